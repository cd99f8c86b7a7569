"""Where every parameter and buffer of the model lives, and cutting the module so a rank keeps only its share.

A tensor is registered in a module under a name (``registration``); the same tensor may be registered in several
modules (a head tied to the embedding), and a module may sit at several paths (a block reused). Each registration
goes to the stages that use it:

- inside a block: that block's stage (a block reused in several places: each of their stages);
- a parameter outside the blocks: the stages whose code reads it (the code before the backbone runs on the first
  stage, the code between two blocks on the next block's, the code after the backbone on the last); a tensor
  registered under several names (T5's embedding shared by encoder, decoder and head) goes, under each name, where
  its module is called, so it is tied over those stages; a parameter nothing reads stays on the last stage;
- a buffer outside the backbone goes with its module's parameters; one in a module without parameters (rotary
  tables, masks) is on every stage.

A tensor held on several ranks (tied or shared parameters) has its gradients summed over them after each batch, so
the copies stay identical; checkpoints store it once, under its first name. A rank keeps the registrations of its
stages; every other one becomes a ghost attribute (:mod:`lightning_pipe._ghost`): the module tree, its attributes
and the names of what the rank holds are unchanged, and ``state_dict()`` holds exactly this rank's tensors.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.emptied import (
    forget_ghost_parameters,
    lend_ghost_dtype,
    lend_ghost_parameters,
    restore_classes,
)
from lightning_pipe._calls.flow import make_flow
from lightning_pipe._calls.records import Structure
from lightning_pipe._ghost import Ghost, ghost_of
from lightning_pipe._lightning.summary import parameter_counts
from lightning_pipe._model.names import ModelNames
from lightning_pipe.partition import StageLayout

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Registration:
    """A tensor as one module holds it: ``owner.<name>``, at one or more paths."""

    owner: nn.Module
    name: str
    kind: str  # "parameter" or "buffer"
    tensor: Tensor
    paths: list[str] = field(default_factory=list)
    stages: frozenset[int] = frozenset()
    persistent: bool = True
    key: str = ""  # the tensor's first name in the whole model (a checkpoint stores it under it)
    requires_grad: bool = False  # as the whole model had it at the cut

    @property
    def table(self) -> dict:
        return self.owner._parameters if self.kind == "parameter" else self.owner._buffers


class Cut:
    """The placement of every registration of ``module`` for ``layout`` (identical on every rank).

    Args:
        module: the whole LightningModule, before the split.
        backbone: its backbone.
        structure: what the setup learned about its step.
        layout: which blocks each stage holds, and which rank runs it.
    """

    def __init__(self, module: nn.Module, backbone: Backbone, structure: Structure, layout: StageLayout) -> None:
        self.backbone = backbone
        self.structure = structure
        self.layout = layout
        self.last_stage = layout.num_stages - 1
        self.block_stage = [layout.stage_of_block(i) for i in range(len(backbone))]
        self.registrations = _registrations(module)
        self._module = weakref.ref(module)
        self._emptied: list[tuple[nn.Module, type]] = []
        self.names = ModelNames.of(module)
        for reg in self.registrations:
            reg.key = self.names.first_name.get(id(reg.tensor), reg.paths[0])
            reg.requires_grad = reg.tensor.requires_grad
        self.param_counts = parameter_counts(module)  # for ModelSummary: the whole model's
        # What `_model/parallelize.py` applied to this rank's share after the cut (a `StageParallelism`), kept for the
        # strategy's next Trainer call on the module.
        self.parallelism: Any = None
        #: whether the module is cut now (:meth:`keep_only`), or whole again after a Trainer call (:meth:`unsplit`)
        self.split = False
        self._trained_names: dict[int, str] = {}
        _refuse_shared_storage(module)
        self._place(module)
        self.flow = make_flow(structure, layout, [b.name for b in backbone.blocks])

    # ------------------------------------------------------------------------------------------------ placement
    def region_stage(self, region: int) -> int:
        """The stage that runs the code before block ``region`` (after the backbone: the last)."""
        return self.last_stage if region >= len(self.backbone) else self.block_stage[region]

    def _place(self, module: nn.Module) -> None:
        structure = self.structure
        in_blocks: dict[int, set[int]] = {}
        for i in range(len(self.backbone)):
            for sub in self.backbone.module(i).modules():
                in_blocks.setdefault(id(sub), set()).add(self.block_stage[i])
        by_tensor: dict[int, list[Registration]] = {}
        for reg in self.registrations:
            by_tensor.setdefault(id(reg.tensor), []).append(reg)
        for reg in self.registrations:
            if id(reg.owner) in in_blocks:
                reg.stages = frozenset(in_blocks[id(reg.owner)])
            elif reg.kind == "parameter":
                reg.stages = self._outside_stages(reg, by_tensor[id(reg.tensor)])
        for reg in self.registrations:  # buffers outside the blocks follow their module's parameters
            if reg.kind == "buffer" and id(reg.owner) not in in_blocks:
                own = [r.stages for r in self.registrations if r.owner is reg.owner and r.kind == "parameter"]
                reg.stages = own[0] if own else frozenset(range(self.layout.num_stages))
        for pid, regions in structure.region_params.items():  # every stage that reads a parameter holds it
            regs = by_tensor.get(pid, [])
            for stage in sorted({self.region_stage(r) for r in regions}):
                if regs and not any(stage in r.stages for r in regs):
                    for r in regs:
                        r.stages = r.stages | {stage}

    def _outside_stages(self, reg: Registration, same: list[Registration]) -> frozenset[int]:
        """A parameter outside the blocks goes to the stages whose code reads it. A tensor with several names (T5's
        shared embedding, a tied head) goes, under each name, where that name's module is called; a name whose
        module is never called goes with the first other name."""
        calls = self.structure.region_modules
        reads = self.structure.region_params.get(id(reg.tensor), set())
        regions = set(reads)
        if len(same) > 1:
            mine = reads & calls.get(id(reg.owner), set())
            others = set().union(*(reads & calls.get(id(r.owner), set()) for r in same if r is not reg))
            regions = mine or (reads - others)
            if not regions and others:
                first = next(r for r in same if reads & calls.get(id(r.owner), set()))
                regions = {min(reads & calls.get(id(first.owner), set()))}
        if not regions:
            return frozenset({self.last_stage})  # never read: kept with the code after the backbone
        return frozenset(self.region_stage(r) for r in regions)

    # ------------------------------------------------------------------------------------------------ per rank
    def ranks_of(self, reg: Registration) -> frozenset[int]:
        return frozenset(self.layout.stage_rank(s) for s in reg.stages)

    def held(self, rank: int) -> list[Registration]:
        return [r for r in self.registrations if rank in self.ranks_of(r)]

    def ties(self) -> list[tuple[str, frozenset[int], int]]:
        """``(name, pipeline ranks, source rank)`` of every parameter held by several ranks: its gradients are summed
        over them. The source holds its first name in module order, whose module initialises it (see
        ``_stage.materialize_local``)."""
        found: dict[str, tuple[str, frozenset[int], int]] = {}
        for reg in self.registrations:
            if reg.kind != "parameter":
                continue
            source = self.layout.stage_rank(min(reg.stages))
            _, ranks, source = found.get(reg.key, (reg.key, frozenset(), source))
            found[reg.key] = (reg.key, ranks | self.ranks_of(reg), source)
        return [found_tie for found_tie in found.values() if len(found_tie[1]) > 1]

    def window_swaps(self, rank: int) -> dict[Union[int, str], list[tuple[nn.Module, str, str]]]:
        """``{stage or "answer": [(owner, name, kind)]}``: the parameters this rank holds that the code before that
        run's window reads. They are ghosts until the window starts, so a stage does not compute, for real, what an
        earlier stage computes (and sends)."""
        held = [reg for reg in self.held(rank) if reg.kind == "parameter"]
        starts: dict[Union[int, str], int] = {s: self.layout.bounds[s][0] for s in self.layout.rank_stages(rank)}
        starts["answer"] = len(self.backbone)
        swaps = {}
        for key, first in starts.items():
            early = {pid for pid, regions in self.structure.region_params.items() if min(regions) < first}
            swaps[key] = [(reg.owner, reg.name, reg.kind) for reg in held if id(reg.tensor) in early]
        return swaps

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters a stage's module registers (its blocks' and the outside ones it holds): what torch's stage
        computes weight gradients for, frozen or not (a callback may unfreeze them later)."""
        seen: dict[int, nn.Parameter] = {}
        for reg in self.registrations:
            if reg.kind == "parameter" and stage in reg.stages:
                seen.setdefault(id(reg.tensor), reg.tensor)  # type: ignore[arg-type]
        return list(seen.values())

    def replace_parameters(self, new: dict[int, nn.Parameter]) -> None:
        """Point every registration and name at the new parameter objects ``{id(old): new}`` (``fully_shard``
        registers sharded parameters under the old names)."""
        for reg in self.registrations:
            if id(reg.tensor) in new:
                reg.tensor = new[id(reg.tensor)]
        first = {id(new[i]) if i in new else i: name for i, name in self.names.first_name.items()}
        self.names = replace(self.names, first_name=first)
        reads = self.structure.region_params
        for old in [i for i in reads if i in new]:
            reads[id(new[old])] = reads.pop(old)

    @contextmanager
    def parameters_replaced(self, module: nn.Module) -> Iterator[None]:
        """Within the block, ``fully_shard`` or ``parallelize_module`` register new parameter objects under the old
        names: point the cut at them after it (:meth:`replace_parameters`)."""
        before = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if not isinstance(p, Ghost)]
        yield
        after = dict(module.named_parameters(remove_duplicate=False))
        self.replace_parameters({id(p): after[n] for n, p in before if n in after and after[n] is not p})

    def registered_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters a stage's modules register now: with sharded stages, the unsharded ones while unsharded."""
        seen: dict[int, nn.Parameter] = {}
        for reg in self.registrations:
            if reg.kind == "parameter" and stage in reg.stages:
                value = reg.table.get(reg.name)
                if isinstance(value, nn.Parameter) and not isinstance(value, Ghost):
                    seen.setdefault(id(value), value)
        return list(seen.values())

    # ------------------------------------------------------------------------------------------------ the split
    def keep_only(self, rank: int, device: torch.device) -> None:
        """Turn every registration this rank does not hold into a ghost attribute (on ``device``), and let go of the
        tensors it holds under no name (a model built on a real device frees the other ranks' share)."""
        held = self.held(rank)
        held_regs = {id(r) for r in held}
        kept = {reg.key for reg in held}
        stand_ins: dict[str, Tensor] = {}
        for reg in self.registrations:
            if id(reg) in held_regs:
                continue
            value = reg.table.pop(reg.name)
            if reg.kind == "buffer":
                reg.owner._non_persistent_buffers_set.discard(reg.name)
            object.__setattr__(reg.owner, reg.name, ghost_of(value, device, reg.paths[0]))
            if reg.key not in kept:
                if reg.key not in stand_ins:
                    stand_ins[reg.key] = torch.empty_like(value, device="meta")
                reg.tensor = stand_ins[reg.key]
        held_ids = {id(reg.tensor) for reg in held}
        self.names = replace(self.names, first_name={i: n for i, n in self.names.first_name.items() if i in held_ids})
        whole = self._module()
        if whole is not None:  # [Note: emptied models]
            self._emptied = lend_ghost_dtype(whole)
            ghosts = [(r.owner, r.name) for r in self.registrations if r.kind == "parameter" and id(r) not in held_regs]
            lend_ghost_parameters(whole, ghosts, blocks=[self.backbone.module(i) for i in range(len(self.backbone))])
        self.split = True
        log.debug("pipeline rank %d keeps %d of %d tensors", rank, len(held), len(self.registrations))

    def whole_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{state-dict key: (shape, dtype)}`` of the whole model, in the single-device order (the same on every
        rank: a tensor this rank does not hold is read from its ghost, a sharded one by its global shape)."""
        found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for reg in self.registrations:
            if not reg.persistent:
                continue
            value = reg.owner.__dict__.get(reg.name, reg.table.get(reg.name))
            for path in reg.paths:
                found[path] = (tuple(value.shape), value.dtype)
        return {k: found[k] for k in self.names.state_keys if k in found}

    def unsplit(self, module: nn.Module, values: dict[str, Tensor]) -> None:
        """Register every tensor again with its whole value (``{key: value}``, a parameter this rank held kept as the
        object it is), so the module is the whole model once more ([Note: the whole module after a Trainer call]);
        :meth:`keep_only` cuts it again for the same layout."""
        restore_classes(self._emptied)
        forget_ghost_parameters(module)
        params: dict[str, nn.Parameter] = {}
        renamed: dict[int, nn.Parameter] = {}
        for reg in self.registrations:
            value = values[reg.key]
            if reg.kind == "parameter":
                if reg.key not in params:
                    params[reg.key] = value if isinstance(value, nn.Parameter) else nn.Parameter(
                        value, requires_grad=reg.requires_grad
                    )
                value = params[reg.key]
                renamed[id(reg.tensor)] = value  # type: ignore[assignment]
            reg.owner.__dict__.pop(reg.name, None)  # the ghost
            reg.table[reg.name] = value
            if reg.kind == "buffer" and not reg.persistent:
                reg.owner._non_persistent_buffers_set.add(reg.name)
            reg.tensor = value
        reads = self.structure.region_params
        for old in [i for i in reads if i in renamed]:
            reads[id(renamed[old])] = reads.pop(old)
        # The optimizers of every call so far keep their parameters' names: `trainer.save_checkpoint` after the call
        # (or after a later `validate`) names their state by them.
        self._trained_names.update(self.names.first_name)
        self.names = ModelNames.of(module)
        for pid, name in self._trained_names.items():
            self.names.first_name.setdefault(pid, name)
        self.parallelism = None
        self.split = False

    @contextmanager
    def registered_everywhere(self, rank: int) -> Iterator[None]:
        """Register every parameter this rank does not hold again while the block runs: as the parameter itself where
        the rank holds it under another name (a tied head), else as a ghost. ``configure_optimizers`` then builds
        optimizers with the whole model's parameter groups (``self.head.parameters()`` on a rank without the head);
        :func:`drop_ghosts` takes the ghosts out afterwards."""
        held = self.held(rank)
        held_regs = {id(r) for r in held}
        real = {reg.key: reg.tensor for reg in held}
        added: list[Registration] = []
        ghosts: dict[str, Tensor] = {}
        for reg in self.registrations:
            if reg.kind != "parameter" or id(reg) in held_regs or reg.name in reg.table:
                continue
            value = real.get(reg.key)
            if value is None:
                if reg.key not in ghosts:
                    ghosts[reg.key] = ghost_of(reg.owner.__dict__[reg.name]).requires_grad_(reg.requires_grad)
                value = ghosts[reg.key]
            reg.table[reg.name] = value
            added.append(reg)
        try:
            yield
        finally:
            for reg in added:
                reg.table.pop(reg.name, None)

    def convert_ghosts(self, rank: int, convert: Callable[[nn.Module], nn.Module]) -> None:
        """Give the ghosts the dtypes the precision plugin's ``convert`` gives the module's tensors."""
        held = {id(r) for r in self.held(rank)}
        store = nn.Module()
        regs = [r for r in self.registrations if id(r) not in held]
        for k, reg in enumerate(regs):
            ghost = reg.owner.__dict__[reg.name]
            meta = torch.empty_strided(ghost.shape, ghost.stride(), dtype=ghost.dtype, device="meta")
            if reg.kind == "parameter":
                store.register_parameter(f"t{k}", nn.Parameter(meta, requires_grad=False))
            else:
                store.register_buffer(f"t{k}", meta)
        converted = convert(store)
        for k, reg in enumerate(regs):
            meta = getattr(converted, f"t{k}")
            old = reg.owner.__dict__[reg.name]
            object.__setattr__(reg.owner, reg.name, Ghost(meta.detach(), old.device, old._origin))

    def tied_parameter_ids(self, module: nn.Module) -> set[int]:
        """Ids of this rank's parameters that are tied: held by several ranks, or under several names."""
        shared = {name for name, _, _ in self.ties()} | set(self.names.aliases.values())
        return {id(p) for p in module.parameters() if self.names.first_name.get(id(p)) in shared}

    def describe(self, rank: int) -> str:
        held = self.held(rank)
        numel = sum(t.numel() for t in _unique(held))
        return f"pipeline rank {rank} holds {len(held)} tensors ({numel:,} values)"


