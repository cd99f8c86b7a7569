"""The one-GPU benchmark scripts still run, on CPU (``--accelerator cpu``, gloo, a tiny Llama), so that a session with a
GPU spends its device time measuring, not mending scripts. Their timings here mean nothing and are not checked; the
exactness they report is: ``gpu.py``'s fp32 pipeline against plain Lightning, and ``gpu_auto.py``'s run with
``schedule="auto"`` against its choice set explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_script

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--accelerator", "cpu", "--dim", "64", "--n-layers", "4", "--n-heads", "4", "--seq-len", "32",
        "--batch-size", "8"]


def _run(script: str, arguments: list[str], out: Path) -> dict:
    done = run_script([str(BENCHMARKS / script), *TINY, *arguments, "--out", str(out)], cwd=out.parent, timeout=300,
                      env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout[-6000:]
    return json.loads(out.read_text())


def test_gpu_py_runs_on_cpu_and_its_fp32_pipeline_equals_plain_lightning(tmp_path: Path) -> None:
    result = _run("gpu.py", ["--warmup", "1", "--steps", "2", "--check-steps", "2"], tmp_path / "gpu.json")
    assert result["device"] == "cpu" and "error" not in result["exactness"], result
    fp32 = result["exactness"]["32-true"]
    assert len(fp32["losses_pipeline"]) == 2
    assert fp32["max_loss_diff"] < 1e-5 and fp32["max_weight_diff"] < 1e-5, fp32
    for precision in ("bf16-mixed", "bf16-true"):  # microbatches round differently in bf16: they ran, no error
        assert "error" not in result["exactness"][precision], result["exactness"][precision]
    assert set(result["timing"]) >= {"single_s", "strategy_s", "torch_loop_s"}, result["timing"]


def test_gpu_auto_py_runs_on_cpu_and_auto_trains_as_its_choice_set_explicitly(tmp_path: Path) -> None:
    result = _run("gpu_auto.py", ["--steps", "12"], tmp_path / "auto.json")
    fp32 = result["32-true"]
    assert fp32["chosen"]["schedule"] != "auto"
    assert fp32["max_loss_diff"] < 1e-5, fp32
