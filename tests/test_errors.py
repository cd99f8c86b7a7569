"""Bad input fails at setup with a message that names the fix; a crash in any stage ends the whole job."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import models
import pytest
import torch
import torch.nn.functional as F
import zoo_layouts
from helpers import run_script
from torch import nn

from lightning_pipe import BackboneCallError, PipelineStrategy

HERE = Path(__file__).resolve().parent


def fit(model: L.LightningModule, batch_size: int = 8, **strategy) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(**strategy), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, models.loader(n=16, batch_size=batch_size))


class NoBackbone(models.TinyLM):
    """Its modules are attributes, not a container of blocks (its one container holds the embedding only)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = len(self.backbone)
        for i, layer in enumerate(self.backbone):
            setattr(self, f"layer{i}", layer)
        del self.backbone
        self.layers = nn.Sequential(self.layer0)

    def forward(self, x):
        for i in range(self.count):
            x = getattr(self, f"layer{i}")(x)
        return x


class NotSequential(models.TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(list(self.backbone))


class Manual(models.TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class CallsTwice(models.TinyLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x) + self(x)).mean()


class NeverCalls(models.TinyLM):
    def training_step(self, batch, batch_idx):
        return torch.zeros((), requires_grad=True)


class ReturnsNone(models.TinyLM):
    """Raises in the last stage's forward, which torch wraps ("[Stage 0] failed to run forward"): the user gets the
    strategy's own error."""

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


class FrozenOutside(models.TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


@pytest.mark.parametrize(
    ("model", "strategy", "batch_size", "error", "match"),
    [
        (NoBackbone, {}, 8, ValueError, r"found no container of repeated blocks.*Containers found: .*'layers'"),
        (NoBackbone, {"backbone": "backbone"}, 8, AttributeError, r"no attribute `backbone`.*Containers found"),
        (models.TinyLM, {"backbone": "model.body"}, 8, AttributeError, "no attribute `model`"),
        (models.TinyLM, {"backbone": "backbone.0"}, 8, TypeError, "is a `Embedding`.*must be an `nn.Sequential`"),
        (NotSequential, {}, 8, NotImplementedError, "missing the required \"forward\" function"),
        (lambda: models.TinyLM(blocks=0), {"schedule": "ZBVZeroBubble", "balance": [1, 1]}, 8, ValueError,
         "add up to the 3 backbone modules"),
        (Manual, {}, 8, ValueError, "manual optimization.*not supported"),
        (models.TinyLM, {"num_microbatches": 16}, 8, ValueError,
         "batch size is 8.*lower `num_microbatches` to at most 8"),
        (models.TinyLM, {"pipeline_parallel_size": 2}, 8, ValueError,
         r"needs 2 \* 1 = 2 processes, but the Trainer runs 1"),
        (CallsTwice, {"num_microbatches": 2}, 8, BackboneCallError, "runs each backbone block exactly once per step"),
        (NeverCalls, {}, 8, BackboneCallError, "without calling the pipelined backbone"),
        (ReturnsNone, {"num_microbatches": 2}, 8, BackboneCallError, "must return the loss tensor.*returned NoneType"),
    ],
)
def test_bad_input_is_refused(model, strategy, batch_size, error, match):
    with pytest.raises(error, match=match):
        fit(model(), batch_size=batch_size, **strategy)


class DropsASample(models.TinyLM):
    """Its blocks get one row fewer than the batch has: no row of theirs is known to come from a row of the batch."""

    def forward(self, x):
        return super().forward(x[:-1])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y[:-1].flatten())


def _fit_layout(name: str, **strategy) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(num_microbatches=4, **strategy), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(zoo_layouts.make(name), zoo_layouts.loader(name, n=16))


def test_batches_that_cannot_be_cut_by_rows_are_refused():
    """Microbatches are cut from the batch's rows. Where the first block's rows do not come from the batch's rows,
    where a tensor packs the samples in another layout, or where a backbone's containers hold different rows, the
    first step (or setup) refuses, naming the tensors or containers and the fix."""
    whole = r"fails on a microbatch.*reach every microbatch whole \(here: `batch\['patches'\]`"
    with pytest.raises(BackboneCallError, match=whole + r".*pad it per sample\), or set `num_microbatches=1`"):
        _fit_layout("packed_patches")
    with pytest.raises(BackboneCallError, match=r"hold different numbers of rows \(`model.model.visual.blocks` \d+,"
                                                r" `model.model.language_model.layers` 8\).*language layers"):
        _fit_layout("qwen2_vl", backbone=["model.model.visual.blocks", "model.model.language_model.layers"])
    with pytest.raises(BackboneCallError, match="holds 7 rows.*no tensor of the batch has 7 rows"):
        fit(DropsASample(), num_microbatches=2)


def test_blocks_whose_hidden_states_the_step_reads_are_refused():
    """LLaVA reads its vision layers' hidden states, which Hugging Face records with hooks on those layers; a stage
    that skips them would record nothing (``backbone="auto"`` leaves them out: tests/test_models.py)."""
    recorded = r"records the outputs of the backbone blocks \['model.model.vision_tower.encoder.layers.1'"
    with pytest.raises(BackboneCallError, match=recorded + ".*Set `backbone=` to other blocks"):
        _fit_layout("llava", backbone="model.model.vision_tower.encoder.layers")


def test_parameters_outside_the_backbone_are_kept_trainable_or_frozen():
    """Modules outside the backbone train (on the first or last stage; see test_models.py), frozen ones stay frozen."""

    class Outside(models.TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    model = Outside()
    fit(model)
    assert model.extra.weight.requires_grad
    frozen = FrozenOutside()
    fit(frozen)
    assert not frozen.frozen.weight.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "2F2B"}, r"Unknown `schedule='2F2B'`. Choose one of \['1F1B', 'GPipe'"),
        ({"num_microbatches": 0}, "must be a positive integer or 'auto'"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, "runs one stage per process.*Interleaved1F1B"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "exactly 2 stages per process"),
        ({"balance": "flops"}, r"balance='flops'\)` is unknown"),
        ({"stall_timeout": 0}, r"stall_timeout=0\)` must be a positive number of seconds, a `timedelta`"),
        ({"check_data_every_n_batches": 0}, r"check_data_every_n_batches=0\)` must be a positive integer, or None"),
        ({"compile": "yes"}, r"compile='yes'\)` must be `True`, `False`, or a dict"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("parameter-arguments", r"from the parameter\(s\) gain outside any module on stage 0, is used on stage 1"),
        ("too-few-microbatches", r"num_microbatches=1\)` is not valid for 2 stages.*Raise `num_microbatches`"),
        ("too-many-stages", "cannot be split into 4 non-empty stages"),
        ("synced-metric", r"\['train_acc'\] have `dist_sync_on_step=True`.*`dist_sync_on_step=False`"),
    ],
)
def test_setup_errors_reach_every_rank_without_hanging(case, match, tmp_path):
    import re

    start = time.monotonic()
    proc = run_script([str(HERE / "bad_job.py"), case], cwd=tmp_path, timeout=90)
    assert proc.returncode != 0
    assert len(re.findall(match, proc.stdout)) >= 2, proc.stdout[-4000:]  # raised on both ranks
    assert time.monotonic() - start < 60


@pytest.mark.dist
@pytest.mark.parametrize("case", ["raise-last", "raise-first"])
def test_an_exception_in_one_stage_ends_the_job(case, tmp_path):
    start = time.monotonic()
    proc = run_script([str(HERE / "bad_job.py"), case], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "user error on rank" in proc.stdout, proc.stdout[-4000:]
    if case == "raise-last":  # rank 0 fails after it in a transfer: its error names rank 1 and what it raised
        assert "rank 1 failed first, and this rank failed after it: RuntimeError: user error on rank 1" in (
            proc.stdout), proc.stdout[-4000:]
    assert time.monotonic() - start < 60


def test_sync_batchnorm_is_refused():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipelineStrategy(), sync_batchnorm=True, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="sync_batchnorm=True"):
        trainer.fit(models.TinyLM(), models.loader(n=16))
