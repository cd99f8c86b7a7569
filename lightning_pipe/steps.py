"""One batch through the pipeline: the user's step around ``torch.distributed.pipelining``.

Training: every rank runs the step up to the backbone call to find the backbone input (the first stage feeds
it to the schedule); the last stage runs the whole step once per microbatch, with the backbone call answered by
the stage output, and the microbatch losses drive backward. Evaluation: a forward-only pass, then the step once
on the whole batch on the last stage. Either way the step's logs are reduced, shared with every rank of the
pipeline and logged there (:mod:`lightning_pipe.logging_bridge`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe.backbone import (
    BackboneCallError,
    LocalBackbone,
    batch_size_of,
    capture_input,
    run_with_output,
    slice_batch,
)
from lightning_pipe.logging_bridge import LogRecorder, module_metrics, per_batch_metrics, replay

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pipe.strategy import PipelineStrategy


def train_batch(strategy: PipelineStrategy, batch: Any, *rest: Any, **kwargs: Any) -> Tensor:
    """Forward and backward of one training batch; returns the full-batch loss on every rank."""
    module = strategy.lightning_module
    pipeline = strategy.pipeline
    backbone = strategy._backbone()
    step = module.training_step
    inputs = capture_inputs(module, backbone, step, batch, *rest, **kwargs)
    batch_size = int(inputs[0].shape[0])
    num_microbatches = strategy._microbatch_count(batch_size)
    # Lightning divides the returned loss by `accumulate_grad_batches` and back-propagates that; the schedule
    # back-propagates each microbatch loss, so scale it by the same factor and by the microbatch count.
    grad_scale = 1.0 / (num_microbatches * module.trainer.accumulate_grad_batches)
    amp_scaler = getattr(strategy.precision_plugin, "scaler", None)
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
        return amp_scaler.scale(loss) if amp_scaler is not None else loss

    timeline = strategy._timeline_recorder()
    metrics = module_metrics(module) if pipeline.has_last_stage else []  # only the last stage runs the step
    with per_batch_metrics(metrics, num_microbatches):
        strategy._pending_grads = pipeline.train_step(
            inputs, num_microbatches, microbatch_loss, strategy._params, timeline
        )
    payload = None
    if pipeline.has_last_stage:
        payload = (torch.stack(losses).mean(), recorder.reduce(module, metrics))
    loss, entries = strategy._train_channel.share(payload)
    replay(module, entries, strategy.root_device, strategy.device_mesh.get_group("dp"))
    if timeline is not None:
        strategy._report_timeline(timeline)
    return loss.to(strategy.root_device)


def eval_batch(strategy: PipelineStrategy, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A forward-only pass of one batch; returns the step's result on every rank."""
    module = strategy.lightning_module
    pipeline = strategy.pipeline
    backbone = strategy._backbone()
    inputs = capture_inputs(module, backbone, step, *args, **kwargs)
    num_microbatches = strategy._microbatch_count(int(inputs[0].shape[0]))
    output = pipeline.eval_step(inputs, num_microbatches)
    payload = None
    if pipeline.has_last_stage:
        recorder = LogRecorder()
        recorder.rows = int(inputs[0].shape[0])
        with recorder.installed(module):
            result = run_with_output(backbone, output, step, *args, **kwargs)
        payload = (result, recorder.reduce(module))
    result, entries = strategy._eval_channel.share(payload)
    replay(module, entries, strategy.root_device, strategy.device_mesh.get_group("dp"))
    return apply_to_collection(result, Tensor, lambda t: t.to(strategy.root_device))


def capture_inputs(
    module: pl.LightningModule, backbone: LocalBackbone, step: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Tensor, ...]:
    """The backbone input of this batch, found by running the step up to the backbone call."""
    with LogRecorder().installed(module):  # the last stage logs this part per microbatch
        inputs, input_kwargs = capture_input(backbone, step, *args, **kwargs)
    if input_kwargs or len(inputs) != 1 or not isinstance(inputs[0], Tensor):
        raise BackboneCallError(
            "The pipelined backbone is an `nn.Sequential` and must be called with exactly one tensor, batch"
            f" dimension first; it was called with {len(inputs)} positional and {len(input_kwargs)} keyword"
            " arguments."
        )
    batch_size_of(inputs, input_kwargs)
    return inputs


def loss_of(result: Any) -> Tensor:
    """The loss in what ``training_step`` returned."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise BackboneCallError(
            "Under `PipelineStrategy`, `training_step` must return the loss tensor (or a dict with 'loss') for every"
            f" microbatch; it returned {type(result).__name__}. Skipping a step by returning None is not supported."
        )
    return loss


@contextmanager
def profiling_batch(
    strategy: PipelineStrategy, parent: nn.Module, name: str, backbone: nn.Sequential
) -> Iterator[tuple[Tensor, Optional[Callable[[Tensor], Tensor]]]]:
    """One microbatch of the first batch of the running stage's data, before the split (for profiling).

    Yields the backbone input of that microbatch, on the strategy's device after the batch transfer hooks, and,
    when fitting, the function that turns the backbone's output on it into the ``training_step`` loss (``None``
    otherwise: evaluation has no loss). Logs the step makes here are dropped. The module's parts outside the
    backbone are moved to the device, where training puts them anyway.
    """
    module = strategy.lightning_module
    trainer = module.trainer
    fn = trainer.state.fn
    # The loop of the running stage knows the user's loader however it was given (loader, datamodule or module
    # hook); `_data_source` is Lightning's private handle on it.
    loop, step = {
        TrainerFn.FITTING: (trainer.fit_loop, module.training_step),
        TrainerFn.VALIDATING: (trainer.validate_loop, module.validation_step),
        TrainerFn.TESTING: (trainer.test_loop, module.test_step),
        TrainerFn.PREDICTING: (trainer.predict_loop, module.predict_step),
    }[fn]
    loaders = loop._data_source.dataloader()
    loader = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    with torch.random.fork_rng():
        batch = next(iter(loader))
    # The step runs as in training: on the device, with the batch passed through the transfer hooks. An empty
    # stand-in answers the backbone call, so moving the module moves none of the backbone's weights.
    head = LocalBackbone(backbone, [], len(backbone))
    setattr(parent, name, head)
    try:
        module.to(strategy.root_device)
        batch = strategy.batch_to_device(batch)
        (inputs,) = capture_inputs(module, head, step, batch, 0)
        batch_size = int(inputs.shape[0])
        rows = batch_size // strategy._microbatch_count(batch_size)
        if fn != TrainerFn.FITTING:
            yield inputs[:rows], None
            return
        sub_batch = slice_batch(batch, batch_size, 0, rows)

        def loss(output: Tensor) -> Tensor:
            with LogRecorder().installed(module):
                return loss_of(run_with_output(head, output, step, sub_batch, 0))

        yield inputs[:rows], loss
    finally:
        setattr(parent, name, backbone)
