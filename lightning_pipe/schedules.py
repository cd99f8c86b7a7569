"""The pipeline schedules ``PipelineStrategy(schedule=...)`` accepts, and what this package knows about each.

Every schedule is torch's own class from ``torch.distributed.pipelining.schedules``; this table holds the facts the
strategy, the microbatch policy, the planner and the timeline need about it, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_pipe.partition import Size

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "Config", "ScheduleSpec", "register_schedules", "schedule_spec"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What the package knows about one ``torch.distributed.pipelining`` schedule.

    Attributes:
        name: the name torch knows it by (``get_schedule_class(name)``).
        multi_stage: runs several stages per process (takes ``stages_per_rank``).
        placement: ``"loop"`` (stage ``s`` on pipeline rank ``s % p``) or ``"v"`` (zig-zag, two stages per process).
        min_microbatches: ``"any"``, ``"per_rank"`` (``m >= p``, 1F1B) or ``"per_stage"`` (``m >= p * v``,
            DualPipeV).
        rounds_rule: torch also needs ``m % max(1, m // p) == 0`` (the interleaved schedules' rounds).
        textbook_bubble: its idle fraction is :func:`textbook_bubble_fraction`, the bubble the timeline compares with.
        planned: the planner's cost model covers it.
        strategy_names: the names it is registered under, for ``Trainer(strategy=...)``.
        splits_backward: runs each backward as an input-gradient and a later weight-gradient action (zero bubble):
            torch cannot split the backward of a compiled block ([Note: compiled blocks]).
    """

    name: str
    multi_stage: bool
    placement: str = "loop"
    min_microbatches: str = "any"
    rounds_rule: bool = False
    textbook_bubble: bool = False
    planned: bool = False
    strategy_names: tuple[str, ...] = ()
    splits_backward: bool = False

    @property
    def fixed_stages_per_rank(self) -> Optional[int]:
        """The only ``stages_per_rank`` it runs with: 1 for single-stage, 2 for V placement, else ``None``."""
        if not self.multi_stage:
            return 1
        return 2 if self.placement == "v" else None

    def default_stages_per_rank(self) -> int:
        return self.fixed_stages_per_rank or 2

    def fewest_microbatches(self, pipeline_parallel_size: int, stages_per_rank: int) -> int:
        """The fewest microbatches torch accepts for this pipeline."""
        if self.min_microbatches == "per_rank":
            return pipeline_parallel_size
        if self.min_microbatches == "per_stage":
            return pipeline_parallel_size * stages_per_rank
        return 1

    def accepts(self, num_microbatches: int, pipeline_parallel_size: int, stages_per_rank: int) -> bool:
        """Whether torch's schedule accepts ``num_microbatches`` for ``p`` processes of ``v`` stages each."""
        m, p = num_microbatches, pipeline_parallel_size
        if m < self.fewest_microbatches(p, stages_per_rank):
            return False
        return not (self.rounds_rule and m % max(1, m // p))


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "1F1B", False, min_microbatches="per_rank", textbook_bubble=True, planned=True,
            strategy_names=("pipeline", "pipeline_1f1b"),
        ),
        ScheduleSpec("GPipe", False, textbook_bubble=True, planned=True, strategy_names=("pipeline_gpipe",)),
        ScheduleSpec(
            "Interleaved1F1B", True, rounds_rule=True, textbook_bubble=True, planned=True,
            strategy_names=("pipeline_interleaved",),
        ),
        ScheduleSpec("LoopedBFS", True),
        ScheduleSpec("InterleavedZeroBubble", True, rounds_rule=True, splits_backward=True),
        ScheduleSpec(
            "ZBVZeroBubble", True, placement="v", strategy_names=("pipeline_zero_bubble",), splits_backward=True
        ),
        ScheduleSpec("DualPipeV", True, placement="v", min_microbatches="per_stage", splits_backward=True),
    )
}

#: Schedules selectable by name, in the order the documentation lists them.
SCHEDULE_NAMES = tuple(SCHEDULES)


def textbook_bubble_fraction(pipeline_parallel_size: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a step of GPipe/1F1B, ``(p - 1) / (m + p - 1)``, and of interleaved 1F1B with ``v``
    stages per process, ``(p - 1) / (v * m + p - 1)``, for equal stage times and free communication: what the planner
    predicts and what the timeline compares its measured bubble with."""
    p, m, v = pipeline_parallel_size, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def schedule_spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for ``name`` (case-insensitive); raises ``ValueError`` naming the choices."""
    canonical = {n.lower(): n for n in SCHEDULES}.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"Unknown `schedule={name!r}`. Choose one of {list(SCHEDULE_NAMES)}.")
    return SCHEDULES[canonical]


@dataclass(frozen=True)
class Config:
    """What the pipeline runs: a schedule (by the name torch knows it by), its stages per process, and the microbatch
    count of a full batch (``"auto"``: the default rule). Setup settles one before the cut, from the explicit arguments
    (``PipelineOptions.config``) or, for ``schedule="auto"``, from the chooser (``_step/auto.py``); the cut and the
    runtime are built from it, and ``spec`` is the one way from its name to the schedule's facts."""

    schedule: str
    stages_per_rank: int
    num_microbatches: Size

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]

    @property
    def placement(self) -> tuple[str, int]:
        """What a cut depends on: the stages' placement (looped or V-shaped) and the stages per process."""
        return self.spec.placement, self.stages_per_rank

    def arguments(self) -> str:
        """The ``PipelineStrategy`` arguments that pin it."""
        return (f"schedule={self.schedule!r}, stages_per_rank={self.stages_per_rank},"
                f" num_microbatches={self.num_microbatches}")

    def record(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "num_microbatches": self.num_microbatches}

    @classmethod
    def from_record(cls, record: Any) -> Optional[Config]:
        """A stored choice, or ``None`` when ``record`` is not one (checkpoints are untrusted input)."""
        if not isinstance(record, dict):
            return None
        name, v, m = record.get("schedule"), record.get("stages_per_rank"), record.get("num_microbatches")
        if name not in SCHEDULE_NAMES or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                 for x in (v, m)):
            return None
        return cls(name, v, m)


def register_schedules(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` under each schedule's strategy names (``Trainer(strategy="pipeline_gpipe")``), once."""
    for spec in SCHEDULES.values():
        description = f"Pipeline parallelism with the {spec.name} schedule"
        for name in spec.strategy_names:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, schedule=spec.name)
