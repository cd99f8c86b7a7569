"""What a new sequence length costs a pipelined training step, and what many lengths cost in memory.

    python benchmarks/shapes.py                # about 3 minutes on 2 idle cores
    python benchmarks/shapes.py --part timing  # the step times only

The model is the benchmark's (``benchmarks/benchmark.py``: Llama-style, 8 blocks of 256, a 16384-word vocabulary,
plain SGD), trained with ``PipelineStrategy(schedule="1F1B")`` on 2 processes, one thread each, with the
benchmark's pinning and steady memory settings. Every batch holds ``--batch-size`` rows of one length.

Part 1, step time. After ``--warmup`` steps at ``--seq-len``, each of ``--pairs`` lengths just below it is met
twice in a row: the first step is at a new length, the second at the same length, now known. The pairs give the
median step time at a new and at a known length, and the median of their differences: what a new length costs,
with the compute of both steps the same. ``--revisits`` of those lengths are then met twice again, after their
schedules were evicted: what a rebuilt schedule costs. The cost is broken down from the pipeline's ``shape_stats``
(each rank's time to probe the stage shapes and exchange them, and to construct torch's stages and schedule); the
rest is the first step of a new schedule inside torch (its set-up vote over the pipeline, the receive buffers, and
memory the new sizes take from the allocator). One more pair runs under ``cProfile`` and shows torch's share of
that rest.

Part 2, memory. ``--memory-batches`` batches of ``--memory-batch-size`` rows, each of a length of its own (drawn
from ``--memory-min-len`` to ``--memory-max-len``), trained with the bound on schedules
(``lightning_pipe._step.shapes.MAX_SCHEDULES``) and with the bound off (``--memory-runs``; ``fixed`` adds a run at one
fixed length, the longest). Each rank reports its resident set size after every step, and the bytes of the receive
buffers its kept schedules hold. The buffers grow with rows, length and width, not with depth or vocabulary, so this
part runs the benchmark model with ``--memory-n-layers`` blocks and a ``--memory-vocab-size`` vocabulary: that keeps
90 steps short.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lightning as L  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from benchmark import STEADY_MEMORY, make_model, pin  # noqa: E402  (adds examples/ and the checkout to sys.path)
from llama import load_corpus  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402
from lightning_pipe._compat.pipelining import schedule_stages  # noqa: E402
from lightning_pipe._step.shapes import MAX_SCHEDULES, ScheduleCache  # noqa: E402

#: Functions whose cumulative time the profiled pair reports: ours, then torch's first-step set-up.
PROFILED = {
    "_stage_metas": "probe and exchange of stage shapes",
    "broadcast_object_list": "  of which the in-order exchange",
    "all_gather_object": "  of which the all-at-once exchange",
    "_make_stages": "PipelineStage construction",
    "_make_schedule": "schedule construction",
    "_initialize_pp_stages": "torch's first-step set-up",
    "_warmup_p2p": "  of which its vote over the pipeline",
    "_prepare_forward_infra": "  of which forward receive buffers",
    "_prepare_backward_infra": "  of which backward receive buffers",
}


# ------------------------------------------------------------------------------------------------- in each rank
def batch_lengths(args: argparse.Namespace) -> list[int]:
    """The length of every training batch of the part, in order."""
    if args.part == "timing":
        new = [args.seq_len - 1 - k for k in range(args.pairs)]
        profiled = args.seq_len - 1 - args.pairs
        return [args.seq_len] * args.warmup + [n for n in [*new, *new[: args.revisits], profiled] for _ in range(2)]
    if args.bound == "fixed":
        return [args.memory_max_len] * args.memory_batches
    lengths = list(range(args.memory_min_len, args.memory_max_len + 1))
    random.Random(args.seed).shuffle(lengths)
    return lengths[: args.memory_batches]


def make_batches(args: argparse.Namespace, lengths: list[int], rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of ``rows`` windows of the corpus per length: inputs and next-byte targets."""
    data = load_corpus()
    generator = torch.Generator().manual_seed(args.seed)
    batches = []
    for length in lengths:
        starts = torch.randint(0, len(data) - length - 1, (rows,), generator=generator)
        windows = torch.stack([data[s : s + length + 1].long() for s in starts.tolist()])
        batches.append((windows[:, :-1], windows[:, 1:]))
    return batches


