"""The one place that parallelizes a rank's stage after the cut, from the strategy's arguments and the calls a user's
``configure_model`` made alike.

[Note: stage parallelism]
Each rank holds its stages' blocks and the modules outside the backbone that its stages run (the embedding on the
first, the final norm and head on the last). After the cut, :func:`parallelize_stage` applies to them, in torchtitan's
order:

1. tensor parallelism (``tensor_parallel_plan``, or the styles ``configure_model`` gave ``parallelize_module``,
   recorded while it ran: [Note: tensor-parallel stages]), on the local blocks and, for recorded styles, on the
   outside modules this rank holds;
2. activation checkpointing: selected per block here (``activation_checkpointing=``) and applied when the step calls
   the block (``_step/program.py``), so that the block keeps its parameter names;
3. compile (``compile=``): ``Module.compile`` on each block, in place, so its parameter names stay the module's own
   ([Note: compiled blocks]); activation checkpointing, chosen above, wraps the compiled block when the step calls it;
4. sharded data parallelism (``data_parallel="fsdp"|"hsdp"``): ``fully_shard`` per block and one unit for the outside
   modules ([Note: sharded stages]), materialised block by block from the meta device.

What was applied is one typed record, :class:`StageParallelism`, kept with the cut. A later ``Trainer`` call with the
same strategy (``validate`` after ``fit``) reuses it; another strategy cannot, since the DTensors live on the first
one's mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_pipe._compat.parallel import ModuleSnapshot
from lightning_pipe._compiled import compiled
from lightning_pipe._ghost import Ghost
from lightning_pipe._model.configure_model import ConfigureModelCalls, sharding_of
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.materialize import materialize_local
from lightning_pipe._model.shard import ShardingOptions, StageSharding, outside_modules, shard_stage
from lightning_pipe._model.tensor_parallel import TensorParallelPlan, TensorParallelSplit, choose_plan
from lightning_pipe._parallel_dims import ParallelDims


@dataclass(frozen=True)
class StageParallelism:
    """What :func:`parallelize_stage` applied to one rank's stage.

    Attributes:
        owner: the strategy whose mesh the stage's DTensors and FSDP units use.
        tensor_parallel: whether modules are split over the tensor ranks.
        sharding: the FSDP units (``StageSharding``) of a sharded stage; ``None`` when replicated.
        snapshot: the modules as they were before (``_compat.parallel.ModuleSnapshot``), so that the module can be made
            whole after the call ([Note: undoing a stage's parallelization]).
    """

    owner: object
    tensor_parallel: bool = False
    sharding: Optional[StageSharding] = None
    snapshot: Optional[ModuleSnapshot] = None


@dataclass(frozen=True)
class Sharded:
    """``data_parallel="fsdp"|"hsdp"``: the mesh a stage is sharded over and how."""

    mesh: DeviceMesh
    options: ShardingOptions


@dataclass(frozen=True)
class ParallelismArgs:
    """What ``PipelineStrategy``'s arguments ask of a stage: ``tensor_parallel_plan``, ``data_parallel`` (``None``:
    not given), ``reshard_after_forward``, the precision plugin's ``precision`` (``"bf16-mixed"`` all-gathers
    sharded parameters in bf16), and ``compile``'s options (``None``: blocks not compiled)."""

    tensor_parallel_plan: TensorParallelPlan = None
    data_parallel: Optional[str] = None
    reshard_after_forward: bool = False
    precision: Optional[str] = None
    compile: Optional[dict] = None


def data_parallel_mode(data_parallel: Optional[str], configured: ConfigureModelCalls) -> str:
    """How the replicas hold each stage: ``data_parallel``, or ``"fsdp"`` when ``configure_model`` calls
    ``fully_shard`` ([Note: configure_model's calls]); ``"ddp"`` when neither says."""
    return "fsdp" if configured.shards else (data_parallel or "ddp")


