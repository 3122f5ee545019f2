"""The LDP audit as a library: a user's own ClientApp (own model, own data) registers
``ldp_audit_handler``; the server half is ``LdpGapAudit``.

Nothing of fedparity's run config, populations or models is used here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedparity.clients.ldp import LocalUsers, ldp_audit_handler
from fedparity.clients.ledger import LEDGER_STATE_KEY
from fedparity.clients.messages import NodeRefusal
from fedparity.mechanisms import RandomizedResponseMechanism, mechanism_for_budget
from fedparity.strategies.ldp_audit import LdpGapAudit

# --- LocalUsers ---------------------------------------------------------------------------


def test_users_from_rows_match_a_count_by_hand() -> None:
    rng = np.random.default_rng(3)
    user_ids = rng.choice(np.array([11, 40, 7, 99]), size=200)
    groups_of_user = {11: 0, 40: 1, 7: 1, 99: 0}
    labels = rng.integers(0, 2, size=200)
    predictions = rng.integers(0, 2, size=200)
    groups = np.array([groups_of_user[u] for u in user_ids])
    for metric in ("accuracy", "tpr", "fpr", "fnr"):
        users = LocalUsers.from_rows(
            groups=groups, labels=labels, predictions=predictions, metric=metric, user_ids=user_ids
        )
        for position, user in enumerate(sorted(groups_of_user)):  # users in sorted id order
            rows = user_ids == user
            y, p = labels[rows], predictions[rows]
            expected = {
                "accuracy": np.mean(y == p),
                "tpr": np.mean(p[y == 1] == 1),
                "fpr": np.mean(p[y == 0] == 1),
                "fnr": np.mean(p[y == 1] == 0),
            }[metric]
            assert users.metrics[position] == pytest.approx(expected, abs=1e-15)
            assert users.groups[position] == groups_of_user[user]


def test_a_device_without_user_ids_is_one_user_and_undefined_rates_are_nan() -> None:
    users = LocalUsers.from_rows(
        groups=[1, 1, 1], labels=[0, 0, 0], predictions=[1, 0, 0], metric="tpr"
    )
    assert users.num_users == 1 and users.groups.tolist() == [1]
    assert np.isnan(users.metrics[0])  # no positives: TPR undefined


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups": [0, 1], "user_ids": [5, 5]}, "same protected group"),
        ({"groups": [0, 1], "metric": "auc"}, "metric must be one of"),
        ({"groups": [0, 1], "labels": [0, 2]}, "labels must hold only 0/1"),
        ({"groups": [0]}, "groups must have one value per row"),
    ],
)
def test_bad_rows_get_a_message_naming_the_problem(kwargs: dict, message: str) -> None:
    arguments = {
        "labels": [0, 1],
        "predictions": [0, 1],
        "metric": "accuracy",
        "user_ids": [1, 2],
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        LocalUsers.from_rows(**arguments)


def test_handler_arguments_are_checked_when_it_is_built() -> None:
    def no_users(arrays: ArrayRecord, metric: str, context: Context) -> LocalUsers:
        return LocalUsers(np.zeros(0, dtype=np.int64), np.zeros(0))

    with pytest.raises(ValueError, match="num_groups must be an integer >= 2"):
        ldp_audit_handler(no_users, num_groups=1)
    with pytest.raises(TypeError, match="policy must be a NodePrivacyPolicy"):
        ldp_audit_handler(no_users, num_groups=2, policy={"ldp-user-budget": 1.0})  # type: ignore[arg-type]


# --- the handler on a node ----------------------------------------------------------------


def threshold_users(
    features: np.ndarray, labels: np.ndarray, groups: np.ndarray, user_ids: np.ndarray
):  # noqa: ANN201 - a LocalUsersFn
    """The user's own "model": predict 1 when feature > threshold (the received array)."""

    def local_users(arrays: ArrayRecord, metric: str, context: Context) -> LocalUsers:
        threshold = float(arrays["threshold"].numpy()[0])
        predictions = (features > threshold).astype(np.int64)
        return LocalUsers.from_rows(
            groups=groups, labels=labels, predictions=predictions, metric=metric, user_ids=user_ids
        )

    return local_users


def own_population(node: int, users: int = 600, rows_per_user: int = 8) -> tuple[np.ndarray, ...]:
    """A node's own rows: group 1's feature is noisier, so the threshold model is less
    accurate for it (a real gap)."""
    rng = np.random.default_rng(1000 + node)
    user_ids = np.repeat(np.arange(users) + 10_000 * node, rows_per_user)
    user_groups = rng.integers(0, 2, size=users)
    groups = np.repeat(user_groups, rows_per_user)
    labels = rng.integers(0, 2, size=user_ids.size)
    noise = np.where(groups == 1, 1.5, 0.5)
    features = labels + rng.normal(0.0, noise)
    return features, labels, groups, user_ids


