"""Pipelined training equals single-device training: losses per step and final parameters (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
from helpers import assert_parity, reference, run_job

pytestmark = pytest.mark.dist

BASE = {
    "data": {"n": 48, "batch_size": 8},
    "trainer": {"max_epochs": 2},
}

CASES = {
    # name: (devices, strategy kwargs, model kwargs, trainer kwargs)
    "1f1b-clip-accum-steplr": (
        2,
        {"num_microbatches": 4},
        {"scheduler": "step"},
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ),
    "gpipe-uneven": (
        2, {"schedule": "GPipe", "num_microbatches": 2, "balance": [2, 5]}, {}, {"gradient_clip_val": 0.1}
    ),
    "interleaved-epoch-lr": (
        2,
        {"schedule": "Interleaved1F1B", "num_microbatches": 4},
        {"scheduler": "epoch"},
        {"accumulate_grad_batches": 3},
    ),
    "looped-bfs": (2, {"schedule": "LoopedBFS", "num_microbatches": 4}, {}, {"gradient_clip_val": 0.05}),
    "interleaved-zero-bubble": (2, {"schedule": "InterleavedZeroBubble", "num_microbatches": 4}, {}, {}),
    "zbv-zero-bubble": (2, {"schedule": "ZBVZeroBubble", "num_microbatches": 4}, {}, {"gradient_clip_val": 0.05}),
    "dualpipev": (
        2, {"schedule": "DualPipeV", "num_microbatches": 4}, {"scheduler": "step"}, {"accumulate_grad_batches": 2}
    ),
    "1f1b-4-parameters": (
        4,
        {"num_microbatches": 4, "balance": "parameters"},
        {"scheduler": "step"},
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ),
    "interleaved-4": (
        4,
        {"schedule": "Interleaved1F1B", "num_microbatches": 8},
        {"blocks": 6},
        {"gradient_clip_val": 0.05},
    ),
    "gpipe-4-adamw": (4, {"schedule": "GPipe", "num_microbatches": 8}, {"optimizer": "adamw", "lr": 0.01}, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_single_device(name, tmp_path):
    devices, strategy, model, trainer = CASES[name]
    spec = {**BASE, "devices": devices, "strategy": strategy, "model": model, "trainer": {**BASE["trainer"], **trainer}}
    results = run_job(spec, tmp_path, timeout=240)
    ref = reference(spec, tmp_path)
    atol = 1e-4 if model.get("optimizer") == "adamw" else 1e-5
    assert_parity(results, ref, atol=atol)
    for r in results:  # the hooks of a real backward fired once per step
        assert r["hooks"] == ref["hooks"], (r["hooks"], ref["hooks"])
        assert r["global_step"] == ref["global_step"]
