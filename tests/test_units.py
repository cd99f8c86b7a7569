"""Fast in-process unit tests of the core pieces, on tiny models, in one process: where the cut puts every tensor,
the step program's modes, the parameter groups' alignment and the global gradient norm. No process is started; a
gloo group of size 1 stands in for the pipeline where the code needs one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_pipe._ghost import Ghost, ghost_of
from lightning_pipe._lightning.callbacks import align_param_groups
from lightning_pipe._lightning.log import LogRecorder
from lightning_pipe._lightning.precision import global_grad_norm, pipeline_precision
from lightning_pipe._model.backbone import find_backbone
from lightning_pipe._model.cut import Cut
from lightning_pipe._model.structure import analyze
from lightning_pipe._step.loss_weights import LossWeighing
from lightning_pipe._step.microbatch_loss import MicrobatchLoss
from lightning_pipe._step.program import StepProgram
from lightning_pipe.partition import make_layout

VOCAB, DIM, SEQ, BATCH = 11, 6, 5, 6
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------ a tiny model
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Positions(nn.Module):
    """A buffer in a module without parameters (like a rotary table): every stage computes it from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, SEQ * DIM).view(SEQ, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[: x.shape[1]]


class Net(nn.Module):
    """Before the trunk: an embedding (a module the step calls), a class vector (a parameter the step reads) and a
    position table; the trunk: ``blocks``; after it: a norm and a head.

    Args:
        tied: the head's weight is the embedding's.
        reused: the trunk runs its first block again at the end (``blocks.0`` is ``blocks.3``).
        vector_after: the class vector is read after the trunk too.
    """

    def __init__(self, tied: bool = False, reused: bool = False, vector_after: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vector = nn.Parameter(torch.randn(DIM))
        self.positions = Positions()
        blocks = [Block() for _ in range(4)]
        if reused:
            blocks[3] = blocks[0]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        if tied:
            self.head.weight = self.embed.weight
        self.vector_after = vector_after

    def before(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.vector + self.positions(x)

    def after(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return self.head(h + self.vector if self.vector_after else h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.before(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.after(h).flatten(0, 1), y.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=g), torch.randint(VOCAB, (BATCH, SEQ), generator=g)


def cut_of(model: Net, pipeline_size: int = 2, stages_per_rank: int = 1) -> Cut:
    """The cut ``PipelineStrategy.setup`` makes (``_model.split.cut_module``), 4 blocks split evenly, before
    ``keep_only``."""
    backbone = find_backbone(model, "blocks")
    structure = analyze(model, backbone, model.training_step, (batch(), 0), CPU, training=True)
    return Cut(model, backbone, structure, make_layout([1.0] * 4, pipeline_size, stages_per_rank))


def stages_by_path(cut: Cut) -> dict[str, set[int]]:
    return {path: set(reg.stages) for reg in cut.registrations for path in reg.paths}


# ------------------------------------------------------------------------------------------------ Cut placement
def test_cut_places_before_inside_and_after_the_trunk():
    cut = cut_of(Net())
    assert stages_by_path(cut) == {
        "embed.weight": {0},  # a module the code before the trunk calls
        "vector": {0},  # a parameter it reads directly
        "positions.table": {0, 1},  # a buffer of a module without parameters: every stage
        **{f"blocks.{i}.lin.{n}": {i // 2} for i in range(4) for n in ("weight", "bias")},
        "norm.weight": {1}, "norm.bias": {1}, "head.weight": {1}, "head.bias": {1},  # after the trunk: last stage
    }
    assert cut.ties() == []
    # what the code before the trunk reads: ghosts while it runs anywhere but in the first stage's own window
    swaps = {
        key: {(type(owner).__name__, name, kind) for owner, name, kind in entries}
        for key, entries in cut.window_swaps(0).items()
    }
    assert swaps == {0: set(), "answer": {("Embedding", "weight", "parameter"), ("Net", "vector", "parameter")}}
    assert cut.window_swaps(1) == {1: [], "answer": []}


def test_tied_head_is_on_both_ends_stored_once_and_summed_over_both_ranks():
    cut = cut_of(Net(tied=True))
    embed, head = (next(r for r in cut.registrations if r.paths == [p]) for p in ("embed.weight", "head.weight"))
    assert embed.tensor is head.tensor
    assert (set(embed.stages), set(head.stages)) == ({0}, {1})
    assert embed.key == head.key == "embed.weight"  # a checkpoint stores it once, under its first name
    assert cut.ties() == [("embed.weight", frozenset({0, 1}), 0)]


def test_a_parameter_read_before_and_after_the_trunk_goes_to_both_ends():
    cut = cut_of(Net(vector_after=True))
    assert stages_by_path(cut)["vector"] == {0, 1}
    assert cut.ties() == [("vector", frozenset({0, 1}), 0)]


def test_a_reused_block_lives_on_each_of_its_stages():
    cut = cut_of(Net(reused=True))
    placed = stages_by_path(cut)
    assert placed["blocks.0.lin.weight"] == placed["blocks.3.lin.weight"] == {0, 1}
    reg = next(r for r in cut.registrations if "blocks.3.lin.weight" in r.paths)
    assert reg.paths == ["blocks.0.lin.weight", "blocks.3.lin.weight"]
    assert sorted(name for name, _, _ in cut.ties()) == ["blocks.0.lin.bias", "blocks.0.lin.weight"]


def test_keep_only_leaves_a_rank_its_share_and_ghosts_the_rest():
    model = Net(tied=True)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    cut = cut_of(model)
    cut.keep_only(1, CPU)
    kept = model.state_dict()
    assert sorted(kept) == sorted(
        ["positions.table", "blocks.2.lin.weight", "blocks.2.lin.bias", "blocks.3.lin.weight", "blocks.3.lin.bias",
         "norm.weight", "norm.bias", "head.weight", "head.bias"]
    )
    assert all(torch.equal(kept[k], whole["embed.weight" if k == "head.weight" else k]) for k in kept)
    assert isinstance(model.embed.weight, Ghost) and isinstance(model.blocks[0].lin.weight, Ghost)
    assert model.embed.weight.shape == (VOCAB, DIM)
    assert model.head.weight is next(p for n, p in model.named_parameters() if n == "head.weight")


# ------------------------------------------------------------------------------------------------ StepProgram
def two_stages_on_one_rank() -> tuple[Net, Net, StepProgram]:
    """The model cut for one process running both stages (``devices=1`` with a multi-stage schedule), an uncut
    copy to compare with, and the rank's step program."""
    reference, model = Net(), Net()
    cut = cut_of(model, pipeline_size=1, stages_per_rank=2)
    cut.keep_only(0, CPU)
    bounds = {s: cut.layout.bounds[s] for s in cut.layout.rank_stages(0)}
    assert bounds == {0: (0, 2), 1: (2, 4)}
    return reference, model, StepProgram(
        model, cut.backbone, cut.structure, cut.flow, bounds, cut.window_swaps(0), CPU
    )


@torch.no_grad()
def test_capture_reads_the_batch_size_from_the_first_block_call():
    _, model, program = two_stages_on_one_rank()
    assert program.batch_size_of(model.training_step, batch(), 0) == BATCH
    x, y = batch()
    assert program.batch_size_of(model.training_step, (x[:4], y[:4]), 0) == 4
    assert program.current is None and isinstance(model.blocks[0], Block)  # the blocks are back in the container


@torch.no_grad()
def test_each_stage_runs_its_blocks_and_the_answer_runs_the_rest_of_the_step():
    reference, model, program = two_stages_on_one_rank()
    x, y = batch()
    rows = torch.arange(2, 5)  # one microbatch
    with program.holding(model.training_step, (x, y), BATCH, 0):
        (first,) = program.run_stage(0, rows)
        (second,) = program.run_stage(1, rows, (first,))  # the code before the trunk runs on ghosts here
    assert program.batch is None and program.step is None  # nothing of the batch outlives its block
    h = reference.before(x[2:5])
    h = reference.blocks[1](reference.blocks[0](h))
    torch.testing.assert_close(first, h, rtol=0, atol=0)
    torch.testing.assert_close(second, reference.blocks[3](reference.blocks[2](h)), rtol=0, atol=0)
    loss = program.run_answering(second, model.training_step, (x[2:5], y[2:5]), 0)
    torch.testing.assert_close(loss, reference.training_step((x[2:5], y[2:5]), 0), rtol=0, atol=0)
    assert not isinstance(model.embed.weight, Ghost) and not isinstance(model.vector, Ghost)  # swapped back


def test_the_answer_carries_gradients_to_the_stage_output_and_the_head():
    reference, model, program = two_stages_on_one_rank()
    x, y = batch()
    with torch.no_grad():
        hidden = reference.blocks[3](reference.blocks[2](reference.blocks[1](reference.blocks[0](reference.before(x)))))
    out = hidden.clone().requires_grad_()
    program.run_answering(out, model.training_step, (x, y), 0).backward()
    ref_out = hidden.clone().requires_grad_()
    F.cross_entropy(reference.after(ref_out).flatten(0, 1), y.flatten()).backward()
    torch.testing.assert_close(out.grad, ref_out.grad)
    torch.testing.assert_close(model.head.weight.grad, reference.head.weight.grad)
    assert model.embed.weight.grad is None and model.blocks[0].lin.weight.grad is None  # only the step after the trunk


def test_the_last_stage_of_a_training_step_runs_the_step_once_to_its_weighted_loss():
    """[Note: the last stage's loss]: the last stage's forward runs the step on to its end and returns the loss the
    microbatch back-propagates (here weighted by its targets and scaled by ``grad_scale``); the step runs once per
    stage, and the loss observer watches the code around the blocks, not the blocks, run or skipped."""
    reference, model, program = two_stages_on_one_rank()
    modes_in_blocks: list[object] = []
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda *_: modes_in_blocks.append(torch.overrides._get_current_function_mode())
        )
    modes_skipping: list[object] = []
    skipped_output = program.skipped_output

    def watched(*args: Any) -> Any:
        modes_skipping.append(torch.overrides._get_current_function_mode())
        return skipped_output(*args)

    program.skipped_output = watched  # type: ignore[method-assign]
    calls = []

    def step(*args: Any) -> torch.Tensor:
        calls.append(len(args))
        return model.training_step(*args)

    x, y = batch()
    rows = torch.arange(2, 5)
    weighing = LossWeighing(num_microbatches=2)
    losses = MicrobatchLoss(model, LogRecorder(), weighing, grad_scale=0.5, overlap=None, amp_scaler=None)
    with program.holding(step, (x, y), BATCH, 0), program.computing_loss(losses):
        (first,) = program.run_stage(0, rows)
        (loss,) = program.run_stage(1, rows, (first,))
    assert calls == [2, 2] and modes_in_blocks == [None] * 4 and modes_skipping == [None, None]
    assert weighing.source == "cross_entropy" and float(weighing.weights[0]) == 3 * SEQ  # the targets it holds
    expected = reference.training_step((x[2:5], y[2:5]), 0)
    torch.testing.assert_close(loss, expected * 0.5, rtol=0, atol=0)
    loss.backward()
    (expected * 0.5).backward()
    for name in ("head.weight", "norm.weight", "blocks.3.lin.weight", "blocks.0.lin.weight", "embed.weight"):
        torch.testing.assert_close(
            model.get_parameter(name).grad, reference.get_parameter(name).grad, rtol=0, atol=0, msg=name
        )


class _ReadsItsDtype(Net):
    """Reads a module's parameters before the trunk, as Wan (``next(iter(self.time_embedder.parameters())).dtype``),
    SkyReels-V2 (diffusers' ``get_parameter_dtype(self.time_embedder)``) and diffusers' models (``self.dtype``) do."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def before(self, x: torch.Tensor) -> torch.Tensor:
        from diffusers.models.modeling_utils import get_parameter_dtype

        dtype = next(iter(self.embed.parameters())).dtype
        assert get_parameter_dtype(self.embed) == self.embed.dtype == dtype and self.embed.device == x.device
        return super().before(x).to(dtype)


@torch.no_grad()
def test_a_module_emptied_by_the_cut_answers_from_its_ghosts_while_the_step_runs():
    """[Note: emptied models]: on the rank that does not hold the embedding, the code before the trunk still reads its
    dtype (diffusers' ``ModelMixin`` answers ``dtype``/``device`` from the ghosts); ``parameters()`` yields the ghosts
    while the step runs only: the optimizer and the rest see the rank's own parameters."""
    diffusers = pytest.importorskip("diffusers")

    class Embed(diffusers.ModelMixin):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.table = nn.Embedding(VOCAB, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.table(x)

    reference, model = _ReadsItsDtype(Embed()), _ReadsItsDtype(Embed())
    model.load_state_dict(reference.state_dict())
    cut = cut_of(model)
    cut.keep_only(1, CPU)
    assert list(model.embed.parameters()) == [] and model.embed.dtype == torch.float32
    program = StepProgram(model, cut.backbone, cut.structure, cut.flow, {1: cut.layout.bounds[1]}, cut.window_swaps(1),
                          CPU)
    x, y = batch()
    rows = torch.arange(2, 5)
    first = reference.blocks[1](reference.blocks[0](reference.before(x[2:5])))
    with program.holding(model.training_step, (x, y), BATCH, 0):
        (second,) = program.run_stage(1, rows, (first,))
    torch.testing.assert_close(second, reference.blocks[3](reference.blocks[2](first)), rtol=0, atol=0)
    assert list(model.embed.parameters()) == [] and "parameters" not in vars(model.embed)  # only while it ran
    cut.unsplit(model, {reg.key: reg.tensor for reg in cut.registrations})
    assert type(model.embed) is Embed


def test_a_model_whose_blocks_are_all_it_holds_answers_from_its_ghosts_while_the_step_runs():
    """[Note: emptied models]: GPT-1's model on the last stage holds its blocks but not the embeddings, and its forward
    reads ``next(self.parameters())``; while the step runs, runners stand in for the blocks, so it holds nothing."""
    from lightning_pipe._calls.emptied import ghost_parameters, lend_ghost_parameters
    from lightning_pipe._ghost import ghost_of

    model = nn.Module()
    model.embed, model.blocks = nn.Embedding(VOCAB, DIM), nn.ModuleList([Block(), Block()])
    weight = model.embed._parameters.pop("weight")
    object.__setattr__(model.embed, "weight", ghost_of(weight))  # what `Cut.keep_only` leaves on this rank
    lend_ghost_parameters(model, [(model.embed, "weight")], blocks=list(model.blocks))
    blocks = list(model.blocks)
    model.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])  # the runners, while the step runs
    with ghost_parameters(model):
        assert next(model.parameters()) is model.embed.weight and next(model.blocks[0].parameters(), None) is None
    model.blocks = nn.ModuleList(blocks)
    assert [p for p in model.parameters()] == [p for b in blocks for p in b.parameters()]  # outside the step


def test_sequence_first_hidden_states_hold_the_rows_in_their_second_dimension():
    """[Note: sequence-first hidden states]: FSMT's and XLNet's blocks take ``[length, batch, width]``; the batch's
    token ids are ``[batch, length]``. Evaluation merges the microbatches' outputs along the rows' dimension."""
    from lightning_pipe._calls.batch import rows_dim
    from lightning_pipe._step.pipeline import _merged

    batch = {"input_ids": torch.zeros(8, 28, dtype=torch.long), "labels": torch.zeros(8, 14, dtype=torch.long)}
    assert rows_dim((28, 8, 32), batch) == 1 and rows_dim((8, 28, 32), batch) == 0
    assert rows_dim((8, 8, 32), batch) == 0  # as many positions as rows: batch first, as before
    parts = [torch.full((5, 2, 3), float(i)) for i in range(4)]
    merged = _merged(torch.cat(parts), (5, 2, 3), rows=2, num_microbatches=4, rows_dim=1)  # as torch merges
    assert torch.equal(merged, torch.cat(parts, dim=1))
    assert torch.equal(_merged(torch.cat(parts), (5, 2, 3), rows=5, num_microbatches=4, rows_dim=0), torch.cat(parts))


def test_a_microbatch_writes_its_own_copy_of_the_batch_rows():
    """FSMT fills its labels' -100 in place: a microbatch's write must not bump the version of the tensors another
    microbatch's loss saved (a view shares the whole batch's counter)."""
    from lightning_pipe._calls.batch import slice_batch

    labels = torch.full((4, 3), -100)
    first, second = slice_batch(labels, 4, 0, 2), slice_batch(labels, 4, 2, 4)
    version = first._version
    second.masked_fill_(second == -100, 0)
    assert first._version == version and labels.eq(-100).all()


def test_a_later_call_whose_step_reads_a_parameter_where_the_cut_did_not_put_it_is_refused():
    """The cut is kept across Trainer calls; XLNet's ``generate()`` reads ``mask_emb`` before the first block, which
    its training step never reads: the stage running that code would read a ghost, so setup refuses, naming it."""
    from lightning_pipe import BackboneCallError
    from lightning_pipe._model.split import _refuse_reads_elsewhere

    model = Net()
    cut = cut_of(model)
    _refuse_reads_elsewhere(model, cut, lambda: (model.training_step, (batch(), 0)), CPU, fitting=True)

    def reads_the_head_first(data: Any, batch_idx: int) -> torch.Tensor:
        x, y = data
        h = model.before(x) * model.head.bias.mean()
        for block in model.blocks:
            h = block(h)
        return F.cross_entropy(model.after(h).flatten(0, 1), y.flatten())

    with pytest.raises(BackboneCallError, match=r"`head.bias` before block 0, which stage 0 runs"):
        _refuse_reads_elsewhere(model, cut, lambda: (reads_the_head_first, (batch(), 0)), CPU, fitting=True)


def test_a_run_on_ghosts_leaves_no_ghost_in_plain_attributes():
    """RecurrentGemma keeps its states in plain attributes; the setup's analysis runs the step on ghosts, and a real
    decoding step after it must not continue from them. The ghosts a cut leaves for another stage's parameters stay."""
    from lightning_pipe._ghost import ghost_of
    from lightning_pipe._model.untouched import no_ghosts_left

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].state, model[0].kept = None, ghost_of(torch.zeros(3))
    kept = model[0].kept
    with no_ghosts_left(model):
        model[0].state, model[0].made = ghost_of(torch.zeros(2)), ghost_of(torch.zeros(1))
    assert model[0].state is None and not hasattr(model[0], "made") and model[0].kept is kept


def test_ghosts_of_moe_experts_multiply_in_fp32():
    """Hugging Face's MoE experts call ``torch._grouped_mm`` in fp32 on CPU; torch's meta kernel refuses what is not
    bf16, so a ghost of it has the CPU kernel's shape and dtype (GlmMoeDsa, HYV4: the blocks run on ghosts)."""
    from lightning_pipe._ghost import ghost_of

    a, w, offs = torch.randn(8, 16), torch.randn(2, 16, 32), torch.tensor([3, 8], dtype=torch.int32)
    real = F.grouped_mm(a, w, offs=offs)
    out = F.grouped_mm(ghost_of(a), w, offs=offs)
    assert isinstance(out, Ghost) and out.shape == real.shape and out.dtype == real.dtype == torch.float32
    half = F.grouped_mm(ghost_of(a.bfloat16()), w.bfloat16(), offs=offs)
    assert isinstance(half, Ghost) and half.dtype == torch.bfloat16 and half.shape == real.shape


def test_a_ghost_operation_met_again_takes_its_result_from_the_shapes_alone():
    """[Note: ghost results by shape]: the second run of an operation with the same shapes does not run the meta
    kernel, and its ghosts have what the kernel gives (shape, strides, offset, dtype); an in-place operation still
    returns its own argument, and another shape runs the kernel again."""
    from lightning_pipe import _ghost

    real, table = torch.randn(4, 6, 8), torch.randn(6, 8, dtype=torch.float64)

    def ops(x: torch.Tensor) -> list[torch.Tensor]:
        return [x + table, x[:, 1:, ::2], x.float().softmax(-1), *x.split(3, dim=1), torch.cat([x, x], dim=-1)]

    _ghost._RESULTS.clear()
    first = ops(ghost_of(real))
    kept = len(_ghost._RESULTS)
    assert kept >= 5
    calls = []
    original = _ghost._remember
    _ghost._remember = lambda *args: (calls.append(args[0]), original(*args))
    try:
        again = ops(ghost_of(real))
        assert calls == [] and len(_ghost._RESULTS) == kept  # every result from the kept descriptions
        other = ops(ghost_of(torch.randn(2, 6, 8)))
        assert len(calls) >= 5
    finally:
        _ghost._remember = original
    for a, b, want in zip(first, again, ops(real)):
        assert isinstance(b, Ghost) and b.shape == a.shape == want.shape and b.dtype == a.dtype == want.dtype
        assert b.stride() == a.stride() and b.storage_offset() == a.storage_offset()
    assert other[0].shape == (2, 6, 8)
    ghost = ghost_of(real)
    assert ghost.mul_(2) is ghost and ghost.mul_(2) is ghost  # in place: its argument, every time


def test_ghosts_indexed_by_a_mask_of_the_batch_take_its_shape():
    """``logits[..., :-1, :][mask[:, 1:] != 0]`` (the loss of Granite Speech, Qwen2-Audio): torch's meta kernel needs
    the mask's values, which the batch has; a mask that is a ghost has none, which reads a value."""
    from lightning_pipe._ghost import GhostValueError, ghost_of

    logits, mask = torch.randn(2, 5, 7), torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]])
    out = ghost_of(logits)[..., :-1, :][mask[:, 1:] != 0]
    assert isinstance(out, Ghost) and out.shape == logits[..., :-1, :][mask[:, 1:] != 0].shape
    written = ghost_of(logits)
    written[mask != 0] = 0.0
    assert isinstance(written, Ghost) and written.shape == logits.shape
    with pytest.raises(GhostValueError, match="boolean mask"):
        ghost_of(logits)[ghost_of(mask) != 0]


# ------------------------------------------------------------------------------------------------ one process group


def test_align_param_groups_on_one_rank_keeps_the_groups(group):
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    optimizer = torch.optim.SGD([{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.01}])
    finetuning = BaseFinetuning()
    finetuning._internal_optimizer_metadata[0] = [{"lr": 0.1, "params": ["a"]}]
    align_param_groups([optimizer], group, CPU, [finetuning])
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    assert [g["params"] for g in optimizer.param_groups] == [list(a.parameters()), list(b.parameters())]
    assert finetuning._internal_optimizer_metadata == {0: [{"lr": 0.1, "params": ["a"]}]}


# ------------------------------------------------------------------------------------------------ gradient norm
def with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (3,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_global_grad_norm_is_torchs_norm_on_one_process(norm_type, group):
    params = with_grads()
    want = torch.nn.utils.clip_grad_norm_(with_grads(), max_norm=float("inf"), norm_type=norm_type)
    for on in (None, group):
        got = global_grad_norm([p.grad for p in params], on, CPU, norm_type=norm_type)
        torch.testing.assert_close(got, want)
    assert global_grad_norm([], group, CPU).item() == 0.0


def test_clipping_matches_torch_and_counts_a_tied_copy_once(group):
    """``gradient_clip_val`` through the strategy's precision plugin clips as ``clip_grad_norm_`` does; a parameter
    another rank also holds (a tied copy, not counted here) is clipped by the same factor but not counted twice."""
    params, expected = with_grads(), with_grads()
    torch.nn.utils.clip_grad_norm_(expected, max_norm=0.5)
    plugin = pipeline_precision(Precision())
    copy = nn.Parameter(params[0].detach().clone())  # the same tensor as held by a second rank
    copy.grad = params[0].grad.clone()
    plugin.connect_pipeline(group, counted=lambda p: p is not copy)
    plugin.clip_grad_by_norm(torch.optim.SGD([*params, copy], lr=0.1), 0.5)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e.grad)
    torch.testing.assert_close(copy.grad, expected[0].grad)
    assert type(plugin).__qualname__ == "Precision" and isinstance(plugin, Precision)


def test_no_batch_outlives_its_step():
    """Once Lightning's loop lets go of a batch (training or validation), nothing of the strategy holds it: the
    batch's memory is freed before the next batch arrives, not one step later."""
    import gc
    import weakref

    import lightning as L
    import zoo
    from test_structure import Net

    from lightning_pipe import PipelineStrategy

    class Batches(L.Callback):
        def __init__(self) -> None:
            self.previous: list[weakref.ref] = []
            self.alive: list[bool] = []

        def _check(self) -> None:
            gc.collect()
            self.alive += [ref() is not None for ref in self.previous]
            self.previous = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._check()

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self._check()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.previous = [weakref.ref(t) for t in batch]

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.previous = [weakref.ref(t) for t in batch]

    class WithValidation(Net):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.training_step(batch, batch_idx))

    batches = Batches()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(num_microbatches=2), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[batches],
        num_sanity_val_steps=0, val_check_interval=2,
    )
    loader = zoo.loader("tokens", n=16, batch_size=4)
    trainer.fit(WithValidation(), loader, zoo.loader("tokens", n=8, batch_size=4))
    assert len(batches.alive) >= 4 and not any(batches.alive), batches.alive


