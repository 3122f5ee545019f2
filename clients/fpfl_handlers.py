"""FPFL training on a node, as handlers for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.fpfl.FPFLProtocol` runs a setup and then, per
round, one message with the model weights and one unmask request (Rodriguez-Galvez,
Granqvist, van Dalen and Seigel, "Enforcing fairness in private federated learning via the
modified method of differential multipliers", 2021, Algorithm 1; Bonawitz et al., "Practical
Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017). Register the handlers
with::

    from fedparity.clients import FPFLNodeSettings, fpfl_handlers

    settings = FPFLNodeSettings(constraint="fnr", cohort_size=1000, rounds=250,
                                clipping_bound=2.0, epsilon=2.0)
    for action, handler in fpfl_handlers(make_model, my_users, settings).items():
        app.query(action)(handler)

``make_model()`` returns an instance of your model (one built once will do: every round loads
all of its parameters), ending in ``nn.Sigmoid`` (binary) or ``nn.Softmax(dim=-1)``
(multi-class): the fairness surrogates need probabilities; batch norm is refused.
``my_users(context)`` returns the node's users as an
:class:`~fedparity.clients.fpfl_data.FPFLShard`.

**Agreed once, pinned for the run** (the messages: :mod:`fedparity.mechanisms.protocol.fpfl`).
``fpfl_setup`` proposes the run's parameters (``K``, ``m``, ``T``, epsilon, delta, sigma,
``C``, rho, constraint, groups, vector size, session). The node refuses, before computing
anything, parameters that are not its own ``settings``, that its
:class:`~fedparity.clients.policy.NodePrivacyPolicy` does not allow (``max-population``,
``fpfl-max-rounds``, ``max-groups``, ``fpfl-max-dropout-tolerance``, ``fpfl-max-delta``,
``fpfl-min-noise-multiplier``), a sigma whose epsilon (its own accountant) is above its
``settings.epsilon``, or, under ``require-roster`` (the built-in policy's default outside
simulation), a masked run when it has no roster and identity key: without a roster the server
could invent peers (sybils) whose masks it knows. It signs the parameters' digest with its
masking key. ``fpfl_keys``
brings the members and their keys, which the node checks (with a roster: every key signed by
a distinct roster member over the *same* parameters) and pins with the run digest, from which
every pair secret is derived: nodes shown different parameters or tables derive masks that do
not cancel. The node compares the server's fixed-point codec with its own. A round names the
run digest and carries only the weights; a node refuses another digest, so every round uses
the pinned ``K``, sigma and ``q``.

**Charged what is released.** Before its first noisy round the node checks that every user
can afford the whole training (``SubsampledGaussianRelease`` of the pinned sigma, ``q = m / K``
and ``T``) and refuses the run otherwise; it then charges the training to every user in its
per-user ledger (:mod:`fedparity.clients.ledger`) in blocks of rounds that double (1, 2, 4,
... up to ``T``), each saved before the round that opens it is released, so a training stopped
after ``r`` rounds is charged at most ``2 r - 1`` rounds (review L1 of 2026-11-28), and releases
at most ``T`` noisy sums. Every round is the pinned release, so the charge is what is released.

**No timing channel on sampling.** Every round computes the same fixed workload of user slots
and rows whoever was sampled (:func:`~fedparity.clients.fpfl_node.node_workload`); the chance
that a cohort outgrows it is charged with the training (``timing_tail_probability``).

**Replies that do not depend on the data.** Every refusal is decided from the request and the
node's policy before the data is read: weights beyond ``fpfl-max-weight`` or of the wrong
size are refused first; a user whose statistics are not finite contributes zeros; a round
counted as released always sends its noised vector.

Against a server that reads late replies, replays, edits messages or splits views (each rule
is a test in ``tests/test_secure_sum_attacks.py`` and ``tests/test_agreed_parameters.py``):

* a round number is masked at most once, in increasing order; an unmask request is answered
  once, for the round masked last, for survivors and dropped nodes that split the members;
* every vector carries a self-mask whose seed only ``t`` survivors' shares rebuild
  (:func:`~fedparity.mechanisms.crypto.secure_sum.share_threshold`: ``t + r > n + 1 + c`` for the
  ``r`` survivors a node reveals for, with or without noise);
* a round in which a node dropped is unmasked only for a view that enough members attested
  (:func:`~fedparity.mechanisms.crypto.secure_sum.attestation_threshold`); a node attests one such
  view per round, so no node reveals pair seeds with a peer another honest node saw alive;
* every refusal reaches the server as a fixed sentence
  (:func:`~fedparity.clients.messages.fixed_error_texts`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log

from ..mechanisms.crypto.identity import IdentityError
from ..mechanisms.crypto.secure_sum import (
    FixedPointCodec,
    MaskingKeyPair,
    attest_view,
    attestation_threshold,
    check_attestations,
    check_signed_key_table,
    contribution_codec,
    mask_vector,
    masking_key_transcript,
    minimum_survivors,
    new_self_seed,
    open_share,
    pair_secrets,
    reveal_minimum,
    reveal_round_seeds,
    seal_share,
    share_self_seed,
    share_threshold,
)
from ..mechanisms.fpfl.cohort_workload import CohortWorkload
from ..mechanisms.fpfl.fairfed import release_size
from ..mechanisms.privacy.basic_ledger import LedgerFileError, PrivacyBudgetExceeded
from ..mechanisms.privacy.user_ledger import SubsampledGaussianRelease, UserLedger
from ..mechanisms.protocol import FPFL_KEY, METRICS_KEY
from ..mechanisms.protocol.fpfl import (
    RELEASE_ARRAY,
    FPFLConfirmReply,
    FPFLConfirmRequest,
    FPFLKeysReply,
    FPFLKeyTable,
    FPFLRevealReply,
    FPFLRevealRequest,
    FPFLRoundReply,
    FPFLRoundRequest,
    FPFLRunParameters,
    FPFLSetupReply,
    FPFLSetupRequest,
)
from .fpfl_data import FPFLShard
from .fpfl_node import FPFLNodeSettings, node_workload, round_contribution, round_rng
from .identity import NodeIdentity, node_identity
from .ledger import default_ledger_path, ledger_totals, open_node_ledger, save_node_ledger
from .messages import NodeRefusal, fixed_error_texts, session_label, session_state_key
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import torch

__all__ = [
    "FPFL_LEDGER_REFUSAL",
    "FPFL_LEDGER_UNUSABLE",
    "FPFL_STATE_KEY",
    "MAX_STEP_TO_SHARE_STD",
    "FPFLNode",
    "FPFLRunState",
    "fpfl_handlers",
]

#: Node run-state record of one session's FPFL state (:class:`FPFLRunState`).
FPFL_STATE_KEY = "fpfl-run"
#: The largest quantisation step a node accepts, as a fraction of its noise-share std: the
#: deterministic rounding must stay far below the noise that hides the sum.
MAX_STEP_TO_SHARE_STD = 2.0**-10
#: What the server reads from a node whose users cannot afford the training.
FPFL_LEDGER_REFUSAL = (
    "fpfl: the whole training would take some of this node's users past their privacy budget "
    "(user-epsilon-budget at user-delta of the node's policy); this node does not take part"
)
#: What the server reads from a node whose ledger is lost or damaged.
FPFL_LEDGER_UNUSABLE = (
    "fpfl: this node's privacy ledger is lost or damaged; it takes part in no training until "
    "its operator restores it (the node's log names the file and the recovery)"
)
#: Relative slack on the epsilon a node recomputes for the run's sigma (the same accountant on
#: the same numbers; the slack only absorbs the last bits of floating point).
_EPSILON_SLACK = 1e-9
Handler = Callable[[Message, Context], Message]
_PARAMETER_PREFIX = "parameter:"


@dataclass
class FPFLRunState:
    """One training's state on a node (a session of a run), kept in the node's
    ``context.state``: what was agreed at setup, the pinned table, and each round's progress.
    """

    run_salt: bytes
    parameters: FPFLRunParameters
    private_key: bytes = b""
    members: tuple[int, ...] = ()
    secrets: dict[int, bytes] = field(default_factory=dict)
    run_digest: bytes = b""
    pinned: bool = False
    #: The round masked last, its own self-mask share, and whether it was unmasked.
    last_round: int = -1
    own_share: bytes = b""
    unmasked: bool = True
    #: The view (survivors, dropped) this node attested for ``attested_round``.
    attested_round: int = -1
    attested_view: bytes = b""
    #: Noisy round sums released, the rounds charged so far and when the training's release
    #: was first charged (its ``time`` in the ledger), the ledger's totals.
    answered: int = 0
    charged_rounds: int = 0
    charged_at: str = ""
    totals: dict[str, float] = field(default_factory=dict)

    def round_fields(self) -> dict[str, Any]:
        """The record fields a round, an attestation or an unmask changes."""
        return {
            "last-round": self.last_round,
            "own-share": self.own_share,
            "unmasked": self.unmasked,
            "attested-round": self.attested_round,
            "attested-view": self.attested_view,
            "answered": self.answered,
            "charged-rounds": self.charged_rounds,
            "charged-at": self.charged_at,
            "total-keys": list(self.totals),
            "total-values": [float(value) for value in self.totals.values()],
        }

    def to_record(self) -> ConfigRecord:
        peers = sorted(self.secrets)
        values: dict[str, Any] = {
            "run-salt": self.run_salt,
            "private-key": self.private_key,
            "members": list(self.members),
            "peer-ids": peers,
            "pair-secrets": [self.secrets[peer] for peer in peers],
            "run-digest": self.run_digest,
            "pinned": self.pinned,
            **self.round_fields(),
        }
        values |= {
            _PARAMETER_PREFIX + key: value for key, value in self.parameters.to_fields().items()
        }
        return ConfigRecord(values)

    @classmethod
    def from_record(cls, record: ConfigRecord) -> FPFLRunState:
        parameters = FPFLRunParameters.from_fields(
            {
                key[len(_PARAMETER_PREFIX) :]: value
                for key, value in record.items()
                if key.startswith(_PARAMETER_PREFIX)
            }
        )
        return cls(
            run_salt=bytes(record["run-salt"]),  # type: ignore[arg-type]
            parameters=parameters,
            private_key=bytes(record["private-key"]),  # type: ignore[arg-type]
            members=tuple(int(node) for node in record["members"]),  # type: ignore[union-attr]
            secrets=dict(
                zip(
                    (int(peer) for peer in record["peer-ids"]),  # type: ignore[union-attr]
                    (bytes(secret) for secret in record["pair-secrets"]),  # type: ignore[arg-type, union-attr]
                    strict=True,
                )
            ),
            run_digest=bytes(record["run-digest"]),  # type: ignore[arg-type]
            pinned=bool(record["pinned"]),
            last_round=int(record["last-round"]),  # type: ignore[arg-type]
            own_share=bytes(record["own-share"]),  # type: ignore[arg-type]
            unmasked=bool(record["unmasked"]),
            attested_round=int(record["attested-round"]),  # type: ignore[arg-type]
            attested_view=bytes(record["attested-view"]),  # type: ignore[arg-type]
            answered=int(record["answered"]),  # type: ignore[arg-type]
            charged_rounds=int(record["charged-rounds"]),  # type: ignore[arg-type]
            charged_at=str(record["charged-at"]),
            totals=dict(
                zip(
                    (str(key) for key in record["total-keys"]),  # type: ignore[union-attr]
                    (float(value) for value in record["total-values"]),  # type: ignore[union-attr]
                    strict=True,
                )
            ),
        )


def _training_index(ledger: UserLedger, release: SubsampledGaussianRelease) -> int:
    """The index of the training ``release`` (same job, label and time) charged before."""
    for index in range(len(ledger.releases) - 1, -1, -1):
        charged = ledger.releases[index]
        if (charged.kind, charged.job, charged.label, charged.time) == (
            release.kind,
            release.job,
            release.label,
            release.time,
        ):
            return index
    raise LedgerFileError(
        f"the ledger no longer holds this training ({release.label}, charged {release.time}); "
        "it was reset or replaced during the training"
    )


def _view_digest(survivors: Collection[int], dropped: Collection[int]) -> bytes:
    text = f"{sorted(survivors)}|{sorted(dropped)}".encode()
    return hashlib.sha256(text).digest()


class FPFLNode:
    """A node's side of FPFL: one method per message (``setup``, ``keys``, ``round``,
    ``confirm``, ``reveal``), each ``(msg, context) -> reply``, and the node's per-run state
    as an :class:`FPFLRunState` in ``context.state``. See the module docstring; build it
    through :func:`fpfl_handlers`, which checks the arguments and wraps every method so that
    only fixed sentences reach the server."""

    def __init__(
        self,
        make_model: Callable[[], torch.nn.Module],
        node_users: Callable[[Context], FPFLShard],
        settings: Mapping[str, FPFLNodeSettings],
        *,
        stream: Callable[[Context], int],
        policy: NodePrivacyPolicy | None,
        identity: Callable[[Context], NodeIdentity] | None,
        ledger_path: Callable[[Context], Path | None],
        sessions: Collection[str],
    ) -> None:
        self.make_model = make_model
        self.node_users = node_users
        self.settings_by_session = dict(settings)
        #: The first session's settings: what the policy checks (every session's epsilon,
        #: delta, masking, noise placement and seed are the run's; only the FairFed share of a
        #: pipeline's twin differs).
        self.settings = next(iter(self.settings_by_session.values()))
        self.stream = stream
        self.policy = policy
        self.identity = identity
        self.ledger_path = ledger_path
        self.sessions = tuple(sessions)

    # -- the node's own rules ---------------------------------------------------------------

    def limits(self, context: Context) -> NodePrivacyPolicy:
        """The policy, with the node's settings checked against it (before any work)."""
        current = self.policy if self.policy is not None else node_policy(context.node_config)
        settings = self.settings
        current.check_fpfl(
            epsilon=settings.epsilon,
            delta=settings.delta,
            masking=settings.masking,
            distributed_noise=settings.distributed_noise,
            seeded=settings.client_seed is not None,
        )
        return current

    def own_identity(self, context: Context) -> NodeIdentity:
        try:
            if self.identity is not None:
                return self.identity(context)
            return node_identity(context.node_config)
        except IdentityError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "fpfl: %s", error)
            raise NodeRefusal("fpfl: this node's identity key or roster cannot be read") from None

    def masking_identity(self, context: Context, limits: NodePrivacyPolicy) -> NodeIdentity:
        """This node's identity for a masked run, checked at setup before any data is read or
        any key is made: under ``require-roster`` a node without its roster or identity key
        refuses (a server could invent peers whose masks it knows), with one log line."""
        identity = self.own_identity(context)
        try:
            limits.check_roster(
                identity_key=identity.key is not None, roster=identity.roster is not None
            )
        except PolicyRefusal as refusal:
            log(logging.ERROR, "fpfl: %s (policy: %s)", refusal, limits.source)
            raise
        return identity

    def load_state(self, context: Context, session: str) -> FPFLRunState:
        record = context.state.config_records.get(session_state_key(FPFL_STATE_KEY, session))
        if record is None:
            raise NodeRefusal("fpfl: no setup for this run (the setup message was not received)")
        return FPFLRunState.from_record(record)

    def save_state(self, context: Context, session: str, state: FPFLRunState) -> None:
        context.state.config_records[session_state_key(FPFL_STATE_KEY, session)] = state.to_record()

    def save_round(self, context: Context, session: str, state: FPFLRunState) -> None:
        """Write the fields a round changes into the stored record (the setup's and the
        table's fields stay as they are: a round costs no full rewrite)."""
        record = context.state.config_records[session_state_key(FPFL_STATE_KEY, session)]
        for key, value in state.round_fields().items():
            if record.get(key) != value:
                record[key] = value

    def pinned_state(self, context: Context, session: str) -> FPFLRunState:
        state = self.load_state(context, session)
        if not state.pinned:
            raise NodeRefusal(
                "fpfl: no pinned member table for this run (the keys message was not received)"
            )
        return state

    def check_parameters(
        self, parameters: FPFLRunParameters, limits: NodePrivacyPolicy, session: str
    ) -> None:
        """Refuse run parameters that are not this node's settings or its policy's (fixed
        sentences naming the parameter or the policy key), before anything is computed."""
        if parameters.session != session:
            raise NodeRefusal("fpfl: the run parameters name another session")
        mismatch = self.settings_by_session[session].mismatch(parameters)
        if mismatch is not None:
            raise NodeRefusal(f"fpfl: the run's {mismatch} is not this node's setting; refusing")
        limits.check_population(parameters.population_size)
        limits.check_sizes(num_groups=parameters.num_groups, rounds=parameters.rounds)
        limits.check_dropout_tolerance(parameters.dropout_tolerance)
        limits.check_node_release(parameters.fairfed)
        if parameters.epsilon is None:
            return
        limits.check_fpfl_noise(parameters.noise_multiplier, parameters.dropout_tolerance)
        assert parameters.delta is not None  # FPFLRunParameters checks it with epsilon
        if not parameters.delta <= limits.fpfl_max_delta:
            raise PolicyRefusal("the training's delta is above fpfl-max-delta")
        from ..mechanisms.privacy.opacus_accounting import privacy_spent  # Opacus: once per run

        achieved = privacy_spent(
            noise_multiplier=parameters.noise_multiplier,
            sample_rate=parameters.sample_rate,
            steps=parameters.rounds,
            delta=parameters.delta,
            accountant=parameters.accountant,  # type: ignore[arg-type]
        ).epsilon
        if not achieved <= parameters.epsilon * (1.0 + _EPSILON_SLACK):
            raise NodeRefusal(
                "fpfl: the run's noise multiplier is too small for this node's epsilon; refusing"
            )

    def noise_share_std(
        self, parameters: FPFLRunParameters, num_members: int, limits: NodePrivacyPolicy
    ) -> float:
        """This node's noise-share std for the pinned run (0 without distributed noise)."""
        if not parameters.noisy_shares:
            return 0.0
        try:
            return self.settings_by_session.get(parameters.session, self.settings).noise_share_std(
                parameters.population_size,
                num_members,
                colluders=limits.tolerated_colluders,
                sigma=parameters.sum_noise_multiplier,
            )
        except ValueError:
            raise PolicyRefusal(
                "the run's guaranteed survivors do not outnumber tolerated-colluders"
            ) from None

    def reveal_minimum(
        self, parameters: FPFLRunParameters, num_members: int, limits: NodePrivacyPolicy
    ) -> int:
        """``r``: the fewest survivors this node reveals anything for (policy
        ``min-survivors`` and ``n_min`` of the run, with or without noise)."""
        return reveal_minimum(
            limits.min_survivors, minimum_survivors(num_members, parameters.dropout_tolerance)
        )

    @staticmethod
    def codec(parameters: FPFLRunParameters, num_members: int) -> FixedPointCodec:
        """The run's fixed-point codec, derived by the node from the pinned parameters."""
        return contribution_codec(
            per_user_bound=parameters.clipping_bound,
            population_size=parameters.population_size,
            noise_std=(parameters.clipping_bound or 0.0) * parameters.sum_noise_multiplier
            if parameters.noisy_shares
            else 0.0,
            num_nodes=num_members,
        )

    # -- setup --------------------------------------------------------------------------------

    def setup(self, msg: Message, context: Context) -> Message:
        """Check the proposed run parameters against the node's settings and policy (and, for
        a masked run, ``require-roster``: :meth:`masking_identity`); make this run's masking
        key pair (kept in the node state) and reply with the parameters' digest and the public
        key, signed with the node's identity key when it has one."""
        limits = self.limits(context)
        session = session_label(msg, self.sessions)
        request = FPFLSetupRequest.from_fields(msg.content.config_records.get(FPFL_KEY, {}))
        if session_state_key(FPFL_STATE_KEY, session) in context.state.config_records:
            raise NodeRefusal("fpfl: this run's setup was made already; refusing a second setup")
        parameters = request.parameters
        self.check_parameters(parameters, limits, session)
        identity = self.masking_identity(context, limits) if parameters.masking else None
        shard = self.node_users(context)
        if parameters.population_size < shard.num_users:
            raise NodeRefusal("fpfl: the population size is below this node's own users")
        if parameters.num_groups != shard.num_groups:
            raise NodeRefusal("fpfl: the run's number of groups is not this node's")
        digest = parameters.digest()
        reply = FPFLSetupReply(parameters_digest=digest)
        state = FPFLRunState(run_salt=request.run_salt, parameters=parameters)
        if identity is not None:
            keys = MaskingKeyPair.generate()
            state.private_key = keys.private_bytes()
            reply = replace(reply, public_key=keys.public_bytes())
            key = identity.key
            if key is not None:
                transcript = masking_key_transcript(
                    request.run_salt, int(context.node_id), keys.public_bytes(), digest
                )
                reply = replace(
                    reply, identity_key=key.public_bytes(), signature=key.sign(transcript)
                )
        self.save_state(context, session, state)
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord(reply.to_fields())}), reply_to=msg
        )

    def keys(self, msg: Message, context: Context) -> Message:
        """Check the run's member table (and keys) and pin it with the run digest: its pair
        secrets are the only ones this node masks with for the rest of the run."""
        limits = self.limits(context)
        session = session_label(msg, self.sessions)
        table = FPFLKeyTable.from_fields(msg.content.config_records.get(FPFL_KEY, {}))
        state = self.load_state(context, session)
        if state.run_salt != table.run_salt:
            raise NodeRefusal("fpfl: the key table is for another run")
        if state.pinned:
            raise NodeRefusal("fpfl: the key table is pinned for this run; refusing a change")
        parameters = state.parameters
        if table.parameters_digest != parameters.digest():
            raise NodeRefusal("fpfl: the key table is for other run parameters; refusing")
        own_id = int(context.node_id)
        members = table.members
        if own_id not in members:
            raise NodeRefusal("fpfl: the member table does not hold this node")
        limits.check_nodes(len(members))
        share_std = self.noise_share_std(parameters, len(members), limits)
        needed = self.reveal_minimum(parameters, len(members), limits)
        try:
            share_threshold(
                len(members),
                min_survivors=needed,
                colluders=limits.tolerated_colluders,
            )
        except ValueError:
            raise PolicyRefusal(
                "the run's members are too few for min-survivors, n_min and tolerated-colluders"
            ) from None
        run_digest = table.run_digest()
        secrets: dict[int, bytes] = {}
        if parameters.masking:
            secrets = self._pair_secrets(context, state, table, limits, run_digest)
            codec = self.codec(parameters, len(members))
            if (table.codec_clip_range, table.codec_scale) != (codec.clip_range, codec.scale):
                raise NodeRefusal(
                    "fpfl: the server's fixed-point codec is not the one this node derives "
                    "from the run parameters; refusing"
                )
            if share_std > 0 and codec.step > MAX_STEP_TO_SHARE_STD * share_std:
                raise NodeRefusal("fpfl: the quantisation step is not far below the noise share")
        elif table.public_keys:
            raise NodeRefusal("fpfl: a run without masking has no masking keys; refusing")
        state.members = members
        state.secrets = secrets
        state.run_digest = run_digest
        state.pinned = True
        self.save_state(context, session, state)
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord(FPFLKeysReply(run_digest).to_fields())}),
            reply_to=msg,
        )

    def _pair_secrets(
        self,
        context: Context,
        state: FPFLRunState,
        table: FPFLKeyTable,
        limits: NodePrivacyPolicy,
        run_digest: bytes,
    ) -> dict[int, bytes]:
        """The pair secrets of a masking key table, after its checks (own key present; with a
        roster, every key signed by a distinct member over the run's parameters)."""
        own_id = int(context.node_id)
        if len(table.public_keys) != len(table.members):
            raise NodeRefusal("fpfl: the key table lacks a masking key for some member")
        own = MaskingKeyPair.from_private_bytes(state.private_key)
        keys = dict(zip(table.members, table.public_keys, strict=True))
        if keys.get(own_id) != own.public_bytes():
            raise NodeRefusal("fpfl: the key table does not hold this node's own masking key")
        node_identity_ = self.own_identity(context)
        if node_identity_.roster is not None or limits.require_roster:
            try:
                _, roster = node_identity_.require("FPFL masking with a roster")
            except IdentityError as error:
                log(logging.ERROR, "fpfl: %s", error)
                raise NodeRefusal(
                    "fpfl: this node needs its identity-key and roster (node config) to check "
                    "the key table"
                ) from None
            if len(table.identity_keys) != len(table.members):
                raise NodeRefusal("fpfl: the key table lacks the members' signatures")
            try:
                check_signed_key_table(
                    table.run_salt,
                    keys,
                    dict(zip(table.members, table.identity_keys, strict=True)),
                    dict(zip(table.members, table.signatures, strict=True)),
                    roster,
                    table.parameters_digest,
                )
            except ValueError as error:
                raise NodeRefusal(f"fpfl: {error}") from None
        try:
            return pair_secrets(own_id, own, keys, table.run_salt, run_digest=run_digest)
        except ValueError:
            raise NodeRefusal("fpfl: the key table holds a repeated or unusable key") from None

    # -- a round ------------------------------------------------------------------------------

    def charge_training(
        self,
        context: Context,
        limits: NodePrivacyPolicy,
        shard: FPFLShard,
        state: FPFLRunState,
        workload: CohortWorkload,
    ) -> None:
        """Charge the pinned training's next block of rounds to every user of the node (the
        first block after checking that every user can afford all ``T`` rounds), saved before
        any release; ``state`` gets the rounds charged and the ledger's totals for the
        replies. Refuses (fixed sentences) when a user cannot afford it or the ledger cannot
        be used."""
        path = self.ledger_path(context)
        if path is None and not limits.allow_ephemeral_ledger:
            raise PolicyRefusal(
                "a persistent privacy ledger is required (ledger-dir, or allow-ephemeral-ledger)"
            )
        parameters = state.parameters
        assert parameters.delta is not None
        session = parameters.session
        steps = min(parameters.rounds, max(1, 2 * state.charged_rounds))

        def training(rounds: int, time: str | None = None) -> SubsampledGaussianRelease:
            extra = {} if time is None else {"time": time}
            return SubsampledGaussianRelease(
                noise_multiplier=parameters.noise_multiplier,
                sample_rate=parameters.sample_rate,
                steps=rounds,
                delta=parameters.delta,  # type: ignore[arg-type]
                timing_tail_probability=min(0.5, rounds * workload.tail_probability),
                job="fpfl",
                label=f"FPFL training{f' {session!r}' if session else ''}, {parameters.rounds} "
                f"rounds, constraint {parameters.constraint}",
                **extra,
            )

        try:
            ledger = open_node_ledger(
                context, path, limits, shard.num_users, user_ids=shard.user_ids
            )
            # every user (by id): the Poisson sampling is in the release
            if state.charged_rounds == 0:
                ledger.check(training(parameters.rounds), user_ids=shard.user_ids)
                release = training(steps)
                ledger.charge(release, user_ids=shard.user_ids)
                state.charged_at = release.time
            else:
                release = training(steps, state.charged_at)
                index = _training_index(ledger, release)
                tail = max(ledger.releases[index].failure_probability, release.failure_probability)
                ledger.extend(index, replace(release, timing_tail_probability=tail))
        except LedgerFileError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "fpfl: %s", error)
            raise NodeRefusal(FPFL_LEDGER_UNUSABLE) from None
        except PrivacyBudgetExceeded as error:
            log(logging.WARNING, "fpfl: %s", error)
            raise NodeRefusal(FPFL_LEDGER_REFUSAL) from None
        save_node_ledger(context, path, ledger)
        state.charged_rounds = steps
        if shard.num_users >= limits.min_users_for_counts:  # a device sends no totals in clear
            state.totals = ledger_totals(ledger, path)

    def round(self, msg: Message, context: Context) -> Message:
        """Sample this node's cohort with the pinned ``q``, sum the users' clipped vectors,
        add the noise share and reply with the sum double-masked and the sealed shares of its
        self-mask (or in the clear without masking)."""
        limits = self.limits(context)
        session = session_label(msg, self.sessions)
        request = FPFLRoundRequest.from_fields(
            msg.content.config_records.get("config", {}),
            _arrays(msg.content.array_records.get(FPFL_KEY)),
        )
        state = self.pinned_state(context, session)
        parameters = state.parameters
        if request.run_digest != state.run_digest:
            raise NodeRefusal("fpfl: the round is for another run's parameters; refusing")
        if parameters.masking and request.round <= state.last_round:
            raise NodeRefusal("fpfl: this round number was masked already; refusing a replay")
        if parameters.epsilon is not None and state.answered >= parameters.rounds:
            raise PolicyRefusal("the training's rounds are all spent")
        if request.node_scale != 1.0 and not parameters.fairfed:
            raise NodeRefusal("fpfl: node-scale is for FairFed runs only; refusing")
        limits.check_weights(float(np.max(np.abs(request.weights), initial=0.0)))
        members = state.members
        share_std = self.noise_share_std(parameters, len(members), limits)
        from .fpfl_task import (  # torch: the round's, not every message's
            num_parameters,
            set_flat_parameters,
            statistics_layout,
        )

        model = self.make_model()
        if request.weights.shape != (num_parameters(model),):
            raise NodeRefusal("fpfl: the round's weights do not fit this node's model")
        if statistics_layout(model, parameters.num_groups).size != parameters.vector_size:
            raise NodeRefusal("fpfl: the run's statistic vector size is not this node's model's")
        # Every refusal is decided: from here on the round is released, whatever the data.
        shard = self.node_users(context)
        workload = None  # only a noisy training's cohort is secret
        if parameters.epsilon is not None:
            workload = node_workload(
                shard,
                parameters.sample_rate,
                parameters.rounds,
                user_epsilon_budget=limits.user_epsilon_budget,
                user_delta=limits.user_delta,
            )
            if state.answered >= state.charged_rounds:  # the next block, before its release
                self.charge_training(context, limits, shard, state, workload)
            state.answered += 1  # counted (in the node state) before anything is released
        own_id = int(context.node_id)
        self_seed, threshold, shares = b"", 0, {}
        if parameters.masking:
            threshold = share_threshold(
                len(members),
                min_survivors=self.reveal_minimum(parameters, len(members), limits),
                colluders=limits.tolerated_colluders,
            )
            self_seed = new_self_seed()
            shares = share_self_seed(self_seed, members, threshold)
            state.last_round, state.unmasked = request.round, False
            state.own_share = shares[own_id]
        self.save_round(context, session, state)  # one write, before anything is computed
        set_flat_parameters(model, request.weights)
        total, release = self._contribution(
            model,
            shard,
            parameters,
            share_std,
            context,
            request.round,
            request.node_scale,
            workload,
        )
        extra = {METRICS_KEY: MetricRecord({**state.totals})} if state.totals else {}
        released = {} if release is None else {RELEASE_ARRAY: Array(release)}
        if not parameters.masking:
            reply = FPFLRoundReply(total)
            return Message(
                content=RecordDict(
                    {FPFL_KEY: ArrayRecord({reply.array_name(): Array(total), **released}), **extra}
                ),
                reply_to=msg,
            )
        recipients = tuple(peer for peer in members if peer != own_id)
        sealed = tuple(
            seal_share(state.secrets[peer], request.round, own_id, peer, shares[peer])
            for peer in recipients
        )
        codec = self.codec(parameters, len(members))
        encoded = codec.encode(np.clip(total, -codec.clip_range, codec.clip_range))
        masked = mask_vector(
            encoded, own_id, state.secrets, request.round, cohort=members, self_seed=self_seed
        )
        reply = FPFLRoundReply(masked, recipients, sealed, threshold)
        return Message(
            content=RecordDict(
                {
                    FPFL_KEY: ArrayRecord({reply.array_name(): Array(masked), **released}),
                    "shares": ConfigRecord(reply.to_fields()),
                    **extra,
                }
            ),
            reply_to=msg,
        )

    def _contribution(
        self,
        model: torch.nn.Module,
        shard: FPFLShard,
        parameters: FPFLRunParameters,
        share_std: float,
        context: Context,
        round_number: int,
        scale: float = 1.0,
        workload: CohortWorkload | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The round's noised sum, and in a FairFed run the node's own noised release (None
        otherwise). A failure while computing them (after the round was counted) becomes
        zeros plus the noise: the reply never depends on the data."""
        rng = round_rng(self.settings.client_seed, self.stream(context), round_number)
        release_std = (parameters.clipping_bound or 0.0) * parameters.release_noise_multiplier
        try:
            both = round_contribution(
                model,
                shard,
                # a str on the wire, equal to this node's checked setting (mismatch at setup)
                constraint=parameters.constraint,  # type: ignore[arg-type]
                clipping_bound=parameters.clipping_bound,
                sample_rate=parameters.sample_rate,
                noise_share_std=share_std,
                rng=rng,
                scale=scale,
                release_std=release_std if parameters.fairfed else None,
                workload=workload,
            )
            return both.total, both.release
        except Exception as error:  # noqa: BLE001 - a data-dependent failure is no refusal
            log(
                logging.ERROR,
                "fpfl: round %d: the statistics failed (%r); sending the noise share alone",
                round_number,
                error,
            )
            return (
                _noise(rng, parameters.vector_size, share_std),
                _noise(rng, release_size(parameters.num_groups), release_std)
                if parameters.fairfed
                else None,
            )

    # -- unmask -------------------------------------------------------------------------------

    def _check_view(
        self,
        state: FPFLRunState,
        own_id: int,
        survivors: Collection[int],
        dropped: Collection[int],
        limits: NodePrivacyPolicy,
    ) -> int:
        """Refuse a view that does not split the round's members with this node a survivor, or
        that has fewer survivors than this node reveals for; the reveal minimum ``r``."""
        members = set(state.members)
        if (
            set(survivors) & set(dropped)
            or set(survivors) | set(dropped) != members
            or own_id not in survivors
        ):
            raise NodeRefusal(
                "fpfl: survivors and dropped nodes must split the round's members, with this "
                "node a survivor; refusing to unmask"
            )
        parameters = state.parameters
        noise_survivors = minimum_survivors(len(members), parameters.dropout_tolerance)
        if parameters.epsilon is not None and parameters.distributed_noise:
            if len(survivors) < noise_survivors:
                # The true reason (not the masking rule below): too few noise shares.
                raise NodeRefusal(
                    "fpfl: refusing to unmask: fewer survivors than n_min, whose noise shares "
                    "add up to the run's noise (the sum would carry less noise than accounted)"
                )
        needed = self.reveal_minimum(parameters, len(members), limits)
        if len(survivors) < needed:
            raise NodeRefusal("fpfl: refusing to unmask: fewer survivors than min-survivors")
        return needed

    def _unmasking_state(self, context: Context, session: str, round_number: int) -> FPFLRunState:
        state = self.pinned_state(context, session)
        if not state.parameters.masking:
            raise NodeRefusal("fpfl: a run without masking has nothing to unmask")
        if state.last_round != round_number or state.unmasked:
            raise NodeRefusal(
                "fpfl: unmasking only once, for the round this node masked last; refusing"
            )
        return state

    def confirm(self, msg: Message, context: Context) -> Message:
        """Attest the view (survivors, dropped) of a round with dropped nodes, to every other
        survivor: one view per round (Bonawitz et al. 2017, the consistency check)."""
        limits = self.limits(context)
        session = session_label(msg, self.sessions)
        request = FPFLConfirmRequest.from_fields(msg.content.config_records.get(FPFL_KEY, {}))
        state = self._unmasking_state(context, session, request.round)
        own_id = int(context.node_id)
        if not request.dropped:
            raise NodeRefusal("fpfl: a view without dropped nodes needs no attestation")
        self._check_view(state, own_id, request.survivors, request.dropped, limits)
        view = _view_digest(request.survivors, request.dropped)
        if state.attested_round == request.round and state.attested_view != view:
            raise NodeRefusal(
                "fpfl: this node attested another view of this round; refusing a second one"
            )
        state.attested_round, state.attested_view = request.round, view
        self.save_round(context, session, state)
        recipients = tuple(peer for peer in sorted(request.survivors) if peer != own_id)
        reply = FPFLConfirmReply(
            recipients,
            tuple(
                attest_view(
                    state.secrets[peer],
                    request.round,
                    own_id,
                    peer,
                    request.survivors,
                    request.dropped,
                )
                for peer in recipients
            ),
        )
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord(reply.to_fields())}), reply_to=msg
        )

    def reveal(self, msg: Message, context: Context) -> Message:
        """Unmask the round this node masked last, once: the shares of the survivors'
        self-masks and the pair seeds with the dropped nodes, only for a view with enough
        survivors and, when a node dropped, attested by enough members (refuse otherwise)."""
        limits = self.limits(context)
        session = session_label(msg, self.sessions)
        request = FPFLRevealRequest.from_fields(msg.content.config_records.get(FPFL_KEY, {}))
        state = self._unmasking_state(context, session, request.round)
        own_id = int(context.node_id)
        needed = self._check_view(state, own_id, request.survivors, request.dropped, limits)
        if sorted(request.share_senders) != sorted(set(request.survivors) - {own_id}):
            raise NodeRefusal("fpfl: the unmask request must carry one share from each survivor")
        if request.dropped:
            view = _view_digest(request.survivors, request.dropped)
            attested_here = state.attested_round == request.round
            if attested_here and state.attested_view != view:
                raise NodeRefusal(
                    "fpfl: this node attested another view of this round; refusing to unmask"
                )
            valid = check_attestations(
                own_id,
                state.secrets,
                request.round,
                request.survivors,
                request.dropped,
                dict(zip(request.attesters, request.attestations, strict=True)),
            ) + int(attested_here)
            required = attestation_threshold(len(state.members), needed, limits.tolerated_colluders)
            if valid < required:
                raise NodeRefusal(
                    "fpfl: refusing to unmask: too few members attested this view of the round"
                )
            state.attested_round, state.attested_view = request.round, view
        state.unmasked = True  # before anything is released: one answer per round
        self.save_round(context, session, state)
        try:
            shares = {
                sender: open_share(state.secrets[sender], request.round, sender, own_id, box)
                for sender, box in zip(request.share_senders, request.shares, strict=True)
            }
        except ValueError:
            raise NodeRefusal(
                "fpfl: a share does not open (altered or replayed); refusing"
            ) from None
        shares[own_id] = state.own_share
        seeds = reveal_round_seeds(
            own_id,
            state.secrets,
            request.round,
            request.dropped,
            request.survivors,
            min_survivors=needed,
        )
        owners = tuple(sorted(shares))
        reply = FPFLRevealReply(
            owners,
            tuple(shares[owner] for owner in owners),
            tuple(seeds),
            tuple(seeds.values()),
        )
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord(reply.to_fields())}), reply_to=msg
        )

    def handlers(self) -> dict[str, Handler]:
        """The bound methods by action (``app.query(action)``), each wrapped so that only
        fixed sentences reach the server."""
        methods = {
            "fpfl_setup": self.setup,
            "fpfl_keys": self.keys,
            "fpfl_round": self.round,
            "fpfl_confirm": self.confirm,
            "fpfl_reveal": self.reveal,
        }
        return {action: fixed_error_texts(method) for action, method in methods.items()}


def _noise(rng: np.random.Generator, size: int, std: float) -> np.ndarray:
    """``N(0, std^2 I)`` of length ``size`` (zeros when ``std`` is 0)."""
    return rng.normal(0.0, std, size=size) if std else np.zeros(size)


def _arrays(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    """The numpy arrays of a message's ArrayRecord (empty when absent or unreadable)."""
    if record is None:
        return {}
    arrays = {}
    for name in record:
        try:
            arrays[name] = record[name].numpy()
        except Exception:  # noqa: BLE001, S112 - an unreadable array is a missing one
            continue
    return arrays


def fpfl_handlers(
    make_model: Callable[[], torch.nn.Module],
    node_users: Callable[[Context], FPFLShard],
    settings: FPFLNodeSettings | Mapping[str, FPFLNodeSettings],
    *,
    stream: Callable[[Context], int] = lambda context: int(context.node_id),
    policy: NodePrivacyPolicy | None = None,
    identity: Callable[[Context], NodeIdentity] | None = None,
    ledger_path: Callable[[Context], Path | None] = default_ledger_path,
    sessions: Collection[str] = ("",),
) -> dict[str, Handler]:
    """The FPFL handlers (``fpfl_setup``, ``fpfl_keys``, ``fpfl_round``, ``fpfl_confirm``,
    ``fpfl_reveal``), keyed by the action to register with ``app.query``: the bound methods
    of an :class:`FPFLNode`.

    Parameters
    ----------
    make_model : callable
        An instance of the model the server trains: each round loads its weights into all
        of the model's parameters (``named_parameters`` order), so a model without buffers
        may be built once and returned every time (the project's app does).
    node_users : callable
        ``node_users(context) -> FPFLShard``: this node's users and their samples.
    settings : FPFLNodeSettings or mapping of session to FPFLNodeSettings
        The node's own privacy and training parameters; the run's must equal them. A mapping
        gives each session its own (the pipeline's FairFed training and its PFL twin differ
        in the FairFed release share); every session of ``sessions`` needs one.
    stream : callable, optional
        The node's stream id for a seeded run (``settings.client_seed``); default its node id.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy; default: read for each message from the node's own config
        or environment (:func:`~fedparity.clients.policy.node_policy`).
    identity : callable, optional
        ``identity(context) -> NodeIdentity``: the node's identity key and roster; default
        :func:`~fedparity.clients.identity.node_identity` of its node config.
    ledger_path : callable, optional
        ``ledger_path(context)``: the node's per-user privacy ledger file (None: the run
        state, which needs the policy's ``allow-ephemeral-ledger``); default
        :func:`~fedparity.clients.ledger.default_ledger_path`. Give the node's LDP audit
        handler the same, so that both charge one ledger.
    sessions : collection of str, optional
        The trainings this node's run defines (``("",)``: one). A run that trains more than
        once (the pipeline: ``("fpfl", "pfl")``) labels each; every session has its own
        parameters, keys, rounds and replay state, and is charged to the users' ledger.
    """
    by_session = (
        dict(settings)
        if isinstance(settings, Mapping)
        else {session: settings for session in sessions}
    )
    for session in sessions:
        if not isinstance(by_session.get(session), FPFLNodeSettings):
            raise TypeError(
                f"settings must be FPFLNodeSettings (or one per session); session {session!r} "
                f"has {type(by_session.get(session)).__name__}"
            )
    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")
    node = FPFLNode(
        make_model,
        node_users,
        by_session,
        stream=stream,
        policy=policy,
        identity=identity,
        ledger_path=ledger_path,
        sessions=sessions,
    )
    return node.handlers()
