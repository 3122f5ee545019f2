"""The rate report on a node, as a handler for your own Flower ``ClientApp``.

One private report per user gives every rate metric per group. The server's
:class:`~fedparity.strategies.rate_report.RateReportAudit` sends the model and a frequency
oracle's public parameters (``query.rate_report``); the node evaluates the model with *your*
function, places each user in one joint category (group g, confusion cell TP / FP / FN / TN),
perturbs it once with the oracle (Wang, Blocki, Li and Jha, "Locally differentially private
protocols for frequency estimation", 2017) and replies with the reports only. Selection rate,
TPR, FPR, FNR, TNR, accuracy, precision and NPV per group are all read from the same reports
on the server, so the user's ledger is charged once (a
:class:`~fedparity.mechanisms.privacy.user_ledger.FrequencyReportRelease`), however many
metrics are read.

Register it on your app::

    from fedparity.clients import LocalPredictions, rate_report_handler

    def my_predictions(arrays, context):
        model = load_my_model(arrays)  # your model, your data
        return LocalPredictions(groups=..., labels=..., predictions=..., user_ids=...)

    app.query("rate_report")(rate_report_handler(my_predictions, num_groups=2))

A user with several rows (predictions) reports one of them, chosen uniformly at random on the
node: the rates are then means over users of their rows' cells (every user weighs the same),
which equal the row-level rates when each user has one row (one prediction per device). Privacy
on the node is the LDP audit's (:mod:`fedparity.clients.ldp`): the oracle is rebuilt from its
public parameters, its true epsilon recomputed from its sampler's realised probabilities and
checked against the node's own ``ldp-max-epsilon`` and the report's budget before any data is
read; users whose ledger cannot afford it refuse; the randomness comes from a generator keyed
by the operating system. Every user has a cell (the four cells cover every labelled
prediction), so whether a user answers never depends on the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from numpy.typing import NDArray

from ..mechanisms.crypto.secure_random import secure_generator
from ..mechanisms.ldp.group_rates import encode_cells
from ..mechanisms.privacy.basic_ledger import BUDGET_TOLERANCE
from ..mechanisms.privacy.user_ledger import FrequencyReportRelease
from ..mechanisms.protocol import METRICS_KEY, REPORTS_KEY
from ..mechanisms.protocol.rate_report import (
    CONFIG_KEY,
    RateReportReply,
    RateReportRequest,
    pack_reports,
)
from ..mechanisms.validation import check_binary_array, check_int
from .ldp import LedgerPathFn, charge_users
from .ledger import default_ledger_path
from .messages import NodeRefusal, fixed_error_texts
from .policy import NodePrivacyPolicy, node_policy

__all__ = ["LocalPredictions", "LocalPredictionsFn", "rate_report_handler"]


@dataclass(frozen=True)
class LocalPredictions:
    """The node's labelled predictions for one rate report: each row's protected group, true
    label and predicted label (0/1), and the user it belongs to.

    ``user_ids`` (integers, one per row) key the node's ledger by user and say which rows are
    one user's; None: every row is the device's one user (charged by position).
    """

    groups: NDArray[np.int64]
    labels: NDArray[np.int64]
    predictions: NDArray[np.int64]
    user_ids: NDArray[np.int64] | None = None

    def __post_init__(self) -> None:
        groups = np.asarray(self.groups)
        if groups.ndim != 1 or (groups.size and not np.issubdtype(groups.dtype, np.integer)):
            raise ValueError("groups must be a 1-d integer array (one group per row)")
        labels = check_binary_array(np.asarray(self.labels), "labels")
        predictions = check_binary_array(np.asarray(self.predictions), "predictions")
        if not groups.shape == labels.shape == predictions.shape:
            raise ValueError(
                f"groups, labels and predictions must have one value per row, got "
                f"{groups.shape}, {labels.shape} and {predictions.shape}"
            )
        object.__setattr__(self, "groups", groups.astype(np.int64))
        object.__setattr__(self, "labels", labels.astype(np.int64))
        object.__setattr__(self, "predictions", predictions.astype(np.int64))
        if self.user_ids is not None:
            ids = np.asarray(self.user_ids)
            if ids.shape != groups.shape or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(
                    f"user_ids must be integers, one per row ({groups.shape}), got "
                    f"{ids.dtype} {ids.shape}"
                )
            object.__setattr__(self, "user_ids", ids.astype(np.int64))
        users = np.zeros(groups.shape, dtype=np.int64) if self.user_ids is None else self.user_ids
        unique, index = np.unique(users, return_inverse=True)
        lowest = np.full(unique.size, np.iinfo(np.int64).max)
        highest = np.full(unique.size, np.iinfo(np.int64).min)
        np.minimum.at(lowest, index.reshape(-1), self.groups)
        np.maximum.at(highest, index.reshape(-1), self.groups)
        if (lowest != highest).any():
            raise ValueError("a user's rows must all have the same protected group")

    @property
    def num_rows(self) -> int:
        return int(self.groups.size)

    def one_row_per_user(
        self, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64] | None]:
        """(one row index per user, the users' ids sorted; None without ids): each user's row
        drawn uniformly from its rows with ``rng``."""
        if self.user_ids is None:
            users = np.zeros(self.num_rows, dtype=np.int64)
        else:
            users = self.user_ids
        unique, index = np.unique(users, return_inverse=True)
        index = index.reshape(-1)
        # A uniform row per user: sort rows by (user, random key), take each user's first.
        order = np.lexsort((rng.random(self.num_rows), index))
        starts = np.flatnonzero(np.r_[True, index[order][1:] != index[order][:-1]])
        chosen = order[starts]
        return chosen, (None if self.user_ids is None else unique.astype(np.int64))


#: ``local_predictions(arrays, context)``: the node's labelled predictions of the received model.
LocalPredictionsFn = Callable[[ArrayRecord, Context], LocalPredictions]


def rate_report_handler(
    local_predictions: LocalPredictionsFn,
    *,
    num_groups: int,
    policy: NodePrivacyPolicy | None = None,
    ledger_path: LedgerPathFn = default_ledger_path,
) -> Callable[[Message, Context], Message]:
    """A ``query.rate_report`` handler around your evaluation function.

    Parameters
    ----------
    local_predictions : callable
        ``local_predictions(arrays, context) -> LocalPredictions`` for the received model
        (``arrays``, the report's ArrayRecord).
    num_groups : int
        Protected groups on this node; a report for another number is refused.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy (default: read from the node's config for each report).
    ledger_path : callable, optional
        Where the node's ledger persists; pass the same as to the node's other handlers so
        that every release of a user is charged to one ledger.
    """
    num_groups = check_int("num_groups", num_groups, minimum=2)
    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")

    def handle(msg: Message, context: Context) -> Message:
        request = RateReportRequest.from_fields(msg.content.config_records.get(CONFIG_KEY, {}))
        if request.num_groups != num_groups:
            raise NodeRefusal(
                "rate_report: the report's number of groups is not this node's; refusing"
            )
        oracle = request.build_oracle()
        limits = policy if policy is not None else node_policy(context.node_config)
        limits.check_ldp(oracle.epsilon)
        if oracle.epsilon > request.budget + BUDGET_TOLERANCE:
            raise NodeRefusal(
                "rate_report: the oracle's true epsilon exceeds the report's budget; refusing"
            )
        rows = local_predictions(msg.content.array_records["arrays"], context)
        if not isinstance(rows, LocalPredictions):
            raise TypeError(
                f"local_predictions must return LocalPredictions, got {type(rows).__name__}"
            )
        if rows.num_rows and (rows.groups.min() < 0 or rows.groups.max() >= num_groups):
            raise ValueError(f"a row's group is outside [0, {num_groups})")
        rng = secure_generator()  # AES-CTR keyed by the OS: never a server-known seed
        reports = np.zeros((0,) if oracle.name == "grr" else (0, oracle.domain_size), dtype=bool)
        counts: dict[str, int | float] = {"epsilon-charged": float(oracle.epsilon)}
        if rows.num_rows:
            chosen, user_ids = rows.one_row_per_user(rng)
            num_users = int(chosen.size)
            release = FrequencyReportRelease.from_oracle(
                # a fixed label: the message's audit-id is the server's text, never written
                # into the node's ledger
                oracle,
                job="rate_report",
                label="rate report",
            )
            answering, totals = charge_users(
                context, ledger_path(context), limits, release, num_users, user_ids
            )
            refused = int((~answering).sum())
            categories = encode_cells(
                rows.groups[chosen], rows.labels[chosen], rows.predictions[chosen], num_groups
            )
            reports = oracle.perturb(categories[answering].astype(np.int64), rng)
            if num_users >= limits.min_users_for_counts:
                # Below the policy's minimum the counts would describe too few users.
                counts.update(
                    {"num-reports": num_users - refused, "num-refused": refused, **totals}
                )
        fields = RateReportReply(pack_reports(oracle, reports), counts).to_fields()
        content = RecordDict(
            {
                REPORTS_KEY: ArrayRecord(
                    {name: Array(array) for name, array in fields[REPORTS_KEY].items()}
                ),
                METRICS_KEY: MetricRecord(fields[METRICS_KEY]),
            }
        )
        return Message(content=content, reply_to=msg)

    return fixed_error_texts(handle)  # what reaches the server is a fixed sentence
