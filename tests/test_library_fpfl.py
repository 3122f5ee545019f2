"""FPFL as a library: a user's own torch model and users on each node (``fpfl_handlers``),
the server's ``FPFLProtocol`` recovering the masked sum of the nodes' clipped statistics."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation
from torch import nn

from fedparity.clients import FPFLNodeSettings, FPFLShard, fpfl_handlers
from fedparity.clients.fpfl_task import (
    get_flat_parameters,
    set_flat_parameters,
    shard_contribution,
    statistics_layout,
)
from fedparity.mechanisms.fpfl.mmdm import MMDMConfig, mmdm_update, with_constraint_terms
from fedparity.strategies import FPFLProtocol, FPFLRunParameters, FPFLTraining

NUM_NODES = 3
CLIP = 1.0
MMDM = MMDMConfig(alpha=0.05)


def make_model() -> nn.Module:
    """The user's own network (not one of fedparity's architectures)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Sigmoid())


def node_users(partition: int, users: int = 25, rows: int = 4) -> FPFLShard:
    rng = np.random.default_rng(70 + partition)
    num_samples = users * rows
    user_index = np.repeat(np.arange(users), rows).astype(np.int64)
    groups = np.repeat(rng.integers(0, 2, size=users), rows).astype(np.int64)
    labels = rng.integers(0, 2, size=num_samples).astype(np.int64)
    features = (rng.normal(size=(num_samples, 3)) + labels[:, None]).astype(np.float32)
    return FPFLShard(
        features=features,
        labels=labels,
        groups=groups,
        user_index=user_index,
        user_ids=(np.arange(users) + 1000 * partition).astype(np.int64),
        num_groups=2,
        num_classes=2,
    )


def test_settings_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="constraint must be one of"):
        FPFLNodeSettings(constraint="dp", cohort_size=10, rounds=5, clipping_bound=1.0, epsilon=1)
    with pytest.raises(ValueError, match="epsilon needs a clipping_bound"):
        FPFLNodeSettings(constraint="fnr", cohort_size=10, rounds=5, clipping_bound=None, epsilon=1)
    with pytest.raises(ValueError, match="dropout_tolerance must be in"):
        FPFLNodeSettings(
            constraint="fnr",
            cohort_size=1,
            rounds=1,
            clipping_bound=1.0,
            epsilon=None,
            dropout_tolerance=1.0,
        )
    with pytest.raises(TypeError, match="settings must be FPFLNodeSettings"):
        fpfl_handlers(make_model, lambda _: node_users(0), {"epsilon": 1.0})  # type: ignore[arg-type]


def test_the_node_noise_share_is_its_own_calibration() -> None:
    settings = FPFLNodeSettings(
        constraint="fnr",
        cohort_size=50,
        rounds=20,
        clipping_bound=2.0,
        epsilon=2.0,
        dropout_tolerance=0.25,
    )
    sigma = settings.noise_multiplier(1000)
    assert sigma > 0
    # n = 4 members, n_min = ceil(0.75 * 4) = 3: each share has std C sigma / sqrt(3).
    assert settings.noise_share_std(1000, 4) == pytest.approx(2.0 * sigma / np.sqrt(3), 1e-12)
    central = FPFLNodeSettings(
        constraint="fnr",
        cohort_size=50,
        rounds=20,
        clipping_bound=2.0,
        epsilon=2.0,
        distributed_noise=False,
    )
    assert central.noise_share_std(1000, 4) == 0.0


@pytest.mark.slow
def test_users_own_model_trains_through_masked_fpfl_rounds() -> None:
    """Every user joins (m >= K), no noise: the recovered masked sum equals the sum of every
    node's clipped statistic vectors, computed here independently."""
    settings = FPFLNodeSettings(
        constraint="fnr",
        cohort_size=10_000,
        rounds=2,
        clipping_bound=CLIP,
        epsilon=None,
        dropout_tolerance=0.0,
    )
    client_app = ClientApp()
    for action in ("fpfl_setup", "fpfl_keys", "fpfl_round", "fpfl_confirm", "fpfl_reveal"):

        def handle(msg, context: Context, action: str = action):  # noqa: ANN001, ANN202
            partition = int(context.node_config["partition-id"])
            handlers = fpfl_handlers(make_model, lambda _: node_users(partition), settings)
            return handlers[action](msg, context)

        client_app.query(action)(handle)

    model = make_model()
    weights = get_flat_parameters(model)
    layout = statistics_layout(model, num_groups=2)
    outcomes: list = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        deadline = time.monotonic() + 60
        while len(list(grid.get_node_ids())) < NUM_NODES and time.monotonic() < deadline:
            time.sleep(0.1)
        parameters = FPFLRunParameters.for_training(
            population_size=NUM_NODES * 25,
            cohort_size=settings.cohort_size,
            rounds=settings.rounds,
            clipping_bound=CLIP,
            epsilon=None,
            constraint="fnr",
            num_groups=2,
            vector_size=layout.size,
            dropout_tolerance=0.0,
        )
        protocol = FPFLProtocol(
            grid,
            node_ids=sorted(grid.get_node_ids()),
            parameters=parameters,
            reply_timeout=120.0,
        )
        protocol.setup()
        outcomes.append(protocol.run_round(1, weights))
        # The server's training loop on the same protocol: one MMDM step from round 2.
        training = FPFLTraining(layout, weights, mmdm=MMDM, use_mmdm=True)
        outcomes.append(training.start(protocol, 2, first_round=2))

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=NUM_NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    outcome, trained = outcomes
    assert outcome.total is not None, outcome.reason
    assert len(outcome.replied) == NUM_NODES and not outcome.rejected
    expected = np.zeros(layout.size)
    for partition in range(NUM_NODES):
        local = make_model()
        set_flat_parameters(local, weights)
        expected += shard_contribution(
            local, node_users(partition), constraint="fnr", clipping_bound=CLIP
        ).total
    np.testing.assert_allclose(outcome.total, expected, rtol=0, atol=1e-6)
    # Round 2 sent the same weights to the same full cohort: its MMDM step is the one from
    # the independently computed sum.
    assert [entry["round"] for entry in trained.history] == [2]
    assert "lost" not in trained.history[0]
    stats = layout.split(expected)
    step = mmdm_update(weights, np.zeros(2), with_constraint_terms(stats, stats), MMDM)
    np.testing.assert_allclose(trained.weights, step.weights, rtol=0, atol=1e-5)
    np.testing.assert_allclose(trained.multipliers, step.multipliers, rtol=0, atol=1e-5)
    assert trained.selected_round == 2
