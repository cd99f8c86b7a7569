"""The planner: a pure cost model and search (no processes), plus one run of its command line."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from lightning_pipe.plan import (
    Plan,
    default_num_microbatches,
    format_bytes,
    microbatch_target,
    parse_bytes,
    plan_for_module,
    plan_pipeline,
    search_plans,
    tensor_parallel_sizes,
    valid_num_microbatches,
)
from lightning_pipe.plan._cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _best_max_stage(costs, stages):
    return min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )


def _stage_costs(costs, balance):
    out, start = [], 0
    for size in balance:
        out.append(sum(costs[start : start + size]))
        start += size
    return out


# ------------------------------------------------------------------ the split
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_split_minimises_the_slowest_stage_with_a_heavy_head(pp):
    costs = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0]  # embedding, blocks, a heavy head
    plan = plan_pipeline(costs, 48, pp, pipeline_parallel_size=pp, schedules=["1F1B"])
    assert sum(plan.balance) == len(costs) and all(n > 0 for n in plan.balance)
    assert max(_stage_costs(costs, plan.balance)) == _best_max_stage(costs, pp)
    assert list(plan.stage_costs) == _stage_costs(costs, plan.balance)
    uniform = [len(costs) // pp + (1 if s < len(costs) % pp else 0) for s in range(pp)]
    assert max(_stage_costs(costs, plan.balance)) < max(_stage_costs(costs, uniform))
    if pp >= 3:
        assert plan.balance[-1] == 1  # the head gets a stage of its own


def test_interleaved_split_has_two_stages_per_rank_and_is_optimal():
    costs = [3.0, 7.0, 2.0, 8.0, 1.0, 9.0, 4.0, 6.0, 5.0]
    plan = plan_pipeline(costs, 8, 2, pipeline_parallel_size=2, schedules=["Interleaved1F1B"])
    assert plan.stages_per_rank == 2 and len(plan.balance) == 4
    assert max(_stage_costs(costs, plan.balance)) == _best_max_stage(costs, 4)


def test_interleaved_needs_enough_modules():
    # 3 modules cannot make 2 stages on each of 2 processes: only the single-stage schedules remain
    plans = search_plans([1.0, 1.0, 1.0], 16, 2, pipeline_parallel_size=2)
    assert {p.schedule for p in plans} == {"1F1B", "GPipe"}


# ------------------------------------------------------------------ time and bubble
def test_bubble_and_step_time_formulas():
    costs = [1.0] * 8
    plan = plan_pipeline(costs, 64, 4, pipeline_parallel_size=4, schedules=["1F1B"], microbatch_overhead=0.0)
    m, p = plan.num_microbatches, 4
    assert plan.predicted_bubble == pytest.approx((p - 1) / (m + p - 1))
    # no overhead: more microbatches always shrink the bubble, so the largest count wins
    assert m == 64
    assert plan.predicted_step_time == pytest.approx((m + p - 1) * 2.0 * 64 / m)
    assert plan.ideal_step_time == pytest.approx(8 * 64 / 4)

    plans = search_plans(costs, 64, 4, pipeline_parallel_size=4, microbatch_overhead=0.0)
    by_key = {(q.schedule, q.num_microbatches): q for q in plans}
    inter = by_key[("Interleaved1F1B", 8)]
    assert inter.predicted_bubble == pytest.approx(3 / (2 * 8 + 3))  # (p-1)/(v*m + p-1)
    assert inter.predicted_step_time == pytest.approx((2 * 8 + 3) * 1.0 * 64 / 8)
    assert by_key[("1F1B", 16)].predicted_bubble == pytest.approx(by_key[("Interleaved1F1B", 8)].predicted_bubble)


def test_overhead_keeps_microbatch_count_moderate():
    plan = plan_pipeline([1.0] * 8, 256, 4, pipeline_parallel_size=4, schedules=["1F1B"])
    # default overhead 1% of the ideal step: optimum near sqrt((p-1)/0.01) ~ 17
    assert 8 <= plan.num_microbatches <= 32
    assert plan.predicted_bubble < 0.2


def test_pure_data_parallel_wins_without_a_memory_limit():
    plan = plan_pipeline([1.0] * 8, 64, 8, param_bytes=[1e6] * 8)
    assert (plan.pipeline_parallel_size, plan.data_parallel_size, plan.num_microbatches) == (1, 8, 1)
    assert plan.predicted_bubble == 0


def test_plans_respect_torch_schedule_constraints():
    for plan in search_plans([1.0] * 12, 96, 8):
        p, m = plan.pipeline_parallel_size, plan.num_microbatches
        assert plan.batch_size_per_replica % m == 0
        assert plan.devices == 8
        if plan.schedule == "1F1B":
            assert m >= p
        if plan.schedule == "Interleaved1F1B":
            assert m % max(1, m // p) == 0 and p > 1


def test_fixed_pipeline_size_must_divide_devices():
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        search_plans([1.0] * 8, 64, 8, pipeline_parallel_size=3)
    assert {p.pipeline_parallel_size for p in search_plans([1.0] * 8, 64, 8, pipeline_parallel_size=2)} == {2}


def test_no_valid_plan_explains_why():
    with pytest.raises(ValueError, match="does not split over"):
        search_plans([1.0] * 2, 3, 4, pipeline_parallel_size=1)


# ------------------------------------------------------------------ memory
def test_memory_bound_chooses_a_larger_pipeline():
    costs, weights, acts = [1.0] * 8, [1e9] * 8, [1e6] * 8
    chosen = []
    for budget in (None, 20e9, 9e9, 5e9):
        plan = plan_pipeline(costs, 32, 8, param_bytes=weights, activation_bytes=acts, memory_budget=budget)
        assert budget is None or plan.predicted_memory_per_device <= budget
        chosen.append(plan.pipeline_parallel_size)
    assert chosen == [1, 2, 4, 8]


def test_memory_counts_optimizer_state_and_in_flight_activations():
    weights, acts = [100.0] * 4, [10.0] * 4
    plans = search_plans([1.0] * 4, 16, 2, param_bytes=weights, activation_bytes=acts, pipeline_parallel_size=2)
    by_key = {(q.schedule, q.num_microbatches): q for q in plans}
    one_f_one_b, gpipe = by_key[("1F1B", 8)], by_key[("GPipe", 8)]
    # stage 0: 2 modules -> 200 bytes x (1 + 3); 1F1B keeps p=2 microbatches of 2 samples, GPipe all 8
    assert one_f_one_b.state_memory == 800
    assert one_f_one_b.activation_memory == 2 * 20 * 2
    assert gpipe.activation_memory == 8 * 20 * 2
    assert one_f_one_b.predicted_memory_per_device == 880
    sgd = plan_pipeline(
        [1.0] * 4, 16, 2, param_bytes=weights, pipeline_parallel_size=2, schedules=["1F1B"], optimizer_multiplier=1
    )
    assert sgd.predicted_memory_per_device == 400
    # Interleaved keeps more chunks in flight than 1F1B on the first process
    inter = by_key[("Interleaved1F1B", 8)]
    assert inter.activation_memory > one_f_one_b.activation_memory


def test_infeasible_budget_raises_with_the_smallest_need():
    weights = [1e9] * 8  # 8 GB of weights; Adam: x4; on 8 devices at best one module each: 4e9 bytes
    with pytest.raises(ValueError, match="4000000000 bytes") as info:
        plan_pipeline([1.0] * 8, 64, 8, param_bytes=weights, memory_budget=3e9)
    assert "3000000000 bytes" in str(info.value) and "pipeline 8" in str(info.value)


def test_budget_without_bytes_is_an_error():
    with pytest.raises(ValueError, match="memory_budget"):
        search_plans([1.0] * 4, 8, 2, memory_budget=1e9)


def test_parse_and_format_bytes():
    assert parse_bytes("16GiB") == 16 * 1024**3
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * 1024**2
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError, match="16GiB"):
        parse_bytes("lots")
    assert format_bytes(16 * 1024**3) == "16.00 GiB"
    assert format_bytes(10) == "10 B"


# ------------------------------------------------------------------ tensor parallelism
def test_without_devices_per_node_there_is_no_tensor_parallelism():
    assert tensor_parallel_sizes(8, None) == [1]
    costs, weights, acts = [1.0] * 8, [1e9] * 8, [1e6] * 8
    for budget in (None, 9e9, 5e9):
        plans = search_plans(costs, 32, 8, param_bytes=weights, activation_bytes=acts, memory_budget=budget)
        assert {p.tensor_parallel_size for p in plans} == {1}
    # with room to spare, tensor parallelism is only slower (its communication) than data parallelism
    plan = plan_pipeline(costs, 32, 8, param_bytes=weights, activation_bytes=acts, devices_per_node=8)
    assert (plan.pipeline_parallel_size, plan.data_parallel_size, plan.tensor_parallel_size) == (1, 8, 1)


def test_tensor_parallelism_fits_blocks_too_large_for_a_stage():
    # 4 blocks of 1 GB; Adam: 4 GB each, over a 3 GB budget even with a block per stage
    costs, weights, acts = [1.0] * 4, [1e9] * 4, [1e6] * 4
    kwargs = dict(param_bytes=weights, activation_bytes=acts, memory_budget=3e9)
    with pytest.raises(ValueError, match="devices_per_node"):
        plan_pipeline(costs, 32, 8, **kwargs)
    plan = plan_pipeline(costs, 32, 8, devices_per_node=8, schedules=["1F1B"], **kwargs)
    t, p = plan.tensor_parallel_size, plan.pipeline_parallel_size
    assert t > 1 and plan.fits and plan.predicted_memory_per_device <= 3e9
    assert p * plan.data_parallel_size * t == plan.devices == 8
    # under 1F1B, pipeline 4 x tensor 2 beats pipeline 2 x tensor 4 (which also fits): a smaller share of
    # communication
    assert (p, t, plan.schedule) == (4, 2, "1F1B")
    # each process holds 1/t of its stage's weights (and their gradients and Adam moments); activations are whole
    assert plan.state_memory == pytest.approx(max(_stage_costs(weights, plan.balance)) / t * 4)
    b, m = plan.batch_size_per_replica, plan.num_microbatches
    assert plan.activation_memory == pytest.approx(min(m, p) * _stage_costs(acts, plan.balance)[0] * b / m)
    # 1/t of the compute, plus 10% of it times (t-1)/t for the all-reduces
    scale = (1 + 0.1 * (t - 1)) / t
    assert list(plan.stage_costs) == pytest.approx([c * scale for c in _stage_costs(costs, plan.balance)])
    overhead = 0.01 * plan.ideal_step_time
    assert plan.predicted_step_time == pytest.approx((m + p - 1) * (max(plan.stage_costs) * b / m + overhead))
    assert plan.ideal_step_time == pytest.approx(4 * 32 / 8)


def test_sequence_parallelism_divides_the_activations_a_tensor_rank_keeps():
    costs, weights, acts = [1.0] * 4, [1e6] * 4, [1e6] * 4
    kwargs = dict(param_bytes=weights, activation_bytes=acts, devices_per_node=8)
    whole = {(q.pipeline_parallel_size, q.tensor_parallel_size, q.schedule, q.num_microbatches): q
             for q in search_plans(costs, 32, 8, **kwargs)}
    sharded = {(q.pipeline_parallel_size, q.tensor_parallel_size, q.schedule, q.num_microbatches): q
               for q in search_plans(costs, 32, 8, sequence_parallel=True, **kwargs)}
    for key, plan in whole.items():
        t = key[1]
        assert sharded[key].activation_memory == pytest.approx(plan.activation_memory / t)
        assert sharded[key].state_memory == pytest.approx(plan.state_memory)
        assert sharded[key].predicted_step_time == pytest.approx(plan.predicted_step_time)


def test_tensor_parallel_overhead_is_a_parameter():
    plans = search_plans([1.0] * 8, 64, 8, devices_per_node=8, microbatch_overhead=0.0, tensor_parallel_overhead=0.5)
    by_key = {(q.pipeline_parallel_size, q.tensor_parallel_size, q.schedule, q.num_microbatches): q for q in plans}
    plan = by_key[(2, 4, "1F1B", 16)]
    assert plan.data_parallel_size == 1 and plan.stage_costs == pytest.approx((4 * 2.5 / 4,) * 2)
    assert plan.predicted_step_time == pytest.approx((16 + 1) * 2.5 * 64 / 16)
    with pytest.raises(ValueError, match="tensor_parallel_overhead"):
        search_plans([1.0] * 8, 64, 8, devices_per_node=8, tensor_parallel_overhead=-1)


@pytest.mark.parametrize(
    "devices, per_node, limit, divisor, expected",
    [
        (16, 8, 8, None, [1, 2, 4, 8]),
        (16, 8, 4, None, [1, 2, 4]),  # max_tensor_parallel
        (16, 4, 8, 6, [1, 2]),  # the divisor (e.g. 6 attention heads) rules out 4
        (12, 6, 8, None, [1, 2]),  # powers of two that divide the node
        (4, 8, 8, None, [1, 2, 4]),  # and the device count
        (8, 8, 8, 1, [1]),
    ],
)
def test_tensor_parallel_sizes(devices, per_node, limit, divisor, expected):
    assert tensor_parallel_sizes(devices, per_node, limit, divisor) == expected


def test_tensor_parallel_size_stays_in_the_node_and_divides_the_heads():
    weights, acts = [1e9] * 8, [1e6] * 8
    cases = [(16, 4, None, None), (16, 8, 6, 4e9), (16, 8, 12, 3e9), (24, 8, 4, None)]
    for devices, per_node, divisor, budget in cases:
        plans = search_plans(
            [1.0] * 8,
            48,
            devices,
            param_bytes=weights,
            activation_bytes=acts,
            memory_budget=budget,
            devices_per_node=per_node,
            tensor_divisor=divisor,
        )
        sizes = {q.tensor_parallel_size for q in plans}
        if budget is None:
            assert sizes == set(tensor_parallel_sizes(devices, per_node, 8, divisor))
        else:
            assert 1 not in sizes  # a block per stage does not fit: only tensor parallelism does
        for q in plans:
            t = q.tensor_parallel_size
            assert t <= per_node and per_node % t == 0 and (divisor is None or divisor % t == 0)
            assert q.pipeline_parallel_size * q.data_parallel_size * t == devices
    with pytest.raises(ValueError, match="devices_per_node"):
        search_plans([1.0] * 8, 48, 8, devices_per_node=0)
    with pytest.raises(ValueError, match="tensor_divisor"):
        search_plans([1.0] * 8, 48, 8, devices_per_node=8, tensor_divisor=0)


def test_strategy_arguments_name_tensor_parallel_size_only_when_used():
    fields = dict(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        num_microbatches=8,
        schedule="1F1B",
        stages_per_rank=1,
        balance=(2, 2),
        predicted_bubble=1 / 9,
        predicted_step_time=9.0,
        predicted_memory_per_device=None,
        global_batch_size=16,
        ideal_step_time=8.0,
        stage_costs=(2.0, 2.0),
    )
    plain, tensor = Plan(**fields), Plan(**fields, tensor_parallel_size=2)
    assert plain.tensor_parallel_size == 1 and plain.devices == 4 and tensor.devices == 8
    assert "tensor_parallel_size" not in plain.strategy_kwargs()
    assert "tensor" not in plain.strategy_line() + plain.yaml_snippet() + plain.describe()
    names = ["pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size"]
    assert list(tensor.strategy_kwargs())[:3] == names
    assert tensor.strategy_kwargs()["tensor_parallel_size"] == 2
    assert "data_parallel_size=2, tensor_parallel_size=2, num_microbatches=8" in tensor.strategy_line()
    assert "      tensor_parallel_size: 2\n" in tensor.yaml_snippet()
    assert tensor.describe().startswith("pipeline 2 x data-parallel 2 x tensor-parallel 2 (8 devices)")
    assert tensor.batch_size_per_replica == plain.batch_size_per_replica == 8


# ------------------------------------------------------------------ num_microbatches="auto"
@pytest.mark.parametrize(
    "batch, pp, spr, expected",
    [
        (64, 4, 1, 16),  # 4p divides the batch: bubble 3/19 = 16%
        (8, 4, 1, 8),  # batch below 4p: the largest accepted divisor, one sample per microbatch
        (12, 4, 1, 12),  # smallest divisor >= 16 does not exist -> largest accepted (12)
        (48, 4, 1, 16),
        (40, 4, 1, 20),  # 16 does not divide 40: the next divisor above it
        (6, 4, 1, 6),
        (64, 4, 2, 8),  # two stages per rank: 2p
        (10, 4, 2, 10),  # interleaved: 10 microbatches in 2 rounds of 5
        (7, 1, 1, 1),  # a pipeline of one: nothing to overlap
        (64, 1, 2, 1),
        (32, 8, 1, 32),
    ],
)
def test_default_num_microbatches(batch, pp, spr, expected):
    m = default_num_microbatches(batch, pp, spr)
    assert m == expected
    assert batch % m == 0 and valid_num_microbatches(m, pp, spr)


def test_default_num_microbatches_bubble_under_20_percent_when_the_batch_allows():
    for pp in (2, 3, 4, 8):
        for spr in (1, 2):
            m = default_num_microbatches(1024 * 3, pp, spr)
            assert m >= microbatch_target(pp, spr)
            assert (pp - 1) / (spr * m + pp - 1) < 0.2


def test_default_num_microbatches_schedule_constraints():
    assert default_num_microbatches(8, 1, 2, "DualPipeV") == 2  # one microbatch per stage at least
    assert default_num_microbatches(6, 4, 1, "GPipe") == 6
    # interleaved rounds rule: 9 -> 2 rounds of 4.5 is refused, 3 (1 round) is taken
    assert default_num_microbatches(9, 4, 2, "Interleaved1F1B") == 3
    with pytest.raises(ValueError, match="at least 4"):
        default_num_microbatches(3, 4, 1)
    with pytest.raises(ValueError, match="positive integer"):
        default_num_microbatches(0, 4, 1)


# ------------------------------------------------------------------ modules and the command line
def test_plan_for_module_on_the_meta_device():
    import torch
    from models import TinyLM

    with torch.device("meta"):
        model = TinyLM(blocks=4)
    example = torch.zeros(2, 8, dtype=torch.long)
    plan = plan_for_module(model, 32, 4, pipeline_parallel_size=4, example_input=example)
    assert isinstance(plan, Plan) and plan.pipeline_parallel_size == 4
    assert sum(plan.balance) == len(model.backbone)
    assert plan.activation_memory > 0 and plan.state_memory > 0
    total = sum(p.numel() * 4 for p in model.parameters())
    assert plan.state_memory < total * 4  # a stage holds part of the model
    budget_plan = plan_for_module(model, 32, 4, costs=[1.0] * len(model.backbone), activation_bytes=None)
    assert budget_plan.activation_memory is None and budget_plan.state_memory > 0
    with pytest.raises(ValueError, match="entries"):
        plan_for_module(model, 32, 4, costs=[1.0])


def _write_config(tmp_path, **trainer):
    trainer_lines = "".join(f"\n  {k}: {v}" for k, v in trainer.items())
    path = tmp_path / "cfg.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            model:
              class_path: models.TinyLM
              init_args:
                blocks: 6
            data:
              class_path: models.TokenData
              init_args:
                batch_size: 16
            trainer:"""
        )
        + (trainer_lines or " {}")
        + "\n"
    )
    return str(path)


