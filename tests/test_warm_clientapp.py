"""The warm ClientApp launcher (fedparity.clients.warm_clientapp): ``fedparity-superexec
--executor warm`` forks each ClientApp process from a zygote that imported Flower, fedparity,
torch and TenSEAL once, instead of starting a fresh interpreter per message.

What must hold: the forked child runs exactly the command line Flower's subprocess executor
would run, behind the same app gate; children of one zygote never share a random stream (the
attack on a pre-forked server: state drawn before the fork repeats in every child); a dead
zygote is replaced and a failed fork falls back to a fresh process; and a real deployment runs
the LDP audit and FPFL to the same results as before (``tests/test_fault_suite.py``, whose
deployments run on this executor, ends with :func:`warm_superexec_checks`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus

from fedparity.clients import app_gate, warm_clientapp
from fedparity.clients.app_gate import APP_REFUSED_TEXT, app_bundle_hash
from fedparity.clients.warm_clientapp import (
    DEFAULT_PRELOAD,
    WarmClientAppExecutor,
    check_fork_platform,
    clientapp_args,
)
from tests.support.flower_processes import flower_executable, local_deployment, run_flwr, wait_for
from tests.support.import_probe import last_line_printed
from tests.test_app_gate import GATE_APP, MARKER, hostile_app, installed_apps

REPO = Path(__file__).resolve().parents[1]
PROBE = "tests.support.warm_probe"


def spec(token: str, **changes: object) -> ExecutionSpec:
    fields: dict = {
        "task_type": TaskType.CLIENT_APP,
        "runtime_api_address": "127.0.0.1:9094",
        "token": token,
        "insecure": True,
        "root_certificates_path": None,
        "runtime_dependency_install": False,
        "parent_pid": None,
        "suppress_output": False,
        "task_id": 7,
    }
    fields.update(changes)
    return ExecutionSpec(**fields)


class RecordingFallback:
    """A stand-in for the subprocess executor: records what it was asked to launch."""

    def __init__(self) -> None:
        self.launched: list[ExecutionSpec] = []

    def launch(self, spec: ExecutionSpec):
        from flwr.supercore.superexec.executor.types import LaunchResult

        self.launched.append(spec)
        return LaunchResult.accepted()


@pytest.fixture
def probe_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Zygotes started now import tests.support.warm_probe (children record instead of running)."""
    out = tmp_path / "probe"
    out.mkdir()
    monkeypatch.setenv("WARM_PROBE_DIR", str(out))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return out


def probe_records(folder: Path, tokens: list[str], timeout: float = 60.0) -> list[dict]:
    paths = [folder / f"{token}.json" for token in tokens]
    wait_for(lambda: all(p.exists() for p in paths), timeout, what="the children's records")
    return [json.loads(p.read_text()) for p in paths]


