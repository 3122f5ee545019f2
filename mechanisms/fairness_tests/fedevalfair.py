"""FedEvalFair: per-client bootstrap disparities and the two-stage fairness test.

"FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation
Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review version);
FedEvalFair (anonymous, 2024) below; Sections 3-4 of the paper. What differs from the paper
is the calibrated mode (the default) below: the paper's statistics are miscalibrated (its
weights n_i / S_i^2 with n_i = B, its absolute disparities and its stage-1 statistic T1 each
make a fair model fail the test more often than alpha).

A client i holds a test set (predictions, labels, protected group A in {0, ..., d - 1}). It
draws B bootstrap resamples and computes the disparity on each (Section 3.2), the paper's two

    dp = P(Yhat = 1 | A = 0) - P(Yhat = 1 | A = 1)                   (signed; Eq. 1 has |.|)
    eo = P(Yhat = 1 | A = 0, Y = 1) - P(Yhat = 1 | A = 1, Y = 1)     (signed; Eq. 2 has |.|)

or any rate metric of :data:`METRICS`: the share of *successes* among the rows the metric
averages over, in group a minus group b (``comparison = (a, b)``, default (0, 1); rows of the
other groups are ignored):

    metric      rows         success     rate (fairness criterion)
    dp          all          Yhat = 1    selection rate (demographic parity)
    eo          Y = 1        Yhat = 1    true positive rate (equal opportunity)
    fnr         Y = 1        Yhat = 0    false negative rate
    fpr         Y = 0        Yhat = 1    false positive rate (with eo: equalized odds)
    tnr         Y = 0        Yhat = 0    true negative rate
    accuracy    all          Yhat = Y    accuracy
    precision   Yhat = 1     Y = 1       precision (predictive parity)
    npv         Yhat = 0     Y = 0       negative predictive value

Below, "group 0" and "group 1" are the comparison's two groups and a row "predicted positive"
is a success (Yhat = 1 for dp and eo), so everything holds for every metric. The client
reports a :class:`ClientSummary` (mean, variance, n). Two modes (``"paper"``: faithful,
miscalibrated; ``"calibrated"``: corrects it):

``"paper"``
    Faithful to the paper: the mean and sample variance S_i^2 of the B *absolute* bootstrap
    disparities, n_i = B; weights w_i = n_i / S_i^2 (so Var(mu_hat_i) = S_i^2 / B shrinks with B
    although the data did not change); stage 1 is Eq. 10,
    T1 = sum w_i (Ybar_i - mu_hat)^2 / (1 - omega_i), referred to chi2(k - 1), which it does
    not follow (the terms share mu_hat, so they are not independent): even with known
    variances and exactly normal data it rejects a true H0 at the 5% level at rate 0.164
    (k = 2), 0.109 (k = 5), 0.082 (k = 11) in a 20,000-draw simulation, where Cochran's
    Q = sum w_i (Ybar_i - mu_hat)^2 is exactly chi2(k - 1) (``tests/test_fairtest.py``).
``"calibrated"`` (default)
    The signed plug-in disparity mu_hat_i on the full test set and the bootstrap variance
    S_i^2 of the signed resamples as Var(mu_hat_i). Weights (not simply 1 / S_i^2; see
    below why not): w_i = 1 / V_i(0), where V_i(mu) = :func:`disparity_variance` is the
    variance of the holder's plug-in disparity given its *margins* (the two group sizes and
    the number of rows predicted positive among the rows the metric averages over) when
    its disparity is mu. V_i(0) is exact: given the margins, under fairness within the
    holder (the success independent of A among the metric's rows) the count of group 0's
    positives is hypergeometric, so mu_hat_i has mean 0 and variance V_i(0) whatever the
    cell sizes. The estimate is mu_hat = sum w_i Ybar_i / sum w_i with the sandwich standard
    error sqrt(sum w_i^2 S_i^2) / sum w_i (reported, and used for the confidence interval). The
    tests use the standard error the estimate has under their null: stage 2 is
    W* = (mu_hat - mu0) / se(mu0), se(mu) = sqrt(sum w_i^2 V_i(mu)) / sum w_i (at mu0 = 0,
    1 / sqrt(sum w): a stratified two-proportion score test, exact in its first two moments),
    and TOST uses se(+tolerance) and se(-tolerance). Stage 1 is
    Cochran's Q = sum u_i (Ybar_i - mu_u)^2 with u_i = 1 / V_i(c), c the round-1 mu_hat
    (the variance each holder's disparity has if all share the disparity c), referred to
    chi2(k - 1).

    Why not 1 / S_i^2: S_i^2 is a plug-in variance that is correlated with the plug-in
    disparity when a (group, prediction) cell holds a handful of rows (a group with few
    predicted positives has both a low rate and a low S^2), so 1 / S_i^2 favours extreme
    holders and both stages are liberal: type-I error 0.51 (stage 2) for 10 Adult holders
    of 100 rows. V_i depends on the margins only, which are independent of the disparity's
    sign under the null. A summary without margins (``ClientSummary.margins = None``, e.g.
    a CSV with mean and variance only) falls back to V_i = S_i^2, i.e. the plain
    inverse-variance form (w_i = 1 / S_i^2, every standard error 1 / sqrt(sum w), Cochran's
    Q with the same weights). benchmarks/fedevalfair_mc.py measures both (``--no-margins``).

In both modes mu_hat = sum w_i Ybar_i / sum w_i (Graybill-Deal, Eq. 6); in mode "paper"
its standard error is 1 / sqrt(sum w_i) and stage 2 (Algorithm 2) W* = sqrt(sum w_i)
(mu_hat - mu0) ~ N(0, 1), two sided; the equivalence test (TOST, two one-sided tests; not
in the paper, it is what an operator who wants to *certify* fairness needs) certifies
|mu| < tolerance with the same standard error.

The server only adds (the paper's Algorithms 1-2; the encrypted protocol is
:mod:`fedparity.mechanisms.crypto.ckks`): in round 1 every client adds
:func:`client_contribution` = [w_i, w_i Ybar_i, w_i Ybar_i^2, w_i^2 Var_i, and w_i^2 V_i at
mu0, +tolerance and -tolerance, the group counts, 1] (:data:`ROUND1_FIELDS`); in round 2,
given the decrypted round-1 totals, it adds :func:`stage1_term` (:data:`STAGE1_FIELDS`);
:func:`stage1_statistic` and :func:`report_from_sums` turn the two totals into the
:class:`FairnessReport`. :func:`fedevalfair` is that computation in one process, and
:func:`stage_statistics` the same kernels over arrays (Monte Carlo).

The common disparity mu_hat is a precision-weighted mean, dominated by the most precise
holders; a calibrated report also gives the pooled disparity X0 / N0 - X1 / N1 of all holders'
rows (:class:`PooledDisparity`, from the summed group counts of round 1) and, for when stage 1
rejects, a random-effects summary (:class:`RandomEffects`: DerSimonian-Laird's tau^2, its
Q-profile interval and the random-effects mean, from the round-2 sums on the tau^2 grid
:data:`TAU2_GRID`; :func:`random_effects_release`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict

import numpy as np

from ..formatting import format_number
from ..ldp.estimators import ConfidenceInterval, normal_quantile
from ..validation import (
    check_binary_array,
    check_choice,
    check_finite,
    check_generator,
    check_groups_array,
    check_int,
    check_int_at_least,
    check_nonnegative_finite,
    check_open_unit,
    check_positive_finite,
)

Mode = Literal["calibrated", "paper"]
Metric = Literal["dp", "eo", "fnr", "fpr", "tnr", "accuracy", "precision", "npv"]
MODES: tuple[Mode, ...] = ("paper", "calibrated")
#: Every rate metric (the module docstring's table): "dp" and "eo" are the paper's.
METRICS: tuple[Metric, ...] = ("dp", "eo", "fnr", "fpr", "tnr", "accuracy", "precision", "npv")
# The kernels' inputs and StageStatistics' fields: arrays over any leading axes (resamples,
# clients), or one client's scalar.
Floats = np.ndarray | np.float64

#: Names of the round-1 vector's entries (what :func:`client_contribution` returns).
ROUND1_FIELDS: tuple[str, ...] = (
    "sum_weights",
    "sum_weighted_means",
    "sum_weighted_squared_means",
    "sum_squared_weights_times_variances",
    "sum_squared_weights_times_null_variances",
    "sum_squared_weights_times_variances_at_plus_tolerance",
    "sum_squared_weights_times_variances_at_minus_tolerance",
    "sum_group0_rows",
    "sum_group0_predicted_positive",
    "sum_group1_rows",
    "sum_group1_predicted_positive",
    "num_clients_with_counts",
    "num_clients",
)
#: Index of the first group-count entry of the round-1 vector (the pooled disparity's counts:
#: group-0 rows, of them predicted positive, group-1 rows, of them predicted positive, and 1
#: if the client sent its counts).
_COUNTS = ROUND1_FIELDS.index("sum_group0_rows")
#: The between-holder variances tau^2 at which every holder adds its random-effects sums in
#: round 2 (a protocol constant, never sent by the server, so that no holder can be given
#: another grid than the others): 0, then 10^-6 to 1 in steps of a factor 10^(1/12).
TAU2_GRID: tuple[float, ...] = (0.0, *(10.0 ** (j / 12.0 - 6.0) for j in range(73)))
#: Factor between consecutive positive points of :data:`TAU2_GRID` (the interval's resolution).
TAU2_GRID_FACTOR = 10.0 ** (1.0 / 12.0)
#: Level of the Q-profile interval for tau^2 the key holders release (fixed by the protocol).
TAU2_INTERVAL_LEVEL = 0.95
#: Per grid point of :data:`TAU2_GRID`, the round-2 sums with w(t) = 1 / (V_i + t).
_GRID_SUMS: tuple[str, ...] = (
    "sum_weighted_squared_deviations",
    "sum_weights",
    "sum_weighted_deviations",
    "sum_weighted_means",
)
#: Names of the round-2 vector's entries (what :func:`stage1_term` returns): Cochran's Q is
#: sum u (Ybar - c)^2 - (sum u (Ybar - c))^2 / sum u, exact over whichever clients add them.
#: Mode "paper" sends [T1 term, 0, 0].
#: After these three: sum u^2 (DerSimonian-Laird's tau^2) and, for every tau^2 t of
#: :data:`TAU2_GRID`, [sum w (Ybar - c)^2, sum w, sum w (Ybar - c), sum w Ybar] with
#: w = 1 / (1 / u + t) (the Q-profile and the random-effects mean); zeros in mode "paper".
STAGE1_FIELDS: tuple[str, ...] = (
    "sum_weighted_squared_deviations",
    "sum_stage1_weights",
    "sum_weighted_deviations",
    "sum_squared_stage1_weights",
    *(f"tau2_grid_{j}_{name}" for j in range(len(TAU2_GRID)) for name in _GRID_SUMS),
)
#: What the key holders release of a calibrated block's random-effects summary
#: (:func:`random_effects_release`), after the stage-1 statistic and the round-2 sums.
RANDOM_EFFECTS_FIELDS: tuple[str, ...] = (
    "tau2",
    "tau2_low",
    "tau2_high",
    "tau2_used",
    "random_effects_mean",
    "random_effects_sum_weights",
)
#: Elements of one bootstrap index chunk (B x n is drawn in chunks of this many; ~32 MB).
_CHUNK_ELEMENTS = 1 << 22
#: Cell code of a row the metric ignores (eo: Y = 0; a group outside the comparison).
_IGNORED = 4


class _RateRule(NamedTuple):
    """A rate metric: the rows it averages over and its successes among them, each a test
    (column, value) on a column of :func:`_columns` (None: every row)."""

    rows: tuple[str, int] | None
    success: tuple[str, int]
    members: str  # the rows, as InsufficientGroupData's messages name them


#: The rows and the success of every metric of :data:`METRICS` (module docstring's table).
_RATE_RULES: dict[Metric, _RateRule] = {
    "dp": _RateRule(None, ("predictions", 1), "members"),
    "eo": _RateRule(("labels", 1), ("predictions", 1), "positive (Y = 1) members"),
    "fnr": _RateRule(("labels", 1), ("predictions", 0), "positive (Y = 1) members"),
    "fpr": _RateRule(("labels", 0), ("predictions", 1), "negative (Y = 0) members"),
    "tnr": _RateRule(("labels", 0), ("predictions", 0), "negative (Y = 0) members"),
    "accuracy": _RateRule(None, ("correct", 1), "members"),
    "precision": _RateRule(
        ("predictions", 1), ("labels", 1), "predicted positive (Yhat = 1) members"
    ),
    "npv": _RateRule(("predictions", 0), ("labels", 0), "predicted negative (Yhat = 0) members"),
}


def normal_interval(estimate: float, stderr: float, level: float) -> ConfidenceInterval:
    """The normal interval ``estimate +/- z stderr`` at ``level`` (two-sided)."""
    level = check_open_unit("level", level)
    half = normal_quantile(level) * stderr
    return ConfidenceInterval(estimate - half, estimate + half)


class InsufficientGroupData(ValueError):
    """The client's test set cannot produce the disparity, so the client cannot take part."""


