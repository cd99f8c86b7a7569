"""Running the user's step as a pipeline stage.

The user's ``training_step`` (or ``validation_step``, ...) stays as it is. Every stage runs it, per microbatch, with
the backbone's blocks swapped for runners (:class:`Runner`) that decide what each block call does:

- **stage** (:meth:`StepProgram.run_stage`, inside torch's ``PipelineStage``): the stage's *window* runs for real:
  the code from the end of the block before its first (the code between two containers included), its blocks, and
  the code between them. Before the window everything runs on ghosts (:mod:`lightning_pipe._ghost`): the parameters
  of other stages, and those this rank holds that earlier code reads, are ghosts, blocks before the window are
  skipped, which makes it cheap and keeps the values computed from the batch alone (masks, rotary tables, position
  ids) real. What the previous stage sent takes the place of its producers' outputs (a skipped block's, a
  module's, or what a skipped block's hooks recorded: [Note: values from inside blocks]), so the user's code carries
  each value to where it is used ([Note: stage boundaries]). After the
  window's last block the step stops, and the values the next stage needs are the stage's output. The last stage
  of a training step does not stop: its window runs on to the step's end, and the stage's output is the loss
  ([Note: the last stage's loss]).
- **answer** (:meth:`StepProgram.run_answering`, evaluation): the same with the code after the backbone as the
  window: every block is skipped, the values the last stage output take their producers' places, and the code after
  the backbone (final norm, head, ``self.log``, metrics) runs for real.
- **capture** (:meth:`~lightning_pipe._calls.runners.BlockRunners.batch_size_of`): the code before the backbone runs on
  ghosts until the first block call, whose hidden state gives the batch size.

The runners and the machinery that swaps them in are :mod:`lightning_pipe._calls.runners`; what the setup learned
about each block call (:class:`~lightning_pipe._calls.records.Structure`) tells the runners where the hidden state is
and what shape of output a skipped block returns (:mod:`lightning_pipe._calls.skipped`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lightning_pipe._calls.batch import Result, call_muted, row_span
from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.flow import Flow, Producer
from lightning_pipe._calls.records import HiddenAt, Structure, replace_hidden
from lightning_pipe._calls.runners import BlockCalls, BlockRunners, never_called
from lightning_pipe._calls.stops import Stop
from lightning_pipe._errors import BackboneCallError, stop_iteration_fails
from lightning_pipe._ghost import Ghost, GhostValueError, contains_ghost, ghost_of
from lightning_pipe._model.structure import everything_ghosted

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from torch.autograd.function import FunctionCtx


class StageLoss(Protocol):
    """What the last stage of a training step runs the user's step inside ([Note: the last stage's loss]): the
    runtime's loss weighting, log recording and loss observation."""

    def around_step(self, rows: int) -> AbstractContextManager[object]:
        """Entered around one microbatch's step (``rows``: how many of the batch's rows it holds)."""

    def around_block(self) -> AbstractContextManager[object]:
        """Entered around each block call of the stage, run or skipped: what ``around_step`` watches is paused there."""

    def loss(self, result: object, anchor: Optional[Tensor]) -> Tensor:
        """The loss the microbatch back-propagates, from what the step returned; ``anchor`` (the last block's output,
        or ``None``) carries an exact zero when the microbatch weighs nothing."""


