"""``PipelineStrategy(timeline=...)`` in a Trainer call: which training batch is traced, and its report to the
Trainer's loggers and log directory (the recorder and the summary are the ``timeline`` package's, which needs only
torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe import timeline as _timeline

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pipe._step.shapes import ShapeStats
    from lightning_pipe.partition import StageLayout
    from lightning_pipe.schedules import ScheduleSpec


class StepTimeline:
    """The trace of one training batch of a Trainer call.

    Args:
        options: what to trace and where to write (``PipelineStrategy(timeline=...)``, resolved).
        group: the pipeline's process group (the events are gathered over it).
        device: this rank's device.
    """

    def __init__(self, options: _timeline.TimelineOptions, group: dist.ProcessGroup, device: torch.device) -> None:
        self.options, self.group, self.device = options, group, device
        self._done = False

    def recorder(self, trainer: pl.Trainer) -> Optional[_timeline.TimelineRecorder]:
        """A recorder if this is the batch ``timeline=`` asks for: the first one of that ``global_step``."""
        if self._done or trainer.global_step != self.options.step:
            return None
        self._done = True
        return _timeline.TimelineRecorder(self.group, self.device)

    def report(self, recorder: _timeline.TimelineRecorder, trainer: pl.Trainer, schedule: ScheduleSpec,
               layout: StageLayout, shapes: ShapeStats) -> None:
        """Global rank 0 writes the trace and logs the bubble and busy times. Every rank calls it (collectives)."""
        dirpath = self.options.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir broadcasts
        write = trainer.is_global_zero
        summary = _timeline.report(recorder.events, self.group, dirpath, write=write, png=self.options.png)
        if summary is None or not write:
            return
        metrics = _timeline.timeline_metrics(summary)
        ideal = ""
        if schedule.textbook_bubble:
            value = _timeline.ideal_bubble_fraction(
                layout.pipeline_size, summary["num_microbatches"], layout.stages_per_rank
            )
            metrics["timeline/ideal_bubble_fraction"] = value
            ideal = f" (ideal {value:.1%})"
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"PipelineStrategy timeline of step {trainer.global_step}: measured bubble {summary['bubble_fraction']:.1%}"
            f"{ideal} over {summary['span_s'] * 1e3:.1f} ms; wrote {', '.join(summary['files']) or 'nothing'}."
            f" Microbatch shapes met so far: {shapes.shapes} ({shapes.built} schedules built in"
            f" {shapes.build_seconds * 1e3:.0f} ms, {shapes.evicted} evicted, {shapes.kept} kept)"
        )
