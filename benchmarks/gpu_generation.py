"""Generation through the pipeline on one CUDA device: the GPU paths of lock step ([Note: lock step] in
``lightning_pipe/_step/generation.py``), in fp32 and bf16, against plain Lightning on the same device.

The example Llama (``examples/llama.py``, random weights) generates in ``predict_step`` with nanoGPT's loop: the
model called on the growing sequence, ``argmax`` (greedy) or ``multinomial`` (sampling, seeded in the step) on the
last position. The pipelined run has two stages on the one rank (``Interleaved1F1B``, ``stages_per_rank=2``: a GPU
cannot host two NCCL ranks), so each decoding step runs through torch's forward-only schedule in microbatches,
the random state is the device's, and the second stage's code reads what the first ran in the same pass.
For each precision and decoding: the tokens of the two runs are compared, and the time per call gives tokens per
second (median of the calls after the first). Results go to ``--out``.

    python benchmarks/gpu_generation.py --out gpu_generation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import SGDLlama, _config, model_arguments

from lightning_pipe import PipelineStrategy


class Generating(SGDLlama):
    def __init__(self, *args: Any, new_tokens: int = 32, sample: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new_tokens, self.sample = new_tokens, sample
        self.times: list[float] = []

    @torch.no_grad()
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _synchronize()
        start = time.perf_counter()
        idx = batch
        torch.manual_seed(batch_idx)
        for _ in range(self.new_tokens):
            logits = self(idx)[:, -1, :].float()
            if self.sample:
                nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), num_samples=1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        _synchronize()
        self.times.append(time.perf_counter() - start)
        return idx[:, batch.shape[1]:].cpu()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args: argparse.Namespace, pipeline: bool, precision: str, sample: bool) -> dict[str, Any]:
    L.seed_everything(0)
    model = Generating(_config(args), lr=args.lr, new_tokens=args.new_tokens, sample=sample)
    strategy: Any = "auto"
    if pipeline:
        strategy = PipelineStrategy(schedule="Interleaved1F1B", stages_per_rank=2,
                                    num_microbatches=args.num_microbatches)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision=precision, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab_size, (args.batch_size, args.prompt), generator=g)
               for _ in range(args.calls)]
    out = trainer.predict(model, torch.utils.data.DataLoader(prompts, batch_size=None))
    return {"tokens": torch.cat(out), "seconds": statistics.median(model.times[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "args": vars(args)}
    for precision in ("32-true", "bf16-mixed"):
        for sample in (False, True):
            key = f"{precision}/{'sample' if sample else 'greedy'}"
            try:
                single, piped = run(args, False, precision, sample), run(args, True, precision, sample)
                same = single["tokens"] == piped["tokens"]
                tokens = args.batch_size * args.new_tokens
                result[key] = {
                    "same_tokens": bool(same.all()), "same_fraction": float(same.float().mean()),
                    "first_difference": [int(i) for i in (~same).nonzero()[0]] if not same.all() else None,
                    "tokens_per_second_single": tokens / single["seconds"],
                    "tokens_per_second_pipeline": tokens / piped["seconds"],
                }
            except Exception as error:  # report and go on: each case is a separate finding
                result[key] = {"error": f"{type(error).__name__}: {error}"}
            print(key, result[key], flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
