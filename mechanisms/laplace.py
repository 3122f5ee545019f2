"""The M_L gap mechanism: GRR on the group, Laplace noise on the value.

Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022
(Juarez and Korolova 2022 below), Section 4 and Appendix A.2. Only the noise ratio k = 2 is
LDP (:func:`check_noise_ratio` says why, :func:`laplace_epsilon` gives the true epsilon): the
paper's Theorem 6 for general k is false, and so are its "M_L opt." allocations.

Sampling: one uniform draw decides the group cell and the sign of the noise, one standard
exponential draw its magnitude (Laplace(0, s) = s * (+/-1) * Exp(1)). The output
distribution is M_L's; the number of generator calls per client is two.

Floating point: like every Laplace mechanism on IEEE doubles, outputs are not exactly
continuous (Mironov, CCS 2012); the guarantee below is that of the ideal mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validation import check_clients, check_epsilon, check_generator, check_num_groups
from .randomized_response import _flip_to_other_group, grr_keep_probability
from .reports import PerturbedReports, ReportMoments, ReportSummary

#: The only noise-scale ratio for which M_L is LDP (Juarez and Korolova 2022, Theorem 6 is
#: false for every k != 2; see :func:`check_noise_ratio`).
LDP_NOISE_RATIO = 2.0


class UnboundedPrivacyLossError(ValueError):
    """Raised for M_L with a noise ratio k != 2: its privacy loss is unbounded."""


def check_noise_ratio(noise_ratio: float) -> float:
    """Refuse k != 2, explaining why (Juarez and Korolova 2022, Theorem 6 is false there)."""
    ratio = float(noise_ratio)
    if ratio != LDP_NOISE_RATIO:
        heavier = "kept" if ratio < LDP_NOISE_RATIO else "flipped"
        raise UnboundedPrivacyLossError(
            f"noise_ratio k must be 2 for M_L, got {noise_ratio!r}: a kept client's value gets "
            f"Lap(2/eps2) noise and a flipped client's gets Lap(k/eps2); with k != 2 the "
            f"{heavier} density has the heavier tail, so the likelihood ratio between a kept "
            "and a flipped input grows without bound as |v'| grows and no finite epsilon "
            "holds (the paper's Theorem 6 is false for every k != 2)."
        )
    return ratio


def laplace_epsilon(
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int = 2,
    noise_ratio: float = LDP_NOISE_RATIO,
) -> float:
    """The true LDP epsilon of M_L with k = 2: max(eps2, eps1 + eps2 / 2), any d >= 2.

    Juarez and Korolova 2022, Appendix A.2 (the proof there is only for k = 2, and it is
    right; the paper's Theorem 6 for general k is false). Raises
    :class:`UnboundedPrivacyLossError` for k != 2.

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Theorem 6 and Appendix A.2.
    """
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    check_num_groups(num_groups)
    check_noise_ratio(noise_ratio)
    return max(epsilon_value, epsilon_group + 0.5 * epsilon_value)


def laplace_noise_variance(epsilon_value: float, noise_ratio: float) -> float:
    """Variance 2 (k / eps2)^2 of Lap(k / eps2) (k = 2 for kept clients)."""
    return 2.0 * (noise_ratio / epsilon_value) ** 2


def laplace_report_moments(
    epsilon_group: float, epsilon_value: float, num_groups: int, noise_ratio: float
) -> ReportMoments:
    """Report moments of M_L for any k (also the paper's invalid ones, for formula checks)."""
    return ReportMoments(
        num_groups=num_groups,
        keep_probability=grr_keep_probability(epsilon_group, num_groups),
        value_gain=1.0,
        kept_second_moment=laplace_noise_variance(epsilon_value, LDP_NOISE_RATIO),
        kept_second_moment_slope=1.0,
        flipped_second_moment=laplace_noise_variance(epsilon_value, noise_ratio),
    )


@dataclass(frozen=True)
class LaplaceMechanism:
    """M_L with k = 2 for d >= 2 groups.

    Group step: GRR with eps1. Kept clients report v' = v + Lap(2/eps2); flipped clients
    report v' = 0 + Lap(k/eps2) with k = 2. Reports are float64.

    Parameters
    ----------
    epsilon_group, epsilon_value : float
        eps1 and eps2, both > 0.
    num_groups : int
        d >= 2.
    noise_ratio : float
        k; must be 2 (anything else raises :class:`UnboundedPrivacyLossError`).

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Section 4 (M_L) and Appendix A.2.
    """

    epsilon_group: float
    epsilon_value: float
    num_groups: int = 2
    noise_ratio: float = LDP_NOISE_RATIO

    name = "L"

    def __post_init__(self) -> None:
        check_epsilon("epsilon_group", self.epsilon_group)
        check_epsilon("epsilon_value", self.epsilon_value)
        check_num_groups(self.num_groups)
        check_noise_ratio(self.noise_ratio)

    @property
    def epsilon(self) -> float:
        """True LDP epsilon: max(eps2, eps1 + eps2 / 2)."""
        return laplace_epsilon(self.epsilon_group, self.epsilon_value, self.num_groups)

    @property
    def group_keep_probability(self) -> float:
        return grr_keep_probability(self.epsilon_group, self.num_groups)

    @property
    def noise_scale(self) -> float:
        """Laplace scale 2 / eps2 (the same for kept and flipped clients since k = 2)."""
        return LDP_NOISE_RATIO / self.epsilon_value

    @property
    def moments(self) -> ReportMoments:
        return laplace_report_moments(
            self.epsilon_group, self.epsilon_value, self.num_groups, self.noise_ratio
        )

    def is_valid_report_value(self, values: np.ndarray) -> np.ndarray:
        """Output domain check: any finite real number."""
        return np.isfinite(np.asarray(values, dtype=np.float64))

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each client's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1)."""
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        if self.num_groups == 2:
            in_group_one, out_values = self._perturb_two_groups(groups, values, rng)
            return PerturbedReports(in_group_one.astype(np.int64), out_values)
        a = self.group_keep_probability
        count = groups.shape[0]
        draws = rng.random(count)
        magnitudes = rng.standard_exponential(count)
        kept = draws < a
        other, flipped_positive = _flip_to_other_group(
            groups, (draws - a) / (1.0 - a), self.num_groups
        )
        positive = np.where(kept, draws < 0.5 * a, flipped_positive)
        out_groups = np.where(kept, groups, other)
        noise = self.noise_scale * np.where(positive, magnitudes, -magnitudes)
        out_values = np.where(kept, values, 0.0) + noise
        return PerturbedReports(out_groups.astype(np.int64, copy=False), out_values)

    def _perturb_two_groups(
        self, groups: np.ndarray, values: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """d = 2 kernel: (reported group is 1, reported value), few passes, in place.

        Sign of the noise: + on [0, a/2) (kept) and on [a, a + (1 - a)/2) (flipped), so
        it is - exactly where [u >= a/2] xor [u < a] xor [u < a + (1 - a)/2] holds.
        """
        a = self.group_keep_probability
        count = groups.shape[0]
        draws = rng.random(count)
        out_values = rng.standard_exponential(count)
        kept = draws < a
        negative = (draws >= 0.5 * a) ^ kept ^ (draws < a + 0.5 * (1.0 - a))
        # Masked ufuncs and np.where are ~20x slower than arithmetic on masks here.
        out_values *= self.noise_scale - (2.0 * self.noise_scale) * negative
        out_values += values * kept
        return (groups != 0) == kept, out_values

    def perturb_and_summarize(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> ReportSummary:
        """The summary of :meth:`perturb`'s reports (same draws), without keeping them.

        For d = 2 the per-group sums come from dot products instead of ``bincount``
        (the streaming fast path); they equal ``from_reports`` up to summation order.
        """
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        if self.num_groups != 2:
            reports = self.perturb(groups, values, rng, validate=False)
            return ReportSummary.from_reports(reports.groups, reports.values, self.num_groups)
        in_group_one, out_values = self._perturb_two_groups(groups, values, rng)
        one = in_group_one.astype(np.float64)
        total, squares = float(out_values.sum()), float(np.dot(out_values, out_values))
        sum_one = float(np.dot(out_values, one))
        squares_one = float(np.dot(out_values * out_values, one))
        count = groups.shape[0]
        reports_one = int(np.count_nonzero(in_group_one))
        return ReportSummary(
            count,
            np.array([count - reports_one, reports_one], dtype=np.int64),
            np.array([total - sum_one, sum_one]),
            np.array([squares - squares_one, squares_one]),
        )
