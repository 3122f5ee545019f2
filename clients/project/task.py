"""Model, training and per-user evaluation (the Flower quickstart "task" module).

The model maps a feature vector to one logit. :func:`evaluate_users` turns a trained model into
per-user metrics (accuracy, TPR, FPR, FNR), vectorised over the users of a
:class:`~fedparity.clients.shards.UserShard`; :func:`group_gap_truth` gives the exact (non-private)
per-group means and gap used as ground truth by the simulation harness.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from ...mechanisms.ldp.metrics import METRIC_NAMES, UserRates, user_rates
from ...mechanisms.validation import check_int
from ..fpfl_task import init_uniform, uninitialized
from ..shards import UserShard

__all__ = [
    "METRIC_NAMES",
    "UserMetrics",
    "build_model",
    "evaluate_users",
    "get_arrays",
    "group_gap_truth",
    "metric_values",
    "predict_samples",
    "set_arrays",
    "train",
]


def build_model(num_features: int, hidden: int = 0, *, seed: int = 0) -> nn.Module:
    """A binary classifier returning one logit per sample, shape ``(batch, 1)``.

    ``hidden = 0`` gives a logistic regression (one ``Linear`` layer), otherwise one hidden ReLU
    layer of width ``hidden``. Initial weights are ``Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))``
    (PyTorch's ``Linear`` default) drawn from a ``torch.Generator`` seeded with ``seed``: no
    global RNG is used or touched.
    """
    num_features = check_int("num_features", num_features, minimum=1)
    hidden = check_int("hidden", hidden, minimum=0)
    if hidden == 0:
        layers: list[nn.Module] = [uninitialized(nn.Linear, num_features, 1)]
    else:
        layers = [
            uninitialized(nn.Linear, num_features, hidden),
            nn.ReLU(),
            uninitialized(nn.Linear, hidden, 1),
        ]
    init_uniform(layers, seed)
    return nn.Sequential(*layers)


def get_arrays(model: nn.Module) -> list[NDArray[Any]]:
    """The model's parameters and buffers as NumPy copies, in ``state_dict`` order."""
    return [tensor.detach().cpu().numpy().copy() for tensor in model.state_dict().values()]


def set_arrays(model: nn.Module, arrays: Sequence[NDArray[Any]]) -> None:
    """Load ``arrays`` (in ``state_dict`` order, as from :func:`get_arrays`) into ``model``."""
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ValueError(f"arrays must hold {len(state)} arrays (state_dict), got {len(arrays)}")
    new_state: dict[str, torch.Tensor] = {}
    for position, ((key, current), array) in enumerate(zip(state.items(), arrays, strict=True)):
        array = np.asarray(array)
        if tuple(array.shape) != tuple(current.shape):
            raise ValueError(
                f"arrays[{position}] ({key!r}) must have shape {tuple(current.shape)}, "
                f"got {tuple(array.shape)}"
            )
        new_state[key] = torch.as_tensor(array, dtype=current.dtype).clone()
    model.load_state_dict(new_state, strict=True)


def train(
    model: nn.Module,
    shard: UserShard,
    *,
    epochs: int,
    learning_rate: float,
    batch_size: int = 256,
    seed: int,
) -> float:
    """Train ``model`` in place on all samples of ``shard``; return the mean training loss.

    Plain SGD on ``BCEWithLogitsLoss`` (mean over the batch), ``epochs`` passes over the shuffled
    samples. The step is :class:`torch.optim.SGD`'s without momentum or weight decay
    (``p -= lr * grad``), written out: creating a torch optimizer imports TorchDynamo, about 1.2
    CPU-s in each new ClientApp process (measured 2026-11-28). Shuffling uses a
    ``torch.Generator`` seeded with ``seed``, so the result is deterministic. Returns the
    sample-weighted mean loss over all epochs (0.0 for an empty shard, which leaves the model
    unchanged).
    """
    epochs = check_int("epochs", epochs, minimum=1)
    if not (isinstance(learning_rate, numbers.Real) and math.isfinite(learning_rate)) or (
        learning_rate <= 0
    ):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if shard.num_samples == 0:
        return 0.0
    features = torch.from_numpy(shard.features)
    targets = torch.from_numpy(shard.labels).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    step_size = float(learning_rate)
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    total_loss = 0.0
    for _ in range(epochs):
        order = torch.randperm(shard.num_samples, generator=generator)
        for start in range(0, shard.num_samples, batch_size):
            batch = order[start : start + batch_size]
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(features[batch]).squeeze(1), targets[batch])
            loss.backward()
            with torch.no_grad():  # torch.optim.SGD's step without momentum or weight decay
                for parameter in parameters:
                    if parameter.grad is not None:
                        parameter.add_(parameter.grad, alpha=-step_size)
            total_loss += float(loss.detach()) * batch.shape[0]
    return total_loss / (epochs * shard.num_samples)


