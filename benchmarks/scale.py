"""Scale of the LDP audit job through Flower's simulation engine: time and peak memory.

    python -m benchmarks.scale [--nodes 10,100,1000] [--users 1e5,1e6,1e7] [--timeout 900]
                               [--json] [--mem-guard-gb 16]

Every size is one ``flwr run --stream`` of the built-in app with ``task = "ldp-audit"``, exactly
as users submit it, against a simulation SuperLink of the benchmark's own on free ports
(``tests/support/simulation.py``; never the managed one on port 39091), started afresh per size.
The run config is ``configs/ldp-quick.toml`` with ``users-per-node``, ``min-nodes`` (= nodes),
``num-server-rounds = 1``, ``epsilons = "1"`` (one audit), ``ground-truth = false`` and a
temporary ``output-dir``. Two sweeps:

* nodes: 10, 100, 1000 virtual SuperNodes of ``--users-per-node-small`` (100) users each;
* users: 10^5, 10^6, 10^7 users in one audit, on 10 nodes (10^4, 10^5, 10^6 users a node).

Per size:

* time: the wall clock of the whole ``flwr run`` call, the job's own ``elapsed_seconds``
  (``results.json``) and its phases: start-up (run submitted to the job's first console line)
  and connect (to the ``N node(s)`` line: the nodes' ``describe``), from the time each line
  first reached ``flwr run --stream`` (the lines carry no timestamps; a stream can lag);
  training, the job's own ``Strategy execution finished in`` (the FedAvg round); audit, from
  the audit's release record to the job's end, both stamped by the job in ``status.json``;
* peak memory, sampled every 0.5 s from /proc over the SuperLink's whole process tree: the sum
  of RSS (counts shared pages once per process) and of PSS (shares them out; every 2 s), the
  ``flwr-simulation`` process (ServerApp and the Ray driver: the server side) and the largest
  single ``ray::ClientAppActor`` (a Ray worker that runs one virtual node's ClientApp at a
  time: the per-node side).

A size that fails (timeout, failed run, a node policy's refusal, the memory guard, which stops a
run whose tree exceeds ``--mem-guard-gb`` to protect the shared machine) is a row with its reason.
Prints a Markdown table (or one JSON object per row with ``--json``) and the fitted growth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from tests.support.flwr_runs import FlwrRun, FlwrRunError, start_flwr_run
from tests.support.process_tree import _cmdline, _descendants, _signal_group
from tests.support.simulation import local_simulation

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "configs" / "ldp-quick.toml"
SAMPLE_INTERVAL = 0.5
PSS_EVERY = 4  # PSS walks the page tables (costly for big processes): every 4th sample
MIB = 1024 * 1024

# Console lines whose first appearance marks a phase boundary.
MARKERS = {
    "submitted": "Successfully started run",
    "job_start": "fedparity ldp-audit: status in",
    "connected": re.compile(r"fedparity: \d+ node\(s\)"),
    "training_end": "Strategy execution finished in",
    "audit_start": "[AUDIT 1/",
    "results": "results written to",
}


@dataclass
class Memory:
    """Peak memory of a SuperLink's process tree (MiB), from /proc samples."""

    total_rss: float = 0.0
    total_pss: float = 0.0
    server: float = 0.0
    client_max: float = 0.0
    client_processes: int = 0
    samples: int = 0

    def sample(self, root: int) -> float:
        """Take one sample of the tree under ``root``; return its current RSS sum (MiB)."""
        rss_sum = pss_sum = 0.0
        clients = 0
        with_pss = self.samples % PSS_EVERY == 0
        for pid in [root, *_descendants(root)]:
            rss = _status_kib(pid, "VmRSS") / 1024
            rss_sum += rss
            pss_sum += _pss_kib(pid) / 1024 if with_pss else 0.0
            args = _cmdline(pid)
            if not args:
                continue
            if args[0].startswith("ray::ClientAppActor"):
                clients += 1
                self.client_max = max(self.client_max, rss)
            elif any(arg.endswith("flwr-simulation") for arg in args[:2]):
                self.server = max(self.server, rss)
        self.total_rss = max(self.total_rss, rss_sum)
        self.total_pss = max(self.total_pss, pss_sum)
        self.client_processes = max(self.client_processes, clients)
        self.samples += 1
        return rss_sum


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class Row:
    """One measured size."""

    sweep: str
    nodes: int
    users_per_node: int
    users: int
    ok: bool = False
    status: str = ""
    reason: str = ""
    run_s: float | None = None
    job_s: float | None = None
    startup_s: float | None = None
    connect_s: float | None = None
    training_s: float | None = None
    audit_s: float | None = None
    console_audit_s: float | None = None
    strategy_s: float | None = None
    peak_total_rss_mib: float | None = None
    peak_total_pss_mib: float | None = None
    peak_server_mib: float | None = None
    peak_client_mib: float | None = None
    client_processes: int | None = None
    marks: dict[str, float] = field(default_factory=dict)


