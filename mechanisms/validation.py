"""Argument checks of the whole package: one place, one rule, one wording.

Every public entry point checks its inputs here *before* doing any work and raises a
``ValueError`` that names the parameter and the allowed range. A caller with its own error
type (a run-config ``ConfigError``, a wire ``MessageError``, a CLI usage error) catches the
``ValueError`` and raises its own, keeping the rule.

Integers have one rule (:func:`check_int`): an ``int``, a numpy integer, or a finite float
with an integral value (``3.0``, as TOML, JSON and Flower's records may carry a count); never
a ``bool``, ``3.5``, NaN or a string. Text (a TOML string, an environment variable, a command
line option) goes through :func:`parse_int`, which reads decimal integers (``"3"``, ``" 3 "``)
and, as the command line always has, numbers whose value is integral (``"3.0"``, ``"1e6"``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import NoReturn, TypeVar

import numpy as np

T = TypeVar("T", bound=str)

__all__ = [
    "MAX_GROUPS",
    "check_binary_array",
    "check_choice",
    "check_clients",
    "check_epsilon",
    "check_finite",
    "check_generator",
    "check_group_fractions",
    "check_groups_array",
    "check_int",
    "check_int_at_least",
    "check_metric_values",
    "check_nonnegative_finite",
    "check_num_groups",
    "check_open_unit",
    "check_positive_finite",
    "check_unit_values",
    "integer_range",
    "parse_int",
]


def check_positive_finite(name: str, value: float) -> float:
    """Return ``float(value)`` if it is finite and > 0, else raise ``ValueError``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(number) or number <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def check_epsilon(name: str, value: float) -> float:
    """A privacy budget: finite and > 0."""
    return check_positive_finite(name, value)


def check_open_unit(name: str, value: float) -> float:
    """A probability-like level strictly inside (0, 1), e.g. a confidence level."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value!r}") from None
    if not math.isfinite(number) or not 0.0 < number < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value!r}")
    return number


#: The most protected groups the mechanisms and estimators take (the estimators' covariance
#: matrices grow with d^2, and GRR over more categories keeps almost no signal).
MAX_GROUPS = 1024


def integer_range(minimum: int | None = None, maximum: int | None = None) -> str:
    """The allowed integers in words, as every integer error says them: ``"an integer in
    [2, 1024]"``, ``"an integer >= 1"``, ``"an integer <= 9"`` or ``"an integer"``."""
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def _not_an_integer(name: str, value: object, minimum: int | None, maximum: int | None) -> NoReturn:
    raise ValueError(f"{name} must be {integer_range(minimum, maximum)}, got {value!r}")


