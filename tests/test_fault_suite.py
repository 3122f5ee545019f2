"""Fault injection on a real SuperLink and real SuperNodes (127.0.0.1, ``kill -9``).

The faults of the fault-injection trial, for each job, each with the outcome fedparity
promises (docs/reliability.md): nothing lost, nothing misreported, privacy accounted.

* LDP audit: a SuperNode killed mid-exchange is counted missing (once, in every later audit
  too), never as a phantom "node 1"; a rerun into the used output folder is refused; the
  SuperLink killed during an audit leaves a status file saying what was released, and the
  next run's total includes the spending of the dead run (read back from the nodes'
  ledgers); a deleted or damaged ledger stops that node's audits without a reset (the node's
  ledger registry, kept apart from the ledger folder, still lists the deleted one).
* FPFL: the ServerApp killed mid-training resumes, and epsilon counts every round ever
  released; a SuperNode killed mid-training makes the run stop early (instead of spending
  privacy on rounds bound to be lost), and the training resumes without that node, the
  accountant composing the two (sigma, q) segments.
* FedEvalFair: a holder killed mid-exchange is dropped and the test completes with the rest.

On the main before this suite: the dead node was a phantom rejection of node 1 plus a missing
node, a lost LDP run left no record, a rerun overwrote a privacy ledger, FPFL spent epsilon on
every lost round to the end with status completed, and a resume without the lost node was
refused (sigma and q had changed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fedparity.clients.ldp import LEDGER_UNUSABLE_REPLY
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent, privacy_spent_history
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.server.run_record import read_status
from tests.support.flower_processes import BackgroundRun, Deployment, local_deployment, wait_for
from tests.test_warm_clientapp import warm_superexec_checks

REPO = Path(__file__).resolve().parents[1]
USERS = 300


def _ledger_path(deployment: Deployment, index: int) -> Path:
    """Where SuperNode ``index`` of the built-in app keeps its per-user privacy ledger (its own
    HOME, the default folder)."""
    folder = deployment.work_dir / f"supernode-{index}" / ".fedparity" / "ledgers"
    return folder / f"ledger-partition-{index}.json"


def _spent(deployment: Deployment, index: int) -> float:
    path = _ledger_path(deployment, index)
    return float(UserLedger.load(path, USERS).epsilon_spent().max()) if path.exists() else 0.0


def _releases(folder: Path) -> int:
    status = read_status(folder) if (folder / "status.json").exists() else None
    return 0 if status is None else len(status["releases"])


def _rounds_released(folder: Path) -> int:
    """FPFL rounds the run in ``folder`` has released (its privacy ledger; 0 before any)."""
    ledger = folder / "privacy-ledger.json"
    return json.loads(ledger.read_text())["rounds_released"] if ledger.exists() else 0


def _status_rounds(folder: Path) -> int:
    """FPFL rounds released according to the run's status record (0 before any)."""
    status = read_status(folder)
    return int(status.get("fpfl_rounds_released", 0)) if status else 0


def _wait_during(
    background: BackgroundRun, predicate: Callable[[], object], timeout: float, what: str
) -> None:
    """:func:`wait_for` ``predicate`` while ``background`` runs: a run that ends first, or a
    timeout, fails at once with the run's own output (the ServerApp's log says why)."""

    def reached() -> bool:
        if predicate():
            return True
        if not background.running():
            raise AssertionError(f"the run ended before {what}:\n{background.output()[-4000:]}")
        return False

    try:
        wait_for(reached, timeout, what=what)
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{background.output()[-4000:]}") from None


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


# Every exchange of a deployment run starts a ClientApp process on each node (seconds each):
# the runs here use as few exchanges as the faults need (no FedAvg rounds, few audits).
LDP = {
    "users-per-node": USERS,
    "num-server-rounds": 0,
    "user-budget": 6.0,
    "min-nodes": 3,
    "reply-timeout": 30.0,  # a new run's first exchange starts each node's ClientApp process
}


