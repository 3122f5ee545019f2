"""What the server can time or stop in an FPFL training (issue 48; security review
2026-11-28, H1 and L1), against the real node handlers:

* the reply time of a one-user device does not say whether its user was in the round's
  Poisson cohort (the fixed workload of :func:`fedparity.clients.fpfl_node.node_workload`);
* the padded workload sums exactly the cohort;
* a training the server stops is charged for the rounds it sent (blocks that double), not for
  all ``T``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Context
from torch import nn

import tests.support.fpfl_nodes as fpfl_nodes
from fedparity.clients import FPFLNodeSettings, FPFLShard, fpfl_node
from fedparity.clients.fpfl_handlers import FPFL_STATE_KEY, FPFLRunState
from fedparity.clients.fpfl_node import cohort_sum, node_workload
from fedparity.clients.fpfl_task import build_model_for, shard_contribution
from fedparity.clients.ledger import default_ledger_path
from fedparity.clients.messages import session_state_key
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users
from fedparity.mechanisms.fpfl.cohort_workload import CohortWorkload
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from tests.support.fpfl_nodes import MaskingNodes

pytestmark = pytest.mark.usefixtures("task_identity")

#: The device under attack and its one user's rows.
DEVICE, DEVICE_ROWS = 1, 20
#: A policy under which a long training at q = 1/2 fits each user's budget (the test is about
#: time, not budgets); masking without a roster (the sybil question is another test's).
TIMING_POLICY = NodePrivacyPolicy(user_epsilon_budget=1000.0, require_roster=False)
#: q = 500 / 1000 = 1/2: half of the rounds sample the device's user.
TIMING_TRAINING = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=500,
    rounds=1000,
    clipping_bound=1.0,
    epsilon=8.0,
    delta=1e-6,
    dropout_tolerance=0.0,
)


handlers_module = importlib.import_module("fedparity.clients.fpfl_handlers")
ORIGINAL_DRAW = fpfl_node._draw_cohort
TWENTY_USERS = fpfl_nodes.node_users


def wide_model() -> nn.Module:
    """A model whose per-user statistics take measurable time (a hidden layer of 64)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 1), nn.Sigmoid())


def users_of(context: Context | None = None) -> FPFLShard:
    """Node DEVICE holds one user with DEVICE_ROWS rows; the others 20 users of 2 rows."""
    if context is not None and int(context.node_id) == DEVICE:
        rng = np.random.default_rng(4)
        return FPFLShard(
            features=rng.normal(size=(DEVICE_ROWS, 2)).astype(np.float32),
            labels=rng.integers(0, 2, size=DEVICE_ROWS).astype(np.int64),
            groups=(np.arange(DEVICE_ROWS) % 2).astype(np.int64),
            user_index=np.zeros(DEVICE_ROWS, dtype=np.int64),
            user_ids=np.array([7], dtype=np.int64),
            num_groups=2,
            num_classes=2,
        )
    return TWENTY_USERS()