def _integral(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (numpy's included) or a finite float with an
    integral value; else None (a ``bool``, ``3.5``, NaN, a string, anything else)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` as an ``int`` if it is an integer in ``[minimum, maximum]`` (either
    bound may be None), else raise ``ValueError`` naming ``name`` and the range.

    Accepted: ``int``, numpy integers and finite floats with an integral value (``3.0``).
    Rejected: ``bool``, ``3.5``, NaN and infinities, strings (use :func:`parse_int` for text)
    and anything else.

    >>> check_int("num_groups", 3.0, minimum=2, maximum=1024)
    3
    """
    number = _integral(value)
    if number is None:
        _not_an_integer(name, value, minimum, maximum)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        _not_an_integer(name, value, minimum, maximum)
    return number


def parse_int(
    name: str, text: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """An integer in ``[minimum, maximum]`` from text (a TOML value, an environment variable,
    a command line option), else ``ValueError`` naming ``name`` and the range.

    A string is read without its surrounding spaces as a decimal integer (``"3"``, ``"-2"``)
    or a number whose value is integral (``"3.0"``, ``"1e6"``: the command line has always
    taken ``--clients 1e6``); ``"3.5"``, ``""``, ``"abc"``, ``"nan"`` and ``"inf"`` are
    rejected. Any other value (TOML's typed ``3`` or ``3.0``) goes through :func:`check_int`.

    >>> parse_int("--clients", " 1e6 ", minimum=1)
    1000000
    """
    if not isinstance(text, str):
        return check_int(name, text, minimum=minimum, maximum=maximum)
    stripped = text.strip()
    try:
        number: int | None = int(stripped)
    except ValueError:
        try:
            number = _integral(float(stripped))
        except ValueError:
            number = None
    if number is None:
        _not_an_integer(name, text, minimum, maximum)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        _not_an_integer(name, text, minimum, maximum)
    return number


def check_num_groups(value: int, name: str = "num_groups") -> int:
    """Number of protected groups d: an integer in [2, MAX_GROUPS] (:func:`check_int`)."""
    return check_int(name, value, minimum=2, maximum=MAX_GROUPS)


def check_int_at_least(name: str, value: int, minimum: int) -> int:
    """An integer >= ``minimum`` (:func:`check_int` with a lower bound only)."""
    return check_int(name, value, minimum=minimum)


def check_choice(name: str, value: object, allowed: Iterable[T]) -> T:
    """A string option; the error lists the allowed values."""
    options = tuple(allowed)
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value  # narrowed to T by the membership check


def check_group_fractions(fractions: Iterable[float] | None, num_groups: int) -> np.ndarray:
    """Group fractions: ``num_groups`` positive numbers that sum to 1 (equal if None)."""
    if fractions is None:
        return np.full(num_groups, 1.0 / num_groups)
    array = np.asarray(list(fractions), dtype=np.float64)
    if array.shape != (num_groups,):
        raise ValueError(
            f"group_fractions must have one entry per group ({num_groups}), got {array.size}"
        )
    if not np.all(np.isfinite(array)) or np.any(array <= 0.0):
        raise ValueError("group_fractions must be finite and > 0 for every group")
    if not math.isclose(float(array.sum()), 1.0, rel_tol=0.0, abs_tol=1e-9):
        raise ValueError(f"group_fractions must sum to 1, got {array.sum()!r}")
    return array


def check_groups_array(
    groups: np.ndarray, num_groups: int | None, name: str = "groups"
) -> np.ndarray:
    """Integer group labels in [0, num_groups) (bool, integer or integral float arrays;
    ``num_groups`` None: any label >= 0, returned as int64)."""
    array = np.asarray(groups)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    labels = "labels >= 0" if num_groups is None else f"labels in [0, {num_groups - 1}]"
    if array.dtype == np.bool_:
        array = array.astype(np.int64)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"{name} must hold integer {labels}, got dtype {array.dtype}")
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(array) | (np.mod(array, 1) != 0)
        if bad.any():
            raise ValueError(
                f"{name} must hold integer {labels}; found {array[np.flatnonzero(bad)[0]].item()!r}"
            )
        array = array.astype(np.int64)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or (num_groups is not None and high >= num_groups):
            bad_label = low if low < 0 else high
            if num_groups is None:
                raise ValueError(f"{name} must hold {labels}; found {bad_label}")
            raise ValueError(
                f"{name} must be in [0, {num_groups - 1}] (num_groups={num_groups}); "
                f"found {bad_label}"
            )
    return array if num_groups is not None else array.astype(np.int64)


def check_unit_values(values: np.ndarray, name: str = "values") -> np.ndarray:
    """Performance values v in [-1, 1] (the paper's scale; v = 2 m - 1 for a metric m)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    if array.size:
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{name} must be finite (found NaN or infinity)")
        low, high = float(array.min()), float(array.max())
        if low < -1.0 or high > 1.0:
            bad = low if low < -1.0 else high
            raise ValueError(f"{name} must be in [-1, 1]; found {bad!r}")
    return array


def check_metric_values(metrics: np.ndarray, name: str = "metric") -> np.ndarray:
    """Metric values m in [0, 1] (accuracy, TPR, FPR, ...)."""
    array = np.asarray(metrics, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    if array.size:
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{name} values must be finite numbers in [0, 1] (found NaN/inf)")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            bad = low if low < 0.0 else high
            raise ValueError(f"{name} values must be in [0, 1]; found {bad!r}")
    return array


def check_clients(
    groups: np.ndarray, values: np.ndarray, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Clients' (group, value) pairs: groups in [0, d), values in [-1, 1], equal lengths."""
    groups = check_groups_array(groups, num_groups)
    values = check_unit_values(values)
    if groups.shape != values.shape:
        raise ValueError(
            f"groups and values must have the same length, got {groups.shape[0]} and "
            f"{values.shape[0]}"
        )
    return groups, values


def check_finite(name: str, value: float) -> float:
    """Return ``float(value)`` if it is a finite number, else raise ``ValueError``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def check_nonnegative_finite(name: str, value: float) -> float:
    """Return ``float(value)`` if it is finite and >= 0, else raise ``ValueError``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}") from None
    if not math.isfinite(number) or number < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def check_generator(name: str, value: object) -> np.random.Generator:
    """A ``numpy.random.Generator`` (never the global ``np.random`` state)."""
    if not isinstance(value, np.random.Generator):
        raise ValueError(
            f"{name} must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), "
            f"got {type(value).__name__}"
        )
    return value


def check_binary_array(values: np.ndarray, name: str) -> np.ndarray:
    """A 1-D array of 0/1 values (bool, integer or float 0.0/1.0), returned as int8."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    if array.dtype == np.bool_:
        return array.astype(np.int8)
    if array.size and not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise ValueError(f"{name} must hold 0/1 values, got dtype {array.dtype}")
    if array.size:
        bad = (array != 0) & (array != 1)
        if bad.any():
            raise ValueError(
                f"{name} must hold only 0 and 1; found {array[np.flatnonzero(bad)[0]]!r}"
            )
    return array.astype(np.int8)
