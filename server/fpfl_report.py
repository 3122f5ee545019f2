"""FPFL output: the progress line per round, the training plot, results.json helpers, the
privacy caveats, the summary printed at the end and the content of the HTML report.

``metrics_to_json`` and ``metrics_from_json`` moved to
:mod:`fedparity.mechanisms.fpfl.training_state` with the checkpoint format; they are still
importable from here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..clients.project.config import RunConfig
from ..mechanisms.fpfl.training_state import metrics_from_json as metrics_from_json
from ..mechanisms.fpfl.training_state import metrics_to_json as metrics_to_json
from .html_report import Figure, Finding, Report, Section, Table, Value
from .report import (
    NOISY_RATES_NOTE,
    PLOT_NEEDS_MATPLOTLIB,
    load_pyplot,
    plain_tick_labels,
    privacy_ledger_text,
)
from .results import FPFLPrivacy, FPFLResults

# Reporting helpers

#: Rodriguez-Galvez et al. 2021 (FPFL), Table 2 (Adult, shallow network): (accuracy, FNR gap)
#: by (algorithm, m).
PAPER_TABLE2: dict[tuple[str, int], tuple[float, float]] = {
    ("fl", 200): (0.851, 0.121),
    ("ffl", 200): (0.855, 0.036),
    ("fl-clip", 200): (0.844, 0.169),
    ("ffl-clip", 200): (0.853, 0.018),
    ("pfl", 200): (0.844, 0.167),
    ("fpfl", 200): (0.840, 0.001),
    ("pfl", 1000): (0.847, 0.148),
    ("fpfl", 1000): (0.851, 0.001),
}

# --------------------------------------------------------------------------------------------


def progress_line(entry: dict[str, Any]) -> str:
    gaps = entry.get("cohort_gap")
    rates = entry.get("group_error_rates") or []
    return (
        f"round {entry['round']:>4}: cohort loss {_fmt(entry.get('cohort_loss'))} acc "
        f"{_fmt(entry.get('cohort_accuracy'))} | constraint gap {_fmt(gaps)} "
        f"(group rates {', '.join(_fmt(r) for r in rates)}) | "
        + (
            f"node weights {', '.join(f'{w:.3f}' for w in entry['fairfed_weights'])}"
            if "fairfed_weights" in entry
            else f"lambda {', '.join(f'{m:.3f}' for m in entry['multipliers'])}"
        )
        + " | eps spent "
        f"{_fmt(entry.get('epsilon_spent'))} | nodes {entry['replied']}/{entry['members']}"
        + (f" | LOST: {entry['lost']}" if entry.get("lost") else "")
    )


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def plot_training(path: Path, history: list[dict[str, Any]], alpha: float) -> str | None:
    """Training curves (cohort loss and accuracy, constraint gap, multipliers, epsilon); PNG."""
    plt = load_pyplot()
    if plt is None:
        return PLOT_NEEDS_MATPLOTLIB
    rounds = [entry["round"] for entry in history]

    def series(key: str) -> list[float]:
        return [math.nan if entry.get(key) is None else entry[key] for entry in history]

    figure, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    axes[0, 0].plot(rounds, series("cohort_accuracy"), label="accuracy")
    axes[0, 0].plot(rounds, series("cohort_loss"), label="loss")
    axes[0, 0].set_ylabel("cohort accuracy / loss (noisy)")
    axes[0, 0].legend()
    axes[0, 1].plot(rounds, series("cohort_gap"), label="hard gap (noisy)")
    axes[0, 1].plot(rounds, series("surrogate_gap"), label="surrogate gap (noisy)")
    axes[0, 1].axhline(alpha, color="0.5", linestyle="--", label="alpha")
    axes[0, 1].set_ylabel("constraint gap")
    axes[0, 1].legend()
    multipliers = np.array([entry["multipliers"] for entry in history])
    for group in range(multipliers.shape[1] if multipliers.ndim == 2 else 0):
        axes[1, 0].plot(rounds, multipliers[:, group], label=f"group {group}")
    axes[1, 0].set_ylabel("multiplier lambda (FedFB: group weight q)")
    axes[1, 0].legend()
    axes[1, 1].plot(rounds, series("epsilon_spent"))
    axes[1, 1].set_ylabel("epsilon spent")
    for axis in axes[1]:
        axis.set_xlabel("round")
    for axis in axes.flat:
        plain_tick_labels(axis)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# --------------------------------------------------------------------------------------------


def privacy_caveats(config: RunConfig, sigma: float, discarded: int = 0) -> list[str]:
    notes: list[str] = []
    if sigma and discarded > 0:
        notes.append(
            f"{discarded} round(s) were released by an interrupted run after its last "
            "checkpoint and discarded on resuming: they still count in epsilon, which can "
            "therefore exceed the epsilon calibrated for fpfl-rounds"
        )
    if not sigma:
        notes.append(f"{config.fpfl_algorithm}: no noise, no differential privacy (baseline)")
    if config.fpfl_client_seed is not None:
        notes.append(
            "fpfl-client-seed is set: cohorts and noise are reproducible by anyone who knows "
            "the seed, so this run is NOT private (use it for experiments only)"
        )
    if sigma and config.fpfl_secure_sum == "none" and config.fpfl_noise == "distributed":
        notes.append(
            "fpfl-secure-sum = none with distributed noise: each node's sum reaches the server "
            "with only that node's noise share; the stated epsilon holds for the aggregate only"
        )
    if sigma and config.fpfl_noise == "central":
        notes.append("central noise: the server (trusted aggregator) sees the un-noised sum")
    return notes


def training_caveats(
    *,
    rounds_lost: int,
    stop_reason: str,
    fragile: str,
    segments: int,
    rounds_planned: int,
    rounds_trained: int,
) -> list[str]:
    """What a reader of results.json must know about how the training went."""
    notes: list[str] = []
    if stop_reason:
        notes.append(
            f"the training stopped early after round {rounds_trained} of {rounds_planned}: "
            f"{stop_reason}; resume it with fpfl-resume = true"
        )
    if rounds_lost:
        notes.append(
            f"{rounds_lost} round(s) were lost (no update; their privacy is still spent): see "
            "'lost' in history"
        )
    if fragile:
        notes.append(fragile)
    if segments > 1:
        notes.append(
            f"the training was resumed with a different population: epsilon composes {segments} "
            "segments of rounds with different noise multipliers and sample rates"
        )
    return notes


def paper_row(config: RunConfig) -> dict[str, Any] | None:
    if config.dataset != "adult" or config.fpfl_architecture != "shallow":
        return None
    row = PAPER_TABLE2.get((config.fpfl_algorithm, config.fpfl_cohort_size))
    if row is None:
        return None
    return {
        "table": "Rodriguez-Galvez et al. 2021, Table 2 (shallow)",
        "accuracy": row[0],
        "fnr_gap": row[1],
    }


#: The unconstrained algorithm of the paper's Table 2 for each constrained one (same clipping
#: and noise, no MMDM).
UNCONSTRAINED_COUNTERPART = {
    "ffl": "fl",
    "ffl-clip": "fl-clip",
    "fpfl": "pfl",
    "fedfb": "pfl",
    "fairfed": "pfl",
}

#: How the report says an algorithm was trained, where it is not the paper's constrained or
#: unconstrained training (FedFB: Zeng, Chen and Lee, "Improving Fairness via Federated
#: Learning", arXiv:2110.15545, 2021; FairFed: Ezzeldin, Yan, He, Ferrara and Avestimehr,
#: "FairFed: Enabling Group Fairness in Federated Learning", AAAI 2023).
TRAINED_WITH = {
    "fedfb": "trained with FedFB's group reweighting (Zeng, Chen and Lee 2021), not with",
    "fairfed": "trained with FairFed's node weights (Ezzeldin et al. 2023), not with",
    "fairfed+fedfb": "trained with FairFed's node weights (Ezzeldin et al. 2023) and FedFB's "
    "group reweighting (Zeng, Chen and Lee 2021), not with",
}

#: The FairnessGaps field that each fpfl-constraint bounds by alpha, and its name.
CONSTRAINT_GAPS = {"fnr": ("fnr_gap", "FNR gap"), "accuracy": ("accuracy_gap", "accuracy gap")}


def unconstrained_baseline(config: RunConfig) -> dict[str, Any] | None:
    """The unconstrained counterpart's row of the paper's Table 2 (FNR parity on Adult with the
    shallow network, at the same cohort size), or None where the paper has none."""
    counterpart = UNCONSTRAINED_COUNTERPART.get(config.fpfl_algorithm)
    if counterpart is None or config.fpfl_constraint != "fnr":
        return None
    if config.dataset != "adult" or config.fpfl_architecture != "shallow":
        return None
    row = PAPER_TABLE2.get((counterpart, config.fpfl_cohort_size))
    if row is None:
        return None
    return {
        "algorithm": counterpart,
        "source": "Rodriguez-Galvez et al. 2021, Table 2 (shallow)",
        "accuracy": row[0],
        "fnr_gap": row[1],
    }


def fairness_constraint(config: RunConfig, test_gaps: Any | None) -> dict[str, Any]:
    """The ``fairness_constraint`` section of results.json: alpha, the selected model's gap on
    the held-out test set (``test_gaps``: FairnessGaps, None without a test set), whether
    the constraint holds there, and the unconstrained baseline's gap where it is known."""
    field, _ = CONSTRAINT_GAPS[config.fpfl_constraint]
    gap = None if test_gaps is None else float(getattr(test_gaps, field))
    if gap is not None and not math.isfinite(gap):
        gap = None
    return {
        "metric": config.fpfl_constraint,
        "gap_field": field,
        "alpha": config.fpfl_alpha,
        "trained_with_constraint": config.fpfl_uses_mmdm,
        "test_gap": gap,
        "holds_on_test_set": None if gap is None else gap <= config.fpfl_alpha,
        "unconstrained_baseline": unconstrained_baseline(config),
    }


