"""The FPFL secure sum against an active server: each attack of the security review (findings
H1-H3, M1) run against the real node handlers, as the server would run it.

On the previous main (commit 183bf29) every one of these succeeded: there was no self-mask, the
node took the round's keys, peer list and quantisation range from each message, and it masked
any round number it was sent. Each test below states what the attack would have recovered and
checks that it now recovers nothing, or is refused with a fixed sentence.
"""

from __future__ import annotations

import numpy as np
import pytest
import shamirs

from fedparity.clients.identity import NodeIdentity
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import PolicyRefusal
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from fedparity.mechanisms.crypto.secure_sum import (
    SHAMIR_PRIME,
    MaskingKeyPair,
    combine_self_seed,
    expand_mask,
    round_seed,
    unmask_sum,
)
from tests.support.fpfl_nodes import EXACT, EXACT_POLICY, SALT, MaskingNodes

pytestmark = pytest.mark.usefixtures("task_identity")

MEMBERS = [3, 4, 5, 6]


def pinned(**kwargs: object) -> MaskingNodes:
    nodes = MaskingNodes(MEMBERS, **kwargs)  # type: ignore[arg-type]
    nodes.setup()
    nodes.pin()
    return nodes


def strip_pair_masks(
    vector: np.ndarray, owner: int, seeds: dict[tuple[int, int], bytes], round_number: int
) -> np.ndarray:
    """What the server computes from a node's masked vector once it holds every pair seed of
    that node: the vector minus its pair masks (all that hid it before double masking)."""
    result = vector.copy()
    for (peer, gone), seed in seeds.items():
        assert gone == owner
        mask = expand_mask(seed, vector.size)
        if peer > owner:  # the owner added the mask it shares with a higher id
            result -= mask
        else:
            result += mask
    return result


# --- 1. a slow node is unmasked passively (review H1) -------------------------------------------


def test_a_node_called_dropped_stays_hidden_when_its_reply_arrives() -> None:
    # The server holds node 6's masked vector (it arrived late, or the server called it
    # malformed: the same to the nodes) but tells the others that 6 dropped, so they reveal
    # their pair seeds with 6.
    nodes = pinned()
    replies = nodes.round(1)
    late = replies.masked.pop(6)
    survivors, dropped = [3, 4, 5], [6]
    attestations = nodes.attest(1, survivors, dropped)  # the survivors agree 6 dropped
    answers = {
        node: nodes.unmask(1, node, survivors, dropped, replies.sealed, attestations)
        for node in survivors
    }
    seeds = {pair: seed for _, pairs in answers.values() for pair, seed in pairs.items()}
    assert set(seeds) == {(3, 6), (4, 6), (5, 6)}  # every pair seed of node 6

    # On the previous main that was all that hid x_6: it decoded exactly. Now its self-mask
    # is left in, and no survivor gave a share of it (shares are given for survivors only).
    codec = nodes.codec(len(MEMBERS))
    leftover = strip_pair_masks(late, 6, seeds, 1)
    with pytest.raises(ValueError, match="not a sum"):
        codec.decode(leftover)
    assert all(6 not in shares for shares, _ in answers.values())
    # Asking again, now with 6 among the survivors, is refused by every node: one answer a round.
    for node in survivors:
        with pytest.raises(NodeRefusal, match="only once"):
            nodes.unmask(1, node, MEMBERS, [], replies.sealed)
    # The honest result of the round is unaffected: the three survivors' sum.
    self_seeds = {
        owner: combine_self_seed(
            [shares[owner] for shares, _ in answers.values()], replies.thresholds[owner]
        )
        for owner in survivors
    }
    total = unmask_sum(
        replies.masked, seeds, 1, late.size, participants=MEMBERS, self_seeds=self_seeds
    )
    np.testing.assert_allclose(codec.decode(total), 3 * nodes.true_vector(), atol=1e-9)


