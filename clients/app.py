"""fedparity ClientApp: the project app's thin Flower handlers around its own task
(:mod:`fedparity.clients.project`) and the library's handlers.

A node hosts a shard of users (``users-per-node``; 1 on a real device), selected by the node
config ``partition-id`` / ``num-partitions``. Handlers:

* ``query.describe``  -- the shard's feature count and sizes (so the server can build the model);
* ``train``           -- FedAvg local training on the shard's training data, only on a node
  whose policy allows non-private training (``allow-non-private``) and for a run that trains
  with FedAvg (its updates are neither noised nor charged to the users' ledgers);
* ``query.ldp_audit`` -- evaluate the global model per user, perturb each user's
  (group, metric) pair with the requested mechanism and reply with the perturbed pairs only.

Privacy on the node: the mechanism is rebuilt from its public parameters and its *true*
epsilon is recomputed here, never taken from the server; users whose ledger cannot afford
it refuse. The perturbation randomness comes from a cryptographically secure generator keyed
by the operating system, never from a seed in the run config: a seed known to the server
would let it undo the perturbation.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..clients import _math_first  # noqa: F401 - before the math package
from ..mechanisms.crypto.ckks import KeyMaterialError, secret_context_path
from ..mechanisms.crypto.identity import IdentityError
from ..mechanisms.protocol import (
    METRICS_KEY,
)
from ..mechanisms.validation import parse_int
from .fedevalfair_handlers import (
    fedevalfair_handlers,
    holder_identity,
    load_secret_context_cached,
    round1_reply,
)
from .fpfl_data import FPFLShard, users_as_fpfl_shard
from .fpfl_handlers import fpfl_handlers
from .fpfl_node import FPFLNodeSettings
from .identity import node_identity
from .ldp import LocalUsers, ldp_audit_handler
from .ledger import node_ledger_dir
from .logging_setup import quiet_known_noise
from .messages import NodeRefusal, fixed_error_texts, int_field
from .policy import PolicyRefusal, node_policy
from .process import freeze_warm_heap
from .project.config import DEFAULT_ADULT_DOWNLOAD_DIR, PIPELINE_SESSIONS, RunConfig
from .project.data import ADULT_DIR_ENV, adult_folder
from .project.evaluation import holder_statistics_for, load_shard_for, received_model
from .project.fpfl_node import node_settings, node_shard
from .project.own_data import (
    DATA_FILE_NODE_KEY,
    check_run_num_groups,
    own_fpfl_shard,
    own_shard,
    read_data_file,
)
from .rates import LocalPredictions, rate_report_handler
from .shards import UserShard

if TYPE_CHECKING:
    import torch

# torch is loaded by the handlers that use a model (``fpfl_round``, ``train``, ``ldp_audit``,
# ``fef_round1``), not by the app's import: a deployed SuperNode starts a process for every
# message, and loading torch took 1.4 s of each here, also for the FPFL setup, keys and
# reveal, the FedEvalFair endorse and later rounds, and ``describe``.


def _partition(context: Context) -> tuple[int, int]:
    node_config = context.node_config
    try:
        # node config text or TOML numbers: parse_int refuses 1.5, which int() truncated
        num_partitions = parse_int("num-partitions", node_config["num-partitions"], minimum=1)
        partition_id = parse_int(
            "partition-id", node_config["partition-id"], minimum=0, maximum=num_partitions - 1
        )
        return partition_id, num_partitions
    except KeyError as error:
        raise ValueError(
            f"node config lacks {error}: start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        ) from None


def own_data_file(context: Context) -> str | None:
    """The node's own data file (node config ``data-file``), or None."""
    value = context.node_config.get(DATA_FILE_NODE_KEY)
    return str(value) if value else None


#: Node config key of the node's own folder for UCI Adult (default
#: :data:`~fedparity.clients.project.config.DEFAULT_ADULT_DOWNLOAD_DIR`): the only folder a node
#: downloads into.
ADULT_DIR_NODE_KEY = "adult-dir"


def node_adult_dir(context: Context) -> Path:
    """The node's own UCI Adult folder: node config ``adult-dir`` (an absolute path), else
    :data:`~fedparity.clients.project.config.DEFAULT_ADULT_DOWNLOAD_DIR`."""
    value = context.node_config.get(ADULT_DIR_NODE_KEY)
    folder = Path(str(value) if value else DEFAULT_ADULT_DOWNLOAD_DIR).expanduser()
    if not folder.is_absolute():
        raise ValueError(
            f"node config {ADULT_DIR_NODE_KEY} must be an absolute path, got {value!r}"
        )
    return folder


