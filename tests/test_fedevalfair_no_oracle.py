"""FedEvalFair in plain mode: nothing the server steers answers a question about one holder's
data (security review 2026-11-28: M1, L2 and FedEvalFair's half of L1).

* **M1.** Round 1 refused ("cannot take part") when the holder's rows gave no metric with every
  margin at least ``fef-min-cell``. The model and ``fef-min-cell`` are the server's, nothing
  was charged and it could be asked again: runs with "predict 1 iff age > t" binary-searched a
  holder's oldest users' ages. A holder now takes part with weight 0 in every mode, its reply
  the same records, shapes and ciphertext size as anyone's; a key holder releases no block
  fewer than its ``min-holders`` holders could compute (else a run of the target and weight-0
  holders released the target's sums alone); ``fef-min-cell`` has a floor in the node's policy.
* **L2.** With a round-2 set smaller than round 1's, every round-2 term was weighted at the
  round-1 centre, which includes the holder left out: the released stage-1 statistic moved
  with that holder's data, and the paper's T1 came back NaN exactly when it had computed the
  block. Now neither is released when the sets differ (the rule is the sets', public).
* **L1.** In the holder-level DP mode a holder is charged at its commitment; a server that
  never asks for round 3 releases nothing while every committed holder's users paid. The
  cost of one drained run is measured here against what docs/threat-model.md states.

Everything runs the real handlers (the project's ClientApp object on a node's own data file,
and the library's holders), real TenSEAL keys and ciphertexts, real ledgers, the built-in
node policy unless a test says otherwise, and the server's protocol over an in-process grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
from scipy import stats

from fedparity.clients import HolderRows, fedevalfair_handlers
from fedparity.clients.app import app, fef_round1
from fedparity.clients.fedevalfair import ClientStatistics, rows_statistics
from fedparity.clients.fedevalfair_handlers import (
    DP_LEDGER_REFUSAL,
    FEF_STATE_KEY,
    SMALLER_ROUND2_REFUSAL,
)
from fedparity.clients.messages import session_state_key
from fedparity.clients.policy import NodePrivacyPolicy, PolicyRefusal
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.mechanisms.crypto.ckks import (
    NODE_CONFIG_KEY,
    HolderDP,
    KeyPaths,
    ReleaseJournal,
    contributors_digest,
    load_public_context,
)
from fedparity.mechanisms.crypto.ckks.holder_dp import released_blocks
from fedparity.mechanisms.privacy.user_ledger import ApproximateDPRelease, UserLedger
from fedparity.mechanisms.protocol import (
    BLOCK_WIDTH,
    BLOCKS,
    FEF_KEY,
    RELEASE_WIDTH,
    ROUND1_SIZE,
    ROUND2_SIZE,
)
from fedparity.server.cli.identity import write_node_identities
from fedparity.strategies.fedevalfair import FedEvalFairOutcome, FedEvalFairProtocol
from tests.support.handler_grid import HandlerGrid

pytestmark = pytest.mark.usefixtures("task_identity")

#: Library holders 1..4 (holder 4 is the target in the server-side tests).
NUM_HOLDERS = 4
ROWS = 400
DP = HolderDP(epsilon=1.0, delta=1e-8, max_weight=100.0)
#: A test statistic outside its central 1 - 2e-4 fails.
TAIL = 1e-4
#: How far two releases of the same sums may be apart: the keyed flooding noise (about 1e-8
#: relative, docs/threat-model.md), with the margin tests/test_fedevalfair_holder_dp.py uses.
FLOODING = {"rtol": 1e-4, "atol": 1e-3}


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_node_identities(tmp_path_factory.mktemp("identities"), NUM_HOLDERS)


def node_config(keys: KeyPaths, identities: Path, index: int, ledgers: Path) -> dict[str, object]:
    return {
        "identity-key": str(identities / f"node-{index}.key"),
        "roster": str(identities / "roster.toml"),
        NODE_CONFIG_KEY: str(keys.secret),
        "ledger-dir": str(ledgers / f"node-{index}"),
    }


def structure(reply: Message) -> str:
    """Everything of a round-1 reply but the ciphertext's bytes and length, as text: error or
    not, the record names of each kind, and every array's name, dtype and shape (the
    ciphertext's number of dimensions; its length is compared statistically)."""
    if reply.has_error():
        return f"error: {reply.error.reason}"
    content = reply.content
    arrays = {
        name: sorted(
            (key, str(array.dtype), array.ndim if key == "ciphertext" else array.shape)
            for key, array in ((k, v.numpy()) for k, v in record.items())
        )
        for name, record in content.array_records.items()
    }
    records = [sorted(content.array_records), sorted(content.config_records)]
    return f"reply: {records} {sorted(content.metric_records)} {sorted(arrays.items())}"


