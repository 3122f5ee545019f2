"""Latency of a deployed exchange and of a deployed FPFL round, per ClientApp executor.

    python -m benchmarks.deployed_exchange [--nodes 3 10] [--modes subprocess warm]
        [--superlink-state file memory]

A real SuperLink and N SuperNodes on 127.0.0.1 (``tests/support/flower_processes.py``: the tests'
SuperNodes, which poll the SuperLink every 0.1 s instead of Flower's 3 s), each SuperNode run
with ``--isolation process`` beside ``fedparity-superexec`` (the app gate) with the given
executor:

* ``subprocess`` -- Flower's executor: a fresh ``fedparity-clientapp`` process per message;
* ``warm`` -- :mod:`fedparity.clients.warm_clientapp`: a ClientApp process forked per message
  from a zygote that imported Flower, fedparity, torch and TenSEAL once;
* ``flower`` -- Flower's default SuperNode (``--isolation subprocess``, ungated
  ``flwr-clientapp``), for reference.

and the SuperLink's state either in a SQLite file (``file``, ``--database``: what survives a
restart, the default here) or in Flower's default in-memory state (``memory``).

Per (mode, N) it times whole ``flwr run`` calls of the built-in app and takes differences, so
that what every run pays once (the CLI, the ServerApp process, the first FAB install) cancels:

* one exchange = (LDP audit with 4 epsilons - with 1 epsilon) / 3 (one query per audit,
  ``num-server-rounds=0``);
* one FPFL round = (FPFL with 3 rounds - with 1 round) / 2 (two exchanges a round: masked
  vectors, then the unmask).

A first one-audit run per deployment warms the nodes up (FAB install) and is not used.
Writes benchmarks/results/deployed_exchange.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from fedparity.clients.app_gate import app_bundle_hash
from fedparity.server.cli.identity import write_node_identities
from tests.support.flower_processes import local_deployment

REPO = Path(__file__).resolve().parents[1]

RESULTS = Path(__file__).resolve().parent / "results"
USERS = 300
MODES = ("subprocess", "warm", "flower")
STATES = ("file", "memory")


def _superexec(mode: str) -> list[str] | None:
    return None if mode == "flower" else ["fedparity-superexec", "--executor", mode]


def _timed(deployment, config: dict, timeout: float) -> float:
    start = time.perf_counter()
    run = deployment.run(config, timeout=timeout)
    elapsed = time.perf_counter() - start
    if run.status != "finished:completed":
        raise RuntimeError(f"run ended {run.status}:\n{run.output[-3000:]}")
    return elapsed


def measure(mode: str, nodes: int, work: Path, app_hash: str, state: str = "file") -> dict:
    """Seconds per exchange and per FPFL round with ``nodes`` SuperNodes in ``mode``, the
    SuperLink's state in ``state`` (``"file"`` or ``"memory"``). Each node has its identity
    key and the roster (``fedparity identity``), which the built-in policy's
    ``require-roster`` asks of an FPFL node."""
    identities = write_node_identities(work / "identity", nodes, overwrite=True)
    configs = [
        f'partition-id={i} num-partitions={nodes} fpfl-max-delta=0.01 allowed-apps="{app_hash}" '
        f"identity-key='{identities / f'node-{i}.key'}' roster='{identities / 'roster.toml'}'"
        for i in range(nodes)
    ]
    ldp = {
        "users-per-node": USERS,
        "num-server-rounds": 0,
        "user-budget": 10.0,
        "min-nodes": nodes,
        "reply-timeout": 120.0,
    }
    fpfl = {
        "task": "fpfl",
        "users-per-node": USERS,
        "fpfl-cohort-size": 200,
        "min-nodes": nodes,
        "reply-timeout": 120.0,
    }
    superexec = _superexec(mode)
    with local_deployment(
        REPO,
        nodes,
        configs,
        work / "flwr-home",
        work_dir=work / "deployment",
        superexecs=None if superexec is None else [superexec] * nodes,
        startup_timeout=180.0,
        superlink_state=state,
    ) as deployment:
        out = work / "runs"
        _timed(deployment, {**ldp, "epsilons": "1", "output-dir": str(out / "warm-up")}, 600)
        one = _timed(deployment, {**ldp, "epsilons": "1", "output-dir": str(out / "l1")}, 600)
        four = _timed(
            deployment, {**ldp, "epsilons": "1,1,1,1", "output-dir": str(out / "l4")}, 600
        )
        f1 = _timed(deployment, {**fpfl, "fpfl-rounds": 1, "output-dir": str(out / "f1")}, 900)
        f3 = _timed(deployment, {**fpfl, "fpfl-rounds": 3, "output-dir": str(out / "f3")}, 900)
    return {
        "mode": mode,
        "nodes": nodes,
        "superlink_state": state,
        "ldp_run_1_audit_s": round(one, 2),
        "ldp_run_4_audits_s": round(four, 2),
        "exchange_s": round((four - one) / 3, 2),
        "fpfl_run_1_round_s": round(f1, 2),
        "fpfl_run_3_rounds_s": round(f3, 2),
        "fpfl_round_s": round((f3 - f1) / 2, 2),
    }


def planned_runs(
    nodes: Sequence[int], modes: Sequence[str], states: Sequence[str]
) -> list[tuple[int, str, str, str]]:
    """``(nodes, mode, state, folder name)`` of each measurement, in order; a setting given
    twice (``--superlink-state memory memory``) is measured twice, each in its own folder."""
    runs = [(n, mode, state) for n in nodes for mode in modes for state in states]
    return [(n, mode, state, f"{i}-{mode}-{n}-{state}") for i, (n, mode, state) in enumerate(runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["subprocess", "warm"])
    parser.add_argument(
        "--superlink-state",
        nargs="+",
        choices=STATES,
        default=["file"],
        help="the SuperLink's state: a SQLite file (--database) or Flower's in-memory default",
    )
    parser.add_argument("--output", default=str(RESULTS / "deployed_exchange"))
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.nodes):
        parser.error("--nodes must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="deployed-exchange-") as folder:
        app_hash = app_bundle_hash(REPO)  # the gate's allowed-apps, in each node's config
        for nodes, mode, state, name in planned_runs(args.nodes, args.modes, args.superlink_state):
            work = Path(folder) / name
            row = measure(mode, nodes, work, app_hash, state)
            print(json.dumps(row), flush=True)
            rows.append(row)
    header = (
        "| executor | SuperNodes | SuperLink state | exchange (s) | FPFL round (s) "
        "| LDP run, 1 audit (s) | FPFL run, 1 round (s) |\n|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['mode']} | {r['nodes']} | {r['superlink_state']} | {r['exchange_s']:.2f} "
        f"| {r['fpfl_round_s']:.2f} | {r['ldp_run_1_audit_s']:.2f} "
        f"| {r['fpfl_run_1_round_s']:.2f} |"
        for r in rows
    ]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    table = header + "\n".join(lines) + "\n"
    text = f"# Deployed exchange latency\n\n{time.strftime('%Y-%m-%d')}, {machine}\n\n{table}"
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".md").write_text(text, encoding="utf-8")
    output.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
