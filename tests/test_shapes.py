"""Batches padded to many distinct lengths: the pipeline keeps a bounded number of schedules, frees the ones it
evicts, counts what it built, and trains exactly as one process does."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import shapes_job
import torch
from helpers import merged_state, run_script
from torch.distributed.pipelining import stage as torch_stage

from lightning_pipe._step.shapes import ScheduleCache
from lightning_pipe._step.shapes import size_map as _size_map

#: torch 2.15's receive information allocates its buffer when a transfer is posted (``_RecvInfo.allocate_buffer``).
BUFFERS_PER_TRANSFER = hasattr(torch_stage._RecvInfo, "allocate_buffer")

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
ATOL = 1e-5


def lru_counts(keys: list[Any], bound: int) -> tuple[list[int], int, int]:
    """An independent model of the cache: schedules kept after each step, schedules built, schedules evicted."""
    kept: list[Any] = []
    kept_after, built, evicted = [], 0, 0
    for key in keys:
        if key in kept:
            kept.remove(key)
        else:
            built += 1
            if len(kept) == bound:
                kept.pop(0)
                evicted += 1
        kept.append(key)
        kept_after.append(len(kept))
    return kept_after, built, evicted


def test_many_lengths_keep_few_schedules_free_the_rest_and_train_exactly(tmp_path: Path) -> None:
    proc = run_script([str(HERE / "shapes_job.py"), str(tmp_path / "pipelined"), "2"], cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stdout[-8000:]
    got = [torch.load(tmp_path / "pipelined" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    shapes_job.run(tmp_path / "reference", devices=1)
    want = torch.load(tmp_path / "reference" / "rank0.pt", weights_only=False)

    bound = got[0]["max_kept"]
    distinct = len(set(shapes_job.LENGTHS))
    assert distinct > bound + 4, "the lengths must overflow the bound for the test to mean anything"
    kept_after, built, evicted = lru_counts(shapes_job.LENGTHS, bound)
    for rank, r in enumerate(got):
        watch = r["watch"]
        assert [step["kept"] for step in watch] == kept_after, f"rank {rank}: schedules kept per step"
        assert max(step["kept"] for step in watch) <= bound
        stats = watch[-1]["stats"]
        assert (stats["shapes"], stats["built"], stats["evicted"], stats["dropped"]) == (distinct, built, evicted, 0)
        for step in watch:  # the counters add up after every step
            s = step["stats"]
            assert s["built"] == s["kept"] + s["evicted"] + s["dropped"], (rank, s)
            assert s["kept"] == step["kept"]
        assert stats["probe_seconds"] > 0 and stats["construct_seconds"] > 0
        # Every evicted schedule was watched, and its stages and receive buffers were freed with the cyclic
        # collector off: a stage and, where stages allocate their receive buffers when the schedule is built (torch
        # 2.13 and 2.14; 2.15 allocates them per transfer), at least one buffer per schedule: not vacuous.
        assert watch[-1]["evicted_tracked"] == evicted
        assert all(step["alive_after_eviction"] == 0 for step in watch), f"rank {rank}: {watch}"
        assert min(watch[-1]["references_per_schedule"]) >= (2 if BUFFERS_PER_TRANSFER else 3)

    losses = want["losses"]
    assert len(losses) == len(shapes_job.LENGTHS)
    for rank, r in enumerate(got):
        worst = max(abs(a - b) for a, b in zip(r["losses"], losses))
        assert len(r["losses"]) == len(losses) and worst < ATOL, f"rank {rank}: losses differ by up to {worst:.1e}"
    merged = merged_state(got)
    assert set(merged) == set(want["state_dict"])
    worst = max((merged[k] - want["state_dict"][k]).abs().max().item() for k in merged)
    assert worst < ATOL, f"final parameters differ by up to {worst:.1e}"
    moved = max((want["state_dict"][k] - want["initial"][k]).abs().max().item() for k in merged)
    assert moved > 100 * ATOL, "the parameters barely moved: the comparison would prove nothing"


def test_cache_evicts_the_least_recently_used_and_frees_it() -> None:
    cache = ScheduleCache(max_kept=2)

    class Schedule:
        pass

    a, b, c = Schedule(), Schedule(), Schedule()
    gone = weakref.ref(b)
    assert cache.put("a", a, 0.5, 0.1) == [] and cache.put("b", b, 0.5, 0.1) == []
    assert cache.get("a") is a  # now the most recently used
    assert cache.put("c", c, 0.0, 0.1) == ["b"]
    del b
    assert gone() is None and cache.get("b") is None
    cache.drop(a)
    assert len(cache) == 1 and cache.get("c") is c
    s = cache.stats
    assert (s.shapes, s.built, s.evicted, s.dropped, s.kept) == (3, 3, 1, 1, 1)
    assert s.build_seconds == pytest.approx(1.3)
    with pytest.raises(ValueError, match="keeps no schedule"):
        ScheduleCache(max_kept=0)


def test_sizes_of_a_new_shape_map_one_to_one_or_not_at_all() -> None:
    def key(*shape: int, training: bool = True) -> tuple:
        return 2, ((shape, torch.int64), (shape, torch.int64)), training, False

    assert _size_map(key(2, 64), key(2, 63)) == {2: 2, 64: 63}
    assert _size_map(key(64, 64), key(64, 63)) is None  # 64 would become both 64 and 63
    assert _size_map(key(2, 64), key(2, 63, training=False)) is None
    assert _size_map(key(2, 64), key(2, 63, 1)) is None
