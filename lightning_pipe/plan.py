"""A planner for :class:`~lightning_pipe.PipelineStrategy`: which pipeline size, schedule, microbatch count and
stage split to use for a backbone on a given number of devices.

The cost model and the search are pure Python (no ``torch.distributed``, no processes): they take a cost per
backbone module and, optionally, its parameter and activation bytes, and rank every candidate plan by predicted
step time among those that fit a per-device memory budget. :func:`plan_for_module` measures those numbers on a
``LightningModule`` (on the meta device when it was built there), and ``python -m lightning_pipe.plan --config
cfg.yaml`` does the same for a LightningCLI config file. :func:`default_num_microbatches` is the rule behind
``PipelineStrategy(num_microbatches="auto")``. The model, its formulas and its assumptions are in
``docs/planner.md``.

Cost model, for ``p`` processes per pipeline, ``v`` stages per process (``S = p * v`` stages), ``m`` microbatches
of a per-replica batch ``b`` (global batch ``B = b * data_parallel_size``):

* step time ``T = (v*m + p - 1) * (c_max * b / m + o)``: ``c_max`` is the slowest stage's cost per sample, ``o``
  a fixed overhead per microbatch and stage (``microbatch_overhead`` times the ideal step time
  ``sum(costs) * B / devices``), so that ever more microbatches are not free;
* bubble ``(p - 1) / (v*m + p - 1)``: the idle fraction of the step;
* memory of a process: its parameter bytes times ``1 + optimizer_multiplier`` (gradients and optimizer state;
  3 for Adam) plus the activations of the microbatches in flight: ``min(m, p - r)`` on pipeline rank ``r`` for
  1F1B, ``m`` for GPipe, and torch's warm-up count for Interleaved1F1B.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pipe.partition import split_sizes

if TYPE_CHECKING:
    from torch import nn

#: The schedules the cost model knows (the ones whose timing and memory it models).
PLANNED_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
_MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
_ROUNDS_RULE = ("Interleaved1F1B", "InterleavedZeroBubble")  # torch: m % max(1, m // p) == 0
_SCHEDULE_ORDER = {"1F1B": 0, "Interleaved1F1B": 1, "GPipe": 2}

#: Largest bubble ``num_microbatches="auto"`` aims for (reached with ``m >= 4 * p / v``).
TARGET_BUBBLE = 0.2


# ---------------------------------------------------------------------------------------------- the auto rule
def microbatch_target(pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None) -> int:
    """The microbatch count ``num_microbatches="auto"`` aims for: ``p * ceil(4 / v)``, or 1 when ``p == 1``.

    With ``m = 4p`` (one stage per process) the 1F1B bubble is ``(p-1)/(5p-1) < 20%``; with ``v`` stages per
    process the bubble shrinks by ``v``, so ``m = p * ceil(4/v)`` does as well. A multiple of ``p`` satisfies every
    torch schedule's own constraint (1F1B: ``m >= p``; interleaved: ``m`` a multiple of ``max(1, m // p)``);
    DualPipeV, which needs a microbatch per stage, gets at least ``p * v``.
    """
    _check_positive("pipeline_parallel_size", pipeline_parallel_size)
    _check_positive("stages_per_rank", stages_per_rank)
    target = 1 if pipeline_parallel_size == 1 else pipeline_parallel_size * math.ceil(4 / stages_per_rank)
    if schedule == "DualPipeV":
        target = max(target, pipeline_parallel_size * stages_per_rank)
    return target


def valid_num_microbatches(
    num_microbatches: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> bool:
    """Whether torch's ``schedule`` accepts ``num_microbatches`` for this pipeline.

    ``schedule=None`` checks the constraints of the default schedules: ``m >= p`` for one stage per process
    (1F1B), the interleaved rounds rule for several.
    """
    m, p, v = num_microbatches, pipeline_parallel_size, stages_per_rank
    if m < 1:
        return False
    if schedule is None:
        schedule = "1F1B" if v == 1 else "Interleaved1F1B"
    if schedule == "1F1B" and m < p:
        return False
    if schedule == "DualPipeV" and m < p * v:
        return False
    if schedule in _ROUNDS_RULE and m % max(1, m // p):
        return False
    return True


def default_num_microbatches(
    batch_size: int, pipeline_parallel_size: int, stages_per_rank: int = 1, schedule: Optional[str] = None
) -> int:
    """The microbatch count of ``PipelineStrategy(num_microbatches="auto")`` for a batch of ``batch_size``.

    The rule: among the divisors of ``batch_size`` that ``schedule`` accepts (see :func:`valid_num_microbatches`),
    the smallest one at least :func:`microbatch_target` (``4p`` for one stage per process, ``2p`` for two: a bubble
    under 20%); if the batch is too small for that, the largest accepted one below it. Every microbatch then has
    the same number of samples, at least one. With ``pipeline_parallel_size == 1`` there is nothing to overlap
    and the answer is 1 (2 for DualPipeV, which needs a microbatch per stage).

    Raises:
        ValueError: if no count works, e.g. a 1F1B batch smaller than the pipeline.
    """
    _check_positive("batch_size", batch_size)
    target = microbatch_target(pipeline_parallel_size, stages_per_rank, schedule)
    accepted = [
        d for d in _divisors(batch_size) if valid_num_microbatches(d, pipeline_parallel_size, stages_per_rank, schedule)
    ]
    if not accepted:
        smallest = pipeline_parallel_size * (stages_per_rank if schedule == "DualPipeV" else 1)
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into microbatches for schedule"
            f" {schedule or ('1F1B' if stages_per_rank == 1 else 'Interleaved1F1B')!r} on a pipeline of"
            f" {pipeline_parallel_size} processes: it needs at least {smallest} microbatches of one sample or more."
            f" Raise the batch size to at least {smallest} (ideally a multiple of {target}), or lower"
            " `pipeline_parallel_size`."
        )
    above = [d for d in accepted if d >= target]
    return above[0] if above else accepted[-1]


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """One candidate configuration and what the cost model predicts for it.

    Times are in the units of the costs given (e.g. seconds if the costs are seconds per sample, or
    "parameter-samples" when parameter counts stand in for time); only ratios between plans mean something.
    Memory is in bytes per device, or ``None`` when no byte counts were given.
    """

    pipeline_parallel_size: int
    data_parallel_size: int
    num_microbatches: int
    schedule: str
    stages_per_rank: int
    balance: tuple[int, ...]
    predicted_bubble: float
    predicted_step_time: float
    predicted_memory_per_device: Optional[float]
    global_batch_size: int = 0
    ideal_step_time: float = 0.0
    stage_costs: tuple[float, ...] = ()
    state_memory: Optional[float] = None
    activation_memory: Optional[float] = None
    fits: bool = True

    @property
    def devices(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def batch_size_per_replica(self) -> int:
        """The batch each pipeline replica runs: the dataloader ``batch_size`` under ``PipelineStrategy``."""
        return self.global_batch_size // self.data_parallel_size

    @property
    def microbatch_size(self) -> int:
        return self.batch_size_per_replica // self.num_microbatches

    @property
    def efficiency(self) -> float:
        """Ideal step time (perfect scaling, no bubble, no overhead) over the predicted one; 1.0 is perfect."""
        return self.ideal_step_time / self.predicted_step_time if self.predicted_step_time else 1.0

    def strategy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``PipelineStrategy`` that run this plan."""
        kwargs: dict[str, Any] = {
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
        }
        if self.schedule in _MULTI_STAGE:
            kwargs["stages_per_rank"] = self.stages_per_rank
        kwargs["balance"] = list(self.balance)
        return kwargs

    def strategy_line(self) -> str:
        """The ``PipelineStrategy(...)`` call that runs this plan."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.strategy_kwargs().items())
        return f"PipelineStrategy({args})"

    def yaml_snippet(self) -> str:
        """The LightningCLI config lines that run this plan (the datamodule's ``batch_size`` is per replica)."""
        lines = [
            "trainer:",
            "  strategy:",
            "    class_path: lightning_pipe.PipelineStrategy",
            "    init_args:",
        ]
        for key, value in self.strategy_kwargs().items():
            shown = "[" + ", ".join(str(x) for x in value) + "]" if isinstance(value, list) else str(value)
            if key == "schedule":
                shown = f'"{value}"'
            lines.append(f"      {key}: {shown}")
        lines += [
            "data:",
            "  init_args:",
            f"    batch_size: {self.batch_size_per_replica}"
            f"  # per replica: global batch {self.global_batch_size} / {self.data_parallel_size} replicas",
        ]
        return "\n".join(lines)

    def describe(self) -> str:
        """A few lines a person can read: the layout, the predictions and the ``PipelineStrategy`` call."""
        per_rank = _plural(self.stages_per_rank, "stage")
        micro = _plural(self.num_microbatches, "microbatch", "microbatches")
        lines = [
            f"pipeline {self.pipeline_parallel_size} x data-parallel {self.data_parallel_size}"
            f" ({self.devices} devices), schedule {self.schedule}, {per_rank} per process",
            f"  {micro} of {_plural(self.microbatch_size, 'sample')} (batch {self.batch_size_per_replica}"
            f" per replica, {self.global_batch_size} global)",
            f"  modules per stage: {list(self.balance)}; slowest stage costs {_num(max(self.stage_costs, default=0))}"
            f" per sample (stages: {', '.join(_num(c) for c in self.stage_costs)})",
            f"  predicted bubble {self.predicted_bubble:.1%}, step time {_num(self.predicted_step_time)}"
            f" ({self.efficiency:.0%} of ideal scaling)",
        ]
        if self.predicted_memory_per_device is None:
            lines.append("  memory: not estimated (no parameter or activation bytes given)")
        else:
            lines.append(
                f"  memory per device {format_bytes(self.predicted_memory_per_device)}"
                f" (weights, gradients and optimizer state {format_bytes(self.state_memory or 0)},"
                + (
                    " activations not counted)"
                    if self.activation_memory is None
                    else f" activations {format_bytes(self.activation_memory)})"
                )
                + ("" if self.fits else "  OVER BUDGET")
            )
        if self.pipeline_parallel_size == 1:
            lines.append("  (a pipeline of one process is plain data parallelism: DDP runs it just as well)")
        lines.append(f"  {self.strategy_line()}")
        return "\n".join(lines)


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
    optimizer_multiplier: float = 3.0,
    microbatch_overhead: float = 0.01,
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
    )
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: (p.predicted_memory_per_device, p.predicted_step_time))
        need = smallest.predicted_memory_per_device
        assert need is not None and memory_budget is not None
        raise ValueError(
            f"No plan fits the memory budget of {format_bytes(memory_budget)} ({int(memory_budget)} bytes) per"
            f" device: the smallest needs {format_bytes(need)} ({math.ceil(need)} bytes) per device"
            f" (pipeline {smallest.pipeline_parallel_size} x data-parallel {smallest.data_parallel_size},"
            f" {smallest.schedule}, {smallest.num_microbatches} microbatches). Raise the budget to at least that,"
            " add devices, use a smaller batch or turn on activation checkpointing."
        )
    return fitting


