"""Generation through the pipeline ([Note: lock step] in ``lightning_pipe/_step/generation.py``) against one device.

One four-process launch runs every case, pp4 and pp2 x dp2 (starting processes costs more than these small fits);
each case fine-tunes on padded batches with ``-100`` labels (two SGD steps, clipping), and validates at the end of
the epoch with a ``validation_step`` that computes the loss and then generates 16 tokens from left-padded prompts
of different lengths (tests/generation_models.py); T5 and Bart cases generate from the prompt as the encoder's
input (issue 36). Every case compares, on every rank, the generated token ids with
the single-device run's (exactly), the metrics computed from the generated text and the training losses (within
1e-5). The caches: each rank's microbatch caches held its own stages' layers only, no longer than prompt plus new
tokens, and none is alive after the run. Issue 36: beam search as the step's first model call
(unpadded 8-token prompts, before the loss), and a step that fails on the last stage in a single pass.
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
    case("litgpt_sample_pp4", "litgpt", PP4, model_kwargs={"sample": True}),
    # predict first: the setup learns the structure from a step that generates (it stops at the second call)
    case("nanogpt_predict_only_pp2", "nano", PP2, model_kwargs={"sample": True}, fns=["predict"]),
    case("llama_greedy_fsdp", "lm", {**PP2, "data_parallel": "fsdp"},
         model_kwargs={"family": "llama", "decode": "greedy"}),
    # issue 36: beam search as the step's first model call (8 unpadded prompts of 8 tokens: 16 rows), during fit
    case("llama_beam_first_pp2", "lm", PP2, model_kwargs={"family": "llama", "decode": "beam", "generate_first": True}),
    case("gpt2_beam_first_pp2", "lm", PP2, model_kwargs={"family": "gpt2", "decode": "beam", "generate_first": True}),
    case("llama_beam_tp", "lm", {**PP2, "tensor_parallel_size": 2, "tensor_parallel_plan": "auto"},
         model_kwargs={"family": "llama", "decode": "beam"}),
    # issue 36: an encoder-decoder ([Note: partial passes]), 3 + 3 blocks on 4 stages: stage 1 holds the encoder's
    # last block and the decoder's first, so it computes the encoder's output (its final norm runs where the decoder
    # starts) and is not the last; the decoder's position bias crosses stages 1 to 3; beams reorder both caches.
    case("t5_beam_pp4", "lm", PP4, model_kwargs={"family": "t5", "decode": "beam", "layers": 6}),
]
ERRORS = [
    case("static_cache", "lm", PP2, model_kwargs={"family": "llama", "decode": "static"}, expect_error=True),
    case("inline_loop", "nano", PP4, model_kwargs={"inline": True}, expect_error=True),
    case("head_fails", "nano", PP4, model_kwargs={"fail_after": 5}, expect_error=True),
    # the step fails on the last stage in the first validation batch, before it is known to generate (one pass)
    case("step_fails_at_once", "nano", PP4, model_kwargs={"fail_at_once": True}, expect_error=True),
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
    fitted = "fit" in spec.get("fns", ["fit"])
    assert len(ref["generated"]) == 2 * fitted and all(g.shape[1] == 16 for g in ref["generated"])
    for r in results(launched, spec["name"]):
        assert len(r["generated"]) == len(ref["generated"])
        for mine, theirs in zip(r["generated"], ref["generated"]):
            assert torch.equal(mine, theirs), f"rank {r['rank']}:\n{mine}\n{theirs}"
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        for key in ("val_loss", "val_mean_loss", "val_cer", "val_first_token"):
            if key in ref["callback_metrics"]:
                assert r["callback_metrics"][key] == pytest.approx(ref["callback_metrics"][key], abs=1e-5), key
        if ref["predictions"] is not None:
            assert len(r["predictions"]) == len(ref["predictions"]) == 2
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


@pytest.mark.dist
def test_a_loop_that_runs_the_blocks_itself_fails_on_every_rank(launched: Path) -> None:
    for r in range(4):
        found = torch.load(launched / f"inline_loop.rank{r}.pt", weights_only=False)
        assert found["error"] is not None and "must call the model" in found["error"], found["error"]


# ----------------------------------------------------------------------------------------------------- in process
def _filled_views(rows: list[tuple[int, int]], length: int) -> tuple[Any, Any]:
    """A user's DynamicCache of 2 layers split over ``rows``; this rank runs layer 0 and fills ``length`` positions of
    it per microbatch (row ``i`` holds the value ``i``)."""
    from transformers import DynamicCache

    from lightning_pipe._step.caches import PassCaches

    caches = PassCaches(num_layers=2)
    user = DynamicCache()
    for start, stop in rows:
        view = caches.for_rows(user, start, stop, probing=None)
        keys = torch.arange(start, stop, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 2, length, 4).clone()
        view.update(keys, keys + 100, 0)
    caches.mirror()
    return caches, user


def test_caches_hold_their_rows_and_answer_like_one_cache() -> None:
    from lightning_pipe._ghost import Ghost

    caches, user = _filled_views([(0, 2), (2, 4)], length=5)
    subs = caches.live
    assert len(subs) == 2
    for sub in subs:  # layer 0 is this rank's, layer 1 another stage's: a ghost of the same shape
        assert type(sub.layers[0].keys) is torch.Tensor and isinstance(sub.layers[1].keys, Ghost)
        assert sub.get_seq_length() == 5 and sub.layers[1].get_seq_length() == 5
    assert all(isinstance(layer.keys, Ghost) for layer in user.layers)  # the user's holds no memory
    assert user.get_seq_length() == 5 and tuple(user.layers[0].keys.shape) == (4, 2, 5, 4)
    assert user.get_mask_sizes(torch.arange(1), 0) == subs[0].get_mask_sizes(torch.arange(1), 0)


def test_a_pass_reads_the_cache_as_it_started() -> None:
    """With several stages per rank, a later stage's code before its layers must not see what an earlier stage of
    the same rank appended in this pass."""
    caches, user = _filled_views([(0, 2)], length=5)
    caches.begin_pass()
    first = caches.for_rows(user, 0, 2, probing=None)
    first.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), 0)  # stage 0 appends its new token
    later = caches.for_rows(user, 0, 2, probing=None)
    assert later.get_seq_length() == 5 and caches.live[0].get_seq_length() == 6


def test_beam_reorder_moves_rows_between_microbatches() -> None:
    caches, user = _filled_views([(0, 2), (2, 4)], length=3)
    user.reorder_cache(torch.tensor([3, 0, 0, 2]))
    rows = torch.cat([sub.layers[0].keys[:, 0, 0, 0] for sub in caches.live])
    assert rows.tolist() == [3.0, 0.0, 0.0, 2.0]
    values = torch.cat([sub.layers[0].values[:, 0, 0, 0] for sub in caches.live])
    assert values.tolist() == [103.0, 100.0, 100.0, 102.0]
    for sub in caches.live:  # an entry that holds no rows yet (Unlimited OCR's sliding keys during the prompt)
        sub.layers[0].window_keys = torch.tensor([])
    user.reorder_cache(torch.tensor([1, 1, 2, 3]))
    assert torch.cat([sub.layers[0].keys[:, 0, 0, 0] for sub in caches.live]).tolist() == [0.0, 0.0, 0.0, 2.0]


def test_a_partial_pass_carries_what_its_call_produces_to_its_answer_stage() -> None:
    """[Note: partial passes] on T5's flow, 3 + 3 blocks on 4 stages: the encoder's call is answered on stage 1 (the
    encoder's final norm runs where the decoder starts); the decoder's calls carry its position bias, and not the
    encoder's output, which they are given."""
    from types import SimpleNamespace

    from lightning_pipe._calls.flow import make_pass_flow
    from lightning_pipe.partition import StageLayout

    norm = ("module", "model.encoder.final_layer_norm", 0, 0)
    values = {  # producer -> (position, uses); block j is at 2j + 1, the code before block j at 2j
        ("block", 0, 0, 1): (1, {3, 5}),  # the encoder's position bias
        ("block", 1, 0, 0): (3, {5}),
        ("block", 2, 0, 0): (5, {6}),  # the encoder's last hidden state, read by its final norm
        norm: (6, {7, 9, 11}),  # the encoder's output, read by every decoder block
        ("block", 3, 0, 0): (7, {9}),
        ("block", 3, 0, 1): (7, {9, 11}),  # the decoder's position bias
        ("block", 4, 0, 0): (9, {11}),
        ("block", 5, 0, 0): (11, {12}),  # read by the head
    }
    structure = SimpleNamespace(values=values)
    layout = StageLayout(((0, 2), (2, 4), (4, 5), (5, 6)), 4)
    names = [f"b{i}" for i in range(6)]
    encoder = make_pass_flow(structure, layout, names, range(0, 3), {("block", j, 0) for j in range(3)} | {norm[:3]})
    assert encoder.answer_stage == 1 and encoder.answers == (("block", 2, 0, 0),)
    assert encoder.sends[0] == (("block", 0, 0, 1), ("block", 1, 0, 0)) and encoder.sends[2:] == ((), ())
    decoder = make_pass_flow(structure, layout, names, range(3, 6), {("block", j, 0) for j in range(3, 6)})
    assert decoder.answer_stage == 3 and decoder.answers == (("block", 5, 0, 0),)
    assert decoder.sends[:3] == ((), (("block", 3, 0, 0), ("block", 3, 0, 1)), (("block", 3, 0, 1), ("block", 4, 0, 0)))


def test_encoder_decoder_caches_split_both_parts_and_reorder_them() -> None:
    """An ``EncoderDecoderCache``: each microbatch gets its own self- and cross-attention caches and ``is_updated``
    flags; beam search reorders the rows of both."""
    from transformers import DynamicCache, EncoderDecoderCache

    from lightning_pipe._ghost import Ghost
    from lightning_pipe._step.caches import PassCaches

    caches = PassCaches(num_layers=2)
    user = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for start, stop in [(0, 2), (2, 4)]:
        view = caches.for_rows(user, start, stop, probing=None)
        keys = torch.arange(start, stop, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 2, 3, 4).clone()
        view.self_attention_cache.update(keys, keys + 100, 0)
        view.cross_attention_cache.update(keys + 10, keys, 0)
        view.is_updated[0] = True
    caches.mirror()
    subs = caches.live
    assert all(sub.is_updated[0] for sub in subs) and not user.is_updated.get(0)
    assert isinstance(subs[0].self_attention_cache.layers[1].keys, Ghost)
    assert user.get_seq_length() == 3 and tuple(user.cross_attention_cache.layers[0].keys.shape) == (4, 2, 3, 4)
    user.reorder_cache(torch.tensor([3, 0, 0, 2]))
    for part, plus in (("self_attention_cache", 0.0), ("cross_attention_cache", 10.0)):
        rows = torch.cat([getattr(sub, part).layers[0].keys[:, 0, 0, 0] for sub in caches.live])
        assert rows.tolist() == [3.0 + plus, plus, plus, 2.0 + plus]
    caches.release()


def test_what_cannot_split_is_refused_and_release_frees() -> None:
    import weakref

    from transformers import DynamicCache

    from lightning_pipe import BackboneCallError
    from lightning_pipe._step.caches import PassCaches

    caches, user = _filled_views([(0, 2), (2, 4)], length=3)
    with pytest.raises(BackboneCallError, match="crop"):
        user.crop(1)
    refs = [weakref.ref(sub) for sub in caches.live]
    caches.release()
    assert caches.live == [] and all(r() is None for r in refs)
    assert "crop" not in vars(user)  # the user's cache is its own again
    filled = DynamicCache()
    filled.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4), 0)
    with pytest.raises(BackboneCallError, match="already holds tokens"):
        PassCaches(num_layers=2).for_rows(filled, 0, 1, probing=None)


