"""A Flower grid whose nodes are real handlers in this process (no SuperLink, no simulation):
each pushed message is handled at once by its node's handler, a refusal becomes an error reply
as Flower sends it, and ``drop(action, node)`` may lose a reply."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace

from flwr.app import Context, Error, Message

#: ``handler(node_id, action)``: the node's handler for ``action`` (the message type without
#: its ``query.`` prefix).
HandlerFor = Callable[[int, str], Callable[[Message, Context], Message]]


class HandlerGrid:
    """Nodes ``contexts`` (node id -> its Context) answering through ``handler_for``."""

    def __init__(
        self,
        handler_for: HandlerFor,
        contexts: Mapping[int, Context],
        *,
        run_id: int = 1,
        drop: Callable[[str, int], bool] | None = None,
    ) -> None:
        self.handler_for, self.contexts, self.drop = handler_for, dict(contexts), drop
        self.run = SimpleNamespace(run_id=run_id)
        self.sent: list[tuple[str, int]] = []
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            message_id = str(len(self.sent))
            message.metadata.__dict__["_message_id"] = message_id
            node = int(message.metadata.dst_node_id)
            action = message.metadata.message_type.removeprefix("query.")
            self.sent.append((action, node))
            try:
                reply = self.handler_for(node, action)(message, self.contexts[node])
            except Exception as refusal:  # noqa: BLE001 - Flower sends any error back
                reply = Message(Error(code=0, reason=str(refusal)), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            if self.drop is None or not self.drop(action, node):
                self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]
