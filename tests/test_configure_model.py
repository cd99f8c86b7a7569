"""A ``configure_model`` and a ``backward`` override written for Lightning's ``ModelParallelStrategy``, in one process:
which ``backward`` overrides the pipeline honours ([Note: backward overrides] in ``lightning_pipe/_lightning/
backward.py``), and what the recorded ``fully_shard``/``checkpoint_wrapper``/``parallelize_module`` calls become
([Note: configure_model's calls] in ``lightning_pipe/_model/configure_model.py``). No process is started; a gloo group
of size 1 gives the meshes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import zoo
from models import TinyLM, loader
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_pipe import PipelineStrategy
from lightning_pipe._lightning.backward import _only_enters_a_context
from lightning_pipe._model.configure_model import ConfigureModelCalls, recording, sharding_of


# ------------------------------------------------------------------------------------------------ backward overrides
class Overrides(L.LightningModule):
    """``backward`` overrides as people write them (only their source is read)."""

    def as_lightnings_example(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def with_a_docstring_and_named_loss(self, loss, *args, **kwargs):
        """Parallel loss."""
        with loss_parallel():
            super().backward(loss, *args, **kwargs)

    def nested_and_bound(self, loss, *args, **kwargs):
        with loss_parallel() as entered:  # noqa: F841
            with torch.autograd.set_detect_anomaly(False):
                return super().backward(loss, *args, **kwargs)

    def two_contexts_in_one_with(self, loss, *args, **kwargs):
        with loss_parallel(), torch.autograd.set_detect_anomaly(False):
            super().backward(loss, *args, **kwargs)

    def only_calls_the_base(self, loss, *args, **kwargs):
        super().backward(loss, *args, **kwargs)

    def keyword_passed(self, loss, *args, **kwargs):
        with loss_parallel():
            super().backward(loss=loss, **kwargs)

    def calls_loss_backward(self, loss, *args, **kwargs):  # as LightningModule.backward's docstring does
        with loss_parallel():
            loss.backward(*args, **kwargs)

    def imports_what_it_enters(self, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    # ---- doing more than entering a context
    def scales_the_loss(self, loss, *args, **kwargs):
        with loss_parallel():
            super().backward(loss * 2, *args, **kwargs)

    def passes_something_else(self, loss, *args, **kwargs):
        with loss_parallel():
            super().backward(self.other_loss, *args, **kwargs)

    def calls_backward_on_a_scaled_loss(self, loss, *args, **kwargs):
        with loss_parallel():
            (loss * 2).backward()

    def calls_backward_on_something_else(self, loss, *args, **kwargs):
        with loss_parallel():
            self.other_loss.backward()

    def calls_backward_on_another_argument(self, loss, optimizer, *args, **kwargs):
        with loss_parallel():
            optimizer.backward()

    def calls_manual_backward(self, loss, *args, **kwargs):
        self.manual_backward(loss)

    def a_statement_before(self, loss, *args, **kwargs):
        with loss_parallel():
            self.calls = getattr(self, "calls", 0) + 1
            super().backward(loss, *args, **kwargs)

    def a_statement_after(self, loss, *args, **kwargs):
        with loss_parallel():
            super().backward(loss, *args, **kwargs)
        self.calls = getattr(self, "calls", 0) + 1

    def the_base_of_another_method(self, loss, *args, **kwargs):
        with loss_parallel():
            super().manual_backward(loss, *args, **kwargs)

    def a_branch(self, loss, *args, **kwargs):
        if self.training:
            with loss_parallel():
                super().backward(loss, *args, **kwargs)

    def does_nothing(self, loss, *args, **kwargs):
        pass


HONOURED = ["as_lightnings_example", "with_a_docstring_and_named_loss", "nested_and_bound",
            "two_contexts_in_one_with", "only_calls_the_base", "keyword_passed", "calls_loss_backward",
            "imports_what_it_enters"]
REFUSED = ["scales_the_loss", "passes_something_else", "calls_backward_on_a_scaled_loss",
           "calls_backward_on_something_else", "calls_backward_on_another_argument",
           "calls_manual_backward", "a_statement_before", "a_statement_after",
           "the_base_of_another_method", "a_branch", "does_nothing"]


@pytest.mark.parametrize("name", HONOURED)
def test_an_override_that_only_enters_a_context_is_honoured(name):
    assert _only_enters_a_context(getattr(Overrides, name))


@pytest.mark.parametrize("name", REFUSED)
def test_an_override_that_does_more_is_refused(name):
    assert not _only_enters_a_context(getattr(Overrides, name))


def test_an_override_without_source_is_refused():
    namespace: dict[str, Any] = {}
    exec("def backward(self, *args, **kwargs):\n    super().backward(*args, **kwargs)\n", namespace)
    assert not _only_enters_a_context(namespace["backward"])  # no source to read: not known to be harmless
    assert not _only_enters_a_context(print)
    assert not _only_enters_a_context(lambda self, *args, **kwargs: None)


class Counted(TinyLM):
    """Its ``backward`` override enters a context that counts how often it is entered (and how often a backward
    pass ran inside it)."""

    def __init__(self) -> None:
        super().__init__(blocks=2)
        self.entered = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.entered += 1
        yield

    def backward(self, *args, **kwargs):
        with self.counting():
            super().backward(*args, **kwargs)


class ScaledBackward(TinyLM):
    def backward(self, loss, *args, **kwargs):
        super().backward(loss * 0.5, *args, **kwargs)


def fit(model: L.LightningModule, pipelined: bool, steps: int = 2) -> L.Trainer:
    strategy = PipelineStrategy(num_microbatches=2, schedule="Interleaved1F1B", stages_per_rank=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, strategy=strategy if pipelined else "auto",
    )
    trainer.fit(model, loader(16, 8))
    return trainer


def test_a_backward_override_that_does_more_is_refused_at_setup_naming_it():
    model = ScaledBackward(blocks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"`test_configure_model\.ScaledBackward\.backward` overrides"
                                         r" `LightningModule\.backward`") as err:
        fit(model, pipelined=True)
    assert "super().backward(...)" in str(err.value) and "training_step" in str(err.value)  # the fix
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any step


def test_the_last_stages_backward_runs_through_an_override_that_enters_a_context():
    """One process, two stages (Interleaved1F1B): the override is entered once per microbatch of the last stage, and
    training is the one device's (where Lightning enters it once per step)."""
    torch.manual_seed(0)
    pipelined = Counted()
    torch.manual_seed(0)
    plain = Counted()
    fit(plain, pipelined=False)
    fit(pipelined, pipelined=True)
    assert plain.entered == 2
    assert pipelined.entered == 2 * 2  # steps x microbatches
    want, got = plain.state_dict(), pipelined.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)


