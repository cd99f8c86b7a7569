"""Checking that every stage of a pipeline was given the same batch.

Every rank of a pipeline loads the data itself; the stages are only correct together if they all see the same batch.
A loader that draws its order from each process's own random state, or an iterable dataset with per-process state,
breaks that silently. :func:`fingerprint` sums up a batch in three int64 words, and :func:`differs` compares them
over the pipeline group with one small ``all_reduce``:

- **structure**: a BLAKE2b digest of the batch's nesting (dict keys, sequence lengths, dataclass fields), each
  tensor's path, dtype and shape, and each other leaf: ``str``/``bytes``/``int``/``float``/``bool``/``None`` by
  value, anything else by its type name only (two different objects of one class are not told apart). Python's
  ``hash`` is salted per process, so it is not used.
- **content**: per tensor, the raw bits of at most 65 536 elements sampled with a stride (floats viewed as integers
  of the same width), each times its position (mod 65 521, plus 1), summed in int64 with wrap-around: integer sums
  do not depend on the order of summation, so every device gives the same word; the position weight makes a
  permutation visible.
- **rows**: the first 8 elements of every row, weighted by the row's index, so that reordering whole samples shows
  even where the strided sample would miss it.

A fingerprint costs about a millisecond for a 32 × 2048 token batch on one CPU core, and well under one for the
tests' batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe import _watchdog

if TYPE_CHECKING:
    from lightning_pipe.partition import StageLayout

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 65521
_MAX_ELEMENTS = 1 << 16
_ROW_ELEMENTS = 8


def fingerprint(batch: object, device: torch.device) -> torch.Tensor:
    """Three int64 words on ``device`` that equal batches share (see the module docstring)."""
    digest = hashlib.blake2b(digest_size=8)
    content = torch.zeros((), dtype=torch.int64, device=device)
    rows = torch.zeros((), dtype=torch.int64, device=device)
    for path, leaf in _leaves(batch, ""):
        if isinstance(leaf, torch.Tensor):
            digest.update(f"{path}:{leaf.dtype}:{tuple(leaf.shape)};".encode())
            if leaf.numel() == 0:
                continue
            flat = leaf.detach().reshape(-1)
            sample = _bits(flat[:: -(-flat.numel() // _MAX_ELEMENTS)])  # at most _MAX_ELEMENTS
            weights = torch.arange(sample.numel(), device=sample.device) % _PRIME + 1
            content += (sample * weights).sum().to(device)
            if leaf.dim() >= 1:
                first = _bits(leaf.detach().reshape(leaf.shape[0], -1)[:, :_ROW_ELEMENTS])
                index = torch.arange(1, leaf.shape[0] + 1, device=first.device).unsqueeze(1)
                rows += (first * index).sum().to(device)
        elif leaf is None or isinstance(leaf, (str, bytes, int, float, bool)):
            digest.update(f"{path}={leaf!r};".encode())
        else:
            digest.update(f"{path}:{type(leaf).__module__}.{type(leaf).__qualname__};".encode())
    structure = torch.tensor(struct.unpack("<q", digest.digest()), dtype=torch.int64, device=device)
    return torch.cat([structure, content.view(1), rows.view(1)])


def differs(words: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether some rank of ``group`` holds other ``words``: one ``all_reduce(MAX)`` of ``[words, ~words]``
    (``max(~w) == ~min(w)``, without the overflow of negating the smallest int64). The answer is the same on every
    rank."""
    both = torch.cat([words, torch.bitwise_not(words)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = words.numel()
    return not torch.equal(both[:n], torch.bitwise_not(both[n:]))


def _leaves(obj: object, path: str) -> Iterator[tuple[str, object]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):  # a dict, or Hugging Face's `BatchEncoding` (a `UserDict`)
        yield path, f"<dict:{len(obj)}>"
        for key in sorted(obj, key=repr):
            yield from _leaves(obj[key], f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        yield path, f"<{type(obj).__name__}:{len(obj)}>"
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield path, f"<{type(obj).__qualname__}>"
        for field in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, field.name), f"{path}.{field.name}")
    else:
        yield path, obj


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool:
        return tensor.to(torch.int64)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.contiguous()).reshape(-1)
    if tensor.is_floating_point():
        tensor = tensor.contiguous().view(_INT_VIEW[tensor.element_size()])
    return tensor.to(torch.int64)