def time_rounds(
    monkeypatch: pytest.MonkeyPatch, rounds: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``rounds`` rounds of a private training to the device through the real handlers;
    for each: the handler's wall time, its CPU time, and whether the device's user was
    sampled (read from the node's own cohort draw)."""
    monkeypatch.setattr(fpfl_nodes, "make_model", wide_model)
    monkeypatch.setattr(fpfl_nodes, "node_users", users_of)
    sampled: list[bool] = []
    draw = ORIGINAL_DRAW

    def recorded(num_users: int, sample_rate: float, rng: np.random.Generator) -> np.ndarray:
        cohort = draw(num_users, sample_rate, rng)
        if num_users == 1:
            sampled.append(bool(cohort[0]))
        return cohort

    monkeypatch.setattr(fpfl_node, "_draw_cohort", recorded)
    nodes = MaskingNodes([DEVICE, 2, 3], TIMING_TRAINING, policy=TIMING_POLICY)
    nodes.setup()
    nodes.pin()
    wall, cpu = [], []
    for round_number in range(1, rounds + 1):
        message = nodes.round_message(round_number)
        started, started_cpu = time.perf_counter(), time.process_time()
        nodes.send("fpfl_round", DEVICE, message)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    assert len(sampled) == rounds
    return np.array(wall), np.array(cpu), np.array(sampled)


def threshold_classifier_accuracy(
    features: list[np.ndarray], labels: np.ndarray, train: slice, test: slice
) -> float:
    """The server's attack: the best single threshold on one timing feature (either
    direction), fitted on the ``train`` rounds; its accuracy on the held-out ``test`` rounds."""
    best: tuple[float, Callable[[np.ndarray], np.ndarray]] = (-1.0, lambda x: x > 0)
    for feature in features:
        for threshold in np.unique(feature[train]):
            for sign in (1.0, -1.0):

                def predict(x: np.ndarray, t: float = threshold, s: float = sign) -> np.ndarray:
                    return s * (x - t) > 0

                accuracy = float(np.mean(predict(feature[train]) == labels[train]))
                if accuracy > best[0]:
                    best = (accuracy, lambda rows, p=predict, f=feature: p(f[rows]))
    return float(np.mean(best[1](np.arange(labels.size)[test]) == labels[test]))


@pytest.mark.slow
def test_the_reply_time_does_not_tell_whether_a_one_user_device_was_sampled(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Review H1 (2026-11-28): a threshold on the device's round time, fitted on 30 rounds,
    told the held-out rounds in which its user was sampled. With the fixed workload the same
    attack (fitted on 200 rounds) on 400 held-out rounds is within 4 standard errors of
    chance, ``0.5 +- 4 * 0.5 / sqrt(400) = 0.5 +- 0.1``; without it (the workload dropped from
    the round, as before) the same attack is right in at least 90 % of them."""
    warm, fit, held_out = 10, 200, 400
    total = warm + fit + held_out
    # One intra-op thread: torch's pool of two waits for a descheduled thread on a loaded
    # machine (tens of ms per call), noise that would only hide the channel the test looks for.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    train, test = slice(warm, warm + fit), slice(warm + fit, total)

    wall, cpu, sampled = time_rounds(monkeypatch, total)
    assert 0.4 < sampled[test].mean() < 0.6  # both classes are there to be told apart
    accuracy = threshold_classifier_accuracy([wall, cpu], sampled, train, test)
    assert abs(accuracy - 0.5) <= 4 * 0.5 / np.sqrt(held_out), accuracy

    # The same attack without the defence: the round computes the cohort alone.
    original = handlers_module.round_contribution

    def without_workload(*args: object, workload: object = None, **kwargs: object) -> object:
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers_module, "round_contribution", without_workload)
    wall, cpu, sampled = time_rounds(monkeypatch, total)
    assert threshold_classifier_accuracy([wall, cpu], sampled, train, test) >= 0.9


def test_the_padded_workload_sums_exactly_the_cohort() -> None:
    """The fixed workload (dummy rows of weight 0 in an extra slot) gives the cohort's clipped
    sum, for a small, an empty and an oversized cohort (one larger than the workload)."""
    shard = synthetic_fpfl_users(60, seed=3)
    model = build_model_for("shallow", shard.features.shape[1:], num_classes=2, seed=0)
    workload = node_workload(shard, 0.2, 50, user_epsilon_budget=10.0, user_delta=1e-6)
    assert workload.user_slots < shard.num_users
    small = CohortWorkload(user_slots=2, sample_slots=3, tail_probability=0.1)
    for rate, fixed in ((0.2, workload), (1e-9, workload), (0.9, small)):
        seed = 11
        total = cohort_sum(
            model,
            shard,
            constraint="fnr",
            clipping_bound=0.5,
            sample_rate=rate,
            rng=np.random.default_rng(seed),
            workload=fixed,
        )
        cohort = np.flatnonzero(np.random.default_rng(seed).random(shard.num_users) < rate)
        expected = (
            shard_contribution(
                model, shard, constraint="fnr", clipping_bound=0.5, users=cohort
            ).total
            if cohort.size
            else np.zeros_like(total)
        )
        # float32 model: rows batched with others round differently in the last bits
        np.testing.assert_allclose(total, expected, rtol=1e-6, atol=1e-7)


def _ledger_steps(nodes: MaskingNodes, node: int) -> list[int]:
    path = default_ledger_path(nodes.contexts[node])
    assert path is not None
    return [release.steps for release in UserLedger.load(path).releases]  # type: ignore[attr-defined]


def test_a_stopped_training_is_charged_for_the_rounds_it_sent_not_all_of_them() -> None:
    """Review L1 (2026-11-28): one node that withholds its unmask makes every round release
    nothing; the server stops the training after two lost rounds (``fpfl-max-consecutive-lost``)
    and starts another. Before, every honest user was charged the whole training (``T = 100``
    rounds) at the first round, so each such run cost a full training. Now a node charges
    blocks of rounds that double, each before its first round is released: two rounds sent,
    two rounds charged, and a third round opens a block of four."""
    settings = FPFLNodeSettings(
        constraint="fnr",
        cohort_size=10,
        rounds=100,
        clipping_bound=1.0,
        epsilon=2.0,
        delta=1e-6,
        dropout_tolerance=0.0,
    )
    policy = NodePrivacyPolicy(require_roster=False)
    for run in range(2):
        nodes = MaskingNodes([1, 2, 3], settings, policy=policy)
        nodes.setup()
        nodes.pin()
        for round_number in (1, 2):  # node 3 never unmasks: nothing is released
            nodes.round(round_number)
        assert _ledger_steps(nodes, 1) == [2], run
        state = FPFLRunState.from_record(
            nodes.contexts[1].state.config_records[session_state_key(FPFL_STATE_KEY, "")]
        )
        assert (state.answered, state.charged_rounds) == (2, 2)
        nodes.round(3)
        assert _ledger_steps(nodes, 1) == [4]
