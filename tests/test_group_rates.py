"""Rate metrics from one joint (group, confusion cell) report: fairlearn's values without
noise, interval coverage with noise, near-zero denominators, suppression, intersections.

Statistical tests are seeded Monte Carlo runs; the coverage tolerance is the binomial band of
the replications at a family-wise false-alarm level of 0.001.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import (
    FrequencyEstimate,
    IntersectionalGroups,
    confusion_counts,
    encode_cells,
    frequency_oracle,
    group_rates,
)

FAMILY_ALPHA = 1e-3


def synthetic(n: int, seed: int) -> dict[str, np.ndarray]:
    """Users with sex (2) x race (3) and group-dependent labels and predictions."""
    rng = np.random.default_rng(seed)
    sex = rng.choice(np.array(["F", "M"]), n, p=[0.4, 0.6])
    race = rng.choice(np.array(["a", "b", "c"]), n, p=[0.6, 0.3, 0.1])
    shift = 0.15 * (sex == "M") + 0.1 * (race == "a") - 0.05 * (race == "c")
    y_true = (rng.random(n) < 0.3 + shift).astype(np.int8)
    score = 0.6 * y_true + shift + rng.normal(0.0, 0.3, n)
    y_pred = (score > 0.55).astype(np.int8)
    return {"sex": sex, "race": race, "y_true": y_true, "y_pred": y_pred}


# ---- noise off: fairlearn's MetricFrame to 1e-12 ----------------------------------------


def negative_predictive_value(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    negatives = y_pred == 0
    return float(np.sum(negatives & (y_true == 0)) / np.sum(negatives))


def test_without_noise_every_value_equals_fairlearns_metricframe() -> None:
    fairlearn = pytest.importorskip("fairlearn.metrics", reason="fairlearn is a test extra")
    pd = pytest.importorskip("pandas")
    from sklearn.metrics import accuracy_score, precision_score

    data = synthetic(30_000, seed=1)
    groups = IntersectionalGroups.from_categories({"sex": ["F", "M"], "race": ["a", "b", "c"]})
    codes = groups.encode({"sex": data["sex"], "race": data["race"]})
    counts = confusion_counts(codes, data["y_true"], data["y_pred"], groups.num_groups)
    rates = group_rates(counts, num_groups=groups.num_groups, group_labels=groups.labels)

    functions = {
        "selection_rate": fairlearn.selection_rate,
        "true_positive_rate": fairlearn.true_positive_rate,
        "false_positive_rate": fairlearn.false_positive_rate,
        "false_negative_rate": fairlearn.false_negative_rate,
        "true_negative_rate": fairlearn.true_negative_rate,
        "accuracy": accuracy_score,
        "precision": precision_score,
        "negative_predictive_value": negative_predictive_value,
    }
    sensitive = pd.DataFrame({"sex": data["sex"], "race": data["race"]})
    frame = fairlearn.MetricFrame(
        metrics=functions,
        y_true=data["y_true"],
        y_pred=data["y_pred"],
        sensitive_features=sensitive,
    )
    tolerance = 1e-12
    checked = 0
    for metric in functions:
        for label, estimate in rates.by_group[metric].items():
            assert abs(estimate.value - frame.by_group.loc[label, metric]) < tolerance
            checked += 1
        assert abs(rates.overall[metric].value - frame.overall[metric]) < tolerance
        assert abs(rates.group_min(metric).value - frame.group_min()[metric]) < tolerance
        assert abs(rates.group_max(metric).value - frame.group_max()[metric]) < tolerance
        for method in ("between_groups", "to_overall"):
            assert (
                abs(
                    rates.difference(metric, method).value - frame.difference(method=method)[metric]
                )
                < tolerance
            )
            assert (
                abs(rates.ratio(metric, method).value - frame.ratio(method=method)[metric])
                < tolerance
            )
    assert checked == 8 * 6
    arguments = {
        "y_true": data["y_true"],
        "y_pred": data["y_pred"],
        "sensitive_features": sensitive,
    }
    for name in (
        "demographic_parity_difference",
        "demographic_parity_ratio",
        "equalized_odds_difference",
        "equalized_odds_ratio",
        "equal_opportunity_difference",
        "equal_opportunity_ratio",
    ):
        for method in ("between_groups", "to_overall"):
            ours = getattr(rates, name)(method).value
            theirs = getattr(fairlearn, name)(**arguments, method=method)
            assert abs(ours - theirs) < tolerance, (name, method, ours, theirs)
    # Without noise every interval is the point itself.
    dp = rates.demographic_parity_ratio()
    assert dp.lower == pytest.approx(dp.value, abs=1e-12)
    assert dp.upper == pytest.approx(dp.value, abs=1e-12)


# ---- noise on: interval coverage ------------------------------------------------------------


def fixed_population(cells_by_group: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Users' categories for the given TP, FP, FN, TN counts per group, and the counts."""
    counts = np.array(cells_by_group, dtype=np.int64).reshape(-1)
    return np.repeat(np.arange(counts.shape[0]), counts), counts.astype(np.float64)


