"""The typed messages of the LDP gap audit, used by both ends.

The audit is one exchange (``query.ldp_audit``): the server
(:class:`fedparity.strategies.ldp_audit.LdpGapAudit`) sends the model and an
:class:`LdpAuditRequest` (the mechanism M_R or M_L of Juarez and Korolova, "'You Can't Fix What
You Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
Learning", 2022, with its public parameters); a node (:func:`fedparity.clients.ldp_audit_handler`)
answers an :class:`LdpAuditReply`: its users' perturbed (group, value) pairs and its counts.

``to_fields()`` gives the values of the wire's records, by the names the wire has always used;
``from_fields()`` reads them back or raises :class:`~fedparity.mechanisms.protocol.MessageError`
naming the field. The request's errors name the field only (a node sends them back to the
server). The reply is read on the server, where its errors become the rejection reason recorded
for the node, and say what was wrong with the reply (a shape or a dtype) as they always did.

No Flower import: the Flower adapters wrap the fields into a ``ConfigRecord`` (request),
an ``ArrayRecord`` and a ``MetricRecord`` (reply).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..ldp.metrics import METRIC_NAMES
from ..ldp.nprr import MAX_GRID_SIZE
from ..validation import check_int
from . import (
    GROUPS_KEY,
    METRICS_KEY,
    REPORTS_KEY,
    USER_COUNT_KEYS,
    VALUES_KEY,
    MessageError,
    message_int,
)

__all__ = [
    "CONFIG_KEY",
    "MAX_AUDIT_ID_LENGTH",
    "LdpAuditReply",
    "LdpAuditRequest",
]

#: The longest ``audit-id`` a node accepts (a hostile server's long labels would otherwise grow
#: the node's run state and its users' ledger entries).
MAX_AUDIT_ID_LENGTH = 128

#: Config record of the request (beside the model's ``ArrayRecord`` under ``"arrays"``).
CONFIG_KEY = "config"
#: The mechanisms a request may name.
MECHANISM_NAMES: tuple[Literal["R", "L", "P", "N"], ...] = ("R", "L", "P", "N")


# -- reading fields -------------------------------------------------------------------------


def _get(record: Mapping[str, Any], key: str) -> Any:
    try:
        return record[key]
    except (KeyError, TypeError):
        raise MessageError(f"message field {key!r} is missing") from None


def _int(record: Mapping[str, Any], key: str) -> int:
    """An integer by the one rule (an integral float is accepted, as the node always has)."""
    return message_int(key, _get(record, key))


def _float(record: Mapping[str, Any], key: str) -> float:
    value = _get(record, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MessageError(f"message field {key!r} must be a finite number")
    return float(value)


def _str(record: Mapping[str, Any], key: str) -> str:
    value = _get(record, key)
    if not isinstance(value, str):
        raise MessageError(f"message field {key!r} must be a string")
    return value


# -- the request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LdpAuditRequest:
    """What the server asks of every node in one audit (record ``"config"``).

    Attributes
    ----------
    mechanism : {"R", "L", "P", "N"}
        M_R (randomized response), M_L (Laplace), M_P (Piecewise) or M_N (NPRR).
    epsilon_group, epsilon_value : float
        The mechanism's eps1 and eps2; the node recomputes its true epsilon from them.
    num_groups : int
        The mechanism's group categories: the protected groups, plus one with
        ``undefined_category``.
    budget : float
        The epsilon the audit may spend per user.
    metric : str
        The per-user metric audited (accuracy, tpr, fpr, fnr).
    audit_id : str
        The audit's label ("" when absent: a node does not need it), at most
        :data:`MAX_AUDIT_ID_LENGTH` characters (it keys the node's record of a sequential
        audit's asked users and labels the users' ledger entries).
    undefined_category : bool
        The mechanism's last category is "metric undefined" (absent: false).
    grid_size : int
        M_N's grid G, in [1, 1023] (sent as ``grid-size`` for M_N only; 1 for the others).
    sequential_batch : int or None
        A sequential audit (:class:`~fedparity.strategies.SequentialLdpAudit`, M_N only, with
        an ``audit_id``): how many of its users never asked in this audit the node asks now
        (0: only its number of users); None (absent): an ordinary audit of every user.
    """

    mechanism: Literal["R", "L", "P", "N"]
    epsilon_group: float
    epsilon_value: float
    num_groups: int
    budget: float
    metric: str
    audit_id: str = ""
    undefined_category: bool = False
    grid_size: int = 1
    sequential_batch: int | None = None

    def to_fields(self) -> dict[str, int | float | str | bool]:
        """The ``ConfigRecord`` values, in the wire's order."""
        fields: dict[str, int | float | str | bool] = {
            "mechanism": self.mechanism,
            "epsilon-group": float(self.epsilon_group),
            "epsilon-value": float(self.epsilon_value),
            "num-groups": int(self.num_groups),
            "budget": float(self.budget),
            "metric": self.metric,
            "audit-id": self.audit_id,
            "undefined-category": bool(self.undefined_category),
        }
        if self.mechanism == "N":
            fields["grid-size"] = int(self.grid_size)
        if self.sequential_batch is not None:
            fields["sequential-batch"] = int(self.sequential_batch)
        return fields

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> LdpAuditRequest:
        """Read a request (in the order a node has always checked its fields)."""
        num_groups = _int(record, "num-groups")
        undefined_category = record.get("undefined-category", False)
        if not isinstance(undefined_category, bool):
            raise MessageError("message field 'undefined-category' must be true or false")
        metric = _str(record, "metric")
        if metric not in METRIC_NAMES:
            raise MessageError(f"message field 'metric' must be one of {', '.join(METRIC_NAMES)}")
        mechanism = _str(record, "mechanism")
        if mechanism not in MECHANISM_NAMES:
            raise MessageError("message field 'mechanism' must be one of R, L, P, N")
        grid_size = 1
        if mechanism == "N":
            grid_size = _int(record, "grid-size")
            if not 1 <= grid_size <= MAX_GRID_SIZE:
                raise MessageError(f"message field 'grid-size' must be in [1, {MAX_GRID_SIZE}]")
        elif "grid-size" in record:
            raise MessageError("message field 'grid-size' applies only to mechanism N")
        epsilon_group = _float(record, "epsilon-group")
        epsilon_value = _float(record, "epsilon-value")
        budget = _float(record, "budget")
        audit_id = record.get("audit-id", "")
        if not isinstance(audit_id, str) or len(audit_id) > MAX_AUDIT_ID_LENGTH:
            raise MessageError(
                f"message field 'audit-id' must be a string of at most {MAX_AUDIT_ID_LENGTH} "
                "characters"
            )
        sequential_batch = None
        if "sequential-batch" in record:
            sequential_batch = _int(record, "sequential-batch")
            if sequential_batch < 0:
                raise MessageError("message field 'sequential-batch' must be >= 0")
            if mechanism != "N" or not audit_id:
                raise MessageError(
                    "message field 'sequential-batch' applies only to mechanism N with an "
                    "audit-id (the sequential audit's session)"
                )
        return cls(
            mechanism=mechanism,
            epsilon_group=epsilon_group,
            epsilon_value=epsilon_value,
            num_groups=num_groups,
            budget=budget,
            metric=metric,
            audit_id=audit_id,
            undefined_category=undefined_category,
            grid_size=grid_size,
            sequential_batch=sequential_batch,
        )


