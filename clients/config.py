"""The run configuration: one typed, validated view of ``context.run_config``.

Keys are the kebab-case keys of ``[tool.flwr.app.config]`` in pyproject.toml (defaults) and
of the experiment files in ``configs/`` (``flwr run . --run-config configs/<name>.toml``).
:func:`RunConfig.from_mapping` rejects unknown keys and out-of-range values with a message
naming the key, before any work starts; clients and server parse the same way.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..mechanisms.accounting import BUDGET_TOLERANCE
from ..mechanisms.mmdm import CONSTRAINT_ACTIVATIONS as FPFL_CONSTRAINT_ACTIVATIONS
from .data import DATASETS
from .task import METRIC_NAMES

TASKS = ("ldp-audit", "fedevalfair", "fpfl")
#: The six algorithms of paper 004, Table 2: (MMDM?, clip?, noise?).
FPFL_ALGORITHMS: dict[str, tuple[bool, bool, bool]] = {
    "fl": (False, False, False),
    "fl-clip": (False, True, False),
    "pfl": (False, True, True),
    "ffl": (True, False, False),
    "ffl-clip": (True, True, False),
    "fpfl": (True, True, True),
}
FPFL_ARCHITECTURES = ("shallow", "deep", "cnn")
#: Data sets of the FPFL job only (unfair digits: 3 writer groups, 10 classes, images).
FPFL_ONLY_DATASETS = ("digits",)
FPFL_CONSTRAINTS = ("fnr", "accuracy")
FPFL_MODEL_SELECTIONS = ("best", "last")
FPFL_ACCOUNTANTS = ("rdp", "prv")
FPFL_NOISE = ("distributed", "central")
FPFL_SECURE_SUM = ("masking", "none")
FEF_SPLITS = ("doctorate", "dirichlet")
FEF_VARIANTS = ("trained", "fair")
FEF_MODES = ("calibrated", "paper")
MECHANISM_CHOICES = ("R", "L", "best")
GROUP_SIZE_MODES = ("estimated", "known")


class ConfigError(ValueError):
    """A run-config key is missing, unknown or out of range."""


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def _as_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}") from None
    if not number.is_integer() or number < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(number)


def _as_float(key: str, value: Any, *, low: float, high: float, open_low: bool = True) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a number, got {value!r}") from None
    inside = (number > low if open_low else number >= low) and number < high
    if not math.isfinite(number) or not inside:
        bracket = "(" if open_low else "["
        raise ConfigError(f"{key} must be in {bracket}{low:g}, {high:g}), got {value!r}")
    return number


def _as_choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)


def _as_epsilons(key: str, value: Any) -> tuple[float, ...]:
    parts = [part.strip() for part in str(value).split(",") if part.strip()]
    if not parts:
        raise ConfigError(f'{key} must list at least one epsilon, e.g. "0.5,1,2"')
    epsilons = tuple(
        _as_float(f"{key} (entry {index + 1})", part, low=0.0, high=math.inf)
        for index, part in enumerate(parts)
    )
    return epsilons


def _as_optional(key: str, value: Any, parse: Any) -> Any:
    """``parse(key, value)``, or None for "" (the key's documented "not set")."""
    if value == "" or value is None:
        return None
    return parse(key, value)


def _fpfl_values(get: Mapping[str, Any], default: RunConfig) -> dict[str, Any]:
    """The ``fpfl-*`` keys (task = "fpfl"; paper 004, SPEC 3)."""

    def positive(key: str) -> float:
        name = key.replace("-", "_")
        return _as_float(key, get.get(name, getattr(default, name)), low=0.0, high=math.inf)

    def nonnegative(key: str) -> float:
        name = key.replace("-", "_")
        value = get.get(name, getattr(default, name))
        return _as_float(key, value, low=0.0, high=math.inf, open_low=False)

    def fraction(key: str) -> float:  # in [0, 1)
        name = key.replace("-", "_")
        value = get.get(name, getattr(default, name))
        return _as_float(key, value, low=0.0, high=1.0, open_low=False)

    def choice(key: str, allowed: tuple[str, ...]) -> str:
        name = key.replace("-", "_")
        return _as_choice(key, get.get(name, getattr(default, name)), allowed)

    def integer(key: str, minimum: int) -> int:
        name = key.replace("-", "_")
        return _as_int(key, get.get(name, getattr(default, name)), minimum)

    return {
        "fpfl_algorithm": choice("fpfl-algorithm", tuple(FPFL_ALGORITHMS)),
        "fpfl_architecture": choice("fpfl-architecture", FPFL_ARCHITECTURES),
        "fpfl_constraint": choice("fpfl-constraint", FPFL_CONSTRAINTS),
        "fpfl_alpha": nonnegative("fpfl-alpha"),
        "fpfl_learning_rate": positive("fpfl-learning-rate"),
        "fpfl_multiplier_learning_rate": positive("fpfl-multiplier-learning-rate"),
        "fpfl_damping": nonnegative("fpfl-damping"),
        "fpfl_statistics_smoothing": fraction("fpfl-statistics-smoothing"),
        "fpfl_constraint_activation": choice(
            "fpfl-constraint-activation", FPFL_CONSTRAINT_ACTIVATIONS
        ),
        "fpfl_model_selection": choice("fpfl-model-selection", FPFL_MODEL_SELECTIONS),
        "fpfl_cohort_size": integer("fpfl-cohort-size", 1),
        "fpfl_rounds": integer("fpfl-rounds", 1),
        "fpfl_clipping_bound": positive("fpfl-clipping-bound"),
        "fpfl_epsilon": positive("fpfl-epsilon"),
        "fpfl_delta": _as_optional(
            "fpfl-delta",
            get.get("fpfl_delta", ""),
            lambda key, value: _as_float(key, value, low=0.0, high=1.0),
        ),
        "fpfl_accountant": choice("fpfl-accountant", FPFL_ACCOUNTANTS),
        "fpfl_noise": choice("fpfl-noise", FPFL_NOISE),
        "fpfl_dropout_tolerance": fraction("fpfl-dropout-tolerance"),
        "fpfl_secure_sum": choice("fpfl-secure-sum", FPFL_SECURE_SUM),
        "fpfl_client_seed": _as_optional(
            "fpfl-client-seed",
            get.get("fpfl_client_seed", ""),
            lambda key, value: _as_int(key, value, 0),
        ),
        "fpfl_resume": _as_bool("fpfl-resume", get.get("fpfl_resume", default.fpfl_resume)),
        "fpfl_stop_after": integer("fpfl-stop-after", 0),
        "fpfl_checkpoint_every": integer("fpfl-checkpoint-every", 1),
    }


def _check_fpfl(config: RunConfig) -> None:
    """Cross-key rules of the FPFL job (and of its only data set, digits)."""
    if config.dataset in FPFL_ONLY_DATASETS and config.task != "fpfl":
        raise ConfigError(f'dataset = "{config.dataset}" is for task = "fpfl" only')
    if config.task != "fpfl":
        return
    if config.fpfl_resume and not config.output_dir.strip():
        raise ConfigError(
            "fpfl-resume = true needs output-dir: the checkpoint and the privacy ledger of the "
            "run to resume are read from it (an empty output-dir means a new folder per run)"
        )
    images = config.dataset == "digits"
    if images != (config.fpfl_architecture == "cnn"):
        raise ConfigError(
            'fpfl-architecture must be "cnn" for dataset = "digits" (images) and "shallow" or '
            f'"deep" otherwise; got {config.fpfl_architecture!r} for {config.dataset!r}'
        )
    if images and config.num_groups != 3:
        raise ConfigError('num-groups must be 3 for dataset = "digits" (writer groups)')
    if images and config.fpfl_constraint == "fnr":
        raise ConfigError(
            'fpfl-constraint = "fnr" needs binary labels; dataset = "digits" has 10 classes: '
            'use "accuracy"'
        )


def _as_optional_tolerance(key: str, value: Any) -> float | None:
    """An equivalence tolerance >= 0, or "" for none."""
    if value == "" or value is None:
        return None
    return _as_float(key, value, low=0.0, high=1.0, open_low=False)


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration (see pyproject.toml for every key's meaning)."""

    task: str = "ldp-audit"
    dataset: str = "synthetic"
    data_dir: str = ""
    download: bool = False
    users_per_node: int = 5000
    num_groups: int = 2
    seed: int = 42
    num_server_rounds: int = 3
    local_epochs: int = 1
    learning_rate: float = 0.1
    metric: str = "accuracy"
    mechanism: str = "best"
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    confidence: float = 0.95
    user_budget: float = 10.0
    group_sizes: str = "estimated"
    ground_truth: bool = True
    output_dir: str = ""
    reply_timeout: float = 600.0
    min_nodes: int = 1
    node_wait_timeout: float = 120.0
    fef_split: str = "dirichlet"
    fef_variant: str = "trained"
    fef_mode: str = "calibrated"
    fef_alpha: float = 0.05
    fef_mu0: float = 0.0
    fef_tolerance: float | None = None
    fef_resamples: int = 100
    fef_public_context: str = ""
    fef_key_holders: int = 2
    fef_min_cell: int = 5
    fef_dirichlet_alpha: float = 1.0
    fpfl_algorithm: str = "fpfl"
    fpfl_architecture: str = "shallow"
    fpfl_constraint: str = "fnr"
    fpfl_alpha: float = 0.02
    fpfl_learning_rate: float = 0.1
    fpfl_multiplier_learning_rate: float = 0.01
    fpfl_damping: float = 2.0
    fpfl_statistics_smoothing: float = 0.0
    fpfl_constraint_activation: str = "surrogate"
    fpfl_model_selection: str = "best"
    fpfl_cohort_size: int = 1000
    fpfl_rounds: int = 250
    fpfl_clipping_bound: float = 2.0
    fpfl_epsilon: float = 2.0
    fpfl_delta: float | None = None
    fpfl_accountant: str = "rdp"
    fpfl_noise: str = "distributed"
    fpfl_dropout_tolerance: float = 0.2
    fpfl_secure_sum: str = "masking"
    fpfl_client_seed: int | None = None
    fpfl_resume: bool = False
    fpfl_stop_after: int = 0
    fpfl_checkpoint_every: int = 10

    @property
    def fpfl_uses_mmdm(self) -> bool:
        """MMDM (FFL, FFL + Clip, FPFL) rather than plain FederatedSGD."""
        return FPFL_ALGORITHMS[self.fpfl_algorithm][0]

    @property
    def fpfl_clips(self) -> bool:
        """Per-user vectors clipped to ``fpfl-clipping-bound``."""
        return FPFL_ALGORITHMS[self.fpfl_algorithm][1]

    @property
    def fpfl_private(self) -> bool:
        """Gaussian noise on the cohort sum (PFL, FPFL): user-level (epsilon, delta)-DP."""
        return FPFL_ALGORITHMS[self.fpfl_algorithm][2]

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The accepted kebab-case keys."""
        return tuple(field.name.replace("_", "-") for field in fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> RunConfig:
        """Parse ``context.run_config`` (missing keys take the defaults above)."""
        unknown = sorted(set(mapping) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                f"unknown run-config key(s) {', '.join(unknown)}; known keys: "
                f"{', '.join(cls.keys())}"
            )
        get = {key.replace("-", "_"): value for key, value in mapping.items()}
        default = cls()
        values: dict[str, Any] = {
            "task": _as_choice("task", get.get("task", default.task), TASKS),
            "dataset": _as_choice(
                "dataset", get.get("dataset", default.dataset), DATASETS + FPFL_ONLY_DATASETS
            ),
            "data_dir": str(get.get("data_dir", default.data_dir)),
            "download": _as_bool("download", get.get("download", default.download)),
            "users_per_node": _as_int(
                "users-per-node", get.get("users_per_node", default.users_per_node), 1
            ),
            "num_groups": _as_int("num-groups", get.get("num_groups", default.num_groups), 2),
            "seed": _as_int("seed", get.get("seed", default.seed), 0),
            "num_server_rounds": _as_int(
                "num-server-rounds", get.get("num_server_rounds", default.num_server_rounds), 0
            ),
            "local_epochs": _as_int(
                "local-epochs", get.get("local_epochs", default.local_epochs), 1
            ),
            "learning_rate": _as_float(
                "learning-rate",
                get.get("learning_rate", default.learning_rate),
                low=0.0,
                high=math.inf,
            ),
            "metric": _as_choice("metric", get.get("metric", default.metric), METRIC_NAMES),
            "mechanism": _as_choice(
                "mechanism", get.get("mechanism", default.mechanism), MECHANISM_CHOICES
            ),
            "epsilons": _as_epsilons("epsilons", get.get("epsilons", "0.5,1,2,4")),
            "confidence": _as_float(
                "confidence", get.get("confidence", default.confidence), low=0.0, high=1.0
            ),
            "user_budget": _as_float(
                "user-budget", get.get("user_budget", default.user_budget), low=0.0, high=math.inf
            ),
            "group_sizes": _as_choice(
                "group-sizes", get.get("group_sizes", default.group_sizes), GROUP_SIZE_MODES
            ),
            "ground_truth": _as_bool("ground-truth", get.get("ground_truth", default.ground_truth)),
            "output_dir": str(get.get("output_dir", default.output_dir)),
            "reply_timeout": _as_float(
                "reply-timeout",
                get.get("reply_timeout", default.reply_timeout),
                low=0.0,
                high=math.inf,
            ),
            "min_nodes": _as_int("min-nodes", get.get("min_nodes", default.min_nodes), 1),
            "node_wait_timeout": _as_float(
                "node-wait-timeout",
                get.get("node_wait_timeout", default.node_wait_timeout),
                low=0.0,
                high=math.inf,
            ),
        }
        values.update(
            {
                "fef_split": _as_choice(
                    "fef-split", get.get("fef_split", default.fef_split), FEF_SPLITS
                ),
                "fef_variant": _as_choice(
                    "fef-variant", get.get("fef_variant", default.fef_variant), FEF_VARIANTS
                ),
                "fef_mode": _as_choice(
                    "fef-mode", get.get("fef_mode", default.fef_mode), FEF_MODES
                ),
                "fef_alpha": _as_float(
                    "fef-alpha", get.get("fef_alpha", default.fef_alpha), low=0.0, high=1.0
                ),
                "fef_mu0": _as_float(
                    "fef-mu0",
                    get.get("fef_mu0", default.fef_mu0),
                    low=-1.0,
                    high=1.0,
                    open_low=False,
                ),
                "fef_tolerance": _as_optional_tolerance(
                    "fef-tolerance", get.get("fef_tolerance", "")
                ),
                "fef_resamples": _as_int(
                    "fef-resamples", get.get("fef_resamples", default.fef_resamples), 2
                ),
                "fef_public_context": str(
                    get.get("fef_public_context", default.fef_public_context)
                ),
                "fef_min_cell": _as_int(
                    "fef-min-cell", get.get("fef_min_cell", default.fef_min_cell), 0
                ),
                "fef_key_holders": _as_int(
                    "fef-key-holders", get.get("fef_key_holders", default.fef_key_holders), 1
                ),
                "fef_dirichlet_alpha": _as_float(
                    "fef-dirichlet-alpha",
                    get.get("fef_dirichlet_alpha", default.fef_dirichlet_alpha),
                    low=0.0,
                    high=math.inf,
                ),
            }
        )
        values.update(_fpfl_values(get, default))
        config = cls(**values)
        if config.dataset == "adult" and config.num_groups != 2:
            raise ConfigError('num-groups must be 2 for dataset = "adult" (groups: sex)')
        _check_fpfl(config)
        total = sum(config.epsilons)
        if total > config.user_budget + BUDGET_TOLERANCE:
            raise ConfigError(
                f"epsilons sum to {total:g}, more than user-budget = {config.user_budget:g}: "
                "every user would refuse the later audits (sequential composition)"
            )
        if config.group_sizes == "known" and not config.ground_truth:
            raise ConfigError(
                'group-sizes = "known" needs the simulation harness (ground-truth = true): '
                "a real server does not know the group sizes"
            )
        return config

    @classmethod
    def from_toml(cls, path: str | Path, base: Mapping[str, Any] | None = None) -> RunConfig:
        """Parse a ``configs/*.toml`` file over ``base`` (e.g. pyproject's defaults)."""
        with Path(path).open("rb") as handle:
            overrides = tomllib.load(handle)
        return cls.from_mapping({**(base or {}), **overrides})
