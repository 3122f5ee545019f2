"""FedEvalFair's disparity for every rate metric and for d >= 2 groups (issue 28).

``bootstrap_disparity(..., metric=m, comparison=(a, b))`` is the success rate of group a minus
that of group b among the rows metric m averages over. Reference values are computed here
independently of the library: from each group's confusion counts (TP, FP, FN, TN) with the
textbook formulas, and with fairlearn's ``MetricFrame`` (Bird et al., "Fairlearn: A toolkit for
assessing and improving fairness in AI", 2020) on the same predictions. The calibrated test's
level is checked by seeded Monte Carlo with the tolerance derived in the test.
"""

from __future__ import annotations

import numpy as np
import pytest
from fairlearn.metrics import (
    MetricFrame,
    false_negative_rate,
    false_positive_rate,
    selection_rate,
    true_negative_rate,
    true_positive_rate,
)
from scipy import stats
from sklearn.metrics import accuracy_score, precision_score

from fedparity.mechanisms.fairness_tests.fedevalfair import (
    METRIC_NAMES,
    METRICS,
    BootstrapDisparity,
    InsufficientGroupData,
    bootstrap_disparity,
    fedevalfair,
    reference_comparisons,
)

COMPARISONS = ((0, 1), (0, 2), (2, 1))


def confusion_rates(
    predictions: np.ndarray, labels: np.ndarray, groups: np.ndarray, group: int
) -> dict[str, tuple[float, int]]:
    """Every metric's (rate, denominator) in ``group`` from its confusion counts."""
    mine = groups == group
    tp = int(np.sum(mine & (predictions == 1) & (labels == 1)))
    fp = int(np.sum(mine & (predictions == 1) & (labels == 0)))
    fn = int(np.sum(mine & (predictions == 0) & (labels == 1)))
    tn = int(np.sum(mine & (predictions == 0) & (labels == 0)))
    total = tp + fp + fn + tn
    return {
        "dp": ((tp + fp) / total, total),
        "eo": (tp / (tp + fn), tp + fn),
        "fnr": (fn / (tp + fn), tp + fn),
        "fpr": (fp / (fp + tn), fp + tn),
        "tnr": (tn / (fp + tn), fp + tn),
        "accuracy": ((tp + tn) / total, total),
        "precision": (tp / (tp + fp), tp + fp),
        "npv": (tn / (tn + fn), tn + fn),
    }


