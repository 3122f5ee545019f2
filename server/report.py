"""Human- and machine-readable output of a run: table, results.json, plots, and the content of
the HTML report (headline findings and detail) of the LDP audit and FedEvalFair jobs."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..mechanisms.fairness_tests.fedevalfair import (
    AFTER_STAGE1_WITHOUT_RANDOM_EFFECTS,
    EQUIVALENCE_VERDICTS,
    FAIRNESS_VERDICTS,
    HOMOGENEITY_VERDICTS,
    METRIC_NAMES,
    PAPER_MODE_WARNING,
    tau2_high_text,
)
from ..mechanisms.formatting import format_number
from ..mechanisms.ldp.estimators import GAP_VERDICTS, normal_quantile
from ..mechanisms.ldp.node_influence import NodeInfluence
from ..strategies.fedevalfair import block_label
from ..strategies.ldp_audit import AuditOutcome
from ..strategies.replies import LedgerTotals
from .harness import GroundTruth
from .html_report import Figure, Finding, Report, Section, Table, Value
from .results import AuditRecord, FedEvalFairResults, LdpAuditResults, LdpPrivacy

#: What a plot function returns when matplotlib (the optional extra ``plot``) is missing.
PLOT_NEEDS_MATPLOTLIB = (
    "matplotlib is not installed (pip install 'fedparity[plot]'): no plot written"
)

#: Why a private rate can print below 0 or above 1.
NOISY_RATES_NOTE = (
    "rates estimated from noisy (differentially private) statistics can fall below 0 or above "
    "1: the noise is unbiased, so a small rate plus noise can be negative; the estimate stays "
    "valid and its interval says how far the noise reaches"
)


def load_pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plain_tick_labels(axes: Any) -> None:
    """Label both axes of ``axes`` in plain numbers: 0.5, 1, 2, 4 on a log axis (not
    "6x10^-1"), and no offset or scientific factor on a linear one."""
    from matplotlib.ticker import FuncFormatter, NullFormatter, ScalarFormatter

    for axis, scale in ((axes.xaxis, axes.get_xscale()), (axes.yaxis, axes.get_yscale())):
        if scale == "log":
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())
        elif scale == "linear":
            formatter = ScalarFormatter(useOffset=False)
            formatter.set_scientific(False)
            axis.set_major_formatter(formatter)


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Write ``payload`` as JSON (NaN and infinity as null); returns what was written."""
    cleaned = _clean(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cleaned, indent=2, allow_nan=False) + "\n")
    return cleaned


def audit_table(
    budgets: Sequence[float], outcomes: Sequence[AuditOutcome], truth: GroundTruth | None
) -> str:
    """One row per audit: private estimate next to the (harness-only) true gap."""
    header = (
        f"{'eps':>6} {'mech':>4} {'eps1':>7} {'eps2':>7} {'gap est':>8} {'interval':>17} "
        f"{'+/- normal':>10} {'+/- Cheb.':>9} {'true gap*':>9} {'reports':>8} "
        f"{'rejected':>8} {'missing':>7}"
    )
    lines = [header, "-" * len(header)]
    for budget, outcome in zip(budgets, outcomes, strict=True):
        estimate = outcome.estimate
        true_gap = "" if truth is None else f"{truth.max_gap:.4f}"
        if estimate is None:
            lines.append(
                f"{budget:>6g} {'-':>4} {'':>7} {'':>7} {'n/a':>8} {'':>17} {'':>10} {'':>9} "
                f"{true_gap:>9} {outcome.reports.num_reports:>8} {len(outcome.rejected):>8} "
                f"{len(outcome.missing_nodes):>7}   ({outcome.error})"
            )
            continue
        index = estimate.pairs.index(estimate.max_gap_pair)
        interval = (
            estimate.gap_intervals[index] if estimate.num_groups == 2 else estimate.max_gap_interval
        )
        lines.append(
            f"{budget:>6g} {'M_' + estimate.mechanism:>4} {estimate.epsilon_group:>7.3f} "
            f"{estimate.epsilon_value:>7.3f} {estimate.max_gap:>8.4f} "
            f"{f'[{interval.low:.3f}, {interval.high:.3f}]':>17} "
            f"{estimate.normal_halfwidths[index]:>10.4f} "
            f"{estimate.chebyshev_halfwidths[index]:>9.4f} {true_gap:>9} "
            f"{estimate.num_reports:>8} {len(outcome.rejected):>8} "
            f"{len(outcome.missing_nodes):>7}"
        )
    if truth is not None:
        lines.append("* true gap: simulation harness only (computed from raw data, not private)")
    return "\n".join(lines)


