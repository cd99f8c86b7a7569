"""torch's private names the package needs, and the workarounds that use them (see :mod:`lightning_pipe._compat`)."""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.autograd.graph import Node
    from torch.distributed.checkpoint import StorageReader
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action
    from torch.distributed.tensor.parallel import ParallelStyle


def mesh_group_options(
    sizes: dict[str, int], world_size: int, backend: str, timeout: Optional[timedelta]
) -> dict[str, tuple[str, Any]]:
    """``init_device_mesh(backend_override=...)`` that gives every sub-group of the mesh the default group's timeout.

    ``init_device_mesh`` creates a mesh dimension's groups with the timeout of its backend options, and without
    options with ``new_group``'s default (30 minutes), not the default group's: ``PipelineStrategy(timeout=...)``
    would not reach the pipeline groups when there are several replicas. A dimension that spans every process
    reuses the default group (which has the timeout) and gets no override, which would make torch create a copy;
    but gloo on a machine with CUDA, for which torch creates a new group anyway. Backend options are private to
    torch: ``ProcessGroupGloo._Options`` and the ``_timeout`` attribute.
    """
    if timeout is None:
        return {}
    if backend == "gloo":
        options_class = getattr(dist.ProcessGroupGloo, "_Options", None)
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options_class = dist.ProcessGroupNCCL.Options
    else:
        options_class = None
    if options_class is None:
        return {}
    overrides = {}
    for name, size in sizes.items():
        # torch reuses the default group for such a dimension, except for gloo on a machine with CUDA
        if size == world_size and not (backend == "gloo" and torch.cuda.is_available()):
            continue
        options = options_class()
        options._timeout = timeout
        overrides[name] = (backend, options)
    return overrides


_exit_hook_registered = False


def destroy_process_groups_at_exit() -> None:
    """Register :func:`_release_process_groups` to run at exit, before the interpreter is torn down; once per
    process (Lightning registers ``destroy_process_group`` at exit for NCCL only, in ``_init_dist_connection``)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_release_process_groups)
        _exit_hook_registered = True


def _release_process_groups() -> None:
    """Destroy every process group, then let gloo's worker threads finish with the tensors of the last collectives.

    A gloo worker that completes a collective drops its reference to the collective's tensors after the caller has
    resumed; for a tensor that Python also knew, that takes the GIL. If the interpreter has begun finalizing by
    then, CPython ends the thread with ``pthread_exit``, whose unwinding through a ``noexcept`` C++ destructor calls
    ``std::terminate``: "terminate called without an active exception", exit code 134 after a successful run. The
    last collectives of a fit (the all-reduce of a ``sync_dist`` log at the end of the epoch) come milliseconds
    before exit. ``destroy_process_group`` alone does not close the race: a group that Python objects still
    reference (the pipeline's stages and log channels, Lightning's logged results) is only shut down, and its
    threads live on. So this hook also releases the GIL until those threads are idle (bounded).
    """
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    _destroy_dist_connection()  # a no-op if the user destroyed the groups already
    _wait_for_idle_gloo_threads()


def _wait_for_idle_gloo_threads(timeout: float = 2.0, poll: float = 0.005) -> None:
    """Sleep (the GIL is free meanwhile) until every gloo worker thread of this process sleeps and has not run for
    one poll interval, or ``timeout`` passes. Linux reads the threads' state from ``/proc``; elsewhere, one pause."""
    deadline = time.monotonic() + timeout
    last: Optional[dict[str, tuple[str, str]]] = None
    while time.monotonic() < deadline:
        time.sleep(poll)
        state = _gloo_thread_state()
        if state is None:
            time.sleep(0.05)
            return
        if state == last and all(run_state == "S" for run_state, _ in state.values()):
            return
        last = state


