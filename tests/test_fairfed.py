"""FairFed (Ezzeldin et al., AAAI 2023) on FPFL's protocol, with its per-node releases under
user-level DP (issue 31).

The weight update is checked against the paper's formula computed by hand on small releases;
the noise split by the privacy loss of the composed mechanism (dp_accounting's PLD); the node's
release and scaled sum by their sensitivity and, by Monte Carlo, the release noise; a hostile
scale from the server is refused; and whole trainings run over real nodes in this process and
through a Flower simulation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant

from fedparity.clients.fpfl_data import FPFLShard
from fedparity.clients.fpfl_node import cohort_sum, round_contribution
from fedparity.clients.fpfl_task import statistics_layout
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.clients.project.fpfl_node import node_settings
from fedparity.mechanisms.fpfl.fairfed import (
    RELEASE_BLOCKS,
    FairFedConfig,
    combined_noise_multiplier,
    fairfed_step,
    initial_node_weights,
    node_scales,
    release_indices,
    release_noise_multipliers,
    release_size,
)
from fedparity.mechanisms.fpfl.mmdm import MMDMConfig, StatisticsLayout
from fedparity.mechanisms.protocol import FPFL_KEY, MessageError
from fedparity.mechanisms.protocol.fpfl import RELEASE_ARRAY, FPFLRoundRequest, FPFLRunParameters
from fedparity.strategies.fpfl import FPFLProtocol, FPFLTraining
from fedparity.strategies.fpfl_observers import DurableTraining
from tests.support.fpfl_nodes import (
    CLIP,
    EXACT,
    MaskingNodes,
    make_model,
    node_users,
    run_parameters,
)
from tests.support.handler_grid import HandlerGrid

pytestmark = pytest.mark.usefixtures("task_identity")
LAYOUT = StatisticsLayout(num_params=3, num_groups=2)


def release(
    counts: tuple[float, ...], errors: tuple[float, ...], *, samples: float | None = None
) -> np.ndarray:
    """A node's release with group constraint counts and errors (other blocks filled in)."""
    vector = np.zeros(LAYOUT.size)
    vector[LAYOUT.block("constraint_counts")] = counts
    vector[LAYOUT.block("group_errors")] = errors
    vector[LAYOUT.block("num_samples")] = samples if samples is not None else 2 * sum(counts)
    vector[LAYOUT.block("num_errors")] = sum(errors)
    return vector[release_indices(LAYOUT)]


# --------------------------------------------------------------------------------------------
# The mechanism
# --------------------------------------------------------------------------------------------


def test_the_release_is_every_block_but_the_gradients() -> None:
    layout = StatisticsLayout(num_params=5, num_groups=3)
    indices = release_indices(layout)
    assert indices.size == release_size(3) == 3 * 3 + 3
    gradients = np.r_[
        np.arange(layout.size)[layout.block("loss_grad")],
        np.arange(layout.size)[layout.block("surrogate_grads")],
    ]
    assert sorted(np.r_[indices, gradients].tolist()) == list(range(layout.size))
    assert set(RELEASE_BLOCKS) | {"loss_grad", "surrogate_grads"} == set(layout._bounds())


def test_the_weights_follow_fairfeds_update_computed_by_hand() -> None:
    """Three nodes, two groups; F = FNR_2 - FNR_1. Node A: rates 0.2, 0.6 (F = 0.4); B: 0.4,
    0.4 (F = 0); C: 0.3, 0.3 (F = 0). Pooled: errors (60, 56) over (200, 120): F = 56/120 -
    0.3. Delta = |F_global - F_k|; omega_k - beta (Delta_k - mean Delta), normalised."""
    rows = np.stack(
        [
            release((50, 50), (10, 30)),
            release((50, 50), (20, 20)),
            release((100, 20), (30, 6)),
        ]
    )
    f_global = 56 / 120 - 60 / 200
    deltas = np.array([abs(f_global - 0.4), abs(f_global), abs(f_global)])
    omega = np.array([0.5, 0.3, 0.2])
    beta = 0.3
    expected = omega - beta * (deltas - deltas.mean())
    expected /= expected.sum()
    step = fairfed_step(omega, rows, FairFedConfig(beta=beta), LAYOUT)
    np.testing.assert_allclose(step.distances, deltas, rtol=0, atol=1e-12)
    np.testing.assert_allclose(step.global_fairness, [f_global], rtol=0, atol=1e-12)
    np.testing.assert_allclose(step.weights, expected, rtol=0, atol=1e-12)
    assert step.weights[0] < omega[0]  # the node farthest from the global fairness loses
    assert not step.used_accuracy.any()


