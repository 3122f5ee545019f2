"""Privacy ledgers: every user spends LDP budget per audit and refuses past its budget.

Repeated LDP releases compose by basic sequential composition: a user who answered audits
at eps_1, ..., eps_r has spent sum(eps_i) (McSherry 2009; tight for pure LDP in the worst
case). A ledger refuses a release *before* it happens when the user's remaining budget is
smaller than its epsilon, in the spirit of Flower's ``PrivacyBudgetExhausted``.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..validation import check_epsilon, check_int_at_least

#: Slack for floating-point sums of epsilons (e.g. 0.1 + 0.2 against a budget of 0.3).
BUDGET_TOLERANCE = 1e-9


#: Marker and version stored in a ledger file: anything else is refused as foreign.
LEDGER_FORMAT = "fedparity-ldp-ledger"
LEDGER_VERSION = 1


class PrivacyBudgetExceeded(Exception):
    """A release would take a user past its LDP budget."""


class LedgerFileError(Exception):
    """A ledger file cannot be used (unreadable, corrupt, foreign, for another number of users,
    or missing although it existed). Privacy already spent is never forgotten: the node stops
    its audits until the operator restores the file."""


def ledger_marker(path: str | Path) -> Path:
    """The marker a ledger leaves beside itself when it is first saved (``<name>.created``):
    a ledger whose marker is there but whose file is gone was lost, not never made."""
    path = Path(path)
    return path.with_name(path.name + ".created")


def write_ledger_marker(path: str | Path, what: str) -> None:
    """Leave :func:`ledger_marker` beside ``path`` (once, ``fsync``-ed) before its first save;
    ``what`` says what the ledger holds (e.g. ``"fedparity-ldp-ledger for 3 users"``)."""
    path = Path(path)
    marker = ledger_marker(path)
    if marker.exists():
        return
    with marker.open("w", encoding="utf-8") as note:
        note.write(
            f"{path.name}: {what}. Do not delete: it tells the node that a missing ledger was "
            "lost.\n"
        )
        note.flush()
        os.fsync(note.fileno())


@dataclass(frozen=True)
class LedgerEntry:
    """One release: its epsilon and a label (e.g. ``"audit accuracy eps=1"``)."""

    epsilon: float
    label: str


@dataclass
class PrivacyLedger:
    """One user's LDP budget (a real device holds one of these).

    Parameters
    ----------
    budget : float
        Total epsilon this user allows over all audits.
    """

    budget: float
    spent: float = 0.0
    history: list[LedgerEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.budget = check_epsilon("budget", self.budget)
        if not 0.0 <= self.spent:
            raise ValueError(f"spent must be >= 0, got {self.spent}")

    @property
    def remaining(self) -> float:
        return max(self.budget - self.spent, 0.0)

    def can_spend(self, epsilon: float) -> bool:
        epsilon = check_epsilon("epsilon", epsilon)
        return self.spent + epsilon <= self.budget + BUDGET_TOLERANCE

    def spend(self, epsilon: float, label: str = "") -> None:
        """Record a release, or raise :class:`PrivacyBudgetExceeded` and record nothing."""
        if not self.can_spend(epsilon):
            raise PrivacyBudgetExceeded(
                f"a release at epsilon={epsilon:g} would exceed the budget {self.budget:g} "
                f"(already spent {self.spent:g})"
            )
        self.spent += float(epsilon)
        self.history.append(LedgerEntry(float(epsilon), label))


@dataclass
class ShardLedger:
    """The ledgers of many users hosted by one node (vectorised :class:`PrivacyLedger`).

    Parameters
    ----------
    budget : float
        Per-user budget.
    num_users : int
        Users in the shard.
    """

    budget: float
    num_users: int
    spent: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        self.budget = check_epsilon("budget", self.budget)
        self.num_users = check_int_at_least("num_users", self.num_users, 1)
        if self.spent.size == 0:
            self.spent = np.zeros(self.num_users)
        if self.spent.shape != (self.num_users,):
            raise ValueError(f"spent must have shape ({self.num_users},), got {self.spent.shape}")

    def spend(self, epsilon: float, users: np.ndarray | None = None) -> np.ndarray:
        """Charge ``epsilon`` to every user (or those where ``users`` is True) who can afford it.

        Returns the boolean mask of users who answered; the others refuse and are not
        charged.
        """
        epsilon = check_epsilon("epsilon", epsilon)
        if users is None:
            wanted = np.ones(self.num_users, dtype=bool)
        else:
            wanted = np.asarray(users)
            if wanted.dtype != np.bool_ or wanted.shape != (self.num_users,):
                raise ValueError(
                    f"users must be a boolean mask of shape ({self.num_users},), got dtype "
                    f"{wanted.dtype} and shape {wanted.shape}"
                )
        allowed = wanted & (self.spent + epsilon <= self.budget + BUDGET_TOLERANCE)
        self.spent = self.spent + epsilon * allowed
        return allowed

    def save(self, path: str | Path) -> None:
        """Persist atomically (e.g. under a node's ``ledger-dir``): write a temporary file in
        the same folder, ``fsync`` it, rename it over ``path``, ``fsync`` the folder. A crash
        leaves either the old ledger or the new one, never a torn file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_ledger_marker(path, f"{LEDGER_FORMAT} created for {self.num_users} users")
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, renamed after
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
        )
        try:
            with handle:
                np.savez(
                    handle,
                    format=np.array(LEDGER_FORMAT),
                    version=np.array(LEDGER_VERSION),
                    budget=np.array(self.budget),
                    spent=self.spent,
                )
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(handle.name, path)
        except BaseException:
            Path(handle.name).unlink(missing_ok=True)
            raise
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)

    @classmethod
    def load(cls, path: str | Path, num_users: int) -> ShardLedger:
        """Read a saved ledger; :class:`LedgerFileError` naming the file and the way to
        recover when it cannot be used."""
        path = Path(path)
        recovery = (
            "restore it from a backup; the node answers no audit until then (a ledger is never "
            "reset to zero by fedparity: delete the file yourself only if you accept that "
            "these users start again at zero)"
        )
        try:
            with np.load(path, allow_pickle=False) as saved:
                marker = str(saved["format"]) if "format" in saved.files else None
                version = int(saved["version"]) if "version" in saved.files else None
                budget = float(saved["budget"])
                spent = np.asarray(saved["spent"], dtype=np.float64)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
            raise LedgerFileError(
                f"ledger {path} cannot be read ({type(error).__name__}: {error}); {recovery}"
            ) from None
        if marker != LEDGER_FORMAT or version != LEDGER_VERSION:
            raise LedgerFileError(
                f"ledger {path} is not a fedparity LDP ledger (format {marker!r}, version "
                f"{version!r}); {recovery}"
            )
        if spent.shape != (num_users,) or not np.isfinite(spent).all() or (spent < 0).any():
            raise LedgerFileError(
                f"ledger {path} holds {spent.size} users' spending, this node has {num_users} "
                f"users (or the values are not finite and >= 0); {recovery}"
            )
        if not (np.isfinite(budget) and budget > 0):
            raise LedgerFileError(f"ledger {path} holds an invalid budget {budget!r}; {recovery}")
        return cls(budget, num_users, spent)

    @classmethod
    def load_or_create(cls, path: str | Path, budget: float, num_users: int) -> ShardLedger:
        """Load a saved ledger (keeping what was spent) or start a new one at ``budget``.

        The per-user budget is stored in the ledger and can only be lowered: a saved ledger
        keeps the smaller of its stored budget and ``budget``, so a larger budget asked for
        later never re-enables users who have spent theirs.
        """
        budget = check_epsilon("budget", budget)
        path = Path(path)
        if path.exists():
            saved = cls.load(path, num_users)
            return cls(min(saved.budget, budget), num_users, saved.spent)
        marker = ledger_marker(path)
        if marker.exists():
            raise LedgerFileError(
                f"ledger {path} is missing, but {marker.name} beside it says it was created "
                "and saved before: the spending it held is not known. Restore it from a "
                "backup; the node answers no audit until then (to accept that these users "
                f"start again at zero, delete {marker} yourself)"
            )
        return cls(budget, num_users)
