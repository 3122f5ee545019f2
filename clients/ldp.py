"""The LDP gap audit on a node, as a handler for your own Flower ``ClientApp``.

The server's :class:`~fedparity.strategies.ldp_audit.LdpGapAudit` sends the model and the
audit's public parameters (``query.ldp_audit``); the node evaluates the model per local user
with *your* function, perturbs every user's (group, metric) pair with the requested mechanism
and replies with the perturbed pairs only (Juarez and Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
Learning", 2022: mechanisms M_R and M_L; M_P, the Piecewise mechanism of Wang et al., ICDE 2019,
on the value; M_N, NPRR of Waudby-Smith, Wu and Ramdas, ICML 2023, on the value).

Register it on your app::

    from fedparity.clients import LocalUsers, ldp_audit_handler

    def my_users(arrays, metric, context):
        model = load_my_model(arrays)  # your model, your data
        return LocalUsers.from_rows(groups=..., labels=..., predictions=..., metric=metric)

    app.query("ldp_audit")(ldp_audit_handler(my_users, num_groups=2))

Privacy on the node: the mechanism is rebuilt from its public parameters and its *true*
epsilon is recomputed here; an audit above the node's ``ldp-max-epsilon`` is refused, and
users whose ledger cannot afford it refuse. Both limits come from the node's own
:class:`~fedparity.clients.policy.NodePrivacyPolicy`, never from the server; the per-user
budget is stored in the ledger and can only be lowered. The ledger is the node's per-user
privacy ledger (:mod:`fedparity.clients.ledger`), which its FPFL handlers charge too: a
report is charged as a ``GapReportRelease`` and composed with the PLD accountant with every
other release of the user. Outside Flower's simulation engine
the ledger always persists (node config ``ledger-dir``, default ``~/.fedparity/ledgers``); a
custom ``ledger_path`` that keeps none is refused unless the policy opts in
(``allow-ephemeral-ledger``, logged at every audit), and a ledger that existed and is now
missing or damaged stops the node's audits (:class:`~fedparity.mechanisms.privacy.basic_ledger.
LedgerFileError`) until the operator restores it.
The perturbation randomness comes from a cryptographically secure generator keyed by the
operating system (:func:`~fedparity.mechanisms.crypto.secure_random.secure_generator`), never from
a seed the server could know.

Replies that do not depend on the data. Whether a node answers is decided from the request
and its own policy before your function runs: an audit of TPR, FPR or FNR (undefined for a
user without positives, resp. negatives) must carry the undefined category, or every node
refuses it alike (:data:`NO_UNDEFINED_CATEGORY_REFUSAL`); refusing only where some user's
metric is undefined would tell the server a label bit, uncharged and as often as it asks.
With the undefined category such a user reports that category (with the value 0). A metric
that should always be defined (accuracy) but that your function returns as NaN for some user
is replaced by a uniformly random value in [0, 1] for that user, who then reports like
everyone else (the node logs how many at WARNING): the reply never depends on it.

Users by id: give :class:`LocalUsers` the users' ids (``user_ids``, as
:meth:`LocalUsers.from_rows` does) and the ledger charges each audit to those ids, so the users
of one audit need not be those of the last (another test set, a user who joined); without ids
the node's users are charged by position, and the ledger must always hold that many users.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log
from numpy.typing import ArrayLike, NDArray

from ..mechanisms import build_mechanism, metric_to_value
from ..mechanisms.crypto.secure_random import secure_generator
from ..mechanisms.ldp.calibration import GapMechanismType
from ..mechanisms.ldp.laplace import LaplaceMechanism
from ..mechanisms.ldp.metrics import UNDEFINABLE_METRICS, user_rates
from ..mechanisms.ldp.piecewise import PiecewiseMechanism
from ..mechanisms.privacy.basic_ledger import BUDGET_TOLERANCE, LedgerFileError
from ..mechanisms.privacy.user_ledger import GapReportRelease, Release
from ..mechanisms.protocol import METRICS_KEY, REPORTS_KEY
from ..mechanisms.protocol.ldp_audit import CONFIG_KEY, LdpAuditReply, LdpAuditRequest
from ..mechanisms.validation import check_epsilon, check_int
from .ledger import (
    DEFAULT_LEDGER_DIR,
    LEDGER_STATE_KEY,
    default_ledger_path,
    ledger_totals,
    node_ledger_dir,
    open_node_ledger,
    save_node_ledger,
)
from .messages import NodeRefusal, fixed_error_texts
from .policy import NodePrivacyPolicy, PolicyRefusal, in_flower_simulation, node_policy

__all__ = [
    "DEFAULT_LEDGER_DIR",
    "LEDGER_UNUSABLE_REPLY",
    "LEDGER_STATE_KEY",
    "NO_UNDEFINED_CATEGORY_REFUSAL",
    "UNRELEASABLE_REFUSAL",
    "UNRESOLVABLE_REFUSAL",
    "LedgerPathFn",
    "LocalUsers",
    "LocalUsersFn",
    "charge_users",
    "ldp_audit_handler",
    "ledger_unusable_reply",
    "node_ledger_dir",
]


def ledger_unusable_reply(job: str) -> str:
    """What the server reads from a node whose ledger is lost or damaged (the node's log says
    which file and how to recover)."""
    return (
        f"{job}: this node's privacy ledger is lost or damaged; it answers no audit until its "
        "operator restores it (the node's log names the file and the recovery)"
    )


#: :func:`ledger_unusable_reply` of the LDP gap audit.
LEDGER_UNUSABLE_REPLY = ledger_unusable_reply("ldp_audit")


#: The refusal of an M_L or M_P audit whose eps2 its grid sampler cannot release, before any
#: data is read or any user charged (the server's LdpGapAudit refuses to send one).
UNRELEASABLE_REFUSAL = (
    "ldp_audit: refusing: the requested value budget eps2 is outside the range in which its "
    "sampler releases reports"
)

#: The refusal of an M_N audit whose eps1 or eps2 is below the resolution of its 64-bit
#: samplers (no integer probability realises it), before any data is read or any user charged.
UNRESOLVABLE_REFUSAL = (
    "ldp_audit: refusing: a requested budget is below the resolution of the mechanism's "
    "64-bit samplers"
)

#: The refusal of an audit of a metric that can be undefined (TPR, FPR, FNR) without the
#: undefined category: the same for every node, decided before any data is read.
NO_UNDEFINED_CATEGORY_REFUSAL = (
    "ldp_audit: refusing: an audit of TPR, FPR or FNR must carry the undefined category (a "
    "user without positives, resp. negatives, has no such rate)"
)


@dataclass(frozen=True)
class LocalUsers:
    """The node's users for one audit: each user's protected group and metric value, and
    optionally their ids.

    ``metrics`` are in [0, 1], NaN where the metric is undefined for the user (e.g. TPR
    without positives). ``user_ids`` (distinct integers, one per user) key the node's ledger
    by user; None: the users are charged by position (module docstring).
    """

    groups: NDArray[np.int64]
    metrics: NDArray[np.float64]
    user_ids: NDArray[np.int64] | None = None

    def __post_init__(self) -> None:
        groups = np.asarray(self.groups)
        metrics = np.asarray(self.metrics, dtype=np.float64)
        if groups.ndim != 1 or (groups.size and not np.issubdtype(groups.dtype, np.integer)):
            raise ValueError("groups must be a 1-d integer array (one group per user)")
        if metrics.shape != groups.shape:
            raise ValueError(
                f"metrics must have one value per user ({groups.shape}), got {metrics.shape}"
            )
        finite = metrics[np.isfinite(metrics)]
        if np.isinf(metrics).any() or ((finite < 0) | (finite > 1)).any():
            raise ValueError("metrics must be in [0, 1] (NaN where undefined)")
        if self.user_ids is not None:
            ids = np.asarray(self.user_ids)
            if ids.shape != groups.shape or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(
                    f"user_ids must be integers, one per user ({groups.shape}), got "
                    f"{ids.dtype} {ids.shape}"
                )
            if np.unique(ids).size != ids.size:
                raise ValueError("user_ids must be distinct (one id per user)")
            object.__setattr__(self, "user_ids", ids.astype(np.int64))
        object.__setattr__(self, "groups", groups.astype(np.int64))
        object.__setattr__(self, "metrics", metrics)

    @property
    def num_users(self) -> int:
        return int(self.groups.size)

    @classmethod
    def from_rows(
        cls,
        *,
        groups: ArrayLike,
        labels: ArrayLike,
        predictions: ArrayLike,
        metric: str,
        user_ids: ArrayLike | None = None,
    ) -> LocalUsers:
        """Users from prediction rows: each row's protected group, label, prediction and (on a
        node with several users) user id. Without ``user_ids`` every row is the one user's
        (a device with one user, charged by position); with them the users (sorted by id)
        carry their ids. A user's rows must share one group."""
        row_groups = np.asarray(groups)
        ids = np.zeros(row_groups.shape, dtype=np.int64) if user_ids is None else user_ids
        unique, index = np.unique(np.asarray(ids), return_inverse=True)
        index = index.reshape(-1)
        if row_groups.shape != index.shape:
            raise ValueError(f"groups must have one value per row ({index.shape})")
        if row_groups.size == 0:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0))
        if user_ids is not None and not np.issubdtype(unique.dtype, np.integer):
            raise ValueError(f"user_ids must be integers, got {unique.dtype}")
        user_groups = np.zeros(unique.size, dtype=row_groups.dtype)
        user_groups[index] = row_groups
        if (user_groups[index] != row_groups).any():
            raise ValueError("a user's rows must all have the same protected group")
        rates = user_rates(index, labels, predictions, int(unique.size))
        return cls(
            user_groups.astype(np.int64),
            rates.metric(metric),
            None if user_ids is None else unique.astype(np.int64),
        )


