"""Monte Carlo of FedEvalFair, both modes: type-I error and power (the paper's Figures 2-3).

    python benchmarks/fedevalfair_mc.py [--iterations 1000] [--quick] [--seed 2024] [--json]
        [--min-cell 5] [--no-margins] [--output PATH.md | --no-write]

Every iteration draws fresh client test sets, bootstraps each client with
:func:`fedparity.mechanisms.bootstrap_disparity` (B = 100), summarises it in mode ``"paper"`` (mean
and
S^2 of |disparities|, n = B) and ``"calibrated"`` (signed plug-in, S^2 of the signed
resamples, the margins; ``--no-margins`` drops them, i.e. weights 1 / S^2), and runs both
stages at the 5% level. The calibrated mode, and why the paper's statistics are miscalibrated,
are described in :mod:`fedparity.mechanisms.fairness_tests.fedevalfair`.

The paper: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version); FedEvalFair (anonymous, 2024).

(a) Synthetic, paper style: k = 5 clients of n rows each, A ~ Bernoulli(0.3) (minority),
    Yhat | A=0 ~ Bernoulli(0.3 + delta_i/2), Yhat | A=1 ~ Bernoulli(0.3 - delta_i/2), so the
    client's population dp disparity is exactly delta_i. Scenarios: delta_i = delta for all
    clients (stage 1's H0 holds; stage 2's holds at delta = 0) and delta_i evenly spread on
    [0, delta] (stage 1's H1). TOST (calibrated) with tolerance 0.05.
(b) UCI Adult (``clients.project.data.adult_holder``: race, 0 = White, 1 = other): the paper's
    doctorate / no-doctorate split (k = 2) and a random split into k = 10 (Dirichlet shares
    with alpha = 100 per class: nearly IID). A client's population is its rows of adult.data +
    adult.test; each iteration its test set is a without-replacement sample of min(n, pool)
    rows. Models: ``fair`` -- Yhat ~ Bernoulli(pi) for every row, pi = the logistic
    regression's positive rate on adult.test (a randomised classifier that ignores every
    feature, so Yhat is independent of (A, Y) in the population: dp = eo = 0 in every client);
    ``logreg`` -- a logistic regression (numpy Newton, L2 = 1) trained on adult.data with all
    features (race included): its disparity on each client's pool is the truth; rejections are
    power.

Every simulated client applies the app's ``fef-min-cell`` rule (``--min-cell``, default 5 as
in the app; 0 = no rule): it leaves a metric out when the smallest margin (group size, or
count of rows predicted positive or negative) among the rows the metric averages over (all
rows for dp, Y = 1 for eo) has fewer than ``--min-cell`` rows
(``BootstrapDisparity.smallest_margin``, as in
``clients.fedevalfair.client_statistics``). The remaining clients are tested; an iteration
in which fewer than 2 clients report the metric is "unavailable", and the rates are over
the available iterations (the tables give the unavailable fraction). The random stream does
not depend on ``--min-cell``: with the same seed every client's test set is the same.

A rate over R iterations has binomial SE sqrt(p (1 - p) / R) (0.0069 at p = 0.05, R = 1000).
Writes benchmarks/results/fedevalfair_mc.md (and .json; ``--output PATH.md`` writes PATH.md
and PATH.json instead, ``--no-write`` writes nothing) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedparity.mechanisms import (
    BootstrapDisparity,
    ClientSummary,
    InsufficientGroupData,
    bootstrap_disparity,
    fedevalfair,
    stage_statistics,
)
from fedparity.server.progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_ADULT = REPO.parent / "shared" / "data" / "adult"
ALPHA = 0.05
TOLERANCE = 0.05
MODES = ("paper", "calibrated")

# A client test set for one iteration: (predictions, labels, groups).
Sampler = Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class Rates:
    """Rejection rates at ALPHA of one cell, per mode: stage 1, stage 2, TOST (calibrated).

    The rates are over the ``iterations - untested`` iterations in which at least 2 clients
    reported the metric (NaN if there were none).
    """

    stage1: dict[str, float]
    stage2: dict[str, float]
    tost: float
    iterations: int
    dropped_clients: int
    excluded_clients: int
    untested: int
    smallest_cell: float


def below_min_cell(result: BootstrapDisparity, min_cell: int) -> bool:
    """The data holders' ``fef-min-cell`` rule (clients/fedevalfair.py:client_statistics): a
    metric is not reported when its smallest margin among the rows it averages over (group
    sizes, predicted positives and negatives: :attr:`BootstrapDisparity.smallest_margin`) has
    fewer than ``min_cell`` rows. ``min_cell = 0`` never excludes."""
    return result.smallest_margin < min_cell


def run_cell(
    samplers: list[Sampler],
    sizes: list[int],
    *,
    metric: str,
    iterations: int,
    resamples: int,
    rng: np.random.Generator,
    min_cell: int = 0,
    margins: bool = True,
    progress: Progress | None = None,
) -> Rates:
    """``iterations`` draws of every client's test set -> both modes' p-values -> rates.

    As in the app, a client leaves the metric out when its bootstrap fails (no member of a
    group, S^2 = 0: counted in ``dropped_clients``) or it fails the ``fef-min-cell`` rule
    (:func:`below_min_cell`, checked before the summaries as in
    ``clients.fedevalfair.client_statistics``: counted in ``excluded_clients``). The rest
    are tested; an iteration with fewer than 2 of them is untested (unavailable). The
    bootstrap is run for every client whatever ``min_cell`` is, so the random stream, and
    every client's test set, does not depend on ``min_cell``. ``margins=False`` runs the
    calibrated mode without the margins (weights 1 / S^2, the plain inverse-variance form) on
    the same draws. ``progress`` counts the iterations.
    """
    k = len(samplers)
    means = {mode: np.full((iterations, k), np.nan) for mode in MODES}
    variances = {mode: np.full((iterations, k), np.nan) for mode in MODES}
    holder_margins = np.full((iterations, k, 3), np.nan)
    dropped = excluded = 0
    smallest = np.full((iterations, k), np.nan)
    for iteration in range(iterations):
        for client, (sampler, size) in enumerate(zip(samplers, sizes, strict=True)):
            predictions, labels, groups = sampler(rng, size)
            try:
                result = bootstrap_disparity(
                    predictions, labels, groups, metric=metric, num_resamples=resamples, rng=rng
                )
                if below_min_cell(result, min_cell):  # the app's fef-min-cell rule
                    smallest[iteration, client] = min(result.cell_counts)
                    excluded += 1
                    continue
                summaries = {mode: result.summary(mode) for mode in MODES}  # type: ignore[arg-type]
            except InsufficientGroupData:  # the client cannot take part this time
                dropped += 1
                continue
            smallest[iteration, client] = min(result.cell_counts)
            if margins:
                holder_margins[iteration, client] = result.margins
            for mode, summary in summaries.items():
                means[mode][iteration, client] = summary.mean
                variances[mode][iteration, client] = summary.variance
        if progress is not None:
            progress.advance()
    rejected = {mode: np.zeros((iterations, 3), dtype=bool) for mode in MODES}
    tested = np.zeros(iterations, dtype=bool)
    complete = ~np.isnan(means["paper"]).any(axis=1)
    for mode in MODES:
        if complete.any():
            batch = stage_statistics(
                means[mode][complete],
                variances[mode][complete],
                resamples,
                margins=holder_margins[complete] if margins and mode == "calibrated" else None,
                mode=mode,  # type: ignore[arg-type]
                tolerance=TOLERANCE,
            )
            assert batch.equivalence_pvalue is not None
            rejected[mode][complete] = np.column_stack(
                [
                    batch.homogeneity_pvalue < ALPHA,
                    batch.common_pvalue < ALPHA,
                    batch.equivalence_pvalue < ALPHA,
                ]
            )
        tested |= complete
        for iteration in np.flatnonzero(~complete):  # fewer clients: test those that remain
            present = ~np.isnan(means[mode][iteration])
            if present.sum() < 2:
                continue
            summaries = [
                ClientSummary(m, v, resamples, None if np.isnan(c[0]) else tuple(int(x) for x in c))
                for m, v, c in zip(
                    means[mode][iteration, present],
                    variances[mode][iteration, present],
                    holder_margins[iteration, present],
                    strict=True,
                )
            ]
            report = fedevalfair(summaries, mode=mode, alpha=ALPHA, tolerance=TOLERANCE)  # type: ignore[arg-type]
            rejected[mode][iteration] = (
                report.reject_homogeneity,
                report.reject_fairness,
                bool(report.certified_fair),
            )
            tested[iteration] = True
    count = int(tested.sum())

    def rate(values: np.ndarray) -> float:
        return float(values.sum() / count) if count else float("nan")

    return Rates(
        stage1={mode: rate(rejected[mode][tested, 0]) for mode in MODES},
        stage2={mode: rate(rejected[mode][tested, 1]) for mode in MODES},
        tost=rate(rejected["calibrated"][tested, 2]),
        iterations=iterations,
        dropped_clients=dropped,
        excluded_clients=excluded,
        untested=int((~tested).sum()),
        smallest_cell=float(np.nanmean(np.nanmin(smallest, axis=1))),
    )


# --- (a) synthetic ----------------------------------------------------------------------------


def synthetic_sampler(delta: float, minority: float = 0.3, base: float = 0.3) -> Sampler:
    """A client whose population dp disparity is exactly ``delta`` (group 0 minus group 1)."""

    def sample(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        groups = (rng.random(size) < minority).astype(np.int8)
        rate = np.where(groups == 0, base + delta / 2, base - delta / 2)
        predictions = (rng.random(size) < rate).astype(np.int8)
        return predictions, np.ones(size, dtype=np.int8), groups

    return sample


def synthetic_part(
    sizes: list[int],
    deltas: list[float],
    spreads: list[float],
    k: int,
    args: argparse.Namespace,
    progress: Progress | None = None,
) -> list[dict]:
    rows = []
    scenarios = [("common", d) for d in deltas] + [("spread", d) for d in spreads]
    for index, (kind, delta) in enumerate(scenarios):
        client_deltas = [delta] * k if kind == "common" else list(np.linspace(0.0, delta, k))
        samplers = [synthetic_sampler(d) for d in client_deltas]
        for size_index, size in enumerate(sizes):
            rng = np.random.default_rng(np.random.SeedSequence([args.seed, 1, index, size_index]))
            started = time.perf_counter()
            rates = run_cell(
                samplers,
                [size] * k,
                metric="dp",
                iterations=args.iterations,
                resamples=args.resamples,
                rng=rng,
                min_cell=args.min_cell,
                margins=not args.no_margins,
                progress=progress,
            )
            rows.append(
                {
                    "part": "synthetic",
                    "scenario": kind,
                    "delta": delta,
                    "client_deltas": [float(d) for d in client_deltas],
                    "k": k,
                    "n": size,
                    **_rates_dict(rates, k, args.min_cell),
                    "seconds": time.perf_counter() - started,
                }
            )
            _progress(rows[-1])
    return rows


# --- (b) UCI Adult ----------------------------------------------------------------------------


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> np.ndarray:
    """Newton-Raphson for L2-penalised logistic regression (intercept not penalised)."""
    design = np.hstack([x.astype(np.float64), np.ones((x.shape[0], 1))])
    beta = np.zeros(design.shape[1])
    penalty = np.full(design.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(design @ beta)))
        gradient = design.T @ (p - y) + penalty * beta
        hessian = (design.T * (p * (1 - p))) @ design + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        beta -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return beta


def logistic_predict(beta: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float64) @ beta[:-1] + beta[-1]) > 0.0).astype(np.int8)


@dataclass
class Pool:
    """A client's population: its Adult rows and the two models' predictions on them."""

    labels: np.ndarray
    groups: np.ndarray
    logreg: np.ndarray

    def disparity(self, metric: str) -> float:
        rows = self.labels == 1 if metric == "eo" else np.ones(self.labels.size, dtype=bool)
        rate0 = self.logreg[rows & (self.groups == 0)].mean()
        rate1 = self.logreg[rows & (self.groups == 1)].mean()
        return float(rate0 - rate1)


def adult_pools(data_dir: Path, scheme: str, k: int) -> tuple[list[Pool], float]:
    from fedparity.clients.project.data import adult_features, adult_holder, load_adult

    adult = load_adult(data_dir)
    x_train, y_train, x_test, _, _, _ = adult_features(adult)
    beta = fit_logistic(x_train, y_train)
    positive_rate = float(logistic_predict(beta, x_test).mean())
    pools = []
    for holder in range(k):
        parts = [
            adult_holder(data_dir, holder, k, split, scheme=scheme, dirichlet_alpha=100.0)
            for split in ("train", "test")
        ]
        features = np.concatenate([p.features for p in parts])
        pools.append(
            Pool(
                labels=np.concatenate([p.labels for p in parts]).astype(np.int8),
                groups=np.concatenate([p.user_groups for p in parts]).astype(np.int8),
                logreg=logistic_predict(beta, features),
            )
        )
    return pools, positive_rate


def adult_sampler(pool: Pool, model: str, positive_rate: float) -> Sampler:
    def sample(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = rng.choice(pool.labels.size, size=min(size, pool.labels.size), replace=False)
        if model == "fair":
            predictions = (rng.random(rows.size) < positive_rate).astype(np.int8)
        else:
            predictions = pool.logreg[rows]
        return predictions, pool.labels[rows], pool.groups[rows]

    return sample


def adult_present(args: argparse.Namespace) -> bool:
    data_dir = Path(args.adult_dir)
    return (data_dir / "adult.data").is_file() and (data_dir / "adult.test").is_file()


def adult_part(
    sizes: list[int], args: argparse.Namespace, progress: Progress | None = None
) -> list[dict]:
    data_dir = Path(args.adult_dir)
    if not adult_present(args):
        print(f"UCI Adult not found in {data_dir}: part (b) skipped", file=sys.stderr)
        return []
    rows = []
    for split_index, (scheme, k) in enumerate((("doctorate", 2), ("dirichlet", 10))):
        pools, positive_rate = adult_pools(data_dir, scheme, k)
        for model_index, model in enumerate(("fair", "logreg")):
            samplers = [adult_sampler(pool, model, positive_rate) for pool in pools]
            for metric_index, metric in enumerate(("dp", "eo")):
                truth = [0.0] * k if model == "fair" else [p.disparity(metric) for p in pools]
                for size_index, size in enumerate(sizes):
                    seed = [args.seed, 2, split_index, model_index, metric_index, size_index]
                    rng = np.random.default_rng(np.random.SeedSequence(seed))
                    client_sizes = [min(size, pool.labels.size) for pool in pools]
                    started = time.perf_counter()
                    rates = run_cell(
                        samplers,
                        [size] * k,
                        metric=metric,
                        iterations=args.iterations,
                        resamples=args.resamples,
                        rng=rng,
                        min_cell=args.min_cell,
                        margins=not args.no_margins,
                        progress=progress,
                    )
                    rows.append(
                        {
                            "part": "adult",
                            "split": scheme,
                            "k": k,
                            "model": model,
                            "metric": metric,
                            "n": size,
                            "client_sizes": client_sizes,
                            "pool_sizes": [int(p.labels.size) for p in pools],
                            "positive_rate": positive_rate,
                            "true_disparities": truth,
                            **_rates_dict(rates, k, args.min_cell),
                            "seconds": time.perf_counter() - started,
                        }
                    )
                    _progress(rows[-1])
    return rows


# --- output -----------------------------------------------------------------------------------


def _rate(value: float) -> float | None:
    """A rate for the JSON rows: None when no iteration was available (NaN)."""
    return None if np.isnan(value) else value


def _rates_dict(rates: Rates, k: int, min_cell: int) -> dict:
    return {
        "min_cell": min_cell,
        "paper_stage1": _rate(rates.stage1["paper"]),
        "paper_stage2": _rate(rates.stage2["paper"]),
        "calibrated_stage1": _rate(rates.stage1["calibrated"]),
        "calibrated_stage2": _rate(rates.stage2["calibrated"]),
        "calibrated_tost": _rate(rates.tost),
        "iterations": rates.iterations,
        "tested_iterations": rates.iterations - rates.untested,
        "dropped_clients": rates.dropped_clients,
        "excluded_clients": rates.excluded_clients,
        "excluded_share": rates.excluded_clients / (rates.iterations * k),
        "untested_iterations": rates.untested,
        "unavailable": rates.untested / rates.iterations,
        "mean_smallest_cell": rates.smallest_cell,
    }


def _fmt(value: float | None) -> str:
    """A rate in a table: 3 decimals, or n/a when no iteration was available."""
    return "n/a" if value is None else f"{value:.3f}"


def _progress(row: dict) -> None:
    label = (
        f"{row['scenario']} delta={row['delta']:g}"
        if row["part"] == "synthetic"
        else f"{row['split']} {row['model']} {row['metric']}"
    )
    print(
        f"[{row['part']}] {label} n={row['n']}: paper {_fmt(row['paper_stage1'])}/"
        f"{_fmt(row['paper_stage2'])}  calibrated {_fmt(row['calibrated_stage1'])}/"
        f"{_fmt(row['calibrated_stage2'])}  TOST {_fmt(row['calibrated_tost'])}  "
        f"unavailable {row['unavailable']:.3f}  excluded {row['excluded_share']:.3f}  "
        f"({row['seconds']:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def _pick(rows: list[dict], **match: object) -> dict:
    found = [r for r in rows if all(r.get(key) == value for key, value in match.items())]
    assert len(found) == 1, match
    return found[0]


def markdown(
    rows: list[dict],
    sizes: list[int],
    adult_sizes: list[int],
    deltas: list[float],
    spreads: list[float],
    args: argparse.Namespace,
    elapsed: float,
) -> str:
    synthetic = [r for r in rows if r["part"] == "synthetic"]
    r = args.iterations
    if args.min_cell > 0:
        rule = (
            f"Every client applies the app's `fef-min-cell` = {args.min_cell} rule: it leaves "
            "the metric out when the smallest margin (group size, predicted positives or "
            "negatives) among the rows the metric averages over has fewer than "
            f"{args.min_cell} rows. **Rates are over the "
            "available iterations** (at least 2 clients report the metric); unavailable = "
            "fraction of the iterations with fewer than 2 (no test), n/a = no available "
            "iteration; excluded = fraction of the client test sets left out by the rule."
        )
    else:
        rule = (
            "No `fef-min-cell` rule (`--min-cell 0`): every client whose bootstrap succeeds "
            "reports. Rates are over the available iterations (at least 2 clients report); "
            "unavailable = fraction of the iterations with fewer than 2."
        )
    lines = [
        f"# FedEvalFair Monte Carlo: {r} iterations per cell, B = {args.resamples}, "
        f"alpha = {ALPHA}, seed {args.seed}, fef-min-cell {args.min_cell} ({elapsed:.0f} s)",
        "",
        f"Rejection rates at the 5% level (binomial SE at 0.05 over {r} iterations: "
        f"{np.sqrt(0.0475 / r):.4f}; larger over fewer available iterations). "
        "paper = the paper's statistics (|disparity|, w = B / S^2, T1); calibrated = the "
        + (
            "calibrated mode WITHOUT margins (`--no-margins`: w = 1 / S^2, Cochran's Q with "
            "the same weights, the plain inverse-variance form; liberal where a cell is small). "
            if args.no_margins
            else "default mode (signed plug-in, w = 1 / V_i(0) from the holder's margins, "
            "sandwich stderr, Cochran's Q with 1 / V_i(mu_hat): "
            "mechanisms/fairness_tests/fedevalfair.py). "
        )
        + "Generated by "
        f"`benchmarks/fedevalfair_mc.py --min-cell {args.min_cell}"
        + (" --no-margins" if args.no_margins else "")
        + "`. smallest cell = the "
        "smallest (group, prediction) count among the rows a client's metric averages over, "
        "minimum over clients, mean over iterations.",
        "",
        rule,
        "",
    ]
    if synthetic:
        k = synthetic[0]["k"]
        lines += [
            f"## (a) Synthetic: k = {k} clients of n rows, minority 30%, base rate 0.3 (dp)",
            "",
            "### Type-I error: delta_i = 0 for every client (both H0 true)",
            "",
            "| n per client | paper stage 1 | paper stage 2 | calibrated stage 1 "
            "| calibrated stage 2 | smallest cell | excluded | unavailable |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n in sizes:
            row = _pick(synthetic, scenario="common", delta=0.0, n=n)
            lines.append(
                f"| {n} | {_fmt(row['paper_stage1'])} | {_fmt(row['paper_stage2'])} "
                f"| {_fmt(row['calibrated_stage1'])} | {_fmt(row['calibrated_stage2'])} "
                f"| {row['mean_smallest_cell']:.1f} | {row['excluded_share']:.3f} "
                f"| {row['unavailable']:.3f} |"
            )
        nonzero = [d for d in deltas if d > 0]
        lines += [
            "",
            "### Stage 1 type-I error under a common disparity delta (homogeneity H0 true)",
            "",
            "| n per client | "
            + " | ".join(f"paper delta={d:g}" for d in nonzero)
            + " | "
            + " | ".join(f"calibrated delta={d:g}" for d in nonzero)
            + " |",
            "|---:|" + "---:|" * (2 * len(nonzero)),
        ]
        for n in sizes:
            cells = [
                _fmt(_pick(synthetic, scenario="common", delta=d, n=n)[f"{mode}_stage1"])
                for mode in MODES
                for d in nonzero
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "### Stage 2 power: common disparity delta (H0: mu = 0 false)",
            "",
            "| n per client | "
            + " | ".join(f"paper delta={d:g}" for d in nonzero)
            + " | "
            + " | ".join(f"calibrated delta={d:g}" for d in nonzero)
            + " |",
            "|---:|" + "---:|" * (2 * len(nonzero)),
        ]
        for n in sizes:
            cells = [
                _fmt(_pick(synthetic, scenario="common", delta=d, n=n)[f"{mode}_stage2"])
                for mode in MODES
                for d in nonzero
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "### Stage 1 power: delta_i evenly spread on [0, delta] (homogeneity H0 false)",
            "",
            "| n per client | "
            + " | ".join(f"paper delta={d:g}" for d in spreads)
            + " | "
            + " | ".join(f"calibrated delta={d:g}" for d in spreads)
            + " |",
            "|---:|" + "---:|" * (2 * len(spreads)),
        ]
        for n in sizes:
            cells = [
                _fmt(_pick(synthetic, scenario="spread", delta=d, n=n)[f"{mode}_stage1"])
                for mode in MODES
                for d in spreads
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"### TOST (calibrated), tolerance {TOLERANCE}: certification rate "
            f"(a size when |delta| >= {TOLERANCE}, power below)",
            "",
            "| n per client | " + " | ".join(f"delta={d:g}" for d in deltas) + " |",
            "|---:|" + "---:|" * len(deltas),
        ]
        for n in sizes:
            cells = [
                _fmt(_pick(synthetic, scenario="common", delta=d, n=n)["calibrated_tost"])
                for d in deltas
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        scenarios = [("common", d) for d in deltas] + [("spread", d) for d in spreads]
        lines += [
            "",
            "### Unavailable fraction (fewer than 2 clients report dp) and, in brackets, the "
            "fraction of client test sets excluded by the rule, every synthetic cell",
            "",
            "| n per client | "
            + " | ".join(
                f"delta={d:g}" if kind == "common" else f"on [0, {d:g}]" for kind, d in scenarios
            )
            + " |",
            "|---:|" + "---:|" * len(scenarios),
        ]
        for n in sizes:
            picked = [_pick(synthetic, scenario=kind, delta=d, n=n) for kind, d in scenarios]
            cells = [f"{row['unavailable']:.3f} ({row['excluded_share']:.3f})" for row in picked]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    adult = [r for r in rows if r["part"] == "adult"]
    if adult:
        lines += [
            "",
            "## (b) UCI Adult, race (White vs other); test sets sampled from each client's rows",
            "",
            "`fair` = Bernoulli(pi) predictions (independent of race and label: every H0 true, "
            f"pi = {adult[0]['positive_rate']:.3f}); `logreg` = logistic regression (its "
            "disparities on the clients' rows are listed; rejections are power).",
            "",
            "| split (k) | model | metric | n per client (actual) | true disparities "
            "| paper stage 1 | paper stage 2 | calibrated stage 1 | calibrated stage 2 "
            "| smallest cell | dropped clients | excluded | unavailable |",
            "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in adult:
            actual = sorted(set(row["client_sizes"]))
            shown = f"{row['n']}" + (
                f" ({', '.join(map(str, actual))})" if actual != [row["n"]] else ""
            )
            truth = row["true_disparities"]
            truth_text = (
                "0 (all)"
                if not any(truth)
                else ", ".join(f"{t:+.3f}" for t in truth[:2])
                + (f", ... (range {min(truth):+.3f}..{max(truth):+.3f})" if len(truth) > 2 else "")
            )
            lines.append(
                f"| {row['split']} ({row['k']}) | {row['model']} | {row['metric']} | {shown} "
                f"| {truth_text} | {_fmt(row['paper_stage1'])} | {_fmt(row['paper_stage2'])} "
                f"| {_fmt(row['calibrated_stage1'])} | {_fmt(row['calibrated_stage2'])} "
                f"| {row['mean_smallest_cell']:.1f} | {row['dropped_clients']} "
                f"| {row['excluded_share']:.3f} | {row['unavailable']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 iterations, fewer cells")
    parser.add_argument("--resamples", type=int, default=100, help="bootstrap B (100)")
    parser.add_argument("--clients", type=int, default=5, help="k of the synthetic part (5)")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--adult-dir", default=str(DEFAULT_ADULT))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--min-cell",
        type=int,
        default=5,
        help="the app's fef-min-cell rule: a client reports a metric only if both groups and "
        "both predictions among the rows it averages over have at least this many rows (5; "
        "0 = no rule)",
    )
    parser.add_argument(
        "--no-margins",
        action="store_true",
        help="calibrated mode with weights 1 / S^2 (plain inverse variance) instead of the margins",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--output",
        help="write the Markdown to this path and the JSON rows next to it (suffix .json) "
        "instead of benchmarks/results/",
    )
    output.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.resamples < 2 or args.clients < 2:
        parser.error("--iterations >= 1, --resamples >= 2 and --clients >= 2 are required")
    if args.min_cell < 0:
        parser.error("--min-cell must be >= 0")
    if args.output is not None and Path(args.output).suffix == ".json":
        parser.error("--output names the Markdown file; the JSON goes next to it")
    if args.quick:
        args.iterations = min(args.iterations, 100)
        sizes, adult_sizes = [100, 1000], [100, 1000]
        deltas, spreads = [0.0, 0.05], [0.1]
    else:
        sizes, adult_sizes = [50, 100, 200, 500, 1000, 2000], [100, 500, 2000]
        deltas, spreads = [0.0, 0.02, 0.05, 0.1], [0.05, 0.1]
    started = time.perf_counter()
    cells = (len(deltas) + len(spreads)) * len(sizes)
    cells += 2 * 2 * 2 * len(adult_sizes) if adult_present(args) else 0  # split, model, metric
    with Progress("fedevalfair_mc", cells * args.iterations, units="iterations") as progress:
        rows = synthetic_part(sizes, deltas, spreads, args.clients, args, progress)
        rows += adult_part(adult_sizes, args, progress)
    elapsed = time.perf_counter() - started
    text = markdown(rows, sizes, adult_sizes, deltas, spreads, args, elapsed)
    if not args.no_write:
        if args.output is not None:
            markdown_path = Path(args.output)
        else:
            stem = "fedevalfair_mc_quick" if args.quick else "fedevalfair_mc"
            markdown_path = RESULTS / f"{stem}.md"
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(text)
        markdown_path.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
