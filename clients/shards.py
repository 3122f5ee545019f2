"""A node's users: :class:`UserShard` and the argument checks every population shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..mechanisms.validation import check_int

SPLITS: tuple[str, ...] = ("train", "test")

# --------------------------------------------------------------------------------------------
# UserShard
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserShard:
    """The samples of the users hosted by one node.

    Attributes
    ----------
    features : float32 array, shape (num_samples, num_features)
    labels : int64 array, shape (num_samples,), values in {0, 1}
    user_index : int64 array, shape (num_samples,)
        Local index ``0 .. num_users - 1`` of the user owning each sample.
    user_groups : int64 array, shape (num_users,)
        Protected group (>= 0) of each local user.
    user_ids : int64 array, shape (num_users,)
        Global, population-wide unique id of each local user.
    """

    features: NDArray[np.float32]
    labels: NDArray[np.int64]
    user_index: NDArray[np.int64]
    user_groups: NDArray[np.int64]
    user_ids: NDArray[np.int64]

    def __post_init__(self) -> None:
        _check_array("features", self.features, np.float32, ndim=2)
        num_samples = self.features.shape[0]
        _check_array("labels", self.labels, np.int64, ndim=1, length=num_samples)
        _check_array("user_index", self.user_index, np.int64, ndim=1, length=num_samples)
        _check_array("user_groups", self.user_groups, np.int64, ndim=1)
        num_users = self.user_groups.shape[0]
        _check_array("user_ids", self.user_ids, np.int64, ndim=1, length=num_users)
        if num_samples and not np.isin(self.labels, (0, 1)).all():
            raise ValueError("labels must contain only 0 and 1")
        if num_samples and (self.user_index.min() < 0 or self.user_index.max() >= num_users):
            raise ValueError(f"user_index values must lie in [0, num_users={num_users})")
        if num_users and self.user_groups.min() < 0:
            raise ValueError("user_groups must be >= 0")
        if np.unique(self.user_ids).shape[0] != num_users:
            raise ValueError("user_ids must be unique")
        if not np.isfinite(self.features).all():
            raise ValueError("features must be finite")

    @property
    def num_users(self) -> int:
        """Number of users in the shard."""
        return int(self.user_groups.shape[0])

    @property
    def num_samples(self) -> int:
        """Number of samples (rows) in the shard."""
        return int(self.features.shape[0])

    @property
    def num_features(self) -> int:
        """Number of input features."""
        return int(self.features.shape[1])


def _check_array(
    name: str,
    value: object,
    dtype: type[np.generic],
    *,
    ndim: int,
    length: int | None = None,
) -> None:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {value.shape}")
    if length is not None and value.shape[0] != length:
        raise ValueError(f"{name} must have {length} rows, got shape {value.shape}")


def concat_shards(shards: Sequence[UserShard]) -> UserShard:
    """Concatenate shards with disjoint users into one shard.

    Local user indices of later shards are offset so that they stay distinct; ``user_ids`` must
    be disjoint across the inputs (checked by :class:`UserShard`).
    """
    if len(shards) == 0:
        raise ValueError("shards must contain at least one UserShard")
    num_features = {shard.num_features for shard in shards}
    if len(num_features) != 1:
        raise ValueError(f"shards must share num_features, got {sorted(num_features)}")
    offsets = np.cumsum([0] + [shard.num_users for shard in shards[:-1]])
    return UserShard(
        features=np.concatenate([shard.features for shard in shards]),
        labels=np.concatenate([shard.labels for shard in shards]),
        user_index=np.concatenate(
            [shard.user_index + offset for shard, offset in zip(shards, offsets, strict=True)]
        ).astype(np.int64),
        user_groups=np.concatenate([shard.user_groups for shard in shards]),
        user_ids=np.concatenate([shard.user_ids for shard in shards]),
    )


# --------------------------------------------------------------------------------------------
# Argument checks (ValueError naming the parameter and the allowed values)
# --------------------------------------------------------------------------------------------


def _check_partition(partition_id: object, num_partitions: object) -> tuple[int, int]:
    num_partitions = check_int("num_partitions", num_partitions, minimum=1)
    partition_id = check_int("partition_id", partition_id, minimum=0, maximum=num_partitions - 1)
    return partition_id, num_partitions


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value
