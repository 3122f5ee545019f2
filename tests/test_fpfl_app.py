"""FPFL as a Flower job (real Flower simulations, real masking, real Opacus accountant).

The expected models are recomputed here from the same population, the same seeded cohorts
(:func:`fedparity.clients.fpfl_node.round_rng`) and the central statistics
(:func:`fedparity.clients.fpfl_task.user_statistics`), independently of the server's recovery path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.simulation import run_simulation

from fedparity.clients.app import build_client_app, fpfl_round
from fedparity.clients.fpfl_node import round_rng
from fedparity.clients.fpfl_task import (
    build_model_for,
    clip_statistics,
    get_flat_parameters,
    set_flat_parameters,
    statistics_layout,
    user_statistics,
)
from fedparity.clients.messages import INTERNAL_ERROR_TEXT
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.fpfl_node import node_shard
from fedparity.mechanisms.fpfl.mmdm import sgd_update
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent
from fedparity.server.api import run_simulation_job
from fedparity.server.app import build_server_app
from fedparity.server.fpfl_checkpoint import load_checkpoint
from tests.test_html_report import assert_report_matches_results

REPO = Path(__file__).resolve().parents[1]
SMALL = {
    "task": "fpfl",
    "dataset": "synthetic",
    "users-per-node": 200,
    "fpfl-cohort-size": 150,
    "fpfl-client-seed": 7,
    "reply-timeout": 60.0,
}


def checkpoint_weights(folder: Path, config: RunConfig) -> np.ndarray:
    state = load_checkpoint(folder, config)
    assert state is not None
    return state["arrays"]["weights"]


def expected_sgd_weights(
    config: RunConfig, num_nodes: int, rounds: Iterable[Iterable[int]]
) -> np.ndarray:
    """FederatedSGD (fl / fl-clip) recomputed centrally: round t sums the seeded cohorts of
    the partitions listed for it."""
    shards = [node_shard(config, p, num_nodes) for p in range(num_nodes)]
    model = build_model_for(
        config.fpfl_architecture,
        shards[0].features.shape[1:],
        num_classes=shards[0].num_classes,
        seed=config.seed,
    )
    layout = statistics_layout(model, shards[0].num_groups)
    population = sum(shard.num_users for shard in shards)
    rate = config.fpfl_cohort_size / population
    weights = get_flat_parameters(model)
    for round_number, partitions in enumerate(rounds, start=1):
        total = np.zeros(layout.size)
        for partition in partitions:
            shard = shards[partition]
            rng = round_rng(config.fpfl_client_seed, partition, round_number)
            cohort = np.flatnonzero(rng.random(shard.num_users) < rate)
            vectors = user_statistics(
                model,
                shard,
                constraint=config.fpfl_constraint,  # type: ignore[arg-type]
                users=cohort,
            )
            if config.fpfl_clips:
                vectors = clip_statistics(vectors, config.fpfl_clipping_bound).vectors
            total += vectors.sum(dim=0).numpy()
        weights = sgd_update(weights, layout.split(total), config.fpfl_learning_rate)
        set_flat_parameters(model, weights)
    return weights


@pytest.mark.slow
def test_masked_sum_recovers_the_central_statistics(tmp_path: Path) -> None:
    """Without noise, two rounds through pairwise masking give the model that the central
    computation on the same cohorts gives (to the fixed-point tolerance)."""
    overrides = {**SMALL, "fpfl-algorithm": "fl", "fpfl-rounds": 2, "output-dir": str(tmp_path)}
    results = run_simulation_job(overrides, num_supernodes=3)
    config = RunConfig.from_mapping(overrides)
    assert results["private"] is False and results["epsilon"] is None
    assert [entry["replied"] for entry in results["history"]] == [3, 3]
    expected = expected_sgd_weights(config, 3, [range(3), range(3)])
    np.testing.assert_allclose(checkpoint_weights(tmp_path, config), expected, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_masking_equals_the_plain_sum_with_distributed_noise(tmp_path: Path) -> None:
    """Same seeded cohorts and noise shares: the masked path and the plain path end in the
    same FPFL model (MMDM, clipping, distributed noise), to the fixed-point tolerance."""
    weights = {}
    for mode in ("masking", "none"):
        overrides = {
            **SMALL,
            "fpfl-algorithm": "fpfl",
            "fpfl-rounds": 3,
            "fpfl-secure-sum": mode,
            "output-dir": str(tmp_path / mode),
        }
        results = run_simulation_job(overrides, num_supernodes=3)
        weights[mode] = checkpoint_weights(tmp_path / mode, RunConfig.from_mapping(overrides))
        assert results["private"] is True
        assert results["noise_multiplier"] > 0
        expected = privacy_spent(
            noise_multiplier=results["noise_multiplier"],
            sample_rate=150 / 600,
            steps=3,
            delta=1 / 600,
        ).epsilon
        assert results["epsilon"] == pytest.approx(expected)
    assert not np.array_equal(weights["masking"], get_flat_parameters(_initial_model()))
    np.testing.assert_allclose(weights["masking"], weights["none"], rtol=0, atol=1e-8)


def _initial_model():  # noqa: ANN202
    config = RunConfig.from_mapping(SMALL)
    shard = node_shard(config, 0, 3)
    return build_model_for(
        config.fpfl_architecture, shard.features.shape[1:], num_classes=2, seed=config.seed
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        {},  # the paper's algorithm
        {  # configs/adult-fpfl.toml's: the smoothed sums must survive the checkpoint
            "fpfl-statistics-smoothing": 0.9,
            "fpfl-constraint-activation": "counts",
            "fpfl-model-selection": "last",
        },
    ],
    ids=["paper", "smoothed-counts-last"],
)
def test_resume_after_stop_gives_the_uninterrupted_model(tmp_path: Path, variant: dict) -> None:
    base = {
        **SMALL,
        "fpfl-algorithm": "fpfl",
        "fpfl-rounds": 6,
        "fpfl-checkpoint-every": 1,
        **variant,
    }
    whole = run_simulation_job({**base, "output-dir": str(tmp_path / "whole")}, num_supernodes=3)
    stopped = run_simulation_job(
        {**base, "fpfl-stop-after": 3, "output-dir": str(tmp_path / "parts")}, num_supernodes=3
    )
    assert [entry["round"] for entry in stopped["history"]] == [1, 2, 3]
    assert stopped["epsilon"] < whole["epsilon"]  # a run stopped early spent less
    resumed = run_simulation_job(
        {**base, "fpfl-resume": True, "output-dir": str(tmp_path / "parts")}, num_supernodes=3
    )
    assert [entry["round"] for entry in resumed["history"]] == list(range(1, 7))
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"])  # nothing extra spent
    config = RunConfig.from_mapping(base)
    np.testing.assert_array_equal(
        checkpoint_weights(tmp_path / "parts", config),
        checkpoint_weights(tmp_path / "whole", config),
    )
    assert resumed["selected_round"] == whole["selected_round"]
    assert resumed["evaluation"] == whole["evaluation"]
    if variant:
        assert whole["selected_round"] == 6 and whole["model_selection"] == "last"
        assert "smoothed_cohort_gap" in whole["history"][-1]
    # A checkpoint from other settings is refused, naming the setting.
    with pytest.raises(Exception, match="fpfl-resume"):
        run_simulation_job(
            {
                **base,
                "fpfl-resume": True,
                "fpfl-alpha": 0.05,
                "output-dir": str(tmp_path / "parts"),
            },
            num_supernodes=3,
        )


def crash_in_rounds(msg: Message, context: Context, config: RunConfig) -> Message:
    """Partition 1 crashes from round 2 on; partition 2 crashes in round 3."""
    partition = int(context.node_config["partition-id"])
    round_number = int(msg.content.config_records["config"]["round"])  # type: ignore[arg-type]
    if (partition == 1 and round_number >= 2) or (partition == 2 and round_number == 3):
        raise RuntimeError(f"simulated crash in round {round_number}")
    return fpfl_round(msg, context, config)


@pytest.mark.slow
def test_dropouts_are_unmasked_only_while_enough_nodes_survive(tmp_path: Path) -> None:
    """4 nodes, dropout tolerance 0.25 (3 survivors needed). Round 2 loses one node: the
    survivors attest the view, reveal that round's seeds and the sum of the 3 is recovered
    exactly. Round 3 loses two: the 2 survivors hold 2 of the t = 3 shares of each self-mask,
    so nobody is asked to reveal anything, the round is lost (reported) and the model does
    not move."""
    overrides = {
        **SMALL,
        "fpfl-algorithm": "fl-clip",
        "fpfl-rounds": 3,
        "fpfl-dropout-tolerance": 0.25,
        "output-dir": str(tmp_path),
    }
    run_simulation(
        server_app=build_server_app(overrides),
        client_app=build_client_app(overrides, handlers={"query.fpfl_round": crash_in_rounds}),
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    results = json.loads((tmp_path / "results.json").read_text())
    history = results["history"]
    assert [entry["replied"] for entry in history] == [4, 3, 2]
    assert "lost" not in history[1]
    # the crash reaches the server as a fixed sentence: its text stays in the node's log
    reasons = [item["reason"] for item in history[1]["rejected"]]
    assert any(INTERNAL_ERROR_TEXT in reason for reason in reasons)
    assert not any("simulated crash" in reason for reason in reasons)
    assert "cannot rebuild the self-mask" in history[2]["lost"]
    assert "share threshold 3" in history[2]["lost"]
    config = RunConfig.from_mapping(overrides)
    expected = expected_sgd_weights(config, 4, [range(4), (0, 2, 3)])
    np.testing.assert_allclose(checkpoint_weights(tmp_path, config), expected, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_fpfl_reduces_the_fnr_gap_of_fl_on_adult(adult_path: Path, tmp_path: Path) -> None:
    """A short run on federated UCI Adult, same seed: FPFL (epsilon = 2) ends with a smaller
    test-set FNR gap than FL."""
    common = {
        "task": "fpfl",
        "dataset": "adult",
        "data-dir": str(adult_path),
        "fpfl-cohort-size": 1000,
        "fpfl-rounds": 120,
        "fpfl-client-seed": 1,
        "reply-timeout": 120.0,
    }
    fl = run_simulation_job(
        {**common, "fpfl-algorithm": "fl", "output-dir": str(tmp_path / "fl")}, num_supernodes=4
    )
    fpfl = run_simulation_job(
        {**common, "fpfl-algorithm": "fpfl", "output-dir": str(tmp_path / "fpfl")},
        num_supernodes=4,
    )
    assert fpfl["epsilon"] <= 2.0
    assert fl["fnr_gap"] > 0.08
    assert fpfl["fnr_gap"] < fl["fnr_gap"] - 0.05
    assert fpfl["accuracy"] > 0.78
    assert (tmp_path / "fpfl" / "training.png").read_bytes()[:4] == b"\x89PNG"
    # report.html: the test-set FNR gap against alpha, and the paper's unconstrained baseline
    # (PFL at m = 1000); FL itself is the unconstrained baseline.
    assert fpfl["fairness_constraint"]["unconstrained_baseline"]["algorithm"] == "pfl"
    assert assert_report_matches_results(tmp_path / "fpfl").values["baseline-gap"][0] == 0.148
    assert_report_matches_results(tmp_path / "fl")


@pytest.mark.slow
def test_flwr_run_with_the_named_synthetic_config(tmp_path: Path) -> None:
    """`flwr run . --run-config configs/fpfl-synthetic.toml` through the real CLI (wrapped by
    ``fedparity run``, which exits 0 for a completed run): progress per round, the result
    table and results.json with the documented keys."""
    import tomllib

    from tests.support.flower_processes import local_simulation

    with (REPO / "configs" / "fpfl-synthetic.toml").open("rb") as handle:
        run_config = tomllib.load(handle)
    output = tmp_path / "run"
    run_config.update({"fpfl-rounds": 8, "output-dir": str(output)})
    with local_simulation(REPO, 3, tmp_path / "flwr-home") as simulation:
        wrapped = simulation.run_fedparity(run_config, timeout=600)
    assert wrapped.returncode == 0, wrapped.stdout[-3000:] + wrapped.stderr
    assert re.search(r"fedparity run: run \d+ finished:completed", wrapped.stderr)
    output_text = wrapped.stdout
    assert "\x1b[" not in output_text  # colour codes only on a terminal (issue 32)
    # num-supernodes is set: Flower's "default ... changed from 10 to 2" does not apply
    assert "changed from 10 to 2" not in output_text and "federation size" not in output_text
    results = json.loads((output / "results.json").read_text())
    for key in (
        "accuracy",
        "fnr_gap",
        "eo_gap",
        "demp_gap",
        "pp_gap",
        "epsilon",
        "delta",
        "noise_multiplier",
    ):
        assert isinstance(results[key], float), key
    assert 0 < results["epsilon"] <= 2.0
    assert results["delta"] == pytest.approx(1 / 3000)
    assert results["population"]["nodes"] == 3 and results["population"]["users"] == 3000
    assert "round    8: cohort loss" in output_text and "FPFL result (fpfl" in output_text
    assert (output / "training.png").read_bytes()[:4] == b"\x89PNG"
    # report.html and the log: alpha, the test-set FNR gap and whether the constraint holds.
    constraint = results["fairness_constraint"]
    assert constraint["alpha"] == 0.02 and constraint["test_gap"] == results["fnr_gap"]
    assert constraint["holds_on_test_set"] == (results["fnr_gap"] <= 0.02)
    assert_report_matches_results(output, output_text)


@pytest.mark.slow
def test_central_noise_by_a_trusted_aggregator(tmp_path: Path) -> None:
    """fpfl-noise = central: the nodes add no share and the server adds N(0, C^2 sigma^2)
    to the recovered sum; with the PRV accountant the reported epsilon is Opacus' PRV
    bound for the rounds run."""
    overrides = {
        **SMALL,
        "fpfl-algorithm": "pfl",
        "fpfl-rounds": 3,
        "fpfl-noise": "central",
        "fpfl-accountant": "prv",
        "output-dir": str(tmp_path),
    }
    results = run_simulation_job(overrides, num_supernodes=3)
    assert results["privacy"]["noise"] == "central"
    assert results["privacy"]["noise_share_std"] == 0.0
    assert any("trusted aggregator" in note for note in results["privacy"]["caveats"])
    expected = privacy_spent(
        noise_multiplier=results["noise_multiplier"],
        sample_rate=150 / 600,
        steps=3,
        delta=1 / 600,
        accountant="prv",
    ).epsilon
    assert results["epsilon"] == pytest.approx(expected)
    # Same cohorts without noise (fl-clip) recomputed centrally: the noisy model differs
    # from it by the noise only, never equals it.
    config = RunConfig.from_mapping({**overrides, "fpfl-algorithm": "fl-clip"})
    noiseless = expected_sgd_weights(config, 3, [range(3)] * 3)
    assert not np.allclose(
        checkpoint_weights(tmp_path, RunConfig.from_mapping(overrides)), noiseless
    )


@pytest.mark.slow
def test_unfair_digits_config_trains_with_three_groups(tmp_path: Path) -> None:
    """configs/fpfl-digits.toml (the unfair-FEMNIST stand-in: CNN, accuracy parity, three
    writer groups) for a few rounds through Flower: every round is released, the multipliers
    are one per group, and the test-set report has accuracy parity over three groups."""
    import tomllib

    with (REPO / "configs" / "fpfl-digits.toml").open("rb") as handle:
        run_config = tomllib.load(handle)
    rounds = 3
    results = run_simulation_job(
        {
            **run_config,
            "fpfl-rounds": rounds,
            "fpfl-client-seed": 0,
            "reply-timeout": 300.0,
            "output-dir": str(tmp_path / "digits"),
        },
        num_supernodes=3,
    )
    assert results["algorithm"] == "ffl" and results["private"] is False
    assert results["epsilon"] is None and results["noise_multiplier"] is None
    history = results["history"]
    assert [entry["round"] for entry in history] == list(range(1, rounds + 1))
    assert all("lost" not in entry and entry["replied"] == 3 for entry in history), history
    assert all(len(entry["multipliers"]) == 3 for entry in history)
    selected = results["evaluation"]["selected"]
    assert len(selected["group_accuracy"]) == 3
    assert 0.0 <= results["accuracy"] <= 1.0
    gap = max(abs(results["accuracy"] - acc) for acc in selected["group_accuracy"])
    assert results["accuracy_gap"] == pytest.approx(gap, abs=1e-12)
    assert results["fnr_gap"] is None  # FNR is a binary-label metric
    assert (tmp_path / "digits" / "training.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_unmasked_sums_below_n_min_are_not_released(tmp_path: Path) -> None:
    """fpfl-secure-sum = "none" with distributed noise: a round with fewer than n_min nodes
    (here 2 of 4, n_min = 3) would carry less noise than the accountant assumes, so it is
    lost like a masked round whose survivors refuse to unmask; 3 of 4 is enough."""
    overrides = {
        **SMALL,
        "fpfl-algorithm": "pfl",
        "fpfl-secure-sum": "none",
        "fpfl-rounds": 3,
        "fpfl-dropout-tolerance": 0.25,
        "output-dir": str(tmp_path),
    }
    run_simulation(
        server_app=build_server_app(overrides),
        client_app=build_client_app(overrides, handlers={"query.fpfl_round": crash_in_rounds}),
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    history = json.loads((tmp_path / "results.json").read_text())["history"]
    assert [entry["replied"] for entry in history] == [4, 3, 2]
    assert "lost" not in history[0] and "lost" not in history[1]
    assert "fewer than n_min = 3" in history[2]["lost"], history[2]
