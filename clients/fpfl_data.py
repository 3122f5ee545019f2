"""FPFL's users: :class:`FPFLShard`, the samples of some users, each sample with its own group.

FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021
(Rodriguez-Galvez et al. 2021).

Unlike the LDP audit's :class:`~fedparity.clients.shards.UserShard` (one group per user, binary
labels), FPFL needs a group *per sample* and multi-class labels, so its users are
:class:`FPFLShard` objects. A Flower node hosts a shard of users (many in simulation, one on a
device); :meth:`FPFLShard.select_users` cuts out a cohort and :meth:`FPFLShard.partition` a
node's share. The project app's populations (synthetic, Adult, unfair digits) are in
:mod:`fedparity.clients.project.fpfl_data`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..mechanisms._deprecated import moved_names
from ..mechanisms.validation import check_int
from .shards import UserShard

__all__ = ["FPFLShard", "check_groups_present", "users_as_fpfl_shard"]

# --------------------------------------------------------------------------------------------
# FPFLShard
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FPFLShard:
    """The samples of some users, each sample with its own protected group.

    Attributes
    ----------
    features : float32 array, shape (num_samples, ...)
        Model inputs (a feature vector, or an image ``(channels, height, width)``).
    labels : int64 array, shape (num_samples,)
        Classes in ``[0, num_classes)``.
    groups : int64 array, shape (num_samples,)
        Protected group of every sample, in ``[0, num_groups)``.
    user_index : int64 array, shape (num_samples,)
        Local user ``0 .. num_users - 1`` owning every sample.
    user_ids : int64 array, shape (num_users,)
        Population-wide id of every local user (unique).
    num_groups : int
        Number of groups (>= 2); groups may be absent from a shard.
    num_classes : int
        Number of classes (>= 2).
    """

    features: NDArray[np.float32]
    labels: NDArray[np.int64]
    groups: NDArray[np.int64]
    user_index: NDArray[np.int64]
    user_ids: NDArray[np.int64]
    num_groups: int
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.features, np.ndarray) or self.features.dtype != np.float32:
            raise ValueError("features must be a float32 numpy array")
        if self.features.ndim < 2:
            raise ValueError(f"features must have >= 2 dimensions, got {self.features.shape}")
        n = self.features.shape[0]
        for name in ("labels", "groups", "user_index"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.shape != (n,):
                raise ValueError(f"{name} must be an int64 array of shape ({n},)")
        if not isinstance(self.user_ids, np.ndarray) or self.user_ids.dtype != np.int64:
            raise ValueError("user_ids must be an int64 array")
        if self.user_ids.ndim != 1 or np.unique(self.user_ids).size != self.user_ids.size:
            raise ValueError("user_ids must be a 1-D array of unique ids")
        for name in ("num_groups", "num_classes"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=2))
        for name, high in (
            ("labels", self.num_classes),
            ("groups", self.num_groups),
            ("user_index", self.num_users),
        ):
            value = getattr(self, name)
            if n and (value.min() < 0 or value.max() >= high):
                raise ValueError(f"{name} must be in [0, {high})")
        if not np.all(np.isfinite(self.features)):
            raise ValueError("features must be finite")

    @property
    def num_users(self) -> int:
        """Number of users."""
        return int(self.user_ids.shape[0])

    @property
    def num_samples(self) -> int:
        """Number of samples."""
        return int(self.labels.shape[0])

    def samples_per_user(self) -> NDArray[np.int64]:
        """Number of samples of every local user."""
        return np.bincount(self.user_index, minlength=self.num_users).astype(np.int64)

    def select_users(self, users: Sequence[int] | NDArray[np.integer]) -> FPFLShard:
        """The shard of the local users ``users`` (distinct), renumbered ``0 .. len - 1`` in
        the given order; samples keep their relative order."""
        chosen = np.asarray(users, dtype=np.int64).reshape(-1)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= self.num_users):
            raise ValueError(f"users must be local user indices in [0, {self.num_users})")
        if np.unique(chosen).size != chosen.size:
            raise ValueError("users must be distinct")
        new_index = np.full(self.num_users, -1, dtype=np.int64)
        new_index[chosen] = np.arange(chosen.size, dtype=np.int64)
        mapped = new_index[self.user_index]
        keep = mapped >= 0
        return FPFLShard(
            features=self.features[keep],
            labels=self.labels[keep],
            groups=self.groups[keep],
            user_index=mapped[keep],
            user_ids=self.user_ids[chosen],
            num_groups=self.num_groups,
            num_classes=self.num_classes,
        )

    def partition(self, partition_id: int, num_partitions: int) -> FPFLShard:
        """Node ``partition_id``'s users: ``numpy.array_split`` of the users into
        ``num_partitions`` contiguous blocks (sizes differ by at most one)."""
        num_partitions = check_int("num_partitions", num_partitions, minimum=1)
        partition_id = check_int(
            "partition_id", partition_id, minimum=0, maximum=num_partitions - 1
        )
        blocks = np.array_split(np.arange(self.num_users), num_partitions)
        return self.select_users(blocks[partition_id])


def check_groups_present(
    shard: FPFLShard, *, constraint_samples: NDArray[np.bool_] | None = None
) -> None:
    """Raise ``ValueError`` (naming ``groups``) if a group has no sample in the population.

    ``constraint_samples`` restricts the check to the constraint's sample set ``d'`` (for FNR
    parity: the samples with ``y = 1``): a group without a member there has no ``F_a / n'_a``.
    """
    mask = np.ones(shard.num_samples, dtype=bool)
    if constraint_samples is not None:
        mask = np.asarray(constraint_samples, dtype=bool)
        if mask.shape != (shard.num_samples,):
            raise ValueError(
                f"constraint_samples must have shape ({shard.num_samples},), got {mask.shape}"
            )
    counts = np.bincount(shard.groups[mask], minlength=shard.num_groups)
    missing = np.flatnonzero(counts == 0)
    if missing.size:
        where = "the constraint's samples" if constraint_samples is not None else "the data"
        raise ValueError(
            f"groups: group(s) {missing.tolist()} have no member in {where} "
            f"(num_groups={shard.num_groups}); every group needs at least one sample"
        )


def users_as_fpfl_shard(shard: UserShard, *, num_groups: int) -> FPFLShard:
    """The users of a :class:`~fedparity.clients.shards.UserShard` (one group per user, binary
    labels) as FPFL training users: every sample takes its user's group. The pipeline trains
    on a partition's ``train`` rows and audits the same users on their ``test`` rows, so one
    per-user ledger covers both."""
    return FPFLShard(
        features=np.ascontiguousarray(shard.features, dtype=np.float32),
        labels=shard.labels.astype(np.int64),
        groups=shard.user_groups[shard.user_index].astype(np.int64),
        user_index=shard.user_index.astype(np.int64),
        user_ids=shard.user_ids.astype(np.int64),
        num_groups=num_groups,
        num_classes=2,
    )


# --------------------------------------------------------------------------------------------


# The populations moved to the project app's package (deprecated here).
__getattr__ = moved_names(
    __name__,
    "fedparity.clients.project.fpfl_data",
    (
        "ADULT_MEAN_SAMPLES_PER_USER",
        "BLUE_INK",
        "DIGITS_WRITERS",
        "FEMNIST_SIZE",
        "UNFAIR_FRACTIONS",
        "UNFAIR_GROUP_NAMES",
        "LeafData",
        "adult_fpfl_users",
        "digits_leaf",
        "fpfl_population",
        "load_leaf",
        "synthetic_fpfl_users",
        "unfair_images",
        "unfair_shard",
        "unfair_writer_groups",
    ),
)
