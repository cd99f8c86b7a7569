"""The runtime's own time per schedule action on one process, and where it goes.

Blocks that cost almost nothing (a 16×16 matrix product each), one process, ``PipelineStrategy`` under 1F1B with
``--microbatches`` microbatches, against two peers on the same model: a plain loop doing the same microbatches'
forward and backward back to back, and a hand-written ``torch.distributed.pipelining`` loop (the backbone as one
``PipelineStage``, torch's ``Schedule1F1B`` with the loss as its ``loss_fn``, SGD). The difference, per action (a
forward or a backward of one microbatch on one stage), is what the strategy adds: over the plain loop, with torch's
schedule and Lightning's own step counted against it; over the torch loop, without them. Then one run of the
strategy under cProfile, each function's own time (callees excluded; a builtin's time counted for the function that
called it) summed by the part of the package or of torch it belongs to, per action: the block runners, the stage
program (windows, skipped blocks, hand-over), loss weighting and its observer, log collection, the runtime and
pipeline around torch's schedule, torch's schedule itself, and the rest (the user's code, torch's operators and
autograd, Lightning).

    python benchmarks/overhead.py --out benchmarks/overhead_results.json
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu import write_result  # the JSON printed and written, as the GPU benchmarks do

from lightning_pipe import PipelineStrategy

#: (group, path fragments): a function belongs to the first group one of whose fragments its file contains
GROUPS = [
    ("block runners", ("lightning_pipe/_calls/",)),
    ("stage program", ("lightning_pipe/_step/program.py", "lightning_pipe/_ghost.py", "lightning_pipe/_model/")),
    ("loss weighting", ("lightning_pipe/_step/loss_weights.py",)),
    ("log collection", ("lightning_pipe/_lightning/log.py", "lightning_pipe/_lightning/metrics.py")),
    ("runtime and pipeline", ("lightning_pipe/",)),
    ("torch's schedule", ("torch/distributed/pipelining/",)),
]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x @ self.weight


class Model(L.LightningModule):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[Block(dim) for _ in range(blocks)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.backbone(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Timer(L.Callback):
    def __init__(self, warmup: int, profile: cProfile.Profile | None) -> None:
        self.warmup, self.profile = warmup, profile
        self.times: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self.profile is not None and trainer.global_step == self.warmup:
            self.profile.enable()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        self.times.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: L.Trainer, *_: Any) -> None:
        if self.profile is not None:
            self.profile.disable()


def batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(args.batch_size, args.dim), torch.randn(args.batch_size, args.dim))
            for _ in range(args.warmup + args.steps)]


def plain(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = Model(args.blocks, args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for x, y in batches(args):
        start = time.perf_counter()
        for xs, ys in zip(x.chunk(args.microbatches), y.chunk(args.microbatches)):
            (F.mse_loss(model.backbone(xs), ys) / args.microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


def torch_loop(args: argparse.Namespace) -> float:
    """The hand-written torch.distributed.pipelining loop: one stage on this process, torch's 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if not torch.distributed.is_initialized():  # Lightning's later runs find it and keep it
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = Model(args.blocks, args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stage = PipelineStage(model.backbone, 0, 1, torch.device("cpu"))
    m = args.microbatches
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, y: F.mse_loss(out, y) / m, scale_grads=False)
    times = []
    for x, y in batches(args):
        start = time.perf_counter()
        schedule.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


def strategy(args: argparse.Namespace, profile: cProfile.Profile | None = None) -> float:
    torch.manual_seed(0)
    timer = Timer(args.warmup, profile)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        strategy=PipelineStrategy(num_microbatches=args.microbatches, check_data_every_n_batches=None),
    )
    trainer.fit(Model(args.blocks, args.dim), torch.utils.data.DataLoader(batches(args), batch_size=None))
    return statistics.median(timer.times[args.warmup:])


def _group(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    return next((name for name, parts in GROUPS if any(p in path for p in parts)), "user code, torch, Lightning")


def breakdown(profile: cProfile.Profile, actions: int) -> dict[str, float]:
    """Each group's own time in ms per action; a builtin's (``~``) time goes to the group of each caller."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, callers) in stats.items():
        if filename == "~":
            for (caller_file, _, _), (_, _, caller_own, _) in callers.items():
                group = _group(caller_file)
                out[group] = out.get(group, 0.0) + caller_own
        else:
            out[_group(filename)] = out.get(_group(filename), 0.0) + own
    return {k: round(v / actions * 1e3, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="the three runs, interleaved; the medians' median")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    plains, loops, strategies = [], [], []
    for _ in range(args.rounds):
        plains.append(plain(args))
        loops.append(torch_loop(args))
        strategies.append(strategy(args))
    actions = 2 * args.microbatches  # one stage: a forward and a backward per microbatch
    extra = [(s - q) / actions * 1e3 for s, q in zip(strategies, plains)]
    extra_loop = [(s - q) / actions * 1e3 for s, q in zip(strategies, loops)]
    profile = cProfile.Profile()
    strategy(args, profile)
    result = {
        "args": vars(args), "torch": torch.__version__,
        "plain_step_ms": [round(t * 1e3, 3) for t in plains],
        "torch_loop_step_ms": [round(t * 1e3, 3) for t in loops],
        "strategy_step_ms": [round(t * 1e3, 3) for t in strategies],
        "extra_ms_per_action": [round(e, 3) for e in extra],
        "extra_ms_per_action_median": round(statistics.median(extra), 3),
        "extra_over_torch_loop_ms_per_action": [round(e, 3) for e in extra_loop],
        "extra_over_torch_loop_ms_per_action_median": round(statistics.median(extra_loop), 3),
        "profiled_ms_per_action_by_part": breakdown(profile, actions * args.steps),
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