def parallelize_stage(
    module: nn.Module,
    cut: Cut,
    dims: ParallelDims,
    args: ParallelismArgs,
    configured: ConfigureModelCalls,
    *,
    owner: object,
    device: torch.device,
    prepare: Callable[[nn.Module], None],
) -> StageParallelism:
    """Materialise this rank's share of ``module`` and parallelize it as ``args`` and the calls ``configure_model``
    made (``configured``) ask ([Note: stage parallelism]); returns the record of what was applied, also kept as
    ``cut.parallelism``. ``prepare`` converts a unit to the precision plugin's dtypes on the device before it is
    sharded. The same on every rank; raises ``ValueError`` naming the fix for what it cannot honour."""
    done: Optional[StageParallelism] = cut.parallelism
    if done is not None and (done.tensor_parallel or done.sharding is not None):
        if done.owner is not owner:
            raise ValueError(
                "The module was sharded or split over tensor ranks by another `PipelineStrategy`, whose process"
                " groups its parameters use. Run every `Trainer` call on it with the same strategy object, or create"
                " a new LightningModule (or load one from a checkpoint)."
            )
        return done
    snapshot = ModuleSnapshot(module)
    backbone = cut.backbone
    named = [(backbone.blocks[i].name, backbone.module(i)) for i in range(len(backbone))]
    split = choose_plan(args.tensor_parallel_plan, configured.styles, dims.tensor, module, named)
    sharded = _sharded(args, configured, [b for _, b in named], dims)
    tensor_parallel_block, outside = _tensor_parallel_parts(split, dims.tensor_mesh)
    blocks = _then_compiled(tensor_parallel_block, args.compile)
    rank = dims.pipeline_rank
    if sharded is None:
        materialize_local(module, backbone, device)
        with cut.parameters_replaced(module):
            for block in local_blocks(cut, rank):
                if blocks is not None:
                    blocks(block)
            if outside is not None:
                for part in _held_outside(module, cut):
                    outside(part)
        sharding = None
    else:
        sharding = shard_stage(
            module, cut, pipeline_rank=rank, mesh=sharded.mesh, options=sharded.options, device=device, prepare=prepare,
            parallelize=blocks, parallelize_outside=outside,
        )
    snapshot.parallelized()
    record = StageParallelism(owner=owner, tensor_parallel=split is not None, sharding=sharding, snapshot=snapshot)
    cut.parallelism = record
    return record


def _sharded(
    args: ParallelismArgs, configured: ConfigureModelCalls, blocks: list[nn.Module], dims: ParallelDims
) -> Optional[Sharded]:
    """How the stage is sharded over its replicas: as ``configure_model``'s ``fully_shard`` calls ask, or as
    ``data_parallel`` says; ``None``: replicated."""
    recorded = sharding_of(configured, blocks, args.data_parallel)
    if recorded is not None:
        options = ShardingOptions(args.reshard_after_forward, recorded.mp_policy, recorded.reshard_after_forward)
        return Sharded(dims.shard_mesh, options)
    if data_parallel_mode(args.data_parallel, configured) == "ddp":
        return None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.precision == "bf16-mixed" else MixedPrecisionPolicy()
    return Sharded(dims.shard_mesh, ShardingOptions(args.reshard_after_forward, policy))


def _then_compiled(
    parallelize: Optional[Callable[[nn.Module], None]], options: Optional[dict]
) -> Optional[Callable[[nn.Module], None]]:
    """Each block: split over the tensor ranks, then compiled (``compile=``), before it is sharded ([Note: compiled
    blocks])."""
    if options is None:
        return parallelize

    def apply(block: nn.Module) -> None:
        if parallelize is not None:
            parallelize(block)
        if not compiled(block):  # one the user compiled in `configure_model` is not compiled twice
            block.compile(**options)

    return apply


def local_blocks(cut: Cut, pipeline_rank: int) -> list[nn.Module]:
    """The blocks of this rank's stages, in order."""
    layout = cut.layout
    return [cut.backbone.module(i) for i in layout.rank_modules(pipeline_rank)]


def _tensor_parallel_parts(
    split: Optional[TensorParallelSplit], tp_mesh: Optional[DeviceMesh]
) -> tuple[Optional[Callable[[nn.Module], None]], Optional[Callable[[nn.Module], None]]]:
    if split is None:
        return None, None
    assert tp_mesh is not None
    block, outside = split.block, split.outside
    return (lambda m: block(m, tp_mesh)), (None if outside is None else (lambda m: outside(m, tp_mesh)))


def _held_outside(module: nn.Module, cut: Cut) -> list[nn.Module]:
    """The outermost modules outside the backbone that hold some of this rank's parameters."""
    backbone = cut.backbone
    block_ids = {id(backbone.module(i)) for i in range(len(backbone))}
    local = {id(p) for p in module.parameters() if not isinstance(p, Ghost)}
    return outside_modules(module, block_ids, local)
