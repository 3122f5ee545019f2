"""The FPFL job (paper 004, SPEC 3): train under a fairness constraint with user-level DP.

One run trains with one of the six algorithms of the paper's Table 2 (``fpfl-algorithm``):
``fl`` (FederatedSGD), ``fl-clip``, ``pfl`` (clip + Gaussian noise), ``ffl`` (MMDM),
``ffl-clip`` and ``fpfl`` (MMDM + clip + noise). Every round (FedSGD structure: one update,
no local epochs) the nodes return the secure sum of their cohort users' statistic vectors
(:class:`fedparity.strategies.fpfl.FPFLProtocol`); the server splits it
(:class:`fedparity.mechanisms.mmdm.StatisticsLayout`), offers the model that produced it to the
model
selector (best cohort accuracy among the models fair on cohort statistics; Section 4.1) and
applies :func:`fedparity.mechanisms.mmdm.mmdm_update` or
:func:`fedparity.mechanisms.mmdm.sgd_update`.

Privacy: ``sigma`` is calibrated with Opacus for (``fpfl-epsilon``, ``fpfl-delta``,
``q = m / K``, ``T``) and the epsilon actually spent is recomputed
(:mod:`fedparity.mechanisms.dp_accounting`) over **every round ever released** for this run; every
round sent counts, including a lost one.

Release ledger (``output-dir/privacy-ledger.json``): before round ``t`` is sent to the nodes
(so before its noisy sum can exist, let alone be read or used) the total number of rounds
released so far, this one included, is written to the ledger durably (write, ``fsync``,
atomic replace, ``fsync`` of the folder). A crash after the last checkpoint therefore cannot
hide rounds already released: with checkpoints every 5 rounds and a crash in round 7, the
ledger says 7, the resumed run restarts from the round-5 checkpoint and re-runs rounds 6
and 7 with fresh cohorts and noise, and the epsilon reported is the accountant's for
``7 + (T - 5)`` releases (``privacy.rounds_released_total``), more than for ``T``. A crash
between the ledger write and the send over-counts by one round (the safe side).

Checkpoints (``output-dir/checkpoint.npz``, every ``fpfl-checkpoint-every`` rounds and at the
end) hold the weights, multipliers, round, selected model and history; with
``fpfl-resume = true`` a run continues from the checkpoint in ``output-dir`` and from the
ledger's count: a clean stop at a checkpoint (``fpfl-stop-after``) and a resume cost
nothing extra, a crash costs the rounds re-run. A run without ``fpfl-resume`` starts a new
ledger (and a new model).

The held-out test evaluation (accuracy; FNR, EO, DemP and PP gaps) is done by the simulation
harness, which loads the same population as the nodes (``ground-truth = true``); the paper
also evaluates on a central test set.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import log
from flwr.serverapp import Grid

from ..clients.config import ConfigError, RunConfig
from ..clients.fpfl_data import check_groups_present
from ..clients.fpfl_node import population, round_rng
from ..clients.fpfl_task import (
    build_model_for,
    constraint_mask,
    get_flat_parameters,
    predict,
    set_flat_parameters,
    statistics_layout,
)
from ..mechanisms.dp_accounting import PrivacySpent, calibrate_noise, privacy_spent, sample_rate
from ..mechanisms.mmdm import (
    FairnessGaps,
    MMDMConfig,
    ModelSelector,
    StatisticsLayout,
    cohort_metrics,
    evaluate_constraints,
    exponential_average,
    fairness_gaps,
    mmdm_update,
    privatize_sum,
    sgd_update,
    with_constraint_terms,
)
from ..strategies.fpfl import FPFLProtocol
from .harness import HARNESS_LABEL
from .orchestration import connect_nodes, resolve_output_dir
from .report import write_json

__all__ = [
    "PAPER_TABLE2",
    "RELEASE_LEDGER",
    "ReleaseLedger",
    "cohort_sample_rate",
    "load_checkpoint",
    "read_release_ledger",
    "run_fpfl",
    "save_checkpoint",
    "write_release_ledger",
]

#: Paper 004, Table 2 (Adult, shallow network): (accuracy, FNR gap) by (algorithm, m).
PAPER_TABLE2: dict[tuple[str, int], tuple[float, float]] = {
    ("fl", 200): (0.851, 0.121),
    ("ffl", 200): (0.855, 0.036),
    ("fl-clip", 200): (0.844, 0.169),
    ("ffl-clip", 200): (0.853, 0.018),
    ("pfl", 200): (0.844, 0.167),
    ("fpfl", 200): (0.840, 0.001),
    ("pfl", 1000): (0.847, 0.148),
    ("fpfl", 1000): (0.851, 0.001),
}
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


def _resumed_releases(
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
# Reporting helpers
# --------------------------------------------------------------------------------------------


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _progress_line(entry: dict[str, Any]) -> str:
    gaps = entry.get("cohort_gap")
    rates = entry.get("group_error_rates") or []
    return (
        f"round {entry['round']:>4}: cohort loss {_fmt(entry.get('cohort_loss'))} acc "
        f"{_fmt(entry.get('cohort_accuracy'))} | constraint gap {_fmt(gaps)} "
        f"(group rates {', '.join(_fmt(r) for r in rates)}) | lambda "
        f"{', '.join(f'{m:.3f}' for m in entry['multipliers'])} | eps spent "
        f"{_fmt(entry.get('epsilon_spent'))} | nodes {entry['replied']}/{entry['members']}"
        + (f" | LOST: {entry['lost']}" if entry.get("lost") else "")
    )


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def plot_training(path: Path, history: list[dict[str, Any]], alpha: float) -> str | None:
    """Training curves (cohort loss and accuracy, constraint gap, multipliers, epsilon); PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'fedparity[plot]'): no plot written"
    rounds = [entry["round"] for entry in history]

    def series(key: str) -> list[float]:
        return [math.nan if entry.get(key) is None else entry[key] for entry in history]

    figure, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    axes[0, 0].plot(rounds, series("cohort_accuracy"), label="accuracy")
    axes[0, 0].plot(rounds, series("cohort_loss"), label="loss")
    axes[0, 0].set_ylabel("cohort accuracy / loss (noisy)")
    axes[0, 0].legend()
    axes[0, 1].plot(rounds, series("cohort_gap"), label="hard gap (noisy)")
    axes[0, 1].plot(rounds, series("surrogate_gap"), label="surrogate gap (noisy)")
    axes[0, 1].axhline(alpha, color="0.5", linestyle="--", label="alpha")
    axes[0, 1].set_ylabel("constraint gap")
    axes[0, 1].legend()
    multipliers = np.array([entry["multipliers"] for entry in history])
    for group in range(multipliers.shape[1] if multipliers.ndim == 2 else 0):
        axes[1, 0].plot(rounds, multipliers[:, group], label=f"group {group}")
    axes[1, 0].set_ylabel("multiplier lambda")
    axes[1, 0].legend()
    axes[1, 1].plot(rounds, series("epsilon_spent"))
    axes[1, 1].set_ylabel("epsilon spent")
    for axis in axes[1]:
        axis.set_xlabel("round")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def cohort_sample_rate(config: RunConfig, population_size: int) -> float:
    """``q = m / K``, once the nodes have reported ``K``; ConfigError naming
    ``fpfl-cohort-size`` when ``m > K`` (checked before any training round)."""
    if config.fpfl_cohort_size > population_size:
        raise ConfigError(
            f"fpfl-cohort-size (m = {config.fpfl_cohort_size}) must be <= the number of users "
            f"K = {population_size} reported by the nodes"
        )
    return sample_rate(config.fpfl_cohort_size, population_size)


