"""fedparity ServerApp: one entry point, one job per ``task`` in the run config.

* ``task = "ldp-audit"`` (default): :func:`fedparity.server.ldp_job.run_ldp_audit` -- FedAvg
  training,
  then LDP audits of the performance gap (SPEC 1);
* ``task = "fedevalfair"``: :func:`fedparity.server.fedevalfair_job.run_fedevalfair` -- FedAvg
  training,
  then the two-stage fairness test over CKKS-encrypted statistics (SPEC 2);
* ``task = "fpfl"``: :func:`fedparity.server.fpfl_job.run_fpfl` -- FedSGD training under a fairness
  constraint (MMDM) with clipped per-user statistics, Gaussian noise and secure sums
  (paper 004, SPEC 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..clients.config import RunConfig
from .fedevalfair_job import run_fedevalfair
from .fpfl_job import run_fpfl
from .ldp_job import run_ldp_audit

JOBS = {"ldp-audit": run_ldp_audit, "fedevalfair": run_fedevalfair, "fpfl": run_fpfl}


def run_job(grid: Grid, run_config: Mapping[str, Any]) -> None:
    """Validate the run config (before any work), then run its task."""
    config = RunConfig.from_mapping(run_config)
    JOBS[config.task](grid, config)


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """The ServerApp; ``overrides`` are merged over ``context.run_config`` (Python API)."""
    server_app = ServerApp()
    extra = dict(overrides or {})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_job(grid, {**context.run_config, **extra})

    return server_app


app = build_server_app()
