"""The private names of Lightning, torch and torchmetrics the package uses still exist on the installed versions.

Run this first when a new Lightning, torch or torchmetrics comes out (``pytest tests/test_compat.py``): it names every
listed private name (``lightning_pipe._compat.PRIVATE_NAMES``) that moved or disappeared, in one failure, in well
under a second, without starting a process. Then see the entry for each in ``lightning_pipe/_compat.py``.

A name is found when its module imports and every step of its attribute path resolves; the last step may also be an
attribute that instances set, which counts when the source of the class (or of a base class) assigns it
(``self.<name> = ...``): building a Trainer or a pipeline schedule only to look would take seconds, and instances of
an abstract class cannot be built.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from typing import Any

from lightning_pipe._compat import PRIVATE_NAMES


def _assigned_by_instances(cls: type, name: str) -> bool:
    pattern = re.compile(
        rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)"  # self.name = ... / self.name: T = ...
        rf"|__setattr__\(\s*(self,\s*)?[\"']{re.escape(name)}[\"']"  # nn.Module's super().__setattr__("name", ...)
    )
    return any(pattern.search(_class_source(klass)) for klass in cls.__mro__)


def _class_source(cls: type) -> str:
    """The text of ``class <name>`` up to the next top-level statement in its module's file (``""`` without one).
    Read directly: ``inspect.getsource`` parses the whole file each time, seconds for these classes."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if not path or not path.endswith(".py"):
        return ""
    text = _file_text(path)
    start = re.search(rf"^class {re.escape(cls.__name__)}\b", text, re.MULTILINE)
    if start is None:
        return ""
    end = re.compile(r"^[^\s#)]", re.MULTILINE).search(text, start.end())
    return text[start.start() : end.start() if end else len(text)]


@functools.lru_cache(maxsize=None)
def _file_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _find(module_name: str, path: str) -> bool:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return False
    parts = path.split(".")
    for i, part in enumerate(parts):
        if hasattr(target, part):
            target = getattr(target, part)
            continue
        if i < len(parts) - 1:
            return False
        if isinstance(target, type):
            return _assigned_by_instances(target, part)
        return inspect.ismodule(target) and _marked_by_module(target, part)
    return True


def _marked_by_module(module: Any, name: str) -> bool:
    """A module's functions set ``name`` on objects they are given (``setattr(model, "name", True)``)."""
    path = getattr(module, "__file__", None)
    pattern = re.compile(rf"setattr\([^,]+,\s*[\"']{re.escape(name)}[\"']")
    return bool(path and path.endswith(".py") and pattern.search(_file_text(path)))


def test_every_private_name_still_exists():
    missing = [f"{module}.{path}" for module, path in PRIVATE_NAMES if not _find(module, path)]
    assert not missing, "private names missing on the installed versions (see lightning_pipe/_compat.py):\n" + (
        "\n".join(missing)
    )


#: The private methods the package overrides, swaps or calls with arguments, and the parameters it relies on, in order
#: (see their entries in ``lightning_pipe/_compat/__init__.py``): a method that still exists under a new signature
#: would fail only when the override or the swapped method is called.
SIGNATURES = {
    # _step/pipeline.py: ReducingStage overrides it and reads `last_backward` by keyword or position
    ("torch.distributed.pipelining", "PipelineStage.backward_maybe_with_nosync"): (
        "self", "backward_type", "bwd_kwargs", "last_backward",
    ),
    # _parallel_dims.py: ParallelDims.build passes `backend_override` by keyword
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"): ("self", "mesh_dim_name", "backend_override"),
    # _compat/parallel.py: parallel_styles_recorded swaps it for `recorded(self, module, device_mesh)`
    ("torch.distributed.tensor.parallel.style", "ParallelStyle._apply"): ("self", "module", "device_mesh"),
}


def test_overridden_and_swapped_methods_take_the_arguments_the_package_passes():
    assert set(SIGNATURES) <= set(PRIVATE_NAMES)
    changed = []
    for (module_name, path), expected in SIGNATURES.items():
        target: Any = importlib.import_module(module_name)
        for part in path.split("."):
            target = getattr(target, part)
        parameters = tuple(inspect.signature(target).parameters)
        if parameters[: len(expected)] != expected:
            changed.append(f"{module_name}.{path}{parameters}, expected {expected}")
    assert not changed, "private methods whose parameters changed (see lightning_pipe/_compat/__init__.py):\n" + (
        "\n".join(changed)
    )


def test_the_lookup_finds_what_it_should_and_only_that():
    """The check itself: a class attribute, an attribute set in ``__init__`` (also through a base class), and names
    that do not exist."""
    assert _find("lightning.pytorch.callbacks", "ModelPruning._apply_global_pruning")  # a method
    assert _find("torchmetrics", "Metric._update_count")  # set in Metric.__init__
    assert _find("torchmetrics.classification", "MulticlassAccuracy._update_count")  # ... of a base class
    assert _find("torch.nn", "Linear._parameters")  # set by nn.Module.__init__ through __setattr__
    assert not _find("torchmetrics", "Metric._no_such_state")
    assert not _find("torch.nn", "Module._parameters.missing")
    assert not _find("lightning.pytorch.no_such_module", "Anything")
    assert _find("transformers.utils.output_capturing", "_output_capturing_hooks_installed")  # set on models
    assert not _find("transformers.utils.output_capturing", "_no_such_mark")


