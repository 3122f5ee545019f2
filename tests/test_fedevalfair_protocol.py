"""The encrypted FedEvalFair protocol, message by message, with the real ClientApp handlers,
real TenSEAL ciphertexts and the real server strategy (threat model:
:mod:`fedparity.mechanisms.crypto.ckks`).

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version).

What is checked: a node's round-1/2 replies carry one uint8 ciphertext with its signature
and signer and nothing else; the server's context has no secret key and cannot decrypt; the
rounds (with the endorsement between rounds 1 and 2 and every round-2 holder's commitment to
the two sets before round 3) give the same p-values as the plaintext computation (1e-5, with
the key holders' flooding noise); bad ciphertexts are rejected, not fatal. The attacks of an
active server are in tests/test_ckks_active_server.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedparity.clients.app import (
    fef_commit,
    fef_endorse,
    fef_round1,
    fef_round2,
    fef_round3,
    load_shard_for,
)
from fedparity.clients.fedevalfair import bootstrap_seed, client_statistics, holder_predictions
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.task import build_model, get_arrays, set_arrays
from fedparity.mechanisms.crypto.ckks import (
    NODE_CONFIG_KEY,
    CkksParameters,
    KeyPaths,
    UnverifiedSumError,
    ciphertext_transcript,
    context_has_secret_key,
    contributors_digest,
    decrypt_vector,
    encrypt_vector,
    from_array,
    generate_keys,
    load_public_context,
    load_secret_context,
    to_array,
)
from fedparity.mechanisms.crypto.identity import IdentityKey
from fedparity.mechanisms.fairness_tests.fedevalfair import fedevalfair
from fedparity.mechanisms.protocol import (
    BLOCKS,
    FEF_ENDORSE_MESSAGE_TYPE,
    FEF_KEY,
    FEF_ROUND_MESSAGE_TYPES,
    ROUND1_SIZE,
    ROUND2_SIZE,
)
from fedparity.mechanisms.protocol.fedevalfair import FEF_COMMIT_MESSAGE_TYPE
from fedparity.server.cli.identity import write_node_identities
from fedparity.strategies.fedevalfair import FedEvalFairProtocol

NUM_HOLDERS = 3
RUN_CONFIG = {"task": "fedevalfair", "users-per-node": 1500, "fef-resamples": 60}


pytestmark = pytest.mark.usefixtures("task_identity")


RUN_ID = 1


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """node-<i>.key and roster.toml for the holders (what fedparity identity writes)."""
    return write_node_identities(tmp_path_factory.mktemp("identity"), NUM_HOLDERS)


def holder_context(
    partition_id: int, ckks_keys: KeyPaths, identities: Path, ledgers: Path | None = None
) -> Context:
    ledger = {} if ledgers is None else {"ledger-dir": str(ledgers / f"node-{partition_id}")}
    return Context(
        run_id=RUN_ID,
        node_id=100 + partition_id,
        node_config={
            "partition-id": partition_id,
            "num-partitions": NUM_HOLDERS,
            NODE_CONFIG_KEY: str(ckks_keys.secret),
            "identity-key": str(identities / f"node-{partition_id}.key"),
            "roster": str(identities / "roster.toml"),
            **ledger,
        },
        state=RecordDict(),
        run_config=dict(RUN_CONFIG),
    )


def request(node_id: int, round_index: int | str, content: RecordDict) -> Message:
    if round_index == "endorse":
        message_type = FEF_ENDORSE_MESSAGE_TYPE
    elif round_index == "commit":
        message_type = FEF_COMMIT_MESSAGE_TYPE
    else:
        message_type = FEF_ROUND_MESSAGE_TYPES[round_index]  # type: ignore[index]
    return Message(content=content, dst_node_id=node_id, message_type=message_type)


def endorsed_round2_content(
    protocol: FedEvalFairProtocol,
    first,
    verifier: Context,
    config: RunConfig,  # noqa: ANN001
) -> RecordDict:
    """The endorsement exchange with one verifier, and the round-2 content it allows."""
    reply = fef_endorse(
        request(verifier.node_id, "endorse", protocol.endorse_content(first.entries)),  # type: ignore[arg-type]
        verifier,
        config,
    )
    contributors = [entry.signer for entry in first.entries]
    total, endorsements, rejected = protocol.collect_endorsements(
        [reply], [verifier.node_id], contributors, run_id=RUN_ID
    )
    assert total is not None and not rejected
    return protocol.round2_content(total, contributors, [(e, s) for _, e, s in endorsements])


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


def test_server_context_holds_no_secret_key(ckks_keys: KeyPaths) -> None:
    public = load_public_context(ckks_keys.public)
    assert not context_has_secret_key(public)
    FedEvalFairProtocol(public)  # accepted
    with pytest.raises(ValueError, match="secret key"):
        FedEvalFairProtocol(load_secret_context(ckks_keys.secret))


def test_three_rounds_match_the_plaintext_test(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public))
    contexts = [holder_context(p, ckks_keys, identities, tmp_path) for p in range(NUM_HOLDERS)]
    nodes = [c.node_id for c in contexts]

    # Round 1: one signed ciphertext per node and nothing else.
    replies = [
        fef_round1(request(c.node_id, 0, protocol.round1_content(arrays)), c, config)
        for c in contexts
    ]
    for reply in replies:
        content = reply.content
        assert list(content.array_records) == [FEF_KEY]
        assert not content.metric_records and not content.config_records
        assert list(content.array_records[FEF_KEY]) == ["ciphertext", "signature", "signer"]
        assert content.array_records[FEF_KEY]["ciphertext"].numpy().dtype == np.uint8
    first = protocol.collect_round(1, nodes, replies, ROUND1_SIZE, run_id=RUN_ID)
    assert list(first.accepted) == nodes and not first.rejected and not first.unable
    # The server cannot read what it added: decrypting needs the secret key.
    with pytest.raises(Exception):  # noqa: B017 - tenseal raises its own error types
        decrypt_vector(load_public_context(ckks_keys.public), first.total)

    # Endorsement (verifier: holder 0), then round 2
    content = endorsed_round2_content(protocol, first, contexts[0], config)
    replies = [fef_round2(request(c.node_id, 1, content), c, config) for c in contexts]
    for reply in replies:
        assert list(reply.content.array_records[FEF_KEY]) == ["ciphertext", "signature", "signer"]
        assert not reply.content.metric_records
    reference = contributors_digest(entry.signer for entry in first.entries)
    second = protocol.collect_round(
        2, nodes, replies, ROUND2_SIZE, run_id=RUN_ID, reference=reference
    )
    assert list(second.accepted) == nodes and not second.rejected

    # Commitment: every round-2 holder signs one commitment to the two sets, nothing else.
    content = protocol.commit_content(first.entries, second.entries)
    replies = [fef_commit(request(c.node_id, "commit", content), c, config) for c in contexts]
    for reply in replies:
        assert list(reply.content.array_records[FEF_KEY]) == ["commitment", "signer"]
        assert not reply.content.metric_records and not reply.content.config_records
    commitments, rejected, _ = protocol.collect_commitments(
        replies, first.entries, second.entries, nodes, run_id=RUN_ID
    )
    assert [node for node, _, _ in commitments] == nodes and not rejected

    # Round 3: two key holders release the same (noise-flooded) aggregates.
    holders = contexts[:2]
    content = protocol.round3_content(
        first.entries, second.entries, [(signer, sig) for _, signer, sig in commitments]
    )
    replies = [fef_round3(request(c.node_id, 2, content), c, config) for c in holders]
    releases, rejected = protocol.collect_releases(replies, [c.node_id for c in holders])
    assert len(releases) == 2 and not rejected
    np.testing.assert_array_equal(releases[0], releases[1])  # the same keyed noise

    expected = plaintext_reports(config, arrays)
    for block in protocol.reports(releases[0]):
        plain = expected[(block.metric, block.mode)]
        assert block.report is not None
        for mine, theirs in (
            (block.report.homogeneity, plain.homogeneity),  # type: ignore[attr-defined]
            (block.report.common_disparity, plain.common_disparity),  # type: ignore[attr-defined]
        ):
            # flooding noise (fresh keys per test run) moves these by ~1e-6 at most seen
            assert mine.pvalue == pytest.approx(theirs.pvalue, abs=1e-5)
            assert mine.statistic == pytest.approx(theirs.statistic, rel=1e-5, abs=1e-8)
        # The pooled disparity (from the summed group counts, exact integers) and the
        # random-effects summary (from the grid sums) equal the plaintext's.
        if block.mode == "paper":
            assert block.report.pooled is None and block.report.random_effects is None
            continue
        assert plain.pooled is not None and plain.random_effects is not None  # type: ignore[attr-defined]
        assert block.report.pooled == plain.pooled  # type: ignore[attr-defined]
        mine_re, plain_re = block.report.random_effects, plain.random_effects  # type: ignore[attr-defined]
        assert mine_re is not None
        assert mine_re.tau2 == pytest.approx(plain_re.tau2, rel=1e-5, abs=1e-10)
        # Grid points: equal unless Q sits within the noise of a quantile (never seen).
        assert mine_re.tau2_interval == plain_re.tau2_interval
        assert mine_re.tau2_used == plain_re.tau2_used
        # The mean to 1e-4 of its standard error (the flooding noise on sum w Y is ~1e-5).
        assert mine_re.estimate == pytest.approx(plain_re.estimate, abs=1e-4 * plain_re.stderr)
        assert mine_re.stderr == pytest.approx(plain_re.stderr, rel=1e-5)


def test_bad_ciphertexts_are_rejected_and_the_sum_goes_on(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public))
    contexts = [holder_context(p, ckks_keys, identities) for p in range(NUM_HOLDERS)]
    good = [
        fef_round1(request(c.node_id, 0, protocol.round1_content(arrays)), c, config)
        for c in contexts
    ]
    other_keys = generate_keys(tmp_path / "other", None)
    foreign_parameters = CkksParameters(16384, (60, 40, 40, 60), 40)
    foreign = encrypt_vector(foreign_parameters.make_context(), np.ones(ROUND1_SIZE))
    short = encrypt_vector(load_secret_context(other_keys.secret), np.ones(5))
    # Each bad payload is properly signed (by a key of its own), so it is rejected for what
    # it carries, not for a missing signature.
    bad = [
        signed_reply(node, payload)
        for node, payload in ((200, b"not a ciphertext"), (201, foreign), (202, short))
    ]
    unsigned = Message(
        content=RecordDict({FEF_KEY: ArrayRecord({"ciphertext": _array(short)})}),
        reply_to=request(203, 0, RecordDict({})),
    )
    nodes = [c.node_id for c in contexts] + [200, 201, 202, 203]
    total, accepted, rejected, _, _ = protocol.collect_ciphertexts(
        1, nodes, [*good, *bad, unsigned], ROUND1_SIZE, run_id=RUN_ID
    )
    assert accepted == [c.node_id for c in contexts]
    assert sorted(item.node_id for item in rejected) == [200, 201, 202, 203]
    assert "not signed" in next(item.reason for item in rejected if item.node_id == 203)
    decrypted = decrypt_vector(
        load_secret_context(ckks_keys.secret), total, expected_size=ROUND1_SIZE
    )
    assert decrypted[-1] == pytest.approx(3.0, abs=1e-4)  # count slot: the three good ones


def signed_reply(node: int, payload: bytes, round_number: int = 1) -> Message:
    """A round reply from ``node`` carrying ``payload``, signed by a fresh identity key."""
    key = IdentityKey.generate()
    digest = hashlib.sha256(payload).digest()
    signature = key.sign(ciphertext_transcript(RUN_ID, round_number, digest, b""))
    record = ArrayRecord(
        {
            "ciphertext": _array(payload),
            "signature": _array(signature),
            "signer": _array(key.public_bytes()),
        }
    )
    return Message(
        content=RecordDict({FEF_KEY: record}),
        reply_to=request(node, round_number - 1, RecordDict({})),
    )


def _array(data: bytes) -> Array:
    return Array(to_array(data))


def test_arrays_roundtrip_is_lossless() -> None:
    payload = bytes(range(256)) * 3
    assert from_array(to_array(payload)) == payload


def test_a_verifier_never_endorses_a_sum_of_fewer_than_min_holders(
    ckks_keys: KeyPaths, identities: Path
) -> None:
    """The server asks a verifier to endorse one holder's own ciphertext as a "sum" (it would
    then be decrypted by every holder): refused before anything is computed."""
    config = RunConfig.from_mapping(RUN_CONFIG)
    arrays = model_arrays(config)
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public))
    victim, verifier = (
        holder_context(0, ckks_keys, identities),
        holder_context(1, ckks_keys, identities),
    )
    reply = fef_round1(request(victim.node_id, 0, protocol.round1_content(arrays)), victim, config)
    first = protocol.collect_round(1, [victim.node_id], [reply], ROUND1_SIZE, run_id=RUN_ID)
    assert list(first.accepted) == [victim.node_id]
    content = protocol.endorse_content(first.entries)
    with pytest.raises(UnverifiedSumError, match="fewer than min-holders holders"):
        fef_endorse(request(verifier.node_id, "endorse", content), verifier, config)  # type: ignore[arg-type]
