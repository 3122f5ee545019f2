"""Server side of fedparity's protocols, in the shape of ``flwr.serverapp.strategy``: objects
with explicit keyword arguments and a ``start(grid, ...)`` method that returns a result.

* :class:`LdpGapAudit` -- the LDP gap audit (returns an ``AuditOutcome``), and
  :class:`SequentialLdpAudit` -- the sequential one (fresh users in batches until the question
  is answered; ``SequentialAuditOutcome``);
* :class:`FedEvalFairProtocol` -- the encrypted FedEvalFair test (``FedEvalFairOutcome``);
* :class:`FPFLProtocol` -- one FPFL training round as a masked secure sum, over the run's
  :class:`FPFLRunParameters` (agreed with every node at setup), and :class:`FPFLTraining` --
  the training loop over it (MMDM or FederatedSGD steps, selection), with
  :class:`FPFLObserver` hooks: :class:`DurableTraining` (the default: a release ledger on disk
  before each round is sent, checkpoints, resume), :class:`StopAfterLostRounds` and
  :class:`StopWhenTooFewNodes`;
* :class:`LdpAuditSeries` and :class:`FedEvalFairSeries` -- several audits (or tests) in one
  loop with :class:`SeriesObserver` hooks: :class:`DurableReleases` (the default: each
  release recorded in a :class:`ReleaseLog` on disk before it is sent, the count continued
  from the same folder) and :class:`StopAfterFailures`;
* :class:`RobustFedAvg` -- Flower's FedAvg that counts malformed replies instead of failing.
"""

import lazy_loader as _lazy

# The names below load on first use (lazy_loader; the stub next to this file lists them for
# type checkers). Importing one submodule never runs the others, so two threads that import
# different submodules at once cannot deadlock on the import locks: Flower's simulation loads
# the ServerApp and the ClientApp in two threads.
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
