"""FedEvalFair's typed messages (:mod:`fedparity.mechanisms.protocol.fedevalfair`), the
commitment check (:func:`fedparity.mechanisms.crypto.ckks.verify_commitment`) and a key holder's
journal of commitments and releases per secret key
(:class:`fedparity.mechanisms.crypto.ckks.ReleaseJournal`), without Flower or TenSEAL.

The handlers that use them, against an active server: tests/test_ckks_active_server.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from fedparity.mechanisms.crypto.ckks import (
    CommitmentConflict,
    ReleaseJournal,
    SignedCiphertext,
    UnverifiedSumError,
    ciphertext_transcript,
    commitment_digest,
    commitment_transcript,
    contributors_digest,
    set_digest,
    signed_arrays,
    verify_commitment,
    verify_round_sets,
)
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from fedparity.mechanisms.privacy.basic_ledger import LedgerFileError, ledger_marker
from fedparity.mechanisms.protocol import RELEASE_SIZE, MessageError
from fedparity.mechanisms.protocol.fedevalfair import (
    CommitReply,
    CommitRequest,
    EndorseReply,
    EndorseRequest,
    ReleaseReply,
    Round2Request,
    Round3Request,
    SignedUpload,
)

RUN = 11


def holders(count: int = 3) -> tuple[list[IdentityKey], Roster]:
    keys = [IdentityKey.generate() for _ in range(count)]
    return keys, Roster.from_keys({f"h{i}": key for i, key in enumerate(keys)})


def signed_sets(
    keys: list[IdentityKey], second: list[int] | None = None
) -> tuple[list[SignedCiphertext], list[SignedCiphertext]]:
    """Round-1 entries of every key, round-2 entries of ``second`` (default all), signed as
    honest holders sign them (the payloads stand in for ciphertexts)."""
    first = []
    for index, key in enumerate(keys):
        payload = bytes([index]) * 40
        digest = hashlib.sha256(payload).digest()
        signature = key.sign(ciphertext_transcript(RUN, 1, digest, b""))
        first.append(SignedCiphertext(payload, key.public_bytes(), signature))
    reference = contributors_digest(entry.signer for entry in first)
    round2 = []
    for index in second if second is not None else range(len(keys)):
        payload = bytes([100 + index]) * 50
        digest = hashlib.sha256(payload).digest()
        signature = keys[index].sign(ciphertext_transcript(RUN, 2, digest, reference))
        round2.append(SignedCiphertext(payload, keys[index].public_bytes(), signature))
    return first, round2


# --- the messages ---------------------------------------------------------------------------


def test_every_message_round_trips_and_keeps_the_wire_names() -> None:
    keys, _ = holders()
    first, second = signed_sets(keys)
    commitments = ((keys[0].public_bytes(), bytes(64)), (keys[1].public_bytes(), bytes(range(64))))
    messages = [
        SignedUpload.of(first[0]),
        EndorseRequest(tuple(first)),
        EndorseReply(b"sum", keys[0].public_bytes(), bytes(64)),
        Round2Request(b"total", tuple(sorted(e.signer for e in first)), commitments),
        CommitRequest.of(first, second),
        CommitReply(keys[2].public_bytes(), bytes(64)),
        Round3Request(tuple(first), tuple(second), commitments),
    ]
    for message in messages:
        fields = message.to_fields()
        assert all(array.dtype == np.uint8 and array.ndim == 1 for array in fields.values())
        assert type(message).from_fields(fields) == message
    # The names the protocol has always used (what an older peer sends and reads).
    assert EndorseRequest(tuple(first)).to_fields().keys() == signed_arrays(first).keys()
    round3 = Round3Request(tuple(first), tuple(second), commitments).to_fields()
    old = {**signed_arrays(first, "round1-"), **signed_arrays(second, "round2-")}
    assert set(round3) == {*old, "commit-signers", "commit-signatures"}
    assert all(np.array_equal(round3[name], array) for name, array in old.items())
    assert set(SignedUpload.of(first[0]).to_fields()) == {"ciphertext", "signature", "signer"}
    assert set(Round2Request(b"t", (), ()).to_fields()) == {
        "round1-sum",
        "contributors",
        "endorsers",
        "endorsements",
    }
    release = ReleaseReply(np.arange(RELEASE_SIZE, dtype=np.float64))
    np.testing.assert_array_equal(
        ReleaseReply.from_fields(release.to_fields()).release, release.release
    )
    # a commitment request carries digests, never the ciphertexts
    request = CommitRequest.of(first, second).to_fields()
    assert sum(array.size for array in request.values()) == (3 + 3) * (32 + 32 + 64)


@pytest.mark.parametrize(
    ("cls", "fields", "named"),
    [
        (SignedUpload, {"ciphertext": np.zeros(3, np.uint8)}, "signer"),
        (
            SignedUpload,
            {
                "ciphertext": np.zeros(3, np.uint8),
                "signer": np.zeros(31, np.uint8),
                "signature": np.zeros(64, np.uint8),
            },
            "signer",
        ),
        (EndorseRequest, {"signers": np.zeros(32, np.uint8)}, "signatures"),
        (
            EndorseRequest,
            {"signers": np.zeros(32, np.uint8), "signatures": np.zeros(64, np.uint8)},
            "ciphertext-0",
        ),
        (CommitReply, {"signer": np.zeros(32, np.float64)}, "signer"),
        (
            CommitRequest,
            {
                "round1-signers": np.zeros(64, np.uint8),
                "round1-digests": np.zeros(32, np.uint8),
                "round1-signatures": np.zeros(128, np.uint8),
            },
            "round1-",
        ),
        (Round2Request, {"endorsers": np.zeros(33, np.uint8)}, "endorsers"),
        (ReleaseReply, {"release": np.zeros(3)}, "release"),
        (ReleaseReply, {"release": np.zeros(RELEASE_SIZE, np.uint8)}, "release"),
    ],
)
def test_a_malformed_message_is_a_message_error_naming_the_field(
    cls: type, fields: dict[str, np.ndarray], named: str
) -> None:
    with pytest.raises(MessageError, match=named) as error:
        cls.from_fields(fields)
    assert error.value.fixed_text


# --- the commitment ------------------------------------------------------------------------


def test_a_commitment_needs_every_round2_signer_and_nobody_else() -> None:
    keys, roster = holders(4)
    first, second = signed_sets(keys, [0, 1, 2])
    round1_keys, round2_keys = verify_round_sets(first, second, roster, run_id=RUN, min_holders=2)
    assert len(round1_keys) == 4 and len(round2_keys) == 3
    d1, d2 = set_digest(first), set_digest(second)
    sign = [
        (keys[i].public_bytes(), keys[i].sign(commitment_transcript(RUN, d1, d2))) for i in range(4)
    ]
    assert verify_commitment(
        sign[:3], round2_keys, roster, run_id=RUN, round1_digest=d1, round2_digest=d2
    ) == sorted(round2_keys)
    for wrong, match in (
        (sign[:2], "not signed by every round-2 holder"),
        (sign, "not signed by every round-2 holder"),  # the fourth is not in round 2
        ([*sign[:3], sign[0]], "distinct roster members"),
    ):
        with pytest.raises(UnverifiedSumError, match=match):
            verify_commitment(
                wrong, round2_keys, roster, run_id=RUN, round1_digest=d1, round2_digest=d2
            )
    # the same signatures over another round-2 set, another run or session: not valid
    other = set_digest(second[:2])
    for run_id, first_digest, second_digest in ((RUN, d1, other), (RUN + 1, d1, d2)):
        with pytest.raises(UnverifiedSumError, match="does not verify"):
            verify_commitment(
                sign[:3],
                round2_keys,
                roster,
                run_id=run_id,
                round1_digest=first_digest,
                round2_digest=second_digest,
            )
    # the digests: order-free, and over the ciphertexts (not only the signers)
    assert set_digest(reversed(second)) == d2
    assert set_digest([second[0].without_payload(), *second[1:]]) == d2
    changed = SignedCiphertext(b"other", second[0].signer, second[0].signature)
    assert set_digest([changed, *second[1:]]) != d2
    assert (
        commitment_digest(RUN, d1, d2)
        == hashlib.sha256(commitment_transcript(RUN, d1, d2)).digest()
    )


def test_round_sets_are_checked_before_a_commitment() -> None:
    keys, roster = holders(3)
    first, second = signed_sets(keys)
    with pytest.raises(UnverifiedSumError, match="fewer than min-holders"):
        verify_round_sets(first, second[:1], roster, run_id=RUN, min_holders=2)
    # a round-2 ciphertext (validly signed over the round-1 set) by a holder outside round 1
    reference = contributors_digest(entry.signer for entry in first[:2])
    payload = b"outsider"
    outsider = SignedCiphertext(
        payload,
        keys[2].public_bytes(),
        keys[2].sign(ciphertext_transcript(RUN, 2, hashlib.sha256(payload).digest(), reference)),
    )
    with pytest.raises(UnverifiedSumError, match="did not contribute to round 1"):
        verify_round_sets(first[:2], [outsider], roster, run_id=RUN, min_holders=1)


# --- the key journal ---------------------------------------------------------------------------


def test_the_journal_counts_releases_and_keeps_one_commitment_per_run(tmp_path: Path) -> None:
    path = tmp_path / "ledgers" / "fedevalfair-key-abc.json"
    journal = ReleaseJournal.load_or_create(path, "abc")
    one, two = bytes(32), bytes([1]) * 32
    journal.commit(RUN, one)
    journal.commit(RUN, one)  # the same again: fine
    with pytest.raises(CommitmentConflict, match="another round-1 and round-2 set"):
        journal.commit(RUN, two)
    with pytest.raises(CommitmentConflict, match="another round-1 and round-2 set"):
        journal.record_release(RUN, two)
    journal.record_release(RUN, one)
    with pytest.raises(CommitmentConflict, match="already released"):
        journal.record_release(RUN, one)
    journal.record_release(RUN + 1, two)  # a run it had not committed in
    journal.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert ledger_marker(path).exists()
    again = ReleaseJournal.load_or_create(path, "abc")
    assert again == journal and again.release_count == 2
    with pytest.raises(CommitmentConflict):
        again.commit(RUN + 1, one)


def test_a_lost_damaged_or_foreign_journal_is_an_error_not_a_new_count(tmp_path: Path) -> None:
    path = tmp_path / "fedevalfair-key-abc.json"
    journal = ReleaseJournal("abc")
    journal.record_release(RUN, bytes(32))
    journal.save(path)
    with pytest.raises(LedgerFileError, match="another secret key"):
        ReleaseJournal.load_or_create(path, "def")
    text = path.read_text()
    path.write_text(text.replace('"releases": 1', '"releases": 0'))
    with pytest.raises(LedgerFileError, match="release count does not match"):
        ReleaseJournal.load_or_create(path, "abc")
    path.write_text("[]")
    with pytest.raises(LedgerFileError, match="not a FedEvalFair key journal"):
        ReleaseJournal.load_or_create(path, "abc")
    path.unlink()
    with pytest.raises(LedgerFileError, match="is missing"):
        ReleaseJournal.load_or_create(path, "abc")
    ledger_marker(path).unlink()  # the operator accepts a new count
    assert ReleaseJournal.load_or_create(path, "abc").release_count == 0
