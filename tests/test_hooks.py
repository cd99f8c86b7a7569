"""Step hooks in every form Lightning accepts: with or without ``batch_idx`` (and ``dataloader_idx`` with several
evaluation loaders). The strategy calls the step itself at setup (analysis, ``balance="time"`` profiling) with the
arguments Lightning's loop would pass (``_lightning/hooks.py``); a plain one-device run is the reference for what the
steps receive, what they log and return, and how training moves the parameters."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from models import TinyLM, loader

from lightning_pipe import PipelineStrategy


class Recording(TinyLM):
    """Records the arguments after the batch each step receives (every stage runs the step, and the setup runs it
    once: the set of distinct calls is compared)."""

    def __init__(self) -> None:
        super().__init__(blocks=2)
        self.received: set[tuple] = set()

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def _eval(self, hook: str, batch: Any, *rest: Any) -> None:
        self.received.add((hook, *rest))
        self.log(f"{hook}_loss", self._loss(batch))


class TrainBatchOnly(Recording):
    def training_step(self, batch):
        return self._loss(batch)


class TrainBatchIdx(Recording):
    def training_step(self, batch, batch_idx):
        return self._loss(batch)


class EvalBatchOnly(Recording):
    def validation_step(self, batch):
        self._eval("validation", batch)

    def test_step(self, batch):
        self._eval("test", batch)

    def predict_step(self, batch):
        self.received.add(("predict",))
        return self(batch[0]).argmax(-1)


class EvalBatchIdx(Recording):
    def validation_step(self, batch, batch_idx):
        self._eval("validation", batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self._eval("test", batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self.received.add(("predict", batch_idx))
        return self(batch[0]).argmax(-1)


class EvalDataloaderIdx(Recording):
    def validation_step(self, batch, batch_idx, dataloader_idx):
        self._eval("validation", batch, batch_idx, dataloader_idx)

    def test_step(self, batch, batch_idx, dataloader_idx):
        self._eval("test", batch, batch_idx, dataloader_idx)

    def predict_step(self, batch, batch_idx, dataloader_idx):
        self.received.add(("predict", batch_idx, dataloader_idx))
        return self(batch[0]).argmax(-1)


def make(cls: type) -> Recording:
    torch.manual_seed(1234)
    return cls()


def run(cls: type, fn: str, pipelined: bool, loaders: Any, **strategy: Any) -> tuple[Recording, Any, L.Trainer]:
    """``fn`` on a plain one-device Trainer or on the pipeline (two stages on this process)."""
    model = make(cls)
    pipeline = PipelineStrategy(num_microbatches=2, schedule="Interleaved1F1B", stages_per_rank=2, **strategy)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=pipeline if pipelined else "auto",
    )
    out = getattr(trainer, fn)(model, loaders)
    return model, out, trainer


def weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("cls", "strategy"),
    [(TrainBatchOnly, {}), (TrainBatchIdx, {}), (TrainBatchOnly, {"balance": "time"})],
    ids=["batch", "batch_idx", "batch-balance_time"],
)
def test_training_step_with_or_without_batch_idx_trains_as_on_one_device(cls, strategy):
    """``balance="time"`` profiles the step (``_model/profile.py``) too; with ``batch_idx`` that is covered by
    tests/test_balance_time.py."""
    data = loader(16, 8)
    initial = weights(make(cls))
    ref, _, _ = run(cls, "fit", False, data)
    got, _, trainer = run(cls, "fit", True, data, **strategy)
    assert trainer.global_step == 2
    want, have = weights(ref), weights(got)
    assert want.keys() == have.keys() == initial.keys()
    assert all(not torch.equal(want[k], initial[k]) for k in want if k.endswith("weight"))  # training moved them
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
@pytest.mark.parametrize("cls", [EvalBatchOnly, EvalBatchIdx, EvalDataloaderIdx])
def test_evaluation_steps_receive_what_lightning_passes(cls, fn):
    several = cls is EvalDataloaderIdx
    loaders = [loader(16, 8, seed=1), loader(8, 8, seed=2)] if several else loader(16, 8, seed=1)
    ref, want, _ = run(cls, fn, False, loaders)
    got, have, _ = run(cls, fn, True, loaders)
    assert got.received == ref.received and ref.received, (got.received, ref.received)
    if fn == "predict":
        flat = (lambda out: [t for loader_out in out for t in loader_out]) if several else list
        assert len(flat(have)) == len(flat(want)) == (3 if several else 2)
        assert all(torch.equal(a, b) for a, b in zip(flat(have), flat(want)))
    else:
        assert len(have) == len(want) == (2 if several else 1)
        for h, w in zip(have, want):
            assert h.keys() == w.keys()
            assert all(abs(h[k] - w[k]) < 1e-5 for k in w), (h, w)
