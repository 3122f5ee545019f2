"""clients/fpfl_task.py: models, surrogates, vectorised per-user statistics and clipping.

Reference: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021, Eq. (13), (14),
(17) and Algorithm 1 (clipping).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedparity.clients.fpfl_data import FPFLShard
from fedparity.clients.fpfl_task import (
    build_cnn,
    build_fpfl_model,
    build_mlp,
    clip_statistics,
    get_flat_parameters,
    num_parameters,
    output_activation,
    pooled_statistics,
    predict,
    set_flat_parameters,
    shard_contribution,
    statistics_layout,
    unflatten_parameters,
    user_statistics,
    user_statistics_loop,
)
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users
from tests.support.import_probe import last_line_printed

# Vectorised vs loop: the same float32 per-sample terms summed in a different order over a
# user's few samples; entries are <= ~10 in size, so differences are ~1e-6 at most.
VECTOR_TOLERANCE = 1e-5


def _image_shard(num_users: int, seed: int) -> FPFLShard:
    """A small 3-group, 4-class image population (3 x 8 x 8) for the CNN."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, size=num_users)
    n = int(sizes.sum())
    return FPFLShard(
        features=rng.random((n, 3, 8, 8), dtype=np.float32),
        labels=rng.integers(0, 4, size=n).astype(np.int64),
        groups=rng.integers(0, 3, size=n).astype(np.int64),
        user_index=np.repeat(np.arange(num_users, dtype=np.int64), sizes),
        user_ids=np.arange(num_users, dtype=np.int64) + 100,
        num_groups=3,
        num_classes=4,
    )


@pytest.mark.parametrize(
    ("constraint", "architecture", "num_groups", "num_classes"),
    [
        ("fnr", "shallow", 2, 2),
        ("fnr", "deep", 3, 2),
        ("accuracy", "shallow", 2, 2),
        ("accuracy", "deep", 3, 6),
    ],
)
def test_vectorised_statistics_equal_the_per_user_loop(
    constraint: str, architecture: str, num_groups: int, num_classes: int
) -> None:
    shard = synthetic_fpfl_users(
        60, seed=1, num_features=7, num_groups=num_groups, num_classes=num_classes
    )
    model = build_fpfl_model(architecture, 7, num_classes=num_classes, seed=3)
    # Several chunks of samples, with users split between chunks: rows must land in place.
    fast = user_statistics(model, shard, constraint=constraint, chunk_samples=7)
    slow = user_statistics_loop(model, shard, constraint=constraint)
    layout = statistics_layout(model, num_groups)
    assert fast.shape == slow.shape == (shard.num_users, layout.size)
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, slow, rtol=VECTOR_TOLERANCE, atol=VECTOR_TOLERANCE)
    # Counts are exact.
    counts = layout.block("constraint_counts")
    torch.testing.assert_close(fast[:, counts], slow[:, counts], rtol=0, atol=0)
    np.testing.assert_array_equal(
        fast[:, layout.block("num_samples")].numpy().ravel(), shard.samples_per_user()
    )


def test_vectorised_statistics_for_the_cnn_and_a_cohort_subset() -> None:
    shard = _image_shard(25, seed=2)
    model = build_cnn(in_channels=3, image_size=8, num_classes=4, seed=0)
    cohort = [7, 3, 20, 11]
    fast = user_statistics(model, shard, constraint="accuracy", users=cohort)
    slow = user_statistics_loop(model, shard, constraint="accuracy", users=cohort)
    torch.testing.assert_close(fast, slow, rtol=VECTOR_TOLERANCE, atol=VECTOR_TOLERANCE)
    # Row order follows ``users`` (float32 convolutions may round differently with another
    # batch size, hence the same tolerance).
    alone = user_statistics(model, shard, constraint="accuracy", users=[3])
    torch.testing.assert_close(fast[1:2], alone, rtol=VECTOR_TOLERANCE, atol=VECTOR_TOLERANCE)


