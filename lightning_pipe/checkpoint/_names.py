"""Parameter names and optimizer state for layout-free checkpoints (used by ``_dcp`` and ``_consolidate``).

A pipelined checkpoint keys everything by parameter name, so that it can be loaded onto any pipeline layout. This
module holds that bookkeeping:

- names: :class:`~lightning_pipe._model.names.ModelNames` (the whole model's state-dict keys and parameter names,
  fixed before the split), and splitting a stored key back into a parameter name and the rest;
- optimizer state: what is saved for an optimizer (its state dict flattened and keyed by parameter name: the
  per-parameter state, empty before the first step, and every parameter group's hyper-parameters), and loading it
  back exactly, by building a ``torch.optim`` state dict for this rank's parameters from the stored keys (an
  unstepped optimizer included), or giving an optimizer its part of a single-device state dict.

:class:`CheckpointMismatchError` is defined here and exported by :mod:`lightning_pipe.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_pipe._model.names import ModelNames

T = TypeVar("T")


class CheckpointMismatchError(KeyError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""

    __module__ = "lightning_pipe.checkpoint"  # its public home: tracebacks and pickles name it there

    def __str__(self) -> str:  # KeyError would print the message quoted, with its newlines escaped
        return str(self.args[0]) if self.args else ""


def split_name(rest: str, names: set[str]) -> tuple[Optional[str], str]:
    """Split ``"<parameter name>.<key>"`` at the dot that leaves a known parameter name on the left."""
    pos = rest.rfind(".")
    while pos > 0:
        if rest[:pos] in names:
            return rest[:pos], rest[pos + 1 :]
        pos = rest.rfind(".", 0, pos)
    return None, rest


def all_gather(obj: T) -> list[T]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------- optimizer state
def optimizer_state_for_save(optimizer: torch.optim.Optimizer, names: ModelNames) -> dict[str, Any]:
    """The optimizer's state dict flattened and keyed by the parameters' first names: ``state.<name>.<key>`` (a
    parameter without state, e.g. before the first step or frozen, has none) and ``param_groups.<name>.<key>``,
    each parameter's group hyper-parameters. Nothing is initialised: an optimizer saved before its first step stays
    fresh (Adam's bias correction depends on its step count)."""
    flat = flat_param_groups(optimizer, names)
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                flat[f"state.{names.first_name[id(param)]}.{key}"] = value
    return flat


def flat_param_groups(optimizer: torch.optim.Optimizer, names: ModelNames) -> dict[str, Any]:
    """The ``param_groups.<name>.<key>`` entries of the flattened optimizer state dict."""
    return {
        f"param_groups.{names.first_name[id(p)]}.{key}": value
        for group in optimizer.param_groups
        for p in group["params"]
        for key, value in group.items()
        if key != "params"
    }


def group_representatives(
    optimizer: torch.optim.Optimizer, names: ModelNames, merged: Optional[list[list[str]]]
) -> list[Optional[str]]:
    """For each parameter group, the name its hyper-parameters are stored under in a checkpoint: its first
    parameter's, or, for a group without parameters on this rank, the first of the group over all ranks
    (``merged``, from the checkpoint's ``meta.pt``)."""
    reps: list[Optional[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        if group["params"]:
            reps.append(names.first_name[id(group["params"][0])])
        else:
            reps.append(merged[g][0] if merged is not None and g < len(merged) and merged[g] else None)
    return reps


def stored_group_keys(
    optimizer: torch.optim.Optimizer, names: ModelNames, stored: Iterable[str], prefix: str, reps: list[Optional[str]]
) -> dict[str, list[str]]:
    """``{name: [hyper-parameter keys]}`` the checkpoint holds (``stored`` keys under ``prefix``) for each of this
    optimizer's parameters and group representatives; a name it has nothing for gets the group's current keys
    (reported missing)."""
    local = {names.first_name[id(p)]: group for group in optimizer.param_groups for p in group["params"]}
    local.update({rep: group for rep, group in zip(reps, optimizer.param_groups) if rep is not None})
    found = _keys_by_name(stored, prefix, set(local))
    for name, group in local.items():
        found.setdefault(name, [k for k in group if k not in ("params", "param_names")])
    return found


def stored_state_keys(
    optimizer: torch.optim.Optimizer, names: ModelNames, stored: Iterable[str], prefix: str
) -> dict[str, list[str]]:
    """``{name: [state keys]}`` the checkpoint holds (``stored`` keys under ``prefix``) for this optimizer's
    parameters (``exp_avg``, ``step``; a nested value's keys are dotted)."""
    known = {names.first_name[id(p)] for group in optimizer.param_groups for p in group["params"]}
    return _keys_by_name(stored, prefix, known)


def _keys_by_name(stored: Iterable[str], prefix: str, known: set[str]) -> dict[str, list[str]]:
    """``{name: [sub-keys]}`` of the ``stored`` keys under ``prefix`` that belong to one of the ``known`` names."""
    found: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(prefix):
            name, sub = split_name(key[len(prefix) :], known)
            if name is not None:
                found.setdefault(name, []).append(sub)
    return found


def load_flat_optimizer_state(
    optimizer: torch.optim.Optimizer, flat: dict[str, Any], names: ModelNames, reps: list[Optional[str]]
) -> None:
    """Load a flattened, name-keyed optimizer state dict (``state.<name>.<key>`` and ``param_groups.<name>.<key>``,
    this rank's parameters) the way ``Optimizer.load_state_dict`` loads one: every parameter's state is replaced
    (a parameter without stored state gets none, frozen or not), and every group gets exactly the stored
    hyper-parameters (``reps`` names where each group's are stored)."""
    per_name: dict[str, dict[str, Any]] = {}
    known = {names.first_name[id(p)] for group in optimizer.param_groups for p in group["params"]}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        if section == "state":
            name, sub = split_name(rest, known)
            if name is not None:
                _nest(per_name.setdefault(name, {}), sub.split("."), value)
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        numbers = []
        for param in group["params"]:
            entry = per_name.get(names.first_name[id(param)])
            if entry:
                state[index] = entry
            numbers.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    replace_param_groups(optimizer, flat, reps)


def _nest(target: dict[str, Any], path: list[str], value: object) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def replace_param_groups(optimizer: torch.optim.Optimizer, flat: dict[str, Any], reps: list[Optional[str]]) -> None:
    """Give every parameter group exactly the hyper-parameters ``flat`` holds for it, as ``Optimizer.load_state_dict``
    replaces the groups (keys added since the save, e.g. a scheduler's ``initial_lr``, go)."""
    for group, rep in zip(optimizer.param_groups, reps):
        if rep is None:
            continue
        prefix = f"param_groups.{rep}."
        loaded = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        for key in [k for k in group if k not in ("params", "param_names")]:
            del group[key]
        group.update(loaded)


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], groups: list[list[str]], path: Path, names: ModelNames
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
    number_of: dict[str, int] = {}
    for saved_group, group_names in zip(saved_groups, groups):
        group_names = saved_group.get("param_names", group_names)
        number_of.update(zip(group_names, saved_group["params"]))
    new_state: dict[int, Any] = {}
    new_groups = []
    counter = 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        numbers = []
        for param in group["params"]:
            name = names.first_name[id(param)]
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
                new_state[counter] = {key: shard_like(value, param) for key, value in entry.items()}
            numbers.append(counter)
            counter += 1
        new_group = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
        new_group["params"] = numbers
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        new_groups.append(new_group)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})


def shard_like(value: object, like: torch.Tensor) -> object:
    """``value`` (a whole tensor read from a single file, the same on every rank) as this rank's shard when ``like``
    is sharded: each rank takes its part, no communication."""
    if isinstance(like, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if tuple(value.shape) == tuple(like.shape):
            return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value
