"""Loading and saving a Hugging Face model of about 780 MB under the pipeline (pp4) against one process.

Reports, per rank: the peak RSS after each phase, the wall time of loading (``from_pretrained`` in ``__init__``,
memory-mapped; and ``read_pretrained`` on a model built on the meta device), of gathering the module whole after
``fit``, of the parallel save (``PipelineStrategy.save_pretrained``) and of ``save_pretrained`` on global zero, and the
bytes each rank writes in the parallel save. One process does the same with plain ``from_pretrained`` and
``save_pretrained``. Usage::

    python benchmarks/hf_save.py            # writes benchmarks/hf_save_results.json
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy, read_pretrained

HERE = Path(__file__).resolve().parent
WORK = Path(os.environ.get("HF_SAVE_WORK", "/tmp/lightning_pipe_hf_save"))
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=16, max_position_embeddings=64, tie_word_embeddings=False)


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class LitLM(L.LightningModule):
    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        start = time.perf_counter()
        if meta:
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
            read_pretrained(self.model, WORK / "base")
        else:
            self.model = AutoModelForCausalLM.from_pretrained(WORK / "base")
        self.load_s = time.perf_counter() - start

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    ids = torch.randint(0, 32000, (8, 16), generator=torch.Generator().manual_seed(0))  # the same on every rank
    return DataLoader(TensorDataset(ids), batch_size=4)


def run(mode: str) -> dict:
    record: dict = {"mode": mode}
    lit = LitLM(meta=mode == "pp4_meta")
    record["load_s"], record["peak_after_load_gib"] = lit.load_s, peak_gib()
    pipelined = mode != "one"
    strategy = PipelineStrategy(num_microbatches=4) if pipelined else "auto"

    class Timed(L.Callback):
        def on_train_end(self, trainer, pl_module):
            record["peak_in_fit_gib"] = peak_gib()
            if pipelined:
                local = {k: v for k, v in pl_module.state_dict().items()}
                record["bytes_written"] = sum(v.numel() * v.element_size() for v in local.values())
                start = time.perf_counter()
                trainer.strategy.save_pretrained(WORK / f"{mode}_parallel")
                record["parallel_save_s"] = time.perf_counter() - start
            self.end = time.perf_counter()

    timed = Timed()
    trainer = L.Trainer(accelerator="cpu", devices=4 if pipelined else 1, strategy=strategy, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timed])
    trainer.fit(lit, loader())
    record["gather_whole_s"] = time.perf_counter() - timed.end  # teardown: the module made whole (pipelined)
    record["peak_after_fit_gib"] = peak_gib()
    record["rank"] = trainer.global_rank
    if trainer.is_global_zero and mode != "pp4_meta":
        start = time.perf_counter()
        lit.model.save_pretrained(WORK / f"{mode}_plain")
        record["save_pretrained_s"] = time.perf_counter() - start
    (WORK / f"{mode}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
    return record


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1])
        return
    WORK.mkdir(parents=True, exist_ok=True)
    if not (WORK / "base").exists():
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(WORK / "base")
    size = sum(f.stat().st_size for f in (WORK / "base").glob("*.safetensors"))
    results = {"model_bytes": size, "cores": os.cpu_count(), "runs": {}}
    for mode, ranks in (("one", 1), ("pp4", 4), ("pp4_meta", 4)):
        for stale in WORK.glob(f"{mode}_*"):
            shutil.rmtree(stale, ignore_errors=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, __file__, mode], check=True, env=env, cwd=WORK, timeout=1800)
        results["runs"][mode] = [json.loads((WORK / f"{mode}.rank{r}.json").read_text()) for r in range(ranks)]
    (HERE / "hf_save_results.json").write_text(json.dumps(results, indent=1))
    print(f"model: {size / 2**20:.0f} MiB of safetensors")
    for mode, ranks in results["runs"].items():
        for r in ranks:
            print(mode, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items() if k != "mode"})


if __name__ == "__main__":
    main()
