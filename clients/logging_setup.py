"""Known, harmless noise of the apps' runtime, silenced narrowly and in one place.

Both apps call :func:`quiet_known_noise` when they are imported (the ServerApp's process, the
simulation's driver before it starts Ray, every Ray worker and ``flwr-clientapp`` process):

* Flower's console handler colours its level names unconditionally; these processes write to
  a pipe (Flower uploads it to ``flwr run --stream`` and ``flwr log``, which print it as it
  is), so the colour codes are switched off unless the process's stderr is a terminal:
  redirected logs hold no escape codes;
* warnings in :data:`HARMLESS_WARNINGS`, each matched by the start of its message *and* its
  category (any other warning of the same library still shows);
* Flower log records in :data:`HARMLESS_FLOWER_RECORDS`, matched by their exact format string
  and level on the ``flwr`` logger.

The FedAvg rounds of a job are wrapped in :func:`quiet_strategy_banner`, which keeps
Flower's per-round lines and drops the ~30-line configuration banner and "Final results"
dump that ``Strategy.start`` logs around them (the job prints its own results).

Opacus' ``logging.basicConfig`` (a root handler that printed every Flower line twice) is
handled where Opacus is imported, the only place:
``fedparity.mechanisms.privacy.opacus_accounting``.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from flwr.common.logger import update_console_handler

__all__ = [
    "HARMLESS_FLOWER_RECORDS",
    "HARMLESS_WARNINGS",
    "quiet_known_noise",
    "quiet_strategy_banner",
    "warnings_once",
]

FLOWER_LOGGER = "flwr"

#: (start of the message, category, why it is harmless).
HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (
        "Tip: In future versions of Ray, Ray will no longer override accelerator",
        FutureWarning,
        "ray.init's notice about a future default for GPU-less workers; the simulation "
        "asks for no GPU and does not depend on it",
    ),
)

#: (format string, level) of Flower records that say nothing to a user.
HARMLESS_FLOWER_RECORDS: frozenset[tuple[str, int]] = frozenset(
    {
        # Each Ray worker of the simulation, when Flower ends it at the end of every run.
        ("Manually terminating %s", logging.WARNING),
        # FedAvg built without federated evaluation on purpose (fraction_evaluate=0.0).
        ("fraction_evaluate is set to 0.0. Federated evaluation will be skipped.", logging.WARNING),
    }
)

#: Format strings of ``Strategy.start`` that open and close its banners (flwr 1.41).
_BANNER_START = "Starting %s strategy:"
_ROUND_START = "[ROUND %s/%s]"
_RESULTS_START = "Final results:"


class _DropHarmlessRecords(logging.Filter):
    """Drops the records of :data:`HARMLESS_FLOWER_RECORDS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.msg, record.levelno) not in HARMLESS_FLOWER_RECORDS


class _DropStrategyBanner(logging.Filter):
    """Drops INFO records of ``Strategy.start`` from its opening line to the first round,
    from "Final results:" on, and its blank lines; keeps every WARNING and above."""

    def __init__(self) -> None:
        super().__init__()
        self._in_banner = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        if record.msg in (_BANNER_START, _RESULTS_START):
            self._in_banner = True
            return False
        if record.msg == _ROUND_START:
            self._in_banner = False
        return not self._in_banner and record.msg != ""


def quiet_known_noise() -> None:
    """Install the warning filters and the Flower record filter, and colour Flower's log levels
    only on a terminal (idempotent)."""
    update_console_handler(colored=sys.stderr.isatty())
    for message, category, _why in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    logger = logging.getLogger(FLOWER_LOGGER)
    if not any(isinstance(item, _DropHarmlessRecords) for item in logger.filters):
        logger.addFilter(_DropHarmlessRecords())


@contextmanager
def _flower_filter(item: logging.Filter) -> Iterator[None]:
    """``item`` on Flower's logger while the block runs."""
    logger = logging.getLogger(FLOWER_LOGGER)
    logger.addFilter(item)
    try:
        yield
    finally:
        logger.removeFilter(item)


def quiet_strategy_banner() -> AbstractContextManager[None]:
    """While active, Flower's strategy banner and final-results dump are not logged."""
    return _flower_filter(_DropStrategyBanner())


class _WarningsOnce(logging.Filter):
    """Drops a WARNING record whose text was already logged as a WARNING (the pipeline's two
    trainings gave the same warning twice)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text = record.getMessage()
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


def warnings_once() -> AbstractContextManager[None]:
    """While active (a job's run), each WARNING text reaches the console once; other levels,
    ERROR included, are never dropped."""
    return _flower_filter(_WarningsOnce())
