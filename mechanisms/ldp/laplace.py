"""The M_L gap mechanism: GRR on the group, Laplace noise on the value.

Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022
(Juarez and Korolova 2022 below), Section 4 and Appendix A.2. Only the noise ratio k = 2 is
LDP (:func:`check_noise_ratio` says why, :func:`laplace_epsilon` gives the true epsilon): the
paper's Theorem 6 for general k is false, and so are its "M_L opt." allocations.

Reports on a grid. A Laplace mechanism on IEEE doubles leaks the value through the low
mantissa bits of its output (Mironov, CCS 2012: with v = -1 and outputs in [0.5, 1) the last
bit is always 0, with v = +1 it is odd a third of the time). M_L here releases exact multiples
of :data:`GRID_STEP`: the value is rounded to the grid at random (unbiased), the noise is a
discrete Laplace on the grid with the same scale ``2 / eps2`` (Canonne, Kamath and Steinke
2020), drawn with integer operations only, and the report is clamped to
``+/- (1 + TAIL_SCALES * 2 / eps2)`` (:mod:`fedparity.mechanisms.ldp.discrete_laplace`). The
mechanism's :attr:`~LaplaceMechanism.epsilon` is computed from the probabilities the integer
sampler actually realises, not assumed.

Draws: raw 64-bit words of the generator's bit generator, all integer comparisons. Per client
one word for the value step (from the top: the noise table's column, the top bits of its
threshold draw, and in the low 18 bits the rounding) and a 16-bit piece of a shared word for
the group decision (four clients to a word); for d > 2 one more word for the other group. Each
decision reads only the bits that decide it and, where those tie with the threshold's (about
2^-16 of the group decisions, at most 2^-26 of the noise draws), the rest of its draw from a
fresh word, so every draw is still uniform on its full grid and the realised probabilities are
exactly the tables' (:func:`_keep_decisions`,
:meth:`~fedparity.mechanisms.ldp.discrete_laplace.DiscreteLaplaceNoise.sample_packed`). The
keep probability is realised as the multiple of ``2^-26`` just below ``a``; the computed
epsilon and the report moments (so the estimators) use that realised value. The rounding goes
up with probability ``floor(frac 2^18) / 2^18``: a downward bias below ``2^-18`` grid steps
(1.5e-8 on the [-1, 1] scale, far below any standard error the estimators report). Clients
are processed in blocks of :data:`BLOCK` (cache-sized).

Privacy noise should come from :func:`fedparity.mechanisms.crypto.secure_random.secure_generator`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..validation import check_clients, check_epsilon, check_generator, check_num_groups
from .discrete_laplace import (
    DiscreteLaplaceNoise,
    discrete_laplace_noise,
    uniform_index,
    uniform_words,
)
from .randomized_response import grr_keep_probability
from .reports import GroupValueMechanism, PerturbedReports, ReportMoments, ReportSummary

#: Reports are multiples of this step (2^-8 of the [-1, 1] value scale).
GRID_STEP = 2.0**-8
#: Relative widenings of the noise scale tried in turn until the realised epsilon of the
#: quantised table is at or below the ideal one (the first suffices for eps2 >= 0.05; the
#: variance grows by twice the widening).
SCALE_SLACKS = (1e-6, 1e-5, 1e-4, 1e-3)
#: The range of eps2 in which M_L releases reports: the noise table has ~20500 / eps2 + 1000
#: entries, and its smallest probabilities are ~e^-(20 + eps2) of the largest.
MIN_EPSILON_VALUE = 0.02
MAX_EPSILON_VALUE = 12.0
#: Tables have at most 2^COLUMN_FIELD_BITS columns (the top bits of a client's value word).
COLUMN_FIELD_BITS = 20
#: The keep probability is realised on the grid of 2^-GROUP_BITS.
GROUP_BITS = 26
#: The group decision's top bits, read from a 16-bit piece of a shared word (four clients to
#: a word); the rest of the draw only when they tie with the numerator's.
GROUP_PIECE_BITS = 16
GROUP_PIECES = 64 // GROUP_PIECE_BITS
#: The randomised rounding reads the low ROUNDING_BITS bits of a client's value word.
ROUNDING_BITS = 18
#: Clients per block inside :meth:`LaplaceMechanism.perturb` (the arrays stay in cache).
BLOCK = 8192
#: Reports are clamped to +/- (1 + this many noise scales 2 / eps2); the tail beyond it is
#: e^-20 ~ 2e-9 of the mass, so the clamp's bias on a group mean is below 1e-8 noise scales.
TAIL_SCALES = 20.0

#: The only noise-scale ratio for which M_L is LDP (Juarez and Korolova 2022, Theorem 6 is
#: false for every k != 2; see :func:`check_noise_ratio`).
LDP_NOISE_RATIO = 2.0


def keep_fraction(keep_probability: float) -> tuple[int, int]:
    """(numerator, :data:`GROUP_BITS`): the group step's keep probability realised on the
    grid of ``2^-GROUP_BITS``, the largest multiple at or below it (below 1)."""
    bits = GROUP_BITS
    return min(math.floor(keep_probability * 2.0**bits), 2**bits - 1), bits


class UnboundedPrivacyLossError(ValueError):
    """Raised for M_L with a noise ratio k != 2: its privacy loss is unbounded."""


def check_noise_ratio(noise_ratio: float) -> float:
    """Refuse k != 2, explaining why (Juarez and Korolova 2022, Theorem 6 is false there)."""
    ratio = float(noise_ratio)
    if ratio != LDP_NOISE_RATIO:
        heavier = "kept" if ratio < LDP_NOISE_RATIO else "flipped"
        raise UnboundedPrivacyLossError(
            f"noise_ratio k must be 2 for M_L, got {noise_ratio!r}: a kept client's value gets "
            f"Lap(2/eps2) noise and a flipped client's gets Lap(k/eps2); with k != 2 the "
            f"{heavier} density has the heavier tail, so the likelihood ratio between a kept "
            "and a flipped input grows without bound as |v'| grows and no finite epsilon "
            "holds (the paper's Theorem 6 is false for every k != 2)."
        )
    return ratio


def laplace_epsilon(
    epsilon_group: float,
    epsilon_value: float,
    num_groups: int = 2,
    noise_ratio: float = LDP_NOISE_RATIO,
) -> float:
    """The true LDP epsilon of M_L with k = 2: max(eps2, eps1 + eps2 / 2), any d >= 2.

    Juarez and Korolova 2022, Appendix A.2 (the proof there is only for k = 2, and it is
    right; the paper's Theorem 6 for general k is false). Raises
    :class:`UnboundedPrivacyLossError` for k != 2.

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Theorem 6 and Appendix A.2.
    """
    epsilon_group = check_epsilon("epsilon_group", epsilon_group)
    epsilon_value = check_epsilon("epsilon_value", epsilon_value)
    check_num_groups(num_groups)
    check_noise_ratio(noise_ratio)
    return max(epsilon_value, epsilon_group + 0.5 * epsilon_value)


def laplace_noise_variance(epsilon_value: float, noise_ratio: float) -> float:
    """Variance 2 (k / eps2)^2 of Lap(k / eps2) (k = 2 for kept clients)."""
    return 2.0 * (noise_ratio / epsilon_value) ** 2


def laplace_report_moments(
    epsilon_group: float, epsilon_value: float, num_groups: int, noise_ratio: float
) -> ReportMoments:
    """Report moments of M_L for any k (also the paper's invalid ones, for formula checks)."""
    return ReportMoments(
        num_groups=num_groups,
        keep_probability=grr_keep_probability(epsilon_group, num_groups),
        value_gain=1.0,
        kept_second_moment=laplace_noise_variance(epsilon_value, LDP_NOISE_RATIO),
        kept_second_moment_slope=1.0,
        flipped_second_moment=laplace_noise_variance(epsilon_value, noise_ratio),
    )


@functools.lru_cache(maxsize=64)
def _grid_noise(epsilon_value: float) -> tuple[DiscreteLaplaceNoise, int, float]:
    """(noise table, clamp in grid steps, realised value epsilon) of M_L's value step.

    The value epsilon of the grid mechanism is ``2 (1 / step) rho``: a value moves by at most
    ``2 / step`` grid steps and each step changes a report's log-probability by at most
    ``rho`` (:meth:`DiscreteLaplaceNoise.max_log_ratio` of the realised table).
    """
    if not MIN_EPSILON_VALUE <= epsilon_value <= MAX_EPSILON_VALUE:
        raise ValueError(
            f"epsilon_value must be in [{MIN_EPSILON_VALUE:g}, {MAX_EPSILON_VALUE:g}] for M_L "
            f"to release reports, got {epsilon_value!r}: below, its noise table would need more "
            "than a million entries; above, the probabilities it must tell apart (a ratio of "
            "e^eps2 between v = -1 and v = +1) are finer than its 64-bit sampler resolves "
            "(use M_R there)"
        )
    values = round(1.0 / GRID_STEP)
    ideal_scale = LDP_NOISE_RATIO / epsilon_value / GRID_STEP
    for slack in SCALE_SLACKS:
        scale = ideal_scale * (1.0 + slack)
        # TAIL_SCALES noise scales beyond the largest value: the clamp's bias stays ~e^-20
        clamp = values + math.ceil(TAIL_SCALES * scale)
        noise = discrete_laplace_noise(scale, clamp + values)
        realised = 2 * values * noise.max_log_ratio(clamp)
        if realised <= epsilon_value:
            return noise, clamp, realised
    raise ValueError(  # pragma: no cover - the widest slack leaves a margin of ~1e-3
        f"no grid table for epsilon_value {epsilon_value!r} keeps the realised epsilon below it"
    )


class _SamplerPlan(NamedTuple):
    """What :meth:`LaplaceMechanism._draw` needs of the tables, built once per mechanism."""

    noise: DiscreteLaplaceNoise
    cap: float
    clamp: float
    numerator: int  # of the keep probability, over 2^GROUP_BITS
    top: np.uint16  # the numerator's top GROUP_PIECE_BITS bits
    rounding_mask: np.uint64


@functools.lru_cache(maxsize=64)
def _sampler_plan(epsilon_group: float, epsilon_value: float, num_groups: int) -> _SamplerPlan:
    noise, clamp, _ = _grid_noise(epsilon_value)
    numerator, _ = keep_fraction(grr_keep_probability(epsilon_group, num_groups))
    return _SamplerPlan(
        noise,
        float(noise.cap),
        float(clamp),
        numerator,
        np.uint16(numerator >> (GROUP_BITS - GROUP_PIECE_BITS)),
        np.uint64(2**ROUNDING_BITS - 1),
    )


def _keep_decisions(
    pieces: NDArray[np.uint16], plan: _SamplerPlan, rng: np.random.Generator
) -> NDArray[np.bool_]:
    """Whether each client keeps its group: ``x < numerator`` for a uniform
    :data:`GROUP_BITS`-bit draw ``x`` whose top 16 bits are the client's piece. The piece
    decides unless it equals the numerator's top 16 bits (probability 2^-16); such a client
    reads the low bits of ``x`` from a fresh word's top bits, so ``x`` is uniform on its grid
    and the keep probability is exactly ``numerator / 2^GROUP_BITS``."""
    kept = pieces < plan.top
    ties = np.flatnonzero(pieces == plan.top)
    if ties.size:
        low_bits = GROUP_BITS - GROUP_PIECE_BITS
        low = uniform_words(rng, ties.shape[0]) >> np.uint64(64 - low_bits)
        kept[ties] = ((int(plan.top) << low_bits) | low) < np.uint64(plan.numerator)
    return kept


@dataclass(frozen=True)
class LaplaceMechanism(GroupValueMechanism):
    """M_L with k = 2 for d >= 2 groups, reporting on a grid.

    Group step: GRR with eps1. Kept clients report v' = round(v) + Z, flipped clients
    report v' = 0 + Z, where round() is randomised rounding to the grid of
    :data:`GRID_STEP` and Z a discrete Laplace on that grid with scale 2/eps2 (k = 2),
    clamped to ``+/- TAIL_SCALES * 2 / eps2``. Reports are float64 multiples of the step.

    Parameters
    ----------
    epsilon_group, epsilon_value : float
        eps1 and eps2, both > 0.
    num_groups : int
        d >= 2.
    noise_ratio : float
        k; must be 2 (anything else raises :class:`UnboundedPrivacyLossError`).

    References
    ----------
    .. [1] M. Juarez and A. Korolova, "'You Can't Fix What You Can't Measure': Privately
           Measuring Demographic Performance Disparities in Federated Learning", Workshop on
           Algorithmic Fairness through the Lens of Causality and Privacy (AFCP), PMLR, 2022.
           Section 4 and Appendix A.2 (M_L).
    .. [2] C. Canonne, G. Kamath and T. Steinke, "The discrete Gaussian for differential
           privacy", NeurIPS 2020 (the discrete Laplace).
    """

    noise_ratio: float = LDP_NOISE_RATIO

    name: ClassVar[Literal["L"]] = "L"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_noise_ratio(self.noise_ratio)

    # -- the grid -------------------------------------------------------------------------

    @property
    def grid_scale(self) -> float:
        """The noise scale in grid steps: 2 / eps2 / step, widened by the first of
        :data:`SCALE_SLACKS` for which the realised epsilon of the quantised sampler stays
        at or below :attr:`ideal_epsilon`."""
        return _grid_noise(self.epsilon_value)[0].scale

    @property
    def clamp_steps(self) -> int:
        """Reports are clamped to +/- this many grid steps."""
        return _grid_noise(self.epsilon_value)[1]

    @property
    def report_bound(self) -> float:
        """Largest ``|v'|`` a report can take."""
        return self.clamp_steps * GRID_STEP

    @property
    def _noise(self) -> DiscreteLaplaceNoise:
        return _grid_noise(self.epsilon_value)[0]

    @property
    def group_keep_fraction(self) -> tuple[int, int]:
        """The realised keep probability a' = numerator / 2^bits <= a of the group step."""
        return keep_fraction(self.group_keep_probability)

    # -- privacy --------------------------------------------------------------------------

    @property
    def ideal_epsilon(self) -> float:
        """max(eps2, eps1 + eps2 / 2): the true epsilon of the ideal mechanism."""
        return laplace_epsilon(self.epsilon_group, self.epsilon_value, self.num_groups)

    @property
    def epsilon(self) -> float:
        """The LDP epsilon of what is actually released: max(eps2', eps1' + eps2' / 2), with
        eps2' = 2 (1 / step) rho, rho the largest log ratio of neighbouring realised noise
        probabilities (:meth:`DiscreteLaplaceNoise.max_log_ratio`), and eps1' the GRR
        epsilon of the realised keep probability: at most :attr:`ideal_epsilon`, and within
        a relative 1e-3 of it. Outside [:data:`MIN_EPSILON_VALUE`, :data:`MAX_EPSILON_VALUE`]
        the mechanism cannot release (:meth:`perturb` refuses) and this is the ideal value, for
        planning only."""
        if not MIN_EPSILON_VALUE <= self.epsilon_value <= MAX_EPSILON_VALUE:
            return self.ideal_epsilon
        epsilon_value = _grid_noise(self.epsilon_value)[2]
        numerator, bits = self.group_keep_fraction
        kept = numerator / 2.0**bits
        # each other group is drawn with probability >= 1 / (d - 1) - 2^-64 (uniform_index)
        other = (1.0 - kept) * max(1.0 / (self.num_groups - 1) - 2.0**-64, 0.0)
        epsilon_group = math.log(kept / other)
        return max(epsilon_value, epsilon_group + epsilon_value / 2.0)

    @property
    def group_keep_probability(self) -> float:
        return grr_keep_probability(self.epsilon_group, self.num_groups)

    @property
    def noise_scale(self) -> float:
        """Laplace scale 2 / eps2 (the same for kept and flipped clients since k = 2)."""
        return LDP_NOISE_RATIO / self.epsilon_value

    @property
    def moments(self) -> ReportMoments:
        """Report moments of the grid mechanism: the noise variance of the discrete Laplace of
        scale 2 / eps2 on the grid, ``2 r / (1 - r)^2`` steps^2 with ``r = exp(-step eps2 / 2)``
        (Canonne, Kamath and Steinke 2020), plus at most step^2 / 4 of rounding variance for
        kept values (taken at that bound). The sampler's scale is wider by its slack (1e-6
        relative for eps2 >= 0.05, at most 1e-3) and its clamp cuts an e^-20 tail: the
        realised variance differs from this by less than that relative amount."""
        r = math.exp(-self.epsilon_value * GRID_STEP / LDP_NOISE_RATIO)
        noise = 2.0 * r / (1.0 - r) ** 2 * GRID_STEP**2
        numerator, bits = self.group_keep_fraction
        keep = numerator / 2.0**bits  # the realised a' the estimators must divide by
        return ReportMoments(
            num_groups=self.num_groups,
            keep_probability=keep,
            value_gain=1.0,
            kept_second_moment=noise + GRID_STEP**2 / 4.0,
            kept_second_moment_slope=1.0,
            flipped_second_moment=noise,
        )

    def is_valid_report_value(self, values: np.ndarray) -> np.ndarray:
        """Output domain check: a finite multiple of the grid step within the clamp."""
        array = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            steps = array / GRID_STEP
            return (
                np.isfinite(array)
                & (np.abs(array) <= self.report_bound)
                & (steps == np.round(steps))
            )

    # -- sampling -------------------------------------------------------------------------

    def _draw(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        in_steps: bool = False,
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_] | NDArray[np.int64], NDArray[np.float64]]:
        """(kept, reported group, report) of a block, from raw 64-bit draws only; for d = 2
        the reported group is a boolean (group 1). ``in_steps``: the report in grid steps
        (exact integers as float64), not yet multiplied by :data:`GRID_STEP`.

        Words: one per client for the noise and the rounding, a 16-bit piece of a shared word
        for the group decision (four clients to a word), and for d > 2 one more for the other
        group, all from one call to the generator; rare ties read a fresh word
        (:func:`_keep_decisions`, :meth:`DiscreteLaplaceNoise.sample_packed`).
        """
        plan = _sampler_plan(self.epsilon_group, self.epsilon_value, self.num_groups)
        count = groups.shape[0]
        pieces = -(-count // GROUP_PIECES)
        raw = uniform_words(rng, count + pieces + (count if self.num_groups > 2 else 0))
        words = raw[:count]
        kept = _keep_decisions(raw[count : count + pieces].view(np.uint16)[:count], plan, rng)
        if self.num_groups == 2:
            out_groups = np.equal(groups, kept)  # reported group 1 (groups are 0 or 1)
        else:
            other = uniform_index(raw[count + pieces :], self.num_groups - 1).astype(np.int64)
            other += other >= groups
            out_groups = np.where(kept, groups, other)
        # randomised rounding to the grid: floor(v / step + u) with u uniform on the multiples
        # of 2^-18 in [0, 1) (the word's low bits): up with probability floor(frac 2^18) / 2^18;
        # a flipped client's report is floor(0 + u) + Z = Z
        report = np.multiply(values, 1.0 / GRID_STEP)
        report *= kept
        report += np.multiply((words & plan.rounding_mask).view(np.int64), 2.0**-ROUNDING_BITS)
        np.floor(report, out=report)
        report += plan.noise.sample_packed(words, ROUNDING_BITS, rng)
        if report.size and (report.max() > plan.clamp or report.min() < -plan.clamp):
            np.clip(report, -plan.clamp, plan.clamp, out=report)
        if not in_steps:
            report *= GRID_STEP
        return kept, out_groups, report

    def _blocks(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        in_steps: bool = False,
    ) -> Iterator[tuple[NDArray[np.bool_] | NDArray[np.int64], NDArray[np.float64]]]:
        """(reported group, report) of each block of :data:`BLOCK` clients (:meth:`_draw`)."""
        values = np.asarray(values, dtype=np.float64)
        for start in range(0, groups.shape[0], BLOCK):
            block = slice(start, start + BLOCK)
            _, out_groups, report = self._draw(groups[block], values[block], rng, in_steps)
            yield out_groups, report

    def check_releasable(self) -> None:
        """``ValueError`` unless this mechanism can release reports (eps2 in
        [:data:`MIN_EPSILON_VALUE`, :data:`MAX_EPSILON_VALUE`]); builds its noise table."""
        _grid_noise(self.epsilon_value)

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each client's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1)."""
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        parts = [(g.astype(np.int64), v) for g, v in self._blocks(groups, values, rng)]
        if not parts:
            return PerturbedReports(np.zeros(0, dtype=np.int64), np.zeros(0))
        return PerturbedReports(
            np.concatenate([g for g, _ in parts]), np.concatenate([v for _, v in parts])
        )

    def perturb_and_summarize(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> ReportSummary:
        """The summary of :meth:`perturb`'s reports (same draws), without keeping them.

        For d = 2 the per-group sums come from dot products instead of ``bincount``
        (the streaming fast path); they equal ``from_reports`` up to summation order.
        """
        if validate:
            groups, values = check_clients(groups, values, self.num_groups)
            rng = check_generator("rng", rng)
        if self.num_groups != 2:
            reports = self.perturb(groups, values, rng, validate=False)
            return ReportSummary.from_reports(reports.groups, reports.values, self.num_groups)
        # sums in grid steps (integers, exact in float64 below 2^53), scaled once at the end:
        # the same values as the sums of the scaled reports, since the step is a power of 2
        total = squares = sum_one = squares_one = 0.0
        reports_one = 0
        for out_groups, report in self._blocks(groups, values, rng, in_steps=True):
            one = out_groups.astype(np.float64)
            total += float(report.sum())
            squares += float(np.dot(report, report))
            sum_one += float(np.dot(report, one))
            report *= report
            squares_one += float(np.dot(report, one))
            reports_one += int(np.count_nonzero(out_groups))
        count = groups.shape[0]
        return ReportSummary(
            count,
            np.array([count - reports_one, reports_one], dtype=np.int64),
            np.array([total - sum_one, sum_one]) * GRID_STEP,
            np.array([squares - squares_one, squares_one]) * GRID_STEP**2,
        )
