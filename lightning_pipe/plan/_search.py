"""The planner's search: every candidate plan of pipeline size, schedule, microbatch count, stage split and (when
the devices per node are given) tensor-parallel size, ranked by the cost model described in
:mod:`lightning_pipe.plan` (and ``docs/planner.md``).

The rest of the planner: ``_result`` (:class:`Plan`, byte sizes), ``_model`` (measuring a module) and ``_cli`` (the
command line); the ``"auto"`` microbatch rule is the strategy's own (``lightning_pipe._step.microbatches``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pipe._bytes import format_bytes
from lightning_pipe._simulate import MICROBATCH_OVERHEAD, OPTIMIZER_COPIES, StageCosts, peak_memory, simulate
from lightning_pipe._step.microbatches import check_positive, divisors, valid_num_microbatches
from lightning_pipe.partition import StageLayout, split_sizes
from lightning_pipe.plan._model import backbone_profile
from lightning_pipe.plan._result import Plan
from lightning_pipe.schedules import SCHEDULES

if TYPE_CHECKING:
    from torch import nn

#: The schedules the cost model knows: every one, each played in torch's own order of actions ([Note: schedule
#: simulation]).
PLANNED_SCHEDULES = tuple(SCHEDULES)
#: The search tries microbatch counts up to this many per pipeline process: beyond it the bubble is under 6% for
#: every schedule, and each microbatch adds its overhead.
MAX_MICROBATCHES_PER_RANK = 16
#: Ties in predicted time and memory go to the first.
_SCHEDULE_ORDER = {name: i for i, name in enumerate(("1F1B", "Interleaved1F1B", "ZBVZeroBubble",
                                                     "InterleavedZeroBubble", "DualPipeV", "GPipe", "LoopedBFS"))}


# ---------------------------------------------------------------------------------------------- the search
def search_plans(
    costs: Sequence[float],
    global_batch_size: int,
    devices: int,
    *,
    param_bytes: Optional[Sequence[float]] = None,
    activation_bytes: Optional[Sequence[float]] = None,
    memory_budget: Optional[float] = None,
    pipeline_parallel_size: Optional[int] = None,
    schedules: Sequence[str] = PLANNED_SCHEDULES,
    interleaved_stages_per_rank: int = 2,
    optimizer_multiplier: float = OPTIMIZER_COPIES,
    microbatch_overhead: float = MICROBATCH_OVERHEAD,
    devices_per_node: Optional[int] = None,
    max_tensor_parallel: int = 8,
    tensor_divisor: Optional[int] = None,
    tensor_parallel_overhead: float = 0.1,
    sequence_parallel: bool = False,
    cost_split: Sequence[float] = (1.0, 1.0, 1.0),
    transfer_time: float = 0.0,
    data_parallel_time_per_byte: float = 0.0,
) -> list[Plan]:
    """Every plan that fits, best (lowest predicted step time) first.

    Args:
        costs: per backbone module, the time of forward + backward of one sample, or a proxy such as its
            parameter count. Only ratios matter.
        global_batch_size: samples per optimizer step over all replicas; each of the ``data_parallel_size``
            replicas runs ``global_batch_size / data_parallel_size`` of them.
        devices: the number of processes (one device each).
        param_bytes: per module, its parameter bytes.
        activation_bytes: per module, the bytes it keeps for backward per sample.
        memory_budget: bytes one device may use; plans above it are dropped.
        pipeline_parallel_size: consider only this pipeline size (default: every divisor of ``devices``).
        schedules: the schedules to consider, among :data:`PLANNED_SCHEDULES`.
        interleaved_stages_per_rank: stages per process for Interleaved1F1B (used when the backbone has at least
            ``pipeline_parallel_size * interleaved_stages_per_rank`` modules).
        optimizer_multiplier: extra copies of the parameter bytes kept in training: gradients plus optimizer state.
            3 for Adam/AdamW (gradient, two moments), 2 for SGD with momentum, 1 for plain SGD.
        microbatch_overhead: fixed cost of running one microbatch through one stage, as a fraction of the ideal
            step time (``sum(costs) * global_batch_size / devices``). It keeps the search from always taking
            microbatches of one sample. 0 models free microbatches.
        devices_per_node: the devices of one node. Given, the search also tries tensor-parallel sizes (see
            :func:`tensor_parallel_sizes`): the ranks of one tensor-parallel group are consecutive, so they must fit
            in a node. ``None`` (default): no tensor parallelism.
        max_tensor_parallel: the largest tensor-parallel size to try.
        tensor_divisor: a number every tensor-parallel size must divide, such as the attention head count (each
            rank takes ``1/T`` of the heads and of every split matrix dimension); ``None``: no constraint.
        tensor_parallel_overhead: the communication of tensor parallelism (the all-reduces of the row-wise layers
            in forward and backward), as a fraction of a module's cost, times ``(T - 1) / T``.
        sequence_parallel: the tensor-parallel plan shards activations along the sequence between the split
            layers (``SequenceParallel`` norms, ``RowwiseParallel(output_layouts=Shard(1))``), so each tensor rank
            keeps about ``1/T`` of a block's activations and sends ``1/T`` of the activation to the next stage.
            ``False`` (default): activations are whole on every tensor rank.
        cost_split: how each module's cost divides into forward, input gradient and weight gradient (ratios; default
            equal, as for matrix products), or one such triple per module (``--measure`` gives them). The
            zero-bubble schedules defer the weight gradient; the others run input and weight gradient together.
        transfer_time: the time of sending one sample's activation from a stage to the next (its gradient back
            costs the same), in the units of ``costs``; 0 (default): transfers are free.
        data_parallel_time_per_byte: the time of the gradient all-reduce over the replicas per byte of gradient and
            per ``2 (d - 1) / d`` (a ring), in the units of ``costs``, added to the step; 0 (default): free.

    Raises:
        ValueError: if no plan is valid for the batch and devices, or none fits ``memory_budget`` (the message
            names the smallest memory any plan needs).
    """
    plans = _all_plans(
        costs,
        global_batch_size,
        devices,
        param_bytes=param_bytes,
        activation_bytes=activation_bytes,
        memory_budget=memory_budget,
        pipeline_parallel_size=pipeline_parallel_size,
        schedules=schedules,
        interleaved_stages_per_rank=interleaved_stages_per_rank,
        optimizer_multiplier=optimizer_multiplier,
        microbatch_overhead=microbatch_overhead,
        tensor_sizes=tensor_parallel_sizes(devices, devices_per_node, max_tensor_parallel, tensor_divisor),
        tensor_parallel_overhead=tensor_parallel_overhead,
        sequence_parallel=sequence_parallel,
        cost_split=cost_split,
        transfer_time=transfer_time,
        data_parallel_time_per_byte=data_parallel_time_per_byte,
    )
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: (p.predicted_memory_per_device, p.predicted_step_time))
        need = smallest.predicted_memory_per_device
        assert need is not None and memory_budget is not None
        tensor = f" x tensor-parallel {smallest.tensor_parallel_size}" if smallest.tensor_parallel_size > 1 else ""
        hint = " or consider tensor parallelism (`devices_per_node`)" if devices_per_node is None else ""
        raise ValueError(
            f"No plan fits the memory budget of {format_bytes(memory_budget)} ({int(memory_budget)} bytes) per"
            f" device: the smallest needs {format_bytes(need)} ({math.ceil(need)} bytes) per device"
            f" (pipeline {smallest.pipeline_parallel_size} x data-parallel {smallest.data_parallel_size}{tensor},"
            f" {smallest.schedule}, {smallest.num_microbatches} microbatches). Raise the budget to at least that,"
            f" add devices, use a smaller batch, turn on activation checkpointing{hint}."
        )
    return fitting


def plan_pipeline(costs: Sequence[float], global_batch_size: int, devices: int, **kwargs: Any) -> Plan:
    """The best plan: :func:`search_plans`'s first. Takes the same arguments."""
    return search_plans(costs, global_batch_size, devices, **kwargs)[0]


