"""``fedparity fairtest``: FedEvalFair from a CSV of per-client summaries (server/cli.py).

The printed and JSON values are checked against the library
(:func:`fedparity.mechanisms.fedevalfair`)
and, for the headline numbers, against the formulas written out here (Graybill-Deal estimate,
Cochran's Q with scipy's chi2, W* with scipy's normal).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedparity.mechanisms import ClientSummary, fedevalfair
from tests.support.fixtures import assert_usage_error, cli_json, run_cli

ROWS = [  # client, mean, variance, n (an extra column that the command ignores)
    ("north", 0.012, 4.0e-4, 100),
    ("south", 0.031, 9.0e-4, 100),
    ("east", -0.004, 2.0e-4, 200),
    ("west", 0.020, 6.0e-4, 150),
]
JSON_KEYS = {
    "input",
    "mode",
    "alpha",
    "k",
    "mu0",
    "tolerance",
    "estimate",
    "stderr",
    "confidence_level",
    "confidence_interval",
    "homogeneity",
    "common_disparity",
    "equivalence",
    "reject_homogeneity",
    "reject_fairness",
    "certified_fair",
    "pooled",
    "random_effects",
}
TEST_KEYS = {"statistic", "dof", "pvalue", "estimate", "stderr", "method", "null_value"}


def write_csv(path: Path, rows: list[tuple] = ROWS, header: str = "client,mean,variance,n") -> Path:
    lines = [header] + [",".join(str(field) for field in row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def summaries() -> list[ClientSummary]:
    return [ClientSummary(mean, variance, n) for _, mean, variance, n in ROWS]


@pytest.fixture
def csv_path(tmp_path: Path) -> Path:
    return write_csv(tmp_path / "clients.csv")


def test_json_output_matches_the_library_and_the_formulas(csv_path: Path) -> None:
    payload = cli_json(["fairtest", "--input", str(csv_path), "--tolerance", "0.05"])
    assert set(payload) == JSON_KEYS
    assert set(payload["homogeneity"]) == TEST_KEYS
    assert set(payload["common_disparity"]) == TEST_KEYS
    assert set(payload["equivalence"]) == TEST_KEYS
    report = fedevalfair(summaries(), tolerance=0.05)
    assert payload == {"input": str(csv_path), **report.to_dict()}
    # Independent formulas (calibrated mode: w = 1 / S^2).
    means = np.array([row[1] for row in ROWS])
    w = 1.0 / np.array([row[2] for row in ROWS])
    mu_hat = float(np.sum(w * means) / np.sum(w))
    q = float(np.sum(w * (means - mu_hat) ** 2))
    w_star = math.sqrt(w.sum()) * mu_hat
    assert payload["estimate"] == pytest.approx(mu_hat, rel=1e-12)
    assert payload["stderr"] == pytest.approx(1 / math.sqrt(w.sum()), rel=1e-12)
    assert payload["homogeneity"]["statistic"] == pytest.approx(q, rel=1e-12)
    assert payload["homogeneity"]["dof"] == 3
    assert payload["homogeneity"]["pvalue"] == pytest.approx(stats.chi2.sf(q, 3), rel=1e-10)
    assert payload["common_disparity"]["pvalue"] == pytest.approx(
        2 * stats.norm.sf(abs(w_star)), rel=1e-10
    )
    z = stats.norm.ppf(0.975)
    assert payload["confidence_interval"] == pytest.approx(
        [mu_hat - z / math.sqrt(w.sum()), mu_hat + z / math.sqrt(w.sum())], rel=1e-10
    )
    assert payload["k"] == 4 and payload["mode"] == "calibrated" and payload["tolerance"] == 0.05
    # A CSV of mean, variance and n has no counts: no pooled disparity; the random-effects
    # summary is there (V_i = S_i^2): DerSimonian-Laird's tau^2 from the same Q.
    assert payload["pooled"] is None
    spread = w.sum() - (w**2).sum() / w.sum()
    assert payload["random_effects"]["tau2"] == pytest.approx(max(0.0, (q - 3) / spread), abs=1e-15)


def test_json_paper_mode_and_options(csv_path: Path) -> None:
    payload = cli_json(
        ["fairtest", "--input", str(csv_path), "--mode", "paper", "--alpha", "0.1", "--mu0", "0.01"]
    )
    report = fedevalfair(summaries(), mode="paper", alpha=0.1, mu0=0.01)
    assert payload == {"input": str(csv_path), **report.to_dict()}
    assert payload["equivalence"] is None and payload["certified_fair"] is None
    assert payload["confidence_level"] == pytest.approx(0.9)
    assert payload["common_disparity"]["null_value"] == 0.01


def test_text_output(csv_path: Path) -> None:
    code, text, _ = run_cli(["fairtest", "--input", str(csv_path), "--tolerance", "0.05"])
    assert code == 0
    report = fedevalfair(summaries(), tolerance=0.05)
    assert "mode calibrated" in text and "k = 4 clients" in text
    numbers = {
        name: float(match.group(1))
        for name, pattern in (
            ("q", r"Cochran's Q = ([-0-9.e]+)"),
            ("p1", r"dof 3, p = ([-0-9.e]+)"),
            ("w", r"W\* = ([-0-9.e]+)"),
            ("estimate", r"Graybill-Deal\): ([-0-9.e]+)"),
            ("stderr", r"stderr ([-0-9.e]+)"),
            ("tost", r"TOST, H0: \|mu\| >= 0.05\): z = ([-0-9.e]+)"),
        )
        if (match := re.search(pattern, text))
    }
    assert len(numbers) == 6, text
    assert numbers["q"] == pytest.approx(report.homogeneity.statistic, rel=1e-5)
    assert numbers["p1"] == pytest.approx(report.homogeneity.pvalue, rel=1e-3)
    assert numbers["w"] == pytest.approx(report.common_disparity.statistic, rel=1e-5)
    assert numbers["estimate"] == pytest.approx(report.estimate, rel=1e-5)
    assert numbers["stderr"] == pytest.approx(report.stderr, rel=1e-3)
    assert numbers["tost"] == pytest.approx(report.equivalence.statistic, rel=1e-5)  # type: ignore[union-attr]
    interval = report.confidence_interval(0.95)
    assert f"95% CI [{interval.low:.6g}, {interval.high:.6g}]" in text
    decision = "certified fair" if report.certified_fair else "not certified"
    assert decision in text
    for line in text.splitlines()[1:3]:
        assert line.endswith("-> rejected") or line.endswith("-> not rejected")


MARGIN_HEADER = "client,mean,variance,n,group0_rows,group1_rows,predicted_positive_rows"
#: Holders' group counts (group-0 rows, of them predicted positive, group-1 rows, of them
#: predicted positive): disparities 0.25, 0.03, 0.12 (stage 1 rejects, Q = 22, p = 2e-5) ...
DIFFERING = [(400, 200, 600, 150), (300, 90, 300, 81), (500, 160, 250, 50)]
#: ... and 0.05, 0.05, 0.1 (stage 1 does not reject, p = 0.46).
AGREEING = [(400, 120, 600, 150), (300, 90, 300, 75), (500, 150, 250, 50)]
#: format_number's ".4f" (estimates, interval ends) and ".3g" (tau^2 and its interval) round
#: to half a unit in the last printed place: 5e-5 absolute, 5e-3 relative at most.
FOUR_DECIMALS, THREE_DIGITS = 5e-5 + 1e-12, 5e-3


def counted_summary(n0: int, x0: int, n1: int, x1: int) -> ClientSummary:
    """A calibrated summary from a holder's counts: the plug-in disparity x0/n0 - x1/n1, the
    binomial variance of it as the bootstrap's S^2, B = 200, and the margins."""
    p0, p1 = x0 / n0, x1 / n1
    return ClientSummary(p0 - p1, p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1, 200, (n0, n1, x0 + x1))


