"""Cutting the LightningModule at setup: checks that it can be pipelined, then the cut itself.

:func:`refuse_unsupported` names what cannot run in a pipeline and how to change it. :func:`analyse` finds the
backbone (:mod:`lightning_pipe._model.backbone`) and learns from one ghost run of the step how the step uses the model
(:mod:`lightning_pipe._model.structure`). Setup then settles the configuration and the stages' bounds
(:mod:`lightning_pipe.partition`, with costs from parameter counts or measured times), and :func:`cut_module` leaves
this rank with only its share of the tensors (:mod:`lightning_pipe._model.cut`). A module cut before (``fit``, then
``validate``) is reused (:func:`reuse_cut`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torchmetrics import Metric

from lightning_pipe._calls.batch import rows_dim
from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.records import Structure
from lightning_pipe._calls.stops import BackboneNotCalledError
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._model.backbone import consecutive_candidates, find_backbone
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.structure import analyze
from lightning_pipe.partition import StageLayout

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

#: The cut of every module split in this process (kept while the module lives; nothing is stored on the module).
_cuts: weakref.WeakKeyDictionary[nn.Module, Cut] = weakref.WeakKeyDictionary()


def refuse_unsupported(
    module: pl.LightningModule, *, fitting: bool, sync_batchnorm: bool, pipeline_parallel_size: int,
    name: str = "PipelineStrategy"
) -> None:
    """Raise, naming the fix, for what a pipeline cannot run. Every rank checks the same module, so every rank
    raises."""
    if fitting and not module.automatic_optimization:
        raise ValueError(
            f"`{name}` runs forward and backward inside the pipeline schedule, so manual optimization"
            " (`self.automatic_optimization = False`) is not supported. Remove it and return the loss from"
            " `training_step`; Lightning then steps the optimizers."
        )
    if sync_batchnorm:
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` is not supported by `{name}`: a BatchNorm layer lives on one stage and"
            " normalises each microbatch, and there is no group to synchronise it over that would match"
            " single-device statistics. Remove `sync_batchnorm=True` (see docs/evaluation.md)."
        )
    synced = [n for n, m in module.named_modules() if isinstance(m, Metric) and m.dist_sync_on_step]
    if synced and pipeline_parallel_size > 1:
        raise ValueError(
            f"`{name}`: the metrics {synced} have `dist_sync_on_step=True`, which syncs every call over all"
            " processes, but only the last stage calls a metric, so the sync would wait forever. Create them with"
            " `dist_sync_on_step=False` (the default); the epoch value is still synced."
        )


@dataclass
class Analysis:
    """What one ghost run of the step on its first batch tells setup before the cut: the running step and the
    arguments Lightning's loop passes it (the batch first), the backbone, and how the step calls it."""

    step: Callable[..., object]
    args: tuple
    backbone: Backbone
    structure: Structure

    def parameter_costs(self, module: nn.Module) -> list[float]:
        """Parameters per block; those outside the blocks count with the block whose stage first reads them (the
        code before block ``r`` runs on its stage), those nothing reads with the last."""
        inside: set[int] = set()
        costs = []
        for i in range(len(self.backbone)):
            params = {id(p): p for p in self.backbone.module(i).parameters()}
            inside.update(params)
            costs.append(float(sum(p.numel() for p in params.values())))
        for p in {id(p): p for p in module.parameters()}.values():
            if id(p) not in inside:
                regions = self.structure.region_params.get(id(p))
                costs[min(min(regions), len(costs) - 1) if regions else -1] += p.numel()
        return costs


def analyse(
    module: nn.Module, backbone_spec: Union[str, list[str]], *, device: torch.device, fitting: bool,
    sample: Callable[[], tuple[Callable[..., object], tuple]],
) -> Analysis:
    """Find the backbone and learn how the step runs it, on the batch ``sample()`` returns with the running step and
    the arguments Lightning's loop passes it on the device."""
    step, args = sample()
    backbone, structure = _backbone_of(module, backbone_spec, step, args, device, fitting=fitting)
    return Analysis(step, args, backbone, structure)


def cut_module(module: nn.Module, analysis: Analysis, layout: StageLayout, *, pipeline_rank: int,
               device: torch.device, schedule: str) -> Cut:
    """Cut ``module`` into ``layout``'s stages (made for ``schedule``), keeping this rank's share of the tensors."""
    cut = Cut(module, analysis.backbone, analysis.structure, layout)
    cut.keep_only(pipeline_rank, device)
    _cuts[module] = cut
    rank_zero_info(f"PipelineStrategy ({schedule}): {layout.describe()}")
    if cut.flow.carries_more_than_hidden():
        rank_zero_info(f"PipelineStrategy: stage boundaries carry {cut.flow.describe()}")
    log.debug("%s", cut.describe(pipeline_rank))
    return cut


