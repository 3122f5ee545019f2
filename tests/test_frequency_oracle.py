"""Frequency oracles (GRR, optimal unary encoding, subset selection): privacy, unbiasedness,
variance and the variance-based chooser.

Statistical tests are seeded Monte Carlo runs whose tolerances come from the math: each check
allows a family-wise false-alarm probability of 0.001 (Bonferroni over the coordinates), so a
wrong formula fails and a right one passes with a seed-independent margin.
"""

from __future__ import annotations

import importlib
import itertools
import math

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import FrequencyOracle, frequency_oracle
from fedparity.mechanisms.ldp.frequency_oracle import CHUNK

frequency_oracle_module = importlib.import_module("fedparity.mechanisms.ldp.frequency_oracle")

FAMILY_ALPHA = 1e-3


def all_oracles(epsilon: float, k: int) -> list[FrequencyOracle]:
    """GRR, OUE and subset selection with every omega in [1, k - 1]."""
    return [
        FrequencyOracle("grr", epsilon, k, 1),
        FrequencyOracle("oue", epsilon, k, 0),
        *(FrequencyOracle("ss", epsilon, k, w) for w in range(1, k)),
    ]


# ---- privacy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("epsilon", [0.3, 1.0, 2.5])
def test_worst_likelihood_ratio_of_the_enumerated_outputs_is_e_to_the_epsilon(
    k: int, epsilon: float
) -> None:
    for oracle in all_oracles(epsilon, k):
        tables = [oracle.output_distribution(x) for x in range(k)]
        outputs = set(tables[0])
        for table in tables:
            assert set(table) == outputs
            assert math.isclose(sum(table.values()), 1.0, rel_tol=0, abs_tol=1e-12), oracle
        worst = max(
            tables[x][y] / tables[other][y]
            for x, other in itertools.permutations(range(k), 2)
            for y in outputs
        )
        # The realised epsilon is the worst log-ratio, and it is the epsilon asked for.
        assert math.isclose(math.log(worst), oracle.epsilon, rel_tol=1e-12), oracle
        assert math.isclose(oracle.epsilon, epsilon, rel_tol=1e-12), oracle


def report_key(oracle: FrequencyOracle, reports: np.ndarray) -> np.ndarray:
    if oracle.name == "grr":
        return reports.astype(np.int64)
    return reports.astype(np.int64) @ (1 << np.arange(oracle.domain_size))


