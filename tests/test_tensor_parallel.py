"""Tensor parallelism inside each stage (``tensor_parallel_size``, ``tensor_parallel_plan``), against one process on
the full batch ([Note: tensor-parallel stages] in ``lightning_pipe/_model/tensor_parallel.py``).

One four-process launch runs every phase in a row (``tests/zoo_job.py``):

- a hand-built Llama (separate q/k/v/o, SwiGLU, RoPE) with torchtitan's plan given as a dict, pp2 x tp2: SGD with
  momentum, a per-step LR scheduler, clipping by the global norm and gradient accumulation (1e-5), then validated;
  the same under Interleaved1F1B with activation checkpointing; and pp1 x fsdp2 x tp2 (both replicas fed the whole
  batch, so one process is the reference);
- Hugging Face Llama with its own ``base_model_tp_plan`` (``"auto"``), pp2 x tp2, AdamW (2e-4);
- the hand-built Llama whose ``configure_model`` calls ``parallelize_module`` on its blocks itself, as for
  Lightning's ``ModelParallelStrategy``, with no plan given to the strategy (1e-5);
- nanoGPT (its head tied to the embedding across the end stages; biased MLP layers split, attention whole) under
  InterleavedZeroBubble: the weights left whole stay identical on every tensor rank (their gradients are averaged
  over the tensor ranks); and compiled, bit for bit the same, every linear layer's weight gradient deferred, split
  or whole;
- the pp2 x tp2 checkpoint loaded without tensor parallelism (pp2 x ddp2) and on pp4, and consolidated;
- a plan that names no module of the block: refused at setup on every rank;
- last, a Llama whose ``configure_model`` is torchtitan's sequence-parallel plan written for
  ``ModelParallelStrategy`` (``zoo.LlamaSP``): the embedding, the final norm and a vocabulary-sharded head split too,
  ``loss_parallel()`` in the step and in a ``backward`` override, fine-tuning batches padded with ``-100`` labels to
  lengths that change from batch to batch; pp2 x tp2 under Interleaved1F1B with clipping and accumulation (1e-5),
  its checkpoint loaded on pp2 x ddp2 and consolidated, and the same model with its head tied to its embedding (both
  split) under 1F1B.

A phase that fails stops the launch (its ranks may be out of step) and leaves its error for its tests; the phases
before it keep their results.

A two-process launch runs pp1 x tp2 (one stage over two tensor ranks), trained and then predicting.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from helpers import merged_state
from test_models import assert_same_training, launch, ranks, reference
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_pipe._lightning.options import validated_options
from lightning_pipe._model.tensor_parallel import block_plan, check_plan, choose_plan, recorded_plan

TRAIN = {"max_epochs": 1, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
LLAMA = {"model": "llama_tp", "data": {"n": 48, "batch_size": 8}, "model_kwargs": {"lr": 0.2}, "trainer": TRAIN}
HF = {"model": "hf_llama", "data": {"n": 48, "batch_size": 8}, "model_kwargs": {"optimizer": "adamw", "lr": 2e-2},
      "trainer": TRAIN}
TP2 = {"pipeline_parallel_size": 2, "num_microbatches": 4, "tensor_parallel_size": 2,
       "tensor_parallel_plan": zoo.LLAMA_TP_PLAN}


#: Sequence parallelism, ``loss_parallel`` and the modules outside the blocks split, all by ``configure_model``.
SP = {"model": "llama_sp", "data": {"n": 48, "batch_size": 8, "kind": "padded", "multiple_of": 2},
      "model_kwargs": {"lr": 0.2}, "trainer": TRAIN}
SP_PP2_TP2 = {"pipeline_parallel_size": 2, "num_microbatches": 4, "tensor_parallel_size": 2}


def phases(work: Path) -> list[dict[str, Any]]:
    ckpt, sp_ckpt = str(work / "tp.ckpt"), str(work / "sp.ckpt")
    return [
        {"name": "llama_pp2_tp2", **LLAMA, "strategy": TP2, "fns": ["fit", "validate"], "save": ckpt},
        {"name": "llama_interleaved_ac", **LLAMA, "strategy": {
            **TP2, "schedule": "Interleaved1F1B", "activation_checkpointing": True}},
        {"name": "llama_fsdp2_tp2", **LLAMA, "strategy": {
            **TP2, "pipeline_parallel_size": 1, "data_parallel": "fsdp"}},
        {"name": "hf_llama_auto", **HF, "strategy": {**TP2, "tensor_parallel_plan": "auto"},
         "hf_save": str(work / "hf_llama_auto_hf")},
        {"name": "llama_user_plan", **LLAMA, "model": "llama_tp_user",
         "strategy": {**TP2, "tensor_parallel_plan": None}},
        {"name": "nanogpt_tied_zb", "model": "nanogpt", "data": {"n": 32, "batch_size": 8}, "trainer": TRAIN,
         "strategy": {**TP2, "schedule": "InterleavedZeroBubble",
                      "tensor_parallel_plan": {"mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}}},
        {"name": "nanogpt_tied_zb_compiled", "model": "nanogpt", "data": {"n": 32, "batch_size": 8}, "trainer": TRAIN,
         "count_deferred": True,
         "strategy": {**TP2, "schedule": "InterleavedZeroBubble", "compile": {"backend": "aot_eager"},
                      "tensor_parallel_plan": {"mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}}},
        {"name": "load_pp2_dp2", **LLAMA, "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 4},
         "ckpt_path": ckpt},
        {"name": "load_pp4", **LLAMA, "strategy": {"pipeline_parallel_size": 4, "num_microbatches": 4},
         "ckpt_path": ckpt},
        {"name": "bad_plan", **LLAMA, "strategy": {**TP2, "tensor_parallel_plan": {"attn.wq": "colwise"}},
         "expect_error": True},
        {"name": "sp_interleaved", **SP, "strategy": {**SP_PP2_TP2, "schedule": "Interleaved1F1B"}, "save": sp_ckpt},
        {"name": "load_sp_pp2_dp2", **SP, "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 4},
         "ckpt_path": sp_ckpt},
        {"name": "sp_tied", **SP, "model_kwargs": {"lr": 0.2, "tie": True, "embed_output": "replicate"},
         "strategy": SP_PP2_TP2},
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel")


class Launched:
    """The results of a launch whose phases may have failed (a failing phase stops it: ``tests/zoo_job.py``)."""

    def __init__(self, out: Path, devices: int, log: str) -> None:
        self.out, self.devices, self.log = out, devices, log

    def ranks(self, name: str) -> list[dict[str, Any]]:
        """Every rank's results of phase ``name``; fails with the phase's error, or with the launch's log when it left
        none (an earlier phase failed, or the launch timed out)."""
        results = []
        for r in range(self.devices):
            path = self.out / f"{name}.rank{r}.pt"
            if not path.exists():
                pytest.fail(f"phase {name} left no results for rank {r}; the launch's log ends:\n{self.log[-6000:]}")
            results.append(torch.load(path, weights_only=False))
        errors = [r["error"] for r in results if r["error"] is not None]
        if errors and "expect_error" not in by_name(self.out.parent, name):
            # the rank that failed first, rather than those that lost their connection to it
            errors.sort(key=lambda e: "Connection closed by peer" in e or "Connection reset by peer" in e)
            pytest.fail(f"phase {name} failed:\n{errors[0][-6000:]}")
        return results


@pytest.fixture(scope="module")
def four(work) -> Launched:
    try:
        launch(work, "four", 4, phases(work), timeout=600)
        log = ""
    except AssertionError as err:  # a phase failed or the launch timed out: the phases before it keep their results
        log = str(err)
    return Launched(work / "four", 4, log)


PP1_TP2 = {"name": "pp1_tp2", **LLAMA, "fns": ["fit", "predict"],
           "strategy": {**TP2, "pipeline_parallel_size": 1, "num_microbatches": 2}}


@pytest.fixture(scope="module")
def two(work) -> Path:
    return launch(work, "two", 2, [PP1_TP2], timeout=300)


@pytest.mark.dist
def test_one_stage_over_two_tensor_ranks_trains_and_predicts_as_one_process(two):
    got, want = ranks(two, "pp1_tp2", 2), reference(PP1_TP2)
    assert_same_training(got, want)
    for r in got:
        assert all(torch.equal(a, b) for a, b in zip(r["predictions"], want["predictions"]))


def by_name(work: Path, name: str) -> dict[str, Any]:
    return next(p for p in phases(work) if p["name"] == name)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("name", "atol"),
    [("llama_pp2_tp2", 1e-5), ("llama_interleaved_ac", 1e-5), ("llama_fsdp2_tp2", 1e-5), ("hf_llama_auto", 2e-4),
     ("llama_user_plan", 1e-5), ("nanogpt_tied_zb", 1e-5)],
)
def test_tensor_parallel_stages_train_as_one_process(four, work, name, atol):
    phase = by_name(work, name)
    got = four.ranks(name)
    want = reference(phase)
    worst = assert_same_training(got, want, atol=atol)  # every rank's losses; the union of the ranks' weights
    print(f"{name}: largest difference {worst:.1e}")
    if "validate" in phase.get("fns", []):
        for r in got:
            assert r["validated"][0]["val_loss"] == pytest.approx(want["validated"][0]["val_loss"], abs=1e-5)


@pytest.mark.dist
def test_compiled_tensor_parallel_blocks_under_a_split_backward_equal_eager_ones(four):
    """nanoGPT compiled, under InterleavedZeroBubble: every linear layer hands its weight gradient to the weight
    actions ([Note: deferred weight gradients]), the attention's left whole and the MLP's split over the tensor ranks
    (``c_fc`` by output features, ``c_proj`` by input features, both biased): 4 layers, 2 stages a rank, 4
    microbatches, 4 batches; nothing warns that a weight gradient is computed in the input action. Every rank's
    losses and weights equal the eager run's, bit for bit (``aot_eager`` runs the same kernels)."""
    eager, compiled = four.ranks("nanogpt_tied_zb"), four.ranks("nanogpt_tied_zb_compiled")
    assert [r["deferred"] for r in compiled] == [4 * 2 * 4 * 4] * 4, [r["deferred"] for r in compiled]
    assert not [w for r in compiled for w in r["warnings"] if "input-gradient action" in w]
    for e, c in zip(eager, compiled):
        assert [s["train_loss"] for s in e["steps"]] == [s["train_loss"] for s in c["steps"]]
        assert set(e["state_dict"]) == set(c["state_dict"])
        assert all(torch.equal(e["state_dict"][k], c["state_dict"][k]) for k in e["state_dict"])


