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
- **capture** (:meth:`StepProgram.batch_size`): the code before the backbone runs on ghosts until the first block
  call, whose hidden state gives the batch size.

A block's hidden state is its first positional argument (or the keyword argument that carries the previous block's
output) and its output is that tensor, or a tuple/list whose first element is. What the setup learned about each
block call (:class:`~lightning_pipe._structure.Structure`) tells the runners where the hidden state is and what shape
of output a skipped block returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_pipe._backbone import Backbone, BackboneCallError
from lightning_pipe._ghost import Ghost, contains_ghost, ghost_of
from lightning_pipe._logging import LogRecorder

if TYPE_CHECKING:
    from lightning_pipe._structure import Structure

log = logging.getLogger(__name__)

#: ``("arg", position)`` or ``("kwarg", name)``: where a block call carries the hidden state.
HiddenAt = tuple[str, Any]


class _Stop(BaseException):
    """Ends the user's step early, carrying a value (a ``BaseException``, so ``except Exception`` lets it pass)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class Runner(nn.Module):
    """Stands in a backbone container for one block while a step runs under the pipeline.

    The block is not registered (the runner has no parameters of its own); attribute reads go to the block, so loop
    code such as ``layer.attention_type`` works.
    """

    def __init__(self, program: StepProgram, index: int, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_lp_program", program)
        object.__setattr__(self, "_lp_index", index)
        object.__setattr__(self, "_lp_block", block)

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
    """The mode-independent part of one run: order, hidden state and chain checks, and what the mode does."""

    def __init__(self, program: StepProgram) -> None:
        self.program = program
        self.next = 0
        self.chain: Any = None  # the hidden state the last block call produced
        self.after_backbone = False
        self.restore_prefix: Optional[Callable[[], None]] = None  # undoes the ghosting of the prefix's tensors

    def call_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        backbone = self.program.backbone
        if index != self.next:
            raise BackboneCallError(
                f"The step called block {index} (`{backbone.blocks[index].name}`) when block {self.next} was next."
                " `PipelineStrategy` runs each backbone block exactly once per step, in order: call the blocks"
                " once each, in the order the container holds them."
            )
        self.next += 1
        at = self.hidden_at(index, args, kwargs)
        hidden = get_hidden(args, kwargs, at)
        if index > 0 and hidden is not self.chain:
            prev = backbone.blocks[index - 1].name
            raise BackboneCallError(
                f"The hidden state that reaches `{backbone.blocks[index].name}` is not what `{prev}` returned: code"
                " between two blocks changes it (or, with several containers, code between them runs). A pipeline"
                " runs a stage's blocks back to back, so that code would be skipped. Move it into a block (or before"
                " or after the backbone), or choose other containers with `backbone=`."
            )
        out = self.on_block(index, block, args, kwargs, at, hidden)
        self.chain = self.program.hidden_of(index, out)
        if index == len(backbone) - 1:
            self.after_backbone = True
            self.on_backbone_end()
        return out

    def hidden_at(self, index: int, args: tuple, kwargs: dict) -> HiddenAt:
        return self.program.structure.hidden_at[index]

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        raise NotImplementedError

    def on_backbone_end(self) -> None:
        pass


class StepProgram:
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
        self.module = module
        self.backbone = backbone
        self.structure = structure
        self.stage_bounds = stage_bounds
        self.device = device
        self.checkpointed = checkpointed
        self.current: Optional[BlockCalls] = None
        self._runners = [Runner(self, i, backbone.module(i)) for i in range(len(backbone))]
        self._blocks = [backbone.module(i) for i in range(len(backbone))]
        # (owner, name, kind, real, ghost) of the held tensors the code before the backbone reads
        self._swaps = [
            (owner, name, kind, real, ghost_of(real, origin=name))
            for owner, name, kind in prefix_swaps
            for real in [getattr(owner, f"_{kind}s")[name]]
        ]
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
    def batch_size_of(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """The batch size of a step's call: the first dimension of the first block's hidden state."""
        with self.running(_Capture(self), ghost_prefix=True) as run:
            try:
                call_muted(self.module, step, args, kwargs)
            except _Stop as stop:
                hidden = stop.value
            else:
                raise never_called(run)
        if not isinstance(hidden, Tensor) or hidden.dim() == 0:
            raise BackboneCallError(
                "The first backbone block was called without a batched tensor as its hidden state. `PipelineStrategy`"
                " splits it along dimension 0 into microbatches: pass the hidden state as a tensor, batch first."
            )
        return int(hidden.shape[0])

    def run_stage(self, stage: int, rows: Tensor, received: Optional[Tensor], probing: bool = False) -> Tensor:
        """This rank's ``stage`` on the microbatch ``rows`` of the current batch: its blocks' hidden state.

        ``probing``: the run is on ghosts, to learn shapes (block arguments may then be ghosts too)."""
        assert self.step is not None
        run = _Stage(self, stage, received, probing)
        with self.running(run, ghost_prefix=received is not None or stage > 0):
            try:
                call_muted(self.module, self.step, (self.sub_batch(rows), *self.step_args), self.step_kwargs)
            except _Stop as stop:
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

    # ------------------------------------------------------------------------------------------------ helpers
    def hidden_of(self, index: int, out: Any) -> Any:
        """The hidden state in what block ``index`` returned."""
        return out if self.structure.outputs[index] is None else out[0]

    def output_like(self, index: int, hidden: Any) -> Any:
        """What block ``index`` returns, with ``hidden`` as its hidden state and ghosts for the rest."""
        extra = self.structure.outputs[index]
        if extra is None:
            return hidden
        kind, metas = extra
        rest = [None if m is None else ghost_of(m, self.device) for m in metas]
        return kind([hidden, *rest])

    def run_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.is_grad_enabled() and self.checkpointed(block):
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)

    @contextmanager
    def running(self, run: BlockCalls, ghost_prefix: bool) -> Iterator[BlockCalls]:
        if self.current is not None:
            raise RuntimeError("A pipelined step is already running in this process.")
        self.current = run
        for i, runner in enumerate(self._runners):
            self.backbone.set_module(i, runner)
        swapped = ghost_prefix and bool(self._swaps)
        if swapped:
            self._swap(ghost=True)
        run.restore_prefix = (lambda: self._swap(ghost=False)) if swapped else None
        try:
            yield run
        finally:
            if run.restore_prefix is not None:
                run.restore_prefix()
            for i, block in enumerate(self._blocks):
                self.backbone.set_module(i, block)
            self.current = None

    def _swap(self, ghost: bool) -> None:
        for owner, name, kind, real, stand_in in self._swaps:
            table = getattr(owner, f"_{kind}s")
            current, wanted = (real, stand_in) if ghost else (stand_in, real)
            if table.get(name) is not current:  # registered under another name since (pruning's `weight_orig`)
                name = next((key for key, value in table.items() if value is current), name)
            table[name] = wanted


class _Capture(BlockCalls):
    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        raise _Stop(hidden)


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
            raise _Stop(program.hidden_of(index, out))
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


# ---------------------------------------------------------------------------------------------------- helpers
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


def slice_batch(batch: Any, batch_size: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor or sequence in ``batch`` whose first dimension is ``batch_size``."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == batch_size else batch
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
        raise BackboneCallError(
            "The loss depends on values the last pipeline stage does not compute: something from before the backbone"
            " (computed from the first stage's parameters) or the output of a block other than the last is used"
            f" after the backbone ({loss!r}). Compute the loss from the backbone's output and the batch."
        )
    return loss


def call_muted(module: nn.Module, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    with LogRecorder().installed(module):  # the last stage logs the step once per microbatch, in its loss
        return step(*args, **kwargs)


def never_called(run: BlockCalls) -> BackboneCallError:
    backbone = run.program.backbone
    if run.next == 0:
        return BackboneCallError(
            f"The step finished without calling the pipelined backbone ({backbone.describe()}). With"
            " `PipelineStrategy`, each `training_step`/`validation_step`/`test_step`/`predict_step` must run the"
            " backbone (directly or through `forward`) once per batch."
        )
    return BackboneCallError(
        f"The step called only the first {run.next} of the {len(backbone)} backbone blocks; the next was"
        f" `{backbone.blocks[run.next].name}`. Every block must run once per step; remove unused blocks from the"
        " container, or name the containers to pipeline with `backbone=`."
    )


def _ghost_argument(block: str, args: tuple, kwargs: dict, at: HiddenAt, stage: int) -> BackboneCallError:
    named = [f"positional argument {i}" for i, a in enumerate(args) if contains_ghost(a) and ("arg", i) != at]
    named += [f"`{k}`" for k, v in kwargs.items() if contains_ghost(v) and ("kwarg", k) != at]
    return BackboneCallError(
        f"Block `{block}` runs on stage {stage}, but its {', '.join(named) or 'arguments'} depend on values only the"
        " first stage computes (from its parameters, e.g. the embedding's output). Only the hidden state travels"
        " between stages; a block's other arguments must be computable from the batch and buffers on every stage"
        " (masks, position ids, rotary tables). Compute them from the batch, or move that computation into the blocks."
    )
