"""Every use of a private name of Lightning, torch or torchmetrics, and every patch, in one package.

This page is the list; ``torch.py``, ``pipelining.py``, ``parallel.py``, ``lightning.py`` and ``torchmetrics.py`` hold
the workarounds that do more than read a name, and the one-line uses are at their callers.

Each entry says why no public route exists and which versions it was checked against. :data:`PRIVATE_NAMES` lists
every private name the package uses, these and the few that other modules reach for directly (``nn.Module``'s
tables, pytree, the ghost tensor's subclass hooks, pruning's amount checks, the strategy's protected members), and
``tests/test_compat.py`` checks that each exists. When a supported release moves one of these names, this package is
the one to change (and the torch range in ``pyproject.toml``). ``_compat.torch``, ``.pipelining`` and ``.parallel``
import torch only: ``lightning_pipe.timeline`` imports them without Lightning.

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
  sets it the same way (``PipelineStrategy.setup_environment``).
- ``Strategy._launcher``, ``_precision_plugin``, ``_layer_sync`` and the ``_configure_launcher`` hook: the protected
  members every Lightning strategy subclass sets or reads (the launcher it starts, the precision plugin behind the
  ``precision_plugin`` property, the plugin ``sync_batchnorm=True`` installs).
- ``ModelSummary._summary`` (the callback's way to its summary; Lightning special-cases only DeepSpeed there): the
  strategy gives ``Trainer.callbacks`` a copy of each summary callback whose ``_summary`` counts the whole model
  (``_lightning/summary.py``: ``summarize_whole_model``).
- ``ThroughputMonitor._throughputs`` (its ``Throughput`` per stage, built in the callback's ``setup`` with
  ``world_size=trainer.world_size``): every rank of a pipeline processes the same batch, so the global figures must
  count data-parallel replicas, not processes (:func:`.lightning.count_replicas_in_throughput`).
- The state built-in callbacks take from the whole module in their ``setup`` hook, before the cut, retaken from this
  rank's share after it (:mod:`lightning_pipe._lightning.callbacks`; Lightning has no hook between a strategy's cut and
  the callbacks): ``StochasticWeightAveraging``/``WeightAveraging._average_model`` (and
  ``WeightAveraging._use_buffers``, ``_kwargs``, the arguments of its ``AveragedModel``);
  ``ModelPruning._parameters_to_prune``, ``_original_layers``, ``_use_global_unstructured`` and its
  ``_apply_global_pruning`` method (replaced per instance by the pipeline-wide L1 threshold). Restoring state that one
  process restores before ``on_fit_start`` (the pipeline restores after it, ``restore_checkpoint_after_setup``):
  ``StochasticWeightAveraging._clear_schedulers`` (what its ``on_fit_start`` does with a restored scheduler state) and
  ``BaseFinetuning._restarting`` (its ``on_fit_start`` consumed it); ``BaseFinetuning._internal_optimizer_metadata``:
  the empty groups the pipeline adds are recorded there too, so that the stored groups keep their positions on every
  rank. - ``Trainer._accelerator_connector.use_distributed_sampler`` and
  ``lightning.pytorch.utilities.data._update_dataloader``: with one pipeline (no data parallelism) Lightning would
  still put a shuffling ``DistributedSampler`` on the training loader; the strategy turns that off and gives a
  shuffled loader a sampler seeded the same on every stage (:func:`.lightning.keep_loader_order`;
  ``_lightning/data.py``). Lightning asks the strategy only for the sampler's replicas and rank, not whether to shuffle.
- ``LightningModule.log`` is replaced by an instance attribute while a pipelined step runs on the last stage
  (:func:`.lightning.logging_routed_to`): Lightning has no hook to intercept ``self.log`` calls, and the step's logs
  must be reduced over microbatches and replayed on every rank.

torch (checked against 2.13.0, 2.14.1 and 2.15.0; ``pyproject.toml`` pins ``<2.16``):

- ``torch.distributed._composable_state._module_state_mapping`` (where ``fully_shard`` keeps each module's state),
  ``contract``'s ``__composable_api_*`` keys and ``distribute_module``'s ``_distribute_module_applied`` mark in a
  module's ``__dict__``, and ``nn.Module``'s hook tables: torch has no inverse of ``fully_shard`` or
  ``parallelize_module``, and the module is made whole after each Trainer call (:func:`.torch.restore_modules`,
  [Note: undoing a stage's parallelization]).

- ``torch.distributed.ProcessGroupGloo._Options`` and the backend options' ``_timeout``: the only way to give the
  device mesh's sub-groups the strategy's ``timeout`` (``init_device_mesh`` otherwise creates them with 30 minutes;
  :func:`.torch.mesh_group_options`).
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
  (:func:`.torch.keep_forward_actions`). torch's ``eval()`` on these pipelines fails on the stage-local gradient
  hand-over between two stages ("can't steal_bwd_input if this stage doesn't have backward"), and its own lowering
  refuses a schedule without backward actions. 2.15 fails a step that leaves a send without a ``WAIT_SEND_F``/``_B``
  action.
- ``torch.distributed.pipelining.schedules._batch_p2p`` and ``_wait_batch_p2p`` (module globals every schedule
  posts and waits for its transfers through), ``_PipelineSchedule._maybe_compute_loss``, ``_loss_fn``, and a
  schedule's ``_stage``/``_stages``: wrapped for the duration of one traced step by ``timeline=`` (no hook exists
  to observe a schedule's transfers and losses). With per-direction (2.14, ``torch.distributed.config.
  pipeline_per_direction_p2p``) or per-edge (2.15, ``pipeline_per_edge_p2p``) communicators, both off by default
  and on with TorchComms, ``_batch_p2p`` calls itself through the module global once per process group; the
  recorder counts the outermost call.
- ``PipelineStage.backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)`` (defined on
  ``_PipelineStageBase``; no underscore, but no documented API either): overridden by ``_step/pipeline.py``'s
  ``ReducingStage`` to run the reductions of [Note: overlapped reductions] around a stage's last full backward of a
  step. It is the one call that knows a backward is a stage's last (torch turns DDP's and FSDP's ``no_sync`` off in
  it); no public hook says so. Checked against 2.13.0, with the signature (``tests/test_compat.py``).
- ``torch.distributed.pipelining._backward.get_param_groups`` and ``stage.stage_backward_weight`` (the module global
  ``stage.py`` calls): swapped while a zero-bubble stage's input or weight pass runs (``ReducingStage``;
  :func:`.torch.merged_param_groups`, :func:`.torch.weight_gradients_keep_graph`). torch groups the weights by where
  their paths meet the inputs, merging groups pairwise, and frees the graph after each group; an encoder-decoder (a
  tied embedding read by the decoder's embedding and the head; a decoder block whose self-attention sees only
  weights) gets a weight counted twice, or a group's pass finds another's nodes freed. The groups are merged
  transitively, and the graph is kept until the pass ends (the same sums). No public API splits the backward.
  Checked against 2.13.0 (``tests/test_models.py``: T5 under InterleavedZeroBubble, Flux under ZBVZeroBubble).
- ``DeviceMesh._flatten(mesh_dim_name, backend_override=...)``: the HSDP mesh's ``"data_parallel"`` dimension, its
  ``"data_parallel_replicate"`` and ``"data_parallel_shard"`` dimensions flattened into one
  (``_parallel_dims.py``: ``ParallelDims.build``), so that ``mesh["data_parallel"]`` is the replicas of a
  pipeline rank in every mode, as torchtitan's ``ParallelDims`` flattens its meshes; ``init_device_mesh`` has no public
  way to add a flattened dimension. Checked against 2.13.0, with the signature.
- ``ParallelStyle._apply(module, device_mesh)``: the method through which ``parallelize_module`` applies every
  style, and nothing public records a plan without applying it. It is swapped on torch's style classes while the
  user's ``configure_model`` runs before the cut (:func:`.torch.parallel_styles_recorded`), and the recorded styles
  are applied through it to each rank's own modules after the cut (``_model/tensor_parallel.py``). Checked against
  2.13.0, with the signature.
- ``fully_shard``'s closure cell holding the function ``contract`` wraps, and ``contract``'s ``STATE_KEY`` and
  ``REGISTRY_KEY`` (``torch.distributed._composable.contract``): a ``configure_model`` calls ``fully_shard``
  imported by name, so while it runs the cell holds a recorder and the empty state ``contract`` registers is taken
  off the module again (:func:`.torch.fully_shard_recorded`, [Note: configure_model's calls]). No public API records
  what ``fully_shard`` was asked without sharding. Checked against 2.13.0.
- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``: ``CheckpointWrapper``, ``ActivationWrapper`` and
  ``_checkpoint_wrapped_module``, the module ``checkpoint_wrapper`` lives in (the only place torch offers it) and
  the attribute that holds the wrapped block: each wrapper a ``configure_model`` made is put back by its block, which
  then recomputes its activations (:func:`.torch.checkpoint_wrappers`). Checked against 2.13.0.
- ``torch.nn.init.trunc_normal_`` (public, but patched): swapped from a strategy's ``setup`` to its ``teardown`` for a
  wrapper that leaves ghosts alone (:func:`.torch.ghost_safe_init`); torch 2.13 redraws by rejection, reading
  ``mask.any()``, and the function has no ``__torch_function__`` override point.
- ``torch._ops.OpOverload`` and its ``_schema`` (``is_mutable``): a ghost operation's result is kept by its
  arguments' shapes only for aten operations that mutate nothing (``_ghost.py``, [Note: ghost results by shape]);
  ``torch.overrides._get_current_function_mode``: the loss observer takes itself off the mode stack while blocks run
  only when it is on top (:func:`.torch.top_function_mode`). Neither has a public equivalent.

- FSDP2 (checked against 2.13 and 2.15): ``fully_shard.state(module)`` and the state's ``_fsdp_param_group(s)``,
  ``_lazy_init``, ``_root_post_backward_final_callback`` and ``_state_ctx`` (from 2.15, its
  ``manual_backward_finalization(_active)``: the callback asserts that a backward fixed the mode);
  ``FSDPParamGroup.fsdp_params`` and ``post_backward``; ``FSDPParam.sharded_param``, ``unsharded_param``
  (``_unsharded_param``) and ``unsharded_accumulated_grad``. The public API (``set_requires_gradient_sync``,
  ``unshard``, ``reshard``) drives one backward per step. Sharded pipeline stages defer the reduction over the
  microbatches and reduce in their last backward, after scaling the accumulated unsharded gradients by the step's loss
  weights, which no public hook allows: they do what torch's own ``PipelineStage.perform_reduce_grad`` does for an
  ``FSDPModule`` (the groups' ``post_backward``, then the root's final callback), and wrap ``post_backward`` as an
  instance attribute of each group for the last backward (:func:`.parallel.fsdp_reduce_in_backward`). FSDP's forward
  hooks are taken out while a stage runs on ghosts (:class:`.parallel.fsdp_hooks_suspended`:
  ``nn.Module._forward_pre_hooks``/``_forward_hooks``).

transformers (checked against 5.3 and 5.24; not a dependency, read only where the user's code imported it):

- ``PreTrainedModel._output_capturing_hooks_installed``: the mark of a model whose output-capturing hooks are
  installed (:mod:`.transformers`); ``output_capturing._active_collector``: what a forward records now, read while
  the setup's analysis calls a block, to find blocks whose own outputs are recorded (``output_hidden_states``);
  ``generation.utils._slice_mm_encoder_output``: the features ``generate()`` encoded for a batch's images, cut by
  placeholder as its chunked prefill cuts them, here per microbatch;
  ``PreTrainedModel._init_weights``: a model's own initialisation of modules that have no ``reset_parameters``
  (``_model/materialize.py``). The cache classes are reached through their public
  ``layers``, ``keys``/``values`` and ``layer_class_to_replicate`` (``_step/caches.py``).

torchmetrics (checked against 1.9; the dependency is pinned below 2):

- ``Metric._defaults``, ``_update_count``, ``_forward_cache``, ``_computed``, ``_cache``, ``_is_synced``,
  ``_to_sync``, ``_should_unsync``, ``_reduce_states``: the state handling ``Metric.forward`` does in
  ``_forward_reduce_state_update``, which a training step split over microbatches has to do itself so that a metric
  called once per microbatch logs the whole batch's value.
"""

