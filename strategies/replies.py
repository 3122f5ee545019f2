"""Bookkeeping of the replies a strategy receives, shared by every strategy: who a reply is
from, which nodes did not reply, and the replies it could not use."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

__all__ = [
    "MAX_REASON_LENGTH",
    "POLL_FIRST_INTERVAL",
    "POLL_GROWTH",
    "POLL_MAX_INTERVAL",
    "RejectedReply",
    "attribute_replies",
    "send_and_receive",
    "short_reason",
]

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
MAX_REASON_LENGTH = 240


def short_reason(text: str) -> str:
    """A client's error text for logs and results: no colour codes, one line, the end kept
    (where Python puts the exception message of a long remote traceback)."""
    flat = " ".join(_ANSI_ESCAPE.sub("", str(text)).split())
    if len(flat) <= MAX_REASON_LENGTH:
        return flat
    return "..." + flat[-MAX_REASON_LENGTH:]


@dataclass(frozen=True)
class RejectedReply:
    """A reply that was not used, and why."""

    node_id: int
    reason: str


def attribute_replies(sent: Sequence[Message], replies: Iterable[Message]) -> list[Message]:
    """The replies the nodes themselves sent; the node a reply is from is the node the
    message it answers was sent to.

    When a node cannot be reached, Flower answers in its place with an error reply whose
    source is the SuperLink itself (node id 1), not the node: taken at face value, every
    strategy would count a phantom "node 1" and the dead node as missing as well. The message
    a reply answers (``reply_to_message_id``) names the node it was sent to; such an error
    reply is left out (logged with Flower's reason), so the node counts as missing, which is
    what happened: it did not reply.
    """
    destinations = {msg.metadata.message_id: int(msg.metadata.dst_node_id) for msg in sent}
    attributed = []
    for reply in replies:
        node = destinations.get(reply.metadata.reply_to_message_id)
        if node is not None and reply.has_error() and int(reply.metadata.src_node_id) != node:
            log(
                logging.INFO,
                "no reply from node %d (Flower: %s)",
                node,
                short_reason(reply.error.reason),
            )
            continue
        attributed.append(reply)
    return attributed


#: First wait between two polls for replies (s); it grows by :data:`POLL_GROWTH` per poll up
#: to :data:`POLL_MAX_INTERVAL`.
POLL_FIRST_INTERVAL = 0.002
POLL_GROWTH = 1.5
POLL_MAX_INTERVAL = 0.25


def send_and_receive(grid: Grid, messages: Sequence[Message], timeout: float) -> list[Message]:
    """Push ``messages``, pull their replies until all arrived or ``timeout`` seconds passed,
    and attribute every reply to the node it concerns (:func:`attribute_replies`).

    The same as ``grid.send_and_receive`` except for the waits between polls: Flower sleeps a
    fixed 0.1 s between polls in simulation and 3 s against a SuperLink, which dominated a
    round that itself takes tens of milliseconds. Here the wait starts at 2 ms and grows
    geometrically to at most 0.25 s, so fast replies are read at once and slow ones cost few
    polls.
    """
    message_ids = {message_id for message_id in grid.push_messages(messages) if message_id}
    deadline = time.monotonic() + timeout
    interval = POLL_FIRST_INTERVAL
    replies: list[Message] = []
    while message_ids:
        pulled = list(grid.pull_messages(message_ids))
        replies.extend(pulled)
        message_ids.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        remaining = deadline - time.monotonic()
        if not message_ids or remaining <= 0:
            break
        time.sleep(min(interval, remaining))
        interval = min(interval * POLL_GROWTH, POLL_MAX_INTERVAL)
    return attribute_replies(messages, replies)