def _marks(output: str, seen: dict[str, float], now: float) -> None:
    for name, marker in MARKERS.items():
        if name in seen:
            continue
        found = marker.search(output) if isinstance(marker, re.Pattern) else marker in output
        if found:
            seen[name] = now


def _span(marks: dict[str, float], start: str, end: str) -> float | None:
    if start in marks and end in marks:
        return round(marks[end] - marks[start], 1)
    return None


def _job_audit_seconds(status_file: Path) -> float | None:
    """Seconds from the audit's release record (written just before it is sent) to the job's
    end, both stamped by the job itself in ``status.json`` (1 s resolution)."""
    try:
        status = json.loads(status_file.read_text(encoding="utf-8"))
        sent = datetime.fromisoformat(status["releases"][0]["time"])
        return (datetime.fromisoformat(status["ended"]) - sent).total_seconds()
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _failure_reason(result: FlwrRun) -> str:
    """The most telling part of a failed run's output (300 characters from the first match)."""
    text = (result.status_details or "") + "\n" + result.output
    for pattern in ("PolicyRefusal", "refus", "MemoryError", "Killed", "Error", "error"):
        for line in text.splitlines():
            if (at := line.find(pattern)) >= 0:
                return line[max(0, at - 40) : at + 260].strip()
    return (result.status_details or f"exit {result.returncode}")[:300]


def measure(
    sweep: str, nodes: int, users_per_node: int, timeout: float, mem_guard_mib: float
) -> Row:
    """Run one LDP audit of ``nodes`` x ``users_per_node`` users and measure it."""
    row = Row(sweep, nodes, users_per_node, nodes * users_per_node)
    config = tomllib.loads(BASE_CONFIG.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="fedparity-scale-") as folder:
        work = Path(folder)
        config.update(
            {
                "users-per-node": users_per_node,
                "min-nodes": nodes,
                "num-server-rounds": 1,
                "epsilons": "1",
                "ground-truth": False,
                "output-dir": str(work / "out"),
                "reply-timeout": float(max(timeout, 600.0)),
                "node-wait-timeout": float(max(timeout, 120.0)),
            }
        )
        memory = Memory()
        with local_simulation(
            REPO, nodes, work / "flwr-home", work_dir=work / "superlink", startup_timeout=120.0
        ) as sim:
            background = start_flwr_run(
                sim.app_dir,
                sim.federation,
                config,
                sim.flwr_home,
                timeout,
                federation_config={
                    "num-supernodes": nodes,
                    "client-resources-num-cpus": sim.client_cpus,
                },
            )
            aborted = ""
            try:
                while background.running():
                    now = time.monotonic() - background.started
                    rss = memory.sample(sim.superlink.pid)
                    _marks(background.output(), row.marks, now)
                    if rss > mem_guard_mib:
                        aborted = f"memory guard: process tree RSS {rss / 1024:.1f} GiB"
                    elif now > timeout:
                        aborted = f"timeout after {timeout:.0f} s"
                    if aborted:
                        _signal_group(background.pid, signal.SIGKILL)
                        break
                    time.sleep(SAMPLE_INTERVAL)
                result = background.wait(timeout=60)
            except FlwrRunError as err:
                aborted = aborted or str(err).splitlines()[0]
                result = err.result
            finally:
                background.close()
        if result is not None:
            _marks(result.output, row.marks, result.duration)
            row.run_s = round(result.duration, 1)
            row.status = result.status or f"exit {result.returncode}"
            strategy = re.search(r"Strategy execution finished in ([\d.]+)s", result.output)
            row.strategy_s = float(strategy.group(1)) if strategy else None
        results_json = work / "out" / "results.json"
        if results_json.is_file():
            row.job_s = round(json.loads(results_json.read_text())["elapsed_seconds"], 1)
        row.audit_s = _job_audit_seconds(work / "out" / "status.json")
        row.ok = not aborted and row.status == "finished:completed" and row.job_s is not None
        if aborted:
            row.reason = aborted
        elif not row.ok and result is not None:
            row.reason = _failure_reason(result)
    row.startup_s = _span(row.marks, "submitted", "job_start")
    row.connect_s = _span(row.marks, "job_start", "connected")
    row.training_s = row.strategy_s
    row.console_audit_s = _span(row.marks, "audit_start", "results")
    row.peak_total_rss_mib = round(memory.total_rss)
    row.peak_total_pss_mib = round(memory.total_pss)
    row.peak_server_mib = round(memory.server)
    row.peak_client_mib = round(memory.client_max)
    row.client_processes = memory.client_processes
    row.marks = {k: round(v, 1) for k, v in row.marks.items()}
    return row


def fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares line ``y = a + b x`` with R^2, and the power-law exponent of the
    increments (1 for linear growth, whatever the constant part)."""
    if len(xs) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    sst = sum((y - my) ** 2 for y in ys)
    sse = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    out = {"slope": slope, "intercept": intercept, "r2": 1 - sse / sst if sst else 1.0}
    if n >= 3:
        d1, d2 = ys[-2] - ys[-3], ys[-1] - ys[-2]
        ratio = (xs[-1] - xs[-2]) / (xs[-2] - xs[-3])
        if d1 > 0 and d2 > 0:
            out["increment_exponent"] = math.log(d2 / d1) / math.log(ratio)
    return out


def growth(rows: list[Row]) -> list[str]:
    """Sentences on how time and memory grow along each sweep (successful rows only)."""
    lines = []
    quantities = [
        ("run_s", "flwr run time", "s"),
        ("job_s", "job time", "s"),
        ("audit_s", "audit time", "s"),
        ("peak_total_rss_mib", "peak tree RSS", "MiB"),
        ("peak_server_mib", "peak ServerApp RSS", "MiB"),
        ("peak_client_mib", "peak ClientApp RSS", "MiB"),
    ]
    for sweep, unit, per in (("nodes", "nodes", 100), ("users", "users", 1_000_000)):
        done = sorted((r for r in rows if r.sweep == sweep and r.ok), key=lambda r: r.users)
        if len(done) < 2:
            continue
        xs = [float(r.nodes if sweep == "nodes" else r.users) for r in done]
        for key, name, u in quantities:
            ys = [getattr(r, key) for r in done]
            if any(y is None for y in ys):
                continue
            f = fit(xs, [float(y) for y in ys])
            if f is None:
                continue
            text = (
                f"{sweep} sweep, {name}: {f['slope'] * per:+.2f} {u} per {per:,} {unit} "
                f"(+ {f['intercept']:.1f} {u} fixed), R^2 {f['r2']:.3f}"
            )
            if "increment_exponent" in f:
                text += f", increment exponent {f['increment_exponent']:.2f} (1 = linear)"
            lines.append(text)
    return lines


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    head = (
        "| sweep | nodes | users/node | users | result | flwr run (s) | job (s) | start-up (s) "
        "| connect (s) | training (s) | audit (s) | peak tree RSS (MiB) | peak tree PSS (MiB) "
        "| peak ServerApp (MiB) | peak ClientApp (MiB) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        result = "ok" if r.ok else f"FAILED: {r.reason or r.status}".replace("|", "/")
        lines.append(
            f"| {r.sweep} | {r.nodes:,} | {r.users_per_node:,} | {r.users:,} | {result} "
            f"| {_cell(r.run_s)} | {_cell(r.job_s)} | {_cell(r.startup_s)} "
            f"| {_cell(r.connect_s)} | {_cell(r.training_s)} | {_cell(r.audit_s)} "
            f"| {_cell(r.peak_total_rss_mib, 0)} | {_cell(r.peak_total_pss_mib, 0)} "
            f"| {_cell(r.peak_server_mib, 0)} | {_cell(r.peak_client_mib, 0)} |"
        )
    return head + "\n".join(lines) + "\n"


def _sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    """Measure the requested sizes; print the table (or JSON rows) and the growth."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="10,100,1000", help="node counts ('' to skip)")
    parser.add_argument("--users", default="1e5,1e6,1e7", help="total users ('' to skip)")
    parser.add_argument("--users-per-node-small", type=int, default=100)
    parser.add_argument("--user-sweep-nodes", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--mem-guard-gb", type=float, default=16.0)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    plan = [("nodes", n, args.users_per_node_small) for n in _sizes(args.nodes)]
    plan += [
        ("users", args.user_sweep_nodes, max(1, u // args.user_sweep_nodes))
        for u in _sizes(args.users)
    ]
    if shutil.which("flower-superlink") is None and not os.environ.get("VIRTUAL_ENV"):
        parser.error("activate the project's venv first (flower-superlink not found)")
    # SIGTERM unwinds like Ctrl-C: each SuperLink's process tree and temporary folder go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    for sweep, nodes, per_node in plan:
        row = measure(sweep, nodes, per_node, args.timeout, args.mem_guard_gb * 1024)
        rows.append(row)
        if args.json:
            print(json.dumps(asdict(row)), flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    if args.json:
        print(json.dumps({"machine": machine, "growth": growth(rows)}), file=sys.stderr)
    else:
        print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine}\n")
        print(table(rows))
        for line in growth(rows):
            print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
