"""The runtime of one ``fit``/``validate``/``test``/``predict``: everything the strategy builds in ``setup``.

:class:`PipelineRuntime` owns this rank's part of the model (the cut module and its
:class:`~lightning_pipe.partition.StageLayout`), the :class:`~lightning_pipe._step.program.StepProgram` that runs the
user's step as a stage, the :class:`~lightning_pipe._step.pipeline.StagePipeline` that drives torch's schedule, the
microbatch policy, the channels that carry each step's logs from the last stage, and the trainable parameters with
the gradients kept aside between ``training_step`` and ``backward``. The strategy's hooks call it.

A training batch, from Lightning's loop to the optimizer step:

1. ``Strategy.training_step`` → :meth:`PipelineRuntime.train_batch`. Every rank runs the user's ``training_step`` on
   ghosts up to the first block call, whose hidden state gives the batch size (``StepProgram.batch_size_of``); the
   microbatch policy (:class:`~lightning_pipe._step.microbatches.MicrobatchPolicy`) fixes the count.
2. The schedule runs forward and backward over the microbatches (``StagePipeline.train_step``). Each stage runs the
   user's step on its microbatch's rows, running only its own blocks; the last stage runs the step on to its end
   and returns the loss, ``loss / (microbatches * accumulate_grad_batches)`` (``MicrobatchLoss``): exact under
   gradient accumulation.
3. The gradients the schedule computed are set aside and the earlier ``.grad`` put back (:class:`Gradients`), because
   Lightning calls ``zero_grad`` next; they are averaged over data-parallel replicas and summed over the ranks that
   hold a tied parameter. The last stage's logs are reduced over the microbatches, sent to every rank of the pipeline
   (:class:`~lightning_pipe._lightning.log.LogChannel`) and logged there; the full-batch loss is returned on every rank.
4. Lightning calls ``zero_grad``, then ``Strategy.backward`` → :meth:`Gradients.hand_back` adds the kept gradients,
   between the ``on_before_backward`` and ``on_after_backward`` hooks.
5. Lightning's precision plugin clips (by the norm over the pipeline, :mod:`lightning_pipe._lightning.precision`) and
   steps.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe import _watchdog
from lightning_pipe import timeline as _timeline
from lightning_pipe._calls.stops import SecondPass
from lightning_pipe._compat.parallel import fsdp_hooks_suspended
from lightning_pipe._compiled import compiled_stages, whole_backward_warning
from lightning_pipe._errors import BackboneCallError, not_computed_by_last_stage
from lightning_pipe._fingerprint import SameDataCheck
from lightning_pipe._ghost import Ghost, GhostValueError, contains_ghost
from lightning_pipe._lightning.callbacks import align_param_groups
from lightning_pipe._lightning.log import LogChannel, LogRecorder, replay
from lightning_pipe._lightning.metrics import (
    metrics_set_aside,
    metrics_undone_on,
    module_metrics,
    per_batch_metrics,
)
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.shard import StageSharding
from lightning_pipe._model.structure import everything_ghosted
from lightning_pipe._model.untouched import untouched
from lightning_pipe._step.auto import Choice, Trial, describe_choice
from lightning_pipe._step.deferred_linear import undeferred_split_layers
from lightning_pipe._step.generation import Generates, LockStep, StepFailed
from lightning_pipe._step.gradients import Gradients
from lightning_pipe._step.last_backward import ReductionOverlap
from lightning_pipe._step.loss_weights import LossWeighing, warn_unweighted
from lightning_pipe._step.microbatch_loss import MicrobatchLoss
from lightning_pipe._step.microbatch_rows import MicrobatchRowsCheck
from lightning_pipe._step.microbatches import MicrobatchPolicy
from lightning_pipe._step.pipeline import StageModule, StagePipeline
from lightning_pipe._step.program import StepProgram
from lightning_pipe._step.random_state import random_state_of, set_random_state
from lightning_pipe._step.sharded import ShardedStages
from lightning_pipe._step.traced_step import StepTimeline
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import Config

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import lightning.pytorch as pl
    from torchmetrics import Metric

    from lightning_pipe._step.pipeline import BackwardOverride
    from lightning_pipe._step.shapes import Metas

log = logging.getLogger(__name__)
_R = TypeVar("_R")


class PipelineRuntime:
    """One ``Trainer`` call's pipeline on this rank; built by ``PipelineStrategy.setup``.

    Args:
        module: the LightningModule, already cut (``cut.keep_only``).
        cut: where every tensor lives.
        config: what the pipeline runs (schedule, stages per process, microbatches), settled at setup.
        pp_group: this rank's pipeline (one replica); ``dp_group``: its replicas (``sync_dist`` logging reduces over
            it, gradients are averaged over it).
        tie_groups: process groups of the tied parameters this rank holds, as :class:`Gradients` takes them.
        device: the device the stages run on.
        checkpointed: which blocks run under activation checkpointing.
        amp_scaler: the precision plugin's ``GradScaler``, if any: the microbatch losses are scaled by it.
        timeline: what ``timeline=`` traces, or ``None``.
        check_data_every: compare the batch's fingerprint over the pipeline on the first 3 batches of training and
            of evaluation, and on every ``check_data_every``-th after (``SameDataCheck``); ``None``: never.
        sharding: this rank's FSDP units when the stages are sharded over their replicas ([Note: sharded stages]).
        scale_group: a second group over this rank's pipeline, which carries each step's loss weight to every stage
            during the schedule ([Note: overlapped reductions]); ``None`` with one process per pipeline.
        result_group: another group over this rank's pipeline, which carries each training step's loss and logs from
            the last stage to the other stages during the schedule when the last stage shares the first stage's rank
            ([Note: the step's result, sent before the schedule ends]); otherwise, or ``None``, they are sent on
            ``pp_group`` after the schedule.
        tensor_group: this rank's tensor-parallel group (``None`` without tensor parallelism): see :class:`Gradients`.
        choice, trial: ``schedule="auto"``'s choice for the module and the trial that times its candidates on the
            first training steps ([Note: configuration by measurement]).
    """

    def __init__(
        self,
        module: pl.LightningModule,
        cut: Cut,
        *,
        config: Config,
        pp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        tie_groups: Sequence[tuple[dist.ProcessGroup, list[nn.Parameter]]],
        device: torch.device,
        checkpointed: Callable[[nn.Module], bool],
        amp_scaler: Optional[torch.amp.GradScaler] = None,
        timeline: Optional[_timeline.TimelineOptions] = None,
        check_data_every: Optional[int] = None,
        sharding: Optional[StageSharding] = None,
        scale_group: Optional[dist.ProcessGroup] = None,
        result_group: Optional[dist.ProcessGroup] = None,
        tensor_group: Optional[dist.ProcessGroup] = None,
        through_override: Optional[BackwardOverride] = None,
        choice: Optional[Choice] = None,
        trial: Optional[Trial] = None,
    ) -> None:
        sharding = ShardedStages.of(sharding) if sharding is not None else None  # with its per-batch calls
        self.module = module
        self.sharding = sharding
        self.same_data = SameDataCheck(check_data_every, pp_group, cut.layout, device)
        self.cut = cut
        self.config = config
        self.schedule = schedule = config.spec
        self.microbatches = MicrobatchPolicy.of(config, cut.layout.pipeline_size)
        self.choice = choice  # `schedule="auto"`'s ([Note: configuration by measurement]); None otherwise
        self.device = device
        self.dp_group = dp_group
        self.amp_scaler = amp_scaler
        self.timeline = StepTimeline(timeline, pp_group, device) if timeline is not None else None
        layout = cut.layout
        rank = dist.get_rank(pp_group)
        bounds = {s: layout.bounds[s] for s in layout.rank_stages(rank)}
        self.program = StepProgram(
            module, cut.backbone, cut.structure, cut.flow, bounds, swaps=cut.window_swaps(rank), device=device,
            checkpointed=checkpointed,
        )
        self.program.hand_over = schedule.splits_backward
        if sharding is None:
            stage_modules = {s: StageModule(self.program, s, cut.stage_parameters(s)) for s in bounds}
        else:  # torch computes weight gradients for the parameters the forward used: the unsharded ones
            stage_modules = {
                s: StageModule(self.program, s, [], functools.partial(cut.registered_parameters, s)) for s in bounds
            }
        self.pipeline = StagePipeline(
            stage_modules, layout, schedule, self.microbatches.nominal, pp_group, device=device, probe=self._probe
        )
        replicas = dp_group if dist.get_world_size(dp_group) > 1 else None
        self.overlap = self._overlap(cut, bounds, replicas, scale_group, sharding) if replicas is not None else None
        self.pipeline.overlap = self.overlap
        self.pipeline.through_override = through_override  # [Note: backward overrides]
        # [Note: compiled blocks]: their linear layers' weight gradients wait for the weight action
        self.pipeline.deferring = {
            s: [cut.backbone.module(i) for i in range(*bounds[s])] for s in compiled_stages(cut.backbone, bounds)
        }
        self.pipeline.defer_weights()
        undeferred = undeferred_split_layers(b for blocks in self.pipeline.deferring.values() for b in blocks)
        if undeferred and schedule.splits_backward:
            warnings.warn(whole_backward_warning(schedule.name, undeferred), stacklevel=2)
        self.pipeline.check_schedule()
        last, size = self.pipeline.last_stage_rank, layout.pipeline_size
        # [Note: the step's result, sent before the schedule ends]: when the last stage shares the first's rank
        early = result_group is not None and last == 0
        self._train_channel = LogChannel(result_group if early else pp_group, last, size, device, tag=1, early=early)
        self._eval_channel = LogChannel(pp_group, last, size, device, tag=2)
        self.gradients = Gradients(module, replicas, tie_groups, sharding, tensor_group)
        self._trainable_checked: Optional[int] = None
        self._mean_warned = False
        self.lock_step = LockStep(self)  # evaluation steps that generate ([Note: lock step])
        self.check_rows = MicrobatchRowsCheck(self.program)  # [Note: rows folded into the batch]
        self.trial = trial  # `schedule="auto"`'s first steps ([Note: configuration by measurement])
        self.trial_steps = 0  # how many they were, once chosen
        if trial is not None and trial.chosen is not None:  # one candidate: nothing to time
            self._keep(trial.chosen)

    @property
    def layout(self) -> StageLayout:
        return self.cut.layout

    def end(self, failed: bool) -> None:
        """The call ends: drop the gradients kept aside and, unless it failed (the other ranks may be gone), let the
        last transfers finish (:meth:`drain`)."""
        self.gradients.discard()
        self.pipeline.close()
        if not failed:
            self.drain()

    def drain(self) -> None:
        """Wait for the last stage's last log sends (sent without waiting, see :class:`LogChannel`), so that no
        transfer is in flight when the run ends and the process groups are destroyed at exit."""
        self._train_channel.wait()
        self._eval_channel.wait()

    def use(self, config: Config) -> None:
        """Run ``config`` from the next batch on: a schedule of the cut's placement, and its microbatch count."""
        if config == self.config:
            return
        self.config, self.schedule = config, config.spec
        self.program.hand_over = self.schedule.splits_backward
        self.microbatches = MicrobatchPolicy.of(config, self.layout.pipeline_size)
        self.pipeline.use(self.schedule, self.microbatches.nominal)

    @property
    def stored_choice(self) -> Optional[Config]:
        """What a checkpoint stores of ``schedule="auto"``: the configuration it kept, or ``None`` until it chose."""
        return self.choice.config if self.choice is not None and self.choice.decided else None

    def _keep(self, config: Config) -> None:
        """``schedule="auto"`` chose ``config`` for the rest of the run: what checkpoints store from now on."""
        self.use(config)
        if self.choice is not None:
            self.choice.config, self.choice.decided = config, True
        self.trial = None

    def keep_stored_choice(self, record: object) -> None:
        """A resumed ``schedule="auto"`` run keeps the configuration its checkpoint stores instead of timing again,
        when the cut has its placement (setup predicted the same); ``record`` is from disk, so checked."""
        config = Config.from_record(record)
        if self.choice is None or config is None:
            return
        if config.placement != (self.layout.style, self.layout.stages_per_rank):
            if self.trial is None:  # nothing to choose in this call (an evaluation): it runs what it was cut for
                return
            rank_zero_warn(
                f"PipelineStrategy(schedule='auto'): the checkpoint chose {config.arguments()}, but this run predicted"
                f" another placement ({self.layout.describe()}), so it chooses again. Pass those arguments to keep it."
            )
            return
        self._keep(config)
        rank_zero_info(f"PipelineStrategy(schedule='auto'): keeping the checkpoint's choice, {config.arguments()}.")

    # ------------------------------------------------------------------------------------------------ training
    def train_batch(self, batch: Any, *rest: Any, **kwargs: Any) -> Tensor:
        """Forward and backward of one training batch; returns the full-batch loss on every rank. The gradients are
        kept aside until :meth:`Gradients.hand_back`. While ``schedule="auto"`` times its candidates, each batch runs
        the candidate of its turn, and the choice is made after the last."""
        trial = self.trial
        if trial is None or not trial.running:
            return self._train_batch(batch, *rest, **kwargs)
        self.use(trial.current())
        measure_peak = self.device.type == "cuda"
        if measure_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        loss = self._train_batch(batch, *rest, **kwargs)
        elapsed = time.perf_counter() - start
        trial.record(elapsed, torch.cuda.max_memory_allocated(self.device) if measure_peak else None)
        if trial.finished:
            chosen = trial.settle(self.device)
            if chosen is not None:
                self._keep(chosen)
                self.trial_steps = trial.steps
                rank_zero_info(describe_choice(trial))
        return loss

    def _train_batch(self, batch: Any, *rest: Any, **kwargs: Any) -> Tensor:
        module, program, pipeline = self.module, self.program, self.pipeline
        self._check_trainable()
        self.same_data("training", batch, rest, kwargs)
        step = module.training_step
        batch_size = program.batch_size_of(step, batch, *rest, **kwargs)
        num_microbatches = self.microbatches.for_batch(program.batch_rows_count)
        # Lightning divides the returned loss by `accumulate_grad_batches` and back-propagates that; the schedule
        # back-propagates each microbatch loss, so scale it by the same factor and by the microbatch count.
        grad_scale = 1.0 / (num_microbatches * module.trainer.accumulate_grad_batches)
        recorder = LogRecorder()
        weighing = LossWeighing(num_microbatches, check_unweighted=not self._mean_warned)
        metrics = module_metrics(module) if pipeline.has_last_stage else []  # only the last stage runs the step
        channel, payloads = self._train_channel, []

        def send_early() -> None:  # [Note: the step's result, sent before the schedule ends]
            payloads.append(_train_payload(module, weighing, recorder, metrics))
            channel.send_early(payloads[0])

        losses = MicrobatchLoss(
            module, recorder, weighing, grad_scale=grad_scale, overlap=self.overlap, amp_scaler=self.amp_scaler,
            on_last=send_early if channel.early and not metrics else None,  # metrics merge after the schedule
        )
        tracer = self.timeline.recorder(module.trainer) if self.timeline is not None else None
        channel.expect(pipeline.has_last_stage)
        with program.holding(step, batch, batch_size, *rest, **kwargs), program.computing_loss(losses):
            sample = program.sub_batch(torch.arange(batch_size // num_microbatches))
            self.check_rows(step, batch, sample, rest=rest, kwargs=kwargs, batch_size=batch_size,
                            num_microbatches=num_microbatches)
            with per_batch_metrics(metrics, num_microbatches), self.gradients.computed_aside():
                self._sync_buffers()
                if self.overlap is not None:
                    self.overlap.start(pipeline.has_last_stage, tracer)
                pipeline.train_step(sample, batch_size, num_microbatches, tracer)
                if self.overlap is not None:
                    self.overlap.finish()  # into the step's gradients, before they are set aside
        payload = None
        if pipeline.has_last_stage:
            payload = payloads[0] if payloads else _train_payload(module, weighing, recorder, metrics)
            self._warn_unweighted(weighing)
        with self._waiting_for_last_stage():
            (loss, scale), entries = channel.share(payload)
        self.gradients.synchronise(float(scale), tracer.collective if tracer is not None else None, self.overlap)
        replay(module, entries, self.device, self.dp_group)
        if tracer is not None:
            assert self.timeline is not None
            self.timeline.report(tracer, module.trainer, self.schedule, self.layout, self.pipeline.shape_stats)
        return loss.to(self.device)

    # ------------------------------------------------------------------------------------------------ evaluation
    def eval_batch(self, step: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """A forward-only pass of one batch through ``step`` (``validation_step``, ...); returns the step's result on
        every rank."""
        module, program, pipeline = self.module, self.program, self.pipeline
        batch, *rest = args
        self.same_data("evaluation", batch, rest, kwargs)
        if self.lock_step.generates(step):  # [Note: lock step]
            return self._generate(step, *args, **kwargs)
        batch_size = program.batch_size_of(step, *args, **kwargs)
        if not program.rows_per_row:  # its rows come from none of the batch's (prompts the step makes): in lock step
            self.lock_step.learn(step)
            return self._generate(step, *args, **kwargs)
        num_microbatches = self.microbatches.for_batch(program.batch_rows_count)
        if not self.lock_step.splits_by_rows(step, batch_size, num_microbatches, *args, **kwargs):
            self.lock_step.learn(step)  # its model calls' rows are not the batch's: in lock step
            return self._generate(step, *args, **kwargs)
        payload, failed = None, None
        random_state = random_state_of(self.device)  # put back if the step turns out to generate
        with self._unsharded():  # the last stage's own code runs the modules after the backbone too
            with program.holding(step, batch, batch_size, *rest, **kwargs):
                sample = program.sub_batch(torch.arange(batch_size // num_microbatches))
                output = pipeline.eval_step(sample, batch_size, num_microbatches, rows_dim=program.rows_dim)
            if pipeline.has_last_stage:
                recorder = LogRecorder()
                recorder.start(program.batch_rows_count)
                try:
                    with recorder.installed(module), metrics_undone_on(SecondPass, module_metrics(module)):
                        result = program.run_answering(output, step, *args, **kwargs)
                    if contains_ghost(result):
                        raise _ghost_result(step)
                    payload = (result, recorder.reduce(module))
                except SecondPass:
                    payload = (Generates(), [])
                except Exception as err:  # every rank raises, naming it, instead of waiting for the answer
                    failed, payload = err, (StepFailed.of(err, pipeline.last_stage_rank, step), [])
        with self._waiting_for_last_stage():
            result, entries = self._eval_channel.share(payload)
        if failed is not None:  # the last stage raises its own error, the other ranks one that names it
            raise failed
        if isinstance(result, StepFailed):
            raise BackboneCallError(result.message)
        if isinstance(result, Generates):  # run it again, in lock step
            set_random_state(random_state, self.device)
            self.lock_step.learn(step)
            return self._generate(step, *args, **kwargs)
        replay(module, entries, self.device, self.dp_group)
        return apply_to_collection(result, Tensor, lambda t: t.to(self.device))

    def _generate(self, step: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        with self._unsharded():
            return self.lock_step.run(step, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------ helpers
    def _overlap(
        self, cut: Cut, bounds: dict[int, tuple[int, int]], replicas: dist.ProcessGroup,
        scale_group: Optional[dist.ProcessGroup], sharding: Optional[ShardedStages],
    ) -> ReductionOverlap:
        """What each local stage reduces in its last backward ([Note: overlapped reductions]): replicated, the
        parameters whose last local use it is (backward runs the stages from the last); sharded, its block units."""
        final: dict[int, list[nn.Parameter]] = {}
        units: dict[int, list[nn.Module]] = {}
        if sharding is None:
            seen: set[int] = set()
            for stage in sorted(bounds):
                for p in cut.stage_parameters(stage):
                    if id(p) not in seen:
                        seen.add(id(p))
                        final.setdefault(stage, []).append(p)
        else:
            unit_ids = {id(u) for u in sharding.blocks}
            for stage, (lo, hi) in bounds.items():
                blocks = [cut.backbone.module(i) for i in range(lo, hi)]
                units[stage] = [b for b in blocks if id(b) in unit_ids]
        return ReductionOverlap(
            final, units, replicas, scale_group, self.pipeline.last_stage_rank, device=self.device
        )

    @contextmanager
    def _unsharded(self) -> Iterator[None]:
        """For an evaluation batch of sharded stages: the outside unit unsharded (it has no forward hooks), and every
        unit resharded after."""
        if self.sharding is None:
            yield
            return
        if self.sharding.outside is not None:
            self.sharding.outside.unshard()
        try:
            yield
        finally:
            self.sharding.reshard()

    def _probe(self, stage: int, rows: Tensor, received: Optional[Metas]) -> Metas:
        """The outputs' ``(shape, dtype)`` of ``stage`` on the microbatch ``rows``, for inputs of ``received``'s.

        The stage runs on ghosts: no compute, nothing changes (buffers, random state, metrics). A stage that cannot
        (a block with value-dependent shapes) runs once for real on a zero input, without gradients, and everything
        it touched is put back. Either way compiled blocks run eagerly: dynamo would trace them again for ghosts, or
        without gradients, for nothing but shapes."""
        module, program = self.module, self.program
        ghost_in = tuple(
            Ghost(torch.empty(shape, dtype=dtype, device="meta"), self.device) for shape, dtype in received or ()
        )
        dtypes = self.sharding.compute_dtypes() if self.sharding is not None else None
        if not self.cut.parallelism.tensor_parallel:  # DTensor's hooks and ops cannot run on ghosts: probed for real
            with torch.no_grad(), everything_ghosted(module, self.device, dtypes), program.shape_probe("ghost"), \
                    metrics_set_aside(module_metrics(module)), fsdp_hooks_suspended(module), _eager():
                try:
                    out = program.run_stage(stage, rows, ghost_in, probing=True)
                    return tuple((tuple(t.shape), t.dtype) for t in out)
                except (GhostValueError, NotImplementedError, RuntimeError) as err:
                    log.debug("stage %d does not run on ghosts (%s): measuring its shapes for real", stage, err)
        real_in = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in received or ())
        with torch.no_grad(), untouched(module, self.device), program.shape_probe("real"), _eager():
            out = program.run_stage(stage, rows, real_in)
            return tuple((tuple(t.shape), t.dtype) for t in out)

    def _check_trainable(self) -> None:
        """At the first batch of each epoch (callbacks freeze, unfreeze and add parameter groups at epoch starts): if
        no stage has a parameter that requires a gradient, fail as one process fails in ``loss.backward()`` (instead
        of running the schedule and stepping nothing), and align the optimizers' parameter groups over the pipeline
        (:func:`~lightning_pipe._lightning.callbacks.align_param_groups`). Small collectives over the pipeline, once per
        epoch: every rank raises."""
        trainer = self.module.trainer
        epoch = trainer.current_epoch
        if self._trainable_checked == epoch:
            return
        self._trainable_checked = epoch
        align_param_groups(trainer.optimizers, self.pipeline.group, self.device, trainer.callbacks)
        count = torch.tensor([float(len(self.gradients.trainable()))], device=self.device)
        with _watchdog.waiting(lambda: "the other pipeline ranks at the epoch's start (counting trainable parameters)"):
            dist.all_reduce(count, group=self.pipeline.group)
        if count.item() == 0:
            raise RuntimeError(
                "element 0 of tensors does not require grad and does not have a grad_fn (PipelineStrategy: no"
                " parameter of any pipeline stage requires a gradient, so the loss has nothing to train. Unfreeze"
                " some parameters, or run `trainer.validate` instead of `fit`.)"
            )

    def _warn_unweighted(self, weighing: LossWeighing) -> None:
        """Warn once per run when the loss averages over a data-dependent count it is not weighted by."""
        message = weighing.warning()
        if message is not None and not self._mean_warned:
            self._mean_warned = True
            warn_unweighted(message)

    def _waiting_for_last_stage(self) -> AbstractContextManager[None]:
        rank = self.pipeline.last_stage_rank
        return _watchdog.waiting(lambda: f"the step's loss and logs from the last stage (pipeline rank {rank})")

    def _sync_buffers(self) -> None:
        """With several replicas, start each batch from replica 0's buffers (BatchNorm statistics), as DDP does."""
        if dist.get_world_size(self.dp_group) == 1:
            return
        for buffer in self.module.buffers():
            dist.broadcast(buffer, group_src=0, group=self.dp_group)

def _ghost_result(step: Callable[..., object]) -> Exception:
    name = getattr(step, "__name__", "the step")
    return BackboneCallError(not_computed_by_last_stage(
        f"`{name}` returns values", "Return values computed from the backbone's output and the batch."
    ))


def _eager() -> AbstractContextManager[None]:
    """Compiled code runs eagerly inside (the shape probes')."""
    return torch.compiler.set_stance("force_eager")


def _train_payload(
    module: pl.LightningModule, weighing: LossWeighing, recorder: LogRecorder, metrics: list[tuple[str, Metric]]
) -> tuple[tuple[Tensor, Tensor], list]:
    """What the last stage sends the other ranks after a training step: the full-batch loss, the gradients' factor
    ([Note: token-weighted losses]) and the logs reduced over the microbatches."""
    loss, scale = weighing.result()
    return (loss, torch.tensor(scale, dtype=torch.float64)), recorder.reduce(module, metrics)
