"""A module for tests/test_warm_clientapp.py that a warm ClientApp zygote preloads: it puts a
probe in place of ``fedparity-clientapp``'s entry point, so that each forked child writes what
it drew from every random source to ``$WARM_PROBE_DIR/<token>.json`` instead of running a
ClientApp. Not part of fedparity.

At import (in the zygote, before any fork) it also draws once from each source, which is the
worst case for a forked child: a generator made before the fork (:data:`ZYGOTE_RNG`) is shared
by every child, and it is drawn from here on purpose to show that the test sees such a share.
It then fingerprints every random generator a preloaded module holds (:func:`global_generators`,
:data:`ZYGOTE_GENERATORS`); each child fingerprints them again before it draws anything, and,
when the zygote preloaded torch, draws from torch's global generator what an operator's own app
would (:func:`torch_draws`).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import pickle
import random
import secrets
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

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

#: The types of generator a library may keep at module level (torch's added when it is imported;
#: ``random.SystemRandom`` keeps no state).
GENERATOR_TYPES: tuple[type, ...] = (
    random.Random,
    np.random.RandomState,
    np.random.Generator,
    np.random.BitGenerator,
)


def global_generators() -> dict[str, Any]:
    """Every random generator that an imported module holds as an attribute, or as an attribute
    of a class it defines: ``module.name`` (the shortest of a generator's names) -> generator."""
    torch = sys.modules.get("torch")
    kinds = GENERATOR_TYPES + ((torch.Generator,) if torch is not None else ())
    found: dict[int, tuple[str, Any]] = {}
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            candidates = [(f"{module_name}.{attribute}", value)]
            if isinstance(value, type):
                with warnings.catch_warnings():  # deprecated classes warn on attribute access
                    warnings.simplefilter("ignore")
                    if value.__module__ == module_name:
                        candidates += [
                            (f"{module_name}.{attribute}.{k}", v) for k, v in vars(value).items()
                        ]
            for name, candidate in candidates:
                kind = type(candidate)  # never the object's own __class__ (lazy proxies)
                if issubclass(kind, kinds) and not issubclass(kind, random.SystemRandom):
                    known = found.get(id(candidate))
                    if known is None or (len(name), name) < (len(known[0]), known[0]):
                        found[id(candidate)] = (name, candidate)
    return dict(sorted(found.values(), key=lambda item: item[0]))


def fingerprint(generator: Any) -> str:
    """A digest of ``generator``'s state; a torch generator's is its seed (reading its state
    would run a torch operation in the zygote)."""
    if isinstance(generator, random.Random):
        state: Any = generator.getstate()
    elif isinstance(generator, np.random.RandomState):
        state = generator.get_state(legacy=False)
    elif isinstance(generator, np.random.Generator):
        state = generator.bit_generator.state
    elif isinstance(generator, np.random.BitGenerator):
        state = generator.state
    else:
        state = generator.initial_seed()
    return hashlib.sha256(pickle.dumps(state)).hexdigest()[:16]


def generator_fingerprints() -> dict[str, str]:
    """:func:`fingerprint` of each of :func:`global_generators`."""
    return {name: fingerprint(generator) for name, generator in global_generators().items()}


#: The generators of the zygote's modules as the zygote holds them (what a child inherits).
ZYGOTE_GENERATORS = generator_fingerprints()


def torch_draws() -> dict[str, Any] | None:
    """What an operator's own app draws from torch's global generator: its seed, ``torch.rand``,
    Opacus's DP-SGD noise (``secure_mode`` off, Opacus's default), a ``Dropout`` mask and a
    shuffled ``DataLoader``'s order; None unless the zygote preloaded torch."""
    if "torch" not in sys.modules:
        return None
    import torch
    from opacus.optimizers.optimizer import _generate_noise
    from torch.utils.data import DataLoader

    dropout = torch.nn.Dropout(p=0.5)  # in training mode, as built
    return {
        "initial_seed": torch.initial_seed(),
        "rand": torch.rand(4).tolist(),
        "opacus_noise": _generate_noise(1.0, torch.zeros(4), secure_mode=False).tolist(),
        "dropout_mask": (dropout(torch.ones(32)) != 0).tolist(),
        "dataloader_order": next(iter(DataLoader(range(16), batch_size=16, shuffle=True))).tolist(),
    }


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
    generators = generator_fingerprints()  # before anything is drawn
    record = {
        "pid": os.getpid(),
        "zygote_generators": ZYGOTE_GENERATORS,
        "generators": generators,
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
    record["torch"] = torch_draws()
    out = Path(os.environ["WARM_PROBE_DIR"]) / f"{token}.json"
    atexit.register(_record_exit, out.with_suffix(".exit.json"))
    out.with_suffix(".tmp").write_text(json.dumps(record), encoding="utf-8")
    out.with_suffix(".tmp").rename(out)
    sys.exit(0)


app_gate.clientapp_main = probe
