"""True LDP epsilon of M_R and M_L, checked independently of the library's formulas.

M_R and M_L are the mechanisms of Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated Learning",
AFCP workshop, PMLR, 2022 (Juarez and Korolova 2022 below). M_R (Algorithm 1) has finitely many
outputs and probabilities linear in v, so its true epsilon is the exact maximum over a table of
output probabilities built here from the algorithm's definition. M_L (k = 2) has a density; its
worst-case log-likelihood ratio is evaluated on a grid. The closed forms checked against them
are the corrected ones of :func:`fedparity.mechanisms.ldp.calibration.true_epsilon`; the paper's
Theorems 5/6 are wrong.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedparity.mechanisms import (
    LaplaceMechanism,
    RandomizedResponseMechanism,
    UnboundedPrivacyLossError,
    laplace_epsilon,
    mechanism_for_budget,
    optimal_split,
    randomized_response_epsilon,
    true_epsilon,
)
from fedparity.mechanisms.ldp.calibration import gap_variance_factor

GROUPS = (2, 3, 5)
SPLITS = ((0.1, 2.0), (1.0, 1.0), (2.0, 0.5), (3.0, 3.0), (0.01, 0.01), (5.0, 0.2))
BUDGETS = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
#: Values on [-1, 1]: both ends (where the extremes are attained) plus interior points.
VALUE_GRID = np.linspace(-1.0, 1.0, 21)


# --- independent references -------------------------------------------------------------


def grr_probabilities(epsilon_group: float, num_groups: int) -> tuple[float, float]:
    """(a, q): keep probability e^eps/(e^eps + d - 1) and per-other-group (1 - a)/(d - 1).

    q is computed as 1/(e^eps + d - 1) (not (1 - a)/(d - 1)) to keep relative precision when
    a is close to 1.
    """
    scale = math.exp(epsilon_group) + num_groups - 1
    return math.exp(epsilon_group) / scale, 1.0 / scale


def mr_output_table(
    epsilon_group: float, epsilon_value: float, num_groups: int, values: np.ndarray
) -> np.ndarray:
    """P[(g', v') | (g, v)] of Algorithm 1, shape (d, len(values), d, 2); v' index 0 = -1.

    Built literally from the algorithm: g' = GRR(g); if g' != g then v := 0;
    B ~ Bernoulli((1 + v)/2); B' = B with probability b = e^eps2/(1 + e^eps2), else 1 - B;
    v' = 2 B' - 1.
    """
    a, q = grr_probabilities(epsilon_group, num_groups)
    b = math.exp(epsilon_value) / (1.0 + math.exp(epsilon_value))
    not_b = 1.0 / (1.0 + math.exp(epsilon_value))
    table = np.zeros((num_groups, len(values), num_groups, 2))
    for g in range(num_groups):
        for i, v in enumerate(values):
            for g_out in range(num_groups):
                p_group = a if g_out == g else q
                v_used = float(v) if g_out == g else 0.0
                for bit in (0, 1):
                    p_bit = (1.0 + v_used) / 2.0 if bit == 1 else (1.0 - v_used) / 2.0
                    for bit_out in (0, 1):
                        p_flip = b if bit_out == bit else not_b
                        table[g, i, g_out, bit_out] += p_group * p_bit * p_flip
    return table


def max_log_ratio(log_probabilities: np.ndarray) -> float:
    """max over outputs y and input pairs (x0, x1) of log P[y|x0] - log P[y|x1].

    ``log_probabilities`` has the inputs on the leading axes and the outputs on the rest;
    for each output the worst pair is (argmax_x, argmin_x), so no O(|X|^2) loop is needed.
    """
    flat = log_probabilities.reshape(-1, *log_probabilities.shape[2:])
    flat = flat.reshape(flat.shape[0], -1)
    return float(np.max(flat.max(axis=0) - flat.min(axis=0)))


def mr_enumerated_epsilon(epsilon_group: float, epsilon_value: float, num_groups: int) -> float:
    table = mr_output_table(epsilon_group, epsilon_value, num_groups, VALUE_GRID)
    assert np.allclose(table.sum(axis=(2, 3)), 1.0, atol=1e-12)
    assert np.all(table > 0.0)
    return max_log_ratio(np.log(table))


def spec_mr_epsilon(epsilon_group: float, epsilon_value: float) -> float:
    """The true epsilon: max(eps2, eps1 + ln(2e^eps2/(1+e^eps2)), ln((1+e^eps2)/2) - eps1)."""
    e2 = math.exp(epsilon_value)
    return max(
        epsilon_value,
        epsilon_group + math.log(2.0 * e2 / (1.0 + e2)),
        math.log((1.0 + e2) / 2.0) - epsilon_group,
    )


def laplace_log_density(x: np.ndarray, scale: float) -> np.ndarray:
    return -math.log(2.0 * scale) - np.abs(x) / scale


def ml_log_density_table(
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int,
    noise_ratio: float,
    outputs: np.ndarray,
    values: np.ndarray = VALUE_GRID,
) -> np.ndarray:
    """log f(g', v' | g, v), shape (d, len(values), d, len(outputs)).

    f = a Lap(v' - v; 2/eps2) if g' = g, else (1 - a)/(d - 1) Lap(v'; k/eps2).
    """
    a, q = grr_probabilities(epsilon_group, num_groups)
    kept_scale = 2.0 / epsilon_value
    flip_scale = noise_ratio / epsilon_value
    table = np.empty((num_groups, len(values), num_groups, len(outputs)))
    kept = math.log(a) + laplace_log_density(outputs[None, :] - values[:, None], kept_scale)
    flipped = math.log(q) + laplace_log_density(outputs, flip_scale)
    for g in range(num_groups):
        for g_out in range(num_groups):
            table[g, :, g_out, :] = kept if g_out == g else flipped[None, :]
    return table


def ml_grid_epsilon(
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int,
    noise_ratio: float = 2.0,
    width: float = 60.0,
    points: int = 4001,
) -> float:
    """Worst-case log-likelihood ratio of M_L on v' in [-width s, width s], s = 2/eps2."""
    scale = max(2.0, noise_ratio) / epsilon_value
    outputs = np.linspace(-width * scale, width * scale, points)
    table = ml_log_density_table(epsilon_group, epsilon_value, num_groups, noise_ratio, outputs)
    return max_log_ratio(table)


# --- M_R: exact enumeration ----------------------------------------------------------------


@pytest.mark.parametrize("num_groups", GROUPS)
@pytest.mark.parametrize(("eps1", "eps2"), SPLITS)
def test_mr_enumeration_matches_library_and_spec(eps1: float, eps2: float, num_groups: int) -> None:
    enumerated = mr_enumerated_epsilon(eps1, eps2, num_groups)
    assert randomized_response_epsilon(eps1, eps2, num_groups) == pytest.approx(
        enumerated, abs=1e-9
    )
    assert spec_mr_epsilon(eps1, eps2) == pytest.approx(enumerated, abs=1e-9)
    mechanism = RandomizedResponseMechanism(eps1, eps2, num_groups)
    assert mechanism.epsilon == pytest.approx(enumerated, abs=1e-9)
    assert true_epsilon("R", eps1, eps2, num_groups) == pytest.approx(enumerated, abs=1e-9)


def test_mr_table_is_linear_in_v_so_interior_points_are_not_worse() -> None:
    # Only the ends of [-1, 1] matter: the enumeration over {-1, 1} equals the fine grid.
    for eps1, eps2 in SPLITS:
        ends = mr_output_table(eps1, eps2, 3, np.array([-1.0, 1.0]))
        assert max_log_ratio(np.log(ends)) == pytest.approx(
            mr_enumerated_epsilon(eps1, eps2, 3), abs=1e-12
        )


def test_mr_spec_example_eps_one_one() -> None:
    # eps1 = eps2 = 1 gives 1.3799-LDP, not the 1-LDP of Juarez and Korolova 2022, Theorem 5.
    assert round(mr_enumerated_epsilon(1.0, 1.0, 2), 4) == 1.3799
    assert round(randomized_response_epsilon(1.0, 1.0), 4) == 1.3799


@pytest.mark.parametrize(("eps1", "eps2"), SPLITS)
def test_paper_theorem5_understates_the_true_epsilon(eps1: float, eps2: float) -> None:
    """Theorem 5 claims max(eps1, eps2); the truth is never below it.

    It is strictly above whenever the group term dominates (eps1 >= eps2 suffices, since
    ln(2b) > 0 for eps2 > 0). When eps2 dominates (e.g. (0.1, 2)), the true epsilon equals
    eps2 = max(eps1, eps2) -- the *proof step* Eq. (6) is false for every eps2 > 0, but the
    theorem's value coincides with the truth there.
    """
    claimed = max(eps1, eps2)
    enumerated = mr_enumerated_epsilon(eps1, eps2, 2)
    assert enumerated >= claimed - 1e-12
    if eps1 >= eps2:
        assert enumerated > claimed + 1e-6
    # Eq. (6) of the paper's proof: 2 e^(eps1+eps2)/(1+e^eps2) <= e^eps1 -- false.
    assert 2 * math.exp(eps1 + eps2) / (1 + math.exp(eps2)) > math.exp(eps1)


# --- M_L: worst-case likelihood ratio on a grid ----------------------------------------------


@pytest.mark.parametrize("num_groups", GROUPS)
@pytest.mark.parametrize(("eps1", "eps2"), SPLITS)
def test_ml_grid_matches_library(eps1: float, eps2: float, num_groups: int) -> None:
    grid = ml_grid_epsilon(eps1, eps2, num_groups)
    library = laplace_epsilon(eps1, eps2, num_groups)
    assert grid <= library + 1e-9
    assert grid == pytest.approx(library, abs=1e-6)  # attained (at v' >= 1, v0 = 1, v1 = -1)
    # The grid mechanism's realised epsilon (computed from its quantised sampler: a noise scale
    # widened by at most 1e-5 to stay below the ideal, a keep probability rounded down to 26
    # bits): at most the ideal, and within 1e-4 of it for these splits.
    realised = LaplaceMechanism(eps1, eps2, num_groups).epsilon
    assert grid * (1 - 1e-4) <= realised <= library + 1e-9
    # The closed form (Juarez and Korolova 2022, Appendix A.2, k = 2), written here:
    # max(eps2, eps1 + eps2 / 2).
    assert max(eps2, eps1 + eps2 / 2) == pytest.approx(grid, abs=1e-6)


@pytest.mark.parametrize("num_groups", GROUPS)
@pytest.mark.parametrize("noise_ratio", [2.0 / 3.0, 3.0])
def test_ml_with_k_not_two_has_unbounded_privacy_loss(noise_ratio: float, num_groups: int) -> None:
    eps1, eps2 = 1.0, 1.0
    near = ml_grid_epsilon(eps1, eps2, num_groups, noise_ratio, width=60.0)
    far = ml_grid_epsilon(eps1, eps2, num_groups, noise_ratio, width=120.0)
    # The kept/flipped log ratio has slope |1/k - 1/2| eps2 in |v'|: widening the range by
    # 60 s (s = max(2, k)/eps2) must add about slope * 60 s; require at least half of it.
    scale = max(2.0, noise_ratio) / eps2
    slope = abs(1.0 / noise_ratio - 0.5) * eps2
    assert far > near + 0.5 * slope * 60.0 * scale
    assert near > laplace_epsilon(eps1, eps2, num_groups) + 1.0  # already past the k = 2 value


@pytest.mark.parametrize("noise_ratio", [2.0 / 3.0, 3.0, 0.6667, 1.0, 2.5])
def test_ml_refuses_k_not_two(noise_ratio: float) -> None:
    for call in (
        lambda: LaplaceMechanism(1.0, 1.0, 2, noise_ratio=noise_ratio),
        lambda: laplace_epsilon(1.0, 1.0, 2, noise_ratio=noise_ratio),
    ):
        with pytest.raises(UnboundedPrivacyLossError) as info:
            call()
        message = str(info.value)
        assert "k" in message
        assert "unbounded" in message or "without bound" in message


def test_ml_accepts_k_two() -> None:
    assert LaplaceMechanism(1.0, 1.0, 2, noise_ratio=2.0).epsilon == pytest.approx(1.5, rel=1e-4)
    assert laplace_epsilon(1.0, 1.0, 2, noise_ratio=2) == pytest.approx(1.5)


# --- budget splits ------------------------------------------------------------------------


def nprr_enumerated_epsilon(eps1: float, eps2: float, num_groups: int, grid: int) -> float:
    """M_N's ideal epsilon by enumeration: the worst log ratio of two inputs' probabilities of
    one output (g', z), from the two GRR steps' ideal probabilities (a flipped group reports a
    uniform grid point)."""
    keep = math.exp(eps1) / (math.exp(eps1) + num_groups - 1)
    other = 1.0 / (math.exp(eps1) + num_groups - 1)
    p, q = math.exp(eps2) / (math.exp(eps2) + grid), 1.0 / (math.exp(eps2) + grid)
    inputs = [(g, y) for g in range(num_groups) for y in range(grid + 1)]
    worst = 0.0
    for reported in range(num_groups):
        for z in range(grid + 1):
            probabilities = [
                keep * (p if z == y else q) if reported == g else other / (grid + 1)
                for g, y in inputs
            ]
            worst = max(worst, math.log(max(probabilities) / min(probabilities)))
    return worst


def independent_true_epsilon(
    name: str, eps1: float, eps2: float, num_groups: int, grid: int = 1
) -> float:
    if name == "N":
        return nprr_enumerated_epsilon(eps1, eps2, num_groups, grid)
    if name == "R":
        return mr_enumerated_epsilon(eps1, eps2, num_groups)
    if name == "P":
        # the closed form of the ideal M_P; its grid's realised epsilon is enumerated exactly
        # in tests/test_piecewise.py
        return max(eps2, eps1 + eps2 / 2.0)
    return ml_grid_epsilon(eps1, eps2, num_groups, points=801, width=30.0)


def boundary_group_epsilon(name: str, budget: float, eps2: np.ndarray) -> np.ndarray:
    """Largest eps1 with true eps <= budget given eps2 <= budget (from the closed forms above).

    M_R: the binding term is eps1 + ln(2b) (ln((1+e^eps2)/2) - eps1 <= eps2 always, and
    eps2 <= budget); M_L: eps1 + eps2/2.
    """
    if name == "R":
        return budget - (np.log(2.0) - np.log1p(np.exp(-eps2)))
    return budget - eps2 / 2.0


def brute_force_min_variance(name: str, budget: float, num_groups: int) -> float:
    fractions = np.full(num_groups, 1.0 / num_groups)
    eps2_grid = np.linspace(budget / 600, budget, 600)
    best = math.inf
    for eps2, eps1 in zip(eps2_grid, boundary_group_epsilon(name, budget, eps2_grid), strict=True):
        mechanism = (
            RandomizedResponseMechanism(float(eps1), float(eps2), num_groups)
            if name == "R"
            else LaplaceMechanism(float(eps1), float(eps2), num_groups)
        )
        best = min(best, gap_variance_factor(mechanism.moments, fractions))
    return best


@pytest.mark.parametrize("num_groups", GROUPS)
@pytest.mark.parametrize("name", ["R", "L"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_split_uses_the_budget_and_is_variance_optimal(
    budget: float, name: str, num_groups: int
) -> None:
    split = optimal_split(name, budget, num_groups)  # type: ignore[arg-type]
    built = mechanism_for_budget(name, budget, num_groups)  # type: ignore[arg-type]
    for eps1, eps2 in (
        (split.epsilon_group, split.epsilon_value),
        (built.epsilon_group, built.epsilon_value),
    ):
        measured = independent_true_epsilon(name, eps1, eps2, num_groups)
        # <= budget up to float rounding of the independent computation; the budget is used up.
        assert measured <= budget + 1e-12
        assert measured >= budget - 1e-9
    assert split.epsilon <= budget
    fractions = np.full(num_groups, 1.0 / num_groups)
    chosen = gap_variance_factor(built.moments, fractions)
    assert chosen <= brute_force_min_variance(name, budget, num_groups) * (1.0 + 1e-6)


@pytest.mark.parametrize("name", ["R", "L"])
def test_interior_of_feasible_region_is_never_better_than_the_boundary(name: str) -> None:
    # Justifies searching only the boundary above: variance falls as eps1 grows (a grows).
    budget, num_groups = 1.0, 3
    fractions = np.full(num_groups, 1.0 / num_groups)
    boundary_best = brute_force_min_variance(name, budget, num_groups)
    for eps2 in np.linspace(0.05, budget, 12):
        top = float(boundary_group_epsilon(name, budget, np.array([eps2]))[0])
        for eps1 in np.linspace(0.02, top * 0.98, 12):
            mechanism = (
                RandomizedResponseMechanism(float(eps1), float(eps2), num_groups)
                if name == "R"
                else LaplaceMechanism(float(eps1), float(eps2), num_groups)
            )
            assert gap_variance_factor(mechanism.moments, fractions) > boundary_best


def test_best_mechanism_for_budget_is_within_budget_and_the_smaller_variance() -> None:
    fractions = np.full(2, 0.5)
    for budget in BUDGETS:
        best = mechanism_for_budget("best", budget, 2)
        grid = getattr(best, "grid_size", 1)
        measured = independent_true_epsilon(
            best.name, best.epsilon_group, best.epsilon_value, 2, grid
        )
        assert measured <= budget + 1e-12
        variances = [
            gap_variance_factor(mechanism_for_budget(n, budget, 2).moments, fractions)
            for n in ("R", "L", "P", "N")
        ]
        assert gap_variance_factor(best.moments, fractions) == pytest.approx(min(variances))


# --- bad inputs -----------------------------------------------------------------------------

BAD_EPSILONS = [0.0, -1.0, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", BAD_EPSILONS)
def test_bad_epsilons_raise_naming_the_parameter(bad: float) -> None:
    with pytest.raises(ValueError, match="epsilon_group"):
        randomized_response_epsilon(bad, 1.0)
    with pytest.raises(ValueError, match="epsilon_value"):
        randomized_response_epsilon(1.0, bad)
    with pytest.raises(ValueError, match="epsilon_group"):
        laplace_epsilon(bad, 1.0)
    with pytest.raises(ValueError, match="epsilon_value"):
        laplace_epsilon(1.0, bad)
    with pytest.raises(ValueError, match="epsilon_group"):
        RandomizedResponseMechanism(bad, 1.0)
    with pytest.raises(ValueError, match="epsilon_value"):
        LaplaceMechanism(1.0, bad)


@pytest.mark.parametrize("bad", BAD_EPSILONS)
def test_bad_budget_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="epsilon|budget"):
        optimal_split("R", bad)
    with pytest.raises(ValueError, match="epsilon|budget"):
        mechanism_for_budget("L", bad)


def test_bad_budget_error_names_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        mechanism_for_budget("R", 0.0)


@pytest.mark.parametrize("bad", [1, 0, -3])
def test_too_few_groups_raise(bad: int) -> None:
    with pytest.raises(ValueError, match="num_groups"):
        randomized_response_epsilon(1.0, 1.0, bad)
    with pytest.raises(ValueError, match="num_groups"):
        laplace_epsilon(1.0, 1.0, bad)
    with pytest.raises(ValueError, match="num_groups"):
        optimal_split("R", 1.0, bad)
    with pytest.raises(ValueError, match="num_groups"):
        RandomizedResponseMechanism(1.0, 1.0, bad)


@pytest.mark.parametrize("bad", ["X", "r", "", "best "])
def test_unknown_mechanism_name_raises(bad: str) -> None:
    with pytest.raises(ValueError, match="mechanism"):
        mechanism_for_budget(bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mechanism"):
        optimal_split(bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mechanism"):
        true_epsilon(bad, 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mechanism"):
        optimal_split("best", 1.0)  # type: ignore[arg-type]  # only R or L here
