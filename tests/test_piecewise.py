"""M_P: GRR on the group, the Piecewise mechanism (Wang et al., ICDE 2019) on the value, on a
grid with integer draws.

* Privacy by exact enumeration: every grid input's whole output distribution (integers of
  2^64 words, the sampler's own map from words to points checked at every boundary), the
  worst-case likelihood ratio over all input pairs equal to the reported epsilon and at most
  the nominal one.
* Sampling: a chi-square test of the reports against the enumerated distribution (secure
  generator and PCG64), with a power check.
* Estimation: seeded Monte Carlo of the gap estimator's bias, variance and interval coverage
  for d = 2 and d = 5 groups; the planner's variance factor against Monte Carlo.

Tolerances (R repetitions): a Monte Carlo mean has SE = sd / sqrt(R), accepted within 4 SE; a
sample variance of R roughly normal draws has relative SE sqrt(2 / (R - 1)), accepted within
4.5 SE; a coverage proportion c has SE sqrt(c (1 - c) / R), accepted at >= nominal - 4 SE.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import ReportSummary, best_split, estimate_gap, optimal_split
from fedparity.mechanisms.crypto.secure_random import secure_generator
from fedparity.mechanisms.ldp.discrete_laplace import uniform_index
from fedparity.mechanisms.ldp.estimators import estimator_covariance
from fedparity.mechanisms.ldp.laplace import laplace_noise_variance
from fedparity.mechanisms.ldp.piecewise import (
    INPUT_STEPS,
    PiecewiseMechanism,
    piecewise_epsilon,
    piecewise_grid,
    piecewise_variance,
)

TWO_64 = 2**64
EPSILONS = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)


# --- the sampler's map from words to points is the counted distribution --------------------


def starts(counts: np.ndarray) -> np.ndarray:
    """The first word of each point when the points take consecutive runs of words."""
    edges = np.concatenate([[0], np.cumsum(np.array(counts, dtype=object))])
    return np.array(edges[:-1], dtype=np.uint64)


@pytest.mark.parametrize("epsilon_value", EPSILONS)
def test_the_samplers_word_runs_are_the_counted_probabilities(epsilon_value: float) -> None:
    grid = piecewise_grid(epsilon_value)
    points = np.arange(grid.points)
    for x in (-INPUT_STEPS, -77, 0, 1, INPUT_STEPS):
        counts = grid.point_counts(x)
        assert sum(int(c) for c in counts) == TWO_64
        # the words run through the window's points first, then the outside's, in order
        start = int(grid.window_start(x))
        window = (points >= start) & (points < start + grid.window)
        order = np.concatenate([points[window], points[~window]])
        first = starts(counts[order])
        xs = np.full(grid.points, x, dtype=np.int64)
        # each point takes exactly the words from its start to the next point's start
        np.testing.assert_array_equal(grid.points_for(xs, first), order)
        np.testing.assert_array_equal(grid.points_for(xs[1:], first[1:] - np.uint64(1)), order[:-1])
        last = grid.points_for(np.array([x]), np.array([TWO_64 - 1], dtype=np.uint64))
        assert int(last[0]) == order[-1]
    flipped = grid.flipped_point_counts()
    assert sum(int(c) for c in flipped) == TWO_64
    assert set(int(c) for c in flipped) <= {grid.flipped_count, grid.flipped_count + 1}
    first = starts(flipped)
    np.testing.assert_array_equal(uniform_index(first, grid.points), points)
    np.testing.assert_array_equal(uniform_index(first[1:] - np.uint64(1), grid.points), points[:-1])


# --- privacy by exact enumeration -------------------------------------------------------


def other_group_words(num_groups: int) -> list[list[int]]:
    """words[g][h]: of the 2^64 values of a flipped client's third word, those that send a
    client of group g to group h (``uniform_index`` over d - 1, skipping g)."""
    size = num_groups - 1
    edges = [-((-j * TWO_64) // size) for j in range(size + 1)]
    per_index = [edges[j + 1] - edges[j] for j in range(size)]
    table = []
    for g in range(num_groups):
        row = [0] * num_groups
        for index, words in enumerate(per_index):
            row[index + (index >= g)] = words
        table.append(row)
    return table


def enumerated_epsilon(mechanism: PiecewiseMechanism) -> float:
    """The worst-case log likelihood ratio over every pair of inputs (g, x), x on the grid,
    and every output (g', point), from exact integer probabilities (Fractions)."""
    grid = mechanism.grid
    d = mechanism.num_groups
    kept_table = np.stack(
        [grid.point_counts(x) for x in range(-INPUT_STEPS, INPUT_STEPS + 1)]
    )  # rows: every grid input
    column_max, column_min = kept_table.max(axis=0), kept_table.min(axis=0)
    flipped = grid.flipped_point_counts()
    numerator, bits = mechanism.group_keep_fraction
    kept = Fraction(numerator, 2**bits)
    if d == 2:
        flip = [[Fraction(0), 1 - kept], [1 - kept, Fraction(0)]]
    else:
        words = other_group_words(d)
        flip = [[(1 - kept) * Fraction(words[g][h], TWO_64) for h in range(d)] for g in range(d)]
    worst = Fraction(1)
    # only a few distinct (max, min, flipped) triples: the points' counts take two values each
    triples = {
        (int(a), int(b), int(c)) for a, b, c in zip(column_max, column_min, flipped, strict=True)
    }
    for reported in range(d):
        others = [flip[g][reported] for g in range(d) if g != reported]
        for high, low, uniform in triples:
            probabilities = [kept * high, kept * low] + [q * uniform for q in others]
            worst = max(worst, max(probabilities) / min(probabilities))
    return math.log(worst.numerator) - math.log(worst.denominator)


@pytest.mark.parametrize("num_groups", [2, 3])
@pytest.mark.parametrize("epsilon_value", EPSILONS)
@pytest.mark.parametrize("group_share", [0.1, 0.75])
def test_the_realised_epsilon_is_the_worst_case_over_every_input_pair(
    epsilon_value: float, num_groups: int, group_share: float
) -> None:
    # group_share 0.1: the value step's ratio dominates; 0.75: kept against flipped does
    mechanism = PiecewiseMechanism(group_share * epsilon_value, epsilon_value, num_groups)
    enumerated = enumerated_epsilon(mechanism)
    # the reported epsilon is the enumerated worst case (for d = 3 it bounds the other
    # groups' probabilities by 1 / (d - 1) - 2^-64: a relative 1e-19 above)
    assert enumerated == pytest.approx(mechanism.epsilon, rel=1e-12, abs=1e-12)
    assert enumerated <= mechanism.epsilon + 1e-12
    nominal = piecewise_epsilon(mechanism.epsilon_group, epsilon_value, num_groups)
    assert mechanism.epsilon <= nominal  # never above the nominal max(eps2, eps1 + eps2 / 2)
    assert mechanism.grid.epsilon <= epsilon_value


def test_flipped_reports_cost_half_the_value_budget_as_in_m_l() -> None:
    """With flipped clients reporting PM(0) the kept-against-flipped ratio would be the whole
    e^eps2 (v = 1's window is outside 0's); the uniform flipped point costs e^(eps2 / 2)."""
    mechanism = PiecewiseMechanism(2.0, 4.0)
    grid = mechanism.grid
    at_zero = grid.point_counts(0)
    at_one = grid.point_counts(INPUT_STEPS)
    # a point in v = 1's window and outside v = 0's: PM(1) / PM(0) is the whole c_in / c_out
    apart = (at_one == np.uint64(grid.inside_count)) & (at_zero == np.uint64(grid.outside_count))
    assert apart.any()
    assert mechanism.epsilon == pytest.approx(2.0 + 4.0 / 2, abs=1e-3)
    assert mechanism.epsilon <= 4.0


# --- sampling follows the enumerated distribution --------------------------------------------


def output_distribution(mechanism: PiecewiseMechanism, group: int, x: int) -> np.ndarray:
    """P(g', point) for d = 2, from the counted words (rows: reported group)."""
    grid = mechanism.grid
    numerator, bits = mechanism.group_keep_fraction
    kept = numerator / 2**bits
    table = np.zeros((2, grid.points))
    table[group] = kept * grid.point_counts(x).astype(np.float64) / TWO_64
    table[1 - group] = (1 - kept) * grid.flipped_point_counts().astype(np.float64) / TWO_64
    return table


@pytest.mark.parametrize("source", ["secure", "pcg64"])
def test_samples_follow_the_enumerated_distribution(source: str) -> None:
    mechanism = PiecewiseMechanism(1.0, 2.0)
    grid = mechanism.grid
    rng = secure_generator() if source == "secure" else np.random.Generator(np.random.PCG64(7))
    count = 1_000_000
    x = 100  # v = 100 / 256 is on the grid: no rounding
    reports = mechanism.perturb(np.zeros(count, dtype=np.int64), np.full(count, x / 256), rng)
    points = np.round(reports.values / grid.step + (grid.points - 1)).astype(np.int64) // 2
    observed = np.zeros((2, grid.points))
    np.add.at(observed, (reports.groups, points), 1)
    expected = output_distribution(mechanism, 0, x) * count

    def pvalue(expected_cells: np.ndarray) -> float:
        keep = expected_cells.ravel() > 20  # cells with enough mass; the rest pooled
        obs, exp = observed.ravel()[keep], expected_cells.ravel()[keep]
        if not keep.all():
            obs = np.append(obs, observed.ravel()[~keep].sum())
            exp = np.append(exp, expected_cells.ravel()[~keep].sum())
        return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)

    assert pvalue(expected) > 1e-4  # false failure 1e-4
    # power check: the same test rejects the distribution of an input 8 grid steps away
    assert pvalue(output_distribution(mechanism, 0, x + 8) * count) < 1e-10


