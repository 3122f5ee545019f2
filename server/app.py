"""fedparity ServerApp: one entry point, one job per ``task`` in the run config.

* ``task = "ldp-audit"`` (default): :func:`fedparity.server.ldp_job.run_ldp_audit` -- FedAvg
  training,
  then LDP audits of the performance gap (the mechanisms M_R / M_L of Marc Juarez and
  Aleksandra Korolova, "'You Can't Fix What You Can't Measure': Privately Measuring
  Demographic Performance Disparities in Federated Learning", AFCP workshop, PMLR, 2022, with
  their true epsilon);
* ``task = "rate-report"``: :func:`fedparity.server.rates_job.run_rate_report` -- FedAvg
  training, then every rate metric per group (selection rate, TPR, FPR, ...; demographic
  parity, equalized odds, the four-fifths rule) from one private report per user (frequency
  oracles of Wang, Blocki, Li and Jha, "Locally differentially private protocols for
  frequency estimation", USENIX Security 2017), each user charged once;
* ``task = "fedevalfair"``: :func:`fedparity.server.fedevalfair_job.run_fedevalfair` -- FedAvg
  training,
  then the two-stage fairness test over CKKS-encrypted statistics ("FedEvalFair: A
  Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation Framework",
  anonymous authors, ACM Multimedia 2024 submission; calibrated mode by default);
* ``task = "fpfl"``: :func:`fedparity.server.fpfl_job.run_fpfl` -- FedSGD training under a fairness
  constraint (MMDM) with clipped per-user statistics, Gaussian noise and secure sums
  (FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
  fairness in private federated learning via the modified method of differential
  multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021);
* ``task = "pipeline"``: :func:`fedparity.server.pipeline_job.run_pipeline` -- the three in one
  run: FPFL and its PFL twin trained, both audited under LDP and tested with FedEvalFair, one
  report with each user's privacy spent over all of it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from ..clients import _math_first  # noqa: F401 - before the math package
from ..clients.logging_setup import quiet_known_noise, warnings_once
from ..clients.project.config import ConfigError, RunConfig
from ..clients.project.data import ADULT_URL, load_adult
from .fedevalfair_job import run_fedevalfair
from .fpfl_job import run_fpfl
from .ldp_job import run_ldp_audit
from .orchestration import JobCannotStart
from .pipeline_job import run_pipeline
from .rates_job import run_rate_report
from .run_record import RunRecord, open_run_record

JOBS = {
    "ldp-audit": run_ldp_audit,
    "rate-report": run_rate_report,
    "fedevalfair": run_fedevalfair,
    "fpfl": run_fpfl,
    "pipeline": run_pipeline,
}


class RunConfigErrorWithoutTraceback(logging.Filter):
    """A run-config mistake is the user's, not a bug: Flower logs every exception leaving the
    ServerApp with its traceback ("ServerApp raised an exception" + the stack); for a
    :class:`ConfigError` this filter keeps one line, the error's own text (it names the key and
    the allowed range), and drops the stack. The run still ends ``finished:failed``."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (ConfigError, JobCannotStart)):
            record.msg = (
                "%s refused the run config before any work: %s"
                if isinstance(error, ConfigError)
                else "%s could not start (nothing trained or released): %s"
            )
            args = record.args if isinstance(record.args, tuple) and record.args else ("ServerApp",)
            record.args = (args[0], str(error))
            record.exc_info = None
            record.exc_text = None
        return True


_FLWR_LOGGER = logging.getLogger("flwr")
if not any(isinstance(item, RunConfigErrorWithoutTraceback) for item in _FLWR_LOGGER.filters):
    _FLWR_LOGGER.addFilter(RunConfigErrorWithoutTraceback())


#: The folder (under ``$FLWR_HOME``) where Flower's runtime dependency installation makes each
#: run's environment (``flwr/supercore/superexec/dependency_installer.py``, Flower 1.41).
FLOWER_RUNTIME_ENVS = "runtime-envs"


