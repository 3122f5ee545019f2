"""The documentation site builds cleanly and its examples run.

* ``docs/`` builds with Sphinx (MyST + furo + numpydoc) with warnings as errors, as in CI and
  in the README's command: every page, every cross-reference (``nitpicky``), the API reference
  generated from the packages' ``__all__``.
* Code examples in ``docs/**/*.md`` and ``README.md`` follow one convention, checked here:

  - ```` ```pycon ```` blocks are doctest sessions (``>>>`` prompts and the expected output),
    run with the standard library's doctest parser, all of a page's sessions in one namespace;
  - ```` ```python ```` blocks run in page order in one fresh namespace per page, with the
    current directory a fresh temporary folder, unless the block's first line is
    ``# not run: <reason>`` (then it is only compiled);
  - ```` ```sh ````, ```` ```toml ````, ```` ```text ```` (and every other language) are not run.

* The ``>>>`` examples in the docstrings of every module of the four packages run as doctests.
"""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
PACKAGES = ("mechanisms", "clients", "strategies", "server")
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
NOT_RUN = re.compile(r"#\s*not run:\s*\S")


def sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """The README's build command (``-W --keep-going``), into ``out`` with fresh doctrees."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html"]
        + ["-d", str(out / "doctrees"), str(source), str(out / "html")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    result = sphinx_build(DOCS, tmp_path)
    assert result.returncode == 0, "sphinx -W failed:\n" + result.stderr[-6000:]
    html = tmp_path / "html"
    # The API reference was generated from __all__: one entry per exported name.
    from fedparity import clients, mechanisms, strategies
    from fedparity.server import api

    for module, page in [
        (mechanisms, "mechanisms"),
        (clients, "clients"),
        (strategies, "strategies"),
        (api, "server"),
    ]:
        text = (html / "api" / f"{page}.html").read_text(encoding="utf-8")
        missing = [n for n in module.__all__ if f'id="{module.__name__}.{n}"' not in text]
        assert missing == [], f"{page}: {missing}"
    # The papers page links the functions it maps into the API reference.
    papers = (html / "papers.html").read_text(encoding="utf-8")
    assert 'href="api/mechanisms.html#fedparity.mechanisms.true_epsilon"' in papers


def test_the_build_fails_on_a_reference_to_a_function_that_does_not_exist(
    tmp_path: Path,
) -> None:
    # Power check of the build test, on a one-page site with the same configuration: a real
    # internal function renders (as code, unlinked), a misspelt one fails the build.
    import shutil

    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    shutil.copytree(DOCS / "_ext", source / "_ext")
    (source / "index.md").write_text(
        "# Page\n\n{py:func}`fedparity.mechanisms.ldp.planner.minimum_epsilon`\n\n"
        "{py:func}`fedparity.mechanisms.ldp.planner.minimum_epsilonn`\n",
        encoding="utf-8",
    )
    result = sphinx_build(source, tmp_path / "out")
    assert result.returncode != 0
    unresolved = re.findall(r"reference target not found: (\S+)", result.stderr)
    assert unresolved == ["fedparity.mechanisms.ldp.planner.minimum_epsilonn"], result.stderr


def test_the_app_bundle_leaves_out_the_docs_and_their_build() -> None:
    from flwr.cli.build import build_fab_from_disk

    names = zipfile.ZipFile(__import__("io").BytesIO(build_fab_from_disk(REPO_ROOT))).namelist()
    assert "server/app.py" in names
    assert not [n for n in names if n.startswith("docs/")]


# ---- examples in the pages ---------------------------------------------------------------


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block of a Markdown page."""

    language: str
    code: str
    line: int  # 1-based line of the opening fence


def code_blocks(text: str) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown text (parsed as CommonMark, as MyST reads it)."""
    from markdown_it import MarkdownIt

    return [
        CodeBlock(token.info.strip().split(" ")[0], token.content, token.map[0] + 1)
        for token in MarkdownIt("commonmark").parse(text)
        if token.type == "fence" and token.map is not None
    ]


def example_pages() -> list[Path]:
    pages = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [REPO_ROOT / "README.md", *pages]


def run_pycon(blocks: list[CodeBlock], name: str, path: Path) -> doctest.TestResults:
    """The page's pycon blocks as doctest sessions in one namespace."""
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks:
        test = parser.get_doctest(block.code, namespace, name, str(path), block.line)
        runner.run(test, clear_globs=False)
    return runner.summarize(verbose=False)


