"""The project app's user populations for FPFL: federated Adult and unfair FEMNIST / digits.

FPFL and these populations are from Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen
and Matt Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021 below), Sections 4.1 (Adult) and 4.2
(unfair FEMNIST).

Unlike the LDP audit's :class:`~fedparity.clients.shards.UserShard` (one group per user, binary
labels), FPFL needs a group *per sample* and multi-class labels, so its populations are
:class:`~fedparity.clients.fpfl_data.FPFLShard` objects (the library's, with their
``select_users`` and ``partition``).

* :func:`synthetic_fpfl_users`: an embedded synthetic population (no download).
* :func:`adult_fpfl_users`: Adult rows dealt to users with Poisson(2) samples each (users
  without a sample dropped), group = sex, features of
  :func:`fedparity.clients.project.data.adult_features`.
* :func:`load_leaf`: the LEAF json format of FEMNIST; :func:`unfair_writer_groups` and
  :func:`unfair_images`: the "unfair FEMNIST" transform (black pen 45%, blue pen 45%, white
  chalk on a blackboard 10%); :func:`unfair_shard` puts them together.
* :func:`digits_leaf`: scikit-learn's bundled 8x8 digits split into pseudo-writers in the same
  LEAF structure (FEMNIST cannot be downloaded here; needs ``scikit-learn``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from ...mechanisms.validation import check_int
from ..fpfl_data import FPFLShard
from .data import AdultData, adult_features, load_adult

__all__ = [
    "ADULT_MEAN_SAMPLES_PER_USER",
    "DIGITS_WRITERS",
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
]

#: Mean of the Poisson number of samples per user (Rodriguez-Galvez et al. 2021, Section 4.1).
ADULT_MEAN_SAMPLES_PER_USER = 2.0
#: The unfair FEMNIST groups (Rodriguez-Galvez et al. 2021, Section 4.2) and their shares of the
#: writers.
UNFAIR_GROUP_NAMES: tuple[str, str, str] = ("black_pen", "blue_pen", "white_chalk")
UNFAIR_FRACTIONS: tuple[float, float, float] = (0.45, 0.45, 0.10)
#: Ballpoint-blue ink colour (RGB in [0, 1]) of the blue-pen group.
BLUE_INK: tuple[float, float, float] = (0.1, 0.2, 0.9)
#: Side of a FEMNIST image; the chalk effect's kernels are defined at this resolution.
FEMNIST_SIZE = 28

_TAG_ADULT, _TAG_DIGITS, _TAG_UNFAIR, _TAG_SYNTHETIC = 11, 12, 13, 14
_SPLIT_CODE = {"train": 0, "test": 1}


def synthetic_fpfl_users(
    num_users: int,
    *,
    seed: int = 0,
    num_features: int = 8,
    num_groups: int = 2,
    num_classes: int = 2,
    mean_samples_per_user: float = 2.0,
    group_fractions: Sequence[float] | None = None,
) -> FPFLShard:
    """An embedded synthetic FPFL population (no download), deterministic from ``seed``.

    * user ``k`` holds ``max(Poisson(mean_samples_per_user), 1)`` samples;
    * every sample draws its group from ``group_fractions`` (default equal) and its class
      uniformly;
    * ``x = s_a * mu_y + N(0, I)`` with class centres ``mu_y ~ N(0, I / num_features)`` and a
      separation ``s_a`` falling linearly from 3.0 (group 0) to 1.5 (last group), so the task
      is harder for higher groups and an unconstrained model has a performance gap.
    """
    num_users = check_int("num_users", num_users, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    num_features = check_int("num_features", num_features, minimum=1)
    num_groups = check_int("num_groups", num_groups, minimum=2)
    num_classes = check_int("num_classes", num_classes, minimum=2)
    mean = float(mean_samples_per_user)
    if not math.isfinite(mean) or mean <= 0:
        raise ValueError(f"mean_samples_per_user must be a finite number > 0, got {mean!r}")
    if group_fractions is None:
        fractions = np.full(num_groups, 1.0 / num_groups)
    else:
        fractions = np.asarray(group_fractions, dtype=np.float64)
        if (
            fractions.shape != (num_groups,)
            or not np.all(np.isfinite(fractions))
            or np.any(fractions <= 0)
            or not math.isclose(float(fractions.sum()), 1.0, abs_tol=1e-9)
        ):
            raise ValueError(
                f"group_fractions must be {num_groups} positive numbers summing to 1, "
                f"got {group_fractions!r}"
            )
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_SYNTHETIC,)))
    sizes = np.maximum(rng.poisson(mean, size=num_users), 1).astype(np.int64)
    total = int(sizes.sum())
    groups = rng.choice(num_groups, size=total, p=fractions).astype(np.int64)
    labels = rng.integers(0, num_classes, size=total).astype(np.int64)
    centres = rng.normal(0.0, 1.0 / math.sqrt(num_features), size=(num_classes, num_features))
    separation = np.linspace(3.0, 1.5, num_groups)
    features = separation[groups, None] * centres[labels] + rng.standard_normal(
        (total, num_features)
    )
    return FPFLShard(
        features=features.astype(np.float32),
        labels=labels,
        groups=groups,
        user_index=np.repeat(np.arange(num_users, dtype=np.int64), sizes),
        user_ids=np.arange(num_users, dtype=np.int64),
        num_groups=num_groups,
        num_classes=num_classes,
    )


# --------------------------------------------------------------------------------------------
# Federated Adult (Section 4.1)
# --------------------------------------------------------------------------------------------


def _poisson_user_sizes(rng: np.random.Generator, num_rows: int, mean: float) -> NDArray[np.int64]:
    """Poisson(``mean``) sizes drawn until they cover ``num_rows``; the last user gets the
    remainder; users with no sample are dropped."""
    sizes: list[NDArray[np.int64]] = []
    covered = 0
    batch = max(int(num_rows / mean * 1.1) + 16, 16)
    while covered < num_rows:
        draw = rng.poisson(mean, size=batch).astype(np.int64)
        sizes.append(draw)
        covered += int(draw.sum())
    all_sizes = np.concatenate(sizes)
    ends = np.cumsum(all_sizes)
    last = int(np.searchsorted(ends, num_rows))  # first user whose end reaches num_rows
    all_sizes = all_sizes[: last + 1].copy()
    all_sizes[last] -= int(ends[last]) - num_rows
    return all_sizes[all_sizes > 0]


def adult_fpfl_users(
    adult: AdultData,
    *,
    split: str = "train",
    seed: int = 0,
    mean_samples_per_user: float = ADULT_MEAN_SAMPLES_PER_USER,
) -> FPFLShard:
    """The federated Adult population of Rodriguez-Galvez et al. 2021 (Section 4.1).

    The rows of ``split`` are shuffled and dealt to users in turn, user ``k`` taking
    ``N_k ~ Poisson(mean_samples_per_user)`` rows, until every row is taken (the last user gets
    the remainder). Users with ``N_k = 0`` are dropped, so a user has
    ``E[N | N > 0] = mu / (1 - exp(-mu))`` samples on average (2.313 for ``mu = 2``) and the
    32,561 training rows give about ``32561 (1 - e^-2) / 2 = 14,077`` users (14,090 for
    ``seed = 0``). The paper's ``K = 16,280`` is presumably the number of draws *before* the
    empty users are dropped (``32561 / 2``); the accountant should use the real count. All
    randomness comes from ``numpy.random.SeedSequence(seed)``: the split is deterministic.

    Features are those of :func:`fedparity.clients.project.data.adult_features` (6 numeric columns
    standardised
    with the training statistics, 7 categoricals one-hot); labels ``1`` for income ``>50K``;
    group = sex of the *sample* (0 = Male, 1 = Female), so a user may hold both groups.
    """
    if split not in _SPLIT_CODE:
        raise ValueError(f"split must be one of 'train', 'test'; got {split!r}")
    seed = check_int("seed", seed, minimum=0)
    mean = float(mean_samples_per_user)
    if not math.isfinite(mean) or mean <= 0:
        raise ValueError(f"mean_samples_per_user must be a finite number > 0, got {mean!r}")
    x_train, y_train, x_test, y_test, _, protected = adult_features(adult)
    features, labels = (x_train, y_train) if split == "train" else (x_test, y_test)
    groups = protected[split]["sex"].astype(np.int64)
    rng = np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(_TAG_ADULT, _SPLIT_CODE[split]))
    )
    order = rng.permutation(labels.shape[0])
    sizes = _poisson_user_sizes(rng, labels.shape[0], mean)
    user_index = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)
    return FPFLShard(
        features=np.ascontiguousarray(features[order]),
        labels=labels[order].astype(np.int64),
        groups=groups[order],
        user_index=user_index,
        user_ids=np.arange(sizes.shape[0], dtype=np.int64),
        num_groups=2,
        num_classes=2,
    )


# --------------------------------------------------------------------------------------------
# LEAF / FEMNIST (Section 4.2)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LeafData:
    """Samples of a LEAF dataset: ``features[i]`` belongs to ``user_names[user_index[i]]``.

    ``features`` is float32 ``(num_samples, side * side)`` as in the json (FEMNIST: values in
    [0, 1], background 1 = white, ink 0 = black); ``labels`` int64.
    """

    user_names: tuple[str, ...]
    features: NDArray[np.float32]
    labels: NDArray[np.int64]
    user_index: NDArray[np.int64]

    @property
    def num_users(self) -> int:
        """Number of users."""
        return len(self.user_names)

    @property
    def image_side(self) -> int:
        """Side of the square images (``sqrt`` of the row length)."""
        side = math.isqrt(self.features.shape[1])
        if side * side != self.features.shape[1]:
            raise ValueError(f"rows of length {self.features.shape[1]} are not square images")
        return side


def load_leaf(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    digits_only: bool = False,
) -> LeafData:
    """Read LEAF json files (``{"users", "num_samples", "user_data": {u: {"x", "y"}}}``).

    Several files (LEAF writes ``all_data_0.json`` ...) are concatenated; a user appearing in
    two files is an error. ``digits_only=True`` keeps FEMNIST's classes 0-9 (the paper's
    "unfair FEMNIST" uses the digits only) and drops users left without a sample. Every
    ``num_samples`` entry must match its user's ``x`` and ``y``; all rows must have the same
    length. Raises ``ValueError`` naming the file and the field.
    """
    if isinstance(paths, (str, os.PathLike)):
        path_list = [Path(paths)]
    else:
        path_list = [Path(path) for path in paths]
    if not path_list:
        raise ValueError("paths must name at least one LEAF json file")
    names: list[str] = []
    blocks_x: list[NDArray[np.float32]] = []
    blocks_y: list[NDArray[np.int64]] = []
    seen: set[str] = set()
    width: int | None = None
    for path in path_list:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
        for key in ("users", "num_samples", "user_data"):
            if key not in content:
                raise ValueError(f"{path}: missing field {key!r}")
        users, counts, user_data = content["users"], content["num_samples"], content["user_data"]
        if len(users) != len(counts):
            raise ValueError(f"{path}: 'users' and 'num_samples' differ in length")
        for user, count in zip(users, counts, strict=True):
            if user in seen:
                raise ValueError(f"{path}: user {user!r} appears in more than one file")
            seen.add(user)
            if user not in user_data:
                raise ValueError(f"{path}: user {user!r} has no entry in 'user_data'")
            x = np.asarray(user_data[user]["x"], dtype=np.float32)
            y = np.asarray(user_data[user]["y"], dtype=np.int64)
            if x.ndim != 2 or x.shape[0] != count or y.shape != (count,):
                raise ValueError(
                    f"{path}: user {user!r}: num_samples={count} but x has shape {x.shape} "
                    f"and y has shape {y.shape}"
                )
            if width is None:
                width = x.shape[1]
            elif x.shape[1] != width:
                raise ValueError(f"{path}: user {user!r}: rows of length {x.shape[1]} != {width}")
            if digits_only:
                keep = (y >= 0) & (y < 10)
                x, y = x[keep], y[keep]
                if y.size == 0:
                    continue
            names.append(str(user))
            blocks_x.append(x)
            blocks_y.append(y)
    if not names:
        raise ValueError("the LEAF files hold no sample")
    lengths = np.array([block.shape[0] for block in blocks_y], dtype=np.int64)
    return LeafData(
        user_names=tuple(names),
        features=np.concatenate(blocks_x).astype(np.float32),
        labels=np.concatenate(blocks_y),
        user_index=np.repeat(np.arange(len(names), dtype=np.int64), lengths),
    )


def unfair_writer_groups(user_names: Sequence[str]) -> NDArray[np.int64]:
    """Group of every writer: the first 45% in lexicographic order of the names write with a
    black pen (0), the next 45% with a blue pen (1), the last ``K - 2 floor(0.45 K)`` (10%)
    with white chalk on a blackboard (2). Paper: 1,522 / 1,522 / 339 of 3,383 writers."""
    names = list(user_names)
    if len(set(names)) != len(names):
        raise ValueError("user_names must be distinct")
    count = len(names)
    per_pen = math.floor(UNFAIR_FRACTIONS[0] * count)
    ranks = np.empty(count, dtype=np.int64)
    ranks[np.argsort(np.array(names, dtype=str), kind="stable")] = np.arange(count)
    return np.where(ranks < per_pen, 0, np.where(ranks < 2 * per_pen, 1, 2)).astype(np.int64)


def unfair_images(
    images: NDArray[np.floating],
    groups: NDArray[np.integer],
    *,
    rng: np.random.Generator,
    blue_ink: tuple[float, float, float] = BLUE_INK,
    blur_sigmas: tuple[float, float] = (1.0, 2.0),
) -> NDArray[np.float32]:
    """The unfair FEMNIST transform (Rodriguez-Galvez et al. 2021, Section 4.2, Eq. 19), RGB output.

    ``images`` is ``(n, side, side)`` in [0, 1] with a white background (1) and dark ink (0),
    as FEMNIST. The result is float32 ``(n, 3, side, side)`` in [0, 1]:

    * group 0, black pen: unchanged (grey replicated to three channels);
    * group 1, blue pen: every channel ``c`` is ``ink_c + (1 - ink_c) x``, so the background
      stays white and the strokes turn ``blue_ink``;
    * group 2, white chalk on a blackboard: inverted (``1 - x``, white strokes on black),
      ``x <- (x + xi * k2) * k1`` with ``xi ~ N(0, s^2 I)`` and Gaussian kernels of std
      ``blur_sigmas = (1, 2)`` FEMNIST pixels, clipped to [0, 1], rotated by 90 degrees
      (counter-clockwise), grey on three channels.

    At a side other than 28 the kernels' std and the noise std ``s`` are scaled by
    ``side / 28``, so the effect spans the same fraction of the image with the same amplitude
    (the noise std after the ``k2`` blur is ``1 / (2 sqrt(pi) sigma_2) ~ 0.14`` at any size).
    """
    rng = _check_rng(rng)
    array = np.asarray(images, dtype=np.float64)
    labels = np.asarray(groups)
    if array.ndim != 3 or array.shape[1] != array.shape[2]:
        raise ValueError(f"images must have shape (n, side, side), got {array.shape}")
    if labels.shape != (array.shape[0],):
        raise ValueError(f"groups must have shape ({array.shape[0]},), got {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 2):
        raise ValueError("groups must be in {0, 1, 2} (black pen, blue pen, white chalk)")
    if array.size and (array.min() < 0.0 or array.max() > 1.0):
        raise ValueError("images must have values in [0, 1]")
    ink = np.asarray(blue_ink, dtype=np.float64)
    if ink.shape != (3,) or ink.min() < 0 or ink.max() > 1:
        raise ValueError(f"blue_ink must be three numbers in [0, 1], got {blue_ink!r}")
    sigma_1, sigma_2 = (float(value) for value in blur_sigmas)
    if not (sigma_1 > 0 and sigma_2 > 0):
        raise ValueError(f"blur_sigmas must be two numbers > 0, got {blur_sigmas!r}")
    side = array.shape[1]
    scale = side / FEMNIST_SIZE

    out = np.repeat(array[:, None, :, :], 3, axis=1)
    blue = labels == 1
    out[blue] = ink[None, :, None, None] + (1.0 - ink[None, :, None, None]) * array[blue][:, None]
    chalk = np.flatnonzero(labels == 2)
    if chalk.size:
        from scipy import ndimage  # here, not at the top: a node's process starts faster

        inverted = 1.0 - array[chalk]
        noise = rng.normal(0.0, scale, size=inverted.shape)
        blurred_noise = ndimage.gaussian_filter(noise, sigma=(0, sigma_2 * scale, sigma_2 * scale))
        board = ndimage.gaussian_filter(
            inverted + blurred_noise, sigma=(0, sigma_1 * scale, sigma_1 * scale)
        )
        board = np.rot90(np.clip(board, 0.0, 1.0), k=1, axes=(1, 2))
        out[chalk] = board[:, None, :, :]
    return out.astype(np.float32)


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
            f"got {type(rng).__name__}"
        )
    return rng


def unfair_shard(leaf: LeafData, *, seed: int = 0, num_classes: int = 10) -> FPFLShard:
    """An :class:`FPFLShard` of unfair FEMNIST (or digits): groups by
    :func:`unfair_writer_groups`, images by :func:`unfair_images` with noise from
    ``SeedSequence(seed)``; features ``(n, 3, side, side)``; one user per LEAF writer."""
    seed = check_int("seed", seed, minimum=0)
    if leaf.labels.size and (leaf.labels.min() < 0 or leaf.labels.max() >= num_classes):
        raise ValueError(f"num_classes must exceed every label (max {leaf.labels.max()})")
    side = leaf.image_side
    writer_groups = unfair_writer_groups(leaf.user_names)
    sample_groups = writer_groups[leaf.user_index]
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_UNFAIR,)))
    images = unfair_images(leaf.features.reshape(-1, side, side), sample_groups, rng=rng)
    return FPFLShard(
        features=images,
        labels=leaf.labels.astype(np.int64),
        groups=sample_groups.astype(np.int64),
        user_index=leaf.user_index.astype(np.int64),
        user_ids=np.arange(leaf.num_users, dtype=np.int64),
        num_groups=3,
        num_classes=num_classes,
    )


def digits_leaf(
    *, seed: int = 0, num_writers: int = 60, test_fraction: float = 0.2
) -> tuple[LeafData, LeafData]:
    """scikit-learn's bundled 8x8 digits (1,797 images) as a LEAF-like (train, test) pair.

    The bundled copy has no writer ids, so the images are shuffled (``SeedSequence(seed)``)
    and dealt to ``num_writers`` pseudo-writers (``writer_000`` ...) in near-equal blocks; each
    writer's last ``round(test_fraction * size)`` images form its test set, as LEAF splits per
    user. Pixels are mapped to FEMNIST's convention ``x = 1 - v / 16`` (white background,
    dark ink). Needs ``scikit-learn`` (``pip install scikit-learn``).
    """
    seed = check_int("seed", seed, minimum=0)
    num_writers = check_int("num_writers", num_writers, minimum=3, maximum=1797)
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "digits_leaf needs scikit-learn (pip install scikit-learn), which bundles the "
            "8x8 digits data set (no download)"
        ) from error
    digits = load_digits()
    images = (1.0 - digits.images.reshape(len(digits.target), -1) / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_DIGITS,)))
    order = rng.permutation(labels.shape[0])
    blocks = np.array_split(order, num_writers)
    names = tuple(f"writer_{k:03d}" for k in range(num_writers))
    train_rows: list[NDArray[np.int64]] = []
    test_rows: list[NDArray[np.int64]] = []
    for block in blocks:
        num_test = max(1, round(float(test_fraction) * block.shape[0]))
        train_rows.append(block[:-num_test])
        test_rows.append(block[-num_test:])

    def build(rows: list[NDArray[np.int64]]) -> LeafData:
        lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
        flat = np.concatenate(rows)
        return LeafData(
            user_names=names,
            features=images[flat],
            labels=labels[flat],
            user_index=np.repeat(np.arange(num_writers, dtype=np.int64), lengths),
        )

    return build(train_rows), build(test_rows)


# The federated populations of the Flower job (task = "fpfl")
# --------------------------------------------------------------------------------------------

#: Pseudo-writers of the unfair-digits population (the whole bundled set, about 30 images each).
DIGITS_WRITERS = 60


def fpfl_population(
    dataset: str,
    *,
    num_partitions: int,
    seed: int,
    users_per_node: int = 1000,
    num_groups: int = 2,
    data_dir: str | os.PathLike[str] = "",
    download: bool = False,
) -> tuple[FPFLShard, FPFLShard]:
    """The (training users, held-out test set) of an FPFL run, deterministic from ``seed``.

    * ``"adult"``: :func:`adult_fpfl_users` on ``adult.data`` (about 14,090 users) and the
      ``adult.test`` rows; ``data_dir`` is the folder with the UCI files.
    * ``"synthetic"`` (embedded, no download): :func:`synthetic_fpfl_users` with
      ``users_per_node * num_partitions`` training users and a quarter as many (at least
      1,000) held-out users drawn from the same distribution.
    * ``"digits"``: unfair digits (:func:`digits_leaf` + :func:`unfair_shard`, 3 groups,
      10 classes; stand-in for unfair FEMNIST).

    A node takes ``train.partition(partition_id, num_partitions)``; only the simulation
    harness on the server looks at ``test``.
    """
    num_partitions = check_int("num_partitions", num_partitions, minimum=1)
    if dataset == "adult":
        adult = load_adult(data_dir, download=download)
        train = adult_fpfl_users(adult, split="train", seed=seed)
        test = adult_fpfl_users(adult, split="test", seed=seed)
    elif dataset == "synthetic":
        users_per_node = check_int("users_per_node", users_per_node, minimum=1)
        num_train = int(users_per_node) * int(num_partitions)
        num_test = max(num_train // 4, 1000)
        everyone = synthetic_fpfl_users(num_train + num_test, seed=seed, num_groups=num_groups)
        train = everyone.select_users(np.arange(num_train))
        test = everyone.select_users(np.arange(num_train, num_train + num_test))
    elif dataset == "digits":
        leaf_train, leaf_test = digits_leaf(seed=seed, num_writers=DIGITS_WRITERS)
        train = unfair_shard(leaf_train, seed=seed)
        test = unfair_shard(leaf_test, seed=seed + 1)
    else:
        raise ValueError(f"dataset must be one of 'synthetic', 'adult', 'digits'; got {dataset!r}")
    if num_partitions > train.num_users:
        raise ValueError(
            f"num_partitions ({num_partitions}) must be <= the number of users ({train.num_users})"
        )
    return train, test
