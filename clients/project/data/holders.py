"""FedEvalFair data holders: every row is its own user (Adult by doctorate or a Dirichlet
label skew, or the synthetic population)."""

from __future__ import annotations

import math
import os

import numpy as np
from numpy.typing import NDArray

from ....mechanisms.validation import check_int_at_least
from .adult import _adult_features_cached, load_adult
from .shards import SPLITS, UserShard, _check_choice, _check_partition
from .synthetic import synthetic_partition

# --------------------------------------------------------------------------------------------
# Data holders (FedEvalFair): a node holds a whole dataset, every row is its own "user"
# --------------------------------------------------------------------------------------------

HOLDER_SCHEMES: tuple[str, ...] = ("doctorate", "dirichlet")
_HOLDER_ID_STRIDE = 1_000_000_000


def _rows_as_users(
    features: NDArray[np.float32],
    labels: NDArray[np.int64],
    row_groups: NDArray[np.int64],
    partition_id: int,
) -> UserShard:
    count = int(labels.shape[0])
    return UserShard(
        features=np.ascontiguousarray(features, dtype=np.float32),
        labels=np.asarray(labels, dtype=np.int64),
        user_index=np.arange(count, dtype=np.int64),
        user_groups=np.asarray(row_groups, dtype=np.int64),
        user_ids=partition_id * _HOLDER_ID_STRIDE + np.arange(count, dtype=np.int64),
    )


def _dirichlet_assignment(
    labels: NDArray[np.int64], num_partitions: int, alpha: float, seed: int, split: str
) -> NDArray[np.int64]:
    """Holder of every row: per label class, shares ~ Dirichlet(alpha) over the holders.

    The shares come from ``(seed,)`` only (the same for both splits, so a holder's train and
    test data follow the same skew); rows are dealt from a permutation seeded by the split.
    """
    return dirichlet_owners(
        labels,
        2,
        num_partitions,
        alpha,
        share_rng=np.random.default_rng(np.random.SeedSequence([seed, 7_331])),
        deal_rng=np.random.default_rng(np.random.SeedSequence([seed, 7_332, SPLITS.index(split)])),
    )


def dirichlet_owners(
    categories: NDArray[np.int64],
    num_categories: int,
    num_partitions: int,
    alpha: float,
    *,
    share_rng: np.random.Generator,
    deal_rng: np.random.Generator,
) -> NDArray[np.int64]:
    """The partition of every item: per category ``c`` in ``range(num_categories)``, shares
    ``~ Dirichlet(alpha 1)`` over the partitions (from ``share_rng``), and the category's items
    dealt from a permutation (``deal_rng``) in those shares (the usual non-IID split of
    federated benchmarks; smaller ``alpha``, more skew)."""
    owner = np.empty(categories.shape[0], dtype=np.int64)
    for category in range(num_categories):
        shares = share_rng.dirichlet(np.full(num_partitions, alpha))
        items = deal_rng.permutation(np.flatnonzero(categories == category))
        cuts = np.round(np.cumsum(shares)[:-1] * items.size).astype(np.int64)
        for partition, chunk in enumerate(np.split(items, cuts)):
            owner[chunk] = partition
    return owner


def adult_holder(
    data_dir: str | os.PathLike[str],
    partition_id: int,
    num_partitions: int,
    split: str,
    *,
    scheme: str = "dirichlet",
    seed: int = 42,
    dirichlet_alpha: float = 1.0,
    download: bool = False,
) -> UserShard:
    """Data holder ``partition_id`` of Adult for FedEvalFair (the paper's Adult setting).

    The paper: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
    Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
    version), Section 5.1.1.

    Every row is its own user and its group is race: 0 = White, 1 = any other race (the
    paper's sensitive attribute, "a focus on White individuals").

    * ``scheme="doctorate"``: two holders, 0 = rows with education ``Doctorate``, 1 = all
      others (the paper's split; ``num_partitions`` must be 2).
    * ``scheme="dirichlet"``: ``num_partitions`` holders with label-skewed shares
      ~ Dirichlet(``dirichlet_alpha``) per class, deterministic from ``seed``.
    """
    partition_id, num_partitions = _check_partition(partition_id, num_partitions)
    scheme = _check_choice("scheme", scheme, HOLDER_SCHEMES)
    split = _check_choice("split", split, SPLITS)
    if not (math.isfinite(dirichlet_alpha) and dirichlet_alpha > 0):
        raise ValueError(f"dirichlet_alpha must be a finite number > 0, got {dirichlet_alpha!r}")
    adult = load_adult(data_dir, download=download)
    x_train, y_train, x_test, y_test, _, protected = _adult_features_cached(adult)
    features, labels = (x_train, y_train) if split == "train" else (x_test, y_test)
    columns = protected[split]
    groups = (1 - columns["race_white"]).astype(np.int64)
    if scheme == "doctorate":
        if num_partitions != 2:
            raise ValueError(
                f"num_partitions must be 2 for scheme='doctorate', got {num_partitions}"
            )
        doctorate = columns["education"] == "Doctorate"
        mine = doctorate if partition_id == 0 else ~doctorate
    else:
        mine = _dirichlet_assignment(labels, num_partitions, dirichlet_alpha, seed, split) == (
            partition_id
        )
    return _rows_as_users(features[mine], labels[mine], groups[mine], partition_id)


def synthetic_holder(
    partition_id: int,
    num_partitions: int,
    split: str,
    *,
    rows_per_holder: int = 4000,
    seed: int = 42,
) -> UserShard:
    """A synthetic data holder: the samples of :func:`synthetic_partition`'s users, each row
    its own user with its user's group (2 groups; the task is harder for group 1, so a
    trained model has an equal-opportunity gap)."""
    rows_per_holder = check_int_at_least("rows_per_holder", rows_per_holder, 16)
    samples_per_user = 16
    shard = synthetic_partition(
        partition_id,
        num_partitions,
        max(rows_per_holder // samples_per_user, 1),
        num_groups=2,
        seed=seed,
        split=split,
        samples_per_user=samples_per_user,
    )
    return _rows_as_users(
        shard.features, shard.labels, shard.user_groups[shard.user_index], partition_id
    )
