"""The strategy's own cost per schedule, on a model whose blocks cost fixed wall times, against torch's schedule driven
by a hand-written loop over the same blocks, in one run.

Each block's forward sleeps ``--forward-ms``, its input-gradient ``--input-grad-ms`` (a custom autograd function around
the block's output) and its weight-gradient ``--weight-grad-ms`` (a hook on the weight's gradient, which zero-bubble
schedules compute apart from the input gradient and may defer). Sleeping holds no core, so 4 processes on 2 cores
behave like 4 devices and the schedules' bubbles show as they would on GPUs; the matrix products are tiny.

For each schedule: (a) the hand-written loop: ``PipelineStage`` per local stage (looped or V-shaped placement, as the
strategy places them), torch's schedule class, SGD, on ``--pp`` processes (``torch.multiprocessing``, gloo); (b)
``PipelineStrategy(schedule=...)`` on the same blocks, split and batches. Median step time after warm-up, and (b)/(a)
as speed. With ``--runs N`` each schedule runs N times in a row (the loop, then the strategy, each a launch of its
own) and every figure is the median over them; single runs of the same code move by 2 to 3%. Results go to
``benchmarks/costed_results.json``.

``--actions`` also times, in both variants, every stage action torch's schedule runs (``F`` forward, ``B`` backward
or input gradient, ``W`` weight gradient) and the step's *tail*: from the end of a step's last action on any rank to
rank 0's start of the next step, where the optimizer, Lightning's loop and the strategy's own per-step work run.
With 10 ms blocks, what an action takes beyond 10 ms per block is the code around it. Each stage's actions are also
timed apart (``F3``: stage 3's forwards), and the strategy's extra per stage's forward is printed.

``--trainer-defaults`` runs the strategy as a user's script would, under the Trainer's defaults (logger, progress bar,
model summary, checkpointing, the distributed sampler) and the strategy's (the batch check of
``check_data_every_n_batches``), instead of a bare Trainer; the loop stays as it is.

    python benchmarks/costed.py                                   # pp4, m=8, 10 ms each, every schedule
    python benchmarks/costed.py --schedules 1F1B --steps 5        # a quick look
    python benchmarks/costed.py --runs 3                          # the median of 3 runs per schedule
    python benchmarks/costed.py --actions                         # and where the difference is
    python benchmarks/costed.py --trainer-defaults                # the strategy as a user's script runs it
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_pipe import PipelineStrategy
from lightning_pipe.schedules import SCHEDULES

ALL = ["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward sleep: the block's forward and input-gradient cost."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()  # not a view: zero-bubble schedules detach stage outputs in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class CostedBlock(nn.Module):
    """``x + x @ w``, costing ``forward_ms`` forward, ``input_grad_ms`` for the input gradient and ``weight_grad_ms``
    for the weight gradient; with ``per_row``, those times per row of the microbatch (so that the microbatch count
    trades the bubble against nothing else)."""

    def __init__(self, dim: int, forward_ms: float, input_grad_ms: float, weight_grad_ms: float,
                 per_row: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.01)
        self.forward_s, self.input_grad_s = forward_ms / 1e3, input_grad_ms / 1e3
        self.per_row = per_row
        self._rows = 1
        weight_grad_s = weight_grad_ms / 1e3
        if weight_grad_s > 0:
            self.weight.register_hook(lambda grad: (time.sleep(weight_grad_s * self._rows), grad)[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if self.per_row else 1
        self._rows = rows
        return _Sleep.apply(x + x @ self.weight, self.forward_s * rows, self.input_grad_s * rows)


class Costed(L.LightningModule):
    def __init__(self, blocks: int, dim: int, forward_ms: float, input_grad_ms: float, weight_grad_ms: float,
                 lr: float = 0.01, per_row: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Sequential(
            *[CostedBlock(dim, forward_ms, input_grad_ms, weight_grad_ms, per_row) for _ in range(blocks)]
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.backbone(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _model(args: argparse.Namespace) -> Costed:
    torch.manual_seed(0)
    return Costed(args.pp * 2 * args.blocks_per_stage, args.dim, args.forward_ms, args.input_grad_ms,
                  args.weight_grad_ms)


def _batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = args.warmup + args.steps + 1
    return [(torch.randn(args.batch_size, args.dim, generator=g), torch.randn(args.batch_size, args.dim, generator=g))
            for _ in range(n)]


def _stage_indices(name: str, pp: int, rank: int) -> list[int]:
    spec = SCHEDULES[name]
    if not spec.multi_stage:
        return [rank]
    if spec.placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp]


def _num_stages(name: str, pp: int) -> int:
    return 2 * pp if SCHEDULES[name].multi_stage else pp


class _ActionTimes:
    """``--actions``: the start and end of every schedule step and stage action on this rank (torch's
    ``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``), in both variants alike, to
    ``<out>.actions<rank>``. One clock for every process (``time.perf_counter``: the system's monotonic clock)."""

    KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

    def __init__(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        self.records: list[tuple[str, float, float]] = []  # (kind, start, end); a stage action's kind names its stage
        for name, kind in self.KINDS.items():
            self._wrap(stage._PipelineStageBase, name, kind)
        for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
            self._wrap(cls, "step", "step")

    def _wrap(self, cls: type, name: str, kind: str) -> None:
        original, records = getattr(cls, name), self.records

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:  # "F3": a forward of stage 3
                records.append((kind if kind == "step" else f"{kind}{args[0].stage_index}", start, time.perf_counter()))

        setattr(cls, name, timed)

    def dump(self, out: str, rank: int) -> None:
        with open(f"{out}.actions{rank}", "w") as f:
            json.dump(self.records, f)


def _action_summary(out: str, pp: int, warmup: int) -> dict[str, float]:
    """Median ms of each action kind over every rank's timed steps, and of the tail: from the end of a step's last
    action anywhere to rank 0's start of the next step (the step's own work outside torch's schedule: the optimizer,
    Lightning's loop, the strategy's logs and batch set-up)."""
    ranks = []
    for rank in range(pp):
        with open(f"{out}.actions{rank}") as f:
            ranks.append(json.load(f))
    steps = [[(a, b) for kind, a, b in records if kind == "step"] for records in ranks]
    timed_from = [s[warmup][0] for s in steps]
    summary = {}
    kinds = sorted({k for records in ranks for k, _, _ in records if k != "step"}, key=lambda k: (k[0], int(k[1:])))
    for kind in ("F", "B", "W", *kinds):  # every stage's together, then each stage's
        durations = [b - a for r, records in enumerate(ranks) for k, a, b in records
                     if k != "step" and kind in (k, k[0]) and a >= timed_from[r]]
        if durations:
            summary[kind] = 1e3 * statistics.median(durations)
    n = min(len(s) for s in steps)
    ends = [max(s[i][1] for s in steps) for i in range(n)]
    summary["tail"] = 1e3 * statistics.median(steps[0][i + 1][0] - ends[i] for i in range(warmup, n - 1))
    return summary


# ------------------------------------------------------------------------------------------------ (a) torch loop
def torch_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.pp)
    times = _ActionTimes() if args.actions else None
    name, pp = args.schedule, args.pp
    blocks = list(_model(args).backbone)
    num_stages = _num_stages(name, pp)
    per = len(blocks) // num_stages
    indices = _stage_indices(name, pp, rank)
    parts = {i: nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in indices}
    stages = [PipelineStage(parts[i], i, num_stages, torch.device("cpu")) for i in indices]
    cls = get_schedule_class(name)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) / args.num_microbatches

    kwargs = dict(n_microbatches=args.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = cls(stages, **kwargs) if SCHEDULES[name].multi_stage else cls(stages[0], **kwargs)
    params = [p for part in parts.values() for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    has_first, has_last = 0 in indices, num_stages - 1 in indices
    starts = []
    for x, y in _batches(args):
        dist.barrier()
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        schedule.step(*([x] if has_first else []), **({"target": y} if has_last else {}), return_outputs=False)
        optimizer.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"starts": starts}, f)
    if times is not None:
        times.dump(out, rank)
    dist.destroy_process_group()


