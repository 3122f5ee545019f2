"""fedparity.mechanisms: the math, usable alone (pure numpy/scipy; no Flower import).

LDP gap measurement (paper 000/001, SPEC 1):

* :class:`RandomizedResponseMechanism` (M_R) and :class:`LaplaceMechanism` (M_L, k = 2),
  with their *true* epsilon (:func:`true_epsilon`, SPEC 1.1);
* :func:`mechanism_for_budget` / :func:`optimal_split`: the (eps1, eps2) split within a budget;
* :func:`estimate_gap`: unbiased group means, gaps, standard errors, intervals and bounds;
* :func:`summarize_stream`: mechanism + summary over chunks, in bounded memory;
* :mod:`fedparity.mechanisms.planner`: minimum budget for an error target, error at a budget, Table
  1;
* :class:`PrivacyLedger` / :class:`ShardLedger`: per-user budgets over repeated audits.

FedEvalFair two-stage fairness test (paper 003, SPEC 2):

* :func:`bootstrap_disparity`: a client's B bootstrap disparities (dp / eo) and its
  :class:`ClientSummary` in mode "paper" or "calibrated";
* :func:`fedevalfair`: stage 1 (T1 or Cochran's Q), stage 2 (W*) and TOST in a
  :class:`FairnessReport`; :func:`client_contribution`, :func:`stage1_term`,
  :func:`stage1_statistic` and :func:`report_from_sums` are the same computation as sums over
  clients (encrypted protocol); :func:`stage_statistics` vectorises it for simulations;
  :func:`disparity_variance` gives the calibrated weights from a holder's margins.

FPFL: fairness-constrained training with user-level DP (paper 004, SPEC 3):

* :class:`StatisticsLayout` / :class:`AggregateStatistics`: the sufficient-statistic vector
  (Eq. 17) and its cohort sum; :func:`evaluate_constraints`, :func:`mmdm_update` (Eq. 9-11),
  :func:`sgd_update`; :func:`privatize_sum` (Gaussian noise on a clipped sum);
* :func:`cohort_metrics` / :class:`ModelSelector`: model selection on cohort statistics;
* :func:`fairness_gaps`: accuracy and FNR / EO / DemP / PP gaps of hard predictions.
"""

from .accounting import PrivacyBudgetExceeded, PrivacyLedger, ShardLedger
from .calibration import (
    BudgetSplit,
    best_split,
    build_mechanism,
    mechanism_for_budget,
    optimal_split,
    true_epsilon,
)
from .estimators import (
    ConfidenceInterval,
    EstimationError,
    GapEstimate,
    estimate_gap,
    metric_to_value,
    value_to_metric,
)
from .fairtest import (
    BootstrapDisparity,
    ClientSummary,
    FairnessReport,
    InsufficientGroupData,
    StageStatistics,
    TestResult,
    bootstrap_disparity,
    client_contribution,
    common_disparity_test,
    disparity_variance,
    equivalence_test,
    fedevalfair,
    homogeneity_test,
    report_from_sums,
    stage1_statistic,
    stage1_term,
    stage_statistics,
)
from .laplace import LaplaceMechanism, UnboundedPrivacyLossError, laplace_epsilon
from .mmdm import (
    AggregateStatistics,
    CohortMetrics,
    ConstraintEvaluation,
    FairnessGaps,
    MMDMConfig,
    MMDMUpdate,
    ModelSelector,
    NoisySum,
    SelectionCandidate,
    StatisticsLayout,
    cohort_metrics,
    evaluate_constraints,
    fairness_gaps,
    mmdm_update,
    privatize_sum,
    sgd_update,
)
from .randomized_response import (
    RandomizedResponseMechanism,
    grr_frequency_estimate,
    grr_keep_probability,
    grr_perturb,
    randomized_response_epsilon,
)
from .reports import PerturbedReports, ReportMoments, ReportSummary
from .streaming import summarize_stream

__all__ = [
    "AggregateStatistics",
    "CohortMetrics",
    "ConstraintEvaluation",
    "FairnessGaps",
    "MMDMConfig",
    "MMDMUpdate",
    "ModelSelector",
    "NoisySum",
    "SelectionCandidate",
    "StatisticsLayout",
    "cohort_metrics",
    "evaluate_constraints",
    "fairness_gaps",
    "mmdm_update",
    "privatize_sum",
    "sgd_update",
    "BootstrapDisparity",
    "BudgetSplit",
    "ClientSummary",
    "ConfidenceInterval",
    "EstimationError",
    "FairnessReport",
    "GapEstimate",
    "InsufficientGroupData",
    "LaplaceMechanism",
    "PerturbedReports",
    "PrivacyBudgetExceeded",
    "PrivacyLedger",
    "RandomizedResponseMechanism",
    "ReportMoments",
    "ReportSummary",
    "ShardLedger",
    "StageStatistics",
    "TestResult",
    "UnboundedPrivacyLossError",
    "best_split",
    "bootstrap_disparity",
    "build_mechanism",
    "client_contribution",
    "common_disparity_test",
    "disparity_variance",
    "equivalence_test",
    "estimate_gap",
    "fedevalfair",
    "grr_frequency_estimate",
    "grr_keep_probability",
    "grr_perturb",
    "homogeneity_test",
    "laplace_epsilon",
    "mechanism_for_budget",
    "metric_to_value",
    "optimal_split",
    "randomized_response_epsilon",
    "report_from_sums",
    "stage1_statistic",
    "stage1_term",
    "stage_statistics",
    "summarize_stream",
    "true_epsilon",
    "value_to_metric",
]