def tensor_parallel_sizes(
    devices: int, devices_per_node: Optional[int], max_tensor_parallel: int = 8, tensor_divisor: Optional[int] = None
) -> list[int]:
    """The tensor-parallel sizes the search tries: ``[1]`` without ``devices_per_node``; else the powers of two that
    divide ``devices_per_node`` (a group's ranks are consecutive, inside one node) and ``devices``, are at most
    ``max_tensor_parallel`` and divide ``tensor_divisor`` (e.g. the attention head count) when it is given."""
    if devices_per_node is None:
        return [1]
    check_positive("devices_per_node", devices_per_node)
    check_positive("max_tensor_parallel", max_tensor_parallel)
    if tensor_divisor is not None:
        check_positive("tensor_divisor", tensor_divisor)
    sizes, t = [], 1
    while t <= min(devices_per_node, max_tensor_parallel):
        if devices_per_node % t == 0 and devices % t == 0 and (tensor_divisor is None or tensor_divisor % t == 0):
            sizes.append(t)
        t *= 2
    return sizes


def _all_plans(
    costs: Sequence[float],
    global_batch_size: int,
    devices: int,
    *,
    param_bytes: Optional[Sequence[float]],
    activation_bytes: Optional[Sequence[float]],
    memory_budget: Optional[float],
    pipeline_parallel_size: Optional[int],
    schedules: Sequence[str],
    interleaved_stages_per_rank: int,
    optimizer_multiplier: float,
    microbatch_overhead: float,
    tensor_sizes: Sequence[int],
    tensor_parallel_overhead: float,
    sequence_parallel: bool = False,
    cost_split: Union[Sequence[float], Sequence[Sequence[float]]] = (1.0, 1.0, 1.0),
    transfer_time: float = 0.0,
    data_parallel_time_per_byte: float = 0.0,
) -> list[Plan]:
    n = len(costs)
    if n == 0:
        raise ValueError("The backbone has no modules: there is nothing to plan.")
    costs = [float(c) for c in costs]
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ValueError(f"Module costs must be non-negative numbers, got {costs}.")
    if sum(costs) == 0:
        costs = [1.0] * n  # nothing to tell modules apart: treat them as equal
    check_positive("global_batch_size", global_batch_size)
    check_positive("devices", devices)
    check_positive("interleaved_stages_per_rank", interleaved_stages_per_rank)
    for name, values in (("param_bytes", param_bytes), ("activation_bytes", activation_bytes)):
        if values is not None and len(values) != n:
            raise ValueError(f"`{name}` has {len(values)} entries but there are {n} module costs.")
    if min(optimizer_multiplier, microbatch_overhead, tensor_parallel_overhead, transfer_time,
           data_parallel_time_per_byte) < 0:
        raise ValueError(
            "`optimizer_multiplier`, `microbatch_overhead`, `tensor_parallel_overhead`, `transfer_time` and"
            " `data_parallel_time_per_byte` must be non-negative."
        )
    fractions = _fractions(cost_split, n)
    unknown = [s for s in schedules if s not in PLANNED_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"The planner models the schedules {list(PLANNED_SCHEDULES)}; got {list(schedules)}.")
    measured = param_bytes is not None or activation_bytes is not None
    if memory_budget is not None and not measured:
        raise ValueError("A `memory_budget` needs `param_bytes` and/or `activation_bytes` to check plans against.")
    if pipeline_parallel_size is not None:
        check_positive("pipeline_parallel_size", pipeline_parallel_size)
        if devices % pipeline_parallel_size:
            raise ValueError(
                f"`pipeline_parallel_size={pipeline_parallel_size}` does not divide the {devices} devices;"
                f" choose one of {divisors(devices)}."
            )
    weights = [float(x) for x in param_bytes] if param_bytes is not None else [0.0] * n
    acts = [float(x) for x in activation_bytes] if activation_bytes is not None else [0.0] * n
    ideal = sum(costs) * global_batch_size / devices
    overhead = microbatch_overhead * ideal
    splits: dict[int, list[int]] = {}
    plans: list[Plan] = []
    skipped: list[str] = []
    layouts = [(size, p) for size in tensor_sizes for p in divisors(devices // size)]  # tensor, pipeline sizes
    for t, p in layouts:
        if pipeline_parallel_size is not None and p != pipeline_parallel_size:
            continue
        dp = devices // (p * t)
        tensor = f"tensor-parallel {t}, " if t > 1 else ""
        if global_batch_size % dp:
            skipped.append(
                f"{tensor}pipeline {p}: the global batch {global_batch_size} does not split over {dp} replicas"
            )
            continue
        # each of the t ranks computes 1/t of every module plus the all-reduces, and holds 1/t of its weights
        scale = (1 + tensor_parallel_overhead * (t - 1)) / t
        b = global_batch_size // dp
        for schedule in schedules:
            spec = SCHEDULES[schedule]
            v = spec.fixed_stages_per_rank or interleaved_stages_per_rank
            if p == 1 and schedule != "1F1B":
                continue  # one stage: GPipe and interleaving only differ from 1F1B by keeping more in flight
            num_stages = p * v
            if num_stages > n:
                skipped.append(f"{tensor}pipeline {p} ({schedule}): {num_stages} stages but only {n} modules")
                continue
            if num_stages not in splits:
                splits[num_stages] = split_sizes(costs, num_stages, "parameters")
            sizes = splits[num_stages]
            bounds = _bounds(sizes)
            layout = StageLayout(tuple(bounds), p, spec.placement)
            stage_cost = [sum(costs[a:z]) * scale for a, z in bounds]
            # per sample: forward, input gradient, weight gradient of each stage
            stage_parts = [tuple(sum(costs[i] * fractions[i][k] for i in range(a, z)) * scale for k in range(3))
                           for a, z in bounds]
            stage_weights = [sum(weights[a:z]) / t for a, z in bounds]
            # whole on every tensor rank, unless sharded along the sequence
            stage_acts = [sum(acts[a:z]) / (t if sequence_parallel else 1) for a, z in bounds]
            # the gradient all-reduce of the replicas, after the last backward (a ring: 2 (d - 1) / d of the bytes)
            reduce = data_parallel_time_per_byte * 2 * (dp - 1) / dp * max(
                sum(stage_weights[s] for s in layout.rank_stages(r)) for r in range(p)
            )
            for m in divisors(b):
                if not valid_num_microbatches(m, p, v, schedule) or m > MAX_MICROBATCHES_PER_RANK * p:
                    continue
                rows = b / m
                run = simulate(
                    schedule, p, m, [StageCosts(*(x * rows for x in part)) for part in stage_parts],
                    transfer=transfer_time * rows / (t if sequence_parallel else 1), overhead=overhead / 2,
                )
                step = run.step_time + reduce
                bubble = run.bubble
                memory = state = activation = None
                fits = True
                if measured:
                    state, activation = peak_memory(
                        [layout.rank_stages(r) for r in range(p)], run.in_flight, stage_weights,
                        [a * rows for a in stage_acts], optimizer_copies=optimizer_multiplier,
                    )
                    memory = state + activation
                    if activation_bytes is None:
                        activation = None  # not counted, rather than zero
                    fits = memory_budget is None or memory <= memory_budget
                plans.append(
                    Plan(
                        pipeline_parallel_size=p,
                        data_parallel_size=dp,
                        num_microbatches=m,
                        schedule=schedule,
                        stages_per_rank=v,
                        balance=tuple(sizes),
                        predicted_bubble=bubble,
                        predicted_step_time=step,
                        predicted_memory_per_device=memory,
                        global_batch_size=global_batch_size,
                        ideal_step_time=ideal,
                        stage_costs=tuple(stage_cost),
                        state_memory=state,
                        activation_memory=activation,
                        fits=fits,
                        tensor_parallel_size=t,
                    )
                )
    if not plans:
        reasons = "; ".join(skipped) or "no pipeline size fits"
        raise ValueError(
            f"No valid plan for a global batch of {global_batch_size} on {devices} devices with {n} backbone modules:"
            f" {reasons}. Change the batch size, the device count or the schedules considered."
        )
    plans.sort(key=_rank_key)
    return plans


def _fractions(
    cost_split: Union[Sequence[float], Sequence[Sequence[float]]], n: int
) -> list[tuple[float, float, float]]:
    """Per module, the fractions of its cost that are forward, input gradient and weight gradient."""
    split = list(cost_split)
    triples = split if split and isinstance(split[0], (tuple, list)) else [split] * n
    if len(triples) != n or any(len(x) != 3 or min(x) < 0 or sum(x) <= 0 for x in triples):
        raise ValueError(
            f"`cost_split` must be three non-negative ratios (forward, input gradient, weight gradient), or one such"
            f" triple per module ({n}); got {cost_split!r}."
        )
    return [tuple(float(x) / sum(t) for x in t) for t in triples]  # type: ignore[misc]


def _rank_key(plan: Plan) -> tuple:
    memory = plan.predicted_memory_per_device or 0.0
    return (
        float(f"{plan.predicted_step_time:.9g}"),  # equal up to rounding: let memory decide
        float(f"{memory:.9g}"),
        _SCHEDULE_ORDER.get(plan.schedule, 9),
        plan.pipeline_parallel_size,
        plan.tensor_parallel_size,
        plan.num_microbatches,
    )


# ---------------------------------------------------------------------------------------------- modules
def plan_for_module(
    lightning_module: nn.Module,
    batch_size: int,
    devices: int,
    memory_budget: Optional[float] = None,
    backbone: Union[str, list[str]] = "auto",
    costs: Union[str, Sequence[float]] = "parameters",
    *,
    activation_bytes: Union[None, str, Sequence[float]] = "auto",
    example_input: Any = None,
    bytes_per_parameter: Optional[float] = None,
    **search_kwargs: Any,
) -> Plan:
    """The best plan for ``lightning_module``'s backbone.

    Args:
        lightning_module: the ``LightningModule`` (may be built on the meta device: nothing is computed).
        batch_size: the global batch size (samples per optimizer step over all replicas).
        devices: the number of processes.
        memory_budget: bytes one device may use, or ``None``.
        backbone: the backbone's container(s), as for ``PipelineStrategy`` (default ``"auto"``).
        costs: ``"parameters"`` or measured forward+backward times per sample, one per module.
        activation_bytes, example_input, bytes_per_parameter: see :func:`backbone_profile`.
        **search_kwargs: passed to :func:`search_plans` (``pipeline_parallel_size``, ``schedules``,
            ``optimizer_multiplier``, ``microbatch_overhead``, ``devices_per_node``, ``tensor_divisor``, ...).
    """
    module_costs, param_bytes, acts = backbone_profile(
        lightning_module, backbone, costs, activation_bytes, example_input, bytes_per_parameter=bytes_per_parameter
    )
    return plan_pipeline(
        module_costs,
        batch_size,
        devices,
        param_bytes=param_bytes,
        activation_bytes=acts,
        memory_budget=memory_budget,
        **search_kwargs,
    )


# ---------------------------------------------------------------------------------------------- helpers
def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
