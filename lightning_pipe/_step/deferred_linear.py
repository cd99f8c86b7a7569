"""Linear layers whose weight gradient waits for the schedule's weight-gradient action, compiled or not.

[Note: deferred weight gradients]
The schedules that split each backward (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) run a stage's
input gradient first, so the next stage can go on, and its weight gradient later, in the bubble. torch splits an eager
backward by walking the autograd graph twice (``stage_backward_input`` / ``stage_backward_weight``). A compiled block
is one autograd node whose compiled backward computes every gradient at once, so torch cannot split it
(pytorch#161904, torchtitan#3584): its input action would keep the graph for a second run, which a compiled backward
with donated buffers refuses.

So a stage with compiled blocks splits its backward inside the compiled graph, as the Zero Bubble paper's own code
does for linear layers (its ``WeightGradStore``), through torch's own hook for that, ``PipelineStage(dw_builder=)``:

- Each ``nn.Linear`` of the stage's blocks calls the custom op ``lightning_pipe::deferred_linear`` (the layer's class
  becomes :class:`DeferredLinear`; its parameters, their names and its ``state_dict`` do not change, and the class is
  put back when the call ends). Its forward is ``F.linear``. Its backward, traced into the compiled backward as any
  custom op's, returns the input gradient ``grad @ weight`` through a second opaque op,
  ``lightning_pipe::linear_input_grad``, which also hands ``(input, grad)`` to the stage's :class:`Deferral`, and
  returns no gradient for the weight and the bias. Opaque ops are neither duplicated nor removed by the compiler,
  and the input gradient is used, so the hand-over happens exactly once per backward.
- So does each of Hugging Face's ``Conv1D`` layers (GPT-2's ``x @ weight + bias``, the weight stored ``(in, out)``;
  its class becomes a deferring subclass of its own): it passes the op its weight transposed, a view, and its weight
  gradient is computed as ``input.T @ grad``, the formula of the eager backward of the ``addmm`` ``Conv1D`` runs.
- The input action runs the stage's whole backward with ``retain_graph=False`` (torch's ``dw_builder`` path): every
  gradient but the linear layers' weights and biases is computed there, and the compiled graph is freed.
- The weight action (``dw_builder``'s runner, in torch's order) computes each handed-over weight gradient as the
  eager backward of ``F.linear`` does, ``grad.T @ input`` over the flattened rows (and ``grad`` summed for the bias),
  in the parameter's dtype, and adds it to ``.grad``.

What waits costs memory, as torch's own split does (it keeps the graph until the weight action): a copy of each linear
layer's input and output gradient per microbatch whose weight action has not run, copies because the compiled
backward reuses its buffers once the op returns. A step that fails part-way drops what its unfinished microbatches
handed over (``StagePipeline._dropped_if_it_fails``).

That is exact: each parameter gets the same terms the unsplit backward computes, the linear layers' own computed by
the same formula, and a stage's weight actions run in the order of its input actions, so microbatches accumulate in
the same order. A weight several layers share (tied, pytorch#180952) gets each layer's term; a custom
``autograd.Function`` in a block (pytorch#166577) is only ever run as part of the whole backward.

A layer in a unit ``fully_shard`` made defers as any other: while the unit is unsharded the layer registers FSDP's
unsharded parameter, a plain one, which is what its call hands over, and the weight action adds to that parameter's
``.grad``, where the unit accumulates the step's gradients; under these schedules the units reduce-scatter after the
schedule (``ShardedStages.reduce``, as torch's ``perform_reduce_grad``), after every weight action. FSDP allocates the
unsharded parameters when a unit unshards (again after each forward with ``reshard_after_forward=True``), so the
addresses are looked up again where one is missing or no longer the parameter's (:func:`_owner`): a stale address
that another parameter took is never used. In fp32 that is exact as above. With FSDP's bf16 parameters
(``bf16-mixed``), a unit moves the bf16 gradients into its fp32 sum in its post-backward hook, in the input action;
the gradients the input action computes here and torch's eager split computes in the weight action (the norms') may
reach that sum at another hook, so bf16 rounds them in other groups: a run differs from torch's eager split in the
last bf16 digits, and is as far from the fp32 run as that split is (measured: losses within 6.2e-4 of fp32 against
the split's 8.6e-4).

Layers stay as they are where their weight gradient cannot wait: frozen (``requires_grad=False``); a call with
weights split over tensor ranks (``DTensor``), an input that needs no gradient (nothing to hand over) or a forward
without autograd runs plain ``F.linear``. Under autocast, the layer casts its input and parameters as autocast casts
``F.linear``'s, and the weight gradient is cast back to the parameter's dtype, as autograd's ``ToCopyBackward`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

#: A layer's weight and bias (``None`` without one), whose gradients a hand-over carries, and whether the weight is
#: stored ``(in, out)``.
Owners = tuple[nn.Parameter, Optional[nn.Parameter], bool]

#: The parameters of the swapped layers, by address: a call hands its layer's parameters over as tensors (the compiled
#: graph passes them through as inputs, so all blocks of a class share one graph), and the weight action finds the
#: parameter by the address of what it was handed; with whether it is stored ``(in, out)`` (``Conv1D``'s weight).
#: Rebuilt from :data:`_SWAPPED` where an address is missing or stale (FSDP's unsharded parameters are allocated
#: when a unit unshards, so they are known only then, and an address may come back for another parameter).
_PARAMS: dict[int, tuple[nn.Parameter, bool]] = {}
#: The layers swapped now, of every deferring stage of this process, a list per block (a ``fully_shard`` unit
#: unshards its parameters together).
_SWAPPED: list[list[nn.Module]] = []
#: The deferral collecting now, if any: a process runs one backward at a time, and autograd runs a CUDA backward on a
#: thread of its own, so this is not thread-local.
_ACTIVE: list[Deferral] = []


@torch.library.custom_op("lightning_pipe::deferred_linear", mutates_args=())
def _deferred_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_param: Tensor, bias_param: Optional[Tensor]
) -> Tensor:
    return F.linear(x, weight, bias).contiguous()


@_deferred_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_param: Tensor, bias_param: Optional[Tensor]) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("lightning_pipe::linear_input_grad", mutates_args=())
def _linear_input_grad(
    grad: Tensor, x: Tensor, weight: Tensor, weight_param: Tensor, bias_param: Optional[Tensor]
) -> Tensor:
    _hand_over(x, grad, weight_param, bias_param)
    return (grad @ weight).contiguous()


@_linear_input_grad.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, weight_param: Tensor, bias_param: Optional[Tensor]) -> Tensor:
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    x, weight, _, weight_param, bias_param = inputs
    ctx.save_for_backward(x, weight, weight_param, bias_param)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
    x, weight, weight_param, bias_param = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_x = torch.ops.lightning_pipe.linear_input_grad(grad, x, weight, weight_param, bias_param)
    return grad_x, None, None, None, None


_deferred_linear.register_autograd(_backward, setup_context=_setup_context)


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` whose weight and bias gradients wait for the weight action ([Note: deferred weight
    gradients]). Only the class changes: its parameters and buffers are the layer's own."""

    _lp_class: type[nn.Linear]

    def forward(self, input: Tensor) -> Tensor:
        weight_param, bias_param = weight, bias = self.weight, self.bias
        if not _defers(input, weight, bias):
            return F.linear(input, weight, bias)
        device = input.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            input, weight = input.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return torch.ops.lightning_pipe.deferred_linear(input, weight, bias, weight_param, bias_param)


