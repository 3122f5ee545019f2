"""A node's refusal reads as one sentence: one log line instead of Flower's tracebacks, and the
whole sentence on the server (issue 28: a FedEvalFair holder without its key printed about 290
lines of tracebacks while the server's warning was clipped at both ends)."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedparity.clients import HolderRows, fedevalfair_handlers
from fedparity.clients.fedevalfair_handlers import (
    FEF_SECRET_CONTEXT_REFUSAL,
    SecretContextRefusal,
)
from fedparity.clients.identity import NodeIdentity
from fedparity.clients.messages import INTERNAL_ERROR_TEXT, NodeRefusal
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms.crypto.ckks import KeyMaterialError
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from fedparity.mechanisms.protocol import FEF_ROUND_MESSAGE_TYPES
from fedparity.mechanisms.protocol.refusal_log import OneLineRefusals
from fedparity.strategies.replies import MAX_REASON_LENGTH, short_reason

pytestmark = pytest.mark.usefixtures("task_identity")


def formatted(error: BaseException) -> str:
    """The traceback text of ``error`` raised and caught here."""
    try:
        raise error
    except BaseException:  # noqa: BLE001 - formatting whatever was raised
        return traceback.format_exc()


def record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = None if exc is None else (type(exc), exc, exc.__traceback__)
    return logging.LogRecord("flwr", logging.ERROR, __file__, 1, message, (), exc_info)


def test_a_fixed_refusal_with_its_traceback_becomes_its_sentence() -> None:
    refusal = OneLineRefusals()
    # deployed flwr-clientapp: log(ERROR, "%s raised an exception", ..., exc_info=ex)
    try:
        raise NodeRefusal("a fixed sentence")
    except NodeRefusal as error:
        item = record("ClientApp raised an exception", error)
    assert refusal.filter(item) and item.exc_info is None
    assert item.getMessage() == "a ClientApp refused: a fixed sentence"
    # the simulation engine: the Ray actor's traceback as text, then its own copy
    ray_text = "ray::ClientAppActor.run() (pid=1)\n" + formatted(NodeRefusal("the sentence"))
    ray_text += "\nflwr.clientapp.client_app.ClientAppException: \nException occurred."
    item = record(ray_text)
    assert refusal.filter(item)
    assert item.getMessage() == "a ClientApp refused: the sentence"
    assert not refusal.filter(record(formatted(SecretContextRefusal())))
    # the ServerApp's own fixed-text errors (a run config refused) are not a node's refusal
    try:
        raise NodeRefusal("a server-side sentence")
    except NodeRefusal as error:
        item = record("ServerApp raised an exception", error)
    assert refusal.filter(item) and item.exc_info is not None
    assert item.getMessage() == "ServerApp raised an exception"


def test_other_errors_keep_their_tracebacks() -> None:
    refusal = OneLineRefusals()
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError as error:
        item = record("ClientApp raised an exception", error)
    assert refusal.filter(item) and item.exc_info is not None
    text = formatted(ValueError("a value"))
    item = record(text)
    assert refusal.filter(item) and item.getMessage() == text
    # a fedparity exception whose text is not fixed is not shortened either
    text = formatted(KeyMaterialError("cannot read /secret/path"))
    assert refusal.filter(record(text))
    info = logging.LogRecord("flwr", logging.INFO, __file__, 1, text, (), None)
    assert refusal.filter(info) and info.getMessage() == text


def test_the_server_reads_the_whole_sentence_out_of_flowers_wrapping() -> None:
    sentence = FEF_SECRET_CONTEXT_REFUSAL
    deployed = (
        f"<class 'fedparity.clients.fedevalfair_handlers.SecretContextRefusal'>:<'{sentence}'>"
    )
    simulated = (
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\n"
        f"Exception ClientAppException occurred. Message: {sentence}'>"
    )
    assert len(deployed) > MAX_REASON_LENGTH  # clipped at both ends before
    assert short_reason(deployed) == sentence
    assert short_reason(simulated) == sentence
    long = "Traceback ...\n" + "x" * 1000 + "\nValueError: the end"
    assert short_reason(long).endswith("ValueError: the end")
    assert len(short_reason(long)) == MAX_REASON_LENGTH + 3


def test_a_holder_without_its_key_refuses_with_a_fixed_sentence_and_logs_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "not-there" / "secret.tenseal"
    keys = {"a": IdentityKey.generate(), "b": IdentityKey.generate()}
    identity = NodeIdentity(keys["a"], Roster.from_keys(keys))
    handlers = fedevalfair_handlers(
        lambda arrays, context: HolderRows(np.ones(4), np.ones(4), np.array([0, 1, 0, 1])),
        secret_context=missing,
        policy=NodePrivacyPolicy(),
        identity=lambda context: identity,
    )
    message = Message(
        content=RecordDict({"arrays": ArrayRecord()}),
        dst_node_id=1,
        message_type=FEF_ROUND_MESSAGE_TYPES[0],
    )
    context = Context(1, 1, {}, RecordDict(), {})
    with caplog.at_level(logging.ERROR), pytest.raises(SecretContextRefusal) as refused:
        handlers["fef_round1"](message, context)
    assert str(refused.value) == FEF_SECRET_CONTEXT_REFUSAL != INTERNAL_ERROR_TEXT
    assert str(missing) not in str(refused.value)  # the path stays on the node
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and str(missing) in lines[0]