#: ``local_users(arrays, metric, context)``: the node's users evaluated on the received model.
LocalUsersFn = Callable[[ArrayRecord, str, Context], LocalUsers]
#: ``ledger_path(context)``: where this node keeps its persistent ledger (None: run state).
LedgerPathFn = Callable[[Context], "Path | None"]


def ldp_audit_handler(
    local_users: LocalUsersFn,
    *,
    num_groups: int,
    policy: NodePrivacyPolicy | None = None,
    ledger_path: LedgerPathFn = default_ledger_path,
) -> Callable[[Message, Context], Message]:
    """A ``query.ldp_audit`` handler around your evaluation function.

    Parameters
    ----------
    local_users : callable
        ``local_users(arrays, metric, context) -> LocalUsers``: for the received model
        (``arrays``, the audit's ArrayRecord) each local user's group and value of ``metric``
        (``"accuracy"``, ``"tpr"``, ``"fpr"`` or ``"fnr"``).
    num_groups : int
        Protected groups on this node; an audit for another number is refused.
    policy : NodePrivacyPolicy, optional
        The node's privacy policy (``ldp-max-epsilon`` per audit, ``user-epsilon-budget``
        at ``user-delta`` per user, ``min-users-for-counts``). Default: read for each audit
        from the node's own config or environment
        (:func:`~fedparity.clients.policy.node_policy`).
    ledger_path : callable, optional
        Where the node's ledger persists across runs (default: ``user-ledger.json`` in
        :func:`~fedparity.clients.ledger.node_ledger_dir`); pass the same to the node's
        FPFL handlers so that both charge one ledger.
    """
    num_groups = check_int("num_groups", num_groups, minimum=2)
    if policy is not None and not isinstance(policy, NodePrivacyPolicy):
        raise TypeError(f"policy must be a NodePrivacyPolicy, got {type(policy).__name__}")

    def handle(msg: Message, context: Context) -> Message:
        request = LdpAuditRequest.from_fields(msg.content.config_records.get(CONFIG_KEY, {}))
        mechanism = _requested_mechanism(request, num_groups)
        limits = policy if policy is not None else node_policy(context.node_config)
        limits.check_ldp(mechanism.epsilon)
        if mechanism.epsilon > request.budget + BUDGET_TOLERANCE:
            raise NodeRefusal(
                "ldp_audit: the requested mechanism's true epsilon exceeds the audit budget; "
                "refusing"
            )
        users = local_users(msg.content.array_records["arrays"], request.metric, context)
        if not isinstance(users, LocalUsers):
            raise TypeError(f"local_users must return LocalUsers, got {type(users).__name__}")
        if users.num_users and (users.groups.min() < 0 or users.groups.max() >= num_groups):
            raise ValueError(f"a user's group is outside [0, {num_groups})")
        selected = None
        if request.sequential_batch is not None:
            selected, sizes = _sequential_users(request, users, limits, context)
            if selected is None:  # batch 0: the node's number of users only
                empty = np.zeros(0, dtype=np.int64)
                reply = LdpAuditReply(empty, np.zeros(0), sizes)
            else:
                reply = _perturbed_reply(
                    request, mechanism, users, num_groups, limits, ledger_path, context, selected
                )
                reply = LdpAuditReply(reply.groups, reply.values, {**reply.counts, **sizes})
        else:
            reply = _perturbed_reply(
                request, mechanism, users, num_groups, limits, ledger_path, context
            )
        content = RecordDict(
            {
                REPORTS_KEY: ArrayRecord(
                    {name: Array(array) for name, array in reply.to_fields()[REPORTS_KEY].items()}
                ),
                METRICS_KEY: MetricRecord(dict(reply.counts)),
            }
        )
        return Message(content=content, reply_to=msg)

    return fixed_error_texts(handle)  # what reaches the server is a fixed sentence


