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
(:mod:`fedparity.mechanisms.crypto.ckks.signing`, :mod:`fedparity.mechanisms.crypto.ckks.flooding`):
a server cannot have two key holders release over two round-2 sets of one run and difference
them. A holder signs one ciphertext per round, commits to one pair of sets and releases at
most once per run; it keeps its commitments and releases per secret key in a journal beside
its privacy ledger (node config ``ledger-dir``; :mod:`fedparity.mechanisms.crypto.ckks.releases`),
which survives restarts, and refuses past its policy's ``fef-max-releases-per-key``.

Holder-level DP (optional, ``dp``; :mod:`fedparity.mechanisms.crypto.ckks.holder_dp`): every holder
contributes capped, normalised weights; the key holders add keyed Gaussian noise calibrated to
one holder's sensitivity to the released sums; every round-2 holder checks the parameters
against its policy (``fef-dp-max-epsilon``, before any data is read) and charges the release's
(epsilon, delta) to each of its users' privacy ledger (by user id) before it commits, refusing
when a user cannot afford it. The parameters are bound into the commitment, so holders given
different ones never let a key holder release.

:class:`FedEvalFairHolder` is the holder, one method per message; :func:`fedevalfair_handlers`
returns its bound methods.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log

from ..mechanisms.crypto.ckks import (
    CkksParameters,
    CommitmentConflict,
    KeyMaterialError,
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
from ..mechanisms.crypto.ckks.holder_dp import HOLDER_DP_LABEL, HolderDP
from ..mechanisms.crypto.identity import IdentityError, IdentityKey, Roster, transcript
from ..mechanisms.privacy.basic_ledger import LedgerFileError, PrivacyBudgetExceeded
from ..mechanisms.privacy.user_ledger import ApproximateDPRelease
from ..mechanisms.protocol import (
    DEFAULT_LAYOUT,
    FEF_IDENTITY_REFUSAL,
    FEF_KEY,
    METRICS_KEY,
    FedEvalFairLayout,
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
from ..mechanisms.validation import check_int
from .fedevalfair import (
    MAX_MAGNITUDE,
    ROUND2_PRECISION_BITS,
    ClientStatistics,
    dp_release_vector,
    flooded_round2_sum,
    open_sum,
    release_vector,
    round1_vector,
    round2_payload,
    rows_statistics,
)
from .identity import NodeIdentity, node_identity
from .ledger import (
    default_ledger_path,
    ledger_totals,
    node_ledger_dir,
    node_ledger_registry,
    open_node_ledger,
    save_node_ledger,
)
from .messages import NodeRefusal, fixed_error_texts, session_label, session_state_key
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import tenseal as ts

__all__ = [
    "DP_LEDGER_REFUSAL",
    "DP_LEDGER_UNUSABLE",
    "DP_NEEDS_USER_IDS",
    "FEF_SECRET_CONTEXT_REFUSAL",
    "FEF_STATE_KEY",
    "FLOOD_LABEL",
    "JOURNAL_UNUSABLE_REPLY",
    "RELEASE_CAP_RULE",
    "SMALLER_ROUND2_REFUSAL",
    "SecretContextRefusal",
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
#: Node run-state record of the holder's user ids (the DP mode charges them at the commitment).
FEF_USERS_KEY = "fef-user-ids"
#: Label of the transcript that keys a release's flooding noise.
FLOOD_LABEL = "fedparity/fedevalfair/flood/v1"
#: What a holder in the DP mode answers when a user cannot afford the release (fixed sentence).
DP_LEDGER_REFUSAL = (
    "fedevalfair: the release's epsilon and delta would take some of this holder's users past "
    "their privacy budget (user-epsilon-budget at user-delta of the node's policy); this "
    "holder does not commit"
)
#: What a holder in the DP mode answers when its privacy ledger cannot be used.
DP_LEDGER_UNUSABLE = (
    "fedevalfair: this holder's privacy ledger is lost or damaged; it commits to no release "
    "until its operator restores it (the node's log names the file and the recovery)"
)
#: What a holder in the DP mode answers when its rows name no user ids to charge.
DP_NEEDS_USER_IDS = (
    "fedevalfair: the holder-level DP mode charges every user of the holder, and this "
    "holder's rows name no user ids (HolderRows.user_ids)"
)
#: The rule a key holder past its policy's release cap refuses with (a fixed sentence).
RELEASE_CAP_RULE = (
    "this key holder has made fef-max-releases-per-key releases with its secret key; new keys "
    "are needed (fedparity keys)"
)
#: What a key holder answers, in the plain mode, for a round-2 set smaller than round 1's.
SMALLER_ROUND2_REFUSAL = (
    "fedevalfair: without holder-level DP a key holder releases only over a round-2 set equal "
    "to the round-1 set (every round-2 value depends on the round-1 sum, hence on a holder "
    "left out of round 2); run the test again with the holders that answer"
)
#: What a holder without a usable secret TenSEAL context answers (a fixed sentence, no path).
FEF_SECRET_CONTEXT_REFUSAL = (
    "FedEvalFair needs this holder's secret TenSEAL context (made by fedparity keys; "
    "fedevalfair_handlers' secret_context, or node config fef-secret-context): it is missing "
    "or unreadable here (the node's log says where)"
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
    protected group of every row (0/1 for a binary attribute; 0 .. d - 1 for d groups, with
    the holder's ``num_groups = d``)."""

    labels: np.ndarray
    predictions: np.ndarray
    groups: np.ndarray
    #: The ids of the users whose rows these are (one per row, or each user once; integers).
    #: The holder-level DP mode charges each of them; None: not given (that mode refuses).
    user_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("labels", "predictions", "groups"):
            array = np.asarray(getattr(self, name))
            if array.ndim != 1:
                raise ValueError(f"{name} must be a 1-d array (one value per row)")
            if name == "groups":
                if array.size and (array.dtype.kind not in "biu" or int(array.min()) < 0):
                    raise ValueError("groups must hold integers 0 .. d - 1 (or booleans)")
            elif array.size and not np.isin(array, (0, 1)).all():
                raise ValueError(f"{name} must hold only 0/1 (or booleans)")
            arrays[name] = array.astype(np.int64)
        sizes = {name: array.size for name, array in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"labels, predictions and groups must have one value per row: {sizes}")
        for name, array in arrays.items():
            object.__setattr__(self, name, array)
        if self.user_ids is not None:
            ids = np.asarray(self.user_ids)
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise ValueError("user_ids must be a 1-d array of integer user ids")
            object.__setattr__(self, "user_ids", np.unique(ids.astype(np.int64)))


#: ``holder_rows(arrays, context)``: the holder's rows evaluated on the received model.
HolderRowsFn = Callable[[ArrayRecord, Context], HolderRows]


class HolderIdentityRefusal(IdentityError):
    """This holder has no usable identity key or roster (text:
    :data:`~fedparity.mechanisms.protocol.FEF_IDENTITY_REFUSAL`, a fixed sentence)."""

    fixed_text = True


@functools.lru_cache(maxsize=4)
def _cached_secret_context(path: str) -> ts.Context:
    return load_secret_context(path)


class SecretContextRefusal(KeyMaterialError):
    """This holder's secret TenSEAL context is missing or unreadable (text:
    :data:`FEF_SECRET_CONTEXT_REFUSAL`, a fixed sentence; the path and the cause are in the
    node's log, one line)."""

    fixed_text = True

    def __init__(self) -> None:
        super().__init__(FEF_SECRET_CONTEXT_REFUSAL)


def load_secret_context_cached(path: str | os.PathLike[str]) -> ts.Context:
    """The secret context at ``path``, loaded once per process (loading takes ~40 ms).

    Raises :class:`SecretContextRefusal` (a fixed sentence the server may read) when it is
    missing or unreadable, after logging the path and the cause on the node in one line."""
    try:
        return _cached_secret_context(os.fspath(Path(path)))
    except KeyMaterialError as error:
        log(logging.ERROR, "FedEvalFair: this holder's secret context: %s", error)
        raise SecretContextRefusal from None


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
    :func:`~fedparity.mechanisms.crypto.ckks.commitment_transcript`)."""

    statistics: ClientStatistics | None = None
    steps: set[str] = field(default_factory=set)
    commitment: bytes | None = None
    #: The holder's user ids (kept in the holder-level DP mode, charged at the commitment).
    user_ids: np.ndarray | None = None

    @classmethod
    def load(
        cls, state: RecordDict, session: str, layout: FedEvalFairLayout = DEFAULT_LAYOUT
    ) -> HolderState:
        """The session's state as the records of ``state`` hold it (empty: a new session), its
        statistics for the blocks of ``layout``."""
        arrays = state.array_records.get(session_state_key(FEF_STATE_KEY, session))
        steps = state.config_records.get(session_state_key(FEF_STEPS_KEY, session))
        commitment = state.config_records.get(session_state_key(FEF_COMMITMENT_KEY, session))
        users = state.array_records.get(session_state_key(FEF_USERS_KEY, session))
        return cls(
            statistics=(
                None
                if arrays is None
                else ClientStatistics.from_array(arrays["summaries"].numpy(), layout)
            ),
            steps=set() if steps is None else {step for step in steps if steps[step]},
            commitment=None if commitment is None else bytes(commitment["digest"]),  # type: ignore[arg-type]
            user_ids=None if users is None else users["user-ids"].numpy(),
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
        if self.user_ids is not None:
            state.array_records[session_state_key(FEF_USERS_KEY, session)] = ArrayRecord(
                {"user-ids": Array(np.asarray(self.user_ids, dtype=np.int64))}
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
    signatures bind (:func:`~fedparity.mechanisms.crypto.ckks.session_id`)."""
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
    dp: HolderDP | None = None,
    user_ids: np.ndarray | None = None,
) -> Message:
    """Keep ``statistics`` in the node's state for round 2 and reply with the round-1
    ciphertext (one CKKS vector) signed with the node's identity key for this run and round 1
    (refused if the node has no identity, or already signed a round-1 ciphertext this run).
    ``sessions``: the tests the node's run config defines (:func:`fedevalfair_handlers`).
    ``dp``: the holder-level DP mode's parameters (its contribution; ``user_ids``, the
    holder's users, are kept for the charge at the commitment and required).

    Statistics without any block (``statistics.is_empty``) are sent as weight 0, in every
    mode: a reply of the same records, shapes and ciphertext size as anyone's (an encryption
    of zeros and the count slot), never a refusal (review 2026-11-28, M1); the reasons, with
    this node's cell counts, stay in its log."""
    key, _ = holder_identity(context, identity)
    session, run_id = _session(msg, context, sessions)
    if dp is not None and user_ids is None:
        raise NodeRefusal(DP_NEEDS_USER_IDS)
    if statistics.is_empty:
        log(
            logging.WARNING,
            "FedEvalFair: this node can compute no metric and takes part with weight 0: %s",
            "; ".join(statistics.reasons) or "no block",
        )
    state = HolderState.load(context.state, session, statistics.layout)
    state.take("round1")
    state.statistics = statistics
    if dp is not None:
        state.user_ids = np.unique(np.asarray(user_ids, dtype=np.int64))
    state.save(context.state, session)
    vector = round1_vector(statistics, mu0=mu0, tolerance=tolerance, dp=dp)
    payload = encrypt_vector(secret, vector)
    return _signed_reply(msg, payload, key, run_id=run_id, round_number=1)


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
        dp: HolderDP | None = None,
        ledger_path: Callable[[Context], Path | None] | None = None,
        layout: FedEvalFairLayout = DEFAULT_LAYOUT,
    ) -> None:
        num_resamples = check_int("num_resamples", num_resamples, minimum=2)
        min_cell_count = check_int("min_cell_count", min_cell_count, minimum=0)
        if not np.isfinite(mu0):
            raise ValueError(f"mu0 must be a finite number, got {mu0!r}")
        if tolerance is not None and not (np.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"tolerance must be a finite number > 0 or None, got {tolerance!r}")
        if policy is not None and not isinstance(policy, NodePrivacyPolicy):
            raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")
        if dp is not None and not isinstance(dp, HolderDP):
            raise TypeError(f"dp must be a HolderDP or None, got {type(dp).__name__}")
        if not isinstance(layout, FedEvalFairLayout):
            raise TypeError(f"layout must be a FedEvalFairLayout, got {type(layout).__name__}")
        if dp is not None:  # the noise covers every calibrated block the layout releases
            dp = dataclasses.replace(dp, num_blocks=len(layout.dp_blocks))
        self.layout = layout
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
        self.dp = dp
        self.ledger_path = ledger_path

    # -- the node's own settings ----------------------------------------------------------------

    def limits(self, context: Context) -> NodePrivacyPolicy:
        """The node's privacy policy (the one given, else read from its node config)."""
        return self.policy if self.policy is not None else node_policy(context.node_config)

    def dp_limits(self, context: Context) -> NodePrivacyPolicy:
        """The node's policy, after refusing (fixed sentences) a holder-level DP mode whose
        epsilon or delta it does not allow, or a run without the mode when it has
        ``fef-require-dp`` -- decided from the run's parameters and the policy alone, before
        any data is read."""
        limits = self.limits(context)
        limits.check_fef_mode(self.dp)
        return limits

    def terms(self) -> bytes:
        """What the commitment binds besides the sets: the layout's terms (empty for the
        default) and the DP mode's parameters (empty when it is off)."""
        return self.layout.terms() + (b"" if self.dp is None else self.dp.terms())

    def charge(
        self, context: Context, limits: NodePrivacyPolicy, state: HolderState, session: str
    ) -> dict[str, float]:
        """The DP mode, before a commitment: charge the release's (epsilon, delta) to every
        user of this holder (by id) in the node's privacy ledger -- the one its LDP audits and
        FPFL trainings charge -- saved before the commitment is signed. Holder-level DP is
        user-level DP for each of its users (a user's data is part of one holder's). Refuses
        with fixed sentences when a user cannot afford it or the ledger cannot be used.

        Returns the ledger's totals for the commitment reply (:func:`ledger_totals`, as an LDP
        audit's reply carries them), or nothing for a holder with fewer users than its
        policy's ``min-users-for-counts``."""
        assert self.dp is not None
        if state.user_ids is None:
            raise NodeRefusal(DP_NEEDS_USER_IDS)
        ids = np.asarray(state.user_ids, dtype=np.int64)
        if ids.size == 0:
            return {}  # no user, nothing to charge
        path = (self.ledger_path or default_ledger_path)(context)
        if path is None and not limits.allow_ephemeral_ledger:
            raise PolicyRefusal(
                "a persistent privacy ledger is required (ledger-dir, or allow-ephemeral-ledger)"
            )
        release = ApproximateDPRelease(
            epsilon=self.dp.epsilon,
            delta=self.dp.delta,
            job="fedevalfair",
            label=f"FedEvalFair release with holder-level DP{f' {session!r}' if session else ''}"
            f" (max weight {self.dp.max_weight:g})",
        )
        try:
            ledger = open_node_ledger(context, path, limits, ids.size, user_ids=ids)
            ledger.charge(release, user_ids=ids)
        except LedgerFileError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "FedEvalFair: %s", error)
            raise NodeRefusal(DP_LEDGER_UNUSABLE) from None
        except PrivacyBudgetExceeded as error:
            log(logging.WARNING, "FedEvalFair: %s", error)
            raise NodeRefusal(DP_LEDGER_REFUSAL) from None
        save_node_ledger(context, path, ledger)
        if ids.size < limits.min_users_for_counts:
            return {}  # a small holder sends no totals in clear
        return ledger_totals(ledger, path)

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
        """This key's journal (:mod:`fedparity.mechanisms.crypto.ckks.releases`) in the node's
        ledger folder, or in its run state (a simulated node without one, if the policy allows an
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
        registry = node_ledger_registry(context)
        try:
            if registry is not None:  # a journal whose folder vanished is not started again
                registry.check(path, one_per_node=False)
            return ReleaseJournal.load_or_create(path, fingerprint), path
        except LedgerFileError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "FedEvalFair: %s", error)
            raise NodeRefusal(JOURNAL_UNUSABLE_REPLY) from None

    @staticmethod
    def _save_journal(context: Context, journal: ReleaseJournal, path: Path | None) -> None:
        if path is not None:
            registry = node_ledger_registry(context)
            if registry is not None and not path.exists():
                registry.register(path, f"FedEvalFair release journal of key {journal.key}")
            journal.save(path)
        else:
            context.state.config_records[f"{FEF_JOURNAL_STATE_KEY}/{journal.key}"] = ConfigRecord(
                {"json": journal.to_json()}
            )

    # -- the messages ---------------------------------------------------------------------------

    def round1(self, msg: Message, context: Context) -> Message:
        """Bootstrap the layout's metrics and comparisons on the holder's rows; reply with one
        signed ciphertext. A group value beyond the layout's ``num_groups`` is refused (the
        holder's own rows disagree with its own setting). The policy is checked first, before
        the rows are read: the DP mode's parameters (or ``fef-require-dp``) and
        ``min_cell_count`` against ``fef-min-cell-floor``. A holder that can compute no
        metric takes part with weight 0, in every mode: the same reply as anyone's."""
        self._identity(context)
        # refused before any row is read
        self.dp_limits(context).check_fef_min_cell(
            self.min_cell_count, source="min_cell_count of fedevalfair_handlers"
        )
        key = self.secret(context)
        if self.holder_rows is None:
            raise NodeRefusal("this holder computes its round-1 statistics itself")
        rows = self.holder_rows(msg.content.array_records["arrays"], context)
        if not isinstance(rows, HolderRows):
            raise TypeError(f"holder_rows must return HolderRows, got {type(rows).__name__}")
        if rows.groups.size and int(rows.groups.max()) >= self.layout.num_groups:
            raise ValueError(
                f"HolderRows.groups must be in [0, {self.layout.num_groups - 1}] for "
                f"num_groups = {self.layout.num_groups}: this holder's rows name group "
                f"{int(rows.groups.max())}"
            )
        rng = np.random.default_rng() if self.bootstrap_rng is None else self.bootstrap_rng(context)
        statistics = rows_statistics(
            rows.labels,
            rows.predictions,
            rows.groups,
            num_resamples=self.num_resamples,
            rng=rng,
            min_cell_count=self.min_cell_count,
            layout=self.layout,
        )
        return round1_reply(
            msg,
            context,
            statistics,
            key,
            mu0=self.mu0,
            tolerance=self.tolerance,
            identity=self.identity,
            sessions=self.sessions,
            dp=self.dp,
            user_ids=rows.user_ids,
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
        total = _sum(self.secret(context), request.round1, self.layout.round1_size)
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
            min_holders=self.dp_limits(context).min_holders,
            own_key=own.public_bytes(),
        )
        state = HolderState.load(context.state, session, self.layout)
        if state.statistics is None:
            raise ValueError("round 2 before round 1: this node has no bootstrap statistics")
        state.take("round2")
        state.save(context.state, session)
        key = self.secret(context)
        round1_sum = open_sum(key, request.round1_sum, self.layout.round1_size, len(contributors))
        vector = round2_payload(
            state.statistics, round1_sum, mu0=self.mu0, tolerance=self.tolerance, dp=self.dp
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
        only one of the run, kept in the node's state and its key journal. In the DP mode the
        commitment binds the DP parameters, and the first commitment of the run charges the
        release to every user of the holder before it is signed (:meth:`charge`); that reply
        carries the ledger's totals after the charge, in its metrics."""
        own, roster = self._identity(context)
        session, run_id = _session(msg, context, self.sessions)
        request = CommitRequest.from_fields(_fields(msg))
        limits = self.dp_limits(context)
        _, round2_keys = verify_round_sets(
            request.round1, request.round2, roster, run_id=run_id, min_holders=limits.min_holders
        )
        if own.public_bytes() not in round2_keys:
            raise UnverifiedSumError(
                "this node's own round-2 ciphertext is not in the set it is asked to commit to"
            )
        first, second = set_digest(request.round1), set_digest(request.round2)
        terms = self.terms()
        digest = commitment_digest(run_id, first, second, terms)
        state = HolderState.load(context.state, session, self.layout)
        state.check_commitment(digest)
        journal, path = self._journal(context, limits)
        journal.check_commit(run_id, digest)
        totals: dict[str, float] = {}
        if self.dp is not None and run_id not in journal.commitments:
            totals = self.charge(context, limits, state, session)  # saved before the commitment
        journal.commit(run_id, digest)
        self._save_journal(context, journal, path)  # before the signature leaves the node
        state.commitment = digest
        state.save(context.state, session)
        signature = own.sign(commitment_transcript(run_id, first, second, terms))
        reply = _reply(msg, CommitReply(own.public_bytes(), signature).to_fields())
        if totals:  # the ledger's totals after this release's charge, as an audit reports them
            reply.content.metric_records[METRICS_KEY] = MetricRecord({**totals})
        return reply

    def round3(self, msg: Message, context: Context) -> Message:
        """Key holder: verify both signed ciphertext sets and every round-2 holder's
        commitment to them, recompute both sums, decrypt them and release the aggregate
        statistics, noise-flooded (plaintext); the release is counted in the key's journal. In
        the plain mode only over a round-2 set equal to the round-1 set
        (:data:`SMALLER_ROUND2_REFUSAL` otherwise, from the signed sets, before anything is
        decrypted), and no block fewer than ``min-holders`` holders could compute. In the DP
        mode the released sums carry the keyed Gaussian noise of the DP mode
        (:func:`~fedparity.clients.fedevalfair.dp_release_vector`), derived from the secret
        key, the run and the commitment digest."""
        _, roster = self._identity(context)
        session, run_id = _session(msg, context, self.sessions)
        request = Round3Request.from_fields(_fields(msg))
        limits = self.dp_limits(context)
        round1_keys, round2_keys = verify_round_sets(
            request.round1, request.round2, roster, run_id=run_id, min_holders=limits.min_holders
        )
        first, second = set_digest(request.round1), set_digest(request.round2)
        terms = self.terms()
        verify_commitment(
            request.commitments,
            round2_keys,
            roster,
            run_id=run_id,
            round1_digest=first,
            round2_digest=second,
            terms=terms,
        )
        if self.dp is None and set(round2_keys) != set(round1_keys):
            raise NodeRefusal(SMALLER_ROUND2_REFUSAL)  # decided from the signed sets alone
        digest = commitment_digest(run_id, first, second, terms)
        state = HolderState.load(context.state, session, self.layout)
        state.check_commitment(digest)
        state.take("release")
        journal, path = self._journal(context, limits)
        journal.check_release(run_id, digest)
        if journal.release_count >= limits.fef_max_releases_per_key:
            raise PolicyRefusal(RELEASE_CAP_RULE)
        state.save(context.state, session)
        key = self.secret(context)
        sizes = self.layout.round1_size, self.layout.round2_size
        round1_sum = open_sum(key, _sum(key, request.round1, sizes[0]), sizes[0], len(round1_keys))
        scaled = open_sum(
            key,
            _sum(key, request.round2, sizes[1]),
            sizes[1],
            len(round2_keys),
            max_magnitude=MAX_MAGNITUDE * 2.0**ROUND2_PRECISION_BITS,
        )
        noise_key = _flood_key(self.secret_path(context))
        round2_sum = flooded_round2_sum(
            round1_sum,
            scaled,
            num_ciphertexts=len(round2_keys),
            parameters=CkksParameters.from_context(key),
            key=noise_key,
            message=transcript(FLOOD_LABEL, run_id, first, second),
            layout=self.layout,
        )
        if self.dp is None:
            released = release_vector(round2_sum, self.layout, min_holders=limits.min_holders)
        else:
            released = dp_release_vector(
                round2_sum,
                num_holders=len(round2_keys),
                dp=self.dp,
                key=noise_key,
                message=transcript(HOLDER_DP_LABEL, run_id, digest),
                layout=self.layout,
            )
        reply = ReleaseReply.from_fields({"release": released}, self.layout)  # checks the size
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
    dp: HolderDP | None = None,
    ledger_path: Callable[[Context], Path | None] | None = None,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
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
        A metric is reported only when both groups and both predictions have this many rows
        (else the holder's weight for it is 0; it never refuses). Below the node policy's
        ``fef-min-cell-floor`` round 1 is refused before the rows are read.
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
        (:func:`~fedparity.mechanisms.crypto.ckks.session_id`), so one test's ciphertexts are never
        accepted in another.
    dp : HolderDP, optional
        The holder-level DP mode (:mod:`fedparity.mechanisms.crypto.ckks.holder_dp`; the server's
        protocol must use the same): capped weights, keyed Gaussian noise on the released
        sums, each user charged (epsilon, delta) at the commitment. Needs
        ``HolderRows.user_ids``. None (default): the plain release, unchanged.
    ledger_path : callable, optional
        ``ledger_path(context)``: the node's privacy ledger file the DP mode charges (default
        ``user-ledger.json`` in :func:`~fedparity.clients.ledger.node_ledger_dir`; None: the
        run state, if the policy allows an ephemeral ledger). Pass the one the node's LDP
        audit and FPFL handlers charge.
    layout : FedEvalFairLayout, optional
        The run's tests: the metrics, the number of groups d (``HolderRows.groups`` in
        0 .. d - 1) and the reference group the others are compared with (default: dp and eo,
        groups 0 and 1). The server's protocol must use the same (it is bound into every
        commitment); in the DP mode the noise is calibrated to the calibrated blocks it
        releases (:attr:`HolderDP.num_blocks` is set from it).

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
        dp=dp,
        ledger_path=ledger_path,
        layout=layout,
    ).handlers()
