"""The FPFL job: train under a fairness constraint with user-level DP.

FPFL is the algorithm of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021, "the paper" below).

One run trains with one of the six algorithms of the paper's Table 2 (``fpfl-algorithm``):
``fl`` (FederatedSGD), ``fl-clip``, ``pfl`` (clip + Gaussian noise), ``ffl`` (MMDM),
``ffl-clip`` and ``fpfl`` (MMDM + clip + noise), or with ``fedfb`` (clip + noise as ``fpfl``,
FedFB's group reweighting on the same sums: Yuchen Zeng, Hongxu Chen and Kangwook Lee,
"Improving Fairness via Federated Learning", arXiv:2110.15545, 2021). Every round (FedSGD
structure: one update, no local epochs) the nodes return the secure sum of their cohort users'
statistic vectors (:class:`fedparity.strategies.fpfl.FPFLProtocol`); the server splits it
(:class:`fedparity.mechanisms.fpfl.mmdm.StatisticsLayout`), offers the model that produced it to the
model
selector (best cohort accuracy among the models fair on cohort statistics; Section 4.1) and
applies :func:`fedparity.mechanisms.fpfl.mmdm.mmdm_update`,
:func:`fedparity.mechanisms.fpfl.fedfb.fedfb_update` or
:func:`fedparity.mechanisms.fpfl.mmdm.sgd_update`.

Privacy: ``sigma`` is calibrated with Opacus for (``fpfl-epsilon``, ``fpfl-delta``,
``q = m / K``, ``T``) and the epsilon actually spent is recomputed
(:mod:`fedparity.mechanisms.privacy.opacus_accounting`) over **every round ever released** for this
run; every round sent counts, including a lost one.

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

The loop is the library's (:meth:`fedparity.strategies.fpfl.FPFLTraining.start`), and so are
the ledger and the checkpoints (its default observer,
:class:`~fedparity.strategies.fpfl_observers.DurableTraining`, here in ``output-dir`` and
fingerprinted with the run config) and the stops after ``fpfl-max-consecutive-lost`` lost
rounds and before a round too few nodes are connected for; the job adds its progress display
and ``status.json`` as one more observer, and the report.

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

from ..clients.fpfl_data import check_groups_present
from ..clients.fpfl_node import round_rng
from ..clients.fpfl_task import (
    build_model_for,
    constraint_mask,
    get_flat_parameters,
    predict,
    set_flat_parameters,
    statistics_layout,
)
from ..clients.process import freeze_warm_heap, thaw_heap
from ..clients.project.config import ConfigError, RunConfig
from ..clients.project.fpfl_node import population
from ..mechanisms.fpfl.fairfed import FairFedConfig
from ..mechanisms.fpfl.fedfb import FedFBConfig
from ..mechanisms.fpfl.mmdm import FairnessGaps, MMDMConfig, SelectionCandidate, fairness_gaps
from ..mechanisms.privacy.opacus_accounting import NoiseCalibration, calibrate_noise, sample_rate
from ..mechanisms.protocol.fpfl import FPFLRunParameters
from ..strategies.fpfl import FPFLProtocol, FPFLTraining, FPFLTrainingResult, RoundOutcome
from ..strategies.fpfl_observers import (
    DurableTraining,
    FPFLObserver,
    StopAfterLostRounds,
    StopWhenTooFewNodes,
)
from .fpfl_checkpoint import RELEASE_LEDGER, RESUME_ADVICE, RESUME_PREFIX, run_fingerprint
from .fpfl_report import (
    fairness_constraint,
    fpfl_report,
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
from .results import FPFLPrivacy, FPFLResults
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
    """What one FPFL training gave: its folder, its results (as written to results.json) and
    the reported model's flat parameters (``named_parameters`` order)."""

    output_dir: Path
    results: FPFLResults
    weights: NDArray[np.float64]


