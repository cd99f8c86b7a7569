"""torch's private names the package needs, and the workarounds that use them (see :mod:`lightning_pipe._compat`):
process groups (their timeouts, their release at exit, the job's store), reading a DCP checkpoint in one process,
:class:`Swaps` (every instance-attribute patch), finding ``checkpoint_wrapper``s, ``trunc_normal_`` leaving ghosts
alone, and the torch function mode on top of the stack. The pipelining names are in :mod:`.pipelining`, FSDP2's and
tensor parallelism's in :mod:`.parallel`."""

from __future__ import annotations

import atexit
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed.checkpoint import StorageReader


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


def top_function_mode() -> Optional[torch.overrides.TorchFunctionMode]:
    """The ``TorchFunctionMode`` on top of torch's mode stack (``None``: none is active). torch has no public getter;
    the loss observer pops itself only when it is on top (``_step/loss_weights.py``: ``MeanObserver.paused``)."""
    return torch.overrides._get_current_function_mode()
