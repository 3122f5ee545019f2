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
holders recompute and endorse the sum). Before round 3 every round-2 holder signs one
commitment to the run's round-1 and round-2 sets (``fef_commit``), and a key holder recomputes
both sums itself from the signed ciphertexts and releases them, noise-flooded, only with the
commitments of *every* round-2 holder to that very pair of sets
(:mod:`fedparity.mechanisms.ckks.signing`, :mod:`fedparity.mechanisms.ckks.flooding`): a
server cannot have two key holders release over two round-2 sets of one run and difference
them. A holder signs one ciphertext per round, commits to one pair of sets and releases at
most once per run; it keeps its commitments and releases per secret key in a journal beside
its privacy ledger (node config ``ledger-dir``; :mod:`fedparity.mechanisms.ckks.releases`),
which survives restarts, and refuses past its policy's ``fef-max-releases-per-key``.

:class:`FedEvalFairHolder` is the holder, one method per message; :func:`fedevalfair_handlers`
returns its bound methods.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from ..mechanisms.accounting import LedgerFileError
from ..mechanisms.ckks import (
    CkksParameters,
    CommitmentConflict,
    ReleaseJournal,
    SignedCiphertext,
    UnverifiedSumError,
    ciphertext_transcript,
    commitment_digest,
    commitment_transcript,
    contributors_digest,
    encrypt_vector,
    endorsement_transcript,
    flood_key,
    journal_file_name,
    key_fingerprint,
    load_secret_context,
    session_id,
    set_digest,
    sum_ciphertexts,
    verify_commitment,
    verify_contributions,
    verify_endorsements,
    verify_round_sets,
)
from ..mechanisms.fairtest import InsufficientGroupData
from ..mechanisms.identity import IdentityError, IdentityKey, Roster, transcript
from ..mechanisms.protocol import (
    BLOCK_WIDTH,
    FEF_IDENTITY_REFUSAL,
    FEF_KEY,
    ROUND1_SIZE,
    ROUND2_SIZE,
    UNABLE_REPLY,
    MessageError,
)
from ..mechanisms.protocol.fedevalfair import (
    CommitReply,
    CommitRequest,
    EndorseReply,
    EndorseRequest,
    ReleaseReply,
    Round2Request,
    Round3Request,
    SignedUpload,
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
from .ledger import node_ledger_dir
from .messages import NodeRefusal, fixed_error_texts, session_label, session_state_key
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import tenseal as ts

__all__ = [
    "FEF_STATE_KEY",
    "FLOOD_LABEL",
    "JOURNAL_UNUSABLE_REPLY",
    "RELEASE_CAP_RULE",
    "CannotTakePart",
    "FedEvalFairHolder",
    "HolderIdentityRefusal",
    "HolderRows",
    "HolderRowsFn",
    "HolderState",
    "fedevalfair_handlers",
    "holder_identity",
    "load_secret_context_cached",
    "round1_reply",
]

#: Node run-state record of the round-1 statistics (read again in round 2).
FEF_STATE_KEY = "fef-statistics"
#: Node run-state record of the steps this node took in the run (each at most once).
FEF_STEPS_KEY = "fef-steps"
#: Node run-state record of the commitment this node signed in the run.
FEF_COMMITMENT_KEY = "fef-commitment"
#: Node run-state record of a key journal kept for the run only (simulation without ledger-dir).
FEF_JOURNAL_STATE_KEY = "fef-key-journal"
#: Label of the transcript that keys a release's flooding noise.
FLOOD_LABEL = "fedparity/fedevalfair/flood/v1"
#: The rule a key holder past its policy's release cap refuses with (a fixed sentence).
RELEASE_CAP_RULE = (
    "this key holder has made fef-max-releases-per-key releases with its secret key; new keys "
    "are needed (fedparity keys)"
)
#: What a holder whose key journal is lost or damaged answers (the detail stays in its log).
JOURNAL_UNUSABLE_REPLY = (
    "this holder's FedEvalFair key journal (its commitments and releases per secret key) is "
    "lost or damaged: nothing is committed or released until its operator restores it"
)
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


@dataclass
class HolderState:
    """What a holder keeps of one FedEvalFair session between messages, in its run state
    (``context.state``): the round-1 statistics (for round 2), the steps it took (each at most
    once: ``round1``, ``round2``, ``release``) and the commitment it signed (SHA-256 of
    :func:`~fedparity.mechanisms.ckks.commitment_transcript`)."""

    statistics: ClientStatistics | None = None
    steps: set[str] = field(default_factory=set)
    commitment: bytes | None = None

    @classmethod
    def load(cls, state: RecordDict, session: str) -> HolderState:
        """The session's state as the records of ``state`` hold it (empty: a new session)."""
        arrays = state.array_records.get(session_state_key(FEF_STATE_KEY, session))
        steps = state.config_records.get(session_state_key(FEF_STEPS_KEY, session))
        commitment = state.config_records.get(session_state_key(FEF_COMMITMENT_KEY, session))
        return cls(
            statistics=(
                None if arrays is None else ClientStatistics.from_array(arrays["summaries"].numpy())
            ),
            steps=set() if steps is None else {step for step in steps if steps[step]},
            commitment=None if commitment is None else bytes(commitment["digest"]),  # type: ignore[arg-type]
        )

    def save(self, state: RecordDict, session: str) -> None:
        """Write the session's state into the records of ``state``."""
        if self.statistics is not None:
            state.array_records[session_state_key(FEF_STATE_KEY, session)] = ArrayRecord(
                {"summaries": Array(self.statistics.to_array())}
            )
        state.config_records[session_state_key(FEF_STEPS_KEY, session)] = ConfigRecord(
            {step: True for step in sorted(self.steps)}
        )
        if self.commitment is not None:
            state.config_records[session_state_key(FEF_COMMITMENT_KEY, session)] = ConfigRecord(
                {"digest": self.commitment}
            )

    def take(self, step: str) -> None:
        """Refuse a step (a round's signature, a release) this node already took in the
        session; else note it."""
        if step in self.steps:
            raise PolicyRefusal(
                "a holder signs one ciphertext per round and releases at most once per run"
            )
        self.steps.add(step)

    def check_commitment(self, digest: bytes) -> None:
        """Refuse another commitment than the one this node signed in the session."""
        if self.commitment is not None and self.commitment != digest:
            raise CommitmentConflict(
                "this holder already committed to another round-1 and round-2 set in this run"
            )


def _session(msg: Message, context: Context, sessions: Collection[str]) -> tuple[str, int]:
    """The message's session (refused unless the node's run config defines it) and the id its
    signatures bind (:func:`~fedparity.mechanisms.ckks.session_id`)."""
    label = session_label(msg, sessions)
    return label, session_id(context.run_id, label)


def _fields(msg: Message) -> dict[str, np.ndarray]:
    """The arrays of the message's FedEvalFair record (``MessageError`` when it has none)."""
    record = msg.content.array_records.get(FEF_KEY)
    if record is None:
        raise MessageError(f"message record {FEF_KEY!r} is missing")
    return {name: array.numpy() for name, array in record.items()}


def _reply(msg: Message, fields: Mapping[str, np.ndarray]) -> Message:
    record = ArrayRecord({name: Array(array) for name, array in fields.items()})
    return Message(content=RecordDict({FEF_KEY: record}), reply_to=msg)


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
    return _reply(msg, SignedUpload(payload, key.public_bytes(), signature).to_fields())


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
    state = HolderState.load(context.state, session)
    state.take("round1")
    state.statistics = statistics
    state.save(context.state, session)
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


def _sum(secret: ts.Context, entries: tuple[SignedCiphertext, ...], size: int) -> bytes:
    """The holder's own sum of the signed ciphertexts (in signer order)."""
    ordered = sorted(entries, key=lambda entry: entry.signer)
    return sum_ciphertexts(secret, [entry.payload for entry in ordered], expected_size=size)


class FedEvalFairHolder:
    """A FedEvalFair data holder: one method per protocol message (``round1``, ``endorse``,
    ``round2``, ``commit``, ``round3``), each ``(msg, context) -> reply``; its state between
    messages is a :class:`HolderState` in the node's run state. The parameters are those of
    :func:`fedevalfair_handlers`, which returns the bound methods."""

    def __init__(
        self,
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
    ) -> None:
        if (
            isinstance(num_resamples, bool)
            or not isinstance(num_resamples, int)
            or num_resamples < 2
        ):
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
        self.holder_rows = holder_rows
        self.secret_context = secret_context
        self.num_resamples = num_resamples
        self.min_cell_count = min_cell_count
        self.mu0 = mu0
        self.tolerance = tolerance
        self.bootstrap_rng = bootstrap_rng
        self.policy = policy
        self.identity = identity
        self.sessions = tuple(sessions)

    # -- the node's own settings ----------------------------------------------------------------

    def limits(self, context: Context) -> NodePrivacyPolicy:
        """The node's privacy policy (the one given, else read from its node config)."""
        return self.policy if self.policy is not None else node_policy(context.node_config)

    def secret_path(self, context: Context) -> str:
        path = self.secret_context
        return os.fspath(Path(path(context) if callable(path) else path))

    def secret(self, context: Context) -> ts.Context:
        return load_secret_context_cached(self.secret_path(context))

    def _identity(self, context: Context) -> tuple[IdentityKey, Roster]:
        return holder_identity(context, self.identity)

    def _journal(
        self, context: Context, limits: NodePrivacyPolicy
    ) -> tuple[ReleaseJournal, Path | None]:
        """This key's journal (:mod:`fedparity.mechanisms.ckks.releases`) in the node's ledger
        folder, or in its run state (a simulated node without one, if the policy allows an
        ephemeral ledger); refused with fixed sentences when it cannot be used."""
        fingerprint = key_fingerprint(_flood_key(self.secret_path(context)))
        folder = node_ledger_dir(context)
        if folder is None:
            if not limits.allow_ephemeral_ledger:
                raise PolicyRefusal(
                    "a persistent privacy ledger is required (ledger-dir, or "
                    "allow-ephemeral-ledger)"
                )
            record = context.state.config_records.get(f"{FEF_JOURNAL_STATE_KEY}/{fingerprint}")
            if record is None:
                return ReleaseJournal(fingerprint), None
            try:
                journal = ReleaseJournal.from_json(
                    str(record["json"]), fingerprint, source="in this node's run state"
                )
            except LedgerFileError as error:
                log(logging.ERROR, "FedEvalFair: %s", error)
                raise NodeRefusal(JOURNAL_UNUSABLE_REPLY) from None
            return journal, None
        path = folder / journal_file_name(fingerprint)
        try:
            return ReleaseJournal.load_or_create(path, fingerprint), path
        except LedgerFileError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "FedEvalFair: %s", error)
            raise NodeRefusal(JOURNAL_UNUSABLE_REPLY) from None

    @staticmethod
    def _save_journal(context: Context, journal: ReleaseJournal, path: Path | None) -> None:
        if path is not None:
            journal.save(path)
        else:
            context.state.config_records[f"{FEF_JOURNAL_STATE_KEY}/{journal.key}"] = ConfigRecord(
                {"json": journal.to_json()}
            )

    # -- the messages ---------------------------------------------------------------------------

    def round1(self, msg: Message, context: Context) -> Message:
        """Bootstrap dp/eo on the holder's rows; reply with one signed ciphertext."""
        self._identity(context)
        key = self.secret(context)
        if self.holder_rows is None:
            raise NodeRefusal("this holder computes its round-1 statistics itself")
        rows = self.holder_rows(msg.content["arrays"], context)
        if not isinstance(rows, HolderRows):
            raise TypeError(f"holder_rows must return HolderRows, got {type(rows).__name__}")
        rng = np.random.default_rng() if self.bootstrap_rng is None else self.bootstrap_rng(context)
        try:
            statistics = rows_statistics(
                rows.labels,
                rows.predictions,
                rows.groups,
                num_resamples=self.num_resamples,
                rng=rng,
                min_cell_count=self.min_cell_count,
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
            mu0=self.mu0,
            tolerance=self.tolerance,
            identity=self.identity,
            sessions=self.sessions,
        )

    def endorse(self, msg: Message, context: Context) -> Message:
        """Verifier: recompute the round-1 sum from the signed ciphertexts and endorse it
        (nothing is decrypted)."""
        key, roster = self._identity(context)
        _, run_id = _session(msg, context, self.sessions)
        request = EndorseRequest.from_fields(_fields(msg))
        contributors = verify_contributions(
            request.round1,
            roster,
            run_id=run_id,
            round_number=1,
            min_holders=self.limits(context).min_holders,
        )
        total = _sum(self.secret(context), request.round1, ROUND1_SIZE)
        signature = key.sign(
            endorsement_transcript(run_id, 1, hashlib.sha256(total).digest(), contributors)
        )
        return _reply(msg, EndorseReply(total, key.public_bytes(), signature).to_fields())

    def round2(self, msg: Message, context: Context) -> Message:
        """Decrypt the endorsed round-1 sum, add this holder's stage-1 terms; one signed
        ciphertext back."""
        own, roster = self._identity(context)
        session, run_id = _session(msg, context, self.sessions)
        request = Round2Request.from_fields(_fields(msg))
        contributors = verify_endorsements(
            request.round1_sum,
            request.contributors,
            request.endorsements,
            roster,
            run_id=run_id,
            round_number=1,
            min_holders=self.limits(context).min_holders,
            own_key=own.public_bytes(),
        )
        state = HolderState.load(context.state, session)
        if state.statistics is None:
            raise ValueError("round 2 before round 1: this node has no bootstrap statistics")
        state.take("round2")
        state.save(context.state, session)
        key = self.secret(context)
        round1_sum = open_sum(key, request.round1_sum, ROUND1_SIZE, len(contributors))
        vector = round2_payload(
            state.statistics, round1_sum, mu0=self.mu0, tolerance=self.tolerance
        )
        return _signed_reply(
            msg,
            encrypt_vector(key, vector),
            own,
            run_id=run_id,
            round_number=2,
            reference=contributors_digest(contributors),
        )

    def commit(self, msg: Message, context: Context) -> Message:
        """Round-2 holder: check the run's round-1 and round-2 sets (signed digests; this
        holder's own round-2 ciphertext among them) and sign one commitment to them -- the
        only one of the run, kept in the node's state and its key journal."""
        own, roster = self._identity(context)
        session, run_id = _session(msg, context, self.sessions)
        request = CommitRequest.from_fields(_fields(msg))
        limits = self.limits(context)
        _, round2_keys = verify_round_sets(
            request.round1, request.round2, roster, run_id=run_id, min_holders=limits.min_holders
        )
        if own.public_bytes() not in round2_keys:
            raise UnverifiedSumError(
                "this node's own round-2 ciphertext is not in the set it is asked to commit to"
            )
        first, second = set_digest(request.round1), set_digest(request.round2)
        digest = commitment_digest(run_id, first, second)
        state = HolderState.load(context.state, session)
        state.check_commitment(digest)
        journal, path = self._journal(context, limits)
        journal.commit(run_id, digest)
        self._save_journal(context, journal, path)  # before the signature leaves the node
        state.commitment = digest
        state.save(context.state, session)
        signature = own.sign(commitment_transcript(run_id, first, second))
        return _reply(msg, CommitReply(own.public_bytes(), signature).to_fields())

    def round3(self, msg: Message, context: Context) -> Message:
        """Key holder: verify both signed ciphertext sets and every round-2 holder's
        commitment to them, recompute both sums, decrypt them and release the aggregate
        statistics, noise-flooded (plaintext); the release is counted in the key's journal."""
        _, roster = self._identity(context)
        session, run_id = _session(msg, context, self.sessions)
        request = Round3Request.from_fields(_fields(msg))
        limits = self.limits(context)
        round1_keys, round2_keys = verify_round_sets(
            request.round1, request.round2, roster, run_id=run_id, min_holders=limits.min_holders
        )
        first, second = set_digest(request.round1), set_digest(request.round2)
        verify_commitment(
            request.commitments,
            round2_keys,
            roster,
            run_id=run_id,
            round1_digest=first,
            round2_digest=second,
        )
        digest = commitment_digest(run_id, first, second)
        state = HolderState.load(context.state, session)
        state.check_commitment(digest)
        state.take("release")
        journal, path = self._journal(context, limits)
        journal.check_release(run_id, digest)
        if journal.release_count >= limits.fef_max_releases_per_key:
            raise PolicyRefusal(RELEASE_CAP_RULE)
        state.save(context.state, session)
        key = self.secret(context)
        round1_sum = open_sum(
            key, _sum(key, request.round1, ROUND1_SIZE), ROUND1_SIZE, len(round1_keys)
        )
        scaled = open_sum(
            key,
            _sum(key, request.round2, ROUND2_SIZE),
            ROUND2_SIZE,
            len(round2_keys),
            max_magnitude=MAX_MAGNITUDE * 2.0**ROUND2_PRECISION_BITS,
        )
        round2_sum = flooded_round2_sum(
            round1_sum,
            scaled,
            num_ciphertexts=len(round2_keys),
            parameters=CkksParameters.from_context(key),
            key=_flood_key(self.secret_path(context)),
            message=transcript(FLOOD_LABEL, run_id, first, second),
        )
        released = release_vector(_release_reference(round1_sum), round2_sum)
        reply = ReleaseReply.from_fields({"release": released})  # checks the size
        journal.record_release(run_id, digest)
        self._save_journal(context, journal, path)  # counted before the release leaves
        return _reply(msg, reply.to_fields())

    def handlers(self) -> dict[str, Handler]:
        """The bound methods by the action to register with ``app.query`` (``fef_round1``
        only with ``holder_rows``), each wrapped so that what reaches the server is a fixed
        sentence (:func:`~fedparity.clients.messages.fixed_error_texts`)."""
        handlers: dict[str, Handler] = {
            "fef_endorse": self.endorse,
            "fef_round2": self.round2,
            "fef_commit": self.commit,
            "fef_round3": self.round3,
        }
        if self.holder_rows is not None:
            handlers = {"fef_round1": self.round1, **handlers}
        # what reaches the server is a fixed sentence (the node logs the rest)
        return {action: fixed_error_texts(handler) for action, handler in handlers.items()}


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
    """The FedEvalFair handlers, keyed by the action to register with ``app.query``
    (``fef_round1``, ``fef_endorse``, ``fef_round2``, ``fef_commit``, ``fef_round3``): the
    bound methods of a :class:`FedEvalFairHolder`.

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
        holders is never decrypted, and a key holder releases at most
        ``fef-max-releases-per-key`` times with one secret key. Default: read for each message
        from the node's own config or environment
        (:func:`~fedparity.clients.policy.node_policy`).
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

    The key's journal of commitments and releases lives in the node's ledger folder (node
    config ``ledger-dir``; outside simulation ``~/.fedparity/ledgers`` by default).
    """
    return FedEvalFairHolder(
        holder_rows,
        secret_context=secret_context,
        num_resamples=num_resamples,
        min_cell_count=min_cell_count,
        mu0=mu0,
        tolerance=tolerance,
        bootstrap_rng=bootstrap_rng,
        policy=policy,
        identity=identity,
        sessions=sessions,
    ).handlers()