# ------------------------------------------------------------------------------------------------ gradients, logs
def test_gradients_kept_aside_scaled_tied_and_handed_back(group):
    """The schedule's fresh gradients survive Lightning's zero_grad: kept aside, multiplied by the step's factor
    (token weights), tied copies summed over their group, then added to what earlier batches accumulated."""
    from lightning_pipe._step.runtime import Gradients

    module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    frozen = module[1].bias
    frozen.requires_grad_(False)
    earlier = {p: torch.full_like(p, 0.25) for p in module.parameters() if p.requires_grad}
    for p, g in earlier.items():
        p.grad = g.clone()
    gradients = Gradients(module, replica_group=None, tie_groups=[(group, [module[0].weight, frozen])])
    x = torch.randn(4, 3)
    with gradients.computed_aside():
        assert all(p.grad is None for p in earlier)  # the schedule writes into empty gradients
        module(x).sum().backward()
        fresh = {p: p.grad.clone() for p in earlier}
    assert all(torch.equal(p.grad, earlier[p]) for p in earlier)  # the earlier ones are back for zero_grad
    gradients.synchronise(scale=0.5)
    module.zero_grad(set_to_none=False)  # what Lightning does between training_step and backward
    gradients.hand_back()
    for p in earlier:
        torch.testing.assert_close(p.grad, 0.5 * fresh[p], rtol=0, atol=0)
    assert frozen.grad is None  # a frozen tied copy takes part in the sum, then is dropped
    gradients.hand_back()  # handed back once only
    assert all(torch.equal(p.grad, 0.5 * fresh[p]) for p in earlier)


