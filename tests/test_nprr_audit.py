"""The LDP gap audit with M_N ("N", NPRR on the value): the typed request and its grid, the
node's handler (which rebuilds the mechanism from the request and charges its realised
epsilon), the server's reply checks and its estimate, driven through the real handlers of
three nodes; hostile requests refused before any data is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedparity.clients.ldp import UNRESOLVABLE_REFUSAL, LocalUsers, ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import PolicyRefusal
from fedparity.mechanisms import NPRRMechanism, mechanism_for_budget
from fedparity.mechanisms.privacy.user_ledger import (
    GapReportRelease,
    NPRRGapReportRelease,
    release_from_dict,
)
from fedparity.mechanisms.protocol import MessageError
from fedparity.mechanisms.protocol.ldp_audit import CONFIG_KEY, LdpAuditRequest
from fedparity.strategies.ldp_audit import LdpGapAudit


def test_the_request_names_n_and_its_grid_and_round_trips() -> None:
    audit = LdpGapAudit.for_budget("N", 6.0, num_groups=2)
    assert isinstance(audit.mechanism, NPRRMechanism) and audit.mechanism.grid_size > 1
    request = audit.request()
    assert request.mechanism == "N" and request.grid_size == audit.mechanism.grid_size
    fields = request.to_fields()
    assert fields["grid-size"] == audit.mechanism.grid_size
    assert LdpAuditRequest.from_fields(fields) == request
    with pytest.raises(MessageError, match="must be one of R, L, P, N"):
        LdpAuditRequest.from_fields({**fields, "mechanism": "Q"})
    for bad in (0, 1024, 2.5, "4", True):
        with pytest.raises(MessageError, match="grid-size"):
            LdpAuditRequest.from_fields({**fields, "grid-size": bad})
    without = dict(fields)
    del without["grid-size"]
    with pytest.raises(MessageError, match="'grid-size' is missing"):
        LdpAuditRequest.from_fields(without)


def test_the_other_mechanisms_send_no_grid_and_refuse_one() -> None:
    fields = LdpGapAudit.for_budget("R", 1.0, num_groups=2).request().to_fields()
    assert "grid-size" not in fields  # the wire of M_R, M_L and M_P is unchanged
    with pytest.raises(MessageError, match="'grid-size' applies only to mechanism N"):
        LdpAuditRequest.from_fields({**fields, "grid-size": 1})


def test_the_ledger_charges_the_realised_epsilon_of_the_grid_sent() -> None:
    mechanism = mechanism_for_budget("N", 3.0, 2)
    assert isinstance(mechanism, NPRRMechanism)
    release = GapReportRelease.from_mechanism(mechanism, job="ldp_audit")
    assert isinstance(release, NPRRGapReportRelease)
    assert release.gap_mechanism == "N" and release.grid_size == mechanism.grid_size
    assert release.epsilon == mechanism.epsilon <= 3.0
    # the ledger file keeps the grid: read back, the same release and epsilon
    again = release_from_dict(release.to_dict())
    assert again == release and again.epsilon == release.epsilon
    # a grid changes the epsilon: an M_N release without its grid is refused, not read as G = 1
    with pytest.raises(ValueError, match="gap_mechanism must be one of 'R', 'L', 'P'; got 'N'"):
        GapReportRelease(gap_mechanism="N", epsilon_group=1.0, epsilon_value=2.0, job="ldp_audit")
    finer = NPRRMechanism(mechanism.epsilon_group, mechanism.epsilon_value, 2, 64)
    assert finer.epsilon != mechanism.epsilon


def node_users(node: int, users: int = 3000) -> LocalUsers:
    """A node's users: group 1's accuracy is lower (a real gap of about 0.15)."""
    rng = np.random.default_rng(700 + node)
    groups = rng.integers(0, 2, size=users)
    metrics = np.where(groups == 0, rng.beta(8.0, 2.0, users), rng.beta(5.0, 3.0, users))
    return LocalUsers(groups, metrics)


def node_context(node: int, ledger_dir: Path, **config: float) -> Context:
    return Context(
        run_id=1,
        node_id=node,
        node_config={"ledger-dir": str(ledger_dir), **config},
        state=RecordDict(),
        run_config={},
    )


@pytest.mark.usefixtures("task_identity")
def test_an_audit_with_m_n_through_the_real_handlers_of_three_nodes(tmp_path: Path) -> None:
    nodes = (1, 2, 3)
    users = {node: node_users(node) for node in nodes}
    audit = LdpGapAudit.for_budget("N", 6.0, num_groups=2, audit_id="nprr")
    mechanism = audit.mechanism
    assert isinstance(mechanism, NPRRMechanism) and mechanism.epsilon <= 6.0
    messages = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), nodes)
    replies = []
    for node, message in zip(nodes, messages, strict=True):
        handler = ldp_audit_handler(lambda *_, node=node: users[node], num_groups=2)
        reply = handler(message, node_context(node, tmp_path / f"node-{node}"))
        metrics = reply.content.metric_records["metrics"]
        # the node rebuilt M_N (with the grid sent) and charged its realised epsilon
        assert metrics["epsilon-charged"] == pytest.approx(mechanism.epsilon, rel=1e-15)
        values = reply.content.array_records["reports"]["values"].numpy()
        assert values.dtype == np.float64 and mechanism.is_valid_report_value(values).all()
        # every grid point is used: the reports are NPRR's, not M_R's two values
        assert np.unique(values).size == mechanism.grid_size + 1
        replies.append(reply)
    outcome = audit.aggregate_audit(list(nodes), replies)
    assert outcome.accepted_nodes == 3 and not outcome.rejected
    estimate = outcome.estimate
    assert estimate is not None and estimate.mechanism == "N"
    groups = np.concatenate([users[node].groups for node in nodes])
    metrics = np.concatenate([users[node].metrics for node in nodes])
    truth = metrics[groups == 0].mean() - metrics[groups == 1].mean()
    # the estimate lies within 5 of its standard errors of the users' true gap (false
    # failure 6e-7)
    assert abs(estimate.differences[0] - truth) <= 5 * estimate.difference_stderrs[0]


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    "change",
    [
        lambda values, step: values[0] + step / 2,  # between two grid points
        lambda values, step: values[0] + step * 1e-9,  # next to a grid point
        lambda values, step: 1.0 + step,  # beyond the grid
        lambda values, step: np.nan,
    ],
    ids=["between-points", "near-a-point", "out-of-domain", "nan"],
)
def test_the_server_rejects_values_nprr_cannot_output(change, tmp_path: Path) -> None:
    audit = LdpGapAudit.for_budget("N", 6.0, num_groups=2)
    message = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [5])[0]
    handler = ldp_audit_handler(lambda *_: node_users(5, 50), num_groups=2)
    reply = handler(message, node_context(5, tmp_path))
    reports = reply.content.array_records["reports"]
    values = reports["values"].numpy().copy()
    values[0] = change(values, 2.0 / audit.mechanism.grid_size)
    reports["values"] = Array(values)
    outcome = audit.aggregate_audit([5], [reply])
    assert outcome.accepted_nodes == 0
    assert "outside M_N's output domain (its grid points" in outcome.rejected[0].reason


def hostile_message(fields: dict[str, object]) -> Message:
    return Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.zeros(1))}),
                CONFIG_KEY: ConfigRecord(fields),  # type: ignore[arg-type]
            }
        ),
        dst_node_id=4,
        message_type="query.ldp_audit",
    )


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"grid-size": 0}, MessageError, "grid-size' must be in"),
        ({"grid-size": 10**6}, MessageError, "grid-size' must be in"),
        ({"grid-size": None}, MessageError, "grid-size"),
        ({"epsilon-value": 1e-30}, NodeRefusal, "below the resolution"),
        ({"epsilon-group": 1e-30}, NodeRefusal, "below the resolution"),
        # as for M_R: a ValueError, which reaches the server as the node's fixed sentence
        ({"epsilon-value": -1.0}, NodeRefusal, "could not handle this message"),
        ({"epsilon-value": 40.0, "budget": 80.0}, PolicyRefusal, "above ldp-max-epsilon"),
    ],
    ids=["grid-0", "grid-huge", "grid-missing", "eps2-tiny", "eps1-tiny", "eps2-negative", "big"],
)
def test_a_node_refuses_hostile_m_n_parameters_before_reading_data_or_charging(
    change: dict[str, object], error: type[Exception], match: str, tmp_path: Path
) -> None:
    """A request (from a server that skips its own checks) with a grid or budget the node
    must not run: refused before its users' function runs, and its ledger is never written."""
    request = LdpAuditRequest(
        mechanism="N",
        epsilon_group=0.5,
        epsilon_value=2.0,
        num_groups=2,
        budget=20.0,
        metric="accuracy",
        grid_size=4,
    )
    fields: dict[str, object] = {**request.to_fields(), **change}
    if fields["grid-size"] is None:
        del fields["grid-size"]
    read = []

    def users(*_: object) -> LocalUsers:
        read.append(True)
        return node_users(4, 20)

    handler = ldp_audit_handler(users, num_groups=2)
    context = node_context(4, tmp_path, **{"ldp-max-epsilon": 10.0, "user-epsilon-budget": 100.0})
    with pytest.raises(error, match=match) as raised:
        handler(hostile_message(fields), context)
    if match == "below the resolution":
        assert str(raised.value) == UNRESOLVABLE_REFUSAL  # a fixed sentence
    assert not read and not any(tmp_path.iterdir())
