"""FedEvalFair (mechanisms/fairness_tests/fedevalfair.py): bootstrap, both stages, TOST, protocol
sums, errors.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version); "the paper" below.

Reference values are computed here, independently of the library:

* Graybill-Deal mu_hat, the paper's T1 (Eq. 10), Cochran's Q and W* (Algorithm 2) are written
  out below; p-values come from ``scipy.stats.chi2`` / ``scipy.stats.norm``.
* T1's exact null distribution for normal data with known variances: sqrt(w_i)(Ybar_i - mu_hat)
  = (P z)_i with z ~ N(0, I), P = I - u u^T, u_i = sqrt(omega_i); so T1 = z^T P D P z with
  D = diag(1 / (1 - omega_i)), a weighted sum of chi2(1) (eigenvalues of P D P), whose tail is
  computed with Imhof's (1961) integral. Q = z^T P z is exactly chi2(k - 1).
* The bootstrap distribution of a difference of two rates: given the resample's group counts
  N0*, N1*, the two rates are independent with means p0_hat, p1_hat (the full-data rates), so
  E*[Y*] = plug-in and Var*[Y*] = p0(1-p0) E*[1/N0*] + p1(1-p1) E*[1/N1*] with N0* ~ Bin(n, n0/n)
  (conditioned on both >= 1, which the redraws enforce), summed over scipy's binomial pmf.
* The rejection rates of T1 and Q from a separate 20,000-draw simulation (each), quoted in the
  docstring of :mod:`fedparity.mechanisms.fairness_tests.fedevalfair`.

Tolerances: a rejection rate p estimated from R draws has SE sqrt(p (1 - p) / R); comparing with
another R'-draw simulation (the quoted one, R' = 20,000) uses SE sqrt(p (1 - p) (1/R + 1/R')). A
mean of B bootstrap values has SE sqrt(Var / B); a sample variance of B roughly normal values
has relative SE sqrt(2 / (B - 1)). We accept 4 SE.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from scipy import integrate, stats

from fedparity.mechanisms import (
    ClientSummary,
    FairnessReport,
    InsufficientGroupData,
    bootstrap_disparity,
    client_contribution,
    common_disparity_test,
    disparity_variance,
    equivalence_test,
    fedevalfair,
    homogeneity_test,
    report_from_sums,
    stage1_statistic,
    stage1_term,
    stage_statistics,
)
from fedparity.mechanisms.fairness_tests.fedevalfair import ROUND1_FIELDS, STAGE1_FIELDS

# --- independent reference formulas -----------------------------------------------------------


def reference_stages(
    means: np.ndarray, variances: np.ndarray, sizes: np.ndarray, mode: str, mu0: float = 0.0
) -> dict[str, float]:
    """Paper Eq. 6-10 and Algorithm 2 (mode "paper"), Cochran's Q (mode "calibrated")."""
    means, variances, sizes = (np.asarray(a, dtype=float) for a in (means, variances, sizes))
    w = sizes / variances if mode == "paper" else 1.0 / variances
    mu_hat = float(np.sum(w * means) / np.sum(w))
    omega = w / np.sum(w)
    squares = w * (means - mu_hat) ** 2
    statistic = float(np.sum(squares / (1.0 - omega))) if mode == "paper" else float(squares.sum())
    k = means.size
    w_star = math.sqrt(np.sum(w)) * (mu_hat - mu0)
    return {
        "estimate": mu_hat,
        "stderr": 1.0 / math.sqrt(np.sum(w)),
        "stage1": statistic,
        "p1": float(stats.chi2.sf(statistic, k - 1)),
        "stage2": w_star,
        "p2": float(2.0 * min(stats.norm.sf(w_star), stats.norm.cdf(w_star))),
    }


def imhof_tail(eigenvalues: np.ndarray, x: float) -> float:
    """P(sum_j lambda_j chi2_1 > x), Imhof (1961): 1/2 + 1/pi int_0^inf sin(theta(u)) / (u rho(u)).

    theta(u) = sum_j arctan(lambda_j u) / 2 - x u / 2, rho(u) = prod_j (1 + lambda_j^2 u^2)^(1/4).
    The integral is truncated at U where the envelope's tail, <= (2/m) U^(-m/2) / prod
    sqrt(lambda_j) for m >= 4 eigenvalues, is below 1e-7, and computed with Simpson's rule at
    200 points per period 4 pi / x of the oscillation.
    """
    lam = np.asarray(eigenvalues, dtype=float)
    m = lam.size
    assert m >= 4
    upper = (1e-7 * m / 2 * np.prod(np.sqrt(lam))) ** (-2.0 / m)
    points = int(upper / (4 * math.pi / x) * 200) | 1
    u = np.linspace(1e-9, upper, points)
    theta = 0.5 * np.arctan(np.outer(u, lam)).sum(axis=1) - 0.5 * x * u
    rho = np.prod((1.0 + np.outer(u, lam) ** 2) ** 0.25, axis=1)
    value = integrate.simpson(np.sin(theta) / (u * rho), x=u)
    return 0.5 + float(value) / math.pi


def paper_t1_rejection_rate(weights: np.ndarray, alpha: float = 0.05) -> float:
    """Exact P(T1 > chi2_{k-1, alpha}) for normal Ybar_i with known variances 1 / w_i."""
    omega = weights / weights.sum()
    u = np.sqrt(omega)
    projection = np.eye(omega.size) - np.outer(u, u)
    matrix = projection @ np.diag(1.0 / (1.0 - omega)) @ projection
    eigenvalues = np.linalg.eigvalsh(matrix)
    eigenvalues = eigenvalues[eigenvalues > 1e-9]
    assert eigenvalues.size == omega.size - 1
    critical = float(stats.chi2.ppf(1.0 - alpha, omega.size - 1))
    if eigenvalues.size == 1:  # lambda chi2(1): closed form (Imhof's integrand decays slowly)
        return float(stats.chi2.sf(critical / eigenvalues[0], 1))
    return imhof_tail(eigenvalues, critical)


def random_summaries(rng: np.random.Generator, k: int, mode: str) -> list[ClientSummary]:
    return [
        ClientSummary(
            mean=float(rng.normal(0.05, 0.03)),
            variance=float(rng.uniform(2e-4, 3e-3)),
            n=int(rng.integers(50, 500)),
        )
        for _ in range(k)
    ]


def arrays(summaries: list[ClientSummary]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array([s.mean for s in summaries]),
        np.array([s.variance for s in summaries]),
        np.array([s.n for s in summaries]),
    )


# --- stage statistics against the written formulas ---------------------------------------------


