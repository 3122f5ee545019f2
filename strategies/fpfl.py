"""FPFL on the server: two Flower message exchanges per training round.

FPFL is Algorithm 1 of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021).

Setup (once per run): ``query.fpfl_setup`` collects the nodes' masking public keys (signed
with their identity keys when they have them) and ``query.fpfl_keys`` sends the key table,
which each node checks and pins; the member list is fixed from then on.

Round ``t``: ``query.fpfl_round`` sends the current weights to every member node; each node
samples its cohort users (Poisson, ``q = m / K``), sums their clipped statistic vectors, adds
its noise share and replies with that sum **double-masked**, sealed Shamir shares of its
self-mask and their threshold (:mod:`fedparity.mechanisms.secure_sum`). ``query.fpfl_reveal``
then asks survivors for the shares of the survivors' self-masks and their pair seeds with the
nodes that did not reply, provided enough of them survive for the noise to be complete and for
every survivor's threshold: every survivor when a node dropped (its pair masks need each pair
seed), else only the survivors holding the smallest share indices, as many as the largest
threshold (the shares the seeds are rebuilt from: 8 messages instead of 10 in a round of 10
nodes with t = 8). The server removes every mask and reads only the sum over all survivors.
Otherwise the round is lost (the weights do not move, the round still counts as spent
privacy).

The released sum is split with :class:`fedparity.mechanisms.mmdm.StatisticsLayout`; the updates,
model selection and accounting are done by the caller (:mod:`fedparity.server.fpfl_job`) with
:mod:`fedparity.mechanisms.mmdm` and :mod:`fedparity.mechanisms.dp_accounting`.

``fpfl-secure-sum = "none"`` sends the nodes' (noisy) sums in the clear: for debugging and
for measuring the cost of masking; with distributed noise each node's sum then carries only
its own noise share, which is much less than the run's guarantee (stated in the output).
``fpfl-noise = "central"``: nodes add no noise and the server adds ``N(0, C^2 sigma^2)`` to
the recovered sum (a trusted aggregator).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from ..mechanisms.mmdm import (
    MMDMConfig,
    ModelSelector,
    StatisticsLayout,
    cohort_metrics,
    evaluate_constraints,
    exponential_average,
    mmdm_update,
    privatize_sum,
    sgd_update,
    with_constraint_terms,
)
from ..mechanisms.protocol import (
    FPFL_KEY,
    FPFL_KEYS_MESSAGE_TYPE,
    FPFL_REVEAL_MESSAGE_TYPE,
    FPFL_ROUND_MESSAGE_TYPE,
    FPFL_SETUP_MESSAGE_TYPE,
    METRICS_KEY,
)
from ..mechanisms.secure_random import secure_generator
from ..mechanisms.secure_sum import (
    FixedPointCodec,
    combine_self_seed,
    contribution_codec,
    minimum_survivors,
    noise_share_std,
    unmask_sum,
)
from .replies import LedgerTotals, send_and_receive, session_records

__all__ = [
    "FPFLProtocol",
    "FPFLTraining",
    "FPFLTrainingResult",
    "RoundOutcome",
]


@dataclass
class RoundOutcome:
    """What one round produced.

    ``total`` is the recovered (noisy) sum, or None when the round was lost (``reason``).
    """

    round: int
    total: NDArray[np.float64] | None
    replied: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    rejected: list[tuple[int, str]] = field(default_factory=list)
    reason: str = ""


class FPFLProtocol:
    """Setup and rounds of the FPFL message exchange for one run.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
    node_ids : list[int]
        Nodes that described their data.
    vector_size : int
        Length of the statistic vector (``StatisticsLayout.size``).
    population_size : int
        ``K``: users over all nodes.
    noise_multiplier : float
        ``sigma`` (0 without noise).
    clipping_bound : float or None
        ``C``, the per-user L2 bound; None for the unclipped baselines (FL, FFL).
    masking : bool
        Pairwise-masked secure sum (``fpfl-secure-sum = "masking"``); False sends the nodes'
        sums in the clear.
    distributed_noise : bool
        The nodes add the noise in shares (``fpfl-noise = "distributed"``); False: the
        caller adds central noise to the recovered sum.
    dropout_tolerance : float
        ``rho`` in [0, 1): the fraction of nodes that may drop while the noise shares still
        add up to the accounted noise.
    reply_timeout : float
        Seconds to wait for the nodes' replies to one message.
    session : str, optional
        The label of this training when a run trains more than once (the pipeline:
        ``"fpfl"`` and ``"pfl"``); nodes keep each session's keys and rounds apart and accept
        only the labels their run config defines. ``""``: the run's only training.
    """

    def __init__(
        self,
        grid: Grid,
        *,
        node_ids: list[int],
        vector_size: int,
        population_size: int,
        noise_multiplier: float,
        clipping_bound: float | None,
        masking: bool,
        distributed_noise: bool,
        dropout_tolerance: float,
        reply_timeout: float,
        session: str = "",
    ) -> None:
        self.grid = grid
        self.session = session
        self.clipping_bound = clipping_bound
        self._masking = masking
        self.distributed_noise = distributed_noise
        self.dropout_tolerance = dropout_tolerance
        self.reply_timeout = reply_timeout
        self.members = sorted(node_ids)
        self.vector_size = vector_size
        self.population_size = population_size
        self.noise_multiplier = noise_multiplier
        self.public_keys: dict[int, bytes] = {}
        self.run_salt = secrets.token_bytes(16)
        self.setup_failed: list[tuple[int, str]] = []
        #: The largest privacy-ledger totals the nodes reported in their round replies (None
        #: if none did: nodes with fewer users than their ``min-users-for-counts`` send none).
        self.ledger_totals: LedgerTotals | None = None

    # -- setup -----------------------------------------------------------------------------

    @property
    def masking(self) -> bool:
        """Pairwise masking on (``fpfl-secure-sum = "masking"``)."""
        return self._masking

    def setup(self) -> None:
        """Collect the nodes' masking public keys (signed when the nodes have identity keys),
        then send the key table, which every node checks and pins for the run; nodes that
        fail either step leave the run."""
        if not self.masking:
            return
        messages = [
            Message(
                content=RecordDict(
                    {
                        FPFL_KEY: ConfigRecord({"run-salt": self.run_salt}),
                        **session_records(self.session),
                    }
                ),
                dst_node_id=node,
                message_type=FPFL_SETUP_MESSAGE_TYPE,
            )
            for node in self.members
        ]
        keys: dict[int, bytes] = {}
        identities: dict[int, tuple[bytes, bytes]] = {}
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in keys:
                continue
            if reply.has_error():
                self.setup_failed.append((node, reply.error.reason))
                continue
            record = reply.content.config_records.get(FPFL_KEY)
            key = record.get("public-key") if record is not None else None
            if not isinstance(key, bytes) or len(key) != 32:
                self.setup_failed.append((node, "malformed setup reply (no 32-byte public key)"))
                continue
            keys[node] = key
            identity, signature = record.get("identity-key"), record.get("signature")
            if isinstance(identity, bytes) and isinstance(signature, bytes):
                identities[node] = (identity, signature)
        self._record_missing(keys, "no setup reply")
        self.members = sorted(keys)
        self._check_members("the setup")
        table: dict[str, object] = {
            "run-salt": self.run_salt,
            "peer-ids": list(self.members),
            "peer-keys": [keys[node] for node in self.members],
        }
        if set(identities) == set(self.members):
            table["identity-keys"] = [identities[node][0] for node in self.members]
            table["signatures"] = [identities[node][1] for node in self.members]
        messages = [
            Message(
                content=RecordDict(
                    {FPFL_KEY: ConfigRecord(table), **session_records(self.session)}  # type: ignore[arg-type]
                ),
                dst_node_id=node,
                message_type=FPFL_KEYS_MESSAGE_TYPE,
            )
            for node in self.members
        ]
        pinned: set[int] = set()
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in pinned:
                continue
            if reply.has_error():
                self.setup_failed.append((node, reply.error.reason))
                continue
            pinned.add(node)
        self._record_missing(pinned, "no reply to the key table")
        self.public_keys = {node: keys[node] for node in sorted(pinned)}
        self.members = sorted(pinned)
        self._check_members("the key table")

    def _record_missing(self, answered: Collection[int], reason: str) -> None:
        failed = {node for node, _ in self.setup_failed}
        self.setup_failed += [
            (node, reason) for node in self.members if node not in answered and node not in failed
        ]

    def _check_members(self, step: str) -> None:
        if len(self.members) < 2:
            raise RuntimeError(
                f"secure aggregation needs at least 2 nodes; {len(self.members)} answered "
                f"{step} ({self.setup_failed})"
            )

    # -- fixed point -----------------------------------------------------------------------

    def min_survivors(self) -> int:
        """n_min: the fewest member nodes whose noise shares add up to the accounted noise
        (:func:`~fedparity.mechanisms.secure_sum.minimum_survivors`, the nodes' own rule)."""
        return minimum_survivors(len(self.members), self.dropout_tolerance)

    def noise_share_std(self) -> float:
        """Std of one node's noise share (distributed noise), by the nodes' own rule
        (:func:`~fedparity.mechanisms.secure_sum.noise_share_std`: ``C sigma / sqrt(n_min)``)."""
        if not self.distributed_noise or self.noise_multiplier == 0:
            return 0.0
        if self.clipping_bound is None:
            raise ValueError("distributed noise needs a clipping bound (clipping_bound is None)")
        return noise_share_std(self.clipping_bound, self.noise_multiplier, self.min_survivors())

    def codec(self) -> FixedPointCodec:
        """The fixed-point encoding of a round, by the nodes' own rule
        (:func:`~fedparity.mechanisms.secure_sum.contribution_codec`; never sent to them)."""
        noise_std = (
            (self.clipping_bound or 0.0) * self.noise_multiplier
            if self.noise_share_std() > 0
            else 0.0
        )
        return contribution_codec(
            per_user_bound=self.clipping_bound,
            population_size=self.population_size,
            noise_std=noise_std,
            num_nodes=len(self.members),
        )

    # -- one round -------------------------------------------------------------------------

    def round_config(self, round_number: int) -> ConfigRecord:
        """Public parameters of round ``round_number``."""
        values: dict[str, object] = {
            "round": round_number,
            "population-size": self.population_size,
            "peer-ids": list(self.members),
        }
        return ConfigRecord(values)  # type: ignore[arg-type]

    def run_round(self, round_number: int, weights: NDArray[np.float64]) -> RoundOutcome:
        """Send the weights, collect the (masked) node sums and recover their total."""
        arrays = ArrayRecord({"weights": Array(np.asarray(weights, dtype=np.float64))})
        settings = self.round_config(round_number)
        messages = [
            Message(
                content=RecordDict(
                    {FPFL_KEY: arrays, "config": settings, **session_records(self.session)}
                ),
                dst_node_id=node,
                message_type=FPFL_ROUND_MESSAGE_TYPE,
            )
            for node in self.members
        ]
        outcome = RoundOutcome(round=round_number, total=None)
        received: dict[int, NDArray] = {}
        sealed: dict[int, tuple[dict[int, bytes], int]] = {}
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in received:
                continue
            if reply.has_error():
                outcome.rejected.append((node, reply.error.reason))
                continue
            vector, reason = self._read_reply(reply)
            try:
                totals = LedgerTotals.from_metrics(
                    reply.content.metric_records.get(METRICS_KEY, {})
                )
            except ValueError as error:
                vector, reason = None, f"malformed reply: {error}"
            if vector is not None and self.masking:
                shares, reason = self._read_shares(reply, node)
                vector = vector if shares is not None else None
            if vector is None:
                outcome.rejected.append((node, reason))
                continue
            received[node] = vector
            if totals is not None:
                self.ledger_totals = totals.merge(self.ledger_totals)
            if self.masking:
                sealed[node] = shares  # type: ignore[assignment]
        outcome.replied = sorted(received)
        outcome.missing = sorted(set(self.members) - set(received))
        if not received:
            outcome.reason = "no node replied"
            return outcome
        if self.noise_share_std() > 0 and len(received) < self.min_survivors():
            # Fewer noise shares than n_min: the sum would carry less noise than the accountant
            # assumes, so it is not recovered (no seeds are asked for). The round is lost and
            # still counts as spent privacy.
            outcome.reason = (
                f"only {len(received)} of {len(self.members)} node(s) replied, fewer than "
                f"n_min = {self.min_survivors()} whose noise shares add up to the accounted "
                "noise: the sum would carry too little noise"
            )
            return outcome
        if not self.masking:
            outcome.total = np.sum([received[node] for node in outcome.replied], axis=0)
            return outcome
        return self._unmask(round_number, received, sealed, outcome)

    def _read_shares(
        self, reply: Message, node: int
    ) -> tuple[tuple[dict[int, bytes], int] | None, str]:
        """``({recipient: sealed share}, threshold)`` of a masked reply: one share for every
        other member, and how many of them rebuild the node's self-mask seed."""
        record = reply.content.config_records.get("shares")
        try:
            recipients = [int(peer) for peer in record["recipients"]]  # type: ignore[index]
            boxes = [bytes(box) for box in record["sealed"]]  # type: ignore[index]
            threshold = record["threshold"]  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return None, "malformed reply: no sealed shares"
        if sorted(recipients) != sorted(set(self.members) - {node}) or len(boxes) != len(
            recipients
        ):
            return None, "malformed reply: the sealed shares are not one per other member"
        if (
            not isinstance(threshold, int)
            or isinstance(threshold, bool)
            or not 2 <= threshold <= len(self.members)
        ):
            return None, (
                f"malformed reply: the share threshold must be an integer in "
                f"[2, {len(self.members)}], got {threshold!r}"
            )
        return (dict(zip(recipients, boxes, strict=True)), threshold), ""

    def _read_reply(self, reply: Message) -> tuple[NDArray | None, str]:
        record = reply.content.array_records.get(FPFL_KEY)
        name, dtype = ("masked", np.uint64) if self.masking else ("sum", np.float64)
        if record is None or name not in record:
            return None, f"malformed reply: no array {name!r} in record {FPFL_KEY!r}"
        try:
            vector = record[name].numpy()
        except Exception as error:  # noqa: BLE001 - any deserialisation failure is a rejection
            return None, f"malformed reply: {error!r}"
        if vector.dtype != dtype or vector.shape != (self.vector_size,):
            return None, (
                f"malformed reply: {name} must be {np.dtype(dtype).name} of shape "
                f"({self.vector_size},), got {vector.dtype} {vector.shape}"
            )
        if dtype == np.float64 and not np.all(np.isfinite(vector)):
            return None, "malformed reply: non-finite values"
        return vector, ""

    def _unmask(
        self,
        round_number: int,
        received: dict[int, NDArray],
        sealed: dict[int, tuple[dict[int, bytes], int]],
        outcome: RoundOutcome,
    ) -> RoundOutcome:
        """The unmask exchange (every masked round): each survivor asked returns the shares of the
        survivors' self-masks and its pair seeds with the dropped nodes; the server rebuilds
        the self-mask seeds (Shamir) and removes every mask (Bonawitz et al. 2017)."""
        survivors = outcome.replied
        dropped = outcome.missing
        thresholds = {node: sealed[node][1] for node in survivors}
        short = sorted(node for node in survivors if thresholds[node] > len(survivors))
        if short:
            # Nobody is asked to reveal anything for a sum that could not be unmasked.
            outcome.reason = (
                f"{len(survivors)} survivor(s) cannot rebuild the self-mask of node(s) {short} "
                f"(share threshold {max(thresholds[node] for node in short)})"
            )
            return outcome
        boxes = {node: sealed[node][0] for node in survivors}
        # Every seed is rebuilt from the shares of the smallest indices, those the first
        # survivors (in the members' order) hold: with nobody dropped, only as many
        # survivors as the largest threshold are asked; a dropped node's pair masks need
        # the pair seed of every survivor, so then all are asked.
        asked = survivors if dropped else survivors[: max(thresholds.values())]
        answers, failures = self._reveal(round_number, survivors, dropped, boxes, asked)
        if failures:
            outcome.reason = (
                f"{len(dropped)} node(s) dropped and the survivors did not unmask the sum "
                f"({failures[0][1]})"
                if dropped
                else f"the survivors did not unmask the sum ({failures[0][1]})"
            )
            outcome.rejected += failures
            return outcome
        revealed = {pair: seed for _, seeds in answers.values() for pair, seed in seeds.items()}
        try:
            self_seeds = {
                owner: combine_self_seed(
                    [shares[owner] for shares, _ in answers.values()], thresholds[owner]
                )
                for owner in survivors
            }
        except ValueError as error:
            outcome.reason = f"the self-masks could not be rebuilt ({error})"
            return outcome
        try:
            masked_total = unmask_sum(
                received,
                revealed,
                round_number,
                self.vector_size,
                participants=self.members,
                min_survivors=min(2, len(self.members)),
                self_seeds=self_seeds,
            )
            outcome.total = self.codec().decode(masked_total)
        except ValueError as error:
            outcome.reason = f"the unmasked sum is not a sum of encodings ({error})"
        return outcome

    def _reveal(
        self,
        round_number: int,
        survivors: list[int],
        dropped: list[int],
        sealed: dict[int, dict[int, bytes]],
        asked: list[int],
    ) -> tuple[
        dict[int, tuple[dict[int, bytes], dict[tuple[int, int], bytes]]], list[tuple[int, str]]
    ]:
        """``{survivor: ({owner: self-mask share}, {(survivor, dropped): pair seed})}`` of the
        ``asked`` survivors, and those of them that failed to answer."""
        messages = []
        for node in asked:
            senders = [peer for peer in survivors if peer != node]
            settings = ConfigRecord(
                {
                    "round": round_number,
                    "survivors": list(survivors),
                    "dropped": list(dropped),
                    "share-senders": senders,
                    "shares": [sealed[peer][node] for peer in senders],
                }
            )
            messages.append(
                Message(
                    content=RecordDict({FPFL_KEY: settings, **session_records(self.session)}),
                    dst_node_id=node,
                    message_type=FPFL_REVEAL_MESSAGE_TYPE,
                )
            )
        answers: dict[int, tuple[dict[int, bytes], dict[tuple[int, int], bytes]]] = {}
        failures: list[tuple[int, str]] = []
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in asked or node in answers:
                continue
            if reply.has_error():
                failures.append((node, f"unmask refused or failed: {reply.error.reason}"))
                continue
            record = reply.content.config_records.get(FPFL_KEY)
            try:
                owners = [int(owner) for owner in record["share-owners"]]  # type: ignore[index]
                shares = [bytes(share) for share in record["self-shares"]]  # type: ignore[index]
                peers = [int(peer) for peer in record["dropped"]]  # type: ignore[index]
                seeds = [bytes(seed) for seed in record["seeds"]]  # type: ignore[index]
            except (KeyError, TypeError, ValueError) as error:
                failures.append((node, f"malformed unmask reply: {error!r}"))
                continue
            if (
                sorted(owners) != sorted(survivors)
                or len(shares) != len(owners)
                or sorted(peers) != sorted(dropped)
                or len(seeds) != len(peers)
            ):
                failures.append((node, "malformed unmask reply: wrong owners or peers"))
                continue
            answers[node] = (
                dict(zip(owners, shares, strict=True)),
                {(node, peer): seed for peer, seed in zip(peers, seeds, strict=True)},
            )
        failures += [(node, "no unmask reply") for node in asked if node not in answers]
        if failures:
            log(logging.WARNING, "FPFL round %d: unmasking failed: %s", round_number, failures)
        return answers, failures


# -- training ------------------------------------------------------------------------------


@dataclass
class FPFLTrainingResult:
    """What :meth:`FPFLTraining.start` produced: the final weights and multipliers, the round
    the selected model comes from (None: no round released), its weights, and one history
    entry per round."""

    weights: NDArray[np.float64]
    multipliers: NDArray[np.float64]
    selected_round: int | None
    selected_weights: NDArray[np.float64]
    history: list[dict[str, Any]]


class FPFLTraining:
    """The server's training loop of FPFL (Rodriguez-Galvez et al. 2021, Algorithm 1): each
    round releases the (noisy, masked) sum of the cohort's statistic vectors through an
    :class:`FPFLProtocol`, and the server takes an MMDM step (FPFL Eq. 10; FFL, FPFL) or a
    FederatedSGD step (FL, PFL) and keeps the best model on cohort statistics (Section 4.1).

    Parameters
    ----------
    layout : StatisticsLayout
        How the statistic vector splits (``statistics_layout(model, num_groups)``).
    weights : array
        The initial flat weights (``get_flat_parameters(model)``).
    mmdm : MMDMConfig
        Step sizes, damping, tolerance ``alpha`` and the constraint's activation.
    use_mmdm : bool
        MMDM updates with the fairness constraint (True) or plain FederatedSGD (False).
    smoothing : float
        ``beta`` in [0, 1): the constraint terms and the selection read an exponential moving
        average of the released sums (0: this round's sum).
    require_fair_selection : bool or None
        The selector prefers models fair on their cohort (default: ``use_mmdm``).
    central_noise_multiplier : float
        ``sigma`` of central noise the server adds to each recovered sum (0: none, e.g. with
        the nodes' distributed noise); needs ``clipping_bound``.
    clipping_bound : float or None
        ``C`` (for central noise).
    central_noise_rng : callable, optional
        ``central_noise_rng(round) -> numpy Generator`` (default: OS entropy).
    """

    def __init__(
        self,
        layout: StatisticsLayout,
        weights: NDArray[np.floating],
        *,
        mmdm: MMDMConfig,
        use_mmdm: bool,
        smoothing: float = 0.0,
        require_fair_selection: bool | None = None,
        central_noise_multiplier: float = 0.0,
        clipping_bound: float | None = None,
        central_noise_rng: Callable[[int], np.random.Generator] | None = None,
    ) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if central_noise_multiplier < 0:
            raise ValueError(
                f"central_noise_multiplier must be >= 0, got {central_noise_multiplier!r}"
            )
        if central_noise_multiplier and clipping_bound is None:
            raise ValueError("central noise needs a clipping_bound")
        self.layout = layout
        self.weights = np.asarray(weights, dtype=np.float64)
        self.multipliers = np.zeros(layout.num_groups)
        self.mmdm = mmdm
        self.use_mmdm = use_mmdm
        self.smoothing = float(smoothing)
        self.smoothed_total: NDArray[np.float64] | None = None
        fair = use_mmdm if require_fair_selection is None else require_fair_selection
        self.selector = ModelSelector(require_fair=fair)
        self.central_noise_multiplier = float(central_noise_multiplier)
        self.clipping_bound = clipping_bound
        self.central_noise_rng = central_noise_rng

    def update(self, round_number: int, total: NDArray[np.floating]) -> dict[str, Any]:
        """One step from round ``round_number``'s released sum (the statistics of the weights
        sent in that round); returns the round's cohort metrics for the history."""
        alpha, min_count = self.mmdm.alpha, self.mmdm.min_count
        if self.central_noise_multiplier:
            rng = (
                secure_generator()
                if self.central_noise_rng is None
                else self.central_noise_rng(round_number)
            )
            total = privatize_sum(
                total,
                clipping_bound=self.clipping_bound,  # type: ignore[arg-type]
                noise_multiplier=self.central_noise_multiplier,
                rng=rng,
            ).values
        stats = self.layout.split(total)
        raw_metrics = cohort_metrics(stats, alpha, min_count=min_count)
        # Selection and the constraint terms read the smoothed sums (smoothing > 0) or this
        # round's sum; the loss gradient always comes from this round's sum.
        smoothed = stats
        if self.smoothing:
            self.smoothed_total = exponential_average(self.smoothed_total, total, self.smoothing)
            smoothed = self.layout.split(self.smoothed_total)
        metrics = cohort_metrics(smoothed, alpha, min_count=min_count)
        self.selector.consider(round_number, self.weights, metrics)
        constraints = evaluate_constraints(smoothed, alpha, min_count=min_count)
        if self.use_mmdm:
            step = mmdm_update(
                self.weights, self.multipliers, with_constraint_terms(stats, smoothed), self.mmdm
            )
            self.weights, self.multipliers = step.weights, step.multipliers
        else:
            self.weights = sgd_update(
                self.weights, stats, self.mmdm.learning_rate, min_count=min_count
            )
        entry: dict[str, Any] = {
            "cohort_loss": _finite(stats.loss_sum / max(stats.num_samples, min_count)),
            "cohort_accuracy": _finite(raw_metrics.accuracy),
            "cohort_gap": _finite(raw_metrics.gap),
            "group_error_rates": [_finite(r) for r in raw_metrics.group_error_rates],
            "surrogate_gap": _finite(constraints.max_gap),
            "cohort_size_noisy": _finite(stats.num_samples),
        }
        if self.smoothing:
            entry["smoothed_cohort_accuracy"] = _finite(metrics.accuracy)
            entry["smoothed_cohort_gap"] = _finite(metrics.gap)
        return entry

    def start(
        self, protocol: FPFLProtocol, num_rounds: int, *, first_round: int = 1
    ) -> FPFLTrainingResult:
        """Set the protocol up (if not yet) and train rounds ``first_round .. num_rounds``;
        a lost round leaves the model as it was (and still counts as spent privacy)."""
        if not protocol.public_keys and protocol.masking:
            protocol.setup()
        history: list[dict[str, Any]] = []
        for round_number in range(first_round, num_rounds + 1):
            outcome = protocol.run_round(round_number, self.weights)
            entry: dict[str, Any] = {"round": round_number, "replied": len(outcome.replied)}
            if outcome.total is None:
                entry["lost"] = outcome.reason
            else:
                entry.update(self.update(round_number, outcome.total))
            entry["multipliers"] = [float(m) for m in self.multipliers]
            history.append(entry)
        best = self.selector.best
        return FPFLTrainingResult(
            weights=self.weights,
            multipliers=self.multipliers,
            selected_round=None if best is None else best.round,
            selected_weights=self.weights if best is None else best.weights,
            history=history,
        )


def _finite(value: float) -> float | None:
    """A JSON-safe number: None for NaN or infinity."""
    number = float(value)
    return number if np.isfinite(number) else None
