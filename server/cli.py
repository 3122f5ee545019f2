"""The ``fedparity`` command line: the LDP math for auditors and planners.

Subcommands (``fedparity <command> --help`` for every option):

* ``privacy``  -- the true LDP epsilon of M_R / M_L for (eps1, eps2, d) (SPEC 1.1);
* ``plan``     -- minimum budget for an error target, or the error bound at a budget;
* ``measure``  -- run a mechanism on every row of a CSV (one row = one client) and estimate
  the per-group means and gaps from the perturbed reports, streaming the file;
* ``fairtest`` -- the two-stage FedEvalFair test on per-client summaries from a CSV;
* ``keys``     -- write a CKKS key pair for the encrypted FedEvalFair protocol;
* ``federations`` -- add the app's ``local-simulation`` / ``local-deployment`` connections to
  Flower's ``$FLWR_HOME/config.toml``.

Each takes ``--json`` to print one JSON object (keys in the README). Bad input exits with
status 2 and a one-line message naming the parameter; nothing is computed or released.
No Flower import here: the command starts fast and works without a federation.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np

from ..mechanisms import (
    EstimationError,
    GapEstimate,
    UnboundedPrivacyLossError,
    estimate_gap,
    metric_to_value,
    summarize_stream,
    true_epsilon,
)
from ..mechanisms.calibration import best_split
from ..mechanisms.fairtest import ClientSummary, FairnessReport, fedevalfair
from ..mechanisms.laplace import LDP_NOISE_RATIO, check_noise_ratio
from ..mechanisms.planner import error_bound, format_table1, minimum_epsilon, table1

#: Rows parsed per chunk by ``measure`` (bounded memory for files of any length).
DEFAULT_CHUNK_ROWS = 1 << 18
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: printed on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _finite(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{name} must be finite, got {text!r}")
    return value


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise UsageError(f"{name} must be > 0, got {value:g}")
    return value


def _unit_open(name: str, value: float) -> float:
    if not 0.0 < value < 1.0:
        raise UsageError(f"{name} must be in the open interval (0, 1), got {value:g}")
    return value


def _int_at_least(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        try:  # accept integral scientific notation such as 1e7
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number.is_integer()):
            raise UsageError(f"{name} must be an integer >= {minimum}, got {text!r}") from None
        value = int(number)
    if value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _number(value: float) -> str:
    """A number for a message: 2 for 2.0, else the shortest exact form (1.0000001, nan),
    never numpy's ``np.float64(2.0)`` repr."""
    number = float(value)
    if number.is_integer() and abs(number) < 1e16:
        return str(int(number))
    return repr(number)


def _emit(payload: dict[str, Any], text: str, as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(payload, allow_nan=False) + "\n")
    else:
        out.write(text.rstrip("\n") + "\n")


# --- privacy ------------------------------------------------------------------------------


def _paper_claimed_epsilon(mechanism: str, eps1: float, eps2: float, k: float) -> float:
    """What the paper's Theorem 5 / 6 claims (for contrast only; both are wrong)."""
    if mechanism == "R":
        return max(eps1, eps2)
    return max(eps2, math.log(2 / k) + eps2 / 2 - eps1, math.log(k / 2) + eps2 / k + eps1)


def run_privacy(args: argparse.Namespace, out: TextIO) -> int:
    eps1 = _positive("--eps1", _finite("--eps1", args.eps1))
    eps2 = _positive("--eps2", _finite("--eps2", args.eps2))
    groups = _int_at_least("--groups", args.groups, 2)
    noise_ratio = _positive("--k", _finite("--k", args.k))
    if args.mechanism == "R" and noise_ratio != LDP_NOISE_RATIO:
        # Compared as a number: "2", "2.0" and "2e0" all mean the default.
        raise UsageError(
            "--k only applies to --mechanism L (M_R has no noise ratio); got "
            f"{_number(noise_ratio)}"
        )
    if args.mechanism == "L":
        try:
            check_noise_ratio(noise_ratio)
        except UnboundedPrivacyLossError as error:
            raise UsageError(f"--k: {error}") from None
    epsilon = true_epsilon(args.mechanism, eps1, eps2, groups)
    claimed = _paper_claimed_epsilon(args.mechanism, eps1, eps2, noise_ratio)
    payload = {
        "mechanism": args.mechanism,
        "epsilon_group": eps1,
        "epsilon_value": eps2,
        "num_groups": groups,
        "noise_ratio": noise_ratio if args.mechanism == "L" else None,
        "epsilon": epsilon,
        "paper_claimed_epsilon": claimed,
    }
    theorem = "Theorem 5" if args.mechanism == "R" else "Theorem 6"
    text = (
        f"M_{args.mechanism} with eps1={eps1:g}, eps2={eps2:g}, d={groups}: "
        f"true epsilon = {epsilon:.6g}\n"
        f"(the paper's {theorem} claims {claimed:.6g}"
        + (", which is wrong: see SPEC 1.1)" if not math.isclose(claimed, epsilon) else ")")
    )
    _emit(payload, text, args.json, out)
    return 0


