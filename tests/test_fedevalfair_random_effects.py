"""FedEvalFair's pooled disparity and random-effects summary (issue 28).

The kernels against a direct per-holder computation; the Q-profile interval's coverage for
tau^2 (Viechtbauer, "Confidence intervals for the amount of heterogeneity in meta-analysis",
Statistics in Medicine, 2007) and the pooled disparity's unbiasedness and coverage by seeded
Monte Carlo; the report's lines. The encrypted path is checked against the plaintext in
tests/test_fedevalfair_protocol.py, and the holder-level DP mode (which releases neither) in
tests/test_fedevalfair_holder_dp.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from fedparity.clients.fedevalfair import (
    release_vector,
    round1_vector,
    round2_vector,
    rows_statistics,
)
from fedparity.mechanisms.crypto.ckks import KeyPaths, load_public_context
from fedparity.mechanisms.fairness_tests.fedevalfair import (
    RANDOM_EFFECTS_FIELDS,
    ROUND1_FIELDS,
    STAGE1_FIELDS,
    TAU2_GRID,
    TAU2_GRID_FACTOR,
    BootstrapDisparity,
    ClientSummary,
    PooledDisparity,
    RandomEffects,
    bootstrap_disparity,
    client_contribution,
    disparity_variance,
    fedevalfair,
    random_effects_release,
    report_from_sums,
    stage_statistics,
    tau2_high_text,
)
from fedparity.mechanisms.protocol import BLOCK_WIDTH, BLOCKS
from fedparity.strategies.fedevalfair import FedEvalFairProtocol

GRID = np.asarray(TAU2_GRID)


def holders(
    seed: int, rates: list[tuple[float, float]], size: int = 300
) -> list[BootstrapDisparity]:
    """One bootstrap per holder: ``size`` rows, group 1 with probability 0.4, predictions
    Bernoulli(rate of the row's group)."""
    rng = np.random.default_rng(seed)
    boots = []
    for rate0, rate1 in rates:
        groups = (rng.random(size) < 0.4).astype(int)
        predictions = (rng.random(size) < np.where(groups == 0, rate0, rate1)).astype(int)
        labels = rng.integers(0, 2, size)
        boots.append(bootstrap_disparity(predictions, labels, groups, num_resamples=50, rng=rng))
    return boots


def direct(boots: list[BootstrapDisparity]) -> dict[str, float]:
    """Everything from the holders' own numbers, one holder at a time (no sums)."""
    means = [b.plugin for b in boots]
    weights = [1.0 / disparity_variance(b.margins, 0.0) for b in boots]
    centre = sum(w * y for w, y in zip(weights, means, strict=True)) / sum(weights)
    variances = [disparity_variance(b.margins, centre) for b in boots]
    k = len(boots)

    def q_at(tau2: float) -> tuple[float, float, float]:
        w = [1.0 / (v + tau2) for v in variances]
        mean = sum(wi * y for wi, y in zip(w, means, strict=True)) / sum(w)
        q = sum(wi * (y - mean) ** 2 for wi, y in zip(w, means, strict=True))
        return q, mean, sum(w)

    u = [1.0 / v for v in variances]
    q0 = q_at(0.0)[0]
    tau2 = max(0.0, (q0 - (k - 1)) / (sum(u) - sum(x * x for x in u) / sum(u)))
    high_q, low_q = stats.chi2.ppf(0.975, k - 1), stats.chi2.ppf(0.025, k - 1)
    profile = [q_at(t)[0] for t in TAU2_GRID]
    low = (
        0.0
        if q0 < high_q
        else max(t for t, q in zip(TAU2_GRID, profile, strict=True) if q >= high_q)
    )
    below = [t for t, q in zip(TAU2_GRID, profile, strict=True) if q <= low_q]
    high = 0.0 if q0 < low_q else (min(below) if below else math.inf)
    used = min((t for t in TAU2_GRID if t >= tau2), default=TAU2_GRID[-1])
    _, mean, total = q_at(used)
    rows0 = sum(b.group_sizes[0] for b in boots)
    rows1 = sum(b.group_sizes[1] for b in boots)
    positive0 = sum(b.cell_counts[1] for b in boots)
    positive1 = sum(b.cell_counts[3] for b in boots)
    p0, p1 = positive0 / rows0, positive1 / rows1
    return {
        "q": q0,
        "tau2": tau2,
        "low": low,
        "high": high,
        "used": used,
        "mean": mean,
        "stderr": 1.0 / math.sqrt(total),
        "pooled": p0 - p1,
        "pooled_stderr": math.sqrt(p0 * (1 - p0) / rows0 + p1 * (1 - p1) / rows1),
        "exact_low": (
            0.0
            if q0 < high_q
            else optimize.brentq(lambda t: q_at(t)[0] - high_q, 0.0, 10.0, xtol=1e-14)
        ),
        "exact_high": (
            0.0
            if q0 < low_q
            else optimize.brentq(lambda t: q_at(t)[0] - low_q, 0.0, 10.0, xtol=1e-14)
        ),
    }


HETEROGENEOUS = [(0.30, 0.30), (0.5, 0.2), (0.25, 0.35), (0.6, 0.3), (0.4, 0.4), (0.2, 0.45)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kernels_equal_the_direct_per_holder_computation(seed: int) -> None:
    boots = holders(seed, HETEROGENEOUS)
    report = fedevalfair([b.summary("calibrated") for b in boots])
    expected = direct(boots)
    effects, pooled = report.random_effects, report.pooled
    assert effects is not None and pooled is not None
    assert report.homogeneity.statistic == pytest.approx(expected["q"], rel=1e-9)
    assert effects.tau2 == pytest.approx(expected["tau2"], rel=1e-9, abs=1e-15)
    assert effects.tau2_interval.low == pytest.approx(expected["low"], rel=1e-9)
    assert effects.tau2_interval.high == pytest.approx(expected["high"], rel=1e-9)
    assert effects.tau2_used == pytest.approx(expected["used"], rel=1e-9)
    assert effects.estimate == pytest.approx(expected["mean"], rel=1e-9, abs=1e-12)
    assert effects.stderr == pytest.approx(expected["stderr"], rel=1e-9)
    assert pooled.estimate == pytest.approx(expected["pooled"], rel=1e-9, abs=1e-12)
    assert pooled.stderr == pytest.approx(expected["pooled_stderr"], rel=1e-9)
    # The grid interval contains the exact Q-profile interval, each end within one step.
    low, high = effects.tau2_interval.low, effects.tau2_interval.high
    assert low <= expected["exact_low"] and high >= expected["exact_high"]
    if expected["exact_low"] > GRID[1]:
        assert expected["exact_low"] <= low * TAU2_GRID_FACTOR * (1 + 1e-12)
    if expected["exact_high"] > GRID[1]:
        assert high <= expected["exact_high"] * TAU2_GRID_FACTOR * (1 + 1e-12)
    assert effects.tau2_used >= effects.tau2


def test_pooled_counts_travel_in_the_round1_sums_and_need_every_holder() -> None:
    boots = holders(4, HETEROGENEOUS[:3])
    summaries = [b.summary("calibrated") for b in boots]
    counts = slice(ROUND1_FIELDS.index("sum_group0_rows"), ROUND1_FIELDS.index("num_clients"))
    vector = client_contribution(summaries[0])
    assert vector[counts].tolist() == [
        boots[0].group_sizes[0],
        boots[0].cell_counts[1],
        boots[0].group_sizes[1],
        boots[0].cell_counts[3],
        1.0,
    ]
    # No counts from a paper summary, one without margins, or a mean no integer count gives.
    assert not client_contribution(boots[0].summary("paper"), "paper")[counts].any()
    plain = ClientSummary(summaries[0].mean, summaries[0].variance, 50)
    assert not client_contribution(plain)[counts].any()
    off = ClientSummary(summaries[0].mean + 1e-3, summaries[0].variance, 50, summaries[0].margins)
    assert not client_contribution(off)[counts].any()
    # One holder without counts: no pooled disparity (not a pooled value of the others).
    assert fedevalfair([plain, *summaries[1:]]).pooled is None
    assert fedevalfair(summaries).pooled is not None
    assert fedevalfair([b.summary("paper") for b in boots], mode="paper").pooled is None


def test_random_effects_release_checks_its_input() -> None:
    boots = holders(5, HETEROGENEOUS[:3])
    summaries = [b.summary("calibrated") for b in boots]
    totals = np.sum([client_contribution(s) for s in summaries], axis=0)
    with pytest.raises(ValueError, match="stage1_totals"):
        random_effects_release(np.zeros(3), 3)
    with pytest.raises(ValueError, match="num_clients"):
        random_effects_release(np.ones(len(STAGE1_FIELDS)), 1)
    with pytest.raises(ValueError, match="level"):
        random_effects_release(np.ones(len(STAGE1_FIELDS)), 3, level=1.0)
    with pytest.raises(ValueError, match="values"):
        RandomEffects.from_release(np.zeros(5))
    with pytest.raises(ValueError, match="tau2_high >= tau2_low"):
        RandomEffects.from_release(np.array([0.1, 0.2, 0.1, 0.1, 0.0, 1.0]))
    with pytest.raises(ValueError, match="mode 'calibrated'"):
        report_from_sums(totals, 1.0, mode="paper", num_clients=3, random_effects=np.ones(6))
    assert len(RANDOM_EFFECTS_FIELDS) == 6


@pytest.mark.parametrize(("k", "tau2"), [(4, 0.0), (8, 0.004), (15, 0.02)])
def test_q_profile_interval_covers_tau2(k: int, tau2: float) -> None:
    """Normal model with known V_i: Q(tau2) at the true tau^2 is exactly chi2(k - 1)
    (Viechtbauer 2007), so the exact interval misses below and above with probability
    0.025 each; rounding the ends outwards to the grid only lowers these. Each miss rate
    must be <= 0.025 + 4 sd (sd = sqrt(0.025 * 0.975 / R), R replications: a false
    failure once in ~30,000 runs)."""
    rng = np.random.default_rng(100 + k)
    replications = 4000
    variances = rng.uniform(0.0004, 0.01, size=k)  # holders of ~25 to ~600 rows a group
    means = 0.05 + rng.normal(size=(replications, k)) * np.sqrt(variances + tau2)
    computed = stage_statistics(means, variances, 2, mode="calibrated")
    assert computed.random_effects is not None
    released = computed.random_effects
    low, high = released[:, 1], released[:, 2]
    tolerance = 0.025 + 4 * math.sqrt(0.025 * 0.975 / replications)
    assert np.mean(low > tau2) <= tolerance
    assert np.mean(high < tau2) <= tolerance
    # Not vacuous: the upper end is finite and the interval not everything.
    assert np.isfinite(high).mean() > 0.99 and np.median(high) < 1.0
    # DL's tau^2 is not negative, and the mean is taken at the grid point at or above it.
    assert (released[:, 0] >= 0).all() and (released[:, 3] >= released[:, 0]).all()


def test_random_effects_mean_is_unbiased_and_wider_than_the_common_one() -> None:
    """The random-effects mean at the grid point above DL's tau^2 is unbiased by symmetry
    (the weights depend on the data only through tau^2, which is even in the deviations):
    its mean is within 4 Monte Carlo standard errors of mu. Its standard error is at least
    the fixed-effect one (w(t) <= u for t >= 0). Its normal interval is not claimed to have
    nominal coverage: DerSimonian-Laird plug-in intervals undercover with few holders
    (Hartung and Knapp, Statistics in Medicine 2001; the guide says so)."""
    rng = np.random.default_rng(7)
    k, tau2, mu, replications = 12, 0.005, -0.03, 4000
    variances = rng.uniform(0.0004, 0.01, size=k)
    means = mu + rng.normal(size=(replications, k)) * np.sqrt(variances + tau2)
    computed = stage_statistics(means, variances, 2)
    released = computed.random_effects
    assert released is not None
    estimate, stderr = released[:, 4], 1.0 / np.sqrt(released[:, 5])
    assert abs(estimate.mean() - mu) <= 4 * estimate.std() / math.sqrt(replications)
    assert (stderr >= 1.0 / math.sqrt(np.sum(1.0 / variances)) * (1 - 1e-12)).all()


@pytest.mark.slow
def test_pooled_disparity_is_unbiased_and_its_interval_covers() -> None:
    """Holders with fixed group sizes and their own rates: the pooled disparity is unbiased
    for the row-weighted rate difference (mean within 4 Monte Carlo standard errors), and
    its standard error, exact for shared rates and conservative otherwise, covers at
    >= 0.95 - 4 sd (R replications)."""
    rng = np.random.default_rng(11)
    sizes = [(120, 80), (300, 60), (90, 150), (200, 200), (50, 70)]
    rates = [(0.3, 0.2), (0.5, 0.25), (0.2, 0.35), (0.45, 0.4), (0.6, 0.3)]
    rows0 = sum(n0 for n0, _ in sizes)
    rows1 = sum(n1 for _, n1 in sizes)
    target = (
        sum(n0 * r0 for (n0, _), (r0, _) in zip(sizes, rates, strict=True)) / rows0
        - sum(n1 * r1 for (_, n1), (_, r1) in zip(sizes, rates, strict=True)) / rows1
    )
    replications = 3000
    estimates, covered = [], []
    for _ in range(replications):
        totals = np.zeros(len(ROUND1_FIELDS))
        for (n0, n1), (r0, r1) in zip(sizes, rates, strict=True):
            x0, x1 = rng.binomial(n0, r0), rng.binomial(n1, r1)
            summary = ClientSummary(x0 / n0 - x1 / n1, 0.01, 50, (n0, n1, x0 + x1))
            totals += client_contribution(summary)
        pooled = PooledDisparity.from_totals(totals, len(sizes))
        assert pooled is not None
        interval = pooled.confidence_interval(0.95)
        estimates.append(pooled.estimate)
        covered.append(interval.low <= target <= interval.high)
    spread = np.std(estimates) / math.sqrt(replications)
    assert abs(np.mean(estimates) - target) <= 4 * spread
    assert np.mean(covered) >= 0.95 - 4 * math.sqrt(0.05 * 0.95 / replications)


def test_the_report_says_what_to_do_after_stage1_rejects() -> None:
    boots = holders(1, HETEROGENEOUS)
    report = fedevalfair([b.summary("calibrated") for b in boots])
    assert report.reject_homogeneity and report.random_effects is not None
    lines = report.verdicts()
    assert lines[2].startswith("pooled disparity (every holder's rows as one test set): ")
    assert lines[3].startswith("after stage 1 (the holders differ): report the random-effects")
    assert "between-holder sd tau = " in lines[3] and "Q-profile interval" in lines[3]
    summary = report.summary("dp")
    assert "the pooled disparity weighs every row alike" in summary
    data = report.to_dict()
    assert data["pooled"]["estimate"] == report.pooled.estimate  # type: ignore[union-attr]
    assert data["random_effects"]["tau2"] == report.random_effects.tau2
    assert "grid of factor 1.212" in data["random_effects"]["tau2_interval_method"]
    # Agreeing holders: no line after stage 1; the pooled line stays.
    agreeing = fedevalfair([b.summary("calibrated") for b in holders(2, [(0.3, 0.3)] * 4)])
    if not agreeing.reject_homogeneity:
        assert not any(line.startswith("after stage 1") for line in agreeing.verdicts())
    assert any(line.startswith("pooled disparity") for line in agreeing.verdicts())
    # Past the grid's last point the high end is written as such, in both renderings.
    assert tau2_high_text(math.inf) == tau2_high_text(None) == "beyond 1"
    assert tau2_high_text(0.0123) == "0.0123"


def test_the_servers_reports_read_the_release_and_survive_a_bad_summary(
    ckks_keys: KeyPaths,
) -> None:
    """Round 1, round 2 and the key holder's release in natural units (no encryption): the
    server's calibrated reports carry the plaintext test's pooled disparity and random-effects
    summary; a released summary that does not hold together (high end below the low end) is
    left out of the report instead of failing the run."""
    rng = np.random.default_rng(3)
    statistics, summaries = [], {block: [] for block in BLOCKS}
    for rate0, rate1 in [(0.5, 0.2), (0.3, 0.3), (0.25, 0.45)]:
        groups = (rng.random(600) < 0.4).astype(int)
        labels = rng.integers(0, 2, 600)
        predictions = (rng.random(600) < np.where(groups == 0, rate0, rate1)).astype(int)
        found = rows_statistics(
            labels, predictions, groups, num_resamples=40, rng=rng, min_cell_count=5
        )
        statistics.append(found)
        for block, summary in zip(BLOCKS, found.summaries, strict=True):
            summaries[block].append(summary)
    round1_sum = np.sum([round1_vector(s, mu0=0.0, tolerance=None) for s in statistics], 0)[:-1]
    round2_sum = np.sum(
        [round2_vector(s, round1_sum, mu0=0.0, tolerance=None) for s in statistics], 0
    )[:-1]
    release = release_vector(round2_sum, min_holders=2)
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public))
    for result in protocol.reports(release):
        assert result.report is not None
        if result.mode == "paper":
            assert result.report.random_effects is None and result.report.pooled is None
            continue
        plain = fedevalfair(summaries[(result.metric, result.mode)])
        assert result.report.pooled == plain.pooled
        mine, theirs = result.report.random_effects, plain.random_effects
        assert mine is not None and theirs is not None
        assert mine.tau2 == pytest.approx(theirs.tau2, rel=1e-9, abs=1e-15)
        assert mine.tau2_interval == theirs.tau2_interval
        assert mine.estimate == pytest.approx(theirs.estimate, rel=1e-9, abs=1e-12)
    first = 1 + BLOCK_WIDTH  # the first block's random-effects summary in the release
    bad = release.copy()
    bad[first + 2] = bad[first + 1] - 1.0  # tau2_high below tau2_low
    damaged = protocol.reports(bad)[0]
    assert damaged.report is not None and damaged.report.random_effects is None
