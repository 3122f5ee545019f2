"""The code is ruff-clean (lint rules and formatting of ``pyproject.toml``'s ``[tool.ruff]``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIRS = ["clients", "server", "strategies", "mechanisms", "benchmarks", "tests", "examples"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_finds_nothing(command: list[str]) -> None:
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency (pip install -e '.[test]')"
    result = subprocess.run(
        [ruff, *command, *PYTHON_DIRS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_papers_are_cited_so_a_reader_outside_this_machine_can_find_them() -> None:
    # Papers by authors, title and year, equations by paper and number: never by a section of
    # an internal specification ("SPEC 2.1"), a file number ("paper 004") or a local path.
    import re

    pattern = re.compile(r"SPEC \d|\b[Pp]apers? 00\d|seeds/")
    files = [
        path
        for folder in (*PYTHON_DIRS, "configs", "docs")
        for path in (REPO_ROOT / folder).rglob("*")
        if path.suffix in {".py", ".pyi", ".toml", ".md"}
    ] + [REPO_ROOT / "README.md", REPO_ROOT / "pyproject.toml"]
    assert len(files) > 100
    found = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line) and path.name != "test_style.py"
    ]
    assert found == []


#: The longest a function of the orchestration layers may be (issue 29: Flower's only long
#: function is ``start()``; the math of ``mechanisms/`` may be longer, as dp-accounting's is).
MAX_ORCHESTRATION_LINES = 120


def test_no_orchestration_function_is_over_120_lines() -> None:
    import ast

    long = []
    for folder in ("clients", "server", "strategies"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_ORCHESTRATION_LINES:
                        long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}")
    assert long == [], long
