"""fedparity ServerApp: train with FedAvg, then audit the performance gap under LDP.

The default job (``flwr run .``): nodes host shards of an embedded synthetic population;
``num-server-rounds`` FedAvg rounds train a logistic regression; then one LDP audit per
value of ``epsilons`` measures the gap of ``metric`` between groups; the table puts the
private estimate next to the true gap (computed by the simulation harness only), and
results.json plus a plot go to ``output-dir``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from clients.task import build_model, get_arrays
from mechanisms import mechanism_for_budget
from server.config import RunConfig
from server.harness import GroundTruth, ground_truth
from server.report import audit_table, plot_audits, write_json
from strategies.ldp_audit import METRICS_KEY, AuditOutcome, LdpGapAudit
from strategies.robust_fedavg import RobustFedAvg

app = ServerApp()

DESCRIBE_MESSAGE_TYPE = "query.describe"
DEFAULT_RUNS_DIR = Path.home() / ".fedparity" / "runs"


class NodeDescriptions:
    """What the nodes said about their shards (public sizes only)."""

    def __init__(self) -> None:
        self.num_features: int | None = None
        self.num_users = 0
        self.partitions: list[tuple[int, int]] = []
        self.failed: list[tuple[int, str]] = []


def wait_for_nodes(grid: Grid, minimum: int, timeout: float) -> list[int]:
    """Node ids once at least ``minimum`` are connected (nodes register asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= minimum:
            return node_ids
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {len(node_ids)} node(s) connected after {timeout:g} s; min-nodes = {minimum}"
            )
        time.sleep(0.5)


def describe_nodes(grid: Grid, node_ids: list[int], timeout: float) -> NodeDescriptions:
    """Ask every node for its feature count, user count and partition (no private data)."""
    messages = [
        Message(content=RecordDict({}), dst_node_id=node, message_type=DESCRIBE_MESSAGE_TYPE)
        for node in node_ids
    ]
    found = NodeDescriptions()
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            found.failed.append((node, reply.error.reason))
            continue
        metrics = reply.content.metric_records.get(METRICS_KEY)
        try:
            num_features = int(metrics["num-features"])  # type: ignore[index]
            found.num_users += int(metrics["num-users"])  # type: ignore[index]
            found.partitions.append(
                (int(metrics["partition-id"]), int(metrics["num-partitions"]))  # type: ignore[index]
            )
        except (KeyError, TypeError, ValueError) as error:
            found.failed.append((node, f"malformed describe reply: {error!r}"))
            continue
        if found.num_features is None:
            found.num_features = num_features
        elif found.num_features != num_features:
            reason = f"{num_features} features, the others have {found.num_features}"
            found.failed.append((node, reason))
    if found.num_features is None:
        raise RuntimeError(f"no node described its data: {found.failed}")
    return found


