"""The ``fedparity`` command: the parser and the dispatch to one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from . import fairtest, federations, identity, keys, ledger, measure, plan, privacy, run
from ._common import EXIT_USAGE, UsageError, _Parser

__all__ = ["COMMANDS", "build_parser", "main"]

_DESCRIPTION = "The fedparity command line: the LDP math for auditors and planners."

#: One module per subcommand, as in Flower's own CLI.
_MODULES = {
    "privacy": privacy,
    "plan": plan,
    "measure": measure,
    "fairtest": fairtest,
    "keys": keys,
    "identity": identity,
    "federations": federations,
    "ledger": ledger,
    "run": run,
}
COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "privacy": privacy.run_privacy,
    "plan": plan.run_plan,
    "measure": measure.run_measure,
    "fairtest": fairtest.run_fairtest,
    "federations": federations.run_federations,
    "keys": keys.run_keys,
    "identity": identity.run_identity,
    "ledger": ledger.run_ledger,
    "run": run.run_run,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedparity", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in _MODULES.values():
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 bad input)."""
    out = sys.stdout if out is None else out
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and not {"-h", "--help"} & set(argv[1:2]):
        # everything after "run" is flwr run's (options first included): no parsing here
        return run.run_with_status(argv[1:], out, sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args, out)
    except (UsageError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        sys.stderr.write(f"fedparity {args.command}: error: {message}\n")
        return EXIT_USAGE
