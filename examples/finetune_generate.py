"""Fine-tune a Hugging Face causal LM with pipeline parallelism and score it by generating, as fine-tuning scripts do.

The task is small enough to learn on a laptop CPU: copy a string of letters after a separator (``"hdbia=" ->
"hdbia."``). The LightningModule is what a fine-tuning script holds:

- ``training_step`` computes the model's own loss from ``labels`` whose prompt positions are ``-100``, on batches
  padded per batch;
- ``validation_step`` logs the loss, then calls ``self.model.generate(...)`` on the left-padded prompts, decodes the
  new tokens to text, and logs the exact-match rate and a character error rate (torchmetrics), and one sample;
- ``predict_step`` returns the completions as text.

The only pipeline-specific line is ``strategy=PipelineStrategy(...)``. Under it, each model call that ``generate()``
makes (the prompt, then one per new token) runs through the stages in microbatches, each stage keeps the key-value
cache of its own layers, and the logits reach every rank, so every rank runs ``generate()``'s loop alike
(docs/evaluation.md, "Generation"). The tokens equal one device's.

    python examples/finetune_generate.py                  # 2 CPU processes (gloo), or every GPU when CUDA exists
    python examples/finetune_generate.py --devices 1      # one process, no strategy, for comparison
    python examples/finetune_generate.py --num-beams 2    # beam search
"""

from __future__ import annotations

import argparse
import random
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.text import CharErrorRate
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_pipe import PipelineStrategy

LETTERS = "abcdefghij"
PAD, BOS, EQUALS, END = 0, 1, 2, 3  # then one token per letter
VOCAB = 4 + len(LETTERS)


def encode(text: str) -> list[int]:
    return [4 + LETTERS.index(c) for c in text]


def decode(tokens: list[int]) -> str:
    out = []
    for t in tokens:
        if t == END or t == PAD:
            break
        out.append(LETTERS[t - 4] if t >= 4 else "?")
    return "".join(out)


def examples(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` strings of 2 to 6 letters: prompt ``<bos> letters =``, answer ``letters <end>``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 6)))
        rows.append({"prompt": [BOS, *encode(word), EQUALS], "answer": [*encode(word), END], "word": word})
    return rows


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Training rows right-padded (labels ``-100`` on the prompt and the padding), prompts left-padded."""
    length = max(len(r["prompt"]) + len(r["answer"]) for r in rows)
    width = max(len(r["prompt"]) for r in rows)
    n = len(rows)
    batch = {
        "input_ids": torch.full((n, length), PAD), "attention_mask": torch.zeros(n, length, dtype=torch.long),
        "labels": torch.full((n, length), -100),
        "prompt_ids": torch.full((n, width), PAD), "prompt_mask": torch.zeros(n, width, dtype=torch.long),
    }
    for i, r in enumerate(rows):
        ids = r["prompt"] + r["answer"]
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, len(r["prompt"]) : len(ids)] = torch.tensor(r["answer"])
        batch["prompt_ids"][i, width - len(r["prompt"]) :] = torch.tensor(r["prompt"])
        batch["prompt_mask"][i, width - len(r["prompt"]) :] = 1
    batch["words"] = [r["word"] for r in rows]
    return batch


class CopyLM(L.LightningModule):
    def __init__(self, layers: int = 4, dim: int = 64, lr: float = 3e-3, num_beams: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=END,
        )
        self.model = LlamaForCausalLM(config)
        self.exact = MeanMetric()
        self.cer = CharErrorRate()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch["labels"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def complete(self, batch: dict[str, Any]) -> list[str]:
        out = self.model.generate(
            input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], max_new_tokens=8,
            do_sample=False, num_beams=self.hparams.num_beams, pad_token_id=PAD,
        )
        return [decode(row) for row in out[:, batch["prompt_ids"].shape[1] :].tolist()]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch["labels"]).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        completions = self.complete(batch)
        self.exact.update(torch.tensor([float(c == w) for c, w in zip(completions, batch["words"])]))
        self.cer.update(completions, batch["words"])
        self.log("val_exact_match", self.exact, prog_bar=True)
        self.log("val_cer", self.cer)
        if batch_idx == 0:
            self.sample = f"{batch['words'][0]!r} -> {completions[0]!r}"

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        return self.complete(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: Optional[list[str]] = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2, help="processes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=300)
    args = p.parse_args(argv)
    L.seed_everything(1234)

    model = CopyLM(args.layers, num_beams=args.num_beams)
    train = DataLoader(examples(args.max_steps * args.batch_size, 0), batch_size=args.batch_size, collate_fn=collate)
    val = DataLoader(examples(4 * args.batch_size, 1), batch_size=args.batch_size, collate_fn=collate)
    strategy: Any = "auto" if args.devices == 1 else PipelineStrategy(num_microbatches=args.num_microbatches)
    trainer = L.Trainer(
        accelerator="auto" if cuda else "cpu", devices=args.devices, strategy=strategy,  # the one line
        max_steps=args.max_steps, val_check_interval=args.max_steps // 3, log_every_n_steps=10,
        enable_checkpointing=False, logger=False,
    )
    trainer.fit(model, train, val)
    metrics = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()}
    completions = trainer.predict(model, DataLoader(examples(4, 2), batch_size=4, collate_fn=collate))
    if trainer.is_global_zero:
        print(f"final metrics: {metrics}; sample: {model.sample}")
        print(f"predicted: {[w['word'] for w in examples(4, 2)]} -> {completions[0]}")


if __name__ == "__main__":
    main()
