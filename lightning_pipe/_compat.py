"""Every use of a private name of Lightning, torch or torchmetrics, and every patch, in one place.

Each entry says why no public route exists and which versions it was checked against. :data:`PRIVATE_NAMES` lists
every private name the package uses, these and the few that other modules reach for directly (``nn.Module``'s
tables, pytree, the ghost tensor's subclass hooks, pruning's amount checks, the strategy's protected members), and
``tests/test_compat.py`` checks that each exists. When a supported release moves one of these names, this module is
the one to change (and the torch range in ``pyproject.toml``). Module-level imports are torch only:
``lightning_pipe.timeline`` imports this module without Lightning.

Lightning (checked against 2.6.6):

- ``lightning.fabric.utilities.distributed``: ``_init_dist_connection``, ``_destroy_dist_connection``,
  ``_get_default_process_group_backend_for_device``, ``_sync_ddp_if_available``, ``_distributed_is_initialized``;
  ``lightning.fabric.utilities.optimizer``: ``_optimizers_to_device``. Every Lightning strategy (DDP, FSDP,
  ModelParallel) starts its process group and moves its optimizers with these helpers; there is no public
  equivalent.
- ``lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher``: the launcher DDP uses to
  start the other ranks (a strategy without a launcher runs rank 0 only); ``procs`` and ``kill`` end them after a
  failure.
- ``_EvaluationLoop``/``_FitLoop``/``_PredictionLoop._data_source``: the only handle on the user's loader of the
  running stage (loader, datamodule or module hook) before the loop iterates it; ``balance="time"`` profiles its
  first batch.
- ``LightningModule._device_mesh``: what ``LightningModule.device_mesh`` returns; Lightning's ModelParallelStrategy
  sets it the same way (:func:`set_device_mesh`).
- ``Strategy._launcher``, ``_precision_plugin``, ``_layer_sync`` and the ``_configure_launcher`` hook: the protected
  members every Lightning strategy subclass sets or reads (the launcher it starts, the precision plugin behind the
  ``precision_plugin`` property, the plugin ``sync_batchnorm=True`` installs).
- ``ModelSummary._summary`` (the callback's way to its summary; Lightning special-cases only DeepSpeed there): the
  strategy gives ``Trainer.callbacks`` a copy of each summary callback whose ``_summary`` counts the whole model
  (``_summary.summarize_whole_model``).
- ``ThroughputMonitor._throughputs`` (its ``Throughput`` per stage, built in the callback's ``setup`` with
  ``world_size=trainer.world_size``): every rank of a pipeline processes the same batch, so the global figures must
  count data-parallel replicas, not processes (:func:`count_replicas_in_throughput`).
- The state built-in callbacks take from the whole module in their ``setup`` hook, before the cut, retaken from this
  rank's share after it (:mod:`lightning_pipe._callbacks`; Lightning has no hook between a strategy's cut and the
  callbacks): ``StochasticWeightAveraging``/``WeightAveraging._average_model`` (and ``WeightAveraging._use_buffers``,
  ``_kwargs``, the arguments of its ``AveragedModel``); ``ModelPruning._parameters_to_prune``, ``_original_layers``,
  ``_use_global_unstructured`` and its ``_apply_global_pruning`` method (replaced per instance by the pipeline-wide
  L1 threshold). Restoring state that one process restores before ``on_fit_start`` (the pipeline restores after it,
  ``restore_checkpoint_after_setup``): ``StochasticWeightAveraging._clear_schedulers`` (what its ``on_fit_start``
  does with a restored scheduler state) and ``BaseFinetuning._restarting`` (its ``on_fit_start`` consumed it);
  ``BaseFinetuning._internal_optimizer_metadata``: the empty groups the pipeline adds are recorded there too, so
  that the stored groups keep their positions on every rank.
- ``Trainer._accelerator_connector.use_distributed_sampler`` and
  ``lightning.pytorch.utilities.data._update_dataloader``: with one pipeline (no data parallelism) Lightning would
  still put a shuffling ``DistributedSampler`` on the training loader; the strategy turns that off and gives a
  shuffled loader a sampler seeded the same on every stage (:func:`keep_loader_order`, :func:`with_sampler`).
  Lightning asks the strategy only for the sampler's replicas and rank, not whether to shuffle.
- ``LightningModule.log`` is replaced by an instance attribute while a pipelined step runs on the last stage
  (:func:`logging_routed_to`): Lightning has no hook to intercept ``self.log`` calls, and the step's logs must be
  reduced over microbatches and replayed on every rank.

torch (checked against 2.13.0, 2.14.1 and 2.15.0; ``pyproject.toml`` pins ``<2.16``):

- ``torch.distributed.ProcessGroupGloo._Options`` and the backend options' ``_timeout``: the only way to give the
  device mesh's sub-groups the strategy's ``timeout`` (``init_device_mesh`` otherwise creates them with 30 minutes;
  :func:`mesh_group_options`).
- ``torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner`` and
  ``torch.distributed.checkpoint.state_dict_loader._load_state_dict``: read a DCP checkpoint into an empty state dict
  in one process (consolidation); without them, the public ``dcp.load`` reads into a template built from the index.
- Names that DCP's ``.metadata`` pickle holds, admitted by name by the restricted unpickler of
  ``checkpoint/_safe.py`` (``DCP_INDEX_GLOBALS``; the file references them, the package calls none of them):
  ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``, ``torch.distributed.checkpoint.filesystem.
  _StorageInfo``, ``torch.serialization._get_layout``. torch 2.13 to 2.15 write the same set of globals.
- A multi-stage schedule's ``pipeline_order`` (its compute actions per rank, ``_Action`` with ``computation_type``
  and ``sub_actions``), ``stage_index_to_group_rank``, ``_num_stages``, ``pipeline_order_with_comms`` and the
  lowerings ``schedules._add_send_recv`` and, from 2.15 (looked up by name), ``_add_wait_send``: where a stage feeds
  the next one on the same process (the V-shaped ``ZBVZeroBubble`` and ``DualPipeV``; any multi-stage schedule on
  one process), evaluation runs the forward actions only, with torch's own communication actions added
  (:func:`keep_forward_actions`). torch's ``eval()`` on these pipelines fails on the stage-local gradient hand-over
  between two stages ("can't steal_bwd_input if this stage doesn't have backward"), and its own lowering refuses a
  schedule without backward actions. 2.15 fails a step that leaves a send without a ``WAIT_SEND_F``/``_B`` action.
- ``torch.distributed.pipelining.schedules._batch_p2p`` and ``_wait_batch_p2p`` (module globals every schedule
  posts and waits for its transfers through), ``_PipelineSchedule._maybe_compute_loss``, ``_loss_fn``, and a
  schedule's ``_stage``/``_stages``: wrapped for the duration of one traced step by ``timeline=`` (no hook exists
  to observe a schedule's transfers and losses). With per-direction (2.14, ``torch.distributed.config.
  pipeline_per_direction_p2p``) or per-edge (2.15, ``pipeline_per_edge_p2p``) communicators, both off by default
  and on with TorchComms, ``_batch_p2p`` calls itself through the module global once per process group; the
  recorder counts the outermost call.

torchmetrics (checked against 1.9; the dependency is pinned below 2):

- ``Metric._defaults``, ``_update_count``, ``_forward_cache``, ``_computed``, ``_cache``, ``_is_synced``,
  ``_to_sync``, ``_should_unsync``, ``_reduce_states``: the state handling ``Metric.forward`` does in
  ``_forward_reduce_state_update``, which a training step split over microbatches has to do itself so that a metric
  called once per microbatch logs the whole batch's value.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

#: Every private name of Lightning, torch and torchmetrics the package reaches for, as ``(module, attribute path)``,
#: whether through this module or directly (the modules that reach directly are named). An attribute an instance
#: sets in its class's code counts as the class's. ``tests/test_compat.py`` looks up each one on the installed
#: versions: the first test to run when a new Lightning or torch comes out. Names looked up only where they exist
#: (``schedules._add_wait_send``, from torch 2.15) are not listed.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    # Lightning: processes, the launcher, the strategy's protected members
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_destroy_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    ("lightning.fabric.utilities.distributed", "_distributed_is_initialized"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher.procs"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher.kill"),
    ("lightning.pytorch.strategies.strategy", "Strategy._launcher"),  # strategy.py
    ("lightning.pytorch.strategies.strategy", "Strategy._precision_plugin"),  # strategy.py
    ("lightning.pytorch.strategies.parallel", "ParallelStrategy._layer_sync"),  # strategy.py
    ("lightning.pytorch.strategies.strategy", "Strategy._configure_launcher"),  # strategy.py
    ("lightning.pytorch.core.module", "LightningModule._device_mesh"),
    # Lightning: the running loop's loader, the samplers
    ("lightning.pytorch.loops.fit_loop", "_FitLoop._data_source"),
    ("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop._data_source"),
    ("lightning.pytorch.loops.prediction_loop", "_PredictionLoop._data_source"),
    ("lightning.pytorch.trainer.connectors.data_connector", "_DataLoaderSource.dataloader"),
    ("lightning.pytorch.trainer.trainer", "Trainer._accelerator_connector"),
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector.use_distributed_sampler"),
    ("lightning.pytorch.utilities.data", "_update_dataloader"),
    # Lightning: built-in callbacks
    ("lightning.pytorch.callbacks", "ModelSummary._summary"),  # _summary.py
    ("lightning.pytorch.callbacks", "ThroughputMonitor._throughputs"),
    ("lightning.pytorch.callbacks", "StochasticWeightAveraging._average_model"),
    ("lightning.pytorch.callbacks", "StochasticWeightAveraging._clear_schedulers"),
    ("lightning.pytorch.callbacks", "WeightAveraging._average_model"),
    ("lightning.pytorch.callbacks", "WeightAveraging._use_buffers"),
    ("lightning.pytorch.callbacks", "WeightAveraging._kwargs"),
    ("lightning.pytorch.callbacks", "ModelPruning._parameters_to_prune"),
    ("lightning.pytorch.callbacks", "ModelPruning._original_layers"),
    ("lightning.pytorch.callbacks", "ModelPruning._use_global_unstructured"),
    ("lightning.pytorch.callbacks", "ModelPruning._apply_global_pruning"),
    ("lightning.pytorch.callbacks", "BaseFinetuning._restarting"),
    ("lightning.pytorch.callbacks", "BaseFinetuning._internal_optimizer_metadata"),
    # torch: process groups and distributed checkpoints
    ("torch.distributed", "ProcessGroupGloo._Options"),
    ("torch.distributed", "ProcessGroupGloo._Options._timeout"),
    ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # checkpoint/_safe.py
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # checkpoint/_safe.py
    ("torch.serialization", "_get_layout"),  # checkpoint/_safe.py
    # torch: schedules (keep_forward_actions; the timeline's recorder)
    ("torch.distributed.pipelining.schedules", "_Action.computation_type"),
    ("torch.distributed.pipelining.schedules", "_Action.sub_actions"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleMulti.pipeline_order"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleMulti.stage_index_to_group_rank"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleMulti._num_stages"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleMulti._stages"),
    ("torch.distributed.pipelining.schedules", "PipelineScheduleSingle._stage"),
    ("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime.pipeline_order_with_comms"),
    ("torch.distributed.pipelining.schedules", "_add_send_recv"),
    ("torch.distributed.pipelining.schedules", "_batch_p2p"),
    ("torch.distributed.pipelining.schedules", "_wait_batch_p2p"),
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._maybe_compute_loss"),
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule._loss_fn"),
    # torch: tensors and modules
    ("torch.utils._pytree", "tree_any"),  # _ghost.py
    ("torch.utils._pytree", "tree_map"),  # _ghost.py
    ("torch.utils._pytree", "tree_leaves"),  # _ghost.py, _structure.py, _pipeline.py
    ("torch", "Tensor._make_wrapper_subclass"),  # _ghost.py
    ("torch._C", "_disabled_torch_function_impl"),  # _ghost.py
    ("torch", "ops.aten._local_scalar_dense.default"),  # _ghost.py
    ("torch", "_foreach_mul_"),  # _runtime.py
    ("torch.nn", "Module._parameters"),  # _cut.py, _stage.py, _structure.py, _callbacks.py
    ("torch.nn", "Module._buffers"),  # _cut.py, _stage.py, _structure.py
    ("torch.nn", "Module._modules"),  # _backbone.py
    ("torch.nn", "Module._non_persistent_buffers_set"),  # _cut.py
    ("torch.nn.utils.prune", "_compute_nparams_toprune"),  # _callbacks.py
    ("torch.nn.utils.prune", "_validate_pruning_amount"),  # _callbacks.py
    ("torch.nn._reduction", "legacy_get_string"),  # _loss_weights.py
    # torchmetrics: Metric.forward's state handling
    ("torchmetrics", "Metric._defaults"),
    ("torchmetrics", "Metric._update_count"),
    ("torchmetrics", "Metric._forward_cache"),
    ("torchmetrics", "Metric._computed"),
    ("torchmetrics", "Metric._cache"),
    ("torchmetrics", "Metric._is_synced"),
    ("torchmetrics", "Metric._to_sync"),
    ("torchmetrics", "Metric._should_unsync"),
    ("torchmetrics", "Metric._reduce_states"),
)

# ---------------------------------------------------------------------------------------------------- Lightning


def init_process_group(cluster_environment: Any, backend: str, timeout: Any, device: torch.device) -> None:
    """Start the default process group the way Lightning's DDP strategy does, and have every process group
    destroyed when the interpreter exits (:func:`_destroy_process_groups_at_exit`)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    device_id = device if device.type != "cpu" else None
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    _destroy_process_groups_at_exit()


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


