"""The planner: the paper's Table 1 (formula check) and the valid mechanisms' budgets.

The paper: Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure':
Privately Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop,
PMLR, 2022 (Juarez and Korolova 2022 below).

Reference values: the paper's printed Table 1 ("Minimum privacy budget required to bound the
error by alpha, given K clients, with 0.99 probability"; value scale, Chebyshev, balanced
groups); for the valid planner an independent computation written here from Eq. 19 / Eq. 20
(Juarez and Korolova 2022, Appendix A.4) and the true-epsilon privacy constraints (the
paper's Theorems 5/6 are false; see :func:`fedparity.mechanisms.ldp.calibration.true_epsilon`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from fedparity.mechanisms.ldp.laplace import LaplaceMechanism
from fedparity.mechanisms.ldp.planner import error_bound, minimum_epsilon, paper_table1_cell, table1

CLIENTS = (10**5, 10**6, 10**7, 10**8, 10**9)
ALPHAS = (0.1, 0.01, 0.001)

# Table 1 of Juarez and Korolova 2022 (Section 5), copied from the paper.
PAPER_TABLE1: dict[str, list[list[float | None]]] = {
    "R": [
        [1.86, None, None],
        [0.63, None, None],
        [0.23, 1.86, None],
        [0.08, 0.63, None],
        [0.02, 0.23, 1.86],
    ],
    "L": [
        [2.56, 17.89, 178.89],
        [0.71, 6.32, 56.57],
        [0.21, 2.56, 17.89],
        [0.07, 0.71, 6.32],
        [0.02, 0.21, 2.56],
    ],
}
CELLS = [
    (name, k_index, a_index) for name in ("R", "L") for k_index in range(5) for a_index in range(3)
]


@pytest.mark.parametrize(("name", "k_index", "a_index"), CELLS)
def test_paper_table1_cell(name: str, k_index: int, a_index: int) -> None:
    expected = PAPER_TABLE1[name][k_index][a_index]
    got = paper_table1_cell(name, CLIENTS[k_index], ALPHAS[a_index])  # type: ignore[arg-type]
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert abs(got - expected) <= 0.005 + 1e-12  # printed to 2 decimals


def test_table1_function_returns_the_paper_table() -> None:
    table = table1(paper_allocation=True)
    for name in ("R", "L"):
        for row, paper_row in zip(table[name], PAPER_TABLE1[name], strict=True):
            for got, expected in zip(row, paper_row, strict=True):
                assert (got is None) == (expected is None)
                if expected is not None:
                    assert got is not None and abs(got - expected) <= 0.005 + 1e-12


# --- independent reference for the valid mechanisms ------------------------------------------


def group_variance(name: str, eps1: float, eps2: float, k_total: float, n: float) -> float:
    """Worst case over values of Var(m_hat_G), v units, known n, d = 2.

    Eq. 20 (M_R) decreases in nu^2, so the worst case is nu^2 = 0; Eq. 19 (M_L, k = 2:
    sigma^2 = sigma_bar^2 = 8/eps2^2) increases in nu^2, so it is nu^2 = 1.
    """
    e = math.exp(-eps1)
    if name == "R":
        a = 1.0 / (1.0 + e)
        b = 1.0 / (1.0 + math.exp(-eps2))
        c2 = (2.0 * b - 1.0) ** 2
        return 1.0 / (a * c2 * n) * (1.0 + (k_total - n) / n * (1.0 - a) / a)
    # M_L keeps the group with its realised a' (a rounded down to a multiple of 2^-26).
    numerator, bits = LaplaceMechanism(eps1, eps2).group_keep_fraction
    e = (1.0 - numerator / 2**bits) / (numerator / 2**bits)
    # The grid mechanism's noise: a discrete Laplace of scale 2/eps2 on steps s = 2^-8,
    # Var = 2 r / (1 - r)^2 s^2 with r = exp(-s eps2 / 2) (the paper's 8 / eps2^2 to within
    # ~1e-6 relative), plus at most s^2 / 4 of rounding for kept values.
    step = 2.0**-8
    r = math.exp(-step * eps2 / 2.0)
    sigma_bar2 = 2.0 * r / (1.0 - r) ** 2 * step**2
    sigma2 = sigma_bar2 + step**2 / 4.0
    return (1.0 / n) * (e + (1.0 + e) * (sigma2 + (k_total - n) / n * sigma_bar2 * e))


def boundary_eps1(name: str, budget: float, eps2: float) -> float:
    """Largest eps1 with true epsilon <= budget (not Theorems 5/6), for eps2 <= budget."""
    if name == "R":
        # ln(2 e^eps2 / (1 + e^eps2)) written as ln 2 - ln(1 + e^-eps2) (no overflow).
        return budget - (math.log(2.0) - math.log1p(math.exp(-eps2)))
    return budget - eps2 / 2.0


def min_gap_variance(
    name: str, budget: float, k_total: float, fractions: tuple[float, ...]
) -> float:
    """Smallest worst-case variance of the gap over valid splits (grid + bounded refinement)."""
    sizes = [k_total * f for f in fractions]

    def variance(eps2: float) -> float:
        eps1 = boundary_eps1(name, budget, eps2)
        per_group = sorted(group_variance(name, eps1, eps2, k_total, n) for n in sizes)
        return per_group[-1] + per_group[-2]  # Theorem 9, the largest pair

    grid = np.linspace(budget / 200, budget, 200)
    values = [variance(float(x)) for x in grid]
    best = int(np.argmin(values))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    refined = optimize.minimize_scalar(
        variance, bounds=(low, high), method="bounded", options={"xatol": 1e-12}
    )
    return min(values[best], float(refined.fun))


def reference_error(
    name: str,
    budget: float,
    k_total: float,
    confidence: float = 0.99,
    fractions: tuple[float, ...] = (0.5, 0.5),
) -> float:
    """Chebyshev error (value scale): sqrt(Var / (1 - confidence))."""
    return math.sqrt(min_gap_variance(name, budget, k_total, fractions) / (1.0 - confidence))


def reference_min_epsilon(name: str, k_total: float, alpha: float) -> float | None:
    if reference_error(name, 1e4, k_total) > alpha:
        return None

    def excess(log_budget: float) -> float:
        return reference_error(name, math.exp(log_budget), k_total) - alpha

    return math.exp(optimize.brentq(excess, math.log(1e-6), math.log(1e4), xtol=1e-13))


@pytest.mark.parametrize("name", ["R", "L"])
@pytest.mark.parametrize("k_total", CLIENTS)
def test_valid_minimum_epsilon_matches_independent_computation(name: str, k_total: int) -> None:
    for alpha in ALPHAS:
        plan = minimum_epsilon(name, k_total, alpha, scale="value")  # type: ignore[arg-type]
        expected = reference_min_epsilon(name, k_total, alpha)
        if expected is None:
            assert plan.epsilon is None
            # M_R's floor: Var -> 2 * (1/n) = 4/K as eps -> inf, error -> 20/sqrt(K).
            assert name == "R" and 20.0 / math.sqrt(k_total) > alpha * 0.99
            continue
        assert plan.epsilon is not None
        assert plan.epsilon == pytest.approx(expected, rel=1e-6)
        assert plan.split is not None and plan.split.epsilon <= plan.epsilon
        # Minimality, with the library's error and with the independent one.
        at = error_bound(name, k_total, plan.epsilon, scale="value")  # type: ignore[arg-type]
        below = error_bound(name, k_total, 0.99 * plan.epsilon, scale="value")  # type: ignore[arg-type]
        assert at.alpha <= alpha
        assert below.alpha > alpha
        assert reference_error(name, plan.epsilon, k_total) <= alpha * (1 + 1e-9)
        assert reference_error(name, 0.99 * plan.epsilon, k_total) > alpha


def test_valid_table_differs_from_the_paper_where_the_paper_overstates_privacy() -> None:
    # The valid M_R needs more budget than the paper's invalid eps1 = eps2 = eps allocation
    # (K = 1e5, alpha = 0.1: 1.86 in the paper).
    valid = minimum_epsilon("R", 10**5, 0.1, scale="value").epsilon
    assert valid is not None and valid > 1.86 + 0.1


@pytest.mark.parametrize("metric_scale", ["metric", "value"])
@pytest.mark.parametrize("k_total", [10**5, 10**7])
@pytest.mark.parametrize("alpha", [0.05, 0.005])
def test_best_picks_the_smaller_budget(alpha: float, k_total: int, metric_scale: str) -> None:
    plans = {
        n: minimum_epsilon(n, k_total, alpha, scale=metric_scale)  # type: ignore[arg-type]
        for n in ("R", "L", "P", "N")
    }
    best = minimum_epsilon("best", k_total, alpha, scale=metric_scale)  # type: ignore[arg-type]
    reachable = {n: p.epsilon for n, p in plans.items() if p.epsilon is not None}
    assert reachable
    chosen = min(reachable, key=reachable.__getitem__)
    assert best.mechanism == chosen
    assert best.epsilon == pytest.approx(reachable[chosen], rel=1e-12)


@pytest.mark.parametrize("name", ["R", "L"])
@pytest.mark.parametrize("epsilon", [0.3, 1.0, 4.0])
def test_error_bound_matches_reference_and_scales(name: str, epsilon: float) -> None:
    k_total = 10**5
    value = error_bound(name, k_total, epsilon, scale="value")  # type: ignore[arg-type]
    assert value.alpha == pytest.approx(reference_error(name, epsilon, k_total), rel=1e-6)
    assert value.split is not None and value.split.epsilon <= epsilon
    # 1 / sqrt(K): ten times the clients, sqrt(10) times smaller error (exactly).
    for factor_k in (10, 100):
        more = error_bound(name, k_total * factor_k, epsilon, scale="value")  # type: ignore[arg-type]
        assert value.alpha / more.alpha == pytest.approx(math.sqrt(factor_k), rel=1e-12)
    # Normal bound: z_{0.995} sqrt(Var) against Chebyshev sqrt(Var / 0.01) = 10 sqrt(Var).
    normal = error_bound(name, k_total, epsilon, bound="normal", scale="value")  # type: ignore[arg-type]
    assert normal.alpha == pytest.approx(stats.norm.ppf(0.995) / 10.0 * value.alpha, rel=1e-12)
    # Metric units are half of value units (m = (v + 1) / 2).
    metric = error_bound(name, k_total, epsilon, scale="metric")  # type: ignore[arg-type]
    assert metric.alpha == pytest.approx(value.alpha / 2.0, rel=1e-12)
    # Another confidence level: Chebyshev scales with 1 / sqrt(1 - confidence).
    c90 = error_bound(name, k_total, epsilon, confidence=0.9, scale="value")  # type: ignore[arg-type]
    assert c90.alpha == pytest.approx(value.alpha * math.sqrt(0.01 / 0.1), rel=1e-12)


@pytest.mark.parametrize("name", ["R", "L"])
def test_error_bound_unbalanced_and_three_groups(name: str) -> None:
    k_total, epsilon = 10**6, 1.0
    unbalanced = error_bound(name, k_total, epsilon, group_ratio=3.0, scale="value")  # type: ignore[arg-type]
    assert unbalanced.alpha == pytest.approx(
        reference_error(name, epsilon, k_total, fractions=(0.75, 0.25)), rel=1e-6
    )
    balanced = error_bound(name, k_total, epsilon, scale="value")  # type: ignore[arg-type]
    assert unbalanced.alpha > balanced.alpha


def test_error_bound_best_is_the_smaller() -> None:
    for epsilon in (0.2, 1.0, 5.0):
        every = [error_bound(n, 10**6, epsilon).alpha for n in ("R", "L", "P", "N")]  # type: ignore[arg-type]
        assert error_bound("best", 10**6, epsilon).alpha == pytest.approx(min(every), rel=1e-12)


# --- input errors -------------------------------------------------------------------------------


def test_too_few_clients() -> None:
    with pytest.raises(ValueError, match="num_clients"):
        minimum_epsilon("R", 1, 0.1)
    with pytest.raises(ValueError, match="num_clients"):
        error_bound("L", 2, 1.0, num_groups=3)
    with pytest.raises(ValueError, match="num_clients"):
        minimum_epsilon("R", 0, 0.1)


@pytest.mark.parametrize("alpha", [0.0, -0.1, math.nan, math.inf])
def test_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        minimum_epsilon("best", 10**5, alpha)


@pytest.mark.parametrize("confidence", [1.0, 0.0, 1.5, math.nan])
def test_bad_confidence(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence"):
        minimum_epsilon("R", 10**5, 0.1, confidence=confidence)
    with pytest.raises(ValueError, match="confidence"):
        error_bound("R", 10**5, 1.0, confidence=confidence)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        error_bound("R", 10**5, 0.0)
    with pytest.raises(ValueError, match="bound"):
        error_bound("R", 10**5, 1.0, bound="bernstein")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        minimum_epsilon("R", 10**5, 0.1, scale="percent")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mechanism"):
        minimum_epsilon("Q", 10**5, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_ratio"):
        error_bound("R", 10**5, 1.0, group_ratio=0.0)
    with pytest.raises(ValueError, match="num_groups"):
        error_bound("R", 10**5, 1.0, num_groups=1)
