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

import functools
import math
import os
import shutil
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray

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

DATASETS: tuple[str, ...] = ("synthetic", "adult")
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


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_partition(partition_id: object, num_partitions: object) -> tuple[int, int]:
    num_partitions = _check_int("num_partitions", num_partitions, 1)
    if (
        isinstance(partition_id, bool)
        or not isinstance(partition_id, (int, np.integer))
        or not 0 <= partition_id < num_partitions
    ):
        raise ValueError(
            f"partition_id must be an integer in [0, num_partitions={num_partitions}), "
            f"got {partition_id!r}"
        )
    return int(partition_id), num_partitions


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


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


def synthetic_class_separation(num_groups: int) -> NDArray[np.float64]:
    """Default per-group class separation: 3.0 for group 0 down to 1.5 for the last group."""
    num_groups = _check_int("num_groups", num_groups, 2)
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
    users_per_node = _check_int("users_per_node", users_per_node, 1)
    num_groups = _check_int("num_groups", num_groups, 2)
    seed = _check_int("seed", seed, 0)
    split = _check_choice("split", split, SPLITS)
    samples_per_user = _check_int("samples_per_user", samples_per_user, 2)
    num_features = _check_int("num_features", num_features, 1)
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
    order = np.lexsort((sample_rng.random(labels.shape[0]), user_index))
    labels = labels[order]
    noise = sample_rng.standard_normal((labels.shape[0], num_features))
    signed_separation = (labels - 0.5) * separation[user_groups[user_index]]
    features = user_offsets[user_index] + signed_separation[:, None] * direction[None, :] + noise

    return UserShard(
        features=features.astype(np.float32),
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


# --------------------------------------------------------------------------------------------
# UCI Adult
# --------------------------------------------------------------------------------------------

ADULT_URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"
ADULT_FILES: tuple[str, str] = ("adult.data", "adult.test")
ADULT_COLUMNS: tuple[str, ...] = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
)
ADULT_NUMERIC: tuple[str, ...] = (
    "age",
    "fnlwgt",
    "education-num",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
)
# The 7 standard categorical features; ``sex`` is excluded because it is the usual protected
# group (it is still available through ``protected``).
ADULT_CATEGORICAL: tuple[str, ...] = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "native-country",
)
_ADULT_LABELS = {"<=50K": 0, ">50K": 1}
# Group attributes of adult_partition: sex (1 = Female) or race (1 = non-White).
ADULT_GROUP_ATTRIBUTES: tuple[str, ...] = ("sex", "race")


@dataclass(frozen=True, eq=False)
class AdultSplit:
    """Raw columns of one Adult file (``adult.data`` or ``adult.test``).

    ``columns`` maps every name of :data:`ADULT_COLUMNS` to a read-only array: float64 for the
    numeric columns, str for the others (``'?'`` kept as its own value). ``income`` is
    ``'>50K'`` or ``'<=50K'`` (a trailing ``'.'``, as in ``adult.test``, is removed).
    """

    columns: Mapping[str, NDArray[np.generic]]

    @property
    def num_rows(self) -> int:
        """Number of rows."""
        return int(self.columns["income"].shape[0])

    @property
    def labels(self) -> NDArray[np.int64]:
        """Binary label: 1 for income ``>50K``."""
        return (self.columns["income"] == ">50K").astype(np.int64)


@dataclass(frozen=True, eq=False)
class AdultData:
    """The UCI Adult train (``adult.data``) and test (``adult.test``) splits."""

    train: AdultSplit
    test: AdultSplit
    source_dir: Path


def load_adult(
    data_dir: str | os.PathLike[str],
    *,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    source_url: str = ADULT_URL,
) -> AdultData:
    """Read ``adult.data`` and ``adult.test`` (UCI format) from ``data_dir``.

    Format tolerated: comma-separated fields with optional spaces, no header; an optional first
    line ``|1x3 Cross validator`` (any line starting with ``'|'`` is skipped); labels with or
    without a trailing ``'.'``; blank lines skipped; ``'?'`` kept as a category.

    If the files are not in ``data_dir`` (nor in ``cache_dir`` when given): with
    ``download=False`` raise ``FileNotFoundError``; with ``download=True`` fetch them from
    ``source_url`` (default :data:`ADULT_URL`, UCI) into ``cache_dir`` (default ``data_dir``)
    and read them from there.
    Parsed files are cached in memory per folder and modification time.
    """
    data_path = Path(data_dir).expanduser()
    candidates = [data_path] if cache_dir is None else [data_path, Path(cache_dir).expanduser()]
    for folder in candidates:
        if all((folder / name).is_file() for name in ADULT_FILES):
            return _read_adult_cached(*_cache_key(folder))
    if not download:
        searched = " or ".join(f"'{folder}'" for folder in candidates)
        raise FileNotFoundError(
            f"UCI Adult files {', '.join(ADULT_FILES)} not found in {searched}; pass "
            f"download=True (config 'download = true') to fetch them from {ADULT_URL}, or point "
            "data_dir at a folder containing them"
        )
    target = candidates[-1]
    _download_adult(target, source_url)
    return _read_adult_cached(*_cache_key(target))


