"""``fedparity plan``: minimum budget for an error target, or the error bound at a budget; and
power and sample size, for the LDP audit or FedEvalFair's stage 2
(:mod:`fedparity.mechanisms.ldp.power`)."""

from __future__ import annotations

import argparse
from typing import TextIO, TypedDict, cast

from ...mechanisms.ldp.calibration import MECHANISMS, MechanismChoice
from ...mechanisms.ldp.planner import (
    MAX_GAP,
    MAX_GROUP_RATIO,
    MAX_PLANNED_CLIENTS,
    MAX_PLANNED_EPSILON,
    MIN_GROUP_RATIO,
    MIN_PLANNED_EPSILON,
    BoundName,
    Scale,
    error_bound,
    format_table1,
    group_fractions_from_ratio,
    minimum_epsilon,
    table1,
)
from ...mechanisms.ldp.power import (
    MAX_PLANNED_HOLDERS,
    MAX_PLANNED_ROWS,
    AuditPlan,
    FedEvalFairPlan,
    audit_detectable_gap,
    audit_minimum_epsilon,
    audit_minimum_users,
    audit_power,
    fedevalfair_detectable_disparity,
    fedevalfair_minimum_holders,
    fedevalfair_minimum_rows,
    fedevalfair_power,
)
from ._common import (
    UsageError,
    _emit,
    _epsilon,
    _finite,
    _groups,
    _in_range,
    _integer,
    _positive,
    _unit_open,
)

#: Options that only a power plan takes: any of them selects one.
_POWER_OPTIONS = (
    "power",
    "gap",
    "holders",
    "rows",
    "significance",
    "metric_mean",
    "metric_variance",
    "positive_rate",
    "mu0",
)


class _PlanOptions(TypedDict):
    """The keyword arguments of :func:`minimum_epsilon` and :func:`error_bound` a plan shares."""

    confidence: float
    group_ratio: float
    num_groups: int
    bound: BoundName
    scale: Scale


class _AuditOptions(TypedDict):
    """The keyword arguments every audit power query shares."""

    mechanism: MechanismChoice
    group_fractions: list[float]
    alpha: float
    metric_mean: float | None
    metric_variance: float | None
    sizes_known: bool


class _HolderOptions(TypedDict):
    """The keyword arguments every FedEvalFair power query shares."""

    positive_rate: float
    group_fractions: list[float]
    alpha: float
    mu0: float


def _run_rate_comparison(args: argparse.Namespace, out: TextIO) -> int:
    """``--cell-counts``: the joint report against the gap audit for each rate metric (or
    ``--rate-metric``), at ``--epsilon``, in that scenario."""
    from ...mechanisms.ldp.group_rates import CELLS, RATE_METRICS
    from ...mechanisms.ldp.rate_design import compare_rate_designs

    if args.epsilon is None:
        raise UsageError("--cell-counts needs --epsilon (the budget per user of either design)")
    epsilon = _epsilon("--epsilon", args.epsilon)
    groups = _groups(_or(args.groups, "2"))
    confidence = _unit_open("--confidence", _finite("--confidence", _or(args.confidence, "0.95")))
    parts = [part for part in args.cell_counts.split(",") if part.strip()]
    if len(parts) != groups * len(CELLS):
        raise UsageError(
            f"--cell-counts must be {groups * len(CELLS)} comma-separated counts (--groups "
            f"{groups} x cells {', '.join(CELLS)}, group by group), got {len(parts)}"
        )
    counts = [_finite("--cell-counts", part) for part in parts]
    if any(count < 0 for count in counts):
        raise UsageError("--cell-counts must be counts >= 0")
    metrics = list(RATE_METRICS) if args.rate_metric is None else [args.rate_metric]
    results = []
    for metric in metrics:
        try:
            results.append(
                compare_rate_designs(
                    metric, epsilon, counts, num_groups=groups, confidence=confidence
                )
            )
        except ValueError as error:  # e.g. a group without the metric's denominator
            raise UsageError(f"--cell-counts: {error}") from None
    payload = {
        "epsilon": epsilon,
        "confidence": confidence,
        "comparisons": [
            {
                "metric": r.metric,
                "difference": r.difference,
                "joint_oracle": r.joint_oracle,
                "joint_stderr": r.joint_stderr,
                "gap_audit_mechanism": r.gap_audit_mechanism,
                "gap_audit_stderr": r.gap_audit_stderr,
                "tighter": r.tighter,
            }
            for r in results
        ],
    }
    _emit(payload, "\n".join(r.summary() for r in results), args.json, out)
    return 0


