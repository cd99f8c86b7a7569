"""Predicting a schedule's step time from stage costs, by running torch's own order of actions against a clock.

[Note: schedule simulation] torch lists, for every schedule, what each pipeline rank does in which order: forward,
input gradient, weight gradient or full backward, of which stage and microbatch (``_schedule_visualizer``'s
``get_schedule_ops``, which builds the schedule on stand-in stages, without processes). :func:`simulate` plays that
order: a rank runs its actions one after the other, each as soon as the rank is free and its inputs are there (the
previous stage's forward of that microbatch, the next stage's input gradient, plus ``transfer`` seconds when the two
stages are on different ranks), for the given forward, input-gradient and weight-gradient times per stage. The
result is the step time and each rank's busy time, so the bubble, with the schedule's own order, not a textbook
formula: no schedule is written here.

torch's first stage has no input gradient to compute: its ``BACKWARD_INPUT`` does nothing and its
``BACKWARD_WEIGHT`` runs the whole backward. ``OVERLAP_F_B`` (DualPipeV) runs its forward and backward one after
the other, as torch's runtime does without a custom overlap function.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

#: The cost model's constants, shared by ``schedule="auto"`` (``_step/auto.py``) and the planner (``plan/``):
#: seconds the runtime spends around each action of a schedule (posting transfers, the step's bookkeeping), which makes
#: ever more microbatches cost more (``benchmarks/predicted.py`` fits it on CPU processes; ``schedule="auto"`` refits it
#: on the steps it times). The planner's costs may have no unit (parameter counts): its ``microbatch_overhead`` is the
#: same cost as a fraction of the ideal step time, two actions per microbatch and stage.
ACTION_OVERHEAD_S = 1e-3
MICROBATCH_OVERHEAD = 0.01
#: Copies of each parameter's bytes that training holds besides the weight: its gradient and two optimizer moments
#: (Adam).
OPTIMIZER_COPIES = 3.0


@dataclass(frozen=True)
class StageCosts:
    """Seconds per microbatch of one stage: forward, input gradient and weight gradient (a full backward is both)."""

    forward: float
    input_grad: float
    weight_grad: float


@dataclass(frozen=True)
class Prediction:
    """What :func:`simulate` predicts for one step.

    Attributes:
        step_time: seconds from the first action to the last, over all ranks.
        busy: seconds each rank computes.
        ideal: the step time without idling: the busiest rank's compute, ``m * (F + B + W)`` of its stages.
        in_flight: for each stage, the most microbatches whose activations it held at once (from a forward to the
            backward, or weight gradient, that frees them): what the schedule's activation memory scales with.
    """

    step_time: float
    busy: tuple[float, ...]
    ideal: float
    in_flight: tuple[int, ...] = ()

    @property
    def bubble(self) -> float:
        """The idle fraction of the step, averaged over the ranks."""
        if self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


def schedule_actions(schedule: str, pipeline_parallel_size: int, num_microbatches: int, stages_per_rank: int) -> list:
    """torch's order of actions for every rank: ``[rank][k]`` is an ``_Action`` (or ``None``, a gap)."""
    from lightning_pipe.schedules import schedule_spec

    spec = schedule_spec(schedule)
    per_rank = stages_per_rank if spec.multi_stage else None
    return [list(ops) for ops in _actions(spec.name, pipeline_parallel_size, num_microbatches, per_rank)]


