"""How far each node moves an LDP answer, and whether the nodes agree: the per-node cap and
influence check of the LDP audit, the rate report and the sequential audit.

A node that lies about its users (it says it hosts many, and runs the real mechanism on
invented ones) sends reports in the mechanism's output domain that no check of a single report
can refuse. Two things bound and expose it, both post-processing of reports the server already
holds (no further privacy cost):

* **A cap on a node's users that the node does not choose.** :func:`node_size_cap` is
  :data:`NODE_SIZE_FACTOR` times the lower median of the sizes the nodes describe: one node
  cannot move the lower median (with at least two nodes, fewer than half of them lying), and
  a node over the cap is left out of the exchange. A node with at most U of the users of
  group G (N_G of them honest) moves G's mean by at most U / (N_G + U) of the metric's range
  (U / N in a rate's denominator likewise), and a gap by at most the sum over its two groups.
* **An influence check** (:func:`node_influence`): (a) leave one node out: the estimate
  without each node, the largest shift in standard errors of the estimate and its node;
  (b) heterogeneity across nodes: each node's own estimate of the same quantity from its own
  reports, Cochran's Q = sum_k w_k (d_k - d_w)^2 with w_k = 1 / V_k against chi2(m - 1)
  (m the nodes tested; Cochran 1954), and each node's standardised deviation from the others,
  z_k = (d_k - d_{-k}) / sqrt(V_k + 1 / sum_{j != k} w_j) with d_{-k} the others'
  inverse-variance mean, flagged beyond the two-sided Bonferroni threshold
  z_{1 - alpha / (2 m t)} (t: the quantities checked together), one node at a time: a
  flagged node leaves the others' mean before the rest are compared again, so that a liar's
  pull on that mean does not flag honest nodes (the first step is the Bonferroni test, so
  honest nodes raise a flag with probability at most alpha).

The node's variance V_k is the variance of its estimate as a sample of its population: the
mechanism's closed-form variance *given* the users' values (what
:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap` gives for M_L, M_P and M_N, and the
frequency oracle's covariance for the rates) plus the sampling variance of the users' own
metric, m (1 - m) / n per group for a metric in [0, 1] with mean m (the largest a metric of
that mean can have: exact for 0/1 metrics, conservative otherwise; a rate's r (1 - r) / n is
exact). M_R's closed form already is that variance: its reports carry no sum of squares and
the estimator plugs in n m^2, the value at which the conditional and unconditional variances
coincide. Honest nodes whose populations share the quantity then give a Q close to
chi2(m - 1) and flag no node with probability at least 1 - alpha (tested by Monte Carlo with
the real mechanisms' samplers). A node whose own reports cannot give an estimate (a group
whose estimated size is indistinguishable from zero, or a rate whose denominator is within z
standard errors of 0) is not tested: it has too few reports to tell anything alone, and its
leave-one-out shift still shows how far it moved the answer. With more than
:data:`MAX_CHECKED_NODES` nodes (cross-device federations), the check covers that many with
the most reports: each of the others holds fewer reports than any of them.

References
----------
.. [1] W. G. Cochran, "The combination of estimates from different experiments", Biometrics
       10(1), 101-129, 1954.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from ..validation import check_int, check_open_unit
from .estimators import EstimationError, GapMechanism, estimate_gap, normal_quantile
from .frequency_oracle import FrequencyOracle
from .group_rates import CELLS, RATE_METRICS, group_rates
from .reports import ReportSummary

__all__ = [
    "AUTO_CAP",
    "INFLUENCE_RATE_METRICS",
    "MAX_CHECKED_NODES",
    "NODE_SIZE_FACTOR",
    "NodeInfluence",
    "UserCap",
    "check_user_cap",
    "gap_node_influence",
    "node_influence",
    "node_size_cap",
    "rate_node_influence",
    "resolve_user_cap",
]

#: The default cap on a node's users is this many times the lower median of the sizes the
#: nodes describe: honest nodes up to four times the typical one take part, and one node that
#: lies holds at most 4 / (4 + k) of the users next to k honest nodes of the median size.
NODE_SIZE_FACTOR = 4
#: The setting that derives the cap from the nodes' sizes (:func:`resolve_user_cap`).
AUTO_CAP: Final = "auto"
#: The influence check covers at most this many nodes, those with the most reports (with more,
#: every other node holds fewer reports than each of them: at most 1 / 501 of all); it costs
#: two estimates per node.
MAX_CHECKED_NODES = 500
#: The rates whose between-group difference the rate report's influence check follows: the
#: selection rate (demographic parity, four-fifths rule), TPR (equal opportunity) and FPR
#: (with TPR, equalized odds).
INFLUENCE_RATE_METRICS = ("selection_rate", "true_positive_rate", "false_positive_rate")

UserCap = int | Literal["auto"] | None


def check_user_cap(name: str, value: object) -> UserCap:
    """``value`` as a per-node cap setting: ``"auto"``, an integer >= 1, or None (no cap);
    ``ValueError`` naming ``name`` otherwise."""
    if value is None:
        return None
    if value == AUTO_CAP:
        return AUTO_CAP
    try:
        return check_int(name, value, minimum=1)
    except ValueError:
        raise ValueError(
            f'{name} must be "auto", an integer >= 1 or None (no cap), got {value!r}'
        ) from None


def node_size_cap(claimed_sizes: Iterable[int], factor: int = NODE_SIZE_FACTOR) -> int:
    """``factor`` times the lower median of the non-zero ``claimed_sizes`` (at least
    ``factor``).

    The lower median of k sizes is the ceil(k / 2)-th smallest: fewer than half of the nodes
    cannot raise it above an honest node's size, and a single node of two cannot either.
    Nodes without users bring nothing to an audit and do not lower it.

    Parameters
    ----------
    claimed_sizes : iterable of int
        The users each node says it hosts (at least one size).
    factor : int
        How many times the lower median a node may hold (>= 1).

    Returns
    -------
    int
        The cap on any node's users.
    """
    factor = check_int("factor", factor, minimum=1)
    sizes = [check_int("claimed_sizes", size, minimum=0) for size in claimed_sizes]
    if not sizes:
        raise ValueError("claimed_sizes must hold at least one size, got none")
    with_users = [size for size in sizes if size > 0] or [1]
    return factor * int(statistics.median_low(with_users))


def resolve_user_cap(setting: UserCap, claimed_sizes: Iterable[int]) -> int | None:
    """The cap a setting gives: ``"auto"``, :func:`node_size_cap` of ``claimed_sizes`` (None
    if there are none); an integer, itself; None, no cap.

    Parameters
    ----------
    setting : "auto", int or None
        The cap setting (:func:`check_user_cap`).
    claimed_sizes : iterable of int
        The sizes the nodes describe.

    Returns
    -------
    int or None
        The cap on any node's users (None: no cap).
    """
    setting = check_user_cap("max_users_per_node", setting)
    if setting != AUTO_CAP:
        return setting
    sizes = list(claimed_sizes)
    return node_size_cap(sizes) if sizes else None


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _read_float(value: Any) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True)
class NodeInfluence:
    """Each node's influence on one estimate (:func:`node_influence`; module docstring).

    Attributes
    ----------
    quantity : str
        What the estimate is, in words (e.g. "difference of the accuracy means of groups 0
        and 1").
    estimate, stderr : float
        The estimate from every node's reports and its standard error.
    nodes : tuple of int
        The nodes whose reports entered it, in order; the tuples below follow it.
    leave_one_out : tuple of float
        The estimate without each node (nan when the others' reports give none).
    node_estimates, node_stderrs : tuple of float
        Each node's own estimate and its standard error as a sample of its population (nan:
        too few reports to test the node alone).
    deviations : tuple of float
        Each tested node's standardised deviation from the other nodes not flagged before it
        (a flagged node's: when it was flagged; nan: not tested).
    statistic : float
        Cochran's Q over the tested nodes (nan with fewer than two).
    dof : int
        Its degrees of freedom: the tested nodes minus one.
    pvalue : float
        P(chi2(dof) >= statistic): small when the nodes disagree (nan: no test).
    threshold : float
        A node is flagged when its deviation's absolute value exceeds this.
    flagged : tuple of int
        The flagged nodes, in the order they were flagged (the largest deviation first).
    alpha : float
        The family-wise level of the flags and the level the p-value is read at.
    nodes_total : int
        The nodes whose reports entered the estimate; more than :attr:`nodes` when only the
        :data:`MAX_CHECKED_NODES` with the most reports were checked (0: as many).
    """

    quantity: str
    estimate: float
    stderr: float
    nodes: tuple[int, ...]
    leave_one_out: tuple[float, ...]
    node_estimates: tuple[float, ...]
    node_stderrs: tuple[float, ...]
    deviations: tuple[float, ...]
    statistic: float
    dof: int
    pvalue: float
    threshold: float
    flagged: tuple[int, ...]
    alpha: float
    nodes_total: int = 0

    @property
    def shifts(self) -> tuple[float, ...]:
        """How far leaving each node out moves the estimate, in its standard errors
        ((leave-one-out - estimate) / stderr; nan when unknown)."""
        if not self.stderr > 0:
            return tuple(math.nan for _ in self.nodes)
        return tuple((value - self.estimate) / self.stderr for value in self.leave_one_out)

    @property
    def largest_shift(self) -> float:
        """The largest absolute leave-one-node-out shift, in standard errors (nan: none)."""
        known = [abs(shift) for shift in self.shifts if math.isfinite(shift)]
        return max(known) if known else math.nan

    @property
    def largest_shift_node(self) -> int | None:
        """The node whose removal moves the estimate most (None: no shift is known)."""
        known = [(abs(s), node) for s, node in zip(self.shifts, self.nodes, strict=True)]
        known = [item for item in known if math.isfinite(item[0])]
        return max(known)[1] if known else None

    @property
    def tested_nodes(self) -> tuple[int, ...]:
        """The nodes with an estimate of their own (in the heterogeneity test)."""
        return tuple(
            node
            for node, value in zip(self.nodes, self.deviations, strict=True)
            if math.isfinite(value)
        )

    @property
    def heterogeneous(self) -> bool:
        """The heterogeneity test rejects at :attr:`alpha`."""
        return math.isfinite(self.pvalue) and self.pvalue < self.alpha

    def summary(self) -> str:
        """One line: the largest leave-one-node-out shift, the heterogeneity test and the
        flagged nodes."""
        node = self.largest_shift_node
        if node is None:
            shift = "no leave-one-node-out estimate (a single node, or too few reports)"
        else:
            shift = (
                f"largest leave-one-node-out shift {self.largest_shift:.2f} standard errors "
                f"(node {node})"
            )
        tested = len(self.tested_nodes)
        if tested < 2:
            test = f"{tested} of {len(self.nodes)} nodes have enough reports alone: no test"
        else:
            test = (
                f"heterogeneity across {tested} of {len(self.nodes)} nodes: Cochran's Q "
                f"{self.statistic:.3g} on {self.dof} df, p = {self.pvalue:.3g}"
            )
        by_node = dict(zip(self.nodes, self.deviations, strict=True))
        flags = (
            "; flagged (|z| > "
            + f"{self.threshold:.3g}, Bonferroni at {self.alpha:g}): "
            + ", ".join(f"node {n} (z {by_node[n]:+.2f})" for n in self.flagged)
            if self.flagged
            else "; no node flagged"
        )
        checked = (
            f" (the {len(self.nodes)} nodes with the most reports of {self.nodes_total})"
            if self.nodes_total > len(self.nodes)
            else ""
        )
        return f"influence on the {self.quantity}{checked}: {shift}; {test}{flags}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (nan as None), with the derived fields a reader needs."""

        def floats(values: Sequence[float]) -> list[float | None]:
            return [_json_float(value) for value in values]

        return {
            "quantity": self.quantity,
            "estimate": _json_float(self.estimate),
            "stderr": _json_float(self.stderr),
            "nodes": list(self.nodes),
            "leave_one_out": floats(self.leave_one_out),
            "shifts": floats(self.shifts),
            "largest_shift": _json_float(self.largest_shift),
            "largest_shift_node": self.largest_shift_node,
            "node_estimates": floats(self.node_estimates),
            "node_stderrs": floats(self.node_stderrs),
            "deviations": floats(self.deviations),
            "statistic": _json_float(self.statistic),
            "dof": self.dof,
            "pvalue": _json_float(self.pvalue),
            "threshold": _json_float(self.threshold),
            "flagged": list(self.flagged),
            "alpha": self.alpha,
            "nodes_total": max(self.nodes_total, len(self.nodes)),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeInfluence:
        """Read :meth:`to_dict`'s object back (e.g. from a results.json)."""

        def floats(key: str) -> tuple[float, ...]:
            return tuple(_read_float(value) for value in data[key])

        return cls(
            quantity=str(data["quantity"]),
            estimate=_read_float(data["estimate"]),
            stderr=_read_float(data["stderr"]),
            nodes=tuple(int(node) for node in data["nodes"]),
            leave_one_out=floats("leave_one_out"),
            node_estimates=floats("node_estimates"),
            node_stderrs=floats("node_stderrs"),
            deviations=floats("deviations"),
            statistic=_read_float(data["statistic"]),
            dof=int(data["dof"]),
            pvalue=_read_float(data["pvalue"]),
            threshold=_read_float(data["threshold"]),
            flagged=tuple(int(node) for node in data["flagged"]),
            alpha=float(data["alpha"]),
            nodes_total=int(data.get("nodes_total") or 0),
        )


def node_influence(
    quantity: str,
    estimate: float,
    stderr: float,
    leave_one_out: Mapping[int, float],
    node_estimates: Mapping[int, tuple[float, float]],
    *,
    alpha: float = 0.05,
    tests: int = 1,
    nodes_total: int = 0,
) -> NodeInfluence:
    """The influence check of one estimate from its per-node parts (module docstring).

    Parameters
    ----------
    quantity : str
        What the estimate is, in words.
    estimate, stderr : float
        The estimate from every node's reports and its standard error.
    leave_one_out : mapping of int to float
        Each node's id to the estimate without its reports (nan: none); its keys are the
        nodes, in order.
    node_estimates : mapping of int to (float, float)
        Each node's own estimate and its variance-as-a-sample standard error; a node missing,
        or with a non-finite value or a standard error that is not > 0, is not tested.
    alpha : float
        Family-wise level of the flags, in (0, 1).
    tests : int
        How many quantities are checked together (the flags' Bonferroni correction covers
        nodes x tests).
    nodes_total : int
        The nodes whose reports entered the estimate, when more than those checked (0: as
        many).

    Returns
    -------
    NodeInfluence
        The shifts, Cochran's Q and its p-value, the deviations and the flagged nodes.
    """
    from scipy import stats  # (a lazy import, as in estimators.normal_quantile)

    alpha = check_open_unit("alpha", alpha)
    tests = check_int("tests", tests, minimum=1)
    nodes = tuple(int(node) for node in leave_one_out)
    own = [node_estimates.get(node, (math.nan, math.nan)) for node in nodes]
    values = np.array([float(value) for value, _ in own], dtype=np.float64)
    errors = np.array([float(error) for _, error in own], dtype=np.float64)
    tested = np.isfinite(values) & np.isfinite(errors) & (errors > 0)
    deviations = np.full(len(nodes), math.nan)
    statistic, pvalue, dof = math.nan, math.nan, 0
    count = int(tested.sum())
    threshold = normal_quantile(1.0 - alpha / max(count * tests, 1))  # two-sided: 1 - a / 2
    flagged: tuple[int, ...] = ()
    if count >= 2:
        weights = np.where(tested, 1.0 / np.where(tested, errors, 1.0) ** 2, 0.0)
        parts = np.where(tested, values, 0.0)
        total = float(weights.sum())
        pooled = float(weights @ parts) / total
        statistic = float(weights[tested] @ (parts[tested] - pooled) ** 2)
        dof = count - 1
        pvalue = float(stats.chi2.sf(statistic, dof))
        flagged = _step_down_flags(nodes, parts, weights, tested, threshold, deviations)
    return NodeInfluence(
        quantity=quantity,
        estimate=float(estimate),
        stderr=float(stderr),
        nodes=nodes,
        leave_one_out=tuple(float(leave_one_out[node]) for node in nodes),
        node_estimates=tuple(float(value) for value in values),
        node_stderrs=tuple(float(error) for error in errors),
        deviations=tuple(float(value) for value in deviations),
        statistic=statistic,
        dof=dof,
        pvalue=pvalue,
        threshold=threshold,
        flagged=flagged,
        alpha=alpha,
        nodes_total=check_int("nodes_total", nodes_total, minimum=0),
    )


def _checked(reports: Mapping[int, int]) -> list[int]:
    """The nodes the influence check covers: all, or the :data:`MAX_CHECKED_NODES` with the
    most reports, in the mapping's order."""
    if len(reports) <= MAX_CHECKED_NODES:
        return list(reports)
    largest = sorted(reports, key=lambda node: -reports[node])[:MAX_CHECKED_NODES]
    chosen = set(largest)
    return [node for node in reports if node in chosen]


def _step_down_flags(
    nodes: tuple[int, ...],
    values: np.ndarray,
    weights: np.ndarray,
    tested: np.ndarray,
    threshold: float,
    deviations: np.ndarray,
) -> tuple[int, ...]:
    """Flag nodes one at a time: each active node's deviation from the other active nodes'
    inverse-variance mean; the largest beyond ``threshold`` is flagged and leaves the active
    set, and the rest are compared again, so that one node's pull on the others' mean does
    not flag honest nodes. Without a flag at the first step (Bonferroni over every tested
    node) there is none, so the family-wise false flag rate stays at most alpha. Writes each
    node's last deviation into ``deviations`` (a flagged node's: the one that flagged it)."""
    active = tested.copy()
    flagged: list[int] = []
    while int(active.sum()) >= 2:
        total = float(weights[active].sum())
        pooled = float(weights[active] @ values[active])
        others = total - weights[active]
        others_mean = (pooled - weights[active] * values[active]) / others
        deviation = (values[active] - others_mean) / np.sqrt(1.0 / weights[active] + 1.0 / others)
        deviations[active] = deviation
        worst = int(np.argmax(np.abs(deviation)))
        if not abs(deviation[worst]) > threshold:
            break
        index = int(np.flatnonzero(active)[worst])
        flagged.append(nodes[index])
        active[index] = False
    return tuple(flagged)


def _merged(summaries: Iterable[ReportSummary], num_groups: int) -> ReportSummary:
    total = ReportSummary.empty(num_groups)
    for summary in summaries:
        total = total.merge(summary)
    return total


def _without(total: ReportSummary, part: ReportSummary) -> ReportSummary:
    """The summary of ``total``'s reports but ``part``'s (summaries are additive)."""
    return ReportSummary(
        total.num_reports - part.num_reports,
        total.report_counts - part.report_counts,
        total.value_sums - part.value_sums,
        total.value_square_sums - part.value_square_sums,
    )


def _pair_difference(
    summary: ReportSummary,
    mechanism: GapMechanism,
    pair: tuple[int, int],
    undefined_category: bool,
    *,
    as_sample: bool,
) -> tuple[float, float]:
    """The pair's signed difference of means from ``summary`` and its standard error (with
    ``as_sample``, the variance of the users' metric added where the closed form is given
    the users' values: module docstring); (nan, nan) when the reports give no estimate."""
    try:
        estimate = estimate_gap(summary, mechanism, undefined_category=undefined_category)
    except EstimationError:
        return math.nan, math.nan
    index = estimate.pairs.index(pair)
    variance = float(estimate.difference_stderrs[index]) ** 2
    if as_sample and mechanism.moments.kept_second_moment_slope > 0:
        means = np.clip(estimate.group_means[list(pair)], 0.0, 1.0)
        sizes = np.maximum(estimate.group_sizes[list(pair)], 1.0)
        variance += float(np.sum(means * (1.0 - means) / sizes))
    return float(estimate.differences[index]), math.sqrt(variance)


def gap_node_influence(
    summaries: Mapping[int, ReportSummary],
    mechanism: GapMechanism,
    *,
    metric: str = "metric",
    undefined_category: bool = False,
    alpha: float = 0.05,
) -> NodeInfluence:
    """The influence check of an LDP gap audit: the signed difference of the two group
    means whose gap is the largest, from every node's reports (group sizes estimated).

    Parameters
    ----------
    summaries : mapping of int to ReportSummary
        Each accepted node's reports (at least one node).
    mechanism : GapMechanism
        The mechanism the users applied (M_R, M_L, M_P or M_N).
    metric : str
        The audited metric's name (for :attr:`NodeInfluence.quantity`).
    undefined_category : bool
        The mechanism's last category is "metric undefined"
        (:func:`~fedparity.mechanisms.ldp.estimators.estimate_gap`).
    alpha : float
        Family-wise level of the flags.

    Returns
    -------
    NodeInfluence

    Raises
    ------
    EstimationError
        When every node's reports together give no estimate.
    """
    if not summaries:
        raise ValueError("summaries must hold at least one node's reports, got none")
    total = _merged(summaries.values(), mechanism.num_groups)
    pooled = estimate_gap(total, mechanism, undefined_category=undefined_category)
    pair = pooled.max_gap_pair
    index = pooled.pairs.index(pair)
    checked = _checked({node: summary.num_reports for node, summary in summaries.items()})
    leave_one_out = {
        node: (
            _pair_difference(
                _without(total, summaries[node]),
                mechanism,
                pair,
                undefined_category,
                as_sample=False,
            )[0]
            if len(summaries) > 1
            else math.nan
        )
        for node in checked
    }
    own = {
        node: _pair_difference(summaries[node], mechanism, pair, undefined_category, as_sample=True)
        for node in checked
    }
    return node_influence(
        f"difference of the {metric} means of groups {pair[0]} and {pair[1]}",
        float(pooled.differences[index]),
        float(pooled.difference_stderrs[index]),
        leave_one_out,
        own,
        alpha=alpha,
        nodes_total=len(summaries),
    )


def _rate_difference(
    support: np.ndarray,
    num_reports: int,
    oracle: FrequencyOracle,
    num_groups: int,
    metric: str,
    pair: tuple[int, int],
    *,
    as_sample: bool,
) -> tuple[float, float]:
    """R_first - R_second of ``metric`` from the reports' support counts and its standard
    error (with ``as_sample``, plus r (1 - r) / n of each rate); nan when unknown."""
    if num_reports < 1:
        return math.nan, math.nan
    counts = oracle.estimate(support, num_reports)
    rates = group_rates(counts, num_groups=num_groups, metrics=(metric,))
    value, stderr = rates.pair_difference(metric, *pair)
    if not (math.isfinite(value) and math.isfinite(stderr)):
        return math.nan, math.nan
    variance = stderr**2
    if as_sample:
        cells = counts.counts.shape[0] // num_groups
        bottom = [CELLS.index(name) for name in RATE_METRICS[metric][1]]
        for group in pair:
            rate = min(max(float(rates.values[0, group]), 0.0), 1.0)
            denominator = float(counts.counts[[group * cells + cell for cell in bottom]].sum())
            variance += rate * (1.0 - rate) / max(denominator, 1.0)
    return value, math.sqrt(variance)


def rate_node_influence(
    supports: Mapping[int, tuple[np.ndarray, int]],
    oracle: FrequencyOracle,
    *,
    num_groups: int,
    metrics: Sequence[str] = INFLUENCE_RATE_METRICS,
    alpha: float = 0.05,
) -> tuple[NodeInfluence, ...]:
    """The influence check of a rate report: for each of ``metrics``, the difference of the
    rates of the groups with the largest and the smallest rate (fairlearn's difference between
    groups), from every node's reports; the flags' Bonferroni correction covers every node and
    metric.

    Parameters
    ----------
    supports : mapping of int to (np.ndarray, int)
        Each accepted node's support counts and number of reports (at least one node).
    oracle : FrequencyOracle
        The oracle the users applied (over num_groups x 4 or 5 categories).
    num_groups : int
        The protected groups.
    metrics : sequence of str
        Rate metrics (:data:`~fedparity.mechanisms.ldp.group_rates.RATE_METRICS`).
    alpha : float
        Family-wise level of the flags.

    Returns
    -------
    tuple of NodeInfluence
        One per metric with two groups that have a rate (none for the others).
    """
    if not supports:
        raise ValueError("supports must hold at least one node's reports, got none")
    total_support = sum(np.asarray(support, dtype=np.int64) for support, _ in supports.values())
    total_reports = sum(int(reports) for _, reports in supports.values())
    if total_reports < 1:
        return ()
    pooled = group_rates(
        oracle.estimate(np.asarray(total_support), total_reports),
        num_groups=num_groups,
        metrics=tuple(metrics),
    )
    checked = _checked({node: int(reports) for node, (_, reports) in supports.items()})
    checks = []
    for position, metric in enumerate(metrics):
        values = pooled.values[position, :num_groups]
        valid = [group for group in range(num_groups) if math.isfinite(values[group])]
        if len(valid) < 2:
            continue
        high = max(valid, key=lambda group: values[group])
        low = min(valid, key=lambda group: values[group])
        pair = (high, low)
        estimate, stderr = pooled.pair_difference(metric, *pair)
        leave_one_out = {}
        for node in checked:
            support, reports = supports[node]
            rest = total_reports - int(reports)
            leave_one_out[node] = (
                _rate_difference(
                    np.asarray(total_support - support),
                    rest,
                    oracle,
                    num_groups,
                    metric,
                    pair,
                    as_sample=False,
                )[0]
                if rest > 0 and len(supports) > 1
                else math.nan
            )
        own = {
            node: _rate_difference(
                np.asarray(supports[node][0]),
                int(supports[node][1]),
                oracle,
                num_groups,
                metric,
                pair,
                as_sample=True,
            )
            for node in checked
        }
        checks.append((metric, pair, estimate, stderr, leave_one_out, own))
    return tuple(
        node_influence(
            f"{metric.replace('_', ' ')} difference of groups {pair[0]} and {pair[1]}",
            estimate,
            stderr,
            leave_one_out,
            own,
            alpha=alpha,
            tests=len(checks),
            nodes_total=len(supports),
        )
        for metric, pair, estimate, stderr, leave_one_out, own in checks
    )
