"""End-to-end checks of ``tests/support/flower_processes.py`` with real Flower processes.

The throwaway app in ``tests/flower_lab_app`` is copied into ``tmp_path`` and run
(1) on a SuperLink + 3 SuperNodes, (2) on a simulation SuperLink with 3 virtual
SuperNodes. Each node answers a ``query`` with its ``partition-id``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.flower_processes import (
    FlwrRunError,
    bundle_folder,
    format_run_config,
    free_port,
    local_deployment,
    local_simulation,
)

LAB_APP = Path(__file__).parent / "flower_lab_app"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lab_app(tmp_path: Path) -> Path:
    """Fresh copy of the throwaway Flower App."""
    dst = tmp_path / "flowerlab_app"
    shutil.copytree(LAB_APP, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_superlink_state_is_a_sqlite_file_or_flowers_in_memory_default(tmp_path: Path) -> None:
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

    from tests.support.process_tree import _superlink_cmd

    file_cmd = _superlink_cmd(9093, tmp_path / "state.db", simulation=False)
    assert file_cmd[file_cmd.index("--database") + 1] == str(tmp_path / "state.db")
    memory_cmd = _superlink_cmd(9093, None, simulation=False)
    assert "--database" not in memory_cmd
    # without --database, Flower keeps its state in memory (what "memory" relies on)
    args = _parse_args_run_superlink().parse_args(memory_cmd[1:])
    assert args.database == FLWR_IN_MEMORY_DB_NAME
    with pytest.raises(ValueError, match='superlink_state must be "file" or "memory"'):
        with local_deployment(LAB_APP, 1, None, tmp_path / "home", superlink_state="disk"):  # type: ignore[arg-type]
            pass
    assert not (tmp_path / "home").exists()  # refused before anything started


def test_the_deployment_benchmark_measures_a_setting_given_twice_in_two_folders() -> None:
    # ``--superlink-state memory memory`` measured the second run in the first one's folder,
    # where the ServerApp refused to write over the warm-up run's results.
    from benchmarks.deployed_exchange import planned_runs

    runs = planned_runs([10], ["warm"], ["memory", "memory"])
    assert [run[:3] for run in runs] == [(10, "warm", "memory")] * 2
    assert len({run[3] for run in runs}) == 2
    plan = planned_runs([3, 10], ["subprocess", "warm"], ["file"])
    assert [run[:2] for run in plan] == [
        (3, "subprocess"),
        (3, "warm"),
        (10, "subprocess"),
        (10, "warm"),
    ]
    assert len({run[3] for run in plan}) == 4


@pytest.mark.slow  # builds the checkout's bundle from a .venv-holding folder (6 CPU-s)
def test_flwr_run_gets_a_copy_without_the_venv_that_bundles_byte_for_byte_the_same(
    lab_app: Path,
) -> None:
    # A Flower App with a virtual environment in .venv (as this checkout has one after the
    # README's install): flwr run is given a copy without it, and the bundle built from the copy
    # is the one built from the folder itself.
    from flwr.cli.build import build_fab_from_disk

    (lab_app / ".gitignore").write_text(".venv/\n__pycache__/\n", encoding="utf-8")
    venv = lab_app / ".venv" / "lib" / "site-packages" / "big"
    venv.mkdir(parents=True)
    (venv / "module.py").write_text("x = 1\n", encoding="utf-8")
    (lab_app / "extra.md").write_text("carried in the bundle\n", encoding="utf-8")
    copy = bundle_folder(lab_app)
    assert copy != lab_app and not (copy / ".venv").exists()
    assert (copy / "extra.md").read_text(encoding="utf-8") == "carried in the bundle\n"
    assert build_fab_from_disk(copy) == build_fab_from_disk(lab_app)
    # the repository itself, with or without its .venv
    assert build_fab_from_disk(bundle_folder(REPO)) == build_fab_from_disk(REPO)
    # a folder without a .venv is handed over as it is
    assert bundle_folder(LAB_APP) == LAB_APP.resolve()


def test_format_run_config_quotes_for_flower_parser() -> None:
    from flwr.common.config import parse_config_args

    config: dict[str, bool | int | float | str] = {
        "a": 3,
        "b": 0.5,
        "c": True,
        "d": "x y=z",
        "e": "it's",
        "f": "",
        "g": r"C:\dir",
        "h": 1e-5,
    }
    line = format_run_config(config)
    assert parse_config_args([line]) == config
    with pytest.raises(ValueError):
        format_run_config({"bad key": 1})


@pytest.mark.slow  # over 5 s: CI runs it, the fast lane leaves it out
def test_deployment_three_supernodes_and_failure_status(lab_app: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out-deployment"
    with local_deployment(lab_app, 3, None, tmp_path / "flwr-home") as dep:
        assert len(set(dep.node_ids)) == 3
        run = dep.run(
            {"expected-nodes": 3, "greeting": "hi 'there'", "output-dir": str(out_dir)},
            timeout=180,
        )
        logs = dep.logs()
        # `flwr run` exits 0 although the ServerApp raised: the helper reads the status.
        with pytest.raises(FlwrRunError, match="finished:failed"):
            dep.run({"fail": True}, timeout=120)
        pids = [p.pid for p in dep.processes]
    assert run.status == "finished:completed"
    for i in range(3):
        assert f"LAB reply partition-id={i} num-partitions=3 greeting=hi 'there'" in run.output
        # ClientApp prints land in the SuperNode's log.
        assert f"LABCLIENT partition-id={i}" in logs[f"supernode-{i}"]
    replies = json.loads((out_dir / "replies.json").read_text())
    assert [r["partition-id"] for r in replies] == [0, 1, 2]
    assert _pids_alive(pids) == []
    # The connection was removed again from the per-test FLWR_HOME.
    assert "local-deployment" not in (tmp_path / "flwr-home" / "config.toml").read_text()


@pytest.mark.slow  # over 5 s: CI runs it, the fast lane leaves it out
def test_simulation_three_supernodes(lab_app: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out-simulation"
    # Run config from a TOML file inside the app (as `flwr run . -c configs/sim.toml`).
    (lab_app / "configs").mkdir()
    (lab_app / "configs" / "sim.toml").write_text(
        f'expected-nodes = 3\noutput-dir = "{out_dir.as_posix()}"\n', encoding="utf-8"
    )
    with local_simulation(lab_app, 3, tmp_path / "flwr-home") as sim:
        run = sim.run(Path("configs/sim.toml"), timeout=180)
        pid = sim.superlink.pid
    assert "3 simulated SuperNodes" in run.output
    for i in range(3):
        assert f"LAB reply partition-id={i} num-partitions=3 greeting=hello" in run.output
    replies = json.loads((out_dir / "replies.json").read_text())
    assert [r["partition-id"] for r in replies] == [0, 1, 2]
    assert f"LAB cwd={os.path.realpath(lab_app)}" in run.output
    assert _pids_alive([pid]) == []
