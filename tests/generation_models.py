"""Models that score themselves by generating, as fine-tuning scripts do (tests/test_generation.py).

- :class:`GenerativeLM`: a Hugging Face causal LM (Llama or GPT-2 from a tiny config, optionally wrapped in a peft
  LoRA adapter), or an encoder-decoder (T5, Bart: the prompt is the encoder's input), fine-tuned on padded batches
  with ``-100`` labels. Its ``validation_step`` computes the loss, then
  calls ``self.model.generate(...)`` on left-padded prompts of different lengths (greedy, beam search or sampling
  with a seed), decodes the new tokens to text and scores them with torchmetrics' character error rate. Its
  ``predict_step`` returns the generated tokens.
- :class:`NanoGenerator`: nanoGPT's ``GPT.generate`` sampling loop (crop to the block size, temperature, top-k,
  ``multinomial`` or ``argmax`` on the last position) on the zoo's nanoGPT.
- :class:`LitGPTGenerator`: litgpt's model structure and decoding loop (``set_kv_cache``: a ``KVCache`` of the whole
  batch in each block's attention, written at ``input_pos``; prefill, then one token at a time). litgpt itself pins
  ``huggingface-hub<1.4``, which would hold ``transformers`` back, so its parts are copied here.

Both keep what they generated (``self.generated``) for the tests to compare with one device.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
import zoo
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.text import CharErrorRate

EOS = 3  # a token the random models sometimes pick: some rows stop before the others
NEW_TOKENS = 16
#: Weights drawn wide enough that the logits are far apart: at the default 0.02 the tiny random models' logits lie
#: within 1e-6 of each other, and a microbatch of 2 rows rounds differently from a batch of 8 (another matrix kernel),
#: which flips an argmax between two numerically tied tokens. That is not the pipeline's doing.
INIT = 0.3


def loader(n: int = 16, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Fine-tuning rows with a prompt whose labels are ``-100``, padded per batch (``zoo.finetuning``)."""
    return DataLoader(zoo.finetuning(n, seed, "prompt"), batch_size=batch_size, collate_fn=zoo.pad_collate)


