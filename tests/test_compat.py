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
        return i == len(parts) - 1 and isinstance(target, type) and _assigned_by_instances(target, part)
    return True


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
    # _lightning/parallel_dims.py: ParallelDims.build passes `backend_override` by keyword
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"): ("self", "mesh_dim_name", "backend_override"),
    # _compat/torch.py: parallel_styles_recorded swaps it for `recorded(self, module, device_mesh)`
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
