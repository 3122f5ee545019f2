"""The pipeline's headline and HTML report, built from its results.json
(:mod:`fedparity.server.pipeline_job`): both models side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..clients.project.config import FAIR_ALGORITHM_LABELS
from .harness import HARNESS_LABEL
from .html_report import Finding, Report, Section, Table, Value
from .report import (
    FEDEVALFAIR_METRICS,
    PAPER_MODE_WARNING,
    holder_dp_line,
    influence_blocks,
    node_findings,
    privacy_ledger_text,
)
from .results import PipelineAudit, PipelineModel, PipelinePrivacy, PipelineResults

#: The models in the order the report shows them.
MODELS = ("fpfl", "pfl")


def _label(results: PipelineResults, session: str) -> str:
    """The model's short name: the fair training's algorithm (FPFL, FedFB, FairFed) or PFL."""
    return _fair(results) if session == "fpfl" else session.upper()


def _first_estimate(model: PipelineModel) -> tuple[PipelineAudit, Any] | None:
    """The first audit with an estimate (the table lists them all)."""
    for audit in model.audits or []:
        if audit.estimate is not None:
            return audit, audit.estimate
    return None


#: How each fair training pursues the constraint, for the report's sentence.
_FAIR_AIMS = {
    "fpfl": "enforces",
    "fedfb": "reweights the groups toward",
    "fairfed": "weights the nodes toward",
}


def _algorithm(results: PipelineResults) -> str:
    """The fair training's ``fpfl-algorithm`` (``"fpfl"`` in results written before it was
    recorded)."""
    return str((results.run_config or {}).get("fpfl_algorithm", "fpfl"))


def _fair(results: PipelineResults) -> str:
    """The fair training's name: FPFL, FedFB or FairFed."""
    return FAIR_ALGORITHM_LABELS.get(_algorithm(results), "FPFL")


def _tests(model: PipelineModel) -> list[Mapping[str, Any]]:
    return list((model.fedevalfair or {}).get("tests", []))


def _comparison_finding(results: PipelineResults, row: Mapping[str, Any]) -> Finding:
    metric = results.metric
    budget = Value(f"compare-{row['budget']:g}-budget", row["budget"], "g")
    compared = row.get("comparison")
    if compared is None:
        return Finding(
            ("At epsilon = ", budget, f" per audit: no comparison ({row['error']})"), "warn"
        )
    low, high = compared["interval"]
    parts: list[str | Value] = [
        "At epsilon = ",
        budget,
        f" per audit, {_fair(results)}'s {metric} gap is smaller than PFL's by ",
        Value(f"compare-{row['budget']:g}-difference", compared["statistic"]),
        f" ({100 * compared['confidence']:g}% interval [",
        Value(f"compare-{row['budget']:g}-low", low),
        ", ",
        Value(f"compare-{row['budget']:g}-high", high),
        "]): ",
    ]
    if compared["resolved"]:
        parts.append(f"the private estimates alone show that {_fair(results)}'s gap is smaller.")
        return Finding(tuple(parts), "good")
    parts.append("the audits cannot resolve the difference at this budget")
    key = f"compare-{row['budget']:g}"
    detectable = row.get("detectable_difference")
    if detectable is not None:
        parts += [
            f" (with {int(100 * row['power'])}% power they detect a difference of ",
            Value(f"{key}-detectable", detectable),
            " or more)",
        ]
    parts += [
        ". To detect a difference of ",
        Value(f"{key}-planned-for", row["difference_planned_for"], "g"),
        " (pipeline-plan-difference) each audit would need ",
    ]
    needed = row.get("epsilon_needed_per_audit")
    if needed is not None:
        parts += ["epsilon = ", Value(f"{key}-needed", needed, ".3g"), " with these users"]
    else:
        parts.append("more than any budget with these users")
    users = row.get("users_needed_at_budget")
    if users is not None:
        parts += [", or ", Value(f"{key}-users-needed", users, "d"), " users at this budget."]
    else:
        parts.append(".")
    return Finding(tuple(parts), "warn")