def _noisy_cohort_rates(history: list[dict[str, Any]]) -> bool:
    return any(
        rate is not None and not 0.0 <= rate <= 1.0
        for entry in history
        for rate in entry.get("group_error_rates") or []
    )


def fpfl_findings(results: FPFLResults | Mapping[str, Any]) -> list[Finding]:
    """The headline of an FPFL run (from its results, or its results.json): the test-set gap
    against alpha and whether the constraint holds, the accuracy, and the unconstrained
    baseline's gap where known."""
    results = FPFLResults.coerce(results)
    constraint = results.fairness_constraint or {}
    algorithm = results.algorithm
    _, name = CONSTRAINT_GAPS[constraint["metric"]]
    alpha = Value("alpha", constraint["alpha"], "g")
    findings: list[Finding] = []
    if results.status != "completed":
        reason = f" ({results.stop_reason})" if results.stop_reason else ""
        findings.append(Finding((f"Training {results.status}{reason}",), "warn"))
    trained = "trained with" if constraint["trained_with_constraint"] else "trained without"
    debiased = (results.run_config or {}).get("fpfl_fairfed_debiasing") == "fedfb"
    trained = TRAINED_WITH.get(
        f"{algorithm}+fedfb" if algorithm == "fairfed" and debiased else str(algorithm), trained
    )
    if constraint["test_gap"] is None:
        findings.append(
            Finding(
                (
                    f"{algorithm} ({trained} the {name} constraint, alpha = ",
                    alpha,
                    "): no held-out test set on the server (ground-truth = false or the nodes "
                    "read their own data), so whether the constraint holds is not known",
                ),
                "warn",
            )
        )
    else:
        holds = constraint["holds_on_test_set"]
        findings.append(
            Finding(
                (
                    f"{algorithm} ({trained} the constraint): {name} on the test set ",
                    Value("test-gap", constraint["test_gap"]),
                    " against alpha = ",
                    alpha,
                    ": the constraint ",
                    Value("constraint-holds", holds, words=("holds", "is violated")),
                ),
                "good" if holds else "bad",
            )
        )
        findings.append(
            Finding(
                (
                    "Test accuracy ",
                    Value("accuracy", results.accuracy),
                    f" (model of round {results.selected_round}, "
                    f"{results.model_selection} selection)",
                )
            )
        )
    baseline = constraint["unconstrained_baseline"]
    counterpart = UNCONSTRAINED_COUNTERPART.get(str(algorithm))
    if baseline is not None:
        findings.append(
            Finding(
                (
                    f"Unconstrained baseline ({baseline['algorithm']}, {baseline['source']}): "
                    f"{name} ",
                    Value("baseline-gap", baseline["fnr_gap"]),
                    ", accuracy ",
                    Value("baseline-accuracy", baseline["accuracy"]),
                )
            )
        )
    elif counterpart is not None:
        findings.append(
            Finding(
                (
                    "Unconstrained baseline: not known for this setting (train the same run "
                    f"config with fpfl-algorithm = {counterpart} to compare)",
                )
            )
        )
    else:
        findings.append(Finding((f"{algorithm} is itself an unconstrained baseline",)))
    return findings


