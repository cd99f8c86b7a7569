"""The one module that talks to ``torch.distributed.pipelining``.

:class:`StagePipeline` owns this rank's stages and runs a whole batch through the chosen schedule, either
with backward (training) or forward-only (evaluation). Stage shapes are given to torch statically: they are
inferred with fake tensors (no real compute, no buffer updates) and passed along the pipeline once per distinct
batch shape, so torch never runs its own shape-inference forward, which would update BatchNorm statistics and
call the loss on uninitialised data. One schedule is kept per (microbatch shape, microbatch count, mode), so a
ragged last batch gets its own correctly-shaped schedule instead of reusing stale buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from itertools import chain
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
from torch.func import functional_call

from lightning_pipe import _compat
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import ScheduleSpec
from lightning_pipe.timeline import TimelineRecorder

log = logging.getLogger(__name__)

_Meta = tuple[tuple[int, ...], torch.dtype]


class StagePipeline:
    """This rank's pipeline stages and the schedules that drive them.

    Args:
        stage_modules: ``{stage_index: module}`` for the stages this rank runs.
        layout: the full stage layout, identical on every rank.
        schedule: the schedule to run.
        num_microbatches: microbatches per full batch.
        group: the process group of this pipeline (one replica).
        device: the device the stages run on.
        wrap: ``(module, stage) -> module`` run by the stage (e.g. DDP); shapes are inferred on the unwrapped one.
    """

    def __init__(
        self,
        stage_modules: dict[int, nn.Module],
        layout: StageLayout,
        schedule: ScheduleSpec,
        num_microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        wrap: Optional[Callable[[nn.Module, int], nn.Module]] = None,
    ) -> None:
        self._wrap = wrap or (lambda module, stage: module)
        self.schedule = schedule
        self.schedule_class = get_schedule_class(schedule.name)
        self.stage_modules = stage_modules
        self.layout = layout
        self.num_microbatches = num_microbatches
        self.group = group
        self.device = device
        self.pipeline_rank = dist.get_rank(group)
        self.first_stage_rank = layout.stage_rank(0)
        self.last_stage_rank = layout.stage_rank(layout.num_stages - 1)
        self._schedules: dict[tuple, Any] = {}
        self._loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
        self._targets: dict[int, torch.Tensor] = {}

    @property
    def has_first_stage(self) -> bool:
        return self.pipeline_rank == self.first_stage_rank

    @property
    def has_last_stage(self) -> bool:
        return self.pipeline_rank == self.last_stage_rank

    def check_schedule(self) -> None:
        """Build the schedule once for the configured microbatch count so torch's own checks run at setup."""
        self._make_schedule(self._make_stages(None), self.num_microbatches, training=True)

    # ------------------------------------------------------------------ running
    def train_step(
        self,
        inputs: Sequence[torch.Tensor],
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        timeline: Optional[TimelineRecorder] = None,
    ) -> None:
        """Forward and backward of one batch; gradients accumulate into ``.grad``. ``loss_fn(output, rows)`` gets
        the last stage's output of a microbatch and the batch rows it holds. With ``timeline``, the schedule's step
        is traced into it (:mod:`lightning_pipe.timeline`; a barrier over the pipeline group)."""
        schedule = self._schedule_for(inputs, num_microbatches, training=True)
        batch_size = int(inputs[0].shape[0])
        target = self._targets.get(batch_size)
        if target is None:
            target = self._targets[batch_size] = torch.arange(batch_size, device=self.device)
        self._loss_fn = loss_fn
        try:
            with timeline.trace(schedule) if timeline is not None else nullcontext():
                schedule.step(*(inputs if self.has_first_stage else ()), target=target, return_outputs=False)
        finally:
            self._loss_fn = None

    def eval_step(self, inputs: Sequence[torch.Tensor], num_microbatches: int) -> Optional[torch.Tensor]:
        """Forward-only pass of one batch. Returns the merged backbone output on the last stage, else ``None``."""
        schedule = self._schedule_for(inputs, num_microbatches, training=False)
        output = schedule.eval(*(inputs if self.has_first_stage else ()))
        return output if self.has_last_stage else None

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    # ------------------------------------------------------------------ building
    def _schedule_for(self, inputs: Sequence[torch.Tensor], num_microbatches: int, training: bool) -> Any:
        rows = int(inputs[0].shape[0]) // num_microbatches
        first_meta = tuple(((rows, *t.shape[1:]), t.dtype) for t in inputs)
        key = (first_meta, num_microbatches, training, torch.is_autocast_enabled(self.device.type))
        schedule = self._schedules.get(key)
        if schedule is None:
            metas = self._stage_metas(first_meta, training)
            schedule = self._make_schedule(self._make_stages(metas, training), num_microbatches, training)
            self._schedules[key] = schedule
            log.debug(
                "pipeline rank %d: new %s schedule for %d microbatches of shape %s (stage shapes %s)",
                self.pipeline_rank, "training" if training else "evaluation", num_microbatches, first_meta, metas,
            )
        return schedule

    def _make_stages(self, metas: Optional[dict[int, tuple]], training: bool = True) -> list[PipelineStage]:
        stages = []
        for index, module in self.stage_modules.items():
            kwargs = {}
            if metas is not None:
                inputs, outputs = metas[index]
                grads_in = training and index > 0
                kwargs = {
                    "input_args": tuple(_meta_tensor(m, requires_grad=grads_in) for m in inputs),
                    "output_args": tuple(_meta_tensor(m, requires_grad=training) for m in outputs),
                }
            runtime = self._wrap(module, index)
            num_stages = self.layout.num_stages
            stages.append(PipelineStage(runtime, index, num_stages, self.device, group=self.group, **kwargs))
        return stages

    def _make_schedule(self, stages: list[PipelineStage], num_microbatches: int, training: bool) -> Any:
        loss_fn = self._loss if training else None
        multi = self.schedule.multi_stage
        try:
            return _construct(self.schedule_class, stages, num_microbatches, loss_fn, multi)
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
            return _construct(fallback, stages, num_microbatches, loss_fn, multi)

    def _stage_metas(self, first_inputs: tuple[_Meta, ...], training: bool) -> dict[int, tuple]:
        """Input and output shapes of every local stage for one microbatch.

        Walks the stages in order: the rank owning stage ``s`` infers its output with fake tensors and
        broadcasts it to the pipeline, since it is the next stage's input.
        """
        metas: dict[int, tuple] = {}
        inputs = first_inputs
        for stage in range(self.layout.num_stages):
            owner = self.layout.stage_rank(stage)
            outputs: Any = None
            if owner == self.pipeline_rank:
                outputs = _infer_outputs(self.stage_modules[stage], inputs, self.device, stage)
            if stage < self.layout.num_stages - 1 and self.layout.pipeline_size > 1:
                box = [outputs]
                dist.broadcast_object_list(box, group_src=owner, group=self.group)
                outputs = box[0]
            if owner == self.pipeline_rank:
                metas[stage] = (inputs, outputs)
            inputs = outputs
        return metas


