"""The batch and the step as a run sees them: a batch's rows (:func:`row_numbers`, :func:`row_span`,
:func:`slice_batch`, :func:`rows_dim`), the loss in what the step returned (:func:`loss_of`), and the step called with
its logging muted (:func:`call_muted`)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_pipe._compat.lightning import logging_routed_to
from lightning_pipe._errors import BackboneCallError, not_computed_by_last_stage, stop_iteration_fails
from lightning_pipe._ghost import Ghost
from lightning_pipe._lightning.log import LogRecorder

Result = TypeVar("Result")


def rows_dim(hidden: tuple[int, ...], batch: Any) -> int:
    """The dimension of a hidden state of shape ``hidden`` that holds the rows of ``batch``.

    [Note: sequence-first hidden states] Most backbones take the hidden state batch first (``[batch, length,
    width]``); FSMT's and XLNet's take it sequence first (``[length, batch, width]``). The pipeline cuts the batch into
    microbatches by rows, so it needs the rows' count: the first dimension, unless no tensor of the batch has that
    many rows and the second (of three or more) is the first dimension of one (the ``[batch, length]`` token ids).
    A microbatch's hidden state then holds its rows in its second dimension; its stage runs compute from the
    microbatch's rows of the batch, so only what merges the microbatches' outputs again (the last stage's output in
    evaluation) reads this."""
    firsts = {leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if hidden[0] in firsts or len(hidden) < 3 or hidden[1] not in firsts:
        return 0
    return 1


def row_numbers(batch_size: int, device: torch.device) -> Tensor:
    """The batch's row numbers, ``0 .. batch_size - 1``, as the schedule splits them into microbatches
    ([Note: row numbers read from the view])."""
    rows = torch.arange(batch_size, device=device)
    rows._lp_row_numbers = True  # type: ignore[attr-defined]
    return rows


def row_span(rows: Tensor) -> tuple[int, int]:
    """The first row and the row after the last of the microbatch ``rows`` (consecutive row numbers).

    [Note: row numbers read from the view]
    Every stage run reads which rows of the batch its microbatch holds. Reading them from the tensor (``rows[0]``)
    costs two indexing operations and, on a GPU, waits for the device each time: a synchronisation per stage run that
    stops the host from queueing work ahead. torch's schedule splits the step's :func:`row_numbers` with
    ``tensor_split`` into views of it, and a view's offset into ``0 .. batch_size - 1`` is its first row number: so
    the span is read from the view's offset and length, no value read. Any other tensor of row numbers (a schedule
    that copied them, a caller's own ``arange``) is read."""
    base = rows._base
    if base is not None and getattr(base, "_lp_row_numbers", False) and rows.dim() == 1 and rows.stride(0) == 1:
        start = rows.storage_offset() - base.storage_offset()
        return start, start + rows.numel()
    return int(rows[0]), int(rows[-1]) + 1


def slice_batch(batch: Any, batch_size: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor or sequence in ``batch`` whose first dimension is ``batch_size``.

    A tensor's rows are a copy, not a view: models write into their inputs in place (FSMT's ``shift_tokens_right``
    fills the labels' ``-100`` with the pad id), and a view shares the whole batch's version counter, so one
    microbatch's write would fail the backward of another's that saved its rows (the loss's targets), or reach a
    later stage's run of the same rows on this rank."""
    if isinstance(batch, Tensor):
        return batch[start:stop].clone() if batch.dim() > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, batch_size, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, batch_size, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and not any(isinstance(v, (Tensor, list, tuple, dict)) for v in batch):
            return batch[start:stop]
        return type(batch)(slice_batch(v, batch_size, start, stop) for v in batch)
    return batch


def loss_of(result: Any) -> Tensor:
    """The loss in what ``training_step`` returned."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise BackboneCallError(
            "Under `PipelineStrategy`, `training_step` must return the loss tensor (or a dict with 'loss') for every"
            f" microbatch; it returned {type(result).__name__}. Skipping a step by returning None is not supported."
        )
    if isinstance(loss, Ghost):
        raise BackboneCallError(not_computed_by_last_stage(
            "The loss depends on values", "Compute the loss from the backbone's output and the batch.", loss
        ))
    return loss


def call_muted(module: nn.Module, step: Callable[..., Result], args: tuple, kwargs: dict) -> Result:
    """``step(*args, **kwargs)``, what it logs kept by a recorder that is then dropped."""
    with logging_routed_to(module, LogRecorder()), stop_iteration_fails():  # the last stage logs per microbatch
        return step(*args, **kwargs)
