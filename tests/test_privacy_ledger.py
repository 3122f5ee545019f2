"""The per-user privacy ledger (mechanisms/privacy/user_ledger.py) and ``fedparity ledger show``.

Reference values come from dp-accounting's own PLD accountant, fed with events built here by
hand from the mechanisms' definitions (not with the module's conversions).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedparity.mechanisms.ldp.calibration import mechanism_for_budget
from fedparity.mechanisms.privacy.basic_ledger import (
    LedgerFileError,
    PrivacyBudgetExceeded,
    ledger_marker,
)
from fedparity.mechanisms.privacy.user_ledger import (
    NEIGHBOURING,
    VALUE_DISCRETIZATION_INTERVAL,
    ApproximateDPRelease,
    GapReportRelease,
    RandomizedResponseRelease,
    SubsampledGaussianRelease,
    UserLedger,
    compose,
)
from fedparity.server.cli import main
from tests.support.fixtures import CliResult

TIME = "2026-11-25T12:00:00+00:00"
DELTA = 1e-5


def rr_noise(epsilon: float, buckets: int) -> float:
    """dp-accounting's RR noise parameter p (uniform bucket with probability p) for which the
    true bucket has e^eps times the probability of any other: (1 - p + p/k) / (p/k) = e^eps."""
    return buckets / (math.exp(epsilon) + buckets - 1)


def reference_epsilon(events: list, delta: float) -> float:
    """dp-accounting's PLD accountant, replace-one relation, the module's grid."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL,
    )
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(delta)


def fpfl(steps: int = 50, **overrides: float) -> SubsampledGaussianRelease:
    parameters = {"noise_multiplier": 1.0, "sample_rate": 0.01, "delta": DELTA, **overrides}
    return SubsampledGaussianRelease(steps=steps, job="fpfl", time=TIME, **parameters)


def audit(budget: float = 1.0, mechanism: str = "R") -> GapReportRelease:
    return GapReportRelease.from_mechanism(
        mechanism_for_budget(mechanism, budget), job="ldp_audit", label="accuracy", time=TIME
    )


# --- composition ----------------------------------------------------------------------------------


def test_three_rr_releases_and_fifty_fpfl_rounds_match_dp_accounting() -> None:
    from dp_accounting import dp_event

    # epsilons off the PLD's grid: a loss exactly on it (0.8) may round either way by 1e-16
    group = RandomizedResponseRelease(epsilon=0.7654, num_categories=3, job="survey", time=TIME)
    report = audit(1.0, "L")
    sequence = [group, report, report, fpfl(50)]
    by_hand = [
        dp_event.RandomizedResponseDpEvent(noise_parameter=rr_noise(0.7654, 3), num_buckets=3),
        *[
            dp_event.RandomizedResponseDpEvent(
                noise_parameter=rr_noise(mechanism_for_budget("L", 1.0).epsilon, 2),
                num_buckets=2,
            )
        ]
        * 2,
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), 50
        ),
    ]
    expected = reference_epsilon(by_hand, DELTA)
    total = compose(sequence, DELTA)
    assert total.pld_epsilon == pytest.approx(expected, rel=1e-6)
    assert total.epsilon == pytest.approx(expected, rel=1e-6)  # below basic here
    assert reference_epsilon([r.to_dp_event() for r in sequence], DELTA) == pytest.approx(
        expected, rel=1e-6
    )
    assert total.num_releases == 4 and total.delta == DELTA
    assert total.neighbouring == NEIGHBOURING == "replace-one-user"
    # basic composition: 0.7654 + 2 * (the audit's true epsilon, at most 1) + the FPFL epsilon
    assert total.basic_epsilon == pytest.approx(
        0.7654 + 2 * report.epsilon + fpfl(50).basic_epsilon
    )
    assert report.epsilon <= 1.0 and report.epsilon == pytest.approx(1.0, rel=1e-3)
    assert total.basic_delta == DELTA
    assert expected < total.basic_epsilon