def _construct(cls: type, stages: list, n: int, loss_fn: Optional[Callable], multi: bool) -> Any:
    if multi:
        return cls(stages, n, loss_fn=loss_fn, scale_grads=False)
    if issubclass(cls, PipelineScheduleSingle) and len(stages) != 1:
        raise ValueError(f"{cls.__name__} runs one stage per process, got {len(stages)}.")
    return cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)


def _meta_tensor(meta: _Meta, requires_grad: bool) -> torch.Tensor:
    shape, dtype = meta
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad and dtype.is_floating_point)


def _infer_outputs(module: nn.Module, inputs: tuple[_Meta, ...], device: torch.device, stage: int) -> tuple[_Meta, ...]:
    """Output shapes of ``module`` for inputs of the given shapes, computed on fake tensors: no real compute,
    and parameters and buffers (BatchNorm statistics) are not touched."""
    with torch.inference_mode(False), _compat.fake_tensor_mode(allow_non_fake_inputs=True) as mode:
        state = {
            name: mode.from_tensor(t)
            for name, t in chain(
                module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
            )
        }
        args = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in inputs)
        output = functional_call(module, state, args, tie_weights=False)
    outputs = output if isinstance(output, tuple) else (output,)
    if not all(isinstance(o, torch.Tensor) for o in outputs) or len(outputs) != 1:
        raise TypeError(
            f"Pipeline stage {stage} must return a single tensor (its last module is"
            f" `{type(list(module.children())[-1]).__name__}`), got {type(output).__name__}. Make every backbone"
            " module that ends a stage return one tensor, or move the split with `balance=`."
        )
    return tuple((tuple(o.shape), o.dtype) for o in outputs)
