"""One per-user privacy ledger per node, charged by its LDP audit and FPFL handlers
(clients/ledger.py): real handlers, real ledger files, totals checked against ``compose`` of
the releases built here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedparity.clients.fpfl_handlers import FPFL_LEDGER_REFUSAL
from fedparity.clients.fpfl_node import node_workload
from fedparity.clients.ldp import LocalUsers, ldp_audit_handler
from fedparity.clients.ledger import MIGRATED_SUFFIX
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms.ldp.calibration import mechanism_for_budget
from fedparity.mechanisms.privacy.basic_ledger import ShardLedger, ledger_marker
from fedparity.mechanisms.privacy.user_ledger import (
    NEIGHBOURING,
    ApproximateDPRelease,
    GapReportRelease,
    SubsampledGaussianRelease,
    UserLedger,
    compose,
)
from fedparity.mechanisms.protocol import (
    EPSILON_SPENT_BASIC_DELTA_KEY,
    EPSILON_SPENT_BASIC_KEY,
    EPSILON_SPENT_DELTA_KEY,
    EPSILON_SPENT_KEY,
    LEDGER_NEW_KEY,
    METRICS_KEY,
)
from fedparity.server.api import run_simulation_job
from fedparity.strategies.ldp_audit import LdpGapAudit
from tests.support.fpfl_nodes import (
    POPULATION,
    PRIVATE_TRAINING,
    SMALL_FPFL,
    USERS,
    MaskingNodes,
    roster_identities,
)
from tests.support.fpfl_nodes import node_users as fpfl_users

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = [3, 4, 5]
USER_DELTA = 1e-6
#: A private FPFL training under masking and distributed noise (the built-in policy's rules).
TRAINING = PRIVATE_TRAINING
#: Five audits at epsilon 0.25 after the training: where the PLD's gain over basic
#: composition is clear (about 1.89 against 2.35 at these parameters).
AUDIT = mechanism_for_budget("R", 0.25)
AUDITS = 5


def training_release(budget: float | None = None) -> SubsampledGaussianRelease:
    """The release a node of :data:`TRAINING` charges, built here from public parameters:
    with ``budget`` (the users' epsilon budget), the chance that a round's cohort outgrew the
    node's fixed workload, which that budget sizes (``fpfl_node.node_workload``)."""
    tail = 0.0
    if budget is not None:
        workload = node_workload(
            fpfl_users(),
            TRAINING.cohort_size / POPULATION,
            TRAINING.rounds,
            user_epsilon_budget=budget,
            user_delta=USER_DELTA,
        )
        tail = TRAINING.rounds * workload.tail_probability
    return SubsampledGaussianRelease(
        noise_multiplier=TRAINING.noise_multiplier(POPULATION),
        sample_rate=TRAINING.cohort_size / POPULATION,
        steps=TRAINING.rounds,
        delta=1e-6,
        timing_tail_probability=tail,
        job="fpfl",
    )


def audit_release() -> GapReportRelease:
    return GapReportRelease.from_mechanism(AUDIT, job="ldp_audit")


def node_users(_: ArrayRecord, __: str, ___: Context) -> LocalUsers:
    """The same USERS users as the FPFL nodes' shard (one ledger for both)."""
    rng = np.random.default_rng(4)
    return LocalUsers(rng.integers(0, 2, size=USERS), rng.uniform(size=USERS))


def audit_message(node: int = 3) -> Message:
    arrays = ArrayRecord({"w": Array(np.zeros(1))})
    return LdpGapAudit(AUDIT, budget=AUDIT.epsilon).configure_audit(arrays, [node])[0]


def train_then_audit(
    tmp_path: Path, budget: float
) -> tuple[Message, list[Message], MaskingNodes, NodePrivacyPolicy]:
    """A whole private training of node 3 among three nodes (charged block by block; the reply
    of its last round is returned), then :data:`AUDITS` audits of node 3 through its LDP
    handler, on the same ledger."""
    policy = NodePrivacyPolicy(user_epsilon_budget=budget, user_delta=USER_DELTA)
    nodes = MaskingNodes(
        NODES,
        TRAINING,
        policy=policy,
        identities=roster_identities(NODES),
        node_config={node: {"ledger-dir": str(tmp_path / f"node-{node}")} for node in NODES},
    )
    nodes.setup()
    nodes.pin()
    for round_number in range(1, TRAINING.rounds + 1):
        round_reply = nodes.send("fpfl_round", 3, nodes.round_message(round_number))
    handler = ldp_audit_handler(node_users, num_groups=2, policy=policy)
    audit_replies = [handler(audit_message(), nodes.contexts[3]) for _ in range(AUDITS)]
    return round_reply, audit_replies, nodes, policy


def _ledger_context(ledger_dir: Path) -> Context:
    """A node's context whose node config keeps its ledger in ``ledger_dir``."""
    return Context(
        run_id=1,
        node_id=3,
        node_config={"ledger-dir": str(ledger_dir)},
        state=RecordDict(),
        run_config={},
    )


def test_a_node_that_trained_and_audits_is_charged_both_and_pld_allows_what_basic_refuses(
    tmp_path: Path,
) -> None:
    training, audit = training_release(), audit_release()
    both = compose([training] + [audit] * AUDITS, USER_DELTA)
    basic = training.basic_epsilon + AUDITS * audit.basic_epsilon  # each at its delta, summed
    assert both.epsilon < basic - 0.3  # the PLD's gain is real at these parameters
    budget = (both.epsilon + basic) / 2  # PLD within it, basic composition past it
    training = training_release(budget)
    both = compose([training] + [audit] * AUDITS, USER_DELTA)
    round_reply, audit_replies, _, _ = train_then_audit(tmp_path, budget)
    audit_reply = audit_replies[-1]

    # the round reply carries the ledger's totals after the training alone
    alone = compose([training], USER_DELTA)
    sent = round_reply.content.metric_records[METRICS_KEY]
    assert sent[EPSILON_SPENT_KEY] == pytest.approx(alone.epsilon, rel=1e-9)
    assert sent[EPSILON_SPENT_DELTA_KEY] == USER_DELTA
    assert sent[EPSILON_SPENT_BASIC_KEY] == pytest.approx(training.basic_epsilon, rel=1e-9)
    assert sent[EPSILON_SPENT_BASIC_DELTA_KEY] == pytest.approx(alone.basic_delta, rel=1e-9)
    # the training is the first release of the node's new ledger file: said once, not after
    assert sent[LEDGER_NEW_KEY] == 1
    assert all(
        LEDGER_NEW_KEY not in reply.content.metric_records[METRICS_KEY] for reply in audit_replies
    )
    # every user answered every audit, and the totals are the composition of all releases
    for reply in audit_replies:
        assert reply.content.metric_records[METRICS_KEY]["num-reports"] == USERS
    metrics = audit_reply.content.metric_records[METRICS_KEY]
    assert metrics["num-reports"] == USERS and metrics["num-refused"] == 0
    assert metrics[EPSILON_SPENT_KEY] == pytest.approx(both.epsilon, rel=1e-9)
    assert metrics[EPSILON_SPENT_BASIC_KEY] == pytest.approx(both.basic_epsilon, rel=1e-9)
    ledger = UserLedger.load(tmp_path / "node-3" / "user-ledger.json", USERS)
    assert [release.kind for release in ledger.releases] == [training.kind] + [audit.kind] * 5
    assert all(ledger.participants(i).all() for i in range(6))  # sampled or not: everyone
    np.testing.assert_allclose(ledger.epsilon_spent(), both.epsilon, rtol=1e-9)
    # what the server keeps is the same, with the relation it holds under
    outcome = LdpGapAudit(AUDIT, budget=AUDIT.epsilon).aggregate_audit([3], [audit_reply])
    assert outcome.ledger_totals is not None
    assert outcome.ledger_totals.epsilon == pytest.approx(both.epsilon, rel=1e-9)
    assert outcome.ledger_totals.basic_epsilon == pytest.approx(both.basic_epsilon, rel=1e-9)
    assert outcome.ledger_totals.neighbouring == NEIGHBOURING


def test_an_audit_that_would_pass_the_composed_budget_is_refused_by_both(tmp_path: Path) -> None:
    training, audit = training_release(), audit_release()
    all_audits = compose([training] + [audit] * AUDITS, USER_DELTA)
    budget = all_audits.epsilon - 0.05  # the training and 4 audits fit, the fifth does not
    four = compose([training_release(budget)] + [audit] * (AUDITS - 1), USER_DELTA)
    assert four.epsilon < budget < all_audits.basic_epsilon  # both accountants refuse it
    _, audit_replies, _, _ = train_then_audit(tmp_path, budget)
    answered = [r.content.metric_records[METRICS_KEY]["num-reports"] for r in audit_replies]
    assert answered == [USERS] * (AUDITS - 1) + [0]
    audit_reply = audit_replies[-1]
    metrics = audit_reply.content.metric_records[METRICS_KEY]
    assert metrics["num-reports"] == 0 and metrics["num-refused"] == USERS
    assert audit_reply.content.array_records["reports"]["groups"].numpy().size == 0
    ledger = UserLedger.load(tmp_path / "node-3" / "user-ledger.json", USERS)
    assert len(ledger.releases) == AUDITS  # the refused audit left the ledger unchanged
    assert metrics[EPSILON_SPENT_KEY] == pytest.approx(four.epsilon, rel=1e-9)


def test_a_node_whose_users_cannot_afford_the_training_refuses_the_run(tmp_path: Path) -> None:
    training = training_release()
    budget = compose([training], USER_DELTA).epsilon - 0.1
    policy = NodePrivacyPolicy(user_epsilon_budget=budget, user_delta=USER_DELTA)
    folder = tmp_path / "node-3"
    nodes = MaskingNodes(
        NODES,
        TRAINING,
        policy=policy,
        identities=roster_identities(NODES),
        node_config={3: {"ledger-dir": str(folder)}},
    )
    nodes.setup()
    nodes.pin()
    for _ in range(2):  # refused again at the next round: nothing was counted
        with pytest.raises(NodeRefusal) as refused:
            nodes.send("fpfl_round", 3, nodes.round_message(1))
        assert str(refused.value) == FPFL_LEDGER_REFUSAL  # a fixed sentence, no value
    assert not (folder / "user-ledger.json").exists()  # nothing charged, nothing released
    # an audit still fits in the budget
    reply = ldp_audit_handler(node_users, num_groups=2, policy=policy)(
        audit_message(), nodes.contexts[3]
    )
    assert reply.content.metric_records[METRICS_KEY]["num-reports"] == USERS


def test_a_basic_composition_ledger_is_migrated_once_and_kept(tmp_path: Path) -> None:
    old = tmp_path / "ldp-ledger.npz"
    spent = np.array([0.0, 1.5, 1.5, 3.9] + [0.5] * (USERS - 4))
    ShardLedger(4.0, USERS, spent).save(old)
    policy = NodePrivacyPolicy(user_epsilon_budget=10.0, user_delta=USER_DELTA)
    handler = ldp_audit_handler(node_users, num_groups=2, policy=policy)
    context = _ledger_context(tmp_path)
    reply = handler(audit_message(), context)

    assert not old.exists() and (tmp_path / ("ldp-ledger.npz" + MIGRATED_SUFFIX)).is_file()
    migrated = UserLedger.load(tmp_path / "user-ledger.json", USERS)
    assert migrated.budget == 4.0  # the stored (lower) budget is kept
    assert ledger_marker(tmp_path / "user-ledger.json").is_file()
    audit = audit_release()
    # each user's old spending is one pure release, then the audit (for those who could)
    for user, before in enumerate(spent):
        kinds = [migrated.releases[i].kind for i in migrated.releases_of(user)]
        expected = ([ApproximateDPRelease.kind] if before else []) + (
            [audit.kind] if before + audit.epsilon <= 4.0 else []
        )
        assert kinds == expected
        releases = [ApproximateDPRelease(epsilon=before, job="t")] if before else []
        if audit.kind in kinds:
            releases.append(audit)
        assert migrated.total(user).epsilon == pytest.approx(
            compose(releases, USER_DELTA).epsilon if releases else 0.0, rel=1e-9
        )
    # user 3 (3.9 spent + 0.25 > 4) refused: nothing else did
    assert reply.content.metric_records[METRICS_KEY]["num-refused"] == 1
    # a second release reads the new ledger, not the kept old file
    handler(audit_message(), context)
    assert (
        len(UserLedger.load(tmp_path / "user-ledger.json", USERS).releases)
        == len(migrated.releases) + 1
    )


def test_a_damaged_old_ledger_is_not_silently_replaced(tmp_path: Path) -> None:
    (tmp_path / "ldp-ledger.npz").write_bytes(b"PK\x03\x04 truncated")
    handler = ldp_audit_handler(node_users, num_groups=2, policy=NodePrivacyPolicy())
    context = _ledger_context(tmp_path)
    with pytest.raises(NodeRefusal, match="privacy ledger is lost or damaged"):
        handler(audit_message(), context)
    assert not (tmp_path / "user-ledger.json").exists()


# --- results.json of the jobs (real Flower simulation) --------------------------------------


@pytest.mark.slow
def test_the_fpfl_job_reports_the_nodes_ledger_totals(tmp_path: Path) -> None:
    results = run_simulation_job({**SMALL_FPFL, "output-dir": str(tmp_path)}, num_supernodes=3)
    privacy = results["privacy"]
    training = SubsampledGaussianRelease(
        noise_multiplier=results["noise_multiplier"],
        sample_rate=privacy["sample_rate"],
        steps=SMALL_FPFL["fpfl-rounds"],
        delta=results["delta"],
        job="fpfl",
    )
    expected = compose([training], NodePrivacyPolicy.simulation().user_delta)
    totals = privacy["ledger_totals_reported_by_nodes"]
    assert totals["epsilon"] == pytest.approx(expected.epsilon, rel=1e-6)
    assert totals["delta"] == expected.delta
    assert totals["basic_epsilon"] == pytest.approx(expected.basic_epsilon, rel=1e-6)
    assert totals["basic_delta"] == pytest.approx(expected.basic_delta, rel=1e-9)
    assert totals["neighbouring"] == NEIGHBOURING
    # node by node, the same (equal shards); simulated nodes keep their ledgers in the run
    # state, so no ledger file is new
    by_node = privacy["ledger_totals_by_node"]
    assert len(by_node) == 3
    assert all(entry["epsilon"] == pytest.approx(expected.epsilon) for entry in by_node.values())
    assert privacy["new_ledger_nodes"] == []
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "privacy spent per user over every release the nodes" in report


@pytest.mark.slow
def test_the_ldp_job_reports_the_nodes_ledger_totals(tmp_path: Path) -> None:
    results = run_simulation_job(
        {
            "output-dir": str(tmp_path),
            "users-per-node": 50,
            "num-server-rounds": 1,
            "epsilons": "1,2",
        },
        num_supernodes=2,
    )
    audits = results["audits"]
    assert all(audit["refused_users"] == 0 for audit in audits)
    # each report is charged at its mechanism's true epsilon (the run record lists them)
    from fedparity.server.run_record import read_status

    charged = [item["epsilon"] for item in read_status(tmp_path)["releases"]]  # type: ignore[index]
    releases = [ApproximateDPRelease(epsilon=epsilon, job="t") for epsilon in charged]
    expected = compose(releases, NodePrivacyPolicy.simulation().user_delta)
    totals = results["privacy"]["ledger_totals_reported_by_nodes"]
    assert totals["epsilon"] == pytest.approx(expected.epsilon, rel=1e-6)
    assert totals["basic_epsilon"] == pytest.approx(math.fsum(charged), rel=1e-9)
    assert totals["basic_delta"] == 0.0 and totals["neighbouring"] == NEIGHBOURING
    assert results["privacy"]["epsilon_spent_total_max_reported_by_nodes"] == totals["epsilon"]


def test_round_replies_of_a_small_node_carry_no_totals(tmp_path: Path) -> None:
    policy = NodePrivacyPolicy(user_epsilon_budget=50.0, min_users_for_counts=USERS + 1)
    nodes = MaskingNodes(
        NODES,
        TRAINING,
        policy=policy,
        identities=roster_identities(NODES),
        node_config={3: {"ledger-dir": str(tmp_path)}},
    )
    nodes.setup()
    nodes.pin()
    reply = nodes.send("fpfl_round", 3, nodes.round_message(1))
    assert METRICS_KEY not in reply.content.metric_records
    assert len(UserLedger.load(tmp_path / "user-ledger.json", USERS).releases) == 1  # charged
