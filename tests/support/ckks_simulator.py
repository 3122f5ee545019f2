"""The three-round FedEvalFair CKKS protocol without Flower: an in-process simulator.

Runs the protocol of :mod:`fedparity.mechanisms.crypto.ckks` (real TenSEAL ciphertexts, or float64
vectors for a plaintext baseline) for the unit tests and ``benchmarks/fedevalfair_protocol.py``.
It is not part of the library: the Flower handlers and strategy implement the protocol.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import tenseal as ts

from fedparity.mechanisms.crypto.ckks import (
    COUNT_BYTES,
    DEFAULT_AGREEMENT_TOLERANCE,
    DEFAULT_COUNT_TOLERANCE,
    DEFAULT_MAX_MAGNITUDE,
    NUM_ROUNDS,
    CkksParameters,
    KeyMaterialError,
    NoValidCiphertextError,
    ProtocolError,
    Rejection,
    RejectionKind,
    StaleReferenceError,
    add_ciphertexts,
    check_count_slot,
    check_magnitude,
    context_has_secret_key,
    decrypt_vector,
    encrypt_vector,
    from_array,
    to_array,
)
from fedparity.mechanisms.crypto.ckks.vectors import _as_values

#: ``term_fn(round1_sum, contribution) -> round-2 term`` (count slot removed from the sum).
TermFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: ``tamper(round, client, payload) -> payload the server receives`` (tests: bad clients).
TamperFn = Callable[[int, int, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class DecryptedSums:
    """What a key holder decrypts in round 3 (never sent to the server as such)."""

    #: Round-1 sum of the contributions over the round-1 clients R1 (reference of the terms).
    reference: np.ndarray
    #: |R1|, from the count slot.
    reference_count: int
    #: Sum of the round-2 terms over the round-2 clients R2.
    terms: np.ndarray
    #: Fresh sum of the contributions over R2.
    contributions: np.ndarray
    #: |R2|, from the count slot.
    count: int

    @property
    def participants_changed(self) -> bool:
        """Whether R2 is smaller than R1 (clients dropped or were rejected in between)."""
        return self.count != self.reference_count


ReleaseFn = Callable[[DecryptedSums], np.ndarray]


def release_sums(sums: DecryptedSums) -> np.ndarray:
    """Default release: ``[terms, contributions, count]`` over the round-2 clients.

    Raises
    ------
    StaleReferenceError
        The round-2 clients differ from the round-1 clients, so the terms refer to a sum that
        includes clients who dropped. Pass a ``release_fn`` that corrects the terms with the
        fresh contribution sums (see the module notes) or rerun the protocol.
    """
    if sums.participants_changed:
        raise StaleReferenceError(
            f"{sums.reference_count} clients took part in round 1 but {sums.count} in round 2: "
            "the round-2 terms refer to a round-1 sum over other clients; pass a release_fn "
            "that corrects them with the fresh contribution sums, or rerun the protocol"
        )
    return np.concatenate([sums.terms, sums.contributions, [float(sums.count)]])


@dataclass(frozen=True)
class Upload:
    """One message the server received (kept when ``keep_messages=True``)."""

    round: int
    client: int
    payload: np.ndarray


@dataclass(frozen=True)
class ClientRejection:
    """A client's upload the server rejected."""

    round: int
    client: int
    kind: RejectionKind
    reason: str


@dataclass(frozen=True)
class ProtocolTrace:
    """Outcome and cost of one protocol run (traffic arrays: clients x 3 rounds)."""

    encrypted: bool
    num_clients: int
    #: Clients whose round-1 / round-2 ciphertext was added; the round-3 key holders.
    round1_clients: tuple[int, ...]
    round2_clients: tuple[int, ...]
    key_holders: tuple[int, ...]
    dropped_before_round2: tuple[int, ...]
    dropped_before_round3: tuple[int, ...]
    rejections: tuple[ClientRejection, ...]
    #: The plaintext aggregates the key holders released (the only plaintext the server got).
    released: np.ndarray
    #: ``report_fn(released)``, computed by the server (None without a report_fn).
    report: Any
    #: Payload bytes each client uploaded / downloaded per round (metadata excluded).
    upload_bytes: np.ndarray
    download_bytes: np.ndarray
    #: Ciphertexts each client uploaded per round (0 or 1).
    ciphertexts: np.ndarray
    #: Compute time per client per round, and the server's per round (seconds).
    client_seconds: np.ndarray
    server_seconds: tuple[float, float, float]
    wall_seconds: float
    #: Every message the server received (empty unless ``keep_messages=True``).
    uploads: tuple[Upload, ...] = field(default=())

    @property
    def max_ciphertexts_per_round(self) -> int:
        """Most ciphertexts any client uploaded in one round (the protocol guarantees <= 1)."""
        return int(self.ciphertexts.max()) if self.ciphertexts.size else 0

    @property
    def participants_changed(self) -> bool:
        return len(self.round2_clients) != len(self.round1_clients)


