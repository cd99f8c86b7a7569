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

import models

from lightning_pipe import PipelineStrategy


class Recorder(L.Callback):
    """Keeps what every rank sees: per-step logged values, hook calls, learning rates and batches."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.hooks: dict[str, int] = {}
        self.val: list[dict[str, float]] = []
        self.first_rows: list[list[int]] = []
        self.initial: dict[str, torch.Tensor] | None = None
        self.count_saved = False
        self.saved_bytes: list[int] = []
        self.inf_at_step: int | None = None  # put an inf into one gradient of the last rank at this step
        self.params_before_inf_step: dict[str, torch.Tensor] = {}
        self.params_after_inf_step: dict[str, torch.Tensor] = {}
        self.scales: list[float] = []

    def _count(self, name: str) -> None:
        self.hooks[name] = self.hooks.get(name, 0) + 1

    def on_train_start(self, trainer, pl_module):
        if self.initial is None:  # after setup: a meta-built model is materialised by now
            self.initial = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_rows.append(batch[0][:, 0].tolist())
        if self.count_saved:
            self.saved_bytes.append(0)

            def pack(t: torch.Tensor) -> torch.Tensor:
                self.saved_bytes[-1] += t.numel() * t.element_size()
                return t

            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self._hooks.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.count_saved:
            self._hooks.__exit__(None, None, None)
        if self.inf_at_step is not None and trainer.global_step == self.inf_at_step + 1:
            self.params_after_inf_step = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        logged = trainer.callback_metrics.items()
        metrics = {k: float(v) for k, v in logged if k.startswith(("train_loss", "train_acc"))}
        metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        metrics["returned_loss"] = float(outputs["loss"])
        self.steps.append(metrics)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})

    def on_before_backward(self, trainer, pl_module, loss):
        self._count("on_before_backward")

    def on_after_backward(self, trainer, pl_module):
        self._count("on_after_backward")
        if self.inf_at_step is not None and trainer.global_step == self.inf_at_step:
            self.params_before_inf_step = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            if trainer.global_rank == trainer.world_size - 1:
                next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._count("on_before_optimizer_step")


def run(spec: dict[str, Any], out_dir: Path) -> None:
    if spec.get("meta_init"):
        with torch.device("meta"):
            model = models.make_model(**spec.get("model", {}))
    else:
        model = models.make_model(**spec.get("model", {}))
    strategy_kwargs = spec.get("strategy")
    recorder = Recorder()
    recorder.count_saved = spec.get("count_saved", False)
    recorder.inf_at_step = spec.get("inf_at_step")
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
    if spec.get("fp16_scaler"):  # Lightning maps "16-mixed" on CPU to bf16; build the fp16 plugin by hand
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
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
            trainer.fit(model, train, val, ckpt_path=spec.get("ckpt_path"))
        elif fn == "validate":
            trainer.validate(model, val if val is not None else train, verbose=False)
    if "save_checkpoint" in spec:
        trainer.save_checkpoint(spec["save_checkpoint"])
    pipelined = isinstance(trainer.strategy, PipelineStrategy)
    result = {
        "steps": recorder.steps,
        "val": recorder.val,
        "hooks": recorder.hooks,
        "first_rows": recorder.first_rows,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "initial": recorder.initial,
        "saved_bytes": recorder.saved_bytes,
        "scales": recorder.scales,
        "params_before_inf_step": recorder.params_before_inf_step,
        "params_after_inf_step": recorder.params_after_inf_step,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "layout": [list(b) for b in trainer.strategy.layout.bounds] if pipelined else None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
