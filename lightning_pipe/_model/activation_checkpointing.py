"""``activation_checkpointing=``: which blocks recompute their activations in backward."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Union

from torch import nn

#: ``PipelineStrategy(activation_checkpointing=...)``: all blocks, those of the named classes, or a predicate.
Checkpointing = Union[bool, list[str], Callable[[nn.Module], bool]]


def checkpointed_blocks(option: Checkpointing, wrapped: Iterable[nn.Module] = ()) -> Callable[[nn.Module], bool]:
    """Which blocks ``activation_checkpointing=`` selects: all (``True``), those of the named classes, those a
    callable accepts, or none; and the blocks ``configure_model`` wrapped in ``checkpoint_wrapper`` (``wrapped``)."""
    chosen = _chosen(option)
    ids = {id(m) for m in wrapped}
    return (lambda block: id(block) in ids or chosen(block)) if ids else chosen


def _chosen(option: Checkpointing) -> Callable[[nn.Module], bool]:
    if option is True:
        return lambda block: True
    if not option:
        return lambda block: False
    if callable(option):
        return lambda block: bool(option(block))
    names = set(option)
    return lambda block: type(block).__name__ in names
