"""User-level (epsilon, delta) accounting for FPFL with Opacus' accountants.

FPFL is Algorithm 1 of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021 below). It releases, every round, the
sum of the clipped vectors of a cohort of users plus ``N(0, C^2 sigma^2 I)``: a subsampled
Gaussian mechanism with sensitivity ``C`` (one user changes one clipped vector) and noise
multiplier ``sigma``. Over ``T`` rounds its privacy is
computed by Opacus, with the Renyi-DP accountant (``"rdp"``, Mironov et al. 2019, RDP of the
Poisson-subsampled Gaussian mechanism; the paper itself cites the analytical moments
accountant of Wang, Balle and Kasiviswanathan, AISTATS 2019) or the privacy-random-variable
accountant (``"prv"``, Gopi et al. 2021, tighter).

**Sampling assumption.** Both accountants analyse *Poisson* subsampling: every round, each of
the ``K`` users joins the cohort independently with probability ``q = m / K`` (so the cohort
size is random with mean ``m``). A cohort of exactly ``m`` users drawn without replacement is
a different mechanism, and these numbers are then only a (commonly used) approximation. The
strategy must therefore sample users independently with probability ``q`` to get the
guarantee stated here.

* :func:`calibrate_noise` -- the smallest ``sigma`` (Opacus bisection, ``get_noise_multiplier``)
  with ``epsilon(sigma) <= target`` after ``T`` rounds; the achieved epsilon lies in
  ``[target - epsilon_tolerance, target]``.
* :func:`privacy_spent` -- the epsilon actually spent after ``t`` rounds (a run stopped early
  spent less). For ``"prv"`` it is Opacus' *upper* bound (``PRVAccountant.get_epsilon``), the
  guarantee; for ``"rdp"`` the RDP-to-DP conversion at the best order.

Cross-check (reference values computed with Opacus, Poisson sampling, for the federated Adult
setting of Rodriguez-Galvez et al. 2021, Section 4.1: ``K = 16280`` users, ``epsilon = 2``,
``delta = 1/K``): ``m = 200, T = 1000``: ``sigma`` RDP 1.0645, PRV 1.0010;
``m = 1000, T = 250``: RDP 2.1191, PRV 1.9629.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import numpy as np

from ..validation import (
    check_choice,
    check_epsilon,
    check_int_at_least,
    check_open_unit,
    check_positive_finite,
)

__all__ = [
    "ACCOUNTANTS",
    "NoiseCalibration",
    "PrivacySpent",
    "calibrate_noise",
    "import_opacus",
    "privacy_spent",
    "privacy_spent_history",
    "sample_rate",
]

AccountantName = Literal["rdp", "prv"]
ACCOUNTANTS: tuple[AccountantName, ...] = ("rdp", "prv")
#: Opacus' default bisection tolerance on epsilon (``get_noise_multiplier``).
EPSILON_TOLERANCE = 0.01
#: Opacus PRV accountant's default ``eps_error``.
PRV_EPSILON_ERROR = 0.01


def import_opacus(module: str) -> ModuleType:
    """Import an Opacus module (lazily) without its side effect on logging: Opacus calls
    ``logging.basicConfig`` when imported, which adds a handler to the root logger and makes
    every log line of a Flower app appear twice. Handlers it adds are removed again, and the
    root logger's level restored. The only way fedparity imports Opacus (the warm ClientApp
    zygote preloads it through this too)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(module)
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def sample_rate(cohort_size: int, population_size: int) -> float:
    """``q = m / K`` with ``1 <= m <= K`` (ValueError naming the parameter otherwise)."""
    cohort_size = check_int_at_least("cohort_size", cohort_size, 1)
    population_size = check_int_at_least("population_size", population_size, 1)
    if cohort_size > population_size:
        raise ValueError(
            f"cohort_size must be <= population_size ({population_size}), got {cohort_size}"
        )
    return cohort_size / population_size


@dataclass(frozen=True)
class PrivacySpent:
    """Privacy spent by ``steps`` rounds of the Poisson-subsampled Gaussian mechanism.

    Attributes
    ----------
    epsilon : float
        Spent epsilon at ``delta`` (PRV: upper bound; RDP: best-order conversion).
    delta : float
    steps : int
        Rounds released so far.
    noise_multiplier : float
        ``sigma`` (noise std / clipping bound).
    sample_rate : float
        ``q``, the Poisson probability that a user joins a round.
    accountant : ``"rdp"`` | ``"prv"``
    best_order : float | None
        RDP only: the Renyi order that gave ``epsilon``.
    order_at_edge : bool
        RDP only: the best order is the largest of Opacus' default grid, so a wider grid might
        give a smaller (still valid) epsilon.
    history : tuple of (float, float, int)
        The ``(sigma, q, steps)`` segments composed (:func:`privacy_spent_history`).
    """

    epsilon: float
    delta: float
    steps: int
    noise_multiplier: float
    sample_rate: float
    accountant: str
    best_order: float | None = None
    order_at_edge: bool = False
    history: tuple[tuple[float, float, int], ...] = ()


