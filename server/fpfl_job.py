"""The FPFL job: train under a fairness constraint with user-level DP.

FPFL is the algorithm of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021, "the paper" below).

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

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

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
from ..clients.process import freeze_warm_heap, thaw_heap
from ..mechanisms.dp_accounting import (
    PrivacySpent,
    calibrate_noise,
    privacy_spent_history,
    sample_rate,
)
from ..mechanisms.mmdm import (
    FairnessGaps,
    MMDMConfig,
    ModelSelector,
    StatisticsLayout,
    fairness_gaps,
)
from ..mechanisms.protocol.fpfl import FPFLRunParameters
from ..strategies.fpfl import FPFLProtocol, FPFLTraining
from .fpfl_checkpoint import (
    RELEASE_LEDGER,
    ReleaseLedger,
    load_checkpoint,
    resumed_ledger,
    save_checkpoint,
    write_release_ledger,
)
from .fpfl_report import (
    fairness_constraint,
    fpfl_report,
    metrics_from_json,
    metrics_to_json,
    paper_row,
    plot_training,
    privacy_caveats,
    progress_line,
    summary_text,
    training_caveats,
)
from .harness import HARNESS_LABEL
from .html_report import write_report
from .orchestration import connect_nodes, harness_applies
from .progress import Progress
from .report import write_json
from .run_record import RunRecord, open_run_record

__all__ = ["cohort_sample_rate", "run_fpfl"]

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


@dataclass(frozen=True)
class FPFLRun:
    """What one FPFL training gave: its folder, its results.json content and the reported
    model's flat parameters (``named_parameters`` order)."""

    output_dir: Path
    results: dict[str, Any]
    weights: NDArray[np.float64]


