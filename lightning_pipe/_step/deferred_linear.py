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

A layer split over tensor ranks (``DTensor`` weight and input) defers too, where its layout is one DTensor's own
``F.linear`` runs as ``F.linear`` of the local parts: split by output features (``ColwiseParallel``: weight and bias
``Shard(0)``, input replicated, output ``Shard(-1)``) or by input features (``RowwiseParallel``: weight ``Shard(1)``,
input ``Shard(-1)``, output ``Partial``, to which each rank adds its share of the replicated bias, the bias divided by
the tensor ranks as DTensor divides it). The op runs on the local parts, and its output and input gradient are wrapped
in the placements DTensor's backward gives them (the input's gradient ``Partial`` where the input is replicated), so the
collectives of the layer's ``ParallelStyle`` run as before, in the input action. The local weight and bias gradients
are computed by the same formula from the local input and the local output gradient (replicated over the tensor ranks
for a ``Partial`` output, so a replicated bias gets the same sum on every rank), and added to ``.grad`` in the
parameter's placements. That is DTensor's own computation, term for term (measured bit for bit against eager DTensor,
fp32 and bf16 autocast, with and without bias and sequence parallelism). FSDP's unsharded parameters of a split layer
are DTensors over the tensor ranks; both are looked up by their local part's address.

