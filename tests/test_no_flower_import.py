"""fedparity.mechanisms is pure numpy/scipy: importing it loads no Flower, torch or TenSEAL.

Two rooms use heavy libraries in their functions only (``privacy.opacus_accounting``: Opacus;
``crypto.ckks``: TenSEAL) and import them there, so importing the package stays light."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import fedparity.mechanisms as mechanisms

HEAVY = ("flwr", "torch", "tenseal")
PACKAGE_DIR = Path(mechanisms.__file__).resolve().parent
FLOWER_IMPORT = re.compile(r"^\s*(import\s+flwr\b|from\s+flwr\b)", re.MULTILINE)

PROBE = """
import importlib, json, pkgutil, sys
import fedparity.mechanisms as mechanisms
names = sorted(
    m.name for m in pkgutil.walk_packages(mechanisms.__path__, "fedparity.mechanisms.")
)
for name in names:
    importlib.import_module(name)
heavy = sorted(k for k in sys.modules if k.split(".")[0] in {heavy!r})
print(json.dumps({{"modules": names, "heavy": heavy}}))
"""


def test_importing_every_mechanisms_module_leaves_heavy_packages_out() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=set(HEAVY))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        ".".join(
            ["fedparity", "mechanisms", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        ).removesuffix(".__init__")
        for path in PACKAGE_DIR.rglob("*.py")
    } - {"fedparity.mechanisms"}
    assert "fedparity.mechanisms.crypto.ckks.keys" in expected  # the rooms were read
    assert expected <= set(report["modules"])  # every module was really imported
    assert report["heavy"] == []


def test_the_probe_detects_a_heavy_import() -> None:
    # Power check: the same probe does report a package that mechanisms really imports.
    probe = PROBE.format(heavy={"scipy"})
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert "scipy" in json.loads(result.stdout.strip().splitlines()[-1])["heavy"]


def test_no_flower_import_statement_in_mechanisms() -> None:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) >= 9
    offenders = [
        str(path.relative_to(PACKAGE_DIR))
        for path in files
        if FLOWER_IMPORT.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_static_pattern_catches_flower_imports() -> None:
    for line in ("import flwr", "from flwr.common import Context", "    import flwr as fl"):
        assert FLOWER_IMPORT.search(f"x = 1\n{line}\n")
    for line in ("import flwrx", "# uses flwr", "from flowers import rose"):
        assert not FLOWER_IMPORT.search(line)
