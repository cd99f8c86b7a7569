#!/usr/bin/env bash
# Run the lint and the test suite (the README's test command) against one torch release, in a venv of its own.
#
#   scripts/check_torch.sh 2.15.0                 # everything; extra arguments go to pytest:
#   scripts/check_torch.sh 2.15.0 tests/test_timeline.py -x
#
# The venv is made once and reused: $VENV, default ~/.cache/lightning_pipe/torch-VERSION (an existing venv works,
# missing packages are added). torch comes from PyPI (on Linux a CUDA build of several GB, which runs the CPU tests
# as they are) or from $TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu for the CPU build). The other
# dependencies are pyproject.toml's, less torch, and the package runs from this checkout (PYTHONPATH), so a release
# outside the torch range that pyproject.toml pins can be checked too. Every pip call runs under a constraint file
# holding torch==VERSION: nothing can move torch, and it replaces a machine-wide constraint file (pip.conf) that
# could cap torch below VERSION. Needs Python >= 3.11 ($PYTHON, default python3).
set -euo pipefail

version=${1:?usage: scripts/check_torch.sh TORCH_VERSION [PYTEST_ARGS...]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning_pipe/torch-$version}
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pin="$venv/torch-pin.txt"
echo "torch==$version" >"$pin"
export PIP_CONSTRAINT=$pin

torch_index=()
[ -z "${TORCH_INDEX_URL:-}" ] || torch_index=(--index-url "$TORCH_INDEX_URL")
"$venv/bin/python" -m pip install -q "torch==$version" ${torch_index[@]+"${torch_index[@]}"}

requirements=$("$venv/bin/python" - "$root/pyproject.toml" <<'EOF'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not re.match(r"torch\b", requirement):
        print(requirement)
EOF
)
mapfile -t requirements <<<"$requirements"
"$venv/bin/python" -m pip install -q "${requirements[@]}"

cd "$root"
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
"$venv/bin/python" -c 'import lightning, torch; print(f"torch {torch.__version__}, lightning {lightning.__version__}")'
"$venv/bin/python" -m ruff check .
"$venv/bin/python" -m pytest -q tests "$@"