def run_plan(args: argparse.Namespace, out: TextIO) -> int:
    if args.cell_counts is not None:
        return _run_rate_comparison(args, out)
    if (
        args.fedevalfair
        or args.known_sizes
        or any(getattr(args, name) is not None for name in _POWER_OPTIONS)
    ):
        return _run_power(args, out)
    confidence = _unit_open("--confidence", _finite("--confidence", _or(args.confidence, "0.99")))
    groups = _groups(_or(args.groups, "2"))
    # argparse's choices restrict these three options to their Literal values
    bound = cast(BoundName, _or(args.bound, "chebyshev"))
    scale = cast(Scale, _or(args.scale, "metric"))
    mechanism = cast(MechanismChoice, _or(args.mechanism, "best"))
    ratio = _in_range(
        "--group-ratio",
        _finite("--group-ratio", args.group_ratio),
        MIN_GROUP_RATIO,
        MAX_GROUP_RATIO,
    )
    if args.table:
        paper = table1(paper_allocation=True, confidence=confidence)
        valid = table1(bound=bound, confidence=confidence)
        payload: dict[str, object] = {"paper_table1": paper, "valid_table1": valid, "bound": bound}
        text = (
            "Juarez and Korolova 2022, Table 1 (value scale, Chebyshev; its allocations are NOT "
            "eps-LDP):\n"
            f"{format_table1(paper)}\n\n"
            f"Valid mechanisms (true eps <= budget; {bound} bound, value scale):\n"
            f"{format_table1(valid)}"
        )
        _emit(payload, text, args.json, out)
        return 0
    if args.clients is None:
        raise UsageError("--clients is required (or use --table)")
    clients = _integer("--clients", args.clients, groups)
    if clients > MAX_PLANNED_CLIENTS:
        raise UsageError(
            f"--clients must be an integer in [{groups}, {MAX_PLANNED_CLIENTS:.0e}], got "
            f"{args.clients}"
        )
    if (args.alpha is None) == (args.epsilon is None):
        raise UsageError("give exactly one of --alpha (find the budget) or --epsilon (the error)")
    candidates: tuple[MechanismChoice, ...] = MECHANISMS if mechanism == "best" else (mechanism,)
    common = _PlanOptions(
        confidence=confidence,
        group_ratio=ratio,
        num_groups=groups,
        bound=bound,
        scale=scale,
    )
    if args.alpha is not None:
        largest = MAX_GAP[scale]
        alpha = _positive("--alpha", _finite("--alpha", args.alpha))
        if alpha >= largest:
            raise UsageError(
                f"--alpha must be below {largest:g}, the largest possible gap on the "
                f"{scale} scale (any estimate meets a larger target), got {alpha:g}"
            )
        plans = [minimum_epsilon(name, clients, alpha, **common) for name in candidates]
        reachable = [(p.epsilon, p) for p in plans if p.epsilon is not None]
        chosen = min(reachable, key=lambda pair: pair[0])[1] if reachable else plans[0]
        query = "min_epsilon"
    else:
        epsilon = _epsilon("--epsilon", args.epsilon)
        plans = [error_bound(name, clients, epsilon, **common) for name in candidates]
        chosen = min(plans, key=lambda p: p.alpha)
        query = "error_bound"
    payload = {
        "query": query,
        **chosen.to_dict(),
        "candidates": [p.to_dict() for p in plans],
    }
    lines = [
        f"K={clients:,} clients, d={groups}, group ratio {ratio:g}, confidence {confidence:g}, "
        f"{bound} bound, errors on the {scale} scale"
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
            f"true eps={split.epsilon:.4g}"
            + (f", G={split.grid_size})" if split.mechanism == "N" else ")")
        )
    if len(plans) > 1:
        lines.append(f"best: M_{chosen.mechanism}")
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


