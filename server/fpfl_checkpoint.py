"""FPFL checkpoints and the durable release ledger of the FPFL job: the files of
:mod:`fedparity.mechanisms.fpfl.training_state`, fingerprinted with the job's run config.

The files and the observer that keeps them (:class:`~fedparity.strategies.fpfl_observers.
DurableTraining`) live in the library, so that a library user's training is as durable as the
job's; the names here stay for existing callers, with the run config in place of a
fingerprint.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..clients.project.config import RunConfig
from ..mechanisms.fpfl import training_state
from ..mechanisms.fpfl.training_state import (
    CHECKPOINT_ARRAYS,
    CHECKPOINT_STATE,
    RELEASE_LEDGER,
    ReleaseLedger,
    ReleaseSegment,
)

__all__ = [
    "CHECKPOINT_ARRAYS",
    "CHECKPOINT_STATE",
    "RELEASE_LEDGER",
    "RESUME_ADVICE",
    "RESUME_PREFIX",
    "ReleaseLedger",
    "ReleaseSegment",
    "load_checkpoint",
    "read_release_ledger",
    "resumed_ledger",
    "run_fingerprint",
    "save_checkpoint",
    "write_release_ledger",
]

#: How the job's refusals of a folder start, and what they advise.
RESUME_PREFIX = "fpfl-resume"
RESUME_ADVICE = "use another output-dir or the same run config"
#: Run-config keys that do not change what a run computes (a resumed run may differ in them).
_RESUME_NEUTRAL = {
    "fpfl_resume",
    "fpfl_stop_after",
    "fpfl_checkpoint_every",
    "output_dir",
    "reply_timeout",
    "node_wait_timeout",
    "min_nodes",
    "fpfl_require_dropout_tolerance",
    "fpfl_max_consecutive_lost",
}


def run_fingerprint(config: RunConfig) -> dict[str, Any]:
    """The run config without the keys a resumed run may change: what the job's ledger and
    checkpoint record under ``config`` and compare on resume."""
    return {k: v for k, v in asdict(config).items() if k not in _RESUME_NEUTRAL}


def save_checkpoint(folder: Path, config: RunConfig, state: dict[str, Any]) -> None:
    """Write ``state`` (numpy arrays under ``arrays``, the rest JSON) atomically."""
    training_state.save_checkpoint(folder, state, run_fingerprint(config))


def load_checkpoint(folder: Path, config: RunConfig) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` (None if there is none); ValueError if it was written by
    a run with a different configuration."""
    return training_state.load_checkpoint(
        folder, run_fingerprint(config), prefix=RESUME_PREFIX, advice=RESUME_ADVICE
    )


def write_release_ledger(folder: Path, config: RunConfig, ledger: ReleaseLedger) -> None:
    """Durably record ``ledger`` in ``folder/privacy-ledger.json`` (call it *before* the
    release it counts)."""
    training_state.save_release_ledger(folder, ledger, run_fingerprint(config))


def read_release_ledger(folder: Path, config: RunConfig) -> ReleaseLedger | None:
    """The ledger in ``folder`` (None if there is none); ValueError if it is unreadable or was
    written by a run with a different configuration (never silently restarted from 0)."""
    return training_state.load_release_ledger(
        folder, run_fingerprint(config), prefix=RESUME_PREFIX, advice=RESUME_ADVICE
    )


def resumed_ledger(
    folder: Path,
    config: RunConfig,
    checkpoint_round: int,
    *,
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
) -> ReleaseLedger:
    """The rounds released before this (resumed) run, to which its own rounds are added
    (:func:`fedparity.mechanisms.fpfl.training_state.resumed_ledger`)."""
    return training_state.resumed_ledger(
        folder,
        run_fingerprint(config),
        checkpoint_round,
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        delta=delta,
        prefix=RESUME_PREFIX,
        advice=RESUME_ADVICE,
    )
