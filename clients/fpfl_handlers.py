"""FPFL training on a node, as handlers for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.fpfl.FPFLProtocol` sends a setup message (the run's
masking keys) and then one message per round with the model weights; each node samples its
cohort (Poisson), sums the users' clipped statistic vectors for *your* torch model, adds its
share of the Gaussian noise and replies with the sum masked (Rodriguez-Galvez, Granqvist, van
Dalen and Seigel, "Enforcing fairness in private federated learning via the modified method
of differential multipliers", 2021, Algorithm 1). Register them with::

    from fedparity.clients import FPFLNodeSettings, fpfl_handlers

    settings = FPFLNodeSettings(constraint="fnr", cohort_size=1000, rounds=250,
                                clipping_bound=2.0, epsilon=2.0)
    for action, handler in fpfl_handlers(make_model, my_users, settings).items():
        app.query(action)(handler)

``make_model()`` returns a fresh instance of your model, ending in ``nn.Sigmoid`` (binary) or
``nn.Softmax(dim=-1)`` (multi-class): the fairness surrogates need probabilities.
``my_users(context)`` returns the node's users as an
:class:`~fedparity.clients.fpfl_data.FPFLShard`. The node recomputes ``sigma`` from
``settings`` and never takes a noise level from the server, and it holds to its own
:class:`~fedparity.clients.policy.NodePrivacyPolicy` (node config or a policy file): settings
beyond the policy (epsilon, delta, no masking, central noise, a seed, no noise at all) are
refused before anything is computed; the population size ``K`` and the node count the server
sends are bounded by the policy; the noise share is sized for the policy's tolerated
colluders; masks are revealed only for at least the policy's ``min-survivors``; and a node
releases at most ``settings.rounds`` noisy sums in a run (``sigma`` is calibrated for them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from ..mechanisms.protocol import FPFL_KEY
from ..mechanisms.secure_sum import (
    FixedPointCodec,
    MaskingKeyPair,
    mask_vector,
    minimum_survivors,
    pair_secrets,
    reveal_round_seeds,
)
from .fpfl_data import FPFLShard
from .fpfl_node import FPFLNodeSettings, cohort_contribution, round_rng
from .fpfl_task import set_flat_parameters
from .messages import (
    MessageError,
    bytes_field,
    bytes_list_field,
    float_field,
    int_field,
    int_list_field,
)
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

__all__ = ["FPFL_STATE_KEY", "ROUNDS_STATE_KEY", "fpfl_handlers"]

#: Node run-state record of the run's masking key pair and revealed rounds.
FPFL_STATE_KEY = "fpfl-masking"
#: Node run-state record of how many noisy round contributions the node has released.
ROUNDS_STATE_KEY = "fpfl-rounds"
Handler = Callable[[Message, Context], Message]


def _masking_secrets(msg_config: Any, context: Context) -> dict[int, bytes]:
    """This node's pair secrets with the round's peers (its key pair is in its state)."""
    state = context.state.config_records.get(FPFL_STATE_KEY)
    salt = bytes_field(msg_config, "run-salt")
    if state is None or bytes(state["run-salt"]) != salt:  # type: ignore[arg-type]
        raise ValueError("fpfl: no masking key for this run (the setup message was not received)")
    own = MaskingKeyPair.from_private_bytes(bytes(state["private-key"]))  # type: ignore[arg-type]
    peer_ids = int_list_field(msg_config, "peer-ids")
    peer_keys = bytes_list_field(msg_config, "peer-keys")
    if len(peer_ids) != len(peer_keys):
        raise MessageError("message fields 'peer-ids' and 'peer-keys' must have equal lengths")
    peers = dict(zip(peer_ids, peer_keys, strict=True))
    return pair_secrets(int(context.node_id), own, peers, salt)


def fpfl_handlers(
    make_model: Callable[[], torch.nn.Module],
    node_users: Callable[[Context], FPFLShard],
    settings: FPFLNodeSettings,
    *,
    stream: Callable[[Context], int] = lambda context: int(context.node_id),
    policy: NodePrivacyPolicy | None = None,
) -> dict[str, Handler]:
    """The three FPFL handlers (``fpfl_setup``, ``fpfl_round``, ``fpfl_reveal``), keyed by
    the action to register with ``app.query``.

    Parameters
    ----------
    make_model : callable
        A fresh instance of the model the server trains (the round's weights are loaded
        into it in ``named_parameters`` order).
    node_users : callable
        ``node_users(context) -> FPFLShard``: this node's users and their samples.
    settings : FPFLNodeSettings
        The node's own privacy and training parameters.
    stream : callable, optional
        The node's stream id for a seeded run (``settings.client_seed``); default its node id.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy; default: read for each message from the node's own config
        or environment (:func:`~fedparity.clients.policy.node_policy`).
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

    def setup(msg: Message, context: Context) -> Message:
        """Generate this run's masking key pair (kept in the node state); reply with the
        public key only."""
        limits(context)
        salt = bytes_field(msg.content.config_records.get(FPFL_KEY, {}), "run-salt")
        keys = MaskingKeyPair.generate()
        context.state.config_records[FPFL_STATE_KEY] = ConfigRecord(
            {"run-salt": salt, "private-key": keys.private_bytes()}
        )
        return Message(
            content=RecordDict({FPFL_KEY: ConfigRecord({"public-key": keys.public_bytes()})}),
            reply_to=msg,
        )

    def round_(msg: Message, context: Context) -> Message:
        """Sample this node's cohort, sum the users' clipped vectors, add the noise share and
        reply with the sum masked (or in the clear without masking)."""
        node_limits = limits(context)
        settings_record = msg.content.config_records.get("config", {})
        weights = msg.content.array_records[FPFL_KEY]["weights"].numpy()
        if weights.ndim != 1 or weights.dtype.kind != "f" or not np.isfinite(weights).all():
            raise MessageError("message array 'weights' must be a 1-d array of finite floats")
        round_number = int_field(settings_record, "round", minimum=0)
        # K and the node count come from the server: bounded by the node's policy.
        population_size = node_limits.bounded_population(
            int_field(settings_record, "population-size", minimum=1)
        )
        if settings.epsilon is not None and settings.delta is None:
            if not 1.0 / population_size <= node_limits.fpfl_max_delta:
                raise PolicyRefusal("the training's delta is above fpfl-max-delta")
        num_nodes = int_field(settings_record, "num-nodes", minimum=1)
        peers = set(int_list_field(settings_record, "peer-ids"))
        if len(peers) != num_nodes or int(context.node_id) not in peers:
            # The noise share shrinks with num-nodes: never take it from the server unchecked.
            raise ValueError(
                f"fpfl: the round says num-nodes = {num_nodes} but lists {len(peers)} distinct "
                f"peer(s){'' if int(context.node_id) in peers else ' without this node'}; "
                "refusing to scale the noise share"
            )
        if settings.masking or settings.distributed_noise:
            node_limits.check_nodes(num_nodes)
        if settings.epsilon is not None:
            # sigma is calibrated for T rounds: a server asking for more would spend more than
            # epsilon. Counted (in this run's node state) before anything is released.
            answered = context.state.config_records.get(ROUNDS_STATE_KEY, {}).get("answered", 0)
            if int(answered) >= settings.rounds:  # type: ignore[arg-type]
                raise PolicyRefusal("the training's rounds are all spent")
            context.state.config_records[ROUNDS_STATE_KEY] = ConfigRecord(
                {"answered": int(answered) + 1}  # type: ignore[arg-type]
            )
        shard = node_users(context)
        model = make_model()
        set_flat_parameters(model, np.asarray(weights, dtype=np.float64))
        rng = round_rng(settings.client_seed, stream(context), round_number)
        total = cohort_contribution(
            model,
            shard,
            constraint=settings.constraint,
            clipping_bound=settings.clipping_bound,
            sample_rate=min(1.0, settings.cohort_size / population_size),
            noise_share_std=settings.noise_share_std(
                population_size, num_nodes, colluders=node_limits.tolerated_colluders
            ),
            rng=rng,
        )
        if not settings.masking:
            record = ArrayRecord({"sum": Array(total)})
        else:
            limit = float_field(settings_record, "codec-range")
            codec = FixedPointCodec(clip_range=limit, max_nodes=max(2, num_nodes))
            encoded = codec.encode(np.clip(total, -limit, limit))
            secrets = _masking_secrets(settings_record, context)
            masked = mask_vector(encoded, int(context.node_id), secrets, round_number)
            record = ArrayRecord({"masked": Array(masked)})
        return Message(content=RecordDict({FPFL_KEY: record}), reply_to=msg)

    def reveal(msg: Message, context: Context) -> Message:
        """Reveal this round's mask seeds with the dropped nodes, only if enough nodes survive
        for the noise shares to add up to the run's noise (refuse otherwise)."""
        record = msg.content.config_records.get(FPFL_KEY, {})
        round_number = int_field(record, "round", minimum=0)
        survivors = int_list_field(record, "survivors")
        dropped = int_list_field(record, "dropped")
        members = len(survivors) + len(dropped)
        node_limits = limits(context)
        noise_survivors = minimum_survivors(members, settings.dropout_tolerance)
        if settings.epsilon is not None and settings.distributed_noise:
            if len(survivors) < noise_survivors:
                # The true reason (not the masking rule below): too few noise shares.
                raise ValueError(
                    f"fpfl: refusing to reveal: {len(survivors)} survivor(s), fewer than "
                    f"n_min = {noise_survivors} whose noise shares add up to the run's noise "
                    "(the sum would carry less noise than accounted)"
                )
        needed = max(node_limits.min_survivors, noise_survivors)
        secrets = _masking_secrets(record, context)
        state = context.state.config_records[FPFL_STATE_KEY]
        revealed_rounds = [int(r) for r in state.get("revealed-rounds", [])]  # type: ignore[union-attr]
        if round_number in revealed_rounds:
            raise ValueError(
                f"fpfl: already revealed seeds for round {round_number}; refusing again"
            )
        seeds = reveal_round_seeds(
            int(context.node_id), secrets, round_number, dropped, survivors, min_survivors=needed
        )
        state["revealed-rounds"] = [*revealed_rounds, round_number]
        reply = ConfigRecord({"dropped": list(seeds), "seeds": list(seeds.values())})
        return Message(content=RecordDict({FPFL_KEY: reply}), reply_to=msg)

    return {"fpfl_setup": setup, "fpfl_round": round_, "fpfl_reveal": reveal}
