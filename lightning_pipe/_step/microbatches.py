"""How many microbatches a batch is split into: the one rule, used by the strategy, the planner and the checks.

:class:`MicrobatchPolicy` is what ``PipelineStrategy(num_microbatches=...)`` means for one pipeline. A fixed count
that does not divide a batch (a ragged last batch) becomes the largest count below it that does
(:func:`largest_divisor_at_most`), so every microbatch has the same size and the mean of microbatch means is the
batch mean. A batch of one sample is one microbatch whatever the count (Lightning's fp8 example trains on batches of
one): it runs, with a warning that the stages cannot overlap. ``"auto"`` is :func:`default_num_microbatches`: a count
that splits the batch evenly, that torch's schedule accepts (:func:`valid_num_microbatches`, which the planner's search
checks too) and whose bubble is under :data:`TARGET_BUBBLE` when the batch is large enough
(:func:`microbatch_target`). :mod:`lightning_pipe.plan` re-exports the functions.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.schedules import Config, ScheduleSpec, schedule_spec

#: Largest bubble ``num_microbatches="auto"`` aims for (reached with ``m >= 4 * p / v``).
TARGET_BUBBLE = 0.2


class MicrobatchPolicy:
    """``PipelineStrategy(num_microbatches=...)`` for a pipeline of ``pipeline_parallel_size`` processes running
    ``stages_per_rank`` stages each with ``schedule``.

    Args:
        num_microbatches: a positive count, or ``"auto"``.
        schedule: the schedule's :class:`~lightning_pipe.schedules.ScheduleSpec`.
        pipeline_parallel_size: processes per pipeline.
        stages_per_rank: stages per process.
    """

    def __init__(
        self,
        num_microbatches: Union[int, str],
        schedule: ScheduleSpec,
        pipeline_parallel_size: int,
        stages_per_rank: int,
    ) -> None:
        self.requested = num_microbatches
        self.schedule = schedule
        self.pipeline_parallel_size = pipeline_parallel_size
        self.stages_per_rank = stages_per_rank

    @classmethod
    def of(cls, config: Config, pipeline_parallel_size: int) -> MicrobatchPolicy:
        """The policy of the configuration the pipeline runs."""
        return cls(config.num_microbatches, config.spec, pipeline_parallel_size, config.stages_per_rank)

    @property
    def nominal(self) -> int:
        """The count for a full batch: the fixed one, or what ``"auto"`` aims for (what setup checks)."""
        if self.requested != "auto":
            return int(self.requested)
        return microbatch_target(self.pipeline_parallel_size, self.stages_per_rank, self.schedule.name)

    def for_batch(self, batch_size: int) -> int:
        """The count for a batch of ``batch_size`` samples (raises for ``"auto"`` when none suits the batch)."""
        if self.requested != "auto":
            return largest_divisor_at_most(batch_size, int(self.requested))
        return default_num_microbatches(
            batch_size, self.pipeline_parallel_size, self.stages_per_rank, self.schedule.name
        )

    def check_batch_size(self, batch_size: Optional[int], split: str) -> None:
        """Raise, naming the fix, when a loader's ``batch_size`` is too small to split."""
        if not isinstance(batch_size, int):
            return
        if batch_size == 1 and self.pipeline_parallel_size * self.stages_per_rank > 1:
            rank_zero_warn(
                f"PipelineStrategy: the {split} batch size is 1, so each batch is one microbatch and the pipeline's"
                " stages run one after the other: they cannot overlap. Raise the batch size (and `num_microbatches`)"
                " for the stages to work at the same time."
            )
            return
        if self.requested == "auto":
            self.for_batch(batch_size)  # raises, naming the fix, when no count suits the batch
            return
        wanted = self.nominal
        if batch_size < wanted:
            raise ValueError(
                f"`PipelineStrategy(num_microbatches={wanted})` splits each batch into {wanted} microbatches, but the"
                f" {split} batch size is {batch_size}. Raise the batch size to at least {wanted}, or lower"
                f" `num_microbatches` to at most {batch_size}."
            )