@pytest.mark.slow
def test_ldp_audit_faults(tmp_path: Path) -> None:
    with local_deployment(REPO, 3, None, tmp_path / "flwr-home", warm=True) as deployment:
        # 1. A SuperNode dies during the first of two audits.
        first = tmp_path / "run-1"
        background = deployment.run_in_background(
            {**LDP, "epsilons": "0.5,0.5", "output-dir": str(first)}, timeout=400
        )
        _wait_during(background, lambda: _releases(first) >= 1, 300, "the first audit to be sent")
        dead = deployment.node_ids[2]
        deployment.kill_supernode(2)
        run = background.wait()
        assert run.status == "finished:completed", run.output[-3000:]
        results = _results(first)
        for audit in results["audits"]:
            accounted = audit["accepted_nodes"] + len(audit["rejected_replies"])
            accounted += len(audit["missing_nodes"])
            assert accounted == 3  # every node counted once
            assert all(item["node_id"] != 1 for item in audit["rejected_replies"])  # no phantom
            assert all(item["node_id"] != dead for item in audit["rejected_replies"])
        assert results["audits"][1]["missing_nodes"] == [dead]  # stays missing in audit 2
        assert results["audits"][1]["accepted_nodes"] == 2
        assert "reports from up to" in run.output
        # every ledger starts with this run: reported node by node (issue 32 item 6)
        assert set(deployment.node_ids[:2]) <= set(results["privacy"]["new_ledger_nodes"])
        assert "New privacy ledger on node(s)" in run.output
        assert read_status(first)["status"] == "completed"  # type: ignore[index]

        # 2. A rerun into the used output folder is refused; nothing is written over.
        before = (first / "results.json").read_bytes()
        again = deployment.run({**LDP, "epsilons": "0.5", "output-dir": str(first)}, check=False)
        assert again.status == "finished:failed"
        assert "already holds a run" in again.output
        assert (first / "results.json").read_bytes() == before

        # 3. The SuperLink dies during an audit, after the nodes charged their users.
        deployment.unregister_node(dead)
        deployment.start_supernode(2)
        spent_before = [_spent(deployment, i) for i in range(3)]
        second = tmp_path / "run-2"
        background = deployment.run_in_background(
            {**LDP, "epsilons": "0.5,0.5,0.5,0.5,0.5,0.5", "output-dir": str(second)}, timeout=300
        )
        _wait_during(
            background,
            lambda: _spent(deployment, 0) > spent_before[0],
            200,
            "node 0 to charge its users for the first audit",
        )
        deployment.restart_superlink()
        background.close()
        status = read_status(second)
        assert status is not None and status["status"] == "running"  # killed outright
        assert len(status["releases"]) >= 1  # recorded before it was sent
        assert not (second / "results.json").exists()  # no estimate came out
        charged_by_dead_run = _spent(deployment, 0) - spent_before[0]
        assert charged_by_dead_run >= 0.5 - 1e-3  # PLD: the sum within the accountant's grid

        # 4. The next run reports the total, the dead run's spending included.
        third = tmp_path / "run-3"
        wait_for(lambda: len(deployment.online_node_ids()) >= 3, 120, what="the nodes to reconnect")
        # (epsilon 2: at 0.5 the group sizes of 900 users are estimated with a standard
        # deviation of ~106, and a group of 450 falls below the 3-sd "empty" threshold in ~1 of
        # 5 runs; at 2 the threshold is ~86)
        run = deployment.run({**LDP, "epsilons": "2", "output-dir": str(third)}, timeout=300)
        assert run.status == "finished:completed", run.output[-3000:]
        clean = _results(third)
        privacy = clean["privacy"]
        # a clean audit across the three processes: every node, every user, a sound estimate
        assert clean["num_nodes"] == 3 and clean["num_users"] == 3 * USERS
        audit = clean["audits"][0]
        assert audit["accepted_nodes"] == 3 and audit["num_reports"] == 3 * USERS
        assert audit["rejected_replies"] == [] and audit["missing_nodes"] == []
        stderr = audit["estimate"]["difference_stderrs"][0]
        truth = clean["ground_truth"]["max_gap"]
        assert abs(abs(audit["estimate"]["differences"][0]) - truth) <= 5 * stderr
        ledgers = [_spent(deployment, i) for i in range(3)]
        total = privacy["epsilon_spent_total_max_reported_by_nodes"]
        assert total == pytest.approx(max(ledgers))  # what the ledgers hold
        by_node = privacy["ledger_totals_by_node"]  # and node by node
        assert {int(node) for node in by_node} == set(deployment.node_ids)
        assert sorted(entry["epsilon"] for entry in by_node.values()) == pytest.approx(
            sorted(ledgers)
        )
        assert privacy["new_ledger_nodes"] == []  # every ledger predates this run
        # run 1, the dead run and this one: more than this run's own spending
        # (the PLD total of pure releases is their sum within the accountant's grid)
        assert _spent(deployment, 0) >= spent_before[0] + charged_by_dead_run + 2.0 - 1e-3
        assert total > privacy["epsilon_spent_per_user"] + charged_by_dead_run - 1e-3
        assert "over every release the nodes' ledgers recorded" in run.output

        # 5. A damaged ledger and a deleted one stop those nodes' audits, without a reset.
        _ledger_path(deployment, 0).write_bytes(b"garbage")
        _ledger_path(deployment, 1).unlink()
        fourth = tmp_path / "run-4"
        run = deployment.run({**LDP, "epsilons": "0.5", "output-dir": str(fourth)}, timeout=300)
        assert run.status == "finished:completed", run.output[-3000:]
        audit = _results(fourth)["audits"][0]
        reasons = {item["node_id"]: item["reason"] for item in audit["rejected_replies"]}
        assert set(reasons) == set(deployment.node_ids[:2]) and audit["accepted_nodes"] == 1
        # The server reads a fixed sentence; each node's log names its file and the recovery.
        assert all(LEDGER_UNUSABLE_REPLY in reason for reason in reasons.values())
        assert "start again at zero" in deployment.node_log_text(0)
        # the deleted ledger is still in the node's registry (kept apart from the folder):
        # refused, with the file and the operator's explicit reset named
        lost = deployment.node_log_text(1)
        assert "ledger-partition-1.json" in lost and "fedparity ledger reset" in lost
        assert _ledger_path(deployment, 0).read_bytes() == b"garbage"
        assert not _ledger_path(deployment, 1).exists()


