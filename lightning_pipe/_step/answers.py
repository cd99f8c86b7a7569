"""The answer of a generation pass: what the last stage's forward returned, described as a header (its tree, and per
leaf a tensor's shape and dtype, an input's position or a plain value) and its tensors, sent to every rank of the
pipeline and rebuilt there ([Note: lock step] in :mod:`lightning_pipe._step.generation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, Union

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import Ghost
from lightning_pipe._step.caches import is_cache

PRIMITIVE = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Failed:
    message: str


def describe_answer(
    answer: Any, input_leaves: list[Any]
) -> tuple[tuple[Union[TreeSpec, Failed], list[tuple]], list[Tensor]]:
    """The header of the last stage's answer (its tree, and per leaf: a tensor's shape and dtype, an input's
    position, or a plain value) and its tensors."""
    if isinstance(answer, Failed):
        return (answer, []), []
    leaves, spec = tree_flatten(answer)
    kinds: list[tuple] = []
    tensors: list[Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, Ghost):  # a part of the output the last stage does not compute (an encoder's output):
            kinds.append(("ghost", tuple(leaf.shape), leaf.dtype))  # a ghost on every rank, that raises when read
            continue
        if isinstance(leaf, Tensor):
            tensors.append(leaf.detach().contiguous())
            kinds.append(("tensor", tuple(leaf.shape), leaf.dtype))
            continue
        position = next((i for i, x in enumerate(input_leaves) if x is leaf), None)
        if position is not None:
            kinds.append(("input", position))
        elif isinstance(leaf, PRIMITIVE):
            kinds.append(("value", leaf))
        elif is_cache(leaf):  # made inside the call (a forward without a cache given): only its last stage's part
            kinds.append(("unavailable", type(leaf).__name__))
        else:
            return (Failed(
                f"the model call returns a {type(leaf).__name__} it created; under `PipelineStrategy` a decoding step"
                " may return tensors, plain values and the objects it was given. Create the cache before the loop"
                " and pass it in (`past_key_values=DynamicCache(...)`), as `generate()` does"
            ), []), []
    return (spec, kinds), tensors


def rebuild_answer(spec: Union[TreeSpec, Failed], kinds: list[tuple], tensors: list[Tensor], input_leaves: list[Any],
             device: torch.device) -> Any:
    if isinstance(spec, Failed):
        raise BackboneCallError(f"The last pipeline stage failed in a generation pass: {spec.message}")
    leaves, taken = [], iter(tensors)
    for kind in kinds:
        if kind[0] == "tensor":
            leaves.append(next(taken))
        elif kind[0] == "input":
            leaves.append(input_leaves[kind[1]])
        elif kind[0] == "ghost":
            leaves.append(Ghost(torch.empty(kind[1], dtype=kind[2], device="meta"), device, "the last stage"))
        elif kind[0] == "unavailable":
            leaves.append(Unavailable(kind[1]))
        else:
            leaves.append(kind[1])
    return tree_unflatten(leaves, spec)


class Unavailable:
    """A cache a pipelined call made itself and returned: each stage filled its own part of a copy of its own, so
    there is no whole one to return. Any use of it raises."""

    def __init__(self, kind: str) -> None:
        self._kind = kind

    def __getattr__(self, name: str) -> NoReturn:
        raise BackboneCallError(
            f"This {self._kind} was created inside a call of the pipelined model, which returns it; under"
            " `PipelineStrategy` each stage holds its own layers' part of it, so it cannot be used after the call."
            " To decode with a cache, create it before the loop and pass it in (`past_key_values=DynamicCache(...)`,"
            " as `generate()` does)."
        )

    def __repr__(self) -> str:
        return f"<{self._kind} held by the pipeline stages>"
