"""The fault-injection primitives of ``tests/flower_processes.py`` act on real processes: a
SuperNode is killed with its descendants and comes back as a new node, the SuperLink is
restarted on its database and the SuperNodes carry on with the same ids, and a run then
completes (watched in the background, with its ``flwr-serverapp`` found among the
SuperLink's descendants)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    from tests.flower_processes import (
        _descendants,
        _same_process_running,
        local_deployment,
        wait_for,
    )
except ImportError:  # pragma: no cover
    from flower_processes import (  # type: ignore[no-redef, import-not-found]
        _descendants,
        _same_process_running,
        local_deployment,
        wait_for,
    )

REPO = Path(__file__).resolve().parents[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return 200 <= int(response.status) < 300
    except (urllib.error.URLError, OSError):
        return False


def _with_start_times(pids: list[int]) -> dict[int, int]:
    """``{pid: start time}`` from /proc, to tell a process from a later one with its pid."""
    found = {}
    for pid in pids:
        try:
            found[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])
        except (OSError, IndexError, ValueError):
            pass
    return found


def _running(processes: dict[int, int]) -> list[int]:
    return [pid for pid, start in processes.items() if _same_process_running(pid, start)]


@pytest.mark.slow
def test_kill_and_restart_supernode_and_superlink(tmp_path: Path) -> None:
    with local_deployment(REPO, 2, None, tmp_path / "flwr-home") as deployment:
        node = deployment.supernodes[0]
        old_pid, old_id = node.pid, deployment.node_ids[0]
        # The SuperNode runs its SuperExec as a child: the kill must take that too.
        tree = wait_for(lambda: _descendants(old_pid), 30, what="the SuperNode's SuperExec")
        tree |= _with_start_times([old_pid])

        deployment.kill_supernode(0)
        assert not node.alive() and _running(tree) == []
        assert not _healthy(node.port)

        deployment.start_supernode(0)
        assert node.alive() and node.pid != old_pid and _healthy(node.port)
        new_id = deployment.node_ids[0]
        assert new_id != old_id  # a restarted SuperNode registers as a new node
        assert "--- relaunch 2 of supernode-0 ---" in node.log_text()
        # The dead id stays online until its heartbeat is overdue (~60 s): forget it now,
        # or the run below would wait that long for its "Node Unavailable" reply.
        assert deployment.node_statuses()[old_id] == "online"
        deployment.unregister_node(old_id)
        assert deployment.online_node_ids() == set(deployment.node_ids)

        link = _with_start_times([deployment.superlink.pid]) | _descendants(
            deployment.superlink.pid
        )
        deployment.restart_superlink()
        assert _running(link) == []
        assert _healthy(deployment.superlink.port)
        # Same database: the SuperNodes keep their ids and stay online.
        wait_for(
            lambda: deployment.online_node_ids() == set(deployment.node_ids),
            30,
            what="both SuperNodes online again after the SuperLink restart",
        )

        run = deployment.run_in_background(
            {
                "users-per-node": 50,
                "num-server-rounds": 1,
                "epsilons": "3",
                "user-budget": 3.0,
                "min-nodes": 2,
                "output-dir": str(tmp_path / "out"),
            },
            timeout=300,
        )
        run_id = run.wait_run_id()
        assert wait_for(deployment.serverapp_pids, 60, what="the run's flwr-serverapp")
        result = run.wait()
        assert result.run_id == run_id
        assert result.status == "finished:completed", result.output[-3000:]
        wait_for(lambda: deployment.serverapp_pids() == [], 30, what="the ServerApp to exit")
        everything = _with_start_times([process.pid for process in deployment.processes])
    assert len(everything) == 3 and _running(everything) == []
