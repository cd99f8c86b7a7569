"""Ghost tensors: stand-ins for values a stage does not compute.

Every stage runs the user's own step code, but only the first stage computes what comes before the backbone (the
embeddings): on the other stages those values are *ghosts*. A ghost knows its shape, dtype and (real) device, so
code that reads them (``torch.arange(x.shape[1], device=x.device)``, masks, rotary tables) runs as usual; any
operation on a ghost gives a ghost, computed on the meta device: no memory, no compute. Reading a ghost's values
(``.item()``, ``bool()``, ``.tolist()``) raises :class:`GhostValueError`. A real tensor never changes through an
operation that involves a ghost.

The parameters and buffers a rank does not hold are ghosts too: attribute access (``self.cls_token``) and module
calls (``self.embed_tokens(ids)``) keep working on every stage, without the memory.

``torch.compile`` never traces a ghost: making one and every operation on one are opaque to dynamo (a graph break),
so a compiled module that meets ghosts (a stage's code before its window) runs those operations eagerly and compiles
the rest.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, NoReturn, Optional

import torch
from torch.utils._pytree import tree_any, tree_map

_ITEM_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


#: Called with each operation on ghosts, the ghosts it read and what it returned (``None`` when it reads a value),
#: while set: the setup's analysis of a step watches them.
observer: Optional[Callable[[Callable[..., object], list[Ghost], object], None]] = None


class GhostValueError(RuntimeError):
    """User code read the value of a tensor this stage does not compute."""


class Ghost(torch.Tensor):
    """A tensor of a known shape, dtype and device whose values this process never computes.

    Args:
        meta: a meta tensor with the ghost's shape, strides and dtype.
        device: the device the ghost reports (where the real value would live).
        origin: what the ghost stands for, for error messages (e.g. ``"model.embed_tokens.weight"``).
    """

    _meta: torch.Tensor
    _origin: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    @torch.compiler.disable
    def __new__(cls, meta: torch.Tensor, device: torch.device, origin: str = "") -> Ghost:
        ghost = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=False,
        )
        ghost._meta = meta
        ghost._origin = origin
        return ghost

    def __init__(self, meta: torch.Tensor, device: torch.device, origin: str = "") -> None:
        super().__init__()

    def __repr__(self) -> str:
        origin = f", from {self._origin}" if self._origin else ""
        return f"Ghost(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}{origin})"

    def __deepcopy__(self, memo: dict) -> Ghost:
        return Ghost(copy.deepcopy(self._meta, memo), self.device, self._origin)

    def __reduce_ex__(self, protocol: int) -> NoReturn:
        raise GhostValueError(
            f"{self!r} cannot be saved: this process does not hold its value (it belongs to another pipeline stage)."
        )

    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(
        cls, func: Callable[..., object], types: tuple[type, ...], args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        ghosts = [a for a in _leaves((args, kwargs)) if isinstance(a, Ghost)]
        first = ghosts[0]
        if func in _ITEM_OPS:
            if observer is not None:
                observer(func, ghosts, None)
            raise GhostValueError(
                f"The code read the value of {first!r}, which this pipeline stage does not compute. Only the first"
                " stage computes what comes before the backbone, and values a step reads before the backbone call"
                " (with `.item()`, `bool()`, `if tensor:`) must come from the batch, not from parameters. Compute"
                " such values from the batch, or move them after the backbone call."
            )
        device = first.device
        key = _cache_key(func, args, kwargs)
        if key is not None:  # [Note: ghost results by shape]
            cached = _RESULTS.get(key)
            if cached is not None:
                result = _rebuilt(cached, device, first._origin)
                if observer is not None:
                    observer(func, ghosts, result)
                return result
        if "device" in kwargs and kwargs["device"] is not None:
            device = torch.device(kwargs["device"])
            kwargs = {**kwargs, "device": "meta"}
        if func in _MASKED:
            args = _masks_as_positions(args)
        metas: dict[int, Ghost] = {}

        def to_meta(value: object) -> object:
            if isinstance(value, Ghost):
                metas[id(value._meta)] = value
                return value._meta
            if isinstance(value, torch.Tensor):
                return value.to("meta")  # a copy: the real tensor never changes
            return value

        out = _META_STAND_INS.get(func, func)(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        origin = first._origin

        def to_ghost(value: object) -> object:
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                same = metas.get(id(value))  # an in-place op returns its (ghost) argument
                return same if same is not None else Ghost(value, device, origin)
            return value

        result = tree_map(to_ghost, out)
        if key is not None:
            _remember(key, out, metas)
        if observer is not None:
            observer(func, ghosts, result)
        return result


# [Note: ghost results by shape]
# A ghost's operation runs torch's meta kernel, and many of those are Python (torch._refs and prims: type promotion,
# broadcasting): 150 to 350 µs for an `add` or an `embedding`, on every stage after the first, per microbatch. The
# result depends only on what the meta kernel sees, the operation, its arguments' shapes, strides, dtypes and
# storage offsets, and its other arguments, never on values (a meta tensor has none). So the result's description is
# kept per that key, and an operation met again gets new ghosts of the kept shapes without running the kernel. Only
# operations that cannot depend on anything else are kept: no in-place or `out=` operation (its result is its
# argument), no boolean-mask indexing (its shape comes from the mask's values), no reading of a value, no `device=`,
# and only results whose sizes are plain integers.
_RESULTS: dict[tuple, tuple] = {}
_MAX_RESULTS = 4096
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _cache_key(func: Callable[..., object], args: tuple, kwargs: dict) -> Optional[tuple]:
    if func in _MASKED or func in _META_STAND_INS or "device" in kwargs or not isinstance(func, torch._ops.OpOverload):
        return None
    if func._schema.is_mutable:
        return None
    try:
        described = _described(args), tuple((k, _described(v)) for k, v in sorted(kwargs.items()))
    except _Uncacheable:
        return None
    return func, described


class _Uncacheable(Exception):
    pass


def _described(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.stride(), value.dtype, value.storage_offset(), value.device.type,
                isinstance(value, Ghost))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_described(v) for v in value))
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    raise _Uncacheable


def _remember(key: tuple, out: object, metas: dict[int, Ghost]) -> None:
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(out)
    kept: list[object] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "meta" or id(leaf) in metas or isinstance(leaf, Ghost):
                return  # an argument returned, or a real tensor: not a result of shapes alone
            if not all(type(n) is int for n in (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
                return
            kept.append(("t", tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype))
        elif isinstance(leaf, _PLAIN):
            kept.append(("v", leaf))
        else:
            return
    if len(_RESULTS) >= _MAX_RESULTS:  # shapes that change every batch: keep the newest
        del _RESULTS[next(iter(_RESULTS))]
    _RESULTS[key] = (spec, tuple(kept))


def _rebuilt(cached: tuple, device: torch.device, origin: str) -> object:
    from torch.utils._pytree import tree_unflatten

    spec, kept = cached
    leaves = []
    for item in kept:
        if item[0] == "v":
            leaves.append(item[1])
            continue
        _, shape, stride, offset, dtype = item
        size = 1 + offset + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0) if all(shape) else 0
        meta = torch.empty(size, dtype=dtype, device="meta").as_strided(shape, stride, offset)
        leaves.append(Ghost(meta, device, origin))
    return tree_unflatten(leaves, spec)


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: object, **kwargs: Any) -> torch.Tensor:
    """``aten._grouped_mm`` on the meta device for any dtype: torch's meta kernel checks CUDA's rule (bf16 inputs and
    output only), while the CPU kernel also multiplies fp32 (Hugging Face's MoE experts on CPU). The shape is the same
    for every dtype: the kernel's own shape rule on bf16 stand-ins, in the dtype asked for or the inputs'."""
    out_dtype = kwargs.pop("out_dtype", None) or mat_a.dtype
    out = torch.ops.aten._grouped_mm.default(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs)
    return torch.empty(out.shape, dtype=out_dtype, device="meta")


#: Indexing that takes boolean masks (``logits[mask != 0]``, Hugging Face's audio and speech models' loss), which
#: torch's meta kernels turn into positions with ``nonzero``: that needs the mask's values, which the meta device does
#: not have. See :func:`_masks_as_positions`.
_MASKED = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def _masks_as_positions(args: tuple) -> tuple:
    """``args`` of an indexing operation (the tensor, its list of indices, the rest) whose real boolean masks (from
    the batch) became their positions, as torch's own kernels do first: the ghost it gives has the real shape. A mask
    that is itself a ghost has no values to count: that reads a value (:class:`GhostValueError`)."""
    tensor, indices, *rest = args
    positions: list[Optional[torch.Tensor]] = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            if isinstance(index, Ghost):
                raise GhostValueError(
                    f"The code indexed with a boolean mask, {index!r}, which this pipeline stage does not compute:"
                    " the result's shape depends on the mask's values. Compute masks from the batch, not from"
                    " parameters, or index after the backbone call with the mask of the batch."
                )
            positions.extend(index.nonzero(as_tuple=True))
        else:
            positions.append(index)
    return (tensor, positions, *rest)


#: Meta-device stand-ins for operations whose meta kernel refuses what the real device computes.
_META_STAND_INS: dict[Callable[..., object], Callable[..., torch.Tensor]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm,
}


def _leaves(tree: object) -> list:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def ghost_of(tensor: torch.Tensor, device: Optional[torch.device] = None, origin: str = "") -> Ghost:
    """A ghost with ``tensor``'s shape, strides and dtype, on ``device`` (default: ``tensor``'s own)."""
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return Ghost(meta, device if device is not None else tensor.device, origin)


def contains_ghost(tree: object) -> bool:
    """Whether any tensor in the pytree ``tree`` is a ghost."""
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], dict) and not tree[1] \
            and isinstance(tree[0], tuple) and all(isinstance(a, torch.Tensor) for a in tree[0]):
        return any(isinstance(a, Ghost) for a in tree[0])  # a block's usual call, ``(tensors, {})``: no pytree walk
    return tree_any(lambda leaf: isinstance(leaf, Ghost), tree)
