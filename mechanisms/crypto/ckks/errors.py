"""Exceptions of the CKKS layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .vectors import Rejection


class KeyMaterialError(ValueError):
    """Key material is missing, misplaced (a secret key on the server) or malformed."""


class DecryptionCheckError(ValueError):
    """A decrypted sum failed a plausibility check; nothing derived from it may be released."""


class MagnitudeCheckError(DecryptionCheckError):
    """A decrypted value is not finite or exceeds the allowed magnitude."""


class CountSlotError(DecryptionCheckError):
    """The decrypted count slot differs from the number of accepted ciphertexts."""


class ProtocolError(RuntimeError):
    """The protocol cannot complete (too few clients, key holders disagree, ...)."""


class StaleReferenceError(ProtocolError):
    """Round-2 terms refer to a round-1 sum over a different set of clients."""


class NoValidCiphertextError(ProtocolError):
    """Every payload of a round was rejected."""

    def __init__(self, message: str, rejections: Sequence[Rejection]) -> None:
        super().__init__(message)
        self.rejections = tuple(rejections)


# --------------------------------------------------------------------------------------------
# Parameters
