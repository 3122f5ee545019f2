"""Run orchestration shared by the jobs: wait for nodes, learn their shapes, train, output dir.

Every job (LDP audit, FedEvalFair, FPFL) starts the same way: wait until enough nodes are
connected, ask each for its (public) shard shape with a ``query.describe`` message, build the
model, and, for the jobs that evaluate a global model (LDP audit, FedEvalFair), either load the
one the server's operator supplies (``model-file``: no node trains, nothing is released) or
train it with plain FedAvg (:class:`~fedparity.strategies.robust_fedavg.RobustFedAvg`). FedAvg's
updates are not private, so a node answers ``train`` only when its own policy allows
non-private training; when the nodes refuse it, the job stops (:class:`TrainingRefused`)
rather than evaluate an untrained model.
"""

from __future__ import annotations

import logging
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..clients.logging_setup import quiet_strategy_banner
from ..clients.project.config import ConfigError, RunConfig
from ..clients.project.task import build_model, get_arrays
from ..mechanisms.protocol import METRICS_KEY
from ..strategies.replies import send_and_receive
from ..strategies.robust_fedavg import RobustFedAvg
from .progress import Progress

DESCRIBE_MESSAGE_TYPE = "query.describe"


class NodeDescriptions:
    """What the nodes said about their shards (public sizes only)."""

    def __init__(self) -> None:
        self.num_features: int | None = None
        self.num_users = 0
        self.partitions: list[tuple[int, int]] = []
        self.failed: list[tuple[int, str | None]] = []  # reason None: Flower gave none
        self.users_by_node: dict[int, int] = {}
        #: Nodes that read their own data file (the simulation harness cannot know their truth).
        self.own_data: list[int] = []
        #: FPFL nodes also report their sample shape, classes and groups (public metadata).
        self.sample_shape: tuple[int, ...] | None = None
        self.num_classes: int | None = None
        self.num_groups: int | None = None
        #: Nodes that said what they lack to hold in FedEvalFair (``fef-missing`` bits, non-zero
        #: only: a secret context, an identity); nodes that did not say are not listed.
        self.fedevalfair_missing: dict[int, int] = {}


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


def _loss(metrics: MetricRecord) -> float:
    """The round's ``train-loss`` (nan when absent)."""
    loss = metrics.get("train-loss", float("nan"))
    if isinstance(loss, list):
        raise TypeError(f"train-loss must be a number, got {loss!r}")
    return float(loss)


def _metric_int(metrics: MetricRecord, key: str) -> int:
    """``metrics[key]`` as an int (KeyError when absent, TypeError when a list)."""
    value = metrics[key]
    if isinstance(value, list):
        raise TypeError(f"{key} must be a number, got {value!r}")
    return int(value)


def describe_nodes(grid: Grid, node_ids: list[int], timeout: float) -> NodeDescriptions:
    """Ask every node for its feature count, user count and partition (no private data)."""
    messages = [
        Message(content=RecordDict({}), dst_node_id=node, message_type=DESCRIBE_MESSAGE_TYPE)
        for node in node_ids
    ]
    found = NodeDescriptions()
    for reply in send_and_receive(grid, messages, timeout):
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            found.failed.append((node, reply.error.reason))
            continue
        metrics = reply.content.metric_records.get(METRICS_KEY, MetricRecord())
        try:
            num_features = _metric_int(metrics, "num-features")
            num_users = _metric_int(metrics, "num-users")
            partition = (
                _metric_int(metrics, "partition-id"),
                _metric_int(metrics, "num-partitions"),
            )
            sizes = metrics.get("sample-shape")
            if sizes is not None and not isinstance(sizes, list):
                raise TypeError(f"sample-shape must be a list, got {sizes!r}")
            shape = tuple(int(size) for size in sizes) if sizes is not None else None
            classes = _metric_int(metrics, "num-classes") if "num-classes" in metrics else None
            groups = _metric_int(metrics, "num-groups") if "num-groups" in metrics else None
            own_data = _metric_int(metrics, "own-data") if "own-data" in metrics else 0
        except (KeyError, TypeError, ValueError) as error:
            found.failed.append((node, f"malformed describe reply: {error!r}"))
            continue
        if found.num_features is None:
            found.num_features = num_features
            found.sample_shape = shape
            found.num_classes = classes
            found.num_groups = groups
        elif found.num_features != num_features or found.sample_shape != shape:
            reason = f"{num_features} features, the others have {found.num_features}"
            found.failed.append((node, reason))
            continue
        found.num_users += num_users
        found.users_by_node[node] = num_users
        if own_data:
            found.own_data.append(node)
        missing = metrics.get("fef-missing")
        if isinstance(missing, int) and missing:
            found.fedevalfair_missing[node] = missing
        found.partitions.append(partition)
    return found


