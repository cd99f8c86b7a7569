"""The schedule timeline: events of one traced step, Chrome trace, PNG and the measured bubble.

No assertion here depends on how long anything took: the unit tests use hand-built events, and the real runs
(2 CPU processes, gloo, torch's schedules driven directly) check which events were recorded, in what order per
rank, and that the files are well formed.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
from helpers import HERE, run_script

from lightning_pipe import timeline
from lightning_pipe.timeline import (
    TimelineOptions,
    TimelineRecorder,
    ideal_bubble_fraction,
    report,
    summarize,
    timeline_metrics,
    write_chrome_trace,
    write_png,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGE_METHODS = (
    "forward_one_chunk",
    "backward_one_chunk",
    "backward_weight_one_chunk",
    "get_fwd_recv_ops",
    "get_fwd_send_ops",
    "get_bwd_recv_ops",
    "get_bwd_send_ops",
)


def ev(rank, cat, stage, mb, start, end, name=None, **extra):
    letter = {"forward": "F", "backward": "B", "loss": "L", "backward_input": "I", "backward_weight": "W"}
    if name is None:
        name = f"{letter[cat]}{mb} s{stage}" if cat in letter else cat
    return {"rank": rank, "cat": cat, "name": name, "stage": stage, "mb": mb, "start": start, "end": end, **extra}


def gpipe_events(m: int = 4, f: float = 1000.0, b: float = 2000.0) -> list[dict]:
    """GPipe on 2 ranks, equal stages, forward f and backward b microseconds, free communication."""
    events = []
    for i in range(m):
        events.append(ev(0, "forward", 0, i, i * f, (i + 1) * f))
        events.append(ev(1, "forward", 1, i, (i + 1) * f, (i + 2) * f))
    t1 = (m + 1) * f  # rank 1 starts backward after its last forward
    for i in range(m):
        events.append(ev(1, "backward", 1, i, t1 + i * b, t1 + (i + 1) * b))
        events.append(ev(0, "backward", 0, i, t1 + (i + 1) * b, t1 + (i + 2) * b))
    # waits fill the gaps; they are not compute
    events.append(ev(1, "comm", 1, 0, 0.0, f, name="recv wait", args={"ops": ["recv act mb0 s1 from rank 0"]}))
    events.append(ev(0, "comm", 0, 0, m * f, t1 + b, name="recv wait", args={"ops": ["recv grad mb0 s0 from rank 1"]}))
    events.append(ev(0, "step", None, None, -50.0, t1 + (m + 1) * b + 80.0))
    events.append(ev(1, "step", None, None, -20.0, t1 + (m + 1) * b + 10.0))
    return events


# ---------------------------------------------------------------------------------------------- synthetic events
def test_summarize_hand_built_gpipe_bubble():
    m, p = 4, 2
    summary = summarize(gpipe_events(m), num_ranks=p)
    # span: 5 forwards' worth then 5 backwards' worth = 5 ms + 10 ms; busy 4 * (1 + 2) ms per rank
    assert summary["span_s"] == pytest.approx(0.015)
    assert summary["busy_s"] == {0: pytest.approx(0.012), 1: pytest.approx(0.012)}
    assert summary["stage_busy_s"] == {0: pytest.approx(0.012), 1: pytest.approx(0.012)}
    assert summary["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert summary["bubble_fraction"] == pytest.approx(ideal_bubble_fraction(p, m))
    assert summary["comm_s"][1] == pytest.approx(0.001)
    assert summary["compute_s_by_kind"]["forward"] == pytest.approx(0.008)
    assert summary["step_s"] == pytest.approx((15000 + 130) / 1e6)
    assert summary["num_events"] == 4 * m + 2
    assert (summary["num_stages"], summary["num_microbatches"]) == (2, m)


def test_gradient_reductions_are_drawn_and_timed_but_not_in_the_schedule_span(tmp_path: Path):
    events = gpipe_events(4) + [
        ev(0, "collective", None, None, 15000.0, 15400.0, name="reduce-scatter Block"),
        ev(1, "collective", None, None, 14000.0, 14100.0, name="all-reduce over replicas"),
    ]
    summary = summarize(events, num_ranks=2)
    assert summary["span_s"] == pytest.approx(0.015)  # the schedule's span, as without them
    assert summary["collective_s"] == {0: pytest.approx(400e-6), 1: pytest.approx(100e-6)}
    write_chrome_trace(events, tmp_path / "t.json")
    threads = [t for t in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if t["name"] == "thread_name"]
    assert {"rank": 0, "name": "collective"} in [{"rank": t["pid"], "name": t["args"]["name"]} for t in threads]
    pytest.importorskip("matplotlib")
    write_png(events, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_summarize_counts_overlap_once_and_idle_ranks():
    events = [
        ev(0, "forward", 0, 0, 0.0, 100.0),
        ev(0, "backward_input", 0, 0, 50.0, 150.0),  # overlapping compute on one rank counts once
        ev(0, "backward_weight", 0, 0, 150.0, 200.0),
    ]
    summary = summarize(events, num_ranks=2)  # rank 1 recorded nothing: all of its time is bubble
    assert summary["busy_s"] == {0: pytest.approx(200e-6), 1: 0.0}
    assert summary["stage_busy_s"] == {0: pytest.approx(250e-6)}
    assert summary["bubble_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="No pipeline events"):
        summarize([ev(0, "step", None, None, 0.0, 1.0)], 1)


def test_ideal_bubble_fraction():
    assert ideal_bubble_fraction(2, 4) == pytest.approx(0.2)
    assert ideal_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble_fraction(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)
    assert ideal_bubble_fraction(1, 4) == 0.0


def test_chrome_trace_is_well_formed(tmp_path: Path):
    events = gpipe_events()
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path)
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents"}
    complete = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    meta = [t for t in trace["traceEvents"] if t["ph"] == "M"]
    assert len(complete) == len(events)
    for t in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(t)
        assert isinstance(t["ts"], (int, float)) and isinstance(t["dur"], (int, float)) and t["dur"] >= 0
        assert t["pid"] in (0, 1)
        if t["cat"] == "comm":
            assert t["tid"] == "comm" and t["args"]["ops"]
        elif t["cat"] == "step":
            assert t["tid"] == "step"
        else:
            assert t["tid"] == t["args"]["stage"] and t["name"] == f"{t['name'][0]}{t['args']['mb']} s{t['tid']}"
    names = {t["name"] for t in complete}
    assert {"F0 s0", "F3 s1", "B0 s1", "B3 s0", "recv wait"} <= names
    thread_names = {(t["pid"], t["tid"]): t["args"]["name"] for t in meta if t["name"] == "thread_name"}
    assert thread_names[(0, 0)] == "stage 0" and thread_names[(1, 1)] == "stage 1"
    assert thread_names[(0, "comm")] == "comm" and thread_names[(1, "step")] == "step"
    assert {t["args"]["name"] for t in meta if t["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_png_is_written(tmp_path: Path):
    import matplotlib  # noqa: F401  (a test dependency: fail, never skip, when it is missing)
    path = tmp_path / "timeline.png"
    write_png(gpipe_events(), path, title="GPipe")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_png_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        write_png(gpipe_events(), tmp_path / "x.png")
    # `report` still writes the JSON and warns instead of failing
    with pytest.warns(UserWarning, match="timeline.png"):
        summary = report(gpipe_events(), dirpath=tmp_path / "out")
    assert [Path(f).name for f in summary["files"]] == ["timeline.json"]


def test_report_without_process_group(tmp_path: Path):
    import matplotlib  # noqa: F401  (a test dependency: fail, never skip, when it is missing)
    summary = report(gpipe_events(), dirpath=tmp_path / "out")  # one process: gather is the identity
    assert [Path(f).name for f in summary["files"]] == ["timeline.json", "timeline.png"]
    assert (tmp_path / "out" / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    metrics = timeline_metrics(summarize(gpipe_events(), 2))
    assert metrics["timeline/bubble_fraction"] == pytest.approx(0.2)
    assert metrics["timeline/stage1_busy_s"] == pytest.approx(0.012)
    assert metrics["timeline/rank0_busy_s"] == pytest.approx(0.012)
    assert all(isinstance(v, float) for v in metrics.values())


def test_timeline_options():
    assert TimelineOptions.resolve(None) is None and TimelineOptions.resolve(False) is None
    assert TimelineOptions.resolve(True) == TimelineOptions(step=1)
    assert TimelineOptions.resolve(5) == TimelineOptions(step=5)
    assert TimelineOptions.resolve("runs/tl") == TimelineOptions(dirpath="runs/tl")
    assert TimelineOptions.resolve({"step": 0, "png": False}) == TimelineOptions(step=0, png=False)
    with pytest.raises(ValueError, match="non-negative"):
        TimelineOptions.resolve(-1)
    with pytest.raises(ValueError, match="unknown keys"):
        TimelineOptions.resolve({"steps": 3})
    with pytest.raises(ValueError, match="not understood"):
        TimelineOptions.resolve(2.5)


# ---------------------------------------------------------------------------------------------- installing
class FakeStage:
    """Has the methods of a PipelineStage that the recorder wraps."""

    def __init__(self, index: int, is_last: bool = False) -> None:
        self.stage_index = index
        self.is_last = is_last
        self.calls: list[tuple] = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(("F", fwd_chunk_id))
        return "out"

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.calls.append(("B" if full_backward else "I", bwd_chunk_id))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.calls.append(("W", bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops


def test_trace_wraps_only_inside_and_restores():
    stages = [FakeStage(0), FakeStage(2)]
    custom = stages[1].forward_one_chunk  # an instance attribute someone else set: put back as it was
    stages[1].forward_one_chunk = custom
    post, wait = torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p
    recorder = TimelineRecorder()
    with recorder.trace(stages):
        assert torch_schedules._batch_p2p is not post and torch_schedules._wait_batch_p2p is not wait
        assert all(name in vars(stages[0]) for name in STAGE_METHODS)
        assert stages[0].forward_one_chunk(3, ()) == "out"
        stages[0].backward_one_chunk(3, full_backward=False)
        stages[0].backward_weight_one_chunk(bwd_chunk_id=3)
        stages[1].forward_one_chunk(1, ())
        stages[1].backward_one_chunk(1, None, True)
        torch_schedules._wait_batch_p2p([])  # nothing to wait for: no event
    assert torch_schedules._batch_p2p is post and torch_schedules._wait_batch_p2p is wait
    assert not any(name in vars(stages[0]) for name in STAGE_METHODS)
    assert vars(stages[1])["forward_one_chunk"] is custom
    assert stages[0].calls == [("F", 3), ("I", 3), ("W", 3)]
    names = [e["name"] for e in recorder.events if e["cat"] != "step"]
    assert names == ["F3 s0", "I3 s0", "W3 s0", "F1 s2", "B1 s2"]
    starts = [e["start"] for e in recorder.events]
    assert starts == sorted(starts)
    assert [e["cat"] for e in recorder.events].count("step") == 1


def test_trace_restores_after_an_error_and_refuses_nesting():
    stage = FakeStage(0)
    post = torch_schedules._batch_p2p
    recorder = TimelineRecorder()
    with pytest.raises(KeyError):
        with recorder.trace(stage):
            with pytest.raises(RuntimeError, match="already being traced"):
                with TimelineRecorder().trace(FakeStage(1)):
                    pass
            raise KeyError("boom")
    assert torch_schedules._batch_p2p is post
    assert not any(name in vars(stage) for name in STAGE_METHODS)
    with recorder.trace(stage):  # usable again
        stage.forward_one_chunk(0, ())
    assert [e["name"] for e in recorder.events if e["cat"] != "step"] == ["F0 s0"]


class Op:
    """What ``_batch_p2p`` and the recorder read of a ``P2POp``: the function, the peer and the group."""

    def __init__(self, op, peer: int, group_name: str) -> None:
        self.op, self.peer, self.group = op, peer, SimpleNamespace(group_name=group_name)


class GroupedStage(FakeStage):
    """The last of 2 stages, with one communicator per direction: activations come downstream, gradients go up."""

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return [Op(dist.irecv, 0, "pp_p2p_downstream")]

    def get_bwd_send_ops(self, bwd_chunk_id):
        return [Op(dist.isend, 0, "pp_p2p_upstream")]


def test_nested_batch_p2p_is_one_post_and_labels_each_work(monkeypatch: pytest.MonkeyPatch):
    """torch 2.14/2.15's ``_batch_p2p`` with per-direction or per-edge communicators (a flag that gloo on CPU cannot
    turn on in 2.14, absent before): it calls itself through the module global once per group, in group-name order,
    so the wrapper is entered again. The schedule's one call is one event, and each work keeps its own op's label
    although the works come back in another order than the ops."""
    calls = []

    def per_group_batch_p2p(p2p_ops, desc=None):  # the structure of torch 2.14's _batch_p2p
        calls.append(len(p2p_ops))
        by_group = {}
        for op in p2p_ops:
            by_group.setdefault(op.group.group_name, []).append(op)
        if len(by_group) > 1:
            works = []
            for _, ops in sorted(by_group.items()):
                works += torch_schedules._batch_p2p(ops, desc=desc)
            return works
        return [SimpleNamespace(op=op, wait=lambda: None) for op in p2p_ops]

    monkeypatch.setattr(torch_schedules, "_batch_p2p", per_group_batch_p2p)
    stage = GroupedStage(1, is_last=True)
    recorder = TimelineRecorder()
    with recorder.trace(stage):
        ops = stage.get_bwd_send_ops(0) + stage.get_fwd_recv_ops(1)  # as 1F1B's last stage fuses them
        works = torch_schedules._batch_p2p(ops, desc="bwd_send_fwd_recv")
        assert [w.op for w in works] == ops[::-1]  # downstream first
        for op in ops[::-1]:
            torch_schedules._wait_batch_p2p([w for w in works if w.op is op])
        works = torch_schedules._batch_p2p(stage.get_fwd_recv_ops(2))  # one group: no nesting
        torch_schedules._wait_batch_p2p(works)
    assert torch_schedules._batch_p2p is per_group_batch_p2p
    assert calls == [2, 1, 1, 1]
    send, recv = "send grad mb0 s1 to rank 0", "recv act mb1 s1 from rank 0"
    comm = [(e["name"], e["mb"], e["args"]["ops"]) for e in recorder.events if e["cat"] == "comm"]
    assert comm == [
        ("send/recv post", 1, [send, recv]),
        ("recv wait", 1, [recv]),
        ("send wait", 0, [send]),
        ("recv post", 2, ["recv act mb2 s1 from rank 0"]),
        ("recv wait", 2, ["recv act mb2 s1 from rank 0"]),
    ]
    assert recorder._post_depth == 0


# ---------------------------------------------------------------------------------------------- real processes
#: torch >= 2.15 can give every pair of ranks its own communicators (off by default), also over gloo on CPU; then
#: `_batch_p2p` calls itself once per communicator. (2.14's per-direction communicators need a device-bound default
#: group, which gloo on CPU cannot have.) TORCH_LOGS shows torch's own line saying it uses them.
PER_EDGE_P2P = {"TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P": "1", "TORCH_LOGS": "+torch.distributed.pipelining._p2p"}
TRACED_CASES = [
    pytest.param("1F1B", 1, (), None, id="1F1B"),
    pytest.param("1F1B", 1, ("--trace-first",), None, id="1F1B-first-step"),  # the set-up happens inside the trace
    pytest.param("GPipe", 1, (), None, id="GPipe"),
    pytest.param("Interleaved1F1B", 2, (), None, id="Interleaved1F1B"),
    pytest.param("ZBVZeroBubble", 2, (), None, id="ZBVZeroBubble"),
]
if hasattr(dist.config, "pipeline_per_edge_p2p"):
    TRACED_CASES.append(pytest.param("1F1B", 1, (), PER_EDGE_P2P, id="1F1B-per-edge-p2p"))


def run_traced(
    schedule: str, stages_per_rank: int, tmp_path: Path, *extra: str, env: dict | None = None
) -> tuple[dict, list[dict], str]:
    out = tmp_path / "out"
    args = [str(HERE / "timeline_job.py"), schedule, str(out), "--microbatches", "4"]
    proc = run_script([*args, "--stages-per-rank", str(stages_per_rank), *extra], cwd=tmp_path, timeout=40, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    result = json.loads((out / "summary.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    trace = json.loads((out / "timeline.json").read_text())
    assert (out / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    complete = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert len(complete) == len(result["events"])
    assert {t["pid"] for t in complete} == {0, 1}
    assert all(t["dur"] >= 0 and t["ts"] >= 0 for t in complete)
    return result, ranks, proc.stdout


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule, stages_per_rank, extra, env", TRACED_CASES)
def test_traced_step_records_every_microbatch(
    schedule: str, stages_per_rank: int, extra: tuple, env: dict | None, tmp_path: Path
):
    result, ranks, output = run_traced(schedule, stages_per_rank, tmp_path, *extra, env=env)
    if env is PER_EDGE_P2P:
        assert "Pipeline P2P: using" in output, output[-3000:]  # torch did switch to its per-edge communicators
    m, num_stages = 4, 2 * stages_per_rank
    events = result["events"]
    for rank, r in enumerate(ranks):
        checks = r["checks"]
        assert checks["grads_equal"], "tracing changed the gradients"
        assert checks["stage_attrs_left"] == [] and checks["schedule_attrs_left"] == []
        assert checks["helpers_restored"]
        mine = [e for e in events if e["rank"] == rank]
        assert mine == sorted(r["events"], key=lambda e: (e["start"], e["end"]))  # gathered unchanged
        timed = [e for e in mine if e["cat"] != "step"]
        assert timed, rank
        # one thread records them one after another: ordered and never overlapping
        for a, b in zip(timed, timed[1:]):
            assert a["end"] <= b["start"], (a, b)
        assert all(e["stage"] in checks["stages"] for e in timed if e["cat"] != "comm" or e["stage"] is not None)
        (step,) = [e for e in mine if e["cat"] == "step"]
        assert step["start"] == 0.0 and step["end"] >= timed[-1]["end"]
    count = Counter((e["cat"], e["stage"], e["mb"]) for e in events)
    for stage in range(num_stages):
        for mb in range(m):
            assert count[("forward", stage, mb)] == 1, (stage, mb)
            full = count[("backward", stage, mb)]
            split = (count[("backward_input", stage, mb)], count[("backward_weight", stage, mb)])
            assert (full, split) in ((1, (0, 0)), (0, (1, 1))), (stage, mb, full, split)
            assert count[("loss", stage, mb)] == (1 if stage == num_stages - 1 else 0)
    if schedule == "ZBVZeroBubble":
        assert any(e["cat"] == "backward_weight" for e in events)
    comm = [e for e in events if e["cat"] == "comm"]
    assert comm and all(e["name"].endswith((" post", " wait")) and e["args"]["ops"] for e in comm)
    for rank in range(2):  # every transfer is posted once, and waited for once
        for phase in ("post", "wait"):
            mine = [e for e in comm if e["rank"] == rank and e["name"].endswith(phase)]
            counted = Counter(op for e in mine for op in e["args"]["ops"])
            assert counted and set(counted.values()) == {1}, (rank, phase, counted)
    ops = {op for e in comm for op in e["args"]["ops"]}
    if stages_per_rank == 1:  # every activation and gradient transfer is labelled with its microbatch
        for mb in range(m):
            assert f"recv act mb{mb} s1 from rank 0" in ops and f"send act mb{mb} s0 to rank 1" in ops
            assert f"recv grad mb{mb} s0 from rank 1" in ops and f"send grad mb{mb} s1 to rank 0" in ops
        assert any(e["name"] == "recv wait" for e in comm)
    # The bytes of each transfer posted: every rank sent its activations or gradients
    assert all(v > 0 for v in result["summary"]["sent_bytes"].values()), result["summary"]["sent_bytes"]
    summary = result["summary"]
    assert 0.0 <= summary["bubble_fraction"] < 1.0
    assert set(summary["stage_busy_s"]) == {str(s) for s in range(num_stages)}
    assert all(v > 0 for v in summary["busy_s"].values())
    assert summary["ideal_bubble_fraction"] == pytest.approx(ideal_bubble_fraction(2, m, stages_per_rank))


def test_module_has_no_wrappers_installed_at_import():
    assert torch_schedules._batch_p2p.__module__ == "torch.distributed.pipelining.schedules"
    assert torch_schedules._wait_batch_p2p.__module__ == "torch.distributed.pipelining.schedules"
    assert timeline._recorder._tracing is False


# ---------------------------------------------------------------------------------------------- through the Trainer
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_strategy_timeline_writes_files_and_logs(tmp_path: Path):
    import csv

    from helpers import run_job

    spec = {
        "devices": 2,
        "strategy": {"num_microbatches": 4, "timeline": 1},  # the first batch of global step 1
        "data": {"n": 24, "batch_size": 8},
        "trainer": {"max_steps": 3},
        "logger": "csv+tensorboard",
    }
    results = run_job(spec, tmp_path, timeout=110)
    assert [r["global_step"] for r in results] == [3, 3]
    log_dir = tmp_path / "out" / "csv" / "version_0"  # the Trainer's log_dir: its first logger's
    trace = json.loads((log_dir / "timeline.json").read_text())
    complete = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    names = Counter(t["name"] for t in complete)
    for mb in range(4):
        for stage in range(2):
            assert names[f"F{mb} s{stage}"] == 1 and names[f"B{mb} s{stage}"] == 1
    assert (log_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    logged = [r for r in rows if r.get("timeline/bubble_fraction")]
    assert len(logged) == 1 and logged[0]["step"] == "1"
    assert 0.0 <= float(logged[0]["timeline/bubble_fraction"]) < 1.0
    assert float(logged[0]["timeline/ideal_bubble_fraction"]) == pytest.approx(0.2)
    assert float(logged[0]["timeline/stage0_busy_s"]) > 0 and float(logged[0]["timeline/stage1_busy_s"]) > 0
