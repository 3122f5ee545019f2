"""The results of each job as dataclasses: what ``results.json`` holds, read by attribute.

Each job builds one of :class:`LdpAuditResults`, :class:`FedEvalFairResults`,
:class:`FPFLResults` and :class:`PipelineResults` from its outcome objects
(:class:`~fedparity.strategies.ldp_audit.AuditOutcome`,
:class:`~fedparity.strategies.fedevalfair.FedEvalFairOutcome`,
:class:`~fedparity.strategies.fpfl.FPFLTrainingResult`, whose ``to_dict()`` give the nested
parts); :meth:`Results.to_dict` is exactly the ``results.json`` the job writes (the same keys,
in the same order, with the same values), and :meth:`Results.from_dict` reads one back, so a
report can be rendered again from a ``results.json`` file. The report functions
(:mod:`fedparity.server.report`, :mod:`fedparity.server.fpfl_report`,
:mod:`fedparity.server.pipeline_report`) take either (:meth:`Results.coerce`).

Fields whose content has a schema of its own (the estimate of an audit, a test's report, the
run config, the FPFL history) stay the JSON objects ``to_dict()`` of their producers gave.
A field missing from a dict read back is None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self, TypeVar

from ..strategies.ldp_audit import AuditOutcome

__all__ = [
    "AuditRecord",
    "FPFLPrivacy",
    "FPFLResults",
    "FedEvalFairResults",
    "LdpAuditResults",
    "LdpPrivacy",
    "PipelineAudit",
    "PipelineModel",
    "PipelinePrivacy",
    "PipelineResults",
    "RateReportRecord",
    "RateReportResults",
    "Results",
    "results_for_task",
]

R = TypeVar("R", bound="Results")

#: Field metadata: the field holds one record (``"one"``), a list of them (``"list"``) or a
#: mapping of names to them (``"map"``) of the given class.
_NESTED = "results-nested"


def _nested(kind: str, cls: type[Results]) -> dict[str, Any]:
    return {_NESTED: (kind, cls)}


def _plain(value: Any) -> Any:
    if isinstance(value, Results):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


@dataclass
class Results:
    """A part of a ``results.json``: one field per key, in the file's order."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (nested records as objects too)."""
        return {item.name: _plain(getattr(self, item.name)) for item in fields(self)}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """Read the JSON object ``data`` (a missing key: None)."""
        values: dict[str, Any] = {}
        for item in fields(cls):
            value = data.get(item.name)
            nested = item.metadata.get(_NESTED)
            if nested is not None and value is not None:
                kind, record = nested
                if kind == "one":
                    value = record.from_dict(value)
                elif kind == "list":
                    value = [record.from_dict(entry) for entry in value]
                else:
                    value = {name: record.from_dict(entry) for name, entry in value.items()}
            values[item.name] = value
        return cls(**values)

    @classmethod
    def coerce(cls: type[R], results: R | Mapping[str, Any]) -> R:
        """``results`` itself, or read from its JSON object."""
        return results if isinstance(results, cls) else cls.from_dict(results)  # type: ignore[arg-type]


def _field(kind: str, cls: type[Results]) -> Any:
    return field(default=None, metadata=_nested(kind, cls))


# -- the LDP audit -----------------------------------------------------------------------------


@dataclass
class AuditRecord(Results):
    """One audit of ``results.json``: its budget and :meth:`AuditOutcome.to_dict
    <fedparity.strategies.ldp_audit.AuditOutcome.to_dict>`."""

    budget: float | None = None
    estimate: dict[str, Any] | None = None
    num_reports: int | None = None
    nodes_sent: int | None = None
    nodes_replied: int | None = None
    accepted_nodes: int | None = None
    rejected_replies: list[dict[str, Any]] | None = None
    missing_nodes: list[int] | None = None
    refused_users: int | None = None
    undefined_users: int | None = None
    error: str | None = None
    epsilon_spent_max_reported_by_nodes: float | None = None
    ledger_totals_reported_by_nodes: dict[str, Any] | None = None
    # each reporting node's totals (the latest it sent), and the nodes whose ledger a
    # release of this run created (their users' totals start there)
    ledger_totals_by_node: dict[str, dict[str, Any]] | None = None
    new_ledger_nodes: list[int] | None = None
    # the nodes the per-node cap left out (not asked), the cap, and each node's influence
    # (NodeInfluence.to_dict: leave-one-node-out shifts, heterogeneity test, flagged nodes)
    excluded_nodes: list[dict[str, Any]] | None = None
    max_users_per_node: int | None = None
    influence: dict[str, Any] | None = None

    @classmethod
    def of(cls, budget: float, outcome: AuditOutcome, **more: Any) -> Self:
        """The record of ``outcome``, an audit at ``budget`` (``more``: the fields a
        subclass adds)."""
        return cls(budget=budget, **outcome.to_dict(), **more)


