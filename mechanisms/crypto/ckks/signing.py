"""Signed ciphertexts and endorsed sums: what a FedEvalFair holder checks before it decrypts.

Against an *active* server a holder must never decrypt a ciphertext the server merely calls a
"sum": the server holds the public key, so it can encrypt anything, add ``Enc(0, ..., 0, 1)``
to one holder's ciphertext and present the result as the sum of two holders. Here every
ciphertext a holder uploads is signed with its Ed25519 identity key
(:mod:`fedparity.mechanisms.crypto.identity`) over :func:`ciphertext_transcript` -- a label, the run
id, the round, the SHA-256 of the ciphertext bytes and, in round 2, the digest of the round-1
contributors it built on -- so a signature is valid for one run and one round only. A holder
decrypts only a sum of at least ``min_holders`` such ciphertexts, each signed by a *distinct*
member of its own roster (:func:`verify_contributions`), and the count it checks the sum's
count slot against is the number of verified signers, never a number from the server.

Endorsements: round 2 needs the round-1 sum at every holder; sending all k ciphertexts to all
k holders costs k^2 ciphertexts (~330 kB each). Instead a few designated verifiers recompute
the sum from the signed ciphertexts and sign :func:`endorsement_transcript` (run, round,
SHA-256 of the sum they computed, the sorted contributor keys); a holder decrypts a forwarded
sum only with a valid endorsement by a roster member whose contributor list has at least
``min_holders`` distinct roster members and includes the holder itself
(:func:`verify_endorsements`).

One committed set per run: every holder has the secret key, so a server that asked two key
holders to release over two different round-2 sets of one run (``{a, b, c}`` and ``{a, b}``)
would get holder ``c``'s statistics from the difference. Before round 3 every round-2 holder
signs :func:`commitment_transcript` -- the run (and session), the :func:`set_digest` of the
round-1 and of the round-2 signed ciphertexts -- once per run, and a key holder releases only
with valid signatures on that very commitment by *every* signer of the round-2 set
(:func:`verify_commitment`). Two releases over different round-2 sets of one run would need an
honest holder in both sets to sign two commitments, which it refuses; sets without a common
holder are disjoint, so no difference of releases is a sum over fewer than ``min_holders``
holders (the idea of the consistency check of Bonawitz et al., "Practical Secure Aggregation
for Privacy-Preserving Machine Learning", CCS 2017, applied to the released set).

Pure Python plus ``cryptography``: no Flower import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..identity import IDENTITY_KEY_BYTES, SIGNATURE_BYTES, Roster, transcript, verify_signature

__all__ = [
    "CIPHERTEXT_LABEL",
    "COMMITMENT_LABEL",
    "COMMITMENT_TERMS_LABEL",
    "ENDORSEMENT_LABEL",
    "SignedCiphertext",
    "SignedDigest",
    "UnverifiedSumError",
    "ciphertext_transcript",
    "commitment_digest",
    "commitment_transcript",
    "contributors_digest",
    "endorsement_transcript",
    "pack_keys",
    "session_id",
    "set_digest",
    "signed_arrays",
    "signed_from_arrays",
    "unpack_keys",
    "verify_commitment",
    "verify_contributions",
    "verify_endorsements",
    "verify_round_sets",
]

#: Label of a holder's signature on one of its ciphertexts (versioned: a new layout is a new
#: label, so an old signature never verifies under a new meaning).
CIPHERTEXT_LABEL = "fedparity/fedevalfair/ciphertext/v1"
#: Label of a verifier's endorsement of a sum it recomputed.
ENDORSEMENT_LABEL = "fedparity/fedevalfair/endorsement/v1"
#: Label of a round-2 holder's commitment to the run's round-1 and round-2 sets.
COMMITMENT_LABEL = "fedparity/fedevalfair/commitment/v1"
#: Label of the same commitment when it also binds the release's terms (the holder-level DP
#: mode's parameters, :meth:`fedparity.mechanisms.crypto.ckks.holder_dp.HolderDP.terms`).
COMMITMENT_TERMS_LABEL = "fedparity/fedevalfair/commitment-with-terms/v1"


def session_id(run_id: int, session: str = "") -> int:
    """The id every signature of a protocol execution binds: the run's id for the run's only
    session (``session = ""``), else the first 8 bytes of SHA-256 over the run id and the
    session label, so that two executions in one run (the pipeline tests two models) never
    accept each other's ciphertexts, endorsements or releases."""
    run_id = int(run_id)
    if not session:
        return run_id
    digest = hashlib.sha256(transcript("fedparity/session/v1", run_id, session)).digest()
    return int.from_bytes(digest[:8], "big")


