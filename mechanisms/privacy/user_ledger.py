"""One privacy ledger per user: every DP release a user takes part in, composed tightly.

A user of fedparity may answer LDP gap audits (M_R, M_L), join FPFL trainings (rounds of the
Poisson-subsampled Gaussian mechanism) and take part in any other (epsilon, delta) release.
This module composes all of them into one (epsilon, delta) per user with the
privacy-loss-distribution (PLD) accountant of Google's ``dp-accounting`` (Koskela, Jalko and
Honkela 2020, "Computing tight differential privacy guarantees using FFT", AISTATS; Doroshenko,
Ghazi, Kamath, Kumar and Manurangsi 2022, "Connect the dots: tighter discrete approximations
of privacy loss distributions", PETS), and reports basic composition (the sums of the releases'
epsilons and deltas) beside it as a cross-check.

**Neighbouring relation: replace one user.** Every total holds for two datasets that differ
in *one user's data replaced by any other* (:data:`NEIGHBOURING`). An LDP report is a
guarantee of exactly this kind (any two inputs of the user; a report that is absent instead
is not covered by LDP at all), so add/remove-one-user is not a relation under which LDP
reports compose. FPFL's user-level DP is usually stated (and computed by Opacus, see
:mod:`fedparity.mechanisms.privacy.opacus_accounting`) for adding or removing one user; under
replacement the subsampled Gaussian is analysed directly by ``dp-accounting``
(``NeighboringRelation.REPLACE_ONE``: with probability ``q`` the user's clipped vector ``x``
is in the sum, and it is replaced by ``-x``, both of norm ``C``), which is tighter than the
generic "add/remove epsilon doubles" bound. The FPFL part of a ledger's total is therefore
larger than the add/remove epsilon an FPFL job reports for the same training (e.g.
``sigma = 1.0645, q = 200 / 16280, 1000`` rounds at ``delta = 1 / 16280``: about 2.91 here
against 1.76 for add/remove).

**How each release is modelled** (a PLD that dominates the release's, so the total is never
under-counted):

* :class:`GapReportRelease` -- one M_R, M_L or M_P report of a user (group and value together);
  :class:`NPRRGapReportRelease` one M_N report (with its grid).
  The mechanism is ``epsilon``-LDP with ``epsilon`` its true (for M_L: realised) epsilon
  (:attr:`~fedparity.mechanisms.ldp.laplace.LaplaceMechanism.epsilon`), and binary randomized
  response at ``epsilon`` dominates every ``epsilon``-DP mechanism (Kairouz, Oh and Viswanath
  2015, "The composition theorem for differential privacy", ICML), so the report is accounted
  as that pair. It is not split into "GRR on the group" and "RR / discrete Laplace on the
  value": that composition is sound (the value step is ``eps2``-DP for every group output)
  but charges ``eps1 + eps2``, 1.5 to 1.6 times the true epsilon at the budget splits of
  :func:`~fedparity.mechanisms.ldp.calibration.mechanism_for_budget`. M_L's value step is not
  modelled as a Laplace mechanism either: its randomised rounding to the grid and its clamp
  make its privacy loss differ from the discrete Laplace's, while its pure epsilon is
  computed from the sampler's realised probabilities.
* :class:`FrequencyReportRelease` -- one joint (group, confusion cell) report of a
  frequency oracle (GRR, OUE or subset selection, :mod:`fedparity.mechanisms.ldp.frequency_oracle`),
  charged once however many rate metrics are read from it: pure ``epsilon``-LDP at the
  oracle's realised epsilon, accounted as binary randomized response at that epsilon (as
  above).
* :class:`RandomizedResponseRelease` -- generalised randomized response over ``k``
  categories (exactly ``RandomizedResponseDpEvent``), e.g. a group-only frequency release.
* :class:`SubsampledGaussianRelease` -- ``steps`` rounds of FPFL (Poisson rate ``q``, noise
  multiplier ``sigma``), with the chance that a round's work showed its cohort
  (``timing_tail_probability``, below).
* :class:`ApproximateDPRelease` -- any other ``(epsilon, delta)``-DP release, by the
  pessimistic PLD of ``(epsilon, delta)``-DP (``from_privacy_parameters``).

**Side events.** A release may carry a *failure probability* ``s``: an event of probability
at most ``s`` under every dataset outside which the release is exactly its mechanism (an FPFL
node whose Poisson cohort outgrew its fixed per-round workload, so that the round's time showed
it). Outside the event the rest of what is observed is constant, so a total that is
``(epsilon, delta_pld)`` holds with ``delta_pld + (1 + e^epsilon) s`` instead: the ledger states
every total at the user's ``delta`` by taking the PLD's epsilon at ``delta - (1 + e^eps') s``
(with ``eps'`` the PLD's epsilon at ``delta / 2``, an upper bound of the result).

``dp_accounting`` is imported only where a PLD is built (it takes ~0.7 s); it adds no
handler to the root logger.
"""

from __future__ import annotations

import abc
import base64
import binascii
import contextlib
import fcntl
import functools
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike

from .._files import write_file_atomic
from ..validation import (
    check_choice,
    check_epsilon,
    check_int,
    check_int_at_least,
    check_num_groups,
    check_open_unit,
    check_positive_finite,
)
from .basic_ledger import (
    BUDGET_TOLERANCE,
    LedgerFileError,
    PrivacyBudgetExceeded,
    ledger_marker,
    write_ledger_marker,
)

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

__all__ = [
    "NEIGHBOURING",
    "ApproximateDPRelease",
    "Composition",
    "FrequencyReportRelease",
    "GapReportRelease",
    "NPRRGapReportRelease",
    "LedgerRegistry",
    "RandomizedResponseRelease",
    "Release",
    "SubsampledGaussianRelease",
    "UserLedger",
    "check_ledger_writable",
    "compose",
]

#: The relation every total holds under (see the module docstring).
NEIGHBOURING = "replace-one-user"
#: Width of the PLD's privacy-loss grid: epsilons are upper bounds within about this much per
#: release (1e-4 is ~10 times slower for a change below 1e-3 on 1000 FPFL rounds).
VALUE_DISCRETIZATION_INTERVAL = 1e-3
#: Marker and version of a ledger file: anything else is refused as foreign. Version 1 holds
#: its users by position (no ids); version 2 names them (``user_ids``), so that an older
#: fedparity refuses it rather than reading it by position.
LEDGER_FORMAT = "fedparity-privacy-ledger"
LEDGER_VERSION = 1
LEDGER_VERSION_KEYED = 2
#: How many refused users a :class:`PrivacyBudgetExceeded` message names.
NAMED_USERS = 5
#: The operator's command that accepts that a lost or damaged ledger's users start at zero.
RESET_COMMAND = "fedparity ledger reset"
#: Where a node records the ledgers it created (:class:`LedgerRegistry`) unless told otherwise.
DEFAULT_LEDGER_REGISTRY = Path("~/.fedparity/ledger-registry.json")
#: Marker and version of a ledger registry file.
REGISTRY_FORMAT = "fedparity-ledger-registry"
REGISTRY_VERSION = 1