def node_data_config(context: Context, config: RunConfig) -> RunConfig:
    """``config`` as this node reads embedded data: with ``dataset = "adult"`` and
    ``download = true`` the UCI files are read from the run config's ``data-dir`` when it
    holds them, else from the node's own folder (:func:`node_adult_dir`), fetched into it
    when missing; the run's ``data-dir`` is never created or written by a node (a server
    could name any folder). The result names the folder found, with ``download = false``."""
    if config.dataset != "adult" or not config.download:
        return config
    folder = adult_folder(
        config.data_dir or os.environ.get(ADULT_DIR_ENV, ""),
        download=True,
        download_dir=node_adult_dir(context),
    )
    return replace(config, data_dir=str(folder), download=False)


def load_shard(context: Context, config: RunConfig, split: str) -> UserShard:
    """This node's users (``split`` = "train" or "test"): from the node's own data file when
    its node config names one (:mod:`fedparity.clients.project.own_data`; never a fallback to
    embedded data), else from the embedded population (:func:`node_data_config`). For
    FedEvalFair the node is a data holder and every row is its own user
    (:func:`fedparity.clients.project.data.adult_holder`).

    A run whose ``num-groups`` is not the node config's (required with ``data-file``) is
    refused before the file is read
    (:func:`~fedparity.clients.project.own_data.check_run_num_groups`): the answer never
    depends on the groups in the file."""
    data_file = own_data_file(context)
    if data_file is not None:
        num_groups = check_run_num_groups(context.node_config, config.num_groups)
        return own_shard(read_data_file(data_file), split, num_groups=num_groups)
    partition_id, num_partitions = _partition(context)
    return load_shard_for(node_data_config(context, config), partition_id, num_partitions, split)


def fpfl_users(context: Context, config: RunConfig) -> FPFLShard:
    """This node's FPFL users: from the node's own data file when its node config names one
    (its ``train`` rows, after the run's ``num-groups`` was checked against the node
    config's, as in :func:`load_shard`; never a fallback to embedded data), else its
    partition of the embedded population."""
    data_file = own_data_file(context)
    if data_file is not None:
        num_groups = check_run_num_groups(context.node_config, config.num_groups)
        return own_fpfl_shard(read_data_file(data_file), num_groups=num_groups)
    if config.task == "pipeline":  # the audited users, on their training rows
        return users_as_fpfl_shard(
            load_shard(context, config, "train"), num_groups=config.num_groups
        )
    partition_id, num_partitions = _partition(context)
    return node_shard(node_data_config(context, config), partition_id, num_partitions)


#: ``fef-missing`` of a describe reply: what a FedEvalFair holder lacks (bits; 0 = ready).
FEF_MISSING_SECRET_CONTEXT = 1
FEF_MISSING_IDENTITY = 2


def fedevalfair_missing(context: Context) -> int:
    """What this node lacks to take part in FedEvalFair, from its own configuration and files
    (never its data): :data:`FEF_MISSING_SECRET_CONTEXT` without a secret context,
    :data:`FEF_MISSING_IDENTITY` without an identity key and roster; 0 when it can hold."""
    missing = 0
    try:
        _node_secret_context_path(context)
    except KeyMaterialError:
        missing |= FEF_MISSING_SECRET_CONTEXT
    try:
        node_identity(context.node_config).require("FedEvalFair")
    except IdentityError:
        missing |= FEF_MISSING_IDENTITY
    return missing


