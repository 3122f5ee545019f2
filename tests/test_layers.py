"""The package layers and the one import namespace, checked on the source.

Layers (bottom to top): ``fedparity.mechanisms`` imports no other layer and no Flower;
``fedparity.clients`` and ``fedparity.strategies`` are peers that import only
``fedparity.mechanisms`` (and Flower); ``fedparity.server`` may import all of them. Inside the
project every import of its own code is relative, so nothing depends on a top-level
``clients`` or ``server`` that a user's flat Flower app (its own ``server.py``) would shadow.
Every import statement counts, also the lazy ones inside functions.

Rooms inside ``fedparity.clients``: the project app's own task (``fedparity.clients.project``:
run config, embedded data, populations, models) and its ClientApp module
(``fedparity.clients.app``) sit beside the node library (handlers, policy, ledger, messages,
shards). The library never imports the project app, and ``fedparity.server`` never imports the
ClientApp module (it shares the task code in ``fedparity.clients.project`` instead, as a Flower
app's ServerApp and ClientApp share ``task.py``).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.import_probe import last_line_printed, modules_loaded_by

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
        ("clients", "import mechanisms.crypto.secure_sum", "top-level import"),
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
        ("clients", "from ..mechanisms.crypto.secure_sum import mask_vector\nfrom .data import x"),
        ("strategies", "from ..mechanisms.protocol import FPFL_KEY\nfrom flwr.app import Message"),
        ("mechanisms", "from .fairtest import ROUND1_FIELDS\nimport numpy as np"),
    ],
)
def test_the_check_accepts_allowed_imports(layer: str, source: str) -> None:
    assert check_source(source, layer, ["module"], "probe.py") == []


# --------------------------------------------------------------------------------------------
# Rooms: the node library never imports the project app; the server never imports the ClientApp
# --------------------------------------------------------------------------------------------

#: The project app inside ``fedparity.clients``: its own task package and its ClientApp module.
PROJECT_APP: tuple[str, ...] = ("fedparity.clients.project", "fedparity.clients.app")
#: Old paths of modules that moved to ``fedparity.clients.project``; each only forwards its
#: names (``mechanisms/_deprecated.py``, with a ``DeprecationWarning``), so importing one is
#: importing the project app.
DEPRECATED_ALIASES: dict[str, str] = {
    "fedparity.clients.config": "fedparity.clients.project.config",
    "fedparity.clients.data": "fedparity.clients.project.data",
    "fedparity.clients.own_data": "fedparity.clients.project.own_data",
    "fedparity.clients.task": "fedparity.clients.project.task",
}
CLIENT_APP = "fedparity.clients.app"
#: The one server module that builds the ClientApp: the Python API runs a simulation of both
#: apps in one process (``flwr run`` does it from ``pyproject.toml``), inside the function only.
CLIENT_APP_RUNNERS = frozenset({"fedparity.server.api"})


def _within(name: str, packages: Iterable[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _import_targets(
    tree: ast.AST, layer: str, module_parts: list[str]
) -> Iterator[tuple[int, str]]:
    """(line, module) of every import, eager or lazy; ``from package import name`` also counts
    as importing ``package.name`` (it loads the submodule when there is one)."""
    for line, name, _ in _imports(tree, layer, module_parts):
        yield line, name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            resolved = next(iter(_imports(node, layer, module_parts)))[1]
            for alias in node.names:
                yield node.lineno, f"{resolved}.{alias.name}"


def module_name(layer: str, parts: list[str]) -> str:
    names = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(["fedparity", layer, *names])


def is_client_library(layer: str, parts: list[str]) -> bool:
    """A module of the node library: in ``fedparity.clients``, not the project app, not an old
    path of a moved module."""
    name = module_name(layer, parts)
    return layer == "clients" and not _within(name, PROJECT_APP) and name not in DEPRECATED_ALIASES


def room_violations(source: str, layer: str, module_parts: list[str], path: str) -> list[Violation]:
    """The library importing the project app, or the server importing the ClientApp module."""
    found: list[Violation] = []
    tree = ast.parse(source)
    for line, name in _import_targets(tree, layer, module_parts):
        if is_client_library(layer, module_parts) and (
            _within(name, PROJECT_APP) or _within(name, DEPRECATED_ALIASES)
        ):
            found.append(Violation(path, line, f"the node library imports the project's {name!r}"))
        if (
            layer == "server"
            and _within(name, (CLIENT_APP,))
            and module_name(layer, module_parts) not in CLIENT_APP_RUNNERS
        ):
            found.append(Violation(path, line, f"fedparity.server imports the ClientApp {name!r}"))
    return found


def test_the_node_library_never_imports_the_project_app_and_the_server_never_the_client_app() -> (
    None
):
    """Run on the sources of commit 5e50373 (before the project's task moved to
    ``clients/project/``) this finds 16 violations: ``clients/fpfl_node.py`` imported
    ``.config`` (``RunConfig``) and ``.data``, ``clients/fpfl_data.py`` and
    ``clients/fedevalfair.py`` imported ``.data``, and ``server/harness.py`` imported
    ``load_shard_for`` and ``received_model`` from ``clients/app.py``."""
    modules = list(library_modules())
    library = [m for m in modules if is_client_library(m[0], m[1])]
    assert len(library) >= 15  # the node library was read
    assert any(layer == "server" and parts == ["harness"] for layer, parts, _ in modules)
    violations = [
        v
        for layer, parts, path in modules
        for v in room_violations(
            path.read_text(encoding="utf-8"), layer, parts, str(path.relative_to(REPO_ROOT))
        )
    ]
    assert violations == []


def test_the_old_paths_of_moved_modules_only_forward_to_the_project() -> None:
    # A module left at an old path holds no code of its own: it imports only the forwarding
    # helper, so the library cannot reach the project through it unseen.
    for old in DEPRECATED_ALIASES:
        parts = old.split(".")[2:]
        path = REPO_ROOT / "clients" / Path(*parts).with_suffix(".py")
        if not path.is_file():
            path = REPO_ROOT / "clients" / Path(*parts) / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_parts = [*parts, "__init__"] if path.name == "__init__.py" else parts
        imported = {name for _, name, _ in _imports(tree, "clients", module_parts)}
        assert imported <= {"fedparity.mechanisms._deprecated"}, (old, imported)


@pytest.mark.parametrize(
    ("layer", "parts", "source", "expected"),
    [
        ("clients", ["ldp"], "from .project.config import RunConfig", "node library"),
        ("clients", ["ldp"], "def f():\n    from .project import task", "node library"),
        ("clients", ["fpfl_node"], "from .config import RunConfig", "node library"),
        ("clients", ["fpfl_node"], "from . import app", "node library"),
        ("clients", ["fpfl_node"], "from .app import load_shard_for", "node library"),
        ("clients", ["data", "__init__"], "from ..ledger import x", None),
        ("clients", ["project", "task"], "from ..ledger import x", None),
        ("clients", ["app"], "from .project.config import RunConfig", None),
        ("server", ["harness"], "from ..clients.app import received_model", "ClientApp"),
        ("server", ["harness"], "from ..clients import app", "ClientApp"),
        ("server", ["harness"], "def f():\n    from ..clients.app import x", "ClientApp"),
        ("server", ["harness"], "from ..clients.project.evaluation import x", None),
        ("server", ["api"], "def f():\n    from ..clients.app import build_client_app", None),
    ],
)
def test_the_room_check_reports_each_kind_of_violation(
    layer: str, parts: list[str], source: str, expected: str | None
) -> None:
    # Power check: each rule fails on the import it forbids, and passes the allowed ones.
    violations = room_violations(source, layer, parts, "probe.py")
    if expected is None:
        assert violations == []
    else:
        assert any(expected in v.message for v in violations), violations


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATED_ALIASES.items()))
def test_an_old_import_path_still_works_with_a_deprecation_warning(old: str, new: str) -> None:
    import importlib

    name = {"config": "RunConfig", "data": "load_partition", "own_data": "read_data_file"}.get(
        old.rsplit(".", 1)[1], "build_model"
    )
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(
    ("old", "name"),
    [
        ("fedparity.clients.fpfl_data", "fpfl_population"),
        ("fedparity.clients.fpfl_data", "digits_leaf"),
        ("fedparity.clients.fpfl_node", "node_settings"),
        ("fedparity.clients.fpfl_node", "population"),
    ],
)
def test_a_name_moved_out_of_a_library_module_warns(old: str, name: str) -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match="moved to fedparity.clients.project"):
        getattr(importlib.import_module(old), name)
    with pytest.raises(AttributeError):
        importlib.import_module(old).no_such_name  # noqa: B018


# --------------------------------------------------------------------------------------------
# Rooms inside ``fedparity.mechanisms``: the old flat module paths only forward (issue 29)
# --------------------------------------------------------------------------------------------

#: Old flat paths of the mechanisms' modules and the module each moved to. Each old path is a
#: deprecation shim: a docstring, the forwarding helper and nothing else.
MOVED_MECHANISMS: dict[str, str] = {
    **{
        f"fedparity.mechanisms.{name}": f"fedparity.mechanisms.ldp.{name}"
        for name in (
            "randomized_response",
            "laplace",
            "discrete_laplace",
            "calibration",
            "estimators",
            "planner",
            "streaming",
            "reports",
            "metrics",
            "frequency_oracle",
            "group_rates",
            "power",
        )
    },
    "fedparity.mechanisms.fairtest": "fedparity.mechanisms.fairness_tests.fedevalfair",
    "fedparity.mechanisms.accounting": "fedparity.mechanisms.privacy.basic_ledger",
    "fedparity.mechanisms.privacy_ledger": "fedparity.mechanisms.privacy.user_ledger",
    "fedparity.mechanisms.dp_accounting": "fedparity.mechanisms.privacy.opacus_accounting",
    "fedparity.mechanisms.secure_sum": "fedparity.mechanisms.crypto.secure_sum",
    "fedparity.mechanisms.identity": "fedparity.mechanisms.crypto.identity",
    "fedparity.mechanisms.secure_random": "fedparity.mechanisms.crypto.secure_random",
    "fedparity.mechanisms.mmdm": "fedparity.mechanisms.fpfl.mmdm",
    "fedparity.mechanisms.training_state": "fedparity.mechanisms.fpfl.training_state",
    "fedparity.mechanisms._validation": "fedparity.mechanisms.validation",
    "fedparity.mechanisms.ckks": "fedparity.mechanisms.crypto.ckks",
    **{
        f"fedparity.mechanisms.ckks.{name}": f"fedparity.mechanisms.crypto.ckks.{name}"
        for name in (
            "aggregation",
            "errors",
            "flooding",
            "holder_dp",
            "keys",
            "releases",
            "signing",
            "vectors",
        )
    },
}
#: What the mechanisms' top level keeps beside the rooms (and the shims above).
MECHANISMS_TOP_LEVEL = frozenset(
    {"__init__", "_deprecated", "_files", "formatting", "validation", "protocol", "ldp"}
    | {"fairness_tests"}
    | {"privacy", "crypto", "fpfl"}
)


def _source_path(module: str) -> Path:
    parts = module.split(".")[2:]
    path = REPO_ROOT / "mechanisms" / Path(*parts).with_suffix(".py")
    return path if path.is_file() else REPO_ROOT / "mechanisms" / Path(*parts) / "__init__.py"


def shim_problems(source: str, old: str, new: str) -> list[str]:
    """What makes ``source`` more than a deprecation shim of module ``old`` for ``new``: any
    statement besides the docstring, ``from <..>._deprecated import moved_names`` and
    ``__getattr__ = moved_names(__name__, "<new>")``."""
    problems = []
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    else:
        problems.append("no docstring")
    expected_call = f"__getattr__ = moved_names(__name__, {new!r})"
    for statement in body:
        text = ast.unparse(statement).replace('"', "'")
        if isinstance(statement, ast.ImportFrom) and statement.module == "_deprecated":
            if [alias.name for alias in statement.names] != ["moved_names"]:
                problems.append(f"imports {text}")
        elif text != expected_call.replace('"', "'"):
            problems.append(f"code: {text}")
    if not any(ast.unparse(s).replace('"', "'") == expected_call.replace('"', "'") for s in body):
        problems.append(f"does not forward to {new}")
    return problems


def test_the_mechanisms_top_level_holds_only_rooms_and_shims() -> None:
    # Every module left at the top of fedparity.mechanisms is a room, a private helper, the
    # protocol messages or the old path of a moved module; nothing new lands there unseen.
    top = {p.stem for p in (REPO_ROOT / "mechanisms").glob("*.py")}
    top |= {p.name for p in (REPO_ROOT / "mechanisms").iterdir() if (p / "__init__.py").is_file()}
    old_paths = {name.split(".")[2] for name in MOVED_MECHANISMS}
    assert top - MECHANISMS_TOP_LEVEL == old_paths


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MECHANISMS.items()))
def test_an_old_mechanisms_path_is_only_a_deprecation_shim(old: str, new: str) -> None:
    assert _source_path(new).is_file(), new
    source = _source_path(old).read_text(encoding="utf-8")
    assert shim_problems(source, old, new) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('"""Doc."""\nimport numpy as np\n', "code: import numpy as np"),
        ('"""Doc."""\nfrom ._deprecated import moved_names\n', "does not forward"),
        (
            '"""Doc."""\nfrom ._deprecated import moved_names\n'
            '__getattr__ = moved_names(__name__, "fedparity.mechanisms.ldp.laplace")\n'
            "def f():\n    return 1\n",
            "code: def f",
        ),
        (
            '"""Doc."""\nfrom ._deprecated import moved_names\n'
            '__getattr__ = moved_names(__name__, "fedparity.mechanisms.ldp.planner")\n',
            "does not forward",
        ),
        (
            '"""Doc."""\nfrom ._deprecated import moved_names\n'
            '__getattr__ = moved_names(__name__, "fedparity.mechanisms.ldp.laplace")\n',
            None,
        ),
    ],
)
def test_the_shim_check_reports_code_in_an_old_path(source: str, expected: str | None) -> None:
    # Power check: a shim with code, or forwarding elsewhere, fails; a bare shim passes.
    problems = shim_problems(
        source, "fedparity.mechanisms.laplace", "fedparity.mechanisms.ldp.laplace"
    )
    if expected is None:
        assert problems == []
    else:
        assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MECHANISMS.items()))
def test_an_old_mechanisms_path_still_imports_with_a_deprecation_warning(
    old: str, new: str
) -> None:
    import importlib

    target = importlib.import_module(new)
    public = getattr(target, "__all__", None) or [n for n in vars(target) if n[0] != "_"]
    name = sorted(public)[0]
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(target, name)


def test_every_name_the_mechanisms_export_still_imports_from_the_package() -> None:
    # The public surface did not move: each name of the stub resolves, without a warning.
    import importlib
    import warnings

    mechanisms = importlib.import_module("fedparity.mechanisms")
    assert len(mechanisms.__all__) >= 79
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in mechanisms.__all__:
            value = getattr(mechanisms, name)
            assert getattr(value, "__module__", None) not in MOVED_MECHANISMS, name


# --------------------------------------------------------------------------------------------
# One validation module: no integer validator of its own anywhere else (issue 29)
# --------------------------------------------------------------------------------------------

#: The module that holds the package's argument checks; the integer rule is its ``check_int``
#: (values) and ``parse_int`` (text). Eight modules once had their own, each with its own rule.
VALIDATION_MODULE = "mechanisms/validation.py"
#: Names of an integer validator: ``check_int``, ``_as_int``, ``parse_integer_option``,
#: ``_int_at_least``... (``int`` followed by the end, ``eger`` or ``_``, so that
#: ``check_interval`` is not one).
INTEGER_VALIDATOR = re.compile(r"_?(check|as|parse)_?int(eger)?(_\w*)?|\w*_int_at_least\w*")


def integer_validators(source: str) -> list[str]:
    """The functions (and methods) of ``source`` named like an integer validator."""
    return sorted(
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and INTEGER_VALIDATOR.fullmatch(node.name)
    )


def test_no_module_but_the_validation_module_defines_an_integer_validator() -> None:
    """Run on commit ab09d56 this finds six of the validators the review counted:
    ``_as_int`` in ``clients/messages.py`` and ``clients/project/config.py``, ``_check_int``
    in ``clients/fpfl_task.py`` and ``clients/shards.py``, ``_int_at_least`` in
    ``server/cli/_common.py`` and ``check_int_at_least`` in ``mechanisms/_validation.py`` (now
    the validation module). Inline checks and generic names (the node policy's ``_check``, the
    protocol parsers' ``_int``) are beyond a name pattern; those now call ``check_int``."""
    found = {
        str(path.relative_to(REPO_ROOT)): names
        for _, _, path in library_modules()
        if (names := integer_validators(path.read_text(encoding="utf-8")))
    }
    assert "check_int" in found.pop(VALIDATION_MODULE)
    assert found == {}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def _as_int(key, value): ...", ["_as_int"]),
        ("def _check_int(name, value, minimum): ...", ["_check_int"]),
        ("def check_int_at_least(name, value, minimum): ...", ["check_int_at_least"]),
        ("def _int_at_least(name, text, minimum): ...", ["_int_at_least"]),
        ("def parse_integer(text): ...", ["parse_integer"]),
        ("class A:\n    def _parse_int(self, text): ...", ["_parse_int"]),
        ("def f():\n    def asint(v): ...", ["asint"]),
        ("def _check_interval(low, high): ...", []),
        ("def int_field(record, key): ...", []),
        ("def check_choice(name, value, allowed): ...", []),
    ],
)
def test_the_validator_check_sees_a_ninth_validator(source: str, expected: list[str]) -> None:
    # Power check: each spelling of an integer validator is found; other checks are not.
    assert integer_validators(source) == expected


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


