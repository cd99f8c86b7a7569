"""What a step does with the model, learned at setup from one run of it on ghosts.

Before the split, every rank runs the user's step once on one microbatch of the first batch with every parameter a
ghost (:mod:`lightning_pipe._ghost`): no compute, no memory, the same answer on every rank. The run shows

- which parameters the code before the backbone reads, and which modules it calls: they live on the first stage
  (the rest of the model outside the backbone lives on the last);
- how each block is called: where its hidden state is, what it returns, and whether its other arguments depend on
  parameters (then only a first-stage block may have them);
- that the step can be cut: the blocks run once each, in order, each gets what the one before returned, and no block
  output but the last is used elsewhere; a cache of keys and values from earlier calls is refused.

Any of these that fails is an error at setup, on every rank, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_pipe import _ghost
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import Ghost, GhostValueError, contains_ghost, ghost_of
from lightning_pipe._lightning.metrics import metrics_set_aside, module_metrics
from lightning_pipe._model.backbone import Backbone
from lightning_pipe._model.calls import (
    BlockCalls,
    BlockRunners,
    HiddenAt,
    OutputKind,
    Runner,
    Structure,
    call_muted,
    never_called,
    replace_hidden,
)

log = logging.getLogger(__name__)

def analyze(
    module: nn.Module,
    backbone: Backbone,
    step: Callable[..., Any],
    args: tuple,
    device: torch.device,
    training: bool,
) -> Structure:
    """Run ``step(*args)`` once on ghosts, in training or evaluation mode, and learn its :class:`Structure`."""
    params = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    run = _Analysis(module, backbone, device)
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    with everything_ghosted(module, device) as ghosts, metrics_set_aside(module_metrics(module)), torch.no_grad():
        run.ghost_params = {id(g): pid for pid, g in ghosts.items() if pid in params}
        previous = _ghost.observer
        hook = nn.modules.module.register_module_forward_pre_hook(run.module_called)
        _ghost.observer = run.observe
        try:
            with run.program.running(run, ghost_prefix=False):
                try:
                    call_muted(module, step, args, {})
                except (GhostValueError, RuntimeError, TypeError, ValueError, IndexError) as err:
                    if not run.after_backbone or isinstance(err, BackboneCallError):
                        raise
                    # After the backbone the analysis is best effort (e.g. a metric that validates its inputs' values).
                    log.debug("analysis stopped after the backbone: %s", err)
        finally:
            _ghost.observer = previous
            hook.remove()
            for sub, mode in modes:
                sub.training = mode
    if run.next < len(backbone):
        raise never_called(run)
    if run.misuse is not None:
        raise run.misuse
    structure = run.structure
    log.debug(
        "structure: %d blocks, prefix reads %d parameters, block arguments from parameters: %s",
        len(backbone), len(structure.prefix_params), structure.param_extras or "none",
    )
    return structure


class _Analysis(BlockCalls):
    """The analysing run: records everything :class:`Structure` holds."""

    def __init__(self, module: nn.Module, backbone: Backbone, device: torch.device) -> None:
        n = len(backbone)
        structure = Structure(hidden_at=[("arg", 0)] * n, outputs=[None] * n)
        program = BlockRunners(module, backbone, structure, device)
        super().__init__(program)
        self.structure = structure
        self.device = device
        self.ghost_params: dict[int, int] = {}
        self.block_outputs: dict[int, tuple[int, Tensor]] = {}  # id of a block's output -> (block, the output)
        self.in_block = False
        self.started = False
        self.misuse: Optional[BackboneCallError] = None

    # --------------------------------------------------------------------------------------------- observation
    def module_called(self, called: nn.Module, args: Any) -> None:
        if not self.started and not isinstance(called, Runner):
            self.structure.prefix_modules.add(id(called))

    def observe(self, func: Any, ghosts: list[Ghost]) -> None:
        for g in ghosts:
            pid = self.ghost_params.get(id(g))
            if pid is not None and not self.in_block:
                (self.structure.post_params if self.after_backbone else self.structure.prefix_params).add(pid)
            known = self.block_outputs.get(id(g))
            if known is not None and known[1] is g and not self.in_block and self.misuse is None:
                # Reported after the step, unless a more precise error (a block skipped, code between blocks) comes.
                self.misuse = BackboneCallError(
                    f"The output of block `{self.program.backbone.blocks[known[0]].name}` is used by code other than"
                    " the next block (for example kept for later, or combined with another block's output). A"
                    " pipeline stage passes on only its last block's hidden state; use only the last block's output"
                    " after the backbone."
                )

    # --------------------------------------------------------------------------------------------- block calls
    def locate_hidden(self, index: int, args: tuple, kwargs: dict) -> HiddenAt:
        """Learn (and record) where this call carries the hidden state, checking it against the block before."""
        if index == 0:
            self.started = True
            _refuse_filled_cache(args, kwargs)
            if args:
                at: HiddenAt = ("arg", 0)
            else:
                key = next((k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
                if key is None:
                    raise BackboneCallError(
                        f"The first backbone block `{self.program.backbone.blocks[0].name}` was called without a"
                        " tensor argument; its first positional argument (or first tensor keyword argument) must be"
                        " the hidden state."
                    )
                at = ("kwarg", key)
        else:
            found = [("arg", i) for i, a in enumerate(args) if a is self.chain]
            found += [("kwarg", k) for k, v in kwargs.items() if v is self.chain]
            at = found[0] if found else ("arg", 0)  # no match: the chain check reports it
        self.structure.hidden_at[index] = at
        return at

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        backbone = self.program.backbone
        if not isinstance(hidden, Tensor):
            raise BackboneCallError(
                f"Block `{backbone.blocks[index].name}` gets a {type(hidden).__name__} as its hidden state; a pipeline"
                " sends one tensor between stages. Pass the hidden state as a tensor (the block's first argument)."
            )
        others = _others(args, kwargs, at)
        ghostly = [name for name, value in others if contains_ghost(value)]
        if ghostly and index > 0:
            self.structure.param_extras[index] = ghostly
        if not isinstance(hidden, Ghost):  # no real data reaches a block: it computes nothing here
            args, kwargs = replace_hidden(args, kwargs, at, ghost_of(hidden, self.device))
        self.in_block = True
        try:
            out = block(*args, **kwargs)
        except (GhostValueError, RuntimeError, NotImplementedError, TypeError) as err:
            # The block cannot run on ghosts (e.g. data-dependent routing): assume it returns its hidden state's
            # kind and shape, and check what it really returns when it first runs.
            log.debug("block %d does not run on ghosts (%s); assuming it returns a tensor", index, err)
            out = hidden
        finally:
            self.in_block = False
        self.structure.outputs[index] = _output_kind(backbone.blocks[index].name, out)
        hidden_out = out if self.structure.outputs[index] is None else out[0]
        if index < len(backbone) - 1:
            self.block_outputs[id(hidden_out)] = (index, hidden_out)  # kept alive, so its id is not reused
        return out

    def on_backbone_end(self) -> None:
        self.block_outputs.pop(id(self.chain), None)  # the last block's output is the stage output: free to use


def _others(args: tuple, kwargs: dict, at: HiddenAt) -> list[tuple[str, Any]]:
    named = [(f"positional argument {i}", a) for i, a in enumerate(args) if ("arg", i) != at]
    return named + [(f"`{k}`", v) for k, v in kwargs.items() if ("kwarg", k) != at]


def _output_kind(name: str, out: Any) -> OutputKind:
    if isinstance(out, Tensor):
        return None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        rest = tuple(
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") if isinstance(v, Tensor) else None
            for v in out[1:]
        )
        return (type(out) if type(out) in (tuple, list) else tuple, rest)
    raise BackboneCallError(
        f"Block `{name}` returns a {type(out).__name__}; a pipelined block must return its hidden state as a tensor,"
        " or a tuple or list whose first element is the hidden state."
    )


def _refuse_filled_cache(args: tuple, kwargs: dict) -> None:
    """A cache of keys and values from earlier calls (generation) cannot be split over stages; a fresh one (what
    Hugging Face models create in training by default) is harmless."""
    for value in tree_leaves((args, kwargs)):
        length = getattr(value, "get_seq_length", None)
        if callable(length) and not isinstance(value, Tensor):
            try:
                filled = int(length()) > 0
            except Exception:
                continue
            if filled:
                raise BackboneCallError(
                    f"The backbone blocks get a {type(value).__name__} that already holds keys and values from earlier"
                    " calls (a KV cache, as in generation). A pipeline cannot split a cache that lives across calls"
                    " over stages. Train and evaluate without `past_key_values` (e.g. `use_cache=False`), and generate"
                    " with the consolidated model outside the pipeline."
                )


@contextmanager
def everything_ghosted(
    module: nn.Module, device: torch.device, dtypes: Optional[dict[int, torch.dtype]] = None
) -> Iterator[dict[int, Ghost]]:
    """Every parameter of ``module``, and every buffer of a module with parameters, a ghost for the block (one ghost
    per tensor, shared by the names it has). Yields ``{id(real tensor): ghost}``. ``dtypes``: the dtype a tensor
    computes in when it is not its own (``{id: dtype}``: a sharded parameter all-gathered in bf16)."""
    ghosts: dict[int, Ghost] = {}
    swaps: list[tuple[dict, str, Tensor]] = []
    try:
        for path, sub in module.named_modules(remove_duplicate=False):
            owned = sub._parameters
            tables = [owned] + ([sub._buffers] if any(v is not None for v in owned.values()) else [])
            for table in tables:
                for name, value in list(table.items()):
                    if value is None or isinstance(value, Ghost):
                        continue
                    ghost = ghosts.get(id(value))
                    if ghost is None:
                        origin = f"{path}.{name}".lstrip(".")
                        dtype = (dtypes or {}).get(id(value))
                        source = value if dtype is None else torch.empty(value.shape, dtype=dtype, device="meta")
                        ghost = ghosts[id(value)] = ghost_of(source, device, origin)
                    swaps.append((table, name, value))
                    table[name] = ghost
        yield ghosts
    finally:
        for table, name, value in reversed(swaps):
            table[name] = value
