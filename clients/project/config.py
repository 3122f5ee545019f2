"""The run configuration: one typed, validated view of ``context.run_config``.

Keys are the kebab-case keys of ``[tool.flwr.app.config]`` in pyproject.toml (defaults) and
of the experiment files in ``configs/`` (``flwr run . --run-config configs/<name>.toml``).
:func:`RunConfig.from_mapping` rejects unknown keys and out-of-range values with a message
naming the key, before any work starts; clients and server parse the same way.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from ...mechanisms.fairness_tests.fedevalfair import METRICS as FEF_METRICS
from ...mechanisms.fairness_tests.fedevalfair import Mode
from ...mechanisms.fpfl.mmdm import CONSTRAINT_ACTIVATIONS as FPFL_CONSTRAINT_ACTIVATIONS
from ...mechanisms.fpfl.mmdm import CONSTRAINTS, Constraint
from ...mechanisms.ldp.calibration import MechanismChoice
from ...mechanisms.ldp.frequency_oracle import ORACLES
from ...mechanisms.ldp.metrics import METRIC_NAMES
from ...mechanisms.privacy.basic_ledger import BUDGET_TOLERANCE
from ...mechanisms.privacy.opacus_accounting import AccountantName
from ...mechanisms.protocol import FedEvalFairLayout
from ...mechanisms.validation import parse_int
from .data import DATASETS

if TYPE_CHECKING:
    from ...mechanisms.crypto.ckks.holder_dp import HolderDP

TASKS = ("ldp-audit", "rate-report", "fedevalfair", "fpfl", "pipeline")
#: The jobs that evaluate a global model they train with plain FedAvg (the ``train`` message),
#: unless the server's operator supplies one (``model-file``). FedAvg's updates are not
#: private: a node answers ``train`` only if its own policy has ``allow-non-private``.
FEDAVG_TASKS = ("ldp-audit", "rate-report", "fedevalfair")
#: The two trainings of ``task = "pipeline"``: the fairness-aware one (session ``"fpfl"``,
#: trained with ``fpfl-algorithm``: FPFL, FedFB or FairFed) and its PFL twin (same clipping,
#: noise, rounds and cohort; no fairness update). Each is a session of the FPFL and
#: FedEvalFair protocols.
PIPELINE_SESSIONS = ("fpfl", "pfl")
#: The fairness-aware trainings the pipeline can compare with PFL (its ``"fpfl"`` session):
#: FPFL, FedFB and FairFed, all under the same clipping, noise and epsilon as the PFL twin.
PIPELINE_FAIR_ALGORITHMS = ("fpfl", "fedfb", "fairfed")
#: How reports name each of them.
FAIR_ALGORITHM_LABELS = {"fpfl": "FPFL", "fedfb": "FedFB", "fairfed": "FairFed"}
#: The audited metric that matches each FPFL constraint (the pipeline audits what it trains for).
PIPELINE_METRIC = {"fnr": "fnr", "accuracy": "accuracy"}
#: The six algorithms of Rodriguez-Galvez et al. 2021, Table 2, FedFB (Zeng, Chen and Lee
#: 2021) on the same private sums, and FairFed (Ezzeldin et al. 2023), whose nodes also
#: release their own statistics: (MMDM?, clip?, noise?).
FPFL_ALGORITHMS: dict[str, tuple[bool, bool, bool]] = {
    "fl": (False, False, False),
    "fl-clip": (False, True, False),
    "pfl": (False, True, True),
    "ffl": (True, False, False),
    "ffl-clip": (True, True, False),
    "fpfl": (True, True, True),
    "fedfb": (False, True, True),
    "fairfed": (False, True, True),
}
#: The server's update rule of each algorithm: FederatedSGD, MMDM (FPFL Eq. 10), FedFB's
#: group reweighting (:func:`fedparity.mechanisms.fpfl.fedfb.fedfb_update`) or FairFed's node
#: weights (:mod:`fedparity.mechanisms.fpfl.fairfed`). The nodes read only whether it is
#: FairFed (they then release their own statistics and take scales); what they compute, clip
#: and charge depends on (clip?, noise?) only.
FPFL_UPDATE_RULES: dict[str, str] = {
    "fl": "sgd",
    "fl-clip": "sgd",
    "pfl": "sgd",
    "ffl": "mmdm",
    "ffl-clip": "mmdm",
    "fpfl": "mmdm",
    "fedfb": "fedfb",
    "fairfed": "fairfed",
}
FPFL_ARCHITECTURES = ("shallow", "deep", "cnn")
#: Data sets of the FPFL job only (unfair digits: 3 writer groups, 10 classes, images).
FPFL_ONLY_DATASETS = ("digits",)
FPFL_CONSTRAINTS = CONSTRAINTS
FPFL_MODEL_SELECTIONS = ("best", "last")
FPFL_ACCOUNTANTS: tuple[str, ...] = get_args(AccountantName)
FPFL_NOISE = ("distributed", "central")
FPFL_SECURE_SUM = ("masking", "none")
#: How the FPFL population's users are dealt to the nodes: contiguous blocks of the shuffled
#: users, or per group (of a user's first row) in Dirichlet shares over the nodes.
FPFL_SPLITS = ("iid", "dirichlet")
#: What FairFed's node weights are paired with (the FairFed paper pairs them with local
#: debiasing): nothing, or FedFB's FairBatch reweighting on the server's weighted sums.
FPFL_FAIRFED_DEBIASING = ("none", "fedfb")
FEF_SPLITS = ("doctorate", "dirichlet")
FEF_VARIANTS = ("trained", "fair")
FEF_MODES: tuple[str, ...] = get_args(Mode)
MECHANISM_CHOICES: tuple[str, ...] = get_args(MechanismChoice)
#: ``oracle`` of ``task = "rate-report"``.
ORACLE_CHOICES: tuple[str, ...] = (*ORACLES, "best")
GROUP_SIZE_MODES = ("estimated", "known")


class ConfigError(ValueError):
    """A run-config key is missing, unknown or out of range. The text names the key and the
    value the run config gave: nothing of the node's, so it may reach the server."""

    fixed_text = True


