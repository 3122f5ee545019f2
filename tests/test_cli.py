"""The ``fedparity`` command line (server/cli.py): privacy, plan and measure."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.support.fixtures import CliResult, assert_usage_error, cli_json, run_cli


def spec_true_epsilon(mechanism: str, eps1: float, eps2: float, grid: int = 1) -> float:
    """The true-epsilon closed forms (M_R any d; M_L with k = 2; M_N's two-group form with grid
    G), not Theorems 5/6 of Juarez and Korolova 2022, which are false (see
    fedparity.mechanisms.ldp.calibration.true_epsilon)."""
    if mechanism == "N":
        kept = math.log((grid + 1) * math.exp(eps2) / (math.exp(eps2) + grid))
        flipped = math.log((math.exp(eps2) + grid) / (grid + 1))
        return max(eps2, eps1 + kept, flipped - eps1)
    if mechanism == "R":
        log_two_b = math.log(2.0) - math.log1p(math.exp(-eps2))
        log_half = math.log1p(math.exp(eps2)) - math.log(2.0)
        return max(eps2, eps1 + log_two_b, log_half - eps1)
    return max(eps2, eps1 + eps2 / 2.0)


# --- privacy --------------------------------------------------------------------------------------


def test_privacy_of_m_p_is_m_ls_closed_form_without_a_paper_claim() -> None:
    payload = cli_json(
        ["privacy", "--mechanism", "P", "--eps1", "1", "--eps2", "3", "--groups", "3"]
    )
    assert payload["mechanism"] == "P" and payload["num_groups"] == 3
    assert payload["epsilon"] == pytest.approx(spec_true_epsilon("P", 1.0, 3.0))
    assert payload["paper_claimed_epsilon"] is None and payload["noise_ratio"] is None
    code, _, err = run_cli(
        ["privacy", "--mechanism", "P", "--eps1", "1", "--eps2", "1", "--k", "3"]
    )
    assert code == 2 and "--k only applies to --mechanism L (M_P has no noise ratio)" in err


def test_privacy_of_m_n_needs_its_grid_and_has_no_paper_claim() -> None:
    payload = cli_json(["privacy", "--mechanism", "N", "--eps1", "2", "--eps2", "2", "--grid", "2"])
    assert payload["mechanism"] == "N" and payload["grid_size"] == 2
    assert payload["epsilon"] == pytest.approx(spec_true_epsilon("N", 2.0, 2.0, 2))
    assert payload["paper_claimed_epsilon"] is None and payload["noise_ratio"] is None
    # the grid changes the epsilon: G = 1 is M_R's
    coarse = cli_json(["privacy", "--mechanism", "N", "--eps1", "2", "--eps2", "2"])
    assert coarse["epsilon"] == pytest.approx(spec_true_epsilon("R", 2.0, 2.0))
    assert coarse["epsilon"] != pytest.approx(payload["epsilon"])
    code, text, _ = run_cli(
        ["privacy", "--mechanism", "N", "--eps1", "2", "--eps2", "2", "--grid", "2"]
    )
    assert code == 0 and text.startswith("M_N with eps1=2, eps2=2, d=2, G=2: true epsilon")
    for argv, message in [
        (["--mechanism", "L", "--grid", "2"], "--grid only applies to --mechanism N (M_L has"),
        (["--mechanism", "N", "--grid", "0"], "--grid"),
        (["--mechanism", "N", "--grid", "1024"], "--grid"),
    ]:
        code, _, err = run_cli(["privacy", "--eps1", "1", "--eps2", "1", *argv])
        assert code == 2 and message in err


def test_privacy_spec_example_text_and_json() -> None:
    code, text, _ = run_cli(["privacy", "--mechanism", "R", "--eps1", "1", "--eps2", "1"])
    assert code == 0
    match = re.search(r"true epsilon = ([0-9.]+)", text)
    assert match is not None
    assert round(float(match.group(1)), 4) == 1.3799  # not 1: the paper's Theorem 5 is false
    payload = cli_json(["privacy", "--mechanism", "R", "--eps1", "1", "--eps2", "1"])
    assert round(payload["epsilon"], 4) == 1.3799
    assert payload["paper_claimed_epsilon"] == 1.0  # Theorem 5's (wrong) claim


def test_privacy_laplace_k2() -> None:
    payload = cli_json(["privacy", "--mechanism", "L", "--eps1", "1", "--eps2", "2"])
    assert payload["epsilon"] == pytest.approx(2.0)  # max(eps2, eps1 + eps2/2)
    payload = cli_json(
        ["privacy", "--mechanism", "L", "--eps1", "1.5", "--eps2", "1", "--groups", "5"]
    )
    assert payload["epsilon"] == pytest.approx(2.0)


def test_privacy_laplace_k_not_two_is_refused() -> None:
    err = assert_usage_error(
        ["privacy", "--mechanism", "L", "--eps1", "1", "--eps2", "1", "--k", "0.6667"],
        "--k",
    )
    assert "unbounded" in err or "without bound" in err


@pytest.mark.parametrize("k", ["2", "2.0", "2e0", "2.000"])
@pytest.mark.parametrize("mechanism", ["R", "L"])
def test_privacy_k_is_compared_as_a_number(mechanism: str, k: str) -> None:
    payload = cli_json(
        ["privacy", "--mechanism", mechanism, "--eps1", "1", "--eps2", "1", "--k", k]
    )
    assert payload["epsilon"] == pytest.approx(spec_true_epsilon(mechanism, 1.0, 1.0))
    assert payload["noise_ratio"] == (2.0 if mechanism == "L" else None)


@pytest.mark.parametrize(
    ("mechanism", "k", "shown"),
    [("R", "2.5", "got 2.5"), ("R", "0.5", "got 0.5"), ("L", "2.0000001", "got 2.0000001")],
)
def test_privacy_k_other_than_two_is_refused_with_a_plain_number(
    mechanism: str, k: str, shown: str
) -> None:
    err = assert_usage_error(
        ["privacy", "--mechanism", mechanism, "--eps1", "1", "--eps2", "1", "--k", k],
        "--k",
        shown,
    )
    assert "np." not in err


def test_installed_script_exit_code_and_one_line_stderr(
    cli_script: Callable[..., CliResult],
) -> None:
    code, out, err = cli_script(
        ["privacy", "--mechanism", "L", "--eps1", "1", "--eps2", "1", "--k", "3"], timeout=60
    )
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert "--k" in err
    assert "unbounded" in err or "without bound" in err


# --- plan -----------------------------------------------------------------------------------------


PLAN_KEYS = {
    "query",
    "mechanism",
    "epsilon",
    "epsilon_group",
    "epsilon_value",
    "true_epsilon",
    "alpha",
    "candidates",
}


@pytest.mark.slow
def test_plan_alpha_path() -> None:
    payload = cli_json(["plan", "--clients", "1000000", "--alpha", "0.01"])
    assert PLAN_KEYS <= set(payload)
    assert payload["query"] == "min_epsilon"
    assert payload["alpha"] == 0.01
    assert [c["mechanism"] for c in payload["candidates"]] == ["R", "L", "P", "N"]
    budgets = [c["epsilon"] for c in payload["candidates"] if c["epsilon"] is not None]
    assert payload["epsilon"] == min(budgets)
    assert payload["mechanism"] in ("R", "L", "P", "N")
    true = spec_true_epsilon(
        payload["mechanism"], payload["epsilon_group"], payload["epsilon_value"]
    )
    # the realised epsilon of the chosen mechanism: M_R's exactly, M_L's grid sampler at most
    # the ideal one and within 1e-3 of it
    assert true * (1 - 1e-3) <= payload["true_epsilon"] <= true + 1e-12
    assert true <= payload["epsilon"] + 1e-12
    code, text, _ = run_cli(["plan", "--clients", "1000000", "--alpha", "0.01"])
    assert code == 0 and "best: M_" in text


def test_plan_epsilon_path() -> None:
    payload = cli_json(["plan", "--clients", "1e6", "--epsilon", "1", "--mechanism", "best"])
    assert PLAN_KEYS <= set(payload)
    assert payload["query"] == "error_bound"
    assert payload["epsilon"] == 1.0
    alphas = [c["alpha"] for c in payload["candidates"]]
    assert payload["alpha"] == min(alphas)
    assert payload["true_epsilon"] <= 1.0
    # Normal bound at 0.99 is z_0.995 / 10 of the Chebyshev one (same variance).
    normal = cli_json(
        ["plan", "--clients", "1e6", "--epsilon", "1", "--mechanism", "L", "--bound", "normal"]
    )
    chebyshev = cli_json(["plan", "--clients", "1e6", "--epsilon", "1", "--mechanism", "L"])
    assert normal["alpha"] == pytest.approx(2.5758293035489 / 10 * chebyshev["alpha"], rel=1e-9)


@pytest.mark.slow
def test_plan_table_has_paper_and_valid_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    # The valid table is a search per cell: the text and JSON runs share one computation
    # of each table (a cache around the real function, same arguments).
    import copy
    import functools

    from fedparity.server.cli import plan

    real = plan.table1
    cached = functools.cache(lambda **kwargs: real(**kwargs))
    monkeypatch.setattr(plan, "table1", lambda **kwargs: copy.deepcopy(cached(**kwargs)))
    code, text, _ = run_cli(["plan", "--table"])
    assert code == 0
    assert "1.86" in text and "178.89" in text  # paper's Table 1 cells
    assert "Valid mechanisms" in text
    payload = cli_json(["plan", "--table"])
    assert payload["paper_table1"]["R"][0][0] == pytest.approx(1.86, abs=0.005)
    assert payload["paper_table1"]["L"][0][2] == pytest.approx(178.89, abs=0.005)
    assert payload["paper_table1"]["R"][0][1] is None
    assert set(payload["valid_table1"]) == {"R", "L", "P", "N", "best"}


def test_plan_bad_inputs() -> None:
    assert_usage_error(["plan", "--clients", "1000"], "--alpha", "--epsilon")
    assert_usage_error(["plan", "--clients", "1000", "--alpha", "0.1", "--epsilon", "1"], "--alpha")
    assert_usage_error(["plan", "--alpha", "0.1"], "--clients")
    assert_usage_error(["plan", "--clients", "1", "--alpha", "0.1"], "--clients")
    assert_usage_error(["plan", "--clients", "1000", "--alpha", "0"], "--alpha")
    assert_usage_error(["plan", "--clients", "1000", "--epsilon", "nan"], "--epsilon")
    assert_usage_error(
        ["plan", "--clients", "1000", "--alpha", "0.1", "--confidence", "1"], "--confidence"
    )


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        # values the math does not support: refused by name with the allowed range, before
        # any work (the first used to fail inside the mechanism without naming the option,
        # and with M_L in a division by zero)
        (["--clients", "1000", "--epsilon", "1e-300"], ("--epsilon", "[1e-06, 10000]")),
        (["--clients", "1000", "--epsilon", "1e-300", "--mechanism", "L"], ("--epsilon",)),
        (["--clients", "1000", "--epsilon", "1e5"], ("--epsilon", "[1e-06, 10000]")),
        # a 300-digit K and a minimum epsilon clamped at the search limit used to exit 0
        (["--clients", "1e300", "--alpha", "0.1"], ("--clients", "1e+12")),
        # a target any estimate meets
        (["--clients", "1000", "--alpha", "2"], ("--alpha", "below 1", "metric scale")),
        (["--clients", "1000", "--alpha", "2", "--scale", "value"], ("--alpha", "below 2")),
        (["--clients", "1000", "--alpha", "0.1", "--group-ratio", "1e300"], ("--group-ratio",)),
        (["--clients", "1000", "--alpha", "0.1", "--group-ratio", "0"], ("--group-ratio",)),
    ],
)
def test_plan_refuses_values_outside_what_the_math_supports(
    argv: list[str], needles: tuple[str, ...]
) -> None:
    assert_usage_error(["plan", *argv], *needles)


def test_plan_says_when_an_error_bound_is_vacuous() -> None:
    # epsilon = 1e-5 with 1000 clients: an error bound of ~1e5 for a metric in [0, 1]
    payload = cli_json(["plan", "--clients", "1000", "--epsilon", "1e-5"])
    assert payload["alpha"] > 1 and payload["vacuous"] is True
    code, text, _ = run_cli(["plan", "--clients", "1000", "--epsilon", "1e-5"])
    assert code == 0 and text.count("vacuous") == 4  # one line per mechanism
    useful = cli_json(["plan", "--clients", "1000000", "--epsilon", "1"])
    assert useful["alpha"] < 1 and useful["vacuous"] is False
    code, text, _ = run_cli(["plan", "--clients", "1000000", "--epsilon", "1"])
    assert "vacuous" not in text


def test_plan_help_is_plain_text_with_examples() -> None:
    code, text, _ = run_cli(["plan", "--help"])
    assert code == 0
    assert "fedparity plan --clients 100000 --alpha 0.05" in text  # an example
    assert "randomized response" in text and "discrete Laplace" in text  # R and L explained
    assert ":func:" not in text and "``" not in text  # no RST markup


COMMAND_NAMES = (
    "privacy",
    "plan",
    "measure",
    "fairtest",
    "keys",
    "identity",
    "federations",
    "ledger",
    "run",
)


def help_examples(command: str) -> list[list[str]]:
    """The ``fedparity ...`` example command lines of a subcommand's help, as argv lists."""
    import shlex

    code, text, _ = run_cli([command, "--help"])
    assert code == 0, command
    assert ":func:" not in text and "``" not in text, command
    examples = []
    for line in text.splitlines():
        if line.startswith("  fedparity "):  # the examples' layout: two spaces, the command
            examples.append(shlex.split(line)[1:])
    return examples


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_every_help_is_plain_text_with_an_example_the_parser_accepts(command: str) -> None:
    from fedparity.server.cli.commands import build_parser

    examples = help_examples(command)
    assert examples, f"fedparity {command} --help shows no example"
    for argv in examples:
        assert argv[0] == command
        build_parser().parse_args(argv)  # exits (status 2) on an unknown option or value