def ciphertext_size(reply: Message) -> int:
    return int(reply.content.array_records[FEF_KEY]["ciphertext"].numpy().size)


# --- M1 through the project's ClientApp: the review's binary search ------------------------


def ages_file(path: Path, ages: np.ndarray) -> Path:
    """A holder's own data file: one user per row, groups alternating, features age and
    hours (the review's demo)."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 2, ages.size)
    rows = [
        f"{user},{user % 2},{label},{age},{40 + user % 7}"
        for user, (label, age) in enumerate(zip(labels, ages, strict=True))
    ]
    path.write_text("\n".join(["user,group,label,age,hours", *rows]) + "\n", encoding="utf-8")
    return path


def threshold_model(t: float) -> ArrayRecord:
    """The server's logistic regression "predict 1 iff age > t" (ages are integers)."""
    weight = np.array([[10.0, 0.0]], dtype=np.float32)
    bias = np.array([-10.0 * (t + 0.5)], dtype=np.float32)
    arrays = get_arrays(build_model(2, seed=0))
    assert [a.shape for a in arrays] == [weight.shape, bias.shape]
    return ArrayRecord([weight, bias])


ATTACK_RUN = {"task": "fedevalfair", "fef-resamples": 20, "fef-min-cell": 5}


class Holder:
    """A project-app holder with its own data file; every probe is a new run (fresh state,
    new run id) that sends only ``query.fef_round1``, as the review's demo did."""

    def __init__(self, config: dict[str, object]) -> None:
        self.config = config
        self.runs = 0

    def probe(self, t: float, run: dict[str, object] = ATTACK_RUN) -> Message:
        self.runs += 1
        message = Message(
            RecordDict({"arrays": threshold_model(t)}),
            dst_node_id=7,
            message_type="query.fef_round1",
        )
        message.metadata.__dict__["_message_id"] = f"probe-{self.runs}"
        context = Context(self.runs, 7, dict(self.config), RecordDict(), dict(run))
        try:
            return app(message, context)
        except Exception as refusal:  # noqa: BLE001 - Flower sends any error back as this
            return Message(Error(code=0, reason=str(refusal)), reply_to=message)


def binary_search(holder: Holder) -> tuple[int, list[str]]:
    """The review's attack: "answered" is "some metric has every margin >= fef-min-cell",
    true for t below the 5th-oldest user's age and false from it on; bisect [50, 128) for the
    first refused t. Returns what the attack concludes and the structure of every reply."""
    seen: list[str] = []

    def answered(t: int) -> bool:
        reply = holder.probe(t)
        seen.append(structure(reply))
        return not reply.has_error()

    low, high = 50, 128
    assert answered(low)
    answered(high)  # refused on the reviewed main; the search goes on either way
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if answered(middle) else (low, middle)
    return high, seen