def test_the_fpfl_part_holds_under_replacement_not_only_add_or_remove() -> None:
    """Replace-one is the stronger relation: its epsilon is above the add/remove one that
    Opacus reports for the same rounds, and below the generic doubling of it."""
    import dp_accounting
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    rounds = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), 50
    )
    add_remove = PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, VALUE_DISCRETIZATION_INTERVAL
    )
    add_remove.compose(rounds)
    replace = compose([fpfl(50)], DELTA).pld_epsilon
    assert add_remove.get_epsilon(DELTA) < replace < 2 * add_remove.get_epsilon(DELTA)


def test_many_small_releases_compose_below_basic_composition() -> None:
    releases = [ApproximateDPRelease(epsilon=0.1, job="other", time=TIME)] * 200
    total = compose(releases, DELTA)
    assert total.basic_epsilon == pytest.approx(20.0)
    assert total.epsilon == total.pld_epsilon < 7.0  # about 6.64 (docs/ledger.md)


def test_an_approximate_dp_release_counts_its_delta() -> None:
    release = ApproximateDPRelease(epsilon=1.0, delta=1e-6, job="other", time=TIME)
    total = compose([release, release], 1e-5)
    assert total.basic_delta == pytest.approx(2e-6)
    assert total.pld_epsilon <= 2.0 + 2 * VALUE_DISCRETIZATION_INTERVAL
    with pytest.raises(ValueError, match="delta"):
        compose([release], 0.0)  # the user's delta must be in (0, 1)


pure_releases = st.one_of(
    st.builds(
        lambda e: ApproximateDPRelease(epsilon=e, job="x", time=TIME),
        st.floats(0.01, 3.0),
    ),
    st.builds(
        lambda e, k: RandomizedResponseRelease(epsilon=e, num_categories=k, job="x", time=TIME),
        st.floats(0.01, 3.0),
        st.integers(2, 8),
    ),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(pure_releases, min_size=1, max_size=12), st.floats(1e-9, 0.1))
def test_never_above_basic_composition(releases: list, delta: float) -> None:
    total = compose(releases, delta)
    basic = math.fsum(release.epsilon for release in releases)
    assert total.basic_epsilon == pytest.approx(basic) and total.basic_delta == 0.0
    # the PLD's grid rounds each release's loss up by at most one interval
    assert total.pld_epsilon <= basic + len(releases) * VALUE_DISCRETIZATION_INTERVAL + 1e-12
    assert total.epsilon <= basic


def test_releases_check_their_parameters() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        ApproximateDPRelease(epsilon=0.0, job="x")
    with pytest.raises(ValueError, match="sample_rate"):
        fpfl(10, sample_rate=1.5)
    with pytest.raises(ValueError, match="gap_mechanism"):
        GapReportRelease(gap_mechanism="Q", epsilon_group=1.0, epsilon_value=1.0, job="x")
    with pytest.raises(ValueError, match="job"):
        ApproximateDPRelease(epsilon=1.0, job="")


# --- the ledger -----------------------------------------------------------------------------------


def test_an_overspending_release_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "privacy-ledger.json"
    ledger = UserLedger(budget=2.5, delta=DELTA, num_users=4)
    ledger.charge(audit(1.0))
    ledger.charge(audit(1.0), np.array([True, True, False, False]))
    ledger.save(path)
    on_disk = path.read_bytes()
    before = ledger.total(0)

    with pytest.raises(PrivacyBudgetExceeded) as refused:
        ledger.charge(audit(1.0))
    message = str(refused.value)
    assert "user 0, 1 (2 of 4)" in message and "epsilon=2.5" in message
    assert "would reach epsilon=3" in message and NEIGHBOURING in message
    assert len(ledger.releases) == 2 and ledger.total(0) == before
    assert path.read_bytes() == on_disk
    assert UserLedger.load(path).total(0) == before

    affordable = ledger.can_afford(audit(1.0))
    assert affordable.tolist() == [False, False, True, True]
    ledger.charge(audit(1.0), affordable)  # the users who can afford it answer
    assert ledger.epsilon_spent() == pytest.approx([2.0, 2.0, 2.0, 2.0], abs=1e-3)


