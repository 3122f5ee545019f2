"""M_N: NPRR on the value (Waudby-Smith, Wu and Ramdas, ICML 2023, Algorithm 1) with GRR on
the group: exact privacy on the grid, the sampler's law, the estimators' bias and coverage."""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms.ldp.calibration import MECHANISMS, best_split, optimal_split
from fedparity.mechanisms.ldp.estimators import estimate_gap, estimator_covariance
from fedparity.mechanisms.ldp.nprr import (
    NPRRMechanism,
    nprr_epsilon,
    nprr_for_budget,
    nprr_report_moments,
)
from fedparity.mechanisms.ldp.planner import error_bound, minimum_epsilon
from fedparity.mechanisms.ldp.power import audit_power
from fedparity.mechanisms.ldp.randomized_response import randomized_response_epsilon
from fedparity.mechanisms.ldp.reports import ReportMoments, ReportSummary

#: Family-wise false-alarm probability of each statistical test below (seeded, so each run is
#: deterministic; this is the chance a correct sampler would fail it at a fresh seed).
FAMILY_ALPHA = 1e-3

CASES = [
    # (eps1, eps2, d, G)
    (0.5, 0.5, 2, 1),
    (1.0, 1.0, 2, 1),
    (1.0, 2.0, 2, 2),
    (2.0, 1.0, 5, 4),
    (0.3, 4.0, 3, 8),
    (4.0, 4.0, 5, 3),
]


def composed_distribution(
    mechanism: NPRRMechanism, group: int, grid_value: int
) -> dict[tuple[int, int], Fraction]:
    """The joint law built from the two oracles' own enumerations (independent of the
    mechanism's formula): kept group -> NPRR of the value, flipped -> a uniform grid point."""
    groups = mechanism.group_oracle.exact_output_distribution(group)
    values = mechanism.value_oracle.exact_output_distribution(grid_value)
    points = mechanism.grid_size + 1
    table = {}
    for (reported,), p_group in groups.items():
        for (z,), p_value in values.items():
            table[(reported, z)] = p_group * (p_value if reported == group else Fraction(1, points))
    return table


@pytest.mark.parametrize(("eps1", "eps2", "d", "grid"), CASES)
def test_the_worst_likelihood_ratio_over_every_grid_input_is_the_reported_epsilon(
    eps1: float, eps2: float, d: int, grid: int
) -> None:
    mechanism = NPRRMechanism(eps1, eps2, d, grid)
    inputs = list(itertools.product(range(d), range(grid + 1)))
    tables = [mechanism.exact_output_distribution(g, y) for g, y in inputs]
    for (g, y), table in zip(inputs, tables, strict=True):
        assert table == composed_distribution(mechanism, g, y)
        assert sum(table.values()) == 1
        assert all(p > 0 for p in table.values())
    outputs = list(tables[0])
    # worst ratio over every pair of inputs, for every output: its largest over its smallest
    worst = max(max(t[o] for t in tables) / min(t[o] for t in tables) for o in outputs)
    assert math.isclose(math.log1p(float(worst - 1)), mechanism.epsilon, rel_tol=1e-12)
    # the realised epsilon is at most the ideal one, and short of it by the 64-bit rounding
    assert mechanism.epsilon <= mechanism.ideal_epsilon
    assert mechanism.ideal_epsilon - mechanism.epsilon < 1e-9


def test_with_one_grid_step_the_mechanism_is_m_r_and_its_epsilon_m_r_s() -> None:
    for eps1, eps2, d in itertools.product((0.2, 1.0, 3.0), (0.5, 1.0, 5.0), (2, 4)):
        expected = randomized_response_epsilon(eps1, eps2, d)
        assert math.isclose(nprr_epsilon(eps1, eps2, d, 1), expected, rel_tol=1e-12)
        assert NPRRMechanism(eps1, eps2, d, 1).epsilon <= expected


def test_the_value_step_alone_is_nprrs_epsilon() -> None:
    # Waudby-Smith et al. 2023, Algorithm 1: eps = ln(1 + (G + 1) r / (1 - r))
    for eps2, grid in itertools.product((0.5, 1.0, 3.0), (1, 2, 5, 16)):
        mechanism = NPRRMechanism(1.0, eps2, 2, grid)
        r = mechanism.report_keep_probability
        paper = math.log1p((grid + 1) * r / (1 - r))
        assert math.isclose(paper, mechanism.value_oracle.epsilon, rel_tol=1e-9)
        assert paper <= eps2 * (1 + 1e-12)


