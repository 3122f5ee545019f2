"""Series of privacy releases: several LDP audits, or several FedEvalFair tests, in one loop
with observer hooks, durable by default.

An LDP audit (:class:`~fedparity.strategies.ldp_audit.LdpGapAudit`, the mechanisms of Juarez
and Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring Demographic
Performance Disparities in Federated Learning", 2022) spends its epsilon on every node that
processes it, whether or not the node's reply arrives; a FedEvalFair test
(:class:`~fedparity.strategies.fedevalfair.FedEvalFairProtocol`; "FedEvalFair: A
Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation Framework",
anonymous authors, 2024) releases decrypted aggregates in its last round. What a run has
released must therefore be on disk **before** each release is sent, so that a crash cannot
hide it. :class:`LdpAuditSeries` and :class:`FedEvalFairSeries` are that loop, the same one the
built-in jobs run; per release they call, in the order the observers are given:

* :meth:`SeriesObserver.should_stop` (any non-empty reason stops the series before it);
* :meth:`SeriesObserver.before_release` with the :class:`Release` about to be sent: the
  default observer, :class:`DurableReleases`, records it durably here (scratch file, ``fsync``,
  atomic replace, ``fsync`` of the folder);
* the audit or test itself;
* :meth:`SeriesObserver.after_release` with its outcome;

and :meth:`SeriesObserver.begin` / :meth:`SeriesObserver.end` around them. The default record,
:class:`ReleaseLog`, is ``releases.json`` in a folder (default: a new
``~/.fedparity/runs/<kind>-<UTC time>``); a series started again on the same folder continues
its count, so :attr:`ReleaseLog.epsilon_recorded` covers every release ever sent from it.
The jobs record into their run's ``status.json`` instead (:class:`DurableReleases` over any
object with ``add_release(**fields)``).

In the style of Keras callbacks and of the FPFL loop's observers
(:mod:`fedparity.strategies.fpfl_observers`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import ArrayRecord
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms._files import DEFAULT_RUNS_DIR, new_run_folder, write_text_durably
from ..mechanisms.validation import check_int_at_least

if TYPE_CHECKING:
    from .fedevalfair import FedEvalFairOutcome, FedEvalFairProtocol
    from .ldp_audit import AuditOutcome, LdpGapAudit
    from .rate_report import RateReportAudit, RateReportOutcome

__all__ = [
    "DurableReleases",
    "FedEvalFairSeries",
    "FedEvalFairTest",
    "LdpAuditSeries",
    "Release",
    "ReleaseLog",
    "ReleaseRecorder",
    "SeriesObserver",
    "SeriesResult",
    "StopAfterFailures",
]

#: The file a :class:`ReleaseLog` keeps in its folder.
RELEASES_FILE = "releases.json"


@dataclass(frozen=True)
class Release:
    """One release about to be sent: how the record describes it.

    ``what`` is a sentence, ``kind`` the release's type (``"ldp-audit"``, ``"fedevalfair"``),
    ``details`` further fields (``epsilon``, ``nodes``, ``holders``, ...), in record order."""

    what: str
    kind: str
    details: Mapping[str, Any]

    @property
    def epsilon(self) -> float | None:
        """The epsilon the release spends per user, if it is differentially private."""
        value = self.details.get("epsilon")
        return None if value is None else float(value)

    def fields(self) -> dict[str, Any]:
        """The record's fields: ``what``, ``kind``, then the details."""
        return {"what": self.what, "kind": self.kind, **self.details}


@dataclass(frozen=True)
class SeriesResult:
    """What a series gave: one outcome per release sent (in order), why it stopped early
    (``""``: it did not), and the epsilon per user its releases spent (basic composition of
    the releases' epsilons; an upper bound: users who refused spent less)."""

    outcomes: tuple[Any, ...]
    releases: tuple[Release, ...]
    stop_reason: str = ""
    epsilon_spent: float = 0.0


class ReleaseRecorder(Protocol):
    """Where :class:`DurableReleases` records: anything with a durable ``add_release``
    (:class:`ReleaseLog`; a job's ``RunRecord``)."""

    def add_release(self, **release: Any) -> None: ...


