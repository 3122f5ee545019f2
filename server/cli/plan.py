"""``fedparity plan``: minimum budget for an error target, or the error bound at a budget."""

from __future__ import annotations

import argparse
from typing import TextIO

from ...mechanisms.planner import error_bound, format_table1, minimum_epsilon, table1
from ._common import (
    UsageError,
    _emit,
    _finite,
    _int_at_least,
    _positive,
    _unit_open,
)


def run_plan(args: argparse.Namespace, out: TextIO) -> int:
    confidence = _unit_open("--confidence", _finite("--confidence", args.confidence))
    groups = _int_at_least("--groups", args.groups, 2)
    ratio = _positive("--group-ratio", _finite("--group-ratio", args.group_ratio))
    if args.table:
        paper = table1(paper_allocation=True, confidence=confidence)
        valid = table1(bound=args.bound, confidence=confidence)
        payload = {"paper_table1": paper, "valid_table1": valid, "bound": args.bound}
        text = (
            "Juarez and Korolova 2022, Table 1 (value scale, Chebyshev; its allocations are NOT "
            "eps-LDP):\n"
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


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity plan`` and its options."""
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
