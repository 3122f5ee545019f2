"""Side by side: MSE and interval width of M_R, M_L, M_P and M_N at the same true epsilon.

    python -m benchmarks.mechanism_table [--quick] [--json]

For every budget eps in {0.5, 1, 2, 4, 8}, d in {2, 5} balanced groups and n in {10^5, 10^7}
users, each mechanism of the LDP gap audit at the split the planner gives it for that budget
(M_R, M_L, M_P: :func:`fedparity.mechanisms.ldp.calibration.optimal_split`; M_N:
:func:`fedparity.mechanisms.ldp.nprr.nprr_for_budget`, split and grid), its realised epsilon at
most eps. The population is fixed and has no randomness: group g holds users n g / d to
n (g + 1) / d - 1, each with a binary metric m in {0, 1} (v = 2 m - 1 = +/-1: e.g. whether the
model is right on the user's example); the first round(mu_g n / d) users of group g have m = 1,
with group means mu = 0.6 and 0.4 for d = 2 and 0.6, 0.55, 0.5, 0.45, 0.4 for d = 5, so the
largest gap is 0.2, between groups 0 and d - 1, in both.

Each cell is a seeded Monte Carlo of R replicates: every replicate perturbs the whole
population with the real mechanism (``perturb_and_summarize`` in blocks, through
:func:`~fedparity.mechanisms.ldp.streaming.summarize_stream`, so 10^7 users take a few blocks'
memory) and estimates with :func:`~fedparity.mechanisms.ldp.estimators.estimate_gap` (group sizes
estimated from the reports, as the audit does by default; ``--known-sizes`` gives it the true
sizes). Reported in metric units:

* MSE of the estimated difference of the largest gap's pair, m_hat_0 - m_hat_(d-1), against the
  true 0.2 (unbiased, so its MSE is its variance), with its Monte Carlo standard error;
* the standard error three ways: Monte Carlo (the replicates' sd), analytic (the estimator's
  variance, :func:`~fedparity.mechanisms.ldp.estimators.estimator_covariance`, at the
  population's true sizes and values: exact for known sizes, the delta method for estimated
  ones), and the planner's (the worst case over values with known sizes that
  :func:`~fedparity.mechanisms.ldp.calibration.gap_variance_factor` and ``fedparity plan``
  use, divided by n);
* the mean width of the audit's interval for the largest gap (``max_gap_interval``:
  simultaneous over the pairs, Bonferroni; for d = 2 the pair's normal interval) at 95 %, and
  its empirical coverage of the true 0.2;
* the MSE of the reported largest gap ``max_gap`` (the largest |difference| over all pairs),
  which for d = 5 at small budgets picks the noisiest pair and is biased upwards.

A mechanism that cannot release at a budget (M_L and M_P need eps2 in [0.02, 12]) gets a row
saying so. The side-by-side table gives, per (eps, d, n), each mechanism's MSE and interval
width, the mechanism with the smallest Monte Carlo MSE, and the planner's choice: ``best``
of :func:`~fedparity.mechanisms.ldp.calibration.best_split` and, among all four, the smallest
worst-case variance factor (M_N's from its moments).

Runs are seeded (``--seed``) and reproducible, so **not private** (``--generator secure`` draws
the noise from the nodes' AES-CTR generator instead). Writes
benchmarks/results/mechanism_table.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import git_commit, load_average
from fedparity.mechanisms import estimate_gap, summarize_stream
from fedparity.mechanisms.crypto.secure_random import secure_generator
from fedparity.mechanisms.ldp.calibration import best_split, gap_variance_factor, optimal_split
from fedparity.mechanisms.ldp.estimators import EstimationError, estimator_covariance
from fedparity.mechanisms.ldp.laplace import LaplaceMechanism
from fedparity.mechanisms.ldp.nprr import NPRRMechanism, nprr_for_budget
from fedparity.mechanisms.ldp.piecewise import PiecewiseMechanism
from fedparity.mechanisms.ldp.reports import ReportMoments

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
GROUPS = (2, 5)
#: (users, replicates) of the full run and of ``--quick``.
SIZES = ((10**5, 200), (10**7, 10))
QUICK_SIZES = ((10**4, 50), (10**5, 5))
NAMES = ("R", "L", "P", "N")
#: Users per chunk handed to summarize_stream (a view of the population, no copy).
CHUNK = 1 << 20
LARGEST_GAP = 0.2


def group_means(num_groups: int) -> np.ndarray:
    """mu_g, from 0.6 down to 0.4 in equal steps (largest gap 0.2, groups 0 and d - 1)."""
    return np.linspace(0.6, 0.6 - LARGEST_GAP, num_groups)


@dataclass(frozen=True)
class Population:
    """The fixed population: balanced groups, values +/-1, its true sizes and sums (v units)."""

    groups: np.ndarray
    values: np.ndarray
    sizes: np.ndarray
    sums: np.ndarray
    square_sums: np.ndarray

    @property
    def means(self) -> np.ndarray:
        """True group means of the metric m = (v + 1) / 2."""
        return (self.sums / self.sizes + 1.0) / 2.0

    @property
    def largest_gap(self) -> float:
        return float(self.means.max() - self.means.min())


def population(num_users: int, num_groups: int) -> Population:
    """Group g: users n g / d .. n (g + 1) / d - 1; its first round(mu_g n / d) have v = +1."""
    if num_users % num_groups or num_users < 2 * num_groups:
        raise ValueError(
            f"num_users must be a multiple of num_groups ({num_groups}) and at least "
            f"{2 * num_groups}, got {num_users}"
        )
    size = num_users // num_groups
    ones = np.rint(group_means(num_groups) * size).astype(np.int64)
    groups = np.repeat(np.arange(num_groups, dtype=np.int8), size)
    rank = np.tile(np.arange(size, dtype=np.int64), num_groups)
    values = np.where(rank < np.repeat(ones, size), 1.0, -1.0)
    sizes = np.full(num_groups, float(size))
    return Population(groups, values, sizes, 2.0 * ones - sizes, sizes.copy())


def build(name: str, epsilon: float, num_groups: int) -> Any:
    """The mechanism at the planner's split for ``epsilon``; ``ValueError`` if it cannot
    release there."""
    if name == "N":
        return nprr_for_budget(epsilon, num_groups)
    mechanism = optimal_split(name, epsilon, num_groups).build()  # type: ignore[arg-type]
    if isinstance(mechanism, (LaplaceMechanism, PiecewiseMechanism)):
        mechanism.check_releasable()
    return mechanism


def population_moments(mechanism: Any) -> ReportMoments:
    """The report moments exact for values on the mechanism's grid (here +/-1).

    M_N's :attr:`~fedparity.mechanisms.ldp.nprr.NPRRMechanism.moments` add NPRR's rounding
    variance at its bound r / G^2 for kept reports; a value on the grid is not rounded, so for
    this population that term is 0. M_L's and M_P's rounding terms (at most step^2 / 4 of a
    2^-8 step) are left: below 10^-5 of their variance.
    """
    moments = mechanism.moments
    if isinstance(mechanism, NPRRMechanism) and mechanism.grid_size > 1:
        rounding = moments.value_gain / mechanism.grid_size**2
        return dataclasses.replace(
            moments, kept_second_moment=moments.kept_second_moment - rounding
        )
    return moments


def pair_stderr(moments: ReportMoments, people: Population, *, sizes_known: bool) -> float:
    """The estimator's standard error (metric units) of m_hat_0 - m_hat_(d-1) at the
    population's true sizes and values."""
    num_users = float(people.sizes.sum())
    cov = estimator_covariance(
        moments, num_users, people.sizes, people.sums, people.square_sums, sizes_known=sizes_known
    )
    last = cov.shape[0] - 1
    return float(np.sqrt(cov[0, 0] + cov[last, last] - 2.0 * cov[0, last]) / 2.0)


