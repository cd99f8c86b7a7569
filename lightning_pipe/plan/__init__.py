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

* step time: :func:`simulate` plays the schedule's own order of actions (torch builds it) with each stage's
  forward, input-gradient and weight-gradient time for ``b / m`` samples (``cost_split`` of the costs), a fixed
  overhead ``o / 2`` per action (``o = microbatch_overhead`` times the ideal step time ``sum(costs) * B /
  devices``, so that ever more microbatches are not free), ``transfer_time`` per message between ranks, then adds
  the replicas' gradient all-reduce (``data_parallel_time_per_byte``). For balanced stages this is the textbook
  ``(v*m + p - 1) * (c * b / m + o)`` of 1F1B, GPipe and Interleaved1F1B; the zero-bubble schedules defer the
  weight gradient into the bubble;
* bubble: the idle fraction of that play, averaged over the ranks;
* memory of a process: its parameter bytes times ``1 + optimizer_multiplier`` (gradients and optimizer state;
  3 for Adam) plus the activations of the microbatches each of its stages holds at once in the same play;
* tensor parallelism over ``t`` processes of a node (``devices_per_node`` given; ``p * data_parallel_size * t``
  devices): every module costs ``(1 + tensor_parallel_overhead * (t - 1)) / t`` of its cost and holds ``1 / t`` of
  its parameter bytes; activations stay whole.

``benchmarks/predicted.py`` compares :func:`simulate` with measured step times; ``PipelineStrategy(schedule="auto")``
uses it on the times it measures at setup.
"""

from lightning_pipe._bytes import format_bytes, parse_bytes
from lightning_pipe._simulate import Prediction, StageCosts, simulate
from lightning_pipe._step.microbatches import (
    TARGET_BUBBLE,
    default_num_microbatches,
    microbatch_target,
    valid_num_microbatches,
)
from lightning_pipe.plan._model import backbone_profile, measure_activation_bytes, measure_module_times
from lightning_pipe.plan._result import Plan
from lightning_pipe.plan._search import (
    PLANNED_SCHEDULES,
    plan_for_module,
    plan_pipeline,
    search_plans,
    tensor_parallel_sizes,
)

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
    "measure_module_times",
    "microbatch_target",
    "parse_bytes",
    "plan_for_module",
    "plan_pipeline",
    "search_plans",
    "simulate",
    "tensor_parallel_sizes",
    "valid_num_microbatches",
]