def test_log_channel_values_only_round_trip():
    """Once the keys are known, a step's result (the loss in its dtype and the float64 gradient factor) and logged
    values travel as one small float64 buffer and come back with their dtypes; new keys fall back to an object."""
    from lightning_pipe._lightning.log import LogChannel, _signature

    channel = LogChannel(None, src=1, size=2, device=torch.device("cpu"))
    first = ((torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(0.75, dtype=torch.float64)),
             [("train_loss", torch.tensor(2.5), {"prog_bar": True}), ("n", torch.tensor(3, dtype=torch.int64), {})])
    assert channel._pack(first)[0] == 0  # the first step sends an object
    channel._signature = _signature(*first)
    second = ((torch.tensor(1.25, dtype=torch.bfloat16), torch.tensor(1 / 3, dtype=torch.float64)),
              [("train_loss", torch.tensor(1.125), {"prog_bar": True}), ("n", torch.tensor(7, dtype=torch.int64), {})])
    buffer = channel._pack(second)
    assert buffer[0] == 1 and buffer.numel() == 1 + 2 + 2
    (loss, scale), entries = channel._unpack(buffer[1:])
    assert loss.dtype == torch.bfloat16 and float(loss) == 1.25 and scale.dtype == torch.float64
    assert float(scale) == 1 / 3
    assert [(n, float(v), v.dtype, o) for n, v, o in entries] == [
        ("train_loss", 1.125, torch.float32, {"prog_bar": True}), ("n", 7.0, torch.int64, {})]
    changed = (second[0], [("other", torch.tensor(1.0), {})])
    assert channel._pack(changed)[0] == 0