@dataclass
class LdpPrivacy(Results):
    """The LDP audit's ``privacy``: the server's plan, what this run spent, and what the
    nodes' ledgers reported."""

    user_budget: float | None = None
    epsilon_spent_per_user: float | None = None
    composition: str | None = None
    epsilon_spent_total_max_reported_by_nodes: float | None = None
    ledger_totals_reported_by_nodes: dict[str, Any] | None = None
    # each reporting node's totals (the latest it sent), and the nodes whose ledger a
    # release of this run created (their users' totals start there)
    ledger_totals_by_node: dict[str, dict[str, Any]] | None = None
    new_ledger_nodes: list[int] | None = None


@dataclass
class LdpAuditResults(Results):
    """``results.json`` of the LDP audit job (:mod:`fedparity.server.ldp_job`)."""

    task: str | None = None
    run_config: dict[str, Any] | None = None
    num_nodes: int | None = None
    num_users: int | None = None
    failed_describe: list[dict[str, Any]] | None = None
    training: dict[str, Any] | None = None
    ground_truth: dict[str, Any] | None = None
    audits: list[AuditRecord] | None = _field("list", AuditRecord)
    privacy: LdpPrivacy | None = _field("one", LdpPrivacy)
    elapsed_seconds: float | None = None


# -- the rate report ---------------------------------------------------------------------------


@dataclass
class RateReportRecord(Results):
    """One rate report of ``results.json``: its budget and :meth:`RateReportOutcome.to_dict
    <fedparity.strategies.rate_report.RateReportOutcome.to_dict>`."""

    budget: float | None = None
    oracle: str | None = None
    epsilon: float | None = None
    rates: dict[str, Any] | None = None
    num_reports: int | None = None
    nodes_sent: int | None = None
    nodes_replied: int | None = None
    accepted_nodes: int | None = None
    rejected_replies: list[dict[str, Any]] | None = None
    missing_nodes: list[int] | None = None
    refused_users: int | None = None
    error: str | None = None
    ledger_totals_reported_by_nodes: dict[str, Any] | None = None
    ledger_totals_by_node: dict[str, dict[str, Any]] | None = None
    new_ledger_nodes: list[int] | None = None
    # as AuditRecord's; influence: one NodeInfluence.to_dict per rate difference checked
    excluded_nodes: list[dict[str, Any]] | None = None
    max_users_per_node: int | None = None
    influence: list[dict[str, Any]] | None = None


@dataclass
class RateReportResults(Results):
    """``results.json`` of the rate-report job (:mod:`fedparity.server.rates_job`)."""

    task: str | None = None
    run_config: dict[str, Any] | None = None
    num_nodes: int | None = None
    num_users: int | None = None
    failed_describe: list[dict[str, Any]] | None = None
    training: dict[str, Any] | None = None
    ground_truth: dict[str, Any] | None = None
    reports: list[RateReportRecord] | None = _field("list", RateReportRecord)
    privacy: LdpPrivacy | None = _field("one", LdpPrivacy)
    elapsed_seconds: float | None = None


# -- FedEvalFair -------------------------------------------------------------------------------


@dataclass
class FedEvalFairResults(Results):
    """``results.json`` of the FedEvalFair job (:mod:`fedparity.server.fedevalfair_job`);
    ``fedevalfair`` is :meth:`FedEvalFairOutcome.to_dict
    <fedparity.strategies.fedevalfair.FedEvalFairOutcome.to_dict>`."""

    task: str | None = None
    run_config: dict[str, Any] | None = None
    num_nodes: int | None = None
    model_variant: str | None = None
    primary_mode: str | None = None
    training: dict[str, Any] | None = None
    fedevalfair: dict[str, Any] | None = None
    harness_plaintext: dict[str, Any] | None = None
    max_abs_pvalue_difference_vs_plaintext: float | None = None
    server_context_has_secret_key: bool | None = None
    privacy: dict[str, Any] | None = None
    elapsed_seconds: float | None = None

    @property
    def tests(self) -> list[dict[str, Any]]:
        """The outcome's tests (one per metric and mode)."""
        return list((self.fedevalfair or {}).get("tests", []))

    @property
    def error(self) -> str | None:
        """Why the protocol gave no result (None: it did)."""
        return (self.fedevalfair or {}).get("error")

    @property
    def holder_dp(self) -> dict[str, Any] | None:
        """The holder-level DP mode's parameters and noise (None: off)."""
        return (self.fedevalfair or {}).get("holder_dp")


# -- FPFL --------------------------------------------------------------------------------------


