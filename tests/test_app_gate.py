"""The app gate (fedparity.clients.app_gate): a SuperNode runs only the app bundles its operator
approved, by SHA-256 in ``allowed-apps`` of the node's policy.

The attack: in Flower the server ships the ClientApp code. The run's bundle names its own
``clientapp``; the SuperNode installs the bundle and imports it beside the node's data, keys and
secret context. Before the gate, a node ran whatever bundle the server sent (the ungated node of
the deployment test still does: its marker file appears). Here the checks run on real bundle
bytes built by Flower's builder, with Flower's real installer, and, in the deployment test,
through a real SuperLink and SuperNodes with ``flower-supernode --isolation process`` and
``fedparity-superexec``.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import get_project_dir
from flwr.supercore.fab import Fab
from flwr.supercore.run import Run

from fedparity.clients import app_gate
from fedparity.clients.app_gate import (
    APP_REFUSED_TEXT,
    CHECKED_FLOWER,
    AppGate,
    app_bundle_hash,
    app_hash_main,
    bundle_files,
    check_app_bundle,
    check_flower,
    install_gate,
)
from fedparity.clients.messages import NodeRefusal
from fedparity.clients.policy import POLICY_ENV, NodePrivacyPolicy
from fedparity.mechanisms.protocol.object_pulls import (
    OBJECT_POLL_BUSY_MAX,
    OBJECT_POLL_FIRST,
    OBJECT_POLL_MAX,
    POLL_COST_FACTOR,
    PromptObjectPulls,
    object_poll_interval,
)
from tests.support.flower_processes import flower_executable, local_deployment, run_flwr
from tests.support.virtual_clock import VirtualClock

GATE_APP = Path(__file__).resolve().parent / "gate_app"
MARKER = "hostile-clientapp-ran"
#: The ClientApp a hostile server ships instead of the approved one: importing it writes a
#: marker into the node's home (it could as well read the node's keys and data).
HOSTILE_CLIENT = textwrap.dedent(
    f'''
    """A ClientApp the node's operator never approved."""
    import os
    from pathlib import Path

    (Path.home() / "{MARKER}").write_text(str(os.getpid()))

    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()


    @app.query()
    def query(msg, context):
        return Message(RecordDict({{"gate": ConfigRecord({{"ran": "hostile"}})}}), reply_to=msg)
    '''
)


def hostile_app(folder: Path) -> Path:
    """The approved app with its ClientApp replaced: same name and version, another bundle."""
    app = folder / "gateapp"
    shutil.copytree(GATE_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "gateapp" / "client_app.py").write_text(HOSTILE_CLIENT, encoding="utf-8")
    return app


@pytest.fixture(scope="module")
def approved_fab() -> bytes:
    return build_fab_from_disk(GATE_APP)


@pytest.fixture(scope="module")
def hostile_fab(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_fab_from_disk(hostile_app(tmp_path_factory.mktemp("hostile")))


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def allowing(*contents: bytes) -> NodePrivacyPolicy:
    return NodePrivacyPolicy(allowed_apps=tuple(sha256(c) for c in contents), source="test")


def refused(call, *args, **kwargs) -> str:
    """The text of the NodeRefusal ``call`` raises (fails if it raises nothing)."""
    with pytest.raises(NodeRefusal) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ------------------------------------------------------------------------------ the check


def test_an_approved_bundle_passes_with_the_hash_flower_gives_it(approved_fab: bytes) -> None:
    digest = check_app_bundle(approved_fab, sha256(approved_fab), allowing(approved_fab))
    # Flower names a bundle by the SHA-256 of its bytes (flwr run, the SuperLink, the installer)
    assert digest == sha256(approved_fab) == app_bundle_hash(GATE_APP)


def test_a_bundle_not_in_allowed_apps_is_refused_with_the_fixed_sentence(
    approved_fab: bytes, hostile_fab: bytes
) -> None:
    # Before the gate, the node installed and imported it.
    policy = allowing(approved_fab)
    assert refused(check_app_bundle, hostile_fab, sha256(hostile_fab), policy) == APP_REFUSED_TEXT


def test_a_bundle_whose_bytes_are_not_the_hash_the_run_names_is_refused(
    approved_fab: bytes, hostile_fab: bytes
) -> None:
    # Flower installs a bundle under the hash of its bytes but loads the ClientApp from the
    # folder of the hash the run names: a mismatch would load another folder's code.
    both = allowing(approved_fab, hostile_fab)
    claimed = sha256(approved_fab)
    assert refused(check_app_bundle, hostile_fab, claimed, both) == APP_REFUSED_TEXT
    assert refused(check_app_bundle, approved_fab, claimed.upper(), both) == APP_REFUSED_TEXT


def test_without_allowed_apps_every_bundle_is_refused(approved_fab: bytes) -> None:
    for policy in (NodePrivacyPolicy(), NodePrivacyPolicy.simulation()):
        assert not policy.allowed_apps
        text = refused(check_app_bundle, approved_fab, sha256(approved_fab), policy)
        assert text == APP_REFUSED_TEXT


# ------------------------------------------------------ the gate around Flower's installer


def pulled(content: bytes, node_config: dict | None = None, **run_fields) -> tuple:
    """What Flower's ``pull_task_input`` returns for a run of ``content`` (real Flower types)."""
    fields = {"fab_id": "fedparity-tests/gateapp", "fab_version": "1.0.0", **run_fields}
    run = replace(Run.create_empty(7), fab_hash=sha256(content), **fields)
    context = Context(7, 1, dict(node_config or {}), RecordDict(), {})
    message = object()  # passed through untouched (a real one needs a running task)
    return message, context, run, Fab(sha256(content), content, {})


@pytest.fixture
def flwr_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.delenv(POLICY_ENV, raising=False)
    # the gate stops its ClientApp process from writing bytecode: not this test process
    monkeypatch.setattr(sys, "dont_write_bytecode", sys.dont_write_bytecode)
    return home


def gate_for(task: tuple, environ: dict[str, str] | None = None) -> AppGate:
    from flwr.cli.install import install_from_fab

    gate = AppGate(lambda client: task, install_from_fab, environ or {})
    assert gate.pull_task_input(client=None) == task
    return gate


def installed_apps(flwr_home: Path) -> list[str]:
    apps = flwr_home / "apps"
    return sorted(p.name for p in apps.iterdir()) if apps.exists() else []


def test_the_gate_installs_an_approved_bundle_where_flower_loads_it(
    approved_fab: bytes, flwr_home: Path
) -> None:
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})  # policy key in node config
    installed = gate_for(task).install_from_fab(approved_fab, skip_prompt=True)
    run, fab = task[2], task[3]
    assert installed == get_project_dir(run.fab_id, run.fab_version, fab.hash_str)
    assert (installed / "gateapp" / "client_app.py").is_file()


def test_the_gate_refuses_before_any_byte_of_the_bundle_is_written(
    approved_fab: bytes, hostile_fab: bytes, flwr_home: Path, tmp_path: Path
) -> None:
    # Before the gate, Flower's installer unpacked it into FLWR_HOME/apps and the loader
    # imported its ClientApp.
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(f'allowed-apps = ["{sha256(approved_fab)}"]\n', encoding="utf-8")
    task = pulled(hostile_fab)
    gate = gate_for(task, {POLICY_ENV: str(policy_file)})  # the SuperExec's environment
    assert refused(gate.install_from_fab, hostile_fab, skip_prompt=True) == APP_REFUSED_TEXT
    assert installed_apps(flwr_home) == []
    # the node config's policy wins over the environment's, as for every other limit
    gate = gate_for(pulled(approved_fab, {"allowed-apps": ""}), {POLICY_ENV: str(policy_file)})
    assert refused(gate.install_from_fab, approved_fab, skip_prompt=True) == APP_REFUSED_TEXT
    assert installed_apps(flwr_home) == []


def test_the_gate_refuses_when_the_policy_cannot_be_read(
    approved_fab: bytes, flwr_home: Path, tmp_path: Path
) -> None:
    task = pulled(approved_fab, {"privacy-policy": str(tmp_path / "missing.toml")})
    assert refused(gate_for(task).install_from_fab, approved_fab) == APP_REFUSED_TEXT
    assert installed_apps(flwr_home) == []


def test_a_run_that_names_another_app_than_its_bundle_is_refused(
    approved_fab: bytes, flwr_home: Path
) -> None:
    # Flower loads the ClientApp from the folder of the run's app id and version: a run naming
    # another app would load another folder's code than the approved bundle's.
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)}, fab_id="other/app")
    assert refused(gate_for(task).install_from_fab, approved_fab) == APP_REFUSED_TEXT
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)}, fab_version="2.0.0")
    assert refused(gate_for(task).install_from_fab, approved_fab) == APP_REFUSED_TEXT
    assert installed_apps(flwr_home) == []  # refused before anything was written


def test_the_gate_installs_only_the_pulled_bundle(
    approved_fab: bytes, hostile_fab: bytes, flwr_home: Path
) -> None:
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    assert refused(gate_for(task).install_from_fab, hostile_fab) == APP_REFUSED_TEXT
    from flwr.cli.install import install_from_fab

    never_pulled = AppGate(lambda client: task, install_from_fab, {})
    assert refused(never_pulled.install_from_fab, approved_fab) == APP_REFUSED_TEXT
    assert installed_apps(flwr_home) == []


class CountingInstaller:
    """Flower's ``install_from_fab``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs) -> Path:
        from flwr.cli.install import install_from_fab

        self.calls += 1
        return install_from_fab(*args, **kwargs)


def test_an_approved_bundle_is_unpacked_once_and_checked_for_every_message(
    approved_fab: bytes, flwr_home: Path
) -> None:
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    flower = CountingInstaller()
    folders = []
    for _ in range(3):  # three messages of the run, each its own ClientApp process
        gate = AppGate(lambda client: task, flower, {})
        gate.pull_task_input(None)
        folders.append(gate.install_from_fab(approved_fab, skip_prompt=True))
    assert flower.calls == 1 and len(set(folders)) == 1
    assert installed_apps(flwr_home) == [folders[0].name]  # no temporary folder left
    assert (folders[0] / "gateapp" / "client_app.py").is_file()
    # other bytes under the approved hash are refused although the approved bundle is installed
    tampered = approved_fab[:-1] + bytes([approved_fab[-1] ^ 1])
    forged = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    forged = (*forged[:3], Fab(sha256(approved_fab), tampered, {}))
    gate = AppGate(lambda client: forged, flower, {})
    gate.pull_task_input(None)
    assert refused(gate.install_from_fab, tampered, skip_prompt=True) == APP_REFUSED_TEXT
    # and so is the approved bundle once the node's policy no longer lists it
    gate = AppGate(lambda client: pulled(approved_fab, {"allowed-apps": ""}), flower, {})
    gate.pull_task_input(None)
    assert refused(gate.install_from_fab, approved_fab, skip_prompt=True) == APP_REFUSED_TEXT
    assert flower.calls == 1


def test_a_folder_flower_installed_before_the_gate_is_used_if_it_holds_the_bundles_files(
    approved_fab: bytes, flwr_home: Path
) -> None:
    from flwr.cli.install import install_from_fab

    folder = install_from_fab(approved_fab, skip_prompt=True)  # plain Flower, before the gate
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    flower = CountingInstaller()
    gate = AppGate(lambda client: task, flower, {})
    gate.pull_task_input(None)
    assert gate.install_from_fab(approved_fab, skip_prompt=True) == folder
    assert flower.calls == 0  # Flower's installer would keep the folder anyway
    # the earlier gate's marker, or Python's bytecode cache from a run without the gate, are
    # files that are not the bundle's: refused, and the log says which and where
    for stray in (".fedparity-bundle-sha256", "gateapp/__pycache__/client_app.cpython-311.pyc"):
        (folder / stray).parent.mkdir(exist_ok=True)
        (folder / stray).write_bytes(b"")
        gate = AppGate(lambda client: task, flower, {})
        gate.pull_task_input(None)
        assert refused(gate.install_from_fab, approved_fab, skip_prompt=True) == APP_REFUSED_TEXT
        (folder / stray).unlink()
    assert flower.calls == 0


# ------------------------------------ what Flower loads: the installed folder (review L3)

#: The query a server sends (answered by the approved ClientApp with its name).
QUERY = RecordDict({"gate": ConfigRecord({"ask": "ran"})})


@pytest.fixture
def clientapp_process(
    flwr_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task_identity: None
) -> Path:
    """This process as a fresh ClientApp process for each message: no module of the test app
    imported, bytecode written as Python does by default, ``sys.path`` restored after the
    test; ``$HOME`` (where the hostile ClientApp writes its marker) is returned."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(sys, "path", list(sys.path))
    # Python's default (this environment may set PYTHONDONTWRITEBYTECODE): caches are written
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    forget_the_app()
    yield home
    forget_the_app()


def forget_the_app() -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "gateapp"]:
        del sys.modules[name]


def one_message(task: tuple) -> str:
    """One message through the gate and Flower's own loader, as Flower's ClientApp process
    runs them (``run_clientapp``: pull, install, load the ClientApp from the run's app folder,
    call it): the reply's answer. Each call is a new process: no module of the app imported."""
    from flwr.clientapp.utils import get_load_client_app_fn

    forget_the_app()
    gate = gate_for(task)
    _, context, run, fab = task
    gate.install_from_fab(fab.content, skip_prompt=True)
    load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    client_app = load(run.fab_id, run.fab_version, fab.hash_str)
    message = Message(QUERY, dst_node_id=1, message_type="query")
    message.metadata.__dict__["_message_id"] = message.object_id  # as pulled messages have
    reply = client_app(message=message, context=context)
    return str(reply.content.config_records["gate"]["ran"])


def plant_changed_module(folder: Path) -> None:
    """The approved bundle's ClientApp module, rewritten in place."""
    (folder / "gateapp" / "client_app.py").write_text(HOSTILE_CLIENT, encoding="utf-8")


def plant_bytecode(folder: Path) -> None:
    """A bytecode cache of another ClientApp beside the unchanged approved module, stamped
    with that module's time and size: Python imports the cache and never reads the source."""
    from importlib._bootstrap_external import _code_to_timestamp_pyc
    from importlib.util import cache_from_source

    source = folder / "gateapp" / "client_app.py"
    code = compile(HOSTILE_CLIENT, str(source), "exec")
    info = source.stat()
    cache = Path(cache_from_source(str(source)))
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(_code_to_timestamp_pyc(code, int(info.st_mtime), info.st_size))


@pytest.mark.parametrize("plant", [plant_changed_module, plant_bytecode])
def test_code_planted_in_an_approved_bundles_folder_is_refused_before_it_is_imported(
    plant, approved_fab: bytes, clientapp_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review L3: Flower keeps an app's installed folder and imports the ClientApp from it;
    the gate checked only the pulled bundle's bytes. Someone who can write the node's
    ``$FLWR_HOME`` plants code there under the approved bundle's name: before the folder
    check the next message ran it (the marker appeared, the reply was the planted app's)."""
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    assert one_message(task) == "gateapp 1.0.0"  # installs the approved bundle
    assert one_message(task) == "gateapp 1.0.0"  # the gate's own loads leave it exact
    run, fab = task[2], task[3]
    folder = get_project_dir(run.fab_id, run.fab_version, fab.hash_str)
    plant(folder)
    flwr_logger = logging.getLogger("flwr")  # Flower's logger does not propagate to the root
    flwr_logger.addHandler(caplog.handler)
    try:
        assert refused(one_message, task) == APP_REFUSED_TEXT
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert not (clientapp_process / MARKER).exists()
    assert not [name for name in sys.modules if name.split(".")[0] == "gateapp"]
    lines = {r.getMessage() for r in caplog.records}  # once, whether or not Flower propagates
    [line] = [text for text in lines if "does not hold exactly" in text]
    assert str(folder) in line and "gateapp/" in line and sha256(approved_fab) in line


def test_an_approved_bundles_folder_is_checked_against_every_file_of_the_bundle(
    approved_fab: bytes, flwr_home: Path
) -> None:
    task = pulled(approved_fab, {"allowed-apps": sha256(approved_fab)})
    folder = gate_for(task).install_from_fab(approved_fab, skip_prompt=True)
    files = bundle_files(approved_fab)
    # the folder holds the bundle's members but its manifest (.info), byte for byte
    with zipfile.ZipFile(io.BytesIO(approved_fab)) as bundle:
        members = {m for m in bundle.namelist() if not m.startswith(".info/")}
    assert set(files) == members and "pyproject.toml" in files
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == members
    for name, change in [
        ("gateapp/server_app.py", lambda p: p.unlink()),  # missing
        ("gateapp/__init__.py", lambda p: p.write_bytes(p.read_bytes() + b"\n")),  # changed
        ("pyproject.toml", lambda p: p.write_bytes(p.read_bytes().replace(b"1.0.0", b"1.0.1"))),
        ("gateapp/extra.py", lambda p: p.write_text("")),  # an extra module
        ("gateapp/client_app.py", lambda p: (p.unlink(), p.symlink_to(folder / "x.py"))),
    ]:
        original = files.get(name)
        path = folder / name
        change(path)
        gate = gate_for(task)
        assert refused(gate.install_from_fab, approved_fab, skip_prompt=True) == APP_REFUSED_TEXT
        if path.is_symlink() or path.exists():
            path.unlink()
        if original is not None:
            path.write_bytes(original)
        assert gate_for(task).install_from_fab(approved_fab, skip_prompt=True) == folder
    # a folder without files holds no code and is accepted
    (folder / "gateapp" / "empty").mkdir()
    assert gate_for(task).install_from_fab(approved_fab, skip_prompt=True) == folder


# ------------------------------------------------- the ClientApp's pulls of message objects


class SlowSuperNode:
    """A Runtime API client whose objects become available ``ready_after`` seconds after the
    first request (as when the SuperNode is still pulling them from the SuperLink); counts the
    ``PullObject`` requests."""

    def __init__(self, ready_after: float, found: bool = True) -> None:
        self.ready_after = ready_after
        self.found = found
        self.requests = 0
        self.first: float | None = None
        self.lock = threading.Lock()
        self.other = object()

    def PullObject(self, request):  # noqa: N802 - Flower's name
        from flwr.proto.message_pb2 import PullObjectResponse

        with self.lock:
            self.requests += 1
            now = time.monotonic()
            self.first = now if self.first is None else self.first
        available = self.found and now - self.first >= self.ready_after
        return PullObjectResponse(
            object_found=self.found,
            object_available=available,
            object_content=request.object_id.encode() if available else b"",
        )


def pull_all(client, objects: int = 8, workers: int = 4) -> tuple[dict, float]:
    """Flower's own ``pull_objects`` (the one ``pull_task_input`` runs) through ``client``:
    the contents and the seconds it took."""
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    ids = [f"object-{i}" for i in range(objects)]
    start = time.monotonic()
    contents = pull_objects(
        ids,
        make_pull_object_fn_protobuf(client.PullObject, Node(node_id=1), 7),
        max_concurrent_pulls=workers,
    )
    return contents, time.monotonic() - start


def test_an_object_the_supernode_does_not_hold_yet_is_read_promptly() -> None:
    # Flower 1.41 waits 1 s (+-20%), then 2 s, between requests for an object that is not
    # there yet: with objects ready after 0.3 s its pull takes at least 0.8 s.
    flower, flower_seconds = pull_all(slow := SlowSuperNode(0.3))
    assert flower_seconds >= 0.8 and len(flower) == 8
    prompt = PromptObjectPulls(slow := SlowSuperNode(0.3))
    contents, seconds = pull_all(prompt)
    assert contents == flower  # the same objects, through Flower's own checks
    # read at most one pause (50 ms) after they arrived, plus scheduling slack
    assert seconds < 0.3 + OBJECT_POLL_MAX + 0.25
    # one thread asks while the others wait: 8 first requests, about 24 re-asks in 0.3 s
    # (a pause is a tenth of the time waited, 5 to 50 ms), one more per waiting object
    assert slow.requests <= 8 + 40 + 8
    assert prompt.other is slow.other  # every other attribute is the client's


def test_prompt_pulls_give_the_wait_back_to_flower_after_the_window() -> None:
    start = time.monotonic()
    response = PromptObjectPulls(SlowSuperNode(60.0), window=0.2).PullObject(request())
    assert not response.object_available and 0.2 <= time.monotonic() - start < 1.0
    # an object the SuperNode does not know is Flower's error at once, never waited for
    gone = SlowSuperNode(0.0, found=False)
    assert not PromptObjectPulls(gone).PullObject(request()).object_found
    assert gone.requests == 1
    with pytest.raises(ValueError, match="window must be > 0"):
        PromptObjectPulls(gone, window=0.0)


class CostlySuperNode:
    """A Runtime API client on a virtual clock whose every ``PullObject`` takes ``cost``
    seconds (the serving process's work) and whose object is available from ``ready_at``."""

    def __init__(self, clock: VirtualClock, ready_at: float, cost: float) -> None:
        self.clock, self.ready_at, self.cost = clock, ready_at, cost
        self.requests = 0

    def PullObject(self, request):  # noqa: N802 - Flower's name
        from flwr.proto.message_pb2 import PullObjectResponse

        self.requests += 1
        self.clock.now += self.cost
        available = self.clock.now >= self.ready_at
        return PullObjectResponse(
            object_found=True,
            object_available=available,
            object_content=request.object_id.encode() if available else b"",
        )


@pytest.mark.parametrize("cost", [0.0, 0.001, 0.015, 0.1])
def test_re_asks_for_an_object_are_spaced_by_ten_times_their_cost(cost: float) -> None:
    """On a 2-core machine a request costs the Flower process serving it 5-15 ms of CPU; ten
    ClientApps (or SuperNodes) re-asking every 5 ms would keep it busy serving re-asks instead
    of the upload they wait for. The pause is at least ten times the last request's duration
    (at most 0.25 s) and otherwise unchanged: at most 1/(11 cost) requests a second, and the
    object read at most one pause and one request after it arrived."""
    clock = VirtualClock(1000.0)
    node = CostlySuperNode(clock, ready_at=1000.0 + 2.0, cost=cost)
    prompt = PromptObjectPulls(node, clock=clock.monotonic, sleep=clock.sleep)
    response = prompt.PullObject(request())
    assert response.object_available
    pause_floor = max(min(POLL_COST_FACTOR * cost, OBJECT_POLL_BUSY_MAX), OBJECT_POLL_FIRST)
    seconds = clock.now - 1000.0
    lag = max(pause_floor, OBJECT_POLL_MAX)
    assert 2.0 <= seconds <= 2.0 + lag + 2 * cost + 1e-9
    # the pauses of the old rule alone (a tenth of the time waited, 5 to 50 ms) ask ~80 times
    # in 2 s whatever the cost; with the floor at most 2 s / (pause + cost), plus the first
    assert node.requests <= 2.0 / (max(pause_floor, OBJECT_POLL_FIRST) + cost) + 2
    if 0 < POLL_COST_FACTOR * cost <= OBJECT_POLL_BUSY_MAX:  # the floor is not capped
        assert node.requests <= 2.0 / (11 * cost) + 2
    assert object_poll_interval(0.0, cost) == pytest.approx(pause_floor)


def request():
    from flwr.proto.message_pb2 import PullObjectRequest

    return PullObjectRequest(object_id="object-0")


def test_the_gate_pulls_through_prompt_object_pulls() -> None:
    seen = []
    task = (object(), object(), object(), object())
    gate = AppGate(lambda client: seen.append(client) or task, lambda *a: Path(), {})
    client = SlowSuperNode(0.0)
    assert gate.pull_task_input(client) == task
    assert isinstance(seen[0], PromptObjectPulls) and seen[0].other is client.other


# ------------------------------------------------------------ what the gate relies on in Flower


def test_install_gate_replaces_the_two_names_in_flowers_clientapp_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.cli.install import install_from_fab
    from flwr.supernode.runtime import run_clientapp

    for name in ("pull_task_input", "install_from_fab"):  # restored after the test
        monkeypatch.setattr(run_clientapp, name, getattr(run_clientapp, name))
    assert run_clientapp.install_from_fab is install_from_fab
    gate = install_gate({})
    assert run_clientapp.install_from_fab == gate.install_from_fab
    assert run_clientapp.pull_task_input == gate.pull_task_input
    assert install_gate({}) is gate  # idempotent
    check_flower()  # still passes with the gate in place


def test_flowers_clientapp_process_pulls_then_installs_then_loads_inside_one_try() -> None:
    """Fails when Flower changes what the gate relies on (checked against Flower 1.41): the
    bundle is installed by the module's ``install_from_fab`` right after the module's
    ``pull_task_input`` and before anything of it is loaded, inside the ``try`` whose
    ``except`` replies to the pulled message with the exception's text; the ClientApp is
    loaded from the folder the gate checks."""
    from flwr.supernode.runtime import run_clientapp

    source = textwrap.dedent(inspect.getsource(run_clientapp.run_clientapp))
    function = ast.parse(source).body[0]
    (block,) = [node for node in function.body if isinstance(node, ast.Try)]
    calls = [
        ast.unparse(node.func)
        for statement in block.body
        for node in ast.walk(statement)
        if isinstance(node, ast.Call)
    ]
    pull, install = calls.index("pull_task_input"), calls.index("install_from_fab")
    assert calls.count("pull_task_input") == 1 and calls.count("install_from_fab") == 1
    assert set(calls[:pull]) == {"HeartbeatSender", "make_task_heartbeat_fn_http"} | {
        "heartbeat_sender.start"
    }
    assert set(calls[pull + 1 : install]) <= {"log"}
    assert calls.index("load_client_app_fn") > install
    assert calls.index("client_app") > install
    # the ClientApp is imported from the folder of the run's app id, version and hash, the
    # folder the gate checks (check_installed_app), and only from there
    body = "\n".join(ast.unparse(statement) for statement in block.body)
    assert "get_load_client_app_fn(default_app_ref='', app_path=None, multi_app=True)" in body
    assert "load_client_app_fn(run.fab_id, run.fab_version, fab.hash_str)" in body
    from flwr.clientapp import utils

    loader = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(utils))))
    assert "runtime_app_dir = get_project_dir(fab_id, fab_version, fab_hash)" in loader
    assert "load_app(client_app_ref, LoadClientAppError, runtime_app_dir)" in loader
    pulled_names = [
        ast.unparse(node.targets[0])
        for node in block.body
        if isinstance(node, ast.Assign) and "pull_task_input" in ast.unparse(node.value)
    ]
    assert pulled_names == ["(message, context, run, fab)"]
    (handler,) = block.handlers
    assert ast.unparse(handler.type) == "Exception"
    handler_source = ast.unparse(handler)
    assert "Message(Error(code=e_code, reason=reason), reply_to=message)" in handler_source
    assert 'reason = str(type(ex)) + ":<\'" + str(ex) + "\'>"' in handler_source


def test_flowers_superexec_starts_clientapps_by_the_command_table() -> None:
    """Fails when Flower's subprocess executor stops reading the table that
    ``fedparity-superexec`` points at ``fedparity-clientapp`` (checked against Flower 1.41)."""
    from flwr.supercore import constant
    from flwr.supercore.superexec.executor import subprocess_executor

    assert constant.TASK_TYPE_TO_COMMAND[constant.TaskType.CLIENT_APP] == "flwr-clientapp"
    assert subprocess_executor.TASK_TYPE_TO_COMMAND is constant.TASK_TYPE_TO_COMMAND
    source = textwrap.dedent(inspect.getsource(subprocess_executor.SubprocessExecutor.launch))
    (args,) = [
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "args"
    ]
    assert ast.unparse(args.elts[0]) == "TASK_TYPE_TO_COMMAND[spec.task_type]"


def test_the_gate_refuses_to_start_under_another_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_gate, "version", lambda name: "1.42.0")
    with pytest.raises(RuntimeError, match=rf"checked against Flower {CHECKED_FLOWER}.*1\.42\.0"):
        check_flower()
    with pytest.raises(SystemExit, match="fedparity-clientapp: .*refusing to start"):
        app_gate.clientapp_main()


# ------------------------------------------------------------------------- the commands


def test_app_hash_of_a_bundle_file_and_of_its_folder_agree(
    approved_fab: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fab = tmp_path / "gateapp.fab"
    fab.write_bytes(approved_fab)
    app_hash_main([str(fab), str(GATE_APP)])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{sha256(approved_fab)}  {fab}", f"{sha256(approved_fab)}  {GATE_APP}"]
    (tmp_path / "notes.txt").write_text("not a bundle")
    for bad, says in (("notes.txt", "not a Flower app bundle"), ("gone.fab", "no such file")):
        with pytest.raises(SystemExit) as caught:
            app_hash_main([str(tmp_path / bad)])
        assert caught.value.code == 2
        assert says in capsys.readouterr().err


@pytest.mark.slow  # two interpreters importing Flower: over 5 s
def test_fedparity_superexec_checks_its_policy_file_before_starting(tmp_path: Path) -> None:
    command = [flower_executable("fedparity-superexec"), "--runtime-api-address", "127.0.0.1:1"]
    bad = tmp_path / "policy.toml"
    bad.write_text('allowed-apps = ["not-a-hash"]\n', encoding="utf-8")
    result = subprocess.run(
        [*command, "--privacy-policy", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--privacy-policy: privacy-policy key allowed-apps must hold SHA-256" in result.stderr
    result = subprocess.run(
        [*command, "--executor", "kubernetes"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--executor must be subprocess" in result.stderr


# --------------------------------------------------------------------------- deployment


@pytest.mark.slow  # a real SuperLink and two SuperNodes, three runs: about 80 s
def test_a_gated_supernode_refuses_an_unapproved_bundle_and_runs_the_approved_one(
    tmp_path: Path,
) -> None:
    """A real SuperLink and two SuperNodes: node 0 started as the operator's docs say
    (``flower-supernode --isolation process`` and ``fedparity-superexec --privacy-policy FILE``
    whose ``allowed-apps`` holds the approved bundle's hash), node 1 as Flower's default. The
    server ships the approved app with another ClientApp: node 1 runs it (its marker appears:
    what every node did before the gate), node 0 answers with the fixed sentence and neither
    installs nor imports it. The approved bundle then runs on both. Then another ClientApp is
    written into the approved bundle's installed folder on both nodes (review L3): node 1 runs
    it, node 0 refuses the message with the fixed sentence and logs the folder."""
    policy = tmp_path / "policy.toml"
    policy.write_text(f'allowed-apps = ["{app_bundle_hash(GATE_APP)}"]\n', encoding="utf-8")
    hostile = hostile_app(tmp_path / "server")
    gated = ["fedparity-superexec", "--privacy-policy", str(policy)]
    work = tmp_path / "deployment"
    with local_deployment(
        GATE_APP, 2, None, tmp_path / "flwr-home", work_dir=work, superexecs=[gated, None]
    ) as dep:
        gated_id, open_id = (str(node) for node in dep.node_ids)

        def replies(app: Path, name: str) -> dict[str, str]:
            out = tmp_path / name
            config = {"output-dir": str(out), "min-nodes": 2}
            run_flwr(app, dep.federation, config, dep.flwr_home, timeout=180)
            return json.loads((out / "replies.json").read_text(encoding="utf-8"))

        answers = replies(hostile, "hostile")
        assert answers[open_id] == "answered: hostile"
        assert (work / "supernode-1" / MARKER).is_file()  # the attack, on the ungated node
        expected = (
            f"refused: <class 'fedparity.clients.messages.NodeRefusal'>:<'{APP_REFUSED_TEXT}'>"
        )
        assert answers[gated_id] == expected
        assert not (work / "supernode-0" / MARKER).exists()
        assert installed_apps(work / "supernode-0") == []

        answers = replies(GATE_APP, "approved")
        assert answers == {gated_id: "answered: gateapp 1.0.0", open_id: "answered: gateapp 1.0.0"}
        assert installed_apps(work / "supernode-0") == [
            f"fedparity-tests.gateapp.1.0.0.{app_bundle_hash(GATE_APP)[:8]}"
        ]
        assert not (work / "supernode-0" / MARKER).exists()
        assert dep.superexecs[0].alive()
        log = dep.superexecs[0].log_text()
        assert "app gate: refused the app bundle" in log and "is in allowed-apps" in log

        # review L3: another ClientApp written into the approved bundle's installed folder
        # on both nodes. Flower keeps the folder and imports it: node 1 runs the planted code.
        (work / "supernode-1" / MARKER).unlink()
        folder = f"fedparity-tests.gateapp.1.0.0.{app_bundle_hash(GATE_APP)[:8]}"
        for node in ("supernode-0", "supernode-1"):
            plant_changed_module(work / node / "apps" / folder)
        answers = replies(GATE_APP, "planted")
        assert answers[open_id] == "answered: hostile"
        assert (work / "supernode-1" / MARKER).is_file()
        assert answers[gated_id] == expected
        assert not (work / "supernode-0" / MARKER).exists()
        log = dep.superexecs[0].log_text()
        assert f"{folder}, does not hold exactly its files (gateapp/client_app.py" in log


def test_a_serverapps_grid_reads_reply_objects_promptly() -> None:
    """A ServerApp's grid against a SuperLink (Flower's ``HttpGrid``) pulled each reply's
    objects with Flower's 1 s, then 2 s waits for an object still being uploaded: with 10 nodes
    the replies of one exchange were read over about 4 s. ``prompt_object_pulls`` wraps the
    connected client once (Flower's own ``pull_objects`` through it then takes about the upload
    time), and leaves a grid with no client yet, or the simulation's grid, as it is."""
    from flwr.superlink.grid.http_grid import HttpGrid

    from fedparity.strategies.replies import prompt_object_pulls

    grid = HttpGrid(token="t")
    prompt_object_pulls(grid)  # not connected: nothing to wrap
    assert grid._client is None
    slow = SlowSuperNode(0.3)
    grid._client = slow  # type: ignore[assignment]
    prompt_object_pulls(grid)
    prompt_object_pulls(grid)  # once only
    wrapped = grid._runtime_client
    assert isinstance(wrapped, PromptObjectPulls) and wrapped._client is slow
    contents, seconds = pull_all(wrapped)
    assert len(contents) == 8 and seconds < 0.3 + OBJECT_POLL_MAX + 0.25

    class SimulationGrid:  # no Runtime API client
        pass

    simulation = SimulationGrid()
    prompt_object_pulls(simulation)  # type: ignore[arg-type]
    assert not hasattr(simulation, "_client")


def test_the_test_supernodes_pull_message_objects_promptly() -> None:
    """The tests' SuperNodes (``tests/support/fast_supernode.py``) pull a message's objects
    through Flower's ``make_pull_object_fn_protobuf`` over a promptly re-asking ``PullObject``:
    an object uploaded 0.3 s after the first request is returned, not left to Flower's 1 s
    back-off (Flower's function raises ``ObjectUnavailableError`` at once)."""
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from tests.support.fast_supernode import _flower_pull_fn, _prompt_pull_fn

    slow = SlowSuperNode(0.3)
    started = time.monotonic()
    content = _prompt_pull_fn(slow.PullObject, Node(node_id=1), 1)("object-1")
    assert content == b"object-1" and time.monotonic() - started < 0.3 + OBJECT_POLL_MAX + 0.25
    with pytest.raises(ObjectUnavailableError):  # Flower's own asks once
        _flower_pull_fn(SlowSuperNode(0.3).PullObject, Node(node_id=1), 1)("object-1")
