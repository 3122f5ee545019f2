"""A node's privacy never depends on a number the server chooses per message: the attacks of
the security review of 2026-11-26 (C1, C2, H1, H2) against the real FPFL handlers.

On the previous main (commit 1b4a09e) each of these succeeded: the node read the population
size ``K`` from every round message (C1: a split view on ``K`` left only the target's own noise
share in the decoded sum; C2: the ledger charged the whole training at round 1's ``K``), the
share threshold was 2 for the noise-free runs and ``rho`` was unbounded (H1: split views of the
survivors opened one node's vector), and huge weights made some users' statistics NaN, which
turned into a refusal after the round was counted (H2: a noiseless bit per round). Each test
says what the attack obtained then and checks that it obtains nothing now.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from fedparity.clients import FPFLNodeSettings, FPFLShard
from fedparity.clients.fpfl_node import node_workload
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.mechanisms.crypto.secure_sum import (
    attest_view,
    minimum_survivors,
    share_threshold,
)
from fedparity.mechanisms.privacy.user_ledger import SubsampledGaussianRelease, UserLedger, compose
from fedparity.mechanisms.protocol import MessageError
from fedparity.mechanisms.protocol.fpfl import FPFLKeyTable, FPFLRunParameters
from tests.support.fpfl_nodes import EXACT, EXACT_POLICY, MaskingNodes, node_users, run_parameters

pytestmark = pytest.mark.usefixtures("task_identity")

#: A private training under masking and distributed noise, three nodes.
PRIVATE = FPFLNodeSettings(
    constraint="fnr", cohort_size=10, rounds=5, clipping_bound=1.0, epsilon=2.0, delta=1e-6
)
#: The built-in policy, with a ledger kept in the run state (these nodes are in-process) and
#: masking without a roster (the attacks here are on nodes that have none; invented peers:
#: tests/test_sybil_peers.py).
STRICT = NodePrivacyPolicy(allow_ephemeral_ledger=True, require_roster=False)


def setup_all(nodes: MaskingNodes, views: dict[int, FPFLRunParameters]) -> dict[int, FPFLKeyTable]:
    """Give every node its own view of the parameters, and a table that matches it: the best
    an active server can do (a node refuses a table for other parameters)."""
    nodes.setup(views)
    tables = {}
    for node, parameters in views.items():
        table = nodes.key_table(parameters)
        nodes.pin(table, nodes=[node])
        tables[node] = table
    return tables


def pinned_rounds(
    parameters: FPFLRunParameters, steps: int, policy: NodePrivacyPolicy = STRICT
) -> SubsampledGaussianRelease:
    """``steps`` rounds released at the pinned sigma and ``q``: what a ledger must cover (with
    the chance, per round, that the cohort of a node of :func:`node_users` outgrew its fixed
    workload under ``policy``)."""
    workload = node_workload(
        node_users(),
        parameters.sample_rate,
        parameters.rounds,
        user_epsilon_budget=policy.user_epsilon_budget,
        user_delta=policy.user_delta,
    )
    return SubsampledGaussianRelease(
        noise_multiplier=parameters.noise_multiplier,
        sample_rate=parameters.sample_rate,
        steps=steps,
        delta=parameters.delta,  # type: ignore[arg-type]
        timing_tail_probability=steps * workload.tail_probability,
        job="fpfl",
        label="released",
    )


# --- C1: a split view on the population size -------------------------------------------------


def test_a_split_view_on_the_population_size_yields_no_sum() -> None:
    """The review's C1: the target is told its true ``K``, the others ``K = 10^7``: they sample
    almost no one and add noise shares far too small, encoded 2^16 times coarser, so the sum
    decoded with the target's codec held only the target's vector and its own share (noise std
    6.23 instead of 10.70 with 3 nodes). Now every node's pair secrets are bound to the run
    digest of what it agreed: the pair (target, other) derives two different secrets, the
    sealed shares do not open across the views, and no node reveals anything for the round."""
    policy = replace(STRICT, fpfl_min_noise_multiplier=0.0)  # the floor is a separate defence
    nodes = MaskingNodes([3, 4, 5], PRIVATE, policy=policy)
    true_view = run_parameters(PRIVATE, population=1000)
    inflated = run_parameters(PRIVATE, population=10**7)
    assert inflated.noise_multiplier < true_view.noise_multiplier  # what the attack exploited
    tables = setup_all(nodes, {3: true_view, 4: inflated, 5: inflated})
    assert tables[3].run_digest() != tables[4].run_digest()
    assert nodes.pair_secret(3, 4) != nodes.pair_secret(4, 3)
    assert nodes.pair_secret(4, 5) == nodes.pair_secret(5, 4)  # the same view agrees
    sealed: dict[int, dict[int, bytes]] = {}
    for node in (3, 4, 5):  # each node's round under the digest it pinned
        nodes.table = tables[node]
        sealed[node] = nodes.round(1, nodes=[node]).sealed[node]
    # Calling the target dropped leaves the others a sum of two noise shares, fewer than the
    # n_min = 3 whose shares add up to the accounted noise: refused.
    for node in (4, 5):
        with pytest.raises(NodeRefusal, match="fewer survivors than n_min"):
            nodes.confirm(1, node, [4, 5], [3])
    for node in (3, 4, 5):  # every survivor holds a share it cannot open: nobody reveals
        with pytest.raises(NodeRefusal, match="does not open"):
            nodes.unmask(1, node, [3, 4, 5], [], sealed)


def test_a_round_for_other_parameters_is_refused_and_k_never_comes_with_a_round() -> None:
    """A round names the run digest; a round for another ``K`` (another digest) is refused, so
    the ``K``, sigma and ``q`` of every round are the pinned ones."""
    nodes = MaskingNodes([3, 4, 5], PRIVATE, policy=STRICT)
    nodes.setup()
    nodes.pin()
    other = nodes.key_table(run_parameters(PRIVATE, population=10**7))
    with pytest.raises(NodeRefusal, match="another run's parameters"):
        nodes.round(1, nodes=[3], run_digest=other.run_digest())
    content = nodes.round_message(1)
    content.config_records["config"]["population-size"] = 10**7  # an old-style field: ignored
    reply = nodes.send("fpfl_round", 3, content)
    assert not reply.has_error()


def test_with_a_roster_split_parameters_are_refused_at_the_key_table() -> None:
    """With a roster each node's masking key is signed together with the parameters' digest
    it accepted: a table mixing keys accepted under two views is refused by every node."""
    from fedparity.clients.identity import NodeIdentity
    from fedparity.mechanisms.crypto.identity import IdentityKey, Roster

    keys = {node: IdentityKey.generate() for node in (3, 4, 5)}
    roster = Roster.from_keys({f"node-{node}": key for node, key in keys.items()})
    identities = {node: NodeIdentity(keys[node], roster) for node in keys}
    policy = replace(STRICT, fpfl_min_noise_multiplier=0.0)
    nodes = MaskingNodes([3, 4, 5], PRIVATE, policy=policy, identities=identities)
    true_view = run_parameters(PRIVATE, population=1000)
    inflated = run_parameters(PRIVATE, population=10**7)
    nodes.setup({3: true_view, 4: inflated, 5: inflated})
    for view, victims in ((true_view, [3]), (inflated, [4, 5])):
        table = nodes.key_table(view)
        for node in victims:
            with pytest.raises(NodeRefusal, match="not signed by its node"):
                nodes.pin(table, nodes=[node])
        others = [node for node in (3, 4, 5) if node not in victims]
        for node in others:
            with pytest.raises(NodeRefusal, match="for other run parameters"):
                nodes.pin(table, nodes=[node])


# --- C2: the ledger charges what is released ------------------------------------------------


def test_the_ledger_total_is_what_the_releases_compose_to_across_runs() -> None:
    """The review's C2: round 1 at ``K = 10^7`` charged the whole training at epsilon ~0.001,
    later rounds at ``K = m`` released ordinary noisy sums: three runs left the ledger at 0.0020
    while the releases composed to 7.27. Now ``K`` (and so sigma and ``q``) is pinned at setup:
    each run charges exactly the release every one of its rounds makes, and a run's rounds
    cannot change it. Three runs on one ledger at different ``K``: the ledger's total equals the
    composition of the three pinned trainings (all ``T`` rounds released)."""
    policy = replace(STRICT, fpfl_min_noise_multiplier=0.0, allow_ephemeral_ledger=False)
    releases = []
    ledger_dir = None
    for population in (10**7, 1000, 50):
        settings = replace(PRIVATE, cohort_size=10)
        nodes = MaskingNodes([3, 4, 5], settings, policy=policy, population=population)
        if ledger_dir is not None:  # the same nodes (ledger folders) in a new run
            for node, context in nodes.contexts.items():
                context.node_config["ledger-dir"] = f"{ledger_dir}/node-{node}"
        else:
            ledger_dir = nodes._ledgers.name
            keep = nodes._ledgers  # noqa: F841 - the folder lives as long as the test
        nodes.setup()
        nodes.pin()
        parameters = nodes.parameters
        for round_number in range(1, settings.rounds + 1):
            replies = nodes.round(round_number)
            nodes.honest_sum(round_number, replies)
        with pytest.raises(PolicyRefusal, match="rounds are all spent"):
            nodes.round(settings.rounds + 1, nodes=[3])
        releases.append(pinned_rounds(parameters, parameters.rounds))
    ledger = UserLedger.load(f"{ledger_dir}/node-3/user-ledger.json")
    expected = compose(releases, delta=ledger.delta)
    assert len(ledger.releases) == 3
    assert ledger.total(0).epsilon == pytest.approx(expected.epsilon, rel=1e-9)
    assert ledger.total(0).epsilon > 1.0  # not the ~0.002 the attack left


def test_a_round_that_names_another_k_is_released_and_charged_at_the_pinned_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review's C2 within one run: round 1 said ``K = 10^7`` (and a matching sigma and
    ``q``), so the training was charged at epsilon ~0.001, and the later rounds at ``K = m``
    released ordinary noisy sums. Now whatever a round message says of ``K``, sigma or ``q``
    (here round 1 carries the old fields with the attack's values), every round samples at
    the pinned ``q``, adds the pinned noise share, and the ledger holds the composition of
    all ``T`` pinned rounds: what the releases compose to."""
    handlers = importlib.import_module("fedparity.clients.fpfl_handlers")

    policy = replace(STRICT, fpfl_min_noise_multiplier=0.0, allow_ephemeral_ledger=False)
    nodes = MaskingNodes([3, 4, 5], PRIVATE, policy=policy, population=1000)
    keep = nodes._ledgers  # noqa: F841 - the ledger folders live as long as the test
    nodes.setup()
    nodes.pin()
    pinned = nodes.parameters
    attack = run_parameters(PRIVATE, population=10**7)
    assert attack.sample_rate < pinned.sample_rate / 1000  # what round 1 claimed
    used: list[tuple[float, float]] = []
    real_contribution = handlers.round_contribution

    def recording(*args: object, **kwargs: object) -> object:
        used.append((float(kwargs["sample_rate"]), float(kwargs["noise_share_std"])))  # type: ignore[arg-type]
        return real_contribution(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers, "round_contribution", recording)
    real_message = nodes.round_message

    def hostile_round_one(round_number: int, *args: object, **kwargs: object) -> RecordDict:
        content = real_message(round_number, *args, **kwargs)  # type: ignore[arg-type]
        if round_number == 1:
            content.config_records["config"]["population-size"] = 10**7
            content.config_records["config"]["noise-multiplier"] = attack.noise_multiplier
            content.config_records["config"]["sample-rate"] = attack.sample_rate
        return content

    monkeypatch.setattr(nodes, "round_message", hostile_round_one)
    for round_number in range(1, PRIVATE.rounds + 1):
        nodes.honest_sum(round_number, nodes.round(round_number))
    share_std = PRIVATE.noise_share_std(
        pinned.population_size,
        3,
        colluders=policy.tolerated_colluders,
        sigma=pinned.noise_multiplier,
    )
    assert share_std > 0
    assert len(used) == 3 * PRIVATE.rounds
    assert all(rate == pinned.sample_rate for rate, _ in used), used[:3]
    assert all(std == pytest.approx(share_std, rel=1e-12) for _, std in used), used[:3]
    ledger = UserLedger.load(f"{nodes._ledgers.name}/node-3/user-ledger.json")
    expected = compose([pinned_rounds(pinned, PRIVATE.rounds)], delta=ledger.delta)
    assert ledger.total(0).epsilon == pytest.approx(expected.epsilon, rel=1e-9)
    assert ledger.total(0).epsilon > 1.0  # not the ~0.001 a charge at round 1's K would be