def planner_stderr(mechanism: Any, num_groups: int, num_users: int) -> float:
    """The planner's standard error (metric units): worst case over values, known sizes."""
    factor = gap_variance_factor(mechanism.moments, np.full(num_groups, 1.0 / num_groups))
    return float(np.sqrt(factor / num_users) / 2.0)


@dataclass(frozen=True)
class CellResult:
    """One (mechanism, eps, d, n) cell. Metric units; ``unavailable`` says why a mechanism
    did not run (then the numbers are NaN)."""

    mechanism: str
    budget: float
    num_groups: int
    num_users: int
    replicates: int
    epsilon: float
    epsilon_group: float
    epsilon_value: float
    grid_size: int | None
    true_gap: float
    mse: float
    mse_stderr: float
    bias: float
    mc_stderr: float
    analytic_stderr: float
    planner_stderr: float
    reported_stderr: float
    mean_width: float
    covered: int
    max_gap_mse: float
    failures: int
    seconds: float
    unavailable: str | None = None

    @property
    def coverage(self) -> float:
        runs = self.replicates - self.failures
        return self.covered / runs if runs else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "coverage": self.coverage}


def _unavailable(
    name: str, budget: float, num_groups: int, num_users: int, replicates: int, reason: str
) -> CellResult:
    nan = float("nan")
    return CellResult(
        name, budget, num_groups, num_users, replicates, nan, nan, nan, None, LARGEST_GAP,
        nan, nan, nan, nan, nan, nan, nan, nan, 0, nan, 0, 0.0, reason,
    )  # fmt: skip


