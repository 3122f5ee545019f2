"""The README is a front page: small, starting with the two commands, the second of which is
exactly what CI runs, and citing the three papers by authors, title, venue and year."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: "at most about 12 KB"
MAX_README_BYTES = 12 * 1024


def _commands() -> list[str]:
    """The commands of the README's first sh block, line continuations joined."""
    block = re.search(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block is not None, "the README starts no sh block"
    joined = re.sub(r"\s*\\\n\s*", " ", block.group(1))
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def test_the_readme_is_a_front_page() -> None:
    assert README.stat().st_size <= MAX_README_BYTES
    text = README.read_text(encoding="utf-8")
    # the two commands come before any other section
    assert text.index("```sh") < text.index("\n## ")


def test_the_first_command_runs_the_main_job_and_the_second_is_what_ci_runs() -> None:
    main_job, tests = _commands()
    assert "flwr run . --stream" in main_job and 'pip install -c constraints.txt -e ".[plot]"' in (
        main_job
    )
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [tests]
    # the whole suite (no marker-filtered lane), two tests at a time
    assert tests.endswith("python -m pytest -n 2 --dist worksteal")


def test_the_three_papers_are_cited_with_authors_title_venue_and_year() -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    for citation in (
        ("Juarez", "Korolova", "Privately Measuring Demographic Performance Disparities", "2022"),
        ("FedEvalFair: A Privacy-Preserving and Statistically Grounded", "ACM Multimedia 2024"),
        ("Rodríguez-Gálvez", "modified method of differential multipliers", "NeurIPS 2021"),
    ):
        for part in citation:
            assert part in text, part
