"""User populations for the federated fairness audit.

A Flower node (SuperNode) hosts a *shard* of users: many users per node in simulation, exactly
one user on a real device. Both cases use the same :class:`UserShard`, so the client code path
is identical.

Two populations are available:

* ``"synthetic"`` -- an embedded, seeded population (no download), see
  :func:`synthetic_partition`. The task is deliberately harder for higher-numbered groups, so a
  trained model has a known, clearly non-zero performance gap between groups.
* ``"adult"`` -- the UCI Adult census data split into small single-group users, see
  :func:`load_adult`, :func:`adult_features` and :func:`adult_partition`.

:func:`load_partition` dispatches between them with validated arguments.
"""


from __future__ import annotations

import os

from .adult import (
    ADULT_CATEGORICAL,
    ADULT_COLUMNS,
    ADULT_FILES,
    ADULT_GROUP_ATTRIBUTES,
    ADULT_NUMERIC,
    ADULT_URL,
    AdultData,
    AdultSplit,
    AdultUsers,
    adult_features,
    adult_partition,
    adult_users,
    load_adult,
)
from .holders import HOLDER_SCHEMES, adult_holder, synthetic_holder
from .shards import (
    DATASETS,
    SPLITS,
    UserShard,
    _check_choice,
    _check_int,
    _check_partition,
    concat_shards,
)
from .synthetic import synthetic_class_separation, synthetic_partition

__all__ = [
    "ADULT_CATEGORICAL",
    "ADULT_COLUMNS",
    "ADULT_DIR_ENV",
    "ADULT_FILES",
    "ADULT_GROUP_ATTRIBUTES",
    "ADULT_NUMERIC",
    "ADULT_URL",
    "DATASETS",
    "SPLITS",
    "AdultData",
    "AdultSplit",
    "AdultUsers",
    "UserShard",
    "HOLDER_SCHEMES",
    "adult_features",
    "adult_holder",
    "adult_partition",
    "adult_users",
    "concat_shards",
    "load_adult",
    "load_partition",
    "synthetic_class_separation",
    "synthetic_holder",
    "synthetic_partition",
]

# --------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------

ADULT_DIR_ENV = "FEDPARITY_ADULT_DIR"


def load_partition(
    dataset: str,
    partition_id: int,
    num_partitions: int,
    *,
    users_per_node: int,
    num_groups: int,
    seed: int,
    split: str,
    data_dir: str | None = None,
    download: bool = False,
) -> UserShard:
    """The users of node ``partition_id`` for ``dataset`` in ``'synthetic'``, ``'adult'``.

    ``'synthetic'`` uses :func:`synthetic_partition` (balanced groups, defaults otherwise).
    ``'adult'`` uses :func:`adult_partition` with ``group_attribute='sex'`` (so ``num_groups``
    must be 2); ``data_dir`` ``None`` or ``''`` falls back to the ``FEDPARITY_ADULT_DIR``
    environment variable. Raises ``ValueError`` naming the offending parameter.
    """
    dataset = _check_choice("dataset", dataset, DATASETS)
    partition_id, num_partitions = _check_partition(partition_id, num_partitions)
    users_per_node = _check_int("users_per_node", users_per_node, 1)
    num_groups = _check_int("num_groups", num_groups, 2)
    split = _check_choice("split", split, SPLITS)
    seed = _check_int("seed", seed, 0)
    if dataset == "synthetic":
        return synthetic_partition(
            partition_id,
            num_partitions,
            users_per_node,
            num_groups=num_groups,
            seed=seed,
            split=split,
        )
    if num_groups != 2:
        raise ValueError(
            f"num_groups must be 2 for dataset='adult' (groups: sex), got {num_groups}"
        )
    folder = data_dir or os.environ.get(ADULT_DIR_ENV, "")
    if not folder:
        raise ValueError(
            f"data_dir must name the folder with {', '.join(ADULT_FILES)} for dataset='adult' "
            f"(or set {ADULT_DIR_ENV}), got {data_dir!r}"
        )
    return adult_partition(
        folder,
        partition_id,
        num_partitions,
        users_per_node,
        split,
        seed,
        group_attribute="sex",
        download=download,
    )