class JobCannotStart(RuntimeError):
    """The job cannot do its work with the federation it found (e.g. FedEvalFair holders
    without their keys): raised before any training or release, one line saying what to do."""


#: What each ``fef-missing`` bit means, and how a simulation's operator fixes it.
FEDEVALFAIR_MATERIAL = {
    1: ("a secret context", "fedparity keys"),
    2: ("an identity key and roster", "fedparity identity --nodes {nodes}"),
}


def require_fedevalfair_holders(nodes: NodeDescriptions, node_ids: Sequence[int]) -> None:
    """Refuse to start (:class:`JobCannotStart`) when fewer than two of the described nodes
    can hold in FedEvalFair; warn when some cannot. Decided from the nodes' ``fef-missing``
    (their configuration, never their data), before the model is trained."""
    lacking = {node: bits for node, bits in nodes.fedevalfair_missing.items() if node in node_ids}
    if not lacking:
        return
    ready = len(node_ids) - len(lacking)
    what = "; ".join(
        f"{sum(1 for bits in lacking.values() if bits & bit)} without {name}"
        for bit, (name, _) in FEDEVALFAIR_MATERIAL.items()
        if any(bits & bit for bits in lacking.values())
    )
    if ready >= 2:
        log(
            logging.WARNING,
            "FedEvalFair: %d of %d nodes cannot hold (%s); the test runs with the other %d",
            len(lacking),
            len(node_ids),
            what,
            ready,
        )
        return
    commands = " and ".join(
        command.format(nodes=len(node_ids))
        for bit, (_, command) in FEDEVALFAIR_MATERIAL.items()
        if any(bits & bit for bits in lacking.values())
    )
    raise JobCannotStart(
        f"FedEvalFair needs at least 2 holders with their keys, and {ready} of {len(node_ids)} "
        f"nodes have them ({what}): in a simulation run {commands} on this machine (the nodes "
        "read ~/.fedparity/keys and ~/.fedparity/identity), on real nodes set their node config "
        "keys fef-secret-context, identity-key and roster; then start the run again"
    )


def connect_nodes(
    grid: Grid, config: RunConfig, minimum: int = 1
) -> tuple[list[int], NodeDescriptions]:
    """Wait for the nodes and describe them, so that a job starts with the whole federation.

    Nodes register one by one (in simulation too), so waiting for ``min-nodes`` alone would
    start a job with whichever nodes happen to be up. Every node reports ``num-partitions``,
    the size of the federation it belongs to: when fewer nodes than that have described
    themselves, wait (up to ``node-wait-timeout`` in all) for the rest, then describe again.
    After the timeout the job goes on with the nodes present and says so.

    A node's first message starts its ClientApp (imports; in a deployment a new process),
    which on a loaded machine can outlast a short ``reply-timeout``: while no node has
    described itself and some have not answered at all, they are asked again until
    ``node-wait-timeout``. Nodes that all answer with an error are not asked again.
    """
    deadline = time.monotonic() + config.node_wait_timeout
    node_ids = wait_for_nodes(grid, max(config.min_nodes, minimum), config.node_wait_timeout)
    nodes = describe_nodes(grid, node_ids, config.reply_timeout)
    while (
        nodes.num_features is None
        and len(nodes.failed) < len(node_ids)
        and time.monotonic() < deadline
    ):
        log(
            logging.INFO,
            "no node described its data within reply-timeout = %g s (a ClientApp starts with "
            "its first message); asking again, up to node-wait-timeout = %g s in all",
            config.reply_timeout,
            config.node_wait_timeout,
        )
        node_ids = sorted(grid.get_node_ids())
        nodes = describe_nodes(grid, node_ids, config.reply_timeout)
    expected = max((count for _, count in nodes.partitions), default=0)
    while len(nodes.partitions) < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log(
                logging.WARNING,
                "only %d of %d node(s) described their data within node-wait-timeout = %g s; "
                "going on with them",
                len(nodes.partitions),
                expected,
                config.node_wait_timeout,
            )
            break
        try:
            node_ids = wait_for_nodes(grid, expected, remaining)
        except RuntimeError:
            node_ids = sorted(grid.get_node_ids())
        nodes = describe_nodes(grid, node_ids, config.reply_timeout)
        if len(node_ids) >= expected and len(nodes.partitions) < expected:
            break  # every node is connected; the ones that failed are in nodes.failed
    if nodes.num_features is None:
        raise RuntimeError(f"no node described its data: {nodes.failed}")
    return node_ids, nodes