# --- unbiased, with the stated moments ----------------------------------------------------


@pytest.mark.parametrize("v", [-1.0, -0.37, 0.0, 0.4999, 1.0])
def test_kept_reports_are_unbiased_with_the_stated_second_moment(v: float) -> None:
    mechanism = PiecewiseMechanism(30.0, 3.0)  # eps1 = 30: a' = 1 - 2^-26, nearly all kept
    moments = mechanism.moments
    count = 1_000_000
    reports = mechanism.perturb(
        np.zeros(count, dtype=np.int64), np.full(count, v), secure_generator()
    ).values
    second = moments.kept_second_moment + moments.kept_second_moment_slope * v * v
    variance = second - (moments.value_gain * v) ** 2
    # mean: within 5 standard errors (false failure 6e-7); 2^-26 flipped clients move it by
    # less than 1e-7
    assert abs(reports.mean() - moments.value_gain * v) <= 5 * math.sqrt(variance / count)
    # second moment: the reports are bounded by C' = report_bound, so Var(V'^2) <= C'^2 E[V'^2]
    bound = mechanism.report_bound
    assert abs(np.mean(reports**2) - second) <= 5 * bound * math.sqrt(second / count)


def test_flipped_reports_are_uniform_with_mean_zero() -> None:
    mechanism = PiecewiseMechanism(1.0, 2.0)
    grid = mechanism.grid
    units = 2 * np.arange(grid.points) - (grid.points - 1)
    weights = grid.flipped_point_counts().astype(np.float64) / TWO_64
    assert abs(float(weights @ units)) * grid.step < 1e-12
    flipped_second = float(weights @ (units * grid.step) ** 2)
    assert flipped_second == pytest.approx(mechanism.moments.flipped_second_moment, rel=1e-12)


