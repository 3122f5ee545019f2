"""Operator texts that name the true cause (issue 32, item 8; the fault trial of 2026-11-26).

Before: an audit where every user refused (their budget spent) said only "no estimate ... got
0" and the refusal count was in results.json alone; the nodes' ledger totals were "not
reported" with the blame on min-users-for-counts when no reply had been accepted at all.

Driven through the real LDP audit handler (a node's real ledger, its real policy) and the
server's real aggregation; the console lines are the job's own functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict

from fedparity.clients.ldp import LocalUsers, ldp_audit_handler
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.server.ldp_job import log_audit_outcome, missing_contributions
from fedparity.server.report import ledger_totals_text, no_totals_reason
from fedparity.strategies.ldp_audit import AuditOutcome, LdpGapAudit
from tests.test_ledger_registry import node_log

pytestmark = pytest.mark.usefixtures("task_identity")

MECHANISM = RandomizedResponseMechanism(1.0, 1.0)
USERS = 20


def _audit_three_nodes(
    tmp_path: Path, budgets: dict[int, float], num_users: int = USERS
) -> AuditOutcome:
    """One audit of nodes 3, 4 (and 5, which never answers), each node with ``num_users``
    users, ``budgets[node]`` as their budget and its own ledger folder."""
    rng = np.random.default_rng(4)
    users = LocalUsers(rng.integers(0, 2, size=num_users), rng.uniform(size=num_users))
    audit = LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon)
    messages = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [3, 4, 5])
    replies = []
    for message in messages[:2]:
        node = message.metadata.dst_node_id
        policy = NodePrivacyPolicy(user_epsilon_budget=budgets[node])
        handler = ldp_audit_handler(lambda *_: users, num_groups=2, policy=policy)
        context = Context(
            run_id=1,
            node_id=node,
            node_config={"ledger-dir": str(tmp_path / f"node-{node}")},
            state=RecordDict(),
            run_config={},
        )
        reply = handler(message, context)
        reply.metadata.__dict__["_src_node_id"] = node
        replies.append(reply)
    return audit.aggregate_audit([3, 4, 5], replies)


def test_an_audit_every_user_refused_says_their_budget_is_spent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    budget = MECHANISM.epsilon / 2  # less than one audit costs
    outcome = _audit_three_nodes(tmp_path, {3: budget, 4: budget})
    assert outcome.estimate is None and outcome.refused_users == 2 * USERS
    with node_log(caplog):
        log_audit_outcome(outcome, 0.95)
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][:1]
    assert "no estimate" in line
    assert f"{2 * USERS} user(s) refused: their privacy budget is spent" in line
    assert "1 node(s) did not reply" in line


def test_an_audit_with_an_estimate_names_who_did_not_contribute(tmp_path: Path) -> None:
    # (node 3's 4000 reports give the estimate; node 4's users cannot afford the audit)
    outcome = _audit_three_nodes(tmp_path, {3: 10.0, 4: MECHANISM.epsilon / 2}, 4000)
    assert outcome.estimate is not None
    assert missing_contributions(outcome) == (
        "4000 user(s) refused: their privacy budget is spent (each node's "
        "user-epsilon-budget); 1 node(s) did not reply"
    )


def test_totals_missing_because_no_reply_was_accepted_say_so() -> None:
    reason = no_totals_reason([0, 0])
    assert reason is not None and "no node's reply was accepted" in reason
    text = ledger_totals_text(None, why_missing=reason)
    assert "min-users-for-counts" not in text and "no node's reply was accepted" in text
    assert no_totals_reason([0, 2]) is None
    assert "min-users-for-counts" in ledger_totals_text(None, why_missing=no_totals_reason([2]))
