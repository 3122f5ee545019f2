"""FPFL on federated UCI Adult: the paper's Table 2 (m = 1000) and the end-to-end timing.

The paper: Borja Rodríguez-Gálvez, Filip Granqvist, Rogier van Dalen and Matt Seigel,
"Enforcing fairness in private federated learning via the modified method of differential
multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021
(Rodríguez-Gálvez et al. 2021).

    python -m benchmarks.fpfl_adult                      # both parts (~40 min on 2 cores)
    python -m benchmarks.fpfl_adult --table --seeds 0 --algorithms fl fpfl --rounds 20
    python -m benchmarks.fpfl_adult --timing --json

``--table``: each of the named configs configs/adult-{fl,fl-clip,pfl,ffl,ffl-clip,fpfl}.toml
(the paper's Table 2), configs/adult-fedfb.toml (FedFB under FPFL's privacy) and
configs/adult-fairfed{,-fedfb}.toml (FairFed, alone and with FedFB's reweighting); ``--split
dirichlet`` deals each group's users to the nodes in Dirichlet(``--dirichlet-alpha``) shares
(as they are, ``--rounds`` overrides T for a quick check) runs once per seed through
:func:`fedparity.server.api.run_simulation_job` with 10 simulated nodes. Run-config ``seed`` (data
split,
initial model) and ``fpfl-client-seed`` (cohort sampling and noise) are both set to the seed,
so every run is reproducible -- and therefore NOT private in a deployment. The table gives mean
+- sample std over seeds next to the paper's Table 2 (m = 1000 exists only for PFL and FPFL; the
others are shown at the paper's m = 200, labelled so) and checks the issue's acceptance
criterion: FPFL FNR gap (mean over seeds) < 0.04 and FPFL accuracy within 0.02 of PFL's.

``--timing``: ``flwr run . --run-config <copy of configs/adult-fpfl.toml>`` through the real
CLI against a simulation SuperLink started here (tests/support/flower_processes.py), 10 virtual
SuperNodes; the copy differs from the named config only in ``data-dir`` and ``output-dir``.
End to end = from before the SuperLink starts until ``flwr run`` returned and the run status
was read; per round = results.json ``history[].seconds``. Targets: < 200 s end to end and
at most 0.3 s per round with double masking (issue 12); the table also counts the rounds by
Flower ticks (the simulation engine delivers messages every 0.1 s, so a round of two exchanges
takes two ticks or more). ``--rounds`` overrides T here too (a quick check: the table says
so). It then runs
benchmarks/fpfl_statistics.py (vectorised vs per-user loop of the per-user statistics; target
>= 10x; it also writes its own results/fpfl_statistics.md) and reports its headline number.

Writes benchmarks/results/fpfl_adult.md (+ .json with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from datetime import date
from pathlib import Path
from typing import Any

import tomli_w

from benchmarks.provenance import git_commit, load_average
from fedparity.server.api import run_simulation_job
from fedparity.server.fpfl_report import PAPER_TABLE2
from fedparity.server.progress import Progress
from fedparity.server.run_record import read_status

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
ALGORITHMS = (
    "fl",
    "fl-clip",
    "pfl",
    "ffl",
    "ffl-clip",
    "fpfl",
    "fedfb",
    "fairfed",
    "fairfed-fedfb",
)
LABELS = {
    "fl": "FL",
    "fl-clip": "FL + Clip",
    "pfl": "PFL",
    "ffl": "FFL",
    "ffl-clip": "FFL + Clip",
    "fpfl": "FPFL",
    "fedfb": "FedFB",
    "fairfed": "FairFed",
    "fairfed-fedfb": "FairFed + FedFB",
}
#: What the table says about rows that are not the paper's own.
ROW_NOTES = {
    "fl": (
        "FL is FederatedSGD (one step per round on the cohort's summed gradient, no clipping, "
        "no noise): the issue's FedAvg row (FedAvg with one local gradient step, McMahan et "
        "al. 2017, 'Communication-Efficient Learning of Deep Networks from Decentralized "
        "Data'); configs/adult-fl.toml has the paper's T = 1000, the T column says what ran."
    ),
    "fedfb": (
        "FedFB (Zeng, Chen and Lee 2021, 'Improving Fairness via Federated Learning') is "
        "configs/adult-fedfb.toml: the same users, cohort, rounds, clipping, noise and "
        "accountant as FPFL, so the same epsilon per user; the server reweights the groups' "
        "surrogate risks (FedFB's lambda) instead of taking MMDM steps. One gradient step per "
        "round (no local epochs) and no alpha constraint. Its step (fpfl-fedfb-step = 0.02) was "
        "chosen over 0.005 from one probe run on seed 0 at T = 200, test set included."
    ),
    "fairfed": (
        "FairFed (Ezzeldin et al. 2023, 'FairFed: Enabling Group Fairness in Federated "
        "Learning') is configs/adult-fairfed.toml: the same users, cohort, rounds, clipping and "
        "accountant as FPFL, and the same epsilon per user (sigma split between the sum and "
        "each node's own release, fpfl-fairfed-release-share = 0.25); FederatedSGD on the "
        "node-weighted sum, node weights from the nodes' noisy releases (beta = 0.1, not tuned), "
        "no local debiasing."
    ),
    "fairfed-fedfb": (
        "FairFed + FedFB is configs/adult-fairfed-fedfb.toml: FairFed's node weights and "
        "FedFB's group reweighting (step 0.02, as configs/adult-fedfb.toml) on the weighted "
        "sums, the server-side stand-in for the local FairBatch debiasing the FairFed paper "
        "pairs its weights with."
    ),
}
METRICS = ("accuracy", "fnr_gap", "eo_gap", "demp_gap", "pp_gap")
NUM_SUPERNODES = 10
#: How often the progress of a ``flwr run`` is read from its ``status.json`` (s).
STATUS_POLL_S = 1.0
E2E_TARGET_S = 200.0
ROUND_TARGET_S = 0.3
SPEEDUP_TARGET = 10.0
SEED_NOTE = (
    "Seeded runs (`seed` = `fpfl-client-seed` = the seed) are reproducible and therefore NOT "
    "private in a deployment: anyone who knows the seed can recompute the cohorts and the "
    "noise. The epsilon shown is what the accountant gives for the noise actually added."
)


def load_config(algorithm: str) -> dict[str, Any]:
    """The named run config configs/adult-<algorithm>.toml."""
    with (REPO / "configs" / f"adult-{algorithm}.toml").open("rb") as handle:
        return tomllib.load(handle)


# --------------------------------------------------------------------------------------------
# Part 1: Table 2
# --------------------------------------------------------------------------------------------


def run_table_cell(
    algorithm: str,
    seed: int,
    adult_dir: Path,
    rounds: int | None,
    scratch: Path,
    split: tuple[str, float] = ("iid", 0.5),
) -> dict[str, Any]:
    """One algorithm, one seed, through the Python API with 10 simulated nodes; ``split`` is
    (``fpfl-split``, ``fpfl-dirichlet-alpha``)."""
    run_config = load_config(algorithm)
    run_config.update(
        {
            "data-dir": str(adult_dir),
            "seed": seed,
            "fpfl-client-seed": seed,
            "output-dir": str(scratch / f"{algorithm}-seed{seed}"),
            "fpfl-split": split[0],
            "fpfl-dirichlet-alpha": split[1],
        }
    )
    if rounds is not None:
        run_config["fpfl-rounds"] = rounds
    started = time.perf_counter()
    results = run_simulation_job(run_config, num_supernodes=NUM_SUPERNODES)
    wall = time.perf_counter() - started
    row: dict[str, Any] = {"algorithm": algorithm, "seed": seed}
    row.update({key: results[key] for key in METRICS})
    row.update(
        {
            "epsilon": results["epsilon"],
            "delta": results["delta"],
            "noise_multiplier": results["noise_multiplier"],
            "selected_round": results["selected_round"],
            "rounds": results["privacy"]["rounds_released"],
            "cohort_size": run_config["fpfl-cohort-size"],
            "users": results["population"]["users"],
            "seconds_wall": wall,
            "seconds_job": results["timing"]["seconds_total"],
            "seconds_per_round_mean": results["timing"]["seconds_per_round_mean"],
            "caveats": results["privacy"]["caveats"],
        }
    )
    return row


def _mean_std(values: list[float | None]) -> tuple[float | None, float | None, int]:
    present = [v for v in values if v is not None and math.isfinite(v)]
    if not present:
        return None, None, 0
    std = statistics.stdev(present) if len(present) > 1 else None
    return statistics.fmean(present), std, len(present)


def summarise(rows: list[dict[str, Any]], algorithms: list[str]) -> list[dict[str, Any]]:
    """Mean and sample std over seeds, per algorithm, with the paper's numbers."""
    summary = []
    for algorithm in algorithms:
        mine = [r for r in rows if r["algorithm"] == algorithm and "error" not in r]
        if not mine:
            continue
        entry: dict[str, Any] = {
            "algorithm": algorithm,
            "seeds": [r["seed"] for r in mine],
            "rounds": mine[0]["rounds"],
            "cohort_size": mine[0]["cohort_size"],
        }
        for key in (
            *METRICS,
            "epsilon",
            "noise_multiplier",
            "selected_round",
            "seconds_wall",
            "seconds_per_round_mean",
        ):
            mean, std, _ = _mean_std([r[key] for r in mine])
            entry[key] = {"mean": mean, "std": std}
        cohort = int(entry["cohort_size"])
        if (algorithm, cohort) in PAPER_TABLE2:
            paper_m = cohort
        elif (algorithm, 200) in PAPER_TABLE2:
            paper_m = 200
        else:
            paper_m = None
        paper = PAPER_TABLE2.get((algorithm, paper_m)) if paper_m else None
        entry["paper"] = (
            None if paper is None else {"m": paper_m, "accuracy": paper[0], "fnr_gap": paper[1]}
        )
        summary.append(entry)
    return summary