def _gloo_thread_state() -> Optional[dict[str, tuple[str, str]]]:
    """``{tid: (state, cpu_time_ns)}`` of gloo's worker threads (``pt_gloo_runloop``), or ``None`` without ``/proc``."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    state = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                run_state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu_time = f.read().split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        state[tid] = (run_state, cpu_time)
    return state


def read_dcp_in_one_process(
    path: Union[str, os.PathLike], keys: Optional[set[str]] = None, storage_reader: Optional[StorageReader] = None
) -> dict[str, Any]:
    """Every entry of a DCP checkpoint (or those under ``keys``), read in this process alone (no process group),
    through ``storage_reader`` (default: torch's ``FileSystemReader`` of ``path``)."""
    import torch.distributed.checkpoint as dcp

    reader = storage_reader if storage_reader is not None else dcp.FileSystemReader(path)
    state: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:  # a torch without these private names: public `dcp.load` into a template built from the index
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = reader.read_metadata()
        for fqn, meta in metadata.state_dict_metadata.items():
            where = tuple((metadata.planner_data or {}).get(fqn, (fqn,)))
            if keys is not None and not any(".".join(map(str, where[: i + 1])) in keys for i in range(len(where))):
                continue
            node = state
            for part in where[:-1]:
                node = node.setdefault(part, {})
            tensor = isinstance(meta, TensorStorageMetadata)
            node[where[-1]] = torch.empty(meta.size, dtype=meta.properties.dtype) if tensor else None
        dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return state
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return state


#: ``torch.distributed.pipelining.schedules`` globals every schedule posts and waits for its transfers through.
P2P_POST = "_batch_p2p"
P2P_WAIT = "_wait_batch_p2p"
#: The schedule method that runs the loss after each forward of the last stage.
SCHEDULE_LOSS_METHOD = "_maybe_compute_loss"


def job_store() -> Optional[dist.Store]:
    """The key-value store every process of the job shares (the default process group's, which rank 0's process
    serves), or ``None`` before the process group exists: where a failing rank leaves its error for the others
    (:mod:`lightning_pipe._lightning.processes`). torch has no public handle on it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


class Swaps:
    """Instance attributes put over what objects the package does not own answer, all put back on exit, also on
    error, in the reverse order: every patch of the package goes through here.

    - the timeline's recorder wraps torch's pipelining objects (a stage's ``forward_one_chunk``, a schedule's
      ``_maybe_compute_loss``, the schedules module's ``_batch_p2p``): torch has no hook on a stage's actions or its
      transfers;
    - a generating step routes the calls of the user's model (``module.forward``) through the pipeline
      ([Note: lock step]): Python has no other way to see a call of a module that is not a block;
    - a generation pass's key-value caches answer beam search's ``reorder_cache`` on the microbatches' caches and
      refuse what cannot be split ([Note: caches per microbatch]): Hugging Face's ``Cache`` has no hook for either.

    :meth:`wrap` wraps what the attribute is now (left alone where the object lacks it: the recorder then records
    less); :meth:`put` sets a value whether or not there was one.
    """

    def __init__(self) -> None:
        self._restore: list[tuple[Any, str, bool, Any]] = []  # (owner, name, had an own attribute, that attribute)

    def wrap(self, owner: Any, name: str, wrapper_factory: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        self.put(owner, name, wrapper_factory(original))

    def put(self, owner: Any, name: str, value: object) -> None:
        had = name in vars(owner)  # an instance (or module) attribute already: put that back afterwards
        self._restore.append((owner, name, had, vars(owner).get(name)))
        vars(owner)[name] = value  # past a class's own __setattr__

    def names_on(self, owner: object) -> list[str]:
        """The attributes put on ``owner`` (a copy of it carries them too)."""
        return [name for o, name, _, _ in self._restore if o is owner]

    def __enter__(self) -> "Swaps":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Put back everything, last first; the object may be used again."""
        for owner, name, had, previous in reversed(self._restore):
            if had:
                vars(owner)[name] = previous
            else:
                vars(owner).pop(name, None)
        self._restore.clear()


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


# ---------------------------------------------------------------------------------------------- FSDP2 (fully_shard)
# torch 2.13's public FSDP2 surface (`fully_shard`, `FSDPModule.unshard/reshard/set_*`) drives one backward per step.
# A pipeline runs one backward per microbatch and learns the step's loss weights only after the last one (see
# `_step/loss_weights.py`), so the strategy defers the reduce-scatter as torch's own `PipelineStage` does for an
# `FSDPModule` (`perform_reduce_grad`: the `FSDPParamGroup.post_backward` of every group, then the root's final
# callback), scales the accumulated unsharded gradients first, and keeps FSDP's forward hooks out of the runs on
# ghosts (shape probes), which must not all-gather. Checked against torch 2.13, 2.14 and 2.15.


def fsdp_state(unit: FSDPModule) -> FSDPState:
    """The ``FSDPState`` of a module ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(unit)  # type: ignore[attr-defined]


def fsdp_params(unit: FSDPModule) -> list[FSDPParam]:
    """The ``FSDPParam`` objects of a unit (its sharded and unsharded parameters, and its accumulated gradients)."""
    group = fsdp_state(unit)._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def fsdp_sharded_params(unit: FSDPModule) -> list[torch.nn.Parameter]:
    """The sharded parameters of a unit, whether it is sharded now or not (while unsharded, the module registers its
    unsharded parameters instead)."""
    return [p.sharded_param for p in fsdp_params(unit)]


def fsdp_lazy_init(unit: FSDPModule) -> None:
    """Initialise the unit as its own root now, as its first forward would."""
    fsdp_state(unit)._lazy_init()


def fsdp_modules_in(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class fsdp_hooks_suspended:
    """Within the block, FSDP's forward hooks of every sharded module under ``module`` do not run: a run on ghosts
    (a shape probe) neither all-gathers nor swaps parameters. The hook tables are restored as they were."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.saved: list[tuple[dict, dict]] = []

    def __enter__(self) -> None:
        for m in fsdp_modules_in(self.module):
            for table in (m._forward_pre_hooks, m._forward_hooks):
                state_hooks = [
                    k for k, fn in table.items() if type(getattr(fn, "__self__", None)).__name__ == "FSDPState"
                ]
                if state_hooks:
                    self.saved.append((table, dict(table)))
                    for k in state_hooks:
                        del table[k]

    def __exit__(self, *exc: object) -> None:
        for table, before in reversed(self.saved):
            table.clear()
            table.update(before)
        self.saved.clear()


def fsdp_defer_reduction(unit: FSDPModule) -> None:
    """Accumulate this step's microbatch gradients unsharded, with no reduce-scatter and no reshard in backward."""
    unit.set_is_last_backward(False)
    unit.set_reshard_after_backward(False)
    unit.set_requires_gradient_sync(False)


def fsdp_scale_unsharded_grads(unit: FSDPModule, scale: float) -> None:
    """Multiply the unsharded gradients the unit accumulated this step by ``scale`` (before they are reduced)."""
    grads = []
    for p in fsdp_params(unit):
        if p.unsharded_accumulated_grad is not None:
            grads.append(p.unsharded_accumulated_grad)
        if hasattr(p, "_unsharded_param") and p.unsharded_param.grad is not None:
            grads.append(p.unsharded_param.grad)
    if grads:
        torch._foreach_mul_(grads, scale)


def fsdp_reduce_now(unit: FSDPModule) -> None:
    """Reduce-scatter (and, for HSDP, all-reduce) the accumulated gradients into the sharded ``.grad`` and reshard,
    as ``PipelineStage.perform_reduce_grad`` does for an ``FSDPModule``."""
    unit.set_is_last_backward(True)
    unit.set_reshard_after_backward(True)
    unit.set_requires_gradient_sync(True)
    state = fsdp_state(unit)
    for group in state._fsdp_param_groups:
        group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_reduce_in_backward(
    unit: FSDPModule, around: Callable[[Callable[[float], None]], None]
) -> Callable[[], None]:
    """Let ``unit`` reduce-scatter in its own post-backward hook during the next backward, as FSDP does outside a
    pipeline, with ``around(reduce)`` wrapping each call: ``reduce(scale)`` multiplies the accumulated unsharded
    gradients by ``scale`` and runs FSDP's post-backward. Returns the function that puts the unit back to deferred
    reduction. The wrapper is an instance attribute of each ``FSDPParamGroup``: FSDP's autograd function calls
    ``param_group.post_backward()`` through it."""
    unit.set_is_last_backward(True)
    unit.set_reshard_after_backward(True)
    unit.set_requires_gradient_sync(True)
    groups = list(fsdp_state(unit)._fsdp_param_groups)
    for group in groups:
        original = group.post_backward

        def post_backward(*args: Any, _original: Callable[..., None] = original) -> None:
            def reduce(scale: float) -> None:
                if scale != 1.0:
                    fsdp_scale_unsharded_grads(unit, scale)
                return _original(*args)

            return around(reduce)

        group.post_backward = post_backward

    def undo() -> None:
        for group in groups:
            vars(group).pop("post_backward", None)
        fsdp_defer_reduction(unit)

    return undo


# ---------------------------------------------------------------------------------------------- tensor parallelism
@contextmanager
def parallel_styles_recorded(record: Callable[[ParallelStyle, torch.nn.Module, DeviceMesh], object]) -> Iterator[None]:
    """Within the block, ``parallelize_module`` (and every other use of torch's own ``ParallelStyle`` classes) records
    ``record(style, module, device_mesh)`` instead of splitting the module: a ``configure_model`` written for
    Lightning's ``ModelParallelStrategy`` runs before the pipeline cut, and the strategy applies what it asked for to
    each rank's own blocks after it. ``parallelize_module`` applies a plan through each style's ``_apply(module,
    device_mesh)``; the classes' ``_apply`` are swapped for the duration (torch 2.13 to 2.15)."""
    from torch.distributed.tensor.parallel import style as styles

    classes = [
        c for c in vars(styles).values()
        if isinstance(c, type) and issubclass(c, styles.ParallelStyle) and "_apply" in vars(c)
        and c is not styles.ParallelStyle
    ]
    saved = {c: vars(c)["_apply"] for c in classes}

    def recorded(self: ParallelStyle, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        record(self, module, device_mesh)
        return module

    for c in classes:
        c._apply = recorded  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for c, original in saved.items():
            c._apply = original  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- configure_model's FSDP
@contextmanager
def fully_shard_recorded(
    record: Callable[[Union[torch.nn.Module, list[torch.nn.Module]], dict[str, Any]], object]
) -> Iterator[None]:
    """Within the block, ``fully_shard(module, **kwargs)`` records ``record(module, kwargs)`` and leaves the module as
    it is: a ``configure_model`` written for Lightning's ``ModelParallelStrategy`` runs before the pipeline cut, and
    the strategy shards each rank's own stage after it, as that call asked ([Note: configure_model's calls]).

    Users import ``fully_shard`` by name (from ``torch.distributed.fsdp`` or the older
    ``torch.distributed._composable.fsdp``), so replacing a module attribute would intercept nothing. ``fully_shard``
    is ``contract(state_cls=FSDPState)`` around the function that shards: the one function object every import
    name binds to keeps that function in a closure cell, swapped here for the recorder while the block runs.
    ``contract``'s wrapper also registers an empty state on the module (under ``contract``'s ``STATE_KEY`` and
    ``REGISTRY_KEY``), taken off again, so that the strategy's own ``fully_shard`` can apply later (torch 2.13 to
    2.15)."""
    import importlib

    from torch.distributed.fsdp import fully_shard

    contract_module = importlib.import_module("torch.distributed._composable.contract")

    cells = [c for c in (fully_shard.__closure__ or ()) if callable(c.cell_contents)
             and getattr(c.cell_contents, "__name__", "") == "fully_shard"]
    if len(cells) != 1:
        raise RuntimeError("lightning_pipe: this torch's `fully_shard` has no inner function to record (2.13-2.15 do).")
    cell, original = cells[0], cells[0].cell_contents
    touched: list[torch.nn.Module] = []

    def recorded(
        module: Union[torch.nn.Module, list[torch.nn.Module]], *args: Any, **kwargs: Any
    ) -> Union[torch.nn.Module, list[torch.nn.Module]]:
        if args:
            raise TypeError("fully_shard takes its options as keyword arguments")
        modules = [module] if isinstance(module, torch.nn.Module) else list(module)
        touched.extend(modules)
        record(module, kwargs)
        return module

    recorded.__name__ = original.__name__  # the registry key `contract` takes
    cell.cell_contents = recorded
    try:
        yield
    finally:
        cell.cell_contents = original
        for module in touched:
            vars(module).get(contract_module.STATE_KEY, {}).pop(recorded, None)
            vars(module).get(contract_module.REGISTRY_KEY, {}).pop("fully_shard", None)


def checkpoint_wrappers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
    """``(parent, name, wrapper, wrapped)`` of each ``checkpoint_wrapper`` child in ``module``, outermost first.
    ``CheckpointWrapper`` and its ``_checkpoint_wrapped_module`` live in a private module of torch
    (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``), the only place ``checkpoint_wrapper`` is
    offered (torch 2.13 to 2.15). Another activation wrapper (``offload_wrapper``) raises ``ValueError``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, CheckpointWrapper

    found = []
    for parent_name, parent in module.named_modules():
        for name, child in parent._modules.items():
            if isinstance(child, CheckpointWrapper):
                found.append((parent, name, child, child._checkpoint_wrapped_module))
            elif isinstance(child, ActivationWrapper):
                raise ValueError(
                    f"`{f'{parent_name}.{name}'.lstrip('.')}` is wrapped in `{type(child).__name__}`: under"
                    " `PipelineStrategy` only `checkpoint_wrapper` is honoured (as"
                    " `PipelineStrategy(activation_checkpointing=...)`). Remove the wrapper."
                )
    return found


def ghost_safe_init(swaps: Swaps) -> None:
    """Until ``swaps`` closes, ``torch.nn.init.trunc_normal_`` leaves a ghost (a parameter another stage holds) as it
    is; put once however often this is called.

    A model's own ``init_weights`` runs over the whole model on every rank (Lightning's tensor-parallel example calls
    it in ``on_train_start``). In-place initialisers on ghosts do nothing already (a ghost computes on the meta
    device), but torch 2.13's ``trunc_normal_`` redraws by rejection, reading ``mask.any()``, a value a ghost does
    not have. ``trunc_normal_`` has no ``__torch_function__`` override point, so the module attribute is swapped
    (user code calls it as ``nn.init.trunc_normal_``); every other tensor goes to torch's own."""
    from torch.nn import init

    from lightning_pipe._ghost import Ghost

    def leaving_ghosts(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return tensor if isinstance(tensor, Ghost) else original(tensor, *args, **kwargs)

        return trunc_normal_

    if "trunc_normal_" not in swaps.names_on(init):
        swaps.wrap(init, "trunc_normal_", leaving_ghosts)


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


# [Note: undoing a stage's parallelization]
# After a Trainer call the module becomes whole again (`_model/whole.py`): every module `parallelize_stage` touched
# must be a plain module once more, or a forward on one rank would all-gather (FSDP's hooks) or redistribute
# (tensor-parallel hooks) alone and hang. torch has no public inverse of `fully_shard` or `parallelize_module`:
# `fully_shard` swaps the class for `FSDP<Class>`, adds forward and state-dict hooks, stores its state in the
# module's `__dict__` (`contract`'s registry) and in `torch.distributed._composable_state._module_state_mapping`;
# `parallelize_module` adds forward hooks. So the setup takes a snapshot of every module's class, hook tables and
# `__dict__` keys before it parallelizes, and `restore_modules` puts them back (parameters are set afterwards by the
# caller). Checked against torch 2.13, 2.14 and 2.15.
_HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


#: What ``distribute_module`` (under ``parallelize_module``) marks a module with; ``contract``'s state and registry
#: keys (``fully_shard``) start with ``__``.
_PARALLEL_MARKS = ("_distribute_module_applied",)


class ModuleSnapshot:
    """Each module's class, hook tables and ``__dict__`` keys as they were (:func:`restore_modules`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.entries = [
            (m, type(m), {t: dict(getattr(m, t)) for t in _HOOK_TABLES if hasattr(m, t)}, set(m.__dict__))
            for m in module.modules()
        ]


def restore_modules(snapshot: ModuleSnapshot) -> None:
    """Give every module of ``snapshot`` its class, hook tables and ``__dict__`` keys back, and forget FSDP's state
    for it, so that ``fully_shard`` may be applied to it again ([Note: undoing a stage's parallelization])."""
    from torch.distributed import _composable_state

    for m, cls, tables, keys in snapshot.entries:
        _composable_state._module_state_mapping.pop(m, None)
        if type(m) is not cls:
            m.__class__ = cls
        for name, before in tables.items():
            table = getattr(m, name)
            table.clear()
            table.update(before)
        for key in [k for k in m.__dict__ if k not in keys and (k.startswith("__") or k in _PARALLEL_MARKS)]:
            del m.__dict__[key]