def _or(value: str | None, default: str) -> str:
    """An option's value, or its default when it was not given."""
    return default if value is None else value


# --- power and sample size ---------------------------------------------------------------

#: The API's parameter names in the CLI's words (the first word of a ValueError message).
_OPTION_NAMES = {
    "num_users": "--clients",
    "epsilon": "--epsilon",
    "gap": "--gap",
    "disparity": "--gap",
    "power": "--power",
    "alpha": "--significance",
    "metric_mean": "--metric-mean",
    "metric_variance": "--metric-variance",
    "positive_rate": "--positive-rate",
    "mu0": "--mu0",
    "holders": "--holders",
    "rows": "--rows",
}


def _usage_from(error: ValueError) -> UsageError:
    """The planner's message with its parameter named as the option (``gap`` -> ``--gap``)."""
    message = str(error)
    name, _, rest = message.partition(" ")
    option = _OPTION_NAMES.get(name.split("[")[0])
    return UsageError(f"{option} {rest}" if option else message)


def _refuse(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """A usage error if any option of ``names`` (attribute names) was given."""
    for name in names:
        if getattr(args, name) not in (None, False):
            raise UsageError(f"--{name.replace('_', '-')} {why}")


def _rows(text: str) -> int | list[int]:
    """--rows: one count (rows per holder) or a comma-separated count per holder."""
    parts = text.split(",")
    counts = [_integer("--rows", part.strip(), 1) for part in parts]
    for count in counts:
        if count > MAX_PLANNED_ROWS:
            raise UsageError(
                f"--rows must be at most {MAX_PLANNED_ROWS:.0e} per holder, got {count}"
            )
    return counts if len(parts) > 1 else counts[0]


def _power_target(args: argparse.Namespace, significance: float) -> float | None:
    if args.power is None:
        return None
    power = _finite("--power", args.power)
    if not significance < power < 1.0:
        raise UsageError(
            f"--power must be in ({significance:g}, 1) (above the test's level --significance, "
            f"which any plan reaches, and below 1), got {power:g}"
        )
    return power


def _missing(given: dict[str, object], names: str) -> str:
    """The one option of ``given`` left out (to plan), or a usage error."""
    missing = [name for name, value in given.items() if value is None]
    if len(missing) != 1:
        raise UsageError(
            f"give three of {names}: the fourth is planned (missing: {', '.join(missing)})"
            if missing
            else f"give three of {names}, not all four: the fourth is planned"
        )
    return missing[0]


def _run_power(args: argparse.Namespace, out: TextIO) -> int:
    _refuse(
        args,
        ("alpha", "confidence", "bound", "scale", "table"),
        "is for error bounds and Table 1; a power plan takes --power, --gap and --significance",
    )
    significance = _unit_open(
        "--significance", _finite("--significance", _or(args.significance, "0.05"))
    )
    ratio = _in_range(
        "--group-ratio",
        _finite("--group-ratio", args.group_ratio),
        MIN_GROUP_RATIO,
        MAX_GROUP_RATIO,
    )
    target = _power_target(args, significance)
    if args.fedevalfair:
        return _run_fedevalfair_power(args, out, significance, ratio, target)
    _refuse(args, ("holders", "rows", "positive_rate", "mu0"), "needs --fedevalfair")
    groups = _groups(_or(args.groups, "2"))
    clients = None
    if args.clients is not None:
        clients = _integer("--clients", args.clients, groups)
        if clients > MAX_PLANNED_CLIENTS:
            raise UsageError(
                f"--clients must be an integer in [{groups}, {MAX_PLANNED_CLIENTS:.0e}], got "
                f"{args.clients}"
            )
    epsilon = None
    if args.epsilon is not None:
        epsilon = _epsilon("--epsilon", args.epsilon)
    gap = None
    if args.gap is not None:
        gap = _finite("--gap", args.gap)
        if not 0.0 < gap <= 1.0:
            raise UsageError(f"--gap must be in (0, 1] (metric units), got {gap:g}")
    query = _missing(
        {"--clients": clients, "--epsilon": epsilon, "--gap": gap, "--power": target},
        "--clients, --epsilon, --gap and --power",
    )
    options = _AuditOptions(
        mechanism=cast(MechanismChoice, _or(args.mechanism, "best")),  # argparse's choices
        group_fractions=group_fractions_from_ratio(ratio, groups).tolist(),
        alpha=significance,
        metric_mean=None
        if args.metric_mean is None
        else _finite("--metric-mean", args.metric_mean),
        metric_variance=(
            None
            if args.metric_variance is None
            else _finite("--metric-variance", args.metric_variance)
        ),
        sizes_known=bool(args.known_sizes),
    )
    try:
        # _missing: only the queried option is None
        if query == "--power":
            assert clients is not None and epsilon is not None and gap is not None
            plan = audit_power(clients, epsilon, gap, **options)
        elif query == "--clients":
            assert target is not None and epsilon is not None and gap is not None
            plan = audit_minimum_users(target, epsilon, gap, **options)
        elif query == "--epsilon":
            assert target is not None and clients is not None and gap is not None
            plan = audit_minimum_epsilon(target, clients, gap, **options)
        else:
            assert target is not None and clients is not None and epsilon is not None
            plan = audit_detectable_gap(target, clients, epsilon, **options)
    except ValueError as error:
        raise _usage_from(error) from None
    payload = {"plan": "ldp_audit", **plan.to_dict()}
    _emit(payload, _audit_text(plan), args.json, out)
    return 0


def _audit_text(plan: AuditPlan) -> str:
    """The answer first, then the setting and any notes."""
    at_users = "" if plan.num_users is None else f" with {plan.num_users:,} users"
    at_epsilon = "" if plan.epsilon is None else f" at epsilon {plan.epsilon:g}"
    target = f"power {plan.target_power or 0:g}"  # (unused by a power query)
    if plan.query == "power":
        answer = f"power to detect a gap of {plan.gap:g}{at_epsilon}{at_users}: {plan.power:.4f}"
    elif plan.query == "min_users":
        head = f"minimum users to detect a gap of {plan.gap:g} with {target}{at_epsilon}: "
        answer = head + (
            f"none up to {MAX_PLANNED_CLIENTS:.0e} (power there {plan.power:.4f})"
            if plan.num_users is None
            else f"{plan.num_users:,} (power {plan.power:.4f})"
        )
    elif plan.query == "min_epsilon":
        head = f"minimum epsilon to detect a gap of {plan.gap:g} with {target}{at_users}: "
        answer = head + (
            f"none up to {MAX_PLANNED_EPSILON:g} (power there {plan.power:.4f})"
            if plan.epsilon is None
            else f"{plan.epsilon:.4g} (power {plan.power:.4f})"
        )
    else:
        head = f"smallest gap detected with {target}{at_epsilon}{at_users}: "
        answer = head + (
            f"none up to a gap of 1 (power there {plan.power:.4f})"
            if plan.gap is None
            else f"{plan.gap:.4g} (metric units; power {plan.power:.4f})"
        )
    fractions = "/".join(f"{f:.3g}" for f in plan.group_fractions)
    means = " and ".join(f"{m:.4g}" for m in plan.group_means)
    values = (
        f"worst case over the metric's values (group means {means})"
        if plan.worst_case
        else f"group means {means}"
    )
    lines = [
        answer,
        f"setting: M_{plan.mechanism} (eps1={plan.epsilon_group:.4g}, "
        f"eps2={plan.epsilon_value:.4g}), group fractions {fractions}, two-sided test of "
        f"gap = 0 at level {plan.alpha:g} (the audit's {1 - plan.alpha:g} interval excludes 0), "
        f"group sizes {'known' if plan.sizes_known else 'estimated from the reports'}, {values}; "
        f"standard error {plan.test_stderr:.4g}",
    ]
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)