# --------------------------------------------------------------------------------------------
# What a client reports
# --------------------------------------------------------------------------------------------


def _check_margins(margins: object) -> tuple[int, int, int]:
    """(group-0 rows, group-1 rows, rows predicted positive): each group >= 1 row and the
    positives strictly between 0 and the total (else the disparity cannot vary)."""
    if not isinstance(margins, tuple | list | np.ndarray) or len(margins) != 3:
        raise ValueError(
            f"margins must be (group0_rows, group1_rows, predicted_positive_rows), got {margins!r}"
        )
    group0, group1, positives = (
        check_int_at_least(name, value, 0)
        for name, value in zip(
            ("margins group0_rows", "margins group1_rows", "margins predicted_positive_rows"),
            margins,
            strict=True,
        )
    )
    if group0 < 1 or group1 < 1:
        raise ValueError(f"margins: each group needs >= 1 row, got {group0} and {group1}")
    if not 0 < positives < group0 + group1:
        raise ValueError(
            f"margins predicted_positive_rows must be in (0, {group0 + group1}) (both "
            f"predictions present), got {positives}"
        )
    return group0, group1, positives


def disparity_variance(margins: tuple[int, int, int], disparity: float = 0.0) -> float:
    """Variance of a holder's plug-in disparity given its margins, at disparity ``disparity``.

    ``margins`` = (n0, n1, x): the rows of group 0 and group 1 the metric averages over, and
    how many of those are predicted positive; N = n0 + n1, p = x / N. The group rates that
    keep p and have difference mu are r0 = p + n1 mu / N and r1 = p - n0 mu / N, and

        V(mu) = N / (N - 1) * (r0 (1 - r0) / n0 + r1 (1 - r1) / n1).

    At mu = 0 this is p (1 - p) (1 / n0 + 1 / n1) N / (N - 1), the exact variance of
    x0 / n0 - (x - x0) / n1 when x0 is hypergeometric (Yhat independent of A given the
    margins): no approximation, whatever the cell sizes. A rate outside
    [1 / (2 n), 1 - 1 / (2 n)] (a mu that this holder's margins cannot produce) is clipped to
    that range, half a row from the boundary, widened to contain p (so mu = 0 is never
    clipped and V > 0). Used for the calibrated weights (module docstring).
    """
    checked = _check_margins(margins)
    disparity = check_finite("disparity", disparity)
    return float(disparity_variances(np.asarray(checked, dtype=np.float64), disparity))


def disparity_variances(margins: np.ndarray, disparity: np.ndarray | float) -> np.ndarray:
    """:func:`disparity_variance` over arrays, without its input checks: ``margins`` (..., 3)
    of valid margins (n0, n1, x), ``disparity`` broadcasts to (...); returns (...)."""
    group0, group1, positives = margins[..., 0], margins[..., 1], margins[..., 2]
    total = group0 + group1
    rate = positives / total

    def clip(value: np.ndarray, size: np.ndarray) -> np.ndarray:
        return np.clip(value, np.minimum(0.5 / size, rate), np.maximum(1.0 - 0.5 / size, rate))

    rate0 = clip(rate + group1 * disparity / total, group0)
    rate1 = clip(rate - group0 * disparity / total, group1)
    return total / (total - 1) * (rate0 * (1.0 - rate0) / group0 + rate1 * (1.0 - rate1) / group1)


@dataclass(frozen=True)
class ClientSummary:
    """A client's bootstrap summary (paper Section 3.1: Ybar_i, S_i^2, n_i) and its margins.

    Attributes
    ----------
    mean : float
        Ybar_i: the mean ``|disparity|`` of the resamples (mode "paper") or the signed plug-in
        disparity (mode "calibrated").
    variance : float
        S_i^2 > 0: the sample variance (ddof = 1) of the resamples (of ``|disparity|`` in mode
        "paper", of the signed disparity in mode "calibrated", where it estimates
        Var(mean)).
    n : int
        n_i >= 2: the number of bootstrap resamples B (the paper's n_i; its weights are
        n_i / S_i^2). Not used by the calibrated mode.
    margins : (int, int, int) or None
        Calibrated mode: (group-0 rows, group-1 rows, successes) among the rows the metric
        averages over (all rows for dp, Y = 1 for eo, ...; the successes are the rows
        predicted positive for dp and eo; module docstring's table); the calibrated
        weights come from :func:`disparity_variance` of these. None: weights 1 / S_i^2 (the
        plain inverse-variance form, liberal with small cells; module docstring). Not used by
        the paper mode.
    """

    mean: float
    variance: float
    n: int
    margins: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", check_finite("mean", self.mean))
        object.__setattr__(self, "variance", check_positive_finite("variance", self.variance))
        object.__setattr__(self, "n", check_int_at_least("n", self.n, 2))
        if self.margins is not None:
            object.__setattr__(self, "margins", _check_margins(self.margins))


@dataclass(frozen=True, eq=False)
class BootstrapDisparity:
    """B bootstrap disparities of one client's test set (paper Sections 3.1-3.2).

    The disparity is the success rate of group a = ``comparison[0]`` minus that of group
    b = ``comparison[1]`` among the rows the metric averages over (module docstring's table;
    a success is Yhat = 1 for "dp" and "eo"); "group 0" and "group 1" below are a and b.

    Attributes
    ----------
    metric : one of :data:`METRICS`
    plugin : float
        The signed disparity on the full test set (mu_hat_i of the calibrated mode).
    resamples : np.ndarray
        The B signed bootstrap disparities Y_i1 .. Y_iB (read-only).
    redraws : int
        Resamples discarded and drawn again because they lacked a member of a or of b among
        the metric's rows (for "eo": a positive, Y = 1, member).
    group_sizes : tuple of int
        Rows of group a and group b that the metric averages over (all rows for "dp", the
        positives for "eo", ...).
    num_samples : int
        Rows of the test set (the size n of each resample), whatever their group.
    cell_counts : tuple of int
        Counts of (a, failure), (a, success), (b, failure), (b, success) among the rows the
        metric averages over (for "dp": (A=a, Yhat=0), (A=a, Yhat=1), ...). With a handful of
        rows in a cell, S^2 is strongly correlated with the plug-in disparity (why the
        calibrated weights use :attr:`margins`).
    comparison : (int, int)
        (a, b), the groups compared (default (0, 1)).
    """

    metric: Metric
    plugin: float
    resamples: np.ndarray
    redraws: int
    group_sizes: tuple[int, int]
    num_samples: int
    cell_counts: tuple[int, int, int, int]
    comparison: tuple[int, int] = (0, 1)

    @property
    def margins(self) -> tuple[int, int, int]:
        """(group-a rows, group-b rows, successes) among the metric's rows (for "dp" and "eo"
        the successes are the rows predicted positive)."""
        counts = self.cell_counts
        return self.group_sizes[0], self.group_sizes[1], counts[1] + counts[3]

    @property
    def smallest_margin(self) -> int:
        """min(group-a rows, group-b rows, successes, failures) among the metric's rows (for
        "dp" and "eo": rows predicted positive and negative): what the app's
        ``fef-min-cell`` rule compares."""
        group0, group1, positives = self.margins
        return min(group0, group1, positives, group0 + group1 - positives)

    @property
    def num_resamples(self) -> int:
        """B."""
        return int(self.resamples.shape[0])

    @property
    def mean(self) -> float:
        """Mean of the signed resamples."""
        return float(np.mean(self.resamples))

    @property
    def variance(self) -> float:
        """Sample variance (ddof = 1) of the signed resamples: the bootstrap Var(plugin)."""
        return float(np.var(self.resamples, ddof=1))

    def summary(self, mode: Mode = "calibrated") -> ClientSummary:
        """What the client reports in ``mode`` (``"paper"`` or ``"calibrated"``).

        ``"paper"``: mean and S^2 of ``|Y_ij|``, n = B. ``"calibrated"``: the signed plug-in
        disparity, S^2 of the signed Y_ij, n = B (unused) and the :attr:`margins`.

        Raises
        ------
        InsufficientGroupData
            If every resample gives the same value (S^2 = 0, e.g. a model that predicts the
            same class for everyone): no variance can be estimated from this test set.
        """
        mode = check_choice("mode", mode, MODES)
        margins: tuple[int, int, int] | None = None
        if mode == "paper":
            values = np.abs(self.resamples)
            mean = float(np.mean(values))
        else:
            values = self.resamples
            mean = self.plugin
            margins = self.margins
        variance = float(np.var(values, ddof=1))
        if not variance > 0.0:
            raise InsufficientGroupData(
                f"all {self.num_resamples} bootstrap disparities ({self.metric}) are equal, so "
                "their variance is 0: this test set cannot estimate the disparity's "
                "uncertainty and the client cannot take part"
            )
        return ClientSummary(mean=mean, variance=variance, n=self.num_resamples, margins=margins)


