"""Cost of the FedEvalFair three-round protocol, CKKS-encrypted vs plaintext, in one process.

    python -m benchmarks.fedevalfair_protocol                 # k = 10, 100, 1000; writes tables
    python -m benchmarks.fedevalfair_protocol --clients 100 --json

(from the repository's folder: the in-process protocol simulator is the tests',
:mod:`tests.support.ckks_simulator`, not part of the library).

No Flower: every simulated client runs in this process one after the other with real
TenSEAL ciphertexts (:func:`tests.support.ckks_simulator.run_protocol_locally`); the plaintext
rows run the same protocol with float64 vectors
(:func:`tests.support.ckks_simulator.run_protocol_plaintext`). Flower's own overhead is measured
elsewhere.

Payload (the calibrated mode's inverse-variance form,
:mod:`fedparity.mechanisms.fairness_tests.fedevalfair`): client i contributes [w_i, w_i y_i, w_i
y_i^2] with w_i = 1/S_i^2 in [1e4, 1e6] and y_i ~ N(0.03, 1/w_i) (+ the count slot); its round-2
terms are Cochran's w_i (y_i - mu)^2 and the paper's w_i (y_i - mu)^2 / (1 - w_i / W) (T1, Eq. 10 of
"FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness Evaluation
Framework", anonymous authors, ACM Multimedia 2024 submission). Two key holders decrypt
in round 3. Reported per client and round: payload bytes up and down (Flower framing not
included), ciphertexts uploaded, compute time; per round the server's time. "parallel s"
is the critical path if the clients ran in parallel: sum over rounds of (slowest client +
server). Precision: the encrypted run's p-values (Q, T1, W*) against exact float64.

Target (issue): encrypted, 100 clients, under 30 s; at most one ciphertext per client per round.

The second table runs the protocol as deployed against an active server: the real holder
handlers (:func:`fedparity.clients.fedevalfair_handlers`: signed ciphertexts, the endorsement
of the round-1 sum by the verifiers, round-2 terms, key holders that recompute both sums and
release noise-flooded aggregates) and the real server strategy's message contents and checks
(:class:`fedparity.strategies.FedEvalFairProtocol`), in one process without Flower's
transport, holders one after the other (synthetic rows, B = 100 bootstrap resamples). Its
"k^2 round 2" column is what the alternative without endorsements would cost in round 2:
every holder verifying and adding all k signed ciphertexts (one verifier's measured time,
times k), plus k^2 ciphertexts of traffic.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from fedparity.mechanisms.crypto.ckks import (
    CkksParameters,
    generate_keys,
    load_public_context,
    load_secret_context,
)
from tests.support.ckks_simulator import (
    ProtocolTrace,
    run_protocol_locally,
    run_protocol_plaintext,
)

RESULTS = Path(__file__).resolve().parent / "results"
KEY_HOLDERS = 2
TARGET_SECONDS = 30.0


def population(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights 1/S^2 in [1e4, 1e6] and estimates y ~ N(0.03, 1/w) (H0 of stage 1 true)."""
    rng = np.random.default_rng(seed)
    weights = 10.0 ** rng.uniform(4.0, 6.0, size=k)
    return weights, 0.03 + rng.standard_normal(k) / np.sqrt(weights)


def terms(reference: np.ndarray, contribution: np.ndarray) -> np.ndarray:
    """Round-2 terms: Cochran's and the paper's, against the round-1 weighted mean."""
    total, mean = reference[0], reference[1] / reference[0]
    weight, estimate = contribution[0], contribution[1] / contribution[0]
    cochran = weight * (estimate - mean) ** 2
    return np.array([cochran, cochran / (1.0 - weight / total)])


def report(released: np.ndarray) -> dict[str, float]:
    """p-values from the default release [Q, T1, W, sum w y, sum w y^2, count]."""
    q, t1, total, weighted, weighted_squares, count = released
    z = np.sqrt(total) * weighted / total
    q_round1 = max(weighted_squares - weighted**2 / total, 0.0)  # one round, by cancellation
    return {
        "Q": float(q),
        "Q_round1": float(q_round1),
        "p_Q_round1": float(stats.chi2.sf(q_round1, count - 1)),
        "T1": float(t1),
        "W*": float(z),
        "p_Q": float(stats.chi2.sf(q, count - 1)),
        "p_T1": float(stats.chi2.sf(t1, count - 1)),
        "p_W*": float(2.0 * stats.norm.sf(abs(z))),
    }


