"""Generation through the pipeline ([Note: lock step] in ``lightning_pipe/_step/generation.py``) against one device.

One four-process launch runs every case, pp4 and pp2 x dp2 (starting processes costs more than these small fits);
each case fine-tunes on padded batches with ``-100`` labels (two SGD steps, clipping), and validates at the end of
the epoch with a ``validation_step`` that computes the loss and then generates 16 tokens from left-padded prompts
of different lengths (tests/generation_models.py). Every case compares, on every rank, the generated token ids with
the single-device run's (exactly), the metrics computed from the generated text and the training losses (within
1e-5). The caches: each rank's microbatch caches held its own stages' layers only, no longer than prompt plus new
tokens, and none is alive after the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_script

HERE = Path(__file__).resolve().parent


def case(name: str, model: str, strategy: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "strategy": {"num_microbatches": 4, **strategy}, **extra}


PP4 = {"pipeline_parallel_size": 4}
PP2 = {"pipeline_parallel_size": 2}  # x 2 replicas
CASES = [
    case("llama_greedy_pp4", "lm", PP4, model_kwargs={"family": "llama", "decode": "greedy"}),
    case("llama_beam_pp4", "lm", PP4, model_kwargs={"family": "llama", "decode": "beam"}),
    case("gpt2_greedy_pp4", "lm", PP4, model_kwargs={"family": "gpt2", "decode": "greedy"}),
    case("gpt2_beam_pp4", "lm", PP4, model_kwargs={"family": "gpt2", "decode": "beam"}),
    case("llama_greedy_pp2", "lm", PP2, model_kwargs={"family": "llama", "decode": "greedy"}, fns=["fit", "predict"]),
    case("llama_beam_pp2", "lm", PP2, model_kwargs={"family": "llama", "decode": "beam"}),
    case("gpt2_greedy_pp2", "lm", PP2, model_kwargs={"family": "gpt2", "decode": "greedy"}),
    case("gpt2_beam_pp2", "lm", PP2, model_kwargs={"family": "gpt2", "decode": "beam"}),
    case("llama_sample_pp2", "lm", {**PP2, "schedule": "Interleaved1F1B"},
         model_kwargs={"family": "llama", "decode": "sample"}),
    case("nanogpt_sample_pp4", "nano", PP4, model_kwargs={"sample": True}),
    case("lora_greedy_pp2", "lm", PP2, model_kwargs={"family": "llama", "decode": "greedy", "lora": True}),
]
ERRORS = [
    case("static_cache", "lm", PP2, model_kwargs={"family": "llama", "decode": "static"}, expect_error=True),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("generation")
    spec = work / "spec.json"
    spec.write_text(json.dumps({"devices": 4, "phases": CASES + ERRORS}))
    proc = run_script([str(HERE / "generation_job.py"), str(spec), str(work / "out")], cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return work / "out"


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    import generation_job

    refs = {}
    for spec in CASES:
        key = json.dumps([spec["model"], spec.get("model_kwargs"), spec.get("fns")], sort_keys=True)
        if key not in refs:
            refs[key] = generation_job.run_phase({**spec, "strategy": None}, devices=1)
    return {spec["name"]: refs[json.dumps([spec["model"], spec.get("model_kwargs"), spec.get("fns")],
                                          sort_keys=True)] for spec in CASES}


def results(out: Path, name: str) -> list[dict[str, Any]]:
    found = [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(4)]
    for r in found:
        assert "error" not in r or r["error"] is None, r["error"]
    return found


@pytest.mark.dist
@pytest.mark.parametrize("spec", CASES, ids=[c["name"] for c in CASES])
def test_generated_tokens_equal_one_device(launched: Path, references: dict, spec: dict) -> None:
    ref = references[spec["name"]]
    assert len(ref["generated"]) == 2 and all(g.shape[1] == 16 for g in ref["generated"])
    for r in results(launched, spec["name"]):
        assert len(r["generated"]) == len(ref["generated"])
        for mine, theirs in zip(r["generated"], ref["generated"]):
            assert torch.equal(mine, theirs), f"rank {r['rank']}:\n{mine}\n{theirs}"
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        for key in ("val_loss", "val_cer", "val_first_token"):
            if key in ref["callback_metrics"]:
                assert r["callback_metrics"][key] == pytest.approx(ref["callback_metrics"][key], abs=1e-5), key
        if ref["predictions"] is not None:
            for mine, theirs in zip(r["predictions"], ref["predictions"]):
                assert torch.equal(mine, theirs)


@pytest.mark.dist
def test_generation_is_not_trivial(references: dict) -> None:
    """The cases generate different tokens (and the loops stop rows at the end-of-sequence token): a comparison
    that would pass with any decoding is not one."""
    greedy, beam = references["llama_greedy_pp4"]["generated"][0], references["llama_beam_pp4"]["generated"][0]
    sampled = references["llama_sample_pp2"]["generated"][0]
    assert not torch.equal(greedy, beam) and not torch.equal(greedy, sampled)
    assert any((g == 3).any() for g in references["llama_greedy_pp4"]["generated"] + [beam, sampled])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["llama_greedy_pp4", "gpt2_beam_pp2", "lora_greedy_pp2"])
def test_each_stage_caches_its_own_layers_and_frees_them(launched: Path, name: str) -> None:
    for r in results(launched, name):
        stages = [s for s, rank in enumerate(r["stage_ranks"]) if rank == r["pipeline_rank"]]
        own = sorted(i for s in stages for i in range(*r["bounds"][s]))
        assert r["held_layers"] == own, (r["rank"], r["held_layers"], own)
        assert r["caches_made"] >= 4  # one per microbatch, per generate call
        assert r["caches_alive"] == 0
        assert 0 < r["longest_cache"] <= 6 + 16  # the longest prompt plus the new tokens


@pytest.mark.dist
def test_an_unsplittable_cache_fails_on_every_rank_naming_the_fix(launched: Path) -> None:
    for r in range(4):
        found = torch.load(launched / f"static_cache.rank{r}.pt", weights_only=False)
        assert found["error"] is not None, r
        assert "StaticLayer" in found["error"] and 'cache_implementation="dynamic"' in found["error"], found["error"]