def describe(msg: Message, context: Context, config: RunConfig) -> Message:
    """Reply with the shard's shape (no private content: sizes and feature count) and, for the
    jobs that run FedEvalFair, whether the node has its key material (``fef-missing``,
    :func:`fedevalfair_missing`: so the server can stop before training). On a node with its
    own data file a run whose ``num-groups`` is not the node config's is refused before the
    file is read (:func:`load_shard`, :func:`fpfl_users`)."""
    partition_id, num_partitions = _partition(context)
    if config.task in ("fpfl", "pipeline"):
        users = fpfl_users(context, config)
        sample_shape = [int(size) for size in users.features.shape[1:]]
        num_users = users.num_users
        values: dict[str, int | list[int]] = {
            "num-features": int(np.prod(sample_shape)),
            "num-users": num_users,
            "num-train-samples": users.num_samples,
            "sample-shape": sample_shape,
            "num-classes": users.num_classes,
            "num-groups": users.num_groups,
        }
    else:
        shard = load_shard(context, config, "train")
        num_users = shard.num_users
        values = {
            "num-features": shard.num_features,
            "num-users": num_users,
            "num-train-samples": shard.num_samples,
        }
    if num_users < node_policy(context.node_config).min_users_for_counts:
        # a small node (a device) says how many users it hosts (K needs it), never how many
        # samples they have
        values.pop("num-train-samples")
    metrics = MetricRecord(
        {
            "partition-id": partition_id,
            "num-partitions": num_partitions,
            # 1: the node reads its own file; the simulation harness cannot know its truth.
            "own-data": int(own_data_file(context) is not None),
            **values,
            **(
                {"fef-missing": fedevalfair_missing(context)}
                if config.task in ("fedevalfair", "pipeline")
                else {}
            ),
        }
    )
    return Message(content=RecordDict({METRICS_KEY: metrics}), reply_to=msg)


#: The policy rule a node without ``allow-non-private`` refuses ``train`` with (a fixed sentence).
NON_PRIVATE_TRAINING_RULE = "non-private FedAvg training (train) needs allow-non-private"
#: The refusal of ``train`` when the node's own run config trains no model with FedAvg.
NO_FEDAVG_TRAINING_TEXT = (
    "this node's run config trains no model with FedAvg (task, model-file, num-server-rounds)"
)


def check_fedavg_training(context: Context, config: RunConfig) -> None:
    """Refuse plain FedAvg training unless the node's own policy allows non-private training
    (``allow-non-private``: the simulation policy does, the built-in one does not) and the run
    trains with FedAvg (:attr:`RunConfig.trains_with_fedavg`). Decided from the policy and the
    run config alone, before any data is read, so the refusal says nothing about the data."""
    if not node_policy(context.node_config).allow_non_private:
        raise PolicyRefusal(NON_PRIVATE_TRAINING_RULE)
    if not config.trains_with_fedavg:
        raise NodeRefusal(NO_FEDAVG_TRAINING_TEXT)


def train_handler(msg: Message, context: Context, config: RunConfig) -> Message:
    """Local FedAvg training on the shard (one reply: arrays + num-examples).

    The reply is the model trained on the node's own data, in clear and uncharged: on a
    one-user device one step from zero weights gives back the user's row. So it is refused
    (:func:`check_fedavg_training`) unless the node's policy allows non-private training."""
    from .project.task import get_arrays, train

    check_fedavg_training(context, config)
    shard = load_shard(context, config, "train")
    arrays = msg.content.array_records["arrays"]
    model = received_model(shard, arrays, config)
    train_config: Mapping[str, object] = msg.content.config_records.get("config", {})
    server_round = int_field(train_config, "server-round") if "server-round" in train_config else 0
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


def node_ledger_file(context: Context, config: RunConfig) -> Path | None:
    """The shard's per-user privacy ledger in the node's ledger folder (node config
    ``ledger-dir``; outside simulation ``~/.fedparity/ledgers`` by default), one per partition
    and population; None: a simulated node's run state (survives messages within a run).

    * ``ledger-partition-<i>.json``: the partition's users of the LDP audit, charged by the
      audit, by FedEvalFair's releases in the holder-level DP mode (``fef-dp-epsilon``; without it
      FedEvalFair is no DP release and charges nothing) and by the pipeline's trainings (the same
      users train and are audited), and every job on a node's own data file (one set of users);
    * ``ledger-fpfl-partition-<i>.json``: ``task = "fpfl"`` on the embedded data, whose users
      are other people (Adult dealt into Poisson-sized users, or a synthetic generator of its
      own): charging them to the audit's users would mix two populations.

    The LDP audit charges its users by id (a data file's test users need not be its training
    users: :mod:`fedparity.clients.ledger`); a ledger of an older version, kept by position,
    is named by the first audit's ids, and a ``ledger-partition-<i>.npz`` beside the first is
    migrated."""
    folder = node_ledger_dir(context)
    if folder is None:
        return None
    partition_id, _ = _partition(context)
    if config.task == "fpfl" and own_data_file(context) is None:
        return folder / f"ledger-fpfl-partition-{partition_id}.json"
    return folder / f"ledger-partition-{partition_id}.json"


