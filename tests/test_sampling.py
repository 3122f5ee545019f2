"""The samplers draw from Algorithm 1's (M_R), M_L's and GRR's output distributions.

Reference distributions are built here from the definitions (Marc Juarez and Aleksandra
Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring Demographic Performance
Disparities in Federated Learning", AFCP workshop, PMLR, 2022, Definition 2, Algorithm 1,
Section 4), never from the library. Goodness of fit: chi-square for the finite output cells,
Kolmogorov-Smirnov for the Laplace noise; each has a power check against a deliberately wrong
reference so that the test could fail. Seeds are fixed, so every p-value is deterministic; the
1e-4 acceptance level is a safety margin, not a flakiness budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import (
    LaplaceMechanism,
    RandomizedResponseMechanism,
    ReportSummary,
    grr_frequency_estimate,
    grr_keep_probability,
    grr_perturb,
    summarize_stream,
)

N_PER_INPUT = 200_000
VALUES = (-1.0, -0.3, 0.5, 1.0)
SPLITS = ((1.0, 1.0), (0.5, 2.0))
ACCEPT = 1e-4
REJECT = 1e-6


def grr_probabilities(epsilon_group: float, num_groups: int) -> tuple[float, float]:
    scale = math.exp(epsilon_group) + num_groups - 1
    return math.exp(epsilon_group) / scale, 1.0 / scale


def mr_cell_probabilities(
    epsilon_group: float, epsilon_value: float, num_groups: int, group: int, value: float
) -> np.ndarray:
    """P[(g', v') | (g, v)] from Algorithm 1, flattened as index 2 g' + (v' == +1)."""
    a, q = grr_probabilities(epsilon_group, num_groups)
    b = math.exp(epsilon_value) / (1.0 + math.exp(epsilon_value))
    cells = np.zeros(2 * num_groups)
    for g_out in range(num_groups):
        p_group = a if g_out == group else q
        v_used = value if g_out == group else 0.0
        for bit in (0, 1):
            p_bit = (1.0 + v_used) / 2.0 if bit else (1.0 - v_used) / 2.0
            for bit_out in (0, 1):
                p_flip = b if bit_out == bit else 1.0 - b
                cells[2 * g_out + bit_out] += p_group * p_bit * p_flip
    return cells


def ml_sign_cell_probabilities(epsilon_group: float, num_groups: int, group: int) -> np.ndarray:
    """P[(g', sign of the noise)]: a/2 each sign when kept, (1-a)/(2(d-1)) otherwise.

    Laplace noise is symmetric and independent of the group step; index 2 g' + (noise > 0).
    """
    a, q = grr_probabilities(epsilon_group, num_groups)
    cells = np.full(2 * num_groups, q / 2.0)
    cells[2 * group : 2 * group + 2] = a / 2.0
    return cells


def observed_cells(groups: np.ndarray, positive: np.ndarray, num_groups: int) -> np.ndarray:
    return np.bincount(2 * groups + positive.astype(np.int64), minlength=2 * num_groups)


def ks_pvalue(sample: np.ndarray, scale: float) -> float:
    """KS test against Laplace(0, scale); asymptotic p-value (n >= 1e4 here)."""
    return float(stats.kstest(sample, "laplace", args=(0.0, scale), method="asymp").pvalue)


def chisquare_pvalue(observed: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities / probabilities.sum() * observed.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def mixed_inputs(num_groups: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, float]]]:
    """N_PER_INPUT clients for every (g, v) in groups x VALUES, interleaved in one batch."""
    inputs = [(g, v) for g in range(num_groups) for v in VALUES]
    index = np.tile(np.arange(len(inputs)), N_PER_INPUT)
    groups = np.array([g for g, _ in inputs])[index]
    values = np.array([v for _, v in inputs])[index]
    return groups, values, inputs


# --- M_R --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_groups", [2, 3])
@pytest.mark.parametrize(("eps1", "eps2"), SPLITS)
def test_mr_perturb_matches_algorithm1(eps1: float, eps2: float, num_groups: int) -> None:
    rng = np.random.default_rng(1000 + num_groups)
    groups, values, inputs = mixed_inputs(num_groups)
    mechanism = RandomizedResponseMechanism(eps1, eps2, num_groups)
    reports = mechanism.perturb(groups, values, rng)
    assert set(np.unique(reports.values).tolist()) <= {-1, 1}
    for which, (g, v) in enumerate(inputs):
        mine = slice(which, None, len(inputs))
        observed = observed_cells(reports.groups[mine], reports.values[mine] > 0, num_groups)
        assert observed.sum() == N_PER_INPUT
        right = mr_cell_probabilities(eps1, eps2, num_groups, g, v)
        assert chisquare_pvalue(observed, right) > ACCEPT, (g, v)
        # Power: the same counts must reject a table with eps1 off by 0.1, and (where v is
        # far enough from 0 for the value step to matter at this n) eps2 30% too large. The
        # expected chi-square statistic under the wrong table is df + lambda with
        # lambda = n sum (p - p')^2 / p'; we check lambda >= 100 so the rejection is certain
        # in expectation and not a lucky draw.
        wrong_group = mr_cell_probabilities(eps1 + 0.1, eps2, num_groups, g, v)
        assert chisquare_pvalue(observed, wrong_group) < REJECT, (g, v)
        if abs(v) >= 0.5:
            wrong_value = mr_cell_probabilities(eps1, 1.3 * eps2, num_groups, g, v)
            noncentrality = N_PER_INPUT * np.sum((right - wrong_value) ** 2 / wrong_value)
            assert noncentrality >= 100.0
            assert chisquare_pvalue(observed, wrong_value) < REJECT, (g, v)


# --- M_L --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_groups", [2, 3])
@pytest.mark.parametrize(("eps1", "eps2"), SPLITS)
def test_ml_perturb_matches_definition(eps1: float, eps2: float, num_groups: int) -> None:
    rng = np.random.default_rng(2000 + num_groups)
    groups, values, inputs = mixed_inputs(num_groups)
    mechanism = LaplaceMechanism(eps1, eps2, num_groups)
    reports = mechanism.perturb(groups, values, rng)
    assert reports.values.dtype == np.float64
    scale = 2.0 / eps2  # k = 2: kept and flipped noise are both Lap(2/eps2)
    for which, (g, v) in enumerate(inputs):
        mine = slice(which, None, len(inputs))
        out_groups, out_values = reports.groups[mine], reports.values[mine]
        kept = out_groups == g  # a flipped client always reports another group
        noise = np.where(kept, out_values - v, out_values)
        observed = observed_cells(out_groups, noise > 0, num_groups)
        assert chisquare_pvalue(observed, ml_sign_cell_probabilities(eps1, num_groups, g)) > (
            ACCEPT
        )
        assert (
            chisquare_pvalue(observed, ml_sign_cell_probabilities(eps1 + 0.1, num_groups, g))
            < REJECT
        )
        # Kept: v' - v ~ Lap(0, 2/eps2). Flipped, per reported group: v' ~ Lap(0, 2/eps2).
        samples = [noise[kept]] + [noise[out_groups == h] for h in range(num_groups) if h != g]
        for sample in samples:
            assert ks_pvalue(sample, scale) > ACCEPT
        # Power: a 10% wrong scale is rejected (the kept sample has >= 0.38 N draws).
        assert ks_pvalue(samples[0], 1.1 * scale) < REJECT
        flipped = noise[~kept]
        assert ks_pvalue(flipped, 1.1 * scale) < REJECT


# --- perturb_and_summarize --------------------------------------------------------------------


@pytest.mark.parametrize("num_groups", [2, 3])
def test_perturb_and_summarize_equals_summary_of_perturb(num_groups: int) -> None:
    data_rng = np.random.default_rng(7)
    count = 50_001
    groups = data_rng.integers(0, num_groups, count)
    values = data_rng.uniform(-1.0, 1.0, count)
    values[:5] = [-1.0, 1.0, 0.0, -1.0, 1.0]
    for mechanism in (
        RandomizedResponseMechanism(0.7, 1.3, num_groups),
        LaplaceMechanism(0.7, 1.3, num_groups),
    ):
        reports = mechanism.perturb(groups, values, np.random.default_rng(99))
        expected = ReportSummary.from_reports(reports.groups, reports.values, num_groups)
        fast = mechanism.perturb_and_summarize(groups, values, np.random.default_rng(99))
        assert fast.num_reports == expected.num_reports == count
        np.testing.assert_array_equal(fast.report_counts, expected.report_counts)
        if mechanism.name == "R":
            np.testing.assert_array_equal(fast.value_sums, expected.value_sums)
            np.testing.assert_array_equal(fast.value_square_sums, expected.value_square_sums)
        else:
            np.testing.assert_allclose(fast.value_sums, expected.value_sums, rtol=1e-9)
            np.testing.assert_allclose(
                fast.value_square_sums, expected.value_square_sums, rtol=1e-9
            )
        # A different generator state gives a different summary (the check is not vacuous).
        other = mechanism.perturb_and_summarize(groups, values, np.random.default_rng(100))
        assert not np.array_equal(other.value_sums, expected.value_sums)


# --- GRR ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_groups", [2, 3, 5])
@pytest.mark.parametrize("epsilon", [0.3, 2.0])
def test_grr_perturb_distribution(epsilon: float, num_groups: int) -> None:
    rng = np.random.default_rng(3000 + num_groups)
    categories = np.repeat(np.arange(num_groups), N_PER_INPUT)
    out = grr_perturb(categories, epsilon, num_groups, rng)
    for g in range(num_groups):
        observed = np.bincount(out[categories == g], minlength=num_groups)
        a, q = grr_probabilities(epsilon, num_groups)
        right = np.full(num_groups, q)
        right[g] = a
        assert chisquare_pvalue(observed, right) > ACCEPT
        a_wrong, q_wrong = grr_probabilities(epsilon + 0.1, num_groups)
        wrong = np.full(num_groups, q_wrong)
        wrong[g] = a_wrong
        assert chisquare_pvalue(observed, wrong) < REJECT


def test_grr_keep_probability_definition() -> None:
    for d in (2, 3, 5):
        for eps in (0.01, 1.0, 30.0):
            assert grr_keep_probability(eps, d) == pytest.approx(
                math.exp(eps) / (math.exp(eps) + d - 1), rel=1e-12
            )


@pytest.mark.parametrize("num_groups", [2, 3])
def test_grr_frequency_estimate_is_unbiased(num_groups: int) -> None:
    rng = np.random.default_rng(4000 + num_groups)
    epsilon, reps = 0.5, 2000
    sizes = np.array([1000, 3000, 1000][:num_groups])
    total = int(sizes.sum())
    categories = np.repeat(np.arange(num_groups), sizes)
    a, q = grr_probabilities(epsilon, num_groups)
    estimates = np.empty((reps, num_groups))
    for r in range(reps):
        out = grr_perturb(categories, epsilon, num_groups, rng)
        estimates[r] = grr_frequency_estimate(np.bincount(out, minlength=num_groups), total, a)
    # n'_G is a sum of independent Bernoullis: n_G with p = a, K - n_G with p = q, so
    # Var(n'_G) = n_G a(1-a) + (K - n_G) q(1-q) and Var(n_hat) = Var(n'_G) / (a - q)^2;
    # the mean of R estimates has SE sqrt(Var(n_hat) / R).
    variance = (sizes * a * (1 - a) + (total - sizes) * q * (1 - q)) / (a - q) ** 2
    standard_error = np.sqrt(variance / reps)
    assert np.all(np.abs(estimates.mean(axis=0) - sizes) <= 4 * standard_error)
    # And its Monte Carlo variance matches (relative SE of a variance ~ sqrt(2/(R-1))).
    relative = estimates.var(axis=0, ddof=1) / variance
    assert np.all(np.abs(relative - 1.0) <= 4.5 * math.sqrt(2.0 / (reps - 1)))
    # The estimates sum to K exactly (the counts do, and the estimator is affine).
    np.testing.assert_allclose(estimates.sum(axis=1), total, rtol=1e-12)


# --- input validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mechanism",
    [RandomizedResponseMechanism(1.0, 1.0, 3), LaplaceMechanism(1.0, 1.0, 3)],
    ids=["R", "L"],
)
def test_perturb_rejects_bad_inputs(mechanism: RandomizedResponseMechanism) -> None:
    rng = np.random.default_rng(0)
    good_groups = np.array([0, 1, 2])
    good_values = np.array([0.0, 0.5, -0.5])
    for method in (mechanism.perturb, mechanism.perturb_and_summarize):
        for groups in ([0, 3, 1], [-1, 0, 1], [0.5, 1, 2]):
            with pytest.raises(ValueError, match="groups"):
                method(np.array(groups), good_values, rng)
        for values in (
            [0.0, 1.5, 0.0],
            [-1.0001, 0.0, 0.0],
            [0.0, math.nan, 0.0],
            [math.inf, 0, 0],
        ):
            with pytest.raises(ValueError, match="values"):
                method(good_groups, np.array(values), rng)
        with pytest.raises(ValueError, match="length"):
            method(good_groups, np.array([0.0, 0.5]), rng)


@pytest.mark.parametrize(
    "rng",
    [42, np.random.RandomState(0), None],
    ids=["int", "RandomState", "None"],
)
def test_every_sampler_wants_an_explicit_generator(rng: object) -> None:
    """A seed, the legacy RandomState or None is refused with a message naming rng."""
    groups, values = np.array([0, 1, 1]), np.array([0.0, 0.5, -0.5])
    for mechanism in (RandomizedResponseMechanism(1.0, 1.0, 2), LaplaceMechanism(1.0, 1.0, 3)):
        for method in (mechanism.perturb, mechanism.perturb_and_summarize):
            with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
                method(groups, values, rng)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
            summarize_stream(mechanism, [(groups, values)], rng)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
        grr_perturb(groups, 1.0, 2, rng)  # type: ignore[arg-type]


def test_grr_perturb_rejects_bad_categories() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="categories"):
        grr_perturb(np.array([0, 1, 3]), 1.0, 3, rng)
    with pytest.raises(ValueError, match="categories"):
        grr_perturb(np.array([-1, 1]), 1.0, 3, rng)
    with pytest.raises(ValueError, match="epsilon"):
        grr_perturb(np.array([0, 1]), 0.0, 3, rng)
    with pytest.raises(ValueError, match="num_groups"):
        grr_perturb(np.array([0, 0]), 1.0, 1, rng)