def test_the_help_examples_of_privacy_measure_and_fairtest_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as printed, on files named as in the examples: each exits 0 with its answer."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(5)
    groups = rng.integers(0, 3, size=20_000)
    write_csv(tmp_path / "clients.csv", "id,group,metric", groups % 2, rng.random(groups.size))
    (tmp_path / "summaries.csv").write_text(
        "client,mean,variance,n\n0,0.01,0.0004,200\n1,0.02,0.0005,150\n2,0.00,0.0003,300\n"
    )
    for command in ("privacy", "measure", "fairtest"):
        for argv in help_examples(command):
            if argv[0] == "measure" and "--groups" in argv:  # the 3-group example
                write_csv(
                    tmp_path / "clients.csv", "id,group,metric", groups, rng.random(groups.size)
                )
            code, text, _ = run_cli(argv)
            assert code == 0 and text.strip(), argv


# --- measure --------------------------------------------------------------------------------------


def write_csv(path: Path, header: str, groups: np.ndarray, metrics: np.ndarray) -> None:
    rows = (
        f"{i},{g},{m:.6f}"
        for i, (g, m) in enumerate(zip(groups.tolist(), metrics.tolist(), strict=True))
    )
    path.write_text(header + "\n" + "\n".join(rows) + "\n", encoding="utf-8")