@pytest.mark.parametrize(
    "name,subset_size,sampler",
    [
        ("grr", 1, "default"),
        ("oue", 0, "default"),
        ("ss", 1, "table"),
        ("ss", 2, "table"),
        ("ss", 1, "floyd"),
        ("ss", 2, "floyd"),
    ],
)
def test_the_sampler_draws_the_enumerated_distribution(
    name: str, subset_size: int, sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chi-square goodness of fit of 60,000 reports of one user value against the exact output
    # distribution the privacy test enumerates; no report outside its support. Subset
    # selection has two samplers (a table of report shapes for small domains, Floyd's
    # algorithm for large ones): both are checked.
    if sampler == "floyd":
        monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    k, value, n = 5, 3, 60_000
    oracle = FrequencyOracle(name, 0.9, k, subset_size)
    reports = oracle.perturb(np.full(n, value), np.random.default_rng(7))
    table = oracle.output_distribution(value)
    if name == "grr":
        codes = {key: key[0] for key in table}
    else:
        codes = {key: sum(1 << j for j in key) for key in table}
    observed = np.bincount(report_key(oracle, reports), minlength=1 << k)
    expected = np.zeros_like(observed, dtype=np.float64)
    for key, probability in table.items():
        expected[codes[key]] = probability * n
    support = expected > 0
    assert observed[~support].sum() == 0
    result = stats.chisquare(observed[support], expected[support])
    assert result.pvalue > FAMILY_ALPHA / 6, result


@pytest.mark.parametrize("sampler", ["table", "floyd"])
def test_a_subset_size_above_half_the_domain_samples_right_too(
    sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sampler == "floyd":
        monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    oracle = FrequencyOracle("ss", 0.5, 5, 3)
    reports = oracle.perturb(np.full(40_000, 0), np.random.default_rng(3))
    assert np.all(reports.sum(axis=1) == 3)
    table = oracle.output_distribution(0)
    observed = np.bincount(report_key(oracle, reports), minlength=32)
    expected = np.zeros(32)
    for key, probability in table.items():
        expected[sum(1 << j for j in key)] = probability * 40_000
    assert stats.chisquare(observed[expected > 0], expected[expected > 0]).pvalue > 1e-3


# ---- unbiasedness and the covariance formula ---------------------------------------------


def monte_carlo_estimates(
    oracle: FrequencyOracle, counts: np.ndarray, repetitions: int, seed: int
) -> np.ndarray:
    """(repetitions, k) count estimates, each from a fresh perturbation of the same users."""
    k, n = oracle.domain_size, int(counts.sum())
    users = np.repeat(np.arange(k), counts)
    reports = oracle.perturb(np.tile(users, repetitions), np.random.default_rng(seed))
    if oracle.name == "grr":
        run = np.repeat(np.arange(repetitions), n)
        support = np.bincount(run * k + reports, minlength=repetitions * k).reshape(-1, k)
    else:
        support = reports.reshape(repetitions, n, k).sum(axis=1)
    return np.stack([oracle.estimate(row, n).counts for row in support])


@pytest.mark.parametrize(
    "oracle",
    [
        FrequencyOracle("grr", 1.0, 6, 1),
        FrequencyOracle("oue", 1.0, 6, 0),
        FrequencyOracle("ss", 1.0, 6, 2),
        FrequencyOracle("ss", 0.4, 6, 4),
    ],
    ids=repr,
)
def test_the_estimator_is_unbiased_and_its_covariance_formula_is_exact(
    oracle: FrequencyOracle,
) -> None:
    counts = np.array([400, 250, 150, 100, 60, 40])
    repetitions = 2000
    estimates = monte_carlo_estimates(oracle, counts, repetitions, seed=11)
    sigma = oracle.covariance(counts)
    # Linear statistics checked: every count, a pair sum (tests one covariance) and a fixed
    # +-1 contrast (tests all of them at once).
    contrast = np.array([1, -1, 1, -1, 1, -1], dtype=np.float64)
    weights = np.vstack([np.eye(6), [1, 1, 0, 0, 0, 0], contrast])
    truths = weights @ counts
    variances = np.einsum("ij,jk,ik->i", weights, sigma, weights)
    values = estimates @ weights.T
    checks = weights.shape[0]
    # Unbiased: the Monte Carlo mean is within z standard errors sqrt(Var / R) of the truth,
    # z at a family-wise level of 0.001 over the statistics.
    z = stats.norm.ppf(1 - FAMILY_ALPHA / (2 * checks))
    mean_z = (values.mean(axis=0) - truths) / np.sqrt(variances / repetitions)
    assert np.all(np.abs(mean_z) < z), mean_z
    # Variance: each estimate is a sum of n independent bounded terms (n = 1000), close to
    # normal, so (R - 1) s^2 / sigma^2 is close to chi-square with R - 1 degrees of freedom
    # (the excess kurtosis, O(1/n), widens the spread by under 1 %); two-sided quantiles at the
    # same family-wise level.
    ratio = values.var(axis=0, ddof=1) / variances
    low = stats.chi2.ppf(FAMILY_ALPHA / (2 * checks), repetitions - 1) / (repetitions - 1)
    high = stats.chi2.ppf(1 - FAMILY_ALPHA / (2 * checks), repetitions - 1) / (repetitions - 1)
    assert np.all((ratio > low) & (ratio < high)), (ratio, low, high)


def test_a_wrong_variance_would_be_caught() -> None:
    # Power check of the variance test above: GRR's variance without its (n - c_j) q (1 - q)
    # term is rejected by the same chi-square band.
    oracle = FrequencyOracle("grr", 1.0, 6, 1)
    counts = np.array([400, 250, 150, 100, 60, 40])
    estimates = monte_carlo_estimates(oracle, counts, 2000, seed=12)
    p, q = oracle.support_probability, oracle.other_support_probability
    wrong = counts * p * (1 - p) / (p - q) ** 2
    ratio = estimates.var(axis=0, ddof=1) / wrong
    high = stats.chi2.ppf(1 - FAMILY_ALPHA / 12, 1999) / 1999
    assert np.any(ratio > high)


def test_total_variance_is_the_trace_of_the_covariance_for_any_counts() -> None:
    rng = np.random.default_rng(0)
    for oracle in all_oracles(1.3, 7):
        counts = rng.multinomial(500, rng.dirichlet(np.ones(7)))
        assert math.isclose(
            np.trace(oracle.covariance(counts)), oracle.total_variance(500), rel_tol=1e-12
        )


def test_the_plug_in_covariance_is_the_formula_at_the_estimate() -> None:
    oracle = frequency_oracle("oue", 1.0, 5)
    estimate = oracle.estimate(np.array([300, 200, 210, 190, 180]), 1000)
    np.testing.assert_allclose(estimate.covariance, oracle.covariance(estimate.counts))
    np.testing.assert_allclose(estimate.frequencies, estimate.counts / 1000)


# ---- the chooser ---------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.2, 0.7, 1.0, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("k", [2, 3, 5, 8, 10, 20, 64, 200])
def test_best_picks_the_smallest_variance(epsilon: float, k: int) -> None:
    best = frequency_oracle("best", epsilon, k, num_users=10_000)
    candidates = all_oracles(epsilon, k)
    smallest = min(o.total_variance(10_000) for o in candidates)
    assert best.total_variance(10_000) <= smallest * (1 + 1e-12)
    # GRR beats OUE when k < 3 e^eps + 2 (Wang et al. 2017, from the variance at small
    # frequencies; the exact trace moves the crossing slightly, so not within 1 of it).
    grr, oue = candidates[0], candidates[1]
    boundary = 3 * math.exp(epsilon) + 2
    if abs(k - boundary) > 1:
        assert (grr.total_variance(1) < oue.total_variance(1)) == (k < boundary)


def test_best_subset_size_is_near_k_over_e_to_the_epsilon_plus_one() -> None:
    for epsilon, k in [(0.5, 100), (1.0, 100), (2.0, 200)]:
        omega = frequency_oracle("ss", epsilon, k).subset_size
        assert abs(omega - k / (math.exp(epsilon) + 1)) <= 1.0


# ---- counting path, validation ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["grr", "oue", "ss"])
def test_perturb_and_count_counts_the_reports_perturb_draws(name: str) -> None:
    oracle = frequency_oracle(name, 1.0, 12)
    values = np.random.default_rng(1).integers(0, 12, CHUNK - 5)
    counted = oracle.perturb_and_count(values, np.random.default_rng(2))
    reports = oracle.perturb(values, np.random.default_rng(2))
    np.testing.assert_array_equal(counted, oracle.support_counts(reports))


def test_floyds_counting_path_counts_omega_categories_per_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Floyd's path draws in a different order from perturb's, so only the total is exact.
    monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    oracle = frequency_oracle("ss", 1.0, 12)
    values = np.random.default_rng(1).integers(0, 12, 2 * CHUNK + 5)
    counted = oracle.perturb_and_count(values, np.random.default_rng(2))
    assert counted.sum() == oracle.subset_size * values.shape[0]


def test_grr_counting_matches_its_reports_across_chunks() -> None:
    oracle = frequency_oracle("grr", 0.5, 9)
    values = np.random.default_rng(4).integers(0, 9, 3 * (1 << 20) + 17).astype(np.int16)
    counted = oracle.perturb_and_count(values, np.random.default_rng(5))
    reports = oracle.perturb(values, np.random.default_rng(5))
    np.testing.assert_array_equal(counted, oracle.support_counts(reports))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: frequency_oracle("grr", 0.0, 8), "epsilon must be a finite number > 0"),
        (lambda: frequency_oracle("grr", 1.0, 1), r"domain_size must be an integer in \[2,"),
        (lambda: frequency_oracle("rappor", 1.0, 8), "oracle must be one of"),
        (lambda: frequency_oracle("best", 1.0, 8, num_users=0), "num_users must be an integer"),
        (lambda: FrequencyOracle("ss", 1.0, 8, 8), r"subset_size must be an integer in \[1, 7\]"),
        (
            lambda: frequency_oracle("oue", 1.0, 4).perturb(
                np.array([0, 4]), np.random.default_rng()
            ),
            r"values must be in \[0, 3\]",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).perturb(np.array([0, 1]), np.random),
            "rng must be a numpy.random.Generator",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).estimate(np.array([1, 2, 3]), 6),
            r"support_counts must have one entry per category \(4\)",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).estimate(np.array([1, 2, 3, 9]), 6),
            r"support_counts must be counts in \[0, num_users=6\]",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).covariance(np.ones(3)),
            "true_counts must have one entry per category",
        ),
    ],
)
def test_bad_input_is_refused_with_the_parameter_and_its_range(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