def run_fpfl(grid: Grid, config: RunConfig) -> Path:
    """Train with ``fpfl-algorithm``; write results.json, plots and checkpoints."""
    output_dir = resolve_output_dir(config)
    started = time.perf_counter()
    node_ids, nodes = connect_nodes(grid, config, minimum=1)
    if nodes.sample_shape is None or nodes.num_classes is None or nodes.num_groups is None:
        raise RuntimeError("the nodes did not describe FPFL data (is task = 'fpfl' on them?)")
    population_size = nodes.num_users
    rate = cohort_sample_rate(config, population_size)
    delta = config.fpfl_delta if config.fpfl_delta is not None else 1.0 / population_size
    num_partitions = max((n for _, n in nodes.partitions), default=len(node_ids))
    test = None
    if config.ground_truth:
        train_population, test = population(config, num_partitions)
        check_groups_present(
            train_population,
            constraint_samples=constraint_mask(train_population.labels, config.fpfl_constraint),
        )
    calibration = None
    sigma = 0.0
    if config.fpfl_private:
        calibration = calibrate_noise(
            epsilon=config.fpfl_epsilon,
            delta=delta,
            cohort_size=config.fpfl_cohort_size,
            population_size=population_size,
            steps=config.fpfl_rounds,
            accountant=config.fpfl_accountant,  # type: ignore[arg-type]
        )
        sigma = calibration.noise_multiplier
    model = build_model_for(
        config.fpfl_architecture,
        nodes.sample_shape,
        num_classes=nodes.num_classes,
        seed=config.seed,
    )
    layout: StatisticsLayout = statistics_layout(model, nodes.num_groups)
    active = [node for node in node_ids if node in nodes.users_by_node]
    protocol = FPFLProtocol(
        grid,
        node_ids=active,
        vector_size=layout.size,
        population_size=population_size,
        max_node_users=max(nodes.users_by_node.values()),
        noise_multiplier=sigma,
        clipping_bound=config.fpfl_clipping_bound if config.fpfl_clips else None,
        masking=config.fpfl_secure_sum == "masking",
        distributed_noise=config.fpfl_noise == "distributed",
        dropout_tolerance=config.fpfl_dropout_tolerance,
        reply_timeout=config.reply_timeout,
    )
    protocol.setup()
    log(
        logging.INFO,
        "fedparity FPFL: algorithm %s, %d node(s), K = %d users, m = %d (q = %.4f), T = %d, "
        "sigma = %.4f (%s), C = %g, noise %s, secure sum %s",
        config.fpfl_algorithm,
        len(protocol.members),
        population_size,
        config.fpfl_cohort_size,
        rate,
        config.fpfl_rounds,
        sigma,
        config.fpfl_accountant if sigma else "no noise",
        config.fpfl_clipping_bound if config.fpfl_clips else math.inf,
        config.fpfl_noise if sigma else "-",
        config.fpfl_secure_sum,
    )
    mmdm = MMDMConfig(
        alpha=config.fpfl_alpha,
        learning_rate=config.fpfl_learning_rate,
        multiplier_learning_rate=config.fpfl_multiplier_learning_rate,
        damping=config.fpfl_damping,
        activation=config.fpfl_constraint_activation,
        error_surrogate=config.fpfl_constraint == "fnr",
    )
    weights = get_flat_parameters(model)
    multipliers = np.zeros(layout.num_groups)
    selector = ModelSelector(require_fair=config.fpfl_uses_mmdm)
    smoothing = config.fpfl_statistics_smoothing
    smoothed_total: np.ndarray | None = None  # EMA of the released sums (smoothing > 0)
    history: list[dict[str, Any]] = []
    first_round = 1
    ledger = ReleaseLedger(0, noise_multiplier=sigma, sample_rate=rate, delta=delta)
    if config.fpfl_resume:
        state = load_checkpoint(output_dir, config)
        if state is not None:
            weights = state["arrays"]["weights"]
            multipliers = state["arrays"]["multipliers"]
            history = state["history"]
            smoothed_total = state["arrays"].get("smoothed_total")
            first_round = int(state["round"]) + 1
            if "best_weights" in state["arrays"]:
                selector.consider(
                    int(state["best_round"]),
                    state["arrays"]["best_weights"],
                    _metrics_from_json(state["best_metrics"]),
                )
            log(logging.INFO, "resuming from round %d (%s)", first_round, output_dir)
        released = _resumed_releases(output_dir, config, ledger, first_round - 1)
        ledger = ReleaseLedger(released, noise_multiplier=sigma, sample_rate=rate, delta=delta)
        if released > first_round - 1:
            log(
                logging.WARNING,
                "the privacy ledger counts %d released round(s), the checkpoint holds %d: the "
                "%d round(s) released after the last checkpoint are discarded but stay counted "
                "in epsilon, and the rounds run again count as new releases",
                released,
                first_round - 1,
                released - (first_round - 1),
            )
    last_round = config.fpfl_rounds
    if config.fpfl_stop_after:
        last_round = min(last_round, first_round - 1 + config.fpfl_stop_after)
    round_seconds: list[float] = []

    def spent_after(rounds: int) -> PrivacySpent | None:
        """Privacy spent by ``rounds`` released rounds (None without noise)."""
        if not sigma:
            return None
        return privacy_spent(
            noise_multiplier=sigma,
            sample_rate=rate,
            steps=rounds,
            delta=delta,
            accountant=config.fpfl_accountant,  # type: ignore[arg-type]
        )

    for round_number in range(first_round, last_round + 1):
        tick = time.perf_counter()
        # Durable *before* the round is sent: a crash from here on cannot un-count it.
        ledger = replace(ledger, rounds_released=ledger.rounds_released + 1)
        write_release_ledger(output_dir, config, ledger)
        outcome = protocol.run_round(round_number, weights)
        entry: dict[str, Any] = {
            "round": round_number,
            "members": len(protocol.members),
            "replied": len(outcome.replied),
            "missing": outcome.missing,
            "rejected": [{"node_id": n, "reason": r} for n, r in outcome.rejected],
        }
        if outcome.total is None:
            entry["lost"] = outcome.reason
        else:
            total = outcome.total
            if sigma and config.fpfl_noise == "central":
                rng = round_rng(config.fpfl_client_seed, 0, round_number, central=True)
                total = privatize_sum(
                    total,
                    clipping_bound=config.fpfl_clipping_bound,
                    noise_multiplier=sigma,
                    rng=rng,
                ).values
            stats = layout.split(total)
            raw_metrics = cohort_metrics(stats, config.fpfl_alpha, min_count=mmdm.min_count)
            # Selection and the constraint terms read the smoothed sums (smoothing > 0) or
            # this round's sum; the loss gradient always comes from this round's sum.
            smoothed = stats
            if smoothing:
                smoothed_total = exponential_average(smoothed_total, total, smoothing)
                smoothed = layout.split(smoothed_total)
            metrics = cohort_metrics(smoothed, config.fpfl_alpha, min_count=mmdm.min_count)
            selector.consider(round_number, weights, metrics)
            constraints = evaluate_constraints(  # the surrogate gap, for the progress display
                smoothed, config.fpfl_alpha, min_count=mmdm.min_count
            )
            if config.fpfl_uses_mmdm:
                update = mmdm_update(
                    weights, multipliers, with_constraint_terms(stats, smoothed), mmdm
                )
                weights, multipliers = update.weights, update.multipliers
            else:
                weights = sgd_update(
                    weights, stats, config.fpfl_learning_rate, min_count=mmdm.min_count
                )
            entry.update(
                {
                    "cohort_loss": _finite(stats.loss_sum / max(stats.num_samples, mmdm.min_count)),
                    "cohort_accuracy": _finite(raw_metrics.accuracy),
                    "cohort_gap": _finite(raw_metrics.gap),
                    "group_error_rates": [_finite(r) for r in raw_metrics.group_error_rates],
                    "surrogate_gap": _finite(constraints.max_gap),
                    "cohort_size_noisy": _finite(stats.num_samples),
                }
            )
            if smoothing:
                entry["smoothed_cohort_accuracy"] = _finite(metrics.accuracy)
                entry["smoothed_cohort_gap"] = _finite(metrics.gap)
        entry["multipliers"] = [float(m) for m in multipliers]
        entry["rounds_released_total"] = ledger.rounds_released
        spent_so_far = spent_after(ledger.rounds_released)
        entry["epsilon_spent"] = None if spent_so_far is None else spent_so_far.epsilon
        entry["seconds"] = time.perf_counter() - tick
        round_seconds.append(entry["seconds"])
        history.append(entry)
        log(logging.INFO, "%s", _progress_line(entry))
        if round_number % config.fpfl_checkpoint_every == 0 or round_number == last_round:
            _checkpoint(
                output_dir,
                config,
                round_number,
                weights,
                multipliers,
                selector,
                history,
                smoothed_total,
            )
    if last_round < first_round:
        log(logging.INFO, "nothing to do: the checkpoint is already at round %d", first_round - 1)
    rounds_done = max(first_round - 1, last_round)
    spent = spent_after(ledger.rounds_released)
    best = selector.best
    if config.fpfl_model_selection == "last":
        # The weights after the last update (evaluation.final): never sent, so no cohort
        # statistics describe them; selected_round = the last round trained.
        best = None
        selected_weights = weights
        selected_round: int | None = rounds_done
    else:
        selected_weights = best.weights if best is not None else weights
        selected_round = None if best is None else best.round
    evaluation: dict[str, Any] = {}
    if test is not None:
        for name, vector in (("selected", selected_weights), ("final", weights)):
            set_flat_parameters(model, vector)
            gaps = fairness_gaps(
                test.labels, predict(model, test.features), test.groups, test.num_groups
            )
            evaluation[name] = gaps
    headline: FairnessGaps | None = evaluation.get("selected")
    payload: dict[str, Any] = {
        "task": config.task,
        "algorithm": config.fpfl_algorithm,
        "accuracy": None if headline is None else headline.accuracy,
        "fnr_gap": None if headline is None else headline.fnr_gap,
        "eo_gap": None if headline is None else headline.eo_gap,
        "demp_gap": None if headline is None else headline.demp_gap,
        "pp_gap": None if headline is None else headline.pp_gap,
        "accuracy_gap": None if headline is None else headline.accuracy_gap,
        "epsilon": None if spent is None else spent.epsilon,
        "delta": delta if sigma else None,
        "noise_multiplier": sigma if sigma else None,
        "private": bool(sigma),
        "privacy": {
            "accountant": config.fpfl_accountant if sigma else None,
            "sampling": "Poisson, q = m / K, drawn on the nodes",
            "sample_rate": rate,
            # epsilon is the accountant's for rounds_released_total (the ledger): every round
            # ever sent, including the rounds an interrupted run released after its last
            # checkpoint (rounds_discarded_by_crashes: not in the model, still spent).
            "rounds_released_total": ledger.rounds_released,
            "rounds_released": ledger.rounds_released,  # same; kept for existing readers
            "rounds_trained": rounds_done,
            "rounds_discarded_by_crashes": ledger.rounds_released - rounds_done,
            "release_ledger": str(output_dir / RELEASE_LEDGER),
            "rounds_planned": config.fpfl_rounds,
            "target_epsilon": config.fpfl_epsilon if sigma else None,
            "calibrated_epsilon_at_T": None
            if calibration is None
            else calibration.achieved.epsilon,
            "noise": config.fpfl_noise if sigma else None,
            "noise_share_std": protocol.noise_share_std(),
            "secure_sum": config.fpfl_secure_sum,
            "client_seed": config.fpfl_client_seed,
            "caveats": _privacy_caveats(config, sigma, ledger.rounds_released - rounds_done),
        },
        "selected_round": selected_round,
        "model_selection": config.fpfl_model_selection,
        "selected_fair_on_cohort": None if best is None else best.metrics.fair,
        "evaluation": {
            "source": f"held-out test set ({HARNESS_LABEL})",
            **{name: asdict(gaps) for name, gaps in evaluation.items()},
        },
        "paper": _paper_row(config),
        "population": {
            "users": population_size,
            "nodes": len(protocol.members),
            "setup_failed": [{"node_id": n, "reason": r} for n, r in protocol.setup_failed],
        },
        "timing": {
            "seconds_total": time.perf_counter() - started,
            "seconds_per_round_mean": float(np.mean(round_seconds)) if round_seconds else None,
        },
        "history": history,
        "run_config": asdict(config),
    }
    write_json(output_dir / "results.json", payload)
    note = (
        plot_training(output_dir / "training.png", history, config.fpfl_alpha) if history else None
    )
    for line in ("", *_summary(payload).splitlines(), ""):
        log(logging.INFO, "%s", line)
    if note:
        log(logging.WARNING, "%s", note)
    log(logging.INFO, "results written to %s", output_dir)
    return output_dir


