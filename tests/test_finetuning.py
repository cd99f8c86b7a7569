"""Fine-tuning data as people have it, pipelined, against one device: padded batches whose length changes from batch
to batch, ``-100`` labels on the padding and on masked prompts, a microbatch without a single label, and a
hand-written loss divided by ``mask.sum()`` ([Note: token-weighted losses] in ``lightning_pipe/_loss_weights.py``).

One two-process launch runs every case (starting processes costs more than these small fits), one four-process
launch runs pipeline x data parallel; every case compares the loss of every step, the loss returned to Lightning and
the final parameters with single-device training of the same module on the same batches (SGD with momentum, a
per-step LR scheduler, gradient clipping and accumulation): within 1e-5 (1e-4 with AdamW). The in-process tests at
the end check what the observer counts on single calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from helpers import merged_state, run_script
from test_models import assert_same_training, ranks, reference

from lightning_pipe._step.loss_weights import LossWeighing

HERE = Path(__file__).resolve().parent
ACCUM = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}


def case(name: str, model: str, strategy: dict, kind: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "strategy": strategy, "data": {"n": 32, "batch_size": 8, "kind": kind},
            "trainer": ACCUM, **extra}


TWO = [
    case("gpt2_padded", "hf_gpt2_ft", {"num_microbatches": 4}, "padded", fns=["fit", "validate"]),
    case("llama_prompt", "hf_llama_ft", {"num_microbatches": 4, "schedule": "Interleaved1F1B"}, "prompt",
         fns=["fit", "validate"]),
    case("gpt2_prompt_zbv", "hf_gpt2_ft", {"num_microbatches": 4, "schedule": "ZBVZeroBubble"}, "prompt"),
    case("llama_padded_adamw", "hf_llama_ft", {"num_microbatches": 4}, "padded",
         model_kwargs={"optimizer": "adamw", "lr": 2e-2}),
    case("masked_num_items", "masked", {"num_microbatches": 4}, "prompt"),
    case("masked_unweighted", "masked", {"num_microbatches": 4}, "padded", model_kwargs={"num_items": False}),
]
FOUR = [
    case("gpt2_padded_dp", "hf_gpt2_ft", {"num_microbatches": 2, "pipeline_parallel_size": 2}, "padded"),
]


def launch(work: Path, name: str, devices: int, phases: list[dict]) -> tuple[Path, str]:
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"devices": devices, "phases": phases}))
    out = work / name
    proc = run_script([str(HERE / "zoo_job.py"), str(spec), str(out)], cwd=work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetuning")


@pytest.fixture(scope="module")
def two(work) -> tuple[Path, str]:
    return launch(work, "two", 2, TWO)


@pytest.fixture(scope="module")
def four(work) -> tuple[Path, str]:
    return launch(work, "four", 4, FOUR)


@pytest.mark.dist
@pytest.mark.parametrize("index", range(len(TWO) - 1), ids=[p["name"] for p in TWO[:-1]])
def test_token_weighted_losses_train_like_one_device(two, index):
    phase = TWO[index]
    got = ranks(two[0], phase["name"], 2)
    want = reference(phase)
    atol = 1e-4 if phase.get("model_kwargs", {}).get("optimizer") == "adamw" else 1e-5
    worst = assert_same_training(got, want, atol=atol)
    for r in got:  # the loss handed to Lightning is the full batch's, on every rank
        returned = [s["returned_loss"] for s in r["steps"]]
        assert returned == pytest.approx([s["returned_loss"] for s in want["steps"]], abs=atol)
    print(f"{phase['name']}: largest difference {worst:.1e}")
    if "validate" in phase.get("fns", []):
        for r in got:
            assert r["validated"][0]["val_loss"] == pytest.approx(want["validated"][0]["val_loss"], abs=1e-5)


def test_the_data_really_needs_token_weights():
    """Without the weights the same fits differ from one device: the cases above prove something."""
    phase = TWO[0]
    loader = zoo.loader(phase["model"], **phase["data"])
    module = zoo.make(phase["model"])
    batch = next(iter(loader))
    quarters = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    equal = torch.stack([module.loss(q) for q in quarters]).mean()
    assert abs(float(equal) - float(module.loss(batch))) > 1e-3
    assert len({tuple(b["input_ids"].shape) for b in loader}) > 1, "every batch has its own length"


@pytest.mark.dist
def test_a_loss_it_cannot_weight_warns_once_with_the_spread(two):
    phase = TWO[-1]
    out, stdout = two
    warned = [line for line in stdout.splitlines() if "averages over a count that depends on the data" in line]
    assert len(warned) == 1, stdout[-4000:]  # once, from the last stage, at the first step
    assert "divides by a count summed from a mask" in warned[0] and "ranges from" in warned[0]
    assert "num_items" in warned[0]
    got = merged_state(ranks(out, phase["name"], 2))
    want = reference(phase)["state_dict"]
    assert max((got[k] - want[k]).abs().max().item() for k in got) > 1e-4  # and it is not exact: rightly warned


@pytest.mark.dist
def test_replicas_weight_their_own_tokens_as_ddp_does(four):
    """pp2 x dp2, each replica fed the whole batch (no sampler): each normalises by its own count, as DDP does,
    and the average over replicas is the one-device gradient."""
    phase = FOUR[0]
    got = ranks(four[0], phase["name"], 4)
    want = reference(phase)
    for replica in (got[:2], got[2:]):
        assert_same_training(replica, want)


# ---------------------------------------------------------------------------------------------------- in process
def _weigh(step, *args) -> LossWeighing:
    weighing = LossWeighing(1)
    with weighing.observing() as observer:
        result = step(*args)
    loss = result["loss"] if isinstance(result, dict) else result
    weighing.add(result, loss, observer)
    return weighing


def test_counts_what_cross_entropy_divides_by():
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, -100, 2, 3, -100, 1])
    weighing = _weigh(lambda: F.cross_entropy(logits, target))
    assert weighing.source == "cross_entropy" and float(weighing.weights[0]) == 4
    class_weight = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    weighted = torch.nn.CrossEntropyLoss(weight=class_weight, ignore_index=3)
    weighing = _weigh(lambda: weighted(logits, target.clamp(min=0)))
    assert float(weighing.weights[0]) == pytest.approx(float(class_weight[[0, 0, 2, 0, 1]].sum()))
    weighing = _weigh(lambda: F.nll_loss(logits.log_softmax(-1), target, reduction="sum"))
    assert weighing.source == "rows" and not weighing.unweighted  # a sum needs no weight


def test_explicit_counts_and_what_is_refused():
    loss = torch.tensor(2.0, requires_grad=True)
    weighing = _weigh(lambda: {"loss": loss, "num_items": torch.tensor(7)})
    assert weighing.source == "num_items" and float(weighing.weights[0]) == 7
    for bad in (-1, float("nan"), torch.ones(2), "7"):
        with pytest.raises(ValueError, match="num_items"):
            _weigh(lambda bad=bad: {"loss": loss, "num_items": bad})


def test_finds_means_it_cannot_weight_only_where_they_feed_the_loss():
    per_token = torch.randn(4, 6, requires_grad=True)
    mask = torch.rand(4, 6) > 0.3
    assert _weigh(lambda: (per_token * mask).sum() / mask.sum()).unweighted  # divided by mask.sum()
    assert _weigh(lambda: (per_token * mask).sum() / mask.float().sum().clamp(min=1)).unweighted
    assert _weigh(lambda: per_token[mask].mean()).unweighted  # the mean of the selected elements
    logits, target = torch.randn(6, 5, requires_grad=True), torch.tensor([0, -100, 2, 3, -100, 1])
    assert _weigh(lambda: F.cross_entropy(logits, target) + per_token.mean()).unweighted  # a part of the loss

    def logs_a_masked_accuracy_aside():
        with torch.no_grad():
            accuracy = per_token[mask].mean()  # not part of the loss
        return per_token.mean() + 0 * accuracy.detach()

    assert not _weigh(logs_a_masked_accuracy_aside).unweighted
    assert not _weigh(lambda: per_token.mean()).unweighted


def test_weights_the_gradient_like_one_mean_over_the_batch():
    """Two microbatches with 1 and 3 targets: the weighted gradient is the whole batch's mean, not the mean of
    the two means."""
    logits = torch.randn(4, 5, requires_grad=True)
    target = torch.tensor([0, -100, 2, 3])
    expected = torch.autograd.grad(F.cross_entropy(logits, target), logits)[0]
    weighing = LossWeighing(2)
    contributions = []
    for rows in (slice(0, 2), slice(2, 4)):
        with weighing.observing() as observer:
            loss = F.cross_entropy(logits[rows], target[rows])
        _, factor = weighing.add(loss, loss, observer)
        contributions.append(loss * factor / 2)
    grad = torch.autograd.grad(sum(contributions), logits)[0]
    full, scale = weighing.result()
    assert torch.allclose(grad * scale, expected, atol=1e-7)
    assert float(full) == pytest.approx(float(F.cross_entropy(logits, target)), abs=1e-6)



def test_hugging_face_masked_lm_loss_is_weighted_by_its_masked_tokens():
    """A BERT-style masked-LM loss (labels -100 everywhere but the masked positions) is a mean-reduced cross-entropy
    returned as ``outputs.loss``: weighted automatically by the masked tokens it averages over."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=zoo.VOCAB, hidden_size=zoo.DIM, num_hidden_layers=2, num_attention_heads=zoo.HEADS,
                        intermediate_size=2 * zoo.DIM, max_position_embeddings=64)
    model = BertForMaskedLM(config)
    input_ids = torch.randint(1, zoo.VOCAB, (3, 10))
    labels = torch.full_like(input_ids, -100)
    labels[0, [1, 4]] = input_ids[0, [1, 4]]
    labels[2, 7] = input_ids[2, 7]
    weighing = _weigh(lambda: model(input_ids=input_ids, labels=labels).loss)
    assert weighing.source == "cross_entropy" and float(weighing.weights[0]) == 3
