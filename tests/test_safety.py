"""Checkpoints are untrusted input; a bad checkpoint fails clearly on every rank; a failed save loses nothing.

One job (``tests/safety_job.py``: 2 processes started as ``torchrun`` would, so that a phase failing on every rank
does not end the processes) runs, in order:

- ``overwrite_last``: training under ``ModelCheckpoint(every 2 steps, save_last)`` where rank 1's DCP writer fails
  while ``last.ckpt`` is replaced at step 4: the fit fails on every rank, ``last.ckpt`` is still step 2's;
- ``manual``: one epoch, ``good.ckpt``, then saves that fail half-way (rank 0 cannot create the directory; rank 0
  cannot write ``meta.pt``; rank 0 cannot rename the finished directory into place; rank 0's DCP writer fails),
  three of them over step 2's ``last.ckpt``, and a last save that succeeds;
- bad copies of ``good.ckpt`` (``safety_job.craft``): planted ``os.system`` payloads in ``.metadata``, ``meta.pt``
  and a shard, truncated and missing files, another model, a save that did not finish;
- one resume (``trainer.fit(ckpt_path=...)``) from each bad copy, which must fail on every rank within seconds,
  naming the file; a resume with another optimizer; a trusted resume (``weights_only=False``).

The other paths, ``lightning_pipe.load_from_checkpoint``, consolidation and ``stored_balance``, run in this process
on the same copies. No planted payload may ever run: each would create its marker file.
"""

from __future__ import annotations

import fractions
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import models
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_script
from safety_job import PLANTED_ENTRY

import lightning_pipe
from lightning_pipe._compat import torch as torch_compat
from lightning_pipe.checkpoint import consolidated_checkpoint, is_pipeline_checkpoint, stored_balance
from lightning_pipe.checkpoint._files import META_FILENAME, OLD_SUFFIX, TMP_SUFFIX
from lightning_pipe.checkpoint._safe import (
    DamagedCheckpointError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    dcp_metadata_globals,
    load_dcp_metadata,
)
from lightning_pipe.consolidate import main as consolidate_main

HERE = Path(__file__).resolve().parent
STEPS_PER_EPOCH = 6
PIPE = {"num_microbatches": 4, "timeout_s": 60}
#: A failing load or save must end on every rank well before the process group's timeout (60 s) could end it.
PROMPT_S = 30

#: Resume from each bad copy: the error type every rank raises and what its message says.
LOAD_CASES: dict[str, tuple[str, list[str]]] = {
    "planted_index": ("UnsafeCheckpointError", ["planted_index.ckpt/.metadata`", "`posix.system`"]),
    "planted_meta": ("UnsafeCheckpointError", ["planted_meta.ckpt/meta.pt`", "`posix.system`"]),
    "planted_shard": ("UnsafeCheckpointError", ["planted_shard.ckpt/__0_0.distcp`", PLANTED_ENTRY, "`posix.system`"]),
    "custom_object": (
        "UnsafeCheckpointError",
        ["custom_object.ckpt/meta.pt`", "`fractions.Fraction`", "add_safe_globals"],
    ),
    "truncated_shard": ("DamagedCheckpointError", ["damaged or incomplete", "truncated_shard.ckpt/__1_0.distcp"]),
    "missing_shard": ("DamagedCheckpointError", ["damaged or incomplete", "missing_shard.ckpt/__1_0.distcp"]),
    "truncated_index": ("DamagedCheckpointError", ["truncated_index.ckpt/.metadata` is damaged or incomplete"]),
    "truncated_meta": ("DamagedCheckpointError", ["truncated_meta.ckpt/meta.pt` is damaged or incomplete"]),
    "missing_index": ("FileNotFoundError", ["missing_index.ckpt` is a directory but", "it lacks `.metadata`"]),
    "missing_meta": ("FileNotFoundError", ["missing_meta.ckpt` is a directory but", "it lacks `meta.pt`"]),
    "wrong_shapes": (
        "CheckpointMismatchError",
        ["rank 1: shape mismatch", "backbone.6.weight: checkpoint (33, 16), model (32, 16)"],
    ),
    "other_optimizer": (
        "CheckpointMismatchError",
        ["optimizer 0 as saved by `torch.optim.sgd.SGD`", "now returns `torch.optim.adamw.AdamW`"],
    ),
    "interrupted": ("FileNotFoundError", ["interrupted.ckpt` does not exist: a save to it did not finish"]),
    "interrupted_tmp": ("FileNotFoundError", [f"interrupted.ckpt{TMP_SUFFIX}` is a save that did not finish"]),
}
PLANTED = ("planted_index", "planted_meta", "planted_shard")


