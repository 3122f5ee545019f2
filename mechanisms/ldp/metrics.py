"""Per-user metrics from prediction rows: accuracy, TPR, FPR and FNR of each user.

The LDP audit perturbs one metric value per user, a performance metric in [0, 1] (Juarez and
Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring Demographic Performance
Disparities in Federated Learning", 2022). These functions compute it from a node's rows
(user, label, prediction) with integer counts, so that a rate is an exact ratio and is NaN
where it is undefined (no samples, no positives or no negatives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..validation import check_int

__all__ = ["METRIC_NAMES", "UNDEFINABLE_METRICS", "MetricName", "UserRates", "user_rates"]

MetricName = Literal["accuracy", "tpr", "fpr", "fnr"]
#: The per-user metrics an audit can ask for.
METRIC_NAMES: tuple[str, ...] = get_args(MetricName)
#: Metrics undefined for some users (TPR and FNR without positives, FPR without negatives).
UNDEFINABLE_METRICS: tuple[str, ...] = ("tpr", "fpr", "fnr")


def _ratio(numerator: NDArray[np.int64], denominator: NDArray[np.int64]) -> NDArray[np.float64]:
    out = np.full(numerator.shape, np.nan, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


@dataclass(frozen=True)
class UserRates:
    """Per-user rates (float64, NaN where undefined) and the counts they come from."""

    accuracy: NDArray[np.float64]
    tpr: NDArray[np.float64]
    fpr: NDArray[np.float64]
    fnr: NDArray[np.float64]
    num_samples: NDArray[np.int64]
    num_positives: NDArray[np.int64]
    num_negatives: NDArray[np.int64]

    def metric(self, name: str) -> NDArray[np.float64]:
        """The per-user array of metric ``name`` (one of :data:`METRIC_NAMES`)."""
        if name not in METRIC_NAMES:
            raise ValueError(
                f"metric must be one of {', '.join(map(repr, METRIC_NAMES))}; got {name!r}"
            )
        return getattr(self, name)


def user_rates(
    user_index: ArrayLike, labels: ArrayLike, predictions: ArrayLike, num_users: int
) -> UserRates:
    """Accuracy, TPR, FPR and FNR of each user from its rows.

    Parameters
    ----------
    user_index : array of int, shape (rows,)
        The row's user, in ``[0, num_users)``.
    labels, predictions : array of bool or {0, 1}, shape (rows,)
        True label and predicted label of each row.
    num_users : int
        Users on the node (users without rows get NaN rates).

    Examples
    --------
    >>> rates = user_rates([0, 0, 1], [1, 0, 1], [1, 1, 0], num_users=2)
    >>> rates.accuracy.tolist(), rates.tpr.tolist(), rates.fpr.tolist()
    ([0.5, 0.0], [1.0, 0.0], [1.0, nan])
    """
    num_users = check_int("num_users", num_users, minimum=0)
    index = np.asarray(user_index)
    if index.ndim != 1 or (index.size and not np.issubdtype(index.dtype, np.integer)):
        raise ValueError("user_index must be a 1-d integer array")
    if index.size and (index.min() < 0 or index.max() >= num_users):
        raise ValueError(f"user_index must lie in [0, {num_users}), got values outside")
    truth = np.asarray(labels)
    predicted = np.asarray(predictions)
    for name, array in (("labels", truth), ("predictions", predicted)):
        if array.shape != index.shape:
            raise ValueError(f"{name} must have shape {index.shape}, got {array.shape}")
        if array.size and not np.isin(array, (0, 1)).all():
            raise ValueError(f"{name} must hold only 0/1 (or booleans)")
    truth = truth.astype(bool)
    predicted = predicted.astype(bool)

    def count(mask: NDArray[np.bool_] | None) -> NDArray[np.int64]:
        return np.bincount(index, weights=mask, minlength=num_users).astype(np.int64)

    num_samples = count(None)
    num_positives = count(truth)
    num_negatives = num_samples - num_positives
    true_positives = count(predicted & truth)
    false_positives = count(predicted & ~truth)
    return UserRates(
        accuracy=_ratio(count(predicted == truth), num_samples),
        tpr=_ratio(true_positives, num_positives),
        fpr=_ratio(false_positives, num_negatives),
        fnr=_ratio(num_positives - true_positives, num_positives),
        num_samples=num_samples,
        num_positives=num_positives,
        num_negatives=num_negatives,
    )
