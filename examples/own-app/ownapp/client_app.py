"""The ClientApp: the app's own FedAvg training, plus fedparity's LDP audit and FedEvalFair
handlers around the app's own evaluation."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedparity.clients import (
    HolderRows,
    LocalPredictions,
    LocalUsers,
    fedevalfair_handlers,
    ldp_audit_handler,
    rate_report_handler,
)
from fedparity.mechanisms.crypto.ckks import secret_context_path
from ownapp.task import data_file, load_rows, predict, train

app = ClientApp()


def node_rows(context: Context) -> dict[str, np.ndarray]:
    return load_rows(data_file(context.node_config, int(context.node_config["partition-id"])))


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Plain FedAvg (the app's own choice: the update it returns is not private)."""
    rows = node_rows(context)
    arrays = msg.content.array_records["arrays"]
    model = train(arrays, rows, float(msg.content.config_records["config"]["lr"]))
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(rows["label"])}),
        }
    )
    return Message(content=content, reply_to=msg)


def local_users(arrays: ArrayRecord, metric: str, context: Context) -> LocalUsers:
    """Each user's group and value of ``metric`` under the model the audit sent."""
    rows = node_rows(context)
    return LocalUsers.from_rows(
        groups=rows["group"],
        labels=rows["label"],
        predictions=predict(arrays, rows["features"]),
        metric=metric,
        user_ids=np.arange(len(rows["label"])),
    )


def local_predictions(arrays: ArrayRecord, context: Context) -> LocalPredictions:
    """Each user's group, label and prediction under the model the rate report sent."""
    rows = node_rows(context)
    return LocalPredictions(
        groups=rows["group"],
        labels=rows["label"],
        predictions=predict(arrays, rows["features"]),
        user_ids=np.arange(len(rows["label"])),
    )


def holder_rows(arrays: ArrayRecord, context: Context) -> HolderRows:
    rows = node_rows(context)
    return HolderRows(
        labels=rows["label"], predictions=predict(arrays, rows["features"]), groups=rows["group"]
    )


# The LDP audit: the node perturbs each user's (group, metric) pair and charges the user's
# ledger; its own privacy policy (node config) bounds what it spends.
app.query("ldp_audit")(ldp_audit_handler(local_users, num_groups=2))

# The rate report: one perturbed (group, confusion cell) report per user gives every rate
# metric per group; the user's ledger is charged once.
app.query("rate_report")(rate_report_handler(local_predictions, num_groups=2))

# FedEvalFair: the node's secret context and identity come from its own node config, else
# ~/.fedparity/keys and ~/.fedparity/identity (prepare.py writes them there); never from the
# server.
for action, handler in fedevalfair_handlers(
    holder_rows, secret_context=lambda context: secret_context_path(context.node_config)
).items():
    app.query(action)(handler)
