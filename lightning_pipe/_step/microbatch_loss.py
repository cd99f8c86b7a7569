"""The loss each microbatch of a training step back-propagates, computed where the last stage's forward runs the
user's step to its end ([Note: the last stage's loss] in :mod:`lightning_pipe._step.program`).

:class:`MicrobatchLoss` is the runtime's :class:`~lightning_pipe._step.program.StageLoss` for one batch: around each
microbatch's step it records what the step logs and watches the loss code for data-dependent means; from what the
step returns it takes the loss, weights it by what the microbatch holds ([Note: token-weighted losses]) and scales it
by the microbatch count and Lightning's gradient accumulation (and the AMP scaler, if any).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from lightning_pipe._calls.batch import loss_of
from lightning_pipe._lightning.log import LogRecorder
from lightning_pipe._step.loss_weights import LossWeighing, MeanObserver, whole

if TYPE_CHECKING:
    from lightning_pipe._step.last_backward import ReductionOverlap


class MicrobatchLoss:
    """One training batch's microbatch losses on the last stage.

    Args:
        module: the LightningModule (``self.log`` goes to ``recorder`` while a microbatch's step runs).
        recorder: what the step logs, per microbatch.
        weighing: the microbatches' loss weights (it knows the batch's microbatch count).
        grad_scale: ``1 / (microbatches * accumulate_grad_batches)``: Lightning back-propagates the loss divided by
            ``accumulate_grad_batches``, the schedule each microbatch's.
        recorder: what the step logs, per microbatch.
        weighing: the microbatches' loss weights.
        overlap: the reductions that overlap the last backward: they get the step's gradient scale once the last
            microbatch's loss is known ([Note: overlapped reductions]).
        amp_scaler: the precision plugin's ``GradScaler``, if any.
        on_last: called once the last microbatch's loss is in (the step's result is then known: [Note: the step's
            result, sent before the schedule ends]).
    """

    def __init__(
        self, module: nn.Module, recorder: LogRecorder, weighing: LossWeighing, *, grad_scale: float,
        overlap: Optional[ReductionOverlap], amp_scaler: Optional[torch.amp.GradScaler],
        on_last: Optional[Callable[[], None]] = None,
    ) -> None:
        self.module = module
        self.grad_scale = grad_scale
        self.recorder = recorder
        self.weighing = weighing
        self.overlap = overlap
        self.amp_scaler = amp_scaler
        self.on_last = on_last
        self._observer: Optional[MeanObserver] = None

    @contextmanager
    def around_step(self, rows: int) -> Iterator[None]:
        self.recorder.start(rows)
        with self.recorder.installed(self.module), self.weighing.observing() as observer:
            self._observer = observer
            yield

    def around_block(self) -> AbstractContextManager[None]:
        assert self._observer is not None
        return self._observer.paused()

    def loss(self, result: object, anchor: Optional[Tensor]) -> Tensor:
        assert self._observer is not None
        loss = loss_of(result)
        weighing = self.weighing
        weight, factor = weighing.add(result, loss, self._observer)
        self._observer = None
        if weight is not None:
            self.recorder.weigh_loss(loss, weight)
        if len(weighing.losses) == weighing.num_microbatches:
            if self.overlap is not None:
                self.overlap.share_scale(weighing.result()[1])  # the other stages reduce with it as they finish
            if self.on_last is not None:
                self.on_last()
        loss = whole(loss)  # a `loss_parallel` loss as the plain tensor every tensor rank holds
        if factor:
            loss = loss * (factor * self.grad_scale)
        else:  # a microbatch that weighs nothing back-propagates an exact zero (its mean may be 0 / 0)
            loss = anchor.sum() * 0.0 if anchor is not None else loss.detach() * 0.0
        return self.amp_scaler.scale(loss) if self.amp_scaler is not None else loss
