"""A module for tests/test_warm_clientapp.py that a warm ClientApp zygote preloads: it puts a
probe in place of ``fedparity-clientapp``'s entry point, so that each forked child writes what
it drew from every random source to ``$WARM_PROBE_DIR/<token>.json`` instead of running a
ClientApp. Not part of fedparity.

At import (in the zygote, before any fork) it also draws once from each source, which is the
worst case for a forked child: a generator made before the fork (:data:`ZYGOTE_RNG`) is shared
by every child, and it is drawn from here on purpose to show that the test sees such a share.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import secrets
import sys
import threading
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedparity.clients import app_gate
from fedparity.mechanisms.crypto.secure_random import secure_generator

#: A generator made in the zygote: the stream every child shares (the hazard shown).
ZYGOTE_RNG = np.random.default_rng()
# the sources used once before any fork (initialised state is what a child inherits)
np.random.random()  # noqa: NPY002 - the legacy global, on purpose
random.random()
secure_generator().random()
X25519PrivateKey.generate()


def _x25519() -> str:
    key = X25519PrivateKey.generate()
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return raw.hex()


def _record_exit(path: Path) -> None:
    """An exit function of the child: how many of torch's operator finalizers are still set to
    run at exit (the finalizers run after every exit function registered after torch's import)."""
    from fedparity.clients.warm_clientapp import torch_library_finalizers

    torch_finalizers = torch_library_finalizers()
    record = {
        "torch_finalizers": len(torch_finalizers),
        "left_to_run": sum(finalizer.atexit for finalizer in torch_finalizers),
    }
    path.write_text(json.dumps(record), encoding="utf-8")


def probe() -> None:
    """What a child runs instead of ``fedparity-clientapp``: record, then exit like it."""
    token = sys.argv[sys.argv.index("--token") + 1]
    record = {
        "pid": os.getpid(),
        "argv": sys.argv,
        "zygote_rng": ZYGOTE_RNG.integers(2**62, size=4).tolist(),
        "secure_generator": secure_generator().integers(2**62, size=4).tolist(),
        "default_rng": np.random.default_rng().integers(2**62, size=4).tolist(),
        "numpy_global": np.random.randint(2**62, size=4, dtype=np.int64).tolist(),  # noqa: NPY002
        "python_random": random.getrandbits(64),
        "secrets": secrets.token_hex(16),
        "x25519": _x25519(),
        "threads": threading.active_count(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "preloaded_app": "fedparity.clients.app" in sys.modules,
        "preloaded_opacus": "opacus.accountants" in sys.modules,
        "root_handlers": [type(handler).__name__ for handler in logging.getLogger().handlers],
    }
    out = Path(os.environ["WARM_PROBE_DIR"]) / f"{token}.json"
    atexit.register(_record_exit, out.with_suffix(".exit.json"))
    out.with_suffix(".tmp").write_text(json.dumps(record), encoding="utf-8")
    out.with_suffix(".tmp").rename(out)
    sys.exit(0)


app_gate.clientapp_main = probe
