"""What every subcommand shares: argument parsing with exit status 2, number checks, output."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn, TextIO

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: printed on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _finite(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{name} must be finite, got {text!r}")
    return value


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise UsageError(f"{name} must be > 0, got {value:g}")
    return value


def _in_range(name: str, value: float, low: float, high: float) -> float:
    """``value`` if ``low <= value <= high``; else a usage error naming ``name`` and the range."""
    if not low <= value <= high:
        raise UsageError(f"{name} must be a number in [{low:g}, {high:g}], got {value:g}")
    return value


def _unit_open(name: str, value: float) -> float:
    if not 0.0 < value < 1.0:
        raise UsageError(f"{name} must be in the open interval (0, 1), got {value:g}")
    return value


def _int_at_least(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        try:  # accept integral scientific notation such as 1e7
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number.is_integer()):
            raise UsageError(f"{name} must be an integer >= {minimum}, got {text!r}") from None
        value = int(number)
    if value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _number(value: float) -> str:
    """A number for a message: 2 for 2.0, else the shortest exact form (1.0000001, nan),
    never numpy's ``np.float64(2.0)`` repr."""
    number = float(value)
    if number.is_integer() and abs(number) < 1e16:
        return str(int(number))
    return repr(number)


def _emit(payload: dict[str, Any], text: str, as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(payload, allow_nan=False) + "\n")
    else:
        out.write(text.rstrip("\n") + "\n")


# --- privacy ------------------------------------------------------------------------------
