"""Compiled blocks under every schedule, those that split the backward (zero bubble, DualPipeV) included: exact
against one eager device ([Note: compiled blocks], [Note: deferred weight gradients]).

Two stages on one process (one under 1F1B and GPipe; the boundary is torch's own hand-over, the second stage runs
torch's input- and weight-gradient actions), clipping and accumulation on, ``aot_eager`` (AOTAutograd's joint graph
and its compiled backward, without Inductor's C++ builds that would dominate CI's two cores). The cases torch itself
gets wrong are covered: a weight shared between blocks of both stages (pytorch#180952) and a custom
``autograd.Function`` in a block (pytorch#166577).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import models
import pytest
import torch
from helpers import fit_one_process
from torch import nn

from lightning_pipe import PipelineStrategy
from lightning_pipe._step import deferred_linear
from lightning_pipe.schedules import SCHEDULE_NAMES, schedule_spec

SPLITTING = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
AOT_EAGER = {"backend": "aot_eager"}


class _Scale(torch.autograd.Function):
    """A custom autograd function: ``x * w`` with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=tuple(range(grad.dim() - 1)))


class ScaledBlock(models.Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, models.DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(super().forward(x), self.scale)


class UserCompiled(models.TinyLM):
    """Blocks compiled as Lightning's docs advise (``block.compile()`` in ``configure_model``)."""

    def configure_model(self) -> None:
        for block in self.backbone[1:-2]:
            if not hasattr(block, "_compiled_call_impl") or block._compiled_call_impl is None:
                block.compile(**AOT_EAGER)


class SharedAndCustom(models.TinyLM):
    """Every block ends in a custom ``autograd.Function`` with a weight of its own, and the first and the last block
    share their MLP's output layer (on two stages: a tied weight)."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(1, 5):
            self.backbone[i] = ScaledBlock()
        self.backbone[4].mlp[2].weight = self.backbone[1].mlp[2].weight


class Conv1DBlock(models.Block):
    """GPT-2's layers: the attention's projections and the MLP are Hugging Face ``Conv1D`` (``x @ weight + bias``,
    the weight stored ``(in, out)``)."""

    def __init__(self) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        d = models.DIM
        self.qkv, self.proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.mlp = nn.Sequential(Conv1D(2 * d, d), nn.GELU(), Conv1D(d, 2 * d))


class GPT2Like(models.TinyLM):
    def __init__(self) -> None:
        super().__init__()
        for i in range(1, 5):
            self.backbone[i] = Conv1DBlock()


def _fitted(model: type, strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    losses, state = fit_one_process(model(), strategy, models.loader(n=16, batch_size=4), max_steps=2,
                                    gradient_clip_val=0.5, accumulate_grad_batches=2)
    return losses, {k.replace("._orig_mod", ""): v for k, v in state.items()}


def _assert_same(got: tuple, want: tuple) -> None:
    assert len(got[0]) == len(want[0]) == 4
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) < 1e-5
    assert set(got[1]) == set(want[1])
    assert max((got[1][k] - want[1][k]).abs().max().item() for k in want[1]) < 1e-5


class _Deferred:
    """Counts the linear weight gradients each stage's weight actions compute ([Note: deferred weight gradients])."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.applied: list[int] = []
        builder = deferred_linear.Deferral.builder

        def counted(deferral: deferred_linear.Deferral) -> Callable[[], None]:
            n = len(deferral._collected)
            run = builder(deferral)
            return lambda: (self.applied.append(n), run())[1]

        monkeypatch.setattr(deferred_linear.Deferral, "builder", counted)


def _check(model: type, compile: Any, schedule: str, reference: type, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.compiler.reset()
    want = _fitted(reference, "auto")
    stages = 2 if schedule_spec(schedule).multi_stage else 1
    strategy = PipelineStrategy(num_microbatches=2, schedule=schedule, stages_per_rank=stages, compile=compile)
    deferred = _Deferred(monkeypatch)
    got = _fitted(model, strategy)
    if schedule in SPLITTING:
        # 4 batches (2 steps of 2) of 2 microbatches, 2 stages: every weight action computed linear layers' gradients
        assert len(deferred.applied) == 4 * 2 * 2 and min(deferred.applied) > 0, deferred.applied
    else:  # torch's own full backward: nothing waits
        assert deferred.applied == []
    _assert_same(got, want)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_compiled_blocks_train_exactly(schedule, monkeypatch):
    """``compile=`` under every schedule: losses and weights equal one eager device's, with a weight shared by blocks
    of both stages and a custom autograd function in every block. Under the schedules that split the backward, the
    linear layers' weight gradients are computed in the weight actions ([Note: deferred weight gradients])."""
    _check(SharedAndCustom, AOT_EAGER, schedule, SharedAndCustom, monkeypatch)


def test_blocks_the_user_compiled_train_exactly_under_a_split_backward(monkeypatch):
    """Blocks compiled in ``configure_model`` (``block.compile()``) are recognised, with the same result."""
    _check(UserCompiled, False, "InterleavedZeroBubble", models.TinyLM, monkeypatch)


def test_conv1d_layers_defer_their_weight_gradients_exactly(monkeypatch):
    """Hugging Face ``Conv1D`` layers (GPT-2's) in compiled blocks under a schedule that splits the backward: every
    one of their weights and biases gets its gradient in the weight actions, and the run equals one eager device's."""
    from transformers.pytorch_utils import Conv1D

    swapped: set[int] = set()
    deferred: set[int] = set()
    deferred_class, accumulate = deferred_linear._deferred_class, deferred_linear._accumulate

    def recorded(layer: nn.Module) -> type:
        if isinstance(layer, Conv1D):
            swapped.update(id(p) for p in layer.parameters())
        return deferred_class(layer)

    monkeypatch.setattr(deferred_linear, "_deferred_class", recorded)
    monkeypatch.setattr(deferred_linear, "_accumulate", lambda p, g: (deferred.add(id(p)), accumulate(p, g))[1])
    torch.compiler.reset()
    want = _fitted(GPT2Like, "auto")
    got = _fitted(GPT2Like, PipelineStrategy(num_microbatches=2, schedule="ZBVZeroBubble", compile=AOT_EAGER))
    assert len(swapped) == 4 * 8 and swapped <= deferred  # 4 layers of weight and bias in each of the 4 blocks
    _assert_same(got, want)


def test_lengths_that_change_compile_once_more_and_stay_exact():
    """Batches of 6 sequence lengths: dynamo compiles each code it meets once static, then once with the length
    dynamic, however many lengths follow, so no graph is added after the second length. On torch 2.13 that is the
    blocks' and the head's (an ``nn.Linear``, compiled as the backbone's last module), 4 graphs; torch 2.15 also
    compiles the embedding and the norm (``Module.compile`` no longer leaves torch's own modules to run eagerly).
    The shape probes run compiled code eagerly, so they add none. The run equals one eager device's."""
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    lengths = [5, 9, 12, 7, 16, 3]
    batches = [(x, x) for x in (torch.randint(0, models.VOCAB, (4, t), generator=torch.Generator().manual_seed(t))
                                for t in lengths)]
    graphs: list[int] = []

    class Counted(models.TinyLM):
        def on_train_batch_end(self, *args: Any) -> None:
            graphs.append(counters["stats"]["unique_graphs"])

    def fitted(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        return fit_one_process(Counted(), strategy, DataLoader(batches, batch_size=None), max_steps=len(lengths))

    want = fitted("auto")
    torch.compiler.reset()
    counters.clear()
    graphs.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fitted(PipelineStrategy(num_microbatches=2, schedule="ZBVZeroBubble", compile=AOT_EAGER))
    assert 0 < graphs[0] < graphs[1] == graphs[-1] and len(graphs) == len(lengths), graphs
    assert graphs[-1] <= 8, dict(counters["stats"])  # 4 on torch 2.13, 6 on 2.15: two per code, four codes at most
    assert len(got[0]) == len(want[0]) == len(lengths)
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) < 1e-5
    assert max((got[1][k] - want[1][k]).abs().max().item() for k in want[1]) < 1e-5


#: Blocks split over two tensor ranks, in a process of its own (a fake process group: no peer runs, and the test's
#: process keeps no group): what defers, and what ``schedule="auto"`` weighs.
SPLIT_BLOCKS = """
import json, sys
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers.pytorch_utils import Conv1D
from lightning_pipe._compiled import whole_backward_warning
from lightning_pipe._lightning.options import validated_options
from lightning_pipe._model.backbone import find_backbone
from lightning_pipe._step.auto import _schedules_for
from lightning_pipe._step.deferred_linear import undeferred_split_layers

dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))

def block(odd):
    b = nn.ModuleDict({"norm": nn.LayerNorm(4), "up": nn.Linear(4, 8), "down": nn.Linear(8, 4, bias=False),
                       "whole": nn.Linear(4, 4), "odd": nn.Linear(4, 4), "conv": Conv1D(8, 4)})
    parallelize_module(b, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                 "down": RowwiseParallel(output_layouts=Shard(1))})
    if odd:  # split by output features with a replicated bias; a Conv1D split at all
        b.odd.weight = nn.Parameter(distribute_tensor(b.odd.weight.detach(), mesh, [Shard(0)]))
        b.odd.bias = nn.Parameter(distribute_tensor(b.odd.bias.detach(), mesh, [Replicate()]))
        b.conv.weight = nn.Parameter(distribute_tensor(b.conv.weight.detach(), mesh, [Shard(1)]))
    return b

split = validated_options(pipeline_parallel_size=2, schedule="auto", compile=True, tensor_parallel_size=2)
result = {}
for odd in (False, True):
    backbone = find_backbone(nn.ModuleDict({"layers": nn.ModuleList([block(odd), block(False)])}), "layers")
    blocks = [backbone.module(i) for i in range(len(backbone))]
    result[str(odd)] = {"undeferred": undeferred_split_layers(blocks), "schedules": _schedules_for(split, backbone)}
result["warning"] = whole_backward_warning("DualPipeV", result["True"]["undeferred"])
json.dump(result, sys.stdout)
"""


def test_auto_weighs_the_split_schedules_where_compiled_blocks_defer():
    """``schedule="auto"`` with compiled blocks: every schedule where the linear layers can defer their weight
    gradients: replicated, sharded, or split over tensor ranks by output or by input features (``ColwiseParallel``,
    ``RowwiseParallel``, sequence-parallel or not); where a block holds a layer split in another layout, only those
    that do not split the backward (the others would be credited a gain they do not have), and the warning names the
    layers and the fix."""
    import json
    import subprocess
    import sys

    from lightning_pipe._lightning.options import validated_options
    from lightning_pipe._step.auto import _schedules_for

    replicated = validated_options(pipeline_parallel_size=2, schedule="auto", compile=True)
    sharded = validated_options(pipeline_parallel_size=2, schedule="auto", compile=True, data_parallel="fsdp")
    split = validated_options(pipeline_parallel_size=2, schedule="auto", compile=True, tensor_parallel_size=2)
    assert _schedules_for(replicated, None) == _schedules_for(sharded, None) == _schedules_for(split, None)
    assert _schedules_for(split, None) == SCHEDULE_NAMES
    assert {"ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"} <= set(SCHEDULE_NAMES)

    run = subprocess.run([sys.executable, "-c", SPLIT_BLOCKS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout)
    assert got["False"] == {"undeferred": [], "schedules": list(SCHEDULE_NAMES)}
    assert got["True"]["undeferred"] == ["conv", "odd"]
    assert set(got["True"]["schedules"]) == {n for n in SCHEDULE_NAMES if not schedule_spec(n).splits_backward}
    assert "'conv', 'odd'" in got["warning"] and "ColwiseParallel" in got["warning"]


def test_deferred_weight_gradients_under_autocast_equal_torchs_split():
    """bf16-mixed: a compiled stage's linear layers cast as autocast casts ``F.linear`` and defer their weight
    gradients; losses and weights equal torch's own split of the eager stages, bit for bit (``aot_eager`` runs the
    same kernels)."""

    def fitted(compile: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        torch.compiler.reset()
        strategy = PipelineStrategy(num_microbatches=2, schedule="ZBVZeroBubble", compile=compile)
        return fit_one_process(models.TinyLM(), strategy, models.loader(n=16, batch_size=4), max_steps=3,
                               precision="bf16-mixed")

    eager, compiled = fitted(False), fitted(AOT_EAGER)
    assert eager[0] == compiled[0]
    assert all(torch.equal(eager[1][k], compiled[1][k]) for k in eager[1])


def test_a_parameter_reallocated_after_the_swap_gets_its_own_weight_gradient():
    """FSDP allocates its unsharded parameters when a unit unshards, after the layers were swapped, and an address may
    then come back for another parameter: the weight action adds to the parameter the layer registers at the call,
    never to a stale address's owner ([Note: deferred weight gradients])."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    want = [torch.autograd.grad(nn.Sequential(*layers)(x).sum(), [p for p in layers.parameters()])]
    deferral = deferred_linear.Deferral()
    with deferred_linear.deferred_linears([layers]) as swapped:
        assert swapped == 2
        first = layers[0].weight
        layers[0].weight = nn.Parameter(first.detach().clone())  # unsharded again, at a new address
        # the old parameter's address now said to be the second layer's weight: what reused storage looks like
        deferred_linear._PARAMS[layers[0].weight.data_ptr()] = (layers[1].weight, False)
        layers[1].bias = nn.Parameter(layers[1].bias.detach().clone())  # not the block's first: a unit of its own
        with deferral.collecting():
            layers(x).sum().backward()
        deferral.builder()()
    assert first.grad is None
    got = [layers[0].weight.grad, layers[0].bias.grad, layers[1].weight.grad, layers[1].bias.grad]
    assert all(g is not None for g in got)
    assert all(torch.allclose(g, w) for g, w in zip(got, want[0]))
    assert type(layers[0]) is nn.Linear and not deferred_linear._PARAMS and not deferred_linear._SWAPPED
