"""The one integer rule (``fedparity.mechanisms.validation``): ``check_int`` for values,
``parse_int`` for text, one wording; and the callers that had their own rule now agree.

Before (review of 2026-11-26, P5): eight integer validators, each with its own rule; the run
config and the node policy took ``"3"``, the LDP request took ``3.0`` but not numpy, the FPFL
data and model builders refused ``3.0``, the LDP handler and ``FPFLNodeSettings`` refused numpy
integers, and the command line had a rule of its own.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from fedparity.mechanisms import check_int, parse_int
from fedparity.mechanisms.protocol.fpfl import FPFLRunParameters
from fedparity.mechanisms.validation import MAX_GROUPS, check_num_groups, integer_range

# --------------------------------------------------------------------------------------------
# check_int
# --------------------------------------------------------------------------------------------

ACCEPTED = [
    (3, 3),
    (-4, -4),
    (2**70, 2**70),  # Python ints are unbounded
    (np.int64(3), 3),
    (np.int32(3), 3),
    (np.uint8(3), 3),
    (3.0, 3),
    (-0.0, 0),
    (np.float64(3.0), 3),
    (np.float32(3.0), 3),
    (1e6, 1_000_000),
]
REJECTED = [
    True,
    False,
    np.bool_(True),
    3.5,
    np.float64(0.5),
    math.nan,
    math.inf,
    -math.inf,
    "3",
    b"3",
    None,
    [3],
    np.array([3]),
    Decimal(3),
    Fraction(3, 1),
    3 + 0j,
]


@pytest.mark.parametrize(("value", "expected"), ACCEPTED, ids=repr)
def test_check_int_accepts_integers_and_integral_floats(value: object, expected: int) -> None:
    result = check_int("n", value)
    assert result == expected
    assert type(result) is int  # never a numpy scalar or a float


@pytest.mark.parametrize("value", REJECTED, ids=repr)
def test_check_int_rejects_everything_else(value: object) -> None:
    with pytest.raises(ValueError, match=r"^n must be an integer, got "):
        check_int("n", value)


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "message"),
    [
        (3.5, 2, MAX_GROUPS, "num_groups must be an integer in [2, 1024], got 3.5"),
        (1, 2, MAX_GROUPS, "num_groups must be an integer in [2, 1024], got 1"),
        (1025, 2, MAX_GROUPS, "num_groups must be an integer in [2, 1024], got 1025"),
        (np.int64(1), 2, None, "num_groups must be an integer >= 2, got np.int64(1)"),
        (0.0, 1, None, "num_groups must be an integer >= 1, got 0.0"),
        (10, None, 9, "num_groups must be an integer <= 9, got 10"),
        ("3", None, None, "num_groups must be an integer, got '3'"),
        (True, 0, 1, "num_groups must be an integer in [0, 1], got True"),
    ],
)
def test_the_message_names_the_parameter_the_range_and_the_value(
    value: object, minimum: int | None, maximum: int | None, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        check_int("num_groups", value, minimum=minimum, maximum=maximum)
    assert str(raised.value) == message


def test_the_bounds_are_inclusive() -> None:
    assert check_int("k", 2, minimum=2, maximum=2) == 2
    assert check_int("k", 2.0, minimum=2, maximum=2) == 2
    assert integer_range(2, 9) == "an integer in [2, 9]"
    assert integer_range(0) == "an integer >= 0"
    assert integer_range(maximum=9) == "an integer <= 9"
    assert integer_range() == "an integer"


def test_the_shorthands_keep_the_rule() -> None:
    # check_num_groups once refused 3.0 while check_int_at_least took it: one rule now.
    assert check_num_groups(3.0) == 3
    assert check_num_groups(np.int16(3)) == 3
    with pytest.raises(ValueError, match=r"num_groups must be an integer in \[2, 1024\]"):
        check_num_groups("3")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# parse_int
# --------------------------------------------------------------------------------------------

TEXT_ACCEPTED = [
    ("3", 3),
    (" 3 ", 3),
    ("\t3\n", 3),
    ("+3", 3),
    ("-2", -2),
    ("007", 7),
    ("1_000", 1000),
    ("12345678901234567891", 12345678901234567891),  # exact, never through a float
    ("3.0", 3),
    ("1e3", 1000),
    ("1E6", 1_000_000),
    ("2.5e1", 25),
    # not text: the value rule
    (3, 3),
    (3.0, 3),
    (np.int64(3), 3),
]
TEXT_REJECTED = ["3.5", "", "   ", "abc", "3 apples", "nan", "inf", "-inf", "1e400", "0x10"]
TEXT_REJECTED += ["1e-3", "½"]


@pytest.mark.parametrize(("text", "expected"), TEXT_ACCEPTED, ids=repr)
def test_parse_int_reads_integers_from_text(text: object, expected: int) -> None:
    result = parse_int("--clients", text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize("text", [*TEXT_REJECTED, True, 3.5, None, b"3"], ids=repr)
def test_parse_int_rejects_what_is_not_an_integer(text: object) -> None:
    with pytest.raises(ValueError) as raised:
        parse_int("--clients", text, minimum=1)
    assert str(raised.value) == f"--clients must be an integer >= 1, got {text!r}"


def test_parse_int_checks_the_range_and_shows_the_text_given() -> None:
    with pytest.raises(ValueError) as raised:
        parse_int("max-groups", " 1 ", minimum=2, maximum=MAX_GROUPS)
    assert str(raised.value) == "max-groups must be an integer in [2, 1024], got ' 1 '"
    with pytest.raises(ValueError, match=r"in \[2, 1024\], got '1e4'"):
        parse_int("max-groups", "1e4", minimum=2, maximum=MAX_GROUPS)


# --------------------------------------------------------------------------------------------
# The callers agree
# --------------------------------------------------------------------------------------------

#: num-groups = 3 as each source may carry it: a TOML integer, a TOML float, numpy (a library
#: user's array), the text of an environment variable or a quoted TOML value.
FORMS = {"int": 3, "float": 3.0, "numpy": np.int64(3), "text": "3"}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_run_config_and_the_node_policy_read_every_form(form: str) -> None:
    from fedparity.clients.policy import NodePrivacyPolicy
    from fedparity.clients.project.config import RunConfig

    value = FORMS[form]
    assert RunConfig.from_mapping({"num-groups": value}).num_groups == 3
    policy = NodePrivacyPolicy.from_mapping({"max-groups": value}, source="test")
    assert policy.max_groups == 3
    assert type(policy.max_groups) is int


@pytest.mark.parametrize("value", [3.5, "3.5", "abc", True, math.nan])
def test_the_run_config_and_the_node_policy_refuse_the_same_values(value: object) -> None:
    from fedparity.clients.policy import NodePrivacyPolicy
    from fedparity.clients.project.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=f"^num-groups must be an integer >= 2, got {value!r}"):
        RunConfig.from_mapping({"num-groups": value})
    with pytest.raises(
        ValueError, match=f"^privacy-policy key max-groups must be an integer >= 2, got {value!r}"
    ):
        NodePrivacyPolicy.from_mapping({"max-groups": value}, source="test")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_node_config_reads_every_form(form: str) -> None:
    # The node's own num-groups (beside its data file) once took "3" but not numpy or " 3 ";
    # its partition once went through int(), which truncated 1.5 to 1.
    from fedparity.clients.app import _partition
    from fedparity.clients.project.own_data import node_num_groups

    value = FORMS[form]
    assert node_num_groups({"num-groups": value}) == 3
    context = SimpleNamespace(node_config={"partition-id": value, "num-partitions": 4})
    assert _partition(context) == (3, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [3.5, "3.5", "abc", True, None, 1, 2000])
def test_the_node_config_refuses_the_same_values(value: object) -> None:
    from fedparity.clients.app import _partition
    from fedparity.clients.messages import NodeRefusal
    from fedparity.clients.project.own_data import (
        NUM_GROUPS_MISSING_REFUSAL,
        node_num_groups,
    )

    with pytest.raises(NodeRefusal, match=re.escape(NUM_GROUPS_MISSING_REFUSAL)):
        node_num_groups({"num-groups": value})
    if value not in (1, None):
        context = SimpleNamespace(node_config={"partition-id": value, "num-partitions": 4})
        with pytest.raises(ValueError, match=r"^partition-id must be an integer in \[0, 3\]"):
            _partition(context)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [("3", 3), (" 3 ", 3), ("3.0", 3), ("1e1", 10)])
def test_the_command_line_reads_the_same_text(text: str, expected: int) -> None:
    from fedparity.server.cli._common import _groups, _integer

    assert _groups(text) == expected
    assert _integer("--clients", text, 1) == expected


@pytest.mark.parametrize("text", ["3.5", "", "abc", "1", "2000"])
def test_the_command_line_refuses_with_the_option_name_and_range(text: str) -> None:
    from fedparity.server.cli._common import UsageError, _groups

    with pytest.raises(UsageError) as raised:
        _groups(text)
    assert str(raised.value) == f"--groups must be an integer in [2, 1024], got {text!r}"


@pytest.mark.parametrize("form", ["int", "float", "numpy"])
def test_the_ldp_request_reads_the_value_forms_and_refuses_text(form: str) -> None:
    from fedparity.mechanisms.protocol import MessageError
    from fedparity.mechanisms.protocol.ldp_audit import LdpAuditRequest

    fields = _ldp_request_fields()
    fields["num-groups"] = FORMS[form]
    assert LdpAuditRequest.from_fields(fields).num_groups == 3
    fields["num-groups"] = "3"  # the wire is typed: text is a malformed message
    with pytest.raises(MessageError) as raised:
        LdpAuditRequest.from_fields(fields)
    # a fixed text: the field and the range, never the value
    assert str(raised.value) == "message field 'num-groups' must be an integer"


def test_the_fpfl_wire_refuses_floats_on_purpose() -> None:
    # The FPFL fields are written as ints by both ends and pinned by a digest; a float there is
    # a malformed message (mechanisms/protocol/fpfl.py ``_int``), numpy integers are not.
    from fedparity.mechanisms.protocol import MessageError

    fields = _fpfl_parameters().to_fields()
    fields["num-groups"] = np.int64(3)
    read = FPFLRunParameters.from_fields(fields)
    assert read.num_groups == 3 and type(read.num_groups) is int
    assert read.digest() == _fpfl_parameters(num_groups=3).digest()
    for value in (3.0, "3", True, 1):
        fields["num-groups"] = value
        with pytest.raises(MessageError) as raised:
            FPFLRunParameters.from_fields(fields)
        assert str(raised.value) == "message field 'num-groups' must be an integer >= 2"


def test_the_client_message_fields_follow_the_rule() -> None:
    from fedparity.clients.messages import int_field, int_list_field
    from fedparity.mechanisms.protocol import MessageError

    for value in (3, 3.0, np.int64(3)):
        assert int_field({"server-round": value}, "server-round", minimum=0) == 3
    for value in ("3", 3.5, True, -1):
        with pytest.raises(MessageError, match="'server-round' must be an integer >= 0$"):
            int_field({"server-round": value}, "server-round", minimum=0)
    assert int_list_field({"ids": [1, 2.0, np.int8(3)]}, "ids") == [1, 2, 3]
    with pytest.raises(MessageError, match="'ids' must be a list of integers$"):
        int_list_field({"ids": [1, "2"]}, "ids")


@pytest.mark.parametrize("form", ["int", "float", "numpy"])
def test_the_library_entry_points_take_the_value_forms(form: str) -> None:
    # Before: the LDP handler and FPFLNodeSettings refused numpy integers, the model builder
    # and the population refused 3.0.
    from fedparity.clients.fpfl_node import FPFLNodeSettings
    from fedparity.clients.fpfl_task import build_mlp
    from fedparity.clients.ldp import ldp_audit_handler
    from fedparity.clients.project.fpfl_data import synthetic_fpfl_users

    value = FORMS[form]
    assert callable(ldp_audit_handler(lambda context: None, num_groups=value))  # type: ignore[arg-type]
    settings = FPFLNodeSettings(
        constraint="fnr", cohort_size=value, rounds=value, clipping_bound=1.0, epsilon=None
    )
    assert settings.cohort_size == 3 and type(settings.rounds) is int
    assert build_mlp(value, (4,), num_classes=value, seed=value)[0].in_features == 3
    users = synthetic_fpfl_users(value * 10, seed=value, num_groups=value)
    assert users.num_groups == 3 and type(users.num_groups) is int


def test_the_library_entry_points_refuse_the_same_values() -> None:
    from fedparity.clients.fpfl_node import FPFLNodeSettings
    from fedparity.clients.fpfl_task import build_mlp
    from fedparity.clients.ldp import ldp_audit_handler

    for value in (3.5, "3", True):
        with pytest.raises(ValueError, match="num_groups must be an integer >= 2, got"):
            ldp_audit_handler(lambda context: None, num_groups=value)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="rounds must be an integer >= 1, got"):
            FPFLNodeSettings(
                constraint="fnr", cohort_size=3, rounds=value, clipping_bound=1.0, epsilon=None
            )
        with pytest.raises(ValueError, match="num_features must be an integer >= 1, got"):
            build_mlp(value, (4,))  # type: ignore[arg-type]


def _ldp_request_fields() -> dict[str, object]:
    from fedparity.mechanisms.protocol.ldp_audit import LdpAuditRequest

    request = LdpAuditRequest(
        mechanism="R",
        epsilon_group=0.5,
        epsilon_value=1.0,
        num_groups=3,
        budget=2.0,
        metric="tpr",
    )
    return dict(request.to_fields())


def _fpfl_parameters(num_groups: int = 3) -> FPFLRunParameters:
    return FPFLRunParameters(
        population_size=100,
        cohort_size=10,
        rounds=2,
        clipping_bound=1.0,
        epsilon=None,
        delta=None,
        noise_multiplier=0.0,
        accountant="rdp",
        constraint="fnr",
        num_groups=num_groups,
        vector_size=8,
        distributed_noise=True,
        masking=True,
        dropout_tolerance=0.2,
    )
