"""FPFL output: the progress line per round, the training plot, results.json helpers, the
privacy caveats and the summary printed at the end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..clients.config import RunConfig

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
        f"(group rates {', '.join(_fmt(r) for r in rates)}) | lambda "
        f"{', '.join(f'{m:.3f}' for m in entry['multipliers'])} | eps spent "
        f"{_fmt(entry.get('epsilon_spent'))} | nodes {entry['replied']}/{entry['members']}"
        + (f" | LOST: {entry['lost']}" if entry.get("lost") else "")
    )


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def plot_training(path: Path, history: list[dict[str, Any]], alpha: float) -> str | None:
    """Training curves (cohort loss and accuracy, constraint gap, multipliers, epsilon); PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'fedparity[plot]'): no plot written"
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
    axes[1, 0].set_ylabel("multiplier lambda")
    axes[1, 0].legend()
    axes[1, 1].plot(rounds, series("epsilon_spent"))
    axes[1, 1].set_ylabel("epsilon spent")
    for axis in axes[1]:
        axis.set_xlabel("round")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# --------------------------------------------------------------------------------------------


def metrics_to_json(metrics: Any) -> dict[str, Any]:
    return {
        "accuracy": metrics.accuracy,
        "group_error_rates": [float(r) for r in metrics.group_error_rates],
        "overall_error_rate": metrics.overall_error_rate,
        "gap": metrics.gap,
        "fair": metrics.fair,
    }


def metrics_from_json(values: dict[str, Any]) -> Any:
    from ..mechanisms.mmdm import CohortMetrics

    return CohortMetrics(
        accuracy=float(values["accuracy"]),
        group_error_rates=np.asarray(values["group_error_rates"], dtype=np.float64),
        overall_error_rate=float(values["overall_error_rate"]),
        gap=float(values["gap"]),
        fair=bool(values["fair"]),
    )


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


def summary_text(payload: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    lines = [
        f"FPFL training: {payload['status']}"
        + (f" ({payload['stop_reason']})" if payload.get("stop_reason") else "")
        + f"; {payload['rounds_lost']} round(s) lost",
        f"FPFL result ({payload['algorithm']}; selected round {payload['selected_round']}; "
        f"test set: {payload['evaluation']['source']}):",
        f"{'':>10} {'accuracy':>9} {'FNR gap':>9} {'EO gap':>9} {'DemP gap':>9} {'PP gap':>9}",
        f"{'ours':>10} {cell(payload['accuracy']):>9} {cell(payload['fnr_gap']):>9} "
        f"{cell(payload['eo_gap']):>9} {cell(payload['demp_gap']):>9} {cell(payload['pp_gap']):>9}",
    ]
    paper = payload.get("paper")
    if paper:
        lines.append(
            f"{'paper':>10} {paper['accuracy']:>9.3f} {paper['fnr_gap']:>9.3f} "
            f"{'':>9} {'':>9} {'':>9}   ({paper['table']})"
        )
    if payload["private"]:
        lines.append(
            f"privacy: epsilon = {payload['epsilon']:.4f} spent after "
            f"{payload['privacy']['rounds_released_total']} released round(s), "
            f"delta = {payload['delta']:.3g}, "
            f"noise multiplier = {payload['noise_multiplier']:.4f} "
            f"({payload['privacy']['accountant']}, {payload['privacy']['noise']} noise)"
        )
    for note in payload["privacy"]["caveats"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
