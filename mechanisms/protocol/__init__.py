"""Wire names, sizes and message types shared by the Flower handlers (``clients``) and
strategies.

The message types, record keys and FedEvalFair vector layouts that both ends of each
protocol must agree on, and the typed messages of the FPFL protocol
(:mod:`fedparity.mechanisms.protocol.fpfl`). No Flower import, so that a client never imports
a server strategy and a strategy never imports a client module.
"""

from __future__ import annotations

from ..fairness_tests.fedevalfair import Metric, Mode
from ..fairness_tests.fedevalfair_layout import (
    BLOCK_WIDTH,
    DEFAULT_LAYOUT,
    MAX_VECTOR_SIZE,
    RANDOM_EFFECTS_WIDTH,
    RELEASE_WIDTH,
    STAGE1_WIDTH,
    FedEvalFairBlock,
    FedEvalFairLayout,
)
from ..validation import check_int, integer_range

__all__ = [
    "AUDIT_MESSAGE_TYPE",
    "BLOCKS",
    "BLOCK_WIDTH",
    "CONTRIBUTION_SIZE",
    "CORRUPT_SUM_MARKER",
    "DEFAULT_LAYOUT",
    "EPSILON_SPENT_BASIC_DELTA_KEY",
    "EPSILON_SPENT_BASIC_KEY",
    "EPSILON_SPENT_DELTA_KEY",
    "EPSILON_SPENT_KEY",
    "LEDGER_NEW_KEY",
    "FEF_ENDORSE_MESSAGE_TYPE",
    "FEF_IDENTITY_REFUSAL",
    "FEF_KEY",
    "FEF_ROUND_MESSAGE_TYPES",
    "FedEvalFairBlock",
    "FedEvalFairLayout",
    "FPFL_KEY",
    "FPFL_CONFIRM_MESSAGE_TYPE",
    "FPFL_KEYS_MESSAGE_TYPE",
    "FPFL_REVEAL_MESSAGE_TYPE",
    "FPFL_ROUND_MESSAGE_TYPE",
    "FPFL_SETUP_MESSAGE_TYPE",
    "GROUPS_KEY",
    "MAX_VECTOR_SIZE",
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
#: The default layout's (metric, mode) blocks, in message order (a run's own blocks:
#: :attr:`FedEvalFairLayout.blocks`; the sizes below are the default layout's too).
BLOCKS: tuple[tuple[Metric, Mode], ...] = tuple(
    (block.metric, block.mode) for block in DEFAULT_LAYOUT.blocks
)
CONTRIBUTION_SIZE = DEFAULT_LAYOUT.contribution_size
ROUND1_SIZE = DEFAULT_LAYOUT.round1_size
ROUND2_SIZE = DEFAULT_LAYOUT.round2_size
RELEASE_SIZE = DEFAULT_LAYOUT.release_size
#: Error-reply markers the server sorts replies by. fedparity's FedEvalFair holders never
#: refuse for their data (one that can compute no metric takes part with weight 0); a reply
#: with UNABLE_MARKER comes from another app's holder and is listed apart from rejections.
UNABLE_MARKER = "cannot take part"
CORRUPT_SUM_MARKER = "encrypted sum is corrupt"

# -- FPFL ------------------------------------------------------------------------------------

FPFL_KEY = "fpfl"
FPFL_SETUP_MESSAGE_TYPE = "query.fpfl_setup"
FPFL_KEYS_MESSAGE_TYPE = "query.fpfl_keys"
FPFL_ROUND_MESSAGE_TYPE = "query.fpfl_round"
FPFL_REVEAL_MESSAGE_TYPE = "query.fpfl_reveal"
#: Rounds in which a node dropped: the survivors attest the view before any unmask.
FPFL_CONFIRM_MESSAGE_TYPE = "query.fpfl_confirm"
