"""Generalised randomised response (GRR) and the M_R gap mechanism.

Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022
(Juarez and Korolova 2022 below), Definition 2 and Algorithm 1. The privacy guarantee is the
true one, computed by :func:`randomized_response_epsilon`, not the paper's Theorem 5, which is
false (it claims max(eps1, eps2)).

Sampling uses one uniform draw per client: the unit interval is cut into the mechanism's
output cells (kept group with v' = +1 / -1, then each other group with v' = +1 / -1), so the
*output distribution* is exactly Algorithm 1's (to the 2^-53 resolution of a float64
uniform) while the generator is called once per client instead of three times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from ..validation import (
    check_clients,
    check_epsilon,
    check_generator,
    check_groups_array,
    check_num_groups,
)
from .reports import GroupValueMechanism, PerturbedReports, ReportMoments, ReportSummary


def grr_keep_probability(epsilon: float, num_groups: int) -> float:
    """a = e^eps / (e^eps + d - 1): probability that GRR reports the true category.

    Juarez and Korolova 2022, Definition 2. Computed as 1 / (1 + (d - 1) e^-eps) to stay finite
    for large eps.
    """
    epsilon = check_epsilon("epsilon", epsilon)
    num_groups = check_num_groups(num_groups)
    return 1.0 / (1.0 + (num_groups - 1) * math.exp(-epsilon))


def binary_keep_probability(epsilon: float) -> float:
    """b = e^eps / (1 + e^eps): keep-probability of binary randomised response."""
    return grr_keep_probability(epsilon, 2)


def _flip_to_other_group(
    groups: np.ndarray, position: np.ndarray, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Map a uniform ``position`` in [0, 1) of a flipped client to (other group, sign cell).

    The flipped mass is cut into 2 (d - 1) equal cells: cell j sends the client to group
    ``(g + 1 + j // 2) mod d`` with v' = +1 when j is even, -1 when odd.
    """
    cells = 2 * (num_groups - 1)
    cell = np.minimum((position * cells).astype(np.int64), cells - 1)
    other = (groups + 1 + cell // 2) % num_groups
    return other, (cell % 2) == 0


def grr_perturb(
    categories: np.ndarray, epsilon: float, num_categories: int, rng: np.random.Generator
) -> np.ndarray:
    """GRR: keep each category with probability a, else report one of the others uniformly."""
    keep = grr_keep_probability(epsilon, num_categories)
    categories = check_groups_array(categories, num_categories, "categories")
    rng = check_generator("rng", rng)
    draws = rng.random(len(categories))
    kept = draws < keep
    position = (draws - keep) / (1.0 - keep)
    other = (
        categories
        + 1
        + np.minimum((position * (num_categories - 1)).astype(np.int64), num_categories - 2)
    ) % num_categories
    return np.where(kept, categories, other).astype(np.int64)


def grr_frequency_estimate(
    report_counts: np.ndarray, num_reports: int, keep_probability: float
) -> np.ndarray:
    """Unbiased GRR frequency estimator: n_hat = (n' - K q) / (a - q), q = (1 - a)/(d - 1).

    Wang et al. (2017), the "direct encoding" estimator; used when group sizes are unknown.
    """
    counts = np.asarray(report_counts, dtype=np.float64)
    num_groups = counts.shape[0]
    flip = (1.0 - keep_probability) / (num_groups - 1)
    return (counts - num_reports * flip) / (keep_probability - flip)


def randomized_response_epsilon(
    epsilon_group: float, epsilon_value: float, num_groups: int = 2
) -> float:
    """The true LDP epsilon of M_R, for any d >= 2 (not the paper's Theorem 5).

    eps = max(eps2, eps1 + ln(2 e^eps2 / (1 + e^eps2)), ln((1 + e^eps2) / 2) - eps1).
    The paper's Theorem 5 claims max(eps1, eps2), which is false for every eps2 > 0: Eq. (6)
    of its proof (Appendix A.1) claims 2 e^(eps1 + eps2) / (1 + e^eps2) <= e^eps1. The
    closed form above is checked by exact enumeration of M_R's finitely many outputs (its
    output probabilities are linear in v) in ``tests/test_privacy.py``; e.g.
    eps1 = eps2 = 1 gives 1.3799-LDP, not 1-LDP.

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Theorem 5 and Appendix A.1.
    """
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    check_num_groups(num_groups)
    # ln(2b) = ln 2 - ln(1 + e^-eps2); ln((1 + e^eps2)/2) = logaddexp(0, eps2) - ln 2.
    log_two_b = math.log(2.0) - math.log1p(math.exp(-epsilon_value))
    log_half_one_plus = float(np.logaddexp(0.0, epsilon_value)) - math.log(2.0)
    return max(epsilon_value, epsilon_group + log_two_b, log_half_one_plus - epsilon_group)


@dataclass(frozen=True)
class RandomizedResponseMechanism(GroupValueMechanism):
    """M_R (Juarez and Korolova 2022, Algorithm 1) for d >= 2 groups.

    Group step: GRR with eps1. If the group flipped, v is replaced by 0. Value step: draw
    B ~ Bernoulli((1 + v)/2), apply binary RR with eps2, report v' = 2B' - 1 in {-1, +1}.
    Reports are ``int8`` values in {-1, +1}.

    Parameters
    ----------
    epsilon_group : float
        eps1 > 0, budget of the group step.
    epsilon_value : float
        eps2 > 0, budget of the value step.
    num_groups : int
        d >= 2.

    Use :func:`fedparity.mechanisms.ldp.calibration.mechanism_for_budget` to build one for a total
    budget;
    :attr:`epsilon` is the true guarantee (:func:`randomized_response_epsilon`; the paper's
    Theorem 5 is false), computed, not assumed.

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Algorithm 1 (M_R) and Definition 2 (GRR).
    """

    name: ClassVar[Literal["R"]] = "R"

    @property
    def epsilon(self) -> float:
        """True LDP epsilon of this mechanism (:func:`randomized_response_epsilon`)."""
        return randomized_response_epsilon(self.epsilon_group, self.epsilon_value, self.num_groups)

    @property
    def group_keep_probability(self) -> float:
        """a = e^eps1 / (e^eps1 + d - 1)."""
        return grr_keep_probability(self.epsilon_group, self.num_groups)

    @property
    def value_keep_probability(self) -> float:
        """b = e^eps2 / (1 + e^eps2)."""
        return binary_keep_probability(self.epsilon_value)

    @property
    def moments(self) -> ReportMoments:
        b = self.value_keep_probability
        return ReportMoments(
            num_groups=self.num_groups,
            keep_probability=self.group_keep_probability,
            value_gain=2.0 * b - 1.0,
            kept_second_moment=1.0,
            kept_second_moment_slope=0.0,
            flipped_second_moment=1.0,
        )

    def is_valid_report_value(self, values: np.ndarray) -> np.ndarray:
        """Output domain check: v' must be exactly -1 or +1."""
        values = np.asarray(values)
        return (values == 1) | (values == -1)

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each client's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1).

        ``validate=False`` skips the input checks (for callers that already validated, e.g.
        the streaming path); never pass unchecked user input with it.
        """
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        a = self.group_keep_probability
        value_gain = 2.0 * self.value_keep_probability - 1.0
        draws = rng.random(len(groups))
        kept = draws < a
        # Kept cell [0, a): v' = +1 on [0, a (1 + (2b - 1) v) / 2).
        kept_positive = draws < (0.5 * a) * (1.0 + value_gain * values)
        if self.num_groups == 2:
            flipped_positive = draws < a + 0.5 * (1.0 - a)
            out_groups = np.where(kept, groups, 1 - groups)
        else:
            other, flipped_positive = _flip_to_other_group(
                groups, (draws - a) / (1.0 - a), self.num_groups
            )
            out_groups = np.where(kept, groups, other)
        positive = np.where(kept, kept_positive, flipped_positive)
        out_values = np.where(positive, np.int8(1), np.int8(-1))
        return PerturbedReports(out_groups.astype(np.int64, copy=False), out_values)

    def perturb_and_summarize(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> ReportSummary:
        """``ReportSummary.from_reports`` of :meth:`perturb`, without materialising reports.

        Uses the same draws in the same order as :meth:`perturb`, so with the same generator
        state the summary is identical; for d = 2 it only counts (the streaming fast path).
        """
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        if self.num_groups != 2:
            reports = self.perturb(groups, values, rng, validate=False)
            return ReportSummary.from_reports(reports.groups, reports.values, self.num_groups)
        a = self.group_keep_probability
        value_gain = 2.0 * self.value_keep_probability - 1.0
        count = groups.shape[0]
        draws = rng.random(count)
        in_group_one = groups != 0
        kept = draws < a
        kept_positive = draws < (0.5 * a) * (1.0 + value_gain * values)
        flipped_positive = (draws < a + 0.5 * (1.0 - a)) ^ kept
        reports_one = int(np.count_nonzero(kept == in_group_one))
        positives_one = int(np.count_nonzero(kept_positive & in_group_one)) + int(
            np.count_nonzero(flipped_positive & ~in_group_one)
        )
        positives = int(np.count_nonzero(kept_positive)) + int(np.count_nonzero(flipped_positive))
        counts = np.array([count - reports_one, reports_one], dtype=np.int64)
        positive_counts = np.array([positives - positives_one, positives_one])
        return ReportSummary(
            count,
            counts,
            (2 * positive_counts - counts).astype(np.float64),
            counts.astype(np.float64),
        )
