"""FedFB (Zeng, Chen and Lee 2021) as an update rule on FPFL's released sums (issue 31).

The update is checked against a direct computation of its formula, the group weights against
their feasible set and direction, and the whole rule against FederatedSGD on a small
synthetic problem with exact statistics; the config key's errors; the nodes' privacy
settings (and so the epsilon they charge) against FPFL's; and a Flower simulation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.clients.project.fpfl_node import node_settings
from fedparity.mechanisms.fpfl.fedfb import (
    FedFBConfig,
    fedfb_update,
    initial_group_weights,
    project_to_simplex,
)
from fedparity.mechanisms.fpfl.mmdm import (
    AggregateStatistics,
    MMDMConfig,
    StatisticsLayout,
    fairness_gaps,
    sgd_update,
)
from fedparity.strategies.fpfl import FPFLTraining

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def random_statistics(
    rng: np.random.Generator, num_params: int, num_groups: int
) -> AggregateStatistics:
    """Random (noisy-looking) sums with counts well above min_count."""
    layout = StatisticsLayout(num_params, num_groups)
    stats = layout.split(rng.normal(size=layout.size))
    return replace(
        stats,
        surrogate_sums=rng.uniform(1.0, 30.0, num_groups),
        constraint_counts=rng.uniform(20.0, 80.0, num_groups),
        num_samples=float(rng.uniform(300.0, 500.0)),
    )


def random_simplex(rng: np.random.Generator, size: int) -> NDArray[np.float64]:
    return rng.dirichlet(np.ones(size))


def bisection_projection(values: NDArray[np.float64], mass: float) -> NDArray[np.float64]:
    """The simplex projection by its definition (``max(v - theta, 0)`` summing to ``mass``,
    theta by bisection to machine precision): independent of the sort-based algorithm."""
    low, high = float(values.min()) - mass, float(values.max())
    for _ in range(200):
        theta = 0.5 * (low + high)
        if np.maximum(values - theta, 0.0).sum() > mass:
            low = theta
        else:
            high = theta
    return np.maximum(values - 0.5 * (low + high), 0.0)


def direct_update(
    weights: NDArray[np.float64],
    q: NDArray[np.float64],
    stats: AggregateStatistics,
    step: float,
    learning_rate: float,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The module docstring's formulas, term by term, every group defined."""
    groups = len(q)
    risks = [stats.surrogate_sums[a] / stats.constraint_counts[a] for a in range(groups)]
    mean = sum(risks) / groups
    mu = np.array([r - mean for r in risks])
    new_q = bisection_projection(q + step * mu / math.sqrt(float(mu @ mu)), 1.0)
    n, total = stats.num_samples, float(stats.constraint_counts.sum())
    direction = stats.loss_grad / n
    for a in range(groups):
        coefficient = (total * new_q[a] - stats.constraint_counts[a]) / n
        direction = direction + coefficient * stats.surrogate_grads[a] / stats.constraint_counts[a]
    return weights - learning_rate * direction, new_q


# --------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_groups", [2, 3, 5])
def test_the_update_equals_its_formula_on_random_sums(num_groups: int) -> None:
    rng = np.random.default_rng(31 + num_groups)
    for _ in range(20):
        stats = random_statistics(rng, 7, num_groups)
        weights = rng.normal(size=7)
        q = random_simplex(rng, num_groups)
        config = FedFBConfig(step=float(rng.uniform(0.001, 0.3)), learning_rate=0.3)
        update = fedfb_update(weights, q, stats, config)
        expected_weights, expected_q = direct_update(
            weights, q, stats, config.step, config.learning_rate
        )
        np.testing.assert_allclose(update.group_weights, expected_q, rtol=0, atol=1e-12)
        np.testing.assert_allclose(update.weights, expected_weights, rtol=0, atol=1e-12)
        np.testing.assert_allclose(
            update.loss_gradient, stats.loss_grad / stats.num_samples, rtol=0, atol=1e-15
        )
        # The reweighting moves weight between groups of d' only: its total stays n' / n.
        assert abs(update.coefficients.sum()) < 1e-12


