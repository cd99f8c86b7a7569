"""Makes ``self.log`` inside a pipelined step behave as in single-device training.

On the last stage the user's step runs once per microbatch (training) or once on the gathered batch
(evaluation). While it runs, ``LightningModule.log`` is replaced by a :class:`LogRecorder`. Afterwards the
recorded values are averaged over the microbatches, weighted by their sizes: a value logged from a step is a
statistic of its batch (a mean loss, an accuracy), and the size-weighted mean of microbatch means is the
full-batch mean. ``reduce_fx`` keeps its Lightning meaning, the reduction across steps. The values are sent to
every rank of the pipeline and logged there for real, once per key. Every rank therefore logs the same keys
with the same values, and ``sync_dist=True`` is matched collectively on all ranks instead of deadlocking on
one stage; it reduces over the data-parallel replicas only, since the stages of one pipeline hold copies of
the same value.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from lightning_pipe._compat.lightning import logging_routed_to
from lightning_pipe._errors import not_computed_by_last_stage
from lightning_pipe._ghost import Ghost, GhostValueError
from lightning_pipe._lightning.metrics import module_metrics

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
#: what `log` takes by keyword after the value: keyword arguments of these names need no binding
_LOG_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}
#: what `LightningModule.log` takes as a value (Lightning's `_METRIC`)
LoggedValue = Union[Metric, torch.Tensor, int, float]


def _plain(value: LoggedValue) -> LoggedValue:
    """A DTensor logged value (a ``loss_parallel`` loss) as the plain tensor every rank holds: a replicated one's own
    local tensor (so that it is still recognised as the loss), any other one gathered."""
    if not isinstance(value, DTensor):
        return value
    return value.to_local() if all(p.is_replicate() for p in value.placements) else value.full_tensor()


class LogRecorder:
    """Stands in for ``LightningModule.log`` and keeps what the step logs, per key."""

    def __init__(self) -> None:
        self.values: dict[str, list[LoggedValue]] = {}
        self.options: dict[str, dict[str, Any]] = {}
        self.batch_sizes: dict[str, list[int]] = {}
        #: what each value weighs in the merge: its batch size, or its count
        self.weights: dict[str, list[Union[int, torch.Tensor]]] = {}
        self.rows = 0  # size of the (micro)batch the step is running on
        self._this_microbatch: list[str] = []

    def __call__(self, name: str, value: LoggedValue, *args: object, **kwargs: object) -> None:
        if not args and kwargs.keys() <= _LOG_OPTIONS:  # by keyword, as nearly every step logs: nothing to bind
            options = dict(kwargs)
        else:
            bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs)
            options = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        self.values.setdefault(name, []).append(_plain(value))
        self.options[name] = options
        given = options.get("batch_size")
        size = int(given) if given is not None else self.rows
        self.batch_sizes.setdefault(name, []).append(size)
        self.weights.setdefault(name, []).append(size)
        self._this_microbatch.append(name)

    def start(self, rows: int) -> None:
        """A new microbatch of ``rows`` rows begins."""
        self.rows = rows
        self._this_microbatch = []

    def weigh_loss(self, loss: torch.Tensor, weight: torch.Tensor) -> None:
        """Merge the values this microbatch logged that are its loss (the tensor, or a view or detached copy of it)
        by ``weight``, the count the loss averages over, instead of by rows ([Note: token-weighted losses])."""
        for name in self._this_microbatch:
            value = self.values[name][-1]
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.data_ptr() == _plain(loss).data_ptr():
                self.weights[name][-1] = weight

    @contextmanager
    def installed(self, module: LightningModule) -> Iterator["LogRecorder"]:
        """Route ``module.log`` (and so ``module.log_dict``) here for the duration of the block."""
        with logging_routed_to(module, self):
            yield self

    def reduce(
        self, module: LightningModule, metrics: Optional[list[tuple[str, Metric]]] = None
    ) -> list[tuple[str, Union[torch.Tensor, _MetricRef, _MetricStates], dict[str, Any]]]:
        """One ``(name, value, options)`` per key, values reduced over microbatches.

        Tensors and numbers become Python floats (or a float list for non-scalars) so they travel cheaply; a
        torchmetrics ``Metric`` becomes a reference to the module attribute holding it.
        """
        entries = []
        metrics = module_metrics(module) if metrics is None else metrics
        metric_names = {id(m): n for n, m in metrics}
        for name, values in self.values.items():
            options = dict(self.options[name])
            if options.get("batch_size") is not None:
                options["batch_size"] = sum(self.batch_sizes[name])
            last = values[-1]
            if isinstance(last, Metric):
                if id(last) not in metric_names:
                    raise ValueError(
                        f"`self.log({name!r}, metric)` under `PipelineStrategy` needs the metric to be an attribute of"
                        " the LightningModule, so every rank can log it."
                    )
                forward_cache = last._forward_cache
                entries.append((name, _MetricRef(metric_names[id(last)], forward_cache), options))
                continue
            entries.append((name, _weighted_mean(name, values, self.weights[name]), options))
        states = _MetricStates.of(metrics)
        if states.templates:
            entries.append(("", states, {}))
        return entries


class _MetricRef:
    """A picklable pointer to a ``Metric`` submodule of the LightningModule, with the value of its last
    ``forward`` (the batch value Lightning logs for ``on_step=True``): only the last stage ran ``forward``."""

    def __init__(self, path: str, forward_cache: object = None) -> None:
        self.path = path
        cache = forward_cache.detach().cpu() if isinstance(forward_cache, torch.Tensor) else None
        self.forward_cache: Optional[torch.Tensor] = cache

    def _key(self) -> tuple:
        cache = self.forward_cache
        return (self.path, None if cache is None else (cache.dtype, tuple(cache.shape)))

    def __eq__(self, other: object) -> bool:  # the value of the cache is not part of the identity
        return isinstance(other, _MetricRef) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())


class _MetricStates:
    """Dtype and trailing shape of every non-empty list ("cat") state of the module's metrics.

    Only the last stage updates metrics; the other stages keep empty states, which add nothing when
    ``compute()`` syncs over the world. For a list state torchmetrics all-gathers one tensor per rank and fills
    an empty list with a float32 tensor, which does not match an integer state (the targets of ``AUROC``,
    ``AveragePrecision``, ...) on the last stage: the collective fails. :meth:`pad` gives each empty list one
    zero-row tensor of the right dtype instead, which gathers cleanly and adds no rows.
    """

    def __init__(self, templates: tuple[tuple[str, str, torch.dtype, tuple[int, ...]], ...]) -> None:
        self.templates = templates

    @classmethod
    def of(cls, metrics: list[tuple[str, Metric]]) -> "_MetricStates":
        """From the module's ``(path, metric)`` pairs."""
        templates = []
        for path, metric in metrics:
            for state in metric._defaults:
                value = getattr(metric, state)
                if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                    templates.append((path, state, value[0].dtype, tuple(value[0].shape[1:])))
        return cls(tuple(templates))

    def pad(self, module: LightningModule, device: torch.device) -> None:
        for path, state, dtype, trailing in self.templates:
            value = getattr(module.get_submodule(path), state)
            if isinstance(value, list) and not value:
                value.append(torch.empty((0, *trailing), dtype=dtype, device=device))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetricStates) and other.templates == self.templates

    def __hash__(self) -> int:
        return hash(self.templates)


