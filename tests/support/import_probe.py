"""What importing a module, or running a few lines, loads, seen from a fresh interpreter (the
tests' own process has imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules_loaded_by(module: str, roots: Collection[str]) -> list[str]:
    """The sorted modules under the top-level packages ``roots`` that ``import module`` loads
    in a new Python process."""
    probe = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {set(roots)!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def last_line_printed(code: str, *, timeout: float = 120) -> str:
    """The last line ``code`` prints when run by a new Python process in the repository's
    folder (so ``tests.*`` imports); a failure raises with its output."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if result.returncode != 0:
        raise AssertionError(f"the probe failed:\n{result.stdout}\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]