@pytest.mark.parametrize("epsilon_value", [0.02, *EPSILONS, 12.0])
def test_the_grid_moments_are_close_to_the_continuous_pm(epsilon_value: float) -> None:
    """Wang et al. 2019, Lemma 1: Var = v^2 / (t - 1) + (t + 3) / (3 (t - 1)^2). The grid
    window's share w / m is within 1 / 512 of 1 / t, so the variances agree to ~1 %."""
    moments = PiecewiseMechanism(30.0, epsilon_value).moments
    gain = moments.value_gain
    base = moments.kept_second_moment / gain**2
    at_one = (moments.kept_second_moment + moments.kept_second_moment_slope) / gain**2 - 1.0
    assert base == pytest.approx(piecewise_variance(epsilon_value, 0.0), rel=0.02)
    assert at_one == pytest.approx(piecewise_variance(epsilon_value, 1.0), rel=0.02)


@pytest.mark.parametrize("epsilon_value", [0.01, 0.1, 1.0, 1.3, 4.0, 12.0, 100.0])
def test_pm_beats_laplace_on_one_value_at_every_epsilon(epsilon_value: float) -> None:
    """Wang et al. 2019, Section III: PM's worst-case variance is below Laplace's 8 / eps^2."""
    pm = piecewise_variance(epsilon_value, 1.0)
    assert pm < laplace_noise_variance(epsilon_value, 2.0)


