"""One log line, not a traceback, for a node's refusal with a fixed sentence.

A fedparity handler refuses with an exception whose text is a fixed sentence
(``fixed_text = True``: ``NodeRefusal``, the policy's refusals, ``MessageError``, the CKKS
checks). Flower logs whatever a ClientApp raises with its whole traceback: twice per message in
the simulation engine's process (the Ray actor's traceback as text, then the engine's own), once
with ``exc_info`` in a deployed ``flwr-clientapp``. A holder without its key printed about 270
lines that way in a four-node simulation, the sentence buried in them. :class:`OneLineRefusals`,
on Flower's ``flwr`` logger, turns each such record into the sentence alone and drops the
duplicate; every other record, a traceback of any other exception included, passes unchanged.
Logging only (the standard library, no Flower import): both ends install it
(:func:`install_refusal_filter`), the ClientApp's process and the ServerApp's, which in Flower's
simulation is the process that logs its nodes' errors.
"""

from __future__ import annotations

import logging
import re

__all__ = ["OneLineRefusals", "install_refusal_filter"]

#: The last line of a traceback whose exception is one of fedparity's (module path, class, text).
_FEDPARITY_EXCEPTION = re.compile(r"^fedparity\.[\w.]+\.(?P<name>\w+): (?P<text>.+)$", re.M)
FLOWER_LOGGER = "flwr"


class OneLineRefusals(logging.Filter):
    """Rewrites Flower's ERROR records of a fedparity fixed-sentence refusal to one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            # a ClientApp's only: the ServerApp's own errors have their handler (server.app)
            if not getattr(type(error), "fixed_text", False) or not record.getMessage().startswith(
                "ClientApp"
            ):
                return True
            record.msg, record.args = "a ClientApp refused: %s", (str(error),)
            record.exc_info, record.exc_text = None, None
            return True
        text = record.getMessage()
        if "\n" not in text:
            return True
        found = list(_FEDPARITY_EXCEPTION.finditer(text))
        if not found or not _is_fixed(found[-1]["name"]):
            return True
        if text.startswith("Traceback"):
            return False  # the engine's copy of the record before it
        record.msg, record.args = "a ClientApp refused: %s", (found[-1]["text"],)
        return True


def _is_fixed(name: str) -> bool:
    """Whether ``name`` is one of fedparity's exception classes with a fixed text (by name:
    the record holds text only)."""
    return name in _fixed_names()


def _fixed_names() -> frozenset[str]:
    found: set[str] = set()
    stack: list[type] = [BaseException]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("fedparity.") and getattr(cls, "fixed_text", False):
            found.add(cls.__name__)
    return frozenset(found)


def install_refusal_filter() -> None:
    """Put :class:`OneLineRefusals` on Flower's logger (once per process)."""
    logger = logging.getLogger(FLOWER_LOGGER)
    if not any(isinstance(item, OneLineRefusals) for item in logger.filters):
        logger.addFilter(OneLineRefusals())
