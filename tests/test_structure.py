"""What cannot be pipelined fails at setup (or, for what only the run shows, at the first step) with the reason and
the fix; and how the backbone is found. One process: the checks run on every rank alike (test_errors.py shows a
refusal reaching every rank)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import zoo
from helpers import fit_one_process
from torch import nn

from lightning_pipe import BackboneCallError, PipelineStrategy
from lightning_pipe._ghost import GhostValueError


class Net(L.LightningModule):
    """Embedding, a ModuleList of blocks run in a loop, a head; subclasses change the loop."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(zoo.VOCAB, zoo.DIM)
        self.blocks = nn.ModuleList([zoo.NanoBlock() for _ in range(blocks)])
        self.head = nn.Linear(zoo.DIM, zoo.VOCAB)

    def trunk(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.embed(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


TWO_STAGES = {"schedule": "Interleaved1F1B", "stages_per_rank": 2}


def fit(model: L.LightningModule, **strategy: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(num_microbatches=2, **strategy), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, zoo.loader("tokens", n=8, batch_size=4))
    return trainer


class KeepsAll(Net):
    def trunk(self, h):
        kept = []
        for block in self.blocks:
            h = block(h)
            kept.append(h)
        return torch.stack(kept).mean(0)


class Between(Net):
    def trunk(self, h):
        for block in self.blocks:
            h = block(h) * 0.5
        return h


class Reversed(Net):
    def trunk(self, h):
        for block in reversed(self.blocks):
            h = block(h)
        return h


class FirstTwo(Net):
    def trunk(self, h):
        for block in self.blocks[:2]:
            h = block(h)
        return h


class ReadsEmbedding(Net):
    def forward(self, x):
        h = self.embed(x)
        if h.mean() > 0:  # a decision on a value only the first stage computes
            h = h * 2
        return self.head(self.trunk(h))


class SkipsOver(Net):
    def forward(self, x):
        h = self.embed(x)
        return self.head(self.trunk(h) + h)  # the embedding's output after the backbone


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = zoo.NanoBlock()

    def forward(self, h: torch.Tensor) -> dict:
        return {"hidden": self.inner(h)}


class ReturnsDict(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DictBlock() for _ in range(4)])

    def trunk(self, h):
        for block in self.blocks:
            h = block(h)["hidden"]
        return h


class Cache:
    """Stands for a cache of keys and values that already holds tokens (generation)."""

    def get_seq_length(self) -> int:
        return 5


class CacheBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = zoo.NanoBlock()

    def forward(self, h: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        return self.inner(h)


class WithCache(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CacheBlock() for _ in range(4)])

    def trunk(self, h):
        cache = Cache()
        for block in self.blocks:
            h = block(h, past_key_values=cache)
        return h


class SharedMemory(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(zoo.DIM, zoo.VOCAB, bias=False)
        self.head.weight = nn.Parameter(self.embed.weight.data)  # not a tie: two parameters over one memory


class ScaledSide(Net):
    """Every block takes a side value that plain tensor code computes from a parameter (not inside a module)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SideBlock() for _ in range(4)])
        self.scale = nn.Parameter(torch.ones(zoo.DIM))

    def trunk(self, h):
        side = h.mean(1) * self.scale
        for block in self.blocks:
            h = block(h, side)
        return h


class SideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = zoo.NanoBlock()

    def forward(self, h: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return self.inner(h + side[:, None])


class TwoStacks(Net):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.ModuleList([zoo.NanoBlock() for _ in range(4)])


class ProbeBlock(nn.Module):
    """A block with a module inside whose output the block does not return (a router's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = zoo.NanoBlock()
        self.probe = nn.Linear(zoo.DIM, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.seen = self.probe(h)  # kept on the module (read back only by `Stashes`)
        return self.inner(h)


class Hooked(Net):
    """What a forward hook on a module inside each block records is read after the backbone (as Hugging Face's
    output capturing hands a mixture-of-experts model's router logits to its load-balancing loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ProbeBlock() for _ in range(4)])
        self.recorded: list[torch.Tensor] = []
        for block in self.blocks:
            block.probe.register_forward_hook(lambda module, args, out: self.recorded.append(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recorded.clear()
        h = self.head(self.trunk(self.embed(x)))
        return h + sum(r.mean() * (i + 1) for i, r in enumerate(self.recorded))


class Stashes(Net):
    """The same value read back from where the block kept it: no stage but the block's can put it back there."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ProbeBlock() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.embed(x))) + sum(b.seen.mean() for b in self.blocks)


class NoneFirstBlock(zoo.NanoBlock):
    def forward(self, h: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, super().forward(h)


class ReturnsNone(Net):
    """Blocks return ``(None, hidden)``, as SD3's last joint block does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([NoneFirstBlock() for _ in range(4)])

    def trunk(self, h):
        for block in self.blocks:
            _, h = block(h)
        return h


@pytest.mark.parametrize(
    ("model", "strategy", "error", "match"),
    [
        (ScaledSide, TWO_STAGES, BackboneCallError,
         r"computed from the parameter\(s\) scale outside any module on stage 0, is used on stage 1.*Move it into a"),
        (Reversed, {}, BackboneCallError, r"called block 3 \(`blocks.3`\) when block 0 was next"),
        (FirstTwo, {}, BackboneCallError, r"called only the first 2 of the 4 backbone blocks; the next was `blocks.2`"),
        (ReadsEmbedding, {}, GhostValueError, r"read the value of .*from embed.weight.*must come from the batch"),
        (ReturnsDict, {}, BackboneCallError, r"Block `blocks.0` returns a dict.*tensor, or a tuple or list"),
        (WithCache, {}, BackboneCallError, r"Cache that already holds keys and values.*use_cache=False"),
        (SharedMemory, {}, ValueError, r"`embed.weight` and `head.weight` are different parameters over the same"),
        (Stashes, {}, BackboneCallError, r"output of `blocks.0.probe`, a module inside block `blocks.0`, is used after"
         r" that block.*Return it from the block"),
        (Net, {"backbone": ["blocks", "blocks"]}, ValueError, r"`blocks` is inside `blocks` \(or the same"),
    ],
)
def test_what_cannot_be_pipelined_is_refused(model, strategy, error, match):
    with pytest.raises(error, match=match):
        fit(model(), **strategy)


class Pooled(zoo.LitResNet):
    """torchvision's ResNet with code between two of its containers."""

    def __init__(self) -> None:
        super().__init__()
        self.model.forward = self.between  # type: ignore[method-assign]

    def between(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        x = m.layer2(m.layer1(x) * 0.5)  # code between two containers of the backbone
        x = m.layer4(m.layer3(x))
        return m.fc(torch.flatten(m.avgpool(x), 1))


RESNET = ["model.layer1", "model.layer2", "model.layer3", "model.layer4"]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
@pytest.mark.parametrize(
    ("model", "data", "strategy"),
    [
        (KeepsAll, "tokens", {}),  # every block's output is used after the backbone
        (Between, "tokens", {}),  # code between two blocks changes the hidden state
        (SkipsOver, "tokens", {}),  # the embedding's output is used after the backbone
        (Pooled, "resnet", {"backbone": RESNET}),  # code between two containers
        (Hooked, "tokens", {}),  # a forward hook inside every block records a value read after the backbone
        (ReturnsNone, "tokens", {}),  # blocks return `(None, hidden)`
    ],
    ids=["keeps_all", "between_blocks", "skips_over", "between_containers", "hooked_inside", "returns_none"],
)
def test_values_that_cross_stages_train_like_one_device(model, data, strategy, schedule):
    """Two stages on one process (the boundary is torch's own hand-over): each block output or side value a later
    stage uses crosses, and the code between blocks runs on the next block's stage; against one device with
    clipping and accumulation."""

    def fitted(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        return fit_one_process(model(), strategy, zoo.loader(data, n=16, batch_size=4), max_steps=2,
                               gradient_clip_val=0.5, accumulate_grad_batches=2)

    want = fitted("auto")
    got = fitted(PipelineStrategy(num_microbatches=2, schedule=schedule, stages_per_rank=2, **strategy))
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) < 1e-5
    assert max((got[1][k] - want[1][k]).abs().max().item() for k in want[1]) < 1e-5
    assert len(got[0]) == len(want[0]) == 4


def test_auto_finds_the_longest_container_and_says_so(caplog):
    class Longest(Net):
        def __init__(self) -> None:
            super().__init__()
            self.adapters = nn.ModuleList([nn.Linear(zoo.DIM, zoo.DIM) for _ in range(2)])  # shorter: not chosen

    with caplog.at_level("INFO"):
        trainer = fit(Longest())
    assert "pipelining `blocks` (4 x NanoBlock)" in caplog.text
    assert trainer.strategy.runtime.cut.backbone.paths == ("blocks",)


def _cut(name: str, backbone: Any, stages: int, **kwargs: Any) -> Any:
    """The cut setup makes of zoo model ``name`` over ``stages`` equal stages (analysis only, one process)."""
    from lightning_pipe._model.backbone import find_backbone
    from lightning_pipe._model.cut import Cut
    from lightning_pipe._model.structure import analyze
    from lightning_pipe.partition import make_layout

    model = zoo.make(name, **kwargs)
    batch = next(iter(zoo.loader(name, n=4, batch_size=4, kind="padded" if name == "t5" else None)))
    found = find_backbone(model, backbone)
    structure = analyze(model, found, model.training_step, (batch, 0), torch.device("cpu"), training=True)
    return Cut(model, found, structure, make_layout([1.0] * len(found), stages, 1))


def test_what_each_boundary_carries_flux_and_t5():
    """[Note: stage boundaries] on models as shipped: Flux's two streams and ``temb`` cross, ``temb`` on to the final
    norm; T5's encoder output leaves the stage where the decoder starts (its final norm runs there), the position
    biases reach the blocks of their own stack, and the shared embedding is tied over the stages that read it."""
    flux = _cut("flux", ["model.transformer_blocks", "model.single_transformer_blocks"], 2)
    temb = ("module", "model.time_text_embed", 0, 0)
    assert flux.flow.sends[0] == (temb, ("block", 1, 0, 0), ("block", 1, 0, 1))
    assert flux.flow.answers == (temb, ("block", 3, 0, 1))  # `norm_out(hidden_states, temb)`

    t5 = _cut("t5", ["model.encoder.block", "model.decoder.block"], 4, layers=2)
    enc_bias, dec_bias, cross_bias = ("block", 0, 0, 1), ("block", 2, 0, 1), ("block", 2, 0, 2)
    assert t5.flow.sends[0] == (("block", 0, 0, 0), enc_bias)
    assert t5.flow.sends[1] == (("block", 1, 0, 0),)  # only the encoder's last output: its final norm is on stage 2
    encoder_out = next(p for p in t5.flow.sends[2] if p[0] == "module")
    assert encoder_out[1].startswith("model.encoder.") and set(t5.flow.sends[2]) == {
        encoder_out, dec_bias, cross_bias, ("block", 2, 0, 0)
    }
    placed = {path: set(reg.stages) for reg in t5.registrations for path in reg.paths}
    assert placed["model.encoder.final_layer_norm.weight"] == {2}  # code between the stacks: the decoder's stage
    ties = {name: ranks for name, ranks, _ in t5.ties()}
    assert ties == {"model.shared.weight": frozenset({0, 2, 3})}  # encoder and decoder embedding, tied head


def test_what_each_boundary_carries_moe_router_logits_and_sd3():
    """[Note: values from inside blocks]: each Mixtral block's router logits (recorded by transformers' hook on the
    router) travel with the hidden state to the last stage, where the load-balancing loss reads them all; SD3's last
    joint block returns ``(None, hidden_states)``."""
    moe = _cut("mixtral_aux", "auto", 2)
    gates = [("inner", f"model.model.layers.{i}.mlp.gate", 0, 0) for i in range(4)]
    assert moe.flow.sends[0] == (gates[0], gates[1], ("block", 1, 0, 0))
    assert set(moe.flow.answers) == {*gates, ("block", 3, 0, 0)}
    sd3 = _cut("sd3", "auto", 3)
    assert sd3.flow.answers[-1] == ("block", 2, 0, 1)  # the image stream, after the `None`


class _RoutedBlock(nn.Module):
    """Returns ``(hidden, bias)`` (the first block computes the bias, the others pass it on); a routed block picks its
    rows by value, which cannot run on ghosts (Switch Transformers' sparse blocks between dense ones)."""

    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.lin, self.routed = nn.Linear(zoo.DIM, zoo.DIM), routed

    def forward(self, h: torch.Tensor, bias: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.lin.bias * 0.1 if bias is None else bias
        out = h + torch.tanh(self.lin(h)) + bias
        if self.routed:
            picked = (out.sum(-1) > 0).nonzero(as_tuple=True)
            out = out.index_put(picked, out[picked] * 2)
        return out, bias


class Routed(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_RoutedBlock(routed=i % 2 == 1) for i in range(4)])

    def trunk(self, h: torch.Tensor) -> torch.Tensor:
        bias = None
        for block in self.blocks:
            h, bias = block(h, bias)
        return h


def test_a_block_that_cannot_run_on_ghosts_returns_what_the_one_before_of_its_class_did():
    """The analysis runs blocks on ghosts; one whose routing reads values is taken to return what the nearest earlier
    block of its class returned (its own hidden state and the arguments it passes on), not a bare tensor, which the
    loop's unpacking would refuse."""
    from lightning_pipe._model.backbone import find_backbone
    from lightning_pipe._model.structure import analyze

    model = Routed()
    batch = next(iter(zoo.loader("nano", n=4, batch_size=4)))
    structure = analyze(model, find_backbone(model, "blocks"), model.training_step, (batch, 0), torch.device("cpu"),
                        training=True)
    assert structure.outputs[1][:2] == structure.outputs[0][:2] == (tuple, 0)
    assert structure.block_io[3].passed == structure.block_io[2].passed == {1: 1}  # the bias, passed on


class Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(zoo.DIM, zoo.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.ones(1, 1, zoo.DIM, device=x.device))  # no batch dimension


class NonBatched(Net):
    """A value without a batch dimension, computed from parameters before the backbone and read after it too."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shift(x)
        return self.head(self.trunk(self.embed(x) + s) + s)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_a_value_without_a_batch_dimension_crosses_and_is_not_merged(schedule):
    """Sent with every microbatch; after evaluation, torch concatenates the last stage's outputs along dimension 0,
    and such a value is taken once again: validation equals one device's."""

    def run(strategy: Any) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        module = NonBatched()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )
        trainer.fit(module, zoo.loader("tokens", n=8, batch_size=4))
        validated = trainer.validate(module, zoo.loader("tokens", n=8, batch_size=4), verbose=False)
        return validated[0]["val_loss"], {k: v.clone() for k, v in module.state_dict().items()}

    want = run("auto")
    got = run(PipelineStrategy(num_microbatches=2, schedule=schedule, stages_per_rank=2))
    assert got[0] == pytest.approx(want[0], abs=1e-6)
    assert max((got[1][k] - want[1][k]).abs().max().item() for k in want[1]) < 1e-5


class _SelfLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class _CrossLayer(_SelfLayer):
    """Another class of block in the same container (Mllama's cross-attention layers, Jamba's Mamba layers)."""


def test_auto_takes_containers_of_mixed_block_classes_and_most_of_the_parameters(caplog):
    """A container of blocks of several classes is a container of blocks; the longest candidate gives way to one that
    holds more parameters when it leaves most of them outside; the choice is logged; a tie is still refused."""
    from lightning_pipe._model.backbone import find_backbone

    def holder(**containers: nn.Module) -> nn.Module:
        root = nn.Module()
        for name, container in containers.items():
            root.add_module(name, container)
        return root

    mixed = [_SelfLayer(8), _SelfLayer(8), _CrossLayer(8), _SelfLayer(8)]
    vlm = holder(vision=nn.ModuleList([_SelfLayer(4) for _ in range(2)]), layers=nn.ModuleList(mixed))
    with caplog.at_level("INFO"):
        assert find_backbone(vlm, "auto").paths == ("layers",)
    assert "pipelining `layers` (3 x _SelfLayer + 1 x _CrossLayer), which holds 88% of the parameters" in caplog.text

    light = holder(
        small=nn.ModuleList([_SelfLayer(2) for _ in range(8)]), big=nn.ModuleList([_SelfLayer(16) for _ in range(2)])
    )
    caplog.clear()
    with caplog.at_level("INFO"):
        assert find_backbone(light, "auto").paths == ("big",)  # 8 blocks holding 8%: the 2 holding 92% instead
    assert "pipelining `big` (2 x _SelfLayer), which holds 92% of the parameters" in caplog.text

    tie = holder(
        a=nn.ModuleList([_SelfLayer(4), _CrossLayer(4), _SelfLayer(4), _CrossLayer(4)]),
        b=nn.ModuleList([_SelfLayer(4) for _ in range(4)]),
    )
    with pytest.raises(ValueError, match="cannot choose: 2 containers of blocks are equally long"):
        find_backbone(tie, "auto")

    # modules of several classes, one without parameters, or none repeated: not blocks
    plain = holder(mlp=nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), io=nn.ModuleList(
        [nn.Linear(4, 4), nn.LayerNorm(4)]
    ))
    with pytest.raises(ValueError, match="found no container of repeated blocks"):
        find_backbone(plain, "auto")


class _TextOnlyRows(L.LightningModule):
    """A vision-language model trained on text-only rows (GotOcr2 in the conformance sweep): its vision layers are
    longer and heavier than its language layers, but the step never runs them."""

    def __init__(self, with_images: bool = False) -> None:
        super().__init__()
        self.vision = nn.ModuleList([_SelfLayer(16) for _ in range(6)])
        self.project = nn.Linear(16, 4)
        self.layers = nn.ModuleList([_SelfLayer(4) for _ in range(4)])
        self.with_images = with_images

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, images = batch
        if self.with_images:
            v = images
            for layer in self.vision:
                v = layer(v)
            x = x + self.project(v)
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def test_auto_chooses_among_the_containers_the_step_runs(caplog):
    """`backbone="auto"` considers only the candidates the step runs, and logs the choice and what it left out; with
    images, the step runs both, one after the other, and auto pipelines both as before."""
    from lightning_pipe._model.split import _backbone_of

    batch = (torch.randn(2, 4), torch.randn(2, 16))
    model = _TextOnlyRows()
    with caplog.at_level("INFO"):
        backbone, structure = _backbone_of(model, "auto", model.training_step, (batch, 0), torch.device("cpu"), True)
    assert backbone.paths == ("layers",) and len(structure.hidden_at) == 4
    assert "pipelining `layers` (4 x _SelfLayer)" in caplog.text
    assert "(the step does not run `vision`)" in caplog.text

    caplog.clear()
    stacks = TwoStacks()  # two equal containers, but the step runs one: no tie to refuse
    with caplog.at_level("INFO"):
        backbone, _ = _backbone_of(stacks, "auto", stacks.training_step, (next(iter(zoo.loader("tokens", n=4,
                                   batch_size=4))), 0), torch.device("cpu"), True)
    assert backbone.paths == ("blocks",) and "(the step does not run `decoder`)" in caplog.text

    model = _TextOnlyRows(with_images=True)
    backbone, _ = _backbone_of(model, "auto", model.training_step, (batch, 0), torch.device("cpu"), True)
    assert backbone.paths == ("vision", "layers")


class _EncoderVisionDecoder(L.LightningModule):
    """T5Gemma2 in the conformance sweep: an encoder's layers, a vision tower's (registered between them, never run on
    text-only rows), then a decoder's, as long as the encoder's and as heavy."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([_SelfLayer(4) for _ in range(2)])
        self.vision = nn.ModuleList([_SelfLayer(8) for _ in range(2)])
        self.decoder = nn.ModuleList([_SelfLayer(4) for _ in range(2)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch
        for layer in self.encoder:
            x = layer(x)
        y = x
        for layer in self.decoder:
            y = layer(y)
        return y.pow(2).mean()


def test_auto_pipelines_the_containers_the_step_runs_one_after_the_other():
    """Of consecutive candidates, one the step never runs (the vision tower between encoder and decoder) is left out
    and the others, run one after the other, are the backbone; before, the two equal ones were refused as a tie."""
    from lightning_pipe._model.split import _backbone_of

    model = _EncoderVisionDecoder()
    backbone, structure = _backbone_of(model, "auto", model.training_step, (torch.randn(2, 4), 0),
                                       torch.device("cpu"), True)
    assert backbone.paths == ("encoder", "decoder") and len(structure.hidden_at) == 4
