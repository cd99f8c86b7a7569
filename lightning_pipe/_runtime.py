"""The runtime of one ``fit``/``validate``/``test``/``predict``: everything the strategy builds in ``setup``.

:class:`PipelineRuntime` owns this rank's part of the model (the :class:`~lightning_pipe._backbone.LocalBackbone`
and its :class:`~lightning_pipe.partition.StageLayout`), the :class:`~lightning_pipe._pipeline.StagePipeline` that
runs it, the microbatch policy, the channels that carry each step's logs from the last stage, the trainable
parameters and the gradients kept aside between ``training_step`` and ``backward``. The strategy's hooks call it.

A training batch, from Lightning's loop to the optimizer step:

1. ``Strategy.training_step`` → :meth:`PipelineRuntime.train_batch`. Every rank runs the user's ``training_step`` up
   to the backbone call to find the backbone input (``capture_inputs``) and the batch size, which fixes the
   microbatch count (:class:`~lightning_pipe._microbatches.MicrobatchPolicy`).
2. The schedule runs forward and backward over the microbatches (``StagePipeline.train_step``). The first stage
   feeds the input; on the last stage the loss function runs the user's ``training_step`` on the microbatch's rows
   with the backbone call answered by the stage output (:func:`~lightning_pipe._backbone.run_with_output`), and
   returns ``loss / (microbatches * accumulate_grad_batches)``: exact under gradient accumulation.
3. The gradients the schedule computed are set aside and the earlier ``.grad`` put back (:class:`Gradients`),
   because Lightning calls ``zero_grad`` next. The last stage's logs are reduced over the microbatches, sent to every
   rank of the pipeline (:class:`~lightning_pipe._logging.LogChannel`) and logged there; the full-batch loss is
   returned on every rank.
4. Lightning calls ``zero_grad``, then ``Strategy.backward`` → :meth:`Gradients.hand_back` adds the kept gradients,
   between the ``on_before_backward`` and ``on_after_backward`` hooks.
5. Lightning's precision plugin clips (by the norm over the pipeline, :mod:`lightning_pipe._precision`) and steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe import timeline as _timeline
from lightning_pipe._backbone import LocalBackbone, capture_inputs, loss_of, run_with_output, slice_batch
from lightning_pipe._logging import LogChannel, LogRecorder, replay
from lightning_pipe._metrics import module_metrics, per_batch_metrics
from lightning_pipe._microbatches import MicrobatchPolicy
from lightning_pipe._pipeline import StagePipeline
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import ScheduleSpec

log = logging.getLogger(__name__)


class Gradients:
    """The gradients a training step computed, kept aside across Lightning's ``zero_grad``.

    Lightning runs ``training_step``, then ``zero_grad``, then ``backward``. The schedule runs backward inside
    ``training_step``, so the gradients it writes would be wiped: they are taken out of ``.grad`` right after the
    schedule (the earlier ``.grad``, accumulated over earlier batches, is put back) and added in ``backward``.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self._pending: Optional[list[Optional[Tensor]]] = None

    @contextmanager
    def computed_aside(self) -> Iterator[None]:
        """Let the block write fresh gradients, then keep them aside and restore the earlier ones."""
        previous = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
        finally:
            self._pending = [p.grad for p in self.params]
            for p, grad in zip(self.params, previous):
                p.grad = grad

    def hand_back(self) -> None:
        """Add the kept gradients to ``.grad`` (called by ``Strategy.backward``, after ``zero_grad``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for param, grad in zip(self.params, pending):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)

    def discard(self) -> None:
        self._pending = None


class PipelineRuntime:
    """One ``Trainer`` call's pipeline on this rank; built by ``PipelineStrategy.setup``.

    Args:
        module: the LightningModule, already split (its backbone is ``backbone``).
        backbone: this rank's part of the backbone.
        schedule: the schedule to run.
        stage_modules: ``{stage: module}`` for this rank's stages.
        microbatches: the microbatch policy.
        pp_group: this rank's pipeline (one replica); ``dp_group``: its replicas (``None`` with one).
        device: the device the stages run on.
        wrap: ``(module, stage) -> module`` that torch's stage runs (activation checkpointing, DDP).
        amp_scaler: the precision plugin's ``GradScaler``, if any: the microbatch losses are scaled by it.
        timeline: what ``timeline=`` traces, or ``None``.
    """

    def __init__(
        self,
        module: Any,
        backbone: LocalBackbone,
        schedule: ScheduleSpec,
        stage_modules: dict[int, nn.Module],
        microbatches: MicrobatchPolicy,
        pp_group: dist.ProcessGroup,
        dp_group: Optional[dist.ProcessGroup],
        device: torch.device,
        wrap: Callable[[nn.Module, int], nn.Module],
        amp_scaler: Any = None,
        timeline: Optional[_timeline.TimelineOptions] = None,
    ) -> None:
        self.module = module
        self.backbone = backbone
        self.schedule = schedule
        self.microbatches = microbatches
        self.device = device
        self.dp_group = dp_group
        self.amp_scaler = amp_scaler
        self.timeline = timeline
        self.pipeline = StagePipeline(
            stage_modules, backbone.layout, schedule, microbatches.nominal, pp_group, device, wrap=wrap
        )
        self.pipeline.check_schedule()
        channel = (pp_group, self.pipeline.last_stage_rank, self.layout.pipeline_size, device)
        self._train_channel, self._eval_channel = LogChannel(*channel), LogChannel(*channel)
        self.gradients = Gradients([p for p in module.parameters() if p.requires_grad])
        self._timeline_done = False

    @property
    def layout(self) -> StageLayout:
        return self.backbone.layout

    # ------------------------------------------------------------------------------------------------ training
    def train_batch(self, batch: Any, *rest: Any, **kwargs: Any) -> Tensor:
        """Forward and backward of one training batch; returns the full-batch loss on every rank. The gradients are
        kept aside until :meth:`Gradients.hand_back`."""
        module, backbone, pipeline = self.module, self.backbone, self.pipeline
        step = module.training_step
        inputs = capture_inputs(module, backbone, step, batch, *rest, **kwargs)
        batch_size = int(inputs[0].shape[0])
        num_microbatches = self.microbatches.for_batch(batch_size)
        # Lightning divides the returned loss by `accumulate_grad_batches` and back-propagates that; the schedule
        # back-propagates each microbatch loss, so scale it by the same factor and by the microbatch count.
        grad_scale = 1.0 / (num_microbatches * module.trainer.accumulate_grad_batches)
        recorder = LogRecorder()
        losses: list[Tensor] = []

        def microbatch_loss(output: Tensor, rows: Tensor) -> Tensor:
            start, stop = int(rows[0]), int(rows[-1]) + 1
            sub_batch = slice_batch(batch, batch_size, start, stop)
            recorder.rows = stop - start
            with recorder.installed(module):
                result = run_with_output(backbone, output, step, sub_batch, *rest, **kwargs)
            loss = loss_of(result)
            losses.append(loss.detach())
            loss = loss * grad_scale
            return self.amp_scaler.scale(loss) if self.amp_scaler is not None else loss

        recorder_for_step = self._timeline_recorder()
        metrics = module_metrics(module) if pipeline.has_last_stage else []  # only the last stage runs the step
        with per_batch_metrics(metrics, num_microbatches), self.gradients.computed_aside():
            pipeline.train_step(inputs, num_microbatches, microbatch_loss, recorder_for_step)
        payload = None
        if pipeline.has_last_stage:
            payload = (torch.stack(losses).mean(), recorder.reduce(module, metrics))
        loss, entries = self._train_channel.share(payload)
        replay(module, entries, self.device, self.dp_group)
        if recorder_for_step is not None:
            self._report_timeline(recorder_for_step)
        return loss.to(self.device)

    # ------------------------------------------------------------------------------------------------ evaluation
    def eval_batch(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A forward-only pass of one batch through ``step`` (``validation_step``, ...); returns the step's result on
        every rank."""
        module, backbone, pipeline = self.module, self.backbone, self.pipeline
        inputs = capture_inputs(module, backbone, step, *args, **kwargs)
        num_microbatches = self.microbatches.for_batch(int(inputs[0].shape[0]))
        output = pipeline.eval_step(inputs, num_microbatches)
        payload = None
        if pipeline.has_last_stage:
            recorder = LogRecorder()
            recorder.rows = int(inputs[0].shape[0])
            with recorder.installed(module):
                result = run_with_output(backbone, output, step, *args, **kwargs)
            payload = (result, recorder.reduce(module))
        result, entries = self._eval_channel.share(payload)
        replay(module, entries, self.device, self.dp_group)
        return apply_to_collection(result, Tensor, lambda t: t.to(self.device))

    # ------------------------------------------------------------------------------------------------ timeline
    def _timeline_recorder(self) -> Optional[_timeline.TimelineRecorder]:
        """A recorder if this is the batch ``timeline=`` asks for: the first one of that ``global_step``."""
        options = self.timeline
        if options is None or self._timeline_done or self.module.trainer.global_step != options.step:
            return None
        self._timeline_done = True
        return _timeline.TimelineRecorder(self.pipeline.group, self.device)

    def _report_timeline(self, recorder: _timeline.TimelineRecorder) -> None:
        """Global rank 0 writes the trace and logs the bubble and busy times. Every rank calls it (collectives)."""
        assert self.timeline is not None
        trainer = self.module.trainer
        dirpath = self.timeline.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir broadcasts
        write = trainer.is_global_zero
        summary = _timeline.report(recorder.events, self.pipeline.group, dirpath, write=write, png=self.timeline.png)
        if summary is None or not write:
            return
        metrics = _timeline.timeline_metrics(summary)
        ideal = ""
        if self.schedule.textbook_bubble:
            value = _timeline.ideal_bubble_fraction(
                self.layout.pipeline_size, summary["num_microbatches"], self.layout.stages_per_rank
            )
            metrics["timeline/ideal_bubble_fraction"] = value
            ideal = f" (ideal {value:.1%})"
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"PipelineStrategy timeline of step {trainer.global_step}: measured bubble {summary['bubble_fraction']:.1%}"
            f"{ideal} over {summary['span_s'] * 1e3:.1f} ms; wrote {', '.join(summary['files']) or 'nothing'}"
        )
