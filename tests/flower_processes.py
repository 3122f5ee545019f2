"""Start, drive and stop real Flower 1.41 processes for tests and benchmarks.

Plain functions and context managers (no pytest fixtures), so that both the test
suite and the benchmarks can import them::

    from tests.flower_processes import local_deployment, local_simulation

    with local_deployment(app_dir, 3, None, flwr_home) as dep:
        run = dep.run({"num-server-rounds": 1, "output-dir": str(out)})
    print(run.output)

What this module guarantees (measured facts are in ``/work/notes/flower-runtime.md``):

* Nothing is installed at run time: the SuperLink gets
  ``--disable-runtime-dependency-installation`` (SuperNodes never install by
  default) and every child process gets ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``.
* Every process listens on 127.0.0.1 on a port chosen with :func:`free_port`; in
  Flower 1.41 a SuperLink serves its Fleet, Control and Runtime (ServerAppIo) APIs
  on ONE HTTP port (``--port``) and each SuperNode serves its ClientAppIo API on its
  own ``--port``. Nothing uses the fixed default ports (8000, 9094, 39091).
* Plain HTTP (``--insecure``) by default; ``local_deployment(..., tls=..., node_auth=True)``
  serves the SuperLink over TLS with certificates from :mod:`tests.flower_tls` and admits
  only SuperNodes whose keys were registered (``flwr supernode register``), see
  ``docs/deployment-security.md``.
* The managed local SuperLink of ``flwr run`` (fixed port 39091, detached, left
  running after the run, shared across ``FLWR_HOME`` values) is never used: the
  federations written to ``$FLWR_HOME/config.toml`` have explicit addresses.
* On exit, exactly the processes started here are stopped, together with their
  descendants (SuperExec, ``flwr-serverapp``/``flwr-clientapp``/``flwr-simulation``,
  Ray): SIGTERM to each process group, then SIGKILL after a grace period.
* ``flwr run`` exits with 0 even when the ServerApp raised; :func:`run_flwr` asks the
  SuperLink for the run status and raises :class:`FlwrRunError` unless it is
  ``finished:completed`` (``check=True``).
* Faults (:class:`Deployment`): every kill is a SIGKILL of a whole process tree (a
  crash). Flower 1.41 notices dead processes only through heartbeats (30 s interval,
  patience 2, fixed: no CLI option on ``flower-superlink``/``flower-supernode``; the
  tests' SuperNodes, started by ``tests/fast_supernode.py``, announce the SuperLink's
  minimum of 10 s instead), so:

  - a killed SuperNode stays ``online`` (listed by ``grid.get_node_ids()``) until two
    intervals after its last heartbeat: 38-60 s after the kill at Flower's 30 s
    (measured 42, 51, 60 s), 16-20 s for the tests' SuperNodes; at
    that moment a message to it gets an error reply (src node 1, code 5, ``Error: Node
    Unavailable``). A restarted SuperNode registers as a new node (new id);
  - a killed ``flwr-serverapp`` leaves its run ``running`` until 60 s after the task's
    last heartbeat, then ``finished:failed`` (``No heartbeat received from the task``);
    ``flwr run --stream`` then exits with 0 (measured 61 s after the kill);
  - a killed SuperLink makes ``flwr run --stream`` exit with 1 at once (``Connection to
    the SuperLink is unavailable``). Restarted on its database, it lists the run as
    ``running`` until ~60 s after the last task heartbeat, then ``finished:failed``
    (never resumed); the SuperNodes keep running, retry (back-off <= 20 s) and carry on
    with the same node ids.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

import tomli_w

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 (tomli ships with flwr)
    import tomli as tomllib  # type: ignore[no-redef]

try:
    from tests.flower_tls import NodeKey, TlsMaterial, make_node_key
except ImportError:  # pragma: no cover - tests/ itself on sys.path (benchmarks)
    from flower_tls import (  # type: ignore[no-redef, import-not-found]
        NodeKey,
        TlsMaterial,
        make_node_key,
    )

__all__ = [
    "DEPLOYMENT_FEDERATION",
    "SIMULATION_FEDERATION",
    "BackgroundRun",
    "Deployment",
    "FlowerProcessError",
    "FlwrRun",
    "FlwrRunError",
    "ManagedProcess",
    "NodeKey",
    "RunConfigValue",
    "Simulation",
    "TlsMaterial",
    "child_env",
    "flower_executable",
    "format_run_config",
    "free_port",
    "local_deployment",
    "local_simulation",
    "register_supernode",
    "run_flwr",
    "run_status",
    "start_flwr_run",
    "strip_ansi",
    "supernode_statuses",
    "unregister_supernode",
    "wait_for",
    "write_connection",
]

DEPLOYMENT_FEDERATION = "local-deployment"
SIMULATION_FEDERATION = "local-simulation"
HOST = "127.0.0.1"

RunConfigValue = bool | int | float | str
T = TypeVar("T")

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RUN_ID_RE = re.compile(r"Successfully started run (\d+)")
_NODE_ID_RE = re.compile(r"SuperNode ID: (\d+)")
_CONFIG_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class _NotInlineError(ValueError):
    """A run-config value that Flower's inline ``key=value`` parser cannot carry."""


class FlowerProcessError(RuntimeError):
    """A Flower process failed to start, died, or did not become ready in time."""


class FlwrRunError(RuntimeError):
    """``flwr run`` failed, timed out, or the run did not finish as ``completed``.

    Parameters
    ----------
    message : str
        What went wrong; the tail of the captured output is appended.
    result : FlwrRun or None
        The captured process result, when ``flwr run`` returned at all.
    """

    def __init__(self, message: str, result: FlwrRun | None = None) -> None:
        self.result = result
        tail = ""
        if result is not None:
            tail = "\n--- flwr run output (tail) ---\n" + _tail_text(result.output, 60)
        super().__init__(message + tail)


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
    return _ANSI_RE.sub("", text)


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


# ------------------------------------------------------------------ process handling


@dataclass
class ManagedProcess:
    """A Flower process started by this module, with its log file.

    Attributes
    ----------
    name : str
        Short label (``superlink``, ``supernode-0``...).
    popen : subprocess.Popen[bytes]
        The process; it leads its own session/process group.
    log_path : Path
        File receiving its stdout and stderr.
    port : int
        The HTTP port it listens on.
    cmd : list[str]
        The command line, kept so that :meth:`relaunch` can start it again.
    cwd : Path or None
        Its working directory.
    env : dict[str, str]
        Its complete environment (``HOME``, ``FLWR_HOME``...).
    launches : int
        How many times it was started (1, plus one per :meth:`relaunch`).
    tls_ca : Path or None
        When its HTTP port serves HTTPS (a SuperLink with TLS): the CA certificate that
        verifies it, used for the ``/health`` probe. None: plain HTTP.
    """

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int
    cmd: list[str] = field(default_factory=list)
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict, repr=False)
    launches: int = 1
    tls_ca: Path | None = None
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Process id (also the process-group id)."""
        return self.popen.pid

    def alive(self) -> bool:
        """Return True while the process has not exited."""
        return self.popen.poll() is None

    def log_text(self) -> str:
        """Return the whole log, ANSI codes removed."""
        try:
            return strip_ansi(self.log_path.read_text(encoding="utf-8", errors="replace"))
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 30) -> str:
        """Return the last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_size(self) -> int:
        """Current size of the log in bytes (an offset for :meth:`log_text_since`)."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_text_since(self, offset: int) -> str:
        """Return the log from byte ``offset`` on, ANSI codes removed."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return ""
        return strip_ansi(data.decode("utf-8", errors="replace"))

    def relaunch(self) -> None:
        """Start :attr:`cmd` again (same cwd, environment and port), appending to the log.

        A ``--- relaunch N ---`` line is written to the log first. The object is
        updated in place (new :attr:`popen`), so whoever stops the processes later
        stops the new one.

        Raises
        ------
        FlowerProcessError
            If the process is still running or has no recorded command.
        """
        if self.alive():
            raise FlowerProcessError(f"{self.name} is still running (pid {self.pid})")
        if not self.cmd:
            raise FlowerProcessError(f"{self.name} has no recorded command to relaunch")
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.launches += 1
        log_file = self.log_path.open("ab")
        log_file.write(f"\n--- relaunch {self.launches} of {self.name} ---\n".encode())
        log_file.flush()
        try:
            self.popen = _popen(self.cmd, self.cwd, self.env, log_file)
        except BaseException:
            log_file.close()
            raise
        self._log_file = log_file


