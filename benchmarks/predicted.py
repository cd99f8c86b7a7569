"""The cost model against measurement: the step times ``benchmarks/costed.py`` measured, per schedule, beside what
``lightning_pipe.plan.simulate`` predicts from the same stage costs ([Note: schedule simulation]).

The costed model's blocks cost fixed wall times, so the stage costs are known; what the model does not know is the
runtime's own time per action (posting transfers over gloo, the schedule's bookkeeping). It is fitted on one
schedule (``--calibrate``, 1F1B by default: the least-squares per-action overhead that makes its prediction match)
and then used for all; ``--overhead`` sets it instead. Then the planner's own predictions (``search_plans``, what
``python -m lightning_pipe.plan`` prints) for the same configurations. No timing runs here: it reads
``costed_results.json``.

    python benchmarks/predicted.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_pipe.plan import StageCosts, search_plans, simulate
from lightning_pipe.schedules import SCHEDULES, textbook_bubble_fraction

HERE = Path(__file__).resolve().parent


def stage_costs(args: dict, schedule: str) -> list[StageCosts]:
    """The costed model's stages for ``schedule``: ``2 * pp * blocks_per_stage`` blocks over its stages."""
    v = 2 if SCHEDULES[schedule].multi_stage else 1
    pp, blocks = args["pp"], 2 * args["pp"] * args["blocks_per_stage"]
    per_stage = blocks // (pp * v)
    ms = 1e-3 * per_stage
    one = StageCosts(args["forward_ms"] * ms, args["input_grad_ms"] * ms, args["weight_grad_ms"] * ms)
    return [one] * (pp * v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(HERE / "costed_results.json"))
    p.add_argument("--calibrate", default="1F1B", help="the schedule the per-action overhead is fitted on")
    p.add_argument("--overhead", type=float, default=None, help="seconds per action, instead of fitting it")
    args = p.parse_args()
    results = json.loads(Path(args.results).read_text())
    run = results["args"]
    pp, m = run["pp"], run["num_microbatches"]
    schedules = [s for s in results if s != "args"]

    def predict(schedule: str, overhead: float) -> float:
        return simulate(schedule, pp, m, stage_costs(run, schedule), overhead=overhead).step_time

    overhead = args.overhead
    if overhead is None:  # the prediction grows linearly with the overhead: two points fit it
        measured = results[args.calibrate]["strategy_s"]
        base, slope = predict(args.calibrate, 0.0), predict(args.calibrate, 1e-3) - predict(args.calibrate, 0.0)
        overhead = max(0.0, (measured - base) / slope * 1e-3)
    print(f"pp{pp}, m={m}, {run['forward_ms']}/{run['input_grad_ms']}/{run['weight_grad_ms']} ms per block; "
          f"runtime overhead {overhead * 1e3:.2f} ms per action (fitted on {args.calibrate})")
    print(f"{'schedule':24s}{'no overhead':>12s}{'predicted':>11s}{'strategy':>10s}{'error':>8s}{'torch loop':>12s}"
          f"{'bubble':>8s}{'textbook':>10s}")
    for schedule in schedules:
        v = 2 if SCHEDULES[schedule].multi_stage else 1
        bare = simulate(schedule, pp, m, stage_costs(run, schedule))
        predicted = predict(schedule, overhead)
        measured = results[schedule]["strategy_s"]
        print(f"{schedule:24s}{bare.step_time * 1e3:10.0f}ms{predicted * 1e3:9.0f}ms{measured * 1e3:8.0f}ms"
              f"{(predicted - measured) / measured:+8.1%}{results[schedule]['torch_loop_s'] * 1e3:10.0f}ms"
              f"{bare.bubble:8.3f}{textbook_bubble_fraction(pp, m, v):10.3f}")
    planner(run, results, schedules, overhead)


def planner(run: dict, results: dict, schedules: list[str], overhead: float) -> None:
    """The planner's own predictions (``search_plans``, what ``python -m lightning_pipe.plan`` prints) for the same
    configurations: the blocks' costs per sample (a costed block costs its times per microbatch of ``batch / m``
    rows), their forward/input/weight split, and the fitted overhead as its ``microbatch_overhead`` (``o / 2`` per
    action)."""
    pp, m, batch = run["pp"], run["num_microbatches"], run["batch_size"]
    blocks = 2 * pp * run["blocks_per_stage"]
    rows = batch / m
    split = (run["forward_ms"], run["input_grad_ms"], run["weight_grad_ms"])
    cost = 1e-3 * sum(split) / rows  # seconds per sample of one block
    ideal = cost * blocks * batch / pp
    print(f"\nthe planner (search_plans, pp{pp}, batch {batch}, {blocks} blocks of {cost * 1e3:.2f} ms per sample,"
          f" split {split}, microbatch_overhead {2 * overhead / ideal:.5f})")
    print(f"{'schedule':24s}{'m':>4s}{'planner':>10s}{'strategy':>10s}{'error':>8s}{'ideal/time':>12s}")
    for schedule in schedules:
        plans = search_plans([cost] * blocks, batch, pp, pipeline_parallel_size=pp, schedules=[schedule],
                             cost_split=split, microbatch_overhead=2 * overhead / ideal)
        plan = next(p for p in plans if p.num_microbatches == m)
        measured = results[schedule]["strategy_s"]
        print(f"{schedule:24s}{m:4d}{plan.predicted_step_time * 1e3:8.0f}ms{measured * 1e3:8.0f}ms"
              f"{(plan.predicted_step_time - measured) / measured:+8.1%}{plan.efficiency:12.2f}")


if __name__ == "__main__":
    main()
