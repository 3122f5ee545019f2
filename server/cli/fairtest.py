"""``fedparity fairtest``: the two-stage FedEvalFair test on per-client summaries from a CSV.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version). ``--mode paper`` uses its statistics, which are miscalibrated; the default
``calibrated`` mode and why are described in :mod:`fedparity.mechanisms.fairness_tests.fedevalfair`.
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path
from typing import Any, TextIO

from ...mechanisms.fairness_tests.fedevalfair import (
    ROUND1_FIELDS,
    ClientSummary,
    FairnessReport,
    client_contribution,
    fedevalfair,
)
from ._common import (
    UsageError,
    _emit,
    _finite,
    _input_file,
    _not_utf8,
    _unit_open,
)

FAIRTEST_COLUMNS = ("mean", "variance", "n")
#: Optional columns: a holder's margins (ClientSummary.margins), all three or none.
MARGIN_COLUMNS = ("group0_rows", "group1_rows", "predicted_positive_rows")


def _read_client_summaries(path: Path) -> dict[int, ClientSummary]:
    """One ClientSummary per CSV row, by the row's line number (columns mean, variance, n and,
    optionally, the margins group0_rows, group1_rows, predicted_positive_rows; others
    ignored)."""
    path = _input_file("--input", str(path))
    try:
        text = path.read_bytes().decode("utf-8-sig")  # tolerate a BOM
    except UnicodeDecodeError as error:
        line = error.object[: error.start].count(b"\n") + 1
        raise _not_utf8("--input", path, error, line) from None
    rows = list(csv.reader(io.StringIO(text, newline="")))
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
    summaries: dict[int, ClientSummary] = {}
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
            summaries[line] = ClientSummary(
                values["mean"],
                values["variance"],
                values["n"],  # type: ignore[arg-type]
                margins,  # type: ignore[arg-type]
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


#: The round-1 entry that is 1 when a summary's group counts were recovered from it.
_WITH_COUNTS = ROUND1_FIELDS.index("num_clients_with_counts")


def _no_pooled_line(report: FairnessReport, summaries: dict[int, ClientSummary]) -> str | None:
    """Why a calibrated report has no pooled disparity, in one line (None when it has one,
    and in mode paper, which uses no group counts)."""
    if report.mode != "calibrated" or report.pooled is not None:
        return None
    if all(summary.margins is None for summary in summaries.values()):
        return (
            "pooled disparity: not shown, the CSV has no group counts (the columns "
            + ", ".join(MARGIN_COLUMNS)
            + ")"
        )
    rows = [line for line, s in summaries.items() if client_contribution(s)[_WITH_COUNTS] != 1]
    if not rows:  # not reached with checked margins: every row gives its counts
        return "pooled disparity: not shown, the summed group counts give none"
    where = f"row {rows[0]}" + (f" and {len(rows) - 1} more" if len(rows) > 1 else "")
    return (
        f"pooled disparity: not shown, the mean of {where} is not x0 / group0_rows - x1 / "
        "group1_rows for whole counts x0 + x1 = predicted_positive_rows (write the plug-in "
        "disparity unrounded)"
    )


def _format_fairtest(report: FairnessReport, summaries: dict[int, ClientSummary]) -> str:
    h, c, level = report.homogeneity, report.common_disparity, 1.0 - report.alpha
    interval = report.confidence_interval(level)
    stage1 = "T1 (FedEvalFair Eq. 10)" if report.mode == "paper" else "Cochran's Q"
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
    # The report's own lines after those of its tests: the pooled disparity, after a stage-1
    # rejection the random-effects summary, and what the common disparity is.
    tests = 2 if report.equivalence is None else 3
    no_pooled = _no_pooled_line(report, summaries)
    lines.extend([no_pooled] if no_pooled else [])
    lines.extend(report.summary().splitlines()[tests:])
    if report.mode == "paper":
        lines.append(
            "(paper mode: weights n/S^2 with n = bootstrap resamples, |disparities|, T1 is not "
            "chi2(k-1): see fedparity.mechanisms.fairness_tests.fedevalfair; the default "
            "calibrated mode holds alpha)"
        )
    return "\n".join(lines)


def run_fairtest(args: argparse.Namespace, out: TextIO) -> int:
    """FedEvalFair's two stages (and TOST) from per-client summaries in a CSV (any mode)."""
    alpha = _unit_open("--alpha", _finite("--alpha", args.alpha))
    mu0 = _finite("--mu0", args.mu0)
    tolerance = None
    if args.tolerance is not None:
        tolerance = _finite("--tolerance", args.tolerance)
        if tolerance < 0:
            raise UsageError(f"--tolerance must be >= 0, got {tolerance:g}")
    summaries = _read_client_summaries(Path(args.input))
    report = fedevalfair(
        list(summaries.values()), alpha=alpha, mode=args.mode, mu0=mu0, tolerance=tolerance
    )
    payload: dict[str, Any] = {"input": str(args.input), **report.to_dict()}
    _emit(payload, _format_fairtest(report, summaries), args.json, out)
    return 0


# --- federations --------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity fairtest`` and its options."""
    fairtest = commands.add_parser(
        "fairtest",
        help="FedEvalFair two-stage fairness test from per-client summaries (CSV)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The FedEvalFair test from each client's disparity summary: stage 1, the same "
            "disparity\nat every client?; stage 2, is the common disparity mu0?; with "
            "--tolerance, an equivalence\ntest.\n\n"
            "examples:\n"
            "  fedparity fairtest --input summaries.csv\n"
            "      columns mean,variance,n per client (optionally the three margin columns)\n"
            "  fedparity fairtest --input summaries.csv --alpha 0.01 --tolerance 0.05 --json"
        ),
    )
    fairtest.add_argument(
        "--input", required=True, help="CSV, one row per client, header with mean,variance,n"
    )
    fairtest.add_argument(
        "--mode",
        choices=("calibrated", "paper"),
        default="calibrated",
        help=(
            "calibrated (default; holds alpha) or the FedEvalFair paper's statistics "
            "(miscalibrated: weights n/S^2 with n = resamples, |disparities|, T1 not chi2(k-1))"
        ),
    )
    fairtest.add_argument("--alpha", default="0.05", help="level of the decisions (0.05)")
    fairtest.add_argument("--mu0", default="0", help="stage 2 null value of the disparity (0)")
    fairtest.add_argument(
        "--tolerance", default=None, help="also certify |mu| < tolerance (TOST); >= 0"
    )
    fairtest.add_argument("--json", action="store_true", help="print one JSON object")
