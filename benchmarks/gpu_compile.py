"""Compiled stages on one CUDA device, in one run (issue 38): exact under the schedules that split the backward, and
timed against eager and against a hand-written ``torch.distributed.pipelining`` loop.

As in ``gpu.py``, the pipeline runs two stages on the one rank over a NCCL group of one (a GPU cannot host two NCCL
ranks). The model is the example Llama (``examples/llama.py``). Phases:

1. exactness, fp32 with SGD: the strategy under ``ZBVZeroBubble`` and ``DualPipeV`` with ``compile=True`` (Inductor,
   the linear layers' weight gradients deferred to the weight actions: [Note: deferred weight gradients]) against
   plain Lightning with eager blocks; losses and weights, max abs difference;
2. timing in bf16-mixed, median step after warm-up (the first steps pay the compile): plain Lightning, the
   hand-written loop (``ScheduleInterleaved1F1B``) and the strategy under ``Interleaved1F1B`` and ``ZBVZeroBubble``,
   each with eager and with compiled blocks. The eager rows are ``gpu.py``'s small-microbatch case;
3. dynamo's counters over the whole run.

    python benchmarks/gpu_compile.py --out benchmarks/gpu_compile_results.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import _median_step, fit, model_arguments, run_arguments, run_phases, torch_loop, write_result


def exactness(args: argparse.Namespace) -> dict[str, Any]:
    ref, ref_w = fit(args, False, "32-true", args.check_steps)
    out: dict[str, Any] = {"losses_single": ref.losses}
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        got, got_w = fit(args, True, "32-true", args.check_steps, compiled=True, schedule=schedule)
        out[schedule] = {
            "losses_compiled_pipeline": got.losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(ref.losses, got.losses)),
            "max_weight_diff": max(float((ref_w[k] - got_w[k]).abs().max()) for k in ref_w),
        }
        print("fp32", schedule, out[schedule]["max_loss_diff"], out[schedule]["max_weight_diff"], flush=True)
    return out


def timing(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.steps + 1
    out: dict[str, Any] = {}
    for compiled in (False, True):
        kind = "compiled" if compiled else "eager"
        record, _ = fit(args, False, "bf16-mixed", steps, compiled=compiled)
        out[f"single_{kind}_s"] = _median_step(record.starts, args.warmup)
        for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
            record, _ = fit(args, True, "bf16-mixed", steps, compiled=compiled, schedule=schedule)
            out[f"strategy_{schedule}_{kind}_s"] = _median_step(record.starts, args.warmup)
        out[f"torch_loop_{kind}_s"] = _median_step(torch_loop(args, steps, compiled=compiled), args.warmup)
        print({k: v for k, v in out.items() if kind in k}, flush=True)
    for kind in ("eager", "compiled"):
        out[f"strategy_vs_torch_loop_{kind}"] = out[f"torch_loop_{kind}_s"] / out[f"strategy_Interleaved1F1B_{kind}_s"]
    for name in ("single", "strategy_Interleaved1F1B", "strategy_ZBVZeroBubble", "torch_loop"):
        out[f"compile_speedup_{name}"] = out[f"{name}_eager_s"] / out[f"{name}_compiled_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    run_arguments(p, steps=15)
    args = p.parse_args()
    result = run_phases(args, (("exactness", exactness), ("timing", timing)))
    from torch._dynamo.utils import counters

    result["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
