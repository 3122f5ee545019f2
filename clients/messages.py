"""Reading the fields of a server's message on a node: each reader returns the typed value or
raises :class:`MessageError` naming the field, so a hostile or corrupt message is refused with
a clear sentence (never an ``OverflowError`` from ``int(inf)`` or an ``AttributeError``).

What a handler raises reaches the server: Flower sends ``str(type(ex)) + str(ex)`` as the
error reply's reason. :func:`fixed_error_texts` therefore lets only exceptions whose text is a
fixed sentence through (classes with ``fixed_text = True``: :class:`MessageError`,
:class:`NodeRefusal`, the policy's refusals, the CKKS checks); any other exception, whose text
could hold a data value, is logged on the node and replaced by one fixed sentence.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from flwr.app import Message
from flwr.common import log

from ..mechanisms.protocol import SESSION_KEY, MessageError, message_int
from ..mechanisms.protocol.refusal_log import install_refusal_filter
from ..mechanisms.validation import check_int

__all__ = [
    "INTERNAL_ERROR_TEXT",
    "MessageError",
    "NodeRefusal",
    "fixed_error_texts",
    "bytes_field",
    "bytes_list_field",
    "float_field",
    "int_field",
    "int_list_field",
    "session_label",
    "session_state_key",
    "str_field",
]


class NodeRefusal(Exception):
    """The node refuses a request that breaks the protocol's rules. The message is a fixed
    sentence naming the rule, never a value, so it is safe to reach the server."""

    fixed_text = True


#: What the server reads when a handler failed for a reason whose text is not fixed.
INTERNAL_ERROR_TEXT = "the node could not handle this message (the reason is in the node's log)"

Handler = TypeVar("Handler", bound=Callable[..., Any])


def fixed_error_texts(handler: Handler) -> Handler:
    """``handler`` whose exceptions reach the server with fixed texts only (module docstring):
    an exception class without ``fixed_text = True`` is logged here and re-raised as a
    :class:`NodeRefusal` carrying :data:`INTERNAL_ERROR_TEXT`."""

    @functools.wraps(handler)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except Exception as error:
            if getattr(type(error), "fixed_text", False):
                raise
            log(logging.ERROR, "%s failed: %r", getattr(handler, "__name__", "handler"), error)
            raise NodeRefusal(INTERNAL_ERROR_TEXT) from None

    return guarded  # type: ignore[return-value]


# A refusal is one log line, not Flower's traceback (the ClientApp's process).
install_refusal_filter()


def _get(record: Mapping[str, Any], key: str) -> Any:
    try:
        return record[key]
    except (KeyError, TypeError):
        raise MessageError(f"message field {key!r} is missing") from None


def int_field(record: Mapping[str, Any], key: str, *, minimum: int | None = None) -> int:
    """An integer field (an integral float is accepted), at least ``minimum`` if given."""
    return message_int(key, _get(record, key), minimum=minimum)


def int_list_field(record: Mapping[str, Any], key: str) -> list[int]:
    """A list of integers."""
    values = _get(record, key)
    if not isinstance(values, list):
        raise MessageError(f"message field {key!r} must be a list of integers")
    try:
        return [check_int(key, value) for value in values]
    except ValueError:
        raise MessageError(f"message field {key!r} must be a list of integers") from None


def float_field(record: Mapping[str, Any], key: str) -> float:
    """A finite number."""
    value = _get(record, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MessageError(f"message field {key!r} must be a finite number")
    return float(value)


def str_field(record: Mapping[str, Any], key: str) -> str:
    """A string."""
    value = _get(record, key)
    if not isinstance(value, str):
        raise MessageError(f"message field {key!r} must be a string")
    return value


def bytes_field(record: Mapping[str, Any], key: str) -> bytes:
    """A byte string."""
    value = _get(record, key)
    if not isinstance(value, bytes):
        raise MessageError(f"message field {key!r} must be bytes")
    return value


def bytes_list_field(record: Mapping[str, Any], key: str) -> list[bytes]:
    """A list of byte strings."""
    values = _get(record, key)
    if not isinstance(values, list) or not all(isinstance(value, bytes) for value in values):
        raise MessageError(f"message field {key!r} must be a list of byte strings")
    return list(values)


def session_label(msg: Message, allowed: Collection[str]) -> str:
    """The session a protocol message belongs to (record ``SESSION_KEY``, field ``label``;
    absent: ``""``, the run's only session), refused unless the node's own run config defines
    it (``allowed``): the server cannot open sessions, and so trainings or tests, of its own."""
    record = msg.content.config_records.get(SESSION_KEY)
    label = "" if record is None else str_field(record, "label")
    if label not in allowed:
        raise NodeRefusal("this node's run config does not define the message's session")
    return label


def session_state_key(key: str, session: str) -> str:
    """The node-state record ``key`` of ``session`` (``key`` itself for the only session)."""
    return key if not session else f"{key}/{session}"
