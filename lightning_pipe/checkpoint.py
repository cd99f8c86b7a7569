"""Saving and loading pipelined checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory (the path Lightning passes, e.g. ``epoch=0-step=100.ckpt/``):

- DCP shards (``__<rank>_0.distcp``) and the DCP index (``.metadata``) hold ``state_dict`` (model weights under
  their original names, each rank writing its own stages) and ``optimizer_<i>`` (optimizer ``i``'s state,
  flattened and keyed by parameter name, so that it can be resharded onto any pipeline layout);
- ``meta.pt`` holds everything else Lightning puts in a checkpoint (loops, callbacks, LR schedulers, hyper-
  parameters, ...), written once by rank 0, plus, under the key ``"lightning_pipe"``, the pipeline layout, the
  full model's parameter order and each optimizer's parameter groups (what ``consolidate`` needs to write an
  ordinary single-file checkpoint).

Saving writes into a temporary sibling directory (``<name>.tmp-lightning-pipe``) and renames it into place once
every rank has written and synced its files: a job killed mid-save leaves the previous checkpoint intact and no
half-written directory under the final name. Overwriting a checkpoint of the same name (``last.ckpt``) moves the
old one aside (``<name>.old-lightning-pipe``) for the instant between the two renames; loading falls back to it.

Loading accepts a checkpoint directory saved with any pipeline layout (another pipeline size, balance or
schedule) or an ordinary single-file Lightning checkpoint; every rank takes its stages' slice. The bookkeeping of
parameter names and optimizer state behind this is in :mod:`lightning_pipe.checkpoint_names`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lightning_pipe.checkpoint_names import (
    _OPTIM_OPTIONS,
    CheckpointMismatchError,
    _all_gather,
    _backbone_prefix,
    _flat_param_groups,
    _group_names,
    _load_full_optimizer_state,
    _merge_groups,
    _merge_order,
    _optimizer_state_for_save,
    _set_param_groups,
)

if TYPE_CHECKING:
    from lightning_pipe.strategy import PipelineStrategy

META_FILENAME = "meta.pt"
INFO_KEY = "lightning_pipe"
FORMAT_VERSION = 1
_TMP_SUFFIX = ".tmp-lightning-pipe"
_OLD_SUFFIX = ".old-lightning-pipe"


def is_pipeline_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a complete lightning_pipe checkpoint directory."""
    try:
        path = Path(path)
    except TypeError:
        return False
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


