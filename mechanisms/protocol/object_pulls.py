"""Prompt pulls of message objects: a Runtime API client wrapper whose ``PullObject`` re-asks
for an object that is not there yet every few milliseconds instead of waiting Flower's 1 s,
then 2 s.

Flower 1.41 stores a message's objects apart from the message (``flwr.supercore.inflatable``);
``pull_objects`` asks for each, and when one is "found but not available yet" (still being
uploaded) it waits 1 s, doubling, before asking again. A ClientApp started as soon as its
SuperNode pulled a message, and a ServerApp reading replies that are still being uploaded, both
paid that wait for objects that arrived milliseconds later. The wrapper changes only the waits:
what is pulled, and every check on it, is Flower's. No Flower import (duck-typed: anything with
``PullObject`` whose responses have ``object_found`` and ``object_available``).
"""

from __future__ import annotations

import math
import threading
import time
import types
from collections.abc import Callable
from typing import Any

__all__ = [
    "IDLE_POLL_LONGEST",
    "OBJECT_POLL_FIRST",
    "OBJECT_POLL_BUSY_MAX",
    "OBJECT_POLL_MAX",
    "OBJECT_WAIT_SECONDS",
    "IdlePolls",
    "POLL_COST_FACTOR",
    "PromptObjectPulls",
    "object_poll_interval",
    "poll_pause",
    "time_with_sleep",
]

#: Seconds a ClientApp process re-asks its SuperNode for a message object that is not there yet
#: before Flower's own back-off (1 s, doubling to 10 s) takes over.
OBJECT_WAIT_SECONDS = 10.0
#: First and longest pause between two such requests (s); each pause is a tenth of the time
#: waited so far, within these bounds.
OBJECT_POLL_FIRST = 0.005
OBJECT_POLL_MAX = 0.05
#: A pause is also at least this many times the last request's own duration, at most
#: :data:`OBJECT_POLL_BUSY_MAX` (s): a request costs the Flower process serving it (a FastAPI
#: handler) 5 to 15 ms of CPU on a 2-core machine, so re-asking every 5 ms from ten processes
#: at once would keep it busy serving the re-asks instead of the upload they wait for.
POLL_COST_FACTOR = 10.0
OBJECT_POLL_BUSY_MAX = 0.25


#: Longest pause (s) of an idle :class:`IdlePolls` poller: Flower's default SuperExec task poll.
IDLE_POLL_LONGEST = 1.0


def poll_pause(waited: float, first: float, longest: float, fraction: float = 0.1) -> float:
    """The pause before asking again after ``waited`` seconds without an answer: ``fraction``
    of it (a tenth by default), within ``[first, longest]``. What arrives ``t`` seconds after
    the wait began is seen at most ``max(first, fraction t)`` later, and a poller left waiting
    asks about ``1 / (fraction t)`` times a second instead of ``1 / first``."""
    return min(max(fraction * waited, first), longest)


def object_poll_interval(waited: float, last_request: float = 0.0) -> float:
    """The pause before re-asking for an object after ``waited`` seconds, the last request
    having taken ``last_request`` seconds: :func:`poll_pause` within
    [:data:`OBJECT_POLL_FIRST`, :data:`OBJECT_POLL_MAX`], and at least :data:`POLL_COST_FACTOR`
    times ``last_request`` (at most :data:`OBJECT_POLL_BUSY_MAX`)."""
    busy = min(POLL_COST_FACTOR * last_request, OBJECT_POLL_BUSY_MAX)
    return max(poll_pause(waited, OBJECT_POLL_FIRST, OBJECT_POLL_MAX), busy)


def time_with_sleep(sleep: Callable[[float], None]) -> types.ModuleType:
    """A copy of the :mod:`time` module whose ``sleep`` is ``sleep``: what a polling loop's
    module can be given as its ``time`` to change its pauses and nothing else."""
    module = types.ModuleType("time")
    module.__dict__.update(time.__dict__)
    module.sleep = sleep  # type: ignore[attr-defined]
    return module


