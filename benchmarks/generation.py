"""Generation through the pipeline against one process: tokens per second and the measured bubble, side by side.

    (a) single       plain Lightning, one process: ``predict_step`` calls ``model.generate(...)``
    (b) pipelined    ``PipelineStrategy(pipeline_parallel_size=2, num_microbatches=M)``, the same ``predict_step``:
                     every model call of ``generate()`` (prefill and each decode step) runs through torch's
                     forward-only schedule in M microbatches ([Note: lock step], ``lightning_pipe/_step/generation.py``)
    (c) unsplit      the same with ``num_microbatches=1``: each step's whole batch goes through the stages one after
                     the other, so each rank idles (p - 1) / p of the time

The model is a Hugging Face Llama with random weights (``--hidden``, ``--layers``, ``--vocab``); the batch holds
``--batch`` left-padded prompts of 16 to ``--prompt`` tokens, and ``generate()`` adds ``--new-tokens`` greedy tokens
(``min_new_tokens`` too, so every call decodes as many). Each variant runs ``--calls`` generate calls, the first a
warm-up (it also learns that the step generates: [Note: lock step]); the median of the others counts.

Tokens per second: new tokens of the whole batch over the wall time of one call. The bubble is measured, from the
timeline of one call on every rank: the time inside the stage's own forward (torch's ``forward_one_chunk``) over
the call's wall time; the bubble is one minus the mean of that over the ranks. The rest is idle time, transfers,
the broadcast of each step's logits and the runtime's per-step work (splitting the inputs and caches, the shape
probe when the prompt length is new, the code before the stage's blocks).

Every process runs one thread (``OMP_NUM_THREADS=1``), so p processes use p cores. On the 2 cores of the
development machine only p = 2 is meaningful.

    python benchmarks/generation.py                  # about 2 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def build(args: argparse.Namespace) -> Any:
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Generator(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(
                vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=1024, pad_token_id=0,
                eos_token_id=1, bos_token_id=1,
            )
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(config)
            self.times: list[float] = []
            self.outputs: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # the strategy needs a trunk to find
            return self.model(**batch).loss

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
            )
            self.times.append(time.perf_counter() - start)
            self.outputs.append(out[:, batch["input_ids"].shape[1]:].cpu())
            return out

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Generator()


def prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.calls):
        lengths = torch.randint(16, args.prompt + 1, (args.batch,), generator=g)
        ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths.tolist()):
            ids[i, args.prompt - n:] = torch.randint(2, args.vocab, (n,), generator=g)
            mask[i, args.prompt - n:] = 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def run_variant(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    torch.set_num_threads(1)
    from lightning_pipe import PipelineStrategy
    from lightning_pipe._step import pipeline as _pipeline

    busy: list[float] = [0.0]
    forward = _pipeline.StageModule.forward

    def timed(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(self, *inputs, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    _pipeline.StageModule.forward = timed
    model = build(args)
    busy_per_call: list[float] = []

    class Busy(L.Callback):
        def on_predict_batch_start(self, *a: Any) -> None:
            busy[0] = 0.0

        def on_predict_batch_end(self, *a: Any) -> None:
            busy_per_call.append(busy[0])

    pipelined = args.variant != "single"
    strategy: Any = "auto"
    if pipelined:
        count = args.microbatches if args.variant == "pipelined" else 1  # forward only: GPipe takes any count
        strategy = PipelineStrategy(pipeline_parallel_size=args.pp, num_microbatches=count, schedule="GPipe")
    trainer = L.Trainer(
        accelerator="cpu", devices=args.pp if pipelined else 1, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Busy()],
    )
    from torch.utils.data import DataLoader

    profile = None
    if args.profile:  # each rank's own profile of the calls, for looking into where the time goes
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    trainer.predict(model, DataLoader(prompts(args), batch_size=None), return_predictions=False)
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{args.out}.rank{trainer.global_rank}.prof")
    result = {
        "times": model.times, "busy": busy_per_call, "rank": trainer.global_rank,
        "outputs": [o.tolist() for o in model.outputs],
    }
    if pipelined:
        stats = trainer.strategy.runtime.pipeline.shape_stats
        result.update(passes=trainer.strategy.runtime.lock_step.passes, schedules_built=stats.built)
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="write each rank's cProfile next to its results")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.variant is not None:
        run_variant(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    rows = {}
    work = HERE / ".generation"
    work.mkdir(exist_ok=True)
    for variant in ("single", "pipelined", "unsplit"):
        out = work / variant
        cmd = [sys.executable, __file__, "--variant", variant, "--out", str(out)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variant", "out", "profile")]
        cmd += ["--profile"] if args.profile else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"{variant} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        ranks = 1 if variant == "single" else args.pp
        parts = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
        seconds = statistics.median(parts[0]["times"][1:])
        busy = statistics.mean(statistics.median(p["busy"][1:]) / seconds for p in parts) if ranks > 1 else 1.0
        rows[variant] = {
            "seconds_per_call": seconds,
            "tokens_per_second": args.batch * args.new_tokens / seconds,
            "bubble": 1.0 - busy,
            "passes_per_call": parts[0].get("passes", 0) / args.calls if ranks > 1 else None,
            "schedules_built": parts[0].get("schedules_built"),
            "same_tokens_as_single": None if variant == "single" else parts[0]["outputs"] == rows["single"]["outputs"],
            "outputs": parts[0]["outputs"],
        }
    single = rows["single"]["tokens_per_second"]
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.batch} prompts of up to"
          f" {args.prompt} tokens, {args.new_tokens} new tokens each; pp = {args.pp}, one thread per process")
    print(f"{'variant':<12}{'s / call':>10}{'tokens/s':>10}{'x single':>10}{'bubble':>9}  same tokens")
    for name, row in rows.items():
        print(f"{name:<12}{row['seconds_per_call']:>10.3f}{row['tokens_per_second']:>10.1f}"
              f"{row['tokens_per_second'] / single:>10.2f}{row['bubble']:>9.1%}  {row['same_tokens_as_single']}")
    for row in rows.values():
        row.pop("outputs")
    settings = {k: v for k, v in vars(args).items() if k not in ("variant", "out", "profile")}
    tag = f"hidden {args.hidden}, batch {args.batch}, {args.new_tokens} new tokens, pp {args.pp}, m {args.microbatches}"
    path = HERE / "generation_results.json"
    runs = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    runs[tag] = {"args": settings, "rows": rows}  # one entry per setting: the memory- and compute-bound runs
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
