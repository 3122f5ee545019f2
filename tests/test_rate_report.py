"""The rate report: one private (group, confusion cell) report per user, every rate metric per
group read from the same reports, each user charged once (issue 28).

The node's handler is called directly with a Flower ``Context`` (its real ledger files), the
server's checks with real ``Message`` replies, and the whole exchange runs in a Flower
simulation of three SuperNodes with their own rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import PolicyRefusal
from fedparity.clients.rates import LocalPredictions, rate_report_handler
from fedparity.mechanisms.protocol import MessageError
from fedparity.mechanisms.protocol.rate_report import (
    RateReportReply,
    RateReportRequest,
    pack_reports,
)
from fedparity.strategies.rate_report import RateReportAudit

THRESHOLD = ArrayRecord({"threshold": Array(np.array([0.5]))})


def own_rows(node: int, users: int = 400, rows_per_user: int = 1) -> tuple[np.ndarray, ...]:
    """A node's own rows: group 1's feature is noisier (a real TPR and selection-rate gap)."""
    rng = np.random.default_rng(500 + node)
    user_ids = np.repeat(np.arange(users) + 10_000 * node, rows_per_user)
    groups = np.repeat(rng.integers(0, 2, size=users), rows_per_user)
    labels = rng.integers(0, 2, size=user_ids.size)
    features = labels + rng.normal(0.0, np.where(groups == 1, 1.5, 0.4))
    return features, labels, groups, user_ids


def threshold_predictions(features, labels, groups, user_ids, calls=None):  # noqa: ANN001, ANN201
    """The user's own model: predict 1 when feature > the received threshold."""

    def local_predictions(arrays: ArrayRecord, context: Context) -> LocalPredictions:
        if calls is not None:
            calls.append(1)
        threshold = float(arrays["threshold"].numpy()[0])
        return LocalPredictions(
            groups=groups,
            labels=labels,
            predictions=(features > threshold).astype(np.int64),
            user_ids=user_ids,
        )

    return local_predictions


def node_context(tmp_path: Path, **policy: object) -> Context:
    return Context(
        run_id=1,
        node_id=3,
        node_config={"ledger-dir": str(tmp_path), **policy},
        state=RecordDict(),
        run_config={},
    )


def request_message(audit: RateReportAudit, fields: dict | None = None) -> Message:
    message = audit.configure_report(THRESHOLD, [3])[0]
    if fields:
        message.content.config_records["config"].update(fields)
    return message


# --- the node -------------------------------------------------------------------------------


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("oracle", ["grr", "oue", "ss"])
def test_a_node_sends_one_report_per_user_and_charges_each_user_once(
    tmp_path: Path, oracle: str
) -> None:
    rows = own_rows(0, users=60, rows_per_user=3)
    handler = rate_report_handler(threshold_predictions(*rows), num_groups=2)
    audit = RateReportAudit.for_budget(1.0, num_groups=2, oracle=oracle)
    context = node_context(tmp_path, **{"user-epsilon-budget": 2.5})
    expected = [60, 60, 0]  # 1 + 1 <= 2.5 < 1 + 1 + 1: the third report is refused
    for want in expected:
        reply = handler(request_message(audit), context)
        metrics = reply.content.metric_records["metrics"]
        assert metrics["num-reports"] == want and metrics["num-refused"] == 60 - want
        assert metrics["epsilon-charged"] == pytest.approx(audit.oracle.epsilon)
        reports = reply.content.array_records["reports"]
        assert list(reports.keys()) == ["categories"]  # nothing else leaves the node
        typed = RateReportReply.from_fields(reports, metrics)
        support = typed.support_counts(audit.oracle)  # only what the sampler can produce
        assert typed.num_reports == want and support.shape == (8,)
    ledger = json.loads((tmp_path / "user-ledger.json").read_text())
    releases = ledger["releases"]
    assert [item["kind"] for item in releases] == ["ldp-frequency-report"] * 2
    assert metrics["epsilon-spent-max"] == pytest.approx(2 * audit.oracle.epsilon, rel=0.02)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        # the server asks for more than the node's own policy allows (ldp-max-epsilon 8)
        ({"epsilon": 9.0, "budget": 9.0}, PolicyRefusal, "ldp-max-epsilon"),
        # a budget below the oracle's true epsilon
        ({"budget": 0.5}, NodeRefusal, "exceeds the report's budget"),
        # another number of groups than the node's
        ({"num-groups": 3}, NodeRefusal, "number of groups"),
        # subset selection with an impossible omega
        ({"oracle": "ss", "subset-size": 8}, MessageError, "do not define a frequency oracle"),
        ({"oracle": "rappor"}, MessageError, "'oracle' must be one of"),
    ],
)
def test_a_hostile_request_is_refused_before_the_data_is_read(
    tmp_path: Path, fields: dict, error: type[Exception], match: str
) -> None:
    calls: list[int] = []
    handler = rate_report_handler(threshold_predictions(*own_rows(0, 20), calls), num_groups=2)
    audit = RateReportAudit.for_budget(1.0, num_groups=2, oracle="grr")
    with pytest.raises(error, match=match):
        handler(request_message(audit, fields), node_context(tmp_path))
    assert calls == []  # the user's function never ran
    assert not (tmp_path / "user-ledger.json").exists()  # nothing charged


