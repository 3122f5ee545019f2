"""Faults never erase, waste or misreport privacy (in-process parts; the multi-process fault
suite on a real SuperLink and SuperNodes is ``tests/test_fault_suite.py``).

* A node's LDP ledger that existed and is now gone stops its audits (it is never recreated at
  zero) until the operator says otherwise; a node whose ledger would not persist refuses
  audits unless its policy opts in.
* Nodes report the most any of their users has spent over every audit their ledgers
  recorded, so the server's total includes a run that died.
* A run's ``status.json`` is written before any work, records each release before it is sent,
  says ``failed`` when the ServerApp raised, and an output folder holding an earlier run is
  never written over.
* FPFL refuses, or warns, when one lost node would lose every round.

The faults are injected with the real handlers and real Flower simulations; a monkeypatched
method stands in only for the fault itself (a crash).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedparity.clients.ldp import LEDGER_UNUSABLE_REPLY, LocalUsers, ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import PolicyRefusal
from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.mechanisms.privacy.basic_ledger import ledger_marker
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.mechanisms.protocol import EPSILON_SPENT_KEY, METRICS_KEY
from fedparity.server.api import run_simulation_job
from fedparity.server.app import run_job
from fedparity.server.cli import main
from fedparity.server.run_record import (
    STATUS_FILE,
    RunRecord,
    read_status,
    resolve_output_dir,
)
from fedparity.strategies.ldp_audit import LdpGapAudit
from tests.support.fpfl_nodes import SMALL_FPFL

pytestmark = pytest.mark.usefixtures("task_identity")

MECHANISM = RandomizedResponseMechanism(1.0, 1.0)


@contextmanager
def node_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Capture what the node logs (Flower's logger does not propagate to the root)."""
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        flwr_logger.removeHandler(caplog.handler)


def _users(num_users: int) -> LocalUsers:
    rng = np.random.default_rng(4)
    return LocalUsers(rng.integers(0, 2, size=num_users), rng.uniform(size=num_users))


def _audit(node_id: int = 3) -> Message:
    arrays = ArrayRecord({"w": Array(np.zeros(1))})
    return LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon).configure_audit(arrays, [node_id])[0]


def _context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=3, node_config=node_config, state=RecordDict(), run_config={})


# --- the node's ledger ---------------------------------------------------------------------


def test_a_deleted_ledger_stops_the_audits_instead_of_restarting_at_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The fault of the trial: with ledger-dir set, a deleted ledger file was recreated at zero
    (users at 7 epsilon against a budget of 5). Now the marker the ledger left beside itself
    tells the node the ledger was lost; only the operator (``fedparity ledger reset``, which
    removes the marker and records the reset in the node's ledger registry) can accept that
    the users start again at zero."""
    handler = ldp_audit_handler(lambda *_: _users(20), num_groups=2)
    config = {"ledger-dir": str(tmp_path), "user-epsilon-budget": 5.0}
    handler(_audit(), _context(config))
    ledger = tmp_path / "user-ledger.json"
    assert UserLedger.load(ledger, 20).epsilon_spent().max() == pytest.approx(MECHANISM.epsilon)
    assert ledger_marker(ledger).is_file()

    ledger.unlink()  # the fault: the file is gone
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        handler(_audit(), _context(config))
    # the server reads a fixed sentence; the node's log names the file and the recovery
    message = caplog.text
    assert str(ledger) in message and "Restore it from a backup" in message
    assert str(ledger_marker(ledger)) in message  # how the operator accepts a restart
    assert not ledger.exists()  # nothing was recreated, nothing was released

    assert main(["ledger", "reset", str(ledger)]) == 0  # the operator says so
    assert not ledger_marker(ledger).exists()
    reply = handler(_audit(), _context(config))
    assert reply.content.array_records["reports"]["groups"].numpy().size == 20


@pytest.mark.parametrize(
    "damage",
    [b"", b"PK\x03\x04 truncated", b"not a ledger at all"],
    ids=["empty", "truncated-zip", "garbage"],
)
def test_a_damaged_ledger_names_the_file_and_the_recovery(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    handler = ldp_audit_handler(lambda *_: _users(20), num_groups=2)
    config = {"ledger-dir": str(tmp_path)}
    handler(_audit(), _context(config))
    ledger = tmp_path / "user-ledger.json"
    ledger.write_bytes(damage)
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        handler(_audit(), _context(config))
    assert str(ledger) in caplog.text and "restore it from a backup" in caplog.text
    assert ledger.read_bytes() == damage  # left for the operator, never reset


def test_a_node_without_a_persistent_ledger_refuses_unless_its_policy_opts_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside simulation, a ledger that would live only for the run (a custom ledger_path
    returning None) would forget every user's spending after it: refused, unless the node's
    policy says allow-ephemeral-ledger, and then logged at every audit."""
    handler = ldp_audit_handler(
        lambda *_: _users(20), num_groups=2, ledger_path=lambda context: None
    )
    with pytest.raises(PolicyRefusal, match="persistent privacy ledger is required"):
        handler(_audit(), _context({}))
    with node_log(caplog):
        reply = handler(_audit(), _context({"allow-ephemeral-ledger": True}))
    assert reply.content.array_records["reports"]["groups"].numpy().size == 20
    assert "lives only as long as the run" in caplog.text


def test_nodes_report_what_their_users_spent_over_every_run(tmp_path: Path) -> None:
    """Each reply carries the most any user has spent over every audit its ledger recorded,
    so a server reports a total that includes runs it does not know of (one that died)."""
    handler = ldp_audit_handler(lambda *_: _users(20), num_groups=2)
    config = {"ledger-dir": str(tmp_path)}
    spent = []
    for _ in range(3):  # three runs, each a fresh context: only the ledger file remembers
        reply = handler(_audit(), _context(config))
        spent.append(reply.content.metric_records[METRICS_KEY][EPSILON_SPENT_KEY])
    assert spent == pytest.approx([MECHANISM.epsilon * k for k in (1, 2, 3)])
    outcome = LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon).aggregate_audit([3], [reply])
    assert outcome.epsilon_spent_max == pytest.approx(3 * MECHANISM.epsilon)
    # a malformed value rejects the reply rather than corrupting the total
    reply.content.metric_records[METRICS_KEY][EPSILON_SPENT_KEY] = -1.0
    outcome = LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon).aggregate_audit([3], [reply])
    assert outcome.accepted_nodes == 0 and EPSILON_SPENT_KEY in outcome.rejected[0].reason


