"""A node downloads only into its own data folder (security review 2026-11-26, finding L2).

On the reviewed main a run config with ``data-dir`` and ``download = true`` made an
embedded-data node create that folder, wherever the server named it, and fetch UCI Adult into
it. A node now reads the run's ``data-dir`` only; it downloads into its own folder (node config
``adult-dir``, default ``~/.fedparity/data/adult``). Driven through the project's ClientApp
(``describe`` of the LDP audit, FedEvalFair and FPFL jobs), with the real Adult files, and a
real HTTP server on 127.0.0.1 standing in for UCI.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict

from fedparity.clients.app import app
from fedparity.clients.project.data import ADULT_FILES
from fedparity.clients.project.data import adult as adult_module

pytestmark = pytest.mark.usefixtures("task_identity")

TASKS = ("ldp-audit", "fedevalfair", "fpfl")


def describe(node_config: dict[str, object], run_config: dict[str, object]) -> dict:
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 0, "num-partitions": 2, **node_config},
        state=RecordDict(),
        run_config=run_config,
    )
    message = Message(content=RecordDict({}), dst_node_id=5, message_type="query.describe")
    message.metadata.__dict__["_message_id"] = "describe"
    return dict(app(message, context).content.metric_records["metrics"])


def adult_run(task: str, data_dir: Path) -> dict[str, object]:
    return {"task": task, "dataset": "adult", "data-dir": str(data_dir), "download": True}


def copy_adult(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for name in ADULT_FILES:
        shutil.copy(source / name, target / name)
    return target


@pytest.fixture
def uci(adult_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real HTTP server on 127.0.0.1 serving UCI's file layout (a temporary copy of the
    shared files) as the download source; yields the folder it serves."""
    served = copy_adult(adult_path, tmp_path / "served")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(adult_module, "ADULT_URL", f"http://127.0.0.1:{server.server_address[1]}/")
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_chosen_data_dir_is_never_created_the_node_downloads_into_its_own(
    uci: Path, tmp_path: Path
) -> None:
    """The attack: ``data-dir = <any folder>`` with ``download = true``. Before, the node
    created it and wrote UCI Adult there; now it stays absent and the files land in the node's
    own folder (node config ``adult-dir``), from which every job reads them."""
    chosen = tmp_path / "chosen-by-the-server" / "anywhere"
    own = tmp_path / "node-data"
    for task in TASKS:
        described = describe({"adult-dir": str(own)}, adult_run(task, chosen))
        assert described["num-users"] > 0, task
    assert not (tmp_path / "chosen-by-the-server").exists()
    assert sorted(path.name for path in own.iterdir()) == sorted(ADULT_FILES)


def test_without_adult_dir_the_node_downloads_into_its_default_folder(
    uci: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    chosen = tmp_path / "chosen"
    assert describe({}, adult_run("ldp-audit", chosen))["num-users"] > 0
    assert not chosen.exists()
    default = tmp_path / "home" / ".fedparity" / "data" / "adult"
    assert sorted(path.name for path in default.iterdir()) == sorted(ADULT_FILES)


def test_a_data_dir_that_holds_the_files_is_only_read(adult_path: Path, tmp_path: Path) -> None:
    """The run's folder with the files is read where it is: nothing is fetched, nothing is
    written there nor into the node's own folder."""
    readable = copy_adult(adult_path, tmp_path / "readable")
    before = {path.name: path.stat().st_mtime_ns for path in readable.iterdir()}
    own = tmp_path / "node-data"
    for task in TASKS:
        assert describe({"adult-dir": str(own)}, adult_run(task, readable))["num-users"] > 0
    assert {path.name: path.stat().st_mtime_ns for path in readable.iterdir()} == before
    assert not own.exists()


def test_a_relative_adult_dir_is_refused_with_a_fixed_sentence(tmp_path: Path) -> None:
    """A node's own folder must be absolute (the SuperNode's working folder is not the
    operator's); the server reads only the fixed internal sentence."""
    from fedparity.clients.app import node_adult_dir
    from fedparity.clients.messages import INTERNAL_ERROR_TEXT, NodeRefusal

    context = Context(1, 5, {"adult-dir": "relative/adult"}, RecordDict(), {})
    with pytest.raises(ValueError, match="node config adult-dir must be an absolute path"):
        node_adult_dir(context)
    with pytest.raises(NodeRefusal) as refused:
        describe({"adult-dir": "relative/adult"}, adult_run("ldp-audit", tmp_path / "x"))
    assert str(refused.value) == INTERNAL_ERROR_TEXT
    assert not (tmp_path / "x").exists()