def exact_report(weights: np.ndarray, estimates: np.ndarray) -> dict[str, float]:
    total = weights.sum()
    mean = (weights * estimates).sum() / total
    cochran = weights * (estimates - mean) ** 2
    released = np.array(
        [
            cochran.sum(),
            (cochran / (1.0 - weights / total)).sum(),
            total,
            (weights * estimates).sum(),
            (weights * estimates**2).sum(),
            weights.size,
        ]
    )
    return report(released)


def summarize(trace: ProtocolTrace, exact: dict[str, float]) -> dict[str, Any]:
    """Per-client traffic (a plain client and a key holder), times, precision."""
    holder = trace.key_holders[0]
    plain = next(c for c in range(trace.num_clients - 1, -1, -1) if c not in trace.key_holders)
    per_round_max = trace.client_seconds.max(axis=0)
    return {
        "mode": "CKKS" if trace.encrypted else "plaintext",
        "clients": trace.num_clients,
        "wall_seconds": trace.wall_seconds,
        "parallel_seconds": float(per_round_max.sum() + sum(trace.server_seconds)),
        "server_seconds": list(trace.server_seconds),
        "client_seconds_mean": trace.client_seconds[:, :2].mean(axis=0).tolist(),
        "client_seconds_max": per_round_max.tolist(),
        "client_upload_bytes": trace.upload_bytes[plain].tolist(),
        "client_download_bytes": trace.download_bytes[plain].tolist(),
        "key_holder_upload_bytes": trace.upload_bytes[holder].tolist(),
        "key_holder_download_bytes": trace.download_bytes[holder].tolist(),
        "max_ciphertexts_per_client_per_round": trace.ciphertexts.max(axis=0).tolist(),
        "server_received_bytes": int(trace.upload_bytes.sum()),
        "pvalue_max_abs_error": max(
            abs(trace.report[name] - exact[name]) for name in ("p_Q", "p_T1", "p_W*")
        ),
        "statistic_max_rel_error": max(
            abs(trace.report[name] - exact[name]) / abs(exact[name]) for name in ("Q", "T1", "W*")
        ),
        "round1_q_pvalue_abs_error": abs(trace.report["p_Q_round1"] - exact["p_Q_round1"]),
        "report": trace.report,
    }


def measure(k: int, seed: int, secret: Any, public: Any) -> list[dict[str, Any]]:
    weights, estimates = population(k, seed)
    contributions = [
        np.array([w, w * y, w * y * y]) for w, y in zip(weights, estimates, strict=True)
    ]
    exact = exact_report(weights, estimates)
    rows = []
    for encrypted in (True, False):
        if encrypted:
            trace = run_protocol_locally(
                contributions, terms, secret, public, report_fn=report, key_holders=KEY_HOLDERS
            )
        else:
            trace = run_protocol_plaintext(
                contributions, terms, report_fn=report, key_holders=KEY_HOLDERS
            )
        rows.append(summarize(trace, exact))
    return rows