def connect_ties(
    cut: Cut,
    module: nn.Module,
    mesh: Tensor,
    rank: int,
    groups: dict[tuple[int, ...], dist.ProcessGroup],
    timeout: Optional[timedelta],
) -> list[tuple[dist.ProcessGroup, list[nn.Parameter]]]:
    """A process group for every set of pipeline ranks sharing a parameter (in each replica), with this rank's
    shared parameters; the copies start equal (the first rank's). Every rank creates every group, in order.

    Args:
        cut: the cut, whose :meth:`Cut.ties` say which ranks share which parameter.
        module: the module after the split: this rank's parameters.
        mesh: the global ranks as ``[replica][pipeline rank]`` (``DeviceMesh.mesh``).
        rank: this process's global rank.
        groups: the groups created so far, by their global ranks: reused, and new ones added (a group is created
            once per job, since every rank must create each one).
        timeout: of the groups created.
    """
    by_ranks: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for name, ranks, source in cut.ties():
        by_ranks.setdefault(tuple(sorted(ranks)), []).append((name, source))
    held = {cut.names.first_name[id(p)]: p for p in module.parameters()}
    result = []
    for ranks, shared in sorted(by_ranks.items()):
        for replica in range(mesh.shape[0]):
            members = tuple(int(mesh[replica][r]) for r in ranks)
            if members not in groups:
                groups[members] = dist.new_group(list(members), timeout=timeout)
            if rank in members:
                group = groups[members]
                for name, source in shared:
                    value = held[name].data
                    value = value.to_local() if isinstance(value, DTensor) else value  # sharded alike on each rank
                    dist.broadcast(value, group_src=ranks.index(source), group=group)
                result.append((group, [held[name] for name, _ in shared]))
    log.debug("rank %d: %d tied parameter groups", rank, len(result))
    return result


