"""How results print: one number format for summaries, verdict lines and reports."""

from __future__ import annotations

import math
import re

#: An ANSI escape sequence (Flower colours its log levels, also in redirected output).
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def format_number(value: float | int | None, spec: str = ".4f") -> str:
    """``format(value, spec)``, or ``"n/a"`` for None, NaN and infinity (a result that has no
    value prints the same in a summary, on the console and in a report)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    return format(value, spec)


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colour codes)."""
    return ANSI_ESCAPE.sub("", text)