# ------------------------------------------------------------------------------------------------ recorded calls


@pytest.fixture(scope="module")
def mesh(group):
    """Lightning's ``ModelParallelStrategy`` mesh on one process."""
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_calls(*calls: tuple[Any, dict]) -> ConfigureModelCalls:
    return ConfigureModelCalls(shards=list(calls))


def test_no_fully_shard_asks_for_no_sharding():
    assert sharding_of(ConfigureModelCalls(), [nn.Linear(2, 2)], None) is None
    assert sharding_of(ConfigureModelCalls(), [nn.Linear(2, 2)], "ddp") is None


def test_the_examples_calls_give_the_policy_and_reshard_per_block(mesh):
    blocks = [nn.Linear(2, 2) for _ in range(3)]
    root = nn.Sequential(*blocks)
    dp = mesh["data_parallel"]
    calls = shard_calls(
        *[(b, {"mesh": dp, "mp_policy": BF16, "reshard_after_forward": i < 2}) for i, b in enumerate(blocks)],
        (root, {"mesh": dp, "mp_policy": BF16}),
    )
    for data_parallel in (None, "fsdp"):
        sharding = sharding_of(calls, blocks, data_parallel)
        assert sharding is not None and sharding.mp_policy == BF16
        assert sharding.reshard_after_forward == {id(blocks[0]): True, id(blocks[1]): True, id(blocks[2]): False}
    # a list of modules in one call; no policy given is the default policy
    listed = sharding_of(shard_calls((blocks[:2], {"reshard_after_forward": False})), blocks, None)
    assert listed is not None and listed.mp_policy == MixedPrecisionPolicy()
    assert listed.reshard_after_forward == {id(blocks[0]): False, id(blocks[1]): False}


def test_policies_that_differ_are_refused():
    blocks = [nn.Linear(2, 2) for _ in range(2)]
    calls = shard_calls((blocks[0], {"mp_policy": BF16}), (blocks[1], {}))
    with pytest.raises(ValueError, match="different `MixedPrecisionPolicy`s.*Pass the same `mp_policy`"):
        sharding_of(calls, blocks, None)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32)
    with pytest.raises(ValueError, match="different `MixedPrecisionPolicy`s"):
        sharding_of(shard_calls((blocks[0], {"mp_policy": BF16}), (blocks[1], {"mp_policy": fp32})), blocks, None)