def test_a_split_view_with_a_colluder_gets_too_few_shares_of_a_self_mask() -> None:
    # Node 5 colludes with the server (the policy tolerates one colluder), so the server has
    # 5's pair secrets and can open the shares sealed for 5. It tells nodes 3 and 4 that 6
    # dropped (their pair seeds with 6, so it now holds every pair seed of 6) and tells 6 it
    # survived (6's own share of its self-mask). With the colluder's share that makes 2 shares.
    # n_min = 2 here, so only the "colluders + 2" term makes t = 3: with t = 2 the server
    # would rebuild 6's self-mask and read x_6.
    from dataclasses import replace

    from fedparity.mechanisms.crypto.secure_sum import open_share, self_mask

    # Today the view "6 dropped" must also be attested by enough members: 3 and 4 attest it and
    # the colluder 5 makes its own attestations (it knows its pair secrets), so it passes; the
    # share threshold is what stops the attack (t = 4 with one colluder among 4 members).
    nodes = pinned(policy=replace(EXACT_POLICY, tolerated_colluders=1))
    replies = nodes.round(1)
    assert replies.thresholds[6] == 4
    from fedparity.mechanisms.crypto.secure_sum import attest_view

    view = ([3, 4, 5], [6])
    attestations = {node: nodes.confirm(1, node, *view) for node in (3, 4)}
    attestations[5] = {
        peer: attest_view(nodes.pair_secret(5, peer), 1, 5, peer, *view) for peer in (3, 4)
    }
    seeds: dict[tuple[int, int], bytes] = {}
    for node in (3, 4):
        _, given = nodes.unmask(1, node, *view, replies.sealed, attestations)
        seeds |= given
    seeds[(5, 6)] = round_seed(nodes.pair_secret(5, 6), 1)  # the colluder's own
    own_shares, _ = nodes.unmask(1, 6, MEMBERS, [], replies.sealed)
    colluders_share = open_share(nodes.pair_secret(5, 6), 1, 6, 5, replies.sealed[6][5])
    # The attacker's best guess at 6's seed: the line through the two shares it holds, at 0.
    points = [
        shamirs.share(int.from_bytes(share[:4], "big"), int.from_bytes(share[4:], "big"))
        for share in (own_shares[6], colluders_share)
    ]
    guessed_value = shamirs.interpolate(points, modulus=SHAMIR_PRIME)
    guessed = (guessed_value % 2**128).to_bytes(16, "big")
    leftover = strip_pair_masks(replies.masked[6], 6, seeds, 1) - self_mask(
        guessed, replies.masked[6].size
    )
    with pytest.raises(ValueError, match="not a sum"):
        nodes.codec(len(MEMBERS)).decode(leftover)


# --- 2. replayed rounds and reveals (review H2) --------------------------------------------------


def test_a_round_is_masked_at_most_once_and_in_order() -> None:
    nodes = pinned()
    nodes.round(2)
    for replayed in (2, 1):  # the same round again, or an older one
        with pytest.raises(NodeRefusal, match="masked already; refusing a replay"):
            nodes.round(replayed, nodes=[3])
    nodes.round(3, nodes=[3])  # the next round is answered


def test_the_attack_a_replay_enabled_on_pair_masks_alone() -> None:
    # Why the rule: two vectors masked with the same round's pair masks (no self-mask, as on
    # the previous main) differ by exactly the difference of the values.
    from fedparity.mechanisms.crypto.secure_sum import mask_vector, pair_secrets

    keys = {node: MaskingKeyPair.generate() for node in (1, 2)}
    table = {node: key.public_bytes() for node, key in keys.items()}
    secrets = pair_secrets(1, keys[1], table, SALT)
    first = mask_vector(np.array([5, 7], dtype=np.uint64), 1, secrets, 4)
    second = mask_vector(np.array([2, 7], dtype=np.uint64), 1, secrets, 4)
    assert list(first - second) == [3, 0]


