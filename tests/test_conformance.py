"""The conformance sweep's CI sample: about ten architectures of the registries (scripts/conformance.py), each built
tiny by the sweep's one shrinking function and trained by its one runner, in ONE shared 2-process launch. Every one
must be exact against one process: the loss of every step and the final weights within 1e-5, and the same tokens
from ``generate()`` greedy and with ``num_beams=2`` (a diffusion model: its output within 1e-5).

The full sweep is ``python scripts/conformance.py --write-docs``; its results are committed in
``scripts/conformance_results.json`` and shown in docs/models.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_script

pytestmark = pytest.mark.dist

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


def test_the_sample_is_exact(tmp_path):
    from conformance import SAMPLE

    out = tmp_path / "results.json"
    args = [str(SCRIPTS / "conformance.py"), "--only", "sample", "--out", str(out), "--work", str(tmp_path / "work"),
            "--timeout", "150", "--chunk", str(len(SAMPLE)), "--keep-launches"]
    proc = run_script(args, cwd=tmp_path, timeout=420)
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == sorted(SAMPLE)
    launches = list((tmp_path / "work").glob("launch*"))
    assert len(launches) == 1, f"the sample took {len(launches)} launches: one failed and ended its launch"
    wrong = {name: r.get("detail") for name, r in results.items() if r["class"] != "exact"}
    assert not wrong, wrong
    for name, r in results.items():
        assert r["moved"] > 1e-3, f"{name}: the weights barely moved, the comparison would prove nothing"
        assert r.get("greedy", "same") == r.get("beam", "same") == r.get("output", "same") == "same"
    # the conditioning check (`conformance.conditioned`), on the sample's real pipelined results: each step's loss
    # is one process's at the weights the pipeline started it from; and weights moved by 1e-2 are told apart
    import torch
    from conformance import ATOL, cm, conditioned

    case = next(c for c in cm.registry() if c.name == "LlamaForCausalLM")
    got = [torch.load(launches[0] / f"LlamaForCausalLM.rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(got[0]["before"]) == len(got[0]["losses"]) == 3
    assert conditioned(case, got) < ATOL
    for r in got:
        for state in r["before"][1:]:
            for key in [k for k in state if k.endswith("norm.weight")]:
                state[key] += 1e-2
    assert conditioned(case, got) > 1e-4
