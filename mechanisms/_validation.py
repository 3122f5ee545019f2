"""Deprecated: moved to :mod:`fedparity.mechanisms.validation`.

The argument checks are one public module now (issue 29). Importing a name from here still
works and warns with a ``DeprecationWarning`` naming the new path. No code of its own
(``tests/test_layers.py`` checks).
"""

from ._deprecated import moved_names

__getattr__ = moved_names(__name__, "fedparity.mechanisms.validation")
