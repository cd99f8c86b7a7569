"""Measuring a real module for the planner: per backbone module, its cost, its parameter bytes and the bytes it
keeps for backward, as :func:`lightning_pipe.plan.search_plans` takes them.

Nothing here trains or allocates: parameters are counted where they live (the meta device included), and the
activations are measured by running a meta tensor through the backbone, which computes nothing.
:func:`lightning_pipe.plan.plan_for_module` plans with these numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch
    from torch import nn


def backbone_profile(
    lightning_module: nn.Module,
    backbone: Union[str, list[str]] = "auto",
    costs: Union[str, Sequence[float]] = "parameters",
    activation_bytes: Union[None, str, Sequence[float]] = "auto",
    example_input: Any = None,
    bytes_per_parameter: Optional[float] = None,
) -> tuple[list[float], list[float], Optional[list[float]]]:
    """``(costs, param_bytes, activation_bytes)`` per backbone module, as :func:`search_plans` takes them.

    Args:
        lightning_module: the module holding the backbone; it may live on the meta device.
        backbone: the backbone's container(s), as for ``PipelineStrategy`` (default ``"auto"``).
        costs: ``"parameters"`` (parameter counts stand in for time) or measured times per sample, one per module.
        activation_bytes: ``"auto"`` measures the bytes each module saves for backward per sample by running
            ``example_input`` (default: the module's ``example_input_array``) through the backbone on the meta
            device, which computes nothing; ``None`` leaves activations out; or one number per module.
        example_input: a tensor with a leading batch dimension, the backbone's input.
        bytes_per_parameter: overrides the parameters' own element size (e.g. 2 for ``precision="bf16-true"``).
    """
    from lightning_pipe._ghost import Ghost
    from lightning_pipe._model.backbone import find_backbone

    found = find_backbone(lightning_module, backbone)
    modules = [found.module(i) for i in range(len(found))]
    if any(isinstance(v, Ghost) for m in modules for v in vars(m).values()):
        raise ValueError("The backbone is already split by a PipelineStrategy; plan with an unsplit module.")
    counts = [float(sum(p.numel() for p in module.parameters())) for module in modules]
    param_bytes = [
        float(
            sum(
                p.numel() * (bytes_per_parameter if bytes_per_parameter else p.element_size())
                for p in module.parameters()
            )
        )
        for module in modules
    ]
    if isinstance(costs, str):
        if costs != "parameters":
            raise ValueError(f"`costs={costs!r}` must be 'parameters' or a list of times per sample, one per module.")
        module_costs = counts
    else:
        module_costs = [float(c) for c in costs]
        if len(module_costs) != len(modules):
            raise ValueError(f"`costs` has {len(module_costs)} entries but the backbone has {len(modules)} modules.")
    acts: Optional[list[float]]
    if isinstance(activation_bytes, str):
        if activation_bytes != "auto":
            raise ValueError(f"`activation_bytes={activation_bytes!r}` must be 'auto', None or one number per module.")
        if example_input is None:
            example_input = getattr(lightning_module, "example_input_array", None)
        acts = measure_activation_bytes(modules, example_input) if example_input is not None else None
    elif activation_bytes is None:
        acts = None
    else:
        acts = [float(a) for a in activation_bytes]
        if len(acts) != len(modules):
            raise ValueError(f"`activation_bytes` has {len(acts)} entries but the backbone has {len(modules)} modules.")
    return module_costs, param_bytes, acts


def measure_activation_bytes(modules: Sequence[nn.Module], example_input: Any) -> Optional[list[float]]:
    """Bytes each module of ``modules`` saves for backward, per sample, measured on the meta device.

    The input is run through the modules one after the other, twice, with batches of 1 and 2 built from
    ``example_input``'s per-sample shape and dtype; the difference is the per-sample part (weights saved for
    backward cancel out). Modules that are not on the meta device are copied there one at a time. Returns ``None``
    when it cannot be measured (an input that is not a single tensor, a block that needs other arguments, or an
    operation the meta device does not support).
    """
    import copy

    import torch

    if isinstance(example_input, (tuple, list)) and len(example_input) == 1:
        example_input = example_input[0]
    if not isinstance(example_input, torch.Tensor) or example_input.dim() == 0:
        return None
    sample_shape, dtype = tuple(example_input.shape[1:]), example_input.dtype
    meta = [
        m if all(t.is_meta for t in [*m.parameters(), *m.buffers()]) else copy.deepcopy(m).to("meta") for m in modules
    ]

    def saved(batch: int) -> list[float]:
        x: Any = torch.zeros((batch, *sample_shape), dtype=dtype, device="meta")
        out: list[float] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            out[-1] += t.numel() * t.element_size()  # counted against the module running now
            return t

        for module in meta:
            out.append(0.0)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = module(x)
        return out

    try:
        one, two = saved(1), saved(2)
    except Exception:  # an op without a meta kernel, or a module that needs more than one tensor
        return None
    return [max(0.0, b - a) for a, b in zip(one, two)]


def measure_module_times(
    modules: Sequence[nn.Module], example_input: Any, device: Union[str, torch.device] = "cpu", repeats: int = 3
) -> list[tuple[float, float, float]]:
    """Seconds per sample of each module's forward, input gradient and weight gradient on ``device``, for
    ``search_plans(costs=..., cost_split=...)`` (``python -m lightning_pipe.plan --measure``).

    ``example_input`` (a tensor with a leading batch dimension, the backbone's input) runs through the modules one
    after the other; each is timed on its input cut from the graph: the forward, the input gradient alone
    (``torch.autograd.grad``), then the whole backward, whose excess over the input gradient is the weight gradient.
    A module on the meta device is copied to ``device`` with random weights (only its speed counts); the median of
    ``repeats`` runs after one warm-up counts.
    """
    import copy
    import statistics
    import time

    import torch

    from lightning_pipe._model.profile import backward_times, synchronize

    device = torch.device(device)

    def real(module: nn.Module) -> nn.Module:
        if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            return module.to(device)
        module = copy.deepcopy(module).to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02) if p.is_floating_point() else p.zero_()
        return module

    if isinstance(example_input, (tuple, list)) and len(example_input) == 1:
        example_input = example_input[0]
    if not isinstance(example_input, torch.Tensor) or example_input.dim() == 0:
        raise ValueError("Timing the modules needs the backbone's input as one tensor with a batch dimension.")
    if example_input.is_meta:
        example_input = (torch.randn(example_input.shape, device=device).to(example_input.dtype)
                         if example_input.is_floating_point() else torch.zeros_like(example_input, device=device))
    batch = example_input.shape[0]
    x = example_input.to(device)
    times = []
    for module in modules:
        module = real(module)
        samples = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            synchronize(device)
            start = time.perf_counter()
            out = module(inp)
            synchronize(device)
            forward = time.perf_counter() - start
            loss = (out[0] if isinstance(out, (tuple, list)) else out).float().sum()
            input_grad, weight_grad = backward_times(loss, inp, device)
            module.zero_grad(set_to_none=True)
            samples.append((forward, input_grad, weight_grad))
        times.append(tuple(statistics.median(s[k] for s in samples[1:]) / batch for k in range(3)))
        x = (out[0] if isinstance(out, (tuple, list)) else out).detach()
    return times  # type: ignore[return-value]
