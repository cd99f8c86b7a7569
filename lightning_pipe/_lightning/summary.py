"""``ModelSummary`` of the whole pipelined model, not of rank 0's stages.

Lightning's ``ModelSummary`` (and ``RichModelSummary``) callback counts ``pl_module.parameters()``: under the pipeline,
rank 0's share. The strategy counts every module's parameters before the cut (:func:`parameter_counts`) and gives
the summary callbacks a copy whose summary reads those counts (:func:`summarize_whole_model`). The summary does not
run ``example_input_array`` through the model: each rank holds only its stages (input and output sizes show ``?``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import LayerSummary, ModelSummary
from torch import nn

from lightning_pipe._subclass import copy_with_mixin

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: ``{module path: (parameters, trainable parameters)}``, ``""`` for the whole model.
Counts = dict[str, tuple[int, int]]


def parameter_counts(module: nn.Module) -> Counts:
    """Every module's parameter counts (shared parameters counted once), taken before the cut."""
    counts: Counts = {}
    for name, sub in module.named_modules():
        params = {id(p): p for p in sub.parameters()}.values()
        counts[name] = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
    return counts


class PipelineModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` with the whole model's parameter counts."""

    def __init__(self, model: pl.LightningModule, counts: Counts, max_depth: int = 1) -> None:
        self._counts = counts
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> dict[str, LayerSummary]:
        summary = {name: LayerSummary(module) for name, module in self.named_modules}
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary

    @property
    def param_nums(self) -> list[int]:
        return [self._counts.get(name, (0, 0))[0] for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        return self._counts[""][0]

    @property
    def trainable_parameters(self) -> int:
        return self._counts[""][1]


class _WholeModelSummary:
    """Mixed in front of the user's summary callback class by :func:`summarize_whole_model`."""

    _lp_counts: Counts
    _max_depth: int

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ModelSummary:
        return PipelineModelSummary(pl_module, self._lp_counts, max_depth=self._max_depth)


def summarize_whole_model(callbacks: list[pl.Callback], counts: Counts) -> list[pl.Callback]:
    """``callbacks`` with each ``ModelSummary`` callback replaced by a copy that summarises the whole model (its class
    named like the user's: :mod:`lightning_pipe._subclass`)."""
    result = []
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback) and not hasattr(callback, "_lp_counts"):
            callback = copy_with_mixin(callback, _WholeModelSummary)
            callback._lp_counts = counts
        result.append(callback)
    return result
