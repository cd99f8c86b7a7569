"""Models as people bring them (tests/zoo.py), pipelined with only the strategy changed, against one device.

Two jobs run every case, one per process count (starting processes costs more than these small fits):

- two processes: Hugging Face Llama (1F1B; fit, validate and predict; saved), Hugging Face GPT-2 with its tied head
  (Interleaved1F1B; ModelSummary), nanoGPT with its tied head and the loss inside ``forward`` (ZBVZeroBubble: both
  ends on one rank; fit, validate, predict), a timm-style ViT (GPipe, activation checkpointing), a torchvision-style
  ResNet over ``layer1`` ... ``layer4`` (DualPipeV; fit and validate), a GPT whose blocks take rotary tables and a
  padding mask (InterleavedZeroBubble, balance="time"), a backbone reusing one block (1F1B), and nanoGPT built on
  the meta device; and models whose stage boundaries carry several tensors: Lightning's demo encoder-decoder
  language model (``backbone="auto"`` finds both stacks; fit, validate, predict), Hugging Face T5 on padded batches
  with ``-100`` targets (1F1B, saved; and InterleavedZeroBubble over 4 stages), BART (Interleaved1F1B, activation
  checkpointing), diffusers' Flux (1F1B with fit, validate, predict; ZBVZeroBubble), PixArt-alpha
  (InterleavedZeroBubble) and SD3 (its last block returns ``(None, hidden_states)``); and mixture-of-experts models
  with the load-balancing loss, whose router logits every block's hook records for the code after the backbone:
  Mixtral (1F1B), Qwen3-MoE (ZBVZeroBubble) and Qwen2-MoE (activation checkpointing); Hugging Face Mllama on images
  and text, its language layers of two classes (self- and cross-attention, the latter on the second stage only)
  named as the backbone (fit, validate, predict), and found by ``backbone="auto"`` with the vision layers before
  them (Interleaved1F1B); batches laid out other than a row per sample (tests/zoo_layouts.py): Qwen2-VL's images
  packed over the batch, LLaVA's one row of pixels per image (0 to 2 per row; ZBVZeroBubble), both generating with
  their images (greedy and beam search), a video model's frames
  folded into the batch, Hugging Face ``BatchEncoding`` batches;
- four processes: Llama and T5 resumed from the two-process checkpoints (another pipeline size), GPT-2, nanoGPT and
  Flux interleaved over 8 stages, the reused block over 4 (LoopedBFS), and the rotary GPT and T5 as 2 pipelines x 2
  replicas.

Every case compares the loss of every step and the final parameters with single-device training (SGD with
momentum, a per-step LR scheduler, gradient clipping and accumulation where noted): within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
import zoo_job
from helpers import merged_state, run_script

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
ATOL = 1e-5
RESNET = {"backbone": ["model.layer1", "model.layer2", "model.layer3", "model.layer4"]}
ACCUM = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
PADDED = {"kind": "padded", "n": 32, "batch_size": 8}  # lengths 3 to 16, padded per batch, -100 labels
T5 = ["model.encoder.block", "model.decoder.block"]
COMPILE = {"backend": "aot_eager"}
MLLAMA = "model.model.language_model.layers"
SMALL = {"n": 16, "batch_size": 8}  # two steps
# the load-balancing loss is a statistic of the rows it sees: computed per microbatch (2 rows), as under DDP or
# gradient accumulation; one device computes it per 2 rows too (zoo.HFMoE)
PER_MICROBATCH = {"model_kwargs": {"group": 2}}


def case(name: str, model: str, strategy: dict, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "strategy": strategy, "data": {"n": 32, "batch_size": 8}, **extra}


TWO = [
    case("llama", "hf_llama", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate", "predict"]),
    case("gpt2", "hf_gpt2", {"num_microbatches": 4, "schedule": "Interleaved1F1B"},
         trainer={"enable_model_summary": True}),
    case("nanogpt_v", "nanogpt", {"num_microbatches": 4, "schedule": "ZBVZeroBubble"}, trainer=ACCUM,
         fns=["fit", "validate", "predict"]),
    case("vit", "vit", {"num_microbatches": 2, "schedule": "GPipe", "activation_checkpointing": True}),
    case("resnet", "resnet", {"num_microbatches": 4, "schedule": "DualPipeV", **RESNET},
         trainer={"gradient_clip_val": 0.5}, fns=["fit", "validate"]),
    # backbone="auto" with four equally long containers that the forward runs one after the other: all of them
    case("resnet_auto", "resnet", {"num_microbatches": 4, "schedule": "Interleaved1F1B"},
         model_kwargs={"layers": [2, 2, 2, 2]}, trainer={"gradient_clip_val": 0.5}),
    case("rope", "rope", {"num_microbatches": 4, "schedule": "InterleavedZeroBubble", "balance": "time"}),
    case("albert", "albert", {"num_microbatches": 4}, fns=["fit", "predict"]),
    # compile=: every block compiled (aot_eager: Inductor's C++ builds would dominate CI's 2 cores), against eager
    case("llama_compiled", "hf_llama", {"num_microbatches": 4, "schedule": "Interleaved1F1B", "compile": COMPILE},
         trainer=ACCUM, fns=["fit", "validate"]),
    # compiled blocks under a schedule that splits the backward: Llama's linear layers' weight gradients wait for the
    # weight actions ([Note: deferred weight gradients]), and so do GPT-2's Conv1D layers; GPT-2's tied embedding and
    # head both on rank 0 (ZBV's first and last stage)
    case("llama_compiled_dualpipev", "hf_llama", {"num_microbatches": 4, "schedule": "DualPipeV", "compile": COMPILE},
         trainer=ACCUM),
    case("gpt2_compiled_zbv", "hf_gpt2", {"num_microbatches": 4, "schedule": "ZBVZeroBubble", "compile": COMPILE},
         trainer={"gradient_clip_val": 0.5}, data=SMALL),
    case("nanogpt_meta", "nanogpt", {"num_microbatches": 4}, meta_init=True),
    # several tensors cross each stage boundary (docs/models.md, "Encoder-decoders and diffusion transformers")
    case("demo_lm", "demo_lm", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate", "predict"]),
    case("t5", "t5", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate"], data=PADDED),
    case("t5_zb", "t5", {"num_microbatches": 4, "schedule": "InterleavedZeroBubble", "backbone": T5},
         model_kwargs={"layers": 4}, data=PADDED),
    case("bart", "bart", {"num_microbatches": 4, "schedule": "Interleaved1F1B", "activation_checkpointing": True},
         trainer=ACCUM, data=PADDED),
    case("flux", "flux", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate", "predict"]),
    case("flux_zbv", "flux", {"num_microbatches": 4, "schedule": "ZBVZeroBubble"}),
    case("pixart", "pixart", {"num_microbatches": 4, "schedule": "InterleavedZeroBubble"}, trainer=ACCUM),
    # diffusers' SD3: the last joint block returns `(None, hidden_states)`
    case("sd3", "sd3", {"num_microbatches": 4}, trainer={"gradient_clip_val": 0.5}, data=SMALL),
    # mixture of experts with the load-balancing loss: every block's router logits reach the last stage
    case("mixtral_aux", "mixtral_aux", {"num_microbatches": 4}, trainer={"gradient_clip_val": 0.5}, data=SMALL,
         reference=PER_MICROBATCH),
    case("qwen3_moe_aux", "qwen3_moe_aux", {"num_microbatches": 4, "schedule": "ZBVZeroBubble"}, data=SMALL,
         reference=PER_MICROBATCH),
    case("qwen2_moe_aux", "qwen2_moe_aux", {"num_microbatches": 4, "activation_checkpointing": True}, data=SMALL,
         reference=PER_MICROBATCH),
    # language layers of two classes, cross-attention on the second stage only; with "auto": the vision layers too
    case("mllama", "mllama", {"num_microbatches": 4, "backbone": MLLAMA}, trainer=ACCUM,
         fns=["fit", "validate", "predict"]),
    case("mllama_auto", "mllama", {"num_microbatches": 4, "schedule": "Interleaved1F1B"},
         trainer={"gradient_clip_val": 0.5}),
    # batches laid out other than a row per sample (tests/zoo_layouts.py): Qwen2-VL's images packed over the batch,
    # rows of 0 to 2 images of different sizes ("auto" takes the language layers, not the vision blocks' patches);
    # frames folded into the batch before the blocks; Hugging Face's `BatchEncoding` batches
    case("qwen2_vl", "qwen2_vl", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate", "predict"]),
    case("llava", "llava", {"num_microbatches": 4, "schedule": "ZBVZeroBubble"}, trainer=ACCUM,
         fns=["fit", "validate", "predict"]),
    case("frames", "frames", {"num_microbatches": 4, "schedule": "Interleaved1F1B"}, fns=["fit", "validate"]),
    case("hf_llama_encoding", "hf_llama_encoding", {"num_microbatches": 4}, trainer=ACCUM, fns=["fit", "validate"]),
]
FOUR = [
    case("llama_resumed", "hf_llama", {"num_microbatches": 4}, trainer={"max_epochs": 2, **ACCUM}),
    case("gpt2_8", "hf_gpt2", {"num_microbatches": 8, "schedule": "Interleaved1F1B"}, model_kwargs={"layers": 8}),
    case("nanogpt_8", "nanogpt", {"num_microbatches": 8, "schedule": "Interleaved1F1B"}, model_kwargs={"layers": 8}),
    case("albert_8", "albert", {"num_microbatches": 4, "schedule": "LoopedBFS"}, model_kwargs={"layers": 8}),
    case("rope_dp", "rope", {"num_microbatches": 4, "pipeline_parallel_size": 2}, trainer=ACCUM),
    case("t5_resumed", "t5", {"num_microbatches": 4}, trainer={"max_epochs": 2, **ACCUM}, data=PADDED,
         fns=["fit", "validate"]),
    case("flux_8", "flux", {"num_microbatches": 4, "schedule": "Interleaved1F1B"},
         model_kwargs={"layers": 4, "single_layers": 4}),
    case("t5_dp", "t5", {"num_microbatches": 4, "pipeline_parallel_size": 2}, trainer=ACCUM, data=PADDED),
    case("flux_fsdp", "flux", {"num_microbatches": 4, "pipeline_parallel_size": 2, "data_parallel": "fsdp"},
         trainer=ACCUM),
]


def launch(work: Path, name: str, devices: int, phases: list[dict], timeout: float = 400) -> Path:
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"devices": devices, "phases": phases}))
    out = work / name
    proc = run_script([str(HERE / "zoo_job.py"), str(spec), str(out)], cwd=work, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return out


def ranks(out: Path, name: str, devices: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def two(work) -> Path:
    phases = [dict(p) for p in TWO]
    phases[0]["save"] = str(work / "llama.ckpt")
    phases[1]["save"] = str(work / "gpt2.ckpt")
    phases[[p["name"] for p in TWO].index("t5")]["save"] = str(work / "t5.ckpt")
    return launch(work, "two", 2, phases)


@pytest.fixture(scope="module")
def four(work, two) -> Path:
    phases = [dict(p) for p in FOUR]
    phases[0]["ckpt_path"] = str(work / "llama.ckpt")
    phases[[p["name"] for p in FOUR].index("t5_resumed")]["ckpt_path"] = str(work / "t5.ckpt")
    return launch(work, "four", 4, phases)


def reference(phase: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return zoo_job.run_phase({**phase, "strategy": None, **changes}, 1)


def assert_same_training(
    got: list[dict[str, Any]], want: dict[str, Any], first_step: int = 0, atol: float = ATOL
) -> float:
    """Every rank logged the reference's losses (from ``first_step``) and the union of the ranks' final weights is
    the reference's, within ``atol``; returns the largest difference."""
    worst = 0.0
    for r in got:
        losses = [s["train_loss"] for s in r["steps"]]
        expected = [s["train_loss"] for s in want["steps"]][first_step:]
        assert len(losses) == len(expected), (len(losses), len(expected))
        diffs = [abs(a - b) for a, b in zip(losses, expected)]
        assert max(diffs) < atol, f"rank {r['rank']}: losses differ by up to {max(diffs):.2e}"
        assert [s["lr"] for s in r["steps"]] == pytest.approx([s["lr"] for s in want["steps"]][first_step:])
        worst = max(worst, *diffs)
    merged = merged_state(got)
    assert set(merged) == set(want["state_dict"]), set(merged) ^ set(want["state_dict"])
    params = max((merged[k].float() - want["state_dict"][k].float()).abs().max().item() for k in merged)
    assert params < atol, f"final parameters differ by up to {params:.2e}"
    moved = max((want["state_dict"][k].float() - want["initial"][k].float()).abs().max().item() for k in merged)
    assert moved > 100 * atol, "the parameters barely moved: the comparison would prove nothing"
    return max(worst, params)


