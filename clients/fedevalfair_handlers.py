"""FedEvalFair on a data holder, as handlers for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.fedevalfair.FedEvalFairProtocol` runs three rounds
(``query.fef_round1`` .. ``query.fef_round3``) over CKKS ciphertexts ("FedEvalFair: A
Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation Framework",
anonymous authors, under review; Algorithms 1-2). On the holder, round 1 calls *your*
function for the received model's predictions on your rows; rounds 2 and 3 need no data.
Register them with::

    from fedparity.clients import HolderRows, fedevalfair_handlers

    def my_rows(arrays, context):
        model = load_my_model(arrays)
        return HolderRows(labels=y, predictions=model_predictions, groups=sex)

    handlers = fedevalfair_handlers(my_rows, secret_context="/etc/fedparity/secret.tenseal")
    for action, handler in handlers.items():
        app.query(action)(handler)

The secret context (made by ``fedparity keys``, handed out of band) is the node's own: its
path is an argument here, never something the server sends. ``mu0`` and ``tolerance`` must be
the values the server's protocol object uses.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.common import log

from ..mechanisms.ckks import encrypt_vector, from_array, load_secret_context, to_array
from ..mechanisms.fairtest import InsufficientGroupData
from ..mechanisms.protocol import FEF_KEY, RELEASE_SIZE, ROUND1_SIZE, ROUND2_SIZE, UNABLE_REPLY
from .fedevalfair import (
    ClientStatistics,
    open_sum,
    release_vector,
    round1_vector,
    round2_vector,
    rows_statistics,
)
from .messages import int_field
from .policy import NodePrivacyPolicy, PolicyRefusal, node_policy

if TYPE_CHECKING:
    import tenseal as ts

__all__ = [
    "FEF_STATE_KEY",
    "HolderRows",
    "HolderRowsFn",
    "fedevalfair_handlers",
    "load_secret_context_cached",
    "round1_reply",
]

#: Node run-state record of the round-1 statistics (read again in round 2).
FEF_STATE_KEY = "fef-statistics"
Handler = Callable[[Message, Context], Message]


@dataclass(frozen=True)
class HolderRows:
    """A holder's test rows for the received model: true labels, 0/1 predictions and the
    binary protected group (0/1) of every row."""

    labels: np.ndarray
    predictions: np.ndarray
    groups: np.ndarray

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("labels", "predictions", "groups"):
            array = np.asarray(getattr(self, name))
            if array.ndim != 1:
                raise ValueError(f"{name} must be a 1-d array (one value per row)")
            if array.size and not np.isin(array, (0, 1)).all():
                raise ValueError(f"{name} must hold only 0/1 (or booleans)")
            arrays[name] = array.astype(np.int64)
        sizes = {name: array.size for name, array in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"labels, predictions and groups must have one value per row: {sizes}")
        for name, array in arrays.items():
            object.__setattr__(self, name, array)


#: ``holder_rows(arrays, context)``: the holder's rows evaluated on the received model.
HolderRowsFn = Callable[[ArrayRecord, Context], HolderRows]


@functools.lru_cache(maxsize=4)
def _cached_secret_context(path: str) -> ts.Context:
    return load_secret_context(path)


def load_secret_context_cached(path: str | os.PathLike[str]) -> ts.Context:
    """The secret context at ``path``, loaded once per process (loading takes ~40 ms)."""
    return _cached_secret_context(os.fspath(Path(path)))


def _ciphertext_reply(msg: Message, payload: bytes) -> Message:
    record = ArrayRecord({"ciphertext": Array(to_array(payload))})
    return Message(content=RecordDict({FEF_KEY: record}), reply_to=msg)


def round1_reply(
    msg: Message,
    context: Context,
    statistics: ClientStatistics,
    secret: ts.Context,
    *,
    mu0: float,
    tolerance: float | None,
) -> Message:
    """Keep ``statistics`` in the node's state for round 2 and reply with the round-1
    ciphertext (one CKKS vector)."""
    context.state.array_records[FEF_STATE_KEY] = ArrayRecord(
        {"summaries": Array(statistics.to_array())}
    )
    vector = round1_vector(statistics, mu0=mu0, tolerance=tolerance)
    return _ciphertext_reply(msg, encrypt_vector(secret, vector))


def fedevalfair_handlers(
    holder_rows: HolderRowsFn | None,
    *,
    secret_context: str | os.PathLike[str] | Callable[[Context], str | os.PathLike[str]],
    num_resamples: int = 100,
    min_cell_count: int = 5,
    mu0: float = 0.0,
    tolerance: float | None = None,
    bootstrap_rng: Callable[[Context], np.random.Generator] | None = None,
    policy: NodePrivacyPolicy | None = None,
) -> dict[str, Handler]:
    """The three FedEvalFair handlers, keyed by the action to register with ``app.query``.

    Parameters
    ----------
    holder_rows : callable or None
        ``holder_rows(arrays, context) -> HolderRows`` for round 1. None leaves round 1 out
        of the returned mapping (for an app that computes its own round-1 statistics and
        replies with :func:`round1_reply`).
    secret_context : path, or callable of the Context returning one
        The holder's secret TenSEAL context file (never sent by the server).
    num_resamples : int
        Bootstrap resamples B per metric (FedEvalFair's per-holder bootstrap).
    min_cell_count : int
        A metric is reported only when both groups and both predictions have this many rows.
    mu0, tolerance : float, float or None
        The stage-2 null value and the TOST tolerance; the server's protocol must use the same.
    bootstrap_rng : callable, optional
        ``bootstrap_rng(context) -> numpy Generator`` for the bootstrap resamples (not a
        privacy mechanism: a seed makes the statistics reproducible). Default: OS entropy.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy: a sum of fewer than its ``min-holders`` holders is never
        decrypted. Default: read for each message from the node's own config or environment
        (:func:`~fedparity.clients.policy.node_policy`).
    """
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int) or num_resamples < 2:
        raise ValueError(f"num_resamples must be an integer >= 2, got {num_resamples!r}")
    if isinstance(min_cell_count, bool) or not isinstance(min_cell_count, int):
        raise ValueError(f"min_cell_count must be an integer >= 0, got {min_cell_count!r}")
    if min_cell_count < 0:
        raise ValueError(f"min_cell_count must be an integer >= 0, got {min_cell_count!r}")
    if not np.isfinite(mu0):
        raise ValueError(f"mu0 must be a finite number, got {mu0!r}")
    if tolerance is not None and not (np.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a finite number > 0 or None, got {tolerance!r}")

    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")

    def check_holders(context: Context, *counts: int) -> None:
        """Refuse to open a sum of fewer holders than the policy's ``min-holders`` (the sum of
        one holder is that holder's statistics)."""
        limits = policy if policy is not None else node_policy(context.node_config)
        if min(counts) < limits.min_holders:
            raise PolicyRefusal("a sum of fewer than min-holders holders is never decrypted")

    def secret(context: Context) -> ts.Context:
        path = secret_context(context) if callable(secret_context) else secret_context
        return load_secret_context_cached(path)

    def round1(msg: Message, context: Context) -> Message:
        """Bootstrap dp/eo on the holder's rows; reply with one ciphertext."""
        key = secret(context)
        assert holder_rows is not None
        rows = holder_rows(msg.content["arrays"], context)
        if not isinstance(rows, HolderRows):
            raise TypeError(f"holder_rows must return HolderRows, got {type(rows).__name__}")
        try:
            statistics = rows_statistics(
                rows.labels,
                rows.predictions,
                rows.groups,
                num_resamples=num_resamples,
                rng=np.random.default_rng() if bootstrap_rng is None else bootstrap_rng(context),
                min_cell_count=min_cell_count,
            )
        except InsufficientGroupData as error:
            # The detailed reason holds this node's cell counts: it stays in the node's log.
            log(logging.WARNING, "FedEvalFair: this node cannot take part: %s", error)
            raise InsufficientGroupData(UNABLE_REPLY) from None
        return round1_reply(msg, context, statistics, key, mu0=mu0, tolerance=tolerance)

    def round2(msg: Message, context: Context) -> Message:
        """Decrypt the round-1 sum, add this holder's stage-1 terms; one ciphertext back."""
        counts = msg.content.config_records.get("config", {})
        round1_count = int_field(counts, "round1-count", minimum=1)
        check_holders(context, round1_count)
        key = secret(context)
        record = msg.content.array_records[FEF_KEY]
        round1_sum = open_sum(
            key, from_array(record["round1-sum"].numpy()), ROUND1_SIZE, round1_count
        )
        if FEF_STATE_KEY not in context.state.array_records:
            raise ValueError("round 2 before round 1: this node has no bootstrap statistics")
        statistics = ClientStatistics.from_array(
            context.state.array_records[FEF_STATE_KEY]["summaries"].numpy()
        )
        vector = round2_vector(statistics, round1_sum, mu0=mu0, tolerance=tolerance)
        return _ciphertext_reply(msg, encrypt_vector(key, vector))

    def round3(msg: Message, context: Context) -> Message:
        """Key holder: decrypt both sums, release the aggregate statistics (plaintext)."""
        counts = msg.content.config_records.get("config", {})
        round1_count = int_field(counts, "round1-count", minimum=1)
        round2_count = int_field(counts, "round2-count", minimum=1)
        check_holders(context, round1_count, round2_count)
        key = secret(context)
        record = msg.content.array_records[FEF_KEY]
        round1_sum = open_sum(
            key, from_array(record["round1-sum"].numpy()), ROUND1_SIZE, round1_count
        )
        round2_sum = open_sum(
            key, from_array(record["round2-sum"].numpy()), ROUND2_SIZE, round2_count
        )
        released = release_vector(round1_sum, round2_sum)
        if released.size != RELEASE_SIZE:
            raise ValueError(f"release has {released.size} values, expected {RELEASE_SIZE}")
        reply = ArrayRecord({"release": Array(released)})
        return Message(content=RecordDict({FEF_KEY: reply}), reply_to=msg)

    handlers: dict[str, Handler] = {"fef_round2": round2, "fef_round3": round3}
    if holder_rows is not None:
        handlers = {"fef_round1": round1, **handlers}
    return handlers