#: Where ``download = true`` puts UCI Adult when ``data-dir`` is empty (outside the project
#: folder: ``flwr run`` packs that folder into the app bundle).
DEFAULT_ADULT_DOWNLOAD_DIR = "~/.fedparity/data/adult"


def _adult_folder(config: RunConfig) -> RunConfig:
    """``dataset = "adult"`` needs the folder with the UCI files: ``data-dir`` (an absolute
    path), or, with ``download = true`` and no ``data-dir``, :data:`DEFAULT_ADULT_DOWNLOAD_DIR`
    (expanded here, so every app of the run on this machine reads the same folder). The run
    config is the only way to name it for a run: the ServerApp and ClientApps of ``flwr run``
    do not see the environment of the command that started it (Flower's managed SuperLink
    keeps its own)."""
    if config.dataset != "adult":
        return config
    if not config.data_dir:
        if config.download:
            return replace(config, data_dir=str(Path(DEFAULT_ADULT_DOWNLOAD_DIR).expanduser()))
        raise ConfigError(
            "data-dir must be the absolute path of the folder with adult.data and adult.test "
            'for dataset = "adult", or set download = true to fetch them from UCI into '
            f"{DEFAULT_ADULT_DOWNLOAD_DIR}; got an empty data-dir"
        )
    if not Path(config.data_dir).expanduser().is_absolute():
        raise ConfigError(
            f"data-dir must be an absolute path (the apps do not run in this folder), "
            f"got {config.data_dir!r}"
        )
    return config


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def _whole_number(key: str, value: Any, minimum: int) -> int:
    """An integer key: TOML's ``3`` or ``3.0``, or the text ``"3"`` (``parse_int``'s rule)."""
    try:
        return parse_int(key, value, minimum=minimum)
    except ValueError as error:
        raise ConfigError(str(error)) from None


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


def _as_fef_metrics(key: str, value: Any) -> str:
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    unknown = [name for name in names if name not in FEF_METRICS]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"{key} must list distinct metrics from {', '.join(FEF_METRICS)}, comma-separated; "
            f"got {value!r}"
        )
    return ",".join(names)


