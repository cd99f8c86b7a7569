"""Sharding this rank's stages over their data-parallel replicas with torch's FSDP2 (``data_parallel="fsdp"|"hsdp"``).

This module shards once, at setup (:func:`shard_stage`); what every batch does with the units is
``_step/sharded.py``'s.

[Note: sharded stages]
Every backbone block of this rank's stages is one ``fully_shard`` unit, and the modules outside the backbone that
this rank holds (an embedding on the first stage; a norm and head on the last) are one more, as torchtitan shards a
pipelined model. Each unit's parameters, gradients and optimizer state are split over the replicas of its pipeline
rank (``mesh["data_parallel"]``; with HSDP, over ``data_parallel_shard`` and replicated over
``data_parallel_replicate``).

- Block units keep FSDP's forward hooks: a block all-gathers before its first forward of a step and, unless
  ``reshard_after_forward=True``, stays unsharded until the step's gradients are reduced (no all-gather per
  microbatch). The strategy suspends the hooks while a stage runs on ghosts to learn its shapes
  (:class:`~lightning_pipe._compat.parallel.fsdp_hooks_suspended`).
- The outside unit is a module that holds those modules and is never called (:class:`OutsideModules`), so FSDP's
  hooks never run for it: the step's own code runs those modules, on ghosts too (on the other stages, and to learn
  the batch size). It is unsharded before each step and resharded after (``_step/sharded.py``).
- Gradients of every microbatch accumulate unsharded. In a stage's last full backward each block unit reduce-scatters
  its own in FSDP's post-backward hook, after they are scaled by the step's loss weight ([Note: token-weighted
  losses]: one replica's own, so before the replicas are averaged; see [Note: overlapped reductions]). The outside
  unit, and every unit under a zero-bubble schedule, reduce after the schedule (``_step/gradients.py`` through
  ``_step/sharded.py``), as torch's ``PipelineStage.perform_reduce_grad`` does.
- A parameter outside any unit (one registered on the LightningModule itself) stays replicated and is averaged
  over the replicas as in the replicated mode.
- From the meta device, each block is materialised (with the seed that gives the unsplit model's values) and sharded
  before the next one: no rank ever holds its whole stage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_pipe._compat.parallel import fsdp_lazy_init, fsdp_sharded_params
from lightning_pipe._ghost import Ghost
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.materialize import Materializer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision

    from lightning_pipe._calls.blocks import Backbone

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardingOptions:
    """How the stages are sharded: ``reshard_after_forward`` as ``fully_shard`` takes it, and the precision policy
    (``bf16-mixed``: parameters all-gathered in bf16, gradients reduced in fp32)."""

    reshard_after_forward: bool = False
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    #: ``{id(block): reshard_after_forward}`` where a block's own differs (``configure_model``'s ``fully_shard`` calls)
    per_block: Mapping[int, bool] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class StageSharding:
    """This rank's FSDP units as :func:`shard_stage` made them (see [Note: sharded stages]). What every batch does
    with them is ``_step/sharded.py``'s (``ShardedStages``).

    Attributes:
        blocks: the block units, in backbone order.
        outside: the unit of the modules outside the backbone this rank holds (:class:`OutsideModules`), if any.
        loose: the module's parameters outside every unit (replicated, averaged over the replicas), taken with every
            unit sharded: while one is unsharded, the module registers its unsharded parameters.
        param_dtype: the dtype the units all-gather their parameters in (``MixedPrecisionPolicy.param_dtype``);
            ``None``: their own.
    """

    blocks: list[nn.Module]
    outside: Optional[nn.Module]
    loose: list[nn.Parameter]
    param_dtype: Optional[torch.dtype] = None

    @property
    def units(self) -> list[nn.Module]:
        """Every unit: the blocks', then the outside one."""
        return self.blocks + ([self.outside] if self.outside is not None else [])

    def sharded_params(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in fsdp_sharded_params(unit)]

    def compute_dtypes(self) -> dict[int, torch.dtype]:
        """``{id(sharded parameter): dtype}`` for those all-gathered in another dtype (``MixedPrecisionPolicy``): what
        a run on ghosts must see to give the stage outputs' dtypes."""
        if self.param_dtype is None:
            return {}
        return {id(p): self.param_dtype for p in self.sharded_params() if p.is_floating_point()}

    def loose_params(self) -> list[nn.Parameter]:
        """The module's parameters outside every unit (replicated, averaged over the replicas)."""
        return list(self.loose)

    def trainable(self) -> list[nn.Parameter]:
        """The parameters the optimizers hold (sharded ones as sharded, whatever the units' state) that require
        gradients."""
        return [p for p in self.sharded_params() + self.loose_params() if p.requires_grad]