@pytest.mark.dist
def test_each_tensor_rank_holds_a_share_of_its_blocks(four):
    split, whole = four.ranks("llama_pp2_tp2"), four.ranks("load_pp2_dp2")
    for s, w in zip(split, whole):
        assert s["local_numel"] < 0.7 * w["local_numel"], (s["local_numel"], w["local_numel"])


@pytest.mark.dist
def test_a_tensor_parallel_checkpoint_loads_without_it_and_consolidates(four, work):
    saved = merged_state(four.ranks("llama_pp2_tp2"))
    for name in ("load_pp2_dp2", "load_pp4"):
        loaded = merged_state(four.ranks(name))
        assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved), name
    out = work / "consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", str(work / "tp.ckpt"), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = torch.load(out, weights_only=True)["state_dict"]
    zoo.make("llama_tp").load_state_dict(state)
    assert all(torch.equal(state[k], saved[k]) for k in saved)


@pytest.mark.dist
def test_a_plan_that_names_no_module_is_refused_on_every_rank(four):
    for r in four.ranks("bad_plan"):
        assert "names `attn.wq`, which is no module of the block" in r["error"], r["error"]
        assert "wq" in r["error"] and "w2" in r["error"]  # the block's modules are listed


def token_counts(phase: dict[str, Any], num_microbatches: int) -> list[list[int]]:
    """The targets that are not ``-100`` in each microbatch of each batch (labels shifted, as the model's loss)."""
    counts = []
    for batch in zoo.loader(phase["model"], **phase["data"]):
        labels = batch["labels"][:, 1:]
        counts.append([int((part != -100).sum()) for part in labels.chunk(num_microbatches)])
    return counts


