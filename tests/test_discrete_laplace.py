"""M_L on a grid: what leaves a node is an exact multiple of the grid step, drawn by an
integer-only sampler whose realised privacy loss is computed, and the estimators stay
unbiased.

The attack (security review H5, Mironov, CCS 2012): with floating-point Laplace, the low
mantissa bits of a report depend on v. On the previous main, 3.75 % of M_L reports identified
v with certainty; the distinguisher below finds that in the old float construction (its power
check) and nothing in the grid mechanism.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms.crypto.secure_random import is_secure_generator, secure_generator
from fedparity.mechanisms.ldp.discrete_laplace import (
    discrete_laplace_noise,
    uniform_index,
    uniform_words,
)
from fedparity.mechanisms.ldp.laplace import GRID_STEP, LaplaceMechanism

# --- the distinguisher on the low mantissa bits --------------------------------------------------


def odd_last_bit_rate_in_window(reports: np.ndarray) -> tuple[int, int]:
    """(reports in [0.5, 1), of which the last mantissa bit is 1): the review's distinguisher."""
    window = reports[(reports >= 0.5) & (reports < 1.0)]
    bits = window.view(np.uint64) & np.uint64(1)
    return int(window.size), int(bits.sum())


def float_laplace_reports(v: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """The previous main's M_L value step: v + (2/eps2) * (+/-1) * Exp(1) in doubles."""
    signs = np.where(rng.random(count) < 0.5, -1.0, 1.0)
    return v + 2.0 * signs * rng.standard_exponential(count)


def test_the_distinguisher_finds_v_in_float_laplace_reports() -> None:
    # Power check: the attack works on the construction the grid mechanism replaces.
    rng = np.random.default_rng(5)
    size_up, odd_up = odd_last_bit_rate_in_window(float_laplace_reports(1.0, 400_000, rng))
    size_down, odd_down = odd_last_bit_rate_in_window(float_laplace_reports(-1.0, 400_000, rng))
    assert size_up > 10_000 and size_down > 5_000
    assert odd_down == 0  # v = -1: y = n - 1 with n in [1.5, 2): the last bit is always 0
    assert odd_up / size_up > 0.2  # v = +1: odd about a third of the time


def test_grid_reports_carry_no_low_bits_whatever_v_is() -> None:
    mechanism = LaplaceMechanism(0.5, 1.0)
    rng = secure_generator()
    low_bits = {}
    for v in (-1.0, 1.0, 0.3):
        groups = np.zeros(200_000, dtype=np.int64)
        reports = mechanism.perturb(groups, np.full(groups.size, v), rng).values
        size, odd = odd_last_bit_rate_in_window(reports)
        assert size > 1000 and odd == 0
        # every report is an exact multiple of the grid step: nothing below it varies
        steps = reports / GRID_STEP
        np.testing.assert_array_equal(steps, np.round(steps))
        # below 16 = 2^12 steps a multiple of 2^-8 fills at most 12 of the 52 mantissa bits,
        # so its low 40 bits are zero (larger reports, rare in the tails, use more of them)
        small = reports[np.abs(reports) < 16.0]
        mantissa = small.view(np.uint64) & np.uint64((1 << 40) - 1)
        low_bits[v] = np.unique(mantissa)
    assert all(list(bits) == [0] for bits in low_bits.values())


# --- the realised privacy loss, by exhaustive enumeration ------------------------------------


def value_output_table(mechanism: LaplaceMechanism) -> np.ndarray:
    """P(report = y | grid value v) for every grid value v in [-1, 1] (rows) and every report
    y in [-clamp, clamp] (columns), from the realised noise table, computed here directly:
    the noise pmf inside the clamp, its tail sums at the two clamp cells."""
    noise = mechanism._noise  # noqa: SLF001 - the realised table under test
    pmf = noise.pmf()
    cap, clamp = noise.cap, mechanism.clamp_steps
    values = np.arange(-round(1 / GRID_STEP), round(1 / GRID_STEP) + 1)
    reports = np.arange(-clamp, clamp + 1)
    table = pmf[reports[None, :] - values[:, None] + cap]
    at_least = np.cumsum(pmf[::-1])[::-1]  # at_least[i] = P(Z >= i - cap)
    at_most = np.cumsum(pmf)  # at_most[i] = P(Z <= i - cap)
    table[:, -1] = at_least[clamp - values + cap]
    table[:, 0] = at_most[-clamp - values + cap]
    return table


@pytest.mark.parametrize(("eps1", "eps2", "num_groups"), [(4.0, 8.0, 2), (2.0, 12.0, 3)])
def test_the_realised_epsilon_is_the_worst_case_over_every_input_pair(
    eps1: float, eps2: float, num_groups: int
) -> None:
    mechanism = LaplaceMechanism(eps1, eps2, num_groups)
    table = value_output_table(mechanism)
    np.testing.assert_allclose(table.sum(axis=1), 1.0, atol=1e-12)
    logs = np.log(table)
    # same group, any two values: per report, the largest minus the smallest log-probability
    same_group = float(np.max(logs.max(axis=0) - logs.min(axis=0)))
    # kept with value v (group g' = g) against flipped (value 0) from another group
    numerator, bits = mechanism.group_keep_fraction
    kept = numerator / 2**bits
    other = (1 - kept) / (num_groups - 1)
    zero = logs[table.shape[0] // 2]
    group_term = math.log(kept / other)
    cross = max(
        group_term + float(np.max(logs - zero[None, :])),  # report in the kept group
        -group_term + float(np.max(zero[None, :] - logs)),  # the reverse ratio
    )
    enumerated = max(same_group, cross)
    assert enumerated <= mechanism.epsilon + 1e-9  # the computed value is an upper bound ...
    # ... and a tight one: the telescoping bound over neighbouring grid points is attained up
    # to the table's quantisation
    assert enumerated >= mechanism.epsilon * (1 - 1e-4)
    assert mechanism.epsilon <= mechanism.ideal_epsilon  # never above the nominal one


# --- the sampler draws the realised table --------------------------------------------------------


def test_uniform_index_is_exact_at_the_edges() -> None:
    raw = np.array([0, 2**64 - 1, 2**63, 2**63 - 1], dtype=np.uint64)
    np.testing.assert_array_equal(uniform_index(raw, 3), [0, 2, 1, 1])
    np.testing.assert_array_equal(uniform_index(raw, 1), [0, 0, 0, 0])
    with pytest.raises(ValueError, match="size must be in"):
        uniform_index(raw, 2**32)


def test_samples_follow_the_realised_distribution() -> None:
    noise = discrete_laplace_noise(3.0, 40)
    rng = np.random.default_rng(11)
    draws = 2_000_000
    raw = rng.bit_generator.random_raw(2 * draws).reshape(2, draws)
    z = noise.sample(raw[0], raw[1]).astype(np.int64)
    counts = np.bincount(z + noise.cap, minlength=2 * noise.cap + 1)
    expected = noise.pmf() * draws
    keep = expected > 20  # chi-square cells with enough mass; the rest pooled
    observed = np.append(counts[keep], counts[~keep].sum())
    expected_cells = np.append(expected[keep], expected[~keep].sum())
    pvalue = stats.chisquare(observed, expected_cells).pvalue
    assert pvalue > 1e-4  # false failure 1e-4
    # power check: the same test rejects draws from a scale 10 % off
    wrong = discrete_laplace_noise(3.3, 40).sample(raw[0], raw[1]).astype(np.int64)
    observed = np.bincount(wrong + 40, minlength=81)
    observed = np.append(observed[keep], observed[~keep].sum())
    assert stats.chisquare(observed, expected_cells).pvalue < 1e-10


# --- unbiased and with the stated variance ----------------------------------------------------


@pytest.mark.parametrize("v", [-1.0, -0.37, 0.0, 0.4999, 1.0])
def test_kept_reports_are_unbiased_with_the_stated_variance(v: float) -> None:
    mechanism = LaplaceMechanism(30.0, 2.0)  # eps1 = 30: every group is kept (a = 1 - 1e-13)
    count = 1_000_000
    reports = mechanism.perturb(
        np.zeros(count, dtype=np.int64), np.full(count, v), secure_generator()
    )
    variance = mechanism.moments.kept_second_moment  # noise + at most step^2 / 4 of rounding
    # mean: within 5 standard errors (false failure 6e-7)
    assert abs(reports.values.mean() - v) <= 5 * math.sqrt(variance / count)
    # variance: the sample variance of n draws has sd ~ sqrt((m4 - s^4) / n); with the
    # Laplace kurtosis 6, m4 = 6 s^4 -> sd = s^2 sqrt(5 / n); 5 sd
    assert abs(reports.values.var() - variance) <= 5 * variance * math.sqrt(5 / count)


@pytest.mark.usefixtures("task_identity")
def test_noise_comes_from_a_secure_generator_in_the_node_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from flwr.app import Array, ArrayRecord, Context, RecordDict

    from fedparity.clients import LocalUsers, ldp_audit_handler
    from fedparity.clients import ldp as ldp_module
    from fedparity.clients.fpfl_node import round_rng
    from fedparity.strategies.ldp_audit import LdpGapAudit

    assert is_secure_generator(secure_generator())
    assert not is_secure_generator(np.random.default_rng(1))
    first, second = secure_generator(), secure_generator()
    # independent keys from the OS: two generators never produce the same stream
    assert not np.array_equal(first.bit_generator.random_raw(4), second.bit_generator.random_raw(4))
    # FPFL noise shares and cohorts: secure unless the (policy-allowed) seed is set
    assert is_secure_generator(round_rng(None, 0, 1))
    assert not is_secure_generator(round_rng(5, 0, 1))
    # the LDP handler draws its reports from the secure generator (a spy records what the
    # real function returned; nothing is replaced)
    made: list[np.random.Generator] = []

    def spy() -> np.random.Generator:
        made.append(secure_generator())
        return made[-1]

    monkeypatch.setattr(ldp_module, "secure_generator", spy)
    users = LocalUsers(np.arange(20) % 2, np.full(20, 0.5))
    handler = ldp_audit_handler(lambda *_: users, num_groups=2)
    mechanism = LaplaceMechanism(0.5, 1.0)
    message = LdpGapAudit(mechanism, budget=mechanism.epsilon).configure_audit(
        ArrayRecord({"w": Array(np.zeros(1))}), [3]
    )[0]
    context = Context(
        run_id=1,
        node_id=3,
        node_config={"ledger-dir": str(tmp_path)},
        state=RecordDict(),
        run_config={},
    )
    handler(message, context)
    assert len(made) == 1 and is_secure_generator(made[0])


def test_a_value_budget_outside_the_samplers_range_is_refused_before_any_release() -> None:
    tiny = LaplaceMechanism(0.001, 0.001)  # usable for planning ...
    assert tiny.epsilon == pytest.approx(tiny.ideal_epsilon)
    for mechanism in (tiny, LaplaceMechanism(1.0, 13.0)):
        with pytest.raises(ValueError, match=r"epsilon_value must be in \[0.02, 12\] for M_L"):
            mechanism.perturb(np.zeros(3, dtype=np.int64), np.zeros(3), secure_generator())


def test_m_l_draws_64_bit_words_from_any_bit_generator() -> None:
    """M_L read its words with ``BitGenerator.random_raw``, which gives 32-bit words for
    MT19937: the noise column (the word's top bits) was then always 0 and the noise nearly
    constant. With 64-bit words from every bit generator, the reports of users whose value is
    0 have the noise's second moment (200,000 users: the sample's relative standard error is
    about sqrt((kurtosis - 1) / n) < 1 %; the tolerance is 10 %)."""
    from fedparity.mechanisms import mechanism_for_budget

    mechanism = mechanism_for_budget("L", 1.0)
    expected = mechanism.moments.flipped_second_moment
    n = 200_000
    for bit_generator in (np.random.MT19937(5), np.random.PCG64(5)):
        rng = np.random.Generator(bit_generator)
        reports = mechanism.perturb(np.zeros(n, dtype=np.int64), np.zeros(n), rng)
        second_moment = float(np.mean(reports.values**2))
        assert abs(second_moment / expected - 1) < 0.1, (bit_generator, second_moment, expected)


@pytest.mark.parametrize(
    "bit_generator",
    [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937],
)
def test_uniform_words_are_the_generators_next_uint64_words(bit_generator: type) -> None:
    """``uniform_words`` reads ``random_raw`` where those are the 64-bit words (faster), and
    must give exactly the words ``integers(0, 2^64)`` gives for every bit generator: a
    generator listed wrongly (MT19937's raw words have 32 bits) fails here."""
    expected = np.random.Generator(bit_generator(9)).integers(
        0, 1 << 64, size=(2, 5000), dtype=np.uint64
    )
    words = uniform_words(np.random.Generator(bit_generator(9)), (2, 5000))
    np.testing.assert_array_equal(words, expected)
    assert words.dtype == np.uint64 and int(words.max()) >= 2**63  # all 64 bits used


def test_the_secure_generators_words_are_its_next_uint64_words() -> None:
    key = b"a sixteen-byte k"
    expected = secure_generator(key).integers(0, 1 << 64, size=4096, dtype=np.uint64)
    np.testing.assert_array_equal(uniform_words(secure_generator(key), 4096), expected)


def test_the_packed_table_draws_what_the_alias_formula_draws() -> None:
    """:meth:`DiscreteLaplaceNoise.sample` reads threshold and alias from one packed row; it
    must equal the alias method written out, ``alias_value + [draw < threshold] own_offset``,
    on random words and on the words at every column's threshold edge."""
    noise = discrete_laplace_noise(2.5, 60)
    rng = np.random.default_rng(4)
    columns = rng.bit_generator.random_raw(200_000)
    thresholds = rng.bit_generator.random_raw(200_000)
    index = (columns >> np.uint64(noise.column_shift)).astype(np.intp)
    edge = noise.threshold[index]
    for draws in (thresholds, edge, edge - (edge > 0).astype(np.uint64)):
        reference = noise.alias_value[index] + (draws < edge) * noise.own_offset[index]
        np.testing.assert_array_equal(noise.sample(columns, draws), reference)
