"""Stage shapes per microbatch shape, and the schedules kept per shape: the bookkeeping of
:class:`~lightning_pipe._step.pipeline.StagePipeline`.

[Note: stage shapes] A stage's shapes are found by running microbatch 0 through it once on ghosts
(:mod:`lightning_pipe._ghost`: no compute, nothing changes), the probe. A stage's input is the previous stage's
output, on another rank, so the first shape met is probed stage after stage, each output broadcast down the
pipeline. A later shape is probed on every rank at once: each stage's input is guessed from a remembered shape whose
sizes map one to one onto the new ones (sequence length 64 becomes 63 wherever it appears), and one all-gather
checks every guess against the output it stands for. A wrong guess (a size that only happened to equal the sequence
length) costs the in-order walk after it, never a wrong shape. Stage shapes are remembered per shape key
(:data:`MAX_SHAPES_REMEMBERED`), so a schedule rebuilt after eviction or a failed step runs neither probe nor
collective. What a rank decides (which path, which guess source) depends on the keys only, the same on every rank.

[Note: schedules kept per shape] On torch 2.13 and 2.14 a stage allocates receive buffers (activations forward,
gradients backward) for every microbatch when its schedule first steps, and holds them as long as the schedule
lives. Data padded per batch meets a new shape with nearly every batch, so the schedules are kept in a
least-recently-used cache of :data:`MAX_SCHEDULES` (:class:`ScheduleCache`). The key sequence is the batch sequence,
the same on every rank of a pipeline, so every rank builds and evicts the same schedules at the same step (building
runs collectives). An evicted schedule's stages and buffers are freed at once: nothing outside the cache refers to
them. :attr:`~lightning_pipe._step.pipeline.StagePipeline.shape_stats` counts the shapes met and what building
their schedules cost.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from lightning_pipe._calls.skipped import size_map_of_shapes

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    #: A schedule object of torch's (every schedule in ``lightning_pipe.schedules`` is one of torch's classes).
    _Schedule = Union[PipelineScheduleSingle, PipelineScheduleMulti]

#: A tensor's ``(shape, dtype)``: what a stage receives or returns, for one microbatch.
Meta = tuple[tuple[int, ...], torch.dtype]
#: What a stage boundary carries for one microbatch: one :data:`Meta` per tensor ([Note: stage boundaries]).
Metas = tuple[Meta, ...]


#: Schedules a pipeline keeps (:class:`ScheduleCache`). Four holds the steady set of a fixed-length run without a
#: rebuild: training and evaluation batches, each with its ragged last batch. Beyond those, every kept schedule holds
#: one shape's receive buffers (at hidden 8192, 4096 tokens, bf16 and 16 one-row microbatches, about 2 GB), while
#: rebuilding an evicted schedule costs about a millisecond: its stage shapes are remembered ([Note: stage shapes]).
MAX_SCHEDULES = 4
#: Stage shapes a pipeline remembers (``StagePipeline._stage_metas``): a few hundred bytes each.
MAX_SHAPES_REMEMBERED = 1024


@dataclass(frozen=True)
class ShapeStats:
    """What new microbatch shapes cost a pipeline so far (:attr:`StagePipeline.shape_stats`).

    A shape is a schedule key: microbatch shapes, microbatch count, training or evaluation, autocast. The counters
    add up: ``built == kept + evicted + dropped``, and ``built - shapes`` schedules were rebuilt for a shape met
    before (evicted, or dropped after a failed step).

    Attributes:
        shapes: distinct shapes met.
        built: schedules built.
        evicted: schedules evicted to keep at most ``max_kept``.
        dropped: schedules dropped because their step raised.
        kept: schedules kept now.
        max_kept: the bound on ``kept``.
        probe_seconds: time spent learning stage shapes (ghost passes and their exchange over the pipeline).
        construct_seconds: time spent constructing torch's stages and schedules.
    """

    shapes: int = 0
    built: int = 0
    evicted: int = 0
    dropped: int = 0
    kept: int = 0
    max_kept: int = MAX_SCHEDULES
    probe_seconds: float = 0.0
    construct_seconds: float = 0.0

    @property
    def build_seconds(self) -> float:
        """Time spent building schedules, probe and construction; a new schedule's first step adds torch's own
        set-up (a two-message vote over the pipeline and the receive buffers), which is timed with that step."""
        return self.probe_seconds + self.construct_seconds


class ScheduleCache:
    """The schedules of the shapes met last, least recently used first evicted (see [Note: schedules kept per shape]).

    A schedule, its stages and their receive buffers form no reference cycle, and nothing else holds them between
    steps: letting go of one frees it at once, without the cyclic garbage collector (``tests/test_shapes.py``).

    Args:
        max_kept: how many schedules to keep, at least 1.
    """

    def __init__(self, max_kept: int = MAX_SCHEDULES) -> None:
        if max_kept < 1:
            raise ValueError(f"`max_schedules={max_kept}` keeps no schedule; a step needs one: pass 1 or more.")
        self._kept: OrderedDict[tuple, _Schedule] = OrderedDict()
        self._seen: set[tuple] = set()
        self.stats = ShapeStats(max_kept=max_kept)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: tuple) -> Optional[_Schedule]:
        """The schedule kept for ``key``, now the most recently used, or ``None``."""
        schedule = self._kept.get(key)
        if schedule is not None:
            self._kept.move_to_end(key)
        return schedule

    def put(self, key: tuple, schedule: _Schedule, probe_seconds: float, construct_seconds: float) -> list[tuple]:
        """Keep a schedule just built for ``key``; returns the keys evicted to make room, oldest first."""
        new_shape = key not in self._seen
        self._seen.add(key)
        self._kept[key] = schedule
        evicted = []
        while len(self._kept) > self.stats.max_kept:
            evicted.append(self._kept.popitem(last=False)[0])
        self._count(
            shapes=int(new_shape), built=1, evicted=len(evicted),
            probe_seconds=probe_seconds, construct_seconds=construct_seconds,
        )
        return evicted

    def clear(self) -> None:
        """Forget every schedule (another schedule class runs from now on)."""
        self._kept.clear()
        self._count()

    def drop(self, schedule: _Schedule) -> None:
        """Forget ``schedule`` (its step raised), wherever it is kept."""
        keys = [key for key, kept in self._kept.items() if kept is schedule]
        for key in keys:
            del self._kept[key]
        self._count(dropped=len(keys))

    def _count(self, **added: float) -> None:
        stats = self.stats
        fields = {name: getattr(stats, name) + value for name, value in added.items()}
        self.stats = ShapeStats(**{**vars(stats), **fields, "kept": len(self._kept)})


def shape_of(key: tuple) -> tuple:
    """What a schedule key's stage shapes depend on: all of it but the microbatch count."""
    rows, shapes, _, *mode = key  # training, autocast, the blocks of a partial pass
    return rows, shapes, *mode


def size_map(old: tuple, new: tuple) -> Optional[dict[int, int]]:
    """``{old size: new size}`` over the rows and the sample's dimensions of two shape keys, or ``None`` if they
    differ in mode, tensors, ranks or dtypes, or an old size would map to two new ones."""
    (old_rows, old_shapes, *old_mode), (new_rows, new_shapes, *new_mode) = old, new
    if old_mode != new_mode or [dtype for _, dtype in old_shapes] != [dtype for _, dtype in new_shapes]:
        return None
    return size_map_of_shapes(
        [(old_rows,), *(shape for shape, _ in old_shapes)], [(new_rows,), *(shape for shape, _ in new_shapes)]
    )


def resized(meta: Meta, sizes: dict[int, int]) -> Meta:
    shape, dtype = meta
    return tuple(sizes.get(d, d) for d in shape), dtype


def describe_key(key: tuple) -> str:
    """A schedule key in words, for the log."""
    rows, shapes, num_microbatches, training, autocast, *_ = key
    mode = "training" if training else "evaluation"
    return f"{mode} with {num_microbatches} microbatches of {rows} rows, inputs {[list(s) for s, _ in shapes]}" + (
        " under autocast" if autocast else ""
    )
