"""The documented commands in the order a newcomer meets them (issue 32): the README's main
command, then the FedEvalFair guide's first block, then the pipeline guide's, each copied
from the docs and run in one user's state: one HOME, one Flower home, and the local SuperLink
the first ``flwr run`` starts and leaves running (every later command uses it). Each must end
with its answer.

Before, the second guide failed for anyone who had run the README first: its environment
variables never reached the SuperLink left running, and its "once" block (``fedparity keys``)
exited 2 when the first guide had made the keys.

The test's SuperLink has ports of its own (Flower's ``FLWR_LOCAL_*_PORT`` variables, as the
getting-started page says), so it never takes over a developer's, and it is stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedparity.mechanisms.fairness_tests.fedevalfair import FAIRNESS_VERDICTS
from fedparity.mechanisms.ldp.estimators import GAP_VERDICTS
from tests.support.flower_env import free_port, strip_ansi
from tests.support.process_tree import _cmdline

REPO = Path(__file__).resolve().parents[1]


def _first_block(path: Path) -> str:
    block = re.search(r"```sh\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
    assert block is not None, f"{path} has no sh block"
    return block.group(1)


def _commands(block: str, *, through_first_run: bool = True) -> list[str]:
    """The block's commands (line continuations joined, comments dropped), up to and including
    its first ``flwr run`` (the later ones need a download)."""
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        command = line.split("  #")[0].strip()
        if not command or command.startswith("#"):
            continue
        commands.append(command)
        if through_first_run and "flwr run" in command:
            break
    return commands


def readme_main_command() -> str:
    """The README's first command without its install steps (this checkout is installed)."""
    first = _commands(_first_block(REPO / "README.md"))[0]
    return first.split(" && ")[-1]


def guide_commands(name: str) -> list[str]:
    return _commands(_first_block(REPO / "docs" / "guides" / name))


def _status(home: Path, task: str) -> dict:
    """The status record of the newest run of ``task`` in the default runs folder."""
    folders = sorted((home / ".fedparity" / "runs").glob(f"{task}-*"))
    assert folders, f"no {task} run folder in {home / '.fedparity' / 'runs'}"
    return json.loads((folders[-1] / "status.json").read_text(encoding="utf-8"))


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A newcomer's environment: a fresh HOME and Flower home, this checkout's environment
    first on PATH, and a managed SuperLink of its own; the SuperLink is stopped afterwards."""
    control = free_port()
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "FLWR_HOME": str(tmp_path / "home" / ".flwr"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
    }
    (tmp_path / "home").mkdir()
    try:
        yield env
    finally:
        _stop_managed_superlink(control)


def _stop_managed_superlink(control_port: int) -> None:
    """SIGKILL the process group of the SuperLink whose Control API is on ``control_port``."""
    address = f"127.0.0.1:{control_port}"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and any(address in arg for arg in _cmdline(int(entry.name))):
            try:
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)
            except OSError:
                pass


def _run(command: str, env: dict[str, str]) -> str:
    done = subprocess.run(  # noqa: S603 - the documented commands, in bash as typed
        ["bash", "-c", command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    output = strip_ansi(done.stdout + done.stderr)
    assert done.returncode == 0, f"{command}\n{output[-4000:]}"
    return output


@pytest.mark.slow
def test_the_readme_then_the_fedevalfair_guide_then_the_pipeline_guide(
    newcomer: dict[str, str],
) -> None:
    home = Path(newcomer["HOME"])
    # 1. The README's main command: the LDP audit; its SuperLink is left running.
    output = _run(readme_main_command(), newcomer)
    assert any(verdict in output for verdict in GAP_VERDICTS), output[-3000:]
    assert _status(home, "ldp-audit")["status"] == "completed"

    # 2. The FedEvalFair guide: keys, identities, the encrypted test on that SuperLink.
    commands = guide_commands("fedevalfair.md")
    assert commands[:2] == ["fedparity keys", "fedparity identity --nodes 4"], commands
    output = "".join(_run(command, newcomer) for command in commands)
    status = _status(home, "fedevalfair")
    assert status["status"] == "completed" and "error" not in status, status
    assert any(verdict in output for verdict in FAIRNESS_VERDICTS), output[-3000:]
    assert "need 2" not in output and "Traceback" not in output

    # 3. The pipeline guide: its "once" block again (kept, exit 0), then the pipeline.
    commands = guide_commands("pipeline.md")
    assert commands[:2] == ["fedparity keys", "fedparity identity --nodes 4"], commands
    output = "".join(_run(command, newcomer) for command in commands)
    assert "kept" in output
    status = _status(home, "pipeline")
    assert status["status"] == "completed", status
    results = json.loads(Path(status["results_file"]).read_text(encoding="utf-8"))
    for model in results["models"].values():  # FPFL and PFL: each audited and tested
        assert all(audit["estimate"] is not None for audit in model["audits"]), model
        assert model["fedevalfair"]["error"] is None, model["fedevalfair"]
