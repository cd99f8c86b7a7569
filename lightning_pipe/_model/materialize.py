"""This rank's stages at setup: materialising what it holds from the meta device, and choosing the blocks that run
under activation checkpointing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional, Union

import torch
from torch import nn
from torchmetrics import Metric

from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._lightning.seed import global_seed
from lightning_pipe._model.backbone import find_backbone


# ---------------------------------------------------------------------------------------------- materialising
def materialize(module: nn.Module, device: torch.device, backbone: Union[str, list[str]] = "auto") -> None:
    """Materialise a whole (unsplit) module built on the meta device exactly as the pipeline materialises each
    rank's share of it (:func:`materialize_local`): the reference for a pipelined run started from the meta device."""
    materialize_local(module, find_backbone(module, backbone), device)


def materialize_local(module: nn.Module, backbone: Backbone, device: torch.device) -> None:
    """Allocate and initialise the tensors of ``module`` that are still on the meta device (after the cut: only
    this rank's).

    Backbone block ``i`` is initialised with its modules' ``reset_parameters()`` under the seed
    ``global_seed() + i``, so its weights are the same whatever the pipeline size, and equal to those of an unsplit
    model materialised the same way (:func:`materialize`). The ``k``-th module outside the backbone with tensors of its
    own uses ``global_seed() + len(backbone) + k``. A tensor shared by several modules (a tied head) keeps the value
    the first of them gives it.
    """
    materializer = Materializer(module, backbone, device)
    for index in range(len(backbone)):
        materializer.block(index)
    materializer.rest()


class Materializer:
    """:func:`materialize_local` one block at a time: a sharded stage shards each block right after it is
    initialised, so that no rank ever holds a whole stage (``_model/shard.py``). Call :meth:`block` for blocks in
    increasing order, then :meth:`rest` once."""

    def __init__(self, module: nn.Module, backbone: Backbone, device: torch.device) -> None:
        self.module, self.backbone, self.device = module, backbone, device
        self.seed = global_seed()
        self.missing: set[str] = set()
        self.initialised: set[int] = set()
        self.hf_init = hugging_face_inits(module)

    def block(self, index: int) -> None:
        _init_seeded(
            self.backbone.module(index), self.device, self.seed + index, self.missing, self.initialised,
            hf_init=self.hf_init,
        )

    def rest(self) -> None:
        module, backbone = self.module, self.backbone
        if _has_meta(module):
            inside = {id(m) for i in range(len(backbone)) for m in backbone.module(i).modules()}
            owners = [
                m for m in module.modules() if id(m) not in inside and not isinstance(m, Metric) and _owns_tensors(m)
            ]
            for k, sub in enumerate(owners):
                _init_seeded(sub, self.device, self.seed + len(backbone) + k, self.missing, self.initialised,
                             recurse=False, hf_init=self.hf_init)
        if self.missing:
            raise TypeError(
                f"The model was built on the meta device, but {sorted(self.missing)} define no `reset_parameters()`,"
                " so their weights cannot be initialised after the split. Add a `reset_parameters()` that initialises"
                " the module's own parameters and buffers, or build the model on a real device."
            )


def _init_seeded(
    sub: nn.Module, device: torch.device, seed: int, missing: set[str], initialised: set[int], recurse: bool = True,
    hf_init: Optional[dict[int, Callable[[nn.Module], None]]] = None,
) -> None:
    """Initialise ``sub``'s meta tensors under ``seed``; tensors already initialised (shared) keep their values."""
    if not _has_meta(sub, recurse):
        return
    tensors = list(itertools.chain(sub.parameters(recurse=recurse), sub.buffers(recurse=recurse)))
    kept = [(t, t.detach().clone()) for t in tensors if id(t) in initialised]
    hf_init = hf_init or {}
    with _seeded(device, seed):
        _to_empty(sub, device, recurse)
        for m in sub.modules() if recurse else [sub]:
            _reset(m, missing, hf_init)
    with torch.no_grad():
        for tensor, value in kept:
            tensor.copy_(value)
    initialised.update(id(t) for t in tensors)


def _to_empty(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Give every meta parameter and buffer of ``module`` (uninitialised) memory on ``device``, keeping each tensor
    object: unlike ``Module.to_empty``, a parameter shared by two modules (a tied head) stays one parameter."""
    for tensor in itertools.chain(module.parameters(recurse=recurse), module.buffers(recurse=recurse)):
        if tensor.is_meta:
            real = torch.empty_like(tensor, device=device)
            if isinstance(tensor, nn.Parameter):
                real = nn.Parameter(real, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, real)


def _reset(m: nn.Module, missing: set[str], hf_init: dict[int, Callable[[nn.Module], None]]) -> None:
    if not any(True for _ in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))):
        return
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        reset()
    elif id(m) in hf_init:  # a Hugging Face model's module (its rotary tables): the model's own initialisation
        hf_init[id(m)](m)
    else:
        missing.add(type(m).__name__)


def hugging_face_inits(module: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """``{id(submodule): init}``: the ``_init_weights`` of the innermost Hugging Face ``PreTrainedModel`` holding each
    module, which initialises what ``reset_parameters`` does not cover (a rotary embedding's ``inv_freq``)."""
    inits: dict[int, Callable[[nn.Module], None]] = {}
    for model in module.modules():
        init = getattr(model, "_init_weights", None)
        if callable(init) and hasattr(model, "config"):
            for sub in model.modules():
                inits[id(sub)] = init
    return inits


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block under ``seed``, leaving the caller's random state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        yield


def _has_meta(module: nn.Module, recurse: bool = True) -> bool:
    tensors = itertools.chain(module.parameters(recurse=recurse), module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


def _owns_tensors(module: nn.Module) -> bool:
    return any(v is not None for v in itertools.chain(module._parameters.values(), module._buffers.values())) or any(
        isinstance(v, torch.Tensor) for v in vars(module).values()
    )