def plot_audits(
    path: Path,
    budgets: Sequence[float],
    outcomes: Sequence[AuditOutcome],
    truth: GroundTruth | None,
    metric: str,
) -> str | None:
    """Estimate and interval per epsilon (PNG). Returns None, or why no plot was written."""
    plt = load_pyplot()
    if plt is None:
        return PLOT_NEEDS_MATPLOTLIB
    points = [
        (budget, outcome.estimate)
        for budget, outcome in zip(budgets, outcomes, strict=True)
        if outcome.estimate is not None
    ]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    if points:
        xs = [budget for budget, _ in points]
        ys, lows, highs, cheb = [], [], [], []
        for _, estimate in points:
            index = estimate.pairs.index(estimate.max_gap_pair)
            interval = (
                estimate.gap_intervals[index]
                if estimate.num_groups == 2
                else estimate.max_gap_interval
            )
            ys.append(estimate.max_gap)
            lows.append(estimate.max_gap - interval.low)
            highs.append(interval.high - estimate.max_gap)
            cheb.append(estimate.chebyshev_halfwidths[index])
        axes.errorbar(
            xs,
            ys,
            yerr=cheb,
            fmt="none",
            ecolor="0.75",
            elinewidth=6,
            alpha=0.6,
            label="Chebyshev bound (paper)",
        )
        level = f"{100 * points[0][1].confidence:g}%"
        axes.errorbar(
            xs,
            ys,
            yerr=[lows, highs],
            fmt="o",
            color="C0",
            capsize=4,
            label=f"private estimate, {level} interval",
        )
    if truth is not None and math.isfinite(truth.max_gap):
        axes.axhline(truth.max_gap, color="C3", linestyle="--", label="true gap (harness only)")
    axes.set_xscale("log")
    axes.set_xticks(sorted(set(budgets)))
    plain_tick_labels(axes)
    axes.set_xlabel("LDP budget epsilon per user")
    axes.set_ylabel(f"{metric} gap between groups")
    axes.set_title("Private measurement of the performance gap")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# The HTML report: LDP audit
# --------------------------------------------------------------------------------------------


def _interval(estimate: Mapping[str, Any]) -> tuple[float, float]:
    """The interval of the largest gap (for two groups, the pair's interval)."""
    low, high = estimate["max_gap_interval"]
    return float(low), float(high)


def _noisy_rates(estimates: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        mean is not None and not 0.0 <= mean <= 1.0
        for estimate in estimates
        for mean in estimate["group_means"]
    )


def ldp_findings(results: LdpAuditResults | Mapping[str, Any]) -> list[Finding]:
    """The headline of an LDP audit (from its results, or its results.json): the gap and its
    interval per audit, and the true gap where the simulation harness knows it."""
    results = LdpAuditResults.coerce(results)
    metric = (results.run_config or {})["metric"]
    findings: list[Finding] = []
    for number, audit in enumerate(results.audits or [], start=1):
        budget = Value(f"audit-{number}-budget", audit.budget, "g")
        estimate = audit.estimate
        if estimate is None:
            findings.append(
                Finding(("At epsilon = ", budget, f": no estimate ({audit.error})"), "bad")
            )
            continue
        low, high = _interval(estimate)
        first, second = estimate["max_gap_pair"]
        detected = low > 0
        findings.append(
            Finding(
                (
                    "At epsilon = ",
                    budget,
                    f": the {metric} gap between groups {first} and {second} is ",
                    Value(f"audit-{number}-gap", estimate["max_gap"]),
                    f", {100 * estimate['confidence']:g}% interval [",
                    Value(f"audit-{number}-low", low),
                    ", ",
                    Value(f"audit-{number}-high", high),
                    "]: " + GAP_VERDICTS[0 if detected else 1],
                ),
                "bad" if detected else "info",
            )
        )
    for audit in results.audits or []:
        findings += node_findings(
            (f"At epsilon = {format_number(audit.budget, 'g')}: ",),
            audit.excluded_nodes,
            [audit.influence] if audit.influence else [],
        )
    truth = results.ground_truth
    if truth is not None and truth.get("max_gap") is not None:
        findings.append(
            Finding(
                (
                    f"True {metric} gap (simulation harness only, not private): ",
                    Value("true-gap", truth["max_gap"]),
                )
            )
        )
    return findings