ReleaseParameter = float | int | str


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _pure_pld(epsilon: float, interval: float) -> PrivacyLossDistribution:
    """Binary randomized response at ``epsilon``: the PLD that dominates every pure
    ``epsilon``-DP release (Kairouz, Oh and Viswanath 2015)."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_randomized_response(
        noise_parameter=_rr_noise_parameter(epsilon, 2),
        num_buckets=2,
        value_discretization_interval=interval,
    )


def _rr_noise_parameter(epsilon: float, num_categories: int) -> float:
    """``p`` of ``dp-accounting``'s randomized response (with probability ``p`` a uniform
    category, else the true one) for GRR at ``epsilon``: ``k / (e^eps + k - 1)``."""
    shrink = math.exp(-epsilon)
    return num_categories * shrink / (1.0 + (num_categories - 1) * shrink)


@dataclass(frozen=True, kw_only=True)
class Release(abc.ABC):
    """One DP release a user takes part in, with what the ledger shows about it.

    Attributes
    ----------
    job : str
        The job that released it (e.g. ``"ldp_audit"``, ``"fpfl"``).
    label : str
        Free text (e.g. ``"audit accuracy of the FPFL model"``).
    time : str
        When it was released, ISO 8601 UTC (default: now).
    """

    kind: ClassVar[str]

    job: str
    label: str = ""
    time: str = field(default_factory=_now)

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job:
            raise ValueError(f"job must be a non-empty string, got {self.job!r}")
        if not isinstance(self.label, str) or not isinstance(self.time, str):
            raise ValueError("label and time must be strings")

    @abc.abstractmethod
    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp-accounting`` event of this release (``UnsupportedDpEvent`` when
        ``dp-accounting`` has none; its PLD is still built, by
        :meth:`privacy_loss_distribution`)."""

    @abc.abstractmethod
    def privacy_loss_distribution(self, value_discretization_interval: float) -> Any:
        """The release's PLD under :data:`NEIGHBOURING` (pessimistic: never under-counts)."""

    @property
    @abc.abstractmethod
    def basic_epsilon(self) -> float:
        """The release's epsilon for basic composition (at :attr:`basic_delta`)."""

    @property
    def basic_delta(self) -> float:
        """The delta that goes with :attr:`basic_epsilon` (0 for a pure-DP release)."""
        return 0.0

    @property
    def failure_probability(self) -> float:
        """The chance of a side event outside which the release is its mechanism (module
        docstring, "Side events"); 0 for most releases."""
        return 0.0

    def parameters(self) -> dict[str, ReleaseParameter]:
        """The mechanism's parameters (every field but job, label and time)."""
        return {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if item.name not in ("job", "label", "time")
        }

    def to_dict(self) -> dict[str, ReleaseParameter]:
        """JSON-ready: ``kind`` plus every field (read back by :func:`release_from_dict`)."""
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, kw_only=True)
class RandomizedResponseRelease(Release):
    """Generalised randomized response over ``num_categories`` (keep the true category with
    probability ``e^eps / (e^eps + k - 1)``, else report one of the others uniformly)."""

    kind: ClassVar[str] = "randomized-response"

    epsilon: float
    num_categories: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_num_groups(self.num_categories, "num_categories")

    def to_dp_event(self) -> dp_accounting.DpEvent:
        from dp_accounting import dp_event

        return dp_event.RandomizedResponseDpEvent(
            noise_parameter=_rr_noise_parameter(self.epsilon, self.num_categories),
            num_buckets=self.num_categories,
        )

    def privacy_loss_distribution(self, value_discretization_interval: float) -> Any:
        from dp_accounting.pld import privacy_loss_distribution

        return privacy_loss_distribution.from_randomized_response(
            noise_parameter=_rr_noise_parameter(self.epsilon, self.num_categories),
            num_buckets=self.num_categories,
            value_discretization_interval=value_discretization_interval,
        )

    @property
    def basic_epsilon(self) -> float:
        return float(self.epsilon)


@dataclass(frozen=True, kw_only=True)
class _PureLdpReport(Release):
    """A pure ``epsilon``-LDP report of a user, accounted as binary randomized response at
    :attr:`epsilon` (the PLD that dominates every pure ``epsilon``-DP release: the module
    docstring)."""

    @property
    @abc.abstractmethod
    def epsilon(self) -> float:
        """The mechanism's true LDP epsilon."""

    def to_dp_event(self) -> dp_accounting.DpEvent:
        from dp_accounting import dp_event

        return dp_event.RandomizedResponseDpEvent(
            noise_parameter=_rr_noise_parameter(self.epsilon, 2), num_buckets=2
        )

    def privacy_loss_distribution(self, value_discretization_interval: float) -> Any:
        return _pure_pld(self.epsilon, value_discretization_interval)

    @property
    def basic_epsilon(self) -> float:
        return self.epsilon


@dataclass(frozen=True, kw_only=True)
class GapReportRelease(_PureLdpReport):
    """One M_R or M_L report of a user (Juarez and Korolova 2022, "'You Can't Fix What You
    Can't Measure': Privately Measuring Demographic Performance Disparities in Federated
    Learning", AFCP workshop, PMLR), accounted as binary randomized response at the
    mechanism's true epsilon (see the module docstring for why not group + value).

    Build it from the mechanism a node uses with :meth:`from_mechanism`.
    """

    kind: ClassVar[str] = "ldp-gap-report"

    gap_mechanism: Literal["R", "L", "P", "N"]
    epsilon_group: float
    epsilon_value: float
    num_groups: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        self._mechanism()  # checks the parameters

    @classmethod
    def from_mechanism(
        cls, mechanism: Any, *, job: str, label: str = "", time: str | None = None
    ) -> GapReportRelease:
        """The release of one report of ``mechanism`` (a RandomizedResponseMechanism,
        LaplaceMechanism or PiecewiseMechanism; for an NPRRMechanism, an
        :class:`NPRRGapReportRelease`, which also records its grid)."""
        if mechanism.name == "N":
            return NPRRGapReportRelease(
                gap_mechanism="N",
                epsilon_group=mechanism.epsilon_group,
                epsilon_value=mechanism.epsilon_value,
                num_groups=mechanism.num_groups,
                grid_size=mechanism.grid_size,
                job=job,
                label=label,
                time=_now() if time is None else time,
            )
        return cls(
            gap_mechanism=mechanism.name,
            epsilon_group=mechanism.epsilon_group,
            epsilon_value=mechanism.epsilon_value,
            num_groups=mechanism.num_groups,
            job=job,
            label=label,
            time=_now() if time is None else time,
        )

    def _mechanism(self) -> Any:
        from ..ldp.calibration import build_mechanism

        # M_N needs its grid: it is an NPRRGapReportRelease
        check_choice("gap_mechanism", self.gap_mechanism, ("R", "L", "P"))
        return build_mechanism(
            self.gap_mechanism, self.epsilon_group, self.epsilon_value, self.num_groups
        )

    @property
    def epsilon(self) -> float:
        """The mechanism's true LDP epsilon (M_L, M_P, M_N: of their realised samplers)."""
        return float(self._mechanism().epsilon)


