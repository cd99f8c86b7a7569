"""Gradient reductions over the replicas that run while the last microbatch's backward does.

[Note: overlapped reductions]
A stage's gradients are final once its last microbatch's backward has passed them. Instead of reducing everything
after the schedule, each stage's last full backward (``PipelineStage.backward_maybe_with_nosync(...,
last_backward=True)``, see :class:`~lightning_pipe._step.pipeline.ReducingStage`) reduces as it goes:

- replicated stages (``data_parallel="ddp"``): a post-accumulate-grad hook on each parameter whose last local use
  is this stage (autograd calls it once per backward, after summing every use) puts its gradient in a bucket of
  about :data:`BUCKET_BYTES`; a full bucket is flattened, multiplied by the step's loss weight and all-reduced
  asynchronously over the replicas, as DDP's reducer does. The schedule goes on meanwhile;
  :meth:`ReductionOverlap.finish` waits for the buckets after it and copies the averages back.
- sharded stages: the stage's block units reduce-scatter in their own post-backward hooks, as FSDP does in a plain
  backward, after their unsharded gradients are multiplied by the loss weight.

The loss weight ([Note: token-weighted losses]) is each replica's own, so it must multiply the gradients before
the replicas are averaged, and it is known once the last stage computed its last microbatch's loss. The last stage
then sends it to the pipeline's other ranks on a process group of its own (:meth:`ReductionOverlap.share_scale`);
they posted the receive before the schedule and wait for it only in their last backward, which comes after that loss
in every schedule, so the wait costs nothing.

What is reduced after the schedule, as before: zero-bubble schedules (their weight gradients come after the last
``backward_maybe_with_nosync``), the sharded modules outside the backbone (their unit has no hooks, see [Note:
sharded stages]), parameters with no gradient in the last microbatch, and ties over pipeline ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._compat.torch import fsdp_reduce_in_backward, fsdp_sharded_params

if TYPE_CHECKING:
    from lightning_pipe.timeline import TimelineRecorder

#: Bytes of gradients per all-reduce (DDP's default ``bucket_cap_mb`` is 25).
BUCKET_BYTES = 25 * 2**20


class ReductionOverlap:
    """One rank's reductions during the last backward of each of its stages (see [Note: overlapped reductions]).

    After :meth:`finish`, :attr:`done` holds the parameters whose gradients are reduced (and weighted) already, and
    :attr:`reduced_units` the ids of the FSDP units that reduced theirs.

    Args:
        final_params: ``{stage: parameters}``: the parameters whose last use on this rank is that stage (replicated
            stages; empty with one replica).
        stage_units: ``{stage: FSDP units}`` of its blocks (sharded stages).
        replica_group: the replicas of this rank (``None`` with one).
        scale_group: a group over this rank's pipeline that carries the step's loss weight; ``last_rank``: the
            pipeline rank of the last stage in it.
        device: where the weight is received.
    """

    def __init__(
        self,
        final_params: dict[int, list[nn.Parameter]],
        stage_units: dict[int, list[nn.Module]],
        replica_group: Optional[dist.ProcessGroup],
        scale_group: Optional[dist.ProcessGroup],
        last_rank: int,
        device: torch.device,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.final_params = final_params
        self.stage_units = stage_units
        self.replica_group = replica_group
        self.scale_group = scale_group
        self.last_rank = last_rank
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.recorder: Optional[TimelineRecorder] = None
        self._scale: Optional[float] = None
        self._scale_box: Optional[Tensor] = None
        self._scale_work: Any = None
        self._sends: list[Any] = []
        self._buckets: dict[tuple, list[nn.Parameter]] = {}
        self._filled: dict[tuple, int] = {}  # bytes in each bucket
        self._in_flight: list[tuple[list[nn.Parameter], Tensor, Any, Callable[[], None]]] = []
        self.done: set[nn.Parameter] = set()
        self.reduced_units: set[int] = set()

    # ------------------------------------------------------------------------------------------------ the weight
    def start(self, is_last: bool, recorder: Optional[TimelineRecorder] = None) -> None:
        """Before the schedule: forget the last step, and post the receive of this step's loss weight. With
        ``recorder``, the reductions are traced as ``collective`` events."""
        self._scale, self._sends, self.done, self.reduced_units = None, [], set(), set()
        self._scale_work = None
        self.recorder = recorder
        if self.scale_group is not None and not is_last:
            self._scale_box = torch.zeros((), dtype=torch.float64, device=self.device)
            self._scale_work = dist.irecv(self._scale_box, group_src=self.last_rank, group=self.scale_group)

    def share_scale(self, scale: float) -> None:
        """On the last stage, once its last microbatch's loss ran: keep the weight and send it to the others."""
        self._scale = scale
        if self.scale_group is None:
            return
        box = torch.tensor(scale, dtype=torch.float64, device=self.device)
        me = dist.get_rank(self.scale_group)
        for rank in range(dist.get_world_size(self.scale_group)):
            if rank != me:
                self._sends.append(dist.isend(box, group_dst=rank, group=self.scale_group))

    def scale(self) -> float:
        """The step's loss weight, waiting for it on the ranks without the last stage."""
        if self._scale is None:
            assert self._scale_work is not None, "the loss weight was neither computed here nor received"
            self._scale_work.wait()
            assert self._scale_box is not None
            self._scale = float(self._scale_box)
        return self._scale

    # ------------------------------------------------------------------------------------------------ backward
    @contextmanager
    def last_backward(self, stage: int) -> Iterator[None]:
        """Around the last full backward of ``stage``: reduce its final gradients while it runs."""
        handles = []
        units = self.stage_units.get(stage, [])
        restore: list[Callable[[], None]] = []
        for unit in units:
            restore.append(fsdp_reduce_in_backward(unit, self._before_unit_reduce(unit)))
            self.reduced_units.add(id(unit))
            self.done.update(fsdp_sharded_params(unit))
        if self.replica_group is not None:
            for p in self.final_params.get(stage, []):
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._ready))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for undo in restore:
                undo()
            for key in list(self._buckets):
                self._launch(key)

    def _before_unit_reduce(self, unit: nn.Module) -> Callable[[Callable[[], Any]], Any]:
        name = type(unit).__name__.removeprefix("FSDP")

        def around(reduce: Callable[[float], Any]) -> Any:
            scale = self.scale()
            what = f"reduce-scatter {name} (in backward)"
            with self.recorder.collective(what) if self.recorder is not None else nullcontext():
                return reduce(scale)

        return around

    def _ready(self, param: nn.Parameter) -> None:
        assert param.grad is not None
        key = (param.grad.dtype, param.grad.device)
        self._buckets.setdefault(key, []).append(param)
        grad = _local(param.grad)
        self._filled[key] = self._filled.get(key, 0) + grad.numel() * grad.element_size()
        if self._filled[key] >= self.bucket_bytes:
            self._launch(key)

    def _launch(self, key: tuple) -> None:
        bucket = self._buckets.pop(key)
        self._filled.pop(key, None)
        scale = self.scale()
        flat = torch.cat([_local(p.grad).reshape(-1) for p in bucket])  # a tensor-parallel shard: its own
        if scale != 1.0:
            flat.mul_(scale)
        start = time.perf_counter_ns()
        work = dist.all_reduce(flat, group=self.replica_group, async_op=True)
        completed: list[int] = []
        recorder = self.recorder
        if recorder is not None:  # the time it completes, not the time the step waits for it
            work.get_future().add_done_callback(lambda _: completed.append(time.perf_counter_ns()))

        def finished() -> None:
            if recorder is not None:
                end = completed[0] if completed else time.perf_counter_ns()
                recorder.add_collective(
                    "all-reduce over replicas (in backward)", start, end, values=sum(p.numel() for p in bucket)
                )

        self._in_flight.append((bucket, flat, work, finished))
        self.done.update(bucket)

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
        if self._scale_work is not None:
            self.scale()  # every step takes its own weight, also a stage that had nothing to reduce in its backward
        for work in self._sends:
            work.wait()
        self._sends = []


def _local(tensor: Any) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
