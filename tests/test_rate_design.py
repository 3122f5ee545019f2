"""The planner's comparison of the joint report with the single-metric gap audit (issue 28):
both standard errors checked by seeded Monte Carlo against the designs themselves (the real
frequency oracle and estimator; the real M_R / M_L mechanism and ``estimate_gap``)."""

from __future__ import annotations

import numpy as np
import pytest

from fedparity.mechanisms import estimate_gap, metric_to_value
from fedparity.mechanisms.ldp.calibration import best_split
from fedparity.mechanisms.ldp.frequency_oracle import frequency_oracle
from fedparity.mechanisms.ldp.group_rates import RATE_METRICS, group_rates
from fedparity.mechanisms.ldp.rate_design import compare_rate_designs
from fedparity.mechanisms.ldp.reports import ReportSummary

#: A population of 2 groups, 4,000 users: group 0 TPR 0.75, group 1 TPR 0.5.
COUNTS = np.array([300, 100, 100, 500, 200, 100, 200, 500]) * 4
REPETITIONS = 400
#: The sample standard deviation of R normal draws has a relative standard error of about
#: 1 / sqrt(2 (R - 1)) = 3.5 %; 4.5 of them (16 %) bound a false failure at ~1e-5 per check.
TOLERANCE = 4.5 / np.sqrt(2 * (REPETITIONS - 1))


def users_of(counts: np.ndarray) -> np.ndarray:
    """One category (g * 4 + cell) per user."""
    return np.repeat(np.arange(counts.size), counts.astype(np.int64))


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_joint_reports_standard_error_is_the_spread_of_its_estimate(epsilon: float) -> None:
    comparison = compare_rate_designs("true_positive_rate", epsilon, COUNTS, num_groups=2)
    oracle = frequency_oracle("best", epsilon, 8, int(COUNTS.sum()))
    assert oracle.name == comparison.joint_oracle
    values = users_of(COUNTS)
    rng = np.random.default_rng(7)
    differences = []
    for _ in range(REPETITIONS):
        support = oracle.support_counts(oracle.perturb(values, rng))
        rates = group_rates(
            oracle.estimate(support, values.size), num_groups=2, metrics=["true_positive_rate"]
        )
        by_group = rates.by_group["true_positive_rate"]
        differences.append(by_group[0].value - by_group[1].value)
    spread = float(np.std(differences, ddof=1))
    assert abs(spread / comparison.joint_stderr - 1) < TOLERANCE, (spread, comparison)
    assert abs(np.mean(differences) - comparison.difference) < 4.5 * spread / np.sqrt(REPETITIONS)


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_gap_audits_standard_error_is_the_spread_of_its_estimate(epsilon: float) -> None:
    """The audit as ``LdpGapAudit.for_budget`` deploys it for TPR: the two groups plus the
    undefined category (users without a positive label), sizes estimated from the reports."""
    comparison = compare_rate_designs("true_positive_rate", epsilon, COUNTS, num_groups=2)
    mechanism = best_split("best", epsilon, 3).build()
    assert mechanism.name == comparison.gap_audit_mechanism
    by_group = COUNTS.reshape(2, 4)
    groups, values = [], []
    for group in (0, 1):
        tp, _, fn, _ = by_group[group]
        groups += [group] * int(tp + fn)
        values += [1.0] * int(tp) + [0.0] * int(fn)
    undefined = int(COUNTS.sum() - len(groups))
    groups = np.array(groups + [2] * undefined)
    users = np.where(groups == 2, 0.0, metric_to_value(np.array(values + [0.5] * undefined)))
    rng = np.random.default_rng(8)
    differences = []
    for _ in range(REPETITIONS):
        reports = mechanism.perturb(groups, users, rng)
        summary = ReportSummary.from_reports(reports.groups, reports.values, 3)
        estimate = estimate_gap(summary, mechanism, undefined_category=True)
        differences.append(float(estimate.differences[0]))
    spread = float(np.std(differences, ddof=1))
    assert comparison.gap_audit_stderr is not None
    assert abs(spread / comparison.gap_audit_stderr - 1) < TOLERANCE, (spread, comparison)


def test_the_comparison_names_the_tighter_design_and_metrics_without_a_gap_audit() -> None:
    low = compare_rate_designs("true_positive_rate", 1.0, COUNTS, num_groups=2)
    high = compare_rate_designs("true_positive_rate", 4.0, COUNTS, num_groups=2)
    for result in (low, high):
        assert result.tighter == (
            "joint report" if result.joint_stderr <= result.gap_audit_stderr else "gap audit"
        )
        assert result.tighter in result.summary()
    assert high.tighter == "joint report"  # GRR at epsilon 4 keeps 89 % of reports
    only_joint = compare_rate_designs("selection_rate", 1.0, COUNTS, num_groups=2)
    assert only_joint.gap_audit_stderr is None and only_joint.tighter == "joint report"
    assert "does not measure" in only_joint.summary()
    assert set(RATE_METRICS) >= {"selection_rate", "true_positive_rate"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metric": "auc"}, "metric must be one of"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"cell_counts": np.ones(7)}, "cell_counts must be 8 finite counts"),
        ({"cell_counts": np.array([0, 1, 0, 1, 1, 1, 1, 1])}, "no user in the denominator"),
    ],
)
def test_bad_questions_get_a_message_naming_the_parameter(kwargs: dict, match: str) -> None:
    arguments = {"metric": "true_positive_rate", "epsilon": 1.0, "cell_counts": COUNTS, **kwargs}
    with pytest.raises(ValueError, match=match):
        compare_rate_designs(num_groups=2, **arguments)
