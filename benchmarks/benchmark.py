"""Steady-state training step time of several ways to train the same model, measured side by side in one run.

    (a)  single       plain Lightning, one process, no strategy (``Trainer(devices=1)``)
    (a') microbatched plain torch, one process, the m microbatches run back to back (for the ceiling below)
    (b)  torch        a hand-written ``torch.distributed.pipelining`` loop: ``PipelineStage`` + ``Schedule1F1B`` on
                      2 processes (``torch.multiprocessing``, gloo), the uniform split, then an SGD step
    (c)  strategy     ``PipelineStrategy(schedule="1F1B", balance="uniform")``: the same split as (b)
    (d)  parameters   ``PipelineStrategy(balance="parameters")``
    (e)  time         ``PipelineStrategy(balance="time")`` (profiled); its step 3 is also traced with ``timeline=``
                      (a warm-up step, not timed) to measure the bubble and draw ``benchmarks/timeline.png``

``--compile=1`` compiles every module of the backbone (Inductor) in every variant: ``compile=True`` for the
strategies, ``Module.compile()`` on each module for the others.

The ceiling on this hardware is (a') / p × (m + p − 1) / m: perfect balance and free transfers, with the cost of
microbatching itself included. Whole modules cannot always be split that evenly, so next to it the benchmark
prints the whole-module bound: the ceiling scaled by how far the best contiguous split of the per-module times
that (e) profiled is from a perfect one (the slowest stage over the mean).

The default model is Llama-style with a head much heavier than one block: 8 blocks of hidden size 256 and a
16384-word vocabulary, whose head and loss cost about 6.5 blocks. The uniform split (by module count) leaves the
second rank three blocks and the head, so the balances differ. A head heavier than half of the model cannot be
balanced by any split, and the whole-module bound then shows how far from the ceiling the best split must stay:
with ``--n-layers 4`` the head and loss alone are 56% of the work, and the bound is 1.13× the ceiling.

Each variant runs ``--rounds`` times, interleaved with the others (a, a', b, c, d, e, a, a', ...), and the run with
the lowest median counts: a burst of other load on a shared machine slows one run, not the variant. Next to the
integration overhead (c)/(b) of the counted runs, the ratio of each round's (c) and (b) runs is printed.

Two settings keep the machine from deciding the comparison, the same for every variant (``--no-pin`` and
``--no-steady-memory`` turn them off):

- ``--pin``: each rank's main thread is pinned to its own core once its process groups exist (gloo's threads stay
  free). Left to the scheduler, the ranks of a 2-process run on 2 cores are moved about, and runs of the same
  variant differed by up to 10%.
- ``--steady-memory``: glibc's malloc runs with fixed thresholds, so the large blocks of the head's logits and
  gradients stay in the heap instead of being unmapped and faulted in again, and torch's allocator asks for
  transparent huge pages (see :data:`STEADY_MEMORY`). Without them, the page faults (40 to 100 ms of kernel time
  per step) and the speed of the same matrix products (up to 5%) differed from one process to the next, whichever
  code it ran.

All variants build the identical model (``examples/llama.py``, same seed), see the same batches of the same
microbatch count and step plain SGD. Every process runs with ONE thread (``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``), (a) included: the comparison is per process, so the speed-up of (c) over (a)
is what a second worker buys, not what a second thread would. (Lightning would otherwise give a lone process
all cores.)

A step is the time between consecutive training-step starts on rank 0: data loading, forward, backward,
optimizer step and Lightning's bookkeeping (for (c) also the logging bridge). The first ``--warmup`` steps
(shape inference, allocator warm-up) are dropped and the median of the next ``--steps`` is reported. Next to
it, each rank's median CPU seconds per step (``time.process_time``): they show how evenly the work is split.
They include the communication threads of gloo, which differ between (b) and (c) for the same compute, so they
are no measure of the integration overhead.

Each variant runs in its own subprocess (``--variant NAME --out FILE``), one after the other, so Lightning's
launcher can start the ranks of (c) as it always does. The parent prints the table and writes
``benchmarks/results.json``.

    python benchmarks/benchmark.py                       # about 13 minutes on 2 idle cores
    python benchmarks/benchmark.py --rounds 1 --steps 10  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]  # the example's model, and lightning_pipe from this checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from llama import LitLlama, LlamaConfig, make_loaders  # noqa: E402

VARIANTS = {
    "single": "(a) Lightning, 1 process, no strategy",
    "microbatched": "(a') torch, 1 process, m microbatches in a row",
    "torch": "(b) hand-written torch 1F1B, uniform split",
    "strategy": "(c) PipelineStrategy 1F1B, uniform split",
    "parameters": "(d) PipelineStrategy 1F1B, balance=parameters",
    "time": "(e) PipelineStrategy 1F1B, balance=time",
    "auto": "(f) PipelineStrategy schedule=auto, after its trial",
}
#: The memory settings of ``--steady-memory``, for every variant. glibc's malloc with fixed thresholds: large blocks
#: stay in the heap instead of being unmapped and faulted in again (with the adaptive default, a rank faulted in 1 to
#: 2.2 million pages in 25 steps, a different number in every run: 40 to 100 ms of kernel time per step). And torch's
#: CPU allocator asks for transparent huge pages for blocks of 2 MB and more: without them, how fast the same
#: matrix products run depended on where a process's heap happened to lie, and one process computed up to 5% slower
#: than another running the same code. jemalloc or tcmalloc, which PyTorch's CPU tuning guide recommends, address the
#: same costs.
STEADY_MEMORY = {
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296",
    "THP_MEM_ALLOC_ENABLE": "1",
}
STRATEGY_BALANCE = {"strategy": "uniform", "parameters": "parameters", "time": "time", "auto": "uniform"}


class BenchLlama(LitLlama):
    """The example's model with plain SGD, the optimizer of the hand-written loop."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class CompiledBenchLlama(BenchLlama):
    """Plain Lightning with every module of the backbone compiled (``--compile=1``), as ``compile=True`` compiles
    the strategy's."""

    def configure_model(self) -> None:
        for module in self.backbone:
            module.compile()


