"""Simulation harness: the *true* (non-private) gap, for comparison with the private estimate.

Only a simulation can know it: the harness regenerates (or re-reads) every node's users
from the same deterministic loaders the ClientApps use and evaluates the global model on
them. Nothing here comes from a client message. Results are labelled as such everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord

from clients.data import load_partition
from clients.task import build_model, evaluate_users, group_gap_truth, metric_values, set_arrays
from server.config import RunConfig

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
        shard = load_partition(
            config.dataset,
            partition_id,
            num_partitions,
            users_per_node=config.users_per_node,
            num_groups=config.num_groups,
            seed=config.seed,
            split="test",
            data_dir=config.data_dir or None,
            download=False,
        )
        if not shard.num_users:
            continue
        model = build_model(shard.num_features, seed=config.seed)
        set_arrays(model, list(arrays.to_numpy_ndarrays()))
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
