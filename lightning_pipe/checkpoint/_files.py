"""A checkpoint directory on disk: its files, reading and writing ``meta.pt``, and replacing a directory safely.

A checkpoint is a directory (the path Lightning passes, e.g. ``epoch=0-step=100.ckpt/``):

- DCP shards (``__<rank>_0.distcp``) and the DCP index (``.metadata``) hold ``state_dict`` (model weights under
  their original names, each rank writing its own stages) and ``optimizer_<i>`` (optimizer ``i``'s state,
  flattened and keyed by parameter name, so that it can be resharded onto any pipeline layout);
- ``meta.pt`` holds everything else Lightning puts in a checkpoint (loops, callbacks, LR schedulers, hyper-
  parameters, ...), written once by rank 0, plus, under the key ``"lightning_pipe"`` (:data:`INFO_KEY`), the
  pipeline layout, the full model's parameter order and each optimizer's parameter groups.

Saving writes into a temporary sibling directory (``<name>.tmp-lightning-pipe``) and renames it into place once
every rank has written and synced its files (:func:`commit`): a job killed mid-save leaves the previous checkpoint
intact and no half-written directory under the final name. Overwriting a checkpoint of the same name
(``last.ckpt``) moves the old one aside (``<name>.old-lightning-pipe``) for the instant between the two renames;
loading falls back to it (:func:`resolve`).

Both ``meta.pt`` and DCP's files are read without running code from them unless the user passes
``weights_only=False`` (``_safe``).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from lightning_pipe.checkpoint._safe import DamagedCheckpointError, load_torch_file

if TYPE_CHECKING:
    from lightning_pipe.partition import StageLayout
    from lightning_pipe.schedules import Config

log = logging.getLogger(__name__)

META_FILENAME = "meta.pt"
INFO_KEY = "lightning_pipe"
FORMAT_VERSION = 1
TMP_SUFFIX = ".tmp-lightning-pipe"
OLD_SUFFIX = ".old-lightning-pipe"


def is_pipeline_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a complete lightning_pipe checkpoint directory (a save that did not finish is not)."""
    try:
        path = Path(path)
    except TypeError:
        return False
    if path.name.endswith(TMP_SUFFIX):
        return False
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


def read_meta(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint directory ``path``, weights-only unless the user passed ``weights_only=False``
    (Lightning's ``None`` included: torch loads weights only by default)."""
    file = path / META_FILENAME
    if not file.is_file():
        raise DamagedCheckpointError(f"`{file}` is missing: the checkpoint is incomplete.")
    meta = load_torch_file(file, weights_only)
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(f"`{file}` holds a {type(meta).__name__}, not a Lightning checkpoint dict.")
    return meta


def write_meta(meta: dict[str, Any], path: Path) -> None:
    """Write ``meta.pt`` into the directory ``path`` and sync it to disk."""
    with open(path / META_FILENAME, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())


def layout_record(
    layout: StageLayout, data_parallel_size: int, backbone: Sequence[str], choice: Optional[Config] = None
) -> dict[str, Any]:
    """The pipeline layout a checkpoint is saved with, as :func:`layout_of` reads it back: the stage ``bounds``, the
    sizes, the placement style and the backbone's paths; and ``schedule="auto"``'s choice (``auto``), if any."""
    return {
        **({"auto": choice.record()} if choice is not None else {}),
        "bounds": [list(b) for b in layout.bounds],
        "pipeline_parallel_size": layout.pipeline_size,
        "data_parallel_size": data_parallel_size,
        "stages_per_rank": layout.stages_per_rank,
        "style": layout.style,
        "backbone": list(backbone),
    }


def layout_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The pipeline layout a checkpoint was saved with (``bounds``, sizes, style, backbone path)."""
    return meta[INFO_KEY]["pipeline_layout"]


def resolve(path: Path) -> Path:
    """The checkpoint to read for ``path``: itself, or the old copy a replacing save left when it was interrupted."""
    if path.name.endswith(TMP_SUFFIX):
        raise FileNotFoundError(
            f"`{path}` is a save that did not finish (it was interrupted, or it failed) and is never loaded. Load"
            f" `{path.name[: -len(TMP_SUFFIX)]}` or an earlier checkpoint; delete this directory when no job is"
            " saving to it."
        )
    if path.exists():
        if path.is_dir() and not is_pipeline_checkpoint(path):
            lacks = " and ".join(f"`{n}`" for n in (META_FILENAME, ".metadata") if not (path / n).is_file())
            raise FileNotFoundError(
                f"`{path}` is a directory but not a complete lightning_pipe checkpoint: it lacks {lacks}."
                " Pass the directory `ModelCheckpoint`/`trainer.save_checkpoint` wrote, e.g."
                " `.../checkpoints/epoch=0-step=100.ckpt`. Directories ending in"
                f" `{TMP_SUFFIX}` are saves that were interrupted and cannot be loaded."
            )
        return path
    old = sibling(path, OLD_SUFFIX)
    if is_pipeline_checkpoint(old):
        warnings.warn(
            f"`{path}` does not exist, but `{old}` does: a save replacing it was interrupted. Loading `{old}`.",
            stacklevel=3,
        )
        return old
    if sibling(path, TMP_SUFFIX).exists():
        raise FileNotFoundError(
            f"Checkpoint `{path}` does not exist: a save to it did not finish (`{sibling(path, TMP_SUFFIX).name}` is"
            " what it left, and is never loaded). Load an earlier checkpoint."
        )
    raise FileNotFoundError(f"Checkpoint `{path}` does not exist.")


def commit(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` directory to ``path``, replacing what is there. If the move fails, what was at
    ``path`` (a checkpoint, a link ``save_last="link"`` made, or a file another strategy wrote) is put back."""
    old: Optional[Path] = None
    if _occupied(path):
        old = sibling(path, OLD_SUFFIX)
        remove(old)
        path.rename(old)  # a link is moved, not what it points to
    try:
        tmp.rename(path)
    except BaseException:
        if old is not None and not _occupied(path):
            old.rename(path)
        raise
    try:  # the checkpoint is in place: what follows is tidying, and must not fail the save
        _fsync_dir(path.parent)
        if old is not None:
            remove(old)
    except OSError as err:
        log.warning("checkpoint %s is saved, but tidying up after it failed: %s", path, err)
    log.debug("checkpoint committed: %s", path)


def remove(filepath: Union[str, os.PathLike]) -> None:
    """Delete a checkpoint directory (or a file or link left by another strategy); nothing there is fine."""
    path = Path(filepath)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif _occupied(path):
        path.unlink()


def _occupied(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling link included (``exists()`` follows links)."""
    return path.exists() or path.is_symlink()


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


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