@dataclass(frozen=True, kw_only=True)
class NPRRGapReportRelease(GapReportRelease):
    """One M_N report of a user: GRR on the group, NPRR (Waudby-Smith, Wu and Ramdas,
    "Nonparametric extensions of randomized response for private confidence sets", ICML 2023)
    on the value over a grid of ``grid_size`` + 1 points; accounted as
    :class:`GapReportRelease` is, at the realised epsilon of its exact integer samplers."""

    kind: ClassVar[str] = "ldp-nprr-gap-report"

    grid_size: int

    def _mechanism(self) -> Any:
        from ..ldp.nprr import NPRRMechanism

        check_choice("gap_mechanism", self.gap_mechanism, ("N",))
        return NPRRMechanism(
            self.epsilon_group, self.epsilon_value, self.num_groups, self.grid_size
        )


@dataclass(frozen=True, kw_only=True)
class FrequencyReportRelease(_PureLdpReport):
    """One report of a frequency oracle over ``domain_size`` categories (a user's joint
    (group, confusion cell) pair, Wang, Blocki, Li and Jha 2017, "Locally differentially
    private protocols for frequency estimation", USENIX Security), accounted as binary
    randomized response at the oracle's realised epsilon (see the module docstring).

    Build it from the oracle a node uses with :meth:`from_oracle`.
    """

    kind: ClassVar[str] = "ldp-frequency-report"

    oracle: Literal["grr", "oue", "ss"]
    epsilon_target: float
    domain_size: int
    subset_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._oracle()  # checks the parameters

    @classmethod
    def from_oracle(
        cls, oracle: Any, *, job: str, label: str = "", time: str | None = None
    ) -> FrequencyReportRelease:
        """The release of one report of ``oracle`` (a ``FrequencyOracle``)."""
        return cls(
            oracle=oracle.name,
            epsilon_target=oracle.epsilon_target,
            domain_size=oracle.domain_size,
            subset_size=oracle.subset_size,
            job=job,
            label=label,
            time=_now() if time is None else time,
        )

    def _oracle(self) -> Any:
        from ..ldp.frequency_oracle import FrequencyOracle

        return FrequencyOracle(self.oracle, self.epsilon_target, self.domain_size, self.subset_size)

    @property
    def epsilon(self) -> float:
        """The oracle's true LDP epsilon, from the probabilities its sampler realises."""
        return float(self._oracle().epsilon)


@dataclass(frozen=True, kw_only=True)
class SubsampledGaussianRelease(Release):
    """``steps`` FPFL rounds: each user joins a round with probability ``sample_rate``
    (Poisson), the sum of clipped vectors gets Gaussian noise of std ``noise_multiplier``
    times the clipping bound.

    ``delta`` is the delta at which its :attr:`basic_epsilon` (its epsilon alone, replace
    one user, by ``dp-accounting``) is stated for basic composition: e.g. the FPFL job's.
    ``timing_tail_probability`` bounds the chance that in any of the ``steps`` rounds the
    node's cohort outgrew its fixed workload, so that the round's time depended on who was
    sampled (:mod:`fedparity.mechanisms.fpfl.cohort_workload`; the module docstring's "Side
    events").
    """

    kind: ClassVar[str] = "subsampled-gaussian"

    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    timing_tail_probability: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_finite("noise_multiplier", self.noise_multiplier)
        if self.sample_rate != 1.0:
            check_open_unit("sample_rate", self.sample_rate)
        check_int_at_least("steps", self.steps, 1)
        check_open_unit("delta", self.delta)
        if self.timing_tail_probability != 0.0:
            check_open_unit("timing_tail_probability", self.timing_tail_probability)

    @property
    def failure_probability(self) -> float:
        return float(self.timing_tail_probability)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        from dp_accounting import dp_event

        round_event = dp_event.PoissonSampledDpEvent(
            sampling_probability=self.sample_rate,
            event=dp_event.GaussianDpEvent(noise_multiplier=self.noise_multiplier),
        )
        return dp_event.SelfComposedDpEvent(event=round_event, count=self.steps)

    def privacy_loss_distribution(self, value_discretization_interval: float) -> Any:
        return _gaussian_pld(
            self.noise_multiplier, self.sample_rate, self.steps, value_discretization_interval
        )

    @property
    def basic_epsilon(self) -> float:
        return _gaussian_epsilon(self.noise_multiplier, self.sample_rate, self.steps, self.delta)

    @property
    def basic_delta(self) -> float:
        return float(self.delta)


