"""FedEvalFair's CKKS protocol against an *active* server (security review H4), with the real
handlers (:func:`fedparity.clients.fedevalfair_handlers`) and real TenSEAL ciphertexts.

The server holds the public key: it can encrypt anything, add it to a holder's ciphertext and
call the result a sum. Each attack below is first shown to work on the path the previous
protocol took -- a holder decrypted whatever "sum" it was sent and checked its count slot
against the count the server claimed (``open_sum`` with the server's count) -- and then
refused by today's handlers, which decrypt only sums they recompute (or that a roster member
endorsed) from ciphertexts each signed by a distinct roster member for this run and round.

Differencing within one run (security review 2026-11-26, M1): every holder has the key, so a
server asked two key holders to release over two round-2 sets of one run and subtracted the
releases. Today every round-2 holder commits once per run to one pair of sets and a key holder
releases only a pair every round-2 holder committed to; releases are counted per secret key.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedparity.clients import HolderRows, fedevalfair_handlers
from fedparity.clients.fedevalfair import ClientStatistics, open_sum, round1_vector
from fedparity.clients.fedevalfair_handlers import (
    FEF_STATE_KEY,
    JOURNAL_UNUSABLE_REPLY,
    RELEASE_CAP_RULE,
)
from fedparity.clients.identity import NodeIdentity
from fedparity.clients.messages import NodeRefusal, session_state_key
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.mechanisms.crypto.ckks import (
    CommitmentConflict,
    KeyPaths,
    SignedCiphertext,
    UnverifiedSumError,
    add_ciphertexts,
    contributors_digest,
    decrypt_vector,
    encrypt_vector,
    endorsement_transcript,
    flood_key,
    journal_file_name,
    key_fingerprint,
    load_public_context,
    load_secret_context,
)
from fedparity.mechanisms.crypto.identity import IdentityError, IdentityKey, Roster
from fedparity.mechanisms.protocol import (
    FEF_ENDORSE_MESSAGE_TYPE,
    FEF_IDENTITY_REFUSAL,
    FEF_KEY,
    FEF_ROUND_MESSAGE_TYPES,
    RELEASE_SIZE,
    ROUND1_SIZE,
    ROUND2_SIZE,
    STAGE1_WIDTH,
)
from fedparity.mechanisms.protocol.fedevalfair import FEF_COMMIT_MESSAGE_TYPE
from fedparity.strategies.fedevalfair import FedEvalFairProtocol
from fedparity.strategies.replies import session_records

pytestmark = pytest.mark.usefixtures("task_identity")

RUN_ID = 7
NAMES = ("a", "b", "c")


@dataclass(frozen=True)
class Federation:
    keys: KeyPaths
    identities: dict[str, IdentityKey]
    roster: Roster

    def handlers(
        self,
        name: str,
        sessions: tuple[str, ...] = ("",),
        policy: NodePrivacyPolicy | None = None,
    ) -> dict:
        identity = NodeIdentity(self.identities[name], self.roster)
        return fedevalfair_handlers(
            rows_of,
            secret_context=self.keys.secret,
            num_resamples=30,
            bootstrap_rng=lambda context: np.random.default_rng(context.node_id),
            policy=policy or NodePrivacyPolicy(),  # min-holders 2
            identity=lambda context: identity,
            sessions=sessions,
        )


def rows_of(arrays: ArrayRecord, context: Context) -> HolderRows:
    """A holder's rows: 400 rows, both groups and both predictions present."""
    rng = np.random.default_rng(1000 + context.node_id)
    groups = np.arange(400) % 2
    labels = rng.integers(0, 2, 400)
    predictions = (rng.random(400) < 0.4 + 0.1 * groups).astype(int)
    return HolderRows(labels=labels, predictions=predictions, groups=groups)


@pytest.fixture(scope="module")
def federation(ckks_keys: KeyPaths) -> Federation:
    identities = {name: IdentityKey.generate() for name in NAMES}
    return Federation(
        ckks_keys,
        identities,
        Roster.from_keys(identities),
    )


def context(name: str, run_id: int = RUN_ID, ledgers: Path | None = None) -> Context:
    """Holder ``name``'s context in run ``run_id``; with ``ledgers``, its ledger folder (and
    key journal) is ``ledgers / name``, else the default one in the test session's home."""
    node_config = {} if ledgers is None else {"ledger-dir": str(ledgers / name)}
    return Context(
        run_id=run_id,
        node_id=NAMES.index(name) + 1,
        node_config=node_config,
        state=RecordDict(),
        run_config={},
    )


