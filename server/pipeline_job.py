"""The pipeline job: train fair under DP, measure the gap privately, test across holders.

One ``flwr run`` with ``task = "pipeline"`` does, over the same users and nodes:

1. **Train** two models with user-level DP: a fairness-aware one, by ``fpfl-algorithm``: FPFL
   (MMDM under the ``fpfl-constraint``, with clipping and noise; Rodriguez-Galvez et al. 2021,
   Algorithm 1; the default), FedFB (Zeng, Chen and Lee 2021) or FairFed (Ezzeldin et al.
   2023), and its PFL twin (the same clipping, noise, cohort and rounds, without the fairness
   update). Each training is a session of the masked secure sum
   (:class:`~fedparity.strategies.fpfl.FPFLProtocol`); the fair one keeps the session label
   ``"fpfl"`` whatever its algorithm.
2. **Audit** both models' ``metric`` gap with the LDP audit over all users (M_R / M_L of Juarez
   and Korolova 2022 at their true epsilon), once per value of ``epsilons`` and model, and
   compare the two gaps from the private estimates alone
   (:func:`~fedparity.mechanisms.ldp.estimators.compare_gaps`); the power planner
   (:mod:`fedparity.mechanisms.ldp.power`) says which gap each audit could detect and which budget
   would resolve the comparison.
3. **Test** both models with FedEvalFair's two-stage test over CKKS-encrypted statistics, the
   nodes being the data holders (FedEvalFair (anonymous, 2024); calibrated mode by default).
4. **Report**: one results.json and one report.html with both models side by side, the true
   values where the simulation harness knows them (labelled as such), and each user's privacy
   spent over the three steps, from the nodes' per-user ledgers.

The users are those of the LDP audit (:func:`~fedparity.clients.project.data.load_partition`: one
group per user, ``train`` and ``test`` rows). The trainings use their ``train`` rows and the audit
and the test their ``test`` rows, so one per-user ledger covers every DP release. FedEvalFair's
releases are aggregates over at least the holders' ``min-holders`` and noise-flooded against key
recovery, but not differentially private unless the run sets ``fef-dp-epsilon`` (the
holder-level DP mode: each of the two tests is then charged to every user of every round-2
holder, in the same ledger, and the holders report their totals after it); the report says
which.

References: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel,
"Enforcing fairness in private federated learning via the modified method of differential
multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021;
Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately
Measuring Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022;
"FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation
Framework", anonymous authors, ACM Multimedia 2024 submission.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common import log
from flwr.serverapp import Grid

from ..clients.project.config import FAIR_ALGORITHM_LABELS, PIPELINE_SESSIONS, RunConfig
from ..mechanisms.ldp.calibration import MechanismChoice
from ..mechanisms.ldp.estimators import compare_gaps
from ..mechanisms.ldp.power import (
    audit_detectable_gap,
    audit_minimum_epsilon,
    audit_minimum_users,
)
from ..strategies.fedevalfair import FedEvalFairOutcome
from ..strategies.ldp_audit import AuditOutcome
from ..strategies.release_series import (
    DurableReleases,
    FedEvalFairSeries,
    FedEvalFairTest,
    LdpAuditSeries,
)
from ..strategies.replies import NodeLedgerReports
from .fedevalfair_job import (
    ExchangeProgress,
    fedevalfair_privacy,
    fedevalfair_protocol,
    server_public_context,
)
from .fpfl_job import FPFLRun, train_fpfl
from .harness import HARNESS_LABEL, GroundTruth, ground_truth
from .html_report import write_report
from .ldp_job import AuditLog, ldp_audit_for
from .orchestration import (
    NodeDescriptions,
    connect_nodes,
    harness_applies,
    require_fedevalfair_holders,
)
from .pipeline_report import pipeline_findings, pipeline_report, pipeline_warnings
from .report import privacy_ledger_text, write_json
from .results import (
    FPFLPrivacy,
    PipelineAudit,
    PipelineModel,
    PipelinePrivacy,
    PipelineResults,
)
from .run_record import RunRecord, open_run_record

#: What each model of the pipeline is (the fair session's by its ``fpfl-algorithm``).
FAIR_MODEL_NAMES = {
    "fpfl": "FPFL (fairness constraint, clipping, noise)",
    "fedfb": "FedFB (group reweighting, clipping, noise)",
    "fairfed": "FairFed (fairness-aware node weights, clipping, noise)",
}
PFL_MODEL_NAME = "PFL (clipping, noise; no fairness constraint)"


def model_names(config: RunConfig) -> dict[str, str]:
    """``{session: name}`` of the pipeline's two models."""
    return {"fpfl": FAIR_MODEL_NAMES[config.fpfl_algorithm], "pfl": PFL_MODEL_NAME}


