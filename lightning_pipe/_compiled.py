"""Compiled blocks: what ``compile=`` does, and what cannot be honoured with compiled blocks.

[Note: compiled blocks]
``compile=True`` (or a dict of ``torch.compile``'s options) calls ``Module.compile`` on every block of this rank's
stages, after tensor parallelism and before sharding, as torchtitan orders them. ``Module.compile`` compiles in place:
the block keeps its class and its parameter names, so checkpoints, the cut and the optimizers see the same names.
A block the user compiled in ``configure_model`` is recognised and not compiled twice. The setup's analysis runs on
ghosts with dynamo forced eager (``_setup.py``), so nothing compiled ever traces a ghost.

The schedules that split each backward into an input-gradient and a later weight-gradient action
(``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) cannot split a compiled block's backward: it is one
compiled graph that computes both gradients at once. torch's input action keeps the graph for the weight action
(``retain_graph=True``), which a compiled backward with donated buffers refuses ("compiled with non-empty donated
buffers"), and without donated buffers the weight action would run the whole compiled backward a second time
(pytorch#161904, torchtitan#3584). So a stage that holds compiled blocks runs its **whole backward in its input
action**, with ``retain_graph=False``, and its weight action has nothing left to do (``ReducingStage.whole_backward``
in ``_step/pipeline.py``). That is exact: every gradient is the one the unsplit backward computes, accumulated over
the microbatches in the same order (the weight actions of a stage run in the order of its input actions). What is
lost is the schedule's gain: the weight gradients no longer fill the bubble, so these schedules run about as
1F1B or Interleaved1F1B do, and a warning says so at setup. The first stage is unchanged: torch runs its whole
backward in the weight action already (it has no input gradient to send). ``schedule="auto"`` weighs only the
schedules that do not split the backward when blocks are compiled: its cost model would credit the others with the
gain. Nothing falls back to eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def compiled(block: nn.Module) -> bool:
    """Whether ``block`` runs compiled: ``Module.compile()`` was called on it, or it is ``torch.compile``'s wrapper."""
    return getattr(block, "_compiled_call_impl", None) is not None or hasattr(block, "_orig_mod")


def compiled_stages(backbone: Any, bounds: dict[int, tuple[int, int]]) -> frozenset[int]:
    """The stages of ``bounds`` (``{stage: (start, stop)}`` of backbone indices) that hold a compiled block."""
    return frozenset(s for s, (start, stop) in bounds.items() if any(compiled(backbone.module(i))
                                                                     for i in range(start, stop)))


def whole_backward_warning(schedule: str) -> str:
    """What a run of a schedule that splits the backward with compiled blocks is told ([Note: compiled blocks])."""
    return (
        f"`PipelineStrategy(schedule={schedule!r})` with compiled blocks: torch cannot split a compiled block's"
        " backward into its input- and weight-gradient parts (pytorch#161904), so each stage with compiled blocks runs"
        " its whole backward in its input-gradient action. Training is exact, but the weight gradients no longer fill"
        " the bubble: 'Interleaved1F1B' or '1F1B' run as fast with compiled blocks."
    )