FPFL = {
    "task": "fpfl",
    "users-per-node": USERS,
    "fpfl-cohort-size": 200,
    "min-nodes": 3,
    # An FPFL round is two exchanges (masked vectors, then the unmask), each starting a
    # ClientApp process on every node: 25-32 s a round at Flower's 3 s SuperNode poll
    # (2026-11-25), about 5 s with the tests' SuperNodes; a round whose node was killed waits
    # for the SuperLink to notice (16-20 s), so the timeout only bounds a loaded machine.
    "reply-timeout": 60.0,
}
#: Seconds for one FPFL run of the faults below on a loaded machine.
FPFL_RUN_TIMEOUT = 600


@pytest.mark.slow
def test_fpfl_faults(tmp_path: Path) -> None:
    from fedparity.server.cli.identity import write_node_identities

    # 900 users: delta = 1/K is above the built-in fpfl-max-delta (1e-3); each node's
    # operator allows it in the node's own config. Each node has its identity key and the
    # roster (the built-in policy's require-roster: no masked sum with peers it cannot check).
    identities = write_node_identities(tmp_path / "identity", 3)
    node_configs = [
        f"partition-id={i} num-partitions=3 fpfl-max-delta=0.002 "
        f"identity-key='{identities / f'node-{i}.key'}' roster='{identities / 'roster.toml'}'"
        for i in range(3)
    ]
    with local_deployment(REPO, 3, node_configs, tmp_path / "flwr-home", warm=True) as deployment:
        # 1. The ServerApp dies mid-training; the training resumes, every release counted.
        folder = tmp_path / "killed-server"
        config = {
            **FPFL,
            "fpfl-rounds": 3,
            "fpfl-checkpoint-every": 2,
            "output-dir": str(folder),
        }
        background = deployment.run_in_background(config, timeout=FPFL_RUN_TIMEOUT)
        # The release ledger is written first, then the status record: the kill waits for
        # both (a kill between the two writes left the record one round behind, once in CI).
        _wait_during(
            background,
            lambda: _rounds_released(folder) >= 3 and _status_rounds(folder) >= 3,
            480,
            "round 3 to be released and recorded (after the round-2 checkpoint)",
        )
        deployment.kill_serverapp()
        background.close()
        released = _rounds_released(folder)
        status = read_status(folder)
        assert status is not None and status["status"] == "running"
        assert status["fpfl_rounds_released"] == released
        checkpoint = json.loads((folder / "checkpoint.json").read_text())["round"]
        assert checkpoint < released
        run = deployment.run({**config, "fpfl-resume": True}, timeout=FPFL_RUN_TIMEOUT)
        assert run.status == "finished:completed", run.output[-3000:]
        results = _results(folder)
        total = released + (3 - checkpoint)
        assert results["privacy"]["rounds_released_total"] == total
        assert results["status"] == "completed" and results["rounds_lost"] == 0
        # the masked secure sum across the processes, with every node in every round
        assert results["population"] == {"users": 3 * USERS, "nodes": 3, "setup_failed": []}
        assert [entry["replied"] for entry in results["history"]] == [3, 3, 3]
        assert results["privacy"]["secure_sum"] == "masking" and results["noise_multiplier"] > 0
        expected = privacy_spent(
            noise_multiplier=results["noise_multiplier"],
            sample_rate=200 / 900,
            steps=total,
            delta=1 / 900,
        )
        assert results["epsilon"] == pytest.approx(expected.epsilon, rel=1e-9)
        status = read_status(folder)
        assert status["status"] == "completed" and status["attempts"] == 2  # type: ignore[index]
        assert status["previous_status"] == "running"  # type: ignore[index]

        # 2. A SuperNode dies mid-training: rounds are lost, the run stops early.
        folder = tmp_path / "killed-node"
        config = {
            **FPFL,
            "fpfl-rounds": 4,
            "fpfl-checkpoint-every": 1,
            "fpfl-max-consecutive-lost": 1,
            "output-dir": str(folder),
        }
        background = deployment.run_in_background(config, timeout=FPFL_RUN_TIMEOUT)
        _wait_during(
            background, lambda: _rounds_released(folder) >= 2, 480, "two FPFL rounds to be released"
        )
        dead = deployment.node_ids[2]
        deployment.kill_supernode(2)
        run = background.wait()
        assert run.status == "finished:completed", run.output[-3000:]
        stopped = _results(folder)
        assert stopped["status"] == "stopped-early"
        # two lost rounds in a row, or (if Flower noticed the dead node first) too few nodes
        # connected for the next round
        assert "in a row" in stopped["stop_reason"] or "connected" in stopped["stop_reason"]
        assert stopped["rounds_lost"] >= 1
        assert len(stopped["history"]) < 4  # did not spend privacy to the end
        caveats = " ".join(stopped["privacy"]["caveats"])
        assert "stopped early" in caveats and "single lost node would lose every round" in caveats
        lost = [entry for entry in stopped["history"] if entry.get("lost")]
        assert all("too little noise" in entry["lost"] for entry in lost)  # the true reason
        assert all(entry["missing"] == [dead] for entry in lost)
        assert read_status(folder)["status"] == "stopped-early"  # type: ignore[index]
        assert "FPFL stopped early" in run.output

        # 3. The node is lost for good: resume without it. K shrinks (900 -> 600), so q and
        # sigma change, and the accountant composes the two segments.
        deployment.unregister_node(dead)
        run = deployment.run(
            {**config, "fpfl-resume": True, "min-nodes": 2, "node-wait-timeout": 5.0},
            timeout=FPFL_RUN_TIMEOUT,
        )
        assert run.status == "finished:completed", run.output[-3000:]
        resumed = _results(folder)
        assert resumed["population"]["users"] == 600
        segments = resumed["privacy"]["segments"]
        assert [s["sample_rate"] for s in segments] == pytest.approx([200 / 900, 200 / 600])
        assert segments[0]["rounds"] == stopped["privacy"]["rounds_released_total"]
        assert segments[0]["noise_multiplier"] != pytest.approx(segments[1]["noise_multiplier"])
        history = [(s["noise_multiplier"], s["sample_rate"], s["rounds"]) for s in segments]
        composed = privacy_spent_history(history, delta=1 / 900)
        assert resumed["epsilon"] == pytest.approx(composed.epsilon, rel=1e-9)
        assert resumed["status"] == "completed-with-lost-rounds"
        assert [entry["round"] for entry in resumed["history"]] == list(range(1, 5))
        assert any("different population" in note for note in resumed["privacy"]["caveats"])
        # every ClientApp of these runs was forked from its node's zygote (the warm executor)
        warm_superexec_checks(deployment.superexecs)


