"""Process-wide settings for the apps' long-running processes (a Ray actor that serves every
simulated node's messages, the ServerApp's process during a training)."""

from __future__ import annotations

import gc

__all__ = ["freeze_warm_heap", "thaw_heap"]

_frozen = False


def freeze_warm_heap() -> bool:
    """Once per process, after its warm-up: move every object alive now to the garbage
    collector's permanent generation (:func:`gc.freeze`), so that later full collections scan
    only the objects made since. True if this call froze the heap, False if one before did.

    Why: a process that has imported torch, Opacus, Ray and Flower holds about 400,000
    tracked objects; each full collection scanned them all for about 0.25 s, in every Ray
    actor and in the ServerApp's process, twice per 100 FPFL rounds each, and stalled the
    process (and its round) while it ran. Objects frozen here are the long-lived ones (modules,
    data, models); they are still freed by reference counting, only cyclic garbage among them
    is never collected. Called once, never per round: a later call would also freeze the
    garbage made since."""
    global _frozen
    if _frozen:
        return False
    gc.collect()  # what is garbage now is collected, not frozen
    gc.freeze()
    _frozen = True
    return True


def thaw_heap() -> None:
    """Undo :func:`freeze_warm_heap` (:func:`gc.unfreeze`): for a process that goes on after
    the work it froze for (a job run from Python with :mod:`fedparity.server.api`, the
    pipeline's second training); the next :func:`freeze_warm_heap` freezes again."""
    global _frozen
    gc.unfreeze()
    _frozen = False
