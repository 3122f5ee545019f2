"""fedparity ServerApp: one entry point, one job per ``task`` in the run config.

* ``task = "ldp-audit"`` (default): :func:`fedparity.server.ldp_job.run_ldp_audit` -- FedAvg
  training,
  then LDP audits of the performance gap (the mechanisms M_R / M_L of Marc Juarez and
  Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring
  Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022, with
  their true epsilon);
* ``task = "fedevalfair"``: :func:`fedparity.server.fedevalfair_job.run_fedevalfair` -- FedAvg
  training,
  then the two-stage fairness test over CKKS-encrypted statistics ("FedEvalFair: A
  Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation Framework",
  anonymous authors, ACM Multimedia 2024 submission; calibrated mode by default);
* ``task = "fpfl"``: :func:`fedparity.server.fpfl_job.run_fpfl` -- FedSGD training under a fairness
  constraint (MMDM) with clipped per-user statistics, Gaussian noise and secure sums
  (FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
  fairness in private federated learning via the modified method of differential
  multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..clients import _math_first  # noqa: F401 - before the math package
from ..clients.config import RunConfig
from .fedevalfair_job import run_fedevalfair
from .fpfl_job import run_fpfl
from .ldp_job import run_ldp_audit
from .run_record import open_run_record

JOBS = {"ldp-audit": run_ldp_audit, "fedevalfair": run_fedevalfair, "fpfl": run_fpfl}


def run_job(grid: Grid, run_config: Mapping[str, Any]) -> None:
    """Validate the run config and the output folder (before any work), then run its task.

    The run's ``status.json`` (:mod:`fedparity.server.run_record`) says how it ended: a job
    that raises is recorded as failed (or interrupted), with what it had released, and an
    ERROR line says so on the console (``flwr run`` itself exits 0 either way)."""
    config = RunConfig.from_mapping(run_config)
    record = open_run_record(config)
    try:
        JOBS[config.task](grid, config, record)
    except BaseException as error:
        record.fail(error)
        raise
    if not record.finished:
        record.finish("completed")


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """The ServerApp; ``overrides`` are merged over ``context.run_config`` (Python API)."""
    server_app = ServerApp()
    extra = dict(overrides or {})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_job(grid, {**context.run_config, **extra})

    return server_app


app = build_server_app()
