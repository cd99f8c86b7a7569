"""The batch and the step as a run sees them: a batch's rows (:func:`row_numbers`, :func:`row_span`,
:func:`slice_batch`, :func:`rows_dim`, :func:`hidden_rows_per_row`, :func:`left_whole`), the loss in what the step
returned (:func:`loss_of`), and the step called with its logging muted (:func:`call_muted`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor, nn

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
    firsts = {leaf.shape[0] for leaf in batch_tensors(batch) if leaf.dim() > 0}
    if hidden[0] in firsts or len(hidden) < 3 or hidden[1] not in firsts:
        return 0
    return 1


def hidden_rows_per_row(hidden_rows: int, batch: Any) -> int:
    """How many rows of the first block's hidden state each row of ``batch`` makes: 1 where a tensor or sequence of
    the batch has the hidden state's rows, ``k`` where the hidden state holds ``k`` rows per row of the batch, and 0
    where it holds neither.

    [Note: rows folded into the batch]
    A video model folds its frames into the batch before its blocks (``[batch * frames, tokens, width]``), a
    vision-language model its images: no tensor of the batch has the hidden state's rows. The pipeline cuts the
    hidden state into microbatches by its rows, and runs the step of each microbatch on the batch's rows that make
    them (:func:`slice_batch`): ``k`` hidden rows per batch row, the batch's rows outermost, as a reshape of
    ``[batch, frames, ...]`` lays them out. The batch's rows are the most rows of one of its tensors that the hidden
    state's rows are a multiple of (not a small tensor's beside the samples, a loss's class weights, say). Whether
    the rows are laid out so is checked on the first microbatch of every new structure of batch: its step must make
    the microbatch's share of the hidden state's rows (:class:`~lightning_pipe._step.microbatch_rows.
    MicrobatchRowsCheck`). A hidden state of neither kind cannot be cut from the batch's rows at all: refused,
    naming the fix (a vision tower's patches packed over the batch's images: the language layers are the backbone
    to pipeline, and Hugging Face's packed images are cut by their own layout, [Note: packed vision inputs])."""
    sizes = list(_leading_sizes(batch))
    if hidden_rows in sizes:
        return 1
    folded = [n for n in sizes if hidden_rows % n == 0]  # a batch of one row too: one microbatch of all its rows
    return hidden_rows // max(folded) if folded else 0


def _leading_sizes(batch: Any) -> Iterator[int]:
    """The row counts :func:`slice_batch` can cut ``batch``'s leaves by, in the batch's order."""
    if isinstance(batch, Tensor):
        if batch.dim() > 0:
            yield batch.shape[0]
        return
    if _plain_sequence(batch):
        yield len(batch)
    for _, value in _items(batch):
        yield from _leading_sizes(value)


def left_whole(batch: Any, batch_size: int, path: str = "batch") -> Iterator[tuple[str, tuple[int, ...]]]:
    """The path and shape of each tensor of ``batch`` that :func:`slice_batch` gives every microbatch whole: one
    whose first dimension is not ``batch_size``."""
    if isinstance(batch, Tensor):
        if batch.dim() > 0 and batch.shape[0] != batch_size:
            yield path, tuple(batch.shape)
        return
    for key, value in _items(batch):
        yield from left_whole(value, batch_size, f"{path}.{key}" if isinstance(key, str) and not
                              isinstance(batch, Mapping) else f"{path}[{key!r}]")


def batch_tensors(batch: Any) -> list[Tensor]:
    """The tensors of ``batch``, in its order, inside the containers :func:`slice_batch` cuts (dicts and other
    mappings, such as Hugging Face's ``BatchEncoding``; lists, tuples, named tuples; dataclasses)."""
    if isinstance(batch, Tensor):
        return [batch]
    return [t for _, value in _items(batch) for t in batch_tensors(value)]


def _items(batch: Any) -> list[tuple[Any, Any]]:
    """The entries of a container of a batch, ``(key, value)``; none for a leaf."""
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.init]
    return []


def _plain_sequence(batch: Any) -> bool:
    """A list or tuple (not a named tuple) of plain values, one per row: a batch's strings, say."""
    return isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") and bool(batch) and not any(
        isinstance(v, (Tensor, list, tuple, Mapping)) or dataclasses.is_dataclass(v) for v in batch
    )


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
    if _plain_sequence(batch) and len(batch) == batch_size:
        return batch[start:stop]
    items = _items(batch)
    if not items:
        return batch
    cut = {key: slice_batch(value, batch_size, start, stop) for key, value in items}
    if isinstance(batch, dict):
        return type(batch)(cut.items())
    if isinstance(batch, Mapping):  # Hugging Face's `BatchEncoding`, `BatchFeature`: a `UserDict`
        return _mapping_like(batch, cut)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*cut.values())
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut.values())
    return dataclasses.replace(batch, **cut)


def _mapping_like(batch: Mapping, items: dict) -> Mapping:
    """``items`` in a mapping of ``batch``'s type where it takes its items as its first argument (``UserDict``,
    ``BatchEncoding``), else in a ``dict``."""
    try:
        return type(batch)(items)  # type: ignore[call-arg]
    except Exception:
        return items


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