@pytest.mark.usefixtures("task_identity")
def test_the_servers_audit_id_is_not_written_into_the_nodes_ledger(tmp_path: Path) -> None:
    """The request's audit-id is free text chosen by the server: a node writing it into every
    ledger release would let a server grow the node's files at will (100,000 characters here)."""
    handler = rate_report_handler(threshold_predictions(*own_rows(0, 20)), num_groups=2)
    audit = RateReportAudit.for_budget(1.0, num_groups=2, oracle="grr")
    handler(request_message(audit, {"audit-id": "x" * 100_000}), node_context(tmp_path))
    ledger = (tmp_path / "user-ledger.json").read_text()
    assert "x" * 100 not in ledger
    assert [item["label"] for item in json.loads(ledger)["releases"]] == ["rate report"]


@pytest.mark.usefixtures("task_identity")
def test_grr_ignores_a_server_chosen_subset_size(tmp_path: Path) -> None:
    """GRR's omega is 1 whatever the message says: a server cannot make the node's oracle
    anything but the one its epsilon was checked for."""
    audit = RateReportAudit.for_budget(1.0, num_groups=2, oracle="grr")
    request = RateReportRequest.from_fields({**audit.request().to_fields(), "subset-size": 7})
    assert request.build_oracle() == audit.oracle


@pytest.mark.usefixtures("task_identity")
def test_whether_a_user_answers_does_not_depend_on_the_labels(tmp_path: Path) -> None:
    """A one-user device with no positive label (TPR undefined for it) answers exactly like
    one with positives: one report, same counts (an LDP audit of TPR without the undefined
    category would have to refuse one of them)."""
    audit = RateReportAudit.for_budget(2.0, num_groups=2, oracle="grr")
    shapes = []
    for index, labels in enumerate(([0, 0, 0], [1, 0, 1])):
        handler = rate_report_handler(
            lambda arrays, context, labels=labels: LocalPredictions(
                groups=[1, 1, 1], labels=labels, predictions=[1, 0, 0]
            ),
            num_groups=2,
        )
        reply = handler(request_message(audit), node_context(tmp_path / str(index)))
        metrics = dict(reply.content.metric_records["metrics"])
        reports = reply.content.array_records["reports"]["categories"].numpy()
        shapes.append((sorted(metrics), reports.shape, reports.dtype))
    assert shapes[0] == shapes[1]
    assert shapes[0][1] == (1,)


def test_one_row_per_user_is_uniform_among_the_users_rows() -> None:
    """Each of a user's 4 rows is chosen with probability 1/4: over 4000 seeded draws each
    count is within 5 binomial standard deviations (sqrt(4000 * 1/4 * 3/4) = 27.4) of 1000."""
    rows = LocalPredictions(
        groups=[0, 0, 0, 0, 1, 1],
        labels=[0, 1, 0, 1, 1, 1],
        predictions=[0, 0, 1, 1, 1, 0],
        user_ids=[7, 7, 7, 7, 9, 9],
    )
    rng = np.random.default_rng(11)
    chosen = np.array([rows.one_row_per_user(rng)[0] for _ in range(4000)])
    assert chosen.shape == (4000, 2)
    counts = np.bincount(chosen[:, 0], minlength=4)
    assert np.all(np.abs(counts - 1000) < 5 * np.sqrt(4000 * 0.25 * 0.75)), counts
    assert set(np.unique(chosen[:, 1])) == {4, 5}
    assert rows.one_row_per_user(rng)[1].tolist() == [7, 9]
    with pytest.raises(ValueError, match="same protected group"):
        LocalPredictions(groups=[0, 1], labels=[0, 1], predictions=[0, 1], user_ids=[5, 5])


