"""fedparity.mechanisms: the math, usable alone (pure numpy/scipy; no Flower import).

LDP gap measurement (paper 000/001, SPEC 1):

* :class:`RandomizedResponseMechanism` (M_R) and :class:`LaplaceMechanism` (M_L, k = 2),
  with their *true* epsilon (:func:`true_epsilon`, SPEC 1.1);
* :func:`mechanism_for_budget` / :func:`optimal_split`: the (eps1, eps2) split within a budget;
* :func:`estimate_gap`: unbiased group means, gaps, standard errors, intervals and bounds;
* :func:`summarize_stream`: mechanism + summary over chunks, in bounded memory;
* :mod:`mechanisms.planner`: minimum budget for an error target, error at a budget, Table 1;
* :class:`PrivacyLedger` / :class:`ShardLedger`: per-user budgets over repeated audits.
"""

from mechanisms.accounting import PrivacyBudgetExceeded, PrivacyLedger, ShardLedger
from mechanisms.calibration import (
    BudgetSplit,
    best_split,
    build_mechanism,
    mechanism_for_budget,
    optimal_split,
    true_epsilon,
)
from mechanisms.estimators import (
    ConfidenceInterval,
    EstimationError,
    GapEstimate,
    estimate_gap,
    metric_to_value,
    value_to_metric,
)
from mechanisms.laplace import LaplaceMechanism, UnboundedPrivacyLossError, laplace_epsilon
from mechanisms.randomized_response import (
    RandomizedResponseMechanism,
    grr_frequency_estimate,
    grr_keep_probability,
    grr_perturb,
    randomized_response_epsilon,
)
from mechanisms.reports import PerturbedReports, ReportMoments, ReportSummary
from mechanisms.streaming import summarize_stream

__all__ = [
    "BudgetSplit",
    "ConfidenceInterval",
    "EstimationError",
    "GapEstimate",
    "LaplaceMechanism",
    "PerturbedReports",
    "PrivacyBudgetExceeded",
    "PrivacyLedger",
    "RandomizedResponseMechanism",
    "ReportMoments",
    "ReportSummary",
    "ShardLedger",
    "UnboundedPrivacyLossError",
    "best_split",
    "build_mechanism",
    "estimate_gap",
    "grr_frequency_estimate",
    "grr_keep_probability",
    "grr_perturb",
    "laplace_epsilon",
    "mechanism_for_budget",
    "metric_to_value",
    "optimal_split",
    "randomized_response_epsilon",
    "summarize_stream",
    "true_epsilon",
    "value_to_metric",
]