def send(  # noqa: ANN201
    federation: Federation,
    name: str,
    node: Context,
    action: str,
    content: RecordDict,
    session: str | None = None,
    policy: NodePrivacyPolicy | None = None,
):
    """Deliver ``content`` to holder ``name``; with ``session``, as the pipeline's nodes (whose
    run defines the sessions "fpfl" and "pfl") and labelled with it."""
    sessions: tuple[str, ...] = ("",)
    if session is not None:
        sessions = ("fpfl", "pfl")  # the pipeline's two tests
        content = RecordDict({**content, **session_records(session)})
    message_type = {
        "fef_round1": FEF_ROUND_MESSAGE_TYPES[0],
        "fef_endorse": FEF_ENDORSE_MESSAGE_TYPE,
        "fef_round2": FEF_ROUND_MESSAGE_TYPES[1],
        "fef_commit": FEF_COMMIT_MESSAGE_TYPE,
        "fef_round3": FEF_ROUND_MESSAGE_TYPES[2],
    }[action]
    message = Message(content=content, dst_node_id=node.node_id, message_type=message_type)
    return federation.handlers(name, sessions, policy)[action](message, node)


def signed(reply: Message) -> SignedCiphertext:
    record = reply.content.array_records[FEF_KEY]
    return SignedCiphertext(
        record["ciphertext"].numpy().tobytes(),
        record["signer"].numpy().tobytes(),
        record["signature"].numpy().tobytes(),
    )


@dataclass
class Round1:
    contexts: dict[str, Context]
    entries: dict[str, SignedCiphertext]
    protocol: FedEvalFairProtocol
    session: str | None = None

    def contribution(self, name: str) -> np.ndarray:
        """What holder ``name`` encrypted in round 1 (the test may look; the server may not)."""
        state = self.contexts[name].state.array_records[
            session_state_key(FEF_STATE_KEY, self.session or "")
        ]
        statistics = ClientStatistics.from_array(state["summaries"].numpy())
        return round1_vector(statistics, mu0=0.0, tolerance=None)


def round1(
    federation: Federation,
    run_id: int = RUN_ID,
    *,
    session: str | None = None,
    contexts: dict[str, Context] | None = None,
    ledgers: Path | None = None,
) -> Round1:
    protocol = FedEvalFairProtocol(load_public_context(federation.keys.public))
    if contexts is None:
        contexts = {name: context(name, run_id, ledgers) for name in NAMES}
    content = protocol.round1_content(ArrayRecord())
    entries = {
        name: signed(send(federation, name, contexts[name], "fef_round1", content, session))
        for name in NAMES
    }
    return Round1(contexts, entries, protocol, session)


def old_path_releases(federation: Federation, payloads: list[bytes], claimed: int) -> np.ndarray:
    """What a holder of the previous protocol did with a "sum" the server sent with a count:
    decrypt it and check the count slot against the server's count, then use the values."""
    public = load_public_context(federation.keys.public)
    total, rejected = add_ciphertexts(public, payloads, expected_size=ROUND1_SIZE)
    assert not rejected
    secret = load_secret_context(federation.keys.secret)
    return open_sum(secret, total, ROUND1_SIZE, claimed)


def encrypt_last_slot(federation: Federation) -> bytes:
    """``Enc_pk(0, ..., 0, 1)``: anyone with the public key (the server) can make it."""
    public = load_public_context(federation.keys.public)
    return encrypt_vector(public, np.eye(ROUND1_SIZE)[-1])


# --- the attacks -----------------------------------------------------------------------------


def test_enc_zero_one_added_to_one_ciphertext_is_refused(federation: Federation) -> None:
    """The demonstrated attack: ``c_A + Enc(0, ..., 0, 1)`` called a sum of two holders."""
    first = round1(federation)
    victim = first.entries["a"]
    forged = encrypt_last_slot(federation)
    # Previous protocol: the count slot says 2, as claimed -> the key holder releases A's values.
    leaked = old_path_releases(federation, [victim.payload, forged], claimed=2)
    np.testing.assert_allclose(leaked, first.contribution("a")[:-1], rtol=1e-6, atol=1e-4)

    # Now: the forged ciphertext carries no roster member's signature...
    stranger = IdentityKey.generate()
    fake = SignedCiphertext(forged, stranger.public_bytes(), stranger.sign(b"anything"))
    content = first.protocol.endorse_content([victim, fake])
    with pytest.raises(UnverifiedSumError, match="not on the roster"):
        send(federation, "b", first.contexts["b"], "fef_endorse", content)
    # ...and a round-2 holder sent the forged sum directly, with A and itself named as the
    # contributors, finds no endorsement of it.
    public = load_public_context(federation.keys.public)
    total, _ = add_ciphertexts(public, [victim.payload, forged], expected_size=ROUND1_SIZE)
    contributors = [victim.signer, first.entries["b"].signer]
    content = first.protocol.round2_content(total, contributors, [])
    with pytest.raises(UnverifiedSumError, match="no endorsement"):
        send(federation, "b", first.contexts["b"], "fef_round2", content)


