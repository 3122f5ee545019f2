"""A FedEvalFair (or pipeline) run whose holders lack their keys fails before training.

Before, the FedEvalFair guide's command on a machine where the holders had no identity trained
the model, then printed the refusal 23 times and about 354 lines, ended "0 valid ciphertext(s),
need 2", and wrote ``status.json`` ``"completed"`` beside an ``"error"``. Now every node says in
its ``describe`` reply what it lacks (from its configuration and files, never its data), and
the job stops before training with one line saying what to run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict

from fedparity.clients.app import (
    FEF_MISSING_IDENTITY,
    FEF_MISSING_SECRET_CONTEXT,
    describe,
)
from fedparity.clients.identity import IDENTITY_DIR_ENV, ROSTER_FILE, identity_key_file
from fedparity.clients.project.config import RunConfig
from fedparity.mechanisms.crypto.ckks import SECRET_CONTEXT_ENV, KeyPaths
from fedparity.server.api import run_simulation_job
from fedparity.server.cli.identity import write_node_identities
from fedparity.server.orchestration import (
    JobCannotStart,
    NodeDescriptions,
    require_fedevalfair_holders,
)
from fedparity.server.run_record import read_status

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def keys(ckks_keys: KeyPaths) -> KeyPaths:
    """The session's CKKS key pair (tests.support.fixtures)."""
    return ckks_keys


def fef_missing(node_config: dict[str, object], task: str = "fedevalfair", **run: object) -> int:
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 3, **node_config},
        state=RecordDict(),
        run_config={"task": task, "users-per-node": 40, **run},
    )
    request = Message(content=RecordDict({}), dst_node_id=7, message_type="query.describe")
    reply = describe(request, context, RunConfig.from_mapping(context.run_config))
    metrics = dict(reply.content.metric_records["metrics"])
    return int(metrics["fef-missing"]) if "fef-missing" in metrics else -1


def test_describe_says_what_a_holder_lacks(
    keys: KeyPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    identities = write_node_identities(tmp_path / "identity", 3)
    complete = {
        "fef-secret-context": str(keys.secret),
        "identity-key": str(identities / identity_key_file(1)),
        "roster": str(identities / ROSTER_FILE),
    }
    monkeypatch.delenv(SECRET_CONTEXT_ENV, raising=False)
    monkeypatch.delenv(IDENTITY_DIR_ENV, raising=False)
    assert fef_missing(complete) == 0
    assert fef_missing({**complete, "identity-key": "", "roster": ""}) == FEF_MISSING_IDENTITY
    assert fef_missing({**complete, "fef-secret-context": ""}) == FEF_MISSING_SECRET_CONTEXT
    assert fef_missing({}) == FEF_MISSING_SECRET_CONTEXT | FEF_MISSING_IDENTITY
    both = FEF_MISSING_SECRET_CONTEXT | FEF_MISSING_IDENTITY
    assert fef_missing({}, task="pipeline", metric="fnr", epsilons="1") == both
    # the other jobs do not ask (a device of an LDP audit has no FedEvalFair keys)
    assert fef_missing({}, task="ldp-audit") == -1
    # the bits depend on the node's configuration, not on its users' data
    assert fef_missing(complete, seed=1) == fef_missing(complete, seed=2) == 0


def described(missing: dict[int, int]) -> NodeDescriptions:
    nodes = NodeDescriptions()
    nodes.fedevalfair_missing = dict(missing)
    return nodes


def test_the_job_refuses_to_start_with_fewer_than_two_holders_and_says_what_to_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(JobCannotStart) as refused:
        require_fedevalfair_holders(
            described({1: FEF_MISSING_IDENTITY, 2: FEF_MISSING_IDENTITY, 3: 3}), [1, 2, 3, 4]
        )
    text = str(refused.value)
    assert "1 of 4 nodes have them" in text
    assert "(1 without a secret context; 3 without an identity key and roster)" in text
    assert "fedparity keys and fedparity identity --nodes 4" in text
    # two ready holders: the test runs with them, and the operator is told who cannot hold
    with caplog.at_level(logging.WARNING):
        require_fedevalfair_holders(described({3: FEF_MISSING_IDENTITY}), [1, 2, 3])
    assert "1 of 3 nodes cannot hold (1 without an identity key and roster)" in caplog.text
    # nodes that did not say (another app's ClientApp) are not judged
    require_fedevalfair_holders(described({}), [1, 2])


@pytest.mark.slow
def test_a_simulation_whose_holders_have_no_identity_fails_before_training(
    keys: KeyPaths, tmp_path: Path
) -> None:
    no_identity = tmp_path / "empty-identity-folder"
    no_identity.mkdir()
    output = tmp_path / "run"
    # the in-process simulation re-raises the ServerApp's error (flwr run logs it in one line)
    with pytest.raises(JobCannotStart, match="0 of 3 nodes have them"):
        run_simulation_job(
            {
                "task": "fedevalfair",
                "fef-public-context": str(keys.public),
                "users-per-node": 500,
                "num-server-rounds": 3,
                "output-dir": str(output),
            },
            num_supernodes=3,
            environment={SECRET_CONTEXT_ENV: str(keys.secret), IDENTITY_DIR_ENV: str(no_identity)},
        )
    status = read_status(output)
    assert status is not None and status["status"] == "failed"
    assert "FedEvalFair needs at least 2 holders with their keys, and 0 of 3" in status["error"]
    assert "fedparity identity --nodes 3" in status["error"]
    assert status["releases"] == [] and status["results_file"] is None


def test_a_run_whose_superlink_installed_the_dependencies_says_how_to_stop_that() -> None:
    """Flower's runtime dependency installation (a SuperLink started without
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1) ran uv sync for 47 s and installed a CUDA
    torch, silently. The job now says so in one line, with the command; the environment is
    given as Flower leaves it (a fault injected, the real uv sync needs a download)."""
    from fedparity.server.app import runtime_install_notice

    flower_env = {"VIRTUAL_ENV": "/home/u/.flwr/runtime-envs/1234567"}
    notice = runtime_install_notice(flower_env)
    assert notice is not None and "/home/u/.flwr/runtime-envs/1234567" in notice
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in notice and "pkill -u" in notice
    assert runtime_install_notice({"VIRTUAL_ENV": "/work/project/.venv"}) is None
    assert runtime_install_notice({}) is None
