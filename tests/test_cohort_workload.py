"""The fixed per-round workload of an FPFL node (``mechanisms/fpfl/cohort_workload.py``): its
tails are upper bounds of the true ones, it is the smallest workload with the asked tail, and the
ledger charges what is left of the tail."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms.fpfl.cohort_workload import cohort_workload, rows_tail_bound
from fedparity.mechanisms.privacy.user_ledger import (
    SubsampledGaussianRelease,
    UserLedger,
    compose,
    release_from_dict,
)


def test_a_one_user_device_always_computes_its_user() -> None:
    """One user: the workload is that user's rows whether or not it was sampled, no tail."""
    for rows in (1, 3, 40):
        workload = cohort_workload([rows], 0.01, 1e-12)
        assert (workload.user_slots, workload.sample_slots) == (1, rows)
        assert workload.tail_probability == 0.0


@pytest.mark.parametrize("threshold", [70, 80, 90, 100])
def test_the_rows_tail_bound_is_an_upper_bound(threshold: int) -> None:
    """Monte Carlo of ``P[X >= t]`` for ``X = sum n_u B_u``, 200,000 cohorts of 300 users with
    1..9 rows: the Chernoff bound is above the estimate minus 4 standard errors."""
    rng = np.random.default_rng(3)
    counts = np.maximum(rng.poisson(2, 300), 1)
    rate = 0.1
    draws = 200_000
    rows = (rng.random((draws, counts.size)) < rate) @ counts
    estimate = float(np.mean(rows >= threshold))
    stderr = math.sqrt(max(estimate * (1 - estimate), 1 / draws) / draws)
    bound = rows_tail_bound(counts, rate, threshold)
    assert bound >= estimate - 4 * stderr
    assert bound <= 1.0


def test_with_equal_rows_the_bound_is_the_binomials_chernoff_bound() -> None:
    """``n`` users of ``k`` rows each: ``X = k Bin(n, q)``, whose Chernoff bound has the closed
    form ``exp(-n KL(a || q))`` at ``a = t / (k n)`` (the relative entropy of Bernoulli laws)."""
    users, rows, rate, threshold = 500, 2, 0.1, 160
    a = threshold / (rows * users)
    kl = a * math.log(a / rate) + (1 - a) * math.log((1 - a) / (1 - rate))
    bound = rows_tail_bound(np.full(users, rows), rate, threshold)
    assert bound == pytest.approx(math.exp(-users * kl), rel=1e-6)
    # and it bounds the exact tail, P[Bin >= 80]
    assert bound >= stats.binom.sf(threshold // rows - 1, users, rate)


def test_the_workload_is_the_smallest_with_the_asked_tail() -> None:
    rng = np.random.default_rng(5)
    counts = np.maximum(rng.poisson(2, 1000), 1)
    rate, tail = 0.07, 1e-9
    workload = cohort_workload(counts, rate, tail)
    users = counts.size
    assert stats.binom.sf(workload.user_slots, users, rate) <= tail / 2
    assert stats.binom.sf(workload.user_slots - 1, users, rate) > tail / 2
    assert rows_tail_bound(counts, rate, workload.sample_slots + 1) <= tail / 2
    assert rows_tail_bound(counts, rate, workload.sample_slots) > tail / 2
    assert 0 < workload.tail_probability <= tail
    # more than the mean cohort, far less than every user
    assert rate * users < workload.user_slots < users
    assert rate * counts.sum() < workload.sample_slots < counts.sum()


def test_no_tail_means_every_user_and_row() -> None:
    workload = cohort_workload([2, 3, 4], 0.2, 0.0)
    assert (workload.user_slots, workload.sample_slots, workload.tail_probability) == (3, 9, 0.0)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (([], 0.1, 1e-9), "rows_per_user"),
        (([1, -1], 0.1, 1e-9), "rows_per_user"),
        (([1.5], 0.1, 1e-9), "rows_per_user"),
        (([1], 0.0, 1e-9), "sample_rate"),
        (([1], 1.5, 1e-9), "sample_rate"),
        (([1], 0.1, 1.0), "tail_probability"),
        (([1], 0.1, -1e-9), "tail_probability"),
    ],
)
def test_bad_input_is_named(arguments: tuple, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        cohort_workload(*arguments)


# -- the ledger's side events ---------------------------------------------------------------


def _training(steps: int, tail: float = 0.0) -> SubsampledGaussianRelease:
    return SubsampledGaussianRelease(
        noise_multiplier=2.0,
        sample_rate=0.07,
        steps=steps,
        delta=1e-5,
        timing_tail_probability=tail,
        job="fpfl",
        time="2026-11-28T00:00:00+00:00",
    )


def test_a_total_with_a_side_event_holds_at_the_users_delta() -> None:
    """With tail ``s`` the total is ``(eps, delta)`` only if the PLD's own delta at ``eps`` plus
    ``(1 + e^eps) s`` is at most ``delta`` (the ledger's "side events"): checked on the PLD."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution

    delta, tail = 1e-6, 1e-10
    total = compose([_training(250, tail)], delta)
    plain = compose([_training(250)], delta)
    assert total.epsilon > plain.epsilon
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=2.0,
        sampling_prob=0.07,
        value_discretization_interval=1e-3,
        neighboring_relation=NeighboringRelation.REPLACE_ONE,
    ).self_compose(250)
    assert pld.get_delta_for_epsilon(total.epsilon) + (1 + math.exp(total.epsilon)) * tail <= delta
    # basic composition carries the side delta too
    assert total.basic_delta == pytest.approx(1e-5 + (1 + math.exp(total.basic_epsilon)) * tail)


def test_a_tail_too_large_for_the_delta_gives_no_finite_epsilon() -> None:
    assert compose([_training(250, 1e-3)], 1e-6).pld_epsilon == math.inf


def test_a_training_extended_block_by_block_ends_where_one_charge_would() -> None:
    ledger = UserLedger(budget=10.0, delta=1e-6, num_users=3)
    ledger.charge(_training(1))
    for steps in (2, 4, 8, 16, 32, 64, 128, 250):
        ledger.extend(0, _training(steps))
    whole = UserLedger(budget=10.0, delta=1e-6, num_users=3)
    whole.charge(_training(250))
    assert ledger.total(0).epsilon == whole.total(0).epsilon
    assert len(ledger.releases) == 1


def test_an_extension_is_the_same_release_over_more_rounds_only() -> None:
    ledger = UserLedger(budget=10.0, delta=1e-6, num_users=2)
    ledger.charge(_training(4))
    with pytest.raises(ValueError, match="same release over more rounds"):
        ledger.extend(0, dataclasses.replace(_training(8), noise_multiplier=3.0))
    with pytest.raises(ValueError, match="cannot take rounds away"):
        ledger.extend(0, _training(2))
    before = ledger.total(0).epsilon
    with pytest.raises(Exception, match="past the budget"):
        ledger.extend(0, _training(100_000))
    assert ledger.total(0).epsilon == before  # nothing changed


def test_a_release_saved_before_the_tail_field_still_loads() -> None:
    saved = _training(5).to_dict()
    del saved["timing_tail_probability"]
    assert release_from_dict(saved) == _training(5)
