"""The conformance sweep: every architecture of the registries, in an ordinary LightningModule, on one process
against ``PipelineStrategy`` on 2 processes (gloo, CPU), classified.

Usage::

    python scripts/conformance.py [--only NAMES] [--registry R] [--out JSON] [--cap SECONDS] [--write-docs]
    python scripts/conformance.py --docs-only        # regenerate docs/models.md's table from the JSON

The cases and the modules are in ``scripts/conformance_models.py``, the shrinking function in
``conformance_shrink.py``. Each architecture:

- **one process** (in this process, reused as the reference): built tiny, trained for 3 steps (fp32, SGD with
  momentum, clipping 0.5, batches of 8 padded rows with ``-100`` labels), then ``trainer.predict`` runs
  ``generate()`` greedy and with ``num_beams=2`` (a diffusion model: its output). A failure here is
  **not built** and is not counted.
- **2 processes**: the same under ``PipelineStrategy(num_microbatches=4)``. Many architectures share one launch
  (starting processes costs more than a tiny fit); a failure ends that launch by design (the ranks may be out of
  step), and the next launch starts after the failed architecture. An architecture that makes no progress for
  ``--timeout`` seconds is killed with its launch.
- **exact**: the loss of every step on every rank and the final weights within 1e-5, the same tokens (a diffusion
  model's output within 1e-5). **refused**: an error raised by a ``raise`` in ``lightning_pipe`` itself, naming the
  reason: at setup, or at the first generation pass of a step that generates (``generate()``'s calls are seen only
  then).
  **defect**: any other error, a hang, or a difference.

Results go to ``scripts/conformance_results.json``; ``--write-docs`` replaces the section of ``docs/models.md``
between ``<!-- conformance:begin -->`` and ``<!-- conformance:end -->`` with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import conformance_models as cm  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

RESULTS = HERE / "conformance_results.json"
DOCS = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
ATOL = 1e-5
#: a model whose state is larger (a "tiny" config that is not: VibeVoice's is 1.3 GB) keeps no weights per step, so
#: the conditioning check (:func:`conditioned`) cannot run for it
SNAPSHOT_BYTES = 64 << 20
CLASSES = ("exact", "refused", "defect", "not built", "not run")
#: the CI sample (tests/test_conformance.py): one shared launch
SAMPLE = ("LlamaForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen2ForCausalLM", "GemmaForCausalLM",
          "RecurrentGemmaForCausalLM", "FalconForCausalLM", "OPTForCausalLM", "MixtralForCausalLM",
          "SD3Transformer2DModel", "FluxTransformer2DModel", "HYV4ForCausalLM", "SkyReelsV2Transformer3DModel",
          "GPT2LMHeadModel", "FalconMambaForCausalLM", "Florence2ForConditionalGeneration")
ORDER = ("diffusers", "causal-lm", "seq2seq", "image-text-to-text")


# ----------------------------------------------------------------------------------------------------- the runner
class Recorder(L.Callback):
    """Losses of every step, the weights before training, and where the run is (``setup`` until the first step
    ends, then ``train``, ``predict``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: Optional[dict[str, torch.Tensor]] = None
        self.before: list[dict[str, torch.Tensor]] = []  # the weights each step starts from (see `conditioned`)
        self.phase = "setup"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.initial = _plain(pl_module.state_dict())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        state = pl_module.state_dict()
        if sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)) <= SNAPSHOT_BYTES:
            self.before.append(_plain(state))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.phase = "train"

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self.phase = "predict"


def _plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}