def test_users_in_different_releases_have_their_own_totals() -> None:
    ledger = UserLedger(budget=10.0, delta=DELTA, num_users=6)
    trained = np.array([True, True, True, False, False, False])
    ledger.charge(fpfl(50), trained)
    ledger.charge(audit(1.0))
    assert ledger.releases_of(0) == (0, 1) and ledger.releases_of(5) == (1,)
    assert ledger.total(0) == compose([fpfl(50), audit(1.0)], DELTA)
    assert ledger.total(5) == compose([audit(1.0)], DELTA)
    spent = ledger.epsilon_spent()
    assert spent[:3] == pytest.approx([ledger.total(0).epsilon] * 3)
    assert ledger.most_spent_user() == 0
    assert [t.num_releases for t in ledger.running_totals(0)] == [1, 2]
    summary = ledger.summary()
    assert summary["max_epsilon"] == ledger.total(0).epsilon
    assert summary["min_epsilon"] == pytest.approx(ledger.total(5).epsilon)


def test_round_trip_keeps_every_release_and_participant(tmp_path: Path) -> None:
    path = tmp_path / "ledgers" / "privacy-ledger.json"
    ledger = UserLedger(budget=20.0, delta=DELTA, num_users=1001)
    sampled = np.random.default_rng(3).random(1001) < 0.4
    ledger.charge(fpfl(20), sampled)
    ledger.charge(audit(2.0, "L"))
    ledger.charge(ApproximateDPRelease(epsilon=0.5, delta=1e-7, job="other", time=TIME))
    ledger.save(path)
    assert ledger_marker(path).is_file() and oct(path.stat().st_mode & 0o777) == "0o600"

    loaded = UserLedger.load(path, num_users=1001)
    assert loaded.releases == ledger.releases
    assert np.array_equal(loaded.participants(0), sampled)
    assert loaded.summary() == ledger.summary()
    assert (loaded.budget, loaded.delta) == (20.0, DELTA)

    again = UserLedger.load_or_create(path, budget=50.0, delta=1e-3, num_users=1001)
    assert (again.budget, again.delta) == (20.0, DELTA)  # a later policy never loosens it
    path.unlink()
    with pytest.raises(LedgerFileError, match="missing"):
        UserLedger.load_or_create(path, budget=20.0, delta=DELTA, num_users=1001)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x00\xffnot json", "cannot be read"),
        (b'{"format": "fedparity-ldp-ledger", "version": 1}', "not a fedparity privacy ledger"),
        (b"[1, 2]", "not a fedparity privacy ledger"),
    ],
)
def test_a_foreign_or_corrupt_file_is_refused(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "privacy-ledger.json"
    path.write_bytes(content)
    with pytest.raises(LedgerFileError, match=needle):
        UserLedger.load(path)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data["releases"][0].update(kind="teleport"),
        lambda data: data["releases"][0].update(participants="AA=="),
        lambda data: data["releases"][0].update(epsilon_value="lots"),
        lambda data: data.update(neighbouring="add-or-remove-one-user"),
        lambda data: data.update(budget=-1),
        lambda data: data["releases"][0].pop("job"),
    ],
)
def test_a_damaged_ledger_is_refused(tmp_path: Path, damage) -> None:
    path = tmp_path / "privacy-ledger.json"
    ledger = UserLedger(budget=5.0, delta=DELTA, num_users=20)
    ledger.charge(audit(1.0), np.arange(20) < 7)
    ledger.save(path)
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    with pytest.raises(LedgerFileError, match="damaged"):
        UserLedger.load(path)


def test_a_ledger_for_another_number_of_users_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "privacy-ledger.json"
    UserLedger(budget=5.0, delta=DELTA, num_users=3).save(path)
    with pytest.raises(LedgerFileError, match="holds 3 users, this node has 4"):
        UserLedger.load(path, num_users=4)


