"""Each log line of ``flwr run --stream`` once, no DEBUG lines, none of the known noise.

Real runs: a simulation SuperLink on a free port (``tests/support/flower_processes.py``, its own
``FLWR_HOME``), the project submitted with ``flwr run . --stream``, and the streamed output
read line by line. Opacus calls ``logging.basicConfig`` when imported; without the guard in
``fedparity.mechanisms.privacy.opacus_accounting`` the root logger gains a stderr handler and every
Flower line of the process that imported it prints twice (again with a timestamp), DEBUG lines
included. The FPFL job imports Opacus (its accountant) in the ServerApp and in the nodes; the
LDP job does not, and checks that nothing else doubles its lines.
"""

from __future__ import annotations

import logging
import re
import tomllib
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from flwr.common import log

from fedparity.clients.logging_setup import quiet_known_noise, quiet_strategy_banner, warnings_once
from tests.support.flower_processes import local_simulation, strip_ansi

REPO = Path(__file__).resolve().parents[1]
LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
#: Flower's console format ("INFO :      text") and logging.basicConfig's as Opacus sets it
#: ("11/25/2026 06:36:01:INFO:text"): the same record through two handlers.
LOG_PREFIX = re.compile(rf"^(?:\d\d/\d\d/\d{{4}} \d\d:\d\d:\d\d:)?(?:{LEVELS})\s*:\s*")
#: Ray's prefix on a line it forwards from another process ("(pid=9847) ",
#: "(ClientAppActor pid=9847) "): with nothing after it, the line is blank.
RAY_PROCESS_PREFIX = re.compile(r"^\((?:\w+ )?pid=\d+(?:, ip=[\d.]+)?\)")
#: Lines that legitimately repeat (never twice in a row): the settings line of each LDP audit.
REPEATS_BY_DESIGN = (re.compile(r"^└── metric \w+, confidence [\d.]+, group sizes \w+$"),)
#: Known noise that the apps silence (clients/logging_setup.py).
SILENCED = (
    "FutureWarning",
    "Manually terminating",
    "Federated evaluation will be skipped",
    "Starting RobustFedAvg strategy",
    "Final results:",
)

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    # two audits (epsilon 1 and 4): their settings lines repeat by design
    "ldp": ("configs/ldp-quick.toml", {"min-nodes": 2, "users-per-node": 200}),
    "fpfl": (
        "configs/fpfl-synthetic.toml",
        {"users-per-node": 200, "fpfl-cohort-size": 100, "fpfl-rounds": 3},
    ),
}


def message(line: str) -> str:
    """A streamed line without colour codes and without the handler's level/time prefix."""
    return LOG_PREFIX.sub("", strip_ansi(line)).strip()


def repeated_lines(output: str) -> tuple[list[str], list[str]]:
    """(lines equal to the one before, lines seen twice overall that may not repeat)."""
    lines = [
        text
        for text in map(message, output.splitlines())
        if RAY_PROCESS_PREFIX.sub("", text).strip()
    ]
    in_a_row = [b for a, b in zip(lines, lines[1:], strict=False) if a == b]
    overall = [
        text
        for text, count in Counter(lines).items()
        if count > 1 and not any(pattern.match(text) for pattern in REPEATS_BY_DESIGN)
    ]
    return in_a_row, overall


def test_repeated_lines_are_found_through_either_handler_format() -> None:
    doubled = (
        "\x1b[92mINFO \x1b[0m:      [AUDIT 1/2] epsilon 1\n"
        "11/25/2026 06:36:01:INFO:[AUDIT 1/2] epsilon 1\n"
        "INFO :      \tround    1: loss 0.5\n"
        "INFO :      \tround    2: loss 0.5\n"
        "INFO :      \t└── metric accuracy, confidence 0.95, group sizes estimated\n"
        "INFO :      \n"
        "INFO :      [AUDIT 2/2] epsilon 4\n"
        "INFO :      \t└── metric accuracy, confidence 0.95, group sizes estimated\n"
        "INFO :      \n"
    )
    assert repeated_lines(doubled) == (["[AUDIT 1/2] epsilon 1"], ["[AUDIT 1/2] epsilon 1"])


def test_blank_lines_ray_forwards_from_another_process_are_no_repetition() -> None:
    # A Ray worker's crash report (seen once in CI, from a worker running no fedparity code)
    # holds blank lines with the worker's prefix; the job's own lines are what is checked.
    forwarded = (
        "(pid=9847) Fatal Python error: Aborted\n"
        "(pid=9847) \n"
        "(pid=9847) \n"
        "(ClientAppActor pid=9850) \n"
        "INFO :      results written to /tmp/run\n"
        "(pid=9847) Fatal Python error: Aborted\n"
    )
    assert repeated_lines(forwarded) == ([], ["(pid=9847) Fatal Python error: Aborted"])


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def flower_records() -> Any:
    """Messages of the ``flwr`` logger (after its filters), while the test runs."""
    handler = Collect()
    logging.getLogger("flwr").addHandler(handler)
    yield handler.messages
    logging.getLogger("flwr").removeHandler(handler)


