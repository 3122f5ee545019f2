"""FairFed's fairness-aware aggregation weights, with the per-node statistics it reads
released under user-level DP.

Yahya H. Ezzeldin, Shen Yan, Chaoyang He, Emilio Ferrara and Salman Avestimehr, "FairFed:
Enabling Group Fairness in Federated Learning", AAAI 2023 (Ezzeldin et al. 2023, or FairFed,
below), Algorithm 1: the server keeps a weight ``omega_k`` per node (``n_k / n`` at the start)
and after every round moves it against the distance between the node's local fairness and the
global one::

    Delta_k = |F_global - F_k|              (|Acc_global - Acc_k| where F_k is undefined)
    omega_k <- omega_k - beta (Delta_k - mean_i Delta_i),   omega <- omega / sum_i omega_i

and the global model is the ``omega``-weighted average of the nodes' models. ``F`` is the
group metric gap (FairFed's equal-opportunity or demographic-parity difference); here the
constraint's error-rate differences ``F_a = e_a / n'_a - e_1 / n'_1`` for the groups ``a`` after
the first (one number, FairFed's, with two groups; the largest of them with more), so that
FNR parity is FairFed's equal opportunity and accuracy parity its accuracy difference.

**What is released, and its privacy.** FairFed needs each node's own ``F_k``, which FPFL's
secure sum does not release. Each node therefore releases, beside its share of the sum, the
counting block of its cohort's clipped statistic vectors (:data:`RELEASE_BLOCKS`: the group
counts, errors, surrogate sums, sample count, errors and loss; ``3 G + 3`` numbers, no
gradient) with its own full Gaussian noise ``N(0, (C sigma_release)^2)``. Each user's block is
part of its clipped vector, so its L2 norm is at most ``C``. The pair (the sum with noise
``C sigma_sum``, the node's block with noise ``C sigma_release``) is one Gaussian mechanism on
the same Poisson cohort with noise multiplier
``(sigma_sum^-2 + sigma_release^-2)^(-1/2)`` (scale each part by its noise; the sensitivities
add in squares), so :func:`release_noise_multipliers` splits the run's accounted ``sigma`` into
the two without changing epsilon: a share ``phi`` of ``1 / sigma^2`` goes to the releases.

**The weights on the wire.** FairFed averages the nodes' *models*; FPFL's round is one
gradient step on the sum of the users' vectors. Node ``k`` multiplies its clipped sum by its
scale ``s_k = r_k / max_i r_i`` in ``[0, 1]`` (:func:`node_scales`, ``r_k = omega_k /
omega_k^0``) before adding its noise share, and the server divides the released loss gradient
by the released (equally scaled) sample count: ``sum_k s_k L_k / sum_k s_k n_k``, which is the
``omega``-weighted average of the nodes' mean gradients, FairFed's aggregate. A scale in
``[0, 1]`` keeps every user's contribution within ``C`` whatever the server sends; the node
refuses any other.

Differences from the paper, on purpose: no local debiasing on the nodes (FairFed pairs its
weights with local reweighting or FairBatch; here they act alone, on one gradient step per
round); the weights after round ``t`` use the statistics of round ``t`` and scale round
``t + 1`` (one exchange per round); ``omega`` is clipped at 0 before it is normalised (the paper
leaves negative weights undefined); ``omega^0`` comes from the first round's noisy sample counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..validation import check_int_at_least, check_positive_finite
from .mmdm import AggregateStatistics, StatisticsLayout, cohort_metrics

__all__ = [
    "RELEASE_BLOCKS",
    "FairFedConfig",
    "FairFedStep",
    "combined_noise_multiplier",
    "fairfed_step",
    "initial_node_weights",
    "local_fairness",
    "node_scales",
    "release_indices",
    "release_noise_multipliers",
    "release_size",
    "release_statistics",
]

FloatArray = NDArray[np.float64]

#: The blocks of :class:`~fedparity.mechanisms.fpfl.mmdm.StatisticsLayout` a node releases on
#: its own (everything but the gradients).
RELEASE_BLOCKS = (
    "surrogate_sums",
    "constraint_counts",
    "num_samples",
    "num_errors",
    "group_errors",
    "loss_sum",
)


@dataclass(frozen=True)
class FairFedConfig:
    """Hyper-parameters of :func:`fairfed_step`.

    Parameters
    ----------
    beta : float
        FairFed's ``beta`` (> 0): how far one round moves a node's weight per unit of its
        fairness distance above the mean.
    min_count : float
        Smallest usable (noisy) count (> 0): a node whose group counts fall below it has no
        defined ``F_k`` this round (its accuracy gap is used, as in FairFed); a node whose
        sample count falls below it keeps its weight.
    """

    beta: float = 0.1
    min_count: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", check_positive_finite("beta", self.beta))
        object.__setattr__(self, "min_count", check_positive_finite("min_count", self.min_count))


@dataclass(frozen=True, eq=False)
class FairFedStep:
    """One update of the node weights.

    Attributes
    ----------
    weights : (K,)
        The new ``omega`` (>= 0, sums to 1).
    distances : (K,)
        ``Delta_k`` (NaN where the node had no usable statistics; it kept its weight).
    global_fairness : (G - 1,)
        ``F_global`` (NaN where a group is undefined in the pooled statistics).
    used_accuracy : (K,) bool
        Nodes whose ``Delta_k`` is the accuracy gap (``F_k`` undefined).
    """

    weights: FloatArray
    distances: FloatArray
    global_fairness: FloatArray
    used_accuracy: NDArray[np.bool_]


def release_noise_multipliers(noise_multiplier: float, release_share: float) -> tuple[float, float]:
    """``(sigma_sum, sigma_release)`` whose joint mechanism has noise multiplier
    ``noise_multiplier``: ``sigma_sum = sigma / sqrt(1 - phi)``, ``sigma_release = sigma /
    sqrt(phi)`` with ``phi = release_share`` in (0, 1)."""
    sigma = check_positive_finite("noise_multiplier", noise_multiplier)
    share = float(release_share)
    if not 0.0 < share < 1.0:  # NaN fails too
        raise ValueError(f"release_share must be in (0, 1), got {release_share!r}")
    return sigma / math.sqrt(1.0 - share), sigma / math.sqrt(share)


def combined_noise_multiplier(*noise_multipliers: float) -> float:
    """The noise multiplier of Gaussian mechanisms on the same users with the same
    sensitivity, released together: ``(sum_j sigma_j^-2)^(-1/2)``."""
    if not noise_multipliers:
        raise ValueError("noise_multipliers must name at least one mechanism")
    sigmas = [check_positive_finite("noise_multiplier", s) for s in noise_multipliers]
    return 1.0 / math.sqrt(sum(1.0 / s**2 for s in sigmas))


def release_size(num_groups: int) -> int:
    """How many numbers a node releases: ``3 G + 3`` (:data:`RELEASE_BLOCKS`)."""
    return 3 * check_int_at_least("num_groups", num_groups, 2) + 3


def release_indices(layout: StatisticsLayout) -> NDArray[np.intp]:
    """Positions of :data:`RELEASE_BLOCKS` in the statistic vector (``3 G + 3`` of them)."""
    return np.concatenate(
        [np.arange(layout.size)[layout.block(name)] for name in RELEASE_BLOCKS]
    ).astype(np.intp)


def release_statistics(
    layout: StatisticsLayout, release: NDArray[np.floating]
) -> AggregateStatistics:
    """A node's release read as :class:`AggregateStatistics` (gradients zero)."""
    indices = release_indices(layout)
    values = np.asarray(release, dtype=np.float64)
    if values.shape != indices.shape:
        raise ValueError(f"release must have shape {indices.shape}, got {values.shape}")
    vector = np.zeros(layout.size)
    vector[indices] = values
    return layout.split(vector)


