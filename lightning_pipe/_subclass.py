"""Copies of Lightning objects whose class is a subclass of the user's, under the user's class name.

The strategy hands Lightning a changed copy of the user's precision plugin (:mod:`lightning_pipe._lightning.precision`)
and of each summary callback (:mod:`lightning_pipe._lightning.summary`). The copy's class puts a mixin in front of the
user's class and keeps its ``__name__``, ``__qualname__`` and ``__module__``: ``isinstance`` against the user's class
still holds, and Lightning saves and restores the state of a plugin or callback under a key made from its class's
qualified name, which stays the user's. The user's object is not changed. """

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

#: One class per (user's class, mixin), so that every copy of one object has the same class.
_variants: dict[tuple[type, type], type] = {}


def copy_with_mixin(obj: T, mixin: type) -> T:
    """A shallow copy of ``obj`` (its ``__dict__``) whose class is ``mixin`` in front of ``type(obj)``, named like
    ``type(obj)``."""
    cls = type(obj)
    variant = _variants.get((cls, mixin))
    if variant is None:
        variant = type(cls.__name__, (mixin, cls), {"__qualname__": cls.__qualname__})
        variant.__module__ = cls.__module__
        _variants[(cls, mixin)] = variant
    copy = variant.__new__(variant)
    copy.__dict__.update(obj.__dict__)
    return copy