# --- the run's status file -------------------------------------------------------------------


def test_a_used_output_dir_is_never_written_over(tmp_path: Path) -> None:
    """Rerunning into an output-dir that holds a run (results, status, privacy ledger or
    checkpoint) is refused before any work: run_job never reaches the grid (None here)."""
    for name in ("results.json", "privacy-ledger.json", STATUS_FILE, "checkpoint.npz"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_text("{}")
        for task in ("ldp-audit", "fedevalfair", "fpfl"):
            with pytest.raises(ConfigError, match=f"output-dir {folder} already holds a run"):
                run_job(None, {"task": task, "output-dir": str(folder)})  # type: ignore[arg-type]
        assert (folder / name).read_text() == "{}"
    # an FPFL run that resumes continues its folder's record
    folder = tmp_path / "fpfl"
    config = RunConfig.from_mapping({"task": "fpfl", "output-dir": str(folder)})
    first = RunRecord.open(config, folder)
    first.add_release(what="round 1", kind="fpfl-round")
    resumed = RunRecord.open(config, folder, resume=True)
    assert resumed.payload["attempts"] == 2 and resumed.payload["previous_status"] == "running"
    assert [item["what"] for item in resumed.payload["releases"]] == ["round 1"]


def test_default_output_dirs_never_collide(isolated_home: Path) -> None:
    config = RunConfig.from_mapping({})
    first = resolve_output_dir(config)
    first.mkdir(parents=True)
    second = resolve_output_dir(config)
    assert second != first and not second.exists()


@pytest.mark.slow
def test_a_failed_ldp_run_says_what_it_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault: the ServerApp dies during the first audit, after the nodes were asked (and
    charged). status.json was written before the audit was sent, so it says what was
    released; the run is recorded as failed with the error; there is no results.json."""
    seen: list[dict] = []

    def crash(self: LdpGapAudit, grid, arrays, **kwargs):  # noqa: ANN001, ANN202
        seen.append(read_status(tmp_path) or {})
        raise RuntimeError("injected crash during the audit")

    monkeypatch.setattr(LdpGapAudit, "start", crash)  # the fault only
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever Flower wraps it in
        run_simulation_job(
            {"output-dir": str(tmp_path), "users-per-node": 50, "num-server-rounds": 1},
            num_supernodes=2,
        )
    assert seen and seen[0]["status"] == "running"
    assert [item["kind"] for item in seen[0]["releases"]] == ["ldp-audit"]  # before the send
    status = read_status(tmp_path)
    assert status is not None and status["status"] == "failed"
    assert "injected crash during the audit" in status["error"]
    assert status["releases"][0]["epsilon"] == pytest.approx(0.5, abs=1e-9)
    assert not (tmp_path / "results.json").exists() and status["results_file"] is None
    # and the folder is not reused by the next run
    with pytest.raises(ConfigError, match="already holds a run"):
        run_job(None, {"output-dir": str(tmp_path)})  # type: ignore[arg-type]


# --- FPFL with no room for a dropout -------------------------------------------------------


@pytest.mark.slow
def test_fpfl_that_one_dropout_would_ruin_warns_or_refuses(tmp_path: Path) -> None:
    """3 nodes at fpfl-dropout-tolerance 0.2: n_min = ceil(0.8 * 3) = 3, so one lost node
    loses every round. By default the run warns and says so in results.json; with
    fpfl-require-dropout-tolerance it refuses before any round is released."""
    results = run_simulation_job(
        {**SMALL_FPFL, "output-dir": str(tmp_path / "warn")}, num_supernodes=3
    )
    assert any(
        "single lost node would lose every round" in c for c in results["privacy"]["caveats"]
    )
    assert results["status"] == "completed" and results["rounds_lost"] == 0
    assert read_status(tmp_path / "warn")["status"] == "completed"  # type: ignore[index]

    with pytest.raises(Exception):  # noqa: B017, PT011
        run_simulation_job(
            {
                **SMALL_FPFL,
                "output-dir": str(tmp_path / "refuse"),
                "fpfl-require-dropout-tolerance": True,
            },
            num_supernodes=3,
        )
    status = json.loads((tmp_path / "refuse" / STATUS_FILE).read_text())
    assert status["status"] == "failed" and "fpfl-require-dropout-tolerance" in status["error"]
    assert not (tmp_path / "refuse" / "privacy-ledger.json").exists()  # nothing released
