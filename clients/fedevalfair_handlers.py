"""FedEvalFair on a data holder, as handlers for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.fedevalfair.FedEvalFairProtocol` runs three rounds
(``query.fef_round1`` .. ``query.fef_round3``) over CKKS ciphertexts ("FedEvalFair: A
Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation Framework",
anonymous authors, under review; Algorithms 1-2). On the holder, round 1 calls *your*
function for the received model's predictions on your rows; rounds 2 and 3 need no data.
Register them with::

    from fedparity.clients import HolderRows, fedevalfair_handlers

    def my_rows(arrays, context):
        model = load_my_model(arrays)
        return HolderRows(labels=y, predictions=model_predictions, groups=sex)

    handlers = fedevalfair_handlers(my_rows, secret_context="/etc/fedparity/secret.tenseal")
    for action, handler in handlers.items():
        app.query(action)(handler)

The secret context (made by ``fedparity keys``, handed out of band) is the node's own: its
path is an argument here, never something the server sends. ``mu0`` and ``tolerance`` must be
the values the server's protocol object uses.

Against an active server (threat model: docs/threat-model.md) every holder also needs its
Ed25519 identity key and the roster of the holders (node config ``identity-key`` and
``roster``, or ``FEDPARITY_IDENTITY_DIR`` in a simulation; ``fedparity keys --holders N``
writes both with the secret context). Every ciphertext it uploads is signed for this run and
round; it decrypts a round-1 sum only with an endorsement by a roster member naming at least
``min-holders`` distinct signed contributors, itself among them (``fef_endorse``: the key
holders recompute and endorse the sum), and a key holder recomputes both sums itself from
the signed ciphertexts and releases them only noise-flooded
(:mod:`fedparity.mechanisms.ckks.signing`, :mod:`fedparity.mechanisms.ckks.flooding`). A
holder signs one ciphertext per round and releases at most once per run.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from ..mechanisms.ckks import (
    CkksParameters,
    SignedCiphertext,
    UnverifiedSumError,
    ciphertext_transcript,
    contributors_digest,
    encrypt_vector,
    endorsement_transcript,
    flood_key,
    from_array,
    load_secret_context,
    session_id,
    signed_from_arrays,
    sum_ciphertexts,
    to_array,
    unpack_keys,
    verify_contributions,
    verify_endorsements,
)
from ..mechanisms.fairtest import InsufficientGroupData
from ..mechanisms.identity import SIGNATURE_BYTES, IdentityError, IdentityKey, Roster, transcript
from ..mechanisms.protocol import (
    BLOCK_WIDTH,
    FEF_IDENTITY_REFUSAL,
    FEF_KEY,
    RELEASE_SIZE,
    ROUND1_SIZE,
    ROUND2_SIZE,
    UNABLE_REPLY,
)
from .fedevalfair import (
    MAX_MAGNITUDE,
    ROUND2_PRECISION_BITS,
    ClientStatistics,
    flooded_round2_sum,
    open_sum,
    release_vector,
    round1_vector,
    round2_payload,
    rows_statistics,
)
from .identity import NodeIdentity, node_identity
from .messages import fixed_error_texts, session_label, session_state_key
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import tenseal as ts

__all__ = [
    "FEF_STATE_KEY",
    "CannotTakePart",
    "HolderIdentityRefusal",
    "FLOOD_LABEL",
    "HolderRows",
    "HolderRowsFn",
    "fedevalfair_handlers",
    "holder_identity",
    "load_secret_context_cached",
    "round1_reply",
]

#: Node run-state record of the round-1 statistics (read again in round 2).
FEF_STATE_KEY = "fef-statistics"
#: Node run-state record of the steps this node took in the run (each at most once).
FEF_STEPS_KEY = "fef-steps"
#: Label of the transcript that keys a release's flooding noise.
FLOOD_LABEL = "fedparity/fedevalfair/flood/v1"
Handler = Callable[[Message, Context], Message]


@dataclass(frozen=True)
class HolderRows:
    """A holder's test rows for the received model: true labels, 0/1 predictions and the
    binary protected group (0/1) of every row."""

    labels: np.ndarray
    predictions: np.ndarray
    groups: np.ndarray

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("labels", "predictions", "groups"):
            array = np.asarray(getattr(self, name))
            if array.ndim != 1:
                raise ValueError(f"{name} must be a 1-d array (one value per row)")
            if array.size and not np.isin(array, (0, 1)).all():
                raise ValueError(f"{name} must hold only 0/1 (or booleans)")
            arrays[name] = array.astype(np.int64)
        sizes = {name: array.size for name, array in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"labels, predictions and groups must have one value per row: {sizes}")
        for name, array in arrays.items():
            object.__setattr__(self, name, array)


#: ``holder_rows(arrays, context)``: the holder's rows evaluated on the received model.
HolderRowsFn = Callable[[ArrayRecord, Context], HolderRows]


class HolderIdentityRefusal(IdentityError):
    """This holder has no usable identity key or roster (text:
    :data:`~fedparity.mechanisms.protocol.FEF_IDENTITY_REFUSAL`, a fixed sentence)."""

    fixed_text = True


class CannotTakePart(InsufficientGroupData):
    """This holder cannot bootstrap any metric (text:
    :data:`~fedparity.mechanisms.protocol.UNABLE_REPLY`, a fixed sentence without counts)."""

    fixed_text = True

    def __init__(self) -> None:
        super().__init__(UNABLE_REPLY)


@functools.lru_cache(maxsize=4)
def _cached_secret_context(path: str) -> ts.Context:
    return load_secret_context(path)


def load_secret_context_cached(path: str | os.PathLike[str]) -> ts.Context:
    """The secret context at ``path``, loaded once per process (loading takes ~40 ms)."""
    return _cached_secret_context(os.fspath(Path(path)))


@functools.lru_cache(maxsize=4)
def _flood_key(path: str) -> bytes:
    return flood_key(_cached_secret_context(path))


def holder_identity(
    context: Context, identity: Callable[[Context], NodeIdentity] | None = None
) -> tuple[IdentityKey, Roster]:
    """This holder's identity key and roster (``identity(context)``, default its node config
    or ``FEDPARITY_IDENTITY_DIR``: :func:`fedparity.clients.identity.node_identity`).

    Raises IdentityError with :data:`~fedparity.mechanisms.protocol.FEF_IDENTITY_REFUSAL` (a
    fixed sentence naming the node config keys; the detail stays in the node's log) when
    either is missing, unreadable or the key is not on the roster.
    """
    try:
        found = identity(context) if identity is not None else node_identity(context.node_config)
        return found.require("FedEvalFair")
    except IdentityError as error:
        log(logging.WARNING, "FedEvalFair: no usable identity on this node: %s", error)
        raise HolderIdentityRefusal(FEF_IDENTITY_REFUSAL) from None


def _session(msg: Message, context: Context, sessions: Collection[str]) -> tuple[str, int]:
    """The message's session (refused unless the node's run config defines it) and the id its
    signatures bind (:func:`~fedparity.mechanisms.ckks.session_id`)."""
    label = session_label(msg, sessions)
    return label, session_id(context.run_id, label)


def _take_step(context: Context, step: str, session: str = "") -> None:
    """Refuse a step (a round's signature, a release) this node already took in this run's
    ``session``."""
    steps_key = session_state_key(FEF_STEPS_KEY, session)
    record = context.state.config_records.get(steps_key)
    if record is None:
        record = ConfigRecord()
        context.state.config_records[steps_key] = record
    if step in record:
        raise PolicyRefusal(
            "a holder signs one ciphertext per round and releases at most once per run"
        )
    record[step] = True


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def _keys_or_none(array: np.ndarray, width: int = 32) -> list[bytes]:
    """:func:`~fedparity.mechanisms.ckks.unpack_keys`, with an empty array read as no keys."""
    return [] if array.size == 0 else unpack_keys(array, width=width)


def _signed_reply(
    msg: Message,
    payload: bytes,
    key: IdentityKey,
    *,
    run_id: int,
    round_number: int,
    reference: bytes = b"",
) -> Message:
    digest = hashlib.sha256(payload).digest()
    signature = key.sign(ciphertext_transcript(run_id, round_number, digest, reference))
    record = ArrayRecord(
        {
            "ciphertext": Array(to_array(payload)),
            "signature": Array(to_array(signature)),
            "signer": Array(to_array(key.public_bytes())),
        }
    )
    return Message(content=RecordDict({FEF_KEY: record}), reply_to=msg)


def round1_reply(
    msg: Message,
    context: Context,
    statistics: ClientStatistics,
    secret: ts.Context,
    *,
    mu0: float,
    tolerance: float | None,
    identity: Callable[[Context], NodeIdentity] | None = None,
    sessions: Collection[str] = ("",),
) -> Message:
    """Keep ``statistics`` in the node's state for round 2 and reply with the round-1
    ciphertext (one CKKS vector) signed with the node's identity key for this run and round 1
    (refused if the node has no identity, or already signed a round-1 ciphertext this run).
    ``sessions``: the tests the node's run config defines (:func:`fedevalfair_handlers`)."""
    key, _ = holder_identity(context, identity)
    session, run_id = _session(msg, context, sessions)
    _take_step(context, "round1", session)
    context.state.array_records[session_state_key(FEF_STATE_KEY, session)] = ArrayRecord(
        {"summaries": Array(statistics.to_array())}
    )
    vector = round1_vector(statistics, mu0=mu0, tolerance=tolerance)
    payload = encrypt_vector(secret, vector)
    return _signed_reply(msg, payload, key, run_id=run_id, round_number=1)


def _release_reference(round1_sum: np.ndarray) -> np.ndarray:
    """The round-1 sum as :func:`release_vector` may see it: only its per-block counts
    (rounded to integers), every other value zero -- the round-1 sum is never released."""
    reference = np.zeros_like(round1_sum)
    counts = slice(BLOCK_WIDTH - 1, None, BLOCK_WIDTH)
    reference[counts] = np.round(round1_sum[counts])
    return reference


def _set_digest(entries: list[SignedCiphertext]) -> bytes:
    ordered = sorted(entries, key=lambda entry: entry.signer)
    return hashlib.sha256(b"".join(entry.signer + entry.digest for entry in ordered)).digest()


def fedevalfair_handlers(
    holder_rows: HolderRowsFn | None,
    *,
    secret_context: str | os.PathLike[str] | Callable[[Context], str | os.PathLike[str]],
    num_resamples: int = 100,
    min_cell_count: int = 5,
    mu0: float = 0.0,
    tolerance: float | None = None,
    bootstrap_rng: Callable[[Context], np.random.Generator] | None = None,
    policy: NodePrivacyPolicy | None = None,
    identity: Callable[[Context], NodeIdentity] | None = None,
    sessions: Collection[str] = ("",),
) -> dict[str, Handler]:
    """The four FedEvalFair handlers, keyed by the action to register with ``app.query``
    (``fef_round1``, ``fef_endorse``, ``fef_round2``, ``fef_round3``).

    Parameters
    ----------
    holder_rows : callable or None
        ``holder_rows(arrays, context) -> HolderRows`` for round 1. None leaves round 1 out
        of the returned mapping (for an app that computes its own round-1 statistics and
        replies with :func:`round1_reply`).
    secret_context : path, or callable of the Context returning one
        The holder's secret TenSEAL context file (never sent by the server).
    num_resamples : int
        Bootstrap resamples B per metric (FedEvalFair's per-holder bootstrap).
    min_cell_count : int
        A metric is reported only when both groups and both predictions have this many rows.
    mu0, tolerance : float, float or None
        The stage-2 null value and the TOST tolerance; the server's protocol must use the same.
    bootstrap_rng : callable, optional
        ``bootstrap_rng(context) -> numpy Generator`` for the bootstrap resamples (not a
        privacy mechanism: a seed makes the statistics reproducible). Default: OS entropy.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy: a sum of fewer than its ``min-holders`` distinct signed
        holders is never decrypted. Default: read for each message from the node's own
        config or environment (:func:`~fedparity.clients.policy.node_policy`).
    identity : callable, optional
        ``identity(context) -> NodeIdentity``: the holder's identity key and roster. Default
        :func:`fedparity.clients.identity.node_identity` of the node config (keys
        ``identity-key`` and ``roster``) or ``FEDPARITY_IDENTITY_DIR``.
    sessions : collection of str, optional
        The tests this node's run defines (``("",)``: one). A run that tests more than one
        model (the pipeline: ``("fpfl", "pfl")``) labels each; every session has its own
        steps, and its signatures bind the session
        (:func:`~fedparity.mechanisms.ckks.session_id`), so one test's ciphertexts are never
        accepted in another.
    """
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int) or num_resamples < 2:
        raise ValueError(f"num_resamples must be an integer >= 2, got {num_resamples!r}")
    if isinstance(min_cell_count, bool) or not isinstance(min_cell_count, int):
        raise ValueError(f"min_cell_count must be an integer >= 0, got {min_cell_count!r}")
    if min_cell_count < 0:
        raise ValueError(f"min_cell_count must be an integer >= 0, got {min_cell_count!r}")
    if not np.isfinite(mu0):
        raise ValueError(f"mu0 must be a finite number, got {mu0!r}")
    if tolerance is not None and not (np.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a finite number > 0 or None, got {tolerance!r}")

    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")

    def min_holders(context: Context) -> int:
        limits = policy if policy is not None else node_policy(context.node_config)
        return limits.min_holders

    def secret_path(context: Context) -> str:
        path = secret_context(context) if callable(secret_context) else secret_context
        return os.fspath(Path(path))

    def secret(context: Context) -> ts.Context:
        return load_secret_context_cached(secret_path(context))

    def round1(msg: Message, context: Context) -> Message:
        """Bootstrap dp/eo on the holder's rows; reply with one signed ciphertext."""
        holder_identity(context, identity)
        key = secret(context)
        assert holder_rows is not None
        rows = holder_rows(msg.content["arrays"], context)
        if not isinstance(rows, HolderRows):
            raise TypeError(f"holder_rows must return HolderRows, got {type(rows).__name__}")
        try:
            statistics = rows_statistics(
                rows.labels,
                rows.predictions,
                rows.groups,
                num_resamples=num_resamples,
                rng=np.random.default_rng() if bootstrap_rng is None else bootstrap_rng(context),
                min_cell_count=min_cell_count,
            )
        except InsufficientGroupData as error:
            # The detailed reason holds this node's cell counts: it stays in the node's log.
            log(logging.WARNING, "FedEvalFair: this node cannot take part: %s", error)
            raise CannotTakePart from None
        return round1_reply(
            msg,
            context,
            statistics,
            key,
            mu0=mu0,
            tolerance=tolerance,
            identity=identity,
            sessions=sessions,
        )

    def endorse(msg: Message, context: Context) -> Message:
        """Verifier: recompute the round-1 sum from the signed ciphertexts and endorse it
        (nothing is decrypted)."""
        key, roster = holder_identity(context, identity)
        _, run_id = _session(msg, context, sessions)
        entries = signed_from_arrays(_arrays(msg.content.array_records[FEF_KEY]))
        contributors = verify_contributions(
            entries,
            roster,
            run_id=run_id,
            round_number=1,
            min_holders=min_holders(context),
        )
        ordered = sorted(entries, key=lambda entry: entry.signer)
        total = sum_ciphertexts(
            secret(context), [entry.payload for entry in ordered], expected_size=ROUND1_SIZE
        )
        signature = key.sign(
            endorsement_transcript(run_id, 1, hashlib.sha256(total).digest(), contributors)
        )
        record = ArrayRecord(
            {
                "sum": Array(to_array(total)),
                "endorsement": Array(to_array(signature)),
                "endorser": Array(to_array(key.public_bytes())),
            }
        )
        return Message(content=RecordDict({FEF_KEY: record}), reply_to=msg)

    def round2(msg: Message, context: Context) -> Message:
        """Decrypt the endorsed round-1 sum, add this holder's stage-1 terms; one signed
        ciphertext back."""
        own, roster = holder_identity(context, identity)
        session, run_id = _session(msg, context, sessions)
        state_key = session_state_key(FEF_STATE_KEY, session)
        record = msg.content.array_records[FEF_KEY]
        total = from_array(record["round1-sum"].numpy())
        endorsers = _keys_or_none(record["endorsers"].numpy())
        signatures = _keys_or_none(record["endorsements"].numpy(), width=SIGNATURE_BYTES)
        if len(endorsers) != len(signatures):
            raise UnverifiedSumError("the numbers of endorsers and endorsements differ")
        contributors = verify_endorsements(
            total,
            unpack_keys(record["contributors"].numpy()),
            list(zip(endorsers, signatures, strict=True)),
            roster,
            run_id=run_id,
            round_number=1,
            min_holders=min_holders(context),
            own_key=own.public_bytes(),
        )
        if state_key not in context.state.array_records:
            raise ValueError("round 2 before round 1: this node has no bootstrap statistics")
        _take_step(context, "round2", session)
        key = secret(context)
        round1_sum = open_sum(key, total, ROUND1_SIZE, len(contributors))
        statistics = ClientStatistics.from_array(
            context.state.array_records[state_key]["summaries"].numpy()
        )
        vector = round2_payload(statistics, round1_sum, mu0=mu0, tolerance=tolerance)
        return _signed_reply(
            msg,
            encrypt_vector(key, vector),
            own,
            run_id=run_id,
            round_number=2,
            reference=contributors_digest(contributors),
        )

    def round3(msg: Message, context: Context) -> Message:
        """Key holder: verify both signed ciphertext sets, recompute both sums, decrypt them
        and release the aggregate statistics, noise-flooded (plaintext)."""
        _, roster = holder_identity(context, identity)
        arrays = _arrays(msg.content.array_records[FEF_KEY])
        first = signed_from_arrays(arrays, "round1-")
        second = signed_from_arrays(arrays, "round2-")
        minimum = min_holders(context)
        session, run_id = _session(msg, context, sessions)
        round1_keys = verify_contributions(
            first, roster, run_id=run_id, round_number=1, min_holders=minimum
        )
        round2_keys = verify_contributions(
            second,
            roster,
            run_id=run_id,
            round_number=2,
            reference=contributors_digest(round1_keys),
            min_holders=minimum,
        )
        if not set(round2_keys) <= set(round1_keys):
            raise UnverifiedSumError("a round-2 contributor did not contribute to round 1")
        _take_step(context, "release", session)
        key = secret(context)
        sums = []
        for entries, size in ((first, ROUND1_SIZE), (second, ROUND2_SIZE)):
            ordered = sorted(entries, key=lambda entry: entry.signer)
            sums.append(sum_ciphertexts(key, [e.payload for e in ordered], expected_size=size))
        round1_sum = open_sum(key, sums[0], ROUND1_SIZE, len(round1_keys))
        scaled = open_sum(
            key,
            sums[1],
            ROUND2_SIZE,
            len(round2_keys),
            max_magnitude=MAX_MAGNITUDE * 2.0**ROUND2_PRECISION_BITS,
        )
        message = transcript(FLOOD_LABEL, run_id, _set_digest(first), _set_digest(second))
        round2_sum = flooded_round2_sum(
            round1_sum,
            scaled,
            num_ciphertexts=len(round2_keys),
            parameters=CkksParameters.from_context(key),
            key=_flood_key(secret_path(context)),
            message=message,
        )
        released = release_vector(_release_reference(round1_sum), round2_sum)
        if released.size != RELEASE_SIZE:
            raise ValueError(f"release has {released.size} values, expected {RELEASE_SIZE}")
        reply = ArrayRecord({"release": Array(released)})
        return Message(content=RecordDict({FEF_KEY: reply}), reply_to=msg)

    handlers: dict[str, Handler] = {
        "fef_endorse": endorse,
        "fef_round2": round2,
        "fef_round3": round3,
    }
    if holder_rows is not None:
        handlers = {"fef_round1": round1, **handlers}
    # what reaches the server is a fixed sentence (the node logs the rest)
    return {action: fixed_error_texts(handler) for action, handler in handlers.items()}
