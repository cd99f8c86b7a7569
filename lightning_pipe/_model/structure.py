"""What a step does with the model, learned at setup from one run of it on ghosts.

Before the split, every rank runs the user's step once on one microbatch of the first batch with every parameter a
ghost (:mod:`lightning_pipe._ghost`): no compute, no memory, the same answer on every rank. The run shows

- which parameters each region of code outside the blocks reads, and which modules it calls: they live on the stage
  that runs that region (before the backbone: the first; between two blocks: the next block's; after the backbone:
  the last);
- how each block is called: where its hidden state is (and whether it is what the block before returned), and what
  it returns;
- every value computed from parameters, from the block or module output that produces it to every use: what each
  stage boundary carries ([Note: stage boundaries] in :mod:`lightning_pipe._calls.flow`), outputs of modules inside a
  block that its forward hooks hand out included ([Note: values from inside blocks] in
  :mod:`lightning_pipe._calls.inner`);
- that the step can be cut: the blocks run once each, in order; a cache of keys and values from earlier calls is
  refused.

Any of these that fails is an error at setup, on every rank, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lightning_pipe import _ghost
from lightning_pipe._calls.batch import call_muted
from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.flow import Producer, Unsendable, block_position, region_position
from lightning_pipe._calls.inner import record_call
from lightning_pipe._calls.records import BlockIO, HiddenAt, OutputKind, Structure, replace_hidden
from lightning_pipe._calls.runners import BlockCalls, BlockRunners, Runner, never_called
from lightning_pipe._calls.stops import SecondPass
from lightning_pipe._compat.transformers import install_output_capturing, newly_recorded, recording_lengths
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import Ghost, GhostValueError, ghost_of
from lightning_pipe._lightning.metrics import metrics_set_aside, module_metrics
from lightning_pipe._model.untouched import no_ghosts_left

log = logging.getLogger(__name__)

def analyze(
    module: nn.Module,
    backbone: Backbone,
    step: Callable[..., object],
    args: tuple,
    device: torch.device,
    training: bool,
) -> Structure:
    """Run ``step(*args)`` once on ghosts, in training or evaluation mode, and learn its :class:`Structure`."""
    # before the blocks are swapped out ([Note: values from inside blocks])
    uninstall = install_output_capturing(module)
    params = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    run = _Analysis(module, backbone, device)
    run.param_names = {id(p): name for name, p in module.named_parameters()}
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    with everything_ghosted(module, device) as ghosts, metrics_set_aside(module_metrics(module)), torch.no_grad():
        run.ghost_params = {id(g): pid for pid, g in ghosts.items() if pid in params}
        previous = _ghost.observer
        pre = nn.modules.module.register_module_forward_pre_hook(run.module_called)
        post = nn.modules.module.register_module_forward_hook(run.module_returned)
        _ghost.observer = run.observe
        try:
            with run.program.running(run):
                try:
                    call_muted(module, step, args, {})
                except (GhostValueError, RuntimeError, TypeError, ValueError, IndexError) as err:
                    generates = isinstance(err, SecondPass) and not training  # its first pass is what is learned
                    if not run.after_backbone or (isinstance(err, BackboneCallError) and not generates):
                        raise
                    # After the backbone the analysis is best effort (e.g. a metric that validates its inputs' values).
                    log.debug("analysis stopped after the backbone: %s", err)
        finally:
            _ghost.observer = previous
            pre.remove()
            post.remove()
            for sub, mode in modes:
                sub.training = mode
    if run.next < len(backbone):
        raise never_called(run)
    structure = run.resolve()
    if not structure.inner_calls:
        uninstall()
    log.debug(
        "structure: %d blocks, parameters read outside them by region: %d, values computed from parameters: %s",
        len(backbone), len(structure.region_params), list(structure.values),
    )
    return structure


class _Analysis(BlockCalls):
    """The analysing run: records everything :class:`Structure` holds.

    Every parameter is a ghost, so every value computed from parameters is one: the run follows ghosts from where
    they are produced (a block's or a module's output, or tensor code) to where they are used (block calls and
    operations outside the blocks), by position ([Note: stage boundaries])."""

    def __init__(self, module: nn.Module, backbone: Backbone, device: torch.device) -> None:
        n = len(backbone)
        structure = Structure(
            hidden_at=[("arg", 0)] * n, outputs=[None] * n, chained=[True] * n, block_io=[None] * n,
            hidden_shapes=[None] * n,
        )
        program = BlockRunners(module, backbone, structure, device)
        super().__init__(program)
        self.structure = structure
        self.device = device
        self.ghost_params: dict[int, int] = {}
        self.param_names: dict[int, str] = {}
        self.module_names = {id(m): name for name, m in module.named_modules() if name}
        self.chain: object = None  # the hidden state the last block call produced (compared by identity)
        self.kept: dict[int, Tensor] = {}  # every ghost (and block output) seen, so that its id is not reused
        self.producers: dict[int, tuple[Producer, int]] = {}  # id(ghost) -> (producer, position)
        self.derived: dict[int, tuple[int, list[int], list[int], str]] = {}  # id -> (position, inputs, params, op)
        self.uses: dict[int, set[int]] = {}  # id(ghost) -> positions that use it
        self.ran: set[int] = set()  # the blocks that ran on ghosts

    def _keep(self, ghost: Tensor) -> int:
        self.kept[id(ghost)] = ghost
        return id(ghost)

    def _here(self) -> int:
        return region_position(self.next)

    # --------------------------------------------------------------------------------------------- observation
    def module_called(self, called: nn.Module, args: tuple) -> None:
        if not self.in_block and not isinstance(called, Runner):
            self.structure.region_modules.setdefault(id(called), set()).add(self.next)

    def module_returned(self, called: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(called, Runner):
            return
        path = self.module_names.get(id(called))
        if self.in_block:
            if path is not None:
                self._inner_returned(called, path, args, output)
        elif path is not None:
            self.module_output(path, output)  # counted as the stages' hooks count it

    def _inner_returned(self, called: nn.Module, path: str, args: tuple, output: Any) -> None:
        """A module inside the block that runs returned: its new tensors may leave the block through a forward hook
        ([Note: values from inside blocks]); a hooked module's call is what a skipped block replays."""
        index = self.next - 1
        if not path.startswith(self.program.backbone.blocks[index].name + "."):
            return
        call = self.inner_calls.get(path, 0)
        self.inner_calls[path] = call + 1
        record = record_call(index, path, call, called, args, output=output)
        if record is not None:
            self.structure.inner_calls.setdefault(index, []).append(record)
        for i, leaf in enumerate(tree_leaves(output)):
            if not isinstance(leaf, Ghost) or id(leaf) in self.ghost_params:
                continue
            known = self.producers.get(id(leaf))
            # a value is its innermost module's, unless an enclosing module's hooks hand it out
            if known is None or (record is not None and known[0][0] == "inner"):
                self.producers.pop(id(leaf), None)
                self.producers[self._keep(leaf)] = (("inner", path, call, i), block_position(index))

    def on_module_output(self, path: str, call: int, output: Any) -> None:
        self.structure.call_regions.setdefault(path, []).append(self.next)
        for i, leaf in enumerate(tree_leaves(output)):
            if isinstance(leaf, Ghost) and id(leaf) not in self.producers and id(leaf) not in self.ghost_params:
                self.producers[self._keep(leaf)] = (("module", path, call, i), self._here())

    def observe(self, func: object, ghosts: list[Ghost], result: Any) -> None:
        if self.in_block:
            return
        here = self._here()
        inputs, reads = [], []
        for g in ghosts:
            pid = self.ghost_params.get(id(g))
            if pid is not None:
                self.structure.region_params.setdefault(pid, set()).add(self.next)
                reads.append(pid)
            else:
                self.uses.setdefault(self._keep(g), set()).add(here)
                inputs.append(id(g))
        if result is None:
            return
        for out in tree_leaves(result):
            if isinstance(out, Ghost) and id(out) not in self.kept and id(out) not in self.ghost_params:
                self.derived[self._keep(out)] = (here, inputs, reads, str(func))

    # --------------------------------------------------------------------------------------------- block calls
    def locate_hidden(self, index: int, args: tuple, kwargs: dict) -> HiddenAt:
        """Learn (and record) where this call carries the hidden state: what the block before returned, else the
        first positional (or tensor keyword) argument."""
        if index == 0:
            _refuse_filled_cache(args, kwargs)
        found = [("arg", i) for i, a in enumerate(args) if index > 0 and a is self.chain]
        found += [("kwarg", k) for k, v in kwargs.items() if index > 0 and v is self.chain]
        if index > 0:
            self.structure.chained[index] = bool(found)
        if not found and args:
            found = [("arg", 0)]
        if not found:
            key = next((k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
            if key is None:
                raise BackboneCallError(
                    f"The backbone block `{self.program.backbone.blocks[index].name}` was called without a tensor"
                    " argument; its first positional argument (or first tensor keyword argument) must be the hidden"
                    " state."
                )
            found = [("kwarg", key)]
        self.structure.hidden_at[index] = found[0]
        return found[0]

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        backbone = self.program.backbone
        if not isinstance(hidden, Tensor):
            raise BackboneCallError(
                f"Block `{backbone.blocks[index].name}` gets a {type(hidden).__name__} as its hidden state; a pipeline"
                " sends tensors between stages. Pass the hidden state as a tensor (the block's first argument)."
            )
        self.structure.hidden_shapes[index] = tuple(hidden.shape)
        position = block_position(index)
        for leaf in tree_leaves((args, kwargs)):
            ghostly = isinstance(leaf, Ghost) and id(leaf) not in self.ghost_params
            if ghostly or (isinstance(leaf, Tensor) and id(leaf) in self.producers):  # a block's real output too
                self.uses.setdefault(self._keep(leaf), set()).add(position)
        if not isinstance(hidden, Ghost):  # no real data reaches a block: it computes nothing here
            args, kwargs = replace_hidden(args, kwargs, at, ghost_of(hidden, self.device))
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))
        self.in_block = True
        recording = recording_lengths()  # Hugging Face's hidden states: recorded by hooks on the blocks themselves
        try:
            out = block(*args, **kwargs)
            returned = (out, *(out if isinstance(out, (tuple, list)) else ()))
            if any(newly_recorded(recording, value) for value in returned):
                self.structure.recorded.add(index)
        except (GhostValueError, RuntimeError, NotImplementedError, TypeError) as err:
            # The block cannot run on ghosts (e.g. data-dependent routing): assume it returns what an earlier block
            # of its class returned, or its hidden state's kind and shape, and check what it really returns when it
            # first runs.
            log.debug("block %d does not run on ghosts (%s); assuming its output", index, err)
            out = self._assumed_output(index, args, kwargs, hidden)
        else:
            self.ran.add(index)
        finally:
            self.in_block = False
        self.structure.outputs[index] = _output_kind(backbone.blocks[index].name, out)
        leaves, spec = tree_flatten(out)
        given = {id(leaf): k for k, leaf in enumerate(tree_leaves((args, kwargs))) if isinstance(leaf, Tensor)}
        passed = {i: given[id(leaf)] for i, leaf in enumerate(leaves) if id(leaf) in given}
        for i, leaf in enumerate(leaves):
            # What the block computes (a real tensor too, e.g. T5's cross-attention bias from the mask: a skipped
            # block cannot give it), unless it returns what it was given.
            if isinstance(leaf, Tensor) and i not in passed and id(leaf) not in self.ghost_params and (
                id(leaf) not in self.producers or id(leaf) in self.derived
                or self.producers[id(leaf)][0][0] == "inner"  # a module's inside the block: the block's output
            ):
                self.producers.pop(id(leaf), None)
                self.producers[self._keep(leaf)] = (("block", index, 0, i), position)
        self.structure.block_io[index] = BlockIO(
            shapes, spec, tuple(_meta(leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves), passed
        )
        self.chain = self.program.hidden_of(index, out)
        return out

    def _assumed_output(self, index: int, args: tuple, kwargs: dict, hidden: Tensor) -> Any:
        """What block ``index``, which cannot run on ghosts, is taken to return: what the nearest earlier block of its
        class that ran returned, with this call's hidden state's shape and this call's arguments where that block
        passed its own through (Switch Transformers' sparse blocks, whose expert routing reads values, return
        ``(hidden, position bias, cross-attention bias)`` as the dense blocks between them do); with none, a tensor
        of the hidden state's shape."""
        backbone = self.program.backbone
        kind = type(backbone.module(index))
        same = [j for j in range(index) if j in self.ran and type(backbone.module(j)) is kind]
        earlier = same[-1] if same else None
        if earlier is None or self.structure.outputs[earlier] is None:
            return ghost_of(hidden, self.device)
        io = self.structure.block_io[earlier]
        at = self.structure.outputs[earlier][1]
        given = tree_leaves((args, kwargs))
        leaves = []
        for i, leaf in enumerate(io.out_leaves):
            if i == at:
                leaves.append(ghost_of(hidden, self.device))
            elif i in io.passed and io.passed[i] < len(given):
                leaves.append(given[io.passed[i]])
            elif isinstance(leaf, Tensor):
                leaves.append(Ghost(torch.empty(leaf.shape, dtype=leaf.dtype, device="meta"), self.device))
            else:
                leaves.append(leaf)
        return tree_unflatten(leaves, io.out_spec)

    # --------------------------------------------------------------------------------------------- the result
    def resolve(self) -> Structure:
        """Name every use of a value computed from parameters by the producers it comes from."""
        roots: dict[int, tuple[frozenset[int], frozenset[int]]] = {}

        def producers_of(gid: int) -> tuple[frozenset[int], frozenset[int]]:
            if gid in self.producers:
                return frozenset({gid}), frozenset()
            if gid in roots:
                return roots[gid]
            roots[gid] = (frozenset(), frozenset())  # a cycle cannot happen; this guards the recursion anyway
            entry = self.derived.get(gid)
            if entry is None:  # not from parameters (a batch tensor's stand-in): real on every stage
                return roots[gid]
            found, params = set(), set(entry[2])
            for source in entry[1]:
                more, read = producers_of(source)
                found |= more
                params |= read
            roots[gid] = (frozenset(found), frozenset(params))
            return roots[gid]

        uses: dict[int, set[int]] = {}
        for gid, positions in self.uses.items():
            found, params = producers_of(gid)
            for root in found:
                uses.setdefault(root, set()).update(positions)
            if params and gid not in self.producers:
                position = self.derived[gid][0]
                later = frozenset(u for u in positions if u > position)
                if later:
                    names = tuple(sorted(self.param_names.get(p, "?") for p in params))
                    what = f"The result of `{self.derived[gid][3]}`"
                    self.structure.unsendable.append(Unsendable(what, names, position, later))
        for gid, (producer, position) in self.producers.items():
            later = {u for u in uses.get(gid, ()) if u > position}
            if later:
                self.structure.values[producer] = (position, later)
        self._check_inner()
        producers = self.structure.producer_modules()
        self.structure.call_regions = {p: r for p, r in self.structure.call_regions.items() if p in producers}
        return self.structure

    def _check_inner(self) -> None:
        """Keep the hooked calls to replay only if a value leaves a block through them; refuse one that leaves a
        block otherwise ([Note: values from inside blocks])."""
        inner = [p for p in self.structure.values if p[0] == "inner"]
        hooked = {(c.path, c.call) for calls in self.structure.inner_calls.values() for c in calls}
        for producer in inner:
            _, path, call, _ = producer
            if (path, call) not in hooked:
                block = self.program.backbone.blocks[(self.structure.values[producer][0] - 1) // 2]
                raise BackboneCallError(
                    f"The output of `{path}`, a module inside block `{block.name}`, is used after that block, but"
                    " the block neither returns it nor hands it out through a forward hook on that module (it is"
                    " kept elsewhere, e.g. on a module). Blocks of another stage cannot put it back where it is read."
                    " Return it from the block (a tuple), or record it with a forward hook on the module."
                )
        if not inner:
            self.structure.inner_calls.clear()


def _meta(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _output_kind(name: str, out: Any) -> OutputKind:
    """How a block's output holds its hidden state: the tensor itself, or the first tensor of a tuple or list (the
    other elements may be anything, ``None`` included: SD3's last joint block returns ``(None, hidden_states)``)."""
    if isinstance(out, Tensor):
        return None
    at = next((i for i, v in enumerate(out) if isinstance(v, Tensor)), None) if isinstance(out, (tuple, list)) else None
    if at is not None:
        metas = tuple(_meta(v) if isinstance(v, Tensor) and i != at else None for i, v in enumerate(out))
        return (type(out) if type(out) in (tuple, list) else tuple, at, metas)
    raise BackboneCallError(
        f"Block `{name}` returns a {type(out).__name__}{' without a tensor' if isinstance(out, (tuple, list)) else ''};"
        " a pipeline sends tensors between stages: a pipelined block must return its hidden state as a tensor, or a"
        " tuple or list of tensors (and `None`s) whose first tensor is the hidden state."
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
                    " calls while the step is analysed. A training step cannot carry a cache across calls over stages:"
                    " train without `past_key_values` (e.g. `use_cache=False`). Generation (`generate()` or a decoding"
                    " loop) runs through the pipeline from `validation_step`, `test_step` and `predict_step`, each"
                    " stage keeping its own layers' cache (docs/evaluation.md, 'Generation')."
                )


@contextmanager
def everything_ghosted(
    module: nn.Module, device: torch.device, dtypes: Optional[dict[int, torch.dtype]] = None
) -> Iterator[dict[int, Ghost]]:
    """Every parameter of ``module``, and every buffer of a module with parameters (or on the meta device), a ghost for
    the block (one ghost
    per tensor, shared by the names it has). Yields ``{id(real tensor): ghost}``. ``dtypes``: the dtype a tensor
    computes in when it is not its own (``{id: dtype}``: a sharded parameter all-gathered in bf16)."""
    ghosts: dict[int, Ghost] = {}
    swaps: list[tuple[dict, str, Tensor]] = []
    with no_ghosts_left(module):  # what the run keeps in plain attributes (RecurrentGemma's states)
        try:
            for path, sub in module.named_modules(remove_duplicate=False):
                owned = sub._parameters
                meta_buffers = any(v is not None and v.is_meta for v in sub._buffers.values())  # on meta: no values
                with_buffers = meta_buffers or any(v is not None for v in owned.values())
                tables = [owned] + ([sub._buffers] if with_buffers else [])
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
