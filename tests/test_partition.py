"""Stage partitioning is pure: no processes needed."""

import pytest

from lightning_pipe.partition import make_layout, split_sizes


def test_uniform_gives_remainder_to_first_stages():
    assert split_sizes([1] * 7, 2) == [4, 3]
    assert split_sizes([1] * 10, 4) == [3, 3, 2, 2]
    assert split_sizes([1] * 4, 4) == [1, 1, 1, 1]


def test_parameters_minimises_the_largest_stage():
    # a heavy head: the head alone should form the last stage
    costs = [10, 10, 10, 10, 10, 50]
    sizes = split_sizes(costs, 2, "parameters")
    assert sizes == [5, 1]
    assert split_sizes([5, 1, 1, 1, 1, 5], 3, "parameters") == [1, 4, 1]


def test_parameters_is_optimal_against_brute_force():
    import itertools

    costs = [3, 7, 2, 8, 1, 9, 4, 6]
    for stages in range(1, 6):
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        sizes = split_sizes(costs, stages, "parameters")
        bounds, start = [], 0
        for s in sizes:
            bounds.append(sum(costs[start : start + s]))
            start += s
        assert max(bounds) == best and all(s > 0 for s in sizes)


def test_explicit_balance_is_validated():
    assert split_sizes([1] * 7, 2, [2, 5]) == [2, 5]
    with pytest.raises(ValueError, match="gives 3 stages but the pipeline has 2"):
        split_sizes([1] * 7, 2, [2, 2, 3])
    with pytest.raises(ValueError, match="add up to the 7 backbone modules"):
        split_sizes([1] * 7, 2, [2, 4])
    with pytest.raises(ValueError, match="Unknown `balance='time2'`"):
        split_sizes([1] * 7, 2, "time2")


def test_more_stages_than_modules_names_the_fix():
    with pytest.raises(ValueError, match="cannot be split into 4 non-empty stages.*pipeline_parallel_size"):
        split_sizes([1] * 3, 4)


def test_loop_placement_puts_stage_i_on_rank_i_mod_pp():
    layout = make_layout([1] * 8, pipeline_size=2, stages_per_rank=2)
    assert [layout.stage_rank(s) for s in range(4)] == [0, 1, 0, 1]
    assert layout.rank_stages(0) == [0, 2] and layout.rank_stages(1) == [1, 3]
    assert layout.rank_modules(1) == [2, 3, 6, 7]


def test_v_placement_zigzags():
    layout = make_layout([1] * 8, pipeline_size=2, stages_per_rank=2, style="v")
    assert [layout.stage_rank(s) for s in range(4)] == [0, 1, 1, 0]
    layout = make_layout([1] * 8, pipeline_size=4, stages_per_rank=2, style="v")
    assert [layout.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_every_module_is_on_exactly_one_rank():
    for pp, spr, style in [(2, 1, "loop"), (4, 2, "loop"), (3, 2, "v")]:
        layout = make_layout(list(range(1, 14)), pp, spr, "parameters", style)
        held = sorted(i for r in range(pp) for i in layout.rank_modules(r))
        assert held == list(range(13))


def test_resolve_sizes_fills_in_auto_and_names_the_mismatch():
    from lightning_pipe.partition import resolve_sizes

    assert resolve_sizes("auto", "auto", 4) == (4, 1)
    assert resolve_sizes(2, "auto", 8) == (2, 4)
    assert resolve_sizes("auto", 2, 8) == (4, 2)
    with pytest.raises(ValueError, match=r"needs 3 \* 1 = 3 processes, but the Trainer runs 4"):
        resolve_sizes(3, "auto", 4)