@pytest.mark.dist
def test_sequence_parallel_loss_parallel_and_split_outside_modules_train_as_one_process(four, work):
    """pp2 x tp2 with the plan of ``zoo.LlamaSP.configure_model`` (sequence parallelism in and between the blocks,
    the embedding, final norm and a vocabulary-sharded head split, ``loss_parallel()``), Interleaved1F1B, clipping,
    accumulation and padded ``-100`` labels: as one process, within 1e-5."""
    phase = by_name(work, "sp_interleaved")
    counts = token_counts(phase, 4)
    assert len({len(b["input_ids"][0]) for b in zoo.loader(phase["model"], **phase["data"])}) > 1  # lengths change
    assert all(len(set(c)) > 1 for c in counts), counts  # equal weights per microbatch would be wrong
    got = four.ranks("sp_interleaved")
    want = reference(phase)
    worst = assert_same_training(got, want, atol=1e-5)
    print(f"sp_interleaved: largest difference {worst:.1e}")
    for r in got:  # every block, on every stage, was given its tensor rank's half of the sequence
        assert r["input_lengths"] == sorted(n // 2 for n in want["input_lengths"]), r["input_lengths"]
    whole = four.ranks("load_sp_pp2_dp2")  # the same pipeline ranks without tensor parallelism
    for split, replicated in zip((r["local_numel"] for r in got), (r["local_numel"] for r in whole)):
        # half of everything but the norms: the embedding and the head are split too (~0.54 if they were not)
        assert split < 0.51 * replicated, (split, replicated)


@pytest.mark.dist
def test_a_sequence_parallel_checkpoint_loads_without_tensor_parallelism_and_consolidates(four, work):
    saved = merged_state(four.ranks("sp_interleaved"))
    loaded = merged_state(four.ranks("load_sp_pp2_dp2"))
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    out = work / "sp_consolidated.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", str(work / "sp.ckpt"), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = torch.load(out, weights_only=True)["state_dict"]
    zoo.make("llama_sp").load_state_dict(state)
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)


