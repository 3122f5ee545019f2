"""Bookkeeping of the replies a strategy receives, shared by every strategy: who a reply is
from, which nodes did not reply, the replies it could not use, and the privacy-ledger totals
the nodes report."""

from __future__ import annotations

import logging
import math
import numbers
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from flwr.app import ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms.formatting import strip_ansi
from ..mechanisms.ldp.node_influence import AUTO_CAP, NODE_SIZE_FACTOR, UserCap, resolve_user_cap
from ..mechanisms.privacy.user_ledger import NEIGHBOURING
from ..mechanisms.protocol import (
    EPSILON_SPENT_BASIC_DELTA_KEY,
    EPSILON_SPENT_BASIC_KEY,
    EPSILON_SPENT_DELTA_KEY,
    EPSILON_SPENT_KEY,
    LEDGER_NEW_KEY,
    SESSION_KEY,
)
from ..mechanisms.protocol.object_pulls import POLL_COST_FACTOR, PromptObjectPulls, poll_pause
from ..mechanisms.protocol.refusal_log import install_refusal_filter

__all__ = [
    "CAP_SETTING",
    "ExcludedNode",
    "LedgerTotals",
    "NodeCap",
    "NodeLedgerReports",
    "merge_ledger_totals",
    "MAX_REASON_LENGTH",
    "POLL_FIRST_INTERVAL",
    "POLL_LAG_FRACTION",
    "POLL_MAX_INTERVAL",
    "RejectedReply",
    "SortedReplies",
    "attribute_replies",
    "cap_lines",
    "exclude_over_cap",
    "exchange_lines",
    "ledger_fields",
    "poll_interval",
    "prompt_object_pulls",
    "refuse_over_cap",
    "send_and_receive",
    "session_records",
    "short_reason",
    "sort_replies",
]

# A node's refusal is one log line, not Flower's traceback (the ServerApp's process, which in
# Flower's simulation logs its nodes' errors).
install_refusal_filter()

MAX_REASON_LENGTH = 240


#: Flower's error reason for what a ClientApp raised: ``<class 'X'>:<'message'>``.
_FLOWER_REASON = re.compile(r"^<class '[^']*'>:<'(?P<message>.*)'>$", re.S)
#: How the simulation engine wraps a ClientApp's exception message.
_SIMULATION_WRAPPER = "occurred. Message: "


def short_reason(text: str | None) -> str:
    """A client's error text for logs and results: the exception's message out of Flower's
    wrapping (``<class '...'>:<'...'>``, and the simulation engine's "Exception ... occurred.
    Message: ..."), no colour codes, one line, and when still longer than
    :data:`MAX_REASON_LENGTH` its end (where Python puts the exception message of a long remote
    traceback). A node's fixed refusal sentence arrives whole."""
    raw = strip_ansi(str(text)).strip()
    wrapped = _FLOWER_REASON.match(raw)
    if wrapped is not None:
        raw = wrapped["message"]
    if _SIMULATION_WRAPPER in raw:
        raw = raw.rsplit(_SIMULATION_WRAPPER, 1)[1]
    flat = " ".join(raw.split())
    if len(flat) <= MAX_REASON_LENGTH:
        return flat
    return "..." + flat[-MAX_REASON_LENGTH:]


@dataclass(frozen=True)
class RejectedReply:
    """A reply that was not used, and why."""

    node_id: int
    reason: str


#: What an operator changes to let a larger node take part.
CAP_SETTING = "max-users-per-node in the run config (max_users_per_node of the strategy)"


@dataclass(frozen=True)
class NodeCap:
    """The most users one node may bring to an exchange, and how it was set
    (:func:`~fedparity.mechanisms.ldp.node_influence.resolve_user_cap`): a node that describes
    more is not asked, a reply that accounts for more is refused.

    Attributes
    ----------
    users : int or None
        The cap (None: no cap).
    automatic : bool
        Derived from the nodes' sizes (``"auto"``) rather than set.
    """

    users: int | None
    automatic: bool = False

    @classmethod
    def resolve(cls, setting: UserCap, sizes: Iterable[int]) -> NodeCap:
        """The cap ``setting`` (``"auto"``, an integer or None) gives over the nodes'
        ``sizes``."""
        return cls(resolve_user_cap(setting, sizes), setting == AUTO_CAP)

    @property
    def rule(self) -> str:
        """How the cap was set, in words."""
        if self.automatic:
            return f"{NODE_SIZE_FACTOR} x the lower median of the sizes the nodes describe"
        return "set by max-users-per-node"

    def exceeded_by(self, users: int) -> bool:
        """``users`` is over the cap."""
        return self.users is not None and users > self.users

    def reason(self, users: int, claim: str = "it describes") -> str:
        """One line: the node's ``users``, the cap, how it was set and what to change."""
        return (
            f"{claim} {users} users, more than the per-node cap of {self.users} ({self.rule}); "
            f"if its size is real, raise {CAP_SETTING}"
        )


