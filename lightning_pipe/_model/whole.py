"""The module after a ``Trainer`` call: gathered whole on every rank, or kept split behind a loud guard.

[Note: the whole module after a Trainer call]
Under DDP the module a user holds after ``fit`` is the trained model, and the line every Hugging Face script ends with,
``lit.model.save_pretrained("out")`` on global zero, writes it. A cut module holds only this rank's stages (the rest
are ghosts, :mod:`lightning_pipe._ghost`), and ``state_dict()`` skips ghosts: it is how ``save_pretrained`` wrote a
partial file without a word. So, when the call ends and every rank is still in it:

- by default, :func:`make_whole` gathers the model on every rank, in host memory, as under DDP: each tensor is read
  whole where it is held (a sharded or tensor-parallel one with ``full_tensor()`` over its mesh), then broadcast from
  its first holder over the pipeline. The sequence of collectives follows the cut's registrations, which are the same
  on every rank, never what a rank holds. The modules ``parallelize_stage`` changed are put back as they were
  ([Note: undoing a stage's parallelization]), and a later ``Trainer`` call cuts the module again for the same
  layout. The cost: the whole model in every process's host memory, and one broadcast per tensor.
- the bound: the whole model's bytes times the processes on the host must fit in its available memory (every rank
  must agree, so the decision is all-reduced). Past it, or with ``keep_split=True``, the module stays split and
  :class:`SplitGuard` makes every ``state_dict()`` of a module that misses tensors raise :class:`SplitModuleError`,
  which names the parallel save: ``save_pretrained`` (which saves ``state_dict()``, and so skipped the ghosts) then
  fails loudly instead of writing a partial file. During a call the split module's ``state_dict()`` is this rank's
  stage, as Lightning's checkpoints and callbacks read it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._compat.parallel import fsdp_modules_in, restore_modules
from lightning_pipe._ghost import Ghost

if TYPE_CHECKING:
    from lightning_pipe._model.cut import Cut, Registration

log = logging.getLogger(__name__)

SPLIT_HELP = (
    "Save it while the Trainer runs, every rank writing its own stages: `trainer.strategy.save_pretrained(dirpath)` "
    "(or the `HuggingFaceCheckpoint` callback), or convert a training checkpoint with `python -m "
    "lightning_pipe.consolidate CKPT_DIR OUT_DIR --format hf`; or let the strategy gather the module after each call "
    "(`PipelineStrategy(keep_split=False)`, the default, within the host-memory bound in docs/checkpointing.md)."
)


class SplitModuleError(RuntimeError):
    """A read of the whole model from a module that holds only this rank's pipeline stages."""


def model_bytes(cut: Cut) -> int:
    """The whole model's bytes: every tensor once (a tied one once), at the dtype it has now."""
    seen: dict[str, int] = {}
    for reg in cut.registrations:
        value = reg.owner.__dict__.get(reg.name, reg.table.get(reg.name))
        if isinstance(value, Tensor):
            seen.setdefault(reg.key, value.numel() * value.element_size())
    return sum(seen.values())


