"""Lightning's tensor-parallel example (``examples/tensor_parallel``) under ``PipelineStrategy``, against Lightning's
``ModelParallelStrategy`` on the same LightningModule (the example's ``Llama3``) and against one process.

The module is the example's as published: ``training_step(self, batch)`` without ``batch_idx``, a ``backward``
override that enters ``loss_parallel()``, and a ``configure_model`` that splits the embedding, the final norm and the
head as well as the blocks, with sequence parallelism, a vocabulary-sharded head output and, with data parallelism,
``checkpoint_wrapper``, ``fully_shard`` per block and on the root, and a bf16 ``MixedPrecisionPolicy``. Only its
``on_train_start`` (which draws new weights on the sharded tensors, each strategy with its own random numbers) is
replaced by loading one full state dict, so that every run starts from the same weights (``tests/tp_example_job.py``).

Lightning's fp8 example (``examples/pytorch/fp8_distributed_transformer``, ``tests/fp8_example.py``: FSDP2 and
``torch.compile`` in ``configure_model``, batches of one, float8 aside) shares the launch of two processes.

Launches, shared by the tests: two processes (``ModelParallelStrategy`` tp2, AdamW and SGD; then the fp8 example under
``PipelineStrategy(pipeline_parallel_size=2)`` in fp32 and in ``bf16-true``), four processes
(``ModelParallelStrategy`` dp2 x tp2 with the example's bf16 policy and with an fp32 one; then ``PipelineStrategy``
pp2 x tp2 with SGD and AdamW, pp1 x dp2 x tp2 with the fp32 and the bf16 policy, and last the example's own
``train()``, whose ``on_train_start`` is not replaced);
one process in this one (SGD, AdamW; the fp8 example in both precisions). A launch stops at its first failing phase:
the phases of ``ModelParallelStrategy`` come first, so its results are there whatever the pipeline does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import tp_example_job
from helpers import merged_state, run_script

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

TP2 = {"data_parallel_size": 1, "tensor_parallel_size": 2}
DP2_TP2 = {"data_parallel_size": 2, "tensor_parallel_size": 2}
PP2_TP2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}  # the example's strategy line
PP1_DP2_TP2 = {"pipeline_parallel_size": 1, "data_parallel_size": 2, "tensor_parallel_size": 2}
SHARDED = {"use_distributed_sampler": True}  # two replicas: the same sampler (replica count, seed) under both

FP8 = {"fp8": True, "strategy": "pipeline", "strategy_kwargs": {"pipeline_parallel_size": 2}}  # the strategy line
TWO = [
    {"name": "mps_tp2_adamw", "strategy": "model_parallel", "strategy_kwargs": TP2},
    {"name": "mps_tp2_sgd", "strategy": "model_parallel", "strategy_kwargs": TP2, "optimizer": "sgd"},
    {"name": "fp8_pp2_fp32", **FP8, "precision": "32-true"},
    {"name": "fp8_pp2_bf16", **FP8, "precision": "bf16-true"},  # the example's own precision
]
FOUR = [
    {"name": "mps_dp2_tp2_bf16", "strategy": "model_parallel", "strategy_kwargs": DP2_TP2, **SHARDED},
    {"name": "mps_dp2_tp2_fp32", "strategy": "model_parallel", "strategy_kwargs": DP2_TP2, **SHARDED,
     "fp32_policy": True},
    {"name": "pp2_tp2_sgd", "strategy": "pipeline", "strategy_kwargs": PP2_TP2, "optimizer": "sgd"},
    {"name": "pp2_tp2_adamw", "strategy": "pipeline", "strategy_kwargs": PP2_TP2},
    {"name": "pp1_dp2_tp2_fp32", "strategy": "pipeline", "strategy_kwargs": PP1_DP2_TP2, **SHARDED,
     "fp32_policy": True},
    {"name": "pp1_dp2_tp2_bf16", "strategy": "pipeline", "strategy_kwargs": PP1_DP2_TP2, **SHARDED},
    {"name": "example_pipeline", "example": True},  # train.py's train() as published: PipelineStrategy, pp2 x tp2
]
ONE = [{"name": "one_adamw"}, {"name": "one_sgd", "optimizer": "sgd"}]


class Launch:
    def __init__(self, out: Path, devices: int, log: str) -> None:
        self.out, self.devices, self.log = out, devices, log

    def ranks(self, name: str) -> list[dict[str, Any]]:
        """Every rank's results of phase ``name``; fails with the phase's error, or the launch's log when the phase
        left nothing (an earlier phase failed, or the launch timed out)."""
        results = []
        for r in range(self.devices):
            path = self.out / f"{name}.rank{r}.pt"
            if not path.exists():
                failed = sorted({f.name.split(".")[0] for f in self.out.glob("*.pt")
                                 if torch.load(f, weights_only=False)["error"] is not None})
                pytest.fail(f"phase {name} left no results for rank {r} (phases that failed: {failed or 'none'}); "
                            f"the launch's log ends:\n{self.log[-6000:]}")
            result = torch.load(path, weights_only=False)
            if result["error"] is not None:
                pytest.fail(f"phase {name} failed on rank {r}:\n{result['error'][-6000:]}")
            results.append(result)
        return results


def launch(work: Path, name: str, devices: int, phases: list[dict[str, Any]], timeout: float) -> Launch:
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"devices": devices, "phases": phases}))
    out = work / name
    try:
        log = run_script([str(HERE / "tp_example_job.py"), str(spec), str(out)], cwd=work, timeout=timeout).stdout
    except AssertionError as err:  # timed out; the process group is killed, the phases done so far are kept
        log = str(err)
    return Launch(out, devices, log)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_example")


@pytest.fixture(scope="module")
def two(work) -> Launch:
    return launch(work, "two", 2, TWO, timeout=300)


@pytest.fixture(scope="module")
def four(work, two) -> Launch:  # after `two`: one multi-process launch at a time
    return launch(work, "four", 4, FOUR, timeout=900)


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    """The full weights every run starts from."""
    try:
        return tp_example_job.full_weights()
    finally:
        tp_example_job.forget_example()


@pytest.fixture(scope="module")
def one() -> dict[str, dict[str, Any]]:
    """One process, in this one (``Trainer(devices=1)``, no strategy): the batches in order, as the dp1 runs."""
    try:
        return {p["name"]: tp_example_job.run_phase(p, 1) for p in ONE}
    finally:
        tp_example_job.forget_example()


def losses(results: list[dict[str, Any]]) -> list[float]:
    """The loss of every step, averaged over the data-parallel replicas; the same on every rank."""
    per_rank = [[s["mean_loss"] for s in r["steps"]] for r in results]
    assert all(p == per_rank[0] for p in per_rank), per_rank
    assert len(per_rank[0]) == tp_example_job.STEPS, per_rank[0]
    return per_rank[0]


def largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    wide = {torch.complex64: torch.complex128, torch.complex128: torch.complex128}
    return max((x.to(wide.get(x.dtype, torch.float64)) - y.to(wide.get(y.dtype, torch.float64))).abs().max().item()
               for k in a for x, y in [(a[k], b[k])])


def compare(
    got: list[dict[str, Any]], want: list[dict[str, Any]], full: dict[str, torch.Tensor], atol: float,
    params: bool = True,
) -> float:
    """Both runs start from the same full weights, log the same losses step by step and, with ``params``, end with
    the same weights (the union over the ranks), within ``atol``; returns the largest difference."""
    start = merged_state(got, "initial")
    assert largest(start, merged_state(want, "initial")) == 0.0, "the runs did not start from the same weights"
    assert largest(start, full) == 0.0, "the full weights were not loaded"
    diffs = [abs(a - b) for a, b in zip(losses(got), losses(want))]
    worst = max(diffs)
    assert worst < atol, f"losses differ by up to {worst:.2e}: {losses(got)} vs {losses(want)}"
    if params:
        end, want_end = merged_state(got), merged_state(want)
        moved = largest(want_end, merged_state(want, "initial"))
        assert moved > 20 * atol, f"the weights moved by {moved:.1e} only: the comparison would prove little"
        worst_param = largest(end, want_end)
        assert worst_param < atol, f"final parameters differ by up to {worst_param:.2e}"
        worst = max(worst, worst_param)
    return worst


def test_the_references_agree(two, one, full):
    """The harness is sound: ``ModelParallelStrategy`` tp2 and one process, from the same weights on the same
    batches, agree within the tolerances the pipeline is held to (1e-5 with SGD, 2e-4 with AdamW)."""
    sgd = compare(two.ranks("mps_tp2_sgd"), [one["one_sgd"]], full, atol=1e-5)
    adamw = compare(two.ranks("mps_tp2_adamw"), [one["one_adamw"]], full, atol=2e-4)
    print(f"one process against ModelParallelStrategy tp2: SGD {sgd:.1e}, AdamW {adamw:.1e}; "
          f"AdamW losses {losses([one['one_adamw']])}")


def test_the_bf16_policy_tracks_fp32_under_model_parallel(four, full):
    """The example's ``fully_shard`` branch under ``ModelParallelStrategy`` dp2 x tp2: its bf16 policy computes in
    bf16 (the tolerance of the pipeline's bf16 comparison is meaningful), the fp32 variant in fp32."""
    bf16, fp32 = four.ranks("mps_dp2_tp2_bf16"), four.ranks("mps_dp2_tp2_fp32")
    diff = compare(bf16, fp32, full, atol=5e-2, params=False)
    assert diff > 1e-6, "the bf16 policy computed as fp32"
    assert all(r["param_dtypes"] == ["torch.float32"] for r in bf16 + fp32)  # the sharded weights stay fp32
    print(f"ModelParallelStrategy dp2 x tp2, bf16 against fp32 policy: losses {diff:.1e} apart")


def test_pp2_tp2_trains_as_model_parallel_tp2_with_adamw(two, four, full):
    worst = compare(four.ranks("pp2_tp2_adamw"), two.ranks("mps_tp2_adamw"), full, atol=2e-4)
    print(f"pp2 x tp2 against ModelParallelStrategy tp2 (AdamW): {worst:.1e}")


def test_pp2_tp2_trains_as_one_process_with_sgd(four, one, full):
    worst = compare(four.ranks("pp2_tp2_sgd"), [one["one_sgd"]], full, atol=1e-5)
    print(f"pp2 x tp2 against one process (SGD): {worst:.1e}")


def test_pp1_dp2_tp2_trains_as_model_parallel_dp2_tp2_in_fp32(four, full):
    """The example's ``fully_shard`` branch (``checkpoint_wrapper``, ``fully_shard`` per block and on the root) with
    an fp32 ``MixedPrecisionPolicy``, under both strategies."""
    worst = compare(four.ranks("pp1_dp2_tp2_fp32"), four.ranks("mps_dp2_tp2_fp32"), full, atol=2e-4)
    print(f"pp1 x dp2 x tp2 against ModelParallelStrategy dp2 x tp2 (fp32 policy): {worst:.1e}")


def test_pp1_dp2_tp2_trains_as_model_parallel_dp2_tp2_in_bf16(four, full):
    """The same with the example's own bf16 ``MixedPrecisionPolicy``: the losses within 5e-3."""
    worst = compare(four.ranks("pp1_dp2_tp2_bf16"), four.ranks("mps_dp2_tp2_bf16"), full, atol=5e-3, params=False)
    print(f"pp1 x dp2 x tp2 against ModelParallelStrategy dp2 x tp2 (bf16 policy): losses {worst:.1e}")


def test_the_example_trains_as_published_under_the_pipeline(four):
    """``examples/tensor_parallel/train.py``'s ``train()``: ``PipelineStrategy(pipeline_parallel_size=2,
    tensor_parallel_size=2)`` on 4 processes, its own ``on_train_start`` re-initialising the sharded weights."""
    four.ranks("example_pipeline")
    assert "Training successfully completed!" in four.log, four.log[-4000:]


# ------------------------------------------------------------------------------------------- Lightning's fp8 example
@pytest.fixture(scope="module")
def fp8_one() -> dict[str, dict[str, Any]]:
    """The fp8 example on one process, in this one, without a strategy (nothing to shard), compiled the same way."""
    import fp8_example

    try:
        return {p: fp8_example.run_phase({"precision": p}, 1, tp_example_job.Recorder())
                for p in ("32-true", "bf16-true")}
    finally:
        torch.compiler.reset()


def fp8_compare(got: list[dict[str, Any]], want: dict[str, Any], **tolerance: float) -> tuple[float, float]:
    """The same start, the same loss at every batch and the same final weights on every rank, within ``tolerance``
    (``torch.testing.assert_close``'s); the compiled module ran compiled on every rank. Returns the largest
    differences of the losses and of the weights."""
    import fp8_example

    assert largest(merged_state(got, "initial"), want["initial"]) == 0.0, "the runs did not start from the same weights"
    want_losses = [s["loss"] for s in want["steps"]]
    assert len(want_losses) == fp8_example.BATCHES
    for r in got:
        torch.testing.assert_close([s["loss"] for s in r["steps"]], want_losses, **tolerance)
        assert r["graphs"] > 0, f"rank {r['rank']}: dynamo compiled nothing: the user's compiled module ran eagerly"
    end = merged_state(got)
    assert largest(want["state_dict"], want["initial"]) > 1e-4, "the weights did not move"
    for k, v in want["state_dict"].items():
        torch.testing.assert_close(end[k], v, **tolerance, msg=lambda m, k=k: f"{k}: {m}")
    return (max(abs(s["loss"] - w) for r in got for s, w in zip(r["steps"], want_losses)),
            largest(end, want["state_dict"]))


def test_the_fp8_example_trains_under_the_pipeline_as_one_process_in_fp32(two, fp8_one):
    """Lightning's fp8 example with only the strategy line changed (``fully_shard`` with the whole mesh, a
    ``torch.compile``d model, batches of one): losses and final weights within 1e-5 of one process."""
    got = two.ranks("fp8_pp2_fp32")
    assert all(r["param_dtypes"] == ["torch.float32"] for r in got)
    losses_apart, weights_apart = fp8_compare(got, fp8_one["32-true"], rtol=0.0, atol=1e-5)
    print(f"fp8 example, pp2 against one process (fp32): losses {losses_apart:.1e}, weights {weights_apart:.1e}")


def test_the_fp8_example_trains_under_the_pipeline_as_one_process_in_bf16_true(two, fp8_one):
    """The same in the example's ``bf16-true``. With one microbatch both run the same bf16 operations in the same
    order, but gradients are reduced and Adam steps in bf16 in another grouping: weights may differ by one bf16
    rounding step (a relative 2**-7), which is the tolerance (losses too)."""
    got = two.ranks("fp8_pp2_bf16")
    assert all(r["param_dtypes"] == ["torch.bfloat16"] for r in got)
    losses_apart, weights_apart = fp8_compare(got, fp8_one["bf16-true"], rtol=2**-7, atol=1e-5)
    print(f"fp8 example, pp2 against one process (bf16-true): losses {losses_apart:.1e}, weights {weights_apart:.1e}")
