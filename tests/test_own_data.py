"""A node's own data file (node config ``data-file``): the schema, every way a file can be
unusable (a message naming the file and the column, never a fallback to embedded data), the
built-in ClientApp on it, and a SuperLink with three SuperNodes that each read their own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedparity.clients.app import describe, ldp_audit
from fedparity.clients.project.config import RunConfig
from fedparity.clients.project.own_data import (
    DataFileError,
    own_fpfl_shard,
    own_shard,
    read_data_file,
)
from fedparity.clients.project.task import build_model, get_arrays
from fedparity.mechanisms import RandomizedResponseMechanism
from fedparity.strategies.ldp_audit import LdpGapAudit
from tests.support.flower_processes import local_deployment

REPO = Path(__file__).resolve().parents[1]
HEADER = "user,group,label,split,age,score"


def write_csv(path: Path, lines: list[str], header: str = HEADER) -> Path:
    path.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return path


def population_csv(path: Path, users: int, seed: int, rows: int = 4) -> Path:
    """Users with train and test rows; group 1's score is a noisier signal of the label."""
    rng = np.random.default_rng(seed)
    lines = []
    for user in range(users):
        group = int(rng.integers(0, 2))
        for row in range(rows):
            label = int(rng.integers(0, 2))
            score = (2 * label - 1) + rng.normal(0, 2.0 if group else 0.5)
            split = "train" if row < rows // 2 else "test"
            user_id = seed * 10_000 + user
            lines.append(f"{user_id},{group},{label},{split},{rng.normal():.4f},{score:.4f}")
    return write_csv(path, lines)


def test_rows_become_users_of_each_split(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "rows.csv",
        ["7,1,1,train,0.5,1.5", "7,1,0,test,0.25,-1", "3,0,1,test,1,2", "3,0,0,train,2,0"],
    )
    rows = read_data_file(path)
    assert rows.feature_names == ("age", "score")
    test = own_shard(rows, "test", num_groups=2)
    assert test.user_ids.tolist() == [3, 7] and test.user_groups.tolist() == [0, 1]
    assert test.labels.tolist() == [0, 1]  # rows in file order: user 7's, then user 3's
    assert test.user_index.tolist() == [1, 0]
    np.testing.assert_array_equal(test.features, np.array([[0.25, -1], [1, 2]], np.float32))
    assert own_shard(rows, "train", num_groups=2).num_samples == 2


def test_a_device_without_user_and_split_columns_is_one_user(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "one.csv", ["1,1,3.5", "1,0,2.5"], header="group,label,x")
    shard = own_shard(read_data_file(path), "test", num_groups=2)
    assert shard.num_users == 1 and shard.num_samples == 2 and shard.user_groups.tolist() == [1]


@pytest.mark.parametrize(
    ("header", "lines", "message"),
    [
        ("user,group,split,age", ["1,0,train,2"], "column 'label' is missing"),
        ("user,grp,label,age", ["1,0,1,2"], "column 'group' is missing"),
        ("user,group,label", ["1,0,1"], "no feature column"),
        (HEADER, [], "no data rows"),
        (HEADER, ["1,0,1,train,abc,2"], "column 'age' must be numeric (data row 1: 'abc')"),
        (HEADER, ["1,0,2,train,1,2"], "column 'label' must hold only 0 and 1"),
        (HEADER, ["1,-1,1,train,1,2"], "column 'group' must hold integers >= 0"),
        (HEADER, ["1.5,0,1,train,1,2"], "column 'user' must hold whole numbers"),
        (HEADER, ["1,0,1,valid,1,2"], "column 'split' must hold 'train' or 'test'"),
        (HEADER, ["1,0,1,train,1"], "row 2 has 5 values, the header has 6"),
        (HEADER, ["1,0,1,train,inf,2"], "column 'age' must hold finite numbers"),
    ],
)
def test_an_unusable_file_names_the_file_and_the_column(
    tmp_path: Path, header: str, lines: list[str], message: str
) -> None:
    path = write_csv(tmp_path / "bad.csv", lines, header=header)
    with pytest.raises(DataFileError) as raised:
        read_data_file(path)
    assert message in str(raised.value) and str(path) in str(raised.value)