def pipeline_findings(results: PipelineResults | Mapping[str, Any]) -> list[Finding]:
    """The headline: per model the private gap, the FedEvalFair verdicts, then the comparison
    from the private estimates and, labelled, the harness's true gaps."""
    results = PipelineResults.coerce(results)
    metric = results.metric
    models = results.models or {}
    findings: list[Finding] = []
    for session in MODELS:
        model = models[session]
        found = _first_estimate(model)
        if found is None:
            findings.append(
                Finding((f"{_label(results, session)}: the LDP audit gave no estimate",), "bad")
            )
        else:
            audit, estimate = found
            low, high = estimate["max_gap_interval"]
            findings.append(
                Finding(
                    (
                        f"{_label(results, session)}: private {metric} gap ",
                        Value(f"{session}-gap", estimate["max_gap"]),
                        f" at epsilon = {audit.budget:g}, "
                        f"{100 * estimate['confidence']:g}% interval [",
                        Value(f"{session}-low", low),
                        ", ",
                        Value(f"{session}-high", high),
                        "]",
                    ),
                    "bad" if low > 0 else "info",
                )
            )
        for test in _tests(model):
            report = test["report"]
            name = FEDEVALFAIR_METRICS.get(test["metric"], test["metric"])
            key = f"{session}-{test['metric']}"
            if report is None:
                findings.append(
                    Finding(
                        (f"{_label(results, session)}, FedEvalFair {name}: unavailable",),
                        "warn",
                    )
                )
                continue
            findings.append(
                Finding(
                    (
                        f"{_label(results, session)}, FedEvalFair {name} ({test['mode']} mode): ",
                        Value(
                            f"{key}-reject-fairness",
                            report["reject_fairness"],
                            words=("UNFAIR", "no evidence of unfairness"),
                        ),
                        ", stage 2 p = ",
                        Value(f"{key}-stage2-pvalue", report["common_disparity"]["pvalue"], ".3g"),
                        "; holders differ (stage 1): ",
                        Value(f"{key}-reject-homogeneity", report["reject_homogeneity"]),
                        ", p = ",
                        Value(f"{key}-stage1-pvalue", report["homogeneity"]["pvalue"], ".3g"),
                    ),
                    "warn" if report["reject_fairness"] else "info",
                )
            )
        error = (model.fedevalfair or {}).get("error")
        if error:
            findings.append(Finding((f"{_label(results, session)}, FedEvalFair: {error}",), "bad"))
        for audit in model.audits or []:
            findings += node_findings(
                (f"{_label(results, session)}, LDP audit at epsilon = {audit.budget:g}: ",),
                audit.excluded_nodes,
                [audit.influence] if audit.influence else [],
            )
    findings += [_comparison_finding(results, row) for row in results.comparison or []]
    for session in MODELS:
        harness = models[session].harness
        truth = None if harness is None else harness["audited_metric_gap"]
        if truth is not None:
            findings.append(
                Finding(
                    (
                        f"{_label(results, session)}: true {metric} gap of the audited users "
                        "(simulation harness only, not private): ",
                        Value(f"{session}-true-gap", truth["max_gap"]),
                    ),
                    "muted",
                )
            )
    return findings


def _fef_cell(model: PipelineModel, metric: str, field: str) -> object:
    for test in _tests(model):
        if test["metric"] == metric and test["report"] is not None:
            report = test["report"]
            if field == "verdict":
                return "UNFAIR" if report["reject_fairness"] else "no evidence"
            if field == "stage1":
                return report["homogeneity"]["pvalue"]
            if field == "stage2":
                return report["common_disparity"]["pvalue"]
            return report["estimate"]
    return None


def _side_by_side(results: PipelineResults) -> Table:
    metric = results.metric
    config = results.run_config or {}
    models = [(results.models or {})[session] for session in MODELS]
    rows: list[list[object]] = []

    def row(name: str, values: Sequence[object]) -> None:
        rows.append([name, *values])

    row(
        "training epsilon (delta)",
        [
            f"{training['epsilon']:.3g} ({training['delta']:.2g})"
            if training["epsilon"] is not None
            else "n/a"
            for training in (m.training or {} for m in models)
        ],
    )
    for index, budget in enumerate(config["epsilons"]):
        audits = [(m.audits or [])[index] for m in models]
        estimates = [audit.estimate for audit in audits]
        row(f"private {metric} gap, epsilon {budget:g}", [e and e["max_gap"] for e in estimates])
        row(
            f"{100 * config['confidence']:g}% interval",
            [
                f"[{e['max_gap_interval'][0]:.4f}, {e['max_gap_interval'][1]:.4f}]" if e else None
                for e in estimates
            ],
        )
        plans = [audit.detectable for audit in audits]
        row(
            "gap detectable with 80% power",
            [p and p["gap"] for p in plans],
        )
        row("reports", [audit.num_reports for audit in audits])
    tested = dict.fromkeys(test["metric"] for model in models for test in _tests(model))
    for fef_metric in tested:
        name = FEDEVALFAIR_METRICS.get(fef_metric, fef_metric)
        row(f"FedEvalFair {name}: verdict", [_fef_cell(m, fef_metric, "verdict") for m in models])
        row("  common disparity", [_fef_cell(m, fef_metric, "estimate") for m in models])
        row("  stage 1 p (holders differ)", [_fef_cell(m, fef_metric, "stage1") for m in models])
        row("  stage 2 p (unfair)", [_fef_cell(m, fef_metric, "stage2") for m in models])
    harness = [m.harness for m in models if m.harness is not None]
    if len(harness) == len(models):
        row("test accuracy (harness)", [h["accuracy"] for h in harness])
        row(
            f"true {metric} gap of the audited users (harness)",
            [h["audited_metric_gap"] and h["audited_metric_gap"]["max_gap"] for h in harness],
        )
        row("true FNR gap, test rows (harness)", [h["fnr_gap"] for h in harness])
    return Table(
        ["", *(m.name or "" for m in models)],
        rows,
        caption="Both models side by side (harness rows: simulation only, not private)",
    )