@pytest.mark.parametrize("index", range(len(TWO)), ids=[p["name"] for p in TWO])
def test_two_processes_train_like_one_device(two, index):
    phase = TWO[index]
    got = ranks(two, phase["name"], 2)
    want = reference(phase, **phase.get("reference", {}))
    if phase.get("meta_init"):  # built on meta: the same weights as the whole model materialised the same way
        initial = merged_state(got, "initial")
        assert set(initial) == set(want["initial"])
        assert all(torch.equal(initial[k], v) for k, v in want["initial"].items())
    worst = assert_same_training(got, want)
    print(f"{phase['name']}: largest difference {worst:.1e}")
    for r in got:  # each rank held its own part only while training, and is whole after the call
        assert len(r["initial"]) < len(want["initial"])
        assert set(r["state_dict"]) == set(want["state_dict"])
    if "validate" in phase.get("fns", []):
        for r in got:
            assert r["validated"][0]["val_loss"] == pytest.approx(want["validated"][0]["val_loss"], abs=ATOL)
    if "predict" in phase.get("fns", []):
        for r in got:  # token ids equal; a diffusion model's predicted velocity within the tolerance
            assert all(
                torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, atol=ATOL, rtol=0)
                for a, b in zip(r["predictions"], want["predictions"])
            )