def test_the_strategy_banner_goes_and_rounds_and_warnings_stay(flower_records: list[str]) -> None:
    with quiet_strategy_banner():
        log(logging.INFO, "Starting %s strategy:", "FedAvg")  # Flower's own format strings
        log(logging.INFO, "\t├── Number of rounds: %d", 3)
        log(logging.WARNING, "a node failed")
        log(logging.INFO, "")
        log(logging.INFO, "[ROUND %s/%s]", 1, 3)
        log(logging.INFO, "aggregate_train: Received %s results and %s failures", 2, 0)
        log(logging.INFO, "Final results:")
        log(logging.INFO, "\t%s", "Global Arrays:")
    log(logging.INFO, "")
    log(logging.INFO, "after the strategy")
    assert flower_records == [
        "a node failed",
        "[ROUND 1/3]",
        "aggregate_train: Received 2 results and 0 failures",
        "",
        "after the strategy",
    ]


def test_a_jobs_repeated_warning_is_said_once_and_nothing_else_is_dropped(
    flower_records: list[str],
) -> None:
    """Issue 32: the pipeline's two trainings printed the same FPFL warning twice. During a
    job (``warnings_once``, around every job in ``run_job``) a WARNING text is said once; INFO
    and ERROR lines are never dropped, and the next job starts afresh."""
    fragile = "FPFL: a single lost node would lose every round"
    with warnings_once():
        for _ in range(2):
            log(logging.WARNING, "%s", fragile)
            log(logging.INFO, "round %d", 1)
            log(logging.ERROR, "fedparity: failed")
        log(logging.WARNING, "another warning")
    log(logging.WARNING, "%s", fragile)  # a later job
    assert flower_records == [
        fragile,
        "round 1",
        "fedparity: failed",
        "round 1",
        "fedparity: failed",
        "another warning",
        fragile,
    ]


def test_fpfl_round_lines_are_condensed_unless_verbose() -> None:
    """Issue 32: 60-round trainings printed 60 lines each. Up to 20 rounds (or with verbose)
    every line; beyond, the first, the last, every tenth of the way and every lost round."""
    from fedparity.server.fpfl_job import shows_round_line

    def shown(last: int, verbose: bool = False, lost: tuple[int, ...] = ()) -> list[int]:
        return [
            number
            for number in range(1, last + 1)
            if shows_round_line(number, last, {"lost": "x" if number in lost else ""}, verbose)
        ]

    assert shown(20) == list(range(1, 21))
    assert shown(60) == [1, *range(6, 61, 6)]
    assert shown(60, lost=(7,)) == [1, 6, 7, *range(12, 61, 6)]
    assert shown(60, verbose=True) == list(range(1, 61))
    assert len(shown(1000)) == 11


def test_known_noise_is_silenced_and_nothing_else(flower_records: list[str]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        warnings.warn(
            "Tip: In future versions of Ray, Ray will no longer override accelerator visible "
            "devices env var if num_gpus=0",
            FutureWarning,
            stacklevel=1,
        )
        warnings.warn("Tip: In future versions of Ray, something else", FutureWarning, stacklevel=1)
        warnings.warn(
            "Tip: In future versions of Ray, Ray will no longer override accelerator",
            UserWarning,
            stacklevel=1,
        )
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "Tip: In future versions of Ray, something else"),
        (UserWarning, "Tip: In future versions of Ray, Ray will no longer override accelerator"),
    ]
    log(logging.WARNING, "Manually terminating %s", "ClientAppActor")
    log(logging.WARNING, "Manually terminating the run")  # another format string: kept
    assert flower_records == ["Manually terminating the run"]


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(JOBS))
def test_flwr_run_prints_each_line_once_and_no_debug(tmp_path: Path, job: str) -> None:
    config_file, overrides = JOBS[job]
    # flwr run refuses a TOML file together with key=value pairs: the file's keys + overrides
    run_config = {**tomllib.loads((REPO / config_file).read_text()), **overrides}
    run_config["output-dir"] = str(tmp_path / "run")
    with local_simulation(REPO, 2, tmp_path / "flwr-home") as simulation:
        run = simulation.run(run_config, timeout=600)
    # Redirected, the job's lines hold no colour codes (issue 32): Flower colours its log levels
    # unconditionally unless the app switches its console handler off a terminal. The lines
    # Flower's simulation and CLI print before the app is loaded keep theirs.
    raw_lines = run.stdout.splitlines()
    first = next(i for i, line in enumerate(raw_lines) if "status in " in line)
    coloured = [line for line in raw_lines[first:] if "\x1b[" in line]
    assert coloured == [], coloured
    output = run.output  # stdout + stderr, colour codes removed
    assert "results written to" in output  # the job's own lines are in the stream
    # the job says first where its status is and how to stop it (Ctrl-C only detaches)
    status = tmp_path / "run" / "status.json"
    assert f"status in {status}; to stop the run: flwr stop {run.run_id}" in output

    in_a_row, overall = repeated_lines(output)
    assert in_a_row == [], f"printed twice in a row: {in_a_row}\n{output}"
    assert overall == [], f"printed more than once: {overall}\n{output}"
    assert "DEBUG" not in output
    noise = [text for text in SILENCED if text in output]
    assert noise == [], f"known noise in the output: {noise}\n{output}"