def test_block_states_are_cut_by_rows_and_other_stages_freed() -> None:
    """litgpt's per-block caches (buffers made after setup, sized by the batch): a microbatch writes its own rows of
    this rank's blocks' buffers; the other blocks' become ghosts."""
    from generation_models import LitBlock

    from lightning_pipe._ghost import Ghost
    from lightning_pipe._step.caches import BlockStates

    mine, other = LitBlock(), LitBlock()
    states = BlockStates([mine], [other], [*mine.buffers(), *other.buffers()])
    for block in (mine, other):
        block.attn.kv_cache = block.attn.build_kv_cache(4, 8)
    whole = mine.attn.kv_cache.k
    states.begin(batch_size=4)
    assert isinstance(other.attn.kv_cache.k, Ghost)
    states.rows(2, 4)
    k = torch.ones(2, 4, 1, 8)
    mine.attn.kv_cache(torch.tensor([3]), k, k)  # writes "its first 2 rows": rows 2 and 3 of the whole
    states.end()
    assert mine.attn.kv_cache.k is whole
    assert whole[2:, :, 3].eq(1).all() and whole[:2].eq(0).all()


def test_state_a_block_keeps_in_attributes_is_kept_per_microbatch() -> None:
    """[Note: attribute states per microbatch]: RecurrentGemma's recurrent block makes its state at the first call of
    a batch and replaces it at each call; each microbatch continues its own rows, a shape probe changes nothing, and
    the pass leaves the whole batch's state, as one device does."""
    from lightning_pipe._ghost import ghost_of
    from lightning_pipe._step.attribute_states import AttributeStates

    class Recurrent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.state: Any = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.state is None or self.state.shape[0] != x.shape[0]:
                self.state = torch.zeros_like(x)
            self.state = self.state * 0.5 + x
            return self.state

    inputs = [torch.arange(4.0).view(4, 1), torch.ones(4, 1)]
    whole = Recurrent()
    expected = [whole(x) for x in inputs]
    split = Recurrent()
    states = AttributeStates([split])
    for x, out in zip(inputs, expected):
        states.begin(batch_size=4)
        states.rows(0, 2, probing="ghost")
        split(ghost_of(x[:2]))  # a shape probe: it leaves a ghost, dropped
        parts = []
        for start in (0, 2):
            states.rows(start, start + 2)
            parts.append(split(x[start:start + 2]))
        states.end()
        assert torch.equal(torch.cat(parts), out)
    assert torch.equal(split.state, whole.state)


