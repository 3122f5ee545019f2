"""The ClientApp handlers, called as the Flower runtime calls them (real Context/Message).

What leaves the node: only perturbed (group, value) pairs and counts; every user's ledger
is charged the mechanism's true epsilon (recomputed on the node) and users refuse once
their budget would be exceeded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedparity.clients.app import describe, ldp_audit, load_shard, train_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.mechanisms import (
    RandomizedResponseMechanism,
    randomized_response_epsilon,
)
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.mechanisms.protocol import AUDIT_MESSAGE_TYPE, METRICS_KEY
from fedparity.strategies.ldp_audit import LdpGapAudit

RUN_CONFIG = {"users-per-node": 40, "epsilons": "1", "user-budget": 2.5}
#: The node's own policy: each user's lifetime budget (node config, set by the operator).
NODE_BUDGET = {"user-epsilon-budget": 2.5}


pytestmark = pytest.mark.usefixtures("task_identity")


def config_of(context: Context) -> RunConfig:
    """What the ClientApp passes every handler: the parsed run config."""
    return RunConfig.from_mapping(context.run_config)


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path) -> Path:
    """Each test's node keeps its ledger here (outside simulation a ledger always persists)."""
    return tmp_path / "ledgers"


def make_context(node_config: dict[str, object] | None = None) -> Context:
    return Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 3, **NODE_BUDGET, **(node_config or {})},
        state=RecordDict(),
        run_config=dict(RUN_CONFIG),
    )


def ledger_spent(folder: Path, num_users: int = 40) -> np.ndarray:
    return UserLedger.load(folder / "ledger-partition-1.json", num_users).epsilon_spent()


def model_arrays(context: Context) -> ArrayRecord:
    shard = load_shard(context, RunConfig.from_mapping(context.run_config), "test")
    return ArrayRecord(get_arrays(build_model(shard.num_features, seed=0)))


def audit_message(
    context: Context, mechanism: RandomizedResponseMechanism, budget: float
) -> Message:
    audit = LdpGapAudit(mechanism, budget=budget, metric="accuracy")
    return audit.configure_audit(model_arrays(context), [context.node_id])[0]


def test_describe_reports_only_shapes() -> None:
    context = make_context()
    request = Message(content=RecordDict({}), dst_node_id=7, message_type="query.describe")
    reply = describe(request, context, config_of(context))
    metrics = dict(reply.content.metric_records["metrics"])
    assert metrics == {
        "partition-id": 1,
        "num-partitions": 3,
        "num-features": 8,
        "num-users": 40,
        "num-train-samples": 40 * 16,
        "own-data": 0,  # the embedded population, not a node's own file
    }
    assert not reply.content.array_records


def test_train_replies_updated_arrays_and_weight() -> None:
    # Plain FedAvg is not private: a node answers train only when its policy allows it (the
    # refusal without it: tests/test_training_gate.py).
    context = make_context({"allow-non-private": True})
    arrays = model_arrays(context)
    request = Message(
        content=RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}),
        dst_node_id=7,
        message_type="train",
    )
    reply = train_handler(request, context, config_of(context))
    new = reply.content.array_records["arrays"].to_numpy_ndarrays()
    old = arrays.to_numpy_ndarrays()
    assert [a.shape for a in new] == [a.shape for a in old]
    assert any(not np.allclose(a, b) for a, b in zip(new, old, strict=True))
    assert reply.content.metric_records["metrics"]["num-examples"] == 40 * 16


def test_audit_reply_holds_only_perturbed_pairs_and_charges_the_ledger(ledger_dir: Path) -> None:
    context = make_context({"ledger-dir": str(ledger_dir)})
    mechanism = RandomizedResponseMechanism(0.6, 1.0)
    true_epsilon = randomized_response_epsilon(0.6, 1.0)
    reply = ldp_audit(audit_message(context, mechanism, budget=1.2), context, config_of(context))

    assert set(reply.content.array_records) == {"reports"}
    reports = reply.content.array_records["reports"]
    assert set(reports) == {"groups", "values"}
    values = reports["values"].numpy()
    assert values.dtype == np.int8 and set(np.unique(values)) <= {-1, 1}  # never a raw metric
    metrics = dict(reply.content.metric_records["metrics"])
    assert metrics["num-reports"] == 40 and metrics["num-refused"] == 0
    assert metrics["epsilon-charged"] == pytest.approx(true_epsilon)
    # the true epsilon, not eps1 or eps2
    np.testing.assert_allclose(ledger_spent(ledger_dir), true_epsilon, rtol=1e-5)


def test_users_refuse_once_their_budget_would_be_exceeded(ledger_dir: Path) -> None:
    context = make_context({"ledger-dir": str(ledger_dir)})
    mechanism = RandomizedResponseMechanism(0.6, 1.0)  # true epsilon 1.096
    message = audit_message(context, mechanism, budget=1.2)
    first = ldp_audit(message, context, config_of(context))
    second = ldp_audit(message, context, config_of(context))  # 2.19 <= 2.5: still allowed
    third = ldp_audit(message, context, config_of(context))  # 3.29 > 2.5: every user refuses
    counts = [dict(r.content.metric_records["metrics"]) for r in (first, second, third)]
    assert [c["num-reports"] for c in counts] == [40, 40, 0]
    assert counts[2]["num-refused"] == 40
    assert third.content.array_records["reports"]["groups"].numpy().size == 0


