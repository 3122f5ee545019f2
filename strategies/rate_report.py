"""Rate report: every rate metric per group from one private report per user.

One exchange. The server sends the global model and a frequency oracle's public parameters
(GRR, OUE or subset selection: Wang, Blocki, Li and Jha, "Locally differentially private
protocols for frequency estimation", USENIX Security 2017) in a ``query.rate_report`` message;
every node places each of its users in one joint category (group, confusion cell TP / FP / FN /
TN), perturbs it once and replies with the reports only
(:func:`fedparity.clients.rates.rate_report_handler`). The strategy checks every reply (only
reports the oracle's sampler can produce are accepted), counts rejected and missing ones, adds
the reports' support counts, estimates the group x cell counts without bias
(:meth:`~fedparity.mechanisms.ldp.frequency_oracle.FrequencyOracle.estimate`) and reads every
rate metric per group with intervals, fairlearn's summaries and the four-fifths verdict from
them (:func:`~fedparity.mechanisms.ldp.group_rates.group_rates`). A user's ledger is charged
once for the report, however many metrics are read.

Like :class:`~fedparity.strategies.ldp_audit.LdpGapAudit`, it is not a
``flwr.serverapp.strategy.Strategy`` subclass (a report is no training round): it has
``configure_report`` and ``aggregate_report`` hooks, ``summary()``, and ``start()``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms.formatting import format_number
from ..mechanisms.ldp.frequency_oracle import FrequencyEstimate, FrequencyOracle, frequency_oracle
from ..mechanisms.ldp.group_rates import CELLS, GroupRates, group_rates
from ..mechanisms.ldp.node_influence import (
    AUTO_CAP,
    NodeInfluence,
    UserCap,
    check_user_cap,
    rate_node_influence,
)
from ..mechanisms.privacy.basic_ledger import BUDGET_TOLERANCE
from ..mechanisms.protocol import METRICS_KEY, REPORTS_KEY
from ..mechanisms.protocol.rate_report import (
    CONFIG_KEY,
    RATE_REPORT_MESSAGE_TYPE,
    RateReportReply,
    RateReportRequest,
)
from ..mechanisms.validation import check_int, check_num_groups
from .replies import (
    ExcludedNode,
    LedgerTotals,
    NodeCap,
    NodeLedgerReports,
    RejectedReply,
    cap_lines,
    exchange_lines,
    exclude_over_cap,
    ledger_fields,
    refuse_over_cap,
    send_and_receive,
    short_reason,
    sort_replies,
)

__all__ = ["RateReportAudit", "RateReportOutcome"]


@dataclass(frozen=True)
class RateReportOutcome:
    """Everything one rate report produced.

    Attributes
    ----------
    rates : GroupRates or None
        Every rate metric per group and overall with intervals, fairlearn's summaries and the
        four-fifths verdict (None if no report was accepted; see ``error``).
    counts : FrequencyEstimate or None
        The unbiased group x cell counts and their covariance.
    num_reports : int
        Reports accepted (one per answering user).
    nodes_sent, nodes_replied, accepted_nodes : int
        Messages sent, replies received, replies whose reports were used.
    rejected : tuple of RejectedReply
        Replies that failed validation (or carried an error).
    missing_nodes : tuple of int
        Nodes asked that did not reply.
    refused_users : int
        Users whose ledger could not afford the report.
    oracle : str
        The frequency oracle ("grr", "oue" or "ss").
    epsilon : float
        The oracle's true epsilon: what each answering user was charged, once.
    error : str or None
        Why there are no rates, if there are none.
    ledger_totals : LedgerTotals or None
        The most any user of the accepted nodes has spent over every release their ledgers
        recorded, this report included (None if no node sent totals).
    ledger_totals_by_node : mapping of int to LedgerTotals, or None
        Each accepted node's totals.
    new_ledger_nodes : tuple of int
        Accepted nodes whose ledger this report created.
    excluded : tuple of ExcludedNode
        Nodes not asked: they describe more users than the per-node cap (their users were
        not charged).
    max_users_per_node : int or None
        The per-node cap on users this report applied (None: no cap).
    influence : tuple of NodeInfluence
        Each node's influence on the selection rate, TPR and FPR differences between the
        groups (:data:`~fedparity.mechanisms.ldp.node_influence.INFLUENCE_RATE_METRICS`):
        the largest leave-one-node-out shift, the heterogeneity test and the flagged nodes.
    """

    rates: GroupRates | None
    counts: FrequencyEstimate | None
    num_reports: int
    nodes_sent: int
    nodes_replied: int
    accepted_nodes: int
    rejected: tuple[RejectedReply, ...] = ()
    missing_nodes: tuple[int, ...] = ()
    refused_users: int = 0
    oracle: str = ""
    epsilon: float = float("nan")
    error: str | None = None
    ledger_totals: LedgerTotals | None = None
    ledger_totals_by_node: Mapping[int, LedgerTotals] | None = None
    new_ledger_nodes: tuple[int, ...] = ()
    excluded: tuple[ExcludedNode, ...] = ()
    max_users_per_node: int | None = None
    influence: tuple[NodeInfluence, ...] = ()

    @property
    def ledger_reports(self) -> NodeLedgerReports:
        """The nodes' ledger reports of this exchange, to combine with other exchanges'."""
        return NodeLedgerReports(dict(self.ledger_totals_by_node or {}), set(self.new_ledger_nodes))

    def summary(self) -> str:
        """The rates' verdict lines (:meth:`GroupRates.summary`), then how many nodes and users
        took part, what each was charged, the nodes the per-node cap left out, each node's
        influence, and the most any user has spent."""
        lines = [
            f"Rate report ({self.oracle}, epsilon {format_number(self.epsilon, '.4g')} per "
            "user, charged once for every metric)"
        ]
        lines.append(f"no rates: {self.error}" if self.rates is None else self.rates.summary())
        lines.append(
            f"{self.num_reports} reports from {self.accepted_nodes} of {self.nodes_sent} nodes "
            f"({self.nodes_replied} replied, {len(self.rejected)} replies rejected, "
            f"{len(self.missing_nodes)} nodes missing); {self.refused_users} users refused "
            "(their ledgers could not afford it)"
        )
        lines += cap_lines(self.excluded)
        lines += [check.summary() for check in self.influence]
        lines += exchange_lines("report", self.rejected, self.ledger_totals, self.new_ledger_nodes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        found = f"error={self.error!r}" if self.rates is None else repr(self.rates)
        return (
            f"RateReportOutcome(oracle={self.oracle!r}, epsilon={format_number(self.epsilon)}, "
            f"num_reports={self.num_reports}, nodes={self.accepted_nodes}/{self.nodes_sent}, "
            f"rejected={len(self.rejected)}, missing={len(self.missing_nodes)}, {found})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "oracle": self.oracle,
            "epsilon": self.epsilon,
            "rates": None if self.rates is None else self.rates.to_dict(),
            "num_reports": self.num_reports,
            "nodes_sent": self.nodes_sent,
            "nodes_replied": self.nodes_replied,
            "accepted_nodes": self.accepted_nodes,
            "rejected_replies": [{"node_id": r.node_id, "reason": r.reason} for r in self.rejected],
            "missing_nodes": list(self.missing_nodes),
            "refused_users": self.refused_users,
            "error": self.error,
            **ledger_fields(self.ledger_totals, self.ledger_reports),
            "excluded_nodes": [item.to_dict() for item in self.excluded],
            "max_users_per_node": self.max_users_per_node,
            "influence": [check.to_dict() for check in self.influence],
        }


class RateReportAudit:
    """Server side of one rate report.

    Parameters
    ----------
    oracle : FrequencyOracle
        What every user applies, over num_groups x 4 categories; its true epsilon must fit
        ``budget``.
    budget : float
        The epsilon the report may spend per user.
    confidence : float
        Level of the intervals.
    group_labels : sequence, optional
        One label per group (e.g. ``IntersectionalGroups.labels``).
    min_group_count : float
        Groups whose noisy count is below this are suppressed (labelled, left out of the
        summaries).
    audit_id : str
        Label recorded in the users' ledgers.
    users_by_node : mapping of int to int, optional
        Users each node said it hosts; a reply accounting for more is rejected.
    max_users_per_node : "auto", int or None
        The most users one node may bring, whatever it claims: a node that describes more is
        not asked, a reply that accounts for more is refused (as
        :class:`~fedparity.strategies.ldp_audit.LdpGapAudit`'s; ``"auto"``, the default,
        :data:`~fedparity.mechanisms.ldp.node_influence.NODE_SIZE_FACTOR` times the lower
        median of the nodes' sizes; None: no cap).
    """

    def __init__(
        self,
        oracle: FrequencyOracle,
        *,
        budget: float,
        confidence: float = 0.95,
        group_labels: Sequence[Any] | None = None,
        min_group_count: float = 0.0,
        audit_id: str = "rates",
        users_by_node: Mapping[int, int] | None = None,
        max_users_per_node: UserCap = AUTO_CAP,
    ) -> None:
        if not isinstance(oracle, FrequencyOracle):
            raise TypeError(f"oracle must be a FrequencyOracle, got {type(oracle).__name__}")
        if not budget > 0:
            raise ValueError(f"budget must be > 0, got {budget!r}")
        if oracle.epsilon > budget + BUDGET_TOLERANCE:
            raise ValueError(
                f"the oracle's true epsilon {oracle.epsilon:.6g} exceeds the report's budget "
                f"{budget:g}: refusing to release"
            )
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
        self._request = RateReportRequest.for_oracle(oracle, budget=budget, audit_id=audit_id)
        self.oracle = oracle
        self.num_groups = self._request.num_groups
        self.budget = float(budget)
        self.confidence = float(confidence)
        self.group_labels = None if group_labels is None else tuple(group_labels)
        self.min_group_count = float(min_group_count)
        self.audit_id = audit_id
        self.users_by_node = {
            int(node): check_int(f"users_by_node[{node!r}]", users, minimum=0)
            for node, users in (users_by_node or {}).items()
        }
        self.max_users_per_node = check_user_cap("max_users_per_node", max_users_per_node)

    @classmethod
    def for_budget(
        cls,
        budget: float,
        *,
        num_groups: int,
        oracle: str = "best",
        **kwargs: Any,
    ) -> RateReportAudit:
        """The report with ``oracle`` ("grr", "oue", "ss" or "best": the smallest variance of
        the counts) at ``budget`` over ``num_groups`` x 4 categories."""
        num_groups = check_num_groups(num_groups)
        built = frequency_oracle(oracle, budget, num_groups * len(CELLS))
        return cls(built, budget=budget, **kwargs)

    @property
    def epsilon(self) -> float:
        """The oracle's true epsilon: what each answering user is charged, once."""
        return float(self.oracle.epsilon)

    def summary(self) -> None:
        """Log the report's parameters (like ``Strategy.summary``)."""
        log(logging.INFO, "RateReportAudit %s:", self.audit_id)
        log(
            logging.INFO,
            "\t└── %r over %d groups x %d cells; true epsilon %.4g (budget %.4g), confidence %.3g",
            self.oracle,
            self.num_groups,
            len(CELLS),
            self.oracle.epsilon,
            self.budget,
            self.confidence,
        )

    def request(self) -> RateReportRequest:
        return self._request

    def configure_report(self, arrays: ArrayRecord, node_ids: Iterable[int]) -> list[Message]:
        """One message per node, carrying the model and the report's parameters."""
        content = RecordDict(
            {"arrays": arrays, CONFIG_KEY: ConfigRecord({**self._request.to_fields()})}
        )
        return [
            Message(content=content, dst_node_id=node_id, message_type=RATE_REPORT_MESSAGE_TYPE)
            for node_id in node_ids
        ]

    def check_reply(
        self, reply: Message, *, max_users: int | None = None
    ) -> tuple[np.ndarray, int, int]:
        """(support counts, reports, refused users) of one reply; ``ValueError`` says what is
        wrong (a report the oracle cannot produce, counts that do not add up, more users than
        the node described)."""
        if reply.has_error():
            raise ValueError(f"client error: {short_reason(reply.error.reason)}")
        content = reply.content
        typed = RateReportReply.from_fields(
            content.array_records.get(REPORTS_KEY), content.metric_records.get(METRICS_KEY, {})
        )
        support = typed.support_counts(self.oracle)
        if max_users is not None and typed.num_reports + typed.num_refused > max_users:
            raise ValueError(
                f"the reply accounts for {typed.num_reports + typed.num_refused} users, more "
                f"than the {max_users} the node described"
            )
        return support, typed.num_reports, typed.num_refused

    def node_cap(self) -> NodeCap:
        """The per-node cap over the sizes the nodes described (``max_users_per_node``)."""
        return NodeCap.resolve(self.max_users_per_node, self.users_by_node.values())

    def aggregate_report(
        self,
        sent_to: Sequence[int],
        replies: Iterable[Message],
        *,
        excluded: Sequence[ExcludedNode] = (),
    ) -> RateReportOutcome:
        """Check replies, refuse those over the per-node cap, add the accepted reports'
        support counts, estimate and check each node's influence; never raises on bad
        replies. ``excluded``: the nodes :meth:`start` left out (recorded in the outcome)."""
        replies_sorted = sort_replies(
            sent_to,
            replies,
            lambda reply, node: self.check_reply(reply, max_users=self.users_by_node.get(node)),
            METRICS_KEY,
        )
        cap = refuse_over_cap(
            replies_sorted,
            lambda item: item[1] + item[2],
            self.max_users_per_node,
            self.users_by_node,
        )
        support = np.zeros(self.oracle.domain_size, dtype=np.int64)
        num_reports = refused = 0
        for _, (node_support, node_reports, node_refused) in replies_sorted.accepted:
            support += node_support
            num_reports += node_reports
            refused += node_refused
        for item in replies_sorted.rejected:
            log(
                logging.WARNING,
                "Rate report: rejected reply from node %d: %s",
                item.node_id,
                item.reason,
            )
        missing = replies_sorted.missing(sent_to)
        if missing:
            log(logging.WARNING, "Rate report: no reply from %d node(s)", len(missing))
        counts: FrequencyEstimate | None = None
        rates: GroupRates | None = None
        error: str | None = None
        influence: tuple[NodeInfluence, ...] = ()
        if num_reports == 0:
            error = "no report was accepted"
        else:
            counts = self.oracle.estimate(support, num_reports)
            rates = group_rates(
                counts,
                num_groups=self.num_groups,
                group_labels=self.group_labels,
                confidence=self.confidence,
                min_group_count=self.min_group_count,
            )
            influence = rate_node_influence(  # post-processing of the accepted reports
                {node: (item[0], item[1]) for node, item in replies_sorted.accepted},
                self.oracle,
                num_groups=self.num_groups,
                alpha=1.0 - self.confidence,
            )
            for check in influence:
                if check.flagged:
                    log(logging.WARNING, "Rate report: %s", check.summary())
        ledgers = replies_sorted.ledgers
        return RateReportOutcome(
            rates=rates,
            counts=counts,
            num_reports=num_reports,
            nodes_sent=len(sent_to),
            nodes_replied=len(replies_sorted.replied),
            accepted_nodes=len(replies_sorted.accepted),
            rejected=tuple(replies_sorted.rejected),
            missing_nodes=missing,
            refused_users=refused,
            oracle=self.oracle.name,
            epsilon=float(self.oracle.epsilon),
            error=error,
            ledger_totals=ledgers.merged(),
            ledger_totals_by_node=ledgers.by_node,
            new_ledger_nodes=tuple(sorted(ledgers.new_ledger_nodes)),
            excluded=tuple(excluded),
            max_users_per_node=cap.users,
            influence=influence,
        )

    def start(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        *,
        timeout: float = 600.0,
        node_ids: Iterable[int] | None = None,
    ) -> RateReportOutcome:
        """Run the report on ``node_ids`` (default: every connected node) but those that
        describe more users than the per-node cap; the outcome."""
        self.summary()
        node_ids = sorted(grid.get_node_ids() if node_ids is None else set(node_ids))
        asked, excluded = exclude_over_cap(
            node_ids, self.users_by_node, self.node_cap(), "Rate report"
        )
        replies = send_and_receive(grid, self.configure_report(arrays, asked), timeout)
        return self.aggregate_report(asked, replies, excluded=excluded)
