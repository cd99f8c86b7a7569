"""Pipelined checkpoints: directories written with ``torch.distributed.checkpoint`` by every rank.

The strategy saves and loads them itself (``ModelCheckpoint``, ``trainer.save_checkpoint`` and ``ckpt_path=`` work
unchanged). Outside a Trainer:

- :func:`load_from_checkpoint` loads a LightningModule from a checkpoint directory (or file), in one process;
- :func:`consolidated_checkpoint` / :func:`consolidate` turn a directory into one ordinary Lightning checkpoint
  (also ``python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt``);
- :func:`stored_balance` reads the stage split a checkpoint was saved with, to reuse it on resume;
- :func:`is_pipeline_checkpoint` tells a complete checkpoint directory.

The directory layout is described in ``docs/checkpointing.md``.
"""

from lightning_pipe.checkpoint._consolidate import consolidate, consolidated_checkpoint, load_from_checkpoint
from lightning_pipe.checkpoint._dcp import stored_balance
from lightning_pipe.checkpoint._files import META_FILENAME, is_pipeline_checkpoint
from lightning_pipe.checkpoint._names import CheckpointMismatchError

__all__ = [
    "CheckpointMismatchError",
    "META_FILENAME",
    "consolidate",
    "consolidated_checkpoint",
    "is_pipeline_checkpoint",
    "load_from_checkpoint",
    "stored_balance",
]