def test_an_unmask_is_given_once_and_only_for_the_round_masked_last() -> None:
    nodes = pinned()
    boxes = {peer: {3: b"sealed"} for peer in MEMBERS}
    with pytest.raises(NodeRefusal, match="only once, for the round this node masked last"):
        nodes.unmask(1, 3, [3, 4, 5], [6], boxes)  # nothing masked yet: a "pre-reveal"
    replies = nodes.round(1)
    with pytest.raises(NodeRefusal, match="only once, for the round this node masked last"):
        nodes.unmask(2, 3, [3, 4, 5], [6], replies.sealed)  # a round not masked yet
    attestations = nodes.attest(1, [3, 4, 5], [6])
    nodes.unmask(1, 3, MEMBERS, [], replies.sealed)
    with pytest.raises(NodeRefusal, match="only once"):
        nodes.unmask(1, 3, [3, 4, 5], [6], replies.sealed, attestations)  # the same round, again


def test_an_unmask_request_must_split_the_round_members_truly() -> None:
    nodes = pinned()
    replies = nodes.round(1)
    for survivors, dropped in (
        ([3, 4, 5], [7]),  # 7 is not a member of the run
        ([3, 4, 5], []),  # 6 is in neither list
        ([3, 4, 5], [5]),  # in both
        ([4, 5], [3]),  # this node is not a survivor
    ):
        with pytest.raises(NodeRefusal, match="split the round's members"):
            nodes.unmask(1, 3, survivors, dropped, {**replies.sealed, 7: {3: b""}})


def test_an_altered_share_is_refused() -> None:
    nodes = pinned()
    replies = nodes.round(1)
    box = bytearray(replies.sealed[4][3])
    box[0] ^= 1
    altered = {**replies.sealed, 4: {**replies.sealed[4], 3: bytes(box)}}
    with pytest.raises(NodeRefusal, match="does not open"):
        nodes.unmask(1, 3, MEMBERS, [], altered)
    # a share sealed for another node does not open here either
    swapped = {**replies.sealed, 4: {**replies.sealed[4], 3: replies.sealed[4][5]}}
    fresh = pinned()
    fresh_replies = fresh.round(1)
    with pytest.raises(NodeRefusal, match="does not open"):
        fresh.unmask(
            1, 3, MEMBERS, [], {**fresh_replies.sealed, 4: {3: fresh_replies.sealed[4][5]}}
        )
    assert swapped  # (built from the first federation's boxes: the same rule)


# --- 3. keys are pinned and, with a roster, authenticated (review H3) ----------------------------


def test_the_key_table_is_pinned_for_the_run() -> None:
    from dataclasses import replace

    nodes = pinned()
    honest = nodes.key_table()
    substituted = replace(
        honest,
        public_keys=tuple(
            key if node != 4 else MaskingKeyPair.generate().public_bytes()
            for node, key in zip(MEMBERS, honest.public_keys, strict=True)
        ),
    )
    with pytest.raises(NodeRefusal, match="pinned for this run; refusing a change"):
        nodes.pin(substituted, nodes=[3])
    # a round is always over the pinned members: a round naming another table (its digest)
    # is refused, so there are no per-round keys or members to substitute
    with pytest.raises(NodeRefusal, match="another run's parameters"):
        nodes.round(1, nodes=[3], run_digest=substituted.run_digest())


def test_a_claimed_crowd_of_peers_is_bounded_by_the_policy() -> None:
    # The attack: 1,000 claimed peers shrink each node's noise share 16-fold (n_min = 800).
    from dataclasses import replace

    nodes = MaskingNodes([3], policy=replace(EXACT_POLICY, max_nodes=100))
    nodes.setup()
    table = nodes.key_table()
    crowd = tuple(range(1000, 1999))
    table = replace(
        table,
        members=(3, *crowd),
        public_keys=(
            table.public_keys[0],
            *(MaskingKeyPair.generate().public_bytes() for _ in crowd),
        ),
    )
    with pytest.raises(PolicyRefusal, match="node count is outside"):
        nodes.pin(table)