def test_auto_pipelines_mllamas_language_layers_of_two_classes(two):
    """``backbone="auto"`` takes the language layers (self- and cross-attention classes mixed) with the vision
    layers the step runs before them: 2 + 4 blocks, not the 2 vision layers alone."""
    for r in ranks(two, "mllama_auto", 2):
        assert r["layout"][-1][1] == 6, r["layout"]


def test_auto_leaves_qwen2_vls_vision_blocks_before_the_backbone(two):
    """Qwen2-VL's vision blocks see the batch's image patches, its language layers the batch's rows: a pipeline cuts
    every stage by the same rows, so ``backbone="auto"`` takes the 4 language layers, not 2 + 4 blocks, and the vision
    tower runs before the backbone, on each microbatch's own images."""
    for r in ranks(two, "qwen2_vl", 2):
        assert r["layout"][-1][1] == 4, r["layout"]


def test_auto_leaves_llavas_vision_tower_before_the_backbone(two):
    """LLaVA's projector reads the vision layers' hidden states, which Hugging Face records with hooks on those
    layers: a stage that skips them would record nothing, so ``backbone="auto"`` takes the 4 language layers."""
    for r in ranks(two, "llava", 2):
        assert r["layout"][-1][1] == 4, r["layout"]


def test_microbatches_hold_their_share_of_folded_rows(two):
    """Frames folded into the batch (8 videos of 3 frames: 24 rows): each of the 4 microbatches' blocks compute on 2
    videos' 6 rows, not on the whole batch ([Note: rows folded into the batch])."""
    want = reference(TWO[[p["name"] for p in TWO].index("frames")])
    assert want["input_lengths"] == [24]
    for r in ranks(two, "frames", 2):
        assert r["input_lengths"] == [6]