def run_torch(args: argparse.Namespace, out: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(torch_worker, args=(args, port, out), nprocs=args.pp, join=True)


# ------------------------------------------------------------------------------------------------ (b) strategy
class _Starts(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Any, *args: Any) -> None:
        self.starts.append(time.perf_counter())


class _Profile(Callback):
    """``--profile DIR``: cProfile of each rank's timed steps (after the warm-up), to ``DIR/rank<r>.prof``."""

    def __init__(self, directory: str, warmup: int) -> None:
        import cProfile

        self.directory, self.warmup, self.profile = directory, warmup, cProfile.Profile()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.profile.enable()

    def on_train_end(self, trainer: Any, *args: Any) -> None:
        self.profile.disable()
        os.makedirs(self.directory, exist_ok=True)
        self.profile.dump_stats(os.path.join(self.directory, f"rank{trainer.global_rank}.prof"))


def run_strategy(args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    spec = SCHEDULES[args.schedule]
    bare = {} if args.trainer_defaults else dict(check_data_every_n_batches=None)
    strategy = PipelineStrategy(
        pipeline_parallel_size=args.pp, schedule=args.schedule, num_microbatches=args.num_microbatches,
        stages_per_rank=2 if spec.multi_stage else 1, **bare,
    )
    starts = _Starts()
    times = _ActionTimes() if args.actions else None
    quiet = {} if args.trainer_defaults else dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                                  enable_model_summary=False, use_distributed_sampler=False)
    trainer = L.Trainer(accelerator="cpu", devices=args.pp, strategy=strategy, max_steps=len(_batches(args)), **quiet,
                        callbacks=[starts] + ([_Profile(args.profile, args.warmup)] if args.profile else []))
    trainer.fit(_model(args), torch.utils.data.DataLoader(_batches(args), batch_size=None))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"starts": starts.starts}, f)
    if times is not None:
        times.dump(out, trainer.global_rank)


