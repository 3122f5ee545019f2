"""Planning an audit: the budget needed for an error target, or the error at a budget.

Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022,
Section 5 ("Precision relative to the number of clients", Table 1): the gap estimator's
variance bound Var(K, ratio, eps) and Chebyshev's inequality give the error alpha that holds
with probability ``confidence``: alpha = sqrt(Var / (1 - confidence)). Here the same is
done for the *valid* mechanisms (true epsilon <= budget, with the true epsilon of
:func:`~fedparity.mechanisms.ldp.calibration.true_epsilon`, not the paper's Theorems 5 and 6,
which are false) and, as a tighter option, with the normal approximation
alpha = z * sqrt(Var).

Scales: ``scale="metric"`` (default) measures errors in metric units (m in [0, 1]);
``scale="value"`` on the paper's v = 2 m - 1 scale, as in its Table 1 (twice as large).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..validation import (
    check_choice,
    check_epsilon,
    check_int_at_least,
    check_num_groups,
    check_open_unit,
    check_positive_finite,
)
from .calibration import (
    MECHANISMS,
    TIE_TOLERANCE,
    BudgetSplit,
    MechanismChoice,
    MechanismName,
    best_split,
    gap_variance_factor,
    optimal_split,
    optimal_variance_factor,
)
from .estimators import normal_quantile
from .laplace import laplace_report_moments
from .randomized_response import RandomizedResponseMechanism
from .reports import ReportMoments

BoundName = Literal["chebyshev", "normal"]
Scale = Literal["metric", "value"]

#: Search range for budgets (the paper's Table 1 reaches 178.89).
MIN_PLANNED_EPSILON = 1e-6
MAX_PLANNED_EPSILON = 1e4
#: Most clients a plan is made for (beyond it the planner's floats lose the count).
MAX_PLANNED_CLIENTS = 10**12
#: Range of the group-size ratio n_A / n_B a plan accepts (a group of 1e-6 of the population).
MIN_GROUP_RATIO = 1e-6
MAX_GROUP_RATIO = 1e6
#: The largest possible gap between two group means, per scale (metric in [0, 1], value in
#: [-1, 1]): an error bound at least this large says nothing (vacuous).
MAX_GAP = {"metric": 1.0, "value": 2.0}
#: The mechanisms of the paper's Table 1 (M_P is not in it).
PAPER_MECHANISMS: tuple[MechanismName, ...] = ("R", "L")


def group_fractions_from_ratio(group_ratio: float, num_groups: int = 2) -> np.ndarray:
    """Fractions of K for groups whose sizes are in ``ratio : 1 : ... : 1``.

    ``group_ratio`` is n_A / n_B for the first group against each other group (the paper's
    g = n / (K - n) for d = 2; 1 means balanced).
    """
    ratio = check_positive_finite("group_ratio", group_ratio)
    weights = np.ones(num_groups)
    weights[0] = ratio
    return weights / weights.sum()


def _error_from_variance(
    variance: float, confidence: float, bound: BoundName, scale: Scale
) -> float:
    if bound == "chebyshev":
        error = math.sqrt(variance / (1.0 - confidence))
    else:
        error = normal_quantile(confidence) * math.sqrt(variance)
    return error if scale == "value" else error / 2.0


@dataclass(frozen=True)
class PlanResult:
    """One planner answer.

    Attributes
    ----------
    mechanism : {"R", "L", "P"}
        The mechanism (for ``best``, the one chosen).
    num_clients, confidence, group_ratio, bound, scale
        The question asked.
    epsilon : float or None
        The minimum total budget (None where no budget reaches ``alpha``).
    alpha : float
        The error target, or, for an error question, the error bound at the budget.
    split : BudgetSplit or None
        The (eps1, eps2) split used (true epsilon <= budget).
    """

    @property
    def vacuous(self) -> bool:
        """The error bound is at least the largest possible gap (:data:`MAX_GAP`): it says
        nothing about the gap."""
        return self.alpha >= MAX_GAP[self.scale]

    @property
    def at_search_limit(self) -> bool:
        """The minimum budget is the search's lower limit (:data:`MIN_PLANNED_EPSILON`): any
        budget down to it reaches the target, and a smaller one may too."""
        return self.epsilon is not None and self.epsilon <= MIN_PLANNED_EPSILON

    mechanism: MechanismName
    num_clients: int
    confidence: float
    group_ratio: float
    bound: BoundName
    scale: Scale
    alpha: float
    epsilon: float | None
    split: BudgetSplit | None

    def to_dict(self) -> dict[str, object]:
        split = self.split
        fields: dict[str, object] = {
            "mechanism": self.mechanism,
            "num_clients": self.num_clients,
            "confidence": self.confidence,
            "group_ratio": self.group_ratio,
            "bound": self.bound,
            "scale": self.scale,
            "alpha": self.alpha,
            "epsilon": self.epsilon,
            "epsilon_group": None if split is None else split.epsilon_group,
            "epsilon_value": None if split is None else split.epsilon_value,
            "true_epsilon": None if split is None else split.epsilon,
            "vacuous": self.vacuous,
            "at_search_limit": self.at_search_limit,
        }
        if self.mechanism == "N" and split is not None:
            fields["grid_size"] = split.grid_size  # M_N's epsilon depends on its grid
        return fields


def _check_plan_args(
    num_clients: int, confidence: float, bound: str, scale: str, num_groups: int
) -> tuple[int, float]:
    num_groups = check_num_groups(num_groups)
    num_clients = check_int_at_least("num_clients", num_clients, 1)
    if num_clients < num_groups:
        raise ValueError(
            f"num_clients (K = {num_clients}) must be at least the number of groups ({num_groups})"
        )
    confidence = check_open_unit("confidence", confidence)
    check_choice("bound", bound, ("chebyshev", "normal"))
    check_choice("scale", scale, ("metric", "value"))
    return num_clients, confidence


def error_bound(
    mechanism: MechanismChoice,
    num_clients: int,
    epsilon: float,
    *,
    confidence: float = 0.99,
    group_ratio: float = 1.0,
    num_groups: int = 2,
    bound: BoundName = "chebyshev",
    scale: Scale = "metric",
) -> PlanResult:
    """Error alpha of the gap estimate that holds with probability ``confidence`` at a budget.

    Worst case over the values (known group sizes); ``best`` picks the smaller error.
    """
    num_clients, confidence = _check_plan_args(num_clients, confidence, bound, scale, num_groups)
    epsilon = check_epsilon("epsilon", epsilon)
    fractions = group_fractions_from_ratio(group_ratio, num_groups)
    split = best_split(mechanism, epsilon, num_groups, fractions)
    variance = split.variance_factor / num_clients
    return PlanResult(
        mechanism=split.mechanism,
        num_clients=num_clients,
        confidence=confidence,
        group_ratio=float(group_ratio),
        bound=bound,
        scale=scale,
        alpha=_error_from_variance(variance, confidence, bound, scale),
        epsilon=epsilon,
        split=split,
    )


def _smallest_epsilon(error_at: Callable[[float], float], alpha: float) -> float | None:
    """Smallest eps in [MIN, MAX] with error_at(eps) <= alpha (error decreasing in eps)."""
    grid = np.geomspace(MIN_PLANNED_EPSILON, MAX_PLANNED_EPSILON, 121)
    below = None
    for index, candidate in enumerate(grid):
        if error_at(float(candidate)) <= alpha:
            below = index
            break
    if below is None:
        return None
    if below == 0:
        return float(grid[0])
    low, high = math.log(grid[below - 1]), math.log(grid[below])
    for _ in range(45):
        middle = 0.5 * (low + high)
        if error_at(math.exp(middle)) <= alpha:
            high = middle
        else:
            low = middle
    return math.exp(high)


def minimum_epsilon(
    mechanism: MechanismChoice,
    num_clients: int,
    alpha: float,
    *,
    confidence: float = 0.99,
    group_ratio: float = 1.0,
    num_groups: int = 2,
    bound: BoundName = "chebyshev",
    scale: Scale = "metric",
) -> PlanResult:
    """The minimum total budget such that |gap_hat - gap| < alpha with prob. ``confidence``.

    For ``best`` every valid mechanism (M_R, M_L, M_P, M_N) is planned and the one needing the
    least budget is returned. ``epsilon`` is None when no budget up to 1e4 reaches alpha (M_R's
    variance has a floor: its reports are always +/-1).
    """
    num_clients, confidence = _check_plan_args(num_clients, confidence, bound, scale, num_groups)
    alpha = check_positive_finite("alpha", alpha)
    check_choice("mechanism", mechanism, (*MECHANISMS, "best"))
    fractions = group_fractions_from_ratio(group_ratio, num_groups)
    names = MECHANISMS if mechanism == "best" else (mechanism,)
    results = []
    for name in names:

        def error_at(budget: float, name: MechanismName = name) -> float:
            factor = optimal_variance_factor(name, budget, num_groups, fractions)
            return _error_from_variance(factor / num_clients, confidence, bound, scale)

        budget = _smallest_epsilon(error_at, alpha)
        split = None if budget is None else optimal_split(name, budget, num_groups, fractions)
        results.append(
            PlanResult(
                mechanism=name,
                num_clients=num_clients,
                confidence=confidence,
                group_ratio=float(group_ratio),
                bound=bound,
                scale=scale,
                alpha=alpha,
                epsilon=budget,
                split=split,
            )
        )
    reachable = [r for r in results if r.epsilon is not None]
    if not reachable:
        return results[0]
    # a tie (M_N with G = 1 is M_R) goes to the first in MECHANISMS, as in best_split
    smallest = min(r.epsilon for r in reachable if r.epsilon is not None)
    return next(
        r
        for r in reachable
        if r.epsilon is not None and r.epsilon <= smallest * (1 + TIE_TOLERANCE)
    )


# --- The paper's Table 1 (formula check; its allocations are NOT eps-LDP) -----------------


def paper_allocation_moments(mechanism: MechanismName, epsilon: float) -> ReportMoments:
    """Report moments under the paper's allocations ("M_R opt." and "M_L opt.").

    M_R: eps1 = eps2 = eps (Theorem 5 -- false, true epsilon is larger). M_L: eps2 = eps,
    k = eps and eps1 = ln(2/eps) + eps - 1 for eps >= 2/3, else k = 2/3 and
    eps1 = ln 3 - eps/2 (Appendix B -- not LDP for k != 2). For reproducing Table 1 only.
    """
    epsilon = check_epsilon("epsilon", epsilon)
    check_choice("mechanism", mechanism, PAPER_MECHANISMS)
    if mechanism == "R":
        return RandomizedResponseMechanism(epsilon, epsilon, 2).moments
    if epsilon >= 2.0 / 3.0:
        noise_ratio, epsilon_group = epsilon, math.log(2.0 / epsilon) + epsilon - 1.0
    else:
        noise_ratio, epsilon_group = 2.0 / 3.0, math.log(3.0) - epsilon / 2.0
    return laplace_report_moments(epsilon_group, epsilon, 2, noise_ratio)


def paper_table1_cell(
    mechanism: MechanismName, num_clients: int, alpha: float, confidence: float = 0.99
) -> float | None:
    """Minimum eps of the paper's Table 1 (value scale, Chebyshev, balanced groups)."""

    def error_at(budget: float) -> float:
        factor = gap_variance_factor(paper_allocation_moments(mechanism, budget), np.full(2, 0.5))
        return _error_from_variance(factor / num_clients, confidence, "chebyshev", "value")

    return _smallest_epsilon(error_at, alpha)


