"""The LDP audit job: train with FedAvg, then audit the gap under LDP.

The audit runs the mechanisms M_R / M_L of Marc Juarez and Aleksandra Korolova, "'You Can't Fix
What You Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
Learning", AFCP workshop, PMLR, 2022, with their true epsilon and a budget split that respects
it (:mod:`fedparity.mechanisms.ldp.calibration`; the paper's Theorem 5, and its Theorem 6 for
k != 2, are false), and M_P (the Piecewise mechanism of Wang et al., "Collecting and Analyzing
Multidimensional Data with Local Differential Privacy", ICDE 2019, on the value).

Nodes host shards of users; ``num-server-rounds`` FedAvg rounds train a logistic regression;
then one LDP audit per value of ``epsilons`` measures the gap of ``metric`` between groups;
the table puts the private estimate next to the true gap (computed by the simulation
harness only), and results.json plus a plot go to ``output-dir``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from flwr.common import log
from flwr.serverapp import Grid

from ..clients.project.config import RunConfig
from ..mechanisms.ldp.node_influence import AUTO_CAP, UserCap
from ..strategies.ldp_audit import AuditOutcome, LdpGapAudit
from ..strategies.rate_report import RateReportOutcome
from ..strategies.release_series import DurableReleases, LdpAuditSeries, Release, SeriesObserver
from ..strategies.replies import NodeLedgerReports
from .harness import GroundTruth, ground_truth
from .html_report import write_report
from .orchestration import connect_and_train, harness_applies, training_report
from .report import (
    audit_table,
    ldp_findings,
    ldp_report,
    no_totals_reason,
    plot_audits,
    privacy_ledger_text,
    write_json,
)
from .results import AuditRecord, LdpAuditResults, LdpPrivacy
from .run_record import RunRecord, open_run_record


def ldp_audit_for(
    config: RunConfig,
    budget: float,
    *,
    audit_id: str,
    users_by_node: Mapping[int, int],
    group_sizes: Sequence[int] | None = None,
) -> LdpGapAudit:
    """One audit at ``budget`` with the run config's mechanism, groups, metric, confidence
    and per-node cap (``max-users-per-node``)."""
    return LdpGapAudit.for_budget(
        config.mechanism,
        budget,
        num_groups=config.num_groups,
        metric=config.metric,
        confidence=config.confidence,
        group_sizes=group_sizes,
        audit_id=audit_id,
        users_by_node=users_by_node,
        max_users_per_node=node_cap_setting(config),
    )


def node_cap_setting(config: RunConfig) -> UserCap:
    """The strategies' ``max_users_per_node`` for the run config's ``max-users-per-node``
    (``""``: ``"auto"``)."""
    return AUTO_CAP if config.max_users_per_node is None else config.max_users_per_node


def missing_contributions(outcome: AuditOutcome | RateReportOutcome) -> str:
    """Who did not contribute to an audit and why, in words ("" if everyone did): users that
    refused (their privacy budget is spent), rejected replies, nodes that did not reply, nodes
    the per-node cap left out."""
    parts = []
    if outcome.refused_users:
        parts.append(
            f"{outcome.refused_users} user(s) refused: their privacy budget is spent "
            "(each node's user-epsilon-budget)"
        )
    if outcome.rejected:
        parts.append(f"{len(outcome.rejected)} node repl(ies) rejected")
    if outcome.missing_nodes:
        parts.append(f"{len(outcome.missing_nodes)} node(s) did not reply")
    if outcome.excluded:
        parts.append(
            f"{len(outcome.excluded)} node(s) left out: more users than the per-node cap "
            "(max-users-per-node)"
        )
    return "; ".join(parts)


def log_audit_outcome(outcome: AuditOutcome, confidence: float) -> None:
    """One console line per audit: the gap and its interval, or why there is none, with who
    did not contribute (:func:`missing_contributions`)."""
    missing = missing_contributions(outcome)
    if outcome.estimate is None:
        log(
            logging.WARNING,
            "\t└──> no estimate: %s",
            "; ".join(filter(None, [outcome.error, missing])),
        )
        return
    log(
        logging.INFO,
        "\t└──> gap %.4f, %g%% interval [%.4f, %.4f] from %d reports%s",
        outcome.estimate.max_gap,
        100 * confidence,
        outcome.estimate.max_gap_interval.low,
        outcome.estimate.max_gap_interval.high,
        outcome.estimate.num_reports,
        f" ({missing})" if missing else "",
    )


class AuditLog(SeriesObserver):
    """The job's console lines around each audit of a series: which one, before it is
    recorded and sent; its gap (or why there is none) after it."""

    def __init__(
        self, config: RunConfig, prefix: str = "[AUDIT {number}/{count}] epsilon {budget:g}"
    ) -> None:
        self.budgets = list(config.epsilons)
        self.confidence = config.confidence
        self.prefix = prefix

    def before_release(self, index: int, release: Release) -> None:
        line = self.prefix.format(
            number=index + 1, count=len(self.budgets), budget=self.budgets[index]
        )
        log(logging.INFO, "%s", line)

    def after_release(self, index: int, release: Release, outcome: AuditOutcome) -> None:
        log_audit_outcome(outcome, self.confidence)


def ldp_privacy(
    config: RunConfig, outcomes: Sequence[AuditOutcome | RateReportOutcome], spent: float
) -> LdpPrivacy:
    """results.json's ``privacy``: the server's plan, this run's spending (``spent``: basic
    composition of every audit or rate report sent) and what the nodes' ledgers reported."""
    reported = [o.ledger_totals.epsilon for o in outcomes if o.ledger_totals is not None]
    ledgers = NodeLedgerReports()
    for outcome in outcomes:  # in order: a node's latest totals are kept
        ledgers.update(outcome.ledger_reports)
    ledger_totals = ledgers.merged()
    return LdpPrivacy(
        # The server's plan only: each node's own policy (user-epsilon-budget at user-delta,
        # kept in its ledger) decides what its users answer, and users past it refuse.
        user_budget=config.user_budget,
        epsilon_spent_per_user=spent,
        composition="basic sequential composition of the true epsilons of every audit "
        "sent (an upper bound: users who refused spent less)",
        # Over every run the nodes' ledgers recorded (a run that died included): the most
        # any user of the reporting nodes has spent. None if no node reported it.
        epsilon_spent_total_max_reported_by_nodes=max(reported) if reported else None,
        # The same with its delta, basic composition beside it and the neighbouring
        # relation: every release the nodes' per-user ledgers recorded (LDP audits and FPFL
        # trainings), composed with the PLD accountant.
        ledger_totals_reported_by_nodes=None if ledger_totals is None else ledger_totals.to_dict(),
        ledger_totals_by_node=ledgers.by_node_dict(),
        new_ledger_nodes=sorted(ledgers.new_ledger_nodes),
    )


