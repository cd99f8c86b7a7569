"""What the setup learns about a step's block calls (:mod:`lightning_pipe._model.structure` learns it; every run of
the step reads it).

A block's hidden state is its first positional argument (or the keyword argument that carries the previous block's
output) and its output is that tensor, or a tuple/list whose first tensor is (other elements may be ``None``: SD3's
last joint block returns ``(None, hidden_states)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch import Tensor
from torch.utils._pytree import TreeSpec

from lightning_pipe._calls.flow import Producer, Unsendable
from lightning_pipe._calls.inner import InnerCall
from lightning_pipe._errors import BackboneCallError

#: ``("arg", position)`` or ``("kwarg", name)``: where a block call carries the hidden state.
HiddenAt = tuple[str, Union[int, str]]

#: What a block returns: ``None`` for a tensor, else ``(tuple or list, index of the hidden state, metas of the
#: elements)`` (``None`` for the hidden state and for what is not a tensor).
OutputKind = Optional[tuple[type, int, tuple[Optional[Tensor], ...]]]


@dataclass(frozen=True)
class BlockIO:
    """How the analysis saw one block call: the shapes of its tensor arguments, and its output as a tree whose
    tensors are meta tensors (a skipped block answers with ghosts of these shapes, resized to the call's)."""

    arg_shapes: tuple[tuple[int, ...], ...]
    out_spec: TreeSpec
    out_leaves: tuple[Any, ...]
    passed: dict[int, int]  # output leaf -> the argument leaf it is (a block returning what it was given)


@dataclass
class Structure:
    """What the setup learned about one step (see the module docstring and [Note: stage boundaries])."""

    hidden_at: list[HiddenAt]
    outputs: list[OutputKind]
    #: per block: whether its hidden state is what the block before returned (``backbone="auto"`` needs it within a
    #: container)
    chained: list[bool] = field(default_factory=list)
    block_io: list[Optional[BlockIO]] = field(default_factory=list)
    #: per block: the shape of its hidden state in the analysed call
    hidden_shapes: list[Optional[tuple[int, ...]]] = field(default_factory=list)
    #: the blocks whose own outputs a hook on them records for the code after them (Hugging Face's
    #: ``output_hidden_states``): a stage that skips them would record nothing
    recorded: set[int] = field(default_factory=set)
    #: ``{producer: (position, positions that use it)}`` of every value computed from parameters, in production order
    values: dict[Producer, tuple[int, set[int]]] = field(default_factory=dict)
    unsendable: list[Unsendable] = field(default_factory=list)
    region_params: dict[int, set[int]] = field(default_factory=dict)  # parameter id -> regions that read it
    region_modules: dict[int, set[int]] = field(default_factory=dict)  # module id -> regions that call it
    #: per block: the calls inside it of modules with forward hooks, replayed where it is skipped ([Note: values from
    #: inside blocks] in :mod:`lightning_pipe._calls.inner`); empty unless a value leaves a block that way
    inner_calls: dict[int, list[InnerCall]] = field(default_factory=dict)
    #: per producer module outside the blocks: the region of each of its calls, in order (a call that runs only some
    #: containers, an encoder-decoder's decoder, counts its calls from its first region: [Note: partial passes])
    call_regions: dict[str, list[int]] = field(default_factory=dict)

    def calls_before(self, region: int) -> dict[str, int]:
        """``{producer module: its calls in the regions before ``region``}``."""
        return {path: sum(r < region for r in regions) for path, regions in self.call_regions.items()}

    def producer_modules(self, kind: str = "module") -> set[str]:
        """The paths of the modules whose outputs cross a boundary: outside the blocks, or ``"inner"``: inside."""
        return {key for what, key, _, _ in self.values if what == kind}


def get_hidden(args: tuple, kwargs: dict, at: HiddenAt) -> Any:
    """The hidden state of a block call: the argument ``at`` names."""
    where, key = at
    if where == "arg":
        if key >= len(args):
            raise BackboneCallError(f"A backbone block was called with {len(args)} positional arguments; expected the"
                                    f" hidden state at position {key}, as in the first step.")
        return args[key]
    if key not in kwargs:
        raise BackboneCallError(f"A backbone block was called without the keyword argument `{key}` that carried the"
                                " hidden state in the first step.")
    return kwargs[key]


def replace_hidden(args: tuple, kwargs: dict, at: HiddenAt, value: Tensor) -> tuple[tuple, dict]:
    """The arguments of a block call with ``value`` as the hidden state, in the argument ``at`` names."""
    where, key = at
    if where == "arg":
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}
