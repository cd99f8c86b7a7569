"""The gradients a training step computed, kept aside across Lightning's ``zero_grad`` and synchronised."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._parallel_dims import is_tensor_parallel

if TYPE_CHECKING:
    from lightning_pipe._step.last_backward import ReductionOverlap
    from lightning_pipe._step.sharded import ShardedStages

#: ``span(name)``: a context manager around one collective, to time it.
Span = Callable[[str], ContextManager[None]]


def _no_span(name: str) -> ContextManager[None]:
    return nullcontext()


class Gradients:
    """The gradients a training step computed, kept aside across Lightning's ``zero_grad``.

    Lightning runs ``training_step``, then ``zero_grad``, then ``backward``. The schedule runs backward inside
    ``training_step``, so the gradients it writes would be wiped: they are taken out of ``.grad`` right after the
    schedule (the earlier ``.grad``, accumulated over earlier batches, is put back) and added in ``backward``.

    Args:
        module: this rank's part of the model: its parameters that require gradients now are the trainable ones (a
            callback such as ``BackboneFinetuning`` may change which between steps).
        replica_group: the data-parallel replicas of this rank (``None`` with one): gradients are averaged over it.
        tie_groups: ``(group, parameters)`` for the parameters this rank shares with other ranks of its pipeline
            (tied or reused): their gradients are summed over the group.
        sharding: this rank's FSDP units, when the stages are sharded: their gradients accumulate unsharded during
            the schedule and are reduce-scattered by :meth:`synchronise` ([Note: sharded stages]); the parameters
            outside every unit are averaged as replicated ones.
        tensor_group: this rank's tensor-parallel group, with tensor parallelism: the gradients of the parameters not
            split over it (norms, embeddings, whatever the plan leaves whole) are averaged over it, so that their
            copies stay identical on every tensor rank (each rank computes them, and a biased row-wise layer can
            make them differ in the last bit).
    """

    def __init__(
        self,
        module: nn.Module,
        replica_group: Optional[dist.ProcessGroup] = None,
        tie_groups: Sequence[tuple[dist.ProcessGroup, list[nn.Parameter]]] = (),
        sharding: Optional[ShardedStages] = None,
        tensor_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.module = module
        self.tensor_group = tensor_group
        self.replica_group = replica_group
        self.tie_groups = list(tie_groups)
        self.sharding = sharding
        self._pending: Optional[list[tuple[nn.Parameter, Tensor]]] = None

    def trainable(self) -> list[nn.Parameter]:
        """The parameters that require a gradient now, as the optimizers hold them (sharded ones sharded)."""
        if self.sharding is not None:
            return self.sharding.trainable()
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextmanager
    def computed_aside(self) -> Iterator[None]:
        """Let the block write fresh gradients, then keep them aside and restore the earlier ones; the kept ones are
        synchronised by :meth:`synchronise`."""
        params = self.trainable()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        if self.sharding is not None:
            self.sharding.before_step()
        try:
            yield
        finally:
            self._pending = [(p, p.grad) for p in params if p.grad is not None]
            for p, grad in zip(params, previous):
                p.grad = grad

    def synchronise(
        self, scale: float = 1.0, span: Optional[Span] = None, overlap: Optional[ReductionOverlap] = None
    ) -> None:
        """Multiply the kept gradients by ``scale`` (the step's loss weighting, [Note: token-weighted losses]: one
        replica's own, so before averaging), average them over the replicas and sum tied copies over their ranks."""
        kept = dict(self._pending or ())
        done = overlap.done if overlap is not None else set()
        todo = [grad for p, grad in kept.items() if p not in done]
        if scale != 1.0 and todo:  # a tensor-parallel stage's gradients are DTensors and plain tensors: the local parts
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in todo], scale)
        span = span or _no_span
        if self.replica_group is not None and todo:
            with span("all-reduce over replicas"):
                _all_reduce(todo, self.replica_group, average=True)
        if self.sharding is not None:
            kept.update(self._reduce_sharded(scale, span, overlap.reduced_units if overlap is not None else set()))
        if self.tensor_group is not None:
            whole = [g for g in kept.values() if not _split_over_tensor_ranks(g)]
            if whole:
                with span("all-reduce over tensor ranks"):
                    _all_reduce(whole, self.tensor_group, average=True)
        for group, shared in self.tie_groups:
            # Every copy takes part (the same sizes on every rank); a frozen copy gets its gradient dropped after.
            grads = [_placed_as(kept[p], p) if p in kept else torch.zeros_like(p) for p in shared]
            with span("all-reduce of tied parameters"):
                _all_reduce(grads, group, average=False)
            for p, grad in zip(shared, grads):
                if p.requires_grad:
                    kept[p] = grad
                else:
                    kept.pop(p, None)
        # A DTensor gradient in another layout than its parameter (a sequence-parallel norm's comes back Partial over
        # the tensor ranks on torch 2.14) is reduced to the parameter's layout: the optimizer state follows it.
        self._pending = [(p, _placed_as(grad, p)) for p, grad in kept.items()]

    def _reduce_sharded(self, scale: float, span: Span, skip: set[int]) -> dict[nn.Parameter, Tensor]:
        """Scale and reduce-scatter the units' accumulated gradients; returns the sharded gradients, leaving the
        earlier (accumulated) ``.grad`` in place."""
        assert self.sharding is not None
        params = self.sharding.sharded_params()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self.sharding.reduce(scale, span, skip)
            return {p: p.grad for p in params if p.grad is not None}
        finally:
            for p, grad in zip(params, previous):
                p.grad = grad

    def hand_back(self) -> None:
        """Add the kept gradients to ``.grad`` (called by ``Strategy.backward``, after ``zero_grad``)."""
        pending, self._pending = self._pending, None
        for param, grad in pending or ():
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)

    def discard(self) -> None:
        self._pending = None


def _placed_as(grad: Tensor, param: nn.Parameter) -> Tensor:
    """``grad`` laid out as ``param``: a split embedding's gradient comes back replicated over the tensor ranks, its
    tied head's sharded, and the copies of a tie are summed shard by shard (a local chunk, no communication); a
    ``Partial`` one is reduced over the tensor ranks."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _split_over_tensor_ranks(grad: Tensor) -> bool:
    return isinstance(grad, DTensor) and is_tensor_parallel(grad.device_mesh)


def _all_reduce(tensors: list[Tensor], group: dist.ProcessGroup, average: bool) -> None:
    """Sum (or average) ``tensors`` in place over ``group``, one flat buffer per dtype and device."""
    by_kind: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t  # a shard: the same shard on every rank of a tie group
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    size = dist.get_world_size(group)
    for group_tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