@dataclass(frozen=True)
class ExcludedNode:
    """A node left out of an exchange before it was asked (its users were not charged): it
    describes more users than the per-node cap (:class:`NodeCap`)."""

    node_id: int
    claimed_users: int
    cap: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "claimed_users": self.claimed_users,
            "cap": self.cap,
            "reason": self.reason,
        }


def exclude_over_cap(
    node_ids: Iterable[int], users_by_node: Mapping[int, int], cap: NodeCap, what: str
) -> tuple[list[int], tuple[ExcludedNode, ...]]:
    """(the nodes to ask, the nodes left out): a node whose described size is over ``cap``
    is left out, with one warning line naming it, its size, the cap and what to change."""
    asked: list[int] = []
    excluded: list[ExcludedNode] = []
    for node in node_ids:
        users = users_by_node.get(node)
        if users is not None and cap.users is not None and cap.exceeded_by(users):
            item = ExcludedNode(node, users, cap.users, cap.reason(users))
            log(logging.WARNING, "%s: node %d left out: %s", what, node, item.reason)
            excluded.append(item)
        else:
            asked.append(node)
    return asked, tuple(excluded)


def cap_lines(excluded: Sequence[ExcludedNode]) -> list[str]:
    """The lines an outcome's ``summary()`` gives on the nodes the per-node cap left out."""
    return [f"  node {item.node_id} left out: {item.reason}" for item in excluded]


@dataclass(frozen=True)
class LedgerTotals:
    """What nodes report of their per-user privacy ledgers: the most any of their users has
    spent over every release the ledgers recorded (``epsilon`` at ``delta``: the PLD
    accountant's total), and basic composition's ``basic_epsilon`` at ``basic_delta`` beside
    it, under the relation :data:`~fedparity.mechanisms.privacy.user_ledger.NEIGHBOURING`. Over
    several nodes: the largest of each (every user is then within both pairs)."""

    epsilon: float
    delta: float
    basic_epsilon: float
    basic_delta: float
    neighbouring: str = NEIGHBOURING

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> LedgerTotals | None:
        """A reply's totals (None if it sent none: a node with fewer users than its
        ``min-users-for-counts``); ``ValueError`` unless each is a finite number >= 0 (a
        delta < 1). A node of an older version that sends the epsilon alone is read with
        delta 0 and its epsilon as basic composition's (its ledger was pure-epsilon)."""
        if EPSILON_SPENT_KEY not in metrics:
            return None
        epsilon = _non_negative(metrics, EPSILON_SPENT_KEY)
        if EPSILON_SPENT_DELTA_KEY not in metrics:
            return cls(epsilon, 0.0, epsilon, 0.0)
        deltas = [
            _non_negative(metrics, key)
            for key in (EPSILON_SPENT_DELTA_KEY, EPSILON_SPENT_BASIC_DELTA_KEY)
        ]
        if any(delta >= 1 for delta in deltas):
            raise ValueError("a ledger's delta must be below 1")
        return cls(epsilon, deltas[0], _non_negative(metrics, EPSILON_SPENT_BASIC_KEY), deltas[1])

    def merge(self, other: LedgerTotals | None) -> LedgerTotals:
        """The totals that hold for the users of both."""
        if other is None:
            return self
        return LedgerTotals(
            max(self.epsilon, other.epsilon),
            max(self.delta, other.delta),
            max(self.basic_epsilon, other.basic_epsilon),
            max(self.basic_delta, other.basic_delta),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "basic_epsilon": self.basic_epsilon,
            "basic_delta": self.basic_delta,
            "neighbouring": self.neighbouring,
        }

    def sentence(self) -> str:
        """The line the jobs print and the reports show."""
        basic = f"basic composition {self.basic_epsilon:.4g}"
        if self.basic_delta > 0:
            basic += f" at delta {self.basic_delta:.3g}"
        return (
            "privacy spent per user over every release the nodes' ledgers recorded: epsilon "
            f"{self.epsilon:.4g} at delta {self.delta:.3g} (PLD; {basic}; {self.neighbouring})"
        )