# --- plan ---------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace, out: TextIO) -> int:
    confidence = _unit_open("--confidence", _finite("--confidence", args.confidence))
    groups = _int_at_least("--groups", args.groups, 2)
    ratio = _positive("--group-ratio", _finite("--group-ratio", args.group_ratio))
    if args.table:
        paper = table1(paper_allocation=True, confidence=confidence)
        valid = table1(bound=args.bound, confidence=confidence)
        payload = {"paper_table1": paper, "valid_table1": valid, "bound": args.bound}
        text = (
            "Paper's Table 1 (value scale, Chebyshev; its allocations are NOT eps-LDP):\n"
            f"{format_table1(paper)}\n\n"
            f"Valid mechanisms (true eps <= budget; {args.bound} bound, value scale):\n"
            f"{format_table1(valid)}"
        )
        _emit(payload, text, args.json, out)
        return 0
    if args.clients is None:
        raise UsageError("--clients is required (or use --table)")
    clients = _int_at_least("--clients", args.clients, groups)
    if (args.alpha is None) == (args.epsilon is None):
        raise UsageError("give exactly one of --alpha (find the budget) or --epsilon (the error)")
    candidates = ("R", "L") if args.mechanism == "best" else (args.mechanism,)
    common = dict(
        confidence=confidence,
        group_ratio=ratio,
        num_groups=groups,
        bound=args.bound,
        scale=args.scale,
    )
    if args.alpha is not None:
        alpha = _positive("--alpha", _finite("--alpha", args.alpha))
        plans = [minimum_epsilon(name, clients, alpha, **common) for name in candidates]
        reachable = [p for p in plans if p.epsilon is not None]
        chosen = min(reachable, key=lambda p: p.epsilon) if reachable else plans[0]
        query = "min_epsilon"
    else:
        epsilon = _positive("--epsilon", _finite("--epsilon", args.epsilon))
        plans = [error_bound(name, clients, epsilon, **common) for name in candidates]
        chosen = min(plans, key=lambda p: p.alpha)
        query = "error_bound"
    payload = {"query": query, **chosen.to_dict(), "candidates": [p.to_dict() for p in plans]}
    lines = [
        f"K={clients:,} clients, d={groups}, group ratio {ratio:g}, confidence {confidence:g}, "
        f"{args.bound} bound, errors on the {args.scale} scale"
    ]
    for plan in plans:
        split = plan.split
        if query == "min_epsilon":
            head = f"M_{plan.mechanism}: minimum epsilon for error {plan.alpha:g}: "
            if plan.epsilon is None:
                lines.append(head + "none (no budget up to 1e4 reaches it)")
                continue
            head += f"{plan.epsilon:.4g}"
        else:
            head = f"M_{plan.mechanism}: error bound at epsilon {plan.epsilon:g}: {plan.alpha:.4g}"
        assert split is not None
        lines.append(
            f"{head}  (eps1={split.epsilon_group:.4g}, eps2={split.epsilon_value:.4g}, "
            f"true eps={split.epsilon:.4g})"
        )
    if len(plans) > 1:
        lines.append(f"best: M_{chosen.mechanism}")
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


# --- measure ------------------------------------------------------------------------------


