"""What every subcommand shares: argument parsing with exit status 2, number checks, output."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
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


def _integer(name: str, text: str, minimum: int, maximum: int | None = None) -> int:
    """An integer option in ``[minimum, maximum]`` (``parse_int``'s rule: ``3``, ``3.0`` and
    integral scientific notation such as ``1e7``); else a usage error naming the option."""
    from ...mechanisms.validation import parse_int

    try:
        return parse_int(name, text, minimum=minimum, maximum=maximum)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _epsilon(name: str, text: str) -> float:
    """A privacy budget option: finite and in the planner's range (the one bound of every
    command: ``measure`` took 1e300 where ``plan`` stops at 1e4)."""
    from ...mechanisms.ldp.planner import MAX_PLANNED_EPSILON, MIN_PLANNED_EPSILON

    return _in_range(name, _finite(name, text), MIN_PLANNED_EPSILON, MAX_PLANNED_EPSILON)


def _groups(text: str) -> int:
    """``--groups``: an integer d in [2, MAX_GROUPS], checked by the mechanisms' own
    validator under the option's name (not its parameter name ``num_groups``)."""
    from ...mechanisms.validation import MAX_GROUPS

    return _integer("--groups", text, 2, MAX_GROUPS)


def _input_file(option: str, text: str) -> Path:
    """An input file option: a usage error naming the option when it is missing or a folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a folder, not a file")
    if not path.is_file():
        raise UsageError(f"{option}: no such file: {path}")
    return path


def _not_utf8(
    option: str, path: Path, error: UnicodeDecodeError, line: int | None = None
) -> UsageError:
    """The usage error of a file that is not UTF-8 text (not Python's codec message, which
    names neither the option nor the file)."""
    byte = error.object[error.start : error.start + 1].hex()
    where = f" on line {line}" if line is not None else ""
    return UsageError(
        f"{option}: {path} is not UTF-8 text (byte 0x{byte}{where}); the CSV must be UTF-8 "
        "(e.g. save it as 'CSV UTF-8', or convert it with iconv -f latin1 -t utf-8)"
    )


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