def test_one_holders_ciphertext_as_a_sum_is_refused(federation: Federation) -> None:
    first = round1(federation)
    victim = first.entries["a"]
    # Previous protocol (with the node's min-holders policy): a count of 1 was refused, but the
    # server claimed any count it liked; with Enc(0..1) added, count 2 passed (test above).
    np.testing.assert_allclose(
        old_path_releases(federation, [victim.payload], claimed=1),
        first.contribution("a")[:-1],
        rtol=1e-6,
        atol=1e-4,
    )
    with pytest.raises(UnverifiedSumError, match="fewer than min-holders"):
        send(
            federation,
            "b",
            first.contexts["b"],
            "fef_endorse",
            first.protocol.endorse_content([victim]),
        )
    # A key holder asked to release a "sum" of A alone (round 1 and round 2) refuses too.
    content = first.protocol.round3_content([victim], [victim])
    with pytest.raises(UnverifiedSumError, match="fewer than min-holders"):
        send(federation, "b", first.contexts["b"], "fef_round3", content)


def test_a_ciphertext_signed_by_a_key_off_the_roster_is_refused(federation: Federation) -> None:
    """The server (or anyone) with an identity key of its own, not on the holders' roster,
    signs ``Enc(0, ..., 0, 1)`` correctly for this run and round: still not a holder."""
    from fedparity.mechanisms.crypto.ckks import ciphertext_transcript

    first = round1(federation)
    victim = first.entries["a"]
    forged = encrypt_last_slot(federation)
    intruder = IdentityKey.generate()
    signature = intruder.sign(
        ciphertext_transcript(RUN_ID, 1, hashlib.sha256(forged).digest(), b"")
    )
    fake = SignedCiphertext(forged, intruder.public_bytes(), signature)
    np.testing.assert_allclose(  # without the roster check this sum opens A's values
        old_path_releases(federation, [victim.payload, fake.payload], claimed=2),
        first.contribution("a")[:-1],
        rtol=1e-6,
        atol=1e-4,
    )
    # A server-side check (signature valid) passes; the holders' roster check does not.
    accepted = first.protocol.collect_round(
        1, [1, 99], [reply_of(1, victim), reply_of(99, fake)], ROUND1_SIZE, run_id=RUN_ID
    )
    assert list(accepted.accepted) == [1, 99]
    with pytest.raises(UnverifiedSumError, match="not on the roster"):
        send(
            federation,
            "b",
            first.contexts["b"],
            "fef_endorse",
            first.protocol.endorse_content([victim, fake]),
        )
    with pytest.raises(UnverifiedSumError, match="not on the roster"):
        send(
            federation,
            "b",
            first.contexts["b"],
            "fef_round3",
            first.protocol.round3_content([victim, fake], [victim, fake]),
        )


def test_a_ciphertext_replayed_from_another_run_is_refused(federation: Federation) -> None:
    """Run 7's ciphertext of B, replayed into run 8 next to A's: were the server to know B's
    run-7 values (e.g. by differencing two earlier releases), this sum would give A's."""
    earlier = round1(federation, run_id=RUN_ID)
    now = round1(federation, run_id=RUN_ID + 1)
    victim, replayed = now.entries["a"], earlier.entries["b"]
    opened = old_path_releases(federation, [victim.payload, replayed.payload], claimed=2)
    np.testing.assert_allclose(
        opened - earlier.contribution("b")[:-1], now.contribution("a")[:-1], rtol=1e-6, atol=1e-4
    )
    verifier = now.contexts["c"]
    content = now.protocol.endorse_content([victim, replayed])
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and round"):
        send(federation, "c", verifier, "fef_endorse", content)


def test_a_ciphertext_replayed_from_another_round_is_refused(federation: Federation) -> None:
    """A's round-1 ciphertext offered as one of round 2 (in round 3) and a round-2 signature
    over another round-1 set: each signature holds for one round and one reference only."""
    first = round1(federation)
    entries = list(first.entries.values())
    content = first.protocol.round3_content(entries, entries)
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and round"):
        send(federation, "b", first.contexts["b"], "fef_round3", content)