def run_cell(
    name: str,
    budget: float,
    people: Population,
    replicates: int,
    rng: np.random.Generator,
    *,
    confidence: float = 0.95,
    known_sizes: bool = False,
) -> CellResult:
    """``replicates`` audits of ``people`` by mechanism ``name`` at ``budget``.

    A replicate whose estimate is refused (:class:`EstimationError`, a group's estimated size
    indistinguishable from zero) counts in ``failures`` and not in the statistics."""
    num_groups = int(people.sizes.shape[0])
    num_users = int(people.sizes.sum())
    try:
        mechanism = build(name, budget, num_groups)
    except ValueError as error:
        return _unavailable(name, budget, num_groups, num_users, replicates, str(error))
    started = time.perf_counter()
    chunks = [
        (people.groups[start : start + CHUNK], people.values[start : start + CHUNK])
        for start in range(0, num_users, CHUNK)
    ]
    sizes = people.sizes.astype(np.int64) if known_sizes else None
    true_gap = people.largest_gap
    pair = (0, num_groups - 1)
    differences, reported, widths, max_gaps = [], [], [], []
    covered = failures = 0
    for _ in range(replicates):
        summary = summarize_stream(mechanism, chunks, rng)
        try:
            estimate = estimate_gap(summary, mechanism, group_sizes=sizes, confidence=confidence)
        except EstimationError:
            failures += 1
            continue
        index = estimate.pairs.index(pair)
        differences.append(float(estimate.differences[index]))
        reported.append(float(estimate.difference_stderrs[index]))
        interval = estimate.max_gap_interval
        widths.append(interval.width)
        covered += int(interval.low <= true_gap <= interval.high)
        max_gaps.append(estimate.max_gap)
    errors = np.asarray(differences) - true_gap
    squares = errors**2
    runs = squares.size
    nan = float("nan")
    return CellResult(
        mechanism=name,
        budget=budget,
        num_groups=num_groups,
        num_users=num_users,
        replicates=replicates,
        epsilon=float(mechanism.epsilon),
        epsilon_group=float(mechanism.epsilon_group),
        epsilon_value=float(mechanism.epsilon_value),
        grid_size=int(mechanism.grid_size) if isinstance(mechanism, NPRRMechanism) else None,
        true_gap=true_gap,
        mse=float(squares.mean()) if runs else nan,
        mse_stderr=float(squares.std(ddof=1) / np.sqrt(runs)) if runs > 1 else nan,
        bias=float(errors.mean()) if runs else nan,
        mc_stderr=float(np.std(differences, ddof=1)) if runs > 1 else nan,
        analytic_stderr=pair_stderr(population_moments(mechanism), people, sizes_known=known_sizes),
        planner_stderr=planner_stderr(mechanism, num_groups, num_users),
        reported_stderr=float(np.mean(reported)) if runs else nan,
        mean_width=float(np.mean(widths)) if runs else nan,
        covered=covered,
        max_gap_mse=float(np.mean((np.asarray(max_gaps) - true_gap) ** 2)) if runs else nan,
        failures=failures,
        seconds=time.perf_counter() - started,
    )