class _Codec(Protocol):
    encrypted: bool

    def encode(self, values: np.ndarray) -> np.ndarray: ...

    def decode(self, payload: np.ndarray, expected_size: int) -> np.ndarray: ...

    def add(
        self, payloads: Sequence[np.ndarray], expected_size: int
    ) -> tuple[np.ndarray, list[Rejection]]: ...


class _CkksCodec:
    """Clients encrypt with the secret context; the server adds with the public one."""

    encrypted = True

    def __init__(self, secret_context: ts.Context, public_context: ts.Context) -> None:
        if not context_has_secret_key(secret_context):
            raise KeyMaterialError(
                "secret_ctx has no secret key (load it with load_secret_context)"
            )
        if context_has_secret_key(public_context):
            raise KeyMaterialError(
                "public_ctx holds a secret key; the server may only hold the public context"
            )
        if CkksParameters.from_context(secret_context) != CkksParameters.from_context(
            public_context
        ):
            raise KeyMaterialError("secret_ctx and public_ctx have different CKKS parameters")
        self._secret = secret_context
        self._public = public_context

    def encode(self, values: np.ndarray) -> np.ndarray:
        return to_array(encrypt_vector(self._secret, values))

    def decode(self, payload: np.ndarray, expected_size: int) -> np.ndarray:
        return decrypt_vector(self._secret, from_array(payload), expected_size=expected_size)

    def add(
        self, payloads: Sequence[np.ndarray], expected_size: int
    ) -> tuple[np.ndarray, list[Rejection]]:
        total, rejections = add_ciphertexts(self._public, payloads, expected_size=expected_size)
        return to_array(total), rejections


class _PlainCodec:
    """Baseline: the same protocol with plain float64 vectors (NOT private)."""

    encrypted = False

    def encode(self, values: np.ndarray) -> np.ndarray:
        return np.array(values, dtype=np.float64)

    def decode(self, payload: np.ndarray, expected_size: int) -> np.ndarray:
        if payload.shape != (expected_size,):
            raise ValueError(f"payload holds {payload.size} values, expected {expected_size}")
        return payload.copy()

    def add(
        self, payloads: Sequence[np.ndarray], expected_size: int
    ) -> tuple[np.ndarray, list[Rejection]]:
        rejections, accepted = [], []
        for index, payload in enumerate(payloads):
            array = np.asarray(payload)
            if array.dtype != np.float64 or array.shape != (expected_size,):
                reason = f"expected {expected_size} float64 values, got {array.dtype} {array.shape}"
                rejections.append(Rejection(index, "size", reason))
            else:
                accepted.append(array)
        if not accepted:
            raise NoValidCiphertextError(
                f"none of the {len(payloads)} payloads is valid", rejections
            )
        return np.sum(accepted, axis=0), rejections


def _client_ids(name: str, clients: Collection[int], num_clients: int) -> frozenset[int]:
    ids = frozenset(int(client) for client in clients)
    outside = sorted(client for client in ids if not 0 <= client < num_clients)
    if outside:
        raise ValueError(f"{name} must hold client indices in [0, {num_clients}), got {outside}")
    return ids