def prompts(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Left-padded prompts of 2 to 6 tokens taken from the batch's rows, their attention mask, and each row's
    continuation (the reference text)."""
    ids = batch["input_ids"]
    lengths = [2 + (i * 3) % 5 for i in range(ids.shape[0])]
    width = max(lengths)
    prompt = torch.zeros(ids.shape[0], width, dtype=torch.long, device=ids.device)
    mask = torch.zeros_like(prompt)
    for i, length in enumerate(lengths):
        prompt[i, width - length:] = ids[i, :length]
        mask[i, width - length:] = 1
    return prompt, mask, [ids[i, lengths[i]:] for i in range(ids.shape[0])]


def text(tokens: torch.Tensor) -> str:
    """Tokens as text: one letter per token, up to the end-of-sequence token."""
    out = []
    for t in tokens.tolist():
        if t == EOS:
            break
        out.append(chr(ord("a") + t % 26) if t % 3 else " ")
    return "".join(out)


class GenerativeLM(zoo.Lit):
    def __init__(self, family: str = "llama", decode: str = "greedy", lora: bool = False, layers: int = 4,
                 generate_first: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        self.seq2seq = family in ("t5", "bart")  # issue 36: encoder-decoder, `layers // 2` blocks in each
        if family == "t5":
            from transformers import T5Config, T5ForConditionalGeneration

            config = T5Config(
                vocab_size=zoo.VOCAB, d_model=zoo.DIM, d_kv=zoo.DIM // zoo.HEADS, d_ff=2 * zoo.DIM, num_heads=zoo.HEADS,
                num_layers=layers // 2, num_decoder_layers=layers // 2, dropout_rate=0.0, eos_token_id=EOS,
                pad_token_id=0, decoder_start_token_id=0,
            )
            model: Any = T5ForConditionalGeneration(config)
        elif family == "bart":
            from transformers import BartConfig, BartForConditionalGeneration

            config = BartConfig(
                vocab_size=zoo.VOCAB, d_model=zoo.DIM, encoder_layers=layers // 2, decoder_layers=layers // 2,
                encoder_attention_heads=zoo.HEADS, decoder_attention_heads=zoo.HEADS, encoder_ffn_dim=2 * zoo.DIM,
                decoder_ffn_dim=2 * zoo.DIM, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, init_std=INIT, eos_token_id=EOS, pad_token_id=0, bos_token_id=1,
                decoder_start_token_id=EOS, forced_eos_token_id=None,
            )
            model = BartForConditionalGeneration(config)
        elif family == "llama":
            config = LlamaConfig(
                vocab_size=zoo.VOCAB, hidden_size=zoo.DIM, intermediate_size=2 * zoo.DIM, num_hidden_layers=layers,
                num_attention_heads=zoo.HEADS, num_key_value_heads=2, max_position_embeddings=64,
                eos_token_id=EOS, pad_token_id=0, bos_token_id=1, initializer_range=INIT,
            )
            model = LlamaForCausalLM(config)
        else:
            config = GPT2Config(
                vocab_size=zoo.VOCAB, n_embd=zoo.DIM, n_layer=layers, n_head=zoo.HEADS, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=EOS, pad_token_id=0, bos_token_id=1,
                initializer_range=INIT,
            )
            model = GPT2LMHeadModel(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0, init_lora_weights=False))
        self.model = model
        self.decode = decode
        self.generate_first = generate_first  # issue 36: the step's first model call is generate()'s, unpadded
        self.cer = CharErrorRate()
        self.mean_loss = MeanMetric()  # updated before generating: the first batch must not count it twice
        self.generated: list[torch.Tensor] = []

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss

    def prompts(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
        """:func:`prompts`, or with ``generate_first`` each row's first 8 tokens, unpadded, without a mask."""
        if not self.generate_first:
            return prompts(batch)
        ids = batch["input_ids"]
        return ids[:, :8], None, list(ids[:, 8:])

    def generate(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        prompt, mask, _ = self.prompts(batch)
        options: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "attention_mask": mask, "pad_token_id": 0}
        if self.decode == "beam":
            options.update(num_beams=2, do_sample=False)
        elif self.decode == "sample":
            torch.manual_seed(100 + batch_idx)
            options.update(do_sample=True, top_k=20, temperature=0.9)
        elif self.decode == "static":  # a cache the pipeline cannot split: refused at the first call
            options.update(do_sample=False, cache_implementation="static")
        else:
            options.update(do_sample=False)
        if self.seq2seq:  # the prompt is the encoder's input; the decoder's start token begins the output
            options["min_new_tokens"] = NEW_TOKENS
            return self.model.generate(input_ids=prompt, **options)[:, 1:]
        out = self.model.generate(input_ids=prompt, **options)
        return out[:, prompt.shape[1]:]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        new = self.generate(batch, batch_idx) if self.generate_first else None
        loss = self.loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.mean_loss.update(loss)
        self.log("val_mean_loss", self.mean_loss)
        new = self.generate(batch, batch_idx) if new is None else new
        self.generated.append(new.cpu())
        _, _, targets = self.prompts(batch)
        self.cer([text(t) for t in new], [text(t) for t in targets])
        self.log("val_cer", self.cer)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.generate(batch, batch_idx)


def _failing_after(count: int) -> Any:
    calls = [0]

    def hook(module: Any, args: Any) -> None:
        if not torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] > count:
                raise ValueError(f"the head refuses its call {calls[0]}")

    return hook


