"""The node side of FPFL: Poisson cohorts, noise shares and the node's own sigma."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedparity.clients.fpfl_node import round_rng
from fedparity.clients.fpfl_task import (
    build_model_for,
    get_flat_parameters,
    statistics_layout,
    user_statistics,
)
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users
from fedparity.clients.project.fpfl_node import node_contribution, node_noise_multiplier
from fedparity.mechanisms.crypto.secure_sum import minimum_survivors
from fedparity.mechanisms.privacy.opacus_accounting import calibrate_noise
from tests.support.import_probe import last_line_printed

CONFIG = RunConfig.from_mapping({"task": "fpfl", "fpfl-algorithm": "fl"})


def weights_for(shard) -> np.ndarray:  # noqa: ANN001
    model = build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=0)
    return get_flat_parameters(model)


def test_node_sigma_is_recomputed_with_opacus() -> None:
    config = RunConfig.from_mapping({"task": "fpfl", "fpfl-cohort-size": 200, "fpfl-rounds": 50})
    expected = calibrate_noise(
        epsilon=2.0, delta=1 / 5000, cohort_size=200, population_size=5000, steps=50
    ).noise_multiplier
    assert node_noise_multiplier(config, 5000) == expected
    assert node_noise_multiplier(CONFIG, 5000) == 0.0  # fl: no noise


def test_noise_shares_of_the_minimum_survivors_add_up_to_the_full_noise() -> None:
    """n_min shares of std C sigma / sqrt(n_min) sum to N(0, C^2 sigma^2): the sample
    variance of 400 rounds x 107 coordinates (42,800 draws; relative sd sqrt(2 / 42800) =
    0.7%) is within 4% of C^2 sigma^2."""
    shard = synthetic_fpfl_users(1, seed=0)
    weights = weights_for(shard)
    clip, sigma, survivors = 2.0, 1.7, minimum_survivors(4, 0.25)
    share = clip * sigma / math.sqrt(survivors)
    totals = []
    for round_number in range(400):
        parts = [
            node_contribution(
                CONFIG,
                shard,
                weights,
                sample_rate=1e-12,  # empty cohort: the message is the noise share alone
                noise_share_std=share,
                rng=round_rng(3, node, round_number),
            )
            for node in range(survivors)
        ]
        totals.append(np.sum(parts, axis=0))
    draws = np.concatenate(totals)
    assert draws.var() == pytest.approx((clip * sigma) ** 2, rel=0.04)
    assert abs(draws.mean()) < 4 * clip * sigma / math.sqrt(draws.size)


@pytest.mark.slow  # over 5 s: CI runs it, the fast lane leaves it out
def test_cohorts_are_poisson_samples_drawn_on_the_node() -> None:
    """Every user joins with probability q independently: over 300 rounds the number of
    samples summed (the n block) has the binomial mean q * sum(N_k) within 4 sd."""
    shard = synthetic_fpfl_users(400, seed=1)
    weights = weights_for(shard)
    rate = 0.1
    model = build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=0)
    layout = statistics_layout(model, 2)
    counts = []
    for round_number in range(300):
        total = node_contribution(
            CONFIG,
            shard,
            weights,
            sample_rate=rate,
            noise_share_std=0.0,
            rng=round_rng(None, 0, round_number),  # OS entropy, as in a private run
        )
        counts.append(total[layout.block("num_samples")][0])
    sizes = shard.samples_per_user().astype(np.float64)
    mean = rate * sizes.sum()
    sd = math.sqrt(rate * (1 - rate) * np.sum(sizes**2) / 300)
    assert abs(np.mean(counts) - mean) < 4 * sd


def test_unclipped_baseline_sums_the_raw_vectors() -> None:
    shard = synthetic_fpfl_users(30, seed=2)
    weights = weights_for(shard)
    total = node_contribution(
        CONFIG, shard, weights, sample_rate=1.0, noise_share_std=0.0, rng=round_rng(0, 0, 1)
    )
    model = build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=0)
    expected = user_statistics(model, shard, constraint="fnr").sum(dim=0)
    torch.testing.assert_close(torch.from_numpy(total), expected)


def test_seeded_streams_differ_by_node_and_round_and_repeat() -> None:
    first = round_rng(5, 0, 1).random(4)
    np.testing.assert_array_equal(first, round_rng(5, 0, 1).random(4))
    assert not np.array_equal(first, round_rng(5, 1, 1).random(4))
    assert not np.array_equal(first, round_rng(5, 0, 2).random(4))
    assert not np.array_equal(first, round_rng(5, 0, 1, central=True).random(4))
    with pytest.raises(ValueError, match="sample_rate"):
        node_contribution(
            CONFIG,
            synthetic_fpfl_users(3, seed=0),
            weights_for(synthetic_fpfl_users(3, seed=0)),
            sample_rate=0.0,
            noise_share_std=0.0,
            rng=round_rng(0, 0, 0),
        )


def test_the_warm_heap_is_frozen_once_per_process_until_thawed() -> None:
    # A second freeze would also freeze the cyclic garbage made since, which would then never
    # be collected; garbage alive at the first call is collected, not frozen; a thawed heap
    # (the end of a training) can be frozen again (a fresh interpreter: freezing this test
    # process would outlive the test).
    probe = "\n".join(
        [
            "import gc, weakref",
            "from fedparity.clients.process import freeze_warm_heap, thaw_heap",
            "class Cycle: pass",
            "a = Cycle(); a.me = a; dead = weakref.ref(a); del a",
            "first = freeze_warm_heap(); frozen = gc.get_freeze_count()",
            "second = freeze_warm_heap(); still = gc.get_freeze_count() == frozen",
            "thaw_heap(); thawed = gc.get_freeze_count() == 0; again = freeze_warm_heap()",
            "print(first, second, frozen > 1000, still, dead() is None, thawed, again)",
        ]
    )
    assert last_line_printed(probe).split() == ["True", "False"] + ["True"] * 5


@pytest.mark.usefixtures("task_identity")
def test_a_node_checks_sigma_once_per_run_and_a_round_loads_no_opacus(tmp_path: Path) -> None:
    # A deployed SuperNode hands every message to a new process with the node's run state:
    # the run's sigma is agreed at setup (the node recomputes its epsilon with its own
    # accountant there, once) and pinned in the run state, so a round neither calibrates nor
    # loads Opacus.
    import pickle

    from fedparity.clients.fpfl_handlers import FPFL_STATE_KEY, FPFLRunState
    from fedparity.clients.policy import NodePrivacyPolicy
    from tests.support.fpfl_nodes import (
        POPULATION,
        PRIVATE_TRAINING,
        MaskingNodes,
        roster_identities,
    )

    nodes = MaskingNodes(
        [3, 4, 5],
        PRIVATE_TRAINING,
        policy=NodePrivacyPolicy(),
        identities=roster_identities([3, 4, 5]),
    )
    nodes.setup()
    nodes.pin()
    nodes.round(1)
    state = FPFLRunState.from_record(nodes.contexts[3].state.config_records[FPFL_STATE_KEY])
    assert state.parameters.noise_multiplier == PRIVATE_TRAINING.noise_multiplier(POPULATION)
    # Round 2 in a fresh interpreter, with node 4's run state and its message: no Opacus.
    context, message = nodes.contexts[4], nodes.round_message(2)
    payload = tmp_path / "round4.pickle"
    payload.write_bytes(pickle.dumps((context, message)))
    probe = "\n".join(
        [
            "import pickle, sys",
            "from flwr.app import Message",
            "from flwr.supercore.task_identity import TaskIdentity",
            "TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0",
            "from fedparity.clients import fpfl_handlers",
            "from fedparity.clients.policy import NodePrivacyPolicy",
            "from tests.support.fpfl_nodes import PRIVATE_TRAINING, make_model, node_users",
            f"context, content = pickle.loads(open({str(payload)!r}, 'rb').read())",
            "message = Message(content, dst_node_id=4, message_type='query.fpfl_round')",
            "handlers = fpfl_handlers(make_model, node_users, PRIVATE_TRAINING,"
            " policy=NodePrivacyPolicy())",
            "reply = handlers['fpfl_round'](message, context)",
            "assert not reply.has_error() and 'masked' in reply.content.array_records['fpfl']",
            "print('opacus' in sys.modules)",
        ]
    )
    assert last_line_printed(probe) == "False"
