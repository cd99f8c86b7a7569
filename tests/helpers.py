"""Running jobs in real processes and comparing them with single-device training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
JOB = HERE / "job.py"


def run_script(
    args: list[str], cwd: Path, timeout: float = 180, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a Python script in a fresh process group; on timeout, kill the whole group (the launched ranks too)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        full_env.pop(var, None)  # set by in-process Trainers; the script must launch its own processes
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as err:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{out[-6000:]}") from err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run_job(spec: dict[str, Any], tmp_path: Path, timeout: float = 180) -> list[dict[str, Any]]:
    """Run ``spec`` through tests/job.py and return every rank's results, rank 0 first."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    out_dir = tmp_path / "out"
    proc = run_script([str(JOB), str(spec_file), str(out_dir)], cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    devices = spec.get("devices", 1)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def reference(spec: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The same spec on one device without a strategy, in this process."""
    sys.path.insert(0, str(HERE))
    import job

    ref = {k: v for k, v in spec.items() if k not in ("strategy", "devices")}
    out = tmp_path / "reference"
    job.run(ref, out)
    return torch.load(out / "rank0.pt", weights_only=False)


def plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict with sharded (DTensor) values gathered, on the CPU: a collective, called on every rank in the same
    order."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}


def merged_state(results: list[dict[str, Any]], key: str = "state_dict") -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r[key].items():
            if name in merged:
                assert torch.equal(merged[name], value), f"{name} differs between ranks"
            merged[name] = value
    return merged


def assert_parity(results: list[dict[str, Any]], ref: dict[str, Any], atol: float = 1e-5) -> None:
    """Losses of every step on every rank and the final parameters match the single-device run."""
    ref_losses = [s["train_loss"] for s in ref["steps"]]
    assert ref_losses, "the reference logged no training loss"
    for rank, r in enumerate(results):
        losses = [s["train_loss"] for s in r["steps"]]
        assert len(losses) == len(ref_losses), (rank, len(losses), len(ref_losses))
        diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
        assert max(diffs) < atol, f"rank {rank} losses differ by up to {max(diffs):.2e}: {losses} vs {ref_losses}"
        returned = [s["returned_loss"] for s in r["steps"]]
        ref_returned = [s["returned_loss"] for s in ref["steps"]]
        assert max(abs(a - b) for a, b in zip(returned, ref_returned)) < atol
        assert [s["lr"] for s in r["steps"]] == [s["lr"] for s in ref["steps"]]
        for key, value in ref["callback_metrics"].items():  # every logged value, on every rank
            got = r["callback_metrics"].get(key)
            assert got is not None and abs(got - value) <= atol * max(1.0, abs(value)), (rank, key, got, value)
    merged = merged_state(results)
    assert set(merged) == set(ref["state_dict"]), set(merged) ^ set(ref["state_dict"])
    worst = max((merged[k].float() - ref["state_dict"][k].float()).abs().max().item() for k in merged)
    assert worst < atol, f"final parameters differ by up to {worst:.2e}"
    moved = max((ref["state_dict"][k].float() - ref["initial"][k].float()).abs().max().item() for k in merged)
    assert moved > 100 * atol, "parameters barely moved: the comparison would prove nothing"
    start = merged_state(results, "initial")
    pipelined_moved = max((merged[k].float() - start[k].float()).abs().max().item() for k in merged)
    assert pipelined_moved > 100 * atol, "the pipelined parameters never moved"


def state_after_call(model: "torch.nn.Module", keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` after a Trainer call; ``{}`` when the call failed and left the module split (its
    ``state_dict()`` then raises rather than give a part of the model)."""
    from lightning_pipe import SplitModuleError

    try:
        return model.state_dict(keep_vars=keep_vars)
    except SplitModuleError:
        return {}


def share_after_call(model: "torch.nn.Module", keys: Any) -> dict[str, torch.Tensor]:
    """The values after a Trainer call of the entries this rank held during it (``keys``, recorded in a hook of the
    call; ``None``: all), on the CPU."""
    state = state_after_call(model)
    return {k: v.detach().cpu().clone() for k, v in state.items() if keys is None or k in set(keys)}


def fit_one_process(module: Any, strategy: Any, loader: Any, **trainer_kwargs: Any) -> tuple[list[float], dict]:
    """Fit ``module`` on one process under ``strategy`` (``"auto"``: plain Lightning): the loss of every training
    batch, and the final state (detached copies)."""
    import lightning as L

    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()], **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
