"""Holder-level differential privacy for the FedEvalFair release (optional; off by default).

Without it a FedEvalFair release is exact up to the key-recovery flooding (:mod:`.flooding`,
~1e-8): a server that runs the test over the holders {a, b, c} and again over {a, b} (two runs,
each committed) subtracts the releases and reads holder c's sums. Where a holder must not be
singled out, the key holders add Gaussian noise calibrated to what one holder can change,
and every holder charges its users' privacy ledgers for the release. The guarantee is
(epsilon, delta)-DP of the release under *replace one holder's data* (the holder set is
public: the server sees who answers); a user belongs to one holder, so it is also user-level
(epsilon, delta)-DP under replace-one-user, the relation of the node's ledger.

What a holder contributes (per calibrated block, metric dp and eo)
-----------------------------------------------------------------
Let v_min = 1 / ``max_weight`` (run config ``fef-dp-max-weight``) and
V* = max{V_i(mu) : mu in {0, mu0, +tol, -tol}} the largest of the holder's null variances
(:func:`~fedparity.mechanisms.fairness_tests.fedevalfair.disparity_variance`; S_i^2 without margins;
the tolerance only when the run has one). The holder's weight is

    w~ = min(1, v_min / V*)      (0 when it cannot compute the block)

-- the calibrated weight 1 / V(0) capped at ``max_weight`` and divided by it (without a
tolerance and with mu0 = 0 exactly that) -- and it adds ``(w~, w~ Ybar, w~ Ybar^2)`` to the
released sums, Ybar in [-1, 1] (a difference of two rates). Its count is 1 whatever its data
(the number of round-2 holders is public). Nothing else is released: not the stage-1 parts of
round 2, not the bootstrap (sandwich) variance, not the variance sums (the tests use the
bound below), not the paper mode's blocks (its weights n / S^2 have no bound).

Sensitivity (L2, replace one holder)
------------------------------------
One block's contribution is ``x = w v(y)`` with ``v(y) = (1, y, y^2)``, w in [0, 1], y in
[-1, 1]. For fixed y, y' the map (w, w') -> ||w v(y) - w' v(y')||^2 is convex, so its maximum
over [0, 1]^2 is at a vertex: 0, ||v(y)||^2 <= 3, or (w = w' = 1)
||v(y) - v(y')||^2 = (y - y')^2 (1 + (y + y')^2). With s = |y + y'| and |y - y'| <= 2 - s the
last is at most g(s) = (2 - s)^2 (1 + s^2), and g'(s) = -2 (2 - s)(2 s^2 - 2 s + 1) < 0 on
[0, 2): the maximum is g(0) = 4, at y = 1, y' = -1. So one block moves by at most 2 in L2, and
a holder's two blocks (dp and eo can both be extreme) by

    Delta = sqrt(4 + 4) = 2 sqrt(2)      (:data:`SENSITIVITY`).

A run whose layout tests more (metric, comparison) pairs releases one calibrated block per pair,
each of which one holder can move by 2: Delta = 2 sqrt(b) for b released blocks
(:attr:`HolderDP.num_blocks`, from the layout on both ends; bound into the commitment).

The bound is attained by real holders: a holder of N rows whose group 0 is all predicted
positive and group 1 all negative has Ybar = 1 and V(0) = 1 / (N - 1), so w~ = 1 once
N - 1 >= ``max_weight``; its mirror has Ybar = -1.

The clamps and their effect on the test
---------------------------------------
* The weight cap: holders with V* below v_min (the larger ones) get equal weights instead of
  inverse-variance ones; the others keep 1 / V* (scaled). The weights still depend on the
  margins only, so mu_hat = sum w~ Ybar / sum w~ is unbiased under a common disparity; it is
  less efficient where many holders are capped. Every weight has w~ V_i(mu) <= v_min for
  mu in {0, mu0, +-tol}, so the null variance sum w~^2 V_i(mu) is at most v_min sum w~: the
  tests use that bound (conservative; exact when every holder sits at the cap).
* Stage 1 is computed by the server from the noisy sums,
  Q = max_weight (sum w~ Ybar^2 - (sum w~ Ybar)^2 / sum w~), Cochran's Q with the capped
  weights w = max_weight w~ <= 1 / V*: under a common disparity in {0, mu0, +-tol} every
  w_i Var(Ybar_i) <= 1, so Q is stochastically below chi2(k - 1) (conservative), and so is a
  holder that cannot compute the block (weight 0, counted in k). Why not release the round-2
  Cochran's Q with its own noise: its terms are centred at the round-1 estimate c, which every
  holder's data moves, so one holder changes every term and the statistic's sensitivity grows
  with k (up to k times any per-term clamp), while the three sums above have sensitivity 2
  per block; post-processing them costs no further privacy.

Who adds the noise
------------------
The key holders, after decrypting and flooding the round-2 sum (so the server never sees an
un-noised value): ``sigma * keyed_gaussian(flood key, transcript(run, commitment digest))``
(:func:`add_noise`), the key derived from the shared secret key as the flooding noise is. Every
key holder of a run releases the same values (the server's agreement check holds) and a
repeated request for the same committed sets returns the same noise, so releases cannot be
averaged; another run has another commitment, hence independent noise, and is charged again.
The noise is a pseudorandom function of data-dependent transcripts under a key the server does
not hold: the guarantee is computational. A holder colluding with the server removes it (it
holds the key, and can decrypt every ciphertext anyway). ``sigma`` is the analytic Gaussian
mechanism's (Balle and Wang, "Improving the Gaussian Mechanism for Differential Privacy:
Analytical Calibration and Optimal Denoising", ICML 2018), the smallest standard deviation with
(epsilon, delta)-DP at sensitivity Delta, computed by Google's ``dp_accounting``
(:func:`noise_std`).

Stays approximate: the decryption error of CKKS (~1e-9 per slot, far below sigma) is not in
Delta; the Gaussian is sampled in floating point and rounded to a grid of sigma / 2^10 (no
discrete-Gaussian argument); the p-values below.

The tests from the noisy sums (:func:`dp_report`)
-------------------------------------------------
With C, B, A the released sums of w~, w~ Ybar, w~ Ybar^2 and sigma their noise std:

* stage 2: W* = (B - mu0 C) / sqrt(v_min C + sigma^2 (1 + mu0^2)) against N(0, 1). The
  numerator's noise (eta_B - mu0 eta_C) is Gaussian with that known variance, so it is
  accounted exactly; approximate are the plug-in of the noisy C in the sampling part and the
  normal approximation the test has anyway. TOST likewise at +-tol.
* the estimate mu_hat = B / C with the delta-method standard error
  sqrt(v_min C + sigma^2 (1 + mu_hat^2)) / C (approximate: a ratio of noisy sums).
* stage 1: Q as above against chi2(k - 1) + N(0, tau^2), tau = max_weight sigma
  sqrt(1 + 4 mu_hat^2 + mu_hat^4) (first-order noise of Q): approximate. Its noise is
  max_weight times that of the sums, so stage 1 only speaks when k is far above
  max_weight sigma.

Pure numpy/scipy (and ``dp_accounting`` for the calibration): no Flower import.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np

from ...fairness_tests.fedevalfair import (
    ClientSummary,
    FairnessReport,
    StageStatistics,
    _report,
    disparity_variance,
)
from ...protocol import BLOCK_WIDTH, DEFAULT_LAYOUT, RELEASE_WIDTH, FedEvalFairLayout
from .flooding import keyed_gaussian

__all__ = [
    "DP_BLOCKS",
    "DP_SUMS",
    "HOLDER_DP_LABEL",
    "SENSITIVITY",
    "HolderDP",
    "add_noise",
    "chi2_plus_normal_sf",
    "dp_block",
    "dp_release",
    "dp_report",
    "dp_weight",
    "noise_std",
    "released_blocks",
]

#: Label of the transcript that keys the DP noise (distinct from the flooding noise's).
HOLDER_DP_LABEL = "fedparity/fedevalfair/holder-dp/v1"
#: Label of the DP parameters bound into the commitment.
DP_TERMS_LABEL = b"fedparity/fedevalfair/holder-dp-terms/v1"
#: Indices (in :data:`~fedparity.mechanisms.protocol.BLOCKS`) of the blocks the DP mode
#: releases in the default layout: the calibrated ones (dp, eo); a run's own:
#: :attr:`~fedparity.mechanisms.protocol.FedEvalFairLayout.dp_blocks`.
DP_BLOCKS: tuple[int, ...] = DEFAULT_LAYOUT.dp_blocks
#: The sums released per DP block, in order (the first three slots of a round-1 block).
DP_SUMS: tuple[str, ...] = ("sum_weights", "sum_weighted_means", "sum_weighted_squared_means")
#: One block's squared L2 sensitivity (module docstring).
BLOCK_SENSITIVITY_SQUARED = 4.0
#: L2 sensitivity of one holder's contribution to everything released in the default layout
#: (two calibrated blocks): 2 sqrt(2).
SENSITIVITY = math.sqrt(BLOCK_SENSITIVITY_SQUARED * len(DP_BLOCKS))
#: The noisy sums are rounded to the power-of-two grid at sigma / 2^GRID_BITS (post-processing).
GRID_BITS = 10


@functools.lru_cache(maxsize=64)
def noise_std(epsilon: float, delta: float, sensitivity: float = SENSITIVITY) -> float:
    """The analytic Gaussian mechanism's standard deviation (Balle and Wang 2018): the
    smallest sigma for which adding N(0, sigma^2) to a function of L2 sensitivity
    ``sensitivity`` is (epsilon, delta)-DP, from ``dp_accounting``.

    Examples
    --------
    >>> round(noise_std(1.0, 1e-6, 1.0), 3)
    4.225
    """
    from dp_accounting.pld import common, privacy_loss_mechanism

    guarantee = common.DifferentialPrivacyParameters(float(epsilon), float(delta))
    loss = privacy_loss_mechanism.GaussianPrivacyLoss.from_privacy_guarantee(
        guarantee, sensitivity=float(sensitivity)
    )
    return float(loss.standard_deviation)


@dataclass(frozen=True)
class HolderDP:
    """The DP mode's parameters, agreed for a run (bound into every holder's commitment).

    Attributes
    ----------
    epsilon, delta : float
        The release's (epsilon, delta) under replace-one-holder (each holder's users are
        charged this).
    max_weight : float
        The cap on the calibrated weight 1 / V (a floor v_min = 1 / max_weight on the
        variance); every weight is divided by it, so each is in [0, 1].
    num_blocks : int
        The calibrated blocks released (one per metric and comparison of the run's layout;
        2 for dp and eo): the sensitivity is 2 sqrt(num_blocks).
    """

    epsilon: float
    delta: float
    max_weight: float = 100.0
    num_blocks: int = len(DP_BLOCKS)

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta", "max_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {self.epsilon!r}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise ValueError(f"max_weight must be a finite number > 0, got {self.max_weight!r}")
        if (
            isinstance(self.num_blocks, bool)
            or not isinstance(self.num_blocks, int)
            or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")

    @classmethod
    def for_layout(
        cls, epsilon: float, delta: float, max_weight: float, layout: FedEvalFairLayout
    ) -> HolderDP:
        """The parameters for a run of ``layout`` (its calibrated blocks are released)."""
        return cls(epsilon, delta, max_weight, len(layout.dp_blocks))

    @property
    def min_variance(self) -> float:
        """v_min = 1 / max_weight."""
        return 1.0 / self.max_weight

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one holder's contribution: 2 sqrt(num_blocks)
        (:data:`SENSITIVITY` for the default two)."""
        return math.sqrt(BLOCK_SENSITIVITY_SQUARED * self.num_blocks)

    @property
    def noise_std(self) -> float:
        """sigma of the Gaussian noise on every released sum (:func:`noise_std`)."""
        return noise_std(self.epsilon, self.delta, self.sensitivity)

    def terms(self) -> bytes:
        """The parameters as bytes, bound into the commitment every round-2 holder signs, so
        that holders given different parameters (a split view) sign different commitments and
        no key holder releases."""
        terms = DP_TERMS_LABEL + struct.pack(">3d", self.epsilon, self.delta, self.max_weight)
        return terms + (
            b"" if self.num_blocks == len(DP_BLOCKS) else struct.pack(">q", self.num_blocks)
        )

    def to_dict(self) -> dict[str, float | str]:
        """JSON-ready, for the outcome and the report."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "max_weight": self.max_weight,
            "sensitivity": self.sensitivity,
            "released_blocks": self.num_blocks,
            "noise_std": self.noise_std,
            "neighbouring": "replace one holder's data (so also one user's)",
            "released_per_block": ", ".join(DP_SUMS),
        }


# --------------------------------------------------------------------------------------------
# What a holder adds
# --------------------------------------------------------------------------------------------


def _null_values(mu0: float, tolerance: float | None) -> tuple[float, ...]:
    values = [0.0, float(mu0)]
    if tolerance is not None:
        values += [float(tolerance), -float(tolerance)]
    return tuple(values)


def dp_weight(
    summary: ClientSummary, *, max_weight: float, mu0: float, tolerance: float | None
) -> float:
    """w~ = min(1, v_min / V*): V* the largest of the holder's null variances V(mu) over
    mu in {0, mu0, +-tol} (S^2 when the summary has no margins); module docstring."""
    if summary.margins is None:
        largest = float(summary.variance)
    else:
        largest = max(
            disparity_variance(summary.margins, value) for value in _null_values(mu0, tolerance)
        )
    return float(min(1.0, (1.0 / float(max_weight)) / largest))


def dp_block(
    summary: ClientSummary | None,
    *,
    max_weight: float,
    mu0: float,
    tolerance: float | None,
) -> np.ndarray:
    """A calibrated block's round-1 slots in the DP mode:
    ``[w~, w~ Ybar, w~ Ybar^2, 0, 0, 0, 0, 1]`` (zeros and the count 1 without a summary)."""
    block = np.zeros(BLOCK_WIDTH)
    block[-1] = 1.0
    if summary is None:
        return block
    weight = dp_weight(summary, max_weight=max_weight, mu0=mu0, tolerance=tolerance)
    mean = float(np.clip(summary.mean, -1.0, 1.0))
    block[:3] = weight, weight * mean, weight * mean * mean
    return block


def released_blocks(
    round2_contributions: np.ndarray, layout: FedEvalFairLayout = DEFAULT_LAYOUT
) -> np.ndarray:
    """The exact sums the DP mode releases, (len(layout.dp_blocks), 3), from the round-2 sum's
    contribution part (one block of :data:`~fedparity.mechanisms.protocol.BLOCK_WIDTH` per
    block of the layout)."""
    values = np.asarray(round2_contributions, dtype=np.float64)
    return np.stack(
        [values[i * BLOCK_WIDTH : i * BLOCK_WIDTH + len(DP_SUMS)] for i in layout.dp_blocks]
    )


def add_noise(values: np.ndarray, *, std: float, key: bytes, message: bytes) -> np.ndarray:
    """``values`` plus ``std`` times the keyed standard normals of ``key`` and ``message``
    (:func:`~fedparity.mechanisms.crypto.ckks.keyed_gaussian`), rounded to the power-of-two grid at
    ``std / 2^GRID_BITS`` (post-processing)."""
    array = np.asarray(values, dtype=np.float64)
    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"std must be finite and > 0, got {std!r}")
    noisy = array + std * keyed_gaussian(key, message, array.size).reshape(array.shape)
    grid = 2.0 ** (math.floor(math.log2(std)) - GRID_BITS)
    return np.round(noisy / grid) * grid


def dp_release(
    round2_contributions: np.ndarray,
    *,
    num_holders: int,
    dp: HolderDP,
    key: bytes,
    message: bytes,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """The release of the DP mode, laid out as the plain release (per block
    ``[stage 1, the contribution's sums, random-effects summary]``): per DP block
    ``[NaN, C, B, A, NaN..., k, NaN...]`` with C, B, A the noisy :data:`DP_SUMS` and
    k = ``num_holders`` (the public number of round-2 holders) in the contribution's count
    slot; every other block NaN (not released). The group counts of the pooled disparity and
    the random-effects summary are not released in this mode (their sensitivity is not in
    :data:`SENSITIVITY`)."""
    if dp.num_blocks != len(layout.dp_blocks):
        raise ValueError(
            f"dp.num_blocks ({dp.num_blocks}) must be the layout's calibrated blocks "
            f"({len(layout.dp_blocks)}): the noise is calibrated to what is released"
        )
    noisy = add_noise(
        released_blocks(round2_contributions, layout), std=dp.noise_std, key=key, message=message
    )
    release = np.full(layout.release_size, np.nan)
    for row, index in enumerate(layout.dp_blocks):
        start = index * RELEASE_WIDTH
        release[start + 1 : start + 1 + len(DP_SUMS)] = noisy[row]
        release[start + BLOCK_WIDTH] = float(num_holders)  # the contribution's count slot
    return release


# --------------------------------------------------------------------------------------------
# The tests from the noisy sums (server side)
# --------------------------------------------------------------------------------------------


#: Gauss-Legendre nodes per piece of :func:`chi2_plus_normal_sf`'s integral.
_QUADRATURE_NODES = 96
#: The normal's range the integral covers (beyond it the density is below 1e-22).
_NORMAL_RANGE = 10.0


def chi2_plus_normal_sf(statistic: float, dof: int, noise_std: float) -> float:
    """P(X + Z >= statistic) for X ~ chi2(dof) and Z ~ N(0, noise_std^2) independent (the
    null distribution of a chi-square statistic released with Gaussian noise):
    E_Z[chi2.sf(statistic - Z)], by Gauss-Legendre quadrature over z in [-10, 10] standard
    deviations, in pieces split where the chi-square argument crosses 0 and at its
    1e-12, 1/2 and 1 - 1e-12 quantiles (each piece smooth on its own scale)."""
    from scipy import stats

    if noise_std <= 0.0:
        return float(stats.chi2.sf(statistic, dof))
    nodes, weights = np.polynomial.legendre.leggauss(_QUADRATURE_NODES)
    quantiles = stats.chi2.ppf([0.0, 1e-12, 0.5, 1.0 - 1e-12], dof)
    cuts = np.clip((statistic - quantiles) / noise_std, -_NORMAL_RANGE, _NORMAL_RANGE)
    edges = np.unique(np.concatenate([[-_NORMAL_RANGE, _NORMAL_RANGE], cuts]))
    total = 0.0
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        z = 0.5 * (high - low) * nodes + 0.5 * (high + low)
        values = stats.chi2.sf(statistic - noise_std * z, dof) * np.exp(-0.5 * z * z)
        total += 0.5 * (high - low) * float(np.dot(weights, values))
    return float(min(1.0, max(0.0, total / math.sqrt(2.0 * math.pi))))


def dp_report(
    sums: np.ndarray,
    num_holders: int,
    *,
    dp: HolderDP,
    alpha: float,
    mu0: float,
    tolerance: float | None,
) -> FairnessReport:
    """The calibrated block's
    :class:`~fedparity.mechanisms.fairness_tests.fedevalfair.FairnessReport` from its noisy released
    sums ``[C, B, A]`` and the number of round-2 holders (module docstring: stage 2 and TOST account
    for the noise's known variance; the estimate's standard error and stage 1 are approximate).

    Raises ``ValueError`` when the noisy sum of weights C is not positive (the noise swamps
    the test) or there are fewer than 2 holders.
    """
    from scipy import stats

    total_weight, weighted, squared = (float(value) for value in np.asarray(sums)[:3])
    if not all(math.isfinite(value) for value in (total_weight, weighted, squared)):
        raise ValueError("the released sums are not finite")
    if num_holders < 2:
        raise ValueError(f"only {num_holders} holder(s) in the release")
    if not total_weight > 0.0:
        raise ValueError(
            "the noisy sum of weights is not positive: the DP noise swamps the test (it needs "
            "more holders, or a larger fef-dp-epsilon; the sum of weights is at most the number "
            "of holders)"
        )
    sigma = dp.noise_std
    bound = dp.min_variance * total_weight  # >= sum w~^2 V(mu): the sampling variance

    def standardised(numerator: float, slope: float) -> float:
        return numerator / math.sqrt(bound + sigma * sigma * (1.0 + slope * slope))

    estimate = weighted / total_weight
    stderr = math.sqrt(bound + sigma * sigma * (1.0 + estimate * estimate)) / total_weight
    common = standardised(weighted - mu0 * total_weight, mu0)
    equivalence_statistic = equivalence_pvalue = None
    if tolerance is not None:
        upper = standardised(tolerance * total_weight - weighted, tolerance)
        lower = standardised(weighted + tolerance * total_weight, tolerance)
        equivalence_statistic = np.float64(min(upper, lower))
        equivalence_pvalue = np.float64(
            stats.norm.sf(equivalence_statistic) if tolerance > 0.0 else 1.0
        )
    homogeneity = dp.max_weight * (squared - weighted * weighted / total_weight)
    spread = dp.max_weight * sigma * math.sqrt(1.0 + 4.0 * estimate**2 + estimate**4)
    computed = StageStatistics(
        mode="calibrated",
        k=num_holders,
        dof=num_holders - 1,
        estimate=np.float64(estimate),
        stderr=np.float64(stderr),
        homogeneity_statistic=np.float64(homogeneity),
        homogeneity_pvalue=np.float64(chi2_plus_normal_sf(homogeneity, num_holders - 1, spread)),
        common_statistic=np.float64(common),
        common_pvalue=np.float64(2.0 * stats.norm.sf(abs(common))),
        equivalence_statistic=equivalence_statistic,
        equivalence_pvalue=equivalence_pvalue,
    )
    report = _report(computed, alpha=alpha, mu0=mu0, tolerance=tolerance)
    return _with_dp_methods(report)


#: The methods of the DP mode's tests (replacing the plain ones in the report).
DP_METHODS = {
    "homogeneity": (
        "Holder-level DP: Cochran's Q = max_weight (A - B^2 / C) from the noisy sums "
        "A = sum w~ Ybar^2, B = sum w~ Ybar, C = sum w~ (w~ = min(1, v_min / V*)), against "
        "chi2(k - 1) plus the Gaussian noise's first-order effect (approximate)"
    ),
    "common": (
        "Holder-level DP: W* = (B - mu0 C) / sqrt(v_min C + sigma^2 (1 + mu0^2)) from the "
        "noisy sums, N(0, 1): the noise's known variance accounted, the sampling variance "
        "bounded by v_min C (conservative)"
    ),
    "equivalence": (
        "Holder-level DP: TOST at +-tolerance with the noise's known variance and the sampling "
        "variance bounded by v_min C, N(0, 1)"
    ),
}


def _with_dp_methods(report: FairnessReport) -> FairnessReport:
    from dataclasses import replace

    return replace(
        report,
        homogeneity=replace(report.homogeneity, method=DP_METHODS["homogeneity"]),
        common_disparity=replace(report.common_disparity, method=DP_METHODS["common"]),
        equivalence=None
        if report.equivalence is None
        else replace(report.equivalence, method=DP_METHODS["equivalence"]),
    )