def local_fairness(stats: AggregateStatistics, min_count: float = 1.0) -> tuple[FloatArray, float]:
    """``(F, accuracy)``: the error-rate differences ``e_a / n'_a - e_1 / n'_1`` (groups after
    the first; NaN where a group's count is below ``min_count``) and the accuracy."""
    metrics = cohort_metrics(stats, 0.0, min_count=min_count)
    rates = metrics.group_error_rates
    return rates[1:] - rates[0], float(metrics.accuracy)


def fairfed_step(
    weights: NDArray[np.floating],
    releases: NDArray[np.floating],
    config: FairFedConfig,
    layout: StatisticsLayout,
) -> FairFedStep:
    """FairFed's weight update (Ezzeldin et al. 2023, Algorithm 1) from the nodes' released
    statistics ``releases`` (``(K, 3 G + 3)``, one row per node, in the order of
    ``weights``; a row of NaN: the node sent none); ``F_global`` and ``Acc_global`` come
    from the sum of the others.

    A node without usable statistics (no release, noisy sample count below ``min_count``, or
    neither its fairness nor its accuracy defined) keeps its weight and takes no part in the
    mean.
    """
    omega = np.asarray(weights, dtype=np.float64)
    rows = np.asarray(releases, dtype=np.float64)
    if omega.ndim != 1 or omega.size == 0 or not np.all(np.isfinite(omega)) or omega.min() < 0:
        raise ValueError("weights must be a non-empty 1-D array of finite numbers >= 0")
    if not math.isclose(float(omega.sum()), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"weights must sum to 1, got {float(omega.sum())!r}")
    width = release_indices(layout).size
    if rows.shape != (omega.size, width):
        raise ValueError(f"releases must have shape ({omega.size}, {width}), got {rows.shape}")
    present = np.all(np.isfinite(rows), axis=1)
    if not np.all(np.isnan(rows[~present])):  # a row is all finite or all NaN
        raise ValueError("releases must be finite rows, or rows of NaN for nodes without one")
    pooled, pooled_accuracy = local_fairness(
        release_statistics(layout, rows[present].sum(axis=0)), config.min_count
    )
    distances = np.full(omega.size, math.nan)
    used_accuracy = np.zeros(omega.size, dtype=bool)
    for k in np.flatnonzero(present):
        stats = release_statistics(layout, rows[k])
        if stats.num_samples < config.min_count:
            continue
        fairness, accuracy = local_fairness(stats, config.min_count)
        if np.all(np.isfinite(fairness)) and np.all(np.isfinite(pooled)):
            distances[k] = float(np.max(np.abs(fairness - pooled)))
        elif math.isfinite(accuracy) and math.isfinite(pooled_accuracy):
            distances[k] = abs(pooled_accuracy - accuracy)
            used_accuracy[k] = True
    usable = np.isfinite(distances)
    new = omega.copy()
    if usable.any():
        mean = float(distances[usable].mean())
        new[usable] = np.maximum(omega[usable] - config.beta * (distances[usable] - mean), 0.0)
    total = float(new.sum())
    new = new / total if total > 0 else omega.copy()
    return FairFedStep(
        weights=new,
        distances=distances,
        global_fairness=pooled,
        used_accuracy=used_accuracy,
    )