def test_the_projection_is_the_nearest_point_of_the_simplex() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        size = int(rng.integers(1, 6))
        values = rng.normal(scale=2.0, size=size)
        mass = float(rng.uniform(0.1, 2.0))
        projected = project_to_simplex(values, mass)
        np.testing.assert_allclose(
            projected, bisection_projection(values, mass), rtol=0, atol=1e-12
        )
        assert projected.min() >= 0.0 and abs(projected.sum() - mass) < 1e-12
        # No point of the simplex is nearer (the projection's defining property).
        others = rng.dirichlet(np.ones(size), size=50) * mass
        distances = np.linalg.norm(others - values, axis=1)
        assert np.linalg.norm(projected - values) <= distances.min() + 1e-12
    inside = np.array([0.2, 0.5, 0.3])
    np.testing.assert_allclose(project_to_simplex(inside), inside, rtol=0, atol=1e-15)


def test_weight_moves_toward_the_group_with_the_higher_surrogate_risk() -> None:
    """Two groups, group 1 riskier: its weight grows by exactly alpha / sqrt(2) (mu / ||mu||
    is (-1, 1) / sqrt(2)), until the simplex stops it at 1; the other way round it shrinks."""
    rng = np.random.default_rng(3)
    stats = random_statistics(rng, 4, 2)
    stats = replace(
        stats,
        surrogate_sums=np.array([10.0, 30.0]),
        constraint_counts=np.array([100.0, 50.0]),
    )
    config = FedFBConfig(step=0.1)
    q = np.array([0.7, 0.3])
    update = fedfb_update(np.zeros(4), q, stats, config)
    np.testing.assert_allclose(
        update.group_weights, q + np.array([-0.1, 0.1]) / math.sqrt(2), rtol=0, atol=1e-15
    )
    for _ in range(20):
        q = fedfb_update(np.zeros(4), q, stats, config).group_weights
        assert q.min() >= 0.0 and abs(q.sum() - 1.0) < 1e-12
    np.testing.assert_array_equal(q, [0.0, 1.0])
    flipped = replace(stats, surrogate_sums=np.array([90.0, 5.0]))
    back = fedfb_update(np.zeros(4), q, flipped, config).group_weights
    assert back[1] < q[1]
    # Equal risks: no direction, no move.
    equal = replace(stats, surrogate_sums=np.array([20.0, 10.0]))
    np.testing.assert_array_equal(fedfb_update(np.zeros(4), q, equal, config).group_weights, q)


def test_group_weights_stay_on_the_simplex_over_many_noisy_steps() -> None:
    rng = np.random.default_rng(11)
    q = None
    weights = np.zeros(5)
    for _ in range(300):
        stats = random_statistics(rng, 5, 4)
        update = fedfb_update(weights, q, stats, FedFBConfig(step=0.2))
        q = update.group_weights
        assert q.min() >= 0.0 and abs(q.sum() - 1.0) < 1e-12


def test_the_first_update_starts_at_the_data_proportions() -> None:
    rng = np.random.default_rng(5)
    stats = replace(random_statistics(rng, 3, 3), constraint_counts=np.array([60.0, 30.0, 10.0]))
    np.testing.assert_allclose(initial_group_weights(stats), [0.6, 0.3, 0.1], rtol=0, atol=1e-15)
    start = fedfb_update(np.zeros(3), None, stats, FedFBConfig())
    given = fedfb_update(np.zeros(3), initial_group_weights(stats), stats, FedFBConfig())
    np.testing.assert_array_equal(start.group_weights, given.group_weights)
    np.testing.assert_array_equal(start.weights, given.weights)
    # At the data's proportions and equal risks the direction is FederatedSGD's.
    level = replace(stats, surrogate_sums=stats.constraint_counts * 0.4)
    sgd = sgd_update(np.zeros(3), level, 0.1)
    np.testing.assert_allclose(
        fedfb_update(np.zeros(3), None, level, FedFBConfig()).weights, sgd, rtol=0, atol=1e-15
    )


