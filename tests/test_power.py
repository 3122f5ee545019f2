"""Power and sample size (mechanisms/ldp/power.py, ``fedparity plan --power/--gap``).

Checked by simulation: a population with a known gap is perturbed with the real mechanisms
(``perturb_and_summarize`` and ``summarize_stream``), estimated with the real ``estimate_gap``, and
the audit's test (its interval at level 1 - alpha excludes 0) is counted; FedEvalFair holders
with a known common disparity are bootstrapped with the real ``bootstrap_disparity`` and tested
with the real stage-2 kernel (``stage_statistics``). With R repetitions the empirical rejection
rate of a test whose power is p has standard deviation sqrt(p (1 - p) / R): we accept 4.5 of
them. The minimum answers are checked analytically (K - 1 users, or a budget or gap 1e-4 / 1e-6
smaller, fall short of the target).

Juarez and Korolova 2022: Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't
Measure': Privately Measuring Demographic Performance Disparities in Federated Learning", AFCP
workshop, PMLR, 2022. FedEvalFair (anonymous, 2024): "FedEvalFair: A Privacy-Preserving and
Statistically Grounded Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import (
    ClientSummary,
    bootstrap_disparity,
    estimate_gap,
    fedevalfair,
    stage_statistics,
    summarize_stream,
)
from fedparity.mechanisms.ldp.calibration import best_split
from fedparity.mechanisms.ldp.estimators import metric_to_value
from fedparity.mechanisms.ldp.planner import error_bound
from fedparity.mechanisms.ldp.power import (
    AuditPlan,
    audit_detectable_gap,
    audit_minimum_epsilon,
    audit_minimum_users,
    audit_power,
    fedevalfair_detectable_disparity,
    fedevalfair_disparity_range,
    fedevalfair_minimum_holders,
    fedevalfair_minimum_rows,
    fedevalfair_power,
    rejection_probability,
)
from fedparity.server.cli import main

SIGMAS = 4.5


def assert_rate_matches(rejections: int, repetitions: int, planned: float) -> None:
    """The empirical rate is within SIGMAS binomial standard deviations of the planned power."""
    rate = rejections / repetitions
    sd = math.sqrt(planned * (1.0 - planned) / repetitions)
    assert abs(rate - planned) <= SIGMAS * sd, (rate, planned, sd)


# --- the LDP audit, by simulation ---------------------------------------------------------------


def population(
    plan: AuditPlan, *, spread: str, metric_variance: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(groups, values v = 2 m - 1, group sizes) of K users with the plan's group means.

    spread "same": every user of a group has the group's mean (M_R's worst case); "binary":
    metrics in {0, 1} (M_L's worst case); "two": half the group at m - sd, half at m + sd
    (variance ``metric_variance``).
    """
    assert plan.num_users is not None
    fractions = np.asarray(plan.group_fractions)
    sizes = np.round(fractions * plan.num_users).astype(np.int64)
    sizes[-1] = plan.num_users - sizes[:-1].sum()
    groups = np.repeat(np.arange(fractions.size), sizes)
    metric = np.full(plan.num_users, 0.5)
    for group, mean in enumerate(plan.group_means):
        members = np.flatnonzero(groups == group)
        if spread == "same":
            metric[members] = mean
        elif spread == "binary":
            ones = int(round(mean * members.size))
            metric[members] = 0.0
            metric[members[:ones]] = 1.0
        else:
            half, sd = members.size // 2, math.sqrt(metric_variance)
            assert members.size % 2 == 0
            metric[members[:half]], metric[members[half:]] = mean - sd, mean + sd
        assert metric[members].mean() == pytest.approx(mean, abs=1e-9)
    return groups, metric_to_value(metric), sizes