def plan_pipeline(costs: Sequence[float], global_batch_size: int, devices: int, **kwargs: Any) -> Plan:
    """The best plan: :func:`search_plans`'s first. Takes the same arguments."""
    return search_plans(costs, global_batch_size, devices, **kwargs)[0]


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
) -> list[Plan]:
    n = len(costs)
    if n == 0:
        raise ValueError("The backbone has no modules: there is nothing to plan.")
    costs = [float(c) for c in costs]
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ValueError(f"Module costs must be non-negative numbers, got {costs}.")
    if sum(costs) == 0:
        costs = [1.0] * n  # nothing to tell modules apart: treat them as equal
    _check_positive("global_batch_size", global_batch_size)
    _check_positive("devices", devices)
    _check_positive("interleaved_stages_per_rank", interleaved_stages_per_rank)
    for name, values in (("param_bytes", param_bytes), ("activation_bytes", activation_bytes)):
        if values is not None and len(values) != n:
            raise ValueError(f"`{name}` has {len(values)} entries but there are {n} module costs.")
    if optimizer_multiplier < 0 or microbatch_overhead < 0:
        raise ValueError("`optimizer_multiplier` and `microbatch_overhead` must be non-negative.")
    unknown = [s for s in schedules if s not in PLANNED_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"The planner models the schedules {list(PLANNED_SCHEDULES)}; got {list(schedules)}.")
    measured = param_bytes is not None or activation_bytes is not None
    if memory_budget is not None and not measured:
        raise ValueError("A `memory_budget` needs `param_bytes` and/or `activation_bytes` to check plans against.")
    if pipeline_parallel_size is not None:
        _check_positive("pipeline_parallel_size", pipeline_parallel_size)
        if devices % pipeline_parallel_size:
            raise ValueError(
                f"`pipeline_parallel_size={pipeline_parallel_size}` does not divide the {devices} devices;"
                f" choose one of {_divisors(devices)}."
            )
    weights = [float(x) for x in param_bytes] if param_bytes is not None else [0.0] * n
    acts = [float(x) for x in activation_bytes] if activation_bytes is not None else [0.0] * n
    ideal = sum(costs) * global_batch_size / devices
    overhead = microbatch_overhead * ideal
    splits: dict[int, list[int]] = {}
    plans: list[Plan] = []
    skipped: list[str] = []
    for p in _divisors(devices):
        if pipeline_parallel_size is not None and p != pipeline_parallel_size:
            continue
        dp = devices // p
        if global_batch_size % dp:
            skipped.append(f"pipeline {p}: the global batch {global_batch_size} does not split over {dp} replicas")
            continue
        b = global_batch_size // dp
        for schedule in schedules:
            v = interleaved_stages_per_rank if schedule in _MULTI_STAGE else 1
            if p == 1 and schedule != "1F1B":
                continue  # one stage: GPipe and interleaving only differ from 1F1B by keeping more in flight
            num_stages = p * v
            if num_stages > n:
                skipped.append(f"pipeline {p} ({schedule}): {num_stages} stages but only {n} modules")
                continue
            if num_stages not in splits:
                splits[num_stages] = split_sizes(costs, num_stages, "parameters")
            sizes = splits[num_stages]
            bounds = _bounds(sizes)
            stage_cost = [sum(costs[a:z]) for a, z in bounds]
            stage_weights = [sum(weights[a:z]) for a, z in bounds]
            stage_acts = [sum(acts[a:z]) for a, z in bounds]
            c_max = max(stage_cost)
            for m in _divisors(b):
                if not valid_num_microbatches(m, p, v, schedule):
                    continue
                step = (v * m + p - 1) * (c_max * b / m + overhead)
                bubble = (p - 1) / (v * m + p - 1)
                memory = state = activation = None
                fits = True
                if measured:
                    state, activation = _peak_memory(
                        schedule, p, v, m, b, stage_weights, stage_acts, optimizer_multiplier
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


def _peak_memory(
    schedule: str,
    p: int,
    v: int,
    m: int,
    b: int,
    stage_weights: list[float],
    stage_acts: list[float],
    optimizer_multiplier: float,
) -> tuple[float, float]:
    """``(state, activations)`` bytes of the process that needs the most in total."""
    micro = b / m
    best = (0.0, 0.0)
    for r in range(p):
        stages = [r + p * k for k in range(v)]  # loop placement: stage s on rank s % p
        state = sum(stage_weights[s] for s in stages) * (1 + optimizer_multiplier)
        if schedule == "GPipe":
            activation = m * stage_acts[r] * micro
        elif schedule == "1F1B":
            activation = min(m, p - r) * stage_acts[r] * micro
        else:  # Interleaved1F1B, as torch orders it: rounds of `per_round` microbatches per local stage
            rounds = max(1, m // p)
            per_round = m // rounds
            warmup = min((v - 1) * per_round + 2 * (p - 1 - r), v * m)
            in_flight = min(warmup + 1, v * m)
            activation = sum(stage_acts[stages[(k // per_round) % v]] for k in range(in_flight)) * micro
        if state + activation > sum(best):
            best = (state, activation)
    return best


def _rank_key(plan: Plan) -> tuple:
    memory = plan.predicted_memory_per_device or 0.0
    return (
        float(f"{plan.predicted_step_time:.9g}"),  # equal up to rounding: let memory decide
        float(f"{memory:.9g}"),
        _SCHEDULE_ORDER.get(plan.schedule, 9),
        plan.pipeline_parallel_size,
        plan.num_microbatches,
    )


# ---------------------------------------------------------------------------------------------- modules
def backbone_profile(
    lightning_module: nn.Module,
    backbone: str = "backbone",
    costs: Union[str, Sequence[float]] = "parameters",
    activation_bytes: Union[None, str, Sequence[float]] = "auto",
    example_input: Any = None,
    bytes_per_parameter: Optional[float] = None,
) -> tuple[list[float], list[float], Optional[list[float]]]:
    """``(costs, param_bytes, activation_bytes)`` per backbone module, as :func:`search_plans` takes them.

    Args:
        lightning_module: the module holding the backbone; it may live on the meta device.
        backbone: dotted attribute path of the ``nn.Sequential``, as for ``PipelineStrategy``.
        costs: ``"parameters"`` (parameter counts stand in for time) or measured times per sample, one per module.
        activation_bytes: ``"auto"`` measures the bytes each module saves for backward per sample by running
            ``example_input`` (default: the module's ``example_input_array``) through the backbone on the meta
            device, which computes nothing; ``None`` leaves activations out; or one number per module.
        example_input: a tensor with a leading batch dimension, the backbone's input.
        bytes_per_parameter: overrides the parameters' own element size (e.g. 2 for ``precision="bf16-true"``).
    """
    from lightning_pipe.backbone import LocalBackbone, resolve_backbone

    _, _, modules = resolve_backbone(lightning_module, backbone)
    if isinstance(modules, LocalBackbone):
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


def measure_activation_bytes(modules: nn.Sequential, example_input: Any) -> Optional[list[float]]:
    """Bytes each module of ``modules`` saves for backward, per sample, measured on the meta device.

    The input is run through the modules twice, with batches of 1 and 2 built from ``example_input``'s per-sample
    shape and dtype; the difference is the per-sample part (weights saved for backward cancel out). Modules that
    are not on the meta device are copied there one at a time. Returns ``None`` when it cannot be measured
    (an input that is not a single tensor, or an operation the meta device does not support).
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


def plan_for_module(
    lightning_module: nn.Module,
    batch_size: int,
    devices: int,
    memory_budget: Optional[float] = None,
    backbone: str = "backbone",
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
        backbone: dotted attribute path of the ``nn.Sequential``.
        costs: ``"parameters"`` or measured forward+backward times per sample, one per module.
        activation_bytes, example_input, bytes_per_parameter: see :func:`backbone_profile`.
        **search_kwargs: passed to :func:`search_plans` (``pipeline_parallel_size``, ``schedules``,
            ``optimizer_multiplier``, ``microbatch_overhead``, ...).
    """
    module_costs, param_bytes, acts = backbone_profile(
        lightning_module, backbone, costs, activation_bytes, example_input, bytes_per_parameter
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
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def _plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: Union[str, float, int]) -> int:
    """``"16GiB"`` -> 17179869184. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and K/M/G/T (of 1024)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read {text!r} as a size in bytes; write e.g. '16GiB', '512MB' or '1e9'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """``17179869184`` -> ``"16.00 GiB"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------- the CLI
_DESCRIPTION = """\
Recommend a PipelineStrategy configuration for a LightningCLI config file.

Reads the config's `model` (class_path + init_args), builds the model on the meta device (nothing is allocated or
computed), measures the backbone's parameters per module and, with --input-shape, the activations it keeps for
backward, then ranks every pipeline size (dividing the device count), schedule (1F1B, GPipe, Interleaved1F1B) and
microbatch count by predicted step time among the plans that fit --memory-budget. Prints the best plans and the
PipelineStrategy(...) call / YAML lines for the best one.

The batch: --batch-size, else the config's data.init_args.batch_size, is the per-process dataloader batch as
in the config; the global batch (what plans are compared at) is that times the config's current number of
replicas (its trainer.strategy's data_parallel_size; every process for a non-pipeline strategy such as DDP; 1 for
PipelineStrategy's default of one pipeline over all devices). --global-batch-size sets it directly.

Costs are parameter counts unless --costs gives measured forward+backward times per sample, one per backbone
module. Predicted times are relative: compare plans, not seconds. See docs/planner.md for the model.
"""

_EPILOG = """\
example:
  python -m lightning_pipe.plan --config config.yaml --devices 8 --memory-budget 40GiB --input-shape 2048 \\
      --input-dtype long
"""


def _build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.plan",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", required=True, help="LightningCLI YAML with `model` (and optionally `data`, `trainer`)."
    )
    parser.add_argument("--devices", type=int, help="devices per node (default: the config's trainer.devices).")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: the config's trainer.num_nodes, else 1).")
    parser.add_argument(
        "--batch-size", type=int, help="per-process dataloader batch (default: data.init_args.batch_size)."
    )
    parser.add_argument("--global-batch-size", type=int, help="samples per optimizer step over all replicas.")
    parser.add_argument("--memory-budget", help="bytes one device may use, e.g. 16GiB, 80GB, 1e10.")
    parser.add_argument("--pipeline-parallel-size", type=int, help="consider only this pipeline size.")
    parser.add_argument(
        "--backbone", help="dotted attribute path of the nn.Sequential (default: the config's, else 'backbone')."
    )
    parser.add_argument(
        "--costs",
        default="parameters",
        help="'parameters' (default), or forward+backward times per sample, one per module: '1.0,2.5,...' or a"
        " JSON file.",
    )
    parser.add_argument(
        "--input-shape",
        help="per-sample shape of the backbone input, e.g. '2048' or '3,224,224': measures activations on the meta"
        " device.",
    )
    parser.add_argument("--input-dtype", default="float32", help="dtype of that input (e.g. long for token ids).")
    parser.add_argument(
        "--bytes-per-parameter", type=float, help="override the parameters' element size (2 for bf16-true)."
    )
    parser.add_argument(
        "--optimizer-multiplier",
        type=float,
        default=3.0,
        help="gradient + optimizer copies of the weights (Adam: 3, SGD+momentum: 2).",
    )
    parser.add_argument(
        "--microbatch-overhead",
        type=float,
        default=0.01,
        help="cost per microbatch and stage, as a fraction of the ideal step time.",
    )
    parser.add_argument(
        "--schedules", default=",".join(PLANNED_SCHEDULES), help="comma-separated schedules to consider."
    )
    parser.add_argument("--model-class", help="class path of the model when the config's `model` has no class_path.")
    parser.add_argument(
        "--top", type=int, default=8, help="how many plans to list (the best per pipeline size and schedule)."
    )
    return parser


def _load_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"error: {path} does not hold a mapping.")
    if "fit" in config and "model" not in config and isinstance(config["fit"], dict):
        config = config["fit"]  # a `python main.py --config` file written for the fit subcommand
    return config


def _instantiate_model(model_config: Any, model_class: Optional[str]) -> tuple[nn.Module, bool]:
    """Build the model from ``{class_path, init_args}`` with jsonargparse; on the meta device when that works."""
    import torch
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    if isinstance(model_config, str):
        model_config = {"class_path": model_config}
    if not isinstance(model_config, dict):
        raise SystemExit("error: the config's `model` must be a mapping with `class_path` and `init_args`.")
    if "class_path" not in model_config:
        if not model_class:
            raise SystemExit(
                "error: the config's `model` has no `class_path` (the script fixes the model class);"
                " give it with --model-class package.module.ClassName."
            )
        model_config = {"class_path": model_class, "init_args": model_config}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    cfg = parser.parse_object({"model": model_config})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    try:
        with torch.device("meta"):
            model = instantiate(cfg).model
        on_meta = True
    except Exception as error:  # e.g. __init__ loads weights or calls .item(): build it for real
        print(
            f"note: building the model on the meta device failed ({type(error).__name__}: {error});"
            " building it on the CPU instead.",
            file=sys.stderr,
        )
        model = instantiate(cfg).model
        on_meta = False
    return model, on_meta


def _devices(trainer: dict[str, Any], devices: Optional[int], num_nodes: Optional[int]) -> int:
    if devices is None:
        value = trainer.get("devices")
        if isinstance(value, (list, tuple)):
            devices = len(value)
        elif isinstance(value, str) and value.strip().isdigit():
            devices = int(value)
        elif isinstance(value, int) and value > 0:
            devices = value
        else:
            raise SystemExit(f"error: cannot tell the device count from trainer.devices={value!r}; give --devices N.")
    nodes = num_nodes if num_nodes is not None else int(trainer.get("num_nodes") or 1)
    return devices * nodes


def _current_replicas(strategy: Any, devices: int) -> int:
    """How many replicas the config trains with now: the divisor from per-process batch to global batch."""
    if strategy is None or strategy in ("auto", "single_device"):
        return devices if devices > 1 else 1
    if isinstance(strategy, str):
        return 1 if strategy.startswith("pipeline") else devices
    if isinstance(strategy, dict):
        if "PipelineStrategy" not in str(strategy.get("class_path", "")):
            return devices
        init = strategy.get("init_args") or {}
        dp, pp = init.get("data_parallel_size", "auto"), init.get("pipeline_parallel_size", "auto")
        if isinstance(dp, int):
            return dp
        if isinstance(pp, int) and pp > 0:
            return max(1, devices // pp)
        return 1
    return devices


def _parse_costs(text: str) -> Union[str, list[float]]:
    import json
    import os

    if text == "parameters":
        return text
    if os.path.exists(text):
        with open(text) as f:
            values = json.load(f)
    else:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    return [float(x) for x in values]


def _table(plans: Sequence[Plan]) -> str:
    best = plans[0].predicted_step_time
    header = [
        "pp",
        "dp",
        "schedule",
        "v",
        "micro",
        "mb size",
        "bubble",
        "rel. time",
        "memory/device",
        "modules per stage",
    ]
    rows = []
    for plan in plans:
        memory = "-" if plan.predicted_memory_per_device is None else format_bytes(plan.predicted_memory_per_device)
        rows.append(
            [
                str(plan.pipeline_parallel_size),
                str(plan.data_parallel_size),
                plan.schedule,
                str(plan.stages_per_rank),
                str(plan.num_microbatches),
                str(plan.microbatch_size),
                f"{plan.predicted_bubble:.1%}",
                f"{plan.predicted_step_time / best:.3f}",
                memory,
                str(list(plan.balance)),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_arg_parser().parse_args(argv)
    config = _load_config(args.config)
    if "model" not in config:
        raise SystemExit(f"error: {args.config} has no `model` section.")
    trainer = config.get("trainer") or {}
    devices = _devices(trainer, args.devices, args.num_nodes)
    strategy = trainer.get("strategy")
    backbone = args.backbone
    if backbone is None and isinstance(strategy, dict):
        backbone = (strategy.get("init_args") or {}).get("backbone")
    backbone = backbone or "backbone"

    if args.global_batch_size is not None:
        global_batch, batch_note = args.global_batch_size, "given"
    else:
        per_process = args.batch_size
        if per_process is None:
            data = config.get("data") or {}
            per_process = (data.get("init_args") or data).get("batch_size") if isinstance(data, dict) else None
        if not isinstance(per_process, int) or per_process < 1:
            raise SystemExit("error: no batch size: give --batch-size or set data.init_args.batch_size in the config.")
        replicas = _current_replicas(strategy, devices)
        global_batch = per_process * replicas
        batch_note = f"batch_size {per_process} x {replicas} replica{'s' if replicas > 1 else ''} in the config"

    import torch

    model, on_meta = _instantiate_model(config["model"], args.model_class)
    example = None
    if args.input_shape:
        shape = tuple(int(x) for x in re.split(r"[,x ]+", args.input_shape.strip()) if x)
        dtype = getattr(torch, args.input_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"error: unknown --input-dtype {args.input_dtype!r}.")
        example = torch.zeros((1, *shape), dtype=dtype, device="meta")
    try:
        costs, param_bytes, acts = backbone_profile(
            model, backbone, _parse_costs(args.costs), "auto", example, args.bytes_per_parameter
        )
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
        plans = search_plans(
            costs,
            global_batch,
            devices,
            param_bytes=param_bytes,
            activation_bytes=acts,
            memory_budget=budget,
            pipeline_parallel_size=args.pipeline_parallel_size,
            schedules=[s.strip() for s in args.schedules.split(",") if s.strip()],
            optimizer_multiplier=args.optimizer_multiplier,
            microbatch_overhead=args.microbatch_overhead,
        )
    except (ValueError, AttributeError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    shown: list[Plan] = []
    seen: set[tuple[int, str]] = set()
    for plan in plans:  # the best microbatch count of each (pipeline size, schedule)
        if (plan.pipeline_parallel_size, plan.schedule) not in seen:
            seen.add((plan.pipeline_parallel_size, plan.schedule))
            shown.append(plan)
    shown = shown[: max(1, args.top)]
    name = type(model).__name__
    memory_note = "parameters, gradients, optimizer state" + (
        " and activations" if acts is not None else " (no activations: give --input-shape to include them)"
    )
    print(
        f"{name}: backbone `{backbone}` with {len(costs)} modules, {sum(param_bytes) / 1e6:.2f} MB of parameters"
        f"{'' if on_meta else ' (built on the CPU)'}; {devices} devices; global batch {global_batch} ({batch_note});"
        f" costs: {'parameter counts' if args.costs == 'parameters' else 'given times'}"
        + (f"; budget {format_bytes(budget)} per device" if budget else "")
    )
    print(f"memory counts {memory_note}.\n")
    print(_table(shown))
    best = plans[0]
    print("\nRecommended:\n" + best.describe())
    print("\nIn Python:\n  " + best.strategy_line())
    print("\nIn the LightningCLI config:\n" + best.yaml_snippet())
    return 0


if __name__ == "__main__":
    sys.exit(main())
