"""Replicated stages' gradients all-reduced over the replicas in buckets, while the last backward runs.

A post-accumulate-grad hook on each parameter whose last local use is the stage puts its gradient in a bucket; a
full bucket is weighted and all-reduced asynchronously, as DDP's reducer does. When and why: [Note: overlapped
reductions] (``_step/last_backward.py``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from lightning_pipe.timeline import TimelineRecorder

#: Bytes of gradients per all-reduce (DDP's default ``bucket_cap_mb`` is 25).
BUCKET_BYTES = 25 * 2**20


class ReplicaBuckets:
    """The bucketed, asynchronous all-reduce of one rank's replicated gradients over its replicas.

    :attr:`reduced` holds the parameters whose gradients went into a bucket since :meth:`start`.

    Args:
        final_params: ``{stage: parameters}``: the parameters whose last use on this rank is that stage.
        replica_group: the replicas of this rank (``None`` with one: nothing is reduced).
        bucket_bytes: bytes of gradients per all-reduce.
    """

    def __init__(
        self,
        final_params: dict[int, list[nn.Parameter]],
        replica_group: Optional[dist.ProcessGroup],
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.final_params = final_params
        self.replica_group = replica_group
        self.bucket_bytes = bucket_bytes
        self._buckets: dict[tuple, list[nn.Parameter]] = {}
        self._filled: dict[tuple, int] = {}  # bytes in each bucket
        self._in_flight: list[tuple[list[nn.Parameter], Tensor, dist.Work, Callable[[], None]]] = []
        self.reduced: set[nn.Parameter] = set()

    def start(self) -> None:
        """Before the schedule: forget the last step's parameters."""
        self.reduced = set()

    @contextmanager
    def filling(
        self, stage: int, weight: Callable[[], float], recorder: Optional[TimelineRecorder] = None
    ) -> Iterator[None]:
        """Around the last full backward of ``stage``: bucket each final gradient as autograd completes it, and
        launch the buckets (partly filled ones at the end). ``weight()`` gives the step's loss weight, which
        multiplies each bucket first; with ``recorder``, each all-reduce is traced as a ``collective`` event."""
        handles = []
        if self.replica_group is not None:
            ready = functools.partial(self._ready, weight=weight, recorder=recorder)
            for p in self.final_params.get(stage, []):
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(ready))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for key in list(self._buckets):
                self._launch(key, weight, recorder)

    def _ready(self, param: nn.Parameter, weight: Callable[[], float], recorder: Optional[TimelineRecorder]) -> None:
        assert param.grad is not None
        key = (param.grad.dtype, param.grad.device)
        self._buckets.setdefault(key, []).append(param)
        grad = _local(param.grad)
        self._filled[key] = self._filled.get(key, 0) + grad.numel() * grad.element_size()
        if self._filled[key] >= self.bucket_bytes:
            self._launch(key, weight, recorder)

    def _launch(self, key: tuple, weight: Callable[[], float], recorder: Optional[TimelineRecorder]) -> None:
        bucket = self._buckets.pop(key)
        self._filled.pop(key, None)
        scale = weight()
        flat = torch.cat([_local(p.grad).reshape(-1) for p in bucket])  # a tensor-parallel shard: its own
        if scale != 1.0:
            flat.mul_(scale)
        start = time.perf_counter_ns()
        work = dist.all_reduce(flat, group=self.replica_group, async_op=True)
        completed: list[int] = []
        if recorder is not None:  # the time it completes, not the time the step waits for it
            work.get_future().add_done_callback(lambda _: completed.append(time.perf_counter_ns()))

        def finished() -> None:
            if recorder is not None:
                end = completed[0] if completed else time.perf_counter_ns()
                recorder.add_collective(
                    "all-reduce over replicas (in backward)", start, end, values=sum(p.numel() for p in bucket)
                )

        self._in_flight.append((bucket, flat, work, finished))
        self.reduced.update(bucket)

    def finish(self) -> None:
        """After the schedule: wait for the buckets, copy the averages back into the gradients."""
        size = dist.get_world_size(self.replica_group) if self.replica_group is not None else 1
        for bucket, flat, work, finished in self._in_flight:
            work.wait()
            finished()
            flat /= size
            offset = 0
            for p in bucket:
                assert p.grad is not None
                grad = _local(p.grad)
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._in_flight = []


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