@dataclass(frozen=True)
class NoiseCalibration:
    """Result of :func:`calibrate_noise`.

    Attributes
    ----------
    noise_multiplier : float
        ``sigma``: the Gaussian noise std is ``clipping_bound * sigma``.
    target_epsilon, delta : float
    sample_rate : float
        ``q = m / K``.
    steps : int
        ``T``, the rounds the budget is for.
    accountant : ``"rdp"`` | ``"prv"``
    epsilon_tolerance : float
        Bisection tolerance: ``target - tolerance <= achieved.epsilon <= target``.
    achieved : PrivacySpent
        The epsilon of ``sigma`` after ``T`` rounds, recomputed with the accountant.
    """

    noise_multiplier: float
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    accountant: str
    epsilon_tolerance: float
    achieved: PrivacySpent

    def noise_std(self, clipping_bound: float) -> float:
        """``C * sigma``: the std of the noise added to the sum of vectors clipped to ``C``."""
        return check_positive_finite("clipping_bound", clipping_bound) * self.noise_multiplier


def _check_common(
    delta: float, rate: float, accountant: str
) -> tuple[float, float, AccountantName]:
    delta = check_open_unit("delta", delta)
    rate = check_open_unit("sample_rate", rate) if rate != 1.0 else 1.0
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    return delta, rate, accountant


def privacy_spent(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: AccountantName = "rdp",
) -> PrivacySpent:
    """Epsilon spent after ``steps`` rounds at noise multiplier ``sigma`` (``steps = 0``: 0).

    Parameters
    ----------
    noise_multiplier : float
        ``sigma`` > 0.
    sample_rate : float
        ``q`` in (0, 1]; see :func:`sample_rate` and the module's sampling assumption.
    steps : int
        Rounds released (>= 0).
    delta : float
        In (0, 1).
    accountant : ``"rdp"`` | ``"prv"``
    """
    return privacy_spent_history(
        [(noise_multiplier, sample_rate, steps)], delta=delta, accountant=accountant
    )


def privacy_spent_history(
    history: Sequence[tuple[float, float, int]],
    *,
    delta: float,
    accountant: AccountantName = "rdp",
) -> PrivacySpent:
    """Epsilon spent by segments of rounds with different ``(sigma, q)``, composed by the
    accountant (Opacus keeps exactly such a history: ``[(sigma, q, steps), ...]``).

    A training resumed after a node left for good runs on with a smaller population ``K``, so
    with another ``q = m / K`` and the ``sigma`` calibrated for it; its privacy is the
    composition of both segments, not either one alone. The result's ``noise_multiplier``
    and ``sample_rate`` are the last segment's; ``history`` holds them all.

    Parameters
    ----------
    history : sequence of (float, float, int)
        ``(sigma > 0, q in (0, 1], steps >= 0)`` per segment, in release order.
    delta : float
        In (0, 1).
    accountant : ``"rdp"`` | ``"prv"``
    """
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence) or not history:
        raise ValueError("history must be a non-empty sequence of (sigma, q, steps) segments")
    segments: list[tuple[float, float, int]] = []
    for sigma, rate, steps in history:
        sigma = check_positive_finite("noise_multiplier", sigma)
        delta, rate, accountant = _check_common(delta, rate, accountant)
        steps = check_int_at_least("steps", steps, 0)
        if steps:
            segments.append((sigma, rate, steps))
    delta, _, accountant = _check_common(delta, 0.5, accountant)
    last_sigma, last_rate = float(history[-1][0]), float(history[-1][1])
    total = sum(steps for _, _, steps in segments)
    if total == 0:
        return PrivacySpent(
            0.0, delta, 0, last_sigma, last_rate, accountant, history=tuple(segments)
        )
    # Opacus (and with it torch) is imported only here, so the module imports without them.
    accountants = import_opacus("opacus.accountants")
    PRVAccountant, RDPAccountant = accountants.PRVAccountant, accountants.RDPAccountant  # noqa: N806

    if accountant == "prv":
        prv = PRVAccountant()
        prv.history = list(segments)
        epsilon = float(prv.get_epsilon(delta=delta, eps_error=PRV_EPSILON_ERROR))
        return PrivacySpent(
            epsilon, delta, total, last_sigma, last_rate, accountant, history=tuple(segments)
        )
    # What RDPAccountant.get_privacy_spent computes for this history, with each segment's
    # one-step RDP cached: Opacus's compute_rdp is the one-step curve times the steps, and a
    # training asks for its epsilon after every round.
    alphas = RDPAccountant.DEFAULT_ALPHAS
    curve = sum(steps * _one_step_rdp(sigma, rate) for sigma, rate, steps in segments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # reported as order_at_edge instead
        epsilon, order = import_opacus("opacus.accountants.analysis.rdp").get_privacy_spent(
            orders=alphas, rdp=curve, delta=delta
        )
    return PrivacySpent(
        float(epsilon),
        delta,
        total,
        last_sigma,
        last_rate,
        accountant,
        best_order=float(order),
        order_at_edge=math.isclose(float(order), max(RDPAccountant.DEFAULT_ALPHAS)),
        history=tuple(segments),
    )


@functools.lru_cache(maxsize=256)
def _one_step_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """Opacus's RDP curve of one subsampled Gaussian step at RDPAccountant's default orders
    (read-only: cached)."""
    alphas = import_opacus("opacus.accountants").RDPAccountant.DEFAULT_ALPHAS
    curve = import_opacus("opacus.accountants.analysis.rdp").compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=alphas
    )
    curve = np.asarray(curve, dtype=np.float64)
    curve.setflags(write=False)
    return curve


