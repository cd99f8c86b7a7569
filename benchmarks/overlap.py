"""Step time of pipeline x data parallel (pp2 x dp2, 4 processes) on the benchmark model, to compare the gradient
reductions under the last backward with those after the schedule.

    python benchmarks/overlap.py [--data-parallel ddp|fsdp] [--steps 12] [--warmup 4]
    LP_CHECKOUT=/path/to/an/older/checkout python benchmarks/overlap.py   # the same run on that checkout's package

The model is ``benchmarks/benchmark.py``'s (``examples/llama.py``, 8 blocks of 256, a 16384-word vocabulary), the
batch 32 x 64 tokens per replica in 8 microbatches, plain SGD, one thread per process. Rank 0 prints the median time
between consecutive training-step starts after the warm-up, and every rank its median CPU seconds per step. Four
processes on fewer than four cores share them: then the step times say little, and the CPU seconds per rank are the
figure to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("LP_CHECKOUT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from llama import LitLlama, LlamaConfig, Windows, load_corpus  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402


class Clock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-parallel", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    kwargs = {"pipeline_parallel_size": 2, "num_microbatches": 8}
    if args.data_parallel != "ddp":
        kwargs["data_parallel"] = args.data_parallel
    clock = Clock()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=PipelineStrategy(**kwargs), max_steps=args.warmup + args.steps + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock],
    )
    cfg = LlamaConfig(vocab_size=16384, dim=256, n_layers=8, max_seq_len=64)
    model = LitLlama(cfg, lr=0.01)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.01)  # plain SGD, as benchmark.py
    samples = 32 * 2 * (args.warmup + args.steps + 2)
    data = torch.utils.data.DataLoader(Windows(load_corpus(), 64, samples, seed=0), batch_size=32)
    trainer.fit(model, data)
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:])][args.warmup:]
    cpu = [b - a for a, b in zip(clock.cpu, clock.cpu[1:])][args.warmup:]
    print(json.dumps({"rank": trainer.global_rank, "checkout": str(ROOT), "step_s": statistics.median(steps),
                      "cpu_s": statistics.median(cpu)}), flush=True)


if __name__ == "__main__":
    main()
