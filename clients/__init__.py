"""Client side of fedparity: Flower handlers for your own ``ClientApp``.

* :func:`ldp_audit_handler` with :class:`LocalUsers` -- the LDP gap audit on a node;
* :func:`fedevalfair_handlers` with :class:`HolderRows` -- a FedEvalFair data holder.

The project's own ClientApp (:mod:`fedparity.clients.app`) is built from the same handlers.
"""

from .fedevalfair_handlers import HolderRows, fedevalfair_handlers
from .ldp import LocalUsers, ldp_audit_handler

__all__ = ["HolderRows", "LocalUsers", "fedevalfair_handlers", "ldp_audit_handler"]
