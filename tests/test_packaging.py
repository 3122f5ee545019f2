"""What ``pip install fedparity`` and the Flower app bundle contain.

The distribution provides the package ``fedparity`` (with ``__version__``) and its
subpackages ``fedparity.{mechanisms,clients,strategies,server}``, and no
top-level ``clients``/``server``/``strategies``/``mechanisms`` (which pip would silently
overwrite, and which a flat Flower app's own ``server.py`` would shadow). The app bundle
(FAB) leaves the tests and benchmarks out.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("mechanisms", "clients", "strategies", "server")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The file names in a wheel built from a copy of the sources (the checkout stays clean)."""
    source = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for layer in LAYERS:
        shutil.copytree(REPO_ROOT / layer, source / layer)
    # the import package: its __init__ and the links to the four folders, kept as links
    shutil.copytree(REPO_ROOT / "fedparity", source / "fedparity", symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("fedparity-*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
def test_the_wheel_installs_one_namespace_and_no_generic_top_level_package(
    wheel_names: list[str],
) -> None:
    tops = {name.split("/")[0] for name in wheel_names}
    assert tops == {"fedparity", *(n for n in tops if n.endswith(".dist-info"))}
    assert not tops & set(LAYERS)
    # a regular package (not a namespace): its __init__ carries __version__
    assert {"fedparity/__init__.py", "fedparity/py.typed"} <= set(wheel_names)
    for layer in LAYERS:
        assert f"fedparity/{layer}/__init__.py" in wheel_names
        assert f"fedparity/{layer}/py.typed" in wheel_names
    # every module of the four folders, subpackages included, is in the wheel
    sources = {
        f"fedparity/{path.relative_to(REPO_ROOT).as_posix()}"
        for layer in LAYERS
        for path in (REPO_ROOT / layer).rglob("*.py")
    }
    # the lazy package __init__s load their names from the stub beside them
    stubs = {
        f"fedparity/{path.relative_to(REPO_ROOT).as_posix()}"
        for layer in LAYERS
        for path in (REPO_ROOT / layer).rglob("__init__.pyi")
    }
    assert len(stubs) >= 6 and stubs <= set(wheel_names), sorted(stubs - set(wheel_names))
    assert len(sources) >= 40 and sources <= set(wheel_names), sorted(sources - set(wheel_names))
    assert not any(n.startswith(("tests/", "benchmarks/", "fedparity/tests")) for n in wheel_names)


def test_a_flat_flower_app_with_its_own_server_module_can_import_fedparity(
    tmp_path: Path,
) -> None:
    # The user's app in the flat layout of Flower's examples: its own server.py and client.py
    # first on sys.path, as `flwr run` puts the app folder at sys.path[0]. Before the
    # namespace, fedparity's ClientApp imported `server.config` and got the user's module
    # ("'server' is not a package").
    (tmp_path / "server.py").write_text("NAME = 'the user server module'\n")
    (tmp_path / "client.py").write_text("NAME = 'the user client module'\n")
    (tmp_path / "clients.py").write_text("NAME = 'a user module named clients'\n")
    probe = textwrap.dedent(
        """
        import server, client, clients
        import fedparity.clients.app
        import fedparity.server.app
        import fedparity.strategies.fpfl
        from flwr.clientapp import ClientApp
        assert server.NAME == 'the user server module'
        assert clients.NAME == 'a user module named clients'
        print(fedparity.server.app.__name__, isinstance(fedparity.clients.app.app, ClientApp))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["fedparity.server.app", "True"]


def test_the_app_bundle_leaves_out_tests_and_benchmarks() -> None:
    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(REPO_ROOT))).namelist()
    assert "clients/app.py" in names and "server/app.py" in names
    assert any(n.startswith("configs/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    # no fedparity/__init__.py in the bundle: with the bundle's folder first on sys.path it
    # would shadow the installed package and hide its subpackages
    assert not any(n.startswith("fedparity/") for n in names)


def test_fedparity_is_a_package_with_the_distribution_version() -> None:
    from importlib.metadata import version

    import fedparity

    assert fedparity.__version__ == version("fedparity") != "0+unknown"
    assert fedparity.__file__ is not None and fedparity.__spec__ is not None
    assert fedparity.__spec__.origin == fedparity.__file__  # not a namespace package


def test_the_checkout_resolves_fedparity_without_an_import_hook() -> None:
    # Editors and type checkers (Pylance, mypy) do not run setuptools' editable import hook;
    # in a checkout they find fedparity/ at the root, whose links lead to the four folders.
    package = REPO_ROOT / "fedparity"
    assert (package / "__init__.py").is_file()
    for layer in LAYERS:
        link = package / layer
        assert link.is_symlink(), f"fedparity/{layer} must be a link to ../{layer}"
        assert link.resolve() == (REPO_ROOT / layer).resolve()
        assert (link / "__init__.py").is_file()


def test_the_app_components_and_the_cli_name_the_namespace() -> None:
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "fedparity.server.app:app",
        "clientapp": "fedparity.clients.app:app",
    }
    assert project["project"]["scripts"]["fedparity"] == "fedparity.server.cli:main"
