"""Central (non-federated) MMDM vs SGD on UCI Adult: Table 1 of the FPFL paper.

The FPFL paper: Borja Rodríguez-Gálvez, Filip Granqvist, Rogier van Dalen and Matt Seigel,
"Enforcing fairness in private federated learning via the modified method of differential
multipliers", NeurIPS 2021 Workshop on Privacy in Machine Learning, arXiv:2109.08604, 2021
(Rodríguez-Gálvez et al. 2021 below).

The same sufficient statistics and updates as FPFL, without users, clipping or noise: each
iteration draws a mini-batch of rows (the paper: ``n_batch = 400``, 1,000 iterations; or the
full training set), computes the pooled statistics of Eq. (16) with
:func:`fedparity.clients.fpfl_task.pooled_statistics` and applies
:func:`fedparity.mechanisms.fpfl.mmdm.mmdm_update`
(MMDM, FNR parity, ``alpha = 0.02``, ``eta = 0.1``, ``gamma = 0.01``, ``c = 2``) or plain SGD
(:func:`fedparity.mechanisms.fpfl.mmdm.sgd_update`). The final model is evaluated on ``adult.test``
(accuracy and the FNR / EO / DemP / PP gaps of
:func:`fedparity.mechanisms.fpfl.mmdm.fairness_gaps`).

The same trainer runs the unfair-digits stand-in for unfair FEMNIST (Section 4.2; scikit-learn's
8x8 digits, 3 writer groups, accuracy parity, the convolutional network):
``python benchmarks/fpfl_central.py --dataset digits``.

Run ``python benchmarks/fpfl_central.py --data-dir /path/to/adult`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal, TextIO

import numpy as np
import torch
from numpy.typing import NDArray

from fedparity.clients.fpfl_data import FPFLShard, check_groups_present
from fedparity.clients.fpfl_task import (
    ARCHITECTURES,
    CONSTRAINTS,
    build_model_for,
    constraint_mask,
    get_flat_parameters,
    pooled_statistics,
    predict,
    set_flat_parameters,
    statistics_layout,
)
from fedparity.clients.project.data import ADULT_DIR_ENV, adult_features, load_adult
from fedparity.clients.project.fpfl_data import digits_leaf, unfair_shard
from fedparity.mechanisms.fpfl.mmdm import (
    FairnessGaps,
    MMDMConfig,
    evaluate_constraints,
    fairness_gaps,
    mmdm_update,
    sgd_update,
)
from fedparity.mechanisms.validation import check_choice, check_int_at_least

__all__ = [
    "ALGORITHMS",
    "CentralConfig",
    "CentralResult",
    "CENTRAL_ARCHITECTURES",
    "DATASETS",
    "PAPER_TABLE1",
    "adult_rows",
    "format_table",
    "main",
    "run_table1",
    "torch_threads",
    "train_central",
]

Algorithm = Literal["sgd", "mmdm"]
ALGORITHMS: tuple[str, ...] = ("sgd", "mmdm")
#: Fully connected networks of Section 4.1 plus the convolutional network of Section 4.2.
CENTRAL_ARCHITECTURES: tuple[str, ...] = (*ARCHITECTURES, "cnn")
DATASETS: tuple[str, ...] = ("adult", "digits")
#: Per-dataset defaults of the command line: Adult (Section 4.1, FNR parity) and unfair
#: digits (the FEMNIST hyper-parameters of Section 4.2: accuracy parity, alpha = 0.04,
#: gamma = 0.05, c = 20, convolutional network).
DATASET_DEFAULTS: dict[str, dict[str, object]] = {
    "adult": {
        "architectures": "shallow,deep",
        "constraint": "fnr",
        "alpha": 0.02,
        "multiplier_learning_rate": 0.01,
        "damping": 2.0,
        "batch_size": 400,
    },
    "digits": {
        "architectures": "cnn",
        "constraint": "accuracy",
        "alpha": 0.04,
        "multiplier_learning_rate": 0.05,
        "damping": 20.0,
        "batch_size": 0,
    },
}

#: Rodríguez-Gálvez et al. 2021, Table 1 (accuracy, FNR gap, EO gap, DemP gap, PP gap).
PAPER_TABLE1: dict[tuple[str, str], tuple[float, float, float, float, float]] = {
    ("deep", "sgd"): (0.858, 0.070, 0.070, 0.117, 0.006),
    ("shallow", "sgd"): (0.857, 0.071, 0.071, 0.113, 0.016),
    ("deep", "mmdm"): (0.854, 0.020, 0.026, 0.087, 0.074),
    ("shallow", "mmdm"): (0.855, 0.019, 0.029, 0.092, 0.044),
}


@dataclass(frozen=True)
class CentralConfig:
    """One central training run (defaults: Rodríguez-Gálvez et al. 2021, Section 4.1, shallow MMDM).

    Parameters
    ----------
    algorithm : ``"sgd"`` | ``"mmdm"``
    architecture : ``"shallow"`` | ``"deep"`` | ``"cnn"``
        ``"cnn"`` needs image features ``(n, channels, side, side)``.
    constraint : ``"fnr"`` | ``"accuracy"``
    alpha, learning_rate, multiplier_learning_rate, damping : float
        ``alpha``, ``eta``, ``gamma``, ``c`` of Eq. (10) (see :class:`MMDMConfig`).
    iterations : int
        Number of updates (>= 1).
    batch_size : int
        Rows per update; 0 means the full training set (full-batch gradient descent).
    seed : int
        Model initialisation and batch order.
    """

    algorithm: Algorithm = "mmdm"
    architecture: str = "shallow"
    constraint: str = "fnr"
    alpha: float = 0.02
    learning_rate: float = 0.1
    multiplier_learning_rate: float = 0.01
    damping: float = 2.0
    iterations: int = 1000
    batch_size: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("architecture", self.architecture, CENTRAL_ARCHITECTURES)
        check_choice("constraint", self.constraint, CONSTRAINTS)
        object.__setattr__(self, "iterations", check_int_at_least("iterations", self.iterations, 1))
        object.__setattr__(self, "batch_size", check_int_at_least("batch_size", self.batch_size, 0))
        object.__setattr__(self, "seed", check_int_at_least("seed", self.seed, 0))
        self.mmdm  # noqa: B018 - validates alpha, the learning rates and the damping

    @property
    def mmdm(self) -> MMDMConfig:
        """The MMDM hyper-parameters (validated)."""
        return MMDMConfig(
            alpha=self.alpha,
            learning_rate=self.learning_rate,
            multiplier_learning_rate=self.multiplier_learning_rate,
            damping=self.damping,
        )


@dataclass(frozen=True)
class CentralResult:
    """Outcome of :func:`train_central`.

    Attributes
    ----------
    config : CentralConfig
    test : FairnessGaps
        The final model on the test rows.
    train : FairnessGaps
        The final model on the training rows.
    multipliers : tuple of float
        Final Lagrange multipliers (zeros for SGD).
    train_surrogate_gap : float
        ``max_a |F/n' - F_a/n'_a|`` of the final model on the whole training set.
    seconds : float
        Training wall time.
    """

    config: CentralConfig
    test: FairnessGaps
    train: FairnessGaps
    multipliers: tuple[float, ...]
    train_surrogate_gap: float
    seconds: float

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable dict."""
        return asdict(self)


