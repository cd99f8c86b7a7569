"""``schedule="auto"`` on one CUDA device: the GPU paths of the search (the device's memory as the bound, the peak
memory measured per candidate, bf16), and that the run trains exactly as the choice set explicitly.

The example Llama runs on one process with ``pipeline_parallel_size=1`` (a GPU cannot host two NCCL ranks), so the
candidates are 1F1B and the multi-stage schedules with two stages on the one rank, each at several microbatch counts.
For each precision: (1) ``schedule="auto"``, (2) the chosen arguments set explicitly, same seed and batches; the
losses of the two are compared step by step, and the logged table is kept. Results go to ``--out``.

    python benchmarks/gpu_auto.py --out gpu_auto.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import SGDLlama, Steps, _config, _loader, model_arguments

from lightning_pipe import PipelineStrategy


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit(args: argparse.Namespace, precision: str, **strategy: Any) -> tuple[list[float], Any, float, list[str]]:
    L.seed_everything(0)
    model = SGDLlama(_config(args), lr=args.lr)
    record = Steps(args.accelerator)
    handler = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(handler)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, precision=precision, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record], use_distributed_sampler=False,
                        strategy=PipelineStrategy(pipeline_parallel_size=1, **strategy))
    begin = time.perf_counter()
    trainer.fit(model, _loader(args, args.steps))
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    steps = [b - a for a, b in zip(record.starts, record.starts[1:])]
    runtime = trainer.strategy._runtime
    median = statistics.median(steps[runtime.trial_steps + 1:] or steps[-1:])
    print(f"{precision} {strategy}: {time.perf_counter() - begin:.1f} s, median step after the choice"
          f" {median * 1e3:.1f} ms", flush=True)
    chosen = runtime.choice.config if runtime.choice is not None else None  # None: the arguments were explicit
    return record.losses, chosen, median, handler.lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    results: dict[str, Any] = {"device": device, "torch": torch.__version__, "args": vars(args)}
    for precision in ("32-true", "bf16-mixed") if args.accelerator == "gpu" else ("32-true",):
        losses, chosen, step_s, lines = fit(args, precision, schedule="auto")
        pinned, _, pinned_s, _ = fit(args, precision, **chosen.record())
        table = next((line for line in lines if "Keeping" in line), "")
        results[precision] = {
            "chosen": chosen.record(), "auto_step_s": step_s, "pinned_step_s": pinned_s,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, pinned)), "table": table,
            "peaks_measured": bool(re.search(r"\d+\.\d+ (MiB|GiB)\s*$", table, re.M)),
        }
        print(table, flush=True)
        print(precision, "max loss difference, auto against pinned:", results[precision]["max_loss_diff"],
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
