"""Invented peers (sybils) in the FPFL secure sum, against the real node handlers (security
review of 2026-11-28, issue 48).

Without a roster a node cannot tell a real peer from one the server made up: a server that
surrounds a node with peers whose masking keys it made itself holds every pair secret of that
node and the shares of its self-mask, and opens its vector down to the node's own noise share
(a share sized for ``n_min`` honest survivors, so far below the noise the training was charged
for). Outside Flower's simulation engine the built-in policy therefore requires a roster
(``require-roster``): a node without one refuses the masked run at setup, before it reads its
data or makes a key, in one fixed sentence. ``require-roster = false`` accepts the risk; the
last test shows what that risk is.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedparity.clients import FPFLNodeSettings
from fedparity.clients.policy import POLICY_ENV, NodePrivacyPolicy, PolicyRefusal, node_policy
from fedparity.mechanisms.crypto.secure_sum import (
    combine_self_seed,
    expand_mask,
    open_share,
    round_seed,
    self_mask,
)
from tests.support import fpfl_nodes
from tests.support.fpfl_nodes import CLIP, POPULATION, MaskingNodes, roster_identities

pytestmark = pytest.mark.usefixtures("task_identity")

TARGET = 3
#: The server's invented peers: node ids it made up, with masking keys it made itself.
SYBILS = list(range(90, 99))
MEMBERS = [TARGET, *SYBILS]
#: A private training with every user in every round (q = m / K = 1), so that the users' part
#: of a vector is known exactly and what is left of it is the noise.
ALL_USERS = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=POPULATION,
    rounds=5,
    clipping_bound=CLIP,
    epsilon=2.0,
    delta=1e-6,
    dropout_tolerance=0.25,
)
#: What the server reads when the node refuses (PolicyRefusal's prefix and the fixed rule).
REFUSAL = (
    "refused by this node's privacy policy: FPFL masking needs this node's roster and "
    "identity-key (node config roster and identity-key, made by fedparity identity), or "
    "require-roster = false to accept peers the server may invent"
)


@pytest.fixture(autouse=True)
def no_policy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node's policy is its node config's (or the built-in one), never the test host's."""
    monkeypatch.delenv(POLICY_ENV, raising=False)


def sybil_nodes(target_config: dict) -> MaskingNodes:
    """The target (node config ``target_config``, no roster) among the server's sybils, every
    node on its own policy from its node config (``policy=None``); the sybils are the
    server's and accept anything it sends."""
    return MaskingNodes(
        MEMBERS,
        ALL_USERS,
        policy=None,
        node_config={
            TARGET: target_config,
            **{sybil: {"require-roster": "false"} for sybil in SYBILS},
        },
    )


def test_the_built_in_policy_requires_a_roster_outside_simulation_only(tmp_path: Path) -> None:
    """The key's default per setting: true for the built-in policy, and for a policy file or
    node config that does not name it; false in Flower's simulation engine; an explicit
    ``false`` (file or node config) accepts the risk."""
    assert NodePrivacyPolicy().require_roster
    assert node_policy({}, {}).require_roster  # pytest is not a simulation: built-in
    assert not NodePrivacyPolicy.simulation().require_roster
    silent = tmp_path / "silent.toml"
    silent.write_text("fpfl-max-delta = 0.002\n", encoding="utf-8")
    accepting = tmp_path / "accepting.toml"
    accepting.write_text("require-roster = false\n", encoding="utf-8")
    assert node_policy({"privacy-policy": str(silent)}, {}).require_roster
    assert node_policy({}, {POLICY_ENV: str(silent)}).require_roster
    assert node_policy({"fpfl-max-delta": "0.002"}, {}).require_roster
    assert not node_policy({"privacy-policy": str(accepting)}, {}).require_roster
    assert not node_policy({"require-roster": "false"}, {}).require_roster


