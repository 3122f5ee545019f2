"""Tests for clients.project.data: synthetic population, UCI Adult loading and partitioning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedparity.clients.project.data import (
    ADULT_CATEGORICAL,
    ADULT_DIR_ENV,
    ADULT_NUMERIC,
    UserShard,
    adult_features,
    adult_partition,
    adult_users,
    concat_shards,
    load_adult,
    load_partition,
    synthetic_partition,
)


def assert_shards_equal(left: UserShard, right: UserShard) -> None:
    for field in ("features", "labels", "user_index", "user_groups", "user_ids"):
        np.testing.assert_array_equal(getattr(left, field), getattr(right, field), err_msg=field)


# --------------------------------------------------------------------------------------------
# UserShard
# --------------------------------------------------------------------------------------------


def small_shard_arrays() -> dict[str, np.ndarray]:
    return {
        "features": np.zeros((3, 2), dtype=np.float32),
        "labels": np.array([0, 1, 1], dtype=np.int64),
        "user_index": np.array([0, 0, 1], dtype=np.int64),
        "user_groups": np.array([0, 1], dtype=np.int64),
        "user_ids": np.array([10, 11], dtype=np.int64),
    }


def test_user_shard_properties() -> None:
    shard = UserShard(**small_shard_arrays())
    assert (shard.num_users, shard.num_samples, shard.num_features) == (2, 3, 2)


@pytest.mark.parametrize(
    ("field", "bad_value"),
    [
        ("features", np.zeros((3, 2), dtype=np.float64)),
        ("features", np.zeros(3, dtype=np.float32)),
        ("labels", np.array([0, 1], dtype=np.int64)),
        ("labels", np.array([0, 1, 2], dtype=np.int64)),
        ("labels", np.array([0, 1, 1], dtype=np.int32)),
        ("user_index", np.array([0, 0, 2], dtype=np.int64)),
        ("user_groups", np.array([0, -1], dtype=np.int64)),
        ("user_ids", np.array([10, 10], dtype=np.int64)),
        ("user_ids", np.array([10], dtype=np.int64)),
    ],
)
def test_user_shard_validation_names_field(field: str, bad_value: np.ndarray) -> None:
    arrays = small_shard_arrays()
    arrays[field] = bad_value
    with pytest.raises(ValueError, match=field):
        UserShard(**arrays)


def test_concat_shards_offsets_user_index() -> None:
    parts = [synthetic_partition(p, 3, 5, seed=1, samples_per_user=4) for p in range(3)]
    merged = concat_shards(parts)
    assert merged.num_users == 15 and merged.num_samples == 60
    np.testing.assert_array_equal(merged.user_ids, np.arange(15))
    np.testing.assert_array_equal(merged.user_index, np.repeat(np.arange(15), 4))
    with pytest.raises(ValueError, match="user_ids"):
        concat_shards([parts[0], parts[0]])


# --------------------------------------------------------------------------------------------
# Synthetic population
# --------------------------------------------------------------------------------------------


def test_synthetic_shapes_and_dtypes() -> None:
    shard = synthetic_partition(2, 5, 30, num_groups=3, seed=7, samples_per_user=6, num_features=5)
    assert shard.features.shape == (180, 5) and shard.features.dtype == np.float32
    assert shard.labels.dtype == np.int64 and set(np.unique(shard.labels)) == {0, 1}
    assert shard.user_index.dtype == np.int64 and shard.user_groups.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(shard.user_index), np.full(30, 6))
    np.testing.assert_array_equal(shard.user_ids, np.arange(60, 90))
    assert set(np.unique(shard.user_groups)) <= {0, 1, 2}


def test_synthetic_reproducible_and_independent_of_other_partitions() -> None:
    first = synthetic_partition(3, 8, 50, seed=11, split="test")
    for other in range(8):  # generating other partitions must not matter
        synthetic_partition(other, 8, 50, seed=11, split="train")
    np.random.seed(123)  # noqa: NPY002 -- nor the global NumPy RNG
    assert_shards_equal(first, synthetic_partition(3, 8, 50, seed=11, split="test"))
    different = synthetic_partition(3, 8, 50, seed=12, split="test")
    assert not np.array_equal(first.features, different.features)


def test_synthetic_partitions_are_disjoint_in_users() -> None:
    shards = [synthetic_partition(p, 6, 40, seed=3) for p in range(6)]
    all_ids = np.concatenate([shard.user_ids for shard in shards])
    assert np.unique(all_ids).shape[0] == 240
    assert not np.array_equal(shards[0].features, shards[1].features)


def test_synthetic_train_and_test_share_users_but_not_samples() -> None:
    train = synthetic_partition(1, 4, 100, seed=5, split="train")
    test = synthetic_partition(1, 4, 100, seed=5, split="test")
    np.testing.assert_array_equal(train.user_ids, test.user_ids)
    np.testing.assert_array_equal(train.user_groups, test.user_groups)
    assert not np.array_equal(train.features, test.features)


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("samples_per_user", [2, 3, 16])
def test_synthetic_every_user_has_positive_and_negative(split: str, samples_per_user: int) -> None:
    shard = synthetic_partition(0, 1, 500, seed=9, split=split, samples_per_user=samples_per_user)
    positives = np.bincount(shard.user_index, weights=shard.labels, minlength=shard.num_users)
    assert positives.min() >= 1
    assert positives.max() <= samples_per_user - 1


def test_synthetic_group_fractions_balanced_by_default() -> None:
    shard = synthetic_partition(0, 2, 1000, num_groups=4, seed=1)
    np.testing.assert_array_equal(np.bincount(shard.user_groups, minlength=4), [250] * 4)


@pytest.mark.parametrize(
    ("fractions", "users_per_node"),
    [((0.7, 0.3), 1000), ((0.5, 0.3, 0.2), 999), ((0.15, 0.85), 37)],
)
def test_synthetic_group_fractions_honoured(
    fractions: tuple[float, ...], users_per_node: int
) -> None:
    for partition_id in range(5):
        shard = synthetic_partition(
            partition_id, 5, users_per_node, len(fractions), seed=4, group_fractions=fractions
        )
        counts = np.bincount(shard.user_groups, minlength=len(fractions))
        expected = np.asarray(fractions) * users_per_node
        assert np.all(np.abs(counts - expected) < 1.0), (counts, expected)


def test_synthetic_one_user_per_node_draws_groups_in_proportion() -> None:
    groups = np.concatenate(
        [
            synthetic_partition(p, 2000, 1, seed=2, group_fractions=(0.8, 0.2)).user_groups
            for p in range(2000)
        ]
    )
    assert abs(groups.mean() - 0.2) < 0.03


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"partition_id": 4}, "partition_id"),
        ({"partition_id": -1}, "partition_id"),
        ({"num_partitions": 0}, "num_partitions"),
        ({"users_per_node": 0}, "users_per_node"),
        ({"num_groups": 1}, "num_groups"),
        ({"split": "validation"}, "split"),
        ({"seed": -1}, "seed"),
        ({"samples_per_user": 1}, "samples_per_user"),
        ({"num_features": 0}, "num_features"),
        ({"group_fractions": (0.5, 0.6)}, "group_fractions"),
        ({"group_fractions": (1.0,)}, "group_fractions"),
        ({"class_separation": (1.0, 2.0, 3.0)}, "class_separation"),
    ],
)
def test_synthetic_bad_arguments_name_parameter(kwargs: dict[str, object], parameter: str) -> None:
    arguments: dict[str, object] = {"partition_id": 0, "num_partitions": 4, "users_per_node": 10}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=parameter):
        synthetic_partition(**arguments)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# load_partition
# --------------------------------------------------------------------------------------------


def test_load_partition_synthetic_matches_synthetic_partition() -> None:
    shard = load_partition("synthetic", 1, 3, users_per_node=20, num_groups=3, seed=8, split="test")
    expected = synthetic_partition(1, 3, 20, num_groups=3, seed=8, split="test")
    assert_shards_equal(shard, expected)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "parameter"),
    [
        ("mnist", {}, "dataset"),
        ("synthetic", {"partition_id": 3}, "partition_id"),
        ("synthetic", {"partition_id": -1}, "partition_id"),
        ("synthetic", {"users_per_node": 0}, "users_per_node"),
        ("synthetic", {"num_groups": 1}, "num_groups"),
        ("synthetic", {"split": "val"}, "split"),
        ("adult", {"num_groups": 3}, "num_groups"),
    ],
)
def test_load_partition_bad_arguments_name_parameter(
    dataset: str, kwargs: dict[str, object], parameter: str
) -> None:
    arguments: dict[str, object] = {
        "partition_id": 0,
        "num_partitions": 3,
        "users_per_node": 10,
        "num_groups": 2,
        "seed": 0,
        "split": "train",
        "data_dir": "/nonexistent",
    }
    arguments.update(kwargs)
    partition_id = arguments.pop("partition_id")
    num_partitions = arguments.pop("num_partitions")
    with pytest.raises(ValueError, match=parameter):
        load_partition(dataset, partition_id, num_partitions, **arguments)  # type: ignore[arg-type]


def test_load_partition_adult_without_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ADULT_DIR_ENV, raising=False)
    common = {"users_per_node": 5, "num_groups": 2, "seed": 0, "split": "test"}
    with pytest.raises(ValueError, match="data_dir"):
        load_partition("adult", 0, 1, **common)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="download"):
        load_partition("adult", 0, 1, data_dir=str(tmp_path / "absent"), **common)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# UCI Adult
# --------------------------------------------------------------------------------------------

TINY_TRAIN = """\
39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K
50, ?, 83311, Bachelors, 13, Married-civ-spouse, ?, Husband, White, Male, 0, 0, 13, United-States, >50K