def write_counted_csv(path: Path, counts: list[tuple[int, int, int, int]]) -> Path:
    """The summaries of ``counts`` as CSV rows, floats written in full (repr)."""
    rows = []
    for index, holder in enumerate(counts):
        s = counted_summary(*holder)
        assert s.margins is not None
        rows.append((f"h{index}", repr(s.mean), repr(s.variance), s.n, *s.margins))
    return write_csv(path, rows, MARGIN_HEADER)


def number(pattern: str, text: str) -> float:
    """The number that ``pattern``'s group matches in ``text`` (exactly one match)."""
    matches = re.findall(pattern, text)
    assert len(matches) == 1, (pattern, text)
    return float(matches[0])


def test_text_after_stage1_rejects_shows_the_pooled_and_random_effects_lines(
    tmp_path: Path,
) -> None:
    """Holders that differ: the text carries the report's pooled-disparity line and its
    random-effects line, with the numbers the library computes for the same summaries; the
    JSON carries the same objects (to_dict)."""
    path = write_counted_csv(tmp_path / "differ.csv", DIFFERING)
    code, text, _ = run_cli(["fairtest", "--input", str(path)])
    assert code == 0
    report = fedevalfair([counted_summary(*holder) for holder in DIFFERING])
    assert report.reject_homogeneity and report.pooled and report.random_effects
    pooled, effects = report.pooled, report.random_effects
    # Pooled: (200 + 90 + 160) / 1200 - (150 + 81 + 50) / 1150, the counts summed.
    assert pooled.estimate == pytest.approx(450 / 1200 - 281 / 1150, rel=1e-12)
    pooled_line = next(line for line in text.splitlines() if line.startswith("pooled"))
    pooled_interval = pooled.confidence_interval(0.95)
    assert number(r"pooled disparity[^:]*: ([-0-9.]+)", pooled_line) == pytest.approx(
        pooled.estimate, abs=FOUR_DECIMALS
    )
    assert [
        number(r"interval \[([-0-9.]+),", pooled_line),
        number(r"interval \[[-0-9.]+, ([-0-9.]+)\]", pooled_line),
    ] == pytest.approx([pooled_interval.low, pooled_interval.high], abs=FOUR_DECIMALS)
    tau2 = number(r"tau\^2 = ([0-9.e-]+)", text)
    low = number(r"Q-profile interval \[([0-9.e-]+),", text)
    high = number(r"Q-profile interval \[[0-9.e-]+, ([0-9.e-]+)\]", text)
    assert effects.tau2 > 0 and math.isfinite(effects.tau2_interval.high)
    assert tau2 == pytest.approx(effects.tau2, rel=THREE_DIGITS)
    assert [low, high] == pytest.approx(
        [effects.tau2_interval.low, effects.tau2_interval.high], rel=THREE_DIGITS
    )
    assert number(r"random-effects mean ([-0-9.]+)", text) == pytest.approx(
        effects.estimate, abs=FOUR_DECIMALS
    )
    assert number(r"tau = ([0-9.]+)", text) == pytest.approx(effects.tau, abs=FOUR_DECIMALS)
    # The CLI's own stage lines stay; the report's stage lines are not printed a second time.
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("stage")] == lines[1:3]
    assert text.splitlines()[-1] == report.summary().splitlines()[-1]
    payload = cli_json(["fairtest", "--input", str(path)])
    assert payload["pooled"] == pooled.to_dict()
    assert payload["random_effects"] == effects.to_dict()