def _requested_mechanism(request: LdpAuditRequest, num_groups: int) -> GapMechanismType:
    """The mechanism of ``request``, rebuilt from its public parameters (its true epsilon
    recomputed here); refused, before any data is read, when the request breaks the audit's
    rules for this node."""
    if request.metric in UNDEFINABLE_METRICS and not request.undefined_category:
        # Refusing only where some user's metric is undefined would be a label bit
        # (uncharged, repeatable): every node refuses this request alike, before its data.
        raise NodeRefusal(NO_UNDEFINED_CATEGORY_REFUSAL)
    # With the undefined category (TPR, FPR, FNR), the mechanism has one more category than
    # the node has groups: users whose metric is undefined report it.
    categories = num_groups + int(request.undefined_category)
    if request.num_groups != categories:
        raise NodeRefusal(
            "ldp_audit: the audit's number of group categories is not this node's number "
            "of groups (plus the undefined category, if the audit has one); refusing"
        )
    if request.mechanism == "N":
        # its parameters are checked first (a bad one is a ValueError, as for the others);
        # then its oracles find no integer probability for a budget below their resolution
        check_epsilon("epsilon_group", request.epsilon_group)
        check_epsilon("epsilon_value", request.epsilon_value)
        try:
            return build_mechanism(
                "N", request.epsilon_group, request.epsilon_value, categories, request.grid_size
            )
        except ValueError:
            raise NodeRefusal(UNRESOLVABLE_REFUSAL) from None
    mechanism = build_mechanism(
        request.mechanism, request.epsilon_group, request.epsilon_value, categories
    )
    if isinstance(mechanism, LaplaceMechanism | PiecewiseMechanism):
        try:
            mechanism.check_releasable()
        except ValueError:
            raise NodeRefusal(UNRELEASABLE_REFUSAL) from None
    return mechanism