@pytest.mark.parametrize("index", range(len(FOUR)), ids=[p["name"] for p in FOUR])
def test_four_processes_train_like_one_device(four, index):
    phase = FOUR[index]
    got = ranks(four, phase["name"], 4)
    if phase["name"] in ("llama_resumed", "t5_resumed"):  # saved by two processes after one epoch, resumed by four
        want = reference(phase)
        assert all(r["global_step"] == want["global_step"] for r in got)
        assert_same_training(got, want, first_step=len(want["steps"]) // 2)
        return
    want = reference(phase)
    if phase["strategy"].get("pipeline_parallel_size") == 2:  # 2 replicas, each fed the whole batch: as one device
        for replica in (got[:2], got[2:]):
            assert_same_training(replica, want)
        return
    assert_same_training(got, want)


def test_tied_weights_stay_tied_and_are_stored_once(two, work):
    """GPT-2's and nanoGPT's heads are tied to the token embedding: both ends hold it, with identical values after
    training, and a checkpoint stores it once; consolidated, it loads into the original model with both names."""
    got = ranks(two, "nanogpt_v", 2)
    # ZBV puts the first and the last stage on rank 0: it holds both names of the one tensor
    assert got[0]["tied"] == {"model.lm_head.weight=model.transformer.wte.weight": True}
    got = ranks(two, "gpt2", 2)
    first, last = got[0]["state_dict"], got[1]["state_dict"]
    assert "model.transformer.wte.weight" in first and "model.lm_head.weight" in last
    assert torch.equal(first["model.transformer.wte.weight"], last["model.lm_head.weight"])
    stored = _dcp_keys(work / "gpt2.ckpt")
    assert "state_dict.model.transformer.wte.weight" in stored and "state_dict.model.lm_head.weight" not in stored
    assert not any(k.startswith("optimizer_0.state.model.lm_head.weight") for k in stored)
    from lightning_pipe.checkpoint import consolidated_checkpoint

    state = consolidated_checkpoint(work / "gpt2.ckpt")["state_dict"]
    assert state["model.lm_head.weight"] is state["model.transformer.wte.weight"]  # one tensor, as on one device
    hf = zoo.make("hf_gpt2").model
    hf.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)


