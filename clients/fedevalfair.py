"""Client side of the encrypted FedEvalFair protocol (the paper's Algorithms 1-2).

FedEvalFair: "FedEvalFair: A Privacy-Preserving and Statistically Grounded Federated Fairness
Evaluation Framework", anonymous authors, ACM Multimedia 2024 submission (anonymous review
version); the calibrated mode is fedparity's correction
(:mod:`fedparity.mechanisms.fairness_tests.fedevalfair`).

One protocol run tests every (metric, comparison) of its
:class:`~fedparity.mechanisms.protocol.FedEvalFairLayout` (default: dp and eo, group 0 vs group
1) in both modes (calibrated, paper): the (metric, comparison, mode) *blocks* travel side by
side in one CKKS ciphertext per message, so a client sends at most one ciphertext per round.

* Round 1 -- :func:`round1_vector`: per block the contribution
  ``[w_i, w_i Ybar_i, w_i Ybar_i^2, w_i^2 Var_i, 1]`` of
  :func:`fedparity.mechanisms.fairness_tests.fedevalfair.client_contribution`
  (zeros for a block the client cannot compute, e.g. eo without positives in a group), plus
  one message-count slot.
* Round 2 -- :func:`round2_vector`: decrypt the round-1 sum, compute the block's stage-1
  parts (:func:`fedparity.mechanisms.fairness_tests.fedevalfair.stage1_term`, 3 numbers), and send
  ``[parts, contribution again, 1]``: the fresh contribution sums give the estimate over the
  clients that are still there.
* Round 3 -- :func:`release_vector` (key holders only): decrypt both sums and release, per
  block, ``[stage-1 statistic, sum w, sum w Ybar, sum w Ybar^2, sum w^2 Var, k]`` over the
  round-2 clients. These numbers determine (T, W*, mu_hat, its standard error, k) plus
  sum w and sum w Ybar^2: the server learns the test statistics and nothing per client. A
  block fewer than the key holder's ``min-holders`` clients could compute is not released.

A holder that can compute no block takes part with weight 0 (zeros, count slot 1), in every
mode: whether it answers never depends on its data.
* The holder-level DP mode (``dp``, :mod:`fedparity.mechanisms.crypto.ckks.holder_dp`): the
  contributions carry capped, normalised weights (:meth:`ClientStatistics.contribution`), round
  2 has no stage-1 terms, and round 3 releases only the calibrated blocks' three sums with
  keyed Gaussian noise (:func:`dp_release_vector`).

Dropouts between rounds 1 and 2: every round-2 vector depends on the round-1 sum, hence on a
client that sent round 1 and not round 2 (the stage-1 terms are weighted at the round-1
centre c, u_i = 1 / V_i(c); the paper's T1 has 1 / (1 - omega_i) factors of the round-1
weights; every slot is scaled by a power of two of the round-1 sums, which the flooded
release's rounding grid shows). In the plain mode a key holder therefore releases only over
a round-2 set equal to round 1's (review 2026-11-28, L2); the holder-level DP mode releases
over the round-2 holders with its noise. The round-1 sum itself is never released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import tenseal as ts

from ..mechanisms.crypto.ckks import (
    CkksParameters,
    KeyMaterialError,
    append_count_slot,
    check_count_slot,
    check_magnitude,
    decrypt_vector,
    decryption_error_bound,
    flood,
    flooding_std,
)
from ..mechanisms.crypto.ckks.holder_dp import HolderDP, dp_block, dp_release
from ..mechanisms.fairness_tests.fedevalfair import (
    ROUND1_FIELDS,
    TAU2_GRID,
    BootstrapDisparity,
    ClientSummary,
    InsufficientGroupData,
    bootstrap_disparity,
    client_contribution,
    random_effects_release,
    stage1_statistic,
    stage1_term,
)
from ..mechanisms.protocol import (
    BLOCK_WIDTH,
    CORRUPT_SUM_MARKER,
    DEFAULT_LAYOUT,
    RANDOM_EFFECTS_WIDTH,
    RELEASE_WIDTH,
    STAGE1_WIDTH,
    FedEvalFairLayout,
)
from ..mechanisms.validation import check_int
from .shards import UserShard

if TYPE_CHECKING:
    import torch

#: Largest magnitude a decrypted sum may have (a sum under a foreign key decrypts to ~1e30).
MAX_MAGNITUDE = 1e12
#: Round-2 vectors are encrypted times 2^ROUND2_PRECISION_BITS (and, slot by slot, divided by
#: a power of two near the slot's natural size, :func:`round2_scales`): the CKKS noise then
#: sits far below the precision the test needs, which leaves room for the noise that floods
#: it before a key holder releases anything (:mod:`fedparity.mechanisms.crypto.ckks.flooding`).
ROUND2_PRECISION_BITS = 24
#: Slots of a round-1 block holding the group counts of the pooled disparity (scaled by their
#: own size in round 2), and the one counting the clients that sent them (an integer).
_COUNT_SLOTS = slice(
    ROUND1_FIELDS.index("sum_group0_rows"), ROUND1_FIELDS.index("sum_group0_rows") + 4
)
_COUNTED_SLOT = ROUND1_FIELDS.index("num_clients_with_counts")


class CorruptSumError(ValueError):
    """A returned encrypted sum does not decrypt to a valid aggregate.

    Some node encrypted under another key, or sent out-of-range values. Neither the server
    (no secret key) nor this node (it only sees the sum) can tell which node it was."""

    #: Its text is a fixed sentence (:func:`fedparity.clients.messages.fixed_error_texts`).
    fixed_text = True


@dataclass(frozen=True)
class ClientStatistics:
    """A client's summaries per block of ``layout`` (None where it cannot take part) and why
    not."""

    summaries: tuple[ClientSummary | None, ...]
    reasons: tuple[str, ...]
    #: The bootstraps per (metric, comparison) of the layout (None where impossible); kept on
    #: the node, never sent.
    bootstraps: tuple[BootstrapDisparity | None, ...] = ()
    #: The run's tests (which blocks the summaries are).
    layout: FedEvalFairLayout = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        if len(self.summaries) != len(self.layout.blocks):
            raise ValueError(
                f"summaries must have one entry per block of the layout "
                f"({len(self.layout.blocks)}), got {len(self.summaries)}"
            )

    @classmethod
    def empty(cls, layout: FedEvalFairLayout = DEFAULT_LAYOUT) -> ClientStatistics:
        """No block can be computed: weight 0 everywhere (a holder takes part with it, in
        every mode, instead of refusing: whether it answers says nothing about its data)."""
        return cls((None,) * len(layout.blocks), (), layout=layout)

    @property
    def is_empty(self) -> bool:
        """No block has a summary: the holder takes part with weight 0 in every block."""
        return all(summary is None for summary in self.summaries)

    def contribution(
        self, *, mu0: float, tolerance: float | None, dp: HolderDP | None = None
    ) -> np.ndarray:
        """The round-1 contribution for the run's ``fef-mu0`` and ``fef-tolerance`` (zeros
        for the blocks without a summary). With ``dp`` (the holder-level DP mode) the
        calibrated blocks are :func:`~fedparity.mechanisms.crypto.ckks.holder_dp.dp_block` (capped,
        normalised weights; count 1 whatever the data) and the paper blocks zeros with count 1
        (not released in that mode)."""
        if dp is not None:
            parts = []
            for summary, block in zip(self.summaries, self.layout.blocks, strict=True):
                if block.mode == "calibrated":
                    parts.append(
                        dp_block(summary, max_weight=dp.max_weight, mu0=mu0, tolerance=tolerance)
                    )
                else:
                    parts.append(np.append(np.zeros(BLOCK_WIDTH - 1), 1.0))
            return np.concatenate(parts)
        parts = [
            np.zeros(BLOCK_WIDTH)
            if summary is None
            else client_contribution(summary, block.mode, mu0=mu0, tolerance=tolerance)
            for summary, block in zip(self.summaries, self.layout.blocks, strict=True)
        ]
        return np.concatenate(parts)

    def to_array(self) -> np.ndarray:
        """(blocks x 6) [mean, variance, n, margins], NaN rows for missing blocks and NaN
        margins where a summary has none (node state)."""
        rows = [
            [math.nan] * 6
            if s is None
            else [s.mean, s.variance, float(s.n), *(s.margins or (math.nan,) * 3)]
            for s in self.summaries
        ]
        return np.asarray(rows, dtype=np.float64)

    @classmethod
    def from_array(
        cls, array: np.ndarray, layout: FedEvalFairLayout = DEFAULT_LAYOUT
    ) -> ClientStatistics:
        """The statistics :meth:`to_array` wrote, for the blocks of ``layout``."""
        summaries: list[ClientSummary | None] = []
        for row in np.asarray(array, dtype=np.float64):
            if not np.isfinite(row[:3]).all():
                summaries.append(None)
                continue
            margins = None if not np.isfinite(row[3:]).all() else tuple(int(v) for v in row[3:])
            summaries.append(ClientSummary(row[0], row[1], int(row[2]), margins))  # type: ignore[arg-type]
        return cls(tuple(summaries), (), layout=layout)


def bootstrap_seed(seed: int, partition_id: int) -> np.random.SeedSequence:
    """The bootstrap's randomness (not a privacy mechanism: seeded for reproducibility)."""
    return np.random.SeedSequence([seed, partition_id, 0xFEF])


