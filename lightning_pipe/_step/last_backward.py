"""Gradient reductions over the replicas that run while the last microbatch's backward does.

[Note: overlapped reductions]
A stage's gradients are final once its last microbatch's backward has passed them. Instead of reducing everything
after the schedule, each stage's last full backward (``PipelineStage.backward_maybe_with_nosync(...,
last_backward=True)``, see :class:`~lightning_pipe._step.pipeline.ReducingStage`) reduces as it goes:

- replicated stages (``data_parallel="ddp"``): a post-accumulate-grad hook on each parameter whose last local use
  is this stage (autograd calls it once per backward, after summing every use) puts its gradient in a bucket of
  about :data:`~lightning_pipe._step.replica_buckets.BUCKET_BYTES`; a full bucket is flattened, multiplied by the
  step's loss weight and all-reduced asynchronously over the replicas, as DDP's reducer does. The schedule goes on
  meanwhile; :meth:`ReductionOverlap.finish` waits for the buckets after it and copies the averages back
  (``_step/replica_buckets.py``).
- sharded stages: the stage's block units reduce-scatter in their own post-backward hooks, as FSDP does in a plain
  backward, after their unsharded gradients are multiplied by the loss weight (``_step/unit_reduce_scatter.py``).

The loss weight ([Note: token-weighted losses]) is each replica's own, so it must multiply the gradients before
the replicas are averaged, and it is known once the last stage computed its last microbatch's loss. The last stage
then sends it to the pipeline's other ranks on a process group of its own (:meth:`ReductionOverlap.share_scale`,
``_step/loss_weight_channel.py``); they posted the receive before the schedule and wait for it only in their last
backward, which comes after that loss in every schedule, so the wait costs nothing.

What is reduced after the schedule, as before: zero-bubble schedules (their weight gradients come after the last
``backward_maybe_with_nosync``), the sharded modules outside the backbone (their unit has no hooks, see [Note:
sharded stages]), parameters with no gradient in the last microbatch, and ties over pipeline ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe._step.loss_weight_channel import LossWeightChannel
from lightning_pipe._step.replica_buckets import BUCKET_BYTES, ReplicaBuckets
from lightning_pipe._step.unit_reduce_scatter import UnitReduceScatter

if TYPE_CHECKING:
    from lightning_pipe.timeline import TimelineRecorder


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
        bucket_bytes: bytes of gradients per all-reduce of replicated stages.
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
        self.buckets = ReplicaBuckets(final_params, replica_group, bucket_bytes)
        self.units = UnitReduceScatter(stage_units)
        self.loss_weight = LossWeightChannel(scale_group, last_rank, device)
        self.recorder: Optional[TimelineRecorder] = None

    @property
    def done(self) -> set[nn.Parameter]:
        """The parameters whose gradients this step reduced in a last backward."""
        return self.buckets.reduced | self.units.reduced

    @property
    def reduced_units(self) -> set[int]:
        """The ids of the FSDP units that reduced their gradients in a last backward this step."""
        return self.units.reduced_units

    def start(self, is_last: bool, recorder: Optional[TimelineRecorder] = None) -> None:
        """Before the schedule: forget the last step, and post the receive of this step's loss weight. With
        ``recorder``, the reductions are traced as ``collective`` events."""
        self.buckets.start()
        self.units.start()
        self.loss_weight.expect(is_last)
        self.recorder = recorder

    def share_scale(self, scale: float) -> None:
        """On the last stage, once its last microbatch's loss ran: keep the weight and send it to the others."""
        self.loss_weight.share(scale)

    @contextmanager
    def last_backward(self, stage: int) -> Iterator[None]:
        """Around the last full backward of ``stage``: reduce its final gradients while it runs."""
        weight, recorder = self.loss_weight.weight, self.recorder
        with self.units.reducing(stage, weight, recorder), self.buckets.filling(stage, weight, recorder):
            yield

    def finish(self) -> None:
        """After the schedule: wait for the buckets, copy the averages back into the gradients, and settle the loss
        weight's transfers."""
        self.buckets.finish()
        self.loss_weight.settle()
