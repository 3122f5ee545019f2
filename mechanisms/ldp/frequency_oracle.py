"""Frequency oracles: one epsilon-LDP report per user over a domain of k categories.

Three "pure" protocols (Wang, Blocki, Li and Jha 2017): a report *supports* a set of
categories, the true category with probability p and any other one with probability q < p;
the unbiased count estimator is ``(S_j - n q) / (p - q)`` with ``S_j`` the number of reports
that support j.

* ``"grr"``: generalized randomized response (direct encoding), the report is one category,
  the true one with probability p, else one of the k - 1 others uniformly.
* ``"oue"``: optimal unary encoding (Wang et al. 2017), the report is k bits, the true bit set
  with probability 1/2, every other bit with probability q ~ 1 / (e^eps + 1).
* ``"ss"``: subset selection (Ye and Barg 2018; Wang et al. 2016), the report is a subset of
  omega categories that holds the true one with probability p ~ omega e^eps / (omega e^eps +
  k - omega), the rest of it a uniform subset of the other categories; omega minimises the
  variance.

Exact privacy on a 64-bit grid
------------------------------
Every random choice is made with integers, never by comparing a float uniform with a float
probability (whose realised probabilities differ from the nominal ones at the 2^-53 level in
ways nobody computes). A Bernoulli(T / 2^64) is ``word < T`` for a uniform 64-bit word,
``rng.integers(0, 2**64, dtype=np.uint64)``: for the full range numpy returns the bit
generator's ``next_uint64`` (``random_bounded_uint64_fill``, ``rng == 0xFFFFFFFFFFFFFFFF``),
64 bits for every bit generator, the AES-CTR one of
:func:`~fedparity.mechanisms.crypto.secure_random.secure_generator` included (unlike
``BitGenerator.random_raw``, which gives 32-bit words for MT19937). With D = 2^64, the
thresholds (:attr:`FrequencyOracle.threshold`) are:

* GRR and subset selection: the user's category is in the report when ``word < P``, P the
  largest integer with P (k - omega) / ((D - P) omega) <= e^eps (omega = 1 for GRR), that is
  P = floor(D omega e^eps / (omega e^eps + k - omega)), proven with a decimal lower bound on
  e^eps (and lowered further if the float epsilon below were to exceed the target).
* OUE: the true bit is ``word < 2^63`` (exactly 1/2), every other bit ``word < Q``, Q the
  smallest integer with (D - Q) / Q <= e^eps, that is Q = ceil(D / (e^eps + 1)).

So p = P / D (OUE: 1/2 and q = Q / D) exactly, and :attr:`FrequencyOracle.support_probability`,
:attr:`~FrequencyOracle.other_support_probability` and :attr:`~FrequencyOracle.epsilon` are the
*realised* values: epsilon = ln(P (k - omega) / ((D - P) omega)) (OUE: ln((D - Q) / Q)),
computed from the integers, is the worst likelihood ratio of the realised output distribution
(:meth:`~FrequencyOracle.exact_output_distribution` enumerates it), at most
``epsilon_target`` and short of it by about one threshold step, 1 / P + 1 / (D - P) (OUE:
1 / Q + 1 / (D - Q)); the estimator is exactly unbiased for what the sampler draws. At
e^eps beyond about D k the thresholds saturate (P = D - 1, Q = 1) and epsilon is what that
realises, ln((D - 1)(k - omega) / omega) (OUE: ln(D - 1) = 44.4); an epsilon below the grid's
resolution (about k / D) is refused.

Uniform choices are exact too. GRR and small-domain subset selection take the whole report
from the user's one word: below P the word is uniform on [0, P), cut into A = C(k - 1,
omega - 1) cells of floor(P / A) words, one per report that holds the user's category; from P
on it is uniform on [P, D), cut into B = C(k - 1, omega) cells of floor((D - P) / B) words, one
per report that does not (GRR: A = 1, B = k - 1 other categories); with up to 4096 shapes a
table indexed by the word's top 16 bits gives the same map faster, sending the words of the
buckets that straddle two ranges to the division. The table needs no more of a user's word
than those 16 bits, so they are the 16-bit pieces of shared words, four users to a word, and
a user whose bucket straddles reads the low 48 bits of its word from a fresh word: every
user's word is still uniform on the 2^64 grid and independent of the others'. The fewer
than A (B) words left over at the end of a range draw the report afresh with numpy's bounded
``rng.integers(0, A)`` (``(0, B)``), so each report has probability exactly P / (A D) or
(D - P) / (B D). numpy's ``Generator.integers`` (since 1.17; checked in 2.4) always uses
Lemire's multiply-and-reject method (``numpy/random/_generator.pyx``: ``_masked = False``;
``numpy/random/src/distributions/distributions.c``: ``bounded_lemire_uint64`` and
``buffered_bounded_lemire_uint32`` redraw while the low half of ``word * n`` is below
``(2^N - n) mod n``, which leaves exactly floor(2^N / n) accepted words per outcome), exactly
uniform given uniform words (Lemire 2019). Large-domain subset selection includes the user's
category when ``word < P`` and draws the uniform subset of the other categories with Floyd's
algorithm on the same bounded integers (Bentley and Floyd 1987). :meth:`FrequencyOracle.perturb`
(one report per user, for devices) and :meth:`FrequencyOracle.perturb_and_count` (counts, for
simulations of 10^7 users) run the same code on the same chunks: one sampler law, and for GRR,
OUE and small-domain subset selection the same counts from the same generator state.

Every oracle's exact covariance for given true counts is :meth:`FrequencyOracle.covariance`,
and :func:`frequency_oracle` with ``"best"`` picks the oracle whose estimator has the smallest
total variance (the trace of the covariance, which for a pure protocol depends on n only, not
on the unknown counts).

References
----------
.. [1] T. Wang, J. Blocki, N. Li and S. Jha, "Locally differentially private protocols for
       frequency estimation", USENIX Security Symposium, 2017.
.. [2] M. Ye and A. Barg, "Optimal schemes for discrete distribution estimation under locally
       differential privacy", IEEE Transactions on Information Theory, 2018.
.. [3] S. Wang, L. Huang, P. Wang, Y. Nie, H. Xu, W. Yang, X.-Y. Li and C. Qiao, "Mutual
       information optimally local private discrete distribution estimation", arXiv:1607.08025,
       2016.
.. [4] D. Lemire, "Fast random integer generation in an interval", ACM Transactions on
       Modeling and Computer Simulation 29(1), 2019.
.. [5] J. Bentley and R. W. Floyd, "Programming pearls: a sample of brilliance",
       Communications of the ACM 30(9), 1987.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..validation import (
    MAX_GROUPS,
    check_choice,
    check_epsilon,
    check_generator,
    check_groups_array,
    check_int_at_least,
    check_num_groups,
)
from .discrete_laplace import uniform_words

__all__ = [
    "ORACLES",
    "FrequencyEstimate",
    "FrequencyOracle",
    "frequency_oracle",
]

OracleName = Literal["grr", "oue", "ss"]

#: The oracles :func:`frequency_oracle` knows; ``"best"`` picks one of them by variance.
ORACLES: tuple[str, ...] = ("grr", "oue", "ss")

#: Users perturbed at once by :meth:`FrequencyOracle.perturb_and_count` for large-domain subset
#: selection (bounds the memory of its k-bit reports to about CHUNK x k bytes).
CHUNK = 1 << 16

#: 64-bit words drawn at once for OUE (k per user; 512 KiB, cache-sized): its chunks hold
#: ``max(1, UNARY_WORDS // k)`` users, in :meth:`FrequencyOracle.perturb` and in the counting.
UNARY_WORDS = 1 << 16

#: Users per chunk of the one-word paths (GRR, small-domain subset selection): the arrays of a
#: chunk (with the lookup table, 2^14 words, one byte of shape and two of index per user) stay
#: in the CPU cache. :meth:`FrequencyOracle.perturb` uses the same chunks.
COUNT_CHUNK = 1 << 16

#: D = 2^64, the number of values of one uniform 64-bit word: thresholds are integers out of D.
TWO_64 = 1 << 64
_HALF = np.uint64(1 << 63)

#: At or above this epsilon every threshold is at its limit (P = D - 1, Q = 1: e^eps is far
#: beyond D k), so the thresholds are computed here and e^eps never overflows.
_SATURATED_EPSILON = 100.0
#: Decimal digits of the exact threshold checks (the thresholds have 20).
_DIGITS = 60


@functools.lru_cache(maxsize=256)
def _exp_lower(epsilon: float) -> Decimal:
    """A lower bound on e^epsilon: ``Decimal.exp`` is correctly rounded to 60 digits, and a
    relative 10^-55 below it is below e^epsilon (the product is rounded down too)."""
    with localcontext() as context:
        context.prec = _DIGITS
        context.rounding = ROUND_FLOOR
        return Decimal(epsilon).exp() * (1 - Decimal(10) ** -55)


def _below_exp(numerator: int, denominator: int, exp_lower: Decimal) -> bool:
    """Proven ``numerator / denominator <= e^eps`` from a lower bound ``exp_lower`` on e^eps
    (the integers convert exactly; the product is rounded down)."""
    with localcontext() as context:
        context.prec = _DIGITS
        context.rounding = ROUND_FLOOR
        return Decimal(numerator) <= Decimal(denominator) * exp_lower


def _log_ratio(numerator: int, denominator: int) -> float:
    """ln(numerator / denominator) from the integers: log1p of the correctly rounded excess
    (Python's int / int), accurate to a few ulps also when the ratio is close to 1."""
    return math.log1p((numerator - denominator) / denominator)


def _floor(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_FLOOR))


