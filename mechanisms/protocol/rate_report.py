"""The typed messages of the rate report, used by both ends.

One exchange (``query.rate_report``): the server
(:class:`fedparity.strategies.rate_report.RateReportAudit`) sends the model and a
:class:`RateReportRequest` (a frequency oracle's public parameters: Wang, Blocki, Li and Jha,
"Locally differentially private protocols for frequency estimation", 2017); a node
(:func:`fedparity.clients.rates.rate_report_handler`) answers a :class:`RateReportReply`: one
perturbed report of each answering user's joint (group, confusion cell) category, and its
counts. Every rate metric per group (selection rate, TPR, FPR, ...) is read on the server from
the same reports, so a user is charged once.

Reports on the wire: GRR's report is one category (an integer array, one per user); OUE's and
subset selection's are k bits per user, packed with ``numpy.packbits`` along each row (``(n,
ceil(k / 8))`` ``uint8``, padding bits zero). The server accepts only reports the oracle's
sampler can produce (:meth:`RateReportReply.support_counts`).

No Flower import: the Flower adapters wrap the fields into a ``ConfigRecord`` (request), an
``ArrayRecord`` and a ``MetricRecord`` (reply).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np

from ..ldp.frequency_oracle import ORACLES, FrequencyOracle
from ..ldp.group_rates import CELLS
from . import METRICS_KEY, REPORTS_KEY, USER_COUNT_KEYS, MessageError, message_int

__all__ = [
    "CATEGORIES_KEY",
    "CONFIG_KEY",
    "RATE_REPORT_MESSAGE_TYPE",
    "RateReportReply",
    "RateReportRequest",
    "pack_reports",
]

#: Message type of a rate report; a ClientApp handles it with ``@app.query("rate_report")``.
RATE_REPORT_MESSAGE_TYPE = "query.rate_report"
#: Config record of the request (beside the model's ``ArrayRecord`` under ``"arrays"``).
CONFIG_KEY = "config"
#: The reply's array of reports, in its ``"reports"`` ArrayRecord.
CATEGORIES_KEY = "categories"


def _get(record: Mapping[str, Any], key: str) -> Any:
    try:
        return record[key]
    except (KeyError, TypeError):
        raise MessageError(f"message field {key!r} is missing") from None


def _float(record: Mapping[str, Any], key: str) -> float:
    value = _get(record, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MessageError(f"message field {key!r} must be a finite number")
    return float(value)


@dataclass(frozen=True)
class RateReportRequest:
    """What the server asks of every node in one rate report (record ``"config"``).

    Attributes
    ----------
    oracle : {"grr", "oue", "ss"}
        The frequency oracle.
    epsilon : float
        The oracle's target epsilon; the node rebuilds the oracle and recomputes its true
        epsilon from its realised probabilities.
    num_groups : int
        Protected groups d; the domain is d x 4 categories (group, cell TP/FP/FN/TN).
    subset_size : int
        Subset selection's omega (ignored for GRR and OUE).
    budget : float
        The epsilon the report may spend per user.
    audit_id : str
        The report's label ("" when absent).
    """

    oracle: Literal["grr", "oue", "ss"]
    epsilon: float
    num_groups: int
    subset_size: int
    budget: float
    audit_id: str = ""

    @property
    def domain_size(self) -> int:
        return self.num_groups * len(CELLS)

    def build_oracle(self) -> FrequencyOracle:
        """The oracle of this request, built from its public parameters (GRR's omega is 1,
        OUE's 0, whatever the message says); a :class:`MessageError` if they are invalid."""
        omega = {"grr": 1, "oue": 0}.get(self.oracle, self.subset_size)
        try:
            return FrequencyOracle(self.oracle, self.epsilon, self.domain_size, omega)
        except ValueError:
            raise MessageError(
                "message fields 'oracle', 'epsilon', 'num-groups' and 'subset-size' do not "
                "define a frequency oracle"
            ) from None

    @classmethod
    def for_oracle(
        cls, oracle: FrequencyOracle, *, budget: float, audit_id: str = ""
    ) -> RateReportRequest:
        """The request for ``oracle`` over ``oracle.domain_size / 4`` groups."""
        if oracle.domain_size % len(CELLS):
            raise ValueError(
                f"the oracle's domain ({oracle.domain_size}) must be num_groups x "
                f"{len(CELLS)} cells"
            )
        return cls(
            oracle=cast(Literal["grr", "oue", "ss"], oracle.name),
            epsilon=float(oracle.epsilon_target),
            num_groups=oracle.domain_size // len(CELLS),
            subset_size=int(oracle.subset_size),
            budget=float(budget),
            audit_id=audit_id,
        )

    def to_fields(self) -> dict[str, int | float | str]:
        return {
            "oracle": self.oracle,
            "epsilon": float(self.epsilon),
            "num-groups": int(self.num_groups),
            "subset-size": int(self.subset_size),
            "budget": float(self.budget),
            "audit-id": self.audit_id,
        }

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> RateReportRequest:
        oracle = _get(record, "oracle")
        if oracle not in ORACLES:
            raise MessageError(f"message field 'oracle' must be one of {', '.join(ORACLES)}")
        audit_id = record.get("audit-id", "")
        if not isinstance(audit_id, str):
            raise MessageError("message field 'audit-id' must be a string")
        return cls(
            oracle=oracle,
            epsilon=_float(record, "epsilon"),
            num_groups=message_int("num-groups", _get(record, "num-groups"), minimum=2),
            subset_size=message_int("subset-size", _get(record, "subset-size"), minimum=0),
            budget=_float(record, "budget"),
            audit_id=audit_id,
        )


def _user_count(counts: Mapping[str, object], key: str, default: int) -> int:
    """A per-user count (an integer >= 0); read on the server, so the text may show it."""
    value = counts.get(key, default)
    try:
        return message_int(key, value, minimum=0)
    except MessageError:
        raise MessageError(f"{key} must be an integer >= 0, got {value!r}") from None


def pack_reports(oracle: FrequencyOracle, reports: np.ndarray) -> np.ndarray:
    """The wire form of ``oracle.perturb``'s reports: GRR's categories as ``int32``, the bit
    reports of OUE and subset selection packed along each row (``numpy.packbits``)."""
    if oracle.name == "grr":
        return np.asarray(reports, dtype=np.int32)
    return np.packbits(np.asarray(reports, dtype=bool), axis=1)


@dataclass(frozen=True)
class RateReportReply:
    """A node's answer: one report per answering user (wire form, :func:`pack_reports`) and
    its counts (``epsilon-charged``; ``num-reports``, ``num-refused`` and the ledger's totals
    from a node with at least its ``min-users-for-counts`` users)."""

    reports: np.ndarray
    counts: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def num_reports(self) -> int:
        return int(self.reports.shape[0])

    @property
    def num_refused(self) -> int:
        return _user_count(self.counts, USER_COUNT_KEYS[1], 0)

    def to_fields(self) -> dict[str, dict[str, Any]]:
        return {REPORTS_KEY: {CATEGORIES_KEY: self.reports}, METRICS_KEY: dict(self.counts)}

    @classmethod
    def from_fields(
        cls, reports: Mapping[str, Any] | None, counts: Mapping[str, Any] | None
    ) -> RateReportReply:
        """Read a reply (``reports`` record: name -> array or anything with ``.numpy()``).
        Checks the counts; :meth:`support_counts` checks the reports against the oracle."""
        if reports is None or CATEGORIES_KEY not in reports:
            raise MessageError(f"no '{REPORTS_KEY}' ArrayRecord with '{CATEGORIES_KEY}'")
        try:
            raw = reports[CATEGORIES_KEY]
            array = raw if isinstance(raw, np.ndarray) else np.asarray(raw.numpy())
        except Exception as error:  # a corrupt Array must not end the run
            raise MessageError(f"cannot decode reports: {error}") from None
        counts = dict(counts or {})
        declared = _user_count(counts, USER_COUNT_KEYS[0], int(array.shape[0]) if array.ndim else 0)
        if array.ndim == 0 or declared != array.shape[0]:
            raise MessageError(
                f"num-reports says {declared}, the array holds "
                f"{array.shape[0] if array.ndim else 'no rows'}"
            )
        _user_count(counts, USER_COUNT_KEYS[1], 0)
        return cls(array, counts)

    def support_counts(self, oracle: FrequencyOracle) -> np.ndarray:
        """S_j, the reports supporting each category; a ``MessageError`` for any report the
        oracle's sampler cannot produce (a category outside the domain; a bit row of the wrong
        width, with padding bits set, or, for subset selection, without exactly omega bits)."""
        k, array = oracle.domain_size, self.reports
        if oracle.name == "grr":
            if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
                raise MessageError(f"GRR reports must be a 1-D integer array, got {array.dtype}")
            if array.size and (array.min() < 0 or array.max() >= k):
                raise MessageError(f"a GRR report is outside [0, {k - 1}]")
            return np.bincount(array.astype(np.int64), minlength=k).astype(np.int64)
        width = (k + 7) // 8
        if array.ndim != 2 or array.dtype != np.uint8 or array.shape[1] != width:
            raise MessageError(
                f"{oracle.name} reports must be packed bits, ({array.shape[0]}, {width}) uint8, "
                f"got {array.dtype} {array.shape}"
            )
        bits = np.unpackbits(array, axis=1)
        if bits[:, k:].any():
            raise MessageError("a report has padding bits set")
        bits = bits[:, :k]
        if oracle.name == "ss" and bits.size and (bits.sum(axis=1) != oracle.subset_size).any():
            raise MessageError(
                f"a subset-selection report does not hold exactly {oracle.subset_size} categories"
            )
        return bits.sum(axis=0, dtype=np.int64)