def _destroy_process_groups_at_exit() -> None:
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


def default_process_group_backend(device: torch.device) -> str:
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def distributed_is_initialized() -> bool:
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    return _distributed_is_initialized()


def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """Lightning's all-reduce of a logged value (``Strategy.reduce`` of DDP)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def subprocess_launcher_class() -> type:
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return _SubprocessScriptLauncher


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``module.device_mesh`` return ``mesh``."""
    module._device_mesh = mesh


def count_replicas_in_throughput(callbacks: Any, replicas: int) -> None:
    """Make every ``ThroughputMonitor`` scale its per-process figures by the number of pipeline replicas."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = replicas






def averaged_model_like(callback: Any, module: Any, device: torch.device) -> Any:
    """The ``AveragedModel`` a ``WeightAveraging`` callback's ``setup`` builds, of ``module``."""
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel(model=module, device=device, use_buffers=callback._use_buffers, **callback._kwargs)




















def keep_loader_order(trainer: Any) -> bool:
    """Stop Lightning from putting its distributed sampler on the loaders; whether it would have."""
    connector = trainer._accelerator_connector
    would = bool(connector.use_distributed_sampler)
    connector.use_distributed_sampler = False
    return would


def with_sampler(dataloader: Any, sampler: Any) -> Any:
    """``dataloader`` re-created with ``sampler``, the way Lightning puts its distributed sampler in."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)




@contextmanager
def logging_routed_to(module: Any, log: Callable[..., None]) -> Iterator[None]:
    """Route ``module.log`` (and so ``module.log_dict``) to ``log`` for the duration of the block."""
    module.log = log
    try:
        yield
    finally:
        del module.log


# ------------------------------------------------------------------------------------------------------- torch


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




# ------------------------------------------------------------------------------------------------ torchmetrics
















def compute_without_sync(metric: Any) -> Any:
    """``compute()`` on the metric's current state, without syncing across processes, as ``Metric.forward`` does."""
    metric._to_sync, metric._should_unsync, metric._computed = False, False, None
    on_cpu, metric.compute_on_cpu = metric.compute_on_cpu, False
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._should_unsync, metric._computed = metric.sync_on_compute, True, None
        metric.compute_on_cpu = on_cpu
