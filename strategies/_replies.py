"""Bookkeeping of the replies a strategy could not use, shared by every strategy."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_REASON_LENGTH", "RejectedReply", "short_reason"]

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
