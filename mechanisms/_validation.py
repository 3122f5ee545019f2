"""Argument checks shared by the mechanisms (one place, one wording).

Every public entry point checks its inputs here *before* doing any work and raises a
``ValueError`` that names the parameter and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

T = TypeVar("T", bound=str)


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


def check_num_groups(value: int, name: str = "num_groups") -> int:
    """Number of protected groups d: an integer in [2, MAX_GROUPS]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 2 <= value <= MAX_GROUPS
    ):
        raise ValueError(f"{name} must be an integer in [2, {MAX_GROUPS}], got {value!r}")
    return int(value)


def check_int_at_least(name: str, value: int, minimum: int) -> int:
    """An integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
        if not as_float.is_integer():
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        value = int(as_float)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


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


def check_groups_array(groups: np.ndarray, num_groups: int, name: str = "groups") -> np.ndarray:
    """Integer group labels in [0, num_groups)."""
    array = np.asarray(groups)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating) or not np.all(np.mod(array, 1) == 0):
            raise ValueError(f"{name} must hold integer labels in [0, {num_groups - 1}]")
        array = array.astype(np.int64)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_groups:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name} must be in [0, {num_groups - 1}] (num_groups={num_groups}); found {bad}"
            )
    return array


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
