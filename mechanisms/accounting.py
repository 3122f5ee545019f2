"""Privacy ledgers: every user spends LDP budget per audit and refuses past its budget.

Repeated LDP releases compose by basic sequential composition: a user who answered audits
at eps_1, ..., eps_r has spent sum(eps_i) (McSherry 2009; tight for pure LDP in the worst
case). A ledger refuses a release *before* it happens when the user's remaining budget is
smaller than its epsilon, in the spirit of Flower's ``PrivacyBudgetExhausted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._validation import check_epsilon, check_int_at_least

#: Slack for floating-point sums of epsilons (e.g. 0.1 + 0.2 against a budget of 0.3).
BUDGET_TOLERANCE = 1e-9


class PrivacyBudgetExceeded(Exception):
    """A release would take a user past its LDP budget."""


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
        """Persist to an ``.npz`` file (e.g. under a node's ``ledger-dir``)."""
        np.savez(Path(path), budget=self.budget, spent=self.spent)

    @classmethod
    def load_or_create(cls, path: str | Path, budget: float, num_users: int) -> ShardLedger:
        """Load a saved ledger (keeping what was spent) or start a new one.

        A saved ledger keeps its spending; the budget is the given one, so an operator can
        lower it but spending is never forgotten.
        """
        path = Path(path)
        if path.exists():
            with np.load(path) as saved:
                spent = np.asarray(saved["spent"], dtype=np.float64)
            if spent.shape != (num_users,):
                raise ValueError(
                    f"ledger {path} holds {spent.shape[0]} users, this node has {num_users}"
                )
            return cls(budget, num_users, spent)
        return cls(budget, num_users)
