"""Deprecated: moved to :mod:`fedparity.mechanisms.crypto.ckks.flooding`.

The mechanisms live in rooms by purpose (issue 29); this module's room is cryptography.
Importing a name from here still works and warns with a ``DeprecationWarning`` naming the
new path. No code of its own (``tests/test_layers.py`` checks).
"""

from .._deprecated import moved_names

__getattr__ = moved_names(__name__, "fedparity.mechanisms.crypto.ckks.flooding")
