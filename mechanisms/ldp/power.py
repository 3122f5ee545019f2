"""Power and sample size: what an LDP audit, or a FedEvalFair test, can detect.

**LDP audit.** The audit estimates the difference of two groups' mean metric, D = m_0 - m_1
(metric units, m in [0, 1]), from the perturbed reports with
:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`, and its normal interval at level
1 - alpha excludes 0 exactly when the two-sided test of D = 0 at level alpha rejects. With
D_hat ~ N(D, s_t^2) and the estimator's standard error s_e, the power is

    P(reject) = Phi((|D| - z s_e) / s_t) + Phi((-|D| - z s_e) / s_t),   z = Phi^-1(1 - alpha / 2).

s_t and s_e come from the estimator's own covariance,
:func:`~fedparity.mechanisms.ldp.estimators.estimator_covariance`: Juarez and Korolova 2022,
Eq. 19 (M_L) and Eq. 20 (M_R) with Theorem 9 for known group sizes, and the delta method for
sizes estimated from the reports (the audit job's default). They are equal except for M_R with a
given spread of values: M_R's reports carry no information on the spread, so its standard error
assumes the smallest spread consistent with the mean. Both scale as 1 / sqrt(K) at fixed group
fractions. The mechanism is the one the audit job deploys for the budget,
:func:`~fedparity.mechanisms.ldp.calibration.best_split` at equal group fractions (as
:func:`~fedparity.mechanisms.ldp.calibration.mechanism_for_budget`).

Worst case (the default; the metric's mean and spread unknown): the smallest power over the
pairs of means (m_0, m_1) in [0, 1] with the given |D|, either group ahead, each group's values
spread so as to maximise the variance given its mean (a metric in {0, 1} for M_L; the same value
for every user of the group for M_R). The variances are quadratic in the means, so three
evaluations give them exactly on a grid of 1001 pairs. ``metric_mean`` (the midpoint of the two
group means) and ``metric_variance`` (the within-group variance of the per-user metric) replace
the worst case by a given population.

Approximations: D_hat is taken as normal (large K; the estimator's interval coverage is checked
by simulation at K = 20,000), s_e at the true means rather than the estimates, and the group
sizes at their expected values K f_G. For d > 2 groups the test is of the pair (0, 1) at level
alpha (the audit's max-gap interval is Bonferroni over all pairs: plan it with
alpha / number of pairs). A TPR / FPR audit, whose users without the metric report an extra
"undefined" category, is planned with that category's share as a third group fraction.

**FedEvalFair.** Stage 2 in the calibrated mode (FedEvalFair (anonymous, 2024), Algorithm 2,
with this package's calibration, :mod:`fedparity.mechanisms.fairness_tests.fedevalfair`): H0 mu =
mu0 is rejected when |mu_hat - mu0| > z se(mu0), mu_hat = sum w_i Y_i / sum w_i the Graybill-Deal
estimate (Eq. 6), w_i = 1 / V_i(0), se(mu) = sqrt(sum w_i^2 V_i(mu)) / sum w_i, V_i(mu) the binomial
variance of a holder's difference of two proportions at disparity mu given its margins
(:func:`~fedparity.mechanisms.fairness_tests.fedevalfair.disparity_variance`). With a true common
disparity d, Y_i ~ N(d, V_i(d)), so the power is the formula above with D = d - mu0, s_e = se(mu0)
and s_t = se(d). Approximations: normal holders' disparities, each holder's margins at their
expected values (rows N_i, group fractions, and the predicted-positive rate p: group rates
p + f_1 d and p - f_0 d), the calibrated mode only (the paper's own mode rejects a fair
population almost always, so its power means nothing).

References: Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure':
Privately Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop,
PMLR, 2022 (Juarez and Korolova 2022); anonymous authors, "FedEvalFair: A Privacy-Preserving and
Statistically Grounded Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
(FedEvalFair (anonymous, 2024)).

Examples
--------
>>> plan = audit_power(100_000, 1.0, 0.05)
>>> plan.mechanism, round(plan.power, 3)
('R', 0.983)
>>> audit_minimum_users(0.8, 1.0, 0.05).num_users
47284
>>> round(audit_detectable_gap(0.8, 100_000, 1.0).gap, 4)
0.0345
>>> fedevalfair_minimum_holders(0.8, 0.05, rows=1000).holders
4
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

from ..fairness_tests.fedevalfair import disparity_variances
from ..validation import (
    check_choice,
    check_finite,
    check_group_fractions,
    check_int_at_least,
    check_open_unit,
)
from .calibration import MECHANISMS, BudgetSplit, MechanismChoice, best_split
from .estimators import (
    SIZE_DETECTION_SIGMAS,
    estimator_covariance,
    normal_quantile,
    size_estimate_covariance,
    worst_case_square_sums,
)
from .planner import MAX_PLANNED_CLIENTS, MAX_PLANNED_EPSILON, MIN_PLANNED_EPSILON
from .reports import ReportMoments

AuditQuery = Literal["power", "min_users", "min_epsilon", "detectable_gap"]
FedEvalFairQuery = Literal["power", "min_holders", "min_rows", "detectable_disparity"]

#: Most holders and rows per holder a FedEvalFair plan is made for.
MAX_PLANNED_HOLDERS = 10**6
MAX_PLANNED_ROWS = 10**9
#: Relative precision of a planned epsilon (bisection in log epsilon) and absolute precision of a
#: detectable gap or disparity.
EPSILON_RELATIVE_TOLERANCE = 1e-4
GAP_TOLERANCE = 1e-6
#: Points of the grid of mean levels on which the (exactly quadratic) variances are evaluated
#: for the worst case.
_MEAN_GRID = 1001
#: A holder cell with fewer expected rows than this makes the normal approximation rough.
_SMALL_CELL_ROWS = 5.0


def rejection_probability(
    effect: float | np.ndarray,
    test_stderr: float | np.ndarray,
    true_stderr: float | np.ndarray,
    alpha: float,
) -> np.ndarray:
    """P(|X| > z test_stderr) for X ~ N(effect, true_stderr^2), z = Phi^-1(1 - alpha / 2).

    The power of a two-sided normal test at level ``alpha`` whose standard error is
    ``test_stderr`` when the estimate's true standard deviation is ``true_stderr``.
    """
    z = normal_quantile(1.0 - alpha)
    effect = np.abs(np.asarray(effect, dtype=np.float64))
    return stats.norm.cdf((effect - z * np.asarray(test_stderr)) / true_stderr) + stats.norm.cdf(
        (-effect - z * np.asarray(test_stderr)) / true_stderr
    )


def _check_power_target(power: float, alpha: float) -> float:
    """A target power in (alpha, 1): any test reaches alpha (a zero gap), none reaches 1."""
    try:
        number = float(power)
    except (TypeError, ValueError):
        number = math.nan
    if not alpha < number < 1.0:
        raise ValueError(
            f"power must be in ({alpha:g}, 1) (above the level alpha, which any test reaches, "
            f"and below 1), got {power!r}"
        )
    return number


def _check_in_range(name: str, value: float, low: float, high: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not low <= number <= high:
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return number


def _smallest_integer(meets: Callable[[int], bool], low: int, high: int) -> int | None:
    """Smallest n in [low, high] with meets(n) (meets increasing in n); None if none."""
    if not meets(high):
        return None
    if meets(low):
        return low
    while high - low > 1:  # meets(high) and not meets(low)
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def _smallest_float(
    meets: Callable[[float], bool], low: float, high: float, *, log: bool, tolerance: float
) -> float | None:
    """Smallest x in [low, high] with meets(x), to ``tolerance`` (relative if ``log``); the
    answer meets it. meets is increasing in x."""
    if not meets(high):
        return None
    if meets(low):
        return low
    while (high / low - 1.0 if log else high - low) > tolerance:
        middle = math.sqrt(low * high) if log else 0.5 * (low + high)
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


# --------------------------------------------------------------------------------------------
# LDP audit
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditPlan:
    """One answer of the LDP-audit planner: a complete (users, epsilon, gap, power) setting.

    Attributes
    ----------
    query : {"power", "min_users", "min_epsilon", "detectable_gap"}
        What was asked: the power at the rest, the minimum users, the minimum epsilon, or the
        smallest gap detected with ``target_power``.
    mechanism : {"R", "L", "P", "N"}
        The mechanism the audit deploys at ``epsilon`` (for "best", the one chosen).
    num_users : int or None
        K (None: no K up to :data:`~fedparity.mechanisms.ldp.planner.MAX_PLANNED_CLIENTS` reaches
        the target; ``power`` is then the power there).
    epsilon : float or None
        The per-user budget (None: no budget up to the search's upper limit reaches the
        target; ``power`` is then the power there).
    gap : float or None
        |m_0 - m_1| in metric units (None: not even a gap of 1 is detected with the power).
    power : float
        The power at (num_users, epsilon, gap) (at the search limit when an answer is None).
    target_power : float or None
        The target of a minimum / detectable-gap query.
    alpha : float
        Level of the two-sided test (the interval's level is 1 - alpha).
    group_fractions : tuple of float
        Share of the users in each group (the test is of groups 0 and 1).
    group_means : tuple of float
        (m_0, m_1) at which the power was computed: the worst case found, or the given ones.
    worst_case : bool
        True when neither ``metric_mean`` nor ``metric_variance`` was given (a given one
        replaces its part of the worst case).
    sizes_known : bool
        True: the estimator is given the true group sizes; False: it estimates them from the
        perturbed group reports (the audit job's default).
    test_stderr, true_stderr : float
        The estimator's standard error of m_hat_0 - m_hat_1 and its true standard deviation at
        (num_users, epsilon) (metric units).
    epsilon_group, epsilon_value : float
        The split (eps1, eps2) of ``epsilon`` (true epsilon <= epsilon).
    notes : tuple of str
        Where the plan is weaker than it looks (e.g. a group the estimator would refuse).
    grid_size : int
        M_N's grid G (1 for the other mechanisms; in :meth:`to_dict` for M_N only).
    """

    query: AuditQuery
    mechanism: str
    num_users: int | None
    epsilon: float | None
    gap: float | None
    power: float
    target_power: float | None
    alpha: float
    group_fractions: tuple[float, ...]
    group_means: tuple[float, float]
    worst_case: bool
    sizes_known: bool
    test_stderr: float
    true_stderr: float
    epsilon_group: float
    epsilon_value: float
    notes: tuple[str, ...] = ()
    grid_size: int = 1

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dictionary (the attributes)."""
        fields: dict[str, object] = {
            "query": self.query,
            "mechanism": self.mechanism,
            "num_users": self.num_users,
            "epsilon": self.epsilon,
            "gap": self.gap,
            "power": self.power,
            "target_power": self.target_power,
            "alpha": self.alpha,
            "group_fractions": list(self.group_fractions),
            "group_means": list(self.group_means),
            "worst_case": self.worst_case,
            "sizes_known": self.sizes_known,
            "test_stderr": self.test_stderr,
            "true_stderr": self.true_stderr,
            "epsilon_group": self.epsilon_group,
            "epsilon_value": self.epsilon_value,
            "notes": list(self.notes),
        }
        if self.mechanism == "N":
            fields["grid_size"] = self.grid_size  # M_N's epsilon depends on its grid
        return fields


@dataclass(frozen=True)
class _AuditSetting:
    """The checked question: everything but K, epsilon, gap and the target."""

    mechanism: MechanismChoice
    fractions: np.ndarray
    alpha: float
    metric_mean: float | None
    metric_variance: float | None
    sizes_known: bool


def _check_audit(
    mechanism: str,
    group_fractions: Sequence[float] | None,
    alpha: float,
    metric_mean: float | None,
    metric_variance: float | None,
    sizes_known: bool,
) -> _AuditSetting:
    choice: MechanismChoice = check_choice("mechanism", mechanism, (*MECHANISMS, "best"))
    if group_fractions is None:
        fractions = np.full(2, 0.5)
    else:
        fractions = np.asarray(list(group_fractions), dtype=np.float64)
        if fractions.ndim != 1 or not 2 <= fractions.size <= 1024:
            raise ValueError(
                f"group_fractions must hold one share per group (2 to 1024 groups), got "
                f"{fractions.size}"
            )
        fractions = check_group_fractions(fractions, fractions.size)
    alpha = check_open_unit("alpha", alpha)
    if metric_mean is not None:
        metric_mean = _check_in_range("metric_mean", metric_mean, 0.0, 1.0)
    if metric_variance is not None:
        metric_variance = _check_in_range("metric_variance", metric_variance, 0.0, 0.25)
    if not isinstance(sizes_known, bool):
        raise ValueError(f"sizes_known must be True or False, got {sizes_known!r}")
    return _AuditSetting(choice, fractions, alpha, metric_mean, metric_variance, sizes_known)


def _check_num_users(num_users: int, num_groups: int) -> int:
    users = check_int_at_least("num_users", num_users, num_groups)
    if users > MAX_PLANNED_CLIENTS:
        raise ValueError(
            f"num_users must be an integer in [{num_groups}, {MAX_PLANNED_CLIENTS:.0e}], got "
            f"{num_users!r}"
        )
    return users


def _check_epsilon(epsilon: float) -> float:
    return _check_in_range("epsilon", epsilon, MIN_PLANNED_EPSILON, MAX_PLANNED_EPSILON)


def _check_gap(gap: float) -> float:
    number = _check_in_range("gap", gap, 0.0, 1.0)
    if number == 0.0:
        raise ValueError("gap must be a number in (0, 1] (metric units), got 0")
    return number


def _mean_levels(setting: _AuditSetting, gap: float) -> np.ndarray:
    """Midpoints c of (m_0, m_1) = (c +/- gap / 2) to consider: the given one, or a grid of
    every c with both means in [0, 1] and each group's variance within m (1 - m)."""
    variance = setting.metric_variance
    # smallest mean whose m (1 - m) reaches the variance
    lowest = 0.0 if variance is None else 0.5 - 0.5 * math.sqrt(max(1.0 - 4.0 * variance, 0.0))
    low, high = lowest + gap / 2.0, 1.0 - lowest - gap / 2.0
    if setting.metric_mean is not None:
        if not low - 1e-12 <= setting.metric_mean <= high + 1e-12:
            raise ValueError(
                f"metric_mean must be in [{low:g}, {high:g}] for a gap of {gap:g}"
                + ("" if variance is None else f" and a metric_variance of {variance:g}")
                + f" (both group means in [0, 1], each variance <= m (1 - m)), got "
                f"{setting.metric_mean:g}"
            )
        return np.array([setting.metric_mean])
    if low > high + 1e-12:
        raise ValueError(
            f"gap must be at most {1.0 - 2.0 * lowest:g} with a metric_variance of {variance:g} "
            f"(each group's variance is at most m (1 - m)), got {gap:g}"
        )
    return np.linspace(low, max(low, high), _MEAN_GRID)


def _square_sums(
    moments: ReportMoments, sizes: np.ndarray, means_v: np.ndarray, variance: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """(true, estimator's) sum of v^2 per group, v = 2 m - 1.

    True: n (mean_v^2 + 4 variance) if the variance is given, else the worst case,
    :func:`worst_case_square_sums` raised to Jensen's floor n mean_v^2. The estimator's: the true
    one for M_L (it estimates it from the reports), n mean_v^2 for M_R (its plug-in).
    """
    floor = sizes * means_v**2
    if variance is None:
        true = np.maximum(worst_case_square_sums(moments, sizes), floor)
    else:
        true = np.minimum(sizes * (means_v**2 + 4.0 * variance), sizes)
    estimated = true if moments.kept_second_moment_slope > 0 else floor
    return true, estimated


def difference_variance(
    moments: ReportMoments,
    fractions: np.ndarray,
    means: tuple[float, float],
    squares: np.ndarray,
    sizes_known: bool,
) -> float:
    """K * Var(m_hat_0 - m_hat_1) in metric units, from the estimator's covariance at K = 1
    (:func:`~fedparity.mechanisms.ldp.estimators.estimator_covariance`; ``fractions`` of every
    category, ``means`` of the first two groups, ``squares`` each category's sum of v^2)."""
    means_v = np.zeros_like(fractions)
    means_v[:2] = 2.0 * np.asarray(means) - 1.0
    cov = estimator_covariance(
        moments, 1.0, fractions, fractions * means_v, squares, sizes_known=sizes_known
    )
    return max(float(cov[0, 0] + cov[1, 1] - 2.0 * cov[0, 1]), 0.0) / 4.0


@dataclass(frozen=True)
class _StderrCurves:
    """Unit (K = 1) standard errors over the candidate mean pairs (rows: candidates)."""

    means: np.ndarray  # (n, 2)
    test: np.ndarray  # (n,)
    true: np.ndarray  # (n,)

    def power(self, gap: float, num_users: float, alpha: float) -> tuple[float, int]:
        """The smallest power over the candidates, and its row."""
        root = math.sqrt(num_users)
        powers = rejection_probability(gap, self.test / root, self.true / root, alpha)
        worst = int(np.argmin(powers))
        return float(powers[worst]), worst


def _stderr_curves(setting: _AuditSetting, moments: ReportMoments, gap: float) -> _StderrCurves:
    """Unit standard errors for every mean pair considered (both signs of the gap).

    The variances are exactly quadratic in the midpoint c (the sums are linear in it, the sums
    of squares quadratic, and the delta method's Jacobian linear), so three evaluations per
    sign give them on the whole grid.
    """
    levels = _mean_levels(setting, gap)
    sizes = setting.fractions
    rows_means, rows_test, rows_true = [], [], []
    for sign in (1.0, -1.0):

        def variances(level: float, sign: float = sign) -> tuple[float, float]:
            means = (level + sign * gap / 2.0, level - sign * gap / 2.0)
            means_v = np.zeros_like(sizes)
            means_v[:2] = 2.0 * np.asarray(means) - 1.0
            true, estimated = _square_sums(moments, sizes, means_v, setting.metric_variance)
            return (
                difference_variance(moments, sizes, means, estimated, setting.sizes_known),
                difference_variance(moments, sizes, means, true, setting.sizes_known),
            )

        if levels.size == 1 or levels[0] == levels[-1]:
            test_var, true_var = (np.array([v]) for v in variances(float(levels[0])))
            levels_used = levels[:1]
        else:
            # Lagrange interpolation through the ends and the middle, t in [0, 1] along the grid
            first, last = float(levels[0]), float(levels[-1])
            ends = np.array([variances(c) for c in (first, 0.5 * (first + last), last)])
            t = (levels - first) / (last - first)
            basis = np.stack([2 * (t - 0.5) * (t - 1), -4 * t * (t - 1), 2 * t * (t - 0.5)])
            test_var, true_var = ends[:, 0] @ basis, ends[:, 1] @ basis
            levels_used = levels
        rows_means.append(
            np.stack([levels_used + sign * gap / 2.0, levels_used - sign * gap / 2.0], axis=1)
        )
        rows_test.append(np.sqrt(np.maximum(test_var, 0.0)))
        rows_true.append(np.sqrt(np.maximum(true_var, 0.0)))
    return _StderrCurves(
        np.clip(np.concatenate(rows_means), 0.0, 1.0),
        np.concatenate(rows_test),
        np.concatenate(rows_true),
    )


def _audit_notes(
    setting: _AuditSetting, split: BudgetSplit, moments: ReportMoments, num_users: int | None
) -> tuple[str, ...]:
    notes = []
    if not split.releasable:
        low, high = split.value_range
        notes.append(
            f"M_{split.mechanism} releases only for eps2 in [{low:g}, {high:g}]: the "
            f"audit refuses this budget's eps2 = {split.epsilon_value:.4g}"
        )
    if not setting.sizes_known and num_users is not None:
        sizes = setting.fractions * num_users
        size_sd = np.sqrt(np.diag(size_estimate_covariance(moments, num_users, sizes)))
        small = np.flatnonzero(sizes < SIZE_DETECTION_SIGMAS * size_sd)
        if small.size:
            notes.append(
                f"with {num_users:,} users the expected size of group {int(small[0])} is within "
                f"{SIZE_DETECTION_SIGMAS:g} standard deviations of its estimate from the reports: "
                "the audit is likely to refuse it as empty (EstimationError)"
            )
    return tuple(notes)


def _audit_plan(
    query: AuditQuery,
    setting: _AuditSetting,
    split: BudgetSplit,
    *,
    num_users: int | None,
    epsilon: float | None,
    gap: float | None,
    target: float | None,
    power_users: float,
    power_gap: float,
) -> AuditPlan:
    """The result at (power_users, split, power_gap): the worst candidate's power and means."""
    moments = split.build().moments
    curves = _stderr_curves(setting, moments, power_gap)
    power, row = curves.power(power_gap, power_users, setting.alpha)
    root = math.sqrt(power_users)
    return AuditPlan(
        query=query,
        mechanism=split.mechanism,
        num_users=num_users,
        epsilon=epsilon,
        gap=gap,
        power=power,
        target_power=target,
        alpha=setting.alpha,
        group_fractions=tuple(float(f) for f in setting.fractions),
        group_means=(float(curves.means[row, 0]), float(curves.means[row, 1])),
        worst_case=setting.metric_mean is None and setting.metric_variance is None,
        sizes_known=setting.sizes_known,
        test_stderr=float(curves.test[row]) / root,
        true_stderr=float(curves.true[row]) / root,
        epsilon_group=split.epsilon_group,
        epsilon_value=split.epsilon_value,
        notes=_audit_notes(setting, split, moments, num_users),
        grid_size=split.grid_size,
    )


def _split(setting: _AuditSetting, epsilon: float) -> BudgetSplit:
    """What the audit deploys: best_split at equal fractions (mechanism_for_budget)."""
    return best_split(setting.mechanism, epsilon, setting.fractions.size)


def audit_power(
    num_users: int,
    epsilon: float,
    gap: float,
    *,
    mechanism: MechanismChoice = "best",
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    metric_mean: float | None = None,
    metric_variance: float | None = None,
    sizes_known: bool = False,
) -> AuditPlan:
    """The power of the audit's test of gap = 0 when the true gap is ``gap``.

    Parameters
    ----------
    num_users : int
        K, the users who report (at least the number of groups, at most 1e12).
    epsilon : float
        The per-user budget of the audit, in [1e-6, 1e4].
    gap : float
        The true |m_0 - m_1| to detect, in (0, 1] (metric units).
    mechanism : {"best", "R", "L", "P", "N"}
        As in the audit job (``best``: the split with the smaller worst-case variance).
    group_fractions : sequence of float, optional
        Share of the users in each group (default two equal groups); the test is of groups 0
        and 1.
    alpha : float
        Level of the two-sided test, in (0, 1): the audit's interval at level 1 - alpha.
    metric_mean, metric_variance : float, optional
        The midpoint of the two group means, and the within-group variance of the per-user
        metric (in [0, 0.25]); default: the worst case (module docstring).
    sizes_known : bool
        Whether the estimator is given the true group sizes (default: estimated from the
        reports, as in the audit job).

    Raises
    ------
    ValueError
        A parameter outside its range (the message names it and the range).
    """
    setting = _check_audit(
        mechanism, group_fractions, alpha, metric_mean, metric_variance, sizes_known
    )
    users = _check_num_users(num_users, setting.fractions.size)
    epsilon = _check_epsilon(epsilon)
    gap = _check_gap(gap)
    return _audit_plan(
        "power",
        setting,
        _split(setting, epsilon),
        num_users=users,
        epsilon=epsilon,
        gap=gap,
        target=None,
        power_users=users,
        power_gap=gap,
    )


def audit_minimum_users(
    power: float,
    epsilon: float,
    gap: float,
    *,
    mechanism: MechanismChoice = "best",
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    metric_mean: float | None = None,
    metric_variance: float | None = None,
    sizes_known: bool = False,
) -> AuditPlan:
    """The smallest K whose audit at ``epsilon`` detects ``gap`` with probability ``power``.

    ``power`` is in (alpha, 1); the other parameters are those of :func:`audit_power`. The
    power increases with K (both standard errors scale as 1 / sqrt(K)), so K - 1 users fall
    short. ``num_users`` is None when more than 1e12 users would be needed.
    """
    setting = _check_audit(
        mechanism, group_fractions, alpha, metric_mean, metric_variance, sizes_known
    )
    target = _check_power_target(power, setting.alpha)
    epsilon = _check_epsilon(epsilon)
    gap = _check_gap(gap)
    split = _split(setting, epsilon)
    curves = _stderr_curves(setting, split.build().moments, gap)
    lowest = setting.fractions.size
    users = _smallest_integer(
        lambda k: curves.power(gap, k, setting.alpha)[0] >= target, lowest, MAX_PLANNED_CLIENTS
    )
    return _audit_plan(
        "min_users",
        setting,
        split,
        num_users=users,
        epsilon=epsilon,
        gap=gap,
        target=target,
        power_users=MAX_PLANNED_CLIENTS if users is None else users,
        power_gap=gap,
    )


def audit_minimum_epsilon(
    power: float,
    num_users: int,
    gap: float,
    *,
    mechanism: MechanismChoice = "best",
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    metric_mean: float | None = None,
    metric_variance: float | None = None,
    sizes_known: bool = False,
) -> AuditPlan:
    """The smallest per-user budget whose audit of K users detects ``gap`` with ``power``.

    Bisection in log epsilon over [1e-6, 1e4] to a relative 1e-4 (the answer reaches the
    target); for each budget the mechanism is the one the audit deploys. ``epsilon`` is None
    when no budget reaches the target (M_R's variance has a floor: its reports are +/-1).
    """
    setting = _check_audit(
        mechanism, group_fractions, alpha, metric_mean, metric_variance, sizes_known
    )
    target = _check_power_target(power, setting.alpha)
    users = _check_num_users(num_users, setting.fractions.size)
    gap = _check_gap(gap)

    def power_at(budget: float) -> float:
        curves = _stderr_curves(setting, _split(setting, budget).build().moments, gap)
        return curves.power(gap, users, setting.alpha)[0]

    budget = _smallest_float(
        lambda e: power_at(e) >= target,
        MIN_PLANNED_EPSILON,
        MAX_PLANNED_EPSILON,
        log=True,
        tolerance=EPSILON_RELATIVE_TOLERANCE,
    )
    return _audit_plan(
        "min_epsilon",
        setting,
        _split(setting, MAX_PLANNED_EPSILON if budget is None else budget),
        num_users=users,
        epsilon=budget,
        gap=gap,
        target=target,
        power_users=users,
        power_gap=gap,
    )


def audit_detectable_gap(
    power: float,
    num_users: int,
    epsilon: float,
    *,
    mechanism: MechanismChoice = "best",
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    metric_mean: float | None = None,
    metric_variance: float | None = None,
    sizes_known: bool = False,
) -> AuditPlan:
    """The smallest gap that K users at ``epsilon`` detect with probability ``power``.

    Bisection over the gap in (0, 1] to 1e-6 (the answer reaches the target); None when not
    even a gap of 1 does. With ``metric_mean`` or ``metric_variance`` given, the gaps searched
    are those they allow.
    """
    setting = _check_audit(
        mechanism, group_fractions, alpha, metric_mean, metric_variance, sizes_known
    )
    target = _check_power_target(power, setting.alpha)
    users = _check_num_users(num_users, setting.fractions.size)
    epsilon = _check_epsilon(epsilon)
    split = _split(setting, epsilon)
    moments = split.build().moments
    variance = 0.0 if setting.metric_variance is None else setting.metric_variance
    largest = math.sqrt(max(1.0 - 4.0 * variance, 0.0))  # the largest gap the variance allows
    if largest <= 0.0:
        raise ValueError(
            "metric_variance must be below 0.25 to leave room for a gap (a variance of 0.25 "
            "puts both group means at 0.5), got 0.25"
        )
    if setting.metric_mean is not None:
        lowest = 0.5 - 0.5 * largest  # the smallest mean whose m (1 - m) holds the variance
        edge = min(setting.metric_mean, 1.0 - setting.metric_mean) - lowest
        if edge <= 0.0:
            raise ValueError(
                f"metric_mean must be in the open interval ({lowest:g}, {1.0 - lowest:g}) to "
                f"leave room for a gap (both group means in [0, 1], each variance <= m (1 - m)"
                f", with metric_variance {variance:g}), got {setting.metric_mean:g}"
            )
        largest = min(largest, 2.0 * edge)

    def meets(gap: float) -> bool:
        curves = _stderr_curves(setting, moments, gap)
        return curves.power(gap, users, setting.alpha)[0] >= target

    gap = _smallest_float(meets, GAP_TOLERANCE, largest, log=False, tolerance=GAP_TOLERANCE)
    return _audit_plan(
        "detectable_gap",
        setting,
        split,
        num_users=users,
        epsilon=epsilon,
        gap=gap,
        target=target,
        power_users=users,
        power_gap=largest if gap is None else gap,
    )


# --------------------------------------------------------------------------------------------
# FedEvalFair
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FedEvalFairPlan:
    """One answer of the FedEvalFair planner (stage 2, calibrated mode).

    Attributes
    ----------
    query : {"power", "min_holders", "min_rows", "detectable_disparity"}
        What was asked: the power, the minimum holders, the minimum rows per holder, or the
        smallest disparity (away from ``mu0``) detected with ``target_power``.
    holders : int or None
        k (None: no k up to :data:`MAX_PLANNED_HOLDERS` reaches the target).
    rows : int, tuple of int, or None
        Rows per holder that the disparity averages over (all rows for dp, the rows with
        Y = 1 for eo): one count for equal holders, or one per holder; None: no count up to
        :data:`MAX_PLANNED_ROWS` reaches the target.
    disparity : float or None
        The true common disparity d = P(Yhat=1 | A=0) - P(Yhat=1 | A=1) (None: no disparity
        that the rates allow is detected with the power on both sides of ``mu0``).
    mu0 : float
        Stage 2's null value.
    power : float
        The power at (holders, rows, disparity), or at the search limit when an answer is None.
    target_power : float or None
    alpha : float
    positive_rate : float
        p, the share of the rows predicted positive (group rates p + f_1 d and p - f_0 d).
    group_fractions : tuple of float
        (f_0, f_1), the groups' shares of each holder's rows.
    test_stderr, true_stderr : float
        se(mu0), the standard error stage 2 uses, and se(d), the estimate's true standard
        deviation.
    notes : tuple of str
    """

    query: FedEvalFairQuery
    holders: int | None
    rows: int | tuple[int, ...] | None
    disparity: float | None
    mu0: float
    power: float
    target_power: float | None
    alpha: float
    positive_rate: float
    group_fractions: tuple[float, float]
    test_stderr: float
    true_stderr: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dictionary (the attributes)."""
        return {
            "query": self.query,
            "holders": self.holders,
            "rows": list(self.rows) if isinstance(self.rows, tuple) else self.rows,
            "disparity": self.disparity,
            "mu0": self.mu0,
            "power": self.power,
            "target_power": self.target_power,
            "alpha": self.alpha,
            "positive_rate": self.positive_rate,
            "group_fractions": list(self.group_fractions),
            "test_stderr": self.test_stderr,
            "true_stderr": self.true_stderr,
            "notes": list(self.notes),
        }


def fedevalfair_disparity_range(
    positive_rate: float = 0.5, group_fractions: Sequence[float] | np.ndarray | None = None
) -> tuple[float, float]:
    """The disparities d whose group rates p + f_1 d and p - f_0 d are both in [0, 1]."""
    rate = _check_in_range("positive_rate", positive_rate, 0.0, 1.0)
    if not 0.0 < rate < 1.0:
        raise ValueError(f"positive_rate must be in the open interval (0, 1), got {rate:g}")
    first, second = (float(f) for f in check_group_fractions(group_fractions, 2))
    low = max(-rate / second, -(1.0 - rate) / first)
    high = min((1.0 - rate) / second, rate / first)
    return low, high


@dataclass(frozen=True)
class _Holders:
    """The checked question: everything but the holders' rows, the disparity and the target."""

    fractions: np.ndarray
    positive_rate: float
    alpha: float
    mu0: float
    disparity_range: tuple[float, float]

    @property
    def minimum_rows(self) -> int:
        """Fewest rows per holder with every expected margin (each group, each prediction) at
        least one row."""
        smallest = min(*self.fractions, self.positive_rate, 1.0 - self.positive_rate)
        return max(2, math.ceil(1.0 / smallest - 1e-9))

    def stderrs(self, rows: np.ndarray, copies: int, disparity: float) -> tuple[float, float]:
        """(se(mu0), se(d)) of the Graybill-Deal estimate with weights 1 / V_i(0), over the
        holders ``rows``, each repeated ``copies`` times."""
        counts = np.asarray(rows, dtype=np.float64)
        margins = np.stack(
            [counts * self.fractions[0], counts * self.fractions[1], counts * self.positive_rate],
            axis=-1,
        )
        weights = 1.0 / disparity_variances(margins, 0.0)

        def stderr(mu: float) -> float:
            spread = float(np.sum(weights**2 * disparity_variances(margins, mu)))
            return math.sqrt(spread / copies) / float(weights.sum())

        return stderr(self.mu0), stderr(disparity)

    def power(self, rows: np.ndarray, copies: int, disparity: float) -> float:
        test, true = self.stderrs(rows, copies, disparity)
        return float(rejection_probability(disparity - self.mu0, test, true, self.alpha))


def _check_holders_question(
    positive_rate: float, group_fractions: Sequence[float] | None, alpha: float, mu0: float
) -> _Holders:
    fractions = check_group_fractions(group_fractions, 2)
    low, high = fedevalfair_disparity_range(positive_rate, fractions)
    mu0 = check_finite("mu0", mu0)
    if not low <= mu0 <= high:
        raise ValueError(
            f"mu0 must be in [{low:.6g}, {high:.6g}] (group rates in [0, 1] at positive_rate "
            f"{positive_rate:g}), got {mu0!r}"
        )
    return _Holders(
        fractions, float(positive_rate), check_open_unit("alpha", alpha), mu0, (low, high)
    )


def _check_disparity(question: _Holders, disparity: float) -> float:
    low, high = question.disparity_range
    value = check_finite("disparity", disparity)
    if not low <= value <= high:
        raise ValueError(
            f"disparity must be in [{low:.6g}, {high:.6g}] (group rates p + f_1 d and p - f_0 d "
            f"in [0, 1] at positive_rate {question.positive_rate:g}), got {disparity!r}"
        )
    if value == question.mu0:
        raise ValueError(f"disparity must differ from mu0 ({question.mu0:g}): nothing to detect")
    return value


def _check_row_count(question: _Holders, rows: int, name: str = "rows") -> int:
    lowest = question.minimum_rows
    count = check_int_at_least(name, rows, lowest)
    if count > MAX_PLANNED_ROWS:
        raise ValueError(
            f"{name} must be an integer in [{lowest}, {MAX_PLANNED_ROWS:.0e}], got {rows!r}"
        )
    return count


def _check_holder_count(holders: int) -> int:
    count = check_int_at_least("holders", holders, 2)
    if count > MAX_PLANNED_HOLDERS:
        raise ValueError(
            f"holders must be an integer in [2, {MAX_PLANNED_HOLDERS:.0e}], got {holders!r}"
        )
    return count


def _check_rows(
    question: _Holders, rows: int | Sequence[int], holders: int | None
) -> tuple[int | tuple[int, ...], np.ndarray, int]:
    """(rows as reported, distinct holders' rows, copies of each): ``rows`` is one count for
    ``holders`` equal holders, or one count per holder."""
    if isinstance(rows, Sequence) and not isinstance(rows, str):
        counts = tuple(_check_row_count(question, r, f"rows[{i}]") for i, r in enumerate(rows))
        if len(counts) < 2:
            raise ValueError(f"rows must list at least 2 holders, got {len(counts)}")
        if holders is not None and holders != len(counts):
            raise ValueError(
                f"holders ({holders}) must equal the number of row counts given ({len(counts)})"
            )
        return counts, np.asarray(counts), 1
    if holders is None:
        raise ValueError("holders is required when rows is one count (rows per holder)")
    count = _check_row_count(question, rows)
    return count, np.array([count]), _check_holder_count(holders)


def _holder_notes(question: _Holders, smallest_rows: int, disparity: float) -> tuple[str, ...]:
    rates = (
        question.positive_rate + question.fractions[1] * disparity,
        question.positive_rate - question.fractions[0] * disparity,
    )
    smallest = min(
        smallest_rows * fraction * min(rate, 1.0 - rate)
        for fraction, rate in zip(question.fractions, rates, strict=True)
    )
    if smallest < _SMALL_CELL_ROWS:
        return (
            f"a holder's smallest (group, prediction) cell expects {smallest:.3g} rows (under "
            f"{_SMALL_CELL_ROWS:g}): the normal approximation behind this power is rough",
        )
    return ()


def _holder_plan(
    query: FedEvalFairQuery,
    question: _Holders,
    *,
    holders: int | None,
    rows: int | tuple[int, ...] | None,
    disparity: float | None,
    target: float | None,
    at: tuple[np.ndarray, int, float],
) -> FedEvalFairPlan:
    """The plan, its power and standard errors at ``at`` = (rows, copies, disparity)."""
    at_rows, copies, at_disparity = at
    test, true = question.stderrs(at_rows, copies, at_disparity)
    return FedEvalFairPlan(
        query=query,
        holders=holders,
        rows=rows,
        disparity=disparity,
        mu0=question.mu0,
        power=float(rejection_probability(at_disparity - question.mu0, test, true, question.alpha)),
        target_power=target,
        alpha=question.alpha,
        positive_rate=question.positive_rate,
        group_fractions=(float(question.fractions[0]), float(question.fractions[1])),
        test_stderr=test,
        true_stderr=true,
        notes=_holder_notes(question, int(np.min(at_rows)), at_disparity),
    )


def fedevalfair_power(
    disparity: float,
    *,
    holders: int | None = None,
    rows: int | Sequence[int],
    positive_rate: float = 0.5,
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    mu0: float = 0.0,
) -> FedEvalFairPlan:
    """The power of FedEvalFair's stage 2 (H0: common disparity = mu0) at a true ``disparity``.

    Parameters
    ----------
    disparity : float
        The true common disparity d (group 0's positive rate minus group 1's), within
        :func:`fedevalfair_disparity_range` and not equal to ``mu0``.
    holders : int, optional
        k >= 2 holders of ``rows`` rows each (not needed when ``rows`` lists every holder).
    rows : int or sequence of int
        Rows per holder that the disparity averages over (all rows for dp, the rows with Y = 1
        for eo), or one count per holder; each enough for one row in every expected margin.
    positive_rate : float
        p in (0, 1), the share of rows predicted positive (default 0.5, where p (1 - p), and so
        the null variance, is largest).
    group_fractions : sequence of 2 floats, optional
        (f_0, f_1), the groups' shares of a holder's rows (default equal).
    alpha : float
        Level of stage 2, in (0, 1).
    mu0 : float
        Stage 2's null value.

    Raises
    ------
    ValueError
        A parameter outside its range (the message names it and the range).
    """
    question = _check_holders_question(positive_rate, group_fractions, alpha, mu0)
    value = _check_disparity(question, disparity)
    reported, counts, copies = _check_rows(question, rows, holders)
    return _holder_plan(
        "power",
        question,
        holders=counts.size * copies,
        rows=reported,
        disparity=value,
        target=None,
        at=(counts, copies, value),
    )


def fedevalfair_minimum_holders(
    power: float,
    disparity: float,
    *,
    rows: int,
    positive_rate: float = 0.5,
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    mu0: float = 0.0,
) -> FedEvalFairPlan:
    """The fewest holders of ``rows`` rows each whose stage 2 detects ``disparity`` with
    ``power`` (k - 1 fall short); ``holders`` is None above :data:`MAX_PLANNED_HOLDERS`."""
    question = _check_holders_question(positive_rate, group_fractions, alpha, mu0)
    target = _check_power_target(power, question.alpha)
    value = _check_disparity(question, disparity)
    count = np.array([_check_row_count(question, rows)])
    holders = _smallest_integer(
        lambda k: question.power(count, k, value) >= target, 2, MAX_PLANNED_HOLDERS
    )
    return _holder_plan(
        "min_holders",
        question,
        holders=holders,
        rows=int(count[0]),
        disparity=value,
        target=target,
        at=(count, MAX_PLANNED_HOLDERS if holders is None else holders, value),
    )


def fedevalfair_minimum_rows(
    power: float,
    disparity: float,
    *,
    holders: int,
    positive_rate: float = 0.5,
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    mu0: float = 0.0,
) -> FedEvalFairPlan:
    """The fewest rows per holder (equal for all ``holders``) whose stage 2 detects
    ``disparity`` with ``power``; ``rows`` is None above :data:`MAX_PLANNED_ROWS`."""
    question = _check_holders_question(positive_rate, group_fractions, alpha, mu0)
    target = _check_power_target(power, question.alpha)
    value = _check_disparity(question, disparity)
    copies = _check_holder_count(holders)
    rows = _smallest_integer(
        lambda n: question.power(np.array([n]), copies, value) >= target,
        question.minimum_rows,
        MAX_PLANNED_ROWS,
    )
    return _holder_plan(
        "min_rows",
        question,
        holders=copies,
        rows=rows,
        disparity=value,
        target=target,
        at=(np.array([MAX_PLANNED_ROWS if rows is None else rows]), copies, value),
    )


def fedevalfair_detectable_disparity(
    power: float,
    *,
    holders: int | None = None,
    rows: int | Sequence[int],
    positive_rate: float = 0.5,
    group_fractions: Sequence[float] | None = None,
    alpha: float = 0.05,
    mu0: float = 0.0,
) -> FedEvalFairPlan:
    """The smallest |d - mu0| that stage 2 detects with ``power``, whichever group is ahead.

    Searched on each side of ``mu0`` (to 1e-6) within the disparities the rates allow; the
    farther of the two answers is returned as ``disparity`` (with its side's sign), so a
    disparity at least that far from ``mu0`` on either side is detected. None when a side
    reaches the edge of the range first (``power`` is then the power at that edge).
    """
    question = _check_holders_question(positive_rate, group_fractions, alpha, mu0)
    target = _check_power_target(power, question.alpha)
    reported, counts, copies = _check_rows(question, rows, holders)
    low, high = question.disparity_range
    answers: list[tuple[float | None, float]] = []  # (distance, edge) per side
    for sign, edge in ((1.0, high), (-1.0, low)):
        room = abs(edge - question.mu0)

        def meets(distance: float, sign: float = sign) -> bool:
            return question.power(counts, copies, question.mu0 + sign * distance) >= target

        distance = (
            None
            if room <= GAP_TOLERANCE
            else _smallest_float(meets, GAP_TOLERANCE, room, log=False, tolerance=GAP_TOLERANCE)
        )
        answers.append((None if distance is None else question.mu0 + sign * distance, edge))
    reached = [value for value, _ in answers if value is not None]
    value: float | None
    if len(reached) < len(answers):
        value, at = None, next(edge for found, edge in answers if found is None)
    else:
        value = max(reached, key=lambda v: abs(v - question.mu0))
        at = value
    return _holder_plan(
        "detectable_disparity",
        question,
        holders=counts.size * copies,
        rows=reported,
        disparity=value,
        target=target,
        at=(counts, copies, at),
    )


__all__ = [
    "AuditPlan",
    "FedEvalFairPlan",
    "MAX_PLANNED_HOLDERS",
    "MAX_PLANNED_ROWS",
    "audit_detectable_gap",
    "audit_minimum_epsilon",
    "audit_minimum_users",
    "audit_power",
    "difference_variance",
    "fedevalfair_detectable_disparity",
    "fedevalfair_disparity_range",
    "fedevalfair_minimum_holders",
    "fedevalfair_minimum_rows",
    "fedevalfair_power",
    "rejection_probability",
]