def test_a_duplicated_holder_is_refused(federation: Federation) -> None:
    """A's ciphertext twice: a "sum of two" that is twice A's values."""
    first = round1(federation)
    victim = first.entries["a"]
    doubled = old_path_releases(federation, [victim.payload, victim.payload], claimed=2)
    np.testing.assert_allclose(doubled / 2, first.contribution("a")[:-1], rtol=1e-6, atol=1e-4)
    with pytest.raises(UnverifiedSumError, match="same member"):
        send(
            federation,
            "b",
            first.contexts["b"],
            "fef_endorse",
            first.protocol.endorse_content([victim, victim]),
        )
    # The server itself also refuses a second node that uses an identity already seen.
    collected = first.protocol.collect_round(
        1, [1, 2], [reply_of(1, victim), reply_of(2, victim)], ROUND1_SIZE, run_id=RUN_ID
    )
    assert list(collected.accepted) == [1]
    assert "already used" in collected.rejected[0].reason


# --- what an honest run still does -------------------------------------------------------------


def through_round2(
    federation: Federation, run_id: int = RUN_ID, *, ledgers: Path | None = None
) -> tuple[Round1, dict[str, SignedCiphertext]]:
    """An honest run up to round 2: every holder's round-1 ciphertext, C's endorsement of
    their sum, every holder's round-2 ciphertext."""
    first = round1(federation, run_id, ledgers=ledgers)
    entries = list(first.entries.values())
    reply = send(
        federation, "c", first.contexts["c"], "fef_endorse", first.protocol.endorse_content(entries)
    )
    record = reply.content.array_records[FEF_KEY]
    total = record["sum"].numpy().tobytes()
    endorsement = (record["endorser"].numpy().tobytes(), record["endorsement"].numpy().tobytes())
    content = first.protocol.round2_content(
        total, [entry.signer for entry in entries], [endorsement]
    )
    second = {
        name: signed(send(federation, name, first.contexts[name], "fef_round2", content))
        for name in NAMES
    }
    return first, second


def commit(
    federation: Federation,
    first: Round1,
    round2: dict[str, SignedCiphertext],
    signers: tuple[str, ...] | None = None,
    contexts: dict[str, Context] | None = None,
) -> list[tuple[bytes, bytes]]:
    """Ask the holders of ``round2`` (or ``signers``) to commit to round 1 and ``round2``;
    their ``(signer, signature)`` commitments."""
    content = first.protocol.commit_content(list(first.entries.values()), list(round2.values()))
    contexts = contexts or first.contexts
    commitments = []
    for name in signers or tuple(round2):
        record = send(federation, name, contexts[name], "fef_commit", content).content
        commitments.append(
            (
                record.array_records[FEF_KEY]["signer"].numpy().tobytes(),
                record.array_records[FEF_KEY]["commitment"].numpy().tobytes(),
            )
        )
    return commitments


def release(
    federation: Federation,
    first: Round1,
    name: str,
    round2: dict[str, SignedCiphertext],
    commitments: list[tuple[bytes, bytes]],
    policy: NodePrivacyPolicy | None = None,
) -> np.ndarray:
    """Key holder ``name``'s release over round 1 and ``round2`` with ``commitments``."""
    content = first.protocol.round3_content(
        list(first.entries.values()), list(round2.values()), commitments
    )
    reply = send(federation, name, first.contexts[name], "fef_round3", content, policy=policy)
    return reply.content.array_records[FEF_KEY]["release"].numpy()


def test_the_honest_exchange_completes_and_a_node_releases_once(
    federation: Federation, tmp_path: Path
) -> None:
    first = round1(federation, ledgers=tmp_path)
    entries = list(first.entries.values())
    reply = send(
        federation, "c", first.contexts["c"], "fef_endorse", first.protocol.endorse_content(entries)
    )
    record = reply.content.array_records[FEF_KEY]
    total = record["sum"].numpy().tobytes()
    contributors = sorted(entry.signer for entry in entries)
    endorsement = (record["endorser"].numpy().tobytes(), record["endorsement"].numpy().tobytes())
    content = first.protocol.round2_content(total, contributors, [endorsement])
    second = {
        name: signed(send(federation, name, first.contexts[name], "fef_round2", content))
        for name in NAMES
    }
    # A holder answers round 2 once per run, and only with its own ciphertext in the sum.
    with pytest.raises(PolicyRefusal, match="one ciphertext per round"):
        send(federation, "a", first.contexts["a"], "fef_round2", content)
    commitments = commit(federation, first, second)
    assert commit(federation, first, second, ("a",)) == commitments[:1]  # the same, again
    released = release(federation, first, "b", second, commitments)
    assert released.shape == (RELEASE_SIZE,)
    # The other key holder releases the very same (keyed) noisy values; nobody releases twice.
    again = release(federation, first, "c", second, commitments)
    np.testing.assert_array_equal(again, released)
    with pytest.raises(PolicyRefusal, match="releases at most once per run"):
        release(federation, first, "b", second, commitments)
    # The endorsement is bound to the contributors: naming only two of them breaks it.
    forged = first.protocol.round2_content(total, contributors[:2], [endorsement])
    fresh = round1(federation, ledgers=tmp_path / "fresh")
    with pytest.raises(UnverifiedSumError):
        send(federation, "a", fresh.contexts["a"], "fef_round2", forged)
    assert endorsement_transcript(RUN_ID, 1, hashlib.sha256(total).digest(), contributors)
    assert contributors_digest(contributors) == contributors_digest(reversed(contributors))
    assert ROUND2_SIZE > ROUND1_SIZE


