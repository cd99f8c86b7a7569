"""Models built the way people bring them, each wrapped in an ordinary LightningModule.

- ``hf_llama`` / ``hf_gpt2``: Hugging Face ``transformers`` causal LMs from tiny configs (random weights, no
  download): blocks in ``model.model.layers`` / ``transformer.h`` (an ``nn.ModuleList`` run in a loop with masks and
  rotary tables), embeddings and head outside, the loss computed inside ``forward`` from ``labels``; GPT-2 ties its
  head to the token embedding.
- ``nanogpt``: nanoGPT's ``model.py`` structure: ``transformer.h`` loop, ``wte``/``wpe``/``drop`` before, ``ln_f``
  and a head tied to ``wte`` after, the loss inside ``forward`` when ``targets`` is given.
- ``vit``: timm's ViT structure: patch embedding, a class token and position embedding used as parameters directly,
  ``blocks`` an ``nn.Sequential`` called as a whole, norm and head after.
- ``resnet``: torchvision's ResNet structure: stem, ``layer1`` ... ``layer4`` (consecutive ``nn.Sequential``s whose
  first blocks change the shape), pooling and ``fc``.
- ``rope``: a GPT whose blocks take rotary ``cos``/``sin`` tables (buffers of the root module) and an attention mask
  built from the batch, litgpt-style.
- ``albert``: one block reused for every layer of the backbone (its parameters are shared by every stage).
- ``mixtral_aux``, ``qwen2_moe_aux``, ``qwen3_moe_aux``: Hugging Face mixture-of-experts LMs with the
  load-balancing loss (router logits recorded by hooks inside every block); ``sd3``: diffusers' SD3 transformer.
- ``mllama``: Hugging Face Mllama on image+text rows: the language layers mix self- and cross-attention classes and
  read the vision encoder's projected output.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, SEQ, HEADS = 48, 32, 8, 4


# ----------------------------------------------------------------------------------------------------- data
def tokens(n: int = 32, seed: int = 0, pad: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    if pad:  # the first positions of every other row are padding
        mask[::2, :2] = 0
    return TensorDataset(x, y, mask)


def images(n: int = 32, seed: int = 0, size: int = 16, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))


def latents(n: int = 32, seed: int = 0, tokens: int = 16, channels: int = 8) -> TensorDataset:
    """Diffusion training rows: packed image latents, text embeddings and their pooled vector, a timestep in (0, 1)
    and the noise (drawn here, so that every run sees the same)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, tokens, channels, generator=g), torch.randn(n, 4, 16, generator=g),
        torch.randn(n, 8, generator=g), torch.rand(n, generator=g), torch.randn(n, tokens, channels, generator=g),
    )


