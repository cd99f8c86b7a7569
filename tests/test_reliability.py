"""Same data on every stage, stall reports, and signals that end every rank (2 CPU processes, 2 stages).

The jobs are in ``tests/reliability_job.py``. Exits after a successful fit are covered by every job of the suite
(each must exit 0); ``scripts/repeat_fits.py`` repeats short fits to measure it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import models
import pytest
import torch
from helpers import run_script

from lightning_pipe._compat import torch as torch_compat
from lightning_pipe._fingerprint import fingerprint

HERE = Path(__file__).resolve().parent
JOB = HERE / "reliability_job.py"
CPU = torch.device("cpu")


def run_case(case: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_script([str(JOB), case, str(tmp_path / "out")], cwd=tmp_path, timeout=timeout)


@pytest.mark.dist
def test_one_replica_keeps_the_loader_order_and_shuffles_alike(tmp_path):
    proc = run_case("order", tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1], "the stages saw different batches"
    sequential = [batch[0][:, 0].tolist() for batch in models.loader(shuffle=False)]
    epoch0, epoch1, epoch2 = ranks[0]
    assert epoch0 == sequential, "a shuffle=False loader was reshuffled"
    assert epoch1 != sequential and epoch2 != epoch1, "a shuffle=True loader was not shuffled every epoch"
    assert sorted(sum(epoch1, [])) == sorted(sum(sequential, []))


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case", "cause"),
    [("different-data", "values and row order"), ("different-iterable", "values")],
)
def test_stages_given_different_batches_fail_on_every_rank(case, cause, tmp_path):
    start = time.monotonic()
    proc = run_case(case, tmp_path)
    assert proc.returncode != 0
    message = "the stages of one pipeline were given different training batches (batch 0 of this run)"
    assert proc.stdout.count(message) >= 2, proc.stdout[-6000:]  # raised on both ranks, before any step
    assert f"pipeline rank 1 (stage 1) differs in its {cause}" in proc.stdout
    assert "check_data_every_n_batches=None" in proc.stdout
    assert time.monotonic() - start < 60


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("stall-shapes", "[lightning_pipe rank 1] has waited 1 s for the output shape of stage 0 from pipeline rank 0"),
        (
            "stall-step",
            "[lightning_pipe rank 1] has waited 1 s for a training step to finish on pipeline rank 1 (stage 1 (its"
            " input from stage 0 on pipeline rank 0))",
        ),
    ],
)
def test_a_stall_is_reported_within_the_bound(case, expected, tmp_path):
    proc = run_case(case, tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]  # a report, not a failure: the stage only was slow
    assert expected in proc.stdout, proc.stdout[-6000:]
    assert "Where this rank waits:" in proc.stdout


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ")[-1].split()[0] != "Z":
                alive.append(pid)
    return alive


@pytest.mark.dist
@pytest.mark.parametrize("target", ["process-group", "rank-0"])
def test_sigterm_ends_every_rank_while_one_is_blocked_in_a_transfer(target, tmp_path):
    """Rank 0 hangs in Python before batch 2's send; rank 1 waits in gloo's receive. SIGTERM, to every process (as
    ``timeout`` and SLURM send it) or to rank 0 alone (``kill``), ends both within 30 s."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "hang", str(tmp_path / "out")], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        marker = tmp_path / "out" / "hanging"
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not reach its hang"
            time.sleep(0.2)
        time.sleep(1.0)  # rank 1 is now blocked in the receive of batch 2
        pids = [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
        assert len(pids) >= 2, pids
        start = time.monotonic()
        if target == "process-group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        while _alive(pids) and time.monotonic() - start < 30:
            time.sleep(0.2)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert not _alive(pids), f"still running after {took:.0f} s"
    assert took < 30
    assert proc.returncode != 0
    assert "[lightning_pipe rank 1] received SIGTERM while waiting for a training step" in out, out[-6000:]


def test_fingerprint_sees_order_values_and_structure():
    x, y = torch.arange(64).view(8, 8), torch.randn(8, 3)
    base = fingerprint((x, y, ["a", "b"], {"n": 1}), CPU)
    same = fingerprint((x.clone(), y.clone(), ["a", "b"], {"n": 1}), CPU)
    assert torch.equal(base, same)
    perm = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])
    changed = {
        "rows swapped": (x[perm], y[perm], ["a", "b"], {"n": 1}),
        "one value": (x, y + torch.eye(8, 3), ["a", "b"], {"n": 1}),
        "strings reordered": (x, y, ["b", "a"], {"n": 1}),
        "dtype": (x.int(), y, ["a", "b"], {"n": 1}),
        "shape": (x.view(4, 16), y, ["a", "b"], {"n": 1}),
        "key": (x, y, ["a", "b"], {"m": 1}),
    }
    for what, batch in changed.items():
        assert not torch.equal(base, fingerprint(batch, CPU)), what


def test_mesh_sub_groups_get_the_strategy_timeout():
    """``init_device_mesh`` would give a sub-group 30 minutes; a dimension spanning every process reuses the
    default group, which has the timeout already."""
    timeout = timedelta(seconds=42)
    overrides = torch_compat.mesh_group_options({"dp": 2, "pp": 2}, 4, "gloo", timeout)
    assert set(overrides) == {"dp", "pp"}
    assert all(backend == "gloo" and options._timeout == timeout for backend, options in overrides.values())
    assert set(torch_compat.mesh_group_options({"dp": 1, "pp": 2}, 2, "gloo", timeout)) == {"dp"}