@pytest.mark.parametrize("mode", ["paper", "calibrated"])
@pytest.mark.parametrize("k", [2, 3, 7])
def test_stages_match_the_written_formulas(mode: str, k: int) -> None:
    rng = np.random.default_rng(100 + k)
    summaries = random_summaries(rng, k, mode)
    ref = reference_stages(*arrays(summaries), mode, mu0=0.01)
    report = fedevalfair(summaries, mode=mode, mu0=0.01)  # type: ignore[arg-type]
    assert report.k == k and report.mode == mode
    h, c = report.homogeneity, report.common_disparity
    assert h.statistic == pytest.approx(ref["stage1"], rel=1e-12)
    assert h.dof == k - 1
    assert h.pvalue == pytest.approx(ref["p1"], rel=1e-10)
    assert c.statistic == pytest.approx(ref["stage2"], rel=1e-12)
    assert c.pvalue == pytest.approx(ref["p2"], rel=1e-10)
    assert c.dof is None and c.null_value == 0.01
    for result in (h, c):
        assert result.estimate == pytest.approx(ref["estimate"], rel=1e-12)
        assert result.stderr == pytest.approx(ref["stderr"], rel=1e-12)
        assert result.mode == mode and result.k == k
    assert homogeneity_test(summaries, mode=mode).statistic == h.statistic  # type: ignore[arg-type]
    assert common_disparity_test(summaries, mode=mode, mu0=0.01).pvalue == c.pvalue  # type: ignore[arg-type]


def test_paper_t1_and_cochran_q_differ_exactly_by_one_minus_omega() -> None:
    # Same weights in both modes: paper w = n / S^2, calibrated w = 1 / S'^2 with S'^2 = S^2 / n.
    rng = np.random.default_rng(7)
    for k in (2, 4, 9):
        paper = random_summaries(rng, k, "paper")
        calibrated = [ClientSummary(s.mean, s.variance / s.n, s.n) for s in paper]
        t1 = fedevalfair(paper, mode="paper").homogeneity.statistic
        q = fedevalfair(calibrated, mode="calibrated").homogeneity.statistic
        means, variances, sizes = arrays(paper)
        w = sizes / variances
        omega = w / w.sum()
        mu_hat = np.sum(w * means) / w.sum()
        terms = w * (means - mu_hat) ** 2
        assert q == pytest.approx(terms.sum(), rel=1e-12)
        assert t1 == pytest.approx(np.sum(terms / (1.0 - omega)), rel=1e-12)
        if k == 2:
            # With two clients sum_i w_i omega_j^2 / omega_j = 2 w1 w2 / (w1 + w2) D^2 = 2 Q.
            assert t1 == pytest.approx(2.0 * q, rel=1e-12)
        # The estimate and its standard error do not depend on the mode given the weights.
        assert fedevalfair(paper, mode="paper").estimate == pytest.approx(
            fedevalfair(calibrated).estimate, rel=1e-12
        )


def test_confidence_interval_matches_stage2_decision() -> None:
    rng = np.random.default_rng(3)
    summaries = random_summaries(rng, 4, "calibrated")
    report = fedevalfair(summaries, alpha=0.1)
    z = stats.norm.ppf(0.95)
    interval = report.confidence_interval(0.9)
    assert interval.low == pytest.approx(report.estimate - z * report.stderr, rel=1e-12)
    assert interval.high == pytest.approx(report.estimate + z * report.stderr, rel=1e-12)
    # At level 1 - alpha the interval excludes mu0 exactly when stage 2 rejects.
    for mu0 in np.linspace(report.estimate - 3 * report.stderr, report.estimate, 13):
        shifted = fedevalfair(summaries, alpha=0.1, mu0=float(mu0))
        excluded = not interval.low <= mu0 <= interval.high
        if abs(abs(mu0 - report.estimate) - z * report.stderr) > 1e-9:
            assert shifted.reject_fairness == excluded


# --- The paper's T1 is not chi2(k - 1); Cochran's Q is -----------------------------------------

SPEC_T1_RATES = {2: 0.164, 5: 0.109, 11: 0.082}  # the reference 20,000-draw simulation
SPEC_Q_RATES = {2: 0.051, 5: 0.051, 11: 0.049}
SPEC_DRAWS = 20_000
DRAWS = 100_000


