"""Building this rank's stage modules: materialising them from the meta device, activation checkpointing, and
data parallelism over replicas.

The modules are the user's own objects (shared with the LightningModule, so ``state_dict`` keeps the original
names); the wrappers exist only in the stage that torch's pipeline runs.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torchmetrics import Metric

from lightning_pipe._backbone import LocalBackbone

Checkpointing = Union[bool, list[str], Callable[[nn.Module], bool]]


def stage_modules(backbone: LocalBackbone, pipeline_rank: int) -> dict[int, nn.Sequential]:
    """``{stage: nn.Sequential}`` of the stages ``pipeline_rank`` runs, over the backbone's own modules."""
    layout = backbone.layout
    return {
        stage: nn.Sequential(OrderedDict((str(i), backbone.module_at(i)) for i in range(*layout.bounds[stage])))
        for stage in layout.rank_stages(pipeline_rank)
    }


# ---------------------------------------------------------------------------------------------- materialising
def init_seed() -> int:
    """The seed of meta-device initialisation: ``seed_everything``'s seed (``PL_GLOBAL_SEED``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def materialize_local(module: nn.Module, backbone: LocalBackbone, device: torch.device) -> None:
    """Allocate and initialise the tensors that are still on the meta device, after the split.

    Backbone module ``i`` is initialised with its ``reset_parameters()`` under the seed ``init_seed() + i``, so
    its weights are the same whatever the pipeline size, and equal to those of an unsplit model materialised
    the same way (:func:`materialize_backbone`). Modules outside the backbone use ``init_seed() + len(backbone)``.
    """
    if not _has_meta(module):
        return
    seed = init_seed()
    missing: set[str] = set()
    for index in backbone.indices:
        _init_seeded(backbone.module_at(index), device, seed + index, missing)
    inside = {id(m) for m in backbone.modules()}
    rest = [m for m in module.modules() if id(m) not in inside and not isinstance(m, Metric) and _has_meta(m, False)]
    with _seeded(device, seed + backbone.num_modules):
        for sub in rest:
            sub.to_empty(device=device, recurse=False)
            _reset(sub, missing)
    if missing:
        raise TypeError(
            f"The model was built on the meta device, but {sorted(missing)} define no `reset_parameters()`, so their"
            " weights cannot be initialised after the split. Add a `reset_parameters()` that initialises the module's"
            " own parameters and buffers, or build the model on a real device."
        )


def materialize_backbone(backbone: nn.Sequential, device: torch.device, seed: Optional[int] = None) -> None:
    """Materialise a whole (unsplit) meta backbone exactly as the pipeline materialises its stages."""
    seed = init_seed() if seed is None else seed
    missing: set[str] = set()
    for index, sub in enumerate(backbone):
        _init_seeded(sub, device, seed + index, missing)
    if missing:
        raise TypeError(f"{sorted(missing)} define no `reset_parameters()`.")


def _init_seeded(sub: nn.Module, device: torch.device, seed: int, missing: set[str]) -> None:
    if not _has_meta(sub):
        return
    with _seeded(device, seed):
        sub.to_empty(device=device)
        for m in sub.modules():
            _reset(m, missing)


def _reset(m: nn.Module, missing: set[str]) -> None:
    if not any(True for _ in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))):
        return
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        reset()
    else:
        missing.add(type(m).__name__)


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block under ``seed``, leaving the caller's random state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        yield


def _has_meta(module: nn.Module, recurse: bool = True) -> bool:
    tensors = itertools.chain(module.parameters(recurse=recurse), module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


# ---------------------------------------------------------------------------------------------- wrapping
class Recompute(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint``: activations are recomputed in backward, not kept."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=False)


def wrap_stage(
    module: nn.Sequential,
    stage: int,
    *,
    backbone: LocalBackbone,
    checkpointing: Checkpointing,
    replica_group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> nn.Module:
    """The module torch's ``PipelineStage`` runs for ``stage``: with activation checkpointing on the selected
    backbone modules and, with several replicas, DistributedDataParallel over the replica group (torch's
    pipelining drives DDP's ``no_sync`` and reduces once per batch). Wrappers are made once per backbone and
    reused when the Trainer sets up again, so DDP never registers its gradient hooks twice."""
    cache = backbone.stage_wrappers
    key = (stage, replica_group is not None, id(checkpointing) if callable(checkpointing) else repr(checkpointing))
    if key in cache:
        return cache[key]
    wrapped: nn.Module = module
    if checkpointing:
        wrapped = nn.Sequential(
            OrderedDict(
                (name, Recompute(child) if _selected(child, checkpointing) else child)
                for name, child in module.named_children()
            )
        )
    if replica_group is not None and any(p.requires_grad for p in wrapped.parameters()):
        wrapped = DistributedDataParallel(
            wrapped, process_group=replica_group, device_ids=[device.index] if device.type == "cuda" else None
        )
    cache[key] = wrapped
    return wrapped


def _selected(module: nn.Module, checkpointing: Checkpointing) -> bool:
    if checkpointing is True:
        return True
    if callable(checkpointing):
        return bool(checkpointing(module))
    return type(module).__name__ in set(checkpointing)
