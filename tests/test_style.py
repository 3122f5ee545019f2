"""The code is ruff-clean (lint rules and formatting of ``pyproject.toml``'s ``[tool.ruff]``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIRS = ["clients", "server", "strategies", "mechanisms", "benchmarks", "tests"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_finds_nothing(command: list[str]) -> None:
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency (pip install -e '.[test]')"
    result = subprocess.run(
        [ruff, *command, *PYTHON_DIRS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