def roster_nodes() -> MaskingNodes:
    keys = {node: IdentityKey.generate() for node in MEMBERS}
    roster = Roster.from_keys({f"node-{node}": key for node, key in keys.items()})
    identities = {node: NodeIdentity(keys[node], roster) for node in MEMBERS}
    nodes = MaskingNodes(MEMBERS, identities=identities)
    nodes.setup()
    return nodes


def test_with_a_roster_every_key_is_signed_by_a_distinct_member() -> None:
    honest = roster_nodes()
    honest.pin()  # the honest table passes
    np.testing.assert_allclose(
        honest.honest_sum(1, honest.round(1)), 4 * honest.true_vector(), atol=1e-9
    )

    # The server substitutes its own masking key for node 4 (and signs it with its own key).
    from dataclasses import replace

    from fedparity.mechanisms.crypto.secure_sum import masking_key_transcript

    nodes = roster_nodes()
    impostor_identity, impostor = IdentityKey.generate(), MaskingKeyPair.generate()
    table = nodes.key_table()
    digest = nodes.parameters.digest()
    index = MEMBERS.index(4)

    def swapped(values: tuple[bytes, ...], value: bytes) -> tuple[bytes, ...]:
        return tuple(value if i == index else v for i, v in enumerate(values))

    table = replace(table, public_keys=swapped(table.public_keys, impostor.public_bytes()))
    for signer, refusal in (
        (IdentityKey.generate(), "not on this node's roster"),  # a key of its own
        (None, "not signed by its node"),  # node 4's true identity, old signature
    ):
        forged = table
        if signer is not None:
            forged = replace(
                table,
                identity_keys=swapped(table.identity_keys, signer.public_bytes()),
                signatures=swapped(
                    table.signatures,
                    signer.sign(masking_key_transcript(SALT, 4, impostor.public_bytes(), digest)),
                ),
            )
        with pytest.raises(NodeRefusal, match=refusal):
            nodes.pin(forged, nodes=[3])
    # An invented extra peer with an identity of the server's own is refused the same way.
    honest_table = nodes.key_table()
    invented = replace(
        honest_table,
        members=(*MEMBERS, 99),
        public_keys=(*honest_table.public_keys, impostor.public_bytes()),
        identity_keys=(*honest_table.identity_keys, impostor_identity.public_bytes()),
        signatures=(
            *honest_table.signatures,
            impostor_identity.sign(
                masking_key_transcript(SALT, 99, impostor.public_bytes(), digest)
            ),
        ),
    )
    with pytest.raises(NodeRefusal, match="not on this node's roster"):
        nodes.pin(invented, nodes=[3])
    # and an unsigned table is refused by a node that has a roster
    unsigned = replace(nodes.key_table(), identity_keys=(), signatures=())
    with pytest.raises(NodeRefusal, match="lacks the members' signatures"):
        nodes.pin(unsigned, nodes=[3])


# --- 4. the quantisation is the node's own (review M1) -------------------------------------------


def test_a_range_in_the_message_changes_nothing() -> None:
    # On the previous main, "codec-range" = 1e16 gave a step of 32 (swamping the noise) and
    # 1e-3 clamped every value to its sign. A round field of that name changes nothing, and a
    # codec in the key table other than the one the node derives is refused at setup.
    from dataclasses import replace

    nodes = pinned()
    for round_number, hostile in ((1, 1e16), (2, 1e-3)):
        content = nodes.round_message(round_number)
        content.config_records["config"]["codec-range"] = hostile
        replies = nodes.round(round_number)
        total = nodes.honest_sum(round_number, replies)
        np.testing.assert_allclose(total, 4 * nodes.true_vector(), atol=1e-9)
    fresh = MaskingNodes(MEMBERS)
    fresh.setup()
    honest = fresh.key_table()
    for hostile in (
        replace(honest, codec_scale=honest.codec_scale / 2**16),  # type: ignore[operator]
        replace(honest, codec_clip_range=1e-3),
    ):
        with pytest.raises(NodeRefusal, match="codec is not the one this node derives"):
            fresh.pin(hostile, nodes=[3])