def resolve_output_dir(config: RunConfig) -> Path:
    if config.output_dir:
        return Path(config.output_dir).expanduser().resolve()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return DEFAULT_RUNS_DIR / f"ldp-audit-{stamp}"


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train, audit at every epsilon, report."""
    config = RunConfig.from_mapping(context.run_config)
    output_dir = resolve_output_dir(config)
    started = time.perf_counter()
    node_ids = wait_for_nodes(grid, config.min_nodes, config.node_wait_timeout)
    nodes = describe_nodes(grid, node_ids, config.reply_timeout)
    log(
        logging.INFO,
        "fedparity: %d node(s), %d user(s), %d features; dataset %s",
        len(node_ids),
        nodes.num_users,
        nodes.num_features,
        config.dataset,
    )
    model = build_model(int(nodes.num_features), seed=config.seed)  # type: ignore[arg-type]
    arrays = ArrayRecord(get_arrays(model))
    strategy = RobustFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
    train_losses: dict[int, float] = {}
    if config.num_server_rounds:
        result = strategy.start(
            grid=grid,
            initial_arrays=arrays,
            num_rounds=config.num_server_rounds,
            timeout=config.reply_timeout,
            train_config=ConfigRecord({"learning-rate": config.learning_rate}),
        )
        arrays = result.arrays
        train_losses = {
            int(rnd): float(metrics.get("train-loss", float("nan")))
            for rnd, metrics in result.train_metrics_clientapp.items()
        }

    truth: GroundTruth | None = None
    if config.ground_truth:
        truth = ground_truth(config, arrays, nodes.partitions)
        log(
            logging.INFO,
            "harness (not private): true %s group means %s, gap %.4f",
            config.metric,
            ", ".join(f"{m:.4f}" for m in truth.group_means),
            truth.max_gap,
        )
    outcomes: list[AuditOutcome] = []
    spent = 0.0
    for index, budget in enumerate(config.epsilons):
        mechanism = mechanism_for_budget(config.mechanism, budget, config.num_groups)  # type: ignore[arg-type]
        audit = LdpGapAudit(
            mechanism,
            budget=budget,
            metric=config.metric,
            confidence=config.confidence,
            group_sizes=truth.group_counts if (truth and config.group_sizes == "known") else None,
            audit_id=f"audit-{index + 1}-eps-{budget:g}",
        )
        log(logging.INFO, "[AUDIT %d/%d] epsilon %g", index + 1, len(config.epsilons), budget)
        # Nodes charge their users' ledgers when they process the audit, whether or not
        # their reply arrives or is accepted: count every audit sent (an upper bound).
        spent += mechanism.epsilon
        outcome = audit.start(grid, arrays, timeout=config.reply_timeout)
        outcomes.append(outcome)
        if outcome.estimate is not None:
            log(
                logging.INFO,
                "\t└──> gap %.4f, %g%% interval [%.4f, %.4f] from %d reports",
                outcome.estimate.max_gap,
                100 * config.confidence,
                outcome.estimate.max_gap_interval.low,
                outcome.estimate.max_gap_interval.high,
                outcome.estimate.num_reports,
            )
        else:
            log(logging.WARNING, "\t└──> no estimate: %s", outcome.error)

    table = audit_table(config.epsilons, outcomes, truth)
    payload = {
        "task": config.task,
        "run_config": {key: value for key, value in asdict(config).items()},
        "num_nodes": len(node_ids),
        "num_users": nodes.num_users,
        "failed_describe": [{"node_id": n, "reason": r} for n, r in nodes.failed],
        "training": {
            "rounds": config.num_server_rounds,
            "train_loss": train_losses,
            "rejected_replies": {
                rnd: [{"node_id": r.node_id, "reason": r.reason} for r in items]
                for rnd, items in strategy.rejected.items()
            },
        },
        "ground_truth": None if truth is None else truth.to_dict(),
        "audits": [
            {"budget": budget, **outcome.to_dict()}
            for budget, outcome in zip(config.epsilons, outcomes, strict=True)
        ],
        "privacy": {
            "user_budget": config.user_budget,
            "epsilon_spent_per_user": spent,
            "composition": "basic sequential composition of the true epsilons of every audit "
            "sent (an upper bound: users who refused or whose metric was undefined spent less)",
        },
        "elapsed_seconds": time.perf_counter() - started,
    }
    write_json(output_dir / "results.json", payload)
    plot_note = plot_audits(
        output_dir / "gap_vs_epsilon.png", config.epsilons, outcomes, truth, config.metric
    )
    for line in (
        "",
        f"LDP audit of the {config.metric} gap ({len(node_ids)} nodes, {nodes.num_users} users):",
        *table.splitlines(),
        "",
    ):
        log(logging.INFO, "%s", line)
    if plot_note:
        log(logging.WARNING, "%s", plot_note)
    log(logging.INFO, "privacy spent per user: %.4g of %.4g", spent, config.user_budget)
    log(logging.INFO, "results written to %s", output_dir)
