"""The node's per-user privacy ledger, shared by its LDP audit and FPFL handlers.

One :class:`~fedparity.mechanisms.privacy.user_ledger.UserLedger` per node holds every DP release
each of the node's users took part in (LDP gap reports, FPFL trainings) and composes them
with the PLD accountant (basic composition beside it), under replace-one-user. Each user's
budget and delta come from the node's own policy (``user-epsilon-budget`` at ``user-delta``,
:mod:`fedparity.clients.policy`), never from the server; the ledger keeps the smallest ever
asked, so a later policy only lowers them.

Where it lives: a file in the node's ledger folder (node config ``ledger-dir``; outside
Flower's simulation engine ``~/.fedparity/ledgers`` by default), or, for a simulated node
without a ledger folder, the node's run state (it lasts as long as the run). A file that is
lost, damaged or foreign stops the node's releases until its operator restores it
(:class:`~fedparity.mechanisms.privacy.basic_ledger.LedgerFileError`).

Never a new ledger silently: outside simulation each ledger file a node creates is recorded in a
registry kept apart from the ledger folder (:func:`node_ledger_registry`: node config
``ledger-registry``, else ``~/.fedparity/ledger-registry.json``), because a deleted folder takes
the ``.created`` marker with it and a changed ``ledger-dir`` has none. A registered ledger that
is gone, or (with the node's own registry) a new ledger while it holds one elsewhere, is
refused from files and config alone, before any data is read; ``fedparity ledger reset`` is the
operator's acknowledgement. A new ledger is logged (with the reset, or the others held).

Users by id: a handler that knows its users' ids passes them
(``open_node_ledger(..., user_ids=ids)``) and charges them by id
(``ledger.charge(release, user_ids=ids)``): the users of one release need not be those of the
last (a data file whose ``split`` column gives the test and the training rows to different
users), an id the ledger has not seen starts at zero, users not in a release are untouched.
A caller that passes only a user count gets the ledger as before ids: its users by position,
and it must hold exactly that many (a keyed ledger of that many users in id order).

A ledger of an older fedparity holds its users by position (the ``i``-th smallest id of the
node's users at the time): the first handler that opens it with ids names them, position ``i``
becoming the ``i``-th smallest of those ids (logged once); a ledger by position with another
number of users than the handler's ids cannot be named and stops the node's releases, as a
ledger of another user count always did.

A basic-composition LDP ledger of older fedparity versions (``ShardLedger``'s ``.npz``) found
where the new ledger is expected is migrated once: each user's spent epsilon becomes one pure
``ApproximateDPRelease(epsilon=spent, delta=0)`` of that user, the old file is kept as
``<name>.migrated``.
"""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context
from flwr.common import log
from numpy.typing import ArrayLike

from ..mechanisms.privacy.basic_ledger import ShardLedger, ledger_marker
from ..mechanisms.privacy.user_ledger import (
    DEFAULT_LEDGER_REGISTRY,
    LedgerRegistry,
    UserLedger,
    check_ledger_writable,
)
from ..mechanisms.protocol import (
    EPSILON_SPENT_BASIC_DELTA_KEY,
    EPSILON_SPENT_BASIC_KEY,
    EPSILON_SPENT_DELTA_KEY,
    EPSILON_SPENT_KEY,
    LEDGER_NEW_KEY,
)
from .policy import NodePrivacyPolicy, in_flower_simulation

__all__ = [
    "DEFAULT_LEDGER_DIR",
    "DEFAULT_LEDGER_NAME",
    "LEDGER_DIR_NODE_KEY",
    "LEDGER_REGISTRY_NODE_KEY",
    "LEDGER_STATE_KEY",
    "MIGRATED_SUFFIX",
    "default_ledger_path",
    "ledger_totals",
    "legacy_ledger_paths",
    "node_ledger_dir",
    "node_ledger_registry",
    "open_node_ledger",
    "save_node_ledger",
]

#: Node run-state record of the ledger when no ledger file is configured (simulation).
LEDGER_STATE_KEY = "privacy-ledger"
#: Node config key of the folder of a persistent ledger (set by whoever starts the SuperNode).
LEDGER_DIR_NODE_KEY = "ledger-dir"
#: Node config key of the node's own ledger registry file (see :func:`node_ledger_registry`).
LEDGER_REGISTRY_NODE_KEY = "ledger-registry"
#: The ledger folder of a node outside simulation whose node config names none.
DEFAULT_LEDGER_DIR = Path("~/.fedparity/ledgers")
#: The ledger file in the node's ledger folder.
DEFAULT_LEDGER_NAME = "user-ledger.json"
#: The file name the LDP ledger of older versions had in the same folder.
LEGACY_LEDGER_NAME = "ldp-ledger.npz"
#: What a migrated basic-composition ledger is renamed to (``<name>.migrated``).
MIGRATED_SUFFIX = ".migrated"