def ldp_audit(msg: Message, context: Context, config: RunConfig) -> Message:
    """The library's audit handler (:func:`~fedparity.clients.ldp.ldp_audit_handler`) on the
    node's shard: evaluate the received model per user and reply with perturbed pairs only."""

    def shard_users(arrays: ArrayRecord, metric: str, node: Context) -> LocalUsers:
        from .project.task import evaluate_users, metric_values

        shard = load_shard(node, config, "test")
        if not shard.num_users:
            return LocalUsers(np.zeros(0, dtype=np.int64), np.zeros(0))
        model = received_model(shard, arrays, config)
        return LocalUsers(
            shard.user_groups,
            metric_values(evaluate_users(model, shard), metric),
            # the ledger is charged by user id: another split's users are other users
            user_ids=shard.user_ids,
        )

    handler = ldp_audit_handler(
        shard_users,
        num_groups=config.num_groups,
        ledger_path=lambda node: node_ledger_file(node, config),
    )
    return handler(msg, context)


def rate_report(msg: Message, context: Context, config: RunConfig) -> Message:
    """The library's rate-report handler (:func:`~fedparity.clients.rates.rate_report_handler`)
    on the node's shard: each user's rows (one is reported) with the received model's
    predictions; the same ledger as the LDP audit (the same users)."""

    def shard_predictions(arrays: ArrayRecord, node: Context) -> LocalPredictions:
        from .project.task import predict_samples

        shard = load_shard(node, config, "test")
        if not shard.num_users:
            empty = np.zeros(0, dtype=np.int64)
            return LocalPredictions(empty, empty, empty)
        predictions, _ = predict_samples(received_model(shard, arrays, config), shard)
        return LocalPredictions(
            groups=shard.user_groups[shard.user_index],
            labels=shard.labels,
            predictions=predictions.astype(np.int64),
            user_ids=shard.user_ids[shard.user_index],
        )

    handler = rate_report_handler(
        shard_predictions,
        num_groups=config.num_groups,
        ledger_path=lambda node: node_ledger_file(node, config),
    )
    return handler(msg, context)


# --- FedEvalFair (task = "fedevalfair"): three rounds over CKKS ciphertexts ---------------


def _session_settings(config: RunConfig) -> dict[str, FPFLNodeSettings]:
    """The node's FPFL settings per session: the pipeline's fair training (its
    ``fpfl-algorithm``) and its PFL twin, else the run's one training."""
    if config.task != "pipeline":
        return {"": node_settings(config)}
    return {
        session: node_settings(
            config if session == "fpfl" else replace(config, fpfl_algorithm=session)
        )
        for session in PIPELINE_SESSIONS
    }


def _sessions(config: RunConfig) -> tuple[str, ...]:
    """The protocol sessions this node's run config defines: the pipeline's two models, else
    the run's only one."""
    return PIPELINE_SESSIONS if config.task == "pipeline" else ("",)


def _node_secret_context_path(context: Context) -> Path:
    """The key holder's secret context, from node config ``fef-secret-context`` or
    ``$FEDPARITY_SECRET_CONTEXT`` -- never from the server."""
    return secret_context_path(context.node_config, os.environ)


def _fef_handlers(config: RunConfig) -> dict[str, Callable[[Message, Context], Message]]:
    """Endorsement, round 2, commitment and round 3: the library's handlers with the run's
    fef-mu0, fef-tolerance and holder-level DP mode (identity key and roster from the node
    config or ``$FEDPARITY_IDENTITY_DIR``; in the DP mode the users are charged in the ledger
    the node's LDP audits charge, :func:`node_ledger_file`)."""
    return fedevalfair_handlers(
        None,
        secret_context=_node_secret_context_path,
        num_resamples=config.fef_resamples,
        min_cell_count=config.fef_min_cell,
        mu0=config.fef_mu0,
        tolerance=config.fef_tolerance,
        sessions=_sessions(config),
        dp=config.fef_holder_dp,
        ledger_path=lambda node: node_ledger_file(node, config),
        layout=config.fef_layout,
    )