def acceptance(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """FPFL FNR gap (mean over seeds) < 0.04 and FPFL accuracy within 0.02 of PFL's."""
    by_name = {entry["algorithm"]: entry for entry in summary}
    if "fpfl" not in by_name or "pfl" not in by_name:
        return {"verdict": "NOT EVALUATED", "reason": "needs both pfl and fpfl in the table"}
    fnr = by_name["fpfl"]["fnr_gap"]["mean"]
    accuracy = by_name["fpfl"]["accuracy"]["mean"]
    pfl_accuracy = by_name["pfl"]["accuracy"]["mean"]
    difference = accuracy - pfl_accuracy
    passed = fnr < 0.04 and abs(difference) <= 0.02
    return {
        "verdict": "PASS" if passed else "FAIL",
        "fpfl_fnr_gap_mean": fnr,
        "fpfl_accuracy_mean": accuracy,
        "pfl_accuracy_mean": pfl_accuracy,
        "accuracy_difference": difference,
        "fnr_gap_ok": fnr < 0.04,
        "accuracy_ok": abs(difference) <= 0.02,
    }


def _pm(cell: dict[str, float | None], digits: int = 3) -> str:
    mean, std = cell["mean"], cell["std"]
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_markdown(
    rows: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    check: dict[str, Any],
    rounds_override: int | None,
) -> list[str]:
    """Markdown lines of part 1."""
    lines = [
        "## Table 2 setting: federated Adult, shallow network, m = 1000, FNR parity",
        "",
        f"Configs configs/adult-*.toml through `server.api.run_simulation_job` with "
        f"{NUM_SUPERNODES} simulated nodes; mean ± sample std over seeds (std omitted for one "
        "seed); metrics on the held-out Adult test set for the selected round's model. "
        "Epsilon: delta = 1/K; '-' = no noise (not private).",
        "",
    ]
    if rounds_override is not None:
        lines += [
            f"**T overridden to {rounds_override} rounds (quick check): not the paper setting; "
            "for the private algorithms the noise is calibrated to epsilon = 2 at this T.**",
            "",
        ]
    lines += [
        "| algorithm | T | seeds | accuracy | FNR gap | EO gap | DemP gap | PP gap | epsilon "
        "| sigma | selected round | s / run | s / round | paper acc. | paper FNR gap |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in summary:
        paper = e["paper"]
        if paper is None:
            paper_acc = paper_fnr = "-"
        else:
            tag = "" if paper["m"] == e["cohort_size"] else f" (m={paper['m']})"
            paper_acc = f"{paper['accuracy']:.3f}{tag}"
            paper_fnr = f"{paper['fnr_gap']:.3f}{tag}"
        lines.append(
            f"| {LABELS[e['algorithm']]} | {e['rounds']} | {','.join(map(str, e['seeds']))} "
            f"| {_pm(e['accuracy'])} | {_pm(e['fnr_gap'])} | {_pm(e['eo_gap'])} "
            f"| {_pm(e['demp_gap'])} | {_pm(e['pp_gap'])} | {_pm(e['epsilon'], 3)} "
            f"| {_pm(e['noise_multiplier'], 3)} | {_pm(e['selected_round'], 0)} "
            f"| {_pm(e['seconds_wall'], 0)} | {_pm(e['seconds_per_round_mean'], 3)} "
            f"| {paper_acc} | {paper_fnr} |"
        )
    lines += ["", *(ROW_NOTES[e["algorithm"]] for e in summary if e["algorithm"] in ROW_NOTES)]
    lines += [
        "",
        "Paper numbers: PAPER_TABLE2 in server/fpfl_report.py (Rodriguez-Galvez et al. 2021, "
        "Table 2, shallow). "
        "At m = 1000 the paper reports PFL and FPFL only; the other rows show its m = 200 "
        "values, labelled (m=200).",
        "",
        f"Note: {SEED_NOTE}",
        "",
        "### Acceptance check (issue)",
        "",
        "FPFL FNR gap (mean over seeds) < 0.04 and FPFL accuracy within 0.02 of PFL's: "
        f"**{check['verdict']}**",
    ]
    if "fpfl_fnr_gap_mean" in check:
        lines.append(
            f"(FPFL FNR gap {check['fpfl_fnr_gap_mean']:.4f} "
            f"{'<' if check['fnr_gap_ok'] else '>='} 0.04; FPFL accuracy "
            f"{check['fpfl_accuracy_mean']:.4f} vs PFL {check['pfl_accuracy_mean']:.4f}, "
            f"difference {check['accuracy_difference']:+.4f})"
        )
    else:
        lines.append(f"({check['reason']})")
    lines += [
        "",
        "### Per run",
        "",
        "| algorithm | seed | accuracy | FNR gap | EO gap | DemP gap | PP gap | epsilon | sigma "
        "| selected round | s / run | s / round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {LABELS[r['algorithm']]} | {r['seed']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {LABELS[r['algorithm']]} | {r['seed']} | {_num(r['accuracy'], '.4f')} "
            f"| {_num(r['fnr_gap'], '.4f')} | {_num(r['eo_gap'], '.4f')} "
            f"| {_num(r['demp_gap'], '.4f')} | {_num(r['pp_gap'], '.4f')} "
            f"| {_num(r['epsilon'], '.4f')} | {_num(r['noise_multiplier'], '.4f')} "
            f"| {_num(r['selected_round'], 'd')} | {r['seconds_wall']:.0f} "
            f"| {_num(r['seconds_per_round_mean'], '.3f')} |"
        )
    return lines


def run_table(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Part 1: every (algorithm, seed), then the summary, markdown and acceptance check."""
    adult_dir = Path(args.adult_dir).resolve()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fpfl-adult-") as folder:
        for algorithm in args.algorithms:
            for seed in args.seeds:
                print(f"[table] {algorithm} seed {seed} ...", flush=True)
                try:
                    row = run_table_cell(
                        algorithm,
                        seed,
                        adult_dir,
                        args.rounds,
                        Path(folder),
                        (args.split, args.dirichlet_alpha),
                    )
                except Exception as error:  # record it and go on with the rest
                    row = {"algorithm": algorithm, "seed": seed, "error": repr(error)}
                    print(f"[table] {algorithm} seed {seed} FAILED: {error!r}", flush=True)
                else:
                    print(
                        f"[table] {algorithm} seed {seed}: accuracy {row['accuracy']:.4f}, "
                        f"FNR gap {row['fnr_gap']:.4f}, epsilon {_num(row['epsilon'], '.3f')}, "
                        f"selected round {row['selected_round']}, {row['seconds_wall']:.0f} s",
                        flush=True,
                    )
                rows.append(row)
    summary = summarise(rows, list(args.algorithms))
    check = acceptance(summary)
    lines = table_markdown(rows, summary, check, args.rounds)
    if args.split == "dirichlet":
        lines[2:2] = [
            f"**Non-IID nodes**: fpfl-split = dirichlet, each group's users dealt to the nodes "
            f"in Dirichlet({args.dirichlet_alpha:g}) shares (the configs deal them at random).",
            "",
        ]
    return lines, {"rows": rows, "summary": summary, "acceptance": check, "note": SEED_NOTE}


# --------------------------------------------------------------------------------------------
# Part 2: timing
# --------------------------------------------------------------------------------------------


#: Flower's simulation engine hands each node at most one message per scan of its queue and
#: scans every 0.1 s (``add_messages_to_queue`` in ``flwr.server.superlink.fleet.vce``), so
#: round times come in steps of that tick: a round of two exchanges takes two ticks or more.
FLOWER_TICK_S = 0.1


def ticks_histogram(per_round: list[float]) -> dict[str, int]:
    """How many rounds took about two Flower ticks (< 0.25 s), three (< 0.35 s) or more: the
    mean per round is decided by this split."""
    return {
        "2 ticks": sum(1 for seconds in per_round if seconds < 2.5 * FLOWER_TICK_S),
        "3 ticks": sum(
            1 for seconds in per_round if 2.5 * FLOWER_TICK_S <= seconds < 3.5 * FLOWER_TICK_S
        ),
        "4+ ticks": sum(1 for seconds in per_round if seconds >= 3.5 * FLOWER_TICK_S),
    }


def follow_rounds(job: Future[Any], output_dir: Path, total_rounds: int) -> None:
    """Show the rounds of the run in ``output_dir`` until ``job`` ends: a bar on a terminal,
    a line per ~10 % otherwise, from the first round on (Flower's start-up is not counted in
    the rate). The count is ``fpfl_rounds_released`` of the run's ``status.json``, which the
    ServerApp updates before it sends each round; reading it once a second costs the run
    nothing measurable."""
    progress: Progress | None = None
    while not wait_for([job], timeout=STATUS_POLL_S).done:
        try:
            status = read_status(output_dir) or {}
        except (OSError, ValueError):  # a reader error: try again at the next poll
            continue
        released = status.get("fpfl_rounds_released", 0)
        if not isinstance(released, int) or released <= 0:
            continue
        if progress is None:
            progress = Progress(
                "flwr run", total_rounds, units="rounds", initial=min(released, total_rounds)
            ).start()
        elif released > progress.done:
            progress.advance(released - progress.done)
    if progress is not None:
        progress.close()


def time_flwr_run(adult_dir: Path, timeout: float, rounds: int | None = None) -> dict[str, Any]:
    """``flwr run`` of configs/adult-fpfl.toml with 10 virtual SuperNodes, timed end to end
    (``rounds`` overrides T for a quick check)."""
    from tests.support.flower_processes import local_simulation

    config = load_config("fpfl")
    with tempfile.TemporaryDirectory(prefix="fpfl-adult-timing-") as folder:
        scratch = Path(folder)
        output = scratch / "run"
        config.update({"data-dir": str(adult_dir), "output-dir": str(output)})
        if rounds is not None:
            config["fpfl-rounds"] = rounds
        config_path = scratch / "adult-fpfl.toml"
        config_path.write_text(tomli_w.dumps(config), encoding="utf-8")
        started = time.perf_counter()
        with (
            local_simulation(REPO, NUM_SUPERNODES, scratch / "flwr-home") as simulation,
            ThreadPoolExecutor(max_workers=1) as pool,
        ):
            superlink_ready = time.perf_counter()
            job = pool.submit(simulation.run, config_path, timeout=timeout)
            follow_rounds(job, output, int(config["fpfl-rounds"]))
            run = job.result()
        end_to_end = time.perf_counter() - started
        results = json.loads((output / "results.json").read_text())
    per_round = [float(entry["seconds"]) for entry in results["history"]]
    rounds = len(per_round)
    mean_round = statistics.fmean(per_round)
    return {
        "command": " ".join(run.args),
        "status": run.status,
        "rounds": rounds,
        "end_to_end_seconds": end_to_end,
        "superlink_startup_seconds": superlink_ready - started,
        "flwr_run_seconds": run.duration,
        "job_seconds_total": results["timing"]["seconds_total"],
        "round_seconds_mean": mean_round,
        "round_seconds_median": statistics.median(per_round),
        "round_seconds_max": max(per_round),
        "round_ticks": ticks_histogram(per_round),
        "wall_seconds_per_round": end_to_end / rounds,
        "accuracy": results["accuracy"],
        "fnr_gap": results["fnr_gap"],
        "epsilon": results["epsilon"],
        "noise_multiplier": results["noise_multiplier"],
        "end_to_end_pass": end_to_end < E2E_TARGET_S,
        "round_pass": mean_round <= ROUND_TARGET_S,
    }


def run_statistics_benchmark(repeats: int) -> dict[str, Any]:
    """benchmarks/fpfl_statistics.py in its own process; its table and headline speed-up."""
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "fpfl_statistics.py"),
        "--repeats",
        str(repeats),
    ]
    started = time.perf_counter()
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    match = re.search(r"Measured minimum there: ([0-9.]+)x", out)
    speedup = float(match.group(1)) if match else None
    rows = [line for line in out.splitlines() if line.startswith("|")]
    return {
        "command": "python benchmarks/fpfl_statistics.py --repeats " + str(repeats),
        "adult_min_speedup": speedup,
        "table": rows,
        "seconds": time.perf_counter() - started,
        "pass": speedup is not None and speedup >= SPEEDUP_TARGET,
    }


def shamir_reference_ms(num_nodes: int = NUM_SUPERNODES, repeats: int = 7) -> float:
    """The server's own CPU work that most decides whether a round fits Flower's delivery
    ticks: rebuilding ``num_nodes`` self-mask seeds from their threshold of shares each (what
    :class:`~fedparity.strategies.FPFLProtocol` does after every unmask; Lagrange
    interpolation over the prime field of ``SHAMIR_PRIME`` by the ``shamirs`` package).
    Median of ``repeats``, in ms: a machine speed reference for the round times, which are
    quantised by the 0.1 s tick and so move in steps with CPU speed."""
    from fedparity.mechanisms.crypto.secure_sum import (
        combine_self_seed,
        new_self_seed,
        share_self_seed,
    )

    members = list(range(1, num_nodes + 1))
    threshold = math.ceil(0.8 * num_nodes)  # n_min at fpfl-dropout-tolerance = 0.2
    shares = [share_self_seed(new_self_seed(), members, threshold) for _ in members]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for owner_shares in shares:
            combine_self_seed(list(owner_shares.values()), threshold)
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def timing_markdown(flwr: dict[str, Any], stats: dict[str, Any] | None) -> list[str]:
    """Markdown lines of part 2."""
    lines = [
        "## Timing: `flwr run` of configs/adult-fpfl.toml, 10 virtual SuperNodes",
        "",
        f"Command: `{flwr['command']}` (the config copied with `data-dir` and `output-dir` "
        "set; otherwise as named); status "
        f"`{flwr['status']}`. End to end = from before starting the SuperLink to the end of "
        "`flwr run` (Flower start-up included)."
        + (
            ""
            if flwr["rounds"] == load_config("fpfl")["fpfl-rounds"]
            else f" **T overridden to {flwr['rounds']} rounds (quick check).**"
        ),
        "",
        "| measure | value | target | verdict |",
        "|---|---:|---:|---|",
        f"| end to end (s) | {flwr['end_to_end_seconds']:.1f} | < {E2E_TARGET_S:.0f} "
        f"| {_verdict(flwr['end_to_end_pass'])} |",
        f"| per round, mean of history[].seconds (s) | {flwr['round_seconds_mean']:.3f} "
        f"| <= {ROUND_TARGET_S} | {_verdict(flwr['round_pass'])} |",
        f"| per round, median (s) | {flwr['round_seconds_median']:.3f} | | |",
        f"| per round, max (s) | {flwr['round_seconds_max']:.3f} | | |",
        "| rounds of 2 / 3 / 4+ Flower ticks (0.1 s each) | "
        + " / ".join(str(count) for count in flwr["round_ticks"].values())
        + " | | |",
        f"| wall time / rounds (s, {flwr['rounds']} rounds) "
        f"| {flwr['wall_seconds_per_round']:.3f} | | |",
        f"| SuperLink start-up (s) | {flwr['superlink_startup_seconds']:.1f} | | |",
        f"| `flwr run` call (s) | {flwr['flwr_run_seconds']:.1f} | | |",
        f"| FPFL job inside the ServerApp (s) | {flwr['job_seconds_total']:.1f} | | |",
        f"| machine reference: the server's Shamir work of one round, alone (ms) "
        f"| {flwr['shamir_reference_ms']:.0f} | | |",
    ]
    if stats is not None:
        headline = stats["adult_min_speedup"]
        lines.append(
            "| per-user statistics, vectorised vs loop (min over Adult cases) "
            f"| {_num(headline, '.1f')}x | >= {SPEEDUP_TARGET:.0f}x | {_verdict(stats['pass'])} |"
        )
    lines += [
        "",
        f"Result of this run: accuracy {flwr['accuracy']:.4f}, FNR gap {flwr['fnr_gap']:.4f}, "
        f"epsilon {_num(flwr['epsilon'], '.3f')}, sigma {_num(flwr['noise_multiplier'], '.4f')} "
        "(no client seed: OS entropy).",
    ]
    if stats is not None:
        lines += [
            "",
            f"`{stats['command']}` (1 torch thread; best of the repeats):",
            "",
            *stats["table"],
        ]
    return lines


def run_timing(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Part 2: the timed ``flwr run`` and the statistics benchmark."""
    adult_dir = Path(args.adult_dir).resolve()
    print("[timing] flwr run ...", flush=True)
    reference = shamir_reference_ms()
    flwr = time_flwr_run(adult_dir, args.timeout, args.rounds)
    flwr["shamir_reference_ms"] = reference
    print(
        f"[timing] end to end {flwr['end_to_end_seconds']:.1f} s, "
        f"{flwr['round_seconds_mean']:.3f} s/round (mean), rounds of 2/3/4+ ticks: "
        + "/".join(str(count) for count in flwr["round_ticks"].values()),
        flush=True,
    )
    stats = None
    if not args.skip_statistics:
        print("[timing] benchmarks/fpfl_statistics.py ...", flush=True)
        stats = run_statistics_benchmark(args.statistics_repeats)
    return timing_markdown(flwr, stats), {"flwr_run": flwr, "statistics": stats}


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--table", action="store_true", help="part 1 (default: both parts)")
    parser.add_argument("--timing", action="store_true", help="part 2 (default: both parts)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS), metavar="ALG"
    )
    parser.add_argument("--rounds", type=int, help="override T (quick check, not the paper)")
    parser.add_argument(
        "--split",
        choices=("iid", "dirichlet"),
        default="iid",
        help="users to nodes (fpfl-split): at random, or each group in Dirichlet shares",
    )
    parser.add_argument(
        "--dirichlet-alpha", type=float, default=0.5, help="fpfl-dirichlet-alpha (> 0)"
    )
    parser.add_argument("--adult-dir", default=str(REPO.parent / "shared" / "data" / "adult"))
    parser.add_argument("--timeout", type=float, default=1800.0, help="flwr run timeout (s)")
    parser.add_argument("--statistics-repeats", type=int, default=5)
    parser.add_argument("--skip-statistics", action="store_true")
    parser.add_argument("--output", default=str(RESULTS / "fpfl_adult.md"), help="markdown path")
    parser.add_argument("--json", action="store_true", help="also write <output>.json")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not (math.isfinite(args.dirichlet_alpha) and args.dirichlet_alpha > 0):
        parser.error(f"--dirichlet-alpha must be a finite number > 0, got {args.dirichlet_alpha}")
    if not (Path(args.adult_dir) / "adult.data").is_file():
        parser.error(f"no adult.data in {args.adult_dir}")
    do_table = args.table or not args.timing
    do_timing = args.timing or not args.table
    import flwr
    import torch

    header = [
        f"# FPFL on federated UCI Adult ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"{date.today().isoformat()}, commit {git_commit()}, flwr {flwr.__version__}, "
        f"torch {torch.__version__})",
        "",
        f"Generated by `python -m benchmarks.fpfl_adult {' '.join(argv or sys.argv[1:])}`. "
        f"Load average at start (1/5/15 min): {load_average()}.",
    ]
    payload: dict[str, Any] = {"argv": argv or sys.argv[1:], "load_average_start": load_average()}
    sections: list[str] = []
    if do_table:
        lines, payload["table"] = run_table(args)
        sections += ["", *lines]
    if do_timing:
        lines, payload["timing"] = run_timing(args)
        sections += ["", *lines]
    payload["load_average_end"] = load_average()
    footer = ["", f"Load average at the end: {payload['load_average_end']}."]
    text = "\n".join(header + sections + footer) + "\n"
    print(text)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    if args.json:
        output.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    failed = [r for r in payload.get("table", {}).get("rows", []) if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
