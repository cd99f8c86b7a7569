"""Cutting the LightningModule at setup: checks that the module can be pipelined, then the split itself.

:func:`refuse_unsupported` names what cannot run in a pipeline and how to change it. :func:`split_backbone`
replaces the user's backbone by this rank's :class:`~lightning_pipe.backbone.LocalBackbone`, with a layout
computed from the modules' parameter counts or, for ``balance="time"``, from their measured times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torchmetrics import Metric

from lightning_pipe import steps as _steps
from lightning_pipe.backbone import LocalBackbone, resolve_backbone
from lightning_pipe.partition import make_layout
from lightning_pipe.pipeline import placement_style
from lightning_pipe.logging_bridge import metrics_set_aside, module_metrics
from lightning_pipe.profile import require_real_weights, time_modules

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pipe.strategy import PipelineStrategy


def refuse_unsupported(strategy: PipelineStrategy, module: pl.LightningModule, fitting: bool) -> None:
    """Raise, naming the fix, for what a pipeline cannot run. Every rank checks the same module, so every rank
    raises."""
    name = type(strategy).__name__
    if fitting and not module.automatic_optimization:
        raise ValueError(
            f"`{name}` runs forward and backward inside the pipeline schedule, so manual optimization"
            " (`self.automatic_optimization = False`) is not supported. Remove it and return the loss from"
            " `training_step`; Lightning then steps the optimizers."
        )
    if strategy._layer_sync is not None:
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` is not supported by `{name}`: a BatchNorm layer lives on one stage and"
            " normalises each microbatch, and there is no group to synchronise it over that would match"
            " single-device statistics. Remove `sync_batchnorm=True` (see docs/evaluation.md)."
        )
    synced = [n for n, m in module.named_modules() if isinstance(m, Metric) and m.dist_sync_on_step]
    if synced and strategy.pipeline_parallel_size > 1:
        raise ValueError(
            f"`{name}`: the metrics {synced} have `dist_sync_on_step=True`, which syncs every call over all"
            " processes, but only the last stage calls a metric, so the sync would wait forever. Create them with"
            " `dist_sync_on_step=False` (the default); the epoch value is still synced."
        )


def split_backbone(strategy: PipelineStrategy, module: pl.LightningModule) -> LocalBackbone:
    """Replace the backbone by this rank's stages; a module split before (fit, then validate) is reused."""
    path = strategy._backbone_path
    parent, name, backbone = resolve_backbone(module, path)
    pp, stages_per_rank, rank = strategy.pipeline_parallel_size, strategy._stages_per_rank, strategy.pipeline_rank
    style = placement_style(strategy._schedule_name)
    if isinstance(backbone, LocalBackbone):
        layout = backbone.layout
        same = (layout.pipeline_size, layout.stages_per_rank, layout.style) == (pp, stages_per_rank, style)
        if not same or backbone.indices != layout.rank_modules(rank):
            raise ValueError(
                f"The backbone was already split for another pipeline ({layout.describe()}). Create a new"
                " LightningModule (or load it from a checkpoint) to run it with a different pipeline layout."
            )
        return backbone
    inside = {id(p) for p in backbone.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"`{type(strategy).__name__}` trains only the pipelined backbone `{path}`, but these trainable"
            f" parameters are outside it: {outside[:5]}{' ...' if len(outside) > 5 else ''}. Move those modules"
            " into the backbone `nn.Sequential`, or freeze them with `requires_grad_(False)`."
        )
    if strategy._balance == "time":
        costs = _measure_module_times(strategy, module, parent, name, backbone)
    else:
        costs = [sum(p.numel() for p in m.parameters()) for m in backbone]
    layout = make_layout(costs, pp, stages_per_rank, strategy._balance, style)
    local = LocalBackbone(backbone, layout.rank_modules(rank), len(backbone))
    local.layout = layout
    del backbone  # the other ranks' modules: on the meta device they were never allocated
    setattr(parent, name, local)
    rank_zero_info(f"PipelineStrategy ({strategy._schedule_name}): {layout.describe()}")
    return local


def _measure_module_times(
    strategy: PipelineStrategy, module: pl.LightningModule, parent: nn.Module, name: str, backbone: nn.Sequential
) -> list[float]:
    """Time every backbone module on one microbatch of the first batch (on rank 0) and share the result."""
    costs = None
    require_real_weights(list(backbone))  # every rank holds the whole model here, so every rank refuses
    if strategy.is_global_zero:
        profiled = _steps.profiling_batch(strategy, parent, name, backbone)
        with profiled as (inputs, loss), metrics_set_aside(module_metrics(module)):
            context = strategy.precision_plugin.train_step_context
            costs = time_modules(list(backbone), inputs, strategy.root_device, context=context, loss=loss)
        rank_zero_info("PipelineStrategy: forward+backward ms per module: " + ", ".join(f"{c * 1e3:.2f}" for c in costs))
    return strategy.broadcast(costs)
