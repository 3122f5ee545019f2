"""The ``fedparity`` command line: the LDP math for auditors and planners.

Subcommands (``fedparity <command> --help`` for every option):

* ``privacy``  -- the true LDP epsilon of M_R / M_L / M_P / M_N for (eps1, eps2, d) (the paper's
  Theorem 5, and its Theorem 6 for k != 2, are false; see
  :func:`fedparity.mechanisms.ldp.calibration.true_epsilon`);
* ``plan``     -- minimum budget for an error target, or the error bound at a budget;
* ``measure``  -- run a mechanism on every row of a CSV (one row = one client) and estimate
  the per-group means and gaps from the perturbed reports, streaming the file;
* ``fairtest`` -- the two-stage FedEvalFair test on per-client summaries from a CSV;
* ``keys``     -- write a CKKS key pair for the encrypted FedEvalFair protocol;
* ``federations`` -- add the app's ``local-simulation`` / ``local-deployment`` connections to
  Flower's ``$FLWR_HOME/config.toml``;
* ``ledger``   -- ``ledger show PATH``: every release of a per-user privacy ledger and the
  running total (:mod:`fedparity.mechanisms.privacy.user_ledger`).

M_R and M_L are the mechanisms of Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated Learning",
AFCP workshop, PMLR, 2022; FedEvalFair is "FedEvalFair: A Privacy-Preserving and Statistically
Grounded Federated Fairness Evaluation Framework", anonymous authors, ACM Multimedia 2024
submission.

Each takes ``--json`` to print one JSON object (keys in the CLI guide, docs/guides/cli.md).
Bad input exits with status 2 and a one-line message naming the parameter; nothing is computed
or released.
No Flower import here: the command starts fast and works without a federation.
"""

import lazy_loader as _lazy

# Loaded on first use, as in every fedparity package (see fedparity.clients).
__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