class ReleaseLog:
    """``folder/releases.json``: every release recorded, durably, before it was sent.

    A log opened on a folder that holds one continues it (its releases stay counted); a
    damaged file is refused (a ledger is never written over).

    Parameters
    ----------
    folder : str or Path
        Where the file is kept (created when the first release is recorded).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        self.releases: list[dict[str, Any]] = []
        path = self.path
        if path.exists():
            try:
                payload = json.loads(path.read_text(encoding="utf-8"))
                releases = payload["releases"]
                if not isinstance(releases, list) or not all(
                    isinstance(item, dict) for item in releases
                ):
                    raise TypeError("releases must be a list of objects")
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"release log {path} is damaged ({error}); it is never written over: "
                    "restore it, or record the series in another folder"
                ) from None
            self.releases = releases

    @property
    def path(self) -> Path:
        return self.folder / RELEASES_FILE

    def add_release(self, **release: Any) -> None:
        """Record durably, *before* it is sent, a release about to happen."""
        time = datetime.now(UTC).isoformat(timespec="seconds")
        self.releases.append({"time": time, **release})
        payload = {"releases": self.releases, "epsilon_recorded": self.epsilon_recorded}
        write_text_durably(self.path, json.dumps(payload, indent=2, allow_nan=False) + "\n")

    @property
    def epsilon_recorded(self) -> float:
        """The epsilons of every recorded release, summed (basic composition)."""
        return math.fsum(float(item.get("epsilon") or 0.0) for item in self.releases)


class SeriesObserver:
    """Hooks into :meth:`LdpAuditSeries.start` and :meth:`FedEvalFairSeries.start`; each does
    nothing here: subclass and override the ones you need (module docstring for the order)."""

    def begin(self, releases: Sequence[Release]) -> None:
        """Before the first release: every release the series may send."""

    def should_stop(self, index: int, outcomes: Sequence[Any]) -> str:
        """Before release ``index`` (from 0): why to stop before it (``""``: go on)."""
        return ""

    def before_release(self, index: int, release: Release) -> None:
        """Release ``index`` is sent next. Raise to stop before anything of it is sent."""

    def after_release(self, index: int, release: Release, outcome: Any) -> None:
        """Release ``index`` is over, with ``outcome``."""

    def end(self, result: SeriesResult) -> None:
        """The series ended (every release, or a stop; not after an exception)."""


class DurableReleases(SeriesObserver):
    """The default observer: each release recorded durably before it is sent.

    Parameters
    ----------
    folder : str or Path, optional
        The :class:`ReleaseLog`'s folder (default: a new ``~/.fedparity/runs/<name>-<UTC
        time>``); pass it again to continue the count.
    record : ReleaseRecorder, optional
        Record here instead of a :class:`ReleaseLog` (e.g. a job's ``RunRecord``).
    name : str
        The default folder's prefix.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        record: ReleaseRecorder | None = None,
        name: str = "releases",
    ) -> None:
        if record is not None and folder is not None:
            raise ValueError("pass folder= or record=, not both")
        if record is None:
            chosen = folder is not None
            folder = Path(folder) if folder is not None else new_run_folder(name, DEFAULT_RUNS_DIR)
            record = ReleaseLog(folder)
            if not chosen:
                log(logging.INFO, "release log in %s", record.folder)
        self.record: ReleaseRecorder = record

    def before_release(self, index: int, release: Release) -> None:
        self.record.add_release(**release.fields())


class StopAfterFailures(SeriesObserver):
    """Stop after ``limit`` releases in a row gave no result (an audit without an estimate,
    a test withheld): every further one would likely fail too while still spending privacy."""

    def __init__(self, limit: int = 1) -> None:
        self.limit = check_int_at_least("limit", limit, 1)
        self.failed_in_a_row = 0
        self.last_error = ""

    def begin(self, releases: Sequence[Release]) -> None:
        self.failed_in_a_row = 0

    def after_release(self, index: int, release: Release, outcome: Any) -> None:
        error = getattr(outcome, "error", None)
        if error:
            self.failed_in_a_row += 1
            self.last_error = str(error)
        else:
            self.failed_in_a_row = 0

    def should_stop(self, index: int, outcomes: Sequence[Any]) -> str:
        if self.failed_in_a_row < self.limit:
            return ""
        return (
            f"{self.failed_in_a_row} release(s) in a row gave no result (last: "
            f"{self.last_error}); every further one would likely fail too while still "
            "spending privacy"
        )


def _run_series(
    releases: Sequence[Release],
    send: Callable[[int], Any],
    observers: Sequence[SeriesObserver],
) -> SeriesResult:
    """The one loop: per release, should_stop, before_release, ``send(index)``,
    after_release; begin and end around them. ``epsilon_spent`` sums the epsilons in order
    (as the jobs always have, so their results.json is unchanged to the last bit)."""
    for observer in observers:
        observer.begin(releases)
    outcomes: list[Any] = []
    stop_reason = ""
    for index, release in enumerate(releases):
        stop_reason = next(
            (reason for o in observers if (reason := o.should_stop(index, outcomes))), ""
        )
        if stop_reason:
            log(logging.WARNING, "series stopped before release %d: %s", index + 1, stop_reason)
            break
        for observer in observers:
            observer.before_release(index, release)
        outcome = send(index)
        outcomes.append(outcome)
        for observer in observers:
            observer.after_release(index, release, outcome)
    sent = tuple(releases[: len(outcomes)])
    spent = 0.0
    for release in sent:
        spent += release.epsilon or 0.0
    result = SeriesResult(
        outcomes=tuple(outcomes), releases=sent, stop_reason=stop_reason, epsilon_spent=spent
    )
    for observer in observers:
        observer.end(result)
    return result


