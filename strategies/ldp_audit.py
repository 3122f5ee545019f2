"""LDP gap audit: a Flower strategy around :mod:`mechanisms`.

The mechanisms M_R and M_L are those of Marc Juarez and Aleksandra Korolova, "'You Can't Fix
What You Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
Learning", AFCP workshop, PMLR, 2022 (Juarez and Korolova 2022), used with their true epsilon
(:func:`fedparity.mechanisms.ldp.calibration.true_epsilon`).

One audit = one exchange. The server sends the global model and the mechanism's public
parameters (M_R, M_L or M_P, eps1, eps2, d, the metric) in a ``query.ldp_audit`` message; every
node evaluates the model for each of its users, perturbs each user's (group, metric) pair
on the node and replies with the perturbed pairs only. The strategy validates every reply,
counts rejected and missing ones, merges the accepted reports into a
:class:`~fedparity.mechanisms.ldp.reports.ReportSummary` and calls
:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`.

It is not a :class:`flwr.serverapp.strategy.Strategy` subclass: an audit is not a training
round (no arrays are aggregated, and every audit spends privacy budget, so it must not run
in every round of ``Strategy.start``). It follows the same shape: ``configure_audit`` and
``aggregate_audit`` hooks, ``summary()``, and ``start()`` that runs one audit on a Grid.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms import EstimationError, GapEstimate, ReportSummary, estimate_gap
from ..mechanisms.formatting import format_number
from ..mechanisms.ldp.calibration import GapMechanismType, MechanismChoice, mechanism_for_budget
from ..mechanisms.ldp.laplace import GRID_STEP, LaplaceMechanism
from ..mechanisms.ldp.metrics import METRIC_NAMES, UNDEFINABLE_METRICS
from ..mechanisms.ldp.node_influence import (
    AUTO_CAP,
    NodeInfluence,
    UserCap,
    check_user_cap,
    gap_node_influence,
)
from ..mechanisms.ldp.nprr import NPRRMechanism
from ..mechanisms.ldp.piecewise import PiecewiseMechanism
from ..mechanisms.privacy.basic_ledger import BUDGET_TOLERANCE
from ..mechanisms.protocol import AUDIT_MESSAGE_TYPE, METRICS_KEY, REPORTS_KEY
from ..mechanisms.protocol.ldp_audit import (
    CONFIG_KEY,
    MAX_AUDIT_ID_LENGTH,
    LdpAuditReply,
    LdpAuditRequest,
)
from ..mechanisms.validation import check_int
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


class _SummaryMethod:
    """``AuditOutcome.summary``: called, the outcome in words; read as the field it replaced
    (the accepted reports' :class:`ReportSummary`), that field, with a deprecation warning."""

    __slots__ = ("_outcome",)

    def __init__(self, outcome: AuditOutcome) -> None:
        self._outcome = outcome

    def __call__(self) -> str:
        return self._outcome.summary_text()

    def __getattr__(self, name: str) -> Any:
        warnings.warn(
            "AuditOutcome.summary is now a method (the outcome in words); the accepted reports "
            "are AuditOutcome.reports",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self._outcome.reports, name)


@dataclass(frozen=True)
class AuditOutcome:
    """Everything one audit produced.

    Attributes
    ----------
    estimate : GapEstimate or None
        The private estimate (None if the accepted reports did not allow one; see ``error``).
    reports : ReportSummary
        Sufficient statistics of the accepted reports (``summary`` before version 0.2: that
        name is now the method that prints the outcome).
    nodes_sent, nodes_replied : int
        Messages sent, replies received (before the timeout).
    accepted_nodes : int
        Replies whose reports were used.
    rejected : tuple of RejectedReply
        Replies that failed validation (or carried an error).
    missing_nodes : tuple of int
        Nodes that were sent the audit but did not reply.
    refused_users : int
        Users who refused because their privacy ledger could not afford the audit.
    undefined_users : int
        Users whose metric is undefined (e.g. TPR without positives) that nodes declared (0
        when the audit carries the undefined category: those users report it, perturbed).
    error : str or None
        Why there is no estimate, if there is none.
    epsilon_spent_max : float or None
        The most any user of the accepted nodes has spent over every release their ledgers
        recorded (LDP audits, FPFL trainings), this audit included, at the users' delta
        (None if no node sent it: nodes with fewer users than their ``min-users-for-counts``
        send none).
    ledger_totals : LedgerTotals or None
        The same with its delta, basic composition beside it and the neighbouring relation.
    ledger_totals_by_node : mapping of int to LedgerTotals, or None
        Each accepted node's totals (the maximum above hides a node whose users start anew);
        None when not collected (an outcome made by hand).
    new_ledger_nodes : tuple of int
        Accepted nodes whose ledger this audit created: their users' totals start with it
        (a first audit, or a ledger its operator reset).
    metric : str
        The audited metric (accuracy, tpr, fpr, fnr; "" if not recorded).
    excluded : tuple of ExcludedNode
        Nodes not asked: they describe more users than the per-node cap (their users were
        not charged).
    max_users_per_node : int or None
        The per-node cap on users this audit applied (None: no cap).
    influence : NodeInfluence or None
        Each node's influence on the estimate: the largest leave-one-node-out shift, the
        heterogeneity test across nodes and the nodes it flags (None without an estimate).

    ``print(outcome)`` gives a one-line repr; ``print(outcome.summary())`` the verdict lines
    the built-in job prints, with the nodes' replies and the privacy the users have spent.
    """

    estimate: GapEstimate | None
    reports: ReportSummary
    nodes_sent: int
    nodes_replied: int
    accepted_nodes: int
    rejected: tuple[RejectedReply, ...] = field(default=())
    missing_nodes: tuple[int, ...] = field(default=())
    refused_users: int = 0
    undefined_users: int = 0
    error: str | None = None
    epsilon_spent_max: float | None = None
    ledger_totals: LedgerTotals | None = None
    metric: str = ""
    # (None rather than a default factory: autodoc cannot parse a signature with <factory>)
    ledger_totals_by_node: Mapping[int, LedgerTotals] | None = None
    new_ledger_nodes: tuple[int, ...] = ()
    excluded: tuple[ExcludedNode, ...] = ()
    max_users_per_node: int | None = None
    influence: NodeInfluence | None = None

    @property
    def ledger_reports(self) -> NodeLedgerReports:
        """The nodes' ledger reports of this audit (:attr:`ledger_totals_by_node`,
        :attr:`new_ledger_nodes`), to combine with other exchanges'."""
        return NodeLedgerReports(dict(self.ledger_totals_by_node or {}), set(self.new_ledger_nodes))

    @property
    def contributing_nodes(self) -> int:
        """Nodes whose reports entered the estimate."""
        return self.accepted_nodes

    @property
    def summary(self) -> _SummaryMethod:
        """``summary()``: the outcome in words (see :meth:`summary_text`). Reading an attribute
        of it (``outcome.summary.num_reports``, the field's old use) still works, with a
        ``DeprecationWarning``: use :attr:`reports`."""
        return _SummaryMethod(self)

    def summary_text(self) -> str:
        """The verdict (the largest gap, its interval, whether the groups differ), each
        group's mean, then how many nodes and users took part, the nodes the per-node cap left
        out, each node's influence and the most any user has spent."""
        metric = self.metric or "metric"
        lines = [f"LDP audit of {metric}"]
        if self.estimate is None:
            lines.append(f"no estimate: {self.error}")
        else:
            lines.append(self.estimate.summary(metric))
        lines.append(
            f"{self.reports.num_reports} reports from {self.accepted_nodes} of "
            f"{self.nodes_sent} nodes ({self.nodes_replied} replied, {len(self.rejected)} "
            f"replies rejected, {len(self.missing_nodes)} nodes missing); "
            f"{self.refused_users} users refused (their ledgers could not afford it), "
            f"{self.undefined_users} without a defined {metric}"
        )
        lines += cap_lines(self.excluded)
        if self.influence is not None:
            lines.append(self.influence.summary())
        lines += exchange_lines("audit", self.rejected, self.ledger_totals, self.new_ledger_nodes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        estimate = self.estimate
        if estimate is None:
            found = f"estimate=None, error={self.error!r}"
        else:
            low, high = estimate.max_gap_interval.low, estimate.max_gap_interval.high
            found = (
                f"max_gap={format_number(estimate.max_gap)}, "
                f"interval=[{format_number(low)}, {format_number(high)}]"
            )
        return (
            f"AuditOutcome(metric={self.metric!r}, {found}, "
            f"num_reports={self.reports.num_reports}, "
            f"nodes={self.accepted_nodes}/{self.nodes_sent}, rejected={len(self.rejected)}, "
            f"missing={len(self.missing_nodes)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
            "num_reports": self.reports.num_reports,
            "nodes_sent": self.nodes_sent,
            "nodes_replied": self.nodes_replied,
            "accepted_nodes": self.accepted_nodes,
            "rejected_replies": [{"node_id": r.node_id, "reason": r.reason} for r in self.rejected],
            "missing_nodes": list(self.missing_nodes),
            "refused_users": self.refused_users,
            "undefined_users": self.undefined_users,
            "error": self.error,
            "epsilon_spent_max_reported_by_nodes": self.epsilon_spent_max,
            **ledger_fields(self.ledger_totals, self.ledger_reports),
            "excluded_nodes": [item.to_dict() for item in self.excluded],
            "max_users_per_node": self.max_users_per_node,
            "influence": None if self.influence is None else self.influence.to_dict(),
        }


class LdpGapAudit:
    """Server side of one LDP audit of the performance gap.

    Parameters
    ----------
    mechanism : RandomizedResponseMechanism, LaplaceMechanism, PiecewiseMechanism or NPRRMechanism
        What every user applies; its *true* epsilon must fit ``budget``.
    budget : float
        The epsilon this audit may spend per user.
    metric : str
        The per-user metric audited (accuracy, tpr, fpr, fnr).
    confidence : float
        Level of the intervals.
    group_sizes : sequence of int, optional
        True group sizes (simulation harness only); by default estimated from the reports.
    audit_id : str
        Label recorded in the users' ledgers.
    users_by_node : mapping of int to int, optional
        Users each node said it hosts (``num-users`` of its ``query.describe`` reply,
        :class:`fedparity.server.orchestration.NodeDescriptions`). A reply accounting for more users
        (num-reports + num-refused + num-undefined) is rejected; nodes not in the mapping,
        or no mapping, are bounded by ``max_users_per_node`` only.
    max_users_per_node : "auto", int or None
        The most users one node may bring, whatever it claims: a node that describes more
        (``users_by_node``) is not asked (:attr:`AuditOutcome.excluded`), a reply that
        accounts for more is refused. ``"auto"`` (the default):
        :data:`~fedparity.mechanisms.ldp.node_influence.NODE_SIZE_FACTOR` times the lower
        median of the sizes the nodes describe (or, without ``users_by_node``, of the users
        the replies account for), which no single node sets; None: no cap, and one node that
        claims many invented users sets the answer (``docs/threat-model.md``).
    undefined_category : bool
        The mechanism's last category is "metric undefined" (default: for TPR, FPR and FNR,
        which are undefined for a user without positives, resp. negatives). Every user then
        reports, and silence never tells the server a label; the estimate covers the other
        categories (:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`).
        :meth:`for_budget` builds the mechanism with the extra category.
    """

    def __init__(
        self,
        mechanism: GapMechanismType,
        *,
        budget: float,
        metric: str = "accuracy",
        confidence: float = 0.95,
        group_sizes: Sequence[int] | None = None,
        audit_id: str = "audit",
        users_by_node: Mapping[int, int] | None = None,
        undefined_category: bool | None = None,
        max_users_per_node: UserCap = AUTO_CAP,
    ) -> None:
        if not budget > 0:
            raise ValueError(f"budget must be > 0, got {budget!r}")
        if mechanism.epsilon > budget + BUDGET_TOLERANCE:
            raise ValueError(
                f"the mechanism's true epsilon {mechanism.epsilon:.6g} exceeds the audit "
                f"budget {budget:g}: refusing to release"
            )
        if isinstance(mechanism, LaplaceMechanism | PiecewiseMechanism):
            mechanism.check_releasable()
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
        if metric not in METRIC_NAMES:
            raise ValueError(f"metric must be one of {', '.join(METRIC_NAMES)}, got {metric!r}")
        if undefined_category is None:
            undefined_category = metric in UNDEFINABLE_METRICS
        if undefined_category and mechanism.num_groups < 3:
            raise ValueError(
                f"with the undefined category the mechanism needs num_groups >= 3 (the protected "
                f"groups and 'undefined'), got {mechanism.num_groups}: use LdpGapAudit.for_budget"
            )
        self.undefined_category = bool(undefined_category)
        self.mechanism = mechanism
        self.budget = float(budget)
        self.metric = metric
        self.confidence = float(confidence)
        self.group_sizes = None if group_sizes is None else list(group_sizes)
        if not isinstance(audit_id, str) or len(audit_id) > MAX_AUDIT_ID_LENGTH:
            raise ValueError(
                f"audit_id must be a string of at most {MAX_AUDIT_ID_LENGTH} characters (the "
                f"nodes refuse longer labels), got {str(audit_id)[:40]!r}..."
            )
        self.audit_id = audit_id
        self.users_by_node: dict[int, int] | None = None
        if users_by_node is not None:
            self.users_by_node = {}
            for node, users in users_by_node.items():
                self.users_by_node[int(node)] = check_int(
                    f"users_by_node[{node!r}]", users, minimum=0
                )
        self.max_users_per_node = check_user_cap("max_users_per_node", max_users_per_node)

    @classmethod
    def for_budget(
        cls,
        mechanism: MechanismChoice,
        budget: float,
        *,
        num_groups: int,
        metric: str = "accuracy",
        **kwargs: Any,
    ) -> LdpGapAudit:
        """The audit with the variance-optimal mechanism (``"R"``, ``"L"``, ``"P"``, ``"N"`` or
        ``"best"``) for ``budget`` over ``num_groups`` protected groups, plus the undefined
        category for TPR, FPR and FNR
        (:func:`~fedparity.mechanisms.ldp.calibration.mechanism_for_budget`)."""
        undefined = metric in UNDEFINABLE_METRICS
        built = mechanism_for_budget(mechanism, budget, num_groups + int(undefined))
        return cls(built, budget=budget, metric=metric, undefined_category=undefined, **kwargs)

    @property
    def epsilon(self) -> float:
        """The mechanism's true epsilon: what each answering user is charged."""
        return float(self.mechanism.epsilon)

    def summary(self) -> None:
        """Log the audit's parameters (like ``Strategy.summary``)."""
        mech = self.mechanism
        log(logging.INFO, "LdpGapAudit %s:", self.audit_id)
        log(
            logging.INFO,
            "\t├── M_%s: eps1=%.4g eps2=%.4g d=%d; true epsilon %.4g (budget %.4g)",
            mech.name,
            mech.epsilon_group,
            mech.epsilon_value,
            mech.num_groups,
            mech.epsilon,
            self.budget,
        )
        log(
            logging.INFO,
            "\t└── metric %s, confidence %.3g, group sizes %s",
            self.metric,
            self.confidence,
            "known (simulation)" if self.group_sizes is not None else "estimated",
        )

    def request(self) -> LdpAuditRequest:
        """The audit's typed request: the public parameters a node needs (it recomputes the
        true epsilon itself)."""
        mech = self.mechanism
        return LdpAuditRequest(
            mechanism=mech.name,
            epsilon_group=float(mech.epsilon_group),
            epsilon_value=float(mech.epsilon_value),
            num_groups=int(mech.num_groups),
            budget=self.budget,
            metric=self.metric,
            audit_id=self.audit_id,
            undefined_category=self.undefined_category,
            grid_size=int(mech.grid_size) if isinstance(mech, NPRRMechanism) else 1,
        )

    def audit_config(self) -> ConfigRecord:
        """The request as the wire's ``ConfigRecord``."""
        return ConfigRecord({**self.request().to_fields()})

    def configure_audit(self, arrays: ArrayRecord, node_ids: Iterable[int]) -> list[Message]:
        """One audit message per node, carrying the model and the audit config."""
        content = RecordDict({"arrays": arrays, CONFIG_KEY: self.audit_config()})
        return [
            Message(content=content, dst_node_id=node_id, message_type=AUDIT_MESSAGE_TYPE)
            for node_id in node_ids
        ]

    def check_reply(
        self, reply: Message, *, max_users: int | None = None
    ) -> tuple[ReportSummary, int, int]:
        """Validate one reply and summarise its reports; ``ValueError`` says what is wrong.

        Besides shapes and types: M_R values must be in {-1, +1}; M_L values must be exact
        multiples of its grid step within its clamp (``mechanism.report_bound``), the only
        values its sampler can produce; num-reports, num-refused and num-undefined must be whole
        numbers >= 0, num-reports must match the arrays, and, if ``max_users`` (the users
        the node said it hosts) is given, their sum must not exceed it.

        Returns
        -------
        (ReportSummary, int, int)
            The reports' summary, the refused users and the undefined users.
        """
        if reply.has_error():
            raise ValueError(f"client error: {short_reason(reply.error.reason)}")
        content = reply.content
        typed = LdpAuditReply.from_fields(
            content.array_records.get(REPORTS_KEY), content.metric_records.get(METRICS_KEY, {})
        )
        groups, values = typed.groups, typed.values
        num_groups = self.mechanism.num_groups
        if groups.size and (groups.min() < 0 or groups.max() >= num_groups):
            raise ValueError(f"group out of range [0, {num_groups - 1}]")
        if not np.all(self.mechanism.is_valid_report_value(values)):
            if isinstance(self.mechanism, LaplaceMechanism):
                domain = (
                    f"(multiples of {GRID_STEP:g} with |v'| <= {self.mechanism.report_bound:g})"
                )
            elif isinstance(self.mechanism, PiecewiseMechanism):
                step, bound = self.mechanism.grid.step, self.mechanism.report_bound
                domain = f"(its grid points, multiples of {step:g} with |v'| <= {bound:g})"
            elif isinstance(self.mechanism, NPRRMechanism):
                grid = self.mechanism.grid_size
                domain = f"(its grid points 2 z / {grid} - 1 for integers z in [0, {grid}])"
            else:
                domain = "{-1, +1}"
            raise ValueError(f"values outside M_{self.mechanism.name}'s output domain {domain}")
        declared, refused, undefined = typed.num_reports, typed.num_refused, typed.num_undefined
        if max_users is not None and declared + refused + undefined > max_users:
            raise ValueError(
                f"the reply accounts for {declared + refused + undefined} users "
                f"(num-reports {declared} + num-refused {refused} + num-undefined "
                f"{undefined}), more than the {max_users} the node described"
            )
        if self.mechanism.name == "R":
            values = values.astype(np.int8)
        return (
            ReportSummary.from_reports(groups.astype(np.int64), values, num_groups),
            refused,
            undefined,
        )

    def node_cap(self) -> NodeCap:
        """The per-node cap over the sizes the nodes described (``max_users_per_node``)."""
        return NodeCap.resolve(self.max_users_per_node, (self.users_by_node or {}).values())

    def aggregate_audit(
        self,
        sent_to: Sequence[int],
        replies: Iterable[Message],
        *,
        excluded: Sequence[ExcludedNode] = (),
    ) -> AuditOutcome:
        """Validate replies, refuse those over the per-node cap, merge accepted reports,
        estimate and check each node's influence; never raises on bad replies.
        ``excluded``: the nodes :meth:`start` left out (recorded in the outcome)."""
        limits = self.users_by_node or {}
        replies_sorted = sort_replies(
            sent_to,
            replies,
            lambda reply, node: self.check_reply(reply, max_users=limits.get(node)),
            METRICS_KEY,
        )
        cap = refuse_over_cap(
            replies_sorted,
            lambda item: item[0].num_reports + item[1] + item[2],
            self.max_users_per_node,
            limits,
        )
        total = ReportSummary.empty(self.mechanism.num_groups)
        for _, (summary, _, _) in replies_sorted.accepted:
            total = total.merge(summary)
        refused = sum(item[1] for _, item in replies_sorted.accepted)
        undefined = sum(item[2] for _, item in replies_sorted.accepted)
        rejected, ledgers = replies_sorted.rejected, replies_sorted.ledgers
        missing = replies_sorted.missing(sent_to)
        totals = ledgers.merged()
        estimate, error_text = None, None
        try:
            estimate = estimate_gap(
                total,
                self.mechanism,
                group_sizes=self.group_sizes,
                confidence=self.confidence,
                undefined_category=self.undefined_category,
            )
        except (EstimationError, ValueError) as error:
            error_text = str(error)
        influence = None
        if estimate is not None:
            try:  # post-processing of the accepted reports (group sizes estimated)
                influence = gap_node_influence(
                    {node: item[0] for node, item in replies_sorted.accepted},
                    self.mechanism,
                    metric=self.metric,
                    undefined_category=self.undefined_category,
                    alpha=1.0 - self.confidence,
                )
            except EstimationError:
                influence = None
            if influence is not None and influence.flagged:
                log(logging.WARNING, "LDP audit: %s", influence.summary())
        for item in rejected:
            log(
                logging.WARNING,
                "LDP audit: rejected reply from node %d: %s",
                item.node_id,
                item.reason,
            )
        if missing:
            log(logging.WARNING, "LDP audit: no reply from %d node(s)", len(missing))
        return AuditOutcome(
            estimate=estimate,
            reports=total,
            nodes_sent=len(sent_to),
            nodes_replied=len(replies_sorted.replied),
            accepted_nodes=len(replies_sorted.accepted),
            rejected=tuple(rejected),
            missing_nodes=missing,
            refused_users=refused,
            undefined_users=undefined,
            error=error_text,
            epsilon_spent_max=None if totals is None else totals.epsilon,
            ledger_totals=totals,
            metric=self.metric,
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
    ) -> AuditOutcome:
        """Run the audit and return the outcome.

        ``node_ids``: the nodes to ask (default: every connected node). A job that runs
        several audits passes the federation it started with, so that a node lost in one
        audit is counted missing in the next, not forgotten. A node that describes more
        users than the per-node cap (``max_users_per_node``) is not asked."""
        self.summary()
        node_ids = sorted(grid.get_node_ids() if node_ids is None else set(node_ids))
        asked, excluded = exclude_over_cap(
            node_ids, self.users_by_node or {}, self.node_cap(), "LDP audit"
        )
        messages = self.configure_audit(arrays, asked)
        replies = send_and_receive(grid, messages, timeout)
        return self.aggregate_audit(asked, replies, excluded=excluded)