def test_a_round2_ciphertext_altered_in_its_random_effects_slots_is_refused(
    federation: Federation,
) -> None:
    """The random-effects sums (sum u^2 and the tau^2 grid) and the pooled disparity's group
    counts travel inside each holder's signed ciphertext: a server that adds ``Enc(delta)``
    there (it holds the public key) to move the released tau^2 interval, mean or counts
    changes what the sum decrypts to, and breaks the holder's signature, so no holder commits
    to that set and no key holder releases over it."""
    first, second = through_round2(federation)
    public = load_public_context(federation.keys.public)
    delta = np.zeros(ROUND2_SIZE)
    delta[4:STAGE1_WIDTH] = 1e3  # the first block's grid sums
    delta[-7:-3] = 50.0  # the last block's group counts (before its two count slots)
    altered, _ = add_ciphertexts(
        public, [second["a"].payload, encrypt_vector(public, delta)], expected_size=ROUND2_SIZE
    )
    secret = load_secret_context(federation.keys.secret)
    moved = decrypt_vector(secret, altered) - decrypt_vector(secret, second["a"].payload)
    np.testing.assert_allclose(moved, delta, atol=1e-3)  # without signatures: it works
    forged = {**second, "a": SignedCiphertext(altered, second["a"].signer, second["a"].signature)}
    with pytest.raises(UnverifiedSumError, match="does not verify"):
        commit(federation, first, forged)
    commitments = commit(federation, first, second)
    with pytest.raises(UnverifiedSumError, match="does not verify"):
        release(federation, first, "b", forged, commitments)
    assert release(federation, first, "b", second, commitments).shape == (RELEASE_SIZE,)


# --- one committed set per run (review M1) ------------------------------------------------------


def test_two_key_holders_cannot_release_over_two_round2_sets_of_one_run(
    federation: Federation, tmp_path: Path
) -> None:
    """The review's demo: A releases over the round-2 set {A, B, C}, B over {A, B} of the same
    run, and A's release minus B's is C's block. On the previous main (each holder released
    once per run, over any round-2 subset of at least min-holders) both releases were made and
    the difference gave C's round-1 contribution to the flooding noise (review: sum w =
    400.9647, sum w Ybar = -40.0965 against C's true 400.9647, -40.0965). Now B needs every
    round-2 holder's commitment to {A, B}; A and B committed to {A, B, C} and refuse another
    pair of sets, also after a restart (their key journals), so B cannot release."""
    first, second = through_round2(federation, ledgers=tmp_path)
    commitments = commit(federation, first, second)
    full = release(federation, first, "a", second, commitments)
    assert np.isfinite(full[1])
    subset = {name: second[name] for name in ("a", "b")}
    # without commitments, with the full set's, with a subset of the full set's: refused
    for offered in ([], commitments, commitments[:2]):
        with pytest.raises(UnverifiedSumError):
            release(federation, first, "b", subset, offered)
    # the holders of {A, B} refuse to commit to it: they committed to {A, B, C} in this run
    for name in ("a", "b"):
        with pytest.raises(CommitmentConflict, match="another round-1 and round-2 set"):
            commit(federation, first, subset, (name,))
    # ... and so after a restart (run state lost): their key journals remember the commitment
    restarted = {name: context(name, ledgers=tmp_path) for name in NAMES}
    with pytest.raises(CommitmentConflict, match="another round-1 and round-2 set"):
        commit(federation, first, subset, ("b",), restarted)
    # A releases once per run, also after a restart (the journal counts it)
    first.contexts["a"] = restarted["a"]
    with pytest.raises(CommitmentConflict, match="already released this run"):
        release(federation, first, "a", second, commitments)
    # C, the target, gives nothing either: it is not in {A, B}
    with pytest.raises(UnverifiedSumError, match="own round-2 ciphertext is not in the set"):
        commit(federation, first, subset, ("c",))


