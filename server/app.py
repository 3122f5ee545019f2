"""fedparity ServerApp: one entry point, one job per ``task`` in the run config.

* ``task = "ldp-audit"`` (default): :func:`server.ldp_job.run_ldp_audit` -- FedAvg training,
  then LDP audits of the performance gap (SPEC 1).
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from server.config import RunConfig
from server.ldp_job import run_ldp_audit

app = ServerApp()

JOBS = {"ldp-audit": run_ldp_audit}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config (before any work), then run its task."""
    config = RunConfig.from_mapping(context.run_config)
    JOBS[config.task](grid, config)
