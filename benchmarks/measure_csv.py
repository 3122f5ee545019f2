"""`fedparity measure` on a large CSV: rows per second and peak memory of the command.

    python benchmarks/measure_csv.py [--rows 10000000] [--keep FILE]

Writes a CSV (header ``client,group,metric``; two groups, metric gap 0.2) into a temporary
folder, runs ``fedparity measure --json`` on it in a child process, and reports the child's
wall time and peak resident memory (``ru_maxrss`` of the child). The file is streamed in
chunks, so memory does not grow with the number of rows. Writes
benchmarks/results/measure_csv.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
WRITE_CHUNK = 1_000_000


def write_csv(path: Path, rows: int, seed: int) -> float:
    """Write the file; return its true metric gap."""
    rng = np.random.default_rng(seed)
    sums, counts = np.zeros(2), np.zeros(2)
    with path.open("w") as handle:
        handle.write("client,group,metric\n")
        for start in range(0, rows, WRITE_CHUNK):
            size = min(WRITE_CHUNK, rows - start)
            groups = rng.integers(0, 2, size)
            metric = rng.random(size) * 0.4 + 0.3 + 0.2 * (groups == 0)
            sums += np.bincount(groups, weights=metric, minlength=2)
            counts += np.bincount(groups, minlength=2)
            block = np.column_stack([np.arange(start, start + size), groups, metric])
            np.savetxt(handle, block, fmt=["%d", "%d", "%.5f"], delimiter=",")
    means = sums / counts
    return float(abs(means[0] - means[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=float, default=1e7)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = int(args.rows)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clients.csv"
        started = time.perf_counter()
        true_gap = write_csv(path, rows, args.seed)
        written = time.perf_counter() - started
        fedparity = Path(sys.executable).with_name("fedparity")
        command = [
            str(fedparity),
            "measure",
            "--input",
            str(path),
            "--epsilon",
            str(args.epsilon),
            "--seed",
            str(args.seed),
            "--json",
        ]
        started = time.perf_counter()
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        elapsed = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
        size_mb = path.stat().st_size / 2**20
    payload = json.loads(output)
    row = {
        "rows": rows,
        "file_mb": size_mb,
        "seconds": elapsed,
        "rows_per_second": rows / elapsed,
        "peak_rss_mb": peak_mb,
        "gap_estimate": payload["gaps"][0],
        "true_gap": true_gap,
        "write_seconds": written,
    }
    table = (
        "| rows | file MB | seconds | M rows/s | peak RSS MB | gap est. | true gap |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {rows:.0e} | {size_mb:.0f} | {elapsed:.1f} | {rows / elapsed / 1e6:.2f} "
        f"| {peak_mb:.0f} | {row['gap_estimate']:.4f} | {true_gap:.4f} |"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "measure_csv.md").write_text(table + "\n")
    print(json.dumps(row))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