def node_ledger_dir(context: Context) -> Path | None:
    """The node's ledger folder: node config ``ledger-dir``; else, outside Flower's simulation
    engine, :data:`DEFAULT_LEDGER_DIR` (a real node's ledger always persists); else None (a
    simulated node keeps its ledger in its run state)."""
    folder = context.node_config.get(LEDGER_DIR_NODE_KEY)
    if folder:
        return Path(os.fspath(str(folder))).expanduser()
    return None if in_flower_simulation() else DEFAULT_LEDGER_DIR.expanduser()


def node_ledger_registry(context: Context) -> LedgerRegistry | None:
    """The record of the ledgers this node created, kept apart from its ledger folder
    (:class:`~fedparity.mechanisms.privacy.user_ledger.LedgerRegistry`): node config
    ``ledger-registry`` (the node's own: a new ledger elsewhere is a changed ``ledger-dir``
    and refused), else ``~/.fedparity/ledger-registry.json`` (shared by the account's nodes:
    a new ledger is logged with the others it holds). None inside Flower's simulation engine,
    whose nodes' ledgers live as long as the run or the test that set their ``ledger-dir``."""
    if in_flower_simulation():
        return None
    own = context.node_config.get(LEDGER_REGISTRY_NODE_KEY)
    if own:
        return LedgerRegistry(str(own), single_node=True)
    return LedgerRegistry(DEFAULT_LEDGER_REGISTRY)


def default_ledger_path(context: Context) -> Path | None:
    """:data:`DEFAULT_LEDGER_NAME` in :func:`node_ledger_dir` (None: the node's run state)."""
    folder = node_ledger_dir(context)
    return folder / DEFAULT_LEDGER_NAME if folder is not None else None


def legacy_ledger_paths(path: Path) -> list[Path]:
    """Where a basic-composition ledger of an older version may be for the ledger ``path``:
    ``path`` itself (a custom path that still names the ``.npz``), the same name with
    ``.npz``, and ``ldp-ledger.npz`` beside the default ledger."""
    candidates = [path, path.with_suffix(".npz")]
    if path.name == DEFAULT_LEDGER_NAME:
        candidates.append(path.with_name(LEGACY_LEDGER_NAME))
    return list(dict.fromkeys(candidates))


def _migrate(
    legacy: Path,
    path: Path,
    budget: float,
    delta: float,
    num_users: int,
    user_ids: np.ndarray | None,
) -> UserLedger:
    """The ledger of the basic-composition ledger ``legacy`` (by position; named by
    ``user_ids`` when given), saved at ``path``; ``legacy`` is kept as ``<name>.migrated``."""
    shard = ShardLedger.load(legacy, num_users)
    ledger = UserLedger.from_spent(
        shard.spent,
        min(shard.budget, budget),
        delta,
        job="ldp_audit",
        label=f"migrated from the basic-composition ledger {legacy.name}",
    )
    if user_ids is not None:
        ledger.include_users(user_ids, source=str(legacy))
    kept = legacy.with_name(legacy.name + MIGRATED_SUFFIX)
    os.replace(legacy, kept)  # before the save: a crash in between is the lost-file error
    ledger.save(path)
    log(
        logging.WARNING,
        "privacy ledger: migrated %s (basic composition) to %s; the old file is kept as %s",
        legacy,
        path,
        kept,
    )
    return ledger


