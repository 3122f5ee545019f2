"""Wire names, sizes and message types shared by the Flower handlers (``clients``) and
strategies.

The message types, record keys and FedEvalFair vector layouts that both ends of each
protocol must agree on, and the typed messages of the FPFL protocol
(:mod:`fedparity.mechanisms.protocol.fpfl`). No Flower import, so that a client never imports
a server strategy and a strategy never imports a client module.
"""

from __future__ import annotations

from ..fairness_tests.fedevalfair import (
    RANDOM_EFFECTS_FIELDS,
    ROUND1_FIELDS,
    STAGE1_FIELDS,
    Metric,
    Mode,
)
from ..validation import check_int, integer_range

__all__ = [
    "AUDIT_MESSAGE_TYPE",
    "BLOCKS",
    "BLOCK_WIDTH",
    "CONTRIBUTION_SIZE",
    "CORRUPT_SUM_MARKER",
    "EPSILON_SPENT_BASIC_DELTA_KEY",
    "EPSILON_SPENT_BASIC_KEY",
    "EPSILON_SPENT_DELTA_KEY",
    "EPSILON_SPENT_KEY",
    "LEDGER_NEW_KEY",
    "FEF_ENDORSE_MESSAGE_TYPE",
    "FEF_IDENTITY_REFUSAL",
    "FEF_KEY",
    "FEF_ROUND_MESSAGE_TYPES",
    "FPFL_KEY",
    "FPFL_CONFIRM_MESSAGE_TYPE",
    "FPFL_KEYS_MESSAGE_TYPE",
    "FPFL_REVEAL_MESSAGE_TYPE",
    "FPFL_ROUND_MESSAGE_TYPE",
    "FPFL_SETUP_MESSAGE_TYPE",
    "GROUPS_KEY",
    "METRICS_KEY",
    "MessageError",
    "RANDOM_EFFECTS_WIDTH",
    "RELEASE_SIZE",
    "SESSION_KEY",
    "RELEASE_WIDTH",
    "REPORTS_KEY",
    "ROUND1_SIZE",
    "ROUND2_SIZE",
    "STAGE1_WIDTH",
    "UNABLE_MARKER",
    "UNABLE_REPLY",
    "USER_COUNT_KEYS",
    "VALUES_KEY",
    "message_int",
]


class MessageError(ValueError):
    """A field of a received message is missing or malformed: the one error type of the wire
    protocols, raised the same way by a node and by a server. The text names the field only,
    never a value, so it is safe to send back (``fixed_text``)."""

    fixed_text = True


def message_int(key: str, value: object, *, minimum: int | None = None) -> int:
    """The integer a message field ``key`` holds, by the package's one integer rule
    (:func:`fedparity.mechanisms.validation.check_int`: an int, a numpy integer or an integral
    float); else a :class:`MessageError` naming the field and the range, never the value."""
    try:
        return check_int(key, value, minimum=minimum)
    except ValueError:
        raise MessageError(f"message field {key!r} must be {integer_range(minimum)}") from None


# -- sessions --------------------------------------------------------------------------------

#: Config record naming the session of a protocol message: a run that runs FPFL training or
#: the FedEvalFair test more than once (the pipeline: once per model) labels each execution,
#: and a node keeps each session's state apart and accepts only the labels its own run config
#: defines. Absent: the run's only session (label "").
SESSION_KEY = "fedparity-session"

# -- LDP gap audit ---------------------------------------------------------------------------

