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


# The layers of docs/design.md, top first: a module may import its own layer's and lower ones' only.
LAYERS = {
    "strategy": 6, "_setup": 6, "_after_call": 6, "plan": 6, "_step": 5, "_model": 4, "_calls": 3, "_lightning": 2,
}


def _imports() -> dict[str, set[str]]:
    """Every module's imports of the package's modules, those inside functions and under ``TYPE_CHECKING`` too."""
    modules = {
        ".".join(("lightning_pipe", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_pipe"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                targets = subs | ({node.module} if len(subs) < len(node.names) else set())
                edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return LAYERS.get(top, 1 if top.startswith("_") or top in ("partition", "schedules") else 0)


def test_imports_point_down_and_never_in_a_circle() -> None:
    edges = _imports()
    upward = [f"{a} -> {b}" for a, targets in edges.items() for b in targets if 1 <= _layer(a) < _layer(b)]
    assert not upward, "imports that point up (docs/design.md's layers):\n" + "\n".join(sorted(upward))
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circles.append(" -> ".join(path[path.index(node):] + [node]))
            return
        if node in done:
            return
        for nxt in sorted(edges[node]):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    assert not circles, "import circles:\n" + "\n".join(circles)