def law_of(mechanism: NPRRMechanism, group: int, value: float) -> dict[tuple[int, int], float]:
    """The exact law of an input v in [-1, 1]: the mixture of its two grid neighbours' laws
    with the rounding's weights."""
    scaled = (value + 1) * mechanism.grid_size / 2
    lower = math.floor(scaled)
    up = scaled - lower
    table = {
        k: float(p) * (1 - up) for k, p in mechanism.exact_output_distribution(group, lower).items()
    }
    if up > 0:
        for k, p in mechanism.exact_output_distribution(group, lower + 1).items():
            table[k] += float(p) * up
    return table


@pytest.mark.parametrize(
    ("mechanism", "group", "value"),
    [
        (NPRRMechanism(1.0, 2.0, 3, 4), 1, 0.0),  # on the grid (z = 2)
        (NPRRMechanism(1.0, 2.0, 3, 4), 2, -0.3),  # between z = 1 and z = 2
        (NPRRMechanism(0.5, 1.0, 2, 1), 0, 0.6),  # M_R's case: rounding to {0, 1}
    ],
    ids=["on-grid", "off-grid", "G=1"],
)
def test_the_sampler_draws_the_enumerated_distribution(
    mechanism: NPRRMechanism, group: int, value: float
) -> None:
    n = 200_000
    rng = np.random.default_rng(20261127)
    reported, index = mechanism.perturb_indices(np.full(n, group), np.full(n, value), rng)
    points = mechanism.grid_size + 1
    observed = np.bincount(reported * points + index, minlength=mechanism.num_groups * points)
    law = law_of(mechanism, group, value)
    expected = np.array([law[(g, z)] for g in range(mechanism.num_groups) for z in range(points)])
    assert math.isclose(expected.sum(), 1.0, abs_tol=1e-12)
    # Pearson's chi-square against the exact law (every cell expects > 1000 draws)
    assert stats.chisquare(observed, expected * n).pvalue > FAMILY_ALPHA / 3


def test_a_report_is_on_the_grid_and_keeps_the_group_step_s_draw() -> None:
    mechanism = NPRRMechanism(1.0, 1.0, 4, 6)
    rng = np.random.default_rng(5)
    reports = mechanism.perturb(rng.integers(0, 4, 5000), rng.uniform(-1, 1, 5000), rng)
    assert mechanism.is_valid_report_value(reports.values).all()
    assert not mechanism.is_valid_report_value(np.array([0.1, 1.5, np.nan])).any()
    assert set(np.unique(reports.groups)) <= set(range(4))


