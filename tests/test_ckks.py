"""CKKS layer of FedEvalFair (mechanisms/crypto/ckks/): real TenSEAL ciphertexts, no mocks.

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version).

Statistics used as protocol payloads (calibrated and paper modes): client i holds
a disparity estimate y_i with weight w_i = 1 / S_i^2 (1e4-1e6, realistic for bootstrap
variances of 1e-2..1e-3 squared); it contributes [w_i, w_i y_i]; its round-2 terms are
Cochran's w_i (y_i - mu)^2 and the paper's w_i (y_i - mu)^2 / (1 - w_i / W), with mu and W
from the decrypted round-1 sum.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path

import numpy as np
import pytest
import tenseal as ts
from scipy import stats

from fedparity.mechanisms.crypto.ckks import (
    MAX_COEFF_MODULUS_BITS_128,
    NODE_CONFIG_KEY,
    SECRET_CONTEXT_ENV,
    CkksParameters,
    CountSlotError,
    DecryptionCheckError,
    KeyMaterialError,
    KeyPaths,
    MagnitudeCheckError,
    NoValidCiphertextError,
    ProtocolError,
    StaleReferenceError,
    add_ciphertexts,
    append_count_slot,
    check_count_slot,
    check_magnitude,
    context_has_secret_key,
    decrypt_vector,
    encrypt_vector,
    from_array,
    generate_keys,
    load_public_context,
    load_secret_context,
    secret_context_path,
    to_array,
)
from tests.support.ckks_simulator import DecryptedSums, run_protocol_locally, run_protocol_plaintext

# --------------------------------------------------------------------------------------------
# Fixtures and the statistics used as payloads
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_ctx(ckks_keys: KeyPaths) -> ts.Context:
    return load_secret_context(ckks_keys.secret)


@pytest.fixture(scope="module")
def public_ctx(ckks_keys: KeyPaths) -> ts.Context:
    return load_public_context(ckks_keys.public)


@pytest.fixture(scope="module")
def foreign_ctx() -> ts.Context:
    """Same parameters, another secret key."""
    return CkksParameters().make_context()


def population(k: int, seed: int, disparity: float = 0.03) -> tuple[np.ndarray, np.ndarray]:
    """Weights w = 1/S^2 in [1e4, 1e6] and estimates y ~ N(disparity, 1/w)."""
    rng = np.random.default_rng(seed)
    weights = 10.0 ** rng.uniform(4.0, 6.0, size=k)
    estimates = disparity + rng.standard_normal(k) / np.sqrt(weights)
    return weights, estimates


def contributions_of(weights: np.ndarray, estimates: np.ndarray) -> list[np.ndarray]:
    return [np.array([w, w * y]) for w, y in zip(weights, estimates, strict=True)]


def terms(reference: np.ndarray, contribution: np.ndarray) -> np.ndarray:
    """Round 2: Cochran's and the paper's term against the round-1 mean."""
    total_weight, mean = reference[0], reference[1] / reference[0]
    weight, estimate = contribution[0], contribution[1] / contribution[0]
    cochran = weight * (estimate - mean) ** 2
    return np.array([cochran, cochran / (1.0 - weight / total_weight)])


def plaintext_statistics(weights: np.ndarray, estimates: np.ndarray) -> dict[str, float]:
    total = float(weights.sum())
    mean = float((weights * estimates).sum() / total)
    cochran = weights * (estimates - mean) ** 2
    return {
        "q": float(cochran.sum()),
        "t1": float((cochran / (1.0 - weights / total)).sum()),
        "w": total,
        "wy": float((weights * estimates).sum()),
        "count": float(weights.size),
    }


def report(released: np.ndarray) -> dict[str, float]:
    """Server side: p-values from [Q, T1, W, sum w y, count] (the default release)."""
    q, t1, total, weighted, count = released
    z = math.sqrt(total) * (weighted / total)
    return {
        "p_q": float(stats.chi2.sf(q, count - 1)),
        "p_t1": float(stats.chi2.sf(t1, count - 1)),
        "p_w": float(2.0 * stats.norm.sf(abs(z))),
    }


def release_cochran(sums: DecryptedSums) -> np.ndarray:
    """Key holder: Cochran's Q over the round-2 clients, exact even after dropouts.

    sum_R2 w (y - c)^2 = Q_R2 + W_R2 (mu_R2 - c)^2 with c the round-1 mean.
    """
    reference_mean = sums.reference[1] / sums.reference[0]
    total, weighted = sums.contributions
    mean = weighted / total
    q = sums.terms[0] - total * (mean - reference_mean) ** 2
    return np.array([q, total, weighted, float(sums.count)])


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def test_default_parameters_are_128_bit() -> None:
    parameters = CkksParameters()
    assert parameters.security_bits == 128
    assert parameters.total_coeff_modulus_bits == 200 <= parameters.max_coeff_modulus_bits == 218
    assert parameters.slot_count == 4096
    assert parameters.global_scale == 2.0**40
    assert parameters.max_plaintext_magnitude == 2.0**99


def test_table_is_the_he_standard_128_bit_classical_table() -> None:
    # HomomorphicEncryption.org Security Standard (2018), Table 1, ternary secret, 128-bit.
    assert dict(MAX_COEFF_MODULUS_BITS_128) == {
        1024: 27,
        2048: 54,
        4096: 109,
        8192: 218,
        16384: 438,
        32768: 881,
    }


@pytest.mark.parametrize(
    ("degree", "sizes", "scale", "needles"),
    [
        (8192, (60, 60, 60, 60), 40, ("coeff_mod_bit_sizes", "240", "218", "128-bit")),
        (4096, (60, 40, 40, 60), 40, ("coeff_mod_bit_sizes", "200", "109")),
        (2048, (30, 30), 20, ("coeff_mod_bit_sizes", "60", "54")),
        (3000, (60, 40, 40, 60), 40, ("poly_modulus_degree", "8192")),
        (65536, (60, 40, 40, 60), 40, ("poly_modulus_degree",)),
        (8192, (60,), 40, ("coeff_mod_bit_sizes", "at least 2")),
        (8192, (60, 30, 40, 60), 40, ("global_scale_bits", "inner prime")),
        (8192, (60, 40, 40, 60), 50, ("global_scale_bits", "inner prime")),
        (8192, (40, 40, 40, 60), 40, ("global_scale_bits", "first")),
        (8192, (60, 40, 40, 60), 10, ("global_scale_bits", ">= 20")),
        (8192, (61, 40, 60), 40, ("coeff_mod_bit_sizes", "60")),
        (8192, (60, 10, 60), 10, ("coeff_mod_bit_sizes", "[15, 60]")),
        (8192, (60, 40.5, 60), 40, ("coeff_mod_bit_sizes", "integers")),
        (8192, (60, 40, 40, 60), 40.0, ("global_scale_bits", "integer")),
    ],
)
def test_invalid_or_insecure_parameters_raise_naming_the_parameter(
    degree: int, sizes: tuple, scale: int, needles: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as error:
        CkksParameters(degree, sizes, scale)
    for needle in needles:
        assert needle in str(error.value), (needle, str(error.value))


@pytest.mark.parametrize(
    ("degree", "at_limit", "over_limit"),
    [(4096, (60, 49), (60, 50)), (8192, (60, 40, 58, 60), (60, 40, 59, 60))],
)
def test_limit_agrees_with_seal(degree: int, at_limit: tuple, over_limit: tuple) -> None:
    """Independent check of the table: SEAL (tc128) accepts the limit and refuses one more bit."""
    parameters = CkksParameters(degree, at_limit, 40)
    assert parameters.total_coeff_modulus_bits == MAX_COEFF_MODULUS_BITS_128[degree]
    context = parameters.make_context()
    assert CkksParameters.from_context(context) == parameters
    with pytest.raises(ValueError, match="coeff_mod_bit_sizes"):
        CkksParameters(degree, over_limit, 40)
    with pytest.raises(ValueError):
        ts.context(ts.SCHEME_TYPE.CKKS, degree, coeff_mod_bit_sizes=list(over_limit))


# --------------------------------------------------------------------------------------------
# Key material
# --------------------------------------------------------------------------------------------


def test_key_files_secret_is_private_and_public_has_no_secret_key(
    ckks_keys: KeyPaths, secret_ctx: ts.Context
) -> None:
    assert stat.S_IMODE(ckks_keys.secret.stat().st_mode) == 0o600
    # Read the public file with TenSEAL itself, not through the loader under test.
    public = ts.context_from(ckks_keys.public.read_bytes())
    assert not public.has_secret_key() and not public.is_private()
    assert not context_has_secret_key(public)
    assert context_has_secret_key(secret_ctx)
    payload = encrypt_vector(secret_ctx, np.array([1.0, 2.0]))
    vector = ts.ckks_vector_from(public, payload)
    with pytest.raises(ValueError, match="secret"):
        vector.decrypt()
    with pytest.raises(KeyMaterialError, match="secret key"):
        decrypt_vector(public, payload)
    assert np.allclose(decrypt_vector(secret_ctx, payload), [1.0, 2.0], atol=1e-6)


def test_loaders_refuse_the_wrong_file(ckks_keys: KeyPaths, tmp_path: Path) -> None:
    with pytest.raises(KeyMaterialError, match="contains a secret key"):
        load_public_context(ckks_keys.secret)
    with pytest.raises(KeyMaterialError, match="no secret key"):
        load_secret_context(ckks_keys.public)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a context")
    with pytest.raises(KeyMaterialError, match="not a serialized TenSEAL context"):
        load_public_context(garbage)
    with pytest.raises(KeyMaterialError, match="cannot read"):
        load_secret_context(tmp_path / "missing")


def test_generate_keys_does_not_overwrite(tmp_path: Path) -> None:
    parameters = CkksParameters(4096, (60, 49), 40)
    paths = generate_keys(tmp_path, parameters)
    with pytest.raises(FileExistsError, match="overwrite"):
        generate_keys(tmp_path, parameters)
    old = paths.secret.read_bytes()
    generate_keys(tmp_path, parameters, overwrite=True)
    assert paths.secret.read_bytes() != old  # a new key pair
    assert CkksParameters.from_context(load_public_context(paths.public)) == parameters
    with pytest.raises(ValueError, match="parameters"):
        generate_keys(tmp_path / "x", parameters=(8192, (60, 40, 40, 60), 40))  # type: ignore[arg-type]


def test_a_secret_context_others_can_read_is_refused(ckks_keys: KeyPaths, tmp_path: Path) -> None:
    """Key hygiene (review L3): the loader took a secret context whatever its mode. A copy
    its group or others may read is now refused, naming the file, the mode and the fix."""
    exposed = tmp_path / "secret_context.tenseal"
    exposed.write_bytes(ckks_keys.secret.read_bytes())
    for mode in (0o644, 0o640, 0o604, 0o620):
        exposed.chmod(mode)
        with pytest.raises(KeyMaterialError, match=f"mode {mode:04o}.*chmod 600"):
            load_secret_context(exposed)
    exposed.chmod(0o600)
    assert context_has_secret_key(load_secret_context(exposed))


def test_generate_keys_makes_the_secret_folder_private_and_can_part_the_contexts(
    tmp_path: Path,
) -> None:
    """mkdir's mode does not tighten a folder that exists: the secret's folder was left as
    it was (e.g. 0755, listable by all). It is now made 0700; and the public context can go
    to a folder of its own (to ship to the server) instead of sitting beside the secret."""
    folder = tmp_path / "holder"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    paths = generate_keys(
        folder, CkksParameters(4096, (60, 49), 40), public_directory=tmp_path / "server"
    )
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert paths.secret.parent == folder and paths.public.parent == tmp_path / "server"
    assert not (folder / paths.public.name).exists()
    assert not context_has_secret_key(load_public_context(paths.public))


def test_secret_context_path_default_folder(ckks_keys: KeyPaths, tmp_path: Path) -> None:
    """Last resort: the node's own default key folder (never a path from the server)."""
    assert secret_context_path({}, {}, default_dir=ckks_keys.secret.parent) == ckks_keys.secret