def measure_handlers(k: int, seed: int, secret_path: Path, public: Any) -> dict[str, Any]:
    """The real handlers and the strategy's contents and checks for k holders (docstring)."""
    import hashlib

    from flwr.app import ArrayRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedparity.clients import HolderRows, fedevalfair_handlers
    from fedparity.clients.fedevalfair import ClientStatistics
    from fedparity.clients.fedevalfair_handlers import FEF_STATE_KEY
    from fedparity.clients.identity import NodeIdentity
    from fedparity.clients.policy import NodePrivacyPolicy
    from fedparity.mechanisms.crypto.ckks import contributors_digest
    from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
    from fedparity.mechanisms.fairness_tests.fedevalfair import fedevalfair
    from fedparity.mechanisms.protocol import (
        BLOCKS,
        FEF_ENDORSE_MESSAGE_TYPE,
        FEF_ROUND_MESSAGE_TYPES,
        ROUND1_SIZE,
        ROUND2_SIZE,
    )
    from fedparity.mechanisms.protocol.fedevalfair import FEF_COMMIT_MESSAGE_TYPE
    from fedparity.strategies import FedEvalFairProtocol

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    run_id = 1
    identities = {node: IdentityKey.generate() for node in range(1, k + 1)}
    roster = Roster.from_keys({f"holder-{n}": key for n, key in identities.items()})

    def rows(arrays: ArrayRecord, context: Context) -> HolderRows:
        rng = np.random.default_rng([seed, context.node_id])
        size = 400
        groups = rng.integers(0, 2, size)
        labels = rng.integers(0, 2, size)
        predictions = (rng.random(size) < 0.45 + 0.05 * groups).astype(int)
        return HolderRows(labels=labels, predictions=predictions, groups=groups)

    handlers = fedevalfair_handlers(
        rows,
        secret_context=secret_path,
        num_resamples=100,
        bootstrap_rng=lambda context: np.random.default_rng([seed, context.node_id, 1]),
        policy=NodePrivacyPolicy(),
        identity=lambda context: NodeIdentity(identities[context.node_id], roster),
    )
    protocol = FedEvalFairProtocol(public, key_holders=KEY_HOLDERS)
    nodes = list(identities)
    # each holder's key journal (commitments and releases per key) in a folder of this call
    ledger_folder = tempfile.TemporaryDirectory(prefix="fef-benchmark-ledgers-")
    ledgers = Path(ledger_folder.name)
    contexts = {
        n: Context(
            run_id=run_id,
            node_id=n,
            node_config={"ledger-dir": str(ledgers / f"holder-{n}")},
            state=RecordDict(),
            run_config={},
        )
        for n in nodes
    }

    def ask(action: str, message_type: str, node: int, content: RecordDict) -> Message:
        message = Message(content=content, dst_node_id=node, message_type=message_type)
        return handlers[action](message, contexts[node])

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    clock = time.perf_counter()
    content = protocol.round1_content(ArrayRecord())
    replies = [ask("fef_round1", FEF_ROUND_MESSAGE_TYPES[0], n, content) for n in nodes]
    seconds["holders r1"] = time.perf_counter() - clock
    clock = time.perf_counter()
    first = protocol.collect_round(1, nodes, replies, ROUND1_SIZE, run_id=run_id)
    verifiers = sorted(first.accepted)[:KEY_HOLDERS]
    endorse = protocol.endorse_content(first.entries)
    seconds["server r1"] = time.perf_counter() - clock
    clock = time.perf_counter()
    endorsements = [ask("fef_endorse", FEF_ENDORSE_MESSAGE_TYPE, n, endorse) for n in verifiers]
    seconds["verifiers"] = time.perf_counter() - clock
    clock = time.perf_counter()
    contributors = [entry.signer for entry in first.entries]
    total, endorsed, _ = protocol.collect_endorsements(
        endorsements, verifiers, contributors, run_id=run_id
    )
    assert total is not None
    content = protocol.round2_content(total, contributors, [(e, s) for _, e, s in endorsed])
    seconds["server endorse"] = time.perf_counter() - clock
    clock = time.perf_counter()
    replies = [ask("fef_round2", FEF_ROUND_MESSAGE_TYPES[1], n, content) for n in nodes]
    seconds["holders r2"] = time.perf_counter() - clock
    clock = time.perf_counter()
    second = protocol.collect_round(
        2,
        nodes,
        replies,
        ROUND2_SIZE,
        run_id=run_id,
        reference=contributors_digest(contributors),
    )
    commit = protocol.commit_content(first.entries, second.entries)
    seconds["server r2"] = time.perf_counter() - clock
    clock = time.perf_counter()
    commit_replies = [ask("fef_commit", FEF_COMMIT_MESSAGE_TYPE, n, commit) for n in nodes]
    seconds["holders commit"] = time.perf_counter() - clock
    clock = time.perf_counter()
    commitments, _, _ = protocol.collect_commitments(
        commit_replies, first.entries, second.entries, list(second.accepted), run_id=run_id
    )
    holders = sorted(second.accepted)[:KEY_HOLDERS]
    content3 = protocol.round3_content(
        first.entries, second.entries, [(signer, sig) for _, signer, sig in commitments]
    )
    seconds["server commit"] = time.perf_counter() - clock
    clock = time.perf_counter()
    releases = [ask("fef_round3", FEF_ROUND_MESSAGE_TYPES[2], n, content3) for n in holders]
    seconds["key holders r3"] = time.perf_counter() - clock
    released, rejected = protocol.collect_releases(releases, holders)
    assert released and not rejected
    reports = protocol.reports(released[0])
    wall = time.perf_counter() - started

    # Precision against the plaintext test of the same holders' statistics.
    summaries = [
        ClientStatistics.from_array(
            contexts[n].state.array_records[FEF_STATE_KEY]["summaries"].numpy()
        ).summaries
        for n in nodes
    ]
    errors = []
    for index, block in enumerate(reports):
        present = [s[index] for s in summaries if s[index] is not None]
        if block.report is None or len(present) < 2:
            continue
        plain = fedevalfair(present, mode=BLOCKS[index][1])  # type: ignore[arg-type]
        for mine, theirs in (
            (block.report.homogeneity, plain.homogeneity),
            (block.report.common_disparity, plain.common_disparity),
        ):
            errors.append(abs(mine.pvalue - theirs.pvalue))
    payload = len(first.entries[0].payload)
    ledger_folder.cleanup()
    return {
        "holders": k,
        "wall_seconds": wall,
        "seconds": seconds,
        "verifier_seconds_each": seconds["verifiers"] / len(verifiers),
        "quadratic_round2_seconds": seconds["verifiers"] / len(verifiers) * k,
        "quadratic_round2_bytes": k * k * payload,
        "endorse_download_bytes": sum(len(e.payload) + 96 for e in first.entries),
        "key_holder_download_bytes": sum(
            len(e.payload) + 96 for e in (*first.entries, *second.entries)
        ),
        "round2_download_bytes": len(total) + 32 * k + 96 * len(endorsed),
        "releases_identical": all(np.array_equal(r, released[0]) for r in released),
        "pvalue_max_abs_error": max(errors) if errors else None,
        "sum_digest": hashlib.sha256(total).hexdigest()[:12],
    }