def _check_contributions(
    contributions: Sequence[np.ndarray], max_magnitude: float
) -> list[np.ndarray]:
    vectors = [_as_values(vector, f"contributions[{i}]") for i, vector in enumerate(contributions)]
    if not vectors:
        raise ValueError("contributions must hold one vector per client, got none")
    length = vectors[0].size
    for index, vector in enumerate(vectors):
        if vector.size != length:
            raise ValueError(
                f"contributions must have equal lengths: contributions[{index}] has "
                f"{vector.size} values, contributions[0] has {length}"
            )
        if float(np.max(np.abs(vector))) > max_magnitude:
            raise ValueError(
                f"contributions[{index}] exceeds max_magnitude={max_magnitude:.3g}; scale the "
                "contributions down or raise max_magnitude"
            )
    return vectors


def _run_protocol(
    codec: _Codec,
    contributions: Sequence[np.ndarray],
    term_fn: TermFn,
    *,
    release_fn: ReleaseFn,
    report_fn: Callable[[np.ndarray], Any] | None,
    drop_before_round2: Collection[int],
    drop_before_round3: Collection[int],
    key_holders: int,
    min_clients: int,
    max_magnitude: float,
    count_tolerance: float,
    agreement_tolerance: float,
    tamper: TamperFn | None,
    keep_messages: bool,
) -> ProtocolTrace:
    started = time.perf_counter()
    if isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 2:
        raise ValueError(f"min_clients must be an integer >= 2, got {min_clients!r}")
    if isinstance(key_holders, bool) or not isinstance(key_holders, int) or key_holders < 1:
        raise ValueError(f"key_holders must be an integer >= 1, got {key_holders!r}")
    if not (math.isfinite(agreement_tolerance) and agreement_tolerance > 0):
        raise ValueError(f"agreement_tolerance must be > 0, got {agreement_tolerance!r}")
    vectors = _check_contributions(contributions, max_magnitude)
    k, width = len(vectors), vectors[0].size
    if k < min_clients:
        raise ProtocolError(f"{k} clients given; at least min_clients={min_clients} are needed")
    dropped2 = _client_ids("drop_before_round2", drop_before_round2, k)
    dropped3 = _client_ids("drop_before_round3", drop_before_round3, k)
    upload_bytes = np.zeros((k, NUM_ROUNDS), dtype=np.int64)
    download_bytes = np.zeros((k, NUM_ROUNDS), dtype=np.int64)
    ciphertexts = np.zeros((k, NUM_ROUNDS), dtype=np.int64)
    client_seconds = np.zeros((k, NUM_ROUNDS))
    server_seconds = [0.0] * NUM_ROUNDS
    uploads: list[Upload] = []
    rejected: list[ClientRejection] = []

    def receive(round_number: int, client: int, payload: np.ndarray) -> np.ndarray:
        if tamper is not None:
            payload = tamper(round_number, client, payload)
        upload_bytes[client, round_number - 1] += payload.nbytes
        if round_number < NUM_ROUNDS:
            ciphertexts[client, round_number - 1] += int(codec.encrypted)
        if keep_messages:
            uploads.append(Upload(round_number, client, payload))
        return payload

    def aggregate(
        round_number: int, senders: list[int], payloads: list[np.ndarray], size: int
    ) -> tuple[np.ndarray, list[int]]:
        tick = time.perf_counter()
        total, rejections = codec.add(payloads, size)
        server_seconds[round_number - 1] += time.perf_counter() - tick
        bad = {rejection.index for rejection in rejections}
        rejected.extend(
            ClientRejection(round_number, senders[r.index], r.kind, r.reason) for r in rejections
        )
        accepted = [client for index, client in enumerate(senders) if index not in bad]
        if len(accepted) < min_clients:
            raise ProtocolError(
                f"round {round_number}: only {len(accepted)} valid ciphertexts; at least "
                f"min_clients={min_clients} are needed so that no sum is one client's value"
            )
        return total, accepted

    def open_sum(total: np.ndarray, size: int, count: int, what: str) -> np.ndarray:
        decrypted = check_magnitude(
            codec.decode(total, size), max_magnitude=max_magnitude, name=what
        )
        return check_count_slot(decrypted, count, tolerance=count_tolerance)

    # Round 1: every client uploads Enc([c_i, 1]).
    senders, payloads = list(range(k)), []
    for client in senders:
        tick = time.perf_counter()
        payload = codec.encode(np.append(vectors[client], 1.0))
        client_seconds[client, 0] += time.perf_counter() - tick
        payloads.append(receive(1, client, payload))
    total1, round1 = aggregate(1, senders, payloads, width + 1)
    del payloads

    # Round 2: clients still present decrypt S1 and upload Enc([t_i, c_i, 1]).
    senders = [client for client in round1 if client not in dropped2]
    if len(senders) < min_clients:
        raise ProtocolError(
            f"round 2: {len(senders)} clients remain ({len(round1) - len(senders)} dropped "
            f"after round 1); fewer than min_clients={min_clients}, so the protocol cannot "
            "complete"
        )
    payloads, term_width = [], None
    for client in senders:
        download_bytes[client, 1] += total1.nbytes + COUNT_BYTES
        tick = time.perf_counter()
        reference = open_sum(total1, width + 1, len(round1), "round-1 sum")
        term = _as_values(term_fn(reference, vectors[client].copy()), "term_fn output")
        if float(np.max(np.abs(term))) > max_magnitude:
            raise ValueError(f"term_fn output exceeds max_magnitude={max_magnitude:.3g}")
        if term_width is None:
            term_width = term.size
        elif term.size != term_width:
            raise ValueError(
                f"term_fn must return vectors of one length: {term.size} != {term_width}"
            )
        payload = codec.encode(np.concatenate([term, vectors[client], [1.0]]))
        client_seconds[client, 1] += time.perf_counter() - tick
        payloads.append(receive(2, client, payload))
    assert term_width is not None
    size2 = term_width + width + 1
    total2, round2 = aggregate(2, senders, payloads, size2)
    del payloads

    # Round 3: key holders decrypt S1 and S2 and release aggregates.
    present = [client for client in round2 if client not in dropped3]
    if len(present) < key_holders:
        raise ProtocolError(
            f"round 3: {len(present)} clients remain to act as key holders; "
            f"key_holders={key_holders} are needed"
        )
    holders = present[:key_holders]
    releases = []
    for client in holders:
        download_bytes[client, 2] += total1.nbytes + total2.nbytes + 2 * COUNT_BYTES
        tick = time.perf_counter()
        reference = open_sum(total1, width + 1, len(round1), "round-1 sum")
        second = open_sum(total2, size2, len(round2), "round-2 sum")
        sums = DecryptedSums(
            reference=reference,
            reference_count=len(round1),
            terms=second[:term_width],
            contributions=second[term_width:],
            count=len(round2),
        )
        released = _as_values(release_fn(sums), "release_fn output")
        client_seconds[client, 2] += time.perf_counter() - tick
        releases.append(receive(3, client, released))
    tick = time.perf_counter()
    first = np.asarray(releases[0], dtype=np.float64)
    for client, other in zip(holders[1:], releases[1:], strict=True):
        other = np.asarray(other, dtype=np.float64)
        if other.shape != first.shape or not np.all(
            np.abs(other - first) <= agreement_tolerance * np.maximum(1.0, np.abs(first))
        ):
            raise ProtocolError(
                f"key holders {holders[0]} and {client} released different aggregates "
                f"(tolerance {agreement_tolerance}); the result is withheld"
            )
    report = report_fn(first) if report_fn is not None else None
    server_seconds[2] += time.perf_counter() - tick

    return ProtocolTrace(
        encrypted=codec.encrypted,
        num_clients=k,
        round1_clients=tuple(round1),
        round2_clients=tuple(round2),
        key_holders=tuple(holders),
        dropped_before_round2=tuple(sorted(dropped2 & set(round1))),
        dropped_before_round3=tuple(sorted(dropped3 & set(round2))),
        rejections=tuple(rejected),
        released=first,
        report=report,
        upload_bytes=upload_bytes,
        download_bytes=download_bytes,
        ciphertexts=ciphertexts,
        client_seconds=client_seconds,
        server_seconds=(server_seconds[0], server_seconds[1], server_seconds[2]),
        wall_seconds=time.perf_counter() - started,
        uploads=tuple(uploads),
    )


