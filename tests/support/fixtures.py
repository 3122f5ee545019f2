"""Fixtures shared by the test files: a pytest plugin (``pytest_plugins`` in ``tests/conftest.py``).

* :func:`run_config`: the project's run config as Flower hands it to the apps (every key of
  ``pyproject.toml``'s ``[tool.flwr.app.config]``, with a test's overrides) and as the apps parse
  it (:class:`fedparity.clients.project.config.RunConfig`);
* :func:`ckks_keys`: one CKKS key pair for the whole session, written as ``fedparity keys --out
  SECRET --public-out PUBLIC`` writes it;
* :func:`cli` and :func:`cli_script`: ``fedparity <args>`` in this process
  (:func:`fedparity.server.cli.main`) or through the installed console script, with the exit
  status, standard output and standard error (:class:`CliResult`); :func:`cli_json` and
  :func:`assert_usage_error` for the two outcomes most CLI tests check.

The functions behind them (:func:`project_run_config`, :func:`run_cli`, :func:`run_cli_script`)
are importable too, for module-level constants and helpers.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

if TYPE_CHECKING:  # the library is imported when a fixture is used, not by the plugin
    from fedparity.clients.project.config import RunConfig
    from fedparity.mechanisms.crypto.ckks import KeyPaths

REPO = Path(__file__).resolve().parents[2]

#: A run-config value as Flower carries it.
RunConfigValue = bool | int | float | str


# --- run configs ---------------------------------------------------------------------------------


@cache
def _pyproject_defaults() -> tuple[tuple[str, RunConfigValue], ...]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        table = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    return tuple(table.items())


def project_defaults() -> dict[str, RunConfigValue]:
    """``[tool.flwr.app.config]`` of ``pyproject.toml``: the run config of a run that overrides
    nothing (a fresh dict each call)."""
    return dict(_pyproject_defaults())


@dataclass(frozen=True)
class ProjectRunConfig:
    """A run config twice: as Flower hands it to the apps, and as they parse it."""

    #: Every key of ``[tool.flwr.app.config]``, the overridden ones with the test's values.
    values: dict[str, RunConfigValue]
    #: ``RunConfig.from_mapping(values)``.
    parsed: RunConfig


def project_run_config(overrides: Mapping[str, RunConfigValue] | None = None) -> ProjectRunConfig:
    """The project's defaults with ``overrides`` (keys spelled as in ``pyproject.toml``), parsed.

    Raises
    ------
    ValueError
        An override whose key is not in ``[tool.flwr.app.config]`` (Flower refuses those), or
        a value :class:`RunConfig` refuses (its :class:`ConfigError` names the key).
    """
    from fedparity.clients.project.config import RunConfig

    values = project_defaults()
    unknown = sorted(set(overrides or {}) - set(values))
    if unknown:
        raise ValueError(
            f"run config keys {unknown} are not in pyproject.toml's [tool.flwr.app.config]"
        )
    values.update(overrides or {})
    return ProjectRunConfig(values, RunConfig.from_mapping(values))


@pytest.fixture
def run_config() -> Callable[[Mapping[str, RunConfigValue] | None], ProjectRunConfig]:
    """:func:`project_run_config`: ``run_config({"task": "fpfl"}).values`` / ``.parsed``."""
    return project_run_config


# --- CKKS keys -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ckks_keys(tmp_path_factory: pytest.TempPathFactory) -> KeyPaths:
    """One CKKS key pair (default parameters) for the session, as ``fedparity keys --out SECRET
    --public-out PUBLIC`` writes it: ``secret``, the key holders' context, in a folder of its
    own (mode 0700, the file 0600); ``public``, the server's context without the secret key, in
    another. Tests read these files and never change them; a test about writing keys, or one that
    needs another key pair, calls ``generate_keys`` itself."""
    from fedparity.mechanisms.crypto.ckks import generate_keys

    folder = tmp_path_factory.mktemp("ckks-keys")
    return generate_keys(folder / "secret", public_directory=folder / "public")


# --- the fedparity command line ------------------------------------------------------------------


class CliResult(NamedTuple):
    """What one ``fedparity`` command did: ``code, out, err = run_cli([...])``."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """The one JSON object a successful ``--json`` command printed (asserts both)."""
        assert self.code == 0, self.err
        lines = self.out.strip().splitlines()
        assert len(lines) == 1, self.out  # one JSON object
        return json.loads(lines[0])


def run_cli(argv: list[str]) -> CliResult:
    """``fedparity <argv>`` in this process: :func:`fedparity.server.cli.main` with its output
    and standard error captured; argparse's exits (``--help``, a bad option) give their code."""
    from fedparity.server.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv, out=out)
        except SystemExit as leaving:
            code = leaving.code if isinstance(leaving.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli_script(
    argv: list[str], *, timeout: float = 120, env: Mapping[str, str] | None = None
) -> CliResult:
    """``fedparity <argv>`` through the installed console script (next to this interpreter),
    in a new process: the real exit status and streams."""
    script = Path(sys.executable).with_name("fedparity")
    result = subprocess.run(
        [str(script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )
    return CliResult(result.returncode, result.stdout, result.stderr)


def cli_json(argv: list[str]) -> Any:
    """``fedparity <argv> --json`` in this process: exit 0 and one JSON object, returned."""
    return run_cli([*argv, "--json"]).json()


def assert_usage_error(argv: list[str], *needles: str) -> str:
    """``fedparity <argv>`` in this process refuses its input as a usage error: exit status 2,
    nothing on stdout, one line on stderr (``fedparity <command>...: error: ...``) containing
    every needle; that line is returned."""
    code, out, err = run_cli(argv)
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"fedparity {argv[0]}: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def cli() -> Callable[[list[str]], CliResult]:
    """:func:`run_cli`: ``result = cli(["privacy", ...])``; ``result.code``, ``.out``, ``.err``,
    ``.json()``."""
    return run_cli


@pytest.fixture
def cli_script() -> Callable[..., CliResult]:
    """:func:`run_cli_script`: the real ``fedparity`` console script in a new process."""
    return run_cli_script