def fef_round1(msg: Message, context: Context, config: RunConfig) -> Message:
    """Bootstrap the run's fef-metrics on the holder's test set (seeded, so the simulation
    harness recomputes the same statistics); reply with one ciphertext signed with the node's
    identity key. The run is checked against the node's policy before the data is read (the
    holder-level DP mode's epsilon and delta, or ``fef-require-dp`` for a run without it, and
    ``fef-min-cell`` against ``fef-min-cell-floor``). In the DP mode (``fef-dp-epsilon``) the
    test rows' users are kept for the charge at the commitment. A holder that can compute no
    metric takes part with weight 0, in every mode (:func:`round1_reply`)."""
    holder_identity(context)
    dp = config.fef_holder_dp
    policy = node_policy(context.node_config)
    policy.check_fef_mode(dp)
    policy.check_fef_min_cell(config.fef_min_cell)
    secret = load_secret_context_cached(_node_secret_context_path(context))
    shard = load_shard(context, config, "test")
    partition_id, _ = _partition(context)
    model = received_model(shard, msg.content.array_records["arrays"], config)
    statistics = holder_statistics_for(config, shard, model, partition_id)
    return round1_reply(
        msg,
        context,
        statistics,
        secret,
        mu0=config.fef_mu0,
        tolerance=config.fef_tolerance,
        sessions=_sessions(config),
        dp=dp,
        user_ids=None if dp is None else shard.user_ids,
    )


def fef_endorse(msg: Message, context: Context, config: RunConfig) -> Message:
    """Verifier: recompute the round-1 sum from the signed ciphertexts and endorse it."""
    return _fef_handlers(config)["fef_endorse"](msg, context)


def fef_round2(msg: Message, context: Context, config: RunConfig) -> Message:
    """Decrypt the endorsed round-1 sum, add this client's stage-1 terms; one signed
    ciphertext back."""
    return _fef_handlers(config)["fef_round2"](msg, context)


def fef_commit(msg: Message, context: Context, config: RunConfig) -> Message:
    """Round-2 holder: sign the one commitment of the run to its round-1 and round-2 sets
    (a key holder releases only a pair of sets every round-2 holder committed to)."""
    return _fef_handlers(config)["fef_commit"](msg, context)


def fef_round3(msg: Message, context: Context, config: RunConfig) -> Message:
    """Key holder: recompute and decrypt both sums, release the aggregate statistics
    (noise-flooded plaintext) over the one pair of sets every round-2 holder committed to."""
    return _fef_handlers(config)["fef_round3"](msg, context)


# --- FPFL (task = "fpfl"): one masked sum per round (Rodriguez-Galvez et al. 2021, Algorithm 1)


@functools.lru_cache(maxsize=8)
def _fpfl_model(
    architecture: str, input_shape: tuple[int, ...], num_classes: int, seed: int
) -> torch.nn.Module:
    """The FPFL model of this process, built once: every round message loads the server's
    weights into all of its parameters before using it (the models have no buffers), and a
    process handles one message at a time, so one instance serves every message (copying it
    per message cost 0.7 ms of every simulated node's round)."""
    from .fpfl_task import build_model_for

    return build_model_for(architecture, input_shape, num_classes=num_classes, seed=seed)


def _fpfl_handler(action: str) -> Callable[[Message, Context, RunConfig], Message]:
    """The library's FPFL handler ``action`` (:func:`~fedparity.clients.fpfl_handlers.
    fpfl_handlers`) on this node's partition of the embedded population, with the project
    app's model (``fpfl-architecture``) and the node settings from the run config."""

    def handle(msg: Message, context: Context, config: RunConfig) -> Message:
        partition_id, _ = _partition(context)

        def users(node: Context) -> FPFLShard:
            return fpfl_users(node, config)

        def make_model() -> torch.nn.Module:
            shard = users(context)
            return _fpfl_model(
                config.fpfl_architecture,
                tuple(shard.features.shape[1:]),
                shard.num_classes,
                config.seed,
            )

        handlers = fpfl_handlers(
            make_model,
            users,
            _session_settings(config),
            stream=lambda _: partition_id,
            ledger_path=lambda node: node_ledger_file(node, config),
            sessions=_sessions(config),
        )
        reply = handlers[action](msg, context)
        if action == "fpfl_round":  # warmed up: data, model, torch and Opacus are loaded
            freeze_warm_heap()
        return reply

    handle.__name__ = action
    handle.__doc__ = f"``query.{action}`` of the library's FPFL handlers on this node's shard."
    return handle