def run_protocol_locally(
    contributions: Sequence[np.ndarray],
    term_fn: TermFn,
    secret_ctx: ts.Context,
    public_ctx: ts.Context,
    *,
    release_fn: ReleaseFn = release_sums,
    report_fn: Callable[[np.ndarray], Any] | None = None,
    drop_before_round2: Collection[int] = (),
    drop_before_round3: Collection[int] = (),
    key_holders: int = 2,
    min_clients: int = 2,
    max_magnitude: float = DEFAULT_MAX_MAGNITUDE,
    count_tolerance: float = DEFAULT_COUNT_TOLERANCE,
    agreement_tolerance: float = DEFAULT_AGREEMENT_TOLERANCE,
    tamper: TamperFn | None = None,
    keep_messages: bool = False,
) -> ProtocolTrace:
    """Run the three rounds in-process with real CKKS ciphertexts (tests, benchmarks).

    Parameters
    ----------
    contributions
        One vector per client (equal lengths); the protocol appends the count slot.
    term_fn
        ``term_fn(round1_sum, contribution)``: a client's round-2 term from the decrypted
        round-1 sum (count slot removed) and its own contribution.
    secret_ctx
        The clients' context (secret key); every simulated client uses it.
    public_ctx
        The server's context (no secret key; checked).
    release_fn
        Key-holder side: the plaintext aggregates released to the server from the decrypted
        sums; default :func:`release_sums` (refuses if clients dropped between rounds 1, 2).
    report_fn
        Server side: the report (p-values) from the released aggregates.
    drop_before_round2, drop_before_round3
        Clients that drop out before that round.
    key_holders
        How many clients decrypt in round 3 (the first ones still present); their releases
        must agree to ``agreement_tolerance`` (relative, absolute below 1).
    min_clients
        Fewest clients any round may sum over (>= 2).
    max_magnitude, count_tolerance
        Checks of every decrypted sum (:func:`check_magnitude`, :func:`check_count_slot`).
    tamper
        ``tamper(round, client, payload)``: replaces a payload before the server receives it
        (tests of misbehaving clients).
    keep_messages
        Keep every received message in ``trace.uploads``.

    Raises
    ------
    ProtocolError
        Fewer than ``min_clients`` valid clients in a round, too few key holders, key holders
        disagree; :class:`StaleReferenceError` from the default ``release_fn``.
    DecryptionCheckError
        A decrypted sum failed the magnitude or count-slot check.
    """
    return _run_protocol(
        _CkksCodec(secret_ctx, public_ctx),
        contributions,
        term_fn,
        release_fn=release_fn,
        report_fn=report_fn,
        drop_before_round2=drop_before_round2,
        drop_before_round3=drop_before_round3,
        key_holders=key_holders,
        min_clients=min_clients,
        max_magnitude=max_magnitude,
        count_tolerance=count_tolerance,
        agreement_tolerance=agreement_tolerance,
        tamper=tamper,
        keep_messages=keep_messages,
    )


