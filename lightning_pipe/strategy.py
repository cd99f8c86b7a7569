"""``PipelineStrategy``: Lightning's hooks mapped onto a torch.distributed.pipelining pipeline.

Each hook is a few lines: the work is done by the runtime built in ``setup`` (:mod:`lightning_pipe._step.runtime`) and
by helpers that take explicit arguments (splitting, checkpoints, the precision plugin, and the adapters to Lightning in
:mod:`lightning_pipe._lightning`: options, data loaders, processes).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Generator
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_pipe import _watchdog
from lightning_pipe._compat.lightning import count_replicas_in_throughput, init_process_group
from lightning_pipe._compat.torch import ghost_safe_init
from lightning_pipe._lightning import callbacks as _callbacks
from lightning_pipe._lightning import data
from lightning_pipe._lightning.backward import through_backward_override
from lightning_pipe._lightning.options import DataParallel as _DataParallel
from lightning_pipe._lightning.options import Size as _Size
from lightning_pipe._lightning.options import validated_options
from lightning_pipe._lightning.precision import PipelinePrecision, pipeline_precision
from lightning_pipe._lightning.processes import (
    HSDP_DIMS,
    end_launched_processes,
    launched_processes,
    pipeline_mesh,
    pipelines,
)
from lightning_pipe._lightning.summary import summarize_whole_model
from lightning_pipe._model.activation_checkpointing import checkpointed_blocks
from lightning_pipe._model.configure_model import ConfigureModelCalls, recording, sharding_of
from lightning_pipe._model.cut import Cut, connect_ties, drop_ghosts
from lightning_pipe._model.parallelize import Sharded, parallelize_stage
from lightning_pipe._model.profile import first_batch, measure_backbone
from lightning_pipe._model.shard import ShardingOptions, StageSharding, refuse_unshardable, refuse_user_sharding
from lightning_pipe._model.split import previous_cut, refuse_unsupported, split_module
from lightning_pipe._model.tensor_parallel import TensorParallelPlan, choose_plan
from lightning_pipe._step.microbatches import MicrobatchPolicy
from lightning_pipe._step.runtime import PipelineRuntime
from lightning_pipe.checkpoint import _dcp, _files
from lightning_pipe.checkpoint._names import all_gather
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import SCHEDULES
from lightning_pipe.timeline import TimelineOptions

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)



class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism for an unchanged LightningModule, on ``torch.distributed.pipelining``.

    The module's backbone (its blocks, in one or more containers) is cut into contiguous stages, one or more per
    process; each process keeps only its stages, under their original parameter names. Every training batch
    runs through the chosen pipeline schedule in microbatches; validation, test and prediction run through a
    forward-only pass. The user's ``*_step`` methods run unchanged: the code before the backbone call prepares
    the input on the first stage, the code after it (loss, ``self.log``, metrics) runs on the last stage, and
    everything logged reaches every rank as the full-batch value.

    Args:
        pipeline_parallel_size: processes per pipeline. ``"auto"``: all processes, or
            ``world_size // data_parallel_size`` when that is given.
        data_parallel_size: pipeline replicas, each fed its own share of the data. ``"auto"``:
            ``world_size // pipeline_parallel_size``.
        num_microbatches: microbatches each batch is split into. A batch it does not divide (a ragged last
            batch) uses the largest count below it that does, so every microbatch has the same size. ``"auto"``:
            chosen for each batch size by :func:`lightning_pipe.plan.default_num_microbatches`: the smallest
            divisor of the batch size that is at least ``4 * pipeline_parallel_size`` (``2 *`` with two stages
            per process; a bubble under 20%) and that the schedule accepts, else the largest accepted one below
            it; 1 for a pipeline of one process. See ``docs/planner.md``.
        schedule: a ``torch.distributed.pipelining`` schedule by name: ``"1F1B"`` (default), ``"GPipe"``,
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"`` or
            ``"DualPipeV"`` (see :mod:`lightning_pipe.schedules`).
        stages_per_rank: virtual stages per process. ``"auto"``: 1 for single-stage schedules (1F1B, GPipe), 2
            for multi-stage ones. Stage ``s`` runs on pipeline rank ``s % pipeline_parallel_size`` (zig-zag for
            the V schedules, as torch expects).
        backbone: the blocks to pipeline: the dotted path of an ``nn.Sequential`` the model calls, or of an
            ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` its code loops over (``"model.layers"``,
            ``"transformer.h"``, ``"blocks"``), or a list of consecutive containers (``["layer1", ..., "layer4"]``).
            ``"auto"`` (default): a ``backbone`` attribute if there is one, else the longest container of repeated
            blocks (said at setup; refused, listing the candidates, when two are equally long). Modules outside the
            backbone train too: those the step runs before it live on the first stage, the rest on the last; a
            parameter used on both ends (a head tied to the embedding) lives on both, with its gradients summed.
        balance: how modules are assigned to stages: ``"uniform"`` (same module count per stage, the first
            stages take the remainder), ``"parameters"`` (minimise the largest stage's parameter count), ``"time"``
            (before training, rank 0 times each module's forward+backward on one microbatch of the first batch on
            the real device, the last module together with the ``training_step`` loss, and the split minimises the
            slowest stage; every rank uses rank 0's measurement), or
            an explicit list with the number of modules of each stage. Checkpoints store the split:
            ``balance=lightning_pipe.stored_balance(ckpt_dir)`` reuses it on resume.
        activation_checkpointing: recompute activations in backward instead of keeping them. ``True``: every
            backbone module of every stage; a list of class names (e.g. ``["Block"]``) or a callable
            ``module -> bool``: the backbone modules it selects. Results are unchanged; memory goes down.
        accelerator: as for every Lightning strategy; normally set by the Trainer.
        parallel_devices: as for every Lightning strategy; normally set by the Trainer.
        cluster_environment: as for every Lightning strategy; normally set by the Trainer.
        checkpoint_io: as for every Lightning strategy; the pipeline saves with ``torch.distributed.checkpoint``.
        precision_plugin: as for every Lightning strategy; normally set by the Trainer's ``precision=``. The
            strategy runs a copy of it that clips gradients by the norm over the whole pipeline and makes every
            rank agree on skipping a step whose fp16 gradients overflowed.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU unless given.
        timeout: how long a collective or point-to-point transfer may wait before the job fails (every process
            group of the mesh, the pipeline's included).
        stall_timeout: how long a rank may wait for another stage (the shape exchange before the first step, a
            step's activations and gradients, the logged values from the last stage) before it says on stderr which
            stage waits for what from which rank, with its stack. Only a report: the job fails when ``timeout`` runs
            out. Seconds or a ``timedelta``; ``None``: never. SIGTERM and SIGINT end every rank within about 10 s
            even while it is blocked in a transfer (see ``docs/reliability.md``).
        check_data_every_n_batches: every stage of a pipeline loads its own data, so the stages compare a
            fingerprint of the batch (shapes, values, order) on the first 3 batches of each run and then on every
            n-th; a mismatch fails on every rank, naming the likely cause. ``None`` turns the check off.
        data_parallel: how each stage's ``data_parallel_size`` replicas hold it. ``None`` (default): ``"ddp"``, or
            ``"fsdp"`` when ``configure_model`` calls ``fully_shard`` (as for Lightning's ``ModelParallelStrategy``;
            its ``reshard_after_forward`` per block and ``MixedPrecisionPolicy`` are honoured). ``"ddp"``: replicated,
            gradients averaged over the replicas after each batch. ``"fsdp"``: sharded over them with torch's FSDP2
            (``fully_shard`` per backbone block, and one unit for the modules outside the backbone), each rank
            holding ``1/data_parallel_size`` of its stage's parameters, gradients and optimizer state; gradients are
            reduce-scattered once per batch. ``"hsdp"``: sharded within groups of ``data_parallel_shard_size``
            replicas and replicated across the groups. See ``docs/scaling.md``.
        data_parallel_shard_size: with ``data_parallel="hsdp"``, the replicas in each sharding group (consecutive
            ranks); ``"auto"``: the processes per node.
        reshard_after_forward: with sharded stages, free each block's gathered parameters after every forward and
            gather them again for its backward (less memory, one all-gather per microbatch); ``False`` (default, as
            torchtitan under a pipeline): gathered once per batch.
        tensor_parallel_size: processes that split each block's matrices (DTensor, torch's ``parallelize_module``),
            consecutive ranks of one node; 1 (default): none. The processes are ``pipeline_parallel_size *
            data_parallel_size * tensor_parallel_size``.
        tensor_parallel_plan: how each block is split over its tensor ranks: a ``parallelize_module`` plan relative to
            one block, keys with wildcards and ``"colwise"``/``"rowwise"`` or ``ParallelStyle`` values (``{"attn.wq":
            "colwise", "attn.wo": "rowwise"}``), a callable ``(block, tp_mesh) -> None``, or ``"auto"``: a Hugging
            Face model's own ``config.base_model_tp_plan``. Applied to each rank's own blocks after the cut; the
            modules outside the backbone stay replicated. See ``docs/scaling.md``.
        timeline: trace one training step to see where the pipeline waits. ``True``: the first batch of
            ``global_step`` 1 (step 0 also sets the schedule up); an int: of that step; a directory; or a dict or
            :class:`~lightning_pipe.timeline.TimelineOptions` with ``step``, ``dirpath``, ``png``. Global rank 0
            writes ``timeline.json`` (open in https://ui.perfetto.dev) and ``timeline.png`` (needs matplotlib) into
            ``dirpath`` (default: the Trainer's ``log_dir``) and logs ``timeline/bubble_fraction`` and
            ``timeline/stage<s>_busy_s`` to the Trainer's loggers.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pipeline_parallel_size: _Size = "auto",
        data_parallel_size: _Size = "auto",
        num_microbatches: _Size = "auto",
        schedule: str = "1F1B",
        stages_per_rank: _Size = "auto",
        backbone: Union[str, list[str]] = "auto",
        balance: Union[str, list[int]] = "uniform",
        activation_checkpointing: Union[bool, list[str], Callable[[nn.Module], bool]] = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        timeline: Union[None, bool, int, str, dict, TimelineOptions] = None,
        stall_timeout: Union[None, float, timedelta] = timedelta(minutes=5),
        check_data_every_n_batches: Optional[int] = 100,
        data_parallel: Optional[_DataParallel] = None,
        data_parallel_shard_size: _Size = "auto",
        reshard_after_forward: bool = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: TensorParallelPlan = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._options = validated_options(
            pipeline_parallel_size, data_parallel_size, num_microbatches, schedule, stages_per_rank, backbone, balance,
            activation_checkpointing, timeline, stall_timeout, check_data_every_n_batches, data_parallel,
            data_parallel_shard_size, reshard_after_forward, tensor_parallel_size, tensor_parallel_plan,
        )
        self._sharding: Optional[StageSharding] = None
        self._scale_group: Optional[dist.ProcessGroup] = None
        self._hooks_context: Optional[ExitStack] = None  # from setup to teardown
        self._configured = ConfigureModelCalls()  # what `configure_model` asked for ([Note: configure_model's calls])
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: Optional[DeviceMesh] = None
        self._runtime: Optional[PipelineRuntime] = None
        self._tie_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # by global ranks; created once per job
        self._failed = False  # set by `on_exception`: teardown must not wait on the other ranks then
        self._own_sampling = False  # one replica: the strategy, not Lightning, decides the loaders' samplers
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties
    @property
    def schedule(self) -> str:
        """The name of the schedule the pipeline runs."""
        return self._options.schedule.name

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D ``("data_parallel", "pipeline_parallel")`` mesh: ``mesh["pipeline_parallel"]`` is this rank's
        pipeline, ``mesh["data_parallel"]`` its replicas (named as in Lightning's ``ModelParallelStrategy``). With
        ``data_parallel="hsdp"`` it is 3-D, ``("data_parallel_replicate", "data_parallel_shard",
        "pipeline_parallel")``, and ``mesh["data_parallel"]`` is the first two flattened."""
        if self._device_mesh is None:
            raise RuntimeError(
                "`PipelineStrategy.device_mesh` is set up when the processes start; access it from `setup` on."
            )
        return self._device_mesh

    @property
    def runtime(self) -> PipelineRuntime:
        """This rank's pipeline for the running ``Trainer`` call; available after ``setup``."""
        if self._runtime is None:
            raise RuntimeError("`PipelineStrategy.runtime` is built in `setup`; access it after the Trainer starts.")
        return self._runtime

    @property
    def layout(self) -> StageLayout:
        """Which backbone modules each stage holds and which rank runs it."""
        return self.runtime.layout

    @property
    def pipeline_parallel_size(self) -> int:
        return self.device_mesh["pipeline_parallel"].size()

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["data_parallel"].size()

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh["pipeline_parallel"].get_local_rank()

    @property
    def _data_parallel(self) -> str:
        """How the replicas hold each stage: ``data_parallel``, or ``"fsdp"`` when ``configure_model`` calls
        ``fully_shard`` ([Note: configure_model's calls]); ``"ddp"`` when neither says."""
        return "fsdp" if self._configured.shards else (self._options.data_parallel or "ddp")

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each block (the mesh's ``"tensor_parallel"`` dimension); 1: none."""
        return self._options.tensor_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh["data_parallel"].get_local_rank()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then syncs ``sync_dist`` logging and injects a distributed sampler."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return data.sampler_kwargs(self.data_parallel_size, self.data_parallel_rank)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        """The user's precision plugin, as a copy that clips by the pipeline's norm (see ``_precision``)."""
        if self._precision_plugin is None:
            self._precision_plugin = pipeline_precision(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = pipeline_precision(precision_plugin) if precision_plugin is not None else None

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            launcher = _SubprocessScriptLauncher
            self._launcher = launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()
        if self._device_mesh is None:
            # Built once per strategy: Lightning keeps each logged key's `sync_dist_group` across `fit`, `validate`,
            # `test` on one Trainer and refuses another group object for the same key.
            options = self._options
            self._device_mesh = pipeline_mesh(
                options.pipeline_parallel_size, options.data_parallel_size, self.world_size, self.root_device.type,
                self._process_group_backend, self._timeout, self._data_parallel, options.data_parallel_shard_size,
                self.num_processes, options.tensor_parallel_size,
            )
            self._scale_group = self._pipeline_side_group()
            log.debug(
                "rank %d: mesh dp=%d x pp=%d, pipeline rank %d",
                self.global_rank, self.data_parallel_size, self.pipeline_parallel_size, self.pipeline_rank,
            )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # what `LightningModule.device_mesh` returns
        _watchdog.start(self.global_rank, lambda: launched_processes(self.launcher), self._options.stall_timeout)

    def _pipeline_side_group(self) -> Optional[dist.ProcessGroup]:
        """A second group over each pipeline, which carries each step's loss weight from the last stage while the
        schedule uses the pipeline's own ([Note: overlapped reductions]); needed with replicas to reduce over."""
        pp = self.pipeline_parallel_size
        rows = pipelines(self.device_mesh)
        if pp == 1 or self.data_parallel_size == 1:
            return None
        group, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in rows], timeout=self._timeout)
        return group

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, backend, self._timeout, self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Build this rank's pipeline for the ``Trainer`` call that starts. Every rank runs these steps in this order,
        since several of them talk to the other ranks:

        1. refuse what the pipeline cannot run, with a message that names the fix;
        2. cut the module into stages (:meth:`_cut_into_stages`);
        3. materialise this rank's share, split it over the tensor ranks and shard it over the replicas
           (:meth:`_parallelize`, [Note: stage parallelism]);
        4. tell the callbacks, the model summary and the data loaders about the cut (:meth:`_adapt_to_cut`);
        5. convert the module and its ghosts to the precision plugin's dtypes, on the device;
        6. connect the copies of each tied parameter over the ranks that hold them (``_cut.connect_ties``);
        7. build the runtime, and let the precision plugin clip by the norm over the whole pipeline;
        8. when fitting, the optimizers over this rank's parameters, on the device.
        """
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        refuse_unsupported(
            module, fitting=fitting, sync_batchnorm=self._layer_sync is not None,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
        options = self._options
        if previous_cut(module) is None:
            refuse_user_sharding(module)
        if self._data_parallel != "ddp":
            refuse_unshardable(self._data_parallel, self.precision_plugin, trainer.callbacks)
        microbatches = MicrobatchPolicy(
            options.num_microbatches, options.schedule, self.pipeline_parallel_size, options.stages_per_rank
        )
        cut = self._cut_into_stages(microbatches, fitting)
        self._parallelize(cut)
        self._adapt_to_cut(trainer, cut)
        self._convert_precision(cut)
        ties = connect_ties(cut, module, pipelines(self.device_mesh), self.global_rank, self._tie_groups, self._timeout)
        self._runtime = self._build_runtime(
            cut, microbatches, ties, through_backward_override(module) if fitting else None
        )
        if self._hooks_context is None:  # the user's hooks may initialise ghosts, until teardown
            self._hooks_context = ExitStack()
            self._hooks_context.enter_context(ghost_safe_init())
        self._setup_optimization(trainer, fitting)
        log.debug("rank %d: setup done for %s", self.global_rank, trainer.state.fn)

    def _cut_into_stages(self, microbatches: MicrobatchPolicy, fitting: bool) -> Cut:
        """Cut the module into stages (timed first for ``balance="time"``); keep and materialise this rank's."""
        module, options, device = self.lightning_module, self._options, self.root_device
        measure = functools.partial(
            measure_backbone, module, device=device, microbatches_for=microbatches.for_batch,
            step_context=self.precision_plugin.train_step_context,
        )
        cut = split_module(
            module, options.backbone, pipeline_parallel_size=self.pipeline_parallel_size,
            stages_per_rank=options.stages_per_rank, pipeline_rank=self.pipeline_rank, schedule=options.schedule,
            balance=options.balance, device=device, fitting=fitting,
            sample=lambda: first_batch(module, self.batch_to_device), measure=measure,
        )
        return cut

    def _parallelize(self, cut: Cut) -> None:
        """Tensor parallelism, then sharding over the replicas, on this rank's stage ([Note: stage parallelism])."""
        module, options, backbone = self.lightning_module, self._options, cut.backbone
        blocks = [(backbone.blocks[i].name, backbone.module(i)) for i in range(len(backbone))]
        split = choose_plan(
            options.tensor_parallel_plan, self._configured.styles, self.tensor_parallel_size, module, blocks
        )
        recorded = sharding_of(self._configured, [b for _, b in blocks], options.data_parallel)
        sharded = None
        if recorded is not None:
            sharded = Sharded(self.device_mesh["data_parallel"], ShardingOptions(
                options.reshard_after_forward, recorded.mp_policy, recorded.reshard_after_forward
            ))
        elif self._data_parallel != "ddp":
            mesh = self.device_mesh
            shard_mesh = mesh[HSDP_DIMS[:2]] if self._data_parallel == "hsdp" else mesh["data_parallel"]
            precision = getattr(self.precision_plugin, "precision", None)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if precision == "bf16-mixed" else MixedPrecisionPolicy()
            sharded = Sharded(shard_mesh, ShardingOptions(options.reshard_after_forward, policy))

        def prepare(unit: nn.Module) -> None:
            self.precision_plugin.convert_module(unit)
            unit.to(self.root_device)

        parallelism = parallelize_stage(
            module, cut, self.pipeline_rank, owner=self, split=split,
            tp_mesh=self.device_mesh["tensor_parallel"] if split is not None else None, sharded=sharded,
            device=self.root_device, prepare=prepare,
        )
        self._sharding = parallelism.sharding

    def _adapt_to_cut(self, trainer: pl.Trainer, cut: Cut) -> None:
        """Callbacks learn this rank's share, summary and throughput count the whole model, samplers are chosen."""
        module = self.lightning_module
        tied = cut.tied_parameter_ids(module)
        pipeline = self.device_mesh.get_group("pipeline_parallel")
        _callbacks.after_cut(trainer.callbacks, module, tied=tied, group=pipeline, device=self.root_device)
        trainer.callbacks = summarize_whole_model(trainer.callbacks, cut.param_counts)
        count_replicas_in_throughput(trainer.callbacks, self.data_parallel_size)
        self._own_sampling = self._own_sampling or data.takes_over_sampling(trainer, self.data_parallel_size)

    def _convert_precision(self, cut: Cut) -> None:
        """The module (and the ghosts of what other ranks hold) in the precision plugin's dtypes, on the device."""
        self.model = self.precision_plugin.convert_module(self.lightning_module)
        cut.convert_ghosts(self.pipeline_rank, self.precision_plugin.convert_module)
        self.model_to_device()

    def _build_runtime(
        self, cut: Cut, microbatches: MicrobatchPolicy, ties: list[tuple[dist.ProcessGroup, list[nn.Parameter]]],
        through_override: Optional[Callable[[Callable[[], Any]], Any]],
    ) -> PipelineRuntime:
        """This rank's pipeline; the precision plugin clips by the pipeline's norm, a tied parameter counted once."""
        options, mesh, pipeline = self._options, self.device_mesh, self.device_mesh.get_group("pipeline_parallel")
        runtime = PipelineRuntime(
            self.lightning_module, cut, options.schedule, microbatches, pipeline, mesh.get_group("data_parallel"), ties,
            self.root_device, checkpointed_blocks(options.activation_checkpointing, self._configured.checkpointed),
            amp_scaler=getattr(self.precision_plugin, "scaler", None), timeline=options.timeline,
            check_data_every=options.check_data_every_n_batches, sharding=self._sharding,
            scale_group=self._scale_group,
            tensor_group=mesh.get_group("tensor_parallel") if self.tensor_parallel_size > 1 else None,
            through_override=through_override,
        )
        assert isinstance(self.precision_plugin, PipelinePrecision)
        counted_once = {id(p) for group, params in ties for p in params if dist.get_rank(group) != 0}
        self.precision_plugin.connect_pipeline(pipeline, counted=lambda p: id(p) not in counted_once)
        return runtime

    def _setup_optimization(self, trainer: pl.Trainer, fitting: bool) -> None:
        """As in Lightning's ``ModelParallelStrategy``: optimizers, precision plugin, optimizer state on the device."""
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` sees every parameter of the model (those of other ranks as ghosts), so that the
        optimizers have the parameter groups they have on one process, on every rank (``self.head.parameters()`` on a
        rank without the head gives an empty group, not an error); then the ghosts are taken out."""
        with self.runtime.cut.registered_everywhere(self.pipeline_rank):
            super().setup_optimizers(trainer)
        drop_ghosts(self.optimizers)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With one pipeline, the loaders keep their order or get a sampler seeded the same on every stage
        (:func:`lightning_pipe._lightning.data.same_order_on_every_stage`)."""
        return data.same_order_on_every_stage(dataloader) if self._own_sampling else dataloader

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: after the split, each rank
        materialises only its own stages."""
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; each rank then materialises only its own stages. What it asks
        ``parallelize_module`` for is recorded, and applied to each rank's own blocks after the cut ([Note:
        tensor-parallel stages])."""
        with torch.device("meta"), recording(self.lightning_module) as calls:
            yield
        self._configured = calls

    @override
    def on_train_start(self) -> None:
        _callbacks.after_restore(self.lightning_module.trainer.callbacks)
        loader = self.lightning_module.trainer.train_dataloader
        self.runtime.microbatches.check_batch_size(data.batch_size(loader), "train")

    @override
    def on_validation_start(self) -> None:
        for loader in data.loaders(self.lightning_module.trainer.val_dataloaders):
            self.runtime.microbatches.check_batch_size(data.batch_size(loader), "validation")

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.precision_plugin.train_step_context():
            return self.runtime.train_batch(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.runtime.eval_batch(self.lightning_module.validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.runtime.eval_batch(self.lightning_module.test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.runtime.eval_batch(self.lightning_module.predict_step, *args, **kwargs)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        """The schedule already ran backward inside ``training_step``; add the gradients it kept aside, between the
        hooks a real backward fires."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.runtime.gradients.hand_back()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        with _watchdog.waiting(lambda: f"every rank to reach the barrier {name or ''}".rstrip()):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with _watchdog.waiting(lambda: f"a broadcast from rank {src} (Lightning's `strategy.broadcast`)"):
            dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        cut = self.runtime.cut
        checkpoint = dict(checkpoint)
        local_states = _callbacks.local_states(checkpoint)
        _callbacks.merge_finetuning_metadata(checkpoint, all_gather)
        stored_layout = _files.layout_record(cut.layout, self.data_parallel_size, cut.backbone.paths)
        _dcp.save(
            checkpoint, self.broadcast(filepath), module=self.lightning_module, optimizers=self.optimizers,
            names=cut.names, layout=stored_layout, is_global_zero=self.is_global_zero,
            local_states=local_states,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        module = self.lightning_module
        return _dcp.load(
            self.broadcast(checkpoint_path), module=module, optimizers=self.optimizers, names=self.runtime.cut.names,
            fitting=module.trainer.state.fn == TrainerFn.FITTING, weights_only=weights_only,
            checkpoint_io=self.checkpoint_io, global_rank=self.global_rank,
            prepare=lambda checkpoint: _callbacks.before_restore(module.trainer, checkpoint, module),
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            _files.remove(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by `load_checkpoint`

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        end_launched_processes(self.launcher, exception, self.global_rank)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self._runtime is not None:
            self._runtime.gradients.discard()
            if not self._failed:
                self._runtime.drain()
        self._failed = False
        _watchdog.stop()
        if self._hooks_context is not None:
            self._hooks_context.close()
            self._hooks_context = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for spec in SCHEDULES.values():
            description = f"Pipeline parallelism with the {spec.name} schedule"
            for name in spec.strategy_names:
                if name not in strategy_registry:
                    strategy_registry.register(name, cls, description=description, schedule=spec.name)
