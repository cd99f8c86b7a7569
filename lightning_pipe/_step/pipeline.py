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

How stage shapes are probed and which schedules are kept: :mod:`lightning_pipe._step.shapes` ([Note: stage
shapes], [Note: schedules kept per shape]).
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

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

from lightning_pipe import _watchdog
from lightning_pipe._calls.batch import batch_tensors, row_numbers
from lightning_pipe._compat.pipelining import (
    keep_forward_actions,
    merged_param_groups,
    raised_in_stage,
    weight_gradients_keep_graph,
)
from lightning_pipe._step.deferred_linear import Deferral, deferred_linears
from lightning_pipe._step.last_backward import ReductionOverlap
from lightning_pipe._step.program import StepProgram
from lightning_pipe._step.shapes import (
    MAX_SCHEDULES,
    MAX_SHAPES_REMEMBERED,
    Meta,
    Metas,
    ScheduleCache,
    ShapeStats,
    describe_key,
    resized,
    shape_of,
    size_map,
)
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import ScheduleSpec
from lightning_pipe.timeline import TimelineRecorder

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    #: A schedule object of torch's (every schedule in ``lightning_pipe.schedules`` is one of torch's classes).
    _Schedule = Union[PipelineScheduleSingle, PipelineScheduleMulti]

log = logging.getLogger(__name__)
shown = logging.getLogger("lightning.pytorch.lightning_pipe")  # printed on every rank, as Lightning's own messages
#: ``probe(stage, rows, received) -> output``: a stage's output shapes for its input shapes, leaving no trace.
Probe = Callable[[int, torch.Tensor, Optional[Metas]], Metas]
#: What torch's ``PipelineStage.backward_maybe_with_nosync`` returns: the input gradients and the parameter groups.
BackwardResult = tuple[tuple[Optional[torch.Tensor], ...], Optional[list[dict[str, Any]]]]
#: ``override(backward)``: runs ``backward()`` through the user's ``backward`` override and returns its result.
BackwardOverride = Callable[[Callable[[], BackwardResult]], BackwardResult]


class StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs for one stage: the user's step as that stage.

    It registers the parameters the stage uses (its blocks' and, for the first and last stage, those outside the
    backbone) so that torch computes their gradients in zero-bubble schedules; they stay the user's own objects.
    """

    def __init__(
        self, program: StepProgram, stage: int, params: list[nn.Parameter],
        current: Optional[Callable[[], list[nn.Parameter]]] = None,
    ) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)
        self.stage = stage
        object.__setattr__(self, "_program", program)
        object.__setattr__(self, "_current", current)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """The stage's parameters as its forward uses them: with sharded stages (``current``), the unsharded ones
        the modules register while unsharded (the zero-bubble schedules compute weight gradients for them)."""
        if self._current is not None:
            return iter(self._current())
        return super().parameters(recurse)

    def forward(self, *inputs: torch.Tensor, lp_rows: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
        for received in inputs if self.stage > 0 and len(inputs) > 1 else ():
            if received.requires_grad:  # torch sends the gradient as computed: a broadcast value's may be strided
                received.register_hook(_contiguous)
        out = self._program.run_stage(self.stage, lp_rows, inputs if self.stage > 0 else ())
        return out[0] if len(out) == 1 else out


class ReducingStage(PipelineStage):
    """torch's ``PipelineStage`` whose last full backward of a step reduces its gradients over the replicas while it
    runs ([Note: overlapped reductions]); every other call is torch's own."""

    overlap: Optional[ReductionOverlap] = None
    #: The user's ``backward`` override that the last stage's backward runs through ([Note: backward overrides]).
    through_override: Optional[BackwardOverride] = None
    #: The stage's deferred linear weight gradients ([Note: deferred weight gradients]): set where the stage holds
    #: compiled blocks and the schedule splits the backward. Its input action then runs the whole backward, collecting
    #: them, and torch runs ``dw_builder``'s runner as its weight action.
    deferral: Optional[Deferral] = None

    def backward_maybe_with_nosync(
        self, backward_type: Literal["full", "input", "weight"], bwd_kwargs: dict, *args: bool, **kwargs: bool
    ) -> BackwardResult:
        if self.is_last and self.through_override is not None and backward_type in ("full", "input"):
            return self.through_override(lambda: self._backward(backward_type, bwd_kwargs, *args, **kwargs))
        return self._backward(backward_type, bwd_kwargs, *args, **kwargs)

    def _backward(
        self, backward_type: Literal["full", "input", "weight"], bwd_kwargs: dict, *args: bool, **kwargs: bool
    ) -> BackwardResult:
        if self.deferral is not None:  # torch's `dw_builder` path: always "full", its runner is the weight action
            with self.deferral.collecting():
                return self._backward_now(backward_type, bwd_kwargs, *args, **kwargs)
        if backward_type in ("input", "weight"):  # torch's zero-bubble split, corrected (see _compat.pipelining)
            fix = merged_param_groups() if backward_type == "input" else weight_gradients_keep_graph()
            with fix:
                return self._backward_now(backward_type, bwd_kwargs, *args, **kwargs)
        return self._backward_now(backward_type, bwd_kwargs, *args, **kwargs)

    def _backward_now(
        self, backward_type: Literal["full", "input", "weight"], bwd_kwargs: dict, *args: bool, **kwargs: bool
    ) -> BackwardResult:
        last = kwargs.get("last_backward", args[0] if args else False)
        # a deferring stage's gradients are whole only after its weight actions: reduced after the schedule
        if self.overlap is None or not last or backward_type != "full" or self.deferral is not None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)
        with self.overlap.last_backward(self.stage_index):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)


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
        self._metas: OrderedDict[tuple, dict[int, tuple[Metas, Metas]]] = OrderedDict()  # see _stage_metas
        self.overlap: Optional[ReductionOverlap] = None  # reductions in the last backward (set by the runtime)
        #: ``{stage: bytes}`` each local stage but the last sends per microbatch for the latest shape, every tensor its
        #: boundary carries ([Note: stage boundaries]): this rank's own message, ``1 / tensor_parallel_size`` of the
        #: activation with sequence parallelism
        self.boundary_bytes: dict[int, int] = {}
        self.through_override: Optional[BackwardOverride] = None  # set by the runtime
        #: ``{stage: blocks}`` of this rank's stages whose linear weight gradients wait for the weight action under
        #: a schedule that splits the backward (set by the runtime; [Note: deferred weight gradients])
        self.deferring: dict[int, list[nn.Module]] = {}
        self._deferrals: dict[int, Deferral] = {}
        self._swapped = ExitStack()

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

    def use(self, schedule: ScheduleSpec, num_microbatches: int) -> None:
        """Run ``schedule`` (of this layout's placement) from now on; the schedules built so far are dropped, and the
        stage shapes kept (no collective: see [Note: stage shapes])."""
        self.schedule = schedule
        self.schedule_class = get_schedule_class(schedule.name)
        self.num_microbatches = num_microbatches
        self._schedules.clear()
        self.defer_weights()

    def defer_weights(self) -> None:
        """Swap the deferring stages' linear layers in while the schedule splits the backward, out otherwise."""
        self._swapped.close()
        self._deferrals = {}
        if self.schedule.splits_backward:
            for stage, blocks in self.deferring.items():
                self._swapped.enter_context(deferred_linears(blocks))
                self._deferrals[stage] = Deferral()

    def close(self) -> None:
        """The call ends: the linear layers are the user's own again."""
        self._swapped.close()
        self._deferrals = {}

    def check_schedule(self) -> None:
        """Build the schedule once for the configured microbatch count so torch's own checks run at setup."""
        self._make_schedule(self._make_stages(None, training=True), self.num_microbatches, training=True)

    # ------------------------------------------------------------------ running
    def train_step(
        self,
        sample: Any,
        batch_size: int,
        num_microbatches: int,
        timeline: Optional[TimelineRecorder] = None,
    ) -> None:
        """Forward and backward of one batch of ``batch_size`` rows; gradients accumulate into ``.grad``.

        ``sample`` is microbatch 0 of the batch (its tensors' shapes select the schedule). The last stage's forward
        returns each microbatch's loss (``StepProgram.computing_loss``, [Note: the last stage's loss]). With
        ``timeline``, the schedule's step is traced into it (:mod:`lightning_pipe.timeline`; a barrier over the
        pipeline group).
        """
        schedule = self._schedule_for(self._key_for(sample, batch_size, num_microbatches, training=True))
        rows = row_numbers(batch_size, self.device)
        traced = timeline.trace(schedule) if timeline is not None else nullcontext()
        with self._dropped_if_it_fails(schedule), traced, _watchdog.waiting(lambda: self._transfers("training")):
            schedule.step(*self._first_input(rows), target=rows, lp_rows=rows, return_outputs=False)

    def eval_step(
        self, sample: Any, batch_size: int, num_microbatches: int, *, rows_dim: int = 0, kind: Optional[tuple] = None
    ) -> Optional[torch.Tensor]:
        """Forward-only pass of one batch. Returns the merged last-stage output on the last stage, else ``None``.
        ``rows_dim``: the hidden state's dimension of rows ([Note: sequence-first hidden states]); ``kind``: what else
        the stages' shapes depend on (a call that runs only some blocks sends other values: [Note: partial passes]),
        a schedule of its own."""
        key = self._key_for(sample, batch_size, num_microbatches, training=False, kind=kind)
        schedule = self._schedule_for(key)
        rows = row_numbers(batch_size, self.device)
        with self._dropped_if_it_fails(schedule), _watchdog.waiting(lambda: self._transfers("evaluation")):
            output = schedule.eval(*self._first_input(rows), lp_rows=rows)
        if not self.has_last_stage:
            return None
        metas = self._metas[shape_of(key)][self.layout.num_stages - 1][1]
        rows = batch_size // num_microbatches
        outputs = tuple(
            _merged(out, shape, rows, num_microbatches, rows_dim)
            for out, (shape, _) in zip(output if isinstance(output, tuple) else (output,), metas)
        )
        return outputs if isinstance(output, tuple) else outputs[0]

    @contextmanager
    def _dropped_if_it_fails(self, schedule: _Schedule) -> Iterator[None]:
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
        except BaseException as err:
            self._schedules.drop(schedule)
            for deferral in self._deferrals.values():  # weight gradients handed over by the unfinished microbatches
                deferral.clear()
            raised = raised_in_stage(err)  # the step's own error, not torch's wrapper of it
            if raised is err:
                raise
            raise raised from raised.__cause__

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

    @staticmethod
    def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage's forward returned the microbatch's loss."""
        return output

    # ------------------------------------------------------------------ building
    def _key_for(
        self, sample: Any, batch_size: int, num_microbatches: int, training: bool, kind: Optional[tuple] = None
    ) -> tuple:
        rows = batch_size // num_microbatches
        shapes = tuple((tuple(t.shape), t.dtype) for t in batch_tensors(sample))
        return rows, shapes, num_microbatches, training, torch.is_autocast_enabled(self.device.type), kind

    def _schedule_for(self, key: tuple) -> _Schedule:
        """The schedule kept for ``key`` (:meth:`_key_for`), built when it is not."""
        schedule = self._schedules.get(key)
        if schedule is None:
            rows, _, num_microbatches, training, *_ = key
            schedule = self._build(key, rows, num_microbatches, training)
        return schedule

    def _build(self, key: tuple, rows: int, num_microbatches: int, training: bool) -> _Schedule:
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
                      self.pipeline_rank, describe_key(old), self._schedules.stats.max_kept)
        return schedule

    def _make_stages(self, metas: Optional[dict[int, tuple]], training: bool = True) -> list[PipelineStage]:
        stages = []
        num_stages = self.layout.num_stages
        for index, module in self.stage_modules.items():
            kwargs = {}
            if metas is not None:
                inputs, outputs = metas[index]
                kwargs = {
                    "input_args": tuple(_meta_tensor(m, requires_grad=training and index > 0) for m in inputs),
                    "output_args": tuple(_meta_tensor(m, requires_grad=training) for m in outputs),
                }
            deferral = self._deferrals.get(index) if training else None
            stage = ReducingStage(module, index, num_stages, self.device, group=self.group,
                                  dw_builder=deferral.builder if deferral is not None else None, **kwargs)
            stage.overlap = self.overlap if training else None
            stage.through_override = self.through_override
            stage.deferral = deferral
            stages.append(stage)
        return stages

    def _make_schedule(self, stages: list[PipelineStage], num_microbatches: int, training: bool) -> _Schedule:
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
            keep_forward_actions(schedule)  # torch's eval() cannot run these schedules (see _compat.pipelining)
        return schedule

    def _has_local_hand_over(self) -> bool:
        """Whether some stage feeds the next one on the same process (V placement; any multi-stage schedule on one
        process): torch's ``eval()`` cannot run such a pipeline (see
        :func:`~lightning_pipe._compat.pipelining.keep_forward_actions`)."""
        return any(
            self.layout.stage_rank(s) == self.layout.stage_rank(s + 1) for s in range(self.layout.num_stages - 1)
        )

    def _stage_metas(self, key: tuple, rows: int) -> dict[int, tuple[Metas, Metas]]:
        """Input and output shape of every local stage for the schedule ``key``, microbatches of ``rows`` rows
        (see [Note: stage shapes])."""
        shape = shape_of(key)
        metas = self._metas.get(shape)
        if metas is not None:
            self._metas.move_to_end(shape)
            self._note_boundary_bytes(metas)
            return metas
        guesses = self._guess_inputs(shape)
        metas = self._probe_at_once(rows, guesses) if guesses is not None else None
        if metas is None:
            metas = self._probe_in_order(rows)
        self._metas[shape] = metas
        if len(self._metas) > MAX_SHAPES_REMEMBERED:
            self._metas.popitem(last=False)
        self._note_boundary_bytes(metas)
        return metas

    def _note_boundary_bytes(self, metas: dict[int, tuple[Metas, Metas]]) -> None:
        last = self.layout.num_stages - 1
        first_time = not self.boundary_bytes
        self.boundary_bytes = {s: _nbytes(out) for s, (_, out) in metas.items() if s < last and out is not None}
        parts = [
            f"stage {s} sends {self.boundary_bytes[s]:,} bytes in {len(out)} tensor(s) {[list(m[0]) for m in out]}"
            for s, (_, out) in sorted(metas.items()) if s in self.boundary_bytes
        ]
        if first_time and parts:  # once per run, on every rank (what differs per shape is in the timeline)
            shown.info("PipelineStrategy, pipeline rank %d, per microbatch: %s", self.pipeline_rank, "; ".join(parts))
        log.debug("pipeline rank %d sends per microbatch (bytes by stage): %s", self.pipeline_rank, self.boundary_bytes)

    def _guess_inputs(self, shape: tuple) -> Optional[dict[int, Metas]]:
        """The input shapes of the local stages for ``shape``, guessed from the last shape remembered whose sizes
        map one to one onto its sizes; ``None`` (the same on every rank) when there is none to guess from."""
        if self.layout.pipeline_size == 1:
            return None  # nothing to exchange: the stages are probed in order
        for old in reversed(self._metas):
            sizes = size_map(old, shape)
            if sizes is not None:
                metas = self._metas[old]
                return {s: tuple(resized(m, sizes) for m in metas[s][0]) for s in metas if s > 0}
        return None

    def _probe_at_once(self, rows: int, guesses: dict[int, Metas]) -> Optional[dict[int, tuple[Metas, Metas]]]:
        """Probe the local stages on the guessed inputs, all ranks at once, and check the guesses against the
        gathered outputs; ``None`` (the same on every rank) when one was wrong."""
        sample_rows = torch.arange(rows, device=self.device)
        probed: dict[int, tuple[Metas, Optional[Metas]]] = {}
        for stage in sorted(self.stage_modules):
            if stage == 0:
                in_meta: Optional[Metas] = (((rows,), sample_rows.dtype),)
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

    def _probe_in_order(self, rows: int) -> dict[int, tuple[Metas, Metas]]:
        """Walk the stages in order: the rank owning stage ``s`` learns its output shape (:attr:`probe`) and sends
        it to the pipeline, since it is the next stage's input."""
        metas: dict[int, tuple[Metas, Metas]] = {}
        sample_rows = torch.arange(rows, device=self.device)
        in_meta: Metas = (((rows,), sample_rows.dtype),)
        for stage in range(self.layout.num_stages):
            owner = self.layout.stage_rank(stage)
            out_meta: Optional[Metas] = None
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


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _construct(cls: type, stages: list, n: int, loss_fn: Optional[Callable], multi: bool) -> _Schedule:
    if multi:
        return cls(stages, n, loss_fn=loss_fn, scale_grads=False)
    if issubclass(cls, PipelineScheduleSingle) and len(stages) != 1:
        raise ValueError(f"{cls.__name__} runs one stage per process, got {len(stages)}.")
    return cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)


def _meta_tensor(meta: Meta, requires_grad: bool) -> torch.Tensor:
    shape, dtype = meta
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad and dtype.is_floating_point)


def _nbytes(metas: Metas) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in metas)


def _merged(out: torch.Tensor, shape: tuple, rows: int, num_microbatches: int, rows_dim: int) -> torch.Tensor:
    """One output of the last stage for the whole batch, from torch's merge, which concatenates the microbatches'
    outputs (of ``shape``) along dimension 0: a value without a batch dimension is the first microbatch's; one with
    the rows in its second dimension (a sequence-first hidden state) is concatenated along that one instead."""
    if rows_dim and len(shape) > rows_dim and shape[rows_dim] == rows:
        return torch.cat(out.chunk(num_microbatches, dim=0), dim=rows_dim)
    return out if shape[:1] == (rows,) else out[: shape[0]]
