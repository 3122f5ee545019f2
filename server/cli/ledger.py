"""``fedparity ledger show``: every release of a privacy ledger and the running total;
``fedparity ledger reset``: the operator's acknowledgement that a lost or damaged ledger's users
start again at zero."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._common import UsageError, _emit, _integer

if TYPE_CHECKING:
    from ...mechanisms.privacy.user_ledger import Composition, Release


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


def run_reset(args: argparse.Namespace, out: TextIO) -> int:
    """Accept that the ledger ``PATH`` is lost (or damaged) and its users start again at zero:
    a damaged file is kept aside as ``<name>.damaged-<time>``, its ``.created`` marker is
    removed, and the registry (``--registry``, default the nodes' own default) records the
    reset and forgets the ledger. An intact ledger is only forgotten by the registry (its file
    kept): the way to accept that a node whose ledger-dir changed starts elsewhere."""
    from datetime import UTC, datetime

    from ...mechanisms.privacy.basic_ledger import LedgerFileError, ledger_marker
    from ...mechanisms.privacy.user_ledger import (
        DEFAULT_LEDGER_REGISTRY,
        LedgerRegistry,
        UserLedger,
    )

    path = Path(LedgerRegistry.key(args.path))
    if path.is_dir():
        raise UsageError(f"PATH: {path} is a folder; give the ledger file in it")
    registry = LedgerRegistry(args.registry or DEFAULT_LEDGER_REGISTRY)
    try:
        entry = registry.entry(path)
    except LedgerFileError as error:
        raise UsageError(f"--registry: {error}") from None
    marker = ledger_marker(path)
    done = []
    if path.exists():
        try:
            UserLedger.load(path)
        except LedgerFileError:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            kept = path.with_name(f"{path.name}.damaged-{stamp}")
            path.rename(kept)
            done.append(f"kept the damaged file as {kept}")
        else:
            if entry is None:
                raise UsageError(
                    f"PATH: {path} is an intact ledger that the registry {registry.path} does "
                    "not hold: nothing to reset (a node uses it as it is)"
                )
            done.append(f"kept the intact file {path} (no node of this registry uses it now)")
    elif entry is None and not marker.exists():
        raise UsageError(
            f"PATH: no ledger, .created marker or entry in the registry {registry.path} at {path}"
        )
    if marker.exists() and not path.exists():
        marker.unlink()
        done.append(f"removed the marker {marker}")
    registry.forget(path, args.reason)
    created = f" (created {entry.get('created')})" if entry else ""
    done.append(f"recorded the reset in {registry.path}")
    lines = [
        f"ledger {path}{created} reset: its users start again at zero at the next release; "
        + "; ".join(done)
    ]
    payload = {"path": str(path), "registry": str(registry.path), "actions": done}
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


def run_ledger(args: argparse.Namespace, out: TextIO) -> int:
    """List a ledger's releases (job, mechanism, parameters, time, users) and one user's
    running total (PLD epsilon at the ledger's delta, basic composition beside it); or, with
    ``reset``, :func:`run_reset`."""
    from ...mechanisms.privacy.basic_ledger import LedgerFileError
    from ...mechanisms.privacy.user_ledger import UserLedger

    if args.action == "reset":
        return run_reset(args, out)
    path = Path(args.path).expanduser()
    if path.is_dir():
        raise UsageError(f"PATH: {path} is a folder; give the ledger file in it")
    if not path.is_file():
        raise UsageError(f"PATH: no ledger file at {path}")
    try:
        ledger = UserLedger.load(path)
    except LedgerFileError as error:
        raise UsageError(f"PATH: {str(error).splitlines()[0]}") from None
    if args.user is None:
        user = ledger.most_spent_user()
    else:
        user = _integer("--user", args.user, 0)
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
            "  fedparity ledger show privacy-ledger.json --user 17 --json\n"
            "  fedparity ledger reset ~/.fedparity/ledgers/user-ledger.json\n"
            "      accept that a lost or damaged ledger's users start again at zero (a node\n"
            "      refuses every release until its ledger is restored or this is run)"
        ),
    )
    parser.add_argument(
        "action",
        choices=("show", "reset"),
        help="show: list the releases and totals; reset: accept that a lost or damaged "
        "ledger's users start again at zero",
    )
    parser.add_argument("path", metavar="PATH", help="the ledger file (JSON)")
    parser.add_argument(
        "--user", default=None, help="user index whose total to show (default: the most spent)"
    )
    parser.add_argument(
        "--registry",
        default=None,
        help="reset: the node's ledger registry (its node config ledger-registry; default "
        "~/.fedparity/ledger-registry.json)",
    )
    parser.add_argument(
        "--reason", default="reset by its operator", help="reset: why, kept in the registry"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