def handlers_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "Real handlers and strategy checks (signed ciphertexts, endorsement, flooded release), "
        f"{KEY_HOLDERS} verifiers = key holders, holders run one after the other:",
        "",
        "| k | wall s | holders r1 s | verifiers s | holders r2 s | key holders r3 s "
        "| server s (r1/endorse/r2) | verifier down MB | key holder r3 down MB "
        "| r2 down kB | k^2 round 2: s / GB | key holders agree | max abs err p |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|",
    ]
    for row in rows:
        t = row["seconds"]
        server = f"{t['server r1']:.2f}/{t['server endorse']:.2f}/{t['server r2']:.2f}"
        error = row["pvalue_max_abs_error"]
        lines.append(
            f"| {row['holders']} | {row['wall_seconds']:.2f} | {t['holders r1']:.2f} "
            f"| {t['verifiers']:.2f} | {t['holders r2']:.2f} | {t['key holders r3']:.2f} "
            f"| {server} | {row['endorse_download_bytes'] / 1e6:.1f} "
            f"| {row['key_holder_download_bytes'] / 1e6:.1f} "
            f"| {row['round2_download_bytes'] / 1e3:.1f} "
            f"| {row['quadratic_round2_seconds']:.1f} / {row['quadratic_round2_bytes'] / 1e9:.2f} "
            f"| {'yes' if row['releases_identical'] else 'NO'} "
            f"| {'-' if error is None else f'{error:.1e}'} |"
        )
    return "\n".join(lines)


def kb(value: float) -> str:
    return f"{value / 1000:.1f}" if value >= 1000 else f"{value / 1000:.3f}"