def _csv_columns(path: Path, group_column: str, metric_column: str) -> tuple[int, int]:
    with path.open("r", encoding="utf-8-sig") as handle:  # tolerate a BOM (Excel)
        header = handle.readline().strip()
    if not header:
        raise UsageError(f"--input: {path} is empty (expected a header line)")
    names = [name.strip() for name in header.split(",")]
    for option, column in (("--group-column", group_column), ("--metric-column", metric_column)):
        if column not in names:
            raise UsageError(f"{option}: column {column!r} not in {path.name}'s header {names}")
    return names.index(group_column), names.index(metric_column)


def _read_chunks(
    path: Path,
    group_index: int,
    metric_index: int,
    num_groups: int,
    chunk_rows: int,
    group_counts: np.ndarray,
    raw_sums: np.ndarray,
    args: argparse.Namespace,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (groups, values) chunks, checking every row; tally true group sizes."""
    row = 1  # header is line 1
    with path.open("rb") as handle:
        handle.readline()
        while True:
            lines = handle.readlines(chunk_rows * 24)
            if not lines:
                return
            try:
                table = np.loadtxt(
                    lines,
                    delimiter=",",
                    usecols=(group_index, metric_index),
                    ndmin=2,
                    dtype=np.float64,
                )
            except ValueError as error:
                raise UsageError(
                    f"--input: cannot parse rows {row + 1}-{row + len(lines)}: {error}"
                ) from None
            groups_float, metrics = table[:, 0], table[:, 1]
            bad = ~np.isfinite(groups_float) | (groups_float != np.round(groups_float))
            bad |= (groups_float < 0) | (groups_float >= num_groups)
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                raise UsageError(
                    f"--group-column {args.group_column!r}: row {row + 1 + first} has group "
                    f"{_number(groups_float[first])}; groups must be integers in "
                    f"[0, {num_groups - 1}] "
                    f"(--groups {num_groups})"
                )
            bad = ~np.isfinite(metrics) | (metrics < 0) | (metrics > 1)
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                raise UsageError(
                    f"--metric-column {args.metric_column!r}: row {row + 1 + first} has value "
                    f"{_number(metrics[first])}; metric values must be in [0, 1]"
                )
            groups = groups_float.astype(np.int64)
            group_counts += np.bincount(groups, minlength=num_groups)
            raw_sums += np.bincount(groups, weights=metrics, minlength=num_groups)
            row += len(lines)
            yield groups, metric_to_value(metrics)


def _format_estimate(estimate: GapEstimate, budget: float, elapsed: float) -> str:
    level = f"{100 * estimate.confidence:g}%"
    lines = [
        f"M_{estimate.mechanism}: eps1={estimate.epsilon_group:.4g}, "
        f"eps2={estimate.epsilon_value:.4g}; true epsilon spent per client = "
        f"{estimate.epsilon:.6g} (budget {budget:g})",
        f"K = {estimate.num_reports:,} clients; group sizes "
        + ("estimated from the perturbed reports" if estimate.sizes_estimated else "known"),
        "",
        f"{'group':>5}  {'size':>12}  {'mean':>8}  {'stderr':>8}",
    ]
    for group in range(estimate.num_groups):
        lines.append(
            f"{group:>5}  {estimate.group_sizes[group]:>12,.0f}  "
            f"{estimate.group_means[group]:>8.4f}  {estimate.group_stderrs[group]:>8.4f}"
        )
    lines += [
        "",
        f"{'pair':>6}  {'gap':>8}  {level + ' interval':>20}  {'normal +/-':>10}  "
        f"{'Chebyshev +/-':>13}",
    ]
    for index, (i, j) in enumerate(estimate.pairs):
        ci = estimate.gap_intervals[index]
        lines.append(
            f"{f'{i}-{j}':>6}  {estimate.gaps[index]:>8.4f}  "
            f"{f'[{ci.low:.4f}, {ci.high:.4f}]':>20}  "
            f"{estimate.normal_halfwidths[index]:>10.4f}  "
            f"{estimate.chebyshev_halfwidths[index]:>13.4f}"
        )
    if estimate.num_groups > 2:
        ci = estimate.max_gap_interval
        i, j = estimate.max_gap_pair
        lines.append(
            f"max gap {estimate.max_gap:.4f} (groups {i}-{j}), simultaneous {level} interval "
            f"[{ci.low:.4f}, {ci.high:.4f}]"
        )
    lines.append(f"(metric units; {elapsed:.1f} s)")
    return "\n".join(lines)


def run_measure(args: argparse.Namespace, out: TextIO) -> int:
    budget = _positive("--epsilon", _finite("--epsilon", args.epsilon))
    groups = _int_at_least("--groups", args.groups, 2)
    confidence = _unit_open("--confidence", _finite("--confidence", args.confidence))
    chunk_rows = _int_at_least("--chunk-rows", args.chunk_rows, 1)
    seed = None if args.seed is None else _int_at_least("--seed", args.seed, 0)
    path = Path(args.input)
    if not path.is_file():
        raise UsageError(f"--input: no such file: {path}")
    group_index, metric_index = _csv_columns(path, args.group_column, args.metric_column)
    mechanism = best_split(args.mechanism, budget, groups).build()
    rng = np.random.default_rng(seed)
    counts = np.zeros(groups, dtype=np.int64)
    raw_sums = np.zeros(groups)
    started = time.perf_counter()
    summary = summarize_stream(
        mechanism,
        _read_chunks(path, group_index, metric_index, groups, chunk_rows, counts, raw_sums, args),
        rng,
    )
    if summary.num_reports < groups:
        raise UsageError(
            f"--input: {summary.num_reports} rows is fewer than the number of groups ({groups})"
        )
    if np.any(counts == 0):
        empty = int(np.flatnonzero(counts == 0)[0])
        raise UsageError(
            f"--group-column {args.group_column!r}: group {empty} has no row (empty group); "
            f"check --groups {groups}"
        )
    try:
        estimate = estimate_gap(
            summary,
            mechanism,
            group_sizes=counts if args.known_group_sizes else None,
            confidence=confidence,
        )
    except EstimationError as error:
        raise UsageError(f"--epsilon {budget:g}: {error}") from None
    elapsed = time.perf_counter() - started
    payload: dict[str, Any] = {
        "input": str(path),
        "budget": budget,
        "seed": seed,
        **estimate.to_dict(),
        "elapsed_seconds": elapsed,
    }
    text = _format_estimate(estimate, budget, elapsed)
    if args.compare_raw:
        raw_means = raw_sums / counts
        raw_gap = float(np.max(raw_means) - np.min(raw_means))
        payload["raw_group_means"] = raw_means.tolist()
        payload["raw_max_gap"] = raw_gap
        text += (
            "\nraw input (NOT private, for evaluating the estimate): group means "
            + ", ".join(f"{m:.4f}" for m in raw_means)
            + f"; max gap {raw_gap:.4f}"
        )
    _emit(payload, text, args.json, out)
    return 0


# --- fairtest -----------------------------------------------------------------------------

FAIRTEST_COLUMNS = ("mean", "variance", "n")
#: Optional columns: a holder's margins (ClientSummary.margins), all three or none.
MARGIN_COLUMNS = ("group0_rows", "group1_rows", "predicted_positive_rows")


def _read_client_summaries(path: Path) -> list[ClientSummary]:
    """One ClientSummary per CSV row (columns mean, variance, n and, optionally, the margins
    group0_rows, group1_rows, predicted_positive_rows; others ignored)."""
    if not path.is_file():
        raise UsageError(f"--input: no such file: {path}")
    with path.open("r", encoding="utf-8-sig", newline="") as handle:  # tolerate a BOM
        rows = list(csv.reader(handle))
    if not rows or not any(field.strip() for field in rows[0]):
        raise UsageError(f"--input: {path} is empty (expected a header line: mean,variance,n)")
    names = [name.strip() for name in rows[0]]
    missing = [column for column in FAIRTEST_COLUMNS if column not in names]
    if missing:
        raise UsageError(f"--input: column {missing[0]!r} not in {path.name}'s header {names}")
    present = [column for column in MARGIN_COLUMNS if column in names]
    if present and len(present) < len(MARGIN_COLUMNS):
        absent = [column for column in MARGIN_COLUMNS if column not in names]
        raise UsageError(
            f"--input: the margin columns go together: {present} given without {absent}"
        )
    columns = FAIRTEST_COLUMNS + tuple(present)
    index = {column: names.index(column) for column in columns}
    summaries = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(field.strip() for field in row):
            continue  # blank line
        if len(row) < len(names):
            raise UsageError(f"--input: row {line} has {len(row)} fields, expected {len(names)}")
        values = {}
        for column, position in index.items():
            text = row[position].strip()
            try:
                values[column] = float(text)
            except ValueError:
                raise UsageError(
                    f"--input: row {line}: column {column!r} is not a number: {text!r}"
                ) from None
        margins = tuple(values[c] for c in MARGIN_COLUMNS) if present else None
        try:
            summaries.append(
                ClientSummary(values["mean"], values["variance"], values["n"], margins)  # type: ignore[arg-type]
            )
        except ValueError as error:
            raise UsageError(f"--input: row {line}: {error}") from None
    if len(summaries) < 2:
        raise UsageError(
            f"--input: FedEvalFair needs at least 2 clients (rows), got {len(summaries)}"
        )
    return summaries


def _decision(rejected: bool) -> str:
    return "rejected" if rejected else "not rejected"


def _format_fairtest(report: FairnessReport) -> str:
    h, c, level = report.homogeneity, report.common_disparity, 1.0 - report.alpha
    interval = report.confidence_interval(level)
    stage1 = "T1 (paper Eq. 10)" if report.mode == "paper" else "Cochran's Q"
    lines = [
        f"FedEvalFair, mode {report.mode}: k = {report.k} clients, alpha = {report.alpha:g}",
        f"stage 1 (H0: mu_1 = ... = mu_k): {stage1} = {h.statistic:.6g}, dof {h.dof}, "
        f"p = {h.pvalue:.4g} -> {_decision(report.reject_homogeneity)}",
        f"stage 2 (H0: mu = {report.mu0:g}): W* = {c.statistic:.6g}, p = {c.pvalue:.4g} -> "
        f"{_decision(report.reject_fairness)}",
        f"common disparity (Graybill-Deal): {report.estimate:.6g} (stderr {report.stderr:.4g}), "
        f"{100 * level:g}% CI [{interval.low:.6g}, {interval.high:.6g}]",
    ]
    if report.equivalence is not None:
        e = report.equivalence
        verdict = "certified fair" if report.certified_fair else "not certified"
        lines.append(
            f"equivalence (TOST, H0: |mu| >= {report.tolerance:g}): z = {e.statistic:.6g}, "
            f"p = {e.pvalue:.4g} -> {verdict}"
        )
    if report.mode == "paper":
        lines.append(
            "(paper mode: weights n/S^2 with n = bootstrap resamples, |disparities|, T1 is not "
            "chi2(k-1): see SPEC 2.1; the default calibrated mode holds alpha)"
        )
    return "\n".join(lines)


def run_fairtest(args: argparse.Namespace, out: TextIO) -> int:
    """FedEvalFair's two stages (and TOST) from per-client summaries in a CSV (SPEC 2)."""
    alpha = _unit_open("--alpha", _finite("--alpha", args.alpha))
    mu0 = _finite("--mu0", args.mu0)
    tolerance = None
    if args.tolerance is not None:
        tolerance = _finite("--tolerance", args.tolerance)
        if tolerance < 0:
            raise UsageError(f"--tolerance must be >= 0, got {tolerance:g}")
    summaries = _read_client_summaries(Path(args.input))
    report = fedevalfair(summaries, alpha=alpha, mode=args.mode, mu0=mu0, tolerance=tolerance)
    payload: dict[str, Any] = {"input": str(args.input), **report.to_dict()}
    _emit(payload, _format_fairtest(report), args.json, out)
    return 0


# --- federations --------------------------------------------------------------------------

LOCAL_SIMULATION = "local-simulation"
LOCAL_DEPLOYMENT = "local-deployment"


def flower_config_path(flwr_home: str | None) -> Path:
    """``$FLWR_HOME/config.toml`` (Flower's default home is ~/.flwr)."""
    import os

    home = flwr_home or os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")
    return Path(home).expanduser() / "config.toml"


def run_federations(args: argparse.Namespace, out: TextIO) -> int:
    """Add the ``local-simulation`` (default) and ``local-deployment`` connections.

    Flower 1.41 keeps connections in ``$FLWR_HOME/config.toml``; a ``[tool.flwr.federations]``
    table in pyproject.toml would be migrated there and commented out of the project file, so
    the project ships this command instead. Other entries of the file are kept.
    """
    import tomllib

    import tomli_w  # a Flower dependency (Flower writes this file with it too)

    address = args.deployment_address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--deployment-address must be HOST:PORT, got {address!r}")
    path = flower_config_path(args.flwr_home)
    config: dict[str, Any] = {}
    if path.exists():
        try:
            config = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as error:
            raise UsageError(f"--flwr-home: {path} is not valid TOML: {error}") from None
    superlink = config.setdefault("superlink", {})
    superlink[LOCAL_SIMULATION] = {"address": ":local:"}
    superlink[LOCAL_DEPLOYMENT] = {"address": address, "insecure": True}
    superlink.setdefault("default", LOCAL_SIMULATION)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config), encoding="utf-8")
    payload = {
        "config_file": str(path),
        "default": superlink["default"],
        LOCAL_SIMULATION: superlink[LOCAL_SIMULATION],
        LOCAL_DEPLOYMENT: superlink[LOCAL_DEPLOYMENT],
    }
    text = (
        f"wrote {path}:\n"
        f"  {LOCAL_SIMULATION}: local simulation engine"
        + (" (default)" if superlink["default"] == LOCAL_SIMULATION else "")
        + f"\n  {LOCAL_DEPLOYMENT}: SuperLink at {address} (insecure, loopback)\n"
        f"then: flwr run . {LOCAL_DEPLOYMENT} --stream"
    )
    _emit(payload, text, args.json, out)
    return 0


