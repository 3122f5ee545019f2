"""A virtual clock for code that polls: ``monotonic`` and ``sleep`` where time passes only when
the code sleeps (or the test moves ``now``)."""

from __future__ import annotations


class VirtualClock:
    """``time.monotonic`` and ``time.sleep`` on virtual seconds."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds
