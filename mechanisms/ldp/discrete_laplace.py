"""Laplace noise on a fixed grid, sampled with integer operations only.

The continuous Laplace mechanism on IEEE doubles leaks: the set of doubles ``v + noise`` can
take depends on ``v``, so the low mantissa bits of a report identify ``v`` (Mironov, "On
significance of the least significant bits for differential privacy", ACM CCS 2012). Here the
value is first rounded to the grid ``step * Z`` (randomised rounding, unbiased) and the noise
is a discrete Laplace variable ``Z`` on the same grid (Canonne, Kamath and Steinke, "The
discrete Gaussian for differential privacy", NeurIPS 2020, Sec. 2.2): every report is an
exact multiple of ``step``, whatever ``v`` was.

Sampling uses integer arithmetic on raw 64-bit draws only: ``Z`` comes from Walker's alias
table over ``-M .. M``, padded with empty columns to a power of two ``2^k`` (the top ``k`` bits
of one draw pick the column exactly; a second draw is compared with the column's 64-bit
threshold). The table's end points ``+/- M`` carry the whole
tails ``P(Z >= M)`` and ``P(Z <= -M)``; the report is clamped to ``[-Y, Y]``
(``Y = M - 1/step`` grid steps), so that every input has the same output set and the tail
ratios keep the Laplace bound. Because the table's probabilities are quantised, the privacy
loss is not assumed: :attr:`DiscreteLaplaceNoise.max_log_ratio` is the largest log ratio of
the *realised* probabilities of neighbouring grid points (interior points and clamped tails),
and a value shift of ``s`` grid steps costs at most ``s`` times it.

References
----------
.. [1] I. Mironov, "On significance of the least significant bits for differential
       privacy", ACM CCS 2012.
.. [2] C. Canonne, G. Kamath and T. Steinke, "The discrete Gaussian for differential
       privacy", NeurIPS 2020.
.. [3] M. D. Vose, "A linear algorithm for generating random numbers with a given
       distribution", IEEE Transactions on Software Engineering 17(9), 1991.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray
from randomgen import AESCounter

__all__ = [
    "DiscreteLaplaceNoise",
    "PackedTable",
    "discrete_laplace_noise",
    "packed_table",
    "uniform_index",
    "uniform_words",
]

_TWO_64 = float(2**64)
#: Largest table: 2^20 columns (the column is read from the top 20 bits of a draw).
MAX_COLUMN_BITS = 20
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_SIGN = np.uint64(63)
_SIGN_SHIFT = np.int64(63)


#: Bit generators whose ``random_raw`` words are their ``next_uint64`` outputs (the words
#: ``integers(0, 2^64)`` returns, about 15 % faster to draw); MT19937's raw words have 32 bits.
_RAW_64_BIT = (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, AESCounter)


def uniform_words(rng: np.random.Generator, shape: int | tuple[int, ...]) -> NDArray[np.uint64]:
    """Uniform 64-bit words: for the full range numpy returns the bit generator's
    ``next_uint64`` (64 bits for every bit generator; ``BitGenerator.random_raw`` gives 32-bit
    words for MT19937, which would leave the high bits of every word zero), read directly with
    ``random_raw`` from the generators whose raw words are those (:data:`_RAW_64_BIT`)."""
    bit_generator = rng.bit_generator
    if type(bit_generator) in _RAW_64_BIT:
        return bit_generator.random_raw(shape)
    return rng.integers(0, 1 << 64, size=shape, dtype=np.uint64)


def uniform_index(raw: NDArray[np.uint64], size: int) -> NDArray[np.uint64]:
    """``floor(raw * size / 2^64)`` exactly, for raw 64-bit draws and ``size < 2^32``: an index
    in ``[0, size)`` whose probabilities differ from ``1 / size`` by less than ``2^-64``."""
    if not 1 <= size < 2**32:
        raise ValueError(f"size must be in [1, 2^32), got {size}")
    n = np.uint64(size)
    high = (raw >> _SHIFT32) * n  # < 2^32 * size < 2^64
    low = (raw & _LOW32) * n  # < 2^64
    return (high + (low >> _SHIFT32)) >> _SHIFT32


@dataclass(frozen=True, eq=False)
class DiscreteLaplaceNoise:
    """A discrete Laplace variable ``P(Z = z) ~ exp(-|z| / scale)`` on ``-cap .. cap`` (the
    end points carry the tails), sampled from an alias table.

    Build it with :func:`discrete_laplace_noise`. :meth:`pmf` is the realised distribution
    (what the integer sampler actually draws, not the ideal one).
    """

    scale: float
    cap: int
    #: ``64 - k`` for a table of ``2^k`` columns: the column is ``draw >> column_shift``.
    column_shift: int
    threshold: NDArray[np.uint64]
    #: ``alias[j] - cap`` and ``j - alias[j]``: the drawn value is
    #: ``alias_value[j] + [draw < threshold[j]] * own_offset[j]`` (float64, exact integers).
    alias_value: NDArray[np.float64]
    own_offset: NDArray[np.float64]
    realised: NDArray[np.float64]
    #: ``(threshold[j], alias[j])`` side by side, shape ``(columns, 2)``: :meth:`sample` reads
    #: both of a column with one gather (one cache line instead of three tables' lines).
    pairs: NDArray[np.uint64]

    def pmf(self) -> NDArray[np.float64]:
        """Realised ``P(Z = z)`` for ``z = -cap .. cap``."""
        return self.realised

    def max_log_ratio(self, clamp: int) -> float:
        """The largest ``|log P(a) / P(a + 1)|`` over the outcomes a report clamped to
        ``[-clamp, clamp]`` can show: neighbouring interior points of ``Z``, and neighbouring
        tails ``P(Z >= k)`` and ``P(Z <= -k)`` for the clamp cells (``k`` from
        ``cap - 2 (cap - clamp)`` to ``cap``). A value shift of ``s`` grid steps changes the
        log-probability of any report by at most ``s`` times this."""
        pmf = self.realised
        cap = self.cap
        steps = np.abs(np.diff(np.log(pmf[1:-1])))  # z = -cap+1 .. cap-1 (inside the clamp)
        low = max(cap - 2 * (cap - clamp), -cap + 1)
        upper = np.log(np.cumsum(pmf[::-1])[::-1][low + cap :])  # P(Z >= k), k = low .. cap
        lower = np.log(np.cumsum(pmf)[: cap - low + 1][::-1])  # P(Z <= -k), k = low .. cap
        bound = max(
            float(steps.max(initial=0.0)),
            float(np.abs(np.diff(upper)).max(initial=0.0)),
            float(np.abs(np.diff(lower)).max(initial=0.0)),
        )
        # float64 logs of the realised probabilities: a relative error of a few ulps.
        return bound * (1.0 + 1e-12)

    def sample(
        self, column_draws: NDArray[np.uint64], threshold_draws: NDArray[np.uint64]
    ) -> NDArray[np.int64]:
        """``Z`` (int64) from two raw 64-bit draws per sample: column ``j`` from the first draw's
        top bits gives ``j - cap`` if the second draw is below ``threshold[j]``, else
        ``alias[j] - cap``."""
        column = (column_draws >> np.uint64(self.column_shift)).astype(np.intp)
        pair = self.pairs.take(column, axis=0)
        own = threshold_draws < pair[:, 0]
        value = np.where(own, column, pair[:, 1].view(np.int64))
        value -= self.cap
        return value

    def sample_packed(
        self, words: NDArray[np.uint64], free_bits: int, rng: np.random.Generator
    ) -> NDArray[np.float64]:
        """``Z`` (float64, exact integers) from one raw 64-bit word per sample, leaving the
        word's low ``free_bits`` bits to the caller.

        The same alias method as :meth:`sample`, reading fewer bits where they decide: the
        word's top ``k`` bits are the column ``j`` (``k = 64 - column_shift``), the next
        ``t = 64 - k - free_bits`` bits the top of the threshold draw ``u``. They decide
        ``u < threshold[j]`` unless they equal the threshold's top ``t`` bits (probability
        ``2^-t``: ``t >= 26`` for tables of up to 2^20 columns and ``free_bits <= 18``); such a
        sample reads the low ``64 - t`` bits of ``u`` from a fresh word's top bits. So ``u`` is
        uniform on the 2^64 grid and independent of the column and of the caller's bits, and
        the realised probabilities are exactly :meth:`pmf`. Two gathers per sample: the
        column's key, then the value of (column, decision) (:func:`packed_table`).
        """
        table = packed_table(self, free_bits)
        column = (words >> table.shift).view(np.int64)
        # words and keys share the column bits, so |word - key| < 2^63: the difference wraps
        # past 2^63 exactly when word < key (own), and is below 2^free_bits exactly when the
        # threshold bits tie
        difference = words - table.keys.take(column)
        if difference.size and difference.min() < table.tie_bound:
            ties = np.flatnonzero(difference < table.tie_bound)
            prefix_bits = table.prefix_bits
            prefix = (words[ties] >> np.uint64(free_bits)) & np.uint64((1 << prefix_bits) - 1)
            draw = prefix << np.uint64(64 - prefix_bits)
            draw |= uniform_words(rng, ties.shape[0]) >> np.uint64(prefix_bits)
            # redrawn: the top bit set exactly when the full threshold draw is below
            difference[ties] = (draw < self.threshold[column[ties]]).astype(np.uint64) << _SIGN
        own = difference.view(np.int64)
        own >>= _SIGN_SHIFT  # -1 where own, else 0
        column += column  # 2 j: the alias's value; 2 j + 1: the column's own
        column -= own
        return table.values.take(column)


class PackedTable(NamedTuple):
    """A :class:`DiscreteLaplaceNoise` table packed for
    :meth:`DiscreteLaplaceNoise.sample_packed` (:func:`packed_table`)."""

    #: One uint64 per column ``j``: ``j`` in the column bits, the threshold's top
    #: ``prefix_bits`` bits below them, zeros in the caller's ``free_bits``.
    keys: NDArray[np.uint64]
    #: ``alias[j] - cap`` at ``2 j`` and ``j - cap`` at ``2 j + 1`` (float64).
    values: NDArray[np.float64]
    prefix_bits: int
    shift: np.uint64  # the column is ``word >> shift``
    tie_bound: np.uint64  # 2^free_bits


@functools.lru_cache(maxsize=64)
def packed_table(noise: DiscreteLaplaceNoise, free_bits: int) -> PackedTable:
    """The tables of :meth:`DiscreteLaplaceNoise.sample_packed` for words whose low
    ``free_bits`` bits are the caller's. A word of column ``j`` is below key ``j`` when its
    threshold bits are below the threshold's top bits and above it when they are above; they
    tie exactly when ``word ^ key < 2^free_bits``."""
    column_bits = 64 - noise.column_shift
    prefix_bits = 64 - column_bits - free_bits
    if not 0 <= free_bits or prefix_bits < 1:
        raise ValueError(
            f"free_bits must be in [0, {63 - column_bits}] for a table of 2^{column_bits} "
            f"columns, got {free_bits}"
        )
    columns = np.arange(noise.threshold.shape[0], dtype=np.uint64)
    top = noise.threshold >> np.uint64(64 - prefix_bits)
    keys = (columns << np.uint64(noise.column_shift)) | (top << np.uint64(free_bits))
    values = np.empty(2 * columns.shape[0])
    values[0::2] = noise.alias_value
    values[1::2] = columns.astype(np.float64) - noise.cap
    for array in (keys, values):
        array.setflags(write=False)
    return PackedTable(
        keys, values, prefix_bits, np.uint64(noise.column_shift), np.uint64(1 << free_bits)
    )


def _alias_table(
    probabilities: NDArray[np.float64],
) -> tuple[NDArray[np.uint64], NDArray[np.int64]]:
    """Vose's alias table: column ``j`` keeps ``j`` when a draw is below ``threshold[j]``
    (out of 2^64), else gives ``alias[j]``."""
    count = probabilities.size
    scaled = probabilities * count
    alias = np.arange(count, dtype=np.int64)
    keep = np.ones(count)
    small = [i for i in range(count) if scaled[i] < 1.0]
    large = [i for i in range(count) if scaled[i] >= 1.0]
    while small and large:
        less, more = small.pop(), large[-1]
        keep[less] = scaled[less]
        alias[less] = more
        scaled[more] = (scaled[more] + scaled[less]) - 1.0
        if scaled[more] < 1.0:
            large.pop()
            small.append(more)
    # keep < 1 scales below 2^64 exactly as a float; keep = 1 takes the largest threshold
    full = keep >= 1.0
    threshold = np.where(full, 0.0, keep * _TWO_64).astype(np.uint64)
    threshold[full] = np.uint64(2**64 - 1)
    return threshold, alias


def _realised(threshold: NDArray[np.uint64], alias: NDArray[np.int64]) -> NDArray[np.float64]:
    """The distribution the table draws: column mass 1/N, split by each threshold."""
    count = threshold.size
    kept = threshold.astype(np.float64) / _TWO_64
    pmf = np.bincount(np.arange(count), weights=kept, minlength=count)
    pmf += np.bincount(alias, weights=1.0 - kept, minlength=count)
    return pmf / count


@functools.lru_cache(maxsize=64)
def discrete_laplace_noise(scale: float, cap: int) -> DiscreteLaplaceNoise:
    """The table of a discrete Laplace of ``scale`` (in grid steps) on ``-cap .. cap``.

    Ideal probabilities, with ``r = exp(-1 / scale)``: ``P(Z = z) = (1 - r) r^|z| / (1 + r)``
    for ``|z| < cap`` and the tails ``P(Z >= cap) = P(Z <= -cap) = r^cap / (1 + r)`` at
    ``+/- cap``.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if not 1 <= cap < 2**20:
        raise ValueError(f"cap must be in [1, 2^20), got {cap!r}")
    r = math.exp(-1.0 / scale)
    z = np.abs(np.arange(-cap, cap + 1, dtype=np.float64))
    ideal = (-math.expm1(-1.0 / scale)) / (1.0 + r) * np.exp(-z / scale)
    ideal[0] = ideal[-1] = math.exp(-cap / scale) / (1.0 + r)
    ideal /= ideal.sum()
    bits = max(1, (2 * cap).bit_length())  # 2^bits >= 2 cap + 1 columns
    if bits > MAX_COLUMN_BITS:
        raise ValueError(f"cap {cap} needs more than 2^{MAX_COLUMN_BITS} table columns")
    padded = np.zeros(2**bits)
    padded[: ideal.size] = ideal  # empty columns always give their alias
    threshold, alias = _alias_table(padded)
    realised_all = _realised(threshold, alias)
    realised = realised_all[: ideal.size].copy()
    if realised_all[ideal.size :].any() or not (realised > 0).all():
        raise ValueError(f"cap {cap} is too far out for scale {scale}: a probability rounds to 0")
    columns = np.arange(alias.size)
    alias_value = (alias - cap).astype(np.float64)
    own_offset = (columns - alias).astype(np.float64)
    pairs = np.stack([threshold, alias.astype(np.uint64)], axis=1)
    for array in (threshold, alias_value, own_offset, realised, pairs):
        array.setflags(write=False)
    return DiscreteLaplaceNoise(
        float(scale), int(cap), 64 - bits, threshold, alias_value, own_offset, realised, pairs
    )