def run_case(case: cm.Case, devices: int, recorder: Recorder) -> dict[str, Any]:
    """Train ``case`` for 3 steps and predict on one batch, on one process (``devices=1``, no strategy) or under
    ``PipelineStrategy`` on ``devices`` processes."""
    module, train, predict, collate = cm.build(case)
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, max_epochs=1,
        gradient_clip_val=0.5, callbacks=[recorder],
    )
    if devices > 1:
        from lightning_pipe import PipelineStrategy

        kwargs["strategy"] = PipelineStrategy(num_microbatches=4, stall_timeout=timedelta(seconds=90))
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, DataLoader(train, batch_size=8, collate_fn=collate))
    final = _plain(module.state_dict())
    recorder.phase = "predict"  # a failure in `trainer.predict`, its setup included, is the prediction's
    predictions = trainer.predict(module, DataLoader(predict, batch_size=8, collate_fn=collate))
    return {"losses": recorder.losses, "initial": recorder.initial, "final": final, "before": recorder.before,
            "predictions": [{k: v.detach().cpu() for k, v in p.items()} for p in predictions],
            "rank": trainer.global_rank}


def error_record(err: BaseException, phase: str) -> dict[str, Any]:
    """What a failure says: its first line, where it was raised, and whether a ``raise`` in ``lightning_pipe``
    raised it."""
    frames = traceback.extract_tb(err.__traceback__)
    last = frames[-1] if frames else None
    ours = [f for f in frames if "lightning_pipe" in f.filename]
    first = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return {
        "error": first[0][:400] if first else type(err).__name__,
        "where": f"{_short(last.filename)}:{last.lineno}" if last else None,
        "pipe_frame": f"{_short(ours[-1].filename)}:{ours[-1].lineno}" if ours else None,
        "deliberate": _deliberate(err),
        "caused": err.__cause__ is not None,
        "phase": phase,
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-6000:],
    }


def _deliberate(err: BaseException) -> bool:
    """Raised by a ``raise`` statement in ``lightning_pipe``, and not wrapping an error from elsewhere (a crash that
    the strategy reports with its rank)."""
    while err is not None:
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or "lightning_pipe" not in frames[-1].filename:
            return False
        if not (frames[-1].line or "").lstrip().startswith("raise"):
            return False
        err = err.__cause__
    return True


def _short(filename: str) -> str:
    for anchor in ("lightning_pipe/", "site-packages/", "scripts/"):
        if anchor in filename:
            return anchor.rstrip("/") + "/" + filename.split(anchor, 1)[1] if anchor != "site-packages/" \
                else filename.split(anchor, 1)[1]
    return filename


def job(spec_file: str, out_dir: str) -> None:
    """One 2-process launch: the spec's cases one after the other; each rank saves ``<name>.rank<r>.pt``. A failure
    is saved and ends the launch."""
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(spec_file).read_text())
    out = Path(out_dir)
    cases = {c.name: c for c in cm.registry()}
    for name in spec["cases"]:
        rank = int(os.environ.get("LOCAL_RANK", 0))
        if rank == 0:
            (out / f"{name}.started").write_text(str(time.time()))
        recorder = Recorder()
        try:
            result = run_case(cases[name], 2, recorder)
        except BaseException as err:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else rank
            torch.save(error_record(err, recorder.phase), out / f"{name}.rank{rank}.pt")
            (out / f"{name}.failed{rank}").write_text(str(time.time()))
            sys.stdout.flush()
            os._exit(1)
        torch.save(result, out / f"{name}.rank{result['rank']}.pt")


# ----------------------------------------------------------------------------------------------------- the driver
class _Alarm(Exception):
    pass


