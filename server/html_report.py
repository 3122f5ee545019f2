"""The HTML report of a run: ``report.html`` next to ``results.json``, one self-contained page.

The page answers the job's question in its first lines (the headline: one
:class:`Finding` per verdict), then gives the detail (:class:`Section` of paragraphs,
:class:`Table` and :class:`Figure` blocks) and the privacy spent. Everything is escaped
with :func:`html.escape`; the CSS is inline, the plots are PNG data URIs, and there is no
script and no external resource, so the file can be mailed or archived as it is.

Every number of the headline is a :class:`Value`: the console prints its text, and the page
marks it ``<span data-key="..." data-value="...">`` with the exact JSON value, so a reader
(or a test) can check it against results.json.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..mechanisms.formatting import format_number
from .run_record import read_status

__all__ = [
    "REPORT_FILE",
    "Figure",
    "Finding",
    "Report",
    "Section",
    "Table",
    "Value",
    "render_report",
    "write_report",
]

REPORT_FILE = "report.html"

#: Finding tones: the colour of the headline line.
TONES = ("good", "bad", "warn", "info", "muted")


@dataclass(frozen=True)
class Value:
    """A headline number or yes/no: ``key`` names it in the page; ``fmt`` formats a number,
    ``words`` says a boolean (true, false)."""

    key: str
    value: float | int | bool | None
    fmt: str = ".4f"
    words: tuple[str, str] = ("yes", "no")

    def text(self) -> str:
        if isinstance(self.value, bool):
            return self.words[0] if self.value else self.words[1]
        return format_number(self.value, self.fmt)

    def html(self) -> str:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        return (
            f'<span class="value" data-key="{html.escape(self.key)}" '
            f'data-value="{html.escape(json.dumps(value))}">{html.escape(self.text())}</span>'
        )


@dataclass(frozen=True)
class Finding:
    """One headline line: text pieces and :class:`Value` numbers, with a tone."""

    parts: tuple[str | Value, ...]
    tone: str = "info"

    def __post_init__(self) -> None:
        if self.tone not in TONES:
            raise ValueError(f"tone must be one of {', '.join(TONES)}, got {self.tone!r}")

    def plain(self) -> str:
        """The console line."""
        return "".join(part.text() if isinstance(part, Value) else part for part in self.parts)

    def html(self) -> str:
        return "".join(
            part.html() if isinstance(part, Value) else html.escape(part) for part in self.parts
        )


@dataclass(frozen=True)
class Table:
    """A table: header cells and rows (cells are text, numbers, None or :class:`Value`)."""

    header: Sequence[str]
    rows: Sequence[Sequence[object]]
    caption: str = ""


@dataclass(frozen=True)
class Figure:
    """A PNG embedded as a data URI; ``missing`` says why there is none (e.g. no matplotlib)."""

    path: Path
    caption: str
    missing: str | None = None


Block = str | Table | Figure


@dataclass(frozen=True)
class Section:
    """A titled part of the page: paragraphs (str), tables and figures, in order."""

    title: str
    blocks: Sequence[Block] = ()


@dataclass(frozen=True)
class Report:
    """What a job's page says: its question, headline, warnings, detail and privacy spent."""

    title: str
    question: str
    headline: Sequence[Finding]
    sections: Sequence[Section]
    privacy: Section
    warnings: Sequence[str] = ()
    notes: Sequence[str] = field(default=())
    #: What run this is (run id, task, start, host, folder), shown under the title.
    about: Sequence[tuple[str, str]] = field(default=())
    #: The run config the job ran with, shown folded after the privacy section.
    run_config: Mapping[str, object] | None = None


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.8em; }
.question { color: #555; margin-top: 0; }
.headline { border: 2px solid #333; border-radius: 6px; padding: 0.6em 1em; margin: 1em 0; }
.headline p { margin: 0.35em 0; font-size: 1.08em; }
.headline .good { color: #0b6b2e; } .headline .bad { color: #a4161a; }
.headline .warn { color: #8a5300; } .headline .info { color: #1d1d1f; }
.headline .muted { color: #6e6e73; font-size: 0.98em; }
.warning { background: #fff4d6; border-left: 5px solid #e0a100; padding: 0.5em 0.8em;
           margin: 0.6em 0; }
.note { color: #444; font-size: 0.95em; }
.about { color: #555; font-size: 0.9em; margin: 0 0 0.4em; }
.value { font-weight: 600; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
caption { text-align: left; font-weight: 600; padding-bottom: 0.3em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; } td.num { white-space: nowrap; }
td:first-child, th:first-child { text-align: left; }
tbody tr:nth-child(even) { background: #fafafa; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.92em; }
"""


def _cell(value: object) -> str:
    if isinstance(value, Value):
        return value.html()
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return html.escape(_number(value))
    return html.escape(str(value))


def _number(value: float) -> str:
    """A table number: whole numbers plainly, others to 4 decimals, tiny ones in 3 digits."""
    if not math.isfinite(value):
        return "n/a"
    if value == round(value) and abs(value) < 1e15:
        return f"{value:.0f}"
    if abs(value) >= 1e-3:
        return f"{value:.4f}"
    return f"{value:.3g}"


def _table(table: Table) -> str:
    caption = f"<caption>{html.escape(table.caption)}</caption>" if table.caption else ""
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table.header)
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_cell(cell)}</td>'
            if isinstance(cell, (int, float, Value))
            else f"<td>{_cell(cell)}</td>"
            for cell in row
        )
        + "</tr>"
        for row in table.rows
    )
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _figure(figure: Figure) -> str:
    caption = html.escape(figure.caption)
    if figure.missing is None and figure.path.is_file():
        data = base64.b64encode(figure.path.read_bytes()).decode("ascii")
        return (
            f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
            f"<figcaption>{caption} ({html.escape(figure.path.name)})</figcaption></figure>"
        )
    why = figure.missing or f"{figure.path.name} was not written"
    return f'<p class="note">Plot not included ({caption}): {html.escape(why)}.</p>'


def _block(block: Block) -> str:
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Figure):
        return _figure(block)
    return f"<p>{html.escape(block)}</p>"


def _section(section: Section) -> str:
    body = "\n".join(_block(block) for block in section.blocks)
    return f"<section><h2>{html.escape(section.title)}</h2>\n{body}\n</section>"


def _results_run_config(folder: Path) -> Mapping[str, object] | None:
    try:
        results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = results.get("run_config") if isinstance(results, dict) else None
    return config if isinstance(config, dict) else None


def render_report(report: Report) -> str:
    """The page as text: headline first, then the warnings, the detail and the privacy."""
    headline = "\n".join(
        f'<p class="{finding.tone}">{finding.html()}</p>' for finding in report.headline
    )
    warnings = "\n".join(
        f'<p class="warning">Warning: {html.escape(text)}</p>' for text in report.warnings
    )
    notes = "\n".join(f'<p class="note">{html.escape(text)}</p>' for text in report.notes)
    sections = "\n".join(_section(section) for section in (*report.sections, report.privacy))
    title = html.escape(report.title)
    about = " · ".join(
        f"{html.escape(label)} <b>{html.escape(value)}</b>" for label, value in report.about
    )
    about = f'<p class="about">{about}</p>\n' if about else ""
    config = ""
    if report.run_config:
        rows = "".join(
            f"<tr><td>{html.escape(str(key))}</td><td>{_cell(value)}</td></tr>"
            for key, value in report.run_config.items()
        )
        config = (
            "<section><h2>Run config</h2>\n<details><summary>the keys this run used "
            f"({len(report.run_config)})</summary><table><thead><tr><th>key</th><th>value</th>"
            f"</tr></thead><tbody>{rows}</tbody></table></details>\n</section>\n"
        )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{title}</h1>\n"
        f"{about}"
        f'<p class="question">{html.escape(report.question)}</p>\n'
        f'<div class="headline">\n{headline}\n</div>\n'
        f"{warnings}\n{notes}\n{sections}\n{config}"
        "</body>\n</html>\n"
    )


def run_description(folder: Path) -> tuple[tuple[str, str], ...]:
    """What run wrote ``folder``: run id, task, start (UTC), host and the folder, from the
    run's ``status.json`` (those it has)."""
    status = read_status(folder) or {}
    started = str(status.get("started") or "").replace("T", " ").replace("+00:00", " UTC")
    about = (
        ("run", str(status.get("run_id") or "")),
        ("task", str(status.get("task") or "")),
        ("started", started),
        ("host", str(status.get("host") or "")),
        ("folder", str(folder)),
    )
    return tuple((label, value) for label, value in about if value)


def write_report(folder: Path, report: Report) -> Path:
    """Write ``folder/report.html`` (UTF-8) and return its path. A report that does not say
    which run it is gets the run's description (:func:`run_description`) and, from
    ``folder/results.json``, its run config."""
    if not report.about:
        report = replace(report, about=run_description(folder))
    if report.run_config is None:
        report = replace(report, run_config=_results_run_config(folder))
    path = folder / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(report), encoding="utf-8")
    return path
