"""The ``num_microbatches="auto"`` rule of :class:`~lightning_pipe.PipelineStrategy`.

:func:`default_num_microbatches` picks, for one batch size, a microbatch count that splits the batch evenly, that
torch's schedule accepts (:func:`valid_num_microbatches`, which the planner's search checks too) and whose bubble
is under :data:`TARGET_BUBBLE` when the batch is large enough (:func:`microbatch_target`). The strategy imports
these from :mod:`lightning_pipe.plan`, which re-exports them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

_ROUNDS_RULE = ("Interleaved1F1B", "InterleavedZeroBubble")  # torch: m % max(1, m // p) == 0

#: Largest bubble ``num_microbatches="auto"`` aims for (reached with ``m >= 4 * p / v``).
TARGET_BUBBLE = 0.2


def microbatch_target(pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None) -> int:
    """The microbatch count ``num_microbatches="auto"`` aims for: ``p * ceil(4 / v)``, or 1 when ``p == 1``.

    With ``m = 4p`` (one stage per process) the 1F1B bubble is ``(p-1)/(5p-1) < 20%``; with ``v`` stages per
    process the bubble shrinks by ``v``, so ``m = p * ceil(4/v)`` does as well. A multiple of ``p`` satisfies every
    torch schedule's own constraint (1F1B: ``m >= p``; interleaved: ``m`` a multiple of ``max(1, m // p)``);
    DualPipeV, which needs a microbatch per stage, gets at least ``p * v``.
    """
    _check_positive("pipeline_parallel_size", pipeline_parallel_size)
    _check_positive("stages_per_rank", stages_per_rank)
    target = 1 if pipeline_parallel_size == 1 else pipeline_parallel_size * math.ceil(4 / stages_per_rank)
    if schedule == "DualPipeV":
        target = max(target, pipeline_parallel_size * stages_per_rank)
    return target


def valid_num_microbatches(
    num_microbatches: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> bool:
    """Whether torch's ``schedule`` accepts ``num_microbatches`` for this pipeline.

    ``schedule=None`` checks the constraints of the default schedules: ``m >= p`` for one stage per process
    (1F1B), the interleaved rounds rule for several.
    """
    m, p, v = num_microbatches, pipeline_parallel_size, stages_per_rank
    if m < 1:
        return False
    if schedule is None:
        schedule = "1F1B" if v == 1 else "Interleaved1F1B"
    if schedule == "1F1B" and m < p:
        return False
    if schedule == "DualPipeV" and m < p * v:
        return False
    if schedule in _ROUNDS_RULE and m % max(1, m // p):
        return False
    return True


def default_num_microbatches(
    batch_size: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> int:
    """The microbatch count of ``PipelineStrategy(num_microbatches="auto")`` for a batch of ``batch_size``.

    The rule: among the divisors of ``batch_size`` that ``schedule`` accepts (see :func:`valid_num_microbatches`),
    the smallest one at least :func:`microbatch_target` (``4p`` for one stage per process, ``2p`` for two: a bubble
    under 20%); if the batch is too small for that, the largest accepted one below it. Every microbatch then has
    the same number of samples, at least one. With ``pipeline_parallel_size == 1`` there is nothing to overlap
    and the answer is 1 (2 for DualPipeV, which needs a microbatch per stage).

    Raises:
        ValueError: if no count works, e.g. a 1F1B batch smaller than the pipeline.
    """
    _check_positive("batch_size", batch_size)
    target = microbatch_target(pipeline_parallel_size, stages_per_rank, schedule)
    accepted = [
        d for d in _divisors(batch_size) if valid_num_microbatches(d, pipeline_parallel_size, stages_per_rank, schedule)
    ]
    if not accepted:
        smallest = pipeline_parallel_size * (stages_per_rank if schedule == "DualPipeV" else 1)
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into microbatches for schedule"
            f" {schedule or ('1F1B' if stages_per_rank == 1 else 'Interleaved1F1B')!r} on a pipeline of"
            f" {pipeline_parallel_size} processes: it needs at least {smallest} microbatches of one sample or more."
            f" Raise the batch size to at least {smallest} (ideally a multiple of {target}), or lower"
            " `pipeline_parallel_size`."
        )
    above = [d for d in accepted if d >= target]
    return above[0] if above else accepted[-1]


# ---------------------------------------------------------------------------------------------- helpers
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