def ldp_report(
    results: LdpAuditResults | Mapping[str, Any], folder: Path, plot_note: str | None
) -> Report:
    """The HTML report of an LDP audit, built from its results (or its results.json)."""
    results = LdpAuditResults.coerce(results)
    config = results.run_config or {}
    metric = config["metric"]
    audits_done = results.audits or []
    estimates = [a.estimate for a in audits_done if a.estimate is not None]
    detail: list[Any] = [
        f"{results.num_nodes} node(s), {results.num_users} user(s); model trained with "
        f"FedAvg for {(results.training or {})['rounds']} round(s). Each audit perturbs every "
        "user's group and metric value on the user's side (local differential privacy; Juarez "
        "and Korolova 2022), and the server estimates the group means and their gaps.",
        _audits_table(audits_done, metric),
        "Interval: normal approximation (simultaneous over the group pairs when there are more "
        "than two groups); the Chebyshev half width is the paper's worst-case bound.",
        _group_means_table(audits_done, metric),
        *influence_blocks(
            [(audit.budget, audit.influence) for audit in audits_done if audit.influence],
            [item for audit in audits_done for item in audit.excluded_nodes or []],
        ),
    ]
    if _noisy_rates(estimates):
        detail.append(f"Note: {NOISY_RATES_NOTE}.")
    for note in sorted({note for estimate in estimates for note in estimate["notes"]}):
        detail.append(f"Note: {note}.")
    truth = results.ground_truth
    if truth is not None:
        detail.append(
            Table(
                ["group", f"true mean {metric}", "users"],
                [
                    [group, mean, count]
                    for group, (mean, count) in enumerate(
                        zip(truth["group_means"], truth["group_counts"], strict=True)
                    )
                ],
                caption=f"Ground truth ({truth['label']})",
            )
        )
    detail.append(
        Figure(
            folder / "gap_vs_epsilon.png",
            "private estimate and interval per epsilon",
            missing=plot_note,
        )
    )
    return Report(
        title=f"fedparity LDP audit of the {metric} gap",
        question=f"How large is the {metric} gap between the groups, measured under local "
        "differential privacy?",
        headline=ldp_findings(results),
        sections=[Section("Audits", detail)],
        privacy=Section(
            "Privacy spent",
            ldp_privacy_blocks(
                results.privacy or LdpPrivacy(),
                no_totals_reason(audit.accepted_nodes for audit in results.audits or []),
            ),
        ),
        notes=[f"{config['confidence'] * 100:g}% intervals; results.json holds every number."],
    )


def _audits_table(audits_done: Sequence[AuditRecord], metric: str) -> Table:
    """One row per audit: the estimate of the largest gap, its interval and the counts."""
    rows = []
    for audit in audits_done:
        estimate = audit.estimate
        counts = [
            audit.num_reports,
            len(audit.rejected_replies or []),
            len(audit.missing_nodes or []),
            audit.refused_users,
        ]
        if estimate is None:
            rows.append([audit.budget, "-", None, None, None, "n/a", None, None, None, *counts])
            continue
        low, high = _interval(estimate)
        index = [list(p) for p in estimate["pairs"]].index(list(estimate["max_gap_pair"]))
        rows.append(
            [
                audit.budget,
                f"M_{estimate['mechanism']}",
                estimate["epsilon"],
                estimate["epsilon_group"],
                estimate["epsilon_value"],
                estimate["max_gap"],
                f"[{low:.4f},\u00a0{high:.4f}]",
                estimate["normal_halfwidths"][index],
                estimate["chebyshev_halfwidths"][index],
                *counts,
            ]
        )
    return Table(
        [
            "budget epsilon",
            "mechanism",
            "true epsilon",
            "epsilon group",
            "epsilon value",
            "gap",
            "interval",
            "+/- normal",
            "+/- Chebyshev",
            "reports",
            "rejected replies",
            "missing nodes",
            "refused users",
        ],
        rows,
        caption=f"One LDP audit per budget: private estimate of the largest {metric} gap",
    )