from __future__ import annotations

#: Every private name of Lightning, torch and torchmetrics the package reaches for, as ``(module, attribute path)``,
#: whether through this module or directly (the modules that reach directly are named). An attribute an instance
#: sets in its class's code counts as the class's. ``tests/test_compat.py`` looks up each one on the installed
#: versions: the first test to run when a new Lightning or torch comes out. Names looked up only where they exist
#: (``schedules._add_wait_send``, from torch 2.15) are in :data:`PRIVATE_NAMES_WHERE_PRESENT`. ``tests/test_compat.py``
#: also scans the package's source: a private name read or imported without an entry here fails it.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    # torch: undoing a stage's parallelization after a Trainer call ([Note: undoing a stage's parallelization])
    ("torch.distributed._composable_state", "_module_state_mapping"),
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
    ("lightning.pytorch.callbacks", "ModelSummary._summary"),  # _lightning/summary.py
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
    ("torch.distributed.distributed_c10d", "_get_default_store"),  # .torch.job_store: failures named on rank 0
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
    # torch: stages and meshes, tensor parallelism (see the entries above; tests/test_compat.py checks the signatures)
    ("torch.distributed.pipelining", "PipelineStage.backward_maybe_with_nosync"),  # _step/pipeline.py: ReducingStage
    ("torch.distributed.pipelining._backward", "get_param_groups"),  # .pipelining.merged_param_groups
    ("torch.distributed.pipelining.stage", "stage_backward_weight"),  # .pipelining.weight_gradients_keep_graph
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),  # _parallel_dims.py: ParallelDims.build
    ("torch.distributed.tensor.parallel.style", "ParallelStyle._apply"),  # .parallel, _model/tensor_parallel.py
    # torch: what configure_model asks of fully_shard and checkpoint_wrapper (_compat/parallel.py, _compat/torch.py)
    ("torch.distributed._composable.contract", "STATE_KEY"),
    ("torch.distributed._composable.contract", "REGISTRY_KEY"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"),
    # torch: FSDP2 (_compat/parallel.py; see "FSDP2" above)
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._fsdp_param_group"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._fsdp_param_groups"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._lazy_init"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._root_post_backward_final_callback"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._state_ctx"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.fsdp_params"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.post_backward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.sharded_param"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.unsharded_param"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.unsharded_accumulated_grad"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam._unsharded_param"),
    # torch: tensors and modules
    ("torch.utils._pytree", "tree_any"),  # _ghost.py
    ("torch.utils._pytree", "tree_map"),  # _ghost.py
    ("torch.utils._pytree", "tree_leaves"),  # _ghost.py, _model/structure.py, _step/pipeline.py
    ("torch.utils._pytree", "tree_flatten"),  # _step/program.py, _step/generation.py
    ("torch.utils._pytree", "tree_unflatten"),  # _step/program.py, _step/generation.py
    ("torch.nn.modules.batchnorm", "_BatchNorm"),  # _step/auto.py: BatchNorm fixes the microbatch count
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper._checkpoint_wrapped_module"),
    ("lightning.pytorch.callbacks", "ModelSummary._max_depth"),  # _lightning/summary.py
    ("lightning.pytorch.utilities.model_summary", "ModelSummary._layer_summary"),  # _lightning/summary.py
    ("torch", "Tensor._make_wrapper_subclass"),  # _ghost.py
    ("torch", "Tensor._base"),  # _calls/batch.py: row_span reads a microbatch's rows from its view
    ("torch._C", "_disabled_torch_function_impl"),  # _ghost.py
    ("torch.overrides", "_get_current_function_mode"),  # .torch.top_function_mode: the loss observer's pause
    ("torch._ops", "OpOverload"),  # _ghost.py: which ghost operations' results are kept by shape
    ("torch._ops", "OpOverload._schema"),  # _ghost.py: in-place and `out=` operations are not kept
    ("torch", "ops.aten._local_scalar_dense.default"),  # _ghost.py
    ("torch", "ops.aten._index_put_impl_"),  # _ghost.py: boolean-mask indexing of a ghost
    ("torch", "_foreach_mul_"),  # _step/gradients.py
    # _model/cut.py, _model/materialize.py, _model/structure.py, _lightning/callbacks.py
    ("torch.nn", "Module._parameters"),
    ("torch.nn", "Module._buffers"),  # _model/cut.py, _model/materialize.py, _model/structure.py
    ("torch.nn", "Module._modules"),  # _model/backbone.py, _calls/blocks.py
    ("torch.nn", "Module._non_persistent_buffers_set"),  # _model/cut.py
    ("torch.nn", "Module._forward_pre_hooks"),  # _compat/parallel.py: fsdp_hooks_suspended
    ("torch.nn", "Module._forward_hooks"),  # _compat/parallel.py: fsdp_hooks_suspended
    ("torch.nn.utils.prune", "_compute_nparams_toprune"),  # _lightning/callbacks.py
    ("torch.nn.utils.prune", "_validate_pruning_amount"),  # _lightning/callbacks.py
    ("torch.nn._reduction", "legacy_get_string"),  # _step/loss_weights.py
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
    # torch: compiled modules (_compiled.py: a block the user compiled is recognised, not compiled twice)
    ("torch.nn", "Module._compiled_call_impl"),
    ("torch._dynamo.eval_frame", "OptimizedModule._orig_mod"),
    # torch: forward hooks that run inside a block (_compat/transformers.py, _calls/inner.py)
    ("torch.nn", "Module._forward_hooks_with_kwargs"),
    ("torch.nn", "Module._forward_hooks_always_called"),
    # torch: the parallel Hugging Face save (checkpoint/_hf.py): no public name consolidates on every rank
    ("torch.distributed.checkpoint._consolidate_hf_safetensors", "consolidate_safetensors_files_on_every_rank"),
    # transformers: a model's own initialisation of modules without reset_parameters (_model/materialize.py)
    ("transformers", "PreTrainedModel._init_weights"),
    # _compat/transformers.py: the mark this module's functions set on a model
    ("transformers.utils.output_capturing", "_output_capturing_hooks_installed"),
    # _compat/transformers.py: what a `capture_outputs` forward records now (the blocks whose outputs it records)
    ("transformers.utils.output_capturing", "_active_collector"),
    # _compat/transformers.py: generate()'s own cut of the images' encoded features (its chunked prefill)
    ("transformers.generation.utils", "_slice_mm_encoder_output"),
)

#: Private names looked up only where the installed release has them (a missing one is a supported release, not a
#: moved name): counted by the source scan in ``tests/test_compat.py``, not required to exist.
PRIVATE_NAMES_WHERE_PRESENT: tuple[tuple[str, str], ...] = (
    ("torch.distributed.pipelining.schedules", "_add_wait_send"),  # torch 2.15: .pipelining.keep_forward_actions
    # torch 2.15: .parallel.fsdp_reduce_now
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPStateContext.manual_backward_finalization_active"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPStateContext.manual_backward_finalization"),
)
