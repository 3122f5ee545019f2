"""Starting Flower processes with their logs, waiting until they serve, and stopping each with
its whole process tree (:mod:`tests.support.flower_processes` says what is guaranteed)."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from tests.support.flower_env import HOST, flower_executable, strip_ansi
from tests.support.flower_tls import NodeKey, TlsMaterial


class FlowerProcessError(RuntimeError):
    """A Flower process failed to start, died, or did not become ready in time."""


# ------------------------------------------------------------------ process handling


@dataclass
class ManagedProcess:
    """A Flower process started by these test helpers, with its log file.

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
    database: Path | None,
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
        *([] if database is None else ["--database", str(database)]),  # None: in memory
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
