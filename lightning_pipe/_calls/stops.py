"""How a run of the user's step ends before the step does (:class:`Stop`), and the errors of a step that calls the
backbone other than once per step."""

from __future__ import annotations

from lightning_pipe._errors import BackboneCallError


class Stop(BaseException):
    """Ends the user's step early, carrying a value (a ``BaseException``, so ``except Exception`` lets it pass): the
    capture's ``(first block, its hidden state)``, or what a stage sends on."""

    def __init__(self, value: tuple) -> None:
        super().__init__()
        self.value = value


class SecondPass(BackboneCallError):
    """The step called the backbone again after a whole pass: it decodes (``generate()``, a sampling loop). The
    evaluation steps then run in lock step (:mod:`lightning_pipe._step.generation`); elsewhere this is the error."""


class BackboneNotCalledError(BackboneCallError):
    """The step finished without calling the backbone at all (``backbone="auto"`` then tries another candidate)."""
