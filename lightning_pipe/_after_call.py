"""What ``PipelineStrategy`` does with the module when a Trainer call ends, and the saves that read a split module.

A mixin of the strategy, as :class:`~lightning_pipe._lightning.collectives.WatchedCollectives` is: the module is made
whole on every rank, or left split behind a :class:`~lightning_pipe._model.whole.SplitGuard` ([Note: the whole module
after a Trainer call]); the parallel Hugging Face save and Lightning's ``lightning_module_state_dict`` read this rank's
stage through the guard.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pipe._model.whole import SplitGuard, after_call
from lightning_pipe.checkpoint import _hf

if TYPE_CHECKING:
    from lightning_pipe._model.cut import Cut


class ModuleAfterCall:
    """The strategy's part that leaves the module whole or guarded after each call (``_leave_module`` from
    ``teardown``, ``_release_split_guard`` from ``setup``), and what reads it then."""

    _split_guard: Optional[SplitGuard] = None  # a module left split after a call: its reads raise
    _keep_split: bool = False

    def _release_split_guard(self) -> None:
        """A module the last call left split is cut as it is by the next one."""
        if self._split_guard is not None:
            self._split_guard.release()
            self._split_guard = None

    def _reading_local_stage(self) -> AbstractContextManager[None]:
        guard = self._split_guard
        return guard.reading_local_stage() if guard is not None else nullcontext()

    def _leave_module(self, cut: Cut, failed: bool) -> None:
        """Whole on every rank after the call, or split behind a guard; after a failure the other ranks may be gone,
        so no collective runs and the module stays split."""
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is None or not cut.split:
            return
        if failed:
            self._split_guard = SplitGuard(module)
            return
        self._split_guard = after_call(
            module, cut, keep_split=self._keep_split, local_processes=self.num_processes,  # type: ignore[attr-defined]
            pipeline_group=self.dims.pipeline_group, device=self.root_device,  # type: ignore[attr-defined]
        )

    def save_pretrained(
        self,
        dirpath: Union[str, Path],
        *,
        max_shard_size: Union[int, str] = "5GB",
        safe_serialization: bool = True,
        attribute: Optional[str] = None,
    ) -> Path:
        """Write the Hugging Face model inside the LightningModule as a directory ``from_pretrained`` loads, every
        rank writing its own stages (and only its shard of a sharded or tensor-parallel stage) through DCP's
        ``HuggingFaceStorageWriter``: no process holds the whole model ([Note: the parallel Hugging Face save]). A
        peft model writes its adapter only. Call it on every rank, during a Trainer call (a callback:
        :class:`~lightning_pipe.HuggingFaceCheckpoint`) or after one.

        Args:
            dirpath: the directory to write.
            max_shard_size: the largest safetensors file, as ``PreTrainedModel.save_pretrained`` takes it.
            safe_serialization: safetensors only; ``False`` is refused (a pickle would run code when loaded).
            attribute: the LightningModule's attribute that is the Hugging Face model; found when ``None``.
        """
        if not safe_serialization:
            raise ValueError("`PipelineStrategy.save_pretrained` writes safetensors only: drop `safe_serialization`.")
        cut = self.runtime.cut  # type: ignore[attr-defined]
        with self._reading_local_stage():
            return _hf.save_pretrained(
                self.lightning_module, self.broadcast(str(dirpath)),  # type: ignore[attr-defined]
                stored=cut.names.stored, attribute=attribute, max_shard_size=max_shard_size,
                whole_sizes=cut.whole_shapes(),
            )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's stage, also for ``trainer.save_checkpoint`` after a call that left the module split."""
        with self._reading_local_stage():
            return super().lightning_module_state_dict()  # type: ignore[misc]