# --- keys ---------------------------------------------------------------------------------


def run_keys(args: argparse.Namespace, out: TextIO) -> int:
    """Write a CKKS key pair for FedEvalFair: the secret context for the key holders (the
    clients; give each node its path out of band) and the public one for the server."""
    from ..mechanisms.ckks import DEFAULT_KEY_DIR, CkksParameters, generate_keys

    degree = _int_at_least("--poly-modulus-degree", args.poly_modulus_degree, 1024)
    try:
        moduli = tuple(int(part) for part in args.coeff_mod_bit_sizes.split(","))
    except ValueError:
        raise UsageError(
            f"--coeff-mod-bit-sizes must be comma-separated integers, got "
            f"{args.coeff_mod_bit_sizes!r}"
        ) from None
    scale = _int_at_least("--scale-bits", args.scale_bits, 1)
    parameters = CkksParameters(degree, moduli, scale)
    try:
        paths = generate_keys(args.out or DEFAULT_KEY_DIR, parameters, overwrite=args.overwrite)
    except FileExistsError as error:
        raise UsageError(f"--out: {error} (use --overwrite to replace)") from None
    payload = {
        "secret_context": str(paths.secret),
        "public_context": str(paths.public),
        "poly_modulus_degree": degree,
        "coeff_mod_bit_sizes": list(moduli),
        "scale_bits": scale,
        "security_bits": parameters.security_bits,
    }
    text = (
        f"secret context (key holders / clients, keep private): {paths.secret}\n"
        f"public context (server, run config fef-public-context): {paths.public}\n"
        f"CKKS N={degree}, moduli {list(moduli)} ({sum(moduli)} bits), scale 2^{scale}: "
        f"{parameters.security_bits}-bit security\n"
        f"give each node the secret path: --node-config \"fef-secret-context='{paths.secret}'\" "
        f"(or FEDPARITY_SECRET_CONTEXT in a simulation's environment)"
    )
    _emit(payload, text, args.json, out)
    return 0


