"""Throughput of the joint (group, confusion cell) report beside M_R, in the same run.

    python -m benchmarks.joint_report_throughput [--clients 1e7] [--groups 2] [--epsilon 1]
    python -m benchmarks.joint_report_throughput --oracle grr           # one oracle, JSON

Each user holds (group, y_true, y_pred); the timed work is the client side and the server
side of one joint report: encoding the confusion cell (``encode_cells``), the frequency
oracle's perturbation and counting (``FrequencyOracle.perturb_and_count``, users in chunks),
then the unbiased counts with their covariance and every rate metric with intervals
(``group_rates``). Generating the synthetic users is timed separately, as in
``benchmarks/ldp_throughput.py``, whose M_R measurement (``run_in_subprocess``) runs here too,
with the same number of users, epsilon, seed and noise generator. Both are measured alike:
the one-time start-up (imports such as scipy's, the oracle's thresholds, a first report of
``WARM_UP_CLIENTS`` users) is reported apart (``startup_seconds``), and the throughput is the
best of ``--warm-runs`` warm runs in the process. Every measurement is a fresh process, so its
peak memory is its own, and the measurements are interleaved and repeated (``--repeats``, best
kept) because a shared machine's load varies within a run. Target (issue 28): the joint report
at 10^7 users at least as fast as M_R.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.ldp_throughput import GENERATION_CHUNK, WARM_UP_CLIENTS, run_in_subprocess
from fedparity.mechanisms import (
    FrequencyOracle,
    GroupRates,
    encode_cells,
    frequency_oracle,
    group_rates,
)
from fedparity.mechanisms.crypto.secure_random import secure_generator

REPO = Path(__file__).resolve().parents[1]
ORACLES = ("best", "grr", "oue", "ss")


def synthetic_chunk(
    rng: np.random.Generator, size: int, num_groups: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Balanced groups; base rate 0.3 + 0.1 g, predictions right 80 % of the time."""
    groups = rng.integers(0, num_groups, size, dtype=np.int16)
    y_true = (rng.random(size, dtype=np.float32) < 0.3 + 0.1 * (groups % 3)).astype(np.int8)
    wrong = rng.random(size, dtype=np.float32) < 0.2
    return groups, y_true, (y_true ^ wrong).astype(np.int8)


def _run(
    oracle: FrequencyOracle,
    num_clients: int,
    num_groups: int,
    seed: int,
    noise_rng: np.random.Generator,
) -> tuple[float, float, np.ndarray, GroupRates]:
    """(work seconds, generation seconds, true cell counts, rates) of one joint report."""
    data_rng = np.random.default_rng(seed)
    support = np.zeros(oracle.domain_size, dtype=np.int64)
    exact = np.zeros(oracle.domain_size, dtype=np.int64)
    generation = work = 0.0
    remaining = num_clients
    while remaining:
        size = min(GENERATION_CHUNK, remaining)
        started = time.perf_counter()
        groups, y_true, y_pred = synthetic_chunk(data_rng, size, num_groups)
        generated = time.perf_counter()
        cells = encode_cells(groups, y_true, y_pred, num_groups)
        support += oracle.perturb_and_count(cells, noise_rng)
        work += time.perf_counter() - generated
        generation += generated - started
        exact += np.bincount(cells, minlength=oracle.domain_size)  # the truth, not timed
        remaining -= size
    started = time.perf_counter()
    rates = group_rates(oracle.estimate(support, num_clients), num_groups=num_groups)
    rates.demographic_parity_difference()
    work += time.perf_counter() - started
    return work, generation, exact, rates


