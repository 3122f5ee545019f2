"""Stopping means stopping, and the operator is told how the run ended (issue 32, item 7).

Before: Ctrl-C on ``flwr run --stream`` only detached the console while the run went on
releasing; after ``flwr stop`` the run's ``status.json`` still said ``running`` (the job runs in
another thread than the one Flower's exit stops, so it never learned of the stop) and its final
ERROR line reached neither the console nor ``flwr log``. Now the ServerApp records the stop as
it exits (``fedparity.server.app.StopRecorder``, one of Flower's exit handlers), and Ctrl-C on
``fedparity run`` stops the run with ``flwr stop`` and prints that final line from the status
file.

A real simulation SuperLink on a free port, the project submitted through ``fedparity run`` in
its own process, a real SIGINT.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from fedparity.server.run_record import STOPPED_TEXT, read_status
from tests.support.flower_processes import (
    bundle_folder,
    child_env,
    flower_executable,
    format_run_config,
    local_simulation,
    run_status,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]


def _rounds_released(folder: Path) -> int:
    ledger = folder / "privacy-ledger.json"
    return json.loads(ledger.read_text())["rounds_released"] if ledger.exists() else 0


@pytest.mark.slow
def test_ctrl_c_on_fedparity_run_stops_the_run_and_says_how_it_ended(tmp_path: Path) -> None:
    output = tmp_path / "run"
    run_config = {"task": "fpfl", "fpfl-rounds": 3000, "output-dir": str(output)}
    with local_simulation(REPO, 2, tmp_path / "flwr-home") as simulation:
        command = [
            flower_executable("fedparity"),
            "run",
            str(bundle_folder(REPO)),
            simulation.federation,
            "--run-config",
            format_run_config(run_config),
            "--federation-config",
            "num-supernodes=2 client-resources-num-cpus=1",
        ]
        wrapper = subprocess.Popen(  # noqa: S603 - the project's own command
            command,
            env=child_env(simulation.flwr_home),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            wait_for(lambda: _rounds_released(output) >= 3, 300, what="three FPFL rounds")
            wrapper.send_signal(signal.SIGINT)  # Ctrl-C
            out, err = wrapper.communicate(timeout=120)
        finally:
            if wrapper.poll() is None:
                wrapper.kill()
        run_id = int(re.search(r"Successfully started run (\d+)", out).group(1))  # type: ignore[union-attr]
        flower_status, _ = run_status(run_id, simulation.federation, simulation.flwr_home)
    assert wrapper.returncode == 130, err
    assert flower_status == "finished:stopped"  # the run itself stopped, not only the console
    status = read_status(output)
    assert status is not None and status["status"] == "interrupted", status
    assert status["error"] == STOPPED_TEXT
    # no round after the stop: the job refused its next release (the privacy ledger may count
    # one more, counted before it was refused, never sent)
    released = status["fpfl_rounds_released"]
    assert released <= _rounds_released(output) <= released + 1 < 3000
    assert f"fedparity run: run {run_id} stopped" in err
    assert (
        f"fedparity run: the fpfl run WAS INTERRUPTED: {STOPPED_TEXT}. "
        f"Released before it ended: {released} FPFL round(s). Status: {output / 'status.json'}"
    ) in err
