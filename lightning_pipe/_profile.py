"""Timing each backbone module, for ``balance="time"``.

The modules are timed one after the other on one microbatch of a real batch, on the device training will use:
each module is moved there, run forward and backward a few times after a warm-up, and moved back, so the whole
model never has to fit on the device at once. The last module is timed together with the loss the user's
``training_step`` computes from its output, since the last stage runs that too: a cross-entropy over a large
vocabulary costs as much as a block. Buffers (BatchNorm statistics) and the random number generators are
restored afterwards, and gradients are cleared: profiling leaves no trace in training (the strategy also sets
torchmetrics states aside around it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe import _compat
from lightning_pipe._backbone import LocalBackbone, capture_inputs, loss_of, run_with_output, slice_batch
from lightning_pipe._logging import LogRecorder
from lightning_pipe._metrics import metrics_set_aside, module_metrics
from lightning_pipe._microbatches import MicrobatchPolicy


def measure_backbone(
    module: Any,
    parent: nn.Module,
    name: str,
    backbone: nn.Sequential,
    *,
    device: torch.device,
    microbatches: MicrobatchPolicy,
    batch_to_device: Callable[[Any], Any],
    step_context: Callable[[], AbstractContextManager],
) -> list[float]:
    """``balance="time"``: every backbone module's forward+backward seconds, measured on global rank 0 on one
    microbatch of the running stage's first batch and shared with every rank (a collective)."""
    require_real_weights(list(backbone))  # every rank holds the whole model here, so every rank refuses
    costs: Optional[list[float]] = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        profiled = profiling_batch(module, parent, name, backbone, device, microbatches, batch_to_device)
        with profiled as (inputs, loss), metrics_set_aside(module_metrics(module)):
            costs = time_modules(list(backbone), inputs, device, context=step_context, loss=loss)
        shown = ", ".join(f"{c * 1e3:.2f}" for c in costs)
        rank_zero_info(f"PipelineStrategy: forward+backward ms per module: {shown}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [costs]
        dist.broadcast_object_list(box, src=0)
        costs = box[0]
    assert costs is not None
    return costs


@contextmanager
def profiling_batch(
    module: Any,
    parent: nn.Module,
    name: str,
    backbone: nn.Sequential,
    device: torch.device,
    microbatches: MicrobatchPolicy,
    batch_to_device: Callable[[Any], Any],
) -> Iterator[tuple[torch.Tensor, Optional[Callable[[torch.Tensor], torch.Tensor]]]]:
    """One microbatch of the first batch of the running stage's data, before the split (for profiling).

    Yields the backbone input of that microbatch, on ``device`` after the batch transfer hooks (``batch_to_device``),
    and, when fitting, the function that turns the backbone's output on it into the ``training_step`` loss (``None``
    otherwise: evaluation has no loss). Logs the step makes here are dropped. The module's parts outside the
    backbone are moved to the device, where training puts them anyway.
    """
    trainer = module.trainer
    fn = trainer.state.fn
    loop, step = {
        TrainerFn.FITTING: (trainer.fit_loop, module.training_step),
        TrainerFn.VALIDATING: (trainer.validate_loop, module.validation_step),
        TrainerFn.TESTING: (trainer.test_loop, module.test_step),
        TrainerFn.PREDICTING: (trainer.predict_loop, module.predict_step),
    }[fn]
    loaders = _compat.loop_dataloaders(loop)
    loader = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    with torch.random.fork_rng():
        batch = next(iter(loader))
    # The step runs as in training: on the device, with the batch passed through the transfer hooks. An empty
    # stand-in answers the backbone call, so moving the module moves none of the backbone's weights.
    head = LocalBackbone(backbone, [], len(backbone))
    setattr(parent, name, head)
    try:
        module.to(device)
        batch = batch_to_device(batch)
        (inputs,) = capture_inputs(module, head, step, batch, 0)
        batch_size = int(inputs.shape[0])
        rows = batch_size // microbatches.for_batch(batch_size)
        if fn != TrainerFn.FITTING:
            yield inputs[:rows], None
            return
        sub_batch = slice_batch(batch, batch_size, 0, rows)

        def loss(output: torch.Tensor) -> torch.Tensor:
            with LogRecorder().installed(module):
                return loss_of(run_with_output(head, output, step, sub_batch, 0))

        yield inputs[:rows], loss
    finally:
        setattr(parent, name, backbone)


def time_modules(
    modules: list[nn.Module],
    first_input: torch.Tensor,
    device: torch.device,
    repeats: int = 5,
    warmup: int = 2,
    context: Optional[Callable[[], AbstractContextManager]] = None,
    loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> list[float]:
    """Median seconds of forward + backward of each module, each fed the previous module's real output.

    ``context`` makes the context each module runs in (e.g. the precision plugin's autocast). ``loss`` maps the
    last module's output to the loss training back-propagates; its cost is counted in the last module's. Without
    it, every module is back-propagated from the sum of its output.
    """
    require_real_weights(modules)
    costs = []
    x = first_input.to(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        for index, module in enumerate(modules):
            home = next((t.device for t in module.parameters()), None) or next(
                (t.device for t in module.buffers()), device
            )
            module.to(device)
            saved = {name: b.detach().clone() for name, b in module.named_buffers()}
            with context() if context is not None else nullcontext():
                tail = loss if index == len(modules) - 1 else None
                cost, x = _time_one(module, x, device, repeats, warmup, tail)
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(saved[name])
            module.zero_grad(set_to_none=True)
            module.to(home)
            costs.append(cost)
    return costs


def require_real_weights(modules: list[nn.Module]) -> None:
    """Timing needs real weights: refuse modules on the meta device, naming the fix."""
    if any(p.is_meta for m in modules for p in m.parameters()):
        raise ValueError(
            "`PipelineStrategy(balance='time')` times every module with its real weights, but the model is on the"
            " meta device. Use `balance='parameters'`, or build the model on a real device."
        )


def _time_one(
    module: nn.Module,
    x: torch.Tensor,
    device: torch.device,
    repeats: int,
    warmup: int,
    loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
):
    times = []
    for i in range(warmup + repeats):
        inp = x.detach().requires_grad_(x.is_floating_point())
        _sync(device)
        start = time.perf_counter()
        out = module(inp)
        (loss(out) if loss is not None else out.float().sum()).backward()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    with torch.no_grad():
        out = module(x)
    return statistics.median(times), out.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

