"""Gradient clipping by the norm of the whole pipelined model."""

from __future__ import annotations

import functools
from typing import Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer


def global_grad_norm(
    grads: list[torch.Tensor], group: dist.ProcessGroup, device: torch.device, norm_type: float = 2.0
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of the pipeline, given this rank's share of them."""
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type=norm_type).float()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    if dist.get_world_size(group) == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)


def use_global_norm_clipping(plugin: Precision, group: dist.ProcessGroup) -> None:
    """Make ``gradient_clip_val`` (by norm) use the norm over the whole model, not over the local stage.

    Lightning clips through ``Precision.clip_grad_by_norm``; the plugin has no pipeline-aware variant, so this
    one instance method is replaced. Gradients are identical across data-parallel replicas by then, so the
    squared norms are summed over the pipeline group only.
    """
    plugin.clip_grad_by_norm = functools.partial(clip_by_global_norm, plugin, group)  # type: ignore[method-assign]


def clip_by_global_norm(
    plugin: Precision, group: dist.ProcessGroup, optimizer: Optimizer, clip_val: Union[int, float]
) -> None:
    """Drop-in for ``Precision.clip_grad_by_norm`` that clips by the norm over every stage of the pipeline."""
    params = [p for p in plugin.main_params(optimizer) if p.grad is not None]
    device = params[0].device if params else plugin_device(optimizer)
    total = global_grad_norm([p.grad for p in params], group, device)
    torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)


def plugin_device(optimizer: Optimizer) -> torch.device:
    """The device of the optimizer's parameters (CPU when it has none)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def agree_on_overflow(plugin: Precision) -> None:
    """With a gradient scaler (``precision="16-mixed"``), make every rank skip or take the step together.

    ``GradScaler.unscale_`` decides from the local gradients only, so one stage could skip the step while the
    others take it, and their loss scales would drift apart. After unscaling, the found-inf flags are combined
    with a MAX over all processes. ``GradScaler`` keeps these flags in a private per-optimizer state; this is
    the one place that reads it.
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or getattr(scaler, "_lightning_pipe_agrees", False):
        return
    unscale = scaler.unscale_

    def unscale_and_agree(optimizer: Optimizer) -> None:
        unscale(optimizer)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flags = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        found = torch.stack([f.float() for f in flags]).amax() if flags else torch.zeros((), device=plugin_device(optimizer))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        for flag in flags:
            flag.copy_(found)

    scaler.unscale_ = unscale_and_agree
    scaler._lightning_pipe_agrees = True