def _weighted_mean(name: str, values: list[LoggedValue], weights: list[Union[int, torch.Tensor]]) -> torch.Tensor:
    tensors = []
    for v in values:
        if isinstance(v, Ghost):
            fix = "Log values computed from the backbone's output and the batch."
            raise GhostValueError(not_computed_by_last_stage(f"`self.log({name!r}, ...)` logs a value", fix, v))
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach().float())
        elif isinstance(v, numbers.Number):
            tensors.append(torch.tensor(float(v)))
        else:
            raise TypeError(f"`self.log({name!r}, ...)` got a {type(v).__name__}; log tensors, numbers or metrics.")
    if len(tensors) == 1:
        return tensors[0]
    stacked = torch.stack([t.to(tensors[0].device) for t in tensors])
    if all(isinstance(w, int) for w in weights) and len(set(weights)) == 1:
        return stacked.mean(0)
    w = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=stacked.device) for v in weights])
    if not bool((w > 0).any()):
        return stacked.mean(0)
    w = w.view(-1, *([1] * (stacked.dim() - 1)))
    # A microbatch that weighs nothing (every label ignored) may have logged 0 / 0: it adds nothing.
    merged = (torch.where(w > 0, stacked.double(), 0.0) * w).sum(0) / w.sum()
    return merged.to(stacked.dtype)


