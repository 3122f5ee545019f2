"""Throughput and memory of the LDP mechanisms + estimator, streamed over N clients.

    python benchmarks/ldp_throughput.py --clients 100000000 [--mechanism R|L] [--json]
    python benchmarks/ldp_throughput.py --sweep        # 1e6, 1e7, 1e8 for both mechanisms

Clients are synthetic (two balanced groups whose mean metric differs by 0.2), generated chunk
by chunk; generating them is timed separately from the mechanism + estimator (input checks,
perturbation, per-group summary, final estimate). Each mechanism runs in its own fresh
process so that ``peak_rss_mb`` (the process's maximum resident set size) is its own. The
one-time start-up (imports such as scipy's, M_L's noise table, a first audit of 2^16 clients)
is reported apart (``startup_seconds``); the throughput is the warm audit's, best of three
(``--repeats``).
``--sweep`` writes a Markdown table to benchmarks/results/ldp_throughput.md.

The privacy noise comes from the cryptographically secure generator the nodes use
(:func:`fedparity.mechanisms.crypto.secure_random.secure_generator`, AES-128-CTR), and M_L is the
grid mechanism with its integer-only sampler; ``--generator pcg64`` measures the same with
NumPy's statistical generator for comparison. ``--seed`` seeds only the synthetic clients.

Targets (the project's requirements): with the secure generator, M_R >= 200 M clients/s and
M_L >= 100 M clients/s (issue 30; about 77 reached) warm at 10^7 on a 2-core machine, 10^8
clients under 1 GB peak memory, throughput flat from 10^6 to 10^8.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fedparity.mechanisms import GapEstimate, estimate_gap, mechanism_for_budget, summarize_stream
from fedparity.mechanisms.crypto.secure_random import secure_generator
from fedparity.mechanisms.ldp.calibration import GapMechanismType
from fedparity.mechanisms.ldp.laplace import LaplaceMechanism
from fedparity.mechanisms.ldp.reports import ReportSummary

GENERATION_CHUNK = 1 << 20
#: Clients of the start-up audit, timed apart from the measured ones.
WARM_UP_CLIENTS = 1 << 16
RESULTS = Path(__file__).resolve().parent / "results"


def synthetic_chunk(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two balanced groups; metric ~ U(0.5, 0.9) for group 0, U(0.3, 0.7) for group 1."""
    groups = (rng.random(size, dtype=np.float32) < 0.5).astype(np.int8)
    metric = rng.random(size, dtype=np.float32) * 0.4 + 0.3 + 0.2 * (groups == 0)
    return groups, 2.0 * metric - 1.0


def _run(
    mechanism: GapMechanismType,
    num_clients: int,
    seed: int,
    mechanism_rng: np.random.Generator,
) -> tuple[float, float, GapEstimate]:
    """(mechanism seconds, generation seconds, estimate) of one audit of ``num_clients``."""
    data_rng = np.random.default_rng(seed)
    total = ReportSummary.empty(2)
    generation = work = 0.0
    remaining = num_clients
    while remaining:
        size = min(GENERATION_CHUNK, remaining)
        started = time.perf_counter()
        chunk = synthetic_chunk(data_rng, size)
        generated = time.perf_counter()
        total = total.merge(summarize_stream(mechanism, [chunk], mechanism_rng))
        work += time.perf_counter() - generated
        generation += generated - started
        remaining -= size
    started = time.perf_counter()
    estimate = estimate_gap(total, mechanism, confidence=0.99)
    work += time.perf_counter() - started
    return work, generation, estimate


