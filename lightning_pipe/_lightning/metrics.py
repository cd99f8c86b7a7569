"""torchmetrics in a pipelined step: finding a module's metrics, and making the calls of a training step split into
microbatches add up to one call on the whole batch.

The state handling mirrors ``Metric.forward``'s own; the private torchmetrics names it needs are reached through
``lightning_pipe._compat``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from torchmetrics import Metric

from lightning_pipe._compat.torchmetrics import compute_without_sync


def module_metrics(module: torch.nn.Module) -> list[tuple[str, Metric]]:
    """``(path, metric)`` for every torchmetrics ``Metric`` under ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, Metric)]


@contextmanager
def per_batch_metrics(metrics: list[tuple[str, Metric]], num_microbatches: int) -> Iterator[None]:
    """Make the ``Metric`` calls of a training step's microbatches add up to one call on the whole batch.

    Under ``training_step``, ``metric(preds, target)`` returns the value on its batch, which Lightning logs with
    ``on_step=True``, and merges the batch into the epoch's state. The last stage runs the step once per
    microbatch, so each call would see a microbatch. Here every metric starts the step from its default state, the
    microbatch calls accumulate the batch's state, and afterwards the batch value is computed from it (without a
    sync, as ``forward`` does) and the state from before the step is merged back in, counted as one update per call
    on the whole batch. Metrics the step does not touch are put back as they were, and so is every metric when the
    step raises.
    """
    saved = [(metric, _stash(metric)) for _, metric in metrics]
    try:
        yield
    except BaseException:
        for metric, kept in saved:
            _put_back(metric, kept)
        raise
    for metric, kept in saved:
        calls, forward_cache = metric._update_count, metric._forward_cache
        if calls == 0:
            _put_back(metric, kept)
            continue
        state, count, _, _, _ = kept
        if forward_cache is not None:
            forward_cache = compute_without_sync(metric)
        metric._update_count = count + max(1, calls // num_microbatches)
        metric._forward_cache, metric._computed = forward_cache, None
        with torch.no_grad():
            metric._reduce_states(state)  # the earlier state, merged with the metric's own reductions


@contextmanager
def metrics_set_aside(metrics: list[tuple[str, Metric]]) -> Iterator[None]:
    """Run the block with every metric at its defaults, then put each back as it was (for a profiled step)."""
    saved = [(metric, _stash(metric)) for _, metric in metrics]
    try:
        yield
    finally:
        for metric, kept in saved:
            _put_back(metric, kept)


@contextmanager
def metrics_undone_on(error: type[BaseException], metrics: list[tuple[str, Metric]]) -> Iterator[None]:
    """Run the block with the metrics as they are; if it raises ``error``, every metric is as it was before it (an
    evaluation step that turns out to generate runs again: its updates before that must not count twice)."""
    saved = [(metric, _copy(metric)) for _, metric in metrics]
    try:
        yield
    except error:
        for metric, kept in saved:
            _put_back(metric, kept)
        raise


_Stashed = tuple[dict[str, Any], int, Any, Any, tuple[Any, ...]]


def _copy(metric: Metric) -> _Stashed:
    """The metric's state, copied (updates change tensor states in place)."""
    state = {
        attr: getattr(metric, attr).clone() if isinstance(default, torch.Tensor) else list(getattr(metric, attr))
        for attr, default in metric._defaults.items()
    }
    return state, metric._update_count, metric._forward_cache, metric._computed, _sync_flags(metric)


def _stash(metric: Metric) -> _Stashed:
    """Take the metric's state out (by reference: nothing is copied) and leave it at its defaults."""
    defaults = metric._defaults
    state = {attr: getattr(metric, attr) for attr in defaults}
    kept = (state, metric._update_count, metric._forward_cache, metric._computed, _sync_flags(metric))
    for attr, default in defaults.items():
        if isinstance(default, torch.Tensor):
            setattr(metric, attr, default.detach().clone().to(state[attr].device))
        else:
            setattr(metric, attr, [])
    metric._update_count, metric._forward_cache, metric._computed = 0, None, None
    metric._cache, metric._is_synced = None, False  # as Metric.reset does
    return kept


def _put_back(metric: Metric, kept: _Stashed) -> None:
    """Undo :func:`_stash`: whatever happened to the metric since, it is as it was."""
    state, count, cache, computed, flags = kept
    for attr, value in state.items():
        setattr(metric, attr, value)
    metric._update_count, metric._forward_cache, metric._computed = count, cache, computed
    metric._to_sync, metric._should_unsync, metric._is_synced, metric._cache = flags


def _sync_flags(
    metric: Metric,
) -> tuple[bool, bool, bool, Optional[dict[str, Union[list[torch.Tensor], torch.Tensor]]]]:
    """The flags ``Metric.forward`` and ``sync`` change: a ``forward`` interrupted by an error leaves them changed,
    and the metric would then skip its sync in ``compute``, on this rank only."""
    return metric._to_sync, metric._should_unsync, metric._is_synced, metric._cache
