"""Pretrained Hugging Face weights read per stage: :func:`read_pretrained`.

[Note: pretrained weights per stage]
``from_pretrained`` refuses the meta device, and a model built on it in ``configure_model`` (``from_config``) is
materialised by the strategy after the cut, each rank only its stages. :func:`read_pretrained` marks such a model with
a Hugging Face directory; once this rank's stages are materialised (and sharded, or split over tensor ranks), every
rank reads from the directory exactly the tensors it holds, through DCP's ``HuggingFaceStorageReader``: a shard reads
its slice of the file, and no rank reads another stage's weights. On a model that is not on the meta device (one
process, or any strategy) it reads at once. The directory is checked against the whole model first, on every rank
alike: a missing, unexpected or mis-shaped tensor is an error that names it. Safetensors only: reading runs no code.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Callable, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

#: ``{model: directory}`` of the models whose weights are read once their stages are materialised.
_marked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_pretrained(model: nn.Module, path: Union[str, os.PathLike]) -> nn.Module:
    """Fill ``model`` (a Hugging Face ``PreTrainedModel``) from the Hugging Face directory ``path``: now, when its
    tensors are real; under ``PipelineStrategy``, for a model built on the meta device (``configure_model``), each
    rank reads its own stages once they are materialised ([Note: pretrained weights per stage]). Returns ``model``.

    Raises:
        FileNotFoundError: ``path`` holds no safetensors files.
        ValueError: the files miss a tensor of the model, hold one it does not have, or one of another shape.
    """
    directory = Path(path)
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"`{directory}` holds no `.safetensors` files to read the pretrained weights from.")
    if any(t.is_meta for t in model.state_dict().values()):
        _marked[model] = directory
        return model
    state = _unique(model.state_dict())
    _check(directory, {k: tuple(v.shape) for k, v in state.items()})
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not dist.is_initialized())
    return model


def read_marked(module: nn.Module, stored: Callable[[str], str], whole_shapes: dict[str, tuple]) -> None:
    """Read the pretrained weights of every model under ``module`` that :func:`read_pretrained` marked, each rank its
    own tensors (``module.state_dict()``, under the whole model's names: ``stored`` maps a tied name to the stored one).
    Every rank calls it, after its stages are materialised; ``whole_shapes`` is ``{key: (shape, dtype)}`` of the whole
    model, the same on every rank."""
    marked = [(path, sub) for path, sub in module.named_modules() if sub in _marked]
    if not marked:
        return
    local = module.state_dict()
    for path, sub in marked:
        directory = _marked.pop(sub)
        prefix = f"{path}." if path else ""
        names = {k: stored(k) for k in whole_shapes if k.startswith(prefix)}
        _check(directory, {stored_key[len(prefix):]: whole_shapes[stored_key][0] for stored_key in names.values()})
        state: dict[str, Tensor] = {}
        for key, value in local.items():
            if key in names:
                state.setdefault(names[key][len(prefix):], value)
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)))


def _check(directory: Path, shapes: dict[str, tuple]) -> None:
    """The directory's tensors are the model's: none missing, none unexpected, none of another shape."""
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    missing = sorted(set(shapes) - set(metadata))
    unexpected = sorted(set(metadata) - set(shapes))
    wrong = sorted(k for k in set(shapes) & set(metadata) if tuple(metadata[k].size) != tuple(shapes[k]))
    if missing or unexpected or wrong:
        parts = [
            f"{label} {names[:5]}{' ...' if len(names) > 5 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong))
            if names
        ]
        raise ValueError(
            f"The pretrained weights in `{directory}` do not match the model: {'; '.join(parts)}. Read a directory "
            "saved from this architecture and config (`save_pretrained`), or build the model from its `config.json`."
        )


def _unique(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """One entry per tensor (a tied head is stored under the embedding's name)."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        if id(value) not in seen:
            seen.add(id(value))
            out[key] = value
    return out