def finetuning(n: int = 32, seed: int = 0, kind: str = "padded") -> list[dict[str, torch.Tensor]]:
    """Rows as LLM fine-tuning has them, for :func:`pad_collate`: ``input_ids`` and ``labels`` (``-100`` where no
    loss is taken).

    - ``padded``: lengths from 3 to 16 tokens, so every batch pads to its own length; labels on every real token.
    - ``prompt``: 12 tokens each, the first 2 to 11 of them a prompt whose labels are ``-100``; in rows 0 and 1 every
      label is ``-100`` (a microbatch that holds no target at all).
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(3, 17, (), generator=g)) if kind == "padded" else 12
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        labels = ids.clone()
        if kind == "prompt":
            prompt = length if i < 2 else int(torch.randint(2, 12, (), generator=g))
            labels[:prompt] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def pad_collate(rows: list[dict[str, torch.Tensor]], multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest row, as a padding collator does: token 0, ``attention_mask`` 0, label ``-100``;
    rounded up to a multiple of ``multiple_of`` (``pad_to_multiple_of``: a sequence-parallel model splits the
    sequence evenly over its tensor ranks)."""
    length = -(-max(len(r["input_ids"]) for r in rows) // multiple_of) * multiple_of
    batch = {
        "input_ids": torch.zeros(len(rows), length, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100, dtype=torch.long),
    }
    for i, r in enumerate(rows):
        batch["input_ids"][i, : len(r["input_ids"])] = r["input_ids"]
        batch["attention_mask"][i, : len(r["input_ids"])] = 1
        batch["labels"][i, : len(r["labels"])] = r["labels"]
    return batch


def loader(
    name: str, n: int = 32, batch_size: int = 8, seed: int = 0, kind: Optional[str] = None, multiple_of: int = 1
) -> DataLoader:
    """Data for the zoo model ``name``: images for the vision models, tokens (padded for ``rope``) otherwise, or
    fine-tuning rows (:func:`finetuning`) of ``kind``, padded to a multiple of ``multiple_of``."""
    if kind is not None:
        collate = functools.partial(pad_collate, multiple_of=multiple_of)
        return DataLoader(finetuning(n, seed, kind), batch_size=batch_size, collate_fn=collate)
    if name == "flux":
        return DataLoader(latents(n, seed), batch_size=batch_size)
    if name == "mllama":
        return DataLoader(image_text(n, seed), batch_size=batch_size)
    if name in ("pixart", "sd3"):  # 4 channels of 8 x 8
        return DataLoader(latents(n, seed, tokens=64, channels=4), batch_size=batch_size)
    data = images(n, seed) if name in ("vit", "resnet") else tokens(n, seed, pad=name == "rope")
    return DataLoader(data, batch_size=batch_size)


# ----------------------------------------------------------------------------------------------------- base
class Lit(L.LightningModule):
    """The LightningModule every zoo model uses: cross-entropy on the output, SGD with momentum or AdamW."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd", scheduler: bool = True) -> None:
        super().__init__()
        self.lr, self.optimizer_name, self.use_scheduler = lr, optimizer, scheduler

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ----------------------------------------------------------------------------------------------------- Hugging Face
class HFCausalLM(Lit):
    """A ``transformers`` causal LM, with only the LightningModule around it."""

    def __init__(self, family: str = "llama", layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if family == "llama":
            config = LlamaConfig(
                vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
            )
            self.model = LlamaForCausalLM(config)
        else:
            config = GPT2Config(
                vocab_size=VOCAB, n_embd=DIM, n_layer=layers, n_head=HEADS, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )
            self.model = GPT2LMHeadModel(config)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Any:
        return self.model(input_ids=x, labels=labels)

    def loss(self, batch: Any) -> torch.Tensor:
        x, _, _ = batch
        return self(x, labels=x).loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).logits.argmax(-1)


class HFFineTuned(HFCausalLM):
    """A ``transformers`` causal LM fine-tuned on padded batches: ``attention_mask`` and ``-100`` labels."""

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)


class HFMoE(Lit):
    """A ``transformers`` mixture-of-experts causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE) with the load-balancing loss
    (``output_router_logits=True``, a nonzero ``router_aux_loss_coef``): the router logits every block's gate
    returns are collected by ``transformers``' output-capturing hooks and read by the code after the backbone.

    The load-balancing loss is a statistic of the rows it sees, as BatchNorm's is: under the pipeline it is computed
    per microbatch (as under DDP or gradient accumulation). ``group`` rows per loss call (the microbatch's rows) make
    one device compute the same: the step's loss is the mean over groups."""

    def __init__(self, family: str = "mixtral", layers: int = 4, group: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import transformers

        common = dict(
            vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=layers,
            num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.5,
        )
        if family == "mixtral":
            config = transformers.MixtralConfig(num_local_experts=4, **common)
            self.model = transformers.MixtralForCausalLM(config)
        elif family == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(
                num_experts=4, moe_intermediate_size=DIM, shared_expert_intermediate_size=DIM, **common
            )
            self.model = transformers.Qwen2MoeForCausalLM(config)
        else:
            config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=DIM, head_dim=8, **common)
            self.model = transformers.Qwen3MoeForCausalLM(config)
        self.group = group

    def loss(self, batch: Any) -> torch.Tensor:
        x = batch[0]
        group = self.group or len(x)
        return torch.stack([self.model(input_ids=x[i : i + group], labels=x[i : i + group]).loss
                            for i in range(0, len(x), group)]).mean()


class DemoLM(Lit):
    """Lightning's demo language model as ``examples/pytorch/basics/transformer.py`` trains it: an ``nn.Transformer``
    (encoder layers, then decoder layers that cross-attend to the encoder's normed output), ``nll_loss`` on its
    log-probabilities; dropout 0."""

    def __init__(self, layers: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=DIM, nhead=HEADS, nhid=2 * DIM, nlayers=layers, dropout=0.0)

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, target, _ = batch
        return F.nll_loss(self.model(inputs, target), target.view(-1))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target, _ = batch
        return self.model(inputs, target).argmax(-1)


class HFSeq2Seq(Lit):
    """Hugging Face T5 (or BART) as shipped, trained on padded batches: the targets are the inputs (a copy task),
    padded with ``-100``."""

    def __init__(self, family: str = "t5", layers: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if family == "t5":
            from transformers import T5Config, T5ForConditionalGeneration

            config = T5Config(
                vocab_size=VOCAB, d_model=DIM, d_kv=DIM // HEADS, d_ff=2 * DIM, num_layers=layers,
                num_decoder_layers=layers, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
                pad_token_id=0, relative_attention_num_buckets=8,
            )
            self.model = T5ForConditionalGeneration(config)
        else:
            from transformers import BartConfig, BartForConditionalGeneration

            config = BartConfig(
                vocab_size=VOCAB, d_model=DIM, encoder_layers=layers, decoder_layers=layers,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * DIM,
                decoder_ffn_dim=2 * DIM, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
            self.model = BartForConditionalGeneration(config)

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).logits.argmax(-1)


class Flux(Lit):
    """diffusers' Flux transformer as shipped (tiny config, random weights), trained by flow matching: double-stream
    blocks carry two states, the image's and the text's, into single-stream blocks; every block and the final norm
    take ``temb`` from the time and text embedders."""

    def __init__(self, layers: int = 2, single_layers: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from diffusers import FluxTransformer2DModel

        self.model = FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=layers, num_single_layers=single_layers, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
        )
        side = torch.arange(4)
        self.register_buffer("img_ids", torch.stack([torch.zeros(16), side.repeat(4), side.repeat_interleave(4)], 1),
                             persistent=False)
        self.register_buffer("txt_ids", torch.zeros(4, 3), persistent=False)

    def predict(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x0, text, pooled, t, noise = batch
        noisy = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        out = self.model(
            hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
            img_ids=self.img_ids, txt_ids=self.txt_ids, return_dict=False,
        )[0]
        return out, noise - x0

    def loss(self, batch: Any) -> torch.Tensor:
        out, target = self.predict(batch)
        return F.mse_loss(out, target)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.predict(batch)[0]


class SD3(Lit):
    """diffusers' SD3 transformer as shipped (tiny config, random weights), trained by flow matching: joint blocks
    carry the text and image streams; the last block is ``context_pre_only`` and returns ``(None, hidden_states)``;
    every block and the final norm take ``temb``."""

    def __init__(self, layers: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from diffusers import SD3Transformer2DModel

        self.model = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=layers, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
            out_channels=4, pos_embed_max_size=8,
        )

    def predict(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x0, text, pooled, t, noise = batch
        image, noise = x0.reshape(-1, 4, 8, 8), noise.reshape(-1, 4, 8, 8)
        noisy = (1 - t[:, None, None, None]) * image + t[:, None, None, None] * noise
        out = self.model(
            hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=t * 1000,
            return_dict=False,
        )[0]
        return out, noise - image

    def loss(self, batch: Any) -> torch.Tensor:
        out, target = self.predict(batch)
        return F.mse_loss(out, target)


class PixArt(Lit):
    """diffusers' PixArt-alpha transformer as shipped (tiny config, random weights), trained to predict the noise:
    every block takes the adaLN timestep embedding and the projected caption, both computed from parameters before
    the blocks; the output modulation reads the embedded timestep again after them."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from diffusers import PixArtTransformer2DModel

        self.model = PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=layers,
            cross_attention_dim=16, sample_size=8, patch_size=2, norm_num_groups=1, caption_channels=16,
        )

    def predict(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x0, text, _, t, noise = batch
        image, noise = x0.reshape(-1, 4, 8, 8), noise.reshape(-1, 4, 8, 8)
        alpha = (1 - t)[:, None, None, None]
        noisy = alpha.sqrt() * image + (1 - alpha).sqrt() * noise
        out = self.model(
            noisy, encoder_hidden_states=text, timestep=(t * 999).long(),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False,
        )[0]
        return out, noise

    def loss(self, batch: Any) -> torch.Tensor:
        out, target = self.predict(batch)
        return F.mse_loss(out, target)


class Mllama(Lit):
    """Hugging Face Mllama (Llama 3.2 Vision) as shipped (tiny config, random weights), on image+text rows: a vision
    encoder (two local layers, one global) whose projected output every cross-attention layer of the language model
    reads; the language layers mix self-attention and cross-attention classes (cross-attention at layer 3 only, so
    the two stages of a 2-process pipeline differ in kind); the loss inside ``forward`` from ``labels``."""

    def __init__(self, layers: int = 4, cross: tuple[int, ...] = (3,), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import MllamaConfig, MllamaForConditionalGeneration

        config = MllamaConfig(
            vision_config=dict(
                image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_global_layers=1,
                attention_heads=4, intermediate_size=32, vision_output_dim=32, intermediate_layers_indices=[0],
                max_num_tiles=1, supported_aspect_ratios=[[1, 1]],
            ),
            text_config=dict(
                vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=layers, num_attention_heads=HEADS,
                num_key_value_heads=2, intermediate_size=2 * DIM, max_position_embeddings=64,
                cross_attention_layers=list(cross), pad_token_id=0, bos_token_id=1, eos_token_id=2,
            ),
            image_token_index=VOCAB,
        )
        self.model = MllamaForConditionalGeneration(config)

    def forward(self, batch: Any, labels: Optional[torch.Tensor] = None) -> Any:
        ids, pixels = batch[0], batch[1]
        n = ids.shape[0]
        ones = torch.ones(n, 1, dtype=torch.long, device=ids.device)
        return self.model(
            input_ids=ids, pixel_values=pixels, aspect_ratio_ids=ones, aspect_ratio_mask=ones[:, :, None],
            cross_attention_mask=batch[2], labels=labels,
        )

    def loss(self, batch: Any) -> torch.Tensor:
        labels = batch[0].masked_fill(batch[0] == VOCAB, -100)
        return self(batch, labels=labels).loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch).logits.argmax(-1)


def image_text(n: int = 32, seed: int = 0) -> TensorDataset:
    """Mllama rows: tokens behind an image token, one 8 x 8 image of one tile, and which tokens see the image (the
    image token's row sees none: a fully masked cross-attention row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    x[:, 0] = VOCAB
    pixels = torch.randn(n, 1, 1, 3, 8, 8, generator=g)
    sees = torch.ones(n, SEQ, 1, 1, dtype=torch.long)
    sees[:, 0] = 0
    return TensorDataset(x, pixels, sees)


class MaskedLoss(Lit):
    """A hand-written causal LM whose loss is a sum over the tokens with a label, divided by ``mask.sum()``.

    ``num_items=True``: ``training_step`` also returns that count, the documented way to make it exact under the
    pipeline; ``False``: it returns the loss alone, which the pipeline cannot weight (and warns about).
    """

    def __init__(self, layers: int = 4, num_items: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.return_num_items = num_items
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([NanoBlock() for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def sum_and_count(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["input_ids"])
        mask = batch["labels"] != -100
        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].clamp(min=0).flatten(), reduction="none")
        return (per_token * mask.flatten()).sum(), mask.sum()

    def loss(self, batch: Any) -> torch.Tensor:
        total, count = self.sum_and_count(batch)
        return total / count

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        total, count = self.sum_and_count(batch)
        loss = total / count
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "num_items": count} if self.return_num_items else loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"]).argmax(-1)


# ----------------------------------------------------------------------------------------------------- nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), CausalSelfAttention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: the head tied to the token embedding, the loss inside ``forward`` when targets are given."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM),
            wpe=nn.Embedding(SEQ, DIM),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([NanoBlock() for _ in range(layers)]),
            ln_f=nn.LayerNorm(DIM),
        ))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class LitNanoGPT(Lit):
    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = NanoGPT(layers)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        _, loss = self.model(x, y)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, _ = self.model(batch[0])
        return logits.argmax(-1)


# ----------------------------------------------------------------------------------------------------- timm ViT
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class VitBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int = 4) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, DIM, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    """timm's layout: ``cls_token`` and ``pos_embed`` are parameters of this module, read directly."""

    def __init__(self, depth: int = 4, classes: int = 10, size: int = 16, patch: int = 4) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, DIM) * 0.02)
        self.pos_drop = nn.Dropout(0.0)
        self.norm_pre = nn.Identity()
        self.blocks = nn.Sequential(*[VitBlock() for _ in range(depth)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, classes)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        x = self.blocks(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)[:, 0])