# ------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"insecure": False, "root_certificates_path": "/etc/ca.pem", "parent_pid": 4242},
        {"insecure": False, "runtime_dependency_install": True, "parent_pid": 1},
    ],
)
def test_the_child_gets_the_command_line_of_flowers_subprocess_executor(
    changes: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(
        subprocess_executor.subprocess, "Popen", lambda args, **kwargs: started.append(args)
    )
    monkeypatch.setitem(subprocess_executor.TASK_TYPE_TO_COMMAND, TaskType.CLIENT_APP, "/x/cmd")
    task = spec("ab" * 16, **changes)
    SubprocessExecutor().launch(task)
    assert clientapp_args(task, "/x/cmd") == started[0]


#: What the project's handlers do first in a ClientApp: build a model (the LDP audit,
#: FedEvalFair, FPFL), compute per-sample gradients with ``torch.func`` (FPFL) and,
#: in an FPFL node's setup, the run's epsilon with Opacus's accountant.
FIRST_CALLS = """
from fedparity.clients.project.task import build_model
build_model(3, 4)
torch.func.vmap(torch.func.jacrev(lambda x: (x ** 2).sum()))(torch.ones(2, 3))
from fedparity.mechanisms.privacy.opacus_accounting import privacy_spent
privacy_spent(noise_multiplier=1.0, sample_rate=0.1, steps=3, delta=1e-3)
"""


def imported_by_first_calls(preload: tuple[str, ...]) -> list[str]:
    """The torch, SymPy, httpcore and Opacus modules :data:`FIRST_CALLS` imports after the
    zygote's preload of ``preload``."""
    code = f"""
import json, sys
from fedparity.clients.warm_clientapp import _preload
_preload({list(preload)!r})
before = set(sys.modules)
import torch
{FIRST_CALLS}
from flwr.supercore.runtime import RuntimeHttpClient
RuntimeHttpClient.from_server_address("127.0.0.1:9", True, None, []).close()
roots = ("torch", "sympy", "mpmath", "httpcore", "h11", "opacus")
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in roots)))
"""
    return json.loads(last_line_printed(code))


@pytest.mark.slow  # two fresh interpreters importing torch: about 15 s
def test_the_zygote_preloads_what_the_first_calls_of_a_clientapp_import() -> None:
    # Measured 2026-11-27: every forked ClientApp imported SymPy (0.4 s) and FPFL's TorchDynamo
    # (0.9 s) itself, on first use, and an FPFL setup Opacus (0.2-0.27 s).
    assert imported_by_first_calls(DEFAULT_PRELOAD) == []
    lazy = (
        "torch._dynamo",
        "httpcore",
        "opacus.accountants",
    )
    without = imported_by_first_calls(tuple(m for m in DEFAULT_PRELOAD if m not in lazy))
    assert {"sympy", "torch._dynamo", "httpcore", "opacus"} <= set(without)  # power check


EXIT_FUNCTIONS = """
import atexit, json, tempfile
from pathlib import Path
import torch, torch._dynamo
from fedparity.clients.warm_clientapp import (
    skip_torch_library_finalizers, torch_library_finalizers)

folder = tempfile.TemporaryDirectory()  # its cleanup is a finalizer that must still run
kept = torch_library_finalizers()
stopped = SKIP and skip_torch_library_finalizers()
atexit._run_exitfuncs()
print(json.dumps({"torch": len(kept), "stopped": stopped, "alive": sum(f.alive for f in kept),
                  "folder_removed": not Path(folder.name).exists()}))
"""


@pytest.mark.slow  # two fresh interpreters importing torch: about 15 s
def test_a_forked_clientapp_exits_without_running_torchs_operator_finalizers() -> None:
    """Measured 2026-11-27: a forked FPFL ClientApp spent 0.04 of its 0.26 CPU-s at exit in
    torch's ``_del_library`` finalizers (deregistering operators in a dying process). They are
    skipped; every other exit function still runs (a temporary folder is still removed)."""
    skipped = json.loads(last_line_printed("SKIP = True" + EXIT_FUNCTIONS))
    assert skipped["torch"] >= 100 and skipped["stopped"] == skipped["torch"]
    assert skipped["alive"] == skipped["torch"]  # none ran at exit
    assert skipped["folder_removed"]
    ran = json.loads(last_line_printed("SKIP = False" + EXIT_FUNCTIONS))  # Python's normal exit
    assert ran["alive"] == 0 and ran["folder_removed"]


def test_other_platforms_are_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(RuntimeError, match="needs Linux or macOS"):
        check_fork_platform()
    with pytest.raises(SystemExit) as exited:
        app_gate.superexec_main(["--runtime-api-address", "127.0.0.1:1", "--executor", "warm"])
    assert exited.value.code == 2


def test_superexec_installs_the_warm_executor_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.supercore import cli
    from flwr.supercore.superexec import run_superexec
    from flwr.supercore.superexec.executor import factory

    installed: list[str] = []
    monkeypatch.setattr(cli, "flower_superexec", lambda: installed.append(sys.argv[-1]))
    monkeypatch.setattr(run_superexec, "get_executor", factory.get_executor)
    # superexec_main also installs its idle task polls there: restored after the test
    monkeypatch.setattr(run_superexec, "time", run_superexec.time)
    monkeypatch.setattr(run_superexec, "_handle_launch_result", run_superexec._handle_launch_result)
    monkeypatch.setitem(subprocess_executor.TASK_TYPE_TO_COMMAND, TaskType.CLIENT_APP, "x")
    app_gate.superexec_main(["--runtime-api-address", "127.0.0.1:1"])
    assert run_superexec.get_executor is factory.get_executor
    app_gate.superexec_main(["--runtime-api-address", "127.0.0.1:1", "--executor", "warm"])
    assert run_superexec.get_executor is not factory.get_executor
    assert installed == ["subprocess", "subprocess"]  # Flower itself runs its subprocess type
    assert hasattr(run_superexec.time, "idle_polls")  # installed twice, no error
    app_gate.superexec_main(["--runtime-api-address", "127.0.0.1:1", "--fixed-task-poll"])


# ---------------------------------------------------------------------------- the zygote


#: Generators a preloaded module holds that a child inherits as they are, and why.
INHERITED_GENERATORS = {
    "tests.support.warm_probe.ZYGOTE_RNG": "the probe's own, made in the zygote: the hazard shown",
    "sympy.core.symbol.Dummy._prng": "drawn once, at import (Dummy._base_dummy_index), never after",
}


@pytest.mark.slow  # a zygote importing torch and TenSEAL, three children: about 10 s
def test_children_of_one_zygote_never_share_a_random_stream(probe_env: Path) -> None:
    """The attack on a pre-forked server: whatever random state exists before the fork is
    copied into every child, so two ClientApps would draw the same noise. The probe's own
    generator made in the zygote shows that the copy is real (identical in every child); every
    source the privacy code uses differs, and so does every global generator the preloaded
    libraries hold (review M2 of 2026-11-28: torch's was shared, so an operator's own app drew
    the same Opacus DP-SGD noise, dropout masks and DataLoader order in every ClientApp)."""
    executor = WarmClientAppExecutor(
        sys.executable, RecordingFallback(), preload=(*DEFAULT_PRELOAD, PROBE)
    )
    try:
        tokens = ["a1" * 16, "b2" * 16, "c3" * 16]
        for token in tokens:
            assert executor.launch(spec(token)).status == LaunchResultStatus.ACCEPTED
        children = probe_records(probe_env, tokens)
        first, second = children[:2]
        assert executor.fallback.launched == []  # all forked, none started afresh
    finally:
        executor.close()
    assert first["pid"] != second["pid"] and executor.zygote_pid is None
    # at the child's exit (after the probe's sys.exit) torch's operator finalizers were
    # stopped before the exit functions ran (test above), and the exit functions did run
    exit_record = json.loads((probe_env / f"{tokens[0]}.exit.json").read_text())
    assert exit_record["torch_finalizers"] >= 100 and exit_record["left_to_run"] == 0
    assert first["argv"] == clientapp_args(spec(tokens[0]), sys.executable)
    assert first["preloaded_app"] and first["threads"] == 1
    # the zygote preloaded Opacus, whose import adds a root handler (every log line twice)
    # unless imported through import_opacus: the child's root logger is a fresh process's
    assert first["preloaded_opacus"] and first["root_handlers"] == []
    # the zygote's pipes to the SuperExec are not in the child (only stdin, stdout, stderr and
    # the descriptor that listed them)
    assert first["stdin"] == "/dev/null" and first["fds"][:3] == [0, 1, 2]
    assert len(first["fds"]) == 4
    assert all(child["zygote_rng"] == first["zygote_rng"] for child in children)  # the hazard
    for source in (
        "secure_generator",
        "default_rng",
        "numpy_global",
        "python_random",
        "secrets",
        "x25519",
    ):
        assert len({json.dumps(child[source]) for child in children}) == 3, source
    # torch's global generator, as an operator's own app draws from it
    for source in ("initial_seed", "rand", "opacus_noise", "dropout_mask", "dataloader_order"):
        assert len({json.dumps(child["torch"][source]) for child in children}) == 3, source
    # every generator a preloaded module holds: none of them is the zygote's in any child
    zygote = first["zygote_generators"]
    assert {"random._inst", "numpy.random.mtrand._rand", "torch.default_generator"} <= set(zygote)
    assert all(child["zygote_generators"] == zygote for child in children)
    for name, before in zygote.items():
        drawn = [child["generators"][name] for child in children]
        if name in INHERITED_GENERATORS:
            assert drawn == [before] * 3, name  # the fingerprint sees a generator copied by fork
        else:
            assert before not in drawn and len(set(drawn)) == 3, name


def test_a_killed_zygote_is_replaced_and_a_failed_fork_starts_a_fresh_process(
    probe_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fallback = RecordingFallback()
    executor = WarmClientAppExecutor(sys.executable, fallback, preload=(PROBE,))
    try:
        first = executor.zygote_pid
        assert first is not None
        executor.launch(spec("c3" * 16))
        probe_records(probe_env, ["c3" * 16])
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: executor._zygote.process.poll() is not None, 10, what="zygote death")
        executor.reconcile()  # what the SuperExec's loop calls before each task poll
        assert executor.restarts == 1 and executor.zygote_pid not in (None, first)
        executor.launch(spec("d4" * 16))
        probe_records(probe_env, ["d4" * 16])
        assert fallback.launched == []

        # a zygote that dies between the check and the fork: this task starts afresh
        os.kill(executor.zygote_pid, signal.SIGKILL)
        executor._zygote.process.wait()
        monkeypatch.setattr(warm_clientapp._Zygote, "alive", lambda self: True)
        task = spec("e5" * 16)
        assert executor.launch(task).status == LaunchResultStatus.ACCEPTED
        assert fallback.launched == [task] and executor.zygote_pid is None
        monkeypatch.undo()
        executor.reconcile()
        assert executor.restarts == 2 and executor.zygote_pid is not None
    finally:
        executor.close()


def test_other_task_types_go_to_the_subprocess_executor(probe_env: Path) -> None:
    fallback = RecordingFallback()
    executor = WarmClientAppExecutor(sys.executable, fallback, preload=(PROBE,))
    try:
        task = spec("f6" * 16, task_type=TaskType.SERVER_APP)
        executor.launch(task)
        assert fallback.launched == [task]
    finally:
        executor.close()


def test_the_zygote_exits_when_the_superexec_goes(probe_env: Path) -> None:
    executor = WarmClientAppExecutor(sys.executable, RecordingFallback(), preload=(PROBE,))
    zygote = executor._zygote
    executor._zygote.wait_ready(60)
    executor.close()
    assert zygote.process.returncode == 0  # ended by the closed pipe, not killed


# ------------------------------------------------------------------------- deployment


@pytest.mark.slow  # a real SuperLink and two SuperNodes, two runs: about 45 s
def test_the_gate_refuses_an_unapproved_bundle_in_warm_mode(tmp_path: Path) -> None:
    """As tests/test_app_gate.py's deployment test, with the gated node's ClientApps forked
    from its zygote: the hostile bundle is refused before a byte of it is written, the approved
    one runs."""
    policy = tmp_path / "policy.toml"
    policy.write_text(f'allowed-apps = ["{app_bundle_hash(GATE_APP)}"]\n', encoding="utf-8")
    hostile = hostile_app(tmp_path / "server")
    gated = ["fedparity-superexec", "--privacy-policy", str(policy), "--executor", "warm"]
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
        expected = (
            f"refused: <class 'fedparity.clients.messages.NodeRefusal'>:<'{APP_REFUSED_TEXT}'>"
        )
        assert answers[gated_id] == expected
        assert not (work / "supernode-0" / MARKER).exists()
        assert installed_apps(work / "supernode-0") == []
        answers = replies(GATE_APP, "approved")
        assert answers == {gated_id: "answered: gateapp 1.0.0", open_id: "answered: gateapp 1.0.0"}
        log = dep.superexecs[0].log_text()
        assert "zygote" in log and "ready" in log and "fresh process" not in log
        assert "app gate: refused the app bundle" in log and "is in allowed-apps" in log


def warm_superexec_checks(superexecs: list) -> None:
    """What a real deployment on the warm executor must show after its runs (the fault suite
    runs the LDP audit and FPFL there, through kills and restarts): every SuperExec's zygote
    came up and served every ClientApp (no fallback to a fresh process), and each running
    SuperExec has exactly one zygote (a killed node's SuperExec has none)."""
    for superexec in superexecs:
        log = superexec.log_text()
        assert "ready in" in log and "fresh process" not in log, log[-3000:]
        if not superexec.alive():
            continue
        zygotes = [pid for pid in _children(superexec.pid) if "zygote_main" in _cmd(pid)]
        assert len(zygotes) == 1  # one zygote per SuperExec, still there


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _cmd(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_fedparity_superexec_lists_the_warm_executor() -> None:
    result = subprocess.run(
        [flower_executable("fedparity-superexec"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--executor" in result.stdout and "warm (Linux, macOS" in result.stdout