def reuse_cut(
    module: nn.Module, previous: Cut, placement: tuple[str, int], *, pipeline_parallel_size: int, pipeline_rank: int,
    device: torch.device, fitting: bool, sample: Callable[[], tuple[Callable[..., object], tuple]],
) -> Cut:
    """A later Trainer call on a module cut before (``fit``, then ``validate``) keeps its cut, for the same pipeline
    (``placement``: the stages' placement and stages per process); cut again for the same layout when it was made
    whole after the last call."""
    layout = previous.layout
    if (layout.pipeline_size, layout.stages_per_rank, layout.style) != (pipeline_parallel_size, placement[1],
                                                                         placement[0]):
        raise ValueError(
            f"The module was already split for another pipeline ({layout.describe()}). Create a new"
            " LightningModule (or load it from a checkpoint) to run it with a different pipeline layout."
        )
    if not previous.split:  # whole again after the last call: cut it for the same layout
        _refuse_reads_elsewhere(module, previous, sample, device, fitting=fitting)
        previous.keep_only(pipeline_rank, device)
    log.debug("pipeline rank %d: reusing the split module: %s", pipeline_rank, layout.describe())
    return previous


def _backbone_of(
    module: nn.Module, spec: Union[str, list[str]], step: Callable[..., object], args: tuple, device: torch.device,
    fitting: bool,
) -> tuple[Backbone, Structure]:
    """The backbone and how the step calls it. With ``backbone="auto"`` and several containers of repeated blocks, all
    of them when the step runs them one after the other, each block's output the next one's input within each
    (torchvision's ``layer1`` .. ``layer4``; an encoder's layers, then a decoder's); else the single container
    ``find_backbone`` picks (or refuses as ambiguous)."""
    candidates = consecutive_candidates(module) if spec == "auto" else None
    if candidates is not None:
        found = _consecutive(module, candidates, step, args, device=device, fitting=fitting)
        if found is not None:
            return found
    tried = {} if candidates is None else _candidates_run(module, candidates, step, args,
                                                          device=device, fitting=fitting)
    recorded = [path for path, found in tried.items() if found is not None and found[1].recorded]
    ran = [path for path in candidates or () if tried.get(path) is not None and path not in recorded]
    if 1 < len(ran) < len(candidates or ()):  # the step runs only some of them (a text-only step, no vision tower)
        found = _consecutive(module, ran, step, args, device=device, fitting=fitting)
        if found is not None:
            return found
    backbone = find_backbone(module, spec, runs=tried or None, recorded=recorded)
    one = tried.get(backbone.paths[0]) if len(backbone.paths) == 1 else None
    structure = one[1] if one is not None else analyze(module, backbone, step, args, device, training=fitting)
    if structure.recorded:
        names = [backbone.blocks[i].name for i in sorted(structure.recorded)]
        raise BackboneCallError(
            f"`PipelineStrategy`: the step records the outputs of the backbone blocks {names[:3]}"
            f"{' ...' if len(names) > 3 else ''} (Hugging Face's hidden states: `output_hidden_states=True`, or a"
            " vision-language model that reads its vision tower's layers, as LLaVA's `vision_feature_layer` does)."
            " A pipeline stage skips the other stages' blocks, so no rank would record them all. Set `backbone=` to"
            " other blocks (a vision-language model's language layers: its vision tower then runs before the"
            " backbone, on the first stage), or do not ask the pipelined blocks for their hidden states."
        )
    if one is not None:
        return one
    rows = container_rows(backbone, structure, args)
    if len(set(rows.values())) > 1:
        held = ", ".join(f"`{path}` {n}" for path, n in rows.items())
        raise BackboneCallError(
            f"`PipelineStrategy(backbone={list(backbone.paths)})`: the containers' hidden states hold different numbers"
            f" of rows ({held}), but a pipeline cuts every stage's hidden state into microbatches by the same rows."
            " The blocks of one of them see the batch's samples in other units (a vision tower's images or patches)."
            " Set `backbone=` to the containers whose hidden state holds the batch's rows (a vision-language model's"
            " language layers); the others then run before the backbone, on the first stage."
        )
    return backbone, structure


def container_rows(backbone: Backbone, structure: Structure, args: tuple) -> dict[str, int]:
    """The rows of each container's hidden state in the analysed call: those of its first block's
    ([Note: sequence-first hidden states])."""
    rows: dict[str, int] = {}
    for block in backbone.blocks:
        shape = structure.hidden_shapes[block.index] if block.index < len(structure.hidden_shapes) else None
        path = backbone.paths[block.container]
        if shape and path not in rows:
            rows[path] = shape[rows_dim(shape, args[:1])]
    return rows