def test_ledger_dir_survives_across_runs(tmp_path: Path) -> None:
    mechanism = RandomizedResponseMechanism(0.6, 1.0)
    for expected in (40, 40, 0):  # a fresh Context per run: only the file remembers
        context = make_context({"ledger-dir": str(tmp_path)})
        reply = ldp_audit(
            audit_message(context, mechanism, budget=1.2), context, config_of(context)
        )
        assert reply.content.metric_records["metrics"]["num-reports"] == expected
    assert (tmp_path / "ledger-partition-1.json").exists()


def test_node_refuses_a_mechanism_above_the_audit_budget(ledger_dir: Path) -> None:
    context = make_context({"ledger-dir": str(ledger_dir)})
    config = ConfigRecord(
        {
            "mechanism": "R",
            "epsilon-group": 1.0,
            "epsilon-value": 1.0,  # true epsilon 1.38 (not the paper's 1), claimed budget 1.0
            "num-groups": 2,
            "budget": 1.0,
            "metric": "accuracy",
            "audit-id": "x",
        }
    )
    message = Message(
        content=RecordDict({"arrays": model_arrays(context), "config": config}),
        dst_node_id=7,
        message_type=AUDIT_MESSAGE_TYPE,
    )
    with pytest.raises(NodeRefusal, match="exceeds the audit budget"):
        ldp_audit(message, context, config_of(context))
    assert not ledger_dir.exists()  # nothing was charged


def test_adult_users_audit_through_the_handler(adult_path: Path, ledger_dir: Path) -> None:
    """Real UCI Adult: a node's users (grouped by sex) evaluate and report perturbed TPRs;
    users without a positive test sample have no TPR and report the undefined category (every
    user sends exactly one report: silence would tell the server they have no positive)."""
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 4, "ledger-dir": str(ledger_dir)},
        state=RecordDict(),
        run_config={
            "dataset": "adult",
            "data-dir": str(adult_path),
            "users-per-node": 500,
            "epsilons": "2",
            "user-budget": 2.0,
        },
    )
    shard = load_shard(context, RunConfig.from_mapping(context.run_config), "test")
    assert shard.num_users == 500 and set(np.unique(shard.user_groups)) == {0, 1}
    audit = LdpGapAudit.for_budget("R", 2.0, num_groups=2, metric="tpr")
    assert audit.undefined_category and audit.mechanism.num_groups == 3
    arrays = ArrayRecord(get_arrays(build_model(shard.num_features, seed=0)))
    message = audit.configure_audit(arrays, [7])[0]
    reply = ldp_audit(message, context, config_of(context))
    metrics = dict(reply.content.metric_records["metrics"])
    positives = np.bincount(shard.user_index, weights=shard.labels, minlength=500)
    assert int((positives == 0).sum()) > 0  # some users have no TPR
    assert metrics["num-reports"] == 500 and "num-undefined" not in metrics
    groups = reply.content.array_records["reports"]["groups"].numpy()
    assert set(np.unique(groups)) <= {0, 1, 2} and groups.size == 500


def _seed_echo(msg: Message, context: Context, config: RunConfig) -> Message:
    """An injected handler: answers with the run config it was given (seed, task)."""
    from flwr.app import MetricRecord

    record = MetricRecord({"seed": config.seed, "fpfl": int(config.task == "fpfl")})
    return Message(content=RecordDict({"echo": record}), reply_to=msg)


def test_the_client_app_travels_to_ray_actors_as_its_build_arguments() -> None:
    """Flower's Ray backend pickles the ClientApp with every message. Pickled by value, the
    app's run-config closures took 10.7 kB and 2 ms of the server process per message (a fifth
    of an FPFL round with 10 nodes); it now travels as build_client_app's arguments, and the
    app rebuilt on the actor answers exactly as the original, with its run-config overrides
    and injected handlers."""
    import ray.cloudpickle as cloudpickle

    from fedparity.clients.app import app, build_client_app

    assert len(cloudpickle.dumps(app)) < 200
    original = build_client_app({"task": "fpfl", "seed": 5}, handlers={"query.echo": _seed_echo})
    payload = cloudpickle.dumps(original)
    assert len(payload) < 1000
    rebuilt = cloudpickle.loads(payload)
    assert type(rebuilt) is type(original)
    message = Message(content=RecordDict({}), dst_node_id=7, message_type="query.echo")
    message.metadata.__dict__["_message_id"] = "message-0"
    for client_app in (original, rebuilt):
        reply = client_app(message, make_context())
        assert dict(reply.content.metric_records["echo"]) == {"seed": 5, "fpfl": 1}
    described = Message(content=RecordDict({}), dst_node_id=7, message_type="query.describe")
    described.metadata.__dict__["_message_id"] = "message-1"
    assert dict(rebuilt(described, make_context()).content.metric_records[METRICS_KEY]) == dict(
        original(described, make_context()).content.metric_records[METRICS_KEY]
    )
