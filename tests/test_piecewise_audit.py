"""The LDP gap audit with M_P ("P"): the typed request, the node's handler (which rebuilds the
mechanism from the request and charges its realised epsilon), the server's reply checks and
its estimate, driven through the real handlers of three nodes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedparity.clients.ldp import LocalUsers, ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.mechanisms import PiecewiseMechanism, mechanism_for_budget
from fedparity.mechanisms.privacy.user_ledger import GapReportRelease
from fedparity.mechanisms.protocol import MessageError
from fedparity.mechanisms.protocol.ldp_audit import CONFIG_KEY, LdpAuditRequest
from fedparity.strategies.ldp_audit import LdpGapAudit


def test_the_request_names_p_and_round_trips() -> None:
    audit = LdpGapAudit.for_budget("P", 4.0, num_groups=2)
    assert isinstance(audit.mechanism, PiecewiseMechanism)
    request = audit.request()
    assert request.mechanism == "P"
    assert LdpAuditRequest.from_fields(request.to_fields()) == request
    with pytest.raises(MessageError, match="must be one of R, L, P, N"):
        LdpAuditRequest.from_fields({**request.to_fields(), "mechanism": "Q"})


def test_the_ledger_charges_the_realised_epsilon() -> None:
    mechanism = mechanism_for_budget("P", 3.0, 2)
    release = GapReportRelease.from_mechanism(mechanism, job="ldp_audit")
    assert release.gap_mechanism == "P"
    assert release.epsilon == mechanism.epsilon <= 3.0


def test_an_audit_refuses_an_unreleasable_value_budget() -> None:
    mechanism = PiecewiseMechanism(0.5, 13.0)
    with pytest.raises(ValueError, match="for M_P to release"):
        LdpGapAudit(mechanism, budget=mechanism.epsilon)


def node_users(node: int, users: int = 3000) -> LocalUsers:
    """A node's users: group 1's accuracy is lower (a real gap of about 0.15)."""
    rng = np.random.default_rng(500 + node)
    groups = rng.integers(0, 2, size=users)
    metrics = np.where(groups == 0, rng.beta(8.0, 2.0, users), rng.beta(5.0, 3.0, users))
    return LocalUsers(groups, metrics)


@pytest.mark.usefixtures("task_identity")
def test_an_audit_with_m_p_through_the_real_handlers_of_three_nodes(tmp_path: Path) -> None:
    nodes = (1, 2, 3)
    users = {node: node_users(node) for node in nodes}
    audit = LdpGapAudit.for_budget("P", 6.0, num_groups=2, audit_id="pm")
    mechanism = audit.mechanism
    assert mechanism.name == "P" and mechanism.epsilon <= 6.0
    messages = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), nodes)
    replies = []
    for node, message in zip(nodes, messages, strict=True):
        handler = ldp_audit_handler(lambda *_, node=node: users[node], num_groups=2)
        context = Context(
            run_id=1,
            node_id=node,
            node_config={"ledger-dir": str(tmp_path / f"node-{node}")},
            state=RecordDict(),
            run_config={},
        )
        reply = handler(message, context)
        metrics = reply.content.metric_records["metrics"]
        # the node rebuilt M_P from the request and charged its realised epsilon
        assert metrics["epsilon-charged"] == pytest.approx(mechanism.epsilon, rel=1e-15)
        values = reply.content.array_records["reports"]["values"].numpy()
        assert values.dtype == np.float64 and mechanism.is_valid_report_value(values).all()
        replies.append(reply)
    outcome = audit.aggregate_audit(list(nodes), replies)
    assert outcome.accepted_nodes == 3 and not outcome.rejected
    estimate = outcome.estimate
    assert estimate is not None and estimate.mechanism == "P"
    groups = np.concatenate([users[node].groups for node in nodes])
    metrics = np.concatenate([users[node].metrics for node in nodes])
    truth = metrics[groups == 0].mean() - metrics[groups == 1].mean()
    # the estimate lies within 5 of its standard errors of the users' true gap (false
    # failure 6e-7)
    assert abs(estimate.differences[0] - truth) <= 5 * estimate.difference_stderrs[0]


@pytest.mark.usefixtures("task_identity")
def test_the_server_rejects_values_off_m_ps_grid(tmp_path: Path) -> None:
    audit = LdpGapAudit.for_budget("P", 4.0, num_groups=2)
    message = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [5])[0]
    handler = ldp_audit_handler(lambda *_: node_users(5, 50), num_groups=2)
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"ledger-dir": str(tmp_path)},
        state=RecordDict(),
        run_config={},
    )
    reply = handler(message, context)
    reports = reply.content.array_records["reports"]
    values = reports["values"].numpy().copy()
    values[0] += audit.mechanism.grid.step  # the other parity: no grid point
    reports["values"] = Array(values)
    outcome = audit.aggregate_audit([5], [reply])
    assert outcome.accepted_nodes == 0
    assert "output domain" in outcome.rejected[0].reason


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("mechanism", ["L", "P"])
def test_a_node_refuses_an_unreleasable_value_budget_before_reading_data_or_charging(
    mechanism: str, tmp_path: Path
) -> None:
    """A request (from a server that skips its own check) with eps2 outside the grid sampler's
    range: the node refuses it with a fixed sentence before its users' function runs, and its
    ledger is never written (no user is charged for reports that are never sent)."""
    request = LdpAuditRequest(
        mechanism=mechanism,  # type: ignore[arg-type]
        epsilon_group=0.5,
        epsilon_value=13.0,
        num_groups=2,
        budget=20.0,
        metric="accuracy",
    )
    message = Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.zeros(1))}),
                CONFIG_KEY: ConfigRecord(dict(request.to_fields())),
            }
        ),
        dst_node_id=4,
        message_type="query.ldp_audit",
    )
    read = []

    def users(*_: object) -> LocalUsers:
        read.append(True)
        return node_users(4, 20)

    handler = ldp_audit_handler(users, num_groups=2)
    context = Context(
        run_id=1,
        node_id=4,
        node_config={
            "ledger-dir": str(tmp_path),
            "ldp-max-epsilon": 50.0,
            "user-epsilon-budget": 100.0,  # the users could afford it
        },
        state=RecordDict(),
        run_config={},
    )
    with pytest.raises(
        NodeRefusal, match="outside the range in which its sampler releases reports"
    ):
        handler(message, context)
    assert not read and not any(tmp_path.iterdir())