@pytest.mark.parametrize(
    "cells_by_group",
    [
        # Group 1 selected less (ratio about 0.63), TPR and FPR differ.
        [[6000, 3000, 2000, 9000], [3000, 1000, 3000, 13000]],
        # Group 1 almost never selected: selection rates 0.45 and 0.025, ratio about 0.056.
        [[6000, 3000, 2000, 9000], [400, 100, 5600, 13900]],
    ],
    ids=["moderate", "near-zero-rate"],
)
@pytest.mark.slow
def test_intervals_cover_the_true_rates_differences_and_ratios(cells_by_group) -> None:
    users, truth_counts = fixed_population(cells_by_group)
    truth = group_rates(truth_counts, num_groups=2)
    oracle = frequency_oracle("best", 2.0, 8, num_users=users.shape[0])
    rng = np.random.default_rng(2026)
    repetitions = 400
    targets = {
        "selection_rate[0]": (lambda r: r.by_group["selection_rate"][0]),
        "true_positive_rate[1]": (lambda r: r.by_group["true_positive_rate"][1]),
        "false_positive_rate[0]": (lambda r: r.by_group["false_positive_rate"][0]),
        "precision[0]": (lambda r: r.by_group["precision"][0]),
        "false_negative_rate[1]": (lambda r: r.by_group["false_negative_rate"][1]),
        "true_negative_rate[0]": (lambda r: r.by_group["true_negative_rate"][0]),
        "accuracy[1]": (lambda r: r.by_group["accuracy"][1]),
        "negative_predictive_value[0]": (lambda r: r.by_group["negative_predictive_value"][0]),
        "demographic_parity_difference": (lambda r: r.demographic_parity_difference()),
        "demographic_parity_ratio": (lambda r: r.demographic_parity_ratio()),
    }
    true_values = {name: get(truth).value for name, get in targets.items()}
    covered = dict.fromkeys(targets, 0)
    for _ in range(repetitions):
        support = oracle.perturb_and_count(users, rng)
        rates = group_rates(oracle.estimate(support, users.shape[0]), num_groups=2)
        for name, get in targets.items():
            estimate = get(rates)
            covered[name] += estimate.lower <= true_values[name] <= estimate.upper
    # Each coverage count is Binomial(R, 0.95) if the intervals are right; the band is
    # two-sided at a family-wise level of 0.001 over the ten quantities (about +-0.043).
    z = stats.norm.ppf(1 - FAMILY_ALPHA / (2 * len(targets)))
    half_width = z * math.sqrt(0.95 * 0.05 / repetitions)
    rates_covered = {name: count / repetitions for name, count in covered.items()}
    for name, coverage in rates_covered.items():
        assert abs(coverage - 0.95) < half_width, (name, rates_covered)


def test_a_log_scale_ratio_interval_would_fail_near_zero_where_fiellers_holds() -> None:
    # Why Fieller: with a selection rate near zero the estimated rate is often <= 0 under
    # noise, where a log-scale interval does not exist; Fieller's still gives one.
    users, _ = fixed_population([[6000, 3000, 2000, 9000], [30, 10, 5970, 13990]])
    oracle = frequency_oracle("best", 1.0, 8)
    rng = np.random.default_rng(5)
    nonpositive = 0
    for _ in range(50):
        estimate = oracle.estimate(oracle.perturb_and_count(users, rng), users.shape[0])
        rates = group_rates(estimate, num_groups=2)
        nonpositive += rates.by_group["selection_rate"][1].value <= 0
        ratio = rates.demographic_parity_ratio()
        assert 0.0 <= ratio.lower <= ratio.upper <= 1.0
    assert nonpositive > 0


# ---- undefined and near-zero denominators, suppression -------------------------------------


