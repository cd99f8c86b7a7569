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
3. compile: not offered;
4. sharded data parallelism (``data_parallel="fsdp"|"hsdp"``): ``fully_shard`` per block and one unit for the outside
   modules ([Note: sharded stages]), materialised block by block from the meta device.

What was applied is one typed record, :class:`StageParallelism`, kept with the cut. A later ``Trainer`` call with the
same strategy (``validate`` after ``fit``) reuses it; another strategy cannot, since the DTensors live on the first
one's mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_pipe._ghost import Ghost
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.materialize import materialize_local
from lightning_pipe._model.shard import ShardingOptions, outside_modules, shard_stage
from lightning_pipe._model.tensor_parallel import TensorParallelSplit


@dataclass(frozen=True)
class StageParallelism:
    """What :func:`parallelize_stage` applied to one rank's stage.

    Attributes:
        owner: the strategy whose mesh the stage's DTensors and FSDP units use.
        tensor_parallel: whether modules are split over the tensor ranks.
        sharding: the FSDP units (``StageSharding``) of a sharded stage; ``None`` when replicated.
    """

    owner: Any
    tensor_parallel: bool = False
    sharding: Any = None


@dataclass(frozen=True)
class Sharded:
    """``data_parallel="fsdp"|"hsdp"``: the mesh a stage is sharded over and how."""

    mesh: DeviceMesh
    options: ShardingOptions


def parallelize_stage(
    module: nn.Module,
    cut: Cut,
    pipeline_rank: int,
    *,
    owner: Any,
    split: Optional[TensorParallelSplit],
    tp_mesh: Optional[DeviceMesh],
    sharded: Optional[Sharded],
    device: torch.device,
    prepare: Callable[[nn.Module], Any],
) -> StageParallelism:
    """Materialise this rank's share of ``module`` and parallelize it ([Note: stage parallelism]); returns the record
    of what was applied, also kept as ``cut.parallelism``. ``prepare`` converts a unit to the precision plugin's
    dtypes on the device before it is sharded."""
    done: Optional[StageParallelism] = cut.parallelism
    if done is not None and (done.tensor_parallel or done.sharding is not None):
        if done.owner is not owner:
            raise ValueError(
                "The module was sharded or split over tensor ranks by another `PipelineStrategy`, whose process"
                " groups its parameters use. Run every `Trainer` call on it with the same strategy object, or create"
                " a new LightningModule (or load one from a checkpoint)."
            )
        return done
    blocks, outside = _tensor_parallel_parts(split, tp_mesh)
    if sharded is None:
        materialize_local(module, cut.backbone, device)
        with cut.parameters_replaced(module):
            for block in local_blocks(cut, pipeline_rank):
                if blocks is not None:
                    blocks(block)
            if outside is not None:
                for part in _held_outside(module, cut):
                    outside(part)
        sharding = None
    else:
        sharding = shard_stage(
            module, cut, pipeline_rank, sharded.mesh, sharded.options, device, prepare, blocks, outside
        )
    record = StageParallelism(owner=owner, tensor_parallel=split is not None, sharding=sharding)
    cut.parallelism = record
    return record


def local_blocks(cut: Cut, pipeline_rank: int) -> list[nn.Module]:
    """The blocks of this rank's stages, in order."""
    layout = cut.layout
    return [cut.backbone.module(i) for s in layout.rank_stages(pipeline_rank) for i in range(*layout.bounds[s])]


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