def _consecutive(
    module: nn.Module, paths: list[str], step: Callable[..., object], args: tuple, *, device: torch.device,
    fitting: bool,
) -> Optional[tuple[Backbone, Structure]]:
    """The containers ``paths`` as one backbone, when the step runs them one after the other, each block's output the
    next one's input within each; else None."""
    backbone = find_backbone(module, paths)
    try:
        structure = analyze(module, backbone, step, args, device, training=fitting)
    except BackboneCallError as err:
        log.debug("backbone='auto': %s do not run one after the other (%s)", paths, err)
        return None
    starts = {b.index for b in backbone.blocks if b.key == next(iter(backbone.containers[b.container]._modules))}
    if not all(structure.chained[i] for i in range(len(backbone)) if i not in starts):
        log.debug("backbone='auto': within %s, a block does not take the one before's output", paths)
        return None
    rows = container_rows(backbone, structure, args)
    if len(set(rows.values())) > 1:  # a vision tower's patches, then the language layers' samples
        log.debug("backbone='auto': %s hold different rows (%s)", paths, rows)
        return None
    if structure.recorded:  # LLaVA's vision tower: the step reads its layers' hidden states
        log.debug("backbone='auto': the step records the outputs of blocks %s", sorted(structure.recorded))
        return None
    rank_zero_info(
        f"PipelineStrategy: pipelining {backbone.describe()}, which the step runs one after the other; set"
        " `backbone=` to choose others."
    )
    return backbone, structure


def _candidates_run(
    module: nn.Module, candidates: list[str], step: Callable[..., object], args: tuple, *, device: torch.device,
    fitting: bool,
) -> dict[str, Optional[tuple[Backbone, Structure]]]:
    """``backbone="auto"``: each candidate container the step runs, with how it runs it; a candidate it never calls
    (a vision-language model's vision layers, for a step on text-only rows) is left out, so that auto chooses among
    the containers the step runs. A candidate whose analysis fails otherwise counts as run (without a structure: its
    error is raised again if it is chosen)."""
    found: dict[str, Optional[tuple[Backbone, Structure]]] = {}
    for path in candidates:
        backbone = find_backbone(module, path)
        try:
            found[path] = (backbone, analyze(module, backbone, step, args, device, training=fitting))
        except BackboneNotCalledError:
            log.debug("backbone='auto': the step does not run `%s`", path)
        except BackboneCallError as err:
            log.debug("backbone='auto': `%s`: %s", path, err)
            found[path] = None
    return found


def _refuse_reads_elsewhere(
    module: nn.Module, cut: Cut, sample: Callable[[], tuple[Callable[..., object], tuple]], device: torch.device,
    fitting: bool,
) -> None:
    """A later Trainer call keeps the module's cut, made for the first call's step. Its step may read, outside the
    blocks, a parameter that step never read there (``generate()`` of XLNet reads ``mask_emb`` before the first
    block, which training does not): the stage that runs that code would compute from a ghost. Learned from one ghost
    run of the step on its first batch, on every rank alike; refused naming the parameter. A step that cannot be
    analysed here is left to fail as it runs."""
    try:
        step, args = sample()
        structure = analyze(module, cut.backbone, step, args, device, training=fitting)
    except Exception as err:
        log.debug("the step of this Trainer call could not be analysed against the kept cut: %s", err)
        return
    names = {id(p): name for name, p in module.named_parameters()}
    held: dict[int, frozenset[int]] = {}
    for reg in cut.registrations:  # a tied tensor: the stages of each of its registrations
        held[id(reg.tensor)] = held.get(id(reg.tensor), frozenset()) | reg.stages
    for pid, regions in structure.region_params.items():
        # only the code before and between the blocks: after the backbone, a step that generates runs its next
        # model call's code before the backbone, which the kept cut places by that step's first call
        for region in sorted(r for r in regions if r < len(cut.backbone)):
            stage = cut.region_stage(region)
            if pid in held and stage not in held[pid]:
                where = f"before block {region}"
                raise BackboneCallError(
                    f"`{getattr(step, '__name__', step)}` reads the parameter `{names.get(pid, '?')}` {where}, which"
                    f" stage {stage} runs, but the module was cut for the first Trainer call's step, which does not"
                    f" read it there: it lives on stage(s) {sorted(held[pid])}. `PipelineStrategy` keeps a module's"
                    " cut across Trainer calls. Run this call with a LightningModule that was not cut before (load"
                    " its weights from a checkpoint), or without `PipelineStrategy`."
                )


def previous_cut(module: nn.Module) -> Optional[Cut]:
    """The cut of ``module`` from an earlier ``Trainer`` call (``validate`` after ``fit``), if it was split."""
    return _cuts.get(module)
