"""Saving and loading pipelined checkpoints with ``torch.distributed.checkpoint`` (DCP).

The directory layout and the safe replacement of a directory are in ``_files``; the bookkeeping of parameter names
and optimizer state that makes a checkpoint loadable onto any pipeline layout is in ``_names``.

Loading accepts a checkpoint directory saved with any pipeline layout (another pipeline size, balance or
schedule) or an ordinary single-file Lightning checkpoint; every rank takes its stages' slice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_pipe.checkpoint._files import (
    FORMAT_VERSION,
    INFO_KEY,
    TMP_SUFFIX,
    commit,
    layout_of,
    read_meta,
    remove,
    resolve,
    sibling,
    write_meta,
)
from lightning_pipe.checkpoint._names import (
    OPTIM_OPTIONS,
    CheckpointMismatchError,
    ModelNames,
    all_gather,
    flat_param_groups,
    load_full_optimizer_state,
    optimizer_state_for_save,
    replace_param_groups,
    stored_group_keys,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------- saving
def save(
    checkpoint: dict[str, Any],
    filepath: Any,
    *,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: ModelNames,
    layout: dict[str, Any],
    is_global_zero: bool,
    barrier: Callable[[str], None],
) -> None:
    """Write ``checkpoint`` (Lightning's dict) to the directory ``filepath``; called on every rank with the same path.

    Args:
        module: the cut LightningModule (its ``state_dict`` holds this rank's tensors).
        optimizers: this rank's optimizers.
        names: the whole model's names (a tensor with several names is stored once, under its first).
        layout: the pipeline layout to store (see ``_files.layout_of``).
        is_global_zero: this rank writes ``meta.pt`` and commits the directory.
        barrier: a barrier over all ranks.
    """
    path = Path(filepath)
    tmp = sibling(path, TMP_SUFFIX)
    if is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists() or tmp.is_symlink():
            remove(tmp)  # left by a save that was killed
    barrier("lightning_pipe.save.start")
    checkpoint = dict(checkpoint)
    # `ModelCheckpoint(save_weights_only=True)` leaves out optimizer and scheduler states: so do we.
    with_optimizers = "optimizer_states" in checkpoint
    checkpoint.pop("optimizer_states", None)
    weights = {names.stored(k): v for k, v in checkpoint.pop("state_dict").items()}
    state: dict[str, Any] = {"state_dict": weights}
    optimizers = list(optimizers) if with_optimizers else []
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = optimizer_state_for_save(module, optimizer, names)
    # Names only: every optimizer's parameter groups on every rank.
    gathered = all_gather([names.group_names(opt) for opt in optimizers])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    if is_global_zero:
        checkpoint[INFO_KEY] = {
            "format_version": FORMAT_VERSION,
            "state_dict_keys": list(names.state_keys),
            "aliases": dict(names.aliases),
            "optimizers": [
                {"param_groups": names.merge_groups([groups[idx] for groups in gathered])}
                for idx in range(len(optimizers))
            ],
            "pipeline_layout": layout,
        }
        write_meta(checkpoint, tmp)
    barrier("lightning_pipe.save.written")
    if is_global_zero:
        commit(tmp, path)
    barrier("lightning_pipe.save.done")


def load(
    filepath: Any,
    *,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: ModelNames,
    fitting: bool,
    weights_only: Optional[bool],
    checkpoint_io: Any,
    global_rank: int,
) -> dict[str, Any]:
    """Load a checkpoint into ``module`` and ``optimizers`` in place; return the rest for Lightning.

    ``filepath`` is a pipelined checkpoint directory (any pipeline layout) or an ordinary single-file Lightning
    checkpoint, of which each rank takes its stages' weights (and, when ``fitting``, their optimizer state).
    """
    path = resolve(Path(filepath))
    strict = module.strict_loading
    if path.is_file():
        optimizers = optimizers if fitting else []
        return _load_file(path, module, optimizers, names, weights_only, checkpoint_io, global_rank)
    checkpoint = read_meta(path, weights_only)
    checkpoint.pop(INFO_KEY, None)
    checkpoint.pop("pipeline_layout", None)
    local = module.state_dict()
    weights = {names.stored(k): v for k, v in local.items()}
    state: dict[str, Any] = {"state_dict": weights}
    # Optimizers are restored when fitting and when the checkpoint has them (not `save_weights_only`); Lightning
    # itself raises for a weights-only checkpoint because the LR scheduler states are missing then.
    optimizers = list(optimizers) if fitting and "lr_schedulers" in checkpoint else []
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stepped = [any(k.startswith(f"optimizer_{idx}.state.") for k in stored) for idx in range(len(optimizers))]
    for idx, optimizer in enumerate(optimizers):
        # The template of what to read: the state if the checkpoint has any (an optimizer saved before its first step
        # has none), and exactly the hyper-parameters the checkpoint holds, which replace the groups' (as
        # `Optimizer.load_state_dict` does: the LR finder restores an unstepped optimizer after stepping it).
        template = {}
        if stepped[idx]:
            flat = get_optimizer_state_dict(module, optimizer, options=OPTIM_OPTIONS)
            template = {
                k: v for k, v in names.optimizer_keys(module, flat, to_stored=True).items() if k.startswith("state.")
            }
        keys = stored_group_keys(optimizer, names, stored, f"optimizer_{idx}.param_groups.")
        for name, subs in keys.items():
            for key in subs:
                entry = f"param_groups.{name}.{key}"
                template[entry] = _placeholder(stored.get(f"optimizer_{idx}.{entry}"))
        state[f"optimizer_{idx}"] = template
    _check_against(path, state, stored, strict, global_rank)
    try:  # DCP gathers every rank's read errors and raises them on all ranks
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"Reading checkpoint `{path}` failed (reported on rank {global_rank}): its files are damaged or"
            f" incomplete. Load an earlier checkpoint. Cause: {_first_line(err)}"
        ) from err
    module.load_state_dict({k: weights[names.stored(k)] for k in local}, strict=strict)
    for idx, optimizer in enumerate(optimizers):
        loaded = state[f"optimizer_{idx}"]
        if stepped[idx]:
            # torch reads every hyper-parameter the groups have now; those the checkpoint lacks are dropped below.
            flat = {**flat_param_groups(optimizer, names), **loaded}
            set_optimizer_state_dict(
                module, optimizer, names.optimizer_keys(module, flat, to_stored=False), options=OPTIM_OPTIONS
            )
        else:
            optimizer.state.clear()
        replace_param_groups(optimizer, loaded, names)
    checkpoint["state_dict"] = module.state_dict()  # this rank's part, for `on_load_checkpoint` hooks
    log.debug("rank %d: loaded checkpoint %s", global_rank, path)
    return checkpoint


def _placeholder(meta: Any) -> Any:
    """A template value DCP reads a stored entry into: a tensor of its size for a tensor, else anything."""
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    return None


def _check_against(path: Path, state: dict[str, Any], stored: dict[str, Any], strict: bool, rank: int) -> None:
    """Compare what every rank needs with what the checkpoint holds; fail on every rank, naming the problem.

    Names missing on one rank only would otherwise leave the other ranks waiting in DCP's collectives.
    """
    missing, mismatched = [], []
    for top, sub in state.items():
        for key, value in sub.items():
            name = f"{top}.{key}"
            meta = stored.get(name)
            if meta is None:
                if strict or top != "state_dict":
                    missing.append(name)
            elif isinstance(value, torch.Tensor):
                size = meta.shape if isinstance(meta, torch.Tensor) else getattr(meta, "size", None)
                if size is not None and tuple(size) != tuple(value.shape):
                    mismatched.append(f"{name}: checkpoint {tuple(size)}, model {tuple(value.shape)}")
    wanted = [f"state_dict.{k}" for k in state["state_dict"]]
    reports = all_gather((rank, missing, mismatched, wanted))
    needed = {k for _, _, _, keys in reports for k in keys}
    unexpected = sorted(k for k in stored if k.startswith("state_dict.") and k not in needed) if strict else []
    _raise_mismatch(path, reports, unexpected, rank)


def _raise_mismatch(path: Path, reports: list[tuple], unexpected: list[str], rank: int) -> None:
    lines = []
    for r, missing, mismatched, _ in reports:
        weights = [k[len("state_dict.") :] for k in missing if k.startswith("state_dict.")]
        others = [k for k in missing if not k.startswith("state_dict.")]
        if weights:
            lines.append(f"  rank {r}: missing weights ({len(weights)}): {_shorten(weights)}")
        if others:
            lines.append(f"  rank {r}: missing optimizer entries ({len(others)}): {_shorten(others, 4)}")
        if mismatched:
            lines.append(f"  rank {r}: shape mismatch ({len(mismatched)}): {_shorten(mismatched)}")
    if unexpected:
        names = [k[len("state_dict.") :] for k in unexpected]
        lines.append(f"  in the checkpoint but in no rank's model ({len(names)}): {_shorten(names)}")
    if not lines:
        return
    raise CheckpointMismatchError(
        f"Checkpoint `{path}` does not match this model (reported on rank {rank}):\n"
        + "\n".join(lines)
        + "\nCheck that it was saved from the same model (number of blocks, sizes) and optimizer configuration."
        " To load only the matching weights set `model.strict_loading = False`; to fine-tune with another optimizer,"
        " load the weights (`Model.load_from_checkpoint`) and call `trainer.fit` without `ckpt_path`."
    )


def _first_line(err: BaseException) -> str:
    if isinstance(err, CheckpointException):  # one failure per rank, each (exception, stack)
        causes = []
        for rank, failure in sorted(err.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {_first_line(exc) if isinstance(exc, BaseException) else exc}")
        return "; ".join(causes)
    text = str(err).strip()
    return f"{type(err).__name__}" + (f": {text.splitlines()[0]}" if text else "")


def _shorten(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _load_file(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: ModelNames,
    weights_only: Optional[bool],
    checkpoint_io: Any,
    global_rank: int,
) -> dict[str, Any]:
    """Each rank takes its stages from an ordinary single-file Lightning checkpoint."""
    strict = module.strict_loading
    checkpoint = checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)
    full = checkpoint.get("state_dict")
    if not isinstance(full, dict):
        raise CheckpointMismatchError(f"`{path}` is not a Lightning checkpoint: it has no `state_dict`.")
    local = module.state_dict()
    stored = {f"state_dict.{k}": v for k, v in full.items() if isinstance(v, torch.Tensor)}
    _check_against(path, {"state_dict": local}, stored, strict, global_rank)
    module.load_state_dict({k: full[k] for k in local if k in full}, strict=strict)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    if optimizers and optimizer_states is not None:
        gathered = all_gather([names.group_names(opt) for opt in optimizers])
        if len(optimizer_states) != len(optimizers):
            raise CheckpointMismatchError(
                f"`{path}` holds {len(optimizer_states)} optimizer states but `configure_optimizers` made"
                f" {len(optimizers)}."
            )
        for idx, (optimizer, saved) in enumerate(zip(optimizers, optimizer_states)):
            groups = names.merge_groups([per_rank[idx] for per_rank in gathered])
            load_full_optimizer_state(optimizer, saved, groups, path, names)
    checkpoint["state_dict"] = module.state_dict()
    return checkpoint


def stored_balance(filepath: Any) -> list[int]:
    """The modules per stage of the split a checkpoint directory was saved with, e.g. a profiled
    ``balance="time"`` split, to pass as ``PipelineStrategy(balance=stored_balance(ckpt_dir))`` on resume."""
    layout = layout_of(read_meta(resolve(Path(filepath)), weights_only=True))
    return [stop - start for start, stop in layout["bounds"]]
