"""The status file of a run: what it has released, and how it ended.

Every job writes ``output-dir/status.json`` before it does any work and keeps it current:

* ``status``: ``running`` while the job runs; at the end ``completed``, or the job's own
  ending (FPFL: ``completed-with-lost-rounds``, ``stopped-early``, ``paused``); ``failed``
  (with ``error``) when the ServerApp raised, ``interrupted`` when it was stopped. A run
  killed outright (``kill -9``, a crashed host) cannot write anything more: its file still
  says ``running``, with ``pid`` and ``updated``, which is how a reader tells it died.
* ``results_file``: the results, once the job has written them (null before, and for a run
  that failed or died: no estimate came out of what it released).
* ``releases``: every privacy-relevant release, each recorded durably *before* it is sent
  (an LDP audit's epsilon, FedEvalFair's decryption round; FPFL keeps its own per-round
  ledger and the count of released rounds here). A run that died therefore still says what
  it released and that no estimate came out of it.

An output folder that already holds a run's status, results, privacy ledger or checkpoint is
never written over: a new run refuses it (before any work) unless it resumes that run
(``fpfl-resume``). Writes are durable: scratch file, ``fsync``, atomic rename, ``fsync`` of
the folder.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flwr.common import log

from ..clients.project.config import ConfigError, RunConfig
from ..mechanisms._files import DEFAULT_RUNS_DIR, new_run_folder, write_text_durably

__all__ = [
    "DEFAULT_RUNS_DIR",
    "PROTECTED_FILES",
    "STATUS_FILE",
    "STOPPED_TEXT",
    "RunRecord",
    "RunStopped",
    "ending_sentence",
    "open_run_record",
    "read_status",
    "resolve_output_dir",
    "write_text_durably",
]

STATUS_FILE = "status.json"
#: Files of an earlier run that a new run never writes over.
PROTECTED_FILES = (
    STATUS_FILE,
    "results.json",
    "privacy-ledger.json",
    "checkpoint.json",
    "checkpoint.npz",
)
#: Statuses after which nothing more happens in a run.
FINAL_STATUSES = (
    "completed",
    "completed-with-lost-rounds",
    "completed-with-errors",
    "stopped-early",
    "paused",
    "failed",
    "interrupted",
)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_status(folder: str | Path) -> dict[str, Any] | None:
    """The status file of the run in ``folder`` (None if there is none)."""
    path = Path(folder) / STATUS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


class RunRecord:
    """``output-dir/status.json`` of one run (see the module docstring).

    Use :meth:`open` (it refuses a used folder before any work), :meth:`add_release` before
    each release, :meth:`update` for running counts, and :meth:`finish` or :meth:`fail`.
    """

    def __init__(self, folder: Path, payload: dict[str, Any]) -> None:
        self.folder = folder
        self.payload = payload
        #: Set by :meth:`stop`: no release may be recorded (hence made) any more.
        self.stopped = False

    @property
    def path(self) -> Path:
        return self.folder / STATUS_FILE

    @classmethod
    def open(cls, config: RunConfig, folder: Path, *, resume: bool = False) -> RunRecord:
        """Start the record of a run in ``folder``.

        Raises
        ------
        ConfigError
            Naming ``output-dir``, when ``folder`` holds an earlier run's files and this run
            does not resume it.
        """
        used = sorted(name for name in PROTECTED_FILES if (folder / name).exists())
        earlier = read_status(folder) if (folder / STATUS_FILE).is_file() else None
        if used and not resume:
            raise ConfigError(
                f"output-dir {folder} already holds a run ({', '.join(used)}): fedparity never "
                "writes over a run's results, status or privacy ledger; choose a new output-dir"
                + (" or resume it (fpfl-resume = true)" if config.task == "fpfl" else "")
            )
        payload: dict[str, Any] = {
            "task": config.task,
            "status": "running",
            "started": _now(),
            "updated": _now(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "releases": [],
            # null until the job writes its results: a run that died says here that no
            # estimate came out of what it released
            "results_file": None,
            "attempts": 1,
        }
        if resume and earlier is not None:
            payload["releases"] = list(earlier.get("releases", []))
            payload["attempts"] = int(earlier.get("attempts", 1)) + 1
            payload["previous_status"] = earlier.get("status")
            payload["first_started"] = earlier.get("first_started", earlier.get("started"))
        record = cls(folder, payload)
        record._write()
        return record

    def _write(self) -> None:
        self.payload["updated"] = _now()
        write_text_durably(self.path, json.dumps(self.payload, indent=2, allow_nan=False) + "\n")

    def add_release(self, **release: Any) -> None:
        """Record durably, *before* it is sent, a release about to happen.

        Raises
        ------
        RunStopped
            After :meth:`stop`: the release must not happen.
        """
        self._refuse_if_stopped()
        self.payload["releases"].append({"time": _now(), **release})
        self._write()

    def update(self, **fields: Any) -> None:
        """Set running fields (e.g. the FPFL rounds released so far) durably; raises
        :class:`RunStopped` after :meth:`stop` (the jobs update before each FPFL round)."""
        self._refuse_if_stopped()
        self.payload.update(fields)
        self._write()

    def _refuse_if_stopped(self) -> None:
        if self.stopped:
            raise RunStopped(STOPPED_TEXT)

    def stop(self) -> None:
        """The run was stopped from outside (``flwr stop``, a signal): record it as
        interrupted, log the final ERROR line, and refuse every later release (the job's
        thread may run on for a moment)."""
        if self.stopped or self.finished:
            return
        self.stopped = True
        self.finish("interrupted", error=STOPPED_TEXT)
        log(logging.ERROR, "fedparity: %s", ending_sentence(self.payload, self.path))

    @property
    def finished(self) -> bool:
        return self.payload["status"] in FINAL_STATUSES

    def finish(self, status: str = "completed", **fields: Any) -> None:
        """The run ended with ``status`` (and e.g. ``reason``)."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {', '.join(FINAL_STATUSES)}, got {status!r}")
        self.payload.update(fields)
        self.payload["status"] = status
        self.payload["ended"] = _now()
        results = self.folder / "results.json"
        self.payload["results_file"] = str(results) if results.is_file() else None
        self._write()

    def fail(self, error: BaseException | str) -> None:
        """The run raised ``error`` (or, given as text, could not do its work): say so in the
        folder and, loudly, on the console."""
        interrupted = isinstance(error, (KeyboardInterrupt, SystemExit))
        if isinstance(error, str):
            text = error
        else:  # "KeyboardInterrupt", not "KeyboardInterrupt:" for an exception without text
            text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self.finish("interrupted" if interrupted else "failed", error=text)
        log(logging.ERROR, "fedparity: %s", ending_sentence(self.payload, self.path))