class ShapeProbe(L.Callback):
    """Records each step's start, the rank's resident memory after it, and the pipeline's shape counters; runs the
    last pair of the timing part under ``cProfile``."""

    def __init__(self, args: argparse.Namespace, steps: int) -> None:
        self.args, self.steps = args, steps
        self.starts: list[float] = []
        self.rss_mb: list[float] = []
        self.held_mb: list[float] = []
        self.profiler = cProfile.Profile() if args.part == "timing" else None
        self.profiled: list[dict[str, float]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pin(self.args, trainer.global_rank)
        if self.args.bound == "off":  # the strategy has no argument for the bound: replace the pipeline's cache
            trainer.strategy.runtime.pipeline._schedules = ScheduleCache(max_kept=10**9)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        self.starts.append(time.perf_counter())
        if self.profiler is not None and index >= self.steps - 2:
            self.profiler.enable()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if self.profiler is not None and len(self.starts) > self.steps - 2:
            self.profiler.disable()
            self.profiled.append(_cumulative_times(self.profiler))
            self.profiler = cProfile.Profile()
        self.rss_mb.append(psutil.Process().memory_info().rss / 2**20)
        self.held_mb.append(_receive_buffer_bytes(trainer.strategy.runtime.pipeline) / 2**20)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.starts.append(time.perf_counter())
        result = {
            "step_s": [b - a for a, b in zip(self.starts, self.starts[1:])],
            "rss_mb": self.rss_mb,
            "held_mb": self.held_mb,
            "stats": vars(trainer.strategy.runtime.pipeline.shape_stats),
            "profiled": self.profiled,
        }
        with open(f"{self.args.out}.rank{trainer.global_rank}", "w") as f:
            json.dump(result, f)


def _receive_buffer_bytes(pipeline: Any) -> int:
    """Bytes of the receive buffers (activations and gradients) of the schedules ``pipeline`` keeps."""
    total = 0
    for schedule in pipeline._schedules._kept.values():  # the cache's own view; the strategy exposes no other
        for stage in schedule_stages(schedule) or []:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                total += sum(i.buffer.nbytes for i in infos if isinstance(i.buffer, torch.Tensor))
    return total


def _cumulative_times(profiler: cProfile.Profile) -> dict[str, float]:
    """Seconds spent in (and below) each function of :data:`PROFILED`, and in the whole step."""
    times = {name: 0.0 for name in PROFILED}
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    for (_, _, name), (*_, cumtime, _) in stats.items():
        if name in times:
            times[name] = max(times[name], cumtime)
    times["step"] = pstats.Stats(profiler).total_tt
    return times


def run_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    lengths = batch_lengths(args)
    timing = args.part == "timing"
    model_args = {**vars(args), "seq_len": max(lengths)}
    if not timing:
        model_args.update(n_layers=args.memory_n_layers, vocab_size=args.memory_vocab_size)
    batches = make_batches(args, lengths, args.batch_size if timing else args.memory_batch_size)
    microbatches = args.num_microbatches if timing else args.memory_num_microbatches
    strategy = PipelineStrategy(num_microbatches=microbatches, schedule="1F1B")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=len(batches),
        callbacks=[ShapeProbe(args, len(batches))], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # one batch, of one length, per item
    trainer.fit(make_model(argparse.Namespace(**model_args)), train_dataloaders=loader)


# ------------------------------------------------------------------------------------------------------ parent
def launch(args: argparse.Namespace, part: str, bound: str = "on") -> list[dict[str, Any]]:
    """One part in its own 2-process run (Lightning's launcher starts rank 1); every rank's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key, value in STEADY_MEMORY.items():
        env.setdefault(key, value)
    skip = ("part", "bound", "out", "json", "pin")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]
    flags.append("--pin" if args.pin else "--no-pin")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), f"--part={part}", f"--bound={bound}", f"--out={out}", *flags]
        print(f"running {part} (bound {bound})", flush=True)
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            sys.exit(f"{part} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        results = []
        for rank in range(2):
            with open(f"{out}.rank{rank}") as f:
                results.append(json.load(f))
    return results


def report_timing(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = ranks[0]["step_s"][args.warmup :]  # rank 0's wall clock: the whole pipeline
    new, known = steps[0 : 2 * args.pairs : 2], steps[1 : 2 * args.pairs : 2]
    extra = statistics.median(n - k for n, k in zip(new, known))
    revisits = steps[2 * args.pairs : 2 * (args.pairs + args.revisits)]
    rebuilt = statistics.median(r - k for r, k in zip(revisits[0::2], revisits[1::2])) if revisits else float("nan")
    builds = [r["stats"]["built"] for r in ranks]
    probe = [r["stats"]["probe_seconds"] / b for r, b in zip(ranks, builds)]
    construct = [r["stats"]["construct_seconds"] / b for r, b in zip(ranks, builds)]
    print(f"\nstep time, {args.batch_size} rows in {args.num_microbatches} microbatches, {args.pairs} pairs "
          f"(lengths {args.seq_len - args.pairs} to {args.seq_len - 1}), rank 0's wall clock")
    print(f"  known length  median {statistics.median(known) * 1e3:8.1f} ms")
    print(f"  new length    median {statistics.median(new) * 1e3:8.1f} ms")
    print(f"  a new length costs   {extra * 1e3:8.1f} ms (median of the pairs' differences), "
          f"{extra / statistics.median(known):.1%} of a step")
    print(f"  a length met again after its schedule was evicted costs {rebuilt * 1e3:.1f} ms "
          f"(median of {args.revisits} pairs: its stage shapes are remembered)")
    print("  of which, per new schedule and rank (shape_stats):")
    print(f"    probe and exchange of stage shapes: {', '.join(f'{p * 1e3:.1f}' for p in probe)} ms")
    print(f"    construction of stages and schedule: {', '.join(f'{c * 1e3:.1f}' for c in construct)} ms")
    print("  the profiled pair (cProfile, inflated), new step / known step, ms, rank 0 | rank 1:")
    for name, label in [*PROFILED.items(), ("step", "the whole step")]:
        cells = " | ".join(f"{r['profiled'][0][name] * 1e3:7.1f} / {r['profiled'][1][name] * 1e3:7.1f}" for r in ranks)
        print(f"    {label:40s} {cells}")
    return {"known_ms": statistics.median(known) * 1e3, "new_ms": statistics.median(new) * 1e3,
            "new_minus_known_ms": extra * 1e3, "rebuilt_minus_known_ms": rebuilt * 1e3,
            "probe_ms": [p * 1e3 for p in probe], "construct_ms": [c * 1e3 for c in construct],
            "profiled": [r["profiled"] for r in ranks]}


def report_memory(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    n = args.memory_batches
    marks = sorted({min(n, k) for k in (1, 10, 30, 60, 90, n)})
    print(f"\nresident memory per rank (MB) over {n} batches of {args.memory_batch_size} rows in "
          f"{args.memory_num_microbatches} microbatches, lengths {args.memory_min_len} to {args.memory_max_len}; "
          f"{args.memory_n_layers} blocks of {args.dim}, vocabulary {args.memory_vocab_size}")
    since = min(30, n)
    print(f"  {'run':20s} {'rank':>4s} " + " ".join(f"{f'after {k}':>9s}" for k in marks)
          + f" {f'growth {since}..{n}':>13s} {'buffers held':>12s} {'kept':>5s} {'built':>6s} {'evicted':>8s}")
    table = {}
    for name, ranks in runs.items():
        for rank, r in enumerate(ranks):
            rss, stats = r["rss_mb"], r["stats"]
            growth = rss[n - 1] - rss[since - 1]
            print(f"  {name:20s} {rank:4d} " + " ".join(f"{rss[k - 1]:9.0f}" for k in marks)
                  + f" {growth:+13.0f} {r['held_mb'][-1]:12.1f} {stats['kept']:5d} {stats['built']:6d}"
                  f" {stats['evicted']:8d}")
            table[f"{name}/rank{rank}"] = {**r, "growth_mb": growth}
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="all", choices=["all", "timing", "memory"])
    p.add_argument("--bound", default="on", choices=["on", "off", "fixed"], help="(internal) the memory run")
    p.add_argument("--out", default=None, help="(internal) where a rank writes its result")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64, help="the known length of part 1; new ones are just below")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs", type=int, default=8, help="lengths met twice in a row (new, then known)")
    p.add_argument("--revisits", type=int, default=3,
                   help="of those lengths, how many are met twice again at the end, after their schedule was evicted")
    p.add_argument("--memory-batches", type=int, default=90)
    p.add_argument("--memory-batch-size", type=int, default=4)
    p.add_argument("--memory-num-microbatches", type=int, default=4)
    p.add_argument("--memory-min-len", type=int, default=32)
    p.add_argument("--memory-max-len", type=int, default=512)
    p.add_argument("--memory-n-layers", type=int, default=2)
    p.add_argument("--memory-vocab-size", type=int, default=256, help="the corpus is bytes")
    p.add_argument("--memory-runs", default="on,off", help="comma-separated: on, off, fixed")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=600, help="seconds allowed per run")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin rank r's main thread to the r-th allowed core (as benchmarks/benchmark.py)")
    args = p.parse_args()
    if args.memory_max_len - args.memory_min_len + 1 < args.memory_batches:
        p.error(f"{args.memory_batches} batches of distinct lengths need at least as many lengths between "
                f"--memory-min-len {args.memory_min_len} and --memory-max-len {args.memory_max_len}.")
    if set(args.memory_runs.split(",")) - {"on", "off", "fixed"}:
        p.error(f"--memory-runs {args.memory_runs!r}: name runs among on, off, fixed.")
    if args.pairs < MAX_SCHEDULES + args.revisits:
        p.error(f"--pairs {args.pairs} must be at least {MAX_SCHEDULES} (the schedules kept) + --revisits "
                f"{args.revisits}, so that the lengths revisited were evicted.")
    if args.pairs + 1 >= args.seq_len:
        p.error(f"--pairs {args.pairs} needs --seq-len above {args.pairs + 1}: each pair has its own shorter length.")
    if args.out is not None:
        return run_part(args)
    report: dict[str, Any] = {"config": vars(args), "torch": torch.__version__}
    if args.part in ("all", "timing"):
        report["timing"] = report_timing(args, launch(args, "timing"))
    if args.part in ("all", "memory"):
        names = {"on": f"bound on (keeps {MAX_SCHEDULES})", "off": "bound off",
                 "fixed": "one fixed length"}
        runs = [run for run in args.memory_runs.split(",") if run]
        report["memory"] = report_memory(args, {names[b]: launch(args, "memory", b) for b in runs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
