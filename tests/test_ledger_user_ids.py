"""Ledgers keyed by user id (security review 2026-11-26, finding L3).

The node's per-user ledger was indexed by position in the split's sorted user ids: a data file
whose ``split`` column gives the test rows and the training rows to different users made every
later release fail as "damaged" (another user count), and a user who joined shifted every
position. A ledger now names its users: each release is charged to the ids that took part,
new ids start at zero, users not in a release are untouched, composition is unchanged, and
the ledgers of older versions (by position) are still read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedparity.clients.app import app
from fedparity.clients.ledger import open_node_ledger, save_node_ledger
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.mechanisms.ldp.calibration import mechanism_for_budget
from fedparity.mechanisms.privacy.basic_ledger import LedgerFileError
from fedparity.mechanisms.privacy.user_ledger import (
    GapReportRelease,
    SubsampledGaussianRelease,
    UserLedger,
    compose,
)
from fedparity.strategies.ldp_audit import LdpGapAudit

pytestmark = pytest.mark.usefixtures("task_identity")

TIME = "2026-11-27T12:00:00+00:00"
DELTA = 1e-6
AUDIT = mechanism_for_budget("R", 1.0)


def audit(label: str = "accuracy") -> GapReportRelease:
    return GapReportRelease.from_mechanism(AUDIT, job="ldp_audit", label=label, time=TIME)


def training() -> SubsampledGaussianRelease:
    return SubsampledGaussianRelease(
        noise_multiplier=1.0, sample_rate=0.1, steps=20, delta=DELTA, job="fpfl", time=TIME
    )


# --- the ledger --------------------------------------------------------------------------------


def test_releases_are_charged_to_ids_and_new_ids_start_at_zero() -> None:
    ledger = UserLedger(10.0, DELTA, user_ids=[40, 7, 12])
    assert ledger.keyed and ledger.user_ids.tolist() == [7, 12, 40]
    ledger.charge(audit(), user_ids=[40, 12])
    assert ledger.add_users([12, 99, 3]) == 2  # 12 is known
    assert ledger.user_ids.tolist() == [3, 7, 12, 40, 99]
    ledger.charge(training(), user_ids=[7, 99])
    spent = dict(zip(ledger.user_ids.tolist(), ledger.epsilon_spent().tolist(), strict=True))
    assert spent[3] == 0.0  # new, in no release
    assert spent[12] == spent[40] == pytest.approx(compose([audit()], DELTA).epsilon)
    assert spent[7] == spent[99] == pytest.approx(compose([training()], DELTA).epsilon)
    # can_afford answers in the order asked
    tight = UserLedger(1.1, DELTA, user_ids=[1, 2])
    tight.charge(audit(), user_ids=[2])
    assert tight.can_afford(audit(), user_ids=[2, 1]).tolist() == [False, True]
    with pytest.raises(ValueError, match="user id 5 is not in this ledger"):
        tight.charge(audit(), user_ids=[5])


def test_composition_is_the_same_by_id_as_by_position() -> None:
    """Keying changes who is who, not what a user spent: the same participation gives the
    same totals (PLD and basic composition) by id and by position."""
    by_position = UserLedger(10.0, DELTA, 4)
    by_id = UserLedger(10.0, DELTA, user_ids=[10, 20, 30, 40])
    for mask in ([True, True, False, True], [False, True, True, False], [True] * 4):
        by_position.charge(audit(), np.array(mask))
        by_id.charge(audit(), user_ids=np.array([10, 20, 30, 40])[np.array(mask)])
    by_position.charge(training())
    by_id.charge(training(), user_ids=[10, 20, 30, 40])
    np.testing.assert_array_equal(by_position.epsilon_spent(), by_id.epsilon_spent())
    for user in range(4):
        assert by_position.total(user) == by_id.total(user)


def test_a_keyed_ledger_round_trips_and_an_older_fedparity_refuses_it(tmp_path: Path) -> None:
    ledger = UserLedger(10.0, DELTA, user_ids=[5, 9])
    ledger.charge(audit(), user_ids=[9])
    ledger.save(tmp_path / "keyed.json")
    data = json.loads((tmp_path / "keyed.json").read_text())
    assert data["version"] == 2 and data["user_ids"] == [5, 9]  # version 1 readers refuse it
    again = UserLedger.load(tmp_path / "keyed.json")
    assert again.user_ids.tolist() == [5, 9]
    np.testing.assert_array_equal(again.epsilon_spent(), ledger.epsilon_spent())
    # a ledger by position keeps the old format exactly: version 1, no ids
    UserLedger(10.0, DELTA, 2).save(tmp_path / "positional.json")
    old = json.loads((tmp_path / "positional.json").read_text())
    assert old["version"] == 1 and "user_ids" not in old
    for damage in ({"user_ids": [9, 5]}, {"user_ids": [5, 5]}, {"version": 1}):
        (tmp_path / "bad.json").write_text(json.dumps({**data, **damage}))
        with pytest.raises(LedgerFileError, match="damaged"):
            UserLedger.load(tmp_path / "bad.json")


def test_a_ledger_by_position_is_named_by_the_first_ids_or_refused(tmp_path: Path) -> None:
    """A ledger of an older fedparity: position i was the i-th smallest id of the node's users.
    Opened with as many ids it is named so (the spending stays with its users); with another
    number it cannot be named, and the node stops as it always did for another count."""
    old = UserLedger(10.0, DELTA, 3)
    old.charge(audit(), np.array([False, True, False]))
    old.save(tmp_path / "user-ledger.json")
    context = Context(1, 3, {}, RecordDict(), {})
    policy = NodePrivacyPolicy(user_epsilon_budget=10.0, user_delta=DELTA)
    named = open_node_ledger(
        context, tmp_path / "user-ledger.json", policy, 3, user_ids=[30, 10, 20]
    )
    assert named.keyed and named.user_ids.tolist() == [10, 20, 30]
    assert named.epsilon_spent()[1] > 0 and named.epsilon_spent()[[0, 2]].tolist() == [0, 0]
    with pytest.raises(LedgerFileError, match="holds 3 users by position .* this node has 2"):
        open_node_ledger(context, tmp_path / "user-ledger.json", policy, 2, user_ids=[1, 2])
    # a caller that passes a count still gets its ledger by position, as before
    assert open_node_ledger(context, tmp_path / "user-ledger.json", policy, 3).num_users == 3
    with pytest.raises(LedgerFileError, match="holds 3 users, this node has 4"):
        open_node_ledger(context, tmp_path / "user-ledger.json", policy, 4)


def test_the_run_state_ledger_is_keyed_too() -> None:
    """A simulated node without a ledger folder keeps its ledger in the run state: by id."""
    context = Context(1, 3, {}, RecordDict(), {})
    policy = NodePrivacyPolicy(user_epsilon_budget=10.0, user_delta=DELTA)
    ledger = open_node_ledger(context, None, policy, 2, user_ids=[4, 8])
    ledger.charge(audit(), user_ids=[4, 8])
    save_node_ledger(context, None, ledger)
    later = open_node_ledger(context, None, policy, 2, user_ids=[8, 15])
    assert later.user_ids.tolist() == [4, 8, 15]
    assert later.epsilon_spent().tolist()[2] == 0.0 and later.epsilon_spent()[0] > 0


# --- through the project's ClientApp on a data file with a split column ----------------------


def split_file(path: Path, train_users: list[int], test_users: list[int]) -> Path:
    """Rows of ``train_users`` in the train split and of ``test_users`` in the test split
    (each user: one group, a positive and a negative row)."""
    lines = ["user,group,label,split,x"]
    for split, users in (("train", train_users), ("test", test_users)):
        for user in users:
            lines += [f"{user},{user % 2},{label},{split},{0.1 * user + label}" for label in (0, 1)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def audit_through_the_app(context: Context) -> Message:
    message = LdpGapAudit(AUDIT, budget=AUDIT.epsilon).configure_audit(
        ArrayRecord(get_arrays(build_model(1, seed=0))), [context.node_id]
    )[0]
    message.metadata.__dict__["_message_id"] = "audit"
    return app(message, context)


def spent_by_user(path: Path) -> dict[int, int]:
    """How many releases each user of the ledger file took part in."""
    ledger = UserLedger.load(path)
    return {
        int(user): len(ledger.releases_of(position))
        for position, user in enumerate(ledger.user_ids.tolist())
    }


def test_audits_of_a_split_file_charge_the_test_users_and_later_releases_still_work(
    tmp_path: Path,
) -> None:
    """The review's failure: train users {1, 2, 3}, test users {3, 4}. On the reviewed main
    the first release sized the ledger by one split and every later release of the other
    stopped on "holds 2 users, this node has 3" (damaged). Now: two audits charge users 3
    and 4; a training charged by id (the call the FPFL handler makes with ids) charges 1, 2
    and 3; a third audit after user 5 joined the test split charges 3, 4 and 5, user 5 from
    zero; nobody else is touched."""
    file = split_file(tmp_path / "rows.csv", train_users=[1, 2, 3], test_users=[3, 4])
    ledgers = tmp_path / "ledgers"
    node_config = {"data-file": str(file), "num-groups": 2, "ledger-dir": str(ledgers)}
    ledger_file = ledgers / "ledger-partition-0.json"

    def context() -> Context:
        return Context(
            1, 5, {"partition-id": 0, "num-partitions": 1, **node_config}, RecordDict(), {}
        )

    for _ in range(2):
        reply = audit_through_the_app(context())
        assert reply.content.array_records["reports"]["groups"].numpy().size == 2
    assert spent_by_user(ledger_file) == {3: 2, 4: 2}

    train_ids = np.array([1, 2, 3])
    policy = NodePrivacyPolicy()
    node = context()
    ledger = open_node_ledger(node, ledger_file, policy, train_ids.size, user_ids=train_ids)
    ledger.charge(training(), user_ids=train_ids)
    save_node_ledger(node, ledger_file, ledger)
    assert spent_by_user(ledger_file) == {1: 1, 2: 1, 3: 3, 4: 2}

    split_file(file, train_users=[1, 2, 3], test_users=[3, 4, 5])
    reply = audit_through_the_app(context())
    assert reply.content.array_records["reports"]["groups"].numpy().size == 3
    assert spent_by_user(ledger_file) == {1: 1, 2: 1, 3: 4, 4: 3, 5: 1}
