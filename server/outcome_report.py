"""results.json and report.html for a user's own ServerApp: the outcomes of
:class:`~fedparity.strategies.LdpGapAudit`, :class:`~fedparity.strategies.RateReportAudit` and
:class:`~fedparity.strategies.FedEvalFairProtocol` in the same page the built-in jobs write.

A ServerApp that ran its own training and then fedparity's strategies passes their outcomes::

    from fedparity.server.outcome_report import write_outcome_report

    write_outcome_report(output, [*series.outcomes, rates, test], run_config=context.run_config)

``results.json`` holds each outcome's ``to_dict()`` under ``outcomes`` (with its ``type`` and
``label``); ``report.html`` opens with one verdict line per outcome and gives each outcome's
summary (the lines its ``summary()`` prints) and its per-group table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..strategies.fedevalfair import FedEvalFairOutcome
from ..strategies.ldp_audit import AuditOutcome
from ..strategies.rate_report import RateReportOutcome
from ..strategies.sequential_audit import SequentialAuditOutcome
from .html_report import Finding, Report, Section, Table, write_report
from .report import holder_dp_line, node_findings, write_json

__all__ = ["Outcome", "OutcomeReportFiles", "write_outcome_report"]

#: What :func:`write_outcome_report` renders.
Outcome = AuditOutcome | RateReportOutcome | FedEvalFairOutcome | SequentialAuditOutcome

_TYPES: tuple[tuple[type, str], ...] = (
    (AuditOutcome, "ldp-audit"),
    (SequentialAuditOutcome, "sequential-audit"),
    (RateReportOutcome, "rate-report"),
    (FedEvalFairOutcome, "fedevalfair"),
)


@dataclass(frozen=True)
class OutcomeReportFiles:
    """Where :func:`write_outcome_report` wrote."""

    results_json: Path
    report_html: Path


def _type(outcome: object) -> str:
    for cls, name in _TYPES:
        if isinstance(outcome, cls):
            return name
    raise TypeError(
        "outcomes must be AuditOutcome, SequentialAuditOutcome, RateReportOutcome or "
        "FedEvalFairOutcome objects (what LdpGapAudit, SequentialLdpAudit, RateReportAudit and "
        f"FedEvalFairProtocol return), got "
        f"{type(outcome).__name__}"
    )


def _label(outcome: Outcome) -> str:
    if isinstance(outcome, AuditOutcome):
        return f"LDP audit of {outcome.metric or 'metric'}"
    if isinstance(outcome, RateReportOutcome):
        return f"Rate report ({outcome.oracle}, epsilon {outcome.epsilon:.4g})"
    if isinstance(outcome, SequentialAuditOutcome):
        return f"Sequential LDP audit (epsilon {outcome.epsilon:.4g})"
    return "FedEvalFair"


def _finding(label: str, outcome: Outcome) -> Finding:
    """The outcome's verdict line (the audit's gap, the rates' demographic parity and the
    four-fifths rule, FedEvalFair's stage 2 per calibrated test), red when a gap or unfairness
    is found or there is no result."""
    lines = outcome.summary().splitlines()
    if isinstance(outcome, FedEvalFairOutcome):
        verdicts = [
            block.summary()
            if block.report is None
            else f"{block.label}, {block.report.verdicts()[1]}"
            for block in outcome.blocks
            if block.mode != "paper"
        ]
        text = "; ".join(verdicts) or (lines[0] if lines else "no result")
        bad = any(
            block.report is not None and block.report.reject_fairness
            for block in outcome.blocks
            if block.mode != "paper"
        )
        tone = "bad" if bad or outcome.error else "info"
        return Finding((f"{label}: {text}",), tone)
    if isinstance(outcome, SequentialAuditOutcome):
        result = outcome.result
        bad = result is None or result.interval.low > 0
        return Finding(
            (f"{label}: {lines[0].removeprefix('sequential audit: ')}",), "bad" if bad else "info"
        )
    if isinstance(outcome, AuditOutcome):
        estimate = outcome.estimate
        verdict = lines[1].strip() if len(lines) > 1 else ""
        bad = estimate is None or estimate.max_gap_interval.low > 0
    elif outcome.rates is None:
        verdict, bad = f"no rates: {outcome.error}", True
    else:
        derived = outcome.rates.derived()
        four_fifths = outcome.rates.four_fifths()
        verdict = "; ".join(
            f"{name.replace('_', ' ')} {derived[name]}"
            for name in ("demographic_parity_difference", "demographic_parity_ratio")
        )
        verdict += f"; {four_fifths.sentence}"
        bad = four_fifths.verdict == "fails"
    return Finding((f"{label}: {verdict}",), "bad" if bad else "info")


def _node_findings(label: str, outcome: Outcome) -> list[Finding]:
    """The nodes the per-node cap left out of an LDP outcome and those its influence check
    flagged (none for FedEvalFair)."""
    if isinstance(outcome, FedEvalFairOutcome):
        return []
    checks = outcome.influence if isinstance(outcome, RateReportOutcome) else [outcome.influence]
    return node_findings(
        (f"{label}: ",),
        [item.to_dict() for item in outcome.excluded],
        [check.to_dict() for check in checks if check is not None],
    )


def _group_table(outcome: Outcome) -> Table | None:
    if isinstance(outcome, AuditOutcome) and outcome.estimate is not None:
        estimate = outcome.estimate
        rows = [
            [group, float(mean), float(stderr), float(size)]
            for group, (mean, stderr, size) in enumerate(
                zip(
                    estimate.group_means,
                    estimate.group_stderrs,
                    estimate.group_sizes,
                    strict=True,
                )
            )
        ]
        return Table(
            ["group", f"private mean {outcome.metric or 'metric'}", "standard error", "users"],
            rows,
            caption="sizes estimated from the reports" if estimate.sizes_estimated else "",
        )
    if isinstance(outcome, RateReportOutcome) and outcome.rates is not None:
        rates = outcome.rates
        by_group = rates.by_group
        overall = rates.overall
        return Table(
            ["metric", *(f"group {g}" for g in rates.groups), "overall"],
            [
                [metric, *(str(values[g]) for g in rates.groups), str(overall[metric])]
                for metric, values in by_group.items()
            ],
            caption=f"every rate per group, value [{100 * rates.confidence:g} % interval]",
        )
    return None


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_outcome_report(
    folder: str | Path,
    outcomes: Sequence[Outcome],
    *,
    title: str = "fedparity results",
    run_config: Mapping[str, object] | None = None,
    extra: Mapping[str, object] | None = None,
) -> OutcomeReportFiles:
    """Write ``folder/results.json`` and ``folder/report.html`` for ``outcomes``.

    Parameters
    ----------
    folder : str or Path
        Where to write (created if missing; both files are replaced).
    outcomes : sequence
        :class:`~fedparity.strategies.AuditOutcome`,
        :class:`~fedparity.strategies.RateReportOutcome` or
        :class:`~fedparity.strategies.FedEvalFairOutcome` objects, in the order to show.
    title : str
        The page's title.
    run_config : mapping, optional
        The run's config (e.g. ``context.run_config``), shown in the page and saved in
        results.json.
    extra : mapping, optional
        More top-level fields of results.json (JSON-ready), e.g. the privacy spent by a
        series: ``{"epsilon_spent_per_user": series.epsilon_spent}``.
    """
    types = [_type(outcome) for outcome in outcomes]  # refuse before writing anything
    if not outcomes:
        raise ValueError("outcomes must hold at least one outcome, got none")
    reserved = {"task", "run_config", "outcomes"} & set(extra or {})
    if reserved:
        raise ValueError(f"extra must not set {sorted(reserved)}: write_outcome_report sets them")
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    labels = [_label(outcome) for outcome in outcomes]
    config = {str(key): _clean(value) for key, value in (run_config or {}).items()}
    results_json = folder / "results.json"
    write_json(
        results_json,
        {
            "task": "own-app",
            "run_config": config or None,
            "outcomes": [
                {"type": kind, "label": label, **outcome.to_dict()}
                for kind, label, outcome in zip(types, labels, outcomes, strict=True)
            ],
            **(extra or {}),
        },
    )
    sections = []
    for label, outcome in zip(labels, outcomes, strict=True):
        lines = outcome.summary().splitlines()
        # the LDP and rate summaries open with the label, which is the section's title here
        # (the sequential audit's first line is its verdict, kept)
        opens_with_label = not isinstance(outcome, FedEvalFairOutcome | SequentialAuditOutcome)
        blocks: list[Any] = lines[1:] if opens_with_label else lines
        if isinstance(outcome, FedEvalFairOutcome) and outcome.holder_dp is not None:
            blocks.append(holder_dp_line(outcome.holder_dp))
        table = _group_table(outcome)
        if table is not None:
            blocks.append(table)
        sections.append(Section(label, blocks))
    report = Report(
        title=title,
        question="Does the model serve every group equally, measured without collecting "
        "anyone's group?",
        headline=[_finding(label, outcome) for label, outcome in zip(labels, outcomes, strict=True)]
        + [
            finding
            for label, outcome in zip(labels, outcomes, strict=True)
            for finding in _node_findings(label, outcome)
        ],
        sections=sections,
        privacy=Section(
            "Privacy spent",
            [
                "Every LDP release above was charged to the users' privacy ledgers on their "
                "nodes, which enforce their own budgets; the line of each section that starts "
                '"the most any user" gives the total the nodes reported (none if no node '
                "sent totals: nodes with fewer users than their min-users-for-counts send "
                "none). FedEvalFair releases encrypted statistics; in its holder-level DP mode "
                "(fef-dp-epsilon) its section says the noise and what was charged."
            ],
        ),
        notes=["results.json holds every number."],
        run_config=config or None,
    )
    return OutcomeReportFiles(results_json, write_report(folder, report))