def fit_phase(name: str, **kwargs: Any) -> dict[str, Any]:
    phase = {
        "name": name,
        "model": {"scheduler": "step"},
        "strategy": dict(PIPE),
        "data": {"n": 48, "batch_size": 8},
        "trainer": {"max_epochs": 1},
    }
    phase.update(kwargs)
    return phase


def results(out: Path, name: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]


def read_step(path: Path) -> int:
    return torch.load(path / META_FILENAME, weights_only=True)["global_step"]


def assert_no_payload_ran(bad: Path) -> None:
    ran = sorted(p.name for p in bad.glob("PAYLOAD_RAN_*"))
    assert not ran, f"a planted payload ran: {ran}"


# ----------------------------------------------------------------------------------------------------------- the job
@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("safety")
    ck, good, bad = work / "ck", work / "good.ckpt", work / "bad"
    (work / "a_file").write_text("not a directory")
    writer_fails = {"kind": "writer", "rank": 1, "call": 4}  # saves: step=2, last, step=4, last <- fails
    phases = [
        fit_phase(
            "overwrite_last",
            checkpoints=[
                {
                    "dirpath": str(ck),
                    "filename": "{step}",
                    "every_n_train_steps": 2,
                    "save_top_k": -1,
                    "save_last": True,
                }
            ],
            fault=writer_fails,
        ),
        fit_phase(
            "manual",
            saves=[
                {"path": str(good)},
                {"path": str(work / "a_file" / "x.ckpt")},
                {"path": str(ck / "last.ckpt"), "fault": {"kind": "meta", "rank": 0, "call": 1}},
                {"path": str(ck / "last.ckpt"), "fault": {"kind": "commit", "rank": 0, "call": 1}},
                {"path": str(ck / "last.ckpt"), "fault": {"kind": "writer", "rank": 0, "call": 1}},
                {"path": str(work / "again.ckpt")},
            ],
        ),
        {"name": "craft", "craft": {"from": str(good), "into": str(bad)}},
    ]
    paths = {case: bad / f"{case}.ckpt" for case in LOAD_CASES}
    paths["other_optimizer"] = good
    paths["interrupted_tmp"] = bad / f"interrupted.ckpt{TMP_SUFFIX}"
    for case in LOAD_CASES:
        model = {"scheduler": "step", "optimizer": "adamw" if case == "other_optimizer" else "sgd"}
        phases.append(fit_phase(case, ckpt_path=str(paths[case]), model=model, trainer={"max_epochs": 2}))
    # Lightning 2.6 does not hand `trainer.fit(weights_only=False)` on to a strategy that restores after setup:
    # torch's own switch for `weights_only=None` is the way to trust a checkpoint on resume.
    trust = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    phases.append(fit_phase("trusted", ckpt_path=str(paths["custom_object"]), env=trust, trainer={"max_epochs": 2}))
    spec = work / "spec.json"
    spec.write_text(json.dumps({"devices": 2, "phases": phases}))
    out = work / "out"
    proc = run_script([str(HERE / "safety_job.py"), str(spec), str(out)], cwd=work, timeout=280)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return {"work": work, "out": out, "ck": ck, "good": good, "bad": bad, "paths": paths, "log": proc.stdout}


