"""What an FPFL training keeps on disk: the durable release ledger and the checkpoint.

The **release ledger** (``privacy-ledger.json``) counts every round ever released for one
training, as ``(sigma, q)`` segments: it is written durably (scratch file, ``fsync``, atomic
replace, ``fsync`` of the folder) *before* each round is sent, so a crash can never hide a
round whose noisy sum may exist. The **checkpoint** (``checkpoint.npz`` for the arrays,
``checkpoint.json`` for the rest) holds what a resumed training continues from. Both carry the
``fingerprint`` of the training that wrote them (a JSON mapping of its settings): a training
with other settings is refused, never silently started from 0 over them.

The accountant composes the ledger's segments
(:func:`~fedparity.mechanisms.privacy.opacus_accounting.privacy_spent_history`, the history
Opacus's ``RDPAccountant`` keeps). The server side that writes these files is
:class:`fedparity.strategies.fpfl_observers.DurableTraining`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._files import write_text_durably
from ..validation import check_int
from .mmdm import CohortMetrics

__all__ = [
    "CHECKPOINT_ARRAYS",
    "CHECKPOINT_STATE",
    "RELEASE_LEDGER",
    "ReleaseLedger",
    "ReleaseSegment",
    "load_checkpoint",
    "load_release_ledger",
    "metrics_from_json",
    "metrics_to_json",
    "resumed_ledger",
    "save_checkpoint",
    "save_release_ledger",
]

CHECKPOINT_ARRAYS = "checkpoint.npz"
CHECKPOINT_STATE = "checkpoint.json"
RELEASE_LEDGER = "privacy-ledger.json"
#: How a refusal starts, and what it advises, unless the caller names its own (the FPFL job:
#: ``fpfl-resume`` and its ``output-dir``).
PREFIX = "FPFL training"
ADVICE = "use another folder or the same training settings"


# --------------------------------------------------------------------------------------------
# Release ledger: rounds ever released, durable before each release
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseSegment:
    """Rounds released at one ``(sigma, q)``: a training resumed after a node left for good
    runs on with a smaller population, so with another ``q = m / K`` and ``sigma``."""

    noise_multiplier: float
    sample_rate: float
    rounds: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", check_int("rounds", self.rounds, minimum=0))
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}")


@dataclass(frozen=True)
class ReleaseLedger:
    """Every round released so far for one training, as ``(sigma, q)`` segments in release
    order (over the interrupted and resumed runs of the training), and its ``delta``.

    The accountant composes the segments (:func:`~fedparity.mechanisms.privacy.opacus_accounting.
    privacy_spent_history`); :meth:`after_release` is the ledger with one more round.
    """

    segments: tuple[ReleaseSegment, ...]
    delta: float

    @classmethod
    def single(
        cls, rounds: int, *, noise_multiplier: float, sample_rate: float, delta: float
    ) -> ReleaseLedger:
        """``rounds`` rounds at one ``(sigma, q)``."""
        return cls((ReleaseSegment(noise_multiplier, sample_rate, rounds),), delta)

    @property
    def rounds_released(self) -> int:
        """Rounds sent to the nodes so far, over all segments."""
        return sum(segment.rounds for segment in self.segments)

    def after_release(self, noise_multiplier: float, sample_rate: float) -> ReleaseLedger:
        """This ledger with one more round at ``(sigma, q)`` (a new segment if they changed)."""
        last = self.segments[-1] if self.segments else None
        if (
            last is not None
            and _same(last.noise_multiplier, noise_multiplier)
            and _same(last.sample_rate, sample_rate)
        ):
            grown = ReleaseSegment(last.noise_multiplier, last.sample_rate, last.rounds + 1)
            return ReleaseLedger((*self.segments[:-1], grown), self.delta)
        added = ReleaseSegment(noise_multiplier, sample_rate, 1)
        return ReleaseLedger((*self.segments, added), self.delta)

    def accountant_history(self) -> list[tuple[float, float, int]]:
        """``[(sigma, q, rounds), ...]`` of the noisy segments, as Opacus keeps it."""
        return [
            (s.noise_multiplier, s.sample_rate, s.rounds)
            for s in self.segments
            if s.rounds and s.noise_multiplier > 0
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 2,
            "rounds_released": self.rounds_released,
            "segments": [asdict(segment) for segment in self.segments],
            "delta": self.delta,
        }

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> ReleaseLedger:
        """Read version 2 (segments) and version 1 (one ``(sigma, q)``: ``rounds_released``,
        ``noise_multiplier``, ``sample_rate``) ledgers."""
        delta = float(payload["delta"])
        if "segments" not in payload:
            return cls.single(
                int(payload["rounds_released"]),
                noise_multiplier=float(payload["noise_multiplier"]),
                sample_rate=float(payload["sample_rate"]),
                delta=delta,
            )
        segments = tuple(
            ReleaseSegment(float(s["noise_multiplier"]), float(s["sample_rate"]), int(s["rounds"]))
            for s in payload["segments"]
        )
        ledger = cls(segments, delta)
        if int(payload["rounds_released"]) != ledger.rounds_released:
            raise ValueError("rounds_released does not match the segments")
        return ledger


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b


def _as_json(fingerprint: Mapping[str, Any]) -> Any:
    """``fingerprint`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(dict(fingerprint)))


def save_release_ledger(
    folder: Path, ledger: ReleaseLedger, fingerprint: Mapping[str, Any]
) -> None:
    """Durably record ``ledger`` in ``folder/privacy-ledger.json`` (call it *before* the
    release it counts)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {**ledger.to_json(), "config": dict(fingerprint)}
    write_text_durably(folder / RELEASE_LEDGER, json.dumps(payload, allow_nan=False))


def load_release_ledger(
    folder: Path,
    fingerprint: Mapping[str, Any],
    *,
    prefix: str = PREFIX,
    advice: str = ADVICE,
) -> ReleaseLedger | None:
    """The ledger in ``folder`` (None if there is none); ValueError (starting with
    ``prefix``) if it is unreadable or was written by a training with another fingerprint
    (never silently restarted from 0)."""
    path = folder / RELEASE_LEDGER
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        ledger = ReleaseLedger.from_json(payload)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{prefix}: the privacy ledger {path} is unreadable ({error!r}); the rounds it "
            "counted cannot be recovered, so this run cannot report its epsilon"
        ) from error
    if payload.get("config") != _as_json(fingerprint):
        raise ValueError(
            f"{prefix}: the privacy ledger in {folder} was written with different settings; "
            f"{advice}"
        )
    return ledger


def resumed_ledger(
    folder: Path,
    fingerprint: Mapping[str, Any],
    checkpoint_round: int,
    *,
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
    prefix: str = PREFIX,
    advice: str = ADVICE,
) -> ReleaseLedger:
    """The rounds released before this (resumed) run, to which its own rounds are added.

    With a ledger in ``folder``: its segments, plus the rounds a checkpoint holds beyond them
    (a checkpoint written before the ledger existed), at the last segment's ``(sigma, q)``.
    Without one: the checkpoint's rounds (a lower bound), at this run's ``(sigma, q)``.
    The ``delta`` of the training is the ledger's (a population that shrank changes
    ``1 / K``; the composed epsilon is stated at the first ``delta``).
    """
    ledger = load_release_ledger(folder, fingerprint, prefix=prefix, advice=advice)
    if ledger is None:
        return ReleaseLedger.single(
            checkpoint_round,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            delta=delta,
        )
    missing = checkpoint_round - ledger.rounds_released
    if missing > 0 and ledger.segments:
        last = ledger.segments[-1]
        grown = ReleaseSegment(last.noise_multiplier, last.sample_rate, last.rounds + missing)
        ledger = ReleaseLedger((*ledger.segments[:-1], grown), ledger.delta)
    return ledger


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def save_checkpoint(folder: Path, state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> None:
    """Write ``state`` (numpy arrays under ``arrays``, the rest JSON) atomically, with the
    training's ``fingerprint`` under ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        name: np.asarray(value) for name, value in state["arrays"].items()
    }
    scratch = folder / (CHECKPOINT_ARRAYS + ".tmp.npz")
    np.savez(scratch, **arrays)  # type: ignore[arg-type]  # stub: **arrays might fill allow_pickle
    scratch.replace(folder / CHECKPOINT_ARRAYS)
    meta = {k: v for k, v in state.items() if k != "arrays"}
    meta["config"] = dict(fingerprint)
    scratch_json = folder / (CHECKPOINT_STATE + ".tmp")
    scratch_json.write_text(json.dumps(meta, allow_nan=True))
    scratch_json.replace(folder / CHECKPOINT_STATE)


def load_checkpoint(
    folder: Path,
    fingerprint: Mapping[str, Any],
    *,
    prefix: str = PREFIX,
    advice: str = ADVICE,
) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` (None if there is none); ValueError (starting with
    ``prefix``, naming the settings that differ) if a training with another fingerprint
    wrote it."""
    if not (folder / CHECKPOINT_STATE).is_file() or not (folder / CHECKPOINT_ARRAYS).is_file():
        return None
    meta = json.loads((folder / CHECKPOINT_STATE).read_text())
    expected = _as_json(fingerprint)
    if meta.get("config") != expected:
        written = meta.get("config", {})
        changed = sorted(
            key for key in set(expected) | set(written) if expected.get(key) != written.get(key)
        )
        raise ValueError(
            f"{prefix}: the checkpoint in {folder} was written with different settings "
            f"({', '.join(changed)}); {advice}"
        )
    with np.load(folder / CHECKPOINT_ARRAYS) as data:
        meta["arrays"] = {name: data[name].copy() for name in data.files}
    return meta


def metrics_to_json(metrics: CohortMetrics) -> dict[str, Any]:
    """A selected model's cohort metrics as the checkpoint keeps them."""
    return {
        "accuracy": metrics.accuracy,
        "group_error_rates": [float(r) for r in metrics.group_error_rates],
        "overall_error_rate": metrics.overall_error_rate,
        "gap": metrics.gap,
        "fair": metrics.fair,
    }


def metrics_from_json(values: Mapping[str, Any]) -> CohortMetrics:
    """:func:`metrics_to_json` read back."""
    return CohortMetrics(
        accuracy=float(values["accuracy"]),
        group_error_rates=np.asarray(values["group_error_rates"], dtype=np.float64),
        overall_error_rate=float(values["overall_error_rate"]),
        gap=float(values["gap"]),
        fair=bool(values["fair"]),
    )