@functools.lru_cache(maxsize=64)
def _gaussian_pld(sigma: float, rate: float, steps: int, interval: float) -> Any:
    """PLD of ``steps`` Poisson-subsampled Gaussian rounds, replace one user (cached: a
    ledger checks a training before it charges it, and a PLD is never changed in place)."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution

    one_round = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        sampling_prob=rate,
        value_discretization_interval=interval,
        neighboring_relation=NeighboringRelation.REPLACE_ONE,
    )
    return one_round.self_compose(steps)


@functools.lru_cache(maxsize=256)
def _gaussian_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    pld = _gaussian_pld(sigma, rate, steps, VALUE_DISCRETIZATION_INTERVAL)
    return float(pld.get_epsilon_for_delta(delta))


@dataclass(frozen=True, kw_only=True)
class ApproximateDPRelease(Release):
    """Any other ``(epsilon, delta)``-DP release (``delta = 0``: pure DP), by the
    pessimistic PLD of ``(epsilon, delta)``-DP: loss infinite with probability ``delta``, else
    binary randomized response at ``epsilon``."""

    kind: ClassVar[str] = "approximate-dp"

    epsilon: float
    delta: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        if self.delta != 0.0:
            check_open_unit("delta", self.delta)

    def to_dp_event(self) -> dp_accounting.DpEvent:
        from dp_accounting import dp_event

        if self.delta == 0.0:
            return dp_event.RandomizedResponseDpEvent(
                noise_parameter=_rr_noise_parameter(self.epsilon, 2), num_buckets=2
            )
        return dp_event.UnsupportedDpEvent()

    def privacy_loss_distribution(self, value_discretization_interval: float) -> Any:
        if self.delta == 0.0:
            return _pure_pld(self.epsilon, value_discretization_interval)
        from dp_accounting.pld import common, privacy_loss_distribution

        return privacy_loss_distribution.from_privacy_parameters(
            common.DifferentialPrivacyParameters(self.epsilon, self.delta),
            value_discretization_interval=value_discretization_interval,
        )

    @property
    def basic_epsilon(self) -> float:
        return float(self.epsilon)

    @property
    def basic_delta(self) -> float:
        return float(self.delta)


RELEASE_KINDS: dict[str, type[Release]] = {
    kind.kind: kind
    for kind in (
        FrequencyReportRelease,
        GapReportRelease,
        NPRRGapReportRelease,
        RandomizedResponseRelease,
        SubsampledGaussianRelease,
        ApproximateDPRelease,
    )
}


def release_from_dict(data: dict[str, Any]) -> Release:
    """The release :meth:`Release.to_dict` wrote (``ValueError`` for anything else)."""
    if not isinstance(data, dict) or data.get("kind") not in RELEASE_KINDS:
        kind = data.get("kind") if isinstance(data, dict) else data
        raise ValueError(f"unknown release kind {kind!r} (known: {sorted(RELEASE_KINDS)})")
    cls = RELEASE_KINDS[data["kind"]]
    names = {item.name for item in fields(cls)}
    required = {
        item.name
        for item in fields(cls)
        if item.default is MISSING and item.default_factory is MISSING
    }
    values = {key: value for key, value in data.items() if key != "kind"}
    if not required <= set(values) <= names:
        raise ValueError(
            f"a {data['kind']} release has the fields {sorted(names)}, got {sorted(values)}"
        )
    try:
        return cls(**values)
    except TypeError as error:
        raise ValueError(f"a {data['kind']} release cannot be built: {error}") from None


@dataclass(frozen=True)
class Composition:
    """A user's total over a sequence of releases.

    Attributes
    ----------
    epsilon : float
        The total epsilon at ``delta``: the PLD epsilon, or basic composition's when that is
        smaller and holds at ``delta`` (``basic_delta <= delta``; both are upper bounds, the
        PLD's only exceeds basic by its grid, at most ``VALUE_DISCRETIZATION_INTERVAL`` per
        release, when every release is pure).
    delta : float
        The user's delta.
    pld_epsilon : float
        The PLD accountant's epsilon at ``delta``.
    basic_epsilon, basic_delta : float
        Basic composition: the sums of the releases' epsilons and deltas.
    num_releases : int
    neighbouring : str
        The relation the total holds under (:data:`NEIGHBOURING`).
    """

    epsilon: float
    delta: float
    pld_epsilon: float
    basic_epsilon: float
    basic_delta: float
    num_releases: int
    neighbouring: str = NEIGHBOURING


def _identity_pld(interval: float) -> Any:
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.identity(value_discretization_interval=interval)


def _side_delta(epsilon: float, failure: float) -> float:
    """``(1 + e^epsilon) failure``: the delta a side event of that probability adds to a total
    of ``epsilon`` (module docstring, "Side events"); infinite on overflow."""
    if failure == 0.0:
        return 0.0
    try:
        return (1.0 + math.exp(epsilon)) * failure
    except OverflowError:
        return math.inf


def _composition(pld: Any, releases: Sequence[Release], delta: float) -> Composition:
    failure = math.fsum(release.failure_probability for release in releases)
    if not releases:
        pld_epsilon = 0.0
    elif failure == 0.0:
        pld_epsilon = float(pld.get_epsilon_for_delta(delta))
    else:  # the PLD's delta and the side events' share delta (module docstring)
        side = _side_delta(float(pld.get_epsilon_for_delta(delta / 2)), failure)
        pld_epsilon = (
            float(pld.get_epsilon_for_delta(delta - side)) if side <= delta / 2 else math.inf
        )
    basic_epsilon = math.fsum(release.basic_epsilon for release in releases)
    basic_delta = math.fsum(release.basic_delta for release in releases)
    basic_delta += _side_delta(basic_epsilon, failure)
    epsilon = pld_epsilon
    if basic_delta <= delta:
        epsilon = min(epsilon, basic_epsilon)
    return Composition(
        epsilon=epsilon,
        delta=delta,
        pld_epsilon=pld_epsilon,
        basic_epsilon=basic_epsilon,
        basic_delta=basic_delta,
        num_releases=len(releases),
    )


def compose(
    releases: Sequence[Release],
    delta: float,
    *,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> Composition:
    """The (epsilon, ``delta``) of a user who took part in every one of ``releases``, under
    :data:`NEIGHBOURING`, with basic composition beside it.

    Examples
    --------
    >>> audit = GapReportRelease(gap_mechanism="R", epsilon_group=0.62, epsilon_value=1.0,
    ...                          job="ldp_audit", time="2026-01-01T00:00:00+00:00")
    >>> total = compose([audit, audit, audit], delta=1e-5)
    >>> round(total.basic_epsilon, 3), total.epsilon <= total.basic_epsilon
    (3.0, True)
    """
    delta = check_open_unit("delta", delta)
    interval = check_positive_finite("value_discretization_interval", value_discretization_interval)
    pld = _identity_pld(interval)
    for release in releases:
        pld = pld.compose(release.privacy_loss_distribution(interval))
    return _composition(pld, list(releases), delta)


class UserLedger:
    """The privacy ledgers of the users of one node (one user: ``num_users=1``).

    Memory grows with the releases, not with their product with the users: the ledger keeps
    each distinct release once and, per release, a boolean mask of the users who took part
    (an FPFL training charges its whole population, sampled or not: the amplification by
    Poisson sampling is in its PLD). Users who took part in the same releases share one
    composition.

    **Users by id or by position.** A ledger made with ``user_ids`` is *keyed*: it names its
    users, keeps them sorted by id, and a release is charged to ids
    (``charge(release, user_ids=...)``), so the users of one release need not be those of the
    last: an id it has not seen starts at zero (:meth:`add_users`), users not in a release are
    untouched. A ledger made with ``num_users`` alone holds its users *by position*
    ``0 .. num_users - 1`` (as every ledger of fedparity before ids): boolean masks of that
    length say who took part. :meth:`include_users` names the users of a positional ledger
    (position ``i`` becomes the ``i``-th smallest id). Positions stay valid on a keyed ledger
    (its users in id order), so every method that takes a user index or a mask works on both.

    Parameters
    ----------
    budget : float
        Each user's epsilon budget at ``delta``.
    delta : float
        The delta of the users' policy: every total is stated at it.
    num_users : int, optional
        The number of users (default: 1, or the number of ``user_ids``).
    user_ids : array of int, optional
        The users' ids (distinct integers): a keyed ledger.
    value_discretization_interval : float
        The PLD's grid (:data:`VALUE_DISCRETIZATION_INTERVAL`).
    """

    def __init__(
        self,
        budget: float,
        delta: float,
        num_users: int | None = None,
        *,
        user_ids: ArrayLike | None = None,
        value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
    ) -> None:
        self.budget = check_epsilon("budget", budget)
        self.delta = check_open_unit("delta", delta)
        self._user_ids: np.ndarray | None = None
        if user_ids is None:
            count = 1 if num_users is None else num_users
            self.num_users = check_int_at_least("num_users", count, 1)
        else:
            ids = _check_user_ids(user_ids)
            if num_users is not None and check_int_at_least("num_users", num_users, 1) != ids.size:
                raise ValueError(
                    f"num_users ({num_users}) must be the number of user_ids ({ids.size})"
                )
            self._user_ids = np.sort(ids)
            self.num_users = int(ids.size)
        self.value_discretization_interval = check_positive_finite(
            "value_discretization_interval", value_discretization_interval
        )
        self._releases: list[Release] = []
        self._participants: list[np.ndarray] = []
        self._plds: dict[tuple[int, ...], Any] = {}

    # -- reading ----------------------------------------------------------------------------

    @property
    def releases(self) -> tuple[Release, ...]:
        return tuple(self._releases)

    @property
    def keyed(self) -> bool:
        """True when the ledger names its users (``user_ids``), False when it holds them by
        position."""
        return self._user_ids is not None

    @property
    def user_ids(self) -> np.ndarray | None:
        """The users' ids in position order (sorted; a copy), or None for a ledger by
        position."""
        return None if self._user_ids is None else self._user_ids.copy()

    def positions(self, user_ids: ArrayLike) -> np.ndarray:
        """The positions of the users ``user_ids`` (in the given order) in a keyed ledger;
        ``ValueError`` naming ids the ledger does not hold (:meth:`add_users` them first)."""
        if self._user_ids is None:
            raise ValueError(
                "this ledger holds its users by position, not by id: name them first "
                "(include_users)"
            )
        ids = _check_user_ids(user_ids, allow_empty=True)
        where = np.searchsorted(self._user_ids, ids)
        found = where < self._user_ids.size
        found[found] = self._user_ids[where[found]] == ids[found]
        if not found.all():
            missing = ids[~found]
            named = ", ".join(str(user) for user in missing[:NAMED_USERS].tolist())
            more = f" and {missing.size - NAMED_USERS} more" if missing.size > NAMED_USERS else ""
            raise ValueError(f"user id {named}{more} is not in this ledger (add_users first)")
        return where.astype(np.int64)

    def add_users(self, user_ids: ArrayLike) -> int:
        """Add the ids the keyed ledger does not hold yet, at zero spending (they took part in
        no earlier release); returns how many were new. Known ids are left as they are."""
        if self._user_ids is None:
            raise ValueError(
                "this ledger holds its users by position, not by id: name them first "
                "(include_users)"
            )
        ids = _check_user_ids(user_ids, allow_empty=True)
        new = np.setdiff1d(ids, self._user_ids)
        if new.size == 0:
            return 0
        merged = np.union1d(self._user_ids, new)
        kept = np.searchsorted(merged, self._user_ids)
        for index, mask in enumerate(self._participants):
            widened = np.zeros(merged.size, dtype=bool)
            widened[kept] = mask
            self._participants[index] = widened
        self._user_ids = merged
        self.num_users = int(merged.size)
        return int(new.size)

    def include_users(self, user_ids: ArrayLike, *, source: str = "the ledger") -> None:
        """Make sure the users ``user_ids`` are in the ledger, by id.

        A keyed ledger adds the ids it does not hold (:meth:`add_users`). A ledger by position
        (a file of an older fedparity, or of a caller that passed a user count) is named: its
        users were the ones at these positions of the node's users sorted by id, so position
        ``i`` becomes the ``i``-th smallest of ``user_ids``. That needs as many ids as it has
        users; otherwise which user spent what cannot be told, and
        :class:`~fedparity.mechanisms.privacy.basic_ledger.LedgerFileError` says so (``source``
        names the ledger)."""
        ids = _check_user_ids(user_ids, allow_empty=True)
        if self._user_ids is not None:
            self.add_users(ids)
            return
        if ids.size != self.num_users:
            raise LedgerFileError(
                f"ledger {source} holds {self.num_users} users by position (no user ids), this "
                f"node has {ids.size}: which of them spent what cannot be told; {_RECOVERY}"
            )
        self._user_ids = np.sort(ids)

    def participants(self, index: int) -> np.ndarray:
        """The boolean mask of the users who took part in release ``index`` (a copy)."""
        return self._participants[index].copy()

    def releases_of(self, user: int) -> tuple[int, ...]:
        """Indices of the releases ``user`` took part in."""
        user = self._check_user(user)
        return tuple(i for i, mask in enumerate(self._participants) if mask[user])

    def total(self, user: int = 0) -> Composition:
        """``user``'s total over every release they took part in."""
        return self._total(self.releases_of(user))

    def running_totals(self, user: int = 0) -> list[Composition]:
        """``user``'s total after each of the releases they took part in, in order."""
        pld = _identity_pld(self.value_discretization_interval)
        totals = []
        taken: list[Release] = []
        for index in self.releases_of(user):
            release = self._releases[index]
            pld = pld.compose(release.privacy_loss_distribution(self.value_discretization_interval))
            taken.append(release)
            totals.append(_composition(pld, taken, self.delta))
        return totals

    def epsilon_spent(self) -> np.ndarray:
        """Every user's total epsilon at the ledger's ``delta``, shape ``(num_users,)``."""
        spent = np.zeros(self.num_users)
        for key, users in self._groups(np.ones(self.num_users, dtype=bool)):
            spent[users] = self._total(key).epsilon
        return spent

    def most_spent_user(self) -> int:
        """The user with the largest total (the first of them)."""
        return int(np.argmax(self.epsilon_spent()))

    def summary(self) -> dict[str, Any]:
        """JSON-ready totals, e.g. for a job's results.json: the budget, the relation, the
        releases and the largest and smallest user totals."""
        spent = self.epsilon_spent()
        worst = self.total(int(np.argmax(spent)))
        return {
            "budget_epsilon": self.budget,
            "delta": self.delta,
            "neighbouring": NEIGHBOURING,
            "num_users": self.num_users,
            "num_releases": len(self._releases),
            "max_epsilon": worst.epsilon,
            "max_epsilon_basic": worst.basic_epsilon,
            "max_delta_basic": worst.basic_delta,
            "min_epsilon": float(spent.min()),
        }

    # -- charging ---------------------------------------------------------------------------

    def can_afford(
        self,
        release: Release,
        users: np.ndarray | None = None,
        *,
        user_ids: ArrayLike | None = None,
    ) -> np.ndarray:
        """The boolean mask of the wanted users (all, or the mask ``users``) whose total stays
        within the budget with ``release`` added. With ``user_ids`` (a keyed ledger): one
        entry per given id, in the given order."""
        if user_ids is not None:
            if users is not None:
                raise ValueError("give users (a mask) or user_ids, not both")
            where = self.positions(user_ids)
            mask = np.zeros(self.num_users, dtype=bool)
            mask[where] = True
            return self.can_afford(release, mask)[where]
        wanted = self._mask(users)
        allowed = np.zeros(self.num_users, dtype=bool)
        release_pld = release.privacy_loss_distribution(self.value_discretization_interval)
        for key, members in self._groups(wanted):
            after = _composition(
                self._pld(key).compose(release_pld),
                [*(self._releases[i] for i in key), release],
                self.delta,
            )
            allowed[members] = after.epsilon <= self.budget + BUDGET_TOLERANCE
        return allowed

    def check(
        self,
        release: Release,
        users: np.ndarray | None = None,
        *,
        user_ids: ArrayLike | None = None,
    ) -> None:
        """Raise :class:`PrivacyBudgetExceeded` naming the users ``release`` would take past
        the budget (all, the mask ``users``, or the ids ``user_ids``); changes nothing."""
        wanted = self._wanted(users, user_ids)
        refused = np.flatnonzero(wanted & ~self.can_afford(release, wanted))
        if refused.size == 0:
            return
        names = refused if self._user_ids is None else self._user_ids[refused]
        named = ", ".join(str(user) for user in names[:NAMED_USERS].tolist())
        more = f" and {refused.size - NAMED_USERS} more" if refused.size > NAMED_USERS else ""
        worst = int(refused[0])
        after = self._total(self.releases_of(worst), extra=release)
        raise PrivacyBudgetExceeded(
            f"the {release.kind} release of job {release.job!r} ({_describe(release)}) would "
            f"take user {named}{more} ({refused.size} of {int(wanted.sum())}) past the budget "
            f"epsilon={self.budget:g} at delta={self.delta:g}: user {int(names[0])} would reach "
            f"epsilon={after.epsilon:.4g} (from {self.total(worst).epsilon:.4g}; "
            f"{NEIGHBOURING}); nothing was released or recorded"
        )

    def charge(
        self,
        release: Release,
        users: np.ndarray | None = None,
        *,
        user_ids: ArrayLike | None = None,
    ) -> None:
        """Record ``release`` for the wanted users (all, the mask ``users``, or the ids
        ``user_ids`` of a keyed ledger; users not named are untouched), or raise
        :class:`PrivacyBudgetExceeded` (from :meth:`check`) and record nothing."""
        wanted = self._wanted(users, user_ids)
        self.check(release, wanted)
        if wanted.any():
            self._releases.append(release)
            self._participants.append(wanted.copy())

    def extend(self, index: int, release: Release) -> None:
        """Replace release ``index`` by ``release``, the same release over more rounds (an
        FPFL training charged block by block): the same kind, job, label, time and parameters
        but for ``steps`` and ``timing_tail_probability``, neither smaller. Its users' totals
        are checked first (:class:`PrivacyBudgetExceeded`, nothing changed).

        Parameters
        ----------
        index : int
            A release of this ledger.
        release : Release
            Its extension.
        """
        index = check_int("index", index, minimum=0, maximum=len(self._releases) - 1)
        old = self._releases[index]
        grown = ("steps", "timing_tail_probability")
        same = replace(
            release, **{name: getattr(old, name) for name in grown if hasattr(old, name)}
        )
        if type(release) is not type(old) or same != old:
            raise ValueError(
                f"release {index} ({_describe(old)}) can only be extended by the same release "
                f"over more rounds, got {_describe(release)}"
            )
        if any(getattr(release, name) < getattr(old, name) for name in grown):
            raise ValueError(f"an extension of release {index} cannot take rounds away")
        members = self._participants[index]
        trial = [*self._releases[:index], release, *self._releases[index + 1 :]]
        for key, users in self._groups(members):
            after = compose(
                [trial[i] for i in key],
                self.delta,
                value_discretization_interval=self.value_discretization_interval,
            )
            if after.epsilon > self.budget + BUDGET_TOLERANCE:
                names = users if self._user_ids is None else self._user_ids[users]
                raise PrivacyBudgetExceeded(
                    f"extending the {old.kind} release of job {old.job!r} to "
                    f"{_describe(release)} would take user {int(names[0])} ({users.size} of "
                    f"{int(members.sum())}) past the budget epsilon={self.budget:g} at "
                    f"delta={self.delta:g} (epsilon={after.epsilon:.4g}); nothing was released "
                    "or recorded"
                )
        self._releases[index] = release
        self._plds = {}

    # -- files ------------------------------------------------------------------------------

    def to_json(self) -> str:
        releases = []
        for release, mask in zip(self._releases, self._participants, strict=True):
            everyone = bool(mask.all())
            packed = (
                "all" if everyone else base64.b64encode(np.packbits(mask).tobytes()).decode("ascii")
            )
            releases.append({**release.to_dict(), "participants": packed})
        named = {} if self._user_ids is None else {"user_ids": self._user_ids.tolist()}
        return json.dumps(
            {
                "format": LEDGER_FORMAT,
                "version": LEDGER_VERSION if self._user_ids is None else LEDGER_VERSION_KEYED,
                "neighbouring": NEIGHBOURING,
                "budget": self.budget,
                "delta": self.delta,
                "num_users": self.num_users,
                **named,
                "value_discretization_interval": self.value_discretization_interval,
                "releases": releases,
            },
            indent=1,
            allow_nan=False,
        )

    def save(self, path: str | Path) -> None:
        """Persist atomically (``write_file_atomic``); the first save leaves the
        ``.created`` marker that tells a lost ledger from one never made."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_ledger_marker(path, f"{LEDGER_FORMAT} created for {self.num_users} users")
            write_file_atomic(path, self.to_json().encode("utf-8"), 0o600)
        except OSError as error:
            raise LedgerFileError(_unwritable(path, error)) from None

    @classmethod
    def load(cls, path: str | Path, num_users: int | None = None) -> UserLedger:
        """Read a saved ledger (of ``num_users`` users, or any number when None; by id or by
        position); :class:`LedgerFileError` naming the file and the way to recover when it
        cannot be used."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise LedgerFileError(
                f"ledger {path} cannot be read ({type(error).__name__}: {error}); {_RECOVERY}"
            ) from None
        return cls.from_json(text, num_users, source=str(path))

    @classmethod
    def from_json(
        cls, text: str, num_users: int | None = None, *, source: str = "the ledger"
    ) -> UserLedger:
        """A ledger from :meth:`to_json`'s text (``source`` names it in errors, e.g. a node's
        run state); :class:`LedgerFileError` when it cannot be used."""
        try:
            data = json.loads(text)
        except ValueError as error:
            raise LedgerFileError(
                f"ledger {source} cannot be read ({type(error).__name__}: {error}); {_RECOVERY}"
            ) from None
        versions = (LEDGER_VERSION, LEDGER_VERSION_KEYED)
        if (
            not isinstance(data, dict)
            or data.get("format") != LEDGER_FORMAT
            or data.get("version") not in versions
            or isinstance(data.get("version"), bool)
        ):
            found = (data.get("format"), data.get("version")) if isinstance(data, dict) else None
            raise LedgerFileError(
                f"ledger {source} is not a fedparity privacy ledger (format, version: "
                f"{found!r}; expected {LEDGER_FORMAT!r}, {' or '.join(map(str, versions))}); "
                f"{_RECOVERY}"
            )
        try:
            if data.get("neighbouring") != NEIGHBOURING:
                raise ValueError(f"its relation is {data.get('neighbouring')!r}")
            keyed = data["version"] == LEDGER_VERSION_KEYED
            if keyed != ("user_ids" in data):
                raise ValueError(f"version {data['version']} with{'out' * keyed} user_ids")
            ids = data["user_ids"] if keyed else None
            if keyed and (
                not isinstance(ids, list)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                or ids != sorted(set(ids))
            ):
                raise ValueError("user_ids must be a sorted list of distinct integers")
            ledger = cls(
                data["budget"],
                data["delta"],
                data["num_users"],
                user_ids=ids,
                value_discretization_interval=data["value_discretization_interval"],
            )
            for entry in data["releases"]:
                entry = dict(entry)
                packed = entry.pop("participants")
                ledger._releases.append(release_from_dict(entry))
                ledger._participants.append(_unpack(packed, ledger.num_users))
        except (KeyError, TypeError, ValueError, binascii.Error) as error:
            raise LedgerFileError(
                f"ledger {source} is damaged ({type(error).__name__}: {error}); {_RECOVERY}"
            ) from None
        if num_users is not None and ledger.num_users != num_users:
            raise LedgerFileError(
                f"ledger {source} holds {ledger.num_users} users, this node has {num_users}; "
                f"{_RECOVERY}"
            )
        return ledger

    @classmethod
    def from_spent(
        cls,
        spent: np.ndarray,
        budget: float,
        delta: float,
        *,
        job: str,
        label: str = "",
    ) -> UserLedger:
        """A ledger whose users have already spent the pure epsilons ``spent`` (shape
        ``(num_users,)``), e.g. read from a basic-composition ledger: each distinct spent
        value becomes one ``ApproximateDPRelease(epsilon=spent, delta=0)`` of the users who
        spent it (sound: a pure epsilon spent bounds whatever those releases were). Recorded
        as they are, even past ``budget``: what was spent is never forgotten."""
        spent = np.asarray(spent, dtype=np.float64)
        if spent.ndim != 1 or not np.isfinite(spent).all() or (spent < 0).any():
            raise ValueError("spent must be a 1-d array of finite numbers >= 0")
        ledger = cls(budget, delta, spent.size)
        for value in np.unique(spent[spent > 0]):
            ledger._releases.append(
                ApproximateDPRelease(epsilon=float(value), delta=0.0, job=job, label=label)
            )
            ledger._participants.append(spent == value)
        return ledger

    @classmethod
    def load_or_create(
        cls,
        path: str | Path,
        budget: float,
        delta: float,
        num_users: int | None = None,
        *,
        user_ids: ArrayLike | None = None,
    ) -> UserLedger:
        """Load a saved ledger (keeping every release) or start an empty one.

        With ``user_ids`` the ledger is keyed by them (:meth:`include_users`: new ids start at
        zero, a ledger by position is named); with ``num_users`` alone it must hold that many
        users (by position, or a keyed ledger of that many users in id order). A saved ledger
        keeps the smaller budget and the smaller delta of the stored and the asked ones, so
        asking more later never re-enables users who have spent theirs. A ledger whose
        ``.created`` marker is there but whose file is gone was lost: :class:`LedgerFileError`.
        """
        budget = check_epsilon("budget", budget)
        delta = check_open_unit("delta", delta)
        path = Path(path)
        if user_ids is not None:
            user_ids = _check_user_ids(user_ids)
            if num_users is not None and num_users != user_ids.size:
                raise ValueError(
                    f"num_users ({num_users}) must be the number of user_ids ({user_ids.size})"
                )
        elif num_users is None:
            num_users = 1
        if path.exists():
            ledger = cls.load(path, None if user_ids is not None else num_users)
            if user_ids is not None:
                ledger.include_users(user_ids, source=str(path))
            ledger.budget = min(ledger.budget, budget)
            ledger.delta = min(ledger.delta, delta)
            ledger._plds.clear()
            return ledger
        marker = ledger_marker(path)
        if marker.exists():
            raise LedgerFileError(
                f"ledger {path} is missing, but {marker.name} beside it says it was created "
                "and saved before: the releases it held are not known. Restore it from a "
                f"backup; no release is made until then (to accept that these users start "
                f"again at zero, run `{RESET_COMMAND} {path}`, which removes {marker})"
            )
        return cls(budget, delta, num_users, user_ids=user_ids)

    # -- internals --------------------------------------------------------------------------

    def _check_user(self, user: int) -> int:
        return check_int("user", user, minimum=0, maximum=self.num_users - 1)

    def _wanted(self, users: np.ndarray | None, user_ids: ArrayLike | None) -> np.ndarray:
        """The mask of the users named by a mask (``users``) or by ids (``user_ids``)."""
        if user_ids is None:
            return self._mask(users)
        if users is not None:
            raise ValueError("give users (a mask) or user_ids, not both")
        mask = np.zeros(self.num_users, dtype=bool)
        mask[self.positions(user_ids)] = True
        return mask

    def _mask(self, users: np.ndarray | None) -> np.ndarray:
        if users is None:
            return np.ones(self.num_users, dtype=bool)
        mask = np.asarray(users)
        if mask.dtype != np.bool_ or mask.shape != (self.num_users,):
            raise ValueError(
                f"users must be a boolean mask of shape ({self.num_users},), got dtype "
                f"{mask.dtype} and shape {mask.shape}"
            )
        return mask

    def _groups(self, wanted: np.ndarray) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """(release indices, user indices) for each distinct participation among ``wanted``."""
        users = np.flatnonzero(wanted)
        if users.size == 0:
            return []
        if not self._participants:
            return [((), users)]
        taken = np.stack([mask[users] for mask in self._participants], axis=1)
        _, first, inverse = np.unique(
            np.packbits(taken, axis=1), axis=0, return_index=True, return_inverse=True
        )
        inverse = inverse.reshape(-1)
        return [
            (tuple(np.flatnonzero(taken[row]).tolist()), users[inverse == group])
            for group, row in enumerate(first)
        ]

    def _pld(self, key: tuple[int, ...]) -> Any:
        if key not in self._plds:
            pld = self._pld(key[:-1]) if key else _identity_pld(self.value_discretization_interval)
            if key:
                release = self._releases[key[-1]]
                pld = pld.compose(
                    release.privacy_loss_distribution(self.value_discretization_interval)
                )
            self._plds[key] = pld
        return self._plds[key]

    def _total(self, key: tuple[int, ...], extra: Release | None = None) -> Composition:
        pld, releases = self._pld(key), [self._releases[i] for i in key]
        if extra is not None:
            pld = pld.compose(extra.privacy_loss_distribution(self.value_discretization_interval))
            releases.append(extra)
        return _composition(pld, releases, self.delta)