def test_a_node_that_lost_its_run_state_is_charged_again_before_it_releases_again() -> None:
    """A restart (a deployed node's process and run state lost mid-training) must not let the
    server go on at a charge the node no longer remembers: the restarted node refuses rounds
    until it is set up again, the nodes that kept their state refuse a second setup of the
    run, and the restarted node's new setup is charged in full before its first release, so
    its ledger holds at least what its releases compose to (two trainings for 3 rounds)."""
    policy = replace(STRICT, fpfl_min_noise_multiplier=0.0, allow_ephemeral_ledger=False)
    nodes = MaskingNodes([3, 4, 5], PRIVATE, policy=policy, population=1000)
    keep = nodes._ledgers  # noqa: F841 - the ledger folders live as long as the test
    nodes.setup()
    nodes.pin()
    for round_number in (1, 2):
        nodes.honest_sum(round_number, nodes.round(round_number))
    ledger_file = f"{nodes._ledgers.name}/node-3/user-ledger.json"
    assert len(UserLedger.load(ledger_file).releases) == 1
    nodes.contexts[3] = replace(nodes.contexts[3], state=RecordDict())  # the restart
    with pytest.raises((NodeRefusal, MessageError)):
        nodes.round(3, nodes=[3])
    for node in (4, 5):
        with pytest.raises(NodeRefusal, match="setup was made already"):
            nodes.setup(nodes=[node])
    nodes.setup(nodes=[3])
    nodes.pin(nodes.key_table(), nodes=[3])
    nodes.round(3, nodes=[3])
    ledger = UserLedger.load(ledger_file)
    assert len(ledger.releases) == 2  # the training, charged again before the new release
    pinned = nodes.parameters
    released = compose([pinned_rounds(pinned, 3)], delta=ledger.delta)
    assert ledger.total(0).epsilon >= released.epsilon


