"""Weights each microbatch's loss by what it holds, so that a loss averaged over a data-dependent count is exact.

[Note: token-weighted losses]
A training loss is often a mean over a count that depends on the data: ``F.cross_entropy(..., ignore_index=-100)``
(Hugging Face's losses) averages over the targets that are not ignored (padding, a masked prompt), a hand-written
loss divides by ``mask.sum()``. One device averages over the whole batch's count. A pipeline runs the step once per
microbatch, and each microbatch averages over its own count, so weighting the microbatches equally gives another
gradient whenever their counts differ. The exact gradient weights microbatch ``i``'s mean ``L_i`` over ``n_i`` items
by ``n_i / N``, ``N = sum(n_i)``. ``N`` is known only once every microbatch ran, but gradients are linear: each
microbatch back-propagates ``L_i * n_i / r`` (``r``: the first non-zero count of the batch, which keeps the
magnitudes those of a mean) and the step's gradients are multiplied by ``r / N`` afterwards. When every count is the
same the factors are those of equal weighting and nothing is rescaled. A microbatch with ``n_i == 0`` (every label
ignored: its mean is ``0 / 0``) back-propagates an exact zero.

Where ``n_i`` comes from (:meth:`LossWeighing.add`):

- **explicit**: ``training_step`` returns ``{"loss": loss, "num_items": n}``: the loss is a mean over ``n`` items;
- **automatic**: the loss is the very tensor a mean-reduced ``F.cross_entropy``/``F.nll_loss`` returned (Hugging Face
  causal and masked LM losses, ``nn.CrossEntropyLoss``): ``n_i`` is its count of targets that are not ignored
  (weighted by ``weight=`` if given), exactly what torch divides by;
- otherwise the microbatch's rows, all equal: exact for per-row means, as before.

Never silently wrong: while the last stage computes a loss, :class:`MeanObserver` also notes means whose count
depends on the data that the weight does not cover, if they feed the loss: a mean-reduced cross-entropy that is only
part of the loss, a division by a count summed from a mask or from integer data, a mean over the elements a boolean
mask selects. The first step that meets one warns, once, with the spread of that count over the microbatches.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_pipe._compat.torch import top_function_mode
from lightning_pipe._ghost import Ghost

#: The key of ``training_step``'s returned dict that gives the count the loss is a mean over.
NUM_ITEMS = "num_items"

_COUNTED_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
_DIVISIONS = {torch.div, torch.true_divide, Tensor.div, Tensor.div_, Tensor.__truediv__, Tensor.__itruediv__,
              Tensor.true_divide}
_SUMS = {torch.sum, Tensor.sum, torch.count_nonzero, Tensor.count_nonzero}
_MEANS = {torch.mean, Tensor.mean}
_SELECTIONS = {torch.masked_select, Tensor.masked_select}
_CONVERSIONS = {Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.long, Tensor.int, Tensor.to,
                Tensor.type, Tensor.type_as}


class PipelineDataDependentMeanWarning(UserWarning):
    """The training loss averages over a data-dependent count that the pipeline cannot weight microbatches by."""


class MeanObserver(TorchFunctionMode):
    """Watches the torch calls of one microbatch's loss code for means over data-dependent counts.

    ``means``: ``(output, count)`` of each mean-reduced ``cross_entropy``/``nll_loss`` with class-index targets.
    ``findings``: ``(what, output, count)`` of the other means over a data-dependent count (see the module docstring).
    """

    def __init__(self) -> None:
        super().__init__()
        self.means: list[tuple[Tensor, Tensor]] = []
        self.findings: list[tuple[str, Tensor, Tensor]] = []
        self._masks: dict[int, Tensor] = {}  # float conversions of boolean or integer tensors
        self._counts: dict[int, Tensor] = {}  # 0-dim sums of such tensors, and what is computed from them alone
        self._selected: dict[int, Tensor] = {}  # the elements a boolean mask selected
        self._paused = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Collection[type], args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused and isinstance(out, Tensor) and not isinstance(out, Ghost):
            self._note(func, args, kwargs, out)
        return out

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not watching while a block runs: taken off torch's mode stack when it is on top (blocks then run as without
        it, compiled ones without a recompile), otherwise passing every call through."""
        if top_function_mode() is self:
            self.__exit__(None, None, None)
            try:
                yield
            finally:
                self.__enter__()
            return
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _note(self, func: Callable[..., object], args: tuple, kwargs: dict, out: Tensor) -> None:
        first = args[0] if args else None
        if func in _COUNTED_LOSSES:
            count = _loss_count(func, args, kwargs)
            if count is not None:
                self.means.append((out, count))
        elif func in _SUMS and out.dim() == 0 and self._is_mask(first):
            self._counts[id(out)] = out
        elif func in _DIVISIONS and len(args) > 1 and id(args[1]) in self._counts:
            self.findings.append(("divides by a count summed from a mask or integer data", out, args[1]))
        elif func in _MEANS and out.dim() == 0 and id(first) in self._selected:
            self.findings.append(("averages the elements a boolean mask selects", out, _numel(first)))
        elif func in _SELECTIONS or (func is Tensor.__getitem__ and _has_bool_index(args[1:])):
            self._selected[id(out)] = out
        elif func in _CONVERSIONS and isinstance(first, Tensor) and self._is_mask(first):
            self._masks[id(out)] = out
        elif out.dim() == 0 and id(first) in self._counts and _scalars_only(args[1:], kwargs):
            self._counts[id(out)] = out  # count.float(), count.clamp(min=1), count + eps

    def _is_mask(self, t: object) -> bool:
        if not isinstance(t, Tensor) or isinstance(t, Ghost):
            return False
        return id(t) in self._masks or not (t.dtype.is_floating_point or t.dtype.is_complex)