# --------------------------------------------------------------------------------------------
# No import cycle, so no import deadlock
# --------------------------------------------------------------------------------------------
# Python takes a lock per module while it runs the module. Two threads that import along a cycle
# of modules from different ends wait for each other: importlib raises ``_DeadlockError``. A
# package's ``__init__`` belongs to every cycle through it (importing ``pkg.sub`` first runs
# ``pkg``), so an ``__init__`` that imports its own submodules closes a cycle with each of them.
# Flower's simulation loads the ServerApp and the ClientApp in two threads at once, and CI once
# failed on exactly that (``fedparity.clients.config`` deadlocked). The package ``__init__``s
# therefore load their names lazily, and the graph below must have no cycle.


def _module_level_imports(tree: ast.Module) -> Iterator[ast.ImportFrom]:
    """Relative imports executed when the module runs (not in functions or TYPE_CHECKING)."""

    def visit(statements: list[ast.stmt]) -> Iterator[ast.ImportFrom]:
        for statement in statements:
            if isinstance(statement, ast.ImportFrom) and statement.level:
                yield statement
            elif isinstance(statement, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(statement.test):
                    yield from visit(statement.body)
                yield from visit(statement.orelse)
            elif isinstance(statement, ast.Try):
                for block in (statement.body, statement.orelse, statement.finalbody):
                    yield from visit(block)
                for handler in statement.handlers:
                    yield from visit(handler.body)

    yield from visit(tree.body)


def import_graph(sources: dict[str, tuple[str, bool, str | None]]) -> dict[str, set[str]]:
    """Edges ``module -> module it waits for`` when imported.

    ``sources`` maps a dotted module name to (source, is_package, stub source or None). A
    submodule waits for its parent package; a relative import waits for the module it names,
    for each name that is a submodule, and, through a lazy package's stub, for the submodule
    that defines a re-exported name.
    """
    stubs = {
        name: {
            alias.name: f"{name}.{node.module}"
            for node in ast.parse(stub).body
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        for name, (_, _, stub) in sources.items()
        if stub is not None
    }
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (source, is_package, _) in sources.items():
        parent = name.rsplit(".", 1)[0]
        if parent in sources:
            graph[name].add(parent)
        package = name if is_package else parent
        for node in _module_level_imports(ast.parse(source)):
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
            while target not in sources and "." in target:  # a package's parents
                target = target.rsplit(".", 1)[0]
            graph[name].add(target)
            for alias in node.names:
                if f"{target}.{alias.name}" in sources:
                    graph[name].add(f"{target}.{alias.name}")
                elif alias.name in stubs.get(target, {}):
                    graph[name].add(stubs[target][alias.name])
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (the modules in order), or ``[]``."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                return path[path.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def library_sources() -> dict[str, tuple[str, bool, str | None]]:
    sources: dict[str, tuple[str, bool, str | None]] = {}
    for layer, parts, path in library_modules():
        is_package = parts[-1] == "__init__"
        name = ".".join(["fedparity", layer, *(parts[:-1] if is_package else parts)])
        stub = path.with_suffix(".pyi")
        sources[name] = (
            path.read_text(encoding="utf-8"),
            is_package,
            stub.read_text(encoding="utf-8") if stub.is_file() else None,
        )
    return sources


def test_the_library_has_no_module_level_import_cycle() -> None:
    sources = library_sources()
    graph = import_graph(sources)
    assert sum(len(edges) for edges in graph.values()) > 100  # the graph was read
    assert find_cycle(graph) == []


def test_the_cycle_check_sees_an_eager_package_init() -> None:
    # Power check: the layout CI deadlocked on (an __init__ importing its submodules, one of
    # which imports a sibling) is a cycle; the same package with a lazy __init__ is not.
    eager = {
        "fedparity.clients": ("from .app import main\n", True, None),
        "fedparity.clients.app": ("from .config import RunConfig\n", False, None),
        "fedparity.clients.config": ("import math\n", False, None),
    }
    assert find_cycle(import_graph(eager)) == [
        "fedparity.clients",
        "fedparity.clients.app",
        "fedparity.clients",
    ]
    lazy = {**eager, "fedparity.clients": ("import lazy_loader\n", True, "from .app import main")}
    assert find_cycle(import_graph(lazy)) == []
    # a re-export used through the package resolves, via the stub, to the defining module
    reexport = {
        **lazy,
        "fedparity.clients.config": ("from . import main\n", False, None),
    }
    assert find_cycle(import_graph(reexport)) != []


_CONCURRENT_IMPORTS = """
import importlib, sys, threading
import fedparity.server.app, fedparity.clients.app  # third-party imports done once
from tests.support.import_probe import last_line_printed, modules_loaded_by
sys.setswitchinterval(1e-6)  # switch threads often: the race window is microseconds
failures = []
for _ in range({repeats}):
    for name in [m for m in sys.modules if m.startswith("fedparity.")]:
        del sys.modules[name]
    barrier = threading.Barrier(2)
    def load(name):
        barrier.wait()
        try:
            importlib.import_module(name)
        except BaseException as error:
            failures.append(f"{{name}}: {{type(error).__name__}}: {{error}}")
    threads = [threading.Thread(target=load, args=(n,)) for n in {modules!r}]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
print(len(failures), failures[:1])
"""


@pytest.mark.slow
def test_the_server_and_client_apps_import_concurrently_without_deadlock() -> None:
    # What Flower's simulation does (the ServerApp in a thread, the ClientApp in the main
    # thread). Before the lazy __init__s, 4 of 50 such imports deadlocked here; 100 clean ones
    # would then have had a chance of (46/50)^100 < 1e-3.
    code = _CONCURRENT_IMPORTS.format(
        repeats=100, modules=("fedparity.server.app", "fedparity.clients.app")
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.split()[0] == "0", result.stdout


def test_a_node_process_imports_no_scipy_torch_or_opacus() -> None:
    # A deployed SuperNode starts one ClientApp process per message (Flower 1.41), so what
    # the ClientApp module imports is paid by every message. scipy.stats, scipy.optimize and
    # scipy.ndimage cost about 1-1.5 s of it on a 2-core machine, torch 1.4 s and Opacus 1.4 s
    # more; each is imported where it is used (a server-side estimate, a calibration, a
    # synthetic image; a model; the accountant).
    assert modules_loaded_by("fedparity.clients.app", {"scipy", "torch", "opacus"}) == []


def test_a_nodes_messages_without_a_model_load_no_torch(tmp_path: Path) -> None:
    # Through the project's ClientApp in a fresh interpreter, as a deployed node runs each
    # message: describing the node's data and the FPFL key exchange load no torch (nor scipy
    # or Opacus); the round, which evaluates the model, does, and so does the setup of a
    # noisy run once (the node recomputes the run's epsilon with its own accountant there).
    import pickle
    from dataclasses import replace

    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedparity.clients.app import _fpfl_model, app, fpfl_users
    from fedparity.clients.fpfl_task import statistics_layout
    from fedparity.clients.project.config import RunConfig
    from fedparity.clients.project.fpfl_node import node_settings
    from fedparity.mechanisms.crypto.secure_sum import contribution_codec
    from fedparity.mechanisms.protocol import FPFL_KEY
    from fedparity.mechanisms.protocol.fpfl import FPFLKeyTable, FPFLSetupRequest
    from tests.support.fpfl_nodes import run_parameters

    run_config = {"task": "fpfl", "dataset": "synthetic", "users-per-node": 50}
    preamble = [
        "import pickle, sys",
        "from flwr.app import ConfigRecord, Context, Message, RecordDict",
        "from flwr.supercore.task_identity import TaskIdentity",
        "from fedparity.clients.app import app",
        "TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0",
    ]
    describe = "\n".join(
        [
            *preamble,
            "context = Context(run_id=1, node_id=7, node_config={'partition-id': 0,"
            " 'num-partitions': 2}, state=RecordDict(), run_config="
            f"{run_config!r})",
            "describe = Message(RecordDict(), dst_node_id=7, message_type='query.describe')",
            "reply = app(describe, context)",
            "assert reply.content.metric_records['metrics']['num-users'] == 50, reply.content",
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'scipy', 'opacus'}))",
        ]
    )
    assert last_line_printed(describe) == "[]"
    # The setup, here; then the member table in a fresh interpreter with the node's state.
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    try:
        config = RunConfig.from_mapping(run_config)
        parameters = run_parameters(node_settings(config), population=5000)
        context = Context(
            run_id=1,
            node_id=7,
            # masking with the invented peer 8 below: no roster (require-roster's accepted risk)
            node_config={"partition-id": 0, "num-partitions": 2, "require-roster": "false"},
            state=RecordDict(),
            run_config=run_config,
        )
        shard = fpfl_users(context, config)
        model = _fpfl_model(
            config.fpfl_architecture, tuple(shard.features.shape[1:]), 2, config.seed
        )
        parameters = replace(parameters, vector_size=statistics_layout(model, 2).size)
        setup = FPFLSetupRequest(b"s" * 16, parameters)
        reply = app(
            Message(
                RecordDict({FPFL_KEY: ConfigRecord(setup.to_fields())}),
                dst_node_id=7,
                message_type="query.fpfl_setup",
            ),
            context,
        )
        assert not reply.has_error(), reply.error
        public_key = bytes(reply.content.config_records[FPFL_KEY]["public-key"])
        codec = contribution_codec(
            per_user_bound=parameters.clipping_bound,
            population_size=5000,
            noise_std=parameters.clipping_bound * parameters.noise_multiplier,
            num_nodes=2,
        )
        table = FPFLKeyTable(
            b"s" * 16,
            parameters.digest(),
            (7, 8),
            (public_key, bytes(range(1, 33))),
            codec_clip_range=codec.clip_range,
            codec_scale=codec.scale,
        )
        payload = tmp_path / "keys.pickle"
        payload.write_bytes(pickle.dumps((context, table.to_fields())))
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved
    keys = "\n".join(
        [
            *preamble,
            f"context, fields = pickle.loads(open({str(payload)!r}, 'rb').read())",
            "message = Message(RecordDict({'fpfl': ConfigRecord(fields)}), dst_node_id=7,"
            " message_type='query.fpfl_keys')",
            "reply = app(message, context)",
            "assert not reply.has_error(), reply.error",
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'scipy', 'opacus'}))",
        ]
    )
    assert last_line_printed(keys) == "[]"