def test_configure_model_finds_the_mesh_by_model_parallel_strategy_names():
    """``self.device_mesh`` in ``configure_model`` is the strategy's mesh, with ``"data_parallel"`` named as in
    Lightning's ``ModelParallelStrategy`` and the pipeline's own ``"pipeline_parallel"``."""
    import lightning as L
    import zoo
    from test_structure import Net

    from lightning_pipe import PipelineStrategy

    class ReadsTheMesh(Net):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            self.seen = (mesh.mesh_dim_names, mesh["data_parallel"].size(), mesh["pipeline_parallel"].size(),
                         mesh["tensor_parallel"].size())

    model = ReadsTheMesh()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(num_microbatches=2), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, zoo.loader("tokens", n=8, batch_size=4))
    # "tensor_parallel" is there without tensor parallelism too, as in ModelParallelStrategy: code tests its size
    assert model.seen == (("data_parallel", "pipeline_parallel", "tensor_parallel"), 1, 1, 1)
    assert trainer.strategy.device_mesh is model.device_mesh


def test_row_spans_are_read_from_the_schedules_views_without_reading_values():
    """[Note: row numbers read from the view]: torch's schedule splits the step's row numbers into views, whose span
    comes from their offset (no value read: no device wait per stage run); any other tensor of rows is read."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

    from lightning_pipe._calls.batch import row_numbers, row_span

    rows = row_numbers(10, torch.device("cpu"))
    spec = {"lp_rows": TensorChunkSpec(0)}
    _, chunks = split_args_kwargs_into_chunks((), {"lp_rows": rows}, 4, kwargs_chunk_spec=spec)
    spans = [row_span(chunk["lp_rows"]) for chunk in chunks]
    assert spans == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert all(chunk["lp_rows"]._base is rows for chunk in chunks)  # read from the view, not the values
    views = [chunk["lp_rows"] for chunk in chunks]
    rows.copy_(torch.arange(100, 110))  # values that are not row numbers: the views' spans stay their offsets
    assert [row_span(v) for v in views] == spans
    assert row_span(torch.arange(5, 9)) == (5, 9)  # not a view of the step's row numbers: read
    assert row_span(torch.arange(12)[4:7]) == (4, 7)