def audit_rejections(
    plan: AuditPlan,
    groups: np.ndarray,
    values: np.ndarray,
    sizes: np.ndarray,
    repetitions: int,
    seed: int,
    *,
    stream: bool = False,
) -> int:
    """How often the audit's interval at level 1 - alpha excludes 0 for the gap of groups 0, 1."""
    assert plan.epsilon is not None
    # what the job deploys (mechanism_for_budget); for "best" the plan names the one chosen
    mechanism = best_split(plan.mechanism, plan.epsilon, sizes.size).build()  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    known = sizes.tolist() if plan.sizes_known else None
    rejections = 0
    for _ in range(repetitions):
        if stream:  # the streaming path, in 4 chunks
            chunks = list(zip(np.array_split(groups, 4), np.array_split(values, 4), strict=True))
            summary = summarize_stream(mechanism, chunks, rng)
        else:
            summary = mechanism.perturb_and_summarize(groups, values, rng)
        estimate = estimate_gap(summary, mechanism, group_sizes=known, confidence=1 - plan.alpha)
        assert estimate.pairs[0] == (0, 1)
        rejections += estimate.gap_intervals[0].low > 0.0
    return rejections


def test_audit_power_matches_simulation_for_m_r_worst_case() -> None:
    """M_R at epsilon 1, two equal groups, sizes estimated from the reports (the job's default)."""
    plan = audit_power(20_000, 1.0, 0.07)
    assert (
        best_split("best", 1.0, 2).mechanism == plan.mechanism == "R"
        and plan.worst_case
        and not plan.sizes_known
    )
    # M_R's worst case here: means at an edge of [0, 1], every user of a group alike.
    assert plan.group_means[0] - plan.group_means[1] == pytest.approx(0.07)
    assert min(plan.group_means) == pytest.approx(0.0, abs=1e-9)
    groups, values, sizes = population(plan, spread="same")
    rejections = audit_rejections(plan, groups, values, sizes, 1500, seed=11, stream=True)
    assert_rate_matches(rejections, 1500, plan.power)
    assert 0.5 < plan.power < 0.9  # a setting where the rate is informative


def test_audit_power_matches_simulation_for_m_l_worst_case_unequal_groups() -> None:
    """M_L at epsilon 2, groups of 30% / 70%: its worst case is a 0/1 metric."""
    plan = audit_power(20_000, 2.0, 0.045, mechanism="L", group_fractions=(0.3, 0.7))
    assert plan.mechanism == "L"
    groups, values, sizes = population(plan, spread="binary")
    rejections = audit_rejections(plan, groups, values, sizes, 1200, seed=12)
    assert_rate_matches(rejections, 1200, plan.power)
    assert 0.4 < plan.power < 0.9


def test_audit_power_matches_simulation_for_a_given_population_with_known_sizes() -> None:
    """M_R with a given mean and spread: its standard error assumes the smallest spread, so the
    test is conservative, and the planner's power accounts for it (the naive power, with the
    true standard deviation in both places, is off by more than the simulation's tolerance)."""
    plan = audit_power(
        20_000,
        2.0,
        0.03,
        mechanism="R",
        group_fractions=(0.4, 0.6),
        metric_mean=0.5,
        metric_variance=0.2,
        sizes_known=True,
    )
    assert not plan.worst_case and plan.test_stderr > 1.1 * plan.true_stderr
    groups, values, sizes = population(plan, spread="two", metric_variance=0.2)
    repetitions = 1500
    rejections = audit_rejections(plan, groups, values, sizes, repetitions, seed=13)
    assert_rate_matches(rejections, repetitions, plan.power)
    naive = float(rejection_probability(0.03, plan.true_stderr, plan.true_stderr, 0.05))
    assert abs(naive - plan.power) > SIGMAS * math.sqrt(plan.power * (1 - plan.power) / repetitions)


# --- the LDP audit, analytically ------------------------------------------------------------------


