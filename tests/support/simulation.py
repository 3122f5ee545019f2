"""A simulation SuperLink on a free port for ``flwr run`` simulations (:func:`local_simulation`),
instead of the managed one of ``flwr run`` (fixed port 39091, left running)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.flower_env import (
    HOST,
    SIMULATION_FEDERATION,
    SUPERLINK_ENV,
    _connection,
    child_env,
    flower_executable,
    free_port,
)
from tests.support.flwr_runs import (
    FlwrRun,
    RunConfigValue,
    _run_config_args,
    bundle_folder,
    prepare_folders,
    run_flwr,
)
from tests.support.process_tree import (
    ManagedProcess,
    _start,
    _stop_processes,
    _superlink_cmd,
    _wait_http_ready,
    _work_dir_cleanup,
)


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

    def run_fedparity(
        self, run_config: Mapping[str, RunConfigValue] | None = None, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """The same run through ``fedparity run`` (``flwr run --stream`` with an exit status
        that says how the run ended); its exit status, output and error lines as printed."""
        with tempfile.TemporaryDirectory() as scratch:
            command = [
                flower_executable("fedparity"),
                "run",
                str(bundle_folder(self.app_dir)),
                self.federation,
                *_run_config_args(run_config, Path(scratch), self.app_dir),
                "--federation-config",
                f"num-supernodes={self.num_supernodes} "
                f"client-resources-num-cpus={self.client_cpus}",
            ]
            done = subprocess.run(  # noqa: S603 - the project's own command
                command,
                env=child_env(self.flwr_home),
                cwd=self.cwd,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        return done


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
    app_dir, flwr_home, work, created, run_cwd = prepare_folders(
        app_dir, flwr_home, work_dir, cwd, "flwr-simulation-"
    )
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
            child_env(flwr_home, {**SUPERLINK_ENV, **(env or {})}),
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
