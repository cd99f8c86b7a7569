"""The backbone's blocks as the setup and every run of the step see them: :class:`Block` and :class:`Backbone`, whose
containers' module tables a run swaps for its runners (:mod:`lightning_pipe._calls.runners`). Finding them is the
setup's (:mod:`lightning_pipe._model.backbone`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Block:
    """One block of the backbone.

    Attributes:
        index: its position in the whole backbone (over all containers).
        container: which of the backbone's containers holds it.
        key: its key in that container (``"3"``).
        name: its dotted path in the LightningModule (``"model.layers.3"``).
    """

    index: int
    container: int
    key: str
    name: str


@dataclass(frozen=True)
class Backbone:
    """The containers of blocks a pipeline splits, in the order they run."""

    paths: tuple[str, ...]
    containers: tuple[nn.Module, ...]
    blocks: tuple[Block, ...]

    def __len__(self) -> int:
        return len(self.blocks)

    def module(self, index: int) -> nn.Module:
        """Block ``index`` as the container holds it now."""
        block = self.blocks[index]
        return self.containers[block.container]._modules[block.key]  # type: ignore[return-value]

    def tables_with(self, modules: Sequence[nn.Module]) -> list[dict[str, nn.Module]]:
        """Per container, a table of its modules with block ``i`` replaced by ``modules[i]``: put in as a whole with
        :meth:`swap_tables` (one assignment per container instead of one per block)."""
        tables: list[dict[str, nn.Module]] = [dict(c._modules) for c in self.containers]  # type: ignore[misc]
        for block, module in zip(self.blocks, modules):
            tables[block.container][block.key] = module
        return tables

    def swap_tables(self, tables: Sequence[dict[str, nn.Module]]) -> list[dict[str, nn.Module]]:
        """Make ``tables`` the containers' module tables; returns the tables they held."""
        held = []
        for container, table in zip(self.containers, tables):
            held.append(vars(container)["_modules"])
            vars(container)["_modules"] = table
        return held

    def describe(self) -> str:
        return ", ".join(f"`{p}` ({len(c)} blocks)" for p, c in zip(self.paths, self.containers))
