"""Lightning's built-in callbacks and tuner under the pipeline, each compared with one process.

One 2-process job runs every phase in a row (``tests/callbacks_job.py``); the one-process references run in this
process. A phase that resumes reads the checkpoint its own run wrote (the pipeline's a directory, the reference's a
file). AdamW throughout (1e-4 allowed; they agree to about 5e-7), 48 rows in batches of 8 (160 for the LR
finder): 6 steps per epoch, 4 microbatches, stage 0 on rank 0 and stage 1 on rank 1.

- SWA: the averaged model, the final weights and every loss; resumed in the middle of SWA with an epoch LR scheduler
  (SWA replaces it; the averaged model comes back from the distributed checkpoint). With BatchNorm: the same extra
  epoch as one process.
- EMAWeightAveraging: the same, and its ``current_model_state`` across a resume.
- LearningRateFinder (a model without a scheduler) and ``Tuner.lr_find``: the same suggestion, the run after the
  search restarts from the saved state (Adam's step counts), and the search's checkpoint is removed.
- BackboneFinetuning on a model whose first stage holds only the frozen feature extractor, with the documented
  ``filter(requires_grad)`` optimizer (empty on rank 0) and with every parameter: the unfrozen backbone trains,
  every rank has one process's parameter groups and learning rates; resumed after the unfreeze.
- ModelPruning, global L1 (the default): the same threshold over the stages, resumed from a pruned checkpoint.
- The callbacks that do not change training, together: GradientAccumulationScheduler, LearningRateMonitor,
  EarlyStopping, Timer, ThroughputMonitor, DeviceStatsMonitor, SpikeDetection, RichProgressBar, ModelSummary;
  the same losses and the same logged metric names as one process.
- Sharded stages (pp1 x fsdp2, both replicas fed the whole batch): BackboneFinetuning, resumed after the unfreeze,
  and the LR finder train as one process does.
- Nothing trainable: one process's error, on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import callbacks_job
import pytest
import torch
from helpers import run_script

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
ATOL = 1e-4  # AdamW; the runs agree to about 5e-7
PIPE = {"num_microbatches": 4}
ADAMW = {"optimizer": "adamw", "lr": 0.01}
SWA = {"cls": "StochasticWeightAveraging", "kwargs": {"swa_lrs": 0.01, "swa_epoch_start": 2, "annealing_epochs": 1}}
EMA = {"cls": "EMAWeightAveraging", "kwargs": {"decay": 0.9}}
EVERY_EPOCH = {"cls": "ModelCheckpoint", "kwargs": {"dirpath": "ck", "save_top_k": -1, "filename": "{epoch}"}}
FINETUNE = {"cls": "BackboneFinetuning", "kwargs": {"unfreeze_backbone_at_epoch": 1, "backbone_initial_lr": 0.005}}
FT_PIPE = {**PIPE, "backbone": ["backbone.blocks", "neck"]}
GRADUAL = {"cls": "GradualFinetuning"}  # callbacks_job.GradualFinetuning: each stage's blocks unfrozen in turn
SHARDED = {**PIPE, "pipeline_parallel_size": 1, "data_parallel": "fsdp"}
FT_SHARDED = {**SHARDED, "backbone": ["backbone.blocks", "neck"]}
WHOLE_BATCH = {"use_distributed_sampler": False}
PRUNE = {"cls": "ModelPruning", "kwargs": {"pruning_fn": "l1_unstructured", "amount": 0.3}}
LR_FIND = {"min_lr": 1e-5, "max_lr": 0.05, "early_stop_threshold": None}


def phase(name: str, epochs: int, callbacks: list[dict], model: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "root": extra.pop("root", name), "model": dict(model or ADAMW), "strategy": dict(PIPE),
        "callbacks": callbacks,
        "trainer": {"max_epochs": epochs, **extra.pop("trainer", {})}, **extra,
    }


PHASES = [
    phase("swa", 4, [SWA, EVERY_EPOCH], model={**ADAMW, "scheduler": "epoch"}),
    phase("swa_resume", 4, [SWA], model={**ADAMW, "scheduler": "epoch"}, root="swa", ckpt_path="swa/ck/epoch=2.ckpt"),
    phase("swa_batchnorm", 3, [{**SWA, "kwargs": {**SWA["kwargs"], "swa_epoch_start": 1}}],
          model={**ADAMW, "batchnorm": True}),
    phase("ema", 1, [EMA], save=["ema.ckpt"]),
    phase("ema_resume", 2, [EMA], root="ema", ckpt_path="ema/ema.ckpt"),
    phase("lr_finder", 1, [{"cls": "LearningRateFinder", "kwargs": {**LR_FIND, "num_training_steps": 16}}],
          model={**ADAMW, "lr": 0.001}, data={"n": 160}),
    phase("tuner", 1, [], model={**ADAMW, "scheduler": "step"}, data={"n": 160}, fn="tuner_then_fit",
          tuner={**LR_FIND, "num_training": 16}),
    phase("finetune", 3, [FINETUNE, EVERY_EPOCH], model={"kind": "finetune"}, strategy=dict(FT_PIPE)),
    phase("finetune_resume", 3, [FINETUNE], model={"kind": "finetune"}, strategy=dict(FT_PIPE), root="finetune",
          ckpt_path="finetune/ck/epoch=1.ckpt"),
    phase("finetune_all", 2, [FINETUNE], model={"kind": "finetune", "optimize": "all"}, strategy=dict(FT_PIPE)),
    phase("gradual", 3, [GRADUAL, EVERY_EPOCH], model={"kind": "finetune"}, strategy=dict(FT_PIPE)),
    phase("gradual_resume", 4, [GRADUAL], model={"kind": "finetune"}, strategy=dict(FT_PIPE), root="gradual",
          ckpt_path="gradual/ck/epoch=2.ckpt"),
    phase("prune", 2, [PRUNE, EVERY_EPOCH]),
    phase("prune_resume", 2, [PRUNE], root="prune", ckpt_path="prune/ck/epoch=0.ckpt"),
    phase(
        "stacked", 2,
        [
            {"cls": "GradientAccumulationScheduler", "kwargs": {"scheduling": {1: 2}}},
            {"cls": "LearningRateMonitor", "kwargs": {"logging_interval": "step"}},
            {"cls": "EarlyStopping", "kwargs": {"monitor": "train_loss", "patience": 100}},
            {"cls": "Timer", "kwargs": {"duration": "00:01:00:00"}},
            {"cls": "ThroughputMonitor", "kwargs": {"window_size": 2}},
            {"cls": "DeviceStatsMonitor", "kwargs": {}},
            {"cls": "SpikeDetection", "kwargs": {"warmup": 100}},
            {"cls": "RichProgressBar", "kwargs": {}},
            {"cls": "ModelSummary", "kwargs": {"max_depth": 2}},
        ],
        model={**ADAMW, "scheduler": "step"}, logger=True, trainer={"log_every_n_steps": 1},
    ),
    # sharded over 2 replicas that both see the whole batch (no distributed sampler): one process's training
    phase("finetune_fsdp", 3, [FINETUNE, EVERY_EPOCH], model={"kind": "finetune"}, strategy=dict(FT_SHARDED),
          trainer=WHOLE_BATCH),
    phase("finetune_fsdp_resume", 3, [FINETUNE], model={"kind": "finetune"}, strategy=dict(FT_SHARDED),
          root="finetune_fsdp", ckpt_path="finetune_fsdp/ck/epoch=1.ckpt", trainer=WHOLE_BATCH),
    phase("lr_finder_fsdp", 1, [{"cls": "LearningRateFinder", "kwargs": {**LR_FIND, "num_training_steps": 16}}],
          model={**ADAMW, "lr": 0.001}, data={"n": 160}, strategy=dict(SHARDED), trainer=WHOLE_BATCH),
    phase("frozen", 1, [], model={**ADAMW, "frozen": True}, expect_error=True),  # last: an error ends the job
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("callbacks")


@pytest.fixture(scope="module")
def pipelined(work) -> dict[str, list[dict[str, Any]]]:
    spec = work / "spec.json"
    spec.write_text(json.dumps({"devices": 2, "phases": PHASES}))
    proc = run_script([str(HERE / "callbacks_job.py"), str(spec), str(work / "out")], cwd=work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return {p["name"]: [torch.load(work / "out" / f"{p['name']}.rank{r}.pt", weights_only=False) for r in (0, 1)]
            for p in PHASES}


@pytest.fixture(scope="module")
def reference(work) -> dict[str, dict[str, Any]]:
    out = {}
    ref = work / "reference"
    ref.mkdir()
    for p in PHASES:
        if p["strategy"].get("data_parallel"):
            continue  # compared with the replicated phase's reference
        p = {**p, "strategy": None, "root": str(ref / p["root"])}
        if "ckpt_path" in p:
            p["ckpt_path"] = str(ref / p["ckpt_path"])
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ref)
            out[p["name"]] = callbacks_job.run_phase(p, 1, None)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((v.float() - b[k].float()).abs().max()) for k, v in a.items())


def assert_same_training(name: str, pipelined, reference) -> None:
    """Every rank took one process's steps: the same losses, learning rates and parameter groups; its share of the
    final weights (and of any averaged model) equals one process's."""
    ref = reference[name]
    assert ref["error"] is None and ref["steps"], ref["error"]
    for rank, got in enumerate(pipelined[name]):
        assert got["error"] is None, got["error"]
        assert len(got["steps"]) == len(ref["steps"]), (rank, len(got["steps"]), len(ref["steps"]))
        for mine, theirs in zip(got["steps"], ref["steps"]):
            assert abs(mine["loss"] - theirs["loss"]) < ATOL, (name, rank, mine, theirs)
            assert mine["groups"] == theirs["groups"] and mine["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12)
            assert mine["global_step"] == theirs["global_step"]
        assert got["state_dict"], "the rank holds nothing"
        assert _max_diff(got["state_dict"], ref["state_dict"]) < ATOL, (name, rank)
        assert set(got["whole_after"]) == set(ref["state_dict"]), "not whole after the call"
        assert _max_diff(got["whole_after"], ref["state_dict"]) < ATOL, (name, rank)
        assert set(got["averaged"]) == set(ref["averaged"])
        for cb, state in got["averaged"].items():
            assert set(state) == set(got["state_dict"]) & set(state), "the averaged copy is not this rank's share"
            assert _max_diff(state, ref["averaged"][cb]) < ATOL, (name, cb, rank)
        assert got["global_step"] == ref["global_step"] and got["current_epoch"] == ref["current_epoch"]
    shares = [set(r["state_dict"]) for r in pipelined[name]]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(ref["state_dict"]), "the shares do not add up"


@pytest.mark.parametrize("name", ["swa", "swa_resume", "ema", "ema_resume"])
def test_weight_averaging(name, pipelined, reference):
    assert_same_training(name, pipelined, reference)
    assert all(r["averaged"] for r in pipelined[name])


def test_swa_with_batchnorm_runs_the_same_epochs(pipelined, reference):
    """SWA adds an epoch that recomputes BatchNorm statistics with the averaged weights: every rank adds it (the
    values themselves differ from one process, as BatchNorm does under microbatching: docs/evaluation.md)."""
    ref = reference["swa_batchnorm"]
    for got in pipelined["swa_batchnorm"]:
        assert got["error"] is None, got["error"]
        assert (got["global_step"], got["current_epoch"], len(got["steps"])) == (
            ref["global_step"], ref["current_epoch"], len(ref["steps"])
        )


@pytest.mark.parametrize("name", ["lr_finder", "tuner"])
def test_learning_rate_finder_restores_the_exact_state(name, pipelined, reference):
    assert_same_training(name, pipelined, reference)
    ref = reference[name]
    for got in pipelined[name]:
        assert got["lr"] == pytest.approx(ref["lr"], rel=1e-9)
        assert got["adam_steps"] == ref["adam_steps"] == [ref["global_step"]], "the search's steps were not undone"
        assert not [f for f in got["listing"] if f.startswith(".lr_find")], got["listing"]
    assert ref["lr"] != 0.001, "the finder suggested nothing: the test would not see a wrong suggestion"


@pytest.mark.parametrize("name", ["finetune", "finetune_resume", "finetune_all"])
def test_backbone_finetuning(name, pipelined, reference):
    assert_same_training(name, pipelined, reference)
    ref = reference[name]
    assert ref["steps"][-1]["groups"] == 2 or name == "finetune_all"
    # Adam's step counts: the head's and, from the unfreeze, the backbone's (kept across the resume, frozen)
    assert {s for got in pipelined[name] for s in got["adam_steps"]} == set(ref["adam_steps"])
    # rank 0 holds only the frozen feature extractor: with `filter(requires_grad)` its optimizer started empty
    assert {k.split(".")[0] for k in pipelined["finetune"][0]["state_dict"]} == {"backbone"}


@pytest.mark.parametrize("name", ["gradual", "gradual_resume"])
def test_gradual_unfreezing_one_stage_at_a_time(name, pipelined, reference):
    """Each added group lands on one rank only (the other gets it empty); the stored groups keep their positions,
    so the resume rebuilds the three groups of one process."""
    assert_same_training(name, pipelined, reference)
    assert reference[name]["steps"][-1]["groups"] == 3
    assert all(step["groups"] == 3 for got in pipelined[name] for step in got["steps"][-6:])


@pytest.mark.parametrize("name", ["prune", "prune_resume"])
def test_global_pruning(name, pipelined, reference):
    assert_same_training(name, pipelined, reference)
    zeros = sum(int((v == 0).sum()) for r in pipelined[name] for v in r["state_dict"].values())
    assert zeros == sum(int((v == 0).sum()) for v in reference[name]["state_dict"].values()) > 1000


@pytest.mark.parametrize(
    ("name", "like"),
    [("finetune_fsdp", "finetune"), ("finetune_fsdp_resume", "finetune_resume"), ("lr_finder_fsdp", "lr_finder")],
)
def test_sharded_stages_unfreeze_and_find_learning_rates_as_one_process(name, like, pipelined, reference):
    """BackboneFinetuning (frozen, then unfrozen into a new parameter group, resumed after it) and the LR finder
    with each stage sharded over two replicas that see the same batches: one process's training."""
    ref = reference[like]
    for got in pipelined[name]:
        assert got["error"] is None, got["error"]
        assert len(got["steps"]) == len(ref["steps"])
        for mine, theirs in zip(got["steps"], ref["steps"]):
            assert abs(mine["loss"] - theirs["loss"]) < ATOL and mine["groups"] == theirs["groups"], (mine, theirs)
        assert set(got["state_dict"]) == set(ref["state_dict"])
        assert _max_diff(got["state_dict"], ref["state_dict"]) < ATOL, name
        assert got["lr"] == pytest.approx(ref["lr"], rel=1e-9)


def test_callbacks_that_do_not_change_training(pipelined, reference):
    assert_same_training("stacked", pipelined, reference)
    logged = reference["stacked"]["logged"]
    assert "lr-AdamW" in logged and "train/device/samples_per_sec" in logged, logged
    # the same names: ThroughputMonitor counts one pipeline as one device (no global rates with one replica)
    assert pipelined["stacked"][0]["logged"] == logged


def test_nothing_trainable_fails_as_on_one_process(pipelined, reference):
    expected = "element 0 of tensors does not require grad"
    assert expected in reference["frozen"]["error"]
    for got in pipelined["frozen"]:
        assert got["error"] is not None and expected in got["error"], got["error"]
