"""A generation pass's arguments, split into microbatches by rows ([Note: lock step] in
:mod:`lightning_pipe._step.generation`), and the checks that refuse what cannot be split."""

from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_pipe._calls.batch import slice_batch
from lightning_pipe._calls.flow import Flow
from lightning_pipe._compat.transformers import encoded_media_rows
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import contains_ghost
from lightning_pipe._step.caches import BlockStates, PassCaches, is_cache

#: Keyword arguments of a pass that are never split by rows, even when their length equals the batch size (a prompt
#: of as many tokens as there are prompts): Hugging Face's and litgpt's positions of the new tokens.
NOT_BATCHED = frozenset({"cache_position", "input_pos", "input_pos_maxp1"})
#: Keyword arguments of a pass whose rows are not their first dimension, by name: (their number of dimensions, the
#: rows' dimension). Multimodal rotary positions (Qwen2-VL, Qwen3-VL, Qwen3.5 and their kin) are ``position_ids`` of
#: ``[3 or 4, batch, length]``, which ``generate()`` passes to every call; a microbatch given all the batch's rows of
#: them would meet its own rows' queries with the whole batch's angles.
ROWS_DIM = {"position_ids": (3, 1)}
#: The keyword argument of a prefill pass with the images' features ``generate()`` encoded before its first call, one
#: per placeholder token: a microbatch gets those of its own rows' placeholders.
ENCODED_MEDIA = "mm_encoder_outputs"


class PassInputs:
    """A pass's arguments; :meth:`lp_rows` gives a microbatch's (``StepProgram.sub_batch`` calls it)."""

    def __init__(
        self, module: nn.Module, args: tuple, kwargs: dict, batch_size: int, caches: PassCaches, states: BlockStates
    ) -> None:
        self.args, self.kwargs, self.batch_size, self.caches, self.states = args, kwargs, batch_size, caches, states
        self.names = positional_names(module, len(args))
        self.config = getattr(module, "config", None)

    def lp_rows(self, start: int, stop: int, probing: Optional[str]) -> tuple[tuple, dict]:
        def cut(value: Any, name: Optional[str] = None) -> Any:
            if is_cache(value):
                return self.caches.for_rows(value, start, stop, probing)
            if name == ENCODED_MEDIA and isinstance(value, dict) and isinstance(ids, Tensor) and ids.dim() == 2:
                rows = encoded_media_rows(value, ids, self.config, start, stop)
                return value if rows is None else rows
            if name in NOT_BATCHED:
                return value
            if rows_not_first(name, value, self.batch_size):
                return value.narrow(ROWS_DIM[name][1], start, stop - start)
            return slice_batch(value, self.batch_size, start, stop)

        ids = self.kwargs.get("input_ids", next((a for a, n in zip(self.args, self.names) if n == "input_ids"), None))
        self.states.rows(start, stop, probing)
        args = tuple(cut(a, name) for a, name in zip(self.args, self.names))
        return args, {k: cut(v, k) for k, v in self.kwargs.items()}


def rows_not_first(name: Optional[str], value: Any, batch_size: int) -> bool:
    """Whether ``value``, passed as ``name``, holds the batch's rows in a dimension other than its first."""
    if name not in ROWS_DIM or not isinstance(value, Tensor):
        return False
    dims, dim = ROWS_DIM[name]
    return value.dim() == dims and value.shape[dim] == batch_size


def pass_kind(flow: Optional[Flow], inputs: PassInputs) -> Optional[tuple]:
    """What the stage shapes of a partial pass depend on besides its inputs' shapes ([Note: partial passes]): its
    blocks, and, when its stages carry more than the hidden state, how many passes its caches have seen (T5's decoder
    carries its position bias, as wide as the cache plus the new tokens, in every decoding step's same-shaped call;
    the cache's length is not known on the stages without the decoder's blocks)."""
    ages = inputs.caches.ages([v for v in (*inputs.args, *inputs.kwargs.values()) if is_cache(v)])
    if flow is None:
        return None
    assert flow.blocks is not None
    kind: tuple = (flow.blocks.start, flow.blocks.stop)
    return kind + ages if flow.carries_more_than_hidden() else kind


def positional_names(module: nn.Module, count: int) -> list[Optional[str]]:
    """The parameter names of ``module``'s forward that its first ``count`` positional arguments bind to (litgpt
    passes ``input_pos`` positionally)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [None] * count
    names: list[Optional[str]] = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return (names + [None] * count)[:count]


def call_with(module: nn.Module, inputs: tuple[tuple, dict]) -> Any:
    args, kwargs = inputs
    return module(*args, **kwargs)


def check_caches(args: tuple, kwargs: dict) -> None:
    """A cache inside a container would reach every microbatch whole: refused."""
    for value in (*args, *kwargs.values()):
        if is_cache(value):
            continue
        for leaf in tree_leaves(value):
            if is_cache(leaf):
                raise BackboneCallError(
                    f"A generation pass got a key-value cache ({type(leaf).__name__}) inside a container."
                    " `PipelineStrategy` splits a cache passed as an argument of the model call itself (as"
                    " `generate()` passes `past_key_values`): pass it as its own argument."
                )


def check_no_ghosts(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A pass given back a value an earlier pass returned that no rank holds whole (each stage computed its own
    layers' part: XLNet's ``mems``, a per-layer memory ``generate()`` passes back as a cache) would run on it: refused,
    on every rank alike (each got the same answer), before anything is sent."""
    names = positional_names(module, len(args))
    for name, value in [*zip(names, args), *kwargs.items()]:
        if is_cache(value) or not contains_ghost(value):
            continue
        raise BackboneCallError(
            f"A generation pass got `{name or 'a positional argument'}` back from an earlier pass, which the pipeline"
            " stages compute in parts (each stage its own layers'), so no rank holds it whole. Under `PipelineStrategy`"
            " a decoding loop may carry the model's tokens, logits and a `Cache` object (`DynamicCache`, which each"
            " stage fills for its own layers) from one call to the next. Generate without this value (XLNet:"
            " `use_mems=False`), or without `PipelineStrategy`."
        )
