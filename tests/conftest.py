"""Shared fixtures: where the real UCI Adult data lives (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clients.data import ADULT_DIR_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]


def adult_dir() -> Path:
    """The real Adult folder: ``$FEDPARITY_ADULT_DIR`` or ``<repo>/../shared/data/adult``."""
    override = os.environ.get(ADULT_DIR_ENV)
    return Path(override) if override else REPO_ROOT.parent / "shared" / "data" / "adult"


@pytest.fixture(scope="session")
def adult_path() -> Path:
    """The Adult folder, or skip (with the reason) when its files are absent."""
    path = adult_dir()
    if not ((path / "adult.data").is_file() and (path / "adult.test").is_file()):
        pytest.skip(f"UCI Adult files not found in {path} (set {ADULT_DIR_ENV} to their folder)")
    return path