class LossWeighing:
    """One training batch's microbatch weights (see [Note: token-weighted losses]).

    Args:
        num_microbatches: microbatches in the batch.
        check_unweighted: look for data-dependent means that a loss weighted by rows leaves out (for
            :meth:`warning`; it walks the loss's autograd graph, so the runtime stops once it warned).
    """

    def __init__(self, num_microbatches: int, check_unweighted: bool = True) -> None:
        self.num_microbatches = num_microbatches
        self.check_unweighted = check_unweighted
        self.source: Optional[str] = None  # "num_items", "cross_entropy" or "rows", fixed by the first microbatch
        self.losses: list[Tensor] = []
        self.weights: list[Tensor] = []
        self.reference: Optional[Tensor] = None  # r: the first non-zero count
        self.unweighted: dict[str, list[Tensor]] = {}  # what the rows-weighting could not cover, with its counts

    def observing(self) -> MeanObserver:
        """The observer of one microbatch's loss code, a context manager (a ``TorchFunctionMode``)."""
        return MeanObserver()

    def add(self, result: object, loss: Tensor, observer: MeanObserver) -> tuple[Optional[Tensor], float]:
        """Take one microbatch's loss; returns its weight (``None``: its rows) and the factor that multiplies the loss
        it back-propagates (0: back-propagate an exact zero)."""
        weight, source = _weight_of(result, loss, observer)
        if self.source is None:
            self.source = source
        elif source != self.source:
            raise RuntimeError(
                f"PipelineStrategy: the microbatches of one batch weight their losses differently ({self.source} for"
                f" the first, {source} for microbatch {len(self.losses)}): `training_step` must return the loss the"
                " same way for every batch (always the same mean-reduced cross-entropy, or always"
                f" `{{'loss': ..., '{NUM_ITEMS}': ...}}`)."
            )
        self.losses.append(whole(loss).detach())
        if weight is None:
            self._note_unweighted(loss, observer)
            return None, 1.0
        self.weights.append(weight)
        if not bool(weight > 0):
            return weight, 0.0
        if self.reference is None:
            self.reference = weight
        return weight, float(weight / self.reference)

    def result(self) -> tuple[Tensor, float]:
        """The full-batch loss, and the factor the step's gradients are multiplied by (1: none)."""
        if self.source in (None, "rows"):
            return torch.stack(self.losses).mean(), 1.0
        weights = torch.stack([w.to(self.losses[0].device, torch.float64) for w in self.weights])
        losses = torch.stack(self.losses).double()
        total = weights.sum()
        if not bool(total > 0):
            return torch.full_like(self.losses[0], float("nan")), 1.0
        loss = (torch.where(weights > 0, losses, 0.0) * weights).sum() / total
        assert self.reference is not None
        scale = float(self.reference.double() * self.num_microbatches / total)
        return loss.to(self.losses[0].dtype), scale

    def warning(self) -> Optional[str]:
        """What to tell the user when the loss averages over a data-dependent count it was not weighted by."""
        if not self.unweighted:
            return None
        parts = [_spread(what, [float(c) for c in counts]) for what, counts in self.unweighted.items()]
        return (
            "PipelineStrategy: the training loss averages over a count that depends on the data, and each"
            " microbatch averages over its own count: " + "; ".join(parts) + ". The pipelined gradient then differs"
            " from one device's. Return the count with the loss, `return {'loss': loss, 'num_items': count}` (the"
            " loss being a mean over `count` items of the microbatch), and every microbatch is weighted by it;"
            " a mean-reduced `F.cross_entropy` returned as the loss itself is weighted automatically (docs/data.md)."
        )

    def _note_unweighted(self, loss: Tensor, observer: MeanObserver) -> None:
        if not self.check_unweighted:
            return
        candidates = [("takes a mean-reduced cross-entropy over the targets that are not ignored", out, count)
                      for out, count in observer.means]
        candidates += observer.findings
        if not candidates:
            return
        reaching = _graph_of(loss)
        for what, out, count in candidates:
            if out.grad_fn is not None and out.grad_fn in reaching:
                self.unweighted.setdefault(what, []).append(count.detach())


