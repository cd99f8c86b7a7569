"""Turning a checkpoint directory into one ordinary Lightning checkpoint, in one process.

:func:`consolidated_checkpoint` reads the shards of every rank (no GPU, no process group) and returns what
single-device training would have saved: ``state_dict`` with every parameter and buffer under its original name, the
optimizer states in ``torch.optim`` format (``optimizer_states``), the LR schedulers, loops, callbacks,
hyper-parameters, ``epoch`` and ``global_step``. :func:`consolidate` writes it to a file;
:func:`load_from_checkpoint` loads a LightningModule from a directory through Lightning's own loader.

All three read the directory without running code from it (``_safe``) unless told the checkpoint is trusted.
"""

from __future__ import annotations

import io
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional, TypeVar, Union

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_pipe._compat.torch import read_dcp_in_one_process
from lightning_pipe.checkpoint._files import INFO_KEY, META_FILENAME, is_pipeline_checkpoint, read_meta, resolve
from lightning_pipe.checkpoint._names import split_name
from lightning_pipe.checkpoint._safe import SafeFileSystemReader, load_dcp_metadata, read_error

if TYPE_CHECKING:
    import lightning.pytorch as pl

Loadable = TypeVar("Loadable", bound="Union[pl.LightningModule, pl.LightningDataModule]")

log = logging.getLogger(__name__)

# What Lightning leaves out of a `save_weights_only` checkpoint.
_TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")


def consolidated_checkpoint(
    checkpoint_dir: Union[str, os.PathLike], weights_only: bool = False, *, trusted: bool = False
) -> dict[str, Any]:
    """Read a lightning_pipe checkpoint directory into one ordinary Lightning checkpoint dictionary.

    Args:
        checkpoint_dir: the directory ``ModelCheckpoint`` or ``trainer.save_checkpoint`` wrote.
        weights_only: leave out the optimizer, LR scheduler and callback states, as
            ``ModelCheckpoint(save_weights_only=True)`` does.
        trusted: the checkpoint comes from a source you trust: unpickle its files without restrictions (what
            ``weights_only=False`` means to ``torch.load``), which runs any code they hold. By default nothing from
            them runs, and a file that references anything else than tensors, plain containers and DCP's index
            classes is refused with :class:`~lightning_pipe.checkpoint._safe.UnsafeCheckpointError`.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` is not a complete checkpoint directory.
        UnsafeCheckpointError: a file was refused (it names the file and what it references).
        DamagedCheckpointError: a file is truncated or not what lightning_pipe wrote.
    """
    path = resolve(Path(checkpoint_dir))
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(
            f"`{path}` is not a complete lightning_pipe checkpoint directory (it needs `{META_FILENAME}` and DCP's"
            " `.metadata`)."
        )
    weights_only_load = False if trusted else None
    checkpoint = read_meta(path, weights_only_load)
    info = checkpoint.pop(INFO_KEY, None) or {}
    checkpoint.pop("pipeline_layout", None)
    load_dcp_metadata(path / ".metadata", weights_only_load)  # its own message before DCP wraps it
    try:
        stored = read_dcp_in_one_process(
            path,
            keys={"state_dict"} if weights_only else None,
            storage_reader=SafeFileSystemReader(path, weights_only_load),
        )
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise read_error(err, path) from err
    weights = stored.pop("state_dict", {})
    for alias, first in info.get("aliases", {}).items():  # a tensor with several names is stored once
        if first in weights:
            weights[alias] = weights[first]
    order = [k for k in info.get("state_dict_keys", []) if k in weights]
    order += [k for k in weights if k not in set(order)]
    checkpoint["state_dict"] = OrderedDict((k, weights[k]) for k in order)
    optimizers = info.get("optimizers", [])
    if "lr_schedulers" in checkpoint and optimizers:  # the save held training state (not weights only)
        checkpoint["optimizer_states"] = [
            _optimizer_state(stored.get(f"optimizer_{idx}", {}), opt["param_groups"])
            for idx, opt in enumerate(optimizers)
        ]
    if weights_only:
        for key in _TRAINING_STATE_KEYS:
            checkpoint.pop(key, None)
    return checkpoint