def measure(
    mechanism_name: str,
    num_clients: int,
    epsilon: float,
    seed: int,
    generator: str = "secure",
    repeats: int = 3,
) -> dict:
    """Start-up (imports, tables, the first small audit) timed apart; then the warm audit of
    ``num_clients``, best of ``repeats``."""
    started = time.perf_counter()
    mechanism = mechanism_for_budget(mechanism_name, epsilon)  # type: ignore[arg-type]
    if isinstance(mechanism, LaplaceMechanism):
        mechanism.check_releasable()  # builds M_L's noise table
    mechanism_rng = secure_generator() if generator == "secure" else np.random.default_rng()
    _run(mechanism, WARM_UP_CLIENTS, seed, mechanism_rng)  # loads scipy, fills the caches
    startup = time.perf_counter() - started
    runs = [_run(mechanism, num_clients, seed, mechanism_rng) for _ in range(repeats)]
    work, generation, estimate = min(runs, key=lambda run: run[0])
    return {
        "mechanism": mechanism.name,
        "generator": generator,
        "clients": num_clients,
        "epsilon": epsilon,
        "clients_per_second": num_clients / work,
        "mechanism_seconds": work,
        "startup_seconds": startup,
        "repeats": repeats,
        "generation_seconds": generation,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "gap_estimate": estimate.gaps[0],
        "true_gap": 0.2,
        "gap_stderr": estimate.difference_stderrs[0],
    }


def run_in_subprocess(
    mechanism: str, num_clients: int, epsilon: float, seed: int, generator: str, repeats: int = 3
) -> dict:
    command = [
        sys.executable,
        __file__,
        "--clients",
        str(num_clients),
        "--mechanism",
        mechanism,
        "--epsilon",
        str(epsilon),
        "--seed",
        str(seed),
        "--generator",
        generator,
        "--repeats",
        str(repeats),
        "--json",
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def markdown(rows: list[dict]) -> str:
    lines = [
        "| mechanism | generator | clients | M clients/s | mechanism s | generation s "
        "| start-up s | peak RSS MB | gap est. |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| M_{row['mechanism']} | {row['generator']} | {row['clients']:.0e} "
            f"| {row['clients_per_second'] / 1e6:.1f} "
            f"| {row['mechanism_seconds']:.3f} | {row['generation_seconds']:.2f} "
            f"| {row['startup_seconds']:.2f} | {row['peak_rss_mb']:.0f} "
            f"| {row['gap_estimate']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=float, default=1e7, help="number of clients N")
    parser.add_argument("--mechanism", choices=("R", "L"), help="default: both")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic clients")
    parser.add_argument(
        "--generator",
        choices=("secure", "pcg64"),
        default="secure",
        help="noise generator: the nodes' AES-CTR one (default) or NumPy's PCG64",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="warm runs measured, the best kept (default 3)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per mechanism")
    parser.add_argument("--sweep", action="store_true", help="1e6, 1e7, 1e8; writes a table")
    args = parser.parse_args(argv)
    if args.clients < 1 or not float(args.clients).is_integer():
        parser.error(f"--clients must be a positive integer, got {args.clients}")
    mechanisms = (args.mechanism,) if args.mechanism else ("R", "L")
    if args.mechanism and not args.sweep:
        row = measure(
            args.mechanism,
            int(args.clients),
            args.epsilon,
            args.seed,
            args.generator,
            max(args.repeats, 1),
        )
        print(json.dumps(row) if args.json else markdown([row]))
        return 0
    sizes = (10**6, 10**7, 10**8) if args.sweep else (int(args.clients),)
    rows = []
    for size in sizes:
        for name in mechanisms:
            row = run_in_subprocess(
                name, size, args.epsilon, args.seed, args.generator, max(args.repeats, 1)
            )
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"M_{name} N={size:.0e}: {row['clients_per_second'] / 1e6:.1f} M clients/s, "
                    f"peak {row['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    if args.sweep:
        RESULTS.mkdir(exist_ok=True)
        table = markdown(rows)
        header = (
            f"# LDP throughput ({platform.processor() or platform.machine()}, "
            f"{time.strftime('%Y-%m-%d')}, epsilon {args.epsilon:g}, {args.generator} "
            "generator, one process)\n\n"
        )
        (RESULTS / "ldp_throughput.md").write_text(header + table + "\n")
        (RESULTS / "ldp_throughput.json").write_text(json.dumps(rows, indent=2) + "\n")
        if not args.json:
            print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