# --------------------------------------------------------------------------------------------------- 1. failed saves
@pytest.mark.dist
def test_failed_overwrite_during_fit_keeps_the_previous_checkpoint(job):
    """Rank 1's shard cannot be written while ``last.ckpt`` (step 2) is replaced at step 4: the fit fails on both
    ranks at once, saying so; ``last.ckpt`` is still step 2's and loads; nothing half-written is left."""
    for rank, r in enumerate(results(job["out"], "overwrite_last")):
        assert r["error"] is not None, rank
        assert "CheckpointSaveError" in r["error"] and "last.ckpt` failed while writing it" in r["error"], r["error"]
        assert "rank 1: OSError: [Errno 28] injected" in r["error"] and "is still there" in r["error"], r["error"]
        assert r["seconds"] < PROMPT_S and r["global_step"] == 4, (rank, r["seconds"], r["global_step"])
    ck = job["ck"]
    assert sorted(p.name for p in ck.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert read_step(ck / "last.ckpt") == 2 and read_step(ck / "step=4.ckpt") == 4
    last = consolidated_checkpoint(ck / "last.ckpt")
    step2 = consolidated_checkpoint(ck / "step=2.ckpt")
    assert last["global_step"] == 2 and set(last["state_dict"]) == set(step2["state_dict"])
    assert all(torch.equal(v, step2["state_dict"][k]) for k, v in last["state_dict"].items())


@pytest.mark.dist
def test_failed_manual_saves_lose_nothing(job):
    """Each half-way failure is raised on both ranks, at once; the model and optimizer states are unchanged by it;
    the checkpoint it was replacing is still there, whole; and saving works again afterwards."""
    ranks = results(job["out"], "manual")
    expected = [
        None,
        "failed while preparing its directory (rank 0: FileExistsError",
        "failed while writing it (rank 0: OSError: [Errno 28] injected: no space left on device writing meta.pt",
        "failed while moving it into place (rank 0: PermissionError: [Errno 13] injected",
        "failed while writing it (rank 0: OSError: [Errno 28] injected: no space left on device (rank 0)",
        None,
    ]
    for rank, r in enumerate(ranks):
        assert r["error"] is None and r["global_step"] == STEPS_PER_EPOCH, (rank, r["error"])
        for save, want in zip(r["saves"], expected):
            assert save["unchanged"], (rank, save)
            assert save["seconds"] < PROMPT_S, (rank, save)
            if want is None:
                assert save["error"] is None, (rank, save)
            else:
                assert save["error"] and "CheckpointSaveError" in save["error"] and want in save["error"], save
    ck = job["ck"]
    assert read_step(ck / "last.ckpt") == 2  # three failed overwrites with the step-6 state left it alone
    assert not [p for p in [*job["work"].iterdir(), *ck.iterdir()] if p.name.endswith((TMP_SUFFIX, OLD_SUFFIX))]
    assert not (job["work"] / "a_file" / "x.ckpt").exists()
    good, again = consolidated_checkpoint(job["good"]), consolidated_checkpoint(job["work"] / "again.ckpt")
    assert good["global_step"] == again["global_step"] == STEPS_PER_EPOCH
    assert all(torch.equal(v, again["state_dict"][k]) for k, v in good["state_dict"].items())
    for a, b in zip(good["optimizer_states"][0]["state"].values(), again["optimizer_states"][0]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


# -------------------------------------------------------------------------------------------- 2. resume, every rank
@pytest.mark.dist
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_resume_from_a_bad_checkpoint_fails_on_every_rank(job, case):
    kind, needles = LOAD_CASES[case]
    for rank, r in enumerate(results(job["out"], case)):
        error = r["error"]
        assert error is not None, f"rank {rank} resumed from {case}"
        assert error.split(":", 1)[0].endswith(kind), (rank, error)
        for needle in needles:
            assert needle in error, (rank, needle, error)
        assert r["seconds"] < PROMPT_S, (rank, r["seconds"])
        assert r["start_step"] is None, rank  # training never started
    assert_no_payload_ran(job["bad"])


@pytest.mark.dist
def test_trusted_resume_loads_a_custom_object(job):
    """Trusting a checkpoint (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, as for ``torch.load``) loads what weights-only
    loading refuses."""
    manual = results(job["out"], "manual")
    for rank, r in enumerate(results(job["out"], "trusted")):
        assert r["error"] is None, (rank, r["error"])
        assert r["start_step"] == STEPS_PER_EPOCH and r["global_step"] == 2 * STEPS_PER_EPOCH
        want = manual[rank]["state_dict"]
        assert r["start_state"].keys() == want.keys()
        assert all(torch.equal(v, want[k]) for k, v in r["start_state"].items()), rank


# ------------------------------------------------------------------------------------ 3. the one-process loaders
@pytest.mark.dist
def test_load_from_checkpoint_refuses_planted_files(job):
    bad = job["bad"]
    for case, needle in (
        ("planted_index", "/.metadata` references `posix.system`"),
        ("planted_meta", "/meta.pt` references `posix.system`"),
    ):
        with pytest.raises(UnsafeCheckpointError, match="Nothing from the file was run") as info:
            lightning_pipe.load_from_checkpoint(models.TinyLM, bad / f"{case}.ckpt")
        assert f"{case}.ckpt{needle}" in str(info.value), str(info.value)
    # The weights never come from optimizer entries: the planted one is not even read.
    model = lightning_pipe.load_from_checkpoint(models.TinyLM, bad / "planted_shard.ckpt")
    assert model.hparams.scheduler == "step"
    assert_no_payload_ran(bad)


@pytest.mark.dist
def test_load_from_checkpoint_custom_object_needs_weights_only_false(job):
    custom = job["bad"] / "custom_object.ckpt"
    with pytest.raises(UnsafeCheckpointError, match="`fractions.Fraction`.*weights_only=False"):
        lightning_pipe.load_from_checkpoint(models.TinyLM, custom)
    model = lightning_pipe.load_from_checkpoint(models.TinyLM, custom, weights_only=False)
    want = consolidated_checkpoint(job["good"])["state_dict"]
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.dist
def test_load_from_checkpoint_on_bad_files(job):
    bad = job["bad"]
    for case in ("missing_index", "missing_meta", f"interrupted.ckpt{TMP_SUFFIX}"):
        path = bad / (case if case.startswith("interrupted") else f"{case}.ckpt")
        with pytest.raises(IsADirectoryError, match="not a complete lightning_pipe checkpoint"):
            lightning_pipe.load_from_checkpoint(models.TinyLM, path)
    for case, needle in (
        ("truncated_index", "truncated_index.ckpt/.metadata` is damaged or incomplete"),
        ("truncated_meta", "truncated_meta.ckpt/meta.pt` is damaged or incomplete (RuntimeError: PytorchStreamReader"),
        ("truncated_shard", "truncated_shard.ckpt/__1_0.distcp"),
        ("missing_shard", "No such file or directory"),
    ):
        with pytest.raises(DamagedCheckpointError) as info:
            lightning_pipe.load_from_checkpoint(models.TinyLM, bad / f"{case}.ckpt")
        assert needle in str(info.value), str(info.value)


@pytest.mark.dist
def test_consolidate_refuses_planted_and_bad_files(job, capsys):
    bad, out = job["bad"], job["work"] / "consolidated.ckpt"
    for case, needle in (
        ("planted_index", "planted_index.ckpt/.metadata` references `posix.system`"),
        ("planted_meta", "planted_meta.ckpt/meta.pt` references `posix.system`"),
        ("planted_shard", f"planted_shard.ckpt/__0_0.distcp` (entry `optimizer_0.{PLANTED_ENTRY}`) references"),
        ("custom_object", "custom_object.ckpt/meta.pt` references `fractions.Fraction`"),
        ("truncated_index", "truncated_index.ckpt/.metadata` is damaged"),
        ("truncated_meta", "truncated_meta.ckpt/meta.pt` is damaged"),
        ("truncated_shard", "EOFError (in `"),
        ("missing_shard", "No such file or directory"),
    ):
        with pytest.raises(SystemExit) as exc:
            consolidate_main([str(bad / f"{case}.ckpt"), str(out)])
        err = capsys.readouterr().err
        assert exc.value.code == 1 and needle in err and "error:" in err, (case, err)
        assert not out.exists()
    for case in ("missing_index", "missing_meta"):
        with pytest.raises(SystemExit) as exc:
            consolidate_main([str(bad / f"{case}.ckpt"), str(out)])
        assert exc.value.code == 2 and "not a complete lightning_pipe checkpoint" in capsys.readouterr().err
    assert_no_payload_ran(bad)
    # A trusted checkpoint with an object of the user's class: --trusted consolidates it.
    assert consolidate_main([str(bad / "custom_object.ckpt"), str(out), "--trusted"]) == 0
    assert torch.load(out, weights_only=False)["user_state"] == fractions.Fraction(1, 3)


@pytest.mark.dist
def test_stored_balance_reads_meta_pt_weights_only(job):
    bad = job["bad"]
    assert stored_balance(job["good"]) == [4, 3]
    with pytest.raises(UnsafeCheckpointError, match="planted_meta.ckpt/meta.pt` references `posix.system`"):
        stored_balance(bad / "planted_meta.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="`fractions.Fraction`"):
        stored_balance(bad / "custom_object.ckpt")
    assert stored_balance(bad / "custom_object.ckpt", weights_only=False) == [4, 3]
    assert stored_balance(bad / "planted_index.ckpt") == [4, 3]  # reads meta.pt only: the index is not touched
    with pytest.raises(DamagedCheckpointError, match="meta.pt` is damaged or incomplete"):
        stored_balance(bad / "truncated_meta.ckpt")
    assert_no_payload_ran(bad)


@pytest.mark.dist
def test_interrupted_save_is_never_a_checkpoint(job):
    tmp = job["bad"] / f"interrupted.ckpt{TMP_SUFFIX}"
    assert (tmp / META_FILENAME).is_file() and (tmp / ".metadata").is_file()  # complete contents, still refused
    assert not is_pipeline_checkpoint(tmp)
    with pytest.raises(FileNotFoundError, match="is a save that did not finish"):
        consolidated_checkpoint(tmp)


# ------------------------------------------------------------------------------------- 4. the restricted unpickler
def recorded_globals(raw: bytes) -> set[str]:
    """Every ``module.name`` a pickle loads (it is our own file: recording lets it load)."""
    found = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recording(io.BytesIO(raw)).load()
    return found


def admitted(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    if (module, attr) in dcp_metadata_globals():
        return True
    return module == "torch" and isinstance(getattr(torch, attr, None), torch.dtype)


@pytest.mark.dist
def test_index_of_a_real_checkpoint_reads_as_torch_reads_it(job):
    raw = (job["good"] / ".metadata").read_bytes()
    assert all(admitted(name) for name in recorded_globals(raw)), recorded_globals(raw)
    safe = load_dcp_metadata(job["good"] / ".metadata")
    plain = pickle.loads(raw)
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.planner_data == plain.planner_data
    assert safe.storage_data == plain.storage_data
    assert torch.serialization.get_unsafe_globals_in_checkpoint(job["good"] / META_FILENAME) == []


def test_index_admits_everything_this_torch_writes(tmp_path):
    """DCP's index of tensors of every kind (dtypes, layouts, memory formats, 0-d, empty, views) and non-tensor
    entries holds only admitted globals, and the safe reader reads everything exactly as torch's does. Run under
    every supported torch: a version that adds a class to the index fails here."""
    g = torch.Generator().manual_seed(0)
    state = {
        "tensors": {
            "f32": torch.randn(3, 4, generator=g),
            "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
            "f16": torch.randn(2, 2, generator=g).half(),
            "f64": torch.randn(2, generator=g).double(),
            "c64": torch.randn(3, generator=g, dtype=torch.complex64),
            "i8": torch.arange(-4, 4, dtype=torch.int8),
            "u8": torch.arange(6, dtype=torch.uint8),
            "i64": torch.arange(7),
            "bool": torch.tensor([True, False]),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
            "view": torch.randn(6, 4, generator=g)[1::2],
            "param": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        },
        "extra": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adamw", "flag": None, "ints": [1, 2], "nested": {"a": 1}},
    }
    path = tmp_path / "ck"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    names = recorded_globals((path / ".metadata").read_bytes())
    refused = sorted(n for n in names if not admitted(n))
    assert not refused, f"torch {torch.__version__} writes globals the restricted unpickler refuses: {refused}"
    safe = torch_compat.read_dcp_in_one_process(path, storage_reader=SafeFileSystemReader(path))
    plain = torch_compat.read_dcp_in_one_process(path, storage_reader=dcp.FileSystemReader(path))
    assert safe.keys() == plain.keys() == state.keys()
    for key, value in state["tensors"].items():
        assert torch.equal(safe["tensors"][key], value.detach()) and torch.equal(plain["tensors"][key], value.detach())
    assert safe["extra"] == plain["extra"] == {**state["extra"], "betas": (0.9, 0.999)}


@pytest.mark.dist
def test_index_refusals_and_the_user_allow_list(tmp_path, job):
    index = load_dcp_metadata(job["good"] / ".metadata")
    index.planner_data["user"] = fractions.Fraction(1, 3)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match="references `fractions.Fraction`, which DCP's index never holds"):
        load_dcp_metadata(tmp_path / ".metadata")
    with torch.serialization.safe_globals([fractions.Fraction]):  # what the user allow-lists is admitted here too
        assert load_dcp_metadata(tmp_path / ".metadata").planner_data["user"] == fractions.Fraction(1, 3)
    assert load_dcp_metadata(tmp_path / ".metadata", weights_only=False).planner_data["user"] == fractions.Fraction(
        1, 3
    )
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "an index"}))
    with pytest.raises(DamagedCheckpointError, match="holds a dict, not the index"):
        load_dcp_metadata(tmp_path / ".metadata")

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, fractions.Fraction) else None

    buffer = io.BytesIO()
    Persistent(buffer).dump({"x": fractions.Fraction(1, 2)})
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="persistent reference"):
        load_dcp_metadata(tmp_path / ".metadata")


