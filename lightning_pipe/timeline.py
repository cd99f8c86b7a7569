"""A measured timeline of one pipeline step: what each rank computed and waited for, and when.

:class:`TimelineRecorder` traces ONE training step on this rank. For the duration of
``with recorder.trace(schedule_or_stages):`` it wraps, as instance attributes of the given torch ``PipelineStage``
objects (and of the schedule, for the loss), the methods the schedules call for every microbatch, and the
module-level point-to-point helpers of ``torch.distributed.pipelining.schedules``. Each call becomes one event:

=================  =====================================================  ================
``cat``            what                                                   name
=================  =====================================================  ================
forward            ``PipelineStage.forward_one_chunk``                    ``F3 s1``
loss               the schedule's loss on the last stage                  ``L3 s1``
backward           ``backward_one_chunk(full_backward=True)``             ``B3 s1``
backward_input     ``backward_one_chunk(full_backward=False)`` (ZB)       ``I3 s1``
backward_weight    ``backward_weight_one_chunk`` (zero-bubble schedules)  ``W3 s1``
comm               posting sends/receives (``_batch_p2p``)                ``recv post``
comm               waiting for them (``_wait_batch_p2p``)                 ``recv wait``
step               the whole traced step on this rank                     ``step``
=================  =====================================================  ================

A communication event knows which microbatch and stage it moves because the stage's op getters
(``get_fwd_recv_ops`` ...) are wrapped too: each ``P2POp`` they return is labelled, and a ``Work`` returned for it
carries the label on to its wait. Events are dicts (``rank, cat, name, stage, mb, start, end``, ``args`` for comm)
with times in microseconds from a common origin, so they pickle and serialise as they are. Outside ``trace``
nothing is installed: an untraced step runs exactly torch's code.

Clocks: every rank takes its origin (``time.perf_counter_ns``) right after a barrier on the pipeline group, as the
traced step starts. Ranks leave a barrier at nearly, not exactly, the same moment: the alignment error is the
barrier's exit skew, typically tens of microseconds between processes on one machine and up to a network round
trip (~0.1 ms or more) between machines; clock drift over one step is negligible. Compare event times across ranks
to that precision. On an accelerator the device is synchronised around every compute event and after every wait,
so that host timestamps bracket the device work (this removes compute/communication overlap on that step).

Then :func:`gather_events` brings every rank's events to rank 0, which can write :func:`write_chrome_trace`
(open in https://ui.perfetto.dev or chrome://tracing), :func:`write_png` (needs matplotlib) and
:func:`summarize` (measured bubble fraction, busy time per rank and per stage). :func:`report` does all of it.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

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
}

Event = dict[str, Any]


# ----------------------------------------------------------------------------------------------------------------
# torch private names. EVERY private name of torch this module touches is here (checked against torch 2.13):
#   * ``torch.distributed.pipelining.schedules._batch_p2p(ops, desc=None) -> list[Work]`` posts a batch of P2POps;
#     ``_sorted_batch_p2p`` (GPipe) calls it once per peer through the module global, so wrapping ``_batch_p2p``
#     covers Schedule1F1B, ScheduleGPipe, PipelineScheduleMulti and _PipelineScheduleRuntime (Interleaved1F1B,
#     LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) alike.
#   * ``..._wait_batch_p2p(works)`` waits for them; every schedule waits through it.
#   * a single-stage schedule keeps its stage in ``_stage``, a multi-stage one in ``_stages``.
#   * ``_PipelineSchedule._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs=None)`` runs the
#     loss after each forward of the last stage, and ``_loss_fn`` is the loss function (None: no loss).
# The public stage methods wrapped are ``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``
# and the op getters ``get_{fwd,bwd}_{send,recv}_ops``. If a torch release renames any of these, tracing records
# fewer events (a helper that is missing is skipped) but training is unaffected.
import torch.distributed.pipelining.schedules as _torch_schedules  # noqa: E402

_P2P_POST = "_batch_p2p"
_P2P_WAIT = "_wait_batch_p2p"
_LOSS_METHOD = "_maybe_compute_loss"


def _schedule_stages(schedule: Any) -> Optional[list[Any]]:
    """The stages of a torch schedule object, or None if ``schedule`` is not one."""
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    if hasattr(schedule, "_stage"):
        return [schedule._stage]
    return None


def _schedule_has_loss(schedule: Any) -> bool:
    return getattr(schedule, "_loss_fn", None) is not None


# ----------------------------------------------------------------------------------------------------------------


_STAGE_OPS = {  # getter -> (direction, payload)
    "get_fwd_recv_ops": ("recv", "act"),
    "get_fwd_send_ops": ("send", "act"),
    "get_bwd_recv_ops": ("recv", "grad"),
    "get_bwd_send_ops": ("send", "grad"),
}
_tracing = False  # the module-level helpers are process-wide: one trace at a time


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _device_sync(device: Optional[Union[str, torch.device]]) -> Optional[Callable[[], None]]:
    if device is None:
        return None
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return None
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is None:
        return None
    return lambda: sync(device)


def _barrier(group: Optional[dist.ProcessGroup], device: Optional[Union[str, torch.device]]) -> None:
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and device.index is not None and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


class TimelineRecorder:
    """Records the forwards, backwards and transfers of one pipeline step on this rank.

    Args:
        group: the pipeline's process group (``None``: the default group). The barrier that aligns the clocks runs
            on it, and event ranks are ranks in it.
        device: the device the stages run on; on an accelerator it is synchronised around each event.
        barrier: align the clocks with a barrier before the step (default). Without it each rank's origin is simply
            the moment its step starts.

    After ``with recorder.trace(...)``, :attr:`events` holds this rank's events sorted by start time.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[str, torch.device]] = None,
        barrier: bool = True,
    ) -> None:
        self.group = group
        self.device = device
        self.barrier = barrier
        self.events: list[Event] = []
        self.rank = 0
        self._origin = 0
        self._sync: Optional[Callable[[], None]] = None
        self._op_labels: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._work_labels: dict[int, tuple[Any, list[dict[str, Any]]]] = {}

    # ------------------------------------------------------------------ tracing
    @contextmanager
    def trace(self, target: Any) -> Iterator["TimelineRecorder"]:
        """Trace one step of ``target``: a torch pipeline schedule (its stages and loss are traced), a
        ``PipelineStage`` or a list of them. Everything installed is removed on exit, also on error."""
        global _tracing
        if _tracing:
            raise RuntimeError("A pipeline timeline is already being traced in this process; trace one step at a time.")
        stages = _schedule_stages(target)
        schedule = target if stages is not None else None
        if stages is None:
            stages = list(target) if isinstance(target, (list, tuple)) else [target]
        self.events = []
        self._op_labels.clear()
        self._work_labels.clear()
        self._sync = _device_sync(self.device)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(self.group) if distributed else 0
        restore: list[tuple[Any, str, bool, Any]] = []  # (owner, name, had_instance_attr, previous)

        def install(owner: Any, name: str, wrapper_factory: Callable[[Callable], Callable]) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return  # not in this torch release: skip, record less
            had = name in vars(owner)  # already an instance (or module) attribute: put that back afterwards
            restore.append((owner, name, had, vars(owner).get(name)))
            setattr(owner, name, wrapper_factory(original))

        _tracing = True
        try:
            for stage in stages:
                index = int(stage.stage_index)
                install(stage, "forward_one_chunk", lambda f, s=index: self._wrap_forward(f, s))
                install(stage, "backward_one_chunk", lambda f, s=index: self._wrap_backward(f, s))
                install(stage, "backward_weight_one_chunk", lambda f, s=index: self._wrap_weight(f, s))
                for getter, (direction, payload) in _STAGE_OPS.items():
                    install(stage, getter, lambda f, s=index, d=direction, p=payload: self._wrap_getter(f, s, d, p))
            if schedule is not None and _schedule_has_loss(schedule):
                install(schedule, _LOSS_METHOD, self._wrap_loss)
            install(_torch_schedules, _P2P_POST, self._wrap_post)
            install(_torch_schedules, _P2P_WAIT, self._wrap_wait)
            if distributed and self.barrier:
                _barrier(self.group, self.device)
            self._origin = time.perf_counter_ns()
            try:
                yield self
            finally:
                end = time.perf_counter_ns()
                self._add("step", "step", None, None, self._origin, end)
        finally:
            for owner, name, had, previous in reversed(restore):
                if had:
                    setattr(owner, name, previous)
                else:
                    delattr(owner, name)
            _tracing = False
            self._op_labels.clear()
            self._work_labels.clear()
            self.events.sort(key=lambda e: (e["start"], e["end"]))

    # ------------------------------------------------------------------ wrappers
    def _add(self, cat: str, name: str, stage: Optional[int], mb: Optional[int], t0: int, t1: int, **args: Any) -> None:
        event: Event = {
            "rank": self.rank,
            "cat": cat,
            "name": name,
            "stage": stage,
            "mb": mb,
            "start": (t0 - self._origin) / 1000.0,
            "end": (t1 - self._origin) / 1000.0,
        }
        if args:
            event["args"] = args
        self.events.append(event)

    def _timed_compute(self, cat: str, stage: int, mb: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
        sync = self._sync
        if sync is not None:
            sync()
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync is not None:
                sync()
            t1 = time.perf_counter_ns()
            mb = int(mb) if mb is not None else None
            self._add(cat, f"{_LETTER[cat]}{mb} s{stage}", stage, mb, t0, t1)

    def _wrap_forward(self, fn: Callable, stage: int) -> Callable:
        def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            mb = _arg(args, kwargs, 0, "fwd_chunk_id")
            return self._timed_compute("forward", stage, mb, fn, args, kwargs)

        return forward_one_chunk

    def _wrap_backward(self, fn: Callable, stage: int) -> Callable:
        def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            mb = _arg(args, kwargs, 0, "bwd_chunk_id")
            full = _arg(args, kwargs, 2, "full_backward", True)
            return self._timed_compute("backward" if full else "backward_input", stage, mb, fn, args, kwargs)

        return backward_one_chunk

    def _wrap_weight(self, fn: Callable, stage: int) -> Callable:
        def backward_weight_one_chunk(*args: Any, **kwargs: Any) -> Any:
            mb = _arg(args, kwargs, 0, "bwd_chunk_id")
            return self._timed_compute("backward_weight", stage, mb, fn, args, kwargs)

        return backward_weight_one_chunk

    def _wrap_loss(self, fn: Callable) -> Callable:
        def maybe_compute_loss(*args: Any, **kwargs: Any) -> Any:
            stage = _arg(args, kwargs, 0, "stage")
            if not getattr(stage, "is_last", False):
                return fn(*args, **kwargs)
            mb = _arg(args, kwargs, 3, "mb_index")
            return self._timed_compute("loss", int(stage.stage_index), mb, fn, args, kwargs)

        return maybe_compute_loss

    def _wrap_getter(self, fn: Callable, stage: int, direction: str, payload: str) -> Callable:
        def get_ops(*args: Any, **kwargs: Any) -> Any:
            ops = fn(*args, **kwargs)
            mb = args[0] if args else next(iter(kwargs.values()), None)  # fwd_chunk_id / bwd_chunk_id
            if mb is None:
                return ops
            for op in ops:
                peer = getattr(op, "peer", None)
                label = {"dir": direction, "what": payload, "stage": stage, "mb": int(mb), "peer": peer}
                self._op_labels[id(op)] = (op, label)  # the op is kept alive, so its id is not reused
            return ops

        return get_ops

    def _wrap_post(self, fn: Callable) -> Callable:
        def batch_p2p(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
            if not p2p_ops:
                return fn(p2p_ops, *args, **kwargs)
            t0 = time.perf_counter_ns()
            works = fn(p2p_ops, *args, **kwargs)
            t1 = time.perf_counter_ns()
            labels = [self._label_of(op) for op in p2p_ops]
            works_list = list(works) if works else []
            for i, work in enumerate(works_list):
                mine = [labels[i]] if len(works_list) == len(labels) else labels
                self._work_labels[id(work)] = (work, mine)
            self._add_comm("post", labels, t0, t1)
            return works

        return batch_p2p

    def _wrap_wait(self, fn: Callable) -> Callable:
        def wait_batch_p2p(work: Any, *args: Any, **kwargs: Any) -> Any:
            works = list(work) if work else []
            if not works:
                return fn(work, *args, **kwargs)
            t0 = time.perf_counter_ns()
            result = fn(work, *args, **kwargs)
            if self._sync is not None:
                self._sync()
            t1 = time.perf_counter_ns()
            labels: list[dict[str, Any]] = []
            for w in works:
                for label in self._work_labels.get(id(w), (None, [{"dir": "p2p"}]))[1]:
                    if label not in labels:
                        labels.append(label)
            self._add_comm("wait", labels, t0, t1)
            return result

        return wait_batch_p2p

    def _label_of(self, op: Any) -> dict[str, Any]:
        known = self._op_labels.get(id(op))
        if known is not None:
            return known[1]
        name = getattr(getattr(op, "op", None), "__name__", "")
        direction = "send" if "send" in name else "recv" if "recv" in name else "p2p"
        return {"dir": direction, "peer": getattr(op, "peer", None)}

    def _add_comm(self, phase: str, labels: list[dict[str, Any]], t0: int, t1: int) -> None:
        directions = {label["dir"] for label in labels}
        kind = directions.pop() if len(directions) == 1 else "send/recv"
        # The microbatch a transfer belongs to: the received one if any (that is what a wait blocks on).
        primary = [label for label in labels if label["dir"] == "recv" and "mb" in label] or [
            label for label in labels if "mb" in label
        ]
        stages = {label["stage"] for label in primary}
        pairs = {(label["stage"], label["mb"]) for label in primary}
        stage = stages.pop() if len(stages) == 1 else None
        mb = next(iter(pairs))[1] if len(pairs) == 1 else None
        self._add("comm", f"{kind} {phase}", stage, mb, t0, t1, ops=[_describe(label) for label in labels])


def _describe(label: dict[str, Any]) -> str:
    if "mb" not in label:
        peer = label.get("peer")
        return f"{label['dir']}" + (f" rank {peer}" if peer is not None else "")
    arrow = "from" if label["dir"] == "recv" else "to"
    return f"{label['dir']} {label['what']} mb{label['mb']} s{label['stage']} {arrow} rank {label['peer']}"


# ----------------------------------------------------------------------------------------------------------------
# gathering and reporting


def gather_events(
    events: Sequence[Event], group: Optional[dist.ProcessGroup] = None, dst: int = 0
) -> Optional[list[Event]]:
    """Every rank's events, on rank ``dst`` of ``group`` (sorted by rank, then start); ``None`` on the others.

    A collective: call it on every rank of ``group``. Without an initialised process group, returns ``events``."""
    if not (dist.is_available() and dist.is_initialized()):
        return sorted(events, key=_order)
    rank = dist.get_rank(group)
    box: Optional[list[Any]] = [None] * dist.get_world_size(group) if rank == dst else None
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
    ``bubble_fraction = 1 - sum(busy_s) / (num_ranks * span_s)``: the share of the pipeline's rank-time not spent
    computing (waiting, transferring, and schedule overhead), to compare with ``ideal_bubble_fraction``.
    ``step_s``: the longest whole traced step on any rank (from its origin to the end of ``schedule.step``,
    including splitting the batch and, on a schedule's first step, its set-up). ``num_stages`` and
    ``num_microbatches``: how many distinct stages and microbatches ran a forward.
    """
    events = list(all_events)
    timed = [e for e in events if e["cat"] != "step"]
    if not timed:
        raise ValueError("No pipeline events to summarize: was a step traced?")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}.")
    t0 = min(e["start"] for e in timed)
    t1 = max(e["end"] for e in timed)
    span = max(t1 - t0, 1e-9)
    busy = {r: 0.0 for r in range(num_ranks)}
    comm = {r: 0.0 for r in range(num_ranks)}
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
    rank, ``(p - 1) / (v * m + p - 1)``, for equal stage times and free communication."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


_COMM_TID = "comm"
_STEP_TID = "step"


def write_chrome_trace(all_events: Iterable[Event], path: Union[str, os.PathLike]) -> None:
    """Write a Chrome/Perfetto trace (``{"traceEvents": [...]}``): one process per rank (``pid`` = rank), one
    thread per stage (``tid`` = stage index) plus ``"comm"`` for transfers and ``"step"`` for the whole step;
    complete (``"ph": "X"``) events in microseconds. Open it in https://ui.perfetto.dev or chrome://tracing."""
    events = list(all_events)
    trace: list[dict[str, Any]] = []
    threads: set[tuple[int, Any]] = set()
    for e in events:
        rank = int(e["rank"])
        if e["cat"] == "comm":
            tid: Any = _COMM_TID
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


def _thread_order(tid: Any) -> int:
    if tid == _STEP_TID:
        return -1
    if tid == _COMM_TID:
        return 1_000_000
    return int(tid)


def write_png(all_events: Iterable[Event], path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
    """Draw the timeline as a PNG: one row per rank, compute coloured by kind (forward, loss, backward, input and
    weight backward) with microbatch labels, transfers as a thin red strip under each row. Needs matplotlib."""
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
            if e["cat"] == "comm":
                ax.broken_barh([(start, width)], (y - 0.42, 0.12), facecolors=_COLOURS["comm"], linewidth=0)
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
    legend = [Patch(color=_COLOURS[c], label=c.replace("_", " ")) for c in (*COMPUTE_CATS, "comm") if c in present]
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
    def resolve(cls, value: Any) -> Optional["TimelineOptions"]:
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