fpfl_setup = _fpfl_handler("fpfl_setup")
fpfl_keys = _fpfl_handler("fpfl_keys")
fpfl_round = _fpfl_handler("fpfl_round")
fpfl_confirm = _fpfl_handler("fpfl_confirm")
fpfl_reveal = _fpfl_handler("fpfl_reveal")


# --- the ClientApp --------------------------------------------------------------------------

#: Message type -> handler(msg, context, config); the one table the ClientApp is built from.
HANDLERS: dict[str, Callable[[Message, Context, RunConfig], Message]] = {
    "query.describe": describe,
    "train": train_handler,
    "query.ldp_audit": ldp_audit,
    "query.rate_report": rate_report,
    "query.fef_round1": fef_round1,
    "query.fef_endorse": fef_endorse,
    "query.fef_round2": fef_round2,
    "query.fef_commit": fef_commit,
    "query.fef_round3": fef_round3,
    "query.fpfl_setup": fpfl_setup,
    "query.fpfl_keys": fpfl_keys,
    "query.fpfl_round": fpfl_round,
    "query.fpfl_confirm": fpfl_confirm,
    "query.fpfl_reveal": fpfl_reveal,
}


def check_run_sizes(context: Context, config: RunConfig) -> None:
    """Refuse a run config whose sizes are beyond the node's policy caps (``max-groups``,
    ``max-users-per-node`` for the embedded data, ``max-resamples`` for the FedEvalFair
    bootstrap, ``fpfl-max-rounds``), before any handler runs: a node never allocates what a
    server-chosen number asks for. Only the sizes the node's task uses are checked."""
    node_policy(context.node_config).check_sizes(
        num_groups=config.num_groups,
        # a node's own data file holds its users; users-per-node sizes the embedded data only
        users_per_node=config.users_per_node if own_data_file(context) is None else None,
        resamples=config.fef_resamples if config.task in ("fedevalfair", "pipeline") else None,
        rounds=config.fpfl_rounds if config.task in ("fpfl", "pipeline") else None,
    )


class _ProjectClientApp(ClientApp):
    """The project's ClientApp, pickled as the arguments of :func:`build_client_app`.

    Flower's Ray backend pickles the ClientApp with every message it hands to an actor. The
    handlers bound to the run config are closures, which cloudpickle copies by value: 2 ms of
    the server process's time per message, 20 ms per exchange with 10 nodes. Rebuilding the
    app from its arguments on the actor takes 0.03 ms."""

    def __init__(
        self,
        overrides: Mapping[str, Any] | None,
        handlers: Mapping[str, Callable[[Message, Context, RunConfig], Message]] | None,
    ) -> None:
        super().__init__()
        self._build_arguments = (
            dict(overrides) if overrides is not None else None,
            dict(handlers) if handlers is not None else None,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return build_client_app, self._build_arguments


def build_client_app(
    overrides: Mapping[str, Any] | None = None,
    handlers: Mapping[str, Callable[[Message, Context, RunConfig], Message]] | None = None,
) -> ClientApp:
    """The ClientApp: every handler gets the run config parsed (and validated) once, and its
    sizes checked against the node's policy caps (:func:`check_run_sizes`) before it runs.

    ``overrides`` are merged over ``context.run_config`` (Flower forbids changing it on a
    node): :mod:`fedparity.server.api` uses them to run a job from Python. ``handlers`` replaces
    entries of :data:`HANDLERS` (tests inject faults this way).
    """
    client_app = _ProjectClientApp(overrides, handlers)
    table = {**HANDLERS, **(handlers or {})}
    extra = dict(overrides or {})

    def bind(handler: Callable[[Message, Context, RunConfig], Message]):  # noqa: ANN202
        def bound(msg: Message, context: Context) -> Message:
            config = RunConfig.from_mapping({**context.run_config, **extra})
            check_run_sizes(context, config)
            return handler(msg, context, config)

        bound.__name__ = handler.__name__
        return fixed_error_texts(bound)

    for message_type, handler in table.items():
        kind, _, action = message_type.partition(".")
        register = getattr(client_app, kind)  # client_app.train / .query / .evaluate
        decorator = register(action) if action else register()
        decorator(bind(handler))
    return client_app


quiet_known_noise()  # Ray's and Flower's known harmless notices (see logging_setup)
app = build_client_app()