def population(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Two groups, 45/55, metrics Beta(7,3) (mean 0.70) and Beta(11,9) (mean 0.55)."""
    rng = np.random.default_rng(seed)
    groups = (rng.random(rows) < 0.55).astype(np.int64)
    metrics = np.where(groups == 0, rng.beta(7.0, 3.0, rows), rng.beta(11.0, 9.0, rows))
    metrics = np.round(metrics, 6)
    means = [metrics[groups == g].mean() for g in (0, 1)]
    return groups, metrics, abs(means[0] - means[1])


@pytest.fixture(scope="module")
def big_csv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, list[float]]:
    groups, metrics, gap = population(200_000, 1)
    path = tmp_path_factory.mktemp("cli") / "clients.csv"
    write_csv(path, "client,group,metric", groups, metrics)
    means = [float(metrics[groups == g].mean()) for g in (0, 1)]
    assert 0.13 < gap < 0.17
    return path, gap, means


@pytest.mark.parametrize("extra", [[], ["--known-group-sizes"], ["--mechanism", "L"]])
def test_measure_json(big_csv: tuple[Path, float, list[float]], extra: list[str]) -> None:
    path, gap, _ = big_csv
    # One run per case: a 99.9% interval, so a miss would be a 1-in-1000 event, not luck.
    payload = cli_json(
        [
            "measure",
            "--input",
            str(path),
            "--epsilon",
            "2",
            "--seed",
            "3",
            "--confidence",
            "0.999",
            *extra,
        ]
    )
    for key in ("group_means", "gaps", "gap_intervals", "chebyshev_halfwidths", "epsilon"):
        assert key in payload
    assert payload["num_reports"] == 200_000
    assert payload["budget"] == 2.0
    assert payload["epsilon"] <= 2.0
    true = spec_true_epsilon(
        payload["mechanism"],
        payload["epsilon_group"],
        payload["epsilon_value"],
        payload.get("grid_size", 1),
    )
    assert true <= 2.0 + 1e-12
    assert ("grid_size" in payload) is (payload["mechanism"] == "N")
    low, high = payload["gap_intervals"][0]
    assert low <= gap <= high
    assert payload["chebyshev_halfwidths"][0] >= (high - low) / 2 - 1e-12
    assert payload["sizes_estimated"] is ("--known-group-sizes" not in extra)
    if "--mechanism" in extra:
        assert payload["mechanism"] == "L"


def test_measure_text_and_compare_raw(big_csv: tuple[Path, float, list[float]]) -> None:
    path, gap, means = big_csv
    payload = cli_json(
        ["measure", "--input", str(path), "--epsilon", "1", "--seed", "4", "--compare-raw"]
    )
    assert payload["raw_max_gap"] == pytest.approx(gap, abs=1e-9)
    assert payload["raw_group_means"] == pytest.approx(means, abs=1e-9)
    code, text, _ = run_cli(["measure", "--input", str(path), "--epsilon", "1", "--seed", "4"])
    assert code == 0 and "interval" in text and "raw input" not in text


def test_measure_custom_columns(tmp_path: Path) -> None:
    groups, metrics, gap = population(50_000, 2)
    path = tmp_path / "custom.csv"
    write_csv(path, "id,sex,tpr", groups, metrics)
    payload = cli_json(
        [
            "measure",
            "--input",
            str(path),
            "--epsilon",
            "4",
            "--seed",
            "5",
            "--group-column",
            "sex",
            "--metric-column",
            "tpr",
            "--compare-raw",
            "--confidence",
            "0.999",
        ]
    )
    assert payload["num_reports"] == 50_000
    assert payload["raw_max_gap"] == pytest.approx(gap, abs=1e-9)
    low, high = payload["gap_intervals"][0]
    assert low <= gap <= high


def test_measure_accepts_a_byte_order_mark(tmp_path: Path) -> None:
    """Spreadsheet programs often save CSV as UTF-8 with a BOM before the header."""
    path = tmp_path / "bom.csv"
    rows = "\n".join(f"{i % 2},{0.9 if i % 2 == 0 else 0.4},{i}" for i in range(2000))
    # The BOM sticks to the first column's name, so the group column comes first here.
    path.write_bytes("\ufeffgroup,metric,client\n".encode() + rows.encode() + b"\n")
    payload = cli_json(["measure", "--input", str(path), "--epsilon", "8", "--seed", "1"])
    assert payload["num_reports"] == 2000


def small_file(tmp_path: Path, rows: list[tuple[float, float]], name: str = "s.csv") -> str:
    path = tmp_path / name
    lines = ["client,group,metric"] + [f"{i},{g},{m}" for i, (g, m) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


GOOD_ROWS = [(i % 2, 0.5) for i in range(20)]


@pytest.mark.parametrize("epsilon", ["0", "nan", "inf", "-1", "abc"])
def test_measure_bad_epsilon(tmp_path: Path, epsilon: str) -> None:
    path = small_file(tmp_path, GOOD_ROWS)
    assert_usage_error(["measure", "--input", path, "--epsilon", epsilon], "--epsilon")


def test_measure_bad_inputs(tmp_path: Path) -> None:
    good = small_file(tmp_path, GOOD_ROWS)
    base = ["measure", "--epsilon", "1", "--input"]
    assert_usage_error([*base, good, "--groups", "1"], "--groups")
    # Group label outside [0, d): data row 6 is file line 7 (the header is line 1).
    rows = list(GOOD_ROWS)
    rows[5] = (2, 0.5)
    err = assert_usage_error([*base, small_file(tmp_path, rows, "g.csv")], "--group-column")
    assert "row 7" in err
    rows = list(GOOD_ROWS)
    rows[9] = (0.5, 0.5)
    err = assert_usage_error([*base, small_file(tmp_path, rows, "h.csv")], "--group-column")
    assert "row 11" in err
    rows = list(GOOD_ROWS)
    rows[3] = (1, 1.5)
    err = assert_usage_error([*base, small_file(tmp_path, rows, "m.csv")], "--metric-column")
    assert "row 5" in err and "1.5" in err
    assert_usage_error([*base, good, "--metric-column", "accuracy"], "--metric-column")
    assert_usage_error([*base, good, "--group-column", "sex"], "--group-column")
    err = assert_usage_error([*base, good, "--groups", "3"], "empty")
    assert "--groups" in err
    assert_usage_error([*base, good, "--confidence", "1.5"], "--confidence")
    assert_usage_error([*base, small_file(tmp_path, [(0, 0.5)], "one.csv")], "--input")
    assert_usage_error([*base, str(tmp_path / "missing.csv")], "--input")


@pytest.mark.parametrize(
    ("row", "option", "shown"),
    [
        ((2, 0.5), "--group-column", "has group 2;"),
        ((0.5, 0.5), "--group-column", "has group 0.5;"),
        ((1, 1.5), "--metric-column", "has value 1.5;"),
        ((1, 1.0000001), "--metric-column", "has value 1.0000001;"),
        ((1, -2), "--metric-column", "has value -2;"),
    ],
)
def test_measure_bad_rows_are_shown_as_plain_numbers(
    tmp_path: Path,
    row: tuple[float, float],
    option: str,
    shown: str,
) -> None:
    """The offending value is printed as the number in the file, not numpy's repr."""
    rows = list(GOOD_ROWS)
    rows[2] = row
    err = assert_usage_error(
        ["measure", "--epsilon", "1", "--input", small_file(tmp_path, rows)],
        option,
        "row 4",
        shown,
    )
    assert "np." not in err and "float64" not in err


def test_measure_row_numbers_across_chunks(tmp_path: Path) -> None:
    rows = [(i % 2, 0.25) for i in range(5_000)]
    rows[4_321] = (1, -0.5)
    path = small_file(tmp_path, rows, "chunked.csv")
    err = assert_usage_error(
        ["measure", "--epsilon", "1", "--input", path, "--chunk-rows", "100"],
        "--metric-column",
    )
    assert "row 4323" in err


def test_measure_streams_a_large_file(tmp_path: Path) -> None:
    rows = 2_000_000
    rng = np.random.default_rng(9)
    groups = (rng.random(rows) < 0.5).astype(np.int64)
    # Metrics on a 1/1000 grid: Binomial(1000, p)/1000 with p = 0.7 (group 0), 0.55 (group 1).
    metrics = np.where(groups == 0, rng.binomial(1000, 0.7, rows), rng.binomial(1000, 0.55, rows))
    text = "\n".join(
        f"{g},{m / 1000:.3f}" for g, m in zip(groups.tolist(), metrics.tolist(), strict=True)
    )
    path = tmp_path / "large.csv"
    path.write_text("group,metric\n" + text + "\n", encoding="utf-8")
    gap = abs(metrics[groups == 0].mean() - metrics[groups == 1].mean()) / 1000
    payload = cli_json(
        [
            "measure",
            "--input",
            str(path),
            "--epsilon",
            "1",
            "--seed",
            "6",
            "--chunk-rows",
            "100000",
            "--confidence",
            "0.999",
        ]
    )
    assert payload["num_reports"] == rows
    low, high = payload["gap_intervals"][0]
    assert low <= gap <= high


# --- messages that name the true cause (issue 32, item 4) ------------------------------------


def test_a_non_utf8_input_names_the_option_the_file_and_the_encoding(tmp_path: Path) -> None:
    """Before: ``'utf-8' codec can't decode byte 0xe9 in position 26``, naming neither the
    option nor the file."""
    path = tmp_path / "latin.csv"
    path.write_bytes("group,metric\n0,0.5\n1,caf\u00e9\n".encode("latin-1"))
    err = assert_usage_error(
        ["measure", "--input", str(path), "--epsilon", "1"], "--input", str(path)
    )
    assert "not UTF-8" in err and "line 3" in err and "codec" not in err
    header = tmp_path / "latin-header.csv"
    header.write_bytes("groupe,m\u00e9trique\n0,0.5\n".encode("latin-1"))
    err = assert_usage_error(
        ["measure", "--input", str(header), "--epsilon", "1"], "--input", str(header)
    )
    assert "not UTF-8" in err and "line 1" in err


def test_a_folder_given_as_input_is_called_a_folder(tmp_path: Path) -> None:
    """Before: ``--input: no such file: <dir>``, though the folder exists."""
    err = assert_usage_error(
        ["measure", "--input", str(tmp_path), "--epsilon", "1"], "--input", str(tmp_path)
    )
    assert "is a folder" in err and "no such file" not in err


def test_a_parse_error_names_the_line_and_the_column_at_fault(tmp_path: Path) -> None:
    """Before: ``cannot parse rows 2-4: ... at row 1, column 2``: two row numbers that
    disagree (numpy counts from 0 within the chunk) and a column number. The value is on
    file line 3, in the metric column."""
    path = tmp_path / "bad.csv"
    path.write_text("id,group,metric\n7,0,0.5\n8,1,abc\n9,0,0.2\n")
    argv = ["measure", "--input", str(path), "--epsilon", "1"]
    err = assert_usage_error(argv, "--metric-column 'metric'", "bad.csv line 3", "'abc'")
    assert "row 1" not in err and "rows 2-4" not in err
    path.write_text("id,group,metric\n7,0,0.5\n8,1,0.5\n9,x,0.2\n")
    assert_usage_error(argv, "--group-column 'group'", "bad.csv line 4", "'x'")


@pytest.mark.parametrize("command", ["measure", "plan", "privacy"])
def test_groups_errors_name_the_option(tmp_path: Path, command: str) -> None:
    """Before: ``num_groups must be an integer in [2, 1024]`` (the library's parameter)."""
    path = tmp_path / "in.csv"
    path.write_text("group,metric\n0,0.5\n1,0.5\n")
    argv = {
        "measure": ["measure", "--input", str(path), "--epsilon", "1"],
        "plan": ["plan", "--clients", "1000", "--epsilon", "1"],
        "privacy": ["privacy", "--mechanism", "R", "--eps1", "1", "--eps2", "1"],
    }[command]
    err = assert_usage_error([*argv, "--groups", "1000000000"], "--groups", "[2, 1024]")
    assert "num_groups" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["measure", "--input", "IN", "--epsilon", "1e300"],
        ["plan", "--clients", "1000", "--epsilon", "1e300"],
        ["plan", "--clients", "1000", "--gap", "0.1", "--epsilon", "1e300"],
        ["privacy", "--mechanism", "R", "--eps1", "1e300", "--eps2", "1"],
    ],
    ids=["measure", "plan", "plan-power", "privacy"],
)
def test_one_epsilon_bound_in_every_command(tmp_path: Path, argv: list[str]) -> None:
    """Before: ``measure --epsilon 1e300`` spent "1e+300" per client while ``plan`` capped
    epsilon at 1e4. Now every command refuses it with the same range, before any work."""
    path = tmp_path / "in.csv"
    path.write_text("group,metric\n0,0.5\n1,0.5\n")
    argv = [str(path) if arg == "IN" else arg for arg in argv]
    option = "--eps1" if "--eps1" in argv else "--epsilon"
    assert_usage_error(argv, f"{option} must be a number in [1e-06, 10000]")


