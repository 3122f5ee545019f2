"""The rate-report job: train with FedAvg, then every rate metric per group from one private
report per user, at each epsilon of ``epsilons``.

Each user's joint (group, confusion cell) category is perturbed once on its node by a
frequency oracle (GRR, OUE or subset selection: Wang, Blocki, Li and Jha, "Locally
differentially private protocols for frequency estimation", USENIX Security 2017; run-config
key ``oracle``, "best" by variance), and the server reads selection rate, TPR, FPR, FNR, TNR,
accuracy, precision and NPV per group, fairlearn's summaries (demographic parity, equalized
odds, equal opportunity: difference and ratio) and the four-fifths verdict from the same
reports (:class:`~fedparity.strategies.rate_report.RateReportAudit`). Each user is charged
once per report, whatever is read from it. The simulation harness computes the true rates of
the same users (never private), and results.json plus report.html go to ``output-dir``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flwr.common import log
from flwr.serverapp import Grid

from ..clients.project.config import RunConfig
from ..mechanisms.formatting import format_number
from ..strategies.rate_report import RateReportAudit, RateReportOutcome
from ..strategies.release_series import DurableReleases, LdpAuditSeries, Release, SeriesObserver
from .harness import rate_truth
from .html_report import Finding, Report, Section, Table, Value, write_report
from .ldp_job import ldp_privacy, missing_contributions, node_cap_setting
from .orchestration import connect_and_train, harness_applies, training_report
from .report import (
    influence_blocks,
    ldp_privacy_blocks,
    no_totals_reason,
    node_findings,
    privacy_ledger_text,
    write_json,
)
from .results import LdpPrivacy, RateReportRecord, RateReportResults
from .run_record import RunRecord, open_run_record

__all__ = ["rate_findings", "rate_report_page", "run_rate_report"]

#: The derived metrics the headline gives, in fairlearn's names and order.
HEADLINE_METRICS = (
    "demographic_parity_difference",
    "demographic_parity_ratio",
    "equalized_odds_difference",
    "equal_opportunity_difference",
)


class RateReportLog(SeriesObserver):
    """The job's console lines around each report: which one before it is recorded and sent,
    its demographic parity and four-fifths verdict (or why there is none) after it."""

    def __init__(self, config: RunConfig) -> None:
        self.budgets = list(config.epsilons)

    def before_release(self, index: int, release: Release) -> None:
        log(
            logging.INFO,
            "[RATE REPORT %d/%d] epsilon %g",
            index + 1,
            len(self.budgets),
            self.budgets[index],
        )

    def after_release(self, index: int, release: Release, outcome: RateReportOutcome) -> None:
        missing = missing_contributions(outcome)
        if outcome.rates is None:
            log(
                logging.WARNING,
                "\t└──> no rates: %s",
                "; ".join(filter(None, [outcome.error, missing])),
            )
            return
        log(
            logging.INFO,
            "\t└──> demographic parity difference %s, ratio %s from %d reports%s",
            outcome.rates.demographic_parity_difference(),
            outcome.rates.demographic_parity_ratio(),
            outcome.num_reports,
            f" ({missing})" if missing else "",
        )


def _estimate_text(estimate: Mapping[str, Any]) -> str:
    low, high = estimate.get("lower"), estimate.get("upper")
    value = estimate.get("value")
    if value is None:
        return f"n/a ({estimate.get('note') or 'no estimate'})"
    shown = (
        f"{value:.4f} [{low:.4f}, {high:.4f}]"
        if low is not None and high is not None
        else (f"{value:.4f}")
    )
    return shown


def rate_findings(results: RateReportResults | Mapping[str, Any]) -> list[Finding]:
    """The headline of a rate report (from its results, or its results.json): per epsilon,
    demographic parity (difference and ratio), equalized odds and equal opportunity with their
    intervals and the four-fifths verdict; the true values where the harness knows them."""
    results = RateReportResults.coerce(results)
    findings: list[Finding] = []
    for number, report in enumerate(results.reports or [], start=1):
        budget = Value(f"report-{number}-budget", report.budget, "g")
        rates = report.rates
        if rates is None:
            findings.append(
                Finding(("At epsilon = ", budget, f": no rates ({report.error})"), "bad")
            )
            continue
        derived = rates["derived"]
        parts: list[Any] = ["At epsilon = ", budget, ": "]
        for index, name in enumerate(HEADLINE_METRICS):
            estimate = derived[name]
            parts.append(("" if index == 0 else "; ") + name.replace("_", " ") + " ")
            parts.append(_estimate_text(estimate))
        parts.append(f". {rates['four_fifths']['sentence']}")
        verdict = rates["four_fifths"]["verdict"]
        findings.append(Finding(tuple(parts), "bad" if verdict == "fails" else "info"))
    for report in results.reports or []:
        findings += node_findings(
            (f"At epsilon = {format_number(report.budget, 'g')}: ",),
            report.excluded_nodes,
            report.influence or [],
        )
    truth = results.ground_truth
    if truth is not None:
        derived = truth["rates"]["derived"]
        findings.append(
            Finding(
                (
                    "True values (simulation harness only, not private): ",
                    "; ".join(
                        f"{name.replace('_', ' ')} {_estimate_text(derived[name]).split(' [')[0]}"
                        for name in HEADLINE_METRICS
                    ),
                )
            )
        )
    return findings


def _rates_table(report: RateReportRecord) -> Table:
    rates = report.rates or {}
    by_group = rates.get("by_group", {})
    groups = rates.get("groups", [])
    rows = [
        [metric.replace("_", " "), *(_estimate_text(values[g]) for g in groups)]
        for metric, values in by_group.items()
    ]
    return Table(
        ["metric", *(f"group {g}" for g in groups)],
        rows,
        caption=f"Every rate per group at epsilon {report.budget:g} ({report.num_reports} reports, "
        f"oracle {report.oracle})",
    )


def rate_report_page(results: RateReportResults | Mapping[str, Any]) -> Report:
    """The HTML report of a rate report, built from its results (or its results.json)."""
    results = RateReportResults.coerce(results)
    config = results.run_config or {}
    detail: list[Any] = [
        f"{results.num_nodes} node(s), {results.num_users} user(s); model trained with FedAvg "
        f"for {(results.training or {}).get('rounds')} round(s). Each user's joint (group, "
        "confusion cell) category is perturbed once on the user's side with a frequency oracle "
        "(local differential privacy; Wang, Blocki, Li and Jha 2017); every rate below is read "
        "from the same reports, so each user was charged once per report.",
    ]
    detail.extend(_rates_table(report) for report in results.reports or [] if report.rates)
    detail += influence_blocks(
        [
            (report.budget, check)
            for report in results.reports or []
            for check in report.influence or []
        ],
        [item for report in results.reports or [] for item in report.excluded_nodes or []],
    )
    return Report(
        title="fedparity rate report",
        question="Do the groups get the same selection rate, TPR and FPR, measured under local "
        "differential privacy?",
        headline=rate_findings(results),
        sections=[Section("Rates", detail)],
        privacy=Section(
            "Privacy spent",
            ldp_privacy_blocks(
                results.privacy or LdpPrivacy(),
                no_totals_reason(report.accepted_nodes for report in results.reports or []),
            ),
        ),
        notes=[
            f"{config.get('confidence', 0.95) * 100:g}% intervals (simultaneous across groups "
            "for the summaries); results.json holds every number."
        ],
    )


def rate_report_for(
    config: RunConfig, budget: float, *, audit_id: str, users_by_node: Mapping[int, int]
) -> RateReportAudit:
    """One rate report at ``budget`` with the run config's oracle, groups, confidence and
    per-node cap (``max-users-per-node``)."""
    return RateReportAudit.for_budget(
        budget,
        num_groups=config.num_groups,
        oracle=config.oracle,
        confidence=config.confidence,
        audit_id=audit_id,
        users_by_node=users_by_node,
        max_users_per_node=node_cap_setting(config),
    )


def _report(config: RunConfig, folder: Path, results: RateReportResults) -> None:
    """results.json, report.html and the summary on the console."""
    written = RateReportResults.from_dict(write_json(folder / "results.json", results.to_dict()))
    report_path = write_report(folder, rate_report_page(written))
    log(logging.INFO, "")
    for finding in rate_findings(written):
        log(logging.INFO, "%s", finding.plain())
    assert written.privacy is not None
    log(
        logging.INFO,
        "privacy spent per user by this run: %.4g of the planned %.4g (each node enforces its "
        "own budget)",
        written.privacy.epsilon_spent_per_user,
        config.user_budget,
    )
    why = no_totals_reason(report.accepted_nodes for report in written.reports or [])
    log(logging.INFO, "%s", privacy_ledger_text(written.privacy, why))
    log(logging.INFO, "results written to %s (report: %s)", folder, report_path)


def run_rate_report(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train, report every rate at every epsilon, write the results; the output folder."""
    record = record if record is not None else open_run_record(config)
    started = time.perf_counter()
    federation = connect_and_train(grid, config)
    node_ids, nodes, arrays = federation.node_ids, federation.nodes, federation.arrays
    train_losses, strategy = federation.train_losses, federation.strategy
    truth = rate_truth(config, arrays, nodes.partitions) if harness_applies(config, nodes) else None
    reports = [
        rate_report_for(
            config,
            budget,
            audit_id=f"rates-{index + 1}-eps-{budget:g}",
            users_by_node=nodes.users_by_node,
        )
        for index, budget in enumerate(config.epsilons)
    ]
    # Every report sent counts (nodes charge when they process it), recorded durably in
    # status.json before it is sent.
    series = LdpAuditSeries(
        reports, what="rate report {number} (epsilon {epsilon:.4g})", kind="rate-report"
    ).start(
        grid,
        arrays,
        timeout=config.reply_timeout,
        node_ids=node_ids,
        observers=[RateReportLog(config), DurableReleases(record=record)],
    )
    outcomes: Sequence[RateReportOutcome] = series.outcomes
    results = RateReportResults(
        task=config.task,
        run_config=dict(asdict(config).items()),
        num_nodes=len(node_ids),
        num_users=nodes.num_users,
        failed_describe=[{"node_id": n, "reason": r} for n, r in nodes.failed],
        training=training_report(config, train_losses, strategy),
        ground_truth=truth,
        reports=[
            RateReportRecord(budget=budget, **outcome.to_dict())
            for budget, outcome in zip(config.epsilons, outcomes, strict=True)
        ],
        privacy=ldp_privacy(config, outcomes, series.epsilon_spent),
        elapsed_seconds=time.perf_counter() - started,
    )
    _report(config, record.folder, results)
    record.finish("completed")
    return record.folder
