"""Train a tiny language model over batches padded to many distinct lengths (for ``tests/test_shapes.py``).

Usage: ``python tests/shapes_job.py OUT_DIR [DEVICES]``. With 2 devices it trains with ``PipelineStrategy`` and
every rank writes ``OUT_DIR/rank<r>.pt``: the losses, its part of the weights, and after every step the schedules
its pipeline keeps and its :class:`~lightning_pipe._step.shapes.ShapeStats`. It also holds weak references to each
schedule's stages and receive buffers, with the cyclic garbage collector off, and records which of them are still
alive once the schedule has left the cache: only reference counting can have freed them. With 1 device the same
model trains on the same batches without a strategy (the reference).
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_pipe import PipelineStrategy
from lightning_pipe._compat.pipelining import schedule_stages

#: The padded length of each batch, in order: 12 distinct lengths, some met again after their schedule was evicted,
#: some while it is still kept.
LENGTHS = [4, 7, 4, 10, 5, 8, 11, 6, 13, 9, 4, 12, 3, 14, 7, 4]
BATCH_SIZE = 8
NUM_MICROBATCHES = 4
VOCAB, DIM, BLOCKS = 32, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A causal running mean over positions: the block's output depends on the sequence length.
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return x + torch.tanh(self.mix(self.norm(x).cumsum(1) / steps))


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        blocks = [Block() for _ in range(BLOCKS)]
        self.backbone = nn.Sequential(nn.Embedding(VOCAB, DIM), *blocks, nn.Linear(DIM, VOCAB))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.backbone(x).flatten(0, 1), y.flatten())  # every position counts, pads included
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Sequences(Dataset):
    """Row ``i`` of batch ``b`` is ``LENGTHS[b] - i % 3`` tokens long: the longest row sets the batch's length."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [
            torch.randint(0, VOCAB, (length + 1 - i % 3,), generator=generator)
            for length in LENGTHS
            for i in range(BATCH_SIZE)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def pad_to_longest(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, padded with token 0 to the batch's longest row."""
    tokens = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    return tokens[:, :-1], tokens[:, 1:]


class ScheduleWatch(L.Callback):
    """After every step: the schedules the pipeline keeps, its shape counters, and whether the stages and receive
    buffers of the schedules evicted so far are all freed."""

    def __init__(self) -> None:
        # every schedule seen, as weak references (the schedule's first): tracked by identity, not by `id()`, which a
        # new schedule may reuse once an evicted one is freed
        self.tracked: list[list[weakref.ref]] = []
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        pipeline = trainer.strategy.runtime.pipeline
        kept = list(pipeline._schedules._kept.values())
        for schedule in kept:
            if not any(refs[0]() is schedule for refs in self.tracked):
                self.tracked.append(_weak_references(schedule))
        gone = [refs for refs in self.tracked if not any(refs[0]() is s for s in kept)]
        self.steps.append({
            "kept": len(kept),
            "stats": vars(pipeline.shape_stats),
            "evicted_tracked": len(gone),
            "alive_after_eviction": sum(ref() is not None for refs in gone for ref in refs),
            "references_per_schedule": [len(refs) for refs in self.tracked],
        })


def _weak_references(schedule: Any) -> list[weakref.ref]:
    """The schedule, its stages, and every receive buffer (activations and gradients) the stages hold."""
    refs = [weakref.ref(schedule)]
    for stage in schedule_stages(schedule) or []:
        refs.append(weakref.ref(stage))
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            refs.extend(weakref.ref(info.buffer) for info in infos if isinstance(info.buffer, torch.Tensor))
    return refs


class Steps(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(out_dir: Path, devices: int) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    steps, watch = Steps(), ScheduleWatch()
    pipelined = devices > 1
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=PipelineStrategy(num_microbatches=NUM_MICROBATCHES) if pipelined else "auto",
        max_epochs=1,
        callbacks=[steps, watch] if pipelined else [steps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    loader = DataLoader(Sequences(), batch_size=BATCH_SIZE, collate_fn=pad_to_longest)
    if pipelined:
        gc.disable()  # an evicted schedule must be freed by reference counting alone, not by a collection
    try:
        trainer.fit(model, loader)
    finally:
        gc.enable()
    result = {
        "losses": steps.losses,
        "initial": steps.initial,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "watch": watch.steps,
        "max_kept": trainer.strategy.runtime.pipeline.shape_stats.max_kept if pipelined else None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
