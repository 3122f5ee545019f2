"""Replies that do not depend on the data (security review 2026-11-26, findings M2 and M3).

A refusal is a noiseless bit: if whether a node answers depends on its users' data, a server
learns that data by asking, uncharged and as often as it likes. Each attack below is the
review's demonstration, driven through the real handlers (the project's ClientApp object
``fedparity.clients.app.app`` on a node's own data file, and the library's LDP handler), with
the built-in node policy. Each succeeded on the reviewed main; each fails now.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedparity.clients.app import app
from fedparity.clients.ldp import NO_UNDEFINED_CATEGORY_REFUSAL, LocalUsers, ldp_audit_handler
from fedparity.clients.messages import INTERNAL_ERROR_TEXT, NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.project.own_data import (
    NUM_GROUPS_MISMATCH_REFUSAL,
    NUM_GROUPS_MISSING_REFUSAL,
    node_num_groups,
)
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.strategies.ldp_audit import LdpGapAudit

pytestmark = pytest.mark.usefixtures("task_identity")

NODE = 5
RUN_GROUPS = (2, 3, 4, 5)
ANSWERED = "answered"


def device_file(path: Path, group: int, labels: tuple[int, ...]) -> Path:
    """A device's own data file: one user (no user column), one feature."""
    rows = [f"{group},{label},{0.5 + i}" for i, label in enumerate(labels)]
    path.write_text("\n".join(["group,label,x", *rows]) + "\n", encoding="utf-8")
    return path


def device(node_config: dict[str, object], run_config: dict[str, object]) -> Context:
    return Context(
        run_id=1,
        node_id=NODE,
        node_config={"partition-id": 0, "num-partitions": 1, **node_config},
        state=RecordDict(),
        run_config=run_config,
    )


def send(message: Message, context: Context) -> str:
    """What the server reads: ``ANSWERED``, or the refusal's text."""
    message.metadata.__dict__["_message_id"] = f"message-{id(message)}"
    try:
        app(message, context)
    except NodeRefusal as refusal:
        return str(refusal)
    return ANSWERED


def describe_message() -> Message:
    return Message(content=RecordDict({}), dst_node_id=NODE, message_type="query.describe")


def audit_message(audit: LdpGapAudit) -> Message:
    arrays = ArrayRecord(get_arrays(build_model(1, seed=0)))
    return audit.configure_audit(arrays, [NODE])[0]


# --- M2: the undefined-metric refusal was a label bit ----------------------------------------


def test_a_tpr_audit_without_the_undefined_category_is_refused_by_every_device_alike(
    tmp_path: Path,
) -> None:
    """The review's demo: asked three times for TPR without the undefined category, the device
    whose user has no positive label refused every time with no ledger charge, the other
    answered and was charged 1, 2, 3 times: the refusal was the user's label. Now both refuse
    with one sentence, before their data is read, and neither ledger records anything."""
    files = {
        "no positive": device_file(tmp_path / "negative.csv", 0, (0, 0)),
        "a positive": device_file(tmp_path / "positive.csv", 0, (1, 0)),
    }
    attack = LdpGapAudit(
        RandomizedResponseMechanism(1.0, 1.0), budget=2.0, metric="tpr", undefined_category=False
    )
    answers: dict[str, list[str]] = {}
    for name, file in files.items():
        ledgers = tmp_path / f"ledgers-{name}"
        context = device(
            {"data-file": str(file), "num-groups": 2, "ledger-dir": str(ledgers)},
            {"task": "ldp-audit"},
        )
        answers[name] = [send(audit_message(attack), context) for _ in range(3)]
        assert not ledgers.exists() or not any(ledgers.iterdir()), "nothing was charged"
    assert answers["no positive"] == answers["a positive"] == [NO_UNDEFINED_CATEGORY_REFUSAL] * 3
    # the same for a device whose data file is gone: decided before any data is read
    gone = device(
        {"data-file": str(tmp_path / "absent.csv"), "num-groups": 2}, {"task": "ldp-audit"}
    )
    assert send(audit_message(attack), gone) == NO_UNDEFINED_CATEGORY_REFUSAL


