"""Server side of fedparity's protocols, in the shape of ``flwr.serverapp.strategy``: objects
with explicit keyword arguments and a ``start(grid, ...)`` method that returns a result.

* :class:`LdpGapAudit` -- the LDP gap audit (returns an ``AuditOutcome``);
* :class:`FedEvalFairProtocol` -- the encrypted FedEvalFair test (``FedEvalFairOutcome``);
* :class:`FPFLProtocol` -- one FPFL training round as a masked secure sum, and
  :class:`FPFLTraining` -- the training loop over it (MMDM or FederatedSGD steps, selection);
* :class:`RobustFedAvg` -- Flower's FedAvg that counts malformed replies instead of failing.
"""

from .fedevalfair import FedEvalFairOutcome, FedEvalFairProtocol
from .fpfl import FPFLProtocol, FPFLTraining, FPFLTrainingResult, RoundOutcome
from .ldp_audit import AuditOutcome, LdpGapAudit
from .robust_fedavg import RobustFedAvg

__all__ = [
    "AuditOutcome",
    "FPFLProtocol",
    "FPFLTraining",
    "FPFLTrainingResult",
    "FedEvalFairOutcome",
    "FedEvalFairProtocol",
    "LdpGapAudit",
    "RobustFedAvg",
    "RoundOutcome",
]