#: Node run-state record (prefix; the audit id follows) of the users a sequential audit asked.
ASKED_STATE_PREFIX = "ldp-sequential-asked/"
#: What a node with fewer than its policy's min-users-for-counts users answers a sequential
#: audit (which needs each node's number of users; a fixed sentence).
SEQUENTIAL_TOO_FEW_USERS = (
    "ldp_audit: a sequential audit tells the server this node's number of users, and this "
    "node has fewer than its policy's min-users-for-counts; refusing"
)


def _sequential_users(
    request: LdpAuditRequest,
    users: LocalUsers,
    limits: NodePrivacyPolicy,
    context: Context,
) -> tuple[NDArray[np.bool_] | None, dict[str, int | float]]:
    """A sequential audit's batch on this node: (which users to ask now, the sizes to send).

    The node draws ``request.sequential_batch`` of its users not asked before in this audit
    (``audit-id``), uniformly at random with its own secure generator (the server names a
    number, never a user), and records them in its run state before anything is computed: a
    user is asked at most once per audit, whatever the server sends. Batch 0 asks nobody (the
    server's first message: how many users the node has, sent only by a node with at least
    its ``min-users-for-counts`` users)."""
    if users.num_users < limits.min_users_for_counts:
        raise NodeRefusal(SEQUENTIAL_TOO_FEW_USERS)
    ids = users.user_ids if users.user_ids is not None else np.arange(users.num_users)
    key = ASKED_STATE_PREFIX + request.audit_id
    record = context.state.array_records.get(key)
    asked = np.zeros(0, dtype=np.int64) if record is None else record["asked"].numpy()
    unasked = ids[~np.isin(ids, asked)]
    wanted = int(request.sequential_batch or 0)
    if wanted == 0:
        return None, {"num-users": users.num_users, "num-unasked": int(unasked.size)}
    chosen = secure_generator().choice(unasked, size=min(wanted, unasked.size), replace=False)
    context.state.array_records[key] = ArrayRecord(
        {"asked": Array(np.concatenate([asked, chosen]).astype(np.int64))}
    )
    sizes: dict[str, int | float] = {
        "num-users": users.num_users,
        "num-unasked": int(unasked.size - chosen.size),
        "num-asked": int(chosen.size),
    }
    return np.isin(ids, chosen), sizes


