"""Real FPFL nodes in one process, for tests that play the server.

:class:`MaskingNodes` holds a few nodes, each with the library's own handlers
(:func:`fedparity.clients.fpfl_handlers`) and its own Flower ``Context``. Its methods build the
messages an honest :class:`~fedparity.strategies.fpfl.FPFLProtocol` sends (same fields), so a
test can send them as they are, or tamper with them as an active server would, and read the
replies as the server does. The server-side unmasking is the library's
(:func:`~fedparity.mechanisms.secure_sum.unmask_sum`, :func:`combine_self_seed`).
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
from fedparity.clients.fpfl_node import cohort_contribution
from fedparity.clients.fpfl_task import get_flat_parameters, statistics_layout
from fedparity.clients.identity import NodeIdentity
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms.protocol import FPFL_KEY, SESSION_KEY
from fedparity.mechanisms.secure_sum import (
    combine_self_seed,
    contribution_codec,
    unmask_sum,
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
#: every user in the cohort; a policy that allows the noise-free run.
EXACT = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=POPULATION,
    rounds=5,
    clipping_bound=CLIP,
    epsilon=None,
    dropout_tolerance=0.25,
)
EXACT_POLICY = NodePrivacyPolicy(allow_non_private=True)
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


@dataclass
class RoundReplies:
    """What the nodes sent in one round: masked vectors and sealed shares, by node."""

    masked: dict[int, np.ndarray] = field(default_factory=dict)
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict)
    thresholds: dict[int, int] = field(default_factory=dict)


class MaskingNodes:
    """``node_ids`` real FPFL nodes; see the module docstring."""

    def __init__(
        self,
        node_ids: Sequence[int],
        settings: FPFLNodeSettings = EXACT,
        *,
        policy: NodePrivacyPolicy = EXACT_POLICY,
        identities: Mapping[int, NodeIdentity] | None = None,
        node_config: Mapping[int, dict] | None = None,
        sessions: Sequence[str] = ("",),
    ) -> None:
        """Each node keeps its privacy ledger in its own folder (node config ``ledger-dir``,
        default: a temporary folder removed with this object). ``sessions``: the trainings
        the nodes' run defines; every message names :attr:`session` (``""``: none)."""
        self.ids = sorted(node_ids)
        self.session = ""
        self._ledgers = tempfile.TemporaryDirectory(prefix="fedparity-ledgers-")
        self.settings = settings
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
        self.setup_replies: dict[int, ConfigRecord] = {}
        self.weights = get_flat_parameters(make_model())

    # -- messages ----------------------------------------------------------------------------

    def send(self, action: str, node: int, content: RecordDict) -> Message:
        if self.session:
            content[SESSION_KEY] = ConfigRecord({"label": self.session})
        message = Message(content, dst_node_id=node, message_type=f"query.{action}")
        return self.handlers[action](message, self.contexts[node])

    def setup(self) -> None:
        for node in self.ids:
            reply = self.send(
                "fpfl_setup", node, RecordDict({FPFL_KEY: ConfigRecord({"run-salt": SALT})})
            )
            self.setup_replies[node] = reply.content.config_records[FPFL_KEY]

    def key_table(self) -> dict[str, object]:
        """The table an honest server sends (with the signatures when every node sent one)."""
        table: dict[str, object] = {
            "run-salt": SALT,
            "peer-ids": list(self.ids),
            "peer-keys": [bytes(self.setup_replies[n]["public-key"]) for n in self.ids],
        }
        if all("signature" in self.setup_replies[n] for n in self.ids):
            table["identity-keys"] = [
                bytes(self.setup_replies[n]["identity-key"]) for n in self.ids
            ]
            table["signatures"] = [bytes(self.setup_replies[n]["signature"]) for n in self.ids]
        return table

    def pin(
        self, table: Mapping[str, object] | None = None, nodes: Sequence[int] | None = None
    ) -> None:
        for node in nodes if nodes is not None else self.ids:
            self.send(
                "fpfl_keys",
                node,
                RecordDict({FPFL_KEY: ConfigRecord(dict(table or self.key_table()))}),  # type: ignore[arg-type]
            )

    def round_message(
        self, round_number: int, members: Sequence[int], population: int = POPULATION
    ) -> RecordDict:
        config = ConfigRecord(
            {"round": round_number, "population-size": population, "peer-ids": list(members)}
        )
        return RecordDict(
            {FPFL_KEY: ArrayRecord({"weights": Array(self.weights)}), "config": config}
        )

    def round(
        self,
        round_number: int,
        members: Sequence[int] | None = None,
        nodes: Sequence[int] | None = None,
        population: int = POPULATION,
    ) -> RoundReplies:
        """Send round ``round_number`` to ``nodes`` (default: the members) and read the
        replies."""
        members = list(members if members is not None else self.ids)
        replies = RoundReplies()
        for node in nodes if nodes is not None else members:
            reply = self.send(
                "fpfl_round", node, self.round_message(round_number, members, population)
            )
            replies.masked[node] = reply.content.array_records[FPFL_KEY]["masked"].numpy()
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

    def unmask_content(
        self,
        round_number: int,
        node: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        sealed: Mapping[int, Mapping[int, bytes]],
    ) -> RecordDict:
        senders = [peer for peer in survivors if peer != node]
        return RecordDict(
            {
                FPFL_KEY: ConfigRecord(
                    {
                        "round": round_number,
                        "survivors": list(survivors),
                        "dropped": list(dropped),
                        "share-senders": senders,
                        "shares": [sealed[peer][node] for peer in senders],
                    }
                )
            }
        )

    def unmask(
        self,
        round_number: int,
        node: int,
        survivors: Sequence[int],
        dropped: Sequence[int],
        sealed: Mapping[int, Mapping[int, bytes]],
    ) -> tuple[dict[int, bytes], dict[tuple[int, int], bytes]]:
        """Node ``node``'s unmask answer: ``({owner: self-mask share}, {(node, d): seed})``."""
        reply = self.send(
            "fpfl_reveal",
            node,
            self.unmask_content(round_number, node, survivors, dropped, sealed),
        )
        record = reply.content.config_records[FPFL_KEY]
        shares = dict(
            zip(
                [int(o) for o in record["share-owners"]],  # type: ignore[union-attr]
                [bytes(s) for s in record["self-shares"]],  # type: ignore[union-attr]
                strict=True,
            )
        )
        seeds = {
            (node, int(peer)): bytes(seed)
            for peer, seed in zip(record["dropped"], record["seeds"], strict=True)  # type: ignore[arg-type]
        }
        return shares, seeds

    # -- the server's arithmetic --------------------------------------------------------------

    def codec(self, num_nodes: int, population: int = POPULATION):  # noqa: ANN201
        return contribution_codec(
            per_user_bound=self.settings.clipping_bound,
            population_size=population,
            noise_std=0.0,
            num_nodes=num_nodes,
        )

    def honest_sum(
        self, round_number: int, replies: RoundReplies, members: Sequence[int]
    ) -> np.ndarray:
        """The whole honest protocol's result for a round whose survivors are ``replies``."""
        survivors = sorted(replies.masked)
        dropped = sorted(set(members) - set(survivors))
        answers = {
            node: self.unmask(round_number, node, survivors, dropped, replies.sealed)
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
            participants=members,
            self_seeds=self_seeds,
        )
        return self.codec(len(members)).decode(total)

    def weights_size(self) -> int:
        return statistics_layout(make_model(), 2).size

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
