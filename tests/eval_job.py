"""An evaluation job run as its own script, so Lightning's launcher can start the other ranks from it.

Usage: ``python tests/eval_job.py SPEC.json OUT_DIR``. The spec lists operations (``fit``, ``validate``,
``test``, ``predict``) run one after the other on the same Trainer and module; every rank writes
``OUT_DIR/rank<r>.pt`` with everything it saw: logged values after each validation, test metrics, predictions,
checkpoint and early-stopping choices, BatchNorm statistics, train/eval modes and its local state dict. With
``"devices": 1`` and ``"strategy": null`` the same spec gives the single-device reference.

Spec keys (all optional but ``ops``):

- ``devices``, ``strategy`` (``PipelineStrategy`` kwargs or null), ``use_distributed_sampler`` (default False)
- ``model``: kwargs of :class:`EvalLM`; ``trainer``: extra Trainer kwargs
- ``train``/``val``/``test``/``predict``: loader kwargs of ``models.loader`` (``val`` may be a list of them)
- ``checkpoint``: ModelCheckpoint kwargs; ``early_stopping``: EarlyStopping kwargs; ``lr_monitor``: bool
- ``writer``: bool, add a :class:`ReplicaWriter`
- ``ops``: list of ``{"op": "fit" | "validate" | "test" | "predict", "max_epochs": int}``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models

from lightning_pipe import PipelineStrategy
from lightning_pipe._ghost import Ghost


class ModeProbe(nn.Module):
    """Passes its input through and records, for every real call (not on fake tensors or the pipeline's ghosts,
    which compute nothing), the train/eval mode it ran in and whether autograd was recording."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []
        self.fake_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fake(x) or isinstance(x, Ghost):
            self.fake_calls += 1
        else:
            self.calls.append((self.training, torch.is_grad_enabled()))
        return x