def run_fpfl(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train with ``fpfl-algorithm``; write results.json, plots and checkpoints."""
    return train_fpfl(grid, config, record).output_dir


def train_fpfl(
    grid: Grid, config: RunConfig, record: RunRecord | None = None, *, session: str = ""
) -> FPFLRun:
    """:func:`run_fpfl`, returning the reported model too; ``session`` labels the training
    when a run trains more than once (the pipeline)."""
    record = record if record is not None else open_run_record(config)
    output_dir = record.folder
    started = time.perf_counter()
    node_ids, nodes = connect_nodes(grid, config, minimum=1)
    if nodes.sample_shape is None or nodes.num_classes is None or nodes.num_groups is None:
        raise RuntimeError("the nodes did not describe FPFL data (is task = 'fpfl' on them?)")
    population_size = nodes.num_users
    rate = cohort_sample_rate(config, population_size)
    delta = config.fpfl_delta if config.fpfl_delta is not None else 1.0 / population_size
    num_partitions = max((n for _, n in nodes.partitions), default=len(node_ids))
    test = None
    if harness_applies(config, nodes):
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
    parameters = FPFLRunParameters(
        population_size=population_size,
        cohort_size=config.fpfl_cohort_size,
        rounds=config.fpfl_rounds,
        clipping_bound=config.fpfl_clipping_bound if config.fpfl_clips else None,
        epsilon=config.fpfl_epsilon if config.fpfl_private else None,
        delta=delta if config.fpfl_private else None,
        noise_multiplier=sigma,
        accountant=config.fpfl_accountant,
        constraint=config.fpfl_constraint,
        num_groups=nodes.num_groups,
        vector_size=layout.size,
        distributed_noise=config.fpfl_noise == "distributed",
        masking=config.fpfl_secure_sum == "masking",
        dropout_tolerance=config.fpfl_dropout_tolerance,
        session=session,
    )
    protocol = FPFLProtocol(
        grid, node_ids=active, parameters=parameters, reply_timeout=config.reply_timeout
    )
    protocol.setup()
    freeze_warm_heap()  # data, model and accountant are loaded: full collections skip them
    fragile = _fragile(config, protocol, sigma)
    if fragile:
        if config.fpfl_require_dropout_tolerance:
            raise ConfigError(f"fpfl-require-dropout-tolerance: {fragile}")
        log(logging.WARNING, "FPFL: %s", fragile)
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
    central = bool(sigma) and config.fpfl_noise == "central"
    training = FPFLTraining(
        layout,
        get_flat_parameters(model),
        mmdm=mmdm,
        use_mmdm=config.fpfl_uses_mmdm,
        smoothing=config.fpfl_statistics_smoothing,
        central_noise_multiplier=sigma if central else 0.0,
        clipping_bound=config.fpfl_clipping_bound,
        central_noise_rng=lambda round_number: round_rng(
            config.fpfl_client_seed, 0, round_number, central=True
        ),
    )
    history: list[dict[str, Any]] = []
    first_round = 1
    ledger = ReleaseLedger.single(0, noise_multiplier=sigma, sample_rate=rate, delta=delta)
    if config.fpfl_resume:
        state = load_checkpoint(output_dir, config)
        if state is not None:
            training.weights = state["arrays"]["weights"]
            training.multipliers = state["arrays"]["multipliers"]
            history = state["history"]
            training.smoothed_total = state["arrays"].get("smoothed_total")
            first_round = int(state["round"]) + 1
            if "best_weights" in state["arrays"]:
                training.selector.consider(
                    int(state["best_round"]),
                    state["arrays"]["best_weights"],
                    metrics_from_json(state["best_metrics"]),
                )
            log(logging.INFO, "resuming from round %d (%s)", first_round, output_dir)
        ledger = resumed_ledger(
            output_dir,
            config,
            first_round - 1,
            noise_multiplier=sigma,
            sample_rate=rate,
            delta=delta,
        )
        delta = ledger.delta
        if ledger.rounds_released > first_round - 1:
            log(
                logging.WARNING,
                "the privacy ledger counts %d released round(s), the checkpoint holds %d: the "
                "%d round(s) released after the last checkpoint are discarded but stay counted "
                "in epsilon, and the rounds run again count as new releases",
                ledger.rounds_released,
                first_round - 1,
                ledger.rounds_released - (first_round - 1),
            )
        earlier = ledger.segments[-1] if ledger.segments else None
        if (
            earlier is not None
            and earlier.rounds
            and (
                not math.isclose(earlier.noise_multiplier, sigma, rel_tol=1e-12)
                or not math.isclose(earlier.sample_rate, rate, rel_tol=1e-12)
            )
        ):
            log(
                logging.WARNING,
                "FPFL resumes with sigma = %.4g, q = %.4g (%d users now; before: sigma = %.4g, "
                "q = %.4g): the accountant composes both segments",
                sigma,
                rate,
                population_size,
                earlier.noise_multiplier,
                earlier.sample_rate,
            )
    last_round = config.fpfl_rounds
    if config.fpfl_stop_after:
        last_round = min(last_round, first_round - 1 + config.fpfl_stop_after)
    round_seconds: list[float] = []

    def spent_by(current: ReleaseLedger) -> PrivacySpent | None:
        """Privacy spent by the rounds ``current`` records (None without noise)."""
        segments = current.accountant_history()
        if not sigma:
            return None
        if not segments:
            segments = [(sigma, rate, 0)]
        return privacy_spent_history(
            segments,
            delta=delta,
            accountant=config.fpfl_accountant,  # type: ignore[arg-type]
        )

    stop_reason = ""
    lost_in_a_row = 0
    trained_to = first_round - 1
    progress = Progress(
        "fpfl",
        last_round,
        units="rounds",
        initial=min(first_round - 1, last_round),
        log=lambda line: log(logging.INFO, "%s", line),
    ).start()
    for round_number in range(first_round, last_round + 1):
        stop_reason = _cannot_reach_n_min(grid, protocol) if sigma else ""
        if stop_reason:
            break
        tick = time.perf_counter()
        # Durable *before* the round is sent: a crash from here on cannot un-count it.
        ledger = ledger.after_release(sigma, rate)
        write_release_ledger(output_dir, config, ledger)
        record.update(fpfl_rounds_released=ledger.rounds_released)
        outcome = protocol.run_round(round_number, training.weights)
        entry: dict[str, Any] = {
            "round": round_number,
            "members": len(protocol.members),
            "replied": len(outcome.replied),
            "missing": outcome.missing,
            "rejected": [{"node_id": n, "reason": r} for n, r in outcome.rejected],
        }
        if outcome.total is None:
            entry["lost"] = outcome.reason
            lost_in_a_row += 1
        else:
            entry.update(training.update(round_number, outcome.total))
            lost_in_a_row = 0
        entry["multipliers"] = [float(m) for m in training.multipliers]
        entry["rounds_released_total"] = ledger.rounds_released
        spent_so_far = spent_by(ledger)
        entry["epsilon_spent"] = None if spent_so_far is None else spent_so_far.epsilon
        entry["seconds"] = time.perf_counter() - tick
        round_seconds.append(entry["seconds"])
        history.append(entry)
        trained_to = round_number
        log(logging.INFO, "%s", progress_line(entry))
        progress.advance()
        if lost_in_a_row >= config.fpfl_max_consecutive_lost and round_number < last_round:
            stop_reason = (
                f"{lost_in_a_row} round(s) in a row were lost (last: {outcome.reason}); every "
                "further round would likely be lost too while still spending privacy"
            )
        if (
            round_number % config.fpfl_checkpoint_every == 0
            or round_number == last_round
            or stop_reason
        ):
            _checkpoint(
                output_dir,
                config,
                round_number,
                training.weights,
                training.multipliers,
                training.selector,
                history,
                training.smoothed_total,
            )
        if stop_reason:
            break
    progress.close()
    thaw_heap()  # the process may go on (the Python API, the pipeline's next training)
    if stop_reason:
        log(
            logging.ERROR,
            "FPFL stopped early after round %d: %s. Resume with fpfl-resume = true (same "
            "output-dir) once the nodes are back; a node lost for good is left out and the "
            "accountant composes the rounds before and after",
            trained_to,
            stop_reason,
        )
    if last_round < first_round:
        log(logging.INFO, "nothing to do: the checkpoint is already at round %d", first_round - 1)
        trained_to = first_round - 1
    last_round = trained_to
    rounds_done = max(first_round - 1, last_round)
    spent = spent_by(ledger)
    rounds_lost = sum(1 for entry in history if entry.get("lost"))
    if stop_reason:
        status = "stopped-early"
    elif rounds_done < config.fpfl_rounds:
        status = "paused"
    elif rounds_lost:
        status = "completed-with-lost-rounds"
    else:
        status = "completed"
    weights = training.weights
    best = training.selector.best
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
            # The nodes' per-user ledgers (every release they recorded, this training and
            # earlier audits and trainings included; PLD under replace-one-user, at the users'
            # delta): None if no node reported them (min-users-for-counts).
            "ledger_totals_reported_by_nodes": None
            if protocol.ledger_totals is None
            else protocol.ledger_totals.to_dict(),
            "segments": [
                {
                    "noise_multiplier": seg.noise_multiplier,
                    "sample_rate": seg.sample_rate,
                    "rounds": seg.rounds,
                }
                for seg in ledger.segments
            ],
            "caveats": privacy_caveats(config, sigma, ledger.rounds_released - rounds_done)
            + training_caveats(
                rounds_lost=rounds_lost,
                stop_reason=stop_reason,
                fragile=fragile,
                segments=len([seg for seg in ledger.segments if seg.rounds]),
                rounds_planned=config.fpfl_rounds,
                rounds_trained=rounds_done,
            ),
        },
        "status": status,
        "stop_reason": stop_reason or None,
        "rounds_lost": rounds_lost,
        "selected_round": selected_round,
        "model_selection": config.fpfl_model_selection,
        "selected_fair_on_cohort": None if best is None else best.metrics.fair,
        "evaluation": {
            "source": f"held-out test set ({HARNESS_LABEL})",
            **{name: asdict(gaps) for name, gaps in evaluation.items()},
        },
        "paper": paper_row(config),
        "fairness_constraint": fairness_constraint(config, headline),
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
    results = write_json(output_dir / "results.json", payload)
    note = (
        plot_training(output_dir / "training.png", history, config.fpfl_alpha) if history else None
    )
    report_path = write_report(output_dir, fpfl_report(results, output_dir, note))
    for line in ("", *summary_text(payload).splitlines(), ""):
        log(logging.INFO, "%s", line)
    if note:
        log(logging.WARNING, "%s", note)
    log(logging.INFO, "results written to %s (report: %s)", output_dir, report_path)
    record.finish(
        status,
        reason=stop_reason or None,
        rounds_lost=rounds_lost,
        fpfl_rounds_released=ledger.rounds_released,
    )
    return FPFLRun(output_dir, results, np.asarray(selected_weights, dtype=np.float64))


def _fragile(config: RunConfig, protocol: FPFLProtocol, sigma: float) -> str:
    """Why one lost node would lose every round ("" if it would not): with distributed noise
    a round needs ``n_min`` of the ``n`` nodes' noise shares, and ``n_min = n`` when
    ``ceil((1 - rho) n) = n`` (e.g. 3 nodes at rho = 0.2)."""
    if not sigma or not protocol.distributed_noise:
        return ""
    members, needed = len(protocol.members), protocol.min_survivors()
    if needed < members:
        return ""
    return (
        f"a single lost node would lose every round: n_min = {needed} of {members} node(s) "
        f"must reply at fpfl-dropout-tolerance = {config.fpfl_dropout_tolerance:g} (raise it, "
        "or add nodes, to tolerate dropouts)"
    )


def _cannot_reach_n_min(grid: Grid, protocol: FPFLProtocol) -> str:
    """Why a round cannot succeed before it is sent ("" if it may): fewer member nodes are
    connected than the ``n_min`` whose noise shares the round needs."""
    if not protocol.distributed_noise or protocol.noise_share_std() == 0:
        return ""
    connected = set(grid.get_node_ids()) & set(protocol.members)
    needed = protocol.min_survivors()
    if len(connected) >= needed:
        return ""
    return (
        f"only {len(connected)} of the {len(protocol.members)} member node(s) are connected, "
        f"fewer than n_min = {needed} whose noise shares a round needs"
    )


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
        state["best_metrics"] = metrics_to_json(selector.best.metrics)
    state["arrays"] = arrays
    save_checkpoint(folder, config, state)
