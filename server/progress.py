"""Progress of long work: a rich bar on a terminal, plain throttled lines everywhere else.

One display for FPFL and FedAvg rounds, the Monte Carlo benchmarks and ``fedparity measure``:

* on a terminal (the stream is a TTY) a `rich <https://rich.readthedocs.io>`_ bar with the
  count, the rate and the time left;
* in logs, pipes and CI, plain lines without ANSI codes, at most one per ~10 % of the work or
  per ~10 s, plus a last one::

      fpfl: 50/250 rounds (20 %), 2.4 rounds/s, about 1m23s left

* through a logging function (``log=``), always the plain lines: a Flower ServerApp's output
  goes to Flower's log, never to a terminal.

Examples
--------
>>> import io
>>> ticks = iter(range(0, 100, 2))
>>> out = io.StringIO()
>>> with Progress("demo", 4, units="steps", stream=out, clock=lambda: next(ticks)) as progress:
...     for _ in range(4):
...         progress.advance()
>>> print(out.getvalue().splitlines()[0])
demo: 1/4 steps (25 %), 0.5 steps/s, about 6s left
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["PLAIN_EVERY_SECONDS", "PLAIN_STEPS", "Progress", "format_duration"]

#: Plain mode prints a line each time another 1/PLAIN_STEPS of the work is done ...
PLAIN_STEPS = 10
#: ... or this many seconds have passed since the last line, whichever comes first.
PLAIN_EVERY_SECONDS = 10.0


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"1m23s"``, ``"2h05m"`` (rounded to whole seconds)."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _amount(value: float) -> str:
    """A count or scaled amount to one decimal, without ``.0`` (``25``, ``8.6``, ``1,024``)."""
    shown = round(value, 1)
    return f"{shown:,.0f}" if shown.is_integer() or shown >= 100 else f"{shown:.1f}"


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


def _rate(value: float) -> str:
    return f"{value:,.1f}" if value >= 1 else f"{value:.2g}"


class Progress:
    """Progress of ``total`` units of work: a context manager (or :meth:`start` and
    :meth:`close`); call :meth:`advance` as the work gets done.

    Parameters
    ----------
    label : str
        What runs (``"fpfl"``, ``"measure"``); starts every line.
    total : float
        Units of work in all (> 0).
    units : str, default "steps"
        Plural name of a unit (``"rounds"``, ``"MB"``).
    scale : float, default 1.0
        Displayed amount per unit counted (``1e-6`` to count bytes and show MB).
    initial : float, default 0.0
        Units already done before this run (a resumed training); the rate and the time left
        count only the work done here.
    stream : TextIO or None
        Where the display goes (default ``sys.stderr``). A TTY gets the rich bar, anything
        else the plain lines.
    log : callable or None
        If given, the plain lines go to ``log(line)`` instead of a stream (always plain).
    clock : callable, default ``time.monotonic``
        Seconds; injectable for tests.
    """

    def __init__(
        self,
        label: str,
        total: float,
        *,
        units: str = "steps",
        scale: float = 1.0,
        initial: float = 0.0,
        stream: TextIO | None = None,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(total) and total > 0):
            raise ValueError(f"total must be a finite number > 0, got {total!r}")
        if not 0 <= initial <= total:
            raise ValueError(f"initial must be in [0, total], got {initial!r}")
        self.label = label
        self.total = float(total)
        self.units = units
        self.scale = scale
        self.done = float(initial)
        self._initial = float(initial)
        self._stream = sys.stderr if stream is None else stream
        self._log = log
        self._clock = clock
        self._started = 0.0
        self._last_line_time = 0.0
        self._last_line_done = float(initial)
        self._rich: Any = None
        self._task: Any = None

    @property
    def plain(self) -> bool:
        """Whether the plain lines are used (a logging function, or a stream that is no TTY)."""
        return self._log is not None or not _is_tty(self._stream)

    def start(self) -> Progress:
        """Start the clock (and the bar on a terminal); ``with Progress(...)`` calls it."""
        self._started = self._last_line_time = self._clock()
        if not self.plain:
            self._start_rich()
        return self

    def close(self) -> None:
        """Stop the bar, or print the last plain line if the work moved since the previous."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self.done != self._last_line_done:
            self._emit(self._clock())

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def advance(self, amount: float = 1.0) -> None:
        """Count ``amount`` more units as done (the total is never exceeded)."""
        self.done = min(self.total, self.done + amount)
        now = self._clock()
        if self._rich is not None:
            rate = self._rate_per_second(now)
            self._rich.update(
                self._task,
                completed=self.done,
                shown=_amount(self.done * self.scale),
                rate="" if rate is None else f"{_rate(rate * self.scale)} {self.units}/s",
            )
            return
        if self.done == self._last_line_done:
            return
        crossed = self._step(self.done) > self._step(self._last_line_done)
        if crossed or now - self._last_line_time >= PLAIN_EVERY_SECONDS or self.finished:
            self._emit(now)

    def _step(self, done: float) -> int:
        """Index of the 1/PLAIN_STEPS part of the work that ``done`` is in."""
        return math.floor(done * PLAIN_STEPS / self.total)

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def line(self, now: float) -> str:
        """The plain line for the state at ``now``."""
        text = (
            f"{self.label}: {_amount(self.done * self.scale)}/{_amount(self.total * self.scale)} "
            f"{self.units} ({math.floor(100 * self.done / self.total)} %)"
        )
        rate = self._rate_per_second(now)
        if rate is not None:
            text += f", {_rate(rate * self.scale)} {self.units}/s"
            if self.finished:
                text += f", done in {format_duration(now - self._started)}"
            else:
                text += f", about {format_duration((self.total - self.done) / rate)} left"
        return text

    def _rate_per_second(self, now: float) -> float | None:
        """Units per second done in this run; None before any time or work."""
        elapsed, worked = now - self._started, self.done - self._initial
        return worked / elapsed if elapsed > 0 and worked > 0 else None

    def _emit(self, now: float) -> None:
        text = self.line(now)
        self._last_line_time, self._last_line_done = now, self.done
        if self._log is not None:
            self._log(text)
        else:
            print(text, file=self._stream, flush=True)

    def _start_rich(self) -> None:
        from rich import progress as bar
        from rich.console import Console

        amounts: Any = (
            bar.MofNCompleteColumn()
            if self.scale == 1.0
            else bar.TextColumn(
                f"{{task.fields[shown]}}/{_amount(self.total * self.scale)} {self.units}"
            )
        )
        self._rich = bar.Progress(
            bar.TextColumn("{task.description}"),
            bar.BarColumn(),
            bar.TaskProgressColumn(),
            amounts,
            bar.TextColumn("{task.fields[rate]}"),
            bar.TimeRemainingColumn(),
            console=Console(file=self._stream),
            get_time=self._clock,
            # prints to stdout go above the bar only when stdout shares the terminal: a
            # redirected stdout (results piped to a file) is never touched
            redirect_stdout=_is_tty(sys.stdout),
            redirect_stderr=self._stream is sys.stderr,
        )
        self._task = self._rich.add_task(
            self.label,
            total=self.total,
            completed=self.done,
            shown=_amount(self.done * self.scale),
            rate="",
        )
        self._rich.start()