def test_whichever_round2_set_is_committed_first_the_other_is_refused(
    federation: Federation, tmp_path: Path
) -> None:
    """The same attack in the other order: the server first has A and B commit to {A, B} and
    B release it, then asks for {A, B, C}. On the previous main A released {A, B, C}; now A
    and B refuse the second set, so no release of {A, B, C} can carry their commitments. (B
    no longer releases {A, B} either: a round-2 set smaller than round 1's is never released
    without holder-level DP, review 2026-11-28 L2, ``tests/test_fedevalfair_no_oracle.py``.)"""
    first, second = through_round2(federation, ledgers=tmp_path)
    subset = {name: second[name] for name in ("a", "b")}
    commitments = commit(federation, first, subset)
    with pytest.raises(NodeRefusal, match="only over a round-2 set equal to the round-1 set"):
        release(federation, first, "b", subset, commitments)
    for name in ("a", "b"):
        with pytest.raises(CommitmentConflict):
            commit(federation, first, second, (name,))
    only_c = commit(federation, first, second, ("c",))
    with pytest.raises(UnverifiedSumError, match="not signed by every round-2 holder"):
        release(federation, first, "a", second, only_c)
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and these sets"):
        release(federation, first, "a", second, [*commitments, *only_c])


def test_a_release_needs_every_round2_holders_commitment(
    federation: Federation, tmp_path: Path
) -> None:
    first, second = through_round2(federation, ledgers=tmp_path)
    commitments = commit(federation, first, second)
    with pytest.raises(UnverifiedSumError, match="not signed by every round-2 holder"):
        release(federation, first, "a", second, commitments[:2])
    intruder = IdentityKey.generate()
    stranger = (intruder.public_bytes(), commitments[0][1])
    with pytest.raises(UnverifiedSumError, match="distinct roster members"):
        release(federation, first, "a", second, [*commitments, stranger])
    with pytest.raises(UnverifiedSumError, match="distinct roster members"):
        release(federation, first, "a", second, [*commitments, commitments[0]])
    # a commitment signed for another run does not verify in this one
    other, other_second = through_round2(federation, RUN_ID + 50, ledgers=tmp_path / "other")
    elsewhere = commit(federation, other, other_second)
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and these sets"):
        release(federation, first, "a", second, elsewhere)
    assert release(federation, first, "a", second, commitments).shape == (RELEASE_SIZE,)


# --- releases counted per key ---------------------------------------------------------------------


def journal_path(federation: Federation, ledgers: Path, name: str) -> Path:
    fingerprint = key_fingerprint(flood_key(load_secret_context(federation.keys.secret)))
    return ledgers / name / journal_file_name(fingerprint)


def test_releases_are_counted_per_key_and_refused_past_the_policy_cap(
    federation: Federation, tmp_path: Path
) -> None:
    """A key holder with fef-max-releases-per-key = 2, asked to release in three runs (each a
    new run state, as after a restart). On the previous main it released in every run (only
    once per run was counted, in the run's state); now the count is kept per secret key in its
    journal and the third release is refused with a fixed sentence naming the policy key."""
    policy = NodePrivacyPolicy(fef_max_releases_per_key=2)
    for run in range(2):
        first, second = through_round2(federation, 100 + run, ledgers=tmp_path)
        release(federation, first, "a", second, commit(federation, first, second), policy)
    path = journal_path(federation, tmp_path, "a")
    assert '"releases": 2' in path.read_text()
    first, second = through_round2(federation, 102, ledgers=tmp_path)
    commitments = commit(federation, first, second)
    with pytest.raises(PolicyRefusal) as refusal:
        release(federation, first, "a", second, commitments, policy)
    assert refusal.value.rule == RELEASE_CAP_RULE
    assert "fef-max-releases-per-key" in str(refusal.value)
    assert '"releases": 2' in path.read_text()  # a refusal is not counted
    # another holder of the same key counts its own releases: B is at 0
    release(federation, first, "b", second, commitments, policy)


def test_a_lost_or_damaged_key_journal_stops_commitments_and_releases(
    federation: Federation, tmp_path: Path
) -> None:
    """A journal deleted after its first save does not start again at zero: its ``.created``
    marker says it existed, and the holder refuses to commit or release until it is restored
    (the detail, naming the files, stays in the node's log)."""
    first, second = through_round2(federation, 200, ledgers=tmp_path)
    release(federation, first, "a", second, commit(federation, first, second))
    first, second = through_round2(federation, 201, ledgers=tmp_path)
    commitments = commit(federation, first, second)
    path = journal_path(federation, tmp_path, "a")
    saved = path.read_bytes()
    path.unlink()
    with pytest.raises(NodeRefusal) as refused:
        release(federation, first, "a", second, commitments)
    assert str(refused.value) == JOURNAL_UNUSABLE_REPLY
    with pytest.raises(NodeRefusal, match="journal"):
        commit(federation, first, second, ("a",))
    path.write_bytes(b"{not json")
    with pytest.raises(NodeRefusal, match="journal"):
        release(federation, first, "a", second, commitments)
    path.write_bytes(saved)  # the operator restores it
    assert release(federation, first, "a", second, commitments).shape == (RELEASE_SIZE,)
    assert '"releases": 2' in path.read_text()


