"""balance="time": every module is timed on rank 0, the split minimises the slowest stage, all ranks agree."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import models
import pytest
import torch
from helpers import assert_parity, reference, run_job
from torch import nn

from lightning_pipe._lightning.metrics import metrics_set_aside, module_metrics
from lightning_pipe._model.backbone import find_backbone
from lightning_pipe._model.profile import measure_backbone
from lightning_pipe._model.structure import analyze
from lightning_pipe._step.microbatches import MicrobatchPolicy
from lightning_pipe.schedules import schedule_spec


class Stack(nn.Module):
    """A trunk of ``blocks`` and a loss after it, as ``balance="time"`` profiles a step (one block per module)."""

    def __init__(self, *blocks: nn.Module, loss: Any = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.loss = loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        h = batch
        for block in self.blocks:
            h = block(h)
        return self.loss(h) if self.loss is not None else h.float().sum()


def measure(net: Stack, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """What ``PipelineStrategy(balance="time")`` measures at setup (``_setup._cut_into_stages`` calls it), on one
    process, one microbatch."""
    backbone = find_backbone(net, "blocks")
    structure = analyze(net, backbone, net.training_step, (x, 0), torch.device("cpu"), training=True)
    return measure_backbone(
        net, backbone, structure, net.training_step, x, device=torch.device("cpu"),
        microbatches_for=MicrobatchPolicy(1, schedule_spec("GPipe"), 1, 1).for_batch, step_context=nullcontext,
        repeats=repeats,
    )


def test_timing_leaves_no_trace():
    torch.manual_seed(0)
    net = Stack(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(32, 8)
    rng = torch.get_rng_state()
    costs = measure(net, x)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # BatchNorm statistics included
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_the_loss_is_timed_with_the_last_module():
    """The last stage computes the loss too: a loss that takes 30 ms lands in the last module's cost, nowhere else."""
    import time

    def slow_loss(out: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return out.square().mean()

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    plain = measure(Stack(nn.Linear(8, 8), nn.Linear(8, 4), loss=lambda out: out.square().mean()), x)
    with_loss = measure(Stack(nn.Linear(8, 8), nn.Linear(8, 4), loss=slow_loss), x)
    assert with_loss[1] >= 0.03 > plain[1]
    assert with_loss[0] < 0.03


def test_metric_states_are_restored():
    from torchmetrics.classification import MulticlassAccuracy

    holder = nn.Module()
    holder.acc = MulticlassAccuracy(num_classes=3, average="micro")
    holder.acc.update(torch.tensor([0, 1]), torch.tensor([0, 0]))
    before = float(holder.acc.compute())
    with metrics_set_aside(module_metrics(holder)):
        holder.acc(torch.tensor([2, 2, 2]), torch.tensor([2, 2, 2]))
        assert float(holder.acc.compute()) != before
    assert holder.acc._update_count == 1
    assert float(holder.acc.compute()) == before == 0.5


def test_meta_model_is_refused_with_the_fix():
    import pytest

    with torch.device("meta"):
        net = Stack(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="balance='parameters'"):
        measure(net, torch.randn(2, 4))


@pytest.mark.dist
def test_time_balance_agrees_across_ranks_and_stays_exact(tmp_path):
    """The profiled split is the same on every rank, exact, stored in the checkpoint, and reused on resume with
    ``balance=stored_balance(dir)``."""
    from lightning_pipe import stored_balance

    saved = tmp_path / "time.ckpt"
    spec = {"devices": 2, "strategy": {"num_microbatches": 4, "balance": "time"}, "data": {"n": 32, "batch_size": 8},
            "trainer": {"max_epochs": 1}}
    results = run_job({**spec, "save_checkpoint": str(saved)}, tmp_path / "time")
    assert results[0]["layout"] == results[1]["layout"]
    held = sorted(int(k.split(".")[1]) for r in results for k in r["state_dict"] if k.endswith("weight"))
    assert set(held) == set(range(len(models.make_model().backbone)))
    assert_parity(results, reference(spec, tmp_path))
    sizes = stored_balance(saved)
    assert sizes == [stop - start for start, stop in results[0]["layout"]]
    resume = {**spec, "strategy": {"num_microbatches": 4, "balance": sizes}, "ckpt_path": str(saved),
              "trainer": {"max_epochs": 2}}
    resumed = run_job(resume, tmp_path / "resumed")
    assert [r["layout"] for r in resumed] == [results[0]["layout"]] * 2
    assert all(r["global_step"] == 8 and len(r["steps"]) == 4 for r in resumed)


def test_profiling_sees_the_batch_after_the_transfer_hooks(tmp_path):
    """The profiled step gets the batch as training does, through ``on_after_batch_transfer``: here the raw
    tokens are out of the vocabulary until the hook shifts them, so profiling the raw batch would fail."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineStrategy

    class Shifted(models.TinyLM):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            return x - models.VOCAB, y

    x, y = models.token_data(16).tensors
    raw = DataLoader(TensorDataset(x + models.VOCAB, y), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(balance="time", num_microbatches=2), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Shifted(), raw)
    assert trainer.global_step == 2
