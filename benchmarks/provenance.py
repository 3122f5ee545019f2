"""Where and on what a benchmark ran: the machine's load and the commit, for result headers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, or "n/a" where the OS has none."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def git_commit() -> str:
    """The short commit, marked when tracked files differ from it (the run measured other
    code than the commit's)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit} with uncommitted changes" if changed else commit
