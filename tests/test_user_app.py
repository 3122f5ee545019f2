"""A user's own Flower app (``tests/user_app``: flat layout, its own model and data files)
adds all three of fedparity's capabilities through the public API -- the LDP audit, the
FedEvalFair test and FPFL training -- and runs through ``flwr run`` on the simulation engine.

The nodes' own data folder, secret key and identity keys reach them through the environment
their runtime was started with (a node-side setting), never through the run config.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fedparity.clients import LocalUsers
from fedparity.clients.fedevalfair import rows_statistics
from fedparity.clients.fedevalfair_handlers import FEF_SECRET_CONTEXT_REFUSAL
from fedparity.clients.identity import IDENTITY_DIR_ENV
from fedparity.mechanisms.crypto.ckks import KeyPaths, generate_keys
from fedparity.mechanisms.fairness_tests.fedevalfair import fedevalfair
from fedparity.mechanisms.ldp.sequential import STOP_REASONS
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent
from fedparity.mechanisms.protocol import BLOCKS
from fedparity.server.cli.identity import write_node_identities
from tests.support.flower_processes import local_simulation

APP = Path(__file__).resolve().parent / "user_app"
NUM_NODES = 4


def user_task() -> ModuleType:
    """The app's own task.py, imported from its folder (the app is not installed)."""
    spec = importlib.util.spec_from_file_location("userapp_task", APP / "task.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_user_app_imports_only_the_public_api() -> None:
    for name in ("client.py", "server.py"):
        source = (APP / name).read_text(encoding="utf-8")
        imports = [line for line in source.splitlines() if "fedparity" in line and "import" in line]
        assert imports, name
        for line in imports:
            module = line.split()[1]
            assert module.split(".")[:2] in (
                ["fedparity", "clients"],
                ["fedparity", "strategies"],
                ["fedparity", "mechanisms"],
            ), line
            # public names only: no module-private imports and no project app internals
            assert ".app" not in module and "._" not in module and "config" not in module, line


def federation(tmp_path: Path, secret: Path | None = None) -> tuple[ModuleType, KeyPaths, dict]:
    """The user's task, the CKKS keys and the nodes' environment: their data, the secret
    context (``secret``, default the generated one) and the holders' identity keys and roster
    (FedEvalFair against an active server)."""
    task = user_task()
    data = tmp_path / "data"
    data.mkdir()
    task.write_population(data, NUM_NODES)
    keys = generate_keys(tmp_path / "keys")
    identities = write_node_identities(tmp_path / "identity", NUM_NODES)
    env = {
        "USERAPP_DATA_DIR": str(data),
        "USERAPP_SECRET_CONTEXT": str(keys.secret if secret is None else secret),
        IDENTITY_DIR_ENV: str(identities),
    }
    return task, keys, env


@pytest.mark.slow
def test_user_app_runs_the_audit_and_fedevalfair_through_flwr_run(tmp_path: Path) -> None:
    task, keys, env = federation(tmp_path)
    data = tmp_path / "data"
    output = tmp_path / "out"
    with local_simulation(APP, NUM_NODES, tmp_path / "flwr-home", env=env) as simulation:
        run = simulation.run(
            {
                "public-context": str(keys.public),
                "output-dir": str(output),
                "num-nodes": NUM_NODES,
            },
            timeout=600,
        )
    assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((output / "results.json").read_text())

    # What the test knows and the server does not: every node's rows and predictions.
    arrays = task.trained_arrays()
    rows = [task.load_rows(str(data), node) for node in range(NUM_NODES)]
    predictions = [task.predict(arrays, r["features"]) for r in rows]

    # LDP audit: the private estimate is within 5 standard errors of the true accuracy gap
    # (false failure ~6e-7; the perturbation uses OS entropy and cannot be seeded).
    means: dict[int, list[float]] = {0: [], 1: []}
    for r, p in zip(rows, predictions, strict=True):
        users = LocalUsers.from_rows(
            groups=r["group"],
            labels=r["label"],
            predictions=p,
            metric="accuracy",
            user_ids=r["user"],
        )
        for group in (0, 1):
            means[group].extend(users.metrics[users.groups == group])
    true_gap = float(np.mean(means[0]) - np.mean(means[1]))
    assert true_gap > 0.05
    ldp = results["ldp"]
    assert ldp["nodes_replied"] == NUM_NODES and ldp["rejected"] == 0
    assert abs(ldp["difference"] - true_gap) < 5 * ldp["stderr"]

    # The sequential audit went through Flower: node sizes, whole batches, a stop by its rules,
    # and every asked user counted (each node asks a user at most once per audit).
    sequential = results["sequential"]
    # (not "a batch came back incomplete": every node answered every batch whole)
    assert sequential["stopped_because"] != STOP_REASONS[3], sequential["summary"]
    assert sorted(sequential["users_by_node"].values()) == sorted(
        len(np.unique(r["user"])) for r in rows
    )
    assert sum(sequential["asked_by_node"].values()) == sequential["users_asked"]
    assert sequential["result"]["users_asked"] == sequential["users_asked"]
    assert sequential["users_asked"] % 150 == 0 and sequential["users_asked"] <= 1200
    low, high = sequential["result"]["interval"]
    assert low <= sequential["result"]["estimate"] <= high

    # FedEvalFair: the encrypted protocol's report equals the plaintext FedEvalFair of the
    # same holders' statistics (same bootstrap seeds as the app's client.py).
    fef = results["fedevalfair"]
    assert fef["error"] is None
    assert [len(set(nodes)) for nodes in fef["participants"][:2]] == [NUM_NODES, NUM_NODES]
    assert set(fef["participants"][0]) == set(fef["participants"][1])
    statistics = [
        rows_statistics(
            r["label"],
            p,
            r["group"],
            num_resamples=50,
            rng=np.random.default_rng([7, node]),
            min_cell_count=5,
        )
        for node, (r, p) in enumerate(zip(rows, predictions, strict=True))
    ]
    by_block = {(b["metric"], b["mode"]): b for b in fef["blocks"]}
    compared = 0
    for index, (metric, mode) in enumerate(BLOCKS):
        summaries = [s.summaries[index] for s in statistics if s.summaries[index] is not None]
        report = by_block[(metric, mode)]["report"]
        if len(summaries) < 2 or report is None:
            continue
        plain = fedevalfair(summaries, mode=mode).to_dict()  # type: ignore[arg-type]
        for test in ("homogeneity", "common_disparity"):
            # within the release's flooding noise (about 5 times larger since round 2 carries the
            # random-effects grid: a Q of 205 came out 3e-6 relative off once)
            assert report[test]["pvalue"] == pytest.approx(plain[test]["pvalue"], abs=1e-5)
            assert report[test]["statistic"] == pytest.approx(
                plain[test]["statistic"], rel=2e-5, abs=1e-9
            )
        compared += 1
    assert compared >= 2  # at least the calibrated dp and eo blocks were checked

    # FPFL: three masked rounds with every node's noise share, none lost; the accounted
    # epsilon is the target the nodes calibrated their own noise for.
    fpfl = results["fpfl"]
    assert fpfl["rounds"] == [1, 2, 3] and fpfl["lost"] == 0
    assert fpfl["replied"] == [NUM_NODES] * 3
    assert fpfl["weights_finite"] and fpfl["weights_moved"] > 0
    assert fpfl["noise_multiplier"] > 0 and fpfl["epsilon"] <= 2.0 + 0.01
    # The library's default observer kept the release ledger and the checkpoint.
    assert fpfl["rounds_released"] == 3
    training = output / "fpfl-training"
    assert json.loads((training / "privacy-ledger.json").read_text())["rounds_released"] == 3
    assert json.loads((training / "checkpoint.json").read_text())["round"] == 3
    expected = privacy_spent(
        noise_multiplier=fpfl["noise_multiplier"],
        sample_rate=300 / fpfl["population"],
        steps=3,
        delta=1 / fpfl["population"],
    )
    assert fpfl["epsilon"] == pytest.approx(expected.epsilon, rel=1e-9)


@pytest.mark.slow
def test_a_holder_without_its_key_is_one_line_on_the_node_and_a_whole_sentence_on_the_server(
    tmp_path: Path,
) -> None:
    """Issue 28: forgetting the FedEvalFair keys in simulation printed about 290 lines of
    tracebacks and the server's warning clipped at both ends. Now each refusal is one line and
    the server's outcome carries the holders' fixed sentence whole."""
    _, keys, env = federation(tmp_path, secret=tmp_path / "no-such-key.tenseal")  # the mistake
    output = tmp_path / "out"
    with local_simulation(APP, NUM_NODES, tmp_path / "flwr-home", env=env) as simulation:
        run = simulation.run(
            {"public-context": str(keys.public), "output-dir": str(output), "num-nodes": NUM_NODES},
            timeout=600,
        )
    assert run.status == "finished:completed", run.output[-3000:]
    fef = json.loads((output / "results.json").read_text())["fedevalfair"]
    assert fef["error"] is not None and "round 1" in fef["error"]
    assert fef["rejected"] and set(fef["rejected"]) == {FEF_SECRET_CONTEXT_REFUSAL}
    assert "Traceback" not in run.output, run.output[-3000:]
    assert f"a ClientApp refused: {FEF_SECRET_CONTEXT_REFUSAL}" in run.output
    assert len(run.output.splitlines()) < 120  # 276 before, 23 of them the job's own lines
