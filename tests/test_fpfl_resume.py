"""The privacy ledger: rounds released after the last checkpoint still count after a crash.

``server.fpfl_job`` writes the number of rounds released so far to
``output-dir/privacy-ledger.json`` durably *before* each round is sent; a resumed run adds
its rounds to that count, so epsilon covers every round ever released (real Flower
simulations, real Opacus accountant; the crash itself is injected by a test double, the only
one here).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedparity.clients.project.config import RunConfig
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent
from fedparity.server.api import run_simulation_job
from fedparity.server.fpfl_checkpoint import (
    RELEASE_LEDGER,
    ReleaseLedger,
    ReleaseSegment,
    load_checkpoint,
    read_release_ledger,
    resumed_ledger,
    write_release_ledger,
)
from fedparity.strategies.fpfl import FPFLProtocol

SMALL = {
    "task": "fpfl",
    "dataset": "synthetic",
    "users-per-node": 200,
    "fpfl-cohort-size": 150,
    "fpfl-client-seed": 7,
    "reply-timeout": 300.0,  # generous: the crash must be the injected one, not a slow node
}
CONFIG = RunConfig.from_mapping({**SMALL, "fpfl-algorithm": "fpfl"})


def test_ledger_round_trip_is_atomic_and_checked(tmp_path: Path) -> None:
    ledger = ReleaseLedger(
        (ReleaseSegment(1.2, 0.25, 7), ReleaseSegment(1.3, 0.3, 2)), delta=1 / 600
    )
    assert read_release_ledger(tmp_path, CONFIG) is None
    write_release_ledger(tmp_path, CONFIG, ledger)
    assert read_release_ledger(tmp_path, CONFIG) == ledger
    assert sorted(p.name for p in tmp_path.iterdir()) == [RELEASE_LEDGER]  # no scratch left
    # Settings neutral to resuming (checkpoint period, stop-after) read the same ledger ...
    neutral = RunConfig.from_mapping({**SMALL, "fpfl-checkpoint-every": 3, "fpfl-stop-after": 2})
    assert read_release_ledger(tmp_path, neutral) == ledger
    # ... other settings, or a damaged file, are refused (never silently restarted from 0).
    other = RunConfig.from_mapping({**SMALL, "fpfl-alpha": 0.05})
    with pytest.raises(ValueError, match="fpfl-resume: the privacy ledger .* different settings"):
        read_release_ledger(tmp_path, other)
    (tmp_path / RELEASE_LEDGER).write_text('{"rounds_released": ')
    with pytest.raises(ValueError, match="unreadable"):
        read_release_ledger(tmp_path, CONFIG)
    with pytest.raises(ValueError, match="rounds"):
        ReleaseSegment(1.0, 0.5, -1)


def test_a_version_1_ledger_is_read_as_one_segment(tmp_path: Path) -> None:
    """Ledgers written before segments existed keep counting."""
    version1 = {"rounds_released": 7, "noise_multiplier": 1.2, "sample_rate": 0.25}
    ledger = ReleaseLedger.from_json({**version1, "delta": 1 / 600})
    assert ledger == ReleaseLedger.single(7, noise_multiplier=1.2, sample_rate=0.25, delta=1 / 600)


def test_resume_counts_max_of_ledger_and_checkpoint(tmp_path: Path) -> None:
    def resumed(checkpoint_round: int, sigma: float = 1.2, rate: float = 0.25) -> ReleaseLedger:
        return resumed_ledger(
            tmp_path,
            CONFIG,
            checkpoint_round,
            noise_multiplier=sigma,
            sample_rate=rate,
            delta=1 / 600,
        )

    assert resumed(5).rounds_released == 5  # no ledger: the checkpoint's rounds
    write_release_ledger(
        tmp_path,
        CONFIG,
        ReleaseLedger.single(7, noise_multiplier=1.2, sample_rate=0.25, delta=1 / 600),
    )
    assert resumed(5).rounds_released == 7
    assert resumed(0).rounds_released == 7  # no checkpoint
    assert resumed(9).rounds_released == 9  # a checkpoint beyond the ledger (older runs)
    # A population that shrank: the earlier rounds stay at their (sigma, q) and the new ones
    # start a segment of their own, composed by the accountant.
    later = resumed(5, sigma=1.3, rate=0.3).after_release(1.3, 0.3).after_release(1.3, 0.3)
    assert later.segments == (ReleaseSegment(1.2, 0.25, 7), ReleaseSegment(1.3, 0.3, 2))
    assert later.delta == pytest.approx(1 / 600)


def test_segments_compose_with_opacus_history() -> None:
    """The composed epsilon is Opacus' for the same heterogeneous history, lies between the
    epsilons of the whole run at either segment's (sigma, q), and one segment gives the
    single-(sigma, q) value."""
    from opacus.accountants import RDPAccountant

    from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent_history

    history = [(1.2, 0.25, 7), (0.9, 0.4, 5)]
    ours = privacy_spent_history(history, delta=1e-3).epsilon
    reference = RDPAccountant()
    reference.history = list(history)
    assert ours == pytest.approx(reference.get_epsilon(delta=1e-3), rel=1e-12)
    first_only = privacy_spent(noise_multiplier=1.2, sample_rate=0.25, steps=12, delta=1e-3)
    second_only = privacy_spent(noise_multiplier=0.9, sample_rate=0.4, steps=12, delta=1e-3)
    assert first_only.epsilon < ours < second_only.epsilon
    split = privacy_spent_history([(1.2, 0.25, 7), (1.2, 0.25, 5)], delta=1e-3)
    assert split.epsilon == pytest.approx(first_only.epsilon, rel=1e-12)
    prv = privacy_spent_history(history, delta=1e-3, accountant="prv")
    assert 0 < prv.epsilon <= ours * 1.05  # PRV is at most RDP's bound (up to its eps_error)


@pytest.mark.slow
def test_crash_after_the_last_checkpoint_counts_the_released_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints every 5 rounds, T = 8; the server crashes in round 7 after the nodes
    released that round's noisy sum. The ledger says 7 rounds were released; resuming from
    the round-5 checkpoint re-runs rounds 6 and 7 and runs 8, so 7 + 3 = 10 rounds have been
    released and the reported epsilon is Opacus' for 10 rounds: more than the epsilon of an
    uninterrupted 8-round run."""
    overrides = {
        **SMALL,
        "fpfl-algorithm": "fpfl",
        "fpfl-rounds": 8,
        "fpfl-checkpoint-every": 5,
        "output-dir": str(tmp_path),
    }
    config = RunConfig.from_mapping(overrides)
    original = FPFLProtocol.run_round
    seen: list[tuple[int, int]] = []  # (round, ledger count when the round is sent)
    crash_in: set[int] = {7}

    def run_round(self: FPFLProtocol, round_number: int, weights: np.ndarray):  # noqa: ANN202
        ledger = read_release_ledger(tmp_path, config)
        seen.append((round_number, -1 if ledger is None else ledger.rounds_released))
        outcome = original(self, round_number, weights)
        if round_number in crash_in:
            crash_in.discard(round_number)
            raise RuntimeError(f"injected crash in round {round_number}, after the release")
        return outcome

    monkeypatch.setattr(FPFLProtocol, "run_round", run_round)  # fault injection only
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the crash surfaces as
        run_simulation_job(overrides, num_supernodes=3)
    assert not crash_in, f"the run failed before the injected crash (rounds sent: {seen})"
    assert seen == [(t, t) for t in range(1, 8)]  # counted before each round was sent
    assert not (tmp_path / "results.json").exists()
    state = load_checkpoint(tmp_path, config)
    assert state is not None and state["round"] == 5
    crashed = read_release_ledger(tmp_path, config)
    assert crashed is not None and crashed.rounds_released == 7

    seen.clear()
    resumed = run_simulation_job({**overrides, "fpfl-resume": True}, num_supernodes=3)
    assert seen == [(6, 8), (7, 9), (8, 10)]
    assert [entry["round"] for entry in resumed["history"]] == list(range(1, 9))
    privacy = resumed["privacy"]
    assert privacy["rounds_released_total"] == 10
    assert privacy["rounds_trained"] == 8
    assert privacy["rounds_discarded_by_crashes"] == 2
    assert any("interrupted run" in note for note in privacy["caveats"])
    ledger = json.loads((tmp_path / RELEASE_LEDGER).read_text())
    assert ledger["rounds_released"] == 10

    sigma = resumed["noise_multiplier"]
    assert sigma > 0 and resumed["delta"] == pytest.approx(1 / 600)

    def accountant(steps: int) -> float:
        return privacy_spent(
            noise_multiplier=sigma, sample_rate=150 / 600, steps=steps, delta=1 / 600
        ).epsilon

    assert resumed["epsilon"] == pytest.approx(accountant(7 + 3))
    assert resumed["history"][-1]["epsilon_spent"] == pytest.approx(resumed["epsilon"])
    uninterrupted = accountant(8)  # what an uninterrupted 8-round run reports
    assert resumed["epsilon"] > uninterrupted