def _columns(predictions: np.ndarray, labels: np.ndarray | None) -> dict[str, np.ndarray]:
    """The 0/1 columns a metric's rows and success test: Yhat, Y and Yhat = Y (no labels:
    Yhat only)."""
    if labels is None:
        return {"predictions": predictions}
    return {"predictions": predictions, "labels": labels, "correct": predictions == labels}


def _cell_codes(
    predictions: np.ndarray,
    labels: np.ndarray | None,
    groups: np.ndarray,
    metric: Metric,
    comparison: tuple[int, int] = (0, 1),
) -> np.ndarray:
    """Cell of every row: 2 side + success for rows the metric averages over (side 0 in group
    comparison[0], 1 in comparison[1]), else 4 (eo: Y = 0; any other group)."""
    rule = _RATE_RULES[metric]
    columns = _columns(predictions, labels)
    column, value = rule.success
    success = (columns[column] == value).astype(np.uint8)
    side = np.where(groups == comparison[0], 0, np.where(groups == comparison[1], 1, -1))
    kept = side >= 0
    if rule.rows is not None:
        column, value = rule.rows
        kept &= columns[column] == value
    codes = np.full(predictions.shape, _IGNORED, dtype=np.uint8)
    codes[kept] = 2 * side[kept] + success[kept]
    return codes


def _check_comparison(comparison: object) -> tuple[int, int]:
    """(a, b): two different group numbers >= 0."""
    if not isinstance(comparison, tuple | list) or len(comparison) != 2:
        raise ValueError(
            f"comparison must be a pair (a, b) of different group numbers >= 0, got {comparison!r}"
        )
    first, second = (
        check_int_at_least(f"comparison[{i}]", value, 0) for i, value in enumerate(comparison)
    )
    if first == second:
        raise ValueError(f"comparison must name two different groups, got ({first}, {second})")
    return first, second


def reference_comparisons(num_groups: int, reference: int = 0) -> tuple[tuple[int, int], ...]:
    """The comparisons of every group against ``reference``: ((reference, g) for every other
    group g = 0, ..., num_groups - 1, in increasing order), one
    :func:`bootstrap_disparity` ``comparison`` each.

    >>> reference_comparisons(3)
    ((0, 1), (0, 2))
    >>> reference_comparisons(4, reference=2)
    ((2, 0), (2, 1), (2, 3))
    """
    num_groups = check_int_at_least("num_groups", num_groups, 2)
    reference = check_int("reference", reference, minimum=0, maximum=num_groups - 1)
    return tuple((reference, group) for group in range(num_groups) if group != reference)


def _cell_counts(cells: np.ndarray) -> np.ndarray:
    """Counts of cells 0..3 along the last axis: shape (..., 4)."""
    return np.stack([np.count_nonzero(cells == c, axis=-1) for c in range(4)], axis=-1)


def _lacking(counts: np.ndarray) -> np.ndarray:
    """Rows of ``counts`` with no member of group 0 or of group 1."""
    return (counts[..., 0] + counts[..., 1] == 0) | (counts[..., 2] + counts[..., 3] == 0)


def _disparity(counts: np.ndarray) -> np.ndarray:
    """c1 / (c0 + c1) - c3 / (c2 + c3): success rate of group a minus that of group b."""
    return counts[..., 1] / (counts[..., 0] + counts[..., 1]) - counts[..., 3] / (
        counts[..., 2] + counts[..., 3]
    )


def bootstrap_disparity(
    predictions: np.ndarray,
    labels: np.ndarray | None,
    groups: np.ndarray,
    *,
    metric: Metric = "dp",
    num_resamples: int = 100,
    rng: np.random.Generator,
    max_redraws: int | None = None,
    comparison: tuple[int, int] = (0, 1),
) -> BootstrapDisparity:
    """Bootstrap the signed disparity of one client's test set (FedEvalFair Sections 3.1-3.2).

    The disparity is the success rate of group a = ``comparison[0]`` minus that of group
    b = ``comparison[1]`` among the rows ``metric`` averages over (module docstring's
    table); rows outside them (for ``"eo"``: Y = 0; any group but a and b) are ignored but
    still drawn. Each of the B resamples draws n rows with replacement (n = the test set's
    size). A resample without a member of group a or of group b among the metric's rows (for
    ``"eo"``: without a positive, Y = 1, member) has no disparity; it is discarded and drawn
    again (the paper does not cover this case). The B x n index matrix is drawn at once (in
    chunks of ~4M entries), and the group rates are counts along each row.

    Parameters
    ----------
    predictions, labels : array of 0/1
        Yhat and Y of the n rows. ``labels`` may be None for ``metric="dp"`` only.
    groups : array of int
        The protected attribute A of the n rows: group labels 0, 1, ..., d - 1 (0/1 for two
        groups; an intersection of attributes encoded as one label per combination).
    metric : one of :data:`METRICS`
        ``"dp"`` demographic parity (Eq. 1), ``"eo"`` equal opportunity (Eq. 2), or the
        difference of ``"fnr"``, ``"fpr"``, ``"tnr"``, ``"accuracy"``, ``"precision"`` or
        ``"npv"``; signed: group a minus group b.
    num_resamples : int
        B >= 2.
    rng : np.random.Generator
    max_redraws : int, optional
        Most resamples that may be discarded in total (default 10 B); beyond it
        :class:`InsufficientGroupData` is raised.
    comparison : (int, int)
        (a, b), two different groups >= 0 (default (0, 1)); :func:`reference_comparisons`
        lists every group against a reference.

    Raises
    ------
    InsufficientGroupData
        Group a or group b has no row the metric averages over (for ``"eo"``: a group without
        positives), or more than ``max_redraws`` resamples lacked one: the client cannot
        take part.

    References
    ----------
    .. [1] Anonymous authors, "FedEvalFair: A Privacy-Preserving and Statistically Grounded
           Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
           (anonymous review version), 2024. Sections 3.1 (Eq. 1, Eq. 2) and 3.2 (bootstrap).
    """
    metric = check_choice("metric", metric, METRICS)
    num_resamples = check_int_at_least("num_resamples", num_resamples, 2)
    max_redraws = 10 * num_resamples if max_redraws is None else max_redraws
    max_redraws = check_int_at_least("max_redraws", max_redraws, 0)
    comparison = _check_comparison(comparison)
    check_generator("rng", rng)
    predictions = check_binary_array(predictions, "predictions")
    groups = check_groups_array(groups, None)
    if groups.shape != predictions.shape:
        raise ValueError(
            f"groups must have one entry per prediction ({predictions.size}), got {groups.size}"
        )
    if labels is None:
        if metric != "dp":
            raise ValueError(
                f"labels are required for metric={metric!r} ({METRIC_NAMES[metric]}: its rows "
                "or its successes depend on Y); only 'dp' needs none"
            )
    else:
        labels = check_binary_array(labels, "labels")
        if labels.shape != predictions.shape:
            raise ValueError(
                f"labels must have one entry per prediction ({predictions.size}), got {labels.size}"
            )
    cells = _cell_codes(predictions, labels, groups, metric, comparison)
    counts = _cell_counts(cells)
    sizes = (int(counts[0] + counts[1]), int(counts[2] + counts[3]))
    members = _RATE_RULES[metric].members
    sizes_text = (
        f"group sizes {sizes[0]} and {sizes[1]}"
        if comparison == (0, 1)
        else f"sizes {sizes[0]} of group {comparison[0]} and {sizes[1]} of group {comparison[1]}"
    )
    for group, size in zip(comparison, sizes, strict=True):
        if size == 0:
            raise InsufficientGroupData(
                f"groups: the test set has no {members} of group {group} "
                f"({sizes_text} of {predictions.size} rows), so "
                f"its {metric} disparity is undefined and the client cannot take part"
            )
    num_rows = int(predictions.size)
    resamples = np.empty(num_resamples)
    redraws = 0
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // num_rows)
    for start in range(0, num_resamples, rows_per_chunk):
        stop = min(start + rows_per_chunk, num_resamples)
        chunk = _cell_counts(cells[rng.integers(0, num_rows, size=(stop - start, num_rows))])
        bad = _lacking(chunk)
        while bad.any():
            discarded = int(np.count_nonzero(bad))
            if redraws + discarded > max_redraws:
                raise InsufficientGroupData(
                    f"max_redraws: more than {max_redraws} bootstrap resamples lacked {members} "
                    f"of a group ({sizes_text} of {num_rows} rows); "
                    "the test set is too small or too unbalanced and the client cannot take part"
                )
            redraws += discarded
            chunk[bad] = _cell_counts(cells[rng.integers(0, num_rows, size=(discarded, num_rows))])
            bad = _lacking(chunk)
        resamples[start:stop] = _disparity(chunk)
    resamples.flags.writeable = False
    return BootstrapDisparity(
        metric=metric,
        plugin=float(_disparity(counts)),
        resamples=resamples,
        redraws=redraws,
        group_sizes=sizes,
        num_samples=num_rows,
        cell_counts=(int(counts[0]), int(counts[1]), int(counts[2]), int(counts[3])),
        comparison=comparison,
    )


# --------------------------------------------------------------------------------------------
# Kernels (array-valued; every entry point below uses them)
# --------------------------------------------------------------------------------------------


