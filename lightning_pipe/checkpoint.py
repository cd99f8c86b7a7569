"""Saving and loading pipelined checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory (the path Lightning passes, e.g. ``epoch=0-step=100.ckpt/``):

- DCP shards (``*.distcp`` and ``.metadata``) hold ``state_dict`` (model weights, original parameter names) and
  ``optimizer_<i>`` (flattened, FQN-keyed optimizer state), each rank writing its own stages;
- ``meta.pt`` holds everything else Lightning puts in a checkpoint (loops, callbacks, LR schedulers, hyper-
  parameters, ...), written once by rank 0, plus the pipeline layout for information.

Saving writes into a temporary sibling directory and renames it into place once every rank has finished, so a
job killed mid-save leaves the previous checkpoint intact and no half-written directory under the final name.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from lightning_pipe.strategy import PipelineStrategy

META_FILENAME = "meta.pt"
_TMP_SUFFIX = ".tmp-lightning-pipe"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_pipeline_checkpoint(path: Any) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


def save(strategy: PipelineStrategy, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Write ``checkpoint`` to the directory ``filepath`` from every rank."""
    path = Path(filepath)
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    if strategy.is_global_zero and tmp.exists():
        shutil.rmtree(tmp)
    strategy.barrier("lightning_pipe.save.start")
    checkpoint = dict(checkpoint)
    checkpoint.pop("optimizer_states", None)
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    model = strategy.lightning_module
    for idx, optimizer in enumerate(strategy.optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    dcp.save(state, checkpoint_id=tmp)
    if strategy.is_global_zero:
        checkpoint["pipeline_layout"] = {
            "bounds": [list(b) for b in strategy.layout.bounds],
            "pipeline_parallel_size": strategy.layout.pipeline_size,
            "data_parallel_size": strategy.data_parallel_size,
            "style": strategy.layout.style,
        }
        torch.save(checkpoint, tmp / META_FILENAME)
    strategy.barrier("lightning_pipe.save.written")
    if strategy.is_global_zero:
        remove(path)
        tmp.rename(path)
    strategy.barrier("lightning_pipe.save.done")


def remove(filepath: Any) -> None:
    """Delete a checkpoint directory (or a file left by another strategy)."""
    path = Path(filepath)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def load(strategy: PipelineStrategy, filepath: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Load a checkpoint into the strategy's module and optimizers in place; return the rest for Lightning.

    ``filepath`` is a pipelined checkpoint directory (any pipeline layout) or an ordinary single-file Lightning
    checkpoint, of which each rank takes its stages' weights.
    """
    path = Path(filepath)
    model = strategy.lightning_module
    strict = model.strict_loading
    if path.is_file():
        checkpoint = torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)
        _load_local_weights(model, checkpoint["state_dict"], strict, path)
        checkpoint.pop("optimizer_states", None)
        return checkpoint
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(
            f"`{path}` is not a lightning_pipe checkpoint directory (no `{META_FILENAME}` and `.metadata` in it) nor a"
            " checkpoint file. Pass the directory ModelCheckpoint wrote, e.g. `.../epoch=0-step=100.ckpt`."
        )
    checkpoint = torch.load(path / META_FILENAME, map_location="cpu", weights_only=bool(weights_only))
    state: dict[str, Any] = {"state_dict": model.state_dict()}
    optimizers = strategy.optimizers if strategy.lightning_module.trainer.state.fn == "fit" else []
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    _check_keys(path, state, strict)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    model.load_state_dict(state["state_dict"], strict=strict)
    for idx, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{idx}"], options=_OPTIM_OPTIONS)
    return checkpoint


def _check_keys(path: Path, state: dict[str, Any], strict: bool) -> None:
    """Name the missing keys up front instead of letting DCP fail with a planner error."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    stored = set(metadata.state_dict_metadata)
    wanted = {f"{top}.{key}" for top, sub in state.items() for key in sub}
    missing = sorted(k for k in wanted if k not in stored and (strict or not k.startswith("state_dict.")))
    if missing:
        raise KeyError(
            f"Checkpoint `{path}` lacks {len(missing)} entries this model needs, e.g. {missing[:5]}. Check that it"
            " was saved from the same model and optimizer configuration, or set `model.strict_loading = False` to"
            " load the weights that match."
        )


def _load_local_weights(model: torch.nn.Module, full: dict[str, Any], strict: bool, path: Path) -> None:
    local = model.state_dict()
    missing = [k for k in local if k not in full]
    if missing and strict:
        raise KeyError(
            f"Checkpoint `{path}` has no weights for {len(missing)} parameters of this stage, e.g. {missing[:5]}."
            " Set `model.strict_loading = False` to load the weights that match."
        )
    model.load_state_dict({k: full[k] for k in local if k in full}, strict=strict)