def reference(case: cm.Case, timeout: int) -> dict[str, Any]:
    """One process, in this process (with a time limit)."""

    def ring(*_: Any) -> None:
        raise _Alarm(f"the one-process run took over {timeout}s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(timeout)
    try:
        return run_case(case, 1, Recorder())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def launch(names: list[str], work: Path, timeout: float) -> dict[str, Any]:
    """Run ``names`` in as few 2-process launches as failures allow; returns each name's rank results, an error
    record list, or ``{"hang": seconds}``."""
    found: dict[str, Any] = {}
    remaining = list(names)
    while remaining:
        out = work / f"launch{int(time.time() * 1000)}"
        out.mkdir(parents=True)
        spec = out / "spec.json"
        spec.write_text(json.dumps({"cases": remaining}))
        env = {k: v for k, v in os.environ.items()
               if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")}
        log = open(out / "log.txt", "w")
        proc = subprocess.Popen([sys.executable, __file__, "--job", str(spec), str(out)], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        hung: Optional[str] = None
        while proc.poll() is None:
            time.sleep(1)
            started = [n for n in remaining if (out / f"{n}.started").exists()]
            if started:
                current = started[-1]
                began = float((out / f"{current}.started").read_text() or time.time())
                if time.time() - began > timeout and not _finished(out, current):
                    hung = current
                    break
                failed = [float(p.read_text() or 0) for p in out.glob(f"{current}.failed*")]
                if failed and time.time() - min(failed) > 15 and not _finished(out, current):
                    break  # one rank failed and the other waits for it: its error is the cause
        if proc.poll() is None or hung:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            time.sleep(2)  # let the other rank save its error
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        log.close()
        done = 0
        for name in remaining:
            if _finished(out, name):
                found[name] = [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
                done += 1
                if any("error" in r for r in found[name]):
                    break
                continue
            if (out / f"{name}.started").exists():  # the one that failed or hung
                partial = [torch.load(p, weights_only=False) for p in sorted(out.glob(f"{name}.rank*.pt"))]
                found[name] = partial if partial and not hung else {"hang": timeout, "partial": partial,
                                                                   "log": _tail(out / "log.txt")}
                if not partial and not hung:
                    found[name] = {"crash": proc.returncode, "log": _tail(out / "log.txt")}
                done += 1
            break
        if done == 0:  # the launch died before any case started
            found[remaining[0]] = {"crash": proc.returncode, "log": _tail(out / "log.txt")}
            done = 1
        remaining = remaining[done:]
    return found


def _finished(out: Path, name: str) -> bool:
    return all((out / f"{name}.rank{r}.pt").exists() for r in range(2))


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def classify(ref: dict[str, Any], got: Any) -> dict[str, Any]:
    """The class of one architecture, from the one-process ``ref`` and the pipelined ranks' results ``got``."""
    if isinstance(got, dict):
        if "hang" in got:
            return {"class": "defect", "detail": f"hang: no result after {got['hang']:.0f}s", "log": got["log"]}
        return {"class": "defect", "detail": f"the launch ended (exit code {got['crash']}) without a result",
                "log": got["log"]}
    errors = [r for r in got if "error" in r]
    if errors:
        real = [e for e in errors if "Connection closed by peer" not in e["error"]] or errors
        e = real[0]
        refused = all(_refusal(x) for x in real)
        return {"class": "refused" if refused else "defect", "detail": e["error"], "where": e["where"],
                "pipe_frame": e["pipe_frame"], "phase": e["phase"], "traceback": e["traceback"]}
    out: dict[str, Any] = {}
    loss_diff = max(max((abs(a - b) for a, b in zip(r["losses"], ref["losses"])), default=0.0) for r in got)
    lengths = {len(r["losses"]) for r in got}
    merged: dict[str, torch.Tensor] = {}
    for r in got:
        merged.update(r["final"])
    keys_match = set(merged) == set(ref["final"])
    weight_diff = max((float((merged[k].float() - v.float()).abs().max()) for k, v in ref["final"].items()
                       if k in merged and merged[k].shape == v.shape), default=0.0)
    moved = max((float((ref["final"][k].float() - v.float()).abs().max()) for k, v in ref["initial"].items()),
                default=0.0)
    out.update(loss_diff=loss_diff, weight_diff=weight_diff, moved=moved)
    problems = []
    if lengths != {len(ref["losses"])}:
        problems.append(f"{sorted(lengths)} steps, not {len(ref['losses'])}")
    if not keys_match:
        problems.append(f"parameter names differ: {sorted(set(merged) ^ set(ref['final']))[:3]}")
    if not loss_diff < ATOL:
        problems.append(f"losses differ by {loss_diff:.1e}")
    if not weight_diff < ATOL:
        problems.append(f"final weights differ by {weight_diff:.1e}")
    for key, want in ref["predictions"][0].items():
        same = [_same(r["predictions"][0].get(key), want) for r in got]
        out[key] = "same" if all(same) else "differs"
        if not all(same):
            problems.append(f"{key} {'tokens' if key in ('greedy', 'beam') else 'output'} differ")
    if problems:
        return {"class": "defect", "detail": "silent difference: " + "; ".join(problems), **out}
    return {"class": "exact", **out}


def conditioned(case: cm.Case, got: list[dict[str, Any]]) -> Optional[float]:
    """For a run whose final weights agree with one process's but whose losses do not: the largest difference
    between each step's pipelined loss and one process's loss *at the weights the pipeline started that step
    from*, computed here on one process; None where those weights are missing.

    When that difference is within the tolerance, the pipeline computed every step's loss as one process does, and
    its weights stay within the tolerance of one process's: what is left is the model's own conditioning, a loss that
    moves by more than 1e-5 when its weights move by rounding (microbatches sum the same gradients in another
    order). Such an architecture is exact, and the table lists both figures."""
    module, train, _, collate = cm.build(case)
    worst = 0.0
    for step, loss in enumerate(got[0]["losses"]):
        state: dict[str, torch.Tensor] = {}
        for r in got:
            if len(r.get("before", ())) <= step:
                return None
            state.update(r["before"][step])
        if set(state) != set(module.state_dict()):
            return None
        module.load_state_dict(state)
        rows = train[8 * step:8 * step + 8]
        with torch.no_grad():
            here = float(module.loss(collate(rows) if collate else torch.utils.data.default_collate(rows)))
        worst = max(worst, abs(here - loss))
    return worst


def _refusal(error: dict[str, Any]) -> bool:
    """An error that ``lightning_pipe`` raised itself, on every rank, naming the reason: at setup, or, for a step that
    generates, at its first generation pass (setup cannot see what ``generate()`` calls); not one it passes on from
    the model's code."""
    cause = error.get("caused") or "The above exception was the direct cause" in error.get("traceback", "")
    return bool(error.get("deliberate")) and error.get("phase") in ("setup", "predict") and not cause


def reclassify(results: dict[str, Any], details: dict[str, Any]) -> None:
    """Apply :func:`_refusal` again to stored refusals (with their tracebacks from the details file)."""
    for name, r in results.items():
        if r["class"] == "refused" and not _refusal({**r, "deliberate": True, **details.get(name, {})}):
            r["class"] = "defect"


def _same(a: Optional[torch.Tensor], b: torch.Tensor) -> bool:
    if a is None or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(torch.allclose(a, b, atol=ATOL, rtol=0))
    return bool(torch.equal(a, b))


def sweep(cases: list[cm.Case], work: Path, timeout: float, cap: float, chunk: int, save: Any,
          keep: bool = False) -> dict[str, Any]:
    """References in this process, then the built ones of each chunk in one launch; stops starting chunks after
    ``cap`` seconds (the rest are "not run")."""
    start = time.time()
    results: dict[str, Any] = {c.name: {"class": "not run", "registry": c.registry} for c in cases}
    for i in range(0, len(cases), chunk):
        if time.time() - start > cap:
            break
        refs: dict[str, Any] = {}
        for case in cases[i:i + chunk]:
            t0 = time.time()
            try:
                refs[case.name] = reference(case, int(timeout))
            except BaseException as err:
                if isinstance(err, KeyboardInterrupt):
                    raise
                rec = error_record(err, "one process")
                results[case.name] = {"class": "not built", "registry": case.registry, "detail": rec["error"],
                                      "where": rec["where"]}
            print(f"[{time.time() - start:6.0f}s] reference {case.name}: {time.time() - t0:.1f}s"
                  f" {'ok' if case.name in refs else results[case.name]['detail'][:100]}", flush=True)
        t0 = time.time()
        found = launch(list(refs), work, timeout)
        for path in [] if keep else work.glob("launch*/*.pt"):  # read: only the logs stay (a model's weights per
            path.unlink()  # step are the size of the model, up to 1.3 GB a rank)
        for name, got in found.items():
            results[name] = {"registry": results[name]["registry"], **classify(refs[name], got)}
            only_losses = results[name].get("detail", "").startswith("silent difference: losses differ by") and \
                ";" not in results[name]["detail"]
            at_own = conditioned(next(c for c in cases if c.name == name), got) if only_losses else None
            if at_own is not None and at_own < ATOL:
                results[name].update({"class": "exact", "loss_at_own_weights": at_own})
                results[name].pop("detail")
            print(f"[{time.time() - start:6.0f}s] {name}: {results[name]['class']}"
                  f" {results[name].get('detail', '')[:160]}", flush=True)
        print(f"[{time.time() - start:6.0f}s] launch of {len(refs)}: {time.time() - t0:.0f}s", flush=True)
        save(results)
    return results


# ----------------------------------------------------------------------------------------------------- results
def counts(results: dict[str, Any]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in results.values():
        row = table.setdefault(r["registry"], dict.fromkeys(CLASSES, 0))
        row[r["class"]] += 1
    return table


def markdown(data: dict[str, Any]) -> str:
    """The generated table: counts per registry and class, then every architecture."""
    results = data["results"]
    lines = [f"Generated by `python scripts/conformance.py --write-docs` ({data['meta']['versions']}; "
             f"{data['meta']['note']}). Exact: losses of every step and final weights within 1e-5 of one process, "
             "the same tokens from `generate()` greedy and with `num_beams=2` (a diffusion model: its output "
             "within 1e-5). Where a model's loss amplifies rounding (its weights agree within 1e-5, its losses do "
             "not), exact also requires each step's loss to equal, within 1e-5, one process's loss at the weights "
             "the pipeline started that step from; the table says so. Refused: an error `lightning_pipe` raises "
             "itself on every rank, naming the reason, at setup or at the first generation pass (caches it cannot "
             "split). Defect: "
             "any other error, a hang or a difference. Not built: the tiny model fails on one process (not counted). "
             "Not run: the sweep's time cap came first.",
             "",
             "| registry | " + " | ".join(CLASSES) + " | exact of built and run |",
             "|---|" + "---|" * (len(CLASSES) + 1)]
    total = dict.fromkeys(CLASSES, 0)
    for reg in ORDER:
        row = counts(results).get(reg)
        if not row:
            continue
        for k in CLASSES:
            total[k] += row[k]
        ran = row["exact"] + row["refused"] + row["defect"]
        share = f"{100 * row['exact'] / ran:.0f}%" if ran else "-"
        lines.append(f"| {reg} | " + " | ".join(str(row[k]) for k in CLASSES) + f" | {share} |")
    ran = total["exact"] + total["refused"] + total["defect"]
    share = f"{100 * total['exact'] / ran:.0f}%" if ran else "-"
    lines.append("| **all** | " + " | ".join(f"**{total[k]}**" for k in CLASSES) + f" | **{share}** |")
    lines += ["", "| architecture | registry | class | detail |", "|---|---|---|---|"]
    for reg in ORDER:
        for name, r in results.items():
            if r["registry"] != reg:
                continue
            detail = r.get("detail", "")
            if r["class"] == "exact":
                detail = f"loss {r.get('loss_diff', 0):.0e}, weights {r.get('weight_diff', 0):.0e}"
                if "loss_at_own_weights" in r:
                    detail += (f" (conditioning: each step's loss is one process's at the pipeline's weights within "
                               f"{r['loss_at_own_weights']:.0e})")
                if "greedy" in r:
                    detail += f"; greedy {r['greedy']}, beam {r.get('beam', '-')}"
            if r.get("where") and r["class"] in ("defect", "refused"):
                detail += f" (`{r['where']}`)"
            detail = detail.replace("|", "\\|").replace("\n", " ")[:220]
            lines.append(f"| `{name}` | {reg} | {r['class']} | {detail} |")
    return "\n".join(lines)


def write_docs(data: dict[str, Any]) -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{markdown(data)}\n{END}{tail}")


def versions() -> str:
    import diffusers
    import transformers

    return (f"torch {torch.__version__}, lightning {L.__version__}, transformers {transformers.__version__}, "
            f"diffusers {diffusers.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated class names or model types; 'sample' for the CI sample")
    parser.add_argument("--registry", choices=ORDER, action="append", help="only these registries")
    parser.add_argument("--out", default=str(RESULTS), help="the results JSON (default: %(default)s)")
    parser.add_argument("--work", default="/tmp/conformance", help="where launches write (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per architecture and process count")
    parser.add_argument("--cap", type=float, default=3600, help="seconds after which no further chunk starts")
    parser.add_argument("--chunk", type=int, default=8, help="architectures per launch")
    parser.add_argument("--resume", action="store_true", help="keep results in --out that are not 'not run'")
    parser.add_argument("--keep-launches", action="store_true", help="keep each launch's rank results in --work")
    parser.add_argument("--write-docs", action="store_true", help="replace docs/models.md's generated section")
    parser.add_argument("--docs-only", action="store_true", help="only regenerate the docs from --out")
    args = parser.parse_args()
    if args.job:
        job(*args.job)
        return
    out = Path(args.out)
    if args.docs_only:
        data = json.loads(out.read_text())
        details = out.with_suffix(".details.json")
        if details.exists():
            reclassify(data["results"], json.loads(details.read_text()))
            data["counts"] = counts(data["results"])
            out.write_text(json.dumps(data, indent=1) + "\n")
        write_docs(data)
        return
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    cases = sorted(cm.registry(), key=lambda c: ORDER.index(c.registry))
    if args.only:
        wanted = set(SAMPLE) if args.only == "sample" else set(args.only.split(","))
        cases = [c for c in cases if c.name in wanted or c.model_type in wanted]
    if args.registry:
        cases = [c for c in cases if c.registry in args.registry]
    previous = json.loads(out.read_text())["results"] if args.resume and out.exists() else {}
    kept = {k: v for k, v in previous.items() if v["class"] != "not run"}
    todo = [c for c in cases if c.name not in kept]
    began = time.time()

    def save(results: dict[str, Any]) -> None:
        merged = {**previous, **kept, **results}
        slim = {k: {f: v for f, v in r.items() if f not in ("traceback", "log")} for k, r in merged.items()}
        note = f"{sum(r['class'] != 'not run' for r in slim.values())} of {len(slim)} run"
        if any(r["class"] == "not run" for r in slim.values()):
            note += f"; the rest were left unrun (the sweep was stopped, or reached its cap of {args.cap:.0f}s)"
        data = {"meta": {"versions": versions(), "note": note, "seconds": round(time.time() - began)},
                "counts": counts(slim), "results": slim}
        out.write_text(json.dumps(data, indent=1) + "\n")
        details = out.with_suffix(".details.json")  # tracebacks and logs: for the engineer, not committed
        details.write_text(json.dumps({k: {f: r.get(f) for f in ("traceback", "log") if f in r}
                                       for k, r in merged.items() if "traceback" in r or "log" in r}, indent=1))
        if args.write_docs:
            write_docs(data)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = sweep(todo, work, args.timeout, args.cap, args.chunk, save, keep=args.keep_launches)
    save(results)
    print(json.dumps(counts({**kept, **results}), indent=1))


if __name__ == "__main__":
    main()
