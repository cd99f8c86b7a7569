"""Lightning's built-in callbacks that keep a copy of the module, or lists taken from it, made to see this rank's share.

Callbacks run on every rank with ``pl_module`` as that rank sees it: after the cut, its own stages' tensors (the
module tree itself is whole; what a rank does not hold is a ghost). Some callbacks take what they need from the
module in their ``setup`` hook, which Lightning runs before the strategy's ``setup``, that is, before the cut:

- ``StochasticWeightAveraging`` deep-copies the whole module, ``WeightAveraging`` (``EMAWeightAveraging``) wraps a
  copy in an ``AveragedModel``; both later pair the copy's ``parameters()`` with the module's by position. The copies
  are taken again after the cut (:func:`after_cut`): a rank averages its own tensors, which is exactly its slice of
  the one-process average, as averaging is elementwise.
- ``ModelPruning`` lists ``(module, "weight")`` pairs of the whole model (and, for the lottery ticket, copies of
  their modules): the list keeps this rank's pairs, and global L1 pruning finds the one-process threshold over the
  pipeline (:func:`global_l1_unstructured`).

The optimizers are built with the whole model's parameter groups (``Cut.registered_everywhere``), so every rank's
groups line up with one process's; a callback that adds a group later (``BaseFinetuning``) adds it only on ranks that
hold some of its parameters, and :func:`align_param_groups` adds the group, empty, on the others.

Per-rank state in checkpoints (SWA's averaged model, ``WeightAveraging``'s ``current_model_state``) is set aside
for the distributed checkpoint by :func:`local_states`; ``BaseFinetuning``'s parameter-group metadata is merged over
the ranks by :func:`merge_finetuning_metadata` and applied on resume by :func:`before_restore`.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch import Tensor, nn
from torch.nn.utils import prune as torch_prune

from lightning_pipe._compat.lightning import averaged_model_like
from lightning_pipe._fingerprint import differs
from lightning_pipe._rank_states import marker

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

#: Keys under which per-rank state dicts are stored in a distributed checkpoint (``<key>.<stored name>``).
CURRENT_MODEL_STATE = "current_model_state"
AVERAGE_MODEL_STATE = "average_model_state"


# ------------------------------------------------------------------------------------------------ after the cut
def after_cut(
    callbacks: list[pl.Callback], module: nn.Module, *, tied: set[int], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Retake what callbacks took from the whole module in ``setup``, now from this rank's share.

    Called on every rank right after the cut and the materialisation of the rank's tensors, before the precision
    plugin converts the module (one process takes its copies before the conversion too).

    Args:
        tied: ids of the parameters held on several ranks or under several names.
        group: this rank's pipeline.
    """
    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            if callback._average_model is not None:
                callback._average_model = _copy_on_cpu(module)
        elif isinstance(callback, WeightAveraging):
            old = callback._average_model
            if old is not None:
                device = next(iter(old.parameters()), torch.empty(0)).device
                callback._average_model = averaged_model_like(callback, module, device)
        elif isinstance(callback, ModelPruning):
            _prune_own_share(callback, module, tied, group, device)


def _copy_on_cpu(module: nn.Module) -> nn.Module:
    """``deepcopy(module)`` (what SWA's ``setup`` does), kept on the CPU until SWA moves it, as one process does."""
    copy = deepcopy(module)
    return copy.to("cpu") if any(t.device.type != "cpu" for t in copy.state_dict().values()) else copy


def _prune_own_share(
    callback: ModelPruning, module: nn.Module, tied: set[int], group: dist.ProcessGroup, device: torch.device
) -> None:
    pairs = callback._parameters_to_prune
    own = [(i, m, n) for i, (m, n) in enumerate(pairs) if _registered(m, n) is not None]
    shared = [n for _, m, n in own if id(_registered(m, n)) in tied]
    if dist.get_world_size(group) > 1:  # every rank raises, not only those holding a tie
        every: list[Optional[list[str]]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, shared, group=group)
        shared = sorted({n for names in every for n in names})
    if shared:
        raise ValueError(
            f"`ModelPruning` would prune parameters that are tied or shared ({shared[:4]}): the pipeline holds a copy"
            " per stage and per name, which a mask on one of them would split. Pass `parameters_to_prune` without"
            " them."
        )
    callback._parameters_to_prune = [(m, n) for _, m, n in own]
    originals = callback._original_layers
    if originals is not None:  # the lottery ticket: copies of this rank's modules as they are now (initialised)
        renumber = {old: new for new, (old, _, _) in enumerate(own)}
        retaken = {}
        for key, ref in originals.items():
            names = [(renumber[i], name) for i, name in ref["names"] if i in renumber]
            if names:
                owner = pairs[ref["names"][0][0]][0]
                retaken[key] = {"data": deepcopy(owner), "names": names}
        callback._original_layers = retaken
    if callback._use_global_unstructured and dist.get_world_size(group) > 1:
        if callback.pruning_fn is not torch_prune.L1Unstructured:
            raise ValueError(
                f"`ModelPruning(use_global_unstructured=True)` with {callback.pruning_fn!r}: under `PipelineStrategy`"
                " each stage holds its own weights, and only 'l1_unstructured' is pruned globally over the stages"
                " (with the one-process threshold). Use 'l1_unstructured' or `use_global_unstructured=False`."
            )

        def apply(amount: Union[int, float], _callback: ModelPruning = callback) -> None:
            global_l1_unstructured(_callback._parameters_to_prune, amount, group, device)

        callback._apply_global_pruning = apply


