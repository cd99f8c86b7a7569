"""The error a step that cannot be pipelined raises, and the messages written in more than one place."""

from __future__ import annotations

from typing import Any


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
