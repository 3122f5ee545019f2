"""A node's own data file (CSV or Parquet), named in its node config.

Start a SuperNode with ``--node-config 'data-file="/path/rows.csv" num-groups=2'`` and the
built-in ClientApp reads that node's rows instead of an embedded population, in every job (LDP
audit, FedEvalFair and FPFL training). There is never a fallback to embedded data: a file that
cannot be used stops the node with a message naming the file and the column.

``num-groups`` (node config, required with ``data-file``) is the number of protected groups
of the file, stated by the node's operator. A run is answered only when its run config's
``num-groups`` is the same; otherwise every job and ``describe`` refuse it with one fixed
sentence, decided before the file is read. Checking the run's number against the file would
make the answer depend on the data: a server trying 2, 3, 4, ... groups would learn the
largest group among the node's users, on a one-user device that user's protected group.
A node config without ``num-groups`` refuses every job (the sentence asks the operator to set
it); a file with a group at or above the node's ``num-groups`` is the operator's error
(:class:`DataFileError` in the node's log; the server reads a fixed sentence, whatever run it
sends).

Schema (one row per example; column order does not matter)
----------------------------------------------------------
``label``
    The true label, 0 or 1.
``group``
    The protected group, an integer in ``[0, num-groups)`` (the node config's
    ``num-groups``).
``user`` (optional)
    An integer user id, so one device can host many users; without it every row belongs to
    the device's one user. All rows of a user must share one group.
``split`` (optional)
    ``train`` or ``test``; without it every row serves both training and evaluation.
every other column
    A numeric feature (finite numbers); at least one. Every node must have the same feature
    columns (the server builds one model).

``.csv`` files are read with Python's ``csv`` module (a header row, then one row per
example); ``.parquet`` / ``.pq`` files need ``pyarrow`` (``pip install 'fedparity[parquet]'``).
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.common import log
from numpy.typing import NDArray

from ...mechanisms.validation import MAX_GROUPS, parse_int
from ..fpfl_data import FPFLShard
from ..messages import NodeRefusal
from ..shards import UserShard

__all__ = [
    "DATA_FILE_NODE_KEY",
    "NUM_GROUPS_MISMATCH_REFUSAL",
    "NUM_GROUPS_MISSING_REFUSAL",
    "NUM_GROUPS_NODE_KEY",
    "DataFileError",
    "OwnRows",
    "check_run_num_groups",
    "node_num_groups",
    "own_fpfl_shard",
    "own_shard",
    "read_data_file",
]

#: Node config key naming the node's own data file.
DATA_FILE_NODE_KEY = "data-file"
#: Node config key of the number of protected groups of the node's own data file.
NUM_GROUPS_NODE_KEY = "num-groups"
#: What the server reads from a node with a data file and no valid ``num-groups``.
NUM_GROUPS_MISSING_REFUSAL = (
    "this node reads its own data file, but its node config sets no num-groups (an integer in "
    f"[2, {MAX_GROUPS}], the number of protected groups of the file): its operator must set it"
)
#: What the server reads when its run's ``num-groups`` is not the node's.
NUM_GROUPS_MISMATCH_REFUSAL = (
    "the run's num-groups is not the number of protected groups of this node's own data (node "
    "config num-groups); refusing"
)
LABEL_COLUMN = "label"
GROUP_COLUMN = "group"
USER_COLUMN = "user"
SPLIT_COLUMN = "split"
_RESERVED = (LABEL_COLUMN, GROUP_COLUMN, USER_COLUMN, SPLIT_COLUMN)
_SPLITS = ("train", "test")


class DataFileError(ValueError):
    """The node's own data file cannot be used (the message names the file and column)."""