def make_model(args: argparse.Namespace, lightning: bool = True) -> BenchLlama:
    torch.manual_seed(args.seed)
    config = LlamaConfig(dim=args.dim, n_layers=args.n_layers, max_seq_len=args.seq_len, vocab_size=args.vocab_size)
    compiled = args.compile and lightning and args.variant not in STRATEGY_BALANCE
    return (CompiledBenchLlama if compiled else BenchLlama)(config, lr=args.lr)


def make_train_loader(args: argparse.Namespace) -> Any:
    torch.manual_seed(args.seed)
    total = args.warmup + args.steps + 1
    loader, _ = make_loaders(args.seq_len, args.batch_size, total * args.batch_size, seed=args.seed)
    return loader


def stage0_modules(args: argparse.Namespace) -> int:
    """Backbone modules on stage 0 under ``balance="uniform"`` (the strategy's own rule, so (b) and (c) match)."""
    from lightning_pipe.partition import split_sizes

    return split_sizes([1] * (args.n_layers + 3), 2, "uniform")[0]


def write_result(args: argparse.Namespace, rank: int, starts: list[float], cpu: list[float]) -> None:
    """Rank 0 writes the wall-clock step times; every rank writes its CPU seconds per step next to it."""
    timed = [b - a for a, b in zip(starts, starts[1:])][args.warmup :]
    cpu_timed = [b - a for a, b in zip(cpu, cpu[1:])][args.warmup :]
    result = {"variant": args.variant, "rank": rank, "cpu_step_times": cpu_timed}
    result["cpu_median"] = statistics.median(cpu_timed)
    if rank == 0:
        result.update(step_times=timed, median=statistics.median(timed))
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)


def pin(args: argparse.Namespace, rank: int) -> None:
    """Keep the calling thread (a rank's main thread, which computes) on the ``rank``-th allowed core, if there is
    one per rank. Call it once the process groups exist: their communication threads, started before, stay free to
    run on any core, as they are without pinning. Without it the scheduler moves the ranks between the two cores of
    the development machine, and runs of the same variant differ by up to 10%. Every rank pins itself after its
    ranks were started, so each starts with all the allowed cores."""
    if not args.pin or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if rank < len(cores):
        os.sched_setaffinity(0, [cores[rank]])  # 0: the calling thread (Linux)


