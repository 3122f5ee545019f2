"""Noise flooding of released CKKS decryptions (IND-CPA^D).

A CKKS decryption is approximate: it returns the message plus an error that is a function of
the secret key. Whoever holds a ciphertext and a full-precision decryption of it can solve for
the key (Li and Micciancio, "On the Security of Homomorphic Encryption on Approximate
Numbers", Eurocrypt 2021), and partial or badly flooded decryptions suffice with more queries
(Guo et al., "Key Recovery Attacks on Approximate Homomorphic Encryption with Non-Worst-Case
Noise Flooding Countermeasures", USENIX Security 2024). The FedEvalFair server holds every
ciphertext, so a key holder never releases raw decrypted slots: it adds Gaussian noise whose
standard deviation floods the worst-case decryption error by a statistical-security margin,
then rounds to a grid at that standard deviation (OpenFHE's ``NOISE_FLOODING_DECRYPT``; the
margin is the one of Li, Micciancio, Schultz and Sorrell, "Securing Approximate Homomorphic
Encryption Using Differential Privacy", CRYPTO 2022).

The error, per slot, at the project's parameters (N = 8192, scale 2^40)
-----------------------------------------------------------------------
SEAL encrypts under the public key at the key level and divides by the special prime, so a
fresh ciphertext's decryption error per coefficient is the rounding ``r0 + r1 s`` (``r``
uniform on [-1/2, 1/2], ``s`` uniform ternary) plus the encoding's own rounding: variance
``(2 + 2N/3) / 12`` = 455 at N = 8192. A slot's real part sums N such coefficients with unit
weights ``cos``, so its standard deviation is ``sqrt(N/2 * 455) / 2^40`` = 1.24e-9
(:func:`encryption_noise_std`; measured 1.17e-9 over 13,500 slots), and ``sqrt(k)`` times that
for a sum of k ciphertexts. Double-precision decoding adds up to about ``2^-52`` times the
largest slot (measured 0.3 of that). :func:`decryption_error_bound` takes
:data:`TAIL_SIGMAS` (8) standard deviations of the first and ``2^-50`` times the largest
magnitude for the second, and doubles the sum (the released round-2 terms also depend, very
weakly, on the holders' decryption of the round-1 sum).

The margin
----------
For released values ``y = m + e + eta`` with ``eta ~ N(0, sigma^2)`` in each of d slots, the
Kullback-Leibler divergence between two keys' output distributions is at most
``d (2B)^2 / (2 sigma^2)``; Li et al. (CRYPTO 2022) show that a divergence of ``2^-lambda``
leaves a key-recovery (search) adversary ``lambda`` bits, so
``sigma = 2^(lambda / 2) sqrt(2 d) B`` (:func:`flooding_std`), lambda =
:data:`STATISTICAL_SECURITY_BITS` = 30 per release, OpenFHE's default. The noise is drawn
from a key derived from the secret key and the transcript of the ciphertexts decrypted
(:func:`keyed_gaussian`): every key holder of a run releases the *same* noisy values (the
server's agreement check still holds), and asking again for the same sums returns the same
noise, so repeated requests cannot be averaged. Divergences add up over releases: a key that
served R releases keeps about ``30 - log2(R)`` bits, which is why ``fedparity keys`` should be
rerun (and the new secret context handed out) after a few hundred test runs.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import TYPE_CHECKING

import numpy as np

from ..secure_random import secure_generator

if TYPE_CHECKING:
    import tenseal as ts

    from .keys import CkksParameters

__all__ = [
    "STATISTICAL_SECURITY_BITS",
    "TAIL_SIGMAS",
    "decryption_error_bound",
    "encryption_noise_std",
    "flood",
    "flood_key",
    "flooding_std",
    "keyed_gaussian",
]

#: Statistical security of one release against key recovery (OpenFHE's default).
STATISTICAL_SECURITY_BITS = 30
#: Standard deviations of the CKKS noise counted in the error bound (exceeded with
#: probability ~1e-15 per slot).
TAIL_SIGMAS = 8.0
#: Relative error of double-precision decoding counted in the bound (4x 2^-52).
DECODING_ERROR = 2.0**-50


def encryption_noise_std(parameters: CkksParameters) -> float:
    """Standard deviation of one fresh ciphertext's decryption error in one slot (value
    units; module docstring). 1.24e-9 at the default parameters."""
    degree = parameters.poly_modulus_degree
    coefficient_variance = (2.0 + 2.0 * degree / 3.0) / 12.0
    return math.sqrt(degree / 2.0 * coefficient_variance) / parameters.global_scale


def decryption_error_bound(
    parameters: CkksParameters, *, num_ciphertexts: int, max_magnitude: float
) -> float:
    """Bound on the error of one decrypted slot of a sum of ``num_ciphertexts`` fresh
    ciphertexts whose largest decrypted value is ``max_magnitude`` (module docstring).

    Examples
    --------
    >>> from fedparity.mechanisms.crypto.ckks import CkksParameters
    >>> f"{decryption_error_bound(CkksParameters(), num_ciphertexts=100, max_magnitude=0):.2e}"
    '1.99e-07'
    """
    if num_ciphertexts < 1:
        raise ValueError(f"num_ciphertexts must be >= 1, got {num_ciphertexts!r}")
    if not (math.isfinite(max_magnitude) and max_magnitude >= 0):
        raise ValueError(f"max_magnitude must be finite and >= 0, got {max_magnitude!r}")
    noise = TAIL_SIGMAS * math.sqrt(num_ciphertexts) * encryption_noise_std(parameters)
    return 2.0 * (noise + DECODING_ERROR * max_magnitude)


def flooding_std(
    error_bound: float, *, num_values: int, security_bits: int = STATISTICAL_SECURITY_BITS
) -> float:
    """``2^(security_bits / 2) sqrt(2 num_values) error_bound``: the noise that floods
    ``num_values`` released slots, each with error at most ``error_bound``.

    Examples
    --------
    >>> round(flooding_std(1e-6, num_values=45), 4)
    0.3109
    """
    if not (math.isfinite(error_bound) and error_bound > 0):
        raise ValueError(f"error_bound must be finite and > 0, got {error_bound!r}")
    if num_values < 1 or security_bits < 1:
        raise ValueError("num_values and security_bits must be >= 1")
    return 2.0 ** (security_bits / 2.0) * math.sqrt(2.0 * num_values) * error_bound


def flood_key(context: ts.Context) -> bytes:
    """A 32-byte key derived from the context's secret key (every holder of the shared secret
    context derives the same one; the server, without the secret key, cannot)."""
    secret = context.serialize(
        save_public_key=False,
        save_secret_key=True,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    return hashlib.sha256(b"fedparity/ckks/flood-key/v1" + secret).digest()


def keyed_gaussian(key: bytes, message: bytes, size: int) -> np.ndarray:
    """``size`` standard normal draws determined by ``key`` and ``message``: the AES-CTR
    generator of :func:`~fedparity.mechanisms.crypto.secure_random.secure_generator` keyed with
    HMAC-SHA256(key, message). Without ``key`` the draws cannot be predicted."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size!r}")
    seed = hmac.new(bytes(key), bytes(message), hashlib.sha256).digest()
    return secure_generator(seed).standard_normal(size)


def flood(values: np.ndarray, *, std: float, key: bytes, message: bytes) -> np.ndarray:
    """``values`` plus keyed Gaussian noise of ``std`` (:func:`keyed_gaussian`), rounded to
    the power-of-two grid just below ``std`` (rounding after the noise is post-processing: it
    hides the low-order digits and costs nothing in security)."""
    array = np.asarray(values, dtype=np.float64)
    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"std must be finite and > 0, got {std!r}")
    noisy = array + std * keyed_gaussian(key, message, array.size).reshape(array.shape)
    grid = 2.0 ** math.floor(math.log2(std))
    return np.round(noisy / grid) * grid
