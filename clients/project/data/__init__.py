"""User populations for the federated fairness audit.

A Flower node (SuperNode) hosts a *shard* of users: many users per node in simulation, exactly
one user on a real device. Both cases use the same :class:`UserShard`, so the client code path
is identical.

Two populations are available:

* ``"synthetic"`` -- an embedded, seeded population (no download), see
  :func:`synthetic_partition`. The task is deliberately harder for higher-numbered groups, so a
  trained model has a known, clearly non-zero performance gap between groups.
* ``"adult"`` -- the UCI Adult census data split into small single-group users, see
  :func:`load_adult`, :func:`adult_features` and :func:`adult_partition`.

:func:`load_partition` dispatches between them with validated arguments.
"""

import lazy_loader as _lazy

# The names below load on first use (lazy_loader; the stub next to this file lists them for
# type checkers). Importing one submodule never runs the others, so two threads that import
# different submodules at once cannot deadlock on the import locks: Flower's simulation loads
# the ServerApp and the ClientApp in two threads.
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
