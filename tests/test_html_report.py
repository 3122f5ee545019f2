"""The HTML report every job writes next to results.json (``report.html``).

The unit tests here check the writer (escaping of hostile text, no script or external
resource, the note that replaces a plot without matplotlib, plain-number axes). The job
tests that already run each job for real (``test_app_simulation.py``,
``test_fedevalfair_app.py``, ``test_fpfl_app.py``) call :func:`assert_report_matches_results`
on their run folder: it opens report.html with the standard library's HTML parser, checks
that the page is self-contained and starts with its headline, and compares every headline
number (the elements marked ``data-key``) with the value this module derives from
results.json on its own; given the run's console output, it checks that the log's final block
starts with the same verdict lines and names report.html.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Mapping
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from fedparity.server.fedevalfair_job import plot_bootstrap_distributions
from fedparity.server.fpfl_report import plot_training
from fedparity.server.html_report import (
    REPORT_FILE,
    Figure,
    Finding,
    Report,
    Section,
    Table,
    Value,
    render_report,
    write_report,
)
from fedparity.server.report import PLOT_NEEDS_MATPLOTLIB, plain_tick_labels, plot_audits

# --------------------------------------------------------------------------------------------
# Reading a report
# --------------------------------------------------------------------------------------------


class ReportParser(HTMLParser):
    """Collects what a test needs: tags and attributes, the headline's lines and its marked
    values, the text of the page, and what precedes the first section heading."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.values: dict[str, tuple[Any, str]] = {}
        self.headline_lines: list[str] = []
        self.headline_before_sections = False
        self._open: list[str] = []
        self._in_headline = False
        self._line: list[str] | None = None
        self._value_key: str | None = None
        self._value_text: list[str] = []
        self._seen_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if tag not in ("meta", "img", "br"):
            self._open.append(tag)
        if tag == "h2":
            self._seen_h2 = True
        if tag == "div" and attributes.get("class") == "headline":
            self._in_headline = True
            self.headline_before_sections = not self._seen_h2
        elif self._in_headline and tag == "p":
            self._line = []
        if tag == "span" and attributes.get("data-key") is not None:
            self._value_key = attributes["data-key"]
            self._value_text = []
            raw = attributes.get("data-value")
            assert raw is not None, f"data-key {self._value_key} without data-value"
            self.values[self._value_key] = (json.loads(raw), "")

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1] == tag:
            self._open.pop()
        if tag == "span" and self._value_key is not None:
            key = self._value_key
            self.values[key] = (self.values[key][0], "".join(self._value_text))
            self._value_key = None
        elif tag == "p" and self._line is not None:
            self.headline_lines.append("".join(self._line))
            self._line = None
        elif tag == "div" and self._in_headline:
            self._in_headline = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._line is not None:
            self._line.append(data)
        if self._value_key is not None:
            self._value_text.append(data)


def parse_report(page: str) -> ReportParser:
    parser = ReportParser()
    parser.feed(page)
    parser.close()
    return parser


def assert_self_contained(parsed: ReportParser) -> None:
    """No script, no event handler, nothing loaded from elsewhere (images are data URIs)."""
    for tag, attributes in parsed.tags:
        assert tag not in ("script", "iframe", "object", "embed", "link", "base"), tag
        for name, value in attributes.items():
            assert not name.startswith("on"), (tag, name)
            if name in ("src", "href"):
                assert value is not None and value.startswith("data:image/png;base64,"), value


def _shown_number_matches(text: str, value: float) -> bool:
    """The printed (rounded) number is the value to its printed precision."""
    if not math.isfinite(value):
        return text == "n/a"
    decimals = len(text.split(".")[1]) if "." in text and "e" not in text else 0
    return abs(float(text) - value) <= 0.5 * 10.0**-decimals + 1e-12 * abs(value) or (
        float(text) == pytest.approx(value, rel=5e-3)
    )


# --------------------------------------------------------------------------------------------
# What each job's headline must say, derived from results.json independently of the server
# --------------------------------------------------------------------------------------------