def test_secret_context_path_lookup(ckks_keys: KeyPaths, tmp_path: Path) -> None:
    other = tmp_path / "other.tenseal"
    other.write_bytes(b"x")
    node = {NODE_CONFIG_KEY: str(ckks_keys.secret)}
    env = {SECRET_CONTEXT_ENV: str(other)}
    assert secret_context_path(node, env) == ckks_keys.secret  # node config first
    assert secret_context_path({}, env) == other  # then the environment
    assert secret_context_path({NODE_CONFIG_KEY: ""}, env) == other  # empty = unset
    with pytest.raises(KeyMaterialError) as error:
        secret_context_path({}, {}, default_dir=tmp_path / "no-keys-here")
    assert NODE_CONFIG_KEY in str(error.value) and SECRET_CONTEXT_ENV in str(error.value)
    with pytest.raises(KeyMaterialError, match="absolute"):
        secret_context_path({NODE_CONFIG_KEY: "keys/secret"}, {})
    with pytest.raises(KeyMaterialError, match=f"{SECRET_CONTEXT_ENV}.*no such file"):
        secret_context_path({}, {SECRET_CONTEXT_ENV: str(tmp_path / "missing")})
    with pytest.raises(KeyMaterialError, match="path string"):
        secret_context_path({NODE_CONFIG_KEY: 3}, {})


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


