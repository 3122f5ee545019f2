"""One-ciphertext messages: encrypt, load and decrypt a vector, and the plausibility checks
(count slot, magnitude) applied after decryption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import tenseal as ts

from .errors import CountSlotError, KeyMaterialError, MagnitudeCheckError
from .keys import context_has_secret_key

# Messages
# --------------------------------------------------------------------------------------------

DEFAULT_MAX_MAGNITUDE = 1e12
DEFAULT_COUNT_TOLERANCE = 1e-3
DEFAULT_AGREEMENT_TOLERANCE = 1e-6
#: Bytes of the plaintext "accepted ciphertexts" count the server sends with a sum.
COUNT_BYTES = 8
NUM_ROUNDS = 3

RejectionKind = Literal["malformed", "parameters", "size"]


@dataclass(frozen=True)
class Rejection:
    """A payload the server did not add, and why."""

    #: Position of the payload in the list given to :func:`add_ciphertexts`.
    index: int
    #: "malformed" (does not parse), "parameters" (not one fresh CKKS ciphertext of the
    #: context's parameters) or "size" (slot count differs from the others).
    kind: RejectionKind
    reason: str


class _Invalid(Exception):
    def __init__(self, kind: RejectionKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def to_array(data: bytes) -> np.ndarray:
    """Serialized bytes as a 1-D uint8 array (for a Flower ``ArrayRecord``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    return np.frombuffer(bytes(data), dtype=np.uint8).copy()


def from_array(array: np.ndarray) -> bytes:
    """The bytes held by a 1-D uint8 array made by :func:`to_array`."""
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        described = (
            f"{array.dtype} array of shape {array.shape}"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        raise ValueError(f"array must be a 1-D uint8 array, got {described}")
    return array.tobytes()


def _as_values(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (found NaN or infinity)")
    return array


def _slot_count(context: ts.Context) -> int:
    return int(context.seal_context().data.first_context_data().parms().poly_modulus_degree()) // 2


def encrypt_vector(context: ts.Context, values: np.ndarray) -> bytes:
    """Encrypt all ``values`` into ONE CKKS ciphertext and serialize it.

    Parameters
    ----------
    context
        Any context with the public key (the secret context of a client works).
    values
        1-D, finite, at most ``poly_modulus_degree / 2`` values.
    """
    import tenseal as ts

    array = _as_values(values, "values")
    slots = _slot_count(context)
    if array.size > slots:
        raise ValueError(f"values must fit one ciphertext ({slots} slots), got {array.size}")
    return ts.ckks_vector(context, array.tolist()).serialize()


def _load_vector(context: ts.Context, data: bytes) -> ts.CKKSVector:
    """Deserialize one fresh CKKS ciphertext of ``context``'s parameters, or raise _Invalid."""
    import tenseal as ts

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _Invalid("malformed", f"payload must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise _Invalid("malformed", "empty payload")
    try:
        vector = ts.ckks_vector_from(context, bytes(data))
    except ValueError as error:
        raise _Invalid("malformed", f"not a serialized CKKS vector ({error})") from None
    except (RuntimeError, TypeError) as error:
        raise _Invalid(
            "parameters", f"not valid under this context's CKKS parameters ({error})"
        ) from None
    ciphertexts = vector.ciphertext()
    if len(ciphertexts) != 1:
        raise _Invalid("parameters", f"expected one ciphertext, got {len(ciphertexts)}")
    ciphertext = ciphertexts[0]
    seal = context.seal_context().data
    if ciphertext.poly_modulus_degree() != seal.first_context_data().parms().poly_modulus_degree():
        raise _Invalid("parameters", "polynomial modulus degree differs from the context's")
    if list(ciphertext.parms_id()) != list(seal.first_parms_id()):
        raise _Invalid("parameters", "not at the context's top modulus level")
    if ciphertext.size() != 2:
        raise _Invalid("parameters", f"ciphertext has {ciphertext.size()} polynomials, not 2")
    if ciphertext.is_transparent():
        raise _Invalid("parameters", "transparent ciphertext (its plaintext is readable)")
    if not math.isclose(ciphertext.scale, float(context.global_scale), rel_tol=1e-9):
        raise _Invalid(
            "parameters",
            f"scale {ciphertext.scale:.6g} differs from the context's {context.global_scale:.6g}",
        )
    size = vector.size()
    if not 1 <= size <= _slot_count(context):
        raise _Invalid("size", f"slot count {size} outside [1, {_slot_count(context)}]")
    return vector


def decrypt_vector(
    context: ts.Context, data: bytes, *, expected_size: int | None = None
) -> np.ndarray:
    """Decrypt one serialized CKKS vector (a client or key holder; needs the secret key).

    Raises
    ------
    KeyMaterialError
        ``context`` has no secret key.
    ValueError
        ``data`` is not one fresh CKKS ciphertext of the context's parameters, or its slot
        count differs from ``expected_size``.
    """
    if not context_has_secret_key(context):
        raise KeyMaterialError("decrypt_vector needs a context with the secret key")
    try:
        vector = _load_vector(context, data)
    except _Invalid as invalid:
        raise ValueError(f"data: {invalid.reason}") from None
    if expected_size is not None and vector.size() != expected_size:
        raise ValueError(f"data holds {vector.size()} values, expected {expected_size}")
    return np.asarray(vector.decrypt(), dtype=np.float64)


def append_count_slot(values: np.ndarray) -> np.ndarray:
    """``values`` followed by the count slot 1.0 (every client appends one)."""
    return np.append(_as_values(values, "values"), 1.0)


def check_magnitude(
    values: np.ndarray, *, max_magnitude: float = DEFAULT_MAX_MAGNITUDE, name: str = "values"
) -> np.ndarray:
    """Return ``values`` if all are finite and at most ``max_magnitude`` in absolute value.

    Raises
    ------
    MagnitudeCheckError
        Otherwise: the sum is corrupted (e.g. a ciphertext under another key was added).
    """
    if not (math.isfinite(max_magnitude) and max_magnitude > 0):
        raise ValueError(f"max_magnitude must be a finite number > 0, got {max_magnitude!r}")
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise MagnitudeCheckError(f"{name}: decrypted values are not finite")
    largest = float(np.max(np.abs(array))) if array.size else 0.0
    if largest > max_magnitude:
        raise MagnitudeCheckError(
            f"{name}: decrypted |value| {largest:.3g} exceeds max_magnitude={max_magnitude:.3g}"
            " (corrupted sum, e.g. a ciphertext under another key)"
        )
    return array


def check_count_slot(
    decrypted: np.ndarray, expected_count: int, *, tolerance: float = DEFAULT_COUNT_TOLERANCE
) -> np.ndarray:
    """Check the last (count) slot of a decrypted sum and return the other slots.

    Parameters
    ----------
    decrypted
        A decrypted sum whose last slot is the count slot.
    expected_count
        Number of ciphertexts the server accepted into the sum.
    tolerance
        Largest allowed ``|count - expected_count|``.

    Raises
    ------
    CountSlotError
        The count differs: the sum contains a ciphertext that is not an honest encryption
        under this key (or the server misreported the count).
    """
    if not (math.isfinite(tolerance) and 0 < tolerance < 0.5):
        raise ValueError(f"tolerance must be in (0, 0.5), got {tolerance!r}")
    array = np.asarray(decrypted, dtype=np.float64)
    if array.ndim != 1 or array.size < 2:
        raise ValueError(f"decrypted must be a 1-D array with a count slot, shape {array.shape}")
    count = float(array[-1])
    if not math.isfinite(count) or abs(count - expected_count) > tolerance:
        raise CountSlotError(
            f"count slot {count:.6g} differs from the {expected_count} accepted ciphertexts "
            f"(tolerance {tolerance})"
        )
    return array[:-1].copy()
