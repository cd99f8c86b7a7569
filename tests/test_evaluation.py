"""Validation, test and prediction through the pipeline equal single-device runs (fp32, CPU, gloo).

Each job below runs once in real processes (``tests/eval_job.py``, launched the way a user launches a script)
and once on one device without a strategy, in this process; several tests then read the same pair of runs.
Loaders are unshuffled and ``use_distributed_sampler=False`` (except where replicas split the data), so both
runs see the same batches.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import merged_state, run_script

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
EVAL_JOB = HERE / "eval_job.py"
ATOL = 1e-5

# 2 stages, 1F1B: validate before training, fit with validation every 3 steps and at each epoch end, validate
# again, fit one more epoch on the same trainer, then test and predict. Every loader has a ragged last batch:
# train 42 = 5*8 + 2 and val 18 = 2*8 + 2 end with a batch smaller than num_microbatches; test ends with a
# batch of 1 and predict with a batch of 1.
TWO_STAGES = {
    "devices": 2,
    "strategy": {"num_microbatches": 4},
    "model": {"num_val_loaders": 2, "step_metric": True},
    "train": {"n": 42, "batch_size": 8},
    "val": [{"n": 20, "batch_size": 8, "seed": 1}, {"n": 18, "batch_size": 8, "seed": 2}],
    "test": {"n": 17, "batch_size": 8, "seed": 3},
    "predict": {"n": 13, "batch_size": 4, "seed": 4},
    "checkpoint": {"monitor": "val_loss", "save_top_k": 2},
    "lr_monitor": True,
    "writer": True,
    "trainer": {"max_epochs": 2, "val_check_interval": 3, "num_sanity_val_steps": 2},
    "ops": [
        {"op": "validate"},
        {"op": "fit"},
        {"op": "validate"},
        {"op": "fit", "max_epochs": 3},
        {"op": "test"},
        {"op": "predict"},
    ],
}

# 4 processes, 2 virtual stages each (8 stages): validation every 2nd epoch, EarlyStopping and ModelCheckpoint on
# val_loss (it improves once, then worsens: training stops at epoch 5 of 20), then test and predict. The val and
# test sets end with a batch of 1 and the training set with a batch of 2 (fewer than 4 microbatches).
FOUR_STAGES = {
    "devices": 4,
    "strategy": {"schedule": "Interleaved1F1B", "num_microbatches": 4},
    "model": {"blocks": 6, "lr": 0.03},
    "train": {"n": 26, "batch_size": 8},
    "val": {"n": 17, "batch_size": 8, "seed": 1},
    "test": {"n": 17, "batch_size": 8, "seed": 3},
    "predict": {"n": 9, "batch_size": 4, "seed": 4},
    "checkpoint": {"monitor": "val_loss", "save_top_k": 2},
    "early_stopping": {"monitor": "val_loss", "patience": 1, "min_delta": 0.0},
    "trainer": {"max_epochs": 20, "check_val_every_n_epoch": 2},
    "ops": [{"op": "fit"}, {"op": "test"}, {"op": "predict"}],
}

# BatchNorm in the backbone. Training uses one microbatch per batch: with more, every microbatch is its own
# BatchNorm batch (as every device is under DDP) and the statistics differ from single-device by design.
BATCHNORM = {
    "devices": 2,
    "strategy": {"schedule": "GPipe", "num_microbatches": 1},
    "model": {"batchnorm": True},
    "train": {"n": 42, "batch_size": 8},
    "val": {"n": 20, "batch_size": 8, "seed": 1},
    "test": {"n": 17, "batch_size": 8, "seed": 3},
    "predict": {"n": 9, "batch_size": 4, "seed": 4},
    "trainer": {"max_epochs": 2},
    "ops": [{"op": "validate"}, {"op": "fit"}, {"op": "validate"}, {"op": "test"}, {"op": "predict"}],
}

# 2 replicas of a 2-stage pipeline with BatchNorm, each replica evaluating its own half of the data through
# Lightning's distributed samplers; the prediction writer writes once per replica.
REPLICAS = {
    "devices": 4,
    "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 2},
    "use_distributed_sampler": True,
    "model": {"batchnorm": True},
    "val": {"n": 32, "batch_size": 8, "seed": 1},
    "predict": {"n": 13, "batch_size": 4, "seed": 4},
    "writer": True,
    "ops": [{"op": "validate"}, {"op": "predict"}],
}

# Exact AUROC keeps every prediction and target in list ("cat") states; the stages that never run the step hold
# empty lists when compute() syncs over the world. Validated twice: the states are reset in between.
LIST_STATES = {
    "devices": 2,
    "strategy": {"num_microbatches": 2},
    "model": {"auroc": True},
    "val": {"n": 20, "batch_size": 8, "seed": 1},
    "ops": [{"op": "validate"}, {"op": "validate"}],
}


class Runs:
    """The pipelined run (every rank's results) and the single-device reference of one spec."""

    def __init__(self, spec: dict[str, Any], root: Path, timeout: float = 120) -> None:
        self.spec = spec
        self.out = root / "pipelined"
        self.ref_out = root / "reference"
        spec_file = root / "spec.json"
        spec_file.write_text(json.dumps(spec))
        proc = run_script([str(EVAL_JOB), str(spec_file), str(self.out)], cwd=root, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-8000:]
        self.ranks = [torch.load(self.out / f"rank{r}.pt", weights_only=False) for r in range(spec["devices"])]
        sys.path.insert(0, str(HERE))
        import eval_job

        eval_job.run({k: v for k, v in spec.items() if k not in ("devices", "strategy")}, self.ref_out)
        self.ref = torch.load(self.ref_out / "rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(TWO_STAGES, tmp_path_factory.mktemp("two_stages"))


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(FOUR_STAGES, tmp_path_factory.mktemp("four_stages"))


@pytest.fixture(scope="module")
def batchnorm(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(BATCHNORM, tmp_path_factory.mktemp("batchnorm"))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(REPLICAS, tmp_path_factory.mktemp("replicas"))


@pytest.fixture(scope="module")
def list_states(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(LIST_STATES, tmp_path_factory.mktemp("list_states"), timeout=90)


# ----------------------------------------------------------------------------------------------- comparisons
def assert_same_values(got: dict[str, float], want: dict[str, float], what: str) -> float:
    """Same keys and values within ATOL; returns the largest difference."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    worst = max((abs(got[k] - want[k]) for k in want), default=0.0)
    assert worst < ATOL, f"{what}: differs by up to {worst:.2e}: {got} vs {want}"
    return worst


def assert_same_validations(runs: Runs) -> float:
    """Every validation (standalone or inside fit) on every rank logged what the single-device run logged."""
    want = runs.ref["validations"]
    assert want
    worst = 0.0
    for rank, r in enumerate(runs.ranks):
        got = r["validations"]
        assert [(v["fn"], v["epoch"], v["step"]) for v in got] == [(v["fn"], v["epoch"], v["step"]) for v in want]
        for i, (g, w) in enumerate(zip(got, want)):
            worst = max(worst, assert_same_values(g["metrics"], w["metrics"], f"rank {rank}, validation {i}"))
    return worst


def assert_same_ops(runs: Runs, kind: str) -> None:
    """What ``trainer.<kind>`` returned and left in ``callback_metrics`` equals the single-device run."""
    want = [op for op in runs.ref["ops"] if op["op"] == kind]
    for rank, r in enumerate(runs.ranks):
        got = [op for op in r["ops"] if op["op"] == kind]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_values(g["callback_metrics"], w["callback_metrics"], f"rank {rank}, {kind} callback_metrics")
            if kind in ("validate", "test"):
                assert len(g["returned"]) == len(w["returned"])
                for gd, wd in zip(g["returned"], w["returned"]):
                    assert_same_values(gd, wd, f"rank {rank}, {kind} returned")


def assert_same_training(runs: Runs) -> tuple[float, float]:
    """Training losses of every step and the final state (parameters and buffers); returns the largest diffs."""
    want = runs.ref["train_losses"]
    worst_loss = 0.0
    for rank, r in enumerate(runs.ranks):
        got = r["train_losses"]
        assert len(got) == len(want), (rank, len(got), len(want))
        worst_loss = max(worst_loss, *(abs(a - b) for a, b in zip(got, want)))
        assert worst_loss < ATOL, f"rank {rank}: training losses differ by up to {worst_loss:.2e}"
        assert r["global_step"] == runs.ref["global_step"]
        assert r["current_epoch"] == runs.ref["current_epoch"]
    merged = merged_state(runs.ranks)
    assert set(merged) == set(runs.ref["state_dict"])
    worst = max((merged[k].float() - runs.ref["state_dict"][k].float()).abs().max().item() for k in merged)
    assert worst < ATOL, f"final state differs by up to {worst:.2e}"
    return worst_loss, worst


def assert_same_predictions(runs: Runs) -> float:
    """``trainer.predict`` returned the single-device logits (within ATOL) and tokens on every rank."""
    want = next(op for op in runs.ref["ops"] if op["op"] == "predict")["returned"]
    worst = 0.0
    for r in runs.ranks:
        got = next(op for op in r["ops"] if op["op"] == "predict")["returned"]
        assert [p["logits"].shape for p in got] == [p["logits"].shape for p in want]
        for g, w in zip(got, want):
            worst = max(worst, (g["logits"] - w["logits"]).abs().max().item())
            assert torch.equal(g["tokens"], w["tokens"])
    assert worst < ATOL, f"predicted logits differ by up to {worst:.2e}"
    return worst


def assert_modes(r: dict[str, Any], fns: set[str]) -> None:
    """Backbone modules ran in train mode with autograd in training, in eval mode without it otherwise."""
    expected = {"train": {(True, True)}, "validate": {(False, False)}, "test": {(False, False)}}
    expected["predict"] = expected["validate"]
    for fn in fns:
        if fn in r["modes"]:  # only the ranks holding a probe (first and last module) record calls
            assert r["modes"][fn] == expected[fn], (fn, r["modes"][fn])
        assert r["modes"][fn + "_modules"] == {fn == "train"}, (fn, r["modes"][fn + "_modules"])


# ------------------------------------------------------------------------------------------------ 2 stages
def test_validation_inside_and_outside_fit(two_stages: Runs) -> None:
    """val loss, torchmetrics accuracy (logged as a Metric per dataloader and computed in on_validation_epoch_end),
    two val dataloaders, val_check_interval and epoch-end validation, fit -> validate -> fit: single-device values on
    every rank."""
    keys = set(two_stages.ranks[0]["validations"][0]["metrics"])
    assert {"val_loss", "val_loss_1", "val_acc/dataloader_idx_0", "val_acc/dataloader_idx_1", "val_acc_manual"} <= keys
    fns = [v["fn"] for v in two_stages.ref["validations"]]
    assert fns == ["validate", "fit", "fit", "fit", "fit", "validate", "fit", "fit"], fns
    worst = assert_same_validations(two_stages)
    assert_same_ops(two_stages, "validate")
    print(f"2 stages: logged validation values differ by up to {worst:.1e}")


def test_training_with_ragged_batches_and_validation_matches(two_stages: Runs) -> None:
    """drop_last=False: the last training batch (2 rows) is smaller than num_microbatches (4)."""
    loss, state = assert_same_training(two_stages)
    assert_same_ops(two_stages, "fit")
    print(f"2 stages: training losses differ by up to {loss:.1e}, final state by up to {state:.1e}")


def test_test_metrics(two_stages: Runs) -> None:
    assert_same_ops(two_stages, "test")
    assert {"test_loss", "test_acc"} <= set(two_stages.ranks[0]["ops"][4]["callback_metrics"])


def test_predictions_and_writer(two_stages: Runs) -> None:
    print(f"2 stages: predicted logits differ by up to {assert_same_predictions(two_stages):.1e}")
    written = sorted(p.name for p in (two_stages.out / "predictions").iterdir())
    # one replica: only its pipeline rank 0 (global rank 0) writes, once per batch and once at the end
    assert written == [f"replica0-rank0-batch{i}.pt" for i in range(4)] + ["replica0-rank0-epoch.pt"], written
    ref_dir = two_stages.ref_out / "predictions"
    for name in written:
        got = torch.load(two_stages.out / "predictions" / name, weights_only=False)
        want = torch.load(ref_dir / name, weights_only=False)
        if name.endswith("epoch.pt"):
            assert got["indices"] == want["indices"]
            assert all(torch.equal(g, w) for g, w in zip(got["tokens"], want["tokens"]))
        else:
            assert torch.equal(got, want)


def test_model_checkpoint_best_and_lr_monitor(two_stages: Runs) -> None:
    want = two_stages.ref["checkpoint"]
    assert len(want["best_k_models"]) == 2
    for r in two_stages.ranks:
        got = r["checkpoint"]
        assert got["best_model_path"] == want["best_model_path"]
        assert abs(got["best_model_score"] - want["best_model_score"]) < ATOL
        assert got["best_k_models"].keys() == want["best_k_models"].keys()
        assert got["saved"] == want["saved"]
    got_rows = _csv_rows(two_stages.out)
    want_rows = _csv_rows(two_stages.ref_out)
    lr = [row["lr-SGD"] for row in want_rows if row.get("lr-SGD")]
    assert lr and [row["lr-SGD"] for row in got_rows if row.get("lr-SGD")] == lr


def test_modules_in_the_right_mode(two_stages: Runs) -> None:
    for r in two_stages.ranks:
        assert_modes(r, {"train", "validate", "test", "predict"})
        assert all(op["training"] == ref["training"] for op, ref in zip(r["ops"], two_stages.ref["ops"]))
    assert {fn for r in two_stages.ranks for fn in r["modes"]} >= {"train", "validate", "test", "predict"}


# ------------------------------------------------------------------------------------------------ 4 stages
def test_four_processes_early_stopping_checkpoint_test_predict(four_stages: Runs) -> None:
    ref = four_stages.ref
    assert ref["early_stopping"]["stopped_epoch"] == 5 and ref["current_epoch"] < 20  # it did stop early
    val = assert_same_validations(four_stages)
    loss, state = assert_same_training(four_stages)
    assert_same_ops(four_stages, "test")
    pred = assert_same_predictions(four_stages)
    print(f"4 stages: validation {val:.1e}, training loss {loss:.1e}, state {state:.1e}, logits {pred:.1e}")
    for r in four_stages.ranks:
        assert r["early_stopping"] == ref["early_stopping"]
        assert r["checkpoint"]["best_model_path"] == ref["checkpoint"]["best_model_path"] == "epoch=3-step=16.ckpt"
        assert abs(r["checkpoint"]["best_model_score"] - ref["checkpoint"]["best_model_score"]) < ATOL
        assert r["checkpoint"]["saved"] == ref["checkpoint"]["saved"]
        assert_modes(r, {"train", "validate", "test", "predict"})


# ----------------------------------------------------------------------------------------------- BatchNorm
def test_batchnorm_statistics(batchnorm: Runs) -> None:
    ref = batchnorm.ref
    val = assert_same_validations(batchnorm)
    loss, state = assert_same_training(batchnorm)
    assert_same_ops(batchnorm, "test")
    pred = assert_same_predictions(batchnorm)
    print(f"BatchNorm: validation {val:.1e}, training loss {loss:.1e}, state (running stats too) {state:.1e},"
          f" logits {pred:.1e}")
    for r in batchnorm.ranks:
        assert_modes(r, {"train", "validate", "test", "predict"})
    owners = [r for r in batchnorm.ranks if r["initial_bn"]]
    assert len(owners) == 1  # the BatchNorm sits on one stage
    r = owners[0]
    keys = set(ref["initial_bn"])
    assert keys and set(r["initial_bn"]) == keys
    initial, after = r["initial_bn"], r["bn_after"]  # after each op: validate, fit, validate, test, predict
    # validating a fresh model, shape inference included, leaves the statistics alone
    assert all(torch.equal(after[0][k], initial[k]) for k in keys)
    # training updates them exactly as on one device (once per batch with one microbatch)
    for k in keys:
        assert torch.allclose(after[1][k].float(), ref["bn_after"][1][k].float(), atol=ATOL, rtol=0), k
    tracked = next(k for k in keys if k.endswith("num_batches_tracked"))
    assert int(after[1][tracked]) == 12  # 2 epochs of 6 batches
    mean = next(k for k in keys if k.endswith("running_mean"))
    assert not torch.equal(after[1][mean], initial[mean])
    # validation, test and prediction after training leave them alone
    for later in after[2:]:
        assert all(torch.equal(later[k], after[1][k]) for k in keys)


# ------------------------------------------------------------------------------------------------ replicas
def test_replicas_validate_and_write_predictions_once_each(replicas: Runs) -> None:
    print(f"2 replicas x 2 stages: validation values differ by up to {assert_same_validations(replicas):.1e}")
    for r in replicas.ranks:  # BatchNorm statistics untouched by evaluation and shape inference
        assert all(torch.equal(r["bn_after"][-1][k], v) for k, v in r["initial_bn"].items())
    written = sorted(p.name for p in (replicas.out / "predictions").iterdir())
    # replica 0 is global ranks 0-1, replica 1 is ranks 2-3; pipeline rank 0 of each writes
    assert {n.split("-batch")[0].split("-epoch")[0] for n in written} == {"replica0-rank0", "replica1-rank2"}, written
    want_batches = next(op for op in replicas.ref["ops"] if op["op"] == "predict")["returned"]
    want = torch.cat([p["tokens"] for p in want_batches])
    got = torch.full_like(want, -1)
    for replica, rank in ((0, 0), (1, 2)):
        epoch = torch.load(replicas.out / "predictions" / f"replica{replica}-rank{rank}-epoch.pt", weights_only=False)
        indices = [i for batch in epoch["indices"][0] for i in batch]
        got[indices] = torch.cat(epoch["tokens"])
        # what trainer.predict returned on both ranks of the replica is what was written
        for r in replicas.ranks[2 * replica : 2 * replica + 2]:
            returned = next(op for op in r["ops"] if op["op"] == "predict")["returned"]
            assert torch.equal(torch.cat([p["tokens"] for p in returned]), torch.cat(epoch["tokens"]))
    assert torch.equal(got, want)  # the replicas together predicted every sample once, as on one device


# -------------------------------------------------------------------- logging and metrics across the stages
def test_sum_reduced_sync_dist_counts_each_sample_once(two_stages: Runs, replicas: Runs) -> None:
    """``self.log(..., reduce_fx="sum", sync_dist=True)`` must sum over replicas, not over the stages of one
    pipeline (which all log the same value)."""
    for runs in (two_stages, replicas):
        want = runs.ref["validations"][0]["metrics"]["val_count"]
        got = [r["validations"][0]["metrics"]["val_count"] for r in runs.ranks]
        assert got == [want] * len(got), f"val_count {got}, single device {want}"


def test_step_level_metric_reaches_the_logger(two_stages: Runs) -> None:
    """A Metric called (forward) in the step and logged with on_step=True: its batch value comes from the last
    stage's forward cache, and must reach rank 0's logger as on one device."""
    want = [float(row["val_acc_fwd_step"]) for row in _csv_rows(two_stages.ref_out) if row.get("val_acc_fwd_step")]
    got = [float(row["val_acc_fwd_step"]) for row in _csv_rows(two_stages.out) if row.get("val_acc_fwd_step")]
    assert want and len(got) == len(want), (got, want)
    assert max(abs(a - b) for a, b in zip(got, want)) < ATOL


def test_list_state_metric_such_as_auroc(list_states: Runs) -> None:
    """A metric with integer list states (exact AUROC's targets) computes on every rank as on one device."""
    assert "val_auroc" in list_states.ref["validations"][0]["metrics"]
    assert_same_validations(list_states)


# ------------------------------------------------------------------------------------------------- examples
EXAMPLES = {
    "vit": ["--max-epochs", "1", "--train-samples", "128", "--val-samples", "72", "--dim", "32", "--depth", "2"],
    "resnet": ["--max-epochs", "1", "--train-samples", "128", "--val-samples", "72", "--depth", "14", "--width", "8"],
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_and_validates(name: str, tmp_path: Path) -> None:
    """The examples run end to end on 2 CPU processes (tiny settings; the defaults take a minute or more)."""
    script = HERE.parent / "examples" / f"{name}.py"
    proc = run_script([str(script), "--batch-size", "32", *EXAMPLES[name]], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "final metrics" in proc.stdout and "'val_acc'" in proc.stdout, proc.stdout[-3000:]


def _csv_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))

