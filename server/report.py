"""Human- and machine-readable output of a run: table, results.json, plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..strategies.ldp_audit import AuditOutcome
from .harness import GroundTruth


def _clean(value: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(payload), indent=2, allow_nan=False) + "\n")


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
                f"{true_gap:>9} {outcome.summary.num_reports:>8} {len(outcome.rejected):>8} "
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'fedparity[plot]'): no plot written"
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
    axes.set_xlabel("LDP budget epsilon per user")
    axes.set_ylabel(f"{metric} gap between groups")
    axes.set_title("Private measurement of the performance gap")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