def _variances_at(
    variances: Floats,
    sizes: Floats,
    margins: np.ndarray | None,
    mode: Mode,
    disparity: np.ndarray | float,
) -> Floats:
    """Var_i if the common disparity were ``disparity``: V_i(disparity) from the margins
    (calibrated; rows of ``margins`` with NaN fall back), else S^2 (S^2 / n in mode paper)."""
    variance_of_mean = variances / sizes if mode == "paper" else variances
    if mode == "paper" or margins is None:
        return variance_of_mean
    known = ~np.isnan(margins[..., 0])
    safe = np.where(known[..., None], margins, 1.0)
    return np.where(known, disparity_variances(safe, disparity), variance_of_mean)


def _weights(
    variances: Floats, sizes: Floats, margins: np.ndarray | None, mode: Mode
) -> tuple[Floats, Floats]:
    """Round-1 weights w_i and Var_i (the variance the standard error uses).

    Paper: w = n / S^2, Var = S^2 / n (Eq. 6). Calibrated: w = 1 / V_i(0) from the margins
    (:func:`disparity_variance`; 1 / S^2 without them), Var = S^2.
    """
    if mode == "paper":
        weights, variance_of_mean = sizes / variances, variances / sizes
    else:
        weights = 1.0 / _variances_at(variances, sizes, margins, mode, 0.0)
        variance_of_mean = variances
    if not np.all(np.isfinite(weights)):
        raise ValueError("variance is too small: a weight n / variance or 1 / variance overflows")
    return weights, variance_of_mean


def _group_counts(means: Floats, margins: np.ndarray | None, mode: Mode) -> np.ndarray:
    """[n0, x0, n1, x1, 1] on a new last axis: the rows of each group the metric averages over
    and how many of them are predicted positive, recovered from the calibrated summary (its
    plug-in disparity x0 / n0 - x1 / n1 and margins (n0, n1, x0 + x1)); zeros where the
    summary holds no counts (mode "paper", no margins, or a mean that no integer x0 gives)."""
    shape = np.shape(means)
    if mode == "paper" or margins is None:
        return np.zeros((*shape, 5))
    group0, group1, positives = margins[..., 0], margins[..., 1], margins[..., 2]
    with np.errstate(invalid="ignore"):
        exact = group0 * (means * group1 + positives) / (group0 + group1)
        rounded = np.round(exact)
        # The recovered count is an integer to rounding error (~1e-16 of n0 n1 / N) and gives
        # the mean back; anything else is a summary that was not computed from counts.
        recovered = rounded / group0 - (positives - rounded) / group1
        valid = (
            np.isfinite(exact)
            & (np.abs(exact - rounded) <= 1e-6)
            & (np.abs(recovered - means) <= 1e-12)
            & (rounded >= 0.0)
            & (rounded <= group0)
            & (positives - rounded >= 0.0)
            & (positives - rounded <= group1)
        )
    counts = np.stack([group0, rounded, group1, positives - rounded, np.ones_like(exact)], axis=-1)
    return np.where(valid[..., None], counts, 0.0)


def _round1_vectors(
    means: Floats,
    variances: Floats,
    sizes: Floats,
    margins: np.ndarray | None,
    mode: Mode,
    mu0: float,
    tolerance: float | None,
) -> np.ndarray:
    """[w, w Ybar, w Ybar^2, w^2 Var, w^2 V(mu0), w^2 V(tol), w^2 V(-tol), the group counts
    (:func:`_group_counts`), 1] on a new last axis."""
    weights, variance_of_mean = _weights(variances, sizes, margins, mode)
    tol = 0.0 if tolerance is None else tolerance
    null = [
        weights**2 * _variances_at(variances, sizes, margins, mode, value)
        for value in (mu0, tol, -tol)
    ]
    moments = np.stack(
        [weights, weights * means, weights * means**2, weights**2 * variance_of_mean, *null], -1
    )
    counts = _group_counts(np.broadcast_to(means, np.shape(weights)), margins, mode)
    return np.concatenate([moments, counts, np.ones_like(weights)[..., None]], -1)


def _stage1_vectors(
    means: Floats,
    variances: Floats,
    sizes: Floats,
    margins: np.ndarray | None,
    totals: np.ndarray,
    mode: Mode,
) -> np.ndarray:
    """Round-2 vectors (:data:`STAGE1_FIELDS`) along a new last axis.

    Calibrated: [u (Ybar - c)^2, u, u (Ybar - c)] with c = the round-1 mu_hat and
    u = 1 / V_i(c) (margins) or 1 / S^2 (no margins). Paper: [w (Ybar - c)^2 / (1 - omega), 0, 0].
    """
    weights, _ = _weights(variances, sizes, margins, mode)
    sum_weights = totals[..., 0]
    centre = totals[..., 1] / sum_weights
    deviations = means - centre
    if mode == "paper":
        others = sum_weights - weights
        if np.any(others <= 0.0):
            raise ValueError(
                "round1_totals[0] (the sum of weights) must exceed the client's own weight "
                "(1 - omega_i > 0)"
            )
        terms = weights * deviations**2 * (sum_weights / others)
        rest = np.zeros((*np.shape(terms), len(STAGE1_FIELDS) - 1))
        return np.concatenate([terms[..., None], rest], -1)
    holder_variance = _variances_at(variances, sizes, margins, mode, centre)
    stage1_weights = 1.0 / holder_variance
    first = np.stack(
        [
            stage1_weights * deviations**2,
            stage1_weights,
            stage1_weights * deviations,
            stage1_weights**2,
        ],
        -1,
    )
    # The random-effects weights w(t) = 1 / (V_i + t) on the grid (V_i = 1 / u_i).
    grid_weights = 1.0 / (np.asarray(holder_variance)[..., None] + np.asarray(TAU2_GRID))
    grid_deviations = np.asarray(deviations)[..., None]
    grid_means = np.broadcast_to(np.asarray(means)[..., None], grid_weights.shape)
    grid = np.stack(
        [
            grid_weights * grid_deviations**2,
            grid_weights,
            grid_weights * grid_deviations,
            grid_weights * grid_means,
        ],
        -1,
    )
    return np.concatenate([first, grid.reshape(*grid.shape[:-2], -1)], -1)


def _stage1_from_sums(stage1_totals: np.ndarray) -> np.ndarray:
    """Cochran's Q = S0 - S2^2 / S1 from the summed calibrated round-2 vectors."""
    squares, weights, deviations = (stage1_totals[..., i] for i in range(3))
    return squares - deviations**2 / weights


def random_effects_release(
    stage1_totals: np.ndarray, num_clients: int, *, level: float = TAU2_INTERVAL_LEVEL
) -> np.ndarray:
    """The random-effects summary of a calibrated block from its summed round-2 vectors
    (:data:`STAGE1_FIELDS`, over any leading axes): :data:`RANDOM_EFFECTS_FIELDS`.

    * ``tau2``: DerSimonian-Laird, max(0, (Q - (k - 1)) / (S1 - S2 / S1)) with Cochran's Q
      of stage 1, S1 = sum u and S2 = sum u^2 (u_i = 1 / V_i, the stage-1 weights).
    * ``tau2_low``, ``tau2_high``: the Q-profile interval at ``level`` (Viechtbauer 2007), the
      tau^2 at which Q(tau^2) lies between the (1 - level) / 2 and (1 + level) / 2
      quantiles of chi2(k - 1),
      where Q(t) = sum w(t) (Ybar - mu(t))^2, w(t) = 1 / (V_i + t), decreases in t. Only
      the grid :data:`TAU2_GRID` is known, so each end is rounded outwards to a grid point
      (the interval contains the exact one): ``tau2_low`` the largest grid point with
      Q >= the upper quantile (0 if Q(0) is below it), ``tau2_high`` the smallest with
      Q <= the lower quantile (0 if Q(0) is below it, infinity if Q(1) is above it).
    * ``tau2_used``: the smallest grid point >= ``tau2`` (the last one, 1, if none);
      ``random_effects_mean`` = sum w(t) Ybar / sum w(t) there and
      ``random_effects_sum_weights`` = sum w(t), its standard error being
      1 / sqrt(sum w(t)) (rounding tau^2 up makes it larger, not smaller).

    What the key holders release instead of the grid sums: Q on the whole grid would let the
    server solve for the holders' own variances (the poles of Q(t)).

    References
    ----------
    .. [1] R. DerSimonian and N. Laird, "Meta-analysis in clinical trials", Controlled
           Clinical Trials 7(3), 177-188, 1986.
    .. [2] W. Viechtbauer, "Confidence intervals for the amount of heterogeneity in
           meta-analysis", Statistics in Medicine 26(1), 37-52, 2007.
    """
    from scipy import stats

    level = check_open_unit("level", level)
    num_clients = check_int_at_least("num_clients", num_clients, 2)
    totals = np.asarray(stage1_totals, dtype=np.float64)
    if totals.shape[-1:] != (len(STAGE1_FIELDS),) or not np.all(np.isfinite(totals)):
        raise ValueError(
            f"stage1_totals must hold {len(STAGE1_FIELDS)} finite numbers (STAGE1_FIELDS) on "
            f"the last axis, got shape {totals.shape}"
        )
    if not np.all(totals[..., 1] > 0.0):
        raise ValueError("stage1_totals[1] (the sum of stage-1 weights) must be > 0")
    dof = num_clients - 1
    sum_u, sum_u2 = totals[..., 1], totals[..., 3]
    q = np.maximum(_stage1_from_sums(totals[..., :3]), 0.0)
    spread = sum_u - sum_u2 / sum_u
    with np.errstate(divide="ignore", invalid="ignore"):
        tau2 = np.where(spread > 0.0, np.maximum(0.0, (q - dof) / spread), 0.0)
    grid = totals[..., 4:].reshape(*totals.shape[:-1], len(TAU2_GRID), len(_GRID_SUMS))
    grid_weights = grid[..., 1]
    if not np.all(grid_weights > 0.0):
        raise ValueError("stage1_totals: every random-effects sum of weights must be > 0")
    grid_q = np.maximum(grid[..., 0] - grid[..., 2] ** 2 / grid_weights, 0.0)
    points = np.asarray(TAU2_GRID)
    upper_quantile = stats.chi2.ppf(0.5 + level / 2.0, dof)
    lower_quantile = stats.chi2.ppf(0.5 - level / 2.0, dof)
    # Outward rounding: the last grid point still at or above the quantile (low end), the
    # first at or below it (high end).
    above = grid_q >= upper_quantile
    low = np.where(above.any(-1), points[np.where(above, np.arange(points.size), 0).max(-1)], 0.0)
    low = np.where(grid_q[..., 0] < upper_quantile, 0.0, low)
    below = grid_q <= lower_quantile
    first_below = np.argmax(below, axis=-1)
    high = np.where(below.any(-1), points[first_below], np.inf)
    high = np.where(grid_q[..., 0] < lower_quantile, 0.0, high)
    at_or_above = points >= tau2[..., None]
    used_index = np.where(at_or_above.any(-1), np.argmax(at_or_above, axis=-1), points.size - 1)
    used = points[used_index]
    weights_used = np.take_along_axis(grid_weights, used_index[..., None], -1)[..., 0]
    means_used = np.take_along_axis(grid[..., 3], used_index[..., None], -1)[..., 0]
    return np.stack([tau2, low, high, used, means_used / weights_used, weights_used], -1)