def _run_fedevalfair_power(
    args: argparse.Namespace,
    out: TextIO,
    significance: float,
    ratio: float,
    target: float | None,
) -> int:
    _refuse(
        args,
        (
            "clients",
            "epsilon",
            "mechanism",
            "groups",
            "metric_mean",
            "metric_variance",
            "known_sizes",
        ),
        "is for the LDP audit, not --fedevalfair (holders test their own rows, without noise)",
    )
    rows = None if args.rows is None else _rows(args.rows)
    holders = None
    if args.holders is not None:
        holders = _integer("--holders", args.holders, 2)
        if holders > MAX_PLANNED_HOLDERS:
            raise UsageError(
                f"--holders must be an integer in [2, {MAX_PLANNED_HOLDERS:.0e}], got {holders}"
            )
    if isinstance(rows, list):
        if holders is not None and holders != len(rows):
            raise UsageError(
                f"--holders ({holders}) must equal the number of counts in --rows ({len(rows)})"
            )
        holders = len(rows)
    gap = None if args.gap is None else _finite("--gap", args.gap)
    query = _missing(
        {"--holders": holders, "--rows": rows, "--gap": gap, "--power": target},
        "--holders, --rows, --gap and --power (a list in --rows gives the holders)",
    )
    options = _HolderOptions(
        positive_rate=_finite("--positive-rate", _or(args.positive_rate, "0.5")),
        group_fractions=group_fractions_from_ratio(ratio, 2).tolist(),
        alpha=significance,
        mu0=_finite("--mu0", _or(args.mu0, "0")),
    )
    try:
        # _missing: only the queried option is None; a list in --rows gives the holders
        if query == "--power":
            assert gap is not None and rows is not None
            plan = fedevalfair_power(gap, holders=holders, rows=rows, **options)
        elif query == "--holders":
            assert target is not None and gap is not None and isinstance(rows, int)
            plan = fedevalfair_minimum_holders(target, gap, rows=rows, **options)
        elif query == "--rows":
            assert target is not None and gap is not None and holders is not None
            plan = fedevalfair_minimum_rows(target, gap, holders=holders, **options)
        else:
            assert target is not None and rows is not None
            plan = fedevalfair_detectable_disparity(target, holders=holders, rows=rows, **options)
    except ValueError as error:
        raise _usage_from(error) from None
    payload = {"plan": "fedevalfair", **plan.to_dict()}
    _emit(payload, _fedevalfair_text(plan), args.json, out)
    return 0


