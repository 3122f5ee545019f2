"""Flower's SuperNode (``flower-supernode``) polling the SuperLink every 0.1 s, for the tests'
deployments on one machine.

Flower 1.41's SuperNode sleeps a hard-coded 3 s after each pull that brought no message, and
0.5 s between checks for its ClientApp's reply (``flwr/supernode/start_client_internal.py``):
most of a deployed exchange's 5-6 s here. The tests start their SuperNodes with this script,
which shortens those two sleeps (to 0.1 s and 0.05 s) in that module only and then runs
Flower's own ``flower-supernode`` entry point with the same arguments; everything else is
Flower's. The SuperExec's own task poll has a setting, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
(:func:`tests.flower_processes.child_env` sets it). Nothing here is part of fedparity: a real
node runs ``flower-supernode``.
"""

from __future__ import annotations

import sys
import time
import types

import flwr.supernode.start_client_internal as supernode_loop
from flwr.supernode.cli import flower_supernode

#: Flower's sleep (s) -> the tests' sleep (s); other durations are kept.
SHORTER = {3: 0.1, 0.5: 0.05}


def _sleep(seconds: float) -> None:
    time.sleep(SHORTER.get(seconds, seconds))


def main() -> None:
    patched = types.ModuleType("time")
    patched.__dict__.update(time.__dict__)
    patched.sleep = _sleep  # type: ignore[attr-defined]
    supernode_loop.time = patched  # type: ignore[attr-defined]
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