def planner_choice(budget: float, num_groups: int) -> tuple[str, str]:
    """(``best_split("best")``'s mechanism, the mechanisms with the smallest worst-case variance
    factor among all four that can release, M_N's from its moments; ties within 0.1 % joined
    by "="; M_N with G = 1 is M_R)."""
    fractions = np.full(num_groups, 1.0 / num_groups)
    best = best_split("best", budget, num_groups).mechanism
    factors = {}
    for name in NAMES:
        try:
            mechanism = build(name, budget, num_groups)
        except ValueError:
            continue
        factors[name] = gap_variance_factor(mechanism.moments, fractions)
    smallest = min(factors.values())
    tied = [name for name in NAMES if name in factors and factors[name] <= smallest * 1.001]
    return best, " = ".join(f"M_{name}" for name in tied)


def _seed(seed: int, budget: float, num_groups: int, num_users: int, name: str) -> list[int]:
    return [seed, round(budget * 100), num_groups, num_users, NAMES.index(name)]


def run(
    sizes: tuple[tuple[int, int], ...],
    *,
    epsilons: tuple[float, ...] = EPSILONS,
    groups: tuple[int, ...] = GROUPS,
    seed: int = 2026,
    generator: str = "pcg64",
    confidence: float = 0.95,
    known_sizes: bool = False,
    progress: bool = True,
) -> list[CellResult]:
    """Every cell, in the order (d, n, eps, mechanism)."""
    rows = []
    for num_groups in groups:
        for num_users, replicates in sizes:
            people = population(num_users, num_groups)
            for budget in epsilons:
                for name in NAMES:
                    rng = (
                        secure_generator()
                        if generator == "secure"
                        else np.random.default_rng(_seed(seed, budget, num_groups, num_users, name))
                    )
                    row = run_cell(
                        name,
                        budget,
                        people,
                        replicates,
                        rng,
                        confidence=confidence,
                        known_sizes=known_sizes,
                    )
                    rows.append(row)
                    if progress:
                        print(_progress_line(row), file=sys.stderr, flush=True)
    return rows


def _progress_line(row: CellResult) -> str:
    head = f"eps={row.budget:g} d={row.num_groups} n={row.num_users:.0e} M_{row.mechanism}"
    if row.unavailable:
        return f"{head}: not releasable"
    return (
        f"{head}: MSE {row.mse:.3g}, SE MC {row.mc_stderr:.3g} / analytic "
        f"{row.analytic_stderr:.3g}, width {row.mean_width:.3g}, covered "
        f"{row.covered}/{row.replicates - row.failures}, {row.seconds:.1f} s"
    )


def _split(row: CellResult) -> str:
    text = f"{row.epsilon_group:.2f} / {row.epsilon_value:.2f}"
    return text + (f" (G = {row.grid_size})" if row.grid_size is not None else "")