# --- H1: split views of the survivors ---------------------------------------------------------


def test_the_share_threshold_beats_the_single_node_split_view_with_or_without_noise() -> None:
    """``t + r > n + 1 + c`` for every member count, dropout tolerance and colluder count the
    policy allows (``r``: the survivors a node reveals for), the same with or without noise;
    on the previous main ``t`` was 2 for the noise-free baselines and ``rho`` unbounded."""
    for n in range(2, 40):
        for rho in (0.0, 0.1, 0.2, 0.3, 0.45):
            for colluders in range(3):
                for min_survivors in (2, 3):
                    r = max(min_survivors, minimum_survivors(n, rho), 2)
                    try:
                        t = share_threshold(
                            n,
                            min_survivors=min_survivors,
                            noise_survivors=minimum_survivors(n, rho),
                            colluders=colluders,
                        )
                    except ValueError:
                        continue  # such a run is refused at the member table
                    assert t + r > n + 1 + colluders
                    assert t >= colluders + 2


def test_a_dropout_tolerance_of_one_half_is_refused_by_the_policy() -> None:
    nodes = MaskingNodes([3, 4, 5, 6], replace(EXACT, dropout_tolerance=0.5))
    with pytest.raises(PolicyRefusal, match="fpfl-max-dropout-tolerance"):
        nodes.setup(nodes=[3])


