"""The user's ClientApp: fedparity's handlers around the user's own model and data."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.clientapp import ClientApp
from task import build_model, load_rows, predict, users_of

from fedparity.clients import (
    FPFLNodeSettings,
    HolderRows,
    LocalUsers,
    fedevalfair_handlers,
    fpfl_handlers,
    ldp_audit_handler,
)

app = ClientApp()


def node_rows(context: Context) -> dict[str, np.ndarray]:
    # The node's own data folder: from the environment the SuperNode was started with.
    return load_rows(os.environ["USERAPP_DATA_DIR"], int(context.node_config["partition-id"]))


def local_users(arrays: ArrayRecord, metric: str, context: Context) -> LocalUsers:
    rows = node_rows(context)
    return LocalUsers.from_rows(
        groups=rows["group"],
        labels=rows["label"],
        predictions=predict(arrays, rows["features"]),
        metric=metric,
        user_ids=rows["user"],
    )


def holder_rows(arrays: ArrayRecord, context: Context) -> HolderRows:
    rows = node_rows(context)
    return HolderRows(
        labels=rows["label"], predictions=predict(arrays, rows["features"]), groups=rows["group"]
    )


def bootstrap_rng(context: Context) -> np.random.Generator:
    # Seeded so that the test can recompute the plaintext statistics.
    return np.random.default_rng([7, int(context.node_config["partition-id"])])


app.query("ldp_audit")(ldp_audit_handler(local_users, num_groups=2))
# The node's own secret context: from the environment the SuperNode was started with.
for action, handler in fedevalfair_handlers(
    holder_rows,
    secret_context=lambda context: os.environ["USERAPP_SECRET_CONTEXT"],
    num_resamples=50,
    bootstrap_rng=bootstrap_rng,
).items():
    app.query(action)(handler)

# FPFL: the node's own privacy settings; it refuses a run whose parameters differ (the server
# proposes K and sigma, which the node checks against its policy and its own epsilon).
FPFL_SETTINGS = FPFLNodeSettings(
    constraint="fnr",
    cohort_size=300,
    rounds=3,
    clipping_bound=1.0,
    epsilon=2.0,
    dropout_tolerance=0.25,
)
for action, handler in fpfl_handlers(
    build_model, lambda context: users_of(node_rows(context)), FPFL_SETTINGS
).items():
    app.query(action)(handler)