class NanoGenerator(zoo.Lit):
    """The zoo's nanoGPT with nanoGPT's own ``generate`` loop."""

    def __init__(self, sample: bool = False, inline: bool = False, fail_after: Optional[int] = None,
                 fail_at_once: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = zoo.NanoGPT(4)
        self.sample = sample
        self.inline = inline  # the loop runs the model's parts itself instead of calling it: refused
        if fail_after is not None:  # the head (on the last stage only) raises in the decoding step after that many
            self.model.lm_head.register_forward_pre_hook(_failing_after(fail_after))
        self.fail_at_once = fail_at_once  # the step raises after its loss: on the last stage, in the batch's one pass
        self.generated: list[torch.Tensor] = []

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return self.model(x, y)[1]

    @torch.no_grad()
    def nanogpt_generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                         top_k: Optional[int] = None) -> torch.Tensor:
        for _ in range(max_new_tokens):  # nanoGPT's GPT.generate, as written there
            idx_cond = idx if idx.size(1) <= zoo.SEQ else idx[:, -zoo.SEQ:]
            if self.inline:
                t = self.model.transformer
                x = t.wte(idx_cond) + t.wpe(torch.arange(idx_cond.shape[1], device=idx.device))
                for block in t.h:
                    x = block(x)
                logits = self.model.lm_head(t.ln_f(x))
            else:
                logits, _ = self.model(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            if self.sample:
                idx_next = torch.multinomial(probs, num_samples=1)
            else:
                idx_next = probs.argmax(-1, keepdim=True)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _, _ = batch
        self.log("val_loss", self.loss(batch), sync_dist=True)
        if self.fail_at_once:
            raise ValueError("the step refuses its batch")
        torch.manual_seed(7 + batch_idx)
        out = self.nanogpt_generate(x[:, :4], NEW_TOKENS, temperature=0.8, top_k=10)
        self.generated.append(out[:, 4:].cpu())
        self.log("val_first_token", out[:, 4].float().mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.manual_seed(batch_idx)
        return self.nanogpt_generate(batch[0][:, :4], NEW_TOKENS, top_k=5)[:, 4:]


# ----------------------------------------------------------------------------------------------------- litgpt
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache(torch.nn.Module):
    """litgpt's ``KVCache``: buffers for the whole batch, written with ``index_copy_`` at ``input_pos``."""

    def __init__(self, shape: tuple[int, ...], device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def forward(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = self.k.to(k.dtype)
        self.v = self.v.to(v.dtype)
        n = k.size(0)  # as litgpt: the first n rows
        k = self.k[:n, ...].index_copy_(2, input_pos, k)
        v = self.v[:n, ...].index_copy_(2, input_pos, v)
        return k, v


class LitAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(zoo.DIM, 3 * zoo.DIM), torch.nn.Linear(zoo.DIM, zoo.DIM)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, zoo.HEADS, c // zoo.HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if input_pos is not None:
            if not isinstance(self.kv_cache, KVCache):
                raise TypeError("You need to call `gpt.set_kv_cache()`")
            k, v = self.kv_cache(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def build_kv_cache(self, batch_size: int, max_seq_length: int, device: Any = None, dtype: Any = None) -> KVCache:
        return KVCache((batch_size, zoo.HEADS, max_seq_length, zoo.DIM // zoo.HEADS), device, dtype)


class LitBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.attn = torch.nn.LayerNorm(zoo.DIM), LitAttention()
        self.norm_2, self.mlp = torch.nn.LayerNorm(zoo.DIM), zoo.MLP()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.norm_2(x))


class LitGPT(torch.nn.Module):
    """litgpt's ``GPT``: rotary tables as buffers, a mask cache and per-block key-value caches made by
    ``set_kv_cache``, ``forward(idx, input_pos)``."""

    max_seq_length = 32

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(zoo.DIM, zoo.VOCAB, bias=False)
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(zoo.VOCAB, zoo.DIM), h=torch.nn.ModuleList(LitBlock() for _ in range(layers)),
            ln_f=torch.nn.LayerNorm(zoo.DIM),
        ))
        half = zoo.DIM // zoo.HEADS // 2
        angles = torch.outer(torch.arange(self.max_seq_length).float(), 10000 ** (-torch.arange(half) / half))
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)
        self.mask_cache: Optional[torch.Tensor] = None

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.size(1)
        if input_pos is not None:
            cos, sin = self.cos.index_select(0, input_pos), self.sin.index_select(0, input_pos)
            if self.mask_cache is None:
                raise TypeError("You need to call `gpt.set_kv_cache()`")
            mask = self.mask_cache.index_select(2, input_pos)
        else:
            cos, sin, mask = self.cos[:t], self.sin[:t], None
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin, mask, input_pos)
        return self.lm_head(self.transformer.ln_f(x))

    def set_kv_cache(self, batch_size: int, device: Any = None, dtype: Any = None) -> None:
        size = self.max_seq_length
        self.mask_cache = torch.ones(size, size, device=device, dtype=torch.bool).tril()[None, None]
        for block in self.transformer.h:
            block.attn.kv_cache = block.attn.build_kv_cache(batch_size, size, device, dtype)

    def clear_kv_cache(self) -> None:
        self.mask_cache = None
        for block in self.transformer.h:
            block.attn.kv_cache = None


class LitGPTGenerator(zoo.Lit):
    """litgpt's model with litgpt's decoding loop: ``set_kv_cache``, prefill at ``input_pos = arange(T)``, then one
    token at a time at the next position, ``clear_kv_cache``."""

    def __init__(self, sample: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = LitGPT()
        self.sample = sample
        self.generated: list[torch.Tensor] = []

    def loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def litgpt_generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        self.model.set_kv_cache(prompt.shape[0], device=prompt.device)
        input_pos = torch.arange(prompt.shape[1], device=prompt.device)
        x, tokens = prompt, []
        for _ in range(max_new_tokens):
            logits = self.model(x, input_pos)[:, -1]
            if self.sample:
                probs = torch.softmax(logits / 0.8, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            input_pos = input_pos[-1:] + 1
            x = nxt
        self.model.clear_kv_cache()
        return torch.cat(tokens, dim=1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _, _ = batch
        self.log("val_loss", self.loss(batch), sync_dist=True)
        torch.manual_seed(11 + batch_idx)
        new = self.litgpt_generate(x[:, :6], NEW_TOKENS)
        self.generated.append(new.cpu())
        self.log("val_first_token", new[:, 0].float().mean())
