"""Distributed checkpoints: exact resume, other layouts, ModelCheckpoint, single files, consolidation, failures.

The expensive part is launching real processes, so the scenarios share a few jobs (module-scoped fixtures):

- ``saved`` (2 processes): train one epoch under ModelCheckpoint (top-k on a monitored value every 2 steps,
  every epoch, weights only, ``save_last``) and a manual ``trainer.save_checkpoint``, then, in the same processes,
  resume from the epoch checkpoint, from ``ckpt_path="last"``, with another balance, and from a single-device
  checkpoint file;
- ``one_process``: resume the 2-stage checkpoints with ``PipelineStrategy`` on one process, validate from the
  weights-only one, and load a checkpoint with a damaged shard (must fail clearly);
- ``four_processes``: resume on a 4-stage pipeline, then load into a model with more blocks (must fail on every
  rank, naming what is missing);
- the crash test: a rank dies in the middle of overwriting ``last.ckpt``.

Every resumed run is compared with straight single-device training (SGD with momentum, a per-step LR scheduler):
the loss of every step and the final parameters agree within 1e-5.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ckpt_job
import models
import pytest
import torch
from helpers import merged_state, run_script

import lightning_pipe
from lightning_pipe._model.names import ModelNames
from lightning_pipe.checkpoint import _dcp, _files, is_pipeline_checkpoint
from lightning_pipe.checkpoint._files import INFO_KEY, OLD_SUFFIX, TMP_SUFFIX
from lightning_pipe.consolidate import consolidated_checkpoint
from lightning_pipe.consolidate import main as consolidate_main

HERE = Path(__file__).resolve().parent
JOB = HERE / "ckpt_job.py"
ATOL = 1e-5
STEPS_PER_EPOCH = 6
DATA = {"n": 48, "batch_size": 8}
MODEL = {"scheduler": "step"}  # SGD with momentum 0.9, StepLR with interval "step"
PIPE = {"num_microbatches": 4}


def phase(name: str, max_epochs: int, **kwargs: Any) -> dict[str, Any]:
    spec = {"name": name, "model": dict(MODEL), "strategy": dict(PIPE), "trainer": {"max_epochs": max_epochs}}
    spec["data"] = dict(DATA)
    spec.update(kwargs)
    return spec


def launch(work: Path, name: str, devices: int, phases: list[dict], timeout: float = 150, **extra: Any):
    spec_file = work / f"{name}.json"
    spec_file.write_text(json.dumps({"devices": devices, "phases": phases, **extra}))
    out = work / name
    proc = run_script([str(JOB), str(spec_file), str(out)], cwd=work, timeout=timeout)
    return proc, out


def results(out: Path, name: str, devices: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(devices)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_resumed(ranks: list[dict[str, Any]], ref: dict[str, Any], first_step: int = STEPS_PER_EPOCH) -> float:
    """The resumed run logs the straight run's losses and learning rates from ``first_step`` on, and ends with
    its parameters. Returns the largest difference seen."""
    want = ref["steps"][first_step:]
    worst = 0.0
    for rank, r in enumerate(ranks):
        assert r["start_step"] == first_step, (rank, r["start_step"])
        got = r["steps"]
        assert [s["global_step"] for s in got] == [s["global_step"] for s in want], rank
        assert [s["lr"] for s in got] == pytest.approx([s["lr"] for s in want], rel=1e-12), rank
        diffs = [abs(a["train_loss"] - b["train_loss"]) for a, b in zip(got, want)]
        assert max(diffs) < ATOL, f"rank {rank}: losses differ by up to {max(diffs):.2e}"
        worst = max(worst, *diffs)
    params = max_diff(merged_state(ranks), ref["state_dict"])
    assert params < ATOL, f"final parameters differ by up to {params:.2e}"
    print(f"max loss diff {worst:.2e}, max param diff {params:.2e}")
    return max(worst, params)


# ----------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def reference(work) -> dict[str, Any]:
    """Single-device training: two epochs straight, and one epoch saved to ``plain.ckpt`` (an ordinary file)."""
    straight = ckpt_job.run_phase({**phase("straight", 2), "strategy": None}, 1, None)
    first = ckpt_job.run_phase({**phase("plain", 1), "strategy": None, "save": [str(work / "plain.ckpt")]}, 1, None)
    moved = max_diff(straight["state_dict"], first["state_dict"])
    assert moved > 100 * ATOL, "the second epoch barely moved the parameters: the comparison would prove nothing"
    return {"straight": straight, "one_epoch": first, "plain_file": work / "plain.ckpt"}


@pytest.fixture(scope="module")
def saved(work, reference) -> dict[str, Any]:
    topk, epochs, manual = work / "topk", work / "epochs", work / "manual.ckpt"
    topk_callback = {
        "dirpath": str(topk), "filename": "{step}", "monitor": "train_loss", "mode": "min",
        "save_top_k": 2, "every_n_train_steps": 2, "save_last": True,
    }
    epoch_callback = {"dirpath": str(epochs), "filename": "{epoch}", "every_n_epochs": 1, "save_top_k": -1}
    weights_callback = {"dirpath": str(work / "weights"), "filename": "{epoch}", "save_weights_only": True,
                        "every_n_train_steps": STEPS_PER_EPOCH}
    link_callback = {"dirpath": str(work / "linked"), "filename": "{step}", "every_n_train_steps": 3,
                     "save_top_k": -1, "save_last": "link"}
    epoch0 = str(epochs / "epoch=0.ckpt")
    phases = [
        phase("train", 1, checkpoints=[topk_callback, epoch_callback, weights_callback, link_callback],
              save=[str(manual)], list_dirs=[str(topk), str(epochs)]),
        # fresh models with other initial weights: everything must come from the checkpoint
        phase("resume", 2, ckpt_path=epoch0, model={**MODEL, "seed": 7}),
        phase("resume_last", 2, ckpt_path="last", model={**MODEL, "seed": 8},
              checkpoints=[{**topk_callback, "save_top_k": 0}]),  # finds topk/last.ckpt (step 6)
        phase("balance", 2, ckpt_path=epoch0, model={**MODEL, "seed": 9}, strategy={**PIPE, "balance": [5, 2]}),
        phase("plain", 2, ckpt_path=str(work / "plain.ckpt"), model={**MODEL, "seed": 10}),
        phase("resume_link", 2, ckpt_path=str(work / "linked" / "last.ckpt"), model={**MODEL, "seed": 15}),
    ]
    proc, out = launch(work, "saved", 2, phases)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"out": out, "topk": topk, "epochs": epochs, "manual": manual, "epoch0": Path(epoch0),
            "linked": work / "linked",
            "weights": work / "weights" / "epoch=0.ckpt"}


@pytest.fixture(scope="module")
def one_process(work, saved) -> Path:
    corrupt = work / "corrupt.ckpt"  # a shard cut in half
    shutil.copytree(saved["epoch0"], corrupt)
    with open(corrupt / "__1_0.distcp", "r+b") as f:
        f.truncate((corrupt / "__1_0.distcp").stat().st_size // 2)
    phases = [
        phase("single", 2, ckpt_path=str(saved["epoch0"]), model={**MODEL, "seed": 11}),
        phase("manual", 2, ckpt_path=str(saved["manual"]), model={**MODEL, "seed": 12}),
        phase("validate", 1, fn="validate", ckpt_path=str(saved["weights"]), model={**MODEL, "seed": 14}),
        phase("corrupt", 2, ckpt_path=str(corrupt), expect_error=True),
    ]
    proc, out = launch(work, "one_process", 1, phases)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out


@pytest.fixture(scope="module")
def four_processes(work, saved) -> tuple[subprocess.CompletedProcess, Path]:
    phases = [
        phase("four", 2, ckpt_path=str(saved["epoch0"]), model={**MODEL, "seed": 13}),
        # 6 blocks instead of 4: ranks 0 and 1 find all their weights, ranks 2 and 3 do not
        phase("mismatch", 2, ckpt_path=str(saved["epoch0"]), model={**MODEL, "blocks": 6}, expect_error=True),
    ]
    return launch(work, "four", 4, phases, timeout=180)


# ---------------------------------------------------------------------------------------------------- 1. exact resume
@pytest.mark.dist
def test_exact_resume(saved, reference):
    out = saved["out"]
    trained = results(out, "train", 2)
    assert [s["train_loss"] for s in trained[0]["steps"]] == pytest.approx(
        [s["train_loss"] for s in reference["straight"]["steps"][:STEPS_PER_EPOCH]], abs=ATOL
    )
    resumed = results(out, "resume", 2)
    for t, r in zip(trained, resumed):  # the weights came from the checkpoint, exactly
        assert set(r["start_state"]) == set(t["state_dict"])
        assert all(torch.equal(r["start_state"][k], v) for k, v in t["state_dict"].items())
    assert_resumed(resumed, reference["straight"])


# --------------------------------------------------------------------------------------------------- 2. other layouts
@pytest.mark.dist
def test_resume_with_another_balance(saved, reference):
    resumed = results(saved["out"], "balance", 2)
    assert sorted(k.split(".")[1] for k in resumed[1]["state_dict"])[0] == "5"  # rank 1 now holds modules 5..6
    assert_resumed(resumed, reference["straight"])


@pytest.mark.dist
def test_resume_on_one_process(one_process, reference):
    assert_resumed(results(one_process, "single", 1), reference["straight"])


@pytest.mark.dist
def test_resume_on_four_processes(four_processes, reference):
    proc, out = four_processes
    assert (out / "four.rank3.pt").exists(), proc.stdout[-6000:]
    resumed = results(out, "four", 4)
    assert [len({k.split(".")[1] for k in r["state_dict"]}) for r in resumed] == [2, 2, 2, 1]
    assert_resumed(resumed, reference["straight"])


# ------------------------------------------------------------------------------------------------- 3. ModelCheckpoint
@pytest.mark.dist
def test_model_checkpoint_directories(saved, reference):
    train = results(saved["out"], "train", 2)[0]
    listing = train["listings"]
    losses = {s["global_step"]: s["train_loss"] for s in train["steps"]}
    best = sorted((2, 4, 6), key=losses.__getitem__)[:2]  # monitored every 2 steps, top 2 kept
    assert listing[str(saved["topk"])] == sorted(["last.ckpt"] + [f"step={s}.ckpt" for s in best])
    assert listing[str(saved["epochs"])] == ["epoch=0.ckpt"]
    for path in [*saved["topk"].iterdir(), *saved["epochs"].iterdir(), saved["manual"]]:
        assert is_pipeline_checkpoint(path), path
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    # every top-k checkpoint holds the state of its step: compare with single-device training
    for step in best:
        meta = torch.load(saved["topk"] / f"step={step}.ckpt" / "meta.pt", weights_only=False)
        assert meta["global_step"] == step
    assert not [p for d in (saved["topk"], saved["epochs"]) for p in d.iterdir() if not p.name.endswith(".ckpt")]


@pytest.mark.dist
def test_resume_from_last(saved, reference):
    assert_resumed(results(saved["out"], "resume_last", 2), reference["straight"])


@pytest.mark.dist
def test_save_last_as_a_link(saved, reference):
    """``save_last="link"``: ``last.ckpt`` is a symlink to the newest complete directory, and resumes exactly."""
    last = saved["linked"] / "last.ckpt"
    assert last.is_symlink() and is_pipeline_checkpoint(last)
    assert last.resolve() == (saved["linked"] / f"step={STEPS_PER_EPOCH}.ckpt").resolve()
    assert_resumed(results(saved["out"], "resume_link", 2), reference["straight"])


@pytest.mark.dist
def test_resume_from_manual_save(one_process, reference):
    assert_resumed(results(one_process, "manual", 1), reference["straight"])


# -------------------------------------------------------------------------------------------------- 4. single file in
@pytest.mark.dist
def test_single_device_file_into_pipeline(saved, reference, work):
    plain = torch.load(work / "plain.ckpt", weights_only=False)["state_dict"]
    resumed = results(saved["out"], "plain", 2)
    for r in resumed:  # each stage took its slice, exactly
        assert r["start_state"] and set(r["start_state"]) < set(plain)
        assert all(torch.equal(v, plain[k]) for k, v in r["start_state"].items())
    assert set(merged_state(resumed, "start_state")) == set(plain)
    # with its optimizer (momentum), scheduler and loop state: the run continues as if never interrupted
    assert_resumed(resumed, reference["straight"])


# --------------------------------------------------------------------------------------------------- 5. consolidation
@pytest.mark.dist
def test_consolidate_cli(saved, reference, work):
    out_file = work / "consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", str(saved["epoch0"]), str(out_file)],
        cwd=work, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Wrote" in proc.stdout
    checkpoint = torch.load(out_file, weights_only=False)
    for key in ("state_dict", "hyper_parameters", "epoch", "global_step", "loops", "callbacks", "lr_schedulers",
                "optimizer_states", "pytorch-lightning_version"):
        assert key in checkpoint, key
    assert checkpoint["global_step"] == STEPS_PER_EPOCH and checkpoint["epoch"] == 0
    assert INFO_KEY not in checkpoint
    trained = merged_state(results(saved["out"], "train", 2))
    assert list(checkpoint["state_dict"]) == list(reference["one_epoch"]["state_dict"])  # single-device order
    model = models.TinyLM.load_from_checkpoint(out_file)  # no strategy, no process group
    assert dict(model.hparams) == {
        "blocks": 4, "lr": 0.1, "optimizer": "sgd", "scheduler": "step", "batchnorm": False, "train_metric": False,
        "log_sometimes": False,
    }
    state = model.state_dict()
    assert set(state) == set(trained) and all(torch.equal(state[k], v) for k, v in trained.items())
    # the optimizer state is in torch.optim format: a single-device run resumes from the file exactly
    resumed = ckpt_job.run_phase({**phase("from_file", 2), "strategy": None, "ckpt_path": str(out_file)}, 1, None)
    assert_resumed([resumed], reference["straight"])
    with pytest.raises(SystemExit):  # refuses to overwrite
        consolidate_main([str(saved["epoch0"]), str(out_file)])


def test_consolidate_help_and_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        consolidate_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "CKPT_DIR" in text.upper() or "checkpoint_dir" in text
    assert "single process" in text.lower() and "load_from_checkpoint" in text
    (tmp_path / "half.ckpt").mkdir()
    with pytest.raises(SystemExit) as exc:
        consolidate_main([str(tmp_path / "half.ckpt"), str(tmp_path / "out.ckpt")])
    assert exc.value.code == 2
    assert "not a complete lightning_pipe checkpoint" in capsys.readouterr().err
    pyproject = (HERE.parent / "pyproject.toml").read_text()
    assert 'lightning-pipe-consolidate = "lightning_pipe.consolidate:main"' in pyproject


# -------------------------------------------------------------------------------------------- 6. load_from_checkpoint
@pytest.mark.dist
def test_load_from_checkpoint_on_a_directory(saved, tmp_path):
    model = lightning_pipe.load_from_checkpoint(models.TinyLM, saved["manual"])  # consolidated in memory
    trained = merged_state(results(saved["out"], "train", 2))
    state = model.state_dict()
    assert set(state) == set(trained) and all(torch.equal(state[k], v) for k, v in trained.items())
    assert model.hparams.scheduler == "step"
    half = tmp_path / "half.ckpt"
    half.mkdir()
    (half / ".metadata").write_bytes(b"")
    with pytest.raises(IsADirectoryError, match="not a complete lightning_pipe checkpoint"):
        lightning_pipe.load_from_checkpoint(models.TinyLM, half)


# -------------------------------------------------------------------------------------------------------- 7. mismatch
@pytest.mark.dist
def test_mismatched_model_fails_on_every_rank(four_processes):
    proc, out = four_processes
    for rank in range(4):
        error_file = out / f"mismatch.rank{rank}.error.txt"
        assert error_file.exists(), f"rank {rank} did not fail cleanly:\n{proc.stdout[-6000:]}"
        text = error_file.read_text()
        assert "CheckpointMismatchError" in text and "does not match this model" in text, text
        assert "rank 2: missing weights (22): backbone.5.norm1.weight" in text and "backbone.5.qkv.weight" in text, text
        assert "rank 3: missing weights (4): backbone.7.weight, backbone.7.bias, backbone.8.weight" in text, text
        assert "rank 2: missing optimizer entries" in text and "no rank's model (4): backbone.5.bias" in text, text
        assert "rank 0: missing" not in text and "rank 1: missing" not in text


@pytest.mark.dist
def test_validate_from_a_weights_only_checkpoint(one_process, saved, reference):
    """``ModelCheckpoint(save_weights_only=True)`` directories: no optimizer entries, and `validate` loads them."""
    meta = torch.load(saved["weights"] / "meta.pt", weights_only=False)
    assert "lr_schedulers" not in meta and "optimizer_states" not in meta
    stored = _dcp.dcp.FileSystemReader(saved["weights"]).read_metadata().state_dict_metadata
    assert stored and all(k.startswith("state_dict.") for k in stored)
    validated = results(one_process, "validate", 1)[0]
    trained = merged_state(results(saved["out"], "train", 2))
    assert all(torch.equal(validated["state_dict"][k], v) for k, v in trained.items())
    want = ckpt_job.run_phase(  # single device, the single-device weights after one epoch
        {**phase("val_ref", 1), "strategy": None, "fn": "validate", "ckpt_path": str(reference["plain_file"])}, 1, None
    )
    diff = abs(validated["callback_metrics"]["val_loss"] - want["callback_metrics"]["val_loss"])
    assert diff < ATOL, diff


@pytest.mark.dist
def test_damaged_shard_gives_a_clear_error(one_process):
    text = (one_process / "corrupt.rank0.error.txt").read_text()
    assert "Reading checkpoint" in text and "damaged or incomplete" in text and "rank 0: EOFError" in text, text


def test_incomplete_directory_is_refused(tmp_path):
    half = tmp_path / "epoch=3.ckpt"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="not a complete lightning_pipe checkpoint"):
        _files.resolve(half)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _files.resolve(tmp_path / "nothing.ckpt")


# ---------------------------------------------------------------------------------------------------- 8. crash safety
@pytest.mark.dist
def test_killed_save_keeps_previous_checkpoint(work, reference):
    crash_dir = work / "crash"
    callback = {"dirpath": str(crash_dir), "filename": "{epoch}", "every_n_epochs": 1, "save_top_k": -1,
                "save_last": True}
    # saves: 1 = epoch=0.ckpt, 2 = last.ckpt, 3 = epoch=1.ckpt, 4 = last.ckpt again: rank 1 dies in the middle
    phases = [phase("crash", 2, checkpoints=[callback], strategy={**PIPE, "timeout_s": 30})]
    proc, _ = launch(work, "crash_run", 2, phases, crash={"rank": 1, "save": 4})
    assert "rank 1 exits in the middle of save 4" in proc.stdout, proc.stdout[-6000:]
    assert proc.returncode != 0
    names = sorted(p.name for p in crash_dir.iterdir())
    # only complete checkpoints under final names; the interrupted save is a temporary directory at most
    for name in names:
        if not name.endswith(TMP_SUFFIX):
            assert is_pipeline_checkpoint(crash_dir / name), (name, names)
    assert {"epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"} <= set(names), names
    # last.ckpt is still the previous (epoch 0) checkpoint, whole: it consolidates and resumes exactly
    last = consolidated_checkpoint(crash_dir / "last.ckpt")
    assert last["global_step"] == STEPS_PER_EPOCH
    assert max_diff(dict(last["state_dict"]), reference["one_epoch"]["state_dict"]) < ATOL
    torch.save(last, work / "crash_last.ckpt")
    resumed = ckpt_job.run_phase(
        {**phase("after_crash", 2), "strategy": None, "ckpt_path": str(work / "crash_last.ckpt")}, 1, None
    )
    assert_resumed([resumed], reference["straight"])


@pytest.mark.dist
def test_commit_replaces_and_interrupted_replace_falls_back(saved, tmp_path):
    """The rename window of overwriting a checkpoint: the old one is moved aside and loading finds it."""
    target = tmp_path / "last.ckpt"
    shutil.copytree(saved["manual"], target)
    new = tmp_path / ("last.ckpt" + TMP_SUFFIX)
    shutil.copytree(saved["epoch0"], new)
    (new / "marker").write_text("new")
    _files.commit(new, target)
    assert (target / "marker").exists() and not new.exists()
    assert not (tmp_path / ("last.ckpt" + OLD_SUFFIX)).exists()
    # simulate a kill between moving the old one aside and renaming the new one into place
    target.rename(tmp_path / ("last.ckpt" + OLD_SUFFIX))
    with pytest.warns(UserWarning, match="interrupted"):
        assert _files.resolve(target) == tmp_path / ("last.ckpt" + OLD_SUFFIX)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["file", "link"])
def test_commit_over_a_file_or_link_puts_it_back_if_the_rename_fails(saved, tmp_path, kind):
    """What another strategy (a file) or `save_last="link"` (a link) left at the path survives a failed commit, and
    a commit that succeeds replaces it without touching what a link points to."""
    target = tmp_path / "last.ckpt"
    pointed = tmp_path / "epoch=0.ckpt"
    pointed.write_text("single file")
    if kind == "file":
        target.write_text("single file")
    else:
        target.symlink_to(pointed.name)
    with pytest.raises(FileNotFoundError):
        _files.commit(tmp_path / ("missing" + TMP_SUFFIX), target)
    assert target.read_text() == "single file" and target.is_symlink() == (kind == "link")
    assert not (tmp_path / ("last.ckpt" + OLD_SUFFIX)).exists()
    new = tmp_path / ("last.ckpt" + TMP_SUFFIX)
    shutil.copytree(saved["epoch0"], new)
    _files.commit(new, target)
    assert is_pipeline_checkpoint(target) and not target.is_symlink() and not new.exists()
    assert not (tmp_path / ("last.ckpt" + OLD_SUFFIX)).exists() and pointed.read_text() == "single file"


def test_merged_parameter_groups_follow_the_model_order():
    """Every rank's optimizer groups, merged, list the parameters in the single-device model's order (what a
    single-file optimizer state numbers them by)."""
    names = ModelNames.of(models.make_model(blocks=10))
    ranks = [
        [["backbone.0.weight", "backbone.2.qkv.weight", "backbone.2.proj.bias", "backbone.12.weight"]],
        [["backbone.1.qkv.weight", "backbone.10.norm1.weight", "backbone.11.bias"]],
    ]
    assert names.merge_groups(ranks) == [[
        "backbone.0.weight", "backbone.1.qkv.weight", "backbone.2.qkv.weight", "backbone.2.proj.bias",
        "backbone.10.norm1.weight", "backbone.11.bias", "backbone.12.weight",
    ]]


# --------------------------------------------------------------------------------------------------------- in-process
def _save_one_rank(model, optimizers, checkpoint, path) -> None:
    """`_dcp.save` in one process without a process group."""
    layout = {"bounds": [[0, 7]], "pipeline_parallel_size": 1, "data_parallel_size": 1, "stages_per_rank": 1,
              "style": "loop", "backbone": "backbone"}
    _dcp.save(checkpoint, path, module=model, optimizers=optimizers, names=ModelNames.of(model), layout=layout,
              is_global_zero=True)


def _load_one_rank(model, optimizers, path) -> dict:
    from lightning.fabric.plugins import TorchCheckpointIO

    return _dcp.load(path, module=model, optimizers=optimizers, names=ModelNames.of(model), fitting=True,
                     weights_only=None, checkpoint_io=TorchCheckpointIO(), global_rank=0)


def test_optimizer_round_trip_before_and_after_the_first_step(tmp_path):
    """An optimizer saved before its first step stays fresh (saving must not initialise Adam's state, which
    would shift its bias correction); after a step, its state is restored exactly and consolidates to the
    ``torch.optim`` format."""
    path = tmp_path / "one.ckpt"

    def make(seed):
        model = models.make_model(seed=seed, optimizer="adamw", lr=0.01)
        return model, model.configure_optimizers()

    def lightning_dict(model):
        return {"state_dict": model.state_dict(), "optimizer_states": [], "lr_schedulers": [], "epoch": 0,
                "global_step": 0, "hyper_parameters": dict(model.hparams)}

    model, opt = make(1)
    _save_one_rank(model, [opt], lightning_dict(model), path)
    assert not opt.state, "saving initialised the optimizer state"
    other, other_opt = make(2)
    other_opt.param_groups[0]["lr"] = 123.0
    _load_one_rank(other, [other_opt], path)
    assert not other_opt.state and other_opt.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())
    # The LR finder's case: the optimizer stepped since, and got an `initial_lr`; it comes back as
    # `Optimizer.load_state_dict` leaves it: no state, exactly the saved hyper-parameters.
    x, y = models.token_data(8)[:]
    stepped, stepped_opt = make(4)
    torch.nn.functional.cross_entropy(stepped(x).flatten(0, 1), y.flatten()).backward()
    stepped_opt.step()
    stepped_opt.param_groups[0]["initial_lr"] = 5.0
    _load_one_rank(stepped, [stepped_opt], path)
    assert not stepped_opt.state
    saved_keys = {k for k in opt.param_groups[0] if k != "params"}
    assert set(stepped_opt.param_groups[0]) - {"params"} == saved_keys
    assert stepped_opt.param_groups[0]["lr"] == 0.01

    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    _save_one_rank(model, [opt], lightning_dict(model), path)  # replaces the first save
    third, third_opt = make(3)
    _load_one_rank(third, [third_opt], path)
    want = opt.state_dict()
    got = third_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    assert all(torch.equal(want["state"][i][k], got["state"][i][k]) for i in want["state"] for k in want["state"][i])
    consolidated = consolidated_checkpoint(path)["optimizer_states"][0]
    assert consolidated["param_groups"] == want["param_groups"]
    assert set(consolidated["state"]) == set(want["state"])
    assert all(
        torch.equal(want["state"][i][k], consolidated["state"][i][k]) for i in want["state"] for k in want["state"][i]
    )
