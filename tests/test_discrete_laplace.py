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
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms.crypto.secure_random import is_secure_generator, secure_generator
from fedparity.mechanisms.ldp.discrete_laplace import (
    DiscreteLaplaceNoise,
    discrete_laplace_noise,
    uniform_index,
    uniform_words,
)
from fedparity.mechanisms.ldp.laplace import GRID_STEP, ROUNDING_BITS, LaplaceMechanism

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


# --- the packed sampler: fewer bits where they decide, the same realised table --------------


class FixedWords:
    """A stand-in generator whose next 64-bit words are given (``uniform_words`` reads them with
    ``integers``); it records how many it gave."""

    bit_generator = None

    def __init__(self, words: list[int]) -> None:
        self.words = list(words)
        self.given = 0

    def integers(self, low: int, high: int, size: int, dtype: type) -> np.ndarray:
        assert (low, high, dtype) == (0, 1 << 64, np.uint64)
        taken, self.words = self.words[:size], self.words[size:]
        self.given += size
        return np.array(taken, dtype=np.uint64)


def packed_output(
    noise: DiscreteLaplaceNoise, word: int, free_bits: int, fresh: int | None = None
) -> tuple[int, bool]:
    """(Z, whether a fresh word was read) of :meth:`sample_packed` on one word."""
    rng = FixedWords([] if fresh is None else [fresh])
    z = noise.sample_packed(np.array([word], dtype=np.uint64), free_bits, rng)
    assert z.dtype == np.float64 and z[0] == round(z[0])
    return int(z[0]), rng.given == 1


def enumerated_packed_pmf(noise: DiscreteLaplaceNoise, free_bits: int) -> dict[int, Fraction]:
    """The distribution :meth:`sample_packed` realises, by enumerating every column and every
    value of the threshold bits it reads (its other low bits at both extremes must not
    matter); where those bits tie, the redraw's 64 - t bits are searched for the point where
    the output changes (one comparison: below it one output, from it on the other)."""
    column_bits = 64 - noise.column_shift
    prefix_bits = 64 - column_bits - free_bits
    suffix_bits = 64 - prefix_bits
    pmf: dict[int, Fraction] = {}
    cell = Fraction(1, 2 ** (column_bits + prefix_bits))
    for column in range(2**column_bits):
        for prefix in range(2**prefix_bits):
            base = (column << noise.column_shift) | (prefix << free_bits)
            z, redrawn = packed_output(noise, base, free_bits, fresh=0)
            for low in (0, (1 << free_bits) - 1):  # the caller's bits do not matter
                assert packed_output(noise, base | low, free_bits, fresh=0) == (z, redrawn)
            if not redrawn:
                pmf[z] = pmf.get(z, Fraction(0)) + cell
                continue
            first = z  # the redraw's suffix 0
            last, _ = packed_output(noise, base, free_bits, fresh=2**64 - 1)
            low_end, high_end = 0, 2**suffix_bits  # the first suffix giving ``last``
            while low_end < high_end:
                middle = (low_end + high_end) // 2
                if packed_output(noise, base, free_bits, fresh=middle << prefix_bits)[0] == last:
                    high_end = middle
                else:
                    low_end = middle + 1
            below = Fraction(low_end, 2**suffix_bits) if first != last else Fraction(1)
            pmf[first] = pmf.get(first, Fraction(0)) + cell * below
            pmf[last] = pmf.get(last, Fraction(0)) + cell * (1 - below)
    return {z: p for z, p in pmf.items() if p}


def exact_table_pmf(noise: DiscreteLaplaceNoise) -> dict[int, Fraction]:
    """The alias table's distribution in exact arithmetic: column j (1 / 2^k) gives j - cap with
    probability threshold[j] / 2^64, else alias[j] - cap."""
    columns = noise.threshold.shape[0]
    pmf: dict[int, Fraction] = {}
    for column in range(columns):
        kept = Fraction(int(noise.threshold[column]), 2**64)
        alias = int(noise.pairs[column, 1])
        for z, p in ((column - noise.cap, kept), (alias - noise.cap, 1 - kept)):
            pmf[z] = pmf.get(z, Fraction(0)) + p / columns
    return {z: p for z, p in pmf.items() if p}