def test_a_node_without_both_groups_is_weighed_by_its_accuracy_gap() -> None:
    """FairFed: where F_k is undefined (a group absent), Delta_k = |Acc_global - Acc_k|."""
    rows = np.stack(
        [
            release((50, 50), (10, 30), samples=200),
            release((60, 0), (30, 0), samples=100),
        ]
    )
    step = fairfed_step(np.array([0.5, 0.5]), rows, FairFedConfig(beta=0.5), LAYOUT)
    pooled_accuracy = 1 - (40 + 30) / 300
    assert step.used_accuracy.tolist() == [False, True]
    assert step.distances[1] == pytest.approx(abs(pooled_accuracy - (1 - 30 / 100)), abs=1e-12)


def test_a_node_without_a_release_keeps_its_weight() -> None:
    rows = np.stack(
        [
            release((50, 50), (10, 30)),
            np.full(release_size(2), np.nan),
            release((50, 50), (20, 20)),
        ]
    )
    omega = np.array([0.2, 0.5, 0.3])
    step = fairfed_step(omega, rows, FairFedConfig(beta=0.2), LAYOUT)
    assert math.isnan(step.distances[1])
    # the others move by -beta (Delta - mean) around their mean; node 1 keeps 0.5 before the
    # normalisation, which the moves (summing to 0) leave at 1
    assert step.weights[1] == pytest.approx(0.5, abs=1e-12)
    assert step.weights.sum() == pytest.approx(1.0, abs=1e-12)


def test_weights_stay_non_negative_and_sum_to_one_under_heavy_noise() -> None:
    rng = np.random.default_rng(0)
    omega = np.full(5, 0.2)
    for _ in range(200):
        rows = np.stack([release((30, 10), (6, 5)) + rng.normal(0, 8, release_size(2))] * 5)
        rows += rng.normal(0, 8, rows.shape)
        omega = fairfed_step(omega, rows, FairFedConfig(beta=1.0), LAYOUT).weights
        assert omega.min() >= 0 and omega.sum() == pytest.approx(1.0, abs=1e-9)


def test_the_scaled_sum_is_fairfeds_weighted_mean_of_the_node_gradients() -> None:
    """sum_k s_k L_k / sum_k s_k n_k with s = node_scales(omega, omega^0), omega^0 = n_k / n,
    equals sum_k omega_k (L_k / n_k) / sum_k omega_k (the aggregate of FairFed's Algorithm 1)."""
    rng = np.random.default_rng(4)
    counts = np.array([120.0, 40.0, 300.0, 75.0])
    gradients = rng.normal(size=(4, 6))  # L_k, summed gradients of node k
    omega = rng.dirichlet(np.ones(4))
    scales = node_scales(omega, counts / counts.sum())
    assert scales.max() == 1.0 and scales.min() >= 0.0
    released = (scales[:, None] * gradients).sum(0) / (scales * counts).sum()
    fairfed = (omega[:, None] * gradients / counts[:, None]).sum(0) / omega.sum()
    np.testing.assert_allclose(released, fairfed, rtol=1e-12, atol=1e-14)


def test_the_start_is_the_nodes_share_of_the_noisy_sample_counts() -> None:
    rows = np.stack(
        [
            release((10, 10), (1, 1), samples=100),
            np.full(release_size(2), np.nan),
            release((10, 10), (1, 1), samples=300),
            release((10, 10), (1, 1), samples=-5),  # noise: clamped to min_count
        ]
    )
    start = initial_node_weights(rows, FairFedConfig(min_count=1.0), LAYOUT)
    counts = np.array([100.0, np.median([100, 300, -5]), 300.0, 1.0])
    np.testing.assert_allclose(start, counts / counts.sum(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 0.9])
