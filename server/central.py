"""Moved: the central Table 1 reproduction of the FPFL paper is ``benchmarks/fpfl_central.py``.

It is a reproduction of a paper's table, not one of the ServerApp's jobs, so it lives with the
other benchmarks in the source repository (``python benchmarks/fpfl_central.py --help``). Using
a name from here, or ``python -m fedparity.server.central``, fails with this message.
"""

from __future__ import annotations

import sys

MOVED = (
    "fedparity.server.central moved to benchmarks/fpfl_central.py in the fedparity source "
    "repository: run python benchmarks/fpfl_central.py (same options)"
)

__all__: list[str] = []


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"{MOVED} (asked for {name!r})")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(MOVED)
