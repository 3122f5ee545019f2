"""Deprecated: moved to :mod:`fedparity.clients.project.task` (the project app's own task).

Importing a name from here still works and warns with a ``DeprecationWarning``.
"""

from ..mechanisms._deprecated import moved_names

__getattr__ = moved_names(__name__, "fedparity.clients.project.task")