def _popen(
    cmd: Sequence[str], cwd: Path | None, env: Mapping[str, str], log_file: IO[bytes]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - fixed executables, no shell
        list(cmd),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _start(
    name: str,
    cmd: Sequence[str],
    log_path: Path,
    cwd: Path,
    env: Mapping[str, str],
    port: int,
    tls_ca: Path | None = None,
) -> ManagedProcess:
    log_file = log_path.open("wb")
    try:
        popen = _popen(cmd, cwd, env, log_file)
    except BaseException:
        log_file.close()
        raise
    return ManagedProcess(
        name,
        popen,
        log_path,
        port,
        cmd=list(cmd),
        cwd=cwd,
        env=dict(env),
        tls_ca=tls_ca,
        _log_file=log_file,
    )


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """Return ``(state, ppid, starttime)`` of ``pid`` from /proc, or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces: split after it.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _descendants(pid: int) -> dict[int, int]:
    """Return ``{pid: starttime}`` of all current descendants of ``pid`` (Linux /proc).

    Empty where /proc is unavailable (then only process groups are signalled).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: dict[int, int] = {}
    stack = list(children.get(pid, []))
    while stack:
        child, starttime = stack.pop()
        if child not in found:
            found[child] = starttime
            stack.extend(children.get(child, []))
    return found


def _same_process_running(pid: int, starttime: int) -> bool:
    """True if ``pid`` is still the process recorded earlier and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[2] == starttime and stat[0] != "Z"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cmdline(pid: int) -> list[str]:
    """Return the argv of ``pid`` from /proc (empty if gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def _kill_tree(proc: ManagedProcess | int, timeout: float = 10.0) -> dict[int, int]:
    """SIGKILL a process, its process group and all its descendants, like ``kill -9``.

    The tree is first frozen with SIGSTOP, top down and repeated until no new
    descendant appears, so that nothing forks or is re-parented to PID 1 between
    recording and killing; then everything gets SIGKILL. Returns once every recorded
    process is gone (zombies count as gone) and, for a :class:`ManagedProcess`, the
    process is reaped and its log file closed.

    Parameters
    ----------
    proc : ManagedProcess or int
        A process started here, or a pid.
    timeout : float, default 10.0
        Seconds to wait for the processes to disappear.

    Returns
    -------
    dict[int, int]
        ``{pid: starttime}`` of the killed descendants (not the process itself).

    Raises
    ------
    FlowerProcessError
        If a process is still running after ``timeout`` seconds.
    """
    root = proc.pid if isinstance(proc, ManagedProcess) else proc
    root_stat = _proc_stat(root)
    _signal_pid(root, signal.SIGSTOP)
    frozen: dict[int, int] = {}
    while True:
        new = {pid: st for pid, st in _descendants(root).items() if pid not in frozen}
        if not new:
            break
        for pid, starttime in new.items():
            if _same_process_running(pid, starttime):
                _signal_pid(pid, signal.SIGSTOP)
        frozen |= new
    if isinstance(proc, ManagedProcess):
        if proc.alive():
            _signal_group(root, signal.SIGKILL)
    elif root_stat is not None and _same_process_running(root, root_stat[2]):
        _signal_pid(root, signal.SIGKILL)
    for pid, starttime in frozen.items():
        if _same_process_running(pid, starttime):
            _signal_pid(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    if isinstance(proc, ManagedProcess):
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if proc._log_file is not None:
            proc._log_file.close()
            proc._log_file = None
    pending = dict(frozen)
    if root_stat is not None and not isinstance(proc, ManagedProcess):
        pending[root] = root_stat[2]
    while pending := {p: st for p, st in pending.items() if _same_process_running(p, st)}:
        if time.monotonic() > deadline:
            raise FlowerProcessError(f"processes still running after SIGKILL: {sorted(pending)}")
        time.sleep(0.05)
    if isinstance(proc, ManagedProcess) and proc.alive():
        raise FlowerProcessError(f"{proc.name} (pid {proc.pid}) survived SIGKILL")
    return frozen


def _stop_processes(processes: Sequence[ManagedProcess], grace: float) -> None:
    """Stop ``processes`` and every descendant: SIGTERM, wait ``grace`` s, SIGKILL.

    Descendants are recorded (pid and start time) *before* signalling, because the
    SuperLink detaches its SuperExec into a new session, Ray's processes live in the
    SuperExec's group (outside our process groups), and orphans are re-parented to
    PID 1. A recorded pid is only killed if its start time still matches.
    """
    owned: dict[int, int] = {}
    for proc in processes:
        owned |= _descendants(proc.pid)
    for proc in processes:
        if proc.alive():
            _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in processes:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # Processes spawned during the grace period are caught too (while still parented).
    for proc in processes:
        if proc.alive():
            owned |= _descendants(proc.pid)
    for proc in processes:
        if proc.alive():
            _signal_group(proc.pid, signal.SIGKILL)
    # Give children a moment to follow their parent (they watch --parent-pid).
    settle = time.monotonic() + min(grace, 3.0)
    while time.monotonic() < settle and any(
        _same_process_running(pid, st) for pid, st in owned.items()
    ):
        time.sleep(0.1)
    for pid, starttime in owned.items():
        if _same_process_running(pid, starttime):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in processes:
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if proc._log_file is not None:
            proc._log_file.close()
            proc._log_file = None


def _http_ok(
    port: int, path: str = "/health", timeout: float = 0.5, ca: Path | None = None
) -> bool:
    """GET ``http://127.0.0.1:port/path`` (``https://`` verified against ``ca`` if given)."""
    scheme, context = "http", None
    if ca is not None:
        scheme, context = "https", ssl.create_default_context(cafile=str(ca))
    url = f"{scheme}://{HOST}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _owns_listening_port(pid: int, port: int) -> bool | None:
    """Whether ``pid`` holds the socket listening on ``127.0.0.1:port``.

    Guards against a port grabbed by someone else between :func:`free_port` and
    the bind: then ``/health`` may answer while our process is about to fail.
    Returns None when /proc cannot tell (non-Linux).
    """
    inodes: set[str] = set()
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        # local_address is "0100007F:PORT" (hex), st "0A" is LISTEN.
        if len(cols) > 9 and cols[3] == "0A" and int(cols[1].split(":")[1], 16) == port:
            inodes.add(cols[9])
    if not inodes:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def _startup_error(message: str, processes: Sequence[ManagedProcess]) -> FlowerProcessError:
    parts = [message]
    for proc in processes:
        state = "running" if proc.alive() else f"exited with code {proc.popen.returncode}"
        parts.append(f"--- {proc.name} (pid {proc.pid}, {state}, log {proc.log_path}) ---")
        parts.append(proc.tail(25) or "<empty log>")
    return FlowerProcessError("\n".join(parts))


def _wait_http_ready(
    procs: Sequence[ManagedProcess], deadline: float, all_procs: Sequence[ManagedProcess]
) -> None:
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if not proc.alive():
                raise _startup_error(
                    f"{proc.name} exited during start-up (port {proc.port} taken?)", all_procs
                )
            ready = _http_ok(proc.port, ca=proc.tls_ca)
            if ready and _owns_listening_port(proc.pid, proc.port) is not False:
                pending.remove(proc)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise _startup_error(f"timed out waiting for /health of: {names}", all_procs)
        time.sleep(0.1)


# ------------------------------------------------------------------------ flwr run


class FlwrRun(subprocess.CompletedProcess[str]):
    """Result of :func:`run_flwr`: a ``CompletedProcess`` plus the run's identity.

    Attributes
    ----------
    run_id : int or None
        Parsed from ``Successfully started run <id>``.
    status : str or None
        ``finished:completed``, ``finished:failed``... as reported by ``flwr list``
        (None when the status was not queried or could not be read).
    status_details : str or None
        The SuperLink's details, e.g. ``ServerApp failed with exception: ...``.
    duration : float
        Wall-clock seconds of the ``flwr run`` call.
    """

    def __init__(
        self,
        args: list[str],
        returncode: int,
        stdout: str,
        stderr: str,
        duration: float,
    ) -> None:
        super().__init__(args, returncode, stdout, stderr)
        match = _RUN_ID_RE.search(strip_ansi(stdout))
        self.run_id: int | None = int(match.group(1)) if match else None
        self.status: str | None = None
        self.status_details: str | None = None
        self.duration = duration

    @property
    def output(self) -> str:
        """Stdout followed by stderr, ANSI codes removed (ServerApp logs are in stdout)."""
        return strip_ansi(self.stdout) + strip_ansi(self.stderr)


def format_run_config(run_config: Mapping[str, RunConfigValue]) -> str:
    """Render a dict as one ``--run-config`` string for Flower's parser.

    Flower splits the string with ``(\\S+?)=('[^']*'|"[^"]*"|\\S+)`` and parses each
    value as TOML. Strings therefore become TOML literal strings ``'...'`` (no
    escapes, backslashes kept) or, if they contain ``'``, basic strings ``"..."``.

    Parameters
    ----------
    run_config : Mapping[str, bool | int | float | str]
        Keys must exist in ``[tool.flwr.app.config]`` (the SuperLink rejects unknown
        keys: ``[code: 15] Invalid run configuration.``). Dotted keys address nested
        tables.

    Returns
    -------
    str
        E.g. ``num-server-rounds=3 epsilons='0.5,1' ground-truth=true``.

    Raises
    ------
    ValueError
        For an invalid key, a non-scalar value, a string containing both quote
        characters or a newline (use a TOML file instead: :func:`run_flwr` does so
        automatically), or a value type Flower cannot carry.
    """
    parts: list[str] = []
    for key, value in run_config.items():
        if not _CONFIG_KEY_RE.match(key):
            raise ValueError(f"run-config key {key!r} is not a bare/dotted TOML key")
        parts.append(f"{key}={_format_value(key, value)}")
    return " ".join(parts)


def _format_value(key: str, value: RunConfigValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)  # 'inf', 'nan', '1e-05' are valid TOML floats
        return text if ("." in text or "e" in text or "n" in text) else text + ".0"
    if isinstance(value, str):
        if "\n" in value or "\r" in value:
            raise _NotInlineError(f"run-config value for {key!r} contains a newline")
        if "'" not in value:
            return f"'{value}'"
        if '"' not in value:
            return '"' + value.replace("\\", "\\\\").replace("\t", "\\t") + '"'
        raise _NotInlineError(f"run-config value for {key!r} contains both ' and \"")
    raise ValueError(f"run-config value for {key!r} has unsupported type {type(value)}")


def _run_config_args(
    run_config: Mapping[str, RunConfigValue] | Path | None, scratch: Path, app_dir: Path
) -> list[str]:
    if run_config is None:
        return []
    if isinstance(run_config, Path):
        path = run_config if run_config.is_absolute() else app_dir / run_config
        if path.suffix != ".toml" or not path.is_file():
            raise ValueError(f"run-config file {path} must be an existing *.toml file")
        # Flower treats a single --run-config value ending in ".toml" as a file path,
        # resolved against the CLI's working directory: pass it absolute.
        return ["--run-config", str(path.resolve())]
    if not run_config:
        return []
    try:
        return ["--run-config", format_run_config(run_config)]
    except _NotInlineError:
        pass
    # Values the inline parser cannot carry: pass a TOML file (flwr flattens it).
    path = scratch / "run-config.toml"
    path.write_text(tomli_w.dumps(dict(run_config)), encoding="utf-8")
    return ["--run-config", str(path)]


def _check_app_dir(app_dir: Path) -> None:
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise FileNotFoundError(f"{pyproject} not found: not a Flower App directory")
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    if "federations" in data.get("tool", {}).get("flwr", {}):
        raise ValueError(
            f"{pyproject} has [tool.flwr.federations]: `flwr run` would migrate it into "
            "$FLWR_HOME/config.toml and rewrite pyproject.toml. Remove that table."
        )


def run_status(
    run_id: int, federation: str, flwr_home: Path, timeout: float = 60.0
) -> tuple[str, str]:
    """Return ``(status, details)`` of a run via ``flwr list <fed> --run-id <id>``.

    Parameters
    ----------
    run_id : int
        The run to look up.
    federation : str
        SuperLink connection name in ``$FLWR_HOME/config.toml``.
    flwr_home : Path
        The ``FLWR_HOME`` holding that connection.
    timeout : float, default 60.0
        Seconds allowed for the CLI call.

    Returns
    -------
    tuple[str, str]
        E.g. ``("finished:completed", "N/A")`` or
        ``("finished:failed", "ServerApp failed with exception: ...")``.

    Raises
    ------
    FlwrRunError
        If the CLI fails or its JSON cannot be read.
    """
    proc = _flwr_cli(
        flwr_home, ["list", federation, "--run-id", str(run_id), "--format", "json"], timeout
    )
    try:
        run = _cli_json(proc)["runs"][0]
        return str(run["status"]), str(run.get("status-details", ""))
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise FlwrRunError(
            f"could not read the status of run {run_id} (exit {proc.returncode}):\n"
            f"{_tail_text(proc.stdout + proc.stderr, 20)}"
        ) from err


def supernode_statuses(federation: str, flwr_home: Path, timeout: float = 60.0) -> dict[int, str]:
    """Return ``{node_id: status}`` via ``flwr supernode list <fed> --format json``.

    Parameters
    ----------
    federation : str
        SuperLink connection name in ``$FLWR_HOME/config.toml``.
    flwr_home : Path
        The ``FLWR_HOME`` holding that connection.
    timeout : float, default 60.0
        Seconds allowed for the CLI call.

    Returns
    -------
    dict[int, str]
        Every node the SuperLink has on record, with status ``online``,
        ``offline``, ``registered`` or ``unregistered``. The ``online`` ones are
        exactly what ``grid.get_node_ids()`` gives a ServerApp:
        both read the same state, which marks a node ``offline`` once its heartbeat
        is overdue (2 x 30 s after the last one in Flower 1.41).

    Raises
    ------
    FlwrRunError
        If the CLI fails or its JSON cannot be read.
    """
    proc = _flwr_cli(flwr_home, ["supernode", "list", federation, "--format", "json"], timeout)
    try:
        nodes = _cli_json(proc)["nodes"]
        return {int(node["node-id"]): str(node["status"]) for node in nodes}
    except (ValueError, KeyError, TypeError) as err:
        raise FlwrRunError(
            f"could not list the SuperNodes (exit {proc.returncode}):\n"
            f"{_tail_text(proc.stdout + proc.stderr, 20)}"
        ) from err


def unregister_supernode(
    node_id: int, federation: str, flwr_home: Path, timeout: float = 60.0
) -> None:
    """Unregister a node via ``flwr supernode unregister <node_id> <fed>``.

    The SuperLink drops it at once: its status becomes ``unregistered`` and
    ``grid.get_node_ids()`` no longer returns it. Useful to forget the id a killed
    SuperNode leaves behind (otherwise ``online`` until its heartbeat is overdue,
    and a message sent to it waits that long for a ``Node Unavailable`` error).

    Raises
    ------
    FlwrRunError
        If the CLI exits with an error.
    """
    proc = _flwr_cli(flwr_home, ["supernode", "unregister", str(node_id), federation], timeout)
    if proc.returncode != 0:
        raise FlwrRunError(
            f"could not unregister node {node_id} (exit {proc.returncode}):\n"
            f"{_tail_text(proc.stdout + proc.stderr, 20)}"
        )


def register_supernode(
    public_key: Path, federation: str, flwr_home: Path, timeout: float = 60.0
) -> int:
    """Authorise a SuperNode key via ``flwr supernode register <public_key> <fed>``.

    Flower 1.41's SuperNode authentication (``flower-superlink --enable-supernode-auth``):
    the SuperLink's Fleet API no longer lets a SuperNode register itself; the operator
    registers each node's public key through the Control API, and the node created there
    (status ``registered``) is activated when a SuperNode started with the matching
    ``--auth-supernode-private-key`` connects (every Fleet request is signed with it).

    Parameters
    ----------
    public_key : Path
        OpenSSH public key on a NIST EC curve (``ecdsa-sha2-nistp384 ...``).
    federation : str
        SuperLink connection name in ``$FLWR_HOME/config.toml``.
    flwr_home : Path
        The ``FLWR_HOME`` holding that connection.
    timeout : float, default 60.0
        Seconds allowed for the CLI call.

    Returns
    -------
    int
        The node id the SuperLink assigned (the SuperNode logs the same ``SuperNode ID``).

    Raises
    ------
    FlwrRunError
        If the CLI fails (e.g. ``[code: 23] Public key already in use``).
    """
    args = ["supernode", "register", str(Path(public_key).resolve()), federation]
    proc = _flwr_cli(flwr_home, [*args, "--format", "json"], timeout)
    try:
        return int(_cli_json(proc)["node-id"])
    except (ValueError, KeyError, TypeError) as err:
        raise FlwrRunError(
            f"could not register the SuperNode key {public_key} (exit {proc.returncode}):\n"
            f"{_tail_text(proc.stdout + proc.stderr, 20)}"
        ) from err


def _flwr_cli(
    flwr_home: Path, args: Sequence[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603
        [flower_executable("flwr"), *args],
        env=child_env(flwr_home),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _cli_json(proc: subprocess.CompletedProcess[str]) -> dict:
    """The JSON object a ``flwr ... --format json`` call printed (``{}`` if none)."""
    start = proc.stdout.find("{")
    return json.loads(proc.stdout[start:]) if start >= 0 else {}


def _stop_run(run_id: int, federation: str, flwr_home: Path) -> None:
    """Best effort ``flwr stop`` of a run left behind by a timed-out ``flwr run``."""
    try:
        _flwr_cli(flwr_home, ["stop", str(run_id), federation], 30)
    except (subprocess.TimeoutExpired, OSError):
        pass


def run_flwr(
    app_dir: Path,
    federation: str,
    run_config: Mapping[str, RunConfigValue] | Path | None,
    flwr_home: Path,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    *,
    federation_config: Mapping[str, RunConfigValue] | None = None,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> FlwrRun:
    """Run ``flwr run <app_dir> <federation> --stream`` and wait for the run to end.

    Parameters
    ----------
    app_dir : Path
        The Flower App (directory with ``pyproject.toml``). It must not contain
        ``[tool.flwr.federations]`` (``flwr run`` would rewrite the file).
    federation : str
        SuperLink connection name in ``$FLWR_HOME/config.toml`` (e.g.
        ``deployment.federation``). Never use one whose address is ``:local:``
        here: that starts Flower's detached managed SuperLink on port 39091.
    run_config : Mapping[str, bool | int | float | str], Path or None
        Overrides of ``[tool.flwr.app.config]``. A mapping is rendered by
        :func:`format_run_config` (or, for strings holding both quote characters or
        newlines, written to a temporary TOML file). A ``Path`` to a ``*.toml`` file
        (relative paths are taken from ``app_dir``, e.g. ``Path("configs/x.toml")``)
        is passed as ``--run-config /abs/path.toml``.
    flwr_home : Path
        ``FLWR_HOME`` for the CLI.
    timeout : float, default 300.0
        Seconds before ``flwr run`` is killed, the run is stopped on the SuperLink
        (best effort ``flwr stop``) and :class:`FlwrRunError` is raised.
    extra_args : Sequence[str], default ()
        Appended to the command line.
    federation_config : Mapping or None
        Simulation settings sent as ``--federation-config`` (e.g.
        ``{"num-supernodes": 10, "client-resources-num-cpus": 1}``).
    check : bool, default True
        Raise :class:`FlwrRunError` unless ``flwr run`` exits with 0 *and* the run's
        status is ``finished:completed``. (``flwr run --stream`` exits with 0 even when
        the ServerApp raised, so the status is queried with ``flwr list``.)
    env : Mapping[str, str] or None
        Extra environment variables for the CLI.
    cwd : Path or None
        Working directory of the CLI (default: ``app_dir``).

    Returns
    -------
    FlwrRun
        ``CompletedProcess`` with ``stdout`` (contains the streamed ServerApp logs),
        ``stderr``, ``run_id``, ``status``, ``status_details``, ``duration``.

    Raises
    ------
    FlwrRunError
        On timeout, or (with ``check``) on a non-zero exit or a failed run.
    """
    background = start_flwr_run(
        app_dir,
        federation,
        run_config,
        flwr_home,
        timeout,
        extra_args,
        federation_config=federation_config,
        env=env,
        cwd=cwd,
    )
    result = background.wait()
    if check:
        if result.returncode != 0 or result.run_id is None:
            raise FlwrRunError(f"`flwr run` exited with code {result.returncode}", result)
        if result.status is None:
            _fill_status(result, federation, flwr_home)  # raises if unreadable
        if result.status != "finished:completed":
            raise FlwrRunError(
                f"run {result.run_id} ended as {result.status!r}: {result.status_details}",
                result,
            )
    return result


def start_flwr_run(
    app_dir: Path,
    federation: str,
    run_config: Mapping[str, RunConfigValue] | Path | None,
    flwr_home: Path,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    *,
    federation_config: Mapping[str, RunConfigValue] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> BackgroundRun:
    """Start ``flwr run <app_dir> <federation> --stream`` and return at once.

    Same command and parameters as :func:`run_flwr` (which is this function followed
    by :meth:`BackgroundRun.wait`). ``flwr run`` leads its own process group; its
    stdout and stderr go to files in a private temporary directory, so nothing has
    to read them while the run is in progress.

    Returns
    -------
    BackgroundRun
        Handle: :attr:`BackgroundRun.run_id` once the run was submitted,
        :meth:`BackgroundRun.wait` for the result.
    """
    app_dir = Path(app_dir).resolve()
    _check_app_dir(app_dir)
    scratch = tempfile.TemporaryDirectory(prefix="flwr-run-")
    try:
        cmd = [flower_executable("flwr"), "run", str(app_dir), federation, "--stream"]
        cmd += _run_config_args(run_config, Path(scratch.name), app_dir)
        if federation_config:
            cmd += ["--federation-config", format_run_config(federation_config)]
        cmd += list(extra_args)
        stdout_path = Path(scratch.name) / "stdout.txt"
        stderr_path = Path(scratch.name) / "stderr.txt"
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            popen = subprocess.Popen(  # noqa: S603
                cmd,
                cwd=cwd or app_dir,
                env=child_env(flwr_home, env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
    except BaseException:
        scratch.cleanup()
        raise
    return BackgroundRun(cmd, popen, scratch, federation, Path(flwr_home), timeout)


class BackgroundRun:
    """A ``flwr run --stream`` in progress, started by :func:`start_flwr_run`.

    Parameters
    ----------
    cmd : list[str]
        The command line.
    popen : subprocess.Popen[bytes]
        The ``flwr run`` process (leader of its own process group).
    scratch : tempfile.TemporaryDirectory[str]
        Directory holding ``stdout.txt``/``stderr.txt`` (removed by :meth:`wait`).
    federation : str
        SuperLink connection name, for the status query.
    flwr_home : Path
        ``FLWR_HOME`` of the CLI.
    timeout : float
        Seconds, counted from the start, after which :meth:`wait` gives up.
    """

    def __init__(
        self,
        cmd: list[str],
        popen: subprocess.Popen[bytes],
        scratch: tempfile.TemporaryDirectory[str],
        federation: str,
        flwr_home: Path,
        timeout: float,
    ) -> None:
        self.args = cmd
        self.popen = popen
        self.federation = federation
        self.flwr_home = flwr_home
        self.timeout = timeout
        self.started = time.monotonic()
        self._scratch: tempfile.TemporaryDirectory[str] | None = scratch
        self._stdout_path = Path(scratch.name) / "stdout.txt"
        self._stderr_path = Path(scratch.name) / "stderr.txt"
        self._run_id: int | None = None
        self._result: FlwrRun | None = None
        self._ended: float | None = None

    @property
    def pid(self) -> int:
        """Process id of ``flwr run`` (also its process-group id)."""
        return self.popen.pid

    def running(self) -> bool:
        """True while ``flwr run`` has not exited (also notes when it was seen to exit)."""
        if self.popen.poll() is None:
            return True
        if self._ended is None:
            self._ended = time.monotonic()
        return False

    def output(self) -> str:
        """Stdout and stderr so far (ANSI codes removed); the final output after :meth:`wait`."""
        if self._result is not None:
            return self._result.output
        return strip_ansi(_read_text(self._stdout_path) + _read_text(self._stderr_path))

    @property
    def run_id(self) -> int | None:
        """The run id once ``flwr run`` printed ``Successfully started run N``, else None."""
        if self._run_id is None:
            if self._result is not None:
                self._run_id = self._result.run_id
            elif match := _RUN_ID_RE.search(strip_ansi(_read_text(self._stdout_path))):
                self._run_id = int(match.group(1))
        return self._run_id

    def wait_run_id(self, timeout: float = 60.0) -> int:
        """Wait until the run was submitted and return its id.

        Raises
        ------
        FlwrRunError
            If ``flwr run`` exits without submitting a run.
        TimeoutError
            If no run id appears within ``timeout`` seconds.
        """
        wait_for(
            lambda: self.run_id is not None or not self.running(),
            timeout,
            interval=0.1,
            what="`flwr run` to print 'Successfully started run N'",
        )
        run_id = self.run_id
        if run_id is None:
            raise FlwrRunError("`flwr run` exited without starting a run", self.wait())
        return run_id

    def wait(self, timeout: float | None = None) -> FlwrRun:
        """Wait for ``flwr run`` to exit and return its result (it is never checked).

        The run's status is queried as in :func:`run_flwr` with ``check=False``:
        :attr:`FlwrRun.status` is None when ``flwr run`` printed no run id or the
        SuperLink could not be asked; it may still read ``running`` when the
        SuperLink lost track of the run. Calling again returns the same result.
        :attr:`FlwrRun.duration` runs until the exit was first seen (by
        :meth:`running`, :meth:`wait_run_id` or this method).

        Parameters
        ----------
        timeout : float or None
            Seconds to wait; None waits until the ``timeout`` given at the start
            (counted from the start) has passed.

        Returns
        -------
        FlwrRun
            Exit code, output, run id, status.

        Raises
        ------
        FlwrRunError
            When the time is up: ``flwr run`` is then killed and the run stopped
            (best effort ``flwr stop``), as :func:`run_flwr` does on a timeout.
        """
        if self._result is not None:
            return self._result
        if timeout is None:
            timeout = self.timeout - (time.monotonic() - self.started)
        try:
            self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            result = self._abort()
            raise FlwrRunError(
                f"`flwr run` timed out after {result.duration:.0f} s", result
            ) from None
        self.running()  # note the exit time
        result = self._collect(self.popen.returncode)
        if result.run_id is not None:
            try:
                _fill_status(result, self.federation, self.flwr_home)
            except FlwrRunError:
                pass
        return result

    def close(self) -> None:
        """Kill ``flwr run`` if it is still running and stop its run (best effort)."""
        if self._result is None:
            if self.running():
                self._abort()
            else:
                self._collect(self.popen.returncode)

    def _abort(self) -> FlwrRun:
        _signal_group(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.running()
        result = self._collect(-9)
        if result.run_id is not None:
            _stop_run(result.run_id, self.federation, self.flwr_home)
        return result

    def _collect(self, returncode: int) -> FlwrRun:
        stdout, stderr = _read_text(self._stdout_path), _read_text(self._stderr_path)
        duration = (self._ended or time.monotonic()) - self.started
        self._result = FlwrRun(self.args, returncode, stdout, stderr, duration)
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
        return self._result


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _fill_status(result: FlwrRun, federation: str, flwr_home: Path, wait: float = 15.0) -> None:
    """Query the run status; poll briefly while it is not ``finished:*`` yet."""
    assert result.run_id is not None
    deadline = time.monotonic() + wait
    while True:
        status, details = run_status(result.run_id, federation, flwr_home)
        result.status, result.status_details = status, details
        if status.startswith("finished") or time.monotonic() > deadline:
            return
        time.sleep(0.5)


# ------------------------------------------------------------------- context managers


@dataclass
class Deployment:
    """A running SuperLink plus SuperNodes started by :func:`local_deployment`.

    Attributes
    ----------
    app_dir : Path
        The Flower App that :meth:`run` submits.
    flwr_home : Path
        ``FLWR_HOME`` of the CLI and of the SuperLink (FABs land in ``apps/``).
    federation : str
        Connection name written to ``$FLWR_HOME/config.toml``.
    address : str
        ``127.0.0.1:<port>`` of the SuperLink (Fleet, Control and Runtime APIs).
    work_dir : Path
        Temporary directory with the logs, ``state.db`` and the SuperNodes' homes.
    cwd : Path
        Working directory of all processes: relative paths written by the ServerApp
        resolve against it.
    superlink : ManagedProcess
        The SuperLink.
    supernodes : list[ManagedProcess]
        The SuperNodes, in ``node_configs`` order.
    node_ids : list[int]
        Node ids as logged by each SuperNode (``SuperNode ID: ...``).
        :meth:`start_supernode` updates the entry: without node authentication a
        restarted SuperNode registers again with a fresh key pair and gets a NEW id (the
        old one stays on record, ``offline`` once its heartbeat is overdue); with it, the
        node keeps its key and its id. A SuperNode that survives a
        :meth:`restart_superlink` keeps its id.
    tls : TlsMaterial or None
        The certificates the SuperLink serves HTTPS with (None: plain HTTP, ``--insecure``).
    node_auth : bool
        Whether the SuperLink runs with ``--enable-supernode-auth``.
    node_keys : list[NodeKey]
        With ``node_auth``: the authentication key pair of each SuperNode (registered
        with ``flwr supernode register`` before the SuperNode started).
    extra_supernodes : list[ManagedProcess]
        SuperNodes started by :meth:`start_unauthorized_supernode` (stopped on exit
        like the others).
    superexecs : list[ManagedProcess]
        The SuperExecs started beside SuperNodes run with ``--isolation process``
        (``local_deployment(..., superexecs=...)``), named ``superexec-<i>`` after their
        SuperNode; empty when every SuperNode starts its own (Flower's default).

    Notes
    -----
    Fault injection: :meth:`kill_supernode`/:meth:`start_supernode`,
    :meth:`kill_serverapp`, :meth:`kill_superlink`/:meth:`start_superlink`/
    :meth:`restart_superlink`, with :meth:`run_in_background` to inject the fault
    while a run is in progress and :func:`wait_for` to await its effect. Every kill
    is a SIGKILL of the process and all its descendants (a crash: nothing is
    deregistered or flushed).
    """

    app_dir: Path
    flwr_home: Path
    federation: str
    address: str
    work_dir: Path
    cwd: Path
    superlink: ManagedProcess
    supernodes: list[ManagedProcess]
    node_ids: list[int] = field(default_factory=list)
    tls: TlsMaterial | None = None
    node_auth: bool = False
    node_keys: list[NodeKey] = field(default_factory=list)
    extra_supernodes: list[ManagedProcess] = field(default_factory=list)
    superexecs: list[ManagedProcess] = field(default_factory=list)
    _background_runs: list[BackgroundRun] = field(default_factory=list, repr=False)
    # The list local_deployment stops on exit: processes started later are added to it.
    _started: list[ManagedProcess] = field(default_factory=list, repr=False)

    @property
    def processes(self) -> list[ManagedProcess]:
        """SuperLink first, then the SuperNodes, the extra SuperNodes, the SuperExecs."""
        return [self.superlink, *self.supernodes, *self.extra_supernodes, *self.superexecs]

    @property
    def log_paths(self) -> dict[str, Path]:
        """Log file of every process, by name."""
        return {p.name: p.log_path for p in self.processes}

    def logs(self) -> dict[str, str]:
        """Current log text of every process, by name (ANSI codes removed)."""
        return {p.name: p.log_text() for p in self.processes}

    def run(
        self,
        run_config: Mapping[str, RunConfigValue] | Path | None = None,
        timeout: float = 300.0,
        extra_args: Sequence[str] = (),
        *,
        check: bool = True,
    ) -> FlwrRun:
        """Submit :attr:`app_dir` with :func:`run_flwr` and wait for it to finish."""
        return run_flwr(
            self.app_dir,
            self.federation,
            run_config,
            self.flwr_home,
            timeout,
            extra_args,
            check=check,
        )

    def run_in_background(
        self,
        run_config: Mapping[str, RunConfigValue] | Path | None = None,
        timeout: float = 300.0,
        extra_args: Sequence[str] = (),
    ) -> BackgroundRun:
        """Submit :attr:`app_dir` like :meth:`run` but return at once.

        Parameters
        ----------
        run_config : Mapping, Path or None
            As in :func:`run_flwr`.
        timeout : float, default 300.0
            Seconds from now after which :meth:`BackgroundRun.wait` kills
            ``flwr run`` and stops the run.
        extra_args : Sequence[str], default ()
            Appended to the command line.

        Returns
        -------
        BackgroundRun
            ``.wait_run_id()`` once submitted, ``.wait()`` for the unchecked result.
            A run still in progress when the deployment exits is killed first.
        """
        background = start_flwr_run(
            self.app_dir, self.federation, run_config, self.flwr_home, timeout, extra_args
        )
        self._background_runs.append(background)
        return background

    def _close_background_runs(self) -> None:
        for background in self._background_runs:
            background.close()

    # ------------------------------------------------------------- fault injection

    def kill_supernode(self, index: int) -> None:
        """SIGKILL SuperNode ``index`` and all its descendants; return once all are gone.

        Its ``flwr-clientapp`` (and SuperExec) processes die with it. The SuperLink is
        not told: it keeps the node ``online`` until the heartbeat is overdue, 20 s
        after the last one (16-20 s after the kill); only then does a message sent to
        it get its ``Node Unavailable`` error reply (see :meth:`node_statuses`).

        Raises
        ------
        FlowerProcessError
            If it is not running, or something survived.
        """
        node = self.supernodes[index]
        if not node.alive():
            raise FlowerProcessError(f"{node.name} is not running")
        _kill_tree(node)

    def start_supernode(self, index: int, timeout: float = 60.0) -> None:
        """Start a killed SuperNode again and wait until it is registered.

        Same command line, port, ``HOME``/``FLWR_HOME`` and ``--node-config``; its log
        is appended to. Returns once it answers ``/health`` and has logged a new
        ``SuperNode ID``, which replaces ``node_ids[index]``. Without node
        authentication a restarted SuperNode generates a new key pair and is a new node
        to the SuperLink (``--auth-supernode-private-key`` is refused with
        ``--insecure``, exit code 303); the old id stays ``online`` until its heartbeat
        is overdue: :meth:`unregister_node` forgets it at once. With node authentication
        it comes back with its registered key, hence its id; but Flower 1.41 activates a
        node only while it is ``registered`` or ``offline`` (an ``online`` one gets
        ``[code: 2004] Failed to activate SuperNode.`` and the SuperNode exits with 305),
        so after a kill this first waits until the SuperLink has marked the old id
        ``offline`` (heartbeat overdue: up to 20 s after the kill).

        Raises
        ------
        FlowerProcessError
            If it is still running, exits, or is not ready within ``timeout``.
        """
        node = self.supernodes[index]
        if self.node_auth and not node.alive():
            old_id = self.node_ids[index]
            wait_for(
                lambda: self.node_statuses().get(old_id) != "online",
                90,
                interval=2.0,
                what=f"node {old_id} to go offline before its SuperNode restarts",
            )
        offset = node.log_size()
        node.relaunch()
        deadline = time.monotonic() + timeout
        _wait_http_ready([node], deadline, self.processes)
        self.node_ids[index] = _wait_registered([node], deadline, self.processes, offset)[0]

    def serverapp_pids(self) -> list[int]:
        """Pids of the running ``flwr-serverapp`` processes (descendants of the SuperLink)."""
        return sorted(
            pid
            for pid, starttime in _descendants(self.superlink.pid).items()
            if _same_process_running(pid, starttime)
            and any(Path(arg).name == "flwr-serverapp" for arg in _cmdline(pid)[:2])
        )

    def kill_serverapp(self) -> int:
        """SIGKILL every running ``flwr-serverapp`` (and its descendants).

        Returns
        -------
        int
            How many ``flwr-serverapp`` processes were killed.

        Raises
        ------
        FlowerProcessError
            If none is running.
        """
        pids = self.serverapp_pids()
        if not pids:
            raise FlowerProcessError("no flwr-serverapp process is running")
        for pid in pids:
            _kill_tree(pid)
        return len(pids)

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and all its descendants (SuperExec, ``flwr-serverapp``).

        The SuperNodes keep running and retry in the background.

        Raises
        ------
        FlowerProcessError
            If it is not running, or something survived.
        """
        if not self.superlink.alive():
            raise FlowerProcessError("superlink is not running")
        _kill_tree(self.superlink)

    def start_superlink(self, timeout: float = 60.0) -> None:
        """Start the killed SuperLink again: same port and ``--database`` file.

        Returns once it answers ``/health``; the log is appended to. The SuperNodes
        are not awaited (see :meth:`restart_superlink`).

        Raises
        ------
        FlowerProcessError
            If it is still running, exits, or is not ready within ``timeout``.
        """
        self.superlink.relaunch()
        _wait_http_ready([self.superlink], time.monotonic() + timeout, self.processes)

    def restart_superlink(self, down_seconds: float = 0.0, timeout: float = 60.0) -> None:
        """:meth:`kill_superlink`, wait ``down_seconds``, then :meth:`start_superlink`.

        What follows (Flower 1.41, measured): a ``flwr run --stream`` in progress exits
        with 1 as soon as the SuperLink dies; the run is not resumed: it reads
        ``running`` until ~60 s after the last task heartbeat, then
        ``finished:failed`` (``No heartbeat received from the task``). The SuperNodes
        keep their ids: after a short outage they are still ``online``; after one
        longer than 60 s they are ``offline`` until their next retry gets through
        (back-off at most 20 s; measured 4 and 9 s). Await them with
        ``wait_for(lambda: dep.online_node_ids() >= set(dep.node_ids), ...)``.

        Parameters
        ----------
        down_seconds : float, default 0.0
            How long the SuperLink stays down.
        timeout : float, default 60.0
            Seconds allowed for ``/health`` after the start.
        """
        self.kill_superlink()
        if down_seconds > 0:
            time.sleep(down_seconds)
        self.start_superlink(timeout)

    def node_statuses(self) -> dict[int, str]:
        """``{node_id: status}`` of every node the SuperLink knows (:func:`supernode_statuses`)."""
        return supernode_statuses(self.federation, self.flwr_home)

    def online_node_ids(self) -> set[int]:
        """Ids of the ``online`` nodes: what ``grid.get_node_ids()`` returns right now."""
        return {node for node, status in self.node_statuses().items() if status == "online"}

    def unregister_node(self, node_id: int) -> None:
        """Make the SuperLink forget ``node_id`` at once (:func:`unregister_supernode`)."""
        unregister_supernode(node_id, self.federation, self.flwr_home)

    # ---------------------------------------------------------- node authentication

    def register_node_key(self, key: NodeKey | Path) -> int:
        """Authorise a public key (:func:`register_supernode`); return the new node id."""
        public_key = key.public_key if isinstance(key, NodeKey) else Path(key)
        return register_supernode(public_key, self.federation, self.flwr_home)

    def start_unauthorized_supernode(
        self,
        node_config: str = "partition-id=0 num-partitions=1",
        key: NodeKey | None = None,
        *,
        without_key: bool = False,
    ) -> ManagedProcess:
        """Start one more SuperNode whose authentication key was never registered.

        Same TLS options as the others plus ``--auth-supernode-private-key`` of ``key``
        (default: a fresh P-384 key pair made in ``W/node-keys/<name>``; ``without_key``:
        no key option at all, i.e. a SuperNode that tries to register itself). Returns at
        once, without waiting: a SuperLink with ``--enable-supernode-auth`` refuses it
        (Flower 1.41: ``ActivateNode`` answers ``[code: 2004] Failed to activate
        SuperNode.``, or without a key ``RegisterNode`` answers ``[code: 2001] SuperNode
        authentication is enabled...``; the SuperNode logs ``Exit Code: 305`` and exits
        with status 1 within seconds). Its name is ``unauthorized-<n>``; it is stopped on
        exit of :func:`local_deployment` if it is still running.

        Raises
        ------
        FlowerProcessError
            If this deployment has no TLS (Flower refuses a key over ``--insecure``).
        """
        if self.tls is None:
            raise FlowerProcessError("an authentication key needs TLS (local_deployment(tls=...))")
        index = len(self.extra_supernodes)
        name = f"unauthorized-{index}"
        node_home = self.work_dir / name
        node_home.mkdir(exist_ok=True)
        if key is None and not without_key:
            key = make_node_key(self.work_dir / "node-keys", name)
        port = free_port()
        cmd = _supernode_cmd(self.address, port, node_config, self.tls, key)
        node = _start(
            name,
            cmd,
            self.work_dir / f"{name}.log",
            self.cwd,
            child_env(node_home, {"HOME": str(node_home)}),
            port,
        )
        self._started.append(node)
        self.extra_supernodes.append(node)
        return node


@dataclass
class Simulation:
    """A simulation SuperLink started by :func:`local_simulation`.

    Attributes
    ----------
    app_dir, flwr_home, federation, address, work_dir, cwd
        As in :class:`Deployment`.
    superlink : ManagedProcess
        The ``flower-superlink --simulation`` process.
    num_supernodes : int
        Virtual SuperNodes per run (sent as ``--federation-config``).
    client_cpus : int
        ``client-resources-num-cpus`` per ClientApp (1 is fastest on 2 cores).
    """

    app_dir: Path
    flwr_home: Path
    federation: str
    address: str
    work_dir: Path
    cwd: Path
    superlink: ManagedProcess
    num_supernodes: int
    client_cpus: int

    @property
    def log_paths(self) -> dict[str, Path]:
        """Log file of the SuperLink (it also receives the Ray/ClientApp output)."""
        return {self.superlink.name: self.superlink.log_path}

    def logs(self) -> dict[str, str]:
        """Current log text, by process name (ANSI codes removed)."""
        return {self.superlink.name: self.superlink.log_text()}

    def run(
        self,
        run_config: Mapping[str, RunConfigValue] | Path | None = None,
        timeout: float = 300.0,
        extra_args: Sequence[str] = (),
        *,
        num_supernodes: int | None = None,
        check: bool = True,
    ) -> FlwrRun:
        """Submit :attr:`app_dir` as a simulation with ``num_supernodes`` virtual nodes."""
        federation_config: dict[str, RunConfigValue] = {
            "num-supernodes": num_supernodes or self.num_supernodes,
            "client-resources-num-cpus": self.client_cpus,
        }
        return run_flwr(
            self.app_dir,
            self.federation,
            run_config,
            self.flwr_home,
            timeout,
            extra_args,
            federation_config=federation_config,
            check=check,
        )


def _work_dir_cleanup(
    work: Path, created: bool, keep: bool
) -> Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], None]:
    """Exit callback removing a work dir we created, unless kept or the block failed."""

    def cleanup(
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if created and not keep and exc_type is None:
            shutil.rmtree(work, ignore_errors=True)

    return cleanup


def _tls_args(tls: TlsMaterial | None) -> list[str]:
    """SuperLink options: ``--insecure``, or the three certificate files."""
    if tls is None:
        return ["--insecure"]
    return [
        "--ssl-ca-certfile",
        str(tls.ca_cert),
        "--ssl-certfile",
        str(tls.server_cert),
        "--ssl-keyfile",
        str(tls.server_key),
    ]


def _superlink_cmd(
    port: int,
    database: Path,
    simulation: bool,
    tls: TlsMaterial | None = None,
    node_auth: bool = False,
) -> list[str]:
    if node_auth and tls is None:
        raise ValueError("SuperNode authentication needs TLS (Flower 1.41 exits otherwise)")
    cmd = [
        flower_executable("flower-superlink"),
        *_tls_args(tls),
        *(["--enable-supernode-auth"] if node_auth else []),
        "--host",
        HOST,
        "--port",
        str(port),
        "--database",
        str(database),
        "--disable-runtime-dependency-installation",
    ]
    if simulation:
        cmd.append("--simulation")
    return cmd


def _supernode_cmd(
    address: str,
    port: int,
    node_config: str,
    tls: TlsMaterial | None = None,
    auth_key: NodeKey | None = None,
    isolation: str | None = None,
) -> list[str]:
    # Flower's SuperNode with a 0.1 s poll of the SuperLink instead of its hard-coded 3 s
    # (tests/fast_supernode.py): a deployed exchange takes about 1 s instead of 5 s here.
    cmd = [sys.executable, str(Path(__file__).with_name("fast_supernode.py"))]
    if isolation is not None:
        cmd += ["--isolation", isolation]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(tls.ca_cert)]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key.private_key)]
    return [
        *cmd,
        "--superlink",
        address,
        "--host",
        HOST,
        "--port",
        str(port),
        "--node-config",
        node_config,
    ]


@contextmanager
def local_deployment(
    app_dir: Path,
    num_supernodes: int,
    node_configs: list[str] | None,
    flwr_home: Path,
    *,
    federation: str = DEPLOYMENT_FEDERATION,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    stop_grace: float = 5.0,
    work_dir: Path | None = None,
    keep_work_dir: bool = False,
    tls: TlsMaterial | None = None,
    node_auth: bool = False,
    superexecs: Sequence[Sequence[str] | None] | None = None,
    warm: bool = False,
) -> Iterator[Deployment]:
    """Start one SuperLink and ``num_supernodes`` SuperNodes on 127.0.0.1.

    Commands (ports chosen with :func:`free_port` at call time)::

        flower-superlink --insecure --host 127.0.0.1 --port P --database W/state.db \\
            --disable-runtime-dependency-installation
        flower-supernode --insecure --superlink 127.0.0.1:P --host 127.0.0.1 \\
            --port Q_i --node-config "<node_configs[i]>"      # FLWR_HOME=W/supernode-i

    With ``tls`` (and ``node_auth``), ``--insecure`` becomes::

        flower-superlink --ssl-ca-certfile CA --ssl-certfile CRT --ssl-keyfile KEY \\
            [--enable-supernode-auth] ...
        flwr supernode register KEY_i.pub <federation>         # node_auth: each node's key
        flower-supernode --root-certificates CA [--auth-supernode-private-key KEY_i] ...

    and the ``flwr`` connection has ``root-certificates = "CA"`` instead of
    ``insecure = true``. The SuperLink's one port then serves HTTPS only.

    With a command ``C`` in ``superexecs[i]``, SuperNode ``i`` runs its ClientApps through a
    SuperExec started here instead of its own (an operator's SuperExec, e.g. fedparity's
    app gate)::

        flower-supernode --isolation process ...                # as above
        C --insecure --runtime-api-address 127.0.0.1:Q_i          # same environment as node i

    The block is entered once the SuperLink answers ``/health``, every SuperNode
    answers ``/health`` and has logged ``SuperNode ID: ...`` (i.e. registered).

    Parameters
    ----------
    app_dir : Path
        Flower App submitted by :meth:`Deployment.run`.
    num_supernodes : int
        Number of SuperNode processes.
    node_configs : list[str] or None
        One ``--node-config`` string per SuperNode; None gives
        ``partition-id=i num-partitions=N``.
    flwr_home : Path
        ``FLWR_HOME`` of the CLI and the SuperLink; ``[superlink.<federation>]`` is
        added to its ``config.toml`` and removed again on exit.
    federation : str, default "local-deployment"
        Connection name.
    cwd : Path or None
        Working directory of the processes (default: ``app_dir``, as for
        ``flwr run .`` typed in the project folder).
    env : Mapping[str, str] or None
        Extra environment variables for all processes.
    startup_timeout : float, default 60.0
        Seconds allowed for everything to become ready.
    stop_grace : float, default 5.0
        Seconds between SIGTERM and SIGKILL on exit.
    work_dir : Path or None
        Where logs, ``state.db`` and the SuperNodes' homes go. Default: a new
        temporary directory, deleted on a clean exit (read the logs inside the
        ``with`` block) and kept when the block raised or ``keep_work_dir`` is set.
        A given ``work_dir`` is never deleted.
    keep_work_dir : bool, default False
        Keep the temporary work directory after a clean exit too.
    tls : TlsMaterial or None
        Serve the SuperLink's APIs over TLS with these certificates
        (:func:`tests.flower_tls.make_tls_material`). None (default): plain HTTP.
    node_auth : bool, default False
        SuperNode authentication (needs ``tls``): SuperNode ``i`` uses
        ``tls.node_keys[i]`` (made in ``W/node-keys`` if ``tls`` has fewer keys), whose
        public key is registered with ``flwr supernode register`` before it starts.
    superexecs : Sequence[Sequence[str] or None] or None
        One entry per SuperNode: None keeps Flower's default (``--isolation subprocess``: the
        SuperNode starts ``flower-superexec`` itself); a command (executable and options, the
        executable found with :func:`flower_executable` unless it is a path) runs the
        SuperNode with ``--isolation process`` and that SuperExec beside it, logging to
        ``W/superexec-<i>.log`` (:attr:`Deployment.superexecs`; not restarted by
        :meth:`Deployment.start_supernode`). None (default): Flower's default for all.
    warm : bool, default False
        Every SuperNode beside ``fedparity-superexec --executor warm`` (ClientApps forked from
        a zygote, behind the app gate), ``allowed-apps="<hash of app_dir>"`` added to each
        node config. Replaces ``superexecs``.

    Yields
    ------
    Deployment
        Handles, ports, log paths, and :meth:`Deployment.run`.

    Raises
    ------
    FlowerProcessError
        If a process exits or is not ready in time; the message contains the tail
        of every process log.
    """
    if num_supernodes < 1:
        raise ValueError("num_supernodes must be >= 1")
    if node_configs is None:
        node_configs = [
            f"partition-id={i} num-partitions={num_supernodes}" for i in range(num_supernodes)
        ]
    if len(node_configs) != num_supernodes:
        raise ValueError(f"{len(node_configs)} node_configs for {num_supernodes} supernodes")
    if node_auth and tls is None:
        raise ValueError("node_auth=True needs tls (Flower refuses node keys over --insecure)")
    if warm:  # fedparity.clients.warm_clientapp; the gate approves app_dir's bundle
        from fedparity.clients.app_gate import app_bundle_hash

        allowed = f'allowed-apps="{app_bundle_hash(app_dir)}"'
        node_configs = [f"{config} {allowed}" for config in node_configs]
        superexecs = [["fedparity-superexec", "--executor", "warm"]] * num_supernodes
    superexec_cmds = list(superexecs) if superexecs is not None else [None] * num_supernodes
    if len(superexec_cmds) != num_supernodes:
        raise ValueError(f"{len(superexec_cmds)} superexecs for {num_supernodes} supernodes")
    app_dir = Path(app_dir).resolve()
    _check_app_dir(app_dir)
    flwr_home = Path(flwr_home).resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    created = work_dir is None
    work = Path(work_dir or tempfile.mkdtemp(prefix="flwr-deployment-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_cwd = Path(cwd or app_dir).resolve()

    link_port, *node_ports = _free_ports(1 + num_supernodes)
    started: list[ManagedProcess] = []
    with ExitStack() as stack:
        stack.push(_work_dir_cleanup(work, created, keep_work_dir))
        stack.callback(lambda: _stop_processes(list(reversed(started)), stop_grace))
        superlink = _start(
            "superlink",
            _superlink_cmd(
                link_port, work / "state.db", simulation=False, tls=tls, node_auth=node_auth
            ),
            work / "superlink.log",
            run_cwd,
            child_env(flwr_home, env),
            link_port,
            tls_ca=None if tls is None else tls.ca_cert,
        )
        started.append(superlink)
        deadline = time.monotonic() + startup_timeout
        # SuperNodes back off exponentially while the SuperLink is down: start them after.
        _wait_http_ready([superlink], deadline, started)

        address = f"{HOST}:{link_port}"
        root_certificates = None if tls is None else tls.ca_cert
        stack.enter_context(_connection(flwr_home, federation, address, root_certificates))
        node_keys: list[NodeKey] = []
        if node_auth:
            assert tls is not None
            node_keys = list(tls.node_keys[:num_supernodes])
            node_keys += [
                make_node_key(work / "node-keys", f"supernode-{i}")
                for i in range(len(node_keys), num_supernodes)
            ]
            for key in node_keys:  # authorised before the SuperNodes first connect
                register_supernode(key.public_key, federation, flwr_home)
        supernodes: list[ManagedProcess] = []
        for i, (port, node_config) in enumerate(zip(node_ports, node_configs, strict=True)):
            node_home = work / f"supernode-{i}"
            node_home.mkdir(exist_ok=True)
            cmd = _supernode_cmd(
                address,
                port,
                node_config,
                tls,
                node_keys[i] if node_auth else None,
                isolation=None if superexec_cmds[i] is None else "process",
            )
            node = _start(
                f"supernode-{i}",
                cmd,
                work / f"supernode-{i}.log",
                run_cwd,
                # HOME per SuperNode: what a node keeps under ~ (its LDP ledger) is its own.
                child_env(node_home, {"HOME": str(node_home), **(env or {})}),
                port,
            )
            started.append(node)
            supernodes.append(node)

        _wait_http_ready(supernodes, deadline, started)
        superexec_procs = _start_superexecs(superexec_cmds, supernodes, work, run_cwd, started)
        node_ids = _wait_registered(supernodes, deadline, started)
        deployment = Deployment(
            app_dir=app_dir,
            flwr_home=flwr_home,
            federation=federation,
            address=address,
            work_dir=work,
            cwd=run_cwd,
            superlink=superlink,
            supernodes=supernodes,
            node_ids=node_ids,
            tls=tls,
            node_auth=node_auth,
            node_keys=node_keys,
            superexecs=superexec_procs,
            _started=started,
        )
        # Runs left in the background are killed first, while the SuperLink still runs.
        stack.callback(deployment._close_background_runs)
        yield deployment


def _start_superexecs(
    commands: Sequence[Sequence[str] | None],
    supernodes: Sequence[ManagedProcess],
    work: Path,
    cwd: Path,
    started: list[ManagedProcess],
) -> list[ManagedProcess]:
    """Start ``commands[i]`` against SuperNode ``i``'s Runtime API (None: nothing), with that
    SuperNode's environment; each is appended to ``started`` (stopped on exit)."""
    procs: list[ManagedProcess] = []
    for i, (command, node) in enumerate(zip(commands, supernodes, strict=True)):
        if command is None:
            continue
        if not command:
            raise ValueError(f"superexecs[{i}] is an empty command")
        executable = command[0] if os.sep in command[0] else flower_executable(command[0])
        cmd = [executable, *command[1:], "--insecure", "--runtime-api-address"]
        cmd.append(f"{HOST}:{node.port}")
        proc = _start(f"superexec-{i}", cmd, work / f"superexec-{i}.log", cwd, node.env, 0)
        started.append(proc)
        procs.append(proc)
    return procs


def _wait_registered(
    nodes: Sequence[ManagedProcess],
    deadline: float,
    all_procs: Sequence[ManagedProcess],
    log_offset: int = 0,
) -> list[int]:
    """Node ids logged by ``nodes`` (after byte ``log_offset`` of each log)."""
    ids: dict[str, int] = {}
    while len(ids) < len(nodes):
        for node in nodes:
            if node.name in ids:
                continue
            if not node.alive():
                raise _startup_error(f"{node.name} exited during start-up", all_procs)
            match = _NODE_ID_RE.search(node.log_text_since(log_offset))
            if match:
                ids[node.name] = int(match.group(1))
        if len(ids) == len(nodes):
            break
        if time.monotonic() > deadline:
            missing = ", ".join(n.name for n in nodes if n.name not in ids)
            raise _startup_error(f"timed out waiting for registration of: {missing}", all_procs)
        time.sleep(0.1)
    return [ids[n.name] for n in nodes]


@contextmanager
def local_simulation(
    app_dir: Path,
    num_supernodes: int,
    flwr_home: Path,
    *,
    client_cpus: int = 1,
    federation: str = SIMULATION_FEDERATION,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    stop_grace: float = 5.0,
    work_dir: Path | None = None,
    keep_work_dir: bool = False,
) -> Iterator[Simulation]:
    """Start a simulation SuperLink on a free port for ``flwr run`` simulations.

    Command (instead of ``flwr run``'s managed SuperLink, which always uses port
    39091, is shared by every ``FLWR_HOME``, keeps the working directory and
    settings of whoever started it first, and stays running after the run)::

        flower-superlink --insecure --simulation --host 127.0.0.1 --port P \\
            --database W/state.db --disable-runtime-dependency-installation

    Runs submitted with :meth:`Simulation.run` pass
    ``--federation-config "num-supernodes=N client-resources-num-cpus=C"``.

    Parameters
    ----------
    app_dir : Path
        Flower App submitted by :meth:`Simulation.run`.
    num_supernodes : int
        Default number of virtual SuperNodes per run.
    flwr_home : Path
        ``FLWR_HOME`` of the CLI and the SuperLink.
    client_cpus : int, default 1
        ``client-resources-num-cpus`` (Flower's default is 2, i.e. one ClientApp at
        a time on a 2-core machine).
    federation : str, default "local-simulation"
        Connection name written to ``$FLWR_HOME/config.toml``.
    cwd : Path or None
        Working directory of the SuperLink and hence of the ServerApp and the Ray
        workers (default: ``app_dir``). NOTE: Ray puts this directory first on the
        workers' ``sys.path``, so a package found there shadows the FAB's copy.
    env : Mapping[str, str] or None
        Extra environment variables.
    startup_timeout : float, default 60.0
        Seconds allowed for ``/health`` to answer.
    stop_grace : float, default 5.0
        Seconds between SIGTERM and SIGKILL on exit.
    work_dir : Path or None
        Where the log and ``state.db`` go; same lifetime rules as in
        :func:`local_deployment`.
    keep_work_dir : bool, default False
        Keep the temporary work directory after a clean exit too.

    Yields
    ------
    Simulation
        Handle with :meth:`Simulation.run`.

    Raises
    ------
    FlowerProcessError
        If the SuperLink exits or is not ready in time (message has its log tail).
    """
    if num_supernodes < 1:
        raise ValueError("num_supernodes must be >= 1")
    app_dir = Path(app_dir).resolve()
    _check_app_dir(app_dir)
    flwr_home = Path(flwr_home).resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    created = work_dir is None
    work = Path(work_dir or tempfile.mkdtemp(prefix="flwr-simulation-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_cwd = Path(cwd or app_dir).resolve()
    port = free_port()
    started: list[ManagedProcess] = []
    with ExitStack() as stack:
        stack.push(_work_dir_cleanup(work, created, keep_work_dir))
        stack.callback(lambda: _stop_processes(started, stop_grace))
        superlink = _start(
            "superlink",
            _superlink_cmd(port, work / "state.db", simulation=True),
            work / "superlink.log",
            run_cwd,
            child_env(flwr_home, env),
            port,
        )
        started.append(superlink)
        _wait_http_ready([superlink], time.monotonic() + startup_timeout, started)
        address = f"{HOST}:{port}"
        stack.enter_context(_connection(flwr_home, federation, address))
        yield Simulation(
            app_dir=app_dir,
            flwr_home=flwr_home,
            federation=federation,
            address=address,
            work_dir=work,
            cwd=run_cwd,
            superlink=superlink,
            num_supernodes=num_supernodes,
            client_cpus=client_cpus,
        )