@functools.lru_cache(maxsize=4096)
def _inclusion_threshold(epsilon: float, domain_size: int, subset_size: int) -> int:
    """P of GRR (omega = 1) and subset selection: the largest P < D with
    ``P (k - omega) / ((D - P) omega) <= e^eps``, proven with a decimal lower bound on e^eps,
    and whose float :func:`_log_ratio` is at most ``epsilon`` too."""
    k, w = domain_size, subset_size
    bound = _exp_lower(min(epsilon, _SATURATED_EPSILON))
    with localcontext() as context:
        context.prec = _DIGITS
        ideal = TWO_64 * w * bound / (w * bound + (k - w))
    threshold = min(_floor(ideal) + 1, TWO_64 - 1)
    while threshold > 0:
        numerator, denominator = threshold * (k - w), (TWO_64 - threshold) * w
        if _below_exp(numerator, denominator, bound) and (
            _log_ratio(numerator, denominator) <= epsilon
        ):
            break
        threshold -= 1
    if threshold * (k - w) <= (TWO_64 - threshold) * w:
        raise ValueError(
            f"epsilon {epsilon!r} is below the resolution of the 64-bit sampler for "
            f"domain_size {k}: no integer threshold gives a realised epsilon in (0, {epsilon!r}]"
        )
    return threshold