class UnverifiedSumError(ValueError):
    """A sum the holder cannot attribute to enough distinct, signed roster members; nothing is
    decrypted. The message is a fixed sentence (safe to reach the server)."""

    fixed_text = True


@dataclass(frozen=True)
class SignedCiphertext:
    """One uploaded ciphertext with its signer's public key and signature."""

    payload: bytes
    signer: bytes
    signature: bytes

    @property
    def digest(self) -> bytes:
        """SHA-256 of the ciphertext bytes (what the signature covers)."""
        return hashlib.sha256(self.payload).digest()

    def without_payload(self) -> SignedDigest:
        """The signer, the ciphertext's SHA-256 and the signature (enough to check it)."""
        return SignedDigest(self.signer, self.digest, self.signature)


@dataclass(frozen=True)
class SignedDigest:
    """A signed ciphertext without its bytes: the signer's public key, the SHA-256 of the
    ciphertext and the signature (about 130 bytes instead of ~330 kB; what a holder needs to
    check the signature and to commit to a set, :func:`commitment_transcript`)."""

    signer: bytes
    digest: bytes
    signature: bytes


def ciphertext_transcript(run_id: int, round_number: int, digest: bytes, reference: bytes) -> bytes:
    """What a holder signs for a ciphertext of SHA-256 ``digest`` in ``round_number`` of run
    ``run_id``; ``reference`` is empty in round 1 and the :func:`contributors_digest` of the
    round-1 sum the holder decrypted in round 2 (so every round-2 term refers to one sum)."""
    return transcript(CIPHERTEXT_LABEL, int(run_id), int(round_number), digest, reference)


def endorsement_transcript(
    run_id: int, round_number: int, sum_digest: bytes, contributors: Sequence[bytes]
) -> bytes:
    """What a verifier signs for a sum of SHA-256 ``sum_digest`` it recomputed from the
    ciphertexts of ``contributors`` (sorted public keys) in ``round_number`` of ``run_id``."""
    return transcript(
        ENDORSEMENT_LABEL, int(run_id), int(round_number), sum_digest, pack_keys(contributors)
    )


def set_digest(entries: Iterable[SignedCiphertext | SignedDigest]) -> bytes:
    """SHA-256 of a signed set: every entry's signer key and ciphertext SHA-256, sorted by
    signer (order-free; each holder signs one ciphertext per round, so this names the set)."""
    ordered = sorted(entries, key=lambda entry: bytes(entry.signer))
    return hashlib.sha256(
        b"".join(bytes(entry.signer) + entry.digest for entry in ordered)
    ).digest()


def commitment_transcript(
    run_id: int, round1_digest: bytes, round2_digest: bytes, terms: bytes = b""
) -> bytes:
    """What a round-2 holder signs to commit run ``run_id`` (a :func:`session_id`) to the
    round-1 and round-2 sets of :func:`set_digest` ``round1_digest`` and ``round2_digest``;
    an honest holder signs one commitment per run. ``terms`` (empty: none, the transcript of
    a plain release) are the release's agreed terms -- the holder-level DP mode's parameters --
    so that holders given different terms sign different commitments."""
    if not terms:
        return transcript(COMMITMENT_LABEL, int(run_id), bytes(round1_digest), bytes(round2_digest))
    return transcript(
        COMMITMENT_TERMS_LABEL,
        int(run_id),
        bytes(round1_digest),
        bytes(round2_digest),
        bytes(terms),
    )


def commitment_digest(
    run_id: int, round1_digest: bytes, round2_digest: bytes, terms: bytes = b""
) -> bytes:
    """SHA-256 of :func:`commitment_transcript`: the name of one committed pair of sets."""
    return hashlib.sha256(
        commitment_transcript(run_id, round1_digest, round2_digest, terms)
    ).digest()


