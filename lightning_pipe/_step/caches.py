"""Key-value caches of a generation pass, split per microbatch and per stage.

[Note: caches per microbatch] A decoding loop hands the model one cache object for the whole batch
(``generate()``'s ``DynamicCache``); each attention layer appends the keys and values of its new tokens to its own
entry in it. Under the pipeline a pass runs microbatch by microbatch, and each stage runs only its own layers. So:

- every microbatch (its rows ``start:stop``) gets a cache of its own, made from the user's while that is still
  empty, and the stage runs see it in place of the user's (:meth:`PassCaches.for_rows`); the layers a rank runs fill
  their entries in it, nothing else does: each stage holds the keys and values of its own layers only, bounded by
  the prompt plus the new tokens;
- the entries of the layers another stage runs, in every microbatch's cache and in the user's, are *ghosts* of the
  right shape after each pass (:meth:`PassCaches.mirror`): ``get_seq_length`` and ``get_mask_sizes`` answer the
  same on every stage (position ids, ``cache_position`` and masks are computed from them on every stage), with no
  memory;
- beam search reorders the user's cache between steps: that call reorders the rows over the microbatches' caches
  (:meth:`PassCaches.reorder`);
- the shape probe of a new microbatch shape runs on ghost copies (on a real throwaway copy where the stage is
  probed for real: tensor-parallel stages), so it changes nothing;
- at the end of the step everything is dropped (:meth:`PassCaches.release`): the memory goes with the step.

What is split is Hugging Face's ``Cache`` with dynamic layers (the default of ``generate()``): full attention,
sliding windows, an indexer's keys (DeepSeek V3.2), compressor buffers (DeepSeek V4), the conv and recurrent states of
linear attention and state-space layers (Mamba), and the hybrids of those. Every tensor a layer holds is a state per
row (:func:`_row_slots`); counters (lengths, flags) are the same for every row. A microbatch's stage run sees the
layers of its window as they are (they change only when they run) and every other layer as it was when the pass
started. An encoder-decoder's cache (``EncoderDecoderCache``) is two such caches, self- and cross-attention, split
alike; its layer 0 is the first block of the pass ([Note: partial passes] in :mod:`lightning_pipe._step.partial`). A
cache of another kind (static, quantised, offloaded) is refused at its first pass, naming the fix; a cache the loop
filled before the pipeline saw it too.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Hashable
from typing import Callable, Optional, Protocol, TypeGuard, TypeVar

import torch
from torch import Tensor, nn

from lightning_pipe._compat.torch import Swaps
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import Ghost, ghost_of
from lightning_pipe._step.attribute_states import AttributeStates

#: The layer kinds of Hugging Face's caches that split by rows (a layer of a subclass of one of them too, unless it is
#: also one of :data:`_NOT_SPLITTABLE`): tensors per row (keys and values ``[batch, heads, length, dim]``, conv and
#: recurrent states ``[batch, ...]``) and counters that are the same for every row.
_SPLITTABLE = ("DynamicLayer", "LinearAttentionLayer")
#: Layer kinds whose tensors are preallocated or packed: a microbatch cannot hold its rows of them.
_NOT_SPLITTABLE = ("StaticLayer", "BaseQuantizedLayer")
#: A layer's per-row tensors whose batch dimension is not the first (``[position dims, batch, length]``).
_BATCH_DIM = {"indexer_position_ids": 1}
#: What a decoding loop may do to a cache besides passing it to the model; reordering is handled, the others refused.
_REFUSED = ("crop", "batch_repeat_interleave", "batch_select_indices", "reset", "offload", "prefetch")


class KVCache(Protocol):
    """What this module uses of a cache object (Hugging Face's ``Cache`` and its look-alikes: :func:`is_cache`): its
    per-layer entries, opaque objects read and written through ``vars``, ``getattr`` and ``setattr`` (an
    encoder-decoder cache's are in its two caches: :func:`_parts`)."""

    layers: list[object]

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


_Cache = TypeVar("_Cache", bound=KVCache)
_Layer = TypeVar("_Layer")


def is_cache(value: object) -> TypeGuard[KVCache]:
    """Whether ``value`` is a cache object (Hugging Face's ``Cache`` and its look-alikes): per-layer state a pass
    updates in place."""
    return hasattr(value, "get_seq_length") and hasattr(value, "update") and not isinstance(value, Tensor)


class PassCaches:
    """The microbatch caches of one step's generation passes on this rank (see [Note: caches per microbatch])."""

    def __init__(self, num_layers: int, window: Callable[[], Optional[range]] = lambda: None) -> None:
        self.num_layers = num_layers  # entries a cache made on first use gets up front
        self.offset = 0  # the block of the pass's cache layer 0 (a decoder's first block: [Note: partial passes])
        self._window = window  # the blocks the stage run in progress runs (None: not known)
        self._before: dict[int, list[object]] = {}  # id(microbatch cache) -> its entries as the pass started
        self._subs: dict[int, dict[tuple[int, int], KVCache]] = {}  # id(user's cache) -> rows -> microbatch's cache
        self._users: dict[int, KVCache] = {}  # id -> the user's cache (kept alive while its microbatch caches are)
        self._patches = Swaps()  # on the users' caches, for the step ([Note: caches per microbatch])
        self._ages: dict[int, int] = {}  # id(user's cache) -> the passes of this step it was given so far

    def for_rows(self, cache: KVCache, start: int, stop: int, probing: Optional[str]) -> KVCache:
        """The cache the rows ``start:stop`` of a pass see in place of ``cache``; a shape probe (``probing``:
        ``"ghost"`` or ``"real"``, how it runs) gets a copy it may change."""
        subs = self.adopt(cache)
        sub = subs.get((start, stop))
        if probing == "real":  # a tensor-parallel stage's probe runs its blocks for real
            return self._throwaway(sub if sub is not None else cache)
        if probing:
            return _ghost_copy(sub if sub is not None else cache)
        if sub is None:
            if _filled(cache):
                raise BackboneCallError(
                    "A generation pass got a key-value cache that already holds tokens the pipeline did not compute"
                    f" ({type(cache).__name__} with {cache.get_seq_length()} positions). Under `PipelineStrategy`"
                    " the pipeline fills the cache: start decoding from an empty cache (as `generate()` does)."
                )
            sub = subs[(start, stop)] = self._throwaway(cache)
            for part in _parts(sub):
                if getattr(part, "layer_class_to_replicate", None) is not None:  # entries made on first use: now
                    while len(part.layers) < self.num_layers:
                        part.layers.append(part.layer_class_to_replicate())
                self._before[id(part)] = [_ghost_layer(layer) for layer in part.layers]
        return _pass_view(sub, self._before, self.window())

    def adopt(self, cache: KVCache) -> dict[tuple[int, int], KVCache]:
        """Take the user's ``cache`` in at its first pass, on every rank (a stage without the pass's blocks included,
        so that what cannot split is refused everywhere alike): checked, patched; returns its microbatch caches."""
        subs = self._subs.get(id(cache))
        if subs is None:
            for part in _parts(cache):
                _check_splittable(part, cache)
            subs = self._subs[id(cache)] = {}
            self._users[id(cache)] = cache
            self._patch(cache)
        return subs

    def window(self) -> Optional[range]:
        """The cache layers the stage run in progress runs."""
        blocks = self._window()
        return None if blocks is None else range(blocks.start - self.offset, blocks.stop - self.offset)

    def _throwaway(self, cache: _Cache) -> _Cache:
        twin = copy.deepcopy(cache)
        for name in self._patches.names_on(cache):
            vars(twin).pop(name, None)
        return twin

    def begin_pass(self, blocks: Optional[range] = None) -> None:
        """What every microbatch cache holds as a pass of ``blocks`` starts (their first one's cache layer is 0): a
        stage's code before its own layers reads it, also after another stage of this rank has run its layers in this
        pass (several stages per rank)."""
        if blocks is not None:
            self.offset, self.num_layers = blocks.start, len(blocks)
        for subs in self._subs.values():
            for sub in subs.values():
                for part in _parts(sub):
                    self._before[id(part)] = [_ghost_layer(layer) for layer in part.layers]

    def mirror(self) -> None:
        """After a pass: the entries of layers this rank does not run become ghosts of those it runs, in every
        microbatch's cache and in the user's (whose entries are all ghosts, of the whole batch)."""
        for key, subs in self._subs.items():
            if not subs:
                continue
            for sub in subs.values():
                for part in _parts(sub):
                    _mirror_layers(part.layers, part.layers, rows=None)
            total = sum(stop - start for start, stop in subs)
            for user, first in zip(_parts(self._users[key]), _parts(subs[min(subs)])):
                while len(user.layers) < len(first.layers):
                    user.layers.append(copy.copy(first.layers[len(user.layers)]))
                _mirror_layers(user.layers, first.layers, rows=total, everything=True)

    def reorder(self, cache: KVCache, beam_idx: Tensor) -> None:
        """Beam search's reordering of ``cache``'s rows, done on the microbatches' caches: rows move between them."""
        subs = self._subs.get(id(cache), {})
        ordered = sorted(subs)
        if not ordered:
            return
        sizes = [stop - start for start, stop in ordered]
        for caches in zip(*(_parts(subs[rows]) for rows in ordered)):  # self- and cross-attention: both
            _reorder_rows(caches, sizes, beam_idx)
        self.mirror()

    def ages(self, caches: list[KVCache]) -> tuple[int, ...]:
        """How many passes of this step each of ``caches`` was given before this one, counting this one: the same on
        every rank (a stage without the call's blocks never sees the cache's contents)."""
        found = tuple(self._ages.get(id(cache), 0) for cache in caches)
        for cache in caches:
            self._ages[id(cache)] = self._ages.get(id(cache), 0) + 1
        return found

    def release(self) -> None:
        """Drop every microbatch cache (the step ended) and undo the patches on the users' caches."""
        self._patches.close()
        self._ages.clear()
        self._subs.clear()
        self._users.clear()
        self._before.clear()

    @property
    def live(self) -> list[KVCache]:
        """The microbatch caches held now (a test checks that a step leaves none)."""
        return [sub for subs in self._subs.values() for sub in subs.values()]

    def _patch(self, cache: KVCache) -> None:
        """The user's cache answers the loop's reorder on the microbatches' caches and refuses what cannot split."""
        self._patches.put(cache, "reorder_cache", lambda beam_idx: self.reorder(cache, beam_idx))
        for name in _REFUSED:
            if callable(getattr(cache, name, None)):
                self._patches.put(cache, name, _refused(type(cache).__name__, name))


class BlockStates:
    """State a decoding loop put into the blocks after setup, sized by the batch (litgpt's ``set_kv_cache``: a
    ``kv_cache`` module with ``k`` and ``v`` buffers ``[batch, groups, length, dim]`` in each block's attention, that
    the attention writes with ``index_copy_`` at ``input_pos``); see [Note: caches per microbatch].

    At each pass (:meth:`begin`): the buffers of this rank's blocks that were not there at setup and have the batch's
    size in dimension 0 are what a microbatch's rows cut (:meth:`rows`: the rows ``start:stop`` of each, a view, so
    the attention writes into the whole; restored by :meth:`end`). The same buffers of the blocks other ranks run
    become ghosts: each stage holds its own layers' state only.

    Args:
        local: the blocks this rank runs; ``others``: the rest.
        known: the buffers the model had at setup.
    """

    def __init__(self, local: list[nn.Module], others: list[nn.Module], known: list[Tensor]) -> None:
        self.local, self.others = local, others
        self.known = {id(b): weakref.ref(b) for b in known}  # by id, checked alive: an id may be reused
        self._cut: list[tuple[dict, str, Tensor]] = []
        #: plain attributes (RecurrentGemma's): [Note: attribute states per microbatch]
        self.attributes = AttributeStates([m for block in local for m in block.modules()])

    def begin(self, batch_size: int) -> None:
        self._cut = [
            (table, name, value)
            for table, name, value in _new_buffers(self.local, self.known)
            if value.dim() > 0 and value.shape[0] == batch_size
        ]
        for table, name, value in _new_buffers(self.others, self.known):
            table[name] = ghost_of(value)  # another stage's layer: its state is that stage's
        self.attributes.begin(batch_size)

    def rows(self, start: int, stop: int, probing: Optional[str] = None) -> None:
        """Before a stage run of the rows ``start:stop`` (``probing``: a shape probe, which runs on ghosts or restores
        what it touched: the buffers stay whole)."""
        if not probing:
            for table, name, value in self._cut:
                table[name] = value[start:stop]
        self.attributes.rows(start, stop, probing)

    def end(self) -> None:
        for table, name, value in self._cut:
            table[name] = value
        self.attributes.end()


def _reorder_rows(caches: tuple[KVCache, ...], sizes: list[int], beam_idx: Tensor) -> None:
    """Reorder the rows of the microbatches' ``caches`` (in row order, ``sizes`` rows each) as one batch."""
    for index in range(len(caches[0].layers)):
        layers = [c.layers[index] for c in caches]
        if not _holds(layers[0]):
            continue
        for name, key, dim in _row_slots(layers[0]):
            parts = [_slot(layer, name, key) for layer in layers]
            if all(_placeholder(part, dim) for part in parts):  # nothing held yet (the layer's own reorder skips)
                continue
            whole = torch.cat(parts, dim=dim)
            whole = whole.index_select(dim, beam_idx.to(whole.device))
            for layer, part in zip(layers, whole.split(sizes, dim=dim)):
                _set_slot(layer, name, key, part)


def _parts(cache: KVCache) -> list[KVCache]:
    """The caches with layers that ``cache`` is: itself, or an encoder-decoder cache's self-attention and
    cross-attention caches (Hugging Face's ``EncoderDecoderCache``; its ``is_updated`` flags stay its own)."""
    if hasattr(cache, "self_attention_cache") and hasattr(cache, "cross_attention_cache"):
        return [cache.self_attention_cache, cache.cross_attention_cache]
    return [cache]


def _new_buffers(blocks: list[nn.Module], known: dict[int, weakref.ref[Tensor]]) -> list[tuple[dict, str, Tensor]]:
    found = []
    for block in blocks:
        for module in block.modules():
            for name, value in module._buffers.items():
                if not isinstance(value, Tensor) or isinstance(value, Ghost):
                    continue
                ref = known.get(id(value))
                if ref is None or ref() is not value:
                    found.append((module._buffers, name, value))
    return found


def _pass_view(cache: _Cache, before: dict[int, list[object]], window: Optional[range]) -> _Cache:
    """A microbatch cache as one stage run sees it during a pass: the layers of its ``window`` as they are (nothing
    else changes them in the pass), and every other layer as the pass started (``before``, by ``id`` of the cache
    that holds them), whose ``update`` goes to the cache's own layer (every layer so, when the window is not known).
    An encoder-decoder cache's view holds views of its two caches and shares its ``is_updated`` flags."""
    parts = _parts(cache)
    if parts[0] is not cache:
        view = copy.copy(cache)
        view.self_attention_cache, view.cross_attention_cache = (_pass_view(p, before, window) for p in parts)
        return view
    before = before[id(cache)]
    view = copy.copy(cache)
    view.layers = []
    for index, (now, then) in enumerate(zip(cache.layers, before)):
        if window is not None and index in window:
            view.layers.append(now)
            continue
        entry = copy.copy(then)
        if hasattr(now, "update"):  # a linear attention layer has none
            entry.update = now.update
        view.layers.append(entry)
    return view


def _refused(kind: str, name: str) -> Callable[..., None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise BackboneCallError(
            f"The decoding loop called `{kind}.{name}()` on a cache that `PipelineStrategy` splits over microbatches"
            " and stages; only `reorder_cache` (beam search) is supported. Use greedy, sampling or beam search"
            " without assisted decoding, or run this evaluation without the pipeline."
        )

    return refuse


def _check_splittable(cache: KVCache, whole: KVCache) -> None:
    """Refuse ``cache`` (``whole``, or one of its parts) unless its layers split by rows."""
    layers = getattr(cache, "layers", None)
    kinds = sorted({type(layer).__name__ for layer in layers or () if not _splittable(layer)})
    if layers is None or kinds or getattr(cache, "offloading", False):
        what = f"layers of kind {', '.join(kinds)}" if kinds else "no per-layer entries the pipeline can split"
        if getattr(cache, "offloading", False):
            what = "offloading"
        kind = type(cache).__name__ if cache is whole else f"{type(whole).__name__} holding a {type(cache).__name__}"
        raise BackboneCallError(
            f"A generation pass got a {kind} with {what}. `PipelineStrategy` splits a key-value cache"
            f" over microbatches and stages when its layers are {' or '.join(_SPLITTABLE)} or kinds of them (a"
            " `DynamicCache`, the default of `generate()`): pass `cache_implementation=\"dynamic\"` to `generate()`,"
            " or leave the cache to it."
        )


def _splittable(layer: object) -> bool:
    bases = {cls.__name__ for cls in type(layer).__mro__}
    return bool(bases & set(_SPLITTABLE)) and not bases & set(_NOT_SPLITTABLE)


def _row_slots(layer: object) -> list[tuple[str, Optional[Hashable], int]]:
    """``(attribute, key or None, batch dimension)`` of each tensor per row a cache layer holds: a tensor attribute
    (keys, values, an indexer's keys) or a tensor in a dict attribute (linear attention's conv and recurrent states,
    DeepSeek V4's compressor buffers). A tensor of no more dimensions than its batch dimension is a counter."""
    slots = []
    for name, value in vars(layer).items():
        dim = _BATCH_DIM.get(name, 0)
        if isinstance(value, Tensor):
            if value.dim() > dim:
                slots.append((name, None, dim))
        elif isinstance(value, dict):
            slots.extend((name, key, dim) for key, v in value.items() if isinstance(v, Tensor) and v.dim() > dim)
    return slots


def _slot(layer: object, name: str, key: Optional[Hashable]) -> Tensor:
    value = getattr(layer, name)
    return value if key is None else value[key]


def _set_slot(layer: object, name: str, key: Optional[Hashable], value: Tensor) -> None:
    if key is None:
        setattr(layer, name, value)
    else:
        getattr(layer, name)[key] = value


def _placeholder(value: Tensor, dim: int) -> bool:
    """An empty tensor that holds no rows yet (Hugging Face's layers start with ``torch.tensor([])``; Unlimited OCR's
    sliding-window keys stay so while the prompt is in its prefill entries)."""
    return value.numel() == 0 and value.dim() <= dim + 1


def _filled(cache: KVCache) -> bool:
    return any(
        isinstance(_slot(layer, name, key), Ghost) or _slot(layer, name, key).numel() > 0
        for part in _parts(cache)
        for layer in part.layers
        for name, key, _ in _row_slots(layer)
    )


def _holds(layer: object) -> bool:
    """Whether a cache layer holds real state (this rank runs it)."""
    for name, key, _ in _row_slots(layer):
        value = _slot(layer, name, key)
        if not isinstance(value, Ghost) and value.numel() > 0:
            return True
    return False


def _ghost_layer(layer: _Layer, rows: Optional[int] = None) -> _Layer:
    """A shallow copy of ``layer`` with dicts of its own (its flags and counters as they are now) whose tensors per
    row are ghosts (of ``rows`` rows when given)."""
    twin = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, dict):
            setattr(twin, name, dict(value))
    for name, key, dim in _row_slots(layer):
        value = _slot(layer, name, key)
        shape = list(value.shape)
        if rows is not None and not _placeholder(value, dim):
            shape[dim] = rows
        _set_slot(twin, name, key, Ghost(torch.empty(shape, dtype=value.dtype, device="meta"), value.device))
    return twin


def _mirror_layers(target: list[object], source: list[object], rows: Optional[int], everything: bool = False) -> None:
    """Each entry of ``target`` that this rank does not run (or every entry, ``everything``) becomes a ghost copy of
    the first entry of ``source`` this rank runs, of the same kind."""
    runs = {}
    for layer in source:
        if _holds(layer):
            runs.setdefault(type(layer), layer)
    for index, layer in enumerate(target):
        if not everything and _holds(layer):
            continue
        own = source[index] if index < len(source) and _holds(source[index]) else None
        model = own if own is not None else runs.get(type(layer))
        if model is not None:
            target[index] = _ghost_layer(model, rows)


def _ghost_copy(cache: _Cache) -> _Cache:
    """A copy of ``cache`` whose layers hold ghosts: what a shape probe may change."""
    twin = copy.copy(cache)
    parts = _parts(cache)
    if parts[0] is not cache:
        twin.self_attention_cache, twin.cross_attention_cache = (_ghost_copy(p) for p in parts)
        twin.is_updated = dict(getattr(cache, "is_updated", {}))
    else:
        twin.layers = [_ghost_layer(layer) for layer in cache.layers]
    for name in ("reorder_cache", *_REFUSED):
        vars(twin).pop(name, None)
    return twin

