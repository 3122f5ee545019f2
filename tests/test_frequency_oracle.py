"""Frequency oracles (GRR, optimal unary encoding, subset selection): privacy, unbiasedness,
variance and the variance-based chooser.

Statistical tests are seeded Monte Carlo runs whose tolerances come from the math: each check
allows a family-wise false-alarm probability of 0.001 (Bonferroni over the coordinates), so a
wrong formula fails and a right one passes with a seed-independent margin.

The samplers draw uniform 64-bit words and compare them with integer thresholds: the privacy
tests enumerate the realised output distribution exactly (fractions), and word-by-word tests
feed chosen words through a scripted bit generator to check that the sampler realises it.
"""

from __future__ import annotations

import importlib
import itertools
import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from randomgen import UserBitGenerator
from scipy import stats

from fedparity.mechanisms import FrequencyOracle, frequency_oracle
from fedparity.mechanisms.crypto.secure_random import secure_generator
from fedparity.mechanisms.ldp.frequency_oracle import CHUNK, TWO_64

frequency_oracle_module = importlib.import_module("fedparity.mechanisms.ldp.frequency_oracle")

FAMILY_ALPHA = 1e-3


def all_oracles(epsilon: float, k: int) -> list[FrequencyOracle]:
    """GRR, OUE and subset selection with every omega in [1, k - 1]."""
    return [
        FrequencyOracle("grr", epsilon, k, 1),
        FrequencyOracle("oue", epsilon, k, 0),
        *(FrequencyOracle("ss", epsilon, k, w) for w in range(1, k)),
    ]


# ---- privacy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("epsilon", [0.3, 1.0, 2.5])
def test_worst_likelihood_ratio_of_the_enumerated_outputs_is_e_to_the_epsilon(
    k: int, epsilon: float
) -> None:
    for oracle in all_oracles(epsilon, k):
        tables = [oracle.output_distribution(x) for x in range(k)]
        outputs = set(tables[0])
        for table in tables:
            assert set(table) == outputs
            assert math.isclose(sum(table.values()), 1.0, rel_tol=0, abs_tol=1e-12), oracle
        worst = max(
            tables[x][y] / tables[other][y]
            for x, other in itertools.permutations(range(k), 2)
            for y in outputs
        )
        # The realised epsilon is the worst log-ratio, and it is the epsilon asked for.
        assert math.isclose(math.log(worst), oracle.epsilon, rel_tol=1e-12), oracle
        assert math.isclose(oracle.epsilon, epsilon, rel_tol=1e-12), oracle


def threshold_step(oracle: FrequencyOracle) -> float:
    """How much one unit of the integer threshold moves the realised epsilon (about)."""
    t = oracle.threshold
    if oracle.name == "oue":
        return 1.0 / (t - 1) + 1.0 / (TWO_64 - t)
    return 1.0 / t + 1.0 / (TWO_64 - t - 1)


def proven_at_most_exp(ratio: Fraction, epsilon: float) -> bool:
    """ratio <= e^epsilon, proven with 80-digit decimals and a 10^-70 margin (independent of
    the library's own threshold code)."""
    with localcontext() as context:
        context.prec = 80
        value = Decimal(ratio.numerator) / Decimal(ratio.denominator)
        margin = Decimal(10) ** -70
        return value * (1 + margin) <= Decimal(epsilon).exp() * (1 - margin)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("epsilon", [0.01, 1.0, 8.0, 20.0])
def test_the_enumerated_realised_distribution_has_epsilon_at_most_the_target(
    k: int, epsilon: float
) -> None:
    # Every oracle (GRR, OUE, subset selection with every omega), every input value: the
    # realised output distribution sums to 1, its worst likelihood ratio over all outputs and
    # all pairs of inputs is e^oracle.epsilon, and that is at most e^epsilon_target (proven on
    # the exact fractions), short of it by about one step of the integer threshold.
    for oracle in all_oracles(epsilon, k):
        exact = [oracle.exact_output_distribution(x) for x in range(k)]
        tables = [oracle.output_distribution(x) for x in range(k)]
        outputs = list(exact[0])
        for exact_table, table in zip(exact, tables, strict=True):
            assert list(exact_table) == list(table) == outputs
            assert sum(exact_table.values()) == 1, oracle
            assert math.isclose(sum(table.values()), 1.0, rel_tol=0, abs_tol=1e-12), oracle
            assert all(probability > 0 for probability in exact_table.values()), oracle
        # worst ratio over pairs of inputs, per output: its largest over its smallest probability
        worst = max(max(t[y] for t in exact) / min(t[y] for t in exact) for y in outputs)
        worst_float = max(
            math.log(max(t[y] for t in tables)) - math.log(min(t[y] for t in tables))
            for y in outputs
        )
        exact_log = math.log1p(float(worst - 1))
        assert math.isclose(exact_log, oracle.epsilon, rel_tol=1e-12, abs_tol=1e-15), oracle
        assert math.isclose(worst_float, oracle.epsilon, rel_tol=1e-12, abs_tol=1e-15), oracle
        assert oracle.epsilon <= oracle.epsilon_target, oracle
        assert proven_at_most_exp(worst, oracle.epsilon_target), oracle
        slack = oracle.epsilon_target - oracle.epsilon
        assert slack <= 2 * threshold_step(oracle) + 8 * math.ulp(epsilon), (oracle, slack)


