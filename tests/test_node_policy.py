"""The node owns its privacy: a node-side policy that nothing the server sends can lower.

Each attack of the security review (finding C1) is run here against the real handlers, as a
curious server would run it; on the previous main every one of them succeeded (the node took
its budget, epsilon, delta, seed, noise placement, masking, K and node count from the run
config or the message). Now each is refused with a fixed sentence, or bounded, by the node's
own policy.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from fedparity.clients import FPFLNodeSettings, FPFLShard, LocalUsers, fpfl_handlers
from fedparity.clients.fpfl_node import cohort_contribution, round_rng
from fedparity.clients.fpfl_task import (
    get_flat_parameters,
    set_flat_parameters,
    statistics_layout,
)
from fedparity.clients.ldp import ldp_audit_handler
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import (
    POLICY_ENV,
    NodePrivacyPolicy,
    PolicyRefusal,
    in_flower_simulation,
    node_policy,
)
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.mechanisms.crypto.secure_sum import noise_share_std
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.mechanisms.protocol import FPFL_KEY
from fedparity.mechanisms.protocol.fpfl import (
    FPFLKeyTable,
    FPFLRoundRequest,
    FPFLRunParameters,
    FPFLSetupRequest,
)
from fedparity.strategies.ldp_audit import LdpGapAudit
from tests.support.fpfl_nodes import EXACT, EXACT_POLICY, MaskingNodes, run_parameters

pytestmark = pytest.mark.usefixtures("task_identity")

# --- the policy itself ------------------------------------------------------------------------


def test_the_built_in_defaults_are_the_safe_ones() -> None:
    policy = NodePrivacyPolicy()
    assert policy.require_masking and policy.require_distributed_noise
    assert not policy.allow_seeded_noise and not policy.allow_non_private
    assert policy.fpfl_max_delta <= 1e-3 and policy.min_survivors >= 2
    assert math.isfinite(policy.user_epsilon_budget) and math.isfinite(policy.fpfl_max_epsilon)
    assert policy.user_delta == 1e-6
    # outside Flower's simulation engine (this test process), a node gets exactly these
    assert not in_flower_simulation()
    assert node_policy({}, {}) == policy


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"fpfl-max-delta": 2}, "fpfl-max-delta must be a number in (0, 1]"),
        ({"fpfl-max-delta": 0}, "fpfl-max-delta must be a number in (0, 1]"),
        ({"user-epsilon-budget": "inf"}, "user-epsilon-budget must be a number in (0, inf)"),
        ({"user-delta": 0.5}, "user-delta must be a number in (0, 0.01]"),
        (
            {"ldp-user-budget": 2.0, "user-epsilon-budget": 3.0},
            "ldp-user-budget (deprecated) and user-epsilon-budget are both in node config",
        ),
        ({"min-survivors": 1}, "min-survivors must be an integer >= 2"),
        ({"tolerated-colluders": 0.5}, "tolerated-colluders must be an integer >= 0"),
        ({"allow-seeded-noise": "yes"}, "allow-seeded-noise must be true or false"),
        ({"max-epsilon": 1.0}, "unknown privacy-policy key(s) max-epsilon"),
    ],
)
def test_a_bad_policy_names_the_key_and_the_range(mapping: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        NodePrivacyPolicy.from_mapping(mapping, source="node config")
    assert message in str(raised.value)


def test_where_a_node_finds_its_policy(tmp_path: Path) -> None:
    file = tmp_path / "policy.toml"
    file.write_text("user-epsilon-budget = 3.0\nallow-non-private = true\n")
    environment_file = tmp_path / "env-policy.toml"
    environment_file.write_text("user-epsilon-budget = 7.0\n")
    environ = {POLICY_ENV: str(environment_file)}
    # 1. a file named in the node config, with node-config keys over it
    named = node_policy({"privacy-policy": str(file), "ldp-max-epsilon": 2.0}, environ)
    assert (named.user_epsilon_budget, named.allow_non_private, named.ldp_max_epsilon) == (
        3.0,
        True,
        2.0,
    )
    # 2. keys in the node config alone, over the defaults
    assert node_policy({"user-epsilon-budget": 4}, environ).user_epsilon_budget == 4.0
    # 3. the node host's environment
    assert node_policy({"partition-id": 0}, environ).user_epsilon_budget == 7.0
    # a policy that cannot be read stops the node with the file's name
    with pytest.raises(ValueError, match="no such file"):
        node_policy({"privacy-policy": str(tmp_path / "missing.toml")}, {})
    (tmp_path / "bad.toml").write_text("user-epsilon-budget = [")
    with pytest.raises(ValueError, match="bad.toml: not valid TOML"):
        node_policy({"privacy-policy": str(tmp_path / "bad.toml")}, {})


def test_the_old_budget_key_still_works_with_a_deprecation_warning(tmp_path: Path) -> None:
    file = tmp_path / "policy.toml"
    file.write_text("ldp-user-budget = 3.0\n")
    for source in ({"privacy-policy": str(file)}, {"ldp-user-budget": 3.0}):
        with pytest.warns(FutureWarning, match="ldp-user-budget .* is deprecated"):
            policy = node_policy(source, {})
        assert policy.user_epsilon_budget == policy.ldp_user_budget == 3.0


# --- LDP audit --------------------------------------------------------------------------------


def _users(num_users: int) -> LocalUsers:
    rng = np.random.default_rng(4)
    return LocalUsers(rng.integers(0, 2, size=num_users), rng.uniform(size=num_users))


def _audit(mechanism: RandomizedResponseMechanism, budget: float, node_id: int = 3) -> Message:
    arrays = ArrayRecord({"w": Array(np.zeros(1))})
    return LdpGapAudit(mechanism, budget=budget).configure_audit(arrays, [node_id])[0]


def _context(node_config: dict, run_config: dict | None = None, node_id: int = 3) -> Context:
    return Context(
        run_id=1,
        node_id=node_id,
        node_config=node_config,
        state=RecordDict(),
        run_config=run_config or {},
    )


def test_an_audit_above_the_nodes_max_epsilon_is_refused_before_any_release(
    tmp_path: Path,
) -> None:
    # The attack: the server's run config asks for a weak audit (true epsilon 8.69, "budget"
    # 8.69), above the built-in ldp-max-epsilon of 8.
    handler = ldp_audit_handler(lambda *_: _users(50), num_groups=2)
    weak = RandomizedResponseMechanism(8.0, 8.0)
    assert weak.epsilon > NodePrivacyPolicy().ldp_max_epsilon
    context = _context({"ledger-dir": str(tmp_path)})
    with pytest.raises(PolicyRefusal, match="epsilon is above ldp-max-epsilon") as refused:
        handler(_audit(weak, budget=weak.epsilon), context)
    assert str(refused.value) == (
        "refused by this node's privacy policy: the audit's epsilon is above ldp-max-epsilon"
    )
    assert not any(tmp_path.iterdir())  # nothing charged, nothing released


def test_a_server_cannot_raise_the_users_budget_nor_reset_it_by_a_new_run(tmp_path: Path) -> None:
    # The attacks: user-budget = 1e9 in the run config; and a new run (new node state).
    handler = ldp_audit_handler(lambda *_: _users(20), num_groups=2)
    mechanism = RandomizedResponseMechanism(1.0, 1.0)  # true epsilon 1.38
    answered = []
    for _ in range(3):  # three runs, each a fresh Context: only the ledger file remembers
        context = _context(
            {"ledger-dir": str(tmp_path), "user-epsilon-budget": 2.0}, {"user-budget": 1e9}
        )
        reply = handler(_audit(mechanism, budget=mechanism.epsilon), context)
        answered.append(reply.content.array_records["reports"]["groups"].numpy().size)
    assert answered == [20, 0, 0]
    # a policy raised later does not re-enable them: the ledger keeps its (lower) budget
    context = _context({"ledger-dir": str(tmp_path), "user-epsilon-budget": 100.0})
    reply = handler(_audit(mechanism, budget=mechanism.epsilon), context)
    assert reply.content.array_records["reports"]["groups"].numpy().size == 0
    assert UserLedger.load(tmp_path / "user-ledger.json", 20).budget == 2.0


def test_outside_simulation_the_ledger_persists_without_a_ledger_dir(isolated_home: Path) -> None:
    handler = ldp_audit_handler(lambda *_: _users(5), num_groups=2)
    mechanism = RandomizedResponseMechanism(1.0, 1.0)
    sizes = []
    for _ in range(2):  # two runs, no ledger-dir: the default folder under ~ remembers
        context = _context({"user-epsilon-budget": 2.0}, node_id=11)
        reply = handler(_audit(mechanism, budget=mechanism.epsilon, node_id=11), context)
        sizes.append(reply.content.array_records["reports"]["groups"].numpy().size)
        assert "privacy-ledger" not in context.state.config_records
    assert sizes == [5, 0]
    assert (isolated_home / ".fedparity" / "ledgers" / "user-ledger.json").is_file()


def test_a_user_with_an_undefined_metric_reports_like_everyone_else(tmp_path: Path) -> None:
    # The side channel (review M3): a one-user device whose TPR is undefined sent nothing, and
    # "num-undefined 1" in clear: a label bit outside the LDP guarantee. Now it sends exactly
    # one perturbed report (of the undefined category), and no counts.
    def one_user(metric: float) -> LocalUsers:
        return LocalUsers(np.zeros(1, dtype=np.int64), np.array([metric]))

    audit = LdpGapAudit.for_budget("R", 2.0, num_groups=2, metric="tpr")
    replies = {}
    for name, metric in (("undefined", np.nan), ("defined", 0.75)):
        handler = ldp_audit_handler(lambda *_, m=metric: one_user(m), num_groups=2)
        context = _context({"ledger-dir": str(tmp_path / name)})
        message = audit.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [3])[0]
        replies[name] = handler(message, context)
    for reply in replies.values():
        assert set(reply.content.metric_records["metrics"]) == {"epsilon-charged"}
        reports = reply.content.array_records["reports"]
        assert reports["groups"].numpy().size == 1  # one report, whatever the metric
    # an audit without the undefined category is refused by every node alike, before its
    # data (tests/test_data_independent_replies.py)
    plain = LdpGapAudit(
        RandomizedResponseMechanism(1.0, 1.0), budget=2.0, metric="tpr", undefined_category=False
    )
    for metric in (np.nan, 0.75):
        handler = ldp_audit_handler(lambda *_, m=metric: one_user(m), num_groups=2)
        message = plain.configure_audit(ArrayRecord({"w": Array(np.zeros(1))}), [3])[0]
        with pytest.raises(NodeRefusal, match="must carry the undefined category"):
            handler(message, _context({"ledger-dir": str(tmp_path / "plain")}))


def test_a_small_node_sends_no_counts_in_clear(tmp_path: Path) -> None:
    mechanism = RandomizedResponseMechanism(1.0, 1.0)
    few = ldp_audit_handler(lambda *_: _users(5), num_groups=2)
    reply = few(_audit(mechanism, mechanism.epsilon), _context({"ledger-dir": str(tmp_path)}))
    assert set(reply.content.metric_records["metrics"]) == {"epsilon-charged"}
    many = ldp_audit_handler(lambda *_: _users(40), num_groups=2)
    context = _context({"ledger-dir": str(tmp_path / "b")})
    reply = many(_audit(mechanism, mechanism.epsilon), context)
    assert reply.content.metric_records["metrics"]["num-reports"] == 40


# --- FPFL -------------------------------------------------------------------------------------

USERS = 25
CLIP = 1.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 1), nn.Sigmoid())


def node_users(_: Context | None = None) -> FPFLShard:
    rng = np.random.default_rng(1)
    rows = 2 * USERS
    return FPFLShard(
        features=rng.normal(size=(rows, 3)).astype(np.float32),
        labels=rng.integers(0, 2, size=rows).astype(np.int64),
        groups=np.repeat(rng.integers(0, 2, size=USERS), 2).astype(np.int64),
        user_index=np.repeat(np.arange(USERS), 2).astype(np.int64),
        user_ids=np.arange(USERS, dtype=np.int64),
        num_groups=2,
        num_classes=2,
    )


def settings(**overrides: object) -> FPFLNodeSettings:
    values: dict = {
        "constraint": "fnr",
        "cohort_size": 10,
        "rounds": 5,
        "clipping_bound": CLIP,
        "epsilon": 2.0,
        "delta": 1e-4,
    }
    return FPFLNodeSettings(**{**values, **overrides})


SALT = b"s" * 16


def parameters_for(node: FPFLNodeSettings, population: int = 5000) -> FPFLRunParameters:
    """The run parameters an honest server proposes to a node with settings ``node`` (and
    this module's model)."""
    return replace(
        run_parameters(node, population=population),
        vector_size=statistics_layout(make_model(), 2).size,
    )


def setup_message(node: FPFLNodeSettings | None = None, population: int = 5000) -> Message:
    request = FPFLSetupRequest(SALT, parameters_for(node or settings(), population))
    return Message(
        RecordDict({FPFL_KEY: ConfigRecord(request.to_fields())}),
        dst_node_id=3,
        message_type="query.fpfl_setup",
    )


def pinned(
    handlers: dict, context: Context, node: FPFLNodeSettings, population: int, members: list[int]
) -> bytes:
    """Set a node up for a run without masking (setup, then the member table); its digest."""
    handlers["fpfl_setup"](setup_message(node, population), context)
    table = FPFLKeyTable(SALT, parameters_for(node, population).digest(), tuple(members))
    handlers["fpfl_keys"](
        Message(
            RecordDict({FPFL_KEY: ConfigRecord(table.to_fields())}),
            dst_node_id=3,
            message_type="query.fpfl_keys",
        ),
        context,
    )
    return table.run_digest()


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        ({"client_seed": 7}, "seeded noise needs allow-seeded-noise"),
        ({"distributed_noise": False}, "require-distributed-noise forbids central noise"),
        ({"masking": False}, "require-masking forbids an unmasked sum"),
        ({"epsilon": 50.0}, "epsilon is above fpfl-max-epsilon"),
        ({"delta": 0.5}, "delta is above fpfl-max-delta"),
        ({"epsilon": None}, "training without noise needs allow-non-private"),
    ],
)
def test_fpfl_settings_beyond_the_policy_are_refused_at_setup(overrides: dict, rule: str) -> None:
    # The attack: the server's run config picks each of these (fpfl-client-seed, fpfl-noise =
    # "central", fpfl-secure-sum = "none", any fpfl-epsilon, fpfl-delta up to 1, fl / ffl).
    node = settings(**overrides)
    handlers = fpfl_handlers(make_model, node_users, node)
    context = _context({})
    with pytest.raises(PolicyRefusal, match=rule):
        handlers["fpfl_setup"](setup_message(node), context)
    assert not context.state.config_records  # no key made, nothing sent
    # the same settings pass a policy whose operator allows them
    allowing = NodePrivacyPolicy(
        fpfl_max_epsilon=100.0,
        fpfl_max_delta=1.0,
        require_masking=False,
        require_distributed_noise=False,
        allow_seeded_noise=True,
        allow_non_private=True,
        fpfl_min_noise_multiplier=0.0,
        require_roster=False,
    )
    allowed = fpfl_handlers(make_model, node_users, node, policy=allowing)
    reply = allowed["fpfl_setup"](setup_message(node), _context({}))
    record = reply.content.config_records[FPFL_KEY]
    assert record["parameters-digest"] == parameters_for(node).digest()
    assert ("public-key" in record) == node.masking