def _download_adult(target: Path, source_url: str = ADULT_URL) -> None:
    """Fetch the missing Adult files into ``target`` (written atomically via a ``.part`` file)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ADULT_FILES:
        destination = target / name
        if destination.is_file():
            continue
        partial = target / f"{name}.part"
        with urllib.request.urlopen(source_url.rstrip("/") + "/" + name, timeout=60) as response:
            with open(partial, "wb") as out:
                shutil.copyfileobj(response, out)
        os.replace(partial, destination)


def _cache_key(folder: Path) -> tuple[str, int, int]:
    train_file, test_file = (folder / name for name in ADULT_FILES)
    return str(folder.resolve()), train_file.stat().st_mtime_ns, test_file.stat().st_mtime_ns


@functools.lru_cache(maxsize=4)
def _read_adult_cached(folder: str, train_mtime: int, test_mtime: int) -> AdultData:
    del train_mtime, test_mtime  # part of the cache key only
    folder_path = Path(folder)
    train_file, test_file = (folder_path / name for name in ADULT_FILES)
    return AdultData(
        train=_parse_adult_file(train_file),
        test=_parse_adult_file(test_file),
        source_dir=folder_path,
    )


def _parse_adult_file(path: Path) -> AdultSplit:
    rows: list[list[str]] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith("|"):
                continue
            fields = [field.strip() for field in stripped.split(",")]
            if len(fields) != len(ADULT_COLUMNS):
                raise ValueError(
                    f"{path}:{line_number}: expected {len(ADULT_COLUMNS)} comma-separated "
                    f"fields, got {len(fields)}"
                )
            label = fields[-1].removesuffix(".")
            if label not in _ADULT_LABELS:
                raise ValueError(
                    f"{path}:{line_number}: income must be '>50K' or '<=50K' (optionally with "
                    f"a trailing '.'), got {fields[-1]!r}"
                )
            fields[-1] = label
            rows.append(fields)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    table = np.array(rows, dtype=str).reshape(len(rows), len(ADULT_COLUMNS))
    columns: dict[str, NDArray[np.generic]] = {}
    for position, name in enumerate(ADULT_COLUMNS):
        column = table[:, position]
        if name in ADULT_NUMERIC:
            try:
                column = column.astype(np.float64)
            except ValueError as error:
                raise ValueError(f"{path}: non-numeric value in column {name!r}: {error}") from None
        else:
            column = np.array(column.tolist(), dtype=str)  # narrowest string width
        column.flags.writeable = False
        columns[name] = column
    return AdultSplit(columns=MappingProxyType(columns))


AdultProtected = dict[str, dict[str, NDArray[np.generic]]]


def adult_features(
    adult: AdultData,
) -> tuple[
    NDArray[np.float32],
    NDArray[np.int64],
    NDArray[np.float32],
    NDArray[np.int64],
    list[str],
    AdultProtected,
]:
    """Model inputs for Adult, fitted on the training split only.

    Returns ``(X_train, y_train, X_test, y_test, feature_names, protected)``:

    * the 6 numeric columns (:data:`ADULT_NUMERIC`) standardised with the *training* mean and
      standard deviation (population std; a constant column is only centred), followed by
    * one-hot encodings of the 7 categorical columns (:data:`ADULT_CATEGORICAL`, ``sex``
      excluded) over the categories seen in training, sorted, ``'?'`` included; an unseen test
      category encodes as all zeros. Names are ``'column=value'``.
    * ``y = 1`` for income ``>50K``.
    * ``protected[split]`` for ``split`` in ``'train'``, ``'test'``: ``'sex'`` (int64, 0 = Male,
      1 = Female), ``'race_white'`` (int64, 1 if race is White) and ``'education'`` (str).
    """
    train, test = adult.train.columns, adult.test.columns
    feature_names: list[str] = list(ADULT_NUMERIC)
    train_blocks: list[NDArray[np.float64]] = []
    test_blocks: list[NDArray[np.float64]] = []
    for name in ADULT_NUMERIC:
        mean = float(train[name].mean())
        std = float(train[name].std())
        scale = std if std > 0 else 1.0
        train_blocks.append(((train[name] - mean) / scale)[:, None])
        test_blocks.append(((test[name] - mean) / scale)[:, None])
    for name in ADULT_CATEGORICAL:
        categories = np.unique(train[name])
        feature_names.extend(f"{name}={category}" for category in categories)
        train_blocks.append(_one_hot(train[name], categories))
        test_blocks.append(_one_hot(test[name], categories))
    protected = {
        "train": _adult_protected(adult.train),
        "test": _adult_protected(adult.test),
    }
    return (
        np.hstack(train_blocks).astype(np.float32),
        adult.train.labels,
        np.hstack(test_blocks).astype(np.float32),
        adult.test.labels,
        feature_names,
        protected,
    )


@functools.lru_cache(maxsize=2)
def _adult_features_cached(
    adult: AdultData,
) -> tuple[
    NDArray[np.float32],
    NDArray[np.int64],
    NDArray[np.float32],
    NDArray[np.int64],
    list[str],
    AdultProtected,
]:
    """:func:`adult_features` memoised per (in-memory cached) ``AdultData`` object."""
    return adult_features(adult)


def _one_hot(values: NDArray[np.generic], categories: NDArray[np.generic]) -> NDArray[np.float64]:
    positions = np.searchsorted(categories, values)
    clipped = np.minimum(positions, categories.shape[0] - 1)
    known = categories[clipped] == values
    encoded = np.zeros((values.shape[0], categories.shape[0]), dtype=np.float64)
    encoded[np.flatnonzero(known), clipped[known]] = 1.0
    return encoded


def _adult_protected(split: AdultSplit) -> dict[str, NDArray[np.generic]]:
    sex = split.columns["sex"]
    unknown = set(np.unique(sex)) - {"Male", "Female"}
    if unknown:
        raise ValueError(f"sex must be 'Male' or 'Female', found {sorted(unknown)}")
    return {
        "sex": (sex == "Female").astype(np.int64),
        "race_white": (split.columns["race"] == "White").astype(np.int64),
        "education": np.array(split.columns["education"]),
    }


@dataclass(frozen=True, eq=False)
class AdultUsers:
    """The Adult user population: rows of every user, indexed by global user id.

    Attributes
    ----------
    user_groups : int64 array, shape (num_users,)
        Group of global user ``u``.
    train_rows, test_rows : tuple of int64 arrays
        ``train_rows[u]`` / ``test_rows[u]``: row numbers of user ``u`` in ``adult.data`` /
        ``adult.test``.
    """

    user_groups: NDArray[np.int64]
    train_rows: tuple[NDArray[np.int64], ...]
    test_rows: tuple[NDArray[np.int64], ...]

    @property
    def num_users(self) -> int:
        """Number of users in the population."""
        return int(self.user_groups.shape[0])

    def rows(self, split: str) -> tuple[NDArray[np.int64], ...]:
        """Rows per user of ``split`` (``'train'`` or ``'test'``)."""
        return (
            self.train_rows if _check_choice("split", split, SPLITS) == "train" else self.test_rows
        )


def adult_users(
    adult: AdultData, *, seed: int, group_attribute: str = "sex", samples_per_user: int = 4
) -> AdultUsers:
    """Split the Adult rows into single-group users, deterministically from ``seed``.

    * group attribute: ``'sex'`` (group 0 = Male, 1 = Female) or ``'race'`` (group 0 = White,
      1 = non-White);
    * per group, the shuffled *test* rows are cut into users of exactly ``samples_per_user``
      rows (the ``< samples_per_user`` leftover rows are unused) and the shuffled *train* rows of
      the same group are dealt to the same users as evenly as possible (about twice as many,
      since ``adult.data`` is twice ``adult.test``). A user thus has one group, and the same id
      and group in both splits;
    * the users of all groups are shuffled into one global order (the global user id).

    With ``samples_per_user = 4`` and ``'sex'`` there are 4,070 users (2,715 male, 1,355 female),
    each with 4 test rows and 7-9 train rows.
    """
    seed = _check_int("seed", seed, 0)
    group_attribute = _check_choice("group_attribute", group_attribute, ADULT_GROUP_ATTRIBUTES)
    samples_per_user = _check_int("samples_per_user", samples_per_user, 1)
    protected = {"train": _adult_protected(adult.train), "test": _adult_protected(adult.test)}
    row_groups = {name: _adult_groups(protected[name], group_attribute) for name in SPLITS}

    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_GLOBAL, 1)))
    group_parts: list[NDArray[np.int64]] = []
    train_rows: list[NDArray[np.int64]] = []
    test_rows: list[NDArray[np.int64]] = []
    for group in (0, 1):
        group_test_rows = rng.permutation(np.flatnonzero(row_groups["test"] == group))
        group_train_rows = rng.permutation(np.flatnonzero(row_groups["train"] == group))
        num_group_users = group_test_rows.shape[0] // samples_per_user
        if num_group_users == 0:
            continue
        group_parts.append(np.full(num_group_users, group, dtype=np.int64))
        test_rows.extend(
            group_test_rows[: num_group_users * samples_per_user].reshape(num_group_users, -1)
        )
        train_rows.extend(np.array_split(group_train_rows, num_group_users))
    user_groups = np.concatenate(group_parts) if group_parts else np.zeros(0, dtype=np.int64)
    order = rng.permutation(user_groups.shape[0])  # global user id -> built user
    return AdultUsers(
        user_groups=user_groups[order],
        train_rows=tuple(train_rows[user].astype(np.int64) for user in order),
        test_rows=tuple(test_rows[user].astype(np.int64) for user in order),
    )


@functools.lru_cache(maxsize=4)
def _adult_users_cached(
    adult: AdultData, seed: int, group_attribute: str, samples_per_user: int
) -> AdultUsers:
    return adult_users(
        adult, seed=seed, group_attribute=group_attribute, samples_per_user=samples_per_user
    )


def adult_partition(
    data_dir: str | os.PathLike[str],
    partition_id: int,
    num_partitions: int,
    users_per_node: int,
    split: str,
    seed: int,
    group_attribute: str = "sex",
    samples_per_user: int = 4,
    *,
    download: bool = False,
) -> UserShard:
    """Users ``partition_id * users_per_node ...`` of the Adult user population.

    The population is built once from ``seed`` alone by :func:`adult_users` (one group per user,
    ``samples_per_user`` test rows and about twice as many train rows per user), so partitions
    are disjoint and reproducible; partition ``p`` takes global user ids
    ``[p * users_per_node, (p + 1) * users_per_node)``. The population is finite (4,070 users
    for the defaults): a partition past its end has fewer users, possibly none (an empty
    shard). TPR/FPR are undefined for users without positives/negatives. Features are those of
    :func:`adult_features` (training statistics).
    """
    partition_id, num_partitions = _check_partition(partition_id, num_partitions)
    users_per_node = _check_int("users_per_node", users_per_node, 1)
    split = _check_choice("split", split, SPLITS)
    seed = _check_int("seed", seed, 0)
    group_attribute = _check_choice("group_attribute", group_attribute, ADULT_GROUP_ATTRIBUTES)
    samples_per_user = _check_int("samples_per_user", samples_per_user, 1)

    adult = load_adult(data_dir, download=download)
    x_train, y_train, x_test, y_test, _, _ = _adult_features_cached(adult)
    users = _adult_users_cached(adult, seed, group_attribute, samples_per_user)

    first = min(partition_id * users_per_node, users.num_users)
    last = min(first + users_per_node, users.num_users)
    rows_per_user = users.rows(split)[first:last]
    lengths = np.array([rows.shape[0] for rows in rows_per_user], dtype=np.int64)
    rows = np.concatenate(rows_per_user) if rows_per_user else np.zeros(0, dtype=np.int64)
    features, labels = (x_train, y_train) if split == "train" else (x_test, y_test)
    return UserShard(
        features=np.ascontiguousarray(features[rows]),
        labels=labels[rows],
        user_index=np.repeat(np.arange(last - first, dtype=np.int64), lengths),
        user_groups=users.user_groups[first:last].copy(),
        user_ids=np.arange(first, last, dtype=np.int64),
    )


def _adult_groups(protected: dict[str, NDArray[np.generic]], attribute: str) -> NDArray[np.int64]:
    if attribute == "sex":
        return protected["sex"].astype(np.int64)
    return (1 - protected["race_white"]).astype(np.int64)


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
    share_rng = np.random.default_rng(np.random.SeedSequence([seed, 7_331]))
    deal_rng = np.random.default_rng(np.random.SeedSequence([seed, 7_332, SPLITS.index(split)]))
    owner = np.empty(labels.shape[0], dtype=np.int64)
    for label in (0, 1):
        shares = share_rng.dirichlet(np.full(num_partitions, alpha))
        rows = deal_rng.permutation(np.flatnonzero(labels == label))
        cuts = np.round(np.cumsum(shares)[:-1] * rows.size).astype(np.int64)
        for holder, chunk in enumerate(np.split(rows, cuts)):
            owner[chunk] = holder
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
    """Data holder ``partition_id`` of Adult for FedEvalFair (SPEC 2.3; paper 003, 5.1.1).

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
    rows_per_holder = _check_int("rows_per_holder", rows_per_holder, 16)
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