def test_the_test_stderr_is_the_estimators_worst_case_variance() -> None:
    """M_L with known sizes: the worst case over values is the one the error planner uses
    (gap_variance_factor, at sum v^2 = n), whatever the means: z * stderr is its normal bound."""
    plan = audit_power(50_000, 1.5, 0.05, mechanism="L", sizes_known=True)
    bound = error_bound("L", 50_000, 1.5, confidence=0.95, bound="normal")
    assert stats.norm.ppf(0.975) * plan.test_stderr == pytest.approx(bound.alpha, rel=1e-9)


def test_worst_case_is_the_smallest_power_over_the_means() -> None:
    """The grid's quadratic interpolation gives the exact variances: the worst case equals the
    power computed directly at its means (a given mean is evaluated, not interpolated), and no
    mean level gives less."""
    common = dict(group_fractions=(0.2, 0.8))
    for mechanism, epsilon in (("R", 1.0), ("R", 4.0), ("L", 1.0)):
        plan = audit_power(30_000, epsilon, 0.04, mechanism=mechanism, **common)  # type: ignore[arg-type]
        if mechanism == "R":  # M_R's worst spread is none at all
            direct = audit_power(
                30_000,
                epsilon,
                0.04,
                mechanism="R",
                metric_mean=0.5 * sum(plan.group_means),
                metric_variance=0.0,
                **common,  # type: ignore[arg-type]
            )
            assert direct.power == pytest.approx(plan.power, rel=1e-9, abs=1e-12)
        for level in np.linspace(0.02, 0.98, 25):
            other = audit_power(
                30_000,
                epsilon,
                0.04,
                mechanism=mechanism,
                metric_mean=float(level),
                **common,  # type: ignore[arg-type]
            )
            assert other.power >= plan.power - 1e-9
        # a given spread, the means unknown: the worst over the means, evaluated exactly
        spread = dict(metric_variance=0.1, **common)
        worst = audit_power(30_000, epsilon, 0.04, mechanism=mechanism, **spread)  # type: ignore[arg-type]
        middle = 0.5 * sum(worst.group_means)
        direct = audit_power(
            30_000,
            epsilon,
            0.04,
            mechanism=mechanism,
            metric_mean=middle,
            **spread,  # type: ignore[arg-type]
        )
        assert direct.power == pytest.approx(worst.power, rel=1e-9, abs=1e-12)
        assert direct.true_stderr == pytest.approx(worst.true_stderr, rel=1e-9)


def test_estimated_group_sizes_cost_power() -> None:
    estimated = audit_power(50_000, 0.5, 0.05)
    known = audit_power(50_000, 0.5, 0.05, sizes_known=True)
    assert known.power > estimated.power and known.test_stderr < estimated.test_stderr


@pytest.mark.parametrize(("mechanism", "fractions"), [("best", (0.5, 0.5)), ("L", (0.25, 0.75))])
def test_minimum_users_is_the_smallest(mechanism: str, fractions: tuple[float, float]) -> None:
    plan = audit_minimum_users(0.8, 1.0, 0.05, mechanism=mechanism, group_fractions=fractions)  # type: ignore[arg-type]
    assert plan.query == "min_users" and plan.num_users is not None
    assert plan.power >= 0.8
    at = audit_power(plan.num_users, 1.0, 0.05, mechanism=mechanism, group_fractions=fractions)  # type: ignore[arg-type]
    assert at.power == pytest.approx(plan.power, rel=1e-12)
    for fewer in (plan.num_users - 1, int(0.9 * plan.num_users)):
        short = audit_power(fewer, 1.0, 0.05, mechanism=mechanism, group_fractions=fractions)  # type: ignore[arg-type]
        assert short.power < 0.8
    # The normal approximation: K = unit variance (z_{1-a/2} + z_power)^2 / gap^2, about.
    unit = plan.true_stderr**2 * plan.num_users
    approx = unit * (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) ** 2 / 0.05**2
    assert plan.num_users == pytest.approx(approx, rel=1e-3)


