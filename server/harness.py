"""Simulation harness: the *true* (non-private) gap, for comparison with the private estimate.

Only a simulation can know it: the harness regenerates (or re-reads) every node's users
from the same deterministic loaders the ClientApps use and evaluates the global model on
them. Nothing here comes from a client message. Results are labelled as such everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord

from ..clients.project.config import RunConfig
from ..clients.project.evaluation import holder_statistics_for, load_shard_for, received_model
from ..clients.project.task import evaluate_users, group_gap_truth, metric_values

if TYPE_CHECKING:
    from ..mechanisms.fairness_tests.fedevalfair import ClientSummary, FairnessReport, Metric, Mode

HARNESS_LABEL = "simulation harness only: computed from raw data, not private"


@dataclass(frozen=True)
class GroundTruth:
    """True per-group means of the audited metric over users with a defined metric."""

    metric: str
    group_means: list[float]
    group_counts: list[int]
    max_gap: float
    pairwise_gaps: list[float]

    def to_dict(self) -> dict[str, object]:
        return {
            "label": HARNESS_LABEL,
            "metric": self.metric,
            "group_means": self.group_means,
            "group_counts": self.group_counts,
            "max_gap": self.max_gap,
            "pairwise_gaps": self.pairwise_gaps,
        }


def ground_truth(
    config: RunConfig, arrays: ArrayRecord, partitions: Sequence[tuple[int, int]]
) -> GroundTruth:
    """Evaluate ``arrays`` on every partition's test users and return the true gap.

    ``partitions`` lists (partition-id, num-partitions) of the nodes, as they reported them.
    """
    groups: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for partition_id, num_partitions in partitions:
        shard = load_shard_for(config, partition_id, num_partitions, "test")
        if not shard.num_users:
            continue
        model = received_model(shard, arrays, config)
        groups.append(shard.user_groups)
        values.append(metric_values(evaluate_users(model, shard), config.metric))
    all_groups = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    all_values = np.concatenate(values) if values else np.zeros(0)
    truth = group_gap_truth(all_groups, all_values, config.num_groups)
    means = [float(m) for m in truth["group_means"]]
    pairwise = [
        abs(means[i] - means[j])
        for i in range(config.num_groups)
        for j in range(i + 1, config.num_groups)
    ]
    return GroundTruth(
        metric=config.metric,
        group_means=means,
        group_counts=[int(c) for c in truth["group_counts"]],
        max_gap=float(truth["max_gap"]),
        pairwise_gaps=pairwise,
    )


def rate_truth(
    config: RunConfig, arrays: ArrayRecord, partitions: Sequence[tuple[int, int]]
) -> dict[str, object]:
    """The true rates a rate report estimates, from every partition's test users: the group x
    cell counts a user's one reported row has in expectation (each of a user's rows weighs
    1 / its rows, as the node draws one of them uniformly), and every rate metric per group
    and its summaries from them (:func:`~fedparity.mechanisms.ldp.group_rates.group_rates`
    fed exact counts)."""
    from ..clients.project.task import predict_samples
    from ..mechanisms.ldp.group_rates import encode_cells, group_rates

    cells = np.zeros(config.num_groups * 4)
    for partition_id, num_partitions in partitions:
        shard = load_shard_for(config, partition_id, num_partitions, "test")
        if not shard.num_samples:
            continue
        predictions, _ = predict_samples(received_model(shard, arrays, config), shard)
        codes = encode_cells(
            shard.user_groups[shard.user_index],
            shard.labels,
            predictions.astype(np.int64),
            config.num_groups,
        )
        rows_per_user = np.bincount(shard.user_index, minlength=shard.num_users)
        weights = 1.0 / rows_per_user[shard.user_index]
        cells += np.bincount(codes.astype(np.int64), weights=weights, minlength=cells.size)
    rates = group_rates(cells, num_groups=config.num_groups, confidence=config.confidence)
    return {"label": HARNESS_LABEL, "cell_counts": cells.tolist(), "rates": rates.to_dict()}


@dataclass(frozen=True)
class FedEvalFairTruth:
    """The plaintext FedEvalFair computation on the same data (simulation harness only).

    ``reports`` maps (metric, mode, comparison) to the plaintext
    :class:`~fedparity.mechanisms.fairness_tests.fedevalfair.FairnessReport`
    (None if fewer than 2 holders could compute the metric); ``resamples`` maps metric to
    each holder's bootstrap disparities of the layout's first comparison (for the
    distribution plot, paper Figures 4/5).
    """

    reports: dict[tuple[str, str, tuple[int, int]], FairnessReport | None]
    resamples: dict[str, list[tuple[int, np.ndarray]]]

    def to_dict(self) -> dict[str, object]:
        return {
            "label": HARNESS_LABEL,
            "tests": [
                {
                    "metric": metric,
                    "mode": mode,
                    "comparison": list(comparison),
                    "report": None if report is None else report.to_dict(),
                }
                for (metric, mode, comparison), report in self.reports.items()
            ],
        }


def fedevalfair_truth(
    config: RunConfig, arrays: ArrayRecord, partitions: Sequence[tuple[int, int]]
) -> FedEvalFairTruth:
    """Recompute every holder's bootstrap exactly as its ClientApp does (the same
    :func:`~fedparity.clients.project.evaluation.holder_statistics_for`, same seeds) and run
    :func:`fedparity.mechanisms.fairness_tests.fedevalfair.fedevalfair` in plaintext."""
    from ..mechanisms.fairness_tests.fedevalfair import fedevalfair

    layout = config.fef_layout
    per_block: dict[tuple[Metric, Mode, tuple[int, int]], list[ClientSummary]] = {
        block: [] for block in layout.blocks
    }
    resamples: dict[str, list[tuple[int, np.ndarray]]] = {m: [] for m in layout.metrics}
    for partition_id, num_partitions in sorted(partitions):
        shard = load_shard_for(config, partition_id, num_partitions, "test")
        model = received_model(shard, arrays, config)
        statistics = holder_statistics_for(config, shard, model, partition_id)  # weight 0: None
        for block, summary in zip(layout.blocks, statistics.summaries, strict=True):
            if summary is not None:
                per_block[block].append(summary)
        for (metric, comparison), boot in zip(layout.tests, statistics.bootstraps, strict=True):
            if boot is not None and comparison == layout.comparisons[0]:
                resamples[metric].append((partition_id, np.asarray(boot.resamples)))
    reports: dict[tuple[str, str, tuple[int, int]], FairnessReport | None] = {}
    for (metric, mode, comparison), summaries in per_block.items():
        reports[(metric, mode, comparison)] = (
            fedevalfair(
                summaries,
                alpha=config.fef_alpha,
                mode=mode,
                mu0=config.fef_mu0,
                tolerance=config.fef_tolerance,
            )
            if len(summaries) >= 2
            else None
        )
    return FedEvalFairTruth(reports, resamples)