def ldp_expected(results: Mapping[str, Any]) -> dict[str, Any]:
    expected: dict[str, Any] = {}
    for number, audit in enumerate(results["audits"], start=1):
        expected[f"audit-{number}-budget"] = audit["budget"]
        estimate = audit["estimate"]
        if estimate is not None:
            expected[f"audit-{number}-gap"] = estimate["max_gap"]
            expected[f"audit-{number}-low"] = estimate["max_gap_interval"][0]
            expected[f"audit-{number}-high"] = estimate["max_gap_interval"][1]
    if results["ground_truth"] is not None:
        expected["true-gap"] = results["ground_truth"]["max_gap"]
    return expected


def fedevalfair_expected(results: Mapping[str, Any]) -> dict[str, Any]:
    expected: dict[str, Any] = {}
    for test in results["fedevalfair"]["tests"]:
        report = test["report"]
        if report is None:
            continue
        key = f"{test['metric']}-{test['mode']}"
        expected[f"{key}-stage1-pvalue"] = report["homogeneity"]["pvalue"]
        expected[f"{key}-reject-homogeneity"] = report["homogeneity"]["pvalue"] < report["alpha"]
        expected[f"{key}-stage2-pvalue"] = report["common_disparity"]["pvalue"]
        expected[f"{key}-reject-fairness"] = report["common_disparity"]["pvalue"] < report["alpha"]
        expected[f"{key}-estimate"] = report["estimate"]
        expected[f"{key}-low"], expected[f"{key}-high"] = report["confidence_interval"]
        if report["equivalence"] is not None:
            expected[f"{key}-equivalence-pvalue"] = report["equivalence"]["pvalue"]
            expected[f"{key}-certified-fair"] = report["equivalence"]["pvalue"] < report["alpha"]
        z = statistics.NormalDist().inv_cdf(0.5 + report["confidence_level"] / 2)
        pooled = report.get("pooled")
        if pooled is not None:  # the pooled disparity of all rows, with its interval
            expected[f"{key}-pooled"] = pooled["estimate"]
            for end, sign in (("low", -1), ("high", 1)):
                expected[f"{key}-pooled-{end}"] = pytest.approx(
                    pooled["estimate"] + sign * z * pooled["stderr"], rel=1e-9, abs=1e-12
                )
        effects = report.get("random_effects")
        rejected = report["homogeneity"]["pvalue"] < report["alpha"]
        if effects is not None and rejected and test["mode"] == "calibrated":
            # after stage 1 rejects: the random-effects mean and tau
            expected[f"{key}-random-effects-mean"] = effects["estimate"]
            for end, sign in (("low", -1), ("high", 1)):
                expected[f"{key}-random-effects-{end}"] = pytest.approx(
                    effects["estimate"] + sign * z * effects["stderr"], rel=1e-9, abs=1e-12
                )
            expected[f"{key}-tau"] = effects["tau"]
            expected[f"{key}-tau2"] = effects["tau2"]
            expected[f"{key}-tau2-low"] = effects["tau2_interval"][0]
    return expected


def fpfl_expected(results: Mapping[str, Any]) -> dict[str, Any]:
    config = results["run_config"]
    gap = results["fnr_gap" if config["fpfl_constraint"] == "fnr" else "accuracy_gap"]
    expected: dict[str, Any] = {"alpha": config["fpfl_alpha"]}
    if gap is not None:
        expected["test-gap"] = gap
        expected["constraint-holds"] = gap <= config["fpfl_alpha"]
        expected["accuracy"] = results["accuracy"]
    baseline = results["fairness_constraint"]["unconstrained_baseline"]
    if baseline is not None:
        expected["baseline-gap"] = baseline["fnr_gap"]
        expected["baseline-accuracy"] = baseline["accuracy"]
    return expected