class OutsideModules(nn.Module):
    """The modules outside the backbone a rank holds, as one FSDP unit that is never called: its forward hooks would
    not fire (the step's own code calls the modules), so the strategy unshards and reshards it. ``fully_shard``
    registers the sharded parameters on the modules themselves, which stay where the LightningModule has them."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError("The modules outside the backbone run as the step calls them, not through this unit.")


def outside_modules(module: nn.Module, blocks: set[int], local: set[int]) -> list[nn.Module]:
    """The outermost modules that contain no backbone block (``blocks``: their ids) and hold some of this rank's
    parameters ``local`` (by id), in module order."""
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in blocks:
                continue
            if any(id(sub) in blocks for sub in child.modules()):  # a container around blocks
                walk(child)
            elif any(id(p) in local for p in child.parameters()):
                found.append(child)

    walk(module)
    return found


def shard_stage(
    module: nn.Module,
    cut: Cut,
    *,
    pipeline_rank: int,
    mesh: DeviceMesh,
    options: ShardingOptions,
    device: torch.device,
    prepare: Callable[[nn.Module], None],
    parallelize: Optional[Callable[[nn.Module], None]] = None,
    parallelize_outside: Optional[Callable[[nn.Module], None]] = None,
) -> StageSharding:
    """Materialise (from the meta device), prepare (dtype, device), split over the tensor ranks (``parallelize`` for
    blocks, ``parallelize_outside`` for the modules outside the backbone) and ``fully_shard`` this rank's units one by
    one, then the outside unit (see [Note: sharded stages]). Updates ``cut`` to the sharded parameters."""
    backbone, layout = cut.backbone, cut.layout
    indices = layout.rank_modules(pipeline_rank)
    materializer = Materializer(module, backbone, device)
    local = {id(r.tensor) for r in cut.held(pipeline_rank) if r.kind == "parameter"}
    block_ids = {id(backbone.module(i)) for i in range(len(backbone))}
    blocks = [backbone.module(i) for i in indices]
    outside = outside_modules(module, block_ids, local)
    _refuse_shared_across_units(blocks, outside, backbone, indices)
    with cut.parameters_replaced(module):
        rest = options.reshard_after_forward
        kwargs = dict(mesh=mesh, reshard_after_forward=rest, mp_policy=options.mp_policy)
        units: list[nn.Module] = []
        for index, block in zip(indices, blocks):
            materializer.block(index)
            prepare(block)
            if parallelize is not None:
                parallelize(block)
            if any(True for _ in block.parameters()):
                fully_shard(block, **{**kwargs, "reshard_after_forward": options.per_block.get(id(block), rest)})
                units.append(block)
        materializer.rest()
        outside_unit: Optional[nn.Module] = None
        for m in outside:
            prepare(m)
            if parallelize_outside is not None:
                parallelize_outside(m)
        if outside:
            outside_unit = OutsideModules(outside)
            fully_shard(outside_unit, **kwargs)
        for unit in units + ([outside_unit] if outside_unit is not None else []):
            fsdp_lazy_init(unit)
            # The unsharded parameters are allocated by the first all-gather: here, not under the inference mode of a
            # first validation (inference tensors cannot be trained later).
            unit.unshard()
            unit.reshard()
    every = units + ([outside_unit] if outside_unit is not None else [])
    sharding = StageSharding(units, outside_unit, _loose_params(module, every), options.mp_policy.param_dtype)

    log.debug(
        "pipeline rank %d: %d block units and %s outside unit (%s) sharded over %s",
        pipeline_rank, len(units), "one" if outside_unit is not None else "no",
        [type(m).__name__ for m in outside], mesh,
    )
    return sharding


def _loose_params(module: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    """The module's parameters outside every unit (``units`` sharded), ghosts left out."""
    sharded = {id(p) for unit in units for p in fsdp_sharded_params(unit)}
    return [p for p in module.parameters() if id(p) not in sharded and not isinstance(p, Ghost)]


