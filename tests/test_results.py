"""The jobs' results as dataclasses (server.results): ``to_dict()`` is exactly the results.json
the jobs wrote before (keys, order, values), ``from_dict()`` reads one back, and a report
rendered from the dataclass is the one rendered from its ``to_dict()`` (and from the file).

Before, every job built results.json as nested dicts and the report modules read them back
through about 210 string lookups; a misspelt key failed only when that report line ran.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from fedparity.mechanisms import RandomizedResponseMechanism, ReportSummary, estimate_gap
from fedparity.mechanisms.crypto.secure_random import secure_generator
from fedparity.server import fpfl_report, pipeline_report, report
from fedparity.server.html_report import render_report
from fedparity.server.results import (
    AuditRecord,
    FedEvalFairResults,
    FPFLPrivacy,
    FPFLResults,
    LdpAuditResults,
    LdpPrivacy,
    PipelineAudit,
    PipelineModel,
    PipelinePrivacy,
    PipelineResults,
    Results,
    results_for_task,
)
from fedparity.strategies.fedevalfair import FedEvalFairOutcome
from fedparity.strategies.ldp_audit import AuditOutcome
from fedparity.strategies.replies import RejectedReply

RUN_CONFIG = {
    "metric": "accuracy",
    "confidence": 0.95,
    "epsilons": [1.0, 2.0],
    "fef_variant": "trained",
    "fef_alpha": 0.05,
    "fef_mu0": 0.0,
    "dataset": "synthetic",
    "fpfl_rounds": 3,
    "fpfl_cohort_size": 10,
    "fpfl_clipping_bound": 1.0,
}


def outcome(epsilon: float, *, estimated: bool = True) -> AuditOutcome:
    """An audit's outcome over perturbed reports of 4,000 users (a real estimate)."""
    mechanism = RandomizedResponseMechanism(epsilon, epsilon)
    rng = np.random.default_rng(3)
    groups = rng.integers(0, 2, 4000)
    values = np.where(rng.random(4000) < 0.7 + 0.1 * groups, 1.0, -1.0)
    reports = mechanism.perturb(groups, values, secure_generator())
    summary = ReportSummary.from_reports(reports.groups, reports.values, 2)
    estimate = estimate_gap(summary, mechanism) if estimated else None
    return AuditOutcome(
        estimate=estimate,
        reports=summary,
        nodes_sent=3,
        nodes_replied=3,
        accepted_nodes=2,
        rejected=(RejectedReply(9, "values outside M_R's output domain"),),
        missing_nodes=(4,),
        refused_users=5,
        error=None if estimated else "too few reports",
    )


def ldp_results() -> LdpAuditResults:
    outcomes = [outcome(1.0), outcome(2.0, estimated=False)]
    return LdpAuditResults(
        task="ldp-audit",
        run_config=dict(RUN_CONFIG),
        num_nodes=3,
        num_users=4000,
        failed_describe=[],
        training={"rounds": 2},
        ground_truth={"label": "harness", "group_means": [0.7, 0.8], "group_counts": [1, 2]},
        audits=[AuditRecord.of(b, o) for b, o in zip((1.0, 2.0), outcomes, strict=True)],
        privacy=LdpPrivacy(
            user_budget=10.0,
            epsilon_spent_per_user=3.0,
            composition="basic",
            epsilon_spent_total_max_reported_by_nodes=None,
            ledger_totals_reported_by_nodes=None,
        ),
        elapsed_seconds=1.5,
    )


