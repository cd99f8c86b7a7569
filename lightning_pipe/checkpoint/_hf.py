"""Hugging Face directories written by every rank in parallel, through DCP's ``HuggingFaceStorageWriter``.

[Note: the parallel Hugging Face save]
Each rank writes the tensors of its own stages (a sharded or tensor-parallel one: its shard only) under the Hugging
Face model's own names, into sharded safetensors files of its own (``save_distributed=True``); then every rank
consolidates some of the output files (``consolidate_safetensors_files_on_every_rank``), so no process ever holds the
whole model, and the directory holds ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``, as
``save_pretrained`` writes them. Which tensor goes to which file is decided from the whole model's names and sizes,
the same on every rank (:func:`file_index`), packed in state-dict order up to ``max_shard_size``. A tensor with several
names (a head tied to the embedding) is written once, under its first name, as ``save_pretrained`` does. Rank 0
writes ``config.json`` (and ``generation_config.json``). A peft model writes its adapter only
(``adapter_model.safetensors``, ``adapter_config.json``), as ``PeftModel.save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.tensor import DTensor

from lightning_pipe._bytes import parse_bytes
from lightning_pipe._compat.torch import read_dcp_in_one_process
from lightning_pipe.checkpoint._files import INFO_KEY, is_pipeline_checkpoint, layout_record, read_meta, resolve
from lightning_pipe.checkpoint._safe import SafeFileSystemReader, load_dcp_metadata

if TYPE_CHECKING:
    from lightning_pipe._model.cut import Cut
    from lightning_pipe.schedules import Config

INDEX_FILE = "model.safetensors.index.json"
_SHARDED = ".sharded"


def pretrained_attribute(module: nn.Module) -> tuple[str, nn.Module]:
    """The LightningModule's attribute that is a Hugging Face ``PreTrainedModel`` (or a peft model around one):
    ``(name, model)``. Raises ``ValueError`` naming them when there are none or several."""
    found = [(name, child) for name, child in module.named_children() if _is_pretrained(child)]
    if len(found) != 1:
        which = f"several: {[n for n, _ in found]}" if found else "none"
        raise ValueError(
            f"`save_pretrained` writes the Hugging Face model that is an attribute of the LightningModule, and it "
            f"has {which}. Pass `attribute=` the one to save."
        )
    return found[0]


def _is_pretrained(model: nn.Module) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def file_index(sizes: dict[str, int], max_shard_size: int) -> dict[str, int]:
    """``{name: file number from 1}``: names in order, a new file when the next tensor would pass the limit (a tensor
    larger than the limit gets a file of its own), as ``split_torch_state_dict_into_shards`` packs them in order."""
    index, used, mapping = 1, 0, {}
    for name, size in sizes.items():
        if used and used + size > max_shard_size:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def save_pretrained(
    module: nn.Module,
    dirpath: Union[str, os.PathLike],
    *,
    stored: Callable[[str], str],
    attribute: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    whole_sizes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    group: Optional[dist.ProcessGroup] = None,
) -> Path:
    """Write the Hugging Face model inside ``module`` to ``dirpath`` from every rank ([Note: the parallel Hugging Face
    save]); every rank of the job calls it.

    Args:
        module: the LightningModule (split or whole); its ``state_dict()`` gives this rank's tensors.
        stored: ``key -> stored key`` (a tied tensor's first name).
        attribute: the LightningModule's attribute that holds the Hugging Face model; found when ``None``.
        max_shard_size: the largest file, as ``save_pretrained`` takes it.
        whole_sizes: ``{state-dict key: (shape, dtype)}`` of the whole model, the same on every rank.
        group: the ranks that write (every rank when ``None``).
    """
    name, model = (attribute, getattr(module, attribute)) if attribute else pretrained_attribute(module)
    path = Path(dirpath)
    prefix = f"{name}."
    local = {k: v for k, v in module.state_dict().items() if k.startswith(prefix) and stored(k) == k}
    local = {k[len(prefix):]: _plain(v) for k, v in local.items()}
    order = [k[len(prefix):] for k in whole_sizes if k.startswith(prefix) and stored(k) == k]
    peft = _is_peft(model)
    if peft:  # one file, as `PeftModel.save_pretrained` writes it
        local, order = _adapter_only(model, local, order)
        mapping = dict.fromkeys(order, 1)
    else:
        sizes = {k: _numel(whole_sizes[prefix + k][0]) * whole_sizes[prefix + k][1].itemsize for k in order}
        mapping = file_index(sizes, parse_bytes(max_shard_size))
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = path / _SHARDED
    if rank == 0:
        if sharded.exists():
            shutil.rmtree(sharded)
        path.mkdir(parents=True, exist_ok=True)
    _barrier(group)
    writer = HuggingFaceStorageWriter(str(sharded), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(local, storage_writer=writer, process_group=group)
    consolidate_safetensors_files_on_every_rank(str(sharded), str(path), mapping, process_group=group)
    _barrier(group)
    if rank == 0:
        shutil.rmtree(sharded, ignore_errors=True)
        _write_configs(model, path, peft, mapping)
    _barrier(group)
    return path


def _adapter_only(model: nn.Module, local: dict[str, Tensor], order: list[str]) -> tuple[dict[str, Tensor], list[str]]:
    """The adapter's tensors under the names ``PeftModel.save_pretrained`` writes them."""
    from peft.utils import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=local)
    names = get_peft_model_state_dict(model, state_dict=dict.fromkeys(order, torch.empty(0)))
    return adapter, list(names)


