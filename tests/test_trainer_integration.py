"""Logging, data order and LightningCLI: the strategy behaves as DDP does."""

from __future__ import annotations

import csv

import lightning as L
import pytest
from helpers import HERE, assert_parity, reference, run_job, run_script

from lightning_pipe import PipelineStrategy


@pytest.mark.dist
def test_loggers_on_rank_zero_record_full_batch_values(tmp_path):
    """Every rank sees each step's logged values as on one device, also when a key is logged on some steps only:
    under DualPipeV those steps' values travel as an object after the schedule, the others' as a tensor sent from
    inside it ([Note: the step's result, sent before the schedule ends])."""
    spec = {
        "devices": 2,
        "model": {"log_sometimes": True},
        "strategy": {"num_microbatches": 4, "schedule": "DualPipeV"},
        "data": {"n": 32, "batch_size": 8},
        "trainer": {"max_epochs": 2, "log_every_n_steps": 1},
        "logger": "csv+tensorboard",
    }
    results = run_job(spec, tmp_path)
    ref = reference({k: v for k, v in spec.items() if k != "logger"}, tmp_path)
    assert_parity(results, ref)
    rows = list(csv.DictReader(open(next((tmp_path / "out" / "csv").rglob("metrics.csv")))))
    logged = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    expected = [s["train_loss"] for s in ref["steps"]]
    assert len(logged) == len(expected) and max(abs(a - b) for a, b in zip(logged, expected)) < 1e-5
    want = [s.get("train_loss_doubled") for s in ref["steps"]]
    assert len({w is None for w in want}) == 2  # logged on some steps, not on others
    for r in results:
        got = [s.get("train_loss_doubled") for s in r["steps"]]
        assert len(got) == len(want)
        assert all((a is None) == (b is None) and (a is None or abs(a - b) < 1e-5) for a, b in zip(got, want))
    sums = [float(r["train_loss_epoch_sum"]) for r in rows if r.get("train_loss_epoch_sum")]
    assert len(sums) == 2  # the epoch-level sum, synced with sync_dist=True without deadlock
    assert list((tmp_path / "out" / "tb").rglob("events.out.tfevents*"))


@pytest.mark.dist
def test_training_step_metric_logs_each_batch_value(tmp_path):
    """A torchmetrics accuracy called in ``training_step`` and logged with ``on_step`` and ``on_epoch``: the step
    value is the whole batch's accuracy, as on one device (the last stage runs the step per microbatch, and a
    microbatch's accuracy differs), and the epoch value matches too. Ragged last batch, gradient accumulation and
    balance="time" (whose profiling runs the step) included."""
    spec = {
        "devices": 2,
        "model": {"train_metric": True},
        "strategy": {"num_microbatches": 4, "balance": "time"},
        "data": {"n": 44, "batch_size": 8},
        "trainer": {"max_epochs": 2, "accumulate_grad_batches": 2},
    }
    results = run_job(spec, tmp_path)
    ref = reference(spec, tmp_path)
    want = [s["train_acc_step"] for s in ref["steps"]]
    assert len(set(want)) > 3  # the accuracy moves from batch to batch
    for r in results:
        got = [s["train_acc_step"] for s in r["steps"]]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)
        assert abs(r["callback_metrics"]["train_acc_epoch"] - ref["callback_metrics"]["train_acc_epoch"]) < 1e-6
    assert_parity(results, ref)


@pytest.mark.dist
def test_distributed_sampler_gives_every_stage_the_ddp_order(tmp_path):
    spec = {"data": {"n": 48, "batch_size": 8, "shuffle": True}, "trainer": {"max_epochs": 2},
            "use_distributed_sampler": True}
    pipelined = run_job({**spec, "devices": 2, "strategy": {"num_microbatches": 2}}, tmp_path / "pp")
    ddp = run_job({**spec, "devices": 1, "strategy_name": "ddp"}, tmp_path / "ddp")
    assert pipelined[0]["first_rows"] == pipelined[1]["first_rows"] == ddp[0]["first_rows"]
    assert pipelined[0]["first_rows"][0] != pipelined[0]["first_rows"][6]  # epochs are reshuffled, as under DDP
    # the same batches, so the same training as DDP on one device
    merged = {k: v for r in pipelined for k, v in r["state_dict"].items()}
    assert max((merged[k] - ddp[0]["state_dict"][k]).abs().max().item() for k in merged) < 1e-5


@pytest.mark.dist
def test_lightning_cli_by_name_and_by_class_path(tmp_path):
    app = str(HERE / "cli_app.py")
    shown = run_script([app, "fit", "--trainer.strategy", "pipeline", "--print_config"], cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stdout[-3000:]
    assert "strategy: pipeline" in shown.stdout
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 3\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  strategy:\n    class_path: lightning_pipe.PipelineStrategy\n    init_args:\n"
        "      num_microbatches: 2\n      schedule: GPipe\n      balance: [3, 4]\n"
    )
    shown = run_script([app, "fit", "--config", str(config), "--print_config"], cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stdout[-3000:]
    for line in ("class_path: lightning_pipe.PipelineStrategy", "pipeline_parallel_size: auto", "schedule: GPipe",
                 "num_microbatches: 2", "backbone: auto", "stages_per_rank: auto"):
        assert line in shown.stdout, line
    ran = run_script([app, "fit", "--config", str(config)], cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "stage 0 (rank 0): modules 0..2; stage 1 (rank 1): modules 3..6" in ran.stdout
    ran = run_script([app, "fit", "--trainer.strategy", "pipeline", "--trainer.devices", "2", "--trainer.accelerator",
                      "cpu", "--trainer.max_steps", "2", "--trainer.logger", "false"], cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "PipelineStrategy (1F1B)" in ran.stdout


def test_registered_names_resolve_to_the_strategy():
    import lightning_pipe  # noqa: F401

    names = [("pipeline", "1F1B"), ("pipeline_gpipe", "GPipe"), ("pipeline_interleaved", "Interleaved1F1B")]
    for name, schedule in names:
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        assert isinstance(trainer.strategy, PipelineStrategy)
        assert trainer.strategy.schedule == schedule
    PipelineStrategy.register_strategies(__import__("lightning.pytorch.strategies", fromlist=["x"]).StrategyRegistry)


@pytest.mark.dist
def test_ragged_last_batch_trains_like_single_device(tmp_path):
    # 44 samples in batches of 8: the last batch has 4 rows, fewer than... and not divisible by 8 microbatches
    spec = {"devices": 2, "strategy": {"num_microbatches": 8}, "data": {"n": 44, "batch_size": 8},
            "trainer": {"max_epochs": 2}}
    assert_parity(run_job(spec, tmp_path), reference(spec, tmp_path))


@pytest.mark.dist
def test_single_process_pipeline_matches_plain_lightning(tmp_path):
    spec = {"devices": 1, "strategy": {"num_microbatches": 4}, "data": {"n": 32, "batch_size": 8},
            "trainer": {"max_epochs": 1, "gradient_clip_val": 0.05}}
    assert_parity(run_job(spec, tmp_path), reference(spec, tmp_path))


@pytest.mark.dist
def test_auto_microbatches_adapt_to_each_batch_and_stay_exact(tmp_path):
    spec = {"devices": 2, "strategy": {"num_microbatches": "auto", "schedule": "Interleaved1F1B"},
            "data": {"n": 44, "batch_size": 8}, "trainer": {"max_epochs": 1}}
    assert_parity(run_job(spec, tmp_path), reference(spec, tmp_path))
