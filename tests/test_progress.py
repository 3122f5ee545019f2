"""Progress display (fedparity.server.progress): plain throttled lines off a terminal, a rich
bar on one (a real pseudo-terminal), and ``fedparity measure`` on a large file."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedparity.server.cli import main, measure
from fedparity.server.progress import (
    PLAIN_EVERY_SECONDS,
    Progress,
    format_duration,
)

ANSI = re.compile(r"\x1b\[")


def fake_clock(step: float) -> Iterator[float]:
    """0, step, 2 step, ... (one tick per call of the clock)."""
    now = 0.0
    while True:
        yield now
        now += step


def run_plain(total: int, seconds_per_step: float, **options: object) -> list[str]:
    """Lines of a plain display over ``total`` steps, one clock tick per step."""
    out = io.StringIO()
    ticks = fake_clock(seconds_per_step)
    with Progress(
        "fpfl", total, units="rounds", stream=out, clock=lambda: next(ticks), **options
    ) as p:
        for _ in range(total - int(options.get("initial", 0))):  # type: ignore[call-overload]
            p.advance()
    return out.getvalue().splitlines()


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 45.4, 83, 3600 + 5 * 60 + 9)] == [
        "0s",
        "45s",
        "1m23s",
        "1h05m",
    ]


def test_plain_lines_every_tenth_with_rate_and_time_left() -> None:
    # 250 rounds at 0.2 s each: 5 rounds/s, one line per 25 rounds (5 s < 10 s)
    lines = run_plain(250, 0.2)
    assert len(lines) == 10
    assert lines[0] == "fpfl: 25/250 rounds (10 %), 5.0 rounds/s, about 45s left"
    assert lines[1] == "fpfl: 50/250 rounds (20 %), 5.0 rounds/s, about 40s left"
    assert lines[-1] == "fpfl: 250/250 rounds (100 %), 5.0 rounds/s, done in 50s"
    assert not any(ANSI.search(line) for line in lines)


def test_plain_lines_every_ten_seconds_on_slow_work_and_never_more() -> None:
    # 100 rounds at 3 s each (300 s): the 10 s rule fires between the 10 % steps
    lines = run_plain(100, 3.0)
    assert len(lines) <= 10 + 300 / PLAIN_EVERY_SECONDS + 1
    counts = [int(re.match(r"fpfl: (\d+)/100", line)[1]) for line in lines]  # type: ignore[index]
    assert counts[:3] == [4, 8, 10]  # 12 s, 24 s, then the 10 % mark at 30 s
    assert counts == sorted(set(counts)) and counts[-1] == 100
    assert lines[0] == "fpfl: 4/100 rounds (4 %), 0.33 rounds/s, about 4m48s left"


def test_a_resumed_run_counts_its_own_rate() -> None:
    # rounds 101-250 at 0.4 s: 2.5 rounds/s from this run's work only
    lines = run_plain(250, 0.4, initial=100)
    assert len(lines) == 6
    assert lines[0] == "fpfl: 125/250 rounds (50 %), 2.5 rounds/s, about 50s left"
    assert lines[-1] == "fpfl: 250/250 rounds (100 %), 2.5 rounds/s, done in 1m00s"


def test_scaled_units_and_an_unfinished_run() -> None:
    out = io.StringIO()
    ticks = fake_clock(1.0)
    with Progress(
        "measure", 40e6, units="MB", scale=1e-6, stream=out, clock=lambda: next(ticks)
    ) as p:
        p.advance(10e6)
        p.advance(1e6)  # below the next 10 % mark and under 10 s: no line
    assert out.getvalue().splitlines() == [
        "measure: 10/40 MB (25 %), 10.0 MB/s, about 3s left",
        "measure: 11/40 MB (27 %), 3.7 MB/s, about 8s left",  # the last state, on close
    ]


def test_log_mode_is_plain_even_when_the_stream_is_a_terminal() -> None:
    logged: list[str] = []
    with Progress("fpfl", 2, units="rounds", stream=sys.__stderr__, log=logged.append) as p:
        assert p.plain
        p.advance()
        p.advance()
    assert [line.split(" (")[0] for line in logged] == ["fpfl: 1/2 rounds", "fpfl: 2/2 rounds"]


def test_bad_totals_are_refused() -> None:
    with pytest.raises(ValueError, match="total"):
        Progress("x", 0)
    with pytest.raises(ValueError, match="initial"):
        Progress("x", 5, initial=6)


def read_all(fd: int, sink: bytearray) -> None:
    """Drain a pty master until the other side closes."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO once the slave end is closed
            return
        if not chunk:
            return
        sink.extend(chunk)


def test_a_terminal_gets_a_rich_bar() -> None:
    master, slave = pty.openpty()
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(master, received), daemon=True)
    reader.start()
    terminal = os.fdopen(slave, "w", encoding="utf-8")
    with Progress(
        "fpfl", 20, units="rounds", stream=terminal
    ) as p:  # rich's thread reads the clock
        assert not p.plain
        for _ in range(20):
            p.advance()
    terminal.close()
    reader.join(timeout=10)
    os.close(master)
    text = received.decode("utf-8", "replace")
    assert ANSI.search(text)  # a live display: cursor and colour codes
    assert "━" in text  # rich's bar
    assert "20/20" in text and "rounds/s" in text and "fpfl" in text
    assert "about" not in text  # not the plain line


# --- fedparity measure -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Just over the progress threshold: 4-byte rows "g,m\\n", two groups, 0/1 metrics."""
    rows = measure.PROGRESS_MIN_BYTES // 4 + 50_000
    rng = np.random.default_rng(3)
    table = np.array([b"0,0\n", b"0,1\n", b"1,0\n", b"1,1\n"], dtype="S4")
    path = tmp_path_factory.mktemp("measure") / "large.csv"
    path.write_bytes(b"group,metric\n" + table[rng.integers(0, 4, rows)].tobytes())
    assert path.stat().st_size > measure.PROGRESS_MIN_BYTES
    return path


MEASURE = ["measure", "--epsilon", "1", "--seed", "7", "--json", "--chunk-rows", "20000"]


def without_time(stdout: str) -> dict:
    payload = json.loads(stdout)
    payload.pop("elapsed_seconds")
    return payload


def test_measure_shows_plain_progress_on_stderr_and_the_same_result(
    large_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = [sys.executable, "-m", "fedparity.server.cli", *MEASURE, "--input", str(large_csv)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    lines = done.stderr.splitlines()
    assert 5 <= len(lines) <= 11, done.stderr  # about one per 10 % (chunks of 480 kB)
    assert all(re.match(r"measure: [\d.]+/[\d.]+ MB \(\d+ %\), ", line) for line in lines)
    assert lines[-1].startswith("measure: 8.6/8.6 MB (100 %)") and "done in" in lines[-1]
    assert not ANSI.search(done.stderr)

    # the result on stdout is the one a run without any progress display prints
    monkeypatch.setattr(measure, "PROGRESS_MIN_BYTES", 1 << 40)
    quiet_out = io.StringIO()
    assert main([*MEASURE, "--input", str(large_csv)], out=quiet_out) == 0
    assert without_time(done.stdout) == without_time(quiet_out.getvalue())
