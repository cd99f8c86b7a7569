"""pp2 x dp2 x tp2, and pp2 x HSDP (2 x 2), on 8 CPU processes against one process on the full batch: too many
processes for CI's 2 cores.

    python scripts/three_d.py [--timeout 900]

One launch of ``tests/zoo_job.py`` on 8 processes trains the hand-built Llama of ``tests/zoo.py`` (torchtitan's plan,
SGD with momentum, a per-step LR scheduler, clipping and gradient accumulation) as pp2 x ddp2 x tp2 and as
pp2 x fsdp2 x tp2, both replicas fed the whole batch (no distributed sampler), so one process on that batch is the
reference; and the same model as pp2 with HSDP, each stage sharded over 2 replicas and replicated over 2 such groups.
Prints the largest difference of the losses and final weights, and the parameters each rank holds
against the same model on pp2 alone (one process per stage, from the reference's state dict).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import zoo  # noqa: E402
import zoo_job  # noqa: E402
from helpers import merged_state, run_script  # noqa: E402

BASE = {"model": "llama_tp", "data": {"n": 48, "batch_size": 8}, "model_kwargs": {"lr": 0.2},
        "trainer": {"max_epochs": 1, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2}}
TP = {"pipeline_parallel_size": 2, "num_microbatches": 4, "tensor_parallel_size": 2,
      "tensor_parallel_plan": zoo.LLAMA_TP_PLAN}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    phases = [
        {"name": "pp2_ddp2_tp2", **BASE, "strategy": TP},
        {"name": "pp2_fsdp2_tp2", **BASE, "strategy": {**TP, "data_parallel": "fsdp"}},
        {"name": "pp2_hsdp2x2", **BASE, "strategy": {
            "pipeline_parallel_size": 2, "num_microbatches": 4, "data_parallel": "hsdp",
            "data_parallel_shard_size": 2,
        }},
    ]
    work = Path(tempfile.mkdtemp())
    (work / "spec.json").write_text(json.dumps({"devices": 8, "phases": phases}))
    proc = run_script([str(ROOT / "tests" / "zoo_job.py"), "spec.json", "out"], cwd=work, timeout=args.timeout)
    if proc.returncode:
        sys.exit(proc.stdout[-6000:])
    reference = zoo_job.run_phase({**BASE, "strategy": None}, 1)
    whole = sum(v.numel() for v in reference["state_dict"].values())
    for phase in phases:
        got = [torch.load(work / "out" / f"{phase['name']}.rank{r}.pt", weights_only=False) for r in range(8)]
        ref_steps = reference["steps"]
        losses = max(abs(a["train_loss"] - b["train_loss"]) for g in got for a, b in zip(g["steps"], ref_steps))
        state = merged_state(got)
        weights = max((state[k] - reference["state_dict"][k]).abs().max().item() for k in state)
        held = [g["local_numel"] for g in got]
        print(f"{phase['name']}: losses within {losses:.1e}, final weights within {weights:.1e} of one process;"
              f" parameters per rank {held} (the whole model: {whole})")


if __name__ == "__main__":
    main()
