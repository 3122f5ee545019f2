"""The embedded synthetic population (no download): the task is deliberately harder for
higher-numbered groups, so a trained model has a known, clearly non-zero gap."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from ....mechanisms.validation import check_int_at_least
from .shards import SPLITS, UserShard, _check_choice, _check_partition

# --------------------------------------------------------------------------------------------
# Synthetic population
# --------------------------------------------------------------------------------------------

# Separation between the class means (along a unit direction) for the easiest group (0) and the
# hardest group (num_groups - 1); intermediate groups are graded linearly.
_SEPARATION_EASIEST = 3.0
_SEPARATION_HARDEST = 1.5
# Standard deviation of the per-user feature offset (user heterogeneity).
_USER_OFFSET_STD = 0.3
# A user's positive rate is uniform on this interval.
_USER_POSITIVE_RATE = (0.25, 0.75)
# SeedSequence spawn-key tags: one stream for population-wide parameters, one per
# (partition, user attributes) and one per (partition, split) for samples.
_TAG_GLOBAL, _TAG_USERS, _TAG_SAMPLES = 0, 1, 2
_SPLIT_CODE = {"train": 0, "test": 1}


#: Samples per block of the feature computation (bounded temporaries, the same values).
_SAMPLE_BLOCK = 1 << 16


def synthetic_class_separation(num_groups: int) -> NDArray[np.float64]:
    """Default per-group class separation: 3.0 for group 0 down to 1.5 for the last group."""
    num_groups = check_int_at_least("num_groups", num_groups, 2)
    return np.linspace(_SEPARATION_EASIEST, _SEPARATION_HARDEST, num_groups)


def synthetic_partition(
    partition_id: int,
    num_partitions: int,
    users_per_node: int,
    num_groups: int = 2,
    seed: int = 42,
    split: str = "train",
    group_fractions: Sequence[float] | None = None,
    samples_per_user: int = 16,
    num_features: int = 8,
    *,
    class_separation: Sequence[float] | None = None,
) -> UserShard:
    """Users ``partition_id * users_per_node ...`` of the embedded synthetic population.

    Generating model (all randomness from ``numpy.random.SeedSequence``, no global RNG):

    * Population-wide, from ``(seed,)``: a unit direction ``w`` in ``R^num_features``.
    * Per partition, from ``(seed, partition_id)`` -- shared by both splits, so a user's train
      and test samples come from the same distribution:

      - group ``g_u``: systematic sampling of ``group_fractions`` (default balanced) with a
        random start, then shuffled. Each group gets ``floor`` or ``ceil`` of
        ``users_per_node * fraction`` users and the expected count is exact, also for
        ``users_per_node = 1`` (a real device draws its group with probability ``fraction``);
      - user offset ``b_u ~ N(0, 0.3^2 I)`` (heterogeneity between users);
      - user positive rate ``pi_u ~ Uniform(0.25, 0.75)``.

    * Per ``(seed, partition_id, split)``: each user gets ``samples_per_user`` samples, of which
      ``clip(Binomial(samples_per_user, pi_u), 1, samples_per_user - 1)`` are positive (so every
      user has >= 1 positive and >= 1 negative sample in each split) and features::

          x = b_u + (y - 1/2) * delta[g_u] * w + N(0, I)

    ``delta`` (``class_separation``) decreases with the group, by default linearly from 3.0
    (group 0) to 1.5 (group ``num_groups - 1``). Along ``w`` the Bayes accuracy of group ``g`` is
    ``Phi(delta_g / (2 * sqrt(1 + 0.3^2)))``: about 0.92 for group 0 and 0.76 for group 1 when
    ``num_groups = 2``, so a shared logistic regression shows an accuracy/TPR gap of ~0.15 with
    group 1 worse. Pass equal separations for a population without a gap (null case).

    Users are disjoint across partitions (global ``user_ids``
    ``partition_id * users_per_node + 0 .. users_per_node - 1``) and a partition is identical
    whichever other partitions are generated. Samples are grouped by user.
    """
    partition_id, num_partitions = _check_partition(partition_id, num_partitions)
    users_per_node = check_int_at_least("users_per_node", users_per_node, 1)
    num_groups = check_int_at_least("num_groups", num_groups, 2)
    seed = check_int_at_least("seed", seed, 0)
    split = _check_choice("split", split, SPLITS)
    samples_per_user = check_int_at_least("samples_per_user", samples_per_user, 2)
    num_features = check_int_at_least("num_features", num_features, 1)
    fractions = _check_fractions(group_fractions, num_groups)
    separation = _check_separation(class_separation, num_groups)

    global_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_GLOBAL,)))
    direction = global_rng.standard_normal(num_features)
    direction /= np.linalg.norm(direction)

    user_rng = np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(_TAG_USERS, partition_id))
    )
    user_groups = _systematic_groups(user_rng, users_per_node, fractions)
    user_offsets = user_rng.normal(0.0, _USER_OFFSET_STD, size=(users_per_node, num_features))
    user_positive_rate = user_rng.uniform(*_USER_POSITIVE_RATE, size=users_per_node)

    sample_rng = np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(_TAG_SAMPLES, partition_id, _SPLIT_CODE[split]))
    )
    num_positives = np.clip(
        sample_rng.binomial(samples_per_user, user_positive_rate), 1, samples_per_user - 1
    )
    user_index = np.repeat(np.arange(users_per_node, dtype=np.int64), samples_per_user)
    position_in_user = np.tile(np.arange(samples_per_user), users_per_node)
    labels = (position_in_user < num_positives[user_index]).astype(np.int64)
    # Shuffle samples within each user (users stay contiguous).
    order = np.lexsort((sample_rng.random(len(labels)), user_index))
    labels = labels[order]
    del order, position_in_user
    signed_separation = (labels - 0.5) * separation[user_groups[user_index]]
    # In blocks of samples: the same draws, sums and rounding as one whole-array expression
    # (the normal draws are sequential in the generator's stream), without its float64
    # temporaries of samples x features (about 3.9 KB a user at 16 samples of 8 features).
    features = np.empty((labels.shape[0], num_features), dtype=np.float32)
    for start in range(0, labels.shape[0], _SAMPLE_BLOCK):
        rows = slice(start, start + _SAMPLE_BLOCK)
        noise = sample_rng.standard_normal((features[rows].shape[0], num_features))
        block = user_offsets[user_index[rows]]
        block += signed_separation[rows, None] * direction[None, :]
        block += noise
        features[rows] = block

    return UserShard(
        features=features,
        labels=labels,
        user_index=user_index,
        user_groups=user_groups,
        user_ids=partition_id * users_per_node + np.arange(users_per_node, dtype=np.int64),
    )


def _check_fractions(
    group_fractions: Sequence[float] | None, num_groups: int
) -> NDArray[np.float64]:
    if group_fractions is None:
        return np.full(num_groups, 1.0 / num_groups)
    fractions = np.asarray(group_fractions, dtype=np.float64)
    if (
        fractions.shape != (num_groups,)
        or not np.isfinite(fractions).all()
        or (fractions < 0).any()
        or not math.isclose(float(fractions.sum()), 1.0, abs_tol=1e-6)
    ):
        raise ValueError(
            f"group_fractions must be {num_groups} finite non-negative numbers summing to 1, "
            f"got {group_fractions!r}"
        )
    return fractions / fractions.sum()


def _check_separation(
    class_separation: Sequence[float] | None, num_groups: int
) -> NDArray[np.float64]:
    if class_separation is None:
        return synthetic_class_separation(num_groups)
    separation = np.asarray(class_separation, dtype=np.float64)
    if separation.shape != (num_groups,) or not np.isfinite(separation).all():
        raise ValueError(
            f"class_separation must be {num_groups} finite numbers, got {class_separation!r}"
        )
    return separation


def _systematic_groups(
    rng: np.random.Generator, num_users: int, fractions: NDArray[np.float64]
) -> NDArray[np.int64]:
    """Groups by systematic sampling: counts are floor/ceil of ``num_users * fractions``."""
    positions = (np.arange(num_users) + rng.random()) / num_users
    boundaries = np.cumsum(fractions)[:-1]
    groups = np.searchsorted(boundaries, positions, side="right").astype(np.int64)
    return rng.permutation(groups)
