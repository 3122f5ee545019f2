"""FedAvg that counts and drops malformed training replies instead of failing the round.

Flower's :class:`~flwr.serverapp.strategy.FedAvg` raises ``InconsistentMessageReplies`` when
one reply lacks its ArrayRecord or weight, which would end the whole run. Here every reply
is checked on its own against the model that was sent (same keys, shapes, finite values, a
finite ``num-examples`` >= 0; a node without data sends 0 and is skipped); bad replies are
logged, recorded per round in :attr:`RobustFedAvg.rejected` and left out, and the others
are averaged as usual.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from .replies import RejectedReply, attribute_replies, short_reason


class RobustFedAvg(FedAvg):
    """:class:`FedAvg` with per-reply validation (same constructor arguments)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rejected: dict[int, list[RejectedReply]] = {}
        #: Per round, the nodes that were sent the model and did not reply.
        self.missing: dict[int, list[int]] = {}
        self._sent_shapes: dict[str, tuple[int, ...]] = {}
        self._sent: list[Message] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._sent_shapes = {key: tuple(array.shape) for key, array in arrays.items()}
        # Kept so that the replies can be attributed to the nodes they concern (the Grid
        # gives the messages their ids when it sends them).
        self._sent = list(super().configure_train(server_round, arrays, config, grid))
        return self._sent

    def _problem(self, content: RecordDict) -> str | None:
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            return "expected exactly one ArrayRecord and one MetricRecord"
        arrays = next(iter(content.array_records.values()))
        if set(arrays.keys()) != set(self._sent_shapes):
            return "array keys differ from the global model's"
        for key, array in arrays.items():
            try:
                values = array.numpy()
            except Exception as error:  # a corrupt Array must not end the run
                return f"array {key!r} cannot be decoded: {error}"
            if tuple(values.shape) != self._sent_shapes[key]:
                return f"array {key!r} has shape {values.shape}, expected {self._sent_shapes[key]}"
            if not np.all(np.isfinite(values)):
                return f"array {key!r} holds NaN or infinity"
        metrics: MetricRecord = next(iter(content.metric_records.values()))
        weight = metrics.get(self.weighted_by_key)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            return f"metric {self.weighted_by_key!r} must be a number >= 0, got {weight!r}"
        return None

    def _weight(self, reply: Message) -> float:
        metrics: MetricRecord = next(iter(reply.content.metric_records.values()))
        return float(metrics[self.weighted_by_key])  # type: ignore[arg-type]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        good: list[Message] = []
        rejected: list[RejectedReply] = []
        replies = attribute_replies(self._sent, replies)
        replied = {int(reply.metadata.src_node_id) for reply in replies}
        self.missing[server_round] = sorted(
            int(msg.metadata.dst_node_id)
            for msg in self._sent
            if int(msg.metadata.dst_node_id) not in replied
        )
        for reply in replies:
            node_id = int(reply.metadata.src_node_id)
            problem = (
                f"client error: {short_reason(reply.error.reason)}"
                if reply.has_error()
                else self._problem(reply.content)
            )
            if problem is None:
                if self._weight(reply) > 0:  # a node without training data has weight 0
                    good.append(reply)
            else:
                rejected.append(RejectedReply(node_id, problem))
                log(
                    logging.WARNING,
                    "round %d: rejected reply from node %d: %s",
                    server_round,
                    node_id,
                    problem,
                )
        self.rejected[server_round] = rejected
        if not good:
            log(logging.WARNING, "round %d: no valid training reply; model unchanged", server_round)
            return None, None
        return super().aggregate_train(server_round, good)
