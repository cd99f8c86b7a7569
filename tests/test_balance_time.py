"""balance="time": every module is timed on rank 0, the split minimises the slowest stage, all ranks agree."""

from __future__ import annotations

import torch
from torch import nn

import models
from helpers import assert_parity, reference, run_job
from lightning_pipe.profile import time_modules


def test_timing_leaves_no_trace():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(32, 8)
    rng = torch.get_rng_state()
    costs = time_modules(list(net), x, torch.device("cpu"), repeats=3, warmup=1)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # BatchNorm statistics included
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_meta_model_is_refused_with_the_fix():
    import pytest

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="balance='parameters'"):
        time_modules(list(net), torch.randn(2, 4), torch.device("cpu"))


def test_time_balance_agrees_across_ranks_and_stays_exact(tmp_path):
    spec = {"devices": 2, "strategy": {"num_microbatches": 4, "balance": "time"}, "data": {"n": 32, "batch_size": 8},
            "trainer": {"max_epochs": 1}}
    results = run_job(spec, tmp_path)
    assert results[0]["layout"] == results[1]["layout"]
    held = sorted(int(k.split(".")[1]) for r in results for k in r["state_dict"] if k.endswith("weight"))
    assert set(held) == set(range(len(models.make_model().backbone)))
    assert_parity(results, reference(spec, tmp_path))