@functools.lru_cache(maxsize=256)
def _unary_threshold(epsilon: float) -> int:
    """Q of OUE: the smallest Q with ``(D - Q) / Q <= e^eps``, proven as in
    :func:`_inclusion_threshold`."""
    bound = _exp_lower(min(epsilon, _SATURATED_EPSILON))
    with localcontext() as context:
        context.prec = _DIGITS
        threshold = max(_floor(TWO_64 / (bound + 1)) - 1, 1)
    while not (
        _below_exp(TWO_64 - threshold, threshold, bound)
        and _log_ratio(TWO_64 - threshold, threshold) <= epsilon
    ):
        threshold += 1
    if 2 * threshold >= TWO_64:
        raise ValueError(
            f"epsilon {epsilon!r} is below the resolution of the 64-bit sampler: no integer "
            f"threshold gives a realised epsilon in (0, {epsilon!r}]"
        )
    return threshold


class _Layout(NamedTuple):
    """How one 64-bit word maps to a report shape (see :meth:`FrequencyOracle._draw_shapes`).

    The A shapes that include the user's category take ``step_in`` words each from 0, the B
    others ``step_out`` words each from P; the words in [A ``step_in``, P) and
    [P + B ``step_out``, D) (fewer than A and B) draw their shape afresh.
    """

    threshold: np.uint64  # P
    shapes_in: int  # A
    shapes_out: int  # B
    step_in: int  # floor(P / A)
    step_out: int  # floor((D - P) / B)

    @property
    def exact(self) -> bool:
        """No word is left over: A divides P and B divides D - P."""
        return self.shapes_in * self.step_in == int(self.threshold) and (
            int(self.threshold) + self.shapes_out * self.step_out == TWO_64
        )

    @property
    def branchless(self) -> bool:
        """Whether the branch-free mapping applies: both steps at least 1, so a word below P is
        at least B steps below P (mod D) and a word from P on at least A steps above 0."""
        return self.step_in >= 1 and self.step_out >= 1


@functools.lru_cache(maxsize=256)
def _layout(threshold: int, shapes_in: int, shapes_out: int) -> _Layout:
    return _Layout(
        np.uint64(threshold),
        shapes_in,
        shapes_out,
        threshold // shapes_in,
        (TWO_64 - threshold) // shapes_out,
    )