def adult_rows(
    features: NDArray[np.float32], labels: NDArray[np.int64], groups: NDArray[np.int64]
) -> FPFLShard:
    """Rows as a shard in which every row is its own user (central training needs no users)."""
    count = labels.shape[0]
    return FPFLShard(
        features=np.ascontiguousarray(features, dtype=np.float32),
        labels=labels.astype(np.int64),
        groups=groups.astype(np.int64),
        user_index=np.arange(count, dtype=np.int64),
        user_ids=np.arange(count, dtype=np.int64),
        num_groups=int(groups.max()) + 1 if count else 2,
        num_classes=2,
    )


def _batches(
    rng: np.random.Generator, num_rows: int, batch_size: int
) -> Iterator[NDArray[np.int64]]:
    """Endless mini-batches: shuffled epochs, the last incomplete batch of an epoch dropped."""
    while True:
        order = rng.permutation(num_rows)
        for start in range(0, num_rows - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def _take(shard: FPFLShard, rows: NDArray[np.int64]) -> FPFLShard:
    return FPFLShard(
        features=shard.features[rows],
        labels=shard.labels[rows],
        groups=shard.groups[rows],
        user_index=np.arange(rows.shape[0], dtype=np.int64),
        user_ids=np.arange(rows.shape[0], dtype=np.int64),
        num_groups=shard.num_groups,
        num_classes=shard.num_classes,
    )


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(num_threads)`` and restore the previous
    value afterwards (``None``: leave torch alone). The models here are tiny, so one thread
    loses little, and it avoids OpenMP threads stalling when another process holds a core."""
    if num_threads is None:
        yield
        return
    num_threads = check_int_at_least("num_threads", num_threads, 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_central(
    train: FPFLShard,
    test: FPFLShard,
    config: CentralConfig,
    *,
    num_threads: int | None = None,
) -> CentralResult:
    """Train a fresh model centrally with MMDM or SGD and evaluate it (Table 1).

    ``num_threads`` sets torch's intra-op threads for the run (see :func:`torch_threads`).
    Raises ``ValueError`` naming ``groups`` if a group has no sample in the constraint's set
    ``d'`` of the training data (its constraint would be undefined).
    """
    with torch_threads(num_threads):
        return _train_central(train, test, config)


def _build_model(config: CentralConfig, train: FPFLShard) -> torch.nn.Sequential:
    return build_model_for(
        config.architecture,
        train.features.shape[1:],
        num_classes=train.num_classes,
        seed=config.seed,
    )


def _train_central(train: FPFLShard, test: FPFLShard, config: CentralConfig) -> CentralResult:
    if train.num_classes != test.num_classes or train.num_groups != test.num_groups:
        raise ValueError("train and test must have the same num_classes and num_groups")
    check_groups_present(train, constraint_samples=constraint_mask(train.labels, config.constraint))
    model = _build_model(config, train)
    layout = statistics_layout(model, train.num_groups)
    mmdm = config.mmdm
    weights = get_flat_parameters(model)
    multipliers = np.zeros(train.num_groups)
    rng = np.random.default_rng(np.random.SeedSequence(config.seed, spawn_key=(1,)))
    full = config.batch_size == 0 or config.batch_size >= train.num_samples
    batches = None if full else _batches(rng, train.num_samples, config.batch_size)
    started = time.perf_counter()
    for _ in range(config.iterations):
        batch = train if batches is None else _take(train, next(batches))
        stats = layout.split(pooled_statistics(model, batch, constraint=config.constraint))
        if config.algorithm == "sgd":
            weights = sgd_update(weights, stats, mmdm.learning_rate)
        else:
            update = mmdm_update(weights, multipliers, stats, mmdm)
            weights, multipliers = update.weights, update.multipliers
        set_flat_parameters(model, weights)
    seconds = time.perf_counter() - started
    final_stats = layout.split(pooled_statistics(model, train, constraint=config.constraint))
    gap = evaluate_constraints(final_stats, mmdm.alpha).max_gap

    def report(shard: FPFLShard) -> FairnessGaps:
        return fairness_gaps(
            shard.labels, predict(model, shard.features), shard.groups, shard.num_groups
        )

    return CentralResult(
        config=config,
        test=report(test),
        train=report(train),
        multipliers=tuple(float(value) for value in multipliers),
        train_surrogate_gap=gap,
        seconds=seconds,
    )


def run_table1(
    train: FPFLShard,
    test: FPFLShard,
    *,
    base: CentralConfig = CentralConfig(),
    architectures: Sequence[str] = ("shallow", "deep"),
    seeds: Sequence[int] = (0,),
    num_threads: int | None = None,
) -> list[CentralResult]:
    """SGD and MMDM for every architecture and seed (same seed = same init and batches)."""
    results: list[CentralResult] = []
    for architecture in architectures:
        for algorithm in ALGORITHMS:
            for seed in seeds:
                config = replace(base, architecture=architecture, algorithm=algorithm, seed=seed)
                results.append(train_central(train, test, config, num_threads=num_threads))
    return results


def _cell(values: NDArray[np.float64]) -> str:
    if np.all(np.isnan(values)):
        return "-"
    cell = f"{np.nanmean(values):.3f}"
    if values.size > 1:
        cell += f" ± {np.nanstd(values, ddof=1):.3f}"
    return cell


def format_table(results: Sequence[CentralResult]) -> str:
    """Mean ± sd over seeds of the test metrics per (model, algorithm), with the paper's
    Table 1 row where there is one (accuracy / FNR / EO / DemP / PP)."""
    columns = ("accuracy", "accuracy_gap", "fnr_gap", "eo_gap", "demp_gap", "pp_gap")
    lines = [
        "| model | algorithm | seeds | accuracy | accuracy gap | FNR gap | EO gap | DemP gap "
        "| PP gap | paper |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r.config.architecture, r.config.algorithm) for r in results})
    for architecture, algorithm in keys:
        rows = [
            r
            for r in results
            if r.config.architecture == architecture and r.config.algorithm == algorithm
        ]
        cells = [
            _cell(np.array([r.test.as_row()[column] for r in rows], dtype=np.float64))
            for column in columns
        ]
        paper = PAPER_TABLE1.get((architecture, algorithm))
        paper_cell = " / ".join(f"{v:.3f}" for v in paper) if paper else "-"
        lines.append(
            f"| {architecture} | {algorithm.upper()} | {len(rows)} | "
            + " | ".join(cells)
            + f" | {paper_cell} |"
        )
    return "\n".join(lines)


def _json_safe(value: object) -> object:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python benchmarks/fpfl_central.py`` (defaults per ``--dataset``)."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/fpfl_central.py",
        description=(
            "Central MMDM vs SGD: UCI Adult (Rodriguez-Galvez et al. 2021, Table 1) or unfair "
            "digits."
        ),
    )
    parser.add_argument("--dataset", choices=DATASETS, default="adult")
    parser.add_argument("--data-dir", default="", help=f"Adult folder (default ${ADULT_DIR_ENV})")
    parser.add_argument("--architectures", default=None, help="comma-separated")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=None, help="0 = full batch")
    parser.add_argument("--alpha", type=float, default=None)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--multiplier-learning-rate", type=float, default=None)
    parser.add_argument("--damping", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = default)")
    parser.add_argument("--output", default="", help="write the results as JSON to this file")
    return parser


def _load(args: argparse.Namespace, seed: int) -> tuple[FPFLShard, FPFLShard, str]:
    if args.dataset == "digits":
        train_leaf, test_leaf = digits_leaf(seed=seed)
        description = (
            "unfair digits (scikit-learn 8x8, 60 pseudo-writers, black pen / blue pen / chalk "
            "45/45/10), accuracy parity"
        )
        return (
            unfair_shard(train_leaf, seed=seed),
            unfair_shard(test_leaf, seed=seed + 1),
            (description),
        )
    folder = args.data_dir or os.environ.get(ADULT_DIR_ENV, "")
    if not folder:
        raise ValueError(f"data_dir: pass --data-dir or set {ADULT_DIR_ENV}")
    x_train, y_train, x_test, y_test, _, protected = adult_features(load_adult(folder))
    return (
        adult_rows(x_train, y_train, protected["train"]["sex"]),
        adult_rows(x_test, y_test, protected["test"]["sex"]),
        "Adult, sex groups, FNR parity",
    )


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run SGD and MMDM for every architecture and seed and print the table as Markdown;
    returns the exit status (0 ok, 2 bad input)."""
    out = sys.stdout if out is None else out
    args = build_parser().parse_args(argv)
    defaults = DATASET_DEFAULTS[args.dataset]

    def pick(name: str) -> object:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
        architectures = [
            name.strip() for name in str(pick("architectures")).split(",") if name.strip()
        ]
        for name in architectures:
            check_choice("architectures", name, CENTRAL_ARCHITECTURES)
        base = CentralConfig(
            constraint=str(defaults["constraint"]),
            iterations=args.iterations,
            batch_size=pick("batch_size"),  # type: ignore[arg-type]
            alpha=pick("alpha"),  # type: ignore[arg-type]
            learning_rate=args.learning_rate,
            multiplier_learning_rate=pick("multiplier_learning_rate"),  # type: ignore[arg-type]
            damping=pick("damping"),  # type: ignore[arg-type]
        )
        train, test, description = _load(args, seeds[0] if seeds else 0)
    except (ValueError, FileNotFoundError, ImportError) as error:
        sys.stderr.write(f"fpfl_central: error: {error}\n")
        return 2
    results = run_table1(
        train,
        test,
        base=base,
        architectures=architectures,
        seeds=seeds,
        num_threads=args.threads or None,
    )
    out.write(
        f"{description}, alpha={base.alpha}, eta={base.learning_rate}, "
        f"gamma={base.multiplier_learning_rate}, c={base.damping}, "
        f"{base.iterations} iterations, batch {base.batch_size or 'full'}; test set; gap = "
        "max over groups of |metric(all) - metric(group)|; paper (Table 1) = "
        "acc / FNR / EO / DemP / PP\n\n"
    )
    out.write(format_table(results) + "\n")
    seconds = sum(r.seconds for r in results)
    out.write(f"\n{len(results)} runs, {seconds:.1f} s training\n")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump([_json_safe(r.to_json()) for r in results], handle, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