def contributors_digest(keys: Iterable[bytes]) -> bytes:
    """SHA-256 of the sorted public keys of a sum's contributors (order-free)."""
    return hashlib.sha256(pack_keys(sorted(bytes(key) for key in keys))).digest()


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Public keys (32 bytes each) concatenated, in the given order."""
    return b"".join(bytes(key) for key in keys)


def unpack_keys(data: bytes | np.ndarray, *, width: int = IDENTITY_KEY_BYTES) -> list[bytes]:
    """The ``width``-byte items of :func:`pack_keys` output (``ValueError`` on a bad length)."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if not raw or len(raw) % width:
        raise UnverifiedSumError("a list of keys or signatures has the wrong length")
    return [raw[i : i + width] for i in range(0, len(raw), width)]


def signed_arrays(entries: Sequence[SignedCiphertext], prefix: str = "") -> dict[str, np.ndarray]:
    """``entries`` as uint8 arrays for a message record: ``<prefix>ciphertext-<i>`` each,
    ``<prefix>signers`` (32 bytes each) and ``<prefix>signatures`` (64 bytes each)."""
    arrays = {
        f"{prefix}ciphertext-{index}": np.frombuffer(entry.payload, dtype=np.uint8).copy()
        for index, entry in enumerate(entries)
    }
    arrays[f"{prefix}signers"] = np.frombuffer(
        pack_keys([entry.signer for entry in entries]), dtype=np.uint8
    ).copy()
    arrays[f"{prefix}signatures"] = np.frombuffer(
        pack_keys([entry.signature for entry in entries]), dtype=np.uint8
    ).copy()
    return arrays


def signed_from_arrays(
    arrays: Mapping[str, np.ndarray], prefix: str = ""
) -> list[SignedCiphertext]:
    """The entries :func:`signed_arrays` wrote (``UnverifiedSumError`` if they do not fit)."""
    signers = unpack_keys(_uint8(arrays, f"{prefix}signers"))
    signatures = unpack_keys(_uint8(arrays, f"{prefix}signatures"), width=SIGNATURE_BYTES)
    if len(signers) != len(signatures):
        raise UnverifiedSumError("the numbers of signers and signatures differ")
    return [
        SignedCiphertext(_uint8(arrays, f"{prefix}ciphertext-{index}").tobytes(), signer, signature)
        for index, (signer, signature) in enumerate(zip(signers, signatures, strict=True))
    ]


