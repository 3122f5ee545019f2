"""Tests for clients.project.task: model, weights I/O, training, per-user metrics, true gap."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedparity.clients.fpfl_task import uninitialized
from fedparity.clients.project.data import ADULT_DIR_ENV, UserShard, adult_partition, concat_shards
from fedparity.clients.project.data import synthetic_partition as synthetic
from fedparity.clients.project.task import (
    METRIC_NAMES,
    UserMetrics,
    build_model,
    evaluate_users,
    get_arrays,
    group_gap_truth,
    metric_values,
    set_arrays,
    train,
)
from tests.support.import_probe import last_line_printed

REPO_ROOT = Path(__file__).resolve().parents[1]


def population(num_groups: int, split: str, **kwargs: object) -> UserShard:
    """Users of 4 synthetic partitions of 500 users, merged."""
    return concat_shards(
        [synthetic(p, 4, 500, num_groups, seed=42, split=split, **kwargs) for p in range(4)]  # type: ignore[arg-type]
    )


def trained_gaps(num_groups: int, **kwargs: object) -> dict[str, dict[str, object]]:
    train_shard = population(num_groups, "train", **kwargs)
    test_shard = population(num_groups, "test", **kwargs)
    model = build_model(train_shard.num_features, seed=0)
    train(model, train_shard, epochs=3, learning_rate=0.1, seed=0)
    metrics = evaluate_users(model, test_shard)
    return {
        name: group_gap_truth(test_shard.user_groups, metric_values(metrics, name), num_groups)
        for name in METRIC_NAMES
    }


# --------------------------------------------------------------------------------------------
# Model and weights
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [0, 16])
def test_build_model_outputs_one_logit_deterministically(hidden: int) -> None:
    rng_state = torch.get_rng_state()
    model = build_model(5, hidden=hidden, seed=3)
    assert torch.equal(rng_state, torch.get_rng_state())  # global RNG untouched
    assert model(torch.zeros(7, 5)).shape == (7, 1)
    for left, right in zip(
        get_arrays(model), get_arrays(build_model(5, hidden, seed=3)), strict=True
    ):
        np.testing.assert_array_equal(left, right)
    assert not np.array_equal(get_arrays(model)[0], get_arrays(build_model(5, hidden, seed=4))[0])
    assert len(get_arrays(model)) == (2 if hidden == 0 else 4)


@pytest.mark.parametrize("hidden", [0, 7])
def test_build_model_draws_uniform_fan_in_weights_in_layer_order(hidden: int) -> None:
    """PyTorch's ``Linear`` default, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, each layer's weight
    then bias, from one generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(1, 9), (1,)] if hidden == 0 else [(hidden, 9), (hidden,), (1, hidden), (1,)]
    expected = []
    for index, shape in enumerate(shapes):
        fan_in = shapes[index - index % 2][1]
        bound = 1.0 / math.sqrt(fan_in)
        expected.append(torch.empty(shape).uniform_(-bound, bound, generator=generator).numpy())
    for got, want in zip(get_arrays(build_model(9, hidden, seed=3)), expected, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("module_cls", "args", "kwargs"),
    [
        (torch.nn.Linear, (6, 3), {}),
        (torch.nn.Linear, (6, 3), {"bias": False}),
        (torch.nn.Conv2d, (2, 4, 5), {"stride": 2, "padding": 2}),
    ],
)
def test_uninitialized_has_skip_inits_parameters(
    module_cls: type[torch.nn.Module], args: tuple[int, ...], kwargs: dict[str, object]
) -> None:
    ours = uninitialized(module_cls, *args, **kwargs)
    torchs = torch.nn.utils.skip_init(module_cls, *args, **kwargs)
    assert type(ours) is module_cls and repr(ours) == repr(torchs)
    expected = [
        (n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in torchs.named_parameters()
    ]
    got = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in ours.named_parameters()]
    assert got == expected
    assert all(isinstance(p, torch.nn.Parameter) for p in ours.parameters())


def test_uninitialized_refuses_a_module_with_buffers() -> None:
    with pytest.raises(ValueError, match="submodules or buffers"):
        uninitialized(torch.nn.BatchNorm1d, 3)


