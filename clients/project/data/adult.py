"""UCI Adult (Becker and Kohavi, 1996): download, parse, features, and small single-group
users."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray

from ....mechanisms.validation import check_int_at_least
from .shards import SPLITS, UserShard, _check_choice, _check_partition
from .synthetic import _TAG_GLOBAL

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
    source_url: str | None = None,
) -> AdultData:
    """Read ``adult.data`` and ``adult.test`` (UCI format) from ``data_dir``.

    Format tolerated: comma-separated fields with optional spaces, no header; an optional first
    line ``|1x3 Cross validator`` (any line starting with ``'|'`` is skipped); labels with or
    without a trailing ``'.'``; blank lines skipped; ``'?'`` kept as a category.

    If the files are not in ``data_dir`` (nor in ``cache_dir`` when given): with
    ``download=False`` raise ``FileNotFoundError``; with ``download=True`` fetch them from
    ``source_url`` (default :data:`ADULT_URL`, UCI) into ``cache_dir`` (default ``data_dir``)
    and read them from there (:func:`adult_folder`; with ``cache_dir`` given, ``data_dir`` is
    only read).
    Parsed files are cached in memory per folder and modification time.
    """
    folder = adult_folder(
        data_dir,
        download=download,
        download_dir=data_dir if cache_dir is None else cache_dir,
        source_url=source_url,
    )
    return _read_adult_cached(*_cache_key(folder))


def adult_folder(
    data_dir: str | os.PathLike[str],
    *,
    download: bool,
    download_dir: str | os.PathLike[str],
    source_url: str | None = None,
) -> Path:
    """The folder holding ``adult.data`` and ``adult.test``: ``data_dir`` when it holds both,
    else ``download_dir`` when it does, else, with ``download=True``, ``download_dir`` after
    the missing files were fetched into it from ``source_url`` (default :data:`ADULT_URL`).

    Only ``download_dir`` is ever created or written: a node passes its own data folder
    there, so a folder named by the server (run config ``data-dir``) is only read from.
    ``FileNotFoundError`` naming both folders when the files are in neither and
    ``download=False``.
    """
    candidates = list(dict.fromkeys([Path(data_dir).expanduser(), Path(download_dir).expanduser()]))
    for folder in candidates:
        if all((folder / name).is_file() for name in ADULT_FILES):
            return folder
    if not download:
        searched = " or ".join(f"'{folder}'" for folder in candidates)
        raise FileNotFoundError(
            f"UCI Adult files {', '.join(ADULT_FILES)} not found in {searched}; pass "
            f"download=True (config 'download = true') to fetch them from {ADULT_URL}, or point "
            "data_dir at a folder containing them"
        )
    target = candidates[-1]
    _download_adult(target, ADULT_URL if source_url is None else source_url)
    return target


def _download_adult(target: Path, source_url: str = ADULT_URL) -> None:
    """Fetch the missing Adult files into ``target`` (each written atomically via a ``.part``
    file of its own)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ADULT_FILES:
        destination = target / name
        if destination.is_file():
            continue
        # A partial file of this process's own: simulated nodes may fetch at the same time.
        handle, partial_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=target)
        try:
            with urllib.request.urlopen(
                source_url.rstrip("/") + "/" + name, timeout=60
            ) as response:
                with os.fdopen(handle, "wb") as out:
                    shutil.copyfileobj(response, out)
            os.replace(partial_name, destination)
        finally:
            Path(partial_name).unlink(missing_ok=True)


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
        train_column = np.asarray(train[name], dtype=np.float64)  # numeric columns are float64
        test_column = np.asarray(test[name], dtype=np.float64)
        mean = float(train_column.mean())
        std = float(train_column.std())
        scale = std if std > 0 else 1.0
        train_blocks.append(((train_column - mean) / scale)[:, None])
        test_blocks.append(((test_column - mean) / scale)[:, None])
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
    seed = check_int_at_least("seed", seed, 0)
    group_attribute = _check_choice("group_attribute", group_attribute, ADULT_GROUP_ATTRIBUTES)
    samples_per_user = check_int_at_least("samples_per_user", samples_per_user, 1)
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
    users_per_node = check_int_at_least("users_per_node", users_per_node, 1)
    split = _check_choice("split", split, SPLITS)
    seed = check_int_at_least("seed", seed, 0)
    group_attribute = _check_choice("group_attribute", group_attribute, ADULT_GROUP_ATTRIBUTES)
    samples_per_user = check_int_at_least("samples_per_user", samples_per_user, 1)

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