def test_minimum_epsilon_is_the_smallest() -> None:
    plan = audit_minimum_epsilon(0.8, 100_000, 0.05)
    assert plan.query == "min_epsilon" and plan.epsilon is not None and plan.power >= 0.8
    assert audit_power(100_000, plan.epsilon, 0.05).power >= 0.8
    assert audit_power(100_000, plan.epsilon * (1 - 2e-4), 0.05).power < 0.8
    assert audit_power(100_000, 0.9 * plan.epsilon, 0.05).power < 0.8
    assert best_split("best", plan.epsilon, 2).epsilon <= plan.epsilon  # a valid split


def test_detectable_gap_is_the_smallest() -> None:
    plan = audit_detectable_gap(0.8, 100_000, 1.0)
    assert plan.query == "detectable_gap" and plan.gap is not None and plan.power >= 0.8
    assert audit_power(100_000, 1.0, plan.gap).power >= 0.8
    assert audit_power(100_000, 1.0, plan.gap - 2e-6).power < 0.8
    # And the minimum-users plan for that gap needs about the same K.
    users = audit_minimum_users(0.8, 1.0, plan.gap).num_users
    assert users is not None and abs(users - 100_000) <= 10


def test_unreachable_targets_are_none_not_clamped() -> None:
    users = audit_minimum_users(0.8, 0.01, 1e-5)
    assert users.num_users is None and users.power < 0.8
    budget = audit_minimum_epsilon(0.9, 1000, 0.05, mechanism="R")  # M_R's variance floor
    assert budget.epsilon is None and budget.power < 0.9
    gap = audit_detectable_gap(0.8, 100, 0.01)
    assert gap.gap is None and gap.power < 0.8
    assert any("refuse" in note for note in gap.notes)  # 100 users at 0.01: groups unresolved


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: audit_power(1, 1.0, 0.05), "num_users"),
        (lambda: audit_power(10**13, 1.0, 0.05), "num_users"),
        (lambda: audit_power(1000, 0.0, 0.05), "epsilon"),
        (lambda: audit_power(1000, 1e5, 0.05), "epsilon"),
        (lambda: audit_power(1000, 1.0, 0.0), "gap"),
        (lambda: audit_power(1000, 1.0, 1.5), "gap"),
        (lambda: audit_power(1000, 1.0, 0.05, alpha=1.0), "alpha"),
        (lambda: audit_power(1000, 1.0, 0.05, mechanism="X"), "mechanism"),  # type: ignore[arg-type]
        (lambda: audit_power(1000, 1.0, 0.05, group_fractions=(0.5, 0.6)), "group_fractions"),
        (lambda: audit_power(1000, 1.0, 0.05, metric_variance=0.3), "metric_variance"),
        (lambda: audit_power(1000, 1.0, 0.5, metric_mean=0.1), "metric_mean"),
        (lambda: audit_power(1000, 1.0, 0.99, metric_variance=0.2), "gap"),
        (lambda: audit_detectable_gap(0.8, 1000, 1.0, metric_variance=0.25), "metric_variance"),
        (lambda: audit_detectable_gap(0.8, 1000, 1.0, metric_mean=0.0), "metric_mean"),
        (lambda: audit_minimum_users(0.05, 1.0, 0.05), "power"),
        (lambda: audit_minimum_users(1.0, 1.0, 0.05), "power"),
        (lambda: audit_minimum_epsilon(math.nan, 1000, 0.05), "power"),
    ],
)
def test_audit_errors_name_the_parameter(call: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        call()  # type: ignore[operator]


# --- FedEvalFair, by simulation ------------------------------------------------------------------


def fedevalfair_rejections(
    rows: list[int],
    disparity: float,
    positive_rate: float,
    fractions: tuple[float, float],
    repetitions: int,
    seed: int,
) -> int:
    """Stage-2 rejections at 5% for holders whose rows have A ~ Bernoulli(f_1) and
    Yhat | A ~ Bernoulli(p + f_1 d) or Bernoulli(p - f_0 d), as in tests/test_fairtest.py."""
    rates = (positive_rate + fractions[1] * disparity, positive_rate - fractions[0] * disparity)
    rng = np.random.default_rng(seed)
    k, resamples = len(rows), 10  # stage 2 uses the plug-in and the margins, not S^2
    means = np.empty((repetitions, k))
    variances = np.empty((repetitions, k))
    margins = np.empty((repetitions, k, 3))
    for repetition in range(repetitions):
        for holder, n in enumerate(rows):
            groups = (rng.random(n) < fractions[1]).astype(np.int8)
            predictions = (rng.random(n) < np.where(groups == 0, *rates)).astype(np.int8)
            result = bootstrap_disparity(
                predictions, None, groups, num_resamples=resamples, rng=rng
            )
            summary = result.summary()
            means[repetition, holder] = summary.mean
            variances[repetition, holder] = summary.variance
            margins[repetition, holder] = summary.margins
    batch = stage_statistics(means, variances, resamples, margins=margins)
    return int(np.count_nonzero(batch.common_pvalue < 0.05))


@pytest.mark.parametrize(
    ("rows", "disparity", "positive_rate", "fractions"),
    [
        ([800] * 8, 0.03, 0.3, (0.7, 0.3)),
        ([200, 500, 1000, 2000, 300], -0.04, 0.2, (0.6, 0.4)),
        ([100] * 10, 0.06, 0.19, (0.86, 0.14)),  # Adult-like small cells
    ],
)
@pytest.mark.slow
def test_fedevalfair_power_matches_simulation(
    rows: list[int], disparity: float, positive_rate: float, fractions: tuple[float, float]
) -> None:
    plan = fedevalfair_power(
        disparity, rows=rows, positive_rate=positive_rate, group_fractions=fractions
    )
    assert 0.3 < plan.power < 0.9
    repetitions = 1500
    rejections = fedevalfair_rejections(rows, disparity, positive_rate, fractions, repetitions, 7)
    assert_rate_matches(rejections, repetitions, plan.power)


def test_fedevalfair_stderr_is_the_tests_own() -> None:
    """se(mu0) is the standard error FedEvalFair's stage 2 divides by: run the real test on
    summaries with the plan's margins and every disparity at d; W* = (d - mu0) / se(mu0)."""
    rows, fractions, rate, d, mu0 = [400, 1000, 2500], (0.6, 0.4), 0.25, 0.04, 0.01
    plan = fedevalfair_power(d, rows=rows, positive_rate=rate, group_fractions=fractions, mu0=mu0)
    summaries = [
        ClientSummary(
            mean=d,
            variance=1e-3,
            n=100,
            margins=(round(n * fractions[0]), round(n * fractions[1]), round(n * rate)),
        )
        for n in rows
    ]
    report = fedevalfair(summaries, mu0=mu0)
    assert (d - mu0) / report.common_disparity.statistic == pytest.approx(
        plan.test_stderr, rel=1e-12
    )


def test_fedevalfair_minimum_holders_and_rows_are_the_smallest() -> None:
    holders = fedevalfair_minimum_holders(0.8, 0.03, rows=500, positive_rate=0.3)
    assert holders.query == "min_holders" and holders.holders is not None
    assert holders.power >= 0.8
    fewer = fedevalfair_power(0.03, holders=holders.holders - 1, rows=500, positive_rate=0.3)
    assert fewer.power < 0.8
    rows = fedevalfair_minimum_rows(0.8, 0.03, holders=5, positive_rate=0.3)
    assert rows.query == "min_rows" and isinstance(rows.rows, int) and rows.power >= 0.8
    assert fedevalfair_power(0.03, holders=5, rows=rows.rows - 1, positive_rate=0.3).power < 0.8
    assert (
        fedevalfair_power(0.03, holders=5, rows=int(0.9 * rows.rows), positive_rate=0.3).power < 0.8
    )


def test_fedevalfair_detectable_disparity_covers_both_sides() -> None:
    options = dict(holders=6, rows=700, positive_rate=0.2, group_fractions=(0.8, 0.2))
    plan = fedevalfair_detectable_disparity(0.8, **options)  # type: ignore[arg-type]
    assert plan.disparity is not None and plan.power >= 0.8
    distance = abs(plan.disparity)
    for sign in (1.0, -1.0):  # both sides detect the returned distance
        assert fedevalfair_power(sign * distance, **options).power >= 0.8 - 1e-9  # type: ignore[arg-type]
    # and the side returned is the harder one: a hair closer falls short there
    closer = plan.disparity - math.copysign(2e-6, plan.disparity)
    assert fedevalfair_power(closer, **options).power < 0.8  # type: ignore[arg-type]


def test_fedevalfair_unreachable_and_notes() -> None:
    holders = fedevalfair_minimum_holders(0.999999, 1e-4, rows=10)
    assert holders.holders is None and holders.power < 0.999999
    small = fedevalfair_power(
        0.05, holders=10, rows=100, positive_rate=0.19, group_fractions=(0.86, 0.14)
    )
    assert any("normal approximation" in note for note in small.notes)
    assert fedevalfair_power(0.05, holders=10, rows=2000).notes == ()


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: fedevalfair_power(0.0, holders=5, rows=100), "differ from mu0"),
        (lambda: fedevalfair_power(0.7, holders=5, rows=100, positive_rate=0.2), "disparity"),
        (lambda: fedevalfair_power(0.05, holders=1, rows=100), "holders"),
        (lambda: fedevalfair_power(0.05, holders=5, rows=1), "rows"),
        (lambda: fedevalfair_power(0.05, rows=100), "holders"),
        (lambda: fedevalfair_power(0.05, rows=[100]), "rows"),
        (lambda: fedevalfair_power(0.05, holders=3, rows=[100, 200]), "holders"),
        (lambda: fedevalfair_power(0.05, holders=5, rows=100, positive_rate=0.0), "positive_rate"),
        (lambda: fedevalfair_power(0.05, holders=5, rows=100, mu0=2.0), "mu0"),
        (lambda: fedevalfair_power(0.05, holders=5, rows=100, alpha=0.0), "alpha"),
        (lambda: fedevalfair_minimum_rows(0.01, 0.05, holders=5), "power"),
    ],
)
def test_fedevalfair_errors_name_the_parameter(call: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        call()  # type: ignore[operator]


def test_disparity_range_keeps_both_rates_in_the_unit_interval() -> None:
    low, high = fedevalfair_disparity_range(0.2, (0.8, 0.2))
    for d in (low, high):
        rates = (0.2 + 0.2 * d, 0.2 - 0.8 * d)
        assert all(-1e-12 <= r <= 1 + 1e-12 for r in rates)
        assert min(min(rates), 1 - max(rates)) == pytest.approx(0.0, abs=1e-12)


# --- the command line ----------------------------------------------------------------------------


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["plan", *argv], out=out)
    return code, out.getvalue()