def test_with_the_undefined_category_both_devices_report_and_are_charged_alike(
    tmp_path: Path,
) -> None:
    """The honest TPR audit carries the undefined category: the user without positives reports
    it (perturbed), the other reports its rate; both answer every time and their ledgers are
    charged the same, so neither the reply nor the spending tells the label."""
    files = {
        "no positive": device_file(tmp_path / "negative.csv", 0, (0, 0)),
        "a positive": device_file(tmp_path / "positive.csv", 0, (1, 0)),
    }
    audit = LdpGapAudit.for_budget("R", 2.0, num_groups=2, metric="tpr")
    spent = {}
    for name, file in files.items():
        ledgers = tmp_path / f"ledgers-{name}"
        context = device(
            {"data-file": str(file), "num-groups": 2, "ledger-dir": str(ledgers)},
            {"task": "ldp-audit"},
        )
        message = audit_message(audit)
        message.metadata.__dict__["_message_id"] = "audit"
        for _ in range(3):
            reply = app(message, context)
            assert reply.content.array_records["reports"]["groups"].numpy().size == 1
            assert set(reply.content.metric_records["metrics"]) == {"epsilon-charged"}
        ledger = UserLedger.load(ledgers / "ledger-partition-0.json")
        assert len(ledger.releases) == 3
        spent[name] = ledger.epsilon_spent()
    np.testing.assert_array_equal(spent["no positive"], spent["a positive"])


