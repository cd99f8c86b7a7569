"""Running a module for a look (a shape probe, a profile) without changing what training will see.

:func:`untouched` is the one way the package does it: the random state (the CPU's and the device's) is forked, the
module's buffers (BatchNorm statistics) are put back, its torchmetrics states are set aside, and, if asked, the
gradients the run wrote are dropped. A run on ghosts changes no tensor, but a model may keep what it computed in a
plain attribute (RecurrentGemma's recurrent states): :func:`no_ghosts_left` takes those ghosts back out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_pipe._ghost import Ghost
from lightning_pipe._lightning.metrics import metrics_set_aside, module_metrics

_ABSENT = object()


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


@contextmanager
def no_ghosts_left(module: nn.Module) -> Iterator[None]:
    """Run the block on ``module`` (on ghosts: the setup's analysis, a shape probe); each plain attribute of its
    modules that the run set to a new ghost gets its value from before the run back (or is removed if it had none):
    RecurrentGemma keeps its states in ``self.conv1d_state`` and ``self.rg_lru.recurrent_states``, and a real call
    after the run would otherwise continue from a ghost. The ghosts a cut leaves in place of another stage's
    parameters were there before and stay."""
    before = {
        (id(sub), name): value
        for sub in module.modules()
        for name, value in vars(sub).items()
        if value is None or isinstance(value, torch.Tensor)
    }
    try:
        yield
    finally:
        for sub in module.modules():
            for name, value in list(vars(sub).items()):
                if not isinstance(value, Ghost):
                    continue
                old = before.get((id(sub), name), _ABSENT)
                if old is value:
                    continue
                if old is _ABSENT:
                    del vars(sub)[name]
                else:
                    vars(sub)[name] = old
