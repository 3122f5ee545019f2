"""FedEvalFair's optional holder-level DP mode (issue 27: "where a holder must not be singled
out, an optional DP noise calibrated to one holder's sensitivity, charged";
:mod:`fedparity.mechanisms.crypto.ckks.holder_dp`), with the real holders
(:func:`fedparity.clients.fedevalfair_handlers` and the project app's ``fef_*`` handlers),
real TenSEAL ciphertexts, real privacy ledgers and the server's protocol over an in-process
grid.

Without the mode a server that runs the test over the holders {a, b, c} and again over {a, b}
subtracts the two releases and reads holder c's sums (the review of 2026-11-26, M1, across
runs). With it the difference is c's sums plus two independent Gaussian noises of the
calibrated standard deviation; the statistical claims (sensitivity, noise, level of the
tests) are checked statistically, and with the mode off every output is bit for bit what the
code before the mode produced (run from git in a subprocess).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from scipy import stats

from fedparity.clients import HolderRows, fedevalfair_handlers
from fedparity.clients.fedevalfair import (
    ClientStatistics,
    _count_slots,
    flooded_round2_sum,
    release_vector,
    round1_vector,
    round2_payload,
    round2_scales,
    rows_statistics,
)
from fedparity.clients.fedevalfair_handlers import (
    DP_LEDGER_REFUSAL,
    FEF_STATE_KEY,
    HolderState,
)
from fedparity.clients.messages import INTERNAL_ERROR_TEXT, session_state_key
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.mechanisms.crypto.ckks import (
    DP_BLOCKS,
    SENSITIVITY,
    CkksParameters,
    HolderDP,
    KeyPaths,
    ReleaseJournal,
    contributors_digest,
    decryption_error_bound,
    dp_release,
    flooding_std,
    load_public_context,
)
from fedparity.mechanisms.crypto.ckks.holder_dp import (
    chi2_plus_normal_sf,
    dp_block,
    dp_report,
    dp_weight,
    released_blocks,
)
from fedparity.mechanisms.fairness_tests.fedevalfair import (
    ROUND1_FIELDS,
    ClientSummary,
    disparity_variance,
    disparity_variances,
)
from fedparity.mechanisms.privacy.user_ledger import ApproximateDPRelease, UserLedger
from fedparity.mechanisms.protocol import (
    BLOCK_WIDTH,
    BLOCKS,
    FEF_KEY,
    LEDGER_NEW_KEY,
    METRICS_KEY,
    RELEASE_SIZE,
    RELEASE_WIDTH,
    ROUND1_SIZE,
    ROUND2_SIZE,
    STAGE1_WIDTH,
)
from fedparity.server.cli.identity import write_node_identities
from fedparity.strategies.fedevalfair import (
    FedEvalFairOutcome,
    FedEvalFairProtocol,
    RoundCollection,
)

pytestmark = pytest.mark.usefixtures("task_identity")

REPO = Path(__file__).resolve().parents[1]
#: The commit before the holder-level DP mode: its code gives the outputs the mode-off code
#: must reproduce bit for bit.
BEFORE_DP_MODE = "81fb901f296e0e34f6461ad72a617c6cc89dc2ba"
NUM_HOLDERS = 3
ROWS = 400
DP = HolderDP(epsilon=1.0, delta=1e-8, max_weight=100.0)
#: Monte Carlo bounds: a chi-square or normal statistic outside its central 1 - 2e-4 fails.
TAIL = 1e-4


# --- the holders ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holders:
    keys: KeyPaths
    identities: Path

    def node_config(self, index: int, ledgers: Path) -> dict[str, str]:
        return {
            "identity-key": str(self.identities / f"node-{index}.key"),
            "roster": str(self.identities / "roster.toml"),
            "ledger-dir": str(ledgers / f"node-{index}"),
        }


@pytest.fixture(scope="module")
def holders(ckks_keys: KeyPaths, tmp_path_factory: pytest.TempPathFactory) -> Holders:
    return Holders(
        ckks_keys,
        write_node_identities(tmp_path_factory.mktemp("identities"), NUM_HOLDERS),
    )


def user_ids(node_id: int) -> np.ndarray:
    return 1000 * node_id + np.arange(ROWS)


def rows_of(arrays: ArrayRecord, context: Context) -> HolderRows:
    """A holder's 400 rows (both groups and predictions present) and their users' ids."""
    rng = np.random.default_rng(1000 + context.node_id)
    groups = np.arange(ROWS) % 2
    labels = rng.integers(0, 2, ROWS)
    predictions = (rng.random(ROWS) < 0.4 + 0.1 * groups).astype(int)
    return HolderRows(labels, predictions, groups, user_ids=user_ids(context.node_id))


def holder_handlers(
    holders: Holders,
    dp: HolderDP | None,
    policy: NodePrivacyPolicy | None = None,
    rows=rows_of,  # noqa: ANN001
    tolerance: float | None = None,
) -> dict:
    return fedevalfair_handlers(
        rows,
        secret_context=holders.keys.secret,
        num_resamples=30,
        tolerance=tolerance,
        bootstrap_rng=lambda context: np.random.default_rng(context.node_id),
        policy=policy or NodePrivacyPolicy(),
        dp=dp,
    )


class Grid:
    """A Flower grid whose nodes are FedEvalFair holders in this process: each pushed message
    is handled at once by the node's real handler (a refusal becomes an error reply, as
    Flower sends it); the key holders' releases are kept in :attr:`releases`."""

    def __init__(self, handlers: dict[int, dict], contexts: dict[int, Context], run_id: int):
        self.handlers, self.contexts = handlers, contexts
        self.run = SimpleNamespace(run_id=run_id)
        self.replies: dict[str, Message] = {}
        self.releases: dict[int, np.ndarray] = {}
        self.sent = 0

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            message_id = str(self.sent)
            self.sent += 1
            message.metadata.__dict__["_message_id"] = message_id
            node = int(message.metadata.dst_node_id)
            action = message.metadata.message_type.removeprefix("query.")
            try:
                reply = self.handlers[node][action](message, self.contexts[node])
            except Exception as refusal:  # noqa: BLE001 - Flower sends any error back
                reply = Message(Error(code=0, reason=str(refusal)), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            if action == "fef_round3" and not reply.has_error():
                self.releases[node] = reply.content.array_records[FEF_KEY]["release"].numpy()
            self.replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        return [self.replies.pop(i) for i in sorted(message_ids, key=int) if i in self.replies]

    def exchange(self, action: str, nodes: list[int], content: RecordDict) -> list[Message]:
        """Send ``content`` as ``query.<action>`` to ``nodes``; their replies."""
        messages = [
            Message(content, dst_node_id=node, message_type=f"query.{action}") for node in nodes
        ]
        return self.pull_messages(set(self.push_messages(messages)))

    def statistics(self, node: int) -> ClientStatistics:
        """What holder ``node`` computed in round 1 (the test may look; the server may not)."""
        record = self.contexts[node].state.array_records[session_state_key(FEF_STATE_KEY, "")]
        return ClientStatistics.from_array(record["summaries"].numpy())


def holder_grid(
    holders: Holders,
    run_id: int,
    ledgers: Path,
    dp: HolderDP | None | dict[int, HolderDP | None],
    policy: dict[int, NodePrivacyPolicy] | None = None,
    tolerance: float | None = None,
) -> Grid:
    """The library holders 1..3 (``dp`` and ``policy`` may differ per node: a split view),
    each with its own ledger folder under ``ledgers``."""
    handlers = {
        node: holder_handlers(
            holders,
            dp.get(node) if isinstance(dp, dict) else dp,
            (policy or {}).get(node),
            tolerance=tolerance,
        )
        for node in range(1, NUM_HOLDERS + 1)
    }
    contexts = {
        node: Context(
            run_id=run_id,
            node_id=node,
            node_config=holders.node_config(node - 1, ledgers),
            state=RecordDict(),
            run_config={},
        )
        for node in range(1, NUM_HOLDERS + 1)
    }
    return Grid(handlers, contexts, run_id)


def protocol_of(holders: Holders, dp: HolderDP | None, **options) -> FedEvalFairProtocol:  # noqa: ANN003
    return FedEvalFairProtocol(
        load_public_context(holders.keys.public), timeout=2.0, dp=dp, **options
    )


def run(
    holders: Holders,
    nodes: list[int],
    run_id: int,
    ledgers: Path,
    dp: HolderDP | None = DP,
    **options,  # noqa: ANN003
) -> tuple[FedEvalFairOutcome, Grid]:
    """One FedEvalFair run of the server's protocol over ``nodes`` (holders and server with
    ``dp``, unless ``options`` give the holders theirs)."""
    grid = holder_grid(holders, run_id, ledgers, options.pop("holder_dp", dp), **options)
    protocol = protocol_of(holders, dp, tolerance=options.get("tolerance"))
    return protocol.start(grid, ArrayRecord(), nodes), grid  # type: ignore[arg-type]


def through_round2(
    grid: Grid, protocol: FedEvalFairProtocol, nodes: list[int]
) -> tuple[RoundCollection, RoundCollection]:
    """Rounds 1 and 2 (node ``nodes[0]`` endorses): both collected rounds."""
    run_id = grid.run.run_id
    replies = grid.exchange("fef_round1", nodes, protocol.round1_content(ArrayRecord()))
    first = protocol.collect_round(1, nodes, replies, ROUND1_SIZE, run_id=run_id)
    contributors = [entry.signer for entry in first.entries]
    endorsed = grid.exchange("fef_endorse", nodes[:1], protocol.endorse_content(first.entries))
    total, endorsements, _ = protocol.collect_endorsements(
        endorsed, nodes[:1], contributors, run_id=run_id
    )
    assert total is not None
    content = protocol.round2_content(total, contributors, [(e, s) for _, e, s in endorsements])
    replies = grid.exchange("fef_round2", nodes, content)
    second = protocol.collect_round(
        2, nodes, replies, ROUND2_SIZE, run_id=run_id, reference=contributors_digest(contributors)
    )
    return first, second


def raw_commitments(replies: list[Message]) -> list[tuple[bytes, bytes]]:
    """The (signer, signature) of every commitment reply, unchecked (a key holder checks)."""
    record = [reply.content.array_records[FEF_KEY] for reply in replies]
    return [
        (item["signer"].numpy().tobytes(), item["commitment"].numpy().tobytes()) for item in record
    ]


def dp_sums(statistics: ClientStatistics, dp: HolderDP = DP) -> np.ndarray:
    """One holder's released DP sums, (blocks, 3): what it adds to the release."""
    return released_blocks(statistics.contribution(mu0=0.0, tolerance=None, dp=dp))


def plain_sums(statistics: ClientStatistics) -> np.ndarray:
    """One holder's [sum w, sum w Ybar, sum w Ybar^2] of the calibrated blocks (mode off)."""
    return released_blocks(statistics.contribution(mu0=0.0, tolerance=None))


def released(release: np.ndarray) -> np.ndarray:
    """The released sums [C, B, A] of the calibrated blocks, (blocks, 3)."""
    return np.stack(
        [release[i * RELEASE_WIDTH + 1 : i * RELEASE_WIDTH + 4] for i in DP_BLOCKS]
    ).astype(np.float64)


def variance_within_chi2_bounds(errors: np.ndarray, std: float) -> tuple[float, float, float]:
    """(n - 1) s^2 / std^2 of ``errors`` (mean known to be 0: n s^2 / std^2 with n degrees of
    freedom) and the chi-square bounds it must lie between."""
    n = errors.size
    statistic = float(np.sum(errors**2) / std**2)
    return statistic, float(stats.chi2.ppf(TAIL, n)), float(stats.chi2.ppf(1 - TAIL, n))


# --- sensitivity ---------------------------------------------------------------------------------


def extreme(mean: float) -> ClientStatistics:
    """A holder of 4000 rows, 2000 per group, every group-0 row predicted positive and every
    group-1 row negative (mean 1), or the mirror (mean -1), in both metrics: V(0) = 1/3999,
    so its weight is capped at 1."""
    summary = ClientSummary(mean=mean, variance=1e-4, n=100, margins=(2000, 2000, 2000))
    paper = ClientSummary(mean=abs(mean), variance=1e-4, n=100)
    return ClientStatistics((summary, paper, summary, paper), ())


def test_one_holder_moves_the_release_by_at_most_the_sensitivity_and_extremes_attain_it() -> None:
    """Delta = 2 sqrt(2) (the derivation in :mod:`fedparity.mechanisms.crypto.ckks.holder_dp`): the
    worst-case neighbours are two holders at the weight cap with mean disparities +1 and -1,
    in both metrics; nothing else in the release depends on a holder's data."""
    plus, minus = extreme(1.0), extreme(-1.0)
    for tolerance in (None, 0.05):
        difference = np.linalg.norm(
            released_blocks(plus.contribution(mu0=0.0, tolerance=tolerance, dp=DP))
            - released_blocks(minus.contribution(mu0=0.0, tolerance=tolerance, dp=DP))
        )
        assert difference == pytest.approx(SENSITIVITY, rel=1e-12)
    assert SENSITIVITY == pytest.approx(2 * math.sqrt(2))
    # The count of every block is 1 for every holder, whatever its data (k is public).
    for statistics in (plus, minus, ClientStatistics.empty()):
        vector = statistics.contribution(mu0=0.0, tolerance=None, dp=DP)
        assert vector[BLOCK_WIDTH - 1 :: BLOCK_WIDTH].tolist() == [1.0] * len(BLOCKS)
    # The bound is the supremum over the whole domain w in [0, 1], y in [-1, 1] of one block.
    w, y = np.meshgrid(np.linspace(0, 1, 21), np.linspace(-1, 1, 81))
    points = np.stack([w.ravel(), (w * y).ravel(), (w * y * y).ravel()], 1)
    squared = ((points[:, None, :] - points[None, :, :]) ** 2).sum(-1)
    assert squared.max() == pytest.approx(4.0)


def test_no_real_holder_exceeds_the_sensitivity_and_the_weights_keep_the_variance_bound() -> None:
    """Random holders (random margins, disparities, mu0 and tolerance): every pair's
    contributions differ by at most Delta, every weight is in [0, 1] and w~ V(mu) <= v_min at
    the null values (the bound the tests use). A holder whose rows separate the groups almost
    perfectly comes within 1% of Delta through the real bootstrap."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        mu0, tolerance = rng.uniform(-0.2, 0.2), rng.choice([None, rng.uniform(0.01, 0.3)])
        vectors = []
        for _ in range(40):
            group0, group1 = rng.integers(5, 3000, 2)
            total = group0 + group1
            positives = int(rng.integers(1, total))
            low = max(-1.0, (positives - group1) / group0 - positives / group1)
            mean = rng.uniform(max(low, -1.0), 1.0)
            summary = ClientSummary(mean, rng.uniform(1e-5, 0.1), 100, (group0, group1, positives))
            weight = dp_weight(summary, max_weight=DP.max_weight, mu0=mu0, tolerance=tolerance)
            assert 0.0 < weight <= 1.0
            for value in (0.0, mu0, *(() if tolerance is None else (tolerance, -tolerance))):
                variance = disparity_variance((group0, group1, positives), value)
                assert weight * variance <= DP.min_variance * (1 + 1e-12)
            blocks = [
                dp_block(summary, max_weight=DP.max_weight, mu0=mu0, tolerance=tolerance)[:3]
                for _ in DP_BLOCKS
            ]
            vectors.append(np.concatenate(blocks))
        points = np.array(vectors)
        distances = np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1))
        assert distances.max() <= SENSITIVITY * (1 + 1e-12)

    def separated(sign: int) -> ClientStatistics:
        groups = np.arange(8000) % 2
        predictions = (groups == (0 if sign > 0 else 1)).astype(int)
        predictions[:2] = 1 - predictions[:2]  # one row of each group the other way
        labels = np.ones_like(groups)  # eo's rows are all rows: both metrics extreme
        return rows_statistics(
            labels,
            predictions,
            groups,
            num_resamples=50,
            rng=np.random.default_rng(1),
            min_cell_count=5,
        )

    reached = np.linalg.norm(dp_sums(separated(1)) - dp_sums(separated(-1)))
    assert 0.99 * SENSITIVITY < reached <= SENSITIVITY


# --- the noise -------------------------------------------------------------------------------


def test_the_noise_is_the_analytic_gaussian_calibration() -> None:
    """sigma is the smallest standard deviation with (epsilon, delta)-DP at Delta (dp_accounting's
    Gaussian privacy loss: delta(epsilon) <= delta at sigma, > delta at 0.99 sigma), below the
    classical sqrt(2 ln(1.25 / delta)) Delta / epsilon."""
    from dp_accounting.pld import privacy_loss_mechanism

    for epsilon, delta in ((0.5, 1e-8), (1.0, 1e-8), (4.0, 1e-6)):
        sigma = HolderDP(epsilon, delta).noise_std
        loss = privacy_loss_mechanism.GaussianPrivacyLoss
        assert loss(sigma, sensitivity=SENSITIVITY).get_delta_for_epsilon(epsilon) <= delta * (
            1 + 1e-6
        )
        assert loss(0.99 * sigma, sensitivity=SENSITIVITY).get_delta_for_epsilon(epsilon) > delta
        if epsilon < 1:
            assert sigma < math.sqrt(2 * math.log(1.25 / delta)) * SENSITIVITY / epsilon


def test_the_released_noise_has_the_calibrated_standard_deviation() -> None:
    """Seeded Monte Carlo over 8 secret-key-derived keys and 500 commitment digests each: the
    released sums minus the exact ones are centred normal with the calibrated sigma (the sum of
    squares against chi-square bounds, each coordinate too), independent across coordinates,
    the same for the same key and digest and independent for another digest."""
    exact = np.array([[57.25, -3.5, 12.0], [41.0, 6.125, 9.5]])
    contributions = np.zeros(len(BLOCKS) * BLOCK_WIDTH)
    for row, index in enumerate(DP_BLOCKS):
        contributions[index * BLOCK_WIDTH : index * BLOCK_WIDTH + 3] = exact[row]
    errors = []
    for key_index in range(8):
        key = np.random.default_rng(key_index).bytes(32)
        for digest in range(500):
            message = b"run 7 commitment " + digest.to_bytes(4, "big")
            release = dp_release(contributions, num_holders=9, dp=DP, key=key, message=message)
            assert np.isnan(release[[i * RELEASE_WIDTH for i in range(len(BLOCKS))]]).all()
            assert release[[i * RELEASE_WIDTH + BLOCK_WIDTH for i in DP_BLOCKS]].tolist() == [
                9.0,
                9.0,
            ]
            errors.append(released(release) - exact)
    errors = np.array(errors).reshape(len(errors), -1)
    sigma = DP.noise_std
    statistic, low, high = variance_within_chi2_bounds(errors, sigma)
    assert low < statistic < high, (statistic, low, high)
    for column in errors.T:
        statistic, low, high = variance_within_chi2_bounds(column, sigma)
        assert low < statistic < high
    z = errors.mean() / (sigma / math.sqrt(errors.size))
    assert abs(z) < stats.norm.isf(TAIL / 2)
    correlation = np.corrcoef(errors.T)[np.triu_indices(errors.shape[1], 1)]
    assert np.abs(correlation).max() < stats.norm.isf(TAIL / 2) / math.sqrt(errors.shape[0])
    assert stats.kstest(errors.ravel() / sigma, "norm").pvalue > TAIL
    # keyed: the same key and digest give the same values, another digest others
    key, message = b"k" * 32, b"m"
    again = dp_release(contributions, num_holders=9, dp=DP, key=key, message=message)
    np.testing.assert_array_equal(
        again, dp_release(contributions, num_holders=9, dp=DP, key=key, message=message)
    )
    other = dp_release(contributions, num_holders=9, dp=DP, key=key, message=b"n")
    assert not np.allclose(released(again), released(other))


def fair_federation(
    rng: np.random.Generator, dp: HolderDP, k: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The exact DP sums [C, B, A] of ``k`` fair holders of 50 to 2000 rows (group 0's
    positives hypergeometric given the margins: disparity 0 at every holder), from their DP
    weights (vectorised; the test checks one federation against :func:`dp_block`), with the
    holders' margins and disparities."""
    sizes = rng.integers(50, 2000, k)
    group0 = rng.binomial(sizes, 0.5).clip(5, sizes - 5)
    positives = rng.binomial(sizes, 0.3).clip(5, sizes - 5)
    hits = rng.hypergeometric(positives, sizes - positives, group0)
    means = hits / group0 - (positives - hits) / (sizes - group0)
    margins = np.stack([group0, sizes - group0, positives], 1).astype(np.float64)
    weights = np.minimum(1.0, dp.min_variance / disparity_variances(margins, 0.0))
    return np.array([weights.sum(), (weights * means).sum(), (weights * means**2).sum()]), (
        margins,
        means,
    )


@pytest.mark.slow
def test_the_tests_hold_their_level_under_the_noise() -> None:
    """2000 federations of 200 fair holders (:func:`fair_federation`), Gaussian noise of the
    calibrated sigma on their DP sums and the server's tests: stage 2 (the noise's variance
    accounted) rejects a true mu = 0 at most at about alpha, and so does stage 1
    (approximate); TOST certifies a true |mu| = tolerance at most at about alpha. At
    epsilon = 1 the noise dominates and stage 2's level is about alpha; at epsilon = 8 (less
    noise) the variance bound makes it conservative."""
    rng = np.random.default_rng(11)
    alpha, reps, k = 0.05, 2000, 200
    ceiling = alpha + stats.norm.isf(TAIL) * math.sqrt(alpha * (1 - alpha) / reps)
    sums, (margins, means) = fair_federation(np.random.default_rng(0), DP, k)
    by_block = sum(
        dp_block(
            ClientSummary(float(mean), 1e-3, 100, tuple(int(v) for v in row)),  # type: ignore[arg-type]
            max_weight=DP.max_weight,
            mu0=0.0,
            tolerance=None,
        )[:3]
        for mean, row in zip(means, margins, strict=True)
    )
    np.testing.assert_allclose(sums, by_block, rtol=1e-12)
    for dp in (HolderDP(1.0, 1e-8), HolderDP(8.0, 1e-8)):
        rejected = {"stage1": 0, "stage2": 0}
        for _ in range(reps):
            exact, _ = fair_federation(rng, dp, k)
            noisy = exact + dp.noise_std * rng.standard_normal(3)
            try:
                report = dp_report(noisy, k, dp=dp, alpha=alpha, mu0=0.0, tolerance=None)
            except ValueError:
                continue  # the noisy sum of weights is not positive: no test, no rejection
            rejected["stage1"] += report.reject_homogeneity
            rejected["stage2"] += report.reject_fairness
        for name in ("stage1", "stage2"):
            assert rejected[name] / reps <= ceiling, (dp, name, rejected)
        if dp.epsilon == 1.0:
            assert rejected["stage2"] / reps > alpha / 2, rejected  # about alpha
    # TOST at a true |mu| = tolerance: k holders at the cap, all at disparity +tolerance
    tolerance, certified = 0.05, 0
    for _ in range(reps):
        exact = np.array([k, k * tolerance, k * tolerance**2])
        exact[1] += math.sqrt(k * DP.min_variance) * rng.standard_normal()
        noisy = exact + DP.noise_std * rng.standard_normal(3)
        report = dp_report(noisy, k, dp=DP, alpha=alpha, mu0=0.0, tolerance=tolerance)
        certified += bool(report.certified_fair)
    assert certified / reps <= ceiling


def test_the_stage1_null_with_noise_is_a_convolution() -> None:
    """P(chi2(nu) + N(0, tau^2) >= q), by quadrature, against a Monte Carlo of 200,000 draws
    (and chi2's own tail at tau = 0)."""
    rng = np.random.default_rng(3)
    for dof, tau in ((3, 2.0), (50, 10.0), (199, 1400.0)):
        draws = rng.chisquare(dof, 200_000) + tau * rng.standard_normal(200_000)
        for q in np.quantile(draws, [0.5, 0.9, 0.99]):
            assert chi2_plus_normal_sf(q, dof, tau) == pytest.approx(
                (draws >= q).mean(), abs=5 * math.sqrt(0.25 / 200_000)
            )
    assert chi2_plus_normal_sf(7.8, 3, 0.0) == pytest.approx(stats.chi2.sf(7.8, 3))


# --- through the real holders ----------------------------------------------------------------


def test_two_key_holders_release_identical_values_and_never_the_exact_sums(
    holders: Holders, tmp_path: Path
) -> None:
    """Both key holders of a run release the same noisy values (the noise is keyed by the
    secret key, the run and the commitment: the server's agreement check holds and a repeated
    request cannot be averaged), which are the holders' exact sums plus noise of about sigma;
    the paper blocks and everything but the three sums and k are not released."""
    outcome, grid = run(holders, [1, 2, 3], 21, tmp_path)
    assert outcome.error is None, outcome
    assert sorted(grid.releases) == [1, 2]
    np.testing.assert_array_equal(grid.releases[1], grid.releases[2])
    release = grid.releases[1]
    assert release.shape == (RELEASE_SIZE,)
    exact = sum(dp_sums(grid.statistics(node)) for node in (1, 2, 3))
    noise = released(release) - exact
    assert np.all(np.abs(noise) > 1e-3) and np.abs(noise).max() < 8 * DP.noise_std
    assert np.isnan(release[[i * RELEASE_WIDTH for i in range(len(BLOCKS))]]).all()
    for index, (_, mode) in enumerate(BLOCKS):
        block = release[index * RELEASE_WIDTH : (index + 1) * RELEASE_WIDTH]
        if mode == "paper":
            assert np.isnan(block).all()
        else:
            # Released: the three DP sums and k (the contribution's count slot); the group
            # counts of the pooled disparity and the random-effects summary are not.
            assert np.isnan(block[4:BLOCK_WIDTH]).all() and block[BLOCK_WIDTH] == 3.0
            assert np.isnan(block[BLOCK_WIDTH + 1 :]).all()
    assert outcome.holder_dp == DP.to_dict()
    assert outcome.to_dict()["holder_dp"]["noise_std"] == DP.noise_std
    for block in outcome.blocks:  # 3 holders: the noise may swamp a test (said so)
        if block.mode == "paper":
            assert block.report is None and "not released" in str(block.reason)
        elif block.report is None:
            assert "noisy sum of weights is not positive" in str(block.reason)
        else:
            assert block.report.homogeneity.method.startswith("Holder-level DP")
            # Not released in this mode: the group counts and the random-effects summary.
            assert block.report.pooled is None and block.report.random_effects is None


def journal_path(ledgers: Path, node: int) -> Path | None:
    found = list((ledgers / f"node-{node - 1}").glob("fedevalfair-key-*.json"))
    return found[0] if found else None


def journal_of(ledgers: Path, node: int) -> ReleaseJournal:
    path = journal_path(ledgers, node)
    assert path is not None
    return ReleaseJournal.from_json(path.read_text(), path.stem.removeprefix("fedevalfair-key-"))


def ledger_of(ledgers: Path, node: int) -> UserLedger:
    return UserLedger.load(ledgers / f"node-{node - 1}" / "user-ledger.json")


def test_every_round2_holder_charges_its_users_before_it_commits(
    holders: Holders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round-2 holder charges (epsilon, delta) to every one of its 400 users (by id) in its
    privacy ledger -- the ledger its LDP audits and FPFL trainings charge -- before it signs the
    commitment. With a fault injected into holder C's key-journal save (which follows the
    charge), C's commitment fails: its users are already charged and it holds no commitment;
    the server withholds the result."""
    saving = ReleaseJournal.save

    def fault(journal: ReleaseJournal, path: Path) -> None:
        if "node-2" in str(path):
            raise OSError("disk full")
        saving(journal, path)

    monkeypatch.setattr(ReleaseJournal, "save", fault)
    outcome, _ = run(holders, [1, 2, 3], 31, tmp_path)
    assert "[3] did not commit" in (outcome.error or ""), outcome
    assert any(INTERNAL_ERROR_TEXT in item.reason for _, item in outcome.rejected)
    for node in (1, 2, 3):
        ledger = ledger_of(tmp_path, node)
        [release] = ledger.releases
        assert isinstance(release, ApproximateDPRelease) and release.job == "fedevalfair"
        assert (release.epsilon, release.delta) == (DP.epsilon, DP.delta)
        assert sorted(ledger.user_ids.tolist()) == user_ids(node).tolist()  # type: ignore[union-attr]
        assert ledger.epsilon_spent().min() > 0  # every user of the holder is charged
    assert 31 in journal_of(tmp_path, 1).commitments
    assert journal_path(tmp_path, 3) is None  # charged first, never committed


def test_each_committer_reports_its_ledger_totals_and_a_malformed_report_is_rejected(
    holders: Holders, tmp_path: Path
) -> None:
    """With its commitment every round-2 holder reports its ledger's totals after the charge
    (as an LDP audit's reply does): the outcome keeps them per node. A holder whose totals are
    malformed (here ``ledger-new`` without totals) has its commitment rejected and counted, and
    the server withholds the result instead of crashing or trusting it."""
    outcome, _ = run(holders, [1, 2, 3], 35, tmp_path / "honest")
    reports = outcome.ledger_reports
    assert sorted(reports.by_node) == [1, 2, 3] and reports.new_ledger_nodes == {1, 2, 3}
    for node, totals in reports.by_node.items():
        summary = ledger_of(tmp_path / "honest", node).summary()
        assert totals.epsilon == pytest.approx(summary["max_epsilon"])
        assert (totals.basic_epsilon, totals.basic_delta) == (DP.epsilon, DP.delta)
    off, _ = run(holders, [1, 2, 3], 36, tmp_path / "off", dp=None)
    assert off.ledger_reports.by_node == {}  # the mode off: nothing charged, nothing reported

    grid = holder_grid(holders, 37, tmp_path / "malformed", DP)
    honest_commit = grid.handlers[2]["fef_commit"]

    def malformed(message: Message, context: Context) -> Message:
        reply = honest_commit(message, context)
        reply.content.metric_records[METRICS_KEY] = MetricRecord({LEDGER_NEW_KEY: 1.0})
        return reply

    grid.handlers[2] = {**grid.handlers[2], "fef_commit": malformed}
    outcome = protocol_of(holders, DP).start(grid, ArrayRecord(), [1, 2, 3])  # type: ignore[arg-type]
    assert outcome.released == () and "[2] did not commit" in (outcome.error or "")
    [reason] = [item.reason for _, item in outcome.rejected if item.node_id == 2]
    assert reason.startswith("malformed ledger totals: ledger-new without")
    assert sorted(outcome.ledger_reports.by_node) == [1, 3]


def test_a_repeated_commitment_request_is_signed_again_without_a_second_charge(
    holders: Holders, tmp_path: Path
) -> None:
    grid = holder_grid(holders, 41, tmp_path, DP)
    protocol = protocol_of(holders, DP)
    first, second = through_round2(grid, protocol, [1, 2, 3])
    content = protocol.commit_content(first.entries, second.entries)
    signatures = [raw_commitments(grid.exchange("fef_commit", [1], content)) for _ in range(2)]
    assert signatures[0] == signatures[1]
    assert len(ledger_of(tmp_path, 1).releases) == 1


def test_a_user_who_cannot_afford_the_release_makes_the_holder_refuse_to_commit(
    holders: Holders, tmp_path: Path
) -> None:
    """One user of holder C has spent 9.5 of its budget of 10 in earlier releases (an LDP
    audit, say): C refuses to commit to a release of epsilon 1 with a fixed sentence, charges
    nothing and commits to nothing, and the server withholds the result. Decided from the
    ledger and the run's parameters, not from this release's data."""
    ids = user_ids(3)
    path = tmp_path / "node-2" / "user-ledger.json"
    ledger = UserLedger(10.0, 1e-6, ids.size, user_ids=ids)
    ledger.charge(ApproximateDPRelease(epsilon=9.5, job="ldp_audit"), user_ids=ids[7:8])
    ledger.save(path)
    outcome, _ = run(holders, [1, 2, 3], 61, tmp_path)
    assert "[3] did not commit" in (outcome.error or "") and outcome.released == ()
    [reason] = [item.reason for _, item in outcome.rejected if item.node_id == 3]
    assert reason == DP_LEDGER_REFUSAL
    assert len(ledger_of(tmp_path, 3).releases) == 1  # nothing charged
    assert journal_path(tmp_path, 3) is None  # nothing committed


def project_holder_without_data(holders: Holders, ledgers: Path) -> dict[str, object]:
    """The node config of a project-app holder (partition 0 of 3) whose data file does not
    exist: a handler that opens it fails, so a refusal before that is before any data is read."""
    from fedparity.mechanisms.crypto.ckks import NODE_CONFIG_KEY

    return {
        **holders.node_config(0, ledgers),
        NODE_CONFIG_KEY: str(holders.keys.secret),
        "data-file": str(ledgers / "no-such-data.csv"),
        "num-groups": 2,
        "partition-id": 0,
        "num-partitions": 3,
    }


def test_the_policy_refuses_an_epsilon_above_its_cap_before_any_data_is_read(
    holders: Holders, tmp_path: Path
) -> None:
    """fef-dp-max-epsilon = 0.5 and a run asking epsilon 1: refused with a fixed sentence naming
    the key before the holder's rows are read (the library holder) or its data file opened
    (the project app); a delta not below user-delta likewise. Within the cap the same holders
    read their data."""
    from fedparity.clients.app import fef_round1
    from fedparity.clients.project.config import RunConfig

    reads: list[int] = []

    def counted_rows(arrays: ArrayRecord, context: Context) -> HolderRows:
        reads.append(context.node_id)
        return rows_of(arrays, context)

    content = protocol_of(holders, DP).round1_content(ArrayRecord())
    message = Message(content, dst_node_id=1, message_type="query.fef_round1")

    def holder(dp: HolderDP, policy: NodePrivacyPolicy) -> Message:
        context = Context(1, 1, holders.node_config(0, tmp_path), RecordDict(), {})
        return holder_handlers(holders, dp, policy, rows=counted_rows)["fef_round1"](
            message, context
        )

    with pytest.raises(PolicyRefusal) as refusal:
        holder(DP, NodePrivacyPolicy(fef_dp_max_epsilon=0.5))
    assert "fef-dp-max-epsilon" in str(refusal.value) and reads == []
    with pytest.raises(PolicyRefusal, match="delta is not below user-delta"):
        holder(HolderDP(1.0, 1e-6), NodePrivacyPolicy())
    assert reads == []
    assert holder(DP, NodePrivacyPolicy(fef_dp_max_epsilon=1.0)).content.array_records[FEF_KEY]
    assert reads == [1]

    config = RunConfig.from_mapping({"task": "fedevalfair", "fef-dp-epsilon": 1.0})
    node_config = project_holder_without_data(holders, tmp_path)
    with pytest.raises(PolicyRefusal, match="fef-dp-max-epsilon"):
        fef_round1(
            message,
            Context(1, 1, {**node_config, "fef-dp-max-epsilon": 0.5}, RecordDict(), {}),
            config,
        )
    with pytest.raises(Exception, match="no-such-data") as error:
        fef_round1(message, Context(1, 1, node_config, RecordDict(), {}), config)
    assert not isinstance(error.value, PolicyRefusal)


REQUIRE_DP = NodePrivacyPolicy(fef_require_dp=True)


def test_a_node_that_requires_the_dp_mode_refuses_a_run_without_it(
    holders: Holders, tmp_path: Path
) -> None:
    """The attack: the server runs FedEvalFair without the holder-level DP mode, so the key
    holders release the holders' exact sums. Against holders whose policy has no
    ``fef-require-dp`` it succeeds (a release). Holders that set it refuse round 1 with a fixed
    sentence before their rows are read, and nothing is released; the same holders take part in
    a run in the DP mode. A key holder that set it releases nothing of a run without the mode
    (its policy tightened after round 2)."""
    baseline, _ = run(holders, [1, 2, 3], 81, tmp_path / "baseline", dp=None)
    assert len(baseline.released) > 0  # the attack, without the defence

    reads: list[int] = []

    def counted_rows(arrays: ArrayRecord, context: Context) -> HolderRows:
        reads.append(context.node_id)
        return rows_of(arrays, context)

    grid = holder_grid(holders, 82, tmp_path / "refused", None)
    grid.handlers = {
        node: holder_handlers(holders, None, REQUIRE_DP, rows=counted_rows)
        for node in grid.handlers
    }
    outcome = protocol_of(holders, None).start(grid, ArrayRecord(), [1, 2, 3])  # type: ignore[arg-type]
    assert outcome.released == () and grid.releases == {} and reads == []
    reasons = {item.node_id: item.reason for _, item in outcome.rejected}
    assert sorted(reasons) == [1, 2, 3]
    assert all("fef-require-dp forbids" in reason for reason in reasons.values()), reasons

    grid = holder_grid(
        holders, 83, tmp_path / "dp", DP, policy=dict.fromkeys((1, 2, 3), REQUIRE_DP)
    )
    assert len(protocol_of(holders, DP).start(grid, ArrayRecord(), [1, 2, 3]).released) > 0  # type: ignore[arg-type]

    grid = holder_grid(holders, 84, tmp_path / "key-holder", None)
    protocol = protocol_of(holders, None)
    first, second = through_round2(grid, protocol, [1, 2, 3])
    content = protocol.commit_content(first.entries, second.entries)
    commitments = raw_commitments(grid.exchange("fef_commit", [1, 2, 3], content))
    round3 = protocol.round3_content(first.entries, second.entries, commitments)
    grid.handlers[1] = holder_handlers(holders, None, REQUIRE_DP)
    [refused] = grid.exchange("fef_round3", [1], round3)
    assert refused.has_error() and "fef-require-dp forbids" in refused.error.reason
    assert grid.releases == {}
    [released] = grid.exchange("fef_round3", [2], round3)  # a holder without the key releases
    assert not released.has_error() and list(grid.releases) == [2]


def test_the_project_app_refuses_a_run_without_the_dp_mode_before_opening_its_data(
    holders: Holders, tmp_path: Path
) -> None:
    """The project's ClientApp: node config ``fef-require-dp = true`` and a run without
    ``fef-dp-epsilon`` is refused before the holder's data file is opened; without the key the
    same node goes on to open it. The key is read from files and node config like every policy
    key, and is off by default (also in simulation)."""
    from fedparity.clients.app import fef_round1
    from fedparity.clients.project.config import RunConfig

    message = Message(
        protocol_of(holders, None).round1_content(ArrayRecord()),
        dst_node_id=1,
        message_type="query.fef_round1",
    )
    config = RunConfig.from_mapping({"task": "fedevalfair"})
    node_config = project_holder_without_data(holders, tmp_path)
    with pytest.raises(PolicyRefusal, match="fef-require-dp forbids"):
        fef_round1(
            message,
            Context(1, 1, {**node_config, "fef-require-dp": True}, RecordDict(), {}),
            config,
        )
    with pytest.raises(Exception, match="no-such-data") as error:
        fef_round1(message, Context(1, 1, node_config, RecordDict(), {}), config)
    assert not isinstance(error.value, PolicyRefusal)

    assert not NodePrivacyPolicy().fef_require_dp
    assert not NodePrivacyPolicy.simulation().fef_require_dp
    assert NodePrivacyPolicy.from_mapping({"fef-require-dp": "true"}, source="t").fef_require_dp
    with pytest.raises(ValueError, match="fef-require-dp"):
        NodePrivacyPolicy.from_mapping({"fef-require-dp": "sometimes"}, source="t")


def test_holders_given_other_dp_parameters_never_let_a_key_holder_release(
    holders: Holders, tmp_path: Path
) -> None:
    """A split view: the server tells holder C epsilon 0.1 (C charges 0.1 and believes its users
    well protected) and the key holders epsilon 8 (little noise). Without the parameters in
    the commitment, the key holders would release C's sums with the noise of epsilon 8 while C
    charged 0.1. Now C signs a commitment to other terms: the server finds it does not verify,
    and a key holder given it directly refuses to release."""
    loose = HolderDP(8.0, 1e-8)
    split = {1: loose, 2: loose, 3: HolderDP(0.1, 1e-8)}
    outcome, _ = run(holders, [1, 2, 3], 71, tmp_path, dp=loose, holder_dp=split)
    assert "[3] did not commit" in (outcome.error or "") and outcome.released == ()
    grid = holder_grid(holders, 72, tmp_path / "direct", split)
    protocol = protocol_of(holders, loose)
    first, second = through_round2(grid, protocol, [1, 2, 3])
    content = protocol.commit_content(first.entries, second.entries)
    commitments = raw_commitments(grid.exchange("fef_commit", [1, 2, 3], content))
    [reply] = grid.exchange(
        "fef_round3", [1], protocol.round3_content(first.entries, second.entries, commitments)
    )
    assert reply.has_error() and "does not verify" in reply.error.reason
    assert grid.releases == {}


def test_a_holder_that_can_compute_no_metric_takes_part_with_weight_zero(
    holders: Holders, tmp_path: Path
) -> None:
    """A holder whose rows hold one group only answers like every other holder, with weight 0
    in every block, with the mode on and off (before the review of 2026-11-28, M1, it answered
    "cannot take part" with the mode off: a bit about its data;
    ``tests/test_fedevalfair_no_oracle.py`` runs that attack)."""

    def one_group(arrays: ArrayRecord, context: Context) -> HolderRows:
        rows = rows_of(arrays, context)
        return HolderRows(rows.labels, rows.predictions, rows.groups * 0, rows.user_ids)

    message = Message(
        protocol_of(holders, DP).round1_content(ArrayRecord()),
        dst_node_id=1,
        message_type="query.fef_round1",
    )
    for dp in (None, DP):
        context = Context(1, 1, holders.node_config(0, tmp_path), RecordDict(), {})
        handler = holder_handlers(holders, dp, rows=one_group)["fef_round1"]
        assert "ciphertext" in handler(message, context).content.array_records[FEF_KEY]
        state = HolderState.load(context.state, "")
        assert state.statistics is not None and state.statistics.is_empty
        sums = plain_sums(state.statistics) if dp is None else dp_sums(state.statistics)
        assert np.array_equal(sums, np.zeros((len(DP_BLOCKS), 3)))


@pytest.mark.slow
def test_differencing_two_runs_no_longer_yields_a_holders_sums(
    holders: Holders, tmp_path: Path
) -> None:
    """The review's differencing across two runs: the release over {A, B, C} minus the release
    over {A, B}. With the mode off it is holder C's sums to 1e-4 (the flooding noise; the
    review's demo read sum w = 400.9647, sum w Ybar = -40.0965 this way): the attack works. On,
    it is C's sums plus the difference of two independent noises: over 30 pairs of runs the
    error has the standard deviation sqrt(2) sigma (its sum of squares within chi-square
    bounds), and is of the order of sigma, not of the flooding noise."""
    pair: dict[str, np.ndarray] = {}
    for name, nodes, run_id in (("abc", [1, 2, 3], 81), ("ab", [1, 2], 82)):
        outcome, grid = run(holders, nodes, run_id, tmp_path / f"off-{name}", dp=None)
        assert outcome.error is None
        pair[name] = released(np.array(outcome.released))
    target = plain_sums(holder_statistics(holders, 3))
    # within the flooding noise: it grew by sqrt(1253 / 45) ~ 5.3 when round 2 gained the
    # random-effects grid (the release floods every decrypted slot), so 10 times the old 1e-5
    np.testing.assert_allclose(pair["abc"] - pair["ab"], target, rtol=1e-4, atol=1e-3)

    errors = []
    for index in range(30):
        releases = []
        for name, nodes in (("abc", [1, 2, 3]), ("ab", [1, 2])):
            run_id = 1000 + 2 * index + len(nodes)
            outcome, _ = run(holders, nodes, run_id, tmp_path / f"on-{index}-{name}")
            assert outcome.error is None
            releases.append(released(np.array(outcome.released)))
        errors.append(releases[0] - releases[1] - dp_sums(holder_statistics(holders, 3)))
    errors = np.array(errors).ravel()
    statistic, low, high = variance_within_chi2_bounds(errors, math.sqrt(2) * DP.noise_std)
    assert low < statistic < high, (statistic, low, high)
    assert np.median(np.abs(errors)) > DP.noise_std / 2


def holder_statistics(holders: Holders, node: int) -> ClientStatistics:
    """Holder ``node``'s round-1 statistics, as its handler computes them (seeded)."""
    context = Context(1, node, {}, RecordDict(), {})
    rows = rows_of(ArrayRecord(), context)
    return rows_statistics(
        rows.labels,
        rows.predictions,
        rows.groups,
        num_resamples=30,
        rng=np.random.default_rng(node),
        min_cell_count=5,
    )


# --- the project app and the server's report ------------------------------------------------


def test_the_project_app_runs_the_dp_mode_and_charges_each_nodes_ledger(
    holders: Holders, tmp_path: Path
) -> None:
    """The ClientApp's ``fef_*`` handlers with ``fef-dp-epsilon`` in the run config, through the
    server's protocol: a completed run whose calibrated tests come from the noisy sums (the
    paper's blocks not released), every holder's test users charged in the ledger its LDP
    audits charge (``ledger-partition-<i>.json``), and the report saying so."""
    from fedparity.clients import app
    from fedparity.clients.project.config import RunConfig
    from fedparity.clients.project.task import build_model, get_arrays
    from fedparity.mechanisms.crypto.ckks import NODE_CONFIG_KEY
    from fedparity.server.fedevalfair_job import fedevalfair_privacy, fedevalfair_protocol
    from fedparity.server.html_report import render_report
    from fedparity.server.report import fedevalfair_report, fedevalfair_warnings

    config = RunConfig.from_mapping(
        {
            "task": "fedevalfair",
            "users-per-node": 600,
            "fef-resamples": 30,
            "fef-dp-epsilon": 2.0,
            "fef-tolerance": 0.05,
        }
    )
    dp = config.fef_holder_dp
    assert dp == HolderDP(2.0, 1e-8, 100.0)
    actions = ("fef_round1", "fef_endorse", "fef_round2", "fef_commit", "fef_round3")
    handlers = {
        node: {
            action: (lambda f: lambda message, context: f(message, context, config))(
                getattr(app, action)
            )
            for action in actions
        }
        for node in (1, 2, 3)
    }
    contexts = {
        node: Context(
            run_id=91,
            node_id=node,
            node_config={
                **holders.node_config(node - 1, tmp_path),
                NODE_CONFIG_KEY: str(holders.keys.secret),
                "partition-id": node - 1,
                "num-partitions": 3,
            },
            state=RecordDict(),
            run_config={},
        )
        for node in (1, 2, 3)
    }
    grid = Grid(handlers, contexts, 91)
    protocol = fedevalfair_protocol(config, load_public_context(holders.keys.public))
    assert protocol.dp == dp
    shard = app.load_shard_for(config, 0, 3, "test")
    arrays = ArrayRecord(get_arrays(build_model(shard.num_features, seed=config.seed)))
    outcome = protocol.start(grid, arrays, [1, 2, 3])  # type: ignore[arg-type]
    assert outcome.error is None, outcome
    for block in outcome.blocks:
        if block.mode == "paper":
            assert block.report is None and "not released" in str(block.reason)
        elif block.report is not None:
            assert block.report.k == 3 and "Holder-level DP" in block.report.common_disparity.method
            assert block.report.equivalence is not None
    for node in (1, 2, 3):
        shard = app.load_shard_for(config, node - 1, 3, "test")
        ledger = UserLedger.load(
            tmp_path / f"node-{node - 1}" / f"ledger-partition-{node - 1}.json"
        )
        [release] = ledger.releases
        assert (release.epsilon, release.delta) == (2.0, 1e-8)  # type: ignore[attr-defined]
        assert sorted(ledger.user_ids.tolist()) == sorted(shard.user_ids.tolist())  # type: ignore[union-attr]

    privacy = fedevalfair_privacy(config, outcome)
    assert privacy["differentially_private"] and privacy["noise_std"] == dp.noise_std  # type: ignore[union-attr]
    # each holder's ledger totals, after the charge, came back with its commitment: a new
    # ledger holding this release alone (basic composition: 2 at 1e-8)
    by_node = privacy["ledger_totals_by_node"]
    assert sorted(by_node) == ["1", "2", "3"] and privacy["new_ledger_nodes"] == [1, 2, 3]  # type: ignore[index]
    totals = privacy["ledger_totals_reported_by_nodes"]
    assert (totals["basic_epsilon"], totals["basic_delta"]) == (2.0, 1e-8)  # type: ignore[index]
    results = {
        "run_config": {"fef_variant": "trained", "fef_alpha": 0.05, "fef_mu0": 0.0},
        "num_nodes": 3,
        "primary_mode": "calibrated",
        "fedevalfair": outcome.to_dict(),
        "harness_plaintext": None,
        "max_abs_pvalue_difference_vs_plaintext": None,
        "server_context_has_secret_key": False,
        "privacy": privacy,
    }
    [warning] = fedevalfair_warnings(results)
    assert f"{dp.noise_std:.4g}" in warning and "epsilon = 2" in warning
    page = render_report(fedevalfair_report(results, tmp_path, None))
    assert "differentially private at the holder level" in page and f"{dp.noise_std:.4g}" in page
    assert "the same on each of the 3 nodes" in page and "New privacy ledger on node(s)" in page


# --- with the mode off, bit for bit what the code before it gave ------------------------------

CHILD = """
import importlib, json, sys
from pathlib import Path

editable = "__editable__"
sys.meta_path[:] = [f for f in sys.meta_path if editable not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if editable not in p]
sys.path_hooks[:] = [h for h in sys.path_hooks if "_Editable" not in repr(h)]
sys.path_importer_cache.clear()
folder = Path(sys.argv[1])
sys.path.insert(0, str(folder / "before"))

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
fef = importlib.import_module("fedparity.clients.fedevalfair")
handlers_module = importlib.import_module("fedparity.clients.fedevalfair_handlers")
strategy = importlib.import_module("fedparity.strategies.fedevalfair")
report = importlib.import_module("fedparity.server.report")
job = importlib.import_module("fedparity.server.fedevalfair_job")
html = importlib.import_module("fedparity.server.html_report")
ckks = importlib.import_module("fedparity.mechanisms.ckks")  # the old code: its path then
policy = importlib.import_module("fedparity.clients.policy")
assert fef.__file__.startswith(str(folder)), fef.__file__

inputs = json.loads((folder / "inputs.json").read_text())
data = np.load(folder / "inputs.npz")
mu0, tolerance = inputs["mu0"], inputs["tolerance"]
statistics = [fef.ClientStatistics.from_array(array) for array in data["statistics"]]
out = {}
out["round1"] = np.stack([fef.round1_vector(s, mu0=mu0, tolerance=tolerance) for s in statistics])
round1_sum = data["round1_sum"]
out["round2"] = np.stack(
    [fef.round2_payload(s, round1_sum, mu0=mu0, tolerance=tolerance) for s in statistics]
)
flooded = fef.flooded_round2_sum(
    round1_sum,
    data["scaled"],
    num_ciphertexts=3,
    parameters=ckks.CkksParameters(),
    key=b"k" * 32,
    message=b"a transcript",
)
out["flooded"] = flooded
out["release"] = fef.release_vector(handlers_module._release_reference(round1_sum), flooded)

def message(prefix, action):
    fields = {name[len(prefix):]: data[name] for name in data.files if name.startswith(prefix)}
    record = ArrayRecord({name: Array(array) for name, array in fields.items()})
    return Message(RecordDict({"fef": record}), dst_node_id=1, message_type="query." + action)

def holder(index):
    handlers = handlers_module.fedevalfair_handlers(
        None,
        secret_context=inputs["secret"],
        tolerance=tolerance,
        mu0=mu0,
        policy=policy.NodePrivacyPolicy(),
    )
    node_config = {
        "identity-key": inputs["identities"] + f"/node-{index}.key",
        "roster": inputs["identities"] + "/roster.toml",
        "ledger-dir": str(folder / f"child-ledgers-{index}"),
    }
    return handlers, Context(inputs["run_id"], index + 1, node_config, RecordDict(), {})

handlers, context = holder(1)
reply = handlers["fef_commit"](message("commit:", "fef_commit"), context)
out["commitment"] = reply.content.array_records["fef"]["commitment"].numpy()
np.savez(folder / "child.npz", **out)

public = ckks.load_public_context(inputs["public"])
protocol = strategy.FedEvalFairProtocol(public, alpha=0.05, mu0=mu0, tolerance=tolerance)
text = {}
for name in ("release", "handler_release"):
    blocks = protocol.reports(data["projected:" + name])
    outcome = strategy.FedEvalFairOutcome(blocks=blocks, **inputs["outcome"])
    results = {**inputs["results"], "fedevalfair": outcome.to_dict()}
    text[name] = {
        "outcome": json.dumps(outcome.to_dict(), sort_keys=True),
        "table": job.fedevalfair_table(outcome, "calibrated"),
        "findings": [finding.plain() for finding in report.fedevalfair_findings(results)],
        "warnings": report.fedevalfair_warnings(results),
        "page": html.render_report(report.fedevalfair_report(results, folder, None)),
    }
(folder / "child.json").write_text(json.dumps(text))
"""


def test_with_the_mode_off_the_outputs_are_bit_for_bit_those_of_the_code_before_it(
    holders: Holders, tmp_path: Path
) -> None:
    """The code of the commit before the DP mode (from git, in a subprocess) and today's with
    the mode off, on the same inputs: the round-1 and round-2 vectors and the commitment
    signature (over the same signed ciphertexts) are identical, and so are the server's
    reports, outcome, table, findings, warnings and HTML page from a release.

    Since the pooled disparity and the random-effects summary (issue 28) every vector also
    holds their slots, and the flooding noise, whose standard deviation grows with the
    number of slots, differs: the vectors are compared on the slots the old code had
    (:func:`old_layout`), the flooded sum and the release to the flooding noise, the old
    code's reports are made from today's release on the old slots, and today's outcome,
    findings and page without the new keys and lines. The old code cannot read today's
    ciphertexts, so the key holder's release of the real handlers is not compared."""
    from fedparity.server import report
    from fedparity.server.fedevalfair_job import fedevalfair_table
    from fedparity.server.html_report import render_report

    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs the git history of the repository")
    known = subprocess.run(
        [git, "cat-file", "-e", f"{BEFORE_DP_MODE}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if known.returncode != 0:
        pytest.skip(f"commit {BEFORE_DP_MODE} is not in this clone")
    before = tmp_path / "before" / "fedparity"
    before.mkdir(parents=True)
    archive = subprocess.run(
        [git, "archive", BEFORE_DP_MODE, "clients", "mechanisms", "strategies", "server"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)

    mu0, tolerance = 0.02, 0.05
    statistics = [holder_statistics(holders, node) for node in (1, 2, 3)]
    round1 = np.stack([round1_vector(s, mu0=mu0, tolerance=tolerance) for s in statistics])
    round1_sum = round1.sum(0)[:-1]
    round2 = np.stack(
        [round2_payload(s, round1_sum, mu0=mu0, tolerance=tolerance) for s in statistics]
    )
    scaled = round2.sum(0)[:-1]
    flooded = flooded_round2_sum(
        round1_sum,
        scaled,
        num_ciphertexts=3,
        parameters=CkksParameters(),
        key=b"k" * 32,
        message=b"a transcript",
    )
    mine = {
        "round1": round1,
        "round2": round2,
        "flooded": flooded,
        "release": release_vector(flooded, min_holders=2),
    }

    # The real handlers, today's code with the mode off: a run to the commitment, then holder
    # 2's commitment and holder 1's release on fresh nodes (the child does the same with its).
    grid = holder_grid(holders, 5, tmp_path / "ledgers", None, tolerance=tolerance)
    for node in grid.handlers:
        grid.handlers[node] = fedevalfair_handlers(
            rows_of,
            secret_context=holders.keys.secret,
            num_resamples=30,
            mu0=mu0,
            tolerance=tolerance,
            bootstrap_rng=lambda context: np.random.default_rng(context.node_id),
            policy=NodePrivacyPolicy(),
        )
    protocol = protocol_of(holders, None, mu0=mu0, tolerance=tolerance)
    first, second = through_round2(grid, protocol, [1, 2, 3])
    commit_request = protocol.commit_content(first.entries, second.entries)
    commitments = raw_commitments(grid.exchange("fef_commit", [1, 2, 3], commit_request))
    round3_request = protocol.round3_content(first.entries, second.entries, commitments)

    def fresh(index: int) -> tuple[dict, Context]:
        handlers = fedevalfair_handlers(
            None,
            secret_context=holders.keys.secret,
            mu0=mu0,
            tolerance=tolerance,
            policy=NodePrivacyPolicy(),
        )
        config = holders.node_config(index, tmp_path / "fresh")
        return handlers, Context(5, index + 1, config, RecordDict(), {})

    def request(content: RecordDict, action: str) -> Message:
        return Message(content, dst_node_id=1, message_type=f"query.{action}")

    handlers, context = fresh(1)
    reply = handlers["fef_commit"](request(commit_request, "fef_commit"), context)
    mine["commitment"] = reply.content.array_records[FEF_KEY]["commitment"].numpy()
    handlers, context = fresh(0)
    reply = handlers["fef_round3"](request(round3_request, "fef_round3"), context)
    mine["handler_release"] = reply.content.array_records[FEF_KEY]["release"].numpy()

    fields = {"statistics": np.stack([s.to_array() for s in statistics])}
    fields.update(round1_sum=old_layout(round1_sum, "round1"), scaled=old_layout(scaled, "round2"))
    for name in ("release", "handler_release"):
        fields["projected:" + name] = old_layout(mine[name], "release")
    for prefix, content in (("commit:", commit_request), ("round3:", round3_request)):
        for name, array in content.array_records[FEF_KEY].items():
            fields[prefix + name] = array.numpy()
    np.savez(tmp_path / "inputs.npz", **fields)
    outcome_fields = {
        "round_participants": [[1, 2, 3], [1, 2, 3], [1, 2]],
        "dropped": [[], [], []],
        "rejected": [],
        "unable": [],
        "key_holders": [1, 2],
        "uploaded_bytes": [{"1": 10}, {"1": 12}, {}],
        "ciphertexts_per_node": [1, 1, 0],
        "verifiers": [1, 2],
        "endorsers": [1],
        "committers": [1, 2, 3],
    }
    results = {
        "run_config": {"fef_variant": "trained", "fef_alpha": 0.05, "fef_mu0": mu0},
        "num_nodes": 3,
        "primary_mode": "calibrated",
        "harness_plaintext": None,
        "max_abs_pvalue_difference_vs_plaintext": 1.5e-7,
        "server_context_has_secret_key": False,
    }
    inputs = {
        "mu0": mu0,
        "tolerance": tolerance,
        "run_id": 5,
        "secret": str(holders.keys.secret),
        "public": str(holders.keys.public),
        "identities": str(holders.identities),
        "outcome": outcome_fields,
        "results": results,
    }
    (tmp_path / "inputs.json").write_text(json.dumps(inputs))
    (tmp_path / "child.py").write_text(textwrap.dedent(CHILD))
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    child = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    theirs = np.load(tmp_path / "child.npz")
    for name in ("round1", "round2"):
        assert np.array_equal(old_layout(mine[name], name), theirs[name]), name
    assert np.array_equal(mine["commitment"], theirs["commitment"])
    # The flooding noise is drawn for more slots today (std sqrt(d) times a bound): the two
    # flooded sums differ by two noises, each within 8 standard deviations (a slot's std in
    # natural units is the flooding std over the slot's round-2 scale) plus its rounding grid.
    bound = decryption_error_bound(
        CkksParameters(), num_ciphertexts=3, max_magnitude=float(np.max(np.abs(scaled)))
    )
    old_bound = decryption_error_bound(
        CkksParameters(),
        num_ciphertexts=3,
        max_magnitude=float(np.max(np.abs(old_layout(scaled, "round2")))),
    )
    stds = [
        flooding_std(bound, num_values=int((~_count_slots()).sum())),
        # the old protocol: 3 stage-1 parts and 7 sums besides the count slot per block
        flooding_std(old_bound, num_values=len(BLOCKS) * (3 + 7)),
    ]
    noise = sum(8 * std + 2.0 ** math.floor(math.log2(std)) for std in stds)
    scales = old_layout(round2_scales(round1_sum), "round2")
    difference = np.abs(old_layout(mine["flooded"], "round2") - theirs["flooded"])
    assert (difference <= noise / scales).all()
    # The release (Q, the sums, k) from them: to the largest of those noises.
    np.testing.assert_allclose(
        old_layout(mine["release"], "release"),
        theirs["release"],
        rtol=1e-6,
        atol=float(np.max(noise / scales)),
    )

    text = json.loads((tmp_path / "child.json").read_text())
    protocol = protocol_of(holders, None, alpha=0.05, mu0=mu0, tolerance=tolerance)
    for name in ("release", "handler_release"):
        blocks = protocol.reports(mine[name])
        outcome = FedEvalFairOutcome(blocks=blocks, **outcome_fields)  # type: ignore[arg-type]
        combined = {**results, "fedevalfair": outcome.to_dict()}
        # Today's release on the old slots is what the old code read, so the blocks agree
        # bit for bit once the new keys (pooled, random_effects) are set aside.
        assert (
            json.dumps(_without_new_keys(outcome.to_dict()), sort_keys=True)
            == (text[name]["outcome"])
        )
        assert fedevalfair_table(outcome, "calibrated") == text[name]["table"]
        findings = [finding.plain() for finding in report.fedevalfair_findings(combined)]
        assert [line for line in findings if not _new_line(line)] == text[name]["findings"]
        assert report.fedevalfair_warnings(combined) == text[name]["warnings"]
        page = render_report(report.fedevalfair_report(combined, tmp_path, None))
        # The page's style sheet gained a rule since (the run's description, issue 32); the
        # DP mode cannot change styling, so the pages are compared without their <style>.
        page = "\n".join(line for line in page.split("\n") if not _new_line(line))
        assert _without_style(page) == _without_style(text[name]["page"])


# --- the parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"fef-dp-epsilon": 0}, "fef-dp-epsilon must be in (0, inf)"),
        ({"fef-dp-epsilon": "x"}, "fef-dp-epsilon must be a number"),
        ({"fef-dp-delta": 1.0}, "fef-dp-delta must be in (0, 1)"),
        ({"fef-dp-max-weight": 0}, "fef-dp-max-weight must be in (0, inf)"),
        ({"fef-dp-epsilon": 1, "fef-mode": "paper"}, 'fef-mode must be "calibrated"'),
        (
            {"fef-dp-epsilon": 1, "task": "ldp-audit"},
            'fef-dp-epsilon is for task = "fedevalfair" or "pipeline"',
        ),
    ],
)
def test_the_dp_keys_are_checked_before_any_work(mapping: dict, message: str) -> None:
    from fedparity.clients.project.config import ConfigError, RunConfig

    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"task": "fedevalfair", **mapping})
    assert message in str(error.value)


def test_the_mode_is_off_by_default_and_its_parameters_name_their_range() -> None:
    from fedparity.clients.project.config import RunConfig

    assert RunConfig().fef_holder_dp is None
    assert RunConfig.from_mapping({"task": "fedevalfair"}).fef_holder_dp is None
    for bad, name in (
        ({"epsilon": 0.0, "delta": 1e-8}, "epsilon"),
        ({"epsilon": 1.0, "delta": 1.0}, "delta"),
        ({"epsilon": 1.0, "delta": 1e-8, "max_weight": -1.0}, "max_weight"),
        ({"epsilon": True, "delta": 1e-8}, "epsilon"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            HolderDP(**bad)  # type: ignore[arg-type]
    assert NodePrivacyPolicy().fef_dp_max_epsilon == 8.0
    assert (
        NodePrivacyPolicy.from_mapping({"fef-dp-max-epsilon": "2"}, source="t").fef_dp_max_epsilon
        == 2
    )
    with pytest.raises(ValueError, match="fef-dp-max-epsilon must be a number in"):
        NodePrivacyPolicy.from_mapping({"fef-dp-max-epsilon": 0}, source="t")
    with pytest.raises(ValueError, match="user_ids must be a 1-d array of integer user ids"):
        HolderRows(np.zeros(2), np.zeros(2), np.array([0, 1]), user_ids=np.array([0.5, 1.0]))


def old_layout(vector: np.ndarray, kind: str) -> np.ndarray:
    """A round-1 sum (``"round1"``, with or without its count slot), a round-2 vector or
    sum (``"round2"``) or a release (``"release"``) on the slots of the protocol before the
    pooled disparity and the random-effects summary (issue 28), along the last axis."""
    counts = ROUND1_FIELDS.index("sum_group0_rows")
    old_block = [*range(counts), BLOCK_WIDTH - 1]  # the moments, then the count slot
    if kind == "round1":
        keep = [b * BLOCK_WIDTH + i for b in range(len(BLOCKS)) for i in old_block]
    elif kind == "round2":
        split = len(BLOCKS) * STAGE1_WIDTH
        keep = [b * STAGE1_WIDTH + i for b in range(len(BLOCKS)) for i in range(3)]
        keep += [split + b * BLOCK_WIDTH + i for b in range(len(BLOCKS)) for i in old_block]
    else:
        keep = [
            b * RELEASE_WIDTH + i
            for b in range(len(BLOCKS))
            for i in [0, *(1 + j for j in old_block)]
        ]
    array = np.asarray(vector)
    if array.shape[-1] in (len(BLOCKS) * BLOCK_WIDTH + 1, ROUND2_SIZE):
        keep.append(array.shape[-1] - 1)  # the message's own count slot
    return array[..., keep]


def _without_new_keys(outcome: dict) -> dict:
    """A FedEvalFair outcome without the report keys issue 28 added."""
    copied = json.loads(json.dumps(outcome))
    for test in copied["tests"]:
        test.pop("comparison")  # the groups compared (d >= 2 groups), also issue 28
        if test["report"] is not None:
            test["report"].pop("pooled")
            test["report"].pop("random_effects")
    return copied


def _new_line(line: str) -> bool:
    """A headline line issue 28 added (the pooled disparity, what to do after stage 1)."""
    return "pooled disparity (every holder" in line or "after stage 1 (the holders" in line


def _without_style(page: str) -> str:
    """An HTML report page without its ``<style>`` element."""
    return re.sub(r"<style>.*?</style>", "<style></style>", page, count=1, flags=re.S)
