"""Running a module for a look (a shape probe, a profile) without changing what training will see.

:func:`untouched` is the one way the package does it: the random state (the CPU's and the device's) is forked, the
module's buffers (BatchNorm statistics) are put back, its torchmetrics states are set aside, and, if asked, the
gradients the run wrote are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_pipe._lightning.metrics import metrics_set_aside, module_metrics


@contextmanager
def untouched(module: nn.Module, device: torch.device, drop_grads: bool = False) -> Iterator[None]:
    """Run the block on ``module`` (on ``device``) leaving its random state, buffer values and metric states as they
    were; with ``drop_grads``, the module's gradients are ``None`` afterwards."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), metrics_set_aside(module_metrics(module)):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
            if drop_grads:
                module.zero_grad(set_to_none=True)