#: Message type of an audit; a ClientApp handles it with ``@app.query("ldp_audit")``.
AUDIT_MESSAGE_TYPE = "query.ldp_audit"
#: Record keys of an audit reply.
REPORTS_KEY = "reports"
GROUPS_KEY = "groups"
VALUES_KEY = "values"
METRICS_KEY = "metrics"
#: The totals of a node's privacy ledger in its replies (LDP audit and FPFL round): the most
#: epsilon any of its users has spent over every release the ledger recorded, at the users'
#: delta; and basic composition's epsilon and delta for the same user.
EPSILON_SPENT_KEY = "epsilon-spent-max"
EPSILON_SPENT_DELTA_KEY = "epsilon-spent-delta"
EPSILON_SPENT_BASIC_KEY = "epsilon-spent-max-basic"
EPSILON_SPENT_BASIC_DELTA_KEY = "epsilon-spent-basic-delta"
#: Sent beside those totals, as 1, by a node whose ledger file this release created: its
#: users' totals start here (a first run, or a ledger its operator reset), which the maximum
#: over the nodes would hide.
LEDGER_NEW_KEY = "ledger-new"
#: Per-user counts a reply carries: every user of the node is exactly one of these.
USER_COUNT_KEYS = ("num-reports", "num-refused", "num-undefined")

# -- FedEvalFair -----------------------------------------------------------------------------

FEF_KEY = "fef"
#: The three rounds, handled with ``@app.query("fef_round1")`` and so on.
FEF_ROUND_MESSAGE_TYPES = ("query.fef_round1", "query.fef_round2", "query.fef_round3")
#: Between rounds 1 and 2: the designated verifiers (the key holders) recompute the round-1
#: sum from the signed ciphertexts and endorse it (``@app.query("fef_endorse")``).
FEF_ENDORSE_MESSAGE_TYPE = "query.fef_endorse"
#: What a holder without an identity key or roster answers (a fixed sentence).
FEF_IDENTITY_REFUSAL = (
    "FedEvalFair needs this node's identity key and roster: set the node config keys "
    "identity-key and roster (files made by fedparity identity or fedparity keys --holders), "
    "or FEDPARITY_IDENTITY_DIR in a simulation's environment"
)
#: (metric, mode) of each block, in message order.
BLOCKS: tuple[tuple[Metric, Mode], ...] = (
    ("dp", "calibrated"),
    ("dp", "paper"),
    ("eo", "calibrated"),
    ("eo", "paper"),
)
BLOCK_WIDTH = len(ROUND1_FIELDS)  # [sum w, sum w Ybar, ..., group counts, count]
STAGE1_WIDTH = len(STAGE1_FIELDS)  # [stage-1 parts, sum u^2, random-effects grid sums]
CONTRIBUTION_SIZE = len(BLOCKS) * BLOCK_WIDTH
ROUND1_SIZE = CONTRIBUTION_SIZE + 1
ROUND2_SIZE = len(BLOCKS) * STAGE1_WIDTH + CONTRIBUTION_SIZE + 1
#: Width of a block's random-effects summary in the release (after the contribution sums).
RANDOM_EFFECTS_WIDTH = len(RANDOM_EFFECTS_FIELDS)
#: [stage-1 statistic, the block's contribution sums (its count last), random-effects summary]
RELEASE_WIDTH = 1 + BLOCK_WIDTH + RANDOM_EFFECTS_WIDTH
RELEASE_SIZE = len(BLOCKS) * RELEASE_WIDTH
#: Error-reply markers the server sorts replies by.
UNABLE_MARKER = "cannot take part"
CORRUPT_SUM_MARKER = "encrypted sum is corrupt"
#: What a node that cannot take part tells the server: a fixed sentence, no counts (its
#: detailed reason, with cell counts, stays in the node's own log).
UNABLE_REPLY = (
    f"{UNABLE_MARKER}: no metric can be bootstrapped on this node's test set "
    "(a group or a prediction is missing, or one is below fef-min-cell rows)"
)

# -- FPFL ------------------------------------------------------------------------------------

FPFL_KEY = "fpfl"
FPFL_SETUP_MESSAGE_TYPE = "query.fpfl_setup"
FPFL_KEYS_MESSAGE_TYPE = "query.fpfl_keys"
FPFL_ROUND_MESSAGE_TYPE = "query.fpfl_round"
FPFL_REVEAL_MESSAGE_TYPE = "query.fpfl_reveal"
#: Rounds in which a node dropped: the survivors attest the view before any unmask.
FPFL_CONFIRM_MESSAGE_TYPE = "query.fpfl_confirm"