def warn_unweighted(message: str) -> None:
    """Emit :meth:`LossWeighing.warning`'s message (the runtime does so once per run)."""
    warnings.warn(message, PipelineDataDependentMeanWarning, stacklevel=2)


def whole(loss: Tensor) -> Tensor:
    """A loss computed on DTensors (``loss_parallel()`` over vocabulary-sharded logits gives a replicated DTensor) as
    the plain tensor every tensor rank holds, still connected to the graph; any other loss as it is."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _weight_of(result: object, loss: Tensor, observer: MeanObserver) -> tuple[Optional[Tensor], str]:
    if isinstance(result, dict) and NUM_ITEMS in result:
        return _explicit_count(result[NUM_ITEMS], loss), NUM_ITEMS
    for out, count in observer.means:
        if out is loss:
            return count, "cross_entropy"
    return None, "rows"


def _explicit_count(value: object, loss: Tensor) -> Tensor:
    count = None
    if isinstance(value, Tensor) and not isinstance(value, Ghost) and value.numel() == 1:
        count = value.detach().reshape(()).double()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        count = torch.tensor(float(value), dtype=torch.float64)
    if count is None or not bool(torch.isfinite(count)) or not bool(count >= 0):
        raise ValueError(
            f"`training_step` returned `{NUM_ITEMS}={value!r}`: it must be the number of items the loss averages over"
            " in this microbatch, a finite non-negative number or one-element tensor computed from the batch (e.g."
            " `(labels != -100).sum()`)."
        )
    return count.to(loss.device)


def _loss_count(func: Callable[..., object], args: tuple, kwargs: dict) -> Optional[Tensor]:
    """The count a mean-reduced ``cross_entropy``/``nll_loss`` call divides by, or ``None`` if not mean-reduced."""
    bound = _COUNTED_LOSSES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a["reduction"]
    if a["size_average"] is not None or a["reduce"] is not None:
        reduction = torch.nn._reduction.legacy_get_string(a["size_average"], a["reduce"], emit_warning=False)
    target, weight = a["target"], a["weight"]
    if reduction != "mean" or not isinstance(target, Tensor) or isinstance(target, Ghost):
        return None
    if target.dtype.is_floating_point:  # class probabilities, (N, C, d1, ...): a mean over N * d1 * ... positions
        positions = target.numel() // target.shape[1] if target.dim() > 1 else 1
        return torch.tensor(float(positions), device=target.device)
    valid = target != a["ignore_index"]
    if weight is None:
        return valid.sum()
    return torch.where(valid, weight[target.masked_fill(~valid, 0)], 0).sum()


def _spread(what: str, counts: list[float]) -> str:
    low, high, mean = min(counts), max(counts), sum(counts) / len(counts)
    if high == low:
        return (f"it {what} ({low:g} in each of this batch's {len(counts)} microbatches: exact for this batch, not"
                " for one whose microbatches hold different counts)")
    off = max(abs(c / mean - 1) for c in counts) if mean > 0 else 0.0
    return (f"it {what}, and that count ranges from {low:g} to {high:g} over this batch's {len(counts)}"
            f" microbatches: weighting them equally puts up to {off:.0%} more or less weight on one than one device"
            " does")


def _graph_of(loss: Tensor) -> set:
    """The autograd nodes ``loss`` was computed through (the last stage's loss code: a small graph)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


def _has_bool_index(index: tuple) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


def _scalars_only(args: tuple, kwargs: dict) -> bool:
    return all(
        isinstance(v, (int, float, bool, type(None), torch.dtype, torch.device))
        or (isinstance(v, Tensor) and v.dim() == 0)
        for v in (*args, *kwargs.values())
    )


def _numel(t: Tensor) -> Tensor:
    return torch.tensor(float(t.numel()))