def open_node_ledger(
    context: Context,
    path: Path | None,
    policy: NodePrivacyPolicy,
    num_users: int,
    *,
    user_ids: ArrayLike | None = None,
) -> UserLedger:
    """The node's ledger: the file ``path`` (migrating a basic-composition ledger found
    there), or the run state when ``path`` is None; a new one at the policy's
    ``user-epsilon-budget`` and ``user-delta``. A stored ledger keeps the smaller budget and
    delta. :class:`LedgerFileError` when it cannot be used.

    With ``user_ids`` (the ``num_users`` users' ids) the ledger is keyed by id: it holds these
    users (those it had not seen at zero) and every other user it ever held; charge them with
    ``ledger.charge(release, user_ids=user_ids)``. Without, it holds exactly ``num_users``
    users by position (module docstring)."""
    budget, delta = policy.user_epsilon_budget, policy.user_delta
    ids = None
    if user_ids is not None:
        ids = np.asarray(user_ids)
        if ids.shape != (num_users,):
            raise ValueError(
                f"user_ids must hold one id per user ({num_users}), got shape {ids.shape}"
            )
    if path is None:
        record = context.state.config_records.get(LEDGER_STATE_KEY)
        if record is None:
            return UserLedger(budget, delta, num_users, user_ids=ids)
        source = "in this node's run state"
        ledger = UserLedger.from_json(
            str(record["json"]), num_users if ids is None else None, source=source
        )
        if ids is not None:
            _include(ledger, ids, source)
        ledger.budget, ledger.delta = min(ledger.budget, budget), min(ledger.delta, delta)
        return ledger
    registry = node_ledger_registry(context)
    if registry is not None:  # from files only, before the ledger or any data is read
        registry.check(path)
    check_ledger_writable(path)
    if registry is not None and path.exists() and registry.entry(path) is None:
        # a ledger of a fedparity before the registry, or moved here by the operator
        registry.register(path, "found in use")
        log(logging.INFO, "privacy ledger %s: recorded in the registry %s", path, registry.path)
    for legacy in legacy_ledger_paths(path):
        if legacy == path:
            found = path.is_file() and zipfile.is_zipfile(path)  # the old format at this path
        else:  # beside it, before any new ledger was saved (a damaged one is an error)
            found = legacy.is_file() and not path.exists() and not ledger_marker(path).exists()
        if found:
            return _migrate(legacy, path, budget, delta, num_users, ids)
    if ids is None or not path.exists():
        return UserLedger.load_or_create(path, budget, delta, num_users, user_ids=ids)
    ledger = UserLedger.load(path)  # any count, by id or by position: named here
    _include(ledger, ids, str(path))
    ledger.budget, ledger.delta = min(ledger.budget, budget), min(ledger.delta, delta)
    return ledger


def _include(ledger: UserLedger, user_ids: np.ndarray, source: str) -> None:
    """:meth:`UserLedger.include_users`, logging when a ledger by position gets its ids."""
    by_position = not ledger.keyed
    ledger.include_users(user_ids, source=source)
    if by_position:
        log(
            logging.INFO,
            "privacy ledger %s: its %d users, kept by position, are now named by user id "
            "(position i = the i-th smallest id of this node's users)",
            source,
            ledger.num_users,
        )


def save_node_ledger(context: Context, path: Path | None, ledger: UserLedger) -> None:
    """Persist ``ledger`` (atomically to ``path``, or to the run state when None); a new
    ledger file is first recorded in the node's registry (:func:`node_ledger_registry`), and
    logged: with the reset its operator acknowledged, or the other ledgers the registry holds.
    """
    if path is not None:
        registry = node_ledger_registry(context)
        if registry is not None and not path.exists():
            _register_new(registry, path, ledger)
        ledger.save(path)
    else:
        context.state.config_records[LEDGER_STATE_KEY] = ConfigRecord({"json": ledger.to_json()})


def ledger_totals(ledger: UserLedger, path: Path | None = None) -> dict[str, float]:
    """What a node tells the server about its ledger (public-release arithmetic only): the
    largest user total (epsilon at the users' delta), basic composition's epsilon and delta
    for the same user; and ``ledger-new`` = 1 when ``ledger`` is the persistent ledger at
    ``path`` and the release just charged is its first (its users' totals start here: the
    server reports it, since the maximum over the nodes would hide it). Sent only by nodes with
    at least ``min-users-for-counts`` users."""
    summary = ledger.summary()
    totals = {
        EPSILON_SPENT_KEY: float(summary["max_epsilon"]),
        EPSILON_SPENT_DELTA_KEY: float(summary["delta"]),
        EPSILON_SPENT_BASIC_KEY: float(summary["max_epsilon_basic"]),
        EPSILON_SPENT_BASIC_DELTA_KEY: float(summary["max_delta_basic"]),
    }
    if path is not None and len(ledger.releases) == 1:
        totals[LEDGER_NEW_KEY] = 1.0
    return totals


def _register_new(registry: LedgerRegistry, path: Path, ledger: UserLedger) -> None:
    """Record the new ledger ``path`` before its first save (a crash in between leaves it
    registered and missing: refused, never started again silently), and say so in the log."""
    if not registry.register(path, f"{ledger.num_users} users at its creation"):
        return
    reset = registry.last_reset(path)
    others = sorted(key for key in registry.ledgers() if key != LedgerRegistry.key(path))
    if reset is not None:
        log(
            logging.WARNING,
            "privacy ledger: new ledger %s, its users at zero: its operator accepted on %s "
            "that the ledger created there on %s was lost (registry %s)",
            path,
            reset.get("reset"),
            reset.get("created"),
            registry.path,
        )
    elif others:
        log(
            logging.WARNING,
            "privacy ledger: new ledger %s, its users at zero; the registry %s also holds %s "
            "(another node of this account, or a changed ledger-dir: give each node its own "
            "ledger-registry to have a changed ledger-dir refused)",
            path,
            registry.path,
            ", ".join(others),
        )
    else:
        log(logging.INFO, "privacy ledger: new ledger %s (registry %s)", path, registry.path)