def test_a_model_trained_in_a_new_process_imports_neither_sympy_nor_dynamo() -> None:
    """Building and training the audit's model leaves out the imports ``skip_init`` (SymPy) and
    a ``torch.optim`` optimizer (TorchDynamo) would make in every new ClientApp process."""
    code = (
        "import sys\n"
        "from fedparity.clients.project.data import synthetic_partition\n"
        "from fedparity.clients.project.task import build_model, train\n"
        "from fedparity.clients.fpfl_task import build_model_for\n"
        "shard = synthetic_partition(0, 1, 50, seed=0)\n"
        "train(build_model(shard.num_features, 4), shard, epochs=1, learning_rate=0.1, seed=0)\n"
        "build_model_for('cnn', (1, 8, 8), num_classes=10)\n"
        "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))\n"
    )
    assert last_line_printed(code) == "[]"


@pytest.mark.parametrize(
    ("kwargs", "parameter"), [({"num_features": 0}, "num_features"), ({"hidden": -1}, "hidden")]
)
def test_build_model_bad_arguments(kwargs: dict[str, int], parameter: str) -> None:
    arguments = {"num_features": 3, **kwargs}
    with pytest.raises(ValueError, match=parameter):
        build_model(**arguments)


def test_get_set_arrays_round_trip_and_shape_checks() -> None:
    source = build_model(4, hidden=3, seed=1)
    target = build_model(4, hidden=3, seed=2)
    arrays = get_arrays(source)
    assert [a.shape for a in arrays] == [(3, 4), (3,), (1, 3), (1,)]
    set_arrays(target, arrays)
    for left, right in zip(get_arrays(target), arrays, strict=True):
        np.testing.assert_array_equal(left, right)
    arrays[0][:] = 99.0  # get_arrays returns copies
    assert not np.any(get_arrays(source)[0] == 99.0)
    with pytest.raises(ValueError, match="shape"):
        set_arrays(target, [np.zeros((4, 3), np.float32)] + arrays[1:])
    with pytest.raises(ValueError, match="4 arrays"):
        set_arrays(target, arrays[:2])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def test_train_is_deterministic_given_seed() -> None:
    shard = synthetic(0, 1, 100, seed=1)
    results = []
    for seed in (5, 5, 6):
        model = build_model(shard.num_features, seed=0)
        loss = train(model, shard, epochs=2, learning_rate=0.1, batch_size=64, seed=seed)
        results.append((loss, get_arrays(model)))
    assert results[0][0] == results[1][0] and math.isfinite(results[0][0])
    np.testing.assert_array_equal(results[0][1][0], results[1][1][0])
    assert not np.array_equal(results[0][1][0], results[2][1][0])


@pytest.mark.parametrize("hidden", [0, 8])
def test_train_steps_exactly_as_torch_optim_sgd(hidden: int) -> None:
    shard = synthetic(0, 1, 150, seed=3)
    ours = build_model(shard.num_features, hidden, seed=0)
    loss = train(ours, shard, epochs=2, learning_rate=0.3, batch_size=32, seed=7)
    reference = build_model(shard.num_features, hidden, seed=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3)
    features = torch.from_numpy(shard.features)
    targets = torch.from_numpy(shard.labels).to(torch.float32)
    generator = torch.Generator().manual_seed(7)
    total = 0.0
    for _ in range(2):
        order = torch.randperm(shard.num_samples, generator=generator)
        for start in range(0, shard.num_samples, 32):
            batch = order[start : start + 32]
            optimizer.zero_grad()
            batch_loss = torch.nn.BCEWithLogitsLoss()(
                reference(features[batch]).squeeze(1), targets[batch]
            )
            batch_loss.backward()
            optimizer.step()
            total += float(batch_loss.detach()) * batch.shape[0]
    assert loss == total / (2 * shard.num_samples)
    for left, right in zip(get_arrays(ours), get_arrays(reference), strict=True):
        np.testing.assert_array_equal(left, right)
    assert not np.array_equal(
        get_arrays(ours)[0], get_arrays(build_model(shard.num_features, hidden, seed=0))[0]
    )


def test_train_reduces_loss() -> None:
    shard = synthetic(0, 1, 300, seed=2)
    model = build_model(shard.num_features, seed=0)
    before = evaluate_users(model, shard).loss
    train(model, shard, epochs=3, learning_rate=0.1, seed=0)
    assert evaluate_users(model, shard).loss < before - 0.1


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"epochs": 0}, "epochs"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_train_bad_arguments(kwargs: dict[str, float], parameter: str) -> None:
    arguments = {"epochs": 1, "learning_rate": 0.1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=parameter):
        train(build_model(8), synthetic(0, 1, 2, seed=0), **arguments)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Per-user metrics
# --------------------------------------------------------------------------------------------