@dataclass(frozen=True)
class RandomEffects:
    """The random-effects summary of FedEvalFair's holders (what to read after stage 1
    rejects): the between-holder variance tau^2 of the holders' true disparities and the
    mean disparity under the random-effects model Ybar_i ~ N(mu, V_i + tau^2).

    Attributes
    ----------
    tau2 : float
        DerSimonian-Laird's estimate (:func:`random_effects_release`).
    tau2_interval : ConfidenceInterval
        The Q-profile interval at :attr:`level`, rounded outwards to the grid
        :data:`TAU2_GRID` (``high`` is infinity when it lies beyond the grid's last point, 1).
    level : float
        The interval's level (:data:`TAU2_INTERVAL_LEVEL` in the encrypted protocol).
    tau2_used : float
        The grid point at which the mean is computed: the smallest >= :attr:`tau2`.
    estimate, stderr : float
        The random-effects mean sum w Ybar / sum w, w = 1 / (V_i + tau2_used), and
        1 / sqrt(sum w).
    grid_factor : float
        Resolution of the grid: consecutive positive points differ by this factor.
    """

    tau2: float
    tau2_interval: ConfidenceInterval
    level: float
    tau2_used: float
    estimate: float
    stderr: float
    grid_factor: float = TAU2_GRID_FACTOR

    @classmethod
    def from_release(
        cls, values: np.ndarray, *, level: float = TAU2_INTERVAL_LEVEL
    ) -> RandomEffects:
        """From :func:`random_effects_release`'s six numbers (:data:`RANDOM_EFFECTS_FIELDS`)."""
        array = np.asarray(values, dtype=np.float64)
        if array.shape != (len(RANDOM_EFFECTS_FIELDS),):
            raise ValueError(
                f"values must hold {len(RANDOM_EFFECTS_FIELDS)} numbers "
                f"{RANDOM_EFFECTS_FIELDS}, got shape {array.shape}"
            )
        tau2, low, high, used, mean, weights = (float(v) for v in array)
        finite = [tau2, low, used, mean, weights]
        if not all(math.isfinite(v) for v in finite) or math.isnan(high):
            raise ValueError(f"values must be finite (tau2_high may be infinity), got {finite}")
        if tau2 < 0.0 or low < 0.0 or high < low or used < 0.0 or not weights > 0.0:
            raise ValueError(
                "values must have tau2, tau2_low, tau2_used >= 0, tau2_high >= tau2_low and a "
                f"sum of weights > 0, got {array.tolist()}"
            )
        return cls(
            tau2=tau2,
            tau2_interval=ConfidenceInterval(low, high),
            level=check_open_unit("level", level),
            tau2_used=used,
            estimate=mean,
            stderr=1.0 / math.sqrt(weights),
        )

    @property
    def tau(self) -> float:
        """sqrt(tau2): the between-holder standard deviation of the true disparities."""
        return math.sqrt(self.tau2)

    def confidence_interval(self, level: float = 0.95) -> ConfidenceInterval:
        """Normal interval estimate +/- z stderr for the random-effects mean (tau^2 taken as
        known at :attr:`tau2_used`)."""
        return normal_interval(self.estimate, self.stderr, level)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (an infinite interval end becomes None)."""
        return {
            "tau2": _json_float(self.tau2),
            "tau": _json_float(self.tau),
            "tau2_interval": [
                _json_float(self.tau2_interval.low),
                _json_float(self.tau2_interval.high),
            ],
            "tau2_interval_level": self.level,
            "tau2_interval_method": (
                "Q-profile (Viechtbauer 2007), ends rounded outwards to a grid of factor "
                f"{self.grid_factor:.4g} from 1e-06 to 1"
            ),
            "tau2_used": _json_float(self.tau2_used),
            "estimate": _json_float(self.estimate),
            "stderr": _json_float(self.stderr),
        }


@dataclass(frozen=True)
class PooledDisparity:
    """The disparity of all holders' rows pooled into one test set: X0 / N0 - X1 / N1 from
    the summed group counts (N_g rows of group g the metric averages over, X_g of them
    predicted positive).

    Its standard error sqrt(p0 (1 - p0) / N0 + p1 (1 - p1) / N1) treats the predictions as
    independent given each holder's group sizes: then the pooled disparity is unbiased for
    the row-weighted mean of the holders' rates, sum_i N_gi r_gi / N_g, and since
    Var(X_g) = sum_i N_gi r_gi (1 - r_gi) <= N_g p_g (1 - p_g) the standard error is exact
    when the holders share their rates and conservative when they differ.
    """

    estimate: float
    stderr: float
    group0_rows: int
    group0_positive: int
    group1_rows: int
    group1_positive: int

    @classmethod
    def from_totals(cls, round1_totals: np.ndarray, num_clients: int) -> PooledDisparity | None:
        """From the round-1 (or round-2) totals; None unless every one of ``num_clients``
        clients sent its counts and both groups have rows."""
        totals = np.asarray(round1_totals, dtype=np.float64)
        counts = totals[_COUNTS : _COUNTS + 5]
        if not np.all(np.isfinite(counts)) or abs(counts[4] - num_clients) > 0.5:
            return None
        rows0, positive0, rows1, positive1 = (int(round(v)) for v in counts[:4])
        if rows0 < 1 or rows1 < 1 or not 0 <= positive0 <= rows0 or not 0 <= positive1 <= rows1:
            return None
        rate0, rate1 = positive0 / rows0, positive1 / rows1
        return cls(
            estimate=rate0 - rate1,
            stderr=math.sqrt(rate0 * (1.0 - rate0) / rows0 + rate1 * (1.0 - rate1) / rows1),
            group0_rows=rows0,
            group0_positive=positive0,
            group1_rows=rows1,
            group1_positive=positive1,
        )

    def confidence_interval(self, level: float = 0.95) -> ConfidenceInterval:
        """Normal interval estimate +/- z stderr."""
        return normal_interval(self.estimate, self.stderr, level)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "estimate": self.estimate,
            "stderr": self.stderr,
            "group0_rows": self.group0_rows,
            "group0_positive": self.group0_positive,
            "group1_rows": self.group1_rows,
            "group1_positive": self.group1_positive,
        }


@dataclass(frozen=True)
class StageStatistics:
    """Both stages' statistics (arrays over any leading axes; see :func:`stage_statistics`)."""

    mode: Mode
    k: int
    dof: int
    estimate: Floats
    stderr: Floats
    homogeneity_statistic: Floats
    homogeneity_pvalue: Floats
    common_statistic: Floats
    common_pvalue: Floats
    equivalence_statistic: Floats | None
    equivalence_pvalue: Floats | None
    #: Mode "calibrated" from :func:`stage_statistics`: :func:`random_effects_release` of
    #: the summed round-2 vectors, shape (..., 6) (:data:`RANDOM_EFFECTS_FIELDS`).
    random_effects: np.ndarray | None = None


def _from_sums(
    totals: np.ndarray,
    stage1_total: Floats,
    *,
    mode: Mode,
    k: int,
    mu0: float,
    tolerance: float | None,
) -> StageStatistics:
    """Estimate, stderr sqrt(sum w^2 Var) / sum w, stage 1 p-value (chi2, k - 1), W* and TOST
    with the standard errors at their null values, sqrt(sum w^2 V(value)) / sum w."""
    from scipy import stats  # here, not at the top: a node's process starts ~1 s faster

    sum_weights = totals[..., 0]
    estimate = totals[..., 1] / sum_weights
    stderr = np.sqrt(totals[..., 3]) / sum_weights
    common = (estimate - mu0) / (np.sqrt(totals[..., 4]) / sum_weights)
    equivalence_statistic = equivalence_pvalue = None
    if tolerance is not None:
        # TOST: max(P(Z > (mu_hat + tol)/se-), P(Z < (mu_hat - tol)/se+)) = sf(min of the two
        # standardised distances), each at its boundary's standard error.
        upper = (tolerance - estimate) / (np.sqrt(totals[..., 5]) / sum_weights)
        lower = (estimate + tolerance) / (np.sqrt(totals[..., 6]) / sum_weights)
        equivalence_statistic = np.minimum(upper, lower)
        if tolerance > 0.0:
            equivalence_pvalue = stats.norm.sf(equivalence_statistic)
        else:  # H0 |mu| >= 0 holds for every mu: never rejected.
            equivalence_pvalue = np.ones_like(estimate)
    return StageStatistics(
        mode=mode,
        k=k,
        dof=k - 1,
        estimate=estimate,
        stderr=stderr,
        homogeneity_statistic=stage1_total,
        homogeneity_pvalue=stats.chi2.sf(stage1_total, k - 1),
        common_statistic=common,
        common_pvalue=2.0 * stats.norm.sf(np.abs(common)),
        equivalence_statistic=equivalence_statistic,
        equivalence_pvalue=equivalence_pvalue,
    )


# --------------------------------------------------------------------------------------------
# Protocol helpers: what each client adds, and the report from the totals
# --------------------------------------------------------------------------------------------


def _summary_arrays(summary: ClientSummary) -> tuple[Floats, Floats, Floats, np.ndarray | None]:
    margins = None if summary.margins is None else np.asarray(summary.margins, dtype=np.float64)
    return (
        np.float64(summary.mean),
        np.float64(summary.variance),
        np.float64(summary.n),
        margins,
    )


