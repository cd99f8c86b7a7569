"""``PipelineStrategy``: Lightning's hooks mapped onto a torch.distributed.pipelining pipeline.

Each hook is a few lines: the work is done by the runtime built in ``setup`` (:mod:`lightning_pipe._step.runtime`) and
by helpers that take explicit arguments (splitting, checkpoints, the precision plugin, and the adapters to Lightning in
:mod:`lightning_pipe._lightning`: options, data loaders, processes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_pipe import _watchdog
from lightning_pipe._after_call import ModuleAfterCall
from lightning_pipe._compat.torch import Swaps, ghost_safe_init
from lightning_pipe._lightning import callbacks as _callbacks
from lightning_pipe._lightning import data
from lightning_pipe._lightning import processes as _processes
from lightning_pipe._lightning.collectives import WatchedCollectives
from lightning_pipe._lightning.options import DataParallel as _DataParallel
from lightning_pipe._lightning.options import option_arguments, validated_options
from lightning_pipe._lightning.precision import pipeline_precision
from lightning_pipe._model.configure_model import ConfigureModelCalls, recording
from lightning_pipe._model.cut import drop_ghosts
from lightning_pipe._model.tensor_parallel import TensorParallelPlan
from lightning_pipe._parallel_dims import ParallelDims
from lightning_pipe._setup import SetupArgs, build_pipeline
from lightning_pipe._step.runtime import PipelineRuntime
from lightning_pipe.checkpoint import _dcp, _files, _hf
from lightning_pipe.checkpoint._names import all_gather
from lightning_pipe.partition import Size as _Size
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import register_schedules
from lightning_pipe.timeline import TimelineOptions

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)


class PipelineStrategy(ModuleAfterCall, WatchedCollectives, ParallelStrategy):
    """Pipeline parallelism for an unchanged LightningModule, on ``torch.distributed.pipelining``.

    The module's backbone (its blocks, in one or more containers) is cut into contiguous stages, one or more per
    process; each process keeps only its stages, under their original parameter names. Every training batch
    runs through the chosen pipeline schedule in microbatches; validation, test and prediction run through a
    forward-only pass. The user's ``*_step`` methods run unchanged: the code before the backbone call prepares
    the input on the first stage, the code after it (loss, ``self.log``, metrics) runs on the last stage, and
    everything logged reaches every rank as the full-batch value.

    Args:
        pipeline_parallel_size: processes per pipeline. ``"auto"``: all processes, or ``world_size //
            data_parallel_size`` when that is given.
        data_parallel_size: pipeline replicas, each fed its own share of the data. ``"auto"``: what the processes
            leave (``world_size // (pipeline_parallel_size * tensor_parallel_size)``).
        num_microbatches: microbatches each batch is split into (a ragged last batch uses the largest count below it
            that divides it). ``"auto"``: the smallest divisor of the batch size that is at least ``4 *
            pipeline_parallel_size`` (``2 *`` with two stages per process) and that the schedule accepts; 1 for a
            pipeline of one process (:func:`lightning_pipe.plan.default_num_microbatches`, ``docs/planner.md``).
        schedule: a ``torch.distributed.pipelining`` schedule by name: ``"1F1B"`` (default), ``"GPipe"``,
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``;
            or ``"auto"``: predicted from each block's measured times and timed on the first training steps, with
            ``num_microbatches="auto"`` searched too; the choice is logged and kept in checkpoints (docs/planner.md).
        stages_per_rank: virtual stages per process. ``"auto"``: 1 for 1F1B and GPipe, 2 for multi-stage schedules.
        backbone: the blocks to pipeline, by dotted path: an ``nn.Sequential`` the model calls, an
            ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` its code loops over (``"model.layers"``), or a list
            of consecutive containers. ``"auto"`` (default): a ``backbone`` attribute, else the containers of repeated
            blocks the step runs one after the other, else the longest (refused when ambiguous). See ``docs/models.md``.
        balance: modules per stage: ``"uniform"`` (default), ``"parameters"`` (minimise the largest stage's parameter
            count), ``"time"`` (each module's forward+backward timed on the first batch by rank 0; minimise the
            slowest stage), or a list of counts (``lightning_pipe.stored_balance(ckpt_dir)`` reuses a checkpoint's).
        activation_checkpointing: recompute activations in backward: ``True`` (every block), a list of class names
            or a callable ``module -> bool``. Blocks a ``configure_model`` wraps in ``checkpoint_wrapper`` too.
        accelerator: as for every Lightning strategy; normally set by the Trainer.
        parallel_devices: as for every Lightning strategy; normally set by the Trainer.
        cluster_environment: as for every Lightning strategy; normally set by the Trainer.
        checkpoint_io: as for every Lightning strategy; the pipeline saves with ``torch.distributed.checkpoint``.
        precision_plugin: as for every Lightning strategy (the Trainer's ``precision=``); run as a copy that clips
            by the norm over the whole pipeline and skips an overflowed fp16 step on every rank together.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU unless given.
        timeout: how long a collective or point-to-point transfer may wait before the job fails.
        stall_timeout: how long a rank may wait for another stage before it reports on stderr what it waits for
            (seconds or a ``timedelta``; ``None``: never). A report only; see ``docs/reliability.md``.
        check_data_every_n_batches: the stages of a pipeline compare a fingerprint of their batch on the first 3
            batches and every n-th; a mismatch fails on every rank. ``None`` turns the check off.
        data_parallel: how each stage's replicas hold it: ``"ddp"`` (replicated), ``"fsdp"`` (sharded over them with
            FSDP2: one unit per block, one for the modules outside the backbone) or ``"hsdp"`` (sharded within groups
            of ``data_parallel_shard_size``, replicated across them). ``None`` (default): ``"fsdp"`` when
            ``configure_model`` calls ``fully_shard`` (its ``reshard_after_forward`` and ``MixedPrecisionPolicy``
            honoured), else ``"ddp"``. See ``docs/scaling.md``.
        data_parallel_shard_size: replicas per sharding group with ``"hsdp"``; ``"auto"``: the processes per node.
        reshard_after_forward: sharded stages free each block's gathered parameters after every forward (less memory,
            one all-gather per microbatch); ``False`` (default, as torchtitan under a pipeline): once per batch.
        tensor_parallel_size: processes that split each stage's matrices (DTensor), consecutive ranks; 1: none.
        tensor_parallel_plan: how blocks are split over the tensor ranks: a ``parallelize_module`` plan relative to one
            block (``{"attn.wq": "colwise", "attn.wo": "rowwise"}``, wildcards, ``ParallelStyle`` values), a callable
            ``(block, tp_mesh)``, ``"auto"`` (a Hugging Face model's ``base_model_tp_plan``), or ``None``: what
            ``configure_model`` asks ``parallelize_module`` for on ``self.device_mesh["tensor_parallel"]`` (the
            modules outside the blocks and sequence parallelism included), applied to each rank's own stage.
        max_memory: with ``schedule="auto"``, the bytes a process may hold (``"40GiB"``): predicted to need more, a
            configuration is not tried. On a GPU, its memory when not given.
        timeline: trace one training step: ``True`` (``global_step`` 1), a step, a directory, or a dict or
            :class:`~lightning_pipe.timeline.TimelineOptions`. Rank 0 writes ``timeline.json`` (Perfetto) and
            ``timeline.png`` and logs the measured bubble. See ``docs/performance.md``.
        keep_split: after each ``Trainer`` call, leave every rank with its stages only (a split module's
            ``state_dict()`` and so ``save_pretrained`` raise, naming :meth:`save_pretrained`). ``False`` (default):
            the module is gathered whole on every rank, as under DDP, within a host-memory bound
            (``docs/checkpointing.md``).
        compile: ``torch.compile`` each block of each stage: ``True``, or a dict of ``torch.compile``'s options;
            after tensor parallelism, before sharding. Under the schedules that split the backward, the linear layers
            of compiled stages defer their weight gradients to the weight-gradient step (``docs/scaling.md``).
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
        max_memory: Union[None, int, str] = None,
        keep_split: bool = False,
        compile: Union[bool, dict] = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
        self._options = validated_options(**option_arguments(locals()))  # the arguments it checks, by name
        self._keep_split = self._options.keep_split
        self._hook_patches = Swaps()  # from setup to teardown
        self._configured = ConfigureModelCalls()  # what `configure_model` asked for ([Note: configure_model's calls])
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._dims: Optional[ParallelDims] = None
        self._runtime: Optional[PipelineRuntime] = None
        self._tie_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # by global ranks; created once per job
        self._failed = False  # set by `on_exception`: teardown must not wait on the other ranks then
        self._own_sampling = False  # one replica: the strategy, not Lightning, decides the loaders' samplers
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties
    @property
    def schedule(self) -> str:
        """The name of the schedule the pipeline runs (``"auto"`` until setup chooses)."""
        if self._runtime is not None:
            return self._runtime.schedule.name
        return self._options.schedule

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh over every process ([Note: the mesh]): ``mesh["pipeline_parallel"]`` is this rank's pipeline,
        ``mesh["data_parallel"]`` its replicas and ``mesh["tensor_parallel"]`` (with ``tensor_parallel_size > 1``) the
        processes that split its blocks, named as in Lightning's ``ModelParallelStrategy``."""
        mesh = self.dims.mesh
        assert mesh is not None
        return mesh

    @property
    def dims(self) -> ParallelDims:
        """The sizes of the mesh's dimensions, and its groups by name; set up when the processes start."""
        if self._dims is None:
            raise RuntimeError(
                "`PipelineStrategy.device_mesh` is set up when the processes start; access it from `setup` on."
            )
        return self._dims

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
        return self.dims.pipeline

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data

    @property
    def pipeline_rank(self) -> int:
        return self.dims.pipeline_rank

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each block (the mesh's ``"tensor_parallel"`` dimension); 1: none."""
        return self._options.tensor_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.dims.data_rank

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
    def distributed_sampler_kwargs(self) -> dict[str, int]:
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
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()
        if self._dims is None:
            # Built once per strategy: Lightning keeps each logged key's `sync_dist_group` across `fit`, `validate`,
            # `test` on one Trainer and refuses another group object for the same key.
            self._dims = self._options.parallel_dims(self.world_size, self.num_processes)
            self._dims.build(self.root_device.type, self._process_group_backend, self._timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh  # what `LightningModule.device_mesh` returns
        _processes.start_watchdog(self.global_rank, self.launcher, self._options.stall_timeout)

    def _setup_distributed(self) -> None:
        self.set_world_ranks()
        self._process_group_backend = _processes.start_process_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Build this rank's pipeline for the ``Trainer`` call that starts (refusals, the cut, tensor parallelism and
        sharding, callbacks, precision, ties, the runtime: :func:`lightning_pipe._setup.build_pipeline`), then the
        optimizers over this rank's parameters."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._release_split_guard()
        _processes.forget_failure(self.global_rank)  # [Note: the first failure, named]
        args = SetupArgs(
            self._options, self.dims, self._configured, self.precision_plugin, self.root_device,
            batch_to_device=self.batch_to_device, tie_groups=self._tie_groups, timeout=self._timeout,
            sync_batchnorm=self._layer_sync is not None, owner=self,
        )
        self._runtime, own_sampling = build_pipeline(self.lightning_module, trainer, args)
        self._own_sampling = self._own_sampling or own_sampling
        self.model = self.lightning_module
        ghost_safe_init(self._hook_patches)  # the user's hooks may initialise ghosts (`init_weights`), until teardown
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # as in Lightning's `ModelParallelStrategy`
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        log.debug("rank %d: setup done for %s", self.global_rank, trainer.state.fn)

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
        """``configure_model`` builds on the meta device; what it asks of ``parallelize_module``, ``fully_shard`` and
        ``checkpoint_wrapper`` is recorded and applied to each rank's own stage ([Note: configure_model's calls])."""
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
        self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: object, **kwargs: object
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

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, os.PathLike], storage_options: object = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        cut = self.runtime.cut
        checkpoint = dict(checkpoint)
        local_states = _callbacks.local_states(checkpoint)
        _callbacks.merge_finetuning_metadata(checkpoint, all_gather)
        stored_layout = _hf.stored_layout(cut, self.data_parallel_size, self.lightning_module,
                                          choice=self.runtime.stored_choice)
        _dcp.save(checkpoint, self.broadcast(filepath), module=self.lightning_module, optimizers=self.optimizers,
                  names=cut.names, layout=stored_layout, is_global_zero=self.is_global_zero, local_states=local_states)

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, os.PathLike], weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        module = self.lightning_module
        return _dcp.load(
            self.broadcast(checkpoint_path), module=module, optimizers=self.optimizers, names=self.runtime.cut.names,
            fitting=module.trainer.state.fn == TrainerFn.FITTING, weights_only=weights_only,
            checkpoint_io=self.checkpoint_io, global_rank=self.global_rank,
            prepare=lambda checkpoint: _callbacks.before_restore(module.trainer, checkpoint, module),
            chosen=self.runtime.keep_stored_choice,
        )

    @override
    def remove_checkpoint(self, filepath: Union[str, os.PathLike]) -> None:
        if self.is_global_zero:
            _files.remove(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool = True) -> None:
        """Loaded in place by :meth:`load_checkpoint`."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, object]) -> None:
        """Loaded in place by :meth:`load_checkpoint`."""

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        _processes.fail(exception, self.launcher, self.global_rank, self.world_size)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        if self._runtime is not None:
            self._runtime.end(failed=self._failed)
            self._leave_module(self._runtime.cut, failed=self._failed)
        self._failed = False
        _watchdog.stop()
        self._hook_patches.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_schedules(cls, strategy_registry)