def test_a_key_journal_whose_whole_folder_vanished_is_refused_not_started_again(
    federation: Federation, tmp_path: Path
) -> None:
    """The key journal and its ``.created`` marker deleted together (the holder's whole ledger
    folder): before, the next release started a new journal at zero, so a holder at its
    ``fef-max-releases-per-key`` cap released again. The node's ledger registry, kept apart
    from the folder, lists the journal: the holder refuses with the fixed sentence until the
    journal is restored."""
    first, second = through_round2(federation, 300, ledgers=tmp_path)
    release(federation, first, "a", second, commit(federation, first, second))
    path = journal_path(federation, tmp_path, "a")
    saved = path.read_bytes()
    shutil.rmtree(path.parent)
    first, second = through_round2(federation, 301, ledgers=tmp_path)
    with pytest.raises(NodeRefusal) as refused:
        commit(federation, first, second, ("a",))
    assert str(refused.value) == JOURNAL_UNUSABLE_REPLY
    assert not path.exists()  # nothing started again
    path.parent.mkdir(parents=True)
    path.write_bytes(saved)  # the operator restores it
    commitments = commit(federation, first, second)
    assert release(federation, first, "a", second, commitments).shape == (RELEASE_SIZE,)
    assert '"releases": 2' in path.read_text()


def test_a_holder_without_identity_refuses_with_a_fixed_sentence(
    federation: Federation, tmp_path: Path
) -> None:
    handlers = fedevalfair_handlers(rows_of, secret_context=federation.keys.secret)
    node = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    message = Message(RecordDict(), dst_node_id=1, message_type=FEF_ROUND_MESSAGE_TYPES[0])
    for action in ("fef_round1", "fef_endorse", "fef_round2", "fef_round3"):
        with pytest.raises(IdentityError) as error:
            handlers[action](message, node)
        assert str(error.value) == FEF_IDENTITY_REFUSAL
        assert "identity-key" in str(error.value) and "roster" in str(error.value)


def reply_of(node: int, entry: SignedCiphertext) -> Message:
    from flwr.app import Array

    from fedparity.mechanisms.crypto.ckks import to_array

    record = ArrayRecord(
        {
            "ciphertext": Array(to_array(entry.payload)),
            "signature": Array(to_array(entry.signature)),
            "signer": Array(to_array(entry.signer)),
        }
    )
    request = Message(RecordDict(), dst_node_id=node, message_type=FEF_ROUND_MESSAGE_TYPES[0])
    return Message(content=RecordDict({FEF_KEY: record}), reply_to=request)


# --- the pipeline: two tests in one run --------------------------------------------------------


def test_a_ciphertext_of_one_pipeline_test_replayed_into_the_other_is_refused(
    federation: Federation,
) -> None:
    """The pipeline tests two models in one run. Were the two tests' signatures bound to the
    run alone, B's ciphertext of the FPFL test would verify in the PFL test, next to A's:
    the server knows nothing of B's values, but a sum of A's PFL values and B's FPFL values,
    differenced with the FPFL test's release, isolates A's PFL values minus A's FPFL values."""
    contexts = {name: context(name) for name in NAMES}
    fpfl = round1(federation, session="fpfl", contexts=contexts)
    pfl = round1(federation, session="pfl", contexts=contexts)
    victim, replayed = pfl.entries["a"], fpfl.entries["b"]
    # On the previous main (run-bound signatures only) the mixed sum opened like any other.
    opened = old_path_releases(federation, [victim.payload, replayed.payload], claimed=2)
    np.testing.assert_allclose(
        opened, pfl.contribution("a")[:-1] + fpfl.contribution("b")[:-1], rtol=1e-6, atol=1e-4
    )
    content = pfl.protocol.endorse_content([victim, replayed])
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and round"):
        send(federation, "c", contexts["c"], "fef_endorse", content, "pfl")
    # The honest PFL set verifies in its own session, and not in the other.
    honest = pfl.protocol.endorse_content(list(pfl.entries.values()))
    send(federation, "c", contexts["c"], "fef_endorse", honest, "pfl")
    with pytest.raises(UnverifiedSumError, match="does not verify for this run and round"):
        send(federation, "c", contexts["c"], "fef_endorse", honest, "fpfl")


