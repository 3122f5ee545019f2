"""Privacy spent is never forgotten when a node's ledger folder vanishes or moves (issue 32,
items 6 and 8; the multi-process fault trial of 2026-11-26).

The ``.created`` marker beside a ledger tells a lost file from one never made, but deleting the
whole ledger folder (file and marker) or pointing ``ledger-dir`` elsewhere started the node's
users at zero with no log line. A node now records the ledgers it creates in a registry kept
apart from them (:class:`~fedparity.mechanisms.privacy.user_ledger.LedgerRegistry`); a ledger it
created that is gone, or (with the node's own ``ledger-registry``) a new ledger while it holds
one elsewhere, is refused with a fixed sentence to the server and one log line naming the
files and ``fedparity ledger reset``, the operator's explicit acknowledgement.

Driven through the real LDP audit handler and real ledger files; a mock stands only for the
fault of an unwritable folder (the tests run as root, whom permission bits do not stop).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedparity.clients.ldp import LEDGER_UNUSABLE_REPLY, LocalUsers, ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.mechanisms.privacy import user_ledger as user_ledger_module
from fedparity.mechanisms.privacy.basic_ledger import ledger_marker
from fedparity.mechanisms.privacy.user_ledger import LedgerRegistry, UserLedger
from fedparity.server.cli import main
from fedparity.strategies.ldp_audit import LdpGapAudit

pytestmark = pytest.mark.usefixtures("task_identity")

MECHANISM = RandomizedResponseMechanism(1.0, 1.0)
USERS = 20


@contextmanager
def node_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Capture what the node logs (Flower's logger does not propagate to the root)."""
    flwr_logger = logging.getLogger("flwr")
    caplog.clear()
    caplog.set_level(logging.INFO)
    if caplog.handler not in flwr_logger.handlers:
        flwr_logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        flwr_logger.removeHandler(caplog.handler)


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The node's log lines at ``level`` (each once: Flower's logger may also propagate)."""
    return list(dict.fromkeys(r.getMessage() for r in caplog.records if r.levelno == level))


def _handler():  # noqa: ANN202 - Flower's handler type
    rng = np.random.default_rng(4)
    users = LocalUsers(rng.integers(0, 2, size=USERS), rng.uniform(size=USERS))
    return ldp_audit_handler(lambda *_: users, num_groups=2)


def _audit() -> Message:
    arrays = ArrayRecord({"w": Array(np.zeros(1))})
    return LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon).configure_audit(arrays, [3])[0]


def _context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=3, node_config=node_config, state=RecordDict(), run_config={})


def _reports(reply: Message) -> int:
    return reply.content.array_records["reports"]["groups"].numpy().size


def test_a_deleted_ledger_folder_is_refused_naming_the_file_and_the_recovery(
    tmp_path: Path, isolated_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: with the folder (ledger file and ``.created`` marker) deleted, the next audit
    answered with all 20 users at zero and logged nothing. Now the account's registry, outside
    the folder, says the node created that ledger: refused before any release."""
    folder = tmp_path / "ledgers"
    config = {"ledger-dir": str(folder), "user-epsilon-budget": 5.0}
    handler = _handler()
    assert _reports(handler(_audit(), _context(config))) == USERS
    ledger = folder / "user-ledger.json"
    registry = isolated_home / ".fedparity" / "ledger-registry.json"
    assert str(ledger) in json.loads(registry.read_text())["ledgers"]

    shutil.rmtree(folder)  # the fault: the whole folder is gone
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        handler(_audit(), _context(config))
    [line] = _lines(caplog, logging.ERROR)
    assert str(ledger) in line and str(registry) in line and "whole folder" in line
    assert f"fedparity ledger reset {ledger} --registry {registry}" in line
    assert not folder.exists()  # nothing recreated, nothing released


