"""``PipelineStrategy(schedule="auto")``: the schedule, stages per process and microbatch count chosen by measurement.

[Note: configuration by measurement] Every schedule computes the same gradients (the tests hold each to 1e-5 of one
device), so which one runs is a question of speed and memory only, and the first training steps can try candidates
on real batches without changing what is trained.

1. **Predict** (at setup, :func:`predict`). Each block's forward, input-gradient and weight-gradient times and the
   bytes its forward saves are measured on one microbatch of the first batch (``_model/profile.py``). For every
   candidate (each schedule with its stages per process, times each microbatch count the batch splits into), the
   stages' costs are summed over the blocks the cut would give them, scaled to the candidate's microbatch size, and
   :func:`lightning_pipe._simulate.simulate` plays torch's order of actions for that schedule against them, with
   :data:`~lightning_pipe._simulate.ACTION_OVERHEAD_S` per action. The same play counts the microbatches each stage
   holds at once, which with the saved bytes and four copies of the parameters (weights, gradients, two optimizer
   moments) gives the peak memory of the fullest process (:func:`~lightning_pipe._simulate.peak_memory`). The planner
   (``plan/``) predicts with the same module and constants: one cost model below both. Candidates over
   ``max_memory`` (on a GPU, its memory if not given) are dropped.
2. **Cut** for the best prediction's placement (looped or V-shaped, its stages per process): one cut serves every
   schedule with that placement.
3. **Time** (:class:`Trial`) the best :data:`TIMED` candidates of that placement on the first training steps,
   :data:`WARMUP` + :data:`STEPS` each after :data:`LEAD` untimed, every rank the same candidate at the same step.
   The slowest rank's mean (an all-reduce) is a candidate's measured step time. The per-action time and the scale
   of the profiled times are refitted on them, and up to :data:`EXTRA` untimed candidates of the placement that the
   refitted model puts ahead are timed too; the fastest measured is kept for the rest of the run, and one table is
   logged with the explicit arguments that pin it.

Candidates of another placement would need another cut, so they are chosen between by prediction alone, and the table
says so. The choice is stored in checkpoints once kept (``auto`` in the stored layout), and a resume keeps it when
the checkpoint is loaded instead of timing again. With BatchNorm, whose statistics are per microbatch, the microbatch
count stays today's rule and only the schedule is searched. A model on the meta device at setup has nothing to time:
its blocks' parameter counts stand in.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist

from lightning_pipe._bytes import format_bytes
from lightning_pipe._calls.batch import batch_tensors
from lightning_pipe._compiled import compiled
from lightning_pipe._simulate import ACTION_OVERHEAD_S, StageCosts, peak_memory, simulate
from lightning_pipe._step.deferred_linear import undeferred_split_layers
from lightning_pipe._step.microbatches import default_num_microbatches, divisors, largest_divisor_at_most
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import SCHEDULE_NAMES, Config, schedule_spec

if TYPE_CHECKING:
    from lightning_pipe._calls.blocks import Backbone
    from lightning_pipe._lightning.options import PipelineOptions
    from lightning_pipe._model.profile import BlockCost
    from lightning_pipe._model.split import Analysis
    from lightning_pipe.partition import Size

log = logging.getLogger(__name__)

#: Candidates timed on the first training steps, and steps each: the first of a candidate builds its schedule. At
#: most ``EXTRA`` more are timed when the model refitted on those times puts them ahead. The run's first ``LEAD``
#: steps (the allocator and the data loader warming up) are not timed.
TIMED, WARMUP, STEPS, EXTRA, LEAD = 3, 1, 2, 2, 1
#: Microbatch counts tried at most, those nearest the default rule's count.
MAX_COUNTS = 5
#: Rows of the logged table: the timed candidates, then the best predicted of the others.
TABLE_ROWS = 10


@dataclass
class Candidate:
    """A configuration with its prediction and, once timed, its measurement (seconds, bytes)."""

    config: Config
    predicted: float
    idle: float
    memory: int
    measured: Optional[float] = None
    samples: list[float] = field(default_factory=list)
    peak: Optional[int] = None
    #: the prediction without the runtime's own work, and how it grows per second of that work per action: the timed
    #: steps fit the overhead ([Note: configuration by measurement])
    base: float = 0.0
    slope: float = 0.0
    calibrated: Optional[float] = None

    def at(self, overhead: float, scale: float = 1.0) -> float:
        return scale * self.base + self.slope * overhead


def predict(
    costs: Sequence[BlockCost],
    params: Sequence[float],
    pipeline_size: int,
    batch_size: int,
    layout_for: Callable[[int, str], StageLayout],
    *,
    num_microbatches: Size,
    stages_per_rank: int,
    fixed_count: bool,
    max_memory: Optional[int],
    schedules: Sequence[str] = SCHEDULE_NAMES,
) -> list[Candidate]:
    """Every candidate that fits, best predicted first (see [Note: configuration by measurement]).

    Args:
        costs: a :class:`~lightning_pipe._model.profile.BlockCost` per block.
        params: parameter bytes per block (those outside the blocks counted with the block whose stage holds them).
        layout_for: the cut's stage bounds for ``(stages_per_rank, style)``.
        num_microbatches: the user's count, or ``"auto"`` to search.
        stages_per_rank: for the looped multi-stage schedules.
        fixed_count: keep the default rule's count (BatchNorm).
        max_memory: bytes a process may hold, or ``None``.
        schedules: the schedules to weigh (compiled blocks: those that do not split the backward).
    """
    p = pipeline_size
    candidates, dropped = [], []
    for name in schedules:
        spec = schedule_spec(name)
        v = spec.fixed_stages_per_rank or stages_per_rank
        try:
            layout = layout_for(v, spec.placement)
        except ValueError:  # fewer blocks than stages
            continue
        for m in _counts(name, p, v, batch_size, num_microbatches, fixed_count=fixed_count):
            candidate = _predicted(Config(name, v, m), layout, costs, params, batch_size)
            (dropped if max_memory is not None and candidate.memory > max_memory else candidates).append(candidate)
    if not candidates and not dropped:
        raise ValueError(
            f"`PipelineStrategy(schedule='auto')`: no schedule accepts a batch of {batch_size} on {p} processes"
            f" ({num_microbatches!r} microbatches, {len(costs)} blocks). Use larger batches, fewer pipeline processes,"
            " or another `num_microbatches`."
        )
    if not candidates:
        least = min(dropped, key=lambda c: c.memory) if dropped else None
        raise ValueError(
            "`PipelineStrategy(schedule='auto')` found no configuration that fits"
            + (f" in {format_bytes(max_memory)} per process: the smallest needs {format_bytes(least.memory)}"
               f" ({least.config.arguments()})" if least is not None and max_memory is not None else "")
            + ". Raise `max_memory`, use more pipeline processes, or use smaller batches."
        )
    for c in dropped:
        log.debug("schedule='auto': %s needs %d bytes, over max_memory", c.config, c.memory)
    return sorted(candidates, key=lambda c: c.predicted)


def _counts(name: str, p: int, v: int, batch_size: int, requested: Size, fixed_count: bool) -> list[int]:
    spec = schedule_spec(name)
    if requested != "auto":  # a count that does not divide the batch runs as the largest below it that does
        return [requested] if spec.accepts(largest_divisor_at_most(batch_size, requested), p, v) else []
    try:
        default = default_num_microbatches(batch_size, p, v, name)
    except ValueError:
        return []
    if fixed_count:
        return [default]
    accepted = [d for d in divisors(batch_size) if spec.accepts(d, p, v)]
    return sorted(sorted(accepted, key=lambda d: abs(math.log(d / default)))[:MAX_COUNTS])


def _predicted(config: Config, layout: StageLayout, costs: Sequence[BlockCost], params: Sequence[float],
               batch_size: int) -> Candidate:
    m = largest_divisor_at_most(batch_size, config.num_microbatches)
    rows = batch_size // m
    stages, saved, held = [], [], []
    for start, stop in layout.bounds:
        blocks = costs[start:stop]
        scale = rows / blocks[0].rows
        stages.append(StageCosts(*(scale * sum(getattr(b, n) for b in blocks)
                                   for n in ("forward", "input_grad", "weight_grad"))))
        saved.append(scale * sum(b.saved_bytes for b in blocks))
        held.append(sum(params[start:stop]))
    run = simulate(config.schedule, layout.pipeline_size, m, stages, overhead=ACTION_OVERHEAD_S)
    base = simulate(config.schedule, layout.pipeline_size, m, stages).step_time
    ranks = [layout.rank_stages(r) for r in range(layout.pipeline_size)]
    memory = sum(peak_memory(ranks, run.in_flight, held, saved))
    return Candidate(config, run.step_time, run.bubble, int(memory), base=base,
                     slope=(run.step_time - base) / ACTION_OVERHEAD_S)


class Trial:
    """The first training steps of a ``schedule="auto"`` run: which candidate each step runs, and the choice.

    The best :data:`TIMED` candidates of the best prediction's placement are timed first. Their times (every rank's,
    the slowest counts: a collective, so every rank decides alike) fit the runtime's work per action, which the
    prediction only assumed; a candidate of the placement not timed yet that the refitted model puts ahead of the
    fastest measured is timed too, up to :data:`EXTRA` of them. The fastest measured is kept.

    Args:
        candidates: every predicted candidate, best first.
    """

    def __init__(self, candidates: list[Candidate], stand_ins: bool = False) -> None:
        self.candidates = candidates
        self.stand_ins = stand_ins  # the costs are stand-ins (parameter counts): the report says so
        self.placement = candidates[0].config.placement
        self.timed = [c for c in candidates if c.config.placement == self.placement][:TIMED]
        self.overhead: Optional[float] = None  # seconds per action, fitted on the timed steps
        self.scale = 1.0  # of the blocks' measured times (their stand-ins on the meta device), fitted with it
        self._step = 0
        self.chosen: Optional[Config] = None if len(self.timed) > 1 else self.timed[0].config

    @property
    def running(self) -> bool:
        return self.chosen is None

    @property
    def steps(self) -> int:
        return LEAD + len(self.timed) * (WARMUP + STEPS)

    def current(self) -> Config:
        return self.timed[min(max(self._step - LEAD, 0) // (WARMUP + STEPS), len(self.timed) - 1)].config

    def record(self, seconds: float, peak: Optional[int]) -> None:
        if self._step < LEAD:
            self._step += 1
            return
        candidate = self.timed[(self._step - LEAD) // (WARMUP + STEPS)]
        if (self._step - LEAD) % (WARMUP + STEPS) >= WARMUP:
            candidate.samples.append(seconds)
            if peak is not None:
                candidate.peak = max(candidate.peak or 0, peak)
        self._step += 1

    @property
    def finished(self) -> bool:
        """Whether every candidate queued so far is timed: time for :meth:`settle`."""
        return self._step >= self.steps

    def settle(self, device: torch.device) -> Optional[Config]:
        """Share the new times (a collective over every rank), refit the overhead, and either queue the candidates
        the refitted model puts ahead (``None``: go on timing) or choose the fastest measured."""
        new = [c for c in self.timed if c.measured is None]
        values = torch.tensor([v for c in new for v in (sum(c.samples) / len(c.samples), float(c.peak or -1))],
                              dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        for c, (t, peak) in zip(new, values.view(-1, 2).tolist()):
            c.measured, c.peak = t, (int(peak) if peak >= 0 else None)
        timed = [c for c in self.timed if c.measured is not None]
        # the blocks' scale is fitted too: what was profiled on one process before the cut may run at another speed in
        # the pipeline (threads, sharding, the other stages' load)
        self.scale, self.overhead = _fit(timed, free_scale=True)
        fastest = min(timed, key=lambda c: c.measured)  # type: ignore[arg-type,return-value]
        if self.overhead is not None:
            for c in self.candidates:
                c.calibrated = c.at(self.overhead, self.scale)
            extra = len(self.timed) - TIMED
            ahead = sorted((c for c in self.candidates if c.config.placement == self.placement and c.measured is None
                            and c.calibrated < fastest.measured), key=lambda c: c.calibrated)  # type: ignore
            if ahead and extra < EXTRA:
                self.timed.extend(ahead[: EXTRA - extra])
                return None
        self.chosen = fastest.config
        return self.chosen

    def table(self) -> str:
        """The logged table: every candidate, predicted and measured step time, idle fraction, peak memory."""
        assert self.chosen is not None
        rows = [("", "schedule", "v", "m", "predicted", "refitted", "measured", "idle", "memory (predicted)",
                 "peak (measured)")]
        others = [id(c) for c in self.candidates if c.measured is None][: TABLE_ROWS - len(self.timed)]
        shown = [c for c in self.candidates if c.measured is not None or id(c) in others]
        for c in shown:
            timed = c.measured is not None
            busy = (c.calibrated if c.calibrated is not None else c.predicted) * (1.0 - c.idle)
            idle = 1.0 - busy / c.measured if timed else c.idle  # type: ignore[operator]
            rows.append((
                "*" if c.config == self.chosen else "", c.config.schedule, str(c.config.stages_per_rank),
                str(c.config.num_microbatches), f"{c.predicted * 1e3:.1f} ms",
                f"{c.calibrated * 1e3:.1f} ms" if c.calibrated is not None else "-",
                f"{c.measured * 1e3:.1f} ms" if timed else "not timed",  # type: ignore[operator]
                f"{idle:.0%}", format_bytes(c.memory), format_bytes(c.peak) if c.peak is not None else "-",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        if len(shown) < len(self.candidates):
            lines.append(f"   ({len(self.candidates) - len(shown)} more untimed candidates, predicted slower)")
        return "\n".join(lines)


def _fit(timed: list[Candidate], free_scale: bool) -> tuple[float, Optional[float]]:
    """``(scale, overhead)`` with ``measured ≈ scale * base + overhead * slope`` in least squares: both when
    ``free_scale`` and two or more candidates were timed (the scale alone when a fit of both leaves the positive
    quadrant), else the overhead alone with the scale 1."""
    ys = [c.measured for c in timed]
    if free_scale and len(timed) >= 2:
        bb = sum(c.base**2 for c in timed)
        ss = sum(c.slope**2 for c in timed)
        bs = sum(c.base * c.slope for c in timed)
        by = sum(c.base * y for c, y in zip(timed, ys))  # type: ignore[operator]
        sy = sum(c.slope * y for c, y in zip(timed, ys))  # type: ignore[operator]
        det = bb * ss - bs * bs
        if det > 1e-12 * bb * ss:
            scale, overhead = (by * ss - sy * bs) / det, (sy * bb - by * bs) / det
            if scale > 0 and overhead >= 0:
                return scale, overhead
        if bb:  # all compute: the scale alone
            return max(by / bb, 0.0), 0.0
    den = sum(c.slope**2 for c in timed)
    if not den:
        return 1.0, None
    return 1.0, max(0.0, sum(c.slope * (y - c.base) for c, y in zip(timed, ys)) / den)  # type: ignore[operator]


def describe_choice(trial: Trial) -> str:
    assert trial.chosen is not None
    timed = sum(c.measured is not None for c in trial.candidates)
    fitted = (f" Fitted on those steps: {trial.overhead * 1e3:.2f} ms of the runtime's work per action (predicted"
              f" with {ACTION_OVERHEAD_S * 1e3:.2f} ms) and {trial.scale:.3g} x the blocks' profiled times; 'refitted'"
              " uses both." if trial.overhead is not None else "")
    if trial.stand_ins:
        fitted += " The blocks' times were parameter counts: the model was on the meta device at setup."
    return (
        f"PipelineStrategy(schedule='auto'): timed {timed} candidates of the best predicted placement on the first"
        f" {trial.steps} training steps ({LEAD} untimed, then {WARMUP} warm-up + {STEPS} timed each; the others are"
        f" predicted only, as they need another cut).{fitted} Keeping {trial.chosen.arguments()}; pass these to"
        f" `PipelineStrategy` to pin it. Idle is 1 - busy / step time, the busy time from the refitted model.\n"
        + trial.table()
    )


def profiled_config(options: PipelineOptions) -> Config:
    """The configuration whose microbatch size the blocks are profiled at (:class:`Chooser`'s ``measure``): the
    looped schedules' default; the prediction scales each candidate's times from it."""
    looped = schedule_spec("Interleaved1F1B")
    v = options.stages_per_rank if isinstance(options.stages_per_rank, int) else looped.default_stages_per_rank()
    return Config(looped.name, v, options.num_microbatches)


@dataclass
class Choice:
    """``schedule="auto"``'s configuration for one LightningModule: the one its cut was made for, then the one the
    timed steps kept (``decided``), which checkpoints store and later Trainer calls on the module run."""

    config: Config
    decided: bool = False


#: The choice of every module setup chose for in this process (kept while the module lives, as its cut is).
_choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def choice_of(module: torch.nn.Module) -> Optional[Choice]:
    """What ``schedule="auto"`` chose for ``module`` in an earlier Trainer call, if it did."""
    return _choices.get(module)


class Chooser:
    """What setup asks for ``schedule="auto"`` between the step's analysis and the cut: measure, predict, and the
    configuration to cut for (:class:`Choice`, kept per module); keeps the :class:`Trial` for the runtime.

    Args:
        options: the strategy's options.
        pipeline_size: processes per pipeline.
        measure: ``_model/profile.py``'s ``measure_backbone`` bound to the module and device, profiling at
            :func:`profiled_config`'s microbatch size.
        module: the LightningModule (BatchNorm keeps the microbatch count fixed).
        device: where training runs (on a GPU, its memory bounds the candidates unless ``max_memory`` does).
        fitting: whether the ``Trainer`` call trains; an evaluation alone runs today's defaults, untimed.
    """

    def __init__(
        self, options: PipelineOptions, pipeline_size: int,
        measure: Callable[..., Union[list[float], list[BlockCost]]], module: torch.nn.Module, device: torch.device,
        fitting: bool,
    ) -> None:
        self.options, self.pipeline_size, self.measure = options, pipeline_size, measure
        self.module, self.device, self.fitting = module, device, fitting
        self.trial: Optional[Trial] = None

    def __call__(self, analysis: Optional[Analysis], parameter_costs: list[float], *,
                 args: Optional[tuple] = None) -> tuple[Config, list[float]]:
        """The configuration to cut for and the costs to balance its stages with; ``args`` (the step's arguments,
        the batch first) stand in for the analysis's where it is ``None``."""
        config, costs = self._choose(analysis, parameter_costs, analysis.args if analysis is not None else args)
        _choices[self.module] = Choice(config)
        return config, costs

    def _choose(self, analysis: Optional[Analysis], parameter_costs: list[float],
                args: tuple) -> tuple[Config, list[float]]:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from lightning_pipe.partition import make_layout

        options, p = self.options, self.pipeline_size
        if not self.fitting:
            rank_zero_info("PipelineStrategy(schedule='auto'): an evaluation alone runs 1F1B; fit to choose.")
            return Config("1F1B", 1, options.num_microbatches), parameter_costs
        backbone = analysis.backbone if analysis is not None else None
        stand_ins = any(t.is_meta for t in self.module.parameters())
        if stand_ins:  # built on the meta device (`configure_model`): nothing to time before the cut
            measured = self._stand_ins(args, parameter_costs)
            rank_zero_info(
                "PipelineStrategy(schedule='auto'): the model is on the meta device until after the cut, so the"
                " prediction takes parameter counts for the blocks' times; the timed steps decide."
            )
        else:
            assert analysis is not None
            measured = self.measure(backbone, analysis.structure, analysis.step, args[0], rest=args[1:], detail=True)
        costs = [c.total for c in measured] if options.balance == "time" and not stand_ins else parameter_costs
        width = next((t.element_size() for t in self.module.parameters()), 4)
        batch_size = measured[0].batch_size
        batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.module.modules())
        budget = options.max_memory
        if budget is None and self.device.type == "cuda":  # the smallest device's, so that every rank agrees
            total = torch.tensor([torch.cuda.get_device_properties(self.device).total_memory], device=self.device)
            if dist.is_initialized():
                dist.all_reduce(total, op=dist.ReduceOp.MIN)
            budget = int(total.item())
        candidates = predict(
            measured, [c * width for c in parameter_costs], p, batch_size,
            lambda v, style: make_layout(costs, p, v, options.balance, style),
            num_microbatches=options.num_microbatches, stages_per_rank=profiled_config(options).stages_per_rank,
            fixed_count=batchnorm, max_memory=budget,
            schedules=_schedules_for(options, backbone),
        )
        self.trial = Trial(candidates, stand_ins=stand_ins)
        best = candidates[0].config
        rank_zero_info(
            f"PipelineStrategy(schedule='auto'): {len(candidates)} candidates predicted for batches of {batch_size};"
            f" cutting for {best.schedule}'s placement ({best.stages_per_rank} stages per process); timing"
            f" {', '.join(f'{c.config.schedule} (m={c.config.num_microbatches})' for c in self.trial.timed)} on the"
            " first training steps."
        )
        return best, costs

    def _stand_ins(self, args: tuple, parameter_costs: list[float]) -> list[BlockCost]:
        """Block costs from parameter counts (a microsecond per thousand, forward, input and weight gradient
        alike) for the whole first batch, nothing saved: only their ratios matter, the trial fits the scale. The
        batch size is the first batch tensor's first dimension."""
        from lightning_pipe._model.profile import BlockCost

        batch_size = next((int(t.shape[0]) for t in batch_tensors(args[0]) if t.dim()), 1)
        return [
            BlockCost(c * 1e-9, c * 1e-9, c * 1e-9, 0, rows=batch_size, batch_size=batch_size) for c in parameter_costs
        ]


def _schedules_for(options: PipelineOptions, backbone: Optional[Backbone]) -> tuple[str, ...]:
    """Every schedule; where compiled blocks hold linear layers split over tensor ranks in a layout whose weight
    gradient cannot wait (read off blocks split already; torch's ``ColwiseParallel`` and ``RowwiseParallel`` layouts
    defer theirs), those that do not split the backward: the cost model would credit the others with a gain they do
    not have ([Note: deferred weight gradients])."""
    blocks = [backbone.module(i) for i in range(len(backbone))] if backbone is not None else []
    if options.compile is None and not any(compiled(b) for b in blocks):
        return SCHEDULE_NAMES
    if options.tensor_parallel_size == 1 or not undeferred_split_layers(blocks):
        return SCHEDULE_NAMES
    return tuple(name for name in SCHEDULE_NAMES if not schedule_spec(name).splits_backward)