def fpfl_report(
    results: FPFLResults | Mapping[str, Any], folder: Path, plot_note: str | None
) -> Report:
    """The HTML report of an FPFL run, built from its results (or its results.json)."""
    results = FPFLResults.coerce(results)
    constraint = results.fairness_constraint or {}
    _, name = CONSTRAINT_GAPS[constraint["metric"]]
    columns = ["accuracy", "fnr_gap", "eo_gap", "demp_gap", "pp_gap", "accuracy_gap"]
    header = ["model", "accuracy", "FNR gap", "EO gap", "DemP gap", "PP gap", "accuracy gap"]
    evaluation = results.evaluation or {}
    rows: list[list[Any]] = []
    for label, key in (("selected (headline)", "selected"), ("after the last round", "final")):
        if key in evaluation:
            rows.append([label, *(evaluation[key][column] for column in columns)])
    paper = results.paper
    if paper:
        rows.append([f"paper ({paper['table']})", paper["accuracy"], paper["fnr_gap"]])
    baseline = constraint["unconstrained_baseline"]
    if baseline:
        rows.append(
            [
                f"unconstrained {baseline['algorithm']} (paper)",
                baseline["accuracy"],
                baseline["fnr_gap"],
            ]
        )
    rows = [row + [None] * (len(header) - len(row)) for row in rows]
    privacy = results.privacy or FPFLPrivacy()
    population = results.population or {}
    detail: list[Any] = [
        f"{results.algorithm} on {population['users']} user(s) at "
        f"{population['nodes']} node(s); {results.status} after "
        f"{privacy.rounds_trained} of {privacy.rounds_planned} "
        f"round(s), {results.rounds_lost} lost. The {name} is the largest |rate(all) - "
        f"rate(group)| over the groups; the constraint asks it to stay <= alpha = "
        f"{constraint['alpha']:g} (Rodriguez-Galvez et al. 2021).",
        Table(header, rows, caption=f"Test set: {evaluation['source']}"),
    ]
    selected = evaluation.get("selected")
    if selected:
        detail.append(
            Table(
                ["group", "size", "accuracy", "FNR", "FPR", "positive rate", "precision"],
                [
                    [group, *values]
                    for group, values in enumerate(
                        zip(
                            selected["group_sizes"],
                            selected["group_accuracy"],
                            selected["group_fnr"],
                            selected["group_fpr"],
                            selected["group_positive_rate"],
                            selected["group_precision"],
                            strict=True,
                        )
                    )
                ],
                caption="Selected model per group (test set)",
            )
        )
    if _noisy_cohort_rates(results.history or []):
        detail.append(
            "Note: the per-round group rates of the training plot come from noisy cohort "
            f"statistics; {NOISY_RATES_NOTE}."
        )
    detail.append(
        Figure(folder / "training.png", "training curves (cohort statistics)", missing=plot_note)
    )
    privacy_rows: list[list[object]]
    if results.private:
        privacy_rows = [
            ["epsilon spent", results.epsilon],
            ["delta", results.delta],
            ["target epsilon (fpfl-epsilon)", privacy.target_epsilon],
            ["noise multiplier sigma", results.noise_multiplier],
            ["rounds released (every round sent counts)", privacy.rounds_released_total],
            ["sample rate q = m / K", privacy.sample_rate],
            ["accountant", privacy.accountant],
            ["noise", privacy.noise],
            ["secure sum", privacy.secure_sum],
        ]
        lead = "User-level differential privacy (Gaussian noise on clipped user statistics):"
    else:
        privacy_rows = [["secure sum", privacy.secure_sum]]
        lead = "This run adds no noise: it is not differentially private."
    privacy_blocks: list[Any] = [lead, Table(["quantity", "value"], privacy_rows)]
    if results.private:
        privacy_blocks.append(privacy_ledger_text(privacy))
    privacy_blocks += [f"Note: {note}." for note in privacy.caveats or []]
    return Report(
        title=f"fedparity FPFL training ({results.algorithm})",
        question=f"Does the trained model meet the fairness constraint ({name} <= alpha) on "
        "held-out data, at what accuracy and privacy cost, compared with an unconstrained "
        "model?",
        headline=fpfl_findings(results),
        sections=[Section("Result", detail)],
        privacy=Section("Privacy spent", privacy_blocks),
    )


