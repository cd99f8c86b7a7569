"""A user's ``LightningModule.backward`` override, under a schedule that runs backward itself.

[Note: backward overrides]
Lightning calls ``LightningModule.backward(loss)`` after ``training_step``; under ``PipelineStrategy`` the schedule
runs each microbatch's backward inside ``training_step``, so the override is not called around it. An override that
only enters a context and calls the base method (Lightning's tensor-parallel example: ``with loss_parallel():
super().backward(*args, **kwargs)``), or calls ``loss.backward()`` itself as the base method does, is honoured: the
last stage's backward of every microbatch runs *through* the override, which is called with a stand-in loss whose
``backward()`` runs the schedule's backward, inside whatever context the override entered. An override that does
anything else (scales the loss, calls ``manual_backward``, steps a scaler) is refused at setup, naming it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Callable, Optional, TypeVar

import lightning.pytorch as pl

T = TypeVar("T")


class _SchedulesBackward:
    """The stand-in loss an override receives: ``LightningModule.backward`` calls its ``backward()``."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run
        self.result: Any = None
        self.ran = False

    def backward(self, *args: Any, **kwargs: Any) -> None:
        self.result, self.ran = self._run(), True


def through_backward_override(module: pl.LightningModule) -> Optional[Callable[[Callable[[], T]], T]]:
    """``None`` when ``module`` does not override ``backward``; else ``run(fn)``, which calls ``fn`` (the last
    stage's backward) inside the override ([Note: backward overrides]). Raises ``ValueError`` naming the override when
    it does more than enter a context."""
    override = type(module).backward
    if override is pl.LightningModule.backward or override.__qualname__ == "LightningModule.backward":
        return None  # Lightning's own (also under the `pytorch_lightning` package name)
    if not _only_enters_a_context(override):
        where = f"{override.__module__}.{override.__qualname__}"
        raise ValueError(
            f"`{where}` overrides `LightningModule.backward`. Under `PipelineStrategy` the pipeline schedule runs"
            " backward inside `training_step`, so an override is honoured only when it enters a context and calls"
            " `super().backward(...)` (`with loss_parallel(): super().backward(*args, **kwargs)`). Move the rest into"
            " `training_step` (scale the loss there) or into `on_before_backward`/`on_after_backward`."
        )

    def run(fn: Callable[[], T]) -> T:
        loss = _SchedulesBackward(fn)
        module.backward(loss)  # type: ignore[arg-type]
        if not loss.ran:
            raise RuntimeError(f"`{type(module).__name__}.backward` did not call `super().backward(...)`.")
        return loss.result

    return run


def _only_enters_a_context(function: Callable[..., Any]) -> bool:
    """Whether ``function``'s body is ``with ...: super().backward(<its own arguments>)`` (or ``loss.backward(...)`` on
    its first argument, as the base method does), nothing else."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return False
    definition = ast.parse(source).body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = _without_imports(definition.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    while len(body) == 1 and isinstance(body[0], ast.With):
        body = _without_imports(body[0].body)
    if len(body) != 1 or not isinstance(body[0], (ast.Expr, ast.Return)):
        return False
    call = body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "backward"):
        return False
    target = call.func.value
    positional = definition.args.args[1:]
    if isinstance(target, ast.Name):  # `loss.backward()`, as LightningModule.backward's docstring shows
        if not positional or target.id != positional[0].arg:
            return False
    elif not (isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super"):
        return False
    params = {a.arg for a in positional + definition.args.kwonlyargs}
    params |= {a.arg for a in (definition.args.vararg, definition.args.kwarg) if a is not None}
    passed = [a.value if isinstance(a, ast.Starred) else a for a in call.args] + [k.value for k in call.keywords]
    return all(isinstance(a, ast.Name) and a.id in params for a in passed)


def _without_imports(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` without its import statements (``from torch.distributed.tensor.parallel import loss_parallel``)."""
    return [statement for statement in body if not isinstance(statement, (ast.Import, ast.ImportFrom))]
