"""A local deployment: one SuperLink and SuperNodes as real processes on 127.0.0.1
(:func:`local_deployment`), with the faults a test injects (:class:`Deployment`)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tests.support.flower_env import (
    DEPLOYMENT_FEDERATION,
    HOST,
    SUPERLINK_ENV,
    _connection,
    _free_ports,
    child_env,
    flower_executable,
    free_port,
    wait_for,
)
from tests.support.flower_tls import NodeKey, TlsMaterial, make_node_key
from tests.support.flwr_runs import (
    BackgroundRun,
    FlwrRun,
    RunConfigValue,
    bundle_folder,
    prepare_folders,
    register_supernode,
    run_flwr,
    start_flwr_run,
    supernode_statuses,
    unregister_supernode,
)
from tests.support.process_tree import (
    FlowerProcessError,
    ManagedProcess,
    _cmdline,
    _descendants,
    _kill_tree,
    _same_process_running,
    _start,
    _startup_error,
    _stop_processes,
    _superlink_cmd,
    _supernode_cmd,
    _wait_http_ready,
    _work_dir_cleanup,
)

_NODE_ID_RE = re.compile(r"SuperNode ID: (\d+)")


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
        SuperNode; empty when every SuperNode starts its own (Flower's default). A SuperNode's
        SuperExec is killed and started with it (:meth:`kill_supernode`,
        :meth:`start_supernode`): the two stand for one machine.

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

    def node_log_text(self, index: int) -> str:
        """What node ``index`` logged: its SuperNode's log, then its SuperExec's if one was
        started beside it (a ClientApp's output goes to whichever process launched it)."""
        superexec = self._superexec_of(index)
        text = self.supernodes[index].log_text()
        return text if superexec is None else f"{text}\n{superexec.log_text()}"

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
        """SIGKILL SuperNode ``index`` and all its descendants (and the SuperExec started
        beside it, if any); return once all are gone.

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
        superexec = self._superexec_of(index)
        if superexec is not None and superexec.alive():
            _kill_tree(superexec)

    def _superexec_of(self, index: int) -> ManagedProcess | None:
        """The SuperExec started beside SuperNode ``index`` (None: the node starts its own)."""
        name = f"superexec-{index}"
        return next((proc for proc in self.superexecs if proc.name == name), None)

    def start_supernode(self, index: int, timeout: float = 60.0) -> None:
        """Start a killed SuperNode again and wait until it is registered.

        Same command line, port, ``HOME``/``FLWR_HOME`` and ``--node-config``; its log
        is appended to; a SuperExec started beside it is started again too. Returns once
        it answers ``/health`` and has logged a new ``SuperNode ID``, which replaces
        ``node_ids[index]``. Without node authentication a restarted SuperNode generates a
        new key pair and is a new node to the SuperLink (``--auth-supernode-private-key``
        is refused with ``--insecure``, exit code 303); the old id stays ``online`` until
        its heartbeat is overdue: :meth:`unregister_node` forgets it at once. With node
        authentication it comes back with its registered key, hence its id; but Flower 1.41
        activates a node only while it is ``registered`` or ``offline`` (an ``online`` one gets
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
        superexec = self._superexec_of(index)
        if superexec is not None and not superexec.alive():
            superexec.relaunch()
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
        """Start the killed SuperLink again: same port and ``--database`` file (an in-memory
        SuperLink, ``superlink_state="memory"``, starts empty).

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
    also_allowed: Sequence[Path] = (),
    superlink_state: Literal["file", "memory"] = "file",
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
        ``W/superexec-<i>.log`` (:attr:`Deployment.superexecs`; killed and started with its
        SuperNode). None (default): Flower's default for all.
    warm : bool, default False
        Every SuperNode beside ``fedparity-superexec --executor warm`` (ClientApps forked from
        a zygote, behind the app gate), ``allowed-apps="<hash of app_dir>"`` added to each
        node config. Replaces ``superexecs``.
    also_allowed : Sequence[Path], default ()
        With ``warm``: more app folders whose bundles the nodes' gate approves (apps other
        than ``app_dir`` submitted with :func:`run_flwr` to this deployment).
    superlink_state : {"file", "memory"}, default "file"
        ``"file"``: the SuperLink keeps its state in ``W/state.db`` (SQLite), which a restart
        keeps. ``"memory"``: Flower's default in-memory state (no ``--database``), which a
        restart loses; its requests cost the SuperLink about half the CPU
        (``benchmarks/deployed_exchange.py --superlink-state``).

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
    if superlink_state not in ("file", "memory"):
        raise ValueError(f'superlink_state must be "file" or "memory", got {superlink_state!r}')
    if node_configs is None:
        node_configs = [
            f"partition-id={i} num-partitions={num_supernodes}" for i in range(num_supernodes)
        ]
    if len(node_configs) != num_supernodes:
        raise ValueError(f"{len(node_configs)} node_configs for {num_supernodes} supernodes")
    if node_auth and tls is None:
        raise ValueError("node_auth=True needs tls (Flower refuses node keys over --insecure)")
    if also_allowed and not warm:
        raise ValueError("also_allowed needs warm=True (the app gate runs in the warm SuperExec)")
    if warm:  # fedparity.clients.warm_clientapp; the gate approves app_dir's bundle
        from fedparity.clients.app_gate import app_bundle_hash

        folders = (app_dir, *also_allowed)
        hashes = ",".join(app_bundle_hash(bundle_folder(folder)) for folder in folders)
        allowed = f'allowed-apps="{hashes}"'
        node_configs = [f"{config} {allowed}" for config in node_configs]
        superexecs = [["fedparity-superexec", "--executor", "warm"]] * num_supernodes
    superexec_cmds = list(superexecs) if superexecs is not None else [None] * num_supernodes
    if len(superexec_cmds) != num_supernodes:
        raise ValueError(f"{len(superexec_cmds)} superexecs for {num_supernodes} supernodes")
    app_dir, flwr_home, work, created, run_cwd = prepare_folders(
        app_dir, flwr_home, work_dir, cwd, "flwr-deployment-"
    )

    (link_port,) = _free_ports(1)
    started: list[ManagedProcess] = []
    with ExitStack() as stack:
        stack.push(_work_dir_cleanup(work, created, keep_work_dir))
        stack.callback(lambda: _stop_processes(list(reversed(started)), stop_grace))
        superlink = _start(
            "superlink",
            _superlink_cmd(
                link_port,
                work / "state.db" if superlink_state == "file" else None,
                simulation=False,
                tls=tls,
                node_auth=node_auth,
            ),
            work / "superlink.log",
            run_cwd,
            child_env(flwr_home, {**SUPERLINK_ENV, **(env or {})}),
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
        # chosen just before the SuperNodes bind them: an earlier choice (before the SuperLink's
        # start and the keys' registration, 10-20 s here) lost a port to another process's
        # connection once (CI, 2026-11-27: "address already in use")
        node_ports = _free_ports(num_supernodes)
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
