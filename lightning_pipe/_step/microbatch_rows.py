"""The check that a training step's microbatches are cut from the batch's rows as its first block sees them.

Each stage runs the user's step of a microbatch on the rows of the batch that make that microbatch's rows of the
first block's hidden state (``StepProgram.sub_batch``, [Note: rows folded into the batch]). Tensors of the batch
whose first dimension is not the batch's rows reach every microbatch whole. Where that is wrong, the microbatches'
steps on ghosts say so: their code before the backbone fails (packed images that no rule cuts meet a microbatch's
image tokens), or makes a hidden state with other rows than the microbatch's share. Either is an error
that names the tensors given whole, on every rank alike (the check runs on ghosts, the same everywhere), before the
schedule sends anything. Evaluation has the same check for every microbatch (``LockStep.splits_by_rows``), which
sends a step that fails it to lock step instead.

Each structure of batch (the tensors given whole, the rows per batch row, the microbatch count) is checked once,
every microbatch of it: a step's code before the backbone on ghosts, a few milliseconds at the first step.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_pipe._calls.batch import left_whole
from lightning_pipe._calls.runners import BlockRunners
from lightning_pipe._errors import BackboneCallError


class MicrobatchRowsCheck:
    """Checks the first microbatch of each new structure of training batch (see the module docstring)."""

    def __init__(self, program: BlockRunners) -> None:
        self.program = program
        self._checked: set[tuple] = set()

    def __call__(
        self, step: Callable[..., object], batch: Any, sample: Any, *, rest: tuple, kwargs: dict, batch_size: int,
        num_microbatches: int,
    ) -> None:
        """``sample``: the first microbatch's rows of ``batch``, whose first block's hidden state has ``batch_size``
        rows; ``rest`` and ``kwargs``: the step's other arguments."""
        program = self.program
        per_row = program.rows_per_row
        whole = list(left_whole(batch, batch_size // per_row))
        key = (per_row, num_microbatches, tuple(path for path, _ in whole))
        if num_microbatches == 1 or key in self._checked:
            return
        rows = batch_size // num_microbatches
        for start in range(0, batch_size, rows):
            part = sample if start == 0 else program.batch_rows(batch, batch_size, start, start + rows)
            try:
                shape = program.hidden_shape_of(step, part, *rest, **kwargs)
            except BackboneCallError:
                raise
            except Exception as err:
                raise BackboneCallError(
                    f"`{getattr(step, '__name__', step)}` fails on a microbatch: {type(err).__name__}: {err}."
                    f"{_how_cut(whole, batch_size // per_row, num_microbatches)}"
                ) from err
            if shape[program.rows_dim] != rows:
                raise BackboneCallError(
                    f"On microbatch {start // rows} ({rows} of the first backbone block's {batch_size} rows), that"
                    f" block's hidden state holds {shape[program.rows_dim]} rows (shape {list(shape)}), not {rows}:"
                    " its rows do not follow the batch's (a vision tower's images, as many as the batch has rows by"
                    " chance). Set `backbone=` to the blocks whose hidden state holds the batch's rows (a"
                    " vision-language model's language layers)."
                    f"{_how_cut(whole, batch_size // per_row, num_microbatches)}"
                )
        self._checked.add(key)


def _how_cut(whole: list[tuple[str, tuple[int, ...]]], batch_rows: int, num_microbatches: int) -> str:
    if not whole:
        return ""
    given = ", ".join(f"`{path}` {list(shape)}" for path, shape in whole[:4])
    return (
        f" `PipelineStrategy` runs the step of each of the {num_microbatches} microbatches on its share of the"
        f" batch's {batch_rows} rows: tensors whose first dimension is {batch_rows} are cut, the others reach every"
        f" microbatch whole (here: {given}). A tensor that holds the batch's samples in another layout (images or"
        " patches packed over the batch) cannot be cut so. Give it the batch's rows first (pad it per sample), or"
        " set `num_microbatches=1`."
    )
