"""torch's private names of ``torch.distributed.pipelining`` the package needs, and the workarounds that use them (see
:mod:`lightning_pipe._compat`): the names the timeline's recorder wraps, the forward-only schedule surgery, and the
two corrections of torch's zero-bubble weight pass, and the exceptions torch wraps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torch.autograd.graph import Node
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action


#: ``torch.distributed.pipelining.schedules`` globals every schedule posts and waits for its transfers through.
P2P_POST = "_batch_p2p"
P2P_WAIT = "_wait_batch_p2p"
#: The schedule method that runs the loss after each forward of the last stage.
SCHEDULE_LOSS_METHOD = "_maybe_compute_loss"


def raised_in_stage(exception: BaseException) -> BaseException:
    """What a stage's forward raised, where torch's ``PipelineStage.forward_one_chunk`` wrapped it in a
    ``RuntimeError("[Stage N] failed to run forward: args: ...")`` raised from it; ``exception`` itself otherwise. The
    wrapper says only which stage: the user's own error (or the strategy's, naming the fix) is the one to raise."""
    while (type(exception) is RuntimeError and exception.__cause__ is not None
           and "failed to run forward" in str(exception)):
        exception = exception.__cause__
    return exception


def keep_forward_actions(schedule: PipelineScheduleMulti) -> None:
    """Make a schedule built from a compute-only action list (the multi-stage ones) run its forward actions only, in
    their order: a forward-only pass."""
    from torch.distributed.pipelining.schedules import FORWARD

    def forwards(action: Optional[_Action]) -> list[_Action]:
        if action is None:
            return []
        if action.computation_type == FORWARD:
            return [action]
        return [a for a in (action.sub_actions or ()) if a.computation_type == FORWARD]

    import torch.distributed.pipelining.schedules as schedules

    order = {rank: [f for a in actions for f in forwards(a)] for rank, actions in schedule.pipeline_order.items()}
    stage_rank = schedule.stage_index_to_group_rank
    schedule.pipeline_order = order
    with_comms = schedules._add_send_recv(order, stage_to_rank=lambda s: stage_rank[s], num_stages=schedule._num_stages)
    # torch >= 2.15 waits for every send through a WAIT_SEND_F/B action, and fails a step that leaves one without
    add_wait_send = getattr(schedules, "_add_wait_send", None)
    if add_wait_send is not None:
        with_comms = add_wait_send(with_comms)
    schedule.pipeline_order_with_comms = with_comms




def schedule_stages(schedule: Any) -> Optional[list[Any]]:
    """The stages of a torch schedule object (``_stages``, or ``_stage`` for one), or None if it is not one."""
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    if hasattr(schedule, "_stage"):
        return [schedule._stage]
    return None


@contextmanager
def weight_gradients_keep_graph() -> Iterator[None]:
    """Zero-bubble schedules split a stage's backward: the input gradient first, keeping the gradients at the
    autograd nodes where the weights' paths meet the inputs' (``param_groups``), then each group's weight gradient,
    one ``autograd.grad`` per group (torch's ``stage_backward_weight``) without retaining the graph. A group's pass
    can run through another group's node: a decoder's first block, whose self-attention sees only weights (the
    embedding), meets the encoder's output in its cross-attention, and the gradient to the query's weights runs
    from the residual sum back through the cross-attention's output projection, whose own group comes later and
    finds that node's saved tensors freed ("Trying to backward through the graph a second time"). Each group's
    nodes clamp the gradient they pass to the one saved for them, so no gradient is counted twice; keeping the
    graph until the last group is done changes no value, and the graph is freed with the groups after the pass.
    Within the block, ``stage_backward_weight`` keeps the graph."""
    from torch.distributed.pipelining import stage as _stage

    original = _stage.stage_backward_weight

    def keeping(
        weights: Iterator[torch.nn.Parameter], param_groups: list[dict[str, Any]], retain_graph: bool = False
    ) -> tuple[Optional[torch.Tensor], ...]:
        return original(weights, param_groups, retain_graph=True)

    _stage.stage_backward_weight = keeping
    try:
        yield
    finally:
        _stage.stage_backward_weight = original


@contextmanager
def merged_param_groups() -> Iterator[None]:
    """torch's ``_backward.get_param_groups`` (what the zero-bubble input pass keeps for the weight pass) merges a
    weight's group with the groups it meets one after the other, leaving the first one behind: a weight that meets
    several groups (a tied embedding, read by a decoder's embedding and by the head) ends up in two groups, and its
    gradient through the node they share is counted twice. Within the block, groups that share a weight or a node
    are merged transitively (union-find), so every weight and every node is in exactly one group."""
    from torch.distributed.pipelining import _backward

    original = _backward.get_param_groups

    def merged(
        inputs: list[Node], params: list[Node], reverse_edges_dict: dict[Node, list[Node]]
    ) -> list[dict[str, Any]]:
        return _merge_groups(original(inputs, params, reverse_edges_dict))

    _backward.get_param_groups = merged
    try:
        yield
    finally:
        _backward.get_param_groups = original


def _merge_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}
    for i, group in enumerate(groups):
        for node in (*group["params"], *group["intermediates"]):
            parent[root(i)] = root(owner.setdefault(node, i))
    merged: dict[int, dict[str, Any]] = {}
    for i, group in enumerate(groups):
        into = merged.setdefault(root(i), {"params": set(), "intermediates": set()})
        into["params"] |= set(group["params"])
        into["intermediates"] |= set(group["intermediates"])
    return list(merged.values())
