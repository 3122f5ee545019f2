"""Run configuration: defaults in one place, named configs valid, bad values named."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from fedparity.clients.project.config import DEFAULT_ADULT_DOWNLOAD_DIR, ConfigError, RunConfig
from tests.support.fixtures import ProjectRunConfig, project_defaults

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_equal_the_dataclass_defaults(
    run_config: Callable[..., ProjectRunConfig],
) -> None:
    """`run_simulation` passes no run config, so RunConfig's own defaults must match."""
    defaults = run_config()
    assert set(defaults.values) == set(RunConfig.keys())
    assert defaults.parsed == RunConfig.from_mapping(project_defaults()) == RunConfig()


def test_the_run_config_fixture_overrides_known_keys_only(
    run_config: Callable[..., ProjectRunConfig],
) -> None:
    """The shared fixture (tests/support/fixtures.py) keeps every default, parses the overrides
    and refuses a key Flower would refuse (one not in [tool.flwr.app.config])."""
    config = run_config({"task": "fpfl", "users-per-node": 200})
    assert config.values == {**project_defaults(), "task": "fpfl", "users-per-node": 200}
    assert (config.parsed.task, config.parsed.users_per_node) == ("fpfl", 200)
    with pytest.raises(ValueError, match="not-a-key"):
        run_config({"not-a-key": 1})
    with pytest.raises(ConfigError, match="users-per-node"):
        run_config({"users-per-node": 0})


def test_no_federations_table_in_pyproject() -> None:
    """Flower 1.41 migrates [tool.flwr.federations] and rewrites pyproject.toml."""
    with (REPO / "pyproject.toml").open("rb") as handle:
        flwr = tomllib.load(handle)["tool"]["flwr"]
    assert "federations" not in flwr


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_named_configs_are_valid(path: Path) -> None:
    with path.open("rb") as handle:
        overrides = tomllib.load(handle)
    # Flower rejects keys that are not in [tool.flwr.app.config].
    assert set(overrides) <= set(project_defaults())
    base = project_defaults()
    config = RunConfig.from_toml(path, base)
    if overrides.get("dataset") == "adult":
        # As written, the Adult configs fetch UCI Adult once into a folder outside the project
        # (flwr does not combine a TOML file with key=value pairs, so they must run as written).
        assert overrides["download"] is True and overrides["data-dir"] == ""
        assert config.data_dir == str(Path(DEFAULT_ADULT_DOWNLOAD_DIR).expanduser())
    assert config.task == overrides.get("task", "ldp-audit")


@pytest.mark.parametrize(
    ("data_dir", "download", "fragment"),
    [
        ("", False, "data-dir must be the absolute path"),
        ("data/adult", False, "data-dir must be an absolute"),
        ("data/adult", True, "data-dir must be an absolute"),
    ],
)
def test_adult_needs_an_absolute_data_dir(data_dir: str, download: bool, fragment: str) -> None:
    """Checked before any work, whatever the task: the apps run elsewhere than this folder and
    do not see this shell's environment."""
    for task in ("ldp-audit", "fedevalfair", "fpfl"):
        with pytest.raises(ConfigError, match=fragment):
            RunConfig.from_mapping(
                {"task": task, "dataset": "adult", "data-dir": data_dir, "download": download}
            )
    accepted = RunConfig.from_mapping({"dataset": "adult", "data-dir": "/srv/adult"})
    assert accepted.data_dir == "/srv/adult"