def run_fpfl(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train with ``fpfl-algorithm``; write results.json, plots and checkpoints."""
    return train_fpfl(grid, config, record).output_dir


def train_fpfl(
    grid: Grid, config: RunConfig, record: RunRecord | None = None, *, session: str = ""
) -> FPFLRun:
    """:func:`run_fpfl`, returning the reported model too; ``session`` labels the training
    when a run trains more than once (the pipeline).

    Config, then objects (:func:`_build`), then the library's training loop
    (:meth:`~fedparity.strategies.fpfl.FPFLTraining.start`) with the job's observers: the
    durable release ledger and checkpoints in ``output-dir``, the stops after lost rounds and
    before rounds that cannot succeed, progress and the status file; then the report."""
    record = record if record is not None else open_run_record(config)
    started = time.perf_counter()
    built = _build(grid, config, session)
    durable = _RunFolder(
        record.folder,
        checkpoint_every=config.fpfl_checkpoint_every,
        resume=config.fpfl_resume,
        fingerprint=run_fingerprint(config),
        delta=built.delta,
    )
    result = built.training.start(
        built.protocol,
        config.fpfl_rounds,
        observers=[
            durable,
            StopAfterLostRounds(config.fpfl_max_consecutive_lost),
            StopWhenTooFewNodes(),
            _JobProgress(record, durable, verbose=config.verbose),
        ],
        stop_after=config.fpfl_stop_after or None,
    )
    thaw_heap()  # the process may go on (the Python API, the pipeline's next training)
    if result.stop_reason:
        log(
            logging.ERROR,
            "FPFL stopped early after round %d: %s. Resume with fpfl-resume = true (same "
            "output-dir) once the nodes are back; a node lost for good is left out and the "
            "accountant composes the rounds before and after",
            result.rounds_trained,
            result.stop_reason,
        )
    return _report(config, record, built, durable, result, started)


@dataclass(frozen=True)
class _Built:
    """What the run config became: the protocol (set up), the training, the model and the
    harness's test set (None outside the harness), and the privacy parameters."""

    protocol: FPFLProtocol
    training: FPFLTraining
    model: Any
    test: Any
    calibration: NoiseCalibration | None
    sigma: float
    rate: float
    delta: float
    population_size: int
    fragile: str


class _RunFolder(DurableTraining):
    """The library's durable ledger and checkpoint in ``output-dir``; refusals name
    ``fpfl-resume`` and ``output-dir``."""

    refusal_prefix = RESUME_PREFIX
    refusal_advice = RESUME_ADVICE


#: Trainings of at most this many rounds print every round's line (and so do all with verbose).
ALL_ROUND_LINES_UP_TO = 20


def shows_round_line(round_number: int, last: int, entry: dict[str, Any], verbose: bool) -> bool:
    """Whether the console gets round ``round_number``'s line: every round with ``verbose`` or
    up to :data:`ALL_ROUND_LINES_UP_TO` rounds; else the first, the last, about ten between,
    and every lost round (results.json and the report keep every round either way)."""
    if verbose or last <= ALL_ROUND_LINES_UP_TO or entry.get("lost"):
        return True
    return round_number in (1, last) or round_number % max(1, last // 10) == 0


class _JobProgress(FPFLObserver):
    """The job's progress display, the per-round line (condensed: :func:`shows_round_line`)
    and the status file's count of rounds released (after the ledger, before the round is
    sent)."""

    def __init__(self, record: RunRecord, durable: DurableTraining, verbose: bool = False) -> None:
        self.record = record
        self.durable = durable
        self.verbose = verbose
        self.last = 0
        self.progress: Progress | None = None

    def begin(self, training: FPFLTraining, protocol: FPFLProtocol, rounds: range) -> None:
        last = self.last = rounds.stop - 1
        if not rounds:
            log(logging.INFO, "nothing to do: the checkpoint is already at round %d", last)
        self.progress = Progress(
            "fpfl",
            last,
            units="rounds",
            initial=min(rounds.start - 1, last),
            log=lambda line: log(logging.INFO, "%s", line),
        ).start()

    def before_release(self, round_number: int) -> None:
        ledger = self.durable.ledger
        assert ledger is not None  # the durable observer counted the round first
        self.record.update(fpfl_rounds_released=ledger.rounds_released)

    def after_round(self, round_number: int, outcome: RoundOutcome, entry: dict[str, Any]) -> None:
        if shows_round_line(round_number, self.last, entry, self.verbose):
            log(logging.INFO, "%s", progress_line(entry))
        if self.progress is not None:
            self.progress.advance()

    def end(self, result: FPFLTrainingResult) -> None:
        if self.progress is not None:
            self.progress.close()


def _build(grid: Grid, config: RunConfig, session: str) -> _Built:
    """The nodes, the population, sigma, the model, the protocol (set up with the nodes) and
    the training, from the run config; refuses a fragile run when asked to."""
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
            accountant=config.fpfl_accountant,
        )
        sigma = calibration.noise_multiplier
    model = build_model_for(
        config.fpfl_architecture,
        nodes.sample_shape,
        num_classes=nodes.num_classes,
        seed=config.seed,
    )
    layout = statistics_layout(model, nodes.num_groups)
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
        fairfed_release_share=config.fpfl_release_share,
    )
    active = [node for node in node_ids if node in nodes.users_by_node]
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
    _log_start(config, protocol, population_size, rate, sigma)
    central = bool(sigma) and config.fpfl_noise == "central"
    training = FPFLTraining(
        layout,
        get_flat_parameters(model),
        mmdm=MMDMConfig(
            alpha=config.fpfl_alpha,
            learning_rate=config.fpfl_learning_rate,
            multiplier_learning_rate=config.fpfl_multiplier_learning_rate,
            damping=config.fpfl_damping,
            activation=config.fpfl_constraint_activation,
            error_surrogate=config.fpfl_constraint == "fnr",
        ),
        use_mmdm=config.fpfl_uses_mmdm,
        fedfb=(
            FedFBConfig(step=config.fpfl_fedfb_step, learning_rate=config.fpfl_learning_rate)
            if config.fpfl_update_rule == "fedfb"
            or (config.fpfl_update_rule == "fairfed" and config.fpfl_fairfed_debiasing == "fedfb")
            else None
        ),
        fairfed=(
            FairFedConfig(beta=config.fpfl_fairfed_beta)
            if config.fpfl_update_rule == "fairfed"
            else None
        ),
        smoothing=config.fpfl_statistics_smoothing,
        central_noise_multiplier=parameters.sum_noise_multiplier if central else 0.0,
        clipping_bound=config.fpfl_clipping_bound,
        central_noise_rng=lambda round_number: round_rng(
            config.fpfl_client_seed, 0, round_number, central=True
        ),
    )
    return _Built(
        protocol, training, model, test, calibration, sigma, rate, delta, population_size, fragile
    )