def test_the_reviews_split_view_opens_no_vector_at_the_default_tolerance() -> None:
    """The review's H1 at ``rho = 0.2`` without noise (5 nodes): tell ``d`` "survivors
    {d} + A, dropped B", A "d dropped", B "nobody dropped". With ``t = 2`` that gave every pair
    seed of ``d`` and two shares of its self-mask: ``x_d`` exactly (error 8.6e-13). Now A and
    ``d`` cannot both have their views attested (each attests one view), and B's share and
    ``d``'s own are 2 of the ``t = 4`` shares."""
    members = [3, 4, 5, 6, 7]
    nodes = MaskingNodes(members, replace(EXACT, dropout_tolerance=0.2))
    nodes.setup()
    nodes.pin()
    replies = nodes.round(1)
    assert replies.thresholds[3] == 4  # max(r = 4, n + 2 - r = 3)
    d, group_a, group_b = 3, [4, 5, 6], [7]
    view_d = (sorted([d, *group_a]), group_b)
    view_a = (sorted([*group_a, *group_b]), [d])
    attest_d = {node: nodes.confirm(1, node, *view_d) for node in view_d[0]}
    for node in group_a:  # A attested d's view already: it attests no second view
        with pytest.raises(NodeRefusal, match="attested another view"):
            nodes.confirm(1, node, *view_a)
    attest_a = {7: nodes.confirm(1, 7, *view_a)}  # B alone
    for node in group_a:
        with pytest.raises(NodeRefusal, match="attested another view|too few members"):
            nodes.unmask(1, node, *view_a, replies.sealed, attest_a)
    # d's own reveal goes through (its view is attested), B's reveals its shares:
    shares_d, seeds_d = nodes.unmask(1, d, *view_d, replies.sealed, attest_d)
    shares_b, _ = nodes.unmask(1, 7, members, [], replies.sealed)
    assert set(seeds_d) == {(3, 7)}  # no seed of d with A: A never revealed
    gathered = [shares_d[d], shares_b[d]]
    assert len(gathered) < replies.thresholds[d]