def node_num_groups(node_config: Mapping[str, object]) -> int:
    """The node config's ``num-groups`` (an integer in ``[2, 1024]``): the number of protected
    groups of the node's own data file. Missing or invalid: :class:`NodeRefusal` with
    :data:`NUM_GROUPS_MISSING_REFUSAL` (the node's log names the value)."""
    value = node_config.get(NUM_GROUPS_NODE_KEY)
    try:
        return parse_int(NUM_GROUPS_NODE_KEY, value, minimum=2, maximum=MAX_GROUPS)
    except ValueError:
        log(
            logging.ERROR,
            "node config %s must be an integer in [2, %d] (the number of protected groups of "
            "the data file %s) when %s is set, got %r",
            NUM_GROUPS_NODE_KEY,
            MAX_GROUPS,
            node_config.get(DATA_FILE_NODE_KEY),
            DATA_FILE_NODE_KEY,
            value,
        )
        raise NodeRefusal(NUM_GROUPS_MISSING_REFUSAL) from None


def check_run_num_groups(node_config: Mapping[str, object], run_num_groups: int) -> int:
    """The node's own ``num-groups`` (:func:`node_num_groups`), refusing with
    :data:`NUM_GROUPS_MISMATCH_REFUSAL` a run whose ``num-groups`` differs. Call it before
    the data file is read: the answer then depends on the request and the node config only."""
    own = node_num_groups(node_config)
    if run_num_groups != own:
        raise NodeRefusal(NUM_GROUPS_MISMATCH_REFUSAL)
    return own


@dataclass(frozen=True)
class OwnRows:
    """The checked rows of a node's own data file."""

    path: Path
    feature_names: tuple[str, ...]
    features: NDArray[np.float32]
    labels: NDArray[np.int64]
    groups: NDArray[np.int64]
    users: NDArray[np.int64]
    splits: NDArray[np.str_] | None


