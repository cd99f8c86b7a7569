"""The error a step that cannot be pipelined raises, and the messages written in more than one place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from types import TracebackType


class BackboneCallError(RuntimeError):
    """The user's step uses the pipelined backbone in a way the pipeline cannot run."""

    __module__ = "lightning_pipe"  # its public home


def not_computed_by_last_stage(what: str, fix: str, value: Any = None) -> str:
    """The message for a value used after the backbone that only the first stage (or another block) computes."""
    shown = f" ({value!r})" if value is not None else ""
    return (
        f"{what} the last pipeline stage does not compute{shown}: it comes from before the backbone (computed from the"
        f" first stage's parameters) or from a block other than the last. {fix}"
    )


def argument_not_on_stage(block: str, stage: int, what: str) -> str:
    """The message for a block argument that another stage than the block's computes from its parameters."""
    return (
        f"Block `{block}` runs on stage {stage}, but {what}. Only the hidden state travels between stages; a block's"
        " other arguments must be computable from the batch and buffers on every stage (masks, position ids, rotary"
        " tables). Compute them from the batch, or move that computation into the blocks."
    )



class stop_iteration_fails:  # a context manager, named like contextlib's
    """Turn a ``StopIteration`` out of the user's step into an error. Lightning's loops take one for the end of the
    data: this rank alone would end its epoch, silently, and the other ranks would wait for it forever. (A class:
    ``contextlib.contextmanager`` lets a ``StopIteration`` through even when the generator converts it.)"""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: Optional[type[BaseException]], err: Optional[BaseException], traceback: Optional[TracebackType]
    ) -> None:
        if isinstance(err, StopIteration):
            raise RuntimeError(
                "The step raised `StopIteration` under `PipelineStrategy` (Lightning would take it for the end of the"
                " data on this rank only, and the other ranks would wait forever). The usual cause is `next(...)` over"
                " something this stage does not hold, such as `next(module.parameters())` of a module whose"
                " parameters live on another stage: read the dtype or device from the input, a buffer or"
                " `self.device` instead."
            ) from err