def _checkpoint(
    folder: Path,
    config: RunConfig,
    round_number: int,
    weights: np.ndarray,
    multipliers: np.ndarray,
    selector: ModelSelector,
    history: list[dict[str, Any]],
    smoothed_total: np.ndarray | None = None,
) -> None:
    arrays = {"weights": weights, "multipliers": multipliers}
    if smoothed_total is not None:
        arrays["smoothed_total"] = smoothed_total
    state: dict[str, Any] = {"round": round_number, "history": history}
    if selector.best is not None:
        arrays["best_weights"] = selector.best.weights
        state["best_round"] = selector.best.round
        state["best_metrics"] = _metrics_to_json(selector.best.metrics)
    state["arrays"] = arrays
    save_checkpoint(folder, config, state)


def _metrics_to_json(metrics: Any) -> dict[str, Any]:
    return {
        "accuracy": metrics.accuracy,
        "group_error_rates": [float(r) for r in metrics.group_error_rates],
        "overall_error_rate": metrics.overall_error_rate,
        "gap": metrics.gap,
        "fair": metrics.fair,
    }


def _metrics_from_json(values: dict[str, Any]) -> Any:
    from ..mechanisms.mmdm import CohortMetrics

    return CohortMetrics(
        accuracy=float(values["accuracy"]),
        group_error_rates=np.asarray(values["group_error_rates"], dtype=np.float64),
        overall_error_rate=float(values["overall_error_rate"]),
        gap=float(values["gap"]),
        fair=bool(values["fair"]),
    )


