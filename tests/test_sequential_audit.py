"""The sequential LDP audit over nodes: the batch spread that keeps the confidence sequences
valid for the population however different the nodes are, the node that asks a user at most
once per audit whatever the server sends, and the strategy over real handlers (an in-process
grid): early stops, what each node's ledger was charged, a batch lost mid-audit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedparity.clients import LocalUsers, ldp_audit_handler
from fedparity.clients.ldp import ASKED_STATE_PREFIX, SEQUENTIAL_TOO_FEW_USERS
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms import build_mechanism
from fedparity.mechanisms.ldp.nprr import nprr_for_budget
from fedparity.mechanisms.ldp.sequential import (
    STOP_REASONS,
    SequentialGapAudit,
    allocate_batch,
)
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.mechanisms.protocol import AUDIT_MESSAGE_TYPE, MessageError
from fedparity.mechanisms.protocol.ldp_audit import CONFIG_KEY, LdpAuditRequest
from fedparity.strategies import SequentialLdpAudit
from tests.support.handler_grid import HandlerGrid

pytestmark = pytest.mark.usefixtures("task_identity")


def binomial_tolerance(level: float, runs: int, sds: float = 3.3) -> float:
    """``sds`` binomial standard deviations of a rate ``level`` over ``runs`` runs (3.3: a
    one-sided false alarm of 5e-4 under the normal approximation)."""
    return sds * math.sqrt(level * (1 - level) / runs)


# --- the batch spread: valid for the population, not for another mixture -------------------------

#: Two nodes of 80% and 20% of the users; equal group shares; group 0's metric is 0.8 at the
#: big node and 0.0 at the small one, group 1's 0.8 at both. The population's group means are
#: 0.64 and 0.8 (gap 0.16); an equal number of users per node would see 0.4 and 0.8 (gap 0.4).
NODE_SIZES = np.array([8000, 2000])
NODE_MEANS = np.array([[0.8, 0.8], [0.0, 0.8]])
POPULATION_MEANS = (NODE_SIZES[:, None] * NODE_MEANS).sum(0) / NODE_SIZES.sum()


def missed_runs(spread, runs: int, level: float, seed: int) -> int:  # noqa: ANN001
    """Runs (12 batches of 2000) in which a group's or the gap's sequence excluded the
    population's value after some batch; ``spread(size, rng)`` gives the users per node."""
    mechanism = nprr_for_budget(2.0, 2)
    rng = np.random.default_rng(seed)
    gap = abs(POPULATION_MEANS[1] - POPULATION_MEANS[0])
    missed = 0
    for _ in range(runs):
        audit = SequentialGapAudit(mechanism, confidence=level)
        for _ in range(12):
            parts = []
            for node, n in enumerate(spread(2000, rng)):
                groups = rng.integers(0, 2, n)
                metric = (rng.random(n) < NODE_MEANS[node][groups]).astype(np.float64)
                parts.append((groups, 2 * metric - 1))
            groups = np.concatenate([g for g, _ in parts])
            values = np.concatenate([v for _, v in parts])
            batch = audit.update(mechanism.perturb(groups, values, rng))
            covered = all(
                ci.low <= m <= ci.high
                for ci, m in zip(batch.group_intervals, POPULATION_MEANS, strict=True)
            ) and (batch.interval.low <= gap <= batch.interval.high)
            if not covered:
                missed += 1
                break
    return missed


def test_the_multinomial_spread_keeps_the_sequences_valid_for_the_population() -> None:
    """Time-uniform coverage of the population's means at level 0.9 over 150 runs, within a
    binomial tolerance of 3.3 standard deviations."""
    runs, level = 150, 0.9
    missed = missed_runs(lambda size, rng: allocate_batch(size, NODE_SIZES, rng), runs, level, 5)
    assert missed / runs <= 1 - level + binomial_tolerance(1 - level, runs)