def test_a_second_keys_run_keeps_the_pair_and_other_keys_need_the_overwrite_option(
    tmp_path: Path,
) -> None:
    """A newcomer's second guide runs its "once" block, ``fedparity keys``, again: the pair is
    kept, exit 0 (before: exit 2 in the middle of the guide). Keys with other parameters are
    refused naming ``--overwrite`` (before: ``pass overwrite=True``, the Python API's words)."""
    out = tmp_path / "keys"
    assert run_cli(["keys", "--out", str(out)]).code == 0
    secret = (out / "secret_context.tenseal").read_bytes()
    again = run_cli(["keys", "--out", str(out)])
    assert again.code == 0 and f"CKKS key pair already in {out}: kept" in again.out
    assert (out / "secret_context.tenseal").read_bytes() == secret  # nothing replaced
    other = ["keys", "--out", str(out), "--poly-modulus-degree", "16384"]
    err = assert_usage_error(
        [*other, "--coeff-mod-bit-sizes", "60,40,40,60"], str(out), "--overwrite"
    )
    assert "overwrite=True" not in err
    (out / "public_context.tenseal").unlink()  # half a pair is not kept
    assert_usage_error(["keys", "--out", str(out)], "--out", str(out), "--overwrite")


def test_a_second_keys_run_refuses_two_files_that_are_not_one_pair(tmp_path: Path) -> None:
    """``fedparity keys`` run again keeps a folder's pair only if it is one: a public context
    copied from another run (a real TenSEAL key of the same parameters) would have every
    holder's statistics decrypt to garbage; it is refused with the way out, not kept."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_cli(["keys", "--out", str(first)]).code == 0
    assert run_cli(["keys", "--out", str(second)]).code == 0
    foreign = (second / "public_context.tenseal").read_bytes()
    (first / "public_context.tenseal").write_bytes(foreign)
    assert_usage_error(
        ["keys", "--out", str(first)], "--out", str(first), "not one key pair", "--overwrite"
    )
    (first / "public_context.tenseal").write_bytes(b"damaged")
    assert_usage_error(["keys", "--out", str(first)], "not a serialized TenSEAL context")
    assert run_cli(["keys", "--out", str(second)]).code == 0  # a true pair is still kept


@pytest.mark.parametrize(
    ("flwr_args", "federation"),
    [
        ([".", "local-deployment", "--run-config", "a=1"], "local-deployment"),
        (["--run-config", "x='. b'", ".", "mine"], "mine"),  # an option's value is skipped
        (["-c", "a=1", "."], None),  # the default connection
        ([".", "--federation-config", "num-supernodes=3", "--stream"], None),
    ],
)
def test_fedparity_run_finds_the_federation_flwr_run_was_given(
    flwr_args: list[str], federation: str | None
) -> None:
    from fedparity.server.cli.run import _federation

    assert _federation(flwr_args) == federation


def test_fedparity_run_hands_every_argument_to_flwr_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options before the app folder are flwr run's too (argparse would refuse them)."""
    from fedparity.server.cli import commands, run

    seen: list[list[str]] = []

    def record(flwr_args: list[str], out: object, err: object) -> int:
        seen.append(list(flwr_args))
        return 1

    monkeypatch.setattr(run, "run_with_status", record)
    assert commands.main(["run", "--run-config", "a=1", "."]) == 1
    assert seen == [["--run-config", "a=1", "."]]
    help_text = run_cli(["run", "--help"])
    assert help_text.code == 0 and "finished:completed" in help_text.out