# -- the reply ------------------------------------------------------------------------------


def _user_count(counts: Mapping[str, object], key: str, default: int) -> int:
    """A per-user count: an integer >= 0 (the one integer rule, ``check_int``). The server
    reads it from a node's reply, so the text may show the value (it never travels back)."""
    try:
        return check_int(key, counts.get(key, default), minimum=0)
    except ValueError as error:
        raise MessageError(str(error)) from None


@dataclass(frozen=True)
class LdpAuditReply:
    """A node's answer: its answering users' perturbed reports and its counts.

    Attributes
    ----------
    groups : ndarray of int
        Each report's (perturbed) group category.
    values : ndarray
        Each report's perturbed value (int8 in {-1, +1} for M_R, float64 for M_L, M_P and M_N).
    counts : mapping of str to number
        The ``MetricRecord``: ``epsilon-charged`` always; ``num-reports``, ``num-refused``
        (and ``num-undefined`` from older nodes) and the ledger's totals
        (``epsilon-spent-max``, ...) from a node with at least its ``min-users-for-counts``
        users.
    num_reports, num_refused, num_undefined : int
        The per-user counts read from ``counts`` (absent: the reports, 0 and 0).
    """

    groups: np.ndarray
    values: np.ndarray
    counts: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def num_reports(self) -> int:
        return _user_count(self.counts, USER_COUNT_KEYS[0], int(self.groups.size))

    @property
    def num_refused(self) -> int:
        return _user_count(self.counts, USER_COUNT_KEYS[1], 0)

    @property
    def num_undefined(self) -> int:
        return _user_count(self.counts, USER_COUNT_KEYS[2], 0)

    def to_fields(self) -> dict[str, dict[str, Any]]:
        """The reply's records: ``{"reports": {"groups", "values"}, "metrics": counts}``."""
        return {
            REPORTS_KEY: {GROUPS_KEY: self.groups, VALUES_KEY: self.values},
            METRICS_KEY: dict(self.counts),
        }

    @classmethod
    def from_fields(
        cls, reports: Mapping[str, Any] | None, counts: Mapping[str, Any] | None
    ) -> LdpAuditReply:
        """Read a reply from its ``reports`` record (name -> array, or anything with a
        ``.numpy()``; None: absent) and its ``metrics`` record (None: absent).

        Checks what needs no mechanism: the arrays (1-D, equal length, integer groups,
        numeric values) and the per-user counts (integers >= 0, ``num-reports`` equal
        to the reports). The server checks the rest against its mechanism."""
        if reports is None:
            raise MessageError(f"no '{REPORTS_KEY}' ArrayRecord")
        if GROUPS_KEY not in reports or VALUES_KEY not in reports:
            raise MessageError(f"'{REPORTS_KEY}' must hold '{GROUPS_KEY}' and '{VALUES_KEY}'")
        try:
            groups = _as_numpy(reports[GROUPS_KEY])
            values = _as_numpy(reports[VALUES_KEY])
        except Exception as error:  # a corrupt Array must not end the run
            raise MessageError(f"cannot decode reports: {error}") from None
        if groups.ndim != 1 or values.ndim != 1 or groups.shape != values.shape:
            raise MessageError(
                f"groups and values must be 1-D of equal length, got {groups.shape} "
                f"and {values.shape}"
            )
        if not np.issubdtype(groups.dtype, np.integer):
            raise MessageError(f"groups must be integers, got dtype {groups.dtype}")
        if values.dtype.kind not in "iuf":
            raise MessageError(f"values must be numeric, got dtype {values.dtype}")
        counts = dict(counts or {})
        declared, _, _ = (
            _user_count(counts, key, groups.size if key == "num-reports" else 0)
            for key in USER_COUNT_KEYS
        )
        if declared != groups.size:
            raise MessageError(f"num-reports says {declared}, the arrays hold {groups.size}")
        return cls(groups, values, counts)


def _as_numpy(array: Any) -> np.ndarray:
    """An array of the reply (a Flower ``Array`` or a numpy array)."""
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array.numpy())