def test_a_value_budget_outside_the_samplers_range_is_refused_before_any_release() -> None:
    for mechanism in (PiecewiseMechanism(0.001, 0.001), PiecewiseMechanism(1.0, 13.0)):
        assert mechanism.epsilon == mechanism.ideal_epsilon  # planning only
        with pytest.raises(ValueError, match=r"epsilon_value must be in \[0.02, 12\] for M_P"):
            mechanism.perturb(np.zeros(3, dtype=np.int64), np.zeros(3), secure_generator())


def test_reports_are_exact_multiples_of_a_power_of_two_and_checked() -> None:
    mechanism = PiecewiseMechanism(1.0, 2.0)
    grid = mechanism.grid
    reports = mechanism.perturb(
        np.zeros(10_000, dtype=np.int64), np.full(10_000, 0.3), secure_generator()
    ).values
    assert math.log2(grid.step).is_integer()
    assert mechanism.is_valid_report_value(reports).all()
    bad = np.array([grid.step * 0.5, mechanism.report_bound + 2 * grid.step, np.nan, np.inf])
    off_parity = reports[:1] + grid.step  # the neighbouring multiple has the other parity
    assert not mechanism.is_valid_report_value(np.append(bad, off_parity)).any()


# --- the gap estimator: bias, variance, coverage -------------------------------------------


def population(num_groups: int, num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, num_groups, size=num_clients)
    shapes = np.array([(8.0, 2.0), (5.0, 3.0), (2.0, 2.0), (3.0, 6.0), (1.0, 1.0)])
    metrics = rng.beta(shapes[groups, 0], shapes[groups, 1])
    return groups, 2.0 * metrics - 1.0