# --- entry point --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedparity", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    privacy = commands.add_parser("privacy", help="true LDP epsilon of M_R / M_L")
    privacy.add_argument("--mechanism", choices=("R", "L"), required=True)
    privacy.add_argument("--eps1", required=True, help="group budget eps1 > 0")
    privacy.add_argument("--eps2", required=True, help="value budget eps2 > 0")
    privacy.add_argument("--groups", default="2", help="number of groups d >= 2 (default 2)")
    privacy.add_argument("--k", default="2", help="M_L noise ratio; only k = 2 is LDP")
    privacy.add_argument("--json", action="store_true", help="print one JSON object")

    plan = commands.add_parser("plan", help="budget for an error target, or error at a budget")
    plan.add_argument("--mechanism", choices=("R", "L", "best"), default="best")
    plan.add_argument("--clients", help="number of clients K")
    plan.add_argument("--alpha", help="error target: find the minimum epsilon")
    plan.add_argument("--epsilon", help="budget: find the error bound")
    plan.add_argument("--confidence", default="0.99", help="probability of the bound (0.99)")
    plan.add_argument("--group-ratio", default="1", help="n_A / n_B (default 1: balanced)")
    plan.add_argument("--groups", default="2", help="number of groups d (default 2)")
    plan.add_argument("--bound", choices=("chebyshev", "normal"), default="chebyshev")
    plan.add_argument("--scale", choices=("metric", "value"), default="metric")
    plan.add_argument("--table", action="store_true", help="print Table 1 (paper vs valid)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    measure = commands.add_parser("measure", help="run a mechanism + estimator on a CSV")
    measure.add_argument("--input", required=True, help="CSV, one row per client, with header")
    measure.add_argument("--epsilon", required=True, help="per-client LDP budget")
    measure.add_argument("--mechanism", choices=("R", "L", "best"), default="best")
    measure.add_argument("--seed", default=None, help="seed (simulations only; omit in production)")
    measure.add_argument("--group-column", default="group")
    measure.add_argument("--metric-column", default="metric")
    measure.add_argument("--groups", default="2", help="number of groups d (default 2)")
    measure.add_argument("--confidence", default="0.95", help="interval level (0.95)")
    measure.add_argument(
        "--known-group-sizes",
        action="store_true",
        help="use the true group sizes from the file instead of estimating them",
    )
    measure.add_argument(
        "--compare-raw",
        action="store_true",
        help="also print the raw (non-private) group means of the input",
    )
    measure.add_argument("--chunk-rows", default=str(DEFAULT_CHUNK_ROWS), help=argparse.SUPPRESS)
    measure.add_argument("--json", action="store_true", help="print one JSON object")

    fairtest = commands.add_parser(
        "fairtest", help="FedEvalFair two-stage fairness test from per-client summaries (CSV)"
    )
    fairtest.add_argument(
        "--input", required=True, help="CSV, one row per client, header with mean,variance,n"
    )
    fairtest.add_argument(
        "--mode",
        choices=("calibrated", "paper"),
        default="calibrated",
        help="calibrated (default; holds alpha) or the paper's statistics (SPEC 2.1)",
    )
    fairtest.add_argument("--alpha", default="0.05", help="level of the decisions (0.05)")
    fairtest.add_argument("--mu0", default="0", help="stage 2 null value of the disparity (0)")
    fairtest.add_argument(
        "--tolerance", default=None, help="also certify |mu| < tolerance (TOST); >= 0"
    )
    fairtest.add_argument("--json", action="store_true", help="print one JSON object")

    keys = commands.add_parser("keys", help="write a CKKS key pair for FedEvalFair")
    keys.add_argument(
        "--out", default=None, help="folder for the two contexts (default ~/.fedparity/keys)"
    )
    keys.add_argument("--poly-modulus-degree", default="8192")
    keys.add_argument("--coeff-mod-bit-sizes", default="60,40,40,60")
    keys.add_argument("--scale-bits", default="40")
    keys.add_argument("--overwrite", action="store_true")
    keys.add_argument("--json", action="store_true", help="print one JSON object")

    federations = commands.add_parser(
        "federations",
        help="add the local-simulation and local-deployment connections to Flower's config",
    )
    federations.add_argument("--flwr-home", default=None, help="default: $FLWR_HOME or ~/.flwr")
    federations.add_argument(
        "--deployment-address",
        default="127.0.0.1:9093",
        help="the SuperLink of local-deployment (its --port)",
    )
    federations.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


COMMANDS = {
    "privacy": run_privacy,
    "plan": run_plan,
    "measure": run_measure,
    "fairtest": run_fairtest,
    "federations": run_federations,
    "keys": run_keys,
}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 bad input)."""
    out = sys.stdout if out is None else out
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args, out)
    except (UsageError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        sys.stderr.write(f"fedparity {args.command}: error: {message}\n")
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
