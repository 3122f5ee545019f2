"""A sequential LDP gap audit: ask fresh users in batches, stop as soon as the question is
answered, with intervals valid under that optional stopping (confidence sequences).

The audit asks batches of users for one M_N report each
(:class:`~fedparity.mechanisms.ldp.nprr.NPRRMechanism`; NPRR on the value, Waudby-Smith, Wu
and Ramdas, "Nonparametric extensions of randomized response for private confidence sets",
ICML 2023) and after every batch updates a confidence sequence (CS) for every group's mean and
every pairwise gap; it stops when the gap's interval excludes 0 ("the groups differ"), when
every pairwise interval is narrower than a target width, or at a cap on the users asked. A user
never asked sends nothing and spends nothing: the privacy spent is (users asked) x epsilon, one
epsilon-LDP report per asked user.

The confidence sequence (not the hedged betting CS of Waudby-Smith et al. 2023, Section 3, but
one whose validity is proven here in a few lines and which, unlike a Hoeffding CS, adapts to
the small variance of the rare per-group statistics):

1. *Per-report statistics.* A report (g', z), z in {0, 1/G, ..., 1} its value on [0, 1], gives
   for each group G the two statistics X1 = [g' = G] z and X0 = [g' = G] (1 - z), both in
   [0, 1]. Fresh users are drawn at random from the population (each independent of the past),
   so each statistic has a fixed mean given the past: P1_G and P0_G. With a and q_g the
   group step's keep and per-other-group probabilities, r NPRR's keep probability, pi_G the
   group's share and m_G its mean metric: P1_G - P0_G = 2 a r pi_G (m_G - 1/2) and
   P1_G + P0_G = q_g + (a - q_g) pi_G (a flipped report is a uniform grid point, mean 1/2), so

       m_G = 1/2 + (a - q_g) (P1_G - P0_G) / (2 a r (P1_G + P0_G - q_g)).

2. *A CS for the mean p of [0, 1]-valued observations* (Robbins' beta-binomial mixture; Robbins
   1970, Howard, Ramdas, McAuliffe and Sekhon 2021). For theta in (0, 1), x -> (theta / p)^x
   ((1 - theta) / (1 - p))^(1 - x) is convex, so on [0, 1] it lies below the chord through
   x = 0 and x = 1, whose mean at E[x] = p is 1: the product L_t(theta) over the first t
   observations is a nonnegative supermartingale with L_0 = 1 when the mean is p. So is its
   mixture over theta ~ Beta(c m0, c (1 - m0)),

       M_t(p) = B(c m0 + S_t, c (1 - m0) + t - S_t) / (B(c m0, c (1 - m0)) p^S_t (1 - p)^(t - S_t)),

   S_t the sum of the observations (Fubini), and Ville's inequality gives
   P(exists t: M_t(p) >= 1 / alpha) <= alpha. The CS is {p : M_t(p) < 1 / alpha}, an interval
   around S_t / t (ln M_t is convex in p), valid at every t at once, so at any stopping time
   and at the ends of batches of any sizes; intersecting the intervals over t keeps it valid.

3. *Union and interval arithmetic.* Each of the 2 d statistics gets a CS at alpha / (2 d):
   with probability at least 1 - alpha all of them cover at every t at once. m_G is a
   linear-fractional function of (P1_G, P0_G), quasi-linear where its denominator is positive,
   so over a box of (P1_G, P0_G) its extremes are at the corners: when the box keeps
   P1 + P0 > q_g the group's interval is the corners' range (clipped to [0, 1]), else [0, 1].
   Every pair's difference then lies in [low_G - high_H, high_G - low_H], simultaneously for
   all pairs, and the largest gap in the range of the folded intervals' ends.

Tightness: at a zero gap the sequence needs about ten times the users of a fixed-n normal
interval of the same width (``docs/benchmarks.md``); the interval arithmetic (the two
statistics of a group, then the two groups of a pair, add their widths instead of combining
them in quadrature) costs about a factor 3 of that, the union bound and the mixture's
penalty the rest. A joint confidence region for a pair's statistics would recover most of the
first part.

The users saved against a fixed-size audit planned for the same question
(:func:`fixed_audit_size`: the fewest users whose fixed-n normal interval is narrower than the
target width at the same level, whatever the gap) are shown by ``tests/test_sequential.py`` and
``benchmarks/sequential_audit.py``.

References
----------
.. [1] I. Waudby-Smith, Z. S. Wu and A. Ramdas, "Nonparametric extensions of randomized
       response for private confidence sets", ICML 2023.
.. [2] H. Robbins, "Statistical methods related to the law of the iterated logarithm", The
       Annals of Mathematical Statistics 41(5), 1970.
.. [3] S. R. Howard, A. Ramdas, J. McAuliffe and J. Sekhon, "Time-uniform, nonparametric,
       nonasymptotic confidence sequences", The Annals of Statistics 49(2), 2021.
.. [4] J. Ville, "Etude critique de la notion de collectif", Gauthier-Villars, 1939.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..validation import (
    check_generator,
    check_group_fractions,
    check_groups_array,
    check_int_at_least,
    check_nonnegative_finite,
    check_open_unit,
    check_positive_finite,
)
from .calibration import gap_variance_factor
from .estimators import ConfidenceInterval, fold_interval, normal_quantile
from .nprr import NPRRMechanism
from .reports import PerturbedReports

__all__ = [
    "STOP_REASONS",
    "allocate_batch",
    "SequentialBatch",
    "SequentialGapAudit",
    "SequentialGapResult",
    "beta_mixture_interval",
    "fixed_audit_size",
    "sequential_gap_audit",
]

#: Why a sequential audit stopped: the gap's interval excludes 0, every pairwise interval is
#: narrower than the target, the cap on users was reached; and in a federated audit
#: (:class:`fedparity.strategies.SequentialLdpAudit`), a batch that did not come back whole
#: (its reports are left out: the intervals stand at the batch before) or a population with
#: too few users left to ask the next batch.
STOP_REASONS = (
    "the groups differ",
    "target width reached",
    "user cap reached",
    "a batch came back incomplete",
    "too few users left to ask",
)

#: The default strength c of the beta mixture's prior in :func:`beta_mixture_interval`.
PRIOR_STRENGTH = 1.0
#: The sequential audit's prior strength: Beta(c m0, c (1 - m0)) with m0 the statistic's mean
#: for equal groups of mean 1/2 (from the mechanism alone, before any data); a stronger prior
#: narrows the sequence at the sizes audits reach (10^3 to 10^6 users) and widens it for the
#: first few hundred.
AUDIT_PRIOR_STRENGTH = 100.0


def _log_mixture(total: float, count: int, p: float, prior: tuple[float, float]) -> float:
    """ln M_t(p) of the beta-binomial mixture (module docstring, step 2)."""
    from scipy import special  # here, not at the top: a node's process starts faster

    alpha, beta = prior
    log_likelihood = 0.0
    if total > 0:
        log_likelihood += total * math.log(p)
    if count - total > 0:
        log_likelihood += (count - total) * math.log1p(-p)
    return (
        float(special.betaln(alpha + total, beta + count - total))
        - float(special.betaln(alpha, beta))
        - log_likelihood
    )


def beta_mixture_interval(
    total: float,
    count: int,
    confidence: float,
    *,
    prior_mean: float = 0.5,
    prior_strength: float = PRIOR_STRENGTH,
) -> ConfidenceInterval:
    """The beta-binomial mixture CS for the mean of [0, 1]-valued observations at time t.

    ``total`` is S_t, the sum of the first ``count`` = t observations; the interval is
    {p : M_t(p) < 1 / (1 - confidence)} (module docstring, step 2), valid for every t at once.
    The prior Beta(c m0, c (1 - m0)) must be fixed before the data.

    >>> interval = beta_mixture_interval(30, 100, 0.95)
    >>> round(interval.low, 3), round(interval.high, 3)
    (0.166, 0.463)
    """
    from scipy import optimize

    count = check_int_at_least("count", count, 0)
    total = check_nonnegative_finite("total", total)
    if total > count:
        raise ValueError(f"total must be in [0, count={count}], got {total!r}")
    confidence = check_open_unit("confidence", confidence)
    prior_mean = check_open_unit("prior_mean", prior_mean)
    prior_strength = check_positive_finite("prior_strength", prior_strength)
    if count == 0:
        return ConfidenceInterval(0.0, 1.0)
    prior = (prior_strength * prior_mean, prior_strength * (1.0 - prior_mean))
    level = -math.log1p(-confidence)  # ln(1 / alpha)
    centre = total / count

    def excess(p: float) -> float:
        return _log_mixture(total, count, p, prior) - level

    tiny = 1e-300
    low = 0.0
    if centre > 0 and excess(tiny) > 0:
        low = optimize.brentq(excess, tiny, centre, xtol=1e-15, rtol=1e-12)
    high = 1.0
    if centre < 1 and excess(1.0 - 1e-16) > 0:
        high = optimize.brentq(excess, centre, 1.0 - 1e-16, xtol=1e-15, rtol=1e-12)
    return ConfidenceInterval(float(low), float(high))


def _mean_range(
    mechanism: NPRRMechanism, positive: ConfidenceInterval, negative: ConfidenceInterval
) -> ConfidenceInterval:
    """The range of m_G over the box positive x negative of (P1_G, P0_G) (step 3)."""
    a, flip, _, _ = (float(x) for x in mechanism.exact_probabilities())
    r = mechanism.report_keep_probability
    if positive.low + negative.low - flip <= 0:
        return ConfidenceInterval(0.0, 1.0)
    corners = [
        0.5 + (a - flip) * (p1 - p0) / (2.0 * a * r * (p1 + p0 - flip))
        for p1 in (positive.low, positive.high)
        for p0 in (negative.low, negative.high)
    ]
    return ConfidenceInterval(
        float(np.clip(min(corners), 0.0, 1.0)), float(np.clip(max(corners), 0.0, 1.0))
    )


def _intersect(first: ConfidenceInterval, second: ConfidenceInterval) -> ConfidenceInterval:
    low, high = max(first.low, second.low), min(first.high, second.high)
    if low > high:  # disjoint: the CS has already failed; keep the newest
        return second
    return ConfidenceInterval(low, high)


@dataclass(frozen=True)
class SequentialBatch:
    """The audit's state after one batch: users asked so far, the largest gap's estimate and
    CS, and every group's CS for its mean (metric units)."""

    users: int
    estimate: float
    interval: ConfidenceInterval
    group_intervals: tuple[ConfidenceInterval, ...]