def _as_model_file(key: str, value: Any) -> str:
    """``""`` (train with FedAvg), or the absolute path of a ``.npz`` file (read by the server
    only: a node never opens it)."""
    if not isinstance(value, str):
        raise ConfigError(f'{key} must be "" or the absolute path of a .npz file, got {value!r}')
    if value and (not Path(value).is_absolute() or Path(value).suffix != ".npz"):
        raise ConfigError(
            f'{key} must be "" or the absolute path of a .npz file (the apps do not run in '
            f"this folder), got {value!r}"
        )
    return value


def _as_optional(key: str, value: Any, parse: Any) -> Any:
    """``parse(key, value)``, or None for "" (the key's documented "not set")."""
    if value == "" or value is None:
        return None
    return parse(key, value)


# -- the parsers of the key table: parser(key, raw value) -> value, ConfigError if bad --------


@dataclass(frozen=True)
class Parser:
    """How one key's raw value is read: the parsing function, the value's type and the values
    it allows, in words (the configuration reference shows the last two)."""

    parse: Callable[[str, Any], Any]
    type: str
    allowed: str

    def __call__(self, key: str, value: Any) -> Any:
        return self.parse(key, value)


def _integer(minimum: int) -> Parser:
    return Parser(lambda key, value: _whole_number(key, value, minimum), "integer", f">= {minimum}")


def _number(low: float, high: float, *, open_low: bool = True) -> Parser:
    bracket = "(" if open_low else "["
    high_text = "inf" if math.isinf(high) else f"{high:g}"
    return Parser(
        lambda key, value: _as_float(key, value, low=low, high=high, open_low=open_low),
        "number",
        f"{bracket}{low:g}, {high_text})",
    )


def _choice(allowed: tuple[str, ...]) -> Parser:
    return Parser(
        lambda key, value: _as_choice(key, value, allowed),
        "string",
        " | ".join(f'"{value}"' for value in allowed),
    )


_boolean = Parser(_as_bool, "boolean", "true | false")
_text = Parser(lambda key, value: str(value), "string", "any")
_epsilon_list = Parser(_as_epsilons, "string", "comma-separated numbers > 0")
_fef_metrics = Parser(_as_fef_metrics, "string", "comma-separated FedEvalFair metrics")
_model_file = Parser(_as_model_file, "string", '"" or an absolute path ending in .npz')


def _optional(parse: Parser) -> Parser:
    """``parse``, or None for "" (the key's documented "not set")."""
    return Parser(
        lambda key, value: _as_optional(key, value, parse),
        parse.type,
        f'"" (not set) or {parse.allowed}',
    )


def _key(default: Any, parse: Parser, help: str) -> Any:  # noqa: A002 - the table's column
    """One row of the key table: the field's default, parser and help text."""
    return field(default=default, metadata={"parse": parse, "help": help})


@dataclass(frozen=True)
class ConfigKey:
    """A run-config key as documented: kebab-case name, default, type, allowed values, help."""

    name: str
    default: Any
    type: str
    allowed: str
    help: str


def config_keys() -> tuple[ConfigKey, ...]:
    """Every run-config key with its default, type, allowed values and help, in table order."""
    return tuple(
        ConfigKey(
            item.name.replace("_", "-"),
            item.default,
            item.metadata["parse"].type,
            item.metadata["parse"].allowed,
            item.metadata["help"],
        )
        for item in fields(RunConfig)
    )


def _toml_value(value: Any) -> str:
    """A default as it is written in ``[tool.flwr.app.config]``."""
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return '"' + ",".join(f"{item:g}" for item in value) + '"'
    if isinstance(value, str):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_reference() -> str:
    """The configuration reference (Markdown), generated from the key table.

    ``python -m fedparity.clients.project.config > docs/configuration.md`` writes it; a test
    checks that the file in the repository is up to date.
    """
    lines = [
        "# Run configuration reference",
        "",
        "<!-- Generated from the key table of fedparity.clients.project.config by",
        "     `python -m fedparity.clients.project.config > docs/configuration.md`;",
        "     do not edit. -->",
        "",
        "Every key of `[tool.flwr.app.config]` in `pyproject.toml` (the defaults), of the named",
        "configs in `configs/` and of `flwr run . --run-config`. An unknown key or a value",
        "outside its allowed range stops the run before any work, with a message naming the key.",
        "",
        "| key | type | default | allowed | what it sets |",
        "|---|---|---|---|---|",
    ]
    for key in config_keys():
        cells = (f"`{key.name}`", key.type, f"`{_toml_value(key.default)}`", key.allowed, key.help)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _check_fpfl(config: RunConfig) -> None:
    """Cross-key rules of the FPFL job (and of its only data set, digits)."""
    if config.dataset in FPFL_ONLY_DATASETS and config.task != "fpfl":
        raise ConfigError(f'dataset = "{config.dataset}" is for task = "fpfl" only')
    if config.task == "pipeline":
        _check_pipeline(config)
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


