"""Privacy ledgers (sequential composition, refusal) and the streaming mechanism path."""

from __future__ import annotations

import io
import math
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedparity.mechanisms import (
    LaplaceMechanism,
    PrivacyBudgetExceeded,
    PrivacyLedger,
    RandomizedResponseMechanism,
    ReportSummary,
    ShardLedger,
    estimate_gap,
    summarize_stream,
)
from fedparity.mechanisms.privacy.basic_ledger import LedgerFileError

# --- PrivacyLedger --------------------------------------------------------------------------------


def test_ledger_refuses_past_the_budget_and_records_nothing() -> None:
    ledger = PrivacyLedger(1.0)
    ledger.spend(0.4, "audit 1")
    ledger.spend(0.4, "audit 2")
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.spend(0.4, "audit 3")
    assert ledger.spent == pytest.approx(0.8)
    assert [entry.label for entry in ledger.history] == ["audit 1", "audit 2"]
    assert ledger.remaining == pytest.approx(0.2)
    assert not ledger.can_spend(0.21)
    assert ledger.can_spend(0.2)
    ledger.spend(0.2, "audit 4")  # exactly to the budget
    assert ledger.remaining == 0.0
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.spend(1e-6)
    assert len(ledger.history) == 3


def test_ledger_float_sums_are_accepted() -> None:
    # 0.1 + 0.2 = 0.30000000000000004 > 0.3 in floating point, but it is the budget.
    assert 0.1 + 0.2 > 0.3
    ledger = PrivacyLedger(0.3)
    ledger.spend(0.1)
    ledger.spend(0.2)
    assert len(ledger.history) == 2
    # ... while a real excess, however small compared with the budget, is refused.
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.spend(1e-6)
    ten = PrivacyLedger(1.0)
    for _ in range(10):
        ten.spend(0.1)  # sums to 0.9999999999999999
    with pytest.raises(PrivacyBudgetExceeded):
        ten.spend(0.01)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_ledger_rejects_bad_epsilons(bad: float) -> None:
    ledger = PrivacyLedger(1.0)
    with pytest.raises(ValueError, match="epsilon"):
        ledger.spend(bad)
    assert ledger.spent == 0.0 and ledger.history == []
    with pytest.raises(ValueError, match="budget"):
        PrivacyLedger(bad)
    with pytest.raises(ValueError, match="budget"):
        ShardLedger(bad, 3)


# --- ShardLedger ----------------------------------------------------------------------------------


def test_shard_ledger_charges_only_those_who_answer() -> None:
    shard = ShardLedger(1.0, 5)
    answered = shard.spend(0.6, np.array([True, True, False, False, True]))
    np.testing.assert_array_equal(answered, [True, True, False, False, True])
    np.testing.assert_allclose(shard.spent, [0.6, 0.6, 0.0, 0.0, 0.6])
    # Everyone asked: users 0, 1, 4 cannot afford 0.6 more and refuse; 2 and 3 answer.
    answered = shard.spend(0.6)
    np.testing.assert_array_equal(answered, [False, False, True, True, False])
    np.testing.assert_allclose(shard.spent, [0.6, 0.6, 0.6, 0.6, 0.6])
    # 0.4 fits everyone exactly (0.6 + 0.4 = 1.0); nobody can pay afterwards.
    assert shard.spend(0.4).all()
    assert not shard.spend(1e-6).any()
    np.testing.assert_allclose(shard.spent, 1.0)


def test_shard_ledger_rejects_or_handles_integer_users() -> None:
    shard = ShardLedger(1.0, 3)
    try:
        answered = shard.spend(0.5, np.array([0, 2, 1]))  # indices of all three users
    except ValueError as error:
        assert "users" in str(error)
        np.testing.assert_array_equal(shard.spent, 0.0)  # nothing charged on refusal
        return
    assert answered.dtype == np.bool_
    np.testing.assert_allclose(shard.spent, 0.5 * answered)
    assert answered.all()  # every listed user could afford it


def test_shard_ledger_wrong_length_mask_names_users() -> None:
    shard = ShardLedger(1.0, 3)
    with pytest.raises(ValueError, match="users"):
        shard.spend(0.5, np.array([True, False]))