def _uint8(arrays: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    array = arrays.get(name)
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise UnverifiedSumError("a signed ciphertext set is incomplete or malformed")
    return array


def verify_contributions(
    entries: Sequence[SignedCiphertext | SignedDigest],
    roster: Roster,
    *,
    run_id: int,
    round_number: int,
    reference: bytes = b"",
    min_holders: int,
) -> list[bytes]:
    """Check that ``entries`` are ciphertexts of this run and round, each signed by a distinct
    member of ``roster``, at least ``min_holders`` of them; return the sorted signer keys.

    Raises
    ------
    UnverifiedSumError
        A signer is not on the roster, signs twice, a signature does not verify (another run,
        round, reference or ciphertext), or there are fewer than ``min_holders`` signers.
    """
    signers: set[bytes] = set()
    for entry in entries:
        signer = bytes(entry.signer)
        if signer not in roster:
            raise UnverifiedSumError("a ciphertext is signed by a key that is not on the roster")
        if signer in signers:
            raise UnverifiedSumError("two ciphertexts of one sum are signed by the same member")
        if len(entry.signature) != SIGNATURE_BYTES or not verify_signature(
            signer,
            entry.signature,
            ciphertext_transcript(run_id, round_number, entry.digest, reference),
        ):
            raise UnverifiedSumError(
                "a ciphertext's signature does not verify for this run and round"
            )
        signers.add(signer)
    if len(signers) < min_holders:
        raise UnverifiedSumError("a sum of fewer than min-holders holders is never decrypted")
    return sorted(signers)


def verify_endorsements(
    sum_payload: bytes,
    contributors: Sequence[bytes],
    endorsements: Sequence[tuple[bytes, bytes]],
    roster: Roster,
    *,
    run_id: int,
    round_number: int,
    min_holders: int,
    own_key: bytes,
) -> list[bytes]:
    """Check a forwarded sum before decrypting it; return its sorted contributor keys.

    The rule: ``contributors`` are distinct roster members, at least ``min_holders``, this
    holder (``own_key``) among them; at least one endorsement ``(endorser, signature)`` is
    given, and every one is by a distinct roster member and verifies over
    :func:`endorsement_transcript` of this run, round, the sum's SHA-256 and the contributors.
    An endorsement by any roster member suffices (the holder itself included): every holder
    already holds the one shared secret key, so a verifier that lied on the server's behalf
    could decrypt the individual ciphertexts directly -- requiring a second verifier would
    not protect against it.

    Raises
    ------
    UnverifiedSumError
        Any of the above fails (fixed sentences).
    """
    keys = [bytes(key) for key in contributors]
    if any(len(key) != IDENTITY_KEY_BYTES for key in keys) or keys != sorted(set(keys)):
        raise UnverifiedSumError("the contributor list is not a sorted list of distinct keys")
    if any(key not in roster for key in keys):
        raise UnverifiedSumError("a contributor of the sum is not on the roster")
    if len(keys) < min_holders:
        raise UnverifiedSumError("a sum of fewer than min-holders holders is never decrypted")
    if bytes(own_key) not in keys:
        raise UnverifiedSumError("this node's own ciphertext is not in the sum it was sent")
    if not endorsements:
        raise UnverifiedSumError("the sum carries no endorsement by a roster member")
    message = endorsement_transcript(
        run_id, round_number, hashlib.sha256(sum_payload).digest(), keys
    )
    endorsers: set[bytes] = set()
    for endorser, signature in endorsements:
        endorser = bytes(endorser)
        if endorser not in roster or endorser in endorsers:
            raise UnverifiedSumError("an endorsement is not by a distinct roster member")
        if not verify_signature(endorser, signature, message):
            raise UnverifiedSumError("an endorsement does not verify for this sum, run and round")
        endorsers.add(endorser)
    return keys


def verify_round_sets(
    round1: Sequence[SignedCiphertext | SignedDigest],
    round2: Sequence[SignedCiphertext | SignedDigest],
    roster: Roster,
    *,
    run_id: int,
    min_holders: int,
) -> tuple[list[bytes], list[bytes]]:
    """Check a run's round-1 and round-2 signed sets as a key holder needs them: each by
    distinct roster members, at least ``min_holders``, the round-2 signatures over the round-1
    contributors (:func:`verify_contributions`), and every round-2 signer a round-1
    contributor; return both sorted signer lists."""
    round1_keys = verify_contributions(
        round1, roster, run_id=run_id, round_number=1, min_holders=min_holders
    )
    round2_keys = verify_contributions(
        round2,
        roster,
        run_id=run_id,
        round_number=2,
        reference=contributors_digest(round1_keys),
        min_holders=min_holders,
    )
    if not set(round2_keys) <= set(round1_keys):
        raise UnverifiedSumError("a round-2 contributor did not contribute to round 1")
    return round1_keys, round2_keys


def verify_commitment(
    signatures: Sequence[tuple[bytes, bytes]],
    round2_keys: Sequence[bytes],
    roster: Roster,
    *,
    run_id: int,
    round1_digest: bytes,
    round2_digest: bytes,
    terms: bytes = b"",
) -> list[bytes]:
    """Check the commitment signatures ``(signer, signature)`` on
    :func:`commitment_transcript` of this run, sets and ``terms`` before a release; return the
    sorted signer keys.

    The rule: the signers are distinct roster members and exactly the round-2 contributors
    ``round2_keys`` -- every one of them, nobody else -- and every signature verifies. Since
    an honest holder commits once per run, two different round-2 sets of one run can both be
    released only if no honest holder is in both (module docstring).

    Raises
    ------
    UnverifiedSumError
        Any of the above fails (fixed sentences).
    """
    message = commitment_transcript(run_id, round1_digest, round2_digest, terms)
    signers: set[bytes] = set()
    for signer, signature in signatures:
        signer = bytes(signer)
        if signer not in roster or signer in signers:
            raise UnverifiedSumError("a commitment is not signed by distinct roster members")
        if len(signature) != SIGNATURE_BYTES or not verify_signature(signer, signature, message):
            raise UnverifiedSumError(
                "a commitment signature does not verify for this run and these sets"
            )
        signers.add(signer)
    if signers != {bytes(key) for key in round2_keys}:
        raise UnverifiedSumError(
            "the commitment is not signed by every round-2 holder (and by them only)"
        )
    return sorted(signers)
