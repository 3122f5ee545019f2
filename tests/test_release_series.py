"""The library's release series (strategies.release_series): several LDP audits (or FedEvalFair
tests) in one loop with observer hooks, durable by default. Driven over real LDP nodes in this
process (the library's ``ldp_audit_handler`` with real per-user ledgers behind an in-process
grid); the only test doubles are the crash and the observers that record or stop.

Before, a library user who ran several ``LdpGapAudit``s kept no record of what was released:
only the built-in job wrote each audit's epsilon to ``status.json`` before sending it, so a
user's crashed series left nothing saying which audits the nodes had already been charged for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict

from fedparity.clients import LocalUsers, ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.strategies import (
    DurableReleases,
    LdpAuditSeries,
    LdpGapAudit,
    Release,
    ReleaseLog,
    SeriesObserver,
    SeriesResult,
    StopAfterFailures,
)
from fedparity.strategies.release_series import RELEASES_FILE

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = [1, 2, 3]
USERS = 30
BUDGETS = [0.5, 1.0, 2.0]


class Crash(RuntimeError):
    """The server process dying (injected)."""


class LdpNodesGrid:
    """A Flower grid whose nodes are the library's LDP handlers in this process, each with its
    own per-user ledger file under ``ledgers``; every audit pushed notes how many releases the
    log in ``folder`` held at that moment, and the grid crashes after audit ``crash_after``
    (counted from 1) was handed to the nodes."""

    def __init__(self, ledgers: Path, folder: Path | None = None, crash_after: int = 0) -> None:
        self.folder, self.crash_after = folder, crash_after
        self.recorded_when_sent: list[int] = []
        self.audits = 0
        self.replies: dict[str, Message] = {}
        policy = NodePrivacyPolicy()
        rng = np.random.default_rng(7)
        self.groups = {node: rng.integers(0, 2, USERS) for node in NODES}
        self.handler = ldp_audit_handler(
            self._users,
            num_groups=2,
            policy=policy,
            ledger_path=lambda context: ledgers / f"node-{context.node_id}.json",
        )
        self.contexts = {node: Context(1, node, {}, RecordDict(), {}) for node in NODES}

    def _users(self, arrays: ArrayRecord, metric: str, context: Context) -> LocalUsers:
        groups = self.groups[context.node_id]
        return LocalUsers(groups, np.full(USERS, 0.5), user_ids=np.arange(USERS))

    def get_node_ids(self) -> list[int]:
        return list(NODES)

    def push_messages(self, messages: list[Message]) -> list[str]:
        self.audits += 1
        recorded = -1
        if self.folder is not None and (self.folder / RELEASES_FILE).is_file():
            recorded = len(json.loads((self.folder / RELEASES_FILE).read_text())["releases"])
        self.recorded_when_sent.append(recorded)
        ids = []
        for number, message in enumerate(messages):
            message_id = f"{self.audits}-{number}"
            message.metadata.__dict__["_message_id"] = message_id
            node = int(message.metadata.dst_node_id)
            try:
                reply = self.handler(message, self.contexts[node])
            except (NodeRefusal, PolicyRefusal) as refusal:
                reply = Message(Error(code=0, reason=str(refusal)), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            self.replies[message_id] = reply
            ids.append(message_id)
        if self.crash_after and self.audits == self.crash_after:
            raise Crash(f"the server died after sending audit {self.crash_after}")
        return ids

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def model() -> ArrayRecord:
    return ArrayRecord({"weights": Array(np.zeros(3))})


def series(budgets: Sequence[float] = BUDGETS) -> LdpAuditSeries:
    return LdpAuditSeries(
        [
            LdpGapAudit.for_budget("R", budget, num_groups=2, audit_id=f"a{budget:g}")
            for budget in budgets
        ]
    )


def charged(ledgers: Path, node: int) -> int:
    """The releases node ``node``'s ledger recorded."""
    return len(UserLedger.load(ledgers / f"node-{node}.json").releases)


def test_each_audit_is_on_disk_before_it_is_sent(tmp_path: Path) -> None:
    """The default observer writes ``releases.json`` durably before each audit is pushed:
    when audit k reaches the grid, the log already holds k releases."""
    folder = tmp_path / "series"
    grid = LdpNodesGrid(tmp_path / "ledgers", folder)
    result = series().start(grid, model(), folder=folder)  # type: ignore[arg-type]
    assert grid.recorded_when_sent == [1, 2, 3]
    assert len(result.outcomes) == 3 and not result.stop_reason
    log = json.loads((folder / RELEASES_FILE).read_text())
    epsilons = [audit.mechanism.epsilon for audit in series().audits]
    assert [item["epsilon"] for item in log["releases"]] == epsilons
    assert [item["nodes"] for item in log["releases"]] == [3, 3, 3]
    assert {item["kind"] for item in log["releases"]} == {"ldp-audit"}
    assert result.epsilon_spent == pytest.approx(sum(epsilons))
    assert log["epsilon_recorded"] == pytest.approx(sum(epsilons))
    assert all(o.accepted_nodes == 3 and o.reports.num_reports == 90 for o in result.outcomes)