def test_model_summary_counts_the_whole_model(two):
    """ModelSummary reports the whole model's parameters on every rank, not rank 0's stages."""
    got = ranks(two, "gpt2", 2)
    whole = sum(p.numel() for p in zoo.make("hf_gpt2").parameters())
    assert [r["summary_total"] for r in got] == [whole, whole]


def _dcp_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def test_checkpoint_names_are_the_models_own_and_consolidate(two, work):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pipe.checkpoint import consolidated_checkpoint

    checkpoint = consolidated_checkpoint(work / "llama.ckpt")
    trained = merged_state(ranks(two, "llama", 2))
    state = checkpoint["state_dict"]
    assert list(state) == list(zoo.make("hf_llama").state_dict())  # single-device names and order
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    config = LlamaConfig(
        vocab_size=zoo.VOCAB, hidden_size=zoo.DIM, intermediate_size=2 * zoo.DIM, num_hidden_layers=4,
        num_attention_heads=zoo.HEADS, num_key_value_heads=2, max_position_embeddings=64,
    )
    hf = LlamaForCausalLM(config)
    hf.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)


def test_t5_checkpoint_stores_the_shared_embedding_once_and_consolidates(two, work):
    """T5's embedding is held by three stages (encoder embedding, decoder embedding, tied head) on two ranks: the
    checkpoint stores it once, and consolidated it loads into ``T5ForConditionalGeneration`` with every name."""
    from lightning_pipe.checkpoint import consolidated_checkpoint

    stored = _dcp_keys(work / "t5.ckpt")
    assert "state_dict.model.shared.weight" in stored
    assert not any(k.startswith("state_dict.") and k.endswith("embed_tokens.weight") for k in stored)
    state = consolidated_checkpoint(work / "t5.ckpt")["state_dict"]
    trained = merged_state(ranks(two, "t5", 2))
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    hf = zoo.make("t5").model
    hf.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    assert torch.equal(hf.lm_head.weight, state["model.shared.weight"])  # the trained, tied values
