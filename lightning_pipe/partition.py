"""Pure stage partitioning: how many backbone modules each stage gets and which stages a rank runs.

Nothing here touches ``torch.distributed``; every function is deterministic, so every rank computes
the same layout without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["BALANCE_MODES", "StageLayout", "make_layout", "resolve_sizes", "split_sizes"]

BalanceSpec = Union[str, Sequence[int]]

BALANCE_MODES = ("uniform", "parameters", "time")
#: a degree or count the user gives, or ``"auto"``
Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class StageLayout:
    """Where each backbone module lives.

    Attributes:
        bounds: ``bounds[s]`` is the half-open range ``(start, stop)`` of backbone indices in stage ``s``.
        pipeline_size: processes in one pipeline.
        style: ``"loop"`` (stage ``s`` on pipeline rank ``s % pipeline_size``) or ``"v"`` (zig-zag, as the
            ZBV and DualPipeV schedules require).
    """

    bounds: tuple[tuple[int, int], ...]
    pipeline_size: int
    style: str = "loop"

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline_size

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        virtual, offset = divmod(stage, self.pipeline_size)
        if self.style == "v" and virtual % 2 == 1:
            return self.pipeline_size - 1 - offset
        return offset

    def stage_of_block(self, index: int) -> int:
        """The stage that holds backbone module ``index``."""
        for stage, (start, stop) in enumerate(self.bounds):
            if start <= index < stop:
                return stage
        raise IndexError(f"Module {index} is outside the {self.bounds[-1][1]} modules of this layout.")

    def rank_stages(self, pipeline_rank: int) -> list[int]:
        """The stages that ``pipeline_rank`` runs, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pipeline_rank]

    def rank_modules(self, pipeline_rank: int) -> list[int]:
        """Backbone indices held by ``pipeline_rank``."""
        return [i for s in self.rank_stages(pipeline_rank) for i in range(*self.bounds[s])]

    def describe(self) -> str:
        parts = [f"stage {s} (rank {self.stage_rank(s)}): modules {a}..{b - 1}" for s, (a, b) in enumerate(self.bounds)]
        return "; ".join(parts)


def split_sizes(module_costs: Sequence[int], num_stages: int, balance: BalanceSpec = "uniform") -> list[int]:
    """Split ``len(module_costs)`` consecutive modules into ``num_stages`` contiguous, non-empty stages.

    Args:
        module_costs: a cost per module, used by ``balance="parameters"`` (e.g. parameter counts).
        num_stages: how many stages to make.
        balance: ``"uniform"`` gives each stage the same number of modules (the first stages take one
            extra when it does not divide); ``"parameters"`` and ``"time"`` minimise the largest stage cost
            (the costs being parameter counts or measured times); a list gives the number of modules per stage.

    Returns:
        The number of modules in each stage.
    """
    num_modules = len(module_costs)
    if num_stages < 1:
        raise ValueError(f"The number of stages must be at least 1, got {num_stages}.")
    if num_modules < num_stages:
        raise ValueError(
            f"The backbone has {num_modules} modules, which cannot be split into {num_stages} non-empty stages."
            f" Lower `pipeline_parallel_size` or `stages_per_rank` so that pipeline_parallel_size * stages_per_rank"
            f" <= {num_modules}, or give the backbone more modules."
        )
    if isinstance(balance, str):
        if balance == "uniform":
            base, extra = divmod(num_modules, num_stages)
            return [base + (1 if s < extra else 0) for s in range(num_stages)]
        if balance in ("parameters", "time"):
            return _min_max_partition(list(module_costs), num_stages)
        raise ValueError(
            f"Unknown `balance={balance!r}`. Use one of {list(BALANCE_MODES)} or a list of module counts per stage."
        )
    sizes = [int(n) for n in balance]
    if len(sizes) != num_stages:
        raise ValueError(
            f"`balance={sizes}` gives {len(sizes)} stages but the pipeline has {num_stages}"
            f" (pipeline_parallel_size * stages_per_rank). Give exactly {num_stages} module counts."
        )
    if any(n < 1 for n in sizes) or sum(sizes) != num_modules:
        raise ValueError(
            f"`balance={sizes}` must hold positive counts that add up to the {num_modules} backbone modules"
            f" (they add up to {sum(sizes)})."
        )
    return sizes


def _min_max_partition(costs: list[float], num_stages: int) -> list[int]:
    """Contiguous partition minimising the largest part's cost; ties go to the earliest cut points."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-part cost splitting the first i modules into k parts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def make_layout(
    module_costs: Sequence[int],
    pipeline_size: int,
    stages_per_rank: int = 1,
    balance: BalanceSpec = "uniform",
    style: str = "loop",
) -> StageLayout:
    """Build the :class:`StageLayout` for a backbone whose modules cost ``module_costs``."""
    if style not in ("loop", "v"):
        raise ValueError(f"Unknown stage placement style {style!r}; expected 'loop' or 'v'.")
    sizes = split_sizes(module_costs, pipeline_size * stages_per_rank, balance)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return StageLayout(tuple(bounds), pipeline_size, style)


def resolve_sizes(pp: Size, dp: Size, world_size: int) -> tuple[int, int]:
    """``(pipeline_parallel_size, data_parallel_size)`` for ``world_size`` processes, either given as ``"auto"``."""
    given_pp, given_dp = pp, dp
    if pp == "auto":
        pp = world_size if dp == "auto" else max(world_size // dp, 1)
    if dp == "auto":
        dp = max(world_size // pp, 1)
    if pp * dp != world_size:
        raise ValueError(
            f"`PipelineStrategy(pipeline_parallel_size={given_pp!r}, data_parallel_size={given_dp!r})` needs"
            f" {pp} * {dp} = {pp * dp} processes, but the Trainer runs {world_size} (devices * num_nodes)."
            " Make pipeline_parallel_size * data_parallel_size equal the number of processes, or leave one of them"
            " 'auto' and use a process count it divides."
        )
    return pp, dp
