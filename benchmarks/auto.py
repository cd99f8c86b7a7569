"""``schedule="auto"`` against every schedule set explicitly, on the costed model of ``benchmarks/costed.py``.

Blocks sleep fixed forward, input-gradient and weight-gradient times (4 processes behave like 4 devices). For each cost
setting (the weight gradient equal to the forward, and near zero), every schedule runs with its default stages per
process and ``--num-microbatches``, then ``schedule="auto"`` with the same count; then, with the costs per row of the
microbatch (``--per-row-ms``), ``schedule="auto"`` searches the count too, against 1F1B and the auto choice's schedule
at 4, 8 and 16 microbatches. Step times are medians after warm-up (for auto: after its choice). Results go to
``benchmarks/auto_results.json``.

    python benchmarks/auto.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import lightning as L
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from costed import ALL, Costed, _Starts  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402
from lightning_pipe._step.auto import EXTRA, LEAD, STEPS, TIMED, WARMUP  # noqa: E402
from lightning_pipe.schedules import SCHEDULES  # noqa: E402

TRIAL = LEAD + (TIMED + EXTRA) * (WARMUP + STEPS)  # the most steps auto times candidates on


def run(args: argparse.Namespace) -> None:
    """One fit on ``--pp`` processes; rank 0 writes the step starts and what ran."""
    torch.set_num_threads(1)
    auto = args.schedule == "auto"
    kwargs: dict[str, Any] = {"schedule": args.schedule}
    if not auto:
        kwargs["stages_per_rank"] = 2 if SCHEDULES[args.schedule].multi_stage else 1
    kwargs["num_microbatches"] = args.num_microbatches if args.num_microbatches > 0 else "auto"
    steps = args.warmup + args.steps + (TRIAL if auto else 0)  # auto: its median counts steps after the choice
    torch.manual_seed(0)
    per_row = args.per_row_ms is not None
    f, i, w = (args.per_row_ms if per_row else (args.forward_ms, args.input_grad_ms, args.weight_grad_ms))
    model = Costed(args.pp * 2, args.dim, f, i, w, per_row=per_row)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch_size, args.dim, generator=g), torch.randn(args.batch_size, args.dim, generator=g))
            for _ in range(steps)]
    starts = _Starts()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.pp, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[starts], use_distributed_sampler=False,
        strategy=PipelineStrategy(pipeline_parallel_size=args.pp, check_data_every_n_batches=None, **kwargs),
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    if trainer.global_rank == 0:
        runtime = trainer.strategy._runtime
        step_times = [b - a for a, b in zip(starts.starts, starts.starts[1:])]
        skip = runtime.trial_steps + args.warmup
        with open(args.out, "w") as fh:
            json.dump({"step_s": statistics.median(step_times[skip:]), "schedule": trainer.strategy.schedule,
                       "num_microbatches": runtime.microbatches.requested}, fh)


def _variant(args: argparse.Namespace, schedule: str, num_microbatches: int, per_row: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--variant=run", f"--schedule={schedule}", f"--out={out}",
               f"--num-microbatches={num_microbatches}", f"--pp={args.pp}", f"--dim={args.dim}",
               f"--batch-size={args.batch_size}", f"--forward-ms={args.forward_ms}",
               f"--input-grad-ms={args.input_grad_ms}", f"--weight-grad-ms={args.weight_grad_ms}",
               f"--warmup={args.warmup}", f"--steps={args.steps}"]
        if per_row:
            cmd.append("--per-row-ms=" + ",".join(str(x) for x in args.per_row_ms))
        proc = subprocess.run(cmd, cwd=tmp, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.exit(f"{schedule} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(out) as fh:
            result = json.load(fh)
        table = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines()
                 if line.startswith(("*  ", "   ")) and " ms" in line]
        if table:
            result["table"] = table
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="all", choices=["all", "run"])
    p.add_argument("--schedule", default="auto")
    p.add_argument("--out")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=8, help="0: 'auto'")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--input-grad-ms", type=float, default=10.0)
    p.add_argument("--weight-grad-ms", type=float, default=10.0)
    p.add_argument("--per-row-ms", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="forward,input-grad,weight-grad ms per row, for the microbatch count search")
    p.add_argument("--parts", default="W = F,W near 0,microbatches",
                   help="which parts to run (comma-separated); the others keep their figures in the results file")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if args.variant == "run":
        return run(args)
    parts = [x.strip() for x in args.parts.split(",")]
    path = os.path.join(HERE, "auto_results.json")
    results: dict[str, Any] = json.load(open(path)) if os.path.exists(path) and len(parts) < 3 else {}
    results["args"] = {k: v for k, v in vars(args).items() if k not in ("variant", "out", "parts")}
    m = args.num_microbatches
    for label, weight_ms in (("W = F", args.forward_ms), ("W near 0", 0.5)):
        if label not in parts:
            continue
        args.weight_grad_ms = weight_ms
        times = {s: _variant(args, s, m, False)["step_s"] for s in ALL}
        auto = _variant(args, "auto", m, False)
        fastest = min(times, key=times.get)  # type: ignore[arg-type]
        results[label] = {"explicit_s": times, "auto": auto, "fastest": fastest,
                          "auto_over_fastest": auto["step_s"] / times[fastest]}
        print(f"\n{label} (forward {args.forward_ms} ms, input gradient {args.input_grad_ms} ms, weight gradient"
              f" {weight_ms} ms per block; pp{args.pp}, m={m})", flush=True)
        for s, t in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {s:<22}{t * 1e3:8.1f} ms", flush=True)
        print(f"  auto -> {auto['schedule']:<14}{auto['step_s'] * 1e3:8.1f} ms  ({auto['step_s'] / times[fastest]:.3f}"
              f" of the fastest, {fastest})", flush=True)
        print("\n".join("    " + line for line in auto.get("table", [])), flush=True)
    if args.per_row_ms is None:
        args.per_row_ms = [1.0, 1.0, 1.0]
    if "microbatches" not in parts:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)
        return
    auto = _variant(args, "auto", 0, True)
    counts = {}
    for schedule in dict.fromkeys(["1F1B", auto["schedule"]]):
        for count in (4, 8, 16):
            counts[f"{schedule} m={count}"] = _variant(args, schedule, count, True)["step_s"]
    best = min(counts, key=counts.get)  # type: ignore[arg-type]
    results["microbatches"] = {"explicit_s": counts, "auto": auto, "best": best,
                               "auto_over_best": auto["step_s"] / counts[best]}
    print(f"\nper row {args.per_row_ms} ms (batch {args.batch_size}): auto searches the count too", flush=True)
    for k, t in sorted(counts.items(), key=lambda kv: kv[1]):
        print(f"  {k:<28}{t * 1e3:8.1f} ms", flush=True)
    print(f"  auto -> {auto['schedule']} m={auto['num_microbatches']}: {auto['step_s'] * 1e3:.1f} ms"
          f" ({auto['step_s'] / counts[best]:.3f} of the best, {best})", flush=True)
    print("\n".join("    " + line for line in auto.get("table", [])), flush=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