@dataclass(frozen=True)
class UserMetrics(UserRates):
    """Per-user evaluation of a model on a :class:`~fedparity.clients.shards.UserShard`.

    The per-user rates and counts (:class:`~fedparity.mechanisms.ldp.metrics.UserRates`) are
    aligned with the shard's local users, NaN where undefined; ``loss`` and
    ``overall_accuracy`` are over all samples of the shard (NaN for an empty shard).
    """

    loss: float = math.nan
    overall_accuracy: float = math.nan

    @property
    def num_users(self) -> int:
        """Number of users."""
        return int(self.accuracy.shape[0])


def predict_samples(
    model: nn.Module, shard: UserShard, threshold: float = 0.5
) -> tuple[NDArray[np.bool_], float]:
    """Each sample's predicted label (``sigmoid(logit) >= threshold``) and the mean
    binary cross-entropy over the shard (nan without samples)."""
    if not (isinstance(threshold, numbers.Real) and 0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(shard.features)).reshape(-1)
        targets = torch.from_numpy(shard.labels).to(torch.float32)
        loss = (
            float(nn.functional.binary_cross_entropy_with_logits(logits, targets))
            if shard.num_samples
            else math.nan
        )
        return (torch.sigmoid(logits) >= threshold).numpy(), loss


def evaluate_users(model: nn.Module, shard: UserShard, threshold: float = 0.5) -> UserMetrics:
    """Per-user accuracy, TPR, FPR and FNR of ``model`` on ``shard`` (vectorised).

    A sample is predicted positive when ``sigmoid(logit) >= threshold``
    (:func:`predict_samples`). Counts per user come from ``np.bincount`` over
    ``shard.user_index``; rates are ratios of integer counts.
    """
    num_users = shard.num_users
    predictions, loss = predict_samples(model, shard, threshold)
    rates = user_rates(shard.user_index, shard.labels, predictions, num_users)
    num_correct_total = int((predictions == shard.labels.astype(bool)).sum())
    return UserMetrics(
        **{field.name: getattr(rates, field.name) for field in fields(UserRates)},
        loss=loss,
        overall_accuracy=(num_correct_total / shard.num_samples if shard.num_samples else math.nan),
    )


def metric_values(metrics: UserMetrics, name: str) -> NDArray[np.float64]:
    """The per-user array of metric ``name`` in ``'accuracy'``, ``'tpr'``, ``'fpr'``, ``'fnr'``."""
    return metrics.metric(name)


def group_gap_truth(
    user_groups: NDArray[np.integer], values: NDArray[np.floating], num_groups: int
) -> dict[str, Any]:
    """Exact per-group mean of per-user ``values`` (NaN users ignored) and the max gap.

    Returns a dict with

    * ``group_means``: list of ``num_groups`` floats (NaN for a group without defined users),
      each the correctly rounded mean (``math.fsum``) of the group's non-NaN values;
    * ``group_counts``: list of the number of users with a defined value per group;
    * ``max_gap``: ``max(group_means) - min(group_means)`` over groups with a defined mean,
      i.e. the largest pairwise gap (NaN if fewer than two groups have one);
    * ``max_group`` / ``min_group``: the group with the largest / smallest mean (-1 if none).
    """
    num_groups = check_int("num_groups", num_groups, minimum=2)
    groups = np.asarray(user_groups)
    metric = np.asarray(values, dtype=np.float64)
    if groups.ndim != 1 or not np.issubdtype(groups.dtype, np.integer):
        raise ValueError(
            f"user_groups must be a 1-D integer array, got {groups.dtype} {groups.shape}"
        )
    if metric.shape != groups.shape:
        raise ValueError(f"values must have shape {groups.shape}, got {metric.shape}")
    if groups.size and (groups.min() < 0 or groups.max() >= num_groups):
        raise ValueError(f"user_groups values must lie in [0, num_groups={num_groups})")
    defined = ~np.isnan(metric)
    group_means: list[float] = []
    group_counts: list[int] = []
    for group in range(num_groups):
        selected = metric[defined & (groups == group)]
        group_counts.append(int(selected.shape[0]))
        group_means.append(
            math.fsum(selected.tolist()) / selected.shape[0] if selected.size else math.nan
        )
    defined_groups = [g for g in range(num_groups) if not math.isnan(group_means[g])]
    if defined_groups:
        max_group = max(defined_groups, key=lambda g: group_means[g])
        min_group = min(defined_groups, key=lambda g: group_means[g])
    else:
        max_group = min_group = -1
    max_gap = (
        group_means[max_group] - group_means[min_group] if len(defined_groups) >= 2 else math.nan
    )
    return {
        "group_means": group_means,
        "group_counts": group_counts,
        "max_gap": max_gap,
        "max_group": max_group,
        "min_group": min_group,
    }
