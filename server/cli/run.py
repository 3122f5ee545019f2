"""``fedparity run``: ``flwr run --stream`` with an exit status that says how the run ended.

Flower 1.41's ``flwr run`` exits 0 even when the ServerApp raised, and Ctrl-C only detaches
the client while the run goes on spending privacy. This command runs ``flwr run ... --stream``
with the same arguments (output passed through as it comes, without colour codes unless it
goes to a terminal, and without Flower's notices about the default federation size when
``--federation-config`` sets ``num-supernodes``), reads the run id it prints, then asks Flower
for the run's final status (``flwr list [FEDERATION] --run-id ID --format json``) and exits 0
only for ``finished:completed``. Ctrl-C (or SIGTERM) stops the run with ``flwr stop`` before
exiting.

Exit status: 0 the run completed; 1 it failed, was stopped or its status could not be read;
``flwr run``'s own status if it failed before starting a run; 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ...mechanisms.formatting import strip_ansi
from ._common import UsageError

__all__ = ["COMPLETED", "add_parser", "flwr_executable", "run_status", "run_with_status"]

#: Flower's status of a run that ended as planned.
COMPLETED = "finished:completed"
#: What ``flwr run`` prints once the SuperLink accepted the run.
_RUN_ID = re.compile(r"Successfully started run (\d+)")
#: The job's first line: where its status file is.
_STATUS_FILE = re.compile(r"fedparity [\w-]+: status in (.+?); to stop the run")
#: Flower's notices about the simulated federation's size: they do not apply to a run whose
#: ``--federation-config`` sets ``num-supernodes``, and are left out of its output then.
SIZE_NOTICES = (
    "default simulated SuperNodes changed from 10 to 2",
    "To change federation size, use the following command:",
    "flwr federation simulation-config",
)
#: ``flwr run`` options followed by a value.
_VALUE_OPTIONS = ("--run-config", "-c", "--federation-config", "--federation", "--format")
#: Seconds allowed for the status to leave ``running`` after ``flwr run --stream`` returned.
STATUS_WAIT_SECONDS = 60.0


def flwr_executable() -> str:
    """The ``flwr`` of this Python's environment (beside ``sys.executable``), else on PATH."""
    beside = Path(sys.executable).with_name("flwr")
    if beside.exists():
        return str(beside)
    found = shutil.which("flwr")
    if found is None:
        raise UsageError("no flwr command found: install flwr (pip install flwr)")
    return found


def _federation(flwr_args: Sequence[str]) -> str | None:
    """The federation ``flwr run`` was given: its second positional argument (None: the
    default connection). Options that take a value (``--run-config X``) are skipped."""
    positionals: list[str] = []
    skip = False
    for arg in flwr_args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _VALUE_OPTIONS
        else:
            positionals.append(arg)
    return positionals[1] if len(positionals) > 1 else None


def run_status(
    run_id: int, federation: str | None, timeout: float = STATUS_WAIT_SECONDS
) -> tuple[str, str]:
    """``(status, details)`` of run ``run_id`` from ``flwr list``, waiting up to ``timeout``
    seconds while it still reads ``running`` or ``starting`` (``("unknown", why)`` if it
    cannot be read)."""
    command = [flwr_executable(), "list", *([federation] if federation else [])]
    command += ["--run-id", str(run_id), "--format", "json"]
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(  # noqa: S603 - flwr of this environment, fixed arguments
            command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
        )
        try:
            start = done.stdout.index("{")
            run: dict[str, Any] = json.loads(done.stdout[start:])["runs"][0]
            status, details = str(run["status"]), str(run.get("status-details", ""))
        except (ValueError, KeyError, IndexError, TypeError):
            text = " ".join((done.stdout + done.stderr).split())[-300:]
            return "unknown", f"flwr list gave no status (exit {done.returncode}): {text}"
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def _stop(run_id: int, federation: str | None, err: TextIO) -> None:
    """``flwr stop`` the run (best effort) and say so."""
    command = [flwr_executable(), "stop", str(run_id), *([federation] if federation else [])]
    done = subprocess.run(  # noqa: S603 - flwr of this environment, fixed arguments
        command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
    )
    outcome = "stopped" if done.returncode == 0 else f"flwr stop exited {done.returncode}"
    err.write(f"fedparity run: run {run_id} {outcome} ({' '.join(command[1:])})\n")


def run_with_status(flwr_args: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Run ``flwr run *flwr_args --stream``, pass its output to ``out``, and return the exit
    status of the run's outcome (see the module's docstring)."""
    args = list(flwr_args)
    if "--stream" not in args:
        args.append("--stream")
    federation = _federation(args)
    process = subprocess.Popen(  # noqa: S603 - flwr of this environment
        [flwr_executable(), "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,  # Ctrl-C reaches this command only: it stops the run itself
    )
    colour = bool(getattr(out, "isatty", lambda: False)())  # codes only for a terminal
    sized = any("num-supernodes" in arg for arg in args)
    run_id: int | None = None
    status_file: Path | None = None
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            plain = strip_ansi(line)
            if not (sized and any(notice in plain for notice in SIZE_NOTICES)):
                out.write(line if colour else plain)
                out.flush()
            if run_id is None and (match := _RUN_ID.search(plain)):
                run_id = int(match.group(1))
            if status_file is None and (match := _STATUS_FILE.search(plain)):
                status_file = Path(match.group(1))
        code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait()
        if run_id is not None:
            _stop(run_id, federation, err)
            run_status(run_id, federation, timeout=30.0)  # until the ServerApp has stopped
            _report_ending(status_file, err)
        else:
            err.write("fedparity run: interrupted before a run was started\n")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if run_id is None:
        err.write(f"fedparity run: flwr run started no run (exit {code})\n")
        return code or 1
    status, details = run_status(run_id, federation)
    line = f"fedparity run: run {run_id} {status}"
    if details and details != "N/A":
        line += f": {details}"
    err.write(line + "\n")
    if status != COMPLETED:
        _report_ending(status_file, err)
    return 0 if status == COMPLETED else 1


def _report_ending(status_file: Path | None, err: TextIO, wait: float = 15.0) -> None:
    """The job's own account of how it ended, from its status file when this machine can
    read it (a run stopped with ``flwr stop`` cannot print its final ERROR line itself: its
    ServerApp records the stop as it exits, so a file still reading ``running`` is read again
    for up to ``wait`` seconds)."""
    from ..run_record import STATUS_FILE, ending_sentence

    # The path comes from the streamed log: only a job's status file is read, never another file.
    if status_file is None or status_file.name != STATUS_FILE or not status_file.is_file():
        return
    deadline = time.monotonic() + wait
    while True:
        try:
            payload = json.loads(status_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(payload, dict):
            return
        if payload.get("status") != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    err.write(f"fedparity run: {ending_sentence(payload, status_file)}\n")


def run_run(args: argparse.Namespace, out: TextIO) -> int:
    return run_with_status(args.flwr_args, out, sys.stderr)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity run``."""
    parser = commands.add_parser(
        "run",
        help="flwr run --stream with an exit status that says how the run ended",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run 'flwr run ARGS --stream' (same arguments: APP, FEDERATION, --run-config ...),\n"
            "then exit 0 only if Flower says the run finished:completed (flwr run itself\n"
            "exits 0 when the job failed); 1 otherwise. Ctrl-C stops the run with flwr stop.\n\n"
            "examples:\n"
            "  fedparity run .\n"
            "  fedparity run . local-deployment --run-config configs/adult-fpfl.toml"
        ),
        usage="fedparity run [APP] [FEDERATION] [flwr run options]",
    )
    parser.add_argument("flwr_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