def _log_start(
    config: RunConfig, protocol: FPFLProtocol, population_size: int, rate: float, sigma: float
) -> None:
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


def _report(
    config: RunConfig,
    record: RunRecord,
    built: _Built,
    durable: DurableTraining,
    result: FPFLTrainingResult,
    started: float,
) -> FPFLRun:
    """Model selection, the harness's test-set evaluation, results.json, the plot, report.html,
    the summary on the console and the end of the status file."""
    output_dir = record.folder
    ledger = durable.ledger
    assert ledger is not None  # the training restored or started it
    rounds_done = result.rounds_trained
    rounds_lost = sum(1 for entry in result.history if entry.get("lost"))
    if result.stop_reason:
        status = "stopped-early"
    elif rounds_done < config.fpfl_rounds:
        status = "paused"
    elif rounds_lost:
        status = "completed-with-lost-rounds"
    else:
        status = "completed"
    best: SelectionCandidate | None = built.training.selector.best
    weights = built.training.weights
    if config.fpfl_model_selection == "last":
        # The weights after the last update (evaluation.final): never sent, so no cohort
        # statistics describe them; selected_round = the last round trained.
        best = None
        selected_weights = weights
        selected_round: int | None = rounds_done
    else:
        selected_weights = best.weights if best is not None else weights
        selected_round = None if best is None else best.round
    evaluation: dict[str, FairnessGaps] = {}
    if built.test is not None:
        test = built.test
        for name, vector in (("selected", selected_weights), ("final", weights)):
            set_flat_parameters(built.model, vector)
            evaluation[name] = fairness_gaps(
                test.labels, predict(built.model, test.features), test.groups, test.num_groups
            )
    headline = evaluation.get("selected")
    seconds = [e["seconds"] for e in result.history if e["round"] >= result.first_round]
    payload = FPFLResults(
        task=config.task,
        algorithm=config.fpfl_algorithm,
        accuracy=None if headline is None else headline.accuracy,
        fnr_gap=None if headline is None else headline.fnr_gap,
        eo_gap=None if headline is None else headline.eo_gap,
        demp_gap=None if headline is None else headline.demp_gap,
        pp_gap=None if headline is None else headline.pp_gap,
        accuracy_gap=None if headline is None else headline.accuracy_gap,
        epsilon=None if (spent := durable.spent()) is None else spent.epsilon,
        delta=ledger.delta if built.sigma else None,
        noise_multiplier=built.sigma if built.sigma else None,
        private=bool(built.sigma),
        privacy=FPFLPrivacy(**_privacy(config, built, durable, result, rounds_lost)),
        status=status,
        stop_reason=result.stop_reason or None,
        rounds_lost=rounds_lost,
        selected_round=selected_round,
        model_selection=config.fpfl_model_selection,
        selected_fair_on_cohort=None if best is None else best.metrics.fair,
        evaluation={
            "source": f"held-out test set ({HARNESS_LABEL})",
            **{name: asdict(gaps) for name, gaps in evaluation.items()},
        },
        paper=paper_row(config),
        fairness_constraint=fairness_constraint(config, headline),
        population={
            "users": built.population_size,
            "nodes": len(built.protocol.members),
            "setup_failed": [{"node_id": n, "reason": r} for n, r in built.protocol.setup_failed],
        },
        timing={
            "seconds_total": time.perf_counter() - started,
            "seconds_per_round_mean": float(np.mean(seconds)) if seconds else None,
        },
        history=result.history,
        run_config=asdict(config),
    )
    results = FPFLResults.from_dict(write_json(output_dir / "results.json", payload.to_dict()))
    history = result.history
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
        reason=result.stop_reason or None,
        rounds_lost=rounds_lost,
        fpfl_rounds_released=ledger.rounds_released,
    )
    return FPFLRun(output_dir, results, np.asarray(selected_weights, dtype=np.float64))


