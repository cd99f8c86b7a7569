"""Saving and loading pipelined checkpoints with ``torch.distributed.checkpoint`` (DCP).

The directory layout and the safe replacement of a directory are in ``_files``; the bookkeeping of parameter names
and optimizer state that makes a checkpoint loadable onto any pipeline layout is in ``_names``.

Loading accepts a checkpoint directory saved with any pipeline layout (another pipeline size, balance or
schedule) or an ordinary single-file Lightning checkpoint; every rank takes its stages' slice. Files are read
without running code from them (``_safe``) unless the user passes ``weights_only=False``.

A step of a save or a load that fails on one rank fails on every rank: the outcome of each step that can fail on
some ranks only is exchanged before the next collective, so no rank is left waiting for another.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as distributed_empty

from lightning_pipe._rank_states import markers
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
    CheckpointMismatchError,
    ModelNames,
    all_gather,
    group_representatives,
    load_flat_optimizer_state,
    load_full_optimizer_state,
    optimizer_state_for_save,
    shard_like,
    stored_group_keys,
    stored_state_keys,
)
from lightning_pipe.checkpoint._safe import SafeFileSystemReader, load_dcp_metadata, read_error

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------- saving
def save(
    checkpoint: dict[str, Any],
    filepath: Union[str, os.PathLike],
    *,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: ModelNames,
    layout: dict[str, Any],
    is_global_zero: bool,
    local_states: Optional[dict[str, dict[str, torch.Tensor]]] = None,
) -> None:
    """Write ``checkpoint`` (Lightning's dict) to the directory ``filepath``; called on every rank with the same path.

    The steps are synchronised by exchanging their outcomes, so that a failure on one rank is raised on all
    (:class:`CheckpointSaveError`). Whatever was at ``filepath`` before is then still there and loadable, the
    temporary directory is removed, and the model and optimizers are untouched.

    Args:
        module: the cut LightningModule (its ``state_dict`` holds this rank's tensors).
        optimizers: this rank's optimizers.
        names: the whole model's names (a tensor with several names is stored once, under its first).
        layout: the pipeline layout to store (see ``_files.layout_of``).
        is_global_zero: this rank writes ``meta.pt`` and commits the directory.
        local_states: per-rank state dicts (keyed by this rank's state-dict names) whose place in ``checkpoint`` holds
            a marker (``_local``): stored like the weights, under their key.
    """
    path = Path(filepath)
    tmp = sibling(path, TMP_SUFFIX)
    failure = _attempt(_prepare, path, tmp) if is_global_zero else None
    _outcome_on_every_rank(failure, path, "preparing its directory", tmp if is_global_zero else None)
    checkpoint = dict(checkpoint)
    # `ModelCheckpoint(save_weights_only=True)` leaves out optimizer and scheduler states: so do we.
    with_optimizers = "optimizer_states" in checkpoint
    checkpoint.pop("optimizer_states", None)
    weights = {names.stored(k): v for k, v in checkpoint.pop("state_dict").items()}
    state: dict[str, Any] = {"state_dict": weights}
    for key, local in (local_states or {}).items():
        state[key] = {names.stored(k): v for k, v in local.items()}
    optimizers = list(optimizers) if with_optimizers else []
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = optimizer_state_for_save(optimizer, names)
    # Names only: every optimizer's parameter groups on every rank.
    gathered = all_gather([names.group_names(opt) for opt in optimizers])
    # DCP raises a failure of any rank's writer on every rank.
    failure = _attempt(dcp.save, state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    if is_global_zero and failure is None:

        def write() -> None:  # inside `_attempt`: a failure here is reported on every rank
            checkpoint[INFO_KEY] = {
                "format_version": FORMAT_VERSION,
                "state_dict_keys": list(names.state_keys),
                "aliases": dict(names.aliases),
                "optimizers": [
                    {
                        "param_groups": names.merge_groups([groups[idx] for groups in gathered]),
                        "class": _class_name(optimizers[idx]),
                    }
                    for idx in range(len(optimizers))
                ],
                "pipeline_layout": layout,
            }
            write_meta(checkpoint, tmp)

        failure = _attempt(write)
    _outcome_on_every_rank(failure, path, "writing it", tmp if is_global_zero else None)
    failure = _attempt(commit, tmp, path) if is_global_zero else None
    _outcome_on_every_rank(failure, path, "moving it into place", tmp if is_global_zero else None)


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed on some rank; raised on every rank. The previous checkpoint is untouched."""


def _prepare(path: Path, tmp: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove(tmp)  # if a save that was killed left it


def _attempt(fn: Callable[..., object], *args: object, **kwargs: object) -> Optional[BaseException]:
    """Run ``fn``; return what it raised (DCP's ``CheckpointException`` is a ``BaseException``), or None."""
    try:
        fn(*args, **kwargs)
    except (Exception, CheckpointException) as err:
        log.debug("checkpoint step %s failed", getattr(fn, "__name__", fn), exc_info=True)
        return err
    return None


def _outcome_on_every_rank(failure: Optional[BaseException], path: Path, step: str, cleanup: Optional[Path]) -> None:
    """Exchange one save step's outcome; if any rank failed, remove ``cleanup`` (the temporary directory, by rank 0)
    and raise :class:`CheckpointSaveError` on every rank."""
    text = None
    if isinstance(failure, CheckpointException):
        text = _first_line(failure)  # DCP's failures, each with its rank, seen by every rank
    elif failure is not None:
        text = f"rank {dist.get_rank() if dist.is_initialized() else 0}: {_first_line(failure)}"
    failed = [t for t in all_gather(text) if t is not None]
    if not failed:
        return
    if cleanup is not None:
        try:
            remove(cleanup)
        except OSError as err:
            log.warning("could not remove the unfinished checkpoint %s: %s", cleanup, err)
    causes = "; ".join(dict.fromkeys(failed))
    raise CheckpointSaveError(
        f"Saving checkpoint `{path}` failed while {step} ({causes}). Nothing was written under that name: a"
        " checkpoint that was there before is still there, and the model and optimizer states are unchanged."
    ) from failure


def load(
    filepath: Union[str, os.PathLike],
    *,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    names: ModelNames,
    fitting: bool,
    weights_only: Optional[bool],
    checkpoint_io: CheckpointIO,
    global_rank: int,
    prepare: Optional[Callable[[dict[str, Any]], None]] = None,
    chosen: Optional[Callable[[object], None]] = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``module`` and ``optimizers`` in place; return the rest for Lightning.

    ``filepath`` is a pipelined checkpoint directory (any pipeline layout) or an ordinary single-file Lightning
    checkpoint, of which each rank takes its stages' weights (and, when ``fitting``, their optimizer state).
    ``prepare`` sees the checkpoint before the optimizers are restored (callbacks rebuild parameter groups there).
    Per-rank state dicts (``_local``) come back with this rank's tensors. ``chosen`` gets the stored
    ``schedule="auto"`` choice (unchecked: a record from disk), or ``None``.
    """
    path, checkpoint, metadata = _read_on_every_rank(Path(filepath), weights_only, global_rank)
    strict = module.strict_loading
    if checkpoint is None:  # a single file
        optimizers = optimizers if fitting else []
        return _load_file(
            path, module, optimizers, names, weights_only, checkpoint_io=checkpoint_io, global_rank=global_rank,
            prepare=prepare,
        )
    info = checkpoint.pop(INFO_KEY, None) or {}
    checkpoint.pop("pipeline_layout", None)
    if chosen is not None:
        chosen((info.get("pipeline_layout") or {}).get("auto") if isinstance(info, dict) else None)
    local = module.state_dict()
    weights = {names.stored(k): v for k, v in local.items()}
    state: dict[str, Any] = {"state_dict": weights}
    # Optimizers are restored when fitting and when the checkpoint has them (not `save_weights_only`); Lightning
    # itself raises for a weights-only checkpoint because the LR scheduler states are missing then.
    optimizers = list(optimizers) if fitting and "lr_schedulers" in checkpoint else []
    if prepare is not None:
        prepare(checkpoint)
    stored = metadata.state_dict_metadata
    marked = list(markers(checkpoint))
    for _, _, key in marked:  # per-rank state dicts (`_local`): this rank's entries, with their stored dtypes
        state[key] = {s: _placeholder(stored[f"{key}.{s}"]) for s in weights if f"{key}.{s}" in stored}
    _check_optimizer_classes(path, info, optimizers, global_rank)
    reps: list[list[Optional[str]]] = []
    for idx, optimizer in enumerate(optimizers):
        # The template of what to read: the state the checkpoint holds for this rank's parameters (none for an
        # optimizer saved before its first step), and exactly the hyper-parameters it holds, which replace the
        # groups' (as `Optimizer.load_state_dict` does: the LR finder restores an unstepped optimizer after stepping
        # it, and its `initial_lr` must go).
        saved = info.get("optimizers") or []
        merged = saved[idx].get("param_groups") if idx < len(saved) else None
        reps.append(group_representatives(optimizer, names, merged))
        by_name = {names.first_name[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
        template = {}
        for section, keys in (
            ("state", stored_state_keys(optimizer, names, stored, f"optimizer_{idx}.state.")),
            ("param_groups", stored_group_keys(optimizer, names, stored, f"optimizer_{idx}.param_groups.", reps[idx])),
        ):
            for name, subs in keys.items():
                for key in subs:
                    entry = f"{section}.{name}.{key}"
                    like = by_name.get(name) if section == "state" else None
                    template[entry] = _placeholder(stored.get(f"optimizer_{idx}.{entry}"), like)
        state[f"optimizer_{idx}"] = template
    _check_against(path, state, stored, strict, global_rank)
    try:  # DCP gathers every rank's read errors and raises them on all ranks
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path, weights_only),
            planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict),
        )
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise read_error(err, path, global_rank) from err
    module.load_state_dict({k: weights[names.stored(k)] for k in local}, strict=strict)
    for idx, optimizer in enumerate(optimizers):
        load_flat_optimizer_state(optimizer, state[f"optimizer_{idx}"], names, reps[idx])
    for container, entry, key in marked:
        container[entry] = {k: state[key][names.stored(k)] for k in local if names.stored(k) in state[key]}
    checkpoint["state_dict"] = module.state_dict()  # this rank's part, for `on_load_checkpoint` hooks
    log.debug("rank %d: loaded checkpoint %s", global_rank, path)
    return checkpoint


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_optimizer_classes(
    path: Path, info: dict[str, Any], optimizers: list[torch.optim.Optimizer], rank: int
) -> None:
    """Refuse optimizer state saved by another kind of optimizer (SGD's momentum is no state for AdamW). Every rank
    reads the same ``meta.pt`` and builds the same optimizers, so every rank raises."""
    saved = info.get("optimizers") or []
    for idx, optimizer in enumerate(optimizers):
        stored = saved[idx].get("class") if idx < len(saved) else None  # absent in checkpoints of older versions
        if stored is not None and stored != _class_name(optimizer):
            raise CheckpointMismatchError(
                f"Checkpoint `{path}` holds the state of optimizer {idx} as saved by `{stored}`, but"
                f" `configure_optimizers` now returns `{_class_name(optimizer)}` (reported on rank {rank})."
                " Resume with the optimizer the checkpoint was saved with; to fine-tune with another optimizer,"
                " load the weights (`Model.load_from_checkpoint`) and call `trainer.fit` without `ckpt_path`."
            )


def _read_on_every_rank(
    filepath: Path, weights_only: Optional[bool], rank: int
) -> tuple[Path, Optional[dict[str, Any]], Optional[Metadata]]:
    """The checkpoint to read, its ``meta.pt`` and DCP's index (both None for a single file). A failure on any rank
    (a missing, damaged or refused file) is raised on every rank, before any rank enters DCP's collectives."""
    path, checkpoint, metadata, failure = filepath, None, None, None
    try:
        path = resolve(filepath)
        if path.is_dir():
            checkpoint = read_meta(path, weights_only)
            metadata = load_dcp_metadata(path / ".metadata", weights_only)
    except Exception as err:
        failure = err
    reports = all_gather(None if failure is None else (rank, failure))
    if failure is not None:
        raise failure
    for other, error in (r for r in reports if r is not None):
        raise type(error)(f"{error} (reported on rank {other})") from error
    return path, checkpoint, metadata


def _placeholder(
    meta: Optional[Union[TensorStorageMetadata, BytesStorageMetadata]], like: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """A template value DCP reads a stored entry into: a tensor of its size for a tensor, else anything. ``like``: the
    parameter an optimizer state entry belongs to; a state of a sharded parameter's size is read sharded like it (each
    rank reads its shard only, whatever layout wrote it)."""
    if isinstance(meta, TensorStorageMetadata):
        if isinstance(like, DTensor) and tuple(meta.size) == tuple(like.shape):
            return distributed_empty(
                meta.size, dtype=meta.properties.dtype, device_mesh=like.device_mesh, placements=like.placements
            )
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
    checkpoint_io: CheckpointIO,
    global_rank: int,
    prepare: Optional[Callable[[dict[str, Any]], None]] = None,
) -> dict[str, Any]:
    """Each rank takes its stages from an ordinary single-file Lightning checkpoint."""
    strict = module.strict_loading
    failure = None
    try:
        checkpoint = checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # e.g. the file is missing on one node: every rank must fail, none may wait
        failure = err
    reports = all_gather(None if failure is None else (global_rank, f"{type(failure).__name__}: {failure}"))
    if failure is not None:
        raise failure
    for other, text in (r for r in reports if r is not None):
        raise RuntimeError(f"Reading checkpoint `{path}` failed on rank {other}: {text}")
    full = checkpoint.get("state_dict")
    if not isinstance(full, dict):
        raise CheckpointMismatchError(f"`{path}` is not a Lightning checkpoint: it has no `state_dict`.")
    local = module.state_dict()
    stored = {f"state_dict.{k}": v for k, v in full.items() if isinstance(v, torch.Tensor)}
    _check_against(path, {"state_dict": local}, stored, strict, global_rank)
    module.load_state_dict({k: shard_like(full[k], local[k]) for k in local if k in full}, strict=strict)
    if prepare is not None:
        prepare(checkpoint)
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


def stored_balance(filepath: Union[str, os.PathLike], weights_only: Optional[bool] = None) -> list[int]:
    """The modules per stage of the split a checkpoint directory was saved with, e.g. a profiled
    ``balance="time"`` split, to pass as ``PipelineStrategy(balance=stored_balance(ckpt_dir))`` on resume.

    Args:
        weights_only: ``meta.pt`` is read weights-only unless this is ``False`` (as in Lightning): pass ``False``
            for a checkpoint you trust whose hyper-parameters hold objects of your own classes.
    """
    layout = layout_of(read_meta(resolve(Path(filepath)), weights_only))
    return [stop - start for start, stop in layout["bounds"]]
