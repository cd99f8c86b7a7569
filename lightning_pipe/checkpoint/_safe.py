"""Reading a checkpoint directory without running code from it.

A checkpoint is untrusted input. Its three kinds of files are unpickled as follows:

- ``meta.pt`` (``torch.save``): ``torch.load(weights_only=True)``, admitting also the few harmless types Lightning
  may store among hyper-parameters (:data:`META_SAFE_GLOBALS`) and whatever the user allow-listed with
  ``torch.serialization.add_safe_globals``;
- DCP's index ``.metadata`` (a plain pickle, which torch's ``FileSystemReader`` loads with ``pickle.load``): a
  restricted unpickler that admits only DCP's metadata classes and the torch and stdlib globals they reduce to
  (:func:`dcp_metadata_globals`);
- the shards ``__<rank>_<n>.distcp``: torch reads tensors weights-only already, but hands every non-tensor entry
  (optimizer hyper-parameters) to the load planner, whose ``load_bytes`` calls ``torch.load(weights_only=False)``.
  :class:`SafeFileSystemReader` unpickles those entries weights-only before the planner sees them.

``weights_only=False``, passed by the user as in Lightning, lifts all three restrictions: the files are then read
exactly as torch reads them, which runs whatever code they hold. ``weights_only=None`` (Lightning's default) is
resolved as ``torch.load`` resolves it: restricted, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set;
``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` restricts even an explicit ``False``. Anything refused raises
:class:`UnsafeCheckpointError` naming the file and the refused global; nothing from the file has run by then.
A file that cannot be read at all (truncated, not what it should be) raises :class:`DamagedCheckpointError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import os
import pathlib
import pickle
import re
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
    from torch.futures import Future

#: Types ``meta.pt`` may hold that a weights-only load refuses by default, and that are harmless to build: what
#: ``save_hyperparameters`` keeps for an argparse configuration, and paths.
META_SAFE_GLOBALS: list[type] = [
    argparse.Namespace,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.WindowsPath,
    pathlib.PureWindowsPath,
]

_TRUST_HINT = (
    "Nothing from the file was run. If you trust this checkpoint, load it without restrictions:"
    " `lightning_pipe.load_from_checkpoint(cls, path, weights_only=False)`, `stored_balance(path,"
    " weights_only=False)`, `python -m lightning_pipe.consolidate --trusted`, or, to resume with"
    " `trainer.fit(ckpt_path=...)` (Lightning 2.6 does not hand `weights_only` on to a strategy that restores after"
    " setup), the environment variable `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`"
)
_TRUE = ("1", "y", "yes", "true")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references a global that a weights-only load refuses; nothing from it was run."""


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file cannot be read: truncated, missing, or not what lightning_pipe or DCP wrote."""


def trusted(weights_only: Optional[bool]) -> bool:
    """Whether to read without restrictions: ``weights_only`` resolved as ``torch.load`` resolves it (an explicit
    ``False`` from the user, or ``None`` with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set; never with
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` set)."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return False
    if weights_only is None and os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        warnings.warn(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: lightning_pipe reads checkpoint files without restrictions,"
            " which runs any code they hold.",
            UserWarning,
            stacklevel=3,
        )
        return True
    return weights_only is False


# ------------------------------------------------------------------------------------------------------------ meta.pt
def load_torch_file(file: Path, weights_only: Optional[bool] = None) -> Any:
    """``torch.load`` of a checkpoint's ``meta.pt`` onto the CPU, weights-only unless ``weights_only=False``."""
    unrestricted = trusted(weights_only)
    try:
        if unrestricted:
            return torch.load(file, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(META_SAFE_GLOBALS):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if unrestricted:
            raise DamagedCheckpointError(f"`{file}` cannot be read: {_first_line(err)}") from err
        raise _refused(file, err) from None
    except (RuntimeError, EOFError, ValueError) as err:  # torch's zip reader: "failed finding central directory"
        raise DamagedCheckpointError(
            f"`{file}` is damaged or incomplete ({_first_line(err)}). Load an earlier checkpoint."
        ) from err


def _refused(file: Path, err: BaseException, what: str = "") -> UnsafeCheckpointError:
    """The weights-only unpickler's refusal, said with the file, the refused global and the remedy."""
    text = str(err)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        reason = f"references `{found.group(1)}`, which a weights-only load does not admit"
    else:
        detail = re.search(r"WeightsUnpickler error: (.*)", text)
        reason = f"holds what a weights-only load refuses ({(detail.group(1) if detail else _first_line(err))[:200]})"
    allow = (
        " or, if it holds objects of your own classes, allow-list them with"
        " `torch.serialization.add_safe_globals([...])`"
    )
    return UnsafeCheckpointError(f"`{file}`{what} {reason}. {_TRUST_HINT}{allow if found else ''}.")


# --------------------------------------------------------------------------------------------------------- .metadata
#: The globals DCP's ``.metadata`` references, by the names the pickle holds (torch 2.13 to 2.15 write the same
#: set; torch dtypes such as ``torch.float32`` are admitted separately). Three are private to torch: the file holds
#: them because DCP's dataclasses and ``torch.layout`` pickle that way; they are names to admit, not APIs we call.
DCP_INDEX_GLOBALS: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",  # an Enum: a tensor's memory format
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),  # where each entry lies in which shard
    "torch.serialization": ("_get_layout",),  # a torch.layout pickles as `_get_layout("torch.strided")`
    "torch": ("Size",),
    "collections": ("OrderedDict",),
    # StorageMeta.checkpoint_id: the path DCP wrote to
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
}


def dcp_metadata_globals() -> dict[tuple[str, str], object]:
    """``(module, name)`` -> object for every global :data:`DCP_INDEX_GLOBALS` admits, plus those the user
    allow-listed with ``torch.serialization.add_safe_globals``."""
    allowed: dict[tuple[str, str], object] = {}
    for module_name, names in DCP_INDEX_GLOBALS.items():
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name, None)
            if obj is not None:  # a torch that no longer has it does not write it either
                allowed[(module_name, name)] = obj
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        module_name, _, qualname = name.rpartition(".")
        allowed[(module_name, qualname)] = obj
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: Path) -> None:
        super().__init__(file)
        self._allowed = dcp_metadata_globals()
        self._source = source

    def find_class(self, module: str, name: str) -> object:
        obj = self._allowed.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"`{self._source}` references `{module}.{name}`, which DCP's index never holds: the file was not"
            f" written by torch.distributed.checkpoint, or it was tampered with. {_TRUST_HINT}."
        )

    def persistent_load(self, pid: object) -> NoReturn:
        raise UnsafeCheckpointError(
            f"`{self._source}` holds a persistent reference, which DCP's index never holds. {_TRUST_HINT}."
        )


def load_dcp_metadata(file: Path, weights_only: Optional[bool] = None) -> _dcp_metadata.Metadata:
    """Unpickle DCP's index ``file`` (``.metadata``), admitting only DCP's metadata classes unless
    ``weights_only=False``."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError as err:
        raise DamagedCheckpointError(f"`{file}` is missing: the checkpoint is incomplete.") from err
    try:
        if trusted(weights_only):
            metadata = pickle.loads(raw)
        else:
            metadata = _RestrictedUnpickler(io.BytesIO(raw), file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or not a pickle: EOFError, UnpicklingError, ValueError, ...
        raise DamagedCheckpointError(
            f"`{file}` is damaged or incomplete ({_first_line(err)}). Load an earlier checkpoint."
        ) from err
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise DamagedCheckpointError(
            f"`{file}` holds a {type(metadata).__name__}, not the index torch.distributed.checkpoint writes."
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that runs no code from the checkpoint: ``.metadata`` through the restricted
    unpickler, non-tensor entries of the shards weights-only. ``weights_only=False`` reads as torch does.

    ``dcp.load`` takes any ``StorageReader``; this one changes only how pickles are read, never what.
    """

    def __init__(self, path: Union[str, os.PathLike], weights_only: Optional[bool] = None) -> None:
        super().__init__(path)
        self.weights_only = weights_only

    def read_metadata(self, *args: object, **kwargs: object) -> _dcp_metadata.Metadata:
        rank = kwargs.get("rank")  # DCP asks for a rank's own index when the global one cannot be read
        name = ".metadata" if rank is None else f"__{rank}.metadata"  # DCP's file names
        metadata = load_dcp_metadata(Path(self.path) / name, self.weights_only)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read one shard file after the other, so that a failure names its file (``checkpoint_file``)."""
        if not trusted(self.weights_only):
            planner = _WeightsOnlyEntries(planner, self)
        per_file: dict[Path, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.shard_of(item), []).append(item)
        future = None
        for file, items in per_file.items():
            try:
                future = super().read_data(dataclasses.replace(plan, items=items), planner)
                future.wait()
            except Exception as err:
                if not isinstance(err, (UnsafeCheckpointError, DamagedCheckpointError)):
                    err.checkpoint_file = str(file)  # kept when DCP gathers the failure from this rank
                raise
        return future if future is not None else super().read_data(plan, planner)

    def shard_of(self, read_item: ReadItem) -> Path:
        """The shard file a read item comes from."""
        info = getattr(self, "storage_data", {}).get(read_item.storage_index)
        return Path(self.path) / (info.relative_path if info is not None else "<shard>")


class _WeightsOnlyEntries:
    """The load planner as ``FileSystemReader.read_data`` sees it, with each non-tensor entry unpickled weights-only
    first: the planner's own ``load_bytes`` (``torch.load(weights_only=False)``) then receives a pickle this
    process wrote from the admitted objects."""

    def __init__(self, planner: LoadPlanner, reader: SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        file = self._reader.shard_of(read_item)
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refused(file, err, f" (entry `{read_item.dest_index.fqn}`)") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


# ------------------------------------------------------------------------------------------------------------ errors
def read_error(err: BaseException, path: Path, rank: Optional[int] = None) -> Exception:
    """The error to raise for a failed ``dcp.load`` of the directory ``path``: DCP gathers every rank's failure
    into a ``CheckpointException`` (a ``BaseException``); a refused pickle stays an :class:`UnsafeCheckpointError`,
    anything else is a :class:`DamagedCheckpointError`."""
    where = f" (reported on rank {rank})" if rank is not None else ""
    failures = _failures(err)
    for _, exc in failures:
        if isinstance(exc, UnsafeCheckpointError):
            return UnsafeCheckpointError(f"{exc}{where}")
    causes = "; ".join(f"rank {r}: {_first_line(e)}" if r is not None else _first_line(e) for r, e in failures)
    return DamagedCheckpointError(
        f"Reading checkpoint `{path}` failed{where}: its files are damaged or incomplete. Load an earlier"
        f" checkpoint. Cause: {causes}"
    )


def _failures(err: BaseException) -> list[tuple[Optional[int], BaseException]]:
    if isinstance(err, CheckpointException):  # one failure per rank, each (exception, stack) or an exception
        out: list[tuple[Optional[int], BaseException]] = []
        for rank, failure in sorted(err.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            out.append((rank, exc if isinstance(exc, BaseException) else RuntimeError(str(exc))))
        return out
    return [(None, err)]


def _first_line(err: BaseException) -> str:
    """``Type: first line`` of an error (its first sentence if the line is long), and the file it was reading."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if len(text) > 160 and ". " in text:
        text = text[: text.index(". ")]
    file = getattr(err, "checkpoint_file", None)
    where = f" (in `{file}`)" if file and file not in text else ""
    return type(err).__name__ + (f": {text}" if text else "") + where
