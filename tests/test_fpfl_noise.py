"""The noise the Flower client path adds (distributed noise, FPFL's Algorithm 1).

FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021.

Each node adds ``N(0, (C sigma)^2 / n_min)``
(:func:`fedparity.mechanisms.crypto.secure_sum.noise_share_std`), so the sum of ``n_min`` shares is
``N(0, (C sigma)^2)``, the noise of Algorithm 1. Checked three ways: the formula's value, the
empirical std of sums of shares drawn by the node's own code, and
``clients.app.fpfl_round`` (the handler Flower calls) adding exactly those draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedparity.clients.app import fpfl_keys, fpfl_round, fpfl_setup
from fedparity.clients.fpfl_node import round_rng
from fedparity.clients.fpfl_task import build_model_for, get_flat_parameters, statistics_layout
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users
from fedparity.clients.project.fpfl_node import (
    node_contribution,
    node_noise_multiplier,
    node_noise_share_std,
    node_shard,
)
from fedparity.mechanisms.crypto.secure_sum import minimum_survivors, noise_share_std
from fedparity.mechanisms.privacy.opacus_accounting import calibrate_noise
from fedparity.mechanisms.protocol import FPFL_KEY, MessageError
from fedparity.mechanisms.protocol.fpfl import FPFLKeyTable, FPFLRoundRequest, FPFLSetupRequest
from fedparity.strategies.fpfl import FPFLProtocol, FPFLRunParameters

#: pfl with distributed noise; 4 nodes and dropout tolerance 0.25 give n_min = 3.
PRIVATE = {
    "task": "fpfl",
    "dataset": "synthetic",
    "users-per-node": 50,
    "fpfl-algorithm": "pfl",
    "fpfl-cohort-size": 40,
    "fpfl-rounds": 20,
    "fpfl-dropout-tolerance": 0.25,
    "fpfl-secure-sum": "none",
    "fpfl-client-seed": 11,
}
NUM_NODES = 4
POPULATION = NUM_NODES * 50


pytestmark = pytest.mark.usefixtures("task_identity")


def test_noise_share_std_formula() -> None:
    """C sigma / sqrt(n_min), by hand."""
    assert noise_share_std(2.0, 1.5, 4) == 1.5
    assert noise_share_std(2.0, 1.7, 3) == pytest.approx(3.4 / math.sqrt(3), rel=1e-15)
    assert noise_share_std(1.3, 2.1191, 1) == pytest.approx(1.3 * 2.1191, rel=1e-15)
    assert noise_share_std(2.0, 0.0, 5) == 0.0
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="clipping_bound"):
            noise_share_std(bad, 1.0, 2)
    with pytest.raises(ValueError, match="noise_multiplier"):
        noise_share_std(1.0, -0.1, 2)
    with pytest.raises(ValueError, match="min_contributors"):
        noise_share_std(1.0, 1.0, 0)
    for bad in (2.5, "2", True):  # the one integer rule (check_int); 2.0 is the integer 2
        with pytest.raises(ValueError, match=r"min_contributors must be an integer >= 1"):
            noise_share_std(1.0, 1.0, bad)  # type: ignore[arg-type]
    assert noise_share_std(1.0, 1.0, 2.0) == noise_share_std(1.0, 1.0, 2)  # type: ignore[arg-type]


def test_node_rule_uses_the_nodes_own_sigma_and_n_min() -> None:
    """The node's share: C sigma / sqrt(n_min) with sigma recomputed with Opacus (independent
    computation here); 0 with central noise and for the algorithms without noise. The server
    reports (and sizes its fixed-point range with) the same value."""
    config = RunConfig.from_mapping(PRIVATE)
    sigma = calibrate_noise(
        epsilon=2.0, delta=1 / POPULATION, cohort_size=40, population_size=POPULATION, steps=20
    ).noise_multiplier
    expected = 2.0 * sigma / math.sqrt(3)  # C = 2 (default), n_min = ceil(0.75 * 4) = 3
    assert node_noise_share_std(config, POPULATION, NUM_NODES) == pytest.approx(expected, 1e-15)
    assert node_noise_share_std(config, POPULATION, 5) == pytest.approx(2.0 * sigma / 2.0, 1e-15)
    central = RunConfig.from_mapping({**PRIVATE, "fpfl-noise": "central"})
    assert node_noise_share_std(central, POPULATION, NUM_NODES) == 0.0
    clip_only = RunConfig.from_mapping({**PRIVATE, "fpfl-algorithm": "fl-clip"})
    assert node_noise_share_std(clip_only, POPULATION, NUM_NODES) == 0.0
    parameters = FPFLRunParameters.for_training(
        population_size=POPULATION,
        cohort_size=config.fpfl_cohort_size,
        rounds=config.fpfl_rounds,
        clipping_bound=config.fpfl_clipping_bound,
        epsilon=config.fpfl_epsilon,
        constraint=config.fpfl_constraint,
        num_groups=2,
        vector_size=10,
        dropout_tolerance=config.fpfl_dropout_tolerance,
    )
    assert parameters.noise_multiplier == sigma
    protocol = FPFLProtocol(
        None,  # type: ignore[arg-type]  # no message is sent
        node_ids=list(range(1, NUM_NODES + 1)),
        parameters=parameters,
        reply_timeout=config.reply_timeout,
    )
    assert protocol.noise_share_std() == node_noise_share_std(config, POPULATION, NUM_NODES)


def test_sum_of_n_min_shares_has_std_c_sigma() -> None:
    """Shares drawn by the node's code (node_contribution with an empty cohort, std from
    node_noise_share_std, seeded round_rng streams): the sum over n_min = 3 nodes, over
    R rounds x d coordinates (N draws), has variance (C sigma)^2.

    Tolerance from the chi-square law of the sample variance: (N - 1) s^2 / v ~ chi2(N - 1),
    so s^2 / v has mean 1 and standard error sqrt(2 / (N - 1)); we allow 5 standard errors
    (a false alarm with probability ~6e-7). The mean is 0 within 5 standard errors
    sqrt(v / N).
    """
    config = RunConfig.from_mapping(PRIVATE)
    survivors = minimum_survivors(NUM_NODES, config.fpfl_dropout_tolerance)
    assert survivors == 3
    share = node_noise_share_std(config, POPULATION, NUM_NODES)
    target = config.fpfl_clipping_bound * node_noise_multiplier(config, POPULATION)
    shard = synthetic_fpfl_users(1, seed=0)
    weights = get_flat_parameters(
        build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=0)
    )
    sums, firsts = [], []
    for round_number in range(250):
        shares = [
            node_contribution(
                config,
                shard,
                weights,
                sample_rate=1e-12,  # empty cohort: the message is the noise share alone
                noise_share_std=share,
                rng=round_rng(5, node, round_number),
            )
            for node in range(survivors)
        ]
        sums.append(np.sum(shares, axis=0))
        firsts.append(shares[0])
    draws = np.concatenate(sums)
    n = draws.size
    assert n > 20_000
    ratio = draws.var(ddof=1) / target**2
    assert abs(ratio - 1.0) <= 5 * math.sqrt(2 / (n - 1)), ratio
    assert abs(draws.mean()) <= 5 * target / math.sqrt(n)
    # One share alone carries 1 / n_min of that variance (same tolerance).
    single = np.concatenate(firsts)
    ratio = single.var(ddof=1) / (target**2 / survivors)
    assert abs(ratio - 1.0) <= 5 * math.sqrt(2 / (single.size - 1)), ratio


def _parameters(config: RunConfig) -> FPFLRunParameters:
    """The run parameters the server proposes for ``config`` (the nodes check them)."""
    shard = node_shard(config, 0, NUM_NODES)
    layout = statistics_layout(
        build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=config.seed),
        shard.num_groups,
    )
    return FPFLRunParameters.for_training(
        population_size=POPULATION,
        cohort_size=config.fpfl_cohort_size,
        rounds=config.fpfl_rounds,
        clipping_bound=config.fpfl_clipping_bound if config.fpfl_clips else None,
        epsilon=config.fpfl_epsilon if config.fpfl_private else None,
        constraint=config.fpfl_constraint,
        num_groups=shard.num_groups,
        vector_size=layout.size,
        distributed_noise=config.fpfl_noise == "distributed",
        masking=config.fpfl_secure_sum == "masking",
        dropout_tolerance=config.fpfl_dropout_tolerance,
    )


def _pin(config: RunConfig, context: Context, peer_ids: tuple[int, ...] = (9, 10, 11, 12)) -> bytes:
    """The setup and member table of a run without masking, through the ClientApp's handlers;
    the run digest the node pinned."""
    parameters = _parameters(config)
    salt = b"n" * 16
    fpfl_setup(
        Message(
            RecordDict({FPFL_KEY: ConfigRecord(FPFLSetupRequest(salt, parameters).to_fields())}),
            dst_node_id=9,
            message_type="query.fpfl_setup",
        ),
        context,
        config,
    )
    table = FPFLKeyTable(salt, parameters.digest(), tuple(peer_ids))
    fpfl_keys(
        Message(
            RecordDict({FPFL_KEY: ConfigRecord(table.to_fields())}),
            dst_node_id=9,
            message_type="query.fpfl_keys",
        ),
        context,
        config,
    )
    return table.run_digest()


def _round_message(weights: np.ndarray, round_number: int, run_digest: bytes) -> Message:
    request = FPFLRoundRequest(round_number, run_digest, weights)
    content = RecordDict(
        {
            FPFL_KEY: ArrayRecord({"weights": Array(weights)}),
            "config": ConfigRecord(request.to_fields()),
        }
    )
    return Message(content=content, dst_node_id=9, message_type="query.fpfl_round")


def _context(run_config: dict[str, object], partition: int) -> Context:
    return Context(
        run_id=1,
        node_id=9,
        # The node's operator allows this reproducible, unmasked research run with a
        # noise-free baseline (the built-in policy of a node outside simulation refuses all
        # three).
        node_config={
            "partition-id": partition,
            "num-partitions": NUM_NODES,
            "allow-seeded-noise": True,
            "allow-non-private": True,
            "require-masking": False,
            "fpfl-max-delta": 0.01,
        },
        state=RecordDict(),
        run_config=dict(run_config),  # type: ignore[arg-type]
    )


def test_fpfl_round_adds_the_share_of_noise_share_std() -> None:
    """The handler Flower calls: with the same seeded cohort, pfl's reply minus fl-clip's
    reply (both clip with C, only pfl adds noise) is exactly the draw
    ``N(0, noise_share_std(C, sigma, n_min)^2)`` from the node's stream, after its cohort
    draw."""
    partition, round_number = 2, 3
    replies = {}
    for algorithm in ("fl-clip", "pfl"):
        run_config = {**PRIVATE, "fpfl-algorithm": algorithm}
        config = RunConfig.from_mapping(run_config)
        shard = node_shard(config, partition, NUM_NODES)
        weights = get_flat_parameters(
            build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=config.seed)
        )
        context = _context(run_config, partition)
        digest = _pin(config, context)
        reply = fpfl_round(_round_message(weights, round_number, digest), context, config)
        replies[algorithm] = reply.content.array_records[FPFL_KEY]["sum"].numpy()
    config = RunConfig.from_mapping(PRIVATE)
    shard = node_shard(config, partition, NUM_NODES)
    rng = round_rng(config.fpfl_client_seed, partition, round_number)
    cohort = rng.random(shard.num_users) < config.fpfl_cohort_size / POPULATION
    assert cohort.any()  # the statistic part is not trivially zero
    sigma = node_noise_multiplier(config, POPULATION)
    std = noise_share_std(config.fpfl_clipping_bound, sigma, 3)
    expected_noise = rng.normal(0.0, std, size=replies["pfl"].shape)
    np.testing.assert_allclose(replies["pfl"] - replies["fl-clip"], expected_noise, atol=1e-9)
    assert std == pytest.approx(config.fpfl_clipping_bound * sigma / math.sqrt(3), rel=1e-15)


@pytest.mark.parametrize(
    ("peer_ids", "refusal"),
    [
        ((9, 9, 10, 11), "must list distinct node ids"),
        ((10, 11, 12, 13), "does not hold this node"),
    ],
)
def test_fpfl_keys_refuses_a_member_list_with_repeats_or_without_this_node(
    peer_ids: tuple[int, ...], refusal: str
) -> None:
    """The node's noise share shrinks with the run's member count, which it takes from the
    member table it pins (no separate count to disagree with): a table that repeats a node, or
    leaves this node out, is refused with a fixed sentence, and no round is answered."""
    config = RunConfig.from_mapping(PRIVATE)
    shard = node_shard(config, 0, NUM_NODES)
    weights = get_flat_parameters(
        build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=config.seed)
    )
    context = _context(PRIVATE, 0)
    with pytest.raises((NodeRefusal, MessageError), match=refusal):
        _pin(config, context, peer_ids)
    with pytest.raises(NodeRefusal, match="no pinned member table"):
        fpfl_round(_round_message(weights, 1, b"d" * 32), context, config)
