"""Import the math package first, completely, before the apps' other imports.

Flower's simulation imports the ServerApp (in a thread) and the ClientApp at once. A thread
that reaches a submodule of a package another thread is still initialising can, for an
instant, find that package missing from ``sys.modules`` (importlib re-inserts a package when
its ``__init__`` ends): a ``KeyError`` in 4-6 of 1500 concurrent imports
(tests/test_layers.py). ``import_module`` waits on the package's import lock instead, so both
apps import this module before anything of ``fedparity.mechanisms``.
"""

import importlib

importlib.import_module(__name__.rsplit(".", 2)[0] + ".mechanisms")