def test_an_accuracy_nobody_defined_is_replaced_by_a_random_value_not_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Accuracy should always be defined; a user's function that returns NaN for a user must
    not change whether the node replies (on the reviewed main it refused: the same label-bit
    channel as TPR). That user now reports like everyone else, the node logs how many."""
    audit = LdpGapAudit(RandomizedResponseMechanism(1.0, 1.0), budget=2.0, metric="accuracy")
    policy = NodePrivacyPolicy()
    replies = {}
    for name, metric in (("undefined", np.nan), ("defined", 0.7)):
        handler = ldp_audit_handler(
            lambda *_, m=metric: LocalUsers(np.zeros(1, dtype=np.int64), np.array([m])),
            num_groups=2,
            policy=policy,
            ledger_path=lambda _, n=name: tmp_path / f"{n}.json",
        )
        with caplog.at_level(logging.WARNING):
            replies[name] = handler(audit_message(audit), device({}, {}))
    for name, reply in replies.items():
        assert reply.content.array_records["reports"]["groups"].numpy().size == 1
        assert set(reply.content.metric_records["metrics"]) == {"epsilon-charged"}
        assert len(UserLedger.load(tmp_path / f"{name}.json").releases) == 1
    assert "undefined (NaN) for 1 user(s)" in caplog.text


def test_users_with_an_undefined_accuracy_report_a_uniform_value_statistically(
    tmp_path: Path,
) -> None:
    """20,000 users whose accuracy is NaN report through M_R: E[report] = a (2b - 1) E[v] with
    v = 2m - 1, so a uniform m in [0, 1] gives mean 0 (within 4.5 standard errors), while a
    fixed replacement such as m = 0 would sit a (2b - 1) away, more than 40 standard errors."""
    mechanism = RandomizedResponseMechanism(1.0, 1.0)
    users = 20_000
    handler = ldp_audit_handler(
        lambda *_: LocalUsers(np.zeros(users, dtype=np.int64), np.full(users, np.nan)),
        num_groups=2,
        policy=NodePrivacyPolicy(),
        ledger_path=lambda _: tmp_path / "ledger.json",
    )
    audit = LdpGapAudit(mechanism, budget=mechanism.epsilon, metric="accuracy")
    reply = handler(audit_message(audit), device({}, {}))
    values = reply.content.array_records["reports"]["values"].numpy().astype(np.float64)
    assert values.size == users
    standard_error = values.std() / math.sqrt(users)
    assert abs(values.mean()) < 4.5 * standard_error
    gain = mechanism.group_keep_probability * (2 * mechanism.value_keep_probability - 1)
    assert gain > 40 * standard_error  # the test would see a fixed replacement


# --- M3: num-groups from the run config was a group oracle ------------------------------------


def answers_over_runs(node_config: dict[str, object]) -> list[str]:
    """The review's demo: runs with num-groups 2..5, each a ``describe`` for an LDP audit and
    for FPFL, and an LDP audit; what the server reads for each."""
    answers = []
    for groups in RUN_GROUPS:
        for task in ("ldp-audit", "fpfl"):
            context = device(node_config, {"task": task, "num-groups": groups})
            answers.append(send(describe_message(), context))
        audit = LdpGapAudit.for_budget("R", 2.0, num_groups=groups, metric="accuracy")
        context = device(
            {**node_config, "ledger-dir": f"{node_config['data-file']}-ledgers"},
            {"task": "ldp-audit", "num-groups": groups},
        )
        answers.append(send(audit_message(audit), context))
    return answers


def test_a_node_without_its_own_num_groups_gives_every_run_the_same_refusal(
    tmp_path: Path,
) -> None:
    """On the reviewed main, runs with num-groups 2, 3, 4, 5 against a one-user file with group
    3 were refused, refused, answered, answered: the user's protected group is 3. A node whose
    config names a data file but no num-groups now refuses every run and job with one
    sentence, whatever the file holds, and also when the file is absent."""
    expected = [NUM_GROUPS_MISSING_REFUSAL] * (3 * len(RUN_GROUPS))
    for name, group in (("three", 3), ("zero", 0)):
        file = device_file(tmp_path / f"{name}.csv", group, (1, 0))
        assert answers_over_runs({"data-file": str(file)}) == expected
    assert answers_over_runs({"data-file": str(tmp_path / "absent.csv")}) == expected


def test_the_runs_a_node_answers_depend_on_its_config_not_on_its_users_group(
    tmp_path: Path,
) -> None:
    """A node that states num-groups = 4 answers the runs with 4 groups and refuses the others
    with one sentence, decided before the file is read (the same with the file absent): the
    pattern is the same whichever group its user is in."""
    refused = [NUM_GROUPS_MISMATCH_REFUSAL] * 3
    expected = [*refused, *refused, ANSWERED, ANSWERED, ANSWERED, *refused]  # runs 2, 3, 4, 5
    for group in range(4):
        file = device_file(tmp_path / f"group-{group}.csv", group, (1, 0))
        assert answers_over_runs({"data-file": str(file), "num-groups": 4}) == expected, group
    absent = answers_over_runs({"data-file": str(tmp_path / "absent.csv"), "num-groups": 4})
    assert absent[:6] == refused * 2 and absent[9:] == refused
    assert absent[6:9] == [INTERNAL_ERROR_TEXT] * 3  # run 4 reads the file: it is gone


def test_a_group_beyond_the_nodes_own_num_groups_is_the_operators_error(tmp_path: Path) -> None:
    """A file whose user is in group 3 on a node stating num-groups = 2: the run with 2 groups
    reads the file and stops on the node's DataFileError (its log names file and column; the
    server reads the fixed internal sentence), the others are refused before it is read. The
    server can no longer move the threshold."""
    file = device_file(tmp_path / "three.csv", 3, (1, 0))
    answers = answers_over_runs({"data-file": str(file), "num-groups": 2})
    assert answers[:3] == [INTERNAL_ERROR_TEXT] * 3
    assert answers[3:] == [NUM_GROUPS_MISMATCH_REFUSAL] * 9


@pytest.mark.parametrize("value", [None, "", "two", 1, 1.5, True, 1025, -3])
def test_a_missing_or_invalid_node_num_groups_is_refused(value: object) -> None:
    config = {"data-file": "/data/rows.csv"} | ({} if value is None else {"num-groups": value})
    with pytest.raises(NodeRefusal) as refused:
        node_num_groups(config)
    assert str(refused.value) == NUM_GROUPS_MISSING_REFUSAL
    assert "num-groups" in NUM_GROUPS_MISSING_REFUSAL and "[2, 1024]" in NUM_GROUPS_MISSING_REFUSAL


def test_node_num_groups_reads_integers_as_flower_passes_them() -> None:
    assert node_num_groups({"num-groups": 3}) == 3
    assert node_num_groups({"num-groups": 3.0}) == 3
    assert node_num_groups({"num-groups": "4"}) == 4
