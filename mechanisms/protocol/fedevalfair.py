"""The typed messages of the encrypted FedEvalFair protocol, used by both ends.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version), Algorithms 1-2; the signatures are those of
:mod:`fedparity.mechanisms.crypto.ckks.signing`.

Each message is a frozen dataclass whose :meth:`to_fields` gives the uint8 (or float64)
arrays of the protocol's ``fef`` record, by the names the wire has always used, and whose
:meth:`from_fields` reads them back or raises
:class:`~fedparity.mechanisms.protocol.MessageError` naming the field (never a value). The
Flower adapters (``clients.fedevalfair_handlers``, ``strategies.fedevalfair``) wrap the fields
into an ``ArrayRecord``. The exchanges, in order:

1. ``fef_round1``: the model (an ``ArrayRecord`` of its own); reply :class:`SignedUpload`.
2. ``fef_endorse`` (verifiers): :class:`EndorseRequest`; reply :class:`EndorseReply`.
3. ``fef_round2``: :class:`Round2Request`; reply :class:`SignedUpload`.
4. ``fef_commit`` (every round-2 holder): :class:`CommitRequest`; reply :class:`CommitReply`.
5. ``fef_round3`` (key holders): :class:`Round3Request`; reply :class:`ReleaseReply`.

No Flower import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..crypto.ckks.signing import SignedCiphertext, SignedDigest
from ..crypto.identity import IDENTITY_KEY_BYTES, SIGNATURE_BYTES
from ..fairness_tests.fedevalfair_layout import DEFAULT_LAYOUT, FedEvalFairLayout
from . import MessageError

__all__ = [
    "DIGEST_BYTES",
    "FEF_COMMIT_MESSAGE_TYPE",
    "CommitReply",
    "CommitRequest",
    "EndorseReply",
    "EndorseRequest",
    "ReleaseReply",
    "Round2Request",
    "Round3Request",
    "SignedUpload",
]

#: Between rounds 2 and 3: every round-2 holder signs one commitment to the run's round-1 and
#: round-2 sets (``@app.query("fef_commit")``); a key holder releases only a set every one of
#: them committed to (:func:`fedparity.mechanisms.crypto.ckks.verify_commitment`).
FEF_COMMIT_MESSAGE_TYPE = "query.fef_commit"
#: Bytes of a SHA-256 digest.
DIGEST_BYTES = 32

Fields = dict[str, np.ndarray]


# -- field codecs ----------------------------------------------------------------------------


def _bytes_array(data: bytes) -> np.ndarray:
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


def _raw(fields: Mapping[str, np.ndarray], name: str, size: int | None = None) -> bytes:
    """The bytes of the 1-D uint8 field ``name`` (of ``size`` bytes when given)."""
    array = fields.get(name)
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise MessageError(f"message field {name!r} must be a 1-D uint8 array")
    if size is not None and array.size != size:
        raise MessageError(f"message field {name!r} must hold {size} bytes")
    return array.tobytes()


def _items(fields: Mapping[str, np.ndarray], name: str, width: int) -> list[bytes]:
    """The ``width``-byte items of the field ``name`` (empty: none)."""
    raw = _raw(fields, name)
    if len(raw) % width:
        raise MessageError(f"message field {name!r} must hold {width}-byte items")
    return [raw[i : i + width] for i in range(0, len(raw), width)]


def _signed_set_fields(entries: Sequence[SignedCiphertext], prefix: str) -> Fields:
    fields = {
        f"{prefix}ciphertext-{index}": _bytes_array(entry.payload)
        for index, entry in enumerate(entries)
    }
    fields[f"{prefix}signers"] = _bytes_array(b"".join(entry.signer for entry in entries))
    fields[f"{prefix}signatures"] = _bytes_array(b"".join(entry.signature for entry in entries))
    return fields


def _signed_set(fields: Mapping[str, np.ndarray], prefix: str) -> tuple[SignedCiphertext, ...]:
    signers = _items(fields, f"{prefix}signers", IDENTITY_KEY_BYTES)
    signatures = _items(fields, f"{prefix}signatures", SIGNATURE_BYTES)
    if len(signers) != len(signatures):
        raise MessageError(
            f"message fields {prefix}signers and {prefix}signatures differ in length"
        )
    return tuple(
        SignedCiphertext(_raw(fields, f"{prefix}ciphertext-{index}"), signer, signature)
        for index, (signer, signature) in enumerate(zip(signers, signatures, strict=True))
    )


def _digest_set_fields(entries: Sequence[SignedDigest], prefix: str) -> Fields:
    return {
        f"{prefix}signers": _bytes_array(b"".join(entry.signer for entry in entries)),
        f"{prefix}digests": _bytes_array(b"".join(entry.digest for entry in entries)),
        f"{prefix}signatures": _bytes_array(b"".join(entry.signature for entry in entries)),
    }


def _digest_set(fields: Mapping[str, np.ndarray], prefix: str) -> tuple[SignedDigest, ...]:
    signers = _items(fields, f"{prefix}signers", IDENTITY_KEY_BYTES)
    digests = _items(fields, f"{prefix}digests", DIGEST_BYTES)
    signatures = _items(fields, f"{prefix}signatures", SIGNATURE_BYTES)
    if not len(signers) == len(digests) == len(signatures):
        raise MessageError(f"message fields {prefix}signers, digests and signatures differ")
    return tuple(SignedDigest(*entry) for entry in zip(signers, digests, signatures, strict=True))


# -- the messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SignedUpload:
    """A holder's round-1 or round-2 reply: one ciphertext, its signer and signature."""

    ciphertext: bytes
    signer: bytes
    signature: bytes

    @classmethod
    def of(cls, entry: SignedCiphertext) -> SignedUpload:
        return cls(entry.payload, entry.signer, entry.signature)

    def entry(self) -> SignedCiphertext:
        return SignedCiphertext(self.ciphertext, self.signer, self.signature)

    def to_fields(self) -> Fields:
        return {
            "ciphertext": _bytes_array(self.ciphertext),
            "signature": _bytes_array(self.signature),
            "signer": _bytes_array(self.signer),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> SignedUpload:
        return cls(
            _raw(fields, "ciphertext"),
            _raw(fields, "signer", IDENTITY_KEY_BYTES),
            _raw(fields, "signature", SIGNATURE_BYTES),
        )


@dataclass(frozen=True)
class EndorseRequest:
    """To a verifier: the signed round-1 ciphertexts, to recompute their sum."""

    round1: tuple[SignedCiphertext, ...]

    def to_fields(self) -> Fields:
        return _signed_set_fields(self.round1, "")

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> EndorseRequest:
        return cls(_signed_set(fields, ""))


@dataclass(frozen=True)
class EndorseReply:
    """A verifier's round-1 sum and its endorsement signature."""

    total: bytes
    endorser: bytes
    endorsement: bytes

    def to_fields(self) -> Fields:
        return {
            "sum": _bytes_array(self.total),
            "endorsement": _bytes_array(self.endorsement),
            "endorser": _bytes_array(self.endorser),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> EndorseReply:
        return cls(
            _raw(fields, "sum"),
            _raw(fields, "endorser", IDENTITY_KEY_BYTES),
            _raw(fields, "endorsement", SIGNATURE_BYTES),
        )


@dataclass(frozen=True)
class Round2Request:
    """To the round-1 holders: the endorsed round-1 sum, its sorted contributor keys and the
    ``(endorser, signature)`` endorsements."""

    round1_sum: bytes
    contributors: tuple[bytes, ...]
    endorsements: tuple[tuple[bytes, bytes], ...]

    def to_fields(self) -> Fields:
        return {
            "round1-sum": _bytes_array(self.round1_sum),
            "contributors": _bytes_array(b"".join(self.contributors)),
            "endorsers": _bytes_array(b"".join(e for e, _ in self.endorsements)),
            "endorsements": _bytes_array(b"".join(s for _, s in self.endorsements)),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> Round2Request:
        endorsers = _items(fields, "endorsers", IDENTITY_KEY_BYTES)
        signatures = _items(fields, "endorsements", SIGNATURE_BYTES)
        if len(endorsers) != len(signatures):
            raise MessageError("message fields 'endorsers' and 'endorsements' differ in length")
        return cls(
            _raw(fields, "round1-sum"),
            tuple(_items(fields, "contributors", IDENTITY_KEY_BYTES)),
            tuple(zip(endorsers, signatures, strict=True)),
        )


@dataclass(frozen=True)
class CommitRequest:
    """To every round-2 holder: the round-1 and round-2 sets to commit to, as signed digests
    (each holder checks every signature; the ciphertexts themselves are not sent)."""

    round1: tuple[SignedDigest, ...]
    round2: tuple[SignedDigest, ...]

    @classmethod
    def of(
        cls,
        round1: Sequence[SignedCiphertext | SignedDigest],
        round2: Sequence[SignedCiphertext | SignedDigest],
    ) -> CommitRequest:
        def digests(entries: Sequence[SignedCiphertext | SignedDigest]) -> tuple[SignedDigest, ...]:
            return tuple(
                e.without_payload() if isinstance(e, SignedCiphertext) else e for e in entries
            )

        return cls(digests(round1), digests(round2))

    def to_fields(self) -> Fields:
        return {
            **_digest_set_fields(self.round1, "round1-"),
            **_digest_set_fields(self.round2, "round2-"),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> CommitRequest:
        return cls(_digest_set(fields, "round1-"), _digest_set(fields, "round2-"))


@dataclass(frozen=True)
class CommitReply:
    """A round-2 holder's signature on the commitment
    (:func:`~fedparity.mechanisms.crypto.ckks.commitment_transcript`)."""

    signer: bytes
    signature: bytes

    def to_fields(self) -> Fields:
        return {"commitment": _bytes_array(self.signature), "signer": _bytes_array(self.signer)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> CommitReply:
        return cls(
            _raw(fields, "signer", IDENTITY_KEY_BYTES),
            _raw(fields, "commitment", SIGNATURE_BYTES),
        )


@dataclass(frozen=True)
class Round3Request:
    """To the key holders: both signed ciphertext sets (they recompute the sums) and the
    round-2 holders' ``(signer, signature)`` commitments to them."""

    round1: tuple[SignedCiphertext, ...]
    round2: tuple[SignedCiphertext, ...]
    commitments: tuple[tuple[bytes, bytes], ...]

    def to_fields(self) -> Fields:
        return {
            **_signed_set_fields(self.round1, "round1-"),
            **_signed_set_fields(self.round2, "round2-"),
            "commit-signers": _bytes_array(b"".join(s for s, _ in self.commitments)),
            "commit-signatures": _bytes_array(b"".join(s for _, s in self.commitments)),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, np.ndarray]) -> Round3Request:
        signers = _items(fields, "commit-signers", IDENTITY_KEY_BYTES)
        signatures = _items(fields, "commit-signatures", SIGNATURE_BYTES)
        if len(signers) != len(signatures):
            raise MessageError(
                "message fields 'commit-signers' and 'commit-signatures' differ in length"
            )
        return cls(
            _signed_set(fields, "round1-"),
            _signed_set(fields, "round2-"),
            tuple(zip(signers, signatures, strict=True)),
        )


@dataclass(frozen=True)
class ReleaseReply:
    """A key holder's release: the aggregate statistics, noise-flooded (float64)."""

    release: np.ndarray

    def to_fields(self) -> Fields:
        return {"release": np.asarray(self.release, dtype=np.float64)}

    @classmethod
    def from_fields(
        cls, fields: Mapping[str, np.ndarray], layout: FedEvalFairLayout = DEFAULT_LAYOUT
    ) -> ReleaseReply:
        """The release of a run of ``layout`` (its :attr:`~FedEvalFairLayout.release_size`
        numbers)."""
        size = layout.release_size
        array = fields.get("release")
        if not isinstance(array, np.ndarray) or array.shape != (size,):
            raise MessageError(f"message field 'release' must hold {size} numbers")
        if array.dtype.kind != "f":
            raise MessageError("message field 'release' must hold floating-point numbers")
        return cls(array.astype(np.float64))
