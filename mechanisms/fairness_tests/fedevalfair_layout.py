"""Which tests one FedEvalFair run carries, and where each sits in its CKKS vectors.

A run tests every metric of :attr:`FedEvalFairLayout.metrics` for every comparison of a group
with the reference group (d - 1 comparisons for d groups), each in both modes (calibrated,
paper): one *block* per (metric, comparison, mode), side by side in one ciphertext per
message. Both ends build the layout from their own settings (the server's protocol object,
the holder's handlers or run config); the vector sizes follow from it, so holders and a
server that disagree on it produce sums of different sizes that no node decrypts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..validation import check_int_at_least
from .fedevalfair import (
    METRIC_NAMES,
    METRICS,
    RANDOM_EFFECTS_FIELDS,
    ROUND1_FIELDS,
    STAGE1_FIELDS,
    Metric,
    Mode,
    reference_comparisons,
)

__all__ = [
    "BLOCK_WIDTH",
    "DEFAULT_LAYOUT",
    "MAX_VECTOR_SIZE",
    "RANDOM_EFFECTS_WIDTH",
    "RELEASE_WIDTH",
    "STAGE1_WIDTH",
    "FedEvalFairBlock",
    "FedEvalFairLayout",
]

#: Slots of one ciphertext at the project's CKKS parameters (N = 8192: N / 2 slots); the
#: round-2 vector, the largest, must fit.
MAX_VECTOR_SIZE = 4096
#: Label of the layout's terms in the commitment (:meth:`FedEvalFairLayout.terms`).
LAYOUT_TERMS_LABEL = b"fedparity/fedevalfair/layout/v1:"
#: The modes every comparison is tested in, in block order.
_MODES: tuple[Mode, ...] = ("calibrated", "paper")
BLOCK_WIDTH = len(ROUND1_FIELDS)  # [sum w, sum w Ybar, ..., group counts, count]
STAGE1_WIDTH = len(STAGE1_FIELDS)  # [stage-1 parts, sum u^2, random-effects grid sums]
#: Width of a block's random-effects summary in the release (after the contribution sums).
RANDOM_EFFECTS_WIDTH = len(RANDOM_EFFECTS_FIELDS)
#: [stage-1 statistic, the block's contribution sums (its count last), random-effects summary]
RELEASE_WIDTH = 1 + BLOCK_WIDTH + RANDOM_EFFECTS_WIDTH


class FedEvalFairBlock(NamedTuple):
    """One test of a run: the metric, the mode and the two groups compared (the disparity is
    the rate of ``comparison[0]`` minus the rate of ``comparison[1]``)."""

    metric: Metric
    mode: Mode
    comparison: tuple[int, int] = (0, 1)

    @property
    def label(self) -> str:
        """The metric's name, the groups when they are not the two of a binary attribute's
        (0 vs 1), and the mode; mode "paper" says it is not evidence."""
        name = METRIC_NAMES.get(self.metric, self.metric)
        if self.comparison != (0, 1):
            name += f", group {self.comparison[0]} vs group {self.comparison[1]}"
        return f"{name} ({self.mode} mode" + (", not evidence)" if self.mode == "paper" else ")")


@dataclass(frozen=True)
class FedEvalFairLayout:
    """The tests of one FedEvalFair run and its vector sizes.

    Parameters
    ----------
    metrics : tuple of str
        The rate metrics tested (each once per comparison), from
        :data:`~fedparity.mechanisms.fairness_tests.fedevalfair.METRICS`; default dp and eo.
    num_groups : int
        d >= 2: the groups' values are 0 .. d - 1.
    reference : int
        The group every other group is compared with (0 <= reference < d).

    Raises
    ------
    ValueError
        For an unknown or repeated metric, a bad group count or reference, or more blocks than
        one ciphertext holds (:data:`MAX_VECTOR_SIZE` slots).
    """

    metrics: tuple[Metric, ...] = ("dp", "eo")
    num_groups: int = 2
    reference: int = 0

    def __post_init__(self) -> None:
        metrics = (
            tuple(self.metrics.replace(",", " ").split())
            if isinstance(self.metrics, str)
            else tuple(self.metrics)
        )
        unknown = [metric for metric in metrics if metric not in METRICS]
        if not metrics or unknown:
            raise ValueError(
                f"fef-metrics must name one or more of {', '.join(METRICS)}; got "
                f"{', '.join(map(repr, unknown)) if unknown else 'none'}"
            )
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"fef-metrics names a metric twice: {', '.join(metrics)}")
        object.__setattr__(self, "metrics", metrics)
        num_groups = check_int_at_least("fef-num-groups", self.num_groups, 2)
        object.__setattr__(self, "num_groups", num_groups)
        reference = check_int_at_least("fef-reference-group", self.reference, 0)
        if reference >= num_groups:
            raise ValueError(
                f"fef-reference-group must be in [0, {num_groups - 1}] (fef-num-groups = "
                f"{num_groups}), got {reference}"
            )
        object.__setattr__(self, "reference", reference)
        # from the counts alone: a huge num_groups must not build its blocks first
        if self.round2_size > MAX_VECTOR_SIZE:
            per_test = len(_MODES) * (STAGE1_WIDTH + BLOCK_WIDTH)
            most = (MAX_VECTOR_SIZE - 1) // per_test
            raise ValueError(
                f"fef-metrics x (fef-num-groups - 1) = {len(metrics)} x {num_groups - 1} = "
                f"{len(metrics) * (num_groups - 1)} tests do not fit one ciphertext "
                f"({MAX_VECTOR_SIZE} slots); at most {most} per run: test fewer metrics or "
                "groups per run"
            )

    @property
    def comparisons(self) -> tuple[tuple[int, int], ...]:
        """(reference, g) for every other group g, in increasing g."""
        return reference_comparisons(self.num_groups, self.reference)

    @property
    def blocks(self) -> tuple[FedEvalFairBlock, ...]:
        """Every (metric, mode, comparison), metric-major, then comparison, then mode."""
        return tuple(
            FedEvalFairBlock(metric, mode, comparison)
            for metric in self.metrics
            for comparison in self.comparisons
            for mode in _MODES
        )

    @property
    def tests(self) -> tuple[tuple[Metric, tuple[int, int]], ...]:
        """Every (metric, comparison): what a holder bootstraps (both modes share it)."""
        return tuple((m, c) for m in self.metrics for c in self.comparisons)

    @property
    def num_blocks(self) -> int:
        """Blocks of a run: (metrics) x (num_groups - 1) x 2 modes."""
        return len(self.metrics) * (self.num_groups - 1) * len(_MODES)

    @property
    def dp_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks the holder-level DP mode releases (the calibrated ones)."""
        return tuple(i for i, block in enumerate(self.blocks) if block.mode == "calibrated")

    @property
    def contribution_size(self) -> int:
        """A holder's round-1 contribution: one :data:`BLOCK_WIDTH` block per block."""
        return self.num_blocks * BLOCK_WIDTH

    @property
    def round1_size(self) -> int:
        """The round-1 vector: the contribution and a message-count slot."""
        return self.contribution_size + 1

    @property
    def round2_size(self) -> int:
        """The round-2 vector: the stage-1 parts per block, the contribution again, a count."""
        return self.num_blocks * STAGE1_WIDTH + self.contribution_size + 1

    @property
    def release_size(self) -> int:
        """A key holder's release: :data:`RELEASE_WIDTH` numbers per block."""
        return self.num_blocks * RELEASE_WIDTH

    def terms(self) -> bytes:
        """The layout as bytes, bound into every holder's commitment beside the DP mode's
        parameters, so that holders given different layouts (a split view, even one with
        equal vector sizes) sign different commitments and no key holder releases. Empty for
        the default layout (its commitments are those of a run before layouts existed)."""
        if self == DEFAULT_LAYOUT:
            return b""
        text = f"{','.join(self.metrics)};{self.num_groups};{self.reference}"
        return LAYOUT_TERMS_LABEL + text.encode()

    def to_config(self) -> dict[str, str | int]:
        """The run-config keys that give this layout (``fef-metrics``, ``fef-num-groups``,
        ``fef-reference-group``)."""
        return {
            "fef-metrics": ",".join(self.metrics),
            "fef-num-groups": self.num_groups,
            "fef-reference-group": self.reference,
        }


#: The layout of a run that sets none of the keys: dp and eo, groups 0 and 1.
DEFAULT_LAYOUT = FedEvalFairLayout()