def test_fedparity_run_repeats_how_a_stopped_run_ended_from_its_status_file(
    tmp_path: Path,
) -> None:
    """A run stopped with flwr stop cannot print its final ERROR line itself (issue 32 item 7):
    ``fedparity run`` reads the job's status file (named in the job's first line) and says it
    in the job's own words, what was released included."""
    import io

    from fedparity.clients.project.config import RunConfig
    from fedparity.server.cli.run import _report_ending
    from fedparity.server.run_record import open_run_record

    record = open_run_record(RunConfig.from_mapping({"output-dir": str(tmp_path / "run")}))
    record.add_release(what="LDP audit at epsilon 1", epsilon=1.0)
    record.fail(KeyboardInterrupt())
    err = io.StringIO()
    _report_ending(record.path, err)
    assert err.getvalue() == (
        "fedparity run: the ldp-audit run WAS INTERRUPTED: KeyboardInterrupt. Released before "
        f"it ended: LDP audit at epsilon 1. Status: {record.path}\n"
    )
    _report_ending(tmp_path / "elsewhere" / "status.json", err)  # another machine's path
    assert err.getvalue().count("\n") == 1
    # the path comes from the streamed log: a file not named status.json is never read, even
    # one that holds a status record
    renamed = record.path.with_name("other.json")
    renamed.write_bytes(record.path.read_bytes())
    _report_ending(renamed, err)
    assert err.getvalue().count("\n") == 1


