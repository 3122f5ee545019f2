"""No unprotected training, and bounded sizes, at the project's ClientApp (security review
2026-11-26, findings C3 and L1).

C3: the ClientApp's plain FedAvg ``train`` handler answered any server with the weights trained
on the node's own data: no policy check, no ledger charge, no minimum user count. On a
one-user device one ``train`` message with zero weights gave the user's row back exactly. Now a
node refuses ``train`` (a fixed sentence naming ``allow-non-private``) unless its own policy
allows non-private training, and unless its run config trains with FedAvg; both are decided
before any data is read. The LDP-audit and FedEvalFair jobs take the operator's model instead
(``model-file``), and stop with a clear message when every node refuses.

L1: ``num-groups``, ``users-per-node``, ``fef-resamples`` and ``fpfl-rounds`` from the run
config accepted 1e9 (a node allocated what the server asked for). Now each is checked against
the node's policy caps before any handler runs.

Every attack goes through the real ClientApp object (``fedparity.clients.app.app``) with real
Flower Messages and Contexts; the deployment test runs a real SuperLink and SuperNodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

import fedparity.clients.app as client_app_module
import fedparity.clients.project.evaluation as project_evaluation
from fedparity.clients.app import (
    NO_FEDAVG_TRAINING_TEXT,
    NON_PRIVATE_TRAINING_RULE,
    app,
)
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import PolicyRefusal
from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.server.orchestration import supplied_model, train_global_model

pytestmark = pytest.mark.usefixtures("task_identity")

REPO = Path(__file__).resolve().parents[1]
POLICY_PREFIX = "refused by this node's privacy policy: "
PIPELINE = {"task": "pipeline", "metric": "fnr", "epsilons": "1"}
#: The device's one row (the review's demo): three features and label 1.
ROW = (47.0, 52.0, 15024.0)


def _message(message_type: str, content: RecordDict | None = None, number: int = 0) -> Message:
    message = Message(content or RecordDict({}), dst_node_id=3, message_type=message_type)
    message.metadata.__dict__["_message_id"] = f"message-{number}"
    return message


def _context(node_config: dict, run_config: dict) -> Context:
    return Context(
        run_id=1, node_id=3, node_config=node_config, state=RecordDict(), run_config=run_config
    )


def _device(tmp_path: Path, **extra: object) -> dict:
    """A one-user device's node config: its own one-row file (two protected groups, set by the
    node's operator) and a ledger folder."""
    rows = tmp_path / "me.csv"
    rows.write_text("group,label,a,b,c\n1,1," + ",".join(f"{v:g}" for v in ROW) + "\n")
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir(exist_ok=True)
    return {
        "partition-id": 0,
        "num-partitions": 1,
        "data-file": str(rows),
        "num-groups": 2,
        "ledger-dir": str(ledgers),
        **extra,
    }


def _zero_weights_train() -> Message:
    """The review's attack: one train message with zero weights."""
    arrays = ArrayRecord([np.zeros((1, len(ROW)), np.float32), np.zeros(1, np.float32)])
    config = ConfigRecord({"server-round": 1})
    return _message("train", RecordDict({"arrays": arrays, "config": config}))


# --- C3: train is refused unless the node's policy allows non-private training --------------


@pytest.mark.parametrize(
    "run_config", [{"task": "ldp-audit"}, {"task": "fedevalfair"}, {"task": "fpfl"}, PIPELINE]
)
def test_a_one_user_device_refuses_train_under_the_built_in_policy(
    tmp_path: Path, run_config: dict
) -> None:
    """Before: the device answered with w' = 0.05 x and b' = 0.05 for its row x, so w'/b' was
    the user's row exactly, with num-examples 1 and no ledger charge. Now every task is refused
    with one fixed sentence and nothing comes back."""
    node_config = _device(tmp_path)
    with pytest.raises(PolicyRefusal) as refused:
        app(_zero_weights_train(), _context(node_config, run_config))
    assert str(refused.value) == POLICY_PREFIX + NON_PRIVATE_TRAINING_RULE
    assert "allow-non-private" in str(refused.value)
    assert not any((tmp_path / "ledgers").iterdir())  # nothing charged, nothing written