def _read_csv(path: Path) -> dict[str, list[str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise DataFileError(f"{path}: the file is empty (no header row)") from None
        names = [name.strip() for name in header]
        columns: dict[str, list[str]] = {name: [] for name in names}
        if len(columns) != len(names):
            raise DataFileError(f"{path}: the header names a column twice: {names}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(names):
                raise DataFileError(
                    f"{path}: row {line} has {len(row)} values, the header has {len(names)}"
                )
            for name, value in zip(names, row, strict=True):
                columns[name].append(value.strip())
    return columns


def _read_parquet(path: Path) -> dict[str, list[object]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DataFileError(
            f"{path}: reading Parquet needs pyarrow (pip install 'fedparity[parquet]')"
        ) from None
    try:
        table = parquet.read_table(path)
    except Exception as error:  # pyarrow raises several types for a file it cannot read
        raise DataFileError(f"{path}: not a readable Parquet file ({error})") from None
    return {name: table.column(name).to_pylist() for name in table.column_names}


def _numeric(path: Path, name: str, values: list, dtype: type) -> np.ndarray:
    try:
        array = np.asarray([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        bad = next((i, v) for i, v in enumerate(values) if not _is_number(v))
        raise DataFileError(
            f"{path}: column {name!r} must be numeric (data row {bad[0] + 1}: {bad[1]!r})"
        ) from None
    if not np.isfinite(array).all():
        raise DataFileError(f"{path}: column {name!r} must hold finite numbers")
    if dtype is np.int64:
        if not np.equal(np.round(array), array).all():
            raise DataFileError(f"{path}: column {name!r} must hold whole numbers")
        return array.astype(np.int64)
    return array.astype(dtype)


def _is_number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def read_data_file(path: str | os.PathLike[str]) -> OwnRows:
    """Read and check a node's own data file (see the module docstring for the schema).

    Raises
    ------
    DataFileError
        Missing file, unknown suffix, empty file, missing or misnamed column, a value of the
        wrong type or out of range; the message names the file and the column.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataFileError(f"{file}: no such file (node config {DATA_FILE_NODE_KEY})")
    suffix = file.suffix.lower()
    if suffix == ".csv":
        columns: dict[str, list] = _read_csv(file)
    elif suffix in (".parquet", ".pq"):
        columns = _read_parquet(file)
    else:
        raise DataFileError(f"{file}: the file must end in .csv, .parquet or .pq")
    for required in (LABEL_COLUMN, GROUP_COLUMN):
        if required not in columns:
            raise DataFileError(
                f"{file}: column {required!r} is missing (columns: {', '.join(columns)})"
            )
    feature_names = tuple(name for name in columns if name not in _RESERVED)
    if not feature_names:
        raise DataFileError(f"{file}: no feature column (every column but {_RESERVED})")
    num_rows = len(columns[LABEL_COLUMN])
    if num_rows == 0:
        raise DataFileError(f"{file}: the file has no data rows")
    labels = _numeric(file, LABEL_COLUMN, columns[LABEL_COLUMN], np.int64)
    if not np.isin(labels, (0, 1)).all():
        raise DataFileError(f"{file}: column {LABEL_COLUMN!r} must hold only 0 and 1")
    groups = _numeric(file, GROUP_COLUMN, columns[GROUP_COLUMN], np.int64)
    if groups.min() < 0:
        raise DataFileError(f"{file}: column {GROUP_COLUMN!r} must hold integers >= 0")
    users = (
        _numeric(file, USER_COLUMN, columns[USER_COLUMN], np.int64)
        if USER_COLUMN in columns
        else np.zeros(num_rows, dtype=np.int64)
    )
    splits = None
    if SPLIT_COLUMN in columns:
        splits = np.asarray([str(v) for v in columns[SPLIT_COLUMN]])
        unknown = sorted(set(splits.tolist()) - set(_SPLITS))
        if unknown:
            raise DataFileError(
                f"{file}: column {SPLIT_COLUMN!r} must hold 'train' or 'test', got {unknown[:3]}"
            )
    features = np.column_stack(
        [_numeric(file, name, columns[name], np.float32) for name in feature_names]
    )
    return OwnRows(file, feature_names, features, labels, groups, users, splits)


def own_shard(rows: OwnRows, split: str, *, num_groups: int) -> UserShard:
    """The node's users for ``split`` (``"train"`` or ``"test"``) as a UserShard;
    ``num_groups`` is the node's own (node config ``num-groups``)."""
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    _check_groups(rows, num_groups)
    keep = np.ones(rows.labels.size, dtype=bool) if rows.splits is None else rows.splits == split
    users, index = np.unique(rows.users[keep], return_inverse=True)
    groups = rows.groups[keep]
    user_groups = np.zeros(users.size, dtype=np.int64)
    user_groups[index] = groups
    if (user_groups[index] != groups).any():
        raise DataFileError(
            f"{rows.path}: column {GROUP_COLUMN!r}: the rows of a user must share one group"
        )
    return UserShard(
        features=np.ascontiguousarray(rows.features[keep]),
        labels=rows.labels[keep],
        user_index=index.reshape(-1).astype(np.int64),
        user_groups=user_groups,
        user_ids=users.astype(np.int64),
    )


def _check_groups(rows: OwnRows, num_groups: int) -> None:
    if rows.groups.max() >= num_groups:
        raise DataFileError(
            f"{rows.path}: column {GROUP_COLUMN!r} must hold groups in [0, {num_groups}) "
            f"(node config {NUM_GROUPS_NODE_KEY} = {num_groups}), got {int(rows.groups.max())}"
        )


def own_fpfl_shard(rows: OwnRows, *, num_groups: int) -> FPFLShard:
    """The node's users for FPFL training: the ``train`` rows (all rows without a ``split``
    column), each row a sample of its user with its own protected group, binary labels;
    ``num_groups`` is the node's own (node config ``num-groups``)."""
    _check_groups(rows, num_groups)
    keep = np.ones(rows.labels.size, dtype=bool) if rows.splits is None else rows.splits == "train"
    if not keep.any():
        raise DataFileError(f"{rows.path}: column {SPLIT_COLUMN!r} has no 'train' row")
    users, index = np.unique(rows.users[keep], return_inverse=True)
    return FPFLShard(
        features=np.ascontiguousarray(rows.features[keep], dtype=np.float32),
        labels=rows.labels[keep].astype(np.int64),
        groups=rows.groups[keep].astype(np.int64),
        user_index=index.reshape(-1).astype(np.int64),
        user_ids=users.astype(np.int64),
        num_groups=num_groups,
        num_classes=2,
    )
