"""``fedparity privacy``: the true LDP epsilon of M_R / M_L / M_P / M_N for (eps1, eps2, d).

M_R and M_L are the mechanisms of Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated Learning",
AFCP workshop, PMLR, 2022 (Juarez and Korolova 2022). Its Theorem 5 (M_R) and Theorem 6 (M_L,
k != 2) are false; the true epsilon is :func:`fedparity.mechanisms.ldp.calibration.true_epsilon`.
M_P (:mod:`fedparity.mechanisms.ldp.piecewise`) and M_N (:mod:`fedparity.mechanisms.ldp.nprr`)
are not in that paper: no claim to contrast.
"""

from __future__ import annotations

import argparse
import math
from typing import TextIO

from ...mechanisms import (
    UnboundedPrivacyLossError,
    true_epsilon,
)
from ...mechanisms.ldp.calibration import MECHANISMS
from ...mechanisms.ldp.laplace import LDP_NOISE_RATIO, check_noise_ratio
from ...mechanisms.ldp.nprr import MAX_GRID_SIZE
from ._common import (
    UsageError,
    _emit,
    _epsilon,
    _finite,
    _groups,
    _integer,
    _number,
    _positive,
)


def _paper_claimed_epsilon(mechanism: str, eps1: float, eps2: float, k: float) -> float:
    """What Juarez and Korolova 2022, Theorem 5 / 6, claims (for contrast only; both are wrong)."""
    if mechanism == "R":
        return max(eps1, eps2)
    return max(eps2, math.log(2 / k) + eps2 / 2 - eps1, math.log(k / 2) + eps2 / k + eps1)


#: What the text says of the true epsilon of the mechanisms that are not in the paper.
_NOT_IN_THE_PAPER = {
    "P": (
        "max(eps2, eps1 + eps2 / 2), as M_L; a released M_P computes its own from its "
        "grid's integer probabilities, at most this"
    ),
    "N": (
        "max(eps2, eps1 + ln((G + 1) e^eps2 / (e^eps2 + G)), ln((e^eps2 + G) / (G + 1)) - eps1); "
        "a released M_N computes its own from its oracles' integer probabilities, at most this"
    ),
}


def run_privacy(args: argparse.Namespace, out: TextIO) -> int:
    eps1 = _epsilon("--eps1", args.eps1)
    eps2 = _epsilon("--eps2", args.eps2)
    groups = _groups(args.groups)
    noise_ratio = _positive("--k", _finite("--k", args.k))
    grid_size = _integer("--grid", args.grid, 1, MAX_GRID_SIZE)
    if args.mechanism != "N" and grid_size != 1:
        raise UsageError(
            f"--grid only applies to --mechanism N (M_{args.mechanism} has no grid); got "
            f"{grid_size}"
        )
    if args.mechanism != "L" and noise_ratio != LDP_NOISE_RATIO:
        # Compared as a number: "2", "2.0" and "2e0" all mean the default.
        raise UsageError(
            f"--k only applies to --mechanism L (M_{args.mechanism} has no noise ratio); got "
            f"{_number(noise_ratio)}"
        )
    if args.mechanism == "L":
        try:
            check_noise_ratio(noise_ratio)
        except UnboundedPrivacyLossError as error:
            raise UsageError(f"--k: {error}") from None
    epsilon = true_epsilon(args.mechanism, eps1, eps2, groups, grid_size)
    if args.mechanism in _NOT_IN_THE_PAPER:  # not in Juarez and Korolova 2022: no claim
        payload_new: dict[str, object] = {
            "mechanism": args.mechanism,
            "epsilon_group": eps1,
            "epsilon_value": eps2,
            "num_groups": groups,
            "noise_ratio": None,
            "epsilon": epsilon,
            "paper_claimed_epsilon": None,
        }
        grid_text = ""
        if args.mechanism == "N":
            payload_new["grid_size"] = grid_size
            grid_text = f", G={grid_size}"
        text_new = (
            f"M_{args.mechanism} with eps1={eps1:g}, eps2={eps2:g}, d={groups}{grid_text}: "
            f"true epsilon = {epsilon:.6g}\n({_NOT_IN_THE_PAPER[args.mechanism]})"
        )
        _emit(payload_new, text_new, args.json, out)
        return 0
    claimed = _paper_claimed_epsilon(args.mechanism, eps1, eps2, noise_ratio)
    payload = {
        "mechanism": args.mechanism,
        "epsilon_group": eps1,
        "epsilon_value": eps2,
        "num_groups": groups,
        "noise_ratio": noise_ratio if args.mechanism == "L" else None,
        "epsilon": epsilon,
        "paper_claimed_epsilon": claimed,
    }
    theorem = "Theorem 5" if args.mechanism == "R" else "Theorem 6"
    text = (
        f"M_{args.mechanism} with eps1={eps1:g}, eps2={eps2:g}, d={groups}: "
        f"true epsilon = {epsilon:.6g}\n"
        f"(Juarez and Korolova 2022, {theorem}, claims {claimed:.6g}"
        + (
            ", which is wrong: the true epsilon is computed by "
            "fedparity.mechanisms.ldp.calibration.true_epsilon)"
            if not math.isclose(claimed, epsilon)
            else ")"
        )
    )
    _emit(payload, text, args.json, out)
    return 0


# --- plan ---------------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity privacy`` and its options."""
    privacy = commands.add_parser(
        "privacy",
        help="true LDP epsilon of M_R / M_L / M_P / M_N",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The true LDP epsilon of a mechanism with a group budget eps1 and a value budget "
            "eps2\n(M_R: randomized response for both; M_L: randomized response for the group, "
            "discrete\nLaplace for the value; M_P: randomized response for the group, the "
            "Piecewise\nmechanism for the value; M_N: randomized response for the group, NPRR "
            "on a grid of\nG + 1 points for the value).\n\n"
            "examples:\n"
            "  fedparity privacy --mechanism R --eps1 0.5 --eps2 1\n"
            "      the epsilon a user really spends with M_R at eps1 = 0.5, eps2 = 1\n"
            "  fedparity privacy --mechanism L --eps1 0.5 --eps2 1 --groups 3 --json"
        ),
    )
    privacy.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        required=True,
        help=(
            "R: randomized response for both (M_R); L: discrete Laplace for the value (M_L); "
            "P: the Piecewise mechanism for the value (M_P); N: NPRR on a grid for the value "
            "(M_N)"
        ),
    )
    privacy.add_argument("--eps1", required=True, help="group budget eps1 > 0")
    privacy.add_argument("--eps2", required=True, help="value budget eps2 > 0")
    privacy.add_argument("--groups", default="2", help="number of groups d >= 2 (default 2)")
    privacy.add_argument("--k", default="2", help="M_L noise ratio; only k = 2 is LDP")
    privacy.add_argument(
        "--grid", default="1", help=f"M_N's grid G in [1, {MAX_GRID_SIZE}] (default 1)"
    )
    privacy.add_argument("--json", action="store_true", help="print one JSON object")
