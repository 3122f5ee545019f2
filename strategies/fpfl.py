"""FPFL on the server: two Flower message exchanges per training round (three when a node
dropped).

FPFL is Algorithm 1 of Borja Rodriguez-Galvez, Filip Granqvist, Rogier van Dalen and Matt
Seigel, "Enforcing fairness in private federated learning via the modified method of
differential multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning,
arXiv:2109.08604, 2021 (Rodriguez-Galvez et al. 2021).

Setup (once per run): ``query.fpfl_setup`` proposes the run's parameters
(:class:`~fedparity.mechanisms.protocol.fpfl.FPFLRunParameters`: ``K``, ``m``, ``T``,
epsilon, delta, sigma, ``C``, rho, ...), which each node checks against its own settings and
policy, and collects the nodes' masking public keys (signed, with the parameters' digest, by
their identity keys when they have them); ``query.fpfl_keys`` sends the member table, which
each node checks and pins with the run digest: the members, the parameters and the keys are
fixed from then on, and every round names that digest (the messages:
:mod:`fedparity.mechanisms.protocol.fpfl`).

Round ``t``: ``query.fpfl_round`` sends the current weights to every member node; each node
samples its cohort users (Poisson, ``q = m / K``), sums their clipped statistic vectors, adds
its noise share and replies with that sum **double-masked**, sealed Shamir shares of its
self-mask and their threshold (:mod:`fedparity.mechanisms.crypto.secure_sum`). When a node dropped,
``query.fpfl_confirm`` first asks every survivor to attest the view (survivors, dropped): a
node reveals only for a view enough members attested. ``query.fpfl_reveal`` then asks
survivors for the shares of the survivors' self-masks and their pair seeds with the
nodes that did not reply, provided enough of them survive for the noise to be complete and for
every survivor's threshold: every survivor when a node dropped (its pair masks need each pair
seed), else only the survivors holding the smallest share indices, as many as the largest
threshold (the shares the seeds are rebuilt from: 8 messages instead of 10 in a round of 10
nodes with t = 8). The server removes every mask and reads only the sum over all survivors.
Otherwise the round is lost (the weights do not move, the round still counts as spent
privacy).

The released sum is split with :class:`fedparity.mechanisms.fpfl.mmdm.StatisticsLayout`;
:class:`FPFLTraining` takes the updates (:mod:`fedparity.mechanisms.fpfl.mmdm`) and selects the
model, in the one training loop of the library and of the FPFL job (:meth:`FPFLTraining.start`). Its
observers (:mod:`fedparity.strategies.fpfl_observers`) keep the durable release ledger and the
checkpoint (by default), and stop a training whose rounds would be lost.

``fpfl-secure-sum = "none"`` sends the nodes' (noisy) sums in the clear: for debugging and
for measuring the cost of masking; with distributed noise each node's sum then carries only
its own noise share, which is much less than the run's guarantee (stated in the output).
``fpfl-noise = "central"``: nodes add no noise and the server adds ``N(0, C^2 sigma^2)`` to
the recovered sum (a trusted aggregator).
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from ..mechanisms.crypto.secure_random import secure_generator
from ..mechanisms.crypto.secure_sum import (
    FixedPointCodec,
    combine_self_seed,
    contribution_codec,
    minimum_survivors,
    noise_share_std,
    unmask_sum,
)
from ..mechanisms.fpfl.fairfed import (
    FairFedConfig,
    fairfed_step,
    initial_node_weights,
    node_scales,
    release_size,
    release_statistics,
)
from ..mechanisms.fpfl.fedfb import FedFBConfig, fedfb_update
from ..mechanisms.fpfl.mmdm import (
    AggregateStatistics,
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
    FPFL_CONFIRM_MESSAGE_TYPE,
    FPFL_KEY,
    FPFL_KEYS_MESSAGE_TYPE,
    FPFL_REVEAL_MESSAGE_TYPE,
    FPFL_ROUND_MESSAGE_TYPE,
    FPFL_SETUP_MESSAGE_TYPE,
    METRICS_KEY,
    MessageError,
)
from ..mechanisms.protocol.fpfl import (
    WEIGHTS_ARRAY,
    FPFLConfirmReply,
    FPFLConfirmRequest,
    FPFLKeysReply,
    FPFLKeyTable,
    FPFLRevealReply,
    FPFLRevealRequest,
    FPFLRoundReply,
    FPFLRoundRequest,
    FPFLRunParameters,
    FPFLSetupReply,
    FPFLSetupRequest,
)
from ..mechanisms.validation import check_int_at_least
from .fpfl_observers import DurableTraining, FPFLObserver
from .replies import LedgerTotals, NodeLedgerReports, send_and_receive, session_records

__all__ = [
    "FPFLProtocol",
    "FPFLRunParameters",
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
    #: FairFed: each replying node's own noisy statistics (empty otherwise).
    releases: dict[int, NDArray[np.float64]] = field(default_factory=dict)
    replied: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    # (node, reason); the reason is None for a Flower error without one
    rejected: list[tuple[int, str | None]] = field(default_factory=list)
    reason: str = ""


class FPFLProtocol:
    """Setup and rounds of the FPFL message exchange for one run.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
    node_ids : list[int]
        Nodes that described their data.
    parameters : FPFLRunParameters
        What the run agrees on (``K``, ``m``, ``T``, epsilon, delta, sigma, ``C``, rho, the
        constraint, the groups and vector size, the session): sent at setup, checked by every
        node against its own settings and policy, and pinned for the run.
    reply_timeout : float
        Seconds to wait for the nodes' replies to one message.

    The keyword form of earlier versions (``vector_size``, ``population_size``,
    ``noise_multiplier``, ``clipping_bound``, ``masking``, ``distributed_noise``,
    ``dropout_tolerance``, ``session``) is still accepted with a ``DeprecationWarning`` when the
    values the nodes now check are given too (``cohort_size``, ``rounds``, ``epsilon``,
    ``delta``, ``constraint``, ``num_groups``; ``accountant`` defaults to ``"rdp"``).
    """

    def __init__(
        self,
        grid: Grid,
        *,
        node_ids: list[int],
        reply_timeout: float,
        parameters: FPFLRunParameters | None = None,
        **legacy: Any,
    ) -> None:
        if parameters is None:
            parameters = _legacy_parameters(legacy)
        elif legacy:
            raise TypeError(
                f"FPFLProtocol takes parameters= or the keyword form, not both: {sorted(legacy)}"
            )
        if not isinstance(parameters, FPFLRunParameters):
            raise TypeError(
                f"parameters must be FPFLRunParameters, got {type(parameters).__name__}"
            )
        self.grid = grid
        self.parameters = parameters
        self.reply_timeout = reply_timeout
        self.members = sorted(node_ids)
        self.public_keys: dict[int, bytes] = {}
        self.run_salt = secrets.token_bytes(16)
        self.table: FPFLKeyTable | None = None
        self.setup_failed: list[tuple[int, str | None]] = []  # reason None: Flower gave none
        #: What each node reported of its privacy ledger in its round replies (nodes with
        #: fewer users than their ``min-users-for-counts`` send nothing).
        self.ledgers = NodeLedgerReports()

    @property
    def ledger_totals(self) -> LedgerTotals | None:
        """The largest privacy-ledger totals the nodes reported in their round replies (None
        if none did)."""
        return self.ledgers.merged()

    # -- the run's values -------------------------------------------------------------------

    @property
    def session(self) -> str:
        return self.parameters.session

    @property
    def masking(self) -> bool:
        """Pairwise masking on (``fpfl-secure-sum = "masking"``)."""
        return self.parameters.masking

    @property
    def distributed_noise(self) -> bool:
        return self.parameters.distributed_noise

    @property
    def dropout_tolerance(self) -> float:
        return self.parameters.dropout_tolerance

    @property
    def clipping_bound(self) -> float | None:
        return self.parameters.clipping_bound

    @property
    def noise_multiplier(self) -> float:
        return self.parameters.noise_multiplier

    @property
    def population_size(self) -> int:
        return self.parameters.population_size

    @property
    def vector_size(self) -> int:
        return self.parameters.vector_size

    @property
    def run_digest(self) -> bytes:
        """The digest every node pinned (after :meth:`setup`)."""
        if self.table is None:
            raise RuntimeError("the protocol is not set up (call setup() first)")
        return self.table.run_digest()

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Propose the run parameters and collect the nodes' masking public keys (signed when
        the nodes have identity keys), then send the member table, which every node checks and
        pins for the run; nodes that refuse the parameters leave the run. A node that fails to
        pin the table stays a member that never replies (dropped in every round)."""
        request = FPFLSetupRequest(self.run_salt, self.parameters)
        messages = [
            self._message(
                FPFL_SETUP_MESSAGE_TYPE, node, {FPFL_KEY: ConfigRecord(request.to_fields())}
            )
            for node in self.members
        ]
        digest = self.parameters.digest()
        accepted: dict[int, FPFLSetupReply] = {}
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in accepted:
                continue
            if reply.has_error():
                self.setup_failed.append((node, reply.error.reason))
                continue
            try:
                answer = FPFLSetupReply.from_fields(reply.content.config_records.get(FPFL_KEY, {}))
            except MessageError as error:
                self.setup_failed.append((node, f"malformed setup reply: {error}"))
                continue
            if answer.parameters_digest != digest:
                self.setup_failed.append((node, "the node accepted other run parameters"))
                continue
            if self.masking and answer.public_key is None:
                self.setup_failed.append((node, "malformed setup reply (no 32-byte public key)"))
                continue
            accepted[node] = answer
        self._record_missing(accepted, "no setup reply")
        self.members = sorted(accepted)
        self._check_members("the setup")
        table = FPFLKeyTable(
            run_salt=self.run_salt, parameters_digest=digest, members=tuple(self.members)
        )
        if self.masking:
            signed = all(accepted[node].signature is not None for node in self.members)
            codec = self._codec(len(self.members))
            table = FPFLKeyTable(
                run_salt=self.run_salt,
                parameters_digest=digest,
                members=tuple(self.members),
                public_keys=tuple(accepted[node].public_key for node in self.members),  # type: ignore[misc]
                identity_keys=(
                    tuple(accepted[node].identity_key or b"" for node in self.members)
                    if signed
                    else ()
                ),
                signatures=(
                    tuple(accepted[node].signature or b"" for node in self.members)
                    if signed
                    else ()
                ),
                codec_clip_range=codec.clip_range,
                codec_scale=codec.scale,
            )
        self.table = table
        messages = [
            self._message(FPFL_KEYS_MESSAGE_TYPE, node, {FPFL_KEY: ConfigRecord(table.to_fields())})
            for node in self.members
        ]
        run_digest = table.run_digest()
        pinned: set[int] = set()
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in pinned:
                continue
            if reply.has_error():
                self.setup_failed.append((node, reply.error.reason))
                continue
            try:
                keys_answer = FPFLKeysReply.from_fields(
                    reply.content.config_records.get(FPFL_KEY, {})
                )
            except MessageError as error:
                self.setup_failed.append((node, f"malformed reply to the key table: {error}"))
                continue
            if keys_answer.run_digest != run_digest:
                self.setup_failed.append((node, "the node pinned another member table"))
                continue
            pinned.add(node)
        self._record_missing(pinned, "no reply to the key table")
        if self.masking:
            self.public_keys = {node: accepted[node].public_key for node in sorted(pinned)}  # type: ignore[misc]
        if len(pinned) < (2 if self.masking else 1):
            raise RuntimeError(
                f"secure aggregation needs at least 2 nodes; {len(pinned)} pinned the member "
                f"table ({self.setup_failed})"
            )

    def _message(self, message_type: str, node: int, records: dict[str, Any]) -> Message:
        return Message(
            content=RecordDict({**records, **session_records(self.session)}),
            dst_node_id=node,
            message_type=message_type,
        )

    def _record_missing(self, answered: Collection[int], reason: str) -> None:
        failed = {node for node, _ in self.setup_failed}
        self.setup_failed += [
            (node, reason) for node in self.members if node not in answered and node not in failed
        ]

    def _check_members(self, step: str) -> None:
        if len(self.members) < (2 if self.masking else 1):
            raise RuntimeError(
                f"secure aggregation needs at least 2 nodes; {len(self.members)} answered "
                f"{step} ({self.setup_failed})"
            )

    # -- fixed point -----------------------------------------------------------------------

    def min_survivors(self) -> int:
        """n_min: the fewest member nodes whose noise shares add up to the accounted noise
        (:func:`~fedparity.mechanisms.crypto.secure_sum.minimum_survivors`, the nodes' own rule)."""
        return minimum_survivors(len(self.members), self.dropout_tolerance)

    def noise_share_std(self) -> float:
        """Std of one node's noise share (distributed noise), by the nodes' own rule
        (:func:`~fedparity.mechanisms.crypto.secure_sum.noise_share_std`:
        ``C sigma / sqrt(n_min)``)."""
        if not self.parameters.noisy_shares:
            return 0.0
        if self.clipping_bound is None:
            raise ValueError("distributed noise needs a clipping bound (clipping_bound is None)")
        return noise_share_std(
            self.clipping_bound, self.parameters.sum_noise_multiplier, self.min_survivors()
        )

    def _codec(self, num_members: int) -> FixedPointCodec:
        return contribution_codec(
            per_user_bound=self.clipping_bound,
            population_size=self.population_size,
            noise_std=(self.clipping_bound or 0.0) * self.parameters.sum_noise_multiplier
            if self.parameters.noisy_shares
            else 0.0,
            num_nodes=num_members,
        )

    def codec(self) -> FixedPointCodec:
        """The fixed-point encoding of the run, by the nodes' own rule
        (:func:`~fedparity.mechanisms.crypto.secure_sum.contribution_codec` of the pinned ``K``,
        ``C``, sigma and members); sent in the member table, which every node compares with its
        own."""
        return self._codec(len(self.members))

    # -- one round -------------------------------------------------------------------------

    def run_round(
        self,
        round_number: int,
        weights: NDArray[np.float64],
        scales: dict[int, float] | None = None,
    ) -> RoundOutcome:
        """Send the weights (and in a FairFed run each node's scale, default 1), collect the
        (masked) node sums and recover their total, and the nodes' own releases."""
        if scales and not self.parameters.fairfed:
            raise ValueError("scales are for FairFed runs only (fairfed_release_share > 0)")
        weights = np.asarray(weights, dtype=np.float64)
        arrays = ArrayRecord({WEIGHTS_ARRAY: Array(weights)})
        messages = []
        for node in self.members:
            request = FPFLRoundRequest(
                round_number, self.run_digest, weights, (scales or {}).get(node, 1.0)
            )
            messages.append(
                self._message(
                    FPFL_ROUND_MESSAGE_TYPE,
                    node,
                    {FPFL_KEY: arrays, "config": ConfigRecord(request.to_fields())},
                )
            )
        outcome = RoundOutcome(round=round_number, total=None)
        received: dict[int, FPFLRoundReply] = {}
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in self.members or node in received:
                continue
            if reply.has_error():
                outcome.rejected.append((node, reply.error.reason))
                continue
            try:
                answer = self._read_reply(reply, node)
                totals, new = NodeLedgerReports.read(
                    reply.content.metric_records.get(METRICS_KEY, {})
                )
            except ValueError as error:  # MessageError included
                outcome.rejected.append((node, f"malformed reply: {error}"))
                continue
            received[node] = answer
            if answer.release is not None:
                outcome.releases[node] = answer.release
            self.ledgers.record(node, totals, new)
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
            outcome.total = np.sum([received[node].vector for node in outcome.replied], axis=0)
            return outcome
        return self._unmask(round_number, received, outcome)

    def _read_reply(self, reply: Message, node: int) -> FPFLRoundReply:
        record = reply.content.array_records.get(FPFL_KEY)
        arrays: dict[str, np.ndarray] = {}
        if record is not None:
            for name in record:
                try:
                    arrays[name] = record[name].numpy()
                except Exception as error:  # noqa: BLE001 - unreadable: a malformed reply
                    raise MessageError(
                        f"message array {name!r} is unreadable ({error!r})"
                    ) from None
        answer = FPFLRoundReply.from_fields(
            reply.content.config_records.get("shares", {}),
            arrays,
            masked=self.masking,
            vector_size=self.vector_size,
            release_size=release_size(self.parameters.num_groups) if self.parameters.fairfed else 0,
        )
        if self.masking:
            if sorted(answer.recipients) != sorted(set(self.members) - {node}):
                raise MessageError("the sealed shares are not one per other member")
            if not 2 <= answer.threshold <= len(self.members):
                raise MessageError(
                    f"the share threshold must be an integer in [2, {len(self.members)}]"
                )
        return answer

    def _unmask(
        self,
        round_number: int,
        received: dict[int, FPFLRoundReply],
        outcome: RoundOutcome,
    ) -> RoundOutcome:
        """The unmask exchange (every masked round): each survivor asked returns the shares of
        the survivors' self-masks and its pair seeds with the dropped nodes; the server rebuilds
        the self-mask seeds (Shamir) and removes every mask (Bonawitz et al. 2017). A round in
        which a node dropped first asks the survivors to attest the view (the consistency
        check): nodes reveal nothing for a view too few members attested."""
        survivors = outcome.replied
        dropped = outcome.missing
        thresholds = {node: received[node].threshold for node in survivors}
        short = sorted(node for node in survivors if thresholds[node] > len(survivors))
        if short:
            # Nobody is asked to reveal anything for a sum that could not be unmasked.
            outcome.reason = (
                f"{len(survivors)} survivor(s) cannot rebuild the self-mask of node(s) {short} "
                f"(share threshold {max(thresholds[node] for node in short)})"
            )
            return outcome
        attestations: dict[int, dict[int, bytes]] = {}
        if dropped:
            attestations, failures = self._confirm(round_number, survivors, dropped)
            if failures:
                outcome.rejected += failures
        boxes = {
            node: dict(zip(received[node].recipients, received[node].sealed, strict=True))
            for node in survivors
        }
        # Every seed is rebuilt from the shares of the smallest indices, those the first
        # survivors (in the members' order) hold: with nobody dropped, only as many
        # survivors as the largest threshold are asked; a dropped node's pair masks need
        # the pair seed of every survivor, so then all are asked.
        asked = survivors if dropped else survivors[: max(thresholds.values())]
        answers, failures = self._reveal(
            round_number, survivors, dropped, boxes, asked, attestations
        )
        if failures:
            outcome.reason = (
                f"{len(dropped)} node(s) dropped and the survivors did not unmask the sum "
                f"({failures[0][1]})"
                if dropped
                else f"the survivors did not unmask the sum ({failures[0][1]})"
            )
            outcome.rejected += failures
            return outcome
        revealed = {
            (node, peer): seed
            for node, answer in answers.items()
            for peer, seed in zip(answer.dropped, answer.seeds, strict=True)
        }
        try:
            self_seeds = {
                owner: combine_self_seed(
                    [
                        dict(zip(answer.share_owners, answer.self_shares, strict=True))[owner]
                        for answer in answers.values()
                    ],
                    thresholds[owner],
                )
                for owner in survivors
            }
        except ValueError as error:
            outcome.reason = f"the self-masks could not be rebuilt ({error})"
            return outcome
        try:
            masked_total = unmask_sum(
                {node: received[node].vector for node in survivors},
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

    def _confirm(
        self, round_number: int, survivors: list[int], dropped: list[int]
    ) -> tuple[dict[int, dict[int, bytes]], list[tuple[int, str]]]:
        """``{attester: {recipient: MAC}}``: the survivors' attestations of the view (a round
        with dropped nodes), and the survivors that did not attest."""
        request = FPFLConfirmRequest(round_number, tuple(survivors), tuple(dropped))
        messages = [
            self._message(
                FPFL_CONFIRM_MESSAGE_TYPE, node, {FPFL_KEY: ConfigRecord(request.to_fields())}
            )
            for node in survivors
        ]
        attestations: dict[int, dict[int, bytes]] = {}
        failures: list[tuple[int, str]] = []
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in survivors or node in attestations:
                continue
            if reply.has_error():
                failures.append((node, f"attestation refused or failed: {reply.error.reason}"))
                continue
            try:
                answer = FPFLConfirmReply.from_fields(
                    reply.content.config_records.get(FPFL_KEY, {})
                )
            except MessageError as error:
                failures.append((node, f"malformed attestation: {error}"))
                continue
            attestations[node] = dict(zip(answer.recipients, answer.attestations, strict=True))
        failures += [
            (node, "no attestation")
            for node in survivors
            if node not in attestations and node not in {n for n, _ in failures}
        ]
        return attestations, failures

    def _reveal(
        self,
        round_number: int,
        survivors: list[int],
        dropped: list[int],
        sealed: dict[int, dict[int, bytes]],
        asked: list[int],
        attestations: dict[int, dict[int, bytes]],
    ) -> tuple[dict[int, FPFLRevealReply], list[tuple[int, str]]]:
        """The unmask answers of the ``asked`` survivors, and those of them that failed."""
        messages = []
        for node in asked:
            request = FPFLRevealRequest.for_node(
                round_number, node, survivors, dropped, sealed, attestations
            )
            messages.append(
                self._message(
                    FPFL_REVEAL_MESSAGE_TYPE, node, {FPFL_KEY: ConfigRecord(request.to_fields())}
                )
            )
        answers: dict[int, FPFLRevealReply] = {}
        failures: list[tuple[int, str]] = []
        for reply in send_and_receive(self.grid, messages, self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in asked or node in answers:
                continue
            if reply.has_error():
                failures.append((node, f"unmask refused or failed: {reply.error.reason}"))
                continue
            try:
                answer = FPFLRevealReply.from_fields(reply.content.config_records.get(FPFL_KEY, {}))
            except MessageError as error:
                failures.append((node, f"malformed unmask reply: {error}"))
                continue
            if sorted(answer.share_owners) != sorted(survivors) or sorted(answer.dropped) != sorted(
                dropped
            ):
                failures.append((node, "malformed unmask reply: wrong owners or peers"))
                continue
            answers[node] = answer
        failures += [(node, "no unmask reply") for node in asked if node not in answers]
        if failures:
            log(logging.WARNING, "FPFL round %d: unmasking failed: %s", round_number, failures)
        return answers, failures


_LEGACY_KEYS = {
    "vector_size",
    "population_size",
    "noise_multiplier",
    "clipping_bound",
    "masking",
    "distributed_noise",
    "dropout_tolerance",
    "session",
    "cohort_size",
    "rounds",
    "epsilon",
    "delta",
    "accountant",
    "constraint",
    "num_groups",
}


def _legacy_parameters(values: dict[str, Any]) -> FPFLRunParameters:
    """:class:`FPFLRunParameters` from the keyword form of earlier versions (deprecated)."""
    unknown = sorted(set(values) - _LEGACY_KEYS)
    if unknown:
        raise TypeError(f"FPFLProtocol got unexpected keyword argument(s) {unknown}")
    needed = ["cohort_size", "rounds", "epsilon", "constraint", "num_groups"]
    missing = [key for key in needed if key not in values]
    if missing:
        raise TypeError(
            "FPFLProtocol needs the run's parameters, which every node checks against its own "
            f"settings: pass parameters=FPFLRunParameters(...) (missing: {', '.join(missing)})"
        )
    warnings.warn(
        "FPFLProtocol(vector_size=..., population_size=..., ...) is deprecated: pass "
        "parameters=FPFLRunParameters(...)",
        DeprecationWarning,
        stacklevel=3,
    )
    epsilon = values["epsilon"]
    population = int(values["population_size"])
    delta = values.get("delta")
    if epsilon is not None and delta is None:
        delta = 1.0 / population
    return FPFLRunParameters(
        population_size=population,
        cohort_size=int(values["cohort_size"]),
        rounds=int(values["rounds"]),
        clipping_bound=values.get("clipping_bound"),
        epsilon=epsilon,
        delta=delta if epsilon is not None else None,
        noise_multiplier=float(values.get("noise_multiplier", 0.0)),
        accountant=str(values.get("accountant", "rdp")),
        constraint=str(values["constraint"]),
        num_groups=int(values["num_groups"]),
        vector_size=int(values["vector_size"]),
        distributed_noise=bool(values.get("distributed_noise", True)),
        masking=bool(values.get("masking", True)),
        dropout_tolerance=float(values.get("dropout_tolerance", 0.2)),
        session=str(values.get("session", "")),
    )


# -- training ------------------------------------------------------------------------------


@dataclass
class FPFLTrainingResult:
    """What :meth:`FPFLTraining.start` produced: the final weights and multipliers, the round
    the selected model comes from (None: no round released), its weights, and one history
    entry per round (the rounds a checkpoint restored included).

    ``first_round`` is the first round this call trained, ``rounds_trained`` the last round
    trained (``first_round - 1`` if none), and ``stop_reason`` why an observer stopped the
    training before ``num_rounds`` (``""``: it was not stopped).
    """

    weights: NDArray[np.float64]
    multipliers: NDArray[np.float64]
    selected_round: int | None
    selected_weights: NDArray[np.float64]
    history: list[dict[str, Any]]
    first_round: int = 1
    rounds_trained: int = 0
    stop_reason: str = ""


class FPFLTraining:
    """The server's training loop of FPFL (Rodriguez-Galvez et al. 2021, Algorithm 1): each
    round releases the (noisy, masked) sum of the cohort's statistic vectors through an
    :class:`FPFLProtocol`, and the server takes an MMDM step (FPFL Eq. 10; FFL, FPFL), a
    FedFB step (Zeng, Chen and Lee, "Improving Fairness via Federated Learning", 2021:
    :func:`~fedparity.mechanisms.fpfl.fedfb.fedfb_update`, on the same sums) or a
    FederatedSGD step (FL, PFL) and keeps the best model on cohort statistics (Section 4.1).

    :meth:`start` is the one training loop, of the library and of the FPFL job alike; what a
    training needs around it comes from :class:`~fedparity.strategies.FPFLObserver` hooks,
    by default :class:`~fedparity.strategies.DurableTraining` (the release ledger on disk
    before each round is sent, checkpoints, resume from the same folder).

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
    fedfb : FedFBConfig, optional
        FedFB's group-reweighting updates instead (needs ``use_mmdm=False``); its group
        weights ``q`` are kept in ``multipliers`` (zeros until the first update, which starts
        them at the first released counts), so checkpoints and the history carry them.
    smoothing : float
        ``beta`` in [0, 1): the constraint terms and the selection read an exponential moving
        average of the released sums (0: this round's sum).
    require_fair_selection : bool or None
        The selector prefers models fair on their cohort (default: True with MMDM or FedFB,
        the fairness-aware rules; False with FederatedSGD).
    central_noise_multiplier : float
        ``sigma`` of central noise the server adds to each recovered sum (0: none, e.g. with
        the nodes' distributed noise); needs ``clipping_bound``.
    clipping_bound : float or None
        ``C`` (for central noise).
    central_noise_rng : callable, optional
        ``central_noise_rng(round) -> numpy Generator`` (default: OS entropy).
    fairfed : FairFedConfig, optional
        FairFed's node weights (Ezzeldin et al., "FairFed: Enabling Group Fairness in
        Federated Learning", AAAI 2023; :mod:`fedparity.mechanisms.fpfl.fairfed`; needs a
        protocol whose run has ``fairfed_release_share > 0``): each round sends the nodes their
        scales, takes the model's step (FederatedSGD, or FedFB's or MMDM's with ``fedfb`` or
        ``use_mmdm``) on the weighted sum and moves the weights from the nodes' own releases;
        the history and the selection read the releases (the unweighted cohort).
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
        fedfb: FedFBConfig | None = None,
        fairfed: FairFedConfig | None = None,
    ) -> None:
        if use_mmdm and fedfb is not None:
            raise ValueError("use_mmdm must be False with fedfb: one update rule per training")
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
        self.fedfb = fedfb
        self.fairfed = fairfed
        #: FairFed: the nodes (the protocol's members), their weights ``omega``, the weights'
        #: start ``omega^0`` and the (smoothed) releases, one row per node (NaN: none yet).
        self.fairfed_nodes: list[int] = []
        self.node_weights: NDArray[np.float64] | None = None
        self.base_weights: NDArray[np.float64] | None = None
        self.smoothed_releases: NDArray[np.float64] | None = None
        self.smoothing = float(smoothing)
        self.smoothed_total: NDArray[np.float64] | None = None
        fair_aware = use_mmdm or fedfb is not None or fairfed is not None
        fair = fair_aware if require_fair_selection is None else require_fair_selection
        self.selector = ModelSelector(require_fair=fair)
        self.central_noise_multiplier = float(central_noise_multiplier)
        self.clipping_bound = clipping_bound
        self.central_noise_rng = central_noise_rng
        #: One entry per round trained (by :meth:`start`, or restored from a checkpoint).
        self.history: list[dict[str, Any]] = []

    @property
    def update_rule(self) -> str:
        """The model's update: ``"mmdm"``, ``"fedfb"`` or ``"sgd"`` (FederatedSGD), prefixed
        ``"fairfed+"`` on FairFed's node-weighted sums (``"fairfed"`` alone: FederatedSGD)."""
        rule = "mmdm" if self.use_mmdm else "sgd" if self.fedfb is None else "fedfb"
        if self.fairfed is None:
            return rule
        return "fairfed" if rule == "sgd" else f"fairfed+{rule}"

    def node_scales(self) -> dict[int, float] | None:
        """FairFed: each node's scale for the next round (None before the first weights, and
        outside FairFed: every scale 1)."""
        if self.fairfed is None or self.node_weights is None or self.base_weights is None:
            return None
        scales = node_scales(self.node_weights, self.base_weights)
        return {node: float(scale) for node, scale in zip(self.fairfed_nodes, scales, strict=True)}

    def _pooled_releases(
        self, releases: dict[int, NDArray[np.float64]]
    ) -> tuple[AggregateStatistics, AggregateStatistics]:
        """FairFed: keep the nodes' (smoothed) releases and start the node weights at the
        first; the pooled releases of this round and their smoothed pool (the unweighted
        cohort, which the history and the selection describe)."""
        assert self.fairfed is not None
        layout = self.layout
        rows = np.full((len(self.fairfed_nodes), release_size(layout.num_groups)), np.nan)
        for index, node in enumerate(self.fairfed_nodes):
            if node in releases:
                rows[index] = releases[node]
        present = np.all(np.isfinite(rows), axis=1)
        if self.smoothed_releases is None:
            self.smoothed_releases = np.full_like(rows, np.nan)
        for row in np.flatnonzero(present):
            previous = self.smoothed_releases[row]
            self.smoothed_releases[row] = exponential_average(
                previous if np.all(np.isfinite(previous)) else None, rows[row], self.smoothing
            )
        if self.node_weights is None:
            self.base_weights = initial_node_weights(rows, self.fairfed, layout)
            self.node_weights = self.base_weights.copy()
        usable = np.all(np.isfinite(self.smoothed_releases), axis=1)
        return (
            release_statistics(layout, rows[present].sum(axis=0)),
            release_statistics(layout, self.smoothed_releases[usable].sum(axis=0)),
        )

    def update(
        self,
        round_number: int,
        total: NDArray[np.floating],
        releases: dict[int, NDArray[np.float64]] | None = None,
    ) -> dict[str, Any]:
        """One step from round ``round_number``'s released sum (the statistics of the weights
        sent in that round) and, with FairFed, the nodes' own releases; returns the round's
        cohort metrics for the history.

        With FairFed the sum is node-weighted: the model's update reads it as it is (the
        weighted mean gradient, FairFed's aggregate), while the history, the selection and the
        constraint's report read the pooled releases (the unweighted cohort); the node weights
        then move with the nodes' (smoothed) releases."""
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
        # The constraint terms read the smoothed sums (smoothing > 0) or this round's sum; the
        # loss gradient always comes from this round's sum.
        smoothed = stats
        if self.smoothing:
            self.smoothed_total = exponential_average(self.smoothed_total, total, self.smoothing)
            smoothed = self.layout.split(self.smoothed_total)
        if self.fairfed is not None:
            observed_now, observed = self._pooled_releases(releases or {})
        else:
            observed_now, observed = stats, smoothed
        raw_metrics = cohort_metrics(observed_now, alpha, min_count=min_count)
        metrics = cohort_metrics(observed, alpha, min_count=min_count)
        self.selector.consider(round_number, self.weights, metrics)
        constraints = evaluate_constraints(observed, alpha, min_count=min_count)
        if self.use_mmdm:
            step = mmdm_update(
                self.weights, self.multipliers, with_constraint_terms(stats, smoothed), self.mmdm
            )
            self.weights, self.multipliers = step.weights, step.multipliers
        elif self.fedfb is not None:
            # Zeros: no group weights yet (they start at the first released counts).
            current = self.multipliers if self.multipliers.any() else None
            fedfb_step = fedfb_update(
                self.weights, current, with_constraint_terms(stats, smoothed), self.fedfb
            )
            self.weights, self.multipliers = fedfb_step.weights, fedfb_step.group_weights
        else:
            self.weights = sgd_update(
                self.weights, stats, self.mmdm.learning_rate, min_count=min_count
            )
        entry: dict[str, Any] = {
            "cohort_loss": _finite(
                observed_now.loss_sum / max(observed_now.num_samples, min_count)
            ),
            "cohort_accuracy": _finite(raw_metrics.accuracy),
            "cohort_gap": _finite(raw_metrics.gap),
            "group_error_rates": [_finite(r) for r in raw_metrics.group_error_rates],
            "surrogate_gap": _finite(constraints.max_gap),
            "cohort_size_noisy": _finite(observed_now.num_samples),
        }
        if self.smoothing:
            entry["smoothed_cohort_accuracy"] = _finite(metrics.accuracy)
            entry["smoothed_cohort_gap"] = _finite(metrics.gap)
        if self.fairfed is not None:
            assert self.node_weights is not None and self.smoothed_releases is not None
            moved = fairfed_step(
                self.node_weights, self.smoothed_releases, self.fairfed, self.layout
            )
            self.node_weights = moved.weights
            entry["fairfed_weights"] = [float(w) for w in moved.weights]
            entry["fairfed_distances"] = [_finite(d) for d in moved.distances]
        return entry

    def start(
        self,
        protocol: FPFLProtocol,
        num_rounds: int,
        *,
        first_round: int | None = None,
        folder: str | Path | None = None,
        observers: Sequence[FPFLObserver] | None = None,
        stop_after: int | None = None,
    ) -> FPFLTrainingResult:
        """Train rounds ``first_round .. num_rounds``: the only FPFL training loop.

        A lost round leaves the model as it was (and still counts as spent privacy). The
        protocol is set up first if it is not yet.

        Parameters
        ----------
        protocol : FPFLProtocol
            The run's message exchange.
        num_rounds : int
            ``T``, the last round (>= 1).
        first_round : int, optional
            The first round to train (default: 1, or the round after the checkpoint an
            observer restored).
        folder : str or Path, optional
            Where the default observer, :class:`~fedparity.strategies.DurableTraining`,
            keeps the release ledger (durable before each round is sent) and the
            checkpoints; the same folder again resumes the training with every earlier
            release counted. Default: a new ``~/.fedparity/runs/fpfl-<UTC time>``.
        observers : sequence of FPFLObserver, optional
            Instead of the default ``[DurableTraining(folder)]`` (an empty list: no files,
            nothing durable); called in this order.
        stop_after : int, optional
            Train at most this many rounds in this call (a pause at a checkpoint; the same
            folder resumes).
        """
        num_rounds = check_int_at_least("num_rounds", num_rounds, 1)
        if stop_after is not None:
            stop_after = check_int_at_least("stop_after", stop_after, 1)
        if observers is None:
            observers = [DurableTraining(folder)]
        elif folder is not None:
            raise ValueError(
                "pass folder= or observers=, not both (put DurableTraining(folder) among the "
                "observers)"
            )
        observers = list(observers)
        self.history = []
        restored = max((observer.restore(self, protocol) for observer in observers), default=0)
        first = self._first_round(first_round, restored)
        last = num_rounds if stop_after is None else min(num_rounds, first - 1 + stop_after)
        if protocol.table is None:
            protocol.setup()
        if self.fairfed is not None:
            if not protocol.parameters.fairfed:
                raise ValueError(
                    "FairFed needs a run whose nodes release their own statistics "
                    "(FPFLRunParameters.fairfed_release_share > 0)"
                )
            if self.fairfed_nodes and self.fairfed_nodes != list(protocol.members):
                raise ValueError("the restored FairFed weights are for other member nodes")
            self.fairfed_nodes = list(protocol.members)
        for observer in observers:
            observer.begin(self, protocol, range(first, last + 1))
        stop_reason = ""
        trained_to = first - 1
        for round_number in range(first, last + 1):
            stop_reason = self._stop_reason(observers, round_number)
            if stop_reason:
                break
            for observer in observers:
                observer.before_release(round_number)
            scales = self.node_scales()
            # (round, weights) outside FairFed: a protocol that overrides run_round keeps working
            outcome = (
                protocol.run_round(round_number, self.weights)
                if scales is None
                else protocol.run_round(round_number, self.weights, scales)
            )
            entry = self._entry(round_number, protocol, outcome)
            self.history.append(entry)
            trained_to = round_number
            for observer in observers:
                observer.after_round(round_number, outcome, entry)
        best = self.selector.best
        result = FPFLTrainingResult(
            weights=self.weights,
            multipliers=self.multipliers,
            selected_round=None if best is None else best.round,
            selected_weights=self.weights if best is None else best.weights,
            history=self.history,
            first_round=first,
            rounds_trained=trained_to,
            stop_reason=stop_reason,
        )
        for observer in observers:
            observer.end(result)
        return result

    def _stop_reason(self, observers: Sequence[FPFLObserver], round_number: int) -> str:
        """The first observer's reason to stop before ``round_number`` ("" if none has)."""
        for observer in observers:
            reason = observer.should_stop(round_number, self.history)
            if reason:
                return reason
        return ""

    @staticmethod
    def _first_round(first_round: int | None, restored: int) -> int:
        if first_round is None:
            return restored + 1
        first_round = check_int_at_least("first_round", first_round, 1)
        if restored and first_round != restored + 1:
            raise ValueError(
                f"first_round is {first_round}, but the checkpoint restored holds rounds up to "
                f"{restored}: leave first_round out to resume after it"
            )
        return first_round

    def _entry(
        self, round_number: int, protocol: FPFLProtocol, outcome: RoundOutcome
    ) -> dict[str, Any]:
        """The round's history entry; the update from its released sum (none if lost)."""
        entry: dict[str, Any] = {
            "round": round_number,
            "members": len(protocol.members),
            "replied": len(outcome.replied),
            "missing": outcome.missing,
            "rejected": [{"node_id": node, "reason": why} for node, why in outcome.rejected],
        }
        if outcome.total is None:
            entry["lost"] = outcome.reason
        else:
            entry.update(self.update(round_number, outcome.total, outcome.releases))
        entry["multipliers"] = [float(m) for m in self.multipliers]
        return entry


def _finite(value: float) -> float | None:
    """A JSON-safe number: None for NaN or infinity."""
    number = float(value)
    return number if np.isfinite(number) else None