def test_arguments_it_cannot_honour_are_refused_by_name():
    from torch.distributed.fsdp import CPUOffloadPolicy

    block = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"fully_shard\(\.\.\., offload_policy=\.\.\.\)`.*honours `mesh`,"
                                         r" `reshard_after_forward` and `mp_policy` only"):
        sharding_of(shard_calls((block, {"offload_policy": CPUOffloadPolicy()})), [block], None)
    with pytest.raises(ValueError, match=r"fully_shard\(\.\.\., ignored_params=\.\.\., shard_placement_fn=\.\.\.\)`"):
        sharding_of(shard_calls((block, {"shard_placement_fn": None, "ignored_params": set()})), [block], None)


class _Mesh:
    """What ``sharding_of`` reads of a ``DeviceMesh``: its dimensions' names and sizes (no group of this size here)."""

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        self.mesh_dim_names, self.shape, self.ndim = names, sizes, len(sizes)

    def size(self, dim: int) -> int:
        return self.shape[dim]


def test_a_mesh_spanning_two_dimensions_is_refused_with_hsdp(mesh):
    """Lightning's fp8 example passes the whole mesh, ``(data_parallel, tensor_parallel)`` of size ``(4, 1)``: plain
    sharding, as is the pipeline's own mesh (its pipeline dimension is never sharded over); two dimensions of more
    than one process are hybrid sharding."""
    block = nn.Linear(2, 2)
    assert sharding_of(shard_calls((block, {"mesh": mesh})), [block], None) is not None
    assert sharding_of(shard_calls((block, {"mesh": mesh["data_parallel"]})), [block], None) is not None
    ours = _Mesh(("data_parallel", "pipeline_parallel", "tensor_parallel"), (2, 2, 1))
    assert sharding_of(shard_calls((block, {"mesh": ours})), [block], None) is not None
    hybrid = _Mesh(("replicate", "shard"), (2, 2))
    with pytest.raises(ValueError, match=r"mesh of several dimensions \(replicate, shard\) \(hybrid sharding\)"
                                         r".*data_parallel='hsdp'"):
        sharding_of(shard_calls((block, {"mesh": hybrid})), [block], None)


@pytest.mark.parametrize("data_parallel", ["ddp", "hsdp"])
def test_fully_shard_against_another_data_parallel_argument_is_refused(data_parallel):
    block = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"calls `fully_shard`.*`PipelineStrategy\(data_parallel='{data_parallel}'\)`"
                                         r".*Drop the argument \(or pass 'fsdp'\)"):
        sharding_of(shard_calls((block, {})), [block], data_parallel)


def test_the_examples_configure_model_is_recorded_not_applied(mesh):
    """Lightning's example's ``parallelize`` (tensor-parallel plan on the outside modules and the blocks, then
    ``checkpoint_wrapper`` and ``fully_shard`` per block and on the root), run while recording: nothing is split,
    wrapped or sharded, and what was asked for is kept against the model's own modules."""
    model = zoo.make("llama_sp")
    blocks = list(model.layers)
    names = set(dict(model.named_parameters()))
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    with recording(model) as calls:
        parallelize_module(model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        for block in model.layers:
            parallelize_module(block, tp, {"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel()})
        for i, block in enumerate(list(model.layers)):
            wrapped = checkpoint_wrapper(block)
            fully_shard(wrapped, mesh=dp, mp_policy=BF16, reshard_after_forward=i < len(blocks) - 1)
            model.layers[i] = wrapped
        fully_shard(model, mesh=dp, mp_policy=BF16)
    assert list(model.layers) == blocks  # the wrappers are taken off again: the names are the model's own
    assert set(dict(model.named_parameters())) == names
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # nothing split
    assert not any(isinstance(m, FSDPModule) for m in model.modules())  # nothing sharded
    assert [id(m) for m in calls.checkpointed] == [id(b) for b in blocks]
    assert [id(target) for target, _ in calls.shards] == [id(b) for b in blocks] + [id(model)]
    styled = [(type(style).__name__, target) for style, target, _ in calls.styles]
    assert ("RowwiseParallel", model.tok_embeddings) in styled and ("SequenceParallel", model.norm) in styled
    assert ("ColwiseParallel", model.output) in styled and ("ColwiseParallel", blocks[3].attention.wq) in styled
    sharding = sharding_of(calls, blocks, None)
    assert sharding is not None and sharding.mp_policy == BF16
    assert sharding.reshard_after_forward == {id(b): i < 3 for i, b in enumerate(blocks)}
