"""Deprecated: moved to :mod:`fedparity.clients.project.data` (the project app's embedded data).

Importing a name from here still works and warns with a ``DeprecationWarning``;
:class:`~fedparity.clients.shards.UserShard` itself is the library's
(:mod:`fedparity.clients.shards`).
"""

from ...mechanisms._deprecated import moved_names

__getattr__ = moved_names(__name__, "fedparity.clients.project.data")