def _registrations(module: nn.Module) -> list[Registration]:
    found: dict[tuple[int, str, str], Registration] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, value in table.items():
                if value is None or isinstance(value, Ghost):
                    continue
                key = (id(sub), name, kind)
                reg = found.get(key)
                if reg is None:
                    persistent = kind == "parameter" or name not in sub._non_persistent_buffers_set
                    reg = found[key] = Registration(sub, name, kind, value, persistent=persistent)
                reg.paths.append(f"{path}.{name}" if path else name)
    return list(found.values())


def _refuse_shared_storage(module: nn.Module) -> None:
    """Two different parameters over the same memory would be trained as one on one device but as two once the
    stages copy them apart: refuse, naming the fix."""
    seen: dict[tuple, str] = {}
    for name, param in module.named_parameters():
        if param.is_meta or param.numel() == 0:
            continue
        key = (param.untyped_storage().data_ptr(), param.storage_offset(), tuple(param.shape))
        other = seen.get(key)
        if other is not None:
            raise ValueError(
                f"`{other}` and `{name}` are different parameters over the same memory (e.g. one made from the other's"
                " `.data`). On one device they change together; pipeline stages would train them apart. Tie them by"
                f" assigning the same Parameter (`module.b.weight = module.a.weight`)."
            )
        seen[key] = name


def _unique(regs: Iterable[Registration]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for reg in regs:
        seen.setdefault(id(reg.tensor), reg.tensor)
    return list(seen.values())


def drop_ghosts(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Take the ghosts :meth:`Cut.registered_everywhere` gave ``configure_optimizers`` out of the optimizers' groups
    (a group may end up empty: torch steps it as nothing)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            keep = [i for i, p in enumerate(group["params"]) if not isinstance(p, Ghost)]
            if len(keep) == len(group["params"]):
                continue
            group["params"] = [group["params"][i] for i in keep]
            if "param_names" in group:
                group["param_names"] = [group["param_names"][i] for i in keep]
