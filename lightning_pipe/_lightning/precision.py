"""The strategy's precision plugin: the user's plugin, made aware that the model is spread over a pipeline.

Two things differ from one process, where every gradient is local:

- **Clipping by norm.** ``gradient_clip_val`` (with the ``"norm"`` algorithm) must clip by the norm of the whole
  model's gradients. Each rank holds its stages' gradients only: the squared norms are summed over the pipeline
  group (gradients are already identical across data-parallel replicas by then) and every rank clips by the total.
- **Gradient scaling (``precision="16-mixed"``).** ``GradScaler`` skips a step when the gradients overflow, and
  decides from the local gradients only. One stage could skip while the others step, and their loss scales would
  drift apart. After the closure (forward and backward) and before the scaler unscales, every rank learns whether
  any rank's gradients hold an ``inf`` or ``nan``; a rank whose own gradients are finite then marks one of them
  ``inf``, so that its scaler skips the step and lowers the scale exactly as the others do.

:func:`pipeline_precision` returns a copy of the user's plugin whose class is a subclass of the user's class with
these two methods replaced, so Lightning, callbacks and checkpoints still see the class they expect (its
``__qualname__`` is the user's: the plugin's state is saved under the usual key; :mod:`lightning_pipe._subclass`).
The user's own instance is not changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_pipe._subclass import copy_with_mixin

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Optimizable
    from torch.distributed.device_mesh import DeviceMesh


class PipelinePrecision:
    """Mixed into a subclass of the user's precision plugin class by :func:`pipeline_precision`."""

    _pipeline_group: Optional[dist.ProcessGroup] = None
    _counted: Optional[Callable[[nn.Parameter], bool]] = None

    def connect_pipeline(
        self, group: Optional[dist.ProcessGroup], counted: Optional[Callable[[nn.Parameter], bool]] = None
    ) -> None:
        """Clip by the norm over ``group`` (this rank's pipeline); ``counted(p)`` says whether this rank counts the
        gradient of ``p`` in the norm (a parameter held by several stages is counted once)."""
        self._pipeline_group = group
        self._counted = counted

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for p in self.main_params(optimizer) if p.grad is not None]  # type: ignore[attr-defined]
        counted = [p.grad for p in params if self._counted is None or self._counted(p)]
        device = params[0].device if params else _optimizer_device(optimizer)
        total = global_grad_norm(counted, self._pipeline_group, device)
        # As `clip_grads_with_norm_` does, on the local shards of sharded gradients (the norm is the global one).
        coefficient = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        grads = [_local(p.grad) for p in params]
        for kind in {(g.device, g.dtype) for g in grads}:
            same = [g for g in grads if (g.device, g.dtype) == kind]
            torch._foreach_mul_(same, coefficient.to(kind[0]))

    def optimizer_step(
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]

        def closure_then_agree() -> Any:
            result = closure()
            _agree_on_overflow(optimizer)
            return result

        return super().optimizer_step(optimizer, model, closure_then_agree, **kwargs)  # type: ignore[misc]


def pipeline_precision(plugin: Precision) -> Precision:
    """A copy of ``plugin`` with :class:`PipelinePrecision`'s clipping and overflow agreement (``plugin`` itself
    if it already has them)."""
    if isinstance(plugin, PipelinePrecision):
        return plugin
    return copy_with_mixin(plugin, PipelinePrecision)


def global_grad_norm(
    grads: list[torch.Tensor], group: Optional[dist.ProcessGroup], device: torch.device, norm_type: float = 2.0
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of the pipeline, given this rank's share of them."""
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    parts = [torch.nn.utils.get_total_norm(plain, norm_type=norm_type).float()] if plain else []
    by_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
    for g in sharded:  # by mesh: sharded over the replicas, over the tensor ranks, or both
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads_on_mesh in by_mesh.values():  # the norm over every shard: a collective over the mesh
        norm = torch.nn.utils.get_total_norm(grads_on_mesh, norm_type=norm_type)
        parts.append(norm.full_tensor().float().to(device))
    if not parts:
        local = torch.zeros((), dtype=torch.float32, device=device)
    elif len(parts) == 1:
        local = parts[0]
    else:
        local = torch.linalg.vector_norm(torch.stack(parts), ord=norm_type)
    if group is None or dist.get_world_size(group) == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _agree_on_overflow(optimizer: Optimizer) -> None:
    """If any rank's (still scaled) gradients are not finite, make one of this rank's gradients ``inf`` too."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    device = grads[0].device if grads else _optimizer_device(optimizer)
    local = torch.nn.utils.get_total_norm(grads).float() if grads else torch.zeros((), device=device)
    found = (~torch.isfinite(local)).float()
    mine = found.clone()
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if found.item() and not mine.item() and grads:
        grads[0].view(-1)[0] = float("inf")


def _optimizer_device(optimizer: Optimizer) -> torch.device:
    """The device of the optimizer's parameters (CPU when it has none)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