@dataclass
class FPFLPrivacy(Results):
    """The FPFL job's ``privacy``: the accounting over every round ever released."""

    accountant: str | None = None
    sampling: str | None = None
    sample_rate: float | None = None
    rounds_released_total: int | None = None
    rounds_released: int | None = None
    rounds_trained: int | None = None
    rounds_discarded_by_crashes: int | None = None
    release_ledger: str | None = None
    rounds_planned: int | None = None
    target_epsilon: float | None = None
    calibrated_epsilon_at_T: float | None = None  # noqa: N815 - the results.json key
    noise: str | None = None
    noise_share_std: float | None = None
    fairfed_noise: dict[str, float] | None = None
    secure_sum: str | None = None
    client_seed: int | None = None
    ledger_totals_reported_by_nodes: dict[str, Any] | None = None
    # each reporting node's totals (the latest it sent), and the nodes whose ledger a
    # release of this run created (their users' totals start there)
    ledger_totals_by_node: dict[str, dict[str, Any]] | None = None
    new_ledger_nodes: list[int] | None = None
    segments: list[dict[str, Any]] | None = None
    caveats: list[str] | None = None


@dataclass
class FPFLResults(Results):
    """``results.json`` of the FPFL job (:mod:`fedparity.server.fpfl_job`)."""

    task: str | None = None
    algorithm: str | None = None
    accuracy: float | None = None
    fnr_gap: float | None = None
    eo_gap: float | None = None
    demp_gap: float | None = None
    pp_gap: float | None = None
    accuracy_gap: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    private: bool | None = None
    privacy: FPFLPrivacy | None = _field("one", FPFLPrivacy)
    status: str | None = None
    stop_reason: str | None = None
    rounds_lost: int | None = None
    selected_round: int | None = None
    model_selection: str | None = None
    selected_fair_on_cohort: bool | None = None
    evaluation: dict[str, Any] | None = None
    paper: dict[str, Any] | None = None
    fairness_constraint: dict[str, Any] | None = None
    population: dict[str, Any] | None = None
    timing: dict[str, Any] | None = None
    history: list[dict[str, Any]] | None = None
    run_config: dict[str, Any] | None = None


# -- the pipeline ------------------------------------------------------------------------------


@dataclass
class PipelineAudit(AuditRecord):
    """One audit of a pipeline model: an :class:`AuditRecord` and what it could detect."""

    detectable: dict[str, Any] | None = None


@dataclass
class PipelineModel(Results):
    """One model of the pipeline: its training, the harness's values, its audits and its
    FedEvalFair tests."""

    name: str | None = None
    training: dict[str, Any] | None = None
    harness: dict[str, Any] | None = None
    audits: list[PipelineAudit] | None = _field("list", PipelineAudit)
    fedevalfair: dict[str, Any] | None = None


@dataclass
class PipelinePrivacy(Results):
    """The pipeline's ``privacy``: each step's (epsilon, delta) and the nodes' totals."""

    per_user_steps: list[dict[str, Any]] | None = None
    ledger_totals_reported_by_nodes: dict[str, Any] | None = None
    # each reporting node's totals (the latest it sent), and the nodes whose ledger a
    # release of this run created (their users' totals start there)
    ledger_totals_by_node: dict[str, dict[str, Any]] | None = None
    new_ledger_nodes: list[int] | None = None


@dataclass
class PipelineResults(Results):
    """``results.json`` of the pipeline job (:mod:`fedparity.server.pipeline_job`)."""

    task: str | None = None
    run_config: dict[str, Any] | None = None
    num_nodes: int | None = None
    num_users: int | None = None
    metric: str | None = None
    constraint: str | None = None
    alpha: float | None = None
    primary_mode: str | None = None
    models: dict[str, PipelineModel] | None = _field("map", PipelineModel)
    comparison: list[dict[str, Any]] | None = None
    privacy: PipelinePrivacy | None = _field("one", PipelinePrivacy)
    timing: dict[str, Any] | None = None


#: The results class of each task.
RESULTS_BY_TASK: dict[str, type[Results]] = {
    "ldp-audit": LdpAuditResults,
    "rate-report": RateReportResults,
    "fedevalfair": FedEvalFairResults,
    "fpfl": FPFLResults,
    "pipeline": PipelineResults,
}


def results_for_task(data: Mapping[str, Any]) -> Results:
    """A ``results.json`` object read as its job's results class (by its ``task``)."""
    task = data.get("task")
    if task not in RESULTS_BY_TASK:
        raise ValueError(f"task must be one of {', '.join(RESULTS_BY_TASK)}, got {task!r}")
    return RESULTS_BY_TASK[str(task)].from_dict(data)
