"""MMDM updates for fairness-constrained learning from aggregated statistics (FPFL).

Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing fairness
in private federated learning via the modified method of differential multipliers", NeurIPS
2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021 (Rodriguez-Galvez et al.
2021, or FPFL, below; equation numbers are the paper's).

Problem (P2) of the paper: minimise ``L(d, w) / n`` subject to, for every group ``a``::

    | F(d', w) / n'  -  F(d'_a, w) / n'_a |  <=  alpha

where ``F`` sums a differentiable surrogate of the fairness function over the constraint's
sample set ``d'`` (FNR parity: the samples with ``y = 1``; accuracy parity: all samples) and
``d'_a`` is the part of ``d'`` in group ``a``. The modified method of differential multipliers
(MMDM, Platt and Barr 1987) gives the updates of Eq. (9)-(11)::

    h_a = |F/n' - F_a/n'_a| - alpha,      g_a = max(h_a, 0)
    grad g_a = sign(F/n' - F_a/n'_a) (grad F/n' - grad F_a/n'_a)   if h_a >= 0, else 0
    lambda <- lambda + gamma g
    w      <- w - eta (grad L/n + lambda^T grad g + c g^T grad g)

Everything here works on the *sum* of the users' sufficient-statistic vectors (Eq. 17/18),
possibly with Gaussian noise added (Algorithm 1), so the same code serves the central trainer,
the federated server and tests. The per-user vectors themselves are computed by
``clients.fpfl_task`` (torch); this module is pure numpy.

Vector layout (:class:`StatisticsLayout`, ``p`` parameters, ``G`` groups)::

    [ grad L (p) | F_a (G) | grad F_a (G x p, group-major) | n'_a (G) | n | errors | e_a (G) | L ]

The first four blocks are Eq. (17). The last three serve model selection and are not in the
paper's vector (the user's sample count and error counts, appended to the same vector so that
the same clipping and noise cover them): ``n``
the number of samples (also the denominator of ``grad L / n``), ``errors`` the number of
misclassified samples, ``e_a`` the number of misclassified samples in ``d'_a`` and ``L`` the
summed loss (for the progress display: the cohort loss ``L / n``). Error
counts carry the same information as correct counts (``correct = n - errors``) but are small
for a good model, so they add less to the norm that is clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from ..validation import (
    check_generator,
    check_int_at_least,
    check_nonnegative_finite,
    check_positive_finite,
)

__all__ = [
    "CONSTRAINTS",
    "CONSTRAINT_ACTIVATIONS",
    "AggregateStatistics",
    "CohortMetrics",
    "ConstraintEvaluation",
    "FairnessGaps",
    "MMDMConfig",
    "MMDMUpdate",
    "ModelSelector",
    "NoisySum",
    "SelectionCandidate",
    "StatisticsLayout",
    "cohort_metrics",
    "evaluate_constraints",
    "exponential_average",
    "fairness_gaps",
    "mmdm_update",
    "privatize_sum",
    "sgd_update",
    "with_constraint_terms",
]

FloatArray = NDArray[np.float64]
#: The fairness constraints (Rodriguez-Galvez et al. 2021, Section 3.1 and Eq. 13-14): FNR
#: parity (equal opportunity, binary) and accuracy parity.
Constraint = Literal["fnr", "accuracy"]
CONSTRAINTS: tuple[Constraint, ...] = ("fnr", "accuracy")
#: What decides the active constraints and their size: see :func:`evaluate_constraints`.
CONSTRAINT_ACTIVATIONS = ("surrogate", "counts")


# --------------------------------------------------------------------------------------------
# Vector layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatisticsLayout:
    """Positions of the blocks of a sufficient-statistic vector (Eq. 17 plus selection counts).

    Parameters
    ----------
    num_params : int
        Number of model parameters ``p`` (>= 1).
    num_groups : int
        Number of groups ``G`` (>= 2).

    References
    ----------
    .. [1] B. Rodriguez-Galvez, F. Granqvist, R. van Dalen and M. Seigel, "Enforcing
           fairness in private federated learning via the modified method of differential
           multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
           arXiv:2109.08604, 2021. Eq. (17) and Algorithm 1.

    Examples
    --------
    >>> StatisticsLayout(num_params=3, num_groups=2).size  # (G + 1) p + 3 G + 3
    18
    """

    num_params: int
    num_groups: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_params", check_int_at_least("num_params", self.num_params, 1))
        object.__setattr__(self, "num_groups", check_int_at_least("num_groups", self.num_groups, 2))

    @property
    def size(self) -> int:
        """Length of the vector: ``(G + 1) p + 3 G + 3``."""
        return (self.num_groups + 1) * self.num_params + 3 * self.num_groups + 3

    def _bounds(self) -> dict[str, tuple[int, int]]:
        p, g = self.num_params, self.num_groups
        sizes = (
            ("loss_grad", p),
            ("surrogate_sums", g),
            ("surrogate_grads", g * p),
            ("constraint_counts", g),
            ("num_samples", 1),
            ("num_errors", 1),
            ("group_errors", g),
            ("loss_sum", 1),
        )
        bounds: dict[str, tuple[int, int]] = {}
        start = 0
        for name, length in sizes:
            bounds[name] = (start, start + length)
            start += length
        return bounds

    def block(self, name: str) -> slice:
        """The slice of block ``name`` (one of the :class:`AggregateStatistics` fields)."""
        bounds = self._bounds()
        if name not in bounds:
            raise ValueError(f"name must be one of {', '.join(map(repr, bounds))}; got {name!r}")
        return slice(*bounds[name])

    def split(self, vector: NDArray[np.floating]) -> AggregateStatistics:
        """Read a summed (possibly noisy) vector into :class:`AggregateStatistics`."""
        array = np.asarray(vector, dtype=np.float64)
        if array.shape != (self.size,):
            raise ValueError(
                f"vector must have shape ({self.size},) for num_params={self.num_params}, "
                f"num_groups={self.num_groups}; got {array.shape}"
            )
        if not np.all(np.isfinite(array)):
            raise ValueError("vector must be finite (found NaN or infinity)")
        b = self._bounds()

        def take(name: str) -> FloatArray:
            return array[slice(*b[name])].copy()

        return AggregateStatistics(
            loss_grad=take("loss_grad"),
            surrogate_sums=take("surrogate_sums"),
            surrogate_grads=take("surrogate_grads").reshape(self.num_groups, self.num_params),
            constraint_counts=take("constraint_counts"),
            num_samples=float(array[b["num_samples"][0]]),
            num_errors=float(array[b["num_errors"][0]]),
            group_errors=take("group_errors"),
            loss_sum=float(array[b["loss_sum"][0]]),
        )


@dataclass(frozen=True, eq=False)
class AggregateStatistics:
    """Sufficient statistics of a set of samples (a cohort sum, Eq. 18, or pooled data).

    Attributes
    ----------
    loss_grad : (p,)
        ``grad_w L(b, w)``: the gradient of the *summed* loss.
    surrogate_sums : (G,)
        ``F(b'_a, w)``: the surrogate summed over the group's constraint samples.
    surrogate_grads : (G, p)
        ``grad_w F(b'_a, w)``.
    constraint_counts : (G,)
        ``n'_a = |b'_a|``.
    num_samples : float
        ``n = |b|``.
    num_errors : float
        Misclassified samples in ``b``.
    group_errors : (G,)
        Misclassified samples in ``b'_a``.
    loss_sum : float
        ``L(b, w)``, the summed loss (0 where not computed).
    """

    loss_grad: FloatArray
    surrogate_sums: FloatArray
    surrogate_grads: FloatArray
    constraint_counts: FloatArray
    num_samples: float
    num_errors: float
    group_errors: FloatArray
    loss_sum: float = 0.0

    @property
    def layout(self) -> StatisticsLayout:
        """The layout these statistics belong to."""
        return StatisticsLayout(
            num_params=int(self.loss_grad.shape[0]),
            num_groups=int(self.surrogate_sums.shape[0]),
        )

    def to_vector(self) -> FloatArray:
        """The flat vector in :class:`StatisticsLayout` order (inverse of ``split``)."""
        return np.concatenate(
            [
                self.loss_grad,
                self.surrogate_sums,
                self.surrogate_grads.reshape(-1),
                self.constraint_counts,
                [self.num_samples, self.num_errors],
                self.group_errors,
                [self.loss_sum],
            ]
        ).astype(np.float64)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MMDMConfig:
    """Hyper-parameters of the MMDM updates, Eq. (10). Defaults: paper's Adult setting.

    Parameters
    ----------
    alpha : float
        Constraint tolerance (>= 0); 0.02 for FNR parity on Adult, 0.04 for accuracy parity on
        unfair FEMNIST.
    learning_rate : float
        ``eta`` (> 0), the model parameters' step size.
    multiplier_learning_rate : float
        ``gamma`` (> 0), the Lagrange multipliers' step size.
    damping : float
        ``c`` (>= 0); ``c = 0`` is the basic method of differential multipliers.
    min_count : float
        Smallest usable denominator (> 0). A group whose (possibly noisy) ``n'_a`` is below it
        has no defined rate: its constraint is inactive for that update. Noisy ``n`` and
        ``n'`` are clamped to at least ``min_count``.
    activation : ``"surrogate"`` | ``"counts"``
        What decides ``h``, ``g`` and the sign of ``grad g`` (:func:`evaluate_constraints`):
        the surrogate rates ``F_a / n'_a`` (the paper's Eq. 11) or the hard rates
        ``e_a / n'_a`` from the error counts (proxy-Lagrangian); the gradient direction is
        the surrogate's in both cases.
    error_surrogate : bool
        The surrogate measures errors (FNR parity: ``1 - psi`` over the positives), so it
        grows with ``e_a``; False for accuracy parity (``psi^T onehot(y)`` measures correct
        predictions), where the hard error-rate difference has the opposite sign. Used only
        with ``activation = "counts"``.
    """

    alpha: float = 0.02
    learning_rate: float = 0.1
    multiplier_learning_rate: float = 0.01
    damping: float = 2.0
    min_count: float = 1.0
    activation: str = "surrogate"
    error_surrogate: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_nonnegative_finite("alpha", self.alpha))
        object.__setattr__(
            self, "learning_rate", check_positive_finite("learning_rate", self.learning_rate)
        )
        object.__setattr__(
            self,
            "multiplier_learning_rate",
            check_positive_finite("multiplier_learning_rate", self.multiplier_learning_rate),
        )
        object.__setattr__(self, "damping", check_nonnegative_finite("damping", self.damping))
        object.__setattr__(self, "min_count", check_positive_finite("min_count", self.min_count))
        if self.activation not in CONSTRAINT_ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(CONSTRAINT_ACTIVATIONS)}; "
                f"got {self.activation!r}"
            )


# --------------------------------------------------------------------------------------------
# Constraint evaluation, Eq. (9) and (11)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ConstraintEvaluation:
    """The constraint terms of Eq. (9) and (11) at the current model.

    Attributes
    ----------
    overall_rate : float
        ``F / n'`` (NaN if ``n' < min_count``).
    group_rates : (G,)
        ``F_a / n'_a`` (NaN where undefined).
    differences : (G,)
        ``F/n' - F_a/n'_a`` (0 where undefined).
    violations : (G,)
        ``h_a = |F/n' - F_a/n'_a| - alpha`` (``-alpha`` where undefined).
    values : (G,)
        ``g_a = max(h_a, 0)``.
    active : (G,) bool
        ``h_a >= 0`` and defined.
    defined : (G,) bool
        ``n'_a >= min_count``.
    gradients : (G, p)
        ``grad g_a`` (zero rows where inactive).
    """

    overall_rate: float
    group_rates: FloatArray
    differences: FloatArray
    violations: FloatArray
    values: FloatArray
    active: NDArray[np.bool_]
    defined: NDArray[np.bool_]
    gradients: FloatArray

    @property
    def max_gap(self) -> float:
        """``max_a |F/n' - F_a/n'_a|`` over defined groups (NaN if none)."""
        if not self.defined.any():
            return math.nan
        return float(np.max(np.abs(self.differences[self.defined])))


def evaluate_constraints(
    stats: AggregateStatistics,
    alpha: float,
    *,
    min_count: float = 1.0,
    activation: str = "surrogate",
    error_surrogate: bool = True,
) -> ConstraintEvaluation:
    """``h``, ``g`` and ``grad g`` from aggregated statistics (Eq. 9 and 11).

    ``F = sum_a F_a``, ``grad F = sum_a grad F_a`` and ``n' = sum_a n'_a`` (Section 3.2);
    ``n'`` and ``n'_a`` do not depend on ``w``, so the gradient of the difference is exactly
    ``grad F / n' - grad F_a / n'_a``.

    ``activation = "counts"`` (proxy-Lagrangian, Cotter et al. 2019): the rates, differences,
    ``h``, ``g`` and the sign of ``grad g`` come from the hard rates ``e_a / n'_a`` of the
    released error counts (the constraint the model is judged by), with their sign flipped
    when ``error_surrogate`` is False; the direction ``grad F / n' - grad F_a / n'_a`` is
    still the surrogate's, the only differentiable one. With the smooth surrogate the hard
    FNR gap can stay well above ``alpha`` while the surrogate gap is below it, and then the
    paper's constraint is inactive.

    References
    ----------
    .. [1] B. Rodriguez-Galvez, F. Granqvist, R. van Dalen and M. Seigel, "Enforcing
           fairness in private federated learning via the modified method of differential
           multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
           arXiv:2109.08604, 2021. Eq. (9), Eq. (11), Section 3.2.
    .. [2] A. Cotter, H. Jiang and K. Sridharan, "Two-Player Games for Efficient Non-Convex
           Constrained Optimization", Algorithmic Learning Theory (ALT), 2019.
    """
    alpha = check_nonnegative_finite("alpha", alpha)
    min_count = check_positive_finite("min_count", min_count)
    if activation not in CONSTRAINT_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(CONSTRAINT_ACTIVATIONS)}; got {activation!r}"
        )
    counts = stats.constraint_counts
    defined = counts >= min_count
    total_count = float(counts.sum())
    num_groups, num_params = stats.surrogate_grads.shape
    if total_count < min_count:
        nan = np.full(num_groups, math.nan)
        return ConstraintEvaluation(
            overall_rate=math.nan,
            group_rates=nan,
            differences=np.zeros(num_groups),
            violations=np.full(num_groups, -alpha),
            values=np.zeros(num_groups),
            active=np.zeros(num_groups, dtype=bool),
            defined=np.zeros(num_groups, dtype=bool),
            gradients=np.zeros((num_groups, num_params)),
        )
    overall_grad = stats.surrogate_grads.sum(axis=0) / total_count
    safe_counts = np.where(defined, counts, 1.0)
    if activation == "counts":
        # Hard rates in the surrogate's orientation (errors, or correct = 1 - errors).
        sign = 1.0 if error_surrogate else -1.0
        overall_rate = sign * float(stats.group_errors.sum()) / total_count
        group_rates = np.where(defined, sign * stats.group_errors / safe_counts, math.nan)
    else:
        overall_rate = float(stats.surrogate_sums.sum()) / total_count
        group_rates = np.where(defined, stats.surrogate_sums / safe_counts, math.nan)
    differences = np.where(defined, overall_rate - np.nan_to_num(group_rates), 0.0)
    violations = np.where(defined, np.abs(differences) - alpha, -alpha)
    active = defined & (violations >= 0.0)
    values = np.where(active, violations, 0.0)
    difference_grads = overall_grad[None, :] - stats.surrogate_grads / safe_counts[:, None]
    gradients = np.where(active[:, None], np.sign(differences)[:, None] * difference_grads, 0.0)
    return ConstraintEvaluation(
        overall_rate=overall_rate,
        group_rates=group_rates,
        differences=differences,
        violations=violations,
        values=values,
        active=active,
        defined=defined,
        gradients=gradients,
    )


# --------------------------------------------------------------------------------------------
# Smoothing over rounds (post-processing of the released sums)
# --------------------------------------------------------------------------------------------


def exponential_average(
    previous: NDArray[np.floating] | None, current: NDArray[np.floating], smoothing: float
) -> FloatArray:
    """``smoothing * previous + (1 - smoothing) * current``; ``current`` when ``previous`` is None.

    Applied by the server to the released (noisy) sums of consecutive rounds. Late in training
    consecutive rounds evaluate nearly the same model on independent cohorts, so the average
    keeps the signal and divides the variance of the noise (and of the cohort sampling) by
    about ``(1 + smoothing) / (1 - smoothing)`` (19 at 0.9), at the price of a lag of about
    ``smoothing / (1 - smoothing)`` rounds. It reads only released sums, so it is
    post-processing: the privacy guarantee is unchanged.

    Parameters
    ----------
    previous : array or None
        The running average after the previous round (None before the first round).
    current : array
        This round's released sum, same shape.
    smoothing : float
        ``beta`` in ``[0, 1)``; 0 returns ``current``.
    """
    smoothing = check_nonnegative_finite("smoothing", smoothing)
    if smoothing >= 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    array = np.asarray(current, dtype=np.float64)
    if previous is None or smoothing == 0.0:
        return array.copy()
    before = np.asarray(previous, dtype=np.float64)
    if before.shape != array.shape:
        raise ValueError(f"previous has shape {before.shape}, current {array.shape}")
    return smoothing * before + (1.0 - smoothing) * array


def with_constraint_terms(
    current: AggregateStatistics, smoothed: AggregateStatistics
) -> AggregateStatistics:
    """``current`` with the constraint blocks (``F_a``, ``grad F_a``, ``n'_a``) of ``smoothed``.

    The MMDM update then takes ``grad L / n`` from this round's sum and ``h``, ``g`` and
    ``grad g`` (:func:`evaluate_constraints`) from the smoothed sums, whose group rates are
    far less noisy: at ``m = 1000`` the smaller group's ``n'_a`` is a few dozen clipped
    samples against a noise sd of ``C sigma``.
    """
    if current.layout != smoothed.layout:
        raise ValueError("current and smoothed statistics must have the same layout")
    return replace(
        current,
        surrogate_sums=smoothed.surrogate_sums.copy(),
        surrogate_grads=smoothed.surrogate_grads.copy(),
        constraint_counts=smoothed.constraint_counts.copy(),
    )


# --------------------------------------------------------------------------------------------
# Updates, Eq. (10)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MMDMUpdate:
    """One MMDM step (Eq. 10).

    Attributes
    ----------
    weights : (p,)
        ``w - eta * direction``.
    multipliers : (G,)
        ``lambda + gamma g(w)``.
    direction : (p,)
        ``grad L/n + lambda_new^T grad g + c g^T grad g``.
    loss_gradient : (p,)
        ``grad L / n``.
    constraints : ConstraintEvaluation
        The constraint terms at the *old* weights.
    """

    weights: FloatArray
    multipliers: FloatArray
    direction: FloatArray
    loss_gradient: FloatArray
    constraints: ConstraintEvaluation


def _check_vector(name: str, value: NDArray[np.floating], length: int) -> FloatArray:
    array = np.asarray(value, dtype=np.float64)
    if array.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (found NaN or infinity)")
    return array


def mmdm_update(
    weights: NDArray[np.floating],
    multipliers: NDArray[np.floating],
    stats: AggregateStatistics,
    config: MMDMConfig,
) -> MMDMUpdate:
    """The MMDM update of Eq. (10) from aggregated (possibly noisy) statistics.

    The order follows Algorithm 1: ``UpdateMultiplier`` first, then ``UpdateParameters`` with
    the *new* multipliers (``lambda_t`` is used to compute ``w_t``). ``n`` is clamped to at
    least ``config.min_count`` (a noisy sum can be small or negative).

    References
    ----------
    .. [1] B. Rodriguez-Galvez, F. Granqvist, R. van Dalen and M. Seigel, "Enforcing
           fairness in private federated learning via the modified method of differential
           multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
           arXiv:2109.08604, 2021. Eq. (10), (11) and Algorithm 1.
    .. [2] J. C. Platt and A. H. Barr, "Constrained Differential Optimization", Neural
           Information Processing Systems (NIPS), 1987 (the MMDM).
    """
    layout = stats.layout
    weights = _check_vector("weights", weights, layout.num_params)
    multipliers = _check_vector("multipliers", multipliers, layout.num_groups)
    constraints = evaluate_constraints(
        stats,
        config.alpha,
        min_count=config.min_count,
        activation=config.activation,
        error_surrogate=config.error_surrogate,
    )
    new_multipliers = multipliers + config.multiplier_learning_rate * constraints.values
    loss_gradient = stats.loss_grad / max(stats.num_samples, config.min_count)
    coefficients = new_multipliers + config.damping * constraints.values
    direction = loss_gradient + coefficients @ constraints.gradients
    return MMDMUpdate(
        weights=weights - config.learning_rate * direction,
        multipliers=new_multipliers,
        direction=direction,
        loss_gradient=loss_gradient,
        constraints=constraints,
    )


def sgd_update(
    weights: NDArray[np.floating],
    stats: AggregateStatistics,
    learning_rate: float,
    *,
    min_count: float = 1.0,
) -> FloatArray:
    """Plain (Federated)SGD from the same statistics: ``w - eta grad L / n`` (no constraint)."""
    learning_rate = check_positive_finite("learning_rate", learning_rate)
    min_count = check_positive_finite("min_count", min_count)
    weights = _check_vector("weights", weights, stats.layout.num_params)
    return weights - learning_rate * stats.loss_grad / max(stats.num_samples, min_count)


# --------------------------------------------------------------------------------------------
# Secure-aggregation stand-in: Gaussian noise on the clipped sum (Algorithm 1)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class NoisySum:
    """A released sum: ``values = sum + N(0, (C sigma)^2 I)`` and the noise std ``C sigma``."""

    values: FloatArray
    noise_std: float


def privatize_sum(
    total: NDArray[np.floating],
    *,
    clipping_bound: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> NoisySum:
    """Add the Gaussian noise of Algorithm 1 to a sum of clipped vectors (central noise).

    The caller is responsible for the vectors having been clipped to ``clipping_bound``; the
    noise std is ``clipping_bound * noise_multiplier``. ``noise_multiplier = 0`` is allowed
    (clipping only, "FL + Clip" in Table 2).
    """
    clipping_bound = check_positive_finite("clipping_bound", clipping_bound)
    noise_multiplier = check_nonnegative_finite("noise_multiplier", noise_multiplier)
    rng = check_generator("rng", rng)
    array = np.asarray(total, dtype=np.float64)
    if array.ndim != 1 or not np.all(np.isfinite(array)):
        raise ValueError(f"total must be a finite 1-D array, got shape {array.shape}")
    std = clipping_bound * noise_multiplier
    noise = rng.normal(0.0, std, size=array.shape) if std > 0 else np.zeros_like(array)
    return NoisySum(values=array + noise, noise_std=std)


# --------------------------------------------------------------------------------------------
# Model selection (Section 4.1: best cohort accuracy among the models fair on the cohort)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CohortMetrics:
    """Hard (0/1) metrics of the model that produced a cohort's statistics.

    Attributes
    ----------
    accuracy : float
        ``1 - errors / n`` (NaN if ``n < min_count``).
    group_error_rates : (G,)
        ``e_a / n'_a``: the FNR of group ``a`` for FNR parity, its error rate (1 - accuracy)
        for accuracy parity; NaN where ``n'_a < min_count``.
    overall_error_rate : float
        ``sum e_a / sum n'_a``.
    gap : float
        ``max_a |overall - group rate|`` over groups (NaN if any group is undefined).
    fair : bool
        ``gap <= alpha`` (False when the gap is undefined).
    """

    accuracy: float
    group_error_rates: FloatArray
    overall_error_rate: float
    gap: float
    fair: bool


def cohort_metrics(
    stats: AggregateStatistics, alpha: float, *, min_count: float = 1.0
) -> CohortMetrics:
    """Accuracy and hard constraint gap from (noisy) cohort statistics, for model selection.

    The gap of ``1 - rate`` equals the gap of ``rate``, so error rates serve both FNR parity
    (``e_a / n'_a`` is the FNR) and accuracy parity.
    """
    alpha = check_nonnegative_finite("alpha", alpha)
    min_count = check_positive_finite("min_count", min_count)
    n = stats.num_samples
    accuracy = 1.0 - stats.num_errors / n if n >= min_count else math.nan
    counts = stats.constraint_counts
    defined = counts >= min_count
    rates = np.where(defined, stats.group_errors / np.where(defined, counts, 1.0), math.nan)
    total = float(counts.sum())
    overall = float(stats.group_errors.sum()) / total if total >= min_count else math.nan
    gap = (
        float(np.max(np.abs(rates - overall)))
        if defined.all() and not math.isnan(overall)
        else math.nan
    )
    return CohortMetrics(
        accuracy=accuracy,
        group_error_rates=rates,
        overall_error_rate=overall,
        gap=gap,
        fair=bool(gap <= alpha) if not math.isnan(gap) else False,
    )


@dataclass(frozen=True, eq=False)
class SelectionCandidate:
    """A model seen during training: the round it was *sent* in, its weights and metrics."""

    round: int
    weights: FloatArray
    metrics: CohortMetrics


@dataclass
class ModelSelector:
    """Keep the best model seen so far (Rodriguez-Galvez et al. 2021, Section 4.1).

    With ``require_fair=True`` (FPFL) a model that is fair on its cohort statistics beats any
    unfair one, and among fair models the higher cohort accuracy wins. While no fair model has
    been seen, the one with the smallest cohort gap is kept (fallback, reported by
    ``best.metrics.fair``). With ``require_fair=False`` (FL / PFL) the best cohort accuracy
    wins. Ties keep the earlier model. NaN accuracies never win.

    The statistics of round ``t`` describe the weights *sent* in round ``t`` (``w_{t-1}``),
    so pass those weights, not the updated ones.
    """

    require_fair: bool = True
    best: SelectionCandidate | None = field(default=None)

    def consider(
        self, round_number: int, weights: NDArray[np.floating], metrics: CohortMetrics
    ) -> bool:
        """Offer a model; return True if it became the best one."""
        round_number = check_int_at_least("round_number", round_number, 0)
        candidate = SelectionCandidate(
            round=round_number,
            weights=np.array(weights, dtype=np.float64, copy=True),
            metrics=metrics,
        )
        if self.best is None or self._better(candidate.metrics, self.best.metrics):
            self.best = candidate
            return True
        return False

    def _better(self, new: CohortMetrics, old: CohortMetrics) -> bool:
        if math.isnan(new.accuracy):
            return False
        if math.isnan(old.accuracy):
            return True
        if not self.require_fair:
            return new.accuracy > old.accuracy
        if new.fair != old.fair:
            return new.fair
        if new.fair:
            return new.accuracy > old.accuracy
        new_gap = math.inf if math.isnan(new.gap) else new.gap
        old_gap = math.inf if math.isnan(old.gap) else old.gap
        return new_gap < old_gap


# --------------------------------------------------------------------------------------------
# Test-set fairness report (Tables 1-3)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FairnessGaps:
    """Accuracy and group-fairness gaps of hard predictions (Rodriguez-Galvez et al. 2021,
    Tables 1-3).

    Every gap is ``max_a |metric(all) - metric(a)|`` over the groups where the metric is
    defined (not the largest pairwise difference). Binary-only metrics are NaN for
    multi-class labels.

    * ``accuracy_gap``: accuracy parity;
    * ``fnr_gap``: false-negative-rate parity (equal opportunity);
    * ``eo_gap``: equalized odds, ``max_a max(|TPR - TPR_a|, |FPR - FPR_a|)``; as
      ``|TPR - TPR_a| = |FNR - FNR_a|``, ``eo_gap >= fnr_gap``;
    * ``demp_gap``: demographic parity, positive-prediction rate ``P(yhat = 1)``;
    * ``pp_gap``: predictive parity, precision ``P(y = 1 | yhat = 1)``.
    """

    accuracy: float
    accuracy_gap: float
    fnr_gap: float
    eo_gap: float
    demp_gap: float
    pp_gap: float
    group_accuracy: tuple[float, ...]
    group_fnr: tuple[float, ...]
    group_fpr: tuple[float, ...]
    group_positive_rate: tuple[float, ...]
    group_precision: tuple[float, ...]
    group_sizes: tuple[int, ...]

    def as_row(self) -> dict[str, float]:
        """The Table 1 columns."""
        return {
            "accuracy": self.accuracy,
            "fnr_gap": self.fnr_gap,
            "eo_gap": self.eo_gap,
            "demp_gap": self.demp_gap,
            "pp_gap": self.pp_gap,
            "accuracy_gap": self.accuracy_gap,
        }


def _rate(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _gap(overall: float, groups: list[float]) -> float:
    defined = [value for value in groups if not math.isnan(value)]
    if math.isnan(overall) or not defined:
        return math.nan
    return max(abs(overall - value) for value in defined)


def fairness_gaps(
    labels: NDArray[np.integer],
    predictions: NDArray[np.integer],
    groups: NDArray[np.integer],
    num_groups: int,
) -> FairnessGaps:
    """Accuracy and FNR / EO / DemP / PP / accuracy gaps of ``predictions``.

    Parameters
    ----------
    labels, predictions : int arrays, shape (n,)
        True and predicted classes; the binary metrics need labels and predictions in {0, 1}.
    groups : int array, shape (n,)
        Group of every sample, in ``[0, num_groups)``.
    num_groups : int
        Number of groups (>= 2).
    """
    num_groups = check_int_at_least("num_groups", num_groups, 2)
    y = np.asarray(labels)
    yhat = np.asarray(predictions)
    a = np.asarray(groups)
    if y.ndim != 1 or yhat.shape != y.shape or a.shape != y.shape:
        raise ValueError(
            f"labels, predictions and groups must be 1-D of equal length, got {y.shape}, "
            f"{yhat.shape}, {a.shape}"
        )
    if y.size == 0:
        raise ValueError("labels must not be empty")
    if a.min() < 0 or a.max() >= num_groups:
        raise ValueError(f"groups must be in [0, {num_groups - 1}]")
    binary = bool(np.isin(y, (0, 1)).all() and np.isin(yhat, (0, 1)).all())

    def metrics(mask: NDArray[np.bool_]) -> tuple[float, float, float, float, float]:
        yy, pp = y[mask], yhat[mask]
        accuracy = _rate(float(np.sum(yy == pp)), float(yy.size))
        if not binary:
            return accuracy, math.nan, math.nan, math.nan, math.nan
        positives, negatives = float(np.sum(yy == 1)), float(np.sum(yy == 0))
        predicted = float(np.sum(pp == 1))
        true_positives = float(np.sum((yy == 1) & (pp == 1)))
        false_positives = float(np.sum((yy == 0) & (pp == 1)))
        fnr = _rate(positives - true_positives, positives)
        fpr = _rate(false_positives, negatives)
        positive_rate = _rate(predicted, float(yy.size))
        precision = _rate(true_positives, predicted)
        return accuracy, fnr, fpr, positive_rate, precision

    overall = metrics(np.ones(y.shape, dtype=bool))
    per_group = [metrics(a == group) for group in range(num_groups)]
    columns = list(zip(*per_group, strict=True))
    accuracy_gap, fnr_gap, fpr_gap, demp_gap, pp_gap = (
        _gap(overall[k], list(columns[k])) for k in range(5)
    )
    eo_gap = (
        math.nan
        if math.isnan(fnr_gap) and math.isnan(fpr_gap)
        else float(np.nanmax([fnr_gap, fpr_gap]))
    )
    return FairnessGaps(
        accuracy=overall[0],
        accuracy_gap=accuracy_gap,
        fnr_gap=fnr_gap,
        eo_gap=eo_gap,
        demp_gap=demp_gap,
        pp_gap=pp_gap,
        group_accuracy=tuple(columns[0]),
        group_fnr=tuple(columns[1]),
        group_fpr=tuple(columns[2]),
        group_positive_rate=tuple(columns[3]),
        group_precision=tuple(columns[4]),
        group_sizes=tuple(int(np.sum(a == group)) for group in range(num_groups)),
    )
