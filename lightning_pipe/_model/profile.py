"""Timing each backbone block, for ``balance="time"``.

:func:`measure_backbone` runs the user's step on one microbatch of a real batch, on the device training will use,
with each block timed (forward and backward) on its real arguments as the step calls it: each block is moved there
for its turn and moved back, so the whole backbone never has to fit on the device at once. The code before the
backbone is counted with the first block and the code after it (head, the ``training_step`` loss) with the last,
since those stages run it too: a cross-entropy over a large vocabulary costs as much as a block. Buffers (BatchNorm
statistics) and the random number generators are restored afterwards, metrics are set aside and gradients are
cleared: profiling leaves no trace in training.
"""

from __future__ import annotations

import statistics
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_map

from lightning_pipe._calls.batch import loss_of
from lightning_pipe._calls.blocks import Backbone
from lightning_pipe._calls.records import HiddenAt, Structure, replace_hidden
from lightning_pipe._calls.runners import BlockCalls, BlockRunners
from lightning_pipe._lightning.hooks import STEP_HOOKS, step_args
from lightning_pipe._lightning.log import LogRecorder
from lightning_pipe._model.untouched import untouched

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass(frozen=True)
class BlockCost:
    """One block's measured cost on one microbatch: seconds of forward, input gradient and weight gradient, and the
    bytes its forward saves for the backward (activations, not parameters). The code before the backbone counts with
    the first block (its backward as weight gradient), the code after it with the last (its backward as input
    gradient: it runs before anything can be deferred)."""

    forward: float
    input_grad: float
    weight_grad: float
    saved_bytes: int
    rows: int  # of the microbatch measured
    batch_size: int  # of the batch it was cut from

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad


def first_batch(
    module: pl.LightningModule, batch_to_device: Callable[[Any], Any]
) -> tuple[Callable[..., object], tuple]:
    """The step the running ``Trainer`` call runs, and the arguments Lightning's loop passes it for the first batch of
    its data (:func:`~lightning_pipe._lightning.hooks.step_args`), the batch on the device and after the batch
    transfer hooks, as the step sees it; the loaders' random state is left as it was."""
    trainer = module.trainer
    fn = trainer.state.fn
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[fn]
    loaders = loop._data_source.dataloader()  # the user's loader(s), before the loop starts
    # the loops count their loaders this way (``num_dataloaders``), once they have combined them
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "sequential")
    loader = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    with torch.random.fork_rng():
        batch = next(iter(loader))
    step = getattr(module, STEP_HOOKS[fn])
    return step, step_args(module, fn, batch_to_device(batch), len(combined.flattened))