@pytest.mark.parametrize(("num_groups", "budget"), [(2, 4.0), (5, 6.0)])
def test_gap_estimates_are_unbiased_and_their_intervals_cover(
    num_groups: int, budget: float
) -> None:
    mechanism = optimal_split("P", budget, num_groups).build()
    assert isinstance(mechanism, PiecewiseMechanism)
    groups, values = population(num_groups, 20_000, seed=31 + num_groups)
    sizes = np.bincount(groups, minlength=num_groups)
    sums = np.bincount(groups, weights=values, minlength=num_groups)
    squares = np.bincount(groups, weights=values**2, minlength=num_groups)
    truth = (sums / sizes + 1.0) / 2.0  # metric units
    rng = np.random.Generator(np.random.PCG64(2026))
    reps, confidence = 600, 0.95
    for known in (True, False):
        differences, covered = [], []
        for _ in range(reps):
            reports = mechanism.perturb(groups, values, rng, validate=False)
            summary = ReportSummary.from_reports(reports.groups, reports.values, num_groups)
            estimate = estimate_gap(
                summary,
                mechanism,
                group_sizes=sizes.tolist() if known else None,
                confidence=confidence,
            )
            true_differences = np.array([truth[i] - truth[j] for i, j in estimate.pairs])
            differences.append(estimate.differences)
            half = estimate.normal_halfwidths
            covered.append(np.abs(estimate.differences - true_differences) <= half)
        diffs = np.array(differences)
        # unbiased: each pair's mean difference within 4 Monte Carlo SE of the truth
        se = diffs.std(axis=0, ddof=1) / math.sqrt(reps)
        assert np.all(np.abs(diffs.mean(axis=0) - true_differences) <= 4 * se)
        # the variance formula (true sizes and sums of v^2, independent of the plug-ins)
        cov = estimator_covariance(
            mechanism.moments, groups.size, sizes, sums, squares, sizes_known=known
        )
        first = np.array([i for i, _ in estimate.pairs])
        second = np.array([j for _, j in estimate.pairs])
        formula = (cov[first, first] + cov[second, second] - 2 * cov[first, second]) / 4.0
        relative = 4.5 * math.sqrt(2.0 / (reps - 1))
        np.testing.assert_allclose(diffs.var(axis=0, ddof=1), formula, rtol=relative)
        # coverage of every pair's normal interval: >= nominal - 4 binomial SE
        coverage = np.array(covered).mean(axis=0)
        floor = confidence - 4 * math.sqrt(confidence * (1 - confidence) / reps)
        assert np.all(coverage >= floor), coverage


# --- the planner and "best" ---------------------------------------------------------------


def test_best_chooses_pm_where_its_interval_is_narrower_and_not_elsewhere() -> None:
    for num_groups, budget, winner in [
        (2, 0.5, "R"),
        (2, 1.0, "R"),
        (2, 4.0, "P"),
        (2, 8.0, "P"),
        (5, 1.0, "R"),
        (5, 8.0, "P"),
    ]:
        splits = {name: optimal_split(name, budget, num_groups) for name in ("R", "L", "P")}
        smallest = min(splits.values(), key=lambda split: split.variance_factor)
        assert smallest.mechanism == winner, (num_groups, budget)
        # "best" also weighs M_N, which is tighter still where M_P beats M_R
        # (tests/test_nprr.py): it takes M_P's split only if it is M_N's too
        chosen = best_split("best", budget, num_groups)
        assert chosen.mechanism in (winner, "N")
        assert chosen.variance_factor <= smallest.variance_factor
    # M_P's split is tighter than M_L's at every budget of the guide's table (it pays the
    # same eps1 + eps2 / 2 for a smaller value variance), e.g. at 8 a third of M_L's
    for num_groups in (2, 5):
        for budget in (0.5, 1.0, 2.0, 4.0, 8.0):
            piecewise = optimal_split("P", budget, num_groups).variance_factor
            assert piecewise < optimal_split("L", budget, num_groups).variance_factor
    assert optimal_split("P", 8.0).variance_factor < 0.4 * optimal_split("L", 8.0).variance_factor


def test_the_planned_variance_is_the_monte_carlo_one() -> None:
    """The variance factor (K Var of the gap at the worst-case values, |v| = 1, known sizes)
    against R = 800 perturbations of such a population."""
    split = optimal_split("P", 4.0, 2)
    mechanism = split.build()
    clients = 10_000
    groups = np.repeat([0, 1], clients // 2)
    values = np.where(np.arange(clients) % 2 == 0, 1.0, -1.0)
    sizes = [clients // 2, clients // 2]
    rng = np.random.Generator(np.random.PCG64(99))
    reps = 800
    gaps = []
    for _ in range(reps):
        reports = mechanism.perturb(groups, values, rng, validate=False)
        summary = ReportSummary.from_reports(reports.groups, reports.values, 2)
        gaps.append(estimate_gap(summary, mechanism, group_sizes=sizes).differences[0])
    value_units = 4.0 * clients * float(np.var(gaps, ddof=1))  # metric -> value units
    assert value_units == pytest.approx(split.variance_factor, rel=4.5 * math.sqrt(2 / reps))