def fedevalfair_results() -> FedEvalFairResults:
    tested = FedEvalFairOutcome(
        blocks=(),
        round_participants=((1, 2, 3), (1, 2)),
        dropped=((), (3,)),
        rejected=((2, RejectedReply(3, "late")),),
        unable=(RejectedReply(3, "cannot take part"),),
        key_holders=(1,),
        uploaded_bytes=({1: 10, 2: 12},),
        ciphertexts_per_node=(1,),
        error="result withheld",
    )
    return FedEvalFairResults(
        task="fedevalfair",
        run_config=dict(RUN_CONFIG),
        num_nodes=3,
        model_variant="trained",
        primary_mode="calibrated",
        training={"rounds": 1},
        fedevalfair=tested.to_dict(),
        harness_plaintext=None,
        max_abs_pvalue_difference_vs_plaintext=None,
        server_context_has_secret_key=False,
        privacy={"differentially_private": False},
        elapsed_seconds=2.0,
    )


def fpfl_results() -> FPFLResults:
    return FPFLResults(
        task="fpfl",
        algorithm="fpfl",
        accuracy=0.81,
        fnr_gap=0.02,
        private=True,
        epsilon=2.0,
        delta=1e-5,
        noise_multiplier=1.1,
        privacy=FPFLPrivacy(
            accountant="rdp",
            rounds_released_total=3,
            rounds_trained=3,
            rounds_planned=3,
            sample_rate=0.1,
            noise="distributed",
            secure_sum="masking",
            target_epsilon=2.0,
            caveats=["a caveat"],
        ),
        status="completed",
        rounds_lost=0,
        selected_round=3,
        model_selection="best",
        evaluation={"source": "held-out test set (harness)"},
        paper=None,
        fairness_constraint={
            "metric": "fnr",
            "alpha": 0.05,
            "trained_with_constraint": True,
            "test_gap": 0.02,
            "holds_on_test_set": True,
            "unconstrained_baseline": None,
        },
        population={"users": 100, "nodes": 3, "setup_failed": []},
        timing={"seconds_total": 1.0},
        history=[],
        run_config=dict(RUN_CONFIG),
    )


def pipeline_results() -> PipelineResults:
    def model(name: str) -> PipelineModel:
        return PipelineModel(
            name=name,
            training={"epsilon": 2.0, "delta": 1e-5},
            harness=None,
            audits=[PipelineAudit.of(b, outcome(b), detectable={"gap": 0.1}) for b in (1.0, 2.0)],
            fedevalfair={"error": None, "holders": 3, "tests": []},
        )

    return PipelineResults(
        task="pipeline",
        run_config=dict(RUN_CONFIG),
        num_nodes=3,
        num_users=4000,
        metric="accuracy",
        constraint="eo",
        alpha=0.05,
        primary_mode="calibrated",
        models={"fpfl": model("FPFL"), "pfl": model("PFL")},
        comparison=[{"budget": 1.0, "comparison": None, "error": "no estimate"}],
        privacy=PipelinePrivacy(per_user_steps=[], ledger_totals_reported_by_nodes=None),
        timing={"seconds_total": 2.0, "seconds_by_step": {"a": 2.0}, "share_by_step": {"a": 1.0}},
    )


PAGES = {
    "ldp": (ldp_results, lambda r, folder: report.ldp_report(r, folder, None)),
    "fedevalfair": (
        fedevalfair_results,
        lambda r, folder: report.fedevalfair_report(r, folder, None),
    ),
    "fpfl": (fpfl_results, lambda r, folder: fpfl_report.fpfl_report(r, folder, None)),
    "pipeline": (pipeline_results, lambda r, folder: pipeline_report.pipeline_report(r)),
}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_a_report_from_the_dataclass_equals_the_one_from_its_dict_and_its_file(
    name: str, tmp_path: Path
) -> None:
    build, render = PAGES[name]
    results: Results = build()
    written = report.write_json(tmp_path / "results.json", results.to_dict())
    from_file = json.loads((tmp_path / "results.json").read_text())
    assert from_file == written
    page = render_report(render(results, tmp_path))
    assert page == render_report(render(results.to_dict(), tmp_path))
    assert page == render_report(render(written, tmp_path))
    assert page == render_report(render(type(results).from_dict(from_file), tmp_path))
    assert results_for_task(from_file) == type(results).from_dict(from_file)