def client_contribution(
    summary: ClientSummary,
    mode: Mode = "calibrated",
    *,
    mu0: float = 0.0,
    tolerance: float | None = None,
) -> np.ndarray:
    """Round 1 (Algorithms 1-2, step 3-4): the vector a client encrypts and the server adds.

    Returns (:data:`ROUND1_FIELDS`) ``[w_i, w_i Ybar_i, w_i Ybar_i^2, w_i^2 Var_i,
    w_i^2 V_i(mu0), w_i^2 V_i(tol), w_i^2 V_i(-tol), n0, x0, n1, x1, 1, 1.0]`` (the group counts,
    then 1 if they were sent: calibrated summaries with margins only, else zeros;
    :class:`PooledDisparity`): mode "paper" w_i = n_i / S_i^2
    and Var_i = V_i = S_i^2 / n_i; mode "calibrated" w_i = 1 / V_i(0), V_i =
    :func:`disparity_variance` of the margins, Var_i = S_i^2 (without margins V_i = S_i^2
    and w_i = 1 / S_i^2). ``mu0`` and ``tolerance`` must be the values the report will use
    (tolerance None: 0). The totals give sum w, mu_hat, its standard errors and k.
    """
    mode, mu0, tolerance = _check_options(mode, mu0, tolerance)
    _check_summary(summary, "summary")
    return _round1_vectors(*_summary_arrays(summary), mode, mu0, tolerance)


def _check_totals(round1_totals: np.ndarray) -> np.ndarray:
    totals = np.asarray(round1_totals, dtype=np.float64)
    if totals.shape != (len(ROUND1_FIELDS),):
        raise ValueError(
            f"round1_totals must have {len(ROUND1_FIELDS)} entries {ROUND1_FIELDS}, "
            f"got shape {totals.shape}"
        )
    if not np.all(np.isfinite(totals)) or not totals[0] > 0.0 or not np.all(totals[3:7] > 0.0):
        raise ValueError(
            "round1_totals must be finite with a sum of weights (entry 0) > 0 and variance "
            f"sums (entries 3-6) > 0, got {totals.tolist()}"
        )
    return totals


def stage1_term(
    summary: ClientSummary, round1_totals: np.ndarray, mode: Mode = "calibrated"
) -> np.ndarray:
    """Round 2 (Algorithm 1, steps 7-9): the client's part of the stage-1 statistic.

    Given the decrypted round-1 totals (c = sum w Ybar / sum w): mode "calibrated" returns
    [u_i (Ybar_i - c)^2, u_i, u_i (Ybar_i - c)] with u_i = 1 / V_i(c)
    (:func:`disparity_variance`; 1 / S_i^2 without margins), whose sum gives Cochran's Q
    (:func:`stage1_statistic`), then u_i^2 and the random-effects sums on the tau^2 grid
    (:data:`STAGE1_FIELDS`; their sum gives :func:`random_effects_release`); mode "paper"
    returns [w_i (Ybar_i - c)^2 / (1 - omega_i), 0, ..., 0] with omega_i = w_i / sum w (Eq. 10).
    """
    mode = check_choice("mode", mode, MODES)
    _check_summary(summary, "summary")
    totals = _check_totals(round1_totals)
    return _stage1_vectors(*_summary_arrays(summary), totals, mode)


def stage1_statistic(stage1_totals: np.ndarray, mode: Mode = "calibrated") -> float:
    """Stage 1's statistic from the sum of :func:`stage1_term` over the clients.

    Calibrated: Q = sum u (Ybar - c)^2 - (sum u (Ybar - c))^2 / sum u = sum u (Ybar - mu_u)^2,
    exact for whichever clients added their terms (c is only a centre). Paper: T1, the
    first entry (the other two are zeros, or encryption noise around 0, and are ignored).
    Slightly negative values (CKKS noise on a sum of squares) are returned as they are;
    :func:`report_from_sums` reads them as 0.
    """
    mode = check_choice("mode", mode, MODES)
    totals = np.asarray(stage1_totals, dtype=np.float64)
    if totals.shape not in ((3,), (len(STAGE1_FIELDS),)) or not np.all(np.isfinite(totals)):
        raise ValueError(
            f"stage1_totals must be {len(STAGE1_FIELDS)} finite numbers (STAGE1_FIELDS), or "
            f"their first 3, got shape {totals.shape}"
        )
    totals = totals[:3]
    if mode == "paper":
        return float(totals[0])
    if not totals[1] > 0.0:
        raise ValueError(f"stage1_totals[1] (a sum of weights) must be > 0, got {totals[1]!r}")
    return float(_stage1_from_sums(totals))


def _check_options(
    mode: str, mu0: float, tolerance: float | None
) -> tuple[Mode, float, float | None]:
    checked_mode = check_choice("mode", mode, MODES)
    mu0 = check_finite("mu0", mu0)
    if tolerance is not None:
        tolerance = check_nonnegative_finite("tolerance", tolerance)
    return checked_mode, mu0, tolerance


def report_from_sums(
    round1_totals: np.ndarray,
    stage1_total: float | None,
    *,
    mode: Mode = "calibrated",
    alpha: float = 0.05,
    mu0: float = 0.0,
    tolerance: float | None = None,
    num_clients: int,
    random_effects: np.ndarray | None = None,
) -> FairnessReport:
    """The :class:`FairnessReport` from the decrypted sums of the two rounds.

    Parameters
    ----------
    round1_totals : array of len(ROUND1_FIELDS)
        The sum over clients of :func:`client_contribution`, computed with this ``mu0`` and
        ``tolerance``.
    stage1_total : float or None
        Stage 1's statistic, :func:`stage1_statistic` of the summed :func:`stage1_term`.
        Mode "calibrated" accepts None: then Q = sum w Ybar^2 - (sum w Ybar)^2 / sum w
        from round 1 alone, with the round-1 weights w = 1 / V_i(0) instead of 1 / V_i(c)
        (one round less; it subtracts two large numbers and, where the common disparity is
        far from 0, is conservative).
    num_clients : int
        k >= 2 clients that contributed (must match ``round1_totals[-1]``).
    random_effects : array of 6, optional
        Mode "calibrated": :func:`random_effects_release` of the summed round-2 vectors (the
        report's :attr:`FairnessReport.random_effects`); None: no random-effects summary.

    The report's :attr:`FairnessReport.pooled` comes from the group counts in
    ``round1_totals`` (None unless every client sent them).

    Notes
    -----
    A ``stage1_total`` slightly below 0 (encryption noise on a sum of non-negative terms)
    is read as 0; anything below -1e-6 (1 + sum w Ybar^2) is an error. The standard error
    is sqrt(round1_totals[3]) / round1_totals[0].
    """
    alpha = check_open_unit("alpha", alpha)
    mode, mu0, tolerance = _check_options(mode, mu0, tolerance)
    num_clients = check_int_at_least("num_clients", num_clients, 2)
    totals = _check_totals(round1_totals)
    if abs(totals[-1] - num_clients) > 0.5:
        raise ValueError(
            f"round1_totals[-1] (the number of contributions, {totals[-1]:g}) must equal "
            f"num_clients ({num_clients})"
        )
    if stage1_total is None:
        if mode != "calibrated":
            raise ValueError("stage1_total is required in mode 'paper' (T1 needs round 2)")
        statistic = totals[2] - totals[1] ** 2 / totals[0]
    else:
        statistic = check_finite("stage1_total", stage1_total)
    if statistic < 0.0:
        if statistic < -1e-6 * (1.0 + abs(totals[2])):
            raise ValueError(f"stage1_total must be >= 0 (a sum of squares), got {statistic!r}")
        statistic = 0.0
    computed = _from_sums(
        totals, np.float64(statistic), mode=mode, k=num_clients, mu0=mu0, tolerance=tolerance
    )
    summary = None
    if random_effects is not None:
        if mode != "calibrated":
            raise ValueError("random_effects is for mode 'calibrated' only")
        summary = RandomEffects.from_release(random_effects)
    report = _report(computed, alpha=alpha, mu0=mu0, tolerance=tolerance)
    pooled = PooledDisparity.from_totals(totals, num_clients)
    return dataclasses.replace(report, pooled=pooled, random_effects=summary)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def _json_float(value: float | None) -> float | None:
    """A finite float, or None (JSON never gets NaN or infinity)."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class TestResult:
    """One test of FedEvalFair (scipy.stats style).

    Attributes
    ----------
    statistic : float
        T1 or Q (stage 1), W* (stage 2) or ``(tolerance - |mu_hat|) / stderr`` (TOST).
    dof : int or None
        k - 1 for the chi-square statistic of stage 1; None for the normal ones.
    pvalue : float
    estimate, stderr : float
        The Graybill-Deal common disparity mu_hat and its standard error
        sqrt(sum w_i^2 Var_i) / sum w_i (= 1 / sqrt(sum w) in mode "paper").
    method : str
    mode : {"paper", "calibrated"}
    k : int
        Number of clients.
    null_value : float or None
        mu0 (stage 2), the tolerance (TOST); None for stage 1.
    """

    __test__ = False  # not a pytest test class

    statistic: float
    dof: int | None
    pvalue: float
    estimate: float
    stderr: float
    method: str
    mode: Mode
    k: int
    null_value: float | None = None

    def confidence_interval(self, level: float = 0.95) -> ConfidenceInterval:
        """Normal interval mu_hat +/- z stderr for the common disparity."""
        return normal_interval(self.estimate, self.stderr, level)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN or infinity: non-finite numbers become None)."""
        return {
            "statistic": _json_float(self.statistic),
            "dof": self.dof,
            "pvalue": _json_float(self.pvalue),
            "estimate": _json_float(self.estimate),
            "stderr": _json_float(self.stderr),
            "method": self.method,
            "null_value": _json_float(self.null_value),
        }


_METHODS = {
    ("homogeneity", "paper"): (
        "FedEvalFair stage 1 (paper Eq. 10): T1 = sum w_i (Ybar_i - mu_hat)^2 / (1 - omega_i), "
        "w_i = n_i / S_i^2, referred to chi2(k - 1) (not its distribution: its terms share mu_hat)"
    ),
    ("homogeneity", "calibrated"): (
        "Cochran's Q = sum u_i (Ybar_i - mu_u)^2, u_i = 1 / V_i(mu_hat) from the holder's "
        "margins (1 / S_i^2 without margins), chi2(k - 1)"
    ),
    ("common", "paper"): (
        "FedEvalFair stage 2 (paper Algorithm 2): W* = sqrt(sum w_i) (mu_hat - mu0), "
        "w_i = n_i / S_i^2 of |disparities|, two-sided N(0, 1)"
    ),
    ("common", "calibrated"): (
        "Stage 2: W* = (mu_hat - mu0) / se(mu0), mu_hat = sum w_i Ybar_i / sum w_i of signed "
        "plug-in disparities, w_i = 1 / V_i(0) from the holder's margins, se(mu0) = "
        "sqrt(sum w_i^2 V_i(mu0)) / sum w_i (without margins V_i = S_i^2), two-sided N(0, 1)"
    ),
    ("equivalence", "paper"): (
        "TOST equivalence, H0: |mu| >= tolerance, on the paper-mode mu_hat and stderr, N(0, 1)"
    ),
    ("equivalence", "calibrated"): (
        "TOST equivalence, H0: |mu| >= tolerance vs H1: |mu| < tolerance, N(0, 1) with "
        "se(+tolerance) and se(-tolerance)"
    ),
}


