"""A fixed per-round workload for a node's Poisson cohort, so that the time a round takes does
not tell who was sampled.

A node computes the statistics of ``user_slots`` users over ``sample_slots`` rows in every
round: its real cohort (each user joins with probability ``q``) padded with dummy rows of
weight 0. Only when the cohort is larger than the workload (the tail event, of probability at
most :attr:`CohortWorkload.tail_probability` per round) does the work grow; the privacy ledger
charges that event (:mod:`fedparity.mechanisms.privacy.user_ledger`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..validation import check_open_unit

__all__ = ["CohortWorkload", "cohort_workload", "rows_tail_bound"]


@dataclass(frozen=True)
class CohortWorkload:
    """The rows and user slots a node computes in every round of a training.

    Attributes
    ----------
    user_slots : int
        Users whose statistics are computed every round (real cohort users first, the rest
        dummies of weight 0).
    sample_slots : int
        Rows computed every round (the real cohort's rows, then dummy rows).
    tail_probability : float
        An upper bound on the probability that one round's cohort exceeds the workload
        (more users than ``user_slots`` or more rows than ``sample_slots``): the only rounds
        whose work, and so whose time, depends on the cohort.
    """

    user_slots: int
    sample_slots: int
    tail_probability: float


def _log_mgf_terms(counts: NDArray[np.int64], multiplicity: NDArray[np.int64], q: float):
    log_keep, log_join = math.log1p(-q), math.log(q)

    def log_mgf(lam: float) -> float:
        return float(np.sum(multiplicity * np.logaddexp(log_keep, log_join + lam * counts)))

    return log_mgf


def rows_tail_bound(rows_per_user: ArrayLike, sample_rate: float, threshold: int) -> float:
    """An upper bound on ``P[X >= threshold]`` for the rows ``X = sum_u n_u B_u`` of a Poisson
    cohort (``B_u`` independent Bernoulli(``sample_rate``)): the Chernoff bound
    ``min_{lam > 0} exp(-lam t) prod_u (1 - q + q e^{lam n_u})``.

    Parameters
    ----------
    rows_per_user : array of int
        ``n_u``, the rows of every user of the node (>= 0).
    sample_rate : float
        ``q`` in (0, 1].
    threshold : int
        ``t``.

    Returns
    -------
    float
        The bound in [0, 1]: 1 when ``t`` is at most the mean, 0 when ``t`` exceeds every row.
    """
    counts = np.asarray(rows_per_user, dtype=np.int64)
    q = float(sample_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    total = int(counts.sum())
    if threshold > total:
        return 0.0
    if q == 1.0 or threshold <= q * total:
        return 1.0
    from scipy import optimize  # not at import: a node that only audits loads no SciPy

    values, multiplicity = np.unique(counts[counts > 0], return_counts=True)
    log_mgf = _log_mgf_terms(values, multiplicity, q)
    # The exponent is convex in lam; its minimiser lies where the tilted mean reaches t, below
    # lam_max = log(t (1 - q) / (q (N - t))) / min(n) + 1 (a generous bracket).
    upper = max(1.0, math.log(threshold * (1 - q) / (q * max(total - threshold, 0.5))) + 1.0)
    found = optimize.minimize_scalar(
        lambda lam: log_mgf(lam) - lam * threshold,
        bounds=(0.0, upper),
        method="bounded",
        options={"xatol": 1e-10},
    )
    return float(min(1.0, math.exp(min(0.0, found.fun))))


def cohort_workload(
    rows_per_user: ArrayLike, sample_rate: float, tail_probability: float
) -> CohortWorkload:
    """The smallest fixed workload whose per-round tail is at most ``tail_probability`` (half
    for the users, half for the rows).

    Parameters
    ----------
    rows_per_user : array of int
        The rows of every user of the node (the shard's layout).
    sample_rate : float
        ``q``, each user's chance of joining a round, in (0, 1].
    tail_probability : float
        The largest allowed chance, per round, that the cohort exceeds the workload, in
        [0, 1); 0 gives every user and every row (no tail at all).

    Returns
    -------
    CohortWorkload
        ``user_slots`` from the exact binomial tail, ``sample_slots`` from
        :func:`rows_tail_bound`, and their combined per-round tail.

    Examples
    --------
    >>> one = cohort_workload([3], 0.01, 1e-12)  # a one-user device: always its user
    >>> one.user_slots, one.sample_slots, one.tail_probability
    (1, 3, 0.0)
    """
    counts = np.asarray(rows_per_user)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("rows_per_user must be a non-empty 1-d array of integers")
    if counts.min() < 0:
        raise ValueError("rows_per_user must be >= 0")
    counts = counts.astype(np.int64)
    q = float(sample_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if tail_probability != 0.0:
        check_open_unit("tail_probability", tail_probability)
    users, rows = int(counts.size), int(counts.sum())
    half = tail_probability / 2.0
    if half == 0.0 or q == 1.0:
        return CohortWorkload(users, rows, 0.0)

    from scipy import stats

    def users_tail(slots: int) -> float:
        return 0.0 if slots >= users else float(stats.binom.sf(slots, users, q))

    def rows_tail(slots: int) -> float:
        return rows_tail_bound(counts, q, slots + 1)

    user_slots = _smallest(users_tail, math.floor(q * users), users, half)
    sample_slots = _smallest(rows_tail, math.floor(q * rows), rows, half)
    return CohortWorkload(
        user_slots, sample_slots, min(1.0, users_tail(user_slots) + rows_tail(sample_slots))
    )


def _smallest(tail, low: int, high: int, target: float) -> int:
    """The smallest ``s`` in [low, high] with ``tail(s) <= target`` (``tail`` decreasing,
    ``tail(high) == 0``)."""
    if tail(low) <= target:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        if tail(middle) <= target:
            high = middle
        else:
            low = middle
    return high