def test_text_when_the_holders_agree_has_no_random_effects_line(tmp_path: Path) -> None:
    """Stage 1 does not reject: the pooled line, no random-effects line."""
    path = write_counted_csv(tmp_path / "agree.csv", AGREEING)
    code, text, _ = run_cli(["fairtest", "--input", str(path), "--tolerance", "0.2"])
    assert code == 0
    report = fedevalfair([counted_summary(*holder) for holder in AGREEING], tolerance=0.2)
    assert not report.reject_homogeneity and report.pooled is not None
    assert number(r"pooled disparity[^:]*: ([-0-9.]+)", text) == pytest.approx(
        report.pooled.estimate, abs=FOUR_DECIMALS
    )
    assert "random-effects" not in text and "tau" not in text and "after stage 1" not in text
    assert "not shown" not in text


def test_text_says_in_one_line_why_no_pooled_disparity_is_shown(tmp_path: Path) -> None:
    """Without the margin columns the CSV has no group counts; with them, a mean that no
    whole counts give (rounded) is named by its row."""
    code, text, _ = run_cli(["fairtest", "--input", str(write_csv(tmp_path / "plain.csv"))])
    assert code == 0
    reasons = [line for line in text.splitlines() if line.startswith("pooled disparity")]
    assert reasons == [
        "pooled disparity: not shown, the CSV has no group counts (the columns "
        "group0_rows, group1_rows, predicted_positive_rows)"
    ]
    # Row 3's mean 70/300 - 50/250 = 0.0333... written as 0.033: no whole x0 gives it.
    rounded = [("a", 0.25, 0.0009375, 200, 400, 600, 350), ("b", 0.033, 0.0012, 200, 300, 250, 120)]
    path = write_csv(tmp_path / "rounded.csv", rounded, MARGIN_HEADER)
    code, text, _ = run_cli(["fairtest", "--input", str(path)])
    assert code == 0
    reasons = [line for line in text.splitlines() if line.startswith("pooled disparity")]
    assert len(reasons) == 1 and reasons[0].startswith(
        "pooled disparity: not shown, the mean of row 3 is not x0 / group0_rows - x1 / "
        "group1_rows for whole counts"
    )
    assert cli_json(["fairtest", "--input", str(path)])["pooled"] is None
    unrounded = ("b", 0.0333333333333333, *rounded[1][2:])  # within 1e-16 of 70/300 - 50/250
    exact = write_csv(tmp_path / "exact.csv", [rounded[0], unrounded], MARGIN_HEADER)
    assert cli_json(["fairtest", "--input", str(exact)])["pooled"] is not None