class StepProgram(BlockRunners):
    """The user's step on this rank, run in the modes described in the module docstring.

    Args:
        module: the LightningModule (split).
        backbone: its backbone.
        structure: what the setup learned about the step's block calls.
        flow: what each stage boundary carries ([Note: stage boundaries]).
        stage_bounds: ``{stage: (first block, last block + 1)}`` for this rank's stages.
        swaps: ``{stage or "answer": [(owner, name, kind)]}``: the parameters this rank holds that the code before
            that run's window reads; they are ghosts until the window starts.
        device: this rank's device.
        checkpointed: which blocks run under activation checkpointing.
    """

    def __init__(
        self,
        module: nn.Module,
        backbone: Backbone,
        structure: Structure,
        flow: Flow,
        stage_bounds: dict[int, tuple[int, int]],
        swaps: dict[Union[int, str], Sequence[tuple[nn.Module, str, str]]],
        device: torch.device,
        checkpointed: Callable[[nn.Module], bool] = lambda block: False,
    ) -> None:
        super().__init__(module, backbone, structure, device, swaps)
        self.flow = flow
        self.stage_bounds = stage_bounds
        self.checkpointed = checkpointed
        #: whether the schedule splits the backward into input and weight gradients: the values a stage sends then go
        #: through :class:`_HandOver` (the runtime sets it with the schedule)
        self.hand_over = True
        self.step: Optional[Callable[..., object]] = None
        self.batch: Any = None
        self.batch_size = 0
        self.step_args: tuple = ()
        self.step_kwargs: dict = {}
        #: ``"ghost"`` or ``"real"`` while a stage runs to learn its shapes (``PipelineRuntime._probe``), on ghosts
        #: or for real: state the step carries between calls (a generation pass's caches) must not change
        self.probing_shapes: Optional[str] = None
        self.whole_flow = flow
        #: ``(first row, outputs)`` of each microbatch of the answer stage of a partial pass that is not the last
        #: ([Note: partial passes])
        self.answers_kept: list[tuple[int, tuple[Tensor, ...]]] = []
        #: within :meth:`computing_loss`: what the last stage's training forward computes its loss with
        self.stage_loss: Optional[StageLoss] = None

    # ------------------------------------------------------------------------------------------------ the batch
    @contextmanager
    def holding(
        self, step: Callable[..., object], batch: Any, batch_size: int, *args: Any, **kwargs: Any
    ) -> Iterator[None]:
        """The step, batch and extra step arguments that the stage runs inside the block use; nothing here refers to
        them once the block ends (the batch's memory is the loop's to free)."""
        self.step, self.batch, self.batch_size = step, batch, batch_size
        self.step_args, self.step_kwargs = args, kwargs
        try:
            yield
        finally:
            self.step, self.batch, self.batch_size = None, None, 0
            self.step_args, self.step_kwargs = (), {}

    @contextmanager
    def passing(self, flow: Flow) -> Iterator[None]:
        """Within the block, the step is a call that runs only ``flow.blocks`` ([Note: partial passes])."""
        self.flow, self.answers_kept = flow, []
        try:
            yield
        finally:
            self.flow, self.answers_kept = self.whole_flow, []

    @contextmanager
    def computing_loss(self, loss: StageLoss) -> Iterator[None]:
        """Within the block (a training step), the last stage's forward runs the step to its end and returns the
        microbatch's loss ([Note: the last stage's loss])."""
        self.stage_loss = loss
        try:
            yield
        finally:
            self.stage_loss = None

    def offsets(self) -> dict[str, int]:
        blocks = self.flow.blocks
        return self.structure.calls_before(blocks.start) if blocks is not None else {}

    def census(
        self, step: Callable[..., object], first: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], set[tuple[str, str, int]]]:
        """A call that starts at block ``first``, run on ghosts with every block skipped: the blocks it calls and
        the ``("module", path, call)`` of each producer module call it makes ([Note: partial passes])."""
        run = _Census(self, first, self.structure.calls_before(first))
        with torch.no_grad(), everything_ghosted(self.module, self.device), self.running(run):
            try:
                call_muted(self.module, step, args, kwargs)
            except (GhostValueError, RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as err:
                if not run.called or isinstance(err, BackboneCallError):
                    raise
                # after the blocks the census is best effort (code that reads values: the answer runs it for real)
        return run.called, run.produced

    @contextmanager
    def shape_probe(self, kind: str) -> Iterator[None]:
        self.probing_shapes = kind
        try:
            yield
        finally:
            self.probing_shapes = None

    def sub_batch(self, rows: Tensor) -> Any:
        start, stop = row_span(rows)
        rows_of = getattr(self.batch, "lp_rows", None)  # a generation pass's inputs slice themselves
        if rows_of is not None:
            return rows_of(start, stop, self.probing_shapes)
        return self.batch_rows(self.batch, self.batch_size, start, stop)

    # ------------------------------------------------------------------------------------------------ the modes
    def run_stage(
        self, stage: int, rows: Tensor, received: Sequence[Tensor] = (), probing: bool = False
    ) -> tuple[Tensor, ...]:
        """This rank's ``stage`` on the microbatch ``rows`` of the current batch, given what the previous stage
        sent: what it sends on (for the last stage, what the code after the backbone reads).

        ``probing``: the run is on ghosts, to learn shapes (block arguments may then be ghosts too)."""
        assert self.step is not None
        first, stop = self.stage_bounds[stage]
        flow, blocks = self.flow, self.flow.blocks
        given = dict(zip(flow.receives(stage), received))
        swaps: Optional[int] = stage
        if blocks is not None:  # a call of only some blocks ([Note: partial passes])
            answer_stage = flow.answer_stage % len(flow.sends)
            if stage > answer_stage or stop <= blocks.start:  # no block of the call: passes on what it was given
                return tuple(received) or (rows.clone(),)
            if first <= blocks.start:
                swaps = None  # the window starts with the call's code before its first block
            first, stop = max(first, blocks.start), min(stop, blocks.stop)
        loss = self.stage_loss
        if loss is not None and blocks is None and stage == len(flow.sends) - 1 and not probing and (
            self.probing_shapes is None  # a probe that runs for real (tensor-parallel blocks) learns shapes only
        ):
            return (self._run_to_loss(loss, stage, first, rows, given),)
        run = _Window(self, first, stop, given, flow.sends[stage], probing=probing, stage=stage)
        if blocks is not None:
            run.calls(blocks, self.offsets())
        with self.running(run, swaps=swaps):
            try:
                call_muted(self.module, self.step, (self.sub_batch(rows), *self.step_args), self.step_kwargs)
            except Stop as stop_run:
                return self._kept_if_answering(stage, rows, stop_run.value, probing)
        raise never_called(run)

    def _run_to_loss(
        self, loss: StageLoss, stage: int, first: int, rows: Tensor, given: dict[Producer, Tensor]
    ) -> Tensor:
        """The last stage of a training step: its window runs on to the step's end, once, and the stage's output is
        the microbatch's loss.

        [Note: the last stage's loss]
        torch's schedule runs the last stage's forward, then its ``loss_fn`` on that forward's output. Running the
        user's step as the forward up to the last block and then again, every block skipped, as the loss function
        would run the code before the backbone twice and walk every block twice per microbatch. Instead the forward
        runs the step once, to its end, and returns the loss already weighted and scaled (the runtime's
        :class:`StageLoss`); the schedule's loss function passes it on. The autograd graph is the same: the code
        after the backbone hangs off the last block's output either way, and torch back-propagates from the loss
        through the stage's inputs, weights included (the head's weights are the last stage's parameters), so the
        zero-bubble schedules' input and weight passes split it as before. What the runtime watches in the loss code
        (``self.log``, the means a loss averages over) is paused while a block is called, run or skipped: a
        ``TorchFunctionMode`` left active in a block would cost a Python call per operator (every tensor attribute the
        runtime reads for a skipped block included) and recompile compiled blocks. The microbatch's rows are sliced
        before it starts, for the same reason.
        """
        assert self.step is not None
        run = _Window(self, first, len(self.backbone), given, (), probing=False, stage=stage, loss=loss)
        batch = self.sub_batch(rows)  # before the loss observer: slicing the batch is the runtime's, not the loss's
        held = len(rows) // (self.rows_per_row or 1)  # the batch's rows, as Lightning counts a microbatch's size
        with self.running(run, swaps=stage), stop_iteration_fails(), loss.around_step(held):
            result = self.step(batch, *self.step_args, **self.step_kwargs)
        if not run.after_backbone:
            raise never_called(run)
        return loss.loss(result, run.anchor)

    def _kept_if_answering(
        self, stage: int, rows: Tensor, outputs: tuple[Tensor, ...], probing: bool
    ) -> tuple[Tensor, ...]:
        """What a stage sends on: its outputs, or, on the answer stage of a partial pass that is not the last, the
        row numbers, its outputs being kept for the answer it computes after the pass."""
        flow = self.flow
        if flow.blocks is None or stage == len(flow.sends) - 1 or stage != flow.answer_stage % len(flow.sends):
            return outputs or (rows.clone(),)  # a boundary a partial pass does not cross: the rows, for torch
        if not probing and self.probing_shapes is None:
            self.answers_kept.append((row_span(rows)[0], outputs))
        return (rows.clone(),)

    def kept_answers(self, batch_size: int) -> tuple[Tensor, ...]:
        """The answer stage's outputs of every microbatch of the partial pass, merged (as the schedule merges the
        last stage's: along dimension 0, a value without the rows taken once)."""
        parts = [outputs for _, outputs in sorted(self.answers_kept, key=lambda item: item[0])]
        rows = batch_size // len(parts)
        return tuple(
            torch.cat(values) if values[0].dim() > 0 and values[0].shape[0] == rows else values[0]
            for values in zip(*parts)
        )

    def run_answering(
        self, output: Union[Tensor, tuple[Tensor, ...]], step: Callable[..., Result], *args: Any, **kwargs: Any
    ) -> Result:
        """The whole step, with the values the code after the backbone reads taken from ``output`` (the last stage's
        output: a tensor, or a tuple of them); returns what the step returns."""
        outputs = output if isinstance(output, tuple) else (output,)
        blocks = self.flow.blocks
        n = len(self.backbone) if blocks is None else blocks.stop
        run = _Window(self, n, n, dict(zip(self.flow.answers, outputs)), (), probing=False, stage=None)
        if blocks is not None:
            run.calls(blocks, self.offsets())
        with self.running(run, swaps="answer"), stop_iteration_fails():
            result = step(*args, **kwargs)
        if not run.after_backbone:
            raise never_called(run)
        return result

    def run_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.is_grad_enabled() and self.checkpointed(block):
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)