def test_surrogate_values_follow_eq_13_and_14() -> None:
    shard = synthetic_fpfl_users(40, seed=4, num_features=5, num_groups=2)
    model = build_fpfl_model("shallow", 5, seed=0)
    layout = statistics_layout(model, 2)
    with torch.no_grad():
        p = model(torch.from_numpy(shard.features)).reshape(-1).double().numpy()
    fnr = layout.split(pooled_statistics(model, shard, constraint="fnr"))
    acc = layout.split(pooled_statistics(model, shard, constraint="accuracy"))
    y, a = shard.labels, shard.groups
    for group in range(2):
        positives = (y == 1) & (a == group)
        assert fnr.surrogate_sums[group] == pytest.approx(np.sum(1 - p[positives]), rel=1e-5)
        correct = np.where(y == 1, p, 1 - p)[a == group]
        assert acc.surrogate_sums[group] == pytest.approx(np.sum(correct), rel=1e-5)
        errors = (p >= 0.5).astype(int) != y
        assert fnr.group_errors[group] == np.sum(errors & positives)
        assert acc.group_errors[group] == np.sum(errors & (a == group))
    assert fnr.num_errors == np.sum((p >= 0.5).astype(int) != y)
    cross_entropy = -np.sum(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert fnr.loss_sum == pytest.approx(cross_entropy, rel=1e-5)


def test_clipping_bound_holds_and_small_vectors_are_unchanged() -> None:
    shard = synthetic_fpfl_users(300, seed=5, num_features=6, num_groups=2)
    model = build_fpfl_model("shallow", 6, seed=1)
    vectors = user_statistics(model, shard, constraint="fnr")
    bound = float(torch.quantile(torch.linalg.vector_norm(vectors, dim=1), 0.5))
    clipped = clip_statistics(vectors, bound)
    norms_after = torch.linalg.vector_norm(clipped.vectors, dim=1)
    assert torch.all(norms_after <= bound * (1 + 1e-6))
    torch.testing.assert_close(clipped.norms, torch.linalg.vector_norm(vectors, dim=1))
    small = clipped.norms <= bound
    assert 0 < int(small.sum()) < shard.num_users  # both branches are exercised
    assert torch.equal(clipped.vectors[small], vectors[small])  # bit for bit
    big = ~small
    # Clipped vectors keep their direction and land on the sphere of radius C.
    torch.testing.assert_close(norms_after[big], torch.full_like(norms_after[big], bound))
    cosine = (clipped.vectors[big] * vectors[big]).sum(1) / (norms_after[big] * clipped.norms[big])
    torch.testing.assert_close(cosine, torch.ones_like(cosine))
    assert clipped.clipped_fraction == pytest.approx(float(big.double().mean()))

    contribution = shard_contribution(model, shard, constraint="fnr", clipping_bound=bound)
    np.testing.assert_allclose(contribution.total, clipped.vectors.sum(0).numpy(), atol=1e-9)
    assert contribution.num_users == shard.num_users
    assert contribution.clipped_fraction == pytest.approx(clipped.clipped_fraction)


def test_clipping_zero_vector_and_bad_bound() -> None:
    zero = torch.zeros(2, 5, dtype=torch.float64)
    assert torch.equal(clip_statistics(zero, 1.0).vectors, zero)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="clipping_bound"):
            clip_statistics(zero, bad)


def test_flatten_round_trip() -> None:
    model = build_fpfl_model("deep", 9, seed=0)
    assert num_parameters(model) == 9 * 16 + 16 + 16 * 8 + 8 + 8 * 8 + 8 + 8 + 1
    flat = get_flat_parameters(model)
    assert flat.dtype == np.float64 and flat.shape == (num_parameters(model),)
    shifted = flat + np.arange(flat.size) * 1e-3
    set_flat_parameters(model, shifted)
    np.testing.assert_allclose(get_flat_parameters(model), shifted, atol=1e-7)
    pieces = unflatten_parameters(model, torch.from_numpy(shifted))
    assert [name for name, _ in model.named_parameters()] == list(pieces)
    assert pieces["0.weight"].shape == (16, 9)
    with pytest.raises(ValueError, match="vector"):
        set_flat_parameters(model, shifted[:-1])


def test_models_are_seeded_and_leave_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = get_flat_parameters(build_fpfl_model("shallow", 5, seed=7))
    b = get_flat_parameters(build_fpfl_model("shallow", 5, seed=7))
    c = get_flat_parameters(build_fpfl_model("shallow", 5, seed=8))
    assert torch.equal(state, torch.random.get_rng_state())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    shallow = build_fpfl_model("shallow", 5)
    assert isinstance(shallow[-1], nn.Sigmoid) and shallow[0].out_features == 10
    multi = build_mlp(5, (4,), num_classes=3)
    assert isinstance(multi[-1], nn.Softmax) and multi[-2].out_features == 3
    cnn = build_cnn(in_channels=3, image_size=28, num_classes=10)
    assert cnn(torch.zeros(2, 3, 28, 28)).shape == (2, 10)


