"""benchmarks/fpfl_central.py: central MMDM vs SGD on Adult (the paper's Table 1), short version.

The paper: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021.

Its Table 1: SGD 0.857 accuracy / 0.071 FNR gap, MMDM 0.855 / 0.019 (1,000 iterations of 400).
The test runs 500 iterations of 2,000 rows (~1 s per model); over seeds 0-2 this setting
gave FNR gaps SGD 0.095 +- 0.007 and MMDM 0.005 +- 0.003 (accuracy 0.852 / 0.851), so the
thresholds below leave margins of several standard deviations.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.fpfl_central import CentralConfig, adult_rows, main, torch_threads, train_central
from fedparity.clients.fpfl_data import FPFLShard
from fedparity.clients.project.data import adult_features, load_adult
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users


@pytest.fixture(scope="module")
def adult_shards(adult_path: Path) -> tuple[FPFLShard, FPFLShard]:
    x_train, y_train, x_test, y_test, _, protected = adult_features(load_adult(adult_path))
    return (
        adult_rows(x_train, y_train, protected["train"]["sex"]),
        adult_rows(x_test, y_test, protected["test"]["sex"]),
    )


def test_mmdm_reduces_the_fnr_gap_on_adult(adult_shards: tuple[FPFLShard, FPFLShard]) -> None:
    train, test = adult_shards
    results = {
        algorithm: train_central(
            train,
            test,
            CentralConfig(algorithm=algorithm, iterations=500, batch_size=2000, seed=0),
            num_threads=1,  # tiny model: one thread is robust on a shared CPU
        )
        for algorithm in ("sgd", "mmdm")
    }
    sgd, mmdm = results["sgd"].test, results["mmdm"].test
    assert sgd.fnr_gap > 0.05  # unconstrained training is unfair on Adult
    assert mmdm.fnr_gap < 0.04
    assert mmdm.fnr_gap < 0.5 * sgd.fnr_gap
    assert mmdm.accuracy > sgd.accuracy - 0.01  # at little cost in accuracy
    assert mmdm.eo_gap >= mmdm.fnr_gap  # EO includes the TPR (= FNR) gap
    assert results["mmdm"].multipliers[1] > 0  # the female group's constraint was active
    assert results["sgd"].multipliers == (0.0, 0.0)


def test_training_is_deterministic_for_a_seed() -> None:
    shard = synthetic_fpfl_users(200, seed=0, num_features=5)
    config = CentralConfig(iterations=20, batch_size=64, seed=3)
    first = train_central(shard, shard, config, num_threads=1)
    second = train_central(shard, shard, config)
    assert first.test == second.test
    assert first.multipliers == second.multipliers


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha": -0.1}, "alpha"),
        ({"damping": -2.0}, "damping"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"multiplier_learning_rate": -0.01}, "multiplier_learning_rate"),
        ({"iterations": 0}, "iterations"),
        ({"batch_size": -1}, "batch_size"),
        ({"algorithm": "adam"}, "algorithm"),
        ({"architecture": "wide"}, "architecture"),
    ],
)
def test_config_errors_name_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        CentralConfig(**kwargs)  # type: ignore[arg-type]


def test_a_group_without_positives_is_rejected() -> None:
    shard = synthetic_fpfl_users(100, seed=1, num_features=5)
    labels = np.where(shard.groups == 1, 0, shard.labels)
    no_positive = FPFLShard(
        shard.features, labels, shard.groups, shard.user_index, shard.user_ids, 2, 2
    )
    with pytest.raises(ValueError, match="groups"):
        train_central(no_positive, shard, CentralConfig(iterations=1))


def test_command_line(adult_path: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    output = tmp_path / "table1.json"
    status = main(
        [
            "--data-dir",
            str(adult_path),
            "--architectures",
            "shallow",
            "--iterations",
            "3",
            "--batch-size",
            "400",
            "--output",
            str(output),
        ],
        out=out,
    )
    assert status == 0
    text = out.getvalue()
    assert "| shallow | MMDM | 1 |" in text and "| shallow | SGD | 1 |" in text
    records = json.loads(output.read_text(encoding="utf-8"))
    assert {r["config"]["algorithm"] for r in records} == {"sgd", "mmdm"}
    assert main(["--data-dir", str(tmp_path / "nowhere")], out=io.StringIO()) == 2


def test_torch_threads_is_restored() -> None:
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        with torch_threads(0):
            pass


def test_cnn_on_images_and_architecture_checks() -> None:
    rng = np.random.default_rng(0)
    n = 60
    images = FPFLShard(
        features=rng.random((n, 3, 8, 8), dtype=np.float32),
        labels=rng.integers(0, 4, size=n).astype(np.int64),
        groups=np.arange(n, dtype=np.int64) % 3,
        user_index=np.arange(n, dtype=np.int64),
        user_ids=np.arange(n, dtype=np.int64),
        num_groups=3,
        num_classes=4,
    )
    config = CentralConfig(
        architecture="cnn",
        constraint="accuracy",
        alpha=0.04,
        damping=20.0,
        iterations=3,
        batch_size=0,
    )
    result = train_central(images, images, config, num_threads=1)
    assert len(result.multipliers) == 3
    assert 0.0 <= result.test.accuracy <= 1.0 and np.isnan(result.test.fnr_gap)
    with pytest.raises(ValueError, match="cnn"):
        train_central(images, images, CentralConfig(constraint="accuracy", iterations=1))
    vectors = synthetic_fpfl_users(20, seed=0, num_features=4)
    with pytest.raises(ValueError, match="cnn"):
        train_central(vectors, vectors, CentralConfig(architecture="cnn", iterations=1))
