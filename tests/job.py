"""A training job run as its own script, so Lightning's launcher can start the other ranks from it.

Usage: ``python tests/job.py SPEC.json OUT_DIR``. Every rank writes ``OUT_DIR/rank<r>.pt`` with the losses
logged per step, its (local) state dict and the final ``callback_metrics``. With ``"devices": 1`` and
``"strategy": null`` the same spec gives the single-device reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402


class Recorder(L.Callback):
    """Keeps what every rank sees: per-step logged values, hook calls, learning rates and batches."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.hooks: dict[str, int] = {}
        self.val: list[dict[str, float]] = []
        self.first_rows: list[list[int]] = []

    def _count(self, name: str) -> None:
        self.hooks[name] = self.hooks.get(name, 0) + 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self.first_rows.append(batch[0][:, 0].tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train_loss")}
        metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        metrics["returned_loss"] = float(outputs["loss"])
        self.steps.append(metrics)

    def on_validation_end(self, trainer, pl_module):  # noqa: ANN001
        if not trainer.sanity_checking:
            self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})

    def on_before_backward(self, trainer, pl_module, loss):  # noqa: ANN001
        self._count("on_before_backward")

    def on_after_backward(self, trainer, pl_module):  # noqa: ANN001
        self._count("on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self._count("on_before_optimizer_step")


def run(spec: dict[str, Any], out_dir: Path) -> None:
    model = models.make_model(**spec.get("model", {}))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    strategy_kwargs = spec.get("strategy")
    recorder = Recorder()
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=spec.get("devices", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=spec.get("use_distributed_sampler", False),
        callbacks=[recorder],
    )
    if strategy_kwargs is not None:
        trainer_kwargs["strategy"] = PipelineStrategy(**strategy_kwargs)
    elif "strategy_name" in spec:
        trainer_kwargs["strategy"] = spec["strategy_name"]
    trainer_kwargs.update(spec.get("trainer", {}))
    trainer = L.Trainer(**trainer_kwargs)
    data = spec.get("data", {})
    train = models.loader(**data)
    if spec.get("logger") == "csv+tensorboard":
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        trainer.loggers = [CSVLogger(out_dir, name="csv"), TensorBoardLogger(out_dir, name="tb")]
    val = models.loader(**spec["val_data"]) if "val_data" in spec else None
    for fn in spec.get("fns", ["fit"]):
        if fn == "fit":
            trainer.fit(model, train, val)
        elif fn == "validate":
            trainer.validate(model, val if val is not None else train, verbose=False)
    result = {
        "steps": recorder.steps,
        "val": recorder.val,
        "hooks": recorder.hooks,
        "first_rows": recorder.first_rows,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "initial": {k: v for k, v in initial.items() if k in model.state_dict()},
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