def round_message(run_digest: bytes, round_number: int = 1) -> Message:
    weights = get_flat_parameters(make_model())
    request = FPFLRoundRequest(round_number, run_digest, weights)
    content = RecordDict(
        {
            FPFL_KEY: ArrayRecord({"weights": Array(weights)}),
            "config": ConfigRecord(request.to_fields()),
        }
    )
    return Message(content=content, dst_node_id=3, message_type="query.fpfl_round")


#: An operator who allows a reproducible unmasked run, to make the noise observable.
OBSERVABLE = {"allow-seeded-noise": True, "require-masking": False}


def expected_reply(node: FPFLNodeSettings, population: int, std: float) -> np.ndarray:
    model = make_model()
    set_flat_parameters(model, get_flat_parameters(make_model()))
    return cohort_contribution(
        model,
        node_users(),
        constraint="fnr",
        clipping_bound=CLIP,
        sample_rate=min(1.0, node.cohort_size / population),
        noise_share_std=std,
        rng=round_rng(node.client_seed, 3, 1),
    )


def test_a_claimed_population_beyond_the_policy_is_refused(tmp_path: Path) -> None:
    # The attack: K = 10^12 makes q = m / K and sigma tiny. The node used to compute with
    # min(K, max-population); now a run agrees on one K at setup, and a K above the policy's
    # max-population is refused there (a node never computes with another K than its peers).
    node = settings(client_seed=5, masking=False, dropout_tolerance=0.0)
    handlers = fpfl_handlers(make_model, node_users, node)
    context = _context({**OBSERVABLE, "max-population": 1000, "ledger-dir": str(tmp_path)})
    with pytest.raises(PolicyRefusal, match="max-population"):
        handlers["fpfl_setup"](setup_message(node, 10**12), context)
    assert not context.state.config_records
    digest = pinned(handlers, context, node, 1000, [3, 4, 5])
    reply = handlers["fpfl_round"](round_message(digest), context)
    sent = reply.content.array_records[FPFL_KEY]["sum"].numpy()
    bounded = node.noise_share_std(1000, 3)
    assert bounded > 2 * node.noise_share_std(10**12, 3)  # what the attack would have got
    np.testing.assert_allclose(sent, expected_reply(node, 1000, bounded), rtol=0, atol=1e-12)