def model_label(config: RunConfig, session: str) -> str:
    """The short name of session ``session``'s model: FPFL, FedFB, FairFed or PFL."""
    return FAIR_ALGORITHM_LABELS[config.fpfl_algorithm] if session == "fpfl" else "PFL"


#: The power the planner's statements are made at.
PLANNED_POWER = 0.8


def _model_arrays(weights: np.ndarray) -> ArrayRecord:
    """A trained model as the audit and the test send it: its flat parameters."""
    return ArrayRecord({"weights": Array(np.asarray(weights, dtype=np.float64))})


def _audit_plan(
    outcome: AuditOutcome, confidence: float, mechanism: MechanismChoice
) -> dict[str, Any] | None:
    """What this audit could detect (:func:`~fedparity.mechanisms.ldp.power.audit_detectable_gap`
    at its reports, budget and estimated group fractions)."""
    estimate = outcome.estimate
    if estimate is None:
        return None
    sizes = np.asarray(estimate.group_sizes, dtype=float)
    reports = int(estimate.num_reports)
    fractions = sizes / sizes.sum() if sizes.sum() > 0 else None
    undefined = reports - float(sizes.sum())
    if fractions is not None and undefined > 0.5:  # users without the metric (TPR/FNR/FPR)
        fractions = np.append(sizes, undefined) / reports
    plan = audit_detectable_gap(
        PLANNED_POWER,
        reports,
        estimate.epsilon,
        mechanism=mechanism,
        group_fractions=None if fractions is None else [float(f) for f in fractions],
        alpha=1.0 - confidence,
    )
    return plan.to_dict()


def _comparison(
    audits: dict[str, list[AuditOutcome]],
    epsilons: list[float],
    confidence: float,
    planned_for: float,
    mechanism: MechanismChoice,
    labels: Mapping[str, str],
) -> list[dict[str, Any]]:
    """Per budget: the fair model's gap against PFL's, from the two private estimates alone,
    what the two audits could detect, and what they would need to detect a difference of
    ``planned_for`` (``pipeline-plan-difference``): planned on the run's public parameters,
    never on the noisy estimates."""
    rows: list[dict[str, Any]] = []
    for index, budget in enumerate(epsilons):
        reference, other = audits["pfl"][index].estimate, audits["fpfl"][index].estimate
        if reference is None or other is None:
            failed = [
                f"the {labels[session]} audit gave no estimate ({audits[session][index].error})"
                for session in ("fpfl", "pfl")
                if audits[session][index].estimate is None
            ]
            rows.append({"budget": budget, "comparison": None, "error": "; ".join(failed)})
            continue
        pair = 0  # groups (0, 1): the pair the constraint is on for two groups
        compared = compare_gaps(
            float(reference.differences[pair]),
            float(reference.difference_stderrs[pair]),
            float(other.differences[pair]),
            float(other.difference_stderrs[pair]),
            confidence=confidence,
        )
        detectable = None
        plan = _audit_plan(audits["pfl"][index], confidence, mechanism)
        if plan is not None and plan["gap"] is not None:
            # Two independent audits of about equal variance: their difference has twice the
            # variance of one audit's gap, so it is detectable from sqrt(2) times the gap one
            # audit detects.
            detectable = math.sqrt(2.0) * float(plan["gap"])
        # What the audits would need to detect a difference of the size the operator plans
        # for (pipeline-plan-difference), with the same power: the budget per audit with
        # these users, and the users at this budget.
        fractions = None if plan is None else plan["group_fractions"]
        gap = min(1.0, planned_for / math.sqrt(2.0))
        needed = audit_minimum_epsilon(
            PLANNED_POWER,
            int(reference.num_reports),
            gap,
            mechanism=mechanism,
            group_fractions=fractions,
            alpha=1.0 - confidence,
        ).epsilon
        users_needed = audit_minimum_users(
            PLANNED_POWER,
            budget,
            gap,
            mechanism=mechanism,
            group_fractions=fractions,
            alpha=1.0 - confidence,
        ).num_users
        rows.append(
            {
                "budget": budget,
                "pair": [0, 1],
                "comparison": compared.to_dict(),
                "detectable_difference": detectable,
                "difference_planned_for": planned_for,
                "epsilon_needed_per_audit": needed,
                "users_needed_at_budget": users_needed,
                "power": PLANNED_POWER,
            }
        )
    return rows


