"""The fine-tuned model leaves the pipeline whole ([Note: the whole module after a Trainer call]).

One two-process launch (``pretrained_job.py``) fine-tunes a Hugging Face Llama, a GPT-2 with its tied head and a peft
LoRA around the Llama, each against one process; then checks what a user's script does after ``fit``: on global zero
``lit.model.save_pretrained`` writes the whole model, ``lit.state_dict()`` is the whole model and a plain forward
gives one process's logits; the parallel save (``PipelineStrategy.save_pretrained`` and ``HuggingFaceCheckpoint``)
and a training checkpoint converted with ``consolidate --format hf`` load with ``from_pretrained`` with nothing missing
or unexpected and equal one process's weights. With ``keep_split=True`` the module stays split and ``save_pretrained``
fails on every rank, naming the parallel save, and writes nothing. A Llama built on the meta device reads each rank's
stages from a Hugging Face directory (``read_pretrained``) and trains as one process from the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pretrained_job
import pytest
import torch
import zoo
from helpers import run_script

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
ATOL = 1e-5
STRATEGY = {"num_microbatches": 4}
PHASES = [
    {"name": "llama", "model": "hf_llama", "strategy": STRATEGY, "callback": True},
    {"name": "gpt2", "model": "hf_gpt2", "strategy": {**STRATEGY, "schedule": "Interleaved1F1B"}},
    {"name": "lora", "model": "hf_llama", "strategy": STRATEGY, "lora": True},
    {"name": "split", "model": "hf_llama", "strategy": {**STRATEGY, "keep_split": True}, "keep_split": True},
    {"name": "meta", "model": "hf_llama", "strategy": {**STRATEGY, "schedule": "GPipe"}},  # + "pretrained": dir
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pretrained")


@pytest.fixture(scope="module")
def launched(work) -> dict[str, list[dict[str, Any]]]:
    zoo.make("hf_llama").model.save_pretrained(work / "initial")  # what the meta phase reads: the llama's start
    phases = [{**p, "out": str(work / p["name"])} for p in PHASES]
    phases[-1]["pretrained"] = str(work / "initial")
    spec = work / "spec.json"
    spec.write_text(json.dumps({"devices": 2, "phases": phases}))
    proc = run_script([str(HERE / "pretrained_job.py"), str(spec), str(work / "out")], cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return {p["name"]: [torch.load(work / "out" / f"{p['name']}.rank{r}.pt") for r in range(2)] for p in PHASES}


def reference(work: Path, name: str) -> dict[str, Any]:
    phase = next(p for p in PHASES if p["name"] == name)
    return pretrained_job.run_phase({**phase, "strategy": None, "out": str(work / f"{name}_one")}, 1)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst < ATOL, worst


def loaded(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_after_fit_the_module_is_the_whole_fine_tuned_model(launched, work, name):
    want = reference(work, name)
    got = launched[name][0]
    assert_close(got["state_dict"], want["state_dict"])
    assert (got["logits"] - want["logits"]).abs().max().item() < ATOL
    one = loaded(work / f"{name}_one" / "plain")
    assert_close(loaded(work / name / "plain"), one)  # the line every Hugging Face script ends with
    assert_close(loaded(work / name / "parallel"), one)  # every rank writing its stages
    out = work / f"{name}_converted"
    subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", str(work / name / "trained.ckpt"), str(out), "--format",
         "hf", "--max-shard-size", "20KB"], check=True, timeout=120,
    )
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded by size, with its index
    assert_close(loaded(out), one)


def test_the_callback_saves_every_n_steps_and_at_the_end(launched, work):
    one = loaded(work / "llama_one" / "plain")
    assert_close(loaded(work / "llama" / "callback"), one)
    steps = sorted(p.name for p in (work / "llama" / "callback").glob("step=*"))
    assert steps == ["step=2", "step=4"]
    assert json.loads((work / "llama" / "callback" / "step=2" / "config.json").read_text())["num_hidden_layers"] == 4


def test_a_peft_model_saves_its_adapter_only(launched, work):
    from peft import PeftModel

    want = reference(work, "lora")
    assert_close(launched["lora"][0]["state_dict"], want["state_dict"])
    written = sorted(p.name for p in (work / "lora" / "parallel").iterdir())
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    base = zoo.make("hf_llama").model  # the same base weights (the adapter trains alone)
    peft_model = PeftModel.from_pretrained(base, work / "lora" / "parallel")
    got = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    expected = {k[len("model."):]: v for k, v in want["state_dict"].items() if "lora_" in k}
    assert_close(got, expected)


def test_a_module_kept_split_refuses_a_partial_save_on_every_rank(launched):
    for rank in launched["split"]:
        assert rank["refused"] is not None and "save_pretrained" in rank["refused"], rank["refused"]
        assert not [f for f in rank["written"] if f.endswith(".safetensors")], rank["written"]  # no partial model


def test_a_model_built_on_the_meta_device_reads_its_stages_from_a_hugging_face_directory(launched, work):
    want = reference(work, "llama")  # trained from the weights the directory holds
    assert_close(launched["meta"][0]["state_dict"], want["state_dict"])


def test_reading_pretrained_weights_checks_the_directory_against_the_model(work, tmp_path):
    from lightning_pipe import read_pretrained

    lit = zoo.make("hf_llama", seed=5)
    read_pretrained(lit.model, work / "initial")  # a real model reads at once
    assert_close(dict(lit.model.state_dict()), loaded(work / "initial"))
    zoo.make("hf_gpt2").model.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="do not match the model: missing"):
        read_pretrained(zoo.make("hf_llama").model, tmp_path / "gpt2")
    with pytest.raises(FileNotFoundError, match="no `.safetensors`"):
        read_pretrained(zoo.make("hf_llama").model, tmp_path)
