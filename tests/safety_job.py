"""Checkpoint safety scenarios in real processes: bad checkpoints and failing saves, one phase after the other.

Usage: ``python tests/safety_job.py SPEC.json OUT_DIR``. The script starts its ranks itself, as ``torchrun`` would
(``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set for each), so Lightning does not launch them.
That keeps the processes alive through a phase that fails on every rank (a launching rank 0 ends its children
after an exception), and many failing phases share one start of the processes.

The spec holds ``devices`` and a list of ``phases``, each a ``Trainer.fit`` (or ``"fn": "validate"``) with:
``model`` (``models.make_model`` arguments), ``strategy``, ``trainer``, ``data``, ``checkpoints``
(``ModelCheckpoint`` arguments), ``ckpt_path``, ``weights_only`` (passed to ``fit``/``validate``), ``env``
(environment variables set during the fit), ``fault`` (active during the fit), and ``saves``: manual
``trainer.save_checkpoint`` calls after the fit, each with its own optional ``fault``. A fault is
``{"kind": k, "rank": r, "call": n}``: on rank ``r``, the ``n``-th call (1-based, counted within its phase or save)
of

- ``"writer"``: DCP's ``FileSystemWriter.write_data`` (this rank's shard) raises ``OSError``;
- ``"meta"``: writing ``meta.pt`` raises ``OSError``;
- ``"commit"``: renaming the finished temporary directory into place raises ``OSError``.

A phase ``{"name": ..., "craft": {"from": GOOD_DIR, "into": DIR}}`` makes the bad copies of a checkpoint that
:func:`craft` lists (rank 0 writes them while the others wait).

Errors never escape a phase: every rank writes ``OUT_DIR/<phase>.rank<r>.pt`` with the fit's error (or None) and
how many seconds the call took, the global step when training started and at the end, the start and end weights,
and for each manual save its error, its seconds and whether the weights and optimizer states are unchanged by it.
"""

from __future__ import annotations

import copy
import fractions
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models
from helpers import share_after_call

from lightning_pipe import PipelineStrategy
from lightning_pipe._compat import torch as torch_compat
from lightning_pipe.checkpoint import _dcp
from lightning_pipe.checkpoint._files import META_FILENAME, TMP_SUFFIX
from lightning_pipe.checkpoint._safe import SafeFileSystemReader, load_dcp_metadata

#: The shard entry the planted shard replaces: a hyper-parameter of the first stage's first parameter.
PLANTED_ENTRY = "param_groups.backbone.0.weight.lr"


