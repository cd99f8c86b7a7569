"""Building one rank's pipeline for a ``Trainer`` call: the sequence ``PipelineStrategy.setup`` runs, in one place.

Every rank runs these steps in this order, since several of them talk to the other ranks:

1. refuse what the pipeline cannot run, with a message that names the fix;
2. settle what the pipeline runs, a :class:`~lightning_pipe.schedules.Config` (schedule, stages per process,
   microbatches): the explicit arguments', or for ``schedule="auto"`` the chooser's from the analysed step
   (``_step/auto.py``); then cut the module into stages for it (``_model/split.py``; timed first for
   ``balance="time"``);
3. materialise this rank's share, split it over the tensor ranks and shard it over the replicas
   (``_model/parallelize.py``, [Note: stage parallelism]); read its pretrained weights where ``read_pretrained`` asked
   ([Note: pretrained weights per stage]);
4. tell the callbacks, the model summary and the data loaders about the cut;
5. convert the module and its ghosts to the precision plugin's dtypes, on the device;
6. connect the copies of each tied parameter over the ranks that hold them (``_model/cut.py``: ``connect_ties``);
7. build the runtime from the configuration, and let the precision plugin clip by the norm over the whole pipeline.

The optimizers come after, from the strategy (Lightning's ``setup_optimizers``).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_pipe._compat.lightning import count_replicas_in_throughput
from lightning_pipe._lightning import callbacks as _callbacks
from lightning_pipe._lightning import data
from lightning_pipe._lightning.backward import through_backward_override
from lightning_pipe._lightning.options import PipelineOptions
from lightning_pipe._lightning.precision import PipelinePrecision
from lightning_pipe._lightning.summary import summarize_whole_model
from lightning_pipe._model.activation_checkpointing import checkpointed_blocks
from lightning_pipe._model.configure_model import ConfigureModelCalls
from lightning_pipe._model.cut import Cut, connect_ties
from lightning_pipe._model.parallelize import ParallelismArgs, StageParallelism, data_parallel_mode, parallelize_stage
from lightning_pipe._model.pretrained import read_marked
from lightning_pipe._model.profile import BlockCost, first_batch, measure_backbone
from lightning_pipe._model.shard import refuse_unshardable, refuse_user_sharding
from lightning_pipe._model.split import analyse, cut_module, previous_cut, refuse_unsupported, reuse_cut
from lightning_pipe._parallel_dims import ParallelDims
from lightning_pipe._step.auto import Chooser, choice_of, profiled_config
from lightning_pipe._step.microbatches import MicrobatchPolicy
from lightning_pipe._step.runtime import PipelineRuntime
from lightning_pipe.partition import make_layout
from lightning_pipe.schedules import Config


@dataclass(frozen=True)
class SetupArgs:
    """What the strategy gives the setup: its options, mesh and plugins.

    Attributes:
        options: the strategy's validated arguments.
        dims: the mesh and its groups.
        configured: what ``configure_model`` asked for ([Note: configure_model's calls]).
        precision_plugin: the strategy's copy of the precision plugin.
        device: this rank's device.
        batch_to_device: the strategy's ``batch_to_device`` (the first batch, for the analysis).
        tie_groups: the process groups of tied parameters, by global ranks, kept across ``Trainer`` calls.
        timeout: of every process group.
        sync_batchnorm: whether ``Trainer(sync_batchnorm=True)`` asked for synchronised BatchNorm (refused).
        owner: the strategy (a later call of another strategy cannot reuse what it parallelized).
    """

    options: PipelineOptions
    dims: ParallelDims
    configured: ConfigureModelCalls
    precision_plugin: PipelinePrecision
    device: torch.device
    batch_to_device: Callable[[Any], Any]
    tie_groups: dict[tuple[int, ...], dist.ProcessGroup]
    timeout: Optional[timedelta]
    sync_batchnorm: bool
    owner: object


def build_pipeline(module: pl.LightningModule, trainer: pl.Trainer, args: SetupArgs) -> tuple[PipelineRuntime, bool]:
    """Steps 1 to 7 of the module docstring; returns this rank's runtime, and whether the strategy picks the data
    loaders' samplers itself (one replica: :func:`lightning_pipe._lightning.data.takes_over_sampling`)."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    options, dims = args.options, args.dims
    refuse_unsupported(
        module, fitting=fitting, sync_batchnorm=args.sync_batchnorm, pipeline_parallel_size=dims.pipeline
    )
    if previous_cut(module) is None:
        refuse_user_sharding(module)
    mode = data_parallel_mode(options.data_parallel, args.configured)
    if mode != "ddp":
        refuse_unshardable(mode, args.precision_plugin, trainer.callbacks)
    cut, config, chooser = _cut_into_stages(module, args, fitting)
    sharding = _parallelize(module, cut, args).sharding
    read_marked(module, cut.names.stored, cut.whole_shapes())  # [Note: pretrained weights per stage]
    own_sampling = _adapt_to_cut(module, trainer, cut, args)
    args.precision_plugin.convert_module(module)
    cut.convert_ghosts(dims.pipeline_rank, args.precision_plugin.convert_module)
    module.to(args.device)
    ties = connect_ties(cut, module, dims.pipelines(), dist.get_rank(), args.tie_groups, timeout=args.timeout)
    runtime = PipelineRuntime(
        module, cut, config=config, pp_group=dims.pipeline_group,
        dp_group=dims.data_group, tie_groups=ties, device=args.device,
        checkpointed=checkpointed_blocks(options.activation_checkpointing, args.configured.checkpointed),
        amp_scaler=getattr(args.precision_plugin, "scaler", None), timeline=options.timeline,
        check_data_every=options.check_data_every_n_batches, sharding=sharding,
        scale_group=dims.loss_weight_group, result_group=dims.result_group,
        tensor_group=dims.tensor_group,
        through_override=through_backward_override(module) if fitting else None,
        choice=choice_of(module) if options.auto else None, trial=chooser.trial if chooser is not None else None,
    )
    counted_once = {id(p) for group, params in ties for p in params if dist.get_rank(group) != 0}
    args.precision_plugin.connect_pipeline(dims.pipeline_group, counted=lambda p: id(p) not in counted_once)
    return runtime, own_sampling


def _measure(
    module: pl.LightningModule, args: SetupArgs, profiled: Config
) -> Callable[..., Union[list[float], list[BlockCost]]]:
    return functools.partial(
        measure_backbone, module, device=args.device,
        microbatches_for=MicrobatchPolicy.of(profiled, args.dims.pipeline).for_batch,
        step_context=args.precision_plugin.train_step_context,
    )


def _cut_into_stages(
    module: pl.LightningModule, args: SetupArgs, fitting: bool
) -> tuple[Cut, Config, Optional[Chooser]]:
    """The cut, the configuration it was made for, and for ``schedule="auto"`` the chooser that settled it (None
    when a later Trainer call keeps the module's cut and choice)."""
    options, device, dims = args.options, args.device, args.dims
    config, chooser = options.config, None
    if options.auto:
        kept = choice_of(module)
        if kept is not None:  # a later Trainer call on the module runs what `schedule="auto"` chose for it
            config = kept.config
        else:
            chooser = Chooser(options, dims.pipeline, _measure(module, args, profiled_config(options)), module,
                              device, fitting=fitting)
    sample = functools.partial(first_batch, module, args.batch_to_device)
    previous = previous_cut(module)
    if previous is not None:
        placement = config.placement if config is not None else ("loop", profiled_config(options).stages_per_rank)
        cut = reuse_cut(module, previous, placement, pipeline_parallel_size=dims.pipeline,
                        pipeline_rank=dims.pipeline_rank, device=device, fitting=fitting, sample=sample)
        return cut, config or previous_config(previous, options), None
    # The analysis runs the step as the Trainer call will (bf16-true's default dtype, autocast): what it creates and
    # keeps (a lazily built table) has the step's dtype. Compiled modules run eagerly: dynamo must not trace ghosts.
    with _step_context(args.precision_plugin, fitting, module.trainer), torch.compiler.set_stance("force_eager"):
        analysis = analyse(module, options.backbone, device=device, fitting=fitting, sample=sample)
        if chooser is not None:  # [Note: configuration by measurement]
            config, costs = chooser(analysis, analysis.parameter_costs(module))
        elif options.balance == "time":
            assert config is not None
            costs = _measure(module, args, config)(
                analysis.backbone, analysis.structure, analysis.step, analysis.args[0], rest=analysis.args[1:]
            )
        else:
            costs = analysis.parameter_costs(module)
        assert config is not None
        layout = make_layout(costs, dims.pipeline, config.stages_per_rank, options.balance, config.spec.placement)
        cut = cut_module(module, analysis, layout, pipeline_rank=dims.pipeline_rank, device=device,
                         schedule=config.schedule)
    return cut, config, chooser


def previous_config(cut: Cut, options: PipelineOptions) -> Config:
    """``schedule="auto"`` on a module an explicit schedule cut before: the looped schedule of its placement."""
    layout = cut.layout
    return Config("1F1B" if layout.stages_per_rank == 1 else "Interleaved1F1B", layout.stages_per_rank,
                  options.num_microbatches)


def _step_context(plugin: PipelinePrecision, fitting: bool, trainer: pl.Trainer) -> AbstractContextManager[None]:
    """The precision plugin's context of the steps this ``Trainer`` call runs."""
    if fitting:
        return plugin.train_step_context()
    contexts = {TrainerFn.VALIDATING: plugin.val_step_context, TrainerFn.TESTING: plugin.test_step_context,
                TrainerFn.PREDICTING: plugin.predict_step_context}
    return contexts.get(trainer.state.fn, plugin.val_step_context)()


def _parallelize(module: pl.LightningModule, cut: Cut, args: SetupArgs) -> StageParallelism:
    options, plugin = args.options, args.precision_plugin
    wanted = ParallelismArgs(
        tensor_parallel_plan=options.tensor_parallel_plan, data_parallel=options.data_parallel,
        reshard_after_forward=options.reshard_after_forward, precision=getattr(plugin, "precision", None),
        compile=options.compile,
    )

    def prepare(unit: nn.Module) -> None:
        plugin.convert_module(unit)
        unit.to(args.device)

    return parallelize_stage(
        module, cut, args.dims, wanted, args.configured, owner=args.owner, device=args.device, prepare=prepare
    )


def _adapt_to_cut(module: pl.LightningModule, trainer: pl.Trainer, cut: Cut, args: SetupArgs) -> bool:
    """Callbacks learn this rank's share, summary and throughput count the whole model, samplers are chosen."""
    dims = args.dims
    tied = cut.tied_parameter_ids(module)
    _callbacks.after_cut(trainer.callbacks, module, tied=tied, group=dims.pipeline_group, device=args.device)
    trainer.callbacks = summarize_whole_model(trainer.callbacks, cut.param_counts)
    count_replicas_in_throughput(trainer.callbacks, dims.data)
    return data.takes_over_sampling(trainer, dims.data)
