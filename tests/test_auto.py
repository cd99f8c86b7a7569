"""``PipelineStrategy(schedule="auto")`` ([Note: configuration by measurement]): the prediction, the choice, the table,
the stored choice, and one 4-process run on the costed model of ``benchmarks/costed.py`` that trains exactly as the
chosen schedule set explicitly."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe._model.profile import BlockCost
from lightning_pipe._step.auto import Candidate, Trial, predict
from lightning_pipe.partition import make_layout
from lightning_pipe.schedules import Config

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from helpers import run_script  # noqa: E402


def _predict(forward_ms: float, input_ms: float, weight_ms: float, *, batch: int = 32, measured_rows: int = 4,
             blocks: int = 8, num_microbatches="auto", max_memory=None, saved: int = 1000) -> list[Candidate]:
    """Candidates for ``blocks`` equal blocks on 4 processes; costs per microbatch of ``measured_rows`` rows."""
    cost = BlockCost(forward_ms / 1e3, input_ms / 1e3, weight_ms / 1e3, saved, measured_rows, batch)
    return predict(
        [cost] * blocks, [1000.0] * blocks, 4, batch,
        lambda v, style: make_layout([1.0] * blocks, 4, v, "uniform", style),
        num_microbatches=num_microbatches, stages_per_rank=2, fixed_count=False, max_memory=max_memory,
    )


def _by_schedule(candidates: list[Candidate]) -> dict[str, Candidate]:
    best: dict[str, Candidate] = {}
    for c in candidates:
        best.setdefault(c.config.schedule, c)
    return best


def test_the_choice_follows_the_weight_gradient_cost():
    """With the weight gradient three times the forward, the zero-bubble schedules lead by far; with none, they do not:
    the predicted best changes with the costs."""
    heavy = _by_schedule(_predict(8, 8, 24, batch=8, measured_rows=2, num_microbatches=4))
    assert next(iter(heavy)) == "InterleavedZeroBubble"
    assert heavy["Interleaved1F1B"].predicted > 1.15 * heavy["InterleavedZeroBubble"].predicted
    assert heavy["1F1B"].predicted > 1.4 * heavy["InterleavedZeroBubble"].predicted
    light = _by_schedule(_predict(8, 8, 0, batch=8, measured_rows=2, num_microbatches=4))
    assert next(iter(light)) in ("Interleaved1F1B", "LoopedBFS")
    assert light["InterleavedZeroBubble"].predicted < 1.05 * light["Interleaved1F1B"].predicted


def test_microbatch_counts_are_searched_and_scaled_by_rows():
    candidates = _predict(4, 4, 4)
    counts = {c.config.num_microbatches for c in candidates if c.config.schedule == "1F1B"}
    assert counts == {4, 8, 16, 32}  # the divisors of 32 that 1F1B accepts on 4 processes (at least 4)
    one = {c.config.num_microbatches: c for c in candidates if c.config.schedule == "1F1B"}
    # the same rows in total: fewer microbatches idle longer, more pay more per-action overhead
    assert one[4].idle > one[8].idle > one[16].idle
    assert one[8].predicted < one[4].predicted
    pinned = _predict(4, 4, 4, num_microbatches=8)
    assert {c.config.num_microbatches for c in pinned} == {8}
    ragged = _predict(4, 4, 4, batch=24, num_microbatches=16)  # runs as 12, the largest count below that divides 24
    assert {c.config.num_microbatches for c in ragged} == {16}
    with pytest.raises(ValueError, match="no schedule accepts a batch of 32 on 4 processes .* 2 blocks"):
        _predict(4, 4, 4, blocks=2)  # fewer blocks than stages


def test_memory_bound_drops_candidates_and_names_the_fix():
    everything = _predict(4, 4, 4, saved=10**6)
    bound = sorted({c.memory for c in everything})[-2]  # all but the largest
    kept = _predict(4, 4, 4, saved=10**6, max_memory=bound)
    assert kept and all(c.memory <= bound for c in kept) and len(kept) < len(everything)
    gpipe = {c.config.num_microbatches: c.memory for c in everything if c.config.schedule == "GPipe"}
    one_f_one_b = {c.config.num_microbatches: c.memory for c in everything if c.config.schedule == "1F1B"}
    assert gpipe[32] > one_f_one_b[32]  # GPipe holds every microbatch, 1F1B at most p of them
    with pytest.raises(ValueError, match="Raise `max_memory`"):
        _predict(4, 4, 4, saved=10**6, max_memory=1000)


def _run(trial: Trial, time_of: Callable[[Config], float]) -> list[Config]:
    """Step ``trial`` to its choice with each candidate taking ``time_of(config)``; the configurations run, in order."""
    seen = []
    while trial.running:
        while not trial.finished:
            config = trial.current()
            seen.append(config)
            trial.record(time_of(config), None)
        trial.settle(torch.device("cpu"))
    return seen


def test_trial_times_each_candidate_and_keeps_the_fastest():
    # (name, base, slope): predicted with 1 ms per action
    specs = (("InterleavedZeroBubble", 0.95, 50), ("ZBVZeroBubble", 1.0, 50), ("Interleaved1F1B", 1.15, 50),
             ("LoopedBFS", 1.25, 50), ("GPipe", 1.35, 50))
    candidates = [Candidate(Config(name, 2 if name != "GPipe" else 1, 4), base + slope * 1e-3, 0.1, 100, base=base,
                            slope=slope) for name, base, slope in specs]
    trial = Trial(candidates)
    assert [c.config.schedule for c in trial.timed] == ["InterleavedZeroBubble", "Interleaved1F1B", "LoopedBFS"]
    # measured disagrees with the prediction; refitted, nothing untimed of the placement is ahead
    times = {"InterleavedZeroBubble": 2.0, "Interleaved1F1B": 1.5, "LoopedBFS": 3.0}
    seen = [c.schedule for c in _run(trial, lambda c: times[c.schedule])]
    assert seen == ["InterleavedZeroBubble"] * 4 + ["Interleaved1F1B"] * 3 + ["LoopedBFS"] * 3  # 1 untimed first
    assert trial.chosen == Config("Interleaved1F1B", 2, 4)
    table = trial.table()
    assert re.search(r"\*\s+Interleaved1F1B\s+2\s+4\s+1200.0 ms\s+[\d.]+ ms\s+1500.0 ms", table), table
    assert re.search(r"ZBVZeroBubble .* not timed", table)


def test_the_timed_steps_refit_the_model_and_time_what_it_then_puts_ahead():
    """Four counts of one schedule: the prediction (1 ms per action) puts the many-microbatch ones first; the times
    show each action costs 20 ms, so the refitted model puts the fewest microbatches ahead, and it is timed."""
    specs = ((16, 0.60, 40), (8, 0.75, 20), (32, 0.50, 80), (4, 0.85, 10))  # (m, base, slope)
    candidates = sorted((Candidate(Config("Interleaved1F1B", 2, m), base + slope * 1e-3, 0.1, 100, base=base,
                                   slope=slope) for m, base, slope in specs), key=lambda c: c.predicted)
    trial = Trial(candidates)
    assert [c.config.num_microbatches for c in trial.timed] == [32, 16, 8]
    times = {m: base + slope * 0.02 for m, base, slope in specs}  # 20 ms per action
    seen = [c.num_microbatches for c in _run(trial, lambda c: times[c.num_microbatches])]
    assert seen == [32] * 4 + [16] * 3 + [8] * 3 + [4] * 3
    assert trial.overhead == pytest.approx(0.02)
    assert trial.chosen == Config("Interleaved1F1B", 2, 4)
    assert "refitted" in trial.table()


def test_stored_choice_is_checked():
    good = Config("ZBVZeroBubble", 2, 8)
    assert Config.from_record(good.record()) == good
    for bad in (None, [], {"schedule": "os.system", "stages_per_rank": 2, "num_microbatches": 8},
                {"schedule": "1F1B", "stages_per_rank": True, "num_microbatches": 8},
                {"schedule": "1F1B", "stages_per_rank": 1, "num_microbatches": -1}):
        assert Config.from_record(bad) is None


def test_arguments():
    assert PipelineStrategy(schedule="auto").schedule == "auto"
    assert PipelineStrategy(schedule="auto", max_memory="2GiB")._options.max_memory == 2 * 1024**3
    with pytest.raises(ValueError, match="max_memory=.*schedule='auto'"):
        PipelineStrategy(schedule="1F1B", max_memory="2GiB")


@pytest.fixture(scope="module")
def costed_run(tmp_path_factory):
    """One launch, three fits (see tests/auto_job.py): weight gradient three times the forward."""
    out = tmp_path_factory.mktemp("auto")
    proc = run_script([str(HERE / "auto_job.py"), str(out), "24"], cwd=out, timeout=420,
                      env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-8000:]
    results = {
        phase: [torch.load(out / f"{phase}_rank{r}.pt", weights_only=False) for r in range(4)]
        for phase in ("auto", "pinned", "resumed", "sharded", "sharded_pinned")
    }
    return results, proc.stdout


@pytest.mark.dist  # the shared launch of costed_run
def test_auto_picks_the_schedule_that_leads_and_logs_the_table(costed_run):
    results, log = costed_run
    chosen = {"schedule": "InterleavedZeroBubble", "stages_per_rank": 2, "num_microbatches": 4}
    assert all(r["chosen"] == chosen and r["schedule"] == "InterleavedZeroBubble" for r in results["auto"])
    after = log[log.index("PipelineStrategy(schedule='auto'): timed"):].split("\n")[1:]
    table = "\n".join(itertools.takewhile(lambda line: line.startswith(("*  ", "   ")), after))  # the pp4 run's
    rows = dict(re.findall(r"^\*?\s+(\w+)\s+\d\s+4\s+[\d.]+ ms\s+[\d.]+ ms\s+([\d.]+) ms", table, re.M))
    assert set(rows) == {"InterleavedZeroBubble", "Interleaved1F1B", "LoopedBFS"}, table
    assert float(rows["Interleaved1F1B"]) > 1.15 * float(rows["InterleavedZeroBubble"])
    assert "pass these to `PipelineStrategy` to pin it" in log
    assert re.search(r"ZBVZeroBubble\s+2\s+4\s+[\d.]+ ms\s+[\d.]+ ms\s+not timed", table)
    assert re.search(r"1F1B\s+1\s+4\s+[\d.]+ ms\s+[\d.]+ ms\s+not timed", table)
    assert "of the runtime's work per action" in log and "x the blocks' profiled times" in log


@pytest.mark.dist  # the shared launch of costed_run
def test_auto_trains_as_the_chosen_schedule_across_the_switch(costed_run):
    """The first 10 steps ran three schedules; losses, validation losses and weights equal the chosen schedule's from
    the start."""
    results, _ = costed_run
    for auto, pinned in zip(results["auto"], results["pinned"]):
        assert len(auto["losses"]) == 12
        torch.testing.assert_close(torch.tensor(auto["losses"]), torch.tensor(pinned["losses"]), atol=1e-5, rtol=0)
        assert len(auto["val"]) == 3  # after steps 4 and 8, during the trial, and 12, after the choice (step 10)
        torch.testing.assert_close(torch.tensor(auto["val"]), torch.tensor(pinned["val"]), atol=1e-5, rtol=0)
        for name, value in pinned["state_dict"].items():
            torch.testing.assert_close(auto["state_dict"][name], value, atol=1e-5, rtol=0)
    before = results["auto"][0]["losses"]
    assert before[-1] < before[0]  # it trains


@pytest.mark.dist  # the shared launch of costed_run
def test_a_resume_keeps_the_choice(costed_run):
    results, log = costed_run
    for r in results["resumed"]:
        assert r["trial_at_start"] is None  # nothing left to time once the checkpoint is loaded
        assert r["chosen"]["schedule"] == "InterleavedZeroBubble" and r["schedule"] == "InterleavedZeroBubble"
        assert len(r["losses"]) == 3
    assert "keeping the checkpoint's choice, schedule='InterleavedZeroBubble'" in log


def test_stand_in_costs_fit_their_scale_too():
    """On the meta device the prediction runs on parameter counts; the timed steps fit both their scale and the
    per-action time, and the refitted model ranks what was not timed."""
    specs = ((32, 500.0, 80), (16, 600.0, 40), (8, 750.0, 20), (4, 850.0, 10))  # (m, base in stand-in units, slope)
    candidates = sorted((Candidate(Config("Interleaved1F1B", 2, m), base + slope * 1e-3, 0.1, 100, base=base,
                                   slope=slope) for m, base, slope in specs), key=lambda c: c.predicted)
    trial = Trial(candidates, stand_ins=True)
    times = {m: 1e-3 * base + slope * 0.02 for m, base, slope in specs}  # a stand-in unit is 1 ms; 20 ms per action
    _run(trial, lambda c: times[c.num_microbatches])
    assert trial.scale == pytest.approx(1e-3) and trial.overhead == pytest.approx(0.02)
    assert trial.chosen == Config("Interleaved1F1B", 2, 4)


def test_a_model_on_the_meta_device_is_predicted_from_parameter_counts():
    from torch import nn

    from lightning_pipe._lightning.options import validated_options
    from lightning_pipe._step.auto import Chooser

    with torch.device("meta"):
        module = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    options = validated_options(pipeline_parallel_size=4, schedule="auto")

    def measure(*args, **kwargs):
        raise AssertionError("nothing is timed on the meta device")

    chooser = Chooser(options, 4, measure, module, torch.device("cpu"), fitting=True)
    costs = [72.0] * 8
    config, layout_costs = chooser(None, costs, args=((torch.zeros(16, 8), torch.zeros(16, 8)), 0))
    assert layout_costs == costs and chooser.trial is not None and chooser.trial.stand_ins
    assert config == chooser.trial.timed[0].config
    assert {c.config.num_microbatches for c in chooser.trial.candidates} <= {1, 2, 4, 8, 16}


@pytest.mark.dist  # the shared launch of costed_run
def test_auto_with_sharded_replicas_and_accumulation_trains_as_the_choice(costed_run):
    """pp2 x FSDP2 dp2, gradients accumulated over 2 batches: the trial switches schedules between the batches of
    one optimizer step, and the run still equals the choice pinned."""
    results, _ = costed_run
    chosen = results["sharded"][0]["chosen"]
    assert chosen is not None and all(r["chosen"] == chosen for r in results["sharded"])
    for auto, pinned in zip(results["sharded"], results["sharded_pinned"]):
        assert len(auto["losses"]) == 14
        torch.testing.assert_close(torch.tensor(auto["losses"]), torch.tensor(pinned["losses"]), atol=1e-5, rtol=0)
        for name, value in pinned["state_dict"].items():
            torch.testing.assert_close(auto["state_dict"][name], value, atol=1e-5, rtol=0)
