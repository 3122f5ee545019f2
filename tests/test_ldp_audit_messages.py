"""The LDP audit's typed messages (mechanisms.protocol.ldp_audit): both ends use them, they
round-trip, and a malformed one is refused with an error naming its field."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.mechanisms.protocol import METRICS_KEY, REPORTS_KEY, MessageError
from fedparity.mechanisms.protocol.ldp_audit import LdpAuditReply, LdpAuditRequest
from fedparity.strategies.ldp_audit import LdpGapAudit

REQUEST = LdpAuditRequest(
    mechanism="L",
    epsilon_group=0.5,
    epsilon_value=1.25,
    num_groups=3,
    budget=2.0,
    metric="tpr",
    audit_id="audit-1",
    undefined_category=True,
)


def test_a_request_round_trips_through_a_flower_config_record() -> None:
    record = ConfigRecord(REQUEST.to_fields())  # type: ignore[arg-type]
    assert LdpAuditRequest.from_fields(record) == REQUEST


def test_the_wire_format_is_the_one_nodes_always_read() -> None:
    """The server's config record holds exactly the fields and types it sent before the
    typed messages (nodes of an earlier version read them)."""
    mechanism = RandomizedResponseMechanism(1.0, 2.0)
    audit = LdpGapAudit(mechanism, budget=mechanism.epsilon, audit_id="a")
    assert dict(audit.audit_config()) == {
        "mechanism": "R",
        "epsilon-group": 1.0,
        "epsilon-value": 2.0,
        "num-groups": 2,
        "budget": float(mechanism.epsilon),
        "metric": "accuracy",
        "audit-id": "a",
        "undefined-category": False,
    }
    assert LdpAuditRequest.from_fields(audit.audit_config()) == audit.request()


def test_optional_fields_keep_their_defaults() -> None:
    fields = REQUEST.to_fields()
    del fields["audit-id"], fields["undefined-category"]
    fields["metric"] = "accuracy"
    fields["num-groups"] = 3.0  # an integral float, as nodes always accepted
    read = LdpAuditRequest.from_fields(fields)
    assert (read.audit_id, read.undefined_category, read.num_groups) == ("", False, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num-groups", None),
        ("num-groups", 2.5),
        ("num-groups", "2"),
        ("undefined-category", 1),
        ("metric", "recall"),
        ("metric", None),
        ("mechanism", "G"),
        ("mechanism", None),
        ("epsilon-group", float("inf")),
        ("epsilon-value", None),
        ("epsilon-value", True),
        ("budget", float("nan")),
        ("budget", None),
        ("audit-id", 3),
    ],
)
def test_a_malformed_request_names_its_field_and_no_value(field: str, value: object) -> None:
    fields: dict[str, object] = dict(REQUEST.to_fields())
    if value is None:
        del fields[field]
    else:
        fields[field] = value
    with pytest.raises(MessageError, match=f"'{field}'") as raised:
        LdpAuditRequest.from_fields(fields)
    assert getattr(type(raised.value), "fixed_text", False)
    if value is not None and not isinstance(value, bool):
        assert str(value) not in str(raised.value)


def test_a_reply_round_trips_through_flower_records() -> None:
    reply = LdpAuditReply(
        np.array([0, 1, 2], dtype=np.int64),
        np.array([0.25, -0.5, 1.0]),
        {"epsilon-charged": 1.5, "num-reports": 3, "num-refused": 1},
    )
    fields = reply.to_fields()
    content = RecordDict(
        {
            REPORTS_KEY: ArrayRecord({k: Array(v) for k, v in fields[REPORTS_KEY].items()}),
            METRICS_KEY: MetricRecord(fields[METRICS_KEY]),
        }
    )
    read = LdpAuditReply.from_fields(
        content.array_records.get(REPORTS_KEY), content.metric_records.get(METRICS_KEY)
    )
    np.testing.assert_array_equal(read.groups, reply.groups)
    np.testing.assert_array_equal(read.values, reply.values)
    assert dict(read.counts) == dict(reply.counts)
    assert (read.num_reports, read.num_refused, read.num_undefined) == (3, 1, 0)


OK = {"groups": np.zeros(2, dtype=np.int64), "values": np.zeros(2)}


@pytest.mark.parametrize(
    ("reports", "counts", "named"),
    [
        (None, {}, "'reports'"),
        ({"groups": np.zeros(2, dtype=np.int64)}, {}, "'values'"),
        ({"groups": np.zeros(2), "values": np.zeros(2)}, {}, "groups"),
        ({"groups": np.zeros(2, dtype=np.int64), "values": np.zeros(3)}, {}, "values"),
        ({"groups": np.zeros(2, dtype=np.int64), "values": np.array(["a", "b"])}, {}, "values"),
        (OK, {"num-reports": 3}, "num-reports"),
        (OK, {"num-refused": -1}, "num-refused"),
        (OK, {"num-undefined": 0.5}, "num-undefined"),
    ],
)
def test_a_malformed_reply_names_its_field(
    reports: dict[str, np.ndarray] | None, counts: dict[str, float], named: str
) -> None:
    with pytest.raises(MessageError, match=named):
        LdpAuditReply.from_fields(reports, counts)
