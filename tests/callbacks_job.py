"""Lightning's built-in callbacks, one phase each, run as their own script (Lightning's launcher starts the ranks).

Usage: ``python tests/callbacks_job.py SPEC.json OUT_DIR``. The spec holds ``devices`` and a list of ``phases`` run
one after the other in the same processes; with ``"strategy": null`` and one device a phase is the single-device
reference, and :func:`run_phase` runs one in the calling process.

A phase: ``name``; ``model`` (``{"kind": "tinylm" | "finetune", ...}`` and the model's arguments); ``callbacks``
(``[{"cls": "StochasticWeightAveraging", "kwargs": {...}}]``, classes of ``lightning.pytorch.callbacks``; paths in
``kwargs["dirpath"]`` are taken relative to ``root``); ``trainer``; ``data``; ``ckpt_path``; ``save`` (paths to
``trainer.save_checkpoint`` after the fit); ``logger`` (a CSV logger); ``fn`` (``"tuner_then_fit"``:
``Tuner.lr_find`` with the ``tuner`` arguments before the fit); ``expect_error``. After each phase every
rank writes ``OUT_DIR/<phase>.rank<r>.pt``: per step the loss, the learning rates and number of parameter groups;
the final (local) state dict; the averaged model of SWA/EMA callbacks; Adam's step counts; the learning rate the
model ends with; the logged metric names; the root directory's listing; the global step; the error if any.
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
from lightning.pytorch import callbacks as builtin
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models
from helpers import plain

from lightning_pipe import PipelineStrategy


class Recorder(L.Callback):
    def __init__(self, out: Optional[Path], name: str) -> None:
        self.out = out
        self.name = name
        self.steps: list[dict[str, Any]] = []
        self.summary_total: Optional[int] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        groups = trainer.optimizers[0].param_groups
        self.steps.append({
            "loss": float(outputs["loss"]),
            "lrs": [g["lr"] for g in groups],
            "groups": len(groups),
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
        })

    def on_train_end(self, trainer, pl_module):  # in the call: the keys of this rank's share
        self.held_keys = list(pl_module.state_dict())

    def on_exception(self, trainer, pl_module, exception):
        if self.out is not None:  # written at once: rank 0 ends the other ranks shortly after an exception
            self.out.mkdir(parents=True, exist_ok=True)
            text = "".join(traceback.format_exception_only(type(exception), exception))
            (self.out / f"{self.name}.rank{trainer.global_rank}.error.txt").write_text(text)


class GradualFinetuning(builtin.BaseFinetuning):
    """Unfreezes the neck (the last stage's blocks) at epoch 1 and the feature extractor's blocks (the first stage's)
    at epoch 2, each as a new parameter group: each time, the other rank has none of the group's parameters."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze([pl_module.backbone, pl_module.neck])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.neck, optimizer, lr=0.004)
        elif epoch == 2:
            self.unfreeze_and_add_param_group(pl_module.backbone.blocks, optimizer, lr=0.002)


def make_callback(spec: dict[str, Any], root: str) -> L.Callback:
    kwargs = dict(spec.get("kwargs", {}))
    if "dirpath" in kwargs:
        kwargs["dirpath"] = os.path.join(root, kwargs["dirpath"])
    if "scheduling" in kwargs:  # JSON keys are strings
        kwargs["scheduling"] = {int(k): v for k, v in kwargs["scheduling"].items()}
    if spec["cls"] == "ThroughputMonitor":
        kwargs["batch_size_fn"] = lambda batch: batch[0].size(0)
    if spec["cls"] == "GradualFinetuning":
        return GradualFinetuning(**kwargs)
    return getattr(builtin, spec["cls"])(**kwargs)


def make_model(spec: dict[str, Any]) -> L.LightningModule:
    spec = dict(spec)
    kind = spec.pop("kind", "tinylm")
    frozen = spec.pop("frozen", False)
    torch.manual_seed(spec.pop("seed", 1234))
    model = models.FinetuneLM(**spec) if kind == "finetune" else models.TinyLM(**spec)
    return model.requires_grad_(False) if frozen else model


def run_phase(phase: dict[str, Any], devices: int, out: Optional[Path]) -> dict[str, Any]:
    name = phase["name"]
    root = phase.get("root", ".")
    model = make_model(phase.get("model", {}))
    recorder = Recorder(out, name)
    # the recorder last: its on_train_end sees the module after the others' (SWA's transfer, pruning made permanent)
    callbacks = [make_callback(c, root) for c in phase.get("callbacks", [])] + [recorder]
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        logger=CSVLogger(root, name=name) if phase.get("logger") else False,
        enable_checkpointing=any(c["cls"] == "ModelCheckpoint" for c in phase.get("callbacks", [])),
        enable_progress_bar=any("ProgressBar" in c["cls"] for c in phase.get("callbacks", [])),
        enable_model_summary=any("ModelSummary" in c["cls"] for c in phase.get("callbacks", [])),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=root,
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
        if phase.get("fn") == "tuner_then_fit":  # Tuner.lr_find with the phase's "tuner" arguments, then fit
            Tuner(trainer).lr_find(model, data, **phase.get("tuner", {}))
        trainer.fit(model, data, ckpt_path=phase.get("ckpt_path"))
        for path in phase.get("save", []):
            trainer.save_checkpoint(os.path.join(root, path))
    except Exception as exc:
        if not phase.get("expect_error"):
            raise
        error = "".join(traceback.format_exception_only(type(exc), exc))
    averaged = {}
    for callback in trainer.callbacks:
        average = getattr(callback, "_average_model", None)
        if average is not None:
            average = getattr(average, "module", average)  # EMA's AveragedModel wraps the copy
            averaged[type(callback).__name__] = {k: v.detach().cpu().clone() for k, v in average.state_dict().items()}
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    adam_steps = sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s}) if optimizer else []
    whole = plain(model.state_dict()) if error is None else {}
    result = {
        "steps": recorder.steps,
        # this rank's share at the end of the call, valued after it (SWA moves the averaged weights in at its
        # on_train_end); the module is whole after the call, and split after a failed one
        "state_dict": {k: whole[k] for k in getattr(recorder, "held_keys", [])},
        "whole_after": whole,
        "averaged": averaged,
        "adam_steps": adam_steps,
        "lr": model.hparams.lr,
        "logged": _logged(trainer),
        "listing": sorted(os.listdir(root)) if os.path.isdir(root) else [],
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "error": error,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / f"{name}.rank{trainer.global_rank}.pt")
    return result


def _logged(trainer: L.Trainer) -> list[str]:
    """The metric names the logger wrote (callbacks like LearningRateMonitor log to it directly), on rank 0."""
    if trainer.logger is None or not trainer.is_global_zero:
        return sorted(trainer.logged_metrics)
    trainer.logger.save()
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    return sorted(path.read_text().splitlines()[0].split(",")) if path.exists() else []


def main(spec: dict[str, Any], out: Path) -> None:
    for phase in spec["phases"]:
        run_phase(phase, spec.get("devices", 1), out)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