def test_the_refusal_is_decided_before_any_data_is_read(tmp_path: Path) -> None:
    """The same sentence whatever the node's data: with its file, or with no file at all (a
    node that read its data first would fail with 'no such file' instead)."""
    answers = set()
    for data_file in (_device(tmp_path)["data-file"], str(tmp_path / "absent.csv")):
        node_config = {**_device(tmp_path), "data-file": data_file}
        with pytest.raises(PolicyRefusal) as refused:
            app(_zero_weights_train(), _context(node_config, {"task": "ldp-audit"}))
        answers.add(str(refused.value))
    assert answers == {POLICY_PREFIX + NON_PRIVATE_TRAINING_RULE}


def test_with_allow_non_private_the_device_answers_and_releases_its_row(tmp_path: Path) -> None:
    """What the gate protects: with allow-non-private (its users agreed), the device trains
    and its reply gives its row back exactly (x = w'/b'), as the review showed."""
    node_config = _device(tmp_path, **{"allow-non-private": True})
    reply = app(_zero_weights_train(), _context(node_config, {"task": "ldp-audit"}))
    weight, bias = reply.content.array_records["arrays"].to_numpy_ndarrays()
    np.testing.assert_allclose(weight[0] / bias[0], ROW, rtol=1e-5)
    assert reply.content.metric_records["metrics"]["num-examples"] == 1


@pytest.mark.parametrize(
    "run_config",
    [
        {"task": "fpfl"},
        PIPELINE,
        {"task": "ldp-audit", "model-file": "/srv/models/audited.npz"},
        {"task": "fedevalfair", "num-server-rounds": 0},
    ],
)
def test_train_is_refused_when_the_run_trains_no_model_with_fedavg(
    tmp_path: Path, run_config: dict
) -> None:
    """Even a node that allows non-private training refuses train for a run whose own config
    trains no model with FedAvg (the review's demo sent it with task = "fpfl")."""
    node_config = _device(tmp_path, **{"allow-non-private": True})
    node_config["data-file"] = str(tmp_path / "absent.csv")  # decided before any data is read
    with pytest.raises(NodeRefusal) as refused:
        app(_zero_weights_train(), _context(node_config, run_config))
    assert str(refused.value) == NO_FEDAVG_TRAINING_TEXT


# --- model-file: the operator's model, checked before any work -------------------------------


def test_model_file_is_read_and_checked_before_any_work(tmp_path: Path) -> None:
    arrays = get_arrays(build_model(8, seed=3))
    positional = tmp_path / "model.npz"
    np.savez(positional, *arrays)
    named = tmp_path / "named.npz"
    np.savez(named, **dict(zip(build_model(8).state_dict(), arrays, strict=True)))
    for path in (positional, named):
        loaded = supplied_model(RunConfig.from_mapping({"model-file": str(path)}))
        assert loaded is not None
        for mine, theirs in zip(loaded, arrays, strict=True):
            np.testing.assert_array_equal(mine, theirs)
    # With it, no FedAvg round and no message: the model is the file's (grid is never used).
    config = RunConfig.from_mapping({"model-file": str(positional)})
    model, losses, strategy = train_global_model(None, config, 8)  # type: ignore[arg-type]
    assert [a.tolist() for a in model.to_numpy_ndarrays()] == [a.tolist() for a in arrays]
    assert losses == {} and strategy.rejected == {}
    assert supplied_model(RunConfig.from_mapping({})) is None  # "" = train with FedAvg


