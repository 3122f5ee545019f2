"""``flwr run`` and the other ``flwr`` CLI calls against a SuperLink the tests started: run
configs on the command line, run status, SuperNode registration, runs in the background."""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import tomli_w

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 (tomli ships with flwr)
    import tomli as tomllib  # type: ignore[no-redef]

from tests.support.flower_env import _tail_text, child_env, flower_executable, strip_ansi, wait_for
from tests.support.process_tree import _signal_group

RunConfigValue = bool | int | float | str

_RUN_ID_RE = re.compile(r"Successfully started run (\d+)")

_CONFIG_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class _NotInlineError(ValueError):
    """A run-config value that Flower's inline ``key=value`` parser cannot carry."""


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


class RunFolders(NamedTuple):
    """The folders of a test SuperLink (:func:`prepare_folders`)."""

    app_dir: Path
    flwr_home: Path
    work: Path
    created: bool  # the work folder is a new temporary one (deleted on a clean exit)
    cwd: Path


def prepare_folders(
    app_dir: Path, flwr_home: Path, work_dir: Path | None, cwd: Path | None, prefix: str
) -> RunFolders:
    """Check the app folder, create the Flower home and the work folder (a new temporary one
    named ``prefix...`` when ``work_dir`` is None); every path absolute, ``cwd`` defaulting to
    the app folder (``flwr run .`` typed in the project folder)."""
    app_dir = Path(app_dir).resolve()
    _check_app_dir(app_dir)
    flwr_home = Path(flwr_home).resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir or tempfile.mkdtemp(prefix=prefix)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    return RunFolders(app_dir, flwr_home, work, work_dir is None, Path(cwd or app_dir).resolve())


@functools.cache
def bundle_folder(app_dir: Path) -> Path:
    """The folder these helpers hand ``flwr run`` for the Flower App in ``app_dir``.

    ``flwr run`` (Flower 1.41, ``flwr.cli.utils.collect_files``) walks and resolves every file
    under the app folder before ``.gitignore`` and the bundle rules drop most of them: in a
    checkout with its virtual environment in ``.venv`` (the README's install) that is about
    53,000 files and 6 CPU-s of every ``flwr run`` on a 2-core machine. For a folder holding a
    ``.venv``, this returns a copy, made once per test process, of the files Flower's publish
    rules keep there (``.gitignore`` applied), from which ``flwr run`` builds the same bundle, byte
    for byte (``tests/test_flower_processes.py`` checks); any other folder is returned as it is.
    Runs keep ``app_dir`` as their working directory, and relative run-config paths resolve
    against it.
    """
    from flwr.cli.utils import collect_files, filter_paths_for_publish

    app_dir = Path(app_dir).resolve()
    if not (app_dir / ".venv").is_dir():
        return app_dir
    kept = filter_paths_for_publish(collect_files(app_dir))
    copy = Path(tempfile.mkdtemp(prefix="fedparity-app-"))
    atexit.register(shutil.rmtree, copy, True)
    for relative, source in kept.items():
        target = copy / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(source), target)  # collect_files gives paths
    return copy


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
        bundle = bundle_folder(app_dir)
        cmd = [flower_executable("flwr"), "run", str(bundle), federation, "--stream"]
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
