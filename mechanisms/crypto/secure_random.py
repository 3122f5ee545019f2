"""A cryptographically secure random generator for privacy noise.

NumPy's default bit generator (PCG64) is a statistical generator: its state can be recovered
from enough of its output (Bouillaguet, Martinez and Sauvage, "Practical seed-recovery for the
PCG pseudo-random number generator", IACR ToSC 2020), and every M_L report or noise share
exposes some of that output. Privacy noise therefore comes from :func:`secure_generator`: a
NumPy :class:`~numpy.random.Generator` over randomgen's ``AESCounter`` bit generator (AES-128
in counter mode, hardware AES where the CPU has it), keyed with 128 bits from the operating
system (:func:`os.urandom`). The key never leaves the process and is never derived from
anything a server sends.

Reproducible, seeded noise (simulations that must be re-run bit for bit) uses an ordinary
seeded ``Generator`` instead, and is not private; nodes refuse it unless their policy allows.
"""

from __future__ import annotations

import os

import numpy as np
from randomgen import AESCounter

__all__ = ["is_secure_generator", "secure_generator"]


def secure_generator(key: bytes | None = None) -> np.random.Generator:
    """A new ``Generator`` over AES-128-CTR keyed from the operating system's entropy, or
    with the first 16 bytes of ``key``: a keyed stream that whoever holds the key (and only
    they) can reproduce (e.g. the noise flooding of
    :mod:`fedparity.mechanisms.crypto.ckks.flooding`).
    """
    if key is None:
        material = os.urandom(16)
    elif isinstance(key, (bytes, bytearray)) and len(key) >= 16:
        material = bytes(key[:16])
    else:
        raise ValueError("key must be at least 16 bytes")
    return np.random.Generator(AESCounter(key=int.from_bytes(material, "little")))


def is_secure_generator(rng: np.random.Generator) -> bool:
    """Whether ``rng`` draws from a cryptographically secure bit generator (AES-CTR)."""
    return isinstance(rng, np.random.Generator) and isinstance(rng.bit_generator, AESCounter)