@pytest.mark.parametrize("epsilon", [50.0, 1e6])
def test_beyond_the_grid_the_thresholds_saturate_and_epsilon_is_the_realised_one(
    epsilon: float,
) -> None:
    # e^eps beyond 2^64 k: the thresholds stop at 2^64 - 1 (GRR, SS) and 1 (OUE), and epsilon
    # is what that realises (ln((2^64 - 1)(k - omega) / omega), OUE ln(2^64 - 1)), not the target.
    for oracle in all_oracles(epsilon, 6):
        t = oracle.threshold
        if oracle.name == "oue":
            assert t == 1
            assert oracle.epsilon == pytest.approx(math.log(TWO_64 - 1), rel=1e-15)
        else:
            w = 1 if oracle.name == "grr" else oracle.subset_size
            assert t == TWO_64 - 1
            expected = math.log(TWO_64 - 1) + math.log(6 - w) - math.log(w)
            assert oracle.epsilon == pytest.approx(expected, rel=1e-15)
        assert oracle.epsilon < epsilon
        tables = [oracle.exact_output_distribution(x) for x in range(6)]
        worst = max(max(t[y] for t in tables) / min(t[y] for t in tables) for y in tables[0])
        assert math.isclose(math.log(worst), oracle.epsilon, rel_tol=1e-12)


#: What the scripted generator returns once its words run out: a word that bounded draws
#: accept (0 would be rejected by Lemire's method forever).
FILLER_WORD = 0x9E3779B97F4A7C15


def scripted_generator(words: list[int]) -> tuple[np.random.Generator, list[int]]:
    """A Generator whose bit generator returns ``words`` in order (then FILLER_WORD), and the
    list of the words it has handed out. Its 32-bit draws (bounded integers below 2^32) are
    the top halves of the words."""
    supply = iter(words)
    used: list[int] = []

    def next_raw(_state: object) -> int:
        word = next(supply, FILLER_WORD)
        used.append(word)
        return word

    return np.random.Generator(UserBitGenerator(next_raw, 64)), used


def subsets(reports: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(j) for j in np.flatnonzero(row)) for row in reports]