def _fedevalfair_text(plan: FedEvalFairPlan) -> str:
    """The answer first, then the setting and any notes."""
    if isinstance(plan.rows, tuple):
        holders = f"{len(plan.rows)} holders of {', '.join(f'{r:,}' for r in plan.rows)} rows"
    elif plan.rows is not None and plan.holders is not None:
        holders = f"{plan.holders:,} holders of {plan.rows:,} rows"
    elif plan.rows is not None:
        holders = f"holders of {plan.rows:,} rows"
    else:
        holders = f"{plan.holders:,} holders"
    target = f"power {plan.target_power or 0:g}"  # (unused by a power query)
    if plan.query == "power":
        answer = (
            f"FedEvalFair stage 2 power at a common disparity of {plan.disparity:g} with "
            f"{holders}: {plan.power:.4f}"
        )
    elif plan.query == "min_holders":
        head = (
            f"minimum holders of {plan.rows:,} rows to detect a disparity of "
            f"{plan.disparity:g} with {target}: "
        )
        answer = head + (
            f"none up to {MAX_PLANNED_HOLDERS:.0e} (power there {plan.power:.4f})"
            if plan.holders is None
            else f"{plan.holders:,} (power {plan.power:.4f})"
        )
    elif plan.query == "min_rows":
        head = (
            f"minimum rows per holder for {plan.holders:,} holders to detect a disparity of "
            f"{plan.disparity:g} with {target}: "
        )
        answer = head + (
            f"none up to {MAX_PLANNED_ROWS:.0e} (power there {plan.power:.4f})"
            if plan.rows is None
            else f"{plan.rows:,} (power {plan.power:.4f})"
        )
    else:
        head = f"smallest common disparity detected with {target} by {holders}: "
        answer = head + (
            f"none within the rates' range (power at its edge {plan.power:.4f})"
            if plan.disparity is None
            else f"{abs(plan.disparity - plan.mu0):.4g} away from {plan.mu0:g}, either group "
            f"ahead (power {plan.power:.4f})"
        )
    fractions = "/".join(f"{f:.3g}" for f in plan.group_fractions)
    lines = [
        answer,
        f"setting: stage 2 (calibrated mode), H0 common disparity = {plan.mu0:g} at level "
        f"{plan.alpha:g}, positive rate {plan.positive_rate:g}, group fractions {fractions}; "
        f"standard error {plan.test_stderr:.4g} under H0",
    ]
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)