def test_missing_empty_and_unknown_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="no such file .*data-file"):
        read_data_file(tmp_path / "absent.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataFileError, match="empty.csv: the file is empty"):
        read_data_file(tmp_path / "empty.csv")
    (tmp_path / "rows.xlsx").write_text("x")
    with pytest.raises(DataFileError, match="must end in .csv, .parquet or .pq"):
        read_data_file(tmp_path / "rows.xlsx")


def test_groups_beyond_num_groups_and_users_in_two_groups_are_refused(tmp_path: Path) -> None:
    rows = read_data_file(write_csv(tmp_path / "g.csv", ["1,2,1,test,1,1"]))
    with pytest.raises(
        DataFileError, match=r"groups in \[0, 2\) \(node config num-groups = 2\), got 2"
    ):
        own_shard(rows, "test", num_groups=2)
    rows = read_data_file(write_csv(tmp_path / "u.csv", ["1,0,1,test,1,1", "1,1,0,test,1,1"]))
    with pytest.raises(DataFileError, match="rows of a user must share one group"):
        own_shard(rows, "test", num_groups=2)


def test_parquet_gives_the_same_rows_as_csv(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (fedparity[parquet])")
    import pyarrow.parquet as parquet

    csv_rows = read_data_file(population_csv(tmp_path / "rows.csv", users=20, seed=1))
    table = pyarrow.table(
        {
            "user": csv_rows.users,
            "group": csv_rows.groups,
            "label": csv_rows.labels,
            "split": csv_rows.splits,
            "age": csv_rows.features[:, 0],
            "score": csv_rows.features[:, 1],
        }
    )
    parquet.write_table(table, tmp_path / "rows.parquet")
    rows = read_data_file(tmp_path / "rows.parquet")
    assert rows.feature_names == csv_rows.feature_names
    np.testing.assert_array_equal(rows.features, csv_rows.features)
    np.testing.assert_array_equal(rows.users, csv_rows.users)
    np.testing.assert_array_equal(rows.splits, csv_rows.splits)
    text = pyarrow.table({"group": [0], "label": [1], "age": ["old"]})
    parquet.write_table(text, tmp_path / "text.parquet")
    with pytest.raises(DataFileError, match="column 'age' must be numeric"):
        read_data_file(tmp_path / "text.parquet")


# --- the built-in ClientApp ------------------------------------------------------------------


def node_context(node_config: dict[str, object]) -> Context:
    return Context(
        run_id=1,
        node_id=5,
        # num-groups: the node's own number of groups, required with a data-file
        node_config={"partition-id": 0, "num-partitions": 1, "num-groups": 2, **node_config},
        state=RecordDict(),
        run_config={"epsilons": "1", "user-budget": 3.0},
    )


@pytest.mark.usefixtures("task_identity")
def test_the_client_app_audits_the_nodes_own_file(tmp_path: Path) -> None:
    path = population_csv(tmp_path / "mine.csv", users=30, seed=4)
    context = node_context({"data-file": str(path), "ledger-dir": str(tmp_path / "ledgers")})
    config = RunConfig.from_mapping(context.run_config)
    request = Message(content=RecordDict({}), dst_node_id=5, message_type="query.describe")
    described = describe(request, context, config).content.metric_records["metrics"]
    assert described["num-users"] == 30 and described["num-features"] == 2
    assert described["own-data"] == 1
    mechanism = RandomizedResponseMechanism(0.5, 0.5)
    arrays = get_arrays(build_model(2, seed=0))
    message = LdpGapAudit(mechanism, budget=mechanism.epsilon).configure_audit(
        ArrayRecord(arrays), [5]
    )[0]
    reply = ldp_audit(message, context, config)
    metrics = reply.content.metric_records["metrics"]
    assert metrics["num-reports"] == 30  # accuracy is defined for every user


@pytest.mark.usefixtures("task_identity")
def test_a_missing_file_stops_the_node_and_never_falls_back(tmp_path: Path) -> None:
    context = node_context({"data-file": str(tmp_path / "gone.csv")})
    config = RunConfig.from_mapping(context.run_config)
    request = Message(content=RecordDict({}), dst_node_id=5, message_type="query.describe")
    with pytest.raises(DataFileError, match="gone.csv: no such file"):
        describe(request, context, config)
    fpfl = RunConfig.from_mapping({"task": "fpfl"})
    with pytest.raises(DataFileError, match="gone.csv: no such file"):
        describe(request, context, fpfl)


@pytest.mark.usefixtures("task_identity")
def test_fpfl_nodes_describe_their_own_files_train_rows(tmp_path: Path) -> None:
    path = population_csv(tmp_path / "mine.csv", users=12, seed=4)
    context = node_context({"data-file": str(path)})
    request = Message(content=RecordDict({}), dst_node_id=5, message_type="query.describe")
    fpfl = RunConfig.from_mapping({"task": "fpfl"})
    described = describe(request, context, fpfl).content.metric_records["metrics"]
    rows = read_data_file(path)
    train = rows.splits == "train"
    assert described["own-data"] == 1 and described["num-users"] == 12
    assert described["num-train-samples"] == int(train.sum()) == 24
    assert list(described["sample-shape"]) == [2] and described["num-classes"] == 2
    shard = own_fpfl_shard(rows, num_groups=2)
    np.testing.assert_array_equal(shard.labels, rows.labels[train])
    np.testing.assert_array_equal(shard.groups, rows.groups[train])
    assert shard.num_users == 12 and shard.features.dtype == np.float32


@pytest.mark.slow
def test_fpfl_trains_on_each_nodes_own_file_through_flower(tmp_path: Path) -> None:
    """Three simulated nodes, each with its own CSV (node config data-file), run the built-in
    ClientApp's FPFL handlers: one masked round with every user in the cohort and no noise
    recovers exactly the sum of the clipped statistic vectors of the files' train rows."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedparity.clients.app import HANDLERS
    from fedparity.clients.fpfl_task import (
        build_model_for,
        get_flat_parameters,
        set_flat_parameters,
        shard_contribution,
        statistics_layout,
    )
    from fedparity.server.orchestration import wait_for_nodes
    from fedparity.strategies import FPFLProtocol, FPFLRunParameters

    files = [
        population_csv(tmp_path / f"node-{i}.csv", users=20 + 5 * i, seed=i + 1) for i in range(3)
    ]
    run_config = {
        "task": "fpfl",
        "fpfl-algorithm": "fl-clip",  # clipped sums, no noise: the sum is checked exactly
        "fpfl-cohort-size": 1000,  # m >= K: every user joins
        "fpfl-rounds": 1,
    }
    config = RunConfig.from_mapping(run_config)
    client_app = ClientApp()
    for action in ("fpfl_setup", "fpfl_keys", "fpfl_round", "fpfl_confirm", "fpfl_reveal"):

        def handle(msg: Message, context: Context, action: str = action) -> Message:
            partition = int(context.node_config["partition-id"])
            context.node_config["data-file"] = str(files[partition])  # the node's own config
            context.node_config["num-groups"] = 2
            return HANDLERS[f"query.{action}"](msg, context, config)

        client_app.query(action)(handle)

    model = build_model_for("shallow", (2,), num_classes=2, seed=config.seed)
    weights = get_flat_parameters(model)
    layout = statistics_layout(model, 2)
    outcomes: list = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        parameters = FPFLRunParameters.for_training(
            population_size=20 + 25 + 30,
            cohort_size=config.fpfl_cohort_size,
            rounds=config.fpfl_rounds,
            clipping_bound=config.fpfl_clipping_bound,
            epsilon=None,
            constraint=config.fpfl_constraint,
            num_groups=2,
            vector_size=layout.size,
            dropout_tolerance=config.fpfl_dropout_tolerance,
        )
        protocol = FPFLProtocol(
            grid,
            node_ids=wait_for_nodes(grid, 3, timeout=60),
            parameters=parameters,
            reply_timeout=120.0,
        )
        protocol.setup()
        outcomes.append(protocol.run_round(1, weights))

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    (outcome,) = outcomes
    assert outcome.total is not None and len(outcome.replied) == 3, outcome.reason
    expected = np.zeros(layout.size)
    for file in files:
        local = build_model_for("shallow", (2,), num_classes=2, seed=config.seed)
        set_flat_parameters(local, weights)
        shard = own_fpfl_shard(read_data_file(file), num_groups=2)
        expected += shard_contribution(
            local, shard, constraint="fnr", clipping_bound=config.fpfl_clipping_bound
        ).total
    np.testing.assert_allclose(outcome.total, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_three_supernodes_each_read_their_own_file(tmp_path: Path) -> None:
    files = [
        population_csv(tmp_path / f"node-{i}.csv", users=100 + 50 * i, seed=i) for i in range(3)
    ]
    # The nodes also train the FedAvg round on their own files: their operators allow plain
    # (non-private) FedAvg, which the built-in policy refuses (tests/test_training_gate.py).
    node_configs = [
        f'partition-id={i} num-partitions=3 allow-non-private=true num-groups=2 data-file="{path}"'
        for i, path in enumerate(files)
    ]
    output = tmp_path / "run"
    # ClientApps forked from a warm zygote (fedparity-superexec --executor warm): the same app
    # and node configs, started faster
    with local_deployment(REPO, 3, node_configs, tmp_path / "flwr-home", warm=True) as deployment:
        run = deployment.run(
            {
                "output-dir": str(output),
                "num-server-rounds": 1,
                "epsilons": "4",
                "user-budget": 4.0,
                "min-nodes": 3,
            },
            timeout=600,
        )
        assert run.status == "finished:completed", run.output[-3000:]
    results = json.loads((output / "results.json").read_text())
    assert results["num_nodes"] == 3 and results["num_users"] == 100 + 150 + 200
    assert results["ground_truth"] is None  # the harness knows no node's own file
    audit = results["audits"][0]
    assert audit["accepted_nodes"] == 3 and audit["rejected_replies"] == []
    assert audit["estimate"] is not None
    assert "harness skipped" in run.output
