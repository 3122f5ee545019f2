"""FedEvalFair for any rate metric and d >= 2 groups: the run's layout
(:class:`fedparity.mechanisms.protocol.FedEvalFairLayout`), end to end over real TenSEAL
ciphertexts with the real handlers and the server's protocol (an in-process grid), and the
split view on the layout that the commitment stops.
"""

from __future__ import annotations

import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict

from fedparity.clients import HolderRows, fedevalfair_handlers
from fedparity.clients.fedevalfair import rows_statistics
from fedparity.clients.identity import NodeIdentity
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.clients.project.config import ConfigError, RunConfig
from fedparity.mechanisms.crypto.ckks import HolderDP, KeyPaths, load_public_context
from fedparity.mechanisms.crypto.ckks.holder_dp import SENSITIVITY, noise_std
from fedparity.mechanisms.crypto.identity import IdentityKey, Roster
from fedparity.mechanisms.fairness_tests.fedevalfair import METRICS, fedevalfair
from fedparity.mechanisms.privacy.user_ledger import UserLedger
from fedparity.mechanisms.protocol import (
    BLOCKS,
    DEFAULT_LAYOUT,
    MAX_VECTOR_SIZE,
    RELEASE_SIZE,
    ROUND1_SIZE,
    ROUND2_SIZE,
    FedEvalFairLayout,
)
from fedparity.strategies.fedevalfair import FedEvalFairProtocol
from tests.support.handler_grid import HandlerGrid

pytestmark = pytest.mark.usefixtures("task_identity")

RUN_ID = 11
NAMES = ("a", "b", "c", "d")
#: Three groups whose selection rates and precisions differ, so every comparison has its own
#: disparity (a block read at the wrong place would not match its plaintext test).
THREE_GROUPS = FedEvalFairLayout(("dp", "precision"), num_groups=3)


# --- the layout ---------------------------------------------------------------------------------


def test_the_default_layout_is_the_protocol_before_layouts() -> None:
    assert (
        [(b.metric, b.mode) for b in DEFAULT_LAYOUT.blocks]
        == list(BLOCKS)
        == [
            ("dp", "calibrated"),
            ("dp", "paper"),
            ("eo", "calibrated"),
            ("eo", "paper"),
        ]
    )
    assert (DEFAULT_LAYOUT.round1_size, DEFAULT_LAYOUT.round2_size) == (53, 1253)
    assert (ROUND1_SIZE, ROUND2_SIZE, RELEASE_SIZE) == (53, 1253, DEFAULT_LAYOUT.release_size)
    assert DEFAULT_LAYOUT.terms() == b""  # its commitments are those of the old protocol
    assert HolderDP(1.0, 1e-8).sensitivity == pytest.approx(SENSITIVITY)