class LogChannel:
    """Carries one step's result and reduced logs from the last stage to the other ranks of the pipeline.

    The first step (and any step whose logged keys or options change) sends a pickled object. After that, when
    the keys are the same and the result and every value are scalars (the result may be a tuple of them), only the
    values travel, in one small tensor: a flag in the first slot tells the receivers whether the object follows.

    [Note: the step's result, sent to each rank]
    The source sends that tensor to each other rank of the pipeline on its own (point to point), not by a
    broadcast. A broadcast relays: gloo's runs down a tree of ranks and NCCL's around a ring, so a rank may get the
    values only once another receiver has joined the broadcast. Under 1F1B on 4 ranks, rank 2 got them through rank
    0, which still ran the step's last backward: rank 2 started its optimizer step and Lightning's loop only then,
    and reached Lightning's per-step broadcast at the next step's start 1.5 ms after rank 0, which waited 3 ms there.
    Sent point to point, each rank gets the values as soon as the source has them and its own schedule has ended.

    The source does not wait for its sends: the last stage finishes its step before the first stage does (which
    still runs the last backward), and a blocking send would hold it until then instead of letting it step its
    optimizer and start the next batch meanwhile. The sends complete in the background and are waited for before
    the next ones.

    [Note: the step's result, sent before the schedule ends]
    A training step's loss and logs are known once the last stage's last microbatch ran its loss, and the schedule
    then still runs the backward passes. With a V-shaped placement (DualPipeV, ZBVZeroBubble) the last stage shares
    rank 0 with the first, which runs the step's last backward. Under DualPipeV every rank ended its schedule within
    3 ms of the others and then waited 1.5 ms more for the values; their optimizer steps and Lightning's loop then ran
    one after the other on few cores, and rank 0 waited for the last of them at Lightning's per-step broadcast. So
    there a training channel (``early=True``) sends the values-only tensor from inside the schedule
    (:meth:`send_early`), and every other rank posts its receive before its schedule starts (:meth:`expect`): each
    rank has the values when its own schedule ends. In a looped placement the last stage's rank ends its schedule
    before the ranks that still run backward, so its send after the schedule arrives in time; sent from inside the
    schedule it would only delay that rank's backward, which the others wait for.

    The channel then needs a process group that carries nothing else: NCCL matches point-to-point transfers between
    two ranks in the order they were issued, whatever their tags, so a send issued amid the schedule's on the
    pipeline's group would be taken for one of them (the loss weight's channel does the same, [Note: overlapped
    reductions]). A step whose values must travel as an object sends it after the schedule, as before: the object's
    broadcast is a collective, which would hold the last stage's schedule until every rank had ended its own.

    Args:
        group: the pipeline's process group (with ``early``: a group over the pipeline that carries nothing else).
        src: the source's rank in ``group``.
        size: the group's size.
        device: where the tensor travels from and to.
        tag: the tag of this channel's messages (each channel on a group its own).
        early: the values may be sent before the schedule ends, and are received into a buffer posted before it
            starts.
    """

    def __init__(
        self, group: Optional[dist.ProcessGroup], src: int, size: int, device: torch.device, tag: int = 1,
        early: bool = False,
    ) -> None:
        self.group, self.src, self.size, self.device, self.tag = group, src, size, device, tag
        self.early = early and size > 1
        self._signature: Optional[tuple] = None
        #: the source's last sends and their buffer
        self._in_flight: Optional[tuple[list[dist.Work], torch.Tensor]] = None
        #: the source's payload of this step, when :meth:`send_early` sent it
        self._sent: Optional[tuple[Any, list]] = None
        #: a receiver's receive posted by :meth:`expect`, and its buffer
        self._posted: Optional[tuple[dist.Work, torch.Tensor]] = None

    def expect(self, is_source: bool) -> None:
        """Before a step's schedule (``early`` channels): a receiver posts the receive of the step's tensor."""
        if self.early and not is_source:
            buffer = self._pack(None)
            self._posted = (dist.irecv(buffer, group_src=self.src, group=self.group, tag=self.tag), buffer)

    def send_early(self, payload: tuple[Any, list]) -> None:
        """On the source, inside the schedule (``early`` channels): send ``payload`` now if it travels as values;
        :meth:`share` then returns it without sending again. An object waits for :meth:`share`."""
        if not self.early:
            return
        self.wait()
        buffer = self._pack(payload)
        if buffer[0] == 1:
            self._send(buffer)
            self._sent = payload

    def share(self, payload: Optional[tuple[Any, list]]) -> tuple[Any, list]:
        """``payload`` is ``(result, entries)`` on the source rank and ``None`` elsewhere."""
        if self.size == 1:
            assert payload is not None
            return payload
        sent, self._sent = self._sent, None
        if payload is not None and payload is sent:  # sent from inside the schedule already
            return payload
        self.wait()
        if payload is not None:
            buffer = self._pack(payload)
            self._send(buffer)
            if buffer[0] == 1:
                return payload
            self.wait()  # the object follows: every rank takes part in its broadcast
        else:
            buffer = self._received()
            if buffer[0].item() == 1:
                return self._unpack(buffer[1:].cpu())
        return self._object(payload)

    def _received(self) -> torch.Tensor:
        """A receiver's buffer of this step: the one posted before the schedule (:meth:`expect`), or received now."""
        if self._posted is not None:
            (work, buffer), self._posted = self._posted, None
            work.wait()
            return buffer
        buffer = self._pack(None)
        dist.recv(buffer, group_src=self.src, group=self.group, tag=self.tag)
        return buffer

    def _send(self, buffer: torch.Tensor) -> None:
        sends = [
            dist.isend(buffer, group_dst=rank, group=self.group, tag=self.tag)
            for rank in range(self.size) if rank != self.src
        ]
        self._in_flight = (sends, buffer)

    def _object(self, payload: Optional[tuple[Any, list]]) -> tuple[Any, list]:
        """The payload as a pickled object, broadcast by the source; every rank learns its signature."""
        box = [_to_cpu(payload)]
        dist.broadcast_object_list(box, group_src=self.src, group=self.group)
        result, entries = box[0]
        self._signature = _signature(result, entries)
        return result, entries

    def _pack(self, payload: Optional[tuple[Any, list]]) -> torch.Tensor:
        """The buffer the source sends and the others receive into: on the source, with the flag set and the values
        in it when the payload has the last object's signature (:func:`_signature`); zeros elsewhere, and for a
        payload that must travel as an object."""
        signature = self._signature
        width = len(signature[0][2]) if signature is not None else 0
        slots = len(signature) - 1 + width if signature is not None else 0
        buffer = torch.zeros(1 + slots, dtype=torch.float64, device=self.device)
        if payload is None or signature is None or _signature(*payload) != signature:
            return buffer
        result, entries = payload
        for i, part in enumerate(_result_parts(result) or ()):
            buffer[1 + i] = part.detach().double()
        values = _slot_values(entries)
        if values:
            buffer[1 + width : 1 + width + len(values)] = torch.stack([v.detach().double().reshape(()) for v in values])
        buffer[0] = 1
        return buffer

    def wait(self) -> None:
        """Wait for the source's last sends to complete (a no-op elsewhere)."""
        if self._in_flight is not None:
            for work in self._in_flight[0]:
                work.wait()
            self._in_flight = None

    def _unpack(self, values: torch.Tensor) -> tuple[Any, list]:
        assert self._signature is not None
        (_, kind, dtypes), *keys = self._signature
        parts = [values[i].to(dtype) for i, dtype in enumerate(dtypes)]
        result = None if kind is None else parts[0] if kind == "tensor" else tuple(parts)
        entries, i = [], len(dtypes)
        for name, options, kind in keys:
            if isinstance(kind, _MetricRef) and kind.forward_cache is not None:
                entries.append((name, _MetricRef(kind.path, values[i].to(kind.forward_cache.dtype)), dict(options)))
                i += 1
            elif isinstance(kind, (_MetricRef, _MetricStates)):
                entries.append((name, kind, dict(options)))
            else:
                entries.append((name, values[i].to(kind), dict(options)))
                i += 1
        return result, entries


