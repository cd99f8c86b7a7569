"""What happens after a pipeline step is traced: gathering, summarising and drawing its events.

The recorder (``_recorder``) records one rank's events: dicts (``rank, cat, name, stage, mb, start, end``, ``args``
for comm) with times in microseconds from a common origin. :func:`gather_events` brings every rank's events to
rank 0, which can write :func:`write_chrome_trace` (open in https://ui.perfetto.dev or chrome://tracing),
:func:`write_png` (needs matplotlib) and :func:`summarize` (measured bubble fraction, busy time per rank and per
stage). :func:`report` does all of it; :func:`timeline_metrics` flattens a summary for the loggers.
:class:`TimelineOptions` is what ``PipelineStrategy(timeline=...)`` traces and where it writes.

The event vocabulary the recorder shares (``Event``, :data:`COMPUTE_CATS`, the letters of the compute kinds) is
defined here, so this module imports nothing from the recorder. It needs only torch (and matplotlib for the PNG) and
the schedule table (:mod:`lightning_pipe.schedules`, no imports of its own).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist

from lightning_pipe.schedules import textbook_bubble_fraction

#: Event categories that count as busy (compute) time. ``comm`` and ``step`` do not.
COMPUTE_CATS = ("forward", "loss", "backward", "backward_input", "backward_weight")
_LETTER = {"forward": "F", "loss": "L", "backward": "B", "backward_input": "I", "backward_weight": "W"}
_COLOURS = {
    "forward": "#4c72b0",
    "loss": "#8c8c8c",
    "backward": "#55a868",
    "backward_input": "#8fd19e",
    "backward_weight": "#dd8452",
    "comm": "#c44e52",
    "collective": "#8172b3",
}
#: Events outside the schedule's span: gradient reductions over the replicas and ties (after it, today).
_AFTER_CATS = ("step", "collective")

Event = dict[str, Any]


def gather_events(
    events: Sequence[Event], group: Optional[dist.ProcessGroup] = None, dst: int = 0
) -> Optional[list[Event]]:
    """Every rank's events, on rank ``dst`` of ``group`` (sorted by rank, then start); ``None`` on the others.

    A collective: call it on every rank of ``group``. Without an initialised process group, returns ``events``."""
    if not (dist.is_available() and dist.is_initialized()):
        return sorted(events, key=_order)
    rank = dist.get_rank(group)
    box: Optional[list[Optional[list[Event]]]] = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(list(events), box, group=group, group_dst=dst)
    if box is None:
        return None
    return sorted((e for part in box for e in (part or ())), key=_order)


def _order(event: Event) -> tuple:
    return (event["rank"], event["start"], event["end"])


def summarize(all_events: Iterable[Event], num_ranks: int) -> dict[str, Any]:
    """Measured bubble and busy times of one traced step.

    ``span_s``: from the first recorded forward/backward/transfer on any rank to the last one ends, in seconds.
    ``busy_s[rank]``: time that rank spent computing (forwards, losses, backwards; overlaps counted once).
    ``stage_busy_s[stage]``: compute time per stage. ``comm_s[rank]``: time in posting and waiting for transfers.
    ``collective_s[rank]``: time in gradient reductions over the replicas and ties (not in ``span_s``).
    ``sent_bytes[rank]``: the bytes that rank sent to other stages (activations and gradients; with sequence
    parallelism each tensor rank sends its own sequence shard, ``1 / tensor_parallel_size`` of the activation).
    ``bubble_fraction = 1 - sum(busy_s) / (num_ranks * span_s)``: the share of the pipeline's rank-time not spent
    computing (waiting, transferring, and schedule overhead), to compare with ``ideal_bubble_fraction``.
    ``step_s``: the longest whole traced step on any rank (from its origin to the end of ``schedule.step``,
    including splitting the batch and, on a schedule's first step, its set-up). ``num_stages`` and
    ``num_microbatches``: how many distinct stages and microbatches ran a forward.
    """
    events = list(all_events)
    timed = [e for e in events if e["cat"] not in _AFTER_CATS]
    if not timed:
        raise ValueError("No pipeline events to summarize: was a step traced?")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}.")
    t0 = min(e["start"] for e in timed)
    t1 = max(e["end"] for e in timed)
    span = max(t1 - t0, 1e-9)
    busy = {r: 0.0 for r in range(num_ranks)}
    comm = {r: 0.0 for r in range(num_ranks)}
    collective = {r: 0.0 for r in range(num_ranks)}
    for r in range(num_ranks):
        collective[r] = _union([e for e in events if e["cat"] == "collective" and int(e["rank"]) == r]) / 1e6
    by_rank: dict[int, list[Event]] = {}
    for e in timed:
        by_rank.setdefault(int(e["rank"]), []).append(e)
    for rank, rank_events in by_rank.items():
        busy[rank] = _union([e for e in rank_events if e["cat"] in COMPUTE_CATS]) / 1e6
        comm[rank] = _union([e for e in rank_events if e["cat"] == "comm"]) / 1e6
    stage_busy: dict[int, float] = {}
    by_kind = {cat: 0.0 for cat in COMPUTE_CATS}
    for e in timed:
        if e["cat"] in COMPUTE_CATS:
            duration = (e["end"] - e["start"]) / 1e6
            stage_busy[int(e["stage"])] = stage_busy.get(int(e["stage"]), 0.0) + duration
            by_kind[e["cat"]] += duration
    sent = {r: 0 for r in range(num_ranks)}
    for e in timed:
        if e["cat"] == "comm":
            sent[int(e["rank"])] = sent.get(int(e["rank"]), 0) + int(e.get("args", {}).get("send_bytes", 0))
    steps = [e["end"] - e["start"] for e in events if e["cat"] == "step"]
    total_busy = sum(busy.values())
    return {
        "num_ranks": num_ranks,
        "span_s": span / 1e6,
        "step_s": max(steps) / 1e6 if steps else None,
        "bubble_fraction": 1.0 - total_busy / (num_ranks * span / 1e6),
        "busy_s": busy,
        "stage_busy_s": dict(sorted(stage_busy.items())),
        "comm_s": comm,
        "collective_s": collective,
        "sent_bytes": sent,
        "compute_s_by_kind": by_kind,
        "num_events": len(timed),
        "num_stages": len({e["stage"] for e in timed if e["cat"] == "forward"}),
        "num_microbatches": len({e["mb"] for e in timed if e["cat"] == "forward"}),
    }


def _union(events: list[Event]) -> float:
    """Total length (µs) of the union of the events' intervals."""
    total = 0.0
    current_start = current_end = None
    for start, end in sorted((e["start"], e["end"]) for e in events):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def ideal_bubble_fraction(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """The textbook bubble of GPipe/1F1B, ``(p - 1) / (m + p - 1)``, and of interleaved 1F1B with ``v`` stages per
    rank, ``(p - 1) / (v * m + p - 1)``, for equal stage times and free communication (the planner's too:
    :func:`lightning_pipe.schedules.textbook_bubble_fraction`)."""
    return textbook_bubble_fraction(num_ranks, num_microbatches, stages_per_rank)


_COMM_TID = "comm"
_COLLECTIVE_TID = "collective"
_STEP_TID = "step"


def write_chrome_trace(all_events: Iterable[Event], path: Union[str, os.PathLike]) -> None:
    """Write a Chrome/Perfetto trace (``{"traceEvents": [...]}``): one process per rank (``pid`` = rank), one
    thread per stage (``tid`` = stage index) plus ``"comm"`` for transfers and ``"step"`` for the whole step;
    complete (``"ph": "X"``) events in microseconds. Open it in https://ui.perfetto.dev or chrome://tracing."""
    events = list(all_events)
    trace: list[dict[str, Any]] = []
    threads: set[tuple[int, Union[int, str]]] = set()
    for e in events:
        rank = int(e["rank"])
        if e["cat"] == "comm":
            tid: Union[int, str] = _COMM_TID
        elif e["cat"] == "collective":
            tid = _COLLECTIVE_TID
        elif e["cat"] == "step":
            tid = _STEP_TID
        else:
            tid = int(e["stage"])
        threads.add((rank, tid))
        args = {k: e[k] for k in ("stage", "mb") if e.get(k) is not None}
        args.update(e.get("args", {}))
        trace.append(
            {
                "name": e["name"],
                "cat": e["cat"],
                "ph": "X",
                "ts": round(float(e["start"]), 3),
                "dur": round(max(float(e["end"]) - float(e["start"]), 0.0), 3),
                "pid": rank,
                "tid": tid,
                "args": args,
            }
        )
    meta: list[dict[str, Any]] = []
    for rank in sorted({r for r, _ in threads}):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, tid in sorted(threads, key=lambda rt: (rt[0], _thread_order(rt[1]))):
        name = tid if isinstance(tid, str) else f"stage {tid}"
        order = _thread_order(tid)
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": order}})
    trace.sort(key=lambda t: (t["pid"], t["ts"]))
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + trace, "displayTimeUnit": "ms"}, f)