def run_protocol_plaintext(
    contributions: Sequence[np.ndarray],
    term_fn: TermFn,
    *,
    release_fn: ReleaseFn = release_sums,
    report_fn: Callable[[np.ndarray], Any] | None = None,
    drop_before_round2: Collection[int] = (),
    drop_before_round3: Collection[int] = (),
    key_holders: int = 2,
    min_clients: int = 2,
    max_magnitude: float = DEFAULT_MAX_MAGNITUDE,
    count_tolerance: float = DEFAULT_COUNT_TOLERANCE,
    agreement_tolerance: float = DEFAULT_AGREEMENT_TOLERANCE,
    tamper: TamperFn | None = None,
    keep_messages: bool = False,
) -> ProtocolTrace:
    """The same protocol with plain float64 vectors: a cost and precision baseline.

    NOT private (the server sees every contribution); same arguments as
    :func:`run_protocol_locally` without the contexts.
    """
    return _run_protocol(
        _PlainCodec(),
        contributions,
        term_fn,
        release_fn=release_fn,
        report_fn=report_fn,
        drop_before_round2=drop_before_round2,
        drop_before_round3=drop_before_round3,
        key_holders=key_holders,
        min_clients=min_clients,
        max_magnitude=max_magnitude,
        count_tolerance=count_tolerance,
        agreement_tolerance=agreement_tolerance,
        tamper=tamper,
        keep_messages=keep_messages,
    )