@pytest.mark.dist
def test_meta_pt_admits_argparse_namespace(tmp_path, job):
    """What ``save_hyperparameters`` may store for an argparse configuration loads weights-only."""
    import argparse

    from lightning_pipe.checkpoint._files import read_meta

    meta = torch.load(job["good"] / META_FILENAME, weights_only=True)
    meta["hyper_parameters"]["args"] = argparse.Namespace(width=16, path=Path("/data"))
    torch.save(meta, tmp_path / META_FILENAME)
    assert read_meta(tmp_path)["hyper_parameters"]["args"].width == 16
    with zipfile.ZipFile(tmp_path / META_FILENAME) as z:  # the argument really went through the unpickler
        assert any(b"Namespace" in z.read(n) for n in z.namelist() if n.endswith("data.pkl"))


@pytest.mark.dist
def test_one_process_reader_without_torch_private_names(job, monkeypatch):
    """Consolidation's fallback for a torch without ``_EmptyStateDictLoadPlanner`` reads the same entries."""
    import torch.distributed.checkpoint.default_planner as default_planner

    good = job["good"]
    want = torch_compat.read_dcp_in_one_process(good, storage_reader=SafeFileSystemReader(good))
    weights = torch_compat.read_dcp_in_one_process(good, keys={"state_dict"}, storage_reader=SafeFileSystemReader(good))
    monkeypatch.delattr(default_planner, "_EmptyStateDictLoadPlanner")
    got = torch_compat.read_dcp_in_one_process(good, storage_reader=SafeFileSystemReader(good))
    assert got.keys() == want.keys()
    for top in want:
        assert got[top].keys() == want[top].keys(), top
        for key, value in want[top].items():
            same = torch.equal(value, got[top][key]) if isinstance(value, torch.Tensor) else value == got[top][key]
            assert same, (top, key)
    assert torch_compat.read_dcp_in_one_process(good, keys={"state_dict"}).keys() == weights.keys() == {"state_dict"}
    with pytest.raises(UnsafeCheckpointError, match="planted_shard.ckpt/__0_0.distcp` .* references `posix.system`"):
        consolidated_checkpoint(job["bad"] / "planted_shard.ckpt")
    assert_no_payload_ran(job["bad"])