def holder_predictions(
    model: torch.nn.Module, shard: UserShard, variant: str, rng: np.random.Generator
) -> np.ndarray:
    """0/1 predictions of the global model (``"trained"``), or of its fair-by-construction
    variant (``"fair"``): Bernoulli(p) with p the model's mean predicted probability on this
    test set, drawn independently of every feature, so P(Yhat = 1 | A) does not depend on A."""
    import torch  # the model's round only: the other FedEvalFair messages load no torch

    model.eval()
    with torch.no_grad():
        scores = torch.sigmoid(model(torch.from_numpy(shard.features)).reshape(-1)).numpy()
    if variant == "trained":
        return (scores >= 0.5).astype(np.int64)
    if variant == "fair":
        rate = float(scores.mean()) if scores.size else 0.5
        return (rng.random(shard.num_samples) < rate).astype(np.int64)
    raise ValueError(f"variant must be 'trained' or 'fair', got {variant!r}")


def client_statistics(
    shard: UserShard,
    predictions: np.ndarray,
    *,
    num_resamples: int,
    rng: np.random.Generator,
    min_cell_count: int,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> ClientStatistics:
    """:func:`rows_statistics` of a :class:`~fedparity.clients.shards.UserShard` (every row's
    group is its user's group)."""
    return rows_statistics(
        shard.labels,
        predictions,
        shard.user_groups[shard.user_index],
        num_resamples=num_resamples,
        rng=rng,
        min_cell_count=min_cell_count,
        layout=layout,
    )


def rows_statistics(
    labels: np.ndarray,
    predictions: np.ndarray,
    groups: np.ndarray,
    *,
    num_resamples: int,
    rng: np.random.Generator,
    min_cell_count: int,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> ClientStatistics:
    """Bootstrap every (metric, comparison) of ``layout`` (default dp and eo, group 0 vs
    group 1) on the holder's test set, in the layout's order; summaries for both modes.

    A metric whose smallest margin (:attr:`BootstrapDisparity.smallest_margin`: the two group
    sizes and the numbers of rows predicted positive and negative, among the rows it averages
    over) has fewer than ``min_cell_count`` rows is not reported by this client: the normal
    approximation needs some rows of each. The rule looks at the margins only, never at the
    joint (group, prediction) cells: the calibrated test conditions on the margins, and a rule
    on the joint cells would select holders by their disparity and bias the test (FedEvalFair
    guide, "fef-min-cell").
    When no block can be computed every summary is None (:attr:`ClientStatistics.is_empty`,
    the reasons in ``reasons``): the holder takes part with weight 0, never refuses -- whether
    it could compute a metric is a predicate of its data that the server steers (the model,
    ``fef-min-cell``), review 2026-11-28 M1.
    """
    summaries: list[ClientSummary | None] = []
    reasons: list[str] = []
    bootstraps: list[BootstrapDisparity | None] = []
    for metric, comparison in layout.tests:
        boot = None
        try:
            boot = bootstrap_disparity(
                predictions,
                labels,
                groups,
                metric=metric,
                comparison=comparison,
                num_resamples=num_resamples,
                rng=rng,
            )
            if boot.smallest_margin < min_cell_count:
                raise InsufficientGroupData(
                    f"smallest margin (group size or prediction count) has "
                    f"{boot.smallest_margin} row(s), fewer than fef-min-cell = {min_cell_count}"
                )
            pair: list[ClientSummary | None] = [boot.summary("calibrated"), boot.summary("paper")]
        except InsufficientGroupData as error:
            pair = [None, None]
            which = metric if layout.num_groups == 2 else f"{metric} {comparison}"
            reasons.append(f"{which}: {error}")
        summaries.extend(pair)
        bootstraps.append(boot)
    return ClientStatistics(tuple(summaries), tuple(reasons), tuple(bootstraps), layout)


def holder_statistics(
    shard: UserShard,
    model: torch.nn.Module,
    *,
    seed: int,
    partition_id: int,
    variant: str,
    num_resamples: int,
    min_cell_count: int,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> ClientStatistics:
    """A holder's round-1 statistics from the global model: predictions (``variant``) and
    the bootstrap, both from the holder's seeded stream (:func:`bootstrap_seed`). The
    ClientApp and the simulation harness both call this, so they agree by construction
    (weight 0 where a block cannot be computed, as :func:`rows_statistics`)."""
    rng = np.random.default_rng(bootstrap_seed(seed, partition_id))
    predictions = holder_predictions(model, shard, variant, rng)
    return client_statistics(
        shard,
        predictions,
        num_resamples=num_resamples,
        rng=rng,
        min_cell_count=min_cell_count,
        layout=layout,
    )


def round1_vector(
    statistics: ClientStatistics,
    *,
    mu0: float,
    tolerance: float | None,
    dp: HolderDP | None = None,
) -> np.ndarray:
    """What a client encrypts in round 1: [contribution, 1] (``dp``: the holder-level DP
    mode's contribution, :meth:`ClientStatistics.contribution`)."""
    return append_count_slot(statistics.contribution(mu0=mu0, tolerance=tolerance, dp=dp))


def open_sum(
    context: ts.Context,
    payload: bytes,
    size: int,
    count: int,
    *,
    max_magnitude: float = MAX_MAGNITUDE,
) -> np.ndarray:
    """Decrypt a sum, check its magnitude and message-count slot; return it without the slot.

    Raises :class:`CorruptSumError` (fixed message: no decrypted value leaves the node) when
    the payload is not a ciphertext of ``size`` slots under this key, decrypts to a value
    beyond ``max_magnitude`` or non-finite, or its count slot is not ``count``. ``count`` must
    come from the holder's own verification of the sum's signed contributors
    (:mod:`fedparity.mechanisms.crypto.ckks.signing`), never from the server.
    """
    try:
        decrypted = decrypt_vector(context, payload, expected_size=size)
        checked = check_magnitude(decrypted, max_magnitude=max_magnitude, name="decrypted sum")
        return check_count_slot(checked, count)
    except KeyMaterialError:
        raise  # this node's own key file is wrong: not the sum's fault
    except ValueError:
        raise CorruptSumError(
            f"{CORRUPT_SUM_MARKER}: it does not decrypt to the sum of {count} contribution(s) "
            "(a node encrypted under another key or sent out-of-range values)"
        ) from None


def _blocks(vector: np.ndarray, layout: FedEvalFairLayout) -> list[np.ndarray]:
    return [vector[i * BLOCK_WIDTH : (i + 1) * BLOCK_WIDTH] for i in range(len(layout.blocks))]


def round2_vector(
    statistics: ClientStatistics,
    round1_sum: np.ndarray,
    *,
    mu0: float,
    tolerance: float | None,
    dp: HolderDP | None = None,
) -> np.ndarray:
    """Round 2: [stage-1 parts (3 per block), contribution, 1] given the decrypted S1. In the
    holder-level DP mode (``dp``) the stage-1 parts are zeros (the round-1 sum has no
    variance sums, and stage 1 comes from the released sums) and the contribution is the DP
    one."""
    parts = []
    layout = statistics.layout
    for summary, totals, block in zip(
        statistics.summaries, _blocks(round1_sum, layout), layout.blocks, strict=True
    ):
        usable = summary is not None and totals[-1] >= 1.5 and totals[0] > 0 and totals[3] > 0
        usable = usable and dp is None  # DP: stage 1 comes from the released sums
        parts.append(
            stage1_term(summary, totals, block.mode)
            if usable and summary is not None
            else np.zeros(STAGE1_WIDTH)
        )
    fresh = statistics.contribution(mu0=mu0, tolerance=tolerance, dp=dp)
    return append_count_slot(np.concatenate([*parts, fresh]))


def round2_scales(round1_sum: np.ndarray, layout: FedEvalFairLayout = DEFAULT_LAYOUT) -> np.ndarray:
    """The factor of every round-2 slot (count slot excluded) before encryption.

    Per block, with ``a`` the binary exponent of the block's round-1 sum of weights (every
    holder and the key holders decrypt the same round-1 sum, so they agree on it): the
    stage-1 parts ``[sum u (Y - c)^2, sum u, sum u (Y - c)]`` get ``[1, 2^-a, 2^-(a // 2)]``
    (the paper's ``[T1, 0, 0]`` gets ``[2^-(a // 2), ...]``: T1 grows with its weights) and
    the contribution ``[w, w Y, w Y^2, w^2 Var, w^2 V x 3, count]`` gets
    ``[2^-a, 2^-(a // 2), 2^-a x 5, 1]``: every slot lands near its own precision need (sums of
    weights relative, sum w Y relative to sqrt(sum w), Q absolute), so that one flooding noise
    fits all of them. Everything but the count slots is then multiplied by
    2^:data:`ROUND2_PRECISION_BITS`. Powers of two: scaling and unscaling are exact.
    """
    precision = 2.0**ROUND2_PRECISION_BITS
    parts, contributions = [], []
    totals_per_block = _blocks(np.asarray(round1_sum, dtype=np.float64), layout)
    for totals, (_, mode, _) in zip(totals_per_block, layout.blocks, strict=True):
        exponent = _exponent(float(totals[0]))
        full, half = 2.0**-exponent, 2.0 ** -(exponent // 2)
        # The paper's T1 grows with its weights n_i / S_i^2 (often 1e3-1e4): it needs relative
        # precision only, and left unscaled it would set the decoding error of every slot.
        first = half if mode == "paper" else 1.0
        # Per tau^2 t of the grid: [sum w (Y - c)^2, sum w, sum w (Y - c), sum w Y] as the
        # stage-1 parts, sum w Y relative to sum w (the random-effects mean), with the sum of
        # weights at t bounded by min(sum w(0), k / t) (w(t) = 1 / (V + t) <= 1 / t).
        count = max(float(totals[-1]), 1.0)
        grid = []
        for point in TAU2_GRID:
            bound = float(totals[0]) if point == 0.0 else min(float(totals[0]), count / point)
            at = _exponent(bound)
            grid.extend([1.0, 2.0**-at, 2.0 ** -(at // 2), 2.0**-at])
        parts.append(np.concatenate([[first, full, half, full * full], grid]) * precision)
        contribution = np.full(BLOCK_WIDTH, full * precision)
        contribution[1] = half * precision
        # The group counts: each relative to its own round-1 total.
        contribution[_COUNT_SLOTS] = [
            2.0 ** -_exponent(float(total)) * precision for total in totals[_COUNT_SLOTS]
        ]
        contribution[_COUNTED_SLOT] = 1.0
        contribution[-1] = 1.0
        contributions.append(contribution)
    return np.concatenate([*parts, *contributions])


def _exponent(value: float) -> int:
    """The binary exponent of ``value`` (0 for values <= 1 or not finite)."""
    return math.frexp(value)[1] if value > 1.0 and math.isfinite(value) else 0


def round2_payload(
    statistics: ClientStatistics,
    round1_sum: np.ndarray,
    *,
    mu0: float,
    tolerance: float | None,
    dp: HolderDP | None = None,
) -> np.ndarray:
    """What a holder encrypts in round 2: :func:`round2_vector` scaled by
    :func:`round2_scales` (count slot 1)."""
    vector = round2_vector(statistics, round1_sum, mu0=mu0, tolerance=tolerance, dp=dp)
    return np.append(vector[:-1] * round2_scales(round1_sum, statistics.layout), vector[-1])


def _count_slots(layout: FedEvalFairLayout = DEFAULT_LAYOUT) -> np.ndarray:
    """Mask of the per-block count slots (the clients, and those that sent group counts) in a
    round-2 sum without its count slot."""
    mask = np.zeros(len(layout.blocks) * (STAGE1_WIDTH + BLOCK_WIDTH), dtype=bool)
    split = len(layout.blocks) * STAGE1_WIDTH
    mask[split + BLOCK_WIDTH - 1 :: BLOCK_WIDTH] = True
    mask[split + _COUNTED_SLOT :: BLOCK_WIDTH] = True
    return mask


def flooded_round2_sum(
    round1_sum: np.ndarray,
    scaled_round2_sum: np.ndarray,
    *,
    num_ciphertexts: int,
    parameters: CkksParameters,
    key: bytes,
    message: bytes,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """The round-2 sum a key holder may release from, in natural units.

    ``scaled_round2_sum`` is the decrypted round-2 sum (count slot removed) of
    ``num_ciphertexts`` ciphertexts made by :func:`round2_payload`. The per-block count slots
    (integers, error far below 1/2) are rounded to integers; every other slot gets the keyed
    flooding noise of :func:`fedparity.mechanisms.crypto.ckks.flood` -- standard deviation
    :func:`~fedparity.mechanisms.crypto.ckks.flooding_std` of the
    :func:`~fedparity.mechanisms.crypto.ckks.decryption_error_bound` of this sum -- and is then
    divided by its :func:`round2_scales` factor.
    """
    raw = np.asarray(scaled_round2_sum, dtype=np.float64)
    counts = _count_slots(layout)
    bound = decryption_error_bound(
        parameters, num_ciphertexts=num_ciphertexts, max_magnitude=float(np.max(np.abs(raw)))
    )
    std = flooding_std(bound, num_values=int((~counts).sum()))
    result = raw.copy()
    result[~counts] = flood(raw[~counts], std=std, key=key, message=message)
    result[counts] = np.round(raw[counts])
    return result / round2_scales(round1_sum, layout)


def dp_release_vector(
    round2_sum: np.ndarray,
    *,
    num_holders: int,
    dp: HolderDP,
    key: bytes,
    message: bytes,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """Round 3 (key holder) in the holder-level DP mode: from the (flooded, natural-unit)
    round-2 sum, the calibrated blocks' sums of the DP contributions with the keyed Gaussian
    noise of :func:`~fedparity.mechanisms.crypto.ckks.holder_dp.dp_release`; NaN where nothing is
    released. ``num_holders``: the round-2 holders (public)."""
    split = len(layout.blocks) * STAGE1_WIDTH
    return dp_release(
        np.asarray(round2_sum, dtype=np.float64)[split:],
        num_holders=num_holders,
        dp=dp,
        key=key,
        message=message,
        layout=layout,
    )


def release_vector(
    round2_sum: np.ndarray,
    layout: FedEvalFairLayout = DEFAULT_LAYOUT,
    *,
    min_holders: int,
) -> np.ndarray:
    """Round 3 (key holder, plain mode, a round-2 set equal to round 1's): per block
    [stage-1 statistic, round-2 sums of the contribution, random-effects summary], from the
    decrypted round-2 sum without its count slot.

    The random-effects summary (a calibrated block of >= 2 holders;
    :func:`~fedparity.mechanisms.fairness_tests.fedevalfair.random_effects_release`: tau^2,
    its Q-profile interval, the random-effects mean and its sum of weights) comes from the
    round-2 grid sums, which are never released themselves; NaN where there is none.
    ``min_holders``: the key holder's policy; a block fewer round-2 holders could compute is
    released as NaN whole (with weight-0 holders in the sets, the sets' size no longer bounds
    a block's, and a run of one holder and weight-0 ones would release that holder's sums).
    """
    min_holders = check_int("min_holders", min_holders, minimum=1)
    num_blocks = len(layout.blocks)
    split = num_blocks * STAGE1_WIDTH
    parts = [round2_sum[i * STAGE1_WIDTH : (i + 1) * STAGE1_WIDTH] for i in range(num_blocks)]
    fresh = _blocks(round2_sum[split:], layout)
    released = []
    for index, (_, mode, _) in enumerate(layout.blocks):
        now = fresh[index]
        holders = int(round(now[-1]))
        if holders < min_holders:
            released.append(np.full(RELEASE_WIDTH, math.nan))
            continue
        total = stage1_statistic(parts[index], mode) if now[0] > 0 else 0.0
        effects = np.full(RANDOM_EFFECTS_WIDTH, math.nan)
        if mode == "calibrated" and now[0] > 0 and holders >= 2:
            try:
                effects = random_effects_release(parts[index], holders)
            except ValueError:
                pass  # a sum of weights not > 0: no random-effects summary
        released.append(np.concatenate([[total], now, effects]))
    return np.concatenate(released)
