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
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Optional

import torch
from torch import nn


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


def _time_one(  # noqa: ANN202
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

