"""FPFL on a node (Algorithm 1, ``UserStatistics``): its users, the round's cohort, the clipped
sum of the cohort's statistic vectors and the node's share of the Gaussian noise.

FPFL: Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt Seigel, "Enforcing
fairness in private federated learning via the modified method of differential multipliers",
NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021
(Rodriguez-Galvez et al. 2021).

A node hosts a shard of users (simulation) or one user (a device); the same code serves both.

* **Cohort (Poisson sampling).** Every user of the node joins round ``t`` independently with
  probability ``q = m / K``, drawn *on the node*: the server never learns who took part, and
  the accountant's Poisson-sampling assumption holds exactly
  (:mod:`fedparity.mechanisms.privacy.opacus_accounting`).
* **A fixed workload (no timing channel on sampling).** The cohort's statistics are computed
  over the same number of user slots and rows in every round (:func:`node_workload`): the real
  cohort padded with dummy rows of weight 0 and selected arithmetically, so a round takes as
  long whether its cohort is empty or full; only a cohort beyond the workload (a tail of
  chance at most :data:`WORKLOAD_TAIL_SHARE` of the users' delta over the training) makes more
  work, and the ledger charges that chance (``timing_tail_probability``).
* **Statistics.** :func:`fedparity.clients.fpfl_task.user_statistics` (vectorised, clipped to
  ``C``), or the unclipped sum for the non-private baselines FL and FFL.
* **Noise share (distributed noise).** The node recomputes the noise multiplier ``sigma``
  itself from the run's public parameters (:meth:`FPFLNodeSettings.noise_multiplier`,
  Opacus); it never takes a noise level from the server. With ``n`` nodes in the round and at
  most a fraction ``rho`` (``fpfl-dropout-tolerance``) allowed to drop, each node adds
  ``N(0, C^2 sigma^2 / n_min)``, ``n_min = ceil((1 - rho) n)`` (:func:`noise_share_std`,
  :meth:`FPFLNodeSettings.noise_share_std`; the server reports the same value): any
  ``n_min`` or more surviving shares sum to at least the ``N(0, C^2 sigma^2)`` of
  Algorithm 1 (with all nodes present the variance is over-provisioned by ``n / n_min``).
  Fewer survivors than ``n_min`` and the nodes refuse to unmask the sum
  (:mod:`fedparity.mechanisms.crypto.secure_sum`), so an
  under-noised sum is never readable.

Randomness (cohort and noise) comes from the operating system unless ``fpfl-client-seed`` is
set; a seed makes runs reproducible (and resumable bit for bit) but anyone who knows it can
recompute the cohort and the noise, so a seeded run is **not private**.

The project app's settings and populations from its run config (``node_settings(config)``,
``population(config)``, ...) are in :mod:`fedparity.clients.project.fpfl_node`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from ..mechanisms._deprecated import moved_names
from ..mechanisms.crypto.secure_random import secure_generator
from ..mechanisms.crypto.secure_sum import minimum_survivors, noise_share_std
from ..mechanisms.fpfl.cohort_workload import CohortWorkload, cohort_workload
from ..mechanisms.fpfl.mmdm import CONSTRAINTS, Constraint
from ..mechanisms.privacy.opacus_accounting import AccountantName, calibrate_noise
from ..mechanisms.protocol.fpfl import FPFLRunParameters
from ..mechanisms.validation import check_int
from .fpfl_data import FPFLShard

if TYPE_CHECKING:
    import torch

__all__ = [
    "FPFLNodeSettings",
    "RoundContribution",
    "WORKLOAD_TAIL_SHARE",
    "cohort_contribution",
    "cohort_sum",
    "node_workload",
    "padded_cohort",
    "round_contribution",
    "round_rng",
]

#: ``spawn_key`` tags of the seeded (reproducible, not private) streams.
_COHORT_AND_NOISE_TAG = 41
_CENTRAL_NOISE_TAG = 42
#: The share of the users' delta that a training's workload tails may take, at the worst
#: epsilon the users' budget allows: the tails add ``(1 + e^eps) s`` to a total's delta.
WORKLOAD_TAIL_SHARE = 1e-3


def node_workload(
    shard: FPFLShard,
    sample_rate: float,
    rounds: int,
    *,
    user_epsilon_budget: float,
    user_delta: float,
) -> CohortWorkload:
    """The fixed per-round workload of ``shard`` in a training of ``rounds`` rounds at Poisson
    rate ``sample_rate``: its tails over the whole training add at most
    :data:`WORKLOAD_TAIL_SHARE` ``* user_delta`` to any total within ``user_epsilon_budget``.

    Parameters
    ----------
    shard : FPFLShard
        The node's users (their rows per user is the shard's layout, treated as public like
        the node's number of users).
    sample_rate : float
        ``q = m / K``.
    rounds : int
        ``T``.
    user_epsilon_budget, user_delta : float
        The node policy's ``user-epsilon-budget`` and ``user-delta``.

    Returns
    -------
    CohortWorkload
    """
    try:
        scale = 1.0 + math.exp(user_epsilon_budget)
    except OverflowError:
        scale = math.inf
    per_round = WORKLOAD_TAIL_SHARE * user_delta / (scale * rounds)
    counts = shard.samples_per_user()
    return _workload(counts.tobytes(), float(sample_rate), per_round)


@functools.lru_cache(maxsize=16)
def _workload(counts: bytes, sample_rate: float, tail: float) -> CohortWorkload:
    return cohort_workload(np.frombuffer(counts, dtype=np.int64), sample_rate, tail)


def padded_cohort(
    shard: FPFLShard, cohort: NDArray[np.bool_], workload: CohortWorkload
) -> tuple[FPFLShard, NDArray[np.float64]]:
    """The rows a round computes: the cohort's users in the first slots, dummy rows (copies of
    the shard's first rows) in one extra slot, ``max(workload, cohort)`` user slots and rows in
    all; and the slots' weights (1 for a cohort user, else 0).

    Parameters
    ----------
    shard : FPFLShard
        The node's users.
    cohort : bool array, shape (num_users,)
        Who was sampled.
    workload : CohortWorkload
        The fixed workload (:func:`node_workload`).

    Returns
    -------
    padded : FPFLShard
        ``user_slots + 1`` users (the last holds the dummy rows), ``sample_slots`` rows, or
        more when the cohort is larger.
    weights : float64 array, shape (padded.num_users,)
    """
    members = np.flatnonzero(cohort)
    real_rows = np.flatnonzero(cohort[shard.user_index])
    slots = max(workload.user_slots, members.size)
    rows = max(workload.sample_slots, real_rows.size)
    slot_of = np.full(shard.num_users, slots, dtype=np.int64)
    slot_of[members] = np.arange(members.size, dtype=np.int64)
    dummy = np.arange(rows - real_rows.size, dtype=np.int64) % max(shard.num_samples, 1)
    taken = np.concatenate([real_rows, dummy])
    padded = FPFLShard(
        features=shard.features[taken],
        labels=shard.labels[taken],
        groups=shard.groups[taken],
        user_index=np.concatenate(
            [slot_of[shard.user_index[real_rows]], np.full(dummy.size, slots, dtype=np.int64)]
        ),
        user_ids=np.arange(slots + 1, dtype=np.int64),
        num_groups=shard.num_groups,
        num_classes=shard.num_classes,
    )
    weights = np.zeros(slots + 1)
    weights[: members.size] = 1.0
    return padded, weights


def round_rng(
    client_seed: int | None, stream: int, round_number: int, *, central: bool = False
) -> np.random.Generator:
    """The generator of one round's cohort and noise on node ``stream`` (its partition id),
    or of the server's central noise (``central=True``). When ``client_seed`` is None, a
    cryptographically secure generator keyed from the operating system
    (:func:`~fedparity.mechanisms.crypto.secure_random.secure_generator`); otherwise
    ``SeedSequence(client_seed)`` keyed by (stream, round), so that a resumed run draws
    exactly what the uninterrupted one would have drawn (reproducible, NOT private)."""
    if client_seed is None:
        return secure_generator()
    tag = _CENTRAL_NOISE_TAG if central else _COHORT_AND_NOISE_TAG
    return np.random.default_rng(
        np.random.SeedSequence(client_seed, spawn_key=(tag, stream, round_number))
    )


@dataclass(frozen=True)
class FPFLNodeSettings:
    """What a node needs to take part in FPFL training, set by the node's own app.

    Every privacy-relevant value here is the node's: it recomputes ``sigma`` from them and
    never takes a noise level from the server (only the population size ``K`` and the member
    list come with a round, and the member list is checked).

    Attributes
    ----------
    constraint : "fnr" or "accuracy"
        The fairness constraint whose per-group terms the statistic vector carries.
    cohort_size, rounds : int
        ``m`` (expected users per round; ``q = m / K``) and ``T``.
    clipping_bound : float or None
        ``C``, the per-user L2 bound; None for the unclipped baselines (FL, FFL).
    epsilon : float or None
        User-level epsilon after ``T`` rounds; None adds no noise (non-private baselines).
    delta : float or None
        None: ``1 / K``.
    accountant : "rdp" or "prv"
    distributed_noise : bool
        The node adds its noise share (True) or the server adds central noise (False).
    masking : bool
        The node masks its sum (pairwise-masked secure sum) or sends it in the clear.
    dropout_tolerance : float
        ``rho`` in [0, 1): the shares are sized for ``n_min = ceil((1 - rho) n)`` survivors.
    client_seed : int or None
        None: OS entropy for the cohort and the noise; an integer is reproducible, NOT private.
    fairfed_release_share : float
        ``phi`` in [0, 1): FairFed's per-node release takes this share of ``1 / sigma^2``
        (0: not FairFed; :mod:`fedparity.mechanisms.fpfl.fairfed`).
    """

    constraint: Constraint
    cohort_size: int
    rounds: int
    clipping_bound: float | None
    epsilon: float | None
    delta: float | None = None
    accountant: AccountantName = "rdp"
    distributed_noise: bool = True
    masking: bool = True
    dropout_tolerance: float = 0.2
    client_seed: int | None = None
    fairfed_release_share: float = 0.0

    def __post_init__(self) -> None:
        if self.constraint not in CONSTRAINTS:
            raise ValueError(f"constraint must be one of {', '.join(CONSTRAINTS)}")
        for name in ("cohort_size", "rounds"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.clipping_bound is not None and not (
            math.isfinite(self.clipping_bound) and self.clipping_bound > 0
        ):
            raise ValueError(f"clipping_bound must be > 0 or None, got {self.clipping_bound!r}")
        if self.epsilon is not None:
            if not (math.isfinite(self.epsilon) and self.epsilon > 0):
                raise ValueError(f"epsilon must be > 0 or None, got {self.epsilon!r}")
            if self.clipping_bound is None:
                raise ValueError("epsilon needs a clipping_bound (noise is calibrated to C)")
        if self.delta is not None and not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1) or None, got {self.delta!r}")
        if not 0.0 <= self.dropout_tolerance < 1.0:
            raise ValueError(f"dropout_tolerance must be in [0, 1), got {self.dropout_tolerance!r}")
        if not 0.0 <= self.fairfed_release_share < 1.0:  # NaN fails too
            raise ValueError(
                f"fairfed_release_share must be in [0, 1), got {self.fairfed_release_share!r}"
            )

    def mismatch(self, parameters: FPFLRunParameters) -> str | None:
        """The name of the first run parameter that is not this node's setting (None: all
        agree). ``delta`` None stands for ``1 / K`` of the run's ``K``."""
        delta = self.delta if self.delta is not None else 1.0 / parameters.population_size
        pairs = (
            ("constraint", self.constraint, parameters.constraint),
            ("cohort size", self.cohort_size, parameters.cohort_size),
            ("rounds", self.rounds, parameters.rounds),
            ("clipping bound", self.clipping_bound, parameters.clipping_bound),
            ("epsilon", self.epsilon, parameters.epsilon),
            ("delta", delta if self.epsilon is not None else None, parameters.delta),
            ("accountant", self.accountant, parameters.accountant),
            ("noise placement", self.distributed_noise, parameters.distributed_noise),
            ("secure sum", self.masking, parameters.masking),
            ("dropout tolerance", self.dropout_tolerance, parameters.dropout_tolerance),
            (
                "FairFed release share",
                self.fairfed_release_share,
                parameters.fairfed_release_share,
            ),
        )
        for name, own, run in pairs:
            if own != run:
                return name
        return None

    def noise_multiplier(self, population_size: int) -> float:
        """``sigma`` for (epsilon, delta, m, K, T), recomputed on the node (Opacus); 0 without
        noise."""
        if self.epsilon is None:
            return 0.0
        delta = self.delta if self.delta is not None else 1.0 / population_size
        return calibrate_noise(  # cached: asked again every round
            epsilon=self.epsilon,
            delta=delta,
            cohort_size=self.cohort_size,
            population_size=population_size,
            steps=self.rounds,
            accountant=self.accountant,
        ).noise_multiplier

    def noise_share_std(
        self,
        population_size: int,
        num_nodes: int,
        colluders: int = 0,
        *,
        sigma: float | None = None,
    ) -> float:
        """This node's noise-share std in a round with ``num_nodes`` members:
        ``C sigma / sqrt(n_min - t)`` with distributed noise, else 0.

        ``t`` (``colluders``) nodes may collude with the server and subtract their own shares;
        the ``n_min - t`` honest survivors' shares still sum to the ``N(0, C^2 sigma^2)`` of
        Algorithm 1. A round with ``n_min <= t`` is refused (``ValueError``). ``sigma``: the
        caller's :meth:`noise_multiplier` of ``population_size`` (default: computed here).
        """
        if sigma is None:
            sigma = self.noise_multiplier(population_size)
        if not sigma or not self.distributed_noise:
            return 0.0
        assert self.clipping_bound is not None  # checked in __post_init__
        survivors = minimum_survivors(num_nodes, self.dropout_tolerance)
        if colluders < 0 or survivors <= colluders:
            raise ValueError(
                f"fpfl: {survivors} guaranteed survivor(s) cannot outnumber {colluders} "
                "tolerated colluder(s); refusing to send a noise share"
            )
        return noise_share_std(self.clipping_bound, sigma, survivors - colluders)