@pytest.mark.parametrize("name", sorted(PAGES))
def test_from_dict_reads_back_what_to_dict_wrote(name: str) -> None:
    results = PAGES[name][0]()
    data = results.to_dict()
    assert type(results).from_dict(data) == results
    assert list(data) == [item.name for item in fields(results)]  # the file's key order


def test_an_audit_record_is_the_outcome_s_dict_with_its_budget_first() -> None:
    """The record reuses AuditOutcome.to_dict: the same keys, in its order, after the
    budget; a key the outcome adds later fails here instead of vanishing from results.json."""
    audited = outcome(1.0)
    assert AuditRecord.of(0.5, audited).to_dict() == {"budget": 0.5, **audited.to_dict()}
    assert list(AuditRecord.of(0.5, audited).to_dict()) == ["budget", *audited.to_dict()]
    planned = PipelineAudit.of(0.5, audited, detectable=None).to_dict()
    assert list(planned) == ["budget", *audited.to_dict(), "detectable"]


def test_the_job_findings_read_attributes_and_dicts_alike() -> None:
    results = ldp_results()
    plain = [f.plain() for f in report.ldp_findings(results)]
    assert plain == [f.plain() for f in report.ldp_findings(results.to_dict())]
    assert "no estimate (too few reports)" in plain[1]
    text = fpfl_report.summary_text(fpfl_results())
    assert text == fpfl_report.summary_text(fpfl_results().to_dict())
    assert "epsilon = 2.0000 spent after 3 released round(s)" in text


def test_an_unknown_task_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        results_for_task({"task": "other"})


def test_the_pages_name_the_nodes_left_out_and_flagged(tmp_path: Path) -> None:
    """An audit and a rate report with a node over the per-node cap and a node the influence
    check flagged: each is a headline line (warn, on the console too) and the section has the
    influence table; the same from the dataclass and from its dict (review M3, 2026-11-28)."""
    from fedparity.mechanisms.ldp.node_influence import node_influence
    from fedparity.server.rates_job import rate_findings, rate_report_page
    from fedparity.server.results import RateReportRecord, RateReportResults
    from fedparity.strategies.replies import ExcludedNode

    excluded = ExcludedNode(7, 3000, 400, "it describes 3000 users, more than the per-node cap")
    check = node_influence(
        "difference of the accuracy means of groups 0 and 1",
        0.3,
        0.05,
        {1: 0.2, 2: 0.21, 3: 0.05},
        {1: (0.0, 0.1), 2: (0.02, 0.1), 3: (0.9, 0.1)},
    )
    assert check.flagged == (3,)
    audited = AuditOutcome(**{**vars(outcome(1.0)), "excluded": (excluded,), "influence": check})
    results = ldp_results()
    results.audits = [AuditRecord.of(1.0, audited)]
    rates = RateReportResults(
        task="rate-report",
        run_config=dict(RUN_CONFIG),
        reports=[
            RateReportRecord(
                budget=1.0,
                rates=None,
                error="no report was accepted",
                excluded_nodes=[excluded.to_dict()],
                influence=[check.to_dict()],
            )
        ],
        privacy=LdpPrivacy(),
    )
    for findings, page in (
        (report.ldp_findings(results), report.ldp_report(results.to_dict(), tmp_path, None)),
        (rate_findings(rates), rate_report_page(rates.to_dict())),
    ):
        warned = [finding.plain() for finding in findings if finding.tone == "warn"]
        assert warned == [
            "At epsilon = 1: node 7 left out: it describes 3000 users, more than the per-node cap",
            f"At epsilon = 1: node(s) 3 flagged: {check.summary()}",
        ]
        shown = render_report(page)
        assert "Influence of each node on the estimate" in shown and "Cochran&#x27;s Q" in shown
    assert render_report(report.ldp_report(results, tmp_path, None)) == render_report(
        report.ldp_report(results.to_dict(), tmp_path, None)
    )