def _blocks(outcome: Any, mode: str) -> list[dict[str, Any]]:
    """The FedEvalFair tests of ``mode`` as results.json rows."""
    tests = []
    for block in outcome.blocks:
        if block.mode != mode:
            continue
        tests.append(
            {
                "metric": block.metric,
                "mode": block.mode,
                "report": None if block.report is None else block.report.to_dict(),
                "unavailable": block.reason if block.report is None else None,
            }
        )
    return tests


def _train_models(
    grid: Grid, config: RunConfig, record: RunRecord, seconds: dict[str, float]
) -> dict[str, FPFLRun]:
    """Step 1: the FPFL and PFL trainings, each through the FPFL job's path
    (:func:`~fedparity.server.fpfl_job.train_fpfl`: the library's training loop with the
    durable release ledger and checkpoints) in its own folder, as a session of the secure sum;
    each is recorded in the run's status before it starts."""
    trainings: dict[str, FPFLRun] = {}
    for session in PIPELINE_SESSIONS:
        tick = time.perf_counter()
        sub_config = replace(
            config,
            fpfl_algorithm=config.fpfl_algorithm if session == "fpfl" else session,
            output_dir=str(record.folder / f"train-{session}"),
        )
        record.add_release(
            what=f"{model_label(config, session)} training ({config.fpfl_rounds} rounds)",
            kind="fpfl-training",
            session=session,
        )
        log(logging.INFO, "[PIPELINE 1/3] training %s", model_names(config)[session])
        trainings[session] = train_fpfl(
            grid,
            sub_config,
            RunRecord.open(sub_config, Path(sub_config.output_dir)),
            session=session,
        )
        seconds[f"train-{session}"] = time.perf_counter() - tick
    return trainings


def _training_summary(training: FPFLRun) -> dict[str, Any]:
    """One training's line in the pipeline's results.json (its own are in its folder)."""
    trained = training.results
    privacy = trained.privacy or FPFLPrivacy()
    return {
        "folder": str(training.output_dir),
        "report": str(training.output_dir / "report.html"),
        "status": trained.status,
        "rounds_trained": privacy.rounds_trained,
        "epsilon": trained.epsilon,
        "delta": trained.delta,
        "noise_multiplier": trained.noise_multiplier,
        "accountant": privacy.accountant,
    }


def _audit_models(
    grid: Grid,
    config: RunConfig,
    record: RunRecord,
    nodes: NodeDescriptions,
    node_ids: list[int],
    trainings: dict[str, FPFLRun],
) -> tuple[dict[str, list[AuditOutcome]], dict[str, GroundTruth]]:
    """Step 2: every model's LDP audits (one series per model, each audit recorded in the
    run's status before it is sent), and the harness's true gaps."""
    audits: dict[str, list[AuditOutcome]] = {}
    truths: dict[str, GroundTruth] = {}
    for session in PIPELINE_SESSIONS:
        arrays = _model_arrays(trainings[session].weights)
        if harness_applies(config, nodes):
            truths[session] = ground_truth(config, arrays, nodes.partitions)
        series = LdpAuditSeries(
            [
                ldp_audit_for(
                    config,
                    budget,
                    audit_id=f"pipeline-{session}-audit-{index + 1}-eps-{budget:g}",
                    users_by_node=nodes.users_by_node,
                )
                for index, budget in enumerate(config.epsilons)
            ],
            what=f"LDP audit of the {model_label(config, session)} model (epsilon {{epsilon:.4g}})",
        )
        audit_log = AuditLog(
            config, f"[PIPELINE 2/3] LDP audit of {session} at epsilon {{budget:g}}"
        )
        audits[session] = list(
            series.start(
                grid,
                arrays,
                timeout=config.reply_timeout,
                node_ids=node_ids,
                observers=[DurableReleases(record=record), audit_log],
            ).outcomes
        )
    return audits, truths