def _group_means_table(audits_done: Sequence[AuditRecord], metric: str) -> Table:
    """Every audit's private group means."""
    group_rows = []
    for audit in audits_done:
        estimate = audit.estimate
        if estimate is None:
            continue
        for group, (mean, stderr, size) in enumerate(
            zip(
                estimate["group_means"],
                estimate["group_stderrs"],
                estimate["group_sizes"],
                strict=True,
            )
        ):
            sized = f"{size:.0f}" + (" (estimated)" if estimate["sizes_estimated"] else "")
            group_rows.append([audit.budget, group, mean, stderr, sized])
    return Table(
        ["budget epsilon", "group", f"mean {metric}", "std. error", "group size"],
        group_rows,
        caption="Private group means",
    )


#: What the influence table's notes say about the check.
INFLUENCE_NOTE = (
    "Influence of each node (post-processing of the reports already received, no further "
    "privacy cost): the largest shift of the estimate when one node's reports are left out, "
    "in standard errors of the estimate; Cochran's Q across the nodes' own estimates of the "
    "same quantity (each with its variance as a sample of its users; nodes with too few "
    "reports to estimate alone are not tested), and the nodes whose own estimate deviates "
    "from the others' beyond the Bonferroni threshold (flagged). A node that claims invented "
    "users shows up here; how far it can move the answer is bounded by the per-node cap "
    "(max-users-per-node; docs/threat-model.md)."
)


def node_findings(
    prefix: tuple[str | Value, ...],
    excluded: Sequence[Mapping[str, Any]] | None,
    influences: Sequence[Mapping[str, Any]],
) -> list[Finding]:
    """Headline lines (tone "warn") of one exchange on its nodes: each node the per-node cap
    left out, and each influence check that flagged nodes (``NodeInfluence.to_dict`` objects),
    after ``prefix`` (e.g. "At epsilon = 2: ")."""
    findings = [
        Finding((*prefix, f"node {item['node_id']} left out: {item['reason']}"), "warn")
        for item in excluded or []
    ]
    for data in influences:
        check = NodeInfluence.from_dict(data)
        if check.flagged:
            nodes = ", ".join(str(node) for node in check.flagged)
            findings.append(
                Finding((*prefix, f"node(s) {nodes} flagged: {check.summary()}"), "warn")
            )
    return findings


def influence_blocks(
    checks: Sequence[tuple[object, Mapping[str, Any]]],
    excluded: Sequence[Mapping[str, Any]] = (),
    first: str = "budget epsilon",
) -> list[Any]:
    """The detail of the influence checks: one table row per check (``(label, NodeInfluence
    .to_dict)``: the largest leave-one-node-out shift and its node, Cochran's Q, its p-value
    and the flagged nodes), the nodes the per-node cap left out, and the note on the check;
    nothing when there is neither."""
    if not checks and not excluded:
        return []
    rows = []
    for label, data in checks:
        check = NodeInfluence.from_dict(data)
        rows.append(
            [
                label,
                check.quantity,
                f"{len(check.tested_nodes)} of {len(check.nodes)}",
                check.largest_shift,
                check.largest_shift_node,
                check.statistic,
                check.dof or None,
                check.pvalue,
                ", ".join(str(node) for node in check.flagged) or "none",
            ]
        )
    blocks: list[Any] = []
    if rows:
        blocks.append(
            Table(
                [
                    first,
                    "quantity",
                    "nodes tested",
                    "largest leave-one-node-out shift (std. errors)",
                    "its node",
                    "Cochran's Q",
                    "df",
                    "p-value",
                    "flagged nodes",
                ],
                rows,
                caption="Influence of each node on the estimate",
            )
        )
    seen: set[tuple[int, str]] = set()
    for item in excluded:
        key = (int(item["node_id"]), str(item["reason"]))
        if key not in seen:
            seen.add(key)
            blocks.append(f"Node {item['node_id']} left out: {item['reason']}.")
    blocks.append(INFLUENCE_NOTE)
    return blocks


def ldp_privacy_blocks(privacy: LdpPrivacy, why_no_totals: str | None = None) -> list[Any]:
    spent_total = privacy.epsilon_spent_total_max_reported_by_nodes
    return [
        Table(
            ["quantity", "value"],
            [
                ["epsilon spent per user by this run", privacy.epsilon_spent_per_user],
                ["planned per-user budget (the server's plan)", privacy.user_budget],
                [
                    "most any user has spent over every run the nodes recorded",
                    "not reported" if spent_total is None else spent_total,
                ],
            ],
        ),
        f"Composition: {privacy.composition}. Each node enforces its own budget from its "
        "users' ledgers; the true gap (if shown) is computed by the simulation harness from "
        "raw data and is not private.",
        privacy_ledger_text(privacy, why_no_totals),
    ]


