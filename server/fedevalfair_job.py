"""The FedEvalFair job: train with FedAvg, then test fairness over encrypted statistics.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version); FedEvalFair (anonymous, 2024), "the paper" below. The test runs in fedparity's
calibrated mode and in the paper's (see :mod:`fedparity.mechanisms.fairness_tests.fedevalfair`).

Nodes are data holders (synthetic, or UCI Adult split by doctorate or Dirichlet label skew;
protected attribute: race). The global model (or its fair-by-construction variant) is
evaluated on every holder's private test set; the two-stage test runs over CKKS ciphertexts
(:class:`~fedparity.strategies.fedevalfair.FedEvalFairProtocol`) for demographic parity and equal
opportunity in both modes. The table shows, per test: stage statistics, degrees of freedom,
p-values, decisions at alpha, the Graybill-Deal common disparity with its standard error,
the number of holders and the mode. results.json and a plot of the holders' bootstrap
distributions (simulation harness only: they never leave the nodes) go to ``output-dir``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import tenseal as ts
from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..clients.project.config import RunConfig
from ..mechanisms.crypto.ckks import (
    DEFAULT_KEY_DIR,
    PUBLIC_CONTEXT_FILE,
    context_has_secret_key,
    load_public_context,
)
from ..strategies.fedevalfair import FedEvalFairOutcome, FedEvalFairProtocol
from ..strategies.release_series import (
    DurableReleases,
    FedEvalFairSeries,
    FedEvalFairTest,
    Release,
    SeriesObserver,
)
from ..strategies.replies import ledger_fields
from .harness import HARNESS_LABEL, FedEvalFairTruth, fedevalfair_truth
from .html_report import write_report
from .orchestration import (
    connect_nodes,
    harness_applies,
    require_fedevalfair_holders,
    supplied_model,
    train_global_model,
    training_report,
)
from .progress import Progress
from .report import (
    PLOT_NEEDS_MATPLOTLIB,
    fedevalfair_findings,
    fedevalfair_ledger_text,
    fedevalfair_report,
    fedevalfair_warnings,
    load_pyplot,
    plain_tick_labels,
    write_json,
)
from .results import FedEvalFairResults
from .run_record import RunRecord, open_run_record


def fedevalfair_table(outcome: FedEvalFairOutcome, primary_mode: str) -> str:
    """One row per (metric, comparison, mode): both stages, decisions and the common
    disparity; the groups compared follow the metric when the run has more than two."""
    names = [
        block.metric
        + ("" if block.comparison == (0, 1) else f" {block.comparison[0]}v{block.comparison[1]}")
        for block in outcome.blocks
    ]
    width = max([6, *map(len, names)])
    header = (
        f"{'metric':>{width}} {'mode':>10} {'k':>3} {'stage1 stat':>11} {'dof':>3} {'p1':>9} "
        f"{'rej1':>4} {'W*':>8} {'p2':>9} {'rej2':>4} {'mu_hat':>8} {'stderr':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, block in zip(names, outcome.blocks, strict=True):
        mark = "*" if block.mode == primary_mode else " "
        if block.report is None:
            lines.append(f"{name:>{width}} {block.mode:>10}{mark}  unavailable: {block.reason}")
            continue
        report = block.report
        first, second = report.homogeneity, report.common_disparity
        reject1 = "yes" if report.reject_homogeneity else "no"
        reject2 = "yes" if report.reject_fairness else "no"
        lines.append(
            f"{name:>{width}} {block.mode:>10}{mark}{report.k:>3} {first.statistic:>11.4f} "
            f"{first.dof:>3} {first.pvalue:>9.3g} {reject1:>4} "
            f"{second.statistic:>8.3f} {second.pvalue:>9.3g} {reject2:>4} "
            f"{report.estimate:>8.4f} {report.stderr:>8.4f}"
        )
        if report.equivalence is not None:
            lines.append(
                f"{'':>{width + 12}} equivalence |mu| < {report.tolerance:g}: p = "
                f"{report.equivalence.pvalue:.3g}, certified fair: "
                f"{'yes' if report.certified_fair else 'no'}"
            )
    lines.append(
        "(* primary mode; stage 1 H0: equal disparity at every holder; stage 2 H0: mu = mu0)"
    )
    return "\n".join(lines)


def plot_bootstrap_distributions(path: Path, truth: FedEvalFairTruth) -> str | None:
    """Histograms of every holder's bootstrap disparities per metric (paper Figures 4/5: dp
    and eo)."""
    plt = load_pyplot()
    if plt is None:
        return PLOT_NEEDS_MATPLOTLIB
    metrics = list(truth.resamples)
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for axis, metric in zip(axes[0], metrics, strict=True):
        for partition, values in truth.resamples[metric]:
            axis.hist(values, bins=30, alpha=0.5, label=f"holder {partition}")
        axis.axvline(0.0, color="black", linewidth=0.8)
        name = {"dp": "ΔDP", "eo": "ΔEO"}.get(metric, f"Δ{metric}")
        axis.set_title(f"bootstrap {name} per holder (harness)")
        axis.set_xlabel("signed disparity, group 0 (White) minus group 1")
        axis.set_ylabel("bootstrap resamples")
        plain_tick_labels(axis)
        if truth.resamples[metric]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


def every_holder_took_part(outcome: FedEvalFairOutcome, holders: Sequence[int]) -> bool:
    """Whether every one of ``holders`` sent its statistics in both rounds that carry them
    (rounds 1 and 2; round 3 is the key holders' release)."""
    rounds = outcome.round_participants[:2]
    return len(rounds) == 2 and all(set(nodes) == set(holders) for nodes in rounds)


def compare_with_plaintext(outcome: FedEvalFairOutcome, truth: FedEvalFairTruth) -> float | None:
    """Largest |p_encrypted - p_plaintext| over every test both computed (None if none)."""
    differences = []
    for block in outcome.blocks:
        plain = truth.reports.get((block.metric, block.mode, block.comparison))
        if block.report is None or plain is None:
            continue
        for mine, theirs in (
            (block.report.homogeneity, plain.homogeneity),
            (block.report.common_disparity, plain.common_disparity),
        ):
            differences.append(abs(mine.pvalue - theirs.pvalue))
    return max(differences) if differences else None


#: Message exchanges of the encrypted protocol: round 1, the verifiers' endorsement, round 2,
#: the round-2 holders' commitment, round 3 (the key holders).
PROTOCOL_EXCHANGES = 5


class FedEvalFairWithProgress(FedEvalFairProtocol):
    """:class:`FedEvalFairProtocol` that counts each message exchange on :attr:`progress`."""

    progress: Progress | None = None

    def _send(
        self, grid: Grid, message_type: str, node_ids: Sequence[int], content: RecordDict
    ) -> list[Message]:
        replies = super()._send(grid, message_type, node_ids, content)
        if self.progress is not None:
            self.progress.advance()
        return replies


class ExchangeProgress(SeriesObserver):
    """The job's progress display of each FedEvalFair test of a series (one step per message
    exchange, counted by ``protocols[i]``), after its release is recorded: ``labels[i]`` names
    test ``i``'s display, and ``lines[i]`` (if any) is logged before it starts. :meth:`close`
    stops a display an exception left open."""

    def __init__(
        self,
        protocols: Sequence[FedEvalFairWithProgress],
        labels: Sequence[str],
        lines: Sequence[str] = (),
    ) -> None:
        self.protocols, self.labels, self.lines = list(protocols), list(labels), list(lines)
        self.progress: Progress | None = None

    def before_release(self, index: int, release: Release) -> None:
        if self.lines:
            log(logging.INFO, "%s", self.lines[index])
        self.progress = Progress(
            self.labels[index],
            PROTOCOL_EXCHANGES,
            units="exchanges",
            log=lambda line: log(logging.INFO, "%s", line),
        ).start()
        self.protocols[index].progress = self.progress

    def after_release(self, index: int, release: Release, outcome: FedEvalFairOutcome) -> None:
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None


def server_public_context(config: RunConfig) -> ts.Context:
    """The server's public TenSEAL context (``fef-public-context``, else the default key
    folder's), before any work: a missing file names the key and how to make it, and a context
    holding a secret key is refused
    (:func:`~fedparity.mechanisms.crypto.ckks.load_public_context`)."""
    public_path = (
        Path(config.fef_public_context).expanduser()
        if config.fef_public_context
        else DEFAULT_KEY_DIR / PUBLIC_CONTEXT_FILE
    )
    if not public_path.is_file():
        raise FileNotFoundError(
            f"fef-public-context: no public TenSEAL context at {public_path}; create the key "
            "pair with `fedparity keys` (default folder ~/.fedparity/keys) and give the nodes "
            "the secret one"
        )
    return load_public_context(public_path)


def fedevalfair_protocol(
    config: RunConfig, public: ts.Context, *, session: str = ""
) -> FedEvalFairWithProgress:
    """The encrypted test with the run config's alpha, mu0, tolerance, key holders, reply
    timeout and holder-level DP mode (``fef-dp-epsilon``); ``session`` labels it when a run
    tests more than one model (the pipeline)."""
    return FedEvalFairWithProgress(
        public,
        alpha=config.fef_alpha,
        mu0=config.fef_mu0,
        tolerance=config.fef_tolerance,
        key_holders=config.fef_key_holders,
        timeout=config.reply_timeout,
        session=session,
        dp=config.fef_holder_dp,
        layout=config.fef_layout,
    )


def fedevalfair_privacy(config: RunConfig, outcome: FedEvalFairOutcome) -> dict[str, object]:
    """What a FedEvalFair run spends of the users' privacy ledgers, for results.json.

    Off (``fef-dp-epsilon = ""``): nothing. Its releases are aggregate statistics over at
    least the holders' min-holders, rounded and noise-flooded against key recovery
    (docs/threat-model.md), not differentially private, so no (epsilon, delta) is charged and
    the nodes report no totals. On: the release is (epsilon, delta)-DP under replace one
    holder (so one user), each released sum carries Gaussian noise of ``noise_std``, every
    round-2 holder charged (epsilon, delta) to each of its users before it committed, and the
    totals its ledger reported with its commitment are ``outcome``'s (none from holders below
    their ``min-users-for-counts``)."""
    dp = config.fef_holder_dp
    if dp is None:
        return {
            "differentially_private": False,
            "charged_to_ledgers": False,
            "ledger_totals_reported_by_nodes": None,
        }
    ledgers = outcome.ledger_reports
    return {
        "differentially_private": True,
        "charged_to_ledgers": True,
        "charged_by": "every round-2 holder, to each of its users, before it committed",
        **ledger_fields(ledgers.merged(), ledgers),
        **dp.to_dict(),
    }


def _report_test(
    config: RunConfig,
    output_dir: Path,
    results: FedEvalFairResults,
    outcome: FedEvalFairOutcome,
    truth: FedEvalFairTruth | None,
) -> None:
    """results.json, the plot, report.html and the summary on the console."""
    written = FedEvalFairResults.from_dict(
        write_json(output_dir / "results.json", results.to_dict())
    )
    plot_note = None
    if truth is not None:
        plot_note = plot_bootstrap_distributions(output_dir / "bootstrap_disparities.png", truth)
    report_path = write_report(output_dir, fedevalfair_report(written, output_dir, plot_note))
    stages = [len(nodes) for nodes in outcome.round_participants[:2]] + [0, 0]
    title = (
        f"FedEvalFair ({config.fef_variant} model; of {results.num_nodes} holder(s) asked, "
        f"{stages[0]} contributed to stage 1 and {stages[1]} to stage 2; "
        f"alpha = {config.fef_alpha:g}, mu0 = {config.fef_mu0:g}):"
    )
    log(logging.INFO, "")
    for finding in fedevalfair_findings(written):
        log(logging.INFO, "%s", finding.plain())
    for warning in fedevalfair_warnings(written):
        log(logging.WARNING, "%s", warning)
    if config.fef_holder_dp is not None:
        log(logging.INFO, "%s", fedevalfair_ledger_text(written.privacy or {}))
    table = fedevalfair_table(outcome, config.fef_mode)
    for line in ("", title, *table.splitlines(), ""):
        log(logging.INFO, "%s", line)
    if outcome.error:
        log(logging.WARNING, "FedEvalFair: %s", outcome.error)
    for item in outcome.unable:
        log(logging.INFO, "holder %d did not take part: %s", item.node_id, item.reason)
    if any(outcome.dropped[1:]):
        log(logging.WARNING, "dropped between rounds: %s", [list(d) for d in outcome.dropped])
    difference = results.max_abs_pvalue_difference_vs_plaintext
    if difference is not None and math.isfinite(difference):
        log(
            logging.INFO,
            "%s: p-values match the plaintext computation to %.1e",
            HARNESS_LABEL,
            difference,
        )
    elif truth is not None and config.fef_holder_dp is None:
        log(
            logging.INFO,
            "%s: p-values not compared with the plaintext computation, which uses every "
            "holder: not every holder sent its statistics in rounds 1 and 2",
            HARNESS_LABEL,
        )
    if plot_note:
        log(logging.WARNING, "%s", plot_note)
    log(logging.INFO, "results written to %s (report: %s)", output_dir, report_path)


def run_fedevalfair(grid: Grid, config: RunConfig, record: RunRecord | None = None) -> Path:
    """Train, run the encrypted two-stage test, report; returns the output directory."""
    record = record if record is not None else open_run_record(config)
    output_dir = record.folder
    started = time.perf_counter()
    protocol = fedevalfair_protocol(config, server_public_context(config))
    supplied = supplied_model(config)  # model-file: read and checked before any work
    node_ids, nodes = connect_nodes(grid, config, minimum=2)
    require_fedevalfair_holders(nodes, node_ids)  # before training: the holders have their keys
    log(
        logging.INFO,
        "fedparity FedEvalFair: %d holder(s), %d test/train rows described, dataset %s",
        len(node_ids),
        nodes.num_users,
        config.dataset,
    )
    arrays, losses, strategy = train_global_model(
        grid,
        config,
        int(nodes.num_features),  # type: ignore[arg-type]
        supplied,
    )
    # The key holders decrypt aggregates in the protocol's last round: recorded durably in
    # status.json before it starts (differentially private only in the holder-level DP mode;
    # see the docs).
    dp = config.fef_holder_dp
    progress = ExchangeProgress([protocol], ["fedevalfair protocol"])
    try:
        [outcome] = (
            FedEvalFairSeries([FedEvalFairTest(protocol, arrays)])
            .start(grid, node_ids, observers=[DurableReleases(record=record), progress])
            .outcomes
        )
    finally:
        progress.close()
    truth = (
        fedevalfair_truth(config, arrays, nodes.partitions)
        if harness_applies(config, nodes)
        else None
    )
    # With holder-level DP the p-values differ from the plaintext ones by the noise, by design,
    # and a holder that did not take part leaves the plaintext (every holder) another test:
    # either way the comparison would not measure the encryption (the plaintext stays reported).
    difference = (
        compare_with_plaintext(outcome, truth)
        if truth is not None and dp is None and every_holder_took_part(outcome, node_ids)
        else None
    )
    results = FedEvalFairResults(
        task=config.task,
        run_config=asdict(config),
        num_nodes=len(node_ids),
        model_variant=config.fef_variant,
        primary_mode=config.fef_mode,
        training=training_report(config, losses, strategy),
        fedevalfair=outcome.to_dict(),
        harness_plaintext=None if truth is None else truth.to_dict(),
        max_abs_pvalue_difference_vs_plaintext=difference,
        server_context_has_secret_key=context_has_secret_key(protocol.public_context),
        privacy=fedevalfair_privacy(config, outcome),
        elapsed_seconds=time.perf_counter() - started,
    )
    _report_test(config, output_dir, results, outcome, truth)
    assert len(outcome.blocks) in (0, len(config.fef_layout.blocks))
    if outcome.error:
        record.fail(f"FedEvalFair gave no result: {outcome.error}")
    else:
        record.finish("completed")
    return output_dir
