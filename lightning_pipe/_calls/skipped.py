"""What a block that a run skips returns: the values received for it, ghosts of the right shapes for the rest
(:class:`SkippedBlocks`, a base of :class:`~lightning_pipe._calls.runners.BlockRunners`), and the hooked calls inside
it replayed ([Note: values from inside blocks] in :mod:`lightning_pipe._calls.inner`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_unflatten

from lightning_pipe._calls.flow import Producer
from lightning_pipe._calls.inner import replay
from lightning_pipe._calls.records import BlockIO, Structure
from lightning_pipe._ghost import Ghost, ghost_of


class SkippedBlocks:
    """The outputs of the blocks of ``module`` that a run skips, from what the setup learned (``structure``).

    Args:
        module: the LightningModule.
        structure: what the setup learned about the step's block calls.
        device: this rank's device (where the ghosts live).
    """

    def __init__(self, module: nn.Module, structure: Structure, device: torch.device) -> None:
        self.module = module
        self.structure = structure
        self.device = device
        #: (block, its arguments' shapes) -> the shapes of what it returns when skipped (:meth:`skipped_output`)
        self._skipped_shapes: dict[tuple[int, tuple], list[Optional[tuple[int, ...]]]] = {}
        #: block -> (its BlockIO, the dtype it returns if it returns its one argument's shape): see
        #: :meth:`_returns_its_argument`
        self._returning_argument: dict[int, tuple[BlockIO, Optional[torch.dtype]]] = {}

    def hidden_of(self, index: int, out: Any) -> Any:
        """The hidden state in what block ``index`` returned."""
        kind = self.structure.outputs[index]
        return out if kind is None else out[kind[1]]

    def output_like(self, index: int, hidden: Any) -> Any:
        """What block ``index`` returns, with ``hidden`` as its hidden state and ghosts for the rest."""
        extra = self.structure.outputs[index]
        if extra is None:
            return hidden
        kind, at, metas = extra
        elements = [None if m is None else ghost_of(m, self.device) for m in metas]
        elements[at] = hidden
        return kind(elements)

    def replay_inner(
        self, index: int, args: tuple, kwargs: dict, given: dict[Producer, Tensor],
        found: Callable[[Producer, Tensor], None],
    ) -> None:
        """Replay the hooked module calls inside block ``index``, which this run skips, with the ``given`` values
        ([Note: values from inside blocks])."""
        calls, io = self.structure.inner_calls.get(index), self.structure.block_io[index]
        if calls:
            shapes = [tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            replay(
                self.module, calls, given, io and size_map_of_shapes(io.arg_shapes, shapes), device=self.device,
                found=found,
            )

    def skipped_output(self, index: int, args: tuple, kwargs: dict, hidden: Any, given: dict[Producer, Tensor]) -> Any:
        """What block ``index``, which this run skips, returns: the values ``given`` for its producers (received
        from the stage that ran it), ghosts of the right shapes for the rest."""
        io = self.structure.block_io[index]
        if io is None:
            return self.output_like(index, hidden)
        if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):  # the common call: one tensor, no walk
            if hidden is args[0] and isinstance(hidden, Ghost):
                dtype = self._returns_its_argument(index, io)  # the common block: its output is shaped as its input
                if dtype is not None and hidden.dtype == dtype and ("block", index, 0, 0) not in given:
                    return hidden
            arg_leaves: Sequence[Any] = args
            shapes: tuple = (tuple(args[0].shape),)
        else:
            plain = not kwargs and all(isinstance(a, Tensor) for a in args)
            arg_leaves = args if plain else tree_leaves((args, kwargs))
            shapes = tuple(tuple(t.shape) for t in arg_leaves if isinstance(t, Tensor))
        out_shapes = self._skipped_shapes.get((index, shapes))
        if out_shapes is None:
            out_shapes = self._skipped_shapes[(index, shapes)] = _shapes_when_skipped(io, list(shapes))
            if len(self._skipped_shapes) > 4096:  # shapes that change every batch: keep the newest
                del self._skipped_shapes[next(iter(self._skipped_shapes))]
        leaves = []
        for i, (leaf, shape) in enumerate(zip(io.out_leaves, out_shapes)):
            value = given.get(("block", index, 0, i))
            if value is None and i in io.passed:
                value = arg_leaves[io.passed[i]]
            if value is None and shape is not None:
                if isinstance(hidden, Ghost) and hidden.shape == shape and hidden.dtype == leaf.dtype:
                    value = hidden  # the common case: a block returns its hidden state's shape (no new ghost)
                else:
                    value = Ghost(torch.empty(shape, dtype=leaf.dtype, device="meta"), self.device)
            leaves.append(leaf if value is None else value)
        return leaves[0] if io.out_spec.is_leaf() else tree_unflatten(leaves, io.out_spec)

    def _returns_its_argument(self, index: int, io: BlockIO) -> Optional[torch.dtype]:
        """The dtype of what block ``index`` returns if it takes one tensor and returns one tensor of that tensor's
        shape (and is not that tensor): skipped, it returns its ghost argument as it is, whatever the call's sizes
        (:func:`_shapes_when_skipped` maps the output's sizes as the argument's, or takes the argument's shape).
        ``None`` for any other block."""
        known = self._returning_argument.get(index)
        if known is None or known[0] is not io:  # learned once per block (the analysis fills in block_io as it goes)
            leaf = io.out_leaves[0] if len(io.out_leaves) == 1 else None
            plain = (
                isinstance(leaf, Tensor) and io.out_spec.is_leaf() and not io.passed and len(io.arg_shapes) == 1
                and tuple(leaf.shape) == io.arg_shapes[0]
            )
            known = self._returning_argument[index] = (io, leaf.dtype if plain else None)  # type: ignore[union-attr]
        return known[1]


def _shapes_when_skipped(io: BlockIO, shapes: list[tuple[int, ...]]) -> list[Optional[tuple[int, ...]]]:
    """The shape of each tensor a skipped block returns, for arguments of ``shapes`` (``None`` for the leaves that are
    not tensors): setup's shapes with its sizes mapped to these arguments'."""
    sizes = size_map_of_shapes(io.arg_shapes, shapes)
    # No size map when one old size takes two new ones (a batch of 8 over 8 image patches, as a microbatch of 2): an
    # output shaped like an argument then takes that argument's new shape.
    like_arg = {} if sizes is not None else dict(reversed(list(zip(io.arg_shapes, shapes))))
    return [
        None if not isinstance(leaf, Tensor) else like_arg.get(tuple(leaf.shape), tuple(leaf.shape)) if sizes is None
        else tuple(sizes.get(d, d) for d in leaf.shape)
        for leaf in io.out_leaves
    ]


def size_map_of_shapes(
    old: Sequence[tuple[int, ...]], new: Sequence[tuple[int, ...]]
) -> Optional[dict[int, int]]:
    """``{old size: new size}`` over two lists of shapes, or ``None`` if they differ in count or rank or an old size
    would map to two new ones (a skipped block's output shapes; a schedule key's, ``_step/shapes.py``)."""
    if len(old) != len(new):
        return None
    sizes: dict[int, int] = {}
    for a, b in zip(old, new):
        if len(a) != len(b):
            return None
        for x, y in zip(a, b):
            if sizes.setdefault(x, y) != y:
                return None
    return sizes
