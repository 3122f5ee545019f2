"""Old import paths of modules and names that moved, kept for a deprecation period.

A module left at an old path forwards its names through :func:`moved_names`: the first use of
each name warns with a ``DeprecationWarning`` naming the new path. The target is imported by
name, on use only, so an old path costs nothing until it is used and never imports more than
the module it forwards to. Two moves use it: the project app's own task (``fedparity.clients``
to :mod:`fedparity.clients.project`, so that the library never imports the app) and the
mechanisms' rooms by purpose (``fedparity.mechanisms.<module>`` to
``fedparity.mechanisms.<room>.<module>``, issue 29). It lives in ``fedparity.mechanisms``, the
bottom layer, so that every layer may import it (pure standard library, no Flower).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable


def moved_names(old: str, new: str, names: Iterable[str] | None = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for module ``old`` that forwards ``names`` (all public names if
    None) to module ``new`` with a ``DeprecationWarning``."""
    forwarded = None if names is None else frozenset(names)

    def __getattr__(name: str) -> object:
        if name.startswith("__") or (forwarded is not None and name not in forwarded):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)
        warnings.warn(
            f"{old}.{name} moved to {new}.{name}; import it from there "
            f"({old} keeps it only for a deprecation period)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
