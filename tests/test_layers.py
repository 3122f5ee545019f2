"""The package layers and the one import namespace, checked on the source.

Layers (bottom to top): ``fedparity.mechanisms`` imports no other layer and no Flower;
``fedparity.clients`` and ``fedparity.strategies`` are peers that import only
``fedparity.mechanisms`` (and Flower); ``fedparity.server`` may import all of them. Inside the
project every import of its own code is relative, so nothing depends on a top-level
``clients`` or ``server`` that a user's flat Flower app (its own ``server.py``) would shadow.
Every import statement counts, also the lazy ones inside functions.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("mechanisms", "clients", "strategies", "server")
#: The layers each layer may import (itself included).
ALLOWED: dict[str, frozenset[str]] = {
    "mechanisms": frozenset({"mechanisms"}),
    "clients": frozenset({"clients", "mechanisms"}),
    "strategies": frozenset({"strategies", "mechanisms"}),
    "server": frozenset(LAYERS),
}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    message: str


def _imports(tree: ast.AST, layer: str, module_parts: list[str]) -> Iterator[tuple[int, str, int]]:
    """(line, absolute module name, level) of every import; relative names resolved against
    the module's place in ``fedparity.<layer>``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module or "", 0
                continue
            package = ["fedparity", layer, *module_parts[:-1]]
            if node.level - 1 > len(package) - 1:
                yield node.lineno, "<beyond fedparity>", node.level
                continue
            base = package[: len(package) - (node.level - 1)]
            name = ".".join([*base, node.module] if node.module else base)
            yield node.lineno, name, node.level


def check_source(source: str, layer: str, module_parts: list[str], path: str) -> list[Violation]:
    """Layer and namespace violations of one module's source."""
    found: list[Violation] = []
    for line, name, level in _imports(ast.parse(source), layer, module_parts):
        top = name.split(".")[0]
        if level == 0 and top in LAYERS:
            found.append(Violation(path, line, f"top-level import of {name!r}"))
            continue
        if level == 0 and top == "fedparity":
            found.append(Violation(path, line, f"absolute import of {name!r} (use a relative one)"))
        if name == "<beyond fedparity>":
            found.append(Violation(path, line, "relative import beyond the fedparity namespace"))
            continue
        if layer == "mechanisms" and top == "flwr":
            found.append(Violation(path, line, "fedparity.mechanisms imports Flower"))
        parts = name.split(".")
        if parts[0] == "fedparity":
            target = parts[1] if len(parts) > 1 else ""
            if target not in ALLOWED[layer]:
                found.append(
                    Violation(path, line, f"fedparity.{layer} imports fedparity.{target or '?'}")
                )
    return found


def library_modules() -> Iterator[tuple[str, list[str], Path]]:
    for layer in LAYERS:
        for path in sorted((REPO_ROOT / layer).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT / layer).with_suffix("").parts)
            yield layer, parts, path


def test_every_layer_imports_only_what_it_may() -> None:
    modules = list(library_modules())
    assert len(modules) >= 40  # the whole library was read
    violations = [
        v
        for layer, parts, path in modules
        for v in check_source(
            path.read_text(encoding="utf-8"), layer, parts, str(path.relative_to(REPO_ROOT))
        )
    ]
    assert violations == []


@pytest.mark.parametrize(
    ("layer", "source", "expected"),
    [
        ("clients", "from ..server.config import RunConfig", "fedparity.clients imports"),
        ("clients", "def f():\n    from ..strategies import fpfl", "fedparity.clients imports"),
        ("strategies", "from ..clients.ckks import add", "fedparity.strategies imports"),
        ("mechanisms", "from ..strategies import x", "fedparity.mechanisms imports"),
        ("mechanisms", "import flwr", "imports Flower"),
        ("mechanisms", "def f():\n    from flwr.app import Message", "imports Flower"),
        ("server", "from server.config import RunConfig", "top-level import"),
        ("clients", "import mechanisms.secure_sum", "top-level import"),
        ("server", "from fedparity.clients import app", "absolute import"),
        ("server", "from .... import x", "beyond the fedparity namespace"),
    ],
)
def test_the_check_reports_each_kind_of_violation(layer: str, source: str, expected: str) -> None:
    # Power check: the checker above does fail on each rule it enforces.
    violations = check_source(source, layer, ["module"], "probe.py")
    assert any(expected in v.message for v in violations), violations


@pytest.mark.parametrize(
    ("layer", "source"),
    [
        ("server", "from ..clients.config import RunConfig\nfrom ..strategies import fpfl"),
        ("clients", "from ..mechanisms.secure_sum import mask_vector\nfrom .data import x"),
        ("strategies", "from ..mechanisms.protocol import FPFL_KEY\nfrom flwr.app import Message"),
        ("mechanisms", "from .fairtest import ROUND1_FIELDS\nimport numpy as np"),
    ],
)
def test_the_check_accepts_allowed_imports(layer: str, source: str) -> None:
    assert check_source(source, layer, ["module"], "probe.py") == []


def _declared_distributions() -> set[str]:
    """Distributions named by fedparity's requirements, extras included (normalised)."""
    names = set()
    for line in requires("fedparity") or []:
        names.add(Requirement(line).name.lower().replace("_", "-"))
    return names


def test_every_third_party_package_imported_is_declared() -> None:
    declared = _declared_distributions()
    providers = packages_distributions()
    undeclared: dict[str, list[str]] = {}
    for layer, parts, path in library_modules():
        for _, name, level in _imports(ast.parse(path.read_text(encoding="utf-8")), layer, parts):
            top = name.split(".")[0]
            if level or top in sys.stdlib_module_names or top in {"fedparity", "__future__"}:
                continue
            dists = {d.lower().replace("_", "-") for d in providers.get(top, [])}
            # flwr[simulation] brings ray; torch is declared as torch, and so on.
            if not dists & declared:
                undeclared.setdefault(top, []).append(str(path.relative_to(REPO_ROOT)))
    assert undeclared == {}
    assert "cryptography" in declared  # the secure sum imports it directly


def test_every_package_ships_its_type_hints_marker() -> None:
    for layer in LAYERS:
        assert (REPO_ROOT / layer / "py.typed").is_file(), layer