def test_dp_accounting_is_imported_only_when_used_and_adds_no_log_handler() -> None:
    code = (
        "import logging, sys\n"
        "from fedparity.mechanisms.privacy import user_ledger as pl\n"
        "assert 'dp_accounting' not in sys.modules\n"
        "pl.compose([pl.ApproximateDPRelease(epsilon=1.0, job='x')], 1e-5)\n"
        "assert 'dp_accounting' in sys.modules\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- fedparity ledger show ------------------------------------------------------------------------


@pytest.fixture
def written_ledger(tmp_path: Path) -> Path:
    path = tmp_path / "privacy-ledger.json"
    ledger = UserLedger(budget=8.0, delta=DELTA, num_users=5)
    ledger.charge(fpfl(50), np.array([False, True, True, False, False]))
    ledger.charge(audit(1.0))
    ledger.save(path)
    return path


def test_ledger_show_text(written_ledger: Path, cli: Callable[[list[str]], CliResult]) -> None:
    code, text, _ = cli(["ledger", "show", str(written_ledger)])
    assert code == 0
    total = UserLedger.load(written_ledger).total(1)
    assert "5 user(s), budget epsilon=8" in text and "replace-one-user" in text
    assert "running total of user 1 (the most spent)" in text
    assert "#0 2026-11-25T12:00:00+00:00 job fpfl: subsampled-gaussian" in text
    assert "noise_multiplier=1 sample_rate=0.01 steps=50" in text
    assert "job ldp_audit (accuracy): ldp-gap-report gap_mechanism=R" in text
    assert "2 of 5 user(s)" in text and "5 of 5 user(s)" in text
    assert f"total of user 1: epsilon={total.epsilon:.4g}" in text
    assert f"(basic composition: epsilon={total.basic_epsilon:.4g}" in text


def test_ledger_show_json(written_ledger: Path, cli: Callable[[list[str]], CliResult]) -> None:
    code, text, _ = cli(["ledger", "show", str(written_ledger), "--user", "0", "--json"])
    assert code == 0 and len(text.strip().splitlines()) == 1
    shown = json.loads(text)
    ledger = UserLedger.load(written_ledger)
    assert shown["user"] == 0
    assert [r["mechanism"] for r in shown["releases"]] == [
        "subsampled-gaussian",
        "ldp-gap-report",
    ]
    assert shown["releases"][0]["parameters"] == {
        "noise_multiplier": 1.0,
        "sample_rate": 0.01,
        "steps": 50,
        "delta": DELTA,
        "timing_tail_probability": 0.0,
    }
    assert shown["releases"][0]["participants"] == 2
    assert shown["releases"][0]["user_total"] is None  # user 0 was not in the training
    assert shown["releases"][1]["user_total"]["epsilon"] == ledger.total(0).epsilon
    assert shown["total"]["epsilon"] == ledger.total(0).epsilon
    assert shown["total"]["neighbouring"] == "replace-one-user"
    assert shown["summary"] == ledger.summary()


def test_ledger_show_bad_input_exits_2_with_one_line(
    tmp_path: Path, written_ledger: Path, cli: Callable[[list[str]], CliResult]
) -> None:
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"format": "something else"}')
    for argv, needle in [
        (["ledger", "show", str(tmp_path / "missing.json")], "PATH: no ledger file"),
        (["ledger", "show", str(foreign)], "PATH: ledger"),
        (["ledger", "show", str(written_ledger), "--user", "5"], "--user must be"),
    ]:
        code, text, err = cli(argv)
        assert code == 2 and text == "", argv
        assert err.count("\n") == 1 and needle in err, err


def test_ledger_help_has_examples_the_parser_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from fedparity.server.cli.commands import build_parser

    with pytest.raises(SystemExit):
        main(["ledger", "--help"])
    text = capsys.readouterr().out
    examples = [
        shlex.split(line)[1:] for line in text.splitlines() if line.startswith("  fedparity ")
    ]
    assert len(examples) == 3 and "``" not in text  # show (2), reset (1)
    for argv in examples:
        assert build_parser().parse_args(argv).command == "ledger"