def runtime_install_notice(environ: Mapping[str, str] | None = None) -> str | None:
    """One line for the operator when Flower installed this run's dependencies into a fresh
    environment before the job started (its SuperLink was started without
    ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``), else None. Flower activates that
    environment by setting ``VIRTUAL_ENV`` to a folder under ``runtime-envs``; the variable the
    user gave a later ``flwr run`` never reached the SuperLink (Getting started)."""
    environ = os.environ if environ is None else environ
    folder = environ.get("VIRTUAL_ENV", "")
    if not folder or Path(folder).parent.name != FLOWER_RUNTIME_ENVS:
        return None
    return (
        "Flower installed this app's dependencies into a new environment before the run "
        f"started ({folder}: its SuperLink was started without "
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, so every run pays a uv sync, without "
        "constraints.txt, possibly a CUDA build of torch). Stop that SuperLink (pkill -u "
        '"$(id -un)" -f -- "--control-api-address 127.0.0.1:<its control port, 39093 by '
        'default>") and start the next run with FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 '
        "flwr run ...; see Getting started"
    )


def check_adult_files(config: RunConfig) -> None:
    """``dataset = "adult"`` with the simulation harness on (``ground-truth``, which reads the
    data on the server): find the UCI files in ``data-dir``, or fetch them once here with
    ``download = true`` (rather than every simulated node at once). A folder without them, or
    a failed download, is a :class:`ConfigError` naming the key, before any work."""
    if config.dataset != "adult" or not config.ground_truth:
        return
    try:
        load_adult(config.data_dir, download=config.download)
    except FileNotFoundError:
        raise ConfigError(
            f"data-dir = {config.data_dir!r} holds no adult.data and adult.test (set download = "
            "true to fetch them from UCI, or data-dir to the folder that holds them)"
        ) from None
    except OSError as error:  # urllib's URLError and socket errors are OSErrors
        raise ConfigError(
            f"download = true could not fetch UCI Adult from {ADULT_URL} into "
            f"data-dir = {config.data_dir!r}: {error}"
        ) from None


def run_job(grid: Grid, run_config: Mapping[str, Any], run_id: int | None = None) -> None:
    """Validate the run config and the output folder (before any work), then run its task.

    The run's ``status.json`` (:mod:`fedparity.server.run_record`) says how it ended: a job
    that raises is recorded as failed (or interrupted), with what it had released, and an
    ERROR line says so on the console (``flwr run`` itself exits 0 either way). The first line
    says where that file is and how to stop the run (``flwr stop``: Ctrl-C on ``flwr run
    --stream`` only detaches the console, and the run goes on releasing)."""
    config = RunConfig.from_mapping(run_config)
    notice = runtime_install_notice()
    if notice is not None:
        log(logging.WARNING, "%s", notice)
    check_adult_files(config)
    record = open_run_record(config)
    if run_id is not None:
        record.update(run_id=run_id)  # the report says which run it is
    stop = f"flwr stop {run_id}" if run_id is not None else "flwr stop <run id>"
    log(
        logging.INFO,
        "fedparity %s: status in %s; to stop the run: %s (Ctrl-C only detaches the console)",
        config.task,
        record.path,
        stop,
    )
    on_stop = StopRecorder(record).arm()
    try:
        with warnings_once():  # a warning repeated by the job's steps is said once
            JOBS[config.task](grid, config, record)
    except BaseException as error:
        if not on_stop.stopped:  # (a stop has said it already)
            record.fail(error)
        raise
    finally:
        on_stop.active = False  # the run is over: a later exit of this process is not its stop
    if not record.finished:
        record.finish("completed")


class StopRecorder:
    """Flower's exit (``flwr stop`` and signals: ``flwr.supercore.exit``) stops the run's
    record (:meth:`RunRecord.stop`: interrupted, the final ERROR line, no later release). The
    job runs in another thread than the one the signal stops: before this, the run's status
    stayed ``running`` and the job went on releasing until the process was gone."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.active = True
        self.stopped = False

    def __call__(self) -> None:
        if self.active and not self.stopped and not self.record.finished:
            self.stopped = True
            self.record.stop()

    def arm(self) -> StopRecorder:
        """Register with Flower's exit handlers, to run before its log uploader stops (a
        Flower without them: the job's own except clause is all there is)."""
        try:
            from flwr.supercore.exit import add_exit_handler
        except ImportError:
            return self
        add_exit_handler(self, run_before_force_exit=True)
        return self


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """The ServerApp; ``overrides`` are merged over ``context.run_config`` (Python API)."""
    server_app = ServerApp()
    extra = dict(overrides or {})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_job(grid, {**context.run_config, **extra}, run_id=context.run_id)

    return server_app


quiet_known_noise()  # Ray's and Flower's known harmless notices (see logging_setup)
app = build_server_app()