def _non_negative(metrics: Mapping[str, Any], key: str) -> float:
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{key} must be a number >= 0, got {number:g}")
    return number


@dataclass
class NodeLedgerReports:
    """What each node reported of its per-user privacy ledger, node by node: its totals (the
    latest it sent) and whether a release created its ledger (``ledger-new``: its users'
    totals start there, which the maximum over the nodes would hide; a first run, or a
    ledger its operator reset)."""

    by_node: dict[int, LedgerTotals] = field(default_factory=dict)
    new_ledger_nodes: set[int] = field(default_factory=set)

    @staticmethod
    def read(metrics: Mapping[str, Any]) -> tuple[LedgerTotals | None, bool]:
        """A reply's totals (:meth:`LedgerTotals.from_metrics`) and its ``ledger-new`` flag;
        ``ValueError`` if either is malformed (the flag is 0 or 1, and only beside totals)."""
        totals = LedgerTotals.from_metrics(metrics)
        flag = metrics.get(LEDGER_NEW_KEY, 0)
        if isinstance(flag, bool) or flag not in (0, 1):
            raise ValueError(f"{LEDGER_NEW_KEY} must be 0 or 1, got {flag!r}")
        if flag and totals is None:
            raise ValueError(f"{LEDGER_NEW_KEY} without the ledger's totals")
        return totals, bool(flag)

    def record(self, node_id: int, totals: LedgerTotals | None, new: bool) -> None:
        """Keep one node's reply (read with :meth:`read`)."""
        if totals is not None:
            self.by_node[node_id] = totals
        if new:
            self.new_ledger_nodes.add(node_id)

    def update(self, later: NodeLedgerReports) -> None:
        """Add the reports of a later exchange: its totals replace a node's earlier ones."""
        self.by_node.update(later.by_node)
        self.new_ledger_nodes |= later.new_ledger_nodes

    def merged(self) -> LedgerTotals | None:
        """The totals that hold for every reporting node's users (None if none reported)."""
        return merge_ledger_totals(self.by_node.values())

    @classmethod
    def from_results(
        cls, by_node: Mapping[str, Mapping[str, Any]] | None, new_nodes: Iterable[int] | None
    ) -> NodeLedgerReports:
        """Read back :meth:`by_node_dict` and the new-ledger nodes of a results.json."""
        return cls(
            {int(node): LedgerTotals(**values) for node, values in (by_node or {}).items()},
            set(new_nodes or ()),
        )

    def by_node_dict(self) -> dict[str, dict[str, Any]]:
        """``{node id: totals}`` for results.json (node ids as strings, in order)."""
        return {str(node): self.by_node[node].to_dict() for node in sorted(self.by_node)}


def merge_ledger_totals(totals: Iterable[LedgerTotals | None]) -> LedgerTotals | None:
    """The totals over every node that reported some (None if none did)."""
    merged: LedgerTotals | None = None
    for item in totals:
        if item is not None:
            merged = item.merge(merged)
    return merged


def ledger_fields(totals: LedgerTotals | None, reports: NodeLedgerReports) -> dict[str, Any]:
    """The ledger part of an outcome's ``to_dict()`` (results.json): the totals over the
    accepted nodes, each node's, and the nodes whose ledger the exchange created."""
    return {
        "ledger_totals_reported_by_nodes": None if totals is None else totals.to_dict(),
        "ledger_totals_by_node": reports.by_node_dict(),
        "new_ledger_nodes": sorted(reports.new_ledger_nodes),
    }


def exchange_lines(
    what: str,
    rejected: Sequence[RejectedReply],
    totals: LedgerTotals | None,
    new_ledger_nodes: Sequence[int],
) -> list[str]:
    """The lines an outcome's ``summary()`` ends with: each rejected reply and why, the most
    any user of the accepted nodes has spent (this ``what`` included), and the nodes whose
    ledger it created."""
    from ..mechanisms.formatting import format_number

    lines = [f"  rejected reply from node {item.node_id}: {item.reason}" for item in rejected]
    if totals is not None:
        lines.append(
            f"the most any user of the accepted nodes has spent, this {what} included: "
            f"epsilon = {format_number(totals.epsilon, '.4g')} at delta = "
            f"{format_number(totals.delta, '.3g')}"
        )
    if new_ledger_nodes:
        nodes = ", ".join(str(node) for node in new_ledger_nodes)
        lines.append(f"new privacy ledger on node(s) {nodes}: their users' totals start here")
    return lines


