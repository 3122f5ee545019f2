"""Run a gap mechanism and its estimator over more clients than fit in memory.

Clients arrive in chunks (from a file, a generator, a database cursor); each chunk is
validated, cut into cache-sized blocks, perturbed and summarised at once; only the additive
:class:`~fedparity.mechanisms.ldp.reports.ReportSummary` is kept, so memory stays bounded whatever
the number of clients (10^8 and beyond). The output distribution is the mechanism's; the
sequence of random draws differs from one whole-array call (blocks interleave draws).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..validation import check_clients, check_generator, check_int_at_least
from .calibration import GapMechanismType
from .reports import ReportSummary

#: Clients per block: 2^16 keeps the block's float64 temporaries (512 KiB) in cache.
DEFAULT_BLOCK_SIZE = 1 << 16


def summarize_stream(
    mechanism: GapMechanismType,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> ReportSummary:
    """Perturb every client's (g, v) and return the summary of all reports.

    Parameters
    ----------
    mechanism : RandomizedResponseMechanism or LaplaceMechanism
        The mechanism each client applies.
    chunks : iterable of (groups, values)
        Client chunks; ``values`` on the [-1, 1] scale. A chunk with an invalid group or
        value raises ``ValueError`` before it is perturbed; nothing is released either way
        (the caller only gets the summary at the end).
    rng : numpy.random.Generator
        Source of randomness (explicit, never the global one).
    block_size : int
        Clients per perturbation block.
    """
    block_size = check_int_at_least("block_size", block_size, 1)
    rng = check_generator("rng", rng)
    total = ReportSummary.empty(mechanism.num_groups)
    for groups, values in chunks:
        groups, values = check_clients(groups, values, mechanism.num_groups)
        for start in range(0, groups.shape[0], block_size):
            stop = start + block_size
            total = total.merge(
                mechanism.perturb_and_summarize(
                    groups[start:stop], values[start:stop], rng, validate=False
                )
            )
    return total
