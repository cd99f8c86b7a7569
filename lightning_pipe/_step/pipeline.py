"""The one module that talks to ``torch.distributed.pipelining``.

:class:`StagePipeline` owns this rank's stages and runs a whole batch through the chosen schedule, either with backward
(training) or forward-only (evaluation). Each stage is a :class:`StageModule`: the user's step run as that stage
(:meth:`~lightning_pipe._step.program.StepProgram.run_stage`). The schedule gets the batch's row numbers: split into
microbatches, they tell every stage which rows of the batch it works on (the first stage as its input, every stage as
the keyword argument ``lp_rows``, the last stage's loss as its target).

Stage shapes are given to torch statically: torch's own shape inference would update BatchNorm statistics and call
the loss on uninitialised data. A schedule is kept per (microbatch shape, count, mode), so a ragged last batch gets
its own correctly-shaped schedule instead of reusing stale buffers; a schedule whose step raised is dropped with its
stages, which that step left half-run.

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
them. :attr:`StagePipeline.shape_stats` counts the shapes met and what building their schedules cost.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleGPipe,
    ScheduleLoopedBFS,
    get_schedule_class,
)
from torch.utils._pytree import tree_leaves

from lightning_pipe import _watchdog
from lightning_pipe._compat.torch import keep_forward_actions
from lightning_pipe._step.program import StepProgram
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import ScheduleSpec
from lightning_pipe.timeline import TimelineRecorder

log = logging.getLogger(__name__)
_Meta = tuple[tuple[int, ...], torch.dtype]
#: ``probe(stage, rows, received) -> output``: a stage's output shape for an input shape, leaving no trace.
Probe = Callable[[int, torch.Tensor, Optional[_Meta]], _Meta]


#: Schedules a pipeline keeps (:class:`ScheduleCache`). Four holds the steady set of a fixed-length run without a
#: rebuild: training and evaluation batches, each with its ragged last batch. Beyond those, every kept schedule holds
#: one shape's receive buffers (at hidden 8192, 4096 tokens, bf16 and 16 one-row microbatches, about 2 GB), while
#: rebuilding an evicted schedule costs about a millisecond: its stage shapes are remembered ([Note: stage shapes]).
MAX_SCHEDULES = 4
#: Stage shapes a pipeline remembers (:meth:`StagePipeline._stage_metas`): a few hundred bytes each.
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
        self._kept: OrderedDict[tuple, Any] = OrderedDict()
        self._seen: set[tuple] = set()
        self.stats = ShapeStats(max_kept=max_kept)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: tuple) -> Optional[Any]:
        """The schedule kept for ``key``, now the most recently used, or ``None``."""
        schedule = self._kept.get(key)
        if schedule is not None:
            self._kept.move_to_end(key)
        return schedule

    def put(self, key: tuple, schedule: Any, probe_seconds: float, construct_seconds: float) -> list[tuple]:
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

    def drop(self, schedule: Any) -> None:
        """Forget ``schedule`` (its step raised), wherever it is kept."""
        keys = [key for key, kept in self._kept.items() if kept is schedule]
        for key in keys:
            del self._kept[key]
        self._count(dropped=len(keys))

    def _count(self, **added: float) -> None:
        stats = self.stats
        fields = {name: getattr(stats, name) + value for name, value in added.items()}
        self.stats = ShapeStats(**{**vars(stats), **fields, "kept": len(self._kept)})


class StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs for one stage: the user's step as that stage.

    It registers the parameters the stage uses (its blocks' and, for the first and last stage, those outside the
    backbone) so that torch computes their gradients in zero-bubble schedules; they stay the user's own objects.
    """

    def __init__(self, program: StepProgram, stage: int, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)
        self.stage = stage
        object.__setattr__(self, "_program", program)

    def forward(self, *inputs: torch.Tensor, lp_rows: torch.Tensor) -> torch.Tensor:
        received = inputs[0] if self.stage > 0 else None
        return self._program.run_stage(self.stage, lp_rows, received)