class Payload:
    """Unpickled, it runs ``touch MARKER``: the file holds ``os.system`` and the command, not this class."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def marker(into: Path, case: str) -> Path:
    """The file a planted payload of ``case`` creates if it ever runs."""
    return into / f"PAYLOAD_RAN_{case}"


def craft(good: Path, into: Path) -> dict[str, Path]:
    """Bad copies of the complete checkpoint directory ``good``, by case name:

    - ``planted_index``, ``planted_meta``, ``planted_shard``: a pickled ``os.system`` call inside DCP's index (in a
      real ``Metadata``), among ``meta.pt``'s hyper-parameters, or as a shard's non-tensor entry;
    - ``custom_object``: ``meta.pt`` also holds a harmless object of a class weights-only loading does not admit;
    - ``truncated_shard``, ``missing_shard``, ``truncated_index``, ``missing_index``, ``truncated_meta``,
      ``missing_meta``: one file cut in half or deleted;
    - ``wrong_shapes``: the head is one row larger than the model's (a checkpoint of another model);
    - ``interrupted``: the directory a save leaves when it stops before the rename (complete contents), under
      ``interrupted.ckpt`` + the temporary suffix; ``interrupted.ckpt`` itself does not exist.
    """
    into.mkdir(parents=True, exist_ok=True)
    out = {}

    def copy_of(case: str) -> Path:
        dst = into / f"{case}.ckpt"
        shutil.copytree(good, dst)
        out[case] = dst
        return dst

    index = load_dcp_metadata(good / ".metadata")
    index.planner_data["extra"] = Payload(marker(into, "planted_index"))
    (copy_of("planted_index") / ".metadata").write_bytes(pickle.dumps(index))

    meta = torch.load(good / META_FILENAME, weights_only=True)
    torch.save(
        {**meta, "hyper_parameters": {**meta["hyper_parameters"], "evil": Payload(marker(into, "planted_meta"))}},
        copy_of("planted_meta") / META_FILENAME,
    )
    torch.save({**meta, "user_state": fractions.Fraction(1, 3)}, copy_of("custom_object") / META_FILENAME)

    def rewrite(case: str, change: Any) -> None:
        state = torch_compat.read_dcp_in_one_process(good, storage_reader=SafeFileSystemReader(good))
        change(state)
        dst = into / f"{case}.ckpt"
        torch.distributed.checkpoint.save(state, checkpoint_id=dst, no_dist=True)
        shutil.copy(good / META_FILENAME, dst / META_FILENAME)
        out[case] = dst

    rewrite(
        "planted_shard",
        lambda state: state["optimizer_0"].update({PLANTED_ENTRY: Payload(marker(into, "planted_shard"))}),
    )

    def wider_head(state: dict[str, Any]) -> None:
        weights = state["state_dict"]
        weights["backbone.6.weight"] = torch.zeros(models.VOCAB + 1, models.DIM)
        weights["backbone.6.bias"] = torch.zeros(models.VOCAB + 1)

    rewrite("wrong_shapes", wider_head)

    for case, name in (("shard", "__1_0.distcp"), ("index", ".metadata"), ("meta", META_FILENAME)):
        with open(copy_of(f"truncated_{case}") / name, "r+b") as f:
            f.truncate((good / name).stat().st_size // 2)
        (copy_of(f"missing_{case}") / name).unlink()
    shutil.copytree(good, into / f"interrupted.ckpt{TMP_SUFFIX}")
    out["interrupted"] = into / "interrupted.ckpt"
    return out


class StartRecorder(L.Callback):
    def __init__(self) -> None:
        self.start_step: Optional[int] = None
        self.start_state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer, pl_module):  # in the call: the keys of this rank's share (whole after it)
        self.held_keys = list(pl_module.state_dict())

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step
        self.start_state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@contextmanager
def injected(fault: Optional[dict[str, Any]], rank: int) -> Iterator[None]:
    """Make the ``fault["call"]``-th call of one save step fail on ``fault["rank"]`` while the block runs."""
    if not fault or fault["rank"] != rank:
        yield
        return
    import torch.distributed.checkpoint as dcp

    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == fault["call"]

    kind = fault["kind"]
    if kind == "writer":
        owner, name = dcp.FileSystemWriter, "write_data"
        original = owner.write_data

        def replacement(self, plan, planner):
            if due():
                raise OSError(28, f"injected: no space left on device (rank {rank})")
            return original(self, plan, planner)

    elif kind == "meta":
        owner, name = _dcp, "write_meta"
        original = _dcp.write_meta

        def replacement(meta, path):
            if due():
                raise OSError(28, f"injected: no space left on device writing meta.pt (rank {rank})")
            return original(meta, path)

    elif kind == "commit":
        owner, name = Path, "rename"
        original = Path.rename

        def replacement(self, target):
            if self.name.endswith(TMP_SUFFIX) and due():
                raise OSError(13, f"injected: permission denied renaming {self.name} (rank {rank})")
            return original(self, target)

    else:
        raise ValueError(f"unknown fault {kind!r}")
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def snapshot(trainer: L.Trainer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    weights = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    return weights, [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def run_phase(phase: dict[str, Any], devices: int, rank: int, out: Path) -> None:
    name = phase["name"]
    model = models.make_model(**phase.get("model", {}))
    recorder = StartRecorder()
    checkpoints = [ModelCheckpoint(**kwargs) for kwargs in phase.get("checkpoints", [])]
    strategy = dict(phase.get("strategy", {"num_microbatches": 4}))
    strategy["timeout"] = timedelta(seconds=strategy.pop("timeout_s", 60))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=PipelineStrategy(**strategy),
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[recorder, *checkpoints],
        default_root_dir=str(out / "root"),
        **phase.get("trainer", {}),
    )
    data = models.loader(**phase.get("data", {}))
    error, started = None, time.monotonic()
    saved_env = {key: os.environ.get(key) for key in phase.get("env", {})}
    os.environ.update(phase.get("env", {}))
    try:
        with injected(phase.get("fault"), rank):
            if phase.get("fn", "fit") == "validate":
                trainer.validate(model, data, ckpt_path=phase.get("ckpt_path"), weights_only=phase.get("weights_only"))
            else:
                trainer.fit(model, data, ckpt_path=phase.get("ckpt_path"), weights_only=phase.get("weights_only"))
    except Exception as exc:
        error = describe(exc)
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    seconds = time.monotonic() - started
    saves = []
    for save in phase.get("saves", []):
        before = snapshot(trainer)
        save_error, started = None, time.monotonic()
        try:
            with injected(save.get("fault"), rank):
                trainer.save_checkpoint(save["path"], weights_only=False)
        except Exception as exc:
            save_error = describe(exc)
        after = snapshot(trainer)
        saves.append(
            {
                "path": save["path"],
                "error": save_error,
                "seconds": time.monotonic() - started,
                "unchanged": same(before, after),
            }
        )
    result = {
        "error": error,
        "seconds": seconds,
        "start_step": recorder.start_step,
        "start_state": recorder.start_state,
        "global_step": trainer.global_step,
        "state_dict": share_after_call(model, getattr(recorder, "held_keys", None)),
        "saves": saves,
    }
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"{name}.rank{rank}.pt")
    print(f"safety_job: rank {rank} phase {name}: {'ok' if error is None else error.splitlines()[0][:160]}", flush=True)


def run_rank(spec: dict[str, Any], out: Path) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    for phase in spec["phases"]:
        if "craft" in phase:
            if rank == 0:
                craft(Path(phase["craft"]["from"]), Path(phase["craft"]["into"]))
            torch.distributed.barrier()
        else:
            run_phase(phase, spec["devices"], rank, out)


def launch(spec_file: str, out: str, devices: int) -> int:
    """Start the ranks and wait for them; when one fails, give the others a few seconds, then end them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(devices):
        env = {
            **os.environ,
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(devices),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_file, out], env=env))
    deadline = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.returncode not in (None, 0) for p in procs):
            deadline = time.monotonic() + 10
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return max(p.returncode for p in procs)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    if "LOCAL_RANK" in os.environ:
        run_rank(spec, Path(sys.argv[2]))
    else:
        sys.exit(launch(sys.argv[1], sys.argv[2], spec["devices"]))
