"""Fast, a scan of the package's source (issue 37): options travel by keyword. No function takes more than 8
parameters that can be passed by position (``PipelineStrategy.__init__`` mirrors Lightning's strategies), and no call
passes more than 5 positional arguments (a logger's %-format calls aside)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_pipe

PACKAGE = Path(lightning_pipe.__file__).parent
MAX_PARAMETERS, MAX_POSITIONAL = 8, 5
LOGGING = {"debug", "info", "warning", "error", "exception", "log"}


def _offenders() -> tuple[list[str], list[str]]:
    functions, calls = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        exempt = {
            id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "PipelineStrategy"
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"
        }
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in exempt:
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > MAX_PARAMETERS:
                    functions.append(f"{where} {node.name} ({len(positional)} parameters)")
            elif isinstance(node, ast.Call):
                func = node.func
                logging = (
                    isinstance(func, ast.Attribute) and func.attr in LOGGING
                    and isinstance(func.value, ast.Name) and func.value.id.lower().endswith(("log", "logger"))
                )
                positional_args = [a for a in node.args if not isinstance(a, ast.Starred)]
                if len(positional_args) > MAX_POSITIONAL and not logging:
                    calls.append(f"{where} {ast.unparse(func)} ({len(positional_args)} positional arguments)")
    return functions, calls


def test_options_travel_by_keyword() -> None:
    functions, calls = _offenders()
    assert not functions, f"more than {MAX_PARAMETERS} parameters without `*`:\n" + "\n".join(functions)
    assert not calls, f"more than {MAX_POSITIONAL} positional arguments:\n" + "\n".join(calls)