def test_predict_matches_the_probability_threshold() -> None:
    shard = synthetic_fpfl_users(30, seed=6, num_features=4)
    model = build_fpfl_model("shallow", 4, seed=2)
    with torch.no_grad():
        p = model(torch.from_numpy(shard.features)).reshape(-1).numpy()
    np.testing.assert_array_equal(predict(model, shard.features, batch_size=7), p >= 0.5)


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Linear(4, 1)),  # logits, no probability output
        nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=0)),  # softmax over the batch
        nn.Linear(4, 1),  # not a Sequential: the last module cannot be checked
        nn.Sequential(nn.Linear(4, 1), nn.Sigmoid(), nn.Identity()),
    ],
)
def test_models_without_probability_output_are_rejected(model: nn.Module) -> None:
    shard = synthetic_fpfl_users(5, seed=0, num_features=4)
    with pytest.raises(ValueError, match="model"):
        output_activation(model)
    with pytest.raises(ValueError, match="model"):
        user_statistics(model, shard, constraint="fnr")


def test_constraint_and_label_checks() -> None:
    binary = synthetic_fpfl_users(5, seed=0, num_features=4)
    multi = synthetic_fpfl_users(5, seed=0, num_features=4, num_classes=3)
    with pytest.raises(ValueError, match="constraint"):
        user_statistics(build_fpfl_model("shallow", 4), binary, constraint="tpr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="constraint"):
        user_statistics(build_mlp(4, (3,), num_classes=3), multi, constraint="fnr")
    with pytest.raises(ValueError, match="num_classes"):
        user_statistics(build_fpfl_model("shallow", 4), multi, constraint="accuracy")
    with pytest.raises(ValueError, match="architecture"):
        build_fpfl_model("wide", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="users"):
        user_statistics(build_fpfl_model("shallow", 4), binary, constraint="fnr", users=[9])


def test_user_without_samples_gets_a_zero_row() -> None:
    shard = synthetic_fpfl_users(6, seed=3, num_features=4)
    keep = shard.user_index != 2
    holey = FPFLShard(
        features=shard.features[keep],
        labels=shard.labels[keep],
        groups=shard.groups[keep],
        user_index=shard.user_index[keep],
        user_ids=shard.user_ids,
        num_groups=2,
        num_classes=2,
    )
    model = build_fpfl_model("shallow", 4, seed=0)
    vectors = user_statistics(model, holey, constraint="fnr")
    assert not vectors[2].any()
    torch.testing.assert_close(
        vectors, user_statistics_loop(model, holey, constraint="fnr"), rtol=1e-5, atol=1e-5
    )


def test_per_user_statistics_refuse_batch_norm_and_leave_the_model_as_it_was() -> None:
    # Batch norm makes a sample's output depend on the other samples: no per-user statistics.
    shard = synthetic_fpfl_users(20, seed=1, num_features=7, num_groups=2)
    batch_norm = nn.Sequential(
        nn.Linear(7, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1), nn.Sigmoid()
    )
    with pytest.raises(ValueError, match="buffers"):
        user_statistics(batch_norm, shard, constraint="fnr")
    model = build_fpfl_model("shallow", 7, seed=0)
    before = get_flat_parameters(model)
    user_statistics(model, shard, constraint="fnr")
    assert all(parameter.grad is None for parameter in model.parameters())
    np.testing.assert_array_equal(get_flat_parameters(model), before)


def test_per_user_statistics_load_nothing_beyond_torch() -> None:
    # A deployed SuperNode starts a process for every message: the statistics must not load
    # Opacus (1.4 s here) or scipy. A fresh interpreter: this process loaded both long ago.
    probe = (
        "import sys; "
        "from fedparity.clients.project.fpfl_data import synthetic_fpfl_users; "
        "from fedparity.clients.fpfl_task import build_fpfl_model, user_statistics; "
        "shard = synthetic_fpfl_users(5, seed=1, num_features=3, num_groups=2); "
        "user_statistics(build_fpfl_model('shallow', 3, seed=0), shard, constraint='fnr'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'opacus', 'scipy'}))"
    )
    assert last_line_printed(probe) == "[]"