class StagePipeline:
    """This rank's pipeline stages and the schedules that drive them.

    Args:
        stage_modules: ``{stage_index: module}`` for the stages this rank runs.
        layout: the full stage layout, identical on every rank.
        schedule: the schedule to run.
        num_microbatches: microbatches per full batch.
        group: the process group of this pipeline (one replica).
        device: the device the stages run on.
        probe: runs a stage once, on ghosts, to learn its output shape (see [Note: stage shapes]).
        max_schedules: how many schedules (one per microbatch shape, count and mode) to keep; the least recently used
            is evicted beyond it, and built again when its shape comes back (see [Note: schedules kept per shape]).
    """

    def __init__(
        self,
        stage_modules: dict[int, StageModule],
        layout: StageLayout,
        schedule: ScheduleSpec,
        num_microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        probe: Probe,
        max_schedules: int = MAX_SCHEDULES,
    ) -> None:
        self.stage_modules = stage_modules
        self.layout = layout
        self.schedule = schedule
        self.schedule_class = get_schedule_class(schedule.name)
        self.num_microbatches = num_microbatches
        self.group = group
        self.device = device
        self.probe = probe
        self.pipeline_rank = dist.get_rank(group)
        self.first_stage_rank = layout.stage_rank(0)
        self.last_stage_rank = layout.stage_rank(layout.num_stages - 1)
        self._schedules = ScheduleCache(max_schedules)
        self._metas: OrderedDict[tuple, dict[int, tuple[_Meta, _Meta]]] = OrderedDict()  # see _stage_metas
        self._loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    @property
    def shape_stats(self) -> ShapeStats:
        """How many microbatch shapes this pipeline met, how many schedules it built and evicted, and what building
        them cost (a snapshot)."""
        return self._schedules.stats

    @property
    def has_first_stage(self) -> bool:
        return self.pipeline_rank == self.first_stage_rank

    @property
    def has_last_stage(self) -> bool:
        return self.pipeline_rank == self.last_stage_rank

    def check_schedule(self) -> None:
        """Build the schedule once for the configured microbatch count so torch's own checks run at setup."""
        self._make_schedule(self._make_stages(None, training=True), self.num_microbatches, training=True)

    # ------------------------------------------------------------------ running
    def train_step(
        self,
        sample: Any,
        batch_size: int,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        timeline: Optional[TimelineRecorder] = None,
    ) -> None:
        """Forward and backward of one batch of ``batch_size`` rows; gradients accumulate into ``.grad``.

        ``sample`` is microbatch 0 of the batch (its tensors' shapes select the schedule). ``loss_fn(output, rows)``
        gets the last stage's output of a microbatch and the batch rows it holds. With ``timeline``, the schedule's
        step is traced into it (:mod:`lightning_pipe.timeline`; a barrier over the pipeline group).
        """
        schedule = self._schedule_for(sample, batch_size, num_microbatches, training=True)
        rows = torch.arange(batch_size, device=self.device)
        self._loss_fn = loss_fn
        try:
            traced = timeline.trace(schedule) if timeline is not None else nullcontext()
            with self._dropped_if_it_fails(schedule), traced, _watchdog.waiting(lambda: self._transfers("training")):
                schedule.step(*self._first_input(rows), target=rows, lp_rows=rows, return_outputs=False)
        finally:
            self._loss_fn = None

    def eval_step(self, sample: Any, batch_size: int, num_microbatches: int) -> Optional[torch.Tensor]:
        """Forward-only pass of one batch. Returns the merged last-stage output on the last stage, else ``None``."""
        schedule = self._schedule_for(sample, batch_size, num_microbatches, training=False)
        rows = torch.arange(batch_size, device=self.device)
        with self._dropped_if_it_fails(schedule), _watchdog.waiting(lambda: self._transfers("evaluation")):
            output = schedule.eval(*self._first_input(rows), lp_rows=rows)
        return output if self.has_last_stage else None

    @contextmanager
    def _dropped_if_it_fails(self, schedule: Any) -> Iterator[None]:
        """Forget ``schedule`` and its stages if the block raises, so that the next batch of that shape builds new
        ones.

        A step that raises part-way leaves torch's stages in the middle of it: activations, gradients and stage-local
        hand-overs of unfinished microbatches (and on torch 2.15 receive buffers still owned by the step). Stepping
        them again fails, or silently loses gradients (ZBVZeroBubble), on every torch version. Rebuilding reuses the
        remembered stage shapes, with no collective (see [Note: stage shapes]), so a rank that failed and one that
        did not stay in step; whether a failed job goes on at all is the strategy's call (an exception in a stage
        ends it).
        """
        try:
            yield
        except BaseException:
            self._schedules.drop(schedule)
            raise

    def _transfers(self, step: str) -> str:
        """What this rank waits for inside a schedule step, for the watchdog's stall report."""
        layout, parts = self.layout, []
        for stage in layout.rank_stages(self.pipeline_rank):
            sources = []
            if stage > 0:
                sources.append(f"its input from stage {stage - 1} on pipeline rank {layout.stage_rank(stage - 1)}")
            if step == "training" and stage < layout.num_stages - 1:
                sources.append(
                    f"its output's gradient from stage {stage + 1} on pipeline rank {layout.stage_rank(stage + 1)}"
                )
            parts.append(f"stage {stage} ({' and '.join(sources) or 'nothing to receive'})")
        return (
            f"a {step} step to finish on pipeline rank {self.pipeline_rank} ({'; '.join(parts)}): if the stack below"
            " is in a transfer (`_wait_batch_p2p`), this rank waits for the one named; otherwise its own computation"
            " takes that long"
        )

    def _first_input(self, rows: torch.Tensor) -> tuple:
        return (rows,) if self.has_first_stage else ()

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    # ------------------------------------------------------------------ building
    def _schedule_for(self, sample: Any, batch_size: int, num_microbatches: int, training: bool) -> Any:
        rows = batch_size // num_microbatches
        shapes = tuple((tuple(t.shape), t.dtype) for t in tree_leaves(sample) if isinstance(t, torch.Tensor))
        key = (rows, shapes, num_microbatches, training, torch.is_autocast_enabled(self.device.type))
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._build(key, rows, num_microbatches, training)
        return schedule

    def _build(self, key: tuple, rows: int, num_microbatches: int, training: bool) -> Any:
        """Build and keep the schedule of a shape not kept, evicting the least recently used beyond the bound."""
        start = time.perf_counter()
        metas = self._stage_metas(key, rows)
        probed = time.perf_counter()
        schedule = self._make_schedule(self._make_stages(metas, training), num_microbatches, training)
        built = time.perf_counter()
        evicted = self._schedules.put(key, schedule, probed - start, built - probed)
        log.debug(
            "pipeline rank %d: new %s schedule for %d microbatches of %d rows (stage shapes %s): %.1f ms to probe"
            " the shapes, %.1f ms to construct (%d kept)",
            self.pipeline_rank, "training" if training else "evaluation", num_microbatches, rows, metas,
            1e3 * (probed - start), 1e3 * (built - probed), len(self._schedules),
        )
        for old in evicted:
            log.debug("pipeline rank %d: evicted the schedule of %s (kept at most %d)",
                      self.pipeline_rank, _describe(old), self._schedules.stats.max_kept)
        return schedule

    def _make_stages(self, metas: Optional[dict[int, tuple]], training: bool = True) -> list[PipelineStage]:
        stages = []
        num_stages = self.layout.num_stages
        for index, module in self.stage_modules.items():
            kwargs = {}
            if metas is not None:
                inputs, outputs = metas[index]
                kwargs = {
                    "input_args": (_meta_tensor(inputs, requires_grad=training and index > 0),),
                    "output_args": (_meta_tensor(outputs, requires_grad=training),),
                }
            stages.append(PipelineStage(module, index, num_stages, self.device, group=self.group, **kwargs))
        return stages

    def _make_schedule(self, stages: list[PipelineStage], num_microbatches: int, training: bool) -> Any:
        loss_fn = self._loss if training else None
        multi = self.schedule.multi_stage
        try:
            schedule = _construct(self.schedule_class, stages, num_microbatches, loss_fn, multi)
        except ValueError as err:
            if num_microbatches == self.num_microbatches or self.schedule.placement == "v":
                raise ValueError(
                    f"`PipelineStrategy(schedule={self.schedule.name!r}, num_microbatches={num_microbatches})` is"
                    f" not valid for {self.layout.num_stages} stages over {self.layout.pipeline_size} processes: {err}"
                    " Raise `num_microbatches` (many schedules need at least one per stage), or pick another schedule."
                ) from err
            # A ragged batch with fewer microbatches than the schedule needs runs through the all-forward,
            # all-backward order, which accepts any count; the arithmetic is the same.
            fallback = ScheduleLoopedBFS if multi else ScheduleGPipe
            rank_zero_info(
                f"PipelineStrategy: a batch split into {num_microbatches} microbatches is too small for"
                f" {self.schedule.name} ({err}); it runs with {fallback.__name__}, which gives the same result."
            )
            log.debug("pipeline rank %d: falling back to %s: %s", self.pipeline_rank, fallback.__name__, err)
            schedule = _construct(fallback, stages, num_microbatches, loss_fn, multi)
        if not training and self._has_local_hand_over():
            keep_forward_actions(schedule)  # torch's eval() cannot run these schedules (see _compat.torch)
        return schedule

    def _has_local_hand_over(self) -> bool:
        """Whether some stage feeds the next one on the same process (V placement; any multi-stage schedule on one
        process): torch's ``eval()`` cannot run such a pipeline (see
        :func:`~lightning_pipe._compat.torch.keep_forward_actions`)."""
        return any(
            self.layout.stage_rank(s) == self.layout.stage_rank(s + 1) for s in range(self.layout.num_stages - 1)
        )

    def _stage_metas(self, key: tuple, rows: int) -> dict[int, tuple[_Meta, _Meta]]:
        """Input and output shape of every local stage for the schedule ``key``, microbatches of ``rows`` rows
        (see [Note: stage shapes])."""
        shape = _shape_of(key)
        metas = self._metas.get(shape)
        if metas is not None:
            self._metas.move_to_end(shape)
            return metas
        guesses = self._guess_inputs(shape)
        metas = self._probe_at_once(rows, guesses) if guesses is not None else None
        if metas is None:
            metas = self._probe_in_order(rows)
        self._metas[shape] = metas
        if len(self._metas) > MAX_SHAPES_REMEMBERED:
            self._metas.popitem(last=False)
        return metas

    def _guess_inputs(self, shape: tuple) -> Optional[dict[int, _Meta]]:
        """The input shapes of the local stages for ``shape``, guessed from the last shape remembered whose sizes
        map one to one onto its sizes; ``None`` (the same on every rank) when there is none to guess from."""
        if self.layout.pipeline_size == 1:
            return None  # nothing to exchange: the stages are probed in order
        for old in reversed(self._metas):
            sizes = _size_map(old, shape)
            if sizes is not None:
                metas = self._metas[old]
                return {s: _resized(metas[s][0], sizes) for s in metas if s > 0}
        return None

    def _probe_at_once(self, rows: int, guesses: dict[int, _Meta]) -> Optional[dict[int, tuple[_Meta, _Meta]]]:
        """Probe the local stages on the guessed inputs, all ranks at once, and check the guesses against the
        gathered outputs; ``None`` (the same on every rank) when one was wrong."""
        sample_rows = torch.arange(rows, device=self.device)
        probed: dict[int, tuple[_Meta, Optional[_Meta]]] = {}
        for stage in sorted(self.stage_modules):
            if stage == 0:
                in_meta = ((rows,), sample_rows.dtype)
            else:
                in_meta = probed[stage - 1][1] if stage - 1 in probed else guesses[stage]
            try:
                out_meta = self.probe(stage, sample_rows, in_meta if stage > 0 else None) if in_meta else None
            except Exception as err:  # a wrong guess can fail a stage's real run; probed in order below
                log.debug("pipeline rank %d: stage %d failed on the guessed input %s: %s", self.pipeline_rank, stage,
                          in_meta, err)
                out_meta = None
            probed[stage] = (in_meta, out_meta)
        gathered: list[Any] = [None] * self.layout.pipeline_size
        what = (
            f"the stage shapes of the other pipeline ranks (the shape exchange before the first step with {rows}-row"
            f" microbatches; this is pipeline rank {self.pipeline_rank})"
        )
        with _watchdog.waiting(lambda: what):
            dist.all_gather_object(gathered, probed, group=self.group)
        found = {stage: meta for part in gathered for stage, meta in part.items()}
        right = all(
            found[s][1] is not None and (s == 0 or found[s][0] == found[s - 1][1])
            for s in range(self.layout.num_stages)
        )
        log.debug("pipeline rank %d: guessed stage inputs %s: %s", self.pipeline_rank, guesses,
                  "right" if right else "wrong, probing in order")
        return dict(probed) if right else None

    def _probe_in_order(self, rows: int) -> dict[int, tuple[_Meta, _Meta]]:
        """Walk the stages in order: the rank owning stage ``s`` learns its output shape (:attr:`probe`) and sends
        it to the pipeline, since it is the next stage's input."""
        metas: dict[int, tuple[_Meta, _Meta]] = {}
        sample_rows = torch.arange(rows, device=self.device)
        in_meta: _Meta = ((rows,), sample_rows.dtype)
        for stage in range(self.layout.num_stages):
            owner = self.layout.stage_rank(stage)
            out_meta: Optional[_Meta] = None
            if owner == self.pipeline_rank:
                out_meta = self.probe(stage, sample_rows, in_meta if stage > 0 else None)
            if self.layout.pipeline_size > 1 and stage < self.layout.num_stages - 1:
                box = [out_meta]
                what = (
                    f"the output shape of stage {stage} from pipeline rank {owner} (the stage-shape exchange before the"
                    f" first step with {rows}-row microbatches; this is pipeline rank {self.pipeline_rank})"
                )
                with _watchdog.waiting(lambda what=what: what):
                    dist.broadcast_object_list(box, group_src=owner, group=self.group)
                out_meta = box[0]
            if owner == self.pipeline_rank:
                assert out_meta is not None
                metas[stage] = (in_meta, out_meta)
            if out_meta is not None:
                in_meta = out_meta
        return metas


