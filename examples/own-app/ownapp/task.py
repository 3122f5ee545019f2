"""The app's own model and data: a logistic regression over each node's file of users.

Each node reads ``node-<partition-id>.npz`` from its data folder (node config ``data-dir``,
else ``~/.fedparity/examples/own-app/data``, where ``prepare.py`` writes it). A file holds one
row per user: ``group`` (the protected attribute, 0 or 1), ``label`` and ``features``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

NUM_FEATURES = 4
#: Where prepare.py writes the data and the nodes read it (unless their node config says).
DEFAULT_DATA_DIR = Path.home() / ".fedparity" / "examples" / "own-app" / "data"


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 1), nn.Sigmoid())


def data_file(node_config: dict, partition_id: int) -> Path:
    folder = Path(str(node_config.get("data-dir") or DEFAULT_DATA_DIR)).expanduser()
    return folder / f"node-{partition_id}.npz"


def load_rows(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in ("group", "label", "features")}


def write_population(folder: Path, num_nodes: int, users: int = 800) -> None:
    """Every node's file. Group 1's features are noisier, so the model serves it worse."""
    folder.mkdir(parents=True, exist_ok=True)
    for node in range(num_nodes):
        rng = np.random.default_rng(100 + node)
        group = rng.integers(0, 2, size=users)
        label = rng.integers(0, 2, size=users)
        noise = np.where(group == 1, 2.0, 0.7)[:, None]
        features = (2 * label - 1)[:, None] + rng.normal(0.0, 1.0, (users, NUM_FEATURES)) * noise
        np.savez(
            folder / f"node-{node}.npz",
            group=group,
            label=label,
            features=features.astype(np.float32),
        )


def train(arrays: ArrayRecord, rows: dict[str, np.ndarray], learning_rate: float) -> nn.Module:
    """One epoch of full-batch gradient descent on the node's rows."""
    model = build_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    features = torch.from_numpy(rows["features"])
    labels = torch.from_numpy(rows["label"].astype(np.float32))
    for _ in range(10):
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy(model(features).reshape(-1), labels)
        loss.backward()
        optimizer.step()
    return model


def predict(arrays: ArrayRecord, features: np.ndarray) -> np.ndarray:
    model = build_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        scores = model(torch.from_numpy(features)).reshape(-1)
    return (scores >= 0.5).numpy().astype(np.int64)