def naive_user_metrics(model: torch.nn.Module, shard: UserShard, threshold: float) -> UserMetrics:
    """Reference: one user at a time in plain Python."""
    with torch.no_grad():
        probabilities = torch.sigmoid(model(torch.from_numpy(shard.features))).reshape(-1)
    predicted = [bool(p >= threshold) for p in probabilities.tolist()]
    columns: dict[str, list[float]] = {name: [] for name in METRIC_NAMES}
    counts: dict[str, list[int]] = {"num_samples": [], "num_positives": [], "num_negatives": []}
    for user in range(shard.num_users):
        rows = [i for i in range(shard.num_samples) if shard.user_index[i] == user]
        labels = [bool(shard.labels[i]) for i in rows]
        preds = [predicted[i] for i in rows]
        tp = sum(p and y for p, y in zip(preds, labels, strict=True))
        fp = sum(p and not y for p, y in zip(preds, labels, strict=True))
        fn = sum(not p and y for p, y in zip(preds, labels, strict=True))
        correct = sum(p == y for p, y in zip(preds, labels, strict=True))
        pos, neg = sum(labels), len(labels) - sum(labels)
        columns["accuracy"].append(correct / len(rows) if rows else math.nan)
        columns["tpr"].append(tp / pos if pos else math.nan)
        columns["fnr"].append(fn / pos if pos else math.nan)
        columns["fpr"].append(fp / neg if neg else math.nan)
        counts["num_samples"].append(len(rows))
        counts["num_positives"].append(pos)
        counts["num_negatives"].append(neg)
    return UserMetrics(
        **{name: np.array(values, dtype=np.float64) for name, values in columns.items()},
        **{name: np.array(values, dtype=np.int64) for name, values in counts.items()},
        loss=math.nan,
        overall_accuracy=math.nan,
    )


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_evaluate_users_equals_naive_loop(threshold: float) -> None:
    rng = np.random.default_rng(0)
    num_samples, num_users = 60, 9
    # User 8 has no samples; user 0 only positives; user 1 only negatives.
    user_index = np.sort(rng.integers(2, 8, size=num_samples)).astype(np.int64)
    user_index[:3], user_index[3:6] = 0, 1
    labels = rng.integers(0, 2, size=num_samples).astype(np.int64)
    labels[:3], labels[3:6] = 1, 0
    shard = UserShard(
        features=rng.normal(size=(num_samples, 3)).astype(np.float32),
        labels=labels,
        user_index=user_index,
        user_groups=rng.integers(0, 2, size=num_users).astype(np.int64),
        user_ids=np.arange(num_users, dtype=np.int64),
    )
    model = build_model(3, seed=7)
    metrics = evaluate_users(model, shard, threshold=threshold)
    expected = naive_user_metrics(model, shard, threshold)
    for name in (*METRIC_NAMES, "num_samples", "num_positives", "num_negatives"):
        np.testing.assert_array_equal(getattr(metrics, name), getattr(expected, name), name)
        assert getattr(metrics, name).dtype == getattr(expected, name).dtype
    assert np.isnan(metrics.accuracy[8]) and np.isnan(metrics.fpr[0]) and np.isnan(metrics.tpr[1])
    assert metrics.num_users == num_users
    assert metrics.overall_accuracy == pytest.approx(
        np.nansum(metrics.accuracy * metrics.num_samples) / num_samples
    )
    with torch.no_grad():
        logits = model(torch.from_numpy(shard.features)).reshape(-1)
        reference_loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(labels).float()
        )
    assert metrics.loss == pytest.approx(float(reference_loss))


def test_metric_values_names() -> None:
    shard = synthetic(0, 1, 5, seed=0)
    metrics = evaluate_users(build_model(8), shard)
    for name in METRIC_NAMES:
        assert metric_values(metrics, name) is getattr(metrics, name)
    with pytest.raises(ValueError, match="accuracy.*tpr.*fpr.*fnr"):
        metric_values(metrics, "precision")


def test_single_user_node_path() -> None:
    shard = synthetic(7, 10, 1, seed=0, split="test")  # a real device hosts one user
    model = build_model(shard.num_features, seed=0)
    train(model, synthetic(7, 10, 1, seed=0), epochs=1, learning_rate=0.1, seed=0)
    metrics = evaluate_users(model, shard)
    assert metrics.num_users == 1 and metrics.num_samples.tolist() == [16]
    assert not np.isnan(metrics.tpr[0]) and not np.isnan(metrics.fpr[0])