# --------------------------------------------------------------------------------- (a) and (c): Lightning
class StepTimer(L.Callback):
    """Records wall-clock and CPU time at every training-step start; each rank writes them when training ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.starts: list[float] = []
        self.cpu: list[float] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pin(self.args, trainer.global_rank)  # after the strategy's setup, which makes the process groups

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.starts.append(time.perf_counter())  # the end of the last step
        self.cpu.append(time.process_time())
        write_result(self.args, trainer.global_rank, self.starts, self.cpu)


def run_lightning(args: argparse.Namespace) -> None:
    extra: dict[str, Any] = {"accelerator": "cpu", "devices": 1}
    if args.variant in STRATEGY_BALANCE:
        from lightning_pipe import PipelineStrategy

        # into the run's own directory: the parent keeps the files of the run that counts
        timeline = {"step": 3, "dirpath": os.path.dirname(args.out)} if args.variant == "time" else None
        auto = args.variant == "auto"
        if auto:  # its trial steps (every candidate, timed) are warm-up here; it searches the microbatch count too
            from lightning_pipe._step.auto import EXTRA, LEAD, STEPS, TIMED, WARMUP

            args.warmup += LEAD + (TIMED + EXTRA) * (WARMUP + STEPS)  # the most it can take
        strategy = PipelineStrategy(
            num_microbatches="auto" if auto else args.num_microbatches, schedule="auto" if auto else "1F1B",
            balance=STRATEGY_BALANCE[args.variant], timeline=timeline, compile=bool(args.compile),
        )
        extra = {"accelerator": "cpu", "devices": 2, "strategy": strategy}
    trainer = L.Trainer(
        max_steps=args.warmup + args.steps,
        callbacks=[StepTimer(args)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **extra,
    )
    trainer.fit(make_model(args), train_dataloaders=make_train_loader(args))


# --------------------------------------------------------------------------------- (a'): microbatches in a row
def run_microbatched(args: argparse.Namespace) -> None:
    model = make_model(args, lightning=False)
    for module in model.backbone if args.compile else ():
        module.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    starts, cpu = [], []
    for x, y in make_train_loader(args):
        starts.append(time.perf_counter())
        cpu.append(time.process_time())
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(args.num_microbatches), y.chunk(args.num_microbatches)):
            loss = F.cross_entropy(model.backbone(xs).flatten(0, 1), ys.flatten()) / args.num_microbatches
            loss.backward()
        optimizer.step()
        if len(starts) == args.warmup + args.steps:
            break
    starts.append(time.perf_counter())
    cpu.append(time.process_time())
    write_result(args, 0, starts, cpu)


# --------------------------------------------------------------------------------- (b): hand-written 1F1B
def torch_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    pin(args, rank)  # after the process group, as the strategy's ranks: gloo's threads stay free
    backbone = make_model(args, lightning=False).backbone
    split = stage0_modules(args)
    module = backbone[:split] if rank == 0 else backbone[split:]
    for part in module if args.compile else ():
        part.compile()
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = Schedule1F1B(stage, n_microbatches=args.num_microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr)
    starts, cpu = [], []
    for x, y in make_train_loader(args):  # both ranks draw the same batches: rank 0 feeds x, rank 1 scores y
        starts.append(time.perf_counter())
        cpu.append(time.process_time())
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:  # the loss is all the last stage needs: merging the logits of every microbatch would waste 45 ms
            schedule.step(target=y, return_outputs=False)
        optimizer.step()
        if len(starts) == args.warmup + args.steps:
            break
    starts.append(time.perf_counter())
    cpu.append(time.process_time())
    write_result(args, rank, starts, cpu)
    dist.destroy_process_group()


def run_torch(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(torch_worker, args=(args, port), nprocs=2, join=True)


# --------------------------------------------------------------------------------- parent
def run_variant(variant: str, flags: list[str], env: dict[str, str], timeout: int, label: str) -> dict[str, Any]:
    """One variant in its own subprocess; rank 0's result with every rank's CPU seconds, and what it logged."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), f"--variant={variant}", f"--out={out}", *flags]
        print(f"{label} running {variant}: {' '.join(cmd[1:])}", flush=True)
        begin = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        ranks = sorted(n for n in os.listdir(tmp) if n.startswith("result.json.rank"))
        if proc.returncode != 0 or "result.json.rank0" not in ranks:
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            sys.exit(f"variant {variant!r} failed (exit {proc.returncode}):\n{tail}")
        per_rank = []
        for name in ranks:
            with open(os.path.join(tmp, name)) as f:
                per_rank.append(json.load(f))
        timeline_files = {}
        for name in ("timeline.json", "timeline.png"):
            if os.path.exists(os.path.join(tmp, name)):
                with open(os.path.join(tmp, name), "rb") as f:
                    timeline_files[name] = f.read()
    result = per_rank[0]
    chosen = re.search(r"Keeping (schedule=.*?); pass", proc.stdout + proc.stderr)
    if chosen:
        result["auto_choice"] = chosen.group(1)
    result["_timeline_files"] = timeline_files
    result["cpu_per_rank_median"] = [r["cpu_median"] for r in per_rank]
    result["cpu_median_all_ranks"] = sum(r["cpu_median"] for r in per_rank)
    result["wall_s"] = round(time.perf_counter() - begin, 1)
    log = proc.stdout + proc.stderr
    bubble = re.search(r"measured bubble ([0-9.]+)%", log)
    if bubble:
        result["timeline_bubble"] = float(bubble.group(1)) / 100
    costs = re.search(r"forward\+backward ms per (?:module|block): ([0-9., ]+)", log)
    if costs:
        result["module_ms"] = [float(c) for c in costs.group(1).split(",")]
    return result