def test_a_claimed_node_count_beyond_the_policy_is_refused() -> None:
    # The attack: 1,000 claimed peers shrink each noise share ~18-fold (n_min = 800).
    node = settings(masking=False)
    handlers = fpfl_handlers(make_model, node_users, node)
    context = _context({"require-masking": False, "max-nodes": 100})
    with pytest.raises(PolicyRefusal, match="node count is outside"):
        pinned(handlers, context, node, 5000, list(range(3, 1003)))


def test_a_node_releases_no_more_rounds_than_its_noise_was_calibrated_for(
    tmp_path: Path,
) -> None:
    # The attack: sigma is calibrated for T rounds, and the server simply asks for more (or
    # replays a round number): every extra noisy sum spends epsilon beyond the target.
    node = settings(rounds=3, masking=False)
    handlers = fpfl_handlers(make_model, node_users, node)
    context = _context({"require-masking": False, "ledger-dir": str(tmp_path)})
    digest = pinned(handlers, context, node, 5000, [3, 4, 5])
    for round_number in (1, 2, 2):  # a replayed round counts too
        reply = handlers["fpfl_round"](round_message(digest, round_number), context)
        assert "sum" in reply.content.array_records[FPFL_KEY]
    with pytest.raises(PolicyRefusal, match="rounds are all spent"):
        handlers["fpfl_round"](round_message(digest, 4), context)