def test_a_split_view_isolating_a_pair_is_stopped_by_the_attestations() -> None:
    """A larger split view, which the share threshold alone does not stop: with 10 nodes at
    ``rho = 0.45`` (``r = t = 6``) a server can, without attestations, decode the sum of two
    nodes ``S'`` (2 noise shares of the 6 the accounting needs): S' is told "S' + P survive, Q
    dropped", P "S' dropped", Q "nobody dropped" (|P| = |Q| = 4): 2 + 4 = 6 shares of each
    self-mask of S', 6 survivors in every view. Every reveal needs its view attested by
    ``max(r, n/2 + 1) = 6`` members, and a member attests one view a round: S' + P attest the
    first view, so P's view gathers only Q's 4 attestations and P refuses."""
    members = list(range(10, 20))
    simulation = NodePrivacyPolicy.simulation()
    nodes = MaskingNodes(members, replace(EXACT, dropout_tolerance=0.45), policy=simulation)
    nodes.setup()
    nodes.pin()
    replies = nodes.round(1)
    pair, group_p, group_q = [10, 11], [12, 13, 14, 15], [16, 17, 18, 19]
    t = replies.thresholds[10]
    r = 6
    assert t == 6 and len(pair) + len(group_q) >= t and len(pair) + len(group_p) >= r
    view_pair = (sorted(pair + group_p), group_q)
    view_p = (sorted(group_p + group_q), pair)
    first = {node: nodes.confirm(1, node, *view_pair) for node in view_pair[0]}
    second = {node: nodes.confirm(1, node, *view_p) for node in group_q}
    for node in group_p:
        with pytest.raises(NodeRefusal, match="attested another view"):
            nodes.confirm(1, node, *view_p)
        with pytest.raises(NodeRefusal, match="attested another view|too few members"):
            nodes.unmask(1, node, *view_p, replies.sealed, second)
    # The pair's own view is attested, so its reveals go through; without P's pair seeds with
    # the pair the server holds nothing that removes the pair's masks with P.
    for node in pair:
        _, seeds = nodes.unmask(1, node, *view_pair, replies.sealed, first)
        assert {peer for _, peer in seeds} == set(group_q)


def test_attestations_cannot_be_forged_or_turned_around() -> None:
    nodes = MaskingNodes([3, 4, 5, 6])
    nodes.setup()
    nodes.pin()
    replies = nodes.round(1)
    view = ([3, 4, 5], [6])
    mine = nodes.confirm(1, 3, *view)  # node 3's attestations, one per other survivor
    # The server hands node 3 its own attestation as if it came from 4 and 5, plus a made-up
    # one: none counts.
    turned = {4: mine[4], 5: mine[5]}
    with pytest.raises(NodeRefusal, match="too few members"):
        nodes.unmask(1, 3, *view, replies.sealed, {4: {3: turned[4]}, 5: {3: b"\0" * 32}})
    # an attestation of another round or view does not count either
    other = attest_view(nodes.pair_secret(4, 3), 2, 4, 3, *view)
    with pytest.raises(NodeRefusal, match="too few members"):
        nodes.unmask(1, 3, *view, replies.sealed, {4: {3: other}})