_RECOVERY = (
    "restore it from a backup; no release is made until then (a ledger is never reset to zero "
    "by fedparity: only if you accept that these users start again at zero, run `"
    + RESET_COMMAND
    + " <the ledger file>`, which keeps the file aside as <name>.damaged-<time> and removes "
    "its .created marker and its registry entry; deleting the file alone leaves the marker, "
    "which keeps the node refusing)"
)


def _check_user_ids(user_ids: ArrayLike, *, allow_empty: bool = False) -> np.ndarray:
    """``user_ids`` as a 1-d int64 array of distinct integers (``ValueError`` otherwise)."""
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or not (
        np.issubdtype(ids.dtype, np.integer) or (ids.size == 0 and ids.dtype == np.float64)
    ):
        raise ValueError(f"user_ids must be a 1-d array of integers, got {ids.dtype} {ids.shape}")
    if ids.size == 0 and not allow_empty:
        raise ValueError("user_ids must name at least one user")
    if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
        raise ValueError("user_ids must fit in a signed 64-bit integer")
    ids = ids.astype(np.int64)
    if np.unique(ids).size != ids.size:
        raise ValueError("user_ids must be distinct")
    return ids


def _unpack(packed: Any, num_users: int) -> np.ndarray:
    if packed == "all":
        return np.ones(num_users, dtype=bool)
    if not isinstance(packed, str):
        raise ValueError(f"participants must be 'all' or base64 bits, got {packed!r}")
    bits = np.frombuffer(base64.b64decode(packed, validate=True), dtype=np.uint8)
    if bits.size != -(-num_users // 8):
        raise ValueError(f"participants hold {bits.size * 8} bits for {num_users} users")
    return np.unpackbits(bits)[:num_users].astype(bool)


def _describe(release: Release) -> str:
    return ", ".join(
        f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in release.parameters().items()
    )


def _unwritable(path: Path, error: OSError, what: str = "ledger") -> str:
    """One line naming the ledger file that cannot be written and why (not ``PermissionError(13,
    ...)``, which names neither)."""
    where = error.filename or path
    return (
        f"{what} {path} cannot be written ({error.strerror or type(error).__name__}: {where}): "
        f"nothing was released; make its folder {path.parent} writable by the user running "
        "this node (or set ledger-dir to a folder it can write)"
    )


def check_ledger_writable(path: str | Path) -> None:
    """:class:`LedgerFileError` naming ``path`` when its folder (or, before it exists, the
    nearest folder above it) cannot be written: a node checks before it answers, so an
    unwritable ledger stops a release before it is made, not at the save after it."""
    path = Path(path)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.R_OK)):
        blocked = folder if not os.access(folder, os.W_OK | os.X_OK) else path
        raise LedgerFileError(_unwritable(path, PermissionError(13, "Permission denied", blocked)))


