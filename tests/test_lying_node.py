"""A lying node moves an LDP answer by no more than its share, and is seen doing so (security
review 2026-11-28, M3).

The attack: a node describes many users and runs the real handler on invented ones (group 0
always right, group 1 always wrong): every report is in the mechanism's output domain and no
check of a reply can refuse it. The defences: a per-node cap the node does not choose
(``max_users_per_node``, run-config ``max-users-per-node``; by default 4 x the lower median of
the described sizes), and an influence check in every outcome (leave-one-node-out shifts,
Cochran's Q across the nodes' own estimates, flagged nodes:
:mod:`fedparity.mechanisms.ldp.node_influence`). The attacks run the real handlers
(``ldp_audit_handler``, ``rate_report_handler``) and the real strategies in process (an
in-process grid); the statistics are checked by seeded Monte Carlo with the real mechanisms'
samplers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict

from fedparity.clients import LocalUsers, ldp_audit_handler
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.rates import LocalPredictions, rate_report_handler
from fedparity.mechanisms import mechanism_for_budget
from fedparity.mechanisms.ldp.calibration import GapMechanismType
from fedparity.mechanisms.ldp.estimators import metric_to_value
from fedparity.mechanisms.ldp.frequency_oracle import frequency_oracle
from fedparity.mechanisms.ldp.group_rates import encode_cells
from fedparity.mechanisms.ldp.node_influence import (
    NODE_SIZE_FACTOR,
    NodeInfluence,
    check_user_cap,
    gap_node_influence,
    node_influence,
    node_size_cap,
    rate_node_influence,
    resolve_user_cap,
)
from fedparity.mechanisms.ldp.nprr import nprr_for_budget
from fedparity.strategies import SequentialLdpAudit
from fedparity.strategies.ldp_audit import LdpGapAudit
from fedparity.strategies.rate_report import RateReportAudit
from tests.support.handler_grid import HandlerGrid


def binomial_tolerance(level: float, runs: int, sds: float = 3.3) -> float:
    """``sds`` binomial standard deviations of a rate ``level`` over ``runs`` runs."""
    return sds * math.sqrt(level * (1 - level) / runs)


# --- the cap ---------------------------------------------------------------------------------


def test_the_cap_is_a_multiple_of_the_lower_median_that_one_node_cannot_raise() -> None:
    honest = [100] * 10
    assert node_size_cap(honest) == NODE_SIZE_FACTOR * 100 == 400
    # one node, however large its claim, leaves the lower median at an honest size
    assert node_size_cap([*honest, 10**9]) == 400
    assert node_size_cap([100, 10**9]) == 400  # of two nodes: the smaller one
    assert node_size_cap([1, 1, 1]) == NODE_SIZE_FACTOR  # one user per device
    assert node_size_cap([0, 0]) == NODE_SIZE_FACTOR  # at least the factor
    assert node_size_cap([0, 0, 0, 100]) == 400  # nodes without users do not lower it
    assert resolve_user_cap("auto", [*honest, 3000]) == 400
    assert resolve_user_cap("auto", []) is None and resolve_user_cap(None, honest) is None
    assert resolve_user_cap(250, honest) == 250
    for bad in (0, -3, 2.5, "many", True):
        with pytest.raises(ValueError, match="max_users_per_node must be"):
            check_user_cap("max_users_per_node", bad)
    with pytest.raises(ValueError, match="claimed_sizes must hold at least one size"):
        node_size_cap([])


def test_the_run_config_key_is_checked_before_any_work() -> None:
    from fedparity.clients.project.config import ConfigError, RunConfig

    assert RunConfig.from_mapping({}).max_users_per_node is None  # "": 4 x the lower median
    assert RunConfig.from_mapping({"max-users-per-node": 5000}).max_users_per_node == 5000
    for bad in (0, -1, 2.5, "lots"):
        with pytest.raises(ConfigError, match="max-users-per-node must be an integer >= 1"):
            RunConfig.from_mapping({"max-users-per-node": bad})


# --- the influence check by hand ---------------------------------------------------------------


def test_the_influence_check_by_hand() -> None:
    """Three nodes with estimates 0.10, 0.12, 0.50 (standard errors 0.05) and a fourth with
    too few reports. Cochran's Q = sum w (d - mean)^2 = 400 (0.14^2 + 0.12^2 + 0.26^2) =
    40.64 on 2 df, whose chi2 tail is exp(-Q / 2); node 3 deviates from the others' mean
    0.11 by 0.39 / sqrt(0.05^2 + 1 / 800) = 6.369 > z(1 - 0.05 / 6) = 2.394, and once it is
    flagged nodes 1 and 2 differ by 0.02 / sqrt(2 x 0.05^2) = 0.283: one flag."""
    check = node_influence(
        "difference",
        0.2,
        0.02,
        {1: 0.25, 2: 0.24, 3: 0.11, 4: 0.2},
        {1: (0.10, 0.05), 2: (0.12, 0.05), 3: (0.50, 0.05), 4: (math.nan, math.nan)},
    )
    assert check.statistic == pytest.approx(40.64)
    assert check.dof == 2 and check.pvalue == pytest.approx(math.exp(-40.64 / 2))
    assert check.threshold == pytest.approx(2.3940, abs=1e-4)
    assert check.flagged == (3,)
    assert check.deviations[2] == pytest.approx(0.39 / math.sqrt(0.0025 + 1 / 800))
    assert check.deviations[0] == pytest.approx(-0.02 / math.sqrt(0.005))
    assert math.isnan(check.deviations[3]) and check.tested_nodes == (1, 2, 3)
    assert check.shifts == pytest.approx((2.5, 2.0, -4.5, 0.0))
    assert (check.largest_shift, check.largest_shift_node) == (pytest.approx(4.5), 3)
    assert NodeInfluence.from_dict(check.to_dict()).to_dict() == check.to_dict()
    line = check.summary()
    assert "largest leave-one-node-out shift 4.50 standard errors (node 3)" in line
    assert "across 3 of 4 nodes" in line and "node 3 (z +6.37)" in line


def test_a_cross_device_federation_checks_the_nodes_with_the_most_reports() -> None:
    """600 devices of one user and one node of 50: the check covers the 500 with the most
    reports (the node of 50 among them) and says so; its cost stays two estimates per checked
    node."""
    from fedparity.mechanisms.ldp.node_influence import MAX_CHECKED_NODES

    mechanism = mechanism_for_budget("R", 2.0, 2)
    rng = np.random.default_rng(15)
    summaries = {}
    for node in range(601):
        size = 50 if node == 300 else 1
        groups = rng.integers(0, 2, size)
        values = np.where(rng.random(size) < 0.8, 1.0, -1.0)
        summaries[node] = mechanism.perturb_and_summarize(groups, values, rng)
    check = gap_node_influence(summaries, mechanism)
    assert len(check.nodes) == MAX_CHECKED_NODES == 500 and 300 in check.nodes
    assert check.to_dict()["nodes_total"] == 601
    assert "(the 500 nodes with the most reports of 601)" in check.summary()


# --- the heterogeneity test's size: honest nodes that share the gap -----------------------------

#: Twelve honest nodes: eight of 100 users, and 30, 60, 400 and 1000; group-1 shares 0.5,
#: 0.2, 0.7 and accuracies (0.8, 0.7), (0.6, 0.5), (0.95, 0.85) in turn: different populations
#: with the same gap 0.1.
SIZES = [100] * 8 + [30, 60, 400, 1000]
SHARES = (0.5, 0.2, 0.7)
MEANS = ((0.8, 0.7), (0.6, 0.5), (0.95, 0.85))


def honest_summaries(mechanism: GapMechanismType, rng: np.random.Generator) -> dict:
    summaries = {}
    for node, size in enumerate(SIZES):
        groups = (rng.random(size) < SHARES[node % 3]).astype(np.int64)
        metric = (rng.random(size) < np.asarray(MEANS[node % 3])[groups]).astype(np.float64)
        summaries[node] = mechanism.perturb_and_summarize(groups, metric_to_value(metric), rng)
    return summaries


def rejections(mechanism: GapMechanismType, runs: int, seed: int) -> tuple[float, float]:
    """(rate of heterogeneity p-values < 0.05, rate of runs with a flag)."""
    rng = np.random.default_rng(seed)
    rejected = flagged = tested = 0
    for _ in range(runs):
        check = gap_node_influence(honest_summaries(mechanism, rng), mechanism)
        if math.isfinite(check.pvalue):
            tested += 1
            rejected += check.pvalue < 0.05
        flagged += bool(check.flagged)
    assert tested >= 0.9 * runs
    return rejected / tested, flagged / runs


@pytest.mark.parametrize("name", ["R", "L", "P"])
def test_honest_nodes_that_share_the_gap_reject_at_the_tests_level(name: str) -> None:
    """300 seeded runs of M_R, M_L and M_P at epsilon 2 (the real samplers): the
    heterogeneity test rejects at 0.05 within 3.3 binomial standard deviations, and no node is
    flagged in at least 95% of the runs (within the same margin) -- nodes of 30 and 60 users
    included."""
    runs = 300
    rejected, flagged = rejections(mechanism_for_budget(name, 2.0, 2), runs, seed=11)
    margin = binomial_tolerance(0.05, runs)
    assert abs(rejected - 0.05) <= margin, rejected
    assert flagged <= 0.05 + margin, flagged


@pytest.mark.parametrize("name", ["R", "L"])
def test_a_nodes_own_standard_error_covers_the_sampling_of_its_users(name: str) -> None:
    """A node's own estimate is compared with other nodes' populations, so its standard error
    must cover the sampling of its users as well as the LDP noise: over 800 seeded nodes of
    2000 users with 0/1 accuracies of mean 0.5 in both groups, (d - 0) / se has variance 1
    within 3.3 standard deviations of a sample variance, sqrt(2 / 800). (M_L's closed form
    alone, given the users' values, gave 1.28: that is what the m (1 - m) / n term adds.)"""
    mechanism = mechanism_for_budget(name, 2.0, 2)
    rng = np.random.default_rng(14)
    scores = []
    for _ in range(800):
        groups = rng.integers(0, 2, 2000)
        metric = (rng.random(2000) < 0.5).astype(np.float64)
        summary = mechanism.perturb_and_summarize(groups, metric_to_value(metric), rng)
        check = gap_node_influence({1: summary}, mechanism)
        scores.append(check.node_estimates[0] / check.node_stderrs[0])
    assert abs(np.var(scores) - 1.0) <= 3.3 * math.sqrt(2 / 800), np.var(scores)


def test_m_n_is_conservative() -> None:
    """M_N's closed form bounds its rounding variance (:func:`~fedparity.mechanisms.ldp.nprr.
    nprr_report_moments`), so its test rejects at most at the level."""
    runs = 200
    rejected, flagged = rejections(nprr_for_budget(2.0, 2), runs, seed=12)
    margin = binomial_tolerance(0.05, runs)
    assert rejected <= 0.05 + margin and flagged <= 0.05 + margin, (rejected, flagged)


def test_honest_rate_reports_reject_at_the_tests_level() -> None:
    """The rate report's check (selection rate, TPR and FPR differences): ten honest nodes of
    300 users and one of 60 and one of 3000, different group shares, the same rates per group;
    GRR at epsilon 4, 200 seeded runs. Each p-value rejects at 0.05 within the margin, and the
    flags (Bonferroni over nodes and the three rates) stay under 5% within it."""
    runs, sizes = 200, [300] * 10 + [60, 3000]
    oracle = frequency_oracle("grr", 4.0, 8)
    rng = np.random.default_rng(13)
    rejected = {name: [] for name in ("selection", "true", "false")}
    flagged = 0
    for _ in range(runs):
        supports = {}
        for node, size in enumerate(sizes):
            groups = (rng.random(size) < SHARES[node % 3]).astype(np.int64)
            labels = (rng.random(size) < 0.3).astype(np.int64)
            # TPR 0.8 and 0.6, FPR 0.2 and 0.1 in groups 0 and 1, at every node
            tpr, fpr = np.array([0.8, 0.6])[groups], np.array([0.2, 0.1])[groups]
            positive = np.where(labels == 1, tpr, fpr)
            predictions = (rng.random(size) < positive).astype(np.int64)
            cells = encode_cells(groups, labels, predictions, 2)
            supports[node] = (oracle.perturb_and_count(cells, rng), size)
        checks = rate_node_influence(supports, oracle, num_groups=2)
        flagged += any(check.flagged for check in checks)
        for check in checks:
            rejected[check.quantity.split()[0]].append(check.pvalue < 0.05)
    margin = binomial_tolerance(0.05, runs)
    for name, outcomes in rejected.items():
        assert len(outcomes) == runs and abs(np.mean(outcomes) - 0.05) <= margin, name
    assert flagged / runs <= 0.05 + margin


# --- the attacks against the real handlers and strategies --------------------------------------

HONEST_NODES, HONEST_USERS, LIAR = 10, 100, 11


def ldp_node(tmp_path: Path, groups: np.ndarray, metrics: np.ndarray):  # noqa: ANN201
    """The real ``query.ldp_audit`` handler over users 1000 .. (by id), built-in policy."""
    ids = 1000 + np.arange(groups.size)
    return ldp_audit_handler(
        lambda arrays, metric, context: LocalUsers(groups, metrics, user_ids=ids),
        num_groups=2,
        policy=NodePrivacyPolicy(),
        ledger_path=lambda context: tmp_path / f"node-{context.node_id}.json",
    )


def invented_users(claimed: int) -> tuple[np.ndarray, np.ndarray]:
    """The review's liar: half its invented users in group 0, always right; half in group 1,
    always wrong."""
    groups = np.repeat([0, 1], [claimed - claimed // 2, claimed // 2]).astype(np.int64)
    return groups, (groups == 0).astype(np.float64)


def gap_federation(
    tmp_path: Path, claimed: int, seed: int, honest_users: int = HONEST_USERS
) -> tuple[HandlerGrid, dict, dict]:
    """Ten honest nodes of 100 users (accuracy 0.8 in both groups) and node 11, which
    describes ``claimed`` users and answers with the real handler on as many invented ones.
    Returns the grid, what each node describes, and the honest users' (size, mean) per
    group."""
    rng = np.random.default_rng(seed)
    handlers, contexts, described = {}, {}, {}
    honest_groups, honest_metrics = [], []
    for node in range(1, HONEST_NODES + 1):
        groups = rng.integers(0, 2, honest_users)
        metrics = (rng.random(honest_users) < 0.8).astype(np.float64)
        honest_groups.append(groups)
        honest_metrics.append(metrics)
        handlers[node] = ldp_node(tmp_path, groups, metrics)
        described[node] = honest_users
    handlers[LIAR] = ldp_node(tmp_path, *invented_users(claimed))
    described[LIAR] = claimed
    for node in handlers:
        contexts[node] = Context(1, node, {}, RecordDict(), {})
    groups, metrics = np.concatenate(honest_groups), np.concatenate(honest_metrics)
    truth = {g: (int((groups == g).sum()), float(metrics[groups == g].mean())) for g in (0, 1)}
    return HandlerGrid(lambda node, action: handlers[node], contexts), described, truth


def audit(described: dict, cap: object = "auto", audit_id: str = "audit") -> LdpGapAudit:
    mechanism = mechanism_for_budget("L", 2.0, 2)  # the review's M_L at epsilon 2
    return LdpGapAudit(
        mechanism,
        budget=2.0,
        users_by_node=described,
        max_users_per_node=cap,  # type: ignore[arg-type]
        audit_id=audit_id,
    )


def assert_within_share(outcome, truth: dict, cap: int) -> None:  # noqa: ANN001
    """The threat model's bound: a node with at most ``cap`` users moves group g's mean by at
    most cap / (N_g + cap) of the metric's range (N_g: the honest users of g), here plus 4.5
    standard errors of the estimate (the LDP noise)."""
    estimate = outcome.estimate
    assert estimate is not None, outcome.summary()
    for group, (size, mean) in truth.items():
        share = cap / (size + cap)
        moved = abs(float(estimate.group_means[group]) - mean)
        assert moved <= share + 4.5 * float(estimate.group_stderrs[group]), (group, moved, share)


@pytest.mark.usefixtures("task_identity")
def test_a_node_that_claims_invented_users_is_left_out_and_moves_nothing(tmp_path: Path) -> None:
    """The review's attack. Without a cap the liar's 3000 invented users set the gap (+0.74
    in the review; here >= 0.5 with every reply accepted). With the default cap (4 x the lower
    median of the described sizes, 400) it is not asked: one warning line, counted in the
    outcome, its users not charged, and every group mean stays within the bound for a node of
    at most 400 users."""
    grid, described, truth = gap_federation(tmp_path, claimed=3000, seed=1)
    unbounded = audit(described, cap=None, audit_id="unbounded").start(grid, ArrayRecord())
    assert unbounded.accepted_nodes == 11 and not unbounded.rejected
    assert unbounded.estimate is not None and unbounded.estimate.max_gap >= 0.5
    ledger = tmp_path / f"node-{LIAR}.json"
    charged = ledger.read_bytes()

    capped = audit(described, audit_id="capped").start(grid, ArrayRecord())
    assert_within_share(capped, truth, cap=400)
    assert capped.max_users_per_node == 400
    assert [(item.node_id, item.claimed_users, item.cap) for item in capped.excluded] == [
        (LIAR, 3000, 400)
    ]
    assert capped.nodes_sent == capped.accepted_nodes == HONEST_NODES
    assert ledger.read_bytes() == charged  # the liar was not asked: nothing more charged
    reason = capped.excluded[0].reason
    assert "describes 3000 users, more than the per-node cap of 400" in reason
    assert "max-users-per-node" in reason and f"node {LIAR} left out" in capped.summary()
    record = capped.to_dict()
    assert record["excluded_nodes"][0]["claimed_users"] == 3000
    assert record["max_users_per_node"] == 400


@pytest.mark.usefixtures("task_identity")
def test_a_liar_inside_the_cap_moves_the_gap_by_its_share_at_most_and_is_flagged(
    tmp_path: Path,
) -> None:
    """The liar describes 400 users (the cap): its reports are accepted, each group mean
    moves by at most 400 / (N_g + 400), and the influence check flags it first and names it
    as the node whose removal moves the estimate most."""
    grid, described, truth = gap_federation(tmp_path, claimed=400, seed=2)
    outcome = audit(described).start(grid, ArrayRecord())
    assert outcome.accepted_nodes == 11 and not outcome.excluded
    assert_within_share(outcome, truth, cap=400)
    check = outcome.influence
    assert check is not None and check.flagged[:1] == (LIAR,), outcome.summary()
    assert check.largest_shift_node == LIAR and check.largest_shift > 3
    assert "flagged" in outcome.summary() and outcome.to_dict()["influence"]["flagged"][0] == LIAR


@pytest.mark.usefixtures("task_identity")
def test_a_reply_over_the_cap_is_refused_without_a_describe(tmp_path: Path) -> None:
    """A library server that sends no ``query.describe``: the cap comes from the users the
    replies account for, and the liar's reply is refused, counted, with one line naming it."""
    grid, _, truth = gap_federation(tmp_path, claimed=3000, seed=3)
    outcome = LdpGapAudit(mechanism_for_budget("L", 2.0, 2), budget=2.0).start(grid, ArrayRecord())
    assert_within_share(outcome, truth, cap=400)
    assert outcome.accepted_nodes == HONEST_NODES and outcome.max_users_per_node == 400
    (refused,) = outcome.rejected
    assert refused.node_id == LIAR
    assert "the reply accounts for 3000 users, more than the per-node cap of 400" in refused.reason


# --- the rate report ---------------------------------------------------------------------------

RATE_USERS = 300


def rate_node(tmp_path: Path, groups, labels, predictions):  # noqa: ANN001, ANN201
    ids = 5000 + np.arange(groups.size)

    def local(arrays: ArrayRecord, context: Context) -> LocalPredictions:
        return LocalPredictions(groups, labels, predictions, user_ids=ids)

    return rate_report_handler(
        local,
        num_groups=2,
        policy=NodePrivacyPolicy(),
        ledger_path=lambda context: tmp_path / f"rates-{context.node_id}.json",
    )


def rate_federation(tmp_path: Path, claimed: int, seed: int) -> tuple[HandlerGrid, dict, dict]:
    """Ten honest nodes of 300 users (TPR 0.8 in both groups) and a liar whose invented users
    are positives: group 0 always predicted 1, group 1 always 0 (TPR 1 and 0). Returns the
    grid, the described sizes and the honest positives (count, TPR) per group."""
    rng = np.random.default_rng(seed)
    handlers, described, rows = {}, {}, []
    for node in range(1, HONEST_NODES + 1):
        groups = rng.integers(0, 2, RATE_USERS)
        labels = rng.integers(0, 2, RATE_USERS)
        predictions = (rng.random(RATE_USERS) < np.where(labels == 1, 0.8, 0.2)).astype(int)
        rows.append((groups, labels, predictions))
        handlers[node] = rate_node(tmp_path, groups, labels, predictions)
        described[node] = RATE_USERS
    groups = np.repeat([0, 1], [claimed - claimed // 2, claimed // 2])
    handlers[LIAR] = rate_node(tmp_path, groups, np.ones_like(groups), (groups == 0).astype(int))
    described[LIAR] = claimed
    contexts = {node: Context(1, node, {}, RecordDict(), {}) for node in handlers}
    groups, labels, predictions = (np.concatenate(part) for part in zip(*rows, strict=True))
    positives = {
        g: (
            int(((groups == g) & (labels == 1)).sum()),
            float(predictions[(groups == g) & (labels == 1)].mean()),
        )
        for g in (0, 1)
    }
    return HandlerGrid(lambda node, action: handlers[node], contexts), described, positives


def rate_audit(described: dict, cap: object = "auto", audit_id: str = "rates") -> RateReportAudit:
    return RateReportAudit.for_budget(
        2.0,
        num_groups=2,
        oracle="grr",
        users_by_node=described,
        max_users_per_node=cap,
        audit_id=audit_id,
    )


def assert_tpr_within_share(outcome, positives: dict, cap: int) -> None:  # noqa: ANN001
    """A node with at most ``cap`` users moves group g's TPR by at most cap / (P_g + cap)
    (P_g: the honest positives of g), plus 4.5 standard errors."""
    assert outcome.rates is not None, outcome.summary()
    for group, (count, tpr) in positives.items():
        estimate = outcome.rates.by_group["true_positive_rate"][group]
        moved = abs(estimate.value - tpr)
        assert moved <= cap / (count + cap) + 4.5 * estimate.stderr, (group, moved)


@pytest.mark.usefixtures("task_identity")
def test_a_rate_report_leaves_out_a_node_over_the_cap_and_flags_one_inside(
    tmp_path: Path,
) -> None:
    """Without a cap the liar's 12,000 invented positives set the equal opportunity
    difference (>= 0.5); with the default cap (1200) it is left out and each group's TPR stays
    within the share of a node of 1200 users; a liar of 1200 (inside the cap) is accepted,
    stays within that share and is flagged by the TPR check."""
    grid, described, positives = rate_federation(tmp_path, claimed=12_000, seed=4)
    model = ArrayRecord({"unused": Array(np.zeros(1))})
    unbounded = rate_audit(described, cap=None, audit_id="unbounded").start(grid, model)
    assert unbounded.accepted_nodes == 11 and unbounded.rates is not None
    assert unbounded.rates.equal_opportunity_difference().value >= 0.5

    capped = rate_audit(described, audit_id="capped").start(grid, model)
    assert_tpr_within_share(capped, positives, cap=4 * RATE_USERS)
    assert [(item.node_id, item.claimed_users) for item in capped.excluded] == [(LIAR, 12_000)]
    assert capped.max_users_per_node == 4 * RATE_USERS
    assert capped.to_dict()["excluded_nodes"][0]["cap"] == 4 * RATE_USERS

    grid, described, positives = rate_federation(tmp_path / "inside", claimed=1200, seed=5)
    inside = rate_audit(described, audit_id="inside").start(grid, model)
    assert inside.accepted_nodes == 11 and not inside.excluded
    assert_tpr_within_share(inside, positives, cap=1200)
    tpr = next(check for check in inside.influence if check.quantity.startswith("true"))
    assert tpr.flagged[:1] == (LIAR,) and tpr.largest_shift_node == LIAR, inside.summary()
    assert any(
        line.startswith("influence on the true positive rate")
        for line in inside.summary().splitlines()
    )


# --- the sequential audit ----------------------------------------------------------------------


@pytest.mark.usefixtures("task_identity")
def test_a_sequential_audit_leaves_out_a_node_over_the_cap_and_flags_one_inside(
    tmp_path: Path,
) -> None:
    """The sequential audit spreads each batch by the sizes the nodes reply (ten honest nodes
    of 300 users here): without a cap the liar's 9000 invented users fill three quarters of
    every batch and the largest gap comes out >= 0.5; with the default cap (1200) it is left
    out (none of its users asked), and a liar inside the cap (1200) is flagged by the
    influence check of the batch (one batch of 2000 users)."""
    mechanism = nprr_for_budget(2.0, 2)

    def run(claimed: int, cap: object, folder: str, seed: int):  # noqa: ANN202
        grid, _, truth = gap_federation(tmp_path / folder, claimed, seed, honest_users=300)
        sequential = SequentialLdpAudit(
            mechanism,
            budget=2.0,
            batch_size=2000,
            max_users=2000,
            target_width=0.01,
            seed=seed,
            audit_id=folder,
            max_users_per_node=cap,  # type: ignore[arg-type]
        )
        return sequential.start(grid, ArrayRecord()), truth

    unbounded, _ = run(9000, None, "unbounded", 6)
    assert unbounded.result is not None and unbounded.result.estimate >= 0.5
    assert unbounded.asked_by_node[LIAR] > 1000, unbounded.summary()

    capped, _ = run(9000, "auto", "capped", 7)
    assert capped.result is not None and capped.result.estimate <= 0.3, capped.summary()
    assert [(item.node_id, item.claimed_users) for item in capped.excluded] == [(LIAR, 9000)]
    assert LIAR not in capped.asked_by_node and capped.max_users_per_node == 1200
    assert capped.to_dict()["excluded_nodes"][0]["claimed_users"] == 9000

    inside, _ = run(1200, "auto", "inside", 8)
    assert not inside.excluded and inside.influence is not None
    assert inside.influence.flagged[:1] == (LIAR,), inside.summary()