def sigma_configuration(name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(sigma_i, n_i): equal, or heterogeneous (sigma 1..3, n 500..50: weights 500 .. 5.6)."""
    if name == "equal":
        return np.ones(k), np.full(k, 100)
    return np.linspace(1.0, 3.0, k), np.linspace(500, 50, k).round()


@functools.cache
def known_variance_simulation(k: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """T1 (paper mode) and Q (calibrated mode) over DRAWS normal data sets, true sigma^2."""
    sigma, n = sigma_configuration(name, k)
    rng = np.random.default_rng(2_100 + k + (0 if name == "equal" else 50))
    means = rng.normal(0.08, sigma / np.sqrt(n), size=(DRAWS, k))  # Ybar_i ~ N(mu, sigma^2/n)
    paper = stage_statistics(means, sigma**2, n, mode="paper")  # w = n / sigma^2
    calibrated = stage_statistics(means, sigma**2 / n, n, mode="calibrated")  # w = n / sigma^2
    return paper.homogeneity_statistic, calibrated.homogeneity_statistic, n / sigma**2


@pytest.mark.parametrize("name", ["equal", "heterogeneous"])
@pytest.mark.parametrize("k", [2, 5, 11])
@pytest.mark.slow
def test_spec_reference_rates_of_t1_and_q(k: int, name: str) -> None:
    t1, q, weights = known_variance_simulation(k, name)
    critical = stats.chi2.ppf(0.95, k - 1)
    t1_rate, q_rate = float(np.mean(t1 > critical)), float(np.mean(q > critical))
    # Against the reference simulation: both estimates carry MC error.
    spec = SPEC_T1_RATES[k]
    se = math.sqrt(spec * (1 - spec) * (1 / DRAWS + 1 / SPEC_DRAWS))
    assert abs(t1_rate - spec) <= 4 * se, (t1_rate, spec, se)
    se_q = math.sqrt(0.05 * 0.95 / DRAWS)
    assert abs(q_rate - 0.05) <= 4 * se_q, q_rate
    spec_q = SPEC_Q_RATES[k]
    assert abs(q_rate - spec_q) <= 4 * math.sqrt(0.05 * 0.95 * (1 / DRAWS + 1 / SPEC_DRAWS))
    # Against the exact rate of T1 for these weights (Imhof); with equal weights
    # T1 = k Q / (k - 1), so the rate is chi2.sf(c (k - 1) / k, k - 1) in closed form.
    exact = paper_t1_rejection_rate(weights)
    if name == "equal" or k == 2:
        assert exact == pytest.approx(stats.chi2.sf(critical * (k - 1) / k, k - 1), abs=1e-6)
    assert abs(t1_rate - exact) <= 4 * math.sqrt(exact * (1 - exact) / DRAWS)


@pytest.mark.parametrize("k", [2, 5, 11])
@pytest.mark.slow
def test_q_is_chi2_and_t1_is_not(k: int) -> None:
    t1, q, _ = known_variance_simulation(k, "heterogeneous")
    null = stats.chi2(k - 1)
    assert stats.kstest(q, null.cdf).pvalue > 1e-3  # exact chi2(k - 1): fails w.p. 1e-3
    assert stats.kstest(t1, null.cdf).pvalue < 1e-12  # T1 is stochastically larger
    assert np.mean(t1) > (k - 1) * 1.05  # E[T1] = trace(P D P) > k - 1 = E[Q]


# --- bootstrap ---------------------------------------------------------------------------------


def client_data(
    rng: np.random.Generator, n: int, minority: float, rate0: float, rate1: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """groups ~ Bernoulli(minority); labels ~ Bernoulli(0.4); Yhat ~ Bernoulli(rate of group)."""
    groups = (rng.random(n) < minority).astype(np.int64)
    labels = (rng.random(n) < 0.4).astype(np.int64)
    predictions = (rng.random(n) < np.where(groups == 1, rate1, rate0)).astype(np.int64)
    return predictions, labels, groups


def test_plugin_disparities_by_hand() -> None:
    # group 0: 4 rows, Yhat = 1,1,0,0 (DP rate 1/2); positives (Y = 1) rows 0, 2: TPR 1/2
    # group 1: 4 rows, Yhat = 1,0,0,0 (DP rate 1/4); positives rows 4, 5: TPR 1/2
    predictions = np.array([1, 1, 0, 0, 1, 0, 0, 0])
    labels = np.array([1, 0, 1, 0, 1, 1, 0, 0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    rng = np.random.default_rng(0)
    dp = bootstrap_disparity(predictions, labels, groups, metric="dp", num_resamples=5, rng=rng)
    eo = bootstrap_disparity(predictions, labels, groups, metric="eo", num_resamples=5, rng=rng)
    assert dp.plugin == pytest.approx(0.5 - 0.25)
    assert eo.plugin == pytest.approx(0.5 - 0.5)
    assert dp.group_sizes == (4, 4) and eo.group_sizes == (2, 2)
    assert dp.cell_counts == (2, 2, 3, 1) and eo.cell_counts == (1, 1, 1, 1)
    assert dp.num_samples == 8 and dp.num_resamples == 5 and dp.metric == "dp"
    # A disparity on n resampled rows is a difference of fractions with denominators <= n.
    assert np.all(np.abs(dp.resamples) <= 1.0) and np.all(np.abs(eo.resamples) <= 1.0)


def exact_bootstrap_variance(
    rate0: float, rate1: float, size0: int, num_rows: int, size1: int | None = None
) -> float:
    """p0(1-p0) E[1/N0*] + p1(1-p1) E[1/N1*], N_g* ~ Bin(n, n_g / n) restricted to >= 1."""
    size1 = num_rows - size0 if size1 is None else size1
    total = 0.0
    for rate, size in ((rate0, size0), (rate1, size1)):
        support = np.arange(1, num_rows + 1)
        pmf = stats.binom.pmf(support, num_rows, size / num_rows)
        total += rate * (1 - rate) * float(np.sum(pmf / support) / np.sum(pmf))
    return total


@pytest.mark.parametrize("metric", ["dp", "eo"])
def test_bootstrap_mean_and_variance(metric: str) -> None:
    rng = np.random.default_rng(11)
    predictions, labels, groups = client_data(rng, 400, 0.3, 0.35, 0.2)
    num_resamples = 20_000
    result = bootstrap_disparity(
        predictions, labels, groups, metric=metric, num_resamples=num_resamples, rng=rng
    )
    counted = labels == 1 if metric == "eo" else np.ones_like(labels, dtype=bool)
    rows0, rows1 = counted & (groups == 0), counted & (groups == 1)
    rate0, rate1 = predictions[rows0].mean(), predictions[rows1].mean()
    assert result.plugin == pytest.approx(rate0 - rate1, abs=1e-15)
    assert result.group_sizes == (int(rows0.sum()), int(rows1.sum()))
    variance = exact_bootstrap_variance(rate0, rate1, int(rows0.sum()), 400, int(rows1.sum()))
    assert abs(result.mean - result.plugin) <= 4 * math.sqrt(variance / num_resamples)
    assert abs(result.variance / variance - 1) <= 4 * math.sqrt(2 / (num_resamples - 1))
    # The textbook p0(1-p0)/n0 + p1(1-p1)/n1 is within 3% of the exact bootstrap variance here.
    simple = rate0 * (1 - rate0) / rows0.sum() + rate1 * (1 - rate1) / rows1.sum()
    assert variance == pytest.approx(simple, rel=0.03)
    assert result.variance == pytest.approx(np.var(result.resamples, ddof=1), rel=1e-12)


def test_eo_ignores_negatives_and_dp_does_not() -> None:
    rng = np.random.default_rng(5)
    predictions, labels, groups = client_data(rng, 300, 0.4, 0.5, 0.3)
    flipped = predictions.copy()
    flipped[labels == 0] = 1 - flipped[labels == 0]  # change every prediction on Y = 0 rows
    runs = {}
    for name, preds in (("original", predictions), ("flipped", flipped)):
        for metric in ("dp", "eo"):
            runs[name, metric] = bootstrap_disparity(
                preds, labels, groups, metric=metric, rng=np.random.default_rng(9)
            )
    # Same seed, same index draws: EO sees only the Y = 1 rows, so nothing changes.
    np.testing.assert_array_equal(runs["original", "eo"].resamples, runs["flipped", "eo"].resamples)
    assert runs["original", "eo"].plugin == runs["flipped", "eo"].plugin
    assert runs["original", "dp"].plugin != runs["flipped", "dp"].plugin


def test_same_seed_same_result() -> None:
    predictions, labels, groups = client_data(np.random.default_rng(1), 200, 0.3, 0.3, 0.3)
    first = bootstrap_disparity(predictions, labels, groups, rng=np.random.default_rng(4))
    second = bootstrap_disparity(predictions, labels, groups, rng=np.random.default_rng(4))
    np.testing.assert_array_equal(first.resamples, second.resamples)
    assert not first.resamples.flags.writeable


def test_redraws_on_a_tiny_test_set() -> None:
    # n = 6 rows, one of group 1: a resample lacks a group w.p. q = (5/6)^6 + (1/6)^6.
    predictions = np.array([1, 0, 1, 0, 0, 1])
    groups = np.array([0, 0, 0, 0, 0, 1])
    q = (5 / 6) ** 6 + (1 / 6) ** 6
    num_resamples = 3000
    result = bootstrap_disparity(
        predictions, None, groups, num_resamples=num_resamples, rng=np.random.default_rng(8)
    )
    # Discarded draws before B valid ones: negative binomial, mean B q/(1-q), var B q/(1-q)^2.
    mean, sd = num_resamples * q / (1 - q), math.sqrt(num_resamples * q) / (1 - q)
    assert abs(result.redraws - mean) <= 4 * sd, (result.redraws, mean, sd)
    assert np.all(np.isfinite(result.resamples))
    # Every kept resample has the group-1 row (rate 1), so Y* = rate0* - 1 <= 0, and
    # E*[rate0* | N0* >= 1] = 2/5 exactly: the mean stays at the plug-in 2/5 - 1.
    assert np.all(result.resamples <= 0.0)
    assert result.plugin == pytest.approx(0.4 - 1.0)
    sd_mean = math.sqrt(result.variance / num_resamples)
    assert abs(result.mean - result.plugin) <= 4 * sd_mean


def test_redraw_limit_raises() -> None:
    predictions = np.array([1, 0, 1, 0, 0, 1])
    groups = np.array([0, 0, 0, 0, 0, 1])
    # P(no resample of 50 lacks group 1) = (1 - 0.335)^50 < 1e-8.
    with pytest.raises(InsufficientGroupData, match="max_redraws"):
        bootstrap_disparity(
            predictions, None, groups, num_resamples=50, rng=np.random.default_rng(0), max_redraws=3
        )


@pytest.mark.parametrize(
    ("labels", "groups", "metric", "needle"),
    [
        (None, [0, 0, 0, 0], "dp", "group 1"),
        (None, [1, 1, 1, 1], "dp", "group 0"),
        ([1, 1, 0, 0], [0, 0, 1, 1], "eo", "positive"),  # group 1 has no Y = 1 row
    ],
)
def test_clients_that_cannot_take_part_are_refused_upfront(
    labels: list[int] | None, groups: list[int], metric: str, needle: str
) -> None:
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    with pytest.raises(InsufficientGroupData, match=needle):
        bootstrap_disparity(
            np.array([1, 0, 1, 0]), labels, np.array(groups), metric=metric, rng=rng
        )  # type: ignore[arg-type]
    assert rng.bit_generator.state == state  # refused before drawing anything
    assert issubclass(InsufficientGroupData, ValueError)


def test_summaries_of_each_mode() -> None:
    predictions, labels, groups = client_data(np.random.default_rng(2), 500, 0.3, 0.32, 0.3)
    result = bootstrap_disparity(predictions, labels, groups, rng=np.random.default_rng(3))
    paper, calibrated = result.summary("paper"), result.summary("calibrated")
    absolute = np.abs(result.resamples)
    assert paper.mean == pytest.approx(absolute.mean(), rel=1e-12)
    assert paper.variance == pytest.approx(np.var(absolute, ddof=1), rel=1e-12)
    assert calibrated.mean == result.plugin
    assert calibrated.variance == pytest.approx(np.var(result.resamples, ddof=1), rel=1e-12)
    assert paper.n == calibrated.n == 100
    assert paper.mean > 0.0  # |.| is positive even for a (nearly) fair model (paper mode)
    with pytest.raises(ValueError, match="mode"):
        result.summary("other")  # type: ignore[arg-type]


def test_constant_predictions_cannot_estimate_a_variance() -> None:
    groups = np.array([0, 1] * 20)
    result = bootstrap_disparity(np.zeros(40), None, groups, rng=np.random.default_rng(0))
    assert result.plugin == 0.0 and result.variance == 0.0
    with pytest.raises(InsufficientGroupData, match="variance is 0"):
        result.summary()


# --- calibrated vs paper mode on a fair population (acceptance criterion) ----------------------

FAIR_SIZES = (200, 400, 800, 1200, 2000)
FAIR_ITERATIONS = 3000  # the criterion says 1000; 3000 keeps MC noise (SE 0.004) well inside


@functools.cache
def fair_population_pvalues() -> dict[str, np.ndarray]:
    """p-values (iterations x 2 stages) of both modes; Yhat ~ Bernoulli(0.3) for everyone."""
    rng = np.random.default_rng(2024)
    out = {"paper": np.empty((FAIR_ITERATIONS, 2)), "calibrated": np.empty((FAIR_ITERATIONS, 2))}
    for iteration in range(FAIR_ITERATIONS):
        summaries: dict[str, list[ClientSummary]] = {"paper": [], "calibrated": []}
        for n in FAIR_SIZES:
            groups = (rng.random(n) < 0.3).astype(np.int8)  # 30% minority
            predictions = (rng.random(n) < 0.3).astype(np.int8)  # independent of the group
            result = bootstrap_disparity(predictions, None, groups, num_resamples=100, rng=rng)
            for mode, collected in summaries.items():
                collected.append(result.summary(mode))  # type: ignore[arg-type]
        for mode, collected in summaries.items():
            report = fedevalfair(collected, mode=mode)  # type: ignore[arg-type]
            out[mode][iteration] = report.homogeneity.pvalue, report.common_disparity.pvalue
    return out


@pytest.mark.slow  # over 5 s: CI runs it, the fast lane leaves it out
def test_calibrated_mode_holds_type_one_error_on_a_fair_population() -> None:
    rates = np.mean(fair_population_pvalues()["calibrated"] < 0.05, axis=0)
    # Acceptance criterion of the issue: stage 2 in [0.03, 0.07] (stated for 1000 iterations;
    # run with 3000, binomial SE 0.004). The true rate is ~0.057 (20,000 iterations: 0.057 for
    # both stages): the Wald-type plug-in variance of a difference of proportions plus the
    # B = 100 noise in S_i^2 make the z-test slightly liberal.
    assert 0.03 <= rates[1] <= 0.07, rates
    # Stage 1 (Cochran's Q with bootstrap weights), same band.
    assert 0.03 <= rates[0] <= 0.07, rates


@pytest.mark.slow
def test_paper_mode_rejects_a_fair_population() -> None:
    rates = np.mean(fair_population_pvalues()["paper"] < 0.05, axis=0)
    # |disparity| > 0 and Var = S^2 / B: both stages reject nearly always (measured: 1.0).
    assert rates[1] > 0.9, rates
    assert rates[0] > 0.5, rates


# --- the calibrated weights: exact null moments, and type-I error with small cells --------------


@pytest.mark.parametrize("margins", [(3, 2, 1), (7, 3, 4), (40, 6, 9), (12, 30, 25), (90, 11, 2)])
def test_null_variance_is_exact_and_the_disparity_has_mean_zero(margins: tuple) -> None:
    """Given the margins and Yhat independent of A, group 0's positives are hypergeometric:
    enumerate them. E[disparity] = 0 and Var = disparity_variance(margins, 0) exactly."""
    n0, n1, x = margins
    counts = np.arange(max(0, x - n1), min(n0, x) + 1)
    probabilities = stats.hypergeom(n0 + n1, x, n0).pmf(counts)
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-12)
    disparities = counts / n0 - (x - counts) / n1
    mean = float(np.sum(probabilities * disparities))
    variance = float(np.sum(probabilities * (disparities - mean) ** 2))
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert disparity_variance(margins, 0.0) == pytest.approx(variance, rel=1e-12)


def test_disparity_variance_at_a_common_disparity() -> None:
    """V(mu): the binomial variance of the rates that keep the margins' positive rate and
    differ by mu (times N / (N - 1)); clipped half a row inside [0, 1]."""
    n0, n1, x = 60, 40, 30
    for mu in (-0.2, 0.0, 0.1, 0.3):
        r0, r1 = 0.3 + 0.4 * mu, 0.3 - 0.6 * mu
        expected = 100 / 99 * (r0 * (1 - r0) / n0 + r1 * (1 - r1) / n1)
        assert disparity_variance((n0, n1, x), mu) == pytest.approx(expected, rel=1e-12)
    clipped = 100 / 99 * ((1 / 120) * (1 - 1 / 120) / n0 + (1 / 80) * (1 - 1 / 80) / n1)
    # mu = -1 asks for r0 = -0.1 and r1 = 0.9: r0 is clipped to 1 / (2 n0).
    r1 = 0.9
    assert disparity_variance((n0, n1, x), -1.0) == pytest.approx(
        100 / 99 * ((1 / 120) * (1 - 1 / 120) / n0 + r1 * (1 - r1) / n1), rel=1e-12
    )
    assert disparity_variance((n0, n1, x), -1.0) > clipped > 0
    with pytest.raises(ValueError, match="predicted_positive_rows"):
        disparity_variance((5, 5, 0))
    with pytest.raises(ValueError, match="group"):
        disparity_variance((0, 5, 2))
    with pytest.raises(ValueError, match="disparity"):
        disparity_variance((5, 5, 2), math.nan)


SMALL_CELL_ITERATIONS = 2000


def small_cell_rejections(
    k: int, n: int, minority: float, rates: tuple[float, float]
) -> dict[str, np.ndarray]:
    """Stage 1 / stage 2 rejections at 5% of the calibrated mode with and without margins.

    k holders of n rows, A ~ Bernoulli(minority), Yhat | A = a ~ Bernoulli(rates[a]), B = 100;
    a holder whose bootstrap cannot run (a group or a prediction missing) is left out, as in
    the app."""
    rng = np.random.default_rng([k, n, 7])
    means = np.full((SMALL_CELL_ITERATIONS, k), np.nan)
    variances = np.full_like(means, np.nan)
    margins = np.full((SMALL_CELL_ITERATIONS, k, 3), np.nan)
    for iteration in range(SMALL_CELL_ITERATIONS):
        for holder in range(k):
            groups = (rng.random(n) < minority).astype(np.int8)
            predictions = (rng.random(n) < np.where(groups == 0, *rates)).astype(np.int8)
            try:
                result = bootstrap_disparity(predictions, None, groups, num_resamples=100, rng=rng)
                summary = result.summary()
            except InsufficientGroupData:
                continue
            means[iteration, holder], variances[iteration, holder] = summary.mean, summary.variance
            margins[iteration, holder] = summary.margins
    complete = ~np.isnan(means).any(axis=1)
    assert complete.mean() > 0.8  # nearly every iteration has all holders
    out = {}
    for name, extra in (("margins", {"margins": margins[complete]}), ("no margins", {})):
        batch = stage_statistics(means[complete], variances[complete], 100, **extra)
        out[name] = np.array(
            [np.mean(batch.homogeneity_pvalue < 0.05), np.mean(batch.common_pvalue < 0.05)]
        )
    return out


@pytest.mark.parametrize(
    ("k", "n", "minority", "rates", "h0_stage2"),
    [
        (10, 100, 0.14, (0.19, 0.19), True),  # Adult-like: ~3 minority rows predicted positive
        (5, 50, 0.3, (0.3, 0.3), True),  # the paper's smallest synthetic cell
        (5, 50, 0.3, (0.35, 0.25), False),  # common disparity 0.1: stage 1's H0 only
    ],
)
@pytest.mark.slow
def test_calibrated_mode_holds_type_one_error_with_small_cells(
    k: int, n: int, minority: float, rates: tuple[float, float], h0_stage2: bool
) -> None:
    """Issue criterion: type-I error in [0.03, 0.07] at 1000 iterations; here 2000 (binomial
    SE 0.005 at 0.05, so the band is 4 SE wide on each side). Without margins (weights
    1 / S^2, the plain inverse-variance form) the same draws over-reject where cells are tiny."""
    rejections = small_cell_rejections(k, n, minority, rates)
    calibrated = rejections["margins"]
    assert 0.03 <= calibrated[0] <= 0.07, rejections  # stage 1: H0 mu_1 = ... = mu_k holds
    if h0_stage2:
        assert 0.03 <= calibrated[1] <= 0.07, rejections
    if k == 10:  # the flaw the margins fix (measured ~0.25 / ~0.5)
        assert rejections["no margins"][0] > 0.12 and rejections["no margins"][1] > 0.2, rejections


# --- equivalence (TOST) ------------------------------------------------------------------------


def test_tost_pvalue_formula_and_decision() -> None:
    rng = np.random.default_rng(12)
    summaries = random_summaries(rng, 5, "calibrated")
    for tolerance in (0.01, 0.05, 0.2):
        report = fedevalfair(summaries, tolerance=tolerance)
        result = equivalence_test(summaries, tolerance=tolerance)
        assert report.equivalence == result
        se, mu = report.stderr, report.estimate
        lower = stats.norm.sf((mu + tolerance) / se)  # H0: mu <= -tol
        upper = stats.norm.cdf((mu - tolerance) / se)  # H0: mu >= tol
        assert result.pvalue == pytest.approx(max(lower, upper), rel=1e-10, abs=1e-300)
        assert result.null_value == tolerance
        assert report.certified_fair == (result.pvalue < 0.05)


def test_tost_with_tolerance_zero_never_certifies() -> None:
    summaries = [ClientSummary(0.0, 1e-4, 100), ClientSummary(0.0, 2e-4, 100)]
    for alpha in (0.05, 0.6, 0.99):
        report = fedevalfair(summaries, alpha=alpha, tolerance=0.0)
        assert report.equivalence is not None and report.equivalence.pvalue == 1.0
        assert report.certified_fair is False
    assert fedevalfair(summaries).certified_fair is None


TOST_DRAWS = 50_000


def tost_rejection_rate(mu: float, tolerance: float) -> tuple[float, float]:
    """Certification rate for Ybar_i ~ N(mu, v_i), known v_i; and the stderr 1/sqrt(sum w)."""
    variances = np.array([4e-4, 1e-4, 2.5e-4])
    rng = np.random.default_rng(int(1e6 * mu) + 17)
    means = rng.normal(mu, np.sqrt(variances), size=(TOST_DRAWS, variances.size))
    result = stage_statistics(means, variances, 100, tolerance=tolerance)
    assert result.equivalence_pvalue is not None
    return float(np.mean(result.equivalence_pvalue < 0.05)), float(result.stderr[0])


def test_tost_size_at_and_beyond_the_tolerance() -> None:
    tolerance = 0.02
    se_mc = math.sqrt(0.05 * 0.95 / TOST_DRAWS)
    at_boundary, se = tost_rejection_rate(tolerance, tolerance)
    # At mu = tol: P(mu_hat < tol - z se) (the other side is ~0): exactly alpha.
    assert abs(at_boundary - 0.05) <= 4 * se_mc
    beyond, _ = tost_rejection_rate(1.5 * tolerance, tolerance)
    exact = stats.norm.cdf(-stats.norm.ppf(0.95) - 0.5 * tolerance / se)
    assert beyond <= 0.05 and abs(beyond - exact) <= 4 * math.sqrt(exact * (1 - exact) / TOST_DRAWS)


def test_tost_power_matches_its_formula() -> None:
    tolerance = 0.02
    rate, se = tost_rejection_rate(0.0, tolerance)
    # mu = 0: certified iff |mu_hat| < tol - z se: probability 2 Phi(tol/se - z) - 1.
    exact = 2 * stats.norm.cdf(tolerance / se - stats.norm.ppf(0.95)) - 1
    assert abs(rate - exact) <= 4 * math.sqrt(exact * (1 - exact) / TOST_DRAWS)


def test_tost_certifies_a_small_disparity_with_enough_data() -> None:
    rng = np.random.default_rng(21)
    summaries = []
    for _ in range(3):
        predictions, labels, groups = client_data(rng, 20_000, 0.3, 0.305, 0.3)  # delta 0.005
        summaries.append(bootstrap_disparity(predictions, labels, groups, rng=rng).summary())
    report = fedevalfair(summaries, tolerance=0.05)
    # se ~ sqrt(0.21 (1/14000 + 1/6000) / 3) ~ 0.0041: (0.05 - 0.005) / se ~ 11 standard errors.
    assert report.certified_fair is True
    assert report.equivalence is not None and report.equivalence.pvalue < 1e-10


# --- the protocol's sums give the same report --------------------------------------------------


def with_margins(rng: np.random.Generator, summaries: list[ClientSummary]) -> list[ClientSummary]:
    """The same summaries with random margins (group sizes and predicted positives)."""
    out = []
    for s in summaries:
        group0, group1 = (int(v) for v in rng.integers(3, 400, size=2))
        positives = int(rng.integers(1, group0 + group1))
        out.append(ClientSummary(s.mean, s.variance, s.n, (group0, group1, positives)))
    return out


def reference_calibrated_with_margins(
    summaries: list[ClientSummary], mu0: float = 0.0
) -> dict[str, float]:
    """The calibrated mode with margins, written out (module docstring of fairtest)."""

    def variance(margins: tuple[int, int, int], mu: float) -> float:
        n0, n1, x = margins
        total, rate = n0 + n1, x / (n0 + n1)
        r0 = min(max(rate + n1 * mu / total, min(0.5 / n0, rate)), max(1 - 0.5 / n0, rate))
        r1 = min(max(rate - n0 * mu / total, min(0.5 / n1, rate)), max(1 - 0.5 / n1, rate))
        return total / (total - 1) * (r0 * (1 - r0) / n0 + r1 * (1 - r1) / n1)

    means = np.array([s.mean for s in summaries])
    s2 = np.array([s.variance for s in summaries])
    w = np.array([1 / variance(s.margins, 0.0) for s in summaries])  # type: ignore[arg-type]
    mu_hat = float(np.sum(w * means) / np.sum(w))
    stderr = float(np.sqrt(np.sum(w**2 * s2)) / np.sum(w))
    u = np.array([1 / variance(s.margins, mu_hat) for s in summaries])  # type: ignore[arg-type]
    mu_u = float(np.sum(u * means) / np.sum(u))
    q = float(np.sum(u * (means - mu_u) ** 2))

    def se_at(mu: float) -> float:  # the standard error if the common disparity were mu
        v = np.array([variance(s.margins, mu) for s in summaries])  # type: ignore[arg-type]
        return float(np.sqrt(np.sum(w**2 * v)) / np.sum(w))

    z = (mu_hat - mu0) / se_at(mu0)
    tolerance = 0.05
    tost_p = max(
        stats.norm.cdf((mu_hat - tolerance) / se_at(tolerance)),
        stats.norm.sf((mu_hat + tolerance) / se_at(-tolerance)),
    )
    return {
        "tost_p": float(tost_p),
        "estimate": mu_hat,
        "stderr": stderr,
        "stage1": q,
        "p1": float(stats.chi2.sf(q, means.size - 1)),
        "stage2": z,
        "p2": float(2 * stats.norm.sf(abs(z))),
    }


@pytest.mark.parametrize("k", [2, 3, 7])
def test_calibrated_stages_with_margins_match_the_written_formulas(k: int) -> None:
    rng = np.random.default_rng(100 + k)
    summaries = with_margins(rng, random_summaries(rng, k, "calibrated"))
    for mu0 in (0.0, 0.03):
        ref = reference_calibrated_with_margins(summaries, mu0)
        report = fedevalfair(summaries, mu0=mu0)
        assert report.estimate == pytest.approx(ref["estimate"], rel=1e-12)
        assert report.stderr == pytest.approx(ref["stderr"], rel=1e-12)
        assert report.homogeneity.statistic == pytest.approx(ref["stage1"], rel=1e-9)
        assert report.homogeneity.pvalue == pytest.approx(ref["p1"], rel=1e-9)
        assert report.common_disparity.statistic == pytest.approx(ref["stage2"], rel=1e-12)
        assert report.common_disparity.pvalue == pytest.approx(ref["p2"], rel=1e-12)
        tost = fedevalfair(summaries, mu0=mu0, tolerance=0.05).equivalence
        assert tost is not None and tost.pvalue == pytest.approx(ref["tost_p"], rel=1e-9)
    # The paper mode ignores the margins.
    plain = [ClientSummary(s.mean, s.variance, s.n) for s in summaries]
    assert fedevalfair(summaries, mode="paper") == fedevalfair(plain, mode="paper")


@pytest.mark.parametrize("margins", [False, True])
@pytest.mark.parametrize("mode", ["paper", "calibrated"])
def test_report_from_sums_equals_fedevalfair(mode: str, margins: bool) -> None:
    rng = np.random.default_rng(31)
    summaries = random_summaries(rng, 6, mode)
    if margins:
        summaries = with_margins(rng, summaries)
    options = dict(alpha=0.1, mu0=0.02, tolerance=0.08)
    direct = fedevalfair(summaries, mode=mode, **options)  # type: ignore[arg-type]
    # What the server would do: add the round-1 vectors (in another order), then the terms.
    totals = np.zeros(len(ROUND1_FIELDS))
    for summary in reversed(summaries):
        totals = totals + client_contribution(summary, mode, mu0=0.02, tolerance=0.08)  # type: ignore[arg-type]
    parts = sum(stage1_term(s, totals, mode) for s in summaries)  # type: ignore[arg-type]
    assert parts.shape == (len(STAGE1_FIELDS),)
    stage1 = stage1_statistic(parts, mode)  # type: ignore[arg-type]
    via_sums = report_from_sums(totals, stage1, mode=mode, num_clients=6, **options)  # type: ignore[arg-type]
    for name in ("homogeneity", "common_disparity", "equivalence"):
        a, b = getattr(direct, name), getattr(via_sums, name)
        for field in ("statistic", "pvalue", "estimate", "stderr"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-12, abs=1e-300)
    assert direct.to_dict().keys() == via_sums.to_dict().keys()
    # The round-1 vector is [w, w Ybar, w Ybar^2, w^2 Var, 1].
    s = summaries[0]
    if mode == "paper":
        w, var = s.n / s.variance, s.variance / s.n
    elif margins:
        n0, n1, x = s.margins  # type: ignore[misc]
        rate = x / (n0 + n1)
        w = 1 / (rate * (1 - rate) * (1 / n0 + 1 / n1) * (n0 + n1) / (n0 + n1 - 1))
        var = s.variance
    else:
        w, var = 1 / s.variance, s.variance
    vector = client_contribution(s, mode)  # type: ignore[arg-type]
    np.testing.assert_allclose(vector[:4], [w, w * s.mean, w * s.mean**2, w**2 * var])
    assert vector[-1] == 1.0 and vector.shape == (len(ROUND1_FIELDS),)
    # Entries 4-6: w^2 V at mu0, +tolerance, -tolerance (V = Var without margins).
    if mode == "paper" or not margins:
        np.testing.assert_allclose(vector[4:7], [w**2 * var] * 3)
    else:
        np.testing.assert_allclose(
            client_contribution(s, mode, mu0=0.02, tolerance=0.08)[4:7],  # type: ignore[arg-type]
            [w**2 * disparity_variance(s.margins, value) for value in (0.02, 0.08, -0.08)],  # type: ignore[arg-type]
        )


def test_one_round_cochran_q_and_batch_agree() -> None:
    rng = np.random.default_rng(41)
    summaries = random_summaries(rng, 5, "calibrated")
    totals = np.sum([client_contribution(s) for s in summaries], axis=0)
    two_round = fedevalfair(summaries)
    one_round = report_from_sums(totals, None, num_clients=5)
    assert one_round.homogeneity.statistic == pytest.approx(
        two_round.homogeneity.statistic, rel=1e-9
    )
    with pytest.raises(ValueError, match="stage1_total is required"):
        report_from_sums(totals, None, mode="paper", num_clients=5)
    marked = with_margins(rng, summaries)
    margins = np.array([s.margins for s in marked])
    for mode, chosen, extra in (
        ("paper", summaries, {}),
        ("calibrated", summaries, {}),
        ("calibrated", marked, {"margins": margins}),
        ("paper", marked, {"margins": margins}),
    ):
        batch = stage_statistics(*arrays(chosen), mode=mode, tolerance=0.1, **extra)  # type: ignore[arg-type]
        report = fedevalfair(chosen, mode=mode, tolerance=0.1)  # type: ignore[arg-type]
        assert float(batch.homogeneity_statistic) == pytest.approx(
            report.homogeneity.statistic, rel=1e-12
        )
        assert float(batch.common_pvalue) == pytest.approx(
            report.common_disparity.pvalue, rel=1e-12
        )
        assert batch.equivalence_pvalue is not None and report.equivalence is not None
        assert float(batch.equivalence_pvalue) == pytest.approx(
            report.equivalence.pvalue, rel=1e-12
        )


def test_report_from_sums_checks_its_inputs() -> None:
    summaries = random_summaries(np.random.default_rng(1), 3, "calibrated")
    totals = np.sum([client_contribution(s) for s in summaries], axis=0)
    with pytest.raises(ValueError, match="num_clients"):
        report_from_sums(totals, 1.0, num_clients=4)
    with pytest.raises(ValueError, match="round1_totals"):
        report_from_sums(totals[:3], 1.0, num_clients=3)
    with pytest.raises(ValueError, match="round1_totals"):
        report_from_sums(np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]), 1.0, num_clients=3)
    with pytest.raises(ValueError, match="stage1_totals"):
        stage1_statistic(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="stage1_totals"):
        stage1_statistic(np.array([1.0, -2.0, 0.0]))
    with pytest.raises(ValueError, match="mode"):
        stage1_statistic(np.array([1.0, 2.0, 0.0]), "both")  # type: ignore[arg-type]
    # Paper: T1 is the first entry; encryption noise in the other two is ignored.
    assert stage1_statistic(np.array([3.0, -1e-10, 1e-9]), "paper") == 3.0
    with pytest.raises(ValueError, match="stage1_total"):
        report_from_sums(totals, -5.0, num_clients=3)
    with pytest.raises(ValueError, match="stage1_total"):
        report_from_sums(totals, math.nan, num_clients=3)
    # Encryption noise below 0 on a sum of squares reads as 0 (p = 1).
    assert report_from_sums(totals, -1e-12, num_clients=3).homogeneity.pvalue == 1.0


def test_report_to_dict_is_json_ready() -> None:
    summaries = random_summaries(np.random.default_rng(2), 3, "calibrated")
    report = fedevalfair(summaries, tolerance=0.05)
    assert isinstance(report, FairnessReport)
    payload = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert payload["k"] == 3 and payload["mode"] == "calibrated"
    assert payload["homogeneity"]["dof"] == 2
    assert payload["certified_fair"] == report.certified_fair
    assert payload["confidence_interval"] == pytest.approx(
        [report.confidence_interval(0.95).low, report.confidence_interval(0.95).high]
    )


# --- bad input ---------------------------------------------------------------------------------


GOOD = [ClientSummary(0.01, 1e-4, 100), ClientSummary(0.02, 2e-4, 100)]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": math.nan}, "alpha"),
        ({"mode": "exact"}, "mode"),
        ({"tolerance": -0.01}, "tolerance"),
        ({"tolerance": math.inf}, "tolerance"),
        ({"mu0": math.nan}, "mu0"),
        ({"summaries": GOOD[:1]}, "at least 2"),
        ({"summaries": []}, "at least 2"),
        ({"summaries": [GOOD[0], (0.1, 0.1, 10)]}, r"summaries\[1\]"),
        ({"summaries": GOOD[0]}, "sequence"),
    ],
)
def test_fedevalfair_bad_input(kwargs: dict, needle: str) -> None:
    summaries = kwargs.pop("summaries", GOOD)
    with pytest.raises(ValueError, match=needle):
        fedevalfair(summaries, **kwargs)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ((0.1, 0.0, 10), "variance"),
        ((0.1, -1.0, 10), "variance"),
        ((0.1, math.nan, 10), "variance"),
        ((0.1, math.inf, 10), "variance"),
        ((math.nan, 0.1, 10), "mean"),
        ((0.1, 0.1, 1), "n"),
        ((0.1, 0.1, 2.5), "n"),
        ((0.1, 0.1, 10, (5, 5)), "margins"),
        ((0.1, 0.1, 10, (0, 5, 2)), "group"),
        ((0.1, 0.1, 10, (5, 5, 10)), "predicted_positive_rows"),
        ((0.1, 0.1, 10, (5, 5, 0)), "predicted_positive_rows"),
        ((0.1, 0.1, 10, (5.5, 5, 2)), "group0_rows"),
    ],
)
def test_client_summary_bad_input(fields: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ClientSummary(*fields)


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (([1, 0], None, [0, 1]), {"num_resamples": 1}, "num_resamples"),
        (([1, 0], None, [0, 1]), {"metric": "auc"}, "metric"),
        (([1, 2], None, [0, 1]), {}, "predictions"),
        (([1, 0], None, [0, 0.5]), {}, "groups"),
        (([1, 0], None, [0, 1, 1]), {}, "groups"),
        (([1, 0], [1], [0, 1]), {}, "labels"),
        (([1, 0], None, [0, 1]), {"metric": "eo"}, "labels"),
        (([[1, 0]], None, [0, 1]), {}, "predictions"),
        (([1, 0], None, [0, 1]), {"max_redraws": -1}, "max_redraws"),
        (([1, 0], None, [0, 1]), {"rng": np.random.RandomState(0)}, "rng"),
    ],
)
def test_bootstrap_bad_input(args: tuple, kwargs: dict, needle: str) -> None:
    predictions, labels, groups = args
    kwargs = {"rng": np.random.default_rng(0), **kwargs}
    with pytest.raises(ValueError, match=needle):
        bootstrap_disparity(
            np.array(predictions),
            None if labels is None else np.array(labels),
            np.array(groups),
            **kwargs,
        )


def test_stage_statistics_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        stage_statistics(np.zeros((5, 1)), 1.0, 10)
    with pytest.raises(ValueError, match="variances"):
        stage_statistics(np.zeros(3), np.array([1.0, 0.0, 1.0]), 10)
    with pytest.raises(ValueError, match="sizes"):
        stage_statistics(np.zeros(3), 1.0, 1)
    with pytest.raises(ValueError, match="mode"):
        stage_statistics(np.zeros(3), 1.0, 10, mode="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tolerance"):
        stage_statistics(np.zeros(3), 1.0, 10, tolerance=-1.0)


def test_mc_harness_applies_the_apps_min_cell_rule() -> None:
    """The Monte Carlo harness leaves a client's metric out exactly when the data holders'
    ``clients.fedevalfair.client_statistics`` does (``fef-min-cell``); an iteration with fewer
    than 2 reporting clients is unavailable; the draws do not depend on the rule."""
    from benchmarks import fedevalfair_mc as mc
    from fedparity.clients.fedevalfair import client_statistics
    from fedparity.clients.project.data import UserShard
    from fedparity.mechanisms.protocol import BLOCKS

    rng = np.random.default_rng(7)
    outcomes = {True: 0, False: 0}
    for _ in range(40):
        n = int(rng.integers(20, 80))
        groups = (rng.random(n) < 0.3).astype(np.int64)
        labels = (rng.random(n) < 0.5).astype(np.int64)
        predictions = (rng.random(n) < 0.3).astype(np.int64)
        shard = UserShard(
            features=np.zeros((n, 1), dtype=np.float32),
            labels=labels,
            user_index=np.arange(n, dtype=np.int64),
            user_groups=groups,
            user_ids=np.arange(n, dtype=np.int64),
        )
        for min_cell in (0, 3, 6, 10):
            try:
                statistics = client_statistics(
                    shard,
                    predictions,
                    num_resamples=20,
                    rng=np.random.default_rng(0),
                    min_cell_count=min_cell,
                )
                summaries = dict(zip(BLOCKS, statistics.summaries, strict=True))
                app = {m: summaries[(m, "calibrated")] is not None for m in ("dp", "eo")}
            except InsufficientGroupData:
                app = {"dp": False, "eo": False}
            for metric in ("dp", "eo"):
                try:
                    boot = bootstrap_disparity(
                        predictions,
                        labels,
                        groups,
                        metric=metric,
                        num_resamples=20,
                        rng=np.random.default_rng(0),
                    )
                    harness = not mc.below_min_cell(boot, min_cell)
                    if harness:
                        boot.summary("calibrated")
                except InsufficientGroupData:
                    harness = False
                assert harness == app[metric], (n, min_cell, metric)
                outcomes[harness] += 1
    assert min(outcomes.values()) > 20, outcomes  # both outcomes exercised

    samplers = [mc.synthetic_sampler(0.0)] * 3
    options = {"metric": "dp", "iterations": 20, "resamples": 20}

    def cell(**extra: int):
        return mc.run_cell(samplers, [40] * 3, rng=np.random.default_rng(1), **options, **extra)

    default, no_rule = cell(), cell(min_cell=0)
    ruled, nobody = cell(min_cell=5), cell(min_cell=10**6)
    assert default == no_rule and no_rule.excluded_clients == 0
    assert 0 < ruled.excluded_clients < 60 and ruled.smallest_cell == no_rule.smallest_cell
    assert ruled.untested >= no_rule.untested
    assert nobody.excluded_clients == 60 and nobody.untested == 20
    assert math.isnan(nobody.stage1["calibrated"]) and math.isnan(nobody.tost)