def measure_backbone(
    module: pl.LightningModule,
    backbone: Backbone,
    structure: Structure,
    step: Callable[..., object],
    batch: Any,
    *,
    rest: tuple = (0,),
    device: torch.device,
    microbatches_for: Callable[[int], int],
    step_context: Callable[[], AbstractContextManager],
    repeats: int = 3,
    detail: bool = False,
) -> Union[list[float], list[BlockCost]]:
    """``balance="time"``: every block's forward+backward seconds, measured on global rank 0 on one microbatch of
    the first batch and shared with every rank (a collective). The code before the backbone is counted with the
    first block, the code after it (head, loss) with the last: those stages run it too.

    Args:
        rest: the step's arguments after the batch, as Lightning's loop passes them (:func:`first_batch`); the
            default is ``batch_idx=0``.
        detail: return a :class:`BlockCost` per block instead (forward, input and weight gradient apart, and the
            bytes saved for the backward), what ``schedule="auto"`` predicts from.
    """
    require_real_weights([module])  # every rank holds the whole model here, so every rank refuses
    costs: Optional[Union[list[float], list[BlockCost]]] = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        program = BlockRunners(module, backbone, structure, device)
        batch_size = program.batch_size_of(step, batch, *rest)
        rows = batch_size // microbatches_for(program.batch_rows_count)
        sub_args = (program.batch_rows(batch, batch_size, 0, rows), *rest)
        samples: list[_Profiled] = []
        with untouched(module, device, drop_grads=True), step_context():
            for attempt in range(repeats + 1):
                timed = _profile_step(program, step, sub_args, device)
                if attempt:  # the first run warms up
                    samples.append(timed)
        if detail:
            costs = [
                BlockCost(*(statistics.median(getattr(s, name)[i] for s in samples) for name in
                            ("forward", "input_grad", "weight_grad")), samples[-1].saved[i], rows,
                          batch_size)
                for i in range(len(program.backbone))
            ]
            shown = ", ".join(f"{c.forward * 1e3:.2f}/{c.input_grad * 1e3:.2f}/{c.weight_grad * 1e3:.2f}"
                              for c in costs)
            rank_zero_info(f"PipelineStrategy: forward/input-gradient/weight-gradient ms per block: {shown}")
        else:
            costs = [statistics.median(column) for column in zip(*(s.totals() for s in samples))]
            shown = ", ".join(f"{c * 1e3:.2f}" for c in costs)
            rank_zero_info(f"PipelineStrategy: forward+backward ms per block: {shown}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [costs]
        dist.broadcast_object_list(box, src=0)
        costs = box[0]
    assert costs is not None
    return costs


def _profile_step(program: BlockRunners, step: Callable[..., object], args: tuple, device: torch.device) -> _Profiled:
    """One run of ``step(*args)`` (one microbatch) with every block timed on ``device``; returns the timings."""
    run = _Profiled(program, device)
    with program.running(run):
        program.module.to(device)  # the blocks are runners now: this moves only what is outside the backbone
        synchronize(device)
        run.mark = time.perf_counter()
        with LogRecorder().installed(program.module):
            result = step(*args)
        synchronize(device)
        run.forward[-1] += time.perf_counter() - run.mark
        if torch.is_grad_enabled() and isinstance(result, (torch.Tensor, dict)):
            start = time.perf_counter()
            loss_of(result).backward()
            synchronize(device)
            run.input_grad[-1] += time.perf_counter() - start
    return run


class _Profiled(BlockCalls):
    """Times each block (forward and backward) on its real arguments, moving it to the device for the purpose."""

    def __init__(self, program: BlockRunners, device: torch.device) -> None:
        super().__init__(program)
        self.device = device
        n = len(program.backbone)
        self.forward, self.input_grad, self.weight_grad = [0.0] * n, [0.0] * n, [0.0] * n
        self.saved = [0] * n
        self.mark = 0.0

    def totals(self) -> list[float]:
        """Each block's forward+backward seconds (what ``balance="time"`` splits by)."""
        return [f + i + w for f, i, w in zip(self.forward, self.input_grad, self.weight_grad)]

    def on_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict, at: HiddenAt, hidden: Any) -> Any:
        if index == 0:  # the code before the backbone: its forward so far, and its backward
            synchronize(self.device)
            self.forward[0] += time.perf_counter() - self.mark
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                start = time.perf_counter()
                torch.autograd.backward(hidden, torch.ones_like(hidden))
                synchronize(self.device)
                self.weight_grad[0] += time.perf_counter() - start
        home = next((t.device for t in block.parameters()), None) or next((t.device for t in block.buffers()), None)
        block.to(self.device)
        detached = hidden.detach()
        inp = detached.requires_grad_(detached.is_floating_point()) if torch.is_grad_enabled() else detached
        # every tensor argument cut from the step's graph (an encoder's output reaches each decoder block through the
        # encoder's final norm: timing one block's backward must not run through it)
        cut = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
                       (args, kwargs))
        call_args, call_kwargs = replace_hidden(*cut, at, inp)
        weights = {t.data_ptr() for t in block.parameters()}
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in weights:
                saved[0] += t.numel() * t.element_size()
            return t

        with untouched(block, self.device, drop_grads=True):
            synchronize(self.device)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(*call_args, **call_kwargs)
            synchronize(self.device)
            self.forward[index] += time.perf_counter() - start
            if torch.is_grad_enabled():
                input_grad, weight_grad = backward_times(self.program.hidden_of(index, out).float().sum(), inp,
                                                         self.device)
                self.input_grad[index] += input_grad
                self.weight_grad[index] += weight_grad
            self.saved[index] = saved[0]
        # What the step goes on with: the timed call's output, cut from its graph. The block is not called twice, so
        # an argument with state (an encoder-decoder's cache of keys and values) sees each call once, as in the step.
        out = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        if home is not None:
            block.to(home)
        if index == len(self.program.backbone) - 1:  # the code after the backbone is timed from here
            last = self.program.hidden_of(index, out).detach()
            out = self.program.output_like(index, last.requires_grad_(last.is_floating_point()))
            synchronize(self.device)
            self.mark = time.perf_counter()
        return out



def backward_times(loss: torch.Tensor, inp: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds of ``loss``'s input gradient (with respect to ``inp``: what zero-bubble schedules run first) and weight
    gradient: the input gradient alone, then the whole backward, whose excess is the weight gradient. Runs the
    backward (the gradients accumulate)."""
    input_grad = 0.0
    if inp.requires_grad:
        start = time.perf_counter()
        torch.autograd.grad(loss, inp, retain_graph=True, allow_unused=True)
        synchronize(device)
        input_grad = time.perf_counter() - start
    start = time.perf_counter()
    loss.backward()
    synchronize(device)
    whole = time.perf_counter() - start
    return min(input_grad, whole), max(whole - input_grad, 0.0)


def require_real_weights(modules: list[nn.Module]) -> None:
    """Timing needs real weights: refuse modules on the meta device, naming the fix."""
    if any(p.is_meta for m in modules for p in m.parameters()):
        raise ValueError(
            "`PipelineStrategy(balance='time')` times every module with its real weights, but the model is on the"
            " meta device. Use `balance='parameters'`, or build the model on a real device."
        )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's), so that a clock read after it counts the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