def host_available_bytes() -> Optional[int]:
    """The host memory available now (``MemAvailable``), or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_on_host(cut: Cut, local_processes: int, device: torch.device) -> tuple[bool, str]:
    """Whether every process of this host can hold the whole model, agreed by every rank; and the figures."""
    need = model_bytes(cut) * local_processes
    available = host_available_bytes()
    fits = available is None or need <= available
    flag = torch.tensor([1 if fits else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    figures = f"{need / 2**30:.2f} GiB for {local_processes} processes"
    if available is not None:
        figures += f" against {available / 2**30:.2f} GiB available on this host"
    return bool(flag.item()), figures


def make_whole(module: nn.Module, cut: Cut, pipeline_group: dist.ProcessGroup, device: torch.device) -> None:
    """Gather ``module`` whole on every rank, in host memory, and undo the stage's parallelization
    ([Note: the whole module after a Trainer call]). Every rank of the job calls it."""
    for unit in fsdp_modules_in(module):
        unit.reshard()  # the registered parameters are the sharded DTensors
    parallelism = cut.parallelism
    for unit in getattr(getattr(parallelism, "sharding", None), "units", []) or []:
        unit.reshard()
    values = _gather(cut, pipeline_group, device)
    snapshot = getattr(parallelism, "snapshot", None)
    if snapshot is not None:
        restore_modules(snapshot)
    cut.unsplit(module, values)
    module.cpu()


def _gather(cut: Cut, group: dist.ProcessGroup, device: torch.device) -> dict[str, Tensor]:
    """``{key: whole value}`` of every tensor of the model, on the CPU: a plain parameter this rank holds is kept as
    the object it is (no copy)."""
    rank = dist.get_rank(group)
    by_key: dict[str, list[Registration]] = {}
    for reg in cut.registrations:
        by_key.setdefault(reg.key, []).append(reg)
    values: dict[str, Tensor] = {}
    for key, regs in by_key.items():
        holders = sorted(set().union(*(cut.ranks_of(r) for r in regs)))
        mine = next((r for r in regs if rank in cut.ranks_of(r)), None)
        local = None
        if mine is not None:
            local = mine.table[mine.name]
            if isinstance(local, DTensor) or isinstance(getattr(local, "data", None), DTensor):
                local = local.full_tensor() if isinstance(local, DTensor) else local.data.full_tensor()
        if len(holders) == dist.get_world_size(group) and mine is not None:
            values[key] = local if isinstance(local, nn.Parameter) else local.detach().cpu()
            continue  # every stage holds it (a buffer of every stage, a parameter on every rank)
        ghost = regs[0].owner.__dict__.get(regs[0].name) if local is None else None
        like = local if local is not None else ghost
        assert like is not None, key
        if rank == holders[0]:
            buffer = local.detach().to(device).contiguous()
        else:
            buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(buffer, group_src=holders[0], group=group)
        if isinstance(local, nn.Parameter) and not isinstance(local, DTensor):
            values[key] = local  # held here: the parameter itself
        else:
            values[key] = buffer.cpu()
    return values


# ---------------------------------------------------------------------------------------------------- the guard
class SplitGuard:
    """While a module stays split after a ``Trainer`` call: ``state_dict()`` of any module that misses some of its
    tensors (the LightningModule, a Hugging Face model inside it, one of its blocks) raises :class:`SplitModuleError`,
    except inside :meth:`reading_local_stage` (the strategy's own saves, which read this rank's stage)."""

    def __init__(self, module: nn.Module) -> None:
        self.open = False
        partial = _modules_with_ghosts(module)
        self.handles = [sub.register_state_dict_pre_hook(self._check) for sub in module.modules() if id(sub) in partial]

    def _check(self, sub: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix or self.open:  # part of a larger state_dict (its root decides), or the strategy's own read
            return
        raise SplitModuleError(
            f"`{type(sub).__name__}.state_dict()` would hold only this rank's pipeline stages: the other stages' "
            f"weights live on other processes, and a save would write a partial model. {SPLIT_HELP}"
        )

    @contextmanager
    def reading_local_stage(self) -> Iterator[None]:
        """Within the block, ``state_dict()`` gives this rank's stage (the strategy's parallel save)."""
        self.open = True
        try:
            yield
        finally:
            self.open = False

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _modules_with_ghosts(module: nn.Module) -> set[int]:
    """Ids of the modules that hold a ghost, and of every module above one."""
    found: set[int] = set()

    def walk(m: nn.Module) -> bool:
        own = any(isinstance(v, Ghost) for v in m.__dict__.values())
        below = [walk(child) for child in m._modules.values() if child is not None]
        if own or any(below):
            found.add(id(m))
            return True
        return False

    walk(module)
    return found


def after_call(
    module: nn.Module, cut: Cut, *, keep_split: bool, local_processes: int, pipeline_group: dist.ProcessGroup,
    device: torch.device,
) -> Optional[SplitGuard]:
    """What the strategy's teardown does with the module ([Note: the whole module after a Trainer call]); returns the
    guard of a module that stays split."""
    if not keep_split:
        fits, figures = fits_on_host(cut, local_processes, device)
        if fits:
            make_whole(module, cut, pipeline_group, device)
            log.debug("the module is whole again: %s", figures)
            return None
        rank_zero_warn(
            f"PipelineStrategy: the module stays split after this call: the whole model needs {figures}. Each rank "
            f"holds its stages; reading the whole model raises. {SPLIT_HELP}"
        )
    return SplitGuard(module)