def _privacy(
    config: RunConfig,
    built: _Built,
    durable: DurableTraining,
    result: FPFLTrainingResult,
    rounds_lost: int,
) -> dict[str, Any]:
    """results.json's ``privacy``: the accounting over every round ever released."""
    ledger = durable.ledger
    assert ledger is not None
    sigma, calibration, protocol = built.sigma, built.calibration, built.protocol
    rounds_done = result.rounds_trained
    return {
        "accountant": config.fpfl_accountant if sigma else None,
        "sampling": "Poisson, q = m / K, drawn on the nodes",
        "sample_rate": built.rate,
        # epsilon is the accountant's for rounds_released_total (the ledger): every round
        # ever sent, including the rounds an interrupted run released after its last
        # checkpoint (rounds_discarded_by_crashes: not in the model, still spent).
        "rounds_released_total": ledger.rounds_released,
        "rounds_released": ledger.rounds_released,  # same; kept for existing readers
        "rounds_trained": rounds_done,
        "rounds_discarded_by_crashes": ledger.rounds_released - rounds_done,
        "release_ledger": str(durable.folder / RELEASE_LEDGER),
        "rounds_planned": config.fpfl_rounds,
        "target_epsilon": config.fpfl_epsilon if sigma else None,
        "calibrated_epsilon_at_T": None if calibration is None else calibration.achieved.epsilon,
        "noise": config.fpfl_noise if sigma else None,
        "noise_share_std": protocol.noise_share_std(),
        # FairFed: the run's sigma split between the sum and each node's own release (their
        # joint noise multiplier is sigma, so epsilon is the accountant's above)
        "fairfed_noise": None
        if not protocol.parameters.fairfed
        else {
            "release_share": protocol.parameters.fairfed_release_share,
            "sum_noise_multiplier": protocol.parameters.sum_noise_multiplier,
            "release_noise_multiplier": protocol.parameters.release_noise_multiplier,
            "release_noise_std": (protocol.clipping_bound or 0.0)
            * protocol.parameters.release_noise_multiplier,
        },
        "secure_sum": config.fpfl_secure_sum,
        "client_seed": config.fpfl_client_seed,
        # The nodes' per-user ledgers (every release they recorded, this training and
        # earlier audits and trainings included; PLD under replace-one-user, at the users'
        # delta): None if no node reported them (min-users-for-counts).
        "ledger_totals_reported_by_nodes": None
        if protocol.ledger_totals is None
        else protocol.ledger_totals.to_dict(),
        "ledger_totals_by_node": protocol.ledgers.by_node_dict(),
        "new_ledger_nodes": sorted(protocol.ledgers.new_ledger_nodes),
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
            stop_reason=result.stop_reason,
            fragile=built.fragile,
            segments=len([seg for seg in ledger.segments if seg.rounds]),
            rounds_planned=config.fpfl_rounds,
            rounds_trained=rounds_done,
        ),
    }


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