def sampler_stream(oracle: FrequencyOracle, user_words: list[int]) -> list[int]:
    """The words a scripted generator must hand out for the users' 64-bit words to be
    ``user_words``: with the lookup table, the users' top 16 bits packed four to a word (in the
    order of the words' 16-bit pieces in memory), then, for each user whose bucket straddles
    two shapes (the table's sentinel), a word whose top 48 bits are that user's low 48 bits;
    without it (the division for every word), the words themselves."""
    module = frequency_oracle_module
    layout = module._layout(oracle.threshold, *oracle._shape_counts())
    if layout.shapes_in + layout.shapes_out > module.MAX_LOOKUP_SHAPES:
        return list(user_words)
    table = module._shape_lookup(layout)
    tops = [word >> 48 for word in user_words]
    pieces = np.zeros(-(-len(tops) // 4) * 4, dtype=np.uint16)
    pieces[: len(tops)] = tops
    stream = [int(word) for word in pieces.view(np.uint64)]
    low = (1 << 48) - 1
    stream += [(word & low) << 16 for word in user_words if table[word >> 48] == table[-1]]
    return stream


@pytest.fixture(params=["lookup", "divide"])
def mapping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a word becomes a report shape: the table of the word's top bits (with the
    division for the buckets that straddle two shapes), and the division for every word."""
    if request.param == "divide":
        monkeypatch.setattr(frequency_oracle_module, "MAX_LOOKUP_SHAPES", 0)
    return str(request.param)


@pytest.mark.parametrize("epsilon", [0.01, 1.0, 8.0, 20.0, 50.0])
@pytest.mark.parametrize("k", [2, 5, 8, 16])
def test_the_lookup_table_gives_the_shape_the_division_gives(epsilon: float, k: int) -> None:
    # The table of the top 16 bits is a shortcut: wherever it does not send a word to the
    # division (its sentinel), it gives the division's shape, on every bucket's first and last
    # word, on both sides of every boundary of the shapes' ranges, and on random words; and it
    # sends few buckets there (at most the number of boundaries).
    module = frequency_oracle_module
    for oracle in all_oracles(epsilon, k):
        if oracle.name == "oue" or sum(oracle._shape_counts()) > module.MAX_LOOKUP_SHAPES:
            continue  # no table: the division for every word
        layout = module._layout(oracle.threshold, *oracle._shape_counts())
        table = module._shape_lookup(layout)
        sentinel = layout.shapes_in + layout.shapes_out + 1
        assert table[-1] == sentinel
        assert int((table == sentinel).sum()) <= layout.shapes_in + layout.shapes_out + 2
        p = oracle.threshold
        boundaries = [i * layout.step_in for i in range(1, layout.shapes_in + 1)]
        boundaries += [p + j * layout.step_out for j in range(layout.shapes_out + 1)]
        starts = np.arange(1 << 16, dtype=np.uint64) << np.uint64(48)
        words = [
            starts,
            starts + np.uint64((1 << 48) - 1),
            np.array(
                [b + d for b in boundaries for d in (-1, 0) if 0 <= b + d < TWO_64], np.uint64
            ),
            np.random.default_rng(k).integers(0, TWO_64, 1 << 16, dtype=np.uint64),
        ]
        for batch in words:
            shapes, leftover = module._map_words(batch, layout)
            looked_up = table[(batch >> np.uint64(48)).astype(np.int64)]
            direct = looked_up != sentinel
            assert np.all(looked_up[direct] == shapes[direct]), oracle
            if leftover is not None:
                assert not leftover[direct].any(), oracle


@pytest.mark.parametrize("epsilon", [0.01, 1.0, 8.0, 20.0, 50.0])
@pytest.mark.parametrize("k", [2, 3, 5, 8, 16])
def test_a_bucket_from_a_16_bit_piece_and_48_fresh_bits_realise_the_accounted_shapes(
    epsilon: float, k: int
) -> None:
    # The lookup path gives a user the top 16 bits of its word (its bucket) from a 16-bit
    # piece of a shared word, and reads 48 fresh bits only when the bucket straddles two
    # shapes' ranges: the user's word is still uniform on the 2^64 grid. Exact enumeration
    # over the 2^16 buckets, weighing each 2^48 words, of what the sampler gives (the table's
    # shape for a bucket inside one range, the ranges' overlap with a straddling bucket, the
    # left-over words' uniform redraw): every shape's probability is the one the privacy
    # accounting uses, p / A for a shape holding the user's category, (1 - p) / B for the others.
    module = frequency_oracle_module
    bucket = 1 << 48
    for oracle in all_oracles(epsilon, k):
        if oracle.name == "oue" or sum(oracle._shape_counts()) > module.MAX_LOOKUP_SHAPES:
            continue  # no table: the division for every word
        layout = module._layout(oracle.threshold, *oracle._shape_counts())
        table = module._shape_lookup(layout)
        sentinel = int(table[-1])
        inner, outer, p = layout.shapes_in, layout.shapes_out, oracle.threshold
        # each shape's range of words, and the left-over ranges (shape None)
        ranges = [(i * layout.step_in, (i + 1) * layout.step_in, True) for i in range(inner)]
        ranges += [(inner * layout.step_in, p, True)]
        ranges += [
            (p + j * layout.step_out, p + (j + 1) * layout.step_out, False) for j in range(outer)
        ]
        ranges += [(p + outer * layout.step_out, TWO_64, False)]
        straddling = np.flatnonzero(table == sentinel)
        left = {inner: 0, inner + 1 + outer: 0}  # left-over words below P, from P on
        mass: dict[int, int] = {}
        for index, (low, high, _) in enumerate(ranges):
            if low >= high:
                continue
            # the 48 fresh bits: the words of the straddling buckets in this range
            first, last = np.searchsorted(straddling, [low // bucket, (high - 1) // bucket + 1])
            words = sum(
                min(high, (t + 1) * bucket) - max(low, t * bucket)
                for t in straddling[first:last].tolist()
            )
            if index in left:
                left[index] = words
                continue
            shapes, leftover = module._map_words(np.array([low, high - 1], np.uint64), layout)
            assert shapes[0] == shapes[1] and (leftover is None or not leftover.any())
            shape = int(shapes[0])
            # the table: a bucket it gives this shape lies wholly inside the range
            inside = np.flatnonzero(table == shape)
            if inside.size:
                assert low <= int(inside[0]) * bucket, oracle
                assert (int(inside[-1]) + 1) * bucket <= high, oracle
            mass[shape] = words + inside.size * bucket
        assert sum(mass.values()) + sum(left.values()) == TWO_64, oracle
        exact_p, _ = oracle._exact_probabilities()
        for index, (low, high, included) in enumerate(ranges):
            if index in left:
                continue
            # an empty range (a step of 0 words, at a saturated epsilon): the redraw alone
            shape = int(module._map_words(np.array([low], np.uint64), layout)[0][0])
            words = mass[shape] if low < high else 0
            if included:
                realised = Fraction(words + Fraction(left[inner], inner), TWO_64)
                assert realised == exact_p / inner, oracle
            else:
                realised = Fraction(words + Fraction(left[inner + 1 + outer], outer), TWO_64)
                assert realised == (1 - exact_p) / outer, oracle


def test_four_users_share_a_word_when_their_buckets_lie_inside_one_shape() -> None:
    # GRR, k = 4, epsilon 1: words in the middle of the kept range and of each other
    # category's range; eight users take two words, and get what the division gives.
    oracle = FrequencyOracle("grr", 1.0, 4, 1)
    p = oracle.threshold
    step = (TWO_64 - p) // 3
    middles = [p // 2, *(p + s * step + step // 2 for s in range(3))] * 2
    stream = sampler_stream(oracle, middles)
    assert len(stream) == 2
    rng, used = scripted_generator(stream)
    reports = oracle.perturb(np.full(8, 1), rng)
    assert len(used) == 2
    assert reports[:4].tolist() == reports[4:].tolist()
    assert reports[0] == 1 and sorted(reports[:4].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("epsilon,k", [(1.0, 5), (0.01, 3), (8.0, 2), (20.0, 8)])
def test_grr_keeps_a_word_below_its_threshold_and_cuts_the_rest_in_equal_cells(
    epsilon: float, k: int, mapping: str
) -> None:
    # GRR keeps the user's category when the word is below P (probability P / 2^64); the words
    # from P on are cut into k - 1 cells of floor((2^64 - P) / (k - 1)) words, one per other
    # category (the fewer than k - 1 left over redraw, see the next test): exactly uniform.
    oracle = FrequencyOracle("grr", epsilon, k, 1)
    p, value = oracle.threshold, k - 1
    assert oracle.support_probability == p / TWO_64
    step = (TWO_64 - p) // (k - 1)
    words = [0, p - 1] + [p + s * step + end for s in range(k - 1) for end in (0, step - 1)]
    stream = sampler_stream(oracle, words)
    rng, used = scripted_generator(stream)
    reports = oracle.perturb(np.full(len(words), value), rng)
    assert len(used) == len(stream)  # no redraw
    assert reports[:2].tolist() == [value, value]
    cells = reports[2:].reshape(k - 1, 2)
    assert np.all(cells[:, 0] == cells[:, 1])
    assert sorted(cells[:, 0].tolist()) == [j for j in range(k) if j != value]


@pytest.mark.parametrize("epsilon,k", [(1.0, 6), (0.5, 7), (3.0, 3), (50.0, 4)])
def test_a_left_over_word_draws_the_other_category_with_a_bounded_integer(
    epsilon: float, k: int, mapping: str
) -> None:
    # The top (2^64 - P) mod (k - 1) words fit no whole cell: such a word draws the other
    # category afresh with numpy's bounded integers (Lemire's method, exactly uniform). At
    # epsilon 50 there is one word from P on (P = 2^64 - 1) and it always redraws.
    oracle = FrequencyOracle("grr", epsilon, k, 1)
    p = oracle.threshold
    assert (TWO_64 - p) % (k - 1) != 0, "pick parameters with left-over words"
    follow = [0x0123456789ABCDEF, 0xFEDCBA9876543210]
    stream = sampler_stream(oracle, [TWO_64 - 1])
    for value in range(k):
        rng, used = scripted_generator([*stream, *follow])
        report = int(oracle.perturb(np.array([value]), rng)[0])
        reference, _ = scripted_generator(follow)
        fresh = int(reference.integers(0, np.array([k - 1]))[0])
        assert report == (value + 1 + fresh) % k != value
        assert len(used) == len(stream) + 1  # the word, then one for the bounded draw


@pytest.mark.parametrize("epsilon", [0.3, 4.0])
def test_subset_selection_cuts_the_words_into_one_cell_per_subset(
    epsilon: float, mapping: str
) -> None:
    # k = 5, omega = 2 (the table sampler): the words below P are cut into C(4, 1) = 4 cells,
    # one per subset that holds the user's category, the words from P on into C(4, 2) = 6
    # cells, one per subset that does not; every cell has the same number of words.
    k, w, value = 5, 2, 3
    oracle = FrequencyOracle("ss", epsilon, k, w)
    p = oracle.threshold
    inside, outside = p // math.comb(k - 1, w - 1), (TWO_64 - p) // math.comb(k - 1, w)
    words = [s * inside + end for s in range(4) for end in (0, inside - 1)]
    words += [p + s * outside + end for s in range(6) for end in (0, outside - 1)]
    stream = sampler_stream(oracle, words)
    rng, used = scripted_generator(stream)
    reports = subsets(oracle.perturb(np.full(len(words), value), rng))
    assert len(used) == len(stream)
    cells = [reports[i] for i in range(0, len(reports), 2)]
    assert reports[::2] == reports[1::2]
    with_value = [s for s in itertools.combinations(range(k), w) if value in s]
    without = [s for s in itertools.combinations(range(k), w) if value not in s]
    assert sorted(cells[:4]) == with_value
    assert sorted(cells[4:]) == without


def test_subset_selection_at_a_saturated_epsilon_redraws_the_single_excluded_word(
    mapping: str,
) -> None:
    # epsilon 50, k = 6, omega = 2: P = 2^64 - 1, so one word (2^64 - 1) excludes the user's
    # category and fewer words than subsets lie above P; it redraws a subset without it.
    oracle = FrequencyOracle("ss", 50.0, 6, 2)
    assert oracle.threshold == TWO_64 - 1
    stream = sampler_stream(oracle, [0, TWO_64 - 2, TWO_64 - 1])
    rng, used = scripted_generator([*stream, 0x0123456789ABCDEF])
    reports = subsets(oracle.perturb(np.array([4, 4, 4]), rng))
    assert 4 in reports[0] and 4 in reports[1] and 4 not in reports[2]
    assert len(used) == len(stream) + 1


def test_oue_sets_a_bit_below_its_threshold_and_the_true_bit_below_half_the_words() -> None:
    # One word per category: bit j is word_j < Q for the other categories and
    # word_x < 2^63 (exactly 1/2) for the user's own.
    oracle = FrequencyOracle("oue", 1.0, 4, 0)
    q, half = oracle.threshold, 1 << 63
    assert oracle.other_support_probability == q / TWO_64
    for words, bits in [
        ([q - 1, q, half - 1, 0], [1, 0, 1, 1]),
        ([q, TWO_64 - 1, half, q - 1], [0, 0, 0, 1]),
    ]:
        rng, used = scripted_generator(words)
        report = oracle.perturb(np.array([2]), rng)
        assert report.astype(int).tolist() == [bits]
        assert len(used) == 4


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square goodness of fit, the cells expected below 5 pooled into one."""
    small = expected < 5
    observed_cells = [*observed[~small], observed[small].sum()]
    expected_cells = [*expected[~small], expected[small].sum()]
    if expected[small].sum() == 0:
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    return float(stats.chisquare(observed_cells, expected_cells).pvalue)


@pytest.mark.parametrize("generator", ["pcg64", "secure"])
@pytest.mark.parametrize("epsilon", [0.5, 3.0])
@pytest.mark.parametrize(
    "name,subset_size,sampler",
    [
        ("grr", 1, "default"),
        ("oue", 0, "default"),
        ("ss", 1, "table"),
        ("ss", 2, "table"),
        ("ss", 3, "table"),
        ("ss", 2, "floyd"),
    ],
)
def test_perturb_frequencies_match_the_realised_distribution_for_every_value(
    name: str,
    subset_size: int,
    sampler: str,
    epsilon: float,
    generator: str,
    mapping: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 40,000 reports per input value (k = 4) against output_distribution, chi-square at a
    # family-wise 0.001 over the values (cells expected below 5 pooled), with a seeded PCG64
    # and with the keyed AES-CTR generator privacy noise uses, words mapped to reports through
    # the lookup table and through the division; no report outside the support.
    if sampler == "floyd":
        monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    k, n = 4, 40_000
    oracle = FrequencyOracle(name, epsilon, k, subset_size)
    if generator == "secure":
        rng = secure_generator(key=b"frequency-oracle-test-key")
    else:
        rng = np.random.default_rng(2024)
    for value in range(k):
        reports = oracle.perturb(np.full(n, value), rng)
        table = oracle.output_distribution(value)
        observed = np.bincount(report_key(oracle, reports), minlength=1 << k)
        expected = np.zeros(1 << k)
        for key, probability in table.items():
            expected[key[0] if name == "grr" else sum(1 << j for j in key)] = probability * n
        assert observed[expected == 0].sum() == 0
        support = expected > 0
        pvalue = chi_square_pvalue(observed[support], expected[support])
        assert pvalue > FAMILY_ALPHA / k, (value, pvalue)


def report_key(oracle: FrequencyOracle, reports: np.ndarray) -> np.ndarray:
    if oracle.name == "grr":
        return reports.astype(np.int64)
    return reports.astype(np.int64) @ (1 << np.arange(oracle.domain_size))


@pytest.mark.parametrize(
    "name,subset_size,sampler",
    [
        ("grr", 1, "default"),
        ("oue", 0, "default"),
        ("ss", 1, "table"),
        ("ss", 2, "table"),
        ("ss", 1, "floyd"),
        ("ss", 2, "floyd"),
    ],
)
def test_the_sampler_draws_the_enumerated_distribution(
    name: str, subset_size: int, sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chi-square goodness of fit of 60,000 reports of one user value against the exact output
    # distribution the privacy test enumerates; no report outside its support. Subset
    # selection has two samplers (a table of report shapes for small domains, Floyd's
    # algorithm for large ones): both are checked.
    if sampler == "floyd":
        monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    k, value, n = 5, 3, 60_000
    oracle = FrequencyOracle(name, 0.9, k, subset_size)
    reports = oracle.perturb(np.full(n, value), np.random.default_rng(7))
    table = oracle.output_distribution(value)
    if name == "grr":
        codes = {key: key[0] for key in table}
    else:
        codes = {key: sum(1 << j for j in key) for key in table}
    observed = np.bincount(report_key(oracle, reports), minlength=1 << k)
    expected = np.zeros_like(observed, dtype=np.float64)
    for key, probability in table.items():
        expected[codes[key]] = probability * n
    support = expected > 0
    assert observed[~support].sum() == 0
    result = stats.chisquare(observed[support], expected[support])
    assert result.pvalue > FAMILY_ALPHA / 6, result


@pytest.mark.parametrize("sampler", ["table", "floyd"])
def test_a_subset_size_above_half_the_domain_samples_right_too(
    sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sampler == "floyd":
        monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    oracle = FrequencyOracle("ss", 0.5, 5, 3)
    reports = oracle.perturb(np.full(40_000, 0), np.random.default_rng(3))
    assert np.all(reports.sum(axis=1) == 3)
    table = oracle.output_distribution(0)
    observed = np.bincount(report_key(oracle, reports), minlength=32)
    expected = np.zeros(32)
    for key, probability in table.items():
        expected[sum(1 << j for j in key)] = probability * 40_000
    assert stats.chisquare(observed[expected > 0], expected[expected > 0]).pvalue > 1e-3


# ---- unbiasedness and the covariance formula ---------------------------------------------


def monte_carlo_estimates(
    oracle: FrequencyOracle, counts: np.ndarray, repetitions: int, seed: int
) -> np.ndarray:
    """(repetitions, k) count estimates, each from a fresh perturbation of the same users."""
    k, n = oracle.domain_size, int(counts.sum())
    users = np.repeat(np.arange(k), counts)
    reports = oracle.perturb(np.tile(users, repetitions), np.random.default_rng(seed))
    if oracle.name == "grr":
        run = np.repeat(np.arange(repetitions), n)
        support = np.bincount(run * k + reports, minlength=repetitions * k).reshape(-1, k)
    else:
        support = reports.reshape(repetitions, n, k).sum(axis=1)
    return np.stack([oracle.estimate(row, n).counts for row in support])


@pytest.mark.parametrize(
    "oracle",
    [
        FrequencyOracle("grr", 1.0, 6, 1),
        FrequencyOracle("oue", 1.0, 6, 0),
        FrequencyOracle("ss", 1.0, 6, 2),
        FrequencyOracle("ss", 0.4, 6, 4),
    ],
    ids=repr,
)
def test_the_estimator_is_unbiased_and_its_covariance_formula_is_exact(
    oracle: FrequencyOracle,
) -> None:
    counts = np.array([400, 250, 150, 100, 60, 40])
    repetitions = 2000
    estimates = monte_carlo_estimates(oracle, counts, repetitions, seed=11)
    sigma = oracle.covariance(counts)
    # Linear statistics checked: every count, a pair sum (tests one covariance) and a fixed
    # +-1 contrast (tests all of them at once).
    contrast = np.array([1, -1, 1, -1, 1, -1], dtype=np.float64)
    weights = np.vstack([np.eye(6), [1, 1, 0, 0, 0, 0], contrast])
    truths = weights @ counts
    variances = np.einsum("ij,jk,ik->i", weights, sigma, weights)
    values = estimates @ weights.T
    checks = weights.shape[0]
    # Unbiased: the Monte Carlo mean is within z standard errors sqrt(Var / R) of the truth,
    # z at a family-wise level of 0.001 over the statistics.
    z = stats.norm.ppf(1 - FAMILY_ALPHA / (2 * checks))
    mean_z = (values.mean(axis=0) - truths) / np.sqrt(variances / repetitions)
    assert np.all(np.abs(mean_z) < z), mean_z
    # Variance: each estimate is a sum of n independent bounded terms (n = 1000), close to
    # normal, so (R - 1) s^2 / sigma^2 is close to chi-square with R - 1 degrees of freedom
    # (the excess kurtosis, O(1/n), widens the spread by under 1 %); two-sided quantiles at the
    # same family-wise level.
    ratio = values.var(axis=0, ddof=1) / variances
    low = stats.chi2.ppf(FAMILY_ALPHA / (2 * checks), repetitions - 1) / (repetitions - 1)
    high = stats.chi2.ppf(1 - FAMILY_ALPHA / (2 * checks), repetitions - 1) / (repetitions - 1)
    assert np.all((ratio > low) & (ratio < high)), (ratio, low, high)


def test_a_wrong_variance_would_be_caught() -> None:
    # Power check of the variance test above: GRR's variance without its (n - c_j) q (1 - q)
    # term is rejected by the same chi-square band.
    oracle = FrequencyOracle("grr", 1.0, 6, 1)
    counts = np.array([400, 250, 150, 100, 60, 40])
    estimates = monte_carlo_estimates(oracle, counts, 2000, seed=12)
    p, q = oracle.support_probability, oracle.other_support_probability
    wrong = counts * p * (1 - p) / (p - q) ** 2
    ratio = estimates.var(axis=0, ddof=1) / wrong
    high = stats.chi2.ppf(1 - FAMILY_ALPHA / 12, 1999) / 1999
    assert np.any(ratio > high)


def test_total_variance_is_the_trace_of_the_covariance_for_any_counts() -> None:
    rng = np.random.default_rng(0)
    for oracle in all_oracles(1.3, 7):
        counts = rng.multinomial(500, rng.dirichlet(np.ones(7)))
        assert math.isclose(
            np.trace(oracle.covariance(counts)), oracle.total_variance(500), rel_tol=1e-12
        )


def test_the_plug_in_covariance_is_the_formula_at_the_estimate() -> None:
    oracle = frequency_oracle("oue", 1.0, 5)
    estimate = oracle.estimate(np.array([300, 200, 210, 190, 180]), 1000)
    np.testing.assert_allclose(estimate.covariance, oracle.covariance(estimate.counts))
    np.testing.assert_allclose(estimate.frequencies, estimate.counts / 1000)


# ---- the chooser ---------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.2, 0.7, 1.0, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("k", [2, 3, 5, 8, 10, 20, 64, 200])
def test_best_picks_the_smallest_variance(epsilon: float, k: int) -> None:
    best = frequency_oracle("best", epsilon, k, num_users=10_000)
    candidates = all_oracles(epsilon, k)
    smallest = min(o.total_variance(10_000) for o in candidates)
    assert best.total_variance(10_000) <= smallest * (1 + 1e-12)
    # GRR beats OUE when k < 3 e^eps + 2 (Wang et al. 2017, from the variance at small
    # frequencies; the exact trace moves the crossing slightly, so not within 1 of it).
    grr, oue = candidates[0], candidates[1]
    boundary = 3 * math.exp(epsilon) + 2
    if abs(k - boundary) > 1:
        assert (grr.total_variance(1) < oue.total_variance(1)) == (k < boundary)


def test_best_subset_size_is_near_k_over_e_to_the_epsilon_plus_one() -> None:
    for epsilon, k in [(0.5, 100), (1.0, 100), (2.0, 200)]:
        omega = frequency_oracle("ss", epsilon, k).subset_size
        assert abs(omega - k / (math.exp(epsilon) + 1)) <= 1.0


# ---- counting path, validation ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["grr", "oue", "ss"])
def test_perturb_and_count_counts_the_reports_perturb_draws(name: str) -> None:
    oracle = frequency_oracle(name, 1.0, 12)
    values = np.random.default_rng(1).integers(0, 12, CHUNK - 5)
    counted = oracle.perturb_and_count(values, np.random.default_rng(2))
    reports = oracle.perturb(values, np.random.default_rng(2))
    np.testing.assert_array_equal(counted, oracle.support_counts(reports))


def test_floyds_counting_path_counts_omega_categories_per_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Floyd's path draws in a different order from perturb's, so only the total is exact.
    monkeypatch.setattr(frequency_oracle_module, "MAX_SUBSET_TABLE", 0)
    oracle = frequency_oracle("ss", 1.0, 12)
    values = np.random.default_rng(1).integers(0, 12, 2 * CHUNK + 5)
    counted = oracle.perturb_and_count(values, np.random.default_rng(2))
    assert counted.sum() == oracle.subset_size * values.shape[0]


@pytest.mark.parametrize(
    "k,omega,dtype", [(8, 1, np.int16), (12, 2, np.uint8), (16, 4, np.int64), (20, 5, np.int64)]
)
def test_subset_counting_matches_its_reports_across_chunks(
    k: int, omega: int, dtype: type, mapping: str
) -> None:
    # Several counting chunks (straddling buckets in each): the counts of the pairs (value,
    # shape), kept in int16 where k x shapes fits (k = 8, 12, 16; from uint8 values too, whose
    # x S would overflow a byte) and in int64 where not (k = 20, omega = 5: 15,505 shapes),
    # fold to the support counts of perturb's reports; k = 16, omega = 4 (1,821 shapes) with
    # the uint16 lookup table, k = 20 with the division only.
    oracle = FrequencyOracle("ss", 1.0, k, omega)
    size = 3 * frequency_oracle_module.COUNT_CHUNK + 17
    values = np.random.default_rng(6).integers(0, k, size).astype(dtype)
    counted = oracle.perturb_and_count(values, np.random.default_rng(7))
    reports = oracle.perturb(values, np.random.default_rng(7))
    np.testing.assert_array_equal(counted, oracle.support_counts(reports))
    assert counted.sum() == omega * size


def test_grr_counting_matches_its_reports_across_chunks() -> None:
    oracle = frequency_oracle("grr", 0.5, 9)
    values = np.random.default_rng(4).integers(0, 9, 3 * (1 << 20) + 17).astype(np.int16)
    counted = oracle.perturb_and_count(values, np.random.default_rng(5))
    reports = oracle.perturb(values, np.random.default_rng(5))
    np.testing.assert_array_equal(counted, oracle.support_counts(reports))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: frequency_oracle("grr", 0.0, 8), "epsilon must be a finite number > 0"),
        (lambda: frequency_oracle("grr", 1.0, 1), r"domain_size must be an integer in \[2,"),
        (lambda: frequency_oracle("rappor", 1.0, 8), "oracle must be one of"),
        (lambda: frequency_oracle("best", 1.0, 8, num_users=0), "num_users must be an integer"),
        (lambda: FrequencyOracle("ss", 1.0, 8, 8), r"subset_size must be an integer in \[1, 7\]"),
        (lambda: frequency_oracle("grr", 1e-20, 4), "below the resolution of the 64-bit sampler"),
        (lambda: frequency_oracle("oue", 1e-20, 4), "below the resolution of the 64-bit sampler"),
        (
            lambda: frequency_oracle("oue", 1.0, 4).perturb(
                np.array([0, 4]), np.random.default_rng()
            ),
            r"values must be in \[0, 3\]",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).perturb(np.array([0, 1]), np.random),
            "rng must be a numpy.random.Generator",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).estimate(np.array([1, 2, 3]), 6),
            r"support_counts must have one entry per category \(4\)",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).estimate(np.array([1, 2, 3, 9]), 6),
            r"support_counts must be counts in \[0, num_users=6\]",
        ),
        (
            lambda: frequency_oracle("grr", 1.0, 4).covariance(np.ones(3)),
            "true_counts must have one entry per category",
        ),
    ],
)
def test_bad_input_is_refused_with_the_parameter_and_its_range(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