def pipeline_expected(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per model its first private gap and its FedEvalFair verdicts; per budget the comparison,
    recomputed here from the two audits' signed differences and standard errors."""
    expected: dict[str, Any] = {}
    for session in ("fpfl", "pfl"):
        model = results["models"][session]
        estimates = [a["estimate"] for a in model["audits"] if a["estimate"] is not None]
        if estimates:
            expected[f"{session}-gap"] = estimates[0]["max_gap"]
            expected[f"{session}-low"], expected[f"{session}-high"] = estimates[0][
                "max_gap_interval"
            ]
        for test in model["fedevalfair"]["tests"]:
            report = test["report"]
            if report is None:
                continue
            key = f"{session}-{test['metric']}"
            alpha = report["alpha"]
            expected[f"{key}-stage1-pvalue"] = report["homogeneity"]["pvalue"]
            expected[f"{key}-reject-homogeneity"] = report["homogeneity"]["pvalue"] < alpha
            expected[f"{key}-stage2-pvalue"] = report["common_disparity"]["pvalue"]
            expected[f"{key}-reject-fairness"] = report["common_disparity"]["pvalue"] < alpha
        harness = model["harness"]
        if harness is not None and harness["audited_metric_gap"] is not None:
            expected[f"{session}-true-gap"] = harness["audited_metric_gap"]["max_gap"]
    confidence = results["run_config"]["confidence"]
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    for index, row in enumerate(results["comparison"]):
        key = f"compare-{row['budget']:g}"
        expected[f"{key}-budget"] = row["budget"]
        pfl = results["models"]["pfl"]["audits"][index]["estimate"]
        fpfl = results["models"]["fpfl"]["audits"][index]["estimate"]
        if pfl is None or fpfl is None:
            continue
        sign = 1.0 if pfl["differences"][0] >= 0 else -1.0
        difference = sign * (pfl["differences"][0] - fpfl["differences"][0])
        stderr = math.hypot(pfl["difference_stderrs"][0], fpfl["difference_stderrs"][0])
        expected[f"{key}-difference"] = pytest.approx(difference, rel=1e-12, abs=1e-15)
        expected[f"{key}-low"] = pytest.approx(difference - z * stderr, rel=1e-9, abs=1e-12)
        expected[f"{key}-high"] = pytest.approx(difference + z * stderr, rel=1e-9, abs=1e-12)
        if difference - z * stderr <= 0:
            if row["detectable_difference"] is not None:
                expected[f"{key}-detectable"] = row["detectable_difference"]
            expected[f"{key}-planned-for"] = results["run_config"]["pipeline_plan_difference"]
            if row["epsilon_needed_per_audit"] is not None:
                expected[f"{key}-needed"] = row["epsilon_needed_per_audit"]
            if row["users_needed_at_budget"] is not None:
                expected[f"{key}-users-needed"] = row["users_needed_at_budget"]
    return expected


EXPECTED: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "ldp-audit": ldp_expected,
    "fedevalfair": fedevalfair_expected,
    "fpfl": fpfl_expected,
    "pipeline": pipeline_expected,
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def assert_report_matches_results(folder: Path, console: str | None = None) -> ReportParser:
    """Check ``folder/report.html`` against ``folder/results.json`` (and the console log).

    The page is self-contained, its headline comes before any section, every headline number
    equals results.json's (exactly, from ``data-value``; the printed text to its precision),
    and, with ``console``, the log shows the headline lines in order and names report.html.
    """
    results = json.loads((folder / "results.json").read_text())
    parsed = parse_report((folder / REPORT_FILE).read_text(encoding="utf-8"))
    assert_self_contained(parsed)
    assert parsed.headline_before_sections and parsed.headline_lines
    expected = EXPECTED[results["task"]](results)
    assert set(parsed.values) == set(expected), set(parsed.values) ^ set(expected)
    for key, wanted in expected.items():
        value, text = parsed.values[key]
        if isinstance(wanted, bool):
            assert value is wanted, key
        elif wanted is None:
            assert value is None and text == "n/a", key
        elif hasattr(wanted, "expected"):  # pytest.approx: recomputed here, rounding apart
            assert value == wanted, (key, value, wanted)
            assert _shown_number_matches(text, wanted.expected), (key, text, wanted)
        else:
            assert value == wanted, (key, value, wanted)
            assert _shown_number_matches(text, wanted), (key, text, wanted)
    if console is not None:
        lines = [_ANSI.sub("", line).rstrip() for line in console.splitlines()]
        first = parsed.headline_lines[0]
        start = next(i for i, line in enumerate(lines) if line.endswith(first))
        for offset, headline in enumerate(parsed.headline_lines):
            assert lines[start + offset].endswith(headline), (lines[start + offset], headline)
        assert f"(report: {folder / REPORT_FILE})" in console
    return parsed


# --------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------

HOSTILE = "<script>alert('x')</script>\"' onload=\"alert(1)\" &amp; <img src=http://evil/>"


def test_hostile_strings_are_escaped_everywhere(tmp_path: Path) -> None:
    report = Report(
        title=HOSTILE,
        question=HOSTILE,
        headline=[
            Finding((HOSTILE, Value(HOSTILE, 0.5)), "bad"),
            Finding(("flag ", Value("flag", True, words=(HOSTILE, "no")))),
        ],
        warnings=[HOSTILE],
        notes=[HOSTILE],
        sections=[
            Section(
                HOSTILE,
                [
                    HOSTILE,
                    Table([HOSTILE, "n"], [[HOSTILE, 1.25], [None, math.nan]], caption=HOSTILE),
                    Figure(tmp_path / "absent.png", HOSTILE, missing=HOSTILE),
                ],
            )
        ],
        privacy=Section(HOSTILE, [HOSTILE]),
        about=[(HOSTILE, HOSTILE)],
        run_config={HOSTILE: HOSTILE},
    )
    path = write_report(tmp_path, report)
    assert path == tmp_path / REPORT_FILE
    parsed = parse_report(path.read_text(encoding="utf-8"))
    assert_self_contained(parsed)
    assert {tag for tag, _ in parsed.tags} <= {
        "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "div", "span",
        "section", "table", "caption", "thead", "tbody", "tr", "th", "td", "b", "details",
        "summary",
    }  # fmt: skip
    text = "".join(parsed.text)
    # Every hostile string comes back as text: the title, question, headline, warning, note,
    # section title, paragraph, table header, cell and caption, figure note, privacy, the run's
    # description and its run config.
    assert text.count(HOSTILE) >= 17
    assert parsed.values[HOSTILE] == (0.5, "0.5000")
    assert parsed.values["flag"] == (True, HOSTILE)
    assert parsed.headline_lines[0] == HOSTILE + "0.5000"
    assert report.headline[0].plain() == parsed.headline_lines[0]


def test_the_report_says_which_run_it_is_and_with_what_config(tmp_path: Path) -> None:
    """Report pages had no run id, date or config: two runs' pages could not be told apart."""
    from fedparity.clients.project.config import RunConfig
    from fedparity.server.run_record import open_run_record

    config = RunConfig.from_mapping({"output-dir": str(tmp_path), "epsilons": "0.5,2"})
    record = open_run_record(config)
    record.update(run_id=987654321)
    (tmp_path / "results.json").write_text(
        json.dumps({"run_config": {"task": "ldp-audit", "epsilons": [0.5, 2.0]}})
    )
    report = Report("LDP audit", "question?", [Finding(("answer",))], [], Section("Privacy", []))
    page = write_report(tmp_path, report).read_text(encoding="utf-8")
    parsed = parse_report(page)
    about = next(line for line in page.splitlines() if 'class="about"' in line)
    started = record.payload["started"][:10]
    for shown in ("run <b>987654321</b>", "task <b>ldp-audit</b>", started, str(tmp_path)):
        assert shown in about, (shown, about)
    text = "".join(parsed.text)
    assert "Run config" in text and "epsilons" in text and "[0.5, 2.0]" in text
    # the question and the answer still come first
    assert page.index('class="headline"') < page.index("Run config")


def test_values_print_plainly_and_mark_their_exact_value() -> None:
    assert Value("gap", 0.123456).text() == "0.1235"
    assert Value("eps", 4.0, "g").text() == "4"
    assert Value("p", 1.234e-7, ".3g").text() == "1.23e-07"
    assert Value("gap", None).text() == "n/a" and Value("gap", math.nan).text() == "n/a"
    assert Value("fair", False, words=("holds", "is violated")).text() == "is violated"
    parsed = parse_report(f"<div class=headline><p>{Value('gap', 0.1234567891234).html()}</p>")
    assert parsed.values["gap"] == (0.1234567891234, "0.1235")
    assert parse_report(Value("gap", math.inf).html()).values["gap"] == (None, "n/a")
    with pytest.raises(ValueError, match="tone"):
        Finding(("x",), "loud")


def test_every_plot_without_matplotlib_leaves_a_note_in_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """matplotlib missing (an import that fails): the three jobs' plot functions write
    nothing and say so, and the report is still written, saying what plots need."""
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    with pytest.raises(ImportError):
        import matplotlib  # noqa: F401
    notes = [
        plot_audits(tmp_path / "gap_vs_epsilon.png", [1.0], [], None, "accuracy"),
        plot_training(tmp_path / "training.png", [], 0.02),
        plot_bootstrap_distributions(tmp_path / "bootstrap_disparities.png", None),  # type: ignore[arg-type]
    ]
    assert notes == [PLOT_NEEDS_MATPLOTLIB] * 3
    assert not list(tmp_path.glob("*.png"))
    report = Report(
        title="t",
        question="q",
        headline=[Finding(("answer",))],
        sections=[Section("Detail", [Figure(tmp_path / "training.png", "curves", notes[0])])],
        privacy=Section("Privacy spent", ["none"]),
    )
    page = write_report(tmp_path, report).read_text(encoding="utf-8")
    parsed = parse_report(page)
    assert all(tag != "img" for tag, _ in parsed.tags)
    assert "pip install 'fedparity[plot]'" in "".join(parsed.text)


def test_figures_are_embedded_as_data_uris(tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
    (tmp_path / "plot.png").write_bytes(png)
    page = render_report(
        Report(
            title="t",
            question="q",
            headline=[Finding(("answer",))],
            sections=[Section("Detail", [Figure(tmp_path / "plot.png", "a plot")])],
            privacy=Section("Privacy spent", []),
        )
    )
    images = [attrs for tag, attrs in parse_report(page).tags if tag == "img"]
    assert len(images) == 1
    import base64

    source = images[0]["src"]
    assert source is not None
    assert base64.b64decode(source.removeprefix("data:image/png;base64,")) == png


def test_axes_are_labelled_in_plain_numbers() -> None:
    """A log epsilon axis reads 0.5, 1, 2, 4 (not 6x10^-1, 10^0, 2x10^0), and a linear axis
    carries no offset or scientific factor."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (log_axes, linear_axes) = plt.subplots(1, 2)
    budgets = [0.5, 1.0, 2.0, 4.0]
    log_axes.plot(budgets, [0.1, 0.2, 0.1, 0.15], "o")
    log_axes.set_xscale("log")
    log_axes.set_xticks(budgets)
    linear_axes.plot([1, 2, 3], [1000.001, 1000.002, 1000.003])
    linear_axes.set_yscale("linear")
    plain_tick_labels(log_axes)
    plain_tick_labels(linear_axes)
    figure.canvas.draw()
    labels = [label.get_text() for label in log_axes.get_xticklabels()]
    assert labels == ["0.5", "1", "2", "4"]
    assert all(not label.get_text() for label in log_axes.get_xticklabels(minor=True))
    assert linear_axes.yaxis.get_offset_text().get_text() == ""
    for label in linear_axes.get_yticklabels():
        assert re.fullmatch(r"-?[0-9.]+", label.get_text().replace("\u2212", "-")), label
    plt.close(figure)