def summary_text(payload: FPFLResults | Mapping[str, Any]) -> str:
    """The console summary of an FPFL run: the headline, the test-set table and the privacy
    spent."""
    payload = FPFLResults.coerce(payload)
    privacy = payload.privacy or FPFLPrivacy()

    def cell(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    lines = [
        *(finding.plain() for finding in fpfl_findings(payload)),
        "",
        f"FPFL training: {payload.status}"
        + (f" ({payload.stop_reason})" if payload.stop_reason else "")
        + f"; {payload.rounds_lost} round(s) lost",
        f"FPFL result ({payload.algorithm}; selected round {payload.selected_round}; "
        f"test set: {(payload.evaluation or {})['source']}):",
        f"{'':>10} {'accuracy':>9} {'FNR gap':>9} {'EO gap':>9} {'DemP gap':>9} {'PP gap':>9}",
        f"{'ours':>10} {cell(payload.accuracy):>9} {cell(payload.fnr_gap):>9} "
        f"{cell(payload.eo_gap):>9} {cell(payload.demp_gap):>9} {cell(payload.pp_gap):>9}",
    ]
    paper = payload.paper
    if paper:
        lines.append(
            f"{'paper':>10} {paper['accuracy']:>9.3f} {paper['fnr_gap']:>9.3f} "
            f"{'':>9} {'':>9} {'':>9}   ({paper['table']})"
        )
    if payload.private:
        lines.append(
            f"privacy: epsilon = {payload.epsilon:.4f} spent after "
            f"{privacy.rounds_released_total} released round(s), "
            f"delta = {payload.delta:.3g}, "
            f"noise multiplier = {payload.noise_multiplier:.4f} "
            f"({privacy.accountant}, {privacy.noise} noise)"
        )
        lines.append(privacy_ledger_text(privacy))
    for note in privacy.caveats or []:
        lines.append(f"note: {note}")
    if _noisy_cohort_rates(payload.history or []):
        lines.append(
            f"note: the per-round group rates above use noisy statistics; {NOISY_RATES_NOTE}"
        )
    return "\n".join(lines)
