"""The ServerApp: FedAvg, then private LDP audits of the model's gap between groups, every rate
metric from one private report per user, and the encrypted FedEvalFair test, each outcome
printed with its verdict and saved (results.json and report.html)."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedparity.mechanisms.crypto.ckks import DEFAULT_KEY_DIR, load_public_context
from fedparity.server.outcome_report import write_outcome_report
from fedparity.strategies import (
    DurableReleases,
    FedEvalFairProtocol,
    FedEvalFairSeries,
    FedEvalFairTest,
    LdpAuditSeries,
    LdpGapAudit,
    RateReportAudit,
)
from ownapp.task import build_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    output = Path(
        str(config["output-dir"]) or Path.home() / ".fedparity" / "examples" / "own-app" / "results"
    ).expanduser()

    # 1. Your training, as in Flower's quickstart.
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(build_model().state_dict()),
        train_config=ConfigRecord({"lr": float(config["learning-rate"])}),
        num_rounds=int(config["num-server-rounds"]),
    )
    arrays = result.arrays
    node_ids = sorted(grid.get_node_ids())

    # 2. The LDP audits: one per metric and budget; every release is recorded in
    # output/releases.json before it is sent.
    audits = [
        LdpGapAudit.for_budget("best", float(epsilon), num_groups=2, metric=metric)
        for metric in str(config["audit-metrics"]).split(",")
        for epsilon in str(config["audit-epsilons"]).split(",")
    ]
    series = LdpAuditSeries(audits).start(grid, arrays, folder=output)
    for outcome in series.outcomes:
        log(logging.INFO, "%s", outcome.summary())

    # 3. Every rate metric per group (demographic parity, equalized odds, the four-fifths rule)
    # from one private report per user, charged once; recorded in the same releases.json.
    rate_series = LdpAuditSeries(
        [RateReportAudit.for_budget(float(config["rate-epsilon"]), num_groups=2)],
        what="rate report {number} (epsilon {epsilon:.4g})",
        kind="rate-report",
    ).start(grid, arrays, folder=output)
    [rates] = rate_series.outcomes
    log(logging.INFO, "%s", rates.summary())

    # 4. FedEvalFair over CKKS-encrypted statistics (the server holds the public key only).
    public = load_public_context(str(DEFAULT_KEY_DIR / "public_context.tenseal"))
    protocol = FedEvalFairProtocol(public, key_holders=int(config["fef-key-holders"]))
    [test] = (
        FedEvalFairSeries([FedEvalFairTest(protocol, arrays)])
        .start(grid, node_ids, observers=[DurableReleases(output)])
        .outcomes
    )
    log(logging.INFO, "%s", test.summary())

    # 5. results.json and report.html, as the built-in jobs write them.
    files = write_outcome_report(
        output,
        [*series.outcomes, rates, test],
        title="Own app: fairness of the FedAvg model",
        run_config=config,
        extra={"epsilon_spent_per_user": series.epsilon_spent + rate_series.epsilon_spent},
    )
    log(logging.INFO, "results written to %s and %s", files.results_json, files.report_html)
