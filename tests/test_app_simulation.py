"""The default job through ``flwr run`` on the local simulation engine (real Flower, real Ray).

A simulation SuperLink is started on a free port with runtime dependency installation
disabled (``tests/support/flower_processes.py``), the project folder is submitted with ``flwr run``,
and the results the ServerApp wrote are checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.flower_processes import local_simulation
from tests.test_html_report import assert_report_matches_results

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_default_job_ten_thousand_users(tmp_path: Path) -> None:
    """`flwr run .` with the embedded default: 2 nodes x 5,000 users, 3 rounds, 4 audits."""
    output = tmp_path / "run"
    with local_simulation(REPO, 2, tmp_path / "flwr-home") as simulation:
        run = simulation.run({"output-dir": str(output)}, timeout=900)
    assert run.status == "finished:completed", run.output[-3000:]

    results = json.loads((output / "results.json").read_text())
    assert results["num_users"] >= 10_000
    assert results["num_nodes"] == 2
    assert results["training"]["rounds"] == 3
    assert len(results["training"]["train_loss"]) == 3
    truth = results["ground_truth"]
    assert "not private" in truth["label"]
    assert truth["max_gap"] > 0.05  # the synthetic task is harder for group 1 by design

    budgets = [0.5, 1.0, 2.0, 4.0]
    assert [audit["budget"] for audit in results["audits"]] == budgets
    for audit in results["audits"]:
        estimate = audit["estimate"]
        assert estimate is not None, audit["error"]
        assert audit["rejected_replies"] == [] and audit["missing_nodes"] == []
        assert audit["num_reports"] == results["num_users"]
        assert estimate["epsilon"] <= audit["budget"] + 1e-9
        # The estimate is consistent with the truth: |est - truth| <= 5 standard errors
        # (two-sided normal tail 6e-7 per audit).
        stderr = estimate["difference_stderrs"][0]
        assert abs(abs(estimate["differences"][0]) - truth["max_gap"]) <= 5 * stderr
        low, high = estimate["gap_intervals"][0]
        assert low <= estimate["gaps"][0] <= high
        assert estimate["chebyshev_halfwidths"][0] > estimate["normal_halfwidths"][0]
    spent = results["privacy"]["epsilon_spent_per_user"]
    assert spent == pytest.approx(sum(budgets)) and spent <= results["privacy"]["user_budget"]

    plot = output / "gap_vs_epsilon.png"
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    assert "true gap: simulation harness only" in run.output
    assert f"results written to {output}" in run.output
    # report.html: the gap and interval of every audit first, equal to results.json's, and
    # the same lines open the log's final block.
    assert_report_matches_results(output, run.output)


@pytest.mark.slow
def test_invalid_run_config_fails_before_any_work(tmp_path: Path) -> None:
    """A bad value stops the run at once, with a message naming the key; ``fedparity run``
    exits 1 for it (``flwr run`` exits 0 for a failed run)."""
    output = tmp_path / "run"
    with local_simulation(REPO, 2, tmp_path / "flwr-home") as simulation:
        wrapped = simulation.run_fedparity({"output-dir": str(output), "confidence": 1.5})
        # A dataset that needs a folder nobody gave: refused by name before any work (the
        # nodes would otherwise each fail to find the files).
        adult = simulation.run(
            {"output-dir": str(output), "dataset": "adult"}, timeout=300, check=False
        )
    assert wrapped.returncode == 1, wrapped.stdout[-3000:] + wrapped.stderr
    assert re.search(r"fedparity run: run \d+ finished:failed", wrapped.stderr), wrapped.stderr
    assert "confidence must be in (0, 1)" in wrapped.stdout
    assert adult.status == "finished:failed"
    assert "refused the run config before any work: data-dir must be" in adult.output
    for failed in (wrapped.stdout, adult.output):
        # one line naming the key, never a stack trace for a user's mistake
        assert "Traceback" not in failed, failed[-3000:]
    assert not output.exists()