def test_plan_compares_the_joint_report_with_the_gap_audit_per_rate_metric() -> None:
    """Issue 28: the planner says, for each rate metric, which design gives the tighter
    interval at the same epsilon; its numbers are the library's."""
    from fedparity.mechanisms.ldp.rate_design import compare_rate_designs

    counts = "7500,2500,2500,12500,5000,2500,5000,12500"
    result = run_cli(["plan", "--epsilon", "4", "--cell-counts", counts, "--json"])
    assert result.code == 0
    payload = json.loads(result.out)
    assert len(payload["comparisons"]) == 8
    expected = compare_rate_designs(
        "accuracy", 4.0, np.array(counts.split(","), dtype=float), num_groups=2
    )
    (accuracy,) = [c for c in payload["comparisons"] if c["metric"] == "accuracy"]
    assert accuracy["joint_stderr"] == expected.joint_stderr
    assert accuracy["tighter"] == expected.tighter
    selection = payload["comparisons"][0]
    assert selection["metric"] == "selection_rate" and selection["gap_audit_stderr"] is None
    text = run_cli(["plan", "--epsilon", "1", "--cell-counts", counts, "--rate-metric", "accuracy"])
    assert "gap audit (M_R)" in text.out and "is tighter" in text.out
    assert_usage_error(["plan", "--cell-counts", counts], "--cell-counts needs --epsilon")
    assert_usage_error(["plan", "--epsilon", "1", "--cell-counts", "1,2,3"], "got 3")
    assert_usage_error(
        ["plan", "--epsilon", "1", "--cell-counts", "0,1,0,1,1,1,1,1"], "no user in the denominator"
    )