class SameDataCheck:
    """The check that every stage of one pipeline was given the same batch (``check_data_every_n_batches``).

    Args:
        every: compare on the first 3 batches of training and of evaluation and on every ``every``-th after;
            ``None``: never.
        group: the pipeline's process group.
        layout: the stages' placement (the error names each rank's stages).
        device: where the fingerprint is reduced.
    """

    def __init__(self, every: Optional[int], group: dist.ProcessGroup, layout: StageLayout,
                 device: torch.device) -> None:
        self.every, self.group, self.layout, self.device = every, group, layout, device
        self._batches_checked = {"training": 0, "evaluation": 0}

    def __call__(self, kind: str, batch: object, rest: Sequence[object], kwargs: dict[str, object]) -> None:
        """Fail on every rank if the stages of this pipeline were not given the same batch.

        Every stage loads its own data; a loader whose order depends on the process (a sampler or generator seeded
        per process, an iterable dataset with per-process state, random augmentation) feeds the stages different
        samples, and the pipeline would train on a mix of them without any error. The first 3 batches of training
        and of evaluation and every ``check_data_every``-th after are compared: a fingerprint (shapes, values, row
        order; :mod:`~lightning_pipe._fingerprint`) and one small all-reduce over the pipeline group.
        """
        every, group = self.every, self.group
        if every is None or self.layout.pipeline_size == 1:
            return
        count = self._batches_checked[kind]
        self._batches_checked[kind] = count + 1
        if count >= 3 and count % every:
            return
        words = fingerprint((batch, list(rest), kwargs), self.device)
        with _watchdog.waiting(lambda: "the other pipeline ranks' batch fingerprints (the same-data check)"):
            if not differs(words, group):
                return
        gathered = [torch.empty_like(words) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, words, group=group)
        raise RuntimeError(different_data_message(kind, count, gathered, self.layout))


def different_data_message(kind: str, index: int, words: list[Tensor], layout: StageLayout) -> str:
    """Which pipeline ranks got another batch than pipeline rank 0, in what, and the usual causes and fixes."""
    aspects = ("structure (nesting, keys, shapes, dtypes)", "values", "row order")
    others = []
    for rank, mine in enumerate(words[1:], start=1):
        unequal = [aspects[i] for i in range(3) if mine[i] != words[0][i]]
        if unequal:
            stages = ", ".join(str(s) for s in layout.rank_stages(rank))
            others.append(f"pipeline rank {rank} (stage {stages}) differs in its {' and '.join(unequal)}")
    return (
        f"PipelineStrategy: the stages of one pipeline were given different {kind} batches (batch {index} of this"
        f" run): compared with pipeline rank 0 (stage {layout.rank_stages(0)[0]}), " + "; ".join(others) + "."
        " Every stage loads the data itself, so every process of a pipeline must draw the same batches in the same"
        " order. Usual causes: a sampler, `generator` or `worker_init_fn` seeded per process (seed it the same on"
        " every rank, e.g. `DataLoader(..., generator=torch.Generator().manual_seed(0))`); an `IterableDataset`"
        " that shards or shuffles by global rank (shard by `trainer.strategy.data_parallel_rank` and"
        " `data_parallel_size` instead: the stages of one pipeline share a data-parallel rank); random augmentation"
        " drawn from each process's random state (draw it from a generator seeded per data-parallel rank)."
        " `PipelineStrategy(check_data_every_n_batches=None)` turns this check off."
    )