def _check_pipeline(config: RunConfig) -> None:
    """Cross-key rules of the pipeline (train FPFL and PFL, audit both, test both)."""
    if config.fpfl_algorithm not in PIPELINE_FAIR_ALGORITHMS:
        raise ConfigError(
            f"fpfl-algorithm must be one of {', '.join(map(repr, PIPELINE_FAIR_ALGORITHMS))} "
            f'for task = "pipeline", got {config.fpfl_algorithm!r}: the pipeline trains a '
            "fairness-aware model and its PFL twin (the same clipping, noise and rounds "
            "without the fairness update)"
        )
    if config.fpfl_architecture == "cnn":
        raise ConfigError('fpfl-architecture must be "shallow" or "deep" for task = "pipeline"')
    if config.fpfl_resume or config.fpfl_stop_after:
        raise ConfigError(
            'fpfl-resume and fpfl-stop-after are not available for task = "pipeline" (run the '
            'trainings alone with task = "fpfl" to pause and resume)'
        )
    expected = PIPELINE_METRIC[config.fpfl_constraint]
    if config.metric != expected:
        raise ConfigError(
            f'metric must be {expected!r} for task = "pipeline" with fpfl-constraint = '
            f"{config.fpfl_constraint!r} (the audit measures the gap the training constrains), "
            f"got {config.metric!r}"
        )


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration: one typed, declarative table of every key.

    Each field is one kebab-case key (``users_per_node`` is ``users-per-node``); its default,
    its parser (type and allowed values) and its help text live on the field
    (:func:`config_keys` lists them). ``pyproject.toml`` repeats the defaults for
    ``flwr run``; a test checks that the two agree.
    """

    # --- the job and the population -----------------------------------------------------
    task: str = _key("ldp-audit", _choice(TASKS), "the job")
    dataset: str = _key(
        "synthetic", _choice(DATASETS + FPFL_ONLY_DATASETS), "population (digits: FPFL only)"
    )
    data_dir: str = _key(
        "",
        _text,
        'Adult: absolute path of the folder with adult.data/.test ("" with download = true: '
        f"{DEFAULT_ADULT_DOWNLOAD_DIR})",
    )
    download: bool = _key(False, _boolean, "Adult: fetch from UCI into data-dir if absent")
    users_per_node: int = _key(5000, _integer(1), "users simulated by one node")
    num_groups: int = _key(2, _integer(2), "protected groups")
    seed: int = _key(42, _integer(0), "data and training; never the privacy noise")
    # --- training (FedAvg) ----------------------------------------------------------------
    num_server_rounds: int = _key(3, _integer(0), "FedAvg rounds before the audits")
    local_epochs: int = _key(1, _integer(1), "local epochs per FedAvg round")
    learning_rate: float = _key(0.1, _number(0.0, math.inf), "FedAvg local learning rate")
    model_file: str = _key(
        "",
        _model_file,
        "ldp-audit, rate-report, fedevalfair: the model to evaluate, a .npz of its arrays on "
        'the server (`np.savez(path, *get_arrays(model))`); no FedAvg round is run. "" = train '
        "with FedAvg, which nodes answer only with allow-non-private",
    )
    # --- LDP audit ------------------------------------------------------------------------
    metric: str = _key("accuracy", _choice(METRIC_NAMES), "the audited per-user metric")
    mechanism: MechanismChoice = _key(
        "best", _choice(MECHANISM_CHOICES), "M_R (R), M_L (L), M_P (P), M_N (N) or best"
    )
    oracle: str = _key(
        "best",
        _choice(ORACLE_CHOICES),
        "rate-report: the frequency oracle of each user's one joint (group, confusion cell) "
        "report: grr, oue, ss, or best (the smallest variance)",
    )
    epsilons: tuple[float, ...] = _key(
        (0.5, 1.0, 2.0, 4.0), _epsilon_list, 'one audit per value, e.g. "0.5,1,2,4"'
    )
    confidence: float = _key(0.95, _number(0.0, 1.0), "confidence of the gap intervals")
    user_budget: float = _key(
        10.0,
        _number(0.0, math.inf),
        "per-user LDP budget the audits are planned for; each node enforces its own policy's",
    )
    max_users_per_node: int | None = _key(
        None,
        _optional(_integer(1)),
        "ldp-audit, rate-report, pipeline: the most users one node may bring to an audit, "
        'whatever it describes (a node over it is left out, counted in results.json); "" = '
        "4 x the lower median of the sizes the nodes describe",
    )
    group_sizes: str = _key(
        "estimated", _choice(GROUP_SIZE_MODES), "estimated from the reports, or known (harness)"
    )
    ground_truth: bool = _key(True, _boolean, "simulation harness prints the true values")
    output_dir: str = _key("", _text, "absolute path; default ~/.fedparity/runs/<task>-<time>")
    verbose: bool = _key(
        False,
        _boolean,
        "every FPFL round's line on the console; else all up to 20 rounds, then about ten "
        "and every lost round",
    )
    # --- orchestration --------------------------------------------------------------------
    reply_timeout: float = _key(600.0, _number(0.0, math.inf), "seconds to wait for replies")
    min_nodes: int = _key(1, _integer(1), "wait until this many nodes are connected")
    node_wait_timeout: float = _key(120.0, _number(0.0, math.inf), "seconds to wait for them")
    # --- FedEvalFair ----------------------------------------------------------------------
    fef_split: str = _key("dirichlet", _choice(FEF_SPLITS), "Adult holders: split scheme")
    fef_variant: str = _key("trained", _choice(FEF_VARIANTS), "FedAvg model, or fair predictions")
    fef_mode: Mode = _key("calibrated", _choice(FEF_MODES), "primary mode of the test")
    fef_alpha: float = _key(0.05, _number(0.0, 1.0), "level of the tests")
    fef_mu0: float = _key(0.0, _number(-1.0, 1.0, open_low=False), "stage 2: H0 mu = mu0")
    fef_tolerance: float | None = _key(
        None, _optional(_number(0.0, 1.0, open_low=False)), 'TOST tolerance; "" = no TOST'
    )
    fef_resamples: int = _key(100, _integer(2), "bootstrap resamples B per holder")
    fef_public_context: str = _key("", _text, "server's public TenSEAL context file")
    fef_key_holders: int = _key(2, _integer(1), "holders that decrypt the final sums")
    fef_min_cell: int = _key(5, _integer(0), "fewest rows per group and prediction")
    fef_metrics: str = _key(
        "dp,eo",
        _fef_metrics,
        "the rate metrics tested: dp, eo (TPR), fnr, fpr, tnr, accuracy, precision, npv",
    )
    fef_reference_group: int = _key(
        0, _integer(0), "FedEvalFair compares every other group with this one"
    )
    fef_dirichlet_alpha: float = _key(
        1.0, _number(0.0, math.inf), "Adult dirichlet split: concentration (smaller = skew)"
    )
    fef_dp_epsilon: float | None = _key(
        None,
        _optional(_number(0.0, math.inf)),
        'holder-level DP of the release: its epsilon, charged to every user; "" = off',
    )
    fef_dp_delta: float = _key(1e-8, _number(0.0, 1.0), "holder-level DP: the release's delta")
    fef_dp_max_weight: float = _key(
        100.0, _number(0.0, math.inf), "holder-level DP: cap on a holder's weight 1 / V"
    )
    # --- FPFL -----------------------------------------------------------------------------
    fpfl_algorithm: str = _key(
        "fpfl", _choice(tuple(FPFL_ALGORITHMS)), "FPFL Table 2 algorithm, FedFB or FairFed"
    )
    fpfl_architecture: str = _key("shallow", _choice(FPFL_ARCHITECTURES), "the model")
    fpfl_constraint: Constraint = _key("fnr", _choice(FPFL_CONSTRAINTS), "FNR or accuracy parity")
    fpfl_alpha: float = _key(0.02, _number(0.0, math.inf, open_low=False), "tolerance alpha")
    fpfl_learning_rate: float = _key(0.1, _number(0.0, math.inf), "eta")
    fpfl_multiplier_learning_rate: float = _key(0.01, _number(0.0, math.inf), "gamma")
    fpfl_damping: float = _key(2.0, _number(0.0, math.inf, open_low=False), "c")
    fpfl_fedfb_step: float = _key(
        0.005, _number(0.0, 1.0), "FedFB: alpha, the group weights' step per round"
    )
    fpfl_fairfed_beta: float = _key(
        0.1, _number(0.0, math.inf), "FairFed: beta, the node weights' step per round"
    )
    fpfl_fairfed_release_share: float = _key(
        0.25,
        _number(0.0, 1.0),
        "FairFed: share of 1/sigma^2 for each node's own release (the sum keeps the rest)",
    )
    fpfl_fairfed_debiasing: str = _key(
        "none",
        _choice(FPFL_FAIRFED_DEBIASING),
        "FairFed: none (node weights alone) or fedfb (FedFB's group reweighting on the sums)",
    )
    fpfl_split: str = _key(
        "iid", _choice(FPFL_SPLITS), "users to nodes: iid blocks, or dirichlet shares per group"
    )
    fpfl_dirichlet_alpha: float = _key(
        0.5, _number(0.0, math.inf), "fpfl-split = dirichlet: concentration (smaller = skew)"
    )
    fpfl_statistics_smoothing: float = _key(
        0.0, _number(0.0, 1.0, open_low=False), "beta: EMA of the released sums (0 = off)"
    )
    fpfl_constraint_activation: str = _key(
        "surrogate", _choice(FPFL_CONSTRAINT_ACTIVATIONS), "surrogate or counts"
    )
    fpfl_model_selection: str = _key("best", _choice(FPFL_MODEL_SELECTIONS), "best or last")
    fpfl_cohort_size: int = _key(1000, _integer(1), "m: expected cohort (q = m / K)")
    fpfl_rounds: int = _key(250, _integer(1), "T")
    fpfl_clipping_bound: float = _key(2.0, _number(0.0, math.inf), "C, per-user L2 bound")
    fpfl_epsilon: float = _key(2.0, _number(0.0, math.inf), "user-level epsilon after T rounds")
    fpfl_delta: float | None = _key(None, _optional(_number(0.0, 1.0)), '"" = 1 / K')
    fpfl_accountant: AccountantName = _key("rdp", _choice(FPFL_ACCOUNTANTS), "Opacus accountant")
    fpfl_noise: str = _key("distributed", _choice(FPFL_NOISE), "noise shares or central noise")
    fpfl_dropout_tolerance: float = _key(
        0.2, _number(0.0, 1.0, open_low=False), "fraction of nodes that may drop"
    )
    fpfl_require_dropout_tolerance: bool = _key(
        False,
        _boolean,
        "refuse to start when one lost node would lose every round (false: warn loudly)",
    )
    fpfl_max_consecutive_lost: int = _key(
        2, _integer(1), "stop (resumably) after this many lost rounds in a row"
    )
    fpfl_secure_sum: str = _key("masking", _choice(FPFL_SECURE_SUM), "masking or none")
    fpfl_client_seed: int | None = _key(
        None, _optional(_integer(0)), '"" = OS entropy; an integer is NOT private'
    )
    fpfl_resume: bool = _key(False, _boolean, "continue from output-dir's checkpoint")
    fpfl_stop_after: int = _key(0, _integer(0), "stop after this many rounds (0 = run to T)")
    fpfl_checkpoint_every: int = _key(10, _integer(1), "rounds between checkpoints")
    pipeline_plan_difference: float = _key(
        0.1,
        _number(0.0, 1.0, open_low=True),
        "pipeline: the difference of the two models' gaps the report plans the audit for",
    )

    @property
    def trains_with_fedavg(self) -> bool:
        """The run trains its global model with plain FedAvg (``train`` messages): a FedAvg
        job (:data:`FEDAVG_TASKS`) without ``model-file`` and with ``num-server-rounds`` >= 1."""
        return self.task in FEDAVG_TASKS and not self.model_file and self.num_server_rounds > 0

    @property
    def fef_holder_dp(self) -> HolderDP | None:
        """The FedEvalFair release's holder-level DP parameters (None: ``fef-dp-epsilon`` is
        "", the mode is off)."""
        if self.fef_dp_epsilon is None:
            return None
        from ...mechanisms.crypto.ckks.holder_dp import HolderDP

        return HolderDP.for_layout(
            self.fef_dp_epsilon, self.fef_dp_delta, self.fef_dp_max_weight, self.fef_layout
        )

    @property
    def fef_layout(self) -> FedEvalFairLayout:
        """FedEvalFair's tests: ``fef-metrics`` for every group against
        ``fef-reference-group`` (``num-groups`` groups)."""
        return FedEvalFairLayout(
            tuple(self.fef_metrics.split(",")),  # type: ignore[arg-type]
            self.num_groups,
            self.fef_reference_group,
        )

    @property
    def fpfl_uses_mmdm(self) -> bool:
        """MMDM (FFL, FFL + Clip, FPFL) rather than plain FederatedSGD."""
        return FPFL_ALGORITHMS[self.fpfl_algorithm][0]

    @property
    def fpfl_update_rule(self) -> str:
        """The server's update: ``"sgd"``, ``"mmdm"``, ``"fedfb"`` or ``"fairfed"``
        (:data:`FPFL_UPDATE_RULES`)."""
        return FPFL_UPDATE_RULES[self.fpfl_algorithm]

    @property
    def fpfl_release_share(self) -> float:
        """FairFed's ``phi`` (``fpfl-fairfed-release-share``); 0 for the other algorithms."""
        return self.fpfl_fairfed_release_share if self.fpfl_algorithm == "fairfed" else 0.0

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
        values = {
            item.name: item.metadata["parse"](item.name.replace("_", "-"), mapping[kebab])
            for item in fields(cls)
            if (kebab := item.name.replace("_", "-")) in mapping
        }
        config = cls(**values)
        if config.dataset == "adult" and config.num_groups != 2:
            raise ConfigError('num-groups must be 2 for dataset = "adult" (groups: sex)')
        config = _adult_folder(config)
        if config.model_file and config.task not in FEDAVG_TASKS:
            raise ConfigError(
                f"model-file is for task = {', '.join(map(repr, FEDAVG_TASKS[:-1]))} or "
                f"{FEDAVG_TASKS[-1]!r}, got task = "
                f"{config.task!r} (its training is its own: FPFL with user-level DP)"
            )
        _check_fpfl(config)
        if config.task in ("fedevalfair", "pipeline"):  # the tasks that run FedEvalFair
            try:
                config.fef_layout  # noqa: B018 - validates fef-metrics with the group count
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if config.fef_dp_epsilon is not None and config.task not in ("fedevalfair", "pipeline"):
            raise ConfigError(
                'fef-dp-epsilon is for task = "fedevalfair" or "pipeline" (the tasks that run '
                f"FedEvalFair), got task = {config.task!r}"
            )
        if config.fef_dp_epsilon is not None and config.fef_mode != "calibrated":
            raise ConfigError(
                'fef-mode must be "calibrated" with fef-dp-epsilon: the holder-level DP mode '
                "releases the calibrated tests only (the paper's weights have no bounded "
                f"sensitivity), got fef-mode = {config.fef_mode!r}"
            )
        audited_models = len(PIPELINE_SESSIONS) if config.task == "pipeline" else 1
        total = audited_models * sum(config.epsilons)
        if total > config.user_budget + BUDGET_TOLERANCE:
            per_model = " per model (the pipeline audits two)" if audited_models > 1 else ""
            raise ConfigError(
                f"epsilons sum to {sum(config.epsilons):g}{per_model}, {total:g} in all, more "
                f"than user-budget = {config.user_budget:g}: every user would refuse the later "
                "audits (sequential composition)"
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


if __name__ == "__main__":
    print(config_reference(), end="")