def ledger_totals_text(
    totals: Mapping[str, Any] | None,
    by_node: Mapping[str, Mapping[str, Any]] | None = None,
    new_nodes: Sequence[int] | None = None,
    *,
    why_missing: str | None = None,
) -> str:
    """The sentence of the nodes' privacy-ledger totals in a results.json (LDP audit, FPFL and
    pipeline jobs), for the console and the HTML report: the largest, the range over the nodes
    (``by_node``) and the nodes whose ledger this run created (``new_nodes``); without totals,
    ``why_missing`` (default: the nodes' ``min-users-for-counts``)."""
    if totals is None:
        why = why_missing or (
            "nodes with fewer users than their min-users-for-counts send no totals"
        )
        return (
            "Privacy spent per user over every release the nodes' ledgers recorded: not "
            f"reported ({why})."
        )
    text = LedgerTotals(
        totals["epsilon"],
        totals["delta"],
        totals["basic_epsilon"],
        totals["basic_delta"],
        totals["neighbouring"],
    ).sentence()
    if by_node and len(by_node) > 1:
        spent = {node: float(values["epsilon"]) for node, values in by_node.items()}
        low, high = min(spent, key=spent.__getitem__), max(spent, key=spent.__getitem__)
        if math.isclose(spent[low], spent[high], rel_tol=1e-9, abs_tol=1e-12):
            text += f"; the same on each of the {len(spent)} nodes"
        else:
            text += (
                f"; by node from {format_number(spent[low], '.4g')} (node {low}) to "
                f"{format_number(spent[high], '.4g')} (node {high}) over {len(spent)} nodes"
            )
    if new_nodes:
        listed = ", ".join(str(node) for node in new_nodes)
        text += (
            f". New privacy ledger on node(s) {listed}: their users' totals start with this "
            "run (a first run there, or a ledger lost and reset by its operator)"
        )
    return text


def no_totals_reason(accepted_nodes: Iterable[int | None]) -> str | None:
    """Why an LDP run's nodes reported no ledger totals when no reply was accepted in any
    audit (None otherwise: the default reason, ``min-users-for-counts``, holds)."""
    if any(count for count in accepted_nodes):
        return None
    return "no node's reply was accepted: see the rejected replies"


def privacy_ledger_text(privacy: Any, why_missing: str | None = None) -> str:
    """:func:`ledger_totals_text` of a results' ``privacy`` (:class:`~.results.LdpPrivacy`,
    the FPFL and the pipeline ones): its ``ledger_totals_reported_by_nodes``,
    ``ledger_totals_by_node`` and ``new_ledger_nodes``."""
    return ledger_totals_text(
        privacy.ledger_totals_reported_by_nodes,
        privacy.ledger_totals_by_node,
        privacy.new_ledger_nodes,
        why_missing=why_missing,
    )


# The HTML report: FedEvalFair
# --------------------------------------------------------------------------------------------

#: What each FedEvalFair metric measures (the names the outcome objects' summaries use).
FEDEVALFAIR_METRICS = METRIC_NAMES


def holder_dp_line(holder_dp: Mapping[str, Any]) -> str:
    """The sentence a reader of a FedEvalFair result in the holder-level DP mode must see: the
    noise on every released sum, its (epsilon, delta), and which p-values are approximate."""
    return (
        f"holder-level DP: every released sum carries Gaussian noise of standard deviation "
        f"{holder_dp['noise_std']:.4g} (epsilon = {holder_dp['epsilon']:g}, delta = "
        f"{holder_dp['delta']:g}, one holder's L2 sensitivity {holder_dp['sensitivity']:.4g} "
        f"with weights capped at {holder_dp['max_weight']:g}); every round-2 holder charged "
        "its users this (epsilon, delta). The tests are computed from the noisy sums: stage 2 "
        "and the equivalence test account for the noise's known variance (their sampling "
        "variance is bounded, conservatively), stage 1's p-value and the confidence interval "
        "are approximate; the paper mode is not released"
    )