def detailed_table(rows: list[CellResult]) -> str:
    """Every cell: split, MSE (Monte Carlo se), the three standard errors, width, coverage."""
    lines = [
        "| ε | d | n | mech | ε1 / ε2 | R | MSE (MC se) | SE: MC | SE: analytic | SE: planner "
        "| 95% width | coverage | MSE of max_gap |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        head = f"| {row.budget:g} | {row.num_groups} | {row.num_users:.0e} | M_{row.mechanism} "
        if row.unavailable:
            reason = row.unavailable.split(":")[0]  # the rule; the JSON has the whole text
            lines.append(head + f"| not releasable: {reason} |" + " |" * 8)
            continue
        runs = row.replicates - row.failures
        failed = f" ({row.failures} refused)" if row.failures else ""
        lines.append(
            head + f"| {_split(row)} | {row.replicates}{failed} | {row.mse:.2e} "
            f"({row.mse_stderr:.1e}) | {row.mc_stderr:.2e} | {row.analytic_stderr:.2e} "
            f"| {row.planner_stderr:.2e} | {row.mean_width:.2e} | {row.covered}/{runs} "
            f"| {row.max_gap_mse:.2e} |"
        )
    return "\n".join(lines)


def smallest_mse(rows: list[CellResult]) -> str:
    """The mechanisms whose Monte Carlo MSE is the smallest, with those within two Monte Carlo
    standard errors of the difference from it ("M_R ≈ M_N"): ties the replicates cannot
    separate."""
    measured = [row for row in rows if not row.unavailable and row.failures < row.replicates]
    if not measured:
        return "-"
    best = min(measured, key=lambda row: row.mse)
    tied = [
        row
        for row in measured
        if row.mse - best.mse <= 2.0 * float(np.hypot(row.mse_stderr, best.mse_stderr))
    ]
    return " ≈ ".join(f"M_{row.mechanism}" for row in sorted(tied, key=lambda row: row.mse))


def narrowest_interval(rows: list[CellResult]) -> str:
    """The mechanisms whose mean 95 % interval is the narrowest (within 1 %)."""
    measured = [row for row in rows if not row.unavailable and row.failures < row.replicates]
    if not measured:
        return "-"
    narrowest = min(row.mean_width for row in measured)
    tied = [row for row in measured if row.mean_width <= 1.01 * narrowest]
    return " = ".join(f"M_{row.mechanism}" for row in tied)


def side_by_side(rows: list[CellResult]) -> str:
    """Per (eps, d, n): each mechanism's "MSE / 95% width", the smallest MSE, the narrowest
    interval, the planner's choices."""
    cells: dict[tuple[float, int, int], dict[str, CellResult]] = {}
    for row in rows:
        cells.setdefault((row.budget, row.num_groups, row.num_users), {})[row.mechanism] = row
    lines = [
        "| ε | d | n | " + " | ".join(f"M_{name}: MSE / width" for name in NAMES)
        + " | smallest MSE | narrowest interval | planner: `best` / of four |",
        "|---:|---:|---:|" + "---:|" * len(NAMES) + "---|---|---|",
    ]  # fmt: skip
    for (budget, num_groups, num_users), by_name in sorted(cells.items()):
        entries = []
        for name in NAMES:
            row = by_name.get(name)
            if row is None:
                entries.append("")
            elif row.unavailable:
                entries.append("not releasable")
            elif row.failures == row.replicates:
                entries.append("estimate refused")
            else:
                entries.append(f"{row.mse:.1e} / {row.mean_width:.3g}")
        best, of_four = planner_choice(budget, num_groups)
        cell_rows = list(by_name.values())
        lines.append(
            f"| {budget:g} | {num_groups} | {num_users:.0e} | " + " | ".join(entries)
            + f" | {smallest_mse(cell_rows)} | {narrowest_interval(cell_rows)} "
            f"| M_{best} / {of_four} |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="n = 10^4 and 10^5 with 50 and 5 replicates"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument(
        "--generator",
        choices=("pcg64", "secure"),
        default="pcg64",
        help="noise generator: seeded PCG64 (default, reproducible) or the nodes' AES-CTR one",
    )
    parser.add_argument("--known-sizes", action="store_true", help="give estimate_gap the sizes")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    parser.add_argument("--groups", type=int, nargs="+", default=list(GROUPS))
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    load_before = load_average()
    started = time.perf_counter()
    rows = run(
        sizes,
        epsilons=tuple(args.epsilons),
        groups=tuple(args.groups),
        seed=args.seed,
        generator=args.generator,
        known_sizes=args.known_sizes,
    )
    elapsed = time.perf_counter() - started
    command = "python -m benchmarks.mechanism_table " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header = (
        f"# LDP gap mechanisms side by side ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()})\n\n"
        f"`{command.strip()}`: {elapsed:.0f} s, load average {load_before} before and "
        f"{load_average()} after; sizes {'estimated' if not args.known_sizes else 'known'}, "
        f"noise {args.generator}, seed {args.seed}, "
        + ", ".join(f"R = {r} at n = {n:.0e}" for n, r in sizes)
        + "; MSE and widths in metric units, true largest gap 0.2.\n"
    )
    text = f"{header}\n{side_by_side(rows)}\n\n{detailed_table(rows)}\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mechanism_table.md").write_text(text)
    payload = [row.to_dict() for row in rows]
    (RESULTS / "mechanism_table.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
