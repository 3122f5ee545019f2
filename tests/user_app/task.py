"""The user's own model and data: a logistic regression on rows of a CSV file per node.

File columns: ``user,group,label,x0,x1,...`` (one row per example; a user may have many).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedparity.clients import FPFLShard

NUM_FEATURES = 4


def build_model() -> nn.Module:
    """A logistic regression (FPFL's fairness surrogates need probabilities: Sigmoid last)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 1), nn.Sigmoid())


def load_rows(data_dir: str, partition_id: int) -> dict[str, np.ndarray]:
    table = np.loadtxt(Path(data_dir) / f"part-{partition_id}.csv", delimiter=",", skiprows=1)
    return {
        "user": table[:, 0].astype(np.int64),
        "group": table[:, 1].astype(np.int64),
        "label": table[:, 2].astype(np.int64),
        "features": table[:, 3:].astype(np.float32),
    }


def predict(arrays: ArrayRecord, features: np.ndarray) -> np.ndarray:
    model = build_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        scores = model(torch.from_numpy(features)).reshape(-1)
    return (scores >= 0.5).numpy().astype(np.int64)


def write_population(folder: Path, num_nodes: int, users: int = 300, rows: int = 6) -> None:
    """Each node's own file: group 1's features are noisier, so the model is less accurate
    for it (a real gap)."""
    for node in range(num_nodes):
        rng = np.random.default_rng(500 + node)
        user = np.repeat(np.arange(users) + 1000 * node, rows)
        group = np.repeat(rng.integers(0, 2, size=users), rows)
        label = rng.integers(0, 2, size=user.size)
        noise = np.where(group == 1, 2.0, 0.6)[:, None]
        features = (2 * label - 1)[:, None] * np.ones(NUM_FEATURES) + rng.normal(
            0.0, 1.0, size=(user.size, NUM_FEATURES)
        ) * noise
        header = "user,group,label," + ",".join(f"x{i}" for i in range(NUM_FEATURES))
        table = np.column_stack([user, group, label, features])
        np.savetxt(folder / f"part-{node}.csv", table, delimiter=",", header=header, comments="")


def trained_arrays() -> ArrayRecord:
    """The model the server sends: weights that separate the classes (w = 1, b = 0)."""
    model = build_model()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    return ArrayRecord(model.state_dict())


def users_of(rows: dict[str, np.ndarray]) -> FPFLShard:
    """The node's rows as FPFL users (a user's rows share one group)."""
    ids, index = np.unique(rows["user"], return_inverse=True)
    return FPFLShard(
        features=rows["features"],
        labels=rows["label"],
        groups=rows["group"],
        user_index=index.reshape(-1).astype(np.int64),
        user_ids=ids.astype(np.int64),
        num_groups=2,
        num_classes=2,
    )
