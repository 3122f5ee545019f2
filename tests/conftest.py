"""Shared fixtures: where the real UCI Adult data lives (never copied into the repo), and a
Flower task identity for tests that build reply Messages outside a running app; the plugin
``tests.support.fixtures`` adds run configs, CKKS keys and the ``fedparity`` command line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.supercore.task_identity import TaskIdentity

from fedparity.clients.project.data import ADULT_DIR_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Fixtures shared by the test files: run configs, CKKS keys, the fedparity command line.
pytest_plugins = ["tests.support.fixtures"]


def adult_dir() -> Path:
    """The real Adult folder: ``$FEDPARITY_ADULT_DIR`` or ``<repo>/../shared/data/adult``.

    Its files are those of the UCI Adult data set (Becker and Kohavi 1996, UCI Machine Learning
    Repository): ``adult.data`` and ``adult.test``.
    """
    override = os.environ.get(ADULT_DIR_ENV)
    return Path(override) if override else REPO_ROOT.parent / "shared" / "data" / "adult"


@pytest.fixture(scope="session")
def adult_path() -> Path:
    """The Adult folder, or skip (with the reason) when its files are absent."""
    path = adult_dir()
    if not ((path / "adult.data").is_file() and (path / "adult.test").is_file()):
        pytest.skip(f"UCI Adult files not found in {path} (set {ADULT_DIR_ENV} to their folder)")
    return path


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower's Messages need a run/task identity, which the runtime sets in a real run;
    modules that build replies directly opt in with ``pytest.mark.usefixtures``."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh ``$HOME`` for the whole test session: a node outside simulation keeps its
    ledger under ``~/.fedparity/ledgers`` by default, and no test may read or write the real
    one (nor the developer's ``~/.fedparity`` keys and runs)."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        yield home


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first (each module kept together, for its module-scoped
    fixtures): the CI's two xdist workers then start on the long multi-process tests and share
    the short ones at the end, instead of one worker finishing a 10-minute module alone."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}  # type: ignore[attr-defined]
    items.sort(key=lambda item: item.module not in slow_modules)  # type: ignore[attr-defined]