@pytest.mark.slow
def test_fedevalfair_holder_killed_mid_exchange(tmp_path: Path) -> None:
    from fedparity.mechanisms.crypto.ckks import generate_keys
    from fedparity.server.cli.identity import write_node_identities

    keys = generate_keys(tmp_path / "keys")
    identities = write_node_identities(tmp_path / "identity", 4)
    node_configs = [
        f"partition-id={i} num-partitions=4 fef-secret-context='{keys.secret}' "
        f"identity-key='{identities / f'node-{i}.key'}' roster='{identities / 'roster.toml'}'"
        for i in range(4)
    ]
    with local_deployment(REPO, 4, node_configs, tmp_path / "flwr-home", warm=True) as deployment:
        folder = tmp_path / "run"
        background = deployment.run_in_background(
            {
                "task": "fedevalfair",
                "fef-public-context": str(keys.public),
                "users-per-node": 1000,
                "num-server-rounds": 0,
                "min-nodes": 4,
                "reply-timeout": 40.0,
                "output-dir": str(folder),
            },
            timeout=400,
        )
        _wait_during(background, lambda: _releases(folder) >= 1, 300, "the test to start")
        dead = deployment.node_ids[3]
        deployment.kill_supernode(3)
        run = background.wait()
        assert run.status == "finished:completed", run.output[-3000:]
        outcome = _results(folder)["fedevalfair"]
        assert outcome["error"] is None  # completed with the three others
        assert dead not in outcome["round_participants"][1]
        assert all(item["node_id"] not in (1, dead) for item in outcome["rejected_replies"])
        took_part = [len(nodes) for nodes in outcome["round_participants"][:2]]
        assert took_part[1] == 3
        assert f"{took_part[0]} contributed to stage 1 and 3 to stage 2" in run.output
