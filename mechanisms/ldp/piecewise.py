"""The M_P gap mechanism: GRR on the group, the Piecewise mechanism on the value.

Ning Wang, Xiaokui Xiao, Yin Yang, Jun Zhao, Siu Cheung Hui, Hyejin Shin, Junbum Shin and Ge
Yu, "Collecting and Analyzing Multidimensional Data with Local Differential Privacy", ICDE
2019 (Wang et al. 2019 below), Algorithm 2: for a value v in [-1, 1] and t = e^(eps/2), the
report is uniform on the window [l(v), r(v)] = [(C + 1) v / 2 - (C - 1) / 2, l(v) + C - 1] with
probability t / (t + 1), else uniform on the rest of [-C, C], C = (t + 1) / (t - 1). Its
density is e^eps times higher inside the window than outside; the report is unbiased with
variance v^2 / (t - 1) + (t + 3) / (3 (t - 1)^2) (Lemma 1), smaller than the Laplace
mechanism's 8 / eps^2 at every eps and, in the worst case over v, smaller than Duchi et al.'s
for eps above about 1.29.

The group step is GRR, as in M_L (:mod:`fedparity.mechanisms.ldp.laplace`), and the
estimators of :mod:`fedparity.mechanisms.ldp.estimators` apply through
:attr:`PiecewiseMechanism.moments`. A flipped client reports a point drawn uniformly from the
whole output range [-C, C] (mean 0), not PM(0): the uniform density 1 / (2 C) lies exactly a
factor t = e^(eps2 / 2) below PM's window density and above its outside density, so a kept
report against a flipped one costs eps1 + eps2 / 2 and M_P has M_L's true epsilon,
max(eps2, eps1 + eps2 / 2) (with PM(0) it would be eps1 + eps2: the windows of v = 1 and
v = 0 are apart).

On a grid, with integer comparisons only (a continuous PM on IEEE doubles leaks ``v`` through
its low bits, like the Laplace mechanism: Mironov, CCS 2012). The value is rounded at random
(unbiased) to ``x / N``, ``x`` in ``-N .. N``, ``N = 1 / GRID_STEP``; the output is one of
``n = w + m`` points ``j = 0 .. n - 1``, the window of ``x`` is the ``w`` points from
``k (x + N)``, and the other ``m = 2 k N`` points are its outside (``w / m ~ 1 / t`` as in
PM; ``m`` a power of two). One uniform 64-bit word ``u`` picks the point: the window's ``j``-th
point when ``u < w c_in`` (``j = u // c_in``), else the ``i``-th outside point
(``i = (u - w c_in) // c_out``), with integers ``w c_in + m c_out = 2^64`` exactly. So every
window point has probability ``c_in / 2^64`` and every outside point ``c_out / 2^64``. A
flipped client's point is ``floor(u n / 2^64)``: ``Q = floor(2^64 / n)`` or ``Q + 1`` words
each. The realised epsilon is computed from these integers (:attr:`PiecewiseMechanism.epsilon`):
``max(ln(c_in / c_out), eps1' + ln(c_in / Q), ln((Q + 1) / c_out) - eps1')``, at most the
ideal one. The report is ``(2 j - n + 1) * step``, a multiple of a power of two ``step``; its
mean is ``value_gain * v`` with ``value_gain`` in [0.7, 1.5], which the estimators divide out.
The flipped points' mean is 0 up to ``n 2^-64`` of a point (their counts differ by one word),
and the rounding goes up with probability ``floor(frac 2^18) / 2^18`` (a downward bias below
2^-18 input steps, as M_L's): both far below any standard error the estimators report.
Draws: two raw 64-bit words per client (three for d > 2): the group decision in the top
:data:`~fedparity.mechanisms.ldp.laplace.GROUP_BITS` bits of the first and the rounding in its
low :data:`~fedparity.mechanisms.ldp.laplace.ROUNDING_BITS`, the point in the second, the other
group in the third.

Privacy noise should come from :func:`fedparity.mechanisms.crypto.secure_random.secure_generator`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from ..validation import check_clients, check_epsilon, check_generator, check_num_groups
from .discrete_laplace import uniform_index, uniform_words
from .laplace import GRID_STEP, ROUNDING_BITS, keep_fraction
from .randomized_response import grr_keep_probability
from .reports import GroupValueMechanism, PerturbedReports, ReportMoments

__all__ = [
    "MAX_EPSILON_VALUE",
    "MIN_EPSILON_VALUE",
    "PiecewiseGrid",
    "PiecewiseMechanism",
    "piecewise_epsilon",
    "piecewise_grid",
    "piecewise_variance",
]

#: The range of eps2 in which M_P releases reports (M_L's): below, its window holds nearly all
#: the mass and the reports spread over +/- 2 / eps2 * 2; above, ``m`` exceeds 2^17 points.
MIN_EPSILON_VALUE = 0.02
MAX_EPSILON_VALUE = 12.0
#: The window has at least this many points (``m >= MIN_WINDOW_POINTS * t``): the discrete
#: window's share ``w / m`` is within 1 / (2 * MIN_WINDOW_POINTS) of PM's ``1 / t``.
MIN_WINDOW_POINTS = 256
#: Input grid: v is rounded to multiples of 1 / INPUT_STEPS (M_L's grid step).
INPUT_STEPS = round(1.0 / GRID_STEP)
_TWO_64 = 2**64


def piecewise_epsilon(epsilon_group: float, epsilon_value: float, num_groups: int = 2) -> float:
    """The true LDP epsilon of the ideal M_P: max(eps2, eps1 + eps2 / 2), any d >= 2 (M_L's).

    Two kept clients of one group: PM's e^eps2. A kept client against a client of another
    group (flipped, uniform on [-C, C]) in the kept one's group: e^eps1 times the ratio of PM's
    density to the uniform one, t or 1 / t (t = e^(eps2 / 2)). Two flipped clients: 1.
    """
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    check_num_groups(num_groups)
    return max(epsilon_value, epsilon_group + 0.5 * epsilon_value)


def piecewise_variance(epsilon_value: float, value: float = 0.0) -> float:
    """Var of the continuous PM's report at ``value``: v^2 / (t - 1) + (t + 3) / (3 (t - 1)^2),
    t = e^(eps2 / 2) (Wang et al. 2019, Lemma 1); finite for every eps2 > 0."""
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    e = math.exp(-epsilon_value / 2.0)  # 1 / t
    em = -math.expm1(-epsilon_value / 2.0)  # 1 - 1 / t = (t - 1) / t
    # (t + 3) / (3 (t - 1)^2) = (1 + 3 / t) / t / (3 ((t - 1) / t)^2)
    return value * value * e / em + (1.0 + 3.0 * e) * e / (3.0 * em * em)


def _uniform_second_moment(epsilon_value: float) -> float:
    """C^2 / 3: the second moment of a flipped report of the continuous M_P (uniform on
    [-C, C], C = (t + 1) / (t - 1))."""
    e = math.exp(-epsilon_value / 2.0)
    bound = (1.0 + e) / -math.expm1(-epsilon_value / 2.0)
    return bound * bound / 3.0


@dataclass(frozen=True)
class PiecewiseGrid:
    """The integer design of M_P's value step for one eps2 (:func:`piecewise_grid`).

    Attributes
    ----------
    window, outside : int
        ``w`` and ``m = 2 k N`` output points inside and outside a window.
    shift : int
        ``k``: the window moves by ``k`` points per input grid step.
    inside_count, outside_count : int
        ``c_in`` and ``c_out``: the 64-bit words that give each window point, each outside
        point (``w c_in + m c_out = 2^64``).
    flipped_count : int
        ``Q = floor(2^64 / n)``: a flipped client's point has ``Q`` or ``Q + 1`` words.
    step : float
        A power of two: the report of point ``j`` is ``(2 j - n + 1) * step``.
    """

    window: int
    outside: int
    shift: int
    inside_count: int
    outside_count: int
    flipped_count: int
    step: float

    @property
    def points(self) -> int:
        """``n = w + m``."""
        return self.window + self.outside

    @property
    def epsilon(self) -> float:
        """``ln(c_in / c_out)``: the largest ratio of one report's probabilities between two
        kept inputs (a window point against an outside point)."""
        return math.log(self.inside_count) - math.log(self.outside_count)

    @property
    def flipped_excess(self) -> float:
        """``ln(c_in / Q)``: the largest ratio of a kept point's probability to a flipped one's."""
        return math.log(self.inside_count) - math.log(self.flipped_count)

    @property
    def flipped_deficit(self) -> float:
        """``ln((Q + 1) / c_out)``: the largest ratio of a flipped point's probability to a kept
        one's."""
        return math.log(self.flipped_count + 1) - math.log(self.outside_count)

    @property
    def gain(self) -> float:
        """E[report | x] / (x / N) = 2 step (c_in - c_out) / 2^64 w k N."""
        spread = (self.inside_count - self.outside_count) / _TWO_64
        return 2.0 * self.step * spread * self.window * self.shift * INPUT_STEPS

    def window_start(self, x: int) -> int:
        """The first point of the window of grid input ``x`` in ``-N .. N``."""
        return self.shift * (x + INPUT_STEPS)

    def point_counts(self, x: int) -> NDArray[np.uint64]:
        """The 64-bit words that give each output point for grid input ``x``: its realised
        distribution times 2^64 (integers, summing to 2^64)."""
        counts = np.full(self.points, self.outside_count, dtype=np.uint64)
        start = self.window_start(x)
        counts[start : start + self.window] = self.inside_count
        return counts

    def flipped_point_counts(self) -> NDArray[np.uint64]:
        """The 64-bit words that give each output point to a flipped client (``floor(u n /
        2^64)``): ``Q`` or ``Q + 1`` each, summing to 2^64."""
        edges = [-((-j * _TWO_64) // self.points) for j in range(self.points + 1)]  # ceil
        return np.array(np.diff(np.array(edges, dtype=object)), dtype=np.uint64)

    def points_for(self, x: NDArray[np.int64], words: NDArray[np.uint64]) -> NDArray[np.int64]:
        """The output point for grid inputs ``x`` from uniform 64-bit ``words``."""
        inside_words = np.uint64(self.window * self.inside_count)
        inside = words < inside_words
        start = (self.shift * (x + INPUT_STEPS)).astype(np.uint64)  # each window's first point
        # words >= w c_in: the outside point's index; the wrapped values below are discarded
        index = (words - inside_words) // np.uint64(self.outside_count)
        outside = index + np.where(index >= start, np.uint64(self.window), np.uint64(0))
        point = np.where(inside, start + words // np.uint64(self.inside_count), outside)
        return point.astype(np.int64)


@functools.lru_cache(maxsize=256)
def piecewise_grid(epsilon_value: float) -> PiecewiseGrid:
    """M_P's integer design for ``epsilon_value`` in [:data:`MIN_EPSILON_VALUE`,
    :data:`MAX_EPSILON_VALUE`]; ``ValueError`` outside it.

    ``m`` is the smallest power of two >= max(2 N, MIN_WINDOW_POINTS t), ``w = round(m / t)``,
    and ``c_out`` the smallest integer for which ``c_in = (2^64 - m c_out) / w`` is an integer
    and ``c_in / c_out <= e^eps2``, ``c_in / Q <= t`` and ``(Q + 1) / c_out <= t`` (the last two
    hold with equality for the continuous PM, where ``w / m = 1 / t``).
    """
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    if not MIN_EPSILON_VALUE <= epsilon_value <= MAX_EPSILON_VALUE:
        raise ValueError(
            f"epsilon_value must be in [{MIN_EPSILON_VALUE:g}, {MAX_EPSILON_VALUE:g}] for M_P "
            f"to release reports, got {epsilon_value!r}: below, a report spreads over more than "
            "a hundred times the values' range; above, its grid would need more than 2^17 "
            "points (use M_R there)"
        )
    t = math.exp(epsilon_value / 2.0)
    least = max(2 * INPUT_STEPS, math.ceil(MIN_WINDOW_POINTS * t))
    outside = 1 << (least - 1).bit_length()  # the smallest power of two >= least
    window = max(1, round(outside / t))
    shift = outside // (2 * INPUT_STEPS)
    # w c_in + m c_out = 2^64: with g = gcd(w, m) (a power of two), c_out must be
    # 2^64 / g * (m / g)^-1 modulo w / g
    common = math.gcd(window, outside)
    modulus = window // common
    residue = 0
    if modulus > 1:
        residue = (_TWO_64 // common) * pow(outside // common, -1, modulus) % modulus
    points = window + outside
    flipped_count = _TWO_64 // points
    # the ratio c_in / c_out that keeps both cross ratios (against the uniform flipped point)
    # at or below t: (w R + m) / n <= t and R n / (w R + m) <= t
    ratio = (t * points - outside) / window
    if points > t * window:
        ratio = min(ratio, t * outside / (points - t * window))
    ratio = min(ratio, math.exp(epsilon_value))
    outside_count = math.ceil(_TWO_64 / (window * ratio + outside))
    outside_count += (residue - outside_count) % max(modulus, 1)
    half = epsilon_value / 2.0
    while True:
        inside_count = (_TWO_64 - outside * outside_count) // window
        if (
            math.log(inside_count) - math.log(outside_count) <= epsilon_value
            and math.log(inside_count) - math.log(flipped_count) <= half
            and math.log(flipped_count + 1) - math.log(outside_count) <= half
        ):
            break
        outside_count += max(modulus, 1)
    if window * inside_count + outside * outside_count != _TWO_64:  # pragma: no cover
        raise AssertionError("the window and outside words do not fill 2^64")
    spread = (inside_count - outside_count) / _TWO_64
    ideal_step = 1.0 / (2.0 * spread * window * shift * INPUT_STEPS)
    step = 2.0 ** round(math.log2(ideal_step))
    return PiecewiseGrid(window, outside, shift, inside_count, outside_count, flipped_count, step)


@dataclass(frozen=True)
class PiecewiseMechanism(GroupValueMechanism):
    """M_P for d >= 2 groups: GRR with eps1 on the group, PM with eps2 on the value, on a grid.

    Kept clients report PM(round(v)), flipped clients a uniform point of PM's output range,
    where round() is randomised rounding to multiples of :data:`GRID_STEP` and PM the grid
    Piecewise mechanism of :func:`piecewise_grid`. Reports are float64 multiples of its
    power-of-two step.

    Parameters
    ----------
    epsilon_group, epsilon_value : float
        eps1 and eps2, both > 0. Reports are released only for eps2 in
        [:data:`MIN_EPSILON_VALUE`, :data:`MAX_EPSILON_VALUE`]; outside, the mechanism plans
        with the continuous PM's moments and :meth:`perturb` refuses.
    num_groups : int
        d >= 2.

    References
    ----------
    .. [1] N. Wang, X. Xiao, Y. Yang, J. Zhao, S. C. Hui, H. Shin, J. Shin and G. Yu,
           "Collecting and Analyzing Multidimensional Data with Local Differential Privacy",
           IEEE ICDE 2019. Algorithm 2 (PM) and Lemma 1 (its variance).
    .. [2] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022
           (the group step and the estimators).
    """

    name: ClassVar[Literal["P"]] = "P"

    # -- the grid -------------------------------------------------------------------------

    @property
    def releasable(self) -> bool:
        """eps2 is in the range in which reports are released."""
        return MIN_EPSILON_VALUE <= self.epsilon_value <= MAX_EPSILON_VALUE

    @property
    def grid(self) -> PiecewiseGrid:
        """The value step's integer design (``ValueError`` outside the releasable range)."""
        return piecewise_grid(self.epsilon_value)

    def check_releasable(self) -> None:
        """``ValueError`` unless this mechanism can release reports."""
        piecewise_grid(self.epsilon_value)

    @property
    def report_bound(self) -> float:
        """Largest ``|v'|`` a report can take: ``(n - 1) * step``."""
        grid = self.grid
        return (grid.points - 1) * grid.step

    @property
    def group_keep_fraction(self) -> tuple[int, int]:
        """The realised keep probability a' = numerator / 2^bits <= a of the group step."""
        return keep_fraction(self.group_keep_probability)

    @property
    def group_keep_probability(self) -> float:
        return grr_keep_probability(self.epsilon_group, self.num_groups)

    # -- privacy --------------------------------------------------------------------------

    @property
    def ideal_epsilon(self) -> float:
        """max(eps2, eps1 + eps2 / 2) (:func:`piecewise_epsilon`)."""
        return piecewise_epsilon(self.epsilon_group, self.epsilon_value, self.num_groups)

    @property
    def epsilon(self) -> float:
        """The LDP epsilon of what is released, from the realised integer probabilities:
        max(ln(c_in / c_out), eps1' + ln(c_in / Q), ln((Q + 1) / c_out) - eps1')
        (:class:`PiecewiseGrid`), eps1' the GRR epsilon of the realised keep probability; at
        most :attr:`ideal_epsilon`. Outside the releasable range this is the ideal value, for
        planning only."""
        if not self.releasable:
            return self.ideal_epsilon
        numerator, bits = self.group_keep_fraction
        kept = numerator / 2.0**bits
        # each other group is drawn with probability >= 1 / (d - 1) - 2^-64 (uniform_index)
        other = (1.0 - kept) * max(1.0 / (self.num_groups - 1) - 2.0**-64, 0.0)
        epsilon_group = math.log(kept / other)
        grid = self.grid
        return max(
            grid.epsilon,
            epsilon_group + grid.flipped_excess,
            grid.flipped_deficit - epsilon_group,
        )

    @property
    def moments(self) -> ReportMoments:
        """Report moments of the grid mechanism, exact for its realised probabilities.

        In point units ``Y = j - (n - 1) / 2`` with ``p = c_out / 2^64`` and
        ``D = (c_in - c_out) / 2^64``: E[Y | x] = D w k x and
        E[Y^2 | x] = (p n (n^2 - 1) + D w (w^2 - 1)) / 12 + D w k^2 x^2; the report is
        2 step Y. Kept values add at most 1 / (4 N^2) of rounding variance (taken at that
        bound). A flipped report is uniform on the n points: E[Y^2] = (n^2 - 1) / 12. Outside
        the releasable range: the continuous PM (Wang et al. 2019, Lemma 1) and C^2 / 3.
        """
        numerator, bits = self.group_keep_fraction
        if not self.releasable:
            base = piecewise_variance(self.epsilon_value, 0.0)
            return ReportMoments(
                num_groups=self.num_groups,
                keep_probability=numerator / 2.0**bits,
                value_gain=1.0,
                kept_second_moment=base,
                kept_second_moment_slope=1.0 + piecewise_variance(self.epsilon_value, 1.0) - base,
                flipped_second_moment=_uniform_second_moment(self.epsilon_value),
            )
        grid = self.grid
        n, w = float(grid.points), float(grid.window)
        p = grid.outside_count / _TWO_64
        spread = (grid.inside_count - grid.outside_count) / _TWO_64
        scale = 4.0 * grid.step**2  # (2 step)^2
        base = scale * (p * n * (n * n - 1.0) + spread * w * (w * w - 1.0)) / 12.0
        slope = grid.gain**2 / (spread * w)
        return ReportMoments(
            num_groups=self.num_groups,
            keep_probability=numerator / 2.0**bits,
            value_gain=grid.gain,
            kept_second_moment=base + slope / (4.0 * INPUT_STEPS**2),
            kept_second_moment_slope=slope,
            flipped_second_moment=scale * (n * n - 1.0) / 12.0,
        )

    def is_valid_report_value(self, values: np.ndarray) -> np.ndarray:
        """Output domain check: ``(2 j - n + 1) * step`` for a point ``j`` in ``0 .. n - 1``."""
        grid = self.grid
        array = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            units = array / grid.step  # exact: the step is a power of two
            whole = np.isfinite(array) & (units == np.round(units))
            parity = np.mod(np.where(whole, units, 0.0) + (grid.points - 1), 2.0) == 0.0
            return whole & (np.abs(array) <= self.report_bound) & parity

    # -- sampling -------------------------------------------------------------------------

    def _draw(
        self, groups: np.ndarray, values: np.ndarray, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """(reported group, report) of clients, from raw 64-bit words only: word 0 holds the
        group decision (its top bits) and the rounding (its low bits), word 1 the output
        point, word 2 (d > 2) the other group."""
        grid = self.grid
        count = groups.shape[0]
        raw = uniform_words(rng, (3 if self.num_groups > 2 else 2, count))
        numerator, bits = self.group_keep_fraction
        kept = (raw[0] >> np.uint64(64 - bits)) < np.uint64(numerator)
        if self.num_groups == 2:
            out_groups = np.where(kept, groups, 1 - groups).astype(np.int64)
        else:
            other = uniform_index(raw[2], self.num_groups - 1).astype(np.int64)
            other += other >= groups
            out_groups = np.where(kept, groups, other).astype(np.int64)
        # randomised rounding to the grid: floor(v N + u), u uniform on multiples of 2^-18
        dither = (raw[0] & np.uint64(2**ROUNDING_BITS - 1)).astype(np.float64)
        dither *= 2.0**-ROUNDING_BITS
        dither += np.asarray(values, dtype=np.float64) * INPUT_STEPS
        x = np.clip(np.floor(dither), -INPUT_STEPS, INPUT_STEPS).astype(np.int64)
        point = np.where(
            kept,
            grid.points_for(x, raw[1]),
            uniform_index(raw[1], grid.points).astype(np.int64),  # flipped: a uniform point
        )
        report = (2 * point - (grid.points - 1)).astype(np.float64) * grid.step
        return out_groups, report

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each client's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1)."""
        self.check_releasable()
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        groups = np.asarray(groups, dtype=np.int64)
        out_groups, report = self._draw(groups, values, rng)
        return PerturbedReports(out_groups, report)