def _registered(module: nn.Module, name: str) -> Optional[nn.Parameter]:
    """The parameter ``module`` holds as ``name`` (or as ``name_orig`` once pruned), ``None`` if another rank holds
    it."""
    value = module._parameters.get(name, module._parameters.get(f"{name}_orig"))
    return value if isinstance(value, nn.Parameter) else None


def global_l1_unstructured(
    pairs: list[tuple[nn.Module, str]], amount: Union[int, float], group: dist.ProcessGroup, device: torch.device
) -> None:
    """``torch.nn.utils.prune.global_unstructured(pairs, L1Unstructured, amount=amount)`` over the pairs of every
    rank of ``group``: the same threshold as over the whole model, found without gathering the weights.

    The entries still unpruned are ranked by ``|w|``. Non-negative floats order like the integers of their bit
    patterns, so the ``k``-th smallest is found by bisection on those integers, one scalar all-reduce per step
    (at most 64). Entries equal to the threshold are pruned in rank order (torch's ``topk`` breaks such ties in an
    unspecified order). ``device``: where the group's collectives run (a rank may hold no pair at all)."""
    scores = [getattr(m, n).detach().reshape(-1) for m, n in pairs]
    masks = [getattr(m, f"{n}_mask", None) for m, n in pairs]
    masks = [torch.ones_like(s) if k is None else k.reshape(-1).to(s.dtype) for s, k in zip(scores, masks)]
    flat = torch.cat(scores) if scores else torch.empty(0, device=device)
    mask = torch.cat(masks) if masks else torch.empty(0, device=device)
    alive = mask == 1
    bits = flat[alive].abs().double().view(torch.int64)

    def total(value: int, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=op, group=group)
        return int(t.item())

    n = total(bits.numel())
    k = torch_prune._compute_nparams_toprune(amount, n)
    torch_prune._validate_pruning_amount(k, n)
    prune_local = torch.zeros_like(bits, dtype=torch.bool)
    if k > 0:
        lo, hi = 0, total(int(bits.max()) if bits.numel() else 0, dist.ReduceOp.MAX)
        while lo < hi:  # the smallest t with count(bits <= t) >= k
            mid = lo + (hi - lo) // 2
            if total(int((bits <= mid).sum())) >= k:
                hi = mid
            else:
                lo = mid + 1
        below = bits < lo
        ties = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
        ties[dist.get_rank(group)] = int((bits == lo).sum())
        dist.all_reduce(ties, group=group)
        wanted = k - total(int(below.sum()))
        quota = min(max(wanted - int(ties[: dist.get_rank(group)].sum()), 0), int(ties[dist.get_rank(group)]))
        equal = (bits == lo).nonzero().flatten()[:quota]
        prune_local = below
        prune_local[equal] = True
    new_mask = mask.clone()
    alive_index = alive.nonzero().flatten()
    new_mask[alive_index[prune_local]] = 0
    offset = 0
    for (module, name), score in zip(pairs, scores):
        part = new_mask[offset : offset + score.numel()].view_as(getattr(module, name))
        torch_prune.custom_from_mask(module, name, mask=part)
        offset += score.numel()


# ------------------------------------------------------------------------------------------------ optimizers
def align_param_groups(
    optimizers: list[torch.optim.Optimizer],
    group: dist.ProcessGroup,
    device: torch.device,
    callbacks: list[pl.Callback] = (),
) -> None:
    """Give every rank of the pipeline the same number of parameter groups per optimizer.

    ``BaseFinetuning.unfreeze_and_add_param_group`` adds a group only where the rank holds some of its parameters;
    the ranks without them get the group, empty, with the same hyper-parameters (torch steps an empty group as
    nothing). A checkpoint then merges the groups by position, ``LearningRateMonitor`` logs what one process logs,
    and the callback's later changes to the last group land on the same group everywhere. The ``BaseFinetuning``
    callbacks among ``callbacks`` record the empty group too, so that their stored groups keep the same positions on
    every rank. One small all-reduce; the hyper-parameters are only exchanged when the counts differ."""
    if not optimizers or dist.get_world_size(group) == 1:
        return
    counts = torch.tensor([len(o.param_groups) for o in optimizers], dtype=torch.int64, device=device)
    if not differs(counts, group):
        return
    hyper = [
        [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in o.param_groups] for o in optimizers
    ]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, hyper, group=group)
    for idx, optimizer in enumerate(optimizers):
        longest = max((per_rank[idx] for per_rank in gathered), key=len)
        for extra in longest[len(optimizer.param_groups) :]:
            empty = {**extra, "params": []}
            if "param_names" in optimizer.param_groups[0]:  # torch refuses to mix named and unnamed groups
                empty["param_names"] = []
            optimizer.add_param_group(empty)
            for callback in callbacks:
                if isinstance(callback, BaseFinetuning):
                    callback._internal_optimizer_metadata.get(idx, []).append({**extra, "params": []})
    log.debug("aligned parameter groups: %s", [len(o.param_groups) for o in optimizers])


