"""What runs for every batch: the user's step as pipeline stages, torch's schedule, microbatches and gradients.

``runtime`` is built by the strategy's ``setup`` and called from its ``training_step``/``validation_step``/...;
``program`` runs the step as a stage, ``pipeline`` drives torch's schedule, ``microbatches`` splits the batch,
``loss_weights`` weights microbatch losses by their counts, ``gradients`` keeps the schedule's gradients across
Lightning's ``zero_grad``. Imports go down to ``_model``, ``_lightning`` and the leaves, never up to the strategy.
"""