def test_the_cli_guides_fairtest_examples_print_what_the_command_prints(tmp_path: Path) -> None:
    """docs/guides/cli.md records ``cat holders.csv`` and ``fedparity fairtest ...`` sessions:
    the command, run on that CSV, prints the recorded lines."""
    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "cli.md"
    session = re.compile(
        r"```text\n\$ cat holders\.csv\n(.*?)\$ fedparity (fairtest [^\n]*)\n(.*?)```", re.DOTALL
    )
    examples = session.findall(guide.read_text(encoding="utf-8"))
    assert len(examples) == 2
    for table, command, recorded in examples:
        path = tmp_path / "holders.csv"
        path.write_text(table, encoding="utf-8")
        argv = command.replace("holders.csv", str(path)).split()
        code, text, _ = run_cli(argv)
        assert code == 0 and text == recorded, (command, text)


def test_paper_mode_text_warns(csv_path: Path) -> None:
    code, text, _ = run_cli(["fairtest", "--input", str(csv_path), "--mode", "paper"])
    assert code == 0
    assert "T1 (FedEvalFair Eq. 10)" in text
    assert "see fedparity.mechanisms.fairness_tests.fedevalfair" in text
    assert "TOST" not in text


def test_extra_columns_any_order_and_blank_lines_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "shuffled.csv"
    lines = ["n,note,variance,mean"] + [f"{n},x{i},{v},{m}" for i, (_, m, v, n) in enumerate(ROWS)]
    path.write_text("\ufeff" + "\n".join(lines) + "\n\n", encoding="utf-8")  # BOM, blank line
    payload = cli_json(["fairtest", "--input", str(path)])
    assert payload["estimate"] == pytest.approx(fedevalfair(summaries()).estimate, rel=1e-12)


# --- bad input: exit 2, nothing on stdout, one line on stderr naming the parameter ---------------


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        (["--alpha", "0"], ("--alpha", "(0, 1)")),
        (["--alpha", "1"], ("--alpha", "(0, 1)")),
        (["--alpha", "nan"], ("--alpha",)),
        (["--alpha", "x"], ("--alpha", "number")),
        (["--mu0", "inf"], ("--mu0", "finite")),
        (["--tolerance", "-0.01"], ("--tolerance", ">= 0")),
        (["--tolerance", "abc"], ("--tolerance", "number")),
        (["--mode", "exact"], ("--mode",)),
    ],
)
def test_bad_options(csv_path: Path, options: list[str], needles: tuple[str, ...]) -> None:
    assert_usage_error(["fairtest", "--input", str(csv_path), *options], *needles)