class _DeferredConv1D:
    """Forward of Hugging Face's ``Conv1D`` (``transformers.pytorch_utils``) whose weight and bias gradients wait for
    the weight action; mixed into a subclass of the layer's own class (:func:`_deferred_class`)."""

    _lp_class: type[nn.Module]
    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    nf: int

    def forward(self, x: Tensor) -> Tensor:
        weight_param, bias_param = weight, bias = self.weight, self.bias
        if not _defers(x, weight, bias):
            return self._lp_class.forward(self, x)  # type: ignore[arg-type]
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as autocast casts `torch.addmm`'s arguments
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.lightning_pipe.deferred_linear(rows, weight.t(), bias, weight_param, bias_param)
        return out.view(*x.shape[:-1], self.nf)


_CONV1D_CLASSES: dict[type, type] = {}


def _is_conv1d(layer: nn.Module) -> bool:
    cls = type(layer)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(layer, "nf")


def _deferred_class(layer: nn.Module) -> type:
    if type(layer) is nn.Linear:
        return DeferredLinear
    cls = type(layer)
    if cls not in _CONV1D_CLASSES:
        _CONV1D_CLASSES[cls] = type(f"Deferred{cls.__name__}", (_DeferredConv1D, cls), {})
    return _CONV1D_CLASSES[cls]


def _deferrable(layer: nn.Module) -> bool:
    """A plain linear layer (or ``Conv1D``) whose parameters all train. Its weight may be a ``DTensor`` here: a
    sharded unit's, which the forward sees unsharded (a plain parameter) and defers, or a tensor-parallel one, which
    it runs plainly (:func:`_defers`)."""
    if type(layer) is not nn.Linear and not _is_conv1d(layer):
        return False
    weight, bias = layer.weight, layer.bias
    return isinstance(weight, nn.Parameter) and weight.requires_grad and (bias is None or bias.requires_grad)


