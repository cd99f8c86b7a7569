"""Fast, in-process: the degrees and the mesh (``ParallelDims``), the HSDP group size, which modules outside the
blocks a rank holds, and the styles a ``configure_model`` asks for, recorded and applied to one rank's own modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_pipe._model.configure_model import recording
from lightning_pipe._model.shard import outside_modules
from lightning_pipe._model.tensor_parallel import recorded_plan
from lightning_pipe._parallel_dims import (
    DATA,
    DATA_REPLICATE,
    DATA_SHARD,
    PIPELINE,
    TENSOR,
    ParallelDims,
    hsdp_shard_size,
    is_tensor_parallel,
)


@pytest.mark.parametrize(
    "pp, dp, tp, world, hybrid, per_node, names, sizes",
    [
        ("auto", "auto", 1, 4, None, 1, (DATA, PIPELINE, TENSOR), (1, 4, 1)),
        (2, "auto", 1, 4, None, 1, (DATA, PIPELINE, TENSOR), (2, 2, 1)),
        (2, "auto", 2, 8, None, 1, (DATA, PIPELINE, TENSOR), (2, 2, 2)),
        ("auto", 2, 2, 8, None, 1, (DATA, PIPELINE, TENSOR), (2, 2, 2)),
        (1, 4, 1, 4, "auto", 2, (DATA_REPLICATE, DATA_SHARD, PIPELINE, TENSOR), (2, 2, 1, 1)),
        (2, 4, 2, 16, 4, 8, (DATA_REPLICATE, DATA_SHARD, PIPELINE, TENSOR), (1, 4, 2, 2)),
    ],
)
def test_the_mesh_dimensions_outermost_first(pp, dp, tp, world, hybrid, per_node, names, sizes):
    dims = ParallelDims.resolve(pp, dp, tp, world, hybrid, per_node)
    assert dims.names_and_sizes() == (names, sizes)
    assert dims.pipeline * dims.data * dims.tensor == world


def test_sizes_that_do_not_match_the_processes_are_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3\)` does not divide the 8 processes"):
        ParallelDims.resolve("auto", "auto", 3, 8)
    with pytest.raises(ValueError, match="groups of 4 replicas, which does not divide the 6 replicas.*e.g. 3"):
        hsdp_shard_size(4, 6, 8)
    assert hsdp_shard_size("auto", 4, 8) == 4  # the processes of a node, at most the replicas
    assert hsdp_shard_size("auto", 8, 4) == 4


def test_the_mesh_hands_out_groups_by_name(group):
    dims = ParallelDims.resolve(1, 1, 1, 1)
    mesh = dims.build("cpu", "gloo", None)
    assert mesh.mesh_dim_names == (DATA, PIPELINE, TENSOR) and dims.mesh is mesh
    assert dims.pipeline_rank == dims.data_rank == 0 and dims.tensor_group is None and dims.tensor_mesh is None
    assert dims.pipelines().tolist() == [[0]] and dims.loss_weight_group is None
    assert dims.result_group is None  # one pipeline rank: the step's result stays where it is computed
    assert dims.shard_mesh.mesh_dim_names == (DATA,)
    assert not is_tensor_parallel(mesh) and not is_tensor_parallel(mesh[DATA]) and not is_tensor_parallel(None)
    with pytest.raises(RuntimeError, match="when the processes start"):
        _ = ParallelDims.resolve(1, 1, 1, 1).pipeline_group


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(4), nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.trunk = nn.ModuleDict({"body": nn.ModuleList([_Block(), _Block()]), "norm": nn.LayerNorm(4)})
        self.head = nn.Linear(4, 8)


def test_the_modules_outside_the_blocks_that_a_rank_holds():
    model = _Model()
    blocks = {id(b) for b in model.trunk["body"]}
    everything = {id(p) for p in model.parameters()}
    # outermost modules without a block, walking into the containers that hold blocks
    assert outside_modules(model, blocks, everything) == [model.embed, model.trunk["norm"], model.head]
    last_stage = {id(p) for m in (model.trunk["norm"], model.head) for p in m.parameters()}
    assert outside_modules(model, blocks, last_stage) == [model.trunk["norm"], model.head]


def test_recorded_styles_apply_to_this_ranks_own_modules_only(group):
    tp_mesh = ParallelDims.resolve(1, 1, 1, 1).build("cpu", "gloo", None)[DATA]  # a 1-D mesh of one rank
    model = _Model()
    with recording(model) as calls:
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            "trunk.norm": SequenceParallel(),
        })
        parallelize_module(model.trunk["body"][0], tp_mesh, {"proj": ColwiseParallel()})
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # recorded, nothing split yet
    assert [(type(s).__name__, t) for s, t, _ in calls.styles] == [
        ("RowwiseParallel", model.embed), ("ColwiseParallel", model.head), ("SequenceParallel", model.trunk["norm"]),
        ("ColwiseParallel", model.trunk["body"][0].proj),
    ]
    named = [(f"trunk.body.{i}", b) for i, b in enumerate(model.trunk["body"])]
    split = recorded_plan(calls.styles, model, named, 1)
    assert split.outside is not None
    split.block(model.trunk["body"][1], tp_mesh)  # a block nothing was asked for: unchanged
    split.outside(model.head, tp_mesh)  # the last stage's head: only its own style
    assert isinstance(model.head.weight, DTensor) and not isinstance(model.embed.weight, DTensor)
    assert not any(isinstance(p, DTensor) for p in model.trunk.parameters())
    split.block(model.trunk["body"][0], tp_mesh)
    assert isinstance(model.trunk["body"][0].proj.weight, DTensor)
    torch.testing.assert_close(model.head.weight.full_tensor().shape, torch.Size([8, 4]))