class IdlePolls:
    """Pauses of a polling loop that slow down while nothing comes (:func:`poll_pause`).

    A loop calls :meth:`sleep` with its own interval after each poll and :meth:`activity` when
    a poll brought work. Right after work the pause is the loop's interval; ``t`` seconds
    later it is ``t / 10``, at most ``longest`` (or the loop's interval where that is longer).
    Flower 1.41's SuperExec polls its SuperNode every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
    seconds whether or not tasks come: at the 0.1 s a device uses to start its ClientApps
    promptly, ten requests a second while idle, each served by the SuperNode.

    Parameters
    ----------
    longest : float
        Longest pause while idle, :data:`IDLE_POLL_LONGEST` by default.
    clock, sleep : callables
        ``time.monotonic`` and ``time.sleep`` by default.
    """

    def __init__(
        self,
        longest: float = IDLE_POLL_LONGEST,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not (math.isfinite(longest) and longest > 0):
            raise ValueError(f"longest must be a finite number of seconds > 0, got {longest!r}")
        self.longest = float(longest)
        self._clock = clock
        self._sleep = sleep
        self._last = clock()

    def activity(self) -> None:
        """A poll brought work: the next pauses start again from the loop's interval."""
        self._last = self._clock()

    def pause(self, interval: float) -> float:
        """The pause after a poll of a loop whose interval is ``interval`` seconds."""
        return poll_pause(self._clock() - self._last, interval, max(interval, self.longest))

    def sleep(self, interval: float) -> None:
        """Sleep :meth:`pause` seconds."""
        self._sleep(self.pause(interval))


class PromptObjectPulls:
    """The ClientApp process's Runtime API client, whose ``PullObject`` re-asks promptly for a
    message object the SuperNode does not hold yet.

    A SuperNode (Flower 1.41, ``flwr.supernode.start_client_internal``) creates the ClientApp's
    task as soon as it has pulled a message, before it has pulled the message's objects from the
    SuperLink; a ClientApp started at once (``--executor warm``) then asks for objects that are
    not there yet, and Flower's ``pull_objects`` (``flwr.supercore.inflatable.inflatable_utils``)
    waits 1 s, then 2 s, before it asks again, whatever the SuperNode needed. Here an
    unavailable object is asked for again after :func:`object_poll_interval` (5 to 50 ms, and
    at least ten times the last request's duration, at most 0.25 s) for up to
    :data:`OBJECT_WAIT_SECONDS`: one of the pulling threads asks, the others wait until an
    object arrived (the SuperNode stores a message's objects together) and then ask once
    themselves. What is pulled and checked is Flower's; only the waits change. Every other
    attribute is the wrapped client's.

    Parameters
    ----------
    client : Any
        Flower's ``RuntimeHttpClient`` (anything with ``PullObject``).
    window : float
        :data:`OBJECT_WAIT_SECONDS`.
    clock, sleep : callables
        ``time.monotonic`` and ``time.sleep`` by default.
    """

    def __init__(
        self,
        client: Any,
        window: float = OBJECT_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        self._client = client
        self._window = window
        self._clock = clock
        self._sleep = sleep
        self._changed = threading.Condition()
        self._asking = False  # one thread re-asks at a time
        self._arrivals = 0  # objects that arrived after a wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def PullObject(self, request: Any) -> Any:  # noqa: N802 - Flower's method name
        """Flower's ``PullObject``; an object that was found but is not available yet is
        asked for again until it is, or until :data:`OBJECT_WAIT_SECONDS` passed (the last
        answer goes back to Flower, whose back-off then applies)."""
        response, last_request = self._timed_pull(request)
        start = self._clock()
        while response.object_found and not response.object_available:
            waited = self._clock() - start
            if waited >= self._window:
                break
            with self._changed:
                asking = not self._asking
                if asking:
                    self._asking = True
                else:  # another thread asks: wait until an object arrived or it stopped asking
                    arrivals = self._arrivals

                    def moved(seen: int = arrivals) -> bool:
                        return self._arrivals != seen or not self._asking

                    self._changed.wait_for(moved, timeout=self._window - waited)
            if not asking:
                response, last_request = self._timed_pull(request)
                continue
            again = False
            try:
                self._sleep(object_poll_interval(waited, last_request))
                response, last_request = self._timed_pull(request)
                again = (
                    response.object_found
                    and not response.object_available
                    and self._clock() - start < self._window
                )
            finally:
                with self._changed:
                    self._asking = False
                    if not again:  # arrived, gone or given up: the waiting threads ask now
                        self._arrivals += bool(response.object_available)
                        self._changed.notify_all()
        return response

    def _timed_pull(self, request: Any) -> tuple[Any, float]:
        """The wrapped client's answer to ``request`` and the seconds the request took."""
        started = self._clock()
        response = self._client.PullObject(request)
        return response, self._clock() - started
