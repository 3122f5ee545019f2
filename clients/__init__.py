"""Client side of fedparity: Flower handlers for your own ``ClientApp``.

* :func:`ldp_audit_handler` with :class:`LocalUsers` -- the LDP gap audit on a node;
* :func:`fedevalfair_handlers` with :class:`HolderRows` -- a FedEvalFair data holder;
* :func:`fpfl_handlers` with :class:`FPFLNodeSettings` and :class:`FPFLShard` -- FPFL training
  of your torch model on the node's users.

The project's own ClientApp (:mod:`fedparity.clients.app`) is built from the same handlers.
"""

from .fedevalfair_handlers import HolderRows, fedevalfair_handlers
from .fpfl_data import FPFLShard
from .fpfl_handlers import fpfl_handlers
from .fpfl_node import FPFLNodeSettings
from .ldp import LocalUsers, ldp_audit_handler

__all__ = [
    "FPFLNodeSettings",
    "FPFLShard",
    "HolderRows",
    "LocalUsers",
    "fedevalfair_handlers",
    "fpfl_handlers",
    "ldp_audit_handler",
]