def test_a_denominator_estimated_at_or_near_zero_gives_nan_and_a_reason_not_a_crash() -> None:
    # Group 1 has no positives (TP + FN = 0): TPR and FNR are undefined there.
    counts = np.array([50, 20, 30, 100, 0, 10, 0, 90], dtype=np.float64)
    rates = group_rates(counts, np.eye(8) * 25.0, num_groups=2)
    tpr = rates.by_group["true_positive_rate"][1]
    assert math.isnan(tpr.value) and "TP+FN" in tpr.note and "<= 0" in tpr.note
    # Group 1's precision: TP + FP = 10 with standard error sqrt(50) ~ 7.1, under 1.96 se.
    precision = rates.by_group["precision"][1]
    assert precision.value == 0.0 and math.isnan(precision.stderr)
    assert (precision.lower, precision.upper) == (0.0, 1.0) and "interval [0, 1]" in precision.note
    # Summaries leave the undefined group out and say so; nothing raises.
    assert "left out: 1" in rates.equal_opportunity_difference().note
    assert math.isnan(rates.equal_opportunity_difference().value)
    rates.summary()
    json.dumps(rates.to_dict())


def test_small_groups_are_suppressed_by_their_noisy_count_and_labelled() -> None:
    counts = np.array([50, 20, 30, 100, 3, 1, 2, 4, 40, 40, 40, 40], dtype=np.float64)
    rates = group_rates(counts, num_groups=3, group_labels=["x", "y", "z"], min_group_count=20.0)
    assert rates.suppressed == ("y",)
    assert rates.by_group["accuracy"]["y"].note.startswith("suppressed: noisy count 10")
    assert math.isnan(rates.by_group["accuracy"]["y"].value)
    # The summaries use x and z only.
    accuracy = {"x": 150 / 200, "z": 0.5}
    assert rates.difference("accuracy").value == pytest.approx(accuracy["x"] - accuracy["z"])
    assert "suppressed" in rates.summary() and "y" in rates.summary()
    # The overall values still count every user (fairlearn's overall).
    assert rates.overall["accuracy"].value == pytest.approx((150 + 7 + 80) / 370)


# ---- the four-fifths verdict -----------------------------------------------------------------


def two_groups(selection: tuple[float, float], n: int = 10_000) -> np.ndarray:
    """Exact counts with the given selection rates (TP = FP, FN = TN within each group)."""
    cells = []
    for rate in selection:
        selected = rate * n
        cells += [selected / 2, selected / 2, (n - selected) / 2, (n - selected) / 2]
    return np.array(cells)


def test_the_four_fifths_verdict_follows_the_ratios_interval() -> None:
    fails = group_rates(two_groups((0.5, 0.3)), num_groups=2).four_fifths()
    assert fails.verdict == "fails" and "ratio < 0.8 with 95 % confidence" in fails.sentence
    holds = group_rates(two_groups((0.5, 0.45)), num_groups=2).four_fifths()
    assert holds.verdict == "passes" and ">= 0.8" in holds.sentence
    noisy = group_rates(two_groups((0.5, 0.41)), np.eye(8) * 4e4, num_groups=2).four_fifths()
    assert noisy.verdict == "undecided"
    assert noisy.ratio.lower < 0.8 < noisy.ratio.upper


# ---- encodings -------------------------------------------------------------------------------


def test_cells_and_the_undefined_category_are_encoded_per_group() -> None:
    codes = encode_cells([0, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0], [1, 1, 0, 0, 1, 0], 2)
    assert codes.tolist() == [0, 1, 2, 3, 4, 7]
    flagged = encode_cells([0, 1, 1], [1, 1, 0], [1, 1, 0], 2, undefined=[False, True, False])
    assert flagged.tolist() == [0, 9, 8]
    counts = confusion_counts([0, 1, 1], [1, 1, 0], [1, 1, 0], 2, undefined=[0, 1, 0])
    rates = group_rates(counts, num_groups=2)
    # The undefined user counts in its group's size, in no rate.
    assert rates.group_counts.tolist() == [1.0, 2.0]
    assert rates.by_group["accuracy"][1].value == 1.0


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint8, np.int16, np.int64, np.float64])
@pytest.mark.parametrize("undefined", [False, True])
def test_cells_are_encoded_alike_from_every_label_dtype(dtype, undefined: bool) -> None:
    # 1-byte labels (bool, int8, uint8) take a fast path (one check, viewed as bytes): it
    # gives the codes g c + cell of the definition, as every other dtype does, leaves the
    # inputs as they were, and refuses what the shared check refuses.
    rng = np.random.default_rng(11)
    groups = rng.integers(0, 3, 1000).astype(np.int16)
    truth, pred = rng.integers(0, 2, 1000), rng.integers(0, 2, 1000)
    flag = rng.integers(0, 2, 1000).astype(bool) if undefined else None
    cells = 5 if undefined else 4
    expected = groups * cells + (3 - 2 * pred - truth)
    if flag is not None:
        expected[flag] = groups[flag] * cells + 4
    y_true, y_pred = truth.astype(dtype), pred.astype(dtype)
    codes = encode_cells(groups, y_true, y_pred, 3, undefined=flag)
    assert codes.dtype == np.int16
    assert codes.tolist() == expected.tolist()
    assert y_true.tolist() == truth.astype(dtype).tolist()
    assert y_pred.tolist() == pred.astype(dtype).tolist()


