"""Every rate metric per group from one joint (group, confusion cell) report per user.

A user's (group g, confusion cell) pair is one category of a domain of k = d c categories
(cells TP, FP, FN, TN, and optionally "undefined" for a user who cannot place itself); a
frequency oracle (:func:`~fedparity.mechanisms.ldp.frequency_oracle`) perturbs it once under one
epsilon, and every metric below is post-processing of the unbiased group x cell counts, so it
costs no further privacy. Each rate is a ratio of two linear functions of the counts,
R = a'c / b'c; its standard error comes from the delta method, grad R = (a - R b) / b'c and
Var R = grad' Sigma grad, with Sigma the counts' covariance.

Summaries across groups follow fairlearn's ``MetricFrame`` (Bird et al. 2020): ``group_min``,
``group_max``, ``difference`` (max - min, or the largest absolute difference to the overall
value) and ``ratio`` (min / max, or the smallest of g / overall and overall / g). Their
intervals are *simultaneous*: Bonferroni-adjusted intervals of every pairwise difference (or
ratio), combined into an interval for the max / min, which covers whatever groups are the
extremes (a difference's interval is clipped at 0, where it stays valid, conservatively). Ratio
intervals are Fieller's (Fieller 1954): the set of theta with (R_i - theta R_j)^2 <= z^2
Var(R_i - theta R_j). Fieller, unlike the log-scale delta method, needs no log of a rate, so it
stays valid when the smaller rate is near 0 (the case the four-fifths rule is about), and it
becomes unbounded, honestly, when the larger rate is not distinguishable from 0.

References
----------
.. [1] S. Bird, M. Dudik, R. Edgar, B. Horn, R. Lutz, V. Milan, M. Sameki, H. Wallach and
       K. Walker, "Fairlearn: A toolkit for assessing and improving fairness in AI", Microsoft
       Technical Report MSR-TR-2020-32, 2020.
.. [2] E. C. Fieller, "Some problems in interval estimation", Journal of the Royal Statistical
       Society, Series B, 1954.
.. [3] T. Wang, J. Blocki, N. Li and S. Jha, "Locally differentially private protocols for
       frequency estimation", USENIX Security Symposium, 2017.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..validation import (
    check_binary_array,
    check_choice,
    check_finite,
    check_groups_array,
    check_num_groups,
    check_open_unit,
)
from .estimators import normal_quantile
from .frequency_oracle import FrequencyEstimate

__all__ = [
    "CELLS",
    "RATE_METRICS",
    "FourFifthsVerdict",
    "GroupRates",
    "IntersectionalGroups",
    "RateEstimate",
    "confusion_counts",
    "encode_cells",
    "group_rates",
]

#: The confusion cells of a user's report, in their order within a group; a fifth,
#: ``"undefined"``, is appended when ``num_cells=5``.
CELLS: tuple[str, ...] = ("TP", "FP", "FN", "TN")
UNDEFINED = "undefined"

_ALL = ("TP", "FP", "FN", "TN")

#: Rate metrics (fairlearn's names where fairlearn has one): numerator and denominator cells.
RATE_METRICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "selection_rate": (("TP", "FP"), _ALL),
    "true_positive_rate": (("TP",), ("TP", "FN")),
    "false_positive_rate": (("FP",), ("FP", "TN")),
    "false_negative_rate": (("FN",), ("TP", "FN")),
    "true_negative_rate": (("TN",), ("FP", "TN")),
    "accuracy": (("TP", "TN"), _ALL),
    "precision": (("TP",), ("TP", "FP")),
    "negative_predictive_value": (("TN",), ("TN", "FN")),
}

FOUR_FIFTHS = 0.8


# ---- encoding ------------------------------------------------------------------------------


def encode_cells(
    groups: np.ndarray,
    y_true: np.ndarray,
    y_pred: np.ndarray,
    num_groups: int,
    undefined: np.ndarray | None = None,
) -> np.ndarray:
    """Each user's category g c + cell (cells TP, FP, FN, TN; 4 = undefined if ``undefined``).

    ``y_true`` and ``y_pred`` hold 0/1; with ``undefined`` (a boolean mask) the domain has
    c = 5 cells and a flagged user's cell is 4 whatever its labels. Returns ``int16`` (or
    ``int64`` for large domains), ready for :meth:`FrequencyOracle.perturb`.

    >>> encode_cells([0, 0, 1, 1], [1, 0, 1, 0], [1, 1, 0, 0], num_groups=2)
    array([0, 1, 6, 7], dtype=int16)
    """
    num_groups = check_num_groups(num_groups)
    groups = check_groups_array(groups, num_groups)
    truth = _binary_bytes(y_true, "y_true")
    pred = _binary_bytes(y_pred, "y_pred")
    if not groups.shape == truth.shape == pred.shape:
        raise ValueError(
            "groups, y_true and y_pred must have the same length, got "
            f"{groups.shape[0]}, {truth.shape[0]} and {pred.shape[0]}"
        )
    cells = 4 if undefined is None else 5
    dtype = np.int16 if num_groups * cells < 2**15 else np.int64
    # g c + 3 - (2 y_pred + y_true): TP 0, FP 1, FN 2, TN 3, in place on the output
    label = np.add(pred, pred)  # uint8 (an add vectorises, a shift does not)
    label += truth
    codes = np.multiply(groups, cells, dtype=dtype, casting="unsafe")  # groups < num_groups
    codes += 3
    np.subtract(codes, label, out=codes, casting="unsafe")
    if undefined is not None:
        flag = check_binary_array(undefined, "undefined").astype(bool)
        if flag.shape != groups.shape:
            raise ValueError("undefined must have one entry per user")
        codes[flag] = groups[flag].astype(dtype) * cells + 4
    return codes


def _binary_bytes(values: np.ndarray, name: str) -> np.ndarray:
    """0/1 labels as bytes (``uint8``): 1-byte integers and booleans are checked with one
    pass and viewed, not copied; anything else (or a failed check, for its message) goes
    through :func:`~fedparity.mechanisms.validation.check_binary_array`."""
    array = np.asarray(values)
    if array.ndim == 1 and array.dtype in (np.bool_, np.int8, np.uint8):
        as_bytes = array.view(np.uint8)  # int8 -1 reads as 255
        if not as_bytes.size or int(as_bytes.max()) <= 1:
            return as_bytes
    return check_binary_array(array, name).view(np.uint8)


def confusion_counts(
    groups: np.ndarray,
    y_true: np.ndarray,
    y_pred: np.ndarray,
    num_groups: int,
    undefined: np.ndarray | None = None,
) -> np.ndarray:
    """Exact group x cell counts (no privacy): the noise-free input of :func:`group_rates`."""
    codes = encode_cells(groups, y_true, y_pred, num_groups, undefined)
    cells = 4 if undefined is None else 5
    return np.bincount(codes.astype(np.int64), minlength=num_groups * cells).astype(np.float64)


@dataclass(frozen=True)
class IntersectionalGroups:
    """Groups formed by several sensitive features: every combination of declared values.

    The categories are declared up front (the domain of a private report is agreed before any
    data is read); group codes are row-major over the features, as ``itertools.product``.

    >>> groups = IntersectionalGroups.from_categories({"sex": ["F", "M"], "race": ["a", "b"]})
    >>> groups.num_groups, groups.labels[1]
    (4, ('F', 'b'))
    >>> groups.encode({"sex": ["M", "F"], "race": ["b", "a"]})
    array([3, 0])
    """

    features: tuple[str, ...]
    categories: tuple[tuple[Any, ...], ...]

    @classmethod
    def from_categories(cls, categories: Mapping[str, Sequence[Any]]) -> IntersectionalGroups:
        """From {feature name: its possible values}."""
        if not categories:
            raise ValueError("categories must name at least one feature")
        values = []
        for name, options in categories.items():
            options = tuple(options)
            if not options or len({str(o) for o in options}) != len(options):
                raise ValueError(
                    f"categories[{name!r}] must be values with distinct text, at least one"
                )
            values.append(options)
        groups = cls(tuple(categories), tuple(values))
        check_num_groups(groups.num_groups, "number of intersectional groups")
        return groups

    @property
    def num_groups(self) -> int:
        """d: the product of the features' numbers of values."""
        return math.prod(len(c) for c in self.categories)

    @property
    def labels(self) -> tuple[tuple[Any, ...], ...]:
        """The group labels (tuples of feature values), in code order."""
        return tuple(itertools.product(*self.categories))

    def encode(self, values: Mapping[str, Sequence[Any]]) -> np.ndarray:
        """Group codes of users given {feature name: one value per user}."""
        missing = [name for name in self.features if name not in values]
        if missing:
            raise ValueError(f"values must hold every feature; missing {missing}")
        codes: np.ndarray | None = None
        for name, options in zip(self.features, self.categories, strict=True):
            column = np.asarray(values[name], dtype=object)
            lookup = {option: index for index, option in enumerate(options)}
            unique, inverse = np.unique(column.astype(str), return_inverse=True)
            originals = {str(o): o for o in options}
            index = np.empty(unique.shape[0], dtype=np.int64)
            for position, text in enumerate(unique):
                if text not in originals:
                    raise ValueError(
                        f"feature {name!r} has a value {str(text)!r} that is not among its "
                        f"declared categories {list(options)}"
                    )
                index[position] = lookup[originals[text]]
            feature_codes = index[inverse.reshape(-1)]
            codes = feature_codes if codes is None else codes * len(options) + feature_codes
            if codes.shape != feature_codes.shape:
                raise ValueError("every feature must have one value per user")
        assert codes is not None
        return codes

    def decode(self, codes: np.ndarray) -> dict[str, np.ndarray]:
        """{feature name: value per user} of group codes."""
        codes = check_groups_array(codes, self.num_groups, "codes").astype(np.int64)
        out: dict[str, np.ndarray] = {}
        for name, options in reversed(list(zip(self.features, self.categories, strict=True))):
            out[name] = np.asarray(options, dtype=object)[codes % len(options)]
            codes = codes // len(options)
        return {name: out[name] for name in self.features}