def test_an_equal_spread_over_the_nodes_misses_the_population() -> None:
    """Power of the check above: asking as many users at each node targets the equal mixture
    (gap 0.4), and its sequences exclude the population's values (gap 0.16) in most runs."""
    runs, level = 60, 0.9
    missed = missed_runs(lambda size, rng: np.array([size // 2, size // 2]), runs, level, 6)
    assert missed / runs > 0.5


def test_allocate_batch_checks_its_input() -> None:
    rng = np.random.default_rng(0)
    assert allocate_batch(10, [0, 5], rng).tolist() == [0, 10]
    for bad in ([], [0, 0], [-1, 3], [[1, 2]]):
        with pytest.raises(ValueError, match="population_sizes"):
            allocate_batch(10, bad, rng)
    with pytest.raises(ValueError, match="size"):
        allocate_batch(-1, [1], rng)


# --- the node ------------------------------------------------------------------------------------

USERS = 400


def node_handler(ledgers: Path, groups: np.ndarray, metrics: np.ndarray, policy=None):  # noqa: ANN001, ANN201
    """The real ``query.ldp_audit`` handler over users 1000 .. 1000 + n (by id)."""
    ids = 1000 + np.arange(groups.size)
    return ldp_audit_handler(
        lambda arrays, metric, context: LocalUsers(groups, metrics, user_ids=ids),
        num_groups=2,
        policy=policy or NodePrivacyPolicy(),
        ledger_path=lambda context: ledgers / f"node-{context.node_id}.json",
    )


def ask(handler, context: Context, batch: int | None, audit_id: str = "seq", mechanism=None):  # noqa: ANN001, ANN201
    mechanism = mechanism or nprr_for_budget(1.0, 2)
    request = LdpAuditRequest(
        mechanism=mechanism.name,
        epsilon_group=mechanism.epsilon_group,
        epsilon_value=mechanism.epsilon_value,
        num_groups=2,
        budget=1.0,
        metric="accuracy",
        audit_id=audit_id,
        grid_size=getattr(mechanism, "grid_size", 1),
        sequential_batch=batch,
    )
    content = RecordDict({"arrays": ArrayRecord(), CONFIG_KEY: ConfigRecord(request.to_fields())})
    message = Message(content=content, dst_node_id=context.node_id, message_type=AUDIT_MESSAGE_TYPE)
    return handler(message, context)


def charged_once(ledgers: Path, node: int) -> dict[int, int]:
    """How many releases each user of node ``node``'s ledger took part in, by id."""
    ledger = UserLedger.load(ledgers / f"node-{node}.json")
    counts = np.sum([ledger.participants(i) for i in range(len(ledger.releases))], axis=0)
    return dict(zip(ledger.user_ids.tolist(), counts.tolist(), strict=True))


def test_a_node_asks_each_user_at_most_once_per_audit_whatever_the_server_asks(
    tmp_path: Path,
) -> None:
    """The attack: a server asks the same node for batches over and over (or for more users
    than it has) to collect several reports of one user and average their noise away. The
    node draws among users it has not asked in this audit, records them before replying and
    charges each asked user once; a new audit id asks them again and is charged again."""
    rng = np.random.default_rng(1)
    handler = node_handler(tmp_path, rng.integers(0, 2, USERS), rng.random(USERS))
    context = Context(1, 1, {}, RecordDict(), {})
    sizes = ask(handler, context, 0).content.metric_records["metrics"]
    assert (sizes["num-users"], sizes["num-unasked"]) == (USERS, USERS)
    reported = [
        int(ask(handler, context, batch).content.metric_records["metrics"]["num-reports"])
        for batch in (150, 150, 150, 150)
    ]
    assert reported == [150, 150, 100, 0]
    asked = context.state.array_records[ASKED_STATE_PREFIX + "seq"]["asked"].numpy()
    assert sorted(asked.tolist()) == list(range(1000, 1000 + USERS))  # each id once
    assert set(charged_once(tmp_path, 1).values()) == {1}
    ask(handler, context, 50, audit_id="another")
    counts = charged_once(tmp_path, 1)
    assert sorted(counts.values()).count(2) == 50 and len(counts) == USERS


def test_users_a_stopped_audit_never_asked_spent_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    handler = node_handler(tmp_path, rng.integers(0, 2, USERS), rng.random(USERS))
    context = Context(1, 1, {}, RecordDict(), {})
    ask(handler, context, 0)
    ask(handler, context, 120)
    counts = charged_once(tmp_path, 1)
    assert sum(counts.values()) == 120 and set(counts.values()) == {0, 1}  # the rest: 0


def test_the_node_refuses_what_a_sequential_audit_may_not_ask(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    handler = node_handler(tmp_path, rng.integers(0, 2, 5), rng.random(5))
    context = Context(1, 1, {}, RecordDict(), {})
    # a node below its min-users-for-counts (default 10) does not tell its size
    with pytest.raises(NodeRefusal, match="min-users-for-counts"):
        ask(handler, context, 0)
    assert "min-users-for-counts" in SEQUENTIAL_TOO_FEW_USERS
    # a batch for another mechanism, or without the audit's session, is a malformed request
    with pytest.raises(MessageError, match="sequential-batch"):
        ask(handler, context, 3, mechanism=build_mechanism("R", 0.5, 0.5, 2))
    with pytest.raises(MessageError, match="sequential-batch"):
        ask(handler, context, 3, audit_id="")
    # a label longer than 128 characters (it keys the node's record of asked users)
    with pytest.raises(MessageError, match="'audit-id' must be a string of at most 128"):
        ask(handler, context, 3, audit_id="x" * 129)
    longest = LdpAuditRequest("N", 1.0, 1.0, 2, 1.0, "accuracy", audit_id="x" * 128)
    assert LdpAuditRequest.from_fields(longest.to_fields()).audit_id == "x" * 128


# --- the strategy over real handlers -------------------------------------------------------------


def federation(tmp_path: Path, means: tuple[float, float], drop=None) -> HandlerGrid:  # noqa: ANN001
    """Three nodes of 3000, 2000 and 1000 users (by id), group means ``means``."""
    rng = np.random.default_rng(4)
    handlers, contexts = {}, {}
    for node, size in zip((1, 2, 3), (3000, 2000, 1000), strict=True):
        groups = rng.integers(0, 2, size)
        metrics = (rng.random(size) < np.asarray(means)[groups]).astype(np.float64)
        handlers[node] = node_handler(tmp_path, groups, metrics)
        contexts[node] = Context(1, node, {}, RecordDict(), {})
    return HandlerGrid(lambda node, action: handlers[node], contexts, drop=drop)


def test_a_clear_gap_stops_early_and_only_the_asked_users_are_charged(tmp_path: Path) -> None:
    grid = federation(tmp_path, (0.9, 0.1))
    mechanism = nprr_for_budget(2.0, 2)
    audit = SequentialLdpAudit(
        mechanism, budget=2.0, batch_size=300, max_users=6000, target_width=0.05, seed=1
    )
    outcome = audit.start(grid, ArrayRecord())  # type: ignore[arg-type]
    assert outcome.stopped_because == STOP_REASONS[0], outcome.summary()
    result = outcome.result
    assert result is not None and result.interval.low > 0
    assert outcome.users_asked == result.users_asked < outcome.population == 6000
    assert outcome.users_by_node == {1: 3000, 2: 2000, 3: 1000}
    for node, asked in outcome.asked_by_node.items():
        counts = charged_once(tmp_path, node)
        assert sum(counts.values()) == asked and set(counts.values()) <= {0, 1}
    assert "the groups differ" in outcome.summary() and "each charged" in outcome.summary()
    assert repr(outcome).startswith("SequentialAuditOutcome(")


def test_a_tpr_audit_carries_the_undefined_category_and_finds_the_gap(tmp_path: Path) -> None:
    """metric = "tpr": users without positives (NaN) report the undefined category; the audit
    compares the two groups' mean TPR over their users with a defined TPR (0.9 and 0.1 here,
    a third of the users undefined) and stops on a clear gap, charging only the asked users."""
    rng = np.random.default_rng(8)
    handlers, contexts = {}, {}
    for node, size in zip((1, 2), (3000, 2000), strict=True):
        groups = rng.integers(0, 2, size)
        metrics = (rng.random(size) < np.array([0.9, 0.1])[groups]).astype(np.float64)
        metrics[rng.random(size) < 1 / 3] = np.nan
        handlers[node] = node_handler(tmp_path, groups, metrics)
        contexts[node] = Context(1, node, {}, RecordDict(), {})
    grid = HandlerGrid(lambda node, action: handlers[node], contexts)
    audit = SequentialLdpAudit(
        nprr_for_budget(2.0, 3),  # two groups and "undefined"
        budget=2.0,
        metric="tpr",
        batch_size=300,
        max_users=5000,
        target_width=0.05,
        seed=2,
    )
    outcome = audit.start(grid, ArrayRecord())  # type: ignore[arg-type]
    result = outcome.result
    assert result is not None and outcome.stopped_because == STOP_REASONS[0], outcome.summary()
    assert len(result.group_intervals) == 2 and result.pairs == ((0, 1),)
    assert result.interval.low <= 0.8 <= result.interval.high
    for node, asked in outcome.asked_by_node.items():
        assert sum(charged_once(tmp_path, node).values()) == asked


def test_a_batch_lost_mid_audit_stops_with_the_batch_before(tmp_path: Path) -> None:
    """Node 2's reply to the second batch is lost: that batch's reports are left out (the
    others would bias the sequence), the result is the first batch's, and the users node 2
    asked are counted as charged."""
    replies = {"count": 0}

    def drop(action: str, node: int) -> bool:
        if node == 2:
            replies["count"] += 1
            return replies["count"] == 3  # its size reply, its first batch, then lost
        return False

    grid = federation(tmp_path, (0.5, 0.5), drop=drop)
    audit = SequentialLdpAudit(
        nprr_for_budget(1.0, 2),
        budget=1.0,
        batch_size=600,
        max_users=6000,
        target_width=0.01,
        timeout=2.0,
    )
    outcome = audit.start(grid, ArrayRecord())  # type: ignore[arg-type]
    assert outcome.stopped_because == STOP_REASONS[3]
    assert outcome.result is not None and outcome.result.users_asked == 600
    assert outcome.users_asked == 1200 and outcome.missing == (2,)
    assert sum(charged_once(tmp_path, 2).values()) == outcome.asked_by_node[2]


def test_the_strategy_refuses_bad_settings() -> None:
    mechanism = nprr_for_budget(1.0, 2)
    common = {"budget": 1.0, "batch_size": 10, "max_users": 100, "target_width": 0.1}
    with pytest.raises(ValueError, match="NPRRMechanism"):
        SequentialLdpAudit(object(), **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="undefined category the mechanism needs num_groups >= 3"):
        SequentialLdpAudit(mechanism, metric="tpr", **common)
    with pytest.raises(ValueError, match="batch_size"):
        SequentialLdpAudit(mechanism, **{**common, "batch_size": 0})
    with pytest.raises(ValueError, match="audit_id must be a string of at most 128"):
        SequentialLdpAudit(mechanism, audit_id="a" * 129, **common)
    with pytest.raises(ValueError, match="target_width"):
        SequentialLdpAudit(mechanism, **{**common, "target_width": 0.0})
