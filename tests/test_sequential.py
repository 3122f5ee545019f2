"""The sequential gap audit: time-uniform coverage of its confidence sequences under optional
stopping, the users it saves against a fixed-size audit, its stopping rules and refusals."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from fedparity.mechanisms.ldp.calibration import gap_variance_factor
from fedparity.mechanisms.ldp.estimators import normal_quantile
from fedparity.mechanisms.ldp.nprr import NPRRMechanism, nprr_for_budget
from fedparity.mechanisms.ldp.reports import PerturbedReports
from fedparity.mechanisms.ldp.sequential import (
    STOP_REASONS,
    SequentialGapAudit,
    beta_mixture_interval,
    fixed_audit_size,
    sequential_gap_audit,
)


def binomial_tolerance(level: float, runs: int, sds: float = 3.3) -> float:
    """How far below ``level`` an observed coverage rate over ``runs`` independent runs may
    fall when the true rate is at least ``level``: ``sds`` binomial standard deviations
    (3.3: a one-sided false alarm of 5e-4 under the normal approximation)."""
    return sds * math.sqrt(level * (1 - level) / runs)


class Population:
    """Fresh users drawn at random: group by ``shares``, metric Bernoulli(``means[g]``)."""

    def __init__(self, shares: np.ndarray, means: np.ndarray) -> None:
        self.shares, self.means = shares, means

    @property
    def max_gap(self) -> float:
        return float(self.means.max() - self.means.min())

    def asker(
        self, mechanism: NPRRMechanism, rng: np.random.Generator, log: list[int] | None = None
    ) -> Callable[[int], PerturbedReports]:
        def next_batch(n: int) -> PerturbedReports:
            if log is not None:
                log.append(n)
            groups = rng.choice(len(self.shares), size=n, p=self.shares)
            metric = (rng.random(n) < self.means[groups]).astype(np.float64)
            return mechanism.perturb(groups, 2 * metric - 1, rng)

        return next_batch


# ---- the confidence sequence of one mean ------------------------------------------------------


@pytest.mark.slow
def test_the_beta_mixture_sequence_covers_a_bounded_mean_at_every_time() -> None:
    # [0, 1]-valued observations (not Bernoulli: uniform on {0, 0.5, 1} shifted) with mean 0.3;
    # a miss is the sequence excluding 0.3 at any of the 2000 times.
    runs, steps, level = 400, 2000, 0.9
    rng = np.random.default_rng(1)
    missed = 0
    for _ in range(runs):
        x = rng.choice([0.0, 0.25, 0.65], size=steps, p=[0.3, 0.4, 0.3])  # mean 0.295
        sums = np.cumsum(x)
        for t in range(0, steps, 20):
            interval = beta_mixture_interval(float(sums[t]), t + 1, level)
            if not interval.low <= 0.295 <= interval.high:
                missed += 1
                break
    assert missed / runs <= 1 - level + binomial_tolerance(1 - level, runs)


def test_the_beta_mixture_sequence_shrinks_and_keeps_its_ends_in_the_unit_interval() -> None:
    assert beta_mixture_interval(0, 0, 0.95).width == 1.0
    wide, narrow = beta_mixture_interval(30, 100, 0.95), beta_mixture_interval(3000, 10_000, 0.95)
    assert wide.low < 0.3 < wide.high and narrow.low < 0.3 < narrow.high
    assert narrow.width < wide.width / 5
    assert beta_mixture_interval(0, 50, 0.95).low == 0.0
    assert beta_mixture_interval(50, 50, 0.95).high == 1.0


# ---- the audit's coverage -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shares", "means", "runs"),
    [
        (np.array([0.6, 0.4]), np.array([0.7, 0.6]), 400),
        (np.array([0.3, 0.2, 0.2, 0.15, 0.15]), np.array([0.5, 0.6, 0.7, 0.55, 0.65]), 200),
    ],
    ids=["d=2", "d=5"],
)
@pytest.mark.slow
def test_the_confidence_sequence_covers_at_every_batch_over_many_runs(
    shares: np.ndarray, means: np.ndarray, runs: int
) -> None:
    # Time-uniform: a run misses when, after any of its 24 batches of 500 fresh users, a
    # group's interval or the largest gap's interval excludes the truth. Every batch is checked
    # (the audit is run past any stop), so coverage holds at whatever batch a stopping rule,
    # sequential_gap_audit's or any other, would pick.
    d, level = len(shares), 0.9
    mechanism = nprr_for_budget(1.0, d)
    population = Population(shares, means)
    rng = np.random.default_rng(2026 + d)
    missed = 0
    for _ in range(runs):
        audit = SequentialGapAudit(mechanism, confidence=level)
        ask = population.asker(mechanism, rng)
        for _ in range(24):
            batch = audit.update(ask(500))
            groups_covered = all(
                ci.low <= m <= ci.high for ci, m in zip(batch.group_intervals, means, strict=True)
            )
            gap_covered = batch.interval.low <= population.max_gap <= batch.interval.high
            if not (groups_covered and gap_covered):
                missed += 1
                break
    assert missed / runs <= 1 - level + binomial_tolerance(1 - level, runs)


@pytest.mark.slow
def test_with_the_undefined_category_the_sequences_cover_the_defined_users_means() -> None:
    """TPR-like metrics: a quarter of the users report the undefined category (value 0, i.e.
    m = 1/2, far from the groups' means); the groups' sequences cover the means over their
    defined users at every batch, at level 0.9 over 300 runs."""
    level, runs = 0.9, 300
    mechanism = nprr_for_budget(1.0, 3)
    shares = np.array([0.45, 0.3, 0.25])  # group 0, group 1, undefined
    means = np.array([0.8, 0.6])
    rng = np.random.default_rng(77)
    missed = 0
    for _ in range(runs):
        audit = SequentialGapAudit(mechanism, confidence=level, undefined_category=True)
        for _ in range(20):
            groups = rng.choice(3, size=500, p=shares)
            metric = np.where(
                groups < 2, (rng.random(500) < means[np.minimum(groups, 1)]).astype(float), 0.5
            )
            batch = audit.update(mechanism.perturb(groups, 2 * metric - 1, rng))
            covered = (
                all(
                    ci.low <= m <= ci.high
                    for ci, m in zip(batch.group_intervals, means, strict=True)
                )
                and batch.interval.low <= 0.2 <= batch.interval.high
            )
            if not covered:
                missed += 1
                break
    assert len(audit.pairs) == 1 and len(audit.group_means()) == 2
    assert missed / runs <= 1 - level + binomial_tolerance(1 - level, runs)
    with pytest.raises(ValueError, match="num_groups >= 3"):
        SequentialGapAudit(nprr_for_budget(1.0, 2), undefined_category=True)


def test_the_coverage_check_catches_a_fixed_n_interval_looked_at_after_every_batch() -> None:
    # Power of the check above: the fixed-n normal 0.9 interval of estimate_gap, valid at one
    # planned size, looked at after each of 24 batches (the first of 2000 users, so that both
    # groups are seen through the group step's noise) misses far more often than 0.1.
    from fedparity.mechanisms.ldp.estimators import estimate_gap
    from fedparity.mechanisms.ldp.reports import ReportSummary

    means, runs, level = np.array([0.7, 0.6]), 200, 0.9
    mechanism = nprr_for_budget(1.0, 2)
    population = Population(np.array([0.6, 0.4]), means)
    rng = np.random.default_rng(11)
    z = normal_quantile(level)
    missed = 0
    for _ in range(runs):
        ask = population.asker(mechanism, rng)
        summary = ReportSummary.empty(2)
        for size in [2000] + [500] * 23:
            reports = ask(size)
            summary = summary.merge(ReportSummary.from_reports(reports.groups, reports.values, 2))
            estimate = estimate_gap(summary, mechanism, confidence=level)
            if np.any(np.abs(estimate.group_means - means) > z * estimate.group_stderrs):
                missed += 1
                break
    assert missed / runs > 1 - level + binomial_tolerance(1 - level, runs)


# ---- the users it saves ---------------------------------------------------------------------


def test_a_clear_gap_is_found_with_fewer_users_than_the_fixed_audit_needs() -> None:
    mechanism = nprr_for_budget(1.0, 2)
    target, level = 0.1, 0.95
    fixed = fixed_audit_size(mechanism, target, confidence=level)
    population = Population(np.array([0.5, 0.5]), np.array([0.8, 0.5]))
    rng = np.random.default_rng(7)
    asked = []
    for _ in range(20):
        result = sequential_gap_audit(
            mechanism,
            population.asker(mechanism, rng),
            batch_size=1000,
            max_users=10 * fixed,
            target_width=target,
            confidence=level,
        )
        assert result.stopped_because == "the groups differ"
        assert result.interval.low > 0
        asked.append(result.users_asked)
    saving = 1 - np.mean(asked) / fixed
    assert saving > 0, (np.mean(asked), fixed)


def test_the_fixed_audit_size_is_the_fewest_users_whose_interval_is_narrow_enough() -> None:
    for d, level, target in ((2, 0.95, 0.1), (5, 0.9, 0.05)):
        mechanism = nprr_for_budget(2.0, d)
        size = fixed_audit_size(mechanism, target, confidence=level)
        z = normal_quantile(1 - (1 - level) / (d * (d - 1) // 2))
        factor = gap_variance_factor(mechanism.moments, np.full(d, 1 / d))

        def width(k: int, z: float = z, factor: float = factor) -> float:
            return 2 * z * math.sqrt(factor / k) / 2  # 2 z sd, sd = sqrt(factor / k) / 2

        assert width(size) <= target < width(size - 1)


# ---- stopping, the users asked and refusals ---------------------------------------------------


def test_no_gap_stops_at_the_cap_and_asks_exactly_the_cap() -> None:
    mechanism = nprr_for_budget(1.0, 2)
    population = Population(np.array([0.5, 0.5]), np.array([0.6, 0.6]))
    log: list[int] = []
    result = sequential_gap_audit(
        mechanism,
        population.asker(mechanism, np.random.default_rng(3), log),
        batch_size=700,
        max_users=5000,
        target_width=0.01,
    )
    assert result.stopped_because == STOP_REASONS[2]
    assert log == [700] * 7 + [100]  # the last batch asks only up to the cap
    assert result.users_asked == 5000 == sum(log)
    assert [b.users for b in result.batches] == list(np.cumsum(log))
    assert result.privacy_spent == 5000 * mechanism.epsilon
    assert result.to_dict()["privacy_spent"] == result.privacy_spent


def test_a_reachable_width_stops_there() -> None:
    mechanism = nprr_for_budget(4.0, 2)
    population = Population(np.array([0.5, 0.5]), np.array([0.6, 0.6]))
    result = sequential_gap_audit(
        mechanism,
        population.asker(mechanism, np.random.default_rng(4)),
        batch_size=5000,
        max_users=10**6,
        target_width=0.2,
    )
    assert result.stopped_because == STOP_REASONS[1]
    assert all(ci.width < 0.2 for ci in result.difference_intervals)
    assert result.users_asked < 10**6
    # the previous batch was not yet narrow enough, or the audit would have stopped there
    if len(result.batches) > 1:
        previous = result.batches[-2].group_intervals
        assert previous[0].width + previous[1].width >= 0.2


def test_the_intervals_only_narrow_from_batch_to_batch() -> None:
    mechanism = nprr_for_budget(1.0, 3)
    population = Population(np.array([0.4, 0.3, 0.3]), np.array([0.5, 0.6, 0.7]))
    audit = SequentialGapAudit(mechanism, confidence=0.9)
    ask = population.asker(mechanism, np.random.default_rng(5))
    previous = None
    for _ in range(10):
        state = audit.update(ask(1000))
        if previous is not None:
            for now, before in zip(state.group_intervals, previous.group_intervals, strict=True):
                assert before.low <= now.low and now.high <= before.high
        previous = state


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda m, ask: sequential_gap_audit(
                m, ask, batch_size=0, max_users=10, target_width=0.1
            ),
            "batch_size must be an integer >= 1",
        ),
        (
            lambda m, ask: sequential_gap_audit(
                m, ask, batch_size=10, max_users=10, target_width=0.0
            ),
            "target_width must be a finite number > 0",
        ),
        (
            lambda m, ask: sequential_gap_audit(
                m, ask, batch_size=10, max_users=10, target_width=0.1, confidence=1.0
            ),
            "confidence must be in the open interval",
        ),
        (
            lambda m, ask: sequential_gap_audit(
                m, lambda n: ask(n + 1), batch_size=10, max_users=10, target_width=0.1
            ),
            "one per asked user",
        ),
        (
            lambda m, ask: SequentialGapAudit(m).update(
                PerturbedReports(np.array([0, 1]), np.array([0.5, 1.0]))
            ),
            "reports.values must be M_N reports",
        ),
        (lambda m, ask: SequentialGapAudit("R"), "mechanism must be an NPRRMechanism"),
        (
            lambda m, ask: beta_mixture_interval(11, 10, 0.9),
            "total must be in",
        ),
    ],
)
def test_bad_input_is_refused_with_the_parameter_and_its_range(call, message: str) -> None:
    mechanism = NPRRMechanism(1.0, 1.0, 2, 1)
    ask = Population(np.array([0.5, 0.5]), np.array([0.5, 0.5])).asker(
        mechanism, np.random.default_rng(0)
    )
    with pytest.raises(ValueError, match=message):
        call(mechanism, ask)