38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, Black, Female, 0, 0, 40, ?, <=50K
"""  # noqa: E501
TINY_TEST = """\
|1x3 Cross validator
25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, United-States, <=50K.
28, Local-gov, 336951, Assoc-acdm, 12, Married-civ-spouse, Protective-serv, Husband, White, Male, 0, 0, 40, Peru, >50K
44,Private,160323,Some-college,10,Married-civ-spouse,Machine-op-inspct,Wife,Asian-Pac-Islander,Female,7688,0,40,United-States,>50K.

"""  # noqa: E501


def write_tiny_adult(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adult.data").write_text(TINY_TRAIN, encoding="utf-8")
    (folder / "adult.test").write_text(TINY_TEST, encoding="utf-8")
    return folder


def test_adult_format_tolerance(tmp_path: Path) -> None:
    adult = load_adult(write_tiny_adult(tmp_path / "adult"))
    assert (adult.train.num_rows, adult.test.num_rows) == (3, 3)  # blank lines, header skipped
    np.testing.assert_array_equal(adult.train.labels, [0, 1, 0])
    np.testing.assert_array_equal(adult.test.labels, [0, 1, 1])  # with and without '.'
    assert list(adult.test.columns["income"]) == ["<=50K", ">50K", ">50K"]
    assert adult.train.columns["workclass"][1] == "?"  # '?' kept as a category
    assert adult.test.columns["age"].dtype == np.float64


def test_adult_tiny_features_use_training_categories(tmp_path: Path) -> None:
    adult = load_adult(write_tiny_adult(tmp_path / "adult"))
    x_train, y_train, x_test, y_test, names, protected = adult_features(adult)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert "workclass=?" in names and "native-country=?" in names
    assert "native-country=Peru" not in names  # categories come from the training split
    country = [i for i, name in enumerate(names) if name.startswith("native-country=")]
    np.testing.assert_array_equal(x_test[:, country].sum(axis=1), [1.0, 0.0, 1.0])
    race = [i for i, name in enumerate(names) if name.startswith("race=")]
    np.testing.assert_array_equal(x_test[:, race].sum(axis=1), [1.0, 1.0, 0.0])  # unseen race
    np.testing.assert_array_equal(protected["test"]["sex"], [0, 0, 1])
    np.testing.assert_array_equal(protected["test"]["race_white"], [0, 1, 0])
    np.testing.assert_array_equal(y_test, [0, 1, 1])


def test_adult_malformed_row_reports_line(tmp_path: Path) -> None:
    folder = write_tiny_adult(tmp_path / "adult")
    (folder / "adult.test").write_text("25, Private, 226802\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"adult\.test:1"):
        load_adult(folder)


def test_adult_absent_folder_mentions_download(tmp_path: Path) -> None:
    missing = tmp_path / "no-adult-here"
    with pytest.raises(FileNotFoundError, match="download=True") as error:
        load_adult(missing)
    assert str(missing) in str(error.value)


def test_adult_real_row_counts_and_positive_rates(adult_path: Path) -> None:
    adult = load_adult(adult_path)
    assert adult.train.num_rows == 32_561
    assert adult.test.num_rows == 16_281
    assert adult.train.labels.mean() == pytest.approx(0.2408, abs=0.001)
    assert adult.test.labels.mean() == pytest.approx(0.2362, abs=0.001)
    assert (adult.train.columns["workclass"] == "?").sum() > 0  # missing values kept


def test_adult_real_features_standardised_with_training_stats(adult_path: Path) -> None:
    x_train, y_train, x_test, y_test, names, protected = adult_features(load_adult(adult_path))
    assert names[: len(ADULT_NUMERIC)] == list(ADULT_NUMERIC)
    assert x_train.shape[1] == x_test.shape[1] == len(names)
    assert {name.split("=")[0] for name in names[len(ADULT_NUMERIC) :]} == set(ADULT_CATEGORICAL)
    numeric = slice(0, len(ADULT_NUMERIC))
    train_means = x_train[:, numeric].astype(np.float64).mean(axis=0)
    test_means = x_test[:, numeric].astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(train_means, 0.0, atol=1e-5)
    np.testing.assert_allclose(x_train[:, numeric].astype(np.float64).std(axis=0), 1.0, atol=1e-5)
    assert np.all(np.abs(test_means) > 1e-4)  # test uses the training statistics
    one_hot = x_train[:, len(ADULT_NUMERIC) :]
    np.testing.assert_array_equal(one_hot.sum(axis=1), len(ADULT_CATEGORICAL))
    assert set(np.unique(protected["train"]["sex"])) == {0, 1}
    assert protected["train"]["sex"].mean() == pytest.approx(0.331, abs=0.002)
    assert protected["test"]["race_white"].mean() == pytest.approx(0.855, abs=0.005)
    assert protected["train"]["education"][0] == "Bachelors"
    assert y_train.shape[0] == x_train.shape[0] and y_test.shape[0] == x_test.shape[0]


def test_adult_users_have_one_group_and_disjoint_rows(adult_path: Path) -> None:
    adult = load_adult(adult_path)
    users = adult_users(adult, seed=3)
    assert users.num_users == 10_860 // 4 + 5_421 // 4
    sex = {"train": adult_features(adult)[5]["train"]["sex"]}
    sex["test"] = (adult.test.columns["sex"] == "Female").astype(np.int64)
    for split in ("train", "test"):
        rows = users.rows(split)
        flat = np.concatenate(rows)
        assert np.unique(flat).shape[0] == flat.shape[0]  # no row used twice
        owner_group = np.repeat(users.user_groups, [r.shape[0] for r in rows])
        np.testing.assert_array_equal(sex[split][flat], owner_group)  # one group per user
    assert {r.shape[0] for r in users.test_rows} == {4}
    assert {r.shape[0] for r in users.train_rows} <= {7, 8, 9}


def test_adult_partition_disjoint_reproducible(adult_path: Path) -> None:
    shards = [adult_partition(adult_path, p, 5, 1000, "test", seed=42) for p in range(5)]
    ids = np.concatenate([shard.user_ids for shard in shards])
    assert np.unique(ids).shape[0] == ids.shape[0] == 4_070
    assert [shard.num_users for shard in shards] == [1000, 1000, 1000, 1000, 70]
    assert shards[0].num_features == 106
    assert_shards_equal(shards[2], adult_partition(adult_path, 2, 5, 1000, "test", seed=42))
    train = adult_partition(adult_path, 2, 5, 1000, "train", seed=42)
    np.testing.assert_array_equal(train.user_ids, shards[2].user_ids)
    np.testing.assert_array_equal(train.user_groups, shards[2].user_groups)
    other_seed = adult_partition(adult_path, 2, 5, 1000, "test", seed=43)
    assert not np.array_equal(other_seed.features, shards[2].features)
    past_end = adult_partition(adult_path, 9, 10, 1000, "test", seed=42)
    assert past_end.num_users == 0 and past_end.num_samples == 0


def test_adult_partition_matches_user_rows(adult_path: Path) -> None:
    adult = load_adult(adult_path)
    _, _, x_test, y_test, _, _ = adult_features(adult)
    users = adult_users(adult, seed=42, group_attribute="race")
    shard = adult_partition(adult_path, 1, 4, 50, "test", seed=42, group_attribute="race")
    rows = np.concatenate(users.test_rows[50:100])
    np.testing.assert_array_equal(shard.features, x_test[rows])
    np.testing.assert_array_equal(shard.labels, y_test[rows])
    np.testing.assert_array_equal(shard.user_groups, users.user_groups[50:100])
    white = (adult.test.columns["race"] == "White").astype(np.int64)
    np.testing.assert_array_equal(1 - white[rows], np.repeat(shard.user_groups, 4))


def test_load_partition_adult_uses_env_folder(
    adult_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ADULT_DIR_ENV, str(adult_path))
    shard = load_partition(
        "adult", 0, 2, users_per_node=10, num_groups=2, seed=1, split="train", data_dir=""
    )
    assert_shards_equal(shard, adult_partition(adult_path, 0, 2, 10, "train", seed=1))


def test_adult_download_only_when_absent_and_asked(adult_path: Path, tmp_path: Path) -> None:
    """The download path, against a real HTTP server on 127.0.0.1 serving UCI's file layout
    (a temporary copy of the shared files; nothing is copied into the repository)."""
    import functools
    import http.server
    import shutil
    import threading

    served = tmp_path / "served"
    served.mkdir()
    for name in ("adult.data", "adult.test"):
        shutil.copy(adult_path / name, served / name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    cache = tmp_path / "cache"
    try:
        with pytest.raises(FileNotFoundError, match="download"):
            load_adult(cache, source_url=url)  # absent and not asked: no download
        assert not cache.exists()
        adult = load_adult(cache, download=True, source_url=url)
        assert adult.train.num_rows == 32_561 and adult.test.num_rows == 16_281
        assert sorted(p.name for p in cache.iterdir()) == ["adult.data", "adult.test"]
        server.shutdown()  # present now: no second download needed
        assert load_adult(cache, download=True, source_url=url).test.num_rows == 16_281
    finally:
        server.shutdown()
        server.server_close()


def test_adult_doctorate_holders_partition_the_rows(adult_path: Path) -> None:
    """FedEvalFair's (anonymous, 2024, Section 5.1.1) split: holder 0 = Doctorate rows, holder 1
    = the rest; group = non-White."""
    from fedparity.clients.project.data import adult_holder

    adult = load_adult(adult_path)
    education = adult.test.columns["education"]
    race = adult.test.columns["race"]
    doctorate = adult_holder(adult_path, 0, 2, "test", scheme="doctorate")
    others = adult_holder(adult_path, 1, 2, "test", scheme="doctorate")
    assert doctorate.num_samples == int((education == "Doctorate").sum())
    assert doctorate.num_samples + others.num_samples == adult.test.num_rows
    assert doctorate.user_groups.sum() == int(
        ((education == "Doctorate") & (race != "White")).sum()
    )
    with pytest.raises(ValueError, match="num_partitions must be 2"):
        adult_holder(adult_path, 0, 3, "test", scheme="doctorate")


def test_adult_dirichlet_holders_are_disjoint_complete_and_skewed(adult_path: Path) -> None:
    from fedparity.clients.project.data import adult_holder

    shards = [adult_holder(adult_path, i, 10, "train", seed=3) for i in range(10)]
    assert sum(s.num_samples for s in shards) == 32_561
    rates = np.array([s.labels.mean() for s in shards if s.num_samples])
    assert rates.max() - rates.min() > 0.2  # label skew from the Dirichlet shares
    again = adult_holder(adult_path, 4, 10, "train", seed=3)
    np.testing.assert_array_equal(again.features, shards[4].features)
    other_seed = adult_holder(adult_path, 4, 10, "train", seed=4)
    assert other_seed.num_samples != shards[4].num_samples


def test_synthetic_holder_rows_carry_their_users_group() -> None:
    from fedparity.clients.project.data import synthetic_holder

    holder = synthetic_holder(1, 3, "test", rows_per_holder=800)
    shard = synthetic_partition(1, 3, 50, split="test")
    np.testing.assert_array_equal(holder.features, shard.features)
    np.testing.assert_array_equal(holder.user_groups, shard.user_groups[shard.user_index])
    assert holder.num_users == holder.num_samples == 800