def test_a_changed_ledger_dir_is_refused_with_the_nodes_own_registry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a changed or mistyped ledger-dir started a new ledger at zero, the old one
    ignored. A node given its own registry (node config ``ledger-registry``) now refuses a new
    ledger while it holds one elsewhere, and the log names both and the way back."""
    registry = tmp_path / "node-state" / "ledger-registry.json"
    old, new = tmp_path / "ledgers", tmp_path / "ledger"  # a typo
    handler = _handler()
    assert (
        _reports(
            handler(_audit(), _context({"ledger-dir": str(old), "ledger-registry": str(registry)}))
        )
        == USERS
    )
    mistyped = {"ledger-dir": str(new), "ledger-registry": str(registry)}
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        handler(_audit(), _context(mistyped))
    [line] = _lines(caplog, logging.ERROR)
    assert f"ledger-dir points to {new}" in line and str(old / "user-ledger.json") in line
    assert str(registry) in line and "fedparity ledger reset" in line
    assert not (new / "user-ledger.json").exists()
    # the way back: the old ledger-dir answers and counts on from what was spent
    reply = handler(_audit(), _context({"ledger-dir": str(old), "ledger-registry": str(registry)}))
    assert _reports(reply) == USERS
    spent = UserLedger.load(old / "user-ledger.json").epsilon_spent()
    assert spent.max() == pytest.approx(2 * MECHANISM.epsilon)


def test_the_acknowledged_reset_is_accepted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``fedparity ledger reset`` is the operator's explicit action: after it the node starts
    a new ledger at zero and says so with the date of the reset. (Before there was nothing to
    acknowledge: the node restarted at zero by itself.)"""
    registry = tmp_path / "state" / "ledger-registry.json"
    folder = tmp_path / "ledgers"
    config = {"ledger-dir": str(folder), "ledger-registry": str(registry)}
    handler = _handler()
    handler(_audit(), _context(config))
    ledger = folder / "user-ledger.json"
    shutil.rmtree(folder)
    with pytest.raises(NodeRefusal):
        handler(_audit(), _context(config))
    out = io.StringIO()
    assert main(["ledger", "reset", str(ledger), "--registry", str(registry)], out=out) == 0
    assert f"ledger {ledger}" in out.getvalue() and "start again at zero" in out.getvalue()
    with node_log(caplog):
        assert _reports(handler(_audit(), _context(config))) == USERS
    [line] = _lines(caplog, logging.WARNING)
    assert f"new ledger {ledger}" in line and "accepted on" in line and str(registry) in line
    resets = json.loads(registry.read_text())["resets"]
    assert [reset["path"] for reset in resets] == [str(ledger)]


