"""The mechanism table benchmark (benchmarks/mechanism_table.py): its numbers agree with each
other at a small size.

Tolerances: a cell's estimate D of the largest gap's difference is a sum of n independent
bounded reports divided by (estimated) sizes, so it is close to normal with the estimator's
variance s^2 (bias O(1/n) relative, from the ratio with estimated sizes: far below what R
replicates resolve). Then R * MSE / s^2 is chi-square with R degrees of freedom, the mean error
is N(0, s^2 / R), and the number of 95 % intervals that cover is binomial(R, 0.95) when the
interval's standard error is consistent (M_L, M_P), at least that when it is conservative (M_R,
whose plug-in sum of v^2 is its smallest value given the mean; M_N, whose moments take NPRR's
rounding variance at its bound while +/-1 values are never rounded). Every check is two-sided
at 0.001 (seeded: the run is fixed; 0.001 says how unlikely a correct estimator fails it).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from scipy import stats

from benchmarks import mechanism_table as table
from fedparity.mechanisms.ldp.estimators import normal_quantile

REPLICATES = 200
USERS = 20_000
BUDGET = 4.0  # every mechanism releases; M_N has G = 4 (its rounding bound matters)
ALPHA = 0.001


@pytest.fixture(scope="module")
def people() -> table.Population:
    return table.population(USERS, 2)


@pytest.fixture(scope="module")
def cells(people: table.Population) -> dict[str, table.CellResult]:
    return {
        name: table.run_cell(name, BUDGET, people, REPLICATES, np.random.default_rng([2026, index]))
        for index, name in enumerate(table.NAMES)
    }


def test_population_is_fixed_balanced_and_binary() -> None:
    two = table.population(1000, 2)
    assert np.array_equal(np.bincount(two.groups), [500, 500])
    assert set(np.unique(two.values)) == {-1.0, 1.0}
    assert two.means == pytest.approx([0.6, 0.4], abs=1e-12)
    five = table.population(10_000, 5)
    assert five.means == pytest.approx([0.6, 0.55, 0.5, 0.45, 0.4], abs=1e-12)
    assert five.largest_gap == pytest.approx(0.2, abs=1e-12)
    for group in range(5):  # sums and squares match the arrays
        values = five.values[five.groups == group]
        assert five.sums[group] == values.sum()
        assert five.square_sums[group] == (values**2).sum()
    with pytest.raises(ValueError, match="num_users must be a multiple of num_groups"):
        table.population(1001, 2)


@pytest.mark.parametrize("name", table.NAMES)
def test_mse_matches_the_analytic_variance(cells: dict[str, table.CellResult], name: str) -> None:
    cell = cells[name]
    assert cell.unavailable is None and cell.failures == 0
    assert cell.epsilon <= BUDGET
    ratio = cell.mse / cell.analytic_stderr**2  # R * ratio ~ chi-square(R)
    low = stats.chi2.ppf(ALPHA / 2, REPLICATES) / REPLICATES
    high = stats.chi2.ppf(1 - ALPHA / 2, REPLICATES) / REPLICATES
    assert low <= ratio <= high, (name, ratio, low, high)
    z = normal_quantile(1 - ALPHA)
    assert abs(cell.bias) <= z * cell.analytic_stderr / np.sqrt(REPLICATES), name
    # the Monte Carlo standard error of the MSE: sd of the squared errors / sqrt(R), which for
    # normal errors is about sqrt(2) MSE / sqrt(R)
    assert cell.mse_stderr == pytest.approx(np.sqrt(2 / REPLICATES) * cell.mse, rel=0.5)


@pytest.mark.parametrize("name", table.NAMES)
def test_coverage_within_binomial_bounds(cells: dict[str, table.CellResult], name: str) -> None:
    cell = cells[name]
    low = stats.binom.ppf(ALPHA / 2, REPLICATES, 0.95)
    high = stats.binom.ppf(1 - ALPHA / 2, REPLICATES, 0.95)
    assert cell.covered >= low, (name, cell.covered)
    if name in ("L", "P"):  # a consistent standard error: coverage is 0.95, not more
        assert cell.covered <= high, (name, cell.covered)
        assert cell.reported_stderr == pytest.approx(cell.analytic_stderr, rel=0.05)
    else:  # conservative plug-ins (module docstring)
        assert cell.reported_stderr > cell.analytic_stderr
    # d = 2: the interval is the pair's normal one, never folded at a gap of 10 standard errors
    z = normal_quantile(0.95)
    assert cell.mean_width == pytest.approx(2 * z * cell.reported_stderr, rel=1e-9)


@pytest.mark.parametrize("num_groups", [2, 5])
def test_planner_stderr_is_the_worst_case_of_the_analytic_one(num_groups: int) -> None:
    """Known sizes: for M_L and M_P, values +/-1 are their worst case (sum v^2 = n), so the
    planner's standard error is the analytic one; M_R's worst case is v = 0 and M_N's moments
    bound the rounding, so theirs is larger."""
    people = table.population(1000 * num_groups, num_groups)
    for name in table.NAMES:
        cell = table.run_cell(name, BUDGET, people, 2, np.random.default_rng(1), known_sizes=True)
        if name in ("L", "P"):
            assert cell.planner_stderr == pytest.approx(cell.analytic_stderr, rel=1e-9)
        else:
            assert cell.planner_stderr > 1.01 * cell.analytic_stderr, name


def test_a_mechanism_that_cannot_release_gets_a_row(people: table.Population) -> None:
    rows = [table.run_cell(name, 0.01, people, 2, np.random.default_rng(0)) for name in table.NAMES]
    by_name = {row.mechanism: row for row in rows}
    for name in ("L", "P"):
        assert by_name[name].unavailable is not None
        assert "epsilon_value must be in [0.02, 12]" in by_name[name].unavailable
    assert by_name["R"].unavailable is None
    detailed = table.detailed_table(rows)
    assert "| M_L | not releasable: epsilon_value must be in [0.02, 12] for M_L" in detailed
    assert "not releasable" in table.side_by_side(rows)


def test_planner_choice_among_four_uses_the_moments() -> None:
    # eps = 8, d = 2: M_N (G = 12) has the smallest worst-case variance factor (0.08 against
    # M_P's 0.20); at eps = 0.5 M_N has G = 1 and is M_R
    assert table.planner_choice(8.0, 2)[1] == "M_N"
    assert table.planner_choice(0.5, 2)[1] == "M_R = M_N"


def test_main_writes_the_tables(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(table, "QUICK_SIZES", ((2000, 3),))
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    assert table.main(["--quick", "--epsilons", "2", "--groups", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["mechanism"] for row in rows] == list(table.NAMES)
    assert all(row["replicates"] == 3 and row["num_users"] == 2000 for row in rows)
    text = (tmp_path / "mechanism_table.md").read_text()
    assert "--epsilons 2 --groups 2" in text and "commit" in text and "load average" in text
    assert "| 2 | 2 | 2e+03 |" in text and "narrowest interval" in text
    assert json.loads((tmp_path / "mechanism_table.json").read_text()) == rows


@pytest.mark.parametrize("budget", [2.0, 4.0, 8.0])
def test_population_moments_of_m_n_are_exact_for_values_on_the_grid(budget: float) -> None:
    """E[v'^2 | kept, v = +/-1] enumerated from M_N's realised output distribution equals
    kept_second_moment + slope of :func:`population_moments` (its rounding term removed)."""
    mechanism = table.build("N", budget, 2)
    assert mechanism.grid_size > 1
    a = float(mechanism.exact_probabilities()[0])
    moments = table.population_moments(mechanism)
    for grid_value in (0, mechanism.grid_size):  # v = -1 and v = +1
        distribution = mechanism.exact_output_distribution(0, grid_value)
        second = sum(
            float(p) * (2 * z / mechanism.grid_size - 1) ** 2
            for (group, z), p in distribution.items()
            if group == 0
        )
        exact = second / a
        assert moments.kept_second_moment + moments.kept_second_moment_slope == pytest.approx(
            exact, rel=1e-12
        )
        assert mechanism.moments.kept_second_moment > moments.kept_second_moment


def _cell(name: str, mse: float, mse_stderr: float, width: float) -> table.CellResult:
    return dataclasses.replace(
        table._unavailable(name, 1.0, 2, 100, 10, ""),
        unavailable=None,
        mse=mse,
        mse_stderr=mse_stderr,
        mean_width=width,
    )


def test_winners_are_ties_within_the_monte_carlo_error() -> None:
    rows = [
        _cell("R", 1.0, 0.1, 0.50),
        _cell("L", 1.25, 0.1, 0.502),  # 0.25 <= 2 * hypot(0.1, 0.1) = 0.28: a tie
        _cell("P", 1.3, 0.1, 0.40),  # 0.3 > 0.28: separated
        _cell("N", 0.9, 0.01, 0.403),
    ]
    assert table.smallest_mse(rows) == "M_N ≈ M_R"  # 0.1 <= 2 * hypot(0.1, 0.01)
    assert table.smallest_mse(rows[:3]) == "M_R ≈ M_L"
    assert table.narrowest_interval(rows) == "M_P = M_N"  # within 1 %
    assert table.narrowest_interval(rows[:2]) == "M_R = M_L"
    assert table.smallest_mse([table._unavailable("L", 1.0, 2, 100, 10, "no")]) == "-"