def _privacy_caveats(config: RunConfig, sigma: float, discarded: int = 0) -> list[str]:
    notes: list[str] = []
    if sigma and discarded > 0:
        notes.append(
            f"{discarded} round(s) were released by an interrupted run after its last "
            "checkpoint and discarded on resuming: they still count in epsilon, which can "
            "therefore exceed the epsilon calibrated for fpfl-rounds"
        )
    if not sigma:
        notes.append(f"{config.fpfl_algorithm}: no noise, no differential privacy (baseline)")
    if config.fpfl_client_seed is not None:
        notes.append(
            "fpfl-client-seed is set: cohorts and noise are reproducible by anyone who knows "
            "the seed, so this run is NOT private (use it for experiments only)"
        )
    if sigma and config.fpfl_secure_sum == "none" and config.fpfl_noise == "distributed":
        notes.append(
            "fpfl-secure-sum = none with distributed noise: each node's sum reaches the server "
            "with only that node's noise share; the stated epsilon holds for the aggregate only"
        )
    if sigma and config.fpfl_noise == "central":
        notes.append("central noise: the server (trusted aggregator) sees the un-noised sum")
    return notes


def _paper_row(config: RunConfig) -> dict[str, Any] | None:
    if config.dataset != "adult" or config.fpfl_architecture != "shallow":
        return None
    row = PAPER_TABLE2.get((config.fpfl_algorithm, config.fpfl_cohort_size))
    if row is None:
        return None
    return {"table": "paper 004, Table 2 (shallow)", "accuracy": row[0], "fnr_gap": row[1]}


