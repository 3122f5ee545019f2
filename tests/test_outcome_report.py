"""``write_outcome_report``: an own app's outcomes in the results.json and report.html the
built-in jobs write.

Before, an own app could print its outcomes' summaries but the report page lived in the built-in
jobs only: the example app wrote its own JSON and no page.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pytest

from fedparity.mechanisms.ldp.frequency_oracle import frequency_oracle
from fedparity.mechanisms.ldp.group_rates import encode_cells, group_rates
from fedparity.mechanisms.ldp.nprr import nprr_for_budget
from fedparity.mechanisms.ldp.reports import PerturbedReports
from fedparity.mechanisms.ldp.sequential import sequential_gap_audit
from fedparity.server.outcome_report import write_outcome_report
from fedparity.strategies.rate_report import RateReportOutcome
from fedparity.strategies.sequential_audit import SequentialAuditOutcome
from tests.test_outcome_summaries import audit_outcome, fairness_block, fedevalfair_outcome


def rate_outcome(users: int = 20_000) -> RateReportOutcome:
    """A real rate report: two groups whose selection rates are 0.3 and 0.6, perturbed with
    the frequency oracle at epsilon 2 and estimated."""
    rng = np.random.default_rng(3)
    groups = rng.integers(0, 2, users)
    labels = (rng.random(users) < 0.5).astype(int)
    predictions = (rng.random(users) < np.where(groups == 1, 0.6, 0.3)).astype(int)
    oracle = frequency_oracle("best", 2.0, 8, num_users=users)
    cells = encode_cells(groups, labels, predictions, num_groups=2)
    counts = oracle.estimate(oracle.perturb_and_count(cells, rng), users)
    return RateReportOutcome(
        rates=group_rates(counts, num_groups=2),
        counts=counts,
        num_reports=users,
        nodes_sent=3,
        nodes_replied=3,
        accepted_nodes=3,
        oracle=oracle.name,
        epsilon=oracle.epsilon,
    )


def test_every_outcome_is_in_results_json_and_its_verdict_heads_the_page(tmp_path: Path) -> None:
    audit, rates = audit_outcome(0.25), rate_outcome()
    test = fedevalfair_outcome((fairness_block("calibrated", fair=False, tolerance=0.05),))
    files = write_outcome_report(
        tmp_path / "out",
        [audit, rates, test],
        title="My app",
        run_config={"learning-rate": 0.1},
        extra={"epsilon_spent_per_user": 4.0},
    )
    results = json.loads(files.results_json.read_text(encoding="utf-8"))
    assert [o["type"] for o in results["outcomes"]] == ["ldp-audit", "rate-report", "fedevalfair"]
    assert results["outcomes"][0]["estimate"] == json.loads(json.dumps(audit.to_dict()))["estimate"]
    assert results["outcomes"][1]["rates"]["derived"]["demographic_parity_ratio"]["value"] == (
        pytest.approx(rates.rates.demographic_parity_ratio().value)  # type: ignore[union-attr]
    )
    assert results["epsilon_spent_per_user"] == 4.0
    assert results["run_config"] == {"learning-rate": 0.1}

    page = files.report_html.read_text(encoding="utf-8")
    headline = page.split('<div class="headline">')[1].split("</div>")[0]
    # each outcome's verdict, in its summary's words; a found gap and an unfair model in red
    assert audit.estimate is not None
    assert audit.estimate.verdict("accuracy") in headline
    assert rates.rates is not None and html.escape(rates.rates.four_fifths().sentence) in headline
    assert "UNFAIR" in headline
    assert headline.count('class="bad"') == 3
    # the per-group tables and the run config
    assert "private mean accuracy" in page and "true_positive_rate" in page
    assert "Run config" in page and "learning-rate" in page


def sequential_outcome(gap: float) -> SequentialAuditOutcome:
    """A real sequential audit's statistics (simulated users, M_N at epsilon 2) in the
    outcome the strategy returns."""
    mechanism = nprr_for_budget(2.0, 2)
    rng = np.random.default_rng(9)

    def ask(n: int) -> PerturbedReports:
        groups = rng.integers(0, 2, n)
        metric = (rng.random(n) < np.where(groups == 0, 0.5 + gap, 0.5)).astype(float)
        return mechanism.perturb(groups, 2 * metric - 1, rng)

    result = sequential_gap_audit(
        mechanism, ask, batch_size=2000, max_users=20_000, target_width=0.05
    )
    return SequentialAuditOutcome(
        result,
        {1: 30_000},
        {1: result.users_asked},
        result.stopped_because,
        epsilon=mechanism.epsilon,
        batches_sent=len(result.batches),
    )


def test_a_sequential_audit_is_reported_with_its_verdict(tmp_path: Path) -> None:
    found, none = sequential_outcome(0.3), sequential_outcome(0.0)
    files = write_outcome_report(tmp_path, [found, none])
    results = json.loads(files.results_json.read_text(encoding="utf-8"))
    assert [o["type"] for o in results["outcomes"]] == ["sequential-audit"] * 2
    assert results["outcomes"][0]["users_asked"] == found.users_asked
    page = files.report_html.read_text(encoding="utf-8")
    headline = page.split('<div class="headline">')[1].split("</div>")[0]
    assert "the groups differ" in headline and "no gap shown" in headline
    assert headline.count('class="bad"') == 1  # the gap found, not the other
    assert "each charged epsilon" in page


def test_a_fair_outcome_is_not_shown_in_red(tmp_path: Path) -> None:
    files = write_outcome_report(tmp_path, [audit_outcome(0.0)])
    page = files.report_html.read_text(encoding="utf-8")
    headline = page.split('<div class="headline">')[1].split("</div>")[0]
    assert 'class="bad"' not in headline and 'class="info"' in headline


@pytest.mark.parametrize(
    ("outcomes", "extra", "message"),
    [
        ([], None, "outcomes must hold at least one outcome"),
        (["an audit"], None, "outcomes must be AuditOutcome, SequentialAuditOutcome, Rate"),
        (None, {"outcomes": []}, "extra must not set ['outcomes']"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, outcomes: list | None, extra: dict | None, message: str
) -> None:
    folder = tmp_path / "out"
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[")):
        write_outcome_report(
            folder,
            [audit_outcome(0.0)] if outcomes is None else outcomes,
            extra=extra,
        )
    assert not folder.exists()


def test_text_a_node_sent_is_escaped_in_the_page(tmp_path: Path) -> None:
    """A rejected reply's reason can carry a node's words: the page shows them as text, never
    as markup (a hostile node cannot put a script into the operator's report)."""
    from dataclasses import replace

    from fedparity.strategies.replies import RejectedReply

    hostile = "<script>alert(1)</script>"
    outcome = replace(audit_outcome(0.0), rejected=(RejectedReply(9, hostile),))
    page = write_outcome_report(tmp_path, [outcome]).report_html.read_text(encoding="utf-8")
    assert hostile not in page and html.escape(hostile) in page


def test_an_own_app_page_names_the_nodes_left_out_and_flagged(tmp_path: Path) -> None:
    """The per-node cap's exclusions and the influence check's flags of an own app's outcome:
    in results.json and as headline lines of the page (review M3, 2026-11-28)."""
    from dataclasses import replace

    from fedparity.mechanisms.ldp.node_influence import node_influence
    from fedparity.strategies.replies import ExcludedNode

    check = node_influence(
        "difference",
        0.3,
        0.05,
        {1: 0.2, 2: 0.21, 3: 0.05},
        {1: (0.0, 0.1), 2: (0.02, 0.1), 3: (0.9, 0.1)},
    )
    excluded = ExcludedNode(7, 3000, 400, "it describes 3000 users, more than the per-node cap")
    audit = replace(audit_outcome(0.25), excluded=(excluded,), influence=check)
    rates = replace(rate_outcome(), influence=(check,))
    files = write_outcome_report(tmp_path / "out", [audit, rates])
    results = json.loads(files.results_json.read_text(encoding="utf-8"))
    first, second = results["outcomes"]
    assert first["excluded_nodes"] == [excluded.to_dict()] and first["influence"]["flagged"] == [3]
    assert second["influence"][0]["flagged"] == [3]
    page = html.unescape(files.report_html.read_text(encoding="utf-8"))
    assert "LDP audit of accuracy: node 7 left out: it describes 3000 users" in page
    assert page.count("node(s) 3 flagged: influence on the difference") == 2