def run_json(argv: list[str]) -> dict:
    code, text = run([*argv, "--json"])
    assert code == 0
    assert text.count("\n") == 1
    return json.loads(text)


def test_cli_audit_queries_match_the_library() -> None:
    users = run_json(["--power", "0.8", "--gap", "0.05", "--epsilon", "1"])
    assert users["plan"] == "ldp_audit" and users["query"] == "min_users"
    assert users["num_users"] == audit_minimum_users(0.8, 1.0, 0.05).num_users
    power = run_json(["--clients", "100000", "--gap", "0.05", "--epsilon", "1"])
    assert power["query"] == "power"
    assert power["power"] == pytest.approx(audit_power(100_000, 1.0, 0.05).power, rel=1e-12)
    known = run_json(
        ["--clients", "1e5", "--gap", "0.05", "--epsilon", "1", "--known-sizes", "--mechanism", "L"]
    )
    assert known["sizes_known"] is True and known["mechanism"] == "L"
    given = run_json(
        ["--clients", "1e5", "--gap", "0.05", "--epsilon", "1"]
        + ["--metric-mean", "0.8", "--metric-variance", "0.1", "--significance", "0.01"]
    )
    assert given["worst_case"] is False and given["alpha"] == 0.01
    assert given["power"] == pytest.approx(
        audit_power(100_000, 1.0, 0.05, metric_mean=0.8, metric_variance=0.1, alpha=0.01).power
    )
    ratio = run_json(
        ["--clients", "1e5", "--gap", "0.05", "--epsilon", "1", "--group-ratio", "0.25"]
    )
    assert ratio["group_fractions"] == pytest.approx([0.2, 0.8])
    gap = run_json(["--clients", "100000", "--epsilon", "1", "--power", "0.8"])
    assert gap["query"] == "detectable_gap" and gap["gap"] == pytest.approx(
        audit_detectable_gap(0.8, 100_000, 1.0).gap
    )