def consolidate(
    checkpoint_dir: Union[str, os.PathLike],
    output: Union[str, os.PathLike],
    weights_only: bool = False,
    overwrite: bool = False,
    *,
    trusted: bool = False,
) -> Path:
    """Write :func:`consolidated_checkpoint` of ``checkpoint_dir`` to the file ``output``; return its path."""
    out = Path(output)
    if out.exists() and not overwrite:
        raise FileExistsError(f"`{out}` exists; pass `--overwrite` (or `overwrite=True`) to replace it.")
    write_file(consolidated_checkpoint(checkpoint_dir, weights_only=weights_only, trusted=trusted), out)
    return out


def write_file(checkpoint: dict[str, object], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, out)


def _optimizer_state(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """A ``torch.optim.Optimizer.state_dict()`` from the flattened, name-keyed state DCP holds.

    ``groups`` lists each parameter group's names in the single-device order, so parameter ``i`` of the result is
    the ``i``-th name over all groups, as ``optimizer.load_state_dict`` expects.
    """
    names = {name for group in groups for name in group}
    per_name: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        name, sub = split_name(rest, names)
        if name is None or section not in ("state", "param_groups"):
            continue
        keys = sub.split(".") if section == "state" else [sub]
        _set_nested(per_name.setdefault(name, {}).setdefault(section, {}), keys, value)
    state: dict[int, Any] = {}
    param_groups = []
    number = 0
    for group_names in groups:
        hyper: Optional[dict[str, Any]] = None
        numbers = []
        for name in group_names:
            entry = per_name.get(name, {})
            if entry.get("state"):
                state[number] = entry["state"]
            if hyper is None and entry.get("param_groups"):
                hyper = dict(entry["param_groups"])
            numbers.append(number)
            number += 1
        group = hyper or {}
        if "param_names" in group:
            group["param_names"] = list(group_names)
        group["params"] = numbers
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def _set_nested(target: dict[str, Any], keys: list[str], value: object) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def load_from_checkpoint(
    cls: type[Loadable], checkpoint_path: Union[str, os.PathLike, IO[bytes]], **kwargs: Any
) -> Loadable:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` that also reads a lightning_pipe checkpoint directory.

    Lightning reads a checkpoint file; a pipelined checkpoint is a directory of shards. For a directory, the weights
    and hyper-parameters are consolidated in memory (as ``python -m lightning_pipe.consolidate DIR OUT
    --weights-only`` would write them) and handed to Lightning's own loader, so ``map_location``, ``hparams_file``,
    ``strict`` and hyper-parameter overrides in ``kwargs`` behave as they always do. Any other path goes to
    ``cls.load_from_checkpoint`` unchanged. No process group is needed: this process reads every rank's shards.
    ``weights_only`` means what it means to Lightning: the directory's files are read weights-only (nothing from them
    runs) unless it is ``False``.

    Example::

        model = lightning_pipe.load_from_checkpoint(LitLM, "checkpoints/last.ckpt")
    """
    if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isdir(checkpoint_path):
        if not is_pipeline_checkpoint(checkpoint_path):
            raise IsADirectoryError(
                f"`{checkpoint_path}` is a directory, not a checkpoint file, and not a complete lightning_pipe"
                f" checkpoint directory either (that holds `{META_FILENAME}` and DCP's `.metadata`; an interrupted"
                " save leaves a `*.tmp-lightning-pipe` directory instead). Pass a checkpoint file or a complete"
                " checkpoint directory."
            )
        buffer = io.BytesIO()
        trusted = kwargs.get("weights_only") is False
        torch.save(consolidated_checkpoint(checkpoint_path, weights_only=True, trusted=trusted), buffer)
        buffer.seek(0)
        log.debug("consolidated %s in memory (%d bytes) for load_from_checkpoint", checkpoint_path, buffer.tell())
        checkpoint_path = buffer
    return cls.load_from_checkpoint(checkpoint_path, **kwargs)