def test_shard_ledger_float_sums() -> None:
    shard = ShardLedger(0.3, 2)
    shard.spend(0.1)
    assert shard.spend(0.2).all()


def test_shard_ledger_round_trip_keeps_spending(tmp_path: Path) -> None:
    path = tmp_path / "ledger.npz"
    shard = ShardLedger.load_or_create(path, 2.0, 4)  # new
    np.testing.assert_array_equal(shard.spent, 0.0)
    shard.spend(1.5, np.array([True, False, True, False]))
    shard.save(path)
    loaded = ShardLedger.load_or_create(path, 2.0, 4)
    np.testing.assert_allclose(loaded.spent, [1.5, 0.0, 1.5, 0.0])
    np.testing.assert_array_equal(loaded.spend(1.0), [False, True, False, True])
    # A lowered budget applies to what was already spent.
    lowered = ShardLedger.load_or_create(path, 1.0, 4)
    np.testing.assert_array_equal(lowered.spend(0.5), [False, True, False, True])
    with pytest.raises(LedgerFileError, match="holds 4 users' spending, this node has 5"):
        ShardLedger.load_or_create(path, 2.0, 5)


def test_a_saved_budget_is_only_ever_lowered(tmp_path: Path) -> None:
    # The attack (security review C1): a server raised user-budget to re-enable spent users.
    path = tmp_path / "ledger.npz"
    ledger = ShardLedger.load_or_create(path, 1.0, 3)
    np.testing.assert_array_equal(ledger.spend(1.0), True)
    ledger.save(path)
    raised = ShardLedger.load_or_create(path, 1e9, 3)
    assert raised.budget == 1.0
    np.testing.assert_array_equal(raised.spend(0.5), False)
    lowered = ShardLedger.load_or_create(path, 0.5, 3)
    lowered.save(path)
    assert ShardLedger.load_or_create(path, 10.0, 3).budget == 0.5


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot be read"),
        (lambda p: p.write_bytes(b"garbage" * 10), "cannot be read"),
        (lambda p: np.savez(p, budget=1.0, spent=np.zeros(3)), "not a fedparity LDP ledger"),
        (
            lambda p: np.savez(
                p, format="fedparity-ldp-ledger", version=1, budget=1.0, spent=-np.ones(3)
            ),
            "not finite and >= 0",
        ),
    ],
)
def test_a_damaged_or_foreign_ledger_stops_the_node_and_is_never_reset(
    tmp_path: Path, damage, message: str
) -> None:
    path = tmp_path / "ledger.npz"
    ledger = ShardLedger.load_or_create(path, 2.0, 3)
    ledger.spend(1.0)
    ledger.save(path)
    damage(path)
    before = path.read_bytes()
    with pytest.raises(LedgerFileError, match=message) as raised:
        ShardLedger.load_or_create(path, 2.0, 3)
    assert str(path) in str(raised.value) and "restore it from a backup" in str(raised.value)
    assert path.read_bytes() == before  # nothing was rewritten