def test_the_binary_search_on_round1_learns_nothing_about_a_holders_ages(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """Two holders of 60 users whose 5th-oldest users are 75 and 68. On the reviewed main the
    binary search over 9 runs returned each one's 5th-oldest age exactly (with fef-min-cell =
    1, the oldest; the built-in floor is now 5). Now every probe of both holders is answered
    with the same reply structure, so the search's answer is the same for both and says
    nothing: the probes carry no bit. Nothing is charged (the ledger folder stays empty)."""
    found, transcripts = {}, {}
    fifth_oldest = {}
    for index, top in enumerate((79, 72)):
        ages = np.arange(top - 59, top + 1)
        fifth_oldest[index] = int(np.sort(ages)[-5])
        ledgers = tmp_path / f"ledgers-{index}"
        config = {
            **node_config(ckks_keys, identities, index, ledgers),
            "data-file": str(ages_file(tmp_path / f"ages-{index}.csv", ages)),
            "num-groups": 2,
            "partition-id": 0,
            "num-partitions": 1,
        }
        found[index], transcripts[index] = binary_search(Holder(config))
        assert not ledgers.exists() or not any(ledgers.rglob("*.json"))
    assert fifth_oldest == {0: 75, 1: 68}  # the secret the attack is after
    assert [len(seen) for seen in transcripts.values()] == [9, 9]  # the review's 9 runs
    assert transcripts[0] == transcripts[1]  # every probe of either holder looks the same
    assert len({item for seen in transcripts.values() for item in seen}) == 1
    assert transcripts[0][0].startswith("reply: [['fef']")
    assert found[0] == found[1] == 128  # the search's answer is its own bound, not an age


def test_a_fef_min_cell_below_the_nodes_floor_is_refused_before_any_data_is_read(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """``fef-min-cell`` is the server's; the node's policy sets a floor (built-in 5,
    simulation 0). Below it round 1 is refused in one line naming the run's value, the floor
    and which side to change, before the data file is opened (here it does not exist, so
    reading it would fail otherwise); at the floor the same node goes on to read it. The
    library holder refuses a ``min_cell_count`` below the floor before its rows are read."""
    config = {
        **node_config(ckks_keys, identities, 0, tmp_path),
        "data-file": str(tmp_path / "no-such-data.csv"),
        "num-groups": 2,
        "partition-id": 0,
        "num-partitions": 1,
    }
    message = Message(
        RecordDict({"arrays": threshold_model(50)}), dst_node_id=1, message_type="query.fef_round1"
    )
    context = Context(1, 1, config, RecordDict(), {})
    below = RunConfig.from_mapping({**ATTACK_RUN, "fef-min-cell": 4})
    with pytest.raises(PolicyRefusal) as refusal:
        fef_round1(message, context, below)
    text = str(refusal.value)
    assert "\n" not in text
    assert "fef-min-cell = 4 (the run config)" in text and "fef-min-cell-floor = 5" in text
    assert "raise fef-min-cell to at least 5" in text and "node's policy" in text
    with pytest.raises(Exception, match="no-such-data") as error:
        fef_round1(message, context, RunConfig.from_mapping(ATTACK_RUN))
    assert not isinstance(error.value, PolicyRefusal)
    # the floor is the node's: a node config key, 0 in simulation, an integer >= 0
    with pytest.raises(Exception, match="no-such-data"):
        fef_round1(
            message, Context(1, 1, {**config, "fef-min-cell-floor": 0}, RecordDict(), {}), below
        )
    assert NodePrivacyPolicy().fef_min_cell_floor == 5
    assert NodePrivacyPolicy.simulation().fef_min_cell_floor == 0
    with pytest.raises(ValueError, match="fef-min-cell-floor must be an integer >= 0"):
        NodePrivacyPolicy.from_mapping({"fef-min-cell-floor": -1}, source="t")

    reads: list[int] = []

    def rows(arrays: ArrayRecord, context: Context) -> HolderRows:
        reads.append(context.node_id)
        return library_rows(arrays, context)

    library = fedevalfair_handlers(
        rows, secret_context=ckks_keys.secret, num_resamples=20, min_cell_count=2
    )["fef_round1"]
    with pytest.raises(PolicyRefusal, match="min_cell_count of fedevalfair_handlers"):
        library(library_message(0.0), Context(1, 1, config, RecordDict(), {}))
    assert reads == []


# --- M1 with the library's holders: the reply's structure, and the server's side -----------


def library_rows(arrays: ArrayRecord, context: Context) -> HolderRows:
    """Holder ``node``'s 400 rows: both groups, predictions from the message's "shift" (0:
    the model predicts both classes in both groups; 2: it predicts 1 everywhere, so no metric
    has a margin of predicted negatives: the holder can compute nothing). Holder 4 (the
    target) has a strong disparity of its own."""
    shift = float(arrays["shift"].numpy()[0]) if "shift" in arrays else 0.0
    node = context.node_id
    rng = np.random.default_rng(1000 + node)
    groups = np.arange(ROWS) % 2
    labels = rng.integers(0, 2, ROWS)
    rate = 0.4 + 0.1 * groups if node != 4 else np.where(groups == 0, 0.8, 0.1)
    predictions = (rng.random(ROWS) < rate + shift).astype(int)
    return HolderRows(labels, predictions, groups, user_ids=1000 * node + np.arange(ROWS))


def library_message(shift: float) -> Message:
    content = RecordDict({"arrays": ArrayRecord({"shift": Array(np.array([shift]))})})
    return Message(content, dst_node_id=1, message_type="query.fef_round1")


def library_handlers(
    keys: KeyPaths,
    dp: HolderDP | None,
    policy: NodePrivacyPolicy | None = None,
    rows: Callable[[ArrayRecord, Context], HolderRows] = library_rows,
) -> dict:
    return fedevalfair_handlers(
        rows,
        secret_context=keys.secret,
        num_resamples=30,
        bootstrap_rng=lambda context: np.random.default_rng(context.node_id),
        policy=policy or NodePrivacyPolicy(),
        dp=dp,
    )


@pytest.mark.parametrize("dp", [None, DP], ids=["plain", "holder-dp"])
def test_a_holder_that_can_compute_no_metric_replies_like_one_that_can(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path, dp: HolderDP | None
) -> None:
    """The same holder, two models: one it can compute both metrics for, one it can compute
    none for (everything predicted positive). In both modes the round-1 replies have the same
    record names, keys, dtypes and shapes, and their ciphertext sizes (compressed
    serialisations of fresh encryptions, which vary with the encryption's randomness) are
    one distribution: a Mann-Whitney test of 30 replies each does not tell them apart at
    1e-4. The holder that can compute nothing sent weight 0 in every block."""
    handler = library_handlers(ckks_keys, dp)["fef_round1"]
    replies: dict[float, list[Message]] = {0.0: [], 2.0: []}
    for run in range(30):
        for shift in replies:
            context = Context(
                run, 1, node_config(ckks_keys, identities, 0, tmp_path), RecordDict(), {}
            )
            replies[shift].append(handler(library_message(shift), context))
            statistics = ClientStatistics.from_array(
                context.state.array_records[session_state_key(FEF_STATE_KEY, "")][
                    "summaries"
                ].numpy()
            )
            assert statistics.is_empty == (shift == 2.0)
    shapes = {structure(reply) for replies_of in replies.values() for reply in replies_of}
    assert len(shapes) == 1 and next(iter(shapes)).startswith("reply: [['fef']"), shapes
    sizes = {shift: [ciphertext_size(reply) for reply in found] for shift, found in replies.items()}
    assert stats.mannwhitneyu(sizes[0.0], sizes[2.0]).pvalue > TAIL, sizes
    # the sizes do vary with the encryption's randomness (so "within" is a distribution)
    assert len(set(sizes[0.0])) > 1


def grid_of(
    keys: KeyPaths,
    identities: Path,
    ledgers: Path,
    run_id: int,
    dp: HolderDP | None = None,
    *,
    rows: dict[int, Callable[[ArrayRecord, Context], HolderRows]] | None = None,
    policy: NodePrivacyPolicy | None = None,
    drop: Callable[[str, int], bool] | None = None,
) -> HandlerGrid:
    """The library holders 1..4, each with its own ledger folder, through an in-process grid
    (``rows``: a holder's own rows function, default :func:`library_rows`)."""
    handlers = {
        node: library_handlers(keys, dp, policy, (rows or {}).get(node, library_rows))
        for node in range(1, NUM_HOLDERS + 1)
    }
    contexts = {
        node: Context(
            run_id, node, node_config(keys, identities, node - 1, ledgers), RecordDict(), {}
        )
        for node in range(1, NUM_HOLDERS + 1)
    }
    return HandlerGrid(
        lambda node, action: handlers[node][action], contexts, run_id=run_id, drop=drop
    )


def run(
    keys: KeyPaths,
    nodes: list[int],
    run_id: int,
    ledgers: Path,
    **options,  # noqa: ANN003
) -> FedEvalFairOutcome:
    """One plain FedEvalFair run of the server's protocol over ``nodes``."""
    protocol = FedEvalFairProtocol(load_public_context(keys.public), timeout=2.0)
    return protocol.start(
        grid_of(keys, **options, ledgers=ledgers, run_id=run_id), ArrayRecord(), nodes
    )  # type: ignore[arg-type]


def one_group(arrays: ArrayRecord, context: Context) -> HolderRows:
    """The target's rows with one group only: it can compute no metric."""
    rows = library_rows(arrays, context)
    return HolderRows(rows.labels, rows.predictions, rows.groups * 0, rows.user_ids)


def test_a_weight_zero_holder_changes_no_released_statistic(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """Holders 1-3 with and without holder 4, which can compute no metric: the server counts
    4 ciphertexts in rounds 1 and 2 but every released statistic (stage 1, the sums, the
    group counts, the random-effects summary, k) is the run of 1-3's, to the flooding noise,
    and so is every test's p-value."""
    with_zero = run(
        ckks_keys, [1, 2, 3, 4], 11, tmp_path / "with", identities=identities, rows={4: one_group}
    )
    without = run(ckks_keys, [1, 2, 3], 12, tmp_path / "without", identities=identities)
    assert with_zero.error is None and without.error is None, (with_zero, without)
    assert [len(nodes) for nodes in with_zero.round_participants[:2]] == [4, 4]
    released = np.array(with_zero.released)
    np.testing.assert_allclose(released, np.array(without.released), equal_nan=True, **FLOODING)
    counts = released[BLOCK_WIDTH::RELEASE_WIDTH]
    assert counts.tolist() == [3.0] * len(BLOCKS)
    for ours, theirs in zip(with_zero.blocks, without.blocks, strict=True):
        assert ours.report is not None and theirs.report is not None
        assert ours.report.k == 3
        for test in ("homogeneity", "common_disparity"):
            assert getattr(ours.report, test).pvalue == pytest.approx(
                getattr(theirs.report, test).pvalue, abs=1e-5
            )


def test_weight_zero_holders_do_not_count_towards_a_blocks_min_holders(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """What weight 0 opens: the sets count signers, and a weight-0 holder signs. Key holders
    whose policy asks min-holders = 3, and a server that runs the target (holder 4), holder 2
    and a holder that can compute nothing (holder 1): 3 signers, but every block is the sum
    of 2 holders' statistics. The key holder releases no block fewer than its min-holders
    holders computed: all NaN, every test unavailable, while the same run with holder 3 in
    place of holder 1 is released (k = 3). With the default min-holders = 2, the target and a
    weight-0 holder alone give blocks of one holder: NaN too (on the reviewed main such a
    block made the key holder fail, an error instead of a release)."""
    three = NodePrivacyPolicy(min_holders=3)
    outcome = run(
        ckks_keys,
        [1, 2, 4],
        21,
        tmp_path / "weight-zero",
        identities=identities,
        rows={1: one_group},
        policy=three,
    )
    assert outcome.error is None, outcome
    assert np.isnan(np.array(outcome.released)).all()
    for block in outcome.blocks:
        assert block.report is None and "min-holders" in str(block.reason)
    outcome = run(ckks_keys, [2, 3, 4], 22, tmp_path / "three", identities=identities, policy=three)
    assert all(block.report is not None and block.report.k == 3 for block in outcome.blocks)

    outcome = run(
        ckks_keys, [1, 4], 23, tmp_path / "alone", identities=identities, rows={1: one_group}
    )
    assert outcome.error is None, outcome
    assert np.isnan(np.array(outcome.released)).all()
    assert all("min-holders" in str(block.reason) for block in outcome.blocks)


# --- L2: a holder left out of round 2 ----------------------------------------------------------


def strong(arrays: ArrayRecord, context: Context) -> HolderRows:
    """The target with 2000 rows and a large disparity of its own (it moves the round-1
    centre and the round-1 sums' binary exponents)."""
    rng = np.random.default_rng(99)
    groups = np.arange(2000) % 2
    predictions = (rng.random(2000) < np.where(groups == 0, 0.9, 0.05)).astype(int)
    labels = rng.integers(0, 2, 2000)
    return HolderRows(labels, predictions, groups, user_ids=np.arange(2000))


def exchange(grid: HandlerGrid, action: str, to: list[int], content: RecordDict) -> list[Message]:
    """Send ``content`` as ``query.<action>`` to ``to``; their replies."""
    messages = [Message(content, dst_node_id=n, message_type=f"query.{action}") for n in to]
    return grid.pull_messages(set(grid.push_messages(messages)))


def through_commit(
    grid: HandlerGrid,
    protocol: FedEvalFairProtocol,
    round1: list[int],
    round2: list[int],
) -> tuple[RecordDict, list[Message]]:
    """What a server may do with the holders' own handlers: round 1 with ``round1``, the
    endorsement, round 2 with ``round2`` only, every round-2 holder's commitment. Returns the
    round-3 request (both signed sets and the commitments) and the commitment replies."""
    run_id = grid.run.run_id
    replies = exchange(grid, "fef_round1", round1, protocol.round1_content(ArrayRecord()))
    first = protocol.collect_round(1, round1, replies, ROUND1_SIZE, run_id=run_id)
    contributors = [entry.signer for entry in first.entries]
    endorsed = exchange(grid, "fef_endorse", round1[:1], protocol.endorse_content(first.entries))
    total, endorsements, _ = protocol.collect_endorsements(
        endorsed, round1[:1], contributors, run_id=run_id
    )
    assert total is not None
    content = protocol.round2_content(total, contributors, [(e, s) for _, e, s in endorsements])
    replies = exchange(grid, "fef_round2", round2, content)
    second = protocol.collect_round(
        2, round2, replies, ROUND2_SIZE, run_id=run_id, reference=contributors_digest(contributors)
    )
    assert sorted(second.accepted) == sorted(round2)
    commits = exchange(
        grid, "fef_commit", round2, protocol.commit_content(first.entries, second.entries)
    )
    signed = [
        (
            r.content.array_records[FEF_KEY]["signer"].numpy().tobytes(),
            r.content.array_records[FEF_KEY]["commitment"].numpy().tobytes(),
        )
        for r in commits
        if not r.has_error()
    ]
    return protocol.round3_content(first.entries, second.entries, signed), commits


def test_a_holder_left_out_of_round2_is_never_released_over(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """The server takes the target (holder 4) into round 1 and leaves it out of round 2, then
    asks key holder 1 for round 3 over {1, 2, 3}. On the reviewed main the release's stage-1
    statistic and random-effects summary were weighted at the round-1 centre, the paper's T1
    was NaN exactly when the target had computed the block, and every slot's rounding grid
    showed the power of two of the round-1 sums: each moved with the target's data (a target
    of 2000 rows with a large disparity, the library's rows, or rows it computes nothing on).
    Now a key holder releases nothing over a round-2 set smaller than round 1's, whatever the
    target's rows, with one fixed sentence decided from the signed sets, before anything is
    decrypted (its key journal counts no release); the server's own protocol stops before the
    commitments and says why."""
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public), timeout=2.0)
    targets = {"strong": strong, "own": library_rows, "nothing": one_group}
    for run_id, (name, rows) in enumerate(targets.items(), start=31):
        grid = grid_of(ckks_keys, identities, tmp_path / name, run_id, rows={4: rows})
        request, commits = through_commit(grid, protocol, [1, 2, 3, 4], [1, 2, 3])
        assert not any(reply.has_error() for reply in commits)
        [reply] = exchange(grid, "fef_round3", [1], request)
        assert reply.has_error() and reply.error.reason == SMALLER_ROUND2_REFUSAL, name
        journals = list((tmp_path / name).rglob("fedevalfair-key-*.json"))
        assert len(journals) == 3  # the three commitments
        for path in journals:
            key = path.stem.removeprefix("fedevalfair-key-")
            assert ReleaseJournal.from_json(path.read_text(), key).release_count == 0
    # the same holders over equal sets release, so the refusal is the sets' and only theirs
    grid = grid_of(ckks_keys, identities, tmp_path / "equal", 38)
    request, _ = through_commit(grid, protocol, [1, 2, 3], [1, 2, 3])
    [reply] = exchange(grid, "fef_round3", [1], request)
    assert not reply.has_error()
    # the server's protocol stops before it asks anyone to commit
    outcome = run(
        ckks_keys,
        [1, 2, 3, 4],
        39,
        tmp_path / "server",
        identities=identities,
        drop=lambda action, node: (action, node) == ("fef_round2", 4),
    )
    assert outcome.released == () and outcome.committers == ()
    assert "node(s) [4] of round 1 sent no valid round-2 ciphertext" in (outcome.error or "")


# --- L1: draining the DP budget by withholding round 3 ----------------------------------------


def drained_run(
    grid: HandlerGrid, protocol: FedEvalFairProtocol, nodes: list[int]
) -> list[Message]:
    """Round 1, the endorsement, round 2 and every round-2 holder's commitment; round 3 is
    never sent (the server, or a key holder, withholds it). The commitment replies."""
    return through_commit(grid, protocol, nodes, nodes)[1]


def test_a_run_drained_before_round3_costs_each_user_one_release_and_the_budget_bounds_it(
    ckks_keys: KeyPaths, identities: Path, tmp_path: Path
) -> None:
    """docs/threat-model.md: in the DP mode a drained run (every round-2 holder committed,
    round 3 never sent) costs each user of each committed holder exactly one release of the
    run's (epsilon, delta), as a completed run does, and nothing more; the holder cannot see
    whether a release followed, so nothing is refunded and nothing caps drained runs but the
    users' budgets. With epsilon 1 and a budget of 2.5, two drained runs cost every user 2
    (basic composition; dp-accounting's PLD of three (1, 1e-8) releases at the ledger's delta
    1e-6 is 3, so the third does not fit) and the third run's commitment is refused with
    nothing charged: the server drained what the budget allowed and learned nothing."""
    from dp_accounting.pld import common, privacy_loss_distribution

    policy = NodePrivacyPolicy(user_epsilon_budget=2.5)
    nodes = [1, 2, 3]
    pld = privacy_loss_distribution.from_privacy_parameters(
        common.DifferentialPrivacyParameters(DP.epsilon, DP.delta)
    )
    assert pld.self_compose(3).get_epsilon_for_delta(policy.user_delta) > 2.5 + 1e-6
    protocol = FedEvalFairProtocol(load_public_context(ckks_keys.public), timeout=2.0, dp=DP)
    for drained in (1, 2):
        grid = grid_of(ckks_keys, identities, tmp_path, 40 + drained, DP, policy=policy)
        commitments = drained_run(grid, protocol, nodes)
        assert not any(reply.has_error() for reply in commitments)
        for node in nodes:
            ledger = UserLedger.load(tmp_path / f"node-{node - 1}" / "user-ledger.json")
            assert len(ledger.releases) == drained  # one release per drained run
            for release in ledger.releases:
                assert isinstance(release, ApproximateDPRelease) and release.job == "fedevalfair"
                assert (release.epsilon, release.delta) == (DP.epsilon, DP.delta)
            # every one of the holder's users paid drained * epsilon: basic composition, which
            # the PLD of `drained` (1, 1e-8) releases at 1e-6 does not undercut here
            composed = pld.self_compose(drained).get_epsilon_for_delta(policy.user_delta)
            assert composed == pytest.approx(drained * DP.epsilon, abs=1e-4)
            spent = ledger.epsilon_spent()
            assert spent.size == ROWS and np.allclose(spent, drained * DP.epsilon)
    grid = grid_of(ckks_keys, identities, tmp_path, 43, DP, policy=policy)
    commitments = drained_run(grid, protocol, nodes)
    assert [reply.error.reason for reply in commitments] == [DP_LEDGER_REFUSAL] * 3
    for node in nodes:
        ledger = UserLedger.load(tmp_path / f"node-{node - 1}" / "user-ledger.json")
        assert len(ledger.releases) == 2  # refused: nothing charged


def test_statistics_without_any_block_are_weight_zero_not_an_exception() -> None:
    """A holder's statistics with no block computable: weight 0 (zeros and the count slot),
    never an exception, in both modes' contributions."""
    groups = np.zeros(50, dtype=int)
    statistics = rows_statistics(
        np.ones(50, dtype=int),
        np.arange(50) % 2,
        groups,
        num_resamples=10,
        rng=np.random.default_rng(0),
        min_cell_count=5,
    )
    assert statistics.is_empty and len(statistics.reasons) == 2
    assert not statistics.contribution(mu0=0.0, tolerance=None).any()
    dp_sums = released_blocks(statistics.contribution(mu0=0.0, tolerance=None, dp=DP))
    assert not dp_sums.any()
    assert math.isclose(
        statistics.contribution(mu0=0.0, tolerance=None, dp=DP)[BLOCK_WIDTH - 1], 1.0
    )