def test_each_pipeline_test_is_one_step_per_round_and_no_other_session_is_taken(
    federation: Federation,
) -> None:
    contexts = {name: context(name) for name in NAMES}
    round1(federation, session="fpfl", contexts=contexts)
    content = FedEvalFairProtocol(load_public_context(federation.keys.public)).round1_content(
        ArrayRecord()
    )
    with pytest.raises(PolicyRefusal, match="one ciphertext per round"):
        send(federation, "a", contexts["a"], "fef_round1", content, "fpfl")
    send(federation, "a", contexts["a"], "fef_round1", content, "pfl")  # its own session
    # a session the node's run config does not define: a third test the server made up
    with pytest.raises(NodeRefusal, match="does not define the message's session"):
        send(federation, "a", contexts["a"], "fef_round1", content, "third")
    # and a run that tests once accepts no pipeline label
    labelled = RecordDict({**content, **session_records("fpfl")})
    with pytest.raises(NodeRefusal, match="does not define the message's session"):
        send(federation, "b", context("b"), "fef_round1", labelled)


# --- the server's protocol over the real holders (an in-process grid) ---------------------------


class HoldersGrid:
    """A Flower grid whose nodes 1, 2, 3 are holders A, B, C in this process: each pushed
    message is handled at once by the holder's real handler (a refusal becomes an error reply,
    as Flower sends it); ``drop(action, name)`` loses that reply."""

    def __init__(self, federation: Federation, ledgers: Path, drop=None) -> None:  # noqa: ANN001
        from types import SimpleNamespace

        self.federation, self.drop = federation, drop
        self.contexts = {name: context(name, ledgers=ledgers) for name in NAMES}
        self.run = SimpleNamespace(run_id=RUN_ID)
        self.sent: list[tuple[str, str]] = []
        self.replies: dict[str, Message] = {}

    def push_messages(self, messages: list[Message]) -> list[str]:
        from flwr.app import Error

        ids = []
        for message in messages:
            message_id = f"{len(self.sent)}"
            message.metadata.__dict__["_message_id"] = message_id
            name = NAMES[int(message.metadata.dst_node_id) - 1]
            action = message.metadata.message_type.removeprefix("query.")
            self.sent.append((action, name))
            handler = self.federation.handlers(name)[action]
            try:
                reply = handler(message, self.contexts[name])
            except Exception as refusal:  # noqa: BLE001 - Flower sends any error back
                reply = Message(Error(code=0, reason=str(refusal)), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
            if self.drop is None or not self.drop(action, name):
                self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def test_the_servers_protocol_asks_every_round2_holder_to_commit(
    federation: Federation, tmp_path: Path
) -> None:
    grid = HoldersGrid(federation, tmp_path)
    protocol = FedEvalFairProtocol(load_public_context(federation.keys.public), timeout=2.0)
    outcome = protocol.start(grid, ArrayRecord(), [1, 2, 3])  # type: ignore[arg-type]
    assert outcome.error is None and not outcome.rejected, outcome
    assert sorted(outcome.committers) == [1, 2, 3] and outcome.key_holders == (1, 2)
    assert len(outcome.released) == RELEASE_SIZE
    assert [action for action, _ in grid.sent] == [
        *["fef_round1"] * 3,
        *["fef_endorse"] * 2,
        *["fef_round2"] * 3,
        *["fef_commit"] * 3,
        *["fef_round3"] * 2,
    ]


def test_a_round2_holder_lost_before_its_commitment_ends_the_run(
    federation: Federation, tmp_path: Path
) -> None:
    """C's commitment never arrives: no key holder could release a set without it, so the
    server withholds the result instead of asking for round 3 (the price of the commitment:
    before it, a holder lost after round 2 changed nothing)."""
    grid = HoldersGrid(
        federation, tmp_path, drop=lambda action, name: (action, name) == ("fef_commit", "c")
    )
    protocol = FedEvalFairProtocol(load_public_context(federation.keys.public), timeout=0.5)
    outcome = protocol.start(grid, ArrayRecord(), [1, 2, 3])  # type: ignore[arg-type]
    assert "round-2 node(s) [3] did not commit" in outcome.error  # type: ignore[operator]
    assert "result withheld" in outcome.error  # type: ignore[operator]
    assert sorted(outcome.committers) == [1, 2] and outcome.released == () and not outcome.blocks
    assert "fef_round3" not in {action for action, _ in grid.sent}