class LedgerRegistry:
    """The ledger files a node has created, recorded apart from them, so that a ledger whose
    whole folder vanished (its ``.created`` marker too) or a node pointed at another folder is
    never taken for a node that never released anything.

    The ``.created`` marker beside a ledger tells a lost file from one never made, but not a
    lost *folder*: with file and marker gone, and equally with a changed or mistyped
    ``ledger-dir``, a node would start its users at zero. The registry is a small JSON file
    outside the ledger folder (by default :data:`DEFAULT_LEDGER_REGISTRY`, in the account's
    fedparity folder, beside the keys and runs: it survives the deletion of the ledger folder
    and a change of ``ledger-dir``, and needs no Flower state, which a SuperNode keeps in a
    folder its operator may reset on an upgrade). It lists, by absolute path, each ledger the
    node created and when, and each reset its operator acknowledged (:meth:`forget`, run by
    ``fedparity ledger reset``). Writes are atomic and under an exclusive lock (several nodes
    of one account share the default registry).

    ``single_node``: the registry belongs to one node (its operator gave it its own), so a new
    ledger anywhere else while it holds one is a changed ``ledger-dir`` and refused. A
    registry shared by the nodes of one account cannot tell a second node from a moved one:
    a new ledger is then allowed, and the node logs it with the ledgers the registry holds.
    """

    def __init__(self, path: str | Path, *, single_node: bool = False) -> None:
        self.path = Path(os.path.abspath(Path(path).expanduser()))
        self.single_node = single_node

    @staticmethod
    def key(ledger: str | Path) -> str:
        """How a ledger is named in the registry: its absolute path (not resolved: the folder
        may be gone)."""
        return os.path.abspath(Path(ledger).expanduser())

    def _read(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"ledgers": {}, "resets": []}
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return empty
        except (OSError, UnicodeDecodeError) as error:
            raise LedgerFileError(self._damaged(f"{type(error).__name__}: {error}")) from None
        try:
            data = json.loads(text)
            if data.get("format") != REGISTRY_FORMAT or data.get("version") != REGISTRY_VERSION:
                raise ValueError(f"format, version {data.get('format')!r}, {data.get('version')!r}")
            if not isinstance(data["ledgers"], dict) or not isinstance(data["resets"], list):
                raise ValueError("ledgers must be an object and resets a list")
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise LedgerFileError(self._damaged(f"{type(error).__name__}: {error}")) from None
        return {"ledgers": data["ledgers"], "resets": data["resets"]}

    def _damaged(self, why: str) -> str:
        return (
            f"ledger registry {self.path} cannot be read ({why}): it is what tells this node "
            "which ledgers it created; restore it from a backup (no release is made until then)"
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The registry's content, written back atomically on exit, under an exclusive lock."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT)
        except OSError as error:
            raise LedgerFileError(_unwritable(self.path, error, "ledger registry")) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read()
            yield data
            payload = {"format": REGISTRY_FORMAT, "version": REGISTRY_VERSION, **data}
            try:
                write_file_atomic(self.path, json.dumps(payload, indent=1).encode(), 0o600)
            except OSError as error:
                raise LedgerFileError(_unwritable(self.path, error, "ledger registry")) from None
        finally:
            os.close(lock)  # releases the lock

    def ledgers(self) -> dict[str, dict[str, Any]]:
        """``{absolute path: {"created": time, ...}}`` of the ledgers this registry holds."""
        return dict(self._read()["ledgers"])

    def entry(self, ledger: str | Path) -> dict[str, Any] | None:
        """The registry's record of ``ledger`` (None: not registered)."""
        return self._read()["ledgers"].get(self.key(ledger))

    def last_reset(self, ledger: str | Path) -> dict[str, Any] | None:
        """The last acknowledged reset of ``ledger`` (None: never reset)."""
        key = self.key(ledger)
        resets = [reset for reset in self._read()["resets"] if reset.get("path") == key]
        return resets[-1] if resets else None

    def check(self, ledger: str | Path, *, one_per_node: bool = True) -> None:
        """Decide from files only, before any data is read, whether a node may open
        ``ledger``: :class:`LedgerFileError` (one line naming the ledger, the registry and the
        way to recover) when it was registered but is gone, or, for a single-node registry
        and a file the node keeps one of (``one_per_node``: its user ledger, not the
        FedEvalFair journals it keeps per key), when it would be a new ledger while the node
        created its ledger elsewhere."""
        path = Path(self.key(ledger))
        if path.exists():
            return
        ledgers = self._read()["ledgers"]
        entry = ledgers.get(str(path))
        reset = f"run `{RESET_COMMAND} {{}} --registry {self.path}`"
        if entry is not None:
            marker = ledger_marker(path)
            gone = (
                f"its whole folder {path.parent} is gone"
                if not path.parent.exists()
                else f"its marker {marker} is still there"
                if marker.exists()
                else "its .created marker is gone too"
            )
            raise LedgerFileError(
                f"ledger {path} is missing ({gone}), but the ledger registry {self.path} says "
                f"this node created it on {entry.get('created', '?')}: the releases it held "
                f"are not known. Restore it from a backup; no release is made until then (to "
                f"accept that its users start again at zero, {reset.format(path)}, which "
                "removes any marker left and records the reset)"
            )
        others = sorted(key for key in ledgers if key != str(path))
        if one_per_node and self.single_node and others and not ledger_marker(path).exists():
            raise LedgerFileError(
                f"ledger-dir points to {path.parent}, where this node has no ledger, but the "
                f"ledger registry {self.path} says it created {', '.join(others)}: a changed or "
                f"mistyped ledger-dir would start its users at zero. Set ledger-dir back, or "
                f"move that ledger to {path}; no release is made until then (to accept that "
                f"its users start again at zero here, {reset.format(others[0])})"
            )

    def register(self, ledger: str | Path, what: str) -> bool:
        """Record ``ledger`` (``what`` it holds) if it is not yet; True when it was new."""
        key = self.key(ledger)
        with self._locked() as data:
            if key in data["ledgers"]:
                return False
            data["ledgers"][key] = {"created": _now(), "what": what}
        return True

    def forget(self, ledger: str | Path, reason: str) -> dict[str, Any] | None:
        """Remove ``ledger``'s record and log the reset (when, why, its creation); the record
        removed, or None when it held none. The operator's acknowledgement that its users
        start again at zero: the next node to open it starts a new ledger there."""
        key = self.key(ledger)
        with self._locked() as data:
            entry = data["ledgers"].pop(key, None)
            data["resets"].append(
                {
                    "path": key,
                    "created": None if entry is None else entry.get("created"),
                    "reset": _now(),
                    "reason": reason,
                }
            )
        return entry