Checked = TypeVar("Checked")


@dataclass
class SortedReplies(Generic[Checked]):
    """The replies of one exchange, sorted: what each accepted node's reply gave (in order of
    arrival), the rejected ones and why, the nodes that replied, and the ledger reports of the
    accepted ones."""

    accepted: list[tuple[int, Checked]] = field(default_factory=list)
    rejected: list[RejectedReply] = field(default_factory=list)
    replied: set[int] = field(default_factory=set)
    ledgers: NodeLedgerReports = field(default_factory=NodeLedgerReports)

    def missing(self, sent_to: Iterable[int]) -> tuple[int, ...]:
        """The nodes that were asked and did not reply, in the order asked."""
        return tuple(node for node in sent_to if node not in self.replied)


def sort_replies(
    sent_to: Iterable[int],
    replies: Iterable[Message],
    check: Callable[[Message, int], Checked],
    metrics_key: str,
) -> SortedReplies[Checked]:
    """Sort an exchange's replies without ever raising on a bad one: a second reply of a node
    and a reply from a node that was not asked are rejected; ``check(reply, node_id)`` reads
    a reply or raises ``ValueError`` (the reason recorded); the ledger totals in an accepted
    reply's ``metrics_key`` record are kept per node (a malformed value rejects the reply)."""
    asked = set(sent_to)
    result: SortedReplies[Checked] = SortedReplies()
    for reply in replies:
        node_id = int(reply.metadata.src_node_id)
        if node_id in result.replied:
            result.rejected.append(RejectedReply(node_id, "duplicate reply"))
            continue
        result.replied.add(node_id)
        if node_id not in asked:
            result.rejected.append(RejectedReply(node_id, "reply from a node that was not asked"))
            continue
        try:
            checked = check(reply, node_id)
            ledger = NodeLedgerReports.read(reply.content.metric_records.get(metrics_key, {}))
        except ValueError as error:
            result.rejected.append(RejectedReply(node_id, str(error)))
            continue
        result.ledgers.record(node_id, *ledger)
        result.accepted.append((node_id, checked))
    return result


def refuse_over_cap(
    replies: SortedReplies[Checked],
    users_of: Callable[[Checked], int],
    setting: UserCap,
    users_by_node: Mapping[int, int],
) -> NodeCap:
    """Refuse the accepted replies that account for more users than the per-node cap (moved
    to the rejected ones, their ledger reports dropped) and return the cap. ``"auto"`` is
    derived from the sizes the nodes described (``users_by_node``), or, when none is known,
    from the users each accepted reply accounts for (``users_of``)."""
    accounted = {node: users_of(checked) for node, checked in replies.accepted}
    cap = NodeCap.resolve(setting, users_by_node.values() or accounted.values())
    kept = []
    for node, checked in replies.accepted:
        if cap.exceeded_by(accounted[node]):
            replies.rejected.append(
                RejectedReply(node, cap.reason(accounted[node], "the reply accounts for"))
            )
            replies.ledgers.by_node.pop(node, None)
            replies.ledgers.new_ledger_nodes.discard(node)
        else:
            kept.append((node, checked))
    replies.accepted = kept
    return cap


def attribute_replies(sent: Sequence[Message], replies: Iterable[Message]) -> list[Message]:
    """The replies the nodes themselves sent; the node a reply is from is the node the
    message it answers was sent to.

    When a node cannot be reached, Flower answers in its place with an error reply whose
    source is the SuperLink itself (node id 1), not the node: taken at face value, every
    strategy would count a phantom "node 1" and the dead node as missing as well. The message
    a reply answers (``reply_to_message_id``) names the node it was sent to; such an error
    reply is left out (logged with Flower's reason), so the node counts as missing, which is
    what happened: it did not reply.
    """
    destinations = {msg.metadata.message_id: int(msg.metadata.dst_node_id) for msg in sent}
    attributed = []
    for reply in replies:
        node = destinations.get(reply.metadata.reply_to_message_id)
        if node is not None and reply.has_error() and int(reply.metadata.src_node_id) != node:
            log(
                logging.INFO,
                "no reply from node %d (Flower: %s)",
                node,
                short_reason(reply.error.reason),
            )
            continue
        attributed.append(reply)
    return attributed