def largest_divisor_at_most(batch_size: int, num_microbatches: int) -> int:
    """``num_microbatches`` when it divides ``batch_size``, else the largest divisor of ``batch_size`` below it."""
    n = min(num_microbatches, batch_size)
    while batch_size % n:
        n -= 1
    return n


def microbatch_target(pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None) -> int:
    """The microbatch count ``num_microbatches="auto"`` aims for: ``p * ceil(4 / v)``, or 1 when ``p == 1``.

    With ``m = 4p`` (one stage per process) the 1F1B bubble is ``(p-1)/(5p-1) < 20%``; with ``v`` stages per
    process the bubble shrinks by ``v``, so ``m = p * ceil(4/v)`` does as well. A multiple of ``p`` satisfies every
    torch schedule's own constraint (1F1B: ``m >= p``; interleaved: ``m`` a multiple of ``max(1, m // p)``);
    DualPipeV, which needs a microbatch per stage, gets at least ``p * v``.
    """
    check_positive("pipeline_parallel_size", pipeline_parallel_size)
    check_positive("stages_per_rank", stages_per_rank)
    p, v = pipeline_parallel_size, stages_per_rank
    target = 1 if p == 1 else p * math.ceil(4 / v)
    return max(target, _spec(schedule, v).fewest_microbatches(p, v))


def valid_num_microbatches(
    num_microbatches: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> bool:
    """Whether torch's ``schedule`` accepts ``num_microbatches`` for this pipeline.

    ``schedule=None`` checks the constraints of the default schedules: ``m >= p`` for one stage per process
    (1F1B), the interleaved rounds rule for several.
    """
    return num_microbatches >= 1 and _spec(schedule, stages_per_rank).accepts(
        num_microbatches, pipeline_parallel_size, stages_per_rank
    )


def default_num_microbatches(
    batch_size: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> int:
    """The microbatch count of ``PipelineStrategy(num_microbatches="auto")`` for a batch of ``batch_size``.

    The rule: among the divisors of ``batch_size`` that ``schedule`` accepts (see :func:`valid_num_microbatches`),
    the smallest one at least :func:`microbatch_target` (``4p`` for one stage per process, ``2p`` for two: a bubble
    under 20%); if the batch is too small for that, the largest accepted one below it. Every microbatch then has
    the same number of samples, at least one. With ``pipeline_parallel_size == 1`` there is nothing to overlap
    and the answer is 1 (2 for DualPipeV, which needs a microbatch per stage). A batch of one sample is one
    microbatch (the strategy runs it with an all-forward, all-backward schedule, which accepts any count).

    Raises:
        ValueError: if no count works, e.g. a 1F1B batch smaller than the pipeline.
    """
    check_positive("batch_size", batch_size)
    if batch_size == 1:
        return 1
    target = microbatch_target(pipeline_parallel_size, stages_per_rank, schedule)
    accepted = [
        d for d in divisors(batch_size) if valid_num_microbatches(d, pipeline_parallel_size, stages_per_rank, schedule)
    ]
    if not accepted:
        spec = _spec(schedule, stages_per_rank)
        smallest = spec.fewest_microbatches(pipeline_parallel_size, stages_per_rank)
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into microbatches for schedule"
            f" {spec.name!r} on a pipeline of {pipeline_parallel_size} processes: it needs at least {smallest}"
            f" microbatches of one sample or more. Raise the batch size to at least {smallest} (ideally a multiple"
            f" of {target}), or lower `pipeline_parallel_size`."
        )
    above = [d for d in accepted if d >= target]
    return above[0] if above else accepted[-1]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_positive(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive integer (``bool`` is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")



def _spec(schedule: Optional[str], stages_per_rank: int) -> ScheduleSpec:
    return schedule_spec(schedule if schedule is not None else ("1F1B" if stages_per_rank == 1 else "Interleaved1F1B"))
