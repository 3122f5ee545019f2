"""FPFL checkpoints and the durable release ledger: what a crashed or stopped training needs
to resume, and the count of released rounds that must never be forgotten."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..clients.config import RunConfig

CHECKPOINT_ARRAYS = "checkpoint.npz"
CHECKPOINT_STATE = "checkpoint.json"
RELEASE_LEDGER = "privacy-ledger.json"
#: Run-config keys that do not change what a run computes (a resumed run may differ in them).
_RESUME_NEUTRAL = {
    "fpfl_resume",
    "fpfl_stop_after",
    "fpfl_checkpoint_every",
    "output_dir",
    "reply_timeout",
    "node_wait_timeout",
    "min_nodes",
}


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def _fingerprint(config: RunConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(config).items() if k not in _RESUME_NEUTRAL}


def save_checkpoint(folder: Path, config: RunConfig, state: dict[str, Any]) -> None:
    """Write ``state`` (numpy arrays under ``arrays``, the rest JSON) atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(value) for name, value in state["arrays"].items()}
    scratch = folder / (CHECKPOINT_ARRAYS + ".tmp.npz")
    np.savez(scratch, **arrays)
    scratch.replace(folder / CHECKPOINT_ARRAYS)
    meta = {k: v for k, v in state.items() if k != "arrays"}
    meta["config"] = _fingerprint(config)
    scratch_json = folder / (CHECKPOINT_STATE + ".tmp")
    scratch_json.write_text(json.dumps(meta, allow_nan=True))
    scratch_json.replace(folder / CHECKPOINT_STATE)


def load_checkpoint(folder: Path, config: RunConfig) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` (None if there is none); ValueError if it was written by
    a run with a different configuration."""
    if not (folder / CHECKPOINT_STATE).is_file() or not (folder / CHECKPOINT_ARRAYS).is_file():
        return None
    meta = json.loads((folder / CHECKPOINT_STATE).read_text())
    expected = json.loads(json.dumps(_fingerprint(config)))
    if meta.get("config") != expected:
        changed = sorted(
            key
            for key in set(expected) | set(meta.get("config", {}))
            if expected.get(key) != meta.get("config", {}).get(key)
        )
        raise ValueError(
            f"fpfl-resume: the checkpoint in {folder} was written with different settings "
            f"({', '.join(changed)}); use another output-dir or the same run config"
        )
    with np.load(folder / CHECKPOINT_ARRAYS) as data:
        meta["arrays"] = {name: data[name].copy() for name in data.files}
    return meta


# --------------------------------------------------------------------------------------------
# Release ledger: rounds ever released, durable before each release
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseLedger:
    """What the accountant needs about the rounds released so far (one ``(sigma, q)`` history).

    Attributes
    ----------
    rounds_released : int
        Rounds sent to the nodes so far, over the interrupted and resumed runs of one training.
    noise_multiplier : float
        ``sigma`` (0 without noise).
    sample_rate : float
        ``q = m / K``.
    delta : float
    """

    rounds_released: int
    noise_multiplier: float
    sample_rate: float
    delta: float

    def __post_init__(self) -> None:
        value = self.rounds_released
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rounds_released must be an integer >= 0, got {value!r}")


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that it survives a crash: scratch file, ``fsync``, atomic
    ``os.replace``, then ``fsync`` of the folder (POSIX) so the rename itself is on disk."""
    scratch = path.with_name(path.name + ".tmp")
    with scratch.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)
    if hasattr(os, "O_DIRECTORY"):
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def write_release_ledger(folder: Path, config: RunConfig, ledger: ReleaseLedger) -> None:
    """Durably record ``ledger`` in ``folder/privacy-ledger.json`` (call it *before* the
    release it counts)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {**asdict(ledger), "config": _fingerprint(config)}
    _write_durably(folder / RELEASE_LEDGER, json.dumps(payload, allow_nan=False))


def read_release_ledger(folder: Path, config: RunConfig) -> ReleaseLedger | None:
    """The ledger in ``folder`` (None if there is none); ValueError if it is unreadable or was
    written by a run with a different configuration (never silently restarted from 0)."""
    path = folder / RELEASE_LEDGER
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        ledger = ReleaseLedger(
            rounds_released=int(payload["rounds_released"]),
            noise_multiplier=float(payload["noise_multiplier"]),
            sample_rate=float(payload["sample_rate"]),
            delta=float(payload["delta"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"fpfl-resume: the privacy ledger {path} is unreadable ({error!r}); the rounds it "
            "counted cannot be recovered, so this run cannot report its epsilon"
        ) from error
    if payload.get("config") != json.loads(json.dumps(_fingerprint(config))):
        raise ValueError(
            f"fpfl-resume: the privacy ledger in {folder} was written with different settings; "
            "use another output-dir or the same run config"
        )
    return ledger


def resumed_releases(
    folder: Path, config: RunConfig, current: ReleaseLedger, checkpoint_round: int
) -> int:
    """Rounds released before this (resumed) run: ``max(ledger, checkpoint round)``.

    The checkpoint round is a lower bound for a checkpoint written before the ledger existed.
    The ledger must describe the same ``(sigma, q, delta)`` as this run, since the accountant
    composes one ``(sigma, q)`` history (same population ``K``).
    """
    ledger = read_release_ledger(folder, config)
    if ledger is None:
        return checkpoint_round
    same = (
        math.isclose(ledger.noise_multiplier, current.noise_multiplier, rel_tol=1e-12)
        and math.isclose(ledger.sample_rate, current.sample_rate, rel_tol=1e-12)
        and math.isclose(ledger.delta, current.delta, rel_tol=1e-12)
    )
    if not same:
        raise ValueError(
            f"fpfl-resume: the privacy ledger in {folder} was written with sigma = "
            f"{ledger.noise_multiplier:g}, q = {ledger.sample_rate:g}, delta = {ledger.delta:g}, "
            f"this run has sigma = {current.noise_multiplier:g}, q = {current.sample_rate:g}, "
            f"delta = {current.delta:g} (a different population?): cannot account both together"
        )
    return max(ledger.rounds_released, checkpoint_round)


# --------------------------------------------------------------------------------------------