def test_a_bad_model_file_names_the_key(tmp_path: Path) -> None:
    def refused(value: str, fragment: str, features: int = 8) -> None:
        with pytest.raises(ConfigError) as raised:
            config = RunConfig.from_mapping({"model-file": value})
            train_global_model(None, config, features, supplied_model(config))  # type: ignore[arg-type]
        assert "model-file" in str(raised.value) and fragment in str(raised.value)

    refused("model.npz", "absolute path")
    refused(str(tmp_path / "model.pt"), ".npz")
    refused(str(tmp_path / "absent.npz"), "no such file")
    (tmp_path / "junk.npz").write_text("not a zip")
    refused(str(tmp_path / "junk.npz"), "not a .npz")
    np.savez(tmp_path / "keys.npz", w=np.zeros((1, 8)), b=np.zeros(1))
    refused(str(tmp_path / "keys.npz"), "holds arrays w, b")
    np.savez(tmp_path / "nan.npz", np.full((1, 8), np.nan), np.zeros(1))
    refused(str(tmp_path / "nan.npz"), "array arr_0 must hold finite numbers")
    np.savez(tmp_path / "small.npz", *get_arrays(build_model(5)))
    refused(str(tmp_path / "small.npz"), "arrays of shapes [(1, 5), (1,)]")
    refused(str(tmp_path / "small.npz"), "8 features, so the model's arrays have shapes")
    with pytest.raises(
        ConfigError, match="model-file is for task = .ldp-audit., .rate-report. or .fedevalfair."
    ):
        RunConfig.from_mapping({"task": "fpfl", "model-file": str(tmp_path / "small.npz")})


# --- L1: sizes bounded by the node's policy before any handler runs ---------------------------

#: (run config, node config cap, the cap's rule) per size the run config sets.
CAPS = {
    "num-groups": (
        {"users-per-node": 50, "num-groups": 5},
        {"max-groups": 4},
        "number of groups",
        {"users-per-node": 50, "num-groups": 4},
    ),
    "users-per-node": (
        {"users-per-node": 51},
        {"max-users-per-node": 50},
        "users per node",
        {"users-per-node": 50},
    ),
    "fef-resamples": (
        {"task": "fedevalfair", "users-per-node": 200, "fef-resamples": 51},
        {"max-resamples": 50},
        "bootstrap resamples",
        {"task": "fedevalfair", "users-per-node": 200, "fef-resamples": 50},
    ),
    "fpfl-rounds": (
        {"task": "fpfl", "users-per-node": 20, "fpfl-rounds": 11},
        {"fpfl-max-rounds": 10},
        "rounds",
        {"task": "fpfl", "users-per-node": 20, "fpfl-rounds": 10},
    ),
}
RULES = {
    "number of groups": "the run's number of groups is outside [2, max-groups]",
    "users per node": "the run's users per node are outside [1, max-users-per-node]",
    "bootstrap resamples": "the run's bootstrap resamples are outside [1, max-resamples]",
    "rounds": "the training's rounds are outside [1, fpfl-max-rounds]",
}
#: The node's data loaders (each loads, or generates, the node's users), by the module that
#: calls them: the ClientApp, and the project's task code it shares with the harness.
LOADERS = {
    "load_partition": project_evaluation,
    "synthetic_holder": project_evaluation,
    "adult_holder": project_evaluation,
    "node_shard": client_app_module,
    "read_data_file": client_app_module,
}