def test_configure_model_calls_are_recorded_not_run():
    """``fully_shard``'s inner function sits in a closure cell and ``checkpoint_wrapper`` keeps the wrapped block in
    ``_checkpoint_wrapped_module``: both recorded and undone while a ``configure_model`` runs (torch 2.13 to 2.15)."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lightning_pipe._model.configure_model import recording

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    inner = model[1]
    with recording(model) as calls:
        model[1] = checkpoint_wrapper(model[1])
        fully_shard(model[1], reshard_after_forward=False)
        fully_shard(model)
    assert model[1] is inner and not isinstance(model, FSDPModule) and calls.checkpointed == [inner]
    assert [(target, kwargs) for target, kwargs in calls.shards] == [(inner, {"reshard_after_forward": False}),
                                                                     (model, {})]
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with recording(model):  # nothing registered twice: the module takes fully_shard again
        fully_shard(model)


#: The libraries whose private names must be in the inventory.
LIBRARIES = ("torch", "lightning", "torchmetrics", "transformers", "peft", "diffusers")
#: Underscored names of the standard library the package reads (``sys._current_frames``, a namedtuple's ``_fields``).
STANDARD_LIBRARY = {"_current_frames", "_fields"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_sources() -> dict[str, Any]:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "lightning_pipe"
    paths = sorted(root.rglob("*.py"))
    return {str(p.relative_to(root.parent)): ast.parse(p.read_text(encoding="utf-8")) for p in paths}


def _scan(trees: dict[str, Any]) -> tuple[dict[str, set[str]], set[str], list[tuple[str, str]]]:
    """The package's reads of underscored attributes (``x._name``, ``getattr(x, "_name")``, ``vars(x)["_name"]``),
    the names it defines itself (functions, classes, variables, arguments, attributes it assigns), and its imports of
    private modules or names of the libraries."""
    import ast

    read: dict[str, set[str]] = {}
    own: set[str] = set()
    imported: list[tuple[str, str]] = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                own.add(node.arg)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store):
                    own.add(node.attr)
                elif _private(node.attr):
                    read.setdefault(node.attr, set()).add(path)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
                name = node.args[1]
                if node.func.id in ("getattr", "hasattr") and isinstance(name, ast.Constant):
                    if isinstance(name.value, str) and _private(name.value):
                        read.setdefault(name.value, set()).add(path)
                elif node.func.id == "setattr" and isinstance(name, ast.Constant):
                    own.add(name.value)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "__setattr__":
                name = node.args[1] if len(node.args) > 1 else None  # object.__setattr__(self, "_name", value)
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    own.add(name.value)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                if isinstance(node.slice.value, str) and _private(node.slice.value):
                    (own.add(node.slice.value) if isinstance(node.ctx, ast.Store) else
                     read.setdefault(node.slice.value, set()).add(path))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    if _private(alias.name) or any(_private(p) for p in node.module.split(".")):
                        imported.append((node.module, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in LIBRARIES and any(_private(p) for p in parts):
                        imported.append((alias.name, ""))
    return read, own, imported


def test_every_private_name_the_source_uses_is_in_the_inventory():
    """A scan of the package's source: every underscored attribute it reads that it does not define itself, and
    every private module or name it imports from torch, Lightning, torchmetrics, transformers, peft or diffusers, has
    an entry in ``lightning_pipe._compat`` (``PRIVATE_NAMES``, or ``PRIVATE_NAMES_WHERE_PRESENT``). A new private
    name without an entry fails here."""
    from lightning_pipe._compat import PRIVATE_NAMES_WHERE_PRESENT

    entries = PRIVATE_NAMES + PRIVATE_NAMES_WHERE_PRESENT
    listed = {part for module, path in entries for part in (*module.split("."), *path.split("."))}
    modules = {module for module, _ in entries}
    read, own, imported = _scan(_package_sources())
    unlisted = sorted(f"{name} (in {', '.join(sorted(paths))})" for name, paths in read.items()
                      if name not in own | listed | STANDARD_LIBRARY)
    unlisted += sorted(
        f"{module}.{name}".rstrip(".") for module, name in imported
        if f"{module}.{name}" not in modules and module not in modules and (module, name) not in entries
        and not any(m == module and p.split(".")[0] == name for m, p in entries)
    )
    assert not unlisted, "private names without an entry in lightning_pipe/_compat/__init__.py:\n" + "\n".join(unlisted)


def test_the_scan_sees_reads_imports_and_own_names():
    """The scan itself, on a few lines of source."""
    import ast

    source = (
        "from torch.distributed import _private_mod\n"
        "import torch.distributed._also_private\n"
        "x = torch.nn.Module()._parameters\n"
        "getattr(y, '_hidden_thing')\n"
        "vars(z)['_via_vars']\n"
        "self._mine = 1\n"
        "object.__setattr__(self, '_set_plainly', 2)\n"
        "print(self._mine)\n"
    )
    read, own, imported = _scan({"example.py": ast.parse(source)})
    assert {"_parameters", "_hidden_thing", "_via_vars", "_mine"} <= set(read)
    assert {"_mine", "_set_plainly"} <= own and "_parameters" not in own
    assert ("torch.distributed", "_private_mod") in imported and ("torch.distributed._also_private", "") in imported
