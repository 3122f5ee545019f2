"""FedEvalFair over CKKS: the server side of the three-round protocol.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version), Algorithms 1-2; the encryption layer and its threat model are in
:mod:`fedparity.mechanisms.crypto.ckks`.

The server holds only the *public* TenSEAL context (no secret key; checked at construction).
Round 1: every node uploads one ciphertext of its bootstrap contributions, signed with its
identity key for this run and round; the server checks the signature (so that a faulty node
is left out, not the whole round) and adds the valid ones. Endorsement: a few verifiers (the
first ``key_holders`` round-1 participants) get the signed ciphertexts, recompute the sum and
sign it. Round 2: the round-1 participants get the endorsed sum with its contributor list and
endorsements, check them against their own roster, decrypt it and upload one signed
ciphertext of their stage-1 terms. Commitment: every round-2 participant gets the signed
digests of both sets and signs one commitment to them (once per run); a run whose round-2
participants do not all commit ends there (result withheld). Round 3: a few key-holder nodes
get both signed ciphertext sets with the commitments, check that every round-2 participant
committed to exactly these sets, recompute both sums, decrypt, and release the aggregate
statistics, noise-flooded; the server checks they agree and computes the two stages' p-values
(``mechanisms.fairness_tests.fedevalfair``). The commitment keeps a server from having two key
holders release over two different round-2 sets of one run and differencing them
(:mod:`fedparity.mechanisms.crypto.ckks.signing`).
Nothing the server asserts (a count, a sum) is believed by a node: see
:mod:`fedparity.mechanisms.crypto.ckks.signing` and docs/threat-model.md.

Holder-level DP (optional, ``dp``; :mod:`fedparity.mechanisms.crypto.ckks.holder_dp`): the key
holders release only the calibrated blocks' sums of capped weights, each with Gaussian noise
of a standard deviation calibrated to one holder's sensitivity, and the server computes both
stages from those noisy sums (the stage-2 and TOST statistics with the noise's known variance
accounted, stage 1 approximately); the outcome says so, with the noise's standard deviation,
epsilon and delta. The commitment binds the DP parameters, so the server's must be the
holders'.

Replies that are errors, undecodable, not a ciphertext of the expected context or of the
wrong length are rejected and counted; nodes that do not answer are reported as dropped.
A holder that can compute no metric (e.g. one group only in its test set) takes part with
weight 0, in every mode; a block that fewer than a key holder's ``min-holders`` holders
could compute comes back NaN and is reported unavailable. The protocol completes while at
least 2 nodes remain.

A ciphertext under another key with the same CKKS parameters, or one carrying out-of-range
values, passes every check the server can make without the secret key. The nodes catch it
when they decrypt the sum (magnitude and count-slot checks) and answer with a "corrupt sum"
report; the server then withholds the result and says so -- it does not list the reporting
(honest) nodes as rejected, and it cannot name the culprit: only the sum is ever decrypted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tenseal as ts
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from ..mechanisms.crypto.ckks import (
    HolderDP,
    NoValidCiphertextError,
    SignedCiphertext,
    add_ciphertexts,
    ciphertext_transcript,
    commitment_transcript,
    context_has_secret_key,
    contributors_digest,
    dp_report,
    endorsement_transcript,
    from_array,
    session_id,
    set_digest,
)
from ..mechanisms.crypto.identity import IDENTITY_KEY_BYTES, SIGNATURE_BYTES, verify_signature
from ..mechanisms.fairness_tests.fedevalfair import (
    PAPER_MODE_WARNING,
    FairnessReport,
    RandomEffects,
    report_from_sums,
)
from ..mechanisms.protocol import (
    BLOCK_WIDTH,
    CORRUPT_SUM_MARKER,
    DEFAULT_LAYOUT,
    FEF_ENDORSE_MESSAGE_TYPE,
    FEF_KEY,
    FEF_ROUND_MESSAGE_TYPES,
    METRICS_KEY,
    RELEASE_WIDTH,
    UNABLE_MARKER,
    FedEvalFairBlock,
    FedEvalFairLayout,
)
from ..mechanisms.protocol.fedevalfair import (
    FEF_COMMIT_MESSAGE_TYPE,
    CommitReply,
    CommitRequest,
    EndorseRequest,
    Round2Request,
    Round3Request,
)
from .replies import (
    NodeLedgerReports,
    RejectedReply,
    send_and_receive,
    session_records,
    short_reason,
)

#: Relative tolerance within which the key holders' releases must agree.
AGREEMENT_TOLERANCE = 1e-6


def block_label(metric: str, mode: str, comparison: tuple[int, int] = (0, 1)) -> str:
    """A test's label in summaries and reports: the metric's name, the groups compared (when
    not 0 vs 1) and the mode; mode "paper" says it is not evidence."""
    return FedEvalFairBlock(metric, mode, comparison).label  # type: ignore[arg-type]


@dataclass(frozen=True)
class BlockResult:
    """The test of one (metric, mode, comparison) block, or why there is none."""

    metric: str
    mode: str
    report: FairnessReport | None
    reason: str | None = None
    #: The groups compared: the disparity is the rate of the first minus that of the second.
    comparison: tuple[int, int] = (0, 1)

    @property
    def label(self) -> str:
        """The metric's name, the groups and the mode (:func:`block_label`)."""
        return block_label(self.metric, self.mode, self.comparison)

    def summary(self) -> str:
        """The verdict lines of this block (or why there is none)."""
        if self.report is None:
            return f"{self.label}: unavailable: {self.reason}"
        return self.report.summary(self.label)

    def __repr__(self) -> str:
        groups = "" if self.comparison == (0, 1) else f", comparison={self.comparison!r}"
        return (
            f"BlockResult(metric={self.metric!r}, mode={self.mode!r}{groups}, "
            f"report={self.report!r})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "metric": self.metric,
            "mode": self.mode,
            "comparison": list(self.comparison),
            "report": None if self.report is None else self.report.to_dict(),
            "unavailable": self.reason,
        }


