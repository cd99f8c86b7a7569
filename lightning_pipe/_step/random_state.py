"""torch's random state, read and put back: a generating step starts from the last stage's on every rank
([Note: lock step] in :mod:`lightning_pipe._step.generation`), and a batch that turns out to generate runs again from
the state it started with."""

from __future__ import annotations

import torch
from torch import Tensor


def random_state_of(device: torch.device) -> list[Tensor]:
    """torch's random state on the host, and on ``device`` when it is a GPU."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_random_state(states: list[Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