# ---- results -------------------------------------------------------------------------------


def _fmt(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.4g}"


@dataclass(frozen=True)
class RateEstimate:
    """A value with its standard error and interval; ``note`` says why a field is nan.

    For a summary across groups (min, max, difference, ratio) the interval is simultaneous
    over the groups and is not value +- z stderr; ``stderr`` is then the delta-method standard
    error of the selected groups' difference (or ratio), for information.
    """

    value: float
    stderr: float
    lower: float
    upper: float
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: nan becomes None."""
        out: dict[str, Any] = {
            key: (None if not math.isfinite(v) else float(v))
            for key, v in (
                ("value", self.value),
                ("stderr", self.stderr),
                ("lower", self.lower),
                ("upper", self.upper),
            )
        }
        out["note"] = self.note
        return out

    def __str__(self) -> str:
        text = f"{_fmt(self.value)} [{_fmt(self.lower)}, {_fmt(self.upper)}]"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class FourFifthsVerdict:
    """The four-fifths rule on a ratio's interval: ``"fails"``, ``"passes"`` or ``"undecided"``."""

    ratio: RateEstimate
    verdict: str
    sentence: str


def _label_text(label: Any) -> str:
    if isinstance(label, tuple):
        return " x ".join(str(part) for part in label)
    return str(label)