@dataclass(frozen=True)
class FedEvalFairOutcome:
    """What one protocol run produced (see the module docstring)."""

    blocks: tuple[BlockResult, ...]
    round_participants: tuple[tuple[int, ...], ...]
    dropped: tuple[tuple[int, ...], ...]
    rejected: tuple[tuple[int, RejectedReply], ...]
    unable: tuple[RejectedReply, ...]
    key_holders: tuple[int, ...]
    uploaded_bytes: tuple[dict[int, int], ...]
    ciphertexts_per_node: tuple[int, ...]
    error: str | None = None
    released: tuple[float, ...] = field(default=())
    #: (round, report) of nodes that found the sum they were sent corrupt (see module doc).
    corrupt_sum_reports: tuple[tuple[int, RejectedReply], ...] = field(default=())
    #: Nodes asked to endorse the round-1 sum, and those whose endorsement went to round 2.
    verifiers: tuple[int, ...] = field(default=())
    endorsers: tuple[int, ...] = field(default=())
    #: Round-2 participants whose commitment to the run's two sets went to round 3.
    committers: tuple[int, ...] = field(default=())
    #: The holder-level DP mode's parameters and noise (``HolderDP.to_dict``), or None (off).
    holder_dp: dict[str, float | str] | None = None
    #: What the committers reported of their per-user ledgers after the DP mode's charge
    #: (nothing with the mode off, or from holders below their ``min-users-for-counts``).
    ledger_reports: NodeLedgerReports = field(default_factory=NodeLedgerReports)

    @property
    def tests(self) -> tuple[BlockResult, ...]:
        """The blocks, under the name ``to_dict()`` and results.json give them (``"tests"``)."""
        return self.blocks

    def block(
        self, metric: str, mode: str, comparison: tuple[int, int] | None = None
    ) -> BlockResult:
        """The block of ``metric`` and ``mode`` (and ``comparison``: required when the run
        compared more than two groups)."""
        found = [
            b
            for b in self.blocks
            if b.metric == metric
            and b.mode == mode
            and (comparison is None or b.comparison == tuple(comparison))
        ]
        if len(found) != 1:
            tests = [(b.metric, b.mode, b.comparison) for b in self.blocks]
            raise KeyError(
                f"no single block for metric={metric!r}, mode={mode!r}, comparison="
                f"{comparison!r}: the run has {tests}"
            )
        return found[0]

    def summary(self) -> str:
        """The verdicts (mode "calibrated" first, "paper" after it, labelled as not evidence),
        then who took part in each round and which replies were lost or rejected."""
        lines = [] if self.error is None else [f"FedEvalFair gave no result: {self.error}"]
        ordered = sorted(self.blocks, key=lambda block: block.mode == "paper")
        lines.extend(block.summary() for block in ordered)
        if any(block.mode == "paper" and block.report is not None for block in self.blocks):
            lines.append(f"note: {PAPER_MODE_WARNING}")
        participants = ", ".join(str(len(nodes)) for nodes in self.round_participants)
        lines.append(
            f"holders per round: {participants or 'none'}; key holders {list(self.key_holders)}"
        )
        for number, nodes in enumerate(self.dropped, start=1):
            if nodes:
                lines.append(f"dropped after round {number}: nodes {list(nodes)}")
        for number, item in self.rejected:
            lines.append(f"round {number}: rejected reply from node {item.node_id}: {item.reason}")
        for item in self.unable:
            lines.append(f"node {item.node_id} could not take part: {item.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        decisions = ", ".join(
            f"{block.metric}/{block.mode}: "
            + (
                "unavailable"
                if block.report is None
                else f"reject_fairness={block.report.reject_fairness}"
            )
            for block in self.blocks
        )
        holders = [len(nodes) for nodes in self.round_participants]
        return f"FedEvalFairOutcome([{decisions}], holders={holders}, error={self.error!r})"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (the results.json of the built-in job: the blocks under "tests")."""
        return {
            "error": self.error,
            "tests": [block.to_dict() for block in self.blocks],
            "round_participants": [list(nodes) for nodes in self.round_participants],
            "dropped_between_rounds": [list(nodes) for nodes in self.dropped],
            "rejected_replies": [
                {"round": rnd, "node_id": item.node_id, "reason": item.reason}
                for rnd, item in self.rejected
            ],
            "unable_to_take_part": [
                {"node_id": item.node_id, "reason": item.reason} for item in self.unable
            ],
            "corrupt_sum_reports": [
                {"round": rnd, "node_id": item.node_id, "reason": item.reason}
                for rnd, item in self.corrupt_sum_reports
            ],
            "key_holders": list(self.key_holders),
            "verifiers": list(self.verifiers),
            "endorsers": list(self.endorsers),
            "committers": list(self.committers),
            "uploaded_bytes_per_round": [
                {str(node): size for node, size in sizes.items()} for sizes in self.uploaded_bytes
            ],
            "max_ciphertexts_per_node_per_round": list(self.ciphertexts_per_node),
            **({} if self.holder_dp is None else {"holder_dp": dict(self.holder_dp)}),
        }


def _random_effects(released: np.ndarray) -> np.ndarray | None:
    """A calibrated block's released random-effects summary, or None when there is none (NaN)
    or it does not hold together (a report without it, rather than no report)."""
    try:
        RandomEffects.from_release(released)
    except ValueError:
        return None
    return released


class FedEvalFairProtocol:
    """Server side of the encrypted FedEvalFair test.

    Parameters
    ----------
    public_context : tenseal.Context
        The public CKKS context; must not hold a secret key (``ValueError`` otherwise).
    alpha, mu0, tolerance
        Level of the tests, stage-2 null value, TOST tolerance (None: no TOST).
    key_holders : int
        Nodes that decrypt the final sums in round 3 (their releases must agree).
    min_clients : int
        Fewest nodes for which the protocol may complete (>= 2: a sum over one node would be
        that node's statistic).
    timeout : float
        Seconds to wait for the replies of one round.
    session : str, optional
        The label of this test when a run tests more than one model (the pipeline: ``"fpfl"``
        and ``"pfl"``): every message names it and every signature binds it
        (:func:`~fedparity.mechanisms.crypto.ckks.session_id`). ``""``: the run's only test.
    dp : HolderDP, optional
        The holder-level DP mode (the holders' must be the same: the commitment binds it).
        None (default): the plain release. Its noise covers the layout's calibrated blocks
        (:attr:`HolderDP.num_blocks` is set from ``layout``).
    layout : FedEvalFairLayout, optional
        The run's tests (metrics, number of groups, reference group); the holders' must be
        the same (the commitment binds it). Default: dp and eo, groups 0 and 1.
    """

    def __init__(
        self,
        public_context: ts.Context,
        *,
        alpha: float = 0.05,
        mu0: float = 0.0,
        tolerance: float | None = None,
        key_holders: int = 2,
        min_clients: int = 2,
        timeout: float = 600.0,
        session: str = "",
        dp: HolderDP | None = None,
        layout: FedEvalFairLayout = DEFAULT_LAYOUT,
    ) -> None:
        if context_has_secret_key(public_context):
            raise ValueError(
                "public_context holds a secret key: the server must only have the public "
                "context (load it with mechanisms.crypto.ckks.load_public_context)"
            )
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        if key_holders < 1:
            raise ValueError(f"key_holders must be >= 1, got {key_holders!r}")
        if min_clients < 2:
            raise ValueError(f"min_clients must be >= 2, got {min_clients!r}")
        if dp is not None and not isinstance(dp, HolderDP):
            raise TypeError(f"dp must be a HolderDP or None, got {type(dp).__name__}")
        if not isinstance(layout, FedEvalFairLayout):
            raise TypeError(f"layout must be a FedEvalFairLayout, got {type(layout).__name__}")
        if dp is not None:
            dp = dataclasses.replace(dp, num_blocks=len(layout.dp_blocks))
        self.layout = layout
        self.public_context = public_context
        self.alpha = float(alpha)
        self.mu0 = float(mu0)
        self.tolerance = tolerance
        self.key_holders = int(key_holders)
        self.min_clients = int(min_clients)
        self.timeout = float(timeout)
        self.session = str(session)
        self.dp = dp

    # --- rounds ---------------------------------------------------------------------------

    def _send(
        self, grid: Grid, message_type: str, node_ids: Sequence[int], content: RecordDict
    ) -> list[Message]:
        for name, record in session_records(self.session).items():
            content[name] = record
        messages = [
            Message(content=content, dst_node_id=node, message_type=message_type)
            for node in node_ids
        ]
        return send_and_receive(grid, messages, self.timeout)

    def collect_round(
        self,
        round_number: int,
        sent_to: Sequence[int],
        replies: Iterable[Message],
        size: int,
        *,
        run_id: int | None = None,
        reference: bytes = b"",
    ) -> RoundCollection:
        """Validate signed replies and add their ciphertexts.

        A reply needs a 1-D uint8 ``ciphertext``, a 64-byte ``signature`` and a 32-byte
        ``signer``; a second reply with a signer already seen is rejected (two nodes with one
        identity); with ``run_id`` the signature must verify over this run, round and
        ``reference`` (the nodes check it again against their rosters: the server's check
        only keeps a faulty node from spoiling the round).
        """
        payloads: list[bytes] = []
        senders: list[int] = []
        entries: list[SignedCiphertext] = []
        rejected: list[RejectedReply] = []
        unable: list[RejectedReply] = []
        uploaded: dict[int, int] = {}
        seen: set[int] = set()
        signers: set[bytes] = set()
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node in seen or node not in sent_to:
                rejected.append(RejectedReply(node, "duplicate or unsolicited reply"))
                continue
            seen.add(node)
            if reply.has_error():
                reason = short_reason(reply.error.reason)
                # "cannot take part" and "corrupt sum" replies are not faults of the sender;
                # the caller sorts the second kind out of ``unable``.
                marked = UNABLE_MARKER in reason or CORRUPT_SUM_MARKER in reason
                (unable if marked else rejected).append(RejectedReply(node, reason))
                continue
            record = reply.content.array_records.get(FEF_KEY)
            if record is None or "ciphertext" not in record:
                rejected.append(RejectedReply(node, "no ciphertext in the reply"))
                continue
            try:
                array = record["ciphertext"].numpy()
                signature = _raw(record, "signature", SIGNATURE_BYTES)
                signer = _raw(record, "signer", IDENTITY_KEY_BYTES)
            except Exception as error:  # a corrupt Array must not end the run
                rejected.append(RejectedReply(node, f"cannot decode the array: {error}"))
                continue
            if array.dtype != np.uint8 or array.ndim != 1:
                rejected.append(
                    RejectedReply(node, f"expected a 1-D uint8 ciphertext, got {array.dtype}")
                )
                continue
            if signature is None or signer is None:
                rejected.append(RejectedReply(node, "the ciphertext is not signed"))
                continue
            if signer in signers:
                rejected.append(RejectedReply(node, "identity key already used by another node"))
                continue
            payload = from_array(array)
            entry = SignedCiphertext(payload, signer, signature)
            if run_id is not None and not verify_signature(
                signer,
                signature,
                ciphertext_transcript(run_id, round_number, entry.digest, reference),
            ):
                rejected.append(RejectedReply(node, "signature does not verify for this round"))
                continue
            signers.add(signer)
            uploaded[node] = int(array.nbytes)
            payloads.append(payload)
            senders.append(node)
            entries.append(entry)
        total = None
        if payloads:
            try:
                total, rejections = add_ciphertexts(
                    self.public_context, payloads, expected_size=size
                )
            except NoValidCiphertextError as error:
                rejections, total = list(error.rejections), None
            bad = {item.index for item in rejections}
            for item in rejections:
                rejected.append(RejectedReply(senders[item.index], f"{item.kind}: {item.reason}"))
            senders = [node for index, node in enumerate(senders) if index not in bad]
            entries = [entry for index, entry in enumerate(entries) if index not in bad]
        for rejected_reply in rejected:
            log(
                logging.WARNING,
                "FedEvalFair round %d: rejected node %d: %s",
                round_number,
                rejected_reply.node_id,
                rejected_reply.reason,
            )
        return RoundCollection(
            total, tuple(senders), tuple(entries), tuple(rejected), tuple(unable), uploaded
        )

    def collect_ciphertexts(
        self,
        round_number: int,
        sent_to: Sequence[int],
        replies: Iterable[Message],
        size: int,
        *,
        run_id: int | None = None,
        reference: bytes = b"",
    ) -> tuple[bytes | None, list[int], list[RejectedReply], list[RejectedReply], dict[int, int]]:
        """:meth:`collect_round` as (sum or None, accepted nodes, rejected, unable, uploaded
        bytes per node)."""
        collected = self.collect_round(
            round_number, sent_to, replies, size, run_id=run_id, reference=reference
        )
        return (
            collected.total,
            list(collected.accepted),
            list(collected.rejected),
            list(collected.unable),
            collected.uploaded,
        )

    def collect_releases(
        self, replies: Iterable[Message], holders: Sequence[int]
    ) -> tuple[list[np.ndarray], list[RejectedReply]]:
        releases: list[np.ndarray] = []
        rejected: list[RejectedReply] = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node not in holders:
                rejected.append(RejectedReply(node, "unsolicited release"))
                continue
            if reply.has_error():
                rejected.append(RejectedReply(node, short_reason(reply.error.reason)))
                continue
            record = reply.content.array_records.get(FEF_KEY)
            try:
                release = np.asarray(record["release"].numpy(), dtype=np.float64)  # type: ignore[index]
            except Exception as error:  # noqa: BLE001 - any malformed reply is rejected
                rejected.append(RejectedReply(node, f"malformed release: {error!r}"))
                continue
            if release.shape != (self.layout.release_size,):
                rejected.append(RejectedReply(node, f"release of shape {release.shape}"))
                continue
            releases.append(release)
        return releases, rejected

    @staticmethod
    def round1_content(arrays: ArrayRecord) -> RecordDict:
        """Round 1: the global model (each node bootstraps its own test set)."""
        return RecordDict({"arrays": arrays})

    @staticmethod
    def endorse_content(entries: Sequence[SignedCiphertext]) -> RecordDict:
        """Endorsement: the signed round-1 ciphertexts, for a verifier to recompute the sum."""
        return RecordDict({FEF_KEY: _record(EndorseRequest(tuple(entries)).to_fields())})

    def collect_endorsements(
        self,
        replies: Iterable[Message],
        verifiers: Sequence[int],
        contributors: Sequence[bytes],
        *,
        run_id: int | None = None,
    ) -> tuple[bytes | None, list[tuple[int, bytes, bytes]], list[RejectedReply]]:
        """The endorsed sum (the first valid one) and every endorsement of those same bytes
        as (node, endorser key, signature); replies that are not a valid endorsement of the
        ``contributors``' sum are rejected."""
        chosen: bytes | None = None
        endorsements: list[tuple[int, bytes, bytes]] = []
        rejected: list[RejectedReply] = []
        keys = sorted(bytes(key) for key in contributors)
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node not in verifiers:
                rejected.append(RejectedReply(node, "unsolicited endorsement"))
                continue
            if reply.has_error():
                rejected.append(RejectedReply(node, short_reason(reply.error.reason)))
                continue
            record = reply.content.array_records.get(FEF_KEY)
            try:
                total = from_array(record["sum"].numpy())  # type: ignore[index]
                signature = _raw(record, "endorsement", SIGNATURE_BYTES)  # type: ignore[arg-type]
                endorser = _raw(record, "endorser", IDENTITY_KEY_BYTES)  # type: ignore[arg-type]
            except Exception as error:  # noqa: BLE001 - any malformed reply is rejected
                rejected.append(RejectedReply(node, f"malformed endorsement: {error!r}"))
                continue
            if signature is None or endorser is None:
                rejected.append(RejectedReply(node, "malformed endorsement"))
                continue
            digest = hashlib.sha256(total).digest()
            if run_id is not None and not verify_signature(
                endorser, signature, endorsement_transcript(run_id, 1, digest, keys)
            ):
                rejected.append(RejectedReply(node, "endorsement does not verify"))
                continue
            if chosen is None:
                chosen = total
            if total == chosen and all(endorser != known for _, known, _ in endorsements):
                endorsements.append((node, endorser, signature))
        return chosen, endorsements, rejected

    @staticmethod
    def round2_content(
        round1_sum: bytes,
        contributors: Sequence[bytes],
        endorsements: Sequence[tuple[bytes, bytes]],
    ) -> RecordDict:
        """Round 2: the endorsed round-1 sum, its sorted contributor keys and the
        ``(endorser, signature)`` endorsements (the count is the contributors' number)."""
        request = Round2Request(
            bytes(round1_sum),
            tuple(sorted(bytes(key) for key in contributors)),
            tuple((bytes(e), bytes(s)) for e, s in endorsements),
        )
        return RecordDict({FEF_KEY: _record(request.to_fields())})

    @staticmethod
    def commit_content(
        round1: Sequence[SignedCiphertext], round2: Sequence[SignedCiphertext]
    ) -> RecordDict:
        """Commitment (every round-2 participant): the signed digests of both sets."""
        return RecordDict({FEF_KEY: _record(CommitRequest.of(round1, round2).to_fields())})

    def collect_commitments(
        self,
        replies: Iterable[Message],
        round1: Sequence[SignedCiphertext],
        round2: Sequence[SignedCiphertext],
        senders: Sequence[int],
        *,
        run_id: int,
    ) -> tuple[list[tuple[int, bytes, bytes]], list[RejectedReply], NodeLedgerReports]:
        """The valid commitments to ``round1`` and ``round2`` as (node, signer, signature),
        in the order of ``senders`` (the round-2 participants, aligned with ``round2``): a
        reply counts only when its signer is the key the node signed its round-2 ciphertext
        with and the signature verifies for this run and these sets (the key holders check
        it again against their rosters). Also the ledger totals the committers reported (the
        DP mode: after the release's charge); a malformed one rejects the reply."""
        expected = {node: entry.signer for node, entry in zip(senders, round2, strict=True)}
        terms = self.layout.terms() + (b"" if self.dp is None else self.dp.terms())
        message = commitment_transcript(run_id, set_digest(round1), set_digest(round2), terms)
        found: dict[int, tuple[bytes, bytes]] = {}
        rejected: list[RejectedReply] = []
        ledgers = NodeLedgerReports()
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node not in expected or node in found:
                rejected.append(RejectedReply(node, "duplicate or unsolicited commitment"))
                continue
            if reply.has_error():
                rejected.append(RejectedReply(node, short_reason(reply.error.reason)))
                continue
            record = reply.content.array_records.get(FEF_KEY)
            try:
                commitment = CommitReply.from_fields(
                    {name: array.numpy() for name, array in record.items()}  # type: ignore[union-attr]
                )
            except Exception as error:  # noqa: BLE001 - any malformed reply is rejected
                rejected.append(RejectedReply(node, f"malformed commitment: {error!r}"))
                continue
            if commitment.signer != expected[node] or not verify_signature(
                commitment.signer, commitment.signature, message
            ):
                rejected.append(RejectedReply(node, "commitment does not verify"))
                continue
            try:
                totals = NodeLedgerReports.read(reply.content.metric_records.get(METRICS_KEY, {}))
            except ValueError as error:
                rejected.append(RejectedReply(node, f"malformed ledger totals: {error}"))
                continue
            ledgers.record(node, *totals)
            found[node] = (commitment.signer, commitment.signature)
        committed = [(node, *found[node]) for node in senders if node in found]
        return committed, rejected, ledgers

    @staticmethod
    def round3_content(
        round1: Sequence[SignedCiphertext],
        round2: Sequence[SignedCiphertext],
        commitments: Sequence[tuple[bytes, bytes]] = (),
    ) -> RecordDict:
        """Round 3 (key holders): both signed ciphertext sets (they recompute the sums) and
        the round-2 participants' ``(signer, signature)`` commitments to them."""
        request = Round3Request(
            tuple(round1), tuple(round2), tuple((bytes(k), bytes(s)) for k, s in commitments)
        )
        return RecordDict({FEF_KEY: _record(request.to_fields())})

    def reports(self, released: np.ndarray) -> tuple[BlockResult, ...]:
        """The (metric, mode) tests from a key holder's release (a block released as NaN was
        computed by fewer holders than the key holder's ``min-holders``)."""
        if self.dp is not None:
            return self.dp_reports(released)
        results = []
        for index, (metric, mode, comparison) in enumerate(self.layout.blocks):
            block = released[index * RELEASE_WIDTH : (index + 1) * RELEASE_WIDTH]
            stage1, totals = block[0], block[1 : 1 + BLOCK_WIDTH]
            effects = block[1 + BLOCK_WIDTH :]
            if not math.isfinite(totals[-1]):
                reason = (
                    f"fewer nodes than the key holder's min-holders could compute {metric}: "
                    "not released"
                )
                results.append(BlockResult(metric, mode, None, reason, comparison))
                continue
            clients = int(round(totals[-1]))
            if clients < 2:
                reason = f"only {clients} node(s) could compute {metric}"
                results.append(BlockResult(metric, mode, None, reason, comparison))
                continue
            if not math.isfinite(stage1):
                reason = "a node dropped between rounds; the paper's T1 cannot be corrected"
                results.append(BlockResult(metric, mode, None, reason, comparison))
                continue
            report = report_from_sums(
                totals,
                float(stage1),
                mode=mode,
                alpha=self.alpha,
                mu0=self.mu0,
                tolerance=self.tolerance,
                num_clients=clients,
                random_effects=_random_effects(effects) if mode == "calibrated" else None,
            )
            results.append(BlockResult(metric, mode, report, None, comparison))
        return tuple(results)

    def dp_reports(self, released: np.ndarray) -> tuple[BlockResult, ...]:
        """The tests of the holder-level DP mode from its noisy release
        (:func:`~fedparity.mechanisms.crypto.ckks.dp_report`); the paper blocks are not released."""
        assert self.dp is not None
        results = []
        for index, (metric, mode, comparison) in enumerate(self.layout.blocks):
            if index not in self.layout.dp_blocks:
                reason = (
                    "not released in the holder-level DP mode (the paper's weights have no "
                    "bounded sensitivity)"
                )
                results.append(BlockResult(metric, mode, None, reason, comparison))
                continue
            block = released[index * RELEASE_WIDTH : (index + 1) * RELEASE_WIDTH]
            count = block[BLOCK_WIDTH]  # the contribution's count slot
            holders = int(round(count)) if math.isfinite(count) else 0
            try:
                report = dp_report(
                    block[1:4],
                    holders,
                    dp=self.dp,
                    alpha=self.alpha,
                    mu0=self.mu0,
                    tolerance=self.tolerance,
                )
            except ValueError as error:
                results.append(BlockResult(metric, mode, None, str(error), comparison))
                continue
            results.append(BlockResult(metric, mode, report, None, comparison))
        return tuple(results)

    def start(self, grid: Grid, arrays: ArrayRecord, node_ids: Sequence[int]) -> FedEvalFairOutcome:
        """Run the rounds on ``node_ids``; never raises on bad or missing replies.

        Round 1, the verifiers' endorsement of its sum, round 2, every round-2 participant's
        commitment to both sets, round 3 (the key holders' release): each step below records
        what it saw in ``progress`` and stops the run with the reason when it cannot go on."""
        run_id = session_id(int(grid.run.run_id), self.session)
        progress = _Progress()
        try:
            first = self._round1(grid, arrays, node_ids, run_id, progress)
            sum1, endorsements = self._endorse(grid, first, run_id, progress)
            second = self._round2(grid, first, sum1, endorsements, run_id, progress)
            commitments = self._commit(grid, first, second, run_id, progress)
            release = self._round3(grid, first, second, commitments, progress)
        except _Withheld as stop:
            return self._finish(progress, str(stop))
        return self._finish(progress, None, self.reports(release), release)

    def _round1(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        node_ids: Sequence[int],
        run_id: int,
        progress: _Progress,
    ) -> RoundCollection:
        """Round 1 on ``node_ids``: their signed ciphertexts, summed by the server."""
        log(logging.INFO, "[FedEvalFair round 1/3] %d node(s)", len(node_ids))
        replies = self._send(
            grid, FEF_ROUND_MESSAGE_TYPES[0], node_ids, self.round1_content(arrays)
        )
        first = self.collect_round(1, node_ids, replies, self.layout.round1_size, run_id=run_id)
        round1 = list(first.accepted)
        progress.unable = list(first.unable)
        progress.rejected += [(1, item) for item in first.rejected]
        progress.record_round(first, node_ids)
        if first.total is None or len(round1) < self.min_clients:
            raise _Withheld(f"round 1: {len(round1)} valid ciphertext(s), need {self.min_clients}")
        return first

    def _endorse(
        self, grid: Grid, first: RoundCollection, run_id: int, progress: _Progress
    ) -> tuple[bytes, list[tuple[int, bytes, bytes]]]:
        """The verifiers (the first ``key_holders`` round-1 nodes) recompute and endorse the
        round-1 sum: (the endorsed sum, the endorsements)."""
        progress.verifiers.extend(sorted(first.accepted)[: self.key_holders])
        contributors = [entry.signer for entry in first.entries]
        log(logging.INFO, "[FedEvalFair endorsement] verifier(s) %s", progress.verifiers)
        replies = self._send(
            grid, FEF_ENDORSE_MESSAGE_TYPE, progress.verifiers, self.endorse_content(first.entries)
        )
        sum1, endorsements, rejected = self.collect_endorsements(
            replies, progress.verifiers, contributors, run_id=run_id
        )
        progress.rejected += [(1, item) for item in rejected]
        progress.endorsers.extend(node for node, _, _ in endorsements)
        if sum1 is None:
            raise _Withheld("endorsement: no verifier endorsed the round-1 sum")
        return sum1, endorsements

    def _round2(
        self,
        grid: Grid,
        first: RoundCollection,
        sum1: bytes,
        endorsements: Sequence[tuple[int, bytes, bytes]],
        run_id: int,
        progress: _Progress,
    ) -> RoundCollection:
        """Round 2 on the round-1 nodes: the endorsed sum in, their stage-2 ciphertexts out."""
        round1 = list(first.accepted)
        contributors = [entry.signer for entry in first.entries]
        log(logging.INFO, "[FedEvalFair round 2/3] %d node(s)", len(round1))
        content = self.round2_content(sum1, contributors, [(e, s) for _, e, s in endorsements])
        replies = self._send(grid, FEF_ROUND_MESSAGE_TYPES[1], round1, content)
        second = self.collect_round(
            2,
            round1,
            replies,
            self.layout.round2_size,
            run_id=run_id,
            reference=contributors_digest(contributors),
        )
        round2 = list(second.accepted)
        corrupt = [item for item in second.unable if CORRUPT_SUM_MARKER in item.reason]
        other = [item for item in second.unable if CORRUPT_SUM_MARKER not in item.reason]
        progress.rejected += [(2, item) for item in [*second.rejected, *other]]
        progress.corrupt += [(2, item) for item in corrupt]
        progress.record_round(second, round1)
        if corrupt:
            raise _Withheld(_corrupt_error(2, corrupt, round1))
        if second.total is None or len(round2) < self.min_clients:
            raise _Withheld(f"round 2: {len(round2)} valid ciphertext(s), need {self.min_clients}")
        if self.dp is None and set(round2) != set(round1):
            missing = sorted(set(round1) - set(round2))
            raise _Withheld(
                f"round 2: node(s) {missing} of round 1 sent no valid round-2 ciphertext; "
                "without holder-level DP the key holders release only over the round-1 set "
                "(every round-2 value depends on the round-1 sum, docs/threat-model.md): run "
                "the test again with the nodes that answer"
            )
        return second

    def _commit(
        self,
        grid: Grid,
        first: RoundCollection,
        second: RoundCollection,
        run_id: int,
        progress: _Progress,
    ) -> list[tuple[int, bytes, bytes]]:
        """Every round-2 participant commits to the round-1 and round-2 sets."""
        round2 = list(second.accepted)
        log(logging.INFO, "[FedEvalFair commitment] %d node(s)", len(round2))
        content = self.commit_content(first.entries, second.entries)
        replies = self._send(grid, FEF_COMMIT_MESSAGE_TYPE, round2, content)
        commitments, rejected, ledgers = self.collect_commitments(
            replies, first.entries, second.entries, round2, run_id=run_id
        )
        progress.rejected += [(2, item) for item in rejected]
        progress.ledgers.update(ledgers)
        progress.committers.extend(node for node, _, _ in commitments)
        if len(commitments) != len(round2):
            missing = sorted(set(round2) - set(progress.committers))
            raise _Withheld(
                f"commitment: round-2 node(s) {missing} did not commit to the round-1 and "
                "round-2 sets; a key holder releases only sets every round-2 node committed "
                "to; result withheld"
            )
        return commitments

    def _round3(
        self,
        grid: Grid,
        first: RoundCollection,
        second: RoundCollection,
        commitments: Sequence[tuple[int, bytes, bytes]],
        progress: _Progress,
    ) -> np.ndarray:
        """Round 3 on the key holders (the first ``key_holders`` round-2 nodes): their
        releases, which must agree; the first one is returned."""
        round2 = list(second.accepted)
        progress.holders = sorted(round2)[: self.key_holders]
        log(logging.INFO, "[FedEvalFair round 3/3] key holder(s) %s", progress.holders)
        content = self.round3_content(
            first.entries, second.entries, [(signer, sig) for _, signer, sig in commitments]
        )
        replies = self._send(grid, FEF_ROUND_MESSAGE_TYPES[2], progress.holders, content)
        releases, rejected = self.collect_releases(replies, progress.holders)
        corrupt = [item for item in rejected if CORRUPT_SUM_MARKER in item.reason]
        progress.rejected += [(3, item) for item in rejected if item not in corrupt]
        progress.corrupt += [(3, item) for item in corrupt]
        progress.uploaded.append({})
        progress.ciphertexts.append(0)  # round 3: the key holders release plaintext aggregates
        progress.participants.append(tuple(progress.holders))
        if corrupt:
            raise _Withheld(_corrupt_error(3, corrupt, round2))
        if not releases:
            raise _Withheld("round 3: no key holder released the statistics")
        first_release = releases[0]
        for other_release in releases[1:]:
            same = np.isclose(
                other_release,
                first_release,
                rtol=AGREEMENT_TOLERANCE,
                atol=AGREEMENT_TOLERANCE,
                equal_nan=True,
            )
            if not same.all():
                raise _Withheld("round 3: the key holders' releases disagree; result withheld")
        return first_release

    def _finish(
        self,
        progress: _Progress,
        error: str | None,
        blocks: tuple[BlockResult, ...] = (),
        released: np.ndarray | None = None,
    ) -> FedEvalFairOutcome:
        """The outcome of the run so far (``error``: why it stopped, logged)."""
        if error:
            log(logging.WARNING, "FedEvalFair: %s", error)
        return FedEvalFairOutcome(
            blocks=blocks,
            round_participants=tuple(progress.participants),
            dropped=tuple(progress.dropped),
            rejected=tuple(progress.rejected),
            unable=tuple(progress.unable),
            key_holders=tuple(progress.holders),
            uploaded_bytes=tuple(progress.uploaded),
            ciphertexts_per_node=tuple(progress.ciphertexts),
            error=error,
            released=() if released is None else tuple(float(x) for x in released),
            corrupt_sum_reports=tuple(progress.corrupt),
            verifiers=tuple(progress.verifiers),
            endorsers=tuple(progress.endorsers),
            committers=tuple(progress.committers),
            holder_dp=None if self.dp is None else self.dp.to_dict(),
            ledger_reports=progress.ledgers,
        )


class _Withheld(Exception):
    """A step of :meth:`FedEvalFairProtocol.start` cannot go on: the result is withheld (the
    message is the outcome's ``error``). Never leaves ``start``."""


def _corrupt_error(round_number: int, reports: list[RejectedReply], senders: Sequence[int]) -> str:
    which = "round-1" if round_number == 2 else "round-2"
    return (
        f"round {round_number}: {len(reports)} node(s) report that the {which} sum is "
        f"corrupt: at least one {which} ciphertext (senders: {sorted(senders)}) was "
        "encrypted under another key or carried out-of-range values; the server holds "
        "no secret key and cannot tell which node sent it; result withheld"
    )


@dataclass
class _Progress:
    """What one run of :meth:`FedEvalFairProtocol.start` has seen so far (its outcome)."""

    participants: list[tuple[int, ...]] = field(default_factory=list)
    dropped: list[tuple[int, ...]] = field(default_factory=list)
    rejected: list[tuple[int, RejectedReply]] = field(default_factory=list)
    corrupt: list[tuple[int, RejectedReply]] = field(default_factory=list)
    uploaded: list[dict[int, int]] = field(default_factory=list)
    #: Per round, the most ciphertexts accepted from one node (each accepted payload was
    #: checked to hold exactly one CKKS ciphertext by mechanisms.crypto.ckks.add_ciphertexts).
    ciphertexts: list[int] = field(default_factory=list)
    verifiers: list[int] = field(default_factory=list)
    endorsers: list[int] = field(default_factory=list)
    committers: list[int] = field(default_factory=list)
    #: Round 1's nodes that could not take part.
    unable: list[RejectedReply] = field(default_factory=list)
    holders: list[int] = field(default_factory=list)
    #: The ledger totals the committers reported (the DP mode).
    ledgers: NodeLedgerReports = field(default_factory=NodeLedgerReports)

    def record_round(self, collection: RoundCollection, asked: Sequence[int]) -> None:
        """Bytes, ciphertexts per node, participants and the nodes that never answered, of a
        round sent to ``asked``."""
        self.uploaded.append(collection.uploaded)
        self.ciphertexts.append(max(Counter(collection.accepted).values(), default=0))
        self.participants.append(tuple(collection.accepted))
        answered = {item.node_id for item in collection.rejected + collection.unable}
        answered |= set(collection.accepted)
        self.dropped.append(tuple(node for node in asked if node not in answered))


@dataclass(frozen=True)
class RoundCollection:
    """What :meth:`FedEvalFairProtocol.collect_round` kept of one round's replies."""

    #: The server's sum of the accepted ciphertexts (None when none was accepted).
    total: bytes | None
    #: Accepted nodes and their signed ciphertexts, in reply order.
    accepted: tuple[int, ...]
    entries: tuple[SignedCiphertext, ...]
    rejected: tuple[RejectedReply, ...]
    unable: tuple[RejectedReply, ...]
    #: Ciphertext bytes per accepted node.
    uploaded: dict[int, int]


def _raw(record: ArrayRecord, name: str, size: int) -> bytes | None:
    """The bytes of a ``size``-byte uint8 entry of ``record``, or None when it is absent or
    has another shape."""
    if name not in record:
        return None
    array = record[name].numpy()
    if array.dtype != np.uint8 or array.shape != (size,):
        return None
    return array.tobytes()


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(array) for name, array in arrays.items()})
