"""A measured timeline of one pipeline step: what each rank computed and waited for, and when.

``PipelineStrategy(timeline=...)`` records one training step with :class:`TimelineRecorder` on every rank, then
:func:`report` gathers the events to rank 0, which summarises them (:func:`summarize`: the measured bubble, busy
time per rank and stage) and writes a Perfetto trace (:func:`write_chrome_trace`) and a picture
(:func:`write_png`). The recorder is in ``_recorder``, the rest in ``_report``. Both need only torch (and
matplotlib for the picture), not Lightning.
"""

from lightning_pipe.timeline._recorder import TimelineRecorder
from lightning_pipe.timeline._report import (
    COMPUTE_CATS,
    TimelineOptions,
    gather_events,
    ideal_bubble_fraction,
    report,
    summarize,
    timeline_metrics,
    write_chrome_trace,
    write_png,
)

__all__ = [
    "COMPUTE_CATS",
    "TimelineOptions",
    "TimelineRecorder",
    "gather_events",
    "ideal_bubble_fraction",
    "report",
    "summarize",
    "timeline_metrics",
    "write_chrome_trace",
    "write_png",
]
