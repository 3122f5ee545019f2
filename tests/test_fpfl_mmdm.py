"""MMDM at the constraint boundary ``h_a = 0`` (``|F/n' - F_a/n'_a| = alpha``).

Equation numbers are those of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021.

Eq. (9): ``g_a = h_a`` if ``h_a >= 0`` else 0, so ``g_a = 0`` on the boundary; Eq. (10):
``lambda <- lambda + gamma g`` leaves the multiplier where it is (it grows only while
``h_a > 0``); Eq. (11) takes the ``h_a >= 0`` branch, so ``grad g_a`` is the signed gradient
and the parameter step keeps ``lambda^T grad g`` (the damping term ``c g^T grad g`` is 0).
Just inside the tolerance (``h_a < 0``) the step is plain SGD; just outside, the multiplier
grows by ``gamma h_a``.
"""

from __future__ import annotations

import numpy as np

from fedparity.mechanisms.fpfl.mmdm import (
    AggregateStatistics,
    MMDMConfig,
    evaluate_constraints,
    mmdm_update,
    sgd_update,
)

#: F_a = [0, 1], n'_a = [2, 2]: F/n' = 1/4, group rates [0, 1/2], differences [1/4, -1/4],
#: all exact in binary floating point, so alpha = 1/4 puts both groups exactly on the boundary.
ALPHA = 0.25
STATS = AggregateStatistics(
    loss_grad=np.array([2.0, -4.0]),
    surrogate_sums=np.array([0.0, 1.0]),
    surrogate_grads=np.array([[1.0, 0.0], [0.0, 2.0]]),
    constraint_counts=np.array([2.0, 2.0]),
    num_samples=10.0,
    num_errors=2.0,
    group_errors=np.array([1.0, 1.0]),
)
MULTIPLIERS = np.array([0.4, 0.7])


def config(alpha: float) -> MMDMConfig:
    return MMDMConfig(alpha=alpha, learning_rate=0.5, multiplier_learning_rate=0.3, damping=2.0)


def test_constraint_exactly_at_the_tolerance() -> None:
    evaluation = evaluate_constraints(STATS, ALPHA)
    np.testing.assert_array_equal(evaluation.differences, [0.25, -0.25])
    np.testing.assert_array_equal(evaluation.violations, [0.0, 0.0])  # h_a = 0 exactly
    np.testing.assert_array_equal(evaluation.values, [0.0, 0.0])  # g_a = 0
    np.testing.assert_array_equal(evaluation.active, [True, True])  # Eq. (11): h_a >= 0
    # grad g_a = sign(D_a) (grad F / n' - grad F_a / n'_a), grad F / n' = [1, 2] / 4:
    # a = 0: +([1/4, 1/2] - [1/2, 0]) = [-1/4, 1/2]; a = 1: -([1/4, 1/2] - [0, 1]) = [-1/4, 1/2].
    np.testing.assert_allclose(evaluation.gradients, [[-0.25, 0.5], [-0.25, 0.5]], rtol=1e-15)

    update = mmdm_update(np.zeros(2), MULTIPLIERS, STATS, config(ALPHA))
    # Eq. (10): lambda + gamma * 0 -- the multiplier does not increase on the boundary.
    np.testing.assert_array_equal(update.multipliers, MULTIPLIERS)
    # direction = grad L / n + lambda^T grad g + c g^T grad g, with g = 0:
    # [0.2, -0.4] + (0.4 + 0.7) [-1/4, 1/2] = [-0.075, 0.15].
    np.testing.assert_allclose(update.direction, [-0.075, 0.15], rtol=1e-12)
    np.testing.assert_allclose(update.weights, [0.0375, -0.075], rtol=1e-12)


def test_just_inside_and_just_outside_the_tolerance() -> None:
    inside = np.nextafter(ALPHA, 1.0)  # |D_a| < alpha by one ulp: h_a < 0
    update = mmdm_update(np.zeros(2), MULTIPLIERS, STATS, config(inside))
    assert not update.constraints.active.any()
    np.testing.assert_array_equal(update.multipliers, MULTIPLIERS)
    np.testing.assert_array_equal(update.weights, sgd_update(np.zeros(2), STATS, 0.5))

    outside = 0.2  # h_a = 0.05 > 0 for both groups
    update = mmdm_update(np.zeros(2), MULTIPLIERS, STATS, config(outside))
    np.testing.assert_allclose(update.constraints.values, [0.05, 0.05], rtol=1e-12)
    np.testing.assert_allclose(update.multipliers, MULTIPLIERS + 0.3 * 0.05, rtol=1e-12)
    assert np.all(update.multipliers > MULTIPLIERS)
