"""``PipelineStrategy``: Lightning's hooks mapped onto a torch.distributed.pipelining pipeline."""

from __future__ import annotations

import functools
import signal
import subprocess
import time
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

import lightning.pytorch as pl
from lightning_pipe import checkpoint as _ckpt
from lightning_pipe.backbone import LocalBackbone, resolve_backbone
from lightning_pipe import stage as _stage
from lightning_pipe import split as _split
from lightning_pipe import steps as _steps
from lightning_pipe import timeline as _timeline
from lightning_pipe.gradients import agree_on_overflow, use_global_norm_clipping
from lightning_pipe.logging_bridge import LogChannel
from lightning_pipe.partition import BALANCE_MODES, StageLayout, resolve_sizes
from lightning_pipe.pipeline import StagePipeline, microbatches_for, placement_style, resolve_schedule

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

_Size = Union[int, Literal["auto"]]


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism for an unchanged LightningModule, on ``torch.distributed.pipelining``.

    The module's sequential backbone (an ``nn.Sequential``) is cut into contiguous stages, one or more per
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
            ``"DualPipeV"``.
        stages_per_rank: virtual stages per process. ``"auto"``: 1 for single-stage schedules (1F1B, GPipe), 2
            for multi-stage ones. Stage ``s`` runs on pipeline rank ``s % pipeline_parallel_size`` (zig-zag for
            the V schedules, as torch expects).
        backbone: dotted attribute path of the ``nn.Sequential`` to pipeline. Default ``"backbone"``.
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
        precision_plugin: as for every Lightning strategy; normally set by the Trainer's ``precision=``.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU unless given.
        timeout: how long a collective or point-to-point transfer may wait before the job fails.
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
        backbone: str = "backbone",
        balance: Union[str, list[int]] = "uniform",
        activation_checkpointing: Union[bool, list[str], Callable[[nn.Module], bool]] = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        timeline: Union[None, bool, int, str, dict, _timeline.TimelineOptions] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        for name, value in (
            ("pipeline_parallel_size", pipeline_parallel_size),
            ("data_parallel_size", data_parallel_size),
            ("num_microbatches", num_microbatches),
            ("stages_per_rank", stages_per_rank),
        ):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`PipelineStrategy({name}={value!r})` must be a positive integer or 'auto'.")
        if isinstance(balance, str) and balance not in BALANCE_MODES:
            raise ValueError(
                f"`PipelineStrategy(balance={balance!r})` is unknown. Use one of {list(BALANCE_MODES)} or a list"
                " with the number of backbone modules in each stage."
            )
        self._schedule_name, _, multi_stage = resolve_schedule(schedule)
        if stages_per_rank == "auto":
            stages_per_rank = 2 if multi_stage else 1
        if not multi_stage and stages_per_rank != 1:
            raise ValueError(
                f"`PipelineStrategy(schedule={self._schedule_name!r})` runs one stage per process, but"
                f" `stages_per_rank={stages_per_rank}`. Use a multi-stage schedule such as 'Interleaved1F1B', or set"
                " `stages_per_rank=1`."
            )
        if placement_style(self._schedule_name) == "v" and stages_per_rank != 2:
            raise ValueError(
                f"`PipelineStrategy(schedule={self._schedule_name!r})` places exactly 2 stages per process;"
                f" set `stages_per_rank=2` (got {stages_per_rank})."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._data_parallel_size = data_parallel_size
        self._num_microbatches = num_microbatches
        self._stages_per_rank: int = stages_per_rank
        self._backbone_path = backbone
        self._balance = balance
        self._activation_checkpointing = activation_checkpointing
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._timeline = _timeline.TimelineOptions.resolve(timeline)
        self._timeline_done = False
        self._device_mesh: Optional[DeviceMesh] = None
        self._pipeline: Optional[StagePipeline] = None
        self._pending_grads: Optional[list[Optional[Tensor]]] = None
        self._params: list[nn.Parameter] = []
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties
    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D ``("dp", "pp")`` mesh: ``mesh["pp"]`` is this rank's pipeline, ``mesh["dp"]`` its replicas."""
        if self._device_mesh is None:
            raise RuntimeError(
                "`PipelineStrategy.device_mesh` is set up when the processes start; access it from `setup` on."
            )
        return self._device_mesh

    @property
    def pipeline(self) -> StagePipeline:
        """This rank's stages and schedules; available after ``setup``."""
        if self._pipeline is None:
            raise RuntimeError("`PipelineStrategy.pipeline` is built in `setup`; access it after the Trainer starts.")
        return self._pipeline

    @property
    def layout(self) -> StageLayout:
        """Which backbone modules each stage holds and which rank runs it."""
        return self.pipeline.layout

    @property
    def pipeline_parallel_size(self) -> int:
        return self.device_mesh["pp"].size()

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["dp"].size()

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh["pp"].get_local_rank()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh["dp"].get_local_rank()

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
        # Every stage of one pipeline must see the same batch: the sampler splits over replicas only.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

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
        if self._device_mesh is None:
            # Built once per strategy: Lightning keeps each logged key's `sync_dist_group` across `fit`, `validate`,
            # `test` on one Trainer and refuses another group object for the same key.
            pp, dp = resolve_sizes(self._pipeline_parallel_size, self._data_parallel_size, self.world_size)
            self._device_mesh = init_device_mesh(self.root_device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        module = self.lightning_module
        assert module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        _split.refuse_unsupported(self, module, fitting)
        backbone = _split.split_backbone(self, module)
        _stage.materialize_local(module, backbone, self.root_device)
        self.model = self.precision_plugin.convert_module(module)
        self.model_to_device()
        self._pipeline = StagePipeline(
            _stage.stage_modules(backbone, self.pipeline_rank),
            backbone.layout,
            self._schedule_name,
            self._microbatch_count(),
            self.device_mesh.get_group("pp"),
            self.root_device,
            wrap=functools.partial(
                _stage.wrap_stage,
                backbone=backbone,
                checkpointing=self._activation_checkpointing,
                replica_group=self.device_mesh.get_group("dp") if self.data_parallel_size > 1 else None,
                device=self.root_device,
            ),
        )
        self._pipeline.check_schedule()
        channel = (self._pipeline.group, self._pipeline.last_stage_rank, self.pipeline_parallel_size, self.root_device)
        self._train_channel, self._eval_channel = LogChannel(*channel), LogChannel(*channel)
        self._params = [p for p in module.parameters() if p.requires_grad]
        use_global_norm_clipping(self.precision_plugin, self.device_mesh.get_group("pp"))
        agree_on_overflow(self.precision_plugin)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _microbatch_count(self, batch_size: Optional[int] = None) -> int:
        """Microbatches for a batch of ``batch_size`` samples; without one, the nominal count (checked at setup)."""
        if self._num_microbatches != "auto":
            fixed = self._num_microbatches
            return fixed if batch_size is None else microbatches_for(batch_size, fixed)
        # imported here, not at the top: `python -m lightning_pipe.plan` must not find the module already imported
        from lightning_pipe.plan import default_num_microbatches, microbatch_target

        pp, spr, schedule = self.pipeline_parallel_size, self._stages_per_rank, self._schedule_name
        if batch_size is None:
            return microbatch_target(pp, spr, schedule)
        return default_num_microbatches(batch_size, pp, spr, schedule)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: after the split, each rank
        materialises only its own stages (see :func:`lightning_pipe.stage.materialize_local`)."""
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; each rank then materialises only its own stages."""
        with torch.device("meta"):
            yield

    @override
    def on_train_start(self) -> None:
        self._check_batch_size(self.lightning_module.trainer.train_dataloader, "train")

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        for loader in _loaders(trainer.val_dataloaders):
            self._check_batch_size(loader, "validation")

    def _check_batch_size(self, loader: Any, split: str) -> None:
        batch_size = getattr(loader, "batch_size", None)
        if isinstance(batch_size, int) and self._num_microbatches == "auto":
            self._microbatch_count(batch_size)  # raises, naming the fix, when no microbatch count suits the batch
            return
        wanted = self._microbatch_count()
        if isinstance(batch_size, int) and batch_size < wanted:
            raise ValueError(
                f"`PipelineStrategy(num_microbatches={wanted})` splits each batch into {wanted} microbatches, but the"
                f" {split} batch size is {batch_size}. Raise the batch size to at least {wanted}, or lower"
                f" `num_microbatches` to at most {batch_size}."
            )

    # ------------------------------------------------------------------ steps
    def _timeline_recorder(self) -> Optional[_timeline.TimelineRecorder]:
        """A recorder if this is the batch ``timeline=`` asks for: the first one of that ``global_step``."""
        options = self._timeline
        if options is None or self._timeline_done or self.lightning_module.trainer.global_step != options.step:
            return None
        self._timeline_done = True
        return _timeline.TimelineRecorder(self.pipeline.group, self.root_device)

    def _report_timeline(self, recorder: _timeline.TimelineRecorder) -> None:
        """Global rank 0 writes the trace and logs the bubble and busy times. Every rank calls it (collectives)."""
        assert self._timeline is not None
        trainer = self.lightning_module.trainer
        dirpath = self._timeline.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir broadcasts
        write = self.is_global_zero
        summary = _timeline.report(recorder.events, self.pipeline.group, dirpath, write=write, png=self._timeline.png)
        if summary is None or not write:
            return
        # imported here, not at the top: `python -m lightning_pipe.plan` must not find the module already imported
        from lightning_pipe.plan import PLANNED_SCHEDULES  # the schedules with the textbook bubble

        metrics = _timeline.timeline_metrics(summary)
        ideal = ""
        if self._schedule_name in PLANNED_SCHEDULES:
            value = _timeline.ideal_bubble_fraction(
                self.pipeline_parallel_size, summary["num_microbatches"], self._stages_per_rank
            )
            metrics["timeline/ideal_bubble_fraction"] = value
            ideal = f" (ideal {value:.1%})"
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"PipelineStrategy timeline of step {trainer.global_step}: measured bubble {summary['bubble_fraction']:.1%}"
            f"{ideal} over {summary['span_s'] * 1e3:.1f} ms; wrote {', '.join(summary['files']) or 'nothing'}"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.precision_plugin.train_step_context():
            return _steps.train_batch(self, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return _steps.eval_batch(self, self.lightning_module.validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return _steps.eval_batch(self, self.lightning_module.test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return _steps.eval_batch(self, self.lightning_module.predict_step, *args, **kwargs)

    def _backbone(self) -> LocalBackbone:
        _, _, backbone = resolve_backbone(self.lightning_module, self._backbone_path)
        assert isinstance(backbone, LocalBackbone)
        return backbone

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward inside ``training_step``; add the gradients it kept aside.

        Lightning calls ``zero_grad`` between ``training_step`` and ``backward``, so gradients written during the
        step would be wiped. They are added here instead, with the same hooks a real backward fires.
        """
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        grads, self._pending_grads = self._pending_grads, None
        if grads is not None:
            for param, grad in zip(self._params, grads):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        _ckpt.save(self, checkpoint, self.broadcast(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return _ckpt.load(self, self.broadcast(checkpoint_path), weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            _ckpt.remove(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in place by `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in place by `load_checkpoint`

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        # Rank 0 launched the other ranks; if it fails they may wait on it in a transfer. Give them a moment to
        # fail on their own (and print why), then end them so that no process is left hanging.
        launcher = self.launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            deadline = time.monotonic() + 3.0
            for proc in launcher.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self._pending_grads = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = {
            "pipeline": ("1F1B", "Pipeline parallelism with the 1F1B schedule"),
            "pipeline_1f1b": ("1F1B", "Pipeline parallelism with the 1F1B schedule"),
            "pipeline_gpipe": ("GPipe", "Pipeline parallelism with the GPipe schedule"),
            "pipeline_interleaved": ("Interleaved1F1B", "Pipeline parallelism, interleaved 1F1B, 2 stages per process"),
            "pipeline_zero_bubble": ("ZBVZeroBubble", "Pipeline parallelism, ZBV zero-bubble, 2 stages per process"),
        }
        for name, (schedule, description) in entries.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, schedule=schedule)


def _loaders(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    if isinstance(loaders, dict):
        return list(loaders.values())
    return [loaders]
