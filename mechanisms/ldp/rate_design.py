"""Which LDP design answers a rate question more precisely: one joint report per user, or the
single-metric gap audit, at the same epsilon.

The question is the difference of a rate metric between groups 0 and 1. Two designs spend the
same epsilon per user:

* **the joint report** (:mod:`fedparity.mechanisms.ldp.group_rates`): each user's (group,
  confusion cell) category through the frequency oracle of least variance
  (:func:`~fedparity.mechanisms.ldp.frequency_oracle.frequency_oracle` ``"best"``); the rate
  R_g = a'c / b'c of the estimated counts c, whose difference has the delta-method variance
  (grad_0 - grad_1)' Sigma (grad_0 - grad_1), grad_g = (a - R_g b) / b'c, with Sigma the
  oracle's exact covariance of the counts (:meth:`FrequencyOracle.covariance`, Wang, Blocki, Li
  and Jha 2017);
* **the gap audit** (M_R or M_L of Juarez and Korolova 2022, as
  :meth:`~fedparity.strategies.ldp_audit.LdpGapAudit.for_budget` deploys it): each user's
  (group, metric value) pair, with the "undefined" category for users without the metric (no
  positive label for TPR and FNR, no negative one for FPR); its variance is the estimator's
  own covariance with group sizes estimated from the reports
  (:func:`~fedparity.mechanisms.ldp.power.difference_variance`, Juarez and Korolova 2022,
  Eqs. 19-20 and the delta method). A user with one labelled prediction has a metric value
  in {0, 1} with mean R_g.

Both standard errors are the *true* ones (how far each estimate strays), computed at the
expected counts of the scenario given (``cell_counts``: the group x cell counts you expect,
e.g. from a pilot or a non-private evaluation of a similar model); the normal interval's half
width is z times them. Selection rate, TNR, precision and NPV have no gap audit: the joint
report is the only LDP design for them. Each user has one labelled prediction (a user with
several reports one of them in the joint report, and their mean in the gap audit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ..validation import check_choice, check_epsilon, check_num_groups, check_open_unit
from .calibration import MechanismChoice, best_split
from .estimators import normal_quantile
from .frequency_oracle import frequency_oracle
from .group_rates import CELLS, RATE_METRICS
from .power import difference_variance

__all__ = ["GAP_AUDIT_METRICS", "DesignComparison", "compare_rate_designs"]

#: The rate metrics the gap audit measures (fairlearn name -> the audit's metric name).
GAP_AUDIT_METRICS: dict[str, str] = {
    "accuracy": "accuracy",
    "true_positive_rate": "tpr",
    "false_positive_rate": "fpr",
    "false_negative_rate": "fnr",
}


@dataclass(frozen=True)
class DesignComparison:
    """The two designs' precision for the difference of ``metric`` between groups 0 and 1.

    Attributes
    ----------
    metric : str
        The rate metric (fairlearn's name).
    epsilon : float
        The budget per user of either design.
    num_users : float
        Users in the scenario.
    difference : float
        The scenario's true difference R_0 - R_1.
    confidence : float
        Level of the half widths.
    joint_oracle : str
        The joint report's frequency oracle ("grr", "oue" or "ss").
    joint_stderr : float
        Standard error of the joint report's difference.
    gap_audit_mechanism : str or None
        M_R ("R") or M_L ("L") as the audit would deploy it; None when the metric has no gap
        audit.
    gap_audit_stderr : float or None
        Standard error of the gap audit's difference (None: no gap audit).
    """

    metric: str
    epsilon: float
    num_users: float
    difference: float
    confidence: float
    joint_oracle: str
    joint_stderr: float
    gap_audit_mechanism: str | None
    gap_audit_stderr: float | None

    @property
    def joint_half_width(self) -> float:
        return normal_quantile(self.confidence) * self.joint_stderr

    @property
    def gap_audit_half_width(self) -> float | None:
        if self.gap_audit_stderr is None:
            return None
        return normal_quantile(self.confidence) * self.gap_audit_stderr

    @property
    def tighter(self) -> str:
        """``"joint report"`` or ``"gap audit"``: the design with the narrower interval."""
        if self.gap_audit_stderr is None or self.joint_stderr <= self.gap_audit_stderr:
            return "joint report"
        return "gap audit"

    def summary(self) -> str:
        level = f"{100 * self.confidence:g} %"
        joint = (
            f"joint report ({self.joint_oracle}): +/- {self.joint_half_width:.4g}"
            f" ({level} half width)"
        )
        if self.gap_audit_stderr is None:
            return (
                f"{self.metric.replace('_', ' ')} difference at epsilon {self.epsilon:g}: "
                f"{joint}; the gap audit does not measure this metric"
            )
        ratio = max(self.joint_stderr, self.gap_audit_stderr) / min(
            self.joint_stderr, self.gap_audit_stderr
        )
        return (
            f"{self.metric.replace('_', ' ')} difference at epsilon {self.epsilon:g}: {joint}; "
            f"gap audit (M_{self.gap_audit_mechanism}): +/- {self.gap_audit_half_width:.4g}. "
            f"The {self.tighter} is tighter ({ratio:.2f}x narrower); the joint report also gives "
            "every other rate metric for the same epsilon"
        )


def _rows(metric: str, group: int, cells: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numerator and denominator rows of ``metric`` for ``group`` over the k categories."""
    top, bottom = RATE_METRICS[metric]
    numer, denom = np.zeros(k), np.zeros(k)
    index = {name: i for i, name in enumerate(CELLS)}
    for name in top:
        numer[group * cells + index[name]] = 1.0
    for name in bottom:
        denom[group * cells + index[name]] = 1.0
    return numer, denom


def compare_rate_designs(
    metric: str,
    epsilon: float,
    cell_counts: ArrayLike,
    *,
    num_groups: int,
    confidence: float = 0.95,
    mechanism: MechanismChoice = "best",
) -> DesignComparison:
    """Standard errors of the two designs for the difference of ``metric`` between groups 0
    and 1 at ``epsilon`` per user, in the scenario ``cell_counts`` (expected group x cell
    counts, category order g * 4 + cell with cells TP, FP, FN, TN, as
    :func:`~fedparity.mechanisms.ldp.group_rates.encode_cells`).

    >>> counts = np.array([300, 100, 100, 500, 200, 100, 200, 500]) * 25  # 2 groups, 40,000 users
    >>> result = compare_rate_designs("true_positive_rate", 4.0, counts, num_groups=2)
    >>> result.tighter, round(result.joint_stderr, 4), round(result.gap_audit_stderr, 4)
    ('joint report', 0.0043, 0.0057)
    >>> compare_rate_designs("true_positive_rate", 1.0, counts, num_groups=2).tighter
    'gap audit'
    """
    check_choice("metric", metric, tuple(RATE_METRICS))
    epsilon = check_epsilon("epsilon", epsilon)
    num_groups = check_num_groups(num_groups)
    confidence = check_open_unit("confidence", confidence)
    counts = np.asarray(cell_counts, dtype=np.float64)
    k = num_groups * len(CELLS)
    if counts.shape != (k,) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError(
            f"cell_counts must be {k} finite counts >= 0 (num_groups x {len(CELLS)} cells), got "
            f"shape {counts.shape}"
        )
    n = float(counts.sum())
    rates, gradients = [], []
    for group in (0, 1):
        numer, denom = _rows(metric, group, len(CELLS), k)
        bottom = float(denom @ counts)
        if not bottom > 0:
            raise ValueError(
                f"cell_counts: group {group} has no user in the denominator of {metric}"
            )
        rate = float(numer @ counts) / bottom
        rates.append(rate)
        gradients.append((numer - rate * denom) / bottom)
    oracle = frequency_oracle("best", epsilon, k, max(int(round(n)), 1))
    gradient = gradients[0] - gradients[1]
    joint_variance = float(gradient @ oracle.covariance(counts) @ gradient)

    audit_name = GAP_AUDIT_METRICS.get(metric)
    audit_mechanism: str | None = None
    audit_stderr: float | None = None
    if audit_name is not None:
        by_group = counts.reshape(num_groups, len(CELLS))
        _, bottom_cells = RATE_METRICS[metric]
        defined_cells = [CELLS.index(name) for name in bottom_cells]
        defined = by_group[:, defined_cells].sum(axis=1)
        undefinable = audit_name != "accuracy"
        sizes = np.append(defined, n - defined.sum()) if undefinable else defined
        split = best_split(mechanism, epsilon, sizes.size)
        moments = split.build().moments
        # a one-row user's metric is 0 or 1: v = 2 m - 1 is +-1, so each category's sum of v^2
        # is its size (the undefined category reports v = 0)
        squares = sizes.copy()
        if undefinable:
            squares[-1] = 0.0
        unit_variance = difference_variance(
            moments, sizes / n, (rates[0], rates[1]), squares / n, sizes_known=False
        )
        audit_mechanism, audit_stderr = split.mechanism, math.sqrt(unit_variance / n)
    return DesignComparison(
        metric=metric,
        epsilon=epsilon,
        num_users=n,
        difference=rates[0] - rates[1],
        confidence=confidence,
        joint_oracle=oracle.name,
        joint_stderr=math.sqrt(max(joint_variance, 0.0)),
        gap_audit_mechanism=audit_mechanism,
        gap_audit_stderr=audit_stderr,
    )