def test_cli_minimum_epsilon() -> None:
    payload = run_json(["--clients", "100000", "--gap", "0.05", "--power", "0.8"])
    assert payload["query"] == "min_epsilon"
    assert payload["epsilon"] == pytest.approx(audit_minimum_epsilon(0.8, 100_000, 0.05).epsilon)
    code, text = run(["--clients", "1000", "--gap", "0.05", "--power", "0.9", "--mechanism", "R"])
    assert code == 0 and "none up to 10000" in text  # said, not clamped


def test_cli_text_answers_first() -> None:
    code, text = run(["--power", "0.8", "--gap", "0.05", "--epsilon", "1"])
    lines = text.splitlines()
    assert code == 0 and lines[0].startswith("minimum users to detect a gap of 0.05")
    assert "47,284" in lines[0] and lines[1].startswith("setting: M_R")
    code, text = run(["--clients", "100", "--gap", "0.05", "--epsilon", "0.01"])
    assert code == 0 and "note: " in text and "refuse" in text


def test_cli_fedevalfair_queries_match_the_library() -> None:
    power = run_json(["--fedevalfair", "--holders", "10", "--rows", "1000", "--gap", "0.05"])
    assert power["plan"] == "fedevalfair" and power["query"] == "power"
    assert power["power"] == pytest.approx(fedevalfair_power(0.05, holders=10, rows=1000).power)
    holders = run_json(["--fedevalfair", "--power", "0.8", "--gap", "0.05", "--rows", "1000"])
    assert holders["query"] == "min_holders" and holders["holders"] == 4
    rows = run_json(["--fedevalfair", "--power", "0.8", "--gap", "0.05", "--holders", "10"])
    assert rows["query"] == "min_rows"
    assert rows["rows"] == fedevalfair_minimum_rows(0.8, 0.05, holders=10).rows
    listed = run_json(
        ["--fedevalfair", "--power", "0.8", "--rows", "100,200,300,1000"]
        + ["--positive-rate", "0.3", "--group-ratio", "4", "--mu0", "0.01"]
    )
    assert listed["query"] == "detectable_disparity" and listed["holders"] == 4
    assert listed["rows"] == [100, 200, 300, 1000]
    assert listed["group_fractions"] == pytest.approx([0.8, 0.2]) and listed["mu0"] == 0.01
    code, text = run(["--fedevalfair", "--holders", "10", "--rows", "1000", "--gap", "0.05"])
    assert code == 0 and text.startswith("FedEvalFair stage 2 power at a common disparity")


