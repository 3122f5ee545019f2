"""Which users a node hosts: :func:`load_partition` dispatches between the embedded populations."""

from __future__ import annotations

import os

from ....mechanisms.validation import check_int_at_least
from .adult import ADULT_FILES, adult_partition
from .shards import DATASETS, SPLITS, UserShard, _check_choice, _check_partition
from .synthetic import synthetic_partition

__all__ = ["ADULT_DIR_ENV", "load_partition"]

#: Environment variable naming the UCI Adult folder when ``data_dir`` is empty.
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
    users_per_node = check_int_at_least("users_per_node", users_per_node, 1)
    num_groups = check_int_at_least("num_groups", num_groups, 2)
    split = _check_choice("split", split, SPLITS)
    seed = check_int_at_least("seed", seed, 0)
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
