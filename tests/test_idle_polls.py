"""Polls that slow down while nothing comes: the rule (:func:`poll_pause`, :class:`IdlePolls`)
and fedparity-superexec's task loop built on it (:func:`install_idle_task_polls`)."""

from __future__ import annotations

import pytest
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.superexec import run_superexec
from flwr.supercore.superexec.executor import LaunchResult

from fedparity.clients.app_gate import _superexec_parser, install_idle_task_polls
from fedparity.mechanisms.protocol.object_pulls import IDLE_POLL_LONGEST, IdlePolls, poll_pause
from tests.support.virtual_clock import VirtualClock


def test_the_pause_is_a_tenth_of_the_wait_within_its_bounds() -> None:
    assert poll_pause(0.0, 0.1, 1.0) == 0.1
    assert poll_pause(4.0, 0.1, 1.0) == pytest.approx(0.4)
    assert poll_pause(60.0, 0.1, 1.0) == 1.0


def test_idle_polls_start_at_the_interval_after_work_and_slow_to_the_longest() -> None:
    clock = VirtualClock()
    polls = IdlePolls(clock=clock.monotonic, sleep=clock.sleep)
    assert polls.pause(0.05) == 0.05
    clock.now = 5.0
    assert polls.pause(0.05) == pytest.approx(0.5)
    clock.now = 300.0
    assert polls.pause(0.05) == IDLE_POLL_LONGEST
    assert polls.pause(3.0) == 3.0  # a loop slower than the longest pause keeps its interval
    polls.activity()
    assert polls.pause(0.05) == 0.05


@pytest.mark.parametrize("interval", [0.01, 0.05, 0.1, 0.5])
def test_work_waits_at_most_a_tenth_longer_and_an_idle_loop_polls_rarely(interval: float) -> None:
    """A loop that polls, then sleeps: work arriving ``t`` seconds after the last is seen at
    most ``max(interval, t / 10)`` later; over ten idle minutes it polls a few hundred times
    where a fixed interval polls ``600 / interval`` times."""
    clock = VirtualClock()
    polls = IdlePolls(clock=clock.monotonic, sleep=clock.sleep)
    times = [0.0]
    while clock.now < 600.0:
        polls.sleep(interval)
        times.append(clock.now)
    for arrival in [0.003, 0.07, 0.5, 1.3, 2.0, 7.7, 42.0, 123.4, 599.0]:
        seen = next(t for t in times if t >= arrival)
        assert seen - arrival <= max(interval, arrival / 10.0) + 1e-9
    fixed = 600.0 / interval
    assert len(times) < 700 and len(times) < fixed / 1.5 + 100


def test_longest_must_be_a_positive_number_of_seconds() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="longest must be"):
            IdlePolls(longest=bad)


def test_the_superexec_loop_sleeps_idle_pauses_and_speeds_up_after_each_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Flower's own loop module: its ``time.sleep`` becomes the idle pause (its other
    ``time`` functions stay), and every task it hands to ``_handle_launch_result`` resets it."""
    monkeypatch.setattr(run_superexec, "time", run_superexec.time)  # restored after the test
    monkeypatch.setattr(run_superexec, "_handle_launch_result", run_superexec._handle_launch_result)
    clock = VirtualClock()
    polls = install_idle_task_polls(IdlePolls(clock=clock.monotonic, sleep=clock.sleep))
    clock.now = 20.0
    run_superexec.time.sleep(0.05)  # what Flower's loop calls after each poll
    assert clock.now == pytest.approx(20.0 + IDLE_POLL_LONGEST)
    assert run_superexec.time.monotonic() > 0  # the rest of the time module is the real one
    run_superexec._handle_launch_result(LaunchResult.accepted(), Task(task_id=7))
    assert polls.pause(0.05) == 0.05
    run_superexec.time.sleep(0.05)
    assert clock.now == pytest.approx(21.05)
    # installed again (a second superexec_main in one process): Flower's handler is wrapped once
    again = install_idle_task_polls(IdlePolls(clock=clock.monotonic, sleep=clock.sleep))
    assert run_superexec.time.idle_polls is again and again is not polls
    assert run_superexec._handle_launch_result.__wrapped__.__module__ == run_superexec.__name__


def test_a_flower_whose_loop_has_no_such_hooks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(run_superexec, "_handle_launch_result")
    with pytest.raises(RuntimeError, match="--fixed-task-poll"):
        install_idle_task_polls()


def test_fixed_task_poll_is_an_option_of_fedparity_superexec() -> None:
    parser = _superexec_parser()
    assert parser.parse_args([]).fixed_task_poll is False
    assert parser.parse_args(["--fixed-task-poll"]).fixed_task_poll is True