def test_a_population_that_would_coarsen_the_step_or_clamp_is_refused() -> None:
    from fedparity.clients import FPFLNodeSettings
    from fedparity.clients.fpfl_handlers import MAX_STEP_TO_SHARE_STD
    from fedparity.clients.policy import NodePrivacyPolicy
    from fedparity.mechanisms.crypto.secure_sum import contribution_codec

    # A private run, whose noise share is what the step must stay far below.
    private = FPFLNodeSettings(
        constraint="fnr", cohort_size=10, rounds=5, clipping_bound=1.0, epsilon=2.0, delta=1e-5
    )
    policy = NodePrivacyPolicy(
        max_population=10**15,
        allow_ephemeral_ledger=True,
        fpfl_min_noise_multiplier=0.0,
        require_roster=False,
    )
    huge = 10**15
    nodes = MaskingNodes(MEMBERS, private, policy=policy, population=huge)
    sigma = private.noise_multiplier(huge)
    codec = contribution_codec(
        per_user_bound=1.0, population_size=huge, noise_std=sigma, num_nodes=len(MEMBERS)
    )
    share = private.noise_share_std(huge, len(MEMBERS))
    assert codec.step > MAX_STEP_TO_SHARE_STD * share  # what the attack would have obtained
    nodes.setup()  # K is agreed at setup now, and the codec with it: refused at the table
    with pytest.raises(NodeRefusal, match="quantisation step is not far below"):
        nodes.pin(nodes=[3])
    small = MaskingNodes(MEMBERS, private, policy=policy, population=15)  # 20 users here
    with pytest.raises(NodeRefusal, match="below this node's own users"):
        small.setup(nodes=[3])
    assert EXACT.clipping_bound == 1.0


# --- the server's own protocol over the real nodes (an in-process grid) ------------------------


