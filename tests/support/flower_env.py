"""Ports, environment, ``$FLWR_HOME`` connections and waiting, for the Flower processes the
tests start (:mod:`tests.support.flower_processes` says what they guarantee)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import tomli_w

from fedparity.mechanisms.formatting import strip_ansi as library_strip_ansi

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 (tomli ships with flwr)
    import tomli as tomllib  # type: ignore[no-redef]


DEPLOYMENT_FEDERATION = "local-deployment"
SIMULATION_FEDERATION = "local-simulation"
HOST = "127.0.0.1"

T = TypeVar("T")


# --------------------------------------------------------------------------- utilities


def free_port(host: str = HOST) -> int:
    """Return a TCP port that is currently free on ``host``.

    Parameters
    ----------
    host : str, default "127.0.0.1"
        Interface to probe.

    Returns
    -------
    int
        A port number the OS just handed out for an ephemeral bind. Another process
        may grab it before it is used; :func:`local_deployment` and
        :func:`local_simulation` detect that (the server exits) and report it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _free_ports(count: int, host: str = HOST) -> list[int]:
    """Return ``count`` distinct free ports (all sockets held open while choosing)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def strip_ansi(text: str) -> str:
    """Remove ANSI colour codes (Flower colours its log levels unconditionally).

    Parameters
    ----------
    text : str
        Text possibly containing escape sequences.

    Returns
    -------
    str
        The text without ANSI escape sequences.
    """
    return library_strip_ansi(text)


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(strip_ansi(text).splitlines()[-lines:])


def wait_for(
    predicate: Callable[[], T], timeout: float, interval: float = 0.2, what: str = "a condition"
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy.

    Parameters
    ----------
    predicate : Callable[[], T]
        Polled condition; exceptions it raises propagate.
    timeout : float
        Seconds before giving up (the predicate is always called at least once, and
        once more at the deadline).
    interval : float, default 0.2
        Seconds between calls.
    what : str, default "a condition"
        What is awaited, for the error message (e.g. ``"node 3 to go offline"``).

    Returns
    -------
    T
        The first truthy value returned by ``predicate``.

    Raises
    ------
    TimeoutError
        ``timed out after <timeout> s waiting for <what>`` (plus the last value).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"timed out after {timeout:.1f} s waiting for {what} (last value: {value!r})"
            )
        time.sleep(min(interval, remaining))


def flower_executable(name: str) -> str:
    """Return the path of a Flower console script (``flwr``, ``flower-superlink``...).

    The script next to the running interpreter is preferred, so that
    ``/work/venv/bin/python -m pytest`` works without an activated venv.

    Parameters
    ----------
    name : str
        Console-script name.

    Returns
    -------
    str
        Absolute path of the executable.

    Raises
    ------
    FileNotFoundError
        If the script is neither next to ``sys.executable`` nor on ``PATH``.
    """
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"Flower executable {name!r} not found (is flwr installed?)")
    return found


#: The SuperLink's own SuperExec (Flower's, started by the SuperLink) starts one ServerApp, or
#: one simulation, per run: it polls every 0.5 s, not the 0.05 s the nodes' SuperExecs start
#: their first poll with (:func:`child_env`). Each poll costs the SuperLink and the SuperExec
#: about 12 ms of CPU together here (FastAPI, SQLite): 20 a second kept a quarter of a core busy
#: while nothing ran (measured 0.25 CPU-s per second against 0.045 at 0.5 s, idle simulation
#: SuperLink), for the whole of every test that had a SuperLink up.
SUPERLINK_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5"}


def child_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Build the environment for a Flower process or ``flwr`` CLI call.

    Parameters
    ----------
    flwr_home : Path
        Value for ``FLWR_HOME`` (CLI config, installed FABs, update-check cache).
    extra : Mapping[str, str] or None
        Variables that override everything else.

    Returns
    -------
    dict[str, str]
        ``os.environ`` plus: ``FLWR_HOME``; the interpreter's ``bin`` directory first
        on ``PATH`` (SuperLink/SuperNode spawn ``flower-superexec``, ``flwr-serverapp``,
        ``flwr-clientapp`` and ``flwr-simulation`` by name);
        ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``;
        ``FLWR_DISABLE_UPDATE_CHECK=1``; ``FLWR_TELEMETRY_ENABLED=0``;
        ``PYTHONUNBUFFERED=1`` (so ``print`` in apps reaches the log files at once); and
        ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.05`` (a SuperExec's poll for new tasks).
    """
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    # A SuperExec looks for new tasks every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds (1 s by
    # default): a deployed exchange waited for it once per message.
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.05"
    if extra:
        env.update(extra)
    return env


# ------------------------------------------------------------- FLWR_HOME configuration


def write_connection(
    flwr_home: Path,
    name: str,
    address: str,
    *,
    make_default: bool = False,
    root_certificates: Path | None = None,
) -> Path:
    """Add or replace ``[superlink.<name>]`` in ``$FLWR_HOME/config.toml``.

    Without ``root_certificates`` the connection is ``insecure = true`` (plain HTTP); with
    it, ``root-certificates = "<absolute path>"`` and no ``insecure`` key, i.e. HTTPS with
    the server certificate verified against that CA (Flower 1.41 requires the path to be
    absolute, and refuses ``root-certificates`` together with ``insecure = true``).

    Other connections in the file are kept. The project's ``pyproject.toml`` is
    never touched (a ``[tool.flwr.federations]`` table there would be *migrated* by
    ``flwr run``, i.e. the tracked file rewritten).

    Parameters
    ----------
    flwr_home : Path
        The Flower home directory (created if missing).
    name : str
        Connection name, used as ``flwr run <app> <name>``.
    address : str
        ``host:port`` of the SuperLink's HTTP API.
    make_default : bool, default False
        Also make it ``[superlink] default``. A default is set anyway when the file
        has none.
    root_certificates : Path or None
        CA certificate (PEM) that signed the SuperLink's TLS certificate.

    Returns
    -------
    Path
        The path of ``config.toml``.
    """
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    data: dict[str, object] = {}
    if path.exists():
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    superlink = data.setdefault("superlink", {})
    assert isinstance(superlink, dict)
    if root_certificates is None:
        superlink[name] = {"address": address, "insecure": True}
    else:
        ca_path = str(Path(root_certificates).resolve())
        superlink[name] = {"address": address, "root-certificates": ca_path}
    if make_default or "default" not in superlink:
        superlink["default"] = name
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


def _remove_connection(flwr_home: Path, name: str, previous_default: str | None) -> None:
    path = flwr_home / "config.toml"
    if not path.exists():
        return
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    superlink = data.get("superlink")
    if not isinstance(superlink, dict):
        return
    superlink.pop(name, None)
    if superlink.get("default") == name:
        if previous_default is not None and previous_default in superlink:
            superlink["default"] = previous_default
        else:
            superlink.pop("default", None)
    path.write_text(tomli_w.dumps(data), encoding="utf-8")


def _read_default(flwr_home: Path) -> str | None:
    path = flwr_home / "config.toml"
    if not path.exists():
        return None
    superlink = tomllib.loads(path.read_text(encoding="utf-8")).get("superlink", {})
    default = superlink.get("default") if isinstance(superlink, dict) else None
    return default if isinstance(default, str) else None


@contextmanager
def _connection(
    flwr_home: Path, name: str, address: str, root_certificates: Path | None = None
) -> Iterator[Path]:
    previous_default = _read_default(flwr_home)
    path = write_connection(flwr_home, name, address, root_certificates=root_certificates)
    try:
        yield path
    finally:
        _remove_connection(flwr_home, name, previous_default)