@dataclass(frozen=True, eq=False)  # array fields: identity, not ==
class GroupRates:
    """Rate metrics per group and overall, in fairlearn's ``MetricFrame`` vocabulary.

    Build with :func:`group_rates`. ``by_group[metric][label]`` and ``overall[metric]`` are
    :class:`RateEstimate` values; :meth:`group_min`, :meth:`group_max`, :meth:`difference` and
    :meth:`ratio` summarise across the groups (suppressed groups and groups whose rate is
    undefined left out, and named in the note); the derived metrics carry fairlearn's names.
    """

    metrics: tuple[str, ...]
    groups: tuple[Any, ...]
    confidence: float
    num_users: float
    group_counts: np.ndarray = field(repr=False)
    suppressed: tuple[Any, ...]
    min_group_count: float
    values: np.ndarray = field(repr=False)
    stderrs: np.ndarray = field(repr=False)
    covariance: np.ndarray = field(repr=False)
    notes: tuple[tuple[str, ...], ...] = field(repr=False)

    # ---- indexing --------------------------------------------------------------------

    def _metric_index(self, metric: str) -> int:
        check_choice("metric", metric, self.metrics)
        return self.metrics.index(metric)

    def _flat(self, metric_index: int, unit: int) -> int:
        return metric_index * (len(self.groups) + 1) + unit

    def _z(self, tests: int = 1) -> float:
        # two-sided, Bonferroni over ``tests``: P(|Z| <= z) = 1 - (1 - confidence) / tests
        return normal_quantile(1.0 - (1.0 - self.confidence) / max(tests, 1))

    def _estimate(self, metric_index: int, unit: int) -> RateEstimate:
        value = float(self.values[metric_index, unit])
        stderr = float(self.stderrs[metric_index, unit])
        note = self.notes[metric_index][unit]
        if not math.isfinite(value):
            lower = upper = math.nan
        elif math.isfinite(stderr):
            z = self._z()
            lower, upper = max(0.0, value - z * stderr), min(1.0, value + z * stderr)
        else:
            lower, upper = 0.0, 1.0
        return RateEstimate(value, stderr, lower, upper, note)

    @property
    def by_group(self) -> dict[str, dict[Any, RateEstimate]]:
        """{metric: {group label: estimate}}."""
        return {
            metric: {label: self._estimate(m, g) for g, label in enumerate(self.groups)}
            for m, metric in enumerate(self.metrics)
        }

    @property
    def overall(self) -> dict[str, RateEstimate]:
        """{metric: estimate over all users}."""
        d = len(self.groups)
        return {metric: self._estimate(m, d) for m, metric in enumerate(self.metrics)}

    def _valid_groups(self, metric_index: int) -> tuple[list[int], str]:
        valid, left_out = [], []
        for g, label in enumerate(self.groups):
            if math.isfinite(self.values[metric_index, g]):
                valid.append(g)
            else:
                left_out.append(_label_text(label))
        note = f"left out: {', '.join(left_out)}" if left_out else ""
        return valid, note

    def _pair_stats(self, i: int, j: int) -> tuple[float, float, float, float, float]:
        """(R_i, R_j, Var R_i, Var R_j, Cov) of two flat rate indices (nan if unknown)."""
        flat_values = self.values.reshape(-1)
        cov = self.covariance
        return (
            float(flat_values[i]),
            float(flat_values[j]),
            float(cov[i, i]),
            float(cov[j, j]),
            float(cov[i, j]),
        )

    def _known(self, i: int) -> bool:
        return bool(math.isfinite(self.stderrs.reshape(-1)[i]))

    def pair_difference(self, metric: str, first: int, second: int) -> tuple[float, float]:
        """(R_first - R_second, its delta-method standard error) of ``metric`` for two groups
        (by index); the standard error is nan when either rate's is unknown.

        Parameters
        ----------
        metric : str
            One of :attr:`metrics`.
        first, second : int
            Group indices in [0, number of groups).

        Returns
        -------
        (float, float)
            The difference and its standard error.
        """
        m = self._metric_index(metric)
        for name, group in (("first", first), ("second", second)):
            if not 0 <= group < len(self.groups):
                raise ValueError(f"{name} must be a group index in [0, {len(self.groups) - 1}]")
        i, j = self._flat(m, first), self._flat(m, second)
        ri, rj, vi, vj, cij = self._pair_stats(i, j)
        if not (self._known(i) and self._known(j)):
            return ri - rj, math.nan
        return ri - rj, math.sqrt(max(vi + vj - 2.0 * cij, 0.0))

    # ---- summaries -------------------------------------------------------------------

    def _extreme(self, metric: str, which: str) -> RateEstimate:
        m = self._metric_index(metric)
        valid, note = self._valid_groups(m)
        if not valid:
            return RateEstimate(math.nan, math.nan, math.nan, math.nan, "no group has a value")
        z = self._z(len(valid))
        values = self.values[m, valid]
        stderrs = self.stderrs[m, valid]
        lows = np.where(np.isfinite(stderrs), np.clip(values - z * stderrs, 0, 1), 0.0)
        highs = np.where(np.isfinite(stderrs), np.clip(values + z * stderrs, 0, 1), 1.0)
        pick = np.argmin(values) if which == "min" else np.argmax(values)
        reduce = np.min if which == "min" else np.max
        return RateEstimate(
            float(values[pick]),
            float(stderrs[pick]),
            float(reduce(lows)),
            float(reduce(highs)),
            note,
        )

    def _group_summary(self, metric: str | None, fn: Any) -> Any:
        if metric is not None:
            return fn(metric)
        return {name: fn(name) for name in self.metrics}

    def group_min(self, metric: str | None = None) -> Any:
        """Smallest group value (one metric, or {metric: estimate}); simultaneous interval."""
        return self._group_summary(metric, lambda name: self._extreme(name, "min"))

    def group_max(self, metric: str | None = None) -> Any:
        """Largest group value (one metric, or {metric: estimate}); simultaneous interval."""
        return self._group_summary(metric, lambda name: self._extreme(name, "max"))

    def _difference_pairs(self, metric: str, method: str) -> tuple[list[tuple[int, int]], str]:
        m = self._metric_index(metric)
        valid, note = self._valid_groups(m)
        if method == "between_groups":
            pairs = [
                (self._flat(m, i), self._flat(m, j)) for i, j in itertools.combinations(valid, 2)
            ]
        else:
            overall = self._flat(m, len(self.groups))
            if not math.isfinite(self.values[m, len(self.groups)]):
                return [], "overall value undefined"
            pairs = [(self._flat(m, g), overall) for g in valid]
        return pairs, note

    def _max_abs_difference(self, pairs: list[tuple[int, int]], note: str) -> RateEstimate:
        if not pairs:
            return RateEstimate(math.nan, math.nan, math.nan, math.nan, note or "needs 2 groups")
        z = self._z(len(pairs))
        best = (-1.0, math.nan)
        lower, upper = 0.0, 0.0
        for i, j in pairs:
            ri, rj, vi, vj, cij = self._pair_stats(i, j)
            diff = ri - rj
            if self._known(i) and self._known(j):
                se = math.sqrt(max(vi + vj - 2.0 * cij, 0.0))
                low, high = diff - z * se, diff + z * se
            else:
                se, low, high = math.nan, -1.0, 1.0
            lower = max(lower, low, -high)
            upper = max(upper, high, -low)
            if abs(diff) > best[0]:
                best = (abs(diff), se)
        return RateEstimate(best[0], best[1], min(lower, 1.0), min(upper, 1.0), note)

    def _fieller(self, i: int, j: int, z: float) -> tuple[float, float, float, float]:
        """(R_i / R_j, its delta se, Fieller lower, upper); an unbounded set is (-inf, inf)."""
        ri, rj, vi, vj, cij = self._pair_stats(i, j)
        value = ri / rj if rj > 0 else math.inf
        if not (self._known(i) and self._known(j)) or rj <= 0:
            return value, math.nan, -math.inf, math.inf
        se = math.sqrt(max(vi - 2 * value * cij + value * value * vj, 0.0)) / rj
        a = rj * rj - z * z * vj
        if a <= 0.0:
            return value, se, -math.inf, math.inf
        b = ri * rj - z * z * cij
        c = ri * ri - z * z * vi
        root = math.sqrt(max(b * b - a * c, 0.0))
        return value, se, (b - root) / a, (b + root) / a

    def _min_ratio(self, ordered: list[tuple[int, int]], tests: int, note: str) -> RateEstimate:
        if not ordered:
            return RateEstimate(math.nan, math.nan, math.nan, math.nan, note or "needs 2 groups")
        z = self._z(tests)
        best = (math.inf, math.nan)
        lower, upper = math.inf, math.inf
        for i, j in ordered:
            value, se, low, high = self._fieller(i, j, z)
            lower, upper = min(lower, low), min(upper, high)
            if value < best[0]:
                best = (value, se)
        value = best[0] if math.isfinite(best[0]) else math.nan
        if not math.isfinite(value):
            note = "; ".join(filter(None, [note, "largest value is <= 0"]))
        return RateEstimate(
            value, best[1], float(np.clip(lower, 0, 1)), float(np.clip(upper, 0, 1)), note
        )

    def _ratio_pairs(self, metric: str, method: str) -> tuple[list[tuple[int, int]], int, str]:
        m = self._metric_index(metric)
        valid, note = self._valid_groups(m)
        if method == "between_groups":
            unordered = list(itertools.combinations(valid, 2))
            ordered = [(self._flat(m, i), self._flat(m, j)) for i, j in unordered]
            ordered += [(b, a) for a, b in ordered]
            return ordered, len(unordered), note
        overall = self._flat(m, len(self.groups))
        if not math.isfinite(self.values[m, len(self.groups)]):
            return [], 0, "overall value undefined"
        ordered = [(self._flat(m, g), overall) for g in valid]
        ordered += [(b, a) for a, b in ordered]
        return ordered, len(valid), note

    def difference(self, metric: str | None = None, method: str = "between_groups") -> Any:
        """max - min over groups, or the largest ``|group - overall|`` (``method="to_overall"``).

        The interval is simultaneous over the pairs (Bonferroni), folded at 0.
        """
        check_choice("method", method, ("between_groups", "to_overall"))
        return self._group_summary(
            metric, lambda name: self._max_abs_difference(*self._difference_pairs(name, method))
        )

    def ratio(self, metric: str | None = None, method: str = "between_groups") -> Any:
        """min / max over groups, or the smallest of group / overall and overall / group.

        The interval is Fieller's, simultaneous over the pairs (Bonferroni), clipped to [0, 1].
        """
        check_choice("method", method, ("between_groups", "to_overall"))
        return self._group_summary(
            metric, lambda name: self._min_ratio(*self._ratio_pairs(name, method))
        )

    # ---- derived metrics (fairlearn's names) ----------------------------------------

    def demographic_parity_difference(self, method: str = "between_groups") -> RateEstimate:
        """Selection-rate difference (fairlearn ``demographic_parity_difference``)."""
        return self.difference("selection_rate", method)

    def demographic_parity_ratio(self, method: str = "between_groups") -> RateEstimate:
        """Selection-rate ratio (fairlearn ``demographic_parity_ratio``)."""
        return self.ratio("selection_rate", method)

    def equal_opportunity_difference(self, method: str = "between_groups") -> RateEstimate:
        """True-positive-rate difference (fairlearn ``equal_opportunity_difference``)."""
        return self.difference("true_positive_rate", method)

    def equal_opportunity_ratio(self, method: str = "between_groups") -> RateEstimate:
        """True-positive-rate ratio (fairlearn ``equal_opportunity_ratio``)."""
        return self.ratio("true_positive_rate", method)

    def equalized_odds_difference(self, method: str = "between_groups") -> RateEstimate:
        """The larger of the TPR and FPR differences (fairlearn, ``agg="worst_case"``).

        The interval is simultaneous over both metrics' pairs.
        """
        check_choice("method", method, ("between_groups", "to_overall"))
        tpr, note_t = self._difference_pairs("true_positive_rate", method)
        fpr, note_f = self._difference_pairs("false_positive_rate", method)
        return self._max_abs_difference(tpr + fpr, "; ".join(filter(None, [note_t, note_f])))

    def equalized_odds_ratio(self, method: str = "between_groups") -> RateEstimate:
        """The smaller of the TPR and FPR ratios (fairlearn, ``agg="worst_case"``)."""
        check_choice("method", method, ("between_groups", "to_overall"))
        tpr, tests_t, note_t = self._ratio_pairs("true_positive_rate", method)
        fpr, tests_f, note_f = self._ratio_pairs("false_positive_rate", method)
        notes = "; ".join(filter(None, [note_t, note_f]))
        return self._min_ratio(tpr + fpr, tests_t + tests_f, notes)

    def four_fifths(self, metric: str = "selection_rate") -> FourFifthsVerdict:
        """The four-fifths rule on ``ratio(metric)``, with its uncertainty."""
        ratio = self.ratio(metric)
        level = f"{100 * self.confidence:g} %"
        if not math.isfinite(ratio.lower) or not math.isfinite(ratio.upper):
            verdict, sentence = "undecided", f"four-fifths rule: undecided ({ratio.note})"
        elif ratio.upper < FOUR_FIFTHS:
            verdict = "fails"
            sentence = f"four-fifths rule fails: ratio < 0.8 with {level} confidence"
        elif ratio.lower >= FOUR_FIFTHS:
            verdict = "passes"
            sentence = f"four-fifths rule holds: ratio >= 0.8 with {level} confidence"
        else:
            verdict = "undecided"
            sentence = f"four-fifths rule undecided: the {level} interval contains 0.8"
        return FourFifthsVerdict(ratio, verdict, sentence)

    def derived(self) -> dict[str, RateEstimate]:
        """fairlearn's derived metrics (between groups), by name."""
        return {
            "demographic_parity_difference": self.demographic_parity_difference(),
            "demographic_parity_ratio": self.demographic_parity_ratio(),
            "equalized_odds_difference": self.equalized_odds_difference(),
            "equalized_odds_ratio": self.equalized_odds_ratio(),
            "equal_opportunity_difference": self.equal_opportunity_difference(),
            "equal_opportunity_ratio": self.equal_opportunity_ratio(),
        }

    # ---- output ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready dicts (nan as None, group labels as text)."""
        summaries = {
            metric: {
                "group_min": self.group_min(metric).to_dict(),
                "group_max": self.group_max(metric).to_dict(),
                "difference_between_groups": self.difference(metric).to_dict(),
                "difference_to_overall": self.difference(metric, "to_overall").to_dict(),
                "ratio_between_groups": self.ratio(metric).to_dict(),
                "ratio_to_overall": self.ratio(metric, "to_overall").to_dict(),
            }
            for metric in self.metrics
        }
        verdict = self.four_fifths()
        return {
            "confidence": self.confidence,
            "num_users": float(self.num_users),
            "groups": [_label_text(label) for label in self.groups],
            "group_counts": [float(c) for c in self.group_counts],
            "suppressed": [_label_text(label) for label in self.suppressed],
            "min_group_count": self.min_group_count,
            "by_group": {
                metric: {_label_text(label): e.to_dict() for label, e in groups.items()}
                for metric, groups in self.by_group.items()
            },
            "overall": {metric: e.to_dict() for metric, e in self.overall.items()},
            "summaries": summaries,
            "derived": {name: e.to_dict() for name, e in self.derived().items()},
            "four_fifths": {"verdict": verdict.verdict, "sentence": verdict.sentence},
        }

    def summary(self) -> str:
        """Verdict lines: the derived metrics with intervals, the four-fifths rule, suppression."""
        level = f"{100 * self.confidence:g} %"
        lines = [
            f"Group rates of {len(self.groups)} groups from about {self.num_users:.0f} users "
            f"({level} intervals, simultaneous across groups for summaries)"
        ]
        for name, estimate in self.derived().items():
            lines.append(f"  {name.replace('_', ' ')}: {estimate}")
        lines.append(f"  {self.four_fifths().sentence} (demographic parity ratio)")
        if self.suppressed:
            shown = ", ".join(_label_text(label) for label in self.suppressed)
            lines.append(f"  suppressed (noisy count < {self.min_group_count:g}): {shown}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        dp = self.demographic_parity_difference()
        return (
            f"GroupRates({len(self.groups)} groups, {len(self.metrics)} metrics, "
            f"~{self.num_users:.0f} users, demographic_parity_difference={dp})"
        )

    def to_pandas(self) -> Any:
        """A long ``pandas.DataFrame``: one row per (group or "overall", metric).

        Columns group, metric, value, stderr, lower, upper, note, suppressed;
        ``df.pivot(index="group", columns="metric", values="value")`` is fairlearn's
        ``by_group`` layout. pandas is imported here (it is optional).
        """
        try:
            import pandas as pd
        except ImportError as error:  # pragma: no cover - pandas is optional
            raise ImportError(
                "to_pandas needs pandas: pip install 'fedparity[frame]' (or pandas)"
            ) from error
        rows = []
        suppressed = set(self.suppressed)
        for metric, groups in self.by_group.items():
            for label, estimate in groups.items():
                rows.append(
                    {"group": label, "metric": metric, **estimate.__dict__}
                    | {"suppressed": label in suppressed}
                )
            rows.append(
                {"group": "overall", "metric": metric, **self.overall[metric].__dict__}
                | {"suppressed": False}
            )
        return pd.DataFrame(rows)


# ---- the computation -----------------------------------------------------------------------


def group_rates(
    counts: np.ndarray | FrequencyEstimate,
    covariance: np.ndarray | None = None,
    *,
    num_groups: int,
    group_labels: Sequence[Any] | None = None,
    confidence: float = 0.95,
    min_group_count: float = 0.0,
    metrics: Sequence[str] | None = None,
) -> GroupRates:
    """Every rate metric per group from (estimated) group x cell counts and their covariance.

    Parameters
    ----------
    counts : array or FrequencyEstimate
        d c counts in category order g c + cell (:func:`encode_cells`), c = 4 or 5; a
        :class:`FrequencyEstimate` brings its covariance.
    covariance : array, optional
        (d c, d c) covariance of the counts; None means exact counts (no noise).
    num_groups : int
        d.
    group_labels : sequence, optional
        One label per group (default 0 .. d - 1), e.g. ``IntersectionalGroups.labels``.
    confidence : float
        Level of every interval.
    min_group_count : float
        A group whose noisy count (the sum of its cells) is below this is suppressed: its
        values are nan, labelled "suppressed", and it is left out of the summaries.
    metrics : sequence of str, optional
        Metric names (default: all eight): "selection_rate", "true_positive_rate",
        "false_positive_rate", "false_negative_rate", "true_negative_rate", "accuracy",
        "precision", "negative_predictive_value".

    Notes
    -----
    A rate whose estimated denominator is <= 0 is nan (note says which cells); one whose
    denominator is not significantly above 0 (below z standard errors) keeps its value with a
    nan standard error and the interval [0, 1].
    """
    if isinstance(counts, FrequencyEstimate):
        if covariance is not None:
            raise ValueError("covariance must be None when counts is a FrequencyEstimate")
        covariance, num_users = counts.covariance, counts.num_users
        counts = counts.counts
    else:
        num_users = None
    num_groups = check_num_groups(num_groups)
    confidence = check_open_unit("confidence", confidence)
    min_group_count = check_finite("min_group_count", min_group_count)
    chosen = tuple(RATE_METRICS) if metrics is None else tuple(metrics)
    for metric in chosen:
        check_choice("metrics", metric, tuple(RATE_METRICS))
    if not chosen:
        raise ValueError("metrics must name at least one metric")
    values = np.asarray(counts, dtype=np.float64)
    k = values.shape[0] if values.ndim == 1 else -1
    if values.ndim != 1 or k not in (4 * num_groups, 5 * num_groups):
        raise ValueError(
            f"counts must be a 1-D array of num_groups x 4 or x 5 = {4 * num_groups} or "
            f"{5 * num_groups} cells, got shape {values.shape}"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("counts must be finite")
    cells = k // num_groups
    if covariance is None:
        sigma = np.zeros((k, k))
    else:
        sigma = np.asarray(covariance, dtype=np.float64)
        if sigma.shape != (k, k) or not np.all(np.isfinite(sigma)):
            raise ValueError(f"covariance must be a finite ({k}, {k}) matrix")
    labels = tuple(range(num_groups)) if group_labels is None else tuple(group_labels)
    if len(labels) != num_groups:
        raise ValueError(f"group_labels must have {num_groups} entries, got {len(labels)}")
    total_users = float(values.sum()) if num_users is None else float(num_users)

    by_group = values.reshape(num_groups, cells)
    group_counts = by_group.sum(axis=1)
    suppressed_mask = group_counts < min_group_count
    units = num_groups + 1
    z = normal_quantile(confidence)

    # Numerator / denominator rows over the k cells for every (metric, unit).
    numer = np.zeros((len(chosen) * units, k))
    denom = np.zeros_like(numer)
    cell_index = {name: i for i, name in enumerate(CELLS)}
    for m, metric in enumerate(chosen):
        top, bottom = RATE_METRICS[metric]
        for unit in range(units):
            row = m * units + unit
            targets = range(num_groups) if unit == num_groups else (unit,)
            for g in targets:
                for name in top:
                    numer[row, g * cells + cell_index[name]] = 1.0
                for name in bottom:
                    denom[row, g * cells + cell_index[name]] = 1.0
    num_hat, den_hat = numer @ values, denom @ values
    den_se = np.sqrt(np.clip(np.einsum("ij,jk,ik->i", denom, sigma, denom), 0.0, None))
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(den_hat > 0, num_hat / den_hat, np.nan)
        gradient = (numer - np.nan_to_num(rate)[:, None] * denom) / np.where(
            den_hat > 0, den_hat, 1.0
        )[:, None]
    rate_cov = gradient @ sigma @ gradient.T
    stderr = np.sqrt(np.clip(np.diag(rate_cov), 0.0, None))

    notes: list[list[str]] = []
    for m, metric in enumerate(chosen):
        bottom_cells = "+".join(RATE_METRICS[metric][1])
        row_notes = []
        for unit in range(units):
            row = m * units + unit
            if unit < num_groups and suppressed_mask[unit]:
                rate[row], stderr[row] = np.nan, np.nan
                row_notes.append(
                    f"suppressed: noisy count {group_counts[unit]:.4g} < {min_group_count:g}"
                )
            elif not den_hat[row] > 0:
                rate[row], stderr[row] = np.nan, np.nan
                row_notes.append(f"undefined: estimated {bottom_cells} count is <= 0")
            elif den_hat[row] < z * den_se[row]:
                stderr[row] = np.nan
                row_notes.append(
                    f"{bottom_cells} count {den_hat[row]:.4g} is within {z:.3g} standard errors "
                    f"({den_se[row]:.3g}) of 0: interval [0, 1]"
                )
            else:
                row_notes.append("")
        notes.append(row_notes)

    return GroupRates(
        metrics=chosen,
        groups=labels,
        confidence=confidence,
        num_users=total_users,
        group_counts=group_counts,
        suppressed=tuple(label for label, s in zip(labels, suppressed_mask, strict=True) if s),
        min_group_count=min_group_count,
        values=rate.reshape(len(chosen), units),
        stderrs=stderr.reshape(len(chosen), units),
        covariance=rate_cov,
        notes=tuple(tuple(row) for row in notes),
    )