#: Why a run stopped from outside ended (its status's ``error``).
STOPPED_TEXT = "the run was stopped (flwr stop, or a signal to the ServerApp's process)"


class RunStopped(KeyboardInterrupt):
    """Raised in a stopped run's job (:meth:`RunRecord.stop`) at its next release."""


def ending_sentence(payload: Mapping[str, Any], path: Path) -> str:
    """How the run of the status record ``payload`` (read from ``path``) ended, with what it
    released: the job's final ERROR line, and ``fedparity run``'s when the job could not say
    it (a run stopped with ``flwr stop``)."""
    status = str(payload.get("status", "unknown"))
    how = {"failed": "FAILED", "interrupted": "WAS INTERRUPTED"}.get(status, f"is {status}")
    error = payload.get("error")
    released = _released_summary(list(payload.get("releases", [])), payload)
    return (
        f"the {payload.get('task', '?')} run {how}"
        + (f": {error}" if error else "")
        + f". Released before it ended: {released}. Status: {path}"
    )


def _released_summary(releases: list[Mapping[str, Any]], payload: Mapping[str, Any]) -> str:
    rounds = payload.get("fpfl_rounds_released")
    if rounds:
        return f"{rounds} FPFL round(s)"
    if not releases:
        return "nothing"
    return ", ".join(str(item.get("what", "a release")) for item in releases)


def resolve_output_dir(config: RunConfig) -> Path:
    """``output-dir`` (absolute), or a new ``~/.fedparity/runs/<task>-<UTC time>[-n]``."""
    if config.output_dir:
        return Path(config.output_dir).expanduser().resolve()
    return new_run_folder(config.task, DEFAULT_RUNS_DIR)


def open_run_record(config: RunConfig) -> RunRecord:
    """The record of a run of ``config`` in its output folder (:meth:`RunRecord.open`; an
    FPFL run with ``fpfl-resume`` continues the folder's record)."""
    resume = config.task == "fpfl" and config.fpfl_resume
    return RunRecord.open(config, resolve_output_dir(config), resume=resume)