class LitVit(Lit):
    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = VisionTransformer(depth=layers)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)


# --------------------------------------------------------------------------------------------- torchvision ResNet
class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1, norm: Any = None) -> None:
        super().__init__()
        norm = norm or nn.BatchNorm2d
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), norm(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(4, channels)


class ResNet(nn.Module):
    """torchvision's ``_forward_impl``: stem, four consecutive containers, pooling and ``fc``."""

    def __init__(
        self, layers: tuple[int, ...] = (1, 1, 1, 1), classes: int = 10, batchnorm: bool = False
    ) -> None:
        super().__init__()
        norm = None if batchnorm else _group_norm
        width = 8
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = (norm or nn.BatchNorm2d)(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        for i, blocks in enumerate(layers):
            stride = 1 if i == 0 else 2
            out = width * 2**i
            first = BasicBlock(inplanes, out, stride, norm)
            rest = [BasicBlock(out, out, 1, norm) for _ in range(blocks - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(first, *rest))
            inplanes = out
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


class LitResNet(Lit):
    def __init__(self, layers: tuple[int, ...] = (1, 1, 1, 1), batchnorm: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = ResNet(tuple(layers), batchnorm=batchnorm)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)


# ----------------------------------------------------------------------------------------------------- RoPE GPT
def rope_tables(head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class RopeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class RopeGPT(Lit):
    """litgpt-style: ``cos``/``sin`` are buffers of this module, sliced per call; the mask comes from the batch."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([RopeBlock() for _ in range(layers)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)
        cos, sin = rope_tables(DIM // HEADS, 64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=idx.device)  # every row attends somewhere
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, mask = batch
        logits = self(x, mask)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], batch[2]).argmax(-1)


# ----------------------------------------------------------------------------------------------------- ALBERT-style
class Albert(Lit):
    """One block reused for every layer: its parameters are shared by every stage that runs a layer."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.shared = NanoBlock()
        self.layers = nn.ModuleList([self.shared for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)


# ----------------------------------------------------------------------------------------------------- tensor parallel
class LlamaBlock(nn.Module):
    """A Llama-style block as torchtitan writes one: separate q/k/v/o projections and a SwiGLU MLP, the head count
    taken from the projection's width (``view(b, t, -1, head_dim)``), so a column-wise split gives each tensor rank
    its own heads."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


#: The plan torchtitan gives such a block, relative to the block.
LLAMA_TP_PLAN = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
                 "w1": "colwise", "w3": "colwise", "w2": "rowwise"}


class LlamaTP(Lit):
    """A hand-built Llama: embedding, blocks in a ModuleList taking RoPE tables, RMSNorm, head."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([LlamaBlock() for _ in range(layers)])
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        cos, sin = rope_tables(DIM // HEADS, 64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return self.output(self.norm(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)


class LlamaUserTP(LlamaTP):
    """:class:`LlamaTP` whose ``configure_model`` splits its blocks itself, as Lightning's ``ModelParallelStrategy``
    documentation teaches (``self.device_mesh["tensor_parallel"]``, ``parallelize_module``); a no-op on one device."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in self.layers:
            parallelize_module(layer, mesh["tensor_parallel"], {k: styles[v]() for k, v in LLAMA_TP_PLAN.items()})


class SPAttention(nn.Module):
    """torchtitan's ``Attention``: its input is whole (``PrepareModuleInput`` gathers the sequence shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class SPFeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SPBlock(nn.Module):
    """torchtitan's ``TransformerBlock``: ``attention`` and ``feed_forward`` submodules, which its sequence-parallel
    plan prepares the inputs of."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), SPAttention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), SPFeedForward()
        self.input_lengths: set[int] = set()  # the sequence lengths this block was given (its shard's, under SP)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.input_lengths.add(x.shape[1])
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaSP(LlamaTP):
    """A Llama fine-tuned on padded batches whose ``configure_model`` is torchtitan's (and Lightning's example's)
    sequence-parallel plan, written for Lightning's ``ModelParallelStrategy``:

    - the embedding ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``: each tensor rank gets
      its sequence shard of the embedded tokens (``embed_output="replicate"``: the whole output, and
      ``PrepareModuleInput`` on ``layers.0`` shards it, as Lightning's example does);
    - in each block ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the sequence before ``attention`` and
      ``feed_forward``, column-wise projections and row-wise ``wo``/``w2`` that reduce-scatter to ``Shard(1)``: the
      activations between blocks, and so between stages, are sequence shards;
    - the final norm ``SequenceParallel()``, the head ``ColwiseParallel(input_layouts=Shard(1),
      output_layouts=Shard(-1), use_local_output=False)``: vocabulary-sharded logits (a DTensor), whose
      cross-entropy (``ignore_index=-100``, labels shifted as Hugging Face does) runs under ``loss_parallel()`` in
      ``training_step``, and ``backward`` enters it too (Lightning's example's override);
    - ``tie=True``: the head's weight is the embedding's (one Parameter), split by both styles (``Shard(0)`` both).

    No-op without a tensor-parallel mesh (one device, or ``tensor_parallel_size=1``).
    """

    def __init__(self, layers: int = 4, tie: bool = False, embed_output: str = "shard", **kwargs: Any) -> None:
        super().__init__(layers=0, **kwargs)
        self.layers = nn.ModuleList([SPBlock() for _ in range(layers)])
        if tie:  # initialised as GPT-2 initialises its tied embedding (N(0, 1) rows make the logits explode)
            self.output.weight = self.tok_embeddings.weight
            nn.init.normal_(self.output.weight, std=0.02)
        self.embed_output = embed_output

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()) or mesh["tensor_parallel"].size() == 1:
            return
        tp_mesh = mesh["tensor_parallel"]
        outside = {
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
        if self.embed_output == "shard":  # torchtitan
            outside["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        else:  # Lightning's example
            outside["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
            outside["layers.0"] = PrepareModuleInput(
                input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            )
        parallelize_module(self, tp_mesh, outside)
        for block in self.layers:
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            })

    def on_train_start(self) -> None:  # what the blocks are given in training (not the strategy's setup analysis)
        for layer in self.layers:
            layer.input_lengths.clear()

    def loss(self, batch: Any) -> torch.Tensor:
        logits = self(batch["input_ids"])  # vocabulary-sharded (a DTensor) under tensor parallelism
        labels = batch["labels"]
        with loss_parallel():
            return F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )

    def backward(self, *args: Any, **kwargs: Any) -> None:
        with loss_parallel():
            super().backward(*args, **kwargs)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"]).argmax(-1)


ZOO = {
    "llama_tp": LlamaTP,
    "llama_tp_user": LlamaUserTP,
    "llama_sp": LlamaSP,
    "hf_llama": lambda **kw: HFCausalLM("llama", **kw),
    "hf_gpt2": lambda **kw: HFCausalLM("gpt2", **kw),
    "hf_llama_ft": lambda **kw: HFFineTuned("llama", **kw),
    "hf_gpt2_ft": lambda **kw: HFFineTuned("gpt2", **kw),
    "masked": MaskedLoss,
    "demo_lm": DemoLM,
    "t5": lambda **kw: HFSeq2Seq("t5", **kw),
    "bart": lambda **kw: HFSeq2Seq("bart", **kw),
    "flux": Flux,
    "pixart": PixArt,
    "mllama": Mllama,
    "nanogpt": LitNanoGPT,
    "vit": LitVit,
    "resnet": LitResNet,
    "rope": RopeGPT,
    "albert": Albert,
    "mixtral_aux": lambda **kw: HFMoE("mixtral", **kw),
    "qwen2_moe_aux": lambda **kw: HFMoE("qwen2_moe", **kw),
    "qwen3_moe_aux": lambda **kw: HFMoE("qwen3_moe", **kw),
    "sd3": SD3,
}


def make(name: str, seed: int = 1234, **kwargs: Any) -> L.LightningModule:
    torch.manual_seed(seed)
    return ZOO[name](**kwargs)

