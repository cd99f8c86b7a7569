"""What a later stage pays per microbatch before its own blocks, with and without the ghost results kept by shape.

Every stage runs the user's step from its start: the code before the backbone on ghosts (what the first stage
computes for real) and every earlier block skipped. A Hugging Face-like step does a few operations on ghosts there
(the embedding, a scale, a position add); torch's meta kernels for them are Python. This times
``StepProgram.run_stage`` of the second of two stages on one process (no autograd, one thread), a model of
``--blocks`` tiny blocks with an embedding, a learned scale and a position table before them, once with
[Note: ghost results by shape] and once with it off, interleaved over ``--rounds`` rounds; and the first stage's run
(no ghosts) as the floor.

    python benchmarks/stage_prefix.py --out benchmarks/stage_prefix_results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu import write_result  # the JSON printed and written, as the GPU benchmarks do

from lightning_pipe import _ghost
from lightning_pipe._model.backbone import find_backbone
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.structure import analyze
from lightning_pipe._step.program import StepProgram
from lightning_pipe.partition import make_layout

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.ones(DIM))
        self.register_buffer("positions", torch.linspace(0, 1, SEQ * DIM).view(SEQ, DIM))
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(DIM, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x) * self.scale + self.positions[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(args.blocks)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(VOCAB, (BATCH, SEQ), generator=g), torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    backbone = find_backbone(model, "blocks")
    structure = analyze(model, backbone, model.training_step, (batch, 0), CPU, training=True)
    cut = Cut(model, backbone, structure, make_layout([1.0] * args.blocks, 1, 2))
    cut.keep_only(0, CPU)
    bounds = {s: cut.layout.bounds[s] for s in cut.layout.rank_stages(0)}
    program = StepProgram(model, cut.backbone, cut.structure, cut.flow, bounds, cut.window_swaps(0), CPU)
    rows = torch.arange(2, 4)
    kept_key = _ghost._cache_key

    def timed(stage: int, received: tuple, kept: bool) -> float:
        _ghost._cache_key = kept_key if kept else (lambda *_: None)
        try:
            for _ in range(20):
                program.run_stage(stage, rows, received)
            start = time.perf_counter()
            for _ in range(args.runs):
                program.run_stage(stage, rows, received)
            return (time.perf_counter() - start) / args.runs * 1e6
        finally:
            _ghost._cache_key = kept_key

    results: dict[str, list[float]] = {"first stage": [], "second stage, kept": [], "second stage, not kept": []}
    with torch.no_grad(), program.holding(model.training_step, batch, BATCH, 0):
        (first,) = program.run_stage(0, rows)
        for _ in range(args.rounds):
            results["first stage"].append(timed(0, (), True))
            results["second stage, not kept"].append(timed(1, (first,), False))
            results["second stage, kept"].append(timed(1, (first,), True))
    out = {
        "args": vars(args), "torch": torch.__version__,
        "us_per_run": {k: [round(v, 1) for v in vs] for k, vs in results.items()},
        "us_per_run_median": {k: round(statistics.median(vs), 1) for k, vs in results.items()},
    }
    write_result(out, args.out)


if __name__ == "__main__":
    main()