# ------------------------------------------------------------------------------------------------------------- saving
def save(strategy: PipelineStrategy, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Write ``checkpoint`` to the directory ``filepath``; called on every rank with the same path."""
    path = Path(filepath)
    tmp = _sibling(path, _TMP_SUFFIX)
    model = strategy.lightning_module
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists() or tmp.is_symlink():
            remove(tmp)  # left by a save that was killed
    strategy.barrier("lightning_pipe.save.start")
    checkpoint = dict(checkpoint)
    # `ModelCheckpoint(save_weights_only=True)` leaves out optimizer and scheduler states: so do we.
    with_optimizers = "optimizer_states" in checkpoint
    checkpoint.pop("optimizer_states", None)
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    optimizers = list(strategy.optimizers) if with_optimizers else []
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = _optimizer_state_for_save(model, optimizer)
    prefix = _backbone_prefix(strategy)
    # Names only: the order of the full model's state dict and of every optimizer's parameter groups.
    local = (list(state["state_dict"]), [_group_names(model, opt) for opt in optimizers])
    gathered = _all_gather(local)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    if strategy.is_global_zero:
        checkpoint[INFO_KEY] = {
            "format_version": FORMAT_VERSION,
            "state_dict_keys": _merge_order([keys for keys, _ in gathered], prefix),
            "optimizers": [
                {"param_groups": _merge_groups([groups[idx] for _, groups in gathered], prefix)}
                for idx in range(len(optimizers))
            ],
            "pipeline_layout": _layout_info(strategy),
        }
        _save_file(checkpoint, tmp / META_FILENAME)
    strategy.barrier("lightning_pipe.save.written")
    if strategy.is_global_zero:
        _commit(tmp, path)
    strategy.barrier("lightning_pipe.save.done")


def _commit(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` directory to ``path``, replacing what is there."""
    old: Optional[Path] = None
    if path.is_symlink() or path.is_file():
        path.unlink()  # a link (``save_last="link"``) or a file written by another strategy
    elif path.exists():
        old = _sibling(path, _OLD_SUFFIX)
        if old.exists():
            remove(old)
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(filepath: Any) -> None:
    """Delete a checkpoint directory (or a file or link left by another strategy)."""
    path = Path(filepath)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _layout_info(strategy: PipelineStrategy) -> dict[str, Any]:
    layout = strategy.layout
    return {
        "bounds": [list(b) for b in layout.bounds],
        "pipeline_parallel_size": layout.pipeline_size,
        "data_parallel_size": strategy.data_parallel_size,
        "stages_per_rank": layout.stages_per_rank,
        "style": layout.style,
        "backbone": getattr(strategy, "_backbone_path", "backbone"),
    }


# ------------------------------------------------------------------------------------------------------------ loading
def load(strategy: PipelineStrategy, filepath: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Load a checkpoint into the strategy's module and optimizers in place; return the rest for Lightning.

    ``filepath`` is a pipelined checkpoint directory (any pipeline layout) or an ordinary single-file Lightning
    checkpoint, of which each rank takes its stages' weights (and, when fitting, their optimizer state).
    """
    path = _resolve(Path(filepath))
    if path.is_file():
        return _load_file(strategy, path, weights_only)
    model = strategy.lightning_module
    strict = model.strict_loading
    checkpoint = torch.load(path / META_FILENAME, map_location="cpu", weights_only=bool(weights_only))
    checkpoint.pop(INFO_KEY, None)
    checkpoint.pop("pipeline_layout", None)
    state: dict[str, Any] = {"state_dict": model.state_dict()}
    # Optimizers are restored when fitting and when the checkpoint has them (not `save_weights_only`); Lightning
    # itself raises for a weights-only checkpoint because the LR scheduler states are missing then.
    optimizers = list(strategy.optimizers) if _fitting(model) and "lr_schedulers" in checkpoint else []
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stepped = [any(k.startswith(f"optimizer_{idx}.state.") for k in stored) for idx in range(len(optimizers))]
    for idx, optimizer in enumerate(optimizers):
        # The template of what to read. An optimizer saved before its first step has hyper-parameters only.
        state[f"optimizer_{idx}"] = (
            get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
            if stepped[idx]
            else _flat_param_groups(model, optimizer)
        )
    _check_against(path, state, stored, strict, strategy.global_rank)
    try:  # DCP gathers every rank's read errors and raises them on all ranks
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"Reading checkpoint `{path}` failed (reported on rank {strategy.global_rank}): its files are damaged or"
            f" incomplete. Load an earlier checkpoint. Cause: {_first_line(err)}"
        ) from err
    model.load_state_dict(state["state_dict"], strict=strict)
    for idx, optimizer in enumerate(optimizers):
        if stepped[idx]:
            set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_OPTIONS)
        else:
            _set_param_groups(model, optimizer, state[f"optimizer_{idx}"])
    checkpoint["state_dict"] = model.state_dict()  # this rank's part, for `on_load_checkpoint` hooks
    return checkpoint


def _resolve(path: Path) -> Path:
    if path.exists():
        if path.is_dir() and not is_pipeline_checkpoint(path):
            raise FileNotFoundError(
                f"`{path}` is a directory but not a complete lightning_pipe checkpoint: it lacks `{META_FILENAME}`"
                " or DCP's `.metadata`. Pass the directory `ModelCheckpoint`/`trainer.save_checkpoint` wrote, e.g."
                " `.../checkpoints/epoch=0-step=100.ckpt`. Directories ending in"
                f" `{_TMP_SUFFIX}` are saves that were interrupted and cannot be loaded."
            )
        return path
    old = _sibling(path, _OLD_SUFFIX)
    if is_pipeline_checkpoint(old):
        warnings.warn(
            f"`{path}` does not exist, but `{old}` does: a save replacing it was interrupted. Loading `{old}`.",
            stacklevel=3,
        )
        return old
    raise FileNotFoundError(f"Checkpoint `{path}` does not exist.")


def _fitting(model: nn.Module) -> bool:
    trainer = getattr(model, "_trainer", None)
    return trainer is not None and trainer.state.fn == "fit"


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
    reports = _all_gather((rank, missing, mismatched, wanted))
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


def _load_file(strategy: PipelineStrategy, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """Each rank takes its stages from an ordinary single-file Lightning checkpoint."""
    model = strategy.lightning_module
    strict = model.strict_loading
    checkpoint = strategy.checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)
    full = checkpoint.get("state_dict")
    if not isinstance(full, dict):
        raise CheckpointMismatchError(f"`{path}` is not a Lightning checkpoint: it has no `state_dict`.")
    local = model.state_dict()
    stored = {f"state_dict.{k}": v for k, v in full.items() if isinstance(v, torch.Tensor)}
    _check_against(path, {"state_dict": local}, stored, strict, strategy.global_rank)
    model.load_state_dict({k: full[k] for k in local if k in full}, strict=strict)
    optimizer_states = checkpoint.pop("optimizer_states", None)
    if _fitting(model) and optimizer_states is not None:
        prefix = _backbone_prefix(strategy)
        optimizers = list(strategy.optimizers)
        gathered = _all_gather([_group_names(model, opt) for opt in optimizers])
        if len(optimizer_states) != len(optimizers):
            raise CheckpointMismatchError(
                f"`{path}` holds {len(optimizer_states)} optimizer states but `configure_optimizers` made"
                f" {len(optimizers)}."
            )
        for idx, (optimizer, saved) in enumerate(zip(optimizers, optimizer_states)):
            groups = _merge_groups([per_rank[idx] for per_rank in gathered], prefix)
            _load_full_optimizer_state(model, optimizer, saved, groups, path)
    checkpoint["state_dict"] = model.state_dict()
    return checkpoint


# ----------------------------------------------------------------------------------------------- load_from_checkpoint
def _install_load_from_checkpoint_support() -> None:
    """Let ``Model.load_from_checkpoint(DIR)`` read a lightning_pipe checkpoint directory.

    Lightning 2.6 reads checkpoints with ``torch.load`` on a file and fails on a directory with
    ``IsADirectoryError``. Its loader (``lightning.pytorch.core.saving.pl_load``) is wrapped so that a complete
    lightning_pipe checkpoint directory is consolidated in memory (weights and hyper-parameters only, as
    ``python -m lightning_pipe.consolidate DIR OUT --weights-only`` would write); every other path goes to
    Lightning unchanged. The process needs no process group: it reads every rank's shards itself.
    """
    try:
        from lightning.pytorch.core import saving
    except ImportError:  # pragma: no cover
        return
    original = getattr(saving, "pl_load", None)
    if original is None or getattr(original, "_lightning_pipe", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
            if not is_pipeline_checkpoint(path_or_url):
                raise IsADirectoryError(
                    f"`{path_or_url}` is a directory, not a checkpoint file, and not a complete lightning_pipe"
                    f" checkpoint directory either (that holds `{META_FILENAME}` and DCP's `.metadata`; an interrupted"
                    f" save leaves a `*{_TMP_SUFFIX}` directory instead). Pass a checkpoint file or a complete"
                    " checkpoint directory."
                )
            from lightning_pipe.consolidate import consolidated_checkpoint

            checkpoint = consolidated_checkpoint(path_or_url, weights_only=True)
            if isinstance(map_location, (str, torch.device)):
                checkpoint["state_dict"] = {k: v.to(map_location) for k, v in checkpoint["state_dict"].items()}
            return checkpoint
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._lightning_pipe = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load


_install_load_from_checkpoint_support()


def stored_balance(filepath: Any) -> list[int]:
    """The modules per stage of the split a checkpoint directory was saved with, e.g. a profiled
    ``balance="time"`` split, to pass as ``PipelineStrategy(balance=stored_balance(ckpt_dir))`` on resume."""
    meta = torch.load(Path(filepath) / META_FILENAME, map_location="cpu", weights_only=False)
    return [stop - start for start, stop in meta["pipeline_layout"]["bounds"]]
