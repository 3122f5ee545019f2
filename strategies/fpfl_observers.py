"""Observers of the FPFL training loop (:meth:`fedparity.strategies.fpfl.FPFLTraining.start`).

The loop is one: it sets the protocol up, then per round asks every observer whether to stop,
tells them a round is about to be released, sends it, takes the MMDM (or FederatedSGD) step
and hands them the round's history entry. What a training needs around that loop lives in
observers, in the style of Keras callbacks and of Opacus's accountants (a stateful object told
of every release, ``opacus.accountants.IAccountant``):

* :class:`DurableTraining` (the default) keeps a durable **release ledger** and a
  **checkpoint** in a folder: before each round is sent, the count of rounds released so far,
  this one included, is on disk (``fsync``); the training resumes from the folder's checkpoint
  with every earlier release counted, so the epsilon it reports covers every round ever sent.
* :class:`StopAfterLostRounds` stops after a number of lost rounds in a row (each further one
  would likely be lost too, while still spending privacy).
* :class:`StopWhenTooFewNodes` stops before a round that cannot succeed: fewer member nodes
  connected than the ``n_min`` whose noise shares a round needs.

The FPFL job (:mod:`fedparity.server.fpfl_job`) adds its progress display and status file as
one more observer. Hooks are called in the order the observers are given.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common import log

from ..mechanisms._files import DEFAULT_RUNS_DIR, new_run_folder
from ..mechanisms.fpfl.training_state import (
    ADVICE,
    CHECKPOINT_ARRAYS,
    CHECKPOINT_STATE,
    PREFIX,
    RELEASE_LEDGER,
    ReleaseLedger,
    load_checkpoint,
    metrics_from_json,
    metrics_to_json,
    resumed_ledger,
    save_checkpoint,
    save_release_ledger,
)
from ..mechanisms.privacy.opacus_accounting import PrivacySpent, privacy_spent_history
from ..mechanisms.validation import check_int_at_least

if TYPE_CHECKING:
    from .fpfl import FPFLProtocol, FPFLTraining, FPFLTrainingResult, RoundOutcome

__all__ = [
    "DurableTraining",
    "FPFLObserver",
    "StopAfterLostRounds",
    "StopWhenTooFewNodes",
    "training_fingerprint",
]


class FPFLObserver:
    """Hooks into :meth:`FPFLTraining.start <fedparity.strategies.fpfl.FPFLTraining.start>`;
    each does nothing here: subclass and override the ones you need.

    Order of the calls: :meth:`restore` (every observer), the protocol's setup (if not done
    yet), :meth:`begin`; then per round :meth:`should_stop`, :meth:`before_release`, the
    round, :meth:`after_round`; finally :meth:`end` (also after a stop, not after an
    exception: a crash leaves the files as they were at the last hook).
    """

    def restore(self, training: FPFLTraining, protocol: FPFLProtocol) -> int:
        """Before anything is sent: restore ``training`` from a checkpoint and return the last
        round it holds (0: start from round 1). At most one observer restores."""
        return 0

    def begin(self, training: FPFLTraining, protocol: FPFLProtocol, rounds: range) -> None:
        """After the setup: the rounds this call will train (empty if none are left)."""

    def should_stop(self, round_number: int, history: Sequence[Mapping[str, Any]]) -> str:
        """Before round ``round_number``: why to stop before it (``""``: go on)."""
        return ""

    def before_release(self, round_number: int) -> None:
        """Round ``round_number`` is sent next, and its noisy sum may exist from then on.
        Raise to stop before anything of the round is sent."""

    def after_round(self, round_number: int, outcome: RoundOutcome, entry: dict[str, Any]) -> None:
        """The round is over: ``outcome`` as the protocol recovered it, ``entry`` its history
        entry (already in ``training.history``; observers may add fields)."""

    def end(self, result: FPFLTrainingResult) -> None:
        """The loop ended (all rounds, a stop, or nothing left to train)."""


def training_fingerprint(training: FPFLTraining, protocol: FPFLProtocol) -> dict[str, Any]:
    """What must be equal for a folder's ledger and checkpoint to be this training's: the run
    parameters except those that follow from the population (``K``, sigma and the default
    delta: a training resumed without a node that left for good runs on at another ``q``,
    which the ledger keeps as a segment of its own), and the training's settings."""
    parameters = asdict(protocol.parameters)
    for name in ("population_size", "noise_multiplier", "delta"):
        parameters.pop(name)
    return {
        "parameters": parameters,
        "mmdm": asdict(training.mmdm),
        "use_mmdm": training.use_mmdm,
        "smoothing": training.smoothing,
        "require_fair_selection": training.selector.require_fair,
        "central_noise": bool(training.central_noise_multiplier),
    }