#: Stage 1's decision in words: rejects H0 mu_1 = ... = mu_k, or not.
HOMOGENEITY_VERDICTS = ("no, the holders differ", "no evidence that the holders differ")
#: Stage 2's decision in words: rejects H0 mu = mu0, or not.
FAIRNESS_VERDICTS = ("UNFAIR", "no evidence of unfairness")
#: The equivalence test's decision in words: TOST rejects H0 |mu| >= tolerance, or not.
EQUIVALENCE_VERDICTS = ("yes, certified fair", "not certified")
#: What the report says after stage 1 rejects when no random-effects summary was released.
AFTER_STAGE1_WITHOUT_RANDOM_EFFECTS = (
    "after stage 1 (the holders differ): no single common disparity describes them; look at "
    "the holders' own disparities"
)


def tau2_high_text(high: float | None) -> str:
    """The Q-profile interval's high end as the verdict lines print it ("beyond 1" past the
    grid's last point; None is how results.json writes that)."""
    if high is None or math.isinf(high):
        return f"beyond {TAU2_GRID[-1]:g}"
    return format_number(high, ".3g")


#: The metrics' names in summaries and reports.
METRIC_NAMES: dict[str, str] = {
    "dp": "Demographic parity",
    "eo": "Equal opportunity",
    "fnr": "False negative rate parity",
    "fpr": "False positive rate parity",
    "tnr": "True negative rate parity",
    "accuracy": "Accuracy parity",
    "precision": "Predictive parity",
    "npv": "Negative predictive value parity",
}
#: Why the rows of mode "paper" are not evidence (printed beside them).
PAPER_MODE_WARNING = (
    "the 'paper' mode rows follow FedEvalFair (anonymous, 2024) as published and are not "
    "evidence: they average absolute bootstrap disparities, which are positive even for a fair "
    "model, so their stage 2 rejects fairness almost always, and their stage 1 rejects a true "
    "null too often; they are shown to compare with the paper. Read the 'calibrated' rows"
)


