"""Flower's SuperNode (``flower-supernode``) polling the SuperLink every 0.1 s after a message
(slowing to 1 s while none come), for the tests' deployments on one machine.

Flower 1.41's SuperNode sleeps a hard-coded 3 s after each pull that brought no message, and
0.5 s between checks for its ClientApp's reply (``flwr/supernode/start_client_internal.py``):
most of a deployed exchange's 5-6 s here. It also announces a heartbeat interval of 30 s
(``HEARTBEAT_DEFAULT_INTERVAL``, not an option), so the SuperLink takes 38-60 s to notice a
killed SuperNode, which the fault tests wait for; and it pulls a message's objects from the
SuperLink with Flower's ``pull_objects``, which waits 1 s, then 2 s, for an object the ServerApp
is still uploading. The tests start their SuperNodes with this script, which shortens those two
sleeps (to 0.1 s, growing to a tenth of the time since the last message and at most 1 s as
:class:`~fedparity.mechanisms.protocol.object_pulls.IdlePolls` does, and to 0.05 s) in that
module only, announces the SuperLink's minimum heartbeat
interval (10 s: a killed node is noticed after 16-20 s), re-asks for an object still being
uploaded every 5 to 50 ms, at least ten times the last request's duration (fedparity's
:class:`~fedparity.mechanisms.protocol.object_pulls.PromptObjectPulls`, as its ClientApp and
ServerApp do) and then runs Flower's own ``flower-supernode`` entry point with the same
arguments; everything else is Flower's. The SuperExec's own task poll has a setting,
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (:func:`tests.support.flower_env.child_env` sets it).
Nothing here is part of fedparity: a real node runs ``flower-supernode``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import flwr.supercore.heartbeat as heartbeat_sender
import flwr.supernode.fleet_http_connection as fleet_connection
import flwr.supernode.start_client_internal as supernode_loop
from flwr.common.constant import HEARTBEAT_MIN_INTERVAL
from flwr.supernode.cli import flower_supernode

from fedparity.mechanisms.protocol.object_pulls import IdlePolls, PromptObjectPulls, time_with_sleep

#: Flower's sleep (s) -> the tests' sleep (s); other durations are kept (3 s: :func:`_sleep`).
SHORTER = {0.5: 0.05}
#: The pause after a pull that brought no message (Flower's 3 s) grows from this (s), as
#: fedparity-superexec's task polls do (:class:`IdlePolls`: a tenth of the time since the
#: last message, at most 1 s).
FIRST_PULL_PAUSE = 0.1
_pulls = IdlePolls()


def _sleep(seconds: float) -> None:
    if seconds == 3:
        _pulls.sleep(FIRST_PULL_PAUSE)
        return
    time.sleep(SHORTER.get(seconds, seconds))


_flower_push = supernode_loop._push_messages


def _push_after_message(*args: Any, **kwargs: Any) -> Any:
    """Flower's ``_push_messages``, called once per message pulled: the pulls speed up."""
    _pulls.activity()
    return _flower_push(*args, **kwargs)


class _PullFunction:
    """A ``PullObject`` callable as the client :class:`PromptObjectPulls` wraps."""

    def __init__(self, pull_object: Any) -> None:
        self.PullObject = pull_object


_flower_pull_fn = fleet_connection.make_pull_object_fn_protobuf


def _prompt_pull_fn(pull_object_protobuf: Any, node: Any, run_id: int) -> Any:
    """Flower's ``make_pull_object_fn_protobuf`` over a promptly re-asking ``PullObject``."""
    prompt = PromptObjectPulls(_PullFunction(pull_object_protobuf))
    return _flower_pull_fn(prompt.PullObject, node, run_id)


def main() -> None:
    supernode_loop.time = time_with_sleep(_sleep)  # type: ignore[attr-defined]
    supernode_loop._push_messages = _push_after_message  # type: ignore[attr-defined]
    # the interval the node announces (activation, heartbeats) and the one it sends at
    fleet_connection.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_MIN_INTERVAL  # type: ignore[misc]
    heartbeat_sender.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_MIN_INTERVAL  # type: ignore[misc]
    fleet_connection.make_pull_object_fn_protobuf = _prompt_pull_fn
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
