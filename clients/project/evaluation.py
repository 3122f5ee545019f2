"""What a node of the project app and the simulation harness compute alike from the run
config: a partition's users, the received model, and a FedEvalFair holder's statistics.

The ClientApp (:mod:`fedparity.clients.app`) calls these on the node's own partition; the
server's simulation harness (:mod:`fedparity.server.harness`) calls the same functions on
every partition to compute the true, non-private values it compares the private estimates
with. torch loads with the model, not with this module.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord

from ..fedevalfair import ClientStatistics, holder_statistics
from ..messages import MessageError
from ..shards import UserShard
from .config import RunConfig
from .data import ADULT_DIR_ENV, adult_holder, load_partition, synthetic_holder

if TYPE_CHECKING:
    import torch

__all__ = ["holder_statistics_for", "load_shard_for", "received_model"]


def load_shard_for(
    config: RunConfig, partition_id: int, num_partitions: int, split: str
) -> UserShard:
    """The shard of partition ``partition_id`` (also used by the simulation harness). A node
    passes its config through :func:`node_data_config` first, so that it never downloads into
    the run's ``data-dir``."""
    if config.task == "fedevalfair":
        if config.dataset == "adult":
            folder = config.data_dir or os.environ.get(ADULT_DIR_ENV, "")
            return adult_holder(
                folder,
                partition_id,
                num_partitions,
                split,
                scheme=config.fef_split,
                seed=config.seed,
                dirichlet_alpha=config.fef_dirichlet_alpha,
                download=config.download,
            )
        return synthetic_holder(
            partition_id,
            num_partitions,
            split,
            rows_per_holder=config.users_per_node,
            seed=config.seed,
        )
    return load_partition(
        config.dataset,
        partition_id,
        num_partitions,
        users_per_node=config.users_per_node,
        num_groups=config.num_groups,
        seed=config.seed,
        split=split,
        data_dir=config.data_dir or None,
        download=config.download,
    )


def received_model(
    shard: UserShard, arrays: ArrayRecord | None, config: RunConfig
) -> torch.nn.Module:
    """The received model as a module returning logits: the FedAvg logistic regression, or
    in the pipeline the FPFL network (``fpfl-architecture``) from its flat ``weights``."""
    from ..fpfl_task import build_model_for, logit_model, num_parameters, set_flat_parameters
    from .task import build_model, set_arrays

    if config.task == "pipeline":
        if arrays is None or "weights" not in arrays:
            raise MessageError("message array 'weights' is missing")
        network = build_model_for(
            config.fpfl_architecture, (shard.num_features,), num_classes=2, seed=config.seed
        )
        weights = arrays["weights"].numpy()
        if weights.shape != (num_parameters(network),) or not np.isfinite(weights).all():
            raise MessageError("message array 'weights' must hold the model's finite parameters")
        set_flat_parameters(network, weights)
        return logit_model(network)
    model = build_model(shard.num_features, seed=config.seed)
    if arrays is not None:
        set_arrays(model, list(arrays.to_numpy_ndarrays()))
    return model


def holder_statistics_for(
    config: RunConfig, shard: UserShard, model: torch.nn.Module, partition_id: int
) -> ClientStatistics:
    """A FedEvalFair holder's bootstrap statistics of ``model`` on ``shard`` with the run's
    variant, resamples and minimum cell count, seeded by the run's seed and the partition (so
    the harness recomputes exactly what the holder sent); a block it cannot compute has no
    summary (weight 0), as in :func:`~fedparity.clients.fedevalfair.holder_statistics`."""
    return holder_statistics(
        shard,
        model,
        seed=config.seed,
        partition_id=partition_id,
        variant=config.fef_variant,
        num_resamples=config.fef_resamples,
        min_cell_count=config.fef_min_cell,
        layout=config.fef_layout,
    )