@dataclass(frozen=True)
class SequentialGapResult:
    """A sequential gap audit's outcome (:func:`sequential_gap_audit`).

    Attributes
    ----------
    estimate : float
        The largest pairwise gap of the plug-in group means (metric units; NaN while a group's
        estimated share is not positive).
    interval : ConfidenceInterval
        Its confidence sequence at the stop: it covers the true largest gap with probability
        at least ``confidence`` whenever the audit stops.
    group_means : np.ndarray
        Plug-in group means (step 1 of the module docstring with the empirical means).
    group_intervals : tuple of ConfidenceInterval
        Every group's CS (simultaneous).
    pairs, difference_intervals
        Every pair (i, j) and the CS of m_i - m_j (simultaneous).
    users_asked : int
        Users who sent a report; nobody else was asked.
    stopped_because : str
        One of :data:`STOP_REASONS`.
    batches : tuple of SequentialBatch
        The state after every batch.
    epsilon : float
        The realised LDP epsilon of each asked user's one report.
    confidence : float
    """

    estimate: float
    interval: ConfidenceInterval
    group_means: np.ndarray = field(compare=False)
    group_intervals: tuple[ConfidenceInterval, ...]
    pairs: tuple[tuple[int, int], ...]
    difference_intervals: tuple[ConfidenceInterval, ...]
    users_asked: int
    stopped_because: str
    batches: tuple[SequentialBatch, ...]
    epsilon: float
    confidence: float

    @property
    def privacy_spent(self) -> float:
        """Total epsilon spent over the population: users asked x epsilon (each asked user
        spends epsilon once; users never asked spend nothing)."""
        return self.users_asked * self.epsilon

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary."""
        return {
            "estimate": self.estimate,
            "interval": [self.interval.low, self.interval.high],
            "group_means": self.group_means.tolist(),
            "group_intervals": [[ci.low, ci.high] for ci in self.group_intervals],
            "pairs": [list(pair) for pair in self.pairs],
            "difference_intervals": [[ci.low, ci.high] for ci in self.difference_intervals],
            "users_asked": self.users_asked,
            "stopped_because": self.stopped_because,
            "batches": [
                {
                    "users": b.users,
                    "estimate": b.estimate,
                    "interval": [b.interval.low, b.interval.high],
                }
                for b in self.batches
            ],
            "epsilon": self.epsilon,
            "privacy_spent": self.privacy_spent,
            "confidence": self.confidence,
        }


class SequentialGapAudit:
    """The running confidence sequences of a sequential audit (module docstring).

    :meth:`update` takes each batch's reports (one per asked user) and returns the state; the
    intervals are intersected over the batches. :func:`sequential_gap_audit` drives it.
    """

    def __init__(
        self,
        mechanism: NPRRMechanism,
        *,
        confidence: float = 0.95,
        prior_strength: float = AUDIT_PRIOR_STRENGTH,
        undefined_category: bool = False,
    ) -> None:
        """``undefined_category``: the mechanism's last category is "metric undefined" (TPR
        and FNR for a user without positives, FPR without negatives), which its users report
        (with the value 0); the means, intervals and gaps are those of the other categories,
        the groups' means over their users with a defined metric (step 1 holds for every
        category: a report flipped to G carries a uniform value whatever its true category)."""
        if not isinstance(mechanism, NPRRMechanism):
            raise ValueError(
                f"mechanism must be an NPRRMechanism (M_N), got {type(mechanism).__name__}"
            )
        self.mechanism = mechanism
        self.confidence = check_open_unit("confidence", confidence)
        self.prior_strength = check_positive_finite("prior_strength", prior_strength)
        d = mechanism.num_groups
        if undefined_category and d < 3:
            raise ValueError(
                "undefined_category needs a mechanism with num_groups >= 3 (the protected "
                f"groups and 'undefined'), got {d}"
            )
        self.undefined_category = bool(undefined_category)
        #: The compared groups: every category, or all but the undefined one.
        self.num_groups = d - 1 if undefined_category else d
        a, flip, _, _ = (float(x) for x in mechanism.exact_probabilities())
        #: m0 of every statistic: half of P(g' = G) = q_g + (a - q_g) / d
        self.prior_mean = 0.5 * (flip + (a - flip) / d)
        self.users = 0
        self.positive_sums = np.zeros(d)  # S of [g' = G] z
        self.negative_sums = np.zeros(d)  # S of [g' = G] (1 - z)
        self.pairs = tuple(itertools.combinations(range(self.num_groups), 2))
        self._statistic_intervals = [ConfidenceInterval(0.0, 1.0)] * (2 * self.num_groups)
        self.batches: list[SequentialBatch] = []

    def update(self, reports: PerturbedReports) -> SequentialBatch:
        """Add one batch of reports (every one from a different, freshly asked user)."""
        mechanism = self.mechanism
        d, grid = mechanism.num_groups, mechanism.grid_size
        groups = check_groups_array(reports.groups, d, "reports.groups")
        valid = mechanism.is_valid_report_value(reports.values)
        if not np.all(valid):
            raise ValueError(
                "reports.values must be M_N reports 2 z / G - 1 for integer z in "
                f"[0, {grid}] (G = {grid})"
            )
        z = mechanism.grid_index(reports.values) / grid
        self.positive_sums += np.bincount(groups, weights=z, minlength=d)
        self.negative_sums += np.bincount(groups, weights=1.0 - z, minlength=d)
        self.users += int(groups.shape[0])
        batch = self._state()
        self.batches.append(batch)
        return batch

    def _statistic_level(self) -> float:
        return 1.0 - (1.0 - self.confidence) / (2 * self.num_groups)

    def _state(self) -> SequentialBatch:
        d = self.num_groups
        level = self._statistic_level()
        sums = [*self.positive_sums[:d], *self.negative_sums[:d]]
        self._statistic_intervals = [
            _intersect(
                previous,
                beta_mixture_interval(
                    min(s, self.users),
                    self.users,
                    level,
                    prior_mean=self.prior_mean,
                    prior_strength=self.prior_strength,
                ),
            )
            for previous, s in zip(self._statistic_intervals, sums, strict=True)
        ]
        group_intervals = tuple(
            _mean_range(
                self.mechanism, self._statistic_intervals[g], self._statistic_intervals[d + g]
            )
            for g in range(d)
        )
        estimate, interval, _ = self._gap(group_intervals)
        return SequentialBatch(self.users, estimate, interval, group_intervals)

    def group_means(self) -> np.ndarray:
        """Plug-in group means (step 1 with the empirical means; NaN where the estimated
        share is not positive)."""
        a, flip, _, _ = (float(x) for x in self.mechanism.exact_probabilities())
        r = self.mechanism.report_keep_probability
        t = max(self.users, 1)
        d = self.num_groups
        p1, p0 = self.positive_sums[:d] / t, self.negative_sums[:d] / t
        share = p1 + p0 - flip
        with np.errstate(divide="ignore", invalid="ignore"):
            means = 0.5 + (a - flip) * (p1 - p0) / (2.0 * a * r * share)
        return np.where(share > 0, np.clip(means, 0.0, 1.0), np.nan)

    def _gap(
        self, group_intervals: Sequence[ConfidenceInterval]
    ) -> tuple[float, ConfidenceInterval, tuple[ConfidenceInterval, ...]]:
        means = self.group_means()
        differences = tuple(
            ConfidenceInterval(
                group_intervals[i].low - group_intervals[j].high,
                group_intervals[i].high - group_intervals[j].low,
            )
            for i, j in self.pairs
        )
        folded = [fold_interval(ci.low, ci.high) for ci in differences]
        interval = ConfidenceInterval(max(ci.low for ci in folded), max(ci.high for ci in folded))
        gaps = [abs(means[i] - means[j]) for i, j in self.pairs]
        estimate = float("nan") if any(math.isnan(g) for g in gaps) else float(max(gaps))
        return estimate, interval, differences

    def stop_reason(self, *, target_width: float, max_users: int) -> str | None:
        """Why the audit stops after its latest batch (one of :data:`STOP_REASONS`), or None
        to ask the next batch: the largest gap's interval excludes 0, every pairwise
        interval is narrower than ``target_width``, or ``max_users`` users were asked."""
        if not self.batches:
            return None
        state = self.batches[-1]
        _, _, differences = self._gap(state.group_intervals)
        if state.interval.low > 0:
            return STOP_REASONS[0]
        if max(ci.width for ci in differences) < target_width:
            return STOP_REASONS[1]
        if self.users >= max_users:
            return STOP_REASONS[2]
        return None

    def result(self, stopped_because: str) -> SequentialGapResult:
        """The outcome so far, stopped for ``stopped_because``."""
        if stopped_because not in STOP_REASONS:
            raise ValueError(
                f"stopped_because must be one of {STOP_REASONS}, got {stopped_because!r}"
            )
        if not self.batches:
            raise ValueError("no batch has been added")
        last = self.batches[-1]
        estimate, interval, differences = self._gap(last.group_intervals)
        return SequentialGapResult(
            estimate=estimate,
            interval=interval,
            group_means=self.group_means(),
            group_intervals=last.group_intervals,
            pairs=self.pairs,
            difference_intervals=differences,
            users_asked=self.users,
            stopped_because=stopped_because,
            batches=tuple(self.batches),
            epsilon=self.mechanism.epsilon,
            confidence=self.confidence,
        )


def allocate_batch(
    size: int, population_sizes: Sequence[int], rng: np.random.Generator
) -> np.ndarray:
    """How many of a batch's ``size`` users to ask at each node: a multinomial draw with the
    nodes' shares ``population_sizes / sum``, so that each asked user is at node k with
    probability N_k / N independently of everything else. With each node's users independent
    draws from its own distribution, every asked user is then an independent draw from the
    mixture of the nodes' distributions -- the population they hold -- and the confidence
    sequence's argument (module docstring, step 2) holds for the population's means, however
    different the nodes are. (A fixed split, e.g. equal numbers per node, would target another
    mixture.)"""
    size = check_int_at_least("size", size, 0)
    sizes = np.asarray(population_sizes, dtype=np.float64)
    if sizes.ndim != 1 or sizes.size == 0 or not np.all(sizes >= 0) or not sizes.sum() > 0:
        raise ValueError(
            "population_sizes must be a non-empty sequence of user counts >= 0, not all 0"
        )
    check_generator("rng", rng)
    return rng.multinomial(size, sizes / sizes.sum())


def sequential_gap_audit(
    mechanism: NPRRMechanism,
    next_batch: Callable[[int], PerturbedReports],
    *,
    batch_size: int,
    max_users: int,
    target_width: float,
    confidence: float = 0.95,
    undefined_category: bool = False,
) -> SequentialGapResult:
    """Ask fresh users in batches until the gap is answered (module docstring).

    Parameters
    ----------
    mechanism : NPRRMechanism
        The M_N every asked user applies to its (group, value).
    next_batch : callable
        ``next_batch(n)`` asks n fresh users (never asked before, drawn at random from the
        population) and returns their n perturbed reports, one per user.
    batch_size : int
        Users asked per batch (the last batch stops at ``max_users``).
    max_users : int
        The cap on users asked.
    target_width : float
        Stop when every pairwise difference's interval is narrower than this (metric units).
    confidence : float
        Level of the confidence sequences, in (0, 1).
    undefined_category : bool
        The mechanism's last category is "metric undefined" (:class:`SequentialGapAudit`).

    Stops after the first batch whose largest gap's interval excludes 0, or whose pairwise
    intervals are all narrower than ``target_width``, or once ``max_users`` users were asked.
    The privacy spent is ``users_asked x mechanism.epsilon``
    (:attr:`SequentialGapResult.privacy_spent`).
    """
    batch_size = check_int_at_least("batch_size", batch_size, 1)
    max_users = check_int_at_least("max_users", max_users, 1)
    target_width = check_positive_finite("target_width", target_width)
    if not callable(next_batch):
        raise ValueError("next_batch must be a callable next_batch(n) -> PerturbedReports")
    audit = SequentialGapAudit(
        mechanism, confidence=confidence, undefined_category=undefined_category
    )
    while True:
        asked = min(batch_size, max_users - audit.users)
        reports = next_batch(asked)
        if not isinstance(reports, PerturbedReports) or len(reports) != asked:
            raise ValueError(
                f"next_batch({asked}) must return PerturbedReports with {asked} reports, one "
                "per asked user"
            )
        audit.update(reports)
        reason = audit.stop_reason(target_width=target_width, max_users=max_users)
        if reason is not None:
            return audit.result(reason)


def fixed_audit_size(
    mechanism: NPRRMechanism,
    target_width: float,
    *,
    confidence: float = 0.95,
    group_fractions: Sequence[float] | np.ndarray | None = None,
) -> int:
    """The fixed-size audit planned for the same question: the fewest users K whose normal
    interval for the largest gap (Bonferroni over the d (d - 1) / 2 pairs when d > 2, as
    :func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`'s) is narrower than
    ``target_width`` at ``confidence`` whatever the gap: 2 z sqrt(V / (4 K)) <= target_width,
    V / K the worst-case variance of the gap on the [-1, 1] scale
    (:func:`~fedparity.mechanisms.ldp.calibration.gap_variance_factor`, known sizes; a quarter
    of it in metric units), that is K = ceil(z^2 V / target_width^2).
    """
    target_width = check_positive_finite("target_width", target_width)
    confidence = check_open_unit("confidence", confidence)
    d = mechanism.num_groups
    fractions = check_group_fractions(group_fractions, d)
    pairs = d * (d - 1) // 2
    z = normal_quantile(1.0 - (1.0 - confidence) / pairs)
    factor = gap_variance_factor(mechanism.moments, fractions)
    return max(math.ceil(z * z * factor / target_width**2), d)