def run_python(blocks: list[CodeBlock], name: str) -> None:
    """The page's python blocks in order, in one namespace; ``# not run:`` blocks compiled."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks:
        first = block.code.lstrip().splitlines()[0] if block.code.strip() else ""
        compiled = compile(block.code, f"{name}, code block at line {block.line}", "exec")
        if first.startswith("#") and NOT_RUN.match(first):
            continue
        exec(compiled, namespace)


@pytest.mark.parametrize(
    "path", example_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)).replace(os.sep, "/")
)
def test_the_examples_of_a_page_run(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = str(path.relative_to(REPO_ROOT))
    blocks = code_blocks(path.read_text(encoding="utf-8"))
    # An example written as a session must be a pycon block, or it would silently not run.
    misfiled = [
        b.line for b in blocks if b.language != "pycon" and b.code.lstrip().startswith(">>>")
    ]
    assert misfiled == [], f"{name}: '>>>' sessions outside a pycon block at lines {misfiled}"
    not_run_marks = [
        b.line
        for b in blocks
        if b.language == "python"
        and b.code.lstrip().startswith("# not run")
        and not (NOT_RUN.match(b.code.lstrip().splitlines()[0]))
    ]
    assert not_run_marks == [], f"{name}: '# not run:' needs a reason (lines {not_run_marks})"

    monkeypatch.chdir(tmp_path)
    pycon = [b for b in blocks if b.language == "pycon"]
    if pycon:
        results = run_pycon(pycon, name, path)
        assert results.failed == 0, f"{name}: {results.failed} of {results.attempted} failed"
    run_python([b for b in blocks if b.language == "python"], name)


def test_the_example_runner_catches_a_wrong_output_and_a_failing_block(tmp_path: Path) -> None:
    # Power check of the page test's runner on a page written by the convention.
    page = tmp_path / "page.md"
    page.write_text(
        "```pycon\n>>> x = 2\n```\n\n```pycon\n>>> x + 1\n4\n```\n\n"
        "```python\n# not run: would fail\nraise RuntimeError\n```\n\n"
        "```python\ny = 1\n```\n\n```python\nassert y == 2\n```\n\n```sh\nexit 1\n```\n",
        encoding="utf-8",
    )
    blocks = code_blocks(page.read_text(encoding="utf-8"))
    assert [b.language for b in blocks] == ["pycon", "pycon", "python", "python", "python", "sh"]
    assert run_pycon(blocks[:2], "page.md", page) == doctest.TestResults(failed=1, attempted=2)
    with pytest.raises(AssertionError):  # the blocks share a namespace: y = 1, then y == 2
        run_python(blocks[2:5], "page.md")
    run_python(blocks[2:4], "page.md")  # the not-run block is compiled, not run


# ---- examples in the docstrings ---------------------------------------------------------


def modules_with_examples() -> list[str]:
    """Every module of the four packages whose source holds a ``>>>`` example."""
    names = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if ">>>" not in path.read_text(encoding="utf-8"):
                continue
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(("fedparity", *parts)))
    return names


@pytest.mark.parametrize("module_name", modules_with_examples())
def test_the_docstring_examples_of_a_module_run(
    module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(module_name)
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module) if t.examples]
    assert tests, f"{module_name} has '>>>' in its source but no docstring example was found"
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    with np.printoptions(legacy=False, precision=8, suppress=False):
        for test in tests:
            runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{module_name}: {results.failed} of {results.attempted} failed"


def test_every_test_the_threat_model_names_exists() -> None:
    """docs/threat-model.md names, for each claim, the test that runs the attack: every name
    must be a test function of the suite (a renamed or deleted test fails here)."""
    page = (DOCS / "threat-model.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_\w+)`", page))
    assert len(named) > 30  # the page was read
    defined = {
        match
        for path in (REPO_ROOT / "tests").glob("test_*.py")
        for match in re.findall(r"^def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M)
    }
    assert sorted(named - defined) == []