@functools.lru_cache(maxsize=128)
def _calibration(
    epsilon: float,
    delta: float,
    rate: float,
    steps: int,
    accountant: AccountantName,
    tolerance: float,
) -> NoiseCalibration:
    """Opacus' bisection for ``sigma`` and the epsilon it achieves (about a second; cached: a
    node asks again every round, and a run, its resume and the planner ask for the same)."""
    get_noise_multiplier = import_opacus("opacus.accountants.utils").get_noise_multiplier
    with warnings.catch_warnings():
        # Opacus warns about the RDP order grid while bisecting through huge sigmas; the
        # final sigma's order is reported in ``achieved.order_at_edge``.
        warnings.simplefilter("ignore", UserWarning)
        sigma = float(
            get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=rate,
                steps=steps,
                accountant=accountant,
                epsilon_tolerance=tolerance,
            )
        )
    achieved = privacy_spent(
        noise_multiplier=sigma, sample_rate=rate, steps=steps, delta=delta, accountant=accountant
    )
    return NoiseCalibration(
        noise_multiplier=sigma,
        target_epsilon=epsilon,
        delta=delta,
        sample_rate=rate,
        steps=steps,
        accountant=accountant,
        epsilon_tolerance=tolerance,
        achieved=achieved,
    )


def calibrate_noise(
    *,
    epsilon: float,
    delta: float,
    cohort_size: int,
    population_size: int,
    steps: int,
    accountant: AccountantName = "rdp",
    epsilon_tolerance: float = EPSILON_TOLERANCE,
) -> NoiseCalibration:
    """The noise multiplier ``sigma`` for ``(epsilon, delta)`` after ``steps`` rounds with
    cohort ``m`` out of ``K`` users (``CalculateNoiseScale`` of Algorithm 1).

    Uses ``opacus.accountants.utils.get_noise_multiplier`` (bisection on ``sigma``, stops when
    ``target - epsilon_tolerance <= epsilon(sigma) <= target``), so the values agree with
    Opacus exactly; the achieved epsilon is then recomputed with :func:`privacy_spent`.
    Raises ``ValueError`` naming the parameter for ``epsilon <= 0``, ``delta`` outside (0, 1),
    ``cohort_size > population_size``, ``steps < 1`` or an unknown accountant.

    References
    ----------
    .. [1] B. Rodriguez-Galvez, F. Granqvist, R. van Dalen and M. Seigel, "Enforcing
           fairness in private federated learning via the modified method of differential
           multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
           arXiv:2109.08604, 2021. Algorithm 1 (CalculateNoiseScale).
    .. [2] I. Mironov, K. Talwar and L. Zhang, "Renyi Differential Privacy of the Sampled
           Gaussian Mechanism", arXiv:1908.10530, 2019 (the ``"rdp"`` accountant).
    .. [3] S. Gopi, Y. T. Lee and L. Wutschitz, "Numerical Composition of Differential
           Privacy", NeurIPS 2021 (the ``"prv"`` accountant).
    .. [4] A. Yousefpour et al., "Opacus: User-Friendly Differential Privacy Library in
           PyTorch", arXiv:2109.12298, 2021.

    Examples
    --------
    >>> cal = calibrate_noise(epsilon=2, delta=1 / 16280, cohort_size=200,
    ...                       population_size=16280, steps=1000, accountant="rdp")
    >>> round(cal.noise_multiplier, 4)
    1.0645
    """
    epsilon = check_epsilon("epsilon", epsilon)
    rate = sample_rate(cohort_size, population_size)
    delta, rate, accountant = _check_common(delta, rate, accountant)
    steps = check_int_at_least("steps", steps, 1)
    epsilon_tolerance = check_positive_finite("epsilon_tolerance", epsilon_tolerance)
    return _calibration(epsilon, delta, rate, steps, accountant, epsilon_tolerance)