def test_a_pass_given_back_what_stages_computed_in_parts_is_refused() -> None:
    """XLNet's ``mems`` (per-layer memories, which ``generate()`` passes back): each stage computed its own layers',
    so the answer holds ghosts; the next pass refuses on every rank. A cache object is the pipeline's to split."""
    from transformers import DynamicCache

    from lightning_pipe import BackboneCallError
    from lightning_pipe._ghost import ghost_of
    from lightning_pipe._step.pass_inputs import check_no_ghosts as _check_no_ghosts

    def forward(input_ids: torch.Tensor, mems: Any = None, past_key_values: Any = None) -> None: ...

    module = torch.nn.Module()
    module.forward = forward
    cache = DynamicCache()
    cache.update(ghost_of(torch.zeros(2, 2, 3, 4)), ghost_of(torch.zeros(2, 2, 3, 4)), 0)
    _check_no_ghosts(module, (torch.zeros(2, 3),), {"past_key_values": cache})
    with pytest.raises(BackboneCallError, match="`mems` back from an earlier pass"):
        _check_no_ghosts(module, (torch.zeros(2, 3),), {"mems": (torch.zeros(3, 2, 4), ghost_of(torch.zeros(3, 2, 4)))})


def test_multimodal_rotary_positions_are_cut_by_their_rows() -> None:
    """Qwen2-VL and its kin: ``generate()`` passes ``position_ids`` of ``[3 or 4, batch, length]``; a microbatch gets
    its own rows of them, in the second dimension (its keys, values and masks in the first)."""
    from lightning_pipe._step.caches import BlockStates, PassCaches
    from lightning_pipe._step.pass_inputs import PassInputs as _PassInputs

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> None: ...

    module = torch.nn.Module()
    module.forward = forward
    ids, positions, plain = torch.arange(8).view(4, 2), torch.arange(4 * 4 * 4).view(4, 4, 4), torch.zeros(4, 4, 4)
    inputs = _PassInputs(module, (ids,), {"position_ids": positions, "other": plain}, 4, PassCaches(2),
                         states=BlockStates([], [], []))
    (cut_ids,), kwargs = inputs.lp_rows(2, 4, probing=None)
    assert cut_ids.tolist() == ids[2:4].tolist()
    assert torch.equal(kwargs["position_ids"], positions[:, 2:4]) and torch.equal(kwargs["other"], plain[2:4])


@pytest.mark.dist
def test_a_failure_on_the_last_stage_ends_every_rank_naming_it(launched: Path) -> None:
    errors = [torch.load(launched / f"head_fails.rank{r}.pt", weights_only=False)["error"] for r in range(4)]
    assert all(e is not None and "the head refuses" in e for e in errors), errors
    assert sum(e.startswith("ValueError") for e in errors) == 1  # the last stage raises its own error
    assert sum(e.startswith("lightning_pipe.BackboneCallError: The last pipeline stage failed") for e in errors) == 3



@pytest.mark.dist
def test_a_failure_in_a_single_pass_step_ends_every_rank_naming_it(launched: Path) -> None:
    errors = [torch.load(launched / f"step_fails_at_once.rank{r}.pt", weights_only=False)["error"] for r in range(4)]
    assert all(e is not None and "the step refuses its batch" in e for e in errors), errors
    assert sum(e.startswith("ValueError") for e in errors) == 1
    named = "lightning_pipe.BackboneCallError: The last pipeline stage (pipeline rank 3) failed in `validation_step`"
    assert sum(e.startswith(named) for e in errors) == 3