def test_encrypt_transport_add_decrypt_matches_plaintext_sum(
    secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    weights, estimates = population(50, seed=1)
    vectors = [
        append_count_slot(np.array([w, w * y, w * y * y]))
        for w, y in zip(weights, estimates, strict=True)
    ]
    arrays = [to_array(encrypt_vector(secret_ctx, vector)) for vector in vectors]
    for array in arrays:
        assert array.dtype == np.uint8 and array.ndim == 1
        assert len(ts.ckks_vector_from(public_ctx, from_array(array)).ciphertext()) == 1
    total, rejections = add_ciphertexts(public_ctx, [from_array(a) for a in arrays])
    assert rejections == []
    decrypted = decrypt_vector(secret_ctx, total, expected_size=4)
    expected = np.sum(vectors, axis=0)
    assert np.all(np.abs(decrypted - expected) <= 1e-7 * np.abs(expected))
    assert np.array_equal(check_count_slot(decrypted, 50), decrypted[:3])
    # uint8 arrays are accepted as payloads too
    again, _ = add_ciphertexts(public_ctx, arrays)
    assert np.allclose(decrypt_vector(secret_ctx, again), expected, rtol=1e-7)


def test_array_conversion_checks() -> None:
    assert from_array(to_array(b"\x00\xffab")) == b"\x00\xffab"
    with pytest.raises(ValueError, match="array must be a 1-D uint8 array"):
        from_array(np.zeros(3))
    with pytest.raises(ValueError, match="array must be a 1-D uint8 array"):
        from_array(np.zeros((2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="data must be bytes"):
        to_array("text")  # type: ignore[arg-type]


def test_encrypt_vector_checks_values(secret_ctx: ts.Context) -> None:
    with pytest.raises(ValueError, match="values must be finite"):
        encrypt_vector(secret_ctx, np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="values must be a non-empty 1-D"):
        encrypt_vector(secret_ctx, np.array([]))
    with pytest.raises(ValueError, match="4096 slots"):
        encrypt_vector(secret_ctx, np.ones(4097))


def test_server_rejects_bad_payloads_and_sums_the_valid_ones(
    secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    good = [np.array([1.5e5, 4.2e3, 1.0, 1.0]), np.array([2.5e4, -3.1e2, 2.0, 1.0])]
    valid = [encrypt_vector(secret_ctx, vector) for vector in good]
    other_params = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 20, 40])
    other_params.global_scale = 2**20
    other_scale = CkksParameters().make_context()
    other_scale.global_scale = 2**30
    bfv = ts.context(ts.SCHEME_TYPE.BFV, 8192, plain_modulus=1032193)
    payloads = [
        valid[0],
        b"\x00garbage" * 50,  # 1
        valid[1][: len(valid[1]) // 2],  # 2 truncated
        ts.ckks_vector(other_params, [1.0, 2.0, 3.0, 4.0]).serialize(),  # 3 other parameters
        ts.bfv_vector(bfv, [1, 2, 3, 4]).serialize(),  # 4 BFV
        encrypt_vector(secret_ctx, np.ones(5)),  # 5 other length
        ts.ckks_vector(other_scale, [1.0, 2.0, 3.0, 4.0]).serialize(),  # 6 other scale
        ts.ckks_tensor(secret_ctx, [1.0, 2.0, 3.0, 4.0]).serialize(),  # 7 one ct per value
        b"",  # 8
        np.zeros(4),  # 9 not a uint8 array
        valid[1],
    ]
    total, rejections = add_ciphertexts(public_ctx, payloads, expected_size=4)
    kinds = {rejection.index: rejection.kind for rejection in rejections}
    assert kinds == {
        1: "malformed",
        2: "malformed",
        3: "parameters",
        4: "parameters",
        5: "size",
        6: "parameters",
        7: "parameters",
        8: "malformed",
        9: "malformed",
    }
    assert all(rejection.reason for rejection in rejections)
    assert "scale" in next(r.reason for r in rejections if r.index == 6)
    assert "one ciphertext" in next(r.reason for r in rejections if r.index == 7)
    assert np.allclose(decrypt_vector(secret_ctx, total), np.sum(good, axis=0), rtol=1e-9)
    # Without expected_size the most common slot count wins.
    _, rejections = add_ciphertexts(public_ctx, [valid[0], payloads[5], valid[1]])
    assert [(r.index, r.kind) for r in rejections] == [(1, "size")]


def test_server_errors(secret_ctx: ts.Context, public_ctx: ts.Context) -> None:
    with pytest.raises(NoValidCiphertextError) as error:
        add_ciphertexts(public_ctx, [b"x", b""])
    assert len(error.value.rejections) == 2
    with pytest.raises(KeyMaterialError, match="secret key"):
        add_ciphertexts(secret_ctx, [encrypt_vector(secret_ctx, np.ones(2))])


def test_foreign_key_is_undetectable_by_the_server_but_caught_after_decryption(
    secret_ctx: ts.Context, public_ctx: ts.Context, foreign_ctx: ts.Context
) -> None:
    honest = [append_count_slot(np.array([1e5, 3e3])) for _ in range(3)]
    payloads = [encrypt_vector(secret_ctx, vector) for vector in honest]
    payloads.append(encrypt_vector(foreign_ctx, append_count_slot(np.array([1e5, 3e3]))))
    total, rejections = add_ciphertexts(public_ctx, payloads)
    assert rejections == []  # same parameters: the server cannot tell
    decrypted = decrypt_vector(secret_ctx, total)
    with pytest.raises(CountSlotError, match="4 accepted"):
        check_count_slot(decrypted, 4)
    with pytest.raises(MagnitudeCheckError, match="max_magnitude"):
        check_magnitude(decrypted)


def test_checks_of_decrypted_values() -> None:
    assert np.array_equal(check_count_slot(np.array([2.0, 3.0005]), 3), [2.0])
    with pytest.raises(CountSlotError):
        check_count_slot(np.array([2.0, 3.002]), 3)
    with pytest.raises(CountSlotError):
        check_count_slot(np.array([2.0, np.nan]), 3)
    with pytest.raises(ValueError, match="tolerance"):
        check_count_slot(np.array([2.0, 3.0]), 3, tolerance=0.0)
    with pytest.raises(MagnitudeCheckError, match="not finite"):
        check_magnitude(np.array([1.0, np.inf]))
    assert check_magnitude(np.array([1e11]), max_magnitude=1e12)[0] == 1e11
    with pytest.raises(MagnitudeCheckError):
        check_magnitude(np.array([2e3]), max_magnitude=1e3)
    assert issubclass(CountSlotError, DecryptionCheckError)
    assert issubclass(MagnitudeCheckError, DecryptionCheckError)


# --------------------------------------------------------------------------------------------
# The three-round protocol
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 10, 50])
def test_protocol_matches_plaintext_and_sends_only_ciphertexts(
    k: int, secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    weights, estimates = population(k, seed=k)
    contributions = contributions_of(weights, estimates)
    trace = run_protocol_locally(
        contributions, terms, secret_ctx, public_ctx, report_fn=report, keep_messages=True
    )
    expected = plaintext_statistics(weights, estimates)
    released = dict(zip(["q", "t1", "w", "wy", "count"], trace.released, strict=True))
    for name, value in expected.items():
        assert released[name] == pytest.approx(value, rel=1e-6), name
    plain_report = report(np.array([expected[n] for n in ("q", "t1", "w", "wy", "count")]))
    for name, value in plain_report.items():
        assert abs(trace.report[name] - value) <= 1e-6, name
    # The plaintext run of the same protocol agrees too.
    baseline = run_protocol_plaintext(contributions, terms, report_fn=report)
    assert np.allclose(baseline.released, trace.released, rtol=1e-6)

    # The server never held a secret key.
    assert not context_has_secret_key(public_ctx)
    # At most one ciphertext per client per round; every client uploaded one in rounds 1, 2.
    assert trace.max_ciphertexts_per_round == 1
    assert np.all(trace.ciphertexts[:, :2] == 1) and np.all(trace.ciphertexts[:, 2] == 0)
    assert trace.round1_clients == trace.round2_clients == tuple(range(k))
    assert trace.key_holders == (0, 1)
    # Every upload of rounds 1-2 is a uint8 ciphertext; round 3 carries only the aggregates.
    for upload in trace.uploads:
        if upload.round < 3:
            assert upload.payload.dtype == np.uint8
            payload = from_array(upload.payload)
            vector = ts.ckks_vector_from(public_ctx, payload)
            assert len(vector.ciphertext()) == 1
            with pytest.raises(ValueError):
                vector.decrypt()
            w, wy = contributions[upload.client]
            # No float64 encoding of a statistic. (A float32 check was dropped: a 4-byte
            # pattern turns up by chance in these random ~100 KB payloads in about 2 % of
            # runs; an 8-byte one with probability ~1e-13.)
            for secret in (w, wy, w * (wy / w) ** 2):
                assert np.float64(secret).tobytes() not in payload
        else:
            assert upload.client in trace.key_holders
            assert np.array_equal(upload.payload, trace.released)
    assert sum(upload.round == 3 for upload in trace.uploads) == 2
    assert len(trace.uploads) == 2 * k + 2
    assert np.all(trace.upload_bytes[:, :2] > 100_000)  # ciphertexts, not a few floats
    assert np.all(trace.download_bytes[:, 0] == 0)


def test_dropouts_before_round_2_complete_with_the_remaining_clients(
    secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    weights, estimates = population(5, seed=7)
    contributions = contributions_of(weights, estimates)
    with pytest.raises(StaleReferenceError, match="5 clients took part in round 1 but 3"):
        run_protocol_locally(
            contributions, terms, secret_ctx, public_ctx, drop_before_round2={1, 3}
        )
    trace = run_protocol_locally(
        contributions,
        terms,
        secret_ctx,
        public_ctx,
        release_fn=release_cochran,
        drop_before_round2={1, 3},
    )
    assert trace.round1_clients == (0, 1, 2, 3, 4)
    assert trace.round2_clients == (0, 2, 4)
    assert trace.dropped_before_round2 == (1, 3)
    assert trace.participants_changed
    assert np.all(trace.ciphertexts[[1, 3], 1:] == 0)
    assert np.all(trace.download_bytes[[1, 3], 1:] == 0)
    survivors = np.array([0, 2, 4])
    expected = plaintext_statistics(weights[survivors], estimates[survivors])
    q, total, weighted, count = trace.released
    assert q == pytest.approx(expected["q"], rel=1e-6)
    assert total == pytest.approx(expected["w"], rel=1e-6)
    assert weighted == pytest.approx(expected["wy"], rel=1e-6)
    assert count == 3


def test_dropout_before_round_3_changes_nothing_but_the_key_holders(
    secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    weights, estimates = population(5, seed=8)
    trace = run_protocol_locally(
        contributions_of(weights, estimates),
        terms,
        secret_ctx,
        public_ctx,
        drop_before_round3={0},
    )
    assert trace.key_holders == (1, 2)
    assert trace.dropped_before_round3 == (0,)
    assert trace.released[0] == pytest.approx(plaintext_statistics(weights, estimates)["q"])
    assert trace.download_bytes[0, 2] == 0 and trace.download_bytes[1, 2] > 0


def test_too_few_clients_fail_clearly(secret_ctx: ts.Context, public_ctx: ts.Context) -> None:
    contributions = contributions_of(*population(3, seed=9))
    with pytest.raises(ProtocolError, match="round 2: 1 clients remain.*min_clients=2"):
        run_protocol_locally(
            contributions, terms, secret_ctx, public_ctx, drop_before_round2={0, 1}
        )
    with pytest.raises(ProtocolError, match="key_holders=2"):
        run_protocol_locally(
            contributions, terms, secret_ctx, public_ctx, drop_before_round3={0, 1}
        )
    with pytest.raises(ProtocolError, match="at least min_clients=2"):
        run_protocol_locally(contributions[:1], terms, secret_ctx, public_ctx)
    with pytest.raises(ValueError, match="drop_before_round2"):
        run_protocol_locally(contributions, terms, secret_ctx, public_ctx, drop_before_round2={7})


def test_protocol_refuses_a_secret_key_on_the_server(secret_ctx: ts.Context) -> None:
    with pytest.raises(KeyMaterialError, match="public_ctx holds a secret key"):
        run_protocol_locally(
            contributions_of(*population(2, seed=1)), terms, secret_ctx, secret_ctx
        )


def test_rejected_client_is_left_out_and_foreign_key_is_caught(
    secret_ctx: ts.Context, public_ctx: ts.Context, foreign_ctx: ts.Context
) -> None:
    weights, estimates = population(4, seed=10)
    contributions = contributions_of(weights, estimates)

    def garbage_from_client_2(round_number: int, client: int, payload: np.ndarray) -> np.ndarray:
        return to_array(b"junk") if (round_number, client) == (1, 2) else payload

    trace = run_protocol_locally(
        contributions, terms, secret_ctx, public_ctx, tamper=garbage_from_client_2
    )
    assert trace.round1_clients == (0, 1, 3)
    assert [(r.round, r.client, r.kind) for r in trace.rejections] == [(1, 2, "malformed")]
    keep = np.array([0, 1, 3])
    expected = plaintext_statistics(weights[keep], estimates[keep])
    assert trace.released[0] == pytest.approx(expected["q"], rel=1e-6)

    def foreign_from_client_1(round_number: int, client: int, payload: np.ndarray) -> np.ndarray:
        if (round_number, client) == (1, 1):
            return to_array(encrypt_vector(foreign_ctx, append_count_slot(contributions[1])))
        return payload

    with pytest.raises(DecryptionCheckError):
        run_protocol_locally(
            contributions, terms, secret_ctx, public_ctx, tamper=foreign_from_client_1
        )


def test_key_holders_must_agree(secret_ctx: ts.Context, public_ctx: ts.Context) -> None:
    def lying_key_holder(round_number: int, client: int, payload: np.ndarray) -> np.ndarray:
        return payload * 1.01 if (round_number, client) == (3, 1) else payload

    with pytest.raises(ProtocolError, match="released different aggregates"):
        run_protocol_locally(
            contributions_of(*population(3, seed=11)),
            terms,
            secret_ctx,
            public_ctx,
            tamper=lying_key_holder,
        )


# --------------------------------------------------------------------------------------------
# Against an active server: recomputed sums, signatures, flooding of releases
# --------------------------------------------------------------------------------------------


def test_a_holder_recomputes_the_servers_sum_bit_for_bit(
    secret_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    """The verifiers' endorsement covers the SHA-256 of the sum they recomputed: it must be
    the same bytes whatever the order, and a bad payload is refused, not skipped."""
    from fedparity.mechanisms.crypto.ckks import sum_ciphertexts

    payloads = [encrypt_vector(secret_ctx, np.full(6, float(i))) for i in range(4)]
    server, rejections = add_ciphertexts(public_ctx, payloads, expected_size=6)
    assert not rejections
    assert sum_ciphertexts(secret_ctx, payloads[::-1], expected_size=6) == server
    with pytest.raises(ValueError, match="not a valid ciphertext"):
        sum_ciphertexts(secret_ctx, [*payloads, b"junk"], expected_size=6)
    with pytest.raises(ValueError, match="wrong number of slots"):
        sum_ciphertexts(secret_ctx, payloads, expected_size=5)


def test_signed_contributions_are_checked_against_the_roster() -> None:
    import hashlib

    from fedparity.mechanisms.crypto.ckks import (
        SignedCiphertext,
        UnverifiedSumError,
        ciphertext_transcript,
        signed_arrays,
        signed_from_arrays,
        verify_contributions,
    )
    from fedparity.mechanisms.crypto.identity import IdentityKey, Roster

    keys = [IdentityKey.generate() for _ in range(3)]
    roster = Roster.from_keys({f"h{i}": key for i, key in enumerate(keys)})

    def entry(key: IdentityKey, payload: bytes, run: int = 5, rnd: int = 1) -> SignedCiphertext:
        digest = hashlib.sha256(payload).digest()
        return SignedCiphertext(
            payload, key.public_bytes(), key.sign(ciphertext_transcript(run, rnd, digest, b""))
        )

    good = [entry(key, bytes([i]) * 10) for i, key in enumerate(keys)]
    assert signed_from_arrays(signed_arrays(good, "x-"), "x-") == good
    signers = verify_contributions(good, roster, run_id=5, round_number=1, min_holders=2)
    assert signers == sorted(key.public_bytes() for key in keys)
    cases = {
        "not on the roster": [good[0], entry(IdentityKey.generate(), b"z")],
        "same member": [good[0], entry(keys[0], b"other")],
        "does not verify": [good[0], entry(keys[1], b"y", run=6)],
        "fewer than min-holders": [good[0]],
    }
    for needle, entries in cases.items():
        with pytest.raises(UnverifiedSumError, match=needle):
            verify_contributions(entries, roster, run_id=5, round_number=1, min_holders=2)
    with pytest.raises(UnverifiedSumError, match="does not verify"):
        verify_contributions(good, roster, run_id=5, round_number=2, min_holders=2)


@pytest.mark.parametrize("k", [1, 20])
def test_the_decryption_error_estimate_matches_tenseal(
    secret_ctx: ts.Context, public_ctx: ts.Context, k: int
) -> None:
    """The per-slot error model of the flooding (SEAL's rounding noise, sqrt(k) for a sum)
    against measured decryptions: std within 25% (1,000+ slots), every error below the bound."""
    from fedparity.mechanisms.crypto.ckks import decryption_error_bound, encryption_noise_std

    rng = np.random.default_rng(k)
    errors = []
    for _ in range(4):
        values = rng.uniform(-1.0, 1.0, size=(k, 400))
        payloads = [encrypt_vector(secret_ctx, row) for row in values]
        total, _ = add_ciphertexts(public_ctx, payloads, expected_size=400)
        errors.append(decrypt_vector(secret_ctx, total) - values.sum(axis=0))
    error = np.concatenate(errors)
    expected = encryption_noise_std(CkksParameters()) * math.sqrt(k)
    assert 0.75 * expected < error.std() < 1.25 * expected, (error.std(), expected)
    bound = decryption_error_bound(CkksParameters(), num_ciphertexts=k, max_magnitude=float(k))
    assert np.abs(error).max() < bound


def test_flooding_noise_is_keyed_gaussian_and_rounded() -> None:
    from fedparity.mechanisms.crypto.ckks import flood, flooding_std, keyed_gaussian

    draws = keyed_gaussian(b"k" * 32, b"message", 200_000)
    assert draws.size == 200_000
    # mean within 5 standard errors, variance within 5 standard errors (sd of s^2 ~ sqrt(2/n))
    assert abs(draws.mean()) < 5 / math.sqrt(draws.size)
    assert abs(draws.var() - 1.0) < 5 * math.sqrt(2 / draws.size)
    assert stats.kstest(draws[:20_000], "norm").pvalue > 1e-4
    np.testing.assert_array_equal(draws[:100], keyed_gaussian(b"k" * 32, b"message", 100))
    assert not np.array_equal(draws[:100], keyed_gaussian(b"k" * 32, b"other", 100))
    assert not np.array_equal(draws[:100], keyed_gaussian(b"j" * 32, b"message", 100))
    assert flooding_std(1e-9, num_values=40, security_bits=30) == pytest.approx(
        2**15 * math.sqrt(80) * 1e-9
    )
    values = np.linspace(-3.0, 3.0, 50)
    flooded = flood(values, std=1e-3, key=b"k", message=b"m")
    grid = 2.0**-10
    np.testing.assert_array_equal(flooded, np.round(flooded / grid) * grid)
    assert 0 < np.abs(flooded - values).max() < 6e-3


def test_flood_keys_come_from_the_secret_key(ckks_keys: KeyPaths, tmp_path: Path) -> None:
    """Every holder of one secret context derives the same flooding key; another key pair
    derives another (and the public context has nothing to derive it from)."""
    from fedparity.mechanisms.crypto.ckks import flood_key

    first = flood_key(load_secret_context(ckks_keys.secret))
    assert first == flood_key(load_secret_context(ckks_keys.secret))
    other = generate_keys(tmp_path / "other")
    assert flood_key(load_secret_context(other.secret)) != first
