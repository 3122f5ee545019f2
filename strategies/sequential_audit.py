"""A sequential LDP gap audit over Flower nodes: ask fresh users in batches, stop as soon as the
question is answered, with intervals valid under that optional stopping.

The statistics are :class:`~fedparity.mechanisms.ldp.sequential.SequentialGapAudit`'s (M_N
reports, NPRR of Waudby-Smith, Wu and Ramdas, "Nonparametric extensions of randomized response
for private confidence sets", ICML 2023; a beta-mixture confidence sequence per statistic);
this module asks the users. Each batch of ``batch_size`` users is spread over the nodes by a
multinomial draw with the nodes' shares of the users (each asked user is on node k with
probability N_k / N, independently of everything else;
:func:`~fedparity.mechanisms.ldp.sequential.allocate_batch`), and every node asks that many of its
users not yet asked in this audit, drawn uniformly at random with its own secure generator
(``clients.ldp``: the server names a number, never a user; a node asks a user at most once per
audit, whatever the server sends, and charges each asked user one report's epsilon before
anything leaves it). A user never asked sends nothing and spends nothing.

What the intervals cover. If each node's users are independent draws from the node's
distribution (the usual sampling model of an audit), every asked user is an independent draw
from the mixture of the nodes' distributions with weights N_k / N -- the population the nodes
hold -- so the confidence sequence's martingale argument holds at the end of every batch
(:mod:`fedparity.mechanisms.ldp.sequential`). A batch that does not come back whole (a node
lost, a reply rejected, a user who refused for lack of budget) would bias the next step; its
reports are left out and the audit stops with the intervals of the batch before, which remain
valid (the decision to stop depends on the past only). Its asked users were charged all the
same: the outcome counts them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms.ldp.estimators import EstimationError
from ..mechanisms.ldp.node_influence import (
    AUTO_CAP,
    NodeInfluence,
    UserCap,
    check_user_cap,
    gap_node_influence,
)
from ..mechanisms.ldp.nprr import NPRRMechanism
from ..mechanisms.ldp.reports import PerturbedReports, ReportSummary
from ..mechanisms.ldp.sequential import (
    STOP_REASONS,
    SequentialGapAudit,
    SequentialGapResult,
    allocate_batch,
)
from ..mechanisms.protocol import AUDIT_MESSAGE_TYPE, METRICS_KEY, REPORTS_KEY, message_int
from ..mechanisms.protocol.ldp_audit import CONFIG_KEY, LdpAuditReply
from ..mechanisms.validation import check_int_at_least, check_positive_finite
from .ldp_audit import LdpGapAudit
from .replies import (
    ExcludedNode,
    NodeCap,
    RejectedReply,
    cap_lines,
    exclude_over_cap,
    send_and_receive,
)

__all__ = ["SequentialAuditOutcome", "SequentialLdpAudit"]


@dataclass(frozen=True)
class SequentialAuditOutcome:
    """What a sequential audit produced.

    Attributes
    ----------
    result : SequentialGapResult or None
        The statistics at the last whole batch (None: no batch came back whole).
    users_by_node : dict
        The users each node said it has (the population: their sum).
    asked_by_node : dict
        Users each node asked over the audit, a left-out batch's included: each was charged
        one report's epsilon.
    stopped_because : str
        One of :data:`~fedparity.mechanisms.ldp.sequential.STOP_REASONS`, or why the audit
        could not start.
    rejected : tuple of RejectedReply
        Replies that were errors or malformed.
    missing : tuple of int
        Nodes that did not answer a message sent to them.
    epsilon : float
        Each asked user's epsilon (one M_N report).
    excluded : tuple of ExcludedNode
        Nodes left out of the audit: their size is over the per-node cap (none of their
        users was asked).
    max_users_per_node : int or None
        The per-node cap on users (None: no cap).
    influence : NodeInfluence or None
        Each node's influence on the fixed-sample estimate of the largest gap from the
        reports of the whole batches
        (:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`; a diagnostic beside the
        confidence sequence): the largest leave-one-node-out shift, the heterogeneity test
        and the flagged nodes.
    """

    result: SequentialGapResult | None
    users_by_node: dict[int, int]
    asked_by_node: dict[int, int]
    stopped_because: str
    rejected: tuple[RejectedReply, ...] = ()
    missing: tuple[int, ...] = ()
    epsilon: float = 0.0
    batches_sent: int = field(default=0)
    excluded: tuple[ExcludedNode, ...] = ()
    max_users_per_node: int | None = None
    influence: NodeInfluence | None = None

    @property
    def users_asked(self) -> int:
        """Users asked on every node (each spent ``epsilon`` once)."""
        return sum(self.asked_by_node.values())

    @property
    def population(self) -> int:
        return sum(self.users_by_node.values())

    def summary(self) -> str:
        """The verdict, the interval, what was spent, the nodes the per-node cap left out and
        each node's influence, in the audit's words."""
        lines = []
        if self.result is None:
            lines.append(f"sequential audit: no result ({self.stopped_because})")
        else:
            result = self.result
            interval = result.interval
            verdict = "the groups differ" if interval.low > 0 else "no gap shown"
            lines.append(
                f"sequential audit: {verdict}; largest gap {result.estimate:.4f}, "
                f"{100 * result.confidence:g}% confidence sequence [{interval.low:.4f}, "
                f"{interval.high:.4f}] (valid at this stop)"
            )
        lines.append(
            f"stopped because: {self.stopped_because}; {self.users_asked} of "
            f"{self.population} users asked ({self.batches_sent} batch(es)), each charged "
            f"epsilon = {self.epsilon:.4g}; the others spent nothing"
        )
        for item in self.rejected:
            lines.append(f"rejected reply from node {item.node_id}: {item.reason}")
        if self.missing:
            lines.append(f"no reply from node(s) {list(self.missing)}")
        lines += cap_lines(self.excluded)
        if self.influence is not None:
            lines.append(self.influence.summary())
        return "\n".join(lines)

    def __repr__(self) -> str:
        gap = None if self.result is None else round(self.result.estimate, 4)
        return (
            f"SequentialAuditOutcome(gap={gap}, stopped_because={self.stopped_because!r}, "
            f"users_asked={self.users_asked}, population={self.population})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "result": None if self.result is None else self.result.to_dict(),
            "users_by_node": {str(k): v for k, v in self.users_by_node.items()},
            "asked_by_node": {str(k): v for k, v in self.asked_by_node.items()},
            "users_asked": self.users_asked,
            "stopped_because": self.stopped_because,
            "rejected": [{"node_id": r.node_id, "reason": r.reason} for r in self.rejected],
            "missing": list(self.missing),
            "epsilon": self.epsilon,
            "batches_sent": self.batches_sent,
            "excluded_nodes": [item.to_dict() for item in self.excluded],
            "max_users_per_node": self.max_users_per_node,
            "influence": None if self.influence is None else self.influence.to_dict(),
        }


class SequentialLdpAudit:
    """Server side of a sequential LDP gap audit (module docstring).

    Parameters
    ----------
    mechanism : NPRRMechanism
        The M_N every asked user applies (its true epsilon must fit ``budget``).
    budget : float
        The epsilon per asked user.
    batch_size : int
        Users asked per batch, over all nodes.
    max_users : int
        The cap on users asked (the last batch is cut to it).
    target_width : float
        Stop when every pairwise difference's interval is narrower than this (metric units).
    metric : str
        The per-user metric. For TPR, FPR and FNR (undefined for a user without positives,
        resp. negatives) the mechanism's last category is "metric undefined"
        (:meth:`~fedparity.strategies.LdpGapAudit.for_budget` builds it with one more
        category): those users report it, and the groups' means are over their users with a
        defined metric.
    confidence : float
        Level of the confidence sequences.
    audit_id : str
        The audit's session on the nodes (each asks a user at most once per audit id) and
        the label in the users' ledgers.
    timeout : float
        Seconds to wait for one batch's replies.
    seed : int, optional
        Seeds the multinomial spread of each batch over the nodes (not a privacy mechanism:
        which users a node asks is the node's own secure draw).
    max_users_per_node : "auto", int or None
        The most users one node may bring, whatever size it replies: a node whose size is
        over it is left out of the audit, so a node's share of every batch is at most the cap
        over the population. ``"auto"`` (the default):
        :data:`~fedparity.mechanisms.ldp.node_influence.NODE_SIZE_FACTOR` times the lower
        median of the nodes' sizes; None: no cap (one node that claims many invented users
        takes most of every batch).
    """

    def __init__(
        self,
        mechanism: NPRRMechanism,
        *,
        budget: float,
        batch_size: int,
        max_users: int,
        target_width: float,
        metric: str = "accuracy",
        confidence: float = 0.95,
        audit_id: str = "sequential-audit",
        timeout: float = 600.0,
        seed: int | None = None,
        max_users_per_node: UserCap = AUTO_CAP,
    ) -> None:
        if not isinstance(mechanism, NPRRMechanism):
            raise ValueError(
                f"mechanism must be an NPRRMechanism (M_N), got {type(mechanism).__name__}"
            )
        if not audit_id:
            raise ValueError("audit_id must be a non-empty label (the audit's session)")
        self.checker = LdpGapAudit(
            mechanism, budget=budget, metric=metric, confidence=confidence, audit_id=audit_id
        )
        self.mechanism = mechanism
        self.batch_size = check_int_at_least("batch_size", batch_size, 1)
        self.max_users = check_int_at_least("max_users", max_users, 1)
        self.target_width = check_positive_finite("target_width", target_width)
        self.confidence = float(confidence)
        self.timeout = check_positive_finite("timeout", timeout)
        self.rng = np.random.default_rng(seed)
        self.max_users_per_node = check_user_cap("max_users_per_node", max_users_per_node)

    def _messages(self, arrays: ArrayRecord, batches: Mapping[int, int]) -> list[Message]:
        base = self.checker.request()
        messages = []
        for node, size in batches.items():
            request = dataclasses.replace(base, sequential_batch=int(size))
            content = RecordDict(
                {"arrays": arrays, CONFIG_KEY: ConfigRecord({**request.to_fields()})}
            )
            messages.append(
                Message(content=content, dst_node_id=node, message_type=AUDIT_MESSAGE_TYPE)
            )
        return messages

    def _ask(
        self, grid: Grid, arrays: ArrayRecord, batches: Mapping[int, int]
    ) -> tuple[dict[int, LdpAuditReply], list[RejectedReply], list[int]]:
        """One message per node of ``batches``; (valid replies, rejected, missing)."""
        replies = send_and_receive(grid, self._messages(arrays, batches), self.timeout)
        valid: dict[int, LdpAuditReply] = {}
        rejected: list[RejectedReply] = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node not in batches or node in valid:
                rejected.append(RejectedReply(node, "unsolicited or repeated reply"))
                continue
            try:
                self.checker.check_reply(reply)  # error replies, shapes, M_N's output domain
                content = reply.content
                valid[node] = LdpAuditReply.from_fields(
                    content.array_records.get(REPORTS_KEY),
                    content.metric_records.get(METRICS_KEY, {}),
                )
            except ValueError as error:
                rejected.append(RejectedReply(node, str(error)))
        missing = sorted(set(batches) - set(valid) - {r.node_id for r in rejected})
        return valid, rejected, missing

    def start(
        self, grid: Grid, arrays: ArrayRecord, *, node_ids: Iterable[int] | None = None
    ) -> SequentialAuditOutcome:
        """Run the audit on ``node_ids`` (default: every connected node); never raises on bad
        or missing replies."""
        nodes = sorted(grid.get_node_ids() if node_ids is None else set(node_ids))
        epsilon = float(self.mechanism.epsilon)
        log(logging.INFO, "[sequential audit] asking %d node(s) for their sizes", len(nodes))
        sized, rejected, missing = self._ask(grid, arrays, dict.fromkeys(nodes, 0))
        users: dict[int, int] = {}
        for node, reply in sized.items():
            try:
                users[node] = message_int("num-users", reply.counts.get("num-users"))
            except ValueError as error:
                rejected.append(RejectedReply(node, str(error)))
        users = {node: count for node, count in users.items() if count > 0}
        cap = NodeCap.resolve(self.max_users_per_node, users.values())
        kept, excluded = exclude_over_cap(sorted(users), users, cap, "Sequential audit")
        users = {node: users[node] for node in kept}
        asked = dict.fromkeys(users, 0)
        reports = {node: ReportSummary.empty(self.mechanism.num_groups) for node in users}
        audit = SequentialGapAudit(
            self.mechanism,
            confidence=self.confidence,
            undefined_category=self.checker.undefined_category,
        )
        batches_sent = 0

        def outcome(reason: str) -> SequentialAuditOutcome:
            result = audit.result(reason) if audit.batches else None
            influence = None
            contributed = {node: part for node, part in reports.items() if part.num_reports}
            if contributed:
                try:  # post-processing of the reports of the whole batches
                    influence = gap_node_influence(
                        contributed,
                        self.mechanism,
                        metric=self.checker.metric,
                        undefined_category=self.checker.undefined_category,
                        alpha=1.0 - self.confidence,
                    )
                except EstimationError:
                    influence = None
            if influence is not None and influence.flagged:
                log(logging.WARNING, "[sequential audit] %s", influence.summary())
            return SequentialAuditOutcome(
                result,
                users,
                asked,
                reason,
                tuple(rejected),
                tuple(missing),
                epsilon,
                batches_sent,
                excluded,
                cap.users,
                influence,
            )

        if not users:
            return outcome("no node has users to ask")
        order = sorted(users)
        while True:
            size = min(self.batch_size, self.max_users - audit.users)
            counts = allocate_batch(size, [users[node] for node in order], self.rng)
            batch = {node: int(n) for node, n in zip(order, counts, strict=True) if n > 0}
            if any(users[node] - asked[node] < n for node, n in batch.items()):
                return outcome(STOP_REASONS[4])
            batches_sent += 1
            log(logging.INFO, "[sequential audit] batch %d: %d user(s)", batches_sent, size)
            replies, lost, absent = self._ask(grid, arrays, batch)
            rejected.extend(lost)
            missing.extend(absent)
            for node, reply in replies.items():
                try:
                    asked[node] += message_int("num-asked", reply.counts.get("num-asked", 0))
                except ValueError:
                    asked[node] += batch[node]
            for node in [*absent, *(item.node_id for item in lost if item.node_id in batch)]:
                asked[node] += batch[node]  # may have asked them before its reply was lost
            whole = (
                not lost
                and not absent
                and all(len(replies[node].groups) == n for node, n in batch.items())
            )
            if not whole:
                return outcome(STOP_REASONS[3])
            groups = np.concatenate([replies[node].groups for node in batch]).astype(np.int64)
            values = np.concatenate([replies[node].values for node in batch]).astype(np.float64)
            audit.update(PerturbedReports(groups, values))
            for node in batch:
                reports[node] = reports[node].merge(
                    ReportSummary.from_reports(
                        replies[node].groups.astype(np.int64),
                        replies[node].values.astype(np.float64),
                        self.mechanism.num_groups,
                    )
                )
            reason = audit.stop_reason(target_width=self.target_width, max_users=self.max_users)
            if reason is not None:
                return outcome(reason)
