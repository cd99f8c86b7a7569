"""Cutting the LightningModule at setup: checks that the module can be pipelined, then the split itself.

:func:`refuse_unsupported` names what cannot run in a pipeline and how to change it. :func:`split_backbone`
replaces the user's backbone by this rank's :class:`~lightning_pipe._backbone.LocalBackbone`, with a layout
computed from the modules' parameter counts or, for ``balance="time"``, from their measured times.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torchmetrics import Metric

from lightning_pipe._backbone import LocalBackbone, resolve_backbone
from lightning_pipe.partition import make_layout
from lightning_pipe.schedules import ScheduleSpec

log = logging.getLogger(__name__)

_Balance = Union[str, list[int]]


def refuse_unsupported(
    module: Any, *, fitting: bool, sync_batchnorm: bool, pipeline_parallel_size: int, name: str = "PipelineStrategy"
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


def split_backbone(
    module: nn.Module,
    path: str,
    *,
    pipeline_parallel_size: int,
    stages_per_rank: int,
    pipeline_rank: int,
    schedule: ScheduleSpec,
    balance: _Balance,
    measure: Callable[[nn.Module, str, nn.Sequential], list[float]],
) -> LocalBackbone:
    """Replace the backbone at ``path`` by this rank's stages; a module split before (fit, then validate) is reused.

    ``measure(parent, name, backbone)`` times every backbone module, for ``balance="time"``.
    """
    parent, name, backbone = resolve_backbone(module, path)
    pp, rank, style = pipeline_parallel_size, pipeline_rank, schedule.placement
    if isinstance(backbone, LocalBackbone):
        layout = backbone.layout
        same = (layout.pipeline_size, layout.stages_per_rank, layout.style) == (pp, stages_per_rank, style)
        if not same or backbone.indices != layout.rank_modules(rank):
            raise ValueError(
                f"The backbone was already split for another pipeline ({layout.describe()}). Create a new"
                " LightningModule (or load it from a checkpoint) to run it with a different pipeline layout."
            )
        log.debug("pipeline rank %d: reusing the split backbone: %s", rank, layout.describe())
        return backbone
    inside = {id(p) for p in backbone.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"`PipelineStrategy` trains only the pipelined backbone `{path}`, but these trainable"
            f" parameters are outside it: {outside[:5]}{' ...' if len(outside) > 5 else ''}. Move those modules"
            " into the backbone `nn.Sequential`, or freeze them with `requires_grad_(False)`."
        )
    if balance == "time":
        costs = measure(parent, name, backbone)
    else:
        costs = [sum(p.numel() for p in m.parameters()) for m in backbone]
    layout = make_layout(costs, pp, stages_per_rank, balance, style)
    local = LocalBackbone(backbone, layout.rank_modules(rank), len(backbone))
    local.layout = layout
    del backbone  # the other ranks' modules: on the meta device they were never allocated
    setattr(parent, name, local)
    rank_zero_info(f"PipelineStrategy ({schedule.name}): {layout.describe()}")
    log.debug("pipeline rank %d: split backbone `%s`, keeping modules %s", rank, path, local.indices)
    return local
