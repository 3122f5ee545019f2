"""mechanisms/crypto/secure_sum.py: pairwise-masking secure sum, with real X25519/HKDF/ChaCha20.

Keys come from seeded private bytes, so every test is deterministic. Bounds: a sum of ``n``
encodings decodes to the exact real sum within ``n * 0.5 * step`` (round half to even, and
the decoded value is exact in float64), checked with ``fractions.Fraction``.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import shamirs

from fedparity.mechanisms.crypto.secure_sum import (
    KEY_BYTES,
    MAX_MASKING_NODES,
    SHAMIR_PRIME,
    SHARE_BYTES,
    FixedPointCodec,
    MaskingKeyPair,
    check_masked_vector,
    combine_self_seed,
    decode_id_table,
    encode_id_table,
    expand_mask,
    fixed_point_scale,
    mask_vector,
    new_self_seed,
    pair_secrets,
    reveal_round_seeds,
    round_seed,
    share_self_seed,
    unmask_sum,
)
from tests.support.import_probe import modules_loaded_by

SALT = b"run-1234"
CLIP = 2.5


def make_nodes(
    count: int, seed: int, salt: bytes = SALT
) -> tuple[list[int], dict[int, MaskingKeyPair], dict[int, dict[int, bytes]]]:
    """``count`` nodes with Flower-like uint64 ids, seeded keys and their pair secrets."""
    rng = np.random.default_rng(seed)
    ids = sorted({int(i) for i in rng.integers(0, 2**63, size=count, dtype=np.int64)})
    assert len(ids) == count
    keys = {node: MaskingKeyPair.from_private_bytes(rng.bytes(KEY_BYTES)) for node in ids}
    broadcast = {node: key.public_bytes() for node, key in keys.items()}
    secrets = {node: pair_secrets(node, keys[node], broadcast, salt) for node in ids}
    return ids, keys, secrets


def exact_sum(vectors: list[np.ndarray]) -> list[Fraction]:
    return [
        sum((Fraction(float(v[i])) for v in vectors), Fraction(0)) for i in range(vectors[0].size)
    ]


def assert_within(decoded: np.ndarray, vectors: list[np.ndarray], bound: float) -> None:
    worst = max(
        abs(Fraction(float(d)) - e) for d, e in zip(decoded, exact_sum(vectors), strict=True)
    )
    assert worst <= Fraction(bound)


def plain_sum_uint64(encoded: list[np.ndarray]) -> np.ndarray:
    total = np.zeros(encoded[0].size, dtype=np.uint64)
    for vector in encoded:
        total += vector
    return total


# --- key agreement ------------------------------------------------------------------------


def test_both_sides_of_a_pair_derive_the_same_secret_and_salts_separate_runs() -> None:
    ids, _, secrets = make_nodes(4, seed=1)
    for u, v in itertools.combinations(ids, 2):
        assert secrets[u][v] == secrets[v][u]
        assert len(secrets[u][v]) == KEY_BYTES
    assert len({secrets[u][v] for u, v in itertools.combinations(ids, 2)}) == 6
    _, _, other_run = make_nodes(4, seed=1, salt=b"run-5678")
    assert all(other_run[ids[0]][v] != secrets[ids[0]][v] for v in ids[1:])
    # Deterministic given the keys.
    assert make_nodes(4, seed=1)[2] == secrets


def test_key_pair_round_trips_through_private_bytes_and_generate_uses_fresh_entropy() -> None:
    pair = MaskingKeyPair.generate()
    again = MaskingKeyPair.from_private_bytes(pair.private_bytes())
    assert again.public_bytes() == pair.public_bytes()
    assert len(pair.public_bytes()) == KEY_BYTES
    assert MaskingKeyPair.generate().public_bytes() != pair.public_bytes()
    assert pair.private_bytes().hex() not in repr(pair)


def test_round_seeds_are_symmetric_and_fresh_every_round() -> None:
    ids, _, secrets = make_nodes(3, seed=2)
    u, v = ids[0], ids[1]
    seeds = [round_seed(secrets[u][v], r) for r in range(1, 6)]
    assert seeds == [round_seed(secrets[v][u], r) for r in range(1, 6)]
    assert len(set(seeds)) == 5


def test_mask_stream_is_the_rfc8439_chacha20_keystream() -> None:
    # RFC 8439 appendix A.1, test vector 1: all-zero key, nonce and counter.
    expected = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    mask = expand_mask(bytes(32), 8)
    assert mask.dtype == np.uint64
    assert mask.astype("<u8").tobytes() == expected
    assert np.array_equal(expand_mask(bytes(32), 3), mask[:3])  # a prefix of the stream


# --- correctness ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3, 10])
def test_secure_sum_equals_the_plain_sum_within_the_quantisation_bound(count: int) -> None:
    ids, _, secrets = make_nodes(count, seed=10 + count)
    codec = FixedPointCodec(CLIP, max_nodes=16)
    rng = np.random.default_rng(count)
    values = {node: rng.uniform(-CLIP, CLIP, size=257) for node in ids}
    values[ids[0]][:2] = [CLIP, -CLIP]  # the extremes are allowed
    masked = {
        node: mask_vector(codec.encode(values[node]), node, secrets[node], round_number=7)
        for node in ids
    }
    total = unmask_sum(masked, {}, 7, 257, participants=ids)
    decoded = codec.decode(total)
    assert decoded.dtype == np.float64
    assert codec.error_bound(count) == count * 0.5 * codec.step
    assert_within(decoded, list(values.values()), codec.error_bound(count))
    # The masks cancel exactly: the unmasked sum is the sum of the encodings mod 2^64.
    assert np.array_equal(total, plain_sum_uint64([codec.encode(v) for v in values.values()]))


def test_masking_is_deterministic_given_the_keys_and_round() -> None:
    ids, _, secrets = make_nodes(3, seed=3)
    codec = FixedPointCodec(CLIP, max_nodes=3)
    encoded = codec.encode(np.linspace(-1.0, 1.0, 9))
    first = mask_vector(encoded, ids[1], secrets[ids[1]], 4)
    assert np.array_equal(first, mask_vector(encoded, ids[1], secrets[ids[1]], 4))
    assert not np.array_equal(first, mask_vector(encoded, ids[1], secrets[ids[1]], 5))


def test_cohort_restricts_masking_to_the_rounds_participants() -> None:
    ids, _, secrets = make_nodes(5, seed=4)
    cohort = ids[1:4]
    codec = FixedPointCodec(CLIP, max_nodes=5)
    rng = np.random.default_rng(4)
    values = {node: rng.uniform(-CLIP, CLIP, size=32) for node in cohort}
    masked = {
        node: mask_vector(codec.encode(values[node]), node, secrets[node], 2, cohort=cohort)
        for node in cohort
    }
    total = unmask_sum(masked, {}, 2, 32, participants=cohort)
    assert_within(codec.decode(total), list(values.values()), codec.error_bound(3))


# --- hiding --------------------------------------------------------------------------------


def test_a_masked_vector_is_not_its_encoding_and_its_bits_look_uniform() -> None:
    length = 4096
    ids, _, secrets = make_nodes(3, seed=5)
    codec = FixedPointCodec(CLIP, max_nodes=3)
    # Non-negative values: every encoding has top bit 0 and tiny magnitude.
    encoded = codec.encode(np.random.default_rng(5).uniform(0.0, CLIP, size=length))
    assert not (encoded >> np.uint64(63)).any()
    masked = mask_vector(encoded, ids[1], secrets[ids[1]], 1)
    assert np.count_nonzero(masked == encoded) == 0
    # Each bit of a uniform uint64 is Bernoulli(1/2): the count of ones over 4096 coordinates
    # is Binomial(4096, 1/2), mean 2048, sd 32. Accept within 5 sd (false alarm ~ 6e-7).
    sd = math.sqrt(length * 0.25)
    for bit in (63, 62, 0):
        ones = int(np.count_nonzero((masked >> np.uint64(bit)) & np.uint64(1)))
        assert abs(ones - length / 2) <= 5 * sd, (bit, ones)
    with pytest.raises(ValueError, match="total is not a sum"):
        codec.decode(masked)


@pytest.mark.parametrize("count", [3, 5])
def test_no_proper_subset_of_masked_vectors_decodes_to_its_plain_sum(count: int) -> None:
    ids, _, secrets = make_nodes(count, seed=20 + count)
    codec = FixedPointCodec(CLIP, max_nodes=count)
    rng = np.random.default_rng(count)
    encoded = {node: codec.encode(rng.uniform(-CLIP, CLIP, size=64)) for node in ids}
    masked = {node: mask_vector(encoded[node], node, secrets[node], 3) for node in ids}
    for size in range(1, count):
        for subset in itertools.combinations(ids, size):
            partial = plain_sum_uint64([masked[node] for node in subset])
            plain = plain_sum_uint64([encoded[node] for node in subset])
            # Masks with the missing nodes remain: no coordinate equals the subset's sum ...
            assert np.count_nonzero(partial == plain) == 0
            # ... and the result is not a decodable sum at all.
            with pytest.raises(ValueError, match="masks left in"):
                codec.decode(partial)


# --- dropouts ------------------------------------------------------------------------------


def test_dropouts_are_unmasked_with_the_survivors_revealed_seeds() -> None:
    ids, _, secrets = make_nodes(5, seed=6)
    length, rnd = 100, 11
    codec = FixedPointCodec(CLIP, max_nodes=5)
    rng = np.random.default_rng(6)
    values = {node: rng.uniform(-CLIP, CLIP, size=length) for node in ids}
    masked = {
        node: mask_vector(codec.encode(values[node]), node, secrets[node], rnd) for node in ids
    }
    dropped = [ids[1], ids[3]]
    survivors = [node for node in ids if node not in dropped]
    received = {node: masked[node] for node in survivors}
    # Without the reveals the sum is garbage (the masks with the dropped nodes remain).
    with pytest.raises(ValueError, match="lacks the seeds"):
        unmask_sum(received, {}, rnd, length, participants=ids)
    revealed = {
        (node, gone): seed
        for node in survivors
        for gone, seed in reveal_round_seeds(node, secrets[node], rnd, dropped, survivors).items()
    }
    assert len(revealed) == len(survivors) * len(dropped)
    total = unmask_sum(received, revealed, rnd, length, participants=ids)
    assert_within(codec.decode(total), [values[node] for node in survivors], codec.error_bound(3))

    # Round r's revealed seeds do not unmask round r + 1: those masks are different.
    next_masked = {
        node: mask_vector(codec.encode(values[node]), node, secrets[node], rnd + 1)
        for node in survivors
    }
    stale = unmask_sum(next_masked, revealed, rnd + 1, length, participants=ids)
    with pytest.raises(ValueError, match="masks left in"):
        codec.decode(stale)
    for (node, gone), seed in revealed.items():
        fresh = round_seed(secrets[node][gone], rnd + 1)
        assert fresh != seed
        assert np.count_nonzero(expand_mask(fresh, length) == expand_mask(seed, length)) == 0


def test_unmask_sum_rejects_incomplete_or_excess_reveals() -> None:
    ids, _, secrets = make_nodes(4, seed=7)
    codec = FixedPointCodec(CLIP, max_nodes=4)
    encoded = codec.encode(np.zeros(8))
    masked = {node: mask_vector(encoded, node, secrets[node], 1) for node in ids[:3]}
    good = {(node, ids[3]): round_seed(secrets[node][ids[3]], 1) for node in ids[:3]}
    total = unmask_sum(masked, good, 1, 8, participants=ids)
    assert np.array_equal(codec.decode(total), np.zeros(8))
    extra = dict(good)
    extra[(ids[0], ids[1])] = round_seed(secrets[ids[0]][ids[1]], 1)  # a survivor pair
    with pytest.raises(ValueError, match="not \\(survivor, dropped\\)"):
        unmask_sum(masked, extra, 1, 8, participants=ids)
    with pytest.raises(ValueError, match="lacks the seeds"):
        unmask_sum(masked, dict(list(good.items())[:2]), 1, 8, participants=ids)
    with pytest.raises(ValueError, match="non-participants"):
        unmask_sum(masked, good, 1, 8, participants=ids[1:])
    with pytest.raises(ValueError, match="min_survivors=2"):
        unmask_sum({ids[0]: masked[ids[0]]}, {}, 1, 8, participants=ids[:1])
    with pytest.raises(ValueError, match="length 9"):
        unmask_sum(masked, good, 1, 9, participants=ids)
    with pytest.raises(ValueError, match="min_survivors must be an integer >= 2"):
        unmask_sum(masked, good, 1, 8, participants=ids, min_survivors=1)


# --- refusal rules -------------------------------------------------------------------------


def test_reveal_refusal_rules() -> None:
    ids, _, secrets = make_nodes(5, seed=8)
    me = ids[2]
    mine = secrets[me]
    with pytest.raises(ValueError, match="survivors must contain own_id"):
        reveal_round_seeds(me, mine, 1, [ids[0]], [ids[1], ids[3]])
    with pytest.raises(ValueError, match="must be disjoint.*refusing to reveal seeds with"):
        reveal_round_seeds(me, mine, 1, [ids[0], ids[1]], [me, ids[1]])
    # A server asking a lone survivor for all its seeds would unmask its vector.
    with pytest.raises(ValueError, match="at least min_survivors=2 nodes, got 1"):
        reveal_round_seeds(me, mine, 1, [i for i in ids if i != me], [me])
    with pytest.raises(ValueError, match="at least min_survivors=3 nodes, got 2"):
        reveal_round_seeds(me, mine, 1, [ids[0]], [me, ids[1]], min_survivors=3)
    with pytest.raises(ValueError, match="min_survivors must be an integer >= 2"):
        reveal_round_seeds(me, mine, 1, [ids[0]], [me, ids[1]], min_survivors=1)
    with pytest.raises(ValueError, match="unknown nodes: \\[12345\\]"):
        reveal_round_seeds(me, mine, 1, [12345], [me, ids[1]])
    with pytest.raises(ValueError, match="unknown nodes"):
        reveal_round_seeds(me, mine, 1, [ids[0]], [me, 12345])
    assert reveal_round_seeds(me, mine, 1, [], [me, ids[0]]) == {}
    revealed = reveal_round_seeds(me, mine, 1, [ids[0], ids[4]], [me, ids[1], ids[3]])
    assert revealed == {ids[0]: round_seed(mine[ids[0]], 1), ids[4]: round_seed(mine[ids[4]], 1)}


def test_mask_vector_refuses_to_send_an_unmasked_or_inconsistent_vector() -> None:
    ids, _, secrets = make_nodes(3, seed=9)
    me = ids[0]
    encoded = FixedPointCodec(CLIP, max_nodes=3).encode(np.ones(4))
    with pytest.raises(ValueError, match="no peer to mask with"):
        mask_vector(encoded, me, {}, 1)
    with pytest.raises(ValueError, match="no peer to mask with"):
        mask_vector(encoded, me, secrets[me], 1, cohort=[me])
    with pytest.raises(ValueError, match="cohort must contain own_id"):
        mask_vector(encoded, me, secrets[me], 1, cohort=ids[1:])
    with pytest.raises(ValueError, match="without a pair secret: \\[99\\]"):
        mask_vector(encoded, me, secrets[me], 1, cohort=[me, 99])
    with pytest.raises(ValueError, match="pair_secrets must not contain own_id"):
        mask_vector(encoded, me, {me: bytes(32), ids[1]: secrets[me][ids[1]]}, 1)
    with pytest.raises(ValueError, match="encoded must be a uint64 numpy array, got float64"):
        mask_vector(np.ones(4), me, secrets[me], 1)
    with pytest.raises(ValueError, match="round_number must be an integer >= 0"):
        mask_vector(encoded, me, secrets[me], -1)


# --- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("clip_range", [0.0, -1.0, math.nan, math.inf, "x"])
def test_bad_clip_range_is_rejected(clip_range: object) -> None:
    with pytest.raises(ValueError, match="clip_range must be a finite number > 0"):
        FixedPointCodec(clip_range, max_nodes=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_nodes", [1, 0, -3, 2.5, MAX_MASKING_NODES + 1])
def test_bad_max_nodes_is_rejected(max_nodes: object) -> None:
    with pytest.raises(ValueError, match="max_nodes must be an integer"):
        FixedPointCodec(1.0, max_nodes=max_nodes)  # type: ignore[arg-type]


def test_encode_rejects_values_beyond_clip_range_nan_and_bad_shapes() -> None:
    codec = FixedPointCodec(CLIP, max_nodes=4)
    with pytest.raises(ValueError, match="values must be in \\[-clip_range, clip_range\\]"):
        codec.encode(np.array([0.0, np.nextafter(CLIP, 3.0)]))
    with pytest.raises(ValueError, match="values must be in .*found -3.0"):
        codec.encode(np.array([-3.0]))
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="values must be finite"):
            codec.encode(np.array([0.0, bad]))
    with pytest.raises(ValueError, match="values must be a non-empty 1-D array"):
        codec.encode(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="values must be a non-empty 1-D array"):
        codec.encode(np.zeros(0))


def test_key_material_checks() -> None:
    ids, keys, secrets = make_nodes(3, seed=12)
    me = ids[0]
    broadcast = {node: key.public_bytes() for node, key in keys.items()}
    with pytest.raises(ValueError, match=f"peer_public_keys\\[{ids[1]}\\] must be 32 bytes"):
        pair_secrets(me, keys[me], {**broadcast, ids[1]: b"short"}, SALT)
    with pytest.raises(ValueError, match="is not own_key's public key"):
        pair_secrets(me, keys[me], {**broadcast, me: broadcast[ids[1]]}, SALT)
    with pytest.raises(ValueError, match="distinct keys"):
        pair_secrets(me, keys[me], {**broadcast, ids[2]: broadcast[ids[1]]}, SALT)
    with pytest.raises(ValueError, match="low-order point"):
        pair_secrets(me, keys[me], {ids[1]: bytes(32)}, SALT)
    with pytest.raises(ValueError, match="run_salt must be non-empty bytes"):
        pair_secrets(me, keys[me], broadcast, b"")
    with pytest.raises(ValueError, match="own_id must be an integer in \\[0, 2\\^64 - 1\\]"):
        pair_secrets(2**64, keys[me], broadcast, SALT)
    with pytest.raises(ValueError, match="own_key must be a MaskingKeyPair"):
        pair_secrets(me, keys[me].private_bytes(), broadcast, SALT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data must be 32 bytes"):
        MaskingKeyPair.from_private_bytes(b"\x01" * 31)
    with pytest.raises(ValueError, match="pair_secret must be 32 bytes"):
        round_seed(b"x", 1)
    with pytest.raises(ValueError, match="length must be an integer >= 1"):
        expand_mask(secrets[me][ids[1]], 0)
    # Without its own key in the list a node still derives the same secrets.
    without_me = {node: key for node, key in broadcast.items() if node != me}
    assert pair_secrets(me, keys[me], without_me, SALT) == secrets[me]


# --- fixed point and overflow --------------------------------------------------------------


@pytest.mark.parametrize(
    ("clip_range", "max_nodes"), [(1.0, 2), (CLIP, 10), (0.1, 1000), (1e-6, 3), (7e5, 2**20)]
)
def test_scale_is_the_largest_power_of_two_within_the_bound(
    clip_range: float, max_nodes: int
) -> None:
    scale = fixed_point_scale(clip_range, max_nodes)
    mantissa, _ = math.frexp(scale)
    assert mantissa == 0.5  # a power of two: x * scale and the decoding are exact
    worst = Fraction(clip_range) * max_nodes
    assert worst * Fraction(scale) <= 2**52 < worst * Fraction(scale) * 2
    codec = FixedPointCodec(clip_range, max_nodes)
    assert codec.scale == scale and codec.step == 1.0 / scale
    # The integer sum bound: below 2^53 (exact in float64), far below 2^63 (no wrap).
    assert codec.sum_limit < 2**53


@pytest.mark.parametrize("max_nodes", [2, 10, 1000, 2**20, MAX_MASKING_NODES])
def test_sums_at_max_magnitude_for_max_nodes_decode_correctly(max_nodes: int) -> None:
    codec = FixedPointCodec(CLIP, max_nodes)
    extremes = np.array([CLIP, -CLIP, CLIP, 0.0])
    encoded = codec.encode(extremes)
    # max_nodes identical vectors: the uint64 sum is max_nodes * encoding (mod 2^64).
    total = encoded * np.uint64(max_nodes)
    decoded = codec.decode(total)
    assert_within(decoded, [extremes * max_nodes], codec.error_bound(max_nodes))
    assert np.array_equal(total.view(np.int64), encoded.view(np.int64) * max_nodes)


def test_max_magnitude_sum_through_masking_decodes_correctly() -> None:
    count = 6
    ids, _, secrets = make_nodes(count, seed=13)
    codec = FixedPointCodec(CLIP, max_nodes=count)
    for sign in (1.0, -1.0):
        vector = np.full(16, sign * CLIP)
        masked = {node: mask_vector(codec.encode(vector), node, secrets[node], 1) for node in ids}
        decoded = codec.decode(unmask_sum(masked, {}, 1, 16, participants=ids))
        assert_within(decoded, [vector] * count, codec.error_bound(count))
    # One node more than max_nodes at the extreme is caught instead of decoded wrongly.
    over = codec.encode(np.full(4, CLIP)) * np.uint64(count + 1)
    with pytest.raises(ValueError, match="too many nodes"):
        codec.decode(over)


def test_decode_rejects_non_uint64_input() -> None:
    codec = FixedPointCodec(CLIP, max_nodes=4)
    with pytest.raises(ValueError, match="total must be a uint64 numpy array, got int64"):
        codec.decode(np.zeros(3, dtype=np.int64))
    # The most negative int64 is not accepted as a small sum (no abs() overflow).
    with pytest.raises(ValueError, match="total is not a sum"):
        codec.decode(np.array([2**63], dtype=np.uint64))


# --- wire formats --------------------------------------------------------------------------


def test_id_tables_and_masked_vectors_survive_flower_arrays() -> None:
    from flwr.app import Array

    ids, keys, secrets = make_nodes(4, seed=14)
    broadcast = {node: key.public_bytes() for node, key in keys.items()}
    table = encode_id_table(broadcast)
    assert table.dtype == np.uint64 and table.shape == (4, 5)
    assert decode_id_table(Array(table).numpy()) == broadcast
    seeds = reveal_round_seeds(ids[0], secrets[ids[0]], 3, ids[2:], ids[:2])
    assert decode_id_table(Array(encode_id_table(seeds)).numpy()) == seeds
    masked = mask_vector(FixedPointCodec(CLIP, 4).encode(np.ones(5)), ids[0], secrets[ids[0]], 3)
    received = check_masked_vector(Array(masked).numpy(), 5)
    assert np.array_equal(received, masked) and received.dtype == np.uint64
    big_endian = masked.astype(">u8")
    assert np.array_equal(check_masked_vector(big_endian), masked)
    with pytest.raises(ValueError, match="must have length 6"):
        check_masked_vector(masked, 6)
    with pytest.raises(ValueError, match="shape \\(k, 5\\)"):
        decode_id_table(np.zeros((2, 4), dtype=np.uint64))
    duplicated = np.vstack([table[:1], table[:1]])
    with pytest.raises(ValueError, match="distinct node ids"):
        decode_id_table(duplicated)
    with pytest.raises(ValueError, match="table\\[1\\] must be 32 bytes"):
        encode_id_table({1: b"abc"})


def test_module_imports_no_flower() -> None:
    assert modules_loaded_by("fedparity.mechanisms.crypto.secure_sum", {"flwr"}) == []


@pytest.mark.parametrize("threshold", [2, 4, 7])
def test_any_threshold_shares_rebuild_the_seed_and_fewer_are_refused(threshold: int) -> None:
    members = [3, 8, 11, 20, 21, 40, 41]
    seed = new_self_seed()
    shares = share_self_seed(seed, members, threshold)
    for subset in itertools.combinations(sorted(shares), threshold):
        assert combine_self_seed([shares[m] for m in subset], threshold) == seed
    with pytest.raises(ValueError, match=f"threshold {threshold} needs {threshold} shares"):
        combine_self_seed([shares[m] for m in members[: threshold - 1]], threshold)


def test_combine_uses_exactly_threshold_shares_those_of_the_smallest_indices() -> None:
    # The seed is interpolated from exactly the threshold of shares, those of the smallest
    # indices, whatever else arrived. A share beyond them is not read: spoiling it leaves the
    # seed intact (with all shares interpolated, the spoiled one changes the result).
    members = list(range(1, 11))
    seed = new_self_seed()
    shares = share_self_seed(seed, members, 6)
    spoiled = bytes(shares[10][:4]) + bytes(SHARE_BYTES - 4)
    given = [shares[m] for m in members[:-1]] + [spoiled]
    assert combine_self_seed(given[::-1], 6) == seed
    all_ten = [
        shamirs.share(int.from_bytes(share[:4], "big"), int.from_bytes(share[4:], "big"))
        for share in given
    ]
    assert shamirs.interpolate(all_ten, modulus=SHAMIR_PRIME) != int.from_bytes(seed, "big")


def test_the_sharing_field_is_prime_and_holds_every_seed() -> None:
    import sympy

    assert sympy.isprime(SHAMIR_PRIME)
    assert SHAMIR_PRIME > 2 ** (8 * 16)
    top = b"\xff" * 16  # the largest seed
    shares = share_self_seed(top, [1, 2, 3, 4], 3)
    assert all(len(share) == SHARE_BYTES for share in shares.values())
    assert combine_self_seed([shares[2], shares[3], shares[4]], 3) == top


def test_a_share_outside_the_field_or_inconsistent_shares_are_refused() -> None:
    shares = share_self_seed(new_self_seed(), [1, 2, 3], 2)
    outside = shares[1][:4] + SHAMIR_PRIME.to_bytes(SHARE_BYTES - 4, "big")
    with pytest.raises(ValueError, match="below the field's prime"):
        combine_self_seed([outside, shares[2]], 2)
    # Two shares of different sharings interpolate to a field element; above 2^128 (3 in 4
    # of them) it is no seed, and the server says so instead of unmasking with garbage.
    rng = np.random.default_rng(4)
    refused = 0
    for _ in range(40):
        other = share_self_seed(rng.bytes(16), [1, 2, 3], 2)
        try:
            rebuilt = combine_self_seed([shares[1], other[2]], 2)
        except ValueError as error:
            assert "do not rebuild a seed" in str(error)
            refused += 1
        else:
            assert len(rebuilt) == 16
    # The coefficients come from the OS (secrets), so this is not seeded: Binomial(40, 3/4)
    # has mean 30 and sd 2.7, and fewer than 15 has probability below 1e-7.
    assert refused >= 15


@pytest.mark.parametrize("threshold", [1, 0, 2.5, None])
def test_combine_rejects_a_bad_threshold(threshold: object) -> None:
    shares = share_self_seed(new_self_seed(), [1, 2, 3], 2)
    with pytest.raises((TypeError, ValueError), match="threshold"):
        combine_self_seed(list(shares.values()), threshold)  # type: ignore[arg-type]