class _Window(BlockCalls):
    """A run whose *window* (blocks ``first .. stop - 1`` and the code from the end of block ``first - 1``) is
    real: the values ``given`` take the place of their producers' outputs before it, and the values in ``send`` are
    collected in it; the run stops after block ``stop - 1`` with them, or (``first == stop == n``, the code after
    the backbone) runs to the end."""

    def __init__(
        self, program: StepProgram, first: int, stop: int, given: dict[Producer, Tensor],
        send: tuple[Producer, ...], probing: bool, stage: Optional[int], loss: Optional[StageLoss] = None,
    ) -> None:
        super().__init__(program)
        self.first, self.stop = first, stop
        self.given = given
        self.send = send
        self.wanted = set(send)
        self.wanted_blocks = {producer[1] for producer in send if producer[0] == "block"}  # blocks whose output is sent
        self.found: dict[Producer, Tensor] = {}
        self.probing = probing
        self.stage = stage
        #: the last stage of a training step: the run goes on after the last block ([Note: the last stage's loss])
        self.loss = loss
        self.anchor: Optional[Tensor] = None  # then: a tensor of the last block's output that requires grad

    def call_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.loss is None:
            return super().call_block(index, block, args, kwargs)
        with self.loss.around_block():  # the runtime's code and the blocks are not the loss code the observer watches
            return super().call_block(index, block, args, kwargs)

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        program = self.program
        if index < self.first:
            out = program.skipped_output(index, args, kwargs, hidden, self.given)
            if index in self.wanted_blocks:
                self._collect_block(index, out)
            if index in program.structure.inner_calls:
                program.replay_inner(index, args, kwargs, self.given, self.on_inner_value)
            if index == self.first - 1 and self.restore_prefix is not None:
                self.restore_prefix()  # the window starts: this run's code reads the real tensors from here
            if index == self.stop - 1 and self.stage is not None:  # the answer stage of a partial pass, no block
                raise Stop(self._outputs())  # of the call its own: what the code after the call's blocks reads
            return out
        if index == self.first and self.probing and not isinstance(hidden, Ghost):
            args, kwargs = replace_hidden(args, kwargs, at, ghost_of(hidden))  # no real data reaches a block
        if not self.probing and contains_ghost((args, kwargs)):
            raise _ghost_argument(program.backbone.blocks[index].name, args, kwargs, self.stage)
        self.in_block = True
        try:
            out = program.run_block(index, block, args, kwargs)
        finally:
            self.in_block = False
        if index in self.wanted_blocks:
            self._collect_block(index, out)
        if index == self.stop - 1:
            if self.loss is None:
                raise Stop(self._outputs())
            self.anchor = next((t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad), None)
        return out

    def on_module_output(self, path: str, call: int, output: Any) -> Any:
        leaves, spec = tree_flatten(output)
        changed = False
        for i in range(len(leaves)):
            producer = ("module", path, call, i)
            value = self.given.get(producer)
            if value is not None:
                leaves[i], changed = value, True
            if producer in self.wanted:
                self.found[producer] = leaves[i]
        return tree_unflatten(leaves, spec) if changed else None

    def on_inner_value(self, producer: Producer, value: Tensor) -> None:
        if producer in self.wanted:
            self.found[producer] = value

    def _collect_block(self, index: int, out: Any) -> None:
        for i, leaf in enumerate(tree_leaves(out)):
            producer = ("block", index, 0, i)
            if producer in self.wanted:
                self.found[producer] = leaf

    def _outputs(self) -> tuple[Tensor, ...]:
        anchor = next((t for t in self.given.values() if t.requires_grad), None)
        sent = []
        for producer in self.send:
            value = self.found.get(producer)
            if value is None:
                raise BackboneCallError(
                    f"Stage {self.stage} did not produce {self.program.flow.names[producer]}, which the setup saw the"
                    " step compute and a later stage uses: the step runs differently from the setup's run (its"
                    " control flow depends on the batch's values, or on the stage). Make the step call the same"
                    " modules and blocks for every batch."
                )
            if isinstance(value, DTensor):
                raise BackboneCallError(
                    f"{self.program.flow.names[producer]} crosses from stage {self.stage} to the next as a DTensor"
                    f" ({value.placements}): a stage boundary carries plain tensors. Have the module that produces it"
                    " return a local tensor (`use_local_output=True` in its tensor-parallel style), replicated over"
                    " the tensor ranks, or run that code inside a block."
                )
            handed = value.requires_grad and self.program.hand_over
            sent.append(_HandOver.apply(value, anchor) if handed else value.contiguous())
        return tuple(sent)


