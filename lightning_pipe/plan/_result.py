"""What the planner recommends: :class:`Plan`, one candidate configuration with the cost model's predictions and
the ways to show and run it (``describe``, ``strategy_kwargs``, ``strategy_line``, ``yaml_snippet``), and the byte
sizes the planner reads and prints (:func:`parse_bytes`, :func:`format_bytes`).

The search (``_search``) finds the plans; this module only holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_pipe._bytes import format_bytes
from lightning_pipe.schedules import schedule_spec


@dataclass(frozen=True)
class Plan:
    """One candidate configuration and what the cost model predicts for it.

    Times are in the units of the costs given (e.g. seconds if the costs are seconds per sample, or
    "parameter-samples" when parameter counts stand in for time); only ratios between plans mean something.
    Memory is in bytes per device, or ``None`` when no byte counts were given.

    With ``tensor_parallel_size`` ``T > 1``, each backbone block is split over ``T`` consecutive processes:
    ``stage_costs`` are then what one of them computes per sample (``1/T`` of the block, plus the tensor-parallel
    communication) and ``state_memory`` counts its ``1/T`` of the weights; activations are whole on every process.
    """

    pipeline_parallel_size: int
    data_parallel_size: int
    num_microbatches: int
    schedule: str
    stages_per_rank: int
    balance: tuple[int, ...]
    predicted_bubble: float
    predicted_step_time: float
    predicted_memory_per_device: Optional[float]
    global_batch_size: int = 0
    ideal_step_time: float = 0.0
    stage_costs: tuple[float, ...] = ()
    state_memory: Optional[float] = None
    activation_memory: Optional[float] = None
    fits: bool = True
    tensor_parallel_size: int = 1

    @property
    def devices(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size * self.tensor_parallel_size

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def batch_size_per_replica(self) -> int:
        """The batch each pipeline replica runs: the dataloader ``batch_size`` under ``PipelineStrategy``."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def microbatch_size(self) -> int:
        return self.batch_size_per_replica // self.num_microbatches

    @property
    def efficiency(self) -> float:
        """Ideal step time (perfect scaling, no bubble, no overhead) over the predicted one; 1.0 is perfect."""
        return self.ideal_step_time / self.predicted_step_time if self.predicted_step_time else 1.0

    def strategy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``PipelineStrategy`` that run this plan (``tensor_parallel_size`` only when it is
        more than 1: the strategy's default is none, and a plan without it reads as before)."""
        kwargs: dict[str, Any] = {
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }
        if self.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        kwargs["num_microbatches"] = self.num_microbatches
        kwargs["schedule"] = self.schedule
        if schedule_spec(self.schedule).multi_stage:
            kwargs["stages_per_rank"] = self.stages_per_rank
        kwargs["balance"] = list(self.balance)
        return kwargs

    def strategy_line(self) -> str:
        """The ``PipelineStrategy(...)`` call that runs this plan."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.strategy_kwargs().items())
        return f"PipelineStrategy({args})"

    def yaml_snippet(self) -> str:
        """The LightningCLI config lines that run this plan (the datamodule's ``batch_size`` is per replica)."""
        lines = [
            "trainer:",
            "  strategy:",
            "    class_path: lightning_pipe.PipelineStrategy",
            "    init_args:",
        ]
        for key, value in self.strategy_kwargs().items():
            shown = "[" + ", ".join(str(x) for x in value) + "]" if isinstance(value, list) else str(value)
            if key == "schedule":
                shown = f'"{value}"'
            lines.append(f"      {key}: {shown}")
        lines += [
            "data:",
            "  init_args:",
            f"    batch_size: {self.batch_size_per_replica}"
            f"  # per replica: global batch {self.global_batch_size} / {self.data_parallel_size} replicas",
        ]
        return "\n".join(lines)

    def describe(self) -> str:
        """A few lines a person can read: the layout, the predictions and the ``PipelineStrategy`` call."""
        per_rank = _plural(self.stages_per_rank, "stage")
        micro = _plural(self.num_microbatches, "microbatch", "microbatches")
        tensor = f" x tensor-parallel {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        lines = [
            f"pipeline {self.pipeline_parallel_size} x data-parallel {self.data_parallel_size}{tensor}"
            f" ({self.devices} devices), schedule {self.schedule}, {per_rank} per process",
            f"  {micro} of {_plural(self.microbatch_size, 'sample')} (batch {self.batch_size_per_replica}"
            f" per replica, {self.global_batch_size} global)",
            f"  modules per stage: {list(self.balance)}; slowest stage costs {_num(max(self.stage_costs, default=0))}"
            f" per sample{' per tensor rank' if tensor else ''}"
            f" (stages: {', '.join(_num(c) for c in self.stage_costs)})",
            f"  predicted bubble {self.predicted_bubble:.1%}, step time {_num(self.predicted_step_time)}"
            f" ({self.efficiency:.0%} of ideal scaling)",
        ]
        if self.predicted_memory_per_device is None:
            lines.append("  memory: not estimated (no parameter or activation bytes given)")
        else:
            lines.append(
                f"  memory per device {format_bytes(self.predicted_memory_per_device)}"
                f" (weights, gradients and optimizer state {format_bytes(self.state_memory or 0)},"
                + (
                    " activations not counted)"
                    if self.activation_memory is None
                    else f" activations {format_bytes(self.activation_memory)})"
                )
                + ("" if self.fits else "  OVER BUDGET")
            )
        if self.pipeline_parallel_size == 1 and self.tensor_parallel_size == 1:
            lines.append("  (a pipeline of one process is plain data parallelism: DDP runs it just as well)")
        lines.append(f"  {self.strategy_line()}")
        return "\n".join(lines)


def _plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"
