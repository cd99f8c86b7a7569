r"""How a step calls the backbone's blocks, and the machinery that stands in for them while a step runs.

What the setup learns about a step's block calls is a :class:`Structure` (:mod:`lightning_pipe._model.structure` learns
it). While a step runs under the pipeline, the backbone's containers hold :class:`Runner`\ s instead of the blocks
(:class:`BlockRunners`): each block call goes to the run in progress, a :class:`BlockCalls` whose mode decides what
the call does. The setup's analysis and the ``balance="time"`` profile are modes of their own; the per-batch modes
(a stage, the last stage's answer) are :class:`~lightning_pipe._step.program.StepProgram`'s. The capture mode,
:meth:`BlockRunners.batch_size_of`, serves both: the first block's hidden state gives the batch size.

A block's hidden state is its first positional argument (or the keyword argument that carries the previous block's
output) and its output is that tensor, or a tuple/list whose first element is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._errors import BackboneCallError, not_computed_by_last_stage
from lightning_pipe._ghost import Ghost, ghost_of
from lightning_pipe._lightning.log import LogRecorder
from lightning_pipe._model.backbone import Backbone

#: ``("arg", position)`` or ``("kwarg", name)``: where a block call carries the hidden state.
HiddenAt = tuple[str, Any]

#: What a block returns besides its hidden state: ``None`` for a tensor, else ``(tuple or list, metas of the rest)``.
OutputKind = Optional[tuple[type, tuple[Optional[Tensor], ...]]]


@dataclass
class Structure:
    """What the setup learned about one step (see the module docstring)."""

    hidden_at: list[HiddenAt]
    outputs: list[OutputKind]
    prefix_params: set[int] = field(default_factory=set)  # ids of parameters read before the backbone
    prefix_modules: set[int] = field(default_factory=set)  # ids of modules called before the backbone
    post_params: set[int] = field(default_factory=set)  # ids of parameters read after it (as far as it ran)
    param_extras: dict[int, list[str]] = field(default_factory=dict)  # block -> its arguments that need parameters


class Stop(BaseException):
    """Ends the user's step early, carrying a value (a ``BaseException``, so ``except Exception`` lets it pass)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


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

    def __init__(self, program: BlockRunners) -> None:
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
        at = self.locate_hidden(index, args, kwargs)
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

    def locate_hidden(self, index: int, args: tuple, kwargs: dict) -> HiddenAt:
        """Where this call carries the hidden state (setup learned it; the analysis overrides this to learn it)."""
        return self.program.structure.hidden_at[index]

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        raise NotImplementedError

    def on_backbone_end(self) -> None:
        pass


class BlockRunners:
    r"""The backbone of ``module`` with its blocks swapped for :class:`Runner`\ s while a run is in progress.

    Args:
        module: the LightningModule.
        backbone: its backbone.
        structure: what the setup learned about the step's block calls (a blank one while it learns).
        device: this rank's device.
        prefix_swaps: the parameters and buffers this rank holds that the code before the backbone uses: runs with
            ``ghost_prefix`` see ghosts in their place until the backbone ends (the stage program's; none elsewhere).
    """

    def __init__(
        self,
        module: nn.Module,
        backbone: Backbone,
        structure: Structure,
        device: Any,
        prefix_swaps: Sequence[tuple[nn.Module, str, str]] = (),
    ) -> None:
        self.module = module
        self.backbone = backbone
        self.structure = structure
        self.device = device
        self.current: Optional[BlockCalls] = None
        self._runners = [Runner(self, i, backbone.module(i)) for i in range(len(backbone))]
        self._blocks = [backbone.module(i) for i in range(len(backbone))]
        # (owner, name, kind, real, ghost) of the held tensors the code before the backbone reads
        self._swaps = [
            (owner, name, kind, real, ghost_of(real, origin=name))
            for owner, name, kind in prefix_swaps
            for real in [getattr(owner, f"_{kind}s")[name]]
        ]
        self._displaced: list[tuple[dict, str, Any]] = []  # what the stand-ins replaced, put back after

    def batch_size_of(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """The batch size of a step's call: the first dimension of the first block's hidden state."""
        with self.running(_Capture(self), ghost_prefix=True) as run:
            try:
                call_muted(self.module, step, args, kwargs)
            except Stop as stop:
                hidden = stop.value
            else:
                raise never_called(run)
        if not isinstance(hidden, Tensor) or hidden.dim() == 0:
            raise BackboneCallError(
                "The first backbone block was called without a batched tensor as its hidden state. `PipelineStrategy`"
                " splits it along dimension 0 into microbatches: pass the hidden state as a tensor, batch first."
            )
        return int(hidden.shape[0])

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

    @contextmanager
    def running(self, run: BlockCalls, ghost_prefix: bool) -> Iterator[BlockCalls]:
        """Swap the runners in and make ``run`` the run in progress for the block (one at a time per process)."""
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
        """Put the stand-ins in (``ghost``) or what they displaced back. What is registered may no longer be the
        tensor captured at setup: a sharded stage registers its unsharded parameters while unsharded."""
        if not ghost:
            for table, name, value in reversed(self._displaced):
                table[name] = value
            self._displaced = []
            return
        self._displaced = []
        for owner, name, kind, real, stand_in in self._swaps:
            table = getattr(owner, f"_{kind}s")
            if name not in table:  # registered under another name since (pruning's `weight_orig`)
                name = next((key for key, value in table.items() if value is real), name)
            self._displaced.append((table, name, table.get(name)))
            table[name] = stand_in
            if isinstance(real, DTensor):  # split over the tensor ranks: its style's hooks cannot take ghosts
                for hooks in ("_forward_pre_hooks", "_forward_hooks"):
                    self._displaced.append((vars(owner), hooks, vars(owner)[hooks]))
                    vars(owner)[hooks] = OrderedDict()


class _Capture(BlockCalls):
    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        raise Stop(hidden)



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
        raise BackboneCallError(not_computed_by_last_stage(
            "The loss depends on values", "Compute the loss from the backbone's output and the batch.", loss
        ))
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