def test_cli_help_examples_run() -> None:
    """Every example of ``fedparity plan --help`` runs as printed (Table 1 aside: slow, and
    tests/test_cli.py runs it), the power ones included."""
    import contextlib
    import shlex

    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        main(["plan", "--help"])
    examples = [
        shlex.split(line)[2:]
        for line in text.getvalue().splitlines()
        if line.startswith("  fedparity plan ") and "--table" not in line
    ]
    assert sum("--power" in e or "--gap" in e for e in examples) >= 6
    for argv in examples:
        code, out = run(argv)
        assert code == 0 and out.strip(), argv


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--clients", "1000", "--gap", "0.05"], ("three of", "--epsilon", "--power")),
        (["--clients", "1000", "--gap", "0.05", "--epsilon", "1", "--power", "0.8"], ("not all",)),
        (["--gap", "0.05", "--epsilon", "1", "--power", "0.01"], ("--power", "(0.05, 1)")),
        (["--gap", "0.05", "--epsilon", "1", "--power", "1"], ("--power",)),
        (["--gap", "0", "--epsilon", "1", "--power", "0.8"], ("--gap", "(0, 1]")),
        (["--gap", "1.5", "--epsilon", "1", "--power", "0.8"], ("--gap",)),
        (["--gap", "0.05", "--epsilon", "1e-9", "--power", "0.8"], ("--epsilon", "[1e-06, 10000]")),
        (["--gap", "0.05", "--clients", "1e13", "--power", "0.8"], ("--clients", "1e+12")),
        (
            ["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--significance", "1"],
            ("--significance",),
        ),
        (
            ["--gap", "0.3", "--epsilon", "1", "--power", "0.8", "--metric-mean", "0.1"],
            ("--metric-mean", "[0.15, 0.85]"),
        ),
        (
            ["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--metric-variance", "0.3"],
            ("--metric-variance", "[0, 0.25]"),
        ),
        (["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--alpha", "0.1"], ("--alpha",)),
        (
            ["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--confidence", "0.9"],
            ("--confidence",),
        ),
        (["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--table"], ("--table",)),
        (
            ["--gap", "0.05", "--epsilon", "1", "--power", "0.8", "--holders", "5"],
            ("--holders", "--fedevalfair"),
        ),
        (["--fedevalfair", "--rows", "100", "--gap", "0.05"], ("three of", "--holders")),
        (["--fedevalfair", "--holders", "1", "--rows", "100", "--gap", "0.05"], ("--holders",)),
        (["--fedevalfair", "--holders", "5", "--rows", "1", "--gap", "0.05"], ("--rows",)),
        (["--fedevalfair", "--holders", "5", "--rows", "100,x", "--gap", "0.05"], ("--rows",)),
        (
            ["--fedevalfair", "--holders", "3", "--rows", "100,200", "--gap", "0.05"],
            ("--holders", "--rows"),
        ),
        (
            [
                "--fedevalfair",
                "--holders",
                "5",
                "--rows",
                "100",
                "--gap",
                "0.9",
                "--positive-rate",
                "0.2",
            ],
            ("--gap", "["),
        ),
        (["--fedevalfair", "--holders", "5", "--rows", "100", "--gap", "0"], ("--gap", "mu0")),
        (
            [
                "--fedevalfair",
                "--holders",
                "5",
                "--rows",
                "100",
                "--gap",
                "0.1",
                "--positive-rate",
                "1",
            ],
            ("--positive-rate",),
        ),
        (
            ["--fedevalfair", "--holders", "5", "--rows", "100", "--gap", "0.1", "--epsilon", "1"],
            ("--epsilon", "LDP audit"),
        ),
        (
            [
                "--fedevalfair",
                "--holders",
                "5",
                "--rows",
                "100",
                "--gap",
                "0.1",
                "--mechanism",
                "R",
            ],
            ("--mechanism",),
        ),
    ],
)
def test_cli_refuses_values_outside_what_the_math_supports(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: tuple[str, ...]
) -> None:
    capsys.readouterr()
    code, text = run(argv)
    err = capsys.readouterr().err
    assert code == 2 and text == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