def cohort_contribution(
    model: torch.nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    clipping_bound: float | None,
    sample_rate: float,
    noise_share_std: float,
    rng: np.random.Generator,
) -> NDArray[np.float64]:
    """This node's message of one round before secure aggregation, for ``model`` (already
    holding the round's weights): the sum of its cohort users' statistic vectors (clipped to
    ``clipping_bound`` unless None) plus its noise share ``N(0, noise_share_std^2 I)``
    (FPFL Algorithm 1, ``UserStatistics``; Poisson cohort with rate ``sample_rate``)."""
    return round_contribution(
        model,
        shard,
        constraint=constraint,
        clipping_bound=clipping_bound,
        sample_rate=sample_rate,
        noise_share_std=noise_share_std,
        rng=rng,
    ).total


@dataclass(frozen=True, eq=False)
class RoundContribution:
    """A node's round: ``total`` (its scaled clipped sum plus its noise share, for the secure
    sum) and, in a FairFed run, ``release`` (the counting block of the unscaled sum plus its
    own noise; None otherwise)."""

    total: NDArray[np.float64]
    release: NDArray[np.float64] | None = None


def round_contribution(
    model: torch.nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    clipping_bound: float | None,
    sample_rate: float,
    noise_share_std: float,
    rng: np.random.Generator,
    scale: float = 1.0,
    release_std: float | None = None,
    workload: CohortWorkload | None = None,
) -> RoundContribution:
    """The clipped cohort sum ``S`` of :func:`cohort_sum`, and ``scale * S + N(0,
    noise_share_std^2 I)`` for the secure sum; with ``release_std`` (FairFed,
    :mod:`fedparity.mechanisms.fpfl.fairfed`) also ``S[release blocks] + N(0, release_std^2
    I)``, released on its own. ``scale`` in [0, 1] keeps each user's part of the sum within
    ``C``."""
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"scale must be in [0, 1], got {scale!r}")
    for name, value in (("noise_share_std", noise_share_std), ("release_std", release_std or 0.0)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    raw = cohort_sum(
        model,
        shard,
        constraint=constraint,
        clipping_bound=clipping_bound,
        sample_rate=sample_rate,
        rng=rng,
        workload=workload,
    )
    total = scale * raw if scale != 1.0 else raw
    if noise_share_std > 0:
        total = total + rng.normal(0.0, noise_share_std, size=total.shape)
    release = None
    if release_std is not None:
        from ..mechanisms.fpfl.fairfed import release_indices
        from .fpfl_task import statistics_layout

        release = raw[release_indices(statistics_layout(model, shard.num_groups))]
        if release_std > 0:
            release = release + rng.normal(0.0, release_std, size=release.shape)
        release = np.asarray(release, dtype=np.float64)
    return RoundContribution(np.asarray(total, dtype=np.float64), release)


def _draw_cohort(num_users: int, sample_rate: float, rng: np.random.Generator) -> NDArray[np.bool_]:
    """Who joins the round: each user independently with probability ``sample_rate``."""
    return rng.random(num_users) < sample_rate


def cohort_sum(
    model: torch.nn.Module,
    shard: FPFLShard,
    *,
    constraint: Constraint,
    clipping_bound: float | None,
    sample_rate: float,
    rng: np.random.Generator,
    workload: CohortWorkload | None = None,
) -> NDArray[np.float64]:
    """The sum of the node's cohort users' statistic vectors for ``model``, clipped to
    ``clipping_bound`` unless None (Poisson cohort with rate ``sample_rate``, drawn from
    ``rng``), without noise. With ``workload`` (and a clipping bound) the round computes the
    fixed workload of :func:`padded_cohort` whoever was sampled; without, only the cohort
    (its time then shows the cohort's size)."""
    # torch's modules are loaded by the round itself, not by a node's other messages (a
    # deployed SuperNode starts a process for each).
    import torch

    from .fpfl_task import (
        clip_statistics,
        shard_contribution,
        statistics_layout,
        user_statistics,
        zero_nonfinite_rows,
    )

    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    sampled = _draw_cohort(shard.num_users, sample_rate, rng)
    if workload is not None and clipping_bound is not None:
        padded, weights = padded_cohort(shard, sampled, workload)
        vectors = clip_statistics(
            user_statistics(model, padded, constraint=constraint), clipping_bound
        ).vectors  # non-finite rows are zeros, so the weights select exactly
        return np.asarray(torch.from_numpy(weights) @ vectors, dtype=np.float64)
    layout = statistics_layout(model, shard.num_groups)
    cohort = np.flatnonzero(sampled)
    if cohort.size == 0:
        total = np.zeros(layout.size)
    elif clipping_bound is not None:
        total = shard_contribution(
            model,
            shard,
            constraint=constraint,
            clipping_bound=clipping_bound,
            users=cohort,
        ).total
    else:
        total = (
            zero_nonfinite_rows(
                user_statistics(
                    model,
                    shard,
                    constraint=constraint,
                    users=cohort,
                )
            )
            .sum(dim=0)
            .numpy()
        )
    return np.asarray(total, dtype=np.float64)


# The project app's run-config helpers moved to its own package (deprecated here).
__getattr__ = moved_names(
    __name__,
    "fedparity.clients.project.fpfl_node",
    (
        "node_contribution",
        "node_noise_multiplier",
        "node_noise_share_std",
        "node_settings",
        "node_shard",
        "population",
    ),
)
