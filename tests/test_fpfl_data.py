"""clients/fpfl_data.py: federated Adult users, the LEAF loader and the unfair transform.

Reference: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021, Sections 4.1
(Poisson(2) users) and 4.2 (unfair FEMNIST).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedparity.clients.fpfl_data import FPFLShard, check_groups_present
from fedparity.clients.project.data import adult_features, load_adult
from fedparity.clients.project.fpfl_data import (
    adult_fpfl_users,
    digits_leaf,
    load_leaf,
    synthetic_fpfl_users,
    unfair_images,
    unfair_shard,
    unfair_writer_groups,
)

# --------------------------------------------------------------------------------------------
# Federated Adult
# --------------------------------------------------------------------------------------------

#: Users of adult_fpfl_users(seed=0) on the 32,561 training rows (deterministic).
ADULT_USERS_SEED0 = 14_090
MU = 2.0
#: Zero-truncated Poisson(2): mean mu / (1 - e^-mu) = 2.3130 and variance
#: (mu + mu^2) / (1 - e^-mu) - mean^2 = 1.589.
TRUNCATED_MEAN = MU / (1 - math.exp(-MU))
TRUNCATED_VAR = (MU + MU**2) / (1 - math.exp(-MU)) - TRUNCATED_MEAN**2


def test_adult_poisson_users(adult_path: Path) -> None:
    adult = load_adult(adult_path)
    users = adult_fpfl_users(adult, seed=0)
    x_train, y_train, _, _, _, protected = adult_features(adult)
    assert users.num_samples == x_train.shape[0] == 32_561
    assert users.num_users == ADULT_USERS_SEED0
    sizes = users.samples_per_user()
    assert sizes.min() >= 1  # no empty user
    # Mean samples per user: the mean of ~14,000 zero-truncated Poisson draws has sd
    # sqrt(1.589 / 14090) = 0.011; 4 sd.
    tolerance = 4 * math.sqrt(TRUNCATED_VAR / users.num_users)
    assert sizes.mean() == pytest.approx(TRUNCATED_MEAN, abs=tolerance)
    # Expected users 32561 (1 - e^-2) / 2 = 14,077; counts of other seeds stay within 2%.
    expected = 32_561 * (1 - math.exp(-MU)) / MU
    for seed in (1, 2):
        assert abs(adult_fpfl_users(adult, seed=seed).num_users - expected) < 0.02 * expected
    # Every row is used once: same multiset of labels / groups, and features per row.
    assert np.bincount(users.labels).tolist() == np.bincount(y_train).tolist()
    assert np.bincount(users.groups).tolist() == np.bincount(protected["train"]["sex"]).tolist()
    assert users.num_groups == 2 and users.num_classes == 2
    # Deterministic for a seed, different for another.
    again = adult_fpfl_users(adult, seed=0)
    np.testing.assert_array_equal(again.user_index, users.user_index)
    np.testing.assert_array_equal(again.features, users.features)
    other = adult_fpfl_users(adult, seed=1)
    assert not np.array_equal(other.labels, users.labels)
    test_users = adult_fpfl_users(adult, split="test", seed=0)
    assert test_users.num_samples == 16_281


def test_select_users_and_partition() -> None:
    shard = synthetic_fpfl_users(50, seed=1)
    cohort = shard.select_users([4, 0, 17])
    assert cohort.num_users == 3
    np.testing.assert_array_equal(cohort.user_ids, [4, 0, 17])
    for new, old in enumerate([4, 0, 17]):
        np.testing.assert_array_equal(
            cohort.features[cohort.user_index == new], shard.features[shard.user_index == old]
        )
    parts = [shard.partition(k, 4) for k in range(4)]
    assert [p.num_users for p in parts] == [13, 13, 12, 12]
    assert sum(p.num_samples for p in parts) == shard.num_samples
    np.testing.assert_array_equal(np.concatenate([p.user_ids for p in parts]), shard.user_ids)
    with pytest.raises(ValueError, match="partition_id"):
        shard.partition(4, 4)
    with pytest.raises(ValueError, match="users"):
        shard.select_users([1, 1])


def test_group_without_member_is_an_error() -> None:
    shard = synthetic_fpfl_users(40, seed=2, num_groups=3)
    check_groups_present(shard)
    no_two = FPFLShard(
        features=shard.features,
        labels=shard.labels,
        groups=np.minimum(shard.groups, 1),
        user_index=shard.user_index,
        user_ids=shard.user_ids,
        num_groups=3,
        num_classes=2,
    )
    with pytest.raises(ValueError, match="groups"):
        check_groups_present(no_two)
    # Group 1 has samples but no positive one: FNR parity's d'_1 is empty.
    labels = np.where(shard.groups == 1, 0, shard.labels)
    only_negatives = FPFLShard(
        features=shard.features,
        labels=labels,
        groups=shard.groups,
        user_index=shard.user_index,
        user_ids=shard.user_ids,
        num_groups=3,
        num_classes=2,
    )
    check_groups_present(only_negatives)
    with pytest.raises(ValueError, match="groups"):
        check_groups_present(only_negatives, constraint_samples=labels == 1)


def test_shard_validation() -> None:
    shard = synthetic_fpfl_users(5, seed=0)
    with pytest.raises(ValueError, match="groups"):
        FPFLShard(
            shard.features, shard.labels, shard.groups + 5, shard.user_index, shard.user_ids, 2, 2
        )
    with pytest.raises(ValueError, match="features"):
        FPFLShard(
            shard.features.astype(np.float64),  # type: ignore[arg-type]
            shard.labels,
            shard.groups,
            shard.user_index,
            shard.user_ids,
            2,
            2,
        )
    with pytest.raises(ValueError, match="num_groups"):
        synthetic_fpfl_users(5, num_groups=1)


# --------------------------------------------------------------------------------------------
# LEAF loader
# --------------------------------------------------------------------------------------------


def _write_leaf(path: Path, users: dict[str, tuple[list[list[float]], list[int]]]) -> None:
    content = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {name: {"x": x, "y": y} for name, (x, y) in users.items()},
    }
    path.write_text(json.dumps(content), encoding="utf-8")


def test_leaf_loader(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def images(n: int) -> list[list[float]]:
        return rng.random((n, 784)).round(3).tolist()

    first = {"f0001_23": (images(3), [1, 7, 40]), "f0002_11": (images(2), [0, 9])}
    second = {"f0003_05": (images(1), [55])}
    _write_leaf(tmp_path / "all_data_0.json", first)
    _write_leaf(tmp_path / "all_data_1.json", second)
    data = load_leaf([tmp_path / "all_data_0.json", tmp_path / "all_data_1.json"])
    assert data.user_names == ("f0001_23", "f0002_11", "f0003_05")
    assert data.features.shape == (6, 784) and data.features.dtype == np.float32
    assert data.labels.tolist() == [1, 7, 40, 0, 9, 55]
    assert data.user_index.tolist() == [0, 0, 0, 1, 1, 2]
    assert data.image_side == 28
    np.testing.assert_allclose(data.features[3], first["f0002_11"][0][0], rtol=1e-6)

    digits = load_leaf(
        [tmp_path / "all_data_0.json", tmp_path / "all_data_1.json"], digits_only=True
    )
    assert digits.user_names == ("f0001_23", "f0002_11")  # f0003_05 had only a letter
    assert digits.labels.tolist() == [1, 7, 0, 9]

    bad = {"u": (images(2), [1])}
    _write_leaf(tmp_path / "bad.json", bad)
    with pytest.raises(ValueError, match="num_samples"):
        load_leaf(tmp_path / "bad.json")
    (tmp_path / "missing.json").write_text(json.dumps({"users": []}), encoding="utf-8")
    with pytest.raises(ValueError, match="num_samples"):
        load_leaf(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="more than one file"):
        load_leaf([tmp_path / "all_data_0.json", tmp_path / "all_data_0.json"])


# --------------------------------------------------------------------------------------------
# Unfair FEMNIST transform
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "expected"), [(3383, (1522, 1522, 339)), (100, (45, 45, 10))])
def test_writer_groups_are_45_45_10_in_lexicographic_order(
    count: int, expected: tuple[int, int, int]
) -> None:
    rng = np.random.default_rng(1)
    names = [f"f{k:05d}_{rng.integers(100):02d}" for k in range(count)]
    shuffled = [names[k] for k in rng.permutation(count)]
    groups = unfair_writer_groups(shuffled)
    assert tuple(np.bincount(groups, minlength=3)) == expected
    by_name = dict(zip(shuffled, groups, strict=True))
    ordered = [by_name[name] for name in sorted(shuffled)]
    assert ordered == sorted(ordered)  # black pens first, then blue, then chalk


def _glyph(side: int) -> np.ndarray:
    """White page with a dark vertical stroke in the left quarter (asymmetric on purpose)."""
    image = np.ones((side, side))
    image[side // 8 : side - side // 8, side // 8 : side // 4] = 0.0
    return image


@pytest.mark.parametrize("side", [28, 8])
def test_unfair_transform(side: int) -> None:
    image = _glyph(side)
    images = np.stack([image] * 6)
    groups = np.array([0, 1, 2, 2, 1, 0])
    out = unfair_images(images, groups, rng=np.random.default_rng(0))
    assert out.shape == (6, 3, side, side) and out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 1.0
    # Black pen: unchanged on every channel.
    np.testing.assert_allclose(out[0], np.stack([image] * 3), atol=1e-7)
    # Blue pen: white background stays white, ink takes the ink colour (blue > red, green).
    ink = image == 0.0
    np.testing.assert_allclose(out[1][:, ~ink], 1.0, atol=1e-7)
    stroke = out[1][:, ink].mean(axis=1)
    assert stroke[2] > 0.8 and stroke[0] < 0.2 and stroke[1] < 0.3
    # Chalk: grey on all channels, inverted (dark board, bright stroke), rotated 90 degrees
    # counter-clockwise, so the left-hand stroke becomes a horizontal bar at the bottom.
    chalk = out[2]
    np.testing.assert_array_equal(chalk[0], chalk[1])
    assert chalk[0].mean() < 0.5  # mostly dark board
    rows = chalk[0].mean(axis=1)
    bottom = rows[side - side // 4 : side - side // 8].mean()
    top = rows[: side // 4].mean()
    assert bottom > top + 0.1
    unrotated = np.rot90(chalk[0], k=-1)
    assert unrotated[:, side // 8 : side // 4].mean() > unrotated[:, side // 2 :].mean() + 0.1
    # Blur + noise: not a plain inversion, and two chalk images get different noise.
    assert np.abs(unrotated - (1 - image)).max() > 0.05
    assert not np.array_equal(out[2], out[3])
    # Deterministic for a seed.
    again = unfair_images(images, groups, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, again)


def test_unfair_transform_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="images"):
        unfair_images(np.full((1, 4, 4), 2.0), np.array([0]), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="groups"):
        unfair_images(np.ones((1, 4, 4)), np.array([3]), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng"):
        unfair_images(np.ones((1, 4, 4)), np.array([0]), rng=0)  # type: ignore[arg-type]


def test_unfair_digits() -> None:
    train, test = digits_leaf(seed=0, num_writers=60)
    assert train.num_users == test.num_users == 60
    assert train.features.shape[0] + test.features.shape[0] == 1797
    assert train.image_side == 8
    assert train.features.min() >= 0.0 and train.features.max() <= 1.0
    assert np.median(train.features) > 0.5  # white background as in FEMNIST
    assert np.all(np.bincount(test.user_index, minlength=60) >= 1)
    shard = unfair_shard(train, seed=0)
    assert shard.features.shape == (train.features.shape[0], 3, 8, 8)
    assert shard.num_groups == 3 and shard.num_classes == 10
    writer_groups = unfair_writer_groups(train.user_names)
    assert tuple(np.bincount(writer_groups)) == (27, 27, 6)
    np.testing.assert_array_equal(shard.groups, writer_groups[shard.user_index])
    # Chalk images are dark on average, pen images bright.
    assert shard.features[shard.groups == 2].mean() < 0.5 < shard.features[shard.groups == 0].mean()
