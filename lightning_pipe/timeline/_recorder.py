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
collective         a gradient reduction (:meth:`collective`)              ``reduce-scatter``
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

What happens after the step, gathering every rank's events to rank 0, :func:`summarize` (the measured bubble),
:func:`write_chrome_trace`, :func:`write_png` and :func:`report`, is in ``_report``, as is :class:`TimelineOptions`
(what ``PipelineStrategy(timeline=...)`` traces). The torch private names the recorder wraps are listed in
``lightning_pipe._compat``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional, ParamSpec, TypeVar, Union

import torch
import torch.distributed as dist

from lightning_pipe._compat.pipelining import P2P_POST, P2P_WAIT, SCHEDULE_LOSS_METHOD, schedule_stages
from lightning_pipe._compat.torch import Swaps
from lightning_pipe.timeline._report import _LETTER, Event

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

_STAGE_OPS = {  # getter -> (direction, payload)
    "get_fwd_recv_ops": ("recv", "act"),
    "get_fwd_send_ops": ("send", "act"),
    "get_bwd_recv_ops": ("recv", "grad"),
    "get_bwd_send_ops": ("send", "grad"),
}
_tracing = False  # the module-level helpers are process-wide: one trace at a time
_P = ParamSpec("_P")
_R = TypeVar("_R")


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

    After ``with recorder.trace(...)``, :attr:`events` holds this rank's events sorted by start time.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        self.group = group
        self.device = device
        self.events: list[Event] = []
        self.rank = 0
        self._origin = 0
        self._sync: Optional[Callable[[], None]] = None
        self._op_labels: dict[int, tuple[dist.P2POp, dict[str, Optional[Union[str, int]]]]] = {}
        self._work_labels: dict[int, tuple[dist.Work, list[dict[str, Optional[Union[str, int]]]]]] = {}
        self._post_depth = 0  # nesting of `_batch_p2p` calls (see `_wrap_post`)
        self._post_calls = 0

    # ------------------------------------------------------------------ tracing
    @contextmanager
    def trace(
        self, target: Union[_PipelineSchedule, PipelineStage, Sequence[PipelineStage]]
    ) -> Iterator["TimelineRecorder"]:
        """Trace one step of ``target``: a torch pipeline schedule (its stages and loss are traced), a
        ``PipelineStage`` or a list of them. Everything installed is removed on exit, also on error."""
        global _tracing
        if _tracing:
            raise RuntimeError("A pipeline timeline is already being traced in this process; trace one step at a time.")
        stages = schedule_stages(target)
        schedule = target if stages is not None else None
        if stages is None:
            stages = list(target) if isinstance(target, (list, tuple)) else [target]
        self.events = []
        self._op_labels.clear()
        self._work_labels.clear()
        self._post_depth = 0
        self._sync = _device_sync(self.device)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(self.group) if distributed else 0
        _tracing = True
        try:
            with Swaps() as swaps:
                for stage in stages:
                    index = int(stage.stage_index)
                    swaps.wrap(stage, "forward_one_chunk", lambda f, s=index: self._wrap_forward(f, s))
                    swaps.wrap(stage, "backward_one_chunk", lambda f, s=index: self._wrap_backward(f, s))
                    swaps.wrap(stage, "backward_weight_one_chunk", lambda f, s=index: self._wrap_weight(f, s))
                    for getter, (direction, payload) in _STAGE_OPS.items():
                        swaps.wrap(stage, getter,
                                   lambda f, s=index, d=direction, p=payload: self._wrap_getter(f, s, d, p))
                if schedule is not None and getattr(schedule, "_loss_fn", None) is not None:
                    swaps.wrap(schedule, SCHEDULE_LOSS_METHOD, self._wrap_loss)
                import torch.distributed.pipelining.schedules as torch_schedules
                swaps.wrap(torch_schedules, P2P_POST, self._wrap_post)
                swaps.wrap(torch_schedules, P2P_WAIT, self._wrap_wait)
                if distributed:
                    _barrier(self.group, self.device)
                self._origin = time.perf_counter_ns()
                try:
                    yield self
                finally:
                    end = time.perf_counter_ns()
                    self._add("step", "step", None, None, t0=self._origin, t1=end)
        finally:
            _tracing = False
            self._op_labels.clear()
            self._work_labels.clear()
            self.events.sort(key=lambda e: (e["start"], e["end"]))

    @contextmanager
    def collective(self, name: str, **args: object) -> Iterator[None]:
        """Record the block as a ``collective`` event: a gradient reduction over the replicas (all-reduce,
        reduce-scatter) or over the ranks of a tied parameter, during or after the traced step."""
        sync = self._sync
        if sync is not None:
            sync()
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.add_collective(name, t0, time.perf_counter_ns(), **args)

    def add_collective(self, name: str, start_ns: int, end_ns: int, **args: object) -> None:
        """Record a ``collective`` event between two ``time.perf_counter_ns()`` readings (an asynchronous one: from
        its launch to its completion)."""
        self._add("collective", name, None, None, t0=start_ns, t1=end_ns, **args)

    # ------------------------------------------------------------------ wrappers
    def _add(
        self, cat: str, name: str, stage: Optional[int], mb: Optional[int], t0: int, t1: int, **args: object
    ) -> None:
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

    def _timed_compute(
        self, cat: str, stage: int, mb: Optional[int], fn: Callable[..., _R], args: tuple, kwargs: dict
    ) -> _R:
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
            self._add(cat, f"{_LETTER[cat]}{mb} s{stage}", stage, mb, t0=t0, t1=t1)

    def _wrap_forward(self, fn: Callable[_P, _R], stage: int) -> Callable[_P, _R]:
        def forward_one_chunk(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            mb = _arg(args, kwargs, 0, "fwd_chunk_id")
            return self._timed_compute("forward", stage, mb, fn, args=args, kwargs=kwargs)

        return forward_one_chunk

    def _wrap_backward(self, fn: Callable[_P, _R], stage: int) -> Callable[_P, _R]:
        def backward_one_chunk(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            mb = _arg(args, kwargs, 0, "bwd_chunk_id")
            full = _arg(args, kwargs, 2, "full_backward", True)
            cat = "backward" if full else "backward_input"
            return self._timed_compute(cat, stage, mb, fn, args=args, kwargs=kwargs)

        return backward_one_chunk

    def _wrap_weight(self, fn: Callable[_P, _R], stage: int) -> Callable[_P, _R]:
        def backward_weight_one_chunk(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            mb = _arg(args, kwargs, 0, "bwd_chunk_id")
            return self._timed_compute("backward_weight", stage, mb, fn, args=args, kwargs=kwargs)

        return backward_weight_one_chunk

    def _wrap_loss(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        def maybe_compute_loss(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            stage = _arg(args, kwargs, 0, "stage")
            if not getattr(stage, "is_last", False):
                return fn(*args, **kwargs)
            mb = _arg(args, kwargs, 3, "mb_index")
            return self._timed_compute("loss", int(stage.stage_index), mb, fn, args=args, kwargs=kwargs)

        return maybe_compute_loss

    def _wrap_getter(
        self, fn: Callable[..., list[dist.P2POp]], stage: int, direction: str, payload: str
    ) -> Callable[..., list[dist.P2POp]]:
        def get_ops(*args: int, **kwargs: int) -> list[dist.P2POp]:  # the microbatch (fwd_chunk_id, bwd_chunk_id)
            ops = fn(*args, **kwargs)
            mb = args[0] if args else next(iter(kwargs.values()), None)  # fwd_chunk_id / bwd_chunk_id
            if mb is None:
                return ops
            for op in ops:
                peer = getattr(op, "peer", None)
                label = {"dir": direction, "what": payload, "stage": stage, "mb": int(mb), "peer": peer}
                tensor = getattr(op, "tensor", None)
                if tensor is not None:  # each rank's own message: a sequence shard with sequence parallelism
                    label["bytes"] = tensor.numel() * tensor.element_size()
                self._op_labels[id(op)] = (op, label)  # the op is kept alive, so its id is not reused
            return ops

        return get_ops

    def _wrap_post(self, fn: Callable[..., list[dist.Work]]) -> Callable[..., list[dist.Work]]:
        """With per-direction (torch 2.14) or per-edge (2.15) communicators, ``_batch_p2p`` splits a batch that spans
        several process groups and calls itself, through the module global (so through this wrapper), once per
        group. The outermost call is the one the schedule made: it alone becomes an event. Its works are the inner
        calls' works concatenated in group order, not in op order, so the works are labelled by the innermost calls,
        where they pair with their ops."""

        def batch_p2p(p2p_ops: list[dist.P2POp], *args: object, **kwargs: object) -> list[dist.Work]:
            if not p2p_ops:
                return fn(p2p_ops, *args, **kwargs)
            outermost = self._post_depth == 0
            self._post_calls += 1
            calls_before = self._post_calls
            self._post_depth += 1
            t0 = time.perf_counter_ns()
            try:
                works = fn(p2p_ops, *args, **kwargs)
            finally:
                self._post_depth -= 1
            t1 = time.perf_counter_ns()
            labels = [self._label_of(op) for op in p2p_ops]
            if self._post_calls == calls_before:  # no nested call: these works are this call's own
                works_list = list(works) if works else []
                for i, work in enumerate(works_list):
                    mine = [labels[i]] if len(works_list) == len(labels) else labels
                    self._work_labels[id(work)] = (work, mine)
            if outermost:
                self._add_comm("post", labels, t0, t1)
            return works

        return batch_p2p

    def _wrap_wait(self, fn: Callable[..., None]) -> Callable[..., None]:
        def wait_batch_p2p(work: list[dist.Work], *args: object, **kwargs: object) -> None:
            works = list(work) if work else []
            if not works:
                return fn(work, *args, **kwargs)
            t0 = time.perf_counter_ns()
            result = fn(work, *args, **kwargs)
            if self._sync is not None:
                self._sync()
            t1 = time.perf_counter_ns()
            labels: list[dict[str, Optional[Union[str, int]]]] = []
            for w in works:
                for label in self._work_labels.get(id(w), (None, [{"dir": "p2p"}]))[1]:
                    if label not in labels:
                        labels.append(label)
            self._add_comm("wait", labels, t0, t1)
            return result

        return wait_batch_p2p

    def _label_of(self, op: dist.P2POp) -> dict[str, Optional[Union[str, int]]]:
        known = self._op_labels.get(id(op))
        if known is not None:
            return known[1]
        name = getattr(getattr(op, "op", None), "__name__", "")
        direction = "send" if "send" in name else "recv" if "recv" in name else "p2p"
        return {"dir": direction, "peer": getattr(op, "peer", None)}

    def _add_comm(self, phase: str, labels: list[dict[str, Optional[Union[str, int]]]], t0: int, t1: int) -> None:
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
        sizes: dict[str, int] = {}
        for label in labels:  # the bytes of each message, this rank's own (a sequence shard with sequence parallelism)
            if "bytes" in label:
                sizes[f"{label['dir']}_bytes"] = sizes.get(f"{label['dir']}_bytes", 0) + label["bytes"]
        ops = [_describe(label) for label in labels]
        self._add("comm", f"{kind} {phase}", stage, mb, t0=t0, t1=t1, ops=ops, **(sizes if phase == "post" else {}))


def _describe(label: dict[str, Optional[Union[str, int]]]) -> str:
    if "mb" not in label:
        peer = label.get("peer")
        return f"{label['dir']}" + (f" rank {peer}" if peer is not None else "")
    arrow = "from" if label["dir"] == "recv" else "to"
    return f"{label['dir']} {label['what']} mb{label['mb']} s{label['stage']} {arrow} rank {label['peer']}"

