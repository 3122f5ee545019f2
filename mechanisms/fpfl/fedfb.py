"""FedFB's group reweighting as a server-side update on FPFL's released sums.

Yuchen Zeng, Hongxu Chen and Kangwook Lee, "Improving Fairness via Federated Learning",
arXiv:2110.15545, 2021 (Zeng et al. 2021, or FedFB, below) make FairBatch (Yuji Roh, Kangwook
Lee, Steven Euijong Whang and Changho Suh, "FairBatch: Batch Selection for Model Fairness",
ICLR 2021) federated: the server keeps group weights ``lambda``, the model is trained on the
``lambda``-reweighted loss, and after every round the server moves ``lambda`` toward the group
whose loss is higher, by a step ``alpha`` in the direction ``mu / ||mu||_2`` of the groups'
loss differences, projected back onto ``lambda``'s feasible set (FedFB, Algorithm 1 and the
update of ``lambda`` in Section 4; FairBatch, Section 3).

Here the released statistics are the noisy, clipped, masked sum of the users' FPFL vectors
(:class:`~fedparity.mechanisms.fpfl.mmdm.StatisticsLayout`), so FedFB needs no node or wire
change: it is one more update rule on those sums, beside MMDM and FederatedSGD. With ``q`` the
group weights on the simplex (``sum_a q_a = 1``) over the constraint's sample set ``d'`` (FNR
parity: the positives, FairBatch's equal-opportunity case; accuracy parity: all samples),
``n'_a`` the group's count, ``n' = sum_a n'_a`` and ``r_a = F_a / n'_a`` the group's surrogate
risk on ``d'_a``::

    mu_a = r_a - mean_b r_b,        q <- Proj_simplex(q + alpha mu / ||mu||_2)
    direction = grad L / n + sum_a (n' q_a - n'_a) / n * grad F_a / n'_a
    w <- w - eta direction

The second line is the gradient of ``L / n + sum_a (lambda_a - n'_a / n) r_a`` with
``lambda_a = (n' / n) q_a``: the natural weight ``n'_a / n`` of group ``a``'s risk in the
average loss is replaced by ``lambda_a``, and the total weight of ``d'`` stays ``n' / n``
(FairBatch keeps the label proportions and reweights the groups inside a label). The
statistic vector carries each group's surrogate ``F_a`` and its gradient, not the group's
loss, so the surrogate risk stands in for the group loss FedFB reweights (for FNR parity
``F_a`` sums ``1 - P(y = 1)`` over the group's positives, which falls as their loss falls).

Differences from the paper, on purpose: one gradient step per round (FederatedSGD, the FPFL
protocol's structure) instead of local epochs; the groups' risks are means (``F_a / n'_a``,
as in FairBatch), not sums; ``lambda`` starts at the data's proportions as in FairBatch, read
from the first round's (noisy) counts; noisy counts below ``min_count`` make a group's risk
undefined for that round, and then the group keeps its weight and takes no part in the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..validation import check_positive_finite
from .mmdm import AggregateStatistics, _check_vector

__all__ = [
    "FedFBConfig",
    "FedFBUpdate",
    "fedfb_update",
    "initial_group_weights",
    "project_to_simplex",
]

FloatArray = NDArray[np.float64]
#: How far group weights may leave the simplex before they are refused (rounding only).
SIMPLEX_TOLERANCE = 1e-9


@dataclass(frozen=True)
class FedFBConfig:
    """Hyper-parameters of :func:`fedfb_update`.

    Parameters
    ----------
    step : float
        ``alpha`` in (0, 1), the group weights' step size (FedFB's and FairBatch's ``alpha``;
        FairBatch's default is 0.005). One step moves ``q`` by at most ``alpha`` (L2).
    learning_rate : float
        ``eta`` (> 0), the model parameters' step size.
    min_count : float
        Smallest usable denominator (> 0), as in
        :class:`~fedparity.mechanisms.fpfl.mmdm.MMDMConfig`: a group whose noisy ``n'_a`` is
        below it has no defined risk this round; a noisy ``n`` is clamped to at least it.
    """

    step: float = 0.005
    learning_rate: float = 0.1
    min_count: float = 1.0

    def __post_init__(self) -> None:
        step = float(self.step)
        if not 0.0 < step < 1.0:  # NaN fails too
            raise ValueError(f"step must be in (0, 1), got {self.step!r}")
        object.__setattr__(self, "step", step)
        object.__setattr__(
            self, "learning_rate", check_positive_finite("learning_rate", self.learning_rate)
        )
        object.__setattr__(self, "min_count", check_positive_finite("min_count", self.min_count))


@dataclass(frozen=True, eq=False)
class FedFBUpdate:
    """One FedFB step.

    Attributes
    ----------
    weights : (p,)
        ``w - eta * direction``.
    group_weights : (G,)
        The new ``q`` (on the simplex).
    direction : (p,)
        ``grad L / n + coefficients @ (grad F_a / n'_a)``.
    loss_gradient : (p,)
        ``grad L / n``.
    group_risks : (G,)
        ``r_a = F_a / n'_a`` at the old weights (NaN where undefined).
    defined : (G,) bool
        ``n'_a >= min_count``.
    coefficients : (G,)
        ``(n' q_a - n'_a) / n`` with the new ``q``, ``n'`` and ``q`` taken over the defined
        groups (``q`` renormalised to sum 1 there); 0 where undefined; they sum to 0.
    """

    weights: FloatArray
    group_weights: FloatArray
    direction: FloatArray
    loss_gradient: FloatArray
    group_risks: FloatArray
    defined: NDArray[np.bool_]
    coefficients: FloatArray


def project_to_simplex(values: NDArray[np.floating], mass: float = 1.0) -> FloatArray:
    """Euclidean projection of ``values`` onto ``{x >= 0, sum x = mass}`` (``mass`` > 0).

    The sort-based algorithm of J. Duchi, S. Shalev-Shwartz, Y. Singer and T. Chandra,
    "Efficient Projections onto the l1-Ball for Learning in High Dimensions", ICML 2008,
    Figure 1.
    """
    mass = check_positive_finite("mass", mass)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)):
        raise ValueError(f"values must be a finite non-empty 1-D array, got shape {v.shape}")
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - mass
    index = np.arange(1, v.size + 1)
    rho = int(np.nonzero(u - cumulative / index > 0)[0][-1])
    theta = cumulative[rho] / (rho + 1)
    return np.maximum(v - theta, 0.0)


def _check_group_weights(group_weights: NDArray[np.floating], num_groups: int) -> FloatArray:
    q = _check_vector("group_weights", group_weights, num_groups)
    if q.min() < -SIMPLEX_TOLERANCE or abs(q.sum() - 1.0) > SIMPLEX_TOLERANCE:
        raise ValueError(f"group_weights must be >= 0 and sum to 1 (the simplex), got {q.tolist()}")
    return np.maximum(q, 0.0)


def initial_group_weights(stats: AggregateStatistics, min_count: float = 1.0) -> FloatArray:
    """FairBatch's start, the data's proportions: ``q_a`` proportional to
    ``max(n'_a, min_count)`` from (noisy) counts."""
    min_count = check_positive_finite("min_count", min_count)
    counts = np.maximum(stats.constraint_counts, min_count)
    return counts / counts.sum()


def fedfb_update(
    weights: NDArray[np.floating],
    group_weights: NDArray[np.floating] | None,
    stats: AggregateStatistics,
    config: FedFBConfig,
) -> FedFBUpdate:
    """FedFB's step from aggregated (possibly noisy) statistics: ``q`` first, then ``w``.

    ``group_weights = None`` starts from :func:`initial_group_weights` of ``stats``. The
    order (``lambda`` from the risks at the current model, then the model step with the new
    ``lambda``) is FedFB's Algorithm 1 and FairBatch's. Fewer than two defined groups: ``q``
    does not move, and the model step is the reweighted one over the defined group (plain
    ``grad L / n`` if none is defined).

    References
    ----------
    .. [1] Y. Zeng, H. Chen and K. Lee, "Improving Fairness via Federated Learning",
           arXiv:2110.15545, 2021. Algorithm 1 and the update of lambda (Section 4).
    .. [2] Y. Roh, K. Lee, S. E. Whang and C. Suh, "FairBatch: Batch Selection for Model
           Fairness", ICLR 2021. Section 3 (equal opportunity).
    """
    layout = stats.layout
    weights = _check_vector("weights", weights, layout.num_params)
    if group_weights is None:
        q = initial_group_weights(stats, config.min_count)
    else:
        q = _check_group_weights(group_weights, layout.num_groups)
    counts = stats.constraint_counts
    defined = counts >= config.min_count
    safe_counts = np.where(defined, counts, 1.0)
    risks = np.where(defined, stats.surrogate_sums / safe_counts, math.nan)
    new_q = q.copy()
    if defined.sum() >= 2:
        mu = risks[defined] - risks[defined].mean()
        norm = float(np.linalg.norm(mu))
        mass = float(q[defined].sum())
        if norm > 0 and mass > 0:
            new_q[defined] = project_to_simplex(q[defined] + config.step * mu / norm, mass)
    n = max(stats.num_samples, config.min_count)
    coefficients = np.zeros(layout.num_groups)
    share = float(new_q[defined].sum())
    if share > 0:
        constraint_total = float(counts[defined].sum())
        coefficients[defined] = (constraint_total * new_q[defined] / share - counts[defined]) / n
    loss_gradient = stats.loss_grad / n
    group_gradients = stats.surrogate_grads / safe_counts[:, None]
    direction = loss_gradient + coefficients @ group_gradients
    return FedFBUpdate(
        weights=weights - config.learning_rate * direction,
        group_weights=new_q,
        direction=direction,
        loss_gradient=loss_gradient,
        group_risks=risks,
        defined=defined,
        coefficients=coefficients,
    )
