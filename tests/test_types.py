"""The type-check lane: mypy over the library (``fedparity.*``, configured in ``pyproject.toml``).

CI runs only the test suite, so the lane is a test: ``python -m mypy`` from the repository root
must report no error. A second test shows the lane can fail and that mypy reads the library's
own types (through the lazy ``__init__`` stubs), not ``Any``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _mypy(cache: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    """``python -m mypy`` from the repository root (its config), caching in ``cache`` so the
    checkout stays clean."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *targets],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_library_type_checks(tmp_path: Path) -> None:
    result = _mypy(tmp_path / "mypy-cache")
    errors = "\n".join(
        line for line in result.stdout.splitlines() if ": error:" in line or ": note:" in line
    )
    assert result.returncode == 0, (
        f"mypy found type errors in the library (exit {result.returncode}):\n"
        f"{errors or result.stdout}{result.stderr}"
    )
    assert "Success: no issues found" in result.stdout, result.stdout


@pytest.mark.slow
def test_lane_fails_on_a_type_error(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent(
            """\
            from fedparity.mechanisms import grr_keep_probability

            keep: float = grr_keep_probability("2", 2)
            """
        )
    )
    result = _mypy(tmp_path / "mypy-cache", str(probe))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        'Argument 1 to "grr_keep_probability" has incompatible type "str"; expected "float"'
        in result.stdout
    ), result.stdout
    assert "[arg-type]" in result.stdout, result.stdout