def test_blocks_are_metric_then_comparison_then_mode() -> None:
    layout = FedEvalFairLayout(("fpr", "accuracy"), num_groups=3, reference=1)
    assert layout.comparisons == ((1, 0), (1, 2))
    assert [(b.metric, b.comparison, b.mode) for b in layout.blocks] == [
        (metric, comparison, mode)
        for metric in ("fpr", "accuracy")
        for comparison in ((1, 0), (1, 2))
        for mode in ("calibrated", "paper")
    ]
    assert layout.dp_blocks == (0, 2, 4, 6)
    assert layout.round2_size == 2 * DEFAULT_LAYOUT.round2_size - 1
    assert "group 1 vs group 2" in layout.blocks[2].label
    assert "vs" not in DEFAULT_LAYOUT.blocks[0].label  # 0 vs 1: as before


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"metrics": ("dp", "tpr")}, "fef-metrics must name one or more of dp, eo"),
        ({"metrics": ()}, "fef-metrics must name"),
        ({"metrics": ("dp", "dp")}, "names a metric twice"),
        ({"num_groups": 1}, "fef-num-groups"),
        ({"num_groups": 3, "reference": 3}, r"fef-reference-group must be in \[0, 2\]"),
        ({"metrics": ("dp", "eo"), "num_groups": 5}, "at most 6 per run"),
    ],
)
def test_a_bad_layout_is_refused_naming_the_key(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedEvalFairLayout(**arguments)


def test_the_largest_layout_fits_one_ciphertext() -> None:
    most = FedEvalFairLayout(tuple(METRICS[:6]), num_groups=2)
    assert most.round2_size <= MAX_VECTOR_SIZE
    assert FedEvalFairLayout(("dp", "eo", "fpr"), num_groups=3).round2_size <= MAX_VECTOR_SIZE


def test_layouts_of_equal_size_have_different_terms() -> None:
    """The commitment tells apart what the vector sizes cannot."""
    one, other = FedEvalFairLayout(("dp", "eo")), FedEvalFairLayout(("fpr", "accuracy"))
    assert one.round2_size == other.round2_size
    assert one.terms() != other.terms()
    assert FedEvalFairLayout(("dp",), 3, 0).terms() != FedEvalFairLayout(("dp",), 3, 1).terms()


def test_the_dp_mode_noise_covers_every_released_block() -> None:
    """Each calibrated block can move by 2 in L2 when one holder is replaced, so b blocks by
    2 sqrt(b); the analytic Gaussian's sigma grows with the sensitivity."""
    layout = FedEvalFairLayout(("dp", "eo", "fpr"), num_groups=2)
    dp = HolderDP.for_layout(1.0, 1e-8, 100.0, layout)
    assert dp.num_blocks == 3
    assert dp.sensitivity == pytest.approx(2 * math.sqrt(3))
    assert dp.noise_std == pytest.approx(HolderDP(1.0, 1e-8).noise_std * math.sqrt(3 / 2), 1e-6)
    assert dp.terms() != HolderDP(1.0, 1e-8).terms()


# --- end to end over real ciphertexts -----------------------------------------------------------


def holder_rows(node_id: int, num_groups: int = 3) -> HolderRows:
    """Holder ``node_id``'s 900 rows over 3 groups (or the first ``num_groups``): selection
    rates 0.30, 0.36, 0.60 and labels that depend on the prediction differently per group (so
    the precisions differ too)."""
    rng = np.random.default_rng(500 + node_id)
    groups = np.arange(900) % num_groups
    predictions = (rng.random(900) < np.array([0.30, 0.36, 0.60])[groups]).astype(int)
    precision = np.array([0.7, 0.6, 0.45])[groups]
    labels = np.where(predictions == 1, rng.random(900) < precision, rng.random(900) < 0.2)
    return HolderRows(
        labels=labels.astype(int),
        predictions=predictions,
        groups=groups,
        user_ids=10_000 * node_id + np.arange(900),
    )


def bootstrap_rng(context: Context) -> np.random.Generator:
    return np.random.default_rng(context.node_id)


def holder_grid(
    keys: KeyPaths,
    layouts: dict[str, FedEvalFairLayout],
    ledgers: Path,
    dp: HolderDP | None = None,
) -> HandlerGrid:
    """Nodes 1..4 as holders a..d with their real handlers, each with its own layout."""
    identities = {name: IdentityKey.generate() for name in NAMES}
    roster = Roster.from_keys(identities)
    handlers = {
        index + 1: fedevalfair_handlers(
            lambda arrays, context, d=layouts[name].num_groups: holder_rows(context.node_id, d),
            secret_context=keys.secret,
            num_resamples=40,
            bootstrap_rng=bootstrap_rng,
            policy=NodePrivacyPolicy(),
            identity=lambda context, name=name: NodeIdentity(identities[name], roster),
            layout=layouts[name],
            dp=dp,
        )
        for index, name in enumerate(NAMES)
    }
    contexts = {
        index + 1: Context(
            run_id=RUN_ID,
            node_id=index + 1,
            node_config={"ledger-dir": str(ledgers / name)},
            state=RecordDict(),
            run_config={},
        )
        for index, name in enumerate(NAMES)
    }
    return HandlerGrid(lambda node, action: handlers[node][action], contexts, run_id=RUN_ID)


def run(  # noqa: ANN201
    keys: KeyPaths,
    server: FedEvalFairLayout,
    holders: dict[str, FedEvalFairLayout],
    tmp: Path,
    dp: HolderDP | None = None,
):
    """The server's protocol with ``server``'s layout over holders with their own layouts."""
    protocol = FedEvalFairProtocol(
        load_public_context(keys.public), timeout=5.0, layout=server, dp=dp
    )
    grid = holder_grid(keys, holders, tmp, dp)
    return protocol.start(grid, ArrayRecord(), [1, 2, 3, 4])  # type: ignore[arg-type]


def test_three_groups_and_two_metrics_match_the_plaintext_test(
    ckks_keys: KeyPaths, tmp_path: Path
) -> None:
    """Every (metric, comparison, mode) block of the encrypted run equals FedEvalFair computed
    in plaintext from the holders' own statistics (same seeds). The released sums carry the
    key holders' flooding noise (relative size about 1e-5 on a sum in CI, module
    ``fedparity.mechanisms.crypto.ckks.flooding``): estimates agree to 1e-4, p-values to
    1e-3, far below the differences between the blocks (dp 0 vs 1 is about -0.06, 0 vs 2
    about -0.30)."""
    outcome = run(ckks_keys, THREE_GROUPS, dict.fromkeys(NAMES, THREE_GROUPS), tmp_path)
    assert outcome.error is None and not outcome.rejected, outcome.summary()
    assert len(outcome.blocks) == len(THREE_GROUPS.blocks) == 8
    statistics = [
        rows_statistics(
            *(lambda r: (r.labels, r.predictions, r.groups))(holder_rows(node)),
            num_resamples=40,
            rng=np.random.default_rng(node),
            min_cell_count=5,
            layout=THREE_GROUPS,
        )
        for node in (1, 2, 3, 4)
    ]
    estimates = {}
    for index, block in enumerate(THREE_GROUPS.blocks):
        result = outcome.block(block.metric, block.mode, block.comparison)
        assert result.report is not None, result.summary()
        plain = fedevalfair([s.summaries[index] for s in statistics], mode=block.mode)
        assert result.report.estimate == pytest.approx(plain.estimate, abs=1e-4)
        assert result.report.homogeneity.pvalue == pytest.approx(plain.homogeneity.pvalue, abs=1e-3)
        assert result.report.common_disparity.pvalue == pytest.approx(
            plain.common_disparity.pvalue, abs=1e-3
        )
        if block.mode == "calibrated":  # signed (the paper mode's disparities are |.|)
            estimates[(block.metric, block.comparison)] = result.report.estimate
    assert estimates[("dp", (0, 2))] < estimates[("dp", (0, 1))] - 0.15
    assert estimates[("precision", (0, 2))] > estimates[("precision", (0, 1))] + 0.05
    assert "group 0 vs group 2" in outcome.summary()
    # one name for the tests on the object and in its dictionary (results.json)
    assert outcome.tests is outcome.blocks
    assert [
        (t["metric"], t["mode"], tuple(t["comparison"])) for t in outcome.to_dict()["tests"]
    ] == [(b.metric, b.mode, b.comparison) for b in outcome.tests]


def test_a_split_view_on_the_layout_is_stopped_at_the_commitment(
    ckks_keys: KeyPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server tells holder d to test other metrics with vectors of the same size: the
    sums still add up, so without the layout in the commitment a key holder would release
    a mixture whose blocks mean different things at different holders (shown first, with the
    binding switched off); with it, d's commitment does not verify and nothing is
    released."""
    same = FedEvalFairLayout(("dp", "eo"))
    other = FedEvalFairLayout(("fpr", "accuracy"))
    assert same.round2_size == other.round2_size
    split = {**dict.fromkeys(NAMES[:3], same), "d": other}
    with monkeypatch.context() as patch:
        patch.setattr(FedEvalFairLayout, "terms", lambda self: b"")
        unbound = run(ckks_keys, same, split, tmp_path / "unbound")
    assert unbound.error is None and len(unbound.released) == same.release_size
    bound = run(ckks_keys, same, split, tmp_path / "bound")
    assert bound.error is not None and "did not commit" in bound.error, bound.error
    assert not bound.released


def test_the_dp_mode_releases_every_calibrated_block_of_the_layout_with_its_noise(
    ckks_keys: KeyPaths, tmp_path: Path
) -> None:
    """Holder-level DP with three groups and two metrics: the four calibrated blocks are
    released, with the noise of sensitivity 2 sqrt(4) = 4 on both ends (HolderDP.num_blocks set
    from the layout, whatever the caller passed), the paper blocks are not, and every holder
    charged its users the release's epsilon once. (Had a holder kept num_blocks = 2, its
    commitment would bind other terms and nothing would be released.)"""
    dp = HolderDP(1.0, 1e-8)  # num_blocks 2: the holders' and the server's own layouts set it
    outcome = run(ckks_keys, THREE_GROUPS, dict.fromkeys(NAMES, THREE_GROUPS), tmp_path, dp)
    assert outcome.error is None, outcome.summary()
    assert outcome.holder_dp is not None
    assert outcome.holder_dp["released_blocks"] == 4
    assert outcome.holder_dp["sensitivity"] == pytest.approx(4.0)
    expected = HolderDP.for_layout(1.0, 1e-8, 100.0, THREE_GROUPS).noise_std
    assert outcome.holder_dp["noise_std"] == pytest.approx(expected)
    assert expected == pytest.approx(noise_std(1.0, 1e-8, 4.0))
    for block in outcome.blocks:
        if block.mode == "paper":
            assert block.report is None and "not released" in str(block.reason)
        else:  # released; with four holders the noise may swamp a sum of weights (at most 4)
            assert block.report is not None or "DP noise" in str(block.reason), block.summary()
    for name in NAMES:
        ledger = UserLedger.load(tmp_path / name / "user-ledger.json")
        spent = ledger.epsilon_spent()
        assert spent.size == 900 and np.allclose(spent, spent[0]) and 0 < spent[0] <= 1.0 + 1e-9


def test_a_hostile_group_count_is_refused_from_the_counts_without_building_the_blocks() -> None:
    """num-groups = 10^9 (a run config is hostile input): refused from the arithmetic alone;
    building the 2 x 10^9 blocks first took 19 GB and an out-of-memory kill in CI."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="do not fit one ciphertext"):
            FedEvalFairLayout(("dp", "eo"), num_groups=10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_only_the_fedevalfair_tasks_check_the_layout() -> None:
    """Five groups do not fit dp and eo in one ciphertext: a FedEvalFair run is refused, naming
    the keys; an LDP audit or FPFL run with five groups is not FedEvalFair's business."""
    with pytest.raises(ConfigError, match="fef-metrics x"):
        RunConfig.from_mapping({"task": "fedevalfair", "num-groups": 5})
    assert RunConfig.from_mapping({"task": "ldp-audit", "num-groups": 5}).num_groups == 5
    assert RunConfig.from_mapping({"task": "fedevalfair", "num-groups": 5, "fef-metrics": "dp"})
