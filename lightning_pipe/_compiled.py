"""Compiled blocks: what ``compile=`` does, and what cannot be honoured with compiled blocks.

[Note: compiled blocks]
``compile=True`` (or a dict of ``torch.compile``'s options) calls ``Module.compile`` on every block of this rank's
stages, after tensor parallelism and before sharding, as torchtitan orders them. ``Module.compile`` compiles in place:
the block keeps its class and its parameter names, so checkpoints, the cut and the optimizers see the same names.
A block the user compiled in ``configure_model`` is recognised and not compiled twice. The setup's analysis runs on
ghosts with dynamo forced eager (``_setup.py``), so nothing compiled ever traces a ghost.

The schedules that split each backward into an input-gradient and a later weight-gradient action
(``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) cannot run a compiled block: its backward is one
compiled graph that computes both gradients at once, and torch's stage then fails in backward ("compiled with
non-empty donated buffers") or computes the weight gradient twice (pytorch#161904, torchtitan#3584). Keeping the
weight gradients outside the compiled graph would be exact, but is not built; so a compiled block under such a
schedule is refused at setup on every rank, naming the schedules that work, and ``schedule="auto"`` weighs only
those. Nothing falls back to eager silently.
"""

from __future__ import annotations

from typing import Any


def compiled(block: Any) -> bool:
    """Whether ``block`` runs compiled: ``Module.compile()`` was called on it, or it is ``torch.compile``'s wrapper."""
    return getattr(block, "_compiled_call_impl", None) is not None or hasattr(block, "_orig_mod")


def compiled_zero_bubble(schedule: str, what: str) -> str:
    """The refusal of a schedule that splits the backward with compiled blocks ([Note: compiled blocks])."""
    return (
        f"`PipelineStrategy(schedule={schedule!r})` splits each block's backward into an input- and a weight-gradient"
        f" step, which torch cannot do for a compiled block ({what}; pytorch#161904). Use `schedule='1F1B'`,"
        " 'Interleaved1F1B', 'GPipe' or 'LoopedBFS' with compiled blocks, `schedule='auto'` (which then weighs only"
        " those), or leave the blocks uncompiled."
    )


def refuse_compiled_zero_bubble(schedule: Any, blocks: list[Any]) -> None:
    """Blocks compiled by the user (``block.compile()`` in ``configure_model``) under a schedule that splits the
    backward: refused on every rank, naming the fix ([Note: compiled blocks])."""
    if schedule.splits_backward and any(compiled(b) for b in blocks):
        raise ValueError(compiled_zero_bubble(schedule.name, "blocks compiled with `Module.compile()`"))
