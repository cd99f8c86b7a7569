"""Callbacks of the package: :class:`HuggingFaceCheckpoint`, the parallel Hugging Face save as a callback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["HuggingFaceCheckpoint"]


class HuggingFaceCheckpoint(Callback):
    """Write the Hugging Face model inside the LightningModule as a directory ``from_pretrained`` loads, every rank
    writing its own stages (:meth:`lightning_pipe.PipelineStrategy.save_pretrained`): at the end of training, and every
    ``every_n_train_steps`` steps into ``dirpath/step=N``.

    Args:
        dirpath: the directory the final model is written to.
        every_n_train_steps: also write every this many optimizer steps, into ``dirpath/step=<global_step>``;
            ``None`` (default): at the end only.
        max_shard_size: the largest safetensors file, as ``save_pretrained`` takes it.
        attribute: the LightningModule's attribute that is the Hugging Face model; found when ``None``.
    """

    def __init__(
        self,
        dirpath: Union[str, os.PathLike],
        every_n_train_steps: Optional[int] = None,
        max_shard_size: Union[int, str] = "5GB",
        attribute: Optional[str] = None,
    ) -> None:
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool) or every_n_train_steps < 1):
            raise ValueError(f"`HuggingFaceCheckpoint(every_n_train_steps={every_n_train_steps!r})` must be >= 1.")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.max_shard_size = max_shard_size
        self.attribute = attribute
        self._saved_step = -1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(trainer.strategy, "save_pretrained"):
            raise TypeError(
                f"`HuggingFaceCheckpoint` writes through `PipelineStrategy.save_pretrained`; the Trainer runs "
                f"`{type(trainer.strategy).__name__}`. Use `Trainer(strategy=PipelineStrategy(...))`, or call "
                "`save_pretrained` of the model yourself."
            )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        n, step = self.every_n_train_steps, trainer.global_step
        if n is not None and step > 0 and step % n == 0 and step != self._saved_step:  # once per optimizer step
            self._saved_step = step
            self._save(trainer, self.dirpath / f"step={step}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, self.dirpath)

    def _save(self, trainer: pl.Trainer, path: Path) -> None:
        trainer.strategy.save_pretrained(  # type: ignore[attr-defined]
            path, max_shard_size=self.max_shard_size, attribute=self.attribute
        )
