"""fedparity ClientApp: thin Flower handlers around :mod:`clients.task` and :mod:`mechanisms`.

A node hosts a shard of users (``users-per-node``; 1 on a real device), selected by the node
config ``partition-id`` / ``num-partitions``. Handlers:

* ``query.describe``  -- the shard's feature count and sizes (so the server can build the model);
* ``train``           -- FedAvg local training on the shard's training data;
* ``query.ldp_audit`` -- evaluate the global model per user, perturb each user's
  (group, metric) pair with the requested mechanism and reply with the perturbed pairs only.

Privacy on the node: the mechanism is rebuilt from its public parameters and its *true*
epsilon is recomputed here, never taken from the server; users whose ledger cannot afford
it refuse. The perturbation randomness comes from the operating system, never from a seed
in the run config: a seed known to the server would let it undo the perturbation.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log

from clients.data import UserShard, load_partition
from clients.task import build_model, evaluate_users, get_arrays, metric_values, set_arrays, train
from mechanisms import ShardLedger, build_mechanism, metric_to_value
from mechanisms.accounting import BUDGET_TOLERANCE
from server.config import RunConfig
from strategies.ldp_audit import GROUPS_KEY, METRICS_KEY, REPORTS_KEY, VALUES_KEY

app = ClientApp()

LEDGER_STATE_KEY = "ldp-ledger"


def _partition(context: Context) -> tuple[int, int]:
    node_config = context.node_config
    try:
        return int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as error:
        raise ValueError(
            f"node config lacks {error}: start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None


def load_shard(context: Context, config: RunConfig, split: str) -> UserShard:
    """This node's users (``split`` = "train" or "test")."""
    partition_id, num_partitions = _partition(context)
    return load_partition(
        config.dataset,
        partition_id,
        num_partitions,
        users_per_node=config.users_per_node,
        num_groups=config.num_groups,
        seed=config.seed,
        split=split,
        data_dir=config.data_dir or None,
        download=config.download,
    )


def _model_for(shard: UserShard, arrays: ArrayRecord | None, seed: int):  # noqa: ANN202
    model = build_model(shard.num_features, seed=seed)
    if arrays is not None:
        set_arrays(model, list(arrays.to_numpy_ndarrays()))
    return model


@app.query("describe")
def describe(msg: Message, context: Context) -> Message:
    """Reply with the shard's shape (no private content: sizes and feature count)."""
    config = RunConfig.from_mapping(context.run_config)
    shard = load_shard(context, config, "train")
    partition_id, num_partitions = _partition(context)
    metrics = MetricRecord(
        {
            "partition-id": partition_id,
            "num-partitions": num_partitions,
            "num-features": shard.num_features,
            "num-users": shard.num_users,
            "num-train-samples": shard.num_samples,
        }
    )
    return Message(content=RecordDict({METRICS_KEY: metrics}), reply_to=msg)


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Local FedAvg training on the shard (one reply: arrays + num-examples)."""
    config = RunConfig.from_mapping(context.run_config)
    shard = load_shard(context, config, "train")
    arrays = msg.content["arrays"]
    model = _model_for(shard, arrays, config.seed)
    server_round = int(msg.content["config"].get("server-round", 0))
    partition_id, _ = _partition(context)
    loss = float("nan")
    if shard.num_samples:
        loss = train(
            model,
            shard,
            epochs=config.local_epochs,
            learning_rate=config.learning_rate,
            seed=config.seed + 1_000_003 * partition_id + server_round,
        )
    reply = RecordDict(
        {
            "arrays": ArrayRecord(get_arrays(model)) if shard.num_samples else arrays,
            METRICS_KEY: MetricRecord(
                {
                    "num-examples": shard.num_samples,
                    "train-loss": loss if shard.num_samples else 0.0,
                }
            ),
        }
    )
    return Message(content=reply, reply_to=msg)


def _ledger(context: Context, config: RunConfig, num_users: int) -> tuple[ShardLedger, Path | None]:
    """The shard's privacy ledger: a file under node config ``ledger-dir`` if set (survives
    runs), else the node's run state (survives messages within a run)."""
    ledger_dir = context.node_config.get("ledger-dir")
    if ledger_dir:
        partition_id, _ = _partition(context)
        path = Path(str(ledger_dir)) / f"ledger-partition-{partition_id}.npz"
        return ShardLedger.load_or_create(path, config.user_budget, num_users), path
    if LEDGER_STATE_KEY in context.state.array_records:
        spent = context.state.array_records[LEDGER_STATE_KEY]["spent"].numpy()
        if spent.shape == (num_users,):
            return ShardLedger(config.user_budget, num_users, spent.astype(np.float64)), None
    return ShardLedger(config.user_budget, num_users), None


@app.query("ldp_audit")
def ldp_audit(msg: Message, context: Context) -> Message:
    """Evaluate, perturb every user's (group, metric) and reply with perturbed pairs only."""
    config = RunConfig.from_mapping(context.run_config)
    audit = msg.content["config"]
    num_groups = int(audit["num-groups"])
    if num_groups != config.num_groups:
        raise ValueError(f"audit asks for {num_groups} groups, this node has {config.num_groups}")
    mechanism = build_mechanism(
        str(audit["mechanism"]),  # type: ignore[arg-type]
        float(audit["epsilon-group"]),
        float(audit["epsilon-value"]),
        num_groups,
    )
    budget = float(audit["budget"])
    if mechanism.epsilon > budget + BUDGET_TOLERANCE:
        raise ValueError(
            f"refusing: the requested mechanism's true epsilon {mechanism.epsilon:.6g} exceeds "
            f"the audit budget {budget:g}"
        )
    shard = load_shard(context, config, "test")
    groups = np.zeros(0, dtype=np.int64)
    values: np.ndarray = np.zeros(0, dtype=np.int8 if mechanism.name == "R" else np.float64)
    refused = undefined = 0
    if shard.num_users:
        model = _model_for(shard, msg.content["arrays"], config.seed)
        metric = metric_values(evaluate_users(model, shard), str(audit["metric"]))
        defined = np.isfinite(metric)
        undefined = int((~defined).sum())
        ledger, path = _ledger(context, config, shard.num_users)
        answering = ledger.spend(mechanism.epsilon, defined)
        refused = int((defined & ~answering).sum())
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            ledger.save(path)
        else:
            context.state.array_records[LEDGER_STATE_KEY] = ArrayRecord(
                {"spent": Array(ledger.spent)}
            )
        rng = np.random.default_rng()  # OS entropy: never a server-known seed
        reports = mechanism.perturb(
            shard.user_groups[answering], metric_to_value(metric[answering]), rng
        )
        groups, values = reports.groups, reports.values
    if refused:
        log(logging.INFO, "ldp_audit: %d user(s) refused (privacy budget)", refused)
    content = RecordDict(
        {
            REPORTS_KEY: ArrayRecord({GROUPS_KEY: Array(groups), VALUES_KEY: Array(values)}),
            METRICS_KEY: MetricRecord(
                {
                    "num-reports": int(groups.size),
                    "num-refused": refused,
                    "num-undefined": undefined,
                    "epsilon-charged": float(mechanism.epsilon),
                }
            ),
        }
    )
    return Message(content=content, reply_to=msg)