def _thread_order(tid: Union[int, str]) -> int:
    if tid == _STEP_TID:
        return -1
    if tid == _COMM_TID:
        return 1_000_000
    if tid == _COLLECTIVE_TID:
        return 1_000_001
    return int(tid)


def write_png(all_events: Iterable[Event], path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
    """Draw the timeline as a PNG: one row per rank, compute coloured by kind (forward, loss, backward, input and
    weight backward) with microbatch labels, transfers as a thin red strip under each row, gradient reductions as a
    purple one above it. Needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "Writing the pipeline timeline as a PNG needs matplotlib: `pip install matplotlib` (the Chrome trace"
            " JSON from `write_chrome_trace` needs nothing)."
        ) from err

    events = [e for e in all_events if e["cat"] != "step"]
    if not events:
        raise ValueError("No pipeline events to draw: was a step traced?")
    ranks = sorted({int(e["rank"]) for e in events})
    t0 = min(e["start"] for e in events)
    span_ms = max(max(e["end"] for e in events) - t0, 1e-6) / 1000.0
    stages_of = {r: {int(e["stage"]) for e in events if e["rank"] == r and e["cat"] in COMPUTE_CATS} for r in ranks}
    # The Agg canvas directly, not pyplot: no global backend is chosen or changed, no window can open.
    fig = Figure(figsize=(12, 1.0 + 0.9 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        multi = len(stages_of[rank]) > 1
        for e in events:
            if e["rank"] != rank:
                continue
            start = (e["start"] - t0) / 1000.0
            width = (e["end"] - e["start"]) / 1000.0
            if e["cat"] in ("comm", "collective"):
                low = y - 0.42 if e["cat"] == "comm" else y + 0.40
                ax.broken_barh([(start, width)], (low, 0.12), facecolors=_COLOURS[e["cat"]], linewidth=0)
                continue
            ax.broken_barh(
                [(start, width)], (y - 0.28, 0.66), facecolors=_COLOURS[e["cat"]], edgecolors="white", linewidth=0.4
            )
            if width > span_ms * 0.012:
                text = f"{_LETTER[e['cat']]}{e['mb']}" + (f"\ns{e['stage']}" if multi else "")
                ax.text(start + width / 2, y + 0.05, text, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    present = {e["cat"] for e in events}
    legend = [Patch(color=_COLOURS[c], label=c.replace("_", " ")) for c in (*COMPUTE_CATS, "comm", "collective")
              if c in present]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 4 else -0.12), ncol=6,
              fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@dataclass(frozen=True)
class TimelineOptions:
    """What ``PipelineStrategy(timeline=...)`` traces and where it writes.

    Args:
        step: the ``trainer.global_step`` whose first training batch is traced. The default 1 skips step 0, which
            also sets the schedule up (first transfers, buffers).
        dirpath: where rank 0 writes ``timeline.json`` and ``timeline.png``; default the Trainer's ``log_dir``.
        png: also draw ``timeline.png`` (needs matplotlib; skipped with a warning without it).
    """

    step: int = 1
    dirpath: Optional[str] = None
    png: bool = True

    @classmethod
    def resolve(
        cls, value: Union[None, bool, int, str, os.PathLike, dict, TimelineOptions]
    ) -> Optional["TimelineOptions"]:
        """``None``/``False``: off. ``True``: defaults. An int: that step. A path string: that directory. A dict:
        the fields. A ``TimelineOptions``: itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            options = value
        elif isinstance(value, int):
            options = cls(step=value)
        elif isinstance(value, (str, os.PathLike)):
            options = cls(dirpath=os.fspath(value))
        elif isinstance(value, dict):
            unknown = set(value) - {"step", "dirpath", "png"}
            if unknown:
                raise ValueError(f"`timeline={value!r}` has unknown keys {sorted(unknown)}; use step, dirpath, png.")
            options = cls(**value)
        else:
            raise ValueError(
                f"`timeline={value!r}` is not understood. Pass True, a step number, a directory, a dict with"
                " step/dirpath/png, or a `TimelineOptions`."
            )
        if isinstance(options.step, bool) or not isinstance(options.step, int) or options.step < 0:
            raise ValueError(f"`timeline` step must be a non-negative integer, got {options.step!r}.")
        return options


def report(
    events: Sequence[Event],
    group: Optional[dist.ProcessGroup] = None,
    dirpath: Optional[Union[str, os.PathLike]] = None,
    write: bool = True,
    png: bool = True,
    title: Optional[str] = None,
) -> Optional[dict[str, Any]]:
    """Gather ``events`` to rank 0 of ``group``; there, summarize them and, when ``write`` and ``dirpath`` are
    given, write ``timeline.json`` (and ``timeline.png`` when ``png`` and matplotlib is installed). Returns the
    summary (with the written ``files``) on rank 0 and ``None`` elsewhere. A collective over ``group``."""
    all_events = gather_events(events, group)
    if all_events is None:
        return None
    num_ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    summary = summarize(all_events, num_ranks)
    files: list[str] = []
    if write and dirpath is not None:
        os.makedirs(dirpath, exist_ok=True)
        json_path = os.path.join(dirpath, "timeline.json")
        write_chrome_trace(all_events, json_path)
        files.append(json_path)
        if png:
            png_path = os.path.join(dirpath, "timeline.png")
            if title is None:
                title = f"pipeline step: measured bubble {summary['bubble_fraction']:.1%}"
            try:
                write_png(all_events, png_path, title=title)
                files.append(png_path)
            except ImportError as err:
                warnings.warn(f"Skipping timeline.png: {err}", stacklevel=2)
    summary["files"] = files
    return summary


def timeline_metrics(summary: dict[str, Any], prefix: str = "timeline/") -> dict[str, float]:
    """Flat float metrics of a :func:`summarize` result, for ``logger.log_metrics``: the bubble fraction, the
    span, and busy seconds per stage and per rank."""
    metrics = {
        f"{prefix}bubble_fraction": float(summary["bubble_fraction"]),
        f"{prefix}span_s": float(summary["span_s"]),
    }
    for stage, seconds in summary["stage_busy_s"].items():
        metrics[f"{prefix}stage{stage}_busy_s"] = float(seconds)
    for rank, seconds in summary["busy_s"].items():
        metrics[f"{prefix}rank{rank}_busy_s"] = float(seconds)
    return metrics
