"""Trace one step of a torch pipeline schedule in real processes (gloo, CPU), directly on torch's APIs.

Usage: ``python tests/timeline_job.py SCHEDULE OUT_DIR [--world 2] [--microbatches 4] [--width 32] [--layers 8]
[--batch 16] [--stages-per-rank 1] [--trace-first]``. Builds an ``nn.Sequential`` of Linear+Tanh blocks, splits it into
``world * stages_per_rank`` contiguous stages (stage ``s`` on rank ``s % world``, zig-zag for the V schedules),
runs one untraced step (set-up: shape inference, first transfers), one untraced reference step and one traced step
on the same batch (``--trace-first``: the traced step first, then the reference), and writes:

* ``OUT_DIR/rank<r>.json``: this rank's events and checks (wrappers gone afterwards, gradients unchanged by tracing);
* on rank 0 ``OUT_DIR/timeline.json`` (Chrome trace), ``OUT_DIR/timeline.png`` and ``OUT_DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def _load_timeline():
    """``lightning_pipe.timeline`` (its ``_recorder`` and ``_report``, and ``_compat``) without
    ``lightning_pipe/__init__`` (which imports Lightning, seconds per process); the modules only need torch."""
    package = types.ModuleType("lightning_pipe")
    package.__path__ = [str(ROOT / "lightning_pipe")]  # its submodules are found here; __init__.py is not run
    sys.modules["lightning_pipe"] = package
    return importlib.import_module("lightning_pipe.timeline")


timeline = _load_timeline()

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
WRAPPED = (
    "forward_one_chunk",
    "backward_one_chunk",
    "backward_weight_one_chunk",
    "get_fwd_recv_ops",
    "get_fwd_send_ops",
    "get_bwd_recv_ops",
    "get_bwd_send_ops",
)


def stage_ranks(num_stages: int, world: int, v: bool) -> list[int]:
    if v:  # rank r holds stages r and 2 * world - 1 - r
        return [s if s < world else 2 * world - 1 - s for s in range(num_stages)]
    return [s % world for s in range(num_stages)]


def worker(rank: int, world: int, port: int, cfg: dict) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        name = cfg["schedule"]
        spr = cfg["stages_per_rank"]
        num_stages = world * spr
        width, layers = cfg["width"], cfg["layers"]
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
        per = [layers // num_stages + (1 if s < layers % num_stages else 0) for s in range(num_stages)]
        bounds = [sum(per[:s]) for s in range(num_stages + 1)]
        owners = stage_ranks(num_stages, world, name in V_SCHEDULES)
        mine = [s for s in range(num_stages) if owners[s] == rank]
        stages = [PipelineStage(nn.Sequential(*blocks[bounds[s] : bounds[s + 1]]), s, num_stages, torch.device("cpu"))
                  for s in mine]
        cls = get_schedule_class(name)
        loss_fn = lambda out, target: (out - target).pow(2).mean()  # noqa: E731
        m = cfg["microbatches"]
        if issubclass(cls, PipelineScheduleMulti):
            schedule = cls(stages, m, loss_fn=loss_fn)
        else:
            schedule = cls(stages[0], m, loss_fn=loss_fn)
        x = torch.randn(cfg["batch"], width, generator=torch.Generator().manual_seed(1))
        y = torch.randn(cfg["batch"], width, generator=torch.Generator().manual_seed(2))
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y} if num_stages - 1 in mine else {}
        params = [p for st in stages for p in st.submod.parameters()]

        def step() -> list[torch.Tensor]:
            for p in params:
                p.grad = None
            schedule.step(*args, **kwargs)
            return [p.grad.clone() for p in params]

        post, wait = torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p
        recorder = timeline.TimelineRecorder()
        if cfg["trace_first"]:  # the schedule's set-up (first transfers, shapes) happens inside the traced step
            with recorder.trace(schedule):
                traced = step()
            reference = step()
        else:
            step()  # set-up step
            reference = step()
            with recorder.trace(schedule):
                traced = step()
        checks = {
            "grads_equal": all(torch.equal(a, b) for a, b in zip(reference, traced)),
            "stage_attrs_left": [n for st in stages for n in WRAPPED if n in vars(st)],
            "schedule_attrs_left": [n for n in ("_maybe_compute_loss",) if n in vars(schedule)],
            "helpers_restored": torch_schedules._batch_p2p is post and torch_schedules._wait_batch_p2p is wait,
            "stages": mine,
        }
        out = Path(cfg["out"])
        (out / f"rank{rank}.json").write_text(json.dumps({"events": recorder.events, "checks": checks}))
        all_events = timeline.gather_events(recorder.events)
        if rank == 0:
            timeline.write_chrome_trace(all_events, out / "timeline.json")
            summary = timeline.summarize(all_events, world)
            title = f"{name}: bubble {summary['bubble_fraction']:.1%}"
            timeline.write_png(all_events, out / "timeline.png", title=title)
            summary["ideal_bubble_fraction"] = timeline.ideal_bubble_fraction(world, m, spr)
            (out / "summary.json").write_text(json.dumps({"summary": summary, "events": all_events}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("schedule")
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--trace-first", action="store_true", help="trace the schedule's very first step")
    cfg = vars(parser.parse_args())
    Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
    # fork: the ranks inherit the imports instead of repeating them (no process group exists yet)
    args = (cfg["world"], free_port(), cfg)
    mp.start_processes(worker, args=args, nprocs=cfg["world"], join=True, start_method="fork")


if __name__ == "__main__":
    main()