def _write_configs(model: nn.Module, path: Path, peft: bool, mapping: dict[str, int]) -> None:
    if peft:
        model.peft_config[model.active_adapter].save_pretrained(str(path))
        (path / INDEX_FILE).unlink(missing_ok=True)
        files = sorted(path.glob("model-*-of-*.safetensors"))
        if len(files) != 1:
            raise RuntimeError(f"An adapter is written as one file; {len(files)} were written to {path}.")
        files[0].rename(path / "adapter_model.safetensors")
        return
    config = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(path))
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(str(path))
    index = json.loads((path / INDEX_FILE).read_text())
    missing = set(mapping) - set(index.get("weight_map", {}))
    if missing:
        raise RuntimeError(f"The Hugging Face save to {path} is missing {sorted(missing)[:5]}.")


def _plain(value: Tensor) -> Tensor:
    return value if isinstance(value, DTensor) else value.detach()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _barrier(group: Optional[dist.ProcessGroup]) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


# ------------------------------------------------------------------------------------------- training checkpoints
def stored_layout(cut: Cut, data_parallel_size: int, module: nn.Module, *, choice: Optional[Config]) -> dict[str, Any]:
    """What a training checkpoint stores of the pipeline: its layout (:func:`~._files.layout_record`) with what
    ``schedule="auto"`` chose (``choice``: ``None`` for explicit arguments, or until it chose), and the Hugging Face
    model's configs for ``consolidate --format hf`` (:func:`config_record`)."""
    record = layout_record(cut.layout, data_parallel_size, cut.backbone.paths, choice)
    record["huggingface"] = config_record(module)
    return record


def config_record(module: nn.Module) -> Optional[dict[str, Optional[str]]]:
    """What a training checkpoint stores to be converted to a Hugging Face directory later: the attribute that holds
    the model, its class and its configs as JSON text; ``None`` when the module holds no (single) Hugging Face model."""
    try:
        name, model = pretrained_attribute(module)
    except ValueError:
        return None
    if _is_peft(model):
        return None  # an adapter is saved with `save_pretrained` during the run
    generation = getattr(model, "generation_config", None)
    can_generate = generation is not None and getattr(model, "can_generate", lambda: False)()
    return {
        "attribute": name,
        "class": type(model).__name__,
        "config": model.config.to_json_string(),
        "generation_config": generation.to_json_string() if can_generate else None,
    }


def convert_checkpoint(
    checkpoint_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *,
    max_shard_size: Union[int, str] = "5GB", trusted: bool = False,
) -> Path:
    """Write a training checkpoint directory as a Hugging Face directory, in one process, holding at most one output
    file's tensors at a time (``python -m lightning_pipe.consolidate CKPT_DIR OUT_DIR --format hf``)."""
    from safetensors.torch import save_file  # installed with transformers, not a dependency of this package

    path = resolve(Path(checkpoint_dir))
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(f"`{path}` is not a complete lightning_pipe checkpoint directory.")
    weights_only = False if trusted else None
    info = read_meta(path, weights_only).get(INFO_KEY) or {}
    record = (info.get("pipeline_layout") or {}).get("huggingface")
    if not isinstance(record, dict) or not isinstance(record.get("config"), str):
        raise ValueError(
            f"`{path}` holds no Hugging Face model's config (it was saved from a module without one attribute that is"
            " a `PreTrainedModel`, or by an older lightning_pipe). Save the model with"
            " `PipelineStrategy.save_pretrained`."
        )
    metadata = load_dcp_metadata(path / ".metadata", weights_only)
    prefix = f"state_dict.{record['attribute']}."
    sizes: dict[str, int] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and hasattr(meta, "size"):
            sizes[fqn[len(prefix):]] = _numel(tuple(meta.size)) * meta.properties.dtype.itemsize
    order = [k[len(prefix) - len("state_dict."):] for k in info.get("state_dict_keys", [])]
    order = [k for k in order if k in sizes] + [k for k in sizes if k not in set(order)]
    mapping = file_index({k: sizes[k] for k in order}, parse_bytes(max_shard_size))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count = max(mapping.values(), default=0)
    weight_map: dict[str, str] = {}
    reader = SafeFileSystemReader(path, weights_only)
    for index in range(1, count + 1):
        keys = {f"{prefix}{k}" for k, i in mapping.items() if i == index}
        stored = read_dcp_in_one_process(path, keys=keys, storage_reader=reader)
        tensors = {k: v.contiguous() for k, v in _flatten(stored).items()}
        tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        filename = f"model-{index:05d}-of-{count:05d}.safetensors"
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        del stored, tensors
    total = sum(sizes.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(record["config"])
    if isinstance(record.get("generation_config"), str):
        (out / "generation_config.json").write_text(record["generation_config"])
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Tensor]:
    flat: dict[str, Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, Tensor):
            flat[f"{prefix}{key}"] = value
    return flat