def _comparison(test: Mapping[str, Any]) -> tuple[int, int]:
    """The groups a test compared (results written before d >= 2 groups: 0 vs 1)."""
    first, second = test.get("comparison", (0, 1))
    return int(first), int(second)


def _test_name(test: Mapping[str, Any]) -> str:
    """The metric, and the groups compared when not 0 vs 1 (the table's first column)."""
    comparison = _comparison(test)
    suffix = "" if comparison == (0, 1) else " (group {} vs {})".format(*comparison)
    return str(test["metric"]) + suffix


def _ordered_tests(results: FedEvalFairResults) -> list[Mapping[str, Any]]:
    primary = results.primary_mode
    tests = results.tests
    return [t for t in tests if t["mode"] == primary] + [t for t in tests if t["mode"] != primary]


def fedevalfair_findings(results: FedEvalFairResults | Mapping[str, Any]) -> list[Finding]:
    """The headline of a FedEvalFair run (from its results, or its results.json): one verdict
    per metric and test (stage 1, stage 2 and, with a tolerance, the equivalence test),
    primary mode first; the "paper" mode's lines say they are not evidence."""
    results = FedEvalFairResults.coerce(results)
    findings: list[Finding] = []
    error = results.error
    if error:
        findings.append(Finding((f"FedEvalFair gave no result: {error}",), "bad"))
    for test in _ordered_tests(results):
        metric, mode = test["metric"], test["mode"]
        comparison = _comparison(test)
        key = f"{metric}-{mode}" + ("" if comparison == (0, 1) else "-{}-{}".format(*comparison))
        label = block_label(metric, mode, comparison)
        report = test["report"]
        if report is None:
            findings.append(Finding((f"{label}: unavailable: {test['unavailable']}",), "warn"))
            continue
        alpha = report["alpha"]
        quiet = mode == "paper"
        reject1 = report["reject_homogeneity"]
        findings.append(
            Finding(
                (
                    f"{label}, stage 1 (same disparity at every holder?): ",
                    Value(
                        f"{key}-reject-homogeneity",
                        reject1,
                        words=HOMOGENEITY_VERDICTS,
                    ),
                    ", p = ",
                    Value(f"{key}-stage1-pvalue", report["homogeneity"]["pvalue"], ".3g"),
                    f" (alpha = {alpha:g})",
                ),
                "muted" if quiet else ("warn" if reject1 else "info"),
            )
        )
        reject2 = report["reject_fairness"]
        low, high = report["confidence_interval"]
        findings.append(
            Finding(
                (
                    f"{label}, stage 2 (common disparity = {report['mu0']:g}?): ",
                    Value(
                        f"{key}-reject-fairness",
                        reject2,
                        words=FAIRNESS_VERDICTS,
                    ),
                    "; common disparity ",
                    Value(f"{key}-estimate", report["estimate"]),
                    f", {100 * report['confidence_level']:g}% interval [",
                    Value(f"{key}-low", low),
                    ", ",
                    Value(f"{key}-high", high),
                    "], p = ",
                    Value(f"{key}-stage2-pvalue", report["common_disparity"]["pvalue"], ".3g"),
                ),
                "muted" if quiet else ("bad" if reject2 else "good"),
            )
        )
        if report["equivalence"] is not None:
            certified = report["certified_fair"]
            findings.append(
                Finding(
                    (
                        f"{label}, equivalence (|disparity| < {report['tolerance']:g}?): ",
                        Value(
                            f"{key}-certified-fair",
                            certified,
                            words=EQUIVALENCE_VERDICTS,
                        ),
                        ", p = ",
                        Value(f"{key}-equivalence-pvalue", report["equivalence"]["pvalue"], ".3g"),
                    ),
                    "muted" if quiet else ("good" if certified else "info"),
                )
            )
        findings.extend(_pooled_and_random_effects(report, key, label, quiet))
    return findings


