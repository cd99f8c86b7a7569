"""Where the strategy's time goes on one CUDA device when microbatches are small: cProfile over the steps after
warm-up, the strategy (``Interleaved1F1B``, two stages on the one rank) with compiled blocks, bf16-mixed, the example
Llama of ``gpu.py``. Prints the functions that take the most time of their own and in all, and the step time.

    python benchmarks/gpu_overhead.py --out overhead.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import SGDLlama, Steps, _config, _loader, _median_step, model_arguments, synchronize

from lightning_pipe import PipelineStrategy


class Profiled(Callback):
    """cProfile from the start of batch ``start`` to the end of the run."""

    def __init__(self, start: int, accelerator: str) -> None:
        self.start, self.accelerator = start, accelerator
        self.profile = cProfile.Profile()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.start:
            synchronize(self.accelerator)
            self.profile.enable()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        synchronize(self.accelerator)
        self.profile.disable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="Interleaved1F1B")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    steps = args.warmup + args.steps
    L.seed_everything(0)
    record, profiled = Steps(args.accelerator), Profiled(args.warmup, args.accelerator)
    strategy = PipelineStrategy(schedule=args.schedule, stages_per_rank=2, num_microbatches=args.num_microbatches,
                                compile=args.compile)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record, profiled], use_distributed_sampler=False)
    trainer.fit(SGDLlama(_config(args), lr=args.lr), _loader(args, steps))
    text = io.StringIO()
    text.write(f"median step {_median_step(record.starts, args.warmup) * 1e3:.1f} ms over {args.steps} steps\n")
    stats = pstats.Stats(profiled.profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