# --- H2: replies that do not depend on the data -----------------------------------------------


class Exploding(nn.Module):
    """A model whose statistics overflow for large feature values: NaN for some users."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.out = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.linear(x))


def one_user(feature: float) -> FPFLShard:
    features = np.array([[feature, 1.0]], dtype=np.float32)
    return FPFLShard(
        features=features,
        labels=np.array([1]),
        groups=np.array([0]),
        user_index=np.array([0]),
        user_ids=np.array([0]),
        num_groups=2,
        num_classes=2,
    )


def test_huge_weights_are_refused_before_the_data_and_nan_statistics_still_reply() -> None:
    """The review's H2: weights (3e38, 0, 0) made some users' statistics NaN, the encoding then
    failed after the round was counted, and the refusal was a noiseless bit about one user's
    feature (a binary search over 20 rounds found it to 5 decimals). Now weights beyond
    ``fpfl-max-weight`` are refused before any data is read (the same for every node), and a
    node whose policy allows them replies in every round whatever the data (a NaN user
    contributes zeros)."""
    from fedparity.clients import fpfl_handlers

    settings = replace(EXACT, cohort_size=1, rounds=20, dropout_tolerance=0.0)
    weights = np.array([3e38, 0.0, 0.0])
    outcomes: dict[tuple[float, float], tuple[str, ...]] = {}
    for feature in (0.5, 37.61803, -2.0):
        for policy in (EXACT_POLICY, replace(EXACT_POLICY, fpfl_max_weight=1e39)):
            nodes = MaskingNodes([3, 4], settings, policy=policy, population=2)
            nodes.handlers = fpfl_handlers(
                Exploding, lambda _context, f=feature: one_user(f), settings, policy=policy
            )
            nodes.setup()
            nodes.pin()
            outcome = []
            for round_number in (1, 2):
                try:
                    reply = nodes.send(
                        "fpfl_round", 3, nodes.round_message(round_number, weights=weights)
                    )
                    outcome.append("error" if reply.has_error() else "replied")
                except PolicyRefusal as refusal:
                    outcome.append(str(refusal))
            outcomes[(feature, policy.fpfl_max_weight)] = tuple(outcome)
    refused = {value for (_, cap), value in outcomes.items() if cap == 1e4}
    allowed = {value for (_, cap), value in outcomes.items() if cap == 1e39}
    sentence = (
        "refused by this node's privacy policy: the round's model weights are above fpfl-max-weight"
    )
    assert refused == {(sentence, sentence)}  # the same for every user's data
    assert allowed == {("replied", "replied")}  # the same whatever the user's feature


class Fragile(nn.Module):
    """A model whose forward pass fails (standing for any failure that depends on the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a failure that depends on the users' data")


def test_a_failure_while_computing_is_a_counted_round_with_the_noise_share_alone() -> None:
    """Whatever fails while a node computes its statistics, once every refusal is decided the
    round is counted (and charged) and a vector is sent: the noise share over zeros."""
    from fedparity.clients import fpfl_handlers
    from fedparity.clients.fpfl_handlers import FPFL_STATE_KEY, FPFLRunState

    settings = replace(PRIVATE, cohort_size=1, rounds=3, dropout_tolerance=0.0)
    nodes = MaskingNodes([3, 4], settings, policy=STRICT, population=2)
    nodes.handlers = fpfl_handlers(Fragile, lambda _: one_user(1.0), settings, policy=STRICT)
    nodes.setup()
    nodes.pin()
    replies = nodes.round(1)
    assert set(replies.masked) == {3, 4}
    total = nodes.honest_sum(1, replies)
    assert np.isfinite(total).all()
    assert np.abs(total).max() > 0  # the noise shares alone: no statistics, but noise
    state = FPFLRunState.from_record(nodes.contexts[3].state.config_records[FPFL_STATE_KEY])
    assert state.answered == 1 and state.charged_rounds == 1


# --- run parameters beyond the node's settings or policy --------------------------------------


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"cohort_size": 11}, "cohort size is not this node's"),
        ({"rounds": 6}, "rounds is not this node's"),
        ({"epsilon": 4.0}, "epsilon is not this node's"),
        ({"clipping_bound": 2.0}, "clipping bound is not this node's"),
        ({"delta": 1e-5}, "delta is not this node's"),
        ({"accountant": "prv"}, "accountant is not this node's"),
        ({"dropout_tolerance": 0.1}, "dropout tolerance is not this node's"),
        ({"constraint": "accuracy"}, "constraint is not this node's"),
        ({"masking": False}, "secure sum is not this node's"),
        ({"num_groups": 3}, "number of groups is not this node's"),
        ({"session": "other"}, "another session"),
        ({"population_size": 10**8}, "max-population"),
    ],
)
def test_run_parameters_other_than_the_nodes_are_refused_at_setup(
    change: dict, refusal: str
) -> None:
    nodes = MaskingNodes([3, 4], PRIVATE, policy=STRICT)
    parameters = replace(nodes.parameters, **change)
    with pytest.raises((NodeRefusal, PolicyRefusal), match=refusal):
        nodes.setup(parameters, nodes=[3])


