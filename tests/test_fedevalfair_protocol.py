"""The encrypted FedEvalFair protocol, message by message, with the real ClientApp handlers,
real TenSEAL ciphertexts and the real server strategy (threat model:
:mod:`fedparity.mechanisms.ckks`).

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version).

What is checked: a node's round-1/2 replies carry one uint8 ciphertext and nothing else; the
server's context has no secret key and cannot decrypt; the three rounds give the same
p-values as the plaintext computation (1e-6); bad ciphertexts are rejected, not fatal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedparity.clients.app import fef_round1, fef_round2, fef_round3, load_shard_for
from fedparity.clients.config import RunConfig
from fedparity.clients.fedevalfair import bootstrap_seed, client_statistics, holder_predictions
from fedparity.clients.task import build_model, get_arrays, set_arrays
from fedparity.mechanisms.ckks import (
    NODE_CONFIG_KEY,
    CkksParameters,
    KeyPaths,
    context_has_secret_key,
    decrypt_vector,
    encrypt_vector,
    from_array,
    generate_keys,
    load_public_context,
    load_secret_context,
    to_array,
)
from fedparity.mechanisms.fairtest import fedevalfair
from fedparity.mechanisms.protocol import (
    BLOCKS,
    FEF_KEY,
    FEF_ROUND_MESSAGE_TYPES,
    ROUND1_SIZE,
    ROUND2_SIZE,
)
from fedparity.strategies.fedevalfair import FedEvalFairProtocol

NUM_HOLDERS = 3
RUN_CONFIG = {"task": "fedevalfair", "users-per-node": 1500, "fef-resamples": 60}


pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeyPaths:
    return generate_keys(tmp_path_factory.mktemp("keys"))


def holder_context(partition_id: int, keys: KeyPaths) -> Context:
    return Context(
        run_id=1,
        node_id=100 + partition_id,
        node_config={
            "partition-id": partition_id,
            "num-partitions": NUM_HOLDERS,
            NODE_CONFIG_KEY: str(keys.secret),
        },
        state=RecordDict(),
        run_config=dict(RUN_CONFIG),
    )


def request(node_id: int, round_index: int, content: RecordDict) -> Message:
    return Message(
        content=content, dst_node_id=node_id, message_type=FEF_ROUND_MESSAGE_TYPES[round_index]
    )


def model_arrays(config: RunConfig) -> ArrayRecord:
    shard = load_shard_for(config, 0, NUM_HOLDERS, "test")
    return ArrayRecord(get_arrays(build_model(shard.num_features, seed=config.seed)))


def plaintext_reports(config: RunConfig, arrays: ArrayRecord) -> dict[tuple[str, str], object]:
    """What the holders compute, done in one process without encryption."""
    per_block: dict[tuple[str, str], list] = {block: [] for block in BLOCKS}
    for partition in range(NUM_HOLDERS):
        shard = load_shard_for(config, partition, NUM_HOLDERS, "test")
        rng = np.random.default_rng(bootstrap_seed(config.seed, partition))
        model = build_model(shard.num_features, seed=config.seed)
        set_arrays(model, list(arrays.to_numpy_ndarrays()))
        predictions = holder_predictions(model, shard, config.fef_variant, rng)
        statistics = client_statistics(
            shard,
            predictions,
            num_resamples=config.fef_resamples,
            rng=rng,
            min_cell_count=config.fef_min_cell,
        )
        for block, summary in zip(BLOCKS, statistics.summaries, strict=True):
            per_block[block].append(summary)
    return {
        (metric, mode): fedevalfair(summaries, mode=mode)  # type: ignore[arg-type]
        for (metric, mode), summaries in per_block.items()
    }


def test_server_context_holds_no_secret_key(keys: KeyPaths) -> None:
    public = load_public_context(keys.public)
    assert not context_has_secret_key(public)
    FedEvalFairProtocol(public)  # accepted
    with pytest.raises(ValueError, match="secret key"):
        FedEvalFairProtocol(load_secret_context(keys.secret))


def test_three_rounds_match_the_plaintext_test(keys: KeyPaths) -> None:
    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(keys.public))
    contexts = [holder_context(p, keys) for p in range(NUM_HOLDERS)]
    nodes = [c.node_id for c in contexts]

    # Round 1: one ciphertext per node and nothing else.
    replies = [
        fef_round1(request(c.node_id, 0, protocol.round1_content(arrays)), c, config)
        for c in contexts
    ]
    for reply in replies:
        content = reply.content
        assert list(content.array_records) == [FEF_KEY]
        assert not content.metric_records and not content.config_records
        assert list(content.array_records[FEF_KEY]) == ["ciphertext"]
        assert content.array_records[FEF_KEY]["ciphertext"].numpy().dtype == np.uint8
    sum1, round1, rejected, unable, uploaded = protocol.collect_ciphertexts(
        1, nodes, replies, ROUND1_SIZE
    )
    assert round1 == nodes and not rejected and not unable
    # The server cannot read what it added: decrypting needs the secret key.
    with pytest.raises(Exception):  # noqa: B017 - tenseal raises its own error types
        decrypt_vector(load_public_context(keys.public), sum1)

    # Round 2
    replies = [
        fef_round2(request(c.node_id, 1, protocol.round2_content(sum1, len(round1))), c, config)
        for c in contexts
    ]
    for reply in replies:
        assert list(reply.content.array_records[FEF_KEY]) == ["ciphertext"]
        assert not reply.content.metric_records
    sum2, round2, rejected, _, _ = protocol.collect_ciphertexts(2, round1, replies, ROUND2_SIZE)
    assert round2 == nodes and not rejected

    # Round 3: two key holders release the same aggregates.
    holders = contexts[:2]
    content = protocol.round3_content(sum1, len(round1), sum2, len(round2))
    replies = [fef_round3(request(c.node_id, 2, content), c, config) for c in holders]
    releases, rejected = protocol.collect_releases(replies, [c.node_id for c in holders])
    assert len(releases) == 2 and not rejected
    np.testing.assert_allclose(releases[0], releases[1], rtol=1e-6, atol=1e-6)

    expected = plaintext_reports(config, arrays)
    for block in protocol.reports(releases[0]):
        plain = expected[(block.metric, block.mode)]
        assert block.report is not None
        for mine, theirs in (
            (block.report.homogeneity, plain.homogeneity),  # type: ignore[attr-defined]
            (block.report.common_disparity, plain.common_disparity),  # type: ignore[attr-defined]
        ):
            assert mine.pvalue == pytest.approx(theirs.pvalue, abs=1e-6)
            assert mine.statistic == pytest.approx(theirs.statistic, rel=1e-6, abs=1e-9)


def test_bad_ciphertexts_are_rejected_and_the_sum_goes_on(keys: KeyPaths, tmp_path: Path) -> None:
    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(keys.public))
    contexts = [holder_context(p, keys) for p in range(NUM_HOLDERS)]
    good = [
        fef_round1(request(c.node_id, 0, protocol.round1_content(arrays)), c, config)
        for c in contexts
    ]
    garbage = Message(
        content=RecordDict({FEF_KEY: ArrayRecord({"ciphertext": _array(b"not a ciphertext")})}),
        reply_to=request(200, 0, RecordDict({})),
    )
    other_keys = generate_keys(tmp_path / "other", None)
    foreign_parameters = CkksParameters(16384, (60, 40, 40, 60), 40)
    foreign = encrypt_vector(foreign_parameters.make_context(), np.ones(ROUND1_SIZE))
    wrong_parameters = Message(
        content=RecordDict({FEF_KEY: ArrayRecord({"ciphertext": _array(foreign)})}),
        reply_to=request(201, 0, RecordDict({})),
    )
    wrong_length = Message(
        content=RecordDict(
            {
                FEF_KEY: ArrayRecord(
                    {
                        "ciphertext": _array(
                            encrypt_vector(load_secret_context(other_keys.secret), np.ones(5))
                        )
                    }
                )
            }
        ),
        reply_to=request(202, 0, RecordDict({})),
    )
    nodes = [c.node_id for c in contexts] + [200, 201, 202]
    total, accepted, rejected, _, _ = protocol.collect_ciphertexts(
        1, nodes, [*good, garbage, wrong_parameters, wrong_length], ROUND1_SIZE
    )
    assert accepted == [c.node_id for c in contexts]
    assert sorted(item.node_id for item in rejected) == [200, 201, 202]
    decrypted = decrypt_vector(load_secret_context(keys.secret), total, expected_size=ROUND1_SIZE)
    assert decrypted[-1] == pytest.approx(3.0, abs=1e-4)  # count slot: the three good ones


def _array(data: bytes) -> Array:
    return Array(to_array(data))


def test_arrays_roundtrip_is_lossless() -> None:
    payload = bytes(range(256)) * 3
    assert from_array(to_array(payload)) == payload


def test_a_key_holder_never_opens_a_sum_of_fewer_than_min_holders(keys: KeyPaths) -> None:
    """The attack (security review H4): the server calls one holder's own ciphertexts a "sum"
    of count 1 and asks a key holder to release it -- that holder's individual statistics.
    The node's policy (min-holders, built-in 2) refuses before anything is decrypted."""
    from fedparity.clients.policy import PolicyRefusal

    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(keys.public))
    victim, key_holder = holder_context(0, keys), holder_context(1, keys)
    reply = fef_round1(request(victim.node_id, 0, protocol.round1_content(arrays)), victim, config)
    single, members, *_ = protocol.collect_ciphertexts(1, [victim.node_id], [reply], ROUND1_SIZE)
    assert members == [victim.node_id]
    content = protocol.round2_content(single, 1)
    with pytest.raises(PolicyRefusal, match="fewer than min-holders holders is never decrypted"):
        fef_round2(request(key_holder.node_id, 1, content), key_holder, config)
    content = protocol.round3_content(single, 1, single, 1)
    with pytest.raises(PolicyRefusal, match="fewer than min-holders"):
        fef_round3(request(key_holder.node_id, 2, content), key_holder, config)