@pytest.mark.usefixtures("task_identity")
def test_handler_sends_perturbed_pairs_only_and_users_refuse_past_their_budget(
    tmp_path: Path,
) -> None:
    features, labels, groups, user_ids = own_population(0, users=50)
    handler = ldp_audit_handler(threshold_users(features, labels, groups, user_ids), num_groups=2)
    mechanism = RandomizedResponseMechanism(0.5, 0.5)  # true epsilon 1.0 or a bit more
    arrays = ArrayRecord({"threshold": Array(np.array([0.5]))})
    expected = [50, 50, 0] if 3 * mechanism.epsilon > 2.5 else [50, 50, 50]
    # The budget is the node's own (its node config), whatever the run config says.
    context = Context(
        run_id=1,
        node_id=3,
        node_config={"ledger-dir": str(tmp_path), "user-epsilon-budget": 2.5},
        state=RecordDict(),
        run_config={"user-budget": 1e9},
    )
    for want in expected:
        message = LdpGapAudit(mechanism, budget=mechanism.epsilon).configure_audit(arrays, [3])[0]
        reply = handler(message, context)
        metrics = reply.content.metric_records["metrics"]
        assert metrics["num-reports"] == want
        assert metrics["epsilon-charged"] == pytest.approx(mechanism.epsilon)
        reports = reply.content.array_records["reports"]
        assert set(reports.keys()) == {"groups", "values"}  # nothing else leaves the node
        assert set(np.unique(reports["values"].numpy())) <= {-1, 1}  # M_R's output domain
    assert (tmp_path / "user-ledger.json").is_file()


@pytest.mark.usefixtures("task_identity")
def test_handler_refuses_another_number_of_groups() -> None:
    features, labels, groups, user_ids = own_population(0, users=5)
    handler = ldp_audit_handler(threshold_users(features, labels, groups, user_ids), num_groups=3)
    mechanism = mechanism_for_budget("R", 1.0, num_groups=2)
    message = LdpGapAudit(mechanism, budget=1.0).configure_audit(
        ArrayRecord({"threshold": Array(np.array([0.5]))}), [1]
    )[0]
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(NodeRefusal, match="number of group categories is not this node"):
        handler(message, context)
    assert LEDGER_STATE_KEY not in context.state.config_records


# --- through Flower -----------------------------------------------------------------------


@pytest.mark.slow
def test_users_own_flower_app_audits_its_own_data_through_flower(tmp_path: Path) -> None:
    """Three SuperNodes in a Flower simulation, each with its own rows; the private estimate
    of the accuracy gap lies within 5 standard errors of the true gap of those rows (a false
    failure has probability ~6e-7: the noise comes from OS entropy and cannot be seeded)."""
    num_nodes = 3
    client_app = ClientApp()

    @client_app.query("ldp_audit")
    def audit(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        features, labels, groups, user_ids = own_population(node)
        handler = ldp_audit_handler(
            threshold_users(features, labels, groups, user_ids), num_groups=2
        )
        return handler(msg, context)

    outcomes: list = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        import time

        deadline = time.monotonic() + 60
        while len(list(grid.get_node_ids())) < num_nodes and time.monotonic() < deadline:
            time.sleep(0.1)
        mechanism = mechanism_for_budget("R", 4.0, num_groups=2)
        audit = LdpGapAudit(mechanism, budget=4.0, metric="accuracy")
        arrays = ArrayRecord({"threshold": Array(np.array([0.5]))})
        outcomes.append(audit.start(grid, arrays, timeout=120))
        del context  # the audit needs nothing of the run config

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    (outcome,) = outcomes
    assert outcome.nodes_replied == num_nodes and not outcome.rejected
    # The true gap of the same rows (what only this test knows).
    per_group: dict[int, list[float]] = {0: [], 1: []}
    for node in range(num_nodes):
        features, labels, groups, user_ids = own_population(node)
        users = LocalUsers.from_rows(
            groups=groups,
            labels=labels,
            predictions=(features > 0.5).astype(np.int64),
            metric="accuracy",
            user_ids=user_ids,
        )
        for group in (0, 1):
            per_group[group].extend(users.metrics[users.groups == group])
    true_gap = np.mean(per_group[0]) - np.mean(per_group[1])
    assert true_gap > 0.05  # the population really has a gap
    estimate = outcome.estimate
    assert estimate is not None
    difference = float(estimate.differences[0])
    stderr = float(estimate.difference_stderrs[0])
    assert abs(difference - true_gap) < 5 * stderr
