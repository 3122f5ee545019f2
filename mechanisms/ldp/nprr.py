"""NPRR: nonparametric randomized response on a grid, and the M_N gap mechanism built on it.

Ian Waudby-Smith, Zhiwei Steven Wu and Aaditya Ramdas, "Nonparametric extensions of randomized
response for private confidence sets", ICML 2023 (Waudby-Smith et al. 2023 below), Algorithm 1:
a value x in [0, 1] is rounded at random to one of the G + 1 grid points {0, 1/G, ..., 1}
(unbiased: up with probability frac(x G)), and the grid point is then reported as is with
probability r, else replaced by a uniform grid point; the value step is
eps2 = ln(1 + (G + 1) r / (1 - r))-LDP. That privatisation is generalized randomized response
over the G + 1 grid points (keep with p = r + (1 - r) / (G + 1), each other point with
q = (1 - r) / (G + 1), so r = p - q), and here it *is* the project's GRR frequency oracle
(:class:`~fedparity.mechanisms.ldp.frequency_oracle.FrequencyOracle`): every choice an integer
comparison on uniform 64-bit words or an exactly uniform bounded integer, its probabilities
integers out of 2^64 and its epsilon computed from them.

The gap mechanism M_N (for the LDP audit, beside M_R and M_L): GRR with eps1 on the group, the
same oracle; a user whose group is kept reports NPRR of its value, a user whose group is flipped
reports a uniform grid point (the value carries nothing; a uniform point is the distribution
that minimises the worst likelihood ratio against the kept reports, and its mean is the
centre, so the estimators of :mod:`~fedparity.mechanisms.ldp.estimators` apply unchanged). On
the audit's [-1, 1] scale a report is v' = 2 z / G - 1 for the grid index z. With G = 1 the
mechanism is M_R (Juarez and Korolova 2022, Algorithm 1) with an exact integer sampler.

Privacy, from the realised probabilities. With a and q_g the group oracle's realised keep and
per-other-group probabilities and p, q the value oracle's, an output (g', z) has probability
a P(z | y) when g' is the user's group (P(z | y) = p for z = y, else q) and q_g / (G + 1)
otherwise. The worst likelihood ratio over inputs and outputs is

    e^eps = max(p / q, (G + 1) a p / q_g, q_g / ((G + 1) a q)),

(two users of one group; a kept report against a flipped one, either way round), which
:attr:`NPRRMechanism.epsilon` computes exactly from the integers (ideal values:
max(eps2, eps1 + ln((G + 1) e^eps2 / (e^eps2 + G)), ln((e^eps2 + G) / (G + 1)) - eps1), which
for G = 1 is M_R's true epsilon). A value between grid points is a mixture of its two
neighbours' output distributions, so the grid inputs are the worst case and
:meth:`NPRRMechanism.exact_output_distribution` enumerates them (``tests/test_nprr.py`` checks
the ratio). The rounding compares a 64-bit word with floor(frac(x G) 2^64): its bias is below
2^-64 plus the rounding of the double x G (about 2^-52 G), far below any standard error.

References
----------
.. [1] I. Waudby-Smith, Z. S. Wu and A. Ramdas, "Nonparametric extensions of randomized
       response for private confidence sets", ICML 2023. Algorithm 1 (NPRR).
.. [2] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring
       Demographic Performance Disparities in Federated Learning", Workshop on Algorithmic
       Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022. Algorithm 1 (M_R).
.. [3] T. Wang, J. Blocki, N. Li and S. Jha, "Locally differentially private protocols for
       frequency estimation", USENIX Security Symposium, 2017 (GRR).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Literal

import numpy as np

from ..validation import (
    MAX_GROUPS,
    check_clients,
    check_epsilon,
    check_generator,
    check_group_fractions,
    check_int,
    check_num_groups,
)
from .discrete_laplace import uniform_words
from .frequency_oracle import TWO_64, FrequencyOracle
from .reports import GroupValueMechanism, PerturbedReports, ReportMoments

__all__ = [
    "GRID_SIZES",
    "NPRRMechanism",
    "nprr_epsilon",
    "nprr_for_budget",
    "nprr_report_moments",
]

#: The grid sizes G that :func:`nprr_for_budget` tries when none is given.
GRID_SIZES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: The largest grid (the value oracle has G + 1 categories, at most MAX_GROUPS).
MAX_GRID_SIZE = MAX_GROUPS - 1


def _check_grid_size(grid_size: int) -> int:
    return check_int("grid_size", grid_size, minimum=1, maximum=MAX_GRID_SIZE)


def nprr_epsilon(
    epsilon_group: float, epsilon_value: float, num_groups: int = 2, grid_size: int = 1
) -> float:
    """The ideal LDP epsilon of M_N (GRR with eps1 on the group, NPRR with eps2 on the value,
    a uniform grid point for a flipped group):
    max(eps2, eps1 + ln((G + 1) e^eps2 / (e^eps2 + G)), ln((e^eps2 + G) / (G + 1)) - eps1).

    For planning; :attr:`NPRRMechanism.epsilon` is the realised one (at most this). With G = 1
    it is M_R's true epsilon.

    >>> round(nprr_epsilon(1.0, 1.0, 2, 1), 4)
    1.3799
    """
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    check_num_groups(num_groups)
    grid = _check_grid_size(grid_size)
    # ln((G + 1) e^eps2 / (e^eps2 + G)) = ln(G + 1) - ln(1 + G e^-eps2)
    kept_against_flipped = math.log(grid + 1.0) - math.log1p(grid * math.exp(-epsilon_value))
    flipped_against_kept = float(np.logaddexp(epsilon_value, math.log(grid))) - math.log(grid + 1)
    return max(
        epsilon_value,
        epsilon_group + kept_against_flipped,
        flipped_against_kept - epsilon_group,
    )


def nprr_report_moments(
    epsilon_group: float, epsilon_value: float, num_groups: int = 2, grid_size: int = 1
) -> ReportMoments:
    """Report moments of the ideal M_N (see :meth:`NPRRMechanism.moments`), for planning."""
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    num_groups = check_num_groups(num_groups)
    grid = _check_grid_size(grid_size)
    keep = 1.0 / (1.0 + (num_groups - 1) * math.exp(-epsilon_group))
    # r = (e^eps2 - 1) / (e^eps2 + G), finite for large eps2
    r = -math.expm1(-epsilon_value) / (1.0 + grid * math.exp(-epsilon_value))
    return _moments(num_groups, keep, r, grid)


def _moments(num_groups: int, keep: float, r: float, grid: int) -> ReportMoments:
    """E[v'^2 | flipped] = (G + 2) / (3 G) (a uniform grid point); kept:
    r (v^2 + rounding variance) + (1 - r) (G + 2) / (3 G), the rounding variance
    4 f (1 - f) / G^2 taken at its bound 1 / G^2, except for G = 1 where it is 1 - v^2
    exactly (E[v'^2] = 1)."""
    uniform = (grid + 2.0) / (3.0 * grid)
    if grid == 1:
        kept, slope = 1.0, 0.0
    else:
        kept, slope = (1.0 - r) * uniform + r / grid**2, r
    return ReportMoments(
        num_groups=num_groups,
        keep_probability=keep,
        value_gain=r,
        kept_second_moment=kept,
        kept_second_moment_slope=slope,
        flipped_second_moment=uniform,
    )


@dataclass(frozen=True)
class NPRRMechanism(GroupValueMechanism):
    """M_N: GRR with eps1 on the group, NPRR (Waudby-Smith et al. 2023, Algorithm 1) with eps2
    on the value over a grid of ``grid_size`` + 1 points, a uniform grid point for a flipped
    group. Reports are float64 values ``2 z / G - 1`` in [-1, 1] (z the grid index).

    Parameters
    ----------
    epsilon_group, epsilon_value : float
        The targets of the two oracles (eps1, eps2 > 0); the realised ones are at most these.
    num_groups : int
        d >= 2.
    grid_size : int
        G >= 1, the grid's steps (G = 1: M_R with an exact sampler).

    :attr:`epsilon` is the realised guarantee of the whole report, computed from the oracles'
    integer thresholds. Build one for a total budget with :func:`nprr_for_budget`.
    """

    grid_size: int = 1

    name: ClassVar[Literal["N"]] = "N"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_grid_size(self.grid_size)
        self.group_oracle  # noqa: B018 - refuses an epsilon below the sampler's resolution
        self.value_oracle  # noqa: B018

    # ---- the two oracles and their realised probabilities ------------------------------

    @property
    def group_oracle(self) -> FrequencyOracle:
        """GRR over the d groups at eps1."""
        return FrequencyOracle("grr", float(self.epsilon_group), self.num_groups, 1)

    @property
    def value_oracle(self) -> FrequencyOracle:
        """GRR over the G + 1 grid points at eps2: NPRR's privatisation step."""
        return FrequencyOracle("grr", float(self.epsilon_value), self.grid_size + 1, 1)

    def exact_probabilities(self) -> tuple[Fraction, Fraction, Fraction, Fraction]:
        """(a, q_g, p, q) as exact fractions: the group kept, a given other group, the grid
        point kept, a given other grid point (each an integer out of 2^64, or its share)."""
        group = Fraction(self.group_oracle.threshold, TWO_64)
        value = Fraction(self.value_oracle.threshold, TWO_64)
        return (
            group,
            (1 - group) / (self.num_groups - 1),
            value,
            (1 - value) / self.grid_size,
        )

    @property
    def report_keep_probability(self) -> float:
        """r = p - q: NPRR's probability of reporting the rounded value as is (realised)."""
        _, _, p, q = self.exact_probabilities()
        return float(p - q)

    def _worst_ratio(self) -> Fraction:
        a, flip, p, q = self.exact_probabilities()
        points = self.grid_size + 1
        return max(p / q, points * a * p / flip, flip / (points * a * q))

    @property
    def epsilon(self) -> float:
        """The realised LDP epsilon of the whole report (g', z): the log of
        max(p / q, (G + 1) a p / q_g, q_g / ((G + 1) a q)) from the exact fractions."""
        ratio = self._worst_ratio()
        numerator, denominator = ratio.numerator, ratio.denominator
        return math.log1p((numerator - denominator) / denominator)

    @property
    def ideal_epsilon(self) -> float:
        """:func:`nprr_epsilon` of the targets (the realised :attr:`epsilon` is at most it)."""
        return nprr_epsilon(self.epsilon_group, self.epsilon_value, self.num_groups, self.grid_size)

    @property
    def moments(self) -> ReportMoments:
        """Report moments with the realised probabilities: gain r, flipped second moment
        (G + 2) / (3 G), kept ones as :func:`nprr_report_moments` says."""
        a, _, _, _ = self.exact_probabilities()
        return _moments(self.num_groups, float(a), self.report_keep_probability, self.grid_size)

    # ---- the output distribution ------------------------------------------------------

    def exact_output_distribution(
        self, group: int, grid_value: int
    ) -> dict[tuple[int, int], Fraction]:
        """P((g', z) | group, value = grid_value / G) of the realised sampler, exact, for every
        output (d (G + 1) of them); for checking the privacy guarantee."""
        group = check_int("group", group, minimum=0, maximum=self.num_groups - 1)
        grid_value = check_int("grid_value", grid_value, minimum=0, maximum=self.grid_size)
        a, flip, p, q = self.exact_probabilities()
        points = self.grid_size + 1
        table = {}
        for reported in range(self.num_groups):
            for z in range(points):
                if reported == group:
                    table[(reported, z)] = a * (p if z == grid_value else q)
                else:
                    table[(reported, z)] = flip / points
        return table

    def is_valid_report_value(self, values: np.ndarray) -> np.ndarray:
        """Output domain check: exactly the float64 ``z * (2 / G) - 1`` :meth:`perturb` sends,
        for an integer z in [0, G]."""
        array = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(array) & (np.abs(array) <= 1.0)
            index = np.rint(np.where(finite, array + 1.0, 0.0) * (self.grid_size / 2.0))
            return finite & (index * (2.0 / self.grid_size) - 1.0 == array)

    def grid_index(self, values: np.ndarray) -> np.ndarray:
        """z = round((v' + 1) G / 2): a report's grid index (``int64``)."""
        array = np.asarray(values, dtype=np.float64)
        return np.rint((array + 1.0) * (self.grid_size / 2.0)).astype(np.int64)

    # ---- sampling -----------------------------------------------------------------------

    def perturb_indices(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(reported group, grid index z) of each user; ``values`` on the [-1, 1] scale."""
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        groups = np.asarray(groups, dtype=np.int64)
        grid = self.grid_size
        scaled = (np.asarray(values, dtype=np.float64) + 1.0) * (grid / 2.0)
        np.clip(scaled, 0.0, float(grid), out=scaled)
        lower = np.floor(scaled)
        # up with probability floor(frac 2^64) / 2^64: frac * 2^64 < 2^64 is exact in float64
        thresholds = ((scaled - lower) * 2.0**64).astype(np.uint64)
        rounded = lower.astype(np.int64) + (uniform_words(rng, groups.shape[0]) < thresholds)
        np.minimum(rounded, grid, out=rounded)
        reported = self.group_oracle.perturb(groups, rng)
        kept_value = self.value_oracle.perturb(rounded, rng)
        uniform = rng.integers(0, grid + 1, size=groups.shape[0])  # Lemire: exactly uniform
        return reported, np.where(reported == groups, kept_value, uniform).astype(np.int64)

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each user's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1)."""
        reported, index = self.perturb_indices(groups, values, rng, validate=validate)
        return PerturbedReports(reported, index * (2.0 / self.grid_size) - 1.0)


def _group_epsilon(budget: float, epsilon_value: float, grid: int) -> float:
    """eps1 on the boundary: budget - ln((G + 1) e^eps2 / (e^eps2 + G)) (> budget - eps2)."""
    return budget - (math.log(grid + 1.0) - math.log1p(grid * math.exp(-epsilon_value)))


def _best_share(
    budget: float, num_groups: int, grid: int, fractions: np.ndarray
) -> tuple[float, float]:
    """(eps2 / budget, variance factor) minimising the worst-case gap variance for grid G."""
    from .calibration import gap_variance_factor  # here: calibration imports this module

    def objective(share: float) -> float:
        epsilon_value = share * budget
        epsilon_group = _group_epsilon(budget, epsilon_value, grid)
        moments = nprr_report_moments(epsilon_group, epsilon_value, num_groups, grid)
        return gap_variance_factor(moments, fractions)

    shares = np.linspace(1e-3, 1.0, 64)
    values = np.array([objective(float(s)) for s in shares])
    best = int(np.argmin(values))
    share, value = float(shares[best]), float(values[best])
    low, high = shares[max(best - 1, 0)], shares[min(best + 1, shares.size - 1)]
    from scipy import optimize  # here, not at the top: a node's process starts faster

    refined = optimize.minimize_scalar(
        objective, bounds=(low, high), method="bounded", options={"xatol": 1e-9}
    )
    if refined.success and refined.fun < value:
        share, value = float(refined.x), float(refined.fun)
    return share, value


def nprr_for_budget(
    budget: float,
    num_groups: int = 2,
    group_fractions: Sequence[float] | np.ndarray | None = None,
    *,
    grid_size: int | None = None,
) -> NPRRMechanism:
    """The M_N whose realised epsilon is at most ``budget``, with the (eps1, eps2) split and
    grid (one of :data:`GRID_SIZES` unless ``grid_size`` is given) that minimise the
    worst-case variance of the largest gap estimator (known sizes, ``group_fractions``, equal
    by default), as :func:`~fedparity.mechanisms.ldp.calibration.optimal_split` does for M_R
    and M_L.

    >>> mechanism = nprr_for_budget(1.0)
    >>> mechanism.epsilon <= 1.0, mechanism.grid_size
    (True, 1)
    """
    budget = check_epsilon("budget", budget)
    num_groups = check_num_groups(num_groups)
    fractions = check_group_fractions(group_fractions, num_groups)
    grids = GRID_SIZES if grid_size is None else (_check_grid_size(grid_size),)
    choices = [(_best_share(budget, num_groups, g, fractions), g) for g in grids]
    (share, _), grid = min(choices, key=lambda choice: choice[0][1])
    epsilon_value = share * budget
    epsilon_group = _group_epsilon(budget, epsilon_value, grid)
    for step in range(64):
        mechanism = NPRRMechanism(epsilon_group, epsilon_value, num_groups, grid)
        if mechanism.epsilon <= budget:
            return mechanism
        shrink = 1.0 - 2.0**-50 * 2.0**step  # the oracles' rounding, then a larger margin
        epsilon_group *= shrink
        epsilon_value *= shrink
    raise RuntimeError("could not fit M_N inside the budget")  # pragma: no cover
