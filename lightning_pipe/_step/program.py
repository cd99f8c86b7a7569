"""Running the user's step as a pipeline stage.

The user's ``training_step`` (or ``validation_step``, ...) stays as it is. Every stage runs it, per microbatch, with
the backbone's blocks swapped for runners (:class:`Runner`) that decide what each block call does:

- **stage** (:meth:`StepProgram.run_stage`, inside torch's ``PipelineStage``): the code before the backbone runs for
  real on the first stage; on the others, with the first stage's parameters as ghosts (:mod:`lightning_pipe._ghost`),
  which makes it cheap and keeps the values it computes from the batch alone (masks, rotary tables, position ids)
  real. Blocks before this stage's are skipped (their output is a ghost); the first of its blocks gets the activation
  received from the previous stage; its blocks run for real, each with its own arguments; after its last block the
  step stops and that block's hidden state is the stage's output.
- **answer** (:meth:`StepProgram.run_answering`, the last stage's loss in training, and evaluation): the code before
  the backbone runs on ghosts, every block is skipped, the last block returns the stage output, and the code after
  the backbone (final norm, head, loss, ``self.log``, metrics) runs for real.
- **capture** (:meth:`~lightning_pipe._model.calls.BlockRunners.batch_size_of`): the code before the backbone runs on
  ghosts until the first block call, whose hidden state gives the batch size.

The runners and the machinery that swaps them in are :mod:`lightning_pipe._model.calls`; what the setup learned about
each block call (:class:`~lightning_pipe._model.calls.Structure`) tells the runners where the hidden state is and what
shape of output a skipped block returns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_pipe._errors import BackboneCallError, argument_not_on_stage
from lightning_pipe._ghost import Ghost, contains_ghost, ghost_of
from lightning_pipe._model.backbone import Backbone
from lightning_pipe._model.calls import (
    BlockCalls,
    BlockRunners,
    HiddenAt,
    Stop,
    Structure,
    call_muted,
    never_called,
    replace_hidden,
    slice_batch,
)


class StepProgram(BlockRunners):
    """The user's step on this rank, run in the modes described in the module docstring.

    Args:
        module: the LightningModule (split).
        backbone: its backbone.
        structure: what the setup learned about the step's block calls.
        stage_bounds: ``{stage: (first block, last block + 1)}`` for this rank's stages.
        prefix_swaps: the parameters and buffers this rank holds that the code before the backbone uses: they are
            ghosts while that code runs anywhere but in the first stage's run.
        device: this rank's device.
        checkpointed: which blocks run under activation checkpointing.
    """

    def __init__(
        self,
        module: nn.Module,
        backbone: Backbone,
        structure: Structure,
        stage_bounds: dict[int, tuple[int, int]],
        prefix_swaps: Sequence[tuple[nn.Module, str, str]],
        device: torch.device,
        checkpointed: Callable[[nn.Module], bool] = lambda block: False,
    ) -> None:
        super().__init__(module, backbone, structure, device, prefix_swaps)
        self.stage_bounds = stage_bounds
        self.checkpointed = checkpointed
        self.step: Optional[Callable[..., Any]] = None
        self.batch: Any = None
        self.batch_size = 0
        self.step_args: tuple = ()
        self.step_kwargs: dict = {}

    # ------------------------------------------------------------------------------------------------ the batch
    @contextmanager
    def holding(
        self, step: Callable[..., Any], batch: Any, batch_size: int, *args: Any, **kwargs: Any
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

    def sub_batch(self, rows: Tensor) -> Any:
        start, stop = int(rows[0]), int(rows[-1]) + 1
        return slice_batch(self.batch, self.batch_size, start, stop)

    # ------------------------------------------------------------------------------------------------ the modes
    def run_stage(self, stage: int, rows: Tensor, received: Optional[Tensor], probing: bool = False) -> Tensor:
        """This rank's ``stage`` on the microbatch ``rows`` of the current batch: its blocks' hidden state.

        ``probing``: the run is on ghosts, to learn shapes (block arguments may then be ghosts too)."""
        assert self.step is not None
        run = _Stage(self, stage, received, probing)
        with self.running(run, ghost_prefix=received is not None or stage > 0):
            try:
                call_muted(self.module, self.step, (self.sub_batch(rows), *self.step_args), self.step_kwargs)
            except Stop as stop:
                return stop.value
        raise never_called(run)

    def run_answering(self, output: Any, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The whole step, with the backbone's result taken from ``output``; returns what the step returns."""
        run = _Answer(self, output)
        with self.running(run, ghost_prefix=True):
            result = step(*args, **kwargs)
        if not run.after_backbone:
            raise never_called(run)
        return result

    def run_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.is_grad_enabled() and self.checkpointed(block):
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)


class _Stage(BlockCalls):
    def __init__(self, program: StepProgram, stage: int, received: Optional[Tensor], probing: bool) -> None:
        super().__init__(program)
        self.stage = stage
        self.first, self.stop = program.stage_bounds[stage]
        self.received = received
        self.probing = probing

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        program = self.program
        if index < self.first:
            return program.output_like(index, hidden)
        if index == self.first and self.received is not None:
            args, kwargs = replace_hidden(args, kwargs, at, self.received)
        elif index == self.first and self.probing and not isinstance(hidden, Ghost):
            args, kwargs = replace_hidden(args, kwargs, at, ghost_of(hidden))  # no real data reaches a block
        if not self.probing and contains_ghost(replace_hidden(args, kwargs, at, None)):
            raise _ghost_argument(program.backbone.blocks[index].name, args, kwargs, at, self.stage)
        out = program.run_block(index, block, args, kwargs)
        if index == self.stop - 1:
            raise Stop(program.hidden_of(index, out))
        return out


class _Answer(BlockCalls):
    def __init__(self, program: StepProgram, output: Any) -> None:
        super().__init__(program)
        self.output = output

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        if index < len(self.program.backbone) - 1:
            return self.program.output_like(index, hidden)
        return self.program.output_like(index, self.output)

    def on_backbone_end(self) -> None:
        if self.restore_prefix is not None:  # the code after the backbone reads the real tensors (e.g. a tied head)
            self.restore_prefix()
            self.restore_prefix = None



def _ghost_argument(block: str, args: tuple, kwargs: dict, at: HiddenAt, stage: int) -> BackboneCallError:
    named = [f"positional argument {i}" for i, a in enumerate(args) if contains_ghost(a) and ("arg", i) != at]
    named += [f"`{k}`" for k, v in kwargs.items() if contains_ghost(v) and ("kwarg", k) != at]
    return BackboneCallError(argument_not_on_stage(
        block, stage, f"its {', '.join(named) or 'arguments'} depend on values only the first stage computes (from its"
        " parameters, e.g. the embedding's output)"
    ))
