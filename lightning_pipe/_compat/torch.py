"""torch's private names the package needs, and the workarounds that use them (see :mod:`lightning_pipe._compat`)."""

from __future__ import annotations

import atexit
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist


def mesh_group_options(sizes: dict[str, int], world_size: int, backend: str, timeout: Any) -> dict[str, Any]:
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


def read_dcp_in_one_process(path: Any, keys: Optional[set[str]] = None, storage_reader: Any = None) -> dict[str, Any]:
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


def keep_forward_actions(schedule: Any) -> None:
    """Make a schedule built from a compute-only action list (the multi-stage ones) run its forward actions only, in
    their order: a forward-only pass."""
    from torch.distributed.pipelining.schedules import FORWARD

    def forwards(action: Any) -> list[Any]:
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