#: Shortest wait between two polls for replies (s).
POLL_FIRST_INTERVAL = 0.002
#: The wait between two polls is this fraction of the time waited so far (at least
#: :data:`POLL_FIRST_INTERVAL`, at most :data:`POLL_MAX_INTERVAL`): a reply is read at most
#: 5% (or 0.25 s) after it arrived, with about 14 polls (ln 2 / 0.05) per doubling of the wait.
POLL_LAG_FRACTION = 0.05
POLL_MAX_INTERVAL = 0.25
# The wait is also at least POLL_COST_FACTOR (10) times the last poll's own duration, as for
# object pulls: a poll of a SuperLink costs it about 10 ms of CPU (FastAPI, SQLite), so polling
# every 2 ms would keep it busy; in simulation a poll takes microseconds and the floor stays 2 ms.


def poll_interval(waited: float, last_poll: float = 0.0) -> float:
    """The wait before the next poll for replies after ``waited`` seconds, the last poll having
    taken ``last_poll`` seconds: :data:`POLL_LAG_FRACTION` of ``waited``, at least
    :data:`POLL_FIRST_INTERVAL` and
    :data:`~fedparity.mechanisms.protocol.object_pulls.POLL_COST_FACTOR` times ``last_poll``,
    at most :data:`POLL_MAX_INTERVAL`
    (:func:`~fedparity.mechanisms.protocol.object_pulls.poll_pause`)."""
    first = max(POLL_FIRST_INTERVAL, POLL_COST_FACTOR * last_poll)
    return poll_pause(waited, first, POLL_MAX_INTERVAL, POLL_LAG_FRACTION)


def prompt_object_pulls(grid: Grid) -> None:
    """Let a ServerApp's grid read reply objects promptly: against a SuperLink, Flower's grid
    (``flwr.superlink.grid.http_grid``, 1.41) pulls each reply's objects through its Runtime
    API client and waits 1 s, then 2 s, for an object still being uploaded (a node's reply is
    listed before its objects arrive); with 10 nodes the replies of one exchange were read over
    about 4 s. Wrapping the connected client's ``PullObject`` in
    :class:`~fedparity.mechanisms.protocol.object_pulls.PromptObjectPulls` re-asks every 5 to
    50 ms instead; what is pulled and checked stays Flower's. A grid without such a client (the
    simulation's) is left as it is; a wrapped one is not wrapped again. Flower's private
    attribute ``_client`` (set when the grid connects) is used because Flower offers no public
    setting for this wait."""
    client = getattr(grid, "_client", None)
    if client is None or isinstance(client, PromptObjectPulls) or not hasattr(client, "PullObject"):
        return
    grid._client = PromptObjectPulls(client)  # type: ignore[attr-defined]


def send_and_receive(grid: Grid, messages: Sequence[Message], timeout: float) -> list[Message]:
    """Push ``messages``, pull their replies until all arrived or ``timeout`` seconds passed,
    and attribute every reply to the node it concerns (:func:`attribute_replies`).

    The same as ``grid.send_and_receive`` except for the waits between polls: Flower sleeps a
    fixed 0.1 s between polls in simulation and 3 s against a SuperLink, which dominated a
    round that itself takes tens of milliseconds. Here each wait is 5% of the time waited so
    far (2 ms to 0.25 s, and at least ten times the last empty poll's duration:
    :func:`poll_interval`): a reply is read at most 5% later than it arrived, and a long wait
    costs about 14 polls per doubling, then one every 0.25 s. (A geometric back-off read the
    last reply of an FPFL round up to 50% late: 55 ms of a 0.4 s round.) Only a poll that
    brought nothing measures the cost of polling: one that brought replies also took the time
    to read them, which is no reason to poll less often.
    """
    message_ids = {message_id for message_id in grid.push_messages(messages) if message_id}
    prompt_object_pulls(grid)
    started = time.monotonic()
    deadline = started + timeout
    replies: list[Message] = []
    empty_poll = 0.0  # the duration of the last poll that brought nothing
    while message_ids:
        polled = time.monotonic()
        pulled = list(grid.pull_messages(message_ids))
        now = time.monotonic()
        if not pulled:
            empty_poll = now - polled
        replies.extend(pulled)
        message_ids.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        remaining = deadline - now
        if not message_ids or remaining <= 0:
            break
        time.sleep(min(poll_interval(now - started, empty_poll), remaining))
    return attribute_replies(messages, replies)


def session_records(session: str) -> dict[str, ConfigRecord]:
    """The record naming ``session`` to add to each message of a protocol execution (none for
    ``""``, the run's only session); nodes accept only the sessions their run config defines."""
    return {SESSION_KEY: ConfigRecord({"label": session})} if session else {}