def test_noisy_small_counts_leave_a_group_out_of_the_step() -> None:
    """A group whose noisy n'_a is below min_count has no risk: it keeps its weight, gets no
    coefficient, and the others move within the weight they hold; a negative noisy n is
    clamped to min_count."""
    rng = np.random.default_rng(2)
    stats = replace(
        random_statistics(rng, 4, 3),
        constraint_counts=np.array([50.0, 0.4, 40.0]),
        surrogate_sums=np.array([5.0, 3.0, 20.0]),
        num_samples=-3.0,
    )
    q = np.array([0.5, 0.2, 0.3])
    update = fedfb_update(np.zeros(4), q, stats, FedFBConfig(step=0.05, min_count=1.0))
    assert update.defined.tolist() == [True, False, True]
    assert math.isnan(update.group_risks[1])
    assert update.group_weights[1] == 0.2 and update.coefficients[1] == 0.0
    assert update.group_weights[2] > 0.3 and abs(update.group_weights.sum() - 1.0) < 1e-12
    np.testing.assert_allclose(update.loss_gradient, stats.loss_grad / 1.0, rtol=0, atol=0)
    # One defined group only: the weights do not move.
    alone = replace(stats, constraint_counts=np.array([50.0, 0.4, -2.0]))
    np.testing.assert_array_equal(
        fedfb_update(np.zeros(4), q, alone, FedFBConfig()).group_weights, q
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": 0.0}, r"step must be in \(0, 1\), got 0.0"),
        ({"step": 1.0}, r"step must be in \(0, 1\)"),
        ({"step": math.nan}, r"step must be in \(0, 1\), got nan"),
        ({"step": -0.5}, r"step must be in \(0, 1\)"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"min_count": 0.0}, "min_count"),
    ],
)
def test_bad_configs_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedFBConfig(**kwargs)


def test_group_weights_off_the_simplex_are_refused() -> None:
    stats = random_statistics(np.random.default_rng(0), 3, 2)
    for bad in ([0.5, 0.6], [1.2, -0.2], [0.5, math.nan]):
        with pytest.raises(ValueError, match="group_weights"):
            fedfb_update(np.zeros(3), np.array(bad), stats, FedFBConfig())
    with pytest.raises(ValueError, match=r"group_weights must have shape \(2,\)"):
        fedfb_update(np.zeros(3), np.array([1.0]), stats, FedFBConfig())
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        fedfb_update(np.zeros(2), None, stats, FedFBConfig())


# --------------------------------------------------------------------------------------------
# FedFB against FederatedSGD with exact statistics
# --------------------------------------------------------------------------------------------


def synthetic_problem(seed: int, n: int = 4000) -> tuple[NDArray, NDArray, NDArray]:
    """Logistic data where the minority group's positives (20 % of samples) are less separated
    (mean shift 1 instead of 2), so the unweighted model misses more of them."""
    rng = np.random.default_rng(seed)
    groups = (rng.random(n) < 0.2).astype(int)
    labels = (rng.random(n) < 0.3).astype(int)
    signal = labels * np.where(groups == 1, 1.0, 2.0) + rng.normal(size=n)
    features = np.column_stack([signal, groups, np.ones(n)])
    return features, labels, groups