def test_save_replaces_the_file_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash in the middle of writing (simulated: the writer stops half way) leaves the
    # previous ledger intact and no temporary file behind. Written in place, the file would
    # be torn and the node locked out.
    path = tmp_path / "ledger.npz"
    ledger = ShardLedger.load_or_create(path, 2.0, 3)
    ledger.spend(1.0)
    ledger.save(path)
    ledger.spend(0.5)
    write = np.savez

    def crash_half_way(file, **arrays) -> None:  # noqa: ANN001
        buffer = io.BytesIO()
        write(buffer, **arrays)
        data = buffer.getvalue()
        if hasattr(file, "write"):
            file.write(data[: len(data) // 2])
        else:
            Path(file).write_bytes(data[: len(data) // 2])
        raise OSError("simulated crash while writing")

    monkeypatch.setattr("fedparity.mechanisms.privacy.basic_ledger.np.savez", crash_half_way)
    with pytest.raises(OSError, match="simulated crash"):
        ledger.save(path)
    monkeypatch.undo()
    np.testing.assert_array_equal(ShardLedger.load_or_create(path, 2.0, 3).spent, 1.0)
    # no temporary file left: the ledger and the marker that says it exists
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.npz", "ledger.npz.created"]


# --- summarize_stream ---------------------------------------------------------------------------


def reference_variance(
    mechanism: RandomizedResponseMechanism | LaplaceMechanism,
    num_clients: int,
    sizes: np.ndarray,
    squares: np.ndarray,
) -> np.ndarray:
    """Var(m_hat_G), v units, known sizes: Eq. 20 (M_R) / Eq. 19 (M_L), d-group forms.

    a = e^eps1/(e^eps1 + d - 1), q = (1 - a)/(d - 1), c = 2b - 1, nu^2 = squares / n.
    M_R: 1/(a c^2 n) (1 - a c^2 nu^2 + (K - n)/n q/a).
    M_L: (1/n) ((1-a)/a nu^2 + s2/a + (K - n)/n q/a^2 s2), s2 = 8/eps2^2.
    """
    d = sizes.shape[0]
    e1 = math.exp(mechanism.epsilon_group)
    a, q = e1 / (e1 + d - 1), 1.0 / (e1 + d - 1)
    nu2 = squares / sizes
    outsiders = (num_clients - sizes) / sizes
    if isinstance(mechanism, RandomizedResponseMechanism):
        c2 = (2.0 / (1.0 + math.exp(-mechanism.epsilon_value)) - 1.0) ** 2
        return 1.0 / (a * c2 * sizes) * (1.0 - a * c2 * nu2 + outsiders * q / a)
    s2 = 8.0 / mechanism.epsilon_value**2
    return (1.0 / sizes) * ((1 - a) / a * nu2 + s2 / a + outsiders * q / a**2 * s2)


def uneven_chunks(
    groups: np.ndarray, values: np.ndarray, sizes: list[int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    start = 0
    for size in sizes:
        yield groups[start : start + size], values[start : start + size]
        start += size
    assert start == groups.shape[0]


STREAM_MECHANISMS = [
    RandomizedResponseMechanism(1.0, 2.0, 2),
    LaplaceMechanism(0.5, 1.0, 2),
    RandomizedResponseMechanism(1.0, 2.0, 3),
    LaplaceMechanism(0.5, 1.0, 3),
]


@pytest.mark.parametrize("mechanism", STREAM_MECHANISMS, ids=["R2", "L2", "R3", "L3"])
def test_stream_estimates_within_4_5_se(
    mechanism: RandomizedResponseMechanism | LaplaceMechanism,
) -> None:
    rng = np.random.default_rng(11 + mechanism.num_groups)
    d, total = mechanism.num_groups, 300_000
    shares = np.array([0.5, 0.3, 0.2])[:d]
    groups = rng.choice(d, size=total, p=shares / shares.sum())
    values = 2.0 * rng.beta(2.0 + 3.0 * groups, 2.0) - 1.0
    chunk_sizes = [1, 99_999, 7, 65_536, 65_537, 1_000, 67_920]
    summary = summarize_stream(
        mechanism, uneven_chunks(groups, values, chunk_sizes), np.random.default_rng(5)
    )
    assert summary.num_reports == total
    assert int(summary.report_counts.sum()) == total
    sizes = np.bincount(groups, minlength=d).astype(np.float64)
    sums = np.bincount(groups, weights=values, minlength=d)
    squares = np.bincount(groups, weights=values**2, minlength=d)
    estimate = estimate_gap(summary, mechanism, group_sizes=sizes.astype(int).tolist())
    se_metric = np.sqrt(reference_variance(mechanism, total, sizes, squares)) / 2.0
    truth = (sums / sizes + 1.0) / 2.0
    # One draw of an (approximately normal) unbiased estimate: within 4.5 SE.
    assert np.all(np.abs(estimate.group_means - truth) <= 4.5 * se_metric)


@pytest.mark.parametrize("mechanism", STREAM_MECHANISMS, ids=["R2", "L2", "R3", "L3"])
def test_stream_is_the_sum_of_block_summaries(
    mechanism: RandomizedResponseMechanism | LaplaceMechanism,
) -> None:
    # The stream's summary is the merge of per-block summaries drawn in sequence from the
    # same generator: blocks of block_size inside each chunk.
    data = np.random.default_rng(3)
    d, total, block = mechanism.num_groups, 10_000, 1_000
    groups = data.integers(0, d, total)
    values = data.uniform(-1.0, 1.0, total)
    chunk_sizes = [2_500, 10, 4_990, 2_500]
    streamed = summarize_stream(
        mechanism,
        uneven_chunks(groups, values, chunk_sizes),
        np.random.default_rng(8),
        block_size=block,
    )
    rng = np.random.default_rng(8)
    expected = ReportSummary.empty(d)
    start = 0
    for size in chunk_sizes:
        for offset in range(0, size, block):
            stop = start + min(offset + block, size)
            reports = mechanism.perturb(
                groups[start + offset : stop], values[start + offset : stop], rng
            )
            expected = expected.merge(ReportSummary.from_reports(reports.groups, reports.values, d))
        start += size
    assert streamed.num_reports == expected.num_reports == total
    np.testing.assert_array_equal(streamed.report_counts, expected.report_counts)
    np.testing.assert_allclose(streamed.value_sums, expected.value_sums, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        streamed.value_square_sums, expected.value_square_sums, rtol=1e-9, atol=1e-9
    )


def test_invalid_chunk_in_the_middle_raises() -> None:
    mechanism = LaplaceMechanism(1.0, 1.0, 2)
    good = (np.zeros(10, dtype=np.int64), np.zeros(10))
    for bad, name in (
        ((np.array([0, 2, 1]), np.zeros(3)), "groups"),
        ((np.array([0, -1, 1]), np.zeros(3)), "groups"),
        ((np.array([0, 1, 1]), np.array([0.0, 1.2, 0.0])), "values"),
        ((np.array([0, 1, 1]), np.array([0.0, math.nan, 0.0])), "values"),
        ((np.array([0, 1, 1]), np.zeros(2)), "length"),
    ):
        consumed: list[int] = []

        def chunks(
            bad: tuple[np.ndarray, np.ndarray] = bad, consumed: list[int] = consumed
        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for index, chunk in enumerate((good, good, bad, good)):
                consumed.append(index)
                yield chunk

        with pytest.raises(ValueError, match=name):
            summarize_stream(mechanism, chunks(), np.random.default_rng(0))
        assert consumed == [0, 1, 2]  # stops at the bad chunk
    with pytest.raises(ValueError, match="block_size"):
        summarize_stream(mechanism, iter([good]), np.random.default_rng(0), block_size=0)


def test_stream_memory_is_bounded() -> None:
    mechanism = LaplaceMechanism(1.0, 2.0, 2)  # float64 reports: the heavier mechanism
    total, chunk = 5_000_000, 100_000

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        data = np.random.default_rng(21)
        for _ in range(total // chunk):
            groups = (data.random(chunk) < 0.4).astype(np.int64)
            yield groups, np.where(groups == 1, 0.5, -0.2)

    megabyte = 1 << 20
    tracemalloc.start()
    try:
        # The measuring tool sees numpy buffers: a whole-array float64 for 5M clients alone
        # is 40 MB (groups + values + reports would be 80 MB and more).
        whole = np.ones(total)
        _, whole_peak = tracemalloc.get_traced_memory()
        del whole
        tracemalloc.reset_peak()
        summary = summarize_stream(mechanism, chunks(), np.random.default_rng(4))
        _, stream_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert whole_peak >= 38 * megabyte
    assert stream_peak < 60 * megabyte
    assert summary.num_reports == total
    # The result is still a correct summary: means within 4.5 SE of the truth.
    true_groups = np.concatenate([g for g, _ in chunks()])
    sizes = np.bincount(true_groups, minlength=2).astype(np.float64)
    estimate = estimate_gap(summary, mechanism, group_sizes=sizes.astype(int).tolist())
    true_v = np.array([-0.2, 0.5])
    se = np.sqrt(reference_variance(mechanism, total, sizes, sizes * true_v**2)) / 2.0
    assert np.all(np.abs(estimate.group_means - (true_v + 1.0) / 2.0) <= 4.5 * se)
