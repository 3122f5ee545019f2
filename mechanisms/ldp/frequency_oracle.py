"""Frequency oracles: one epsilon-LDP report per user over a domain of k categories.

Three "pure" protocols (Wang, Blocki, Li and Jha 2017): a report *supports* a set of
categories, the true category with probability p and any other one with probability q < p;
the unbiased count estimator is ``(S_j - n q) / (p - q)`` with ``S_j`` the number of reports
that support j.

* ``"grr"``: generalized randomized response (direct encoding), the report is one category;
  the sampler is :func:`~fedparity.mechanisms.grr_perturb`.
* ``"oue"``: optimal unary encoding (Wang et al. 2017), the report is k bits, the true bit kept
  with probability 1/2, every other bit set with probability 1 / (e^eps + 1).
* ``"ss"``: subset selection (Ye and Barg 2018; Wang et al. 2016), the report is a subset of
  omega categories that holds the true one with probability p = omega e^eps / (omega e^eps +
  k - omega); omega minimises the variance.

Every oracle's epsilon is computed from its realised probabilities
(:attr:`FrequencyOracle.epsilon`), its estimator's exact covariance for given true counts is
:meth:`FrequencyOracle.covariance`, and :func:`frequency_oracle` with ``"best"`` picks the
oracle whose estimator has the smallest total variance (the trace of the covariance, which for a
pure protocol depends on n only, not on the unknown counts).

References
----------
.. [1] T. Wang, J. Blocki, N. Li and S. Jha, "Locally differentially private protocols for
       frequency estimation", USENIX Security Symposium, 2017.
.. [2] M. Ye and A. Barg, "Optimal schemes for discrete distribution estimation under locally
       differential privacy", IEEE Transactions on Information Theory, 2018.
.. [3] S. Wang, L. Huang, P. Wang, Y. Nie, H. Xu, W. Yang, X.-Y. Li and C. Qiao, "Mutual
       information optimally local private discrete distribution estimation", arXiv:1607.08025,
       2016.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..validation import (
    MAX_GROUPS,
    check_choice,
    check_epsilon,
    check_generator,
    check_groups_array,
    check_int_at_least,
    check_num_groups,
)
from .randomized_response import grr_keep_probability, grr_perturb

__all__ = [
    "ORACLES",
    "FrequencyEstimate",
    "FrequencyOracle",
    "frequency_oracle",
]

OracleName = Literal["grr", "oue", "ss"]

#: The oracles :func:`frequency_oracle` knows; ``"best"`` picks one of them by variance.
ORACLES: tuple[str, ...] = ("grr", "oue", "ss")

#: Users perturbed at once by :meth:`FrequencyOracle.perturb_and_count` (bounds the memory of
#: the k-bit reports of OUE and subset selection to about CHUNK x k bytes).
CHUNK = 1 << 16

#: Users per chunk of the one-uniform counting path (GRR, small-domain subset selection): a few
#: arrays of this length stay in the CPU cache and are reused.
COUNT_CHUNK = 1 << 15


class _Buffers:
    """Work arrays of one chunk, allocated once and reused (fresh arrays cost page faults)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.draws = np.empty(size)
        self.work = np.empty(size)
        self.other = np.empty(size)
        self.index = np.empty(size, dtype=np.int64)
        self.offset = np.empty(size, dtype=np.int64)


#: The largest domain (GRR's sampler and the k x k covariance take up to MAX_GROUPS).
MAX_DOMAIN_SIZE = MAX_GROUPS


def _check_domain_size(value: int) -> int:
    return check_num_groups(value, "domain_size")


