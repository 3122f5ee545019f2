"""Client side of fedparity: Flower handlers for your own ``ClientApp``.

* :func:`ldp_audit_handler` with :class:`LocalUsers` -- the LDP gap audit on a node;
* :func:`rate_report_handler` with :class:`LocalPredictions` -- one private report per user
  from which every rate metric per group is read;
* :func:`fedevalfair_handlers` with :class:`HolderRows` -- a FedEvalFair data holder (the bound
  methods of a :class:`FedEvalFairHolder`);
* :func:`fpfl_handlers` with :class:`FPFLNodeSettings` and :class:`FPFLShard` -- FPFL training
  of your torch model on the node's users (the bound methods of an :class:`FPFLNode`).

The project's own ClientApp (:mod:`fedparity.clients.app`) is built from the same handlers;
its own task (run config, embedded data, populations, models) is :mod:`fedparity.clients.project`,
which the library never imports.
"""

import lazy_loader as _lazy

# The names below load on first use (lazy_loader; the stub next to this file lists them for
# type checkers). Importing one submodule never runs the others, so two threads that import
# different submodules at once cannot deadlock on the import locks: Flower's simulation loads
# the ServerApp and the ClientApp in two threads.
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