def _report_audits(
    config: RunConfig,
    output_dir: Path,
    results: LdpAuditResults,
    outcomes: Sequence[AuditOutcome],
    truth: GroundTruth | None,
) -> None:
    """results.json, the plot, report.html and the summary on the console."""
    written = LdpAuditResults.from_dict(write_json(output_dir / "results.json", results.to_dict()))
    plot_note = plot_audits(
        output_dir / "gap_vs_epsilon.png", config.epsilons, outcomes, truth, config.metric
    )
    report_path = write_report(output_dir, ldp_report(written, output_dir, plot_note))
    contributed = max((o.accepted_nodes for o in outcomes), default=0)
    reports = max((o.reports.num_reports for o in outcomes), default=0)
    assert results.num_nodes is not None and results.privacy is not None
    for line in (
        "",
        *(finding.plain() for finding in ldp_findings(written)),
        "",
        f"LDP audit of the {config.metric} gap (reports from up to {contributed} of "
        f"{results.num_nodes} node(s) and {reports} of {results.num_users} user(s); per audit "
        "in the table):",
        *audit_table(config.epsilons, outcomes, truth).splitlines(),
        "",
    ):
        log(logging.INFO, "%s", line)
    if plot_note:
        log(logging.WARNING, "%s", plot_note)
    log(
        logging.INFO,
        "privacy spent per user by this run: %.4g of the planned %.4g (each node enforces its "
        "own budget)",
        results.privacy.epsilon_spent_per_user,
        config.user_budget,
    )
    why = no_totals_reason(outcome.accepted_nodes for outcome in outcomes)
    log(logging.INFO, "%s", privacy_ledger_text(results.privacy, why))
    log(logging.INFO, "results written to %s (report: %s)", output_dir, report_path)


def run_ldp_audit(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train, audit at every epsilon, report; returns the output directory."""
    record = record if record is not None else open_run_record(config)
    output_dir = record.folder
    started = time.perf_counter()
    federation = connect_and_train(grid, config)
    node_ids, nodes, arrays = federation.node_ids, federation.nodes, federation.arrays
    train_losses, strategy = federation.train_losses, federation.strategy

    truth: GroundTruth | None = None
    if harness_applies(config, nodes):
        truth = ground_truth(config, arrays, nodes.partitions)
        log(
            logging.INFO,
            "harness (not private): true %s group means %s, gap %.4f",
            config.metric,
            ", ".join(f"{m:.4f}" for m in truth.group_means),
            truth.max_gap,
        )
    audits = [
        ldp_audit_for(
            config,
            budget,
            audit_id=f"audit-{index + 1}-eps-{budget:g}",
            users_by_node=nodes.users_by_node,
            group_sizes=truth.group_counts if (truth and config.group_sizes == "known") else None,
        )
        for index, budget in enumerate(config.epsilons)
    ]
    # Nodes charge their users' ledgers when they process the audit, whether or not their
    # reply arrives or is accepted: every audit sent counts (an upper bound), recorded
    # durably in status.json before it is sent (the series' durable observer).
    series = LdpAuditSeries(audits).start(
        grid,
        arrays,
        timeout=config.reply_timeout,
        node_ids=node_ids,
        observers=[AuditLog(config), DurableReleases(record=record)],
    )
    outcomes: list[AuditOutcome] = list(series.outcomes)
    spent = series.epsilon_spent

    results = LdpAuditResults(
        task=config.task,
        run_config={key: value for key, value in asdict(config).items()},
        num_nodes=len(node_ids),
        num_users=nodes.num_users,
        failed_describe=[{"node_id": n, "reason": r} for n, r in nodes.failed],
        training=training_report(config, train_losses, strategy),
        ground_truth=None if truth is None else truth.to_dict(),
        audits=[
            AuditRecord.of(budget, outcome)
            for budget, outcome in zip(config.epsilons, outcomes, strict=True)
        ],
        privacy=ldp_privacy(config, outcomes, spent),
        elapsed_seconds=time.perf_counter() - started,
    )
    _report_audits(config, output_dir, results, outcomes, truth)
    record.finish("completed")
    return output_dir