def test_a_noise_multiplier_below_the_nodes_epsilon_or_floor_is_refused() -> None:
    nodes = MaskingNodes([3, 4], PRIVATE, policy=STRICT)
    honest = nodes.parameters
    with pytest.raises(NodeRefusal, match="too small for this node's epsilon"):
        nodes.setup(replace(honest, noise_multiplier=honest.noise_multiplier * 0.9), nodes=[3])
    floor = replace(STRICT, fpfl_min_noise_multiplier=honest.noise_multiplier * 1.5)
    strict = MaskingNodes([3, 4], PRIVATE, policy=floor)
    with pytest.raises(PolicyRefusal, match="fpfl-min-noise-multiplier"):
        strict.setup(nodes=[3])
    # more noise than needed is accepted (the ledger charges the sigma actually used)
    more = MaskingNodes([3, 4], PRIVATE, policy=STRICT)
    more.setup(replace(honest, noise_multiplier=honest.noise_multiplier * 2), nodes=[3])


def test_sizes_beyond_the_policy_are_refused_before_any_work() -> None:
    policy = replace(STRICT, fpfl_max_rounds=4, max_groups=2)
    nodes = MaskingNodes([3, 4], PRIVATE, policy=policy)
    with pytest.raises(PolicyRefusal, match="fpfl-max-rounds"):
        nodes.setup(nodes=[3])


def test_malformed_parameters_are_a_message_error_naming_the_field() -> None:
    nodes = MaskingNodes([3, 4], PRIVATE, policy=STRICT)
    content = nodes.setup_message()
    content.config_records["fpfl"]["population-size"] = math.inf
    with pytest.raises(MessageError, match="'population-size'"):
        nodes.send("fpfl_setup", 3, content)
    content = nodes.setup_message()
    content.config_records["fpfl"]["noise-multiplier"] = 0.0  # epsilon without noise
    with pytest.raises(MessageError, match="inconsistent"):
        nodes.send("fpfl_setup", 3, content)


def test_the_digest_changes_with_every_parameter() -> None:
    base = run_parameters(PRIVATE)
    changes = {
        "population_size": 1001,
        "cohort_size": 11,
        "rounds": 6,
        "clipping_bound": 1.5,
        "epsilon": 2.5,
        "delta": 2e-6,
        "noise_multiplier": base.noise_multiplier + 2**-40,
        "accountant": "prv",
        "constraint": "accuracy",
        "num_groups": 3,
        "vector_size": base.vector_size + 1,
        "distributed_noise": False,
        "masking": False,
        "dropout_tolerance": 0.1,
        "session": "pfl",
    }
    digests = {replace(base, **{key: value}).digest() for key, value in changes.items()}
    assert len(digests | {base.digest()}) == len(changes) + 1
    assert FPFLRunParameters.from_fields(base.to_fields()) == base
