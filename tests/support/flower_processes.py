"""Start, drive and stop real Flower 1.41 processes for tests and benchmarks.

Plain functions and context managers (no pytest fixtures), so that both the test
suite and the benchmarks (run as ``python -m benchmarks.<name>`` from the repository's
folder) can import them. This module gathers the public names of the modules that
define them::

    from tests.support.flower_processes import local_deployment, local_simulation

    with local_deployment(app_dir, 3, None, flwr_home) as dep:
        run = dep.run({"num-server-rounds": 1, "output-dir": str(out)})
    print(run.output)

What this module guarantees (measured on Flower 1.41):

* Nothing is installed at run time: the SuperLink gets
  ``--disable-runtime-dependency-installation`` (SuperNodes never install by
  default) and every child process gets ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``.
* Every process listens on 127.0.0.1 on a port chosen with :func:`free_port`; in
  Flower 1.41 a SuperLink serves its Fleet, Control and Runtime (ServerAppIo) APIs
  on ONE HTTP port (``--port``) and each SuperNode serves its ClientAppIo API on its
  own ``--port``. Nothing uses the fixed default ports (8000, 9094, 39091).
* Plain HTTP (``--insecure``) by default; ``local_deployment(..., tls=..., node_auth=True)``
  serves the SuperLink over TLS with certificates from :mod:`tests.support.flower_tls` and admits
  only SuperNodes whose keys were registered (``flwr supernode register``), see
  ``docs/deployment-security.md``.
* The managed local SuperLink of ``flwr run`` (fixed port 39091, detached, left
  running after the run, shared across ``FLWR_HOME`` values) is never used: the
  federations written to ``$FLWR_HOME/config.toml`` have explicit addresses.
* On exit, exactly the processes started here are stopped, together with their
  descendants (SuperExec, ``flwr-serverapp``/``flwr-clientapp``/``flwr-simulation``,
  Ray): SIGTERM to each process group, then SIGKILL after a grace period.
* ``flwr run`` is given :func:`bundle_folder` of the app folder: for a folder holding a
  ``.venv`` (this checkout), a copy of the files its bundle is built from, the same bundle
  byte for byte without walking the virtual environment's 53,000 files on every run.
* ``flwr run`` exits with 0 even when the ServerApp raised; :func:`run_flwr` asks the
  SuperLink for the run status and raises :class:`FlwrRunError` unless it is
  ``finished:completed`` (``check=True``).
* Faults (:class:`Deployment`): every kill is a SIGKILL of a whole process tree (a
  crash). Flower 1.41 notices dead processes only through heartbeats (30 s interval,
  patience 2, fixed: no CLI option on ``flower-superlink``/``flower-supernode``; the
  tests' SuperNodes, started by ``tests/support/fast_supernode.py``, announce the SuperLink's
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

Where each part lives: :mod:`tests.support.flower_env` (ports, environment, ``$FLWR_HOME``
connections, waiting), :mod:`tests.support.process_tree` (starting processes, readiness,
stopping them with their descendants), :mod:`tests.support.flwr_runs` (``flwr run`` and the
other CLI calls), :mod:`tests.support.deployment` (:func:`local_deployment`) and
:mod:`tests.support.simulation` (:func:`local_simulation`).
"""

from __future__ import annotations

from tests.support.deployment import Deployment, local_deployment
from tests.support.flower_env import (
    DEPLOYMENT_FEDERATION,
    SIMULATION_FEDERATION,
    child_env,
    flower_executable,
    free_port,
    strip_ansi,
    wait_for,
    write_connection,
)
from tests.support.flower_tls import NodeKey, TlsMaterial
from tests.support.flwr_runs import (
    BackgroundRun,
    FlwrRun,
    FlwrRunError,
    RunConfigValue,
    bundle_folder,
    format_run_config,
    register_supernode,
    run_flwr,
    run_status,
    start_flwr_run,
    supernode_statuses,
    unregister_supernode,
)
from tests.support.process_tree import FlowerProcessError, ManagedProcess
from tests.support.simulation import Simulation, local_simulation

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
    "bundle_folder",
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