def _pooled_and_random_effects(
    report: Mapping[str, Any], key: str, label: str, quiet: bool
) -> list[Finding]:
    """The pooled disparity's line and, after stage 1 rejects (calibrated mode), what to
    report instead of one common disparity: the lines of ``FairnessReport.verdicts``."""
    findings = []
    level = report["confidence_level"]
    z = normal_quantile(level)
    pooled = report.get("pooled")
    if pooled is not None:
        estimate, stderr = pooled["estimate"], pooled["stderr"]
        findings.append(
            Finding(
                (
                    f"{label}, pooled disparity (every holder's rows as one test set): ",
                    Value(f"{key}-pooled", estimate),
                    f", {100 * level:g}% interval [",
                    Value(f"{key}-pooled-low", estimate - z * stderr),
                    ", ",
                    Value(f"{key}-pooled-high", estimate + z * stderr),
                    "]",
                ),
                "muted" if quiet else "info",
            )
        )
    if not report["reject_homogeneity"] or report["mode"] != "calibrated":
        return findings
    effects = report.get("random_effects")
    if effects is None:
        findings.append(Finding((f"{label}, {AFTER_STAGE1_WITHOUT_RANDOM_EFFECTS}",), "warn"))
        return findings
    estimate, stderr = effects["estimate"], effects["stderr"]
    low, high = effects["tau2_interval"]
    findings.append(
        Finding(
            (
                f"{label}, after stage 1 (the holders differ): report the random-effects mean ",
                Value(f"{key}-random-effects-mean", estimate),
                f", {100 * level:g}% interval [",
                Value(f"{key}-random-effects-low", estimate - z * stderr),
                ", ",
                Value(f"{key}-random-effects-high", estimate + z * stderr),
                "], and the between-holder sd tau = ",
                Value(f"{key}-tau", effects["tau"]),
                " (tau^2 = ",
                Value(f"{key}-tau2", effects["tau2"], ".3g"),
                f", {100 * effects['tau2_interval_level']:g}% Q-profile interval [",
                Value(f"{key}-tau2-low", low, ".3g"),
                f", {tau2_high_text(high)}]), not one common disparity, and look at the holders",
            ),
            "warn",
        )
    )
    return findings


def fedevalfair_warnings(results: FedEvalFairResults | Mapping[str, Any]) -> list[str]:
    """Warnings a reader of a FedEvalFair result must see next to the verdicts."""
    results = FedEvalFairResults.coerce(results)
    warnings = []
    if any(t["mode"] == "paper" and t["report"] is not None for t in results.tests):
        warnings.append(PAPER_MODE_WARNING)
    holder_dp = results.holder_dp
    if holder_dp is not None:
        warnings.append(holder_dp_line(holder_dp))
    return warnings


def fedevalfair_report(
    results: FedEvalFairResults | Mapping[str, Any], folder: Path, plot_note: str | None
) -> Report:
    """The HTML report of a FedEvalFair run, built from its results (or its results.json)."""
    results = FedEvalFairResults.coerce(results)
    config = results.run_config or {}
    outcome = results.fedevalfair or {}
    rows = []
    for test in _ordered_tests(results):
        report = test["report"]
        if report is None:
            rows.append([_test_name(test), test["mode"], *([None] * 10), test["unavailable"]])
            continue
        equivalence = report["equivalence"]
        rows.append(
            [
                _test_name(test),
                test["mode"] + (" (not evidence)" if test["mode"] == "paper" else ""),
                report["k"],
                report["homogeneity"]["statistic"],
                report["homogeneity"]["dof"],
                report["homogeneity"]["pvalue"],
                report["reject_homogeneity"],
                report["common_disparity"]["statistic"],
                report["common_disparity"]["pvalue"],
                report["reject_fairness"],
                report["estimate"],
                report["stderr"],
                "" if equivalence is None else f"p = {equivalence['pvalue']:.3g}",
            ]
        )
    participants = outcome["round_participants"]
    detail: list[Any] = [
        f"{results.num_nodes} holder(s) asked; {config['fef_variant']} model; tests at "
        f"alpha = {config['fef_alpha']:g}, stage 2 null mu0 = {config['fef_mu0']:g}. Stage 1 "
        "asks whether every holder has the same disparity (H0: equal), stage 2 whether the "
        "common disparity equals mu0 (H0: fair); the statistics are summed over CKKS "
        "ciphertexts (FedEvalFair, anonymous 2024) and only the sums are decrypted.",
        Table(
            [
                "metric",
                "mode",
                "holders",
                "stage 1 statistic",
                "dof",
                "stage 1 p",
                "stage 1 rejects",
                "W*",
                "stage 2 p",
                "stage 2 rejects",
                "common disparity",
                "std. error",
                "equivalence",
            ],
            rows,
            caption="Two-stage test per metric and mode (primary mode first)",
        ),
        Table(
            ["protocol round", "holders taking part"],
            [[number, len(nodes)] for number, nodes in enumerate(participants, start=1)],
            caption="Participation",
        ),
    ]
    for item in outcome["unable_to_take_part"]:
        detail.append(f"Holder {item['node_id']} did not take part: {item['reason']}.")
    for item in outcome["rejected_replies"]:
        detail.append(
            f"Round {item['round']}: reply of node {item['node_id']} rejected: {item['reason']}."
        )
    difference = results.max_abs_pvalue_difference_vs_plaintext
    if difference is not None:
        detail.append(
            "Simulation harness (not private): the p-values match a plaintext computation on "
            f"the same data to {difference:.1e}."
        )
    detail.append(
        Figure(
            folder / "bootstrap_disparities.png",
            "every holder's bootstrap disparities (simulation harness only)",
            missing=plot_note
            if plot_note or results.harness_plaintext is not None
            else "the holders' bootstrap distributions are only known to the simulation "
            "harness (ground-truth = true, embedded data)",
        )
    )
    privacy_blocks = _fedevalfair_privacy_blocks(results)
    return Report(
        title="fedparity FedEvalFair fairness test",
        question="Is the model fair across the protected groups, on every holder's private "
        "test set, without revealing any holder's statistics?",
        headline=fedevalfair_findings(results),
        warnings=fedevalfair_warnings(results),
        notes=[
            "Disparities are signed in the calibrated mode: group 0's rate minus group 1's "
            "(negative: group 1 has the higher rate). The paper mode averages absolute values."
        ],
        sections=[Section("Tests", detail)],
        privacy=Section("Privacy spent", privacy_blocks),
    )