TABLE1_CLIENTS = (10**5, 10**6, 10**7, 10**8, 10**9)
TABLE1_ALPHAS = (1e-1, 1e-2, 1e-3)


def table1(
    *, paper_allocation: bool = False, bound: BoundName = "chebyshev", confidence: float = 0.99
) -> dict[str, list[list[float | None]]]:
    """Table 1 (rows K = 1e5..1e9, columns alpha = 0.1, 0.01, 0.001; value scale).

    ``paper_allocation=True`` reproduces the paper's cells (invalid allocations);
    otherwise the valid mechanisms' minimum budgets, plus the best of them ("best").
    """
    table: dict[str, list[list[float | None]]] = {}
    names: tuple[MechanismChoice, ...] = (
        PAPER_MECHANISMS if paper_allocation else (*MECHANISMS, "best")
    )
    for name in names:
        rows = []
        for num_clients in TABLE1_CLIENTS:
            row: list[float | None] = []
            for alpha in TABLE1_ALPHAS:
                if paper_allocation and name != "best":  # names has no "best" then
                    row.append(paper_table1_cell(name, num_clients, alpha, confidence))
                else:
                    plan = minimum_epsilon(
                        name,
                        num_clients,
                        alpha,
                        confidence=confidence,
                        bound=bound,
                        scale="value",
                    )
                    row.append(plan.epsilon)
            rows.append(row)
        table[name] = rows
    return table


def format_table1(table: dict[str, list[list[float | None]]]) -> str:
    """Plain-text rendering of :func:`table1`'s output."""
    names = list(table)
    header = ["K"] + [f"{n} a={a:g}" for n in names for a in TABLE1_ALPHAS]
    lines = ["  ".join(f"{h:>11}" for h in header)]
    for index, num_clients in enumerate(TABLE1_CLIENTS):
        cells = [f"{num_clients:>11.0e}"]
        for name in names:
            for value in table[name][index]:
                cells.append(f"{'-' if value is None else f'{value:.2f}':>11}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
