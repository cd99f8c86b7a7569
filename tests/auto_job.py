"""``schedule="auto"`` on the costed model of ``benchmarks/costed.py`` (blocks that sleep fixed forward, input-gradient
and weight-gradient times), 4 processes, in one launch:

1. ``auto``: fit with ``schedule="auto"`` and ``num_microbatches=4``, validating every 4 steps (during the trial
   and after), saving a checkpoint at the end;
2. ``pinned``: the same fit with the chosen arguments set explicitly;
3. ``resumed``: ``schedule="auto"`` resumed from (1)'s checkpoint for more steps;
4. ``sharded`` and ``sharded_pinned``: (1) and (2) on 2 pipelines of 2 stages sharded with FSDP2, accumulating
   gradients over 2 batches (the trial switches schedules between them).

Usage: ``python tests/auto_job.py OUT_DIR WEIGHT_GRAD_MS``. Every rank writes ``OUT_DIR/<phase>_rank<r>.pt``: losses per
step, its state dict, the chosen arguments and what was left to time at the start.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
sys.path.insert(0, str(HERE.parent))

from costed import Costed  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402

STEPS, MORE = 12, 3
SHARDED_STEPS = 7  # optimizer steps of 2 batches each: the trial's 10 batches, then 4 with the choice
BATCH, DIM = 8, 16
FORWARD_MS = INPUT_GRAD_MS = 8.0


class Validated(Costed):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.backbone(x), y), sync_dist=True)


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []
        self.trial_at_start: Any = "unset"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trial = trainer.strategy._runtime.trial
        self.trial_at_start = None if trial is None else [c.config.arguments() for c in trial.timed]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val.append(float(trainer.callback_metrics["val_loss"]))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)) for _ in range(n)]


def fit(phase: str, out: Path, weight_grad_ms: float, steps: int, ckpt: Any = None, accumulate: int = 1,
        **strategy: Any) -> None:
    torch.manual_seed(0)
    model = Validated(8, DIM, FORWARD_MS, INPUT_GRAD_MS, weight_grad_ms, lr=0.05)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[record], use_distributed_sampler=False,
        val_check_interval=4, num_sanity_val_steps=0, limit_val_batches=2, accumulate_grad_batches=accumulate,
        strategy=PipelineStrategy(check_data_every_n_batches=None,
                                  **{"pipeline_parallel_size": 4, "num_microbatches": 4, **strategy}),
    )
    loader = torch.utils.data.DataLoader(batches(2 * (STEPS + MORE)), batch_size=None)
    trainer.fit(model, loader, loader, ckpt_path=ckpt)
    runtime = trainer.strategy._runtime
    chosen = runtime.choice.config if runtime.choice is not None else None
    if phase == "auto":
        trainer.save_checkpoint(out / "auto.ckpt")
    result = {
        "losses": record.losses,
        "val": record.val,
        "state_dict": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                       for k, v in model.state_dict().items()},
        "chosen": chosen.record() if chosen is not None else None,
        "schedule": trainer.strategy.schedule,
        "microbatches": runtime.microbatches.requested,
        "trial_at_start": record.trial_at_start,
    }
    torch.save(result, out / f"{phase}_rank{trainer.global_rank}.pt")
    trainer.strategy.barrier()


def main() -> None:
    out, weight_grad_ms = Path(sys.argv[1]), float(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    fit("auto", out, weight_grad_ms, STEPS, schedule="auto")
    chosen = torch.load(out / "auto_rank0.pt", weights_only=False)["chosen"]
    fit("pinned", out, weight_grad_ms, STEPS, **chosen)
    fit("resumed", out, weight_grad_ms, STEPS + MORE, ckpt=str(out / "auto.ckpt"), schedule="auto")
    sharded = {"pipeline_parallel_size": 2, "data_parallel": "fsdp"}
    fit("sharded", out, weight_grad_ms, SHARDED_STEPS, accumulate=2, schedule="auto", **sharded)
    chosen = torch.load(out / "sharded_rank0.pt", weights_only=False)["chosen"]
    fit("sharded_pinned", out, weight_grad_ms, SHARDED_STEPS, accumulate=2, **{**chosen, **sharded})


if __name__ == "__main__":
    main()