def test_the_packed_sampler_realises_the_tables_probabilities_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every (column, threshold bits) cell of a small table (2^3 columns; 8 threshold bits, 53
    left to the caller), enumerated: the realised probabilities are exactly the alias table's,
    so the privacy loss computed from :meth:`pmf` is the sampler's. Power check: one key's
    threshold bits off by one, or one value wrong, and the enumeration differs."""
    from fedparity.mechanisms.ldp import discrete_laplace as module

    noise = discrete_laplace_noise(2.5, 3)
    assert noise.column_shift == 61
    expected = exact_table_pmf(noise)
    assert enumerated_packed_pmf(noise, 53) == expected
    np.testing.assert_allclose(
        [float(expected.get(z, 0)) for z in range(-3, 4)], noise.pmf(), rtol=1e-15
    )
    # power checks: a deliberately wrong table is seen
    table = module.packed_table(noise, 53)
    wrong_key = table.keys.copy()
    wrong_key[2] += np.uint64(1 << 53)  # column 2 keeps one more 2^-8 of its draws
    wrong_value = table.values.copy()
    wrong_value[5] += 1.0  # column 2's own value
    for wrong in (table._replace(keys=wrong_key), table._replace(values=wrong_value)):
        monkeypatch.setattr(module, "packed_table", lambda *_, wrong=wrong: wrong)
        assert enumerated_packed_pmf(noise, 53) != expected


@pytest.mark.parametrize("epsilon_value", [1.0, 0.02, 12.0])
def test_the_m_l_layout_decides_as_the_full_64_bit_comparison(epsilon_value: float) -> None:
    """M_L's words (columns up to 2^20, 18 low bits for the rounding): for every column, words
    whose threshold bits are just below, at and just above the threshold's top bits, and
    redraws at the threshold's edge, give what :meth:`sample` gives for the full 64-bit
    threshold draw (the redraw read only at the tie)."""
    noise = LaplaceMechanism(1.0, epsilon_value)._noise  # noqa: SLF001 - the table under test
    free_bits = ROUNDING_BITS
    prefix_bits = noise.column_shift - free_bits
    assert prefix_bits >= 26
    suffix_bits = 64 - prefix_bits
    columns = np.arange(noise.threshold.shape[0], dtype=np.uint64)
    threshold = noise.threshold
    top = threshold >> np.uint64(suffix_bits)
    edge = threshold & np.uint64((1 << suffix_bits) - 1)  # the tie's suffix boundary
    prefix_mask = np.uint64((1 << prefix_bits) - 1)
    rng = np.random.default_rng(3)
    for shift in (-1, 0, 1):
        prefix = (top.astype(np.int64) + shift).astype(np.uint64) & prefix_mask
        low = rng.integers(0, 1 << free_bits, columns.shape[0], dtype=np.uint64)
        words = (columns << np.uint64(noise.column_shift)) | (prefix << np.uint64(free_bits)) | low
        tie = prefix == top
        for suffix in (edge - (edge > 0).astype(np.uint64), edge):
            fresh = suffix << np.uint64(prefix_bits)  # the redraw's top bits are the suffix
            generator = FixedWords([int(x) for x in fresh[tie]])
            z = noise.sample_packed(words, free_bits, generator)
            assert generator.given == int(tie.sum())
            draw = (prefix << np.uint64(suffix_bits)) | np.where(
                tie, suffix, rng.integers(0, 1 << suffix_bits, columns.shape[0], dtype=np.uint64)
            )
            np.testing.assert_array_equal(z, noise.sample(words, draw))


def test_packed_samples_follow_the_realised_distribution() -> None:
    """Seeded chi-square of 2,000,000 packed draws against :meth:`pmf` (false failure 1e-4),
    and the power check of :func:`test_samples_follow_the_realised_distribution`."""
    noise = discrete_laplace_noise(3.0, 40)
    words = np.random.default_rng(12).bit_generator.random_raw(2_000_000)
    rng = np.random.default_rng(13)
    z = noise.sample_packed(words, ROUNDING_BITS, rng).astype(np.int64)
    counts = np.bincount(z + noise.cap, minlength=2 * noise.cap + 1)
    expected = noise.pmf() * words.shape[0]
    keep = expected > 20
    expected_cells = np.append(expected[keep], expected[~keep].sum())
    observed = np.append(counts[keep], counts[~keep].sum())
    assert stats.chisquare(observed, expected_cells).pvalue > 1e-4
    wrong = discrete_laplace_noise(3.3, 40).sample_packed(words, ROUNDING_BITS, rng)
    observed = np.bincount(wrong.astype(np.int64) + 40, minlength=81)
    observed = np.append(observed[keep], observed[~keep].sum())
    assert stats.chisquare(observed, expected_cells).pvalue < 1e-10


def test_packed_table_refuses_a_layout_without_threshold_bits() -> None:
    noise = discrete_laplace_noise(2.5, 3)  # 2^3 columns: up to 60 bits for the caller
    with pytest.raises(ValueError, match=r"free_bits must be in \[0, 60\]"):
        noise.sample_packed(np.zeros(2, dtype=np.uint64), 61, FixedWords([]))


@pytest.mark.parametrize(("eps1", "num_groups"), [(1.0, 2), (0.5, 2), (3.0, 5), (0.01, 3)])
def test_the_group_decision_keeps_with_exactly_the_realised_probability(
    eps1: float, num_groups: int
) -> None:
    """All 2^16 pieces, and for the one that ties every one of the 2^10 redrawn low bits: the
    keep probability M_L realises is exactly ``numerator / 2^26``, the one its epsilon and
    moments use. Power check: a plan whose piece threshold is one off is seen."""
    from fedparity.mechanisms.ldp import laplace as module

    mechanism = LaplaceMechanism(eps1, 1.0, num_groups)
    numerator, bits = mechanism.group_keep_fraction
    plan = module._sampler_plan(eps1, 1.0, num_groups)  # noqa: SLF001 - the sampler under test

    def kept_words(plan: module._SamplerPlan) -> int:  # noqa: SLF001
        pieces = np.arange(1 << 16, dtype=np.uint16)
        low_bits = bits - module.GROUP_PIECE_BITS
        tie = int(plan.top)
        generator = FixedWords([0])
        kept = module._keep_decisions(pieces, plan, generator)  # noqa: SLF001
        assert generator.given == 1  # only the tying piece reads a fresh word
        total = (int(kept.sum()) - int(kept[tie])) << low_bits
        ties = np.full(1 << low_bits, tie, dtype=np.uint16)
        fresh = [low << (64 - low_bits) for low in range(1 << low_bits)]
        redrawn = module._keep_decisions(ties, plan, FixedWords(fresh))  # noqa: SLF001
        return total + int(redrawn.sum())

    assert kept_words(plan) == numerator
    wrong = plan._replace(top=np.uint16(int(plan.top) + 1))
    assert kept_words(wrong) != numerator