class DurableTraining(FPFLObserver):
    """The release ledger and the checkpoint of one training, in ``folder`` (the default
    observer of :meth:`FPFLTraining.start <fedparity.strategies.fpfl.FPFLTraining.start>`).

    Before each round is sent (:meth:`before_release`), the number of rounds released so far,
    this one included, is written to ``folder/privacy-ledger.json`` durably (scratch file,
    ``fsync``, atomic replace, ``fsync`` of the folder): a crash from then on cannot un-count
    it. Every ``checkpoint_every`` rounds, at the last round and after a stop, the weights,
    multipliers, smoothed sums, selected model and history go to ``checkpoint.npz`` and
    ``checkpoint.json``. A training started again on the same folder continues from the
    checkpoint, with the ledger's count: a clean stop costs nothing extra; after a crash the
    rounds released since the last checkpoint are run again and counted twice (the safe
    side), so the epsilon reported covers every round ever released.

    Each round's history entry gets ``rounds_released_total``, ``epsilon_spent`` (the
    accountant's, :func:`~fedparity.mechanisms.privacy.opacus_accounting.privacy_spent_history`,
    over every release; None without noise) and ``seconds``.

    Parameters
    ----------
    folder : str or Path, optional
        Where the files are kept (created if needed). Default: a new
        ``~/.fedparity/runs/fpfl-<UTC time>`` (as the FPFL job's ``output-dir``); pass it
        again to resume.
    checkpoint_every : int
        Rounds between checkpoints (>= 1).
    resume : bool
        Continue the training the folder holds (True), or refuse a folder that holds one
        (False: a ledger is never written over).
    fingerprint : mapping, optional
        The training's settings as JSON, stored in both files and compared on resume
        (default: :func:`training_fingerprint`).
    delta : float, optional
        The ledger's delta (default: the run parameters', else ``1 / K``).
    """

    #: How a refused folder's error starts, and what it advises.
    refusal_prefix = PREFIX
    refusal_advice = ADVICE

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        checkpoint_every: int = 10,
        resume: bool = True,
        fingerprint: Mapping[str, Any] | None = None,
        delta: float | None = None,
    ) -> None:
        self.chosen_folder = folder is not None
        self.folder = (
            Path(folder).expanduser()
            if folder is not None
            else new_run_folder("fpfl", DEFAULT_RUNS_DIR)
        )
        self.checkpoint_every = check_int_at_least("checkpoint_every", checkpoint_every, 1)
        self.resume = bool(resume)
        self.fingerprint = None if fingerprint is None else dict(fingerprint)
        self.delta = delta
        #: Every round released so far (after :meth:`restore`).
        self.ledger: ReleaseLedger | None = None
        self.checkpointed = 0
        self._training: FPFLTraining | None = None
        self._sigma = self._rate = 0.0
        self._accountant = "rdp"
        self._last = 0
        self._tick = 0.0

    # -- the hooks -------------------------------------------------------------------------

    def restore(self, training: FPFLTraining, protocol: FPFLProtocol) -> int:
        parameters = protocol.parameters
        self._training = training
        self._sigma = parameters.noise_multiplier
        self._rate = parameters.sample_rate  # q = min(1, m / K), as the nodes sample
        self._accountant = parameters.accountant
        if self.fingerprint is None:
            self.fingerprint = training_fingerprint(training, protocol)
        delta = self.delta
        if delta is None:
            delta = parameters.delta
        if delta is None:
            delta = 1.0 / parameters.population_size
        self.ledger = ReleaseLedger.single(
            0, noise_multiplier=self._sigma, sample_rate=self._rate, delta=delta
        )
        if not self.chosen_folder:
            log(logging.INFO, "FPFL training: release ledger and checkpoints in %s", self.folder)
        if not self.resume:
            held = [
                name
                for name in (RELEASE_LEDGER, CHECKPOINT_STATE, CHECKPOINT_ARRAYS)
                if (self.folder / name).exists()
            ]
            if held:
                raise ValueError(
                    f"{self.refusal_prefix}: {self.folder} already holds a training "
                    f"({', '.join(held)}); its release ledger is never written over: resume it "
                    "or use another folder"
                )
            return 0
        rounds = self._load_checkpoint(training)
        self.checkpointed = rounds
        self.ledger = resumed_ledger(
            self.folder,
            self.fingerprint,
            rounds,
            noise_multiplier=self._sigma,
            sample_rate=self._rate,
            delta=delta,
            prefix=self.refusal_prefix,
            advice=self.refusal_advice,
        )
        self._log_resumed(rounds, parameters.population_size)
        return rounds

    def begin(self, training: FPFLTraining, protocol: FPFLProtocol, rounds: range) -> None:
        self._last = rounds.stop - 1

    def before_release(self, round_number: int) -> None:
        self._tick = time.perf_counter()
        # Durable *before* the round is sent: a crash from here on cannot un-count it.
        self.ledger = self._ledger.after_release(self._sigma, self._rate)
        save_release_ledger(self.folder, self.ledger, self._fingerprint)

    def after_round(self, round_number: int, outcome: RoundOutcome, entry: dict[str, Any]) -> None:
        entry["rounds_released_total"] = self._ledger.rounds_released
        spent = self.spent()
        entry["epsilon_spent"] = None if spent is None else spent.epsilon
        entry["seconds"] = time.perf_counter() - self._tick
        if round_number % self.checkpoint_every == 0 or round_number == self._last:
            self.checkpoint(round_number)

    def end(self, result: FPFLTrainingResult) -> None:
        if result.rounds_trained > self.checkpointed:  # stopped between two checkpoints
            self.checkpoint(result.rounds_trained)

    # -- the files -------------------------------------------------------------------------

    def spent(self) -> PrivacySpent | None:
        """The privacy spent by every round the ledger counts (None without noise)."""
        if not self._sigma:
            return None
        segments = self._ledger.accountant_history() or [(self._sigma, self._rate, 0)]
        return privacy_spent_history(
            segments,
            delta=self._ledger.delta,
            accountant=self._accountant,  # type: ignore[arg-type]
        )

    def checkpoint(self, round_number: int) -> None:
        """Write the training's state after round ``round_number``."""
        training = self._trained
        arrays: dict[str, np.ndarray] = {
            "weights": training.weights,
            "multipliers": training.multipliers,
        }
        if training.smoothed_total is not None:
            arrays["smoothed_total"] = training.smoothed_total
        fairfed = (training.node_weights, training.base_weights, training.smoothed_releases)
        if all(array is not None for array in fairfed):
            arrays["fairfed_nodes"] = np.asarray(training.fairfed_nodes, dtype=np.uint64)
            for name, array in zip(
                ("node_weights", "base_weights", "smoothed_releases"), fairfed, strict=True
            ):
                arrays[name] = np.asarray(array)
        state: dict[str, Any] = {"round": round_number, "history": training.history}
        best = training.selector.best
        if best is not None:
            arrays["best_weights"] = best.weights
            state["best_round"] = best.round
            state["best_metrics"] = metrics_to_json(best.metrics)
        state["arrays"] = arrays
        save_checkpoint(self.folder, state, self._fingerprint)
        self.checkpointed = round_number

    def _load_checkpoint(self, training: FPFLTraining) -> int:
        state = load_checkpoint(
            self.folder,
            self._fingerprint,
            prefix=self.refusal_prefix,
            advice=self.refusal_advice,
        )
        if state is None:
            return 0
        arrays = state["arrays"]
        training.weights = arrays["weights"]
        training.multipliers = arrays["multipliers"]
        training.smoothed_total = arrays.get("smoothed_total")
        if "node_weights" in arrays:  # FairFed
            training.fairfed_nodes = [int(node) for node in arrays["fairfed_nodes"]]
            training.node_weights = arrays["node_weights"]
            training.base_weights = arrays["base_weights"]
            training.smoothed_releases = arrays["smoothed_releases"]
        training.history = state["history"]
        if "best_weights" in arrays:
            training.selector.consider(
                int(state["best_round"]),
                arrays["best_weights"],
                metrics_from_json(state["best_metrics"]),
            )
        log(logging.INFO, "resuming from round %d (%s)", int(state["round"]) + 1, self.folder)
        return int(state["round"])

    def _log_resumed(self, rounds: int, population_size: int) -> None:
        ledger = self._ledger
        if ledger.rounds_released > rounds:
            log(
                logging.WARNING,
                "the privacy ledger counts %d released round(s), the checkpoint holds %d: the "
                "%d round(s) released after the last checkpoint are discarded but stay counted "
                "in epsilon, and the rounds run again count as new releases",
                ledger.rounds_released,
                rounds,
                ledger.rounds_released - rounds,
            )
        earlier = ledger.segments[-1] if ledger.segments else None
        if (
            earlier is not None
            and earlier.rounds
            and (
                not math.isclose(earlier.noise_multiplier, self._sigma, rel_tol=1e-12)
                or not math.isclose(earlier.sample_rate, self._rate, rel_tol=1e-12)
            )
        ):
            log(
                logging.WARNING,
                "FPFL resumes with sigma = %.4g, q = %.4g (%d users now; before: sigma = %.4g, "
                "q = %.4g): the accountant composes both segments",
                self._sigma,
                self._rate,
                population_size,
                earlier.noise_multiplier,
                earlier.sample_rate,
            )

    @property
    def _ledger(self) -> ReleaseLedger:
        if self.ledger is None:
            raise RuntimeError("DurableTraining: restore() was not called (use it as an observer)")
        return self.ledger

    @property
    def _fingerprint(self) -> dict[str, Any]:
        if self.fingerprint is None:
            raise RuntimeError("DurableTraining: restore() was not called (use it as an observer)")
        return self.fingerprint

    @property
    def _trained(self) -> FPFLTraining:
        if self._training is None:
            raise RuntimeError("DurableTraining: restore() was not called (use it as an observer)")
        return self._training


