"""``fedparity measure``: run a mechanism on every row of a CSV (one row = one client) and
estimate the per-group means and gaps from the perturbed reports, streaming the file."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ...mechanisms import (
    EstimationError,
    GapEstimate,
    estimate_gap,
    metric_to_value,
    summarize_stream,
)
from ...mechanisms.crypto.secure_random import secure_generator
from ...mechanisms.ldp.calibration import MECHANISMS, best_split
from ...mechanisms.ldp.nprr import NPRRMechanism
from ..progress import Progress
from ._common import (
    UsageError,
    _emit,
    _epsilon,
    _finite,
    _groups,
    _input_file,
    _integer,
    _not_utf8,
    _number,
    _unit_open,
)

#: Rows parsed per chunk by ``measure`` (bounded memory for files of any length).
DEFAULT_CHUNK_ROWS = 1 << 18
#: Files larger than this show their progress on stderr (about 2 million rows, a second or more).
PROGRESS_MIN_BYTES = 8 << 20


def _csv_columns(path: Path, group_column: str, metric_column: str) -> tuple[int, int]:
    with path.open("rb") as handle:
        raw = handle.readline()
    try:
        header = raw.decode("utf-8-sig").strip()  # tolerate a BOM (Excel)
    except UnicodeDecodeError as error:
        raise _not_utf8("--input", path, error, 1) from None
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
    progress: Progress | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (groups, values) chunks, checking every row; tally true group sizes; count the
    bytes read on ``progress``."""
    row = 1  # header is line 1
    with path.open("rb") as handle:
        handle.readline()
        while True:
            if progress is not None:  # the chunks yielded so far have been processed
                progress.advance(handle.tell() - progress.done)
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
                raise _parse_error(
                    path, lines, row, (group_index, metric_index), args, error
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


def _parse_error(
    path: Path,
    lines: list[bytes],
    row: int,
    indices: tuple[int, int],
    args: argparse.Namespace,
    error: ValueError,
) -> UsageError:
    """The usage error of a chunk numpy could not parse, naming the file line (``row`` is the
    line before the chunk) and the column at fault, found line by line (numpy's own message
    counts rows from 0 within the chunk)."""
    options = (("--group-column", args.group_column), ("--metric-column", args.metric_column))
    for offset, raw in enumerate(lines):
        line = row + 1 + offset
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            return _not_utf8("--input", path, bad, line)
        if not text.strip():
            continue
        fields = text.rstrip("\r\n").split(",")
        for index, (option, column) in zip(indices, options, strict=True):
            if index >= len(fields):
                return UsageError(
                    f"--input: {path.name} line {line} has {len(fields)} fields, too few for "
                    f"column {column!r} ({option})"
                )
            try:
                float(fields[index])
            except ValueError:
                return UsageError(
                    f"{option} {column!r}: {path.name} line {line} holds "
                    f"{fields[index].strip()!r}, not a number"
                )
    return UsageError(f"--input: cannot parse lines {row + 1}-{row + len(lines)}: {error}")


def _format_estimate(
    estimate: GapEstimate, budget: float, elapsed: float, grid_size: int | None = None
) -> str:
    level = f"{100 * estimate.confidence:g}%"
    grid = "" if grid_size is None else f", G={grid_size}"
    lines = [
        f"M_{estimate.mechanism}: eps1={estimate.epsilon_group:.4g}, "
        f"eps2={estimate.epsilon_value:.4g}{grid}; true epsilon spent per client = "
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
    budget = _epsilon("--epsilon", args.epsilon)
    groups = _groups(args.groups)
    confidence = _unit_open("--confidence", _finite("--confidence", args.confidence))
    chunk_rows = _integer("--chunk-rows", args.chunk_rows, 1)
    seed = None if args.seed is None else _integer("--seed", args.seed, 0)
    path = _input_file("--input", args.input)
    group_index, metric_index = _csv_columns(path, args.group_column, args.metric_column)
    mechanism = best_split(args.mechanism, budget, groups).build()
    # privacy noise: the secure generator; a seed (simulations only) makes a run reproducible
    rng = secure_generator() if seed is None else np.random.default_rng(seed)
    counts = np.zeros(groups, dtype=np.int64)
    raw_sums = np.zeros(groups)
    started = time.perf_counter()
    size = path.stat().st_size
    # A large file shows its progress on stderr (a bar on a terminal, else a plain line per
    # ~10 %); stdout keeps only the result.
    progress = (
        Progress("measure", size, units="MB", scale=1e-6) if size > PROGRESS_MIN_BYTES else None
    )
    with progress or contextlib.nullcontext():
        chunks = _read_chunks(
            path, group_index, metric_index, groups, chunk_rows, counts, raw_sums, args, progress
        )
        summary = summarize_stream(mechanism, chunks, rng)
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
    grid_size = mechanism.grid_size if isinstance(mechanism, NPRRMechanism) else None
    if grid_size is not None:
        payload["grid_size"] = grid_size  # M_N's epsilon depends on its grid
    text = _format_estimate(estimate, budget, elapsed, grid_size)
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


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity measure`` and its options."""
    measure = commands.add_parser(
        "measure",
        help="run a mechanism + estimator on a CSV",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Perturb every client's (group, metric) row of a CSV with an LDP mechanism and "
            "estimate\nthe gap between the groups' mean metrics, with its interval (streamed: "
            "any file size;\na progress line on stderr for large files).\n\n"
            "examples:\n"
            "  fedparity measure --input clients.csv --epsilon 1\n"
            "      columns 'group' (0 or 1) and 'metric' (in [0, 1]); prints the gap estimate\n"
            "  fedparity measure --input clients.csv --epsilon 2 --groups 3 --compare-raw --json"
        ),
    )
    measure.add_argument("--input", required=True, help="CSV, one row per client, with header")
    measure.add_argument("--epsilon", required=True, help="per-client LDP budget")
    measure.add_argument(
        "--mechanism",
        choices=(*MECHANISMS, "best"),
        default="best",
        help=(
            "R: randomized response for group and value (M_R); L: randomized response for the "
            "group and discrete Laplace for the value (M_L); P: randomized response for the "
            "group and the Piecewise mechanism for the value (M_P); N: randomized response for "
            "the group and NPRR on a grid for the value (M_N); best: the smaller error "
            "(default)"
        ),
    )
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