@pytest.mark.parametrize(
    "policy_source", ["built-in", "policy file without the key", "node config without the key"]
)
def test_a_node_without_a_roster_refuses_invented_peers_at_setup(
    policy_source: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The attack: the server proposes a masked run to a node among nine peers it invented.
    Under the built-in policy (or a policy that leaves ``require-roster`` at its default) the
    node without a roster refuses the setup with one fixed sentence naming what is missing,
    the node config keys and the policy key, and logs one line: before reading its users
    (no call of ``node_users``) or making a masking key (no run state)."""
    config: dict = {}
    if policy_source == "policy file without the key":
        file = tmp_path / "policy.toml"
        file.write_text("fpfl-max-delta = 0.002\n", encoding="utf-8")
        config = {"privacy-policy": str(file)}
    elif policy_source == "node config without the key":
        config = {"fpfl-max-delta": "0.002"}
    reads: list[object] = []
    users = fpfl_nodes.node_users

    def counted_users(context: object = None) -> fpfl_nodes.FPFLShard:
        reads.append(context)
        return users()

    monkeypatch.setattr(fpfl_nodes, "node_users", counted_users)
    nodes = sybil_nodes(config)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        with pytest.raises(PolicyRefusal) as refused:
            nodes.setup(nodes=[TARGET])
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert str(refused.value) == REFUSAL
    assert not reads  # no data read
    assert not nodes.contexts[TARGET].state.config_records  # no key made, no run state
    # each record once (Flower's logger may also propagate to the root's handler)
    logged = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.name == "flwr"))
    assert logged == [f"fpfl: {REFUSAL} (policy: {node_policy(config, {}).source})"]
    # What is missing is named: a node with a roster but no identity key says so.
    roster_only = {TARGET: replace(roster_identities([TARGET])[TARGET], key=None)}
    nodes = sybil_nodes(config)
    nodes.identities = roster_only
    with pytest.raises(PolicyRefusal, match="needs this node's identity-key \\(node config"):
        nodes.setup(nodes=[TARGET])
    # The same node with its roster and identity key takes part (and a peer that is not on
    # the roster is refused at the key table: tests/test_secure_sum_attacks.py).
    nodes = sybil_nodes(config)
    nodes.identities = roster_identities([TARGET])
    nodes.setup(nodes=[TARGET])
    assert nodes.setup_replies[TARGET].signature is not None


def test_with_require_roster_false_invented_peers_open_the_vector_to_its_noise_share() -> None:
    """The accepted risk, ``require-roster = false`` in the node config: the node takes part,
    and the server, holding its sybils' masking keys, opens the node's masked vector of every
    round from that reply alone (its sybils' pair secrets remove the pair masks; the shares
    of the self-mask sealed for the sybils rebuild the self-mask seed). What is left is the
    node's users' exact statistics plus its own noise share, std ``C sigma / sqrt(n_min)``
    with ``n_min = ceil(0.75 * 10) = 8``, where the training was charged for ``C sigma``."""
    nodes = sybil_nodes({"require-roster": "false"})
    nodes.setup()
    nodes.pin()
    size = nodes.weights_size()
    codec = nodes.codec(len(MEMBERS))
    secrets = {sybil: nodes.pair_secret(sybil, TARGET) for sybil in SYBILS}  # the server's
    residuals = []
    for round_number in range(1, ALL_USERS.rounds + 1):
        replies = nodes.round(round_number, nodes=[TARGET])  # the target's reply is enough
        shares = [
            open_share(secret, round_number, TARGET, sybil, replies.sealed[TARGET][sybil])
            for sybil, secret in secrets.items()
        ]
        seed = combine_self_seed(shares, replies.thresholds[TARGET])
        opened = replies.masked[TARGET] - self_mask(seed, size)
        for secret in secrets.values():  # every sybil id is above the target's: it added them
            opened -= expand_mask(round_seed(secret, round_number), size)
        residuals.append(codec.decode(opened) - nodes.true_vector())
    noise = np.concatenate(residuals)
    sigma = nodes.parameters.noise_multiplier
    own_share = CLIP * sigma / np.sqrt(8)
    charged = CLIP * sigma
    # sum of squares / std^2 is chi-square with noise.size degrees of freedom; both tails at
    # 1e-6 (the noise is the node's own, from OS entropy: not seeded)
    low, high = stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size)
    assert low < np.sum(noise**2) / own_share**2 < high  # the node's own noise share ...
    assert np.sum(noise**2) / charged**2 < low  # ... far below the noise it was charged for