def exact_statistics(
    weights: NDArray, features: NDArray, labels: NDArray, groups: NDArray
) -> AggregateStatistics:
    """The FNR-parity statistic sums of a logistic model (FPFL Eq. 17: cross-entropy gradient,
    F_a = sum of 1 - P(y = 1) over group a's positives, its gradient, the counts)."""
    probability = 1.0 / (1.0 + np.exp(-(features @ weights)))
    positive = labels == 1
    members = [positive & (groups == a) for a in (0, 1)]
    predicted = probability >= 0.5
    return AggregateStatistics(
        loss_grad=features.T @ (probability - labels),
        surrogate_sums=np.array([np.sum(1.0 - probability[m]) for m in members]),
        surrogate_grads=np.stack(
            [
                -(features[m] * (probability * (1.0 - probability))[m, None]).sum(axis=0)
                for m in members
            ]
        ),
        constraint_counts=np.array([float(m.sum()) for m in members]),
        num_samples=float(labels.size),
        num_errors=float(np.sum(predicted != labels)),
        group_errors=np.array([float(np.sum(m & ~predicted)) for m in members]),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedfb_reduces_the_fnr_gap_against_federated_sgd(seed: int) -> None:
    """Noise-free sums, 500 steps of eta = 1 from zero weights. FederatedSGD ends with an FNR
    gap (max_a |FNR - FNR_a|) of about 0.16 here; FedFB (alpha = 0.02) moves weight to the
    minority's positives and ends below a third of it (observed: under 0.02) while its
    accuracy stays within 0.05 of FederatedSGD's (observed: 0.02 lower)."""
    features, labels, groups = synthetic_problem(seed)
    sgd = np.zeros(3)
    fedfb = np.zeros(3)
    q = None
    config = FedFBConfig(step=0.02, learning_rate=1.0)
    for _ in range(500):
        sgd = sgd_update(sgd, exact_statistics(sgd, features, labels, groups), 1.0)
        update = fedfb_update(fedfb, q, exact_statistics(fedfb, features, labels, groups), config)
        fedfb, q = update.weights, update.group_weights
    plain = fairness_gaps(labels, (features @ sgd >= 0).astype(int), groups, 2)
    fair = fairness_gaps(labels, (features @ fedfb >= 0).astype(int), groups, 2)
    assert plain.fnr_gap > 0.1
    assert fair.fnr_gap < plain.fnr_gap / 3
    assert fair.accuracy > plain.accuracy - 0.05
    assert q is not None and q[1] > 0.5  # the minority's positives weigh more than their share


# --------------------------------------------------------------------------------------------
# The training loop, the run config and the nodes' privacy
# --------------------------------------------------------------------------------------------


def test_the_training_loop_takes_fedfb_steps_and_keeps_the_weights_in_multipliers() -> None:
    rng = np.random.default_rng(4)
    layout = StatisticsLayout(6, 2)
    weights = rng.normal(size=6)
    fedfb = FedFBConfig(step=0.05, learning_rate=0.2)
    training = FPFLTraining(
        layout, weights, mmdm=MMDMConfig(learning_rate=0.2), use_mmdm=False, fedfb=fedfb
    )
    assert training.update_rule == "fedfb"
    assert training.selector.require_fair  # fairness-aware: FPFL's selection rule
    np.testing.assert_array_equal(training.multipliers, [0.0, 0.0])
    expected_weights, expected_q = weights, None
    for round_number in (1, 2, 3):
        stats = random_statistics(rng, 6, 2)
        step = fedfb_update(expected_weights, expected_q, stats, fedfb)
        expected_weights, expected_q = step.weights, step.group_weights
        training.update(round_number, stats.to_vector())
        np.testing.assert_array_equal(training.weights, expected_weights)
        np.testing.assert_array_equal(training.multipliers, expected_q)
    with pytest.raises(ValueError, match="use_mmdm must be False with fedfb"):
        FPFLTraining(layout, weights, mmdm=MMDMConfig(), use_mmdm=True, fedfb=fedfb)
    assert FPFLTraining(layout, weights, mmdm=MMDMConfig(), use_mmdm=True).update_rule == "mmdm"
    assert FPFLTraining(layout, weights, mmdm=MMDMConfig(), use_mmdm=False).update_rule == "sgd"


@pytest.mark.usefixtures("task_identity")
def test_a_paused_fedfb_training_resumes_with_its_group_weights(tmp_path: Path) -> None:
    """Over real nodes in this process: a FedFB training paused after 2 rounds keeps its group
    weights q in the checkpoint and resumes at round 3 with them; the resumed run then equals
    the uninterrupted one (every user in every round, exact sums)."""
    from fedparity.clients.fpfl_task import get_flat_parameters, statistics_layout
    from fedparity.strategies.fpfl import FPFLProtocol
    from fedparity.strategies.fpfl_observers import DurableTraining
    from tests.support.fpfl_nodes import EXACT, MaskingNodes, make_model
    from tests.support.handler_grid import HandlerGrid

    def protocol() -> FPFLProtocol:
        nodes = MaskingNodes([1, 2, 3], EXACT)
        return FPFLProtocol(
            HandlerGrid(lambda node, action: nodes.handlers[action], nodes.contexts),  # type: ignore[arg-type]
            node_ids=nodes.ids,
            parameters=nodes.parameters,
            reply_timeout=5.0,
        )

    def training() -> FPFLTraining:
        return FPFLTraining(
            statistics_layout(make_model(), 2),
            get_flat_parameters(make_model()),
            mmdm=MMDMConfig(learning_rate=0.5),
            use_mmdm=False,
            fedfb=FedFBConfig(step=0.1, learning_rate=0.5),
        )

    def run(folder: Path, stops: list[int | None]) -> FPFLTraining:
        server = protocol()
        for stop in stops:
            trained = training()
            trained.start(server, 4, folder=folder, stop_after=stop)
        return trained

    paused = tmp_path / "paused"
    q = run(paused, [2]).multipliers.copy()
    assert q.sum() == pytest.approx(1.0) and q.min() >= 0
    restored = training()
    assert DurableTraining(paused).restore(restored, protocol()) == 2
    np.testing.assert_array_equal(restored.multipliers, q)
    resumed = run(tmp_path / "resumed", [2, None])
    whole = run(tmp_path / "whole", [None])
    np.testing.assert_allclose(resumed.weights, whole.weights, rtol=0, atol=1e-12)
    np.testing.assert_allclose(resumed.multipliers, whole.multipliers, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"fpfl-fedfb-step must be in \(0, 1\), got 0"),
        (1, r"fpfl-fedfb-step must be in \(0, 1\), got 1"),
        (-0.1, r"fpfl-fedfb-step must be in \(0, 1\)"),
        ("fast", "fpfl-fedfb-step must be a number"),
    ],
)
def test_bad_fedfb_steps_are_named(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(
            {"task": "fpfl", "fpfl-algorithm": "fedfb", "fpfl-fedfb-step": value}
        )


def test_fedfb_is_private_like_fpfl_and_the_nodes_cannot_tell_them_apart() -> None:
    """The nodes' settings (clipping, epsilon, delta, accountant, noise, masking: what they
    compute sigma from and charge their users' ledgers with) do not depend on the update rule."""
    common = {"task": "fpfl", "fpfl-epsilon": 1.5, "fpfl-cohort-size": 300}
    fedfb = RunConfig.from_mapping({**common, "fpfl-algorithm": "fedfb"})
    fpfl = RunConfig.from_mapping({**common, "fpfl-algorithm": "fpfl"})
    assert (fedfb.fpfl_update_rule, fpfl.fpfl_update_rule) == ("fedfb", "mmdm")
    assert fedfb.fpfl_private and fedfb.fpfl_clips and not fedfb.fpfl_uses_mmdm
    assert node_settings(fedfb) == node_settings(fpfl)
    assert node_settings(fedfb).noise_multiplier(3000) == node_settings(fpfl).noise_multiplier(3000)
    assert {
        RunConfig.from_mapping({"fpfl-algorithm": name}).fpfl_update_rule
        for name in (
            "fl",
            "fl-clip",
            "pfl",
        )
    } == {"sgd"}


# --------------------------------------------------------------------------------------------
# Through a Flower simulation
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fedfb_runs_as_a_flower_job_and_charges_what_fpfl_charges(tmp_path: Path) -> None:
    """fpfl-algorithm = "fedfb" through the Python API (3 simulated nodes, 4 rounds) completes,
    its nodes report the same ledger totals and epsilon as "fpfl" with the same parameters,
    the group weights stay on the simplex, and the report names FedFB."""
    from fedparity.server.api import run_simulation_job
    from tests.support.fpfl_nodes import FPFL_JOB_3_NODES as common

    runs = {}
    for algorithm in ("fedfb", "fpfl"):
        runs[algorithm] = run_simulation_job(
            {**common, "fpfl-algorithm": algorithm, "output-dir": str(tmp_path / algorithm)},
            num_supernodes=3,
        )
    fedfb, fpfl = runs["fedfb"], runs["fpfl"]
    assert fedfb["status"] == "completed" and fedfb["algorithm"] == "fedfb"
    assert fedfb["private"] is True and fedfb["epsilon"] == pytest.approx(fpfl["epsilon"])
    assert fedfb["noise_multiplier"] == fpfl["noise_multiplier"]
    nodes = fedfb["privacy"]["ledger_totals_reported_by_nodes"]
    assert nodes is not None
    assert nodes == fpfl["privacy"]["ledger_totals_reported_by_nodes"]
    for entry in fedfb["history"]:
        q = np.array(entry["multipliers"])
        assert q.min() >= 0.0 and abs(q.sum() - 1.0) < 1e-9
    report = (tmp_path / "fedfb" / "report.html").read_text()
    assert "FedFB" in report and "Zeng, Chen and Lee" in report
