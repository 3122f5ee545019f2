"""Hostile input, fuzzed (hypothesis): whatever a server sends a node, whatever a node replies
to the server, whatever a user types on the command line.

The outcome is always a refusal (the node raises one of the errors Flower turns into an error
reply, with a message), a counted rejection (the server), or exit status 2 with a message (the
CLI) -- never an unexpected exception, and never a release beyond what the node's policy and
the message's own (valid) parameters allow.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from fedparity.clients import FPFLNodeSettings, FPFLShard, LocalUsers, fpfl_handlers
from fedparity.clients.ldp import ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.mechanisms import RandomizedResponseMechanism, build_mechanism
from fedparity.mechanisms.ldp.laplace import LaplaceMechanism
from fedparity.mechanisms.ldp.nprr import NPRRMechanism
from fedparity.mechanisms.ldp.piecewise import PiecewiseMechanism
from fedparity.mechanisms.protocol import FPFL_KEY, METRICS_KEY, REPORTS_KEY
from fedparity.strategies.ldp_audit import LdpGapAudit
from tests.support.fixtures import run_cli
from tests.support.fpfl_nodes import MaskingNodes

if TYPE_CHECKING:
    from fedparity.mechanisms.crypto.ckks import KeyPaths

pytestmark = pytest.mark.usefixtures("task_identity")

#: What a node may raise for a message it refuses (Flower turns it into an error reply).
REFUSALS = (ValueError, TypeError, KeyError, PolicyRefusal, NodeRefusal)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

#: Values a ConfigRecord can carry (and a few it cannot, which Flower itself refuses).
scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.booleans(),
    st.binary(max_size=40),
)
config_values = st.one_of(
    scalars,
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=6),
    st.lists(st.binary(max_size=40), max_size=4),
)


def mutate(valid: dict[str, object], data: st.DataObject) -> dict[str, object]:
    """A copy of ``valid`` with some keys dropped, replaced by hostile values, or added."""
    mutated = dict(valid)
    for key in list(valid):
        action = data.draw(st.sampled_from(["keep", "keep", "drop", "replace"]), label=key)
        if action == "drop":
            del mutated[key]
        elif action == "replace":
            mutated[key] = data.draw(config_values, label=f"{key} value")
    if data.draw(st.booleans(), label="extra key"):
        mutated[data.draw(st.text(min_size=1, max_size=8), label="key")] = data.draw(config_values)
    return mutated


def config_record(values: dict[str, object]) -> ConfigRecord:
    try:
        return ConfigRecord(values)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a value Flower cannot carry never reaches a node
        assume(False)
        raise


def context_for(node_config: dict[str, object], node_id: int = 3) -> Context:
    return Context(
        run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config={}
    )


# --- the LDP audit on a node ---------------------------------------------------------------------

USERS = LocalUsers(np.arange(40) % 2, np.linspace(0.0, 1.0, 40))


@FUZZ
@given(data=st.data())
def test_a_node_refuses_or_answers_within_its_policy_any_audit_message(
    data: st.DataObject,
) -> None:
    mechanism = data.draw(
        st.sampled_from(
            [
                RandomizedResponseMechanism(0.5, 1.0),
                LaplaceMechanism(0.5, 1.0),
                PiecewiseMechanism(0.5, 1.0),
                NPRRMechanism(0.5, 1.0, 2, 4),
            ]
        )
    )
    valid = LdpGapAudit(mechanism, budget=mechanism.epsilon).audit_config()
    config = config_record(mutate(dict(valid), data))
    arrays = ArrayRecord({"w": Array(np.zeros(1))})
    message = Message(
        RecordDict({"arrays": arrays, "config": config}),
        dst_node_id=3,
        message_type="query.ldp_audit",
    )
    policy = NodePrivacyPolicy(ldp_max_epsilon=2.0, user_epsilon_budget=3.0)
    handler = ldp_audit_handler(lambda *_: USERS, num_groups=2, policy=policy)
    with tempfile.TemporaryDirectory() as ledger_dir:
        try:
            reply = handler(message, context_for({"ledger-dir": ledger_dir}))
        except REFUSALS as refusal:
            event(f"refused: {type(refusal).__name__}")
            assert str(refusal)
            return
    event("answered")
    # Answered: the message was an audit the node could rebuild, within its policy.
    released = build_mechanism(
        str(config["mechanism"]),  # type: ignore[arg-type]
        float(config["epsilon-group"]),  # type: ignore[arg-type]
        float(config["epsilon-value"]),  # type: ignore[arg-type]
        int(config["num-groups"]),  # type: ignore[arg-type]
        int(config["grid-size"]) if config["mechanism"] == "N" else 1,  # type: ignore[arg-type]
    )
    charged = reply.content.metric_records[METRICS_KEY]["epsilon-charged"]
    assert charged == pytest.approx(released.epsilon) and charged <= policy.ldp_max_epsilon
    reports = reply.content.array_records[REPORTS_KEY]
    groups, values = reports["groups"].numpy(), reports["values"].numpy()
    assert set(reports) == {"groups", "values"} and groups.size <= USERS.num_users
    assert np.all((groups >= 0) & (groups < 2)) and np.all(released.is_valid_report_value(values))


# --- FPFL on a node ----------------------------------------------------------------------------


def make_model():  # noqa: ANN201
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 1), nn.Sigmoid())


def node_users(_: Context | None = None) -> FPFLShard:
    rng = np.random.default_rng(2)
    return FPFLShard(
        features=rng.normal(size=(20, 2)).astype(np.float32),
        labels=rng.integers(0, 2, size=20).astype(np.int64),
        groups=(np.arange(20) % 2).astype(np.int64),
        user_index=(np.arange(20) // 2).astype(np.int64),
        user_ids=np.arange(10, dtype=np.int64),
        num_groups=2,
        num_classes=2,
    )


SETTINGS = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=5,
    rounds=3,
    clipping_bound=1.0,
    epsilon=2.0,
    delta=1e-4,
    dropout_tolerance=0.25,  # 4 members: n_min = 3
)


SALT = b"s" * 16


def pinned_nodes() -> MaskingNodes:
    """Nodes 3-6 with their keys pinned; node 3 is the one under test."""
    nodes = MaskingNodes(
        [3, 4, 5, 6], SETTINGS, policy=NodePrivacyPolicy(min_survivors=3, require_roster=False)
    )
    nodes.setup()
    nodes.pin()
    return nodes


@FUZZ
@given(data=st.data())
def test_an_fpfl_node_refuses_or_sends_only_a_masked_sum_for_any_round_message(
    data: st.DataObject,
) -> None:
    nodes = pinned_nodes()
    valid = {"round": 1, "run-digest": nodes.run_digest}
    config = config_record(mutate(valid, data))
    weights = nodes.weights
    weight_choice = data.draw(st.sampled_from(["valid", "short", "nan", "text"]))
    sent = {
        "valid": weights,
        "short": weights[:2],
        "nan": np.full_like(weights, np.nan),
        "text": np.array(["x"] * weights.size),
    }[weight_choice]
    content = RecordDict({FPFL_KEY: ArrayRecord({"weights": Array(sent)}), "config": config})
    try:
        reply = nodes.send("fpfl_round", 3, content)
    except REFUSALS as refusal:
        event(f"refused: {type(refusal).__name__}")
        assert str(refusal)
        return
    event("answered")
    # Answered: the node's policy requires masking, so what leaves it is a masked vector
    # and sealed shares, for pinned members only.
    record = reply.content.array_records[FPFL_KEY]
    assert set(record) == {"masked"}
    assert record["masked"].numpy().dtype == np.uint64
    recipients = set(reply.content.config_records["shares"]["recipients"])  # type: ignore[arg-type]
    assert recipients <= {4, 5, 6}


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_an_fpfl_node_refuses_any_reveal_it_should_not_give(data: st.DataObject) -> None:
    nodes = pinned_nodes()
    replies = nodes.round(1, nodes=[3, 4, 5])
    attestations = nodes.attest(1, [3, 4, 5], [6])
    valid = dict(nodes.unmask_content(1, 3, [3, 4, 5], [6], replies.sealed, attestations)[FPFL_KEY])
    config = config_record(mutate(valid, data))
    try:
        reply = nodes.send("fpfl_reveal", 3, RecordDict({FPFL_KEY: config}))
    except REFUSALS as refusal:
        event(f"refused: {type(refusal).__name__}")
        assert str(refusal)
        return
    event("revealed")
    # Revealed: only the round's true split, with at least min-survivors survivors, this node
    # one; seeds only for dropped nodes and shares only of survivors.
    survivors = [int(n) for n in config["survivors"]]  # type: ignore[union-attr]
    record = reply.content.config_records[FPFL_KEY]
    revealed = [int(n) for n in record["dropped"]]  # type: ignore[union-attr]
    owners = [int(n) for n in record["share-owners"]]  # type: ignore[union-attr]
    assert len(set(survivors)) >= 3 and 3 in survivors
    assert not set(revealed) & set(survivors) and set(owners) == set(survivors)


# --- the server: any reply to an audit is accepted or counted as rejected -----------------------


def _cast(values: list[float], dtype: type) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # nan/inf cast to integers on purpose
        return np.asarray(values).astype(dtype)


arrays_strategy = st.one_of(
    st.builds(
        _cast,
        st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=8),
        st.sampled_from([np.float64, np.float32, np.int64, np.int8, np.uint8, np.bool_]),
    ),
    st.builds(lambda n: np.zeros((n, 2)), st.integers(0, 3)),
)
metric_values = st.one_of(
    st.integers(-(2**62), 2**62), st.floats(allow_nan=True, allow_infinity=True)
)


@FUZZ
@given(data=st.data())
def test_the_server_counts_every_malformed_audit_reply_and_never_fails(
    data: st.DataObject,
) -> None:
    mechanism = data.draw(
        st.sampled_from(
            [
                RandomizedResponseMechanism(0.5, 1.0),
                LaplaceMechanism(0.5, 1.0),
                PiecewiseMechanism(0.5, 1.0),
                NPRRMechanism(0.5, 1.0, 2, 4),
            ]
        )
    )
    audit = LdpGapAudit(mechanism, budget=mechanism.epsilon, users_by_node={1: 50, 2: 50})
    replies = []
    for node in (1, 2):
        content = RecordDict()
        if data.draw(st.booleans(), label="reports"):
            record = {}
            for key in ("groups", "values"):
                if data.draw(st.booleans(), label=f"has {key}"):
                    record[key] = Array(data.draw(arrays_strategy, label=key))
            content[REPORTS_KEY] = ArrayRecord(record)
        if data.draw(st.booleans(), label="metrics"):
            keys = st.sampled_from(["num-reports", "num-refused", "num-undefined", "x"])
            content[METRICS_KEY] = MetricRecord(
                data.draw(st.dictionaries(keys, metric_values, max_size=4))
            )
        message = Message(RecordDict(), dst_node_id=node, message_type="query.ldp_audit")
        replies.append(Message(content, reply_to=message))  # from the node that was asked
    outcome = audit.aggregate_audit([1, 2], replies)
    event(f"accepted {outcome.accepted_nodes}")
    assert outcome.accepted_nodes + len(outcome.rejected) == 2
    assert all(item.reason for item in outcome.rejected)


# --- the command line --------------------------------------------------------------------------

numbers = st.one_of(
    st.sampled_from(["1e-300", "1e300", "nan", "inf", "-1", "0", "1", "0.5", "abc", "", "3"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**20), 10**20).map(str),
)


@st.composite
def cli_arguments(draw: st.DrawFn, tmp: Path) -> list[str]:
    command = draw(st.sampled_from(["privacy", "plan", "measure", "fairtest"]))
    options = {
        "privacy": ["--mechanism", "--eps1", "--eps2", "--groups", "--k", "--grid"],
        "plan": [
            "--mechanism",
            "--clients",
            "--alpha",
            "--epsilon",
            "--confidence",
            "--group-ratio",
            "--groups",
        ],
        "measure": ["--epsilon", "--mechanism", "--groups", "--confidence", "--seed"],
        "fairtest": ["--mode", "--alpha", "--mu0", "--tolerance"],
    }[command]
    argv = [command]
    for option in draw(st.lists(st.sampled_from(options), max_size=5, unique=True)):
        if option == "--mechanism":
            argv += [option, draw(st.sampled_from(["R", "L", "P", "N", "best", "X"]))]
        elif option == "--mode":
            argv += [option, draw(st.sampled_from(["paper", "calibrated", "other"]))]
        else:
            argv += [option, draw(numbers)]
    if command in ("measure", "fairtest"):
        lines = draw(st.lists(st.lists(numbers, min_size=1, max_size=4).map(",".join), max_size=6))
        header = "group,metric" if command == "measure" else "mean,variance,n"
        path = tmp / f"{command}.csv"
        path.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
        argv += ["--input", str(path)]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


@FUZZ
@given(data=st.data())
def test_the_cli_exits_0_or_2_with_a_message_never_with_a_traceback(
    data: st.DataObject, tmp_path: Path
) -> None:
    argv = data.draw(cli_arguments(tmp_path))
    status, out, err = run_cli(argv)  # argparse's exits (a missing or malformed option) too
    event(f"{argv[0]} exit {status}")
    assert status in (0, 2), (argv, status)
    if status == 2:
        assert err.strip(), argv
    else:
        assert out.strip() and "Traceback" not in out


# --- FedEvalFair: a key holder -----------------------------------------------------------------


@pytest.fixture(scope="module")
def holder_key(ckks_keys: KeyPaths) -> Path:
    return ckks_keys.secret


@pytest.mark.parametrize("action", ["fef_round2", "fef_round3"])
@FUZZ
@given(data=st.data())
def test_a_key_holder_refuses_any_sum_it_cannot_verify(
    action: str, data: st.DataObject, holder_key: Path
) -> None:
    from fedparity.clients import fedevalfair_handlers
    from fedparity.clients.identity import NodeIdentity
    from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
    from fedparity.mechanisms.protocol import FEF_KEY

    # A holder with an identity and a roster, so the fuzzed message reaches the checks of the
    # sum itself (signatures, contributors, endorsements) instead of the identity refusal.
    key = IdentityKey.generate()
    identity = NodeIdentity(key, Roster.from_keys({"holder": key}))
    handlers = fedevalfair_handlers(
        None, secret_context=holder_key, identity=lambda context: identity
    )
    valid = {"round1-count": 3, "round2-count": 3}
    config = config_record(mutate(valid, data))
    arrays = {}
    for key in ("round1-sum", "round2-sum"):
        if data.draw(st.booleans(), label=f"has {key}"):
            size = data.draw(st.integers(0, 4096), label=f"{key} size")
            seed = data.draw(st.integers(0, 2**32 - 1), label=f"{key} seed")
            dtype = data.draw(st.sampled_from([np.uint8, np.float64, np.int64]))
            values = np.random.default_rng(seed).integers(0, 256, size=size).astype(dtype)
            arrays[key] = Array(values)
    message = Message(
        RecordDict({FEF_KEY: ArrayRecord(arrays), "config": config}),
        dst_node_id=3,
        message_type=f"query.{action}",
    )
    try:
        handlers[action](message, context_for({}))
    except REFUSALS as refusal:
        event(f"refused: {type(refusal).__name__}")
        assert str(refusal)
        return
    pytest.fail("a key holder released the decryption of a sum it could not verify")


@FUZZ
@given(salt=config_values)
def test_an_fpfl_node_refuses_any_setup_without_a_salt(salt: object) -> None:
    handlers = fpfl_handlers(make_model, node_users, SETTINGS)
    config = config_record({"run-salt": salt})
    message = Message(
        RecordDict({FPFL_KEY: config}), dst_node_id=3, message_type="query.fpfl_setup"
    )
    context = context_for({})
    try:
        reply = handlers["fpfl_setup"](message, context)
    except REFUSALS as refusal:
        assert str(refusal)
        return
    assert isinstance(salt, bytes)  # answered only a well-formed setup: with a public key
    assert set(reply.content.config_records[FPFL_KEY]) == {"public-key"}


# --- the server: FedEvalFair ciphertexts and FPFL sums from the nodes ----------------------------


@pytest.fixture(scope="module")
def public_context(ckks_keys: KeyPaths):  # noqa: ANN201
    from fedparity.mechanisms.crypto.ckks import load_public_context

    return load_public_context(ckks_keys.public)


@FUZZ
@given(data=st.data())
def test_the_server_counts_every_malformed_ciphertext_and_never_fails(
    data: st.DataObject, public_context: object
) -> None:
    from fedparity.mechanisms.protocol import FEF_KEY, ROUND1_SIZE
    from fedparity.strategies.fedevalfair import FedEvalFairProtocol

    protocol = FedEvalFairProtocol(public_context)  # type: ignore[arg-type]
    replies = []
    for node in (1, 2, 3):
        arrays = {}
        if data.draw(st.booleans(), label="has ciphertext"):
            arrays["ciphertext"] = Array(data.draw(arrays_strategy, label="ciphertext"))
        content = RecordDict({FEF_KEY: ArrayRecord(arrays)} if arrays or node == 3 else {})
        message = Message(RecordDict(), dst_node_id=node, message_type="query.fef_round1")
        replies.append(Message(content, reply_to=message))
    total, accepted, rejected, unable, _ = protocol.collect_ciphertexts(
        1, [1, 2, 3], replies, ROUND1_SIZE
    )
    assert len(accepted) + len(rejected) + len(unable) == 3
    assert total is None or accepted


@FUZZ
@given(data=st.data())
def test_the_server_rejects_every_malformed_fpfl_sum(data: st.DataObject) -> None:
    from fedparity.mechanisms.protocol import MessageError
    from fedparity.mechanisms.protocol.fpfl import FPFLRunParameters
    from fedparity.strategies.fpfl import FPFLProtocol

    masking = data.draw(st.booleans(), label="masking")
    protocol = FPFLProtocol(
        None,  # type: ignore[arg-type] - only the reply check runs: no messages are sent
        node_ids=[1, 2, 3],
        parameters=FPFLRunParameters(
            population_size=100,
            cohort_size=10,
            rounds=2,
            clipping_bound=1.0,
            epsilon=None,
            delta=None,
            noise_multiplier=0.0,
            accountant="rdp",
            constraint="fnr",
            num_groups=2,
            vector_size=5,
            distributed_noise=True,
            masking=masking,
            dropout_tolerance=0.0,
        ),
        reply_timeout=1.0,
    )
    arrays = {}
    for key in ("masked", "sum"):
        if data.draw(st.booleans(), label=f"has {key}"):
            arrays[key] = Array(data.draw(arrays_strategy, label=key))
    shares = {"recipients": [2, 3], "sealed": [b"a", b"b"], "threshold": 2}
    message = Message(RecordDict(), dst_node_id=1, message_type="query.fpfl_round")
    reply = Message(
        RecordDict({FPFL_KEY: ArrayRecord(arrays), "shares": ConfigRecord(shares)}),
        reply_to=message,
    )
    try:
        answer = protocol._read_reply(reply, 1)  # noqa: SLF001 - the per-reply check of run_round
    except MessageError as error:
        assert str(error)
        return
    vector = answer.vector
    assert vector.shape == (5,) and vector.dtype == (np.uint64 if masking else np.float64)


# --- FedAvg training and describe on the built-in ClientApp --------------------------------------


@FUZZ
@given(data=st.data())
def test_the_built_in_node_refuses_or_trains_for_any_train_message(data: st.DataObject) -> None:
    from fedparity.clients.app import describe, train_handler
    from fedparity.clients.project.config import RunConfig
    from fedparity.clients.project.task import build_model, get_arrays

    config = RunConfig.from_mapping({"users-per-node": 20})
    context = Context(
        run_id=1,
        node_id=3,
        # a node whose policy allows plain FedAvg (without it every train is refused before
        # the message is read: tests/test_training_gate.py)
        node_config={"partition-id": 0, "num-partitions": 2, "allow-non-private": True},
        state=RecordDict(),
        run_config={},
    )
    describe_message = Message(RecordDict({}), dst_node_id=3, message_type="query.describe")
    described = describe(describe_message, context, config).content.metric_records["metrics"]
    arrays = get_arrays(build_model(int(described["num-features"]), seed=0))
    choice = data.draw(st.sampled_from(["valid", "fewer", "reshaped", "text"]), label="arrays")
    if choice == "fewer":
        arrays = arrays[:-1]
    elif choice == "reshaped":
        arrays = [array.reshape(-1) for array in arrays]
    elif choice == "text":
        arrays = [np.array(["w"] * array.size) for array in arrays]
    train_config = config_record(mutate({"server-round": 1}, data))
    message = Message(
        RecordDict({"arrays": ArrayRecord(list(arrays)), "config": train_config}),
        dst_node_id=3,
        message_type="train",
    )
    try:
        reply = train_handler(message, context, config)
    except REFUSALS as refusal:
        assert str(refusal)
        return
    assert choice == "valid"
    assert reply.content.metric_records["metrics"]["num-examples"] >= 0