def _watch_loaders(monkeypatch: pytest.MonkeyPatch, fail: bool) -> list[str]:
    """Record every call of the node's data loaders (calling through), or with ``fail`` make
    any call fail instead of allocating what a huge run config asks for."""
    calls: list[str] = []

    def watched(name: str, loader: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            calls.append(name)
            if fail:
                raise AssertionError(f"{name} was called: the node loaded data")
            return loader(*args, **kwargs)

        return call

    for name, module in LOADERS.items():
        monkeypatch.setattr(module, name, watched(name, getattr(module, name)))
    return calls


def _node(node_config: dict) -> dict:
    return {"partition-id": 0, "num-partitions": 2, **node_config}


@pytest.mark.parametrize("size", list(CAPS))
def test_a_size_beyond_the_nodes_cap_is_refused_before_any_data_is_loaded(
    monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    """Before: the node took each size from the run config as it came. Now a size one above
    the node's cap is refused, with a fixed sentence naming the cap (never the value), for
    every message type, and no loader ran; at the cap the node describes its data."""
    over, cap, rule, within = CAPS[size]
    calls = _watch_loaders(monkeypatch, fail=False)
    for number, message_type in enumerate(("query.describe", "train", "query.fef_round1")):
        with pytest.raises(PolicyRefusal) as refused:
            app(_message(message_type, number=number), _context(_node(cap), over))
        assert str(refused.value) == POLICY_PREFIX + RULES[rule]  # no value in it
    assert calls == []
    reply = app(_message("query.describe", number=9), _context(_node(cap), within))
    assert reply.content.metric_records["metrics"]["num-users"] > 0
    assert calls  # within the cap the data is loaded


@pytest.mark.parametrize(
    ("run_config", "rule"),
    [
        ({"num-groups": 10**9}, "number of groups"),
        ({"users-per-node": 10**9}, "users per node"),
        ({"task": "fedevalfair", "fef-resamples": 10**9}, "bootstrap resamples"),
        ({**PIPELINE, "fef-resamples": 10**9}, "bootstrap resamples"),
        ({"task": "fpfl", "fpfl-rounds": 10**9}, "rounds"),
        ({**PIPELINE, "fpfl-rounds": 10**9}, "rounds"),
    ],
)
def test_the_reviews_1e9_sizes_are_refused_by_the_built_in_policy(
    monkeypatch: pytest.MonkeyPatch, run_config: dict, rule: str
) -> None:
    """The review's L1: 1e9 groups, users, resamples or rounds; before, a node allocated them
    (the loaders here fail instead of allocating, should the check be missing)."""
    _watch_loaders(monkeypatch, fail=True)
    with pytest.raises(PolicyRefusal) as refused:
        app(_message("query.describe"), _context(_node({}), run_config))
    assert str(refused.value) == POLICY_PREFIX + RULES[rule]


def test_users_per_node_does_not_bound_a_node_with_its_own_file(tmp_path: Path) -> None:
    """A node's own data file holds its users: users-per-node (embedded data) is not checked."""
    node_config = _device(tmp_path)
    reply = app(_message("query.describe"), _context(node_config, {"users-per-node": 10**9}))
    assert reply.content.metric_records["metrics"]["num-users"] == 1
    with pytest.raises(PolicyRefusal):  # the other caps still hold
        app(_message("query.describe"), _context(node_config, {"num-groups": 10**9}))


# --- through a real SuperLink and SuperNodes --------------------------------------------------


@pytest.mark.slow
def test_the_default_ldp_audit_stops_when_the_nodes_refuse_training(tmp_path: Path) -> None:
    """Two SuperNodes with the built-in policy. Before: the default LDP-audit job trained
    with plain FedAvg (every node sent its weights in clear) and audited the result. Now both
    refuse train, the job stops after that one exchange with the way to proceed in its status
    and log, and no audit is sent; with model-file the same nodes are audited, untrained."""
    from fedparity.server.run_record import read_status
    from tests.support.flower_processes import local_deployment

    model_file = tmp_path / "model.npz"
    np.savez(model_file, *get_arrays(build_model(8, seed=7)))  # the synthetic data: 8 features
    common = {
        "users-per-node": 100,
        "epsilons": "2",
        "user-budget": 2.0,
        "min-nodes": 2,
        "reply-timeout": 60.0,
    }
    with local_deployment(REPO, 2, None, tmp_path / "flwr-home", warm=True) as deployment:
        refused = tmp_path / "refused"
        run = deployment.run({**common, "output-dir": str(refused)}, timeout=300, check=False)
        assert run.status == "finished:failed", run.output[-3000:]
        status = read_status(refused)
        assert status is not None and status["status"] == "failed"
        error = status["error"]
        assert error.startswith("TrainingRefused: no node trained the model: 2 of 2 node(s)")
        for step in ("model-file", 'task = "pipeline"', "allow-non-private = true"):
            assert step in error
        assert "refused non-private training" in run.output and "model-file" in run.output
        assert status["releases"] == [] and status["results_file"] is None  # no audit sent
        assert not (refused / "results.json").exists()
        # Each node refused (a fixed sentence): no node released weights or charged a ledger.
        for index in range(2):
            home = deployment.work_dir / f"supernode-{index}"
            assert not (home / ".fedparity" / "ledgers").exists()

        supplied = tmp_path / "supplied"
        run = deployment.run(
            {**common, "model-file": str(model_file), "output-dir": str(supplied)}, timeout=300
        )
        assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((supplied / "results.json").read_text())
    assert results["training"]["model_file"] == str(model_file)
    assert results["training"]["rounds"] == 0 and results["training"]["rejected_replies"] == {}
    (audit,) = results["audits"]
    assert audit["accepted_nodes"] == 2 and audit["num_reports"] == 200