def _signature(result: object, entries: list) -> Optional[tuple]:
    """What must not change between steps for the values-only path: result kind, keys, options, value dtypes."""
    parts = _result_parts(result)
    if parts is None:
        return None
    kind = None if result is None else "tensor" if isinstance(result, torch.Tensor) else "tuple"
    head = ("result", kind, tuple(p.dtype for p in parts))
    keys = []
    for name, value, options in entries:
        try:
            frozen = tuple(sorted(options.items()))
            hash(frozen)
        except TypeError:
            return None
        if isinstance(value, _MetricRef) and value.forward_cache is not None and value.forward_cache.dim() != 0:
            return None
        if isinstance(value, (_MetricRef, _MetricStates)):
            keys.append((name, frozen, value))
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            keys.append((name, frozen, value.dtype))
        else:
            return None
    return (head, *keys)


def _result_parts(result: object) -> Optional[list[torch.Tensor]]:
    """The scalars a result travels as on the values-only path: none for ``None``, itself for a scalar tensor, its
    items for a tuple of scalar tensors (the training loss and its gradient factor); ``None`` for anything else."""
    if result is None:
        return []
    items = [result] if isinstance(result, torch.Tensor) else list(result) if type(result) is tuple else None
    if items is None or not all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in items):
        return None
    return items


def _slot_values(entries: list) -> list[torch.Tensor]:
    """The scalars the values-only path sends, in entry order: logged values and metrics' batch values."""
    values = []
    for _, value, _ in entries:
        if isinstance(value, _MetricRef):
            if value.forward_cache is not None:
                values.append(value.forward_cache)
        elif not isinstance(value, _MetricStates):
            values.append(value)
    return values


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [_to_cpu(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def replay(
    module: LightningModule,
    entries: list[tuple[str, Union[torch.Tensor, _MetricRef, _MetricStates], dict[str, Any]]],
    device: torch.device,
    replica_group: Optional[dist.ProcessGroup],
) -> None:
    """Log each reduced entry for real on this rank; ``sync_dist`` reduces over ``replica_group``."""
    for name, value, options in entries:
        if isinstance(value, _MetricStates):
            value.pad(module, device)
            continue
        if isinstance(value, _MetricRef):
            metric = module.get_submodule(value.path)
            if value.forward_cache is not None:
                metric._forward_cache = value.forward_cache.to(device)
            value = metric
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        if options.get("sync_dist") and options.get("sync_dist_group") is None:
            options = {**options, "sync_dist_group": replica_group}
        module.log(name, value, **options)
