"""The project app's FPFL node from its run config: the node settings, the run's population
and the node's shard, and the round's contribution of the project's model.

The library's side of an FPFL node (:class:`~fedparity.clients.fpfl_node.FPFLNodeSettings`,
:func:`~fedparity.clients.fpfl_node.cohort_contribution`) knows nothing of the run config;
these helpers translate the project app's keys into it.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from numpy.typing import NDArray

from ..fpfl_data import FPFLShard, users_as_fpfl_shard
from ..fpfl_node import FPFLNodeSettings, cohort_contribution
from ..shards import concat_shards
from .config import RunConfig
from .data import ADULT_DIR_ENV, load_partition
from .fpfl_data import fpfl_population

__all__ = [
    "node_contribution",
    "node_noise_multiplier",
    "node_noise_share_std",
    "node_settings",
    "node_shard",
    "population",
]


@functools.lru_cache(maxsize=4)
def _population(
    dataset: str,
    data_dir: str,
    download: bool,
    users_per_node: int,
    num_groups: int,
    seed: int,
    num_partitions: int,
) -> tuple[FPFLShard, FPFLShard]:
    return fpfl_population(
        dataset,
        num_partitions=num_partitions,
        seed=seed,
        users_per_node=users_per_node,
        num_groups=num_groups,
        data_dir=data_dir,
        download=download,
    )


@functools.lru_cache(maxsize=4)
def _pipeline_population(
    dataset: str,
    data_dir: str,
    download: bool,
    users_per_node: int,
    num_groups: int,
    seed: int,
    num_partitions: int,
) -> tuple[FPFLShard, FPFLShard]:
    splits = []
    for split in ("train", "test"):
        shards = [
            load_partition(
                dataset,
                partition,
                num_partitions,
                users_per_node=users_per_node,
                num_groups=num_groups,
                seed=seed,
                split=split,
                data_dir=data_dir or None,
                download=download,
            )
            for partition in range(num_partitions)
        ]
        splits.append(users_as_fpfl_shard(concat_shards(shards), num_groups=num_groups))
    return splits[0], splits[1]


def population(config: RunConfig, num_partitions: int) -> tuple[FPFLShard, FPFLShard]:
    """(training users, held-out test set) of the run, cached per process. The pipeline's
    users are those of the LDP audit (:func:`~fedparity.clients.project.data.load_partition`): its
    trainings use their ``train`` rows and the harness evaluates on their ``test`` rows."""
    data_dir = config.data_dir or os.environ.get(ADULT_DIR_ENV, "")
    if config.task == "pipeline":
        return _pipeline_population(
            config.dataset,
            data_dir,
            config.download,
            config.users_per_node,
            config.num_groups,
            config.seed,
            num_partitions,
        )
    return _population(
        config.dataset,
        data_dir,
        config.download,
        config.users_per_node,
        config.num_groups,
        config.seed,
        num_partitions,
    )


@functools.lru_cache(maxsize=32)
def node_shard(config: RunConfig, partition_id: int, num_partitions: int) -> FPFLShard:
    """The users of partition ``partition_id``, cached per process like the population (a
    simulated ClientApp serves every round of many nodes; nothing changes a shard)."""
    train, _ = population(config, num_partitions)
    if config.fpfl_split == "iid":
        return train.partition(partition_id, num_partitions)
    owners = group_dirichlet_owners(train, num_partitions, config.fpfl_dirichlet_alpha, config.seed)
    return train.select_users(np.flatnonzero(owners == partition_id))


def group_dirichlet_owners(
    users: FPFLShard, num_partitions: int, alpha: float, seed: int
) -> np.ndarray:
    """The node of every user under ``fpfl-split = "dirichlet"``: per group (of the user's
    first row), shares ~ Dirichlet(``alpha``) over the nodes, deterministic from ``seed``
    (:func:`~fedparity.clients.project.data.holders.dirichlet_owners`): the non-IID split over
    the sensitive attribute of Ezzeldin et al., "FairFed: Enabling Group Fairness in Federated
    Learning", AAAI 2023 (heterogeneity over the sensitive attribute)."""
    from .data.holders import dirichlet_owners

    _, first_rows = np.unique(users.user_index, return_index=True)
    return dirichlet_owners(
        users.groups[first_rows],
        users.num_groups,
        num_partitions,
        alpha,
        share_rng=np.random.default_rng(np.random.SeedSequence([seed, 7_341])),
        deal_rng=np.random.default_rng(np.random.SeedSequence([seed, 7_342])),
    )


def node_settings(config: RunConfig) -> FPFLNodeSettings:
    """The project app's node settings from its run config."""
    return FPFLNodeSettings(
        constraint=config.fpfl_constraint,
        cohort_size=config.fpfl_cohort_size,
        rounds=config.fpfl_rounds,
        clipping_bound=config.fpfl_clipping_bound if config.fpfl_clips else None,
        epsilon=config.fpfl_epsilon if config.fpfl_private else None,
        delta=config.fpfl_delta,
        accountant=config.fpfl_accountant,
        distributed_noise=config.fpfl_noise == "distributed",
        masking=config.fpfl_secure_sum == "masking",
        dropout_tolerance=config.fpfl_dropout_tolerance,
        client_seed=config.fpfl_client_seed,
        fairfed_release_share=config.fpfl_release_share,
    )


def node_noise_multiplier(config: RunConfig, population_size: int) -> float:
    """``sigma`` for the run's (epsilon, delta, m, K, T), recomputed on the node (Opacus);
    0 for the algorithms without noise."""
    return node_settings(config).noise_multiplier(population_size)


def node_noise_share_std(config: RunConfig, population_size: int, num_nodes: int) -> float:
    """The std this node's noise share has in a round with ``num_nodes`` member nodes:
    :func:`~fedparity.mechanisms.crypto.secure_sum.noise_share_std` of (``C``, the node's own
    ``sigma``, ``n_min``) with distributed noise, 0 with central noise or without noise (FL,
    FL + Clip, FFL, FFL + Clip)."""
    return node_settings(config).noise_share_std(population_size, num_nodes)


def node_contribution(
    config: RunConfig,
    shard: FPFLShard,
    weights: NDArray[np.floating],
    *,
    sample_rate: float,
    noise_share_std: float,
    rng: np.random.Generator,
) -> NDArray[np.float64]:
    """:func:`~fedparity.clients.fpfl_node.cohort_contribution` of the project app's model
    (``fpfl-architecture``) with ``weights``."""
    from ..fpfl_task import build_model_for, set_flat_parameters

    model = build_model_for(
        config.fpfl_architecture,
        shard.features.shape[1:],
        num_classes=shard.num_classes,
        seed=config.seed,
    )
    set_flat_parameters(model, np.asarray(weights, dtype=np.float64))
    return cohort_contribution(
        model,
        shard,
        constraint=config.fpfl_constraint,
        clipping_bound=config.fpfl_clipping_bound if config.fpfl_clips else None,
        sample_rate=sample_rate,
        noise_share_std=noise_share_std,
        rng=rng,
    )
