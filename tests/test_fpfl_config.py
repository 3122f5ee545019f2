"""FPFL inputs that must fail cleanly, with a message naming the parameter (issue 4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedparity.clients.fpfl_data import check_groups_present
from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.clients.project.fpfl_data import synthetic_fpfl_users
from fedparity.mechanisms.crypto.secure_sum import minimum_survivors
from fedparity.server.api import run_simulation_job
from fedparity.server.app import run_job
from fedparity.server.fpfl_job import cohort_sample_rate


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("fpfl-epsilon", 0, "fpfl-epsilon must be in (0"),
        ("fpfl-epsilon", -1, "fpfl-epsilon"),
        ("fpfl-epsilon", "nan", "fpfl-epsilon"),
        ("fpfl-delta", 0, "fpfl-delta must be in (0, 1)"),
        ("fpfl-delta", 1, "fpfl-delta must be in (0, 1)"),
        ("fpfl-clipping-bound", 0, "fpfl-clipping-bound must be in (0"),
        ("fpfl-clipping-bound", -2, "fpfl-clipping-bound"),
        ("fpfl-alpha", -0.01, "fpfl-alpha must be in [0"),
        ("fpfl-damping", -1, "fpfl-damping must be in [0"),
        ("fpfl-learning-rate", 0, "fpfl-learning-rate must be in (0"),
        ("fpfl-multiplier-learning-rate", -0.1, "fpfl-multiplier-learning-rate"),
        ("fpfl-cohort-size", 0, "fpfl-cohort-size must be an integer >= 1"),
        ("fpfl-rounds", 0, "fpfl-rounds must be an integer >= 1"),
        ("fpfl-algorithm", "sgd", "fpfl-algorithm must be one of fl, fl-clip, pfl"),
        ("fpfl-accountant", "gdp", "fpfl-accountant must be one of rdp, prv"),
        ("fpfl-noise", "local", "fpfl-noise must be one of distributed, central"),
        ("fpfl-dropout-tolerance", 1.0, "fpfl-dropout-tolerance must be in [0, 1)"),
        ("fpfl-client-seed", -1, "fpfl-client-seed must be an integer >= 0"),
        ("fpfl-statistics-smoothing", 1.0, "fpfl-statistics-smoothing must be in [0, 1)"),
        ("fpfl-statistics-smoothing", -0.1, "fpfl-statistics-smoothing must be in [0, 1)"),
        ("fpfl-constraint-activation", "hard", "fpfl-constraint-activation must be one of"),
        ("fpfl-model-selection", "first", "fpfl-model-selection must be one of best, last"),
    ],
)
def test_bad_fpfl_values_are_named(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"task": "fpfl", key: value})
    assert message in str(error.value)


def test_cross_key_rules() -> None:
    with pytest.raises(ConfigError, match='fpfl-architecture must be "cnn"'):
        RunConfig.from_mapping({"task": "fpfl", "dataset": "digits", "num-groups": 3})
    with pytest.raises(ConfigError, match="needs binary labels"):
        RunConfig.from_mapping(
            {
                "task": "fpfl",
                "dataset": "digits",
                "num-groups": 3,
                "fpfl-architecture": "cnn",
                "fpfl-constraint": "fnr",
            }
        )
    with pytest.raises(ConfigError, match='"digits" is for task = "fpfl" only'):
        RunConfig.from_mapping({"dataset": "digits"})


def test_cohort_larger_than_the_population_is_refused() -> None:
    config = RunConfig.from_mapping({"task": "fpfl", "fpfl-cohort-size": 1000})
    assert cohort_sample_rate(config, 4000) == 0.25
    assert cohort_sample_rate(config, 1000) == 1.0
    with pytest.raises(ConfigError, match=r"fpfl-cohort-size \(m = 1000\) must be <= .* K = 999"):
        cohort_sample_rate(config, 999)


def test_a_group_without_members_is_refused() -> None:
    population = synthetic_fpfl_users(50, seed=0, num_groups=3)
    alone = population.select_users(np.flatnonzero(np.bincount(population.user_index) > 0))
    groups = np.where(alone.groups == 2, 0, alone.groups)
    shard = type(alone)(
        features=alone.features,
        labels=alone.labels,
        groups=groups,
        user_index=alone.user_index,
        user_ids=alone.user_ids,
        num_groups=3,
        num_classes=2,
    )
    with pytest.raises(ValueError, match=r"groups: group\(s\) \[2\] have no member"):
        check_groups_present(shard)


@pytest.mark.parametrize(
    ("nodes", "tolerance", "expected"), [(10, 0.2, 8), (4, 0.25, 3), (4, 0.2, 4), (1, 0.0, 1)]
)
def test_minimum_survivors(nodes: int, tolerance: float, expected: int) -> None:
    """n_min = ceil((1 - rho) n): the fewest nodes allowed to survive a round."""
    assert minimum_survivors(nodes, tolerance) == expected


def test_minimum_survivors_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="dropout_tolerance must be in"):
        minimum_survivors(4, 1.0)
    with pytest.raises(ValueError, match="num_nodes"):
        minimum_survivors(0, 0.2)


def test_resume_without_output_dir_is_refused_before_any_work(tmp_path: Path) -> None:
    """fpfl-resume reads the checkpoint and the privacy ledger from output-dir; with an empty
    one (a new folder per run) there is nothing to resume: ConfigError before any work (the
    grid is never touched)."""
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="fpfl-resume = true needs output-dir"):
            RunConfig.from_mapping({"task": "fpfl", "fpfl-resume": True, "output-dir": empty})
    with pytest.raises(ConfigError, match="fpfl-resume = true needs output-dir"):
        run_job(None, {"task": "fpfl", "fpfl-resume": "true"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fpfl-resume = true needs output-dir"):
        run_simulation_job({"task": "fpfl", "fpfl-resume": True}, num_supernodes=2)
    config = RunConfig.from_mapping(
        {"task": "fpfl", "fpfl-resume": True, "output-dir": str(tmp_path)}
    )
    assert config.fpfl_resume and config.output_dir == str(tmp_path)
    assert not RunConfig.from_mapping({"task": "fpfl"}).fpfl_resume  # default: no resume
