"""This round's paths on one CUDA device, in one run: compiled blocks (Inductor) and the Hugging Face save and load.

As in ``gpu.py``, the pipeline runs two stages on the one rank (``Interleaved1F1B``, ``stages_per_rank=2``) over a NCCL
group of one. Phases:

1. compile, exactness: the example Llama trained a few steps in fp32 with SGD by the strategy with eager blocks and
   with ``compile=True`` (Inductor), losses and weights side by side;
2. compile, timing in bf16-mixed: plain Lightning with eager and with compiled blocks, the strategy with eager and with
   compiled blocks; median step time after warm-up (the first steps pay the compile);
3. Hugging Face: a tiny Llama fine-tuned under the strategy on the GPU, then ``save_pretrained`` (the module is whole
   after ``fit``) and ``PipelineStrategy.save_pretrained`` from CUDA tensors, and ``read_pretrained`` into a model built
   on the meta device and materialised on the GPU; every directory is loaded back and compared.

    python benchmarks/gpu_round.py --out gpu_round.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import _median_step, fit, model_arguments

from lightning_pipe import PipelineStrategy, read_pretrained


def compile_exactness(args: argparse.Namespace) -> dict[str, Any]:
    eager, eager_w = fit(args, True, "32-true", args.check_steps)
    comp, comp_w = fit(args, True, "32-true", args.check_steps, compiled=True)
    out = {
        "losses_eager": eager.losses, "losses_compiled": comp.losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(eager.losses, comp.losses)),
        "max_weight_diff": max(float((eager_w[k] - comp_w[k]).abs().max()) for k in eager_w),
    }
    print("compile fp32", out["max_loss_diff"], out["max_weight_diff"], flush=True)
    return out


def compile_timing(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.steps + 1
    out = {}
    for name, pipeline, compiled in (("single_eager", False, False), ("single_compiled", False, True),
                                     ("strategy_eager", True, False), ("strategy_compiled", True, True)):
        record, _ = fit(args, pipeline, "bf16-mixed", steps, compiled=compiled)
        out[f"{name}_s"] = _median_step(record.starts, args.warmup)
        print(name, out[f"{name}_s"], flush=True)
    out["compile_speedup_strategy"] = out["strategy_eager_s"] / out["strategy_compiled_s"]
    out["compile_speedup_single"] = out["single_eager_s"] / out["single_compiled_s"]
    return out


def hugging_face(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    class Lit(L.LightningModule):
        def __init__(self, meta_from: Any = None) -> None:
            super().__init__()
            if meta_from is None:
                torch.manual_seed(0)
                self.model = AutoModelForCausalLM.from_config(config)
            else:
                with torch.device("meta"):
                    self.model = AutoModelForCausalLM.from_config(config)
                read_pretrained(self.model, meta_from)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)
    work = tempfile.mkdtemp()

    def run(lit: Lit, pipeline: bool) -> Any:
        strategy = PipelineStrategy(schedule="Interleaved1F1B", stages_per_rank=2, num_microbatches=4) \
            if pipeline else "auto"
        trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(lit, loader)
        return trainer

    one = Lit()
    one.model.save_pretrained(f"{work}/initial")
    run(one, False)
    piped = Lit()
    trainer = run(piped, True)
    piped.model.save_pretrained(f"{work}/plain")  # whole after fit, on the CPU
    trainer.strategy.save_pretrained(f"{work}/parallel")
    meta = Lit(meta_from=f"{work}/initial")
    run(meta, True)
    want = {k: v.float().cpu() for k, v in one.model.state_dict().items()}
    out: dict[str, Any] = {}
    for name in ("plain", "parallel"):
        loaded, info = AutoModelForCausalLM.from_pretrained(f"{work}/{name}", output_loading_info=True)
        got = loaded.state_dict()
        out[name] = {"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                     "max_diff": max(float((got[k] - want[k]).abs().max()) for k in want)}
    got = meta.model.state_dict()
    out["read_pretrained_max_diff"] = max(float((got[k].float().cpu() - want[k]).abs().max()) for k in want)
    print("hugging face", out, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--check-steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--phases", default="hf,exact,timing")
    args = p.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "args": vars(args)}
    phases = {"hf": ("hugging_face", hugging_face), "exact": ("compile_exactness_fp32", compile_exactness),
              "timing": ("compile_timing_bf16", compile_timing)}
    for key in args.phases.split(","):
        name, phase = phases[key]
        try:
            result[name] = phase(args)
        except Exception as error:  # report and go on: each phase is a separate finding
            result[name] = {"error": f"{type(error).__name__}: {error}"}
            print(name, "failed:", result[name]["error"], flush=True)
        if args.out:  # after each phase: what finished comes back even if a later one runs out of time
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
