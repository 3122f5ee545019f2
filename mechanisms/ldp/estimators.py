"""Unbiased group-mean and gap estimators with closed-form variances and error bounds.

Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022
(Juarez and Korolova 2022 below): Definition 7 (estimators), Appendix A.4 (Eq. 19 for M_L,
Eq. 20 for M_R) and Theorem 9 (the gap's MSE is the sum of the groups' MSEs). Beyond the
paper, which assumes known group sizes and two groups and bounds the error with Chebyshev's
inequality (about 10x loose, its Table 2): unknown group sizes, d > 2 groups, intervals
tighter than Chebyshev.

Notation: values v in [-1, 1] (v = 2 m - 1 for a metric m in [0, 1]); S_G is the sum of
reported values v' over reports whose group is G, n'_G their number, K all reports.
The estimator of a group's mean is  m_hat_G = S_G / (gain * n_G)  with gain = a (2b - 1)
for M_R and a for M_L; n_G is the true group size when known, otherwise the GRR frequency
estimate n_hat_G = (n'_G - K q) / (a - q), q = (1 - a)/(d - 1).

Variances (derived per client from :class:`~fedparity.mechanisms.ldp.reports.ReportMoments`)::

    Var(S_G) = a alpha0 n_G + (a alpha1 - a^2 gamma^2) sum_G v^2 + (K - n_G) q beta

which for d = 2 is exactly Eq. 20 (M_R) and Eq. 19 (M_L) times (gain n_G)^2; the cross
covariances are 0 for known sizes (Theorem 9). With estimated sizes the ratio S_G / n_hat_G
is linearised (delta method) using the exact covariances of (S_G, n'_G) across groups.

All public results are in *metric units* (m in [0, 1]): means (v + 1)/2, gaps and standard
errors half of their v-unit values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..formatting import format_number
from ..validation import check_open_unit
from .randomized_response import grr_frequency_estimate
from .reports import ReportMoments, ReportSummary


class GapMechanism(Protocol):
    """What the estimators need from a mechanism (M_R, M_L or M_P)."""

    # read-only (properties): the mechanisms are frozen dataclasses
    @property
    def name(self) -> str: ...

    @property
    def epsilon_group(self) -> float: ...

    @property
    def epsilon_value(self) -> float: ...

    @property
    def num_groups(self) -> int: ...

    @property
    def epsilon(self) -> float: ...

    @property
    def moments(self) -> ReportMoments: ...


class EstimationError(ValueError):
    """The reports do not allow an estimate (e.g. a group with no member)."""


#: With estimated group sizes, a group is refused when n_hat_G < SIZE_DETECTION_SIGMAS *
#: sd(n_hat_G): its size is not distinguishable from zero at ~3 sigma (one-sided; under the
#: normal approximation a truly empty group passes with probability ~0.13%, and the group's
#: mean S_G / n_hat_G would be a ratio with a denominator near zero, i.e. garbage).
SIZE_DETECTION_SIGMAS = 3.0


@dataclass(frozen=True)
class ConfidenceInterval:
    """A two-sided interval (metric units)."""

    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


def report_sum_variance(
    moments: ReportMoments,
    num_clients: float,
    group_sizes: np.ndarray,
    group_square_sums: np.ndarray,
) -> np.ndarray:
    """Var(S_G) per group: a alpha0 n + (a alpha1 - a^2 gamma^2) sum v^2 + (K - n) q beta."""
    a = moments.keep_probability
    q = moments.flip_probability
    gamma = moments.value_gain
    sizes = np.asarray(group_sizes, dtype=np.float64)
    squares = np.asarray(group_square_sums, dtype=np.float64)
    return (
        a * moments.kept_second_moment * sizes
        + (a * moments.kept_second_moment_slope - (a * gamma) ** 2) * squares
        + (num_clients - sizes) * q * moments.flipped_second_moment
    )


def size_estimate_covariance(
    moments: ReportMoments, num_clients: float, group_sizes: np.ndarray
) -> np.ndarray:
    """Covariance matrix (d x d) of the GRR frequency estimates n_hat_G = (n'_G - K q)/(a - q).

    The reported-group counts n' are a sum of K independent one-hot draws (a client of
    group G reports G with probability a, any other group with probability q), so
    Var(n'_G) = n_G a (1 - a) + (K - n_G) q (1 - q) and, for G != H,
    Cov(n'_G, n'_H) = -(a q (n_G + n_H) + q^2 (K - n_G - n_H)); both are divided by
    (a - q)^2. The variance is Wang et al. (2017)'s for pure LDP frequency protocols,
    n q (1 - q) / (a - q)^2 + n_G (1 - a - q) / (a - q); the covariance is the per-client
    multinomial one summed over clients.
    """
    a = moments.keep_probability
    q = moments.flip_probability
    spread = a - q
    sizes = np.asarray(group_sizes, dtype=np.float64)
    pair_size = sizes[:, None] + sizes[None, :]
    cov_nn = -(a * q * pair_size + q * q * (num_clients - pair_size)) / spread**2
    own_size_variance = sizes * a * (1 - a) + (num_clients - sizes) * q * (1 - q)
    np.fill_diagonal(cov_nn, own_size_variance / spread**2)
    return cov_nn


def estimator_covariance(
    moments: ReportMoments,
    num_clients: float,
    group_sizes: np.ndarray,
    group_sums: np.ndarray,
    group_square_sums: np.ndarray,
    *,
    sizes_known: bool = True,
) -> np.ndarray:
    """Covariance matrix (v units, d x d) of the group-mean estimators m_hat_G.

    Parameters
    ----------
    moments : ReportMoments
        The mechanism's report moments.
    num_clients : int
        K.
    group_sizes, group_sums, group_square_sums : np.ndarray
        n_G, sum of v and sum of v^2 over group G's members (true values, or plug-ins).
    sizes_known : bool
        True: m_hat = S / (gain n) with the true n (exact; diagonal, Theorem 9).
        False: m_hat = S / (gain n_hat) with the GRR frequency estimate (delta method).
    """
    a = moments.keep_probability
    q = moments.flip_probability
    gain = a * moments.value_gain
    sizes = np.asarray(group_sizes, dtype=np.float64)
    sums = np.asarray(group_sums, dtype=np.float64)
    var_totals = report_sum_variance(moments, num_clients, sizes, group_square_sums) / gain**2
    if sizes_known:
        return np.diag(var_totals / sizes**2)
    num_groups = sizes.shape[0]
    spread = a - q
    # Joint covariance of (T_0..T_{d-1}, N_0..N_{d-1}), T_G = S_G / gain, N_G = n_hat_G.
    cov_tt = np.diag(var_totals)
    cov_tn = np.empty((num_groups, num_groups))
    cov_tn[:] = -(sums * q / spread)[:, None]
    np.fill_diagonal(cov_tn, sums * (1.0 - a) / spread)
    cov_nn = size_estimate_covariance(moments, num_clients, sizes)
    joint = np.block([[cov_tt, cov_tn], [cov_tn.T, cov_nn]])
    means = sums / sizes
    jacobian = np.hstack([np.diag(1.0 / sizes), np.diag(-means / sizes)])
    return jacobian @ joint @ jacobian.T


def worst_case_square_sums(moments: ReportMoments, group_sizes: np.ndarray) -> np.ndarray:
    """The sum of v^2 in [0, n_G] that maximises Var(S_G): n_G for M_L, 0 for M_R."""
    a = moments.keep_probability
    slope = a * moments.kept_second_moment_slope - (a * moments.value_gain) ** 2
    sizes = np.asarray(group_sizes, dtype=np.float64)
    return sizes if slope > 0 else np.zeros_like(sizes)


def chebyshev_halfwidth(variance: float | np.ndarray, confidence: float) -> np.ndarray:
    """Chebyshev: P(|X - mu| >= t) <= Var / t^2, so t = sqrt(Var / (1 - confidence))."""
    return np.sqrt(np.asarray(variance, dtype=np.float64) / (1.0 - confidence))


def normal_quantile(confidence: float) -> float:
    """z with P(|Z| <= z) = confidence."""
    from scipy import stats  # here, not at the top: a node's process starts ~1 s faster

    return float(stats.norm.ppf(0.5 + 0.5 * confidence))


def fold_interval(low: float, high: float) -> ConfidenceInterval:
    """Interval for |D| from an interval [low, high] for D."""
    if low > 0:
        return ConfidenceInterval(low, high)
    if high < 0:
        return ConfidenceInterval(-high, -low)
    return ConfidenceInterval(0.0, max(-low, high))


#: What the interval of the largest gap says: it excludes 0, or it reaches 0.
GAP_VERDICTS = ("the groups differ", "no gap detectable at this budget (the interval reaches 0)")


@dataclass(frozen=True)
class GapEstimate:
    """Private estimate of group means and gaps (metric units), with error bounds.

    Attributes
    ----------
    group_means, group_stderrs : np.ndarray
        m_hat_G and its standard error, per group.
    group_sizes : np.ndarray
        Group sizes used by the estimator (true sizes, or estimates from the reports).
    sizes_estimated : bool
        Whether ``group_sizes`` were estimated from the perturbed group reports.
    pairs : tuple of (int, int)
        Group pairs (i, j), i < j, in the order of the pairwise arrays below.
    differences, difference_stderrs : np.ndarray
        Signed m_hat_i - m_hat_j and standard errors.
    gaps : np.ndarray
        ``|m_hat_i - m_hat_j|`` (the paper's gap estimator; note ``|.|`` is biased upwards near 0).
    gap_intervals : tuple of ConfidenceInterval
        Normal-approximation interval for each true gap ``|m_i - m_j|`` at ``confidence``.
    chebyshev_halfwidths : np.ndarray
        The paper's bound: sqrt(Var_worst / (1 - confidence)) with Var_worst the pair's
        variance at the worst-case sum of v^2 (Section 5).
    normal_halfwidths : np.ndarray
        z * stderr of each pair (the tighter interval's half width).
    max_gap, max_gap_pair, max_gap_interval
        The largest pairwise gap, its pair, and a simultaneous (Bonferroni) interval.
    """

    mechanism: str
    epsilon: float
    epsilon_group: float
    epsilon_value: float
    num_reports: int
    confidence: float
    group_means: np.ndarray
    group_stderrs: np.ndarray
    group_sizes: np.ndarray
    sizes_estimated: bool
    pairs: tuple[tuple[int, int], ...]
    differences: np.ndarray
    difference_stderrs: np.ndarray
    gaps: np.ndarray
    gap_intervals: tuple[ConfidenceInterval, ...]
    chebyshev_halfwidths: np.ndarray
    normal_halfwidths: np.ndarray
    max_gap: float
    max_gap_pair: tuple[int, int]
    max_gap_interval: ConfidenceInterval
    notes: tuple[str, ...] = field(default=())

    @property
    def num_groups(self) -> int:
        return int(self.group_means.shape[0])

    @property
    def detected(self) -> bool:
        """Whether the interval of the largest gap excludes 0 (the groups differ)."""
        return bool(self.max_gap_interval.low > 0)

    def verdict(self, metric: str = "metric") -> str:
        """The largest gap, its interval and what they say: the line the built-in job prints
        after "At epsilon = ...: "."""
        first, second = self.max_gap_pair
        interval = self.max_gap_interval
        return (
            f"the {metric} gap between groups {first} and {second} is "
            f"{format_number(self.max_gap)}, {100 * self.confidence:g}% interval "
            f"[{format_number(interval.low)}, {format_number(interval.high)}]: "
            + GAP_VERDICTS[0 if self.detected else 1]
        )

    def summary(self, metric: str = "metric") -> str:
        """The verdict, then each group's mean with its standard error and size, then the
        estimator's notes."""
        sizes = "estimated" if self.sizes_estimated else "known"
        lines = [
            f"At epsilon = {self.epsilon:g} (mechanism {self.mechanism}, {self.num_reports} "
            f"reports): {self.verdict(metric)}"
        ]
        for group, (mean, stderr, size) in enumerate(
            zip(self.group_means, self.group_stderrs, self.group_sizes, strict=True)
        ):
            lines.append(
                f"  group {group}: {metric} {format_number(float(mean))} "
                f"(stderr {format_number(float(stderr))}; {sizes} size {float(size):.0f})"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        interval = self.max_gap_interval
        return (
            f"GapEstimate(max_gap={format_number(self.max_gap)}, "
            f"max_gap_pair={self.max_gap_pair}, "
            f"interval=[{format_number(interval.low)}, {format_number(interval.high)}], "
            f"confidence={self.confidence:g}, num_groups={self.num_groups}, "
            f"num_reports={self.num_reports}, mechanism={self.mechanism!r}, "
            f"epsilon={self.epsilon:g})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (keys documented in the CLI guide, docs/guides/cli.md)."""
        return {
            "mechanism": self.mechanism,
            "epsilon": self.epsilon,
            "epsilon_group": self.epsilon_group,
            "epsilon_value": self.epsilon_value,
            "num_reports": self.num_reports,
            "confidence": self.confidence,
            "group_means": self.group_means.tolist(),
            "group_stderrs": self.group_stderrs.tolist(),
            "group_sizes": self.group_sizes.tolist(),
            "sizes_estimated": self.sizes_estimated,
            "pairs": [list(pair) for pair in self.pairs],
            "differences": self.differences.tolist(),
            "difference_stderrs": self.difference_stderrs.tolist(),
            "gaps": self.gaps.tolist(),
            "gap_intervals": [[ci.low, ci.high] for ci in self.gap_intervals],
            "chebyshev_halfwidths": self.chebyshev_halfwidths.tolist(),
            "normal_halfwidths": self.normal_halfwidths.tolist(),
            "max_gap": self.max_gap,
            "max_gap_pair": list(self.max_gap_pair),
            "max_gap_interval": [self.max_gap_interval.low, self.max_gap_interval.high],
            "notes": list(self.notes),
        }


def _check_known_sizes(group_sizes: Sequence[int], summary: ReportSummary) -> np.ndarray:
    sizes = np.asarray(group_sizes, dtype=np.float64)
    if sizes.shape != (summary.num_groups,):
        raise ValueError(
            f"group_sizes must have one entry per group ({summary.num_groups}), got {sizes.size}"
        )
    if not np.all(np.isfinite(sizes)) or np.any(sizes != np.round(sizes)):
        raise ValueError("group_sizes must be whole numbers")
    if np.any(sizes < 1):
        empty = int(np.flatnonzero(sizes < 1)[0])
        raise EstimationError(f"group {empty} is empty (group_sizes[{empty}] = 0)")
    if int(sizes.sum()) != summary.num_reports:
        raise ValueError(
            f"group_sizes must sum to the number of reports ({summary.num_reports}), "
            f"got {int(sizes.sum())}"
        )
    return sizes


def _check_summary_finite(summary: ReportSummary) -> None:
    """Refuse NaN / infinity in the summary (a corrupt or overflowing report)."""
    for name in ("report_counts", "value_sums", "value_square_sums"):
        array = np.asarray(getattr(summary, name), dtype=np.float64)
        if not np.all(np.isfinite(array)):
            bad = int(np.flatnonzero(~np.isfinite(array))[0])
            raise ValueError(
                f"summary.{name} must be finite numbers, found {float(array[bad])} for group "
                f"{bad} (a corrupt report or an overflow)"
            )


def _check_estimated_sizes(
    sizes: np.ndarray, moments: ReportMoments, num_clients: int, checked: int
) -> None:
    """Refuse a group (among the first ``checked``) whose estimated size is not
    distinguishable from zero.

    Refused when n_hat_G <= 0.5 or n_hat_G < SIZE_DETECTION_SIGMAS * sd(n_hat_G), with
    sd from :func:`size_estimate_covariance` at the plug-in sizes clip(n_hat, 0, K).
    """
    plug_in = np.clip(sizes, 0.0, float(num_clients))
    size_sd = np.sqrt(np.diag(size_estimate_covariance(moments, num_clients, plug_in)))
    threshold = SIZE_DETECTION_SIGMAS * size_sd
    small = ((sizes <= 0.5) | (sizes < threshold))[:checked]
    if np.any(small):
        group = int(np.flatnonzero(small)[0])
        raise EstimationError(
            f"group {group} has an estimated size of {float(sizes[group]):.1f} from the "
            f"perturbed reports, indistinguishable from zero (threshold "
            f"{max(float(threshold[group]), 0.5):.1f} = {SIZE_DETECTION_SIGMAS:g} standard "
            f"deviations of the size estimate, {float(size_sd[group]):.1f}): it is empty or "
            "too small to estimate at this epsilon and number of reports"
        )


def estimate_gap(
    summary: ReportSummary,
    mechanism: GapMechanism,
    *,
    group_sizes: Sequence[int] | np.ndarray | None = None,
    confidence: float = 0.95,
    undefined_category: bool = False,
) -> GapEstimate:
    """Estimate every group's mean, every pairwise gap and the max gap from reports.

    Parameters
    ----------
    summary : ReportSummary
        Sufficient statistics of the perturbed reports (one per client).
    mechanism : GapMechanism
        The mechanism that produced them (its parameters define the estimator).
    group_sizes : sequence of int, optional
        True group sizes n_G if known (they must sum to K); otherwise they are estimated
        from the reported groups (GRR frequency estimator) and the extra error is included
        in the standard errors; a group whose estimated size is below
        ``SIZE_DETECTION_SIGMAS`` standard deviations of that estimate (or <= 0.5) raises
        :class:`EstimationError` (indistinguishable from an empty group).
    confidence : float
        Level of the intervals and bounds, in (0, 1).
    undefined_category : bool
        The mechanism's last category is "metric undefined" (e.g. TPR for a user without
        positives): those users report it, with the value 0, like everyone else, so that not
        reporting never tells their label; it is randomised by the group step like any group.
        The estimate then covers the other categories only (means, gaps, sizes), and
        ``group_sizes``, if given, are those of the other categories.

    Notes
    -----
    Standard errors use the closed-form variance with plug-ins: the group sizes, the means,
    and the sum of v^2 -- estimated from the reported squares for M_L, and for M_R (whose
    reports carry no information on it) its smallest value given the mean, n m^2 (Jensen),
    which maximises M_R's variance near that mean.

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Definition 7, Theorem 9 and Appendix A.4 (Eq. 19, Eq. 20).
    .. [2] T. Wang, J. Blocki, N. Li and S. Jha, "Locally Differentially Private Protocols for
           Frequency Estimation", USENIX Security Symposium, 2017 (the GRR frequency
           estimator used for unknown group sizes).
    """
    confidence = check_open_unit("confidence", confidence)
    if summary.num_groups != mechanism.num_groups:
        raise ValueError(
            f"the summary has {summary.num_groups} groups but the mechanism expects "
            f"{mechanism.num_groups}"
        )
    _check_summary_finite(summary)
    num_clients = summary.num_reports
    if num_clients < mechanism.num_groups:
        raise EstimationError(
            f"need at least as many reports as groups ({mechanism.num_groups}), got {num_clients}"
        )
    moments = mechanism.moments
    a = moments.keep_probability
    gain = a * moments.value_gain
    notes: list[str] = []
    reported = mechanism.num_groups - 1 if undefined_category else mechanism.num_groups
    if reported < 2:
        raise ValueError("undefined_category needs a mechanism with at least 3 categories")
    if group_sizes is not None:
        known = list(group_sizes)
        if undefined_category:
            known.append(num_clients - int(np.sum(np.asarray(known, dtype=np.int64))))
        sizes = _check_known_sizes(known, summary)
        sizes_known = True
    else:
        sizes = grr_frequency_estimate(summary.report_counts, num_clients, a)
        sizes_known = False
        _check_estimated_sizes(sizes, moments, num_clients, reported)
    totals = summary.value_sums / gain
    if undefined_category:
        # the undefined category's users report v = 0: its size only enters its own (unused)
        # row of the covariance, so a floor of 1 keeps that row finite
        sizes = sizes.copy()
        sizes[reported:] = np.clip(sizes[reported:], 1.0, max(float(num_clients), 1.0))
        totals = totals.copy()
        totals[reported:] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        means_v = np.where(sizes > 0, totals / sizes, 0.0)
    # Plug-in for sum_G v^2.
    if moments.kept_second_moment_slope > 0:
        q = moments.flip_probability
        squares = (
            summary.value_square_sums
            - a * moments.kept_second_moment * sizes
            - (num_clients - sizes) * q * moments.flipped_second_moment
        ) / (a * moments.kept_second_moment_slope)
    else:
        squares = np.zeros_like(sizes)
    lower = sizes * np.minimum(means_v**2, 1.0)
    squares = np.clip(squares, lower, sizes)
    worst_squares = np.array(worst_case_square_sums(moments, sizes), dtype=np.float64)
    if undefined_category:
        squares[reported:] = 0.0
        worst_squares[reported:] = 0.0
    cov = estimator_covariance(
        moments, num_clients, sizes, totals, squares, sizes_known=sizes_known
    )
    worst = estimator_covariance(
        moments, num_clients, sizes, totals, worst_squares, sizes_known=sizes_known
    )
    pairs = tuple(itertools.combinations(range(reported), 2))
    first = np.array([i for i, _ in pairs])
    second = np.array([j for _, j in pairs])
    diff_var = cov[first, first] + cov[second, second] - 2 * cov[first, second]
    worst_var = worst[first, first] + worst[second, second] - 2 * worst[first, second]
    diff_var = np.maximum(diff_var, 0.0)
    differences_v = means_v[first] - means_v[second]
    z = normal_quantile(confidence)
    normal_half = z * np.sqrt(diff_var)
    intervals = tuple(
        fold_interval(d - h, d + h) for d, h in zip(differences_v / 2, normal_half / 2, strict=True)
    )
    gaps = np.abs(differences_v) / 2
    best = int(np.argmax(gaps))
    # Simultaneous interval for the max gap: Bonferroni over the pairs.
    z_all = normal_quantile(1.0 - (1.0 - confidence) / len(pairs))
    simultaneous = [
        fold_interval(d - z_all * s, d + z_all * s)
        for d, s in zip(differences_v / 2, np.sqrt(diff_var) / 2, strict=True)
    ]
    max_interval = ConfidenceInterval(
        max(ci.low for ci in simultaneous), max(ci.high for ci in simultaneous)
    )
    if not sizes_known:
        notes.append("group sizes estimated from the perturbed group reports (GRR estimator)")
    if undefined_category:
        notes.append("users with an undefined metric reported the undefined category")
    return GapEstimate(
        mechanism=mechanism.name,
        epsilon=float(mechanism.epsilon),
        epsilon_group=float(mechanism.epsilon_group),
        epsilon_value=float(mechanism.epsilon_value),
        num_reports=int(num_clients),
        confidence=confidence,
        group_means=(means_v[:reported] + 1.0) / 2.0,
        group_stderrs=np.sqrt(np.maximum(np.diag(cov)[:reported], 0.0)) / 2.0,
        group_sizes=sizes[:reported],
        sizes_estimated=not sizes_known,
        pairs=pairs,
        differences=differences_v / 2.0,
        difference_stderrs=np.sqrt(diff_var) / 2.0,
        gaps=gaps,
        gap_intervals=intervals,
        chebyshev_halfwidths=chebyshev_halfwidth(worst_var, confidence) / 2.0,
        normal_halfwidths=normal_half / 2.0,
        max_gap=float(gaps[best]),
        max_gap_pair=pairs[best],
        max_gap_interval=max_interval,
        notes=tuple(notes),
    )


def metric_to_value(metric: np.ndarray | float) -> np.ndarray:
    """v = 2 m - 1: a metric in [0, 1] on the mechanisms' [-1, 1] scale."""
    return 2.0 * np.asarray(metric, dtype=np.float64) - 1.0


def value_to_metric(value: np.ndarray | float) -> np.ndarray:
    """m = (v + 1) / 2."""
    return (np.asarray(value, dtype=np.float64) + 1.0) / 2.0


@dataclass(frozen=True)
class GapComparison:
    """How much smaller one model's gap is than a reference model's, from two independent
    private audits (:func:`compare_gaps`).

    Attributes
    ----------
    statistic : float
        ``s (d_ref - d_other)``, with ``d`` each audit's signed difference of the pair's group
        means and ``s`` the sign of ``d_ref``: positive when the other model's gap is smaller
        on the reference's side.
    stderr : float
        ``sqrt(se_ref^2 + se_other^2)``: the audits' perturbations are independent.
    interval : ConfidenceInterval
        Normal interval at ``confidence``.
    pvalue : float
        One-sided p-value of H0 ``statistic <= 0`` (the other model's gap is not smaller).
    confidence : float
    """

    statistic: float
    stderr: float
    interval: ConfidenceInterval
    pvalue: float
    confidence: float

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 on the positive side: the other gap is smaller."""
        return self.interval.low > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (the attributes and ``resolved``)."""
        return {
            "statistic": self.statistic,
            "stderr": self.stderr,
            "interval": [self.interval.low, self.interval.high],
            "pvalue": self.pvalue,
            "confidence": self.confidence,
            "resolved": self.resolved,
        }


def compare_gaps(
    reference_difference: float,
    reference_stderr: float,
    other_difference: float,
    other_stderr: float,
    *,
    confidence: float = 0.95,
) -> GapComparison:
    """Compare two models' gaps for one pair of groups from two independent LDP audits.

    Each audit gives the signed difference ``d`` of the pair's group means and its standard
    error (:class:`GapEstimate` ``differences`` / ``difference_stderrs``). The audits perturb
    the reports independently, so ``d_ref - d_other`` has variance ``se_ref^2 + se_other^2``;
    signed by ``d_ref`` it measures how much the other model closes the reference's gap.
    Normal approximation, as the audits' own intervals (Juarez and Korolova 2022, Section 5).

    >>> round(compare_gaps(0.20, 0.03, 0.05, 0.03).interval.low, 4)
    0.0668
    """
    for name, value in (
        ("reference_difference", reference_difference),
        ("other_difference", other_difference),
    ):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    for name, value in (("reference_stderr", reference_stderr), ("other_stderr", other_stderr)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    sign = 1.0 if reference_difference >= 0 else -1.0
    statistic = sign * (reference_difference - other_difference)
    stderr = math.hypot(reference_stderr, other_stderr)
    half = normal_quantile(confidence) * stderr
    if stderr > 0:
        from scipy import stats  # (see normal_quantile)

        pvalue = float(stats.norm.sf(statistic / stderr))
    else:
        pvalue = 0.0 if statistic > 0 else 1.0
    return GapComparison(
        statistic=statistic,
        stderr=stderr,
        interval=ConfidenceInterval(statistic - half, statistic + half),
        pvalue=pvalue,
        confidence=float(confidence),
    )


__all__ = [
    "GAP_VERDICTS",
    "ConfidenceInterval",
    "EstimationError",
    "GapComparison",
    "GapEstimate",
    "GapMechanism",
    "SIZE_DETECTION_SIGMAS",
    "chebyshev_halfwidth",
    "compare_gaps",
    "estimate_gap",
    "estimator_covariance",
    "fold_interval",
    "metric_to_value",
    "normal_quantile",
    "report_sum_variance",
    "size_estimate_covariance",
    "value_to_metric",
    "worst_case_square_sums",
]