@pytest.mark.parametrize(
    "bad", [np.array([0, 1, -1], np.int8), np.array([0, 2, 1], np.uint8), np.array([0, 1, 2.0])]
)
def test_labels_other_than_0_and_1_are_refused_whatever_their_dtype(bad) -> None:
    for name, args in (("y_true", (bad, [0, 1, 1])), ("y_pred", ([0, 1, 1], bad))):
        with pytest.raises(ValueError, match=f"{name} must hold only 0 and 1; found"):
            encode_cells([0, 1, 0], *args, 2)
    with pytest.raises(ValueError, match="y_true must be a 1-D array"):
        encode_cells([0, 1], np.zeros((2, 1), np.int8), [0, 1], 2)


def test_intersectional_groups_encode_and_decode_with_labels() -> None:
    groups = IntersectionalGroups.from_categories({"sex": ["F", "M"], "age": [1, 2, 3]})
    assert groups.num_groups == 6
    assert groups.labels == (("F", 1), ("F", 2), ("F", 3), ("M", 1), ("M", 2), ("M", 3))
    codes = groups.encode({"sex": ["M", "F", "M"], "age": [3, 1, 1]})
    assert codes.tolist() == [5, 0, 3]
    decoded = groups.decode(codes)
    assert decoded["sex"].tolist() == ["M", "F", "M"] and decoded["age"].tolist() == [3, 1, 1]
    with pytest.raises(ValueError, match="feature 'age' has a value '4'"):
        groups.encode({"sex": ["M"], "age": [4]})
    with pytest.raises(ValueError, match="missing"):
        groups.encode({"sex": ["M"]})


# ---- outputs ---------------------------------------------------------------------------------


def test_the_outputs_dict_repr_summary_and_dataframe() -> None:
    data = synthetic(5_000, seed=3)
    groups = IntersectionalGroups.from_categories({"sex": ["F", "M"]})
    codes = groups.encode({"sex": data["sex"]})
    oracle = frequency_oracle("best", 2.0, 8)
    users = encode_cells(codes, data["y_true"], data["y_pred"], 2)
    estimate = oracle.estimate(
        oracle.perturb_and_count(users, np.random.default_rng(0)), users.shape[0]
    )
    assert isinstance(estimate, FrequencyEstimate)
    rates = group_rates(estimate, num_groups=2, group_labels=groups.labels)
    text = json.dumps(rates.to_dict())
    assert '"demographic_parity_ratio"' in text and '"four_fifths"' in text
    assert len(repr(rates)) < 200
    summary = rates.summary()
    assert "demographic parity ratio" in summary and "four-fifths rule" in summary
    pd = pytest.importorskip("pandas")
    frame = rates.to_pandas()
    assert isinstance(frame, pd.DataFrame)
    assert len(frame) == len(rates.metrics) * 3
    wide = frame[frame.group != "overall"].pivot(index="group", columns="metric", values="value")
    assert wide.loc[[("F",)], "accuracy"].iloc[0] == rates.by_group["accuracy"][("F",)].value


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"counts": np.ones(7), "num_groups": 2}, r"counts must be a 1-D array"),
        ({"counts": np.ones(8), "num_groups": 1}, r"num_groups must be an integer in \[2,"),
        ({"counts": np.ones(8), "num_groups": 2, "confidence": 1.0}, "confidence must be"),
        ({"counts": np.ones(8), "num_groups": 2, "metrics": ["auc"]}, "metrics must be one of"),
        ({"counts": np.ones(8), "num_groups": 2, "group_labels": ["a"]}, "group_labels must"),
        (
            {"counts": np.ones(8), "covariance": np.ones((7, 7)), "num_groups": 2},
            r"covariance must be a finite \(8, 8\) matrix",
        ),
    ],
)
def test_bad_input_is_refused_with_the_parameter_and_its_range(kwargs, message) -> None:
    counts = kwargs.pop("counts")
    with pytest.raises(ValueError, match=message):
        group_rates(counts, **kwargs)