def population(d: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed population: unequal groups, metrics spread over [0, 1] (off the grid)."""
    rng = np.random.default_rng(seed)
    shares = np.arange(1, d + 1) / np.arange(1, d + 1).sum()
    groups = rng.choice(d, size=n, p=shares)
    centres = np.linspace(0.35, 0.8, d)
    metric = np.clip(centres[groups] + rng.uniform(-0.2, 0.2, n), 0, 1)
    return groups, metric


@pytest.mark.parametrize(("d", "n", "budget"), [(2, 4000, 2.0), (5, 20_000, 4.0)])
def test_the_gap_estimators_are_unbiased_and_their_intervals_cover(
    d: int, n: int, budget: float
) -> None:
    runs = 400
    mechanism = nprr_for_budget(budget, d, grid_size=4)
    groups, metric = population(d, n, seed=d)
    sizes = np.bincount(groups, minlength=d)
    truth = np.array([metric[groups == g].mean() for g in range(d)])
    true_differences = np.array(
        [truth[i] - truth[j] for i, j in itertools.combinations(range(d), 2)]
    )
    rng = np.random.default_rng(100 + d)
    known, estimated, covered_known, covered_estimated = [], [], [], []
    z90 = stats.norm.ppf(0.95)
    for _ in range(runs):
        reports = mechanism.perturb(groups, 2 * metric - 1, rng)
        summary = ReportSummary.from_reports(reports.groups, reports.values, d)
        for sizes_given, means, covered in (
            (sizes, known, covered_known),
            (None, estimated, covered_estimated),
        ):
            estimate = estimate_gap(summary, mechanism, group_sizes=sizes_given, confidence=0.9)
            means.append(estimate.group_means)
            half = z90 * estimate.difference_stderrs
            covered.append(np.abs(estimate.differences - true_differences) <= half)
    known_means = np.array(known)
    # Unbiased with the true group sizes (S_G / (gain n_G), exact): every group's Monte Carlo
    # mean within z standard errors of the truth, z at the family-wise level over d groups.
    z = stats.norm.ppf(1 - FAMILY_ALPHA / (2 * d))
    standard_errors = known_means.std(axis=0, ddof=1) / math.sqrt(runs)
    assert np.all(np.abs(known_means.mean(axis=0) - truth) < z * standard_errors)
    # With estimated sizes (a ratio: bias O(1/n), here far below the standard error) too.
    estimated_means = np.array(estimated)
    assert np.all(np.abs(estimated_means.mean(axis=0) - truth) < z * standard_errors * 1.5)
    # Coverage of the 0.9 intervals of every pairwise difference: the rate of each pair is
    # binomial(runs, >= 0.9) if the standard errors are right (they bound the rounding variance
    # from above); 3.3 binomial sds below 0.9 is a 1e-3 false alarm per pair.
    tolerance = 3.3 * math.sqrt(0.9 * 0.1 / runs)
    for covered in (covered_known, covered_estimated):
        rates = np.mean(covered, axis=0)
        assert np.all(rates >= 0.9 - tolerance), rates


@pytest.mark.parametrize("budget", [0.5, 1.0, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("d", [2, 5])
def test_the_mechanism_for_a_budget_stays_within_it(budget: float, d: int) -> None:
    mechanism = nprr_for_budget(budget, d)
    assert mechanism.epsilon <= budget
    assert mechanism.epsilon > 0.999 * budget
    moments = nprr_report_moments(
        mechanism.epsilon_group, mechanism.epsilon_value, d, mechanism.grid_size
    )
    assert moments.value_gain == pytest.approx(mechanism.moments.value_gain, rel=1e-9)


def test_larger_budgets_choose_finer_grids() -> None:
    # Rounding noise (1/G^2) only matters once the privatisation noise is small.
    assert nprr_for_budget(0.5).grid_size == 1
    assert nprr_for_budget(8.0).grid_size > 4


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: NPRRMechanism(1.0, 1.0, 2, 0), "grid_size must be an integer in"),
        (lambda: NPRRMechanism(0.0, 1.0, 2, 1), "epsilon_group must be a finite number > 0"),
        (lambda: NPRRMechanism(1.0, 1.0, 1, 1), "num_groups must be an integer in"),
        (lambda: nprr_for_budget(-1.0), "budget must be a finite number > 0"),
        (
            lambda: NPRRMechanism(1.0, 1.0, 2, 2).perturb(
                np.array([0, 1]), np.array([0.5, 1.5]), np.random.default_rng(0)
            ),
            "values must be in",
        ),
        (
            lambda: NPRRMechanism(1.0, 1.0, 2, 2).exact_output_distribution(0, 3),
            "grid_value must be an integer in",
        ),
    ],
)
def test_bad_input_is_refused_with_the_parameter_and_its_range(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# --- the planner and "best" ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_groups", "budget", "winner"),
    [
        (2, 1.0, "R"),
        (2, 1.9, "R"),
        (2, 2.0, "N"),
        (2, 4.0, "N"),
        (2, 8.0, "N"),
        (5, 1.0, "R"),
        (5, 2.8, "R"),
        (5, 2.9, "N"),
        (5, 8.0, "N"),
    ],
)
def test_best_chooses_m_n_where_its_interval_is_narrowest(
    num_groups: int, budget: float, winner: str
) -> None:
    """ "best" takes the smallest worst-case variance of the four splits. M_N with G = 1 is M_R
    (equal variances: the tie goes to M_R), so M_N is chosen where a finer grid pays: from
    eps = 2 with two groups and eps ~ 2.85 with five (computed: the crossovers lie in
    (1.95, 2.0] and (2.8, 2.85])."""
    splits = {name: optimal_split(name, budget, num_groups) for name in MECHANISMS}
    chosen = best_split("best", budget, num_groups)
    smallest = min(split.variance_factor for split in splits.values())
    assert chosen.mechanism == winner
    assert chosen.variance_factor == pytest.approx(smallest, rel=1e-9)
    nprr = splits["N"]
    if winner == "R":
        assert nprr.grid_size == 1
        assert nprr.variance_factor == pytest.approx(splits["R"].variance_factor, rel=1e-9)
    else:
        # by more than a tie: 0.2% at (2, 2.0), the crossover; 3x at (2, 8.0)
        assert nprr.grid_size > 1 and nprr.variance_factor < 0.999 * splits["R"].variance_factor
        assert chosen.build().epsilon <= budget
    # the planner's error at this budget is M_N's wherever best picks it
    plan = error_bound("best", 10**6, budget, num_groups=num_groups)
    assert plan.mechanism == winner


def test_the_planned_variance_is_the_monte_carlo_one() -> None:
    """The variance factor (K Var of the gap, known sizes) against R = 800 perturbations.

    M_N's moments take each kept report's rounding variance at its bound 1 / G^2 together with
    |v| = 1, which no value reaches at once (|v| = 1 is a grid point and rounds to itself): the
    planned variance is an upper bound. At v = +/-(1 - 1/G), halfway between the two top grid
    points, the rounding variance is exactly 1 / G^2, so the moments' formula there is the exact
    variance; at |v| = 1 the exact one is the plan less a r / G^2 per user in Var(S_G). Monte
    Carlo is checked against both.
    """
    split = optimal_split("N", 4.0, 2)
    assert split.mechanism == "N" and split.grid_size == 4
    mechanism = split.build()
    moments = mechanism.moments
    clients = 10_000
    groups = np.repeat([0, 1], clients // 2)
    sizes = np.array([clients // 2, clients // 2], dtype=np.float64)

    def exact_factor(square_sums: np.ndarray, report_moments: ReportMoments = moments) -> float:
        cov = estimator_covariance(report_moments, clients, sizes, np.zeros(2), square_sums)
        return clients * float(cov[0, 0] + cov[1, 1])

    # the plan is the formula at sum v^2 = n_G (the worst case of its moments)
    assert split.variance_factor == pytest.approx(exact_factor(sizes), rel=1e-12)
    gain = moments.value_gain
    unrounded = dataclasses.replace(
        moments, kept_second_moment=moments.kept_second_moment - gain / split.grid_size**2
    )
    midpoint = 1.0 - 1.0 / split.grid_size
    cases = [
        (midpoint, exact_factor(sizes * midpoint**2)),
        (1.0, exact_factor(sizes, unrounded)),  # 4 / (G^2 a r) below the plan: 20% here
    ]
    rng = np.random.Generator(np.random.PCG64(99))
    reps = 800
    for magnitude, exact in cases:
        values = np.where(np.arange(clients) % 2 == 0, magnitude, -magnitude)
        gaps = []
        for _ in range(reps):
            reports = mechanism.perturb(groups, values, rng, validate=False)
            summary = ReportSummary.from_reports(reports.groups, reports.values, 2)
            gaps.append(estimate_gap(summary, mechanism, group_sizes=sizes).differences[0])
        value_units = 4.0 * clients * float(np.var(gaps, ddof=1))  # metric -> value units
        # a sample variance of R normal draws: relative SE sqrt(2 / (R - 1)), within 4.5 SE
        assert value_units == pytest.approx(exact, rel=4.5 * math.sqrt(2 / reps)), magnitude
        assert exact < split.variance_factor
    slack = 4.0 / (split.grid_size**2 * moments.keep_probability * gain)
    assert split.variance_factor - cases[1][1] == pytest.approx(slack, rel=1e-9)


@pytest.mark.slow
def test_the_planners_tie_goes_to_m_r_and_m_ns_grid_is_in_every_plan() -> None:
    """Where M_N's best grid is G = 1 it is M_R (the same budget): the planner keeps M_R; where
    a finer grid wins, the plans say which grid (M_N's epsilon depends on it)."""
    plan = minimum_epsilon("best", 10**7, 0.01)
    nprr = minimum_epsilon("N", 10**7, 0.01)
    assert plan.mechanism == "R" and nprr.split is not None and nprr.split.grid_size == 1
    assert nprr.epsilon == pytest.approx(plan.epsilon, rel=1e-6)
    assert "grid_size" not in plan.to_dict()
    bound = error_bound("best", 10**5, 4.0)
    assert bound.mechanism == "N" and bound.to_dict()["grid_size"] == 4
    power = audit_power(10**5, 4.0, 0.05)
    assert power.mechanism == "N" and power.to_dict()["grid_size"] == power.grid_size == 4
    assert "grid_size" not in audit_power(10**5, 1.0, 0.05).to_dict()  # M_R there