def measure(
    oracle_name: str,
    num_clients: int,
    epsilon: float,
    num_groups: int,
    seed: int,
    generator: str,
    warm_runs: int = 3,
) -> dict:
    """Start-up (imports, thresholds, a first small report) timed apart; then the warm joint
    report of ``num_clients`` users, best of ``warm_runs``."""
    started = time.perf_counter()
    oracle = frequency_oracle(oracle_name, epsilon, 4 * num_groups, num_users=num_clients)
    noise_rng = secure_generator() if generator == "secure" else np.random.default_rng()
    _run(oracle, min(WARM_UP_CLIENTS, num_clients), num_groups, seed, noise_rng)
    startup = time.perf_counter() - started
    runs = [_run(oracle, num_clients, num_groups, seed, noise_rng) for _ in range(warm_runs)]
    work, generation, exact, rates = min(runs, key=lambda run: run[0])
    dp = rates.demographic_parity_difference()
    truth = group_rates(exact.astype(np.float64), num_groups=num_groups)
    return {
        "mechanism": f"joint-{oracle.name}",
        "oracle": repr(oracle),
        "generator": generator,
        "clients": num_clients,
        "epsilon": epsilon,
        "groups": num_groups,
        "clients_per_second": num_clients / work,
        "mechanism_seconds": work,
        "startup_seconds": startup,
        "warm_runs": warm_runs,
        "generation_seconds": generation,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "dp_difference": dp.value,
        "dp_difference_interval": [dp.lower, dp.upper],
        "true_dp_difference": truth.demographic_parity_difference().value,
    }


def joint_in_subprocess(
    oracle: str,
    num_clients: int,
    epsilon: float,
    num_groups: int,
    seed: int,
    generator: str,
    warm_runs: int = 3,
) -> dict:
    command = [sys.executable, "-m", "benchmarks.joint_report_throughput"]
    command += ["--oracle", oracle, "--clients", str(num_clients)]
    command += ["--epsilon", str(epsilon), "--groups", str(num_groups), "--seed", str(seed)]
    command += ["--generator", generator, "--warm-runs", str(warm_runs), "--json"]
    output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=float, default=1e7, help="number of users N")
    parser.add_argument("--groups", type=int, default=2, help="number of groups d (k = 4 d)")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic users")
    parser.add_argument("--oracle", choices=ORACLES, help="one oracle in this process")
    parser.add_argument("--generator", choices=("secure", "pcg64"), default="secure")
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs; best kept")
    parser.add_argument(
        "--warm-runs", type=int, default=3, help="warm runs in each process; best kept"
    )
    args = parser.parse_args(argv)
    if args.clients < 1 or not float(args.clients).is_integer():
        parser.error(f"--clients must be a positive integer, got {args.clients}")
    if not 2 <= args.groups <= 256:
        parser.error(f"--groups must be an integer in [2, 256], got {args.groups}")
    clients = int(args.clients)
    warm_runs = max(args.warm_runs, 1)
    if args.oracle:
        row = measure(
            args.oracle, clients, args.epsilon, args.groups, args.seed, args.generator, warm_runs
        )
        print(json.dumps(row))
        return 0
    # Interleaved repeats, best of each: a shared machine's load varies within a run.
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        runs = [run_in_subprocess("R", clients, args.epsilon, args.seed, args.generator, warm_runs)]
        for name in ORACLES:
            runs.append(
                joint_in_subprocess(
                    name, clients, args.epsilon, args.groups, args.seed, args.generator, warm_runs
                )
            )
        for name, row in zip(("R", *ORACLES), runs, strict=True):
            row["repeats"] = args.repeats
            if name not in best or row["clients_per_second"] > best[name]["clients_per_second"]:
                best[name] = row
    rows = list(best.values())
    baseline = rows[0]["clients_per_second"]
    for row in rows:
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        label = "M_R (one metric)" if row["mechanism"] == "R" else row["oracle"]
        if row["mechanism"] != "R" and row is best["best"]:
            label = f"best: {label}"
        print(
            f"{label:58s} {row['clients_per_second'] / 1e6:7.1f} M users/s "
            f"({row['clients_per_second'] / baseline:4.2f} x M_R), "
            f"{row['mechanism_seconds']:6.2f} s, peak {row['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