class _Census(BlockCalls):
    """See :meth:`StepProgram.census`."""

    def __init__(self, program: StepProgram, first: int, offsets: dict[str, int]) -> None:
        super().__init__(program)
        self.calls(range(first, len(program.backbone)), offsets)
        self.called: list[int] = []
        self.produced: set[tuple[str, str, int]] = set()

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        self.called.append(index)
        return self.program.skipped_output(index, args, kwargs, hidden, {})

    def on_module_output(self, path: str, call: int, output: Any) -> None:
        self.produced.add(("module", path, call))
        return None


class _HandOver(torch.autograd.Function):
    """``value`` as the stage sends it, for torch's zero-bubble schedules, which split the backward into input and
    weight gradients (the others send the value itself: a whole backward needs neither, and this node costs an
    autograd call per value and microbatch each way):

    - a new tensor over the same memory that is not a view: torch detaches a stage's outputs in place once their
      input gradients are computed, and a value the stage also uses itself (a block's output that a later block of
      the stage reads, a received value passed on) must stay attached for the weight gradients; a view cannot be
      detached in place;
    - attached to ``anchor``, one of the stage's inputs (no gradient flows to it): torch keeps, for the weight pass,
      the gradients at the nodes where the weights' paths meet the inputs'. A value only weights compute (T5's
      relative position bias, sent to the blocks of the next stage) meets no input, so the gradient the next stage
      sends back for it would reach no weight; through this node, it does."""

    @staticmethod
    def forward(ctx: FunctionCtx, value: Tensor, anchor: Optional[Tensor]) -> Tensor:
        return value.detach().contiguous()  # sent as it is: a broadcast value (T5's position bias) may be strided

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None



def _ghost_argument(block: str, args: tuple, kwargs: dict, stage: Optional[int]) -> BackboneCallError:
    named = [f"positional argument {i}" for i, a in enumerate(args) if contains_ghost(a)]
    named += [f"`{k}`" for k, v in kwargs.items() if contains_ghost(v)]
    return BackboneCallError(
        f"Block `{block}` runs on stage {stage}, but its {', '.join(named) or 'arguments'} depend on values this stage"
        " neither computes nor receives (computed from parameters by code the setup did not see run, e.g. only for"
        " some batches). Compute block arguments the same way for every batch, from the batch, blocks and modules."
    )
