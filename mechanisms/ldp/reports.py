"""What a client sends and what the server keeps of it.

A client's LDP report is a perturbed pair (g', v'). The gap estimators only need, per
reported group, the number of reports, their sum and their sum of squares: that is the
:class:`ReportSummary`, which is additive, so reports can be summarised chunk by chunk
(streaming) or node by node (federated) and merged.

:class:`ReportMoments` holds the per-client moments of a mechanism's output that the
closed-form variances need (Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
Learning", AFCP workshop, PMLR, 2022, Appendix A.3-A.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import check_epsilon, check_num_groups


@dataclass(frozen=True)
class ReportMoments:
    """First and second moments of one client's report, as functions of its true (g, v).

    With G' the reported group and V' the reported value:

    * ``P(G' = g) = keep_probability`` (a); ``P(G' = h) = flip_probability`` for each h != g
      (that is ``(1 - a) / (d - 1)``);
    * ``E[V' | G' = g, v] = value_gain * v``; ``E[V' | G' != g] = 0``;
    * ``E[V'^2 | G' = g, v] = kept_second_moment + kept_second_moment_slope * v^2``;
    * ``E[V'^2 | G' != g] = flipped_second_moment``.

    M_R: gain 2b - 1, second moments 1, 0 and 1. M_L: gain 1, second moments
    sigma^2, 1 and sigma_flip^2 (Laplace variances).
    """

    num_groups: int
    keep_probability: float
    value_gain: float
    kept_second_moment: float
    kept_second_moment_slope: float
    flipped_second_moment: float

    def __post_init__(self) -> None:
        check_num_groups(self.num_groups)
        if not 0.0 < self.keep_probability <= 1.0:
            raise ValueError(f"keep_probability must be in (0, 1], got {self.keep_probability}")
        if self.keep_probability <= self.flip_probability:
            raise ValueError(
                "keep_probability must exceed the flip probability (1 - a)/(d - 1); "
                f"got a={self.keep_probability} with d={self.num_groups}"
            )
        if not self.value_gain > 0.0:
            raise ValueError(f"value_gain must be > 0, got {self.value_gain}")

    @property
    def flip_probability(self) -> float:
        """Probability of reporting one particular other group: (1 - a) / (d - 1)."""
        return (1.0 - self.keep_probability) / (self.num_groups - 1)


@dataclass(frozen=True)
class PerturbedReports:
    """Reports (g', v') of many clients; ``values`` are on the paper's [-1, 1] scale."""

    groups: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        if self.groups.shape != self.values.shape or self.groups.ndim != 1:
            raise ValueError(
                "groups and values must be 1-D arrays of the same length, got "
                f"{self.groups.shape} and {self.values.shape}"
            )

    def __len__(self) -> int:
        return int(self.groups.shape[0])


@dataclass(frozen=True)
class ReportSummary:
    """Sufficient statistics of a set of reports, per reported group.

    Attributes
    ----------
    num_reports : int
        K, the number of reports (every client sends exactly one).
    report_counts : np.ndarray
        n'_G, the number of reports whose group is G.
    value_sums : np.ndarray
        sum of v' over reports with group G.
    value_square_sums : np.ndarray
        sum of v'^2 over reports with group G.
    """

    num_reports: int
    report_counts: np.ndarray
    value_sums: np.ndarray
    value_square_sums: np.ndarray

    def __post_init__(self) -> None:
        shapes = {self.report_counts.shape, self.value_sums.shape, self.value_square_sums.shape}
        if len(shapes) != 1 or self.report_counts.ndim != 1:
            raise ValueError("report_counts, value_sums and value_square_sums must align")
        check_num_groups(self.report_counts.shape[0], "number of groups in the summary")
        if int(self.report_counts.sum()) != int(self.num_reports):
            raise ValueError(
                f"report_counts sum to {int(self.report_counts.sum())}, "
                f"but num_reports is {self.num_reports}"
            )

    @property
    def num_groups(self) -> int:
        return int(self.report_counts.shape[0])

    @classmethod
    def empty(cls, num_groups: int) -> ReportSummary:
        check_num_groups(num_groups)
        return cls(
            0,
            np.zeros(num_groups, dtype=np.int64),
            np.zeros(num_groups, dtype=np.float64),
            np.zeros(num_groups, dtype=np.float64),
        )

    @classmethod
    def from_reports(cls, groups: np.ndarray, values: np.ndarray, num_groups: int) -> ReportSummary:
        """Summarise reports; ``groups`` must already be validated integers in [0, d)."""
        groups = np.asarray(groups)
        values = np.asarray(values)
        counts = np.bincount(groups, minlength=num_groups).astype(np.int64)
        sums: np.ndarray
        squares: np.ndarray
        if values.dtype == np.int8:
            # M_R reports: v' in {-1, +1}, so v'^2 = 1 and one bincount of the +1s suffices.
            positives = np.bincount(groups[values > 0], minlength=num_groups)
            sums = (2 * positives - counts).astype(np.float64)
            squares = counts.astype(np.float64)
        else:
            values = values.astype(np.float64, copy=False)
            sums = np.bincount(groups, weights=values, minlength=num_groups)
            squares = np.bincount(groups, weights=values * values, minlength=num_groups)
        return cls(int(groups.shape[0]), counts, sums, squares)

    def merge(self, other: ReportSummary) -> ReportSummary:
        """The summary of the union of both sets of reports."""
        if other.num_groups != self.num_groups:
            raise ValueError(
                f"cannot merge summaries with {self.num_groups} and {other.num_groups} groups"
            )
        return ReportSummary(
            self.num_reports + other.num_reports,
            self.report_counts + other.report_counts,
            self.value_sums + other.value_sums,
            self.value_square_sums + other.value_square_sums,
        )


@dataclass(frozen=True)
class GroupValueMechanism:
    """What every gap mechanism shares (M_R, M_L, M_P, M_N): GRR on the group with
    ``epsilon_group`` and a value step with ``epsilon_value``, for ``num_groups`` groups, each
    checked when the mechanism is built. :meth:`perturb_and_summarize` summarises
    :meth:`perturb`'s reports unless a mechanism streams them itself."""

    epsilon_group: float
    epsilon_value: float
    num_groups: int = 2

    def __post_init__(self) -> None:
        check_epsilon("epsilon_group", self.epsilon_group)
        check_epsilon("epsilon_value", self.epsilon_value)
        check_num_groups(self.num_groups)

    def perturb(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> PerturbedReports:
        """Perturb each user's (g, v); ``values`` on the [-1, 1] scale (v = 2 m - 1)."""
        raise NotImplementedError

    def perturb_and_summarize(
        self,
        groups: np.ndarray,
        values: np.ndarray,
        rng: np.random.Generator,
        *,
        validate: bool = True,
    ) -> ReportSummary:
        """The summary of :meth:`perturb`'s reports (same draws), without returning them."""
        reports = self.perturb(groups, values, rng, validate=validate)
        return ReportSummary.from_reports(reports.groups, reports.values, self.num_groups)