def _shape_of(key: tuple) -> tuple:
    """What a schedule key's stage shapes depend on: all of it but the microbatch count."""
    rows, shapes, _, training, autocast = key
    return rows, shapes, training, autocast


def _size_map(old: tuple, new: tuple) -> Optional[dict[int, int]]:
    """``{old size: new size}`` over the rows and the sample's dimensions of two shape keys, or ``None`` if they
    differ in mode, tensors, ranks or dtypes, or an old size would map to two new ones."""
    (old_rows, old_shapes, *old_mode), (new_rows, new_shapes, *new_mode) = old, new
    layout = [(len(shape), dtype) for shape, dtype in old_shapes]
    if old_mode != new_mode or layout != [(len(shape), dtype) for shape, dtype in new_shapes]:
        return None
    sizes: dict[int, int] = {}
    old_sizes = [old_rows, *(d for shape, _ in old_shapes for d in shape)]
    new_sizes = [new_rows, *(d for shape, _ in new_shapes for d in shape)]
    for before, after in zip(old_sizes, new_sizes):
        if sizes.setdefault(before, after) != after:
            return None
    return sizes


def _resized(meta: _Meta, sizes: dict[int, int]) -> _Meta:
    shape, dtype = meta
    return tuple(sizes.get(d, d) for d in shape), dtype


def _describe(key: tuple) -> str:
    """A schedule key in words, for the log."""
    rows, shapes, num_microbatches, training, autocast = key
    mode = "training" if training else "evaluation"
    return f"{mode} with {num_microbatches} microbatches of {rows} rows, inputs {[list(s) for s, _ in shapes]}" + (
        " under autocast" if autocast else ""
    )


def _construct(cls: type, stages: list, n: int, loss_fn: Optional[Callable], multi: bool) -> Any:
    if multi:
        return cls(stages, n, loss_fn=loss_fn, scale_grads=False)
    if issubclass(cls, PipelineScheduleSingle) and len(stages) != 1:
        raise ValueError(f"{cls.__name__} runs one stage per process, got {len(stages)}.")
    return cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)


def _meta_tensor(meta: _Meta, requires_grad: bool) -> torch.Tensor:
    shape, dtype = meta
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad and dtype.is_floating_point)
