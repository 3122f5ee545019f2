"""``examples/own-app``: a user's own Flower app (FedAvg, then fedparity's LDP audits and the
FedEvalFair test) runs exactly as its README says: ``python prepare.py --nodes N``, then the
``flwr run`` line it prints.

Before, quick start 3 pointed at ``tests/user_app``, which ended in a TenSEAL traceback with
exit 0 when run with ``flwr run``: running it needed what only its test knew.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedparity.mechanisms.ldp.estimators import GAP_VERDICTS
from tests.support.flower_processes import local_simulation

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own-app"
README = EXAMPLE / "README.md"
NODES = 3


def readme_commands() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block is not None
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_example_imports_only_the_public_api() -> None:
    for path in (EXAMPLE / "ownapp").glob("*.py"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith(("from fedparity", "import fedparity")):
                module = line.split()[1]
                assert "._" not in module and ".project" not in module, (path.name, line)
                assert (
                    module.split(".")[1] in ("clients", "strategies", "mechanisms")
                    or module == "fedparity.server.outcome_report"
                ), line


@pytest.mark.slow
def test_the_example_runs_as_its_readme_says(tmp_path: Path) -> None:
    home = tmp_path / "home"  # a fresh user's home: the data, keys and identities go there
    env = {"HOME": str(home)}
    cd, prepare, run = readme_commands()
    assert cd == "cd examples/own-app" and prepare == "python prepare.py --nodes 4"
    prepared = subprocess.run(
        [sys.executable, "prepare.py", "--nodes", str(NODES)],
        cwd=EXAMPLE,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    printed = prepared.stdout.strip().splitlines()[-1]
    assert printed == run.replace("num-supernodes=4", f"num-supernodes={NODES}")
    assert (home / ".fedparity" / "identity" / "roster.toml").is_file()
    assert (home / ".fedparity" / "keys" / "public_context.tenseal").is_file()

    # The printed line, against a SuperLink of the test's own (the managed one would be shared
    # on port 39091); it too runs without runtime dependency installation.
    with local_simulation(EXAMPLE, NODES, tmp_path / "flwr-home", env=env) as simulation:
        result = simulation.run(None, timeout=900)
    assert result.status == "finished:completed", result.output[-4000:]
    output = home / ".fedparity" / "examples" / "own-app" / "results"
    results = json.loads((output / "results.json").read_text(encoding="utf-8"))
    outcomes = results["outcomes"]
    assert [o["type"] for o in outcomes] == ["ldp-audit"] * 4 + ["rate-report", "fedevalfair"]
    audits = outcomes[:4]
    assert len(audits) == 4 and all(a["estimate"] is not None for a in audits)
    assert all(a["accepted_nodes"] == NODES and not a["rejected_replies"] for a in audits)
    # two metrics at budgets 1 and 2: each audit's true epsilon is at most its budget
    # plus the rate report at 2
    assert 0 < results["epsilon_spent_per_user"] <= 2 * (1.0 + 2.0) + 2.0 + 1e-9
    fedevalfair = outcomes[5]
    assert fedevalfair["error"] is None and len(fedevalfair["tests"]) == 4
    # every release was recorded before it was sent
    releases = json.loads((output / "releases.json").read_text(encoding="utf-8"))
    assert len(releases["releases"]) == 6
    rate_report = outcomes[4]
    assert rate_report["accepted_nodes"] == NODES and rate_report["rates"] is not None
    assert "demographic_parity_ratio" in rate_report["rates"]["derived"]
    # the verdicts reach the console, in the words of the outcomes' summaries
    assert "LDP audit of accuracy" in result.output and "LDP audit of fnr" in result.output
    assert any(verdict in result.output for verdict in GAP_VERDICTS)
    assert "Demographic parity (calibrated mode), stage 2" in result.output
    assert "Rate report (" in result.output and "four-fifths rule" in result.output
    # and the page the built-in jobs write, with every outcome's verdict and the run config
    page = (output / "report.html").read_text(encoding="utf-8")
    assert all(o["label"] in page for o in outcomes)
    assert "Demographic parity (calibrated mode), stage 2" in page
    assert "demographic parity ratio" in page and "Run config" in page