def initial_node_weights(
    releases: NDArray[np.floating], config: FairFedConfig, layout: StatisticsLayout
) -> FloatArray:
    """FairFed's start ``omega_k^0 = n_k / n`` from the nodes' released (noisy) sample counts
    (rows as in :func:`fairfed_step`), each at least ``min_count``; a node without a release
    counts as the median of the others."""
    rows = np.asarray(releases, dtype=np.float64)
    width = release_indices(layout).size
    if rows.ndim != 2 or rows.shape[1] != width or rows.shape[0] == 0:
        raise ValueError(f"releases must have shape (K, {width}) with K >= 1, got {rows.shape}")
    column = int(np.flatnonzero(release_indices(layout) == layout.block("num_samples").start)[0])
    present = np.all(np.isfinite(rows), axis=1)
    counts = np.where(present, rows[:, column], np.nan)
    fallback = float(np.median(counts[present])) if present.any() else config.min_count
    counts = np.maximum(np.where(present, counts, fallback), config.min_count)
    return np.asarray(counts / counts.sum(), dtype=np.float64)


def node_scales(weights: NDArray[np.floating], base_weights: NDArray[np.floating]) -> FloatArray:
    """``s_k = r_k / max_i r_i`` with ``r_k = omega_k / omega_k^0``: the factors in [0, 1] the
    nodes multiply their clipped sums by, so that the released sum divided by its (equally
    scaled) count is the ``omega``-weighted mean of the nodes' mean gradients."""
    omega = np.asarray(weights, dtype=np.float64)
    base = np.asarray(base_weights, dtype=np.float64)
    if omega.shape != base.shape or omega.ndim != 1:
        raise ValueError("weights and base_weights must be 1-D arrays of the same length")
    if not (np.all(np.isfinite(base)) and np.all(base > 0)):
        raise ValueError("base_weights must be finite and > 0")
    if not (np.all(np.isfinite(omega)) and np.all(omega >= 0)):
        raise ValueError("weights must be finite and >= 0")
    ratios = omega / base
    largest = float(ratios.max())
    if largest <= 0:
        raise ValueError("weights must not all be 0")
    return np.asarray(np.clip(ratios / largest, 0.0, 1.0), dtype=np.float64)