def test_a_crashed_series_still_says_what_it_released_and_a_rerun_counts_on(
    tmp_path: Path,
) -> None:
    """The server dies after audit 2 was handed to the nodes (who charged their users): the
    log says 2 releases. A series started again on the same folder continues the count, so
    the log covers every audit ever sent, as the nodes' ledgers do."""
    folder, ledgers = tmp_path / "series", tmp_path / "ledgers"
    with pytest.raises(Crash):
        series().start(LdpNodesGrid(ledgers, folder, crash_after=2), model(), folder=folder)  # type: ignore[arg-type]
    assert len(ReleaseLog(folder).releases) == 2
    assert all(charged(ledgers, node) == 2 for node in NODES)
    grid = LdpNodesGrid(ledgers, folder)
    series([0.5]).start(grid, model(), folder=folder)  # type: ignore[arg-type]
    assert grid.recorded_when_sent == [3]
    resumed = ReleaseLog(folder)
    assert len(resumed.releases) == 3 == charged(ledgers, 1)
    epsilon = series([0.5]).audits[0].mechanism.epsilon
    first_two = [audit.mechanism.epsilon for audit in series().audits[:2]]
    assert resumed.epsilon_recorded == pytest.approx(sum(first_two) + epsilon)


def test_a_damaged_log_is_refused_not_written_over(tmp_path: Path) -> None:
    folder = tmp_path / "series"
    folder.mkdir()
    (folder / RELEASES_FILE).write_text("{not json")
    grid = LdpNodesGrid(tmp_path / "ledgers", folder)
    with pytest.raises(ValueError, match="damaged"):
        series().start(grid, model(), folder=folder)  # type: ignore[arg-type]
    assert grid.audits == 0 and (folder / RELEASES_FILE).read_text() == "{not json"


class Recorder(SeriesObserver):
    def __init__(self, name: str, calls: list[str], stop_before: int = -1) -> None:
        self.name, self.calls, self.stop_before = name, calls, stop_before

    def begin(self, releases: Sequence[Release]) -> None:
        self.calls.append(f"{self.name}:begin:{len(releases)}")

    def should_stop(self, index: int, outcomes: Sequence[Any]) -> str:
        self.calls.append(f"{self.name}:should_stop:{index}")
        return "enough" if index == self.stop_before else ""

    def before_release(self, index: int, release: Release) -> None:
        self.calls.append(f"{self.name}:before:{index}")

    def after_release(self, index: int, release: Release, outcome: Any) -> None:
        self.calls.append(f"{self.name}:after:{index}")

    def end(self, result: SeriesResult) -> None:
        self.calls.append(f"{self.name}:end:{len(result.outcomes)}")


def test_observers_are_called_in_order_and_a_stop_sends_nothing_more(tmp_path: Path) -> None:
    calls: list[str] = []
    grid = LdpNodesGrid(tmp_path / "ledgers")
    result = series().start(
        grid,  # type: ignore[arg-type]
        model(),
        observers=[Recorder("a", calls), Recorder("b", calls, stop_before=2)],
    )
    per_release = [
        f"{who}:{hook}:{i}" for i in (0, 1) for hook in ("should_stop", "before", "after")
        for who in ("a", "b")
    ]  # fmt: skip
    assert calls == [
        "a:begin:3",
        "b:begin:3",
        *per_release,
        "a:should_stop:2",
        "b:should_stop:2",
        "a:end:2",
        "b:end:2",
    ]
    assert result.stop_reason == "enough" and grid.audits == 2
    assert not list(tmp_path.glob("**/" + RELEASES_FILE))  # observers given: no default log


def test_stop_after_failures_stops_before_spending_more(tmp_path: Path) -> None:
    """Every node refuses an audit above its policy's ldp-max-epsilon (here: all of them at
    a budget of 9 > 8), so no estimate comes out; the series stops after the first instead of
    asking again."""
    grid = LdpNodesGrid(tmp_path / "ledgers")
    result = series([9.0, 9.0, 9.0]).start(
        grid,  # type: ignore[arg-type]
        model(),
        observers=[DurableReleases(tmp_path / "log"), StopAfterFailures(1)],
    )
    assert grid.audits == 1 and len(result.outcomes) == 1
    assert "gave no result" in result.stop_reason
    assert len(ReleaseLog(tmp_path / "log").releases) == 1


def test_folder_and_observers_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        series().start(
            LdpNodesGrid(tmp_path / "ledgers"),  # type: ignore[arg-type]
            model(),
            folder=tmp_path,
            observers=[],
        )
