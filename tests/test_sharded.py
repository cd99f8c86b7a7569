"""Stages sharded over their replicas (``data_parallel="fsdp"|"hsdp"``), against the replicated stages of
``data_parallel="ddp"`` on the same replicas and data, which ``tests/test_scale.py`` checks against DDP.

One four-process launch runs every phase in a row (``tests/zoo_job.py``; starting processes costs more than these
small fits). The replicas get their own rows (Lightning's distributed sampler), so their token counts differ:

- the reductions that run in the last backward ([Note: overlapped reductions]) against Lightning's own DDP (pp1 x
  ddp4, padded tokens: each replica weighs its own) and against the reductions after the schedule that zero-bubble
  schedules keep (GPT-2 below, pp2 x ddp2, whose last stage sends each replica's loss weight to the first);
- a hand-built litgpt-style model (RoPE buffers, a padding mask from the batch), pp2 x dp2: SGD with momentum, a
  per-step LR scheduler, clipping by the global norm and gradient accumulation, 1F1B sharded and replicated, and
  Interleaved1F1B sharded with ``reshard_after_forward=True`` and activation checkpointing, and compiled (under 1F1B,
  and under ZBVZeroBubble with the linear weight gradients deferred to the weight actions): 1e-5;
- Hugging Face GPT-2 (head tied to the embedding across the end stages) fine-tuned on padded batches with ``-100``
  labels, AdamW: 2e-4;
- HSDP: pp1 x (2 replicated x 2 sharded) against pp1 x ddp4;
- checkpoints: the sharded run's directory resumed sharded and replicated, against the replicated run resumed; loaded
  on pp1 x fsdp4 and on pp4; consolidated into one file;
- ``bf16-mixed`` as FSDP's mixed precision, tracking the fp32 run;
- the meta device (nanoGPT, its head tied to the embedding): each rank materialises its shards only, to the unsplit
  model's values;
- the timeline of one step shows the gradient reductions (``collective`` spans);
- setup errors: an HSDP shape that does not divide the replicas.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from helpers import merged_state
from test_models import launch, ranks

from lightning_pipe._lightning.options import validated_options
from lightning_pipe._model.shard import refuse_unshardable

SAMPLED = {"use_distributed_sampler": True}
TRAIN = {"max_epochs": 2, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2, **SAMPLED}
PP2 = {"pipeline_parallel_size": 2, "num_microbatches": 4}
ROPE = {"model": "rope", "data": {"n": 64, "batch_size": 8}, "model_kwargs": {"lr": 0.2}}
NANOGPT = {"model": "nanogpt", "data": {"n": 16, "batch_size": 8}}
GPT2 = {"model": "hf_gpt2_ft", "data": {"n": 64, "batch_size": 8, "kind": "padded"},
        "model_kwargs": {"optimizer": "adamw", "lr": 2e-2}}


def phase(name: str, base: dict, strategy: dict, **extra: Any) -> dict[str, Any]:
    trainer = {**TRAIN, **extra.pop("trainer", {})}
    return {"name": name, **base, "strategy": strategy, "trainer": trainer, **extra}


def trace(work: Path, name: str) -> dict[str, Any]:
    return {"step": 1, "dirpath": str(work / f"timeline_{name}"), "png": False}


def phases(work: Path) -> list[dict[str, Any]]:
    ddp, fsdp = str(work / "ddp.ckpt"), str(work / "fsdp.ckpt")
    return [
        phase("rope_ddp", ROPE, {**PP2, "timeline": trace(work, "ddp")}, save=ddp, fns=["fit", "validate"]),
        phase("rope_fsdp", ROPE, {**PP2, "data_parallel": "fsdp", "timeline": trace(work, "fsdp")}, save=fsdp,
              fns=["fit", "validate"]),
        phase("rope_fsdp_interleaved", ROPE, {
            **PP2, "data_parallel": "fsdp", "schedule": "Interleaved1F1B", "reshard_after_forward": True,
            "activation_checkpointing": True,
        }),
        phase("rope_fsdp_compiled", ROPE, {**PP2, "data_parallel": "fsdp", "compile": {"backend": "aot_eager"}}),
        phase("rope_fsdp_compiled_zbv", ROPE, {
            **PP2, "data_parallel": "fsdp", "compile": {"backend": "aot_eager"}, "schedule": "ZBVZeroBubble",
            "reshard_after_forward": True,
        }, count_deferred=True),
        phase("gpt2_ddp", GPT2, {**PP2, "num_microbatches": 2}, hf_save=str(work / "gpt2_ddp_hf")),
        phase("gpt2_fsdp", GPT2, {**PP2, "num_microbatches": 2, "data_parallel": "fsdp"},
              hf_save=str(work / "gpt2_fsdp_hf")),
        phase("gpt2_ddp_zb", GPT2, {**PP2, "num_microbatches": 2, "schedule": "InterleavedZeroBubble"}),
        phase("rope_dp4_ddp", ROPE, {"pipeline_parallel_size": 1, "num_microbatches": 2}),
        {**phase("rope_dp4_lightning", ROPE, None), "strategy_name": "ddp"},
        phase("rope_dp4_hsdp", ROPE, {
            "pipeline_parallel_size": 1, "num_microbatches": 2, "data_parallel": "hsdp", "data_parallel_shard_size": 2,
        }),
        # resumed for a third epoch: sharded from sharded, replicated from replicated, replicated from sharded
        phase("resume_fsdp", ROPE, {**PP2, "data_parallel": "fsdp"}, ckpt_path=fsdp, trainer={"max_epochs": 3}),
        phase("resume_ddp", ROPE, PP2, ckpt_path=ddp, trainer={"max_epochs": 3}),
        phase("resume_ddp_from_fsdp", ROPE, PP2, ckpt_path=fsdp, trainer={"max_epochs": 3}),
        # loaded on other layouts: nothing left to train, the state is the loaded one
        phase("load_fsdp4", ROPE, {"pipeline_parallel_size": 1, "num_microbatches": 2, "data_parallel": "fsdp"},
              ckpt_path=fsdp),
        phase("load_pp4", ROPE, {"pipeline_parallel_size": 4, "num_microbatches": 4}, ckpt_path=fsdp),
        phase("rope_fsdp_bf16", ROPE, {**PP2, "data_parallel": "fsdp"}, trainer={"precision": "bf16-mixed"}),
        phase("meta_fsdp", NANOGPT, {**PP2, "data_parallel": "fsdp"}, meta_init=True, trainer={"max_steps": 1}),
        phase("bad_hsdp", ROPE, {
            "pipeline_parallel_size": 1, "data_parallel": "hsdp", "data_parallel_shard_size": 3,
        }, expect_error=True),
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def four(work) -> Path:
    return launch(work, "four", 4, phases(work), timeout=600)


def replicas(results: list[dict[str, Any]], pp: int) -> list[list[dict[str, Any]]]:
    return [results[i : i + pp] for i in range(0, len(results), pp)]


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], pp: int, atol: float) -> float:
    """Every rank logged the losses of the same rank of ``want`` (its replica's full-batch loss), and each replica's
    weights are ``want``'s; returns the largest difference."""
    worst = 0.0
    for g, w in zip(got, want):
        losses, expected = [s["train_loss"] for s in g["steps"]], [s["train_loss"] for s in w["steps"]]
        assert len(losses) == len(expected) > 0, (len(losses), len(expected))
        worst = max(worst, *(abs(a - b) for a, b in zip(losses, expected)))
        assert [s["lr"] for s in g["steps"]] == pytest.approx([s["lr"] for s in w["steps"]])
    for g, w in zip(replicas(got, pp), replicas(want, pp)):
        mine, theirs = merged_state(g), merged_state(w)
        assert set(mine) == set(theirs)
        worst = max(worst, *((mine[k].float() - theirs[k].float()).abs().max().item() for k in mine))
    assert worst < atol, f"differs by up to {worst:.2e}"
    start = merged_state(want[:pp], "initial")
    final = merged_state(want[:pp])
    assert max((final[k] - start[k]).abs().max().item() for k in final) > 100 * atol, "barely moved"
    return worst


@pytest.mark.dist
@pytest.mark.parametrize(
    ("name", "against", "pp", "atol"),
    [
        ("rope_dp4_ddp", "rope_dp4_lightning", 1, 1e-5),
        ("gpt2_ddp", "gpt2_ddp_zb", 2, 2e-4),
        ("rope_fsdp", "rope_ddp", 2, 1e-5),
        ("rope_fsdp_interleaved", "rope_ddp", 2, 1e-5),
        ("rope_fsdp_compiled", "rope_ddp", 2, 1e-5),  # compile=, then fully_shard: as torchtitan orders them
        ("rope_fsdp_compiled_zbv", "rope_ddp", 2, 1e-5),  # and the linear layers' weight gradients deferred
        ("gpt2_fsdp", "gpt2_ddp", 2, 2e-4),
        ("rope_dp4_hsdp", "rope_dp4_ddp", 1, 1e-5),
        ("resume_fsdp", "resume_ddp", 2, 1e-5),
        ("resume_ddp_from_fsdp", "resume_ddp", 2, 1e-5),
    ],
)
def test_sharded_stages_train_as_replicated_ones(four, name, against, pp, atol):
    got, want = ranks(four, name, 4), ranks(four, against, 4)
    worst = assert_same(got, want, pp, atol)
    print(f"{name} against {against}: {worst:.1e}")
    if name == "rope_fsdp":  # then validated by the same strategy, its units reused
        for g, w in zip(got, want):
            assert g["validated"][0]["val_loss"] == pytest.approx(w["validated"][0]["val_loss"], abs=1e-5)
    if name.startswith("resume"):  # the third epoch only
        assert len(got[0]["steps"]) == len(ranks(four, "rope_ddp", 4)[0]["steps"]) // 2


@pytest.mark.dist
def test_sharded_compiled_stages_defer_their_linear_weight_gradients(four):
    """Under ZBVZeroBubble, every linear layer of every compiled sharded block hands its weight gradient to the weight
    action ([Note: deferred weight gradients]), unsharded again after each forward (``reshard_after_forward=True``):
    4 layers, 2 blocks a rank, 4 microbatches, 8 batches. Exact: ``test_sharded_stages_train_as_replicated_ones``."""
    got = ranks(four, "rope_fsdp_compiled_zbv", 4)
    assert [r["deferred"] for r in got] == [4 * 2 * 4 * 8] * 4, [r["deferred"] for r in got]


@pytest.mark.dist
def test_the_timeline_shows_the_gradient_reductions(four, work):
    for mode, expected in (("ddp", "all-reduce over replicas"), ("fsdp", "reduce-scatter ")):
        trace = json.loads((work / f"timeline_{mode}" / "timeline.json").read_text())
        spans = [t for t in trace["traceEvents"] if t["ph"] == "X" and t["cat"] == "collective"]
        assert {t["pid"] for t in spans} == {0, 1}, spans  # both stages of the traced pipeline
        assert all(t["name"].startswith(expected) for t in spans if "tied" not in t["name"]), spans
        if mode == "fsdp":  # one reduce-scatter per unit: the blocks of each stage and its outside modules
            assert len([t for t in spans if t["pid"] == 0]) == 3
        for rank in (0, 1):  # the blocks' reductions start under the last microbatch's backward
            last = max((t for t in trace["traceEvents"] if t.get("cat") == "backward" and t["pid"] == rank),
                       key=lambda t: t["ts"])
            during = [t for t in spans if t["pid"] == rank and t["name"].endswith("(in backward)")]
            assert during and min(t["ts"] for t in during) < last["ts"] + last["dur"], (mode, rank, spans)


@pytest.mark.dist
def test_bf16_mixed_all_gathers_in_bf16_and_tracks_fp32(four):
    got, want = ranks(four, "rope_fsdp_bf16", 4), ranks(four, "rope_ddp", 4)
    for g, w in zip(got, want):
        losses, expected = [s["train_loss"] for s in g["steps"]], [s["train_loss"] for s in w["steps"]]
        assert len(losses) == len(expected)
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 5e-2, (losses, expected)
    assert all(v.dtype == torch.float32 for v in got[0]["state_dict"].values() if v.is_floating_point())


@pytest.mark.dist
def test_each_rank_holds_a_share_of_its_stage(four):
    sharded, replicated = ranks(four, "rope_fsdp", 4), ranks(four, "rope_ddp", 4)
    for s, r in zip(sharded, replicated):
        assert s["local_numel"] <= r["local_numel"] // 2 + 64, (s["local_numel"], r["local_numel"])
    hsdp, ddp4 = ranks(four, "rope_dp4_hsdp", 4), ranks(four, "rope_dp4_ddp", 4)
    assert all(h["local_numel"] <= d["local_numel"] // 2 + 64 for h, d in zip(hsdp, ddp4))


@pytest.mark.dist
def test_a_sharded_checkpoint_loads_on_other_layouts_and_consolidates(four, work):
    saved = merged_state(ranks(four, "rope_fsdp", 4)[:2])
    for name in ("load_fsdp4", "load_pp4"):
        loaded = merged_state(ranks(four, name, 4))
        assert set(loaded) == set(saved)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), name
    out = work / "consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", str(work / "fsdp.ckpt"), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = torch.load(out, weights_only=True)["state_dict"]
    model = zoo.make("rope")
    model.load_state_dict(state)  # an ordinary Lightning checkpoint of the unsplit module
    assert all(torch.equal(state[k], saved[k]) for k in saved)


@pytest.mark.dist
def test_meta_init_materialises_shards_to_the_unsplit_values(four):
    from lightning_pipe import materialize

    with torch.device("meta"):
        unsplit = zoo.make("nanogpt")
    materialize(unsplit, torch.device("cpu"))
    initial = merged_state(ranks(four, "meta_fsdp", 4)[:2], "initial")
    expected = unsplit.state_dict()
    assert set(initial) == set(expected)
    assert all(torch.equal(initial[k], expected[k]) for k in expected)


@pytest.mark.dist
def test_an_hsdp_shape_that_does_not_divide_is_refused_on_every_rank(four):
    for r in ranks(four, "bad_hsdp", 4):
        assert "data_parallel_shard_size" in r["error"] and "divides 4" in r["error"], r["error"]


def test_arguments_of_the_sharded_modes_are_checked():
    with pytest.raises(ValueError, match="'ddp'.*'fsdp'.*'hsdp'"):
        validated_options(pipeline_parallel_size=2, data_parallel="zero3")
    with pytest.raises(ValueError, match="applies to `data_parallel='hsdp'` only"):
        validated_options(pipeline_parallel_size=2, data_parallel="fsdp",
                          data_parallel_shard_size=2)
    with pytest.raises(ValueError, match="sharded stages only"):
        validated_options(pipeline_parallel_size=2,
                          reshard_after_forward=True)


def test_what_sharded_stages_cannot_honour_is_refused_with_the_fix():
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="bf16-mixed"):
        refuse_unshardable("fsdp", fp16, [])
    for callback in (StochasticWeightAveraging(swa_lrs=0.1), ModelPruning("l1_unstructured")):
        with pytest.raises(ValueError, match="data_parallel='ddp'"):
            refuse_unshardable("hsdp", MixedPrecision("bf16-mixed", "cpu"), [callback])


@pytest.mark.dist
def test_a_sharded_model_is_whole_after_fit_and_saves_in_parallel(four, work):
    """pp2 x FSDP2: after `fit` the module is whole on every rank (`save_pretrained` on global zero writes it), and the
    parallel save writes each rank's shards; both load with nothing missing and equal the replicated run's."""
    from test_pretrained import assert_close, loaded

    replicated = loaded(work / "gpt2_ddp_hf" / "plain")
    plain, parallel = loaded(work / "gpt2_fsdp_hf" / "plain"), loaded(work / "gpt2_fsdp_hf" / "parallel")
    assert_close(parallel, plain)
    assert_close(loaded(work / "gpt2_ddp_hf" / "parallel"), replicated)
    worst = max((plain[k] - replicated[k]).abs().max().item() for k in plain)
    assert worst < 2e-4, worst  # AdamW, as the training comparison above