def test_a_new_ledger_under_the_shared_registry_is_logged_not_silent(
    tmp_path: Path, isolated_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its own registry a node shares the account's with the account's other nodes, so
    a second folder may be a second node: allowed, but never silently. Before: no line."""
    handler = _handler()
    handler(_audit(), _context({"ledger-dir": str(tmp_path / "a")}))
    with node_log(caplog):
        handler(_audit(), _context({"ledger-dir": str(tmp_path / "b")}))
    [line] = _lines(caplog, logging.WARNING)
    assert f"new ledger {tmp_path / 'b' / 'user-ledger.json'}" in line
    assert str(tmp_path / "a" / "user-ledger.json") in line and "ledger-registry" in line


def test_the_damaged_ledger_recovery_names_the_marker_and_the_reset_clears_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the recovery said "delete the file yourself", and the ``.created`` marker left
    beside it then kept the node refusing as "lost". Now the text names the marker and the
    command, which keeps the damaged file aside, removes the marker and unblocks the node."""
    config = {"ledger-dir": str(tmp_path), "ledger-registry": str(tmp_path / "r" / "reg.json")}
    handler = _handler()
    handler(_audit(), _context(config))
    ledger = tmp_path / "user-ledger.json"
    ledger.write_bytes(b"garbage")
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        handler(_audit(), _context(config))
    assert ".created marker" in caplog.text and "fedparity ledger reset" in caplog.text
    registry = config["ledger-registry"]
    assert main(["ledger", "reset", str(ledger), "--registry", registry]) == 0
    assert [p.name.split("-")[0] for p in tmp_path.glob("user-ledger.json.damaged-*")] == ["user"]
    assert not ledger_marker(ledger).exists()
    assert _reports(handler(_audit(), _context(config))) == USERS


def test_an_unwritable_ledger_folder_is_named_before_any_release(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the audit was answered up to the save, which failed with
    ``PermissionError(13, 'Permission denied')`` naming no file. Now the folder is checked
    when the ledger is opened: a fixed refusal, and a log line naming the ledger file."""
    folder = tmp_path / "ledgers"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(  # the fault: a read-only folder (root ignores permission bits)
        user_ledger_module.os,
        "access",
        lambda path, mode: False if Path(path) == folder else real_access(path, mode),
    )
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        _handler()(_audit(), _context({"ledger-dir": str(folder)}))
    assert f"ledger {folder / 'user-ledger.json'} cannot be written" in caplog.text
    assert "PermissionError(13" not in caplog.text


def test_a_failed_save_names_the_ledger_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write itself failing (a full or read-only disk) after the checks: the node's log
    names the ledger file (before: ``PermissionError(13, ...)``), the server reads the fixed
    ledger sentence (before: the generic internal-error one), nothing is released."""

    real_write = user_ledger_module.write_file_atomic

    def refuse(path: Path, data: bytes, mode: int) -> None:
        if path.name != "user-ledger.json":  # the registry beside it is written
            return real_write(path, data, mode)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(user_ledger_module, "write_file_atomic", refuse)
    folder = tmp_path / "ledgers"
    with node_log(caplog), pytest.raises(NodeRefusal, match=re.escape(LEDGER_UNUSABLE_REPLY)):
        _handler()(_audit(), _context({"ledger-dir": str(folder)}))
    assert f"ledger {folder / 'user-ledger.json'} cannot be written" in caplog.text
    assert "PermissionError(13" not in caplog.text


def test_the_registry_is_refused_when_damaged(tmp_path: Path) -> None:
    """A damaged registry is never read as empty (which would forget what it records)."""
    path = tmp_path / "reg.json"
    path.write_text("{not json")
    with pytest.raises(Exception, match=re.escape(f"ledger registry {path} cannot be read")):
        LedgerRegistry(path).check(tmp_path / "ledgers" / "user-ledger.json")


def _reply_as(reply: Message, node_id: int) -> Message:
    """``reply`` as the SuperLink delivers it: from ``node_id``, answering the audit sent there."""
    reply.metadata.__dict__["_src_node_id"] = node_id
    return reply


def test_the_server_reports_each_nodes_totals_and_its_new_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 32 item 6: the server reported only the maximum over the nodes, which hides a
    node whose users start at zero (a first run there, or a ledger lost and reset). Node 3 has
    audited twice, node 4's ledger is reset by its operator: the first audit after the reset
    is node 4's first release (``ledger-new``), reported by node beside the maximum."""
    registry = tmp_path / "state" / "ledger-registry.json"
    configs = {
        node: {
            "ledger-dir": str(tmp_path / f"ledgers-{node}"),
            "ledger-registry": f"{registry}{node}",
        }
        for node in (3, 4)
    }
    handler = _handler()
    audit = LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon)
    arrays = ArrayRecord({"w": Array(np.zeros(1))})

    def one_audit():  # noqa: ANN202
        messages = audit.configure_audit(arrays, [3, 4])
        replies = [
            _reply_as(handler(message, _context(configs[message.metadata.dst_node_id])), node)
            for message, node in zip(messages, (3, 4), strict=True)
        ]
        return audit.aggregate_audit([3, 4], replies)

    first = one_audit()
    assert first.new_ledger_nodes == (3, 4)  # both ledgers start with this audit
    second = one_audit()
    assert second.new_ledger_nodes == ()
    shutil.rmtree(tmp_path / "ledgers-4")
    ledger = tmp_path / "ledgers-4" / "user-ledger.json"
    assert (
        main(["ledger", "reset", str(ledger), "--registry", f"{registry}4"], out=io.StringIO()) == 0
    )
    third = one_audit()
    assert third.new_ledger_nodes == (4,)
    spent = {node: totals.epsilon for node, totals in third.ledger_totals_by_node.items()}
    assert spent[3] == pytest.approx(3 * MECHANISM.epsilon, abs=1e-3)  # PLD of 3 pure releases
    assert spent[4] == pytest.approx(MECHANISM.epsilon, abs=1e-3)
    assert third.ledger_totals is not None and third.ledger_totals.epsilon == spent[3]
    record = third.to_dict()
    assert record["new_ledger_nodes"] == [4]
    assert set(record["ledger_totals_by_node"]) == {"3", "4"}
    assert "new privacy ledger on node(s) 4" in third.summary()


def test_a_malformed_new_ledger_flag_rejects_the_reply(tmp_path: Path) -> None:
    audit = LdpGapAudit(MECHANISM, budget=MECHANISM.epsilon)
    (message,) = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [3])
    reply = _reply_as(_handler()(message, _context({"ledger-dir": str(tmp_path)})), 3)
    reply.content.metric_records["metrics"]["ledger-new"] = 2
    outcome = audit.aggregate_audit([3], [reply])
    assert outcome.accepted_nodes == 0
    assert "ledger-new must be 0 or 1" in outcome.rejected[0].reason


def test_the_jobs_sentence_gives_the_range_over_the_nodes_and_the_new_ledgers() -> None:
    from fedparity.server.report import ledger_totals_text
    from fedparity.strategies.replies import LedgerTotals

    totals = {
        node: LedgerTotals(epsilon, 1e-6, epsilon, 0.0).to_dict()
        for node, epsilon in (("3", 2.5), ("4", 0.5), ("7", 1.0))
    }
    text = ledger_totals_text(totals["3"], totals, [4])
    assert "epsilon 2.5 at delta 1e-06" in text
    assert "by node from 0.5 (node 4) to 2.5 (node 3) over 3 nodes" in text
    assert "New privacy ledger on node(s) 4: their users' totals start with this run" in text
    assert ledger_totals_text(totals["3"]) == LedgerTotals(2.5, 1e-6, 2.5, 0.0).sentence()
    same = {node: totals["3"] for node in ("3", "4")}
    assert ledger_totals_text(totals["3"], same).endswith("; the same on each of the 2 nodes")
