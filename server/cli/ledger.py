"""``fedparity ledger show``: every release of a privacy ledger and the running total."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._common import UsageError, _emit, _int_at_least

if TYPE_CHECKING:
    from ...mechanisms.privacy_ledger import Composition, Release


def _parameters(release: Release) -> str:
    return " ".join(
        f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in release.parameters().items()
    )


def _total_text(total: Composition) -> str:
    return (
        f"epsilon={total.epsilon:.4g} at delta={total.delta:.3g} (basic composition: "
        f"epsilon={total.basic_epsilon:.4g}, delta={total.basic_delta:.3g})"
    )


def _total_json(total: Composition) -> dict[str, Any]:
    return asdict(total)


def run_ledger(args: argparse.Namespace, out: TextIO) -> int:
    """List a ledger's releases (job, mechanism, parameters, time, users) and one user's
    running total (PLD epsilon at the ledger's delta, basic composition beside it)."""
    from ...mechanisms.accounting import LedgerFileError
    from ...mechanisms.privacy_ledger import UserLedger

    path = Path(args.path).expanduser()
    if not path.is_file():
        raise UsageError(f"PATH: no ledger file at {path}")
    try:
        ledger = UserLedger.load(path)
    except LedgerFileError as error:
        raise UsageError(f"PATH: {str(error).splitlines()[0]}") from None
    if args.user is None:
        user = ledger.most_spent_user()
    else:
        user = _int_at_least("--user", args.user, 0)
        if user >= ledger.num_users:
            raise UsageError(
                f"--user must be a user index in [0, {ledger.num_users - 1}], got {user}"
            )
    taken = ledger.releases_of(user)
    running = dict(zip(taken, ledger.running_totals(user), strict=True))
    total = ledger.total(user)
    summary = ledger.summary()
    releases = []
    lines = [
        f"privacy ledger {path}: {ledger.num_users} user(s), budget epsilon={ledger.budget:g} "
        f"at delta={ledger.delta:.3g} each; totals hold for {summary['neighbouring']}",
        f"{len(ledger.releases)} release(s); running total of user {user}"
        + (" (the most spent)" if args.user is None else "")
        + ":",
    ]
    for index, release in enumerate(ledger.releases):
        count = int(ledger.participants(index).sum())
        after = running.get(index)
        releases.append(
            {
                "index": index,
                "time": release.time,
                "job": release.job,
                "label": release.label,
                "mechanism": release.kind,
                "parameters": release.parameters(),
                "epsilon": release.basic_epsilon,
                "delta": release.basic_delta,
                "participants": count,
                "user_total": None if after is None else _total_json(after),
            }
        )
        label = f" ({release.label})" if release.label else ""
        lines.append(
            f"  #{index} {release.time} job {release.job}{label}: {release.kind} "
            f"{_parameters(release)} (alone: epsilon={release.basic_epsilon:.4g}, "
            f"delta={release.basic_delta:.3g})"
        )
        lines.append(
            f"      {count} of {ledger.num_users} user(s); user {user}: "
            + ("not in it" if after is None else _total_text(after))
        )
    lines.append(f"total of user {user}: {_total_text(total)}")
    lines.append(
        f"all users: largest epsilon {summary['max_epsilon']:.4g}, smallest "
        f"{summary['min_epsilon']:.4g} (budget {ledger.budget:g})"
    )
    payload = {
        "path": str(path),
        "user": user,
        "releases": releases,
        "total": _total_json(total),
        "summary": summary,
    }
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity ledger`` and its options."""
    parser = commands.add_parser(
        "ledger",
        help="show a privacy ledger: every release and each user's total",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Show a per-user privacy ledger: every release (job, mechanism, parameters, time,\n"
            "users in it) and one user's running total, composed by the privacy loss\n"
            "distribution accountant of dp-accounting at the ledger's delta, with basic\n"
            "composition (the sums of the releases' epsilons and deltas) beside it. Totals\n"
            "hold when one user's data is replaced by any other.\n\n"
            "examples:\n"
            "  fedparity ledger show ~/.fedparity/ledgers/privacy-ledger.json\n"
            "      every release, and the running total of the user who spent the most\n"
            "  fedparity ledger show privacy-ledger.json --user 17 --json"
        ),
    )
    parser.add_argument("action", choices=("show",), help="show: list the releases and totals")
    parser.add_argument("path", metavar="PATH", help="the ledger file (JSON)")
    parser.add_argument(
        "--user", default=None, help="user index whose total to show (default: the most spent)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