def test_the_noise_share_is_sized_for_the_tolerated_colluders(tmp_path: Path) -> None:
    node = settings(client_seed=5, masking=False, dropout_tolerance=0.0)
    handlers = fpfl_handlers(make_model, node_users, node)
    context = _context({**OBSERVABLE, "tolerated-colluders": 1, "ledger-dir": str(tmp_path)})
    digest = pinned(handlers, context, node, 5000, [3, 4, 5, 6])
    reply = handlers["fpfl_round"](round_message(digest), context)
    sigma = node.noise_multiplier(5000)
    std = noise_share_std(CLIP, sigma, 4 - 1)  # n_min - t honest shares carry C^2 sigma^2
    assert std == pytest.approx(CLIP * sigma / math.sqrt(3))
    sent = reply.content.array_records[FPFL_KEY]["sum"].numpy()
    np.testing.assert_allclose(sent, expected_reply(node, 5000, std), rtol=0, atol=1e-12)
    # with as many colluders as guaranteed survivors no share is sent at all
    context = _context({**OBSERVABLE, "tolerated-colluders": 4})
    with pytest.raises(PolicyRefusal, match="do not outnumber tolerated-colluders"):
        pinned(handlers, context, node, 5000, [3, 4, 5, 6])


def test_masks_are_revealed_only_for_the_policys_minimum_survivors() -> None:
    # n_min = 2 of 3 members (rho = 0.34): the run alone would let two survivors unmask.
    exact = replace(EXACT, dropout_tolerance=0.34)
    lenient_rho = replace(EXACT_POLICY, fpfl_max_dropout_tolerance=0.45)
    strict = MaskingNodes([3, 4, 5], exact, policy=replace(lenient_rho, min_survivors=3))
    strict.setup()
    strict.pin()
    replies = strict.round(1, nodes=[3, 4])
    with pytest.raises(NodeRefusal, match="fewer survivors than min-survivors"):
        strict.unmask(1, 3, [3, 4], [5], replies.sealed)
    lenient = MaskingNodes([3, 4, 5], exact, policy=replace(lenient_rho, min_survivors=2))
    lenient.setup()
    lenient.pin()
    replies = lenient.round(1, nodes=[3, 4])
    attestations = lenient.attest(1, [3, 4], [5])
    _, seeds = lenient.unmask(1, 3, [3, 4], [5], replies.sealed, attestations)
    assert list(seeds) == [(3, 5)]


