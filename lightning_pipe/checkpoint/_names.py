"""Parameter names and optimizer state for layout-free checkpoints (used by ``_dcp`` and ``_consolidate``).

A pipelined checkpoint keys everything by parameter name, so that it can be loaded onto any pipeline layout. This
module holds that bookkeeping:

- names: every rank's parameter names and optimizer parameter groups, and their merge into the full model's order
  (backbone modules by index, other modules before or after the backbone);
- optimizer state: what is saved for an optimizer (its flattened, name-keyed state dict, or only its
  hyper-parameters before the first step), restoring those hyper-parameters, and giving an optimizer its part of a
  single-device ``torch.optim`` state dict.

:class:`CheckpointMismatchError` is defined here and exported by :mod:`lightning_pipe.checkpoint`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointMismatchError(KeyError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""

    __module__ = "lightning_pipe.checkpoint"  # its public home: tracebacks and pickles name it there

    def __str__(self) -> str:  # KeyError would print the message quoted, with its newlines escaped
        return str(self.args[0]) if self.args else ""


# -------------------------------------------------------------------------------------------------------------- names
def param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = param_names(model)
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def merge_order(lists: list[list[str]], prefix: str) -> list[str]:
    """The full model's order of names, from every rank's local order (each a subsequence of it).

    Names under the backbone go by backbone module index (each module lives on one stage, in its local order);
    other names (replicated on every rank) keep their place before or after the backbone.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d+)(\.|$)")
    keys: dict[str, tuple] = {}
    for names in lists:
        seen_backbone = False
        for pos, name in enumerate(names):
            match = pattern.match(name)
            if match:
                seen_backbone = True
                key: tuple = (1, int(match.group(1)), pos)
            else:
                key = (2 if seen_backbone else 0, pos, 0)
            if name not in keys or (key[0] == 2 and keys[name][0] == 0):
                keys[name] = key
    return sorted(keys, key=keys.__getitem__)


def merge_groups(per_rank: list[list[list[str]]], prefix: str) -> list[list[str]]:
    """Merge every rank's parameter groups of one optimizer (same group count on every rank)."""
    counts = {len(groups) for groups in per_rank}
    if len(counts) != 1:
        raise RuntimeError(f"The ranks' optimizers have different numbers of parameter groups: {sorted(counts)}.")
    return [merge_order([groups[g] for groups in per_rank], prefix) for g in range(counts.pop())]


def all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------- optimizer state
def optimizer_state_for_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if not optimizer.state and all(p.grad is None for g in optimizer.param_groups for p in g["params"]):
        # Not stepped yet. `get_optimizer_state_dict` would initialise the state with a zero-lr step (Adam's step
        # count would become 1 and change the run): save the hyper-parameters only.
        return flat_param_groups(model, optimizer)
    return get_optimizer_state_dict(model, optimizer, options=OPTIM_OPTIONS)


def flat_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``param_groups.<name>.<key>`` entries of the flattened optimizer state dict."""
    names = param_names(model)
    return {
        f"param_groups.{names[id(p)]}.{key}": value
        for group in optimizer.param_groups
        for p in group["params"]
        for key, value in group.items()
        if key != "params"
    }


def set_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    names = param_names(model)
    for group in optimizer.param_groups:
        if group["params"]:
            name = names[id(group["params"][0])]
            for key in list(group):
                if key != "params" and f"param_groups.{name}.{key}" in flat:
                    group[key] = flat[f"param_groups.{name}.{key}"]


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], groups: list[list[str]], path: Path
) -> None:
    """Give ``optimizer`` (this rank's parameters) its part of a single-device optimizer state dict.

    A single-device state dict numbers the parameters group after group; ``groups`` are the full model's groups
    (gathered from all ranks, in module order), which gives every number its parameter name.
    """
    saved_groups = saved["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(g) for g in groups]:
        raise CheckpointMismatchError(
            f"The optimizer state in `{path}` has parameter groups of sizes {sizes}, but this model's optimizer,"
            f" over all pipeline stages, has {[len(g) for g in groups]}. It was saved for another model or optimizer"
            " configuration; load the weights only (`Model.load_from_checkpoint`) and fit without `ckpt_path`."
        )
    number_of: dict[str, Any] = {}
    for saved_group, names in zip(saved_groups, groups):
        names = saved_group.get("param_names", names)
        number_of.update(zip(names, saved_group["params"]))
    names_of = param_names(model)
    new_state: dict[int, Any] = {}
    new_groups = []
    counter = 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        numbers = []
        for param in group["params"]:
            name = names_of[id(param)]
            if name not in number_of:
                raise CheckpointMismatchError(f"The optimizer state in `{path}` has no entry for `{name}`.")
            entry = saved["state"].get(number_of[name])
            if entry is not None:
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise CheckpointMismatchError(
                            f"The optimizer state `{key}` for `{name}` in `{path}` has shape {tuple(value.shape)}"
                            f" but the parameter has {tuple(param.shape)}: the optimizer's parameter order differs"
                            " from the checkpoint's (parameter groups must list parameters in module order)."
                        )
                new_state[counter] = entry
            numbers.append(counter)
            counter += 1
        new_group = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
        new_group["params"] = numbers
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        new_groups.append(new_group)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
