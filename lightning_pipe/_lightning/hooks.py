"""The arguments Lightning's loops pass to a step hook, decided as the loops decide them.

``training_step(self, batch)`` takes no ``batch_idx``, and the evaluation and prediction steps take ``batch_idx`` and
``dataloader_idx`` or not: the strategy calls the step itself at setup (analysis, ``balance="time"`` profiling), so it
asks Lightning's own :func:`~lightning.pytorch.utilities.signature_utils.is_param_in_hook_signature`, with the
``min_args`` the loops use, instead of reading the signature itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: The step hook each ``Trainer`` call runs.
STEP_HOOKS = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


def step_args(module: pl.LightningModule, fn: TrainerFn, batch: Any, num_dataloaders: int = 1) -> tuple:
    """The positional arguments Lightning's loop passes to the step of ``fn`` for batch 0 of the first dataloader.

    Args:
        module: the LightningModule whose step hook is called.
        fn: the running ``Trainer`` call (``trainer.state.fn``).
        batch: the batch, as the step receives it (after the transfer hooks).
        num_dataloaders: how many loaders the running loop iterates; evaluation and prediction pass
            ``dataloader_idx`` only when there are several (the training loop never does).

    Returns:
        ``(batch,)``, followed by ``batch_idx=0`` when the hook takes it and, for several evaluation or prediction
        loaders, ``dataloader_idx=0``.
    """
    step = getattr(module, STEP_HOOKS[fn])
    args: tuple = (batch, 0) if is_param_in_hook_signature(step, "batch_idx", min_args=2) else (batch,)
    if fn != TrainerFn.FITTING and num_dataloaders > 1:
        args += (0,)
    return args
