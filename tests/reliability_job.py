"""Jobs for test_reliability.py: ``python tests/reliability_job.py CASE OUT_DIR``, 2 processes, 2 stages.

- ``order``: one epoch with a ``shuffle=False`` loader, then two with a ``shuffle=True`` one (no generator); every
  rank writes the first token of every row of every batch its ``training_step`` saw, per epoch;
- ``different-data``: a loader shuffled by a generator seeded with the global rank;
- ``different-iterable``: an ``IterableDataset`` that shards by global rank;
- ``stall-shapes``: rank 0 sleeps 4 s computing its output shape (the stage-shape exchange), ``stall_timeout=1``;
- ``stall-step``: rank 0 sleeps 4 s before the backbone call of batch 2, ``stall_timeout=1``;
- ``hang``: rank 0 writes ``OUT_DIR/hanging`` and sleeps 10 minutes before the backbone call of batch 2.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models

from lightning_pipe import PipelineStrategy


class SeenRows(models.TinyLM):
    """Records the first token of every row of every training batch; its loader shuffles from the second epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[list[int]]] = []

    def train_dataloader(self):
        return models.loader(shuffle=self.current_epoch > 0)

    def on_train_epoch_start(self):
        self.seen.append([])

    def on_train_batch_start(self, batch, batch_idx):
        self.seen[-1].append(batch[0][:, 0].tolist())


class SleepsOnRankZero(models.TinyLM):
    """Rank 0 sleeps ``seconds`` in its first block call of the stage-shape exchange (``at_batch=None``) or before
    the backbone call of training batch ``at_batch``."""

    def __init__(self, seconds: float, at_batch: int | None, marker: Path | None = None) -> None:
        super().__init__()
        self.seconds, self.at_batch, self.marker = seconds, at_batch, marker
        self.slept = False
        if at_batch is None:
            self.backbone[1].register_forward_pre_hook(self._sleep_once)

    def _sleep_once(self, module, args):
        in_shape_exchange = any(frame.function == "_stage_metas" for frame in inspect.stack(0))
        if self.global_rank == 0 and not self.slept and in_shape_exchange:
            self.slept = True
            time.sleep(self.seconds)

    def training_step(self, batch, batch_idx):
        if self.at_batch is not None and batch_idx == self.at_batch and self.global_rank == 0 and not self.slept:
            self.slept = True  # the step runs more than once per batch (per microbatch)
            if self.marker is not None:
                self.marker.write_text(str(os.getpid()))
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


class ByGlobalRank(IterableDataset):
    """The classic sharding mistake under a pipeline: every process takes its own share of the samples."""

    def __init__(self, rank: int) -> None:
        self.data = models.token_data(48)
        self.rank = rank

    def __iter__(self):
        for i in range(self.rank, len(self.data), 2):
            yield self.data[i]


def trainer(out: Path, epochs: int = 1, **strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(num_microbatches=2, **strategy),
        max_epochs=epochs, reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
    )


def main(case: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    if case == "order":
        model = SeenRows()
        trainer(out, epochs=3).fit(model)
        torch.save(model.seen, out / f"rank{model.global_rank}.pt")
    elif case == "different-data":
        rank = int(os.environ.get("LOCAL_RANK", 0))
        loader = DataLoader(
            models.token_data(48), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(rank)
        )
        trainer(out).fit(models.TinyLM(), loader)
    elif case == "different-iterable":
        trainer(out).fit(models.TinyLM(), DataLoader(ByGlobalRank(int(os.environ.get("LOCAL_RANK", 0))), batch_size=8))
    elif case == "stall-shapes":
        trainer(out, stall_timeout=1).fit(SleepsOnRankZero(4, None), models.loader())
    elif case == "stall-step":
        trainer(out, stall_timeout=1).fit(SleepsOnRankZero(4, 2), models.loader())
    elif case == "hang":
        trainer(out).fit(SleepsOnRankZero(600, 2, out / "hanging"), models.loader())
    else:
        raise ValueError(case)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