@functools.lru_cache(maxsize=256)
def _actions(name: str, p: int, m: int, per_rank: Optional[int]) -> tuple[tuple, ...]:
    """torch's schedule class builds its order on stand-in stages, as its visualiser's ``get_schedule_ops`` does, but
    with one stand-in for every call (``unittest.mock`` takes 50 ms to make one) and each order once per process."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(name)
    stage = _stand_in()
    stage.group_size = p
    v = per_rank or (1 if issubclass(cls, PipelineScheduleSingle) else 2)
    stage.num_stages = p * v
    schedule = cls(stage, m) if issubclass(cls, PipelineScheduleSingle) else cls([stage] * v, m)
    return tuple(tuple(schedule.pipeline_order[rank]) for rank in range(p))


@functools.lru_cache(maxsize=1)
def _stand_in() -> object:
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.submod = None
    return stage


def simulate(
    schedule: str,
    pipeline_parallel_size: int,
    num_microbatches: int,
    stages: Sequence[StageCosts],
    transfer: float = 0.0,
    overhead: float = 0.0,
) -> Prediction:
    """Play ``schedule``'s order of actions with the costs of ``stages`` (one per stage, in stage order; their count
    fixes the stages per rank), ``transfer`` seconds per message between ranks and ``overhead`` seconds per action
    (the runtime's own work around each: posting transfers, the step's bookkeeping). See [Note: schedule
    simulation]."""
    p, m = pipeline_parallel_size, num_microbatches
    if len(stages) % p:
        raise ValueError(f"{len(stages)} stages do not spread evenly over {p} ranks.")
    actions = schedule_actions(schedule, p, m, len(stages) // p)
    num_stages = len(stages)
    where: dict[int, int] = {}
    for rank, ops in enumerate(actions):
        for action in ops:
            for a in _computations(action):
                where.setdefault(a.stage_index, rank)
    forward_done: dict[tuple[int, int], float] = {}
    input_done: dict[tuple[int, int], float] = {}
    clock = [0.0] * p
    busy = [0.0] * p
    queues = [[a for action in ops for a in _computations(action)] for ops in actions]
    if num_stages == p:  # one stage per rank: see _in_order
        queues = [_in_order(queue) for queue in queues]
    position = [0] * p
    held = [0] * num_stages
    most = [0] * num_stages
    while any(position[r] < len(queues[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(queues[r]):
                action = queues[r][position[r]]
                ready = _ready(action, r, where, forward_done, input_done, num_stages=num_stages, transfer=transfer)
                if ready is None:
                    break
                cost = _cost(action, stages) + overhead
                start = max(clock[r], ready)
                clock[r] = start + cost
                busy[r] += cost
                key = (action.stage_index, action.microbatch_index)
                kind = _kind(action)
                if kind == "F":
                    forward_done[key] = clock[r]
                    held[action.stage_index] += 1
                    most[action.stage_index] = max(most[action.stage_index], held[action.stage_index])
                elif kind in ("I", "B"):
                    input_done[key] = clock[r]
                if kind in ("B", "W"):  # what a forward saved is freed once nothing of its backward is left
                    held[action.stage_index] -= 1
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"The simulation of {schedule} stalled: torch's order waits on an action never run.")
    ideal = max(busy)
    return Prediction(step_time=max(clock), busy=tuple(busy), ideal=ideal, in_flight=tuple(most))


def _in_order(queue: list) -> list:
    """The actions of a one-stage-per-rank schedule with the k-th forward (and the k-th backward) of a rank on
    microbatch k, as torch's 1F1B and GPipe run them. torch 2.13's order for 1F1B numbers the last rank's forwards
    from 1 (its visualiser's ``_get_pipeline_order``; the schedule's own loop is right)."""
    from torch.distributed.pipelining.schedules import _Action

    counts: dict[str, int] = {}
    fixed = []
    for a in queue:
        kind = _kind(a)
        k = counts.get(kind, 0)
        counts[kind] = k + 1
        fixed.append(_Action(a.stage_index, a.computation_type, k))
    return fixed


def _computations(action: object) -> list:
    """The compute actions in ``action`` (``OVERLAP_F_B`` holds two), leaving out gaps and the rest."""
    if action is None:
        return []
    sub = getattr(action, "sub_actions", None)
    if sub:
        return [a for s in sub for a in _computations(s)]
    return [action] if _kind(action) in ("F", "I", "W", "B") else []


def _kind(action: object) -> str:
    name = str(getattr(action, "computation_type", ""))
    return {
        "FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B",
    }.get(name.rsplit(".", 1)[-1], "")


def _ready(
    action: object, rank: int, where: dict[int, int], forward_done: dict, input_done: dict, num_stages: int,
    transfer: float,
) -> float | None:
    """When ``action``'s inputs are there (``None``: not yet computed)."""
    s, i = action.stage_index, action.microbatch_index  # type: ignore[attr-defined]
    kind = _kind(action)
    if kind == "F":
        if s == 0:
            return 0.0
        done = forward_done.get((s - 1, i))
        return None if done is None else done + (transfer if where[s - 1] != rank else 0.0)
    if kind in ("I", "B"):
        mine = forward_done.get((s, i))
        if mine is None:
            return None
        if s == num_stages - 1:
            return mine
        done = input_done.get((s + 1, i))
        return None if done is None else max(mine, done + (transfer if where[s + 1] != rank else 0.0))
    return input_done.get((s, i))  # W: after this stage's input gradient


def _cost(action: object, stages: Sequence[StageCosts]) -> float:
    s = action.stage_index  # type: ignore[attr-defined]
    c = stages[s]
    kind = _kind(action)
    if kind == "F":
        return c.forward
    if kind == "B":
        return c.input_grad + c.weight_grad
    if kind == "I":
        return 0.0 if s == 0 else c.input_grad  # the first stage's backward all runs with its weight gradient
    return c.input_grad + c.weight_grad if s == 0 else c.weight_grad


def peak_memory(
    rank_stages: Sequence[Sequence[int]],
    in_flight: Sequence[int],
    stage_parameter_bytes: Sequence[float],
    stage_activation_bytes: Sequence[float],
    optimizer_copies: float = OPTIMIZER_COPIES,
) -> tuple[float, float]:
    """``(state, activations)`` bytes of the process that needs the most in total: its stages' parameters with their
    gradients and optimizer state (``1 + optimizer_copies`` copies), and the activations of the microbatches each of
    its stages holds at once in the schedule's own order (``in_flight``, from :func:`simulate`; the activation bytes
    are one microbatch's). ``rank_stages[r]`` are the stages of process ``r``."""
    best = (0.0, 0.0)
    for stages in rank_stages:
        state = sum(stage_parameter_bytes[s] for s in stages) * (1 + optimizer_copies)
        activation = sum(in_flight[s] * stage_activation_bytes[s] for s in stages)
        if state + activation > sum(best):
            best = (state, activation)
    return best