Layers stay as they are where their weight gradient cannot wait: frozen (``requires_grad=False``); a call whose layout
is split in any other way (or a split ``Conv1D``; :func:`undeferred_split_layers` names them at setup), an input that
needs no gradient (nothing to hand over) or a forward without autograd runs plain ``F.linear``. Under autocast, the
layer casts its input and parameters as autocast casts ``F.linear``'s, and the weight gradient is cast back to the
parameter's dtype, as autograd's ``ToCopyBackward`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from lightning_pipe._parallel_dims import TENSOR, is_tensor_parallel

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
        weight, bias = self.weight, self.bias
        if isinstance(weight, DTensor):
            return _split_linear(input, weight, bias)
        if not _defers(input, weight, bias):
            return F.linear(input, weight, bias)
        return _local_linear(input, weight, bias)


def _local_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], shared_over: Optional[DeviceMesh] = None
) -> Tensor:
    """``F.linear`` on plain tensors through the deferring op, cast as autocast casts ``F.linear``'s arguments. With
    ``shared_over``, the output is this rank's part of a sum over that mesh and the bias is replicated over it: the
    op adds this rank's share of it, as DTensor's ``F.linear`` does (from ``Replicate`` to ``Partial``)."""
    weight_param, bias_param = weight, bias
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if shared_over is not None and bias is not None:
        bias = bias.detach() / shared_over.size()  # DTensor's share of a sum (`Partial._partition_value`)
    return torch.ops.lightning_pipe.deferred_linear(x, weight, bias, weight_param, bias_param)


def _split_linear(x: Tensor, weight: DTensor, bias: Optional[Tensor]) -> Tensor:
    """A layer split over tensor ranks ([Note: deferred weight gradients]): DTensor's ``F.linear`` computes each
    rank's part of the output as ``F.linear`` of the local parts, so the op runs on them, and the gradients of the
    local parts are the local parts of the layer's gradients.

    - Split by output features (``ColwiseParallel``: weight and bias ``Shard(0)``, input replicated): the output is
      ``Shard(-1)``; the input's gradient, each rank's part of a sum, is ``Partial``, as DTensor's backward leaves it.
    - Split by input features (``RowwiseParallel``: weight ``Shard(1)``, input ``Shard(-1)``, bias replicated): the
      output is ``Partial``, each rank adding its share of the bias; the output's gradient comes back replicated, so
      the bias's (the rows' sum) is the same on every rank, ``Replicate`` as the bias.

    Any other layout, or a call with nothing to hand over, runs DTensor's ``F.linear``."""
    style = _split_style(x, weight, bias)
    if style is None or not (torch.is_grad_enabled() and x.requires_grad and weight.requires_grad
                             and (bias is None or bias.requires_grad)):
        return F.linear(x, weight, bias)
    mesh, local_bias = weight.device_mesh, bias.to_local() if bias is not None else None
    if style == "colwise":
        out = _local_linear(x.to_local(grad_placements=[Partial()]), weight.to_local(), local_bias)
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
    out = _local_linear(x.to_local(grad_placements=[Shard(x.dim() - 1)]), weight.to_local(), local_bias, mesh)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def _split_style(x: Tensor, weight: DTensor, bias: Optional[Tensor]) -> Optional[str]:
    """``"colwise"`` or ``"rowwise"`` where a call's layout is one :func:`_split_linear` defers, else ``None``."""
    if weight.device_mesh.ndim != 1 or not isinstance(x, DTensor) or x.device_mesh != weight.device_mesh:
        return None
    if bias is not None and (not isinstance(bias, DTensor) or bias.device_mesh != weight.device_mesh):
        return None
    (placement,), (x_placement,) = weight.placements, x.placements
    if placement == Shard(0) and x_placement == Replicate() and (bias is None or bias.placements == (Shard(0),)):
        return "colwise"
    if (placement == Shard(1) and x_placement == Shard(x.dim() - 1)
            and (bias is None or bias.placements == (Replicate(),))):
        return "rowwise"
    return None


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
    sharded unit's, which the forward sees unsharded and defers, or a tensor-parallel one, which defers in the layouts
    :func:`_split_linear` knows."""
    if type(layer) is not nn.Linear and not _is_conv1d(layer):
        return False
    weight, bias = layer.weight, layer.bias
    return isinstance(weight, nn.Parameter) and weight.requires_grad and (bias is None or bias.requires_grad)


def _defers(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a swapped layer's call on plain parameters (for a ``Conv1D``, not split over tensor ranks either)
    defers its weight gradient: under autograd, with an input that needs a gradient (else there is nothing to hand
    over)."""
    return (torch.is_grad_enabled() and x.requires_grad and weight.requires_grad
            and (bias is None or bias.requires_grad) and not isinstance(weight, DTensor))


def undeferred_split_layers(blocks: Iterable[nn.Module]) -> list[str]:
    """The names of the linear layers of ``blocks`` split over tensor ranks in a layout whose weight gradient cannot
    wait (:func:`_split_linear`: a ``Conv1D``, or a split neither by output nor by input features): DTensor's own
    backward computes theirs, in the input action. Read off the parameters (sharded ones too: their placement over
    the tensor ranks is the layer's)."""
    names = set()
    for block in blocks:
        for name, layer in block.named_modules():
            weight = _split_over_tensor_ranks(layer.weight) if _deferrable(layer) else None
            if weight is None:
                continue
            bias = _split_over_tensor_ranks(layer.bias)
            colwise = weight == Shard(0) and (layer.bias is None or bias == Shard(0))
            rowwise = weight == Shard(1) and bias is None  # the bias replicated, or none
            if _is_conv1d(layer) or not (colwise or rowwise):
                names.add(name)
    return sorted(names)


def _split_over_tensor_ranks(param: Optional[Tensor]) -> Optional[Placement]:
    """A parameter's placement over the tensor ranks, if it is split over several (else ``None``)."""
    if not isinstance(param, DTensor) or not is_tensor_parallel(param.device_mesh):
        return None
    placement = param.placements[list(param.device_mesh.mesh_dim_names or ()).index(TENSOR)]
    return None if isinstance(placement, Replicate) else placement


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
    """:data:`_PARAMS` from the parameters the swapped layers register now, by their local part's address: FSDP's
    unsharded ones while their unit is unsharded (its sharded ones are never handed over), a storage freed by
    resharding left out. Unless ``full``, only the blocks whose first parameter is not registered as it is now (a
    unit unsharded since; with ``reshard_after_forward=True`` that is one block per lookup, not every block); stale
    entries stay, and :func:`_owner` never takes one."""
    if full:
        _PARAMS.clear()
    for group in _SWAPPED:
        first = group[0].weight
        if not full and _PARAMS.get(_address(first), (None,))[0] is first:
            continue
        for layer in group:
            for param, transposed in ((layer.weight, isinstance(layer, _DeferredConv1D)), (layer.bias, False)):
                if param is not None and _address(param) != 0:
                    _PARAMS[_address(param)] = (param, transposed)


def _address(param: Tensor) -> int:
    """Where a parameter's values are: a ``DTensor``'s, its local part's (what a split layer's call hands over)."""
    if isinstance(param, DTensor):
        with torch.no_grad():  # the local part itself, not a view that autograd records
            return param.to_local().data_ptr()
    return param.data_ptr()


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
    return param if param is not None and _address(param[0]) == address else None


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
    if isinstance(param, DTensor):  # a split layer's local gradient: its parameter's part, in its layout
        grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
