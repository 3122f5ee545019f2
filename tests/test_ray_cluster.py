"""Flower's simulation on an existing Ray cluster (issue 30): a head and a worker started with
``ray start`` on 127.0.0.1, each with one CPU and a resource of its own, a SuperLink whose
environment names the cluster (``RAY_ADDRESS``), and a job submitted with ``flwr run``. The
ClientApps must have run on both Ray nodes (read from the cluster's actor table afterwards).

The cluster keeps its files in a temporary folder of its own (``--temp-dir``; Ray then writes
no ``/tmp/ray/ray_current_cluster`` that other simulations on the machine would join) and is
stopped by killing exactly its processes (``ray stop`` would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.flower_env import free_port
from tests.support.flower_processes import local_simulation
from tests.support.process_tree import _kill_tree

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))

#: Prints the Ray node of every ClientApp actor the cluster ran, from its actor table. Ray's
#: state API (``ray list actors``) needs the dashboard extra; the GCS table does not.
ACTOR_NODES = """
import json, ray
from ray._private import state
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
nodes = {{n["NodeID"]: sorted(k for k in n["Resources"] if k.endswith("_node"))
         for n in ray.nodes()}}
print(json.dumps([nodes.get(a["Address"]["NodeID"]) for a in state.actors().values()
                  if a.get("ActorClassName") == "ClientAppActor"]))
"""


def _ray_environment() -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def _start(arguments: list[str]) -> None:
    done = subprocess.run(  # noqa: S603 - Ray's own command of this environment
        [RAY, "start", *arguments, "--num-cpus=1", "--disable-usage-stats"],
        env=_ray_environment(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _kill_cluster(folder: str) -> None:
    """Kill every process of the cluster whose files are in ``folder``, with its descendants
    (the agents a raylet starts name themselves ``ray::...`` and hold no path), and only those."""
    for _ in range(20):
        listed = subprocess.run(
            ["pgrep", "-f", "--", folder], capture_output=True, text=True, check=False
        )
        pids = [int(pid) for pid in listed.stdout.split()]
        if not pids:
            return
        for pid in pids:
            _kill_tree(pid)


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A two-node Ray cluster on 127.0.0.1 (head: resource ``head_node``, worker:
    ``worker_node``, one CPU each); yields its address."""
    if shutil.which("pgrep") is None:
        pytest.skip("pgrep is needed to stop the test's own Ray processes")
    # short: Ray's socket paths under it must stay below the OS limit of ~107 characters
    folder = tempfile.mkdtemp(prefix="fpray-")
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        _start(
            [
                "--head",
                f"--port={port}",
                f"--temp-dir={folder}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                '--resources={"head_node": 1}',
            ]
        )
        _start(
            [
                f"--address={address}",
                f"--dashboard-agent-listen-port={free_port()}",
                '--resources={"worker_node": 1}',
            ]
        )
        yield address
    finally:
        _kill_cluster(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_job_runs_its_clientapps_on_both_nodes_of_a_ray_cluster(
    ray_cluster: str, tmp_path: Path
) -> None:
    config = tomllib.loads((REPO / "configs" / "ldp-quick.toml").read_text())
    config.update({"min-nodes": 2, "users-per-node": 200, "output-dir": str(tmp_path / "run")})
    with local_simulation(
        REPO, 2, tmp_path / "flwr-home", env={"RAY_ADDRESS": ray_cluster}
    ) as simulation:
        run = simulation.run(config, timeout=600)
    assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert all(audit["accepted_nodes"] == 2 for audit in results["audits"]), results["audits"]
    probe = subprocess.run(  # noqa: S603 - this environment's Python
        [sys.executable, "-c", ACTOR_NODES.format(address=ray_cluster)],
        env=_ray_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    nodes = json.loads(probe.stdout.strip().splitlines()[-1])
    # one ClientApp actor per CPU: one on the head, one on the worker
    assert sorted(map(tuple, nodes)) == [("head_node",), ("worker_node",)], nodes
