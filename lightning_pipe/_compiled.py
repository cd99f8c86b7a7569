"""Compiled blocks: what ``compile=`` does, and what cannot be honoured with compiled blocks.

[Note: compiled blocks]
``compile=True`` (or a dict of ``torch.compile``'s options) calls ``Module.compile`` on every block of this rank's
stages, after tensor parallelism and before sharding, as torchtitan orders them. ``Module.compile`` compiles in place:
the block keeps its class and its parameter names, so checkpoints, the cut and the optimizers see the same names.
A block the user compiled in ``configure_model`` is recognised and not compiled twice. The setup's analysis runs on
ghosts with dynamo forced eager (``_setup.py``), so nothing compiled ever traces a ghost.

The schedules that split each backward into an input-gradient and a later weight-gradient action
(``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) cannot have torch split a compiled block's backward: it
is one compiled graph that computes both gradients at once (pytorch#161904, torchtitan#3584). So a stage with compiled
blocks splits it inside the graph: its linear layers' weight gradients wait for the weight action, and every other
gradient is computed in the input action, which runs the whole backward ([Note: deferred weight gradients] in
``_step/deferred_linear.py``). Exact, and the bulk of a transformer's weight-gradient work still fills the bubble.

Linear layers sharded by ``fully_shard`` defer theirs too: the forward sees them unsharded, and under these schedules
their units reduce-scatter after the schedule, after every weight action. So do linear layers split over tensor ranks
by output or by input features (``ColwiseParallel``, ``RowwiseParallel``, sequence-parallel or not): their local
parts run the op, as DTensor's own ``F.linear`` runs them. A layer split in another layout (or a split ``Conv1D``)
computes its weight gradient in the input action: exact too, but the schedule's gain is lost there, a warning that
names the layers says so at setup, and ``schedule="auto"`` weighs only the schedules that do not split the backward.
Nothing falls back to eager.
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


def whole_backward_warning(schedule: str, layers: list[str]) -> str:
    """What a run of a schedule that splits the backward is told where compiled blocks hold linear layers split over
    tensor ranks in a layout whose weight gradient cannot wait ([Note: compiled blocks])."""
    return (
        f"`PipelineStrategy(schedule={schedule!r})` with compiled blocks: torch cannot split a compiled block's"
        " backward into its input- and weight-gradient parts (pytorch#161904), and the linear layers"
        f" {', '.join(repr(name) for name in layers)} are split over tensor ranks in a layout that cannot defer their"
        " weight gradients (only a split by output features, as `ColwiseParallel`'s, or by input features, as"
        " `RowwiseParallel`'s, of an `nn.Linear` can), so theirs are computed in the input-gradient action. Training"
        " is exact, but those weight gradients do not fill the bubble: split them with `ColwiseParallel` or"
        " `RowwiseParallel`, or run 'Interleaved1F1B' or '1F1B', as fast here."
    )