@pytest.mark.dist
def test_cli_in_process(tmp_path, capsys):
    config = _write_config(tmp_path, devices=4, strategy="pipeline")
    assert (
        main(["--config", config, "--input-shape", "8", "--input-dtype", "long", "--pipeline-parallel-size", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert "global batch 16" in out and "Recommended" in out
    assert "PipelineStrategy(pipeline_parallel_size=4, data_parallel_size=1" in out
    assert "class_path: lightning_pipe.PipelineStrategy" in out

    assert main(["--config", config, "--devices", "8", "--memory-budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "No plan fits the memory budget" in err and "1024 bytes" in err

    # 100 KiB needs tensor parallelism: the table gets a `tp` column and the strategy line its size
    small = ["--config", config, "--input-shape", "8", "--input-dtype", "long", "--memory-budget", "100KiB"]
    assert main(small) == 2
    assert "No plan fits" in capsys.readouterr().err
    assert main([*small, "--max-tensor-parallel", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[3].split()[:3] == ["pp", "dp", "tp"]
    assert "tensor_parallel_size=" in out and "      tensor_parallel_size: " in out

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "--memory-budget" in capsys.readouterr().out


def test_cli_measures_the_modules_here(tmp_path, capsys):
    """``--measure`` times each block's forward, input and weight gradient on this machine (random weights) and plans
    in seconds, with every schedule (the zero-bubble ones among them)."""
    config = _write_config(tmp_path, devices=4, strategy="pipeline")
    assert main(["--config", config, "--measure"]) == 2
    assert "--measure needs --input-shape" in capsys.readouterr().err
    code = main(["--config", config, "--input-shape", "8", "--input-dtype", "long", "--measure", "--top", "20"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "costs: measured here, seconds" in out and "ideal/time" in out
    schedules = {line.split()[2] for line in out.splitlines()[5:] if line[:1].isdigit()}
    assert {"1F1B", "ZBVZeroBubble", "InterleavedZeroBubble"} <= schedules, out


@pytest.mark.dist
def test_cli_subprocess_prints_a_plan(tmp_path):
    config = _write_config(tmp_path, devices=4, num_nodes=1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.plan", "--config", config, "--memory-budget", "200KiB", "--top", "4"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # no strategy in the config: Lightning's default (DDP) trains 4 replicas of 16
    assert "global batch 64" in out
    assert "rel. time" in out and "memory/device" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("PipelineStrategy("))
    assert "num_microbatches=" in line and "balance=[" in line


def test_nominal_target_is_accepted_by_every_schedule():
    from lightning_pipe.schedules import SCHEDULE_NAMES

    for schedule in SCHEDULE_NAMES:
        multi = schedule not in ("1F1B", "GPipe")
        for pp in (1, 2, 3, 4, 8):
            spr = 2 if multi else 1
            target = microbatch_target(pp, spr, schedule)
            assert valid_num_microbatches(target, pp, spr, schedule), (schedule, pp)
            assert default_num_microbatches(target * 6, pp, spr, schedule) == target
    assert microbatch_target(1, 2, "DualPipeV") == 2


@pytest.mark.dist
def test_cli_reads_the_replicas_of_the_config(tmp_path, capsys):
    strategy = "\n    class_path: lightning_pipe.PipelineStrategy\n    init_args:\n      data_parallel_size: 2"
    config = _write_config(tmp_path, devices=4, strategy=strategy)
    assert main(["--config", config, "--top", "2"]) == 0
    assert "global batch 32 (batch_size 16 x 2 replicas" in capsys.readouterr().out
    assert main(["--config", config, "--global-batch-size", "8", "--schedules", "1F1B"]) == 0
    out = capsys.readouterr().out
    assert "global batch 8 (given)" in out and "GPipe" not in out


# ------------------------------------------------------------------------------------------------ simulation
from lightning_pipe.plan import StageCosts, simulate  # noqa: E402
from lightning_pipe.schedules import textbook_bubble_fraction  # noqa: E402


@pytest.mark.parametrize(("schedule", "v"), [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)])
def test_simulating_torchs_order_gives_the_textbook_bubble(schedule, v):
    """Equal stages, free transfers: torch's own order of actions idles the textbook fraction, and the busiest
    rank computes m * (F + B + W) of its stages."""
    p, m = 4, 8
    stage = StageCosts(1.0, 1.0, 1.0)
    predicted = simulate(schedule, p, m, [stage] * (p * v))
    assert predicted.ideal == pytest.approx(v * m * 3.0)
    if schedule != "LoopedBFS":  # all forwards of a stage, then all backwards: more idling than interleaving
        assert predicted.bubble == pytest.approx(textbook_bubble_fraction(p, m, v))
    else:
        assert predicted.bubble >= textbook_bubble_fraction(p, m, v)


def test_zero_bubble_schedules_win_by_their_weight_gradients_only():
    """With weight-gradient time equal to forward time, the zero-bubble schedules fill the bubble with deferred
    weight gradients and predict the shortest step; with no weight-gradient time they cannot, and tie with
    Interleaved1F1B: the best choice changes with the costs."""
    p, m = 4, 8

    def steps(weight: float) -> dict[str, float]:
        stage = StageCosts(1.0, 1.0, weight)
        return {
            s: simulate(s, p, m, [stage] * (2 * p)).step_time
            for s in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
        }

    with_w, without = steps(1.0), steps(0.0)
    assert min(with_w, key=with_w.get) != "Interleaved1F1B"
    assert with_w["ZBVZeroBubble"] < 0.95 * with_w["Interleaved1F1B"]
    assert without["ZBVZeroBubble"] == pytest.approx(without["Interleaved1F1B"])


def test_the_slowest_stage_and_the_transfers_set_the_pace():
    p, m = 2, 8
    even = simulate("1F1B", p, m, [StageCosts(1.0, 1.0, 1.0)] * 2)
    slow_last = simulate("1F1B", p, m, [StageCosts(1.0, 1.0, 1.0), StageCosts(2.0, 2.0, 2.0)])
    assert slow_last.step_time == pytest.approx(m * 6.0 + 3.0)  # the slow stage runs back to back after the first F
    assert simulate("1F1B", p, m, [StageCosts(1.0, 1.0, 1.0)] * 2, transfer=0.5).step_time > even.step_time
    assert simulate("1F1B", p, m, [StageCosts(1.0, 1.0, 1.0)] * 2, overhead=0.1).step_time == pytest.approx(
        even.step_time + 0.1 * (m + 1) * 2
    )
