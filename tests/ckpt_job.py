"""Checkpoint scenarios run as their own script, so Lightning's launcher can start the other ranks from it.

Usage: ``python tests/ckpt_job.py SPEC.json OUT_DIR``. The spec holds ``devices`` and a list of ``phases``, each
a ``Trainer.fit`` (or ``"fn": "validate"``) with its own model, strategy, callbacks and ``ckpt_path``, run one
after the other in the same processes. After each phase every rank writes ``OUT_DIR/<phase>.rank<r>.pt``: the
losses and learning rates per step, its (local) state dict when training started (after any restore) and at the
end, the global step, the callback metrics, and the error message if the phase raised (an expected error is also
written at once to ``<phase>.rank<r>.error.txt``). With ``"strategy": null`` (and one device) a phase is the
single-device reference; :func:`run_phase` runs one in the calling process.

Fault injection (``"crash": {"rank": r, "save": n}``): rank ``r`` exits with ``os._exit`` in the middle of the
``n``-th checkpoint save of the job (1-based), after writing its DCP shard and before the save is committed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models
from helpers import share_after_call, state_after_call

from lightning_pipe import PipelineStrategy


class Recorder(L.Callback):
    def __init__(self, out: Optional[Path], name: str) -> None:
        self.out = out
        self.name = name
        self.steps: list[dict[str, float]] = []
        self.start_state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.start_state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.start_step = trainer.global_step

    def on_train_end(self, trainer, pl_module):  # in the call: the keys of this rank's share (whole after it)
        self.held_keys = list(pl_module.state_dict())

    def on_validation_end(self, trainer, pl_module):
        if not trainer.training:
            self.held_keys = list(pl_module.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(
            {
                "train_loss": float(trainer.callback_metrics["train_loss"]),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "global_step": trainer.global_step,
            }
        )

    def on_exception(self, trainer, pl_module, exception):
        # Written at once: rank 0 ends the other ranks shortly after an exception.
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            text = "".join(traceback.format_exception_only(type(exception), exception))
            (self.out / f"{self.name}.rank{trainer.global_rank}.error.txt").write_text(text)


def _install_crash(rank: int, save: int, global_rank: int) -> None:
    """Make ``rank`` exit in the middle of the ``save``-th DCP save of this process."""
    import torch.distributed.checkpoint as dcp

    if rank != global_rank:
        return
    original = dcp.FileSystemWriter.write_data
    count = {"n": 0}

    def write_data(self, plan, planner):
        count["n"] += 1
        future = original(self, plan, planner)
        if count["n"] == save:
            future.wait()  # the shard is on disk; the save is not finished
            print(f"ckpt_job: rank {global_rank} exits in the middle of save {save}", flush=True)
            os._exit(17)
        return future

    dcp.FileSystemWriter.write_data = write_data


def run_phase(phase: dict[str, Any], devices: int, out: Optional[Path]) -> dict[str, Any]:
    name = phase.get("name", "phase")
    model = models.make_model(**phase.get("model", {}))
    if "strict_loading" in phase:
        model.strict_loading = phase["strict_loading"]
    recorder = Recorder(out, name)
    callbacks: list[L.Callback] = [recorder]
    callbacks += [ModelCheckpoint(**kwargs) for kwargs in phase.get("checkpoints", [])]
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=bool(phase.get("checkpoints")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        default_root_dir=phase.get("root", "."),
    )
    strategy = phase.get("strategy")
    if strategy is not None:
        strategy = dict(strategy)
        strategy["timeout"] = timedelta(seconds=strategy.pop("timeout_s", 60))
        trainer_kwargs["strategy"] = PipelineStrategy(**strategy)
    trainer_kwargs.update(phase.get("trainer", {}))
    trainer = L.Trainer(**trainer_kwargs)
    error = None
    try:
        data = models.loader(**phase.get("data", {}))
        if phase.get("fn", "fit") == "validate":
            trainer.validate(model, data, ckpt_path=phase.get("ckpt_path"), verbose=False)
        else:
            trainer.fit(model, data, ckpt_path=phase.get("ckpt_path"))
        for path in phase.get("save", []):
            trainer.save_checkpoint(path)
    except Exception as exc:
        if not phase.get("expect_error"):
            raise
        error = "".join(traceback.format_exception_only(type(exc), exc))
    listings = {d: sorted(os.listdir(d)) for d in phase.get("list_dirs", []) if os.path.isdir(d)}
    result = {
        "steps": recorder.steps,
        "start_state": recorder.start_state,
        "start_step": getattr(recorder, "start_step", None),
        "state_dict": share_after_call(model, getattr(recorder, "held_keys", None)),
        "whole_after": {k: v.detach().cpu().clone() for k, v in state_after_call(model).items()},
        "global_step": trainer.global_step,
        "error": error,
        "listings": listings,
        "world_size": trainer.world_size,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / f"{name}.rank{trainer.global_rank}.pt")
    return result


def main(spec: dict[str, Any], out: Path) -> None:
    devices = spec.get("devices", 1)
    if "crash" in spec:
        _install_crash(spec["crash"]["rank"], spec["crash"]["save"], int(os.environ.get("LOCAL_RANK", 0)))
    for phase in spec["phases"]:
        run_phase(phase, devices, out)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
