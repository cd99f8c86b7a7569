r"""How a step calls the backbone's blocks, and the machinery that stands in for them while a step runs.

What the setup learns about a step's block calls is a :class:`Structure` (:mod:`lightning_pipe._model.structure` learns
it). While a step runs under the pipeline, the backbone's containers hold :class:`Runner`\ s instead of the blocks
(:class:`BlockRunners`): each block call goes to the run in progress, a :class:`BlockCalls` whose mode decides what
the call does. The setup's analysis and the ``balance="time"`` profile are modes of their own; the per-batch modes
(a stage, the last stage's answer) are :class:`~lightning_pipe._step.program.StepProgram`'s. The capture mode,
:meth:`BlockRunners.batch_size_of`, serves both: the first block's hidden state gives the batch size.

A block's hidden state is its first positional argument (or the keyword argument that carries the previous block's
output) and its output is that tensor, or a tuple/list whose first tensor is (other elements may be ``None``: SD3's
last joint block returns ``(None, hidden_states)``).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import TreeSpec, tree_leaves, tree_unflatten

from lightning_pipe._errors import BackboneCallError, not_computed_by_last_stage, stop_iteration_fails
from lightning_pipe._ghost import Ghost, ghost_of
from lightning_pipe._lightning.log import LogRecorder
from lightning_pipe._model.backbone import Backbone
from lightning_pipe._model.emptied import ghost_parameters
from lightning_pipe._model.flow import Producer, Unsendable
from lightning_pipe._model.inner import InnerCall, inner_returned, replay

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
    #: ``{producer: (position, positions that use it)}`` of every value computed from parameters, in production order
    values: dict[Producer, tuple[int, set[int]]] = field(default_factory=dict)
    unsendable: list[Unsendable] = field(default_factory=list)
    region_params: dict[int, set[int]] = field(default_factory=dict)  # parameter id -> regions that read it
    region_modules: dict[int, set[int]] = field(default_factory=dict)  # module id -> regions that call it
    #: per block: the calls inside it of modules with forward hooks, replayed where it is skipped ([Note: values from
    #: inside blocks] in :mod:`lightning_pipe._model.inner`); empty unless a value leaves a block that way
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


class Stop(BaseException):
    """Ends the user's step early, carrying a value (a ``BaseException``, so ``except Exception`` lets it pass)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class SecondPass(BackboneCallError):
    """The step called the backbone again after a whole pass: it decodes (``generate()``, a sampling loop). The
    evaluation steps then run in lock step (:mod:`lightning_pipe._step.generation`); elsewhere this is the error."""