@pytest.mark.dist
def test_a_tied_embedding_and_head_both_split_stay_tied(four, work):
    """The head's weight is the embedding's Parameter, split by both styles (RowwiseParallel, ColwiseParallel: Shard(0)
    both), on the two end stages: pp2 x tp2 trains as one process, and the two names hold the same values."""
    got = four.ranks("sp_tied")
    want = reference(by_name(work, "sp_tied"))
    assert want["tied"] == {"output.weight=tok_embeddings.weight": True}  # one Parameter on one device
    worst = assert_same_training(got, want, atol=1e-5)
    print(f"sp_tied: largest difference {worst:.1e}")
    merged = merged_state(got)
    assert torch.equal(merged["output.weight"], merged["tok_embeddings.weight"])


def test_plans_are_read_and_checked_with_the_fix():
    plan = block_plan({"w*": "colwise"}, zoo.make("llama_tp"))
    assert isinstance(plan["w*"], ColwiseParallel)
    with pytest.raises(ValueError, match="'colwise' and 'rowwise' by name"):
        block_plan({"wq": "sequence_parallel"}, zoo.make("llama_tp"))
    with pytest.raises(ValueError, match="sequence-parallel plans are not supported"):
        block_plan({"attention_norm": SequenceParallel()}, zoo.make("llama_tp"))
    with pytest.raises(ValueError, match="base_model_tp_plan"):
        block_plan("auto", zoo.make("llama_tp"))
    assert set(block_plan("auto", zoo.make("hf_llama"))) >= {"self_attn.q_proj", "mlp.down_proj"}
    block = zoo.LlamaBlock()
    with pytest.raises(ValueError, match="does not divide the 32 output features of `layers.0.wq`"):
        check_plan(block_plan({"wq": "colwise"}, zoo.make("llama_tp")), block, "layers.0", 3)
    blocks = [("layers.0", block)]
    with pytest.raises(ValueError, match="needs to know how to split each block"):
        choose_plan(None, [], 2, zoo.make("llama_tp"), blocks)
    with pytest.raises(ValueError, match="Keep one of them"):
        choose_plan(zoo.LLAMA_TP_PLAN, [(ColwiseParallel(), block.wq, None)], 2, zoo.make("llama_tp"), blocks)
    with pytest.raises(ValueError, match=r"tensor_parallel_plan=\.\.\.\)` needs `tensor_parallel_size` > 1"):
        validated_options(pipeline_parallel_size=2,
                          tensor_parallel_plan=zoo.LLAMA_TP_PLAN)


def test_a_size_that_does_not_divide_the_heads_is_refused():
    model = zoo.make("hf_llama")
    with pytest.raises(ValueError, match="does not divide the model's 2 num key value heads"):
        choose_plan("auto", [], 4, model, [("model.model.layers.0", model.model.model.layers[0])])


def test_what_configure_model_asks_for_is_checked_like_a_plan():
    model = zoo.make("llama_tp")
    blocks = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    # The modules outside the blocks and sequence parallelism are taken (each rank applies what lies in its stage)
    split = recorded_plan(
        [(ColwiseParallel(), model.output, None), (SequenceParallel(), model.layers[0].attention_norm, None)],
        model, blocks, 2,
    )
    assert split.outside is not None
    with pytest.raises(ValueError, match="which holds pipelined blocks"):
        recorded_plan([(SequenceParallel(), model, None)], model, blocks, 2)
    with pytest.raises(ValueError, match="without parameters"):
        recorded_plan([(SequenceParallel(), nn.Dropout(), None)], model, blocks, 2)
    with pytest.raises(ValueError, match="does not divide the 32 output features of `layers.1.wk`"):
        recorded_plan([(ColwiseParallel(), model.layers[1].wk, None)], model, blocks, 3)
    outside = nn.ModuleDict({"emb": nn.Embedding(10, 4)})
    with pytest.raises(ValueError, match="does not divide the 10 rows of `emb`"):
        recorded_plan([(RowwiseParallel(), outside.emb, None)], outside, blocks, 4)


@pytest.mark.dist
def test_a_tensor_parallel_model_is_whole_after_fit_and_saves_in_parallel(four, work):
    """pp2 x TP2: after `fit` the module is whole (`save_pretrained` on global zero), and the parallel save writes each
    tensor rank's shards; both load with nothing missing and equal one process's weights."""
    from test_pretrained import assert_close, loaded

    want = reference(by_name(work, "hf_llama_auto"))["state_dict"]
    want = {k[len("model."):]: v for k, v in want.items()}
    plain, parallel = loaded(work / "hf_llama_auto_hf" / "plain"), loaded(work / "hf_llama_auto_hf" / "parallel")
    assert_close(parallel, plain)
    worst = max((plain[k] - want[k]).abs().max().item() for k in plain)
    assert worst < 2e-4, worst  # AdamW, as the training comparison above