#: Subset selection samples from a table of all C(k, omega) report shapes when k C(k, omega) is
#: at most this many (one uniform per user); above it, Floyd's algorithm.
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
    GRR, whose report is one category; 0 for OUE, whose report is a bit vector).
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

    # ---- probabilities -----------------------------------------------------------------

    @property
    def support_probability(self) -> float:
        """p: probability that a report supports the user's own category."""
        eps, k = self.epsilon_target, self.domain_size
        if self.name == "grr":
            return grr_keep_probability(eps, k)
        if self.name == "oue":
            return 0.5
        w = self.subset_size
        return w / (w + (k - w) * math.exp(-eps))

    @property
    def other_support_probability(self) -> float:
        """q: probability that a report supports a given category other than the user's."""
        p, k = self.support_probability, self.domain_size
        if self.name == "grr":
            return (1.0 - p) / (k - 1)
        if self.name == "oue":
            return 1.0 / (math.exp(self.epsilon_target) + 1.0)
        w = self.subset_size
        return (p * (w - 1) + (1.0 - p) * w) / (k - 1)

    def _joint_support(self) -> tuple[float, float]:
        """P(report supports i and j), i != j: (user in i or j, user in neither)."""
        p, q, k = self.support_probability, self.other_support_probability, self.domain_size
        if self.name == "grr":
            return 0.0, 0.0
        if self.name == "oue":
            return p * q, q * q
        w = self.subset_size
        same = p * (w - 1) / (k - 1)
        if k < 3:
            return same, 0.0
        other = (p * (w - 1) * (w - 2) + (1.0 - p) * w * (w - 1)) / ((k - 1) * (k - 2))
        return same, other

    @property
    def epsilon(self) -> float:
        """The true LDP epsilon, from the realised probabilities (the worst likelihood ratio).

        GRR: ln(p / q); OUE: ln(p (1 - q) / ((1 - p) q)); subset selection: ln(p (k - omega) /
        ((1 - p) omega)). Equal to ``epsilon_target`` up to rounding.
        """
        p, q, k = self.support_probability, self.other_support_probability, self.domain_size
        if self.name == "grr":
            return math.log(p) - math.log(q)
        if self.name == "oue":
            return math.log(p) + math.log1p(-q) - math.log1p(-p) - math.log(q)
        w = self.subset_size
        return math.log(p) + math.log(k - w) - math.log1p(-p) - math.log(w)

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

        ``values`` are the users' categories in [0, domain_size).
        """
        values = check_groups_array(values, self.domain_size, "values")
        rng = check_generator("rng", rng)
        if self.name == "grr":
            return grr_perturb(values, self.epsilon_target, self.domain_size, rng)
        return self._perturb_bits(values.astype(np.int64, copy=False), rng)

    def _uses_subset_table(self) -> bool:
        return (
            self.name == "ss"
            and self.domain_size * math.comb(self.domain_size, self.subset_size) <= MAX_SUBSET_TABLE
        )

    def _subset_shapes(self, m: int, rng: np.random.Generator) -> np.ndarray:
        """One uniform per user -> a row of :func:`_subset_table` (subset selection's law)."""
        buffers = _Buffers(m)
        rng.random(out=buffers.draws)
        self._shape_index(buffers)
        return buffers.index.copy()

    def _shape_index(self, buffers: _Buffers) -> None:
        """Map the uniforms in ``buffers.draws`` to report shapes in ``buffers.index``, in place.

        GRR: shape s = 0 (kept) on [0, a), else 1 + floor((u - a)(k - 1) / (1 - a)), the
        report being (x + s) mod k, as :func:`~fedparity.mechanisms.grr_perturb` draws it.
        Subset selection: [0, p) is cut into the C(k - 1, omega - 1) shapes that include the
        user's value, [p, 1) into the C(k - 1, omega) that do not, each in equal parts (the
        rows of :func:`_subset_table`). Exact to the 2^-53 resolution of a float64 uniform.
        """
        k, u, index = self.domain_size, buffers.draws, buffers.index
        if self.name == "grr":
            a = self.support_probability
            u -= a
            u *= (k - 1) / (1.0 - a)
            u += 1.0
            np.copyto(index, u, casting="unsafe")  # truncation: (-1, 1) gives 0 (kept)
            np.clip(index, 0, k - 1, out=index)
            return
        w, p = self.subset_size, self.support_probability
        with_value, without = math.comb(k - 1, w - 1), math.comb(k - 1, w)
        # Both pieces are linear in u, with_value u / p on [0, p) and with_value + without
        # (u - p) / (1 - p) on [p, 1), and meet at u = p: the piecewise map is the smaller of
        # the two lines where the slope drops at p, the larger where it rises.
        shape, other = buffers.work, buffers.other
        np.multiply(u, with_value / p, out=shape)
        np.multiply(u, without / (1.0 - p), out=other)
        other += with_value - p * without / (1.0 - p)
        if without / (1.0 - p) <= with_value / p:
            np.minimum(shape, other, out=shape)
        else:
            np.maximum(shape, other, out=shape)
        np.copyto(index, shape, casting="unsafe")
        np.clip(index, 0, with_value + without - 1, out=index)

    def _shape_table(self) -> np.ndarray:
        """(shapes, k) table of supported offsets: GRR's is the identity, SS's the subsets."""
        if self.name == "grr":
            return np.eye(self.domain_size, dtype=np.int64)
        return _subset_table(self.domain_size, self.subset_size)

    def _subset_others(
        self, values: np.ndarray, include: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Subset selection's other categories: (m, omega) labels, -1 where none.

        Each user gets a uniform omega-subset of the k - 1 other categories (Floyd's algorithm,
        vectorised: omega integer draws per user); a user whose own category is included drops
        one of them uniformly, which leaves a uniform (omega - 1)-subset.
        """
        k, w, m = self.domain_size, self.subset_size, len(values)
        others = k - 1
        chosen = np.empty((m, w), dtype=np.int64)
        for column, top in enumerate(range(others - w, others)):
            draw = rng.integers(0, top + 1, size=m)
            taken = (chosen[:, :column] == draw[:, None]).any(axis=1)
            chosen[:, column] = np.where(taken, top, draw)
        labels = (values[:, None] + 1 + chosen) % k
        drop = rng.integers(0, w, size=m)
        rows = np.flatnonzero(include)
        labels[rows, drop[rows]] = -1
        return labels

    def _perturb_bits(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        k, m = self.domain_size, len(values)
        rows = np.arange(m)
        if self.name == "oue":
            out = rng.random((m, k)) < self.other_support_probability
            out[rows, values] = rng.random(m) < 0.5
            return out
        if self._uses_subset_table():
            shapes = _subset_table(k, self.subset_size)[self._subset_shapes(m, rng)]
            columns = (values[:, None] + np.arange(k)[None, :]) % k
            out = np.zeros((m, k), dtype=bool)
            out[rows[:, None], columns] = shapes.astype(bool)
            return out
        include = rng.random(m) < self.support_probability
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
        """``support_counts(perturb(values, rng))`` in chunks (bounded memory for k-bit reports)."""
        values = check_groups_array(values, self.domain_size, "values")
        rng = check_generator("rng", rng)
        k = self.domain_size
        counts = np.zeros(k, dtype=np.int64)
        if self.name == "grr" or self._uses_subset_table():
            return self._count_by_shape(values, rng)
        values = values.astype(np.int64, copy=False)
        for start in range(0, values.shape[0], CHUNK):
            chunk = values[start : start + CHUNK]
            if self.name == "oue":
                counts += self._perturb_bits(chunk, rng).sum(axis=0, dtype=np.int64)
                continue
            include = rng.random(len(chunk)) < self.support_probability
            labels = self._subset_others(chunk, include, rng)
            counts += np.bincount(chunk[include], minlength=k)
            counts += np.bincount(labels[labels >= 0], minlength=k)
        return counts

    def _count_by_shape(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Support counts from one uniform per user, without building reports.

        Counts the (user value x, report shape s) pairs in chunks that stay in cache, with
        reused buffers, then folds them: a user in x with shape s supports x + offset (mod k)
        for each offset of row s of :meth:`_shape_table`.
        """
        k = self.domain_size
        table = self._shape_table()
        shapes = table.shape[0]
        pairs = np.zeros(k * shapes, dtype=np.int64)
        buffers = _Buffers(min(COUNT_CHUNK, values.shape[0]))
        for start in range(0, values.shape[0], COUNT_CHUNK):
            chunk = values[start : start + COUNT_CHUNK]
            part = buffers if chunk.shape[0] == buffers.size else _Buffers(chunk.shape[0])
            rng.random(out=part.draws)
            self._shape_index(part)
            np.multiply(chunk, shapes, out=part.offset, dtype=np.int64)
            part.index += part.offset
            pairs += np.bincount(part.index, minlength=k * shapes)
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

    def output_distribution(self, value: int) -> dict[tuple[int, ...], float]:
        """P(report | value) for every possible report, as {supported categories: probability}.

        Enumerates the outputs (k of them for GRR, 2^k for OUE, C(k, omega) for subset
        selection); for checking the privacy guarantee on small domains (k <= 16).
        """
        k = self.domain_size
        if k > 16:
            raise ValueError(f"domain_size must be <= 16 to enumerate the outputs, got {k}")
        value = check_int_at_least("value", value, 0)
        if value >= k:
            raise ValueError(f"value must be in [0, {k - 1}], got {value}")
        p, q = self.support_probability, self.other_support_probability
        if self.name == "grr":
            return {(j,): (p if j == value else q) for j in range(k)}
        if self.name == "oue":
            table = {}
            for bits in itertools.product((0, 1), repeat=k):
                prob = 1.0
                for j, bit in enumerate(bits):
                    keep = p if j == value else q
                    prob *= keep if bit else 1.0 - keep
                table[tuple(j for j in range(k) if bits[j])] = prob
            return table
        w = self.subset_size
        with_value = p / math.comb(k - 1, w - 1)
        without = (1.0 - p) / math.comb(k - 1, w)
        return {
            subset: (with_value if value in subset else without)
            for subset in itertools.combinations(range(k), w)
        }

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