def fedevalfair_ledger_text(privacy: Mapping[str, Any]) -> str:
    """:func:`ledger_totals_text` of a FedEvalFair results' ``privacy`` in the holder-level DP
    mode: the totals the round-2 holders reported with their commitments, after the charge."""
    return ledger_totals_text(
        privacy.get("ledger_totals_reported_by_nodes"),
        privacy.get("ledger_totals_by_node"),
        privacy.get("new_ledger_nodes"),
        why_missing="holders with fewer users than their min-users-for-counts send no totals, "
        "and results written before the holders reported them have none",
    )


def _fedevalfair_privacy_blocks(results: FedEvalFairResults) -> list[Any]:
    """The report's privacy section: whether the release is differentially private, and
    its parameters."""
    outcome = results.fedevalfair or {}
    holder_dp = results.holder_dp
    rows: list[list[object]] = [
        ["holders asked", results.num_nodes],
        ["key holders (decrypt the sums)", len(outcome["key_holders"])],
        ["server's context holds the secret key", results.server_context_has_secret_key],
    ]
    if holder_dp is None:
        summary = (
            "FedEvalFair's releases are not differentially private: every holder encrypts its "
            "statistics under a shared CKKS key, the server only adds ciphertexts, and the key "
            f"holders ({len(outcome['key_holders'])}) decrypt the sums over at least two "
            "holders. Within the run they release over one set only, the one every round-2 "
            "holder committed to; a sum over a set of holders can still be differenced against "
            "another run."
        )
    else:
        summary = (
            "FedEvalFair's release is differentially private at the holder level (replace one "
            "holder's data, so also one user's): the key holders "
            f"({len(outcome['key_holders'])}) add Gaussian noise calibrated to one holder's "
            "sensitivity to every released sum, keyed by the secret key and the commitment (two "
            "key holders release the same values; a repeated request cannot be averaged), and "
            "every round-2 holder charged the release to each of its users' privacy ledgers "
            "before it committed. Differencing two runs gives a holder's sums plus the "
            "difference of two independent noises. "
            + holder_dp_line(holder_dp)
            + ". "
            + fedevalfair_ledger_text(results.privacy or {})
        )
        rows += [
            ["epsilon (replace one holder)", holder_dp["epsilon"]],
            ["delta", holder_dp["delta"]],
            ["noise standard deviation per released sum", holder_dp["noise_std"]],
            ["one holder's L2 sensitivity", holder_dp["sensitivity"]],
            ["weight cap (fef-dp-max-weight)", holder_dp["max_weight"]],
        ]
    return [summary, Table(["quantity", "value"], rows)]