def _map_words(
    words: NDArray[np.uint64], layout: _Layout
) -> tuple[NDArray[np.uint64], NDArray[np.bool_] | None]:
    """(shape, left over) of each word (see :meth:`FrequencyOracle._draw_shapes`); the mask is
    None when no word can be left over.

    Shape numbers: with A = 1 (GRR, omega = 1) the reported offset, 0 when kept, ``B - s`` for
    the excluded step s (a left-over word gives 0 too); otherwise the included shapes are
    0 .. A - 1, the excluded ones ``A + B - s`` (A + 1 .. A + B), and a left-over word gives A.
    In word order the shapes' ranges follow one another, each shape (left-over words aside)
    holding one interval of words.
    """
    inner, outer = layout.shapes_in, layout.shapes_out
    leftover: NDArray[np.bool_] | None
    if layout.branchless:
        # min((word - P) // step, B) is B for a word below P (the subtraction wraps to at
        # least D - P >= B steps), and min(word // step_in, A) is A from P on.
        shapes = words - layout.threshold
        shapes //= np.uint64(layout.step_out)
        np.minimum(shapes, np.uint64(outer), out=shapes)
        np.subtract(np.uint64(outer), shapes, out=shapes)
        if inner == 1:
            end = int(layout.threshold) + outer * layout.step_out
            leftover = words >= np.uint64(end) if end < TWO_64 else None
        else:
            included = words // np.uint64(layout.step_in)
            np.minimum(included, np.uint64(inner), out=included)
            shapes += included
            leftover = None if layout.exact else shapes == np.uint64(inner)
        return shapes, leftover
    # a step is 0 (only at extreme epsilons): every word of that range is left over
    base = 0 if inner == 1 else inner
    below = words < layout.threshold
    step_in, step_out = max(layout.step_in, 1), max(layout.step_out, 1)
    inside = np.minimum(words // np.uint64(step_in), np.uint64(inner))
    outside = np.minimum((words - layout.threshold) // np.uint64(step_out), np.uint64(outer))
    shapes = np.where(below, inside, np.uint64(base + outer) - outside)
    leftover = np.where(below, inside >= inner, outside >= outer)
    leftover |= np.where(below, layout.step_in == 0, layout.step_out == 0)
    return shapes, leftover


#: Bits of a word's top that index :func:`_shape_lookup`'s table (buckets of 2^48 words).
LOOKUP_BITS = 16
_LOOKUP_SHIFT = np.uint64(64 - LOOKUP_BITS)
_LOW_SHIFT = np.uint64(LOOKUP_BITS)
#: Users whose buckets one uniform 64-bit word gives (its 16-bit pieces, in memory order).
_PIECES = 64 // LOOKUP_BITS
#: The lookup table (``uint8``, or ``uint16`` above 255 shapes) is used up to this many shapes:
#: then about 1 bucket in 16 at most straddles two shapes' ranges, and its users read a fresh
#: word (measured faster than the division for every word up to 3,003 shapes, k = 15); beyond,
#: every word goes through :func:`_map_words`.
MAX_LOOKUP_SHAPES = 4096


@functools.lru_cache(maxsize=64)
def _shape_lookup(layout: _Layout) -> np.ndarray:
    """Shape of the words of each bucket of 2^48 words (the word's top 16 bits) that lies
    inside one shape's range, else a sentinel (one more than the largest shape).

    A bucket is inside one range when its first and last words have the same shape and neither
    is left over: each shape holds one interval of words (:func:`_map_words`). The top bucket
    gets the sentinel whatever it holds, so the table's last entry is the sentinel.
    """
    shapes = layout.shapes_in + layout.shapes_out
    starts = np.arange(1 << LOOKUP_BITS, dtype=np.uint64) << _LOOKUP_SHIFT
    first, first_left = _map_words(starts, layout)
    last, last_left = _map_words(starts + np.uint64((1 << (64 - LOOKUP_BITS)) - 1), layout)
    inside = first == last
    if first_left is not None and last_left is not None:
        inside &= ~first_left & ~last_left
    sentinel = shapes + 1
    inside[-1] = False
    table = np.where(inside, first, np.uint64(sentinel))
    table = table.astype(np.uint8 if sentinel < 256 else np.uint16)
    table.setflags(write=False)
    return table


#: The largest domain (the k x k covariance and the shape tables take up to MAX_GROUPS).
MAX_DOMAIN_SIZE = MAX_GROUPS


def _check_domain_size(value: int) -> int:
    return check_num_groups(value, "domain_size")


#: Subset selection samples from a table of all C(k, omega) report shapes when k C(k, omega) is
#: at most this many (one word per user); above it, Floyd's algorithm.
MAX_SUBSET_TABLE = 1 << 22


@functools.lru_cache(maxsize=32)
def _subset_table(domain_size: int, subset_size: int) -> np.ndarray:
    """Subset selection's reports relative to the user's value x, as a (C(k, omega), k) table.

    Row s holds the offsets (category - x) mod k the report supports: first the C(k - 1,
    omega - 1) shapes that include x (offset 0), then the C(k - 1, omega) that do not, each in
    lexicographic order of the other categories.
    """
    k, w = domain_size, subset_size
    rows = [(0, *(1 + o for o in others)) for others in itertools.combinations(range(k - 1), w - 1)]
    rows += [tuple(1 + o for o in others) for others in itertools.combinations(range(k - 1), w)]
    table = np.zeros((len(rows), k), dtype=np.int64)
    for index, offsets in enumerate(rows):
        table[index, list(offsets)] = 1
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=32)
def _padded_subset_table(domain_size: int, subset_size: int) -> np.ndarray:
    """:func:`_subset_table` in the order of the shapes one word gives: the C(k - 1, omega - 1)
    rows that include the user's value, an empty row, the C(k - 1, omega) others reversed."""
    table = _subset_table(domain_size, subset_size)
    split = math.comb(domain_size - 1, subset_size - 1)
    empty = np.zeros((1, domain_size), dtype=np.int64)
    padded = np.concatenate([table[:split], empty, table[split:][::-1]])
    padded.setflags(write=False)
    return padded


@dataclass(frozen=True, eq=False)  # array fields: identity, not ==
class FrequencyEstimate:
    """Unbiased category counts from n reports and their estimated covariance.

    ``counts[j]`` estimates the number of users in category j; ``covariance`` is the oracle's
    exact covariance formula evaluated at the estimated counts (it is affine in the counts, so
    this plug-in is itself unbiased).
    """

    oracle: str
    epsilon: float
    num_users: int
    counts: np.ndarray
    covariance: np.ndarray

    @property
    def frequencies(self) -> np.ndarray:
        """``counts / num_users``."""
        return self.counts / self.num_users

    @property
    def stderrs(self) -> np.ndarray:
        """Standard errors of the counts (square roots of the covariance's diagonal)."""
        return np.sqrt(np.clip(np.diag(self.covariance), 0.0, None))

    def __repr__(self) -> str:
        return (
            f"FrequencyEstimate(oracle={self.oracle!r}, epsilon={self.epsilon:.4g}, "
            f"num_users={self.num_users}, domain_size={self.counts.shape[0]})"
        )


@dataclass(frozen=True)
class FrequencyOracle:
    """One frequency oracle for a domain of ``domain_size`` categories at ``epsilon_target``.

    Build with :func:`frequency_oracle`. ``subset_size`` is omega for subset selection (1 for
    GRR, whose report is one category; 0 for OUE, whose report is a bit vector). The sampler's
    probabilities are integers out of 2^64 (:attr:`threshold`); :attr:`epsilon` is the realised
    one, at most ``epsilon_target``.
    """

    name: str
    epsilon_target: float
    domain_size: int
    subset_size: int = 0

    def __post_init__(self) -> None:
        check_choice("oracle", self.name, ORACLES)
        check_epsilon("epsilon", self.epsilon_target)
        _check_domain_size(self.domain_size)
        if self.name == "ss":
            if not 1 <= self.subset_size <= self.domain_size - 1:
                raise ValueError(
                    f"subset_size must be an integer in [1, {self.domain_size - 1}], "
                    f"got {self.subset_size!r}"
                )
        self.threshold  # noqa: B018 - refuses an epsilon below the grid's resolution

    # ---- the realised probabilities ------------------------------------------------------

    @property
    def _omega(self) -> int:
        """Categories a GRR or subset selection report holds (1 for GRR)."""
        return 1 if self.name == "grr" else self.subset_size

    @property
    def threshold(self) -> int:
        """The integer threshold out of D = 2^64 the sampler compares uniform 64-bit words with.

        GRR and subset selection: P, the user's category is included when ``word < P``; the
        largest P with P (k - omega) / ((D - P) omega) <= e^eps. OUE: Q, each other bit is set
        when ``word < Q`` (the true bit when ``word < 2^63``); the smallest Q with
        (D - Q) / Q <= e^eps. Both are proven against e^eps with decimal bounds.
        """
        if self.name == "oue":
            return _unary_threshold(float(self.epsilon_target))
        return _inclusion_threshold(float(self.epsilon_target), self.domain_size, self._omega)

    def _exact_probabilities(self) -> tuple[Fraction, Fraction]:
        """(p, q) as exact fractions: the sampler's realised support probabilities."""
        t, k = self.threshold, self.domain_size
        if self.name == "oue":
            return Fraction(1, 2), Fraction(t, TWO_64)
        w = self._omega
        return Fraction(t, TWO_64), Fraction(t * (w - 1) + (TWO_64 - t) * w, TWO_64 * (k - 1))

    @property
    def support_probability(self) -> float:
        """p: probability that a report supports the user's own category (realised: P / 2^64;
        1/2 for OUE)."""
        return float(self._exact_probabilities()[0])

    @property
    def other_support_probability(self) -> float:
        """q: probability that a report supports a given category other than the user's
        (realised: GRR (1 - p) / (k - 1), OUE Q / 2^64, subset selection
        (p (omega - 1) + (1 - p) omega) / (k - 1))."""
        return float(self._exact_probabilities()[1])

    def _joint_support(self) -> tuple[float, float]:
        """P(report supports i and j), i != j: (user in i or j, user in neither)."""
        p, q = self._exact_probabilities()
        k = self.domain_size
        if self.name == "grr":
            return 0.0, 0.0
        if self.name == "oue":
            return float(p * q), float(q * q)
        w = self.subset_size
        same = p * (w - 1) / (k - 1)
        if k < 3:
            return float(same), 0.0
        other = (p * (w - 1) * (w - 2) + (1 - p) * w * (w - 1)) / ((k - 1) * (k - 2))
        return float(same), float(other)

    @property
    def epsilon(self) -> float:
        """The true LDP epsilon of the realised sampler (its worst likelihood ratio), computed
        from the integer threshold: GRR and subset selection ln(P (k - omega) / ((D - P)
        omega)), OUE ln((D - Q) / Q), D = 2^64. At most ``epsilon_target``, below it by about
        one threshold step.
        """
        t, k = self.threshold, self.domain_size
        if self.name == "oue":
            return _log_ratio(TWO_64 - t, t)
        w = self._omega
        return _log_ratio(t * (k - w), (TWO_64 - t) * w)

    # ---- variance ----------------------------------------------------------------------

    def covariance(self, true_counts: np.ndarray) -> np.ndarray:
        """Exact covariance matrix of the count estimator for n = sum(true_counts) users.

        Var(c_j) = (c_j p (1 - p) + (n - c_j) q (1 - q)) / (p - q)^2 and, for i != j,
        Cov(c_i, c_j) = ((c_i + c_j)(J1 - p q) + (n - c_i - c_j)(J0 - q^2)) / (p - q)^2, with
        J1 (J0) the probability that one report supports both i and j when the user is in i or
        j (in neither): 0 for GRR, p q (q^2) for OUE.
        """
        counts = np.asarray(true_counts, dtype=np.float64)
        if counts.shape != (self.domain_size,):
            raise ValueError(
                f"true_counts must have one entry per category ({self.domain_size}), "
                f"got shape {counts.shape}"
            )
        if not np.all(np.isfinite(counts)):
            raise ValueError("true_counts must be finite")
        n = float(counts.sum())
        p, q = self.support_probability, self.other_support_probability
        same, other = self._joint_support()
        a, b = same - p * q, other - q * q
        pair = counts[:, None] + counts[None, :]
        cov = pair * (a - b) + n * b
        np.fill_diagonal(cov, counts * (p * (1.0 - p) - q * (1.0 - q)) + n * q * (1.0 - q))
        return cov / (p - q) ** 2

    def total_variance(self, num_users: int) -> float:
        """Trace of :meth:`covariance`: n (p (1 - p) + (k - 1) q (1 - q)) / (p - q)^2.

        The expected squared L2 error of the counts; it depends on n only, not on the counts.
        """
        n = check_int_at_least("num_users", num_users, 1)
        p, q, k = self.support_probability, self.other_support_probability, self.domain_size
        return n * (p * (1.0 - p) + (k - 1) * q * (1.0 - q)) / (p - q) ** 2

    # ---- perturbation -----------------------------------------------------------------

    def perturb(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One report per user: an ``int64`` category (GRR) or a ``bool`` (n, k) matrix.

        ``values`` are the users' categories in [0, domain_size). Every random choice is an
        integer comparison or an exact bounded integer (module docstring).
        """
        values = check_groups_array(values, self.domain_size, "values")
        rng = check_generator("rng", rng)
        values = values.astype(np.int64, copy=False)
        k, count = self.domain_size, values.shape[0]
        if self.name == "grr":
            reports = np.empty(count, dtype=np.int64)
            for start in range(0, count, COUNT_CHUNK):
                chunk = values[start : start + COUNT_CHUNK]
                shapes = self._draw_shapes(chunk.shape[0], rng)
                reports[start : start + chunk.shape[0]] = (chunk + shapes) % k
            return reports
        if self._uses_subset_table():
            table = self._shape_table().astype(bool)
            out = np.zeros((count, k), dtype=bool)
            for start in range(0, count, COUNT_CHUNK):
                chunk = values[start : start + COUNT_CHUNK]
                shapes = table[self._draw_shapes(chunk.shape[0], rng)]
                columns = (chunk[:, None] + np.arange(k)[None, :]) % k
                rows = np.arange(start, start + chunk.shape[0])[:, None]
                out[rows, columns] = shapes
            return out
        if self.name == "oue":
            out = np.empty((count, k), dtype=bool)
            for start, chunk, words in self._unary_chunks(values, rng):
                bits = words < np.uint64(self.threshold)
                columns = np.arange(chunk.shape[0])
                bits[chunk, columns] = words[chunk, columns] < _HALF  # exactly 1/2
                out[start : start + chunk.shape[0]] = bits.T
            return out
        return self._perturb_subsets(values, rng)

    def _uses_subset_table(self) -> bool:
        return (
            self.name == "ss"
            and self.domain_size * math.comb(self.domain_size, self.subset_size) <= MAX_SUBSET_TABLE
        )

    def _shape_counts(self) -> tuple[int, int]:
        """(A, B): report shapes that include the user's category and that do not."""
        k, w = self.domain_size, self._omega
        return math.comb(k - 1, w - 1), math.comb(k - 1, w)

    def _draw_shapes(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """Report shapes (rows of :meth:`_shape_table`) of ``count`` users, one uniform 64-bit
        word each.

        With P = :attr:`threshold`, A and B the shapes that include the user's category and
        that do not: a word below P gives the included shape ``word // floor(P / A)``, a word
        from P on the excluded one ``(word - P) // floor((D - P) / B)``, so every shape takes
        the same number of words (:func:`_map_words`); the fewer than A (B) words left over at
        the end of either range draw the shape afresh with Lemire's exactly uniform bounded
        ``rng.integers``. Shape probabilities: exactly P / (A D) and (D - P) / (B D).

        With few shapes, a table indexed by the word's top 16 bits, its bucket
        (:func:`_shape_lookup`), gives the shape of every word of a bucket that lies inside one
        shape's range, so such a user needs no more than its bucket: the users' buckets are the
        16-bit pieces of shared uniform words, four users to a word. A user whose bucket
        straddles two ranges (the table's sentinel, about 1 in 2^16 / (A + B)) gets the low 48
        bits of its word from a fresh word's top 48 bits, and :func:`_map_words` maps the
        whole word. Each user's word, its bucket then its low bits, is uniform on the 2^64
        grid, and independent of the other users' (disjoint bits of the generator's uniform
        stream; whether the low bits are read depends on the bucket only), so the probabilities
        are the same exact ones.

        Returns ``int64``, or ``uint8`` / ``uint16`` from the table.
        """
        layout = _layout(self.threshold, *self._shape_counts())
        inner, outer = layout.shapes_in, layout.shapes_out
        shapes: np.ndarray
        rows: np.ndarray | None = None  # the users whose words ``words`` are (None: all)
        if inner + outer > MAX_LOOKUP_SHAPES:
            words = uniform_words(rng, count)
            mapped, leftover = _map_words(words, layout)
            shapes = mapped.view(np.int64)  # shapes < 2^63
        else:
            lookup = _shape_lookup(layout)
            buckets = uniform_words(rng, -(-count // _PIECES)).view(np.uint16)[:count]
            shapes = lookup.take(buckets)
            rows = np.flatnonzero(shapes == lookup[-1])  # the sentinel: a straddling bucket
            if not rows.size:
                return shapes
            words = buckets[rows].astype(np.uint64) << _LOOKUP_SHIFT
            words |= uniform_words(rng, rows.shape[0]) >> _LOW_SHIFT
            mapped, leftover = _map_words(words, layout)
            shapes[rows] = mapped
        if leftover is not None and leftover.any():
            left = np.flatnonzero(leftover)
            kept = words[left] < layout.threshold
            # numpy's bounded integers: Lemire's method with rejection, exactly uniform
            # (numpy/random/src/distributions/distributions.c, bounded_lemire_uint64 and
            # buffered_bounded_lemire_uint32; Generator.integers never uses the masked method)
            fresh = rng.integers(0, np.where(kept, inner, outer))
            target = left if rows is None else rows[left]
            shapes[target] = np.where(kept, 0, (0 if inner == 1 else inner) + 1) + fresh
        return shapes

    def _shape_table(self) -> np.ndarray:
        """(shapes, k) table of the offsets each shape of :meth:`_draw_shapes` supports.

        GRR and subset selection with omega = 1: the identity (shape = offset). Subset
        selection: the C(k - 1, omega - 1) rows of :func:`_subset_table` that include the user's
        category, an empty row (the left-over words' shape, never returned), then the
        C(k - 1, omega) others in reverse order.
        """
        if self._omega == 1:
            return np.eye(self.domain_size, dtype=np.int64)
        return _padded_subset_table(self.domain_size, self.subset_size)

    def _subset_others(
        self, values: np.ndarray, include: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Subset selection's other categories: (m, omega) labels, -1 where none.

        Each user gets a uniform omega-subset of the k - 1 other categories (Floyd's algorithm,
        vectorised: omega bounded integer draws per user, each exactly uniform by Lemire's
        method); a user whose own category is included drops one of them uniformly, which
        leaves a uniform (omega - 1)-subset.
        """
        k, w, m = self.domain_size, self.subset_size, len(values)
        others = k - 1
        chosen = np.empty((m, w), dtype=np.int64)
        for column, top in enumerate(range(others - w, others)):
            draw = rng.integers(0, top + 1, size=m)  # Lemire's method: exactly uniform
            taken = (chosen[:, :column] == draw[:, None]).any(axis=1)
            chosen[:, column] = np.where(taken, top, draw)
        labels = (values[:, None] + 1 + chosen) % k
        drop = rng.integers(0, w, size=m)
        rows = np.flatnonzero(include)
        labels[rows, drop[rows]] = -1
        return labels

    def _unary_chunks(
        self, values: np.ndarray, rng: np.random.Generator
    ) -> Iterator[tuple[int, np.ndarray, NDArray[np.uint64]]]:
        """OUE's words by chunk: (first user, the chunk's values, (k, m) words), word [j, i]
        deciding user i's bit j."""
        size = max(1, UNARY_WORDS // self.domain_size)
        for start in range(0, values.shape[0], size):
            chunk = values[start : start + size]
            yield start, chunk, uniform_words(rng, (self.domain_size, chunk.shape[0]))

    def _perturb_subsets(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Large-domain subset selection's reports (Floyd's algorithm), all users at once."""
        k, m = self.domain_size, len(values)
        rows = np.arange(m)
        include = uniform_words(rng, m) < np.uint64(self.threshold)
        labels = self._subset_others(values, include, rng)
        out = np.zeros((m, k), dtype=bool)
        out[rows, values] = include
        for column in labels.T:
            kept = column >= 0
            out[rows[kept], column[kept]] = True
        return out

    def support_counts(self, reports: np.ndarray) -> np.ndarray:
        """S_j: how many reports support each category (``int64``, length k)."""
        reports = np.asarray(reports)
        if self.name == "grr":
            reports = check_groups_array(reports, self.domain_size, "reports")
            return np.bincount(reports, minlength=self.domain_size).astype(np.int64)
        if reports.ndim != 2 or reports.shape[1] != self.domain_size:
            raise ValueError(
                f"reports must be an (n, {self.domain_size}) array of bits, got {reports.shape}"
            )
        return reports.sum(axis=0, dtype=np.int64)

    def perturb_and_count(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``support_counts(perturb(values, rng))`` in chunks (bounded memory for k-bit reports).

        The same sampler as :meth:`perturb`: GRR, OUE and small-domain subset selection draw
        the same words in the same order, so the counts equal those of :meth:`perturb`'s
        reports for the same generator state.
        """
        values = check_groups_array(values, self.domain_size, "values")
        rng = check_generator("rng", rng)
        k = self.domain_size
        if self.name == "grr" or self._uses_subset_table():
            return self._count_by_shape(values, rng)
        values = values.astype(np.int64, copy=False)
        counts = np.zeros(k, dtype=np.int64)
        if self.name == "oue":
            threshold = np.uint64(self.threshold)
            for _, chunk, words in self._unary_chunks(values, rng):
                counts += np.count_nonzero(words < threshold, axis=1)
                # the true bit: count word < 2^63 instead of word < Q (a difference in -1..1)
                own = np.take(words.ravel(), chunk * chunk.shape[0] + np.arange(chunk.shape[0]))
                change = (own < _HALF).view(np.int8) - (own < threshold).view(np.int8)
                tally = np.bincount(3 * chunk + 1 + change, minlength=3 * k).reshape(k, 3)
                counts += tally[:, 2] - tally[:, 0]
            return counts
        for start in range(0, values.shape[0], CHUNK):
            chunk = values[start : start + CHUNK]
            include = uniform_words(rng, len(chunk)) < np.uint64(self.threshold)
            labels = self._subset_others(chunk, include, rng)
            counts += np.bincount(chunk[include], minlength=k)
            counts += np.bincount(labels[labels >= 0], minlength=k)
        return counts

    def _count_by_shape(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Support counts from one word per user (:meth:`_draw_shapes`), without reports.

        Counts the (user value x, report shape s) pairs, the index x S + s (S shapes) in
        ``int16`` when k S fits, in chunks that stay in cache, then folds them: a user in x
        with shape s supports x + offset (mod k) for each offset of row s of
        :meth:`_shape_table`.
        """
        k = self.domain_size
        table = self._shape_table()
        shapes = table.shape[0]
        pairs = np.zeros(k * shapes, dtype=np.int64)
        # the pair index x * shapes + s in the smallest integer type that holds it
        dtype = np.int16 if k * shapes <= np.iinfo(np.int16).max else np.int64
        index = np.empty(min(COUNT_CHUNK, values.shape[0]), dtype=dtype)
        for start in range(0, values.shape[0], COUNT_CHUNK):
            chunk = values[start : start + COUNT_CHUNK]
            drawn = self._draw_shapes(chunk.shape[0], rng)
            part = index[: chunk.shape[0]]
            np.multiply(chunk, shapes, out=part, dtype=dtype, casting="unsafe")  # x < k
            np.add(part, drawn, out=part, casting="unsafe")
            pairs += np.bincount(part, minlength=k * shapes)
        relative = pairs.reshape(k, shapes) @ table  # [x, offset]
        counts = np.zeros(k, dtype=np.int64)
        for x in range(k):
            counts += np.roll(relative[x], x)
        return counts

    # ---- estimation -------------------------------------------------------------------

    def estimate(self, support_counts: np.ndarray, num_users: int) -> FrequencyEstimate:
        """Unbiased counts ``(S_j - n q) / (p - q)`` and their plug-in covariance."""
        n = check_int_at_least("num_users", num_users, 1)
        counts = np.asarray(support_counts, dtype=np.float64)
        if counts.shape != (self.domain_size,):
            raise ValueError(
                f"support_counts must have one entry per category ({self.domain_size}), "
                f"got shape {counts.shape}"
            )
        if not np.all(np.isfinite(counts)) or np.any(counts < 0) or np.any(counts > n):
            raise ValueError(f"support_counts must be counts in [0, num_users={n}]")
        p, q = self.support_probability, self.other_support_probability
        estimate = (counts - n * q) / (p - q)
        # The covariance formula is affine in the true counts: plugging in the unbiased
        # estimate gives an unbiased estimate of the covariance.
        covariance = self.covariance(estimate)
        return FrequencyEstimate(self.name, self.epsilon, n, estimate, covariance)

    # ---- exact output distribution (small k) ------------------------------------------

    def exact_output_distribution(self, value: int) -> dict[tuple[int, ...], Fraction]:
        """P(report | value) of the realised sampler, as exact fractions, for every report.

        Keys are the supported categories (k reports for GRR, 2^k for OUE, C(k, omega) for
        subset selection); for checking the privacy guarantee on small domains (k <= 16).
        """
        k = self.domain_size
        if k > 16:
            raise ValueError(f"domain_size must be <= 16 to enumerate the outputs, got {k}")
        value = check_int_at_least("value", value, 0)
        if value >= k:
            raise ValueError(f"value must be in [0, {k - 1}], got {value}")
        p, q = self._exact_probabilities()
        if self.name == "grr":
            return {(j,): (p if j == value else q) for j in range(k)}
        if self.name == "oue":
            # the true bit is set with probability 1/2 either way; m other bits set: q^m (1-q)^..
            others = [q**m * (1 - q) ** (k - 1 - m) / 2 for m in range(k)]
            table = {}
            for bits in itertools.product((0, 1), repeat=k):
                table[tuple(j for j in range(k) if bits[j])] = others[sum(bits) - bits[value]]
            return table
        w = self.subset_size
        with_value = p / math.comb(k - 1, w - 1)
        without = (1 - p) / math.comb(k - 1, w)
        return {
            subset: (with_value if value in subset else without)
            for subset in itertools.combinations(range(k), w)
        }

    def output_distribution(self, value: int) -> dict[tuple[int, ...], float]:
        """:meth:`exact_output_distribution` rounded to floats (each correctly rounded)."""
        return {key: float(prob) for key, prob in self.exact_output_distribution(value).items()}

    def __repr__(self) -> str:
        size = f", subset_size={self.subset_size}" if self.name == "ss" else ""
        return (
            f"FrequencyOracle({self.name!r}, epsilon={self.epsilon:.4g}, "
            f"domain_size={self.domain_size}{size})"
        )


def _best_subset_size(epsilon: float, domain_size: int) -> int:
    """omega in [1, k - 1] with the smallest total variance (near k / (e^eps + 1))."""
    best, best_variance = 1, math.inf
    for w in range(1, domain_size):
        variance = FrequencyOracle("ss", epsilon, domain_size, w).total_variance(1)
        if variance < best_variance * (1.0 - 1e-12):
            best, best_variance = w, variance
    return best


def frequency_oracle(
    name: str, epsilon: float, domain_size: int, num_users: int = 1
) -> FrequencyOracle:
    """The oracle ``name`` ("grr", "oue", "ss" or "best") at ``epsilon`` for k categories.

    ``"best"`` returns the oracle with the smallest total variance
    (:meth:`FrequencyOracle.total_variance`) for ``num_users`` users; n scales every oracle's
    variance alike, so the choice depends on (epsilon, k) only: GRR wins for small k (about
    k < 3 e^eps + 2), subset selection for large k. Subset selection's omega minimises its
    variance.

    >>> frequency_oracle("best", 2.0, 8).name
    'grr'
    >>> frequency_oracle("best", 1.0, 40)
    FrequencyOracle('ss', epsilon=1, domain_size=40, subset_size=11)
    """
    check_choice("oracle", name, (*ORACLES, "best"))
    epsilon = check_epsilon("epsilon", epsilon)
    domain_size = _check_domain_size(domain_size)
    num_users = check_int_at_least("num_users", num_users, 1)
    if name == "grr":
        return FrequencyOracle("grr", epsilon, domain_size, 1)
    if name == "oue":
        return FrequencyOracle("oue", epsilon, domain_size, 0)
    if name == "ss":
        return FrequencyOracle("ss", epsilon, domain_size, _best_subset_size(epsilon, domain_size))
    best = frequency_oracle("grr", epsilon, domain_size)
    for other in ("oue", "ss"):  # ties (subset selection with omega = 1 is GRR) keep GRR
        candidate = frequency_oracle(other, epsilon, domain_size)
        if candidate.total_variance(num_users) < best.total_variance(num_users) * (1 - 1e-12):
            best = candidate
    return best
