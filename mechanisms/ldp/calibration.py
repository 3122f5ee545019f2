"""Split a total LDP budget into (eps1, eps2) so that the true epsilon fits the budget.

The allocations of Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't
Measure': Privately Measuring Demographic Performance Disparities in Federated Learning", AFCP
workshop, PMLR, 2022 (eps1 = eps2 = eps for M_R; k = eps for M_L) are not eps-LDP: the paper's
Theorem 5 is false and its Theorem 6 holds only for k = 2 (:func:`true_epsilon` computes the
true epsilon). Here the split is re-derived: the true epsilon is tight on the budget along a
one-parameter curve, and the point on it that minimises the worst-case variance of the gap
estimator is found numerically:

* M_R: eps = max(eps2, eps1 + ln(2 e^eps2 / (1 + e^eps2))) (the third term of the true
  epsilon, ln((1 + e^eps2) / 2) - eps1 in
  :func:`~fedparity.mechanisms.ldp.randomized_response.randomized_response_epsilon`, is always
  below eps2), so eps1 = eps - ln(2 b(eps2)) for eps2 in (0, eps].
* M_L (k = 2): eps = max(eps2, eps1 + eps2 / 2), so eps1 = eps - eps2 / 2 for eps2 in (0, eps].
* M_P (the Piecewise mechanism on the value, :mod:`~fedparity.mechanisms.ldp.piecewise`):
  M_L's true epsilon and split.
* M_N (NPRR on the value over a grid of G + 1 points, :mod:`~fedparity.mechanisms.ldp.nprr`):
  the split and the grid G of :func:`~fedparity.mechanisms.ldp.nprr.nprr_for_budget`
  (eps1 = eps - ln((G + 1) e^eps2 / (e^eps2 + G)), the best of its grids).

The objective is K * Var of the largest pairwise gap at the worst-case spread of values
(sum of v^2 at 0 for M_R, at n_G for M_L) with group sizes K * fraction; it does not depend
on K, so one split serves every population size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..validation import check_choice, check_epsilon, check_group_fractions, check_num_groups
from .estimators import estimator_covariance, worst_case_square_sums
from .laplace import MAX_EPSILON_VALUE, MIN_EPSILON_VALUE, LaplaceMechanism, laplace_epsilon
from .nprr import NPRRMechanism, nprr_epsilon, nprr_for_budget
from .piecewise import MAX_EPSILON_VALUE as MAX_PIECEWISE_EPSILON_VALUE
from .piecewise import MIN_EPSILON_VALUE as MIN_PIECEWISE_EPSILON_VALUE
from .piecewise import PiecewiseMechanism, piecewise_epsilon
from .randomized_response import RandomizedResponseMechanism, randomized_response_epsilon
from .reports import ReportMoments

MechanismName = Literal["R", "L", "P", "N"]
MechanismChoice = Literal["R", "L", "P", "N", "best"]
MECHANISMS: tuple[MechanismName, ...] = ("R", "L", "P", "N")
GapMechanismType = (
    RandomizedResponseMechanism | LaplaceMechanism | PiecewiseMechanism | NPRRMechanism
)
#: Two variances within this relative distance are a tie, which "best" breaks in the order of
#: :data:`MECHANISMS` (M_N with G = 1 is M_R: the rounding of their samplers decides nothing).
TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class _GapMechanism:
    """What the split, the planner and "best" need of one mechanism."""

    build: Callable[[float, float, int, int], GapMechanismType]
    epsilon: Callable[[float, float, int, int], float]
    #: The eps2 for which its sampler releases reports (M_L and M_P: their grids' ranges).
    value_range: tuple[float, float]


_REGISTRY: dict[MechanismName, _GapMechanism] = {
    "R": _GapMechanism(
        lambda e1, e2, d, _: RandomizedResponseMechanism(e1, e2, d),
        lambda e1, e2, d, _: randomized_response_epsilon(e1, e2, d),
        (0.0, math.inf),
    ),
    "L": _GapMechanism(
        lambda e1, e2, d, _: LaplaceMechanism(e1, e2, d),
        lambda e1, e2, d, _: laplace_epsilon(e1, e2, d),
        (MIN_EPSILON_VALUE, MAX_EPSILON_VALUE),
    ),
    "P": _GapMechanism(
        lambda e1, e2, d, _: PiecewiseMechanism(e1, e2, d),
        lambda e1, e2, d, _: piecewise_epsilon(e1, e2, d),
        (MIN_PIECEWISE_EPSILON_VALUE, MAX_PIECEWISE_EPSILON_VALUE),
    ),
    "N": _GapMechanism(NPRRMechanism, nprr_epsilon, (0.0, math.inf)),
}


def _check_grid_size(name: MechanismName, grid_size: int) -> None:
    if name != "N" and grid_size != 1:
        raise ValueError(
            f"grid_size applies only to mechanism N (M_{name} has none), got {grid_size!r}"
        )


def build_mechanism(
    name: MechanismName,
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int = 2,
    grid_size: int = 1,
) -> GapMechanismType:
    """The mechanism object for explicit (eps1, eps2) (and M_N's grid G, ``grid_size``)."""
    check_choice("mechanism", name, MECHANISMS)
    _check_grid_size(name, grid_size)
    return _REGISTRY[name].build(epsilon_group, epsilon_value, num_groups, grid_size)


def true_epsilon(
    name: MechanismName,
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int = 2,
    grid_size: int = 1,
) -> float:
    """True LDP epsilon of M_R, M_L (k = 2), M_P or M_N (grid ``grid_size``) for (eps1, eps2,
    d).

    Not the paper's claims: its Theorem 5 (M_R is max(eps1, eps2)-LDP) is false, and its
    Theorem 6 (M_L) is false for every noise ratio k != 2. M_R:
    :func:`~fedparity.mechanisms.ldp.randomized_response.randomized_response_epsilon`; M_L:
    :func:`~fedparity.mechanisms.ldp.laplace.laplace_epsilon`, which explain the corrections;
    M_P: :func:`~fedparity.mechanisms.ldp.piecewise.piecewise_epsilon`; M_N:
    :func:`~fedparity.mechanisms.ldp.nprr.nprr_epsilon` (the ideal one; a built M_N's
    realised epsilon is at most it).

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Theorems 5 and 6, Appendices A.1 and A.2.
    """
    check_choice("mechanism", name, MECHANISMS)
    _check_grid_size(name, grid_size)
    return _REGISTRY[name].epsilon(epsilon_group, epsilon_value, num_groups, grid_size)


def gap_variance_factor(moments: ReportMoments, group_fractions: np.ndarray) -> float:
    """K * Var (value units) of the largest pairwise gap, worst case over values, known sizes."""
    fractions = np.asarray(group_fractions, dtype=np.float64)
    cov = estimator_covariance(
        moments,
        1.0,
        fractions,
        np.zeros_like(fractions),
        worst_case_square_sums(moments, fractions),
        sizes_known=True,
    )
    variances = np.sort(np.diag(cov))
    return float(variances[-1] + variances[-2])


@dataclass(frozen=True)
class BudgetSplit:
    """A budget split and what it achieves.

    Attributes
    ----------
    mechanism : {"R", "L", "P", "N"}
    budget : float
        The operator's total budget.
    epsilon_group, epsilon_value : float
        eps1 and eps2.
    epsilon : float
        The true LDP epsilon of (eps1, eps2) -- always <= budget.
    variance_factor : float
        K * worst-case variance of the largest gap estimator (value units, known sizes).
    grid_size : int
        M_N's grid G (1 for the others).
    """

    mechanism: MechanismName
    budget: float
    epsilon_group: float
    epsilon_value: float
    epsilon: float
    num_groups: int
    variance_factor: float
    grid_size: int = 1

    @property
    def value_range(self) -> tuple[float, float]:
        """The eps2 for which the mechanism's sampler releases reports (M_L and M_P: their
        grids' ranges; M_R and M_N: any)."""
        return _REGISTRY[self.mechanism].value_range

    @property
    def releasable(self) -> bool:
        """Whether its sampler releases reports at this eps2 (:attr:`value_range`)."""
        low, high = self.value_range
        return low <= self.epsilon_value <= high

    def build(self) -> GapMechanismType:
        return build_mechanism(
            self.mechanism,
            self.epsilon_group,
            self.epsilon_value,
            self.num_groups,
            self.grid_size,
        )


def _group_epsilon_on_boundary(name: MechanismName, budget: float, epsilon_value: float) -> float:
    if name == "R":
        log_two_b = math.log(2.0) - math.log1p(math.exp(-epsilon_value))
        return budget - log_two_b
    return budget - 0.5 * epsilon_value  # M_L and M_P


def _fit_to_budget(
    name: MechanismName, budget: float, epsilon_group: float, epsilon_value: float, d: int
) -> float:
    """Shave eps1 by rounding error until the true epsilon is <= budget."""
    for _ in range(64):
        if true_epsilon(name, epsilon_group, epsilon_value, d) <= budget:
            return epsilon_group
        epsilon_group = math.nextafter(epsilon_group, 0.0) * (1.0 - 1e-15)
    raise RuntimeError("could not fit the split inside the budget")  # pragma: no cover


def optimal_split(
    mechanism: MechanismName,
    budget: float,
    num_groups: int = 2,
    group_fractions: Sequence[float] | np.ndarray | None = None,
) -> BudgetSplit:
    """The (eps1, eps2) with true epsilon <= ``budget`` minimising the worst-case gap variance.

    Parameters
    ----------
    mechanism : {"R", "L", "P", "N"}
    budget : float
        Total LDP budget eps > 0.
    num_groups : int
        d >= 2.
    group_fractions : sequence of float, optional
        Expected share of each group (default: equal); only the objective depends on it.
    """
    check_choice("mechanism", mechanism, MECHANISMS)
    budget = check_epsilon("budget", budget)
    num_groups = check_num_groups(num_groups)
    fractions = check_group_fractions(group_fractions, num_groups)
    return _optimal_split(mechanism, budget, num_groups, tuple(fractions.tolist()))


def optimal_variance_factor(
    mechanism: MechanismName,
    budget: float,
    num_groups: int = 2,
    group_fractions: Sequence[float] | np.ndarray | None = None,
) -> float:
    """``variance_factor`` of :func:`optimal_split` without building the released mechanism's
    noise table (for M_L, the realised epsilon of :attr:`BudgetSplit.epsilon` builds its sampler,
    about 0.1 s): what a planner's search over budgets needs."""
    check_choice("mechanism", mechanism, MECHANISMS)
    budget = check_epsilon("budget", budget)
    num_groups = check_num_groups(num_groups)
    fractions = check_group_fractions(group_fractions, num_groups)
    return _optimal_allocation(mechanism, budget, num_groups, tuple(fractions.tolist()))[2]


@functools.lru_cache(maxsize=4096)
def _optimal_split(
    mechanism: MechanismName, budget: float, num_groups: int, fractions: tuple[float, ...]
) -> BudgetSplit:
    epsilon_group, epsilon_value, variance_factor, grid_size = _optimal_allocation(
        mechanism, budget, num_groups, fractions
    )
    built = build_mechanism(mechanism, epsilon_group, epsilon_value, num_groups, grid_size)
    return BudgetSplit(
        mechanism=mechanism,
        budget=budget,
        epsilon_group=epsilon_group,
        epsilon_value=epsilon_value,
        epsilon=built.epsilon,
        num_groups=num_groups,
        variance_factor=variance_factor,
        grid_size=grid_size,
    )


@functools.lru_cache(maxsize=4096)
def _optimal_allocation(
    mechanism: MechanismName, budget: float, num_groups: int, fractions: tuple[float, ...]
) -> tuple[float, float, float, int]:
    """(eps1, eps2, variance factor, grid) of the split minimising the worst-case gap
    variance (the grid: M_N's G, 1 for the others)."""
    if mechanism == "N":
        nprr = nprr_for_budget(budget, num_groups, np.asarray(fractions))
        variance = gap_variance_factor(nprr.moments, np.asarray(fractions))
        return nprr.epsilon_group, nprr.epsilon_value, variance, nprr.grid_size

    def objective(share: float) -> float:
        epsilon_value = share * budget
        epsilon_group = _group_epsilon_on_boundary(mechanism, budget, epsilon_value)
        moments = build_mechanism(mechanism, epsilon_group, epsilon_value, num_groups).moments
        return gap_variance_factor(moments, np.asarray(fractions))

    low, high = 1e-3, 1.0
    if mechanism == "P" and budget >= MIN_PIECEWISE_EPSILON_VALUE:
        # M_P's eps2 stays in its sampler's range: above it, the rest goes to eps1
        low = max(low, MIN_PIECEWISE_EPSILON_VALUE / budget)
        high = min(high, MAX_PIECEWISE_EPSILON_VALUE / budget * (1.0 - 1e-12))
    grid = np.linspace(low, high, 64)
    values = np.array([objective(s) for s in grid])
    best = int(np.argmin(values))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    share, value = float(grid[best]), float(values[best])
    if high > low:
        from scipy import optimize  # here, not at the top: a node's process starts faster

        refined = optimize.minimize_scalar(
            objective, bounds=(low, high), method="bounded", options={"xatol": 1e-10}
        )
        if refined.success and refined.fun < value:
            share, value = float(refined.x), float(refined.fun)
    epsilon_value = share * budget
    epsilon_group = _fit_to_budget(
        mechanism,
        budget,
        _group_epsilon_on_boundary(mechanism, budget, epsilon_value),
        epsilon_value,
        num_groups,
    )
    built = build_mechanism(mechanism, epsilon_group, epsilon_value, num_groups)
    return (
        epsilon_group,
        epsilon_value,
        gap_variance_factor(built.moments, np.asarray(fractions)),
        1,
    )


def best_split(
    mechanism: MechanismChoice,
    budget: float,
    num_groups: int = 2,
    group_fractions: Sequence[float] | np.ndarray | None = None,
) -> BudgetSplit:
    """:func:`optimal_split` for "R", "L", "P" or "N"; for "best", the one with the smallest
    variance (the narrowest interval) among those that can release (M_L and M_P only for eps2
    in their grid samplers' ranges); a tie (:data:`TIE_TOLERANCE`) goes to the first in
    :data:`MECHANISMS`."""
    check_choice("mechanism", mechanism, (*MECHANISMS, "best"))
    if mechanism != "best":
        return optimal_split(mechanism, budget, num_groups, group_fractions)
    candidates = [optimal_split(name, budget, num_groups, group_fractions) for name in MECHANISMS]
    # M_R always releases: outside the others' ranges it is the choice
    releasable = [split for split in candidates if split.releasable]
    smallest = min(split.variance_factor for split in releasable)
    return next(
        split for split in releasable if split.variance_factor <= smallest * (1.0 + TIE_TOLERANCE)
    )


def mechanism_for_budget(
    mechanism: MechanismChoice,
    budget: float,
    num_groups: int = 2,
    group_fractions: Sequence[float] | None = None,
) -> GapMechanismType:
    """A mechanism whose true epsilon is <= ``budget``, with the variance-optimal split."""
    return best_split(mechanism, budget, num_groups, group_fractions).build()
