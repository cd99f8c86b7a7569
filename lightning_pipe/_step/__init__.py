"""What runs for every batch: the user's step as pipeline stages, torch's schedule, microbatches and gradients.

``runtime`` is built by the strategy's ``setup`` and called from its ``training_step``/``validation_step``/...;
``program`` runs the step as a stage, ``pipeline`` drives torch's schedule, ``microbatches`` splits the batch,
``loss_weights`` weights microbatch losses by their counts, ``gradients`` keeps the schedule's gradients across
Lightning's ``zero_grad``. ``last_backward`` reduces over the replicas during each stage's last backward ([Note:
overlapped reductions]) through ``replica_buckets``, ``unit_reduce_scatter`` and ``loss_weight_channel``; ``sharded``
drives the FSDP units ``_model.shard`` made. Imports go down to ``_model``, ``_lightning`` and the leaves, never up to
the strategy.
"""