def test_a_one_user_device_describes_its_users_but_not_its_samples(tmp_path: Path) -> None:
    from fedparity.clients.app import describe
    from fedparity.clients.project.config import RunConfig

    rows = tmp_path / "me.csv"
    rows.write_text("group,label,age\n1,1,0.5\n1,0,0.25\n1,1,0.75\n", encoding="utf-8")
    context = _context(
        {"partition-id": 0, "num-partitions": 1, "data-file": str(rows), "num-groups": 2}
    )
    request = Message(RecordDict({}), dst_node_id=3, message_type="query.describe")
    for task in ("ldp-audit", "fpfl"):
        reply = describe(request, context, RunConfig.from_mapping({"task": task}))
        metrics = reply.content.metric_records["metrics"]
        assert metrics["num-users"] == 1 and "num-train-samples" not in metrics


def test_every_policy_key_is_documented() -> None:
    """docs/privacy-policy.md lists every key an operator can set (and the module docstring's
    table too), so a new key cannot ship undocumented."""
    import fedparity.clients.policy as policy_module

    page = (Path(__file__).resolve().parents[1] / "docs" / "privacy-policy.md").read_text()
    for key in NodePrivacyPolicy.keys():
        assert f"`{key}`" in page, key
        assert f"``{key}``" in (policy_module.__doc__ or ""), key