def test_evaluate_users_on_empty_shard() -> None:
    shard = UserShard(
        features=np.zeros((0, 8), np.float32),
        labels=np.zeros(0, np.int64),
        user_index=np.zeros(0, np.int64),
        user_groups=np.zeros(0, np.int64),
        user_ids=np.zeros(0, np.int64),
    )
    model = build_model(8)
    metrics = evaluate_users(model, shard)
    assert metrics.num_users == 0 and math.isnan(metrics.loss)
    assert train(model, shard, epochs=1, learning_rate=0.1, seed=0) == 0.0


# --------------------------------------------------------------------------------------------
# Ground-truth gap
# --------------------------------------------------------------------------------------------


def test_group_gap_truth_exact_small_case() -> None:
    groups = np.array([0, 0, 1, 1, 1, 2, 2], dtype=np.int64)
    values = np.array([1.0, 0.5, 0.25, np.nan, 0.75, np.nan, np.nan])
    truth = group_gap_truth(groups, values, 4)
    assert truth["group_counts"] == [2, 2, 0, 0]
    assert truth["group_means"][:2] == [0.75, 0.5]
    assert all(math.isnan(m) for m in truth["group_means"][2:])
    assert truth["max_gap"] == 0.25
    assert (truth["max_group"], truth["min_group"]) == (0, 1)
    lonely = group_gap_truth(groups[:2], values[:2], 2)
    assert math.isnan(lonely["max_gap"]) and lonely["max_group"] == 0


@pytest.mark.parametrize(
    ("groups", "values", "num_groups", "parameter"),
    [
        (np.array([0, 2]), np.array([0.1, 0.2]), 2, "user_groups"),
        (np.array([0, 1]), np.array([0.1]), 2, "values"),
        (np.array([0.0, 1.0]), np.array([0.1, 0.2]), 2, "user_groups"),
        (np.array([0, 0]), np.array([0.1, 0.2]), 1, "num_groups"),
    ],
)
def test_group_gap_truth_validation(
    groups: np.ndarray, values: np.ndarray, num_groups: int, parameter: str
) -> None:
    with pytest.raises(ValueError, match=parameter):
        group_gap_truth(groups, values, num_groups)


# --------------------------------------------------------------------------------------------
# The designed gap
# --------------------------------------------------------------------------------------------


def test_trained_model_shows_designed_gap_two_groups() -> None:
    gaps = trained_gaps(2)
    for name in ("accuracy", "tpr"):
        means = gaps[name]["group_means"]
        assert gaps[name]["group_counts"] == [1000, 1000]
        assert means[0] - means[1] >= 0.03, (name, means)  # group 1 worse
        assert gaps[name]["max_gap"] >= 0.1
        assert (gaps[name]["max_group"], gaps[name]["min_group"]) == (0, 1)
    assert gaps["fnr"]["max_group"] == 1 and gaps["fpr"]["max_group"] == 1


def test_trained_model_gap_is_graded_for_three_groups() -> None:
    gaps = trained_gaps(3)
    for name in ("accuracy", "tpr"):
        means = gaps[name]["group_means"]
        assert means[0] - means[1] >= 0.03 and means[1] - means[2] >= 0.03, (name, means)


def test_equal_separation_gives_no_gap() -> None:
    gaps = trained_gaps(2, class_separation=(2.0, 2.0))
    assert gaps["accuracy"]["max_gap"] < 0.02
    assert gaps["tpr"]["max_gap"] < 0.03


def test_adult_logistic_regression_learns() -> None:
    override = os.environ.get(ADULT_DIR_ENV)
    folder = Path(override) if override else REPO_ROOT.parent / "shared" / "data" / "adult"
    if not (folder / "adult.data").is_file():
        pytest.skip(f"UCI Adult files not found in {folder} (set {ADULT_DIR_ENV})")
    train_shard = concat_shards([adult_partition(folder, p, 3, 1500, "train", 0) for p in range(3)])
    test_shard = concat_shards([adult_partition(folder, p, 3, 1500, "test", 0) for p in range(3)])
    model = build_model(train_shard.num_features, seed=0)
    train(model, train_shard, epochs=3, learning_rate=0.1, seed=0)
    metrics = evaluate_users(model, test_shard)
    assert metrics.overall_accuracy > 0.82
    truth = group_gap_truth(test_shard.user_groups, metrics.tpr, 2)
    assert truth["group_counts"][0] > truth["group_counts"][1] > 0
    assert truth["max_gap"] > 0.05