def _perturbed_reply(
    request: LdpAuditRequest,
    mechanism: GapMechanismType,
    users: LocalUsers,
    num_groups: int,
    limits: NodePrivacyPolicy,
    ledger_path: LedgerPathFn,
    context: Context,
    selected: NDArray[np.bool_] | None = None,
) -> LdpAuditReply:
    """Charge the answering users' ledger (saved before anything is released), perturb their
    pairs with a generator keyed by the OS, and count. ``selected``: only these users are
    asked (a sequential audit's batch); the others are neither charged nor reported."""
    metric, undefined_category = request.metric, request.undefined_category
    defined = np.isfinite(users.metrics)
    rng = secure_generator()  # AES-CTR keyed by the OS: never a server-known seed
    metrics = users.metrics
    if not undefined_category and not defined.all():
        # Only a metric that should always be defined gets here (the undefinable ones
        # need the undefined category): those users report a uniformly random value, so
        # that whether and how the node answers never depends on their data.
        missing = ~defined
        log(
            logging.WARNING,
            "ldp_audit: the metric %s is undefined (NaN) for %d user(s); they report a "
            "uniformly random value in [0, 1] instead",
            metric,
            int(missing.sum()),
        )
        metrics = np.where(missing, rng.uniform(0.0, 1.0, size=metrics.shape), metrics)
        defined = np.ones_like(defined)
    groups = np.zeros(0, dtype=np.int64)
    values: np.ndarray = np.zeros(0, dtype=np.int8 if mechanism.name == "R" else np.float64)
    refused = 0
    totals: dict[str, float] = {}
    if users.num_users:
        release = GapReportRelease.from_mechanism(
            mechanism, job="ldp_audit", label=f"audit of {metric}"
        )
        answering, totals = charge_users(
            context,
            ledger_path(context),
            limits,
            release,
            users.num_users,
            users.user_ids,
            selected=selected,
        )
        refused = (
            int((~answering).sum()) if selected is None else int((selected & ~answering).sum())
        )
        # an undefined metric is the undefined category with the value 0 (m = 1/2)
        user_groups = np.where(defined, users.groups, num_groups)
        user_values = np.where(defined, metric_to_value(np.nan_to_num(metrics)), 0.0)
        reports = mechanism.perturb(user_groups[answering], user_values[answering], rng)
        groups, values = reports.groups, reports.values
    if refused:
        log(logging.INFO, "ldp_audit: %d user(s) refused (privacy budget)", refused)
    counts: dict[str, int | float] = {"epsilon-charged": float(mechanism.epsilon)}
    if users.num_users >= limits.min_users_for_counts:
        # Below the policy's minimum these counts (e.g. "TPR undefined" on a one-user
        # device, a label bit) would leave the node outside the LDP guarantee.
        # The ledger's totals over every release it recorded (this audit included): the
        # server can report the users' whole spending, not only its own run's.
        counts.update({"num-reports": int(groups.size), "num-refused": refused, **totals})
    return LdpAuditReply(groups, values, counts)


def charge_users(
    context: Context,
    path: Path | None,
    limits: NodePrivacyPolicy,
    release: Release,
    num_users: int,
    user_ids: NDArray[np.int64] | None,
    *,
    selected: NDArray[np.bool_] | None = None,
) -> tuple[NDArray[np.bool_], dict[str, float]]:
    """Charge ``release`` to the users who can afford it in the node's ledger at ``path`` and
    save it (atomically) before anything is released; (who answers, the ledger's totals).
    ``selected``: only these users are asked (the others are not charged and do not answer).

    Users by id leave the ledger's other users (e.g. of another split) untouched; without ids
    the ledger holds exactly these users, by position. Refused without a persistent ledger
    unless the policy allows it, and with a fixed sentence when its file is lost, damaged or
    cannot be written (the node's log names the file)."""
    job = release.job
    if path is None:
        if not limits.allow_ephemeral_ledger:
            raise PolicyRefusal(
                "a persistent privacy ledger is required (ledger-dir, or allow-ephemeral-ledger)"
            )
        log(
            # simulated users in Flower's simulation engine: not worth a warning
            logging.DEBUG if in_flower_simulation() else logging.WARNING,
            "%s: this node's ledger lives only as long as the run "
            "(allow-ephemeral-ledger, policy: %s): its users' spending is forgotten after it",
            job,
            limits.source,
        )
    try:
        ledger = open_node_ledger(context, path, limits, num_users, user_ids=user_ids)
        asked = np.ones(num_users, dtype=bool) if selected is None else np.asarray(selected)
        if user_ids is None:  # by position: every asked user reports, or refuses
            answering = ledger.can_afford(release) & asked
            ledger.charge(release, answering)
        else:
            answering = np.zeros(num_users, dtype=bool)
            answering[asked] = ledger.can_afford(release, user_ids=user_ids[asked])
            ledger.charge(release, user_ids=user_ids[answering])
        save_node_ledger(context, path, ledger)
    except LedgerFileError as error:
        # The detail names the node's files (e.g. a folder that became unwritable): it stays
        # in the node's log.
        log(logging.ERROR, "%s: %s", job, error)
        raise NodeRefusal(ledger_unusable_reply(job)) from None
    return answering, ledger_totals(ledger, path)