@pytest.mark.parametrize(
    ("rows", "header", "needles"),
    [
        ([("a", 0.1, 0.0, 100), ("b", 0.1, 0.1, 100)], None, ("--input", "row 2", "variance")),
        ([("a", 0.1, -1, 100), ("b", 0.1, 0.1, 100)], None, ("--input", "variance", "> 0")),
        ([("a", 0.1, "nan", 100), ("b", 0.1, 0.1, 100)], None, ("--input", "variance")),
        ([("a", 0.1, 0.1, 100), ("b", 0.1, 0.1, 1)], None, ("--input", "row 3", "n must")),
        ([("a", 0.1, 0.1, 100), ("b", 0.1, 0.1, 2.5)], None, ("--input", "n must")),
        ([("a", "x", 0.1, 100), ("b", 0.1, 0.1, 100)], None, ("--input", "'mean'", "'x'")),
        ([("a", "inf", 0.1, 100), ("b", 0.1, 0.1, 100)], None, ("--input", "mean")),
        ([("a", 0.1, 0.1, 100)], None, ("--input", "at least 2 clients")),
        ([], None, ("--input", "at least 2 clients")),
        ([("a", 0.1, 0.1)], "client,mean,variance", ("--input", "'n'")),
        ([("a", 0.1, 0.1, 100), ("b", 0.1)], None, ("--input", "row 3", "fields")),
        (
            [("a", 0.1, 0.1, 100, 50, 20), ("b", 0.1, 0.1, 100, 40, 30)],
            "client,mean,variance,n,group0_rows,group1_rows",
            ("--input", "margin columns", "predicted_positive_rows"),
        ),
        (
            [("a", 0.1, 0.1, 100, 50, 20, 70), ("b", 0.1, 0.1, 100, 40, 30, 9)],
            "client,mean,variance,n,group0_rows,group1_rows,predicted_positive_rows",
            ("--input", "row 2", "predicted_positive_rows"),
        ),
    ],
)
def test_bad_csv(
    tmp_path: Path,
    rows: list[tuple],
    header: str | None,
    needles: tuple[str, ...],
) -> None:
    path = write_csv(tmp_path / "bad.csv", rows, header or "client,mean,variance,n")
    assert_usage_error(["fairtest", "--input", str(path)], *needles)


def test_margin_columns_give_the_calibrated_weights(tmp_path: Path) -> None:
    """With group0_rows, group1_rows, predicted_positive_rows the CSV's summaries carry their
    margins (ClientSummary.margins): the command reports what the library does with them,
    which differs from the report without margins."""
    margins = [(80, 20, 30), (150, 50, 61), (90, 110, 40), (60, 90, 75)]
    rows = [(*row, *m) for row, m in zip(ROWS, margins, strict=True)]
    header = "client,mean,variance,n,group0_rows,group1_rows,predicted_positive_rows"
    path = write_csv(tmp_path / "margins.csv", rows, header)
    payload = cli_json(["fairtest", "--input", str(path), "--json"])
    expected = fedevalfair(
        [ClientSummary(m, v, n, mg) for (_, m, v, n), mg in zip(ROWS, margins, strict=True)]
    )
    assert payload["estimate"] == pytest.approx(expected.estimate, rel=1e-12)
    assert payload["stderr"] == pytest.approx(expected.stderr, rel=1e-12)
    assert payload["homogeneity"]["pvalue"] == pytest.approx(expected.homogeneity.pvalue, rel=1e-9)
    assert payload["common_disparity"]["pvalue"] == pytest.approx(
        expected.common_disparity.pvalue, rel=1e-12
    )
    assert payload["estimate"] != pytest.approx(fedevalfair(summaries()).estimate, rel=1e-3)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    assert_usage_error(
        ["fairtest", "--input", str(tmp_path / "absent.csv")], "--input", "no such file"
    )
    empty = tmp_path / "empty.csv"
    empty.write_text("", encoding="utf-8")
    assert_usage_error(["fairtest", "--input", str(empty)], "--input", "empty")