def test_adult_download_without_data_dir_uses_the_home_folder() -> None:
    config = RunConfig.from_mapping({"dataset": "adult", "download": True})
    assert config.data_dir == str(Path(DEFAULT_ADULT_DOWNLOAD_DIR).expanduser())
    assert Path(config.data_dir).is_absolute()
    assert ".fedparity" in Path(config.data_dir).parts


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("confidence", 1.0, "confidence must be in (0, 1)"),
        ("confidence", 0, "confidence must be in (0, 1)"),
        ("epsilons", "1,-2", "epsilons (entry 2)"),
        ("epsilons", "1,nan", "epsilons (entry 2)"),
        ("epsilons", "", "epsilons must list"),
        ("num-groups", 1, "num-groups must be an integer >= 2"),
        ("users-per-node", 0, "users-per-node must be an integer >= 1"),
        ("mechanism", "M", "mechanism must be one of R, L, P, N, best"),
        ("metric", "auc", "metric must be one of accuracy, tpr, fpr, fnr"),
        ("dataset", "femnist", "dataset must be one of synthetic, adult"),
        ("learning-rate", 0.0, "learning-rate must be in (0, inf)"),
        ("user-budget", -1.0, "user-budget must be in (0, inf)"),
        ("ground-truth", "yes", "ground-truth must be true or false"),
        ("group-sizes", "guess", "group-sizes must be one of estimated, known"),
        ("fef-alpha", 1.0, "fef-alpha must be in (0, 1)"),
        ("fef-alpha", 0, "fef-alpha must be in (0, 1)"),
        ("fef-resamples", 1, "fef-resamples must be an integer >= 2"),
        ("fef-mode", "exact", "fef-mode must be one of calibrated, paper"),
        ("fef-split", "race", "fef-split must be one of doctorate, dirichlet"),
        ("fef-variant", "x", "fef-variant must be one of trained, fair"),
        ("fef-tolerance", -0.1, "fef-tolerance must be in [0, 1)"),
        ("fef-key-holders", 0, "fef-key-holders must be an integer >= 1"),
        ("fef-min-cell", -1, "fef-min-cell must be an integer >= 0"),
        ("fef-dirichlet-alpha", 0.0, "fef-dirichlet-alpha must be in (0, inf)"),
        ("fef-dirichlet-alpha", "nan", "fef-dirichlet-alpha must be in (0, inf)"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({key: value})
    assert fragment in str(error.value)


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown run-config key"):
        RunConfig.from_mapping({"epsilon": 1.0})


def test_audits_must_fit_the_user_budget() -> None:
    with pytest.raises(ConfigError, match="more than user-budget"):
        RunConfig.from_mapping({"epsilons": "4,4", "user-budget": 7.0})
    assert RunConfig.from_mapping({"epsilons": "0.1,0.2", "user-budget": 0.3}).epsilons == (
        0.1,
        0.2,
    )


def test_known_group_sizes_need_the_harness() -> None:
    with pytest.raises(ConfigError, match="ground-truth"):
        RunConfig.from_mapping({"group-sizes": "known", "ground-truth": False})


def test_adult_has_two_groups() -> None:
    with pytest.raises(ConfigError, match="num-groups must be 2"):
        RunConfig.from_mapping({"dataset": "adult", "num-groups": 3, "data-dir": "/srv/adult"})


def test_federations_command_writes_connections_flower_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedparity federations` gives Flower a default local-simulation and a local-deployment
    connection, keeping the file's other entries; read back with Flower's own reader."""
    import io

    from flwr.cli.flower_config import read_superlink_connection

    from fedparity.server.cli import main

    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "mine"\n\n[superlink.mine]\naddress = "10.0.0.1:9093"\n'
    )
    out = io.StringIO()
    assert (
        main(
            [
                "federations",
                "--flwr-home",
                str(home),
                "--deployment-address",
                "127.0.0.1:9555",
                "--json",
            ],
            out=out,
        )
        == 0
    )
    monkeypatch.setenv("FLWR_HOME", str(home))
    deployment = read_superlink_connection("local-deployment")
    assert deployment.address == "127.0.0.1:9555" and deployment.insecure
    assert read_superlink_connection("local-simulation").address == ":local:"
    assert read_superlink_connection("mine").address == "10.0.0.1:9093"  # kept
    assert read_superlink_connection().name == "mine"  # an existing default is kept

    fresh = tmp_path / "fresh-home"
    assert main(["federations", "--flwr-home", str(fresh)], out=io.StringIO()) == 0
    monkeypatch.setenv("FLWR_HOME", str(fresh))
    assert read_superlink_connection().name == "local-simulation"
    assert (
        main(
            ["federations", "--flwr-home", str(fresh), "--deployment-address", "nope"],
            out=io.StringIO(),
        )
        == 2
    )


def test_the_key_table_lists_every_key_with_help_and_the_project_defaults() -> None:
    from fedparity.clients.project.config import config_keys

    keys = config_keys()
    defaults = project_defaults()
    assert [key.name for key in keys] == list(RunConfig.keys())
    assert {key.name for key in keys} == set(defaults)
    for key in keys:
        assert key.help.strip(), key.name
        # the pyproject value parses to the table's default ("" means None for optional keys)
        config = RunConfig.from_mapping({key.name: defaults[key.name]})
        parsed = getattr(config, key.name.replace("-", "_"))
        assert parsed == key.default, key.name


def test_vocabularies_come_from_the_modules_that_use_them() -> None:
    from typing import get_args

    from fedparity.clients.fpfl_task import CONSTRAINTS
    from fedparity.clients.project import config
    from fedparity.mechanisms.fairness_tests.fedevalfair import Mode
    from fedparity.mechanisms.ldp.calibration import MechanismChoice
    from fedparity.mechanisms.ldp.metrics import METRIC_NAMES
    from fedparity.mechanisms.privacy.opacus_accounting import AccountantName

    assert config.FEF_MODES == get_args(Mode)
    assert config.MECHANISM_CHOICES == get_args(MechanismChoice)
    assert config.FPFL_ACCOUNTANTS == get_args(AccountantName)
    assert config.FPFL_CONSTRAINTS is CONSTRAINTS
    assert config.METRIC_NAMES is METRIC_NAMES


def test_the_configuration_reference_is_generated_from_the_key_table() -> None:
    from fedparity.clients.project.config import config_keys, config_reference

    reference = config_reference()
    # one table row per key, with its type and allowed values
    rows = [line for line in reference.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(RunConfig.keys())
    fpfl_delta = next(key for key in config_keys() if key.name == "fpfl-delta")
    assert (fpfl_delta.type, fpfl_delta.allowed) == ("number", '"" (not set) or (0, 1)')
    # the file in the repository is the generated one (regenerate it with the command it names)
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == reference, (
        "python -m fedparity.clients.project.config > docs/configuration.md"
    )


def test_server_checks_the_adult_folder_before_any_work(
    tmp_path: Path, adult_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the harness on, the ServerApp finds (or fetches once) the files before any work; a
    folder without them, or a failed download, is one ConfigError naming the key."""
    import urllib.error
    import urllib.request

    from fedparity.server.app import check_adult_files

    check_adult_files(RunConfig.from_mapping({"dataset": "adult", "data-dir": str(adult_path)}))
    empty = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"data-dir = '.*empty' holds no adult.data"):
        check_adult_files(RunConfig.from_mapping({"dataset": "adult", "data-dir": empty}))

    def offline(*args: object, **kwargs: object) -> None:  # a network fault
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ConfigError, match="download = true could not fetch UCI Adult"):
        check_adult_files(
            RunConfig.from_mapping({"dataset": "adult", "data-dir": empty, "download": True})
        )
    assert not list((tmp_path / "empty").glob("*.part")), "no partial file left behind"
    # without the harness, the server does not read the data (the nodes hold it)
    check_adult_files(
        RunConfig.from_mapping({"dataset": "adult", "data-dir": empty, "ground-truth": False})
    )