#: The policy key a node names when it refuses non-private training (its refusal is a fixed
#: sentence ending with it: ``fedparity.clients.app.NON_PRIVATE_TRAINING_RULE``).
NON_PRIVATE_POLICY_KEY = "allow-non-private"


class TrainingRefused(RuntimeError):
    """The nodes refused the FedAvg training by their privacy policy: the job stops rather than
    evaluate the untrained initial model. The text says how to proceed."""


def refused_training_text(refused: int, asked: int) -> str:
    """What the run's status and log say when no node trained the model because ``refused``
    of the ``asked`` nodes refused non-private training."""
    return (
        f"no node trained the model: {refused} of {asked} node(s) refused non-private training "
        "(plain FedAvg sends model updates in clear, uncharged to the users' privacy ledgers; "
        f"their privacy policy lacks {NON_PRIVATE_POLICY_KEY}), so the job stopped before "
        "evaluating an untrained model. To proceed: supply the model to evaluate with "
        "model-file (an absolute path to a .npz of its arrays on the server), or use "
        'task = "pipeline", which trains with user-level DP through the secure sum and charges '
        f"each user's ledger, or set {NON_PRIVATE_POLICY_KEY} = true in the privacy policy of "
        "the nodes whose users agreed to non-private training"
    )


class _FedAvgWithProgress(RobustFedAvg):
    """:class:`RobustFedAvg` that counts each aggregated round on :attr:`progress`, and stops
    the training (:class:`TrainingRefused`) at the first round, while no model has been
    aggregated yet, in which every node that replied refused non-private training."""

    progress: Progress | None = None
    _trained = False

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        aggregated = super().aggregate_train(server_round, replies)
        if aggregated[0] is not None:
            self._trained = True
        elif not self._trained:
            rejected = self.rejected.get(server_round, [])
            refused = [r for r in rejected if NON_PRIVATE_POLICY_KEY in r.reason]
            if refused and len(refused) == len(rejected):
                raise TrainingRefused(refused_training_text(len(refused), len(self._sent)))
        if self.progress is not None:
            self.progress.advance()
        return aggregated


def supplied_model(config: RunConfig) -> list[np.ndarray] | None:
    """The model the server's operator supplies (``model-file``), read and checked before any
    work: its arrays in the order of :func:`~fedparity.clients.project.task.get_arrays` (a ``.npz``
    written by ``np.savez(path, *arrays)``, or with the model's ``state_dict`` names as keys),
    finite numbers. None when ``model-file`` is empty (train with FedAvg). The shapes are
    checked against the nodes' feature count by :func:`train_global_model`.

    Raises
    ------
    ConfigError
        Naming ``model-file``, for a missing, unreadable or malformed file.
    """
    if not config.model_file:
        return None
    path = Path(config.model_file)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: np.asarray(archive[name]) for name in archive.files}
    except FileNotFoundError:
        raise ConfigError(f"model-file {path}: no such file (the server reads it)") from None
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise ConfigError(
            f"model-file {path}: not a .npz of the model's arrays ({error})"
        ) from None
    names = list(arrays)
    positional = [f"arr_{index}" for index in range(len(names))]
    if sorted(names) == sorted(positional):
        names = positional  # np.savez(path, *arrays): arr_0, arr_1, ... in order
    elif names != _state_dict_names():
        raise ConfigError(
            f"model-file {path}: holds arrays {', '.join(arrays) or 'none'}; expected the model's "
            f"arrays in get_arrays order, saved with np.savez(path, *arrays) (arr_0, arr_1, ...) "
            f"or with the names {', '.join(_state_dict_names())}"
        )
    ordered = [arrays[name] for name in names]
    for name, array in zip(names, ordered, strict=True):
        numeric = np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
        if not numeric or not np.isfinite(array).all():
            raise ConfigError(f"model-file {path}: array {name} must hold finite numbers")
    return ordered


def _state_dict_names() -> list[str]:
    """The ``state_dict`` names of the jobs' model (a logistic regression)."""
    return list(build_model(1).state_dict())


def _checked_model(
    config: RunConfig, arrays: Sequence[np.ndarray], num_features: int
) -> ArrayRecord:
    """The supplied arrays as the model for ``num_features`` features (``ConfigError`` naming
    ``model-file`` and the shapes when they differ)."""
    expected = [np.asarray(array) for array in get_arrays(build_model(num_features))]
    shapes = [tuple(array.shape) for array in arrays]
    wanted = [tuple(array.shape) for array in expected]
    if shapes != wanted:
        raise ConfigError(
            f"model-file {config.model_file}: arrays of shapes {shapes}; the nodes' data has "
            f"{num_features} features, so the model's arrays have shapes {wanted}"
        )
    return ArrayRecord(
        [np.asarray(a, dtype=e.dtype) for a, e in zip(arrays, expected, strict=True)]
    )