def test_input_is_required() -> None:
    assert_usage_error(["fairtest"], "--input")


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        (["--coeff-mod-bit-sizes", "60,60,60,60"], ("240 bits exceeds 218",)),
        (["--poly-modulus-degree", "4096"], ("exceeds 109",)),
        (["--poly-modulus-degree", "5000"], ("5000",)),
        (["--coeff-mod-bit-sizes", "60,x"], ("--coeff-mod-bit-sizes", "integers")),
    ],
)
def test_keys_refuses_parameters_below_128_bit_security(
    tmp_path: Path, options: list[str], needles: tuple[str, ...]
) -> None:
    """`fedparity keys` with CKKS parameters outside the HomomorphicEncryption.org 128-bit
    table exits 2 with a one-line message, and writes no key file."""
    out = tmp_path / "keys"
    code, text, err = run_cli(["keys", "--out", str(out), *options])
    assert code == 2 and text == ""
    assert err.startswith("fedparity keys: error:") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists() or not any(out.iterdir())


def test_keys_for_holders_writes_private_folders_a_roster_and_the_public_context_apart(
    tmp_path: Path,
) -> None:
    """`fedparity keys --holders 3`: one private folder per holder (the shared secret
    context and its own identity key), the roster of the three keys, and the public context
    only in --public-out; a node loads its material from the folder."""
    import stat

    from fedparity.clients.identity import node_identity
    from fedparity.mechanisms.crypto.ckks import load_public_context, load_secret_context
    from fedparity.mechanisms.crypto.identity import Roster

    out, public = tmp_path / "holders", tmp_path / "server"
    payload = cli_json(["keys", "--holders", "3", "--out", str(out), "--public-out", str(public)])
    roster = Roster.from_file(payload["roster"])
    assert len(roster) == 3
    keys = set()
    for index, holder in enumerate(payload["holders"]):
        folder = Path(holder["folder"])
        assert folder == (out / f"holder-{index}").resolve()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        for name in ("secret_context", "identity_key"):
            assert stat.S_IMODE(Path(holder[name]).stat().st_mode) == 0o600
        load_secret_context(holder["secret_context"])
        identity = node_identity(
            {"identity-key": holder["identity_key"], "roster": holder["roster"]}
        )
        key, own_roster = identity.require("test")
        assert own_roster == roster
        keys.add(key.public_bytes())
    assert len(keys) == 3  # one identity per holder, one shared secret context
    secrets = {Path(h["secret_context"]).read_bytes() for h in payload["holders"]}
    assert len(secrets) == 1
    assert [p.name for p in public.iterdir()] == ["public_context.tenseal"]
    load_public_context(payload["public_context"])  # no secret key in it
    assert not list(out.rglob("public_context.tenseal"))
    # Without --public-out, or with it inside --out, or again without --overwrite: refused.
    for argv in (
        ["keys", "--holders", "3", "--out", str(tmp_path / "x")],
        ["keys", "--holders", "3", "--out", str(out), "--public-out", str(out / "pub")],
        ["keys", "--holders", "3", "--out", str(out), "--public-out", str(public)],
    ):
        code, _, _ = run_cli(argv)
        assert code == 2


def test_a_non_utf8_or_folder_input_names_the_option_and_the_file(tmp_path: Path) -> None:
    """Before: Python's codec error (no option, no file), and "no such file" for a folder
    (issue 32, item 4)."""
    path = tmp_path / "latin.csv"
    path.write_bytes("mean,variance,n\n0.5,0.1,10\n0.4,0.1,10 caf\u00e9\n".encode("latin-1"))
    for target, needle in (
        (path, "is not UTF-8 text (byte 0xe9 on line 3)"),
        (tmp_path, "is a folder"),
    ):
        code, text, err = run_cli(["fairtest", "--input", str(target)])
        assert code == 2 and text == "" and err.count("\n") == 1
        assert f"--input: {target} " in err and needle in err and "codec" not in err