def test_new_policy_keys_parse_and_name_their_range() -> None:
    """The caps added for agreed run parameters: ranges are enforced with the key named, the
    dropout-tolerance cap stays below 0.5, and allowed-apps takes a TOML list or the
    comma/space-separated string a node config holds."""
    digest = "ab" * 32
    policy = NodePrivacyPolicy.from_mapping(
        {
            "fpfl-min-noise-multiplier": 0,
            "fpfl-max-dropout-tolerance": 0.49,
            "allowed-apps": f"{digest.upper()}, {'cd' * 32}",
        },
        source="test",
    )
    assert policy.fpfl_min_noise_multiplier == 0.0
    assert policy.allowed_apps == (digest, "cd" * 32)
    policy.check_app(digest.upper())
    with pytest.raises(PolicyRefusal, match="allowed-apps"):
        policy.check_app("ef" * 32)
    assert NodePrivacyPolicy.from_mapping({"allowed-apps": [digest]}, source="t").allowed_apps == (
        digest,
    )
    for key, value, span in [
        ("fpfl-max-dropout-tolerance", 0.5, r"\[0, 0.5\)"),
        ("fpfl-min-noise-multiplier", -0.1, r"\[0, inf\)"),
        ("fpfl-max-weight", 0, r"\(0, inf\)"),
        ("max-groups", 1, "an integer >= 2"),
        ("allowed-apps", ["abc"], "64 hex characters"),
    ]:
        with pytest.raises(ValueError, match=f"{key} must .*{span}"):
            NodePrivacyPolicy.from_mapping({key: value}, source="test")
    default = NodePrivacyPolicy()
    with pytest.raises(PolicyRefusal, match="max-groups"):
        default.check_sizes(num_groups=default.max_groups + 1)
    with pytest.raises(PolicyRefusal, match="fpfl-min-noise-multiplier"):
        default.check_fpfl_noise(0.49, 0.2)
    with pytest.raises(PolicyRefusal, match="fpfl-max-dropout-tolerance"):
        default.check_fpfl_noise(1.0, 0.31)
    with pytest.raises(PolicyRefusal, match="fpfl-max-weight"):
        default.check_weights(float("nan"))
