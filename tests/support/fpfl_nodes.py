"""Real FPFL nodes in one process, for tests that play the server.

:class:`MaskingNodes` holds a few nodes, each with the library's own handlers
(:func:`fedparity.clients.fpfl_handlers`) and its own Flower ``Context``. Its methods build the
messages an honest :class:`~fedparity.strategies.fpfl.FPFLProtocol` sends (same fields), so a
test can send them as they are, or tamper with them as an active server would, and read the
replies as the server does. The server-side unmasking is the library's
(:func:`~fedparity.mechanisms.crypto.secure_sum.unmask_sum`, :func:`combine_self_seed`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from fedparity.clients import FPFLNodeSettings, FPFLShard, fpfl_handlers
from fedparity.clients.fpfl_handlers import FPFL_STATE_KEY, FPFLRunState
from fedparity.clients.fpfl_node import cohort_contribution
from fedparity.clients.fpfl_task import get_flat_parameters, statistics_layout
from fedparity.clients.identity import NodeIdentity
from fedparity.clients.messages import session_state_key
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from fedparity.mechanisms.crypto.secure_sum import combine_self_seed, unmask_sum
from fedparity.mechanisms.protocol import FPFL_KEY, SESSION_KEY
from fedparity.mechanisms.protocol.fpfl import (
    MASKED_ARRAY,
    WEIGHTS_ARRAY,
    FPFLConfirmReply,
    FPFLConfirmRequest,
    FPFLKeyTable,
    FPFLRevealReply,
    FPFLRevealRequest,
    FPFLRoundRequest,
    FPFLRunParameters,
    FPFLSetupReply,
    FPFLSetupRequest,
)

USERS = 20
CLIP = 1.0
SALT = b"fedparity-test-salt"
POPULATION = 1000
#: A small FPFL run config for a real simulation of a few nodes (fast, reproducible).
SMALL_FPFL = {
    "task": "fpfl",
    "dataset": "synthetic",
    "users-per-node": 100,
    "fpfl-cohort-size": 60,
    "fpfl-rounds": 2,
    "fpfl-client-seed": 3,
}

#: The FPFL job through the Python API on 3 simulated nodes, 4 seeded rounds: what the update
#: rules' simulation tests (FedFB, FairFed) compare with "fpfl".
FPFL_JOB_3_NODES = {
    "task": "fpfl",
    "dataset": "synthetic",
    "users-per-node": 200,
    "fpfl-cohort-size": 150,
    "fpfl-client-seed": 7,
    "fpfl-rounds": 4,
    "reply-timeout": 60.0,
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 1), nn.Sigmoid())


def node_users(_: Context | None = None) -> FPFLShard:
    rng = np.random.default_rng(2)
    rows = 2 * USERS
    return FPFLShard(
        features=rng.normal(size=(rows, 2)).astype(np.float32),
        labels=rng.integers(0, 2, size=rows).astype(np.int64),
        groups=(np.arange(rows) % 2).astype(np.int64),
        user_index=(np.arange(rows) // 2).astype(np.int64),
        user_ids=np.arange(USERS, dtype=np.int64),
        num_groups=2,
        num_classes=2,
    )


#: Clipped sums without noise (the sum is exact, so an unmasked vector is recognisable), with
#: every user in the cohort; a policy that allows the noise-free run, and masking without a
#: roster (the tests that use it play other attacks than invented peers, which
#: tests/test_sybil_peers.py plays: ``require-roster = false`` is that accepted risk).
EXACT = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=POPULATION,
    rounds=5,
    clipping_bound=CLIP,
    epsilon=None,
    dropout_tolerance=0.25,
)
EXACT_POLICY = NodePrivacyPolicy(allow_non_private=True, require_roster=False)
#: A private training under masking and distributed noise (the built-in policy's rules).
PRIVATE_TRAINING = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=10,
    rounds=5,
    clipping_bound=CLIP,
    epsilon=2.0,
    delta=1e-6,
    dropout_tolerance=0.0,
)


def roster_identities(node_ids: Sequence[int]) -> dict[int, NodeIdentity]:
    """A fresh identity key per node and one roster of them all (what ``fedparity identity``
    gives a cross-silo federation): for :class:`MaskingNodes` ``identities``, so that nodes
    under the built-in policy (``require-roster``) take part."""
    keys = {node: IdentityKey.generate() for node in node_ids}
    roster = Roster.from_keys({f"node-{node}": key for node, key in keys.items()})
    return {node: NodeIdentity(keys[node], roster) for node in node_ids}


@dataclass
class RoundReplies:
    """What the nodes sent in one round: masked vectors and sealed shares, by node."""

    masked: dict[int, np.ndarray] = field(default_factory=dict)
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict)
    thresholds: dict[int, int] = field(default_factory=dict)


def run_parameters(
    settings: FPFLNodeSettings,
    *,
    population: int = POPULATION,
    session: str = "",
    noise_multiplier: float | None = None,
) -> FPFLRunParameters:
    """The run parameters an honest server proposes for nodes with ``settings`` (sigma from the
    nodes' own calibration unless given)."""
    sigma = settings.noise_multiplier(population) if noise_multiplier is None else noise_multiplier
    delta = None
    if settings.epsilon is not None:
        delta = settings.delta if settings.delta is not None else 1.0 / population
    return FPFLRunParameters(
        population_size=population,
        cohort_size=settings.cohort_size,
        rounds=settings.rounds,
        clipping_bound=settings.clipping_bound,
        epsilon=settings.epsilon,
        delta=delta,
        noise_multiplier=sigma,
        accountant=settings.accountant,
        constraint=settings.constraint,
        num_groups=2,
        vector_size=statistics_layout(make_model(), 2).size,
        distributed_noise=settings.distributed_noise,
        masking=settings.masking,
        dropout_tolerance=settings.dropout_tolerance,
        session=session,
        fairfed_release_share=settings.fairfed_release_share,
    )


class MaskingNodes:
    """``node_ids`` real FPFL nodes; see the module docstring."""

    def __init__(
        self,
        node_ids: Sequence[int],
        settings: FPFLNodeSettings = EXACT,
        *,
        policy: NodePrivacyPolicy | None = EXACT_POLICY,
        identities: Mapping[int, NodeIdentity] | None = None,
        node_config: Mapping[int, dict] | None = None,
        sessions: Sequence[str] = ("",),
        population: int = POPULATION,
    ) -> None:
        """Each node keeps its privacy ledger in its own folder (node config ``ledger-dir``,
        default: a temporary folder removed with this object). ``policy`` None: each node's
        own, from its ``node_config`` (:func:`~fedparity.clients.policy.node_policy`).
        ``sessions``: the trainings the nodes' run defines; every message names
        :attr:`session` (``""``: none)."""
        self.ids = sorted(node_ids)
        self.session = ""
        self._ledgers = tempfile.TemporaryDirectory(prefix="fedparity-ledgers-")
        self.settings = settings
        self.population = population
        self.identities = dict(identities or {})
        self.handlers = fpfl_handlers(
            make_model,
            node_users,
            settings,
            policy=policy,
            identity=lambda context: self.identities.get(
                int(context.node_id), NodeIdentity(None, None)
            ),
            sessions=sessions,
        )
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={
                    "ledger-dir": f"{self._ledgers.name}/node-{node}",
                    **(node_config or {}).get(node, {}),
                },
                state=RecordDict(),
                run_config={},
            )
            for node in self.ids
        }
        self.setup_replies: dict[int, FPFLSetupReply] = {}
        #: The table pinned last, per session.
        self.tables: dict[str, FPFLKeyTable] = {}
        self.weights = get_flat_parameters(make_model())

    # -- messages ----------------------------------------------------------------------------

    @property
    def parameters(self) -> FPFLRunParameters:
        """What an honest server proposes for this run (and session)."""
        return run_parameters(self.settings, population=self.population, session=self.session)

    def send(self, action: str, node: int, content: RecordDict) -> Message:
        if self.session:
            content[SESSION_KEY] = ConfigRecord({"label": self.session})
        message = Message(content, dst_node_id=node, message_type=f"query.{action}")
        return self.handlers[action](message, self.contexts[node])

    def setup_message(self, parameters: FPFLRunParameters | None = None) -> RecordDict:
        request = FPFLSetupRequest(SALT, parameters or self.parameters)
        return RecordDict({FPFL_KEY: ConfigRecord(request.to_fields())})

    def setup(
        self,
        parameters: FPFLRunParameters | Mapping[int, FPFLRunParameters] | None = None,
        nodes: Sequence[int] | None = None,
    ) -> None:
        """Send the setup to ``nodes`` (default: all) with ``parameters`` (default: the honest
        ones; a mapping gives each node its own view, as an active server could)."""
        for node in nodes if nodes is not None else self.ids:
            proposed = parameters.get(node) if isinstance(parameters, Mapping) else parameters
            reply = self.send("fpfl_setup", node, self.setup_message(proposed))
            self.setup_replies[node] = FPFLSetupReply.from_fields(
                reply.content.config_records[FPFL_KEY]
            )

    def key_table(
        self,
        parameters: FPFLRunParameters | None = None,
        members: Sequence[int] | None = None,
    ) -> FPFLKeyTable:
        """The table an honest server sends (with the signatures when every node sent one)."""
        parameters = parameters or self.parameters
        members = sorted(members if members is not None else self.ids)
        replies = [self.setup_replies[node] for node in members]
        signed = all(reply.signature is not None for reply in replies)
        codec = self.codec(len(members), parameters=parameters)
        return FPFLKeyTable(
            run_salt=SALT,
            parameters_digest=parameters.digest(),
            members=tuple(members),
            public_keys=tuple(reply.public_key for reply in replies)  # type: ignore[misc]
            if parameters.masking
            else (),
            identity_keys=tuple(reply.identity_key for reply in replies) if signed else (),  # type: ignore[misc]
            signatures=tuple(reply.signature for reply in replies) if signed else (),  # type: ignore[misc]
            codec_clip_range=codec.clip_range if parameters.masking else None,
            codec_scale=codec.scale if parameters.masking else None,
        )

    def pin(
        self,
        table: FPFLKeyTable | Mapping[str, object] | None = None,
        nodes: Sequence[int] | None = None,
    ) -> None:
        table = table if table is not None else self.key_table()
        if isinstance(table, FPFLKeyTable):
            self.table = table
        fields = table.to_fields() if isinstance(table, FPFLKeyTable) else dict(table)
        for node in nodes if nodes is not None else self.ids:
            self.send("fpfl_keys", node, RecordDict({FPFL_KEY: ConfigRecord(fields)}))  # type: ignore[arg-type]

    @property
    def table(self) -> FPFLKeyTable | None:
        """The table pinned last in the current session."""
        return self.tables.get(self.session)

    @table.setter
    def table(self, table: FPFLKeyTable) -> None:
        self.tables[self.session] = table

    @property
    def run_digest(self) -> bytes:
        assert self.table is not None, "pin() first"
        return self.table.run_digest()

    def round_message(
        self,
        round_number: int,
        run_digest: bytes | None = None,
        weights: np.ndarray | None = None,
    ) -> RecordDict:
        request = FPFLRoundRequest(
            round_number,
            run_digest if run_digest is not None else self.run_digest,
            self.weights if weights is None else weights,
        )
        return RecordDict(
            {
                FPFL_KEY: ArrayRecord({WEIGHTS_ARRAY: Array(request.weights)}),
                "config": ConfigRecord(request.to_fields()),
            }
        )

    def round(
        self,
        round_number: int,
        nodes: Sequence[int] | None = None,
        run_digest: bytes | None = None,
    ) -> RoundReplies:
        """Send round ``round_number`` to ``nodes`` (default: every member) and read the
        replies."""
        replies = RoundReplies()
        for node in nodes if nodes is not None else self.ids:
            reply = self.send("fpfl_round", node, self.round_message(round_number, run_digest))
            replies.masked[node] = reply.content.array_records[FPFL_KEY][MASKED_ARRAY].numpy()
            shares = reply.content.config_records["shares"]
            replies.sealed[node] = dict(
                zip(
                    [int(peer) for peer in shares["recipients"]],  # type: ignore[union-attr]
                    [bytes(box) for box in shares["sealed"]],  # type: ignore[union-attr]
                    strict=True,
                )
            )
            replies.thresholds[node] = int(shares["threshold"])  # type: ignore[arg-type]
        return replies

    def confirm(
        self, round_number: int, node: int, survivors: Sequence[int], dropped: Sequence[int]
    ) -> dict[int, bytes]:
        """Node ``node``'s attestations of the view: ``{recipient: MAC}``."""
        request = FPFLConfirmRequest(round_number, tuple(survivors), tuple(dropped))
        reply = self.send(
            "fpfl_confirm", node, RecordDict({FPFL_KEY: ConfigRecord(request.to_fields())})
        )
        answer = FPFLConfirmReply.from_fields(reply.content.config_records[FPFL_KEY])
        return dict(zip(answer.recipients, answer.attestations, strict=True))

    def attest(
        self, round_number: int, survivors: Sequence[int], dropped: Sequence[int]
    ) -> dict[int, dict[int, bytes]]:
        """Every survivor's attestations of the view (``{attester: {recipient: MAC}}``)."""
        return {node: self.confirm(round_number, node, survivors, dropped) for node in survivors}

    def unmask_content(
        self,
        round_number: int,
        node: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        sealed: Mapping[int, Mapping[int, bytes]],
        attestations: Mapping[int, Mapping[int, bytes]] | None = None,
    ) -> RecordDict:
        request = FPFLRevealRequest.for_node(
            round_number, node, survivors, dropped, sealed, attestations or {}
        )
        return RecordDict({FPFL_KEY: ConfigRecord(request.to_fields())})

    def unmask(
        self,
        round_number: int,
        node: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        sealed: Mapping[int, Mapping[int, bytes]],
        attestations: Mapping[int, Mapping[int, bytes]] | None = None,
    ) -> tuple[dict[int, bytes], dict[tuple[int, int], bytes]]:
        """Node ``node``'s unmask answer: ``({owner: self-mask share}, {(node, d): seed})``."""
        reply = self.send(
            "fpfl_reveal",
            node,
            self.unmask_content(round_number, node, survivors, dropped, sealed, attestations),
        )
        answer = FPFLRevealReply.from_fields(reply.content.config_records[FPFL_KEY])
        shares = dict(zip(answer.share_owners, answer.self_shares, strict=True))
        seeds = {
            (node, peer): seed for peer, seed in zip(answer.dropped, answer.seeds, strict=True)
        }
        return shares, seeds

    # -- the server's arithmetic --------------------------------------------------------------

    def codec(
        self,
        num_nodes: int,
        population: int | None = None,
        *,
        parameters=None,  # noqa: ANN001
    ):  # noqa: ANN201
        """The run's fixed-point codec (what the nodes derive from the parameters)."""
        from fedparity.clients.fpfl_handlers import FPFLNode

        parameters = parameters or run_parameters(
            self.settings, population=population or self.population, session=self.session
        )
        return FPFLNode.codec(parameters, num_nodes)

    def honest_sum(self, round_number: int, replies: RoundReplies) -> np.ndarray:
        """The whole honest protocol's result for a round whose survivors are ``replies``."""
        survivors = sorted(replies.masked)
        dropped = sorted(set(self.ids) - set(survivors))
        attestations = self.attest(round_number, survivors, dropped) if dropped else None
        answers = {
            node: self.unmask(round_number, node, survivors, dropped, replies.sealed, attestations)
            for node in survivors
        }
        self_seeds = {
            owner: combine_self_seed(
                [shares[owner] for shares, _ in answers.values()], replies.thresholds[owner]
            )
            for owner in survivors
        }
        seeds = {pair: seed for _, pairs in answers.values() for pair, seed in pairs.items()}
        total = unmask_sum(
            replies.masked,
            seeds,
            round_number,
            self.weights_size(),
            participants=self.ids,
            self_seeds=self_seeds,
        )
        return self.codec(len(self.ids)).decode(total)

    def weights_size(self) -> int:
        return statistics_layout(make_model(), 2).size

    def pair_secret(self, node: int, peer: int) -> bytes:
        """A node's pinned pair secret with ``peer`` (what a colluding node hands the server)."""
        state = FPFLRunState.from_record(
            self.contexts[node].state.config_records[
                session_state_key(FPFL_STATE_KEY, self.session)
            ]
        )
        return state.secrets[peer]

    def true_vector(self) -> np.ndarray:
        """What each node sums in a round (every user joins; clipped; no noise)."""
        model = make_model()
        return cohort_contribution(
            model,
            node_users(),
            constraint=self.settings.constraint,
            clipping_bound=self.settings.clipping_bound,
            sample_rate=1.0,
            noise_share_std=0.0,
            rng=np.random.default_rng(0),
        )