def _test_models(
    grid: Grid,
    config: RunConfig,
    record: RunRecord,
    public: Any,
    node_ids: list[int],
    trainings: dict[str, FPFLRun],
) -> dict[str, FedEvalFairOutcome]:
    """Step 3: FedEvalFair over the holders, once per model (its own session), each release
    recorded in the run's status before the test starts."""
    sessions = list(PIPELINE_SESSIONS)
    protocols = [fedevalfair_protocol(config, public, session=session) for session in sessions]
    tested = FedEvalFairSeries(
        [
            FedEvalFairTest(
                protocol,
                _model_arrays(trainings[session].weights),
                what=f"FedEvalFair test statistics of the {model_label(config, session)} model "
                "(decrypted "
                "aggregates)",
            )
            for protocol, session in zip(protocols, sessions, strict=True)
        ]
    )
    progress = ExchangeProgress(
        protocols,
        [f"fedevalfair {session}" for session in sessions],
        [f"[PIPELINE 3/3] FedEvalFair test of {session}" for session in sessions],
    )
    try:
        result = tested.start(grid, node_ids, observers=[DurableReleases(record=record), progress])
    finally:
        progress.close()
    return dict(zip(sessions, result.outcomes, strict=True))


def run_pipeline(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train FPFL and PFL, audit and test both, report; returns the output directory."""
    record = record if record is not None else open_run_record(config)
    folder = record.folder
    started = time.perf_counter()
    public = server_public_context(config)
    node_ids, nodes = connect_nodes(grid, config, minimum=2)
    require_fedevalfair_holders(nodes, node_ids)  # before training: the holders have their keys
    log(
        logging.INFO,
        "fedparity pipeline: %d node(s), %d user(s), dataset %s; steps: train %s and PFL, "
        "audit both, test both",
        len(node_ids),
        nodes.num_users,
        config.dataset,
        FAIR_ALGORITHM_LABELS[config.fpfl_algorithm],
    )
    seconds: dict[str, float] = {}
    # (1) The two trainings, each in its own folder with its own results and report.
    trainings = _train_models(grid, config, record, seconds)
    # (2) The LDP audits of both models, and the harness's true gaps.
    tick = time.perf_counter()
    audits, truths = _audit_models(grid, config, record, nodes, node_ids, trainings)
    seconds["audit"] = time.perf_counter() - tick
    # (3) FedEvalFair over the holders, once per model.
    tick = time.perf_counter()
    tests = _test_models(grid, config, record, public, node_ids, trainings)
    seconds["fedevalfair"] = time.perf_counter() - tick
    # (4) One results.json and one report.
    results = _pipeline_results(
        config, nodes.num_users, len(node_ids), trainings, audits, truths, tests
    )
    total = time.perf_counter() - started
    results.timing = {
        "seconds_total": total,
        "seconds_by_step": seconds,
        "share_by_step": {step: value / total for step, value in seconds.items()},
    }
    written = PipelineResults.from_dict(write_json(folder / "results.json", results.to_dict()))
    report_path = write_report(folder, pipeline_report(written))
    log(logging.INFO, "")
    for finding in pipeline_findings(written):
        log(logging.INFO, "%s", finding.plain())
    for warning in pipeline_warnings(written):
        log(logging.WARNING, "%s", warning)
    assert written.privacy is not None
    log(logging.INFO, "%s", privacy_ledger_text(written.privacy))
    log(logging.INFO, "results written to %s (report: %s)", folder, report_path)
    errors = [f"FedEvalFair ({s}): {error}" for s in PIPELINE_SESSIONS if (error := tests[s].error)]
    if errors:
        record.finish("completed-with-errors", error="; ".join(errors))
        log(logging.ERROR, "fedparity: the pipeline ran, but %s", "; ".join(errors))
    else:
        record.finish("completed")
    return folder


def _pipeline_results(
    config: RunConfig,
    num_users: int,
    num_nodes: int,
    trainings: dict[str, FPFLRun],
    audits: dict[str, list[AuditOutcome]],
    truths: dict[str, GroundTruth],
    tests: dict[str, FedEvalFairOutcome],
) -> PipelineResults:
    """The pipeline's results (``timing`` is set by the caller, at the end)."""
    models: dict[str, PipelineModel] = {}
    for session in PIPELINE_SESSIONS:
        trained = trainings[session].results
        models[session] = PipelineModel(
            name=model_names(config)[session],
            training=_training_summary(trainings[session]),
            harness={
                "label": HARNESS_LABEL,
                "accuracy": trained.accuracy,
                "fnr_gap": trained.fnr_gap,
                "accuracy_gap": trained.accuracy_gap,
                "audited_metric_gap": None if session not in truths else truths[session].to_dict(),
            }
            if trained.accuracy is not None
            else None,
            audits=[
                PipelineAudit.of(
                    budget,
                    outcome,
                    detectable=_audit_plan(outcome, config.confidence, config.mechanism),
                )
                for budget, outcome in zip(config.epsilons, audits[session], strict=True)
            ],
            fedevalfair={
                "error": tests[session].error,
                "holders": num_nodes,
                "tests": _blocks(tests[session], config.fef_mode),
                "privacy": fedevalfair_privacy(config, tests[session]),
            },
        )
    return PipelineResults(
        task=config.task,
        run_config=asdict(config),
        num_nodes=num_nodes,
        num_users=num_users,
        metric=config.metric,
        constraint=config.fpfl_constraint,
        alpha=config.fpfl_alpha,
        primary_mode=config.fef_mode,
        models=models,
        comparison=_comparison(
            audits,
            list(config.epsilons),
            config.confidence,
            config.pipeline_plan_difference,
            config.mechanism,
            {session: model_label(config, session) for session in PIPELINE_SESSIONS},
        ),
        privacy=_pipeline_privacy(config, trainings, audits, tests),
    )


def _fedevalfair_step(config: RunConfig, session: str) -> dict[str, Any]:
    """The privacy row of one FedEvalFair test: the charged (epsilon, delta) in the
    holder-level DP mode (``fef-dp-epsilon``), else not differentially private."""
    step = f"FedEvalFair test of {model_label(config, session)}"
    dp = config.fef_holder_dp
    if dp is None:
        return {
            "step": step,
            "epsilon": None,
            "delta": None,
            "how": "not differentially private: aggregates over at least the holders' "
            "min-holders, noise-flooded; not in the ledger",
        }
    return {
        "step": step,
        "epsilon": dp.epsilon,
        "delta": dp.delta,
        "how": "holder-level DP (analytic Gaussian noise of std "
        f"{dp.noise_std:.3g} on each released sum), charged by every round-2 holder to each "
        "of its users before it committed",
    }


def _pipeline_privacy(
    config: RunConfig,
    trainings: dict[str, FPFLRun],
    audits: dict[str, list[AuditOutcome]],
    tests: dict[str, FedEvalFairOutcome],
) -> PipelinePrivacy:
    """Each step's (epsilon, delta) per user, and what the nodes' ledgers reported."""
    ledgers = NodeLedgerReports()
    # the steps in the order they ran (both trainings, both models' audits, both tests): a
    # node's latest totals are kept
    for session in PIPELINE_SESSIONS:
        privacy = trainings[session].results.privacy
        if privacy is not None:
            ledgers.update(
                NodeLedgerReports.from_results(
                    privacy.ledger_totals_by_node, privacy.new_ledger_nodes
                )
            )
    for session in PIPELINE_SESSIONS:
        for outcome in audits.get(session, []):
            ledgers.update(outcome.ledger_reports)
    for session in PIPELINE_SESSIONS:  # the DP mode's commitments report totals
        ledgers.update(tests[session].ledger_reports)
    ledger_totals = ledgers.merged()
    return PipelinePrivacy(
        per_user_steps=[
            {
                "step": f"{model_label(config, session)} training",
                "epsilon": trainings[session].results.epsilon,
                "delta": trainings[session].results.delta,
                "how": "Opacus accountant of the Poisson-subsampled Gaussian rounds",
            }
            for session in PIPELINE_SESSIONS
        ]
        + [
            {
                "step": f"LDP audit of {model_label(config, session)} at budget {budget:g}",
                "epsilon": outcome.estimate.epsilon if outcome.estimate is not None else None,
                "delta": 0.0,
                "how": "the mechanism's true epsilon (pure local DP)",
            }
            for session in PIPELINE_SESSIONS
            for budget, outcome in zip(config.epsilons, audits[session], strict=True)
        ]
        + [_fedevalfair_step(config, session) for session in PIPELINE_SESSIONS],
        # Every release the nodes' per-user ledgers recorded (both trainings and every
        # audit, and earlier runs with a persistent ledger-dir): PLD at the users' delta,
        # basic composition beside it, under replace-one-user.
        ledger_totals_reported_by_nodes=None if ledger_totals is None else ledger_totals.to_dict(),
        ledger_totals_by_node=ledgers.by_node_dict(),
        new_ledger_nodes=sorted(ledgers.new_ledger_nodes),
    )
