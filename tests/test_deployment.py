"""Multi-process run: one flower-superlink and three flower-supernode processes on
127.0.0.1, the audit submitted with ``flwr run``; only the processes started here are
stopped afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

try:
    from tests.flower_processes import local_deployment
except ImportError:  # pragma: no cover
    from flower_processes import local_deployment  # type: ignore[no-redef, import-not-found]

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_audit_on_superlink_and_three_supernodes(tmp_path: Path) -> None:
    output = tmp_path / "run"
    bystander = os.getpid()  # a process this test did not start: must survive
    with local_deployment(REPO, 3, None, tmp_path / "flwr-home") as deployment:
        pids = [process.pid for process in deployment.processes]
        run = deployment.run(
            {
                "output-dir": str(output),
                "users-per-node": 300,
                "num-server-rounds": 1,
                "epsilons": "3",
                "user-budget": 3.0,
                "min-nodes": 3,
            },
            timeout=600,
        )
        assert run.status == "finished:completed", run.output[-3000:]
        node_logs = "\n".join(
            text for name, text in deployment.logs().items() if name.startswith("supernode")
        )
    assert not any(_alive(pid) for pid in pids)
    assert _alive(bystander)

    results = json.loads((output / "results.json").read_text())
    assert results["num_nodes"] == 3 and results["num_users"] == 900
    audit = results["audits"][0]
    assert audit["accepted_nodes"] == 3 and audit["num_reports"] == 900
    assert audit["rejected_replies"] == [] and audit["missing_nodes"] == []
    estimate = audit["estimate"]
    truth = results["ground_truth"]
    stderr = estimate["difference_stderrs"][0]
    assert abs(abs(estimate["differences"][0]) - truth["max_gap"]) <= 5 * stderr
    assert "ldp_audit" in node_logs or "query" in node_logs  # the nodes ran the ClientApp


@pytest.mark.slow
def test_fpfl_on_superlink_and_three_supernodes(tmp_path: Path) -> None:
    """FPFL (MMDM + clipping + distributed noise, pairwise-masked sums) across real
    processes: each SuperNode keeps its masking key in its own node state and the server
    reads only the sums."""
    output = tmp_path / "run"
    # 900 users: delta = 1/K = 1.1e-3 is above the built-in fpfl-max-delta (1e-3), so each
    # node's operator allows it in the node's own config (a policy key on the command line).
    node_configs = [f"partition-id={i} num-partitions=3 fpfl-max-delta=0.002" for i in range(3)]
    with local_deployment(REPO, 3, node_configs, tmp_path / "flwr-home") as deployment:
        run = deployment.run(
            {
                "task": "fpfl",
                "output-dir": str(output),
                "users-per-node": 300,
                "fpfl-cohort-size": 200,
                "fpfl-rounds": 2,
                "min-nodes": 3,
            },
            timeout=600,
        )
        assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((output / "results.json").read_text())
    assert results["population"] == {"users": 900, "nodes": 3, "setup_failed": []}
    assert [entry["replied"] for entry in results["history"]] == [3, 3]
    assert results["privacy"]["secure_sum"] == "masking"
    assert 0 < results["epsilon"] <= 2.0 and results["noise_multiplier"] > 0
