"""Jobs that must fail: ``python tests/bad_job.py CASE``. Used by test_errors.py."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models

from lightning_pipe import PipelineStrategy


class RaisesInStep(models.TinyLM):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing_rank = rank

    def training_step(self, batch, batch_idx):
        failing = batch_idx == 2 and self.global_rank == self.failing_rank
        if failing and self.failing_rank == 0:  # before the backbone call: runs on the first stage
            raise RuntimeError(f"user error on rank {self.global_rank}")
        loss = super().training_step(batch, batch_idx)  # after the backbone call: runs on the last stage
        if failing:
            raise RuntimeError(f"user error on rank {self.global_rank}")
        return loss


class ScaledBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = models.Block()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * scale


class ParameterArguments(models.TinyLM):
    """Every block gets a scale that plain tensor code computes from the embedding's output and a parameter read
    directly: a later stage could receive the embedding's output, but not compute the scale from it without the
    parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(models.VOCAB, models.DIM)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([ScaledBlock() for _ in range(4)])
        self.head = torch.nn.Linear(models.DIM, models.VOCAB)
        self.gain = torch.nn.Parameter(torch.ones(()))
        del self.backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = (h.mean() * self.gain).sigmoid()
        for layer in self.decoder.layers:
            h = layer(h, scale)
        return self.head(h)


def main(case: str) -> None:
    torch.manual_seed(0)
    strategy: dict = {"num_microbatches": 2}
    model: L.LightningModule = models.TinyLM()
    if case == "raise-last":
        model = RaisesInStep(rank=1)
    elif case == "raise-first":
        model = RaisesInStep(rank=0)
    elif case == "parameter-arguments":
        model = ParameterArguments()
    elif case == "synced-metric":  # only the last stage calls the metric: a per-call sync would hang
        model = models.TinyLM(train_metric=True)
        model.train_acc.dist_sync_on_step = True
    elif case == "too-few-microbatches":
        strategy = {"schedule": "1F1B", "num_microbatches": 1}
    elif case == "too-many-stages":
        model = models.TinyLM(blocks=0)  # 3 modules
        strategy = {"schedule": "Interleaved1F1B"}  # 4 stages
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(**strategy), max_steps=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, models.loader())


if __name__ == "__main__":
    main(sys.argv[1])