def _observers(
    observers: Iterable[SeriesObserver] | None, folder: str | Path | None, name: str
) -> list[SeriesObserver]:
    if observers is None:
        return [DurableReleases(folder, name=name)]
    if folder is not None:
        raise ValueError(
            "pass folder= or observers=, not both (put DurableReleases(folder) among the observers)"
        )
    return list(observers)


class LdpAuditSeries:
    """Several LDP audits of one model, in order (e.g. one per budget), durable by default.

    Parameters
    ----------
    audits : sequence of LdpGapAudit or RateReportAudit
        The audits, in the order they are sent (gap audits, or rate reports).
    what : str
        How the record describes audit ``number`` (from 1) at ``epsilon`` (its true epsilon),
        as a format string.
    kind : str
        The kind of release recorded (``"ldp-audit"``; ``"rate-report"``).
    """

    def __init__(
        self,
        audits: Sequence[LdpGapAudit | RateReportAudit],
        *,
        what: str = "LDP audit {number} (epsilon {epsilon:.4g})",
        kind: str = "ldp-audit",
    ) -> None:
        self.audits = list(audits)
        self.what = what
        self.kind = kind

    def releases(self, nodes: int) -> list[Release]:
        """What each audit releases: its true epsilon, to ``nodes`` nodes."""
        return [
            Release(
                self.what.format(number=index + 1, epsilon=audit.epsilon),
                self.kind,
                {"epsilon": audit.epsilon, "nodes": nodes},
            )
            for index, audit in enumerate(self.audits)
        ]

    def start(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        *,
        timeout: float = 600.0,
        node_ids: Iterable[int] | None = None,
        observers: Iterable[SeriesObserver] | None = None,
        folder: str | Path | None = None,
    ) -> SeriesResult:
        """Run the audits on ``node_ids`` (default: the nodes connected now, fixed for the
        series, so that a node lost in one audit counts missing in the next).

        Parameters
        ----------
        observers : sequence of SeriesObserver, optional
            Instead of the default ``[DurableReleases(folder)]`` (an empty list: nothing
            durable); called in this order.
        folder : str or Path, optional
            The default observer's folder (pass it again to continue its count).

        Returns
        -------
        SeriesResult
            Its outcomes are :class:`~fedparity.strategies.ldp_audit.AuditOutcome`.
        """
        watching = _observers(observers, folder, self.kind)
        nodes = sorted(grid.get_node_ids() if node_ids is None else set(node_ids))

        def send(index: int) -> AuditOutcome | RateReportOutcome:
            return self.audits[index].start(grid, arrays, timeout=timeout, node_ids=nodes)

        return _run_series(self.releases(len(nodes)), send, watching)


@dataclass(frozen=True)
class FedEvalFairTest:
    """One test of a :class:`FedEvalFairSeries`: the protocol, the model it tests, and how
    the record describes its release."""

    protocol: FedEvalFairProtocol
    arrays: ArrayRecord
    what: str = "FedEvalFair test statistics (decrypted aggregates)"


class FedEvalFairSeries:
    """One or more FedEvalFair tests (e.g. one per model, each its own session), with each
    release (the key holders' decryption in the last round) recorded durably before the test
    starts. The protocol itself is :meth:`FedEvalFairProtocol.start
    <fedparity.strategies.fedevalfair.FedEvalFairProtocol.start>`, unchanged.

    The record's fields: ``holders`` (the nodes asked) and, in the holder-level DP mode, the
    ``epsilon`` and ``delta`` every round-2 holder charges its users."""

    def __init__(self, tests: Sequence[FedEvalFairTest]) -> None:
        self.tests = list(tests)

    def releases(self, holders: int) -> list[Release]:
        releases = []
        for test in self.tests:
            dp = test.protocol.dp
            extra = {} if dp is None else {"epsilon": dp.epsilon, "delta": dp.delta}
            releases.append(Release(test.what, "fedevalfair", {"holders": holders, **extra}))
        return releases

    def start(
        self,
        grid: Grid,
        node_ids: Iterable[int] | None = None,
        *,
        observers: Iterable[SeriesObserver] | None = None,
        folder: str | Path | None = None,
    ) -> SeriesResult:
        """Run the tests on ``node_ids`` (default: the nodes connected now); observers and
        folder as in :meth:`LdpAuditSeries.start`. The outcomes are
        :class:`~fedparity.strategies.fedevalfair.FedEvalFairOutcome`."""
        watching = _observers(observers, folder, "fedevalfair")
        nodes = list(grid.get_node_ids() if node_ids is None else node_ids)

        def send(index: int) -> FedEvalFairOutcome:
            test = self.tests[index]
            return test.protocol.start(grid, test.arrays, nodes)

        return _run_series(self.releases(len(nodes)), send, watching)
