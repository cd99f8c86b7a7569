"""What crosses each stage boundary: every value a later stage needs that an earlier one computes.

[Note: stage boundaries] A step is a sequence of *positions*: the code before block 0 (region 0), block 0, the code
between block 0 and block 1 (region 1), ..., block ``n - 1``, the code after the backbone (region ``n``). Region
``r`` runs on the stage of block ``r`` (the code between two containers runs where the next container starts, with
what the previous stage sent), region ``n`` on the last stage.

The setup's analysis (:mod:`lightning_pipe._model.structure`) follows every value computed from parameters from where
it is produced to where it is used. A value is named by its *producer*, which every stage can find again in its own
run of the step:

- ``("block", j, 0, i)``: tensor ``i`` of block ``j``'s output (its hidden state, or the position bias T5's first
  block returns, or either stream of a Flux double-stream block);
- ``("module", path, k, i)``: tensor ``i`` of the output of the ``k``-th call of the module at ``path`` outside the
  blocks (the time embedding of a diffusion transformer, an encoder's final norm or dropout, a decoder's
  embedding);
- ``("inner", path, k, i)``: tensor ``i`` of the output of the ``k``-th call of the module at ``path`` inside a
  block, which a forward hook hands out (a mixture-of-experts router's logits, which the load-balancing loss reads
  after the backbone: [Note: values from inside blocks] in :mod:`lightning_pipe._calls.inner`).

A value computed by plain tensor code from such values (a reshape, a ``.to(dtype)``, a mask built from an
embedding) is computed again on the stage that uses it, from its producers. A boundary carries every producer
whose value is used on a later stage, in the order they are produced, as far as its last user: the code after the
backbone included (Flux's final norm takes ``temb``). The stage that receives a value puts it in place where it is
produced (a skipped block answers with it; a module's call returns it), so the user's code carries it by itself to
every use, with its gradient flowing back to the stage that computed it.

What cannot be sent is refused at setup: a value used on a later stage that plain tensor code computes from a
parameter directly (move that code into a module), and a boundary that would carry nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pipe._errors import BackboneCallError

if TYPE_CHECKING:
    from lightning_pipe.partition import StageLayout

#: ``("block", index, 0, leaf)`` or ``("module", path, call, leaf)``: where a value is produced (see the Note).
Producer = tuple[str, Union[int, str], int, int]


def block_position(index: int) -> int:
    return 2 * index + 1


def region_position(region: int) -> int:
    return 2 * region


@dataclass(frozen=True)
class Unsendable:
    """A value plain tensor code computes from parameters, used later: recomputed where it is used, it would need
    those parameters there."""

    what: str  # e.g. "the result of aten.add.Tensor"
    parameters: tuple[str, ...]
    position: int
    uses: frozenset[int]


@dataclass(frozen=True)
class Flow:
    """The values each stage boundary carries, for one layout (identical on every rank).

    Attributes:
        sends: ``sends[s]``: the producers stage ``s`` sends to stage ``s + 1``, in order; for the last stage, the
            producers the code after the backbone reads (what the last stage hands to the loss).
        names: a readable name of each producer, for the log and errors.
    """

    sends: tuple[tuple[Producer, ...], ...]
    names: dict
    #: the stage whose ``sends`` are the answers: the last, or, for a call that runs only some blocks, the stage that
    #: runs the code after them ([Note: partial passes])
    answer_stage: int = -1
    #: the blocks the call runs (``None``: all of them)
    blocks: Optional[range] = None

    def receives(self, stage: int) -> tuple[Producer, ...]:
        return self.sends[stage - 1] if stage > 0 else ()

    @property
    def answers(self) -> tuple[Producer, ...]:
        return self.sends[self.answer_stage]

    def carries_more_than_hidden(self) -> bool:
        return any(len(s) > 1 for s in self.sends)

    def describe(self) -> str:
        parts = [
            f"stage {s} -> {s + 1}: {', '.join(self.names[p] for p in sent)}"
            for s, sent in enumerate(self.sends[:-1])
        ]
        return "; ".join(parts) + f"; to the code after the backbone: {', '.join(self.names[p] for p in self.answers)}"


def make_flow(structure: Any, layout: StageLayout, block_names: list[str]) -> Flow:
    """The :class:`Flow` of ``structure`` (what the analysis learned) under ``layout``; raises
    :class:`~lightning_pipe.BackboneCallError` for what cannot cross a boundary."""
    n = len(block_names)
    last = layout.num_stages - 1

    def stage_of(position: int) -> int:
        if position % 2:
            return layout.stage_of_block((position - 1) // 2)
        region = position // 2
        return last if region >= n else layout.stage_of_block(region)

    sends: list[list[Producer]] = [[] for _ in range(layout.num_stages)]
    names = {}
    for producer, (position, uses) in structure.values.items():
        names[producer] = _name(producer, block_names)
        start = stage_of(position)
        later = [stage_of(u) for u in uses if u > position]
        end = max(later, default=start)
        for s in range(start, min(end, last)):
            sends[s].append(producer)
        if region_position(n) in uses and position < region_position(n):
            sends[last].append(producer)
    for item in structure.unsendable:
        start = stage_of(item.position)
        crossing = sorted({stage_of(u) for u in item.uses if stage_of(u) > start})
        if crossing:
            raise BackboneCallError(
                f"{item.what}, computed from the parameter(s) {', '.join(item.parameters)} outside any module on stage"
                f" {start}, is used on stage {crossing[0]}. A stage boundary carries the outputs of blocks and of"
                " modules, and code that computes from them runs again where it is needed, but that code reads a"
                " parameter directly. Move it into a module (an `nn.Module` whose forward does it), or into a block."
            )
    for s in range(last):
        if not sends[s]:
            raise BackboneCallError(
                f"Nothing that stage {s} computes reaches stage {s + 1}: the blocks of stage {s + 1} take no block's"
                " output and no value computed from parameters before them. A pipeline runs stages one after the"
                " other; name the containers whose blocks feed each other with `backbone=`."
            )
    if not sends[last]:
        raise BackboneCallError(
            "The code after the backbone uses no output of the backbone's blocks. Compute the loss (or the step's"
            " result) from the last block's output."
        )
    return Flow(tuple(tuple(s) for s in sends), names)


def make_pass_flow(structure: Any, layout: StageLayout, block_names: list[str], blocks: range, produced: set) -> Flow:
    """The :class:`Flow` of a call that runs only ``blocks`` and, of the values the step's analysis saw, only
    those ``produced`` ([Note: partial passes] in :mod:`lightning_pipe._step.partial`): each is carried from
    where it is produced as far as its last use within the call, the code after ``blocks`` included, which runs on
    the answer stage (the stage of block ``blocks.stop``, or the last). The other stages carry nothing."""
    n, last = len(block_names), layout.num_stages - 1
    answer_stage = last if blocks.stop >= n else layout.stage_of_block(blocks.stop)
    end = region_position(blocks.stop)

    def stage_of(position: int) -> int:
        if position % 2:
            return layout.stage_of_block((position - 1) // 2)
        return answer_stage if position >= end else layout.stage_of_block(position // 2)

    sends: list[list[Producer]] = [[] for _ in range(layout.num_stages)]
    for producer, (position, uses) in structure.values.items():
        if producer not in produced and producer[:3] not in produced:
            continue
        start = stage_of(position)
        answer = position < end <= max(uses)  # read after the call's blocks (or by what it returns)
        later = [stage_of(u) for u in uses if position < u <= end] + [answer_stage] * answer
        for s in range(start, min(max(later, default=start), answer_stage)):
            sends[s].append(producer)
        if answer:
            sends[answer_stage].append(producer)
    return Flow(tuple(tuple(s) for s in sends), {p: _name(p, block_names) for p in structure.values},
                answer_stage, blocks)


def _name(producer: Producer, block_names: list[str]) -> str:
    kind, key, call, leaf = producer
    if kind == "block":
        return f"`{block_names[key]}` output {leaf}"
    return f"`{key}` call {call} output {leaf}" + (" (inside its block)" if kind == "inner" else "")