class EvalLM(models.TinyLM):
    """TinyLM with torchmetrics: an accuracy logged as a Metric object per val dataloader, one computed by hand
    in ``on_validation_epoch_end``, a test accuracy, and probes at both ends of the backbone. ``step_metric``
    adds an accuracy called with ``forward`` and logged per step; ``auroc`` an exact AUROC (list states)."""

    def __init__(self, num_val_loaders: int = 1, step_metric: bool = False, auroc: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_metric = step_metric
        self.backbone = nn.Sequential(ModeProbe(), *self.backbone, ModeProbe())
        acc = lambda: MulticlassAccuracy(num_classes=models.VOCAB, average="micro")  # noqa: E731
        self.val_acc = nn.ModuleList([acc() for _ in range(num_val_loaders)])
        self.val_acc_manual = acc()
        self.test_acc = acc()
        self.val_acc_forward = acc()
        # exact AUROC keeps every prediction: list ("cat") states, empty on the stages that never run the step
        self.val_auroc = MulticlassAUROC(num_classes=models.VOCAB, thresholds=None) if auroc else None

    def _logits_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten()), y

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        logits, loss, y = self._logits_loss(batch)
        name = "val_loss" if dataloader_idx == 0 else f"val_loss_{dataloader_idx}"
        self.log(name, loss, sync_dist=True, add_dataloader_idx=False)
        self.val_acc[dataloader_idx].update(logits.argmax(-1), y)
        self.log("val_acc", self.val_acc[dataloader_idx])  # Lightning appends /dataloader_idx_N for several
        if dataloader_idx == 0:
            self.log("val_count", float(y.shape[0]), reduce_fx="sum", sync_dist=True, add_dataloader_idx=False)
            self.val_acc_manual.update(logits.argmax(-1), y)
            if self.val_auroc is not None:
                self.val_auroc.update(logits.flatten(0, 1).softmax(-1), y.flatten())
                self.log("val_auroc", self.val_auroc)
            if self.step_metric:  # forward: the batch value, logged per step and accumulated for the epoch
                self.val_acc_forward(logits.argmax(-1), y)
                self.log("val_acc_fwd", self.val_acc_forward, on_step=True, on_epoch=True, add_dataloader_idx=False)

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc_manual", self.val_acc_manual.compute())
        self.val_acc_manual.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        logits, loss, y = self._logits_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.test_acc(logits.argmax(-1), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self(batch[0])
        return {"logits": logits, "tokens": logits.argmax(-1)}


def replica_of(trainer: L.Trainer) -> tuple[int, bool]:
    """``(replica index, whether this rank writes for it)``: under ``PipelineStrategy`` every stage of a
    replica holds the same predictions, so pipeline rank 0 writes them; without it every rank writes."""
    strategy = trainer.strategy
    if isinstance(strategy, PipelineStrategy):
        return strategy.data_parallel_rank, strategy.pipeline_rank == 0
    return trainer.global_rank, True


class ReplicaWriter(BasePredictionWriter):
    """Writes each batch's predicted tokens and, at the end, all of them with their dataset indices, once per
    replica. File names carry the replica and the writing rank, so a test can tell who wrote what."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.out_dir = out_dir

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        replica, writes = replica_of(trainer)
        if writes:
            name = f"replica{replica}-rank{trainer.global_rank}-batch{batch_idx}.pt"
            torch.save(prediction["tokens"], self.out_dir / name)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        replica, writes = replica_of(trainer)
        if writes:  # one predict dataloader: lists of batches
            tokens = [p["tokens"] for p in predictions]
            name = f"replica{replica}-rank{trainer.global_rank}-epoch.pt"
            torch.save({"tokens": tokens, "indices": batch_indices}, self.out_dir / name)


class Recorder(L.Callback):
    """What this rank sees: logged values after every validation and training step, and module modes."""

    def __init__(self) -> None:
        self.validations: list[dict[str, Any]] = []
        self.train_losses: list[float] = []
        self.modes: dict[str, set] = {}
        self.fn = ""
        self.held_keys: set[str] = set()

    def _probes(self, pl_module: L.LightningModule) -> list[ModeProbe]:
        return [m for m in pl_module.modules() if isinstance(m, ModeProbe)]

    def _collect(self, pl_module: L.LightningModule, phase: str) -> None:
        self.held_keys.update(pl_module.state_dict())  # within the call: this rank's stage (whole after the call)
        for probe in self._probes(pl_module):
            if probe.calls:  # the ranks that run the probe's stage (every rank has the module object)
                self.modes.setdefault(phase, set()).update(probe.calls)
            probe.calls.clear()
        # the module itself, and every submodule this rank holds, must be in the phase's mode
        self.modes.setdefault(phase + "_modules", set()).update({m.training for m in pl_module.modules()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._collect(pl_module, "train")
        self.train_losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._collect(pl_module, "validate")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._collect(pl_module, "test")

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._collect(pl_module, "predict")

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        self.validations.append(
            {"fn": self.fn, "epoch": trainer.current_epoch, "step": trainer.global_step, "metrics": metrics}
        )


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}


def _loaders(spec: Any) -> Any:
    if spec is None:
        return None
    if isinstance(spec, list):
        return [models.loader(**s) for s in spec]
    return models.loader(**spec)


def run(spec: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.get("seed", 1234))
    model = EvalLM(**spec.get("model", {}))
    initial_bn = _bn_state(model)
    recorder = Recorder()
    callbacks: list[L.Callback] = [recorder]
    checkpoint: Optional[ModelCheckpoint] = None
    early: Optional[EarlyStopping] = None
    if "checkpoint" in spec:
        checkpoint = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), **spec["checkpoint"])
        callbacks.append(checkpoint)
    if "early_stopping" in spec:
        early = EarlyStopping(**spec["early_stopping"])
        callbacks.append(early)
    if spec.get("lr_monitor"):
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if spec.get("writer"):
        (out_dir / "predictions").mkdir(exist_ok=True)
        callbacks.append(ReplicaWriter(out_dir / "predictions"))
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=spec.get("devices", 1),
        logger=CSVLogger(str(out_dir), name="logs", version=0) if spec.get("lr_monitor") else False,
        log_every_n_steps=1,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=spec.get("use_distributed_sampler", False),
        callbacks=callbacks,
    )
    if spec.get("strategy") is not None:
        trainer_kwargs["strategy"] = PipelineStrategy(**spec["strategy"])
    trainer_kwargs.update(spec.get("trainer", {}))
    trainer = L.Trainer(**trainer_kwargs)
    train, val, test, predict = (_loaders(spec.get(k)) for k in ("train", "val", "test", "predict"))

    results: list[dict[str, Any]] = []
    bn_after: list[dict[str, torch.Tensor]] = []
    for op in spec["ops"]:
        kind = op["op"]
        recorder.fn = kind
        entry: dict[str, Any] = {"op": kind}
        if kind == "fit":
            if "max_epochs" in op:
                trainer.fit_loop.max_epochs = op["max_epochs"]
            trainer.fit(model, train, val)
            entry["epoch"] = trainer.current_epoch
            entry["step"] = trainer.global_step
        elif kind == "validate":
            out = trainer.validate(model, val, verbose=False)
            entry["returned"] = [{k: float(v) for k, v in d.items()} for d in out]
        elif kind == "test":
            out = trainer.test(model, test, verbose=False)
            entry["returned"] = [{k: float(v) for k, v in d.items()} for d in out]
        elif kind == "predict":
            out = trainer.predict(model, predict, return_predictions=True)
            entry["returned"] = [{k: v.detach().cpu() for k, v in p.items()} for p in out]
        else:
            raise ValueError(f"unknown op {kind!r}")
        entry["callback_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        entry["training"] = model.training
        bn_after.append(_bn_state(model))
        results.append(entry)

    result: dict[str, Any] = {
        "ops": results,
        "validations": recorder.validations,
        "train_losses": recorder.train_losses,
        "modes": recorder.modes,
        "fake_calls": sum(m.fake_calls for m in model.modules() if isinstance(m, ModeProbe)),
        "initial_bn": {k: v for k, v in initial_bn.items() if k in recorder.held_keys},
        "bn_after": bn_after,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }
    if checkpoint is not None:
        result["checkpoint"] = {
            "best_model_score": None if checkpoint.best_model_score is None else float(checkpoint.best_model_score),
            "best_model_path": Path(checkpoint.best_model_path).name,
            "best_k_models": {Path(k).name: float(v) for k, v in checkpoint.best_k_models.items()},
            "saved": sorted(p.name for p in (out_dir / "checkpoints").iterdir()),
        }
    if early is not None:
        result["early_stopping"] = {"stopped_epoch": early.stopped_epoch, "wait_count": early.wait_count}
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