def negative_predictive_value(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """TN / (TN + FN), written out (fairlearn and scikit-learn have no NPV)."""
    negatives = np.asarray(y_pred) == 0
    return float(np.mean(np.asarray(y_true)[negatives] == 0))


FAIRLEARN = {
    "dp": selection_rate,
    "eo": true_positive_rate,
    "fnr": false_negative_rate,
    "fpr": false_positive_rate,
    "tnr": true_negative_rate,
    "accuracy": accuracy_score,
    "precision": lambda y_true, y_pred: precision_score(y_true, y_pred, zero_division=0),
    "npv": negative_predictive_value,
}


def three_groups(seed: int, size: int = 900) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A test set of 3 groups whose every rate differs between groups."""
    rng = np.random.default_rng(seed)
    groups = rng.choice(3, size=size, p=[0.45, 0.35, 0.2])
    labels = (rng.random(size) < np.array([0.3, 0.5, 0.4])[groups]).astype(int)
    positive_rate = np.where(
        labels == 1, np.array([0.7, 0.55, 0.8])[groups], np.array([0.2, 0.35, 0.1])[groups]
    )
    predictions = (rng.random(size) < positive_rate).astype(int)
    return predictions, labels, groups


def test_metric_table() -> None:
    assert METRICS == ("dp", "eo", "fnr", "fpr", "tnr", "accuracy", "precision", "npv")
    assert tuple(METRIC_NAMES) == METRICS
    assert METRIC_NAMES["dp"] == "Demographic parity"
    assert METRIC_NAMES["eo"] == "Equal opportunity"
    assert len(set(METRIC_NAMES.values())) == len(METRICS)


@pytest.mark.parametrize("metric", METRICS)
def test_plugin_matches_confusion_counts_and_fairlearn(metric: str) -> None:
    predictions, labels, groups = three_groups(3)
    frame = MetricFrame(
        metrics=FAIRLEARN[metric],
        y_true=labels,
        y_pred=predictions,
        sensitive_features=groups,
    )
    rates = {g: confusion_rates(predictions, labels, groups, g)[metric] for g in range(3)}
    for a, b in COMPARISONS:
        result = bootstrap_disparity(
            predictions,
            labels,
            groups,
            metric=metric,
            comparison=(a, b),
            num_resamples=3,
            rng=np.random.default_rng(0),
        )
        direct = rates[a][0] - rates[b][0]
        assert abs(result.plugin - direct) <= 1e-12
        assert abs(result.plugin - (frame.by_group[a] - frame.by_group[b])) <= 1e-12
        assert result.group_sizes == (rates[a][1], rates[b][1])
        successes = round(rates[a][0] * rates[a][1]) + round(rates[b][0] * rates[b][1])
        assert result.margins == (rates[a][1], rates[b][1], successes)
        assert result.comparison == (a, b) and result.metric == metric
        assert result.num_samples == predictions.size  # every row is drawn


@pytest.mark.parametrize("metric", ["dp", "eo"])
def test_defaults_reproduce_the_two_group_bootstrap(metric: str) -> None:
    """Binary groups, default comparison: the cells 2 A + Yhat (eo: Y = 0 rows ignored), one
    chunk of rng.integers(0, n, (B, n)) indices (no resample lacks a group at n = 300),
    exactly as before the metrics were generalised."""
    rng = np.random.default_rng(21)
    size, num_resamples = 300, 40
    groups = (rng.random(size) < 0.4).astype(int)
    labels = rng.integers(0, 2, size)
    predictions = (rng.random(size) < np.where(groups == 0, 0.5, 0.3)).astype(int)
    cells = 2 * groups + predictions
    if metric == "eo":
        cells[labels == 0] = 4
    indices = np.random.default_rng(5).integers(0, size, size=(num_resamples, size))
    counts = np.stack([np.count_nonzero(cells[indices] == c, axis=1) for c in range(4)], 1)
    expected = counts[:, 1] / (counts[:, 0] + counts[:, 1]) - counts[:, 3] / (
        counts[:, 2] + counts[:, 3]
    )
    kwargs = {"metric": metric, "num_resamples": num_resamples}
    omitted = bootstrap_disparity(
        predictions, labels, groups, rng=np.random.default_rng(5), **kwargs
    )
    explicit = bootstrap_disparity(
        predictions, labels, groups, rng=np.random.default_rng(5), comparison=(0, 1), **kwargs
    )
    np.testing.assert_array_equal(omitted.resamples, expected)
    np.testing.assert_array_equal(explicit.resamples, omitted.resamples)
    assert omitted.redraws == 0 and omitted.comparison == (0, 1)
    rows = np.ones(size, dtype=bool) if metric == "dp" else labels == 1
    rate0 = predictions[rows & (groups == 0)].mean()
    rate1 = predictions[rows & (groups == 1)].mean()
    assert omitted.plugin == explicit.plugin == pytest.approx(rate0 - rate1, abs=1e-15)


def test_plugin_disparities_by_hand() -> None:
    # group 0: Yhat 1,1,0,0 with Y 1,0,1,0 (DP 1/2, TPR 1/2, precision 1/2, accuracy 1/2)
    # group 1: Yhat 1,0,0,0 with Y 1,1,0,0 (DP 1/4, TPR 1/2, precision 1, accuracy 3/4)
    # group 2: Yhat 1,1 with Y 0,0 (DP 1, FPR 1, precision 0, accuracy 0)
    predictions = np.array([1, 1, 0, 0, 1, 0, 0, 0, 1, 1])
    labels = np.array([1, 0, 1, 0, 1, 1, 0, 0, 0, 0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])

    def plugin(metric: str, comparison: tuple[int, int] = (0, 1)) -> float:
        return bootstrap_disparity(
            predictions,
            labels,
            groups,
            metric=metric,
            comparison=comparison,
            num_resamples=2,
            rng=np.random.default_rng(0),
        ).plugin

    assert plugin("dp") == 0.5 - 0.25 and plugin("eo") == 0.0
    assert plugin("precision") == 0.5 - 1.0 and plugin("accuracy") == 0.5 - 0.75
    assert plugin("dp", (2, 0)) == 1.0 - 0.5 and plugin("fpr", (2, 1)) == 1.0 - 0.0
    assert plugin("precision", (2, 1)) == 0.0 - 1.0 and plugin("accuracy", (1, 2)) == 0.75
    # Group 2 is ignored by the default comparison: the same plug-in without its rows.
    without = bootstrap_disparity(
        predictions[:8], labels[:8], groups[:8], num_resamples=2, rng=np.random.default_rng(0)
    )
    assert without.plugin == plugin("dp") and without.cell_counts == (2, 2, 3, 1)


def test_swapped_comparison_negates_every_resample() -> None:
    """(b, a) draws the same indices as (a, b) and swaps the sides: every disparity negated."""
    predictions, labels, groups = three_groups(8, size=120)
    kwargs = {"metric": "precision", "num_resamples": 200, "max_redraws": 10_000}
    forward = bootstrap_disparity(
        predictions, labels, groups, comparison=(2, 1), rng=np.random.default_rng(3), **kwargs
    )
    backward = bootstrap_disparity(
        predictions, labels, groups, comparison=(1, 2), rng=np.random.default_rng(3), **kwargs
    )
    np.testing.assert_array_equal(backward.resamples, -forward.resamples)
    assert backward.plugin == -forward.plugin and backward.redraws == forward.redraws
    assert backward.group_sizes == forward.group_sizes[::-1]


def test_positional_construction_keeps_the_default_comparison() -> None:
    result = BootstrapDisparity("dp", 0.1, np.zeros(2), 0, (3, 4), 7, (1, 2, 3, 1))
    assert result.comparison == (0, 1) and result.margins == (3, 4, 3)


def test_reference_comparisons() -> None:
    assert reference_comparisons(2) == ((0, 1),)
    assert reference_comparisons(3) == ((0, 1), (0, 2))
    assert reference_comparisons(4, reference=2) == ((2, 0), (2, 1), (2, 3))
    assert reference_comparisons(3, 2.0) == ((2, 0), (2, 1))
    for args, needle in (
        ((1,), "num_groups"),
        ((2.5,), "num_groups"),
        ((3, -1), "reference"),
        ((3, 3), r"reference must be an integer in \[0, 2\]"),
    ):
        with pytest.raises(ValueError, match=needle):
            reference_comparisons(*args)


# --- calibration and unbiasedness (seeded Monte Carlo) ------------------------------------------

HOLDERS = 10
# Per draw, 10 holders of 150-400 rows: about 5 ms, so R = 1500 draws take ~8 s per metric.
CALIBRATION_DRAWS = 1500
# Group shares; the metric's rows depend on the group, its success (given the rows) may not.
SHARES = [0.4, 0.35, 0.25]


def null_holder(
    rng: np.random.Generator, metric: str, size: int, success_rates: tuple[float, float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A holder's rows where, among the rows ``metric`` ("precision" or "fpr") averages over,
    the success has probability success_rates[group]; the other rows depend on the group."""
    groups = rng.choice(3, size=size, p=SHARES)
    success = rng.random(size) < np.asarray(success_rates)[groups]
    if metric == "precision":  # rows Yhat = 1, success Y = 1
        predictions = rng.random(size) < np.array([0.5, 0.3, 0.4])[groups]
        other = rng.random(size) < np.array([0.2, 0.5, 0.3])[groups]
        labels = np.where(predictions, success, other)
    else:  # "fpr": rows Y = 0, success Yhat = 1
        labels = rng.random(size) < np.array([0.3, 0.6, 0.45])[groups]
        other = rng.random(size) < np.array([0.8, 0.5, 0.65])[groups]
        predictions = np.where(labels, other, success)
    return predictions.astype(int), labels.astype(int), groups


@pytest.mark.parametrize("metric", ["precision", "fpr"])
@pytest.mark.slow
def test_calibrated_stage2_holds_its_level(metric: str) -> None:
    """H0 true (the success is independent of the group among the metric's rows, group 1 ignored
    at another rate): stage 2's two-sided test at alpha = 0.05 over 10 holders, comparison
    (0, 2), rejects at a rate within the binomial 99.9 % band of 0.05."""
    rng = np.random.default_rng(2026 + len(metric))
    success_rates = (0.6, 0.3, 0.6) if metric == "precision" else (0.25, 0.6, 0.25)
    rejections = 0
    for _ in range(CALIBRATION_DRAWS):
        summaries = []
        for _ in range(HOLDERS):
            rows = null_holder(rng, metric, int(rng.integers(150, 401)), success_rates)
            boot = bootstrap_disparity(
                *rows, metric=metric, comparison=(0, 2), num_resamples=20, rng=rng
            )
            summaries.append(boot.summary("calibrated"))
        rejections += fedevalfair(summaries, alpha=0.05).reject_fairness
    # Tolerance: given the margins the group-a successes are hypergeometric under H0, so each
    # holder's plug-in has mean 0 and variance V_i(0) exactly; W* is standardised with these,
    # so a calibrated test rejects with probability 0.05 (up to its normal approximation) and
    # the number of rejections over R independent draws is Binomial(R, 0.05). Its central
    # 99.9 % interval (0.05 % in each tail) bounds the count; a calibrated test fails here
    # with probability <= 0.001 (the seed is fixed, so the outcome is too).
    low, high = stats.binom.interval(0.999, CALIBRATION_DRAWS, 0.05)
    assert low <= rejections <= high, (metric, rejections, (low, high))


@pytest.mark.parametrize("metric", ["precision", "fpr"])
def test_plugin_is_unbiased_at_a_nonzero_disparity(metric: str) -> None:
    """Given its rows, a group's success count is Binomial(rows, rate), so the plug-in's mean
    is the true difference rate_a - rate_b (comparison (0, 2)) exactly; the mean over R
    holders must lie within 4 standard errors of it (sample sd / sqrt(R))."""
    rng = np.random.default_rng(99 + len(metric))
    success_rates = (0.7, 0.3, 0.5) if metric == "precision" else (0.15, 0.6, 0.35)
    truth = success_rates[0] - success_rates[2]
    plugins = np.array(
        [
            bootstrap_disparity(
                *null_holder(rng, metric, 200, success_rates),
                metric=metric,
                comparison=(0, 2),
                num_resamples=2,
                rng=rng,
            ).plugin
            for _ in range(4000)
        ]
    )
    stderr = plugins.std(ddof=1) / np.sqrt(plugins.size)
    assert abs(plugins.mean() - truth) <= 4 * stderr, (plugins.mean(), truth, stderr)
    assert abs(plugins.mean()) > 10 * stderr  # the disparity is far from 0


# --- errors ----------------------------------------------------------------------------------


def call(**kwargs: object) -> BootstrapDisparity:
    arguments: dict = {
        "predictions": np.array([1, 0, 1, 0, 1, 0]),
        "labels": np.array([1, 1, 0, 0, 1, 0]),
        "groups": np.array([0, 0, 1, 1, 2, 2]),
        "rng": np.random.default_rng(0),
        **kwargs,
    }
    return bootstrap_disparity(
        arguments.pop("predictions"),
        arguments.pop("labels"),
        arguments.pop("groups"),
        **arguments,
    )


def test_unknown_metric_lists_every_metric() -> None:
    with pytest.raises(ValueError, match="metric must be one of") as error:
        call(metric="auc")
    for metric in METRICS:
        assert repr(metric) in str(error.value)


@pytest.mark.parametrize("metric", [m for m in METRICS if m != "dp"])
def test_labels_are_required_except_for_dp(metric: str) -> None:
    with pytest.raises(ValueError, match=f"labels are required for metric='{metric}'"):
        call(labels=None, metric=metric)
    assert call(labels=None, metric="dp").plugin == pytest.approx(0.5 - 0.5)


@pytest.mark.parametrize(
    "comparison",
    [(1, 1), (-1, 0), (0, -2), (0,), (0, 1, 2), (0.5, 1), "01", None, (True, 0)],
)
def test_bad_comparison(comparison: object) -> None:
    with pytest.raises(ValueError, match="comparison"):
        call(comparison=comparison)


@pytest.mark.parametrize(
    ("groups", "needle"),
    [
        ([0, 0, 1, 1, -1, 2], "found -1"),
        ([0, 0, 1, 1, 0.5, 2], "found 0.5"),
        ([0, 0, 1, 1, np.nan, 2], "found nan"),
        (["a", "b", "a", "b", "a", "b"], "dtype"),
        ([[0, 1, 0, 1, 0, 1]], "1-D"),
        ([0, 1, 0], "one entry per prediction"),
    ],
)
def test_bad_groups(groups: list, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as error:
        call(groups=np.array(groups))
    assert "groups" in str(error.value)
    assert not isinstance(error.value, InsufficientGroupData)


def test_integral_float_and_boolean_groups_are_accepted() -> None:
    as_ints = call(comparison=(2, 1))
    as_floats = call(groups=np.array([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]), comparison=(2, 1))
    np.testing.assert_array_equal(as_floats.resamples, as_ints.resamples)
    booleans = np.array([False, False, True, True, False, True])
    assert call(groups=booleans).plugin == call(groups=booleans.astype(int)).plugin


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"comparison": (0, 3)}, ("group 3", "sizes 2 of group 0 and 0 of group 3")),
        ({"comparison": (5, 1)}, ("group 5",)),
        # Group 0's rows have Y = 1 only (no fpr rows), group 1's Y = 0 only (no eo rows).
        ({"metric": "eo", "comparison": (2, 1)}, ("positive (Y = 1) members of group 1",)),
        ({"metric": "fpr", "comparison": (0, 2)}, ("negative (Y = 0) members of group 0",)),
    ],
)
def test_absent_comparison_group_cannot_take_part(kwargs: dict, needles: tuple[str, ...]) -> None:
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    with pytest.raises(InsufficientGroupData) as error:
        call(rng=rng, **kwargs)
    for needle in needles:
        assert needle in str(error.value)
    assert rng.bit_generator.state == state  # refused before drawing anything


def test_precision_without_predicted_positives_in_a_group() -> None:
    predictions = np.array([1, 1, 0, 0, 1, 0])
    with pytest.raises(InsufficientGroupData, match="predicted positive .* of group 1"):
        call(predictions=predictions, metric="precision")
    with pytest.raises(InsufficientGroupData, match="predicted negative .* of group 0"):
        call(predictions=predictions, metric="npv")
