"""``fedparity plan``: minimum budget for an error target, or the error bound at a budget."""

from __future__ import annotations

import argparse
from typing import TextIO

from ...mechanisms.planner import (
    MAX_GAP,
    MAX_GROUP_RATIO,
    MAX_PLANNED_CLIENTS,
    MAX_PLANNED_EPSILON,
    MIN_GROUP_RATIO,
    MIN_PLANNED_EPSILON,
    error_bound,
    format_table1,
    minimum_epsilon,
    table1,
)
from ._common import (
    UsageError,
    _emit,
    _finite,
    _in_range,
    _int_at_least,
    _positive,
    _unit_open,
)


def run_plan(args: argparse.Namespace, out: TextIO) -> int:
    confidence = _unit_open("--confidence", _finite("--confidence", args.confidence))
    groups = _int_at_least("--groups", args.groups, 2)
    ratio = _in_range(
        "--group-ratio",
        _finite("--group-ratio", args.group_ratio),
        MIN_GROUP_RATIO,
        MAX_GROUP_RATIO,
    )
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
    if clients > MAX_PLANNED_CLIENTS:
        raise UsageError(
            f"--clients must be an integer in [{groups}, {MAX_PLANNED_CLIENTS:.0e}], got "
            f"{args.clients}"
        )
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
        largest = MAX_GAP[args.scale]
        alpha = _positive("--alpha", _finite("--alpha", args.alpha))
        if alpha >= largest:
            raise UsageError(
                f"--alpha must be below {largest:g}, the largest possible gap on the "
                f"{args.scale} scale (any estimate meets a larger target), got {alpha:g}"
            )
        plans = [minimum_epsilon(name, clients, alpha, **common) for name in candidates]
        reachable = [p for p in plans if p.epsilon is not None]
        chosen = min(reachable, key=lambda p: p.epsilon) if reachable else plans[0]
        query = "min_epsilon"
    else:
        epsilon = _in_range(
            "--epsilon",
            _finite("--epsilon", args.epsilon),
            MIN_PLANNED_EPSILON,
            MAX_PLANNED_EPSILON,
        )
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
                lines.append(head + f"none (no budget up to {MAX_PLANNED_EPSILON:g} reaches it)")
                continue
            if plan.at_search_limit:
                head += (
                    f"at most {plan.epsilon:g} (the search's lower limit: even that budget "
                    "reaches the target)"
                )
            else:
                head += f"{plan.epsilon:.4g}"
        else:
            head = f"M_{plan.mechanism}: error bound at epsilon {plan.epsilon:g}: {plan.alpha:.4g}"
            if plan.vacuous:
                head += (
                    f" (vacuous: not below {MAX_GAP[plan.scale]:g}, the largest possible gap on "
                    f"the {plan.scale} scale)"
                )
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
    plan = commands.add_parser(
        "plan",
        help="budget for an error target, or error at a budget",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Plan an LDP audit of the gap between group means.\n\n"
            "examples:\n"
            "  fedparity plan --clients 100000 --alpha 0.05\n"
            "      the smallest epsilon per user for an error below 0.05 (probability 0.99)\n"
            "  fedparity plan --clients 100000 --epsilon 1\n"
            "      the error bound at epsilon 1\n"
            "  fedparity plan --table\n"
            "      Table 1 of Juarez and Korolova 2022, and the valid mechanisms' version"
        ),
    )
    plan.add_argument(
        "--mechanism",
        choices=("R", "L", "best"),
        default="best",
        help=(
            "R: randomized response for group and value (M_R); L: randomized response for the "
            "group and discrete Laplace for the value (M_L); best: whichever needs less "
            "(default)"
        ),
    )
    plan.add_argument(
        "--clients",
        help=f"number of clients K, at least the groups and at most {MAX_PLANNED_CLIENTS:.0e}",
    )
    plan.add_argument(
        "--alpha",
        help="error target: find the minimum epsilon (below 1 on the metric scale, e.g. 0.05)",
    )
    plan.add_argument(
        "--epsilon",
        help=(
            f"budget per user: find the error bound (in [{MIN_PLANNED_EPSILON:g}, "
            f"{MAX_PLANNED_EPSILON:g}], e.g. 1)"
        ),
    )
    plan.add_argument(
        "--confidence", default="0.99", help="probability that the bound holds (default 0.99)"
    )
    plan.add_argument(
        "--group-ratio",
        default="1",
        help=(
            f"n_A / n_B, the first group's size over each other group's, in "
            f"[{MIN_GROUP_RATIO:g}, {MAX_GROUP_RATIO:g}] (default 1: balanced; e.g. 0.25)"
        ),
    )
    plan.add_argument("--groups", default="2", help="number of groups d (default 2)")
    plan.add_argument(
        "--bound",
        choices=("chebyshev", "normal"),
        default="chebyshev",
        help="chebyshev: holds for any K (default); normal: the large-K approximation",
    )
    plan.add_argument(
        "--scale",
        choices=("metric", "value"),
        default="metric",
        help="errors on the metric's scale [0, 1] (default) or the report value's [-1, 1]",
    )
    plan.add_argument("--table", action="store_true", help="print Table 1 (paper vs valid)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
