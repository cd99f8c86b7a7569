"""Scaling out: pipeline x data parallel, meta-device init of the local stage only, mixed precision, activation
checkpointing and multi-node launch through torchrun."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import models
import pytest
import torch
from helpers import JOB, assert_parity, merged_state, reference, run_job

from lightning_pipe._model.materialize import materialize

pytestmark = pytest.mark.dist


def test_pipeline_times_data_parallel_equals_ddp(tmp_path):
    spec = {
        "data": {"n": 64, "batch_size": 8, "shuffle": True},
        "trainer": {"max_epochs": 2, "gradient_clip_val": 0.05},
        "model": {"scheduler": "step", "train_metric": True},
        "use_distributed_sampler": True,
    }
    pp_strategy = {"pipeline_parallel_size": 2, "num_microbatches": 2}
    pp_dp = run_job({**spec, "devices": 4, "strategy": pp_strategy}, tmp_path / "pp")
    ddp = run_job({**spec, "devices": 2, "strategy_name": "ddp"}, tmp_path / "ddp")
    for rank, result in enumerate(pp_dp):
        replica = rank // 2  # ranks (0, 1) are replica 0's pipeline, (2, 3) replica 1's
        assert result["first_rows"] == ddp[replica]["first_rows"]
        losses = [s["train_loss"] for s in result["steps"]]
        expected = [s["train_loss"] for s in ddp[replica]["steps"]]
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-5, (rank, losses, expected)
        # the epoch sum is synced with sync_dist=True: over the 2 replicas, as under DDP
        epoch_sum = result["callback_metrics"]["train_loss_epoch_sum"]
        assert abs(epoch_sum - ddp[0]["callback_metrics"]["train_loss_epoch_sum"]) < 1e-4
        # a torchmetrics accuracy: per step the replica's batch value, per epoch synced over every process
        accs = [s["train_acc_step"] for s in result["steps"]]
        assert max(abs(a - b) for a, b in zip(accs, [s["train_acc_step"] for s in ddp[replica]["steps"]])) < 1e-6
        assert abs(result["callback_metrics"]["train_acc_epoch"] - ddp[0]["callback_metrics"]["train_acc_epoch"]) < 1e-6
    for replica in (0, 1):
        merged = merged_state(pp_dp[2 * replica : 2 * replica + 2])
        worst = max((merged[k] - ddp[replica]["state_dict"][k]).abs().max().item() for k in merged)
        assert worst < 1e-5, worst
    moved = max((ddp[0]["state_dict"][k] - ddp[0]["initial"][k]).abs().max().item() for k in merged)
    assert moved > 1e-3


def test_meta_init_gives_the_same_weights_whatever_the_pipeline_size(tmp_path):
    spec = {"meta_init": True, "data": {"n": 16, "batch_size": 8}, "trainer": {"max_steps": 1}, "model": {"blocks": 2}}
    with torch.device("meta"):
        unsplit = models.make_model(blocks=2)
    materialize(unsplit, torch.device("cpu"))
    expected = unsplit.state_dict()
    for devices in (1, 2, 4):
        results = run_job({**spec, "devices": devices, "strategy": {"num_microbatches": 4}}, tmp_path / str(devices))
        initial = merged_state(results, "initial")
        assert set(initial) == set(expected)
        for name, value in initial.items():
            assert torch.equal(value, expected[name]), (devices, name)
        for r in results:  # each rank holds only its own stage's tensors
            assert len(r["initial"]) < len(expected) or devices == 1


def test_activation_checkpointing_is_exact_and_keeps_fewer_activations(tmp_path):
    spec = {"devices": 2, "data": {"n": 32, "batch_size": 8}, "trainer": {"max_epochs": 1}, "count_saved": True}
    plain = run_job({**spec, "strategy": {"num_microbatches": 4}}, tmp_path / "plain")
    ac = run_job({**spec, "strategy": {"num_microbatches": 4, "activation_checkpointing": True}}, tmp_path / "ac")
    assert_parity(ac, reference(spec, tmp_path))
    for rank in (0, 1):
        assert max(ac[rank]["saved_bytes"]) < 0.5 * max(plain[rank]["saved_bytes"]), (
            ac[rank]["saved_bytes"], plain[rank]["saved_bytes"])


def test_bf16_mixed_tracks_single_device(tmp_path):
    spec = {"data": {"n": 32, "batch_size": 8}, "trainer": {"max_epochs": 2, "precision": "bf16-mixed"}}
    results = run_job({**spec, "devices": 2, "strategy": {"num_microbatches": 4}}, tmp_path)
    ref = reference(spec, tmp_path)
    for r in results:
        diffs = [abs(a["train_loss"] - b["train_loss"]) for a, b in zip(r["steps"], ref["steps"])]
        assert len(diffs) == len(ref["steps"]) and max(diffs) < 3e-2, diffs


def test_fp16_scaler_skips_the_step_on_every_stage_together(tmp_path):
    spec = {"devices": 2, "strategy": {"num_microbatches": 2}, "fp16_scaler": True, "inf_at_step": 2,
            "data": {"n": 48, "batch_size": 8}, "trainer": {"max_steps": 4}}
    results = run_job(spec, tmp_path)
    assert results[0]["scales"] == results[1]["scales"]
    # scales[k] is the scale in use during step k: the overflow in step 2 halved it for step 3 on both ranks
    assert results[0]["scales"][3] == results[0]["scales"][2] / 2 == results[0]["scales"][1] / 2
    for r in results:  # neither stage stepped on the overflowing batch
        before, after = r["params_before_inf_step"], r["params_after_inf_step"]
        assert before and all(torch.equal(before[k], after[k]) for k in before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes(tmp_path):
    spec = {"devices": 1, "strategy": {"num_microbatches": 4}, "data": {"n": 32, "batch_size": 8},
            "trainer": {"max_epochs": 1, "num_nodes": 2}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(JOB), str(spec_file),
             str(tmp_path / "out")],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    results = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    # each node held one stage while training, and holds the whole model after the call
    assert len(results[0]["initial"]) < len(results[0]["state_dict"])
    ref_spec = {k: v for k, v in spec.items() if k != "trainer"} | {"trainer": {"max_epochs": 1}}
    assert_parity(results, reference(ref_spec, tmp_path))