def _refuse_shared_across_units(
    blocks: list[nn.Module], outside: list[nn.Module], backbone: Backbone, indices: list[int]
) -> None:
    """FSDP shards a parameter in one unit only: a parameter used by two blocks, or by a block and a module outside
    the backbone, cannot be sharded."""
    seen: dict[int, str] = {}
    named = [(backbone.blocks[i].name, b) for i, b in zip(indices, blocks)] + [
        (type(m).__name__, m) for m in outside
    ]
    for name, unit in named:
        for p in unit.parameters():
            other = seen.setdefault(id(p), name)
            if other != name:
                raise ValueError(
                    f"`PipelineStrategy(data_parallel='fsdp')` shards each backbone block, and the modules outside the"
                    f" backbone, as separate FSDP units, but `{other}` and `{name}` share a parameter on this stage."
                    " FSDP cannot shard one parameter in two units. Use `data_parallel='ddp'`, or untie the"
                    " parameter, or pipeline so that the two end up on different stages."
                )


def refuse_user_sharding(module: nn.Module) -> None:
    """The strategy places and shards the stages itself: a model the user already wrapped or sharded (``fully_shard``
    or ``parallelize_module`` in ``configure_model``, a ``DistributedDataParallel`` inside) cannot be cut again."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            raise ValueError(
                f"`{name or type(module).__name__}` was sharded with `fully_shard` before `PipelineStrategy` cut the"
                " model into stages. The strategy shards each stage itself: remove the `fully_shard` calls (e.g. from"
                " `configure_model`) and pass `PipelineStrategy(data_parallel='fsdp')`, or 'hsdp' to shard within"
                " groups of replicas."
            )
        if isinstance(sub, DistributedDataParallel):
            raise ValueError(
                f"`{name}` is wrapped in `DistributedDataParallel`. `PipelineStrategy` replicates (or shards) each"
                " stage over its replicas itself: remove the wrapper and choose `PipelineStrategy(data_parallel='ddp')`"
                " (the default) or 'fsdp'."
            )
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"`{name}` is already a DTensor (distributed with `parallelize_module` or `distribute_tensor`, e.g. in"
                " `configure_model`, before the pipeline cut). `PipelineStrategy` splits each rank's own blocks after"
                " the cut: pass the plan as `PipelineStrategy(tensor_parallel_size=..., tensor_parallel_plan=...)`"
                " and `data_parallel='fsdp'` for the sharding, and leave the model unsplit in `configure_model`."
            )


def refuse_unshardable(mode: str, precision_plugin: Precision, callbacks: list[pl.Callback]) -> None:
    """What sharded stages cannot honour, refused at setup on every rank with the fix (as Lightning's
    ``FSDPStrategy`` refuses what it cannot shard)."""
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning < 2.6
        WeightAveraging = StochasticWeightAveraging
    precision = getattr(precision_plugin, "precision", None)
    if precision == "16-mixed":
        raise ValueError(
            f"`Trainer(precision='16-mixed')` with `PipelineStrategy(data_parallel={mode!r})`: fp16 loss scaling needs"
            " every rank to see its whole gradient to find overflows, and sharded stages reduce-scatter theirs. Use"
            " `precision='bf16-mixed'` (no scaler needed; parameters are all-gathered in bf16 and gradients reduced in"
            " fp32), or `data_parallel='ddp'` to keep '16-mixed'."
        )
    for callback in callbacks:
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging, ModelPruning)):
            name = type(callback).__name__
            raise ValueError(
                f"`{name}` with `PipelineStrategy(data_parallel={mode!r})`: it keeps or rewrites whole parameter"
                " tensors of the module (an averaged copy, or pruning masks and reparametrisations), which sharded"
                " stages hold as shards that FSDP swaps in and out. Lightning's `FSDPStrategy` does not support it"
                f" either. Use `data_parallel='ddp'` to keep `{name}`."
            )