def _summary(payload: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    lines = [
        f"FPFL result ({payload['algorithm']}; selected round {payload['selected_round']}; "
        f"test set: {payload['evaluation']['source']}):",
        f"{'':>10} {'accuracy':>9} {'FNR gap':>9} {'EO gap':>9} {'DemP gap':>9} {'PP gap':>9}",
        f"{'ours':>10} {cell(payload['accuracy']):>9} {cell(payload['fnr_gap']):>9} "
        f"{cell(payload['eo_gap']):>9} {cell(payload['demp_gap']):>9} {cell(payload['pp_gap']):>9}",
    ]
    paper = payload.get("paper")
    if paper:
        lines.append(
            f"{'paper':>10} {paper['accuracy']:>9.3f} {paper['fnr_gap']:>9.3f} "
            f"{'':>9} {'':>9} {'':>9}   ({paper['table']})"
        )
    if payload["private"]:
        lines.append(
            f"privacy: epsilon = {payload['epsilon']:.4f} spent after "
            f"{payload['privacy']['rounds_released_total']} released round(s), "
            f"delta = {payload['delta']:.3g}, "
            f"noise multiplier = {payload['noise_multiplier']:.4f} "
            f"({payload['privacy']['accountant']}, {payload['privacy']['noise']} noise)"
        )
    for note in payload["privacy"]["caveats"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