def train_global_model(
    grid: Grid,
    config: RunConfig,
    num_features: int,
    supplied: Sequence[np.ndarray] | None = None,
) -> tuple[ArrayRecord, dict[int, float], RobustFedAvg]:
    """The global model: the ``supplied`` one (from :func:`supplied_model`; no FedAvg round,
    no message) when the run config names ``model-file``, else ``num-server-rounds`` rounds of
    FedAvg from a seeded initial model.

    Raises
    ------
    TrainingRefused
        When, before any round produced a model, every node that replied to a round refused
        non-private training by its policy.
    """
    strategy = _FedAvgWithProgress(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
    if config.model_file:
        given = supplied if supplied is not None else supplied_model(config)
        assert given is not None  # supplied_model returns None only without a model-file
        log(
            logging.INFO,
            "model-file: evaluating the supplied model %s (no FedAvg round)",
            config.model_file,
        )
        return _checked_model(config, given, num_features), {}, strategy
    arrays = ArrayRecord(get_arrays(build_model(num_features, seed=config.seed)))
    losses: dict[int, float] = {}
    if config.num_server_rounds:
        strategy.progress = Progress(
            f"{config.task} training",
            config.num_server_rounds,
            units="rounds",
            log=lambda line: log(logging.INFO, "%s", line),
        )
        with quiet_strategy_banner(), strategy.progress:
            result = strategy.start(
                grid=grid,
                initial_arrays=arrays,
                num_rounds=config.num_server_rounds,
                timeout=config.reply_timeout,
                train_config=ConfigRecord({"learning-rate": config.learning_rate}),
            )
        # Flower's Result holds arrays only from a round that aggregated: when no round had a
        # valid reply, the model is the initial one (not an empty record).
        if len(result.arrays):
            arrays = result.arrays
        losses = {
            int(rnd): _loss(metrics) for rnd, metrics in result.train_metrics_clientapp.items()
        }
    return arrays, losses, strategy


@dataclass(frozen=True)
class TrainedFederation:
    """What :func:`connect_and_train` gives a job: the nodes, their descriptions, the global
    model and how its training went."""

    node_ids: list[int]
    nodes: NodeDescriptions
    arrays: ArrayRecord
    train_losses: dict[int, float]
    strategy: RobustFedAvg


def connect_and_train(grid: Grid, config: RunConfig) -> TrainedFederation:
    """The start of the jobs that evaluate a FedAvg model (LDP audit, rate report): the
    supplied model read and checked before any work, the nodes connected and described (one
    console line), then the global model (:func:`train_global_model`)."""
    supplied = supplied_model(config)  # model-file: read and checked before any work
    node_ids, nodes = connect_nodes(grid, config, minimum=1)
    log(
        logging.INFO,
        "fedparity: %d node(s), %d user(s), %d features; dataset %s",
        len(node_ids),
        nodes.num_users,
        nodes.num_features,
        config.dataset,
    )
    arrays, train_losses, strategy = train_global_model(
        grid,
        config,
        int(nodes.num_features),  # type: ignore[arg-type]
        supplied,
    )
    return TrainedFederation(node_ids, nodes, arrays, train_losses, strategy)


def training_report(config: RunConfig, losses: dict[int, float], strategy: RobustFedAvg) -> dict:
    """The ``training`` section of results.json (``model_file``: the supplied model, which no
    round trained)."""
    return {
        "rounds": 0 if config.model_file else config.num_server_rounds,
        "model_file": config.model_file or None,
        "train_loss": losses,
        "rejected_replies": {
            rnd: [{"node_id": r.node_id, "reason": r.reason} for r in items]
            for rnd, items in strategy.rejected.items()
        },
        "missing_nodes": {rnd: nodes for rnd, nodes in strategy.missing.items() if nodes},
    }


def harness_applies(config: RunConfig, nodes: NodeDescriptions) -> bool:
    """Whether the simulation harness may show the true values: ``ground-truth`` is on and no
    node reads its own data file (the harness only knows the embedded populations)."""
    if not config.ground_truth:
        return False
    if nodes.own_data:
        log(
            logging.INFO,
            "harness skipped: node(s) %s read their own data file (ground-truth needs the "
            "embedded populations)",
            ", ".join(map(str, sorted(nodes.own_data))),
        )
        return False
    return True