class NodesGrid:
    """A Flower grid whose nodes are :class:`MaskingNodes` in this process: each pushed message
    is handled at once by its node's real handler (a refusal becomes an error reply, as
    Flower sends it). ``tamper(node, reply)`` may change a reply or drop it (``None``)."""

    def __init__(self, nodes: MaskingNodes, tamper=None) -> None:  # noqa: ANN001
        self.nodes, self.tamper = nodes, tamper
        self.sent: list[str] = []
        self.receivers: list[int] = []
        self.replies: dict[str, object] = {}

    def push_messages(self, messages: list) -> list[str]:  # noqa: ANN001
        from flwr.app import Error, Message

        ids = []
        for number, message in enumerate(messages):
            message_id = f"{len(self.sent)}-{number}"
            message.metadata.__dict__["_message_id"] = message_id
            node = int(message.metadata.dst_node_id)
            action = message.metadata.message_type.removeprefix("query.")
            self.sent.append(action)
            self.receivers.append(node)
            try:
                reply = self.nodes.handlers[action](message, self.nodes.contexts[node])
            except (NodeRefusal, PolicyRefusal) as refusal:
                reply = Message(Error(code=0, reason=str(refusal)), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            if self.tamper is not None:
                reply = self.tamper(node, reply)
            if reply is not None:
                self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def asked(self, action: str) -> list[int]:
        """The nodes sent ``action``, in the order sent."""
        return [n for a, n in zip(self.sent, self.receivers, strict=True) if a == action]

    def pull_messages(self, message_ids: set[str]) -> list:  # noqa: ANN001
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def server_protocol(grid: NodesGrid):  # noqa: ANN201
    from fedparity.strategies.fpfl import FPFLProtocol

    return FPFLProtocol(
        grid,  # type: ignore[arg-type]
        node_ids=grid.nodes.ids,
        parameters=grid.nodes.parameters,
        reply_timeout=1.0,
    )


def with_threshold(value: object):  # noqa: ANN201
    """A tamper that sets node 6's share threshold to ``value`` in its masked reply."""

    def tamper(node: int, reply):  # noqa: ANN001, ANN202
        shares = reply.content.config_records.get("shares") if not reply.has_error() else None
        if node == 6 and shares is not None:
            shares["threshold"] = value
        return reply

    return tamper


def test_the_server_unmasks_with_each_nodes_own_threshold_of_shares() -> None:
    nodes = MaskingNodes(MEMBERS)
    grid = NodesGrid(nodes)
    protocol = server_protocol(grid)
    protocol.setup()
    outcome = protocol.run_round(1, nodes.weights)
    assert outcome.total is not None, outcome.reason
    np.testing.assert_allclose(outcome.total, 4 * nodes.true_vector(), atol=1e-9)
    # Nobody dropped: only the survivors holding the smallest share indices are asked, as many
    # as the largest threshold (3 here); their shares rebuild every seed. No attestation.
    assert grid.sent.count("fpfl_reveal") == 3
    assert grid.asked("fpfl_reveal") == MEMBERS[:3]
    assert "fpfl_confirm" not in grid.sent


def test_with_a_node_dropped_every_survivor_is_asked_for_its_pair_seed() -> None:
    # Node 5's masked reply is lost: the pair masks of 5 in the other vectors need the pair
    # seed of each of the three survivors, so all three are asked, after all three attested
    # the view (the consistency check of a round with a dropped node).
    nodes = MaskingNodes(MEMBERS)

    def tamper(node: int, reply):  # noqa: ANN001, ANN202
        return None if node == 5 and grid.sent[-1] == "fpfl_round" else reply

    grid = NodesGrid(nodes, tamper)
    protocol = server_protocol(grid)
    protocol.setup()
    outcome = protocol.run_round(1, nodes.weights)
    assert outcome.missing == [5]
    assert outcome.total is not None, outcome.reason
    np.testing.assert_allclose(outcome.total, 3 * nodes.true_vector(), atol=1e-9)
    assert grid.asked("fpfl_confirm") == [3, 4, 6]
    assert grid.asked("fpfl_reveal") == [3, 4, 6]


@pytest.mark.parametrize("claimed", [1, 5, -3, 2.0, "3", True, b"3", [3]])
def test_a_reply_with_an_impossible_share_threshold_is_rejected(claimed: object) -> None:
    # The threshold tells the server how many shares rebuild the node's self-mask, among the
    # 4 members; a reply claiming another kind of number is malformed: node 6 is counted
    # rejected and the three others' sum is recovered without it.
    nodes = MaskingNodes(MEMBERS)
    grid = NodesGrid(nodes, with_threshold(claimed))
    protocol = server_protocol(grid)
    protocol.setup()
    outcome = protocol.run_round(1, nodes.weights)
    assert [node for node, _ in outcome.rejected] == [6]
    assert "threshold" in outcome.rejected[0][1] or "'threshold'" in outcome.rejected[0][1]
    assert outcome.total is not None, outcome.reason
    np.testing.assert_allclose(outcome.total, 3 * nodes.true_vector(), atol=1e-9)


def test_no_survivor_reveals_for_a_sum_whose_self_masks_cannot_be_rebuilt() -> None:
    # Node 6 split its self-mask 4-of-4 (as a stricter policy would); node 5's reply is lost.
    # Three survivors hold three shares of 6's seed: the sum cannot be unmasked, so no survivor
    # is asked to reveal pair seeds of node 5 or shares of anyone (before, all three were, and
    # the server then rebuilt a wrong seed for 6).
    nodes = MaskingNodes(MEMBERS)
    threshold_4 = with_threshold(4)

    def tamper(node: int, reply):  # noqa: ANN001, ANN202
        return None if node == 5 and grid.sent[-1] == "fpfl_round" else threshold_4(node, reply)

    grid = NodesGrid(nodes, tamper)
    protocol = server_protocol(grid)
    protocol.setup()
    outcome = protocol.run_round(1, nodes.weights)
    assert outcome.total is None and outcome.missing == [5]
    assert "cannot rebuild the self-mask of node(s) [6]" in outcome.reason
    assert "fpfl_reveal" not in grid.sent