def whole_module_bound(module_ms: list[float], p: int) -> float:
    """How much slower than a perfect split the best contiguous split of these module times is: the slowest stage
    of the best split over the mean stage."""
    from lightning_pipe.partition import make_layout

    layout = make_layout(module_ms, p, balance="time")  # the split balance="time" makes
    slowest = max(sum(module_ms[start:stop]) for start, stop in layout.bounds)
    return slowest / (sum(module_ms) / p)


def run_all(args: argparse.Namespace) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if args.steady_memory:
        for key, value in STEADY_MEMORY.items():
            env.setdefault(key, value)
    skip = ("variant", "out", "rounds", "steady_memory", "pin")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]
    flags.append("--pin" if args.pin else "--no-pin")
    results: dict[str, dict] = {}
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            result = run_variant(variant, flags, env, args.timeout, f"round {round_ + 1}/{args.rounds}")
            result["round_medians"] = results.get(variant, {}).get("round_medians", []) + [result["median"]]
            if variant not in results or result["median"] < results[variant]["median"]:
                results[variant] = result
            else:
                results[variant]["round_medians"] = result["round_medians"]

    med = {v: results[v]["median"] for v in VARIANTS}
    cpu = {v: results[v]["cpu_median_all_ranks"] for v in VARIANTS}
    p, m = 2, args.num_microbatches
    ceiling = med["microbatched"] / p * (m + p - 1) / m
    module_ms = results["time"].get("module_ms")
    split_excess = whole_module_bound(module_ms, p) if module_ms else None
    ratios = {
        "strategy_over_torch": med["strategy"] / med["torch"],
        "strategy_over_torch_cpu": cpu["strategy"] / cpu["torch"],
        "strategy_over_torch_by_round": [
            c / b for b, c in zip(results["torch"]["round_medians"], results["strategy"]["round_medians"])
        ],
        "single_over_strategy": med["single"] / med["strategy"],
        "single_over_torch": med["single"] / med["torch"],
        "time_over_ceiling": med["time"] / ceiling,
        "whole_module_bound_over_ceiling": split_excess,
        "torch_over_time": med["torch"] / med["time"],
        "uniform_over_time": med["strategy"] / med["time"],
        "uniform_over_parameters": med["strategy"] / med["parameters"],
        "default_over_auto": med["strategy"] / med["auto"],
        "ideal_bubble": (p - 1) / (m + p - 1),
        "measured_bubble": results["time"].get("timeline_bubble"),
    }
    print()
    print(
        f"model: dim {args.dim}, vocab {args.vocab_size}, {args.n_layers} layers, seq {args.seq_len}, batch"
        f" {args.batch_size}, {args.num_microbatches} microbatches; {args.steps} timed steps after {args.warmup}"
        f" warm-up; 1 thread per process; {os.cpu_count()} CPUs, load average {load_before[0]:.1f} at start"
    )
    print(f"best of {args.rounds} interleaved runs per variant (lowest median); run medians in results.json")
    print(f"{'variant':48s} {'median s/step':>13s} {'p10':>7s} {'p90':>7s} {'CPU s/step':>18s} {'run s':>6s}")
    for v, label in VARIANTS.items():
        times = sorted(results[v]["step_times"])
        p10, p90 = times[len(times) // 10], times[(9 * len(times)) // 10]
        per_rank = "+".join(f"{c:.3f}" for c in results[v]["cpu_per_rank_median"])
        print(f"{label:48s} {med[v]:13.4f} {p10:7.4f} {p90:7.4f} {per_rank:>18s} {results[v]['wall_s']:6.1f}")
    ceiling_label = "ceiling: (a') / p * (m + p - 1) / m"
    print(f"{ceiling_label:48s} {ceiling:13.4f}")
    if split_excess is not None:
        bound_label = "whole-module bound: ceiling * best split's excess"
        print(f"{bound_label:48s} {ceiling * split_excess:13.4f}")
    print(
        f"strategy / hand-written torch, same split (c)/(b): {ratios['strategy_over_torch']:.3f}x (>1: integration"
        f" overhead; in CPU seconds summed over ranks {ratios['strategy_over_torch_cpu']:.3f}x)"
    )
    pairs = ", ".join(f"{c / b:.3f}" for b, c in zip(*(results[v]["round_medians"] for v in ("torch", "strategy"))))
    print(f"  the same, round by round: {pairs}")
    print(f"speed-up over one process                 (a)/(c): {ratios['single_over_strategy']:.3f}x")
    print(f"speed-up of hand-written torch            (a)/(b): {ratios['single_over_torch']:.3f}x")
    print(f"balance=time over the ceiling             (e)/ceiling: {ratios['time_over_ceiling']:.3f}x")
    if split_excess is not None:
        print(f"best whole-module split over the ceiling  (profiled by (e)): {split_excess:.3f}x")
    print(f"balance=time against hand-written uniform (b)/(e): {ratios['torch_over_time']:.3f}x")
    print(f"uniform / time, uniform / parameters      (c)/(e), (c)/(d): {ratios['uniform_over_time']:.3f}x,"
          f" {ratios['uniform_over_parameters']:.3f}x")
    print(f"the default (1F1B) over schedule='auto'   (c)/(f): {ratios['default_over_auto']:.3f}x (>1: auto is faster;"
          f" it kept {results['auto'].get('auto_choice')})")
    if ratios["measured_bubble"] is not None:
        print(f"bubble measured by timeline= (step 3 of (e)): {ratios['measured_bubble']:.1%};"
              f" (p-1)/(m+p-1) = {ratios['ideal_bubble']:.1%}")
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("variant", "out")},
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": load_before,  # 1, 5, 15 minutes; above the CPU count, the timings are contended
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            "lightning": L.__version__,
            "python": platform.python_version(),
            "pinned": args.pin,
            "memory_settings": {key: env.get(key) for key in STEADY_MEMORY},
        },
        "median_step_s": med,
        "median_cpu_s_all_ranks": cpu,
        "ratios": ratios,
        "variants": results,
    }
    for name, data in results["time"].pop("_timeline_files", {}).items():  # the counted run's, as its figures
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
    for result in results.values():
        result.pop("_timeline_files", None)
    path = os.path.join(HERE, "results.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="all", choices=["all", *VARIANTS])
    p.add_argument("--out", default=None, help="(internal) where a variant writes its result")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=16384, help="well above --dim: a head heavier than one block")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--compile", type=int, default=0, help="1: every module of the backbone compiled (Inductor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="runs of every variant, interleaved; the fastest counts")
    p.add_argument("--timeout", type=int, default=600, help="seconds allowed per variant")
    p.add_argument("--steady-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="run the variants with the environment STEADY_MEMORY sets (unless already set)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin rank r's main thread to the r-th allowed core, where there is one per rank")
    args = p.parse_args()
    if args.batch_size % args.num_microbatches:
        p.error(f"--num-microbatches {args.num_microbatches} must divide --batch-size {args.batch_size}.")
    if args.n_layers < 2:
        p.error("--n-layers must be at least 2: each stage gets half of the blocks.")
    if args.variant == "all":
        return run_all(args)
    if args.out is None:
        p.error("--out is required with --variant.")
    torch.set_num_threads(1)
    if args.variant == "microbatched":  # the others pin their ranks once the process groups exist
        pin(args, 0)
    {"torch": run_torch, "microbatched": run_microbatched}.get(args.variant, run_lightning)(args)


if __name__ == "__main__":
    main()