class StopAfterLostRounds(FPFLObserver):
    """Stop after ``limit`` lost rounds in a row (counted in this call of ``start``): every
    further round would likely be lost too while still spending privacy."""

    def __init__(self, limit: int) -> None:
        self.limit = check_int_at_least("limit", limit, 1)
        self.lost_in_a_row = 0
        self.last_reason = ""

    def begin(self, training: FPFLTraining, protocol: FPFLProtocol, rounds: range) -> None:
        self.lost_in_a_row = 0

    def after_round(self, round_number: int, outcome: RoundOutcome, entry: dict[str, Any]) -> None:
        if outcome.total is None:
            self.lost_in_a_row += 1
            self.last_reason = outcome.reason
        else:
            self.lost_in_a_row = 0

    def should_stop(self, round_number: int, history: Sequence[Mapping[str, Any]]) -> str:
        if self.lost_in_a_row < self.limit:
            return ""
        return (
            f"{self.lost_in_a_row} round(s) in a row were lost (last: {self.last_reason}); "
            "every further round would likely be lost too while still spending privacy"
        )


class StopWhenTooFewNodes(FPFLObserver):
    """Stop before a round that cannot succeed: with distributed noise, fewer member nodes
    are connected (``grid.get_node_ids()``) than the ``n_min`` whose noise shares a round
    needs, so it would be lost while still counted as released."""

    def __init__(self) -> None:
        self.protocol: FPFLProtocol | None = None

    def begin(self, training: FPFLTraining, protocol: FPFLProtocol, rounds: range) -> None:
        self.protocol = protocol

    def should_stop(self, round_number: int, history: Sequence[Mapping[str, Any]]) -> str:
        protocol = self.protocol
        if protocol is None or not protocol.distributed_noise or protocol.noise_share_std() == 0:
            return ""
        connected = set(protocol.grid.get_node_ids()) & set(protocol.members)
        needed = protocol.min_survivors()
        if len(connected) >= needed:
            return ""
        return (
            f"only {len(connected)} of the {len(protocol.members)} member node(s) are "
            f"connected, fewer than n_min = {needed} whose noise shares a round needs"
        )
