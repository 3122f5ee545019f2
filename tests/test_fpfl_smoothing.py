"""Smoothing of the released sums over rounds and the count-activated constraint (FPFL)."""

from __future__ import annotations

import numpy as np
import pytest

from fedparity.mechanisms.fpfl.mmdm import (
    AggregateStatistics,
    MMDMConfig,
    evaluate_constraints,
    exponential_average,
    mmdm_update,
    with_constraint_terms,
)

#: Surrogate rates [0.5, 0.5] (no surrogate gap); hard rates e_a / n'_a = [0.25, 0.75].
STATS = AggregateStatistics(
    loss_grad=np.array([2.0, -4.0]),
    surrogate_sums=np.array([2.0, 2.0]),
    surrogate_grads=np.array([[1.0, 0.0], [0.0, 2.0]]),
    constraint_counts=np.array([4.0, 4.0]),
    num_samples=10.0,
    num_errors=4.0,
    group_errors=np.array([1.0, 3.0]),
)


def test_exponential_average() -> None:
    current = np.array([1.0, 2.0])
    np.testing.assert_array_equal(exponential_average(None, current, 0.9), current)
    np.testing.assert_allclose(
        exponential_average(np.array([3.0, 4.0]), current, 0.75), [2.5, 3.5], rtol=1e-15
    )
    np.testing.assert_array_equal(exponential_average(np.array([3.0, 4.0]), current, 0.0), current)
    with pytest.raises(ValueError, match="smoothing must be in"):
        exponential_average(None, current, 1.0)
    with pytest.raises(ValueError, match="shape"):
        exponential_average(np.zeros(3), current, 0.5)


def test_with_constraint_terms_takes_only_the_constraint_blocks() -> None:
    smoothed = AggregateStatistics(
        loss_grad=np.zeros(2),
        surrogate_sums=np.array([1.0, 3.0]),
        surrogate_grads=np.ones((2, 2)),
        constraint_counts=np.array([5.0, 5.0]),
        num_samples=99.0,
        num_errors=0.0,
        group_errors=np.zeros(2),
    )
    mixed = with_constraint_terms(STATS, smoothed)
    np.testing.assert_array_equal(mixed.loss_grad, STATS.loss_grad)
    assert mixed.num_samples == STATS.num_samples
    np.testing.assert_array_equal(mixed.group_errors, STATS.group_errors)
    np.testing.assert_array_equal(mixed.surrogate_sums, smoothed.surrogate_sums)
    np.testing.assert_array_equal(mixed.surrogate_grads, smoothed.surrogate_grads)
    np.testing.assert_array_equal(mixed.constraint_counts, smoothed.constraint_counts)


def test_count_activation_uses_hard_rates_and_surrogate_direction() -> None:
    surrogate = evaluate_constraints(STATS, 0.1)
    assert not surrogate.active.any()  # surrogate rates are equal: paper's constraint inactive
    counts = evaluate_constraints(STATS, 0.1, activation="counts")
    # hard overall rate 4 / 8 = 0.5; differences [0.25, -0.25]; h = 0.15.
    np.testing.assert_allclose(counts.differences, [0.25, -0.25], rtol=1e-15)
    np.testing.assert_allclose(counts.values, [0.15, 0.15], rtol=1e-12)
    # grad F / n' = [1, 2] / 8; a = 0: +([1/8, 1/4] - [1/4, 0]); a = 1: -([1/8, 1/4] - [0, 1/2]).
    np.testing.assert_allclose(counts.gradients, [[-0.125, 0.25], [-0.125, 0.25]], rtol=1e-12)
    # Accuracy parity: the surrogate measures correct predictions, so the sign flips.
    flipped = evaluate_constraints(STATS, 0.1, activation="counts", error_surrogate=False)
    np.testing.assert_allclose(flipped.differences, [-0.25, 0.25], rtol=1e-15)
    np.testing.assert_allclose(flipped.gradients, -counts.gradients, rtol=1e-12)
    with pytest.raises(ValueError, match="activation must be one of"):
        evaluate_constraints(STATS, 0.1, activation="hard")


def test_mmdm_update_with_count_activation() -> None:
    config = MMDMConfig(
        alpha=0.1, learning_rate=0.5, multiplier_learning_rate=0.2, activation="counts"
    )
    update = mmdm_update(np.zeros(2), np.zeros(2), STATS, config)
    np.testing.assert_allclose(update.multipliers, [0.03, 0.03], rtol=1e-12)
    # grad L / n = [0.2, -0.4]; coefficients 0.03 + 2 * 0.15 = 0.33 per group.
    expected = np.array([0.2, -0.4]) + 0.66 * np.array([-0.125, 0.25])
    np.testing.assert_allclose(update.direction, expected, rtol=1e-12)
    with pytest.raises(ValueError, match="activation must be one of"):
        MMDMConfig(activation="hard")