class Runner(nn.Module):
    """Stands in a backbone container for one block while a step runs under the pipeline.

    The block is not registered (the runner has no parameters of its own); attribute reads go to the block, so loop
    code such as ``layer.attention_type`` works.
    """

    def __init__(self, program: BlockRunners, index: int, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_lp_program", program)
        object.__setattr__(self, "_lp_index", index)
        object.__setattr__(self, "_lp_block", block)

    @torch.compiler.disable  # a compiled module around the blocks: the pipeline's own code is never traced
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self._lp_program.current
        if run is None:  # e.g. a checkpointed block recomputed in backward, after the step
            return self._lp_block(*args, **kwargs)
        return run.call_block(self._lp_index, self._lp_block, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_lp_block"), name)


class BlockCalls:
    """The mode-independent part of one run: block order, the hidden state, module outputs, and what the mode does."""

    def __init__(self, program: BlockRunners) -> None:
        self.program = program
        self.next = 0
        self.after_backbone = False
        self.in_block = False
        self.module_calls: dict[str, int] = {}  # producer module -> its calls outside the blocks so far
        self.inner_calls: dict[str, int] = {}  # producer module inside a block -> its calls so far
        self.restore_prefix: Optional[Callable[[], None]] = None  # undoes the ghosting of tensors read early
        self.end = len(program.backbone)  # the block after the last one the run calls

    def calls(self, blocks: range, offsets: dict[str, int]) -> None:
        """The run is a call of the model that runs only ``blocks`` ([Note: partial passes]): it starts at their first
        block, its producer modules counting their calls from ``offsets``, and its backbone ends after the last."""
        self.next, self.end = blocks.start, blocks.stop
        self.module_calls = dict(offsets)

    def call_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        backbone = self.program.backbone
        if self.after_backbone:  # an encoder-decoder's next pass starts at the decoder's first block
            raise SecondPass(
                "The step called the backbone a second time. `PipelineStrategy` runs each backbone block exactly once"
                " per step in `training_step`: call the backbone once per batch. (Decoding loops, `generate()`, run"
                " in `validation_step`, `test_step` and `predict_step`: see docs/evaluation.md, 'Generation'.)"
            )
        if index != self.next:
            raise BackboneCallError(
                f"The step called block {index} (`{backbone.blocks[index].name}`) when block {self.next} was next."
                " `PipelineStrategy` runs each backbone block exactly once per step, in order: call the blocks"
                " once each, in the order the container holds them."
            )
        self.next += 1
        at = self.locate_hidden(index, args, kwargs)
        hidden = get_hidden(args, kwargs, at)
        out = self.on_block(index, block, args, kwargs, at=at, hidden=hidden)
        if index == self.end - 1:
            self.after_backbone = True
            self.on_backbone_end()
        return out

    def locate_hidden(self, index: int, args: tuple, kwargs: dict) -> HiddenAt:
        """Where this call carries the hidden state (setup learned it; the analysis overrides this to learn it)."""
        return self.program.structure.hidden_at[index]

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        raise NotImplementedError

    def on_backbone_end(self) -> None:
        pass

    def module_output(self, path: str, output: Any) -> Any:
        """A producer module (see [Note: stage boundaries]) returned ``output`` outside the blocks: count the call,
        and return what the step should see (``None``: the output itself)."""
        call = self.module_calls.get(path, 0)
        self.module_calls[path] = call + 1
        return self.on_module_output(path, call, output)

    def on_module_output(self, path: str, call: int, output: Any) -> Any:
        return None

    def inner_output(self, path: str, output: Any) -> None:
        """A producer module inside a block returned ``output`` (the block runs here): count the call."""
        call = self.inner_calls.get(path, 0)
        self.inner_calls[path] = call + 1
        for i, leaf in enumerate(tree_leaves(output)):
            if isinstance(leaf, Tensor):
                self.on_inner_value(("inner", path, call, i), leaf)

    def on_inner_value(self, producer: Producer, value: Tensor) -> None:
        """``value`` is ``producer``'s, computed by a block that runs here or received for a skipped one."""


class BlockRunners:
    r"""The backbone of ``module`` with its blocks swapped for :class:`Runner`\ s while a run is in progress.

    Args:
        module: the LightningModule.
        backbone: its backbone.
        structure: what the setup learned about the step's block calls (a blank one while it learns).
        device: this rank's device.
        swaps: ``{key: [(owner, name, kind)]}``: the parameters this rank holds that the code before a run's window
            reads (``key``: a stage, or ``"answer"`` for the code after the backbone): a run with that key sees
            ghosts in their place until its window starts (the stage program's; none elsewhere).
    """

    def __init__(
        self,
        module: nn.Module,
        backbone: Backbone,
        structure: Structure,
        device: torch.device,
        swaps: Optional[dict[Union[int, str], Sequence[tuple[nn.Module, str, str]]]] = None,
    ) -> None:
        self.module = module
        self.backbone = backbone
        self.structure = structure
        self.device = device
        self.current: Optional[BlockCalls] = None
        #: the hidden state's dimension of rows, learned by :meth:`batch_size_of` ([Note: sequence-first hidden states])
        self.rows_dim = 0
        self._runners = [Runner(self, i, backbone.module(i)) for i in range(len(backbone))]
        self._blocks = [backbone.module(i) for i in range(len(backbone))]
        #: (block, its arguments' shapes) -> the shapes of what it returns when skipped (:meth:`skipped_output`)
        self._skipped_shapes: dict[tuple[int, tuple], list[Optional[tuple[int, ...]]]] = {}
        # key -> (owner, name, kind, real, ghost) of the held tensors read before the window
        self._swaps = {
            key: [
                (owner, name, kind, real, ghost_of(real, origin=name))
                for owner, name, kind in entries
                for real in [getattr(owner, f"_{kind}s")[name]]
            ]
            for key, entries in (swaps or {}).items()
        }
        self._displaced: list[tuple[dict, str, Any]] = []  # what the stand-ins replaced, put back after
        # a weak reference: the hooks stay on the user's modules, the program may go (a later Trainer call builds
        # another); a hook whose program is gone does nothing
        me = weakref.ref(self)
        self._hooks = [
            module.get_submodule(path).register_forward_hook(functools.partial(_module_returned, me, path))
            for path in sorted(structure.producer_modules())
        ] + [
            module.get_submodule(path).register_forward_hook(functools.partial(inner_returned, me, path))
            for path in sorted(structure.producer_modules("inner"))
        ]

    def batch_size_of(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """The batch size of a step's call: the rows of the first block's hidden state (see :func:`rows_dim`)."""
        return self.rows_of(self.hidden_shape_of(step, *args, **kwargs), *args[:1])

    def rows_of(self, shape: tuple[int, ...], batch: Any) -> int:
        """The rows of a call of ``batch`` whose first block's hidden state has ``shape``; learns :attr:`rows_dim`."""
        self.rows_dim = rows_dim(shape, (batch,))
        return shape[self.rows_dim]

    def hidden_shape_of(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The shape of the first block's hidden state in a step's call (found on ghosts)."""
        return self.first_call_of(step, *args, **kwargs)[1]

    def first_call_of(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, tuple[int, ...]]:
        """The first block a step's call runs (0, or an encoder-decoder's decoder's first when it is given the
        encoder's output) and the shape of its hidden state (found on ghosts)."""
        with self.running(_Capture(self), swaps="answer") as run:
            try:
                call_muted(self.module, step, args, kwargs)
            except Stop as stop:
                index, hidden = stop.value
            else:
                raise never_called(run)
        if not isinstance(hidden, Tensor) or hidden.dim() == 0:
            raise BackboneCallError(
                "The first backbone block was called without a batched tensor as its hidden state. `PipelineStrategy`"
                " splits it along dimension 0 into microbatches: pass the hidden state as a tensor, batch first."
            )
        return index, tuple(int(n) for n in hidden.shape)

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

    def replay_inner(self, index: int, args: tuple, kwargs: dict, given: dict, found: Callable) -> None:
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
        plain = not kwargs and all(isinstance(a, Tensor) for a in args)  # the common call: skip the pytree walk
        arg_leaves = list(args) if plain else tree_leaves((args, kwargs))
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
                if isinstance(hidden, Ghost) and tuple(hidden.shape) == shape and hidden.dtype == leaf.dtype:
                    value = hidden  # the common case: a block returns its hidden state's shape (no new ghost)
                else:
                    value = Ghost(torch.empty(shape, dtype=leaf.dtype, device="meta"), self.device)
            leaves.append(leaf if value is None else value)
        return tree_unflatten(leaves, io.out_spec)

    @contextmanager
    def running(self, run: BlockCalls, swaps: Optional[Union[int, str]] = None) -> Iterator[BlockCalls]:
        """Swap the runners in and make ``run`` the run in progress for the block (one at a time per process);
        ``swaps``: the key of the tensors it sees as ghosts until ``run.restore_prefix()``."""
        if self.current is not None:
            raise RuntimeError("A pipelined step is already running in this process.")
        self.current = run
        for i, runner in enumerate(self._runners):
            self.backbone.set_module(i, runner)
        entries = self._swaps.get(swaps, []) if swaps is not None else []
        if entries:
            self._swap(entries)
        run.restore_prefix = self._put_back if entries else None
        try:
            with ghost_parameters(self.module):  # [Note: emptied models]
                yield run
        finally:
            if run.restore_prefix is not None:
                run.restore_prefix()
            for i, block in enumerate(self._blocks):
                self.backbone.set_module(i, block)
            self.current = None

    def _put_back(self) -> None:
        for table, name, value in reversed(self._displaced):
            table[name] = value
        self._displaced = []
        if self.current is not None:
            self.current.restore_prefix = None

    def _swap(self, entries: list) -> None:
        """Put the stand-ins in. What is registered may no longer be the tensor captured at setup: a sharded stage
        registers its unsharded parameters while unsharded."""
        self._displaced = []
        for owner, name, kind, real, stand_in in entries:
            table = getattr(owner, f"_{kind}s")
            if name not in table:  # registered under another name since (pruning's `weight_orig`)
                name = next((key for key, value in table.items() if value is real), name)
            self._displaced.append((table, name, table.get(name)))
            table[name] = stand_in
            if isinstance(real, DTensor):  # split over the tensor ranks: its style's hooks cannot take ghosts
                for hooks in ("_forward_pre_hooks", "_forward_hooks"):
                    self._displaced.append((vars(owner), hooks, vars(owner)[hooks]))
                    vars(owner)[hooks] = OrderedDict()


@torch.compiler.disable
def _module_returned(
    program: weakref.ref[BlockRunners], path: str, called: nn.Module, args: tuple, output: Any
) -> Any:
    """A producer module's forward hook ([Note: stage boundaries]): the run in progress decides what the step sees."""
    runners = program()
    run = runners.current if runners is not None else None
    if run is None or run.in_block:
        return None
    return run.module_output(path, output)


class _Capture(BlockCalls):
    def call_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        raise Stop((index, get_hidden(args, kwargs, self.locate_hidden(index, args, kwargs))))



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


def get_hidden(args: tuple, kwargs: dict, at: HiddenAt) -> Any:
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


def replace_hidden(args: tuple, kwargs: dict, at: HiddenAt, value: Any) -> tuple[tuple, dict]:
    where, key = at
    if where == "arg":
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}


def rows_dim(hidden: tuple[int, ...], batch: Any) -> int:
    """The dimension of a hidden state of shape ``hidden`` that holds the rows of ``batch``.

    [Note: sequence-first hidden states] Most backbones take the hidden state batch first (``[batch, length,
    width]``); FSMT's and XLNet's take it sequence first (``[length, batch, width]``). The pipeline cuts the batch into
    microbatches by rows, so it needs the rows' count: the first dimension, unless no tensor of the batch has that
    many rows and the second (of three or more) is the first dimension of one (the ``[batch, length]`` token ids).
    A microbatch's hidden state then holds its rows in its second dimension; its stage runs compute from the
    microbatch's rows of the batch, so only what merges the microbatches' outputs again (the last stage's output in
    evaluation) reads this."""
    firsts = {leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if hidden[0] in firsts or len(hidden) < 3 or hidden[1] not in firsts:
        return 0
    return 1


def slice_batch(batch: Any, batch_size: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor or sequence in ``batch`` whose first dimension is ``batch_size``.

    A tensor's rows are a copy, not a view: models write into their inputs in place (FSMT's ``shift_tokens_right``
    fills the labels' ``-100`` with the pad id), and a view shares the whole batch's version counter, so one
    microbatch's write would fail the backward of another's that saved its rows (the loss's targets), or reach a
    later stage's run of the same rows on this rank."""
    if isinstance(batch, Tensor):
        return batch[start:stop].clone() if batch.dim() > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, batch_size, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, batch_size, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and not any(isinstance(v, (Tensor, list, tuple, dict)) for v in batch):
            return batch[start:stop]
        return type(batch)(slice_batch(v, batch_size, start, stop) for v in batch)
    return batch


def loss_of(result: Any) -> Tensor:
    """The loss in what ``training_step`` returned."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise BackboneCallError(
            "Under `PipelineStrategy`, `training_step` must return the loss tensor (or a dict with 'loss') for every"
            f" microbatch; it returned {type(result).__name__}. Skipping a step by returning None is not supported."
        )
    if isinstance(loss, Ghost):
        raise BackboneCallError(not_computed_by_last_stage(
            "The loss depends on values", "Compute the loss from the backbone's output and the batch.", loss
        ))
    return loss


def call_muted(module: nn.Module, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    with LogRecorder().installed(module), stop_iteration_fails():  # the last stage logs the step per microbatch
        return step(*args, **kwargs)


class BackboneNotCalledError(BackboneCallError):
    """The step finished without calling the backbone at all (``backbone="auto"`` then tries another candidate)."""


def never_called(run: BlockCalls) -> BackboneCallError:
    backbone = run.program.backbone
    if run.next == 0:
        return BackboneNotCalledError(
            f"The step finished without calling the pipelined backbone ({backbone.describe()}). With"
            " `PipelineStrategy`, each `training_step`/`validation_step`/`test_step`/`predict_step` must run the"
            " backbone (directly or through `forward`) once per batch."
        )
    return BackboneCallError(
        f"The step called only the first {run.next} of the {len(backbone)} backbone blocks; the next was"
        f" `{backbone.blocks[run.next].name}`. Every block must run once per step; remove unused blocks from the"
        " container, or name the containers to pipeline with `backbone=`."
    )