# ------------------------------------------------------------------------------------------------ checkpoints
def local_states(checkpoint: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Take the per-rank state dicts out of Lightning's ``checkpoint`` (in place, leaving a marker, see
    :mod:`lightning_pipe._rank_states`): ``{stored key: state dict with this rank's names}``."""
    out: dict[str, dict[str, Tensor]] = {}
    if _is_state(checkpoint.get(CURRENT_MODEL_STATE)):  # WeightAveraging.on_save_checkpoint
        out[CURRENT_MODEL_STATE] = checkpoint[CURRENT_MODEL_STATE]
        checkpoint[CURRENT_MODEL_STATE] = marker(CURRENT_MODEL_STATE)
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, dict):
        callbacks = checkpoint["callbacks"] = dict(callbacks)
        for i, key in enumerate(sorted(callbacks, key=str)):
            state = callbacks[key]
            if isinstance(state, dict) and _is_state(state.get(AVERAGE_MODEL_STATE)):  # SWA.state_dict
                name = f"callback_{i}_{AVERAGE_MODEL_STATE}"
                out[name] = state[AVERAGE_MODEL_STATE]
                callbacks[key] = {**state, AVERAGE_MODEL_STATE: marker(name)}
    return out


def keep_own_states(checkpoint: dict[str, Any], own: set[str]) -> None:
    """In a one-process checkpoint, keep this rank's entries (``own``: its state-dict names) of the per-rank state
    dicts, which hold the whole model's."""
    if _is_state(checkpoint.get(CURRENT_MODEL_STATE)):
        checkpoint[CURRENT_MODEL_STATE] = {k: v for k, v in checkpoint[CURRENT_MODEL_STATE].items() if k in own}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if isinstance(state, dict) and _is_state(state.get(AVERAGE_MODEL_STATE)):
            kept = {k: v for k, v in state[AVERAGE_MODEL_STATE].items() if k in own}
            checkpoint["callbacks"][key] = {**state, AVERAGE_MODEL_STATE: kept}


def _is_state(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


def merge_finetuning_metadata(checkpoint: dict[str, Any], gather: Callable[[Any], list[Any]]) -> None:
    """``BaseFinetuning`` stores each optimizer's parameter groups by parameter name; each rank knows its own names.
    Merge them over all ranks (group by group) into the checkpoint rank 0 writes. Every rank calls it."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return
    keys = sorted(
        (k for k, v in callbacks.items() if isinstance(v, dict) and "internal_optimizer_metadata" in v), key=str
    )
    gathered = gather([callbacks[k]["internal_optimizer_metadata"] for k in keys])
    for pos, key in enumerate(keys):
        merged: dict[int, list[dict[str, Any]]] = {}
        for per_rank in gathered:
            for opt_idx, groups in per_rank[pos].items():
                target = merged.setdefault(opt_idx, [])
                for g, group in enumerate(groups):
                    if g == len(target):
                        target.append({**group, "params": list(group["params"])})
                    else:
                        target[g]["params"] += [n for n in group["params"] if n not in target[g]["params"]]
        callbacks[key] = {**callbacks[key], "internal_optimizer_metadata": merged}


def before_restore(trainer: Optional[pl.Trainer], checkpoint: dict[str, Any], module: nn.Module) -> None:
    """What callbacks do in ``on_fit_start`` with restored state, which under the pipeline is restored after
    ``on_fit_start`` (the module must be cut before it can load): SWA clears the LR schedulers it will replace, and
    ``BaseFinetuning`` rebuilds the optimizers' parameter groups (this rank's parameters of each)."""
    keep_own_states(checkpoint, set(module.state_dict()))
    if trainer is None or trainer.state.fn != "fit":
        return
    states = checkpoint.get("callbacks") or {}
    for callback in trainer.callbacks:
        state = states.get(callback.state_key)
        if not isinstance(state, dict):
            continue
        if isinstance(callback, StochasticWeightAveraging) and state.get("scheduler_state") is not None:
            callback._clear_schedulers(trainer)
        elif isinstance(callback, BaseFinetuning) and state.get("internal_optimizer_metadata"):
            named = dict(module.named_parameters())
            for opt_idx, optimizer in enumerate(trainer.optimizers):
                groups = state["internal_optimizer_metadata"].get(opt_idx)
                if groups:
                    optimizer.param_groups = [
                        {
                            **{k: v for k, v in g.items() if k != "params"},
                            "params": [named[n] for n in g["params"] if n in named],
                        }
                        for g in groups
                    ]


def after_restore(callbacks: list[pl.Callback]) -> None:
    """After Lightning restored the callbacks' state (training starts): ``BaseFinetuning``'s groups are in place."""
    for callback in callbacks:
        if isinstance(callback, BaseFinetuning):
            callback._restarting = False  # its restored groups are in place, as its on_fit_start says
