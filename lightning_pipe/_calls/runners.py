r"""The runners that stand in the backbone's containers for the blocks while a step runs, and the run modes' base.

While a step runs under the pipeline, the backbone's containers hold :class:`Runner`\ s instead of the blocks
(:class:`BlockRunners`): each block call goes to the run in progress, a :class:`BlockCalls` whose mode decides what
the call does. The setup's analysis and the ``balance="time"`` profile are modes of their own; the per-batch modes
(a stage, the last stage's answer) are :class:`~lightning_pipe._step.program.StepProgram`'s. The capture mode,
:meth:`BlockRunners.batch_size_of`, serves both: the first block's hidden state gives the batch size.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Callable, NoReturn, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from lightning_pipe._calls.batch import call_muted, hidden_rows_per_row, rows_dim, slice_batch
from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.emptied import ghost_parameters
from lightning_pipe._calls.flow import Producer
from lightning_pipe._calls.inner import inner_returned
from lightning_pipe._calls.packed import PackedMedia
from lightning_pipe._calls.records import HiddenAt, Structure, get_hidden
from lightning_pipe._calls.skipped import SkippedBlocks
from lightning_pipe._calls.stops import BackboneNotCalledError, SecondPass, Stop
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import ghost_of


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

    #: called as ``forward`` itself: ``nn.Module``'s call would only look for hooks, and a runner has none (the
    #: block's own run when the block is called); every skipped block of every stage run goes through here
    __call__ = forward

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


class BlockRunners(SkippedBlocks):
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
        super().__init__(module, structure, device)
        self.backbone = backbone
        self.current: Optional[BlockCalls] = None
        #: the hidden state's dimension of rows, learned by :meth:`batch_size_of` ([Note: sequence-first hidden states])
        self.rows_dim = 0
        #: the hidden state's rows per row of the batch, learned with it (0: none; [Note: rows folded into the
        #: batch]), and the hidden state's shape
        self.rows_per_row = 1
        self.hidden_shape: tuple[int, ...] = ()
        #: images and videos packed over the batch, cut by its rows ([Note: packed vision inputs])
        self.packed = PackedMedia.of(module)
        runners = [Runner(self, i, backbone.module(i)) for i in range(len(backbone))]
        #: the containers' module tables with the runners in the blocks' places, swapped in while a run is in progress
        self._runner_tables = backbone.tables_with(runners)
        # key -> (owner, name, kind, real, ghost) of the held tensors read before the window
        self._swaps = {
            key: [
                (owner, name, kind, real, ghost_of(real, origin=name))
                for owner, name, kind in entries
                for real in [getattr(owner, f"_{kind}s")[name]]
            ]
            for key, entries in (swaps or {}).items()
        }
        # what the stand-ins replaced (a parameter or buffer, or a table of hooks), put back after
        self._displaced: list[tuple[dict, str, Optional[Union[Tensor, dict]]]] = []
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

    # -------------------------------------------------------------------------------------------- the capture
    def batch_size_of(self, step: Callable[..., object], *args: Any, **kwargs: Any) -> int:
        """The batch size of a step's call: the rows of the first block's hidden state (see
        :func:`~lightning_pipe._calls.batch.rows_dim`)."""
        return self.rows_of(self.hidden_shape_of(step, *args, **kwargs), *args[:1])

    def rows_of(self, shape: tuple[int, ...], batch: Any) -> int:
        """The rows of a call of ``batch`` whose first block's hidden state has ``shape``; learns :attr:`rows_dim` and
        :attr:`rows_per_row`."""
        self.rows_dim = rows_dim(shape, (batch,))
        self.rows_per_row = hidden_rows_per_row(shape[self.rows_dim], batch)
        self.hidden_shape = shape
        return shape[self.rows_dim]

    @property
    def batch_rows_count(self) -> int:
        """How many rows of the batch the call learned by :meth:`rows_of` has: its hidden state's rows, or as many of
        them as the batch's rows make ([Note: rows folded into the batch]); refused where they make none."""
        if not self.rows_per_row:
            rows = self.hidden_shape[self.rows_dim]
            raise BackboneCallError(
                f"The first backbone block's hidden state holds {rows} rows (its dimension {self.rows_dim}, shape"
                f" {list(self.hidden_shape)}), but no tensor of the batch has {rows} rows, or a number of rows that"
                f" {rows} is a multiple of. `PipelineStrategy` cuts the hidden state into microbatches by its rows and"
                " runs each microbatch's step on the rows of the batch that make them, so it cannot tell which rows of"
                " the batch make which: the blocks' rows are not the batch's samples (a vision tower's patches packed"
                " over the batch's images, for instance). Set `backbone=` to the blocks whose hidden state holds the"
                " batch's rows (a vision-language model's language layers), so that the code that makes the other"
                " rows runs before the backbone, on the first stage."
            )
        return self.hidden_shape[self.rows_dim] // self.rows_per_row

    def batch_rows(self, batch: Any, batch_size: int, start: int, stop: int) -> Any:
        """The rows of ``batch`` that make rows ``start:stop`` of the hidden state of a call of ``batch_size`` rows
        ([Note: rows folded into the batch]); every row where none of the batch makes them."""
        k = self.rows_per_row or 1
        part = slice_batch(batch, batch_size // k, start // k, stop // k)
        if self.packed is not None and isinstance(batch, Mapping):
            return self.packed.cut(batch, part, start // k, stop // k)
        return part

    def hidden_shape_of(self, step: Callable[..., object], *args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The shape of the first block's hidden state in a step's call (found on ghosts)."""
        return self.first_call_of(step, *args, **kwargs)[1]

    def first_call_of(
        self, step: Callable[..., object], *args: Any, **kwargs: Any
    ) -> tuple[int, tuple[int, ...]]:
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

    # --------------------------------------------------------------------------------------------- the run
    @contextmanager
    def running(self, run: BlockCalls, swaps: Optional[Union[int, str]] = None) -> Iterator[BlockCalls]:
        """Swap the runners in and make ``run`` the run in progress for the block (one at a time per process);
        ``swaps``: the key of the tensors it sees as ghosts until ``run.restore_prefix()``."""
        if self.current is not None:
            raise RuntimeError("A pipelined step is already running in this process.")
        self.current = run
        held = self.backbone.swap_tables(self._runner_tables)
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
            self.backbone.swap_tables(held)
            self.current = None

    def _put_back(self) -> None:
        for table, name, value in reversed(self._displaced):
            table[name] = value
        self._displaced = []
        if self.current is not None:
            self.current.restore_prefix = None

    def _swap(self, entries: list[tuple[nn.Module, str, str, Tensor, Tensor]]) -> None:
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
    def call_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> NoReturn:
        raise Stop((index, get_hidden(args, kwargs, self.locate_hidden(index, args, kwargs))))


def never_called(run: BlockCalls) -> BackboneCallError:
    """The error of a step that finished without calling every block of ``run``'s backbone."""
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
