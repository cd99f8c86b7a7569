"""A planner for :class:`~lightning_pipe.PipelineStrategy`: which pipeline size, schedule, microbatch count and
stage split (and, given the devices per node, tensor-parallel size) to use for a backbone on a given number of
devices.

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
  1F1B, ``m`` for GPipe, and torch's warm-up count for Interleaved1F1B;
* tensor parallelism over ``t`` processes of a node (``devices_per_node`` given; ``p * data_parallel_size * t``
  devices): every module costs ``(1 + tensor_parallel_overhead * (t - 1)) / t`` of its cost and holds ``1 / t`` of
  its parameter bytes; activations stay whole.

:func:`simulate` predicts a schedule's step time differently, for stage costs split into forward, input-gradient and
weight-gradient times: it plays torch's own order of actions for that schedule against a clock ([Note: schedule
simulation] in ``plan/_simulate.py``), so the zero-bubble schedules' deferred weight gradients and torch's exact
warm-up orders count. ``benchmarks/predicted.py`` compares it with measured step times.
"""

from lightning_pipe._step.microbatches import (
    TARGET_BUBBLE,
    default_num_microbatches,
    microbatch_target,
    valid_num_microbatches,
)
from lightning_pipe.plan._model import backbone_profile, measure_activation_bytes
from lightning_pipe.plan._result import Plan, format_bytes, parse_bytes
from lightning_pipe.plan._search import (
    PLANNED_SCHEDULES,
    plan_for_module,
    plan_pipeline,
    search_plans,
    tensor_parallel_sizes,
)
from lightning_pipe.plan._simulate import Prediction, StageCosts, simulate

__all__ = [
    "PLANNED_SCHEDULES",
    "Plan",
    "Prediction",
    "StageCosts",
    "TARGET_BUBBLE",
    "backbone_profile",
    "default_num_microbatches",
    "format_bytes",
    "measure_activation_bytes",
    "microbatch_target",
    "parse_bytes",
    "plan_for_module",
    "plan_pipeline",
    "search_plans",
    "simulate",
    "tensor_parallel_sizes",
    "valid_num_microbatches",
]
