"""Server side: the sum of the valid ciphertexts of one round (the server holds only the
public context).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import tenseal as ts

from .errors import KeyMaterialError, NoValidCiphertextError
from .keys import context_has_secret_key
from .vectors import Rejection, _Invalid, _load_vector, from_array


def add_ciphertexts(
    public_context: ts.Context,
    payloads: Sequence[bytes | np.ndarray],
    *,
    expected_size: int | None = None,
) -> tuple[bytes, list[Rejection]]:
    """Server side: add the valid ciphertexts, reject (never crash on) the others.

    Parameters
    ----------
    public_context
        The server's context; it must not hold a secret key.
    payloads
        Serialized CKKS vectors, as bytes or as uint8 arrays from :func:`to_array`.
    expected_size
        Slot count every vector must have (the server knows the layout; the sum is then
        computed streaming). Default: the most common slot count among the payloads that
        parse (the first one seen on a tie).

    Returns
    -------
    (bytes, list of Rejection)
        The serialized sum of the accepted payloads, and the rejected ones with reasons.
        Accepted = ``len(payloads) - len(rejections)``.

    Raises
    ------
    KeyMaterialError
        ``public_context`` holds a secret key.
    NoValidCiphertextError
        No payload is valid (its ``rejections`` say why).

    Notes
    -----
    A ciphertext encrypted under another secret key with the same parameters is accepted:
    the server cannot detect it. It is caught after decryption by the count slot and the
    magnitude check (:func:`check_count_slot`, :func:`check_magnitude`).
    """

    if context_has_secret_key(public_context):
        raise KeyMaterialError(
            "public_context holds a secret key; the server may only hold the public context"
        )
    rejections: list[Rejection] = []
    pending: list[tuple[int, ts.CKKSVector]] = []  # only while the expected size is unknown
    total: ts.CKKSVector | None = None
    size = expected_size

    def accept(index: int, vector: ts.CKKSVector) -> None:
        nonlocal total
        if vector.size() != size:
            reason = f"slot count {vector.size()} differs from the expected {size}"
            rejections.append(Rejection(index, "size", reason))
        elif total is None:
            total = vector
        else:
            total.add_(vector)

    for index, payload in enumerate(payloads):
        try:
            if isinstance(payload, np.ndarray):
                try:
                    payload = from_array(payload)
                except ValueError as error:
                    raise _Invalid("malformed", str(error)) from None
            vector = _load_vector(public_context, payload)
        except _Invalid as invalid:
            rejections.append(Rejection(index, invalid.kind, invalid.reason))
            continue
        if size is None:
            pending.append((index, vector))
        else:
            accept(index, vector)  # streaming: one ciphertext in memory besides the sum
    if pending:
        size = Counter(vector.size() for _, vector in pending).most_common(1)[0][0]
        for index, vector in pending:
            accept(index, vector)
    if total is None:
        raise NoValidCiphertextError(
            f"none of the {len(payloads)} payloads is a valid ciphertext", rejections
        )
    rejections.sort(key=lambda rejection: rejection.index)
    return total.serialize(), rejections


def sum_ciphertexts(context: ts.Context, payloads: Sequence[bytes], *, expected_size: int) -> bytes:
    """A holder's own recomputation of a sum: every payload must be one fresh CKKS ciphertext
    of ``context``'s parameters with ``expected_size`` slots (any other raises ``ValueError``
    with a fixed sentence: a holder never sums around a bad ciphertext it was sent). Unlike
    :func:`add_ciphertexts` it works with a secret context too; it decrypts nothing.
    """
    if not payloads:
        raise ValueError("no ciphertexts to add")
    total: ts.CKKSVector | None = None
    for payload in payloads:
        try:
            vector = _load_vector(context, payload)
        except _Invalid:
            raise ValueError("a ciphertext of the sum is not a valid ciphertext") from None
        if vector.size() != expected_size:
            raise ValueError("a ciphertext of the sum has the wrong number of slots")
        if total is None:
            total = vector
        else:
            total.add_(vector)
    assert total is not None
    return total.serialize()