def test_the_noise_split_costs_what_the_accounted_sigma_costs(share: float) -> None:
    """The sum (noise C sigma_sum) and a node's release (noise C sigma_release) of the same
    users: their composed privacy loss (dp_accounting PLD) is that of one Gaussian with the
    run's sigma, so the epsilon the nodes charge holds."""
    sigma = 1.3
    sigma_sum, sigma_release = release_noise_multipliers(sigma, share)
    assert combined_noise_multiplier(sigma_sum, sigma_release) == pytest.approx(sigma, rel=1e-12)
    assert sigma_sum > sigma and sigma_release > sigma

    def epsilon(event: dp_accounting.DpEvent) -> float:
        accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        return accountant.compose(event).get_epsilon(1e-6)

    pair = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma_sum), dp_accounting.GaussianDpEvent(sigma_release)]
    )
    single = epsilon(dp_accounting.GaussianDpEvent(sigma))
    assert epsilon(pair) == pytest.approx(single, rel=2e-3)
    # the split is not free: either part alone at the run's sigma would leave the other uncovered
    both_at_sigma = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma)] * 2)
    assert epsilon(both_at_sigma) > 1.2 * single


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, "beta must be"),
        ({"beta": math.nan}, "beta must be"),
        ({"min_count": -1.0}, "min_count must be"),
    ],
)
def test_bad_fairfed_configs_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FairFedConfig(**kwargs)


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, math.nan])
def test_a_release_share_outside_the_open_unit_interval_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="release_share must be in"):
        release_noise_multipliers(1.0, share)


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "fpfl-fairfed-release-share"), ("1.5", "fpfl-fairfed-release-share")],
)
def test_bad_release_shares_in_the_run_config_are_named(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping({"fpfl-algorithm": "fairfed", "fpfl-fairfed-release-share": value})


def test_fairfed_charges_what_fpfl_charges_and_only_fairfed_nodes_release() -> None:
    """Same sigma (so the same epsilon in every ledger); only FairFed's nodes release."""
    common = {"task": "fpfl", "fpfl-epsilon": 1.5, "fpfl-cohort-size": 300}
    fairfed = node_settings(RunConfig.from_mapping({**common, "fpfl-algorithm": "fairfed"}))
    fpfl = node_settings(RunConfig.from_mapping({**common, "fpfl-algorithm": "fpfl"}))
    assert fairfed.noise_multiplier(3000) == fpfl.noise_multiplier(3000)
    assert fairfed.fairfed_release_share == 0.25 and fpfl.fairfed_release_share == 0.0
    assert replace(fairfed, fairfed_release_share=0.0) == fpfl


# --------------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------------


def _without_user(shard: FPFLShard, user: int) -> FPFLShard:
    keep = shard.user_index != user
    index = shard.user_index[keep]
    return replace(
        shard,
        features=shard.features[keep],
        labels=shard.labels[keep],
        groups=shard.groups[keep],
        user_index=np.where(index > user, index - 1, index),
        user_ids=np.delete(shard.user_ids, user),
    )


def exact_sum(model: torch.nn.Module, shard: FPFLShard) -> np.ndarray:
    """The node's clipped sum over every user, without noise."""
    return cohort_sum(
        model,
        shard,
        constraint="fnr",
        clipping_bound=CLIP,
        sample_rate=1.0,
        rng=np.random.default_rng(0),
    )


@pytest.mark.parametrize("scale", [1.0, 0.3, 0.0])
def test_one_user_moves_the_scaled_sum_by_at_most_scale_c_and_the_release_by_at_most_c(
    scale: float,
) -> None:
    """The sensitivity the noise split assumes, on the node's real statistics: removing any
    one user (every user in the cohort, no noise) changes the scaled sum by <= scale * C and
    the release by <= C."""
    model, shard = make_model(), node_users()
    indices = release_indices(statistics_layout(model, 2))

    def both(users: FPFLShard) -> tuple[np.ndarray, np.ndarray]:
        out = round_contribution(
            model,
            users,
            constraint="fnr",
            clipping_bound=CLIP,
            sample_rate=1.0,
            noise_share_std=0.0,
            release_std=0.0,
            scale=scale,
            rng=np.random.default_rng(0),
        )
        return out.total, out.release

    total, released = both(shard)
    raw = exact_sum(model, shard)
    np.testing.assert_allclose(released, raw[indices], rtol=0, atol=1e-9)
    np.testing.assert_allclose(total, scale * raw, rtol=0, atol=1e-9)
    largest = (0.0, 0.0)
    for user in range(shard.num_users):
        other_total, other_release = both(_without_user(shard, user))
        largest = (
            max(largest[0], float(np.linalg.norm(total - other_total))),
            max(largest[1], float(np.linalg.norm(released - other_release))),
        )
    assert largest[0] <= scale * CLIP + 1e-6
    assert largest[1] <= CLIP + 1e-6
    assert largest[1] > 0.05 * CLIP  # the users do move it: the bound is not vacuous


def test_the_release_noise_has_the_std_of_the_split() -> None:
    """Monte Carlo: release - exact block ~ N(0, (C sigma_release)^2); the sample std of
    N = 400 x 9 draws is within 4 of its standard errors sigma / sqrt(2 N) of the target."""
    model, shard = make_model(), node_users()
    indices = release_indices(statistics_layout(model, 2))
    release_std = CLIP * release_noise_multipliers(1.1, 0.25)[1]
    exact = exact_sum(model, shard)[indices]
    draws = np.stack(
        [
            round_contribution(
                model,
                shard,
                constraint="fnr",
                clipping_bound=CLIP,
                sample_rate=1.0,
                noise_share_std=0.5,
                release_std=release_std,
                scale=1.0,
                rng=np.random.default_rng(seed),
            ).release
            - exact
            for seed in range(400)
        ]
    )
    n = draws.size
    assert abs(draws.mean()) < 4 * release_std / math.sqrt(n)
    assert abs(draws.std() - release_std) < 4 * release_std / math.sqrt(2 * n)


FAIRFED_EXACT = replace(EXACT, fairfed_release_share=0.25)
#: The exact runs' policy, with FairFed's per-node release allowed (and masking without a
#: roster, as EXACT_POLICY).
FAIRFED_POLICY = NodePrivacyPolicy(
    allow_non_private=True, allow_node_release=True, require_roster=False
)


@pytest.mark.parametrize("scale", [1.5, -0.1, math.nan, math.inf, "0.5", True])
def test_a_hostile_node_scale_is_refused_before_anything_is_computed(scale: object) -> None:
    """Attack: a server sends one node a scale above 1 to lift its users' part of the sum above
    the noise (sensitivity scale * C). The node refuses any scale outside [0, 1] (and non-numbers)
    from the message itself, before it samples, computes or charges anything."""
    nodes = MaskingNodes([1, 2, 3], FAIRFED_EXACT, policy=FAIRFED_POLICY)
    nodes.setup()
    nodes.pin()
    content = nodes.round_message(1)
    content.config_records["config"]["node-scale"] = scale  # type: ignore[index]
    with pytest.raises(MessageError, match="node-scale"):
        nodes.send("fpfl_round", 1, content)
    # without the check the request would carry the scale to the node's sum
    with pytest.raises(MessageError, match="node-scale"):
        FPFLRoundRequest(1, b"\0" * 32, np.zeros(3), scale)  # type: ignore[arg-type]


def test_a_node_releases_its_own_statistics_only_if_its_policy_allows_it() -> None:
    """allow-node-release (default false; the simulation policy allows it): a node whose
    policy does not allow FairFed's per-node release refuses the run at setup, before it
    makes a key or reads a user."""
    nodes = MaskingNodes([1, 2, 3], FAIRFED_EXACT)  # EXACT_POLICY: node releases not allowed
    with pytest.raises(Exception, match="FairFed's per-node release needs allow-node-release"):
        nodes.setup()
    assert NodePrivacyPolicy.simulation().allow_node_release
    assert not NodePrivacyPolicy().allow_node_release


def test_a_scale_is_refused_in_a_run_that_is_not_fairfed() -> None:
    nodes = MaskingNodes([1, 2, 3], EXACT)
    nodes.setup()
    nodes.pin()
    content = nodes.round_message(1)
    content.config_records["config"]["node-scale"] = 0.5
    with pytest.raises(Exception, match="node-scale is for FairFed runs only"):
        nodes.send("fpfl_round", 1, content)


def test_a_node_refuses_a_run_with_another_release_share() -> None:
    """The share is agreed once per run: a node set for FairFed at 0.25 refuses 0.5 (or FPFL)."""
    nodes = MaskingNodes([1, 2, 3], FAIRFED_EXACT, policy=FAIRFED_POLICY)
    for other in (0.5, 0.0):
        proposed = replace(nodes.parameters, fairfed_release_share=other)
        with pytest.raises(Exception, match="FairFed release share"):
            nodes.setup(proposed)


def test_the_share_changes_the_run_digest_only_in_a_fairfed_run() -> None:
    plain = run_parameters(EXACT)
    assert plain.digest() == replace(plain, fairfed_release_share=0.0).digest()
    fairfed = replace(plain, fairfed_release_share=0.25)
    assert fairfed.digest() != plain.digest()
    assert FPFLRunParameters.from_fields(fairfed.to_fields()) == fairfed
    assert "fairfed-release-share" not in plain.to_fields()


# --------------------------------------------------------------------------------------------
# A training over real nodes in this process
# --------------------------------------------------------------------------------------------


def _grid(nodes: MaskingNodes) -> HandlerGrid:
    return HandlerGrid(lambda node, action: nodes.handlers[action], nodes.contexts)


def _protocol(nodes: MaskingNodes, grid: HandlerGrid | None = None) -> FPFLProtocol:
    """The library's server protocol over ``nodes`` (through ``grid``, default theirs)."""
    return FPFLProtocol(
        grid or _grid(nodes),  # type: ignore[arg-type]
        node_ids=nodes.ids,
        parameters=nodes.parameters,
        reply_timeout=5.0,
    )


@pytest.mark.parametrize("private", [False, True])
def test_a_fairfed_training_sends_scales_reads_releases_and_moves_the_weights(
    private: bool,
) -> None:
    settings = (
        replace(FAIRFED_EXACT, epsilon=4.0, delta=1e-5, cohort_size=600, dropout_tolerance=0.0)
        if private
        else FAIRFED_EXACT
    )
    nodes = MaskingNodes(
        [11, 12, 13],
        settings,
        policy=NodePrivacyPolicy(allow_node_release=True, require_roster=False)
        if private
        else FAIRFED_POLICY,
    )
    grid = _grid(nodes)
    protocol = _protocol(nodes, grid)
    layout = statistics_layout(make_model(), 2)
    training = FPFLTraining(
        layout,
        nodes.weights,
        mmdm=MMDMConfig(alpha=0.02, learning_rate=0.5),
        use_mmdm=False,
        fairfed=FairFedConfig(beta=0.5),
    )
    result = training.start(protocol, 4, observers=[])
    assert training.update_rule == "fairfed"
    assert len(result.history) == 4 and all("lost" not in e for e in result.history)
    weights = [np.array(e["fairfed_weights"]) for e in result.history]
    for w in weights:
        assert w.min() >= 0 and w.sum() == pytest.approx(1.0, abs=1e-9)
    # the scales the server sent (every round after the first) follow the weights
    sent = [m for m in grid.sent if m[0] == "fpfl_round"]
    assert len(sent) == 4 * 3
    scales = training.node_scales()
    assert scales is not None and set(scales) == set(nodes.ids)
    assert max(scales.values()) == pytest.approx(1.0) and min(scales.values()) >= 0
    if not private:
        # exact releases: the three nodes hold the same users, so the weights stay equal
        np.testing.assert_allclose(weights[-1], np.full(3, 1 / 3), atol=1e-9)
        assert not np.array_equal(result.weights, nodes.weights)


@pytest.mark.parametrize(
    ("fedfb", "mmdm", "rule"), [(True, False, "fairfed+fedfb"), (False, True, "fairfed+mmdm")]
)
def test_fairfeds_weights_combine_with_fedfb_or_mmdm_steps(
    fedfb: bool, mmdm: bool, rule: str
) -> None:
    """The node weights pair with another update rule on the weighted sums (the FairFed
    paper pairs them with local debiasing): FedFB's group weights stay on the simplex, MMDM's
    multipliers are >= 0."""
    from fedparity.mechanisms.fpfl.fedfb import FedFBConfig

    nodes = MaskingNodes([1, 2, 3], FAIRFED_EXACT, policy=FAIRFED_POLICY)
    protocol = _protocol(nodes)
    training = FPFLTraining(
        statistics_layout(make_model(), 2),
        nodes.weights,
        mmdm=MMDMConfig(alpha=0.0, learning_rate=0.5, multiplier_learning_rate=0.5),
        use_mmdm=mmdm,
        fedfb=FedFBConfig(step=0.1) if fedfb else None,
        fairfed=FairFedConfig(),
    )
    result = training.start(protocol, 3, observers=[])
    assert training.update_rule == rule
    multipliers = np.array(result.history[-1]["multipliers"])
    if fedfb:
        assert multipliers.min() >= 0 and multipliers.sum() == pytest.approx(1.0)
    else:
        assert multipliers.min() >= 0 and multipliers.max() > 0
    assert all(len(entry["fairfed_weights"]) == 3 for entry in result.history)


def test_the_server_refuses_fairfed_on_a_run_without_releases() -> None:
    nodes = MaskingNodes([1, 2], EXACT)
    protocol = _protocol(nodes)
    training = FPFLTraining(
        statistics_layout(make_model(), 2),
        nodes.weights,
        mmdm=MMDMConfig(),
        use_mmdm=False,
        fairfed=FairFedConfig(),
    )
    with pytest.raises(ValueError, match="fairfed_release_share > 0"):
        training.start(protocol, 1, observers=[])
    with pytest.raises(ValueError, match="FairFed runs only"):
        protocol.run_round(1, nodes.weights, {1: 0.5})


def test_a_malformed_release_is_a_rejected_reply_not_a_crash() -> None:
    """A node whose reply lacks its release (or holds NaN) is counted as rejected."""
    nodes = MaskingNodes([1, 2, 3, 4], FAIRFED_EXACT, policy=FAIRFED_POLICY)
    inner = nodes.handlers["fpfl_round"]

    def tamper(node: int, action: str):  # noqa: ANN202
        if action != "fpfl_round" or node != 2:
            return nodes.handlers[action]

        def broken(message, context):  # noqa: ANN001, ANN202
            reply = inner(message, context)
            record = reply.content.array_records[FPFL_KEY]
            del record[RELEASE_ARRAY]
            return reply

        return broken

    protocol = _protocol(nodes, HandlerGrid(tamper, nodes.contexts))
    protocol.setup()
    outcome = protocol.run_round(1, nodes.weights)
    assert [node for node, _ in outcome.rejected] == [2]
    assert RELEASE_ARRAY in str(outcome.rejected[0][1])
    assert sorted(outcome.releases) == [1, 3, 4] and outcome.total is not None


# --------------------------------------------------------------------------------------------
# Through a Flower simulation
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fairfed_runs_as_a_flower_job_and_charges_what_fpfl_charges(tmp_path: Path) -> None:
    """fpfl-algorithm = "fairfed" through the Python API (3 simulated nodes, 4 rounds)
    completes with the same epsilon and ledger totals as "fpfl", node weights on the simplex,
    and a report that names FairFed."""
    from fedparity.server.api import run_simulation_job
    from tests.support.fpfl_nodes import FPFL_JOB_3_NODES as common

    runs = {}
    for algorithm in ("fairfed", "fpfl"):
        runs[algorithm] = run_simulation_job(
            {**common, "fpfl-algorithm": algorithm, "output-dir": str(tmp_path / algorithm)},
            num_supernodes=3,
        )
    fairfed, fpfl = runs["fairfed"], runs["fpfl"]
    # fpfl-fairfed-debiasing = "fedfb": FedFB's group weights move on the weighted sums too
    debiased = run_simulation_job(
        {
            **common,
            "fpfl-algorithm": "fairfed",
            "fpfl-fairfed-debiasing": "fedfb",
            "output-dir": str(tmp_path / "fairfed-fedfb"),
        },
        num_supernodes=3,
    )
    assert debiased["epsilon"] == pytest.approx(fpfl["epsilon"])
    for entry in debiased["history"]:
        q = np.array(entry["multipliers"])
        assert q.min() >= 0.0 and abs(q.sum() - 1.0) < 1e-9
        assert len(entry["fairfed_weights"]) == 3
    assert all(not any(entry["multipliers"]) for entry in fairfed["history"])
    assert "FedFB" in (tmp_path / "fairfed-fedfb" / "report.html").read_text()
    assert fairfed["status"] == "completed" and fairfed["algorithm"] == "fairfed"
    assert fairfed["epsilon"] == pytest.approx(fpfl["epsilon"])
    assert fairfed["noise_multiplier"] == fpfl["noise_multiplier"]
    split = fairfed["privacy"]["fairfed_noise"]
    assert fpfl["privacy"]["fairfed_noise"] is None and split["release_share"] == 0.25
    assert combined_noise_multiplier(
        split["sum_noise_multiplier"], split["release_noise_multiplier"]
    ) == pytest.approx(fairfed["noise_multiplier"], rel=1e-12)
    nodes = fairfed["privacy"]["ledger_totals_reported_by_nodes"]
    assert nodes is not None and nodes == fpfl["privacy"]["ledger_totals_reported_by_nodes"]
    for entry in fairfed["history"]:
        w = np.array(entry["fairfed_weights"])
        assert len(w) == 3 and w.min() >= 0.0 and abs(w.sum() - 1.0) < 1e-9
    report = (tmp_path / "fairfed" / "report.html").read_text()
    assert "FairFed" in report and "Ezzeldin" in report


def test_a_paused_fairfed_training_resumes_with_its_node_weights(tmp_path: Path) -> None:
    """The checkpoint keeps the nodes, their weights, the start and the smoothed releases: a
    training paused after 2 rounds resumes at round 3 with the same node weights."""
    layout = statistics_layout(make_model(), 2)

    def training() -> FPFLTraining:
        return FPFLTraining(
            layout,
            make_flat_weights(),
            mmdm=MMDMConfig(alpha=0.02, learning_rate=0.5),
            use_mmdm=False,
            fairfed=FairFedConfig(beta=0.5),
            smoothing=0.5,
        )

    nodes = MaskingNodes([1, 2, 3], FAIRFED_EXACT, policy=FAIRFED_POLICY)
    protocol = _protocol(nodes)
    first = training()
    first.start(protocol, 4, folder=tmp_path, stop_after=2)
    assert first.node_weights is not None and first.smoothed_releases is not None
    resumed = training()
    assert DurableTraining(tmp_path).restore(resumed, protocol) == 2
    assert resumed.fairfed_nodes == first.fairfed_nodes == nodes.ids
    for name in ("node_weights", "base_weights", "smoothed_releases"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(first, name))
    result = resumed.start(protocol, 4, folder=tmp_path, stop_after=1)
    assert result.first_round == 3 and len(resumed.history) == 3


def make_flat_weights() -> np.ndarray:
    from fedparity.clients.fpfl_task import get_flat_parameters

    return get_flat_parameters(make_model())


# --------------------------------------------------------------------------------------------
# The non-IID split FairFed is meant for
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.1, 1000.0])
def test_the_dirichlet_split_deals_every_user_once_with_group_skew_set_by_alpha(
    alpha: float,
) -> None:
    """fpfl-split = "dirichlet": the nodes' shards partition the users (each exactly once,
    deterministic from the seed); the nodes' shares of a group follow Dirichlet(alpha): at
    alpha = 0.1 far from equal (the largest node holds most of a group), at alpha = 1000
    within a few percent of 1 / nodes."""
    from fedparity.clients.project.fpfl_node import group_dirichlet_owners, node_shard

    config = RunConfig.from_mapping(
        {
            "task": "fpfl",
            "dataset": "synthetic",
            "users-per-node": 400,
            "fpfl-split": "dirichlet",
            "fpfl-dirichlet-alpha": alpha,
        }
    )
    nodes = 5
    shards = [node_shard(config, node, nodes) for node in range(nodes)]
    assert sum(shard.num_users for shard in shards) == 400 * nodes
    from fedparity.clients.project.fpfl_node import population

    train, _ = population(config, nodes)
    owners = group_dirichlet_owners(train, nodes, alpha, config.seed)
    np.testing.assert_array_equal(owners, group_dirichlet_owners(train, nodes, alpha, config.seed))
    _, first = np.unique(train.user_index, return_index=True)
    user_groups = train.groups[first]
    for group in range(train.num_groups):
        shares = np.bincount(owners[user_groups == group], minlength=nodes) / np.sum(
            user_groups == group
        )
        if alpha < 1:
            assert shares.max() > 0.5
        else:
            np.testing.assert_allclose(shares, 1 / nodes, atol=0.05)
    for node, shard in enumerate(shards):
        assert shard.num_users == int(np.sum(owners == node))


def test_the_iid_split_is_unchanged_by_the_new_keys() -> None:
    from fedparity.clients.project.fpfl_node import node_shard, population

    config = RunConfig.from_mapping({"task": "fpfl", "dataset": "synthetic", "users-per-node": 50})
    train, _ = population(config, 3)
    expected = train.partition(1, 3)
    np.testing.assert_array_equal(node_shard(config, 1, 3).features, expected.features)
