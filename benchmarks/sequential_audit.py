"""Sequential vs fixed-size LDP gap audit: users asked, and coverage under optional stopping.

    python -m benchmarks.sequential_audit [--runs 100] [--epsilon 1] [--target-width 0.1]

Each user holds a 0/1 metric (Bernoulli with its group's mean) and sends one M_N report
(:func:`fedparity.mechanisms.ldp.nprr.nprr_for_budget` at ``--epsilon``). For d = 2 and d = 5
equal groups and several true largest gaps, ``--runs`` seeded sequential audits
(:func:`fedparity.mechanisms.ldp.sequential.sequential_gap_audit`: batches of a twentieth of
the fixed size, the cap at 20 times it) against the fixed-size audit planned for the same
question (:func:`~fedparity.mechanisms.ldp.sequential.fixed_audit_size`: the fewest users whose
normal interval is narrower than the target width whatever the gap). Printed per row: the true
gap, the fixed size, the mean (sd) of the users the sequential audit asked, the saving
(1 - mean / fixed; negative: it asked more), why the runs stopped, and the time-uniform
coverage (the share of all runs, both columns' audits, whose confidence sequence held the truth
after every batch).
The last two columns run the same audits with the cap at the fixed size: the sequential audit
then never asks more users than the fixed one, and stops early when the gap is clear.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from fedparity.mechanisms.ldp.nprr import NPRRMechanism, nprr_for_budget
from fedparity.mechanisms.ldp.reports import PerturbedReports
from fedparity.mechanisms.ldp.sequential import (
    STOP_REASONS,
    SequentialGapAudit,
    fixed_audit_size,
)

GAPS = {2: (0.0, 0.05, 0.1, 0.2, 0.3), 5: (0.0, 0.1, 0.2, 0.3)}
SHORT = {STOP_REASONS[0]: "differ", STOP_REASONS[1]: "width", STOP_REASONS[2]: "cap"}


def run(
    mechanism: NPRRMechanism,
    means: np.ndarray,
    rng: np.random.Generator,
    *,
    batch_size: int,
    max_users: int,
    target_width: float,
    confidence: float,
) -> tuple[int, str, bool]:
    """One sequential audit (the loop of ``sequential_gap_audit``, checking the truth after
    every batch): (users asked, why it stopped, covered at every batch)."""
    d = len(means)
    audit = SequentialGapAudit(mechanism, confidence=confidence)
    true_gap = float(means.max() - means.min())
    covered = True
    while True:
        n = min(batch_size, max_users - audit.users)
        groups = rng.integers(0, d, size=n)
        metric = (rng.random(n) < means[groups]).astype(np.float64)
        reports: PerturbedReports = mechanism.perturb(groups, 2 * metric - 1, rng)
        state = audit.update(reports)
        covered &= state.interval.low <= true_gap <= state.interval.high
        covered &= all(
            ci.low <= m <= ci.high for ci, m in zip(state.group_intervals, means, strict=True)
        )
        widths = [
            state.group_intervals[i].width + state.group_intervals[j].width for i, j in audit.pairs
        ]
        if state.interval.low > 0:
            return audit.users, STOP_REASONS[0], covered
        if max(widths) < target_width:
            return audit.users, STOP_REASONS[1], covered
        if audit.users >= max_users:
            return audit.users, STOP_REASONS[2], covered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--target-width", type=float, default=0.1)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=2023)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(
        f"epsilon {args.epsilon} per user, target width {args.target_width}, confidence "
        f"{args.confidence}, {args.runs} runs per row, metric Bernoulli per user, equal groups"
    )
    print()
    print(
        "| d | true gap | fixed-n users | mean users asked (sd) | saving | stopped "
        "(differ/width/cap) | coverage | cap = fixed: mean users | cap = fixed: gap found |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for d, gaps in GAPS.items():
        mechanism = nprr_for_budget(args.epsilon, d)
        fixed = fixed_audit_size(mechanism, args.target_width, confidence=args.confidence)
        batch_size = max(fixed // 20, 100)
        for gap in gaps:
            means = 0.6 + np.linspace(-gap / 2, gap / 2, d)
            rng = np.random.default_rng([args.seed, d, round(gap * 1000)])
            asked, reasons, covered = [], Counter(), 0
            for _ in range(args.runs):
                users, reason, ok = run(
                    mechanism,
                    means,
                    rng,
                    batch_size=batch_size,
                    max_users=20 * fixed,
                    target_width=args.target_width,
                    confidence=args.confidence,
                )
                asked.append(users)
                reasons[SHORT[reason]] += 1
                covered += ok
            capped, found = [], 0
            for _ in range(args.runs):
                users, reason, ok = run(
                    mechanism,
                    means,
                    rng,
                    batch_size=batch_size,
                    max_users=fixed,
                    target_width=args.target_width,
                    confidence=args.confidence,
                )
                capped.append(users)
                found += reason == STOP_REASONS[0]
                covered += ok
            mean = float(np.mean(asked))
            stops = "/".join(str(reasons[k]) for k in ("differ", "width", "cap"))
            print(
                f"| {d} | {gap:g} | {fixed:,} | {mean:,.0f} ({np.std(asked, ddof=1):,.0f}) | "
                f"{1 - mean / fixed:+.0%} | {stops} | {covered / (2 * args.runs):.3f} | "
                f"{np.mean(capped):,.0f} | {found / args.runs:.0%} |"
            )
    print()
    print(
        f"M_N grid: G = {nprr_for_budget(args.epsilon, 2).grid_size} (d = 2); "
        f"{time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