# --- the server's checks --------------------------------------------------------------------


def reply_message(
    audit: RateReportAudit, reports: np.ndarray, counts: dict, node: int = 3
) -> Message:
    """A reply from ``node`` (the reply's source is the node its request was sent to)."""
    (request,) = audit.configure_report(THRESHOLD, [node])
    content = RecordDict(
        {
            "reports": ArrayRecord({"categories": Array(reports)}),
            "metrics": MetricRecord(counts),
        }
    )
    return Message(content=content, reply_to=request)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    ("oracle", "reports", "counts", "match"),
    [
        ("grr", np.array([0, 8], dtype=np.int32), {}, "outside"),
        ("grr", np.array([0.5, 1.0]), {}, "1-D integer"),
        ("ss", np.packbits(np.eye(8, dtype=bool)[:2], axis=1), {}, "exactly"),
        ("oue", np.array([[0, 1], [0, 0]], dtype=np.uint8), {}, "packed bits"),
        ("oue", np.array([[0], [0]], dtype=np.uint8), {"num-reports": 3}, "num-reports says 3"),
        ("grr", np.array([1, 2], dtype=np.int32), {"num-refused": -1}, "num-refused"),
    ],
)
def test_a_reply_the_oracle_cannot_produce_is_rejected_and_counted(
    oracle: str, reports: np.ndarray, counts: dict, match: str
) -> None:
    audit = RateReportAudit.for_budget(1.0, num_groups=2, oracle=oracle)
    good = audit.oracle.perturb(np.arange(8), np.random.default_rng(0))
    outcome = audit.aggregate_report(
        [3, 4],
        [
            reply_message(audit, reports, counts),
            reply_message(audit, pack_reports(audit.oracle, good), {}, node=4),
        ],
    )
    assert [item.node_id for item in outcome.rejected] == [3]
    assert match in outcome.rejected[0].reason
    assert outcome.accepted_nodes == 1 and outcome.num_reports == 8
    assert outcome.rates is not None  # the good node's reports still give an estimate


# --- through Flower -------------------------------------------------------------------------


@pytest.mark.slow
def test_every_rate_of_users_own_flower_app_through_flower(tmp_path: Path) -> None:
    """Three SuperNodes in a Flower simulation, each with its own rows (one per user). Every
    metric's private estimate per group lies within 5 of its standard errors of the true rate
    of those rows (a false failure per value has probability ~6e-7; the noise comes from OS
    entropy and cannot be seeded), and each user was charged once, for all eight metrics."""
    num_nodes = 3
    client_app = ClientApp()

    @client_app.query("rate_report")
    def report(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        handler = rate_report_handler(threshold_predictions(*own_rows(node)), num_groups=2)
        return handler(msg, context)

    outcomes: list = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        import time

        deadline = time.monotonic() + 60
        while len(list(grid.get_node_ids())) < num_nodes and time.monotonic() < deadline:
            time.sleep(0.1)
        audit = RateReportAudit.for_budget(4.0, num_groups=2)
        outcomes.append(audit.start(grid, THRESHOLD, timeout=120))
        del context

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    (outcome,) = outcomes
    assert outcome.nodes_replied == num_nodes and not outcome.rejected
    assert outcome.num_reports == 3 * 400
    rates = outcome.rates
    assert rates is not None
    from fairlearn.metrics import MetricFrame, selection_rate, true_positive_rate

    rows = [own_rows(node) for node in range(num_nodes)]
    features = np.concatenate([r[0] for r in rows])
    labels = np.concatenate([r[1] for r in rows])
    groups = np.concatenate([r[2] for r in rows])
    truth = MetricFrame(
        metrics={"selection_rate": selection_rate, "true_positive_rate": true_positive_rate},
        y_true=labels,
        y_pred=(features > 0.5).astype(int),
        sensitive_features=groups,
    )
    estimates = rates.by_group
    for metric in ("selection_rate", "true_positive_rate"):
        for group in (0, 1):
            estimate = estimates[metric][group]
            assert abs(estimate.value - truth.by_group[metric][group]) < 5 * estimate.stderr
    # charged once: each user's total is one report's epsilon, not eight metrics' worth
    assert outcome.ledger_totals is not None
    assert outcome.ledger_totals.epsilon == pytest.approx(outcome.epsilon, rel=0.02)
    assert "charged once for every metric" in outcome.summary()
