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
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from . import fairtest, federations, keys, measure, plan, privacy
from ._common import EXIT_USAGE, UsageError, _Parser

__all__ = ["COMMANDS", "build_parser", "main"]

#: One module per subcommand, as in Flower's own CLI.
_MODULES = {
    "privacy": privacy,
    "plan": plan,
    "measure": measure,
    "fairtest": fairtest,
    "keys": keys,
    "federations": federations,
}
COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "privacy": privacy.run_privacy,
    "plan": plan.run_plan,
    "measure": measure.run_measure,
    "fairtest": fairtest.run_fairtest,
    "federations": federations.run_federations,
    "keys": keys.run_keys,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedparity", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in _MODULES.values():
        module.add_parser(commands)
    return parser


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