# --- the parser ---------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity plan`` and its options."""
    plan = commands.add_parser(
        "plan",
        help="budget for an error target, error at a budget, power and sample size",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Plan an LDP audit of the gap between group means (an error bound, or the power "
            "of its test of gap = 0), or FedEvalFair's stage 2 (--fedevalfair). A power plan "
            "takes three of --clients, --epsilon, --gap and --power (FedEvalFair: --holders, "
            "--rows, --gap and --power) and plans the fourth.\n\n"
            "examples:\n"
            "  fedparity plan --clients 100000 --alpha 0.05\n"
            "      the smallest epsilon per user for an error below 0.05 (probability 0.99)\n"
            "  fedparity plan --clients 100000 --epsilon 1\n"
            "      the error bound at epsilon 1\n"
            "  fedparity plan --table\n"
            "      Table 1 of Juarez and Korolova 2022, and the valid mechanisms' version\n"
            "  fedparity plan --power 0.8 --gap 0.05 --epsilon 1\n"
            "      the fewest users whose audit detects a gap of 0.05 with power 0.8\n"
            "  fedparity plan --clients 100000 --gap 0.05 --epsilon 1\n"
            "      the power of an audit of 100,000 users at epsilon 1 to detect a gap of 0.05\n"
            "  fedparity plan --clients 100000 --gap 0.05 --power 0.8\n"
            "      the smallest epsilon per user for that power\n"
            "  fedparity plan --clients 100000 --epsilon 1 --power 0.8\n"
            "      the smallest gap the audit detects with power 0.8\n"
            "  fedparity plan --fedevalfair --holders 10 --rows 1000 --gap 0.05\n"
            "      the power of FedEvalFair's stage 2 at a common disparity of 0.05\n"
            "  fedparity plan --fedevalfair --power 0.8 --gap 0.05 --rows 1000\n"
            "      the fewest holders of 1000 rows for that power\n"
            "  fedparity plan --epsilon 1 --cell-counts 7500,2500,2500,12500,5000,2500,5000,12500\n"
            "      one joint report per user or the gap audit: which is tighter for each rate"
        ),
    )
    plan.add_argument(
        "--mechanism",
        choices=(*MECHANISMS, "best"),
        help=(
            "R: randomized response for group and value (M_R); L: randomized response for the "
            "group and discrete Laplace for the value (M_L); P: randomized response for the "
            "group and the Piecewise mechanism for the value (M_P); N: randomized response for "
            "the group and NPRR on a grid for the value (M_N); best: whichever needs less "
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
            f"budget per user, in [{MIN_PLANNED_EPSILON:g}, {MAX_PLANNED_EPSILON:g}] (e.g. 1): "
            "the error bound at it; in a power plan, the budget (leave it out to plan it)"
        ),
    )
    plan.add_argument("--confidence", help="probability that the bound holds (default 0.99)")
    plan.add_argument(
        "--group-ratio",
        default="1",
        help=(
            f"n_A / n_B, the first group's size over each other group's, in "
            f"[{MIN_GROUP_RATIO:g}, {MAX_GROUP_RATIO:g}] (default 1: balanced; e.g. 0.25)"
        ),
    )
    plan.add_argument("--groups", help="number of groups d (default 2)")
    plan.add_argument(
        "--bound",
        choices=("chebyshev", "normal"),
        help="chebyshev: holds for any K (default); normal: the large-K approximation",
    )
    plan.add_argument(
        "--scale",
        choices=("metric", "value"),
        help="errors on the metric's scale [0, 1] (default) or the report value's [-1, 1]",
    )
    plan.add_argument("--table", action="store_true", help="print Table 1 (paper vs valid)")
    rates = plan.add_argument_group("one joint report per user, or the gap audit")
    rates.add_argument(
        "--cell-counts",
        help=(
            "compare the two designs for a rate metric's difference between groups 0 and 1 in "
            "this scenario: the expected counts of TP,FP,FN,TN per group, group by group "
            '(e.g. "7500,2500,2500,12500,5000,2500,5000,12500"), with --epsilon'
        ),
    )
    rates.add_argument(
        "--rate-metric",
        choices=(
            "selection_rate",
            "true_positive_rate",
            "false_positive_rate",
            "false_negative_rate",
            "true_negative_rate",
            "accuracy",
            "precision",
            "negative_predictive_value",
        ),
        help="the metric to compare (default: every rate metric)",
    )
    _add_power_arguments(plan.add_argument_group("power and sample size"))
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def _add_power_arguments(power: argparse._ArgumentGroup) -> None:
    """The options of a power or sample-size plan (audit and FedEvalFair)."""
    power.add_argument(
        "--power",
        help="target probability of detecting the gap, above --significance and below 1 (e.g. 0.8)",
    )
    power.add_argument(
        "--gap",
        help=(
            "the true gap to detect: |m_A - m_B| in (0, 1] (metric units) for the audit; the "
            "common disparity (group 0's positive rate minus group 1's) for --fedevalfair"
        ),
    )
    power.add_argument(
        "--significance",
        help="level of the two-sided test of gap = 0, in (0, 1) (default 0.05)",
    )
    power.add_argument(
        "--metric-mean",
        help="audit: the midpoint of the two group means, in [0, 1] (default: worst case)",
    )
    power.add_argument(
        "--metric-variance",
        help=(
            "audit: the within-group variance of the per-user metric, in [0, 0.25] "
            "(default: worst case)"
        ),
    )
    power.add_argument(
        "--known-sizes",
        action="store_true",
        help="audit: the estimator is given the true group sizes (default: estimated, as the "
        "audit job does)",
    )
    power.add_argument(
        "--fedevalfair",
        action="store_true",
        help="plan FedEvalFair's stage 2 (calibrated mode) instead of the LDP audit",
    )
    power.add_argument(
        "--holders", help=f"FedEvalFair: number of holders, in [2, {MAX_PLANNED_HOLDERS:.0e}]"
    )
    power.add_argument(
        "--rows",
        help=(
            "FedEvalFair: rows per holder that the disparity averages over (all rows for dp, "
            "the rows with Y = 1 for eo), or a comma-separated count per holder"
        ),
    )
    power.add_argument(
        "--positive-rate",
        help="FedEvalFair: share of the rows predicted positive, in (0, 1) (default 0.5)",
    )
    power.add_argument("--mu0", help="FedEvalFair: stage 2's null value (default 0)")
