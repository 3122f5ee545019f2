"""The one FPFL training loop (``FPFLTraining.start``) and its observers, driven over real FPFL
nodes in this process (the library's handlers behind an in-process grid, real masked rounds,
real Opacus accounting; the only test doubles are the crash and the observers that record or
stop).

Before, a library user's ``FPFLTraining.start`` (``docs/guides/own-app.md``) kept no release
ledger and no checkpoint: a crash forgot every round released, and a restart trained and
counted from round 1. Only the FPFL job's own copy of the loop was durable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedparity.clients.fpfl_task import get_flat_parameters, statistics_layout
from fedparity.clients.policy import NodePrivacyPolicy
from fedparity.mechanisms.fpfl.mmdm import MMDMConfig
from fedparity.mechanisms.fpfl.training_state import CHECKPOINT_STATE, RELEASE_LEDGER
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent
from fedparity.strategies import (
    DurableTraining,
    FPFLObserver,
    FPFLTraining,
    StopAfterLostRounds,
    StopWhenTooFewNodes,
)
from tests.support.fpfl_nodes import (
    POPULATION,
    PRIVATE_TRAINING,
    MaskingNodes,
    make_model,
    roster_identities,
)
from tests.test_secure_sum_attacks import NodesGrid, server_protocol

pytestmark = pytest.mark.usefixtures("task_identity")

MEMBERS = [3, 4, 5]
ROUNDS = 5  # PRIVATE_TRAINING's T


class Crash(RuntimeError):
    """The server process dying (injected)."""


class CountingGrid(NodesGrid):
    """The in-process grid, noting the release ledger's count in ``folder`` each time a round
    message is pushed, and crashing after round ``crash_after`` was handed to the nodes."""

    def __init__(self, nodes: MaskingNodes, folder: Path | None = None, crash_after: int = 0):
        super().__init__(nodes)
        self.folder, self.crash_after = folder, crash_after
        self.ledger_when_sent: list[tuple[int, int]] = []  # (round, rounds_released on disk)
        self.connected = list(nodes.ids)

    def push_messages(self, messages: list) -> list[str]:  # noqa: ANN001
        rounds = {
            int(m.content.config_records["config"]["round"])
            for m in messages
            if m.metadata.message_type == "query.fpfl_round"
        }
        for round_number in sorted(rounds):
            counted = -1
            if self.folder is not None and (self.folder / RELEASE_LEDGER).is_file():
                ledger = json.loads((self.folder / RELEASE_LEDGER).read_text())
                counted = ledger["rounds_released"]
            self.ledger_when_sent.append((round_number, counted))
        ids = super().push_messages(messages)
        if self.crash_after and self.crash_after in rounds:
            raise Crash(f"the server died after sending round {self.crash_after}")
        return ids

    def get_node_ids(self) -> list[int]:
        return list(self.connected)

    def rounds_sent(self) -> int:
        return self.sent.count("fpfl_round")


def private_nodes() -> MaskingNodes:
    """Three real nodes of a noisy masked training (a new Flower run each time), with a
    roster (the built-in policy's require-roster)."""
    return MaskingNodes(
        MEMBERS,
        PRIVATE_TRAINING,
        policy=NodePrivacyPolicy(),
        identities=roster_identities(MEMBERS),
    )


def new_training() -> FPFLTraining:
    model = make_model()
    return FPFLTraining(
        statistics_layout(model, 2),
        get_flat_parameters(model),
        mmdm=MMDMConfig(alpha=0.05),
        use_mmdm=True,
    )


def epsilon_after(releases: int) -> float:
    return privacy_spent(
        noise_multiplier=PRIVATE_TRAINING.noise_multiplier(POPULATION),
        sample_rate=PRIVATE_TRAINING.cohort_size / POPULATION,
        steps=releases,
        delta=PRIVATE_TRAINING.delta,  # type: ignore[arg-type]
    ).epsilon


def test_a_library_training_counts_each_release_durably_and_resumes_counting_every_one(
    tmp_path: Path,
) -> None:
    """Checkpoints every 2 rounds, T = 5; the server dies in round 3 after the nodes got it.
    The ledger on disk already said 3 when round 3 was sent; the training started again on
    the same folder continues from the round-2 checkpoint, runs rounds 3-5 again, and counts
    3 + 3 = 6 releases: its epsilon is the accountant's for 6 rounds, above an uninterrupted
    run's. (Before: no ledger, no checkpoint; the restart trained from round 1 and its
    caller could only count 5.)"""
    grid = CountingGrid(private_nodes(), tmp_path, crash_after=3)
    with pytest.raises(Crash):
        new_training().start(
            server_protocol(grid), ROUNDS, observers=[DurableTraining(tmp_path, checkpoint_every=2)]
        )
    assert grid.ledger_when_sent == [(1, 1), (2, 2), (3, 3)]  # on disk before each send
    assert json.loads((tmp_path / RELEASE_LEDGER).read_text())["rounds_released"] == 3
    assert json.loads((tmp_path / CHECKPOINT_STATE).read_text())["round"] == 2

    grid = CountingGrid(private_nodes(), tmp_path)  # a new run of the ServerApp and the nodes
    durable = DurableTraining(tmp_path, checkpoint_every=2)
    result = new_training().start(server_protocol(grid), ROUNDS, observers=[durable])
    assert grid.ledger_when_sent == [(3, 4), (4, 5), (5, 6)]
    assert [entry["round"] for entry in result.history] == [1, 2, 3, 4, 5]
    assert result.first_round == 3 and result.rounds_trained == 5 and not result.stop_reason
    assert all(entry["replied"] == 3 and "lost" not in entry for entry in result.history)
    assert durable.ledger is not None and durable.ledger.rounds_released == 6
    assert [entry["rounds_released_total"] for entry in result.history[2:]] == [4, 5, 6]
    assert result.history[-1]["epsilon_spent"] == pytest.approx(epsilon_after(6), rel=1e-9)
    assert result.history[-1]["epsilon_spent"] > epsilon_after(ROUNDS)
    assert json.loads((tmp_path / CHECKPOINT_STATE).read_text())["round"] == 5


def test_by_default_a_library_training_is_durable_and_the_same_folder_resumes_it(
    isolated_home: Path,
) -> None:
    runs = isolated_home / ".fedparity" / "runs"
    earlier = set(runs.glob("fpfl-*"))
    grid = CountingGrid(private_nodes())
    result = new_training().start(server_protocol(grid), ROUNDS, stop_after=2)
    (folder,) = set(runs.glob("fpfl-*")) - earlier
    assert json.loads((folder / RELEASE_LEDGER).read_text())["rounds_released"] == 2
    assert json.loads((folder / CHECKPOINT_STATE).read_text())["round"] == 2
    assert result.rounds_trained == 2 and grid.rounds_sent() == 2 * len(MEMBERS)

    grid = CountingGrid(private_nodes(), folder)
    training = new_training()
    result = training.start(server_protocol(grid), ROUNDS, folder=folder)
    assert grid.ledger_when_sent == [(3, 3), (4, 4), (5, 5)]  # a clean pause costs nothing
    assert [entry["round"] for entry in result.history] == [1, 2, 3, 4, 5]
    # The same folder for a training with other settings is refused before anything is sent.
    grid = CountingGrid(private_nodes())
    other = new_training()
    other.use_mmdm = False
    with pytest.raises(ValueError, match="checkpoint in .* different settings .*use_mmdm"):
        other.start(server_protocol(grid), ROUNDS, folder=folder)
    assert grid.sent == []
    # A folder that holds a training is never started over.
    with pytest.raises(ValueError, match="already holds a training .*never written over"):
        new_training().start(
            server_protocol(grid), ROUNDS, observers=[DurableTraining(folder, resume=False)]
        )
    assert grid.sent == []


class Recorder(FPFLObserver):
    """Notes each hook with the round, and how many round messages the grid had been sent."""

    def __init__(self, name: str, calls: list[tuple[str, str, int, int]], grid: CountingGrid):
        self.name, self.calls, self.grid = name, calls, grid

    def note(self, hook: str, round_number: int) -> None:
        self.calls.append((self.name, hook, round_number, self.grid.rounds_sent()))

    def restore(self, training: Any, protocol: Any) -> int:
        assert protocol.table is None  # before the setup: nothing sent yet
        self.note("restore", 0)
        return 0

    def begin(self, training: Any, protocol: Any, rounds: range) -> None:
        assert protocol.table is not None and rounds == range(1, 3)
        self.note("begin", 0)

    def should_stop(self, round_number: int, history: Sequence[Mapping[str, Any]]) -> str:
        assert [entry["round"] for entry in history] == list(range(1, round_number))
        self.note("should_stop", round_number)
        return ""

    def before_release(self, round_number: int) -> None:
        self.note("before_release", round_number)

    def after_round(self, round_number: int, outcome: Any, entry: dict[str, Any]) -> None:
        assert outcome.round == round_number == entry["round"]
        self.note("after_round", round_number)

    def end(self, result: Any) -> None:
        self.note("end", result.rounds_trained)


def test_every_hook_is_called_in_order_and_before_release_precedes_the_send() -> None:
    calls: list[tuple[str, str, int, int]] = []
    grid = CountingGrid(private_nodes())
    observers = [Recorder("a", calls, grid), Recorder("b", calls, grid)]
    new_training().start(server_protocol(grid), 2, observers=observers)
    per_round = [
        ("should_stop", 0),
        ("before_release", 0),  # no round message of this round is out yet
        ("after_round", 3),  # the round's message went to the 3 nodes
    ]
    expected = [(name, "restore", 0, 0) for name in "ab"]
    expected += [(name, "begin", 0, 0) for name in "ab"]
    for round_number in (1, 2):
        sent_before = 3 * (round_number - 1)
        for hook, extra in per_round:
            expected += [(name, hook, round_number, sent_before + extra) for name in "ab"]
    expected += [(name, "end", 2, 6) for name in "ab"]
    assert calls == expected


class StopAt(FPFLObserver):
    def __init__(self, round_number: int) -> None:
        self.round_number = round_number

    def should_stop(self, round_number: int, history: Sequence[Mapping[str, Any]]) -> str:
        return "asked to stop" if round_number == self.round_number else ""


def test_should_stop_ends_the_training_with_a_checkpoint_of_the_last_round(
    tmp_path: Path,
) -> None:
    grid = CountingGrid(private_nodes(), tmp_path)
    durable = DurableTraining(tmp_path, checkpoint_every=10)
    result = new_training().start(server_protocol(grid), ROUNDS, observers=[durable, StopAt(3)])
    assert result.stop_reason == "asked to stop" and result.rounds_trained == 2
    assert [entry["round"] for entry in result.history] == [1, 2]
    assert grid.rounds_sent() == 2 * len(MEMBERS)
    assert json.loads((tmp_path / RELEASE_LEDGER).read_text())["rounds_released"] == 2
    # Stopped between two checkpoints: the end checkpoints round 2, so resuming costs nothing.
    assert json.loads((tmp_path / CHECKPOINT_STATE).read_text())["round"] == 2


class RefuseRelease(FPFLObserver):
    def __init__(self, round_number: int) -> None:
        self.round_number = round_number

    def before_release(self, round_number: int) -> None:
        if round_number == self.round_number:
            raise RuntimeError(f"round {round_number} must not be released")


@pytest.mark.parametrize("refused", [1, 2])
def test_a_before_release_that_raises_stops_before_the_round_is_sent(refused: int) -> None:
    grid = CountingGrid(private_nodes())
    with pytest.raises(RuntimeError, match=f"round {refused} must not be released"):
        new_training().start(server_protocol(grid), ROUNDS, observers=[RefuseRelease(refused)])
    assert grid.rounds_sent() == (refused - 1) * len(MEMBERS)


def test_the_library_stops_after_lost_rounds_and_before_a_round_too_few_nodes_can_answer() -> None:
    # n_min = 3 of 3 (tolerance 0): with node 5 silent each round is lost (too little noise).
    grid = CountingGrid(private_nodes())
    grid.tamper = lambda node, reply: None if node == 5 and grid.sent[-1] == "fpfl_round" else reply
    protocol = server_protocol(grid)
    protocol.reply_timeout = 0.05  # the in-process nodes reply at once; node 5 never does
    result = new_training().start(protocol, ROUNDS, observers=[StopAfterLostRounds(2)])
    assert ["lost" in entry for entry in result.history] == [True, True]
    assert "too little noise" in result.history[-1]["lost"]
    assert result.stop_reason.startswith("2 round(s) in a row were lost")
    assert grid.rounds_sent() == 2 * len(MEMBERS)
    # Node 5 disconnected: no round is sent at all, the training stops before round 1.
    grid = CountingGrid(private_nodes())
    grid.connected = [3, 4]
    result = new_training().start(server_protocol(grid), ROUNDS, observers=[StopWhenTooFewNodes()])
    assert result.stop_reason == (
        "only 2 of the 3 member node(s) are connected, fewer than n_min = 3 whose noise shares "
        "a round needs"
    )
    assert result.history == [] and result.rounds_trained == 0 and grid.rounds_sent() == 0


def test_bad_arguments_are_refused_before_anything_is_sent(tmp_path: Path) -> None:
    grid = CountingGrid(private_nodes())
    training, protocol = new_training(), server_protocol(grid)
    with pytest.raises(ValueError, match="num_rounds must be an integer >= 1"):
        training.start(protocol, 0, observers=[])
    with pytest.raises(ValueError, match="stop_after must be an integer >= 1"):
        training.start(protocol, 2, observers=[], stop_after=0)
    with pytest.raises(ValueError, match="pass folder= or observers=, not both"):
        training.start(protocol, 2, folder=tmp_path, observers=[])
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1"):
        DurableTraining(tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="limit must be an integer >= 1"):
        StopAfterLostRounds(0)
    assert grid.sent == []
    # No observers: nothing durable, nothing written (an explicit choice).
    result = training.start(protocol, 1, observers=[])
    assert result.rounds_trained == 1 and not any(tmp_path.iterdir())
    assert np.isfinite(result.weights).all()