def markdown(rows: list[dict[str, Any]], keys: dict[str, Any]) -> str:
    lines = [
        "Per-client payload in kB (1 kB = 1000 B): r1 up | r2 down | r2 up; key holders "
        "additionally download r3 (both sums) and upload the released aggregates.",
        "",
        "| mode | k | wall s | parallel s | server s (r1/r2/r3) | client ms mean (r1/r2) "
        "| r1 up | r2 down | r2 up | key holder r3 down / up | ct/client/round (r1/r2/r3) "
        "| server received MB | max abs err p | max rel err stat | abs err p(Q, 1 round) |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        up, down = row["client_upload_bytes"], row["client_download_bytes"]
        holder_up, holder_down = row["key_holder_upload_bytes"], row["key_holder_download_bytes"]
        server = "/".join(f"{s:.2f}" for s in row["server_seconds"])
        client = "/".join(f"{1e3 * s:.2f}" for s in row["client_seconds_mean"])
        counts = "/".join(str(c) for c in row["max_ciphertexts_per_client_per_round"])
        lines.append(
            f"| {row['mode']} | {row['clients']} | {row['wall_seconds']:.2f} "
            f"| {row['parallel_seconds']:.2f} | {server} | {client} | {kb(up[0])} "
            f"| {kb(down[1])} | {kb(up[1])} | {kb(holder_down[2])} / {kb(holder_up[2])} "
            f"| {counts} | {row['server_received_bytes'] / 1e6:.2f} "
            f"| {row['pvalue_max_abs_error']:.1e} | {row['statistic_max_rel_error']:.1e} "
            f"| {row['round1_q_pvalue_abs_error']:.1e} |"
        )
    lines += [
        "",
        f"Key material ({keys['parameters']}): secret context {kb(keys['secret_bytes'])} kB "
        f"per client (out of band, once), public context {kb(keys['public_bytes'])} kB for the "
        f"server (once); loading a context takes {keys['load_ms']:.0f} ms.",
        "",
        "Errors against exact float64: p-values of Q, T1 (round-2 terms) and W*; the last column "
        "is Cochran's Q from round 1 alone (sum w y^2 - (sum w y)^2 / sum w, by cancellation).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument(
        "--holders",
        type=int,
        nargs="*",
        default=[10, 100],
        help="holder counts for the real-handler table (none: skip it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--no-write", action="store_true", help="do not write results/")
    args = parser.parse_args(argv)
    if any(k < 2 for k in args.clients):
        parser.error(f"--clients must be integers >= 2, got {args.clients}")
    parameters = CkksParameters()
    with tempfile.TemporaryDirectory() as folder:
        paths = generate_keys(folder, parameters)
        handler_rows = []
        for k in args.holders:
            row = measure_handlers(
                k, args.seed + k, paths.secret, load_public_context(paths.public)
            )
            handler_rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"handlers k={k}: {row['wall_seconds']:.2f} s", flush=True)
        started = time.perf_counter()
        secret = load_secret_context(paths.secret)
        public = load_public_context(paths.public)
        keys = {
            "parameters": (
                f"N={parameters.poly_modulus_degree}, q={list(parameters.coeff_mod_bit_sizes)}, "
                f"scale 2^{parameters.global_scale_bits}, {parameters.security_bits}-bit"
            ),
            "secret_bytes": paths.secret.stat().st_size,
            "public_bytes": paths.public.stat().st_size,
            "load_ms": 1e3 * (time.perf_counter() - started) / 2,
        }
    rows = []
    for k in args.clients:
        for row in measure(k, args.seed + k, secret, public):
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{row['mode']:>9} k={k}: {row['wall_seconds']:.2f} s, "
                    f"{row['client_upload_bytes'][0] / 1e3:.1f} kB up per client in round 1",
                    flush=True,
                )
    encrypted_100 = [r for r in handler_rows if r["holders"] == 100]
    verdict = ""
    if encrypted_100:
        seconds = encrypted_100[0]["wall_seconds"]
        status = "met" if seconds < TARGET_SECONDS else "MISSED"
        verdict = (
            f"Target (real handlers, 100 holders, < {TARGET_SECONDS:.0f} s): {status} "
            f"({seconds:.1f} s, holders one after the other in one process)."
        )
    table = markdown(rows, keys)
    if handler_rows:
        table = handlers_markdown(handler_rows) + "\n\n" + table
    if not args.json:
        print(table)
        if verdict:
            print(verdict)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        header = (
            f"# FedEvalFair protocol cost ({platform.processor() or platform.machine()}, "
            f"{time.strftime('%Y-%m-%d')}, one process, clients run sequentially)\n\n"
        )
        (RESULTS / "fedevalfair_protocol.md").write_text(header + table + "\n\n" + verdict + "\n")
        (RESULTS / "fedevalfair_protocol.json").write_text(
            json.dumps({"keys": keys, "handlers": handler_rows, "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
