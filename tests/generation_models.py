"""Models that score themselves by generating, as fine-tuning scripts do (tests/test_generation.py).

- :class:`GenerativeLM`: a Hugging Face causal LM (Llama or GPT-2 from a tiny config, optionally wrapped in a peft
  LoRA adapter) fine-tuned on padded batches with ``-100`` labels. Its ``validation_step`` computes the loss, then
  calls ``self.model.generate(...)`` on left-padded prompts of different lengths (greedy, beam search or sampling
  with a seed), decodes the new tokens to text and scores them with torchmetrics' character error rate. Its
  ``predict_step`` returns the generated tokens.
- :class:`NanoGenerator`: nanoGPT's ``GPT.generate`` sampling loop (crop to the block size, temperature, top-k,
  ``multinomial`` or ``argmax`` on the last position) on the zoo's nanoGPT.

Both keep what they generated (``self.generated``) for the tests to compare with one device.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
import zoo
from torch.utils.data import DataLoader
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
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if family == "llama":
            config = LlamaConfig(
                vocab_size=zoo.VOCAB, hidden_size=zoo.DIM, intermediate_size=2 * zoo.DIM, num_hidden_layers=layers,
                num_attention_heads=zoo.HEADS, num_key_value_heads=2, max_position_embeddings=64,
                eos_token_id=EOS, pad_token_id=0, bos_token_id=1, initializer_range=INIT,
            )
            model: Any = LlamaForCausalLM(config)
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
        self.cer = CharErrorRate()
        self.generated: list[torch.Tensor] = []

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss

    def generate(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        prompt, mask, _ = prompts(batch)
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
        out = self.model.generate(input_ids=prompt, **options)
        return out[:, prompt.shape[1]:]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)
        new = self.generate(batch, batch_idx)
        self.generated.append(new.cpu())
        _, _, targets = prompts(batch)
        self.cer([text(t) for t in new], [text(t) for t in targets])
        self.log("val_cer", self.cer)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.generate(batch, batch_idx)


class NanoGenerator(zoo.Lit):
    """The zoo's nanoGPT with nanoGPT's own ``generate`` loop."""

    def __init__(self, sample: bool = False, inline: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = zoo.NanoGPT(4)
        self.sample = sample
        self.inline = inline  # the loop runs the model's parts itself instead of calling it: refused
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
        torch.manual_seed(7 + batch_idx)
        out = self.nanogpt_generate(x[:, :4], NEW_TOKENS, temperature=0.8, top_k=10)
        self.generated.append(out[:, 4:].cpu())
        self.log("val_first_token", out[:, 4].float().mean())