@dataclass(frozen=True)
class FairnessReport:
    """Both stages of FedEvalFair, the optional equivalence test, and the decisions at alpha.

    ``reject_homogeneity``: stage 1 rejects H0 mu_1 = ... = mu_k. ``reject_fairness``: stage 2
    rejects H0 mu = mu0. ``certified_fair``: TOST rejects H0 ``|mu| >= tolerance`` (None when no
    tolerance was given). The decisions are reported side by side; none gates another.
    """

    mode: Mode
    alpha: float
    k: int
    mu0: float
    tolerance: float | None
    homogeneity: TestResult
    common_disparity: TestResult
    equivalence: TestResult | None
    #: The disparity of all holders' rows pooled (None without every holder's counts).
    pooled: PooledDisparity | None = None
    #: The random-effects summary (tau^2, its interval, the random-effects mean); None in
    #: mode "paper", in the holder-level DP mode, or from sums without it.
    random_effects: RandomEffects | None = None

    @property
    def reject_homogeneity(self) -> bool:
        return bool(self.homogeneity.pvalue < self.alpha)

    @property
    def reject_fairness(self) -> bool:
        return bool(self.common_disparity.pvalue < self.alpha)

    @property
    def certified_fair(self) -> bool | None:
        if self.equivalence is None:
            return None
        return bool(self.equivalence.pvalue < self.alpha)

    @property
    def estimate(self) -> float:
        """The Graybill-Deal common disparity mu_hat."""
        return self.common_disparity.estimate

    @property
    def stderr(self) -> float:
        """sqrt(sum w^2 Var) / sum w (paper: 1 / sqrt(sum w))."""
        return self.common_disparity.stderr

    def confidence_interval(self, level: float = 0.95) -> ConfidenceInterval:
        """Normal interval mu_hat +/- z stderr for the common disparity. At level 1 - alpha
        it excludes mu0 exactly when stage 2 rejects if every summary lacks margins (or in
        mode "paper"); with margins stage 2 uses se(mu0) instead of the sandwich stderr."""
        return self.common_disparity.confidence_interval(level)

    def verdicts(self) -> tuple[str, ...]:
        """The decisions in words, one line per test (stage 1, stage 2 and, with a tolerance,
        the equivalence test): the lines the built-in job prints after the metric's name."""
        interval = self.confidence_interval(1.0 - self.alpha)
        lines = [
            "stage 1 (same disparity at every holder?): "
            + HOMOGENEITY_VERDICTS[0 if self.reject_homogeneity else 1]
            + f", p = {format_number(self.homogeneity.pvalue, '.3g')} (alpha = {self.alpha:g})",
            f"stage 2 (common disparity = {self.mu0:g}?): "
            + FAIRNESS_VERDICTS[0 if self.reject_fairness else 1]
            + f"; common disparity {format_number(self.estimate)}, "
            + f"{100 * (1.0 - self.alpha):g}% interval [{format_number(interval.low)}, "
            + f"{format_number(interval.high)}], "
            + f"p = {format_number(self.common_disparity.pvalue, '.3g')}",
        ]
        if self.equivalence is not None:
            lines.append(
                f"equivalence (|disparity| < {self.tolerance:g}?): "
                + EQUIVALENCE_VERDICTS[0 if self.certified_fair else 1]
                + f", p = {format_number(self.equivalence.pvalue, '.3g')}"
            )
        level = f"{100 * (1.0 - self.alpha):g}%"
        if self.pooled is not None:
            pooled = self.pooled.confidence_interval(1.0 - self.alpha)
            lines.append(
                "pooled disparity (every holder's rows as one test set): "
                f"{format_number(self.pooled.estimate)}, {level} interval "
                f"[{format_number(pooled.low)}, {format_number(pooled.high)}]"
            )
        if self.reject_homogeneity and self.mode == "calibrated":
            effects = self.random_effects
            if effects is None:
                lines.append(AFTER_STAGE1_WITHOUT_RANDOM_EFFECTS)
            else:
                mean = effects.confidence_interval(1.0 - self.alpha)
                lines.append(
                    "after stage 1 (the holders differ): report the random-effects mean "
                    f"{format_number(effects.estimate)}, {level} interval "
                    f"[{format_number(mean.low)}, {format_number(mean.high)}], and the "
                    f"between-holder sd tau = {format_number(effects.tau)} (tau^2 = "
                    f"{format_number(effects.tau2, '.3g')}, {100 * effects.level:g}% Q-profile "
                    f"interval [{format_number(effects.tau2_interval.low, '.3g')}, "
                    f"{tau2_high_text(effects.tau2_interval.high)}]), not one common "
                    "disparity, and look at the holders"
                )
        return tuple(lines)

    def summary(self, label: str = "") -> str:
        """The verdict lines, each after ``label`` (e.g. the metric's name), then what the
        common disparity is: a precision-weighted mean, not the pooled disparity."""
        prefix = f"{label}, " if label else ""
        lines = [prefix + line for line in self.verdicts()]
        lines.append(
            f"({self.k} holders, {self.mode} mode; the common disparity is the "
            "precision-weighted mean of the holders' disparities, dominated by the most precise "
            "holders"
            + (", where the pooled disparity weighs every row alike" if self.pooled else "")
            + (
                "; stage 1 rejected, so it summarises holders that disagree: read the "
                "holders' own disparities)"
                if self.reject_homogeneity
                else ")"
            )
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        interval = self.confidence_interval(1.0 - self.alpha)
        return (
            f"FairnessReport(mode={self.mode!r}, k={self.k}, "
            f"estimate={format_number(self.estimate)}, "
            f"interval=[{format_number(interval.low)}, {format_number(interval.high)}], "
            f"reject_homogeneity={self.reject_homogeneity}, "
            f"reject_fairness={self.reject_fairness}, certified_fair={self.certified_fair})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (keys documented in the CLI guide, docs/guides/cli.md); never NaN
        or infinity."""
        interval = self.confidence_interval(1.0 - self.alpha)
        return {
            "mode": self.mode,
            "alpha": self.alpha,
            "k": self.k,
            "mu0": self.mu0,
            "tolerance": self.tolerance,
            "estimate": _json_float(self.estimate),
            "stderr": _json_float(self.stderr),
            "confidence_level": 1.0 - self.alpha,
            "confidence_interval": [_json_float(interval.low), _json_float(interval.high)],
            "homogeneity": self.homogeneity.to_dict(),
            "common_disparity": self.common_disparity.to_dict(),
            "equivalence": None if self.equivalence is None else self.equivalence.to_dict(),
            "reject_homogeneity": self.reject_homogeneity,
            "reject_fairness": self.reject_fairness,
            "certified_fair": self.certified_fair,
            "pooled": None if self.pooled is None else self.pooled.to_dict(),
            "random_effects": (
                None if self.random_effects is None else self.random_effects.to_dict()
            ),
        }


class _CommonFields(TypedDict):
    """The fields the three tests of one report share."""

    estimate: float
    stderr: float
    mode: Mode
    k: int


def _report(
    computed: StageStatistics, *, alpha: float, mu0: float, tolerance: float | None
) -> FairnessReport:
    mode, k = computed.mode, computed.k
    estimate, stderr = float(computed.estimate), float(computed.stderr)
    common = _CommonFields(estimate=estimate, stderr=stderr, mode=mode, k=k)
    equivalence = None
    if tolerance is not None:
        assert computed.equivalence_statistic is not None
        assert computed.equivalence_pvalue is not None
        equivalence = TestResult(
            statistic=float(computed.equivalence_statistic),
            dof=None,
            pvalue=float(computed.equivalence_pvalue),
            method=_METHODS["equivalence", mode],
            null_value=tolerance,
            **common,
        )
    return FairnessReport(
        mode=mode,
        alpha=alpha,
        k=k,
        mu0=mu0,
        tolerance=tolerance,
        homogeneity=TestResult(
            statistic=float(computed.homogeneity_statistic),
            dof=computed.dof,
            pvalue=float(computed.homogeneity_pvalue),
            method=_METHODS["homogeneity", mode],
            **common,
        ),
        common_disparity=TestResult(
            statistic=float(computed.common_statistic),
            dof=None,
            pvalue=float(computed.common_pvalue),
            method=_METHODS["common", mode],
            null_value=mu0,
            **common,
        ),
        equivalence=equivalence,
    )


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def _check_summary(summary: object, name: str) -> ClientSummary:
    if not isinstance(summary, ClientSummary):
        raise ValueError(f"{name} must be a ClientSummary, got {type(summary).__name__}")
    return summary


def _check_summaries(summaries: Sequence[ClientSummary]) -> list[ClientSummary]:
    if isinstance(summaries, ClientSummary) or not isinstance(summaries, Sequence):
        raise ValueError("summaries must be a sequence of ClientSummary (one per client)")
    checked = [_check_summary(s, f"summaries[{i}]") for i, s in enumerate(summaries)]
    if len(checked) < 2:
        raise ValueError(f"summaries must hold at least 2 clients, got {len(checked)}")
    return checked


def fedevalfair(
    summaries: Sequence[ClientSummary],
    *,
    alpha: float = 0.05,
    mode: Mode = "calibrated",
    mu0: float = 0.0,
    tolerance: float | None = None,
) -> FairnessReport:
    """Run FedEvalFair's two stages (and TOST if ``tolerance`` is given) on client summaries.

    Exactly the protocol's arithmetic: the round-1 vectors (:func:`client_contribution`) are
    added, each client's :func:`stage1_term` is computed from the totals and added,
    :func:`stage1_statistic` gives stage 1's statistic and :func:`report_from_sums` the
    report.

    Parameters
    ----------
    summaries : sequence of ClientSummary
        One per client, k >= 2 (built with :meth:`BootstrapDisparity.summary` in ``mode``).
    alpha : float
        Level of the decisions, in (0, 1).
    mode : {"calibrated", "paper"}
        See the module docstring (the calibrated mode, and why the paper's statistics are
        miscalibrated).
    mu0 : float
        Stage 2's null value (Algorithm 2).
    tolerance : float, optional
        >= 0: also test H0 ``|mu| >= tolerance`` (TOST). At 0 the null holds for every mu, so
        the p-value is 1 and fairness is never certified.

    References
    ----------
    .. [1] Anonymous authors, "FedEvalFair: A Privacy-Preserving and Statistically Grounded
           Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
           (anonymous review version), 2024. Section 4.2, Algorithms 1 and 2 (Eq. 6, Eq. 10).
    .. [2] W. G. Cochran, "The combination of estimates from different experiments",
           Biometrics 10(1), 101-129, 1954 (Cochran's Q, the calibrated stage 1).
    .. [3] D. J. Schuirmann, "A comparison of the two one-sided tests procedure and the power
           approach for assessing the equivalence of average bioavailability", Journal of
           Pharmacokinetics and Biopharmaceutics 15(6), 657-680, 1987 (TOST).
    """
    alpha = check_open_unit("alpha", alpha)
    mode, mu0, tolerance = _check_options(mode, mu0, tolerance)
    checked = _check_summaries(summaries)
    totals = np.sum(
        [client_contribution(s, mode, mu0=mu0, tolerance=tolerance) for s in checked], axis=0
    )
    terms = np.array([stage1_term(s, totals, mode) for s in checked])
    stage1_totals = np.array([math.fsum(column) for column in terms.T])
    return report_from_sums(
        totals,
        stage1_statistic(stage1_totals, mode),
        mode=mode,
        alpha=alpha,
        mu0=mu0,
        tolerance=tolerance,
        num_clients=len(checked),
        random_effects=(
            random_effects_release(stage1_totals, len(checked)) if mode == "calibrated" else None
        ),
    )


def homogeneity_test(
    summaries: Sequence[ClientSummary], *, mode: Mode = "calibrated"
) -> TestResult:
    """Stage 1 (Algorithm 1), H0: mu_1 = ... = mu_k: T1 (FedEvalFair Eq. 10) or Cochran's Q.

    References
    ----------
    .. [1] Anonymous authors, "FedEvalFair: A Privacy-Preserving and Statistically Grounded
           Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
           (anonymous review version), 2024. Section 4.2, Algorithm 1 and Eq. 10.
    .. [2] W. G. Cochran, "The combination of estimates from different experiments",
           Biometrics 10(1), 101-129, 1954 (Cochran's Q, the calibrated stage 1).
    """
    return fedevalfair(summaries, mode=mode).homogeneity


def common_disparity_test(
    summaries: Sequence[ClientSummary], *, mode: Mode = "calibrated", mu0: float = 0.0
) -> TestResult:
    """Stage 2 (Algorithm 2), H0: mu = mu0: W* = sqrt(sum w)(mu_hat - mu0), two-sided.

    References
    ----------
    .. [1] Anonymous authors, "FedEvalFair: A Privacy-Preserving and Statistically Grounded
           Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
           (anonymous review version), 2024. Section 4.2, Algorithm 2 and Eq. 6.
    .. [2] F. A. Graybill and R. B. Deal, "Combining unbiased estimators", Biometrics 15(4),
           543-550, 1959 (the weighted common-mean estimate mu_hat).
    """
    return fedevalfair(summaries, mode=mode, mu0=mu0).common_disparity


def equivalence_test(
    summaries: Sequence[ClientSummary], *, tolerance: float, mode: Mode = "calibrated"
) -> TestResult:
    """TOST (two one-sided tests), H0: ``|mu| >= tolerance`` vs H1: ``|mu| < tolerance``.

    p = max(P(Z > (mu_hat + tol)/se(-tol)), P(Z < (mu_hat - tol)/se(+tol))) (module docstring);
    tolerance 0 gives p = 1 (the null covers every mu). Not in FedEvalFair [1]_, whose
    stage 2 can only reject fairness; TOST [2]_ certifies it.

    References
    ----------
    .. [1] Anonymous authors, "FedEvalFair: A Privacy-Preserving and Statistically Grounded
           Federated Fairness Evaluation Framework", ACM Multimedia 2024 submission
           (anonymous review version), 2024.
    .. [2] D. J. Schuirmann, "A comparison of the two one-sided tests procedure and the power
           approach for assessing the equivalence of average bioavailability", Journal of
           Pharmacokinetics and Biopharmaceutics 15(6), 657-680, 1987.
    """
    report = fedevalfair(summaries, mode=mode, tolerance=tolerance)
    assert report.equivalence is not None
    return report.equivalence


def stage_statistics(
    means: np.ndarray,
    variances: np.ndarray,
    sizes: np.ndarray,
    *,
    margins: np.ndarray | None = None,
    mode: Mode = "calibrated",
    mu0: float = 0.0,
    tolerance: float | None = None,
) -> StageStatistics:
    """Vectorised :func:`fedevalfair` for simulations: clients on the last axis.

    ``means``, ``variances`` and ``sizes`` broadcast to shape (..., k); every statistic of
    the result has shape (...). ``margins`` (calibrated mode), shape (..., k, 3), holds each
    client's :attr:`ClientSummary.margins`. Same kernels as the protocol helpers; in mode
    "calibrated" the result's ``random_effects`` holds the random-effects summary.
    """
    mode, mu0, tolerance = _check_options(mode, mu0, tolerance)
    means, variances, sizes = np.broadcast_arrays(
        np.asarray(means, dtype=np.float64),
        np.asarray(variances, dtype=np.float64),
        np.asarray(sizes, dtype=np.float64),
    )
    if means.ndim == 0 or means.shape[-1] < 2:
        raise ValueError(f"means must hold at least 2 clients on the last axis, got {means.shape}")
    if not np.all(np.isfinite(means)):
        raise ValueError("means must be finite numbers")
    if not np.all(np.isfinite(variances)) or np.any(variances <= 0.0):
        raise ValueError("variances must be finite numbers > 0")
    if not np.all(np.isfinite(sizes)) or np.any(sizes < 2) or np.any(sizes != np.round(sizes)):
        raise ValueError("sizes must be integers >= 2")
    if margins is not None:
        margins = np.broadcast_to(np.asarray(margins, dtype=np.float64), (*means.shape, 3))
        group0, group1, positives = margins[..., 0], margins[..., 1], margins[..., 2]
        if (
            np.any(margins != np.round(margins))
            or np.any(group0 < 1)
            or np.any(group1 < 1)
            or np.any(positives <= 0)
            or np.any(positives >= group0 + group1)
        ):
            raise ValueError(
                "margins must be integer (group0_rows >= 1, group1_rows >= 1, "
                "predicted_positive_rows strictly between 0 and their sum) on the last axis"
            )
        if mode == "paper":
            margins = None
    totals = _round1_vectors(means, variances, sizes, margins, mode, mu0, tolerance).sum(axis=-2)
    parts = _stage1_vectors(means, variances, sizes, margins, totals[..., None, :], mode).sum(-2)
    stage1 = parts[..., 0] if mode == "paper" else np.maximum(_stage1_from_sums(parts), 0.0)
    k = int(means.shape[-1])
    computed = _from_sums(totals, stage1, mode=mode, k=k, mu0=mu0, tolerance=tolerance)
    if mode == "paper":
        return computed
    return dataclasses.replace(computed, random_effects=random_effects_release(parts, k))


__all__ = [
    "AFTER_STAGE1_WITHOUT_RANDOM_EFFECTS",
    "EQUIVALENCE_VERDICTS",
    "FAIRNESS_VERDICTS",
    "HOMOGENEITY_VERDICTS",
    "METRICS",
    "METRIC_NAMES",
    "MODES",
    "PAPER_MODE_WARNING",
    "RANDOM_EFFECTS_FIELDS",
    "ROUND1_FIELDS",
    "STAGE1_FIELDS",
    "TAU2_GRID",
    "TAU2_GRID_FACTOR",
    "TAU2_INTERVAL_LEVEL",
    "BootstrapDisparity",
    "ClientSummary",
    "FairnessReport",
    "InsufficientGroupData",
    "PooledDisparity",
    "RandomEffects",
    "StageStatistics",
    "TestResult",
    "bootstrap_disparity",
    "client_contribution",
    "disparity_variance",
    "disparity_variances",
    "common_disparity_test",
    "equivalence_test",
    "fedevalfair",
    "homogeneity_test",
    "random_effects_release",
    "reference_comparisons",
    "report_from_sums",
    "stage1_statistic",
    "stage1_term",
    "stage_statistics",
    "tau2_high_text",
]