def _defers(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a swapped layer's call defers its weight gradient: under autograd, with an input that needs a gradient
    (else there is nothing to hand over) and parameters that are not split over tensor ranks (a ``DTensor``'s
    gradient is DTensor's own backward's)."""
    return (torch.is_grad_enabled() and x.requires_grad and weight.requires_grad
            and (bias is None or bias.requires_grad) and not isinstance(weight, DTensor))


@contextmanager
def deferred_linears(blocks: Iterable[nn.Module]) -> Iterator[int]:
    """Inside, the plain ``nn.Linear`` layers (and Hugging Face ``Conv1D`` layers) of ``blocks`` that can defer their
    weight gradients are :class:`DeferredLinear` (a deferring subclass of their class); yields how many."""
    groups: list[list[nn.Module]] = []
    for block in blocks:
        group = []
        for layer in block.modules():
            if _deferrable(layer):
                deferred = _deferred_class(layer)
                layer._lp_class = type(layer)  # type: ignore[assignment]
                layer.__class__ = deferred
                group.append(layer)
        if group:
            groups.append(group)
    _SWAPPED.extend(groups)
    _refresh(full=True)
    try:
        yield sum(len(group) for group in groups)
    finally:
        for group in groups:
            for layer in group:
                layer.__class__ = layer._lp_class
                del layer._lp_class
        gone = {id(group) for group in groups}
        _SWAPPED[:] = [group for group in _SWAPPED if id(group) not in gone]
        _refresh(full=True)


def _refresh(full: bool = False) -> None:
    """:data:`_PARAMS` from the parameters the swapped layers register now: FSDP's unsharded ones while their unit is
    unsharded (its sharded ``DTensor`` ones are never handed over), a storage freed by resharding left out. Unless
    ``full``, only the blocks whose first parameter is not registered as it is now (a unit unsharded since; with
    ``reshard_after_forward=True`` that is one block per lookup, not every block); stale entries stay, and
    :func:`_owner` never takes one."""
    if full:
        _PARAMS.clear()
    for group in _SWAPPED:
        first = group[0].weight
        if not full and (isinstance(first, DTensor) or _PARAMS.get(first.data_ptr(), (None,))[0] is first):
            continue
        for layer in group:
            for param, transposed in ((layer.weight, isinstance(layer, _DeferredConv1D)), (layer.bias, False)):
                if param is not None and not isinstance(param, DTensor) and param.data_ptr() != 0:
                    _PARAMS[param.data_ptr()] = (param, transposed)


class Deferral:
    """One stage's weight gradients handed over by its input actions, in their order. :meth:`collecting` wraps an
    input action's backward; :meth:`builder` is ``PipelineStage``'s ``dw_builder``: called right after that backward,
    it returns the runner of the stage's weight action for that microbatch."""

    def __init__(self) -> None:
        self._collected: list[tuple[Owners, Tensor, Tensor]] = []

    @contextmanager
    def collecting(self) -> Iterator[None]:
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()

    def take(self, owners: Owners, x: Tensor, grad: Tensor) -> None:
        self._collected.append((owners, x, grad))

    def builder(self) -> Callable[[], None]:
        collected, self._collected = self._collected, []
        return lambda: _apply(collected)

    def clear(self) -> None:
        """A step that failed half-way leaves nothing for the next."""
        self._collected = []


def _hand_over(x: Tensor, grad: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    weight_param, transposed = _owner(weight)
    owners = (weight_param, _owner(bias)[0] if bias is not None else None, transposed)
    if not _ACTIVE:  # a backward outside a stage's input action: nothing waits
        _apply([(owners, x, grad)])
    else:  # copies: the compiled backward reuses its buffers once the op returns
        _ACTIVE[-1].take(owners, x.detach().clone(), grad.detach().clone())


def _owner(tensor: Tensor) -> tuple[nn.Parameter, bool]:
    address = tensor.data_ptr()
    param = _current(address)
    if param is None:  # a unit unsharded since, or its storage reused
        _refresh()
        param = _current(address)
    if param is None:  # a block of several units: every block looked at again
        _refresh(full=True)
        param = _current(address)
    if param is None:
        raise RuntimeError(
            "lightning_pipe: a linear layer's parameter moved in memory after its weight gradient was deferred to the"
            " schedule's weight action ([Note: deferred weight gradients]); do not replace parameters during a step"
        )
    return param


def _current(address: int) -> Optional[tuple[nn.Parameter, bool]]:
    """The parameter at ``address`` now, if a swapped layer registers it."""
    param = _PARAMS.get(address)
    return param if param is not None and param[0].data_ptr() == address else None


def _apply(collected: list[tuple[Owners, Tensor, Tensor]]) -> None:
    """The weight and bias gradients of ``F.linear``'s eager backward (of ``addmm``'s for a weight stored ``(in,
    out)``), added to ``.grad`` in the order handed over."""
    for (weight, bias, transposed), x, grad in collected:
        rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        _accumulate(weight, inputs.t().mm(rows) if transposed else rows.t().mm(inputs))
        if bias is not None:
            _accumulate(bias, rows.sum(0))


def _accumulate(param: Tensor, grad: Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
