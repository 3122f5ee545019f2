"""FPFL training on a node, as handlers for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.fpfl.FPFLProtocol` runs a setup (``fpfl_setup``:
each node makes its masking key pair; ``fpfl_keys``: the key table, which the node checks and
pins for the run) and then, per round, one message with the model weights (``fpfl_round``) and
one unmask request (``fpfl_reveal``). On a round each node samples its cohort (Poisson), sums
the users' clipped statistic vectors for *your* torch model, adds its share of the Gaussian
noise and replies with the sum double-masked, with Shamir shares of its self-mask sealed for
its peers (Rodriguez-Galvez, Granqvist, van Dalen and Seigel, "Enforcing fairness in private
federated learning via the modified method of differential multipliers", 2021, Algorithm 1;
Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS
2017). Register them with::

    from fedparity.clients import FPFLNodeSettings, fpfl_handlers

    settings = FPFLNodeSettings(constraint="fnr", cohort_size=1000, rounds=250,
                                clipping_bound=2.0, epsilon=2.0)
    for action, handler in fpfl_handlers(make_model, my_users, settings).items():
        app.query(action)(handler)

``make_model()`` returns an instance of your model (one built once will do: every round loads
all of its parameters), ending in ``nn.Sigmoid`` (binary) or ``nn.Softmax(dim=-1)``
(multi-class): the fairness surrogates need probabilities; batch norm is refused.
``my_users(context)`` returns the node's users as an
:class:`~fedparity.clients.fpfl_data.FPFLShard`. The node recomputes ``sigma`` from
``settings`` and never takes a noise level from the server, and it holds to its own
:class:`~fedparity.clients.policy.NodePrivacyPolicy` (node config or a policy file): settings
beyond the policy (epsilon, delta, no masking, central noise, a seed, no noise at all) are
refused before anything is computed; the population size ``K`` and the node count the server
sends are bounded by the policy; the noise share is sized for the policy's tolerated
colluders; masks are revealed only for at least the policy's ``min-survivors``; and a node
releases at most ``settings.rounds`` noisy sums in a run (``sigma`` is calibrated for them).

Privacy across runs: before the node's first noisy round of a run, the whole training
(``SubsampledGaussianRelease`` of the node's own ``sigma``, ``q = m / K`` and ``T`` rounds)
is checked against and charged to every user of the node in its per-user privacy ledger
(:mod:`fedparity.clients.ledger`, the same ledger its LDP audits charge), and saved before
anything is released. The node refuses the run when any of its users cannot afford it. It is
charged up front: a run that stops early, and a resumed run (charged again for its ``T``),
over-count, the safe side.

Against a server that reads late replies, replays and edits messages (each rule is a test in
``tests/test_secure_sum_attacks.py``):

* the key table is pinned once per run (``fpfl_keys``); a second table, or a round member
  whose key was not pinned, is refused; with a roster (node config ``roster`` and
  ``identity-key``, or policy ``require-roster``) every key must be signed by a distinct
  roster member, so keys can be neither substituted nor invented;
* a round number is masked at most once, in increasing order; an unmask request is answered
  once, for the round masked last, and only for survivors and dropped nodes that are exactly
  that round's members;
* every vector carries a self-mask whose seed only ``t`` survivors' shares rebuild
  (:func:`~fedparity.mechanisms.secure_sum.share_threshold`): a node called "dropped" keeps
  its vector hidden even when its late reply arrives, since no honest node gives both its
  pair seed and a share of its self-mask;
* the quantisation is the node's own (:func:`~fedparity.mechanisms.secure_sum.contribution_codec`
  of values it checks), its step at most ``2^-10`` of the node's noise-share std;
* every refusal reaches the server as a fixed sentence
  (:func:`~fedparity.clients.messages.fixed_error_texts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log

from ..mechanisms.accounting import LedgerFileError, PrivacyBudgetExceeded
from ..mechanisms.identity import IdentityError
from ..mechanisms.privacy_ledger import SubsampledGaussianRelease
from ..mechanisms.protocol import FPFL_KEY, METRICS_KEY
from ..mechanisms.secure_sum import (
    MaskingKeyPair,
    check_signed_key_table,
    contribution_codec,
    mask_vector,
    masking_key_transcript,
    minimum_survivors,
    new_self_seed,
    open_share,
    pair_secrets,
    reveal_round_seeds,
    seal_share,
    share_self_seed,
    share_threshold,
)
from .fpfl_data import FPFLShard
from .fpfl_node import FPFLNodeSettings, cohort_contribution, round_rng
from .identity import NodeIdentity, node_identity
from .ledger import default_ledger_path, ledger_totals, open_node_ledger, save_node_ledger
from .messages import (
    MessageError,
    NodeRefusal,
    bytes_field,
    bytes_list_field,
    fixed_error_texts,
    int_field,
    int_list_field,
    session_label,
    session_state_key,
)
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import torch

__all__ = [
    "FPFL_LEDGER_REFUSAL",
    "FPFL_LEDGER_UNUSABLE",
    "FPFL_STATE_KEY",
    "MAX_STEP_TO_SHARE_STD",
    "ROUNDS_STATE_KEY",
    "SIGMA_STATE_KEY",
    "fpfl_handlers",
]

#: Node run-state record of the run's masking keys, pinned key table and last masked round.
FPFL_STATE_KEY = "fpfl-masking"
#: Node run-state record of how many noisy round contributions the node has released.
ROUNDS_STATE_KEY = "fpfl-rounds"
#: Node run-state record of the noise multiplier the node computed, and of what from.
SIGMA_STATE_KEY = "fpfl-sigma"
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
Handler = Callable[[Message, Context], Message]


def _state(context: Context, session: str) -> ConfigRecord:
    state = context.state.config_records.get(session_state_key(FPFL_STATE_KEY, session))
    if state is None:
        raise NodeRefusal("fpfl: no masking key for this run (the setup message was not received)")
    return state


def _pinned_secrets(context: Context, session: str) -> dict[int, bytes]:
    """The pair secrets of the key table pinned at setup (``fpfl_keys``)."""
    state = _state(context, session)
    if not state.get("pinned", False):
        raise NodeRefusal(
            "fpfl: no pinned key table for this run (the keys message was not received)"
        )
    peers = [int(peer) for peer in state["peer-ids"]]  # type: ignore[union-attr]
    secrets = [bytes(secret) for secret in state["pair-secrets"]]  # type: ignore[union-attr]
    return dict(zip(peers, secrets, strict=True))


def _noise_multiplier(
    context: Context, session: str, settings: FPFLNodeSettings, population_size: int
) -> float:
    """``settings.noise_multiplier(K)``, kept in the node's run state with what it was
    computed from: a deployed SuperNode starts a process for every message, and calibrating
    sigma again (Opacus's accountant) cost every round's process about 1.8 s here. Any change
    of the inputs (K comes with each round) computes it again."""
    key = session_state_key(SIGMA_STATE_KEY, session)
    inputs = repr(
        (
            settings.epsilon,
            settings.delta,
            settings.cohort_size,
            settings.rounds,
            settings.accountant,
            population_size,
        )
    )
    record = context.state.config_records.get(key)
    if record is not None and record.get("inputs") == inputs:
        return float(record["sigma"])  # type: ignore[arg-type]
    sigma = settings.noise_multiplier(population_size)
    context.state.config_records[key] = ConfigRecord({"inputs": inputs, "sigma": sigma})
    return sigma


def fpfl_handlers(
    make_model: Callable[[], torch.nn.Module],
    node_users: Callable[[Context], FPFLShard],
    settings: FPFLNodeSettings,
    *,
    stream: Callable[[Context], int] = lambda context: int(context.node_id),
    policy: NodePrivacyPolicy | None = None,
    identity: Callable[[Context], NodeIdentity] | None = None,
    ledger_path: Callable[[Context], Path | None] = default_ledger_path,
    sessions: Collection[str] = ("",),
) -> dict[str, Handler]:
    """The four FPFL handlers (``fpfl_setup``, ``fpfl_keys``, ``fpfl_round``,
    ``fpfl_reveal``), keyed by the action to register with ``app.query``.

    Parameters
    ----------
    make_model : callable
        An instance of the model the server trains: each round loads its weights into all
        of the model's parameters (``named_parameters`` order), so a model without buffers
        may be built once and returned every time (the project's app does).
    node_users : callable
        ``node_users(context) -> FPFLShard``: this node's users and their samples.
    settings : FPFLNodeSettings
        The node's own privacy and training parameters.
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
        once (the pipeline: ``("fpfl", "pfl")``) labels each; every session has its own keys,
        rounds and replay state, and is charged to the users' ledger in full.
    """
    if not isinstance(settings, FPFLNodeSettings):
        raise TypeError(f"settings must be FPFLNodeSettings, got {type(settings).__name__}")
    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")

    def limits(context: Context) -> NodePrivacyPolicy:
        """The policy, with the run's settings checked against it (before any work)."""
        current = policy if policy is not None else node_policy(context.node_config)
        current.check_fpfl(
            epsilon=settings.epsilon,
            delta=settings.delta,
            masking=settings.masking,
            distributed_noise=settings.distributed_noise,
            seeded=settings.client_seed is not None,
        )
        return current

    def own_identity(context: Context) -> NodeIdentity:
        try:
            return identity(context) if identity is not None else node_identity(context.node_config)
        except IdentityError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "fpfl: %s", error)
            raise NodeRefusal("fpfl: this node's identity key or roster cannot be read") from None

    def setup(msg: Message, context: Context) -> Message:
        """Generate this run's masking key pair (kept in the node state); reply with the
        public key only, signed with the node's identity key when it has one."""
        limits(context)
        session = session_label(msg, sessions)
        salt = bytes_field(msg.content.config_records.get(FPFL_KEY, {}), "run-salt")
        if len(salt) < 16:
            raise MessageError("message field 'run-salt' must hold at least 16 bytes")
        state_key = session_state_key(FPFL_STATE_KEY, session)
        if state_key in context.state.config_records:
            raise NodeRefusal(
                "fpfl: this run's masking key was made already; refusing a second setup"
            )
        keys = MaskingKeyPair.generate()
        context.state.config_records[state_key] = ConfigRecord(
            {"run-salt": salt, "private-key": keys.private_bytes()}
        )
        reply = {"public-key": keys.public_bytes()}
        key = own_identity(context).key
        if key is not None:
            transcript = masking_key_transcript(salt, int(context.node_id), keys.public_bytes())
            reply |= {"identity-key": key.public_bytes(), "signature": key.sign(transcript)}
        return Message(content=RecordDict({FPFL_KEY: ConfigRecord(reply)}), reply_to=msg)

    def keys(msg: Message, context: Context) -> Message:
        """Check the run's key table and pin it: its pair secrets are the only ones this node
        masks with for the rest of the run."""
        node_limits = limits(context)
        record = msg.content.config_records.get(FPFL_KEY, {})
        state = _state(context, session_label(msg, sessions))
        salt = bytes_field(record, "run-salt")
        if bytes(state["run-salt"]) != salt:  # type: ignore[arg-type]
            raise NodeRefusal("fpfl: the key table is for another run")
        if state.get("pinned", False):
            raise NodeRefusal("fpfl: the key table is pinned for this run; refusing a change")
        ids = int_list_field(record, "peer-ids")
        public_keys = bytes_list_field(record, "peer-keys")
        if len(ids) != len(public_keys) or len(set(ids)) != len(ids):
            raise MessageError("message fields 'peer-ids' and 'peer-keys' must list distinct ids")
        own_id = int(context.node_id)
        own = MaskingKeyPair.from_private_bytes(bytes(state["private-key"]))  # type: ignore[arg-type]
        table = dict(zip(ids, public_keys, strict=True))
        if table.get(own_id) != own.public_bytes():
            raise NodeRefusal("fpfl: the key table does not hold this node's own masking key")
        node_limits.check_nodes(len(table))
        node_identity_ = own_identity(context)
        if node_identity_.roster is not None or node_limits.require_roster:
            try:
                _, roster = node_identity_.require("FPFL masking with a roster")
            except IdentityError as error:
                log(logging.ERROR, "fpfl: %s", error)
                raise NodeRefusal(
                    "fpfl: this node needs its identity-key and roster (node config) to check "
                    "the key table"
                ) from None
            identities = bytes_list_field(record, "identity-keys")
            signatures = bytes_list_field(record, "signatures")
            if len(identities) != len(ids) or len(signatures) != len(ids):
                raise MessageError(
                    "message fields 'identity-keys' and 'signatures' must match 'peer-ids'"
                )
            try:
                check_signed_key_table(
                    salt,
                    table,
                    dict(zip(ids, identities, strict=True)),
                    dict(zip(ids, signatures, strict=True)),
                    roster,
                )
            except ValueError as error:
                raise NodeRefusal(f"fpfl: {error}") from None
        try:
            secrets = pair_secrets(own_id, own, table, salt)
        except ValueError:
            raise NodeRefusal("fpfl: the key table holds a repeated or unusable key") from None
        peers = sorted(secrets)
        state["peer-ids"] = peers
        state["pair-secrets"] = [secrets[peer] for peer in peers]
        state["pinned"] = True
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord({"pinned": len(peers) + 1})}), reply_to=msg
        )

    def charge_training(
        context: Context,
        node_limits: NodePrivacyPolicy,
        shard: FPFLShard,
        sigma: float,
        sample_rate: float,
        population_size: int,
        session: str,
    ) -> dict[str, float]:
        """Check and charge the whole training to every user of the node, saved before any
        release; the ledger's totals for the replies. Refuses (fixed sentences) when a user
        cannot afford it or the ledger cannot be used."""
        path = ledger_path(context)
        if path is None and not node_limits.allow_ephemeral_ledger:
            raise PolicyRefusal(
                "a persistent privacy ledger is required (ledger-dir, or allow-ephemeral-ledger)"
            )
        release = SubsampledGaussianRelease(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            steps=settings.rounds,
            delta=settings.delta if settings.delta is not None else 1.0 / population_size,
            job="fpfl",
            label=f"FPFL training{f' {session!r}' if session else ''}, {settings.rounds} rounds, "
            f"constraint {settings.constraint}",
        )
        try:
            ledger = open_node_ledger(context, path, node_limits, shard.num_users)
            ledger.charge(release)  # every user: the Poisson sampling is in the release
        except LedgerFileError as error:  # names the node's files: it stays in the node's log
            log(logging.ERROR, "fpfl: %s", error)
            raise NodeRefusal(FPFL_LEDGER_UNUSABLE) from None
        except PrivacyBudgetExceeded as error:
            log(logging.WARNING, "fpfl: %s", error)
            raise NodeRefusal(FPFL_LEDGER_REFUSAL) from None
        save_node_ledger(context, path, ledger)
        if shard.num_users < node_limits.min_users_for_counts:
            return {}  # a small node (a device) sends no totals in clear
        return ledger_totals(ledger)

    def round_(msg: Message, context: Context) -> Message:
        """Sample this node's cohort, sum the users' clipped vectors, add the noise share and
        reply with the sum double-masked and the sealed shares of its self-mask (or in the
        clear without masking)."""
        node_limits = limits(context)
        session = session_label(msg, sessions)
        rounds_key = session_state_key(ROUNDS_STATE_KEY, session)
        settings_record = msg.content.config_records.get("config", {})
        weights = msg.content.array_records[FPFL_KEY]["weights"].numpy()
        if weights.ndim != 1 or weights.dtype.kind != "f" or not np.isfinite(weights).all():
            raise MessageError("message array 'weights' must be a 1-d array of finite floats")
        round_number = int_field(settings_record, "round", minimum=0)
        # K and the members come from the server: bounded and checked by the node.
        population_size = node_limits.bounded_population(
            int_field(settings_record, "population-size", minimum=1)
        )
        if settings.epsilon is not None and settings.delta is None:
            if not 1.0 / population_size <= node_limits.fpfl_max_delta:
                raise PolicyRefusal("the training's delta is above fpfl-max-delta")
        own_id = int(context.node_id)
        members = int_list_field(settings_record, "peer-ids")
        if len(set(members)) != len(members) or own_id not in members:
            raise NodeRefusal("fpfl: the round's members must be distinct and include this node")
        num_nodes = len(members)
        if settings.masking or settings.distributed_noise:
            node_limits.check_nodes(num_nodes)
        secrets: dict[int, bytes] = {}
        if settings.masking:
            secrets = _pinned_secrets(context, session)
            if not set(members) - {own_id} <= set(secrets):
                raise NodeRefusal("fpfl: the round lists a node whose key was not pinned at setup")
            state = _state(context, session)
            if round_number <= int(state.get("last-round", -1)):  # type: ignore[arg-type]
                raise NodeRefusal("fpfl: this round number was masked already; refusing a replay")
        shard = node_users(context)
        if population_size < shard.num_users:
            raise NodeRefusal("fpfl: the population size is below this node's own users")
        sigma = _noise_multiplier(context, session, settings, population_size)
        sample_rate = min(1.0, settings.cohort_size / population_size)
        try:
            share_std = settings.noise_share_std(
                population_size, num_nodes, colluders=node_limits.tolerated_colluders, sigma=sigma
            )
        except ValueError:
            raise PolicyRefusal(
                "the round's guaranteed survivors do not outnumber tolerated-colluders"
            ) from None
        if settings.epsilon is not None:
            # sigma is calibrated for T rounds: a server asking for more would spend more than
            # epsilon. Counted (in this run's node state) before anything is released.
            rounds_state = context.state.config_records.get(rounds_key, ConfigRecord())
            answered = int(rounds_state.get("answered", 0))  # type: ignore[arg-type]
            if answered >= settings.rounds:
                raise PolicyRefusal("the training's rounds are all spent")
            if answered == 0:  # the run's first noisy round: the whole training, up front
                totals = charge_training(
                    context, node_limits, shard, sigma, sample_rate, population_size, session
                )
                rounds_state = ConfigRecord(totals)  # type: ignore[arg-type]
            rounds_state["answered"] = answered + 1
            context.state.config_records[rounds_key] = rounds_state
        totals = {
            key: float(value)  # type: ignore[arg-type]
            for key, value in context.state.config_records.get(rounds_key, {}).items()
            if key != "answered"
        }
        extra = {METRICS_KEY: MetricRecord(totals)} if totals else {}
        codec = None
        if settings.masking:
            codec = contribution_codec(
                per_user_bound=settings.clipping_bound,
                population_size=population_size,
                noise_std=(settings.clipping_bound or 0.0) * sigma if share_std > 0 else 0.0,
                num_nodes=num_nodes,
            )
            if share_std > 0 and codec.step > MAX_STEP_TO_SHARE_STD * share_std:
                raise NodeRefusal("fpfl: the quantisation step is not far below the noise share")
        from .fpfl_task import set_flat_parameters  # torch: the round's, not every message's

        model = make_model()
        set_flat_parameters(model, np.asarray(weights, dtype=np.float64))
        rng = round_rng(settings.client_seed, stream(context), round_number)
        total = cohort_contribution(
            model,
            shard,
            constraint=settings.constraint,
            clipping_bound=settings.clipping_bound,
            sample_rate=sample_rate,
            noise_share_std=share_std,
            rng=rng,
        )
        if codec is None:
            return Message(
                content=RecordDict({FPFL_KEY: ArrayRecord({"sum": Array(total)}), **extra}),
                reply_to=msg,
            )
        threshold = share_threshold(
            num_nodes,
            min_survivors=node_limits.min_survivors,
            noise_survivors=minimum_survivors(num_nodes, settings.dropout_tolerance)
            if share_std > 0
            else 0,
            colluders=node_limits.tolerated_colluders,
        )
        self_seed = new_self_seed()
        shares = share_self_seed(self_seed, members, threshold)
        recipients = sorted(set(members) - {own_id})
        sealed = [
            seal_share(secrets[peer], round_number, own_id, peer, shares[peer])
            for peer in recipients
        ]
        encoded = codec.encode(np.clip(total, -codec.clip_range, codec.clip_range))
        masked = mask_vector(
            encoded, own_id, secrets, round_number, cohort=members, self_seed=self_seed
        )
        state = _state(context, session)
        state["last-round"] = round_number
        state["last-members"] = sorted(members)
        state["own-share"] = shares[own_id]
        state["unmasked"] = False
        return Message(
            content=RecordDict(
                {
                    FPFL_KEY: ArrayRecord({"masked": Array(masked)}),
                    "shares": ConfigRecord(
                        {"recipients": recipients, "sealed": sealed, "threshold": threshold}
                    ),
                    **extra,
                }
            ),
            reply_to=msg,
        )

    def reveal(msg: Message, context: Context) -> Message:
        """Unmask the round this node masked last, once: the shares of the survivors'
        self-masks and the pair seeds with the dropped nodes, only if enough nodes survive for
        the noise shares to add up to the run's noise (refuse otherwise)."""
        record = msg.content.config_records.get(FPFL_KEY, {})
        round_number = int_field(record, "round", minimum=0)
        survivors = int_list_field(record, "survivors")
        dropped = int_list_field(record, "dropped")
        senders = int_list_field(record, "share-senders")
        sealed = bytes_list_field(record, "shares")
        node_limits = limits(context)
        session = session_label(msg, sessions)
        secrets = _pinned_secrets(context, session)
        state = _state(context, session)
        own_id = int(context.node_id)
        if int(state.get("last-round", -1)) != round_number or state.get("unmasked", True):  # type: ignore[arg-type]
            raise NodeRefusal(
                "fpfl: unmasking only once, for the round this node masked last; refusing"
            )
        members = [int(node) for node in state["last-members"]]  # type: ignore[union-attr]
        if (
            len(set(survivors)) != len(survivors)
            or len(set(dropped)) != len(dropped)
            or set(survivors) & set(dropped)
            or set(survivors) | set(dropped) != set(members)
            or own_id not in survivors
        ):
            raise NodeRefusal(
                "fpfl: survivors and dropped nodes must split the round's members, with this "
                "node a survivor; refusing to unmask"
            )
        noise_survivors = minimum_survivors(len(members), settings.dropout_tolerance)
        if settings.epsilon is not None and settings.distributed_noise:
            if len(survivors) < noise_survivors:
                # The true reason (not the masking rule below): too few noise shares.
                raise NodeRefusal(
                    "fpfl: refusing to unmask: fewer survivors than n_min, whose noise shares "
                    "add up to the run's noise (the sum would carry less noise than accounted)"
                )
        needed = max(node_limits.min_survivors, noise_survivors)
        if len(survivors) < needed:
            raise NodeRefusal("fpfl: refusing to unmask: fewer survivors than min-survivors")
        if sorted(senders) != sorted(set(survivors) - {own_id}) or len(sealed) != len(senders):
            raise NodeRefusal("fpfl: the unmask request must carry one share from each survivor")
        state["unmasked"] = True  # before anything is released: one answer per round
        try:
            shares = {
                sender: open_share(secrets[sender], round_number, sender, own_id, box)
                for sender, box in zip(senders, sealed, strict=True)
            }
        except ValueError:
            raise NodeRefusal(
                "fpfl: a share does not open (altered or replayed); refusing"
            ) from None
        shares[own_id] = bytes(state["own-share"])  # type: ignore[arg-type]
        seeds = reveal_round_seeds(
            own_id, secrets, round_number, dropped, survivors, min_survivors=needed
        )
        owners = sorted(shares)
        reply = ConfigRecord(
            {
                "share-owners": owners,
                "self-shares": [shares[owner] for owner in owners],
                "dropped": list(seeds),
                "seeds": list(seeds.values()),
            }
        )
        return Message(content=RecordDict({FPFL_KEY: reply}), reply_to=msg)

    handlers = {
        "fpfl_setup": setup,
        "fpfl_keys": keys,
        "fpfl_round": round_,
        "fpfl_reveal": reveal,
    }
    return {action: fixed_error_texts(handler) for action, handler in handlers.items()}