# ------------------------------------------------------------------------------------------------ parent
def _median_step(starts: list[float], warmup: int) -> float:
    return statistics.median([b - a for a, b in zip(starts, starts[1:])][warmup:])


def _variant(args: argparse.Namespace, variant: str, schedule: str) -> tuple[float, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
                 if k not in ("schedules", "variant", "out", "schedule") and v is not None and v is not False]
        cmd = [sys.executable, os.path.abspath(__file__), f"--variant={variant}", f"--schedule={schedule}",
               f"--out={out}", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.exit(f"{variant} {schedule} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(out) as f:
            step = _median_step(json.load(f)["starts"], args.warmup)
        return step, _action_summary(out, args.pp, args.warmup) if args.actions else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="all", choices=["all", "torch", "strategy"])
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--schedules", default=",".join(ALL))
    p.add_argument("--out", default=None)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--blocks-per-stage", type=int, default=1, help="blocks per virtual stage")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--input-grad-ms", type=float, default=10.0)
    p.add_argument("--weight-grad-ms", type=float, default=10.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--profile", default=None, help="directory for a cProfile of each rank's timed steps (strategy)")
    p.add_argument("--runs", type=int, default=1,
                   help="runs per schedule, one after the other; each figure is then the median over them")
    p.add_argument("--actions", action="store_true",
                   help="also time each stage action (every stage's, and each stage's apart) and the step's tail, in"
                   " both variants (median ms)")
    p.add_argument("--trainer-defaults", action="store_true",
                   help="the strategy under the Trainer's and the strategy's defaults (logger, progress bar, model"
                   " summary, checkpointing, distributed sampler, the batch check) instead of a bare Trainer")
    args = p.parse_args()
    if args.variant == "torch":
        return run_torch(args, args.out)
    if args.variant == "strategy":
        return run_strategy(args, args.out)
    results = {"args": {k: v for k, v in vars(args).items() if k not in ("variant", "out", "schedule")}}
    print(f"{'schedule':<22}{'torch loop s':>14}{'strategy s':>12}{'speed':>8}", flush=True)
    actions = {}
    for schedule in [s.strip() for s in args.schedules.split(",") if s.strip()]:
        runs = []
        for _ in range(args.runs):  # each run: the loop, then the strategy, as separate launches
            torch_s, torch_actions = _variant(args, "torch", schedule)
            strategy_s, strategy_actions = _variant(args, "strategy", schedule)
            runs.append((torch_s, strategy_s, torch_s / strategy_s))
        torch_s, strategy_s, speed = (statistics.median(column) for column in zip(*runs))
        results[schedule] = {"torch_loop_s": torch_s, "strategy_s": strategy_s, "speed": speed}
        if args.runs > 1:
            results[schedule]["runs"] = [{"torch_loop_s": t, "strategy_s": st, "speed": sp} for t, st, sp in runs]
        if args.actions:  # the last run's
            actions[schedule] = results[schedule]["actions_ms"] = {"torch_loop": torch_actions,
                                                                   "strategy": strategy_actions}
        each = f"  ({', '.join(f'{sp:.3f}' for _, _, sp in runs)})" if args.runs > 1 else ""
        print(f"{schedule:<22}{torch_s:>14.4f}{strategy_s:>12.4f}{speed:>8.3f}{each}", flush=True)
    if actions:
        print(f"\n{'median ms per action; the tail':<48}{'F':>8}{'B':>8}{'W':>8}{'tail':>8}")
        for schedule, by_variant in actions.items():
            for variant, summary in by_variant.items():
                cells = "".join(f"{summary[k]:>8.2f}" if k in summary else f"{'-':>8}" for k in ("F", "B", "W", "tail"))
                print(f"{schedule:<22}{variant:<26}{cells}")
        print("\nmedian ms per stage's forward, the strategy's extra over the loop's")
        for schedule, by_variant in actions.items():
            loop, strategy = by_variant["torch_loop"], by_variant["strategy"]
            stages = [k for k in strategy if k.startswith("F") and len(k) > 1 and k in loop]
            print(f"{schedule:<22}" + " ".join(f"{k} {strategy[k] - loop[k]:+.2f}" for k in stages))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "costed_results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
