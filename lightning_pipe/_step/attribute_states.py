"""State a block keeps in plain attributes between the calls of a decoding loop, kept per microbatch.

[Note: attribute states per microbatch] Some models keep a decoding loop's state in plain tensor attributes of the
modules inside their blocks, sized by the rows of the call that made them, and replace them at every call:
RecurrentGemma's recurrent block (``self.conv1d_state``, ``self.rg_lru.recurrent_states``: made at the first call
of a batch of a new size, replaced by each call). On one device the whole batch's rows go through every call. Under
the pipeline a pass runs microbatch by microbatch through the same modules, so the second microbatch would find the
state the first left (its own rows' history lost), and a shape probe would leave ghosts in them.

So, for the modules of the blocks this rank runs, every attribute that holds a tensor (not a parameter, buffer or
ghost) or ``None`` is a state per microbatch (:class:`AttributeStates`):

- as a pass begins (:meth:`~AttributeStates.begin`), the values they hold are noted: the whole batch's;
- before a microbatch's stage run (:meth:`~AttributeStates.rows`), the values the previous microbatch's run left are
  kept as that microbatch's, and those of the new one put in: what its last run left, or at its first run its rows
  of the noted values (a tensor with the batch's size in dimension 0; any other value as it is). A shape probe gets
  ghosts of them (copies where the probe runs for real), and what it leaves is dropped;
- as the pass ends (:meth:`~AttributeStates.end`), each attribute gets the whole batch's value back: the
  microbatches' values concatenated in row order where each holds its rows, else the last run's value.

Values that no call changes (a constant tensor attribute, an unused ``None``) come back as they were.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_pipe._ghost import Ghost, ghost_of

_Key = tuple[int, str]  # (index of the module, attribute name)
#: What every ``nn.Module`` holds itself (``_compiled_call_impl`` is ``None``): never a state of the model's.
_MODULE_OWN = frozenset(vars(nn.Module()))


class AttributeStates:
    """The tensor (and ``None``) attributes of ``modules``, per microbatch of a pass (see [Note: attribute states
    per microbatch])."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self._batch_size = 0
        self._noted: dict[_Key, Optional[Tensor]] = {}
        self._kept: dict[tuple[int, int], dict[_Key, Optional[Tensor]]] = {}  # rows -> values
        self._current: Optional[tuple[int, int]] = None  # the rows whose values are in the modules now

    def begin(self, batch_size: int) -> None:
        self._batch_size = batch_size
        self._noted = dict(self._held())
        self._kept = {}
        self._current = None

    def rows(self, start: int, stop: int, probing: Optional[str] = None) -> None:
        """Put in the values of the rows ``start:stop`` before a stage run of them (``probing``: a shape probe's
        copies)."""
        self._keep_current()
        values = self._kept.get((start, stop))
        if values is None:
            values = {key: self._rows_of(value, start, stop) for key, value in self._noted.items()}
        if probing:
            values = {key: _probe_copy(value, probing) for key, value in values.items()}
        else:
            self._current = (start, stop)
        self._put(values)

    def end(self) -> None:
        """Each attribute holds the whole batch's value again."""
        self._keep_current()
        if not self._kept:
            self._put(self._noted)
            return
        ordered = sorted(self._kept)
        keys = {key for values in self._kept.values() for key in values}
        whole = {}
        for key in keys:
            parts = [self._kept[rows].get(key) for rows in ordered]
            whole[key] = _joined(parts, [stop - start for start, stop in ordered])
        self._put({**self._noted, **whole})
        self._kept = {}

    def _keep_current(self) -> None:
        if self._current is not None:
            self._kept[self._current] = dict(self._held())
            self._current = None

    def _held(self) -> list[tuple[_Key, Optional[Tensor]]]:
        found = []
        for index, module in enumerate(self.modules):
            for name, value in vars(module).items():
                if name in _MODULE_OWN:
                    continue
                if value is None or (isinstance(value, Tensor) and not isinstance(value, (nn.Parameter, Ghost))):
                    found.append(((index, name), value))
        return found

    def _rows_of(self, value: Optional[Tensor], start: int, stop: int) -> Optional[Tensor]:
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self._batch_size:
            return value[start:stop]
        return value

    def _put(self, values: dict[_Key, Optional[Tensor]]) -> None:
        for (index, name), value in values.items():
            vars(self.modules[index])[name] = value


def _probe_copy(value: Optional[Tensor], probing: str) -> Optional[Tensor]:
    if not isinstance(value, Tensor):
        return value
    return ghost_of(value) if probing == "ghost" else value.clone()


def _joined(parts: list[Optional[Tensor]], sizes: list[int]) -> Optional[Tensor]:
    """The whole batch's value of an attribute from its microbatches' ``parts`` (of ``sizes`` rows)."""
    if all(isinstance(p, Tensor) and p.dim() > 0 and p.shape[0] == n for p, n in zip(parts, sizes)) and len(
        {(tuple(p.shape[1:]), p.dtype) for p in parts}
    ) == 1 and not any(isinstance(p, Ghost) for p in parts):
        return torch.cat(parts)
    return parts[-1]
