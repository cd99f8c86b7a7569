"""The whole model's names, fixed before the split: what a checkpoint is keyed by, on any pipeline layout.

:class:`ModelNames` holds the whole model's state-dict keys and parameter names, and the first name of a tensor that
has several (a tied head: stored once). The cut keeps it; :mod:`lightning_pipe.checkpoint` keys everything by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelNames:
    """The whole model's names, fixed before the split: what a checkpoint is keyed by, on any layout.

    Attributes:
        state_keys: the single-device ``state_dict`` keys, in order.
        aliases: ``{key: first key}`` for a tensor with several names (a tied head, a reused block): a checkpoint
            stores it once, under its first name.
        param_order: every parameter's first name, in the single-device order.
        first_name: ``{id(parameter): first name}``.
    """

    state_keys: tuple[str, ...]
    aliases: dict[str, str]
    param_order: tuple[str, ...]
    first_name: dict[int, str]

    @classmethod
    def of(cls, model: nn.Module) -> ModelNames:
        """The names of ``model`` as it is now (call it on the whole model)."""
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                name = first.setdefault(id(value), key)
                if name != key:
                    aliases[key] = name
        params = {id(p): n for n, p in model.named_parameters()}
        return cls(tuple(model.state_dict(keep_vars=True)), aliases, tuple(params.values()), params)

    def stored(self, key: str) -> str:
        """The key a state-dict entry is stored under."""
        return self.aliases.get(key, key)

    def group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        return [[self.first_name[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def merge_groups(self, per_rank: list[list[list[str]]]) -> list[list[str]]:
        """Merge every rank's parameter groups of one optimizer (same group count on every rank), in model order."""
        counts = {len(groups) for groups in per_rank}
        if len(counts) != 1:
            raise RuntimeError(f"The ranks' optimizers have different numbers of parameter groups: {sorted(counts)}.")
        order = {name: i for i, name in enumerate(self.param_order)}
        merged = []
        for g in range(counts.pop()):
            names = {name for groups in per_rank for name in groups[g]}
            merged.append(sorted(names, key=lambda n: order.get(n, len(order))))
        return merged