def pipeline_report(results: PipelineResults | Mapping[str, Any]) -> Report:
    """The HTML report of the pipeline, built from its results (or its results.json)."""
    results = PipelineResults.coerce(results)
    config = results.run_config or {}
    privacy = results.privacy or PipelinePrivacy()
    steps = Table(
        ["step", "epsilon", "delta", "accounting"],
        [[s["step"], s["epsilon"], s["delta"], s["how"]] for s in privacy.per_user_steps or []],
        caption="Privacy each user spent, step by step",
    )
    timing = results.timing or {}
    audits = [
        (f"{_label(results, session)}, epsilon {audit.budget:g}", audit)
        for session in MODELS
        for audit in ((results.models or {})[session].audits or [])
    ]
    influence = influence_blocks(
        [(label, audit.influence) for label, audit in audits if audit.influence],
        [item for _, audit in audits for item in audit.excluded_nodes or []],
        first="audit",
    )
    sections = [
        Section(
            "Both models",
            (
                f"{results.num_nodes} node(s), {results.num_users} user(s); dataset "
                f"{config['dataset']}. Both models trained with user-level DP for "
                f"{config['fpfl_rounds']} rounds (cohort {config['fpfl_cohort_size']}, clipping "
                f"bound {config['fpfl_clipping_bound']:g}); {_fair(results)} "
                f"{_FAIR_AIMS[_algorithm(results)]} {results.constraint} parity (alpha = "
                f"{results.alpha:g}).",
                _side_by_side(results),
                "The FedEvalFair rows are the "
                f"{results.primary_mode} mode; each training's own report "
                "(train-fpfl/report.html, train-pfl/report.html) has its rounds and plots.",
                *influence,
            ),
        ),
        Section(
            "Time",
            (
                Table(
                    ["step", "seconds", "share"],
                    [
                        [step, value, f"{100 * timing['share_by_step'][step]:.0f}%"]
                        for step, value in timing["seconds_by_step"].items()
                    ],
                    caption=f"{timing['seconds_total']:.0f} s in all",
                ),
            ),
        ),
    ]
    return Report(
        title="fedparity pipeline: train fair under DP, measure privately, test",
        question=(
            f"Does the model trained for {results.constraint} parity ({_fair(results)}) serve "
            "the groups more equally than the model trained without it (PFL), by the private "
            "gap estimates and the holders' test?"
        ),
        headline=pipeline_findings(results),
        sections=sections,
        privacy=Section(
            "Privacy spent",
            (
                steps,
                privacy_ledger_text(privacy),
                f"Harness values are labelled: {HARNESS_LABEL}.",
            ),
        ),
        warnings=pipeline_warnings(results),
    )


def pipeline_warnings(results: PipelineResults | Mapping[str, Any]) -> list[str]:
    """Warnings a reader of the pipeline's FedEvalFair verdicts must see next to them: the
    paper mode's, and the holder-level DP mode's noise (:func:`holder_dp_line`)."""
    results = PipelineResults.coerce(results)
    warnings = []
    if results.primary_mode == "paper":
        warnings.append(PAPER_MODE_WARNING)
    for model in (results.models or {}).values():
        privacy = (model.fedevalfair or {}).get("privacy") or {}
        if privacy.get("differentially_private"):
            warnings.append(holder_dp_line(privacy))  # the same mode for both tests: once
            break
    return warnings
