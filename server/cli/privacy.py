"""``fedparity privacy``: the true LDP epsilon of M_R / M_L / M_P for (eps1, eps2, d).

M_R and M_L are the mechanisms of Marc Juarez and Aleksandra Korolova, "'You Can't Fix What You
Can't Measure': Privately Measuring Demographic Performance Disparities in Federated Learning",
AFCP workshop, PMLR, 2022 (Juarez and Korolova 2022). Its Theorem 5 (M_R) and Theorem 6 (M_L,
k != 2) are false; the true epsilon is :func:`fedparity.mechanisms.ldp.calibration.true_epsilon`.
M_P (:mod:`fedparity.mechanisms.ldp.piecewise`) is not in that paper: no claim to contrast.
"""

from __future__ import annotations

import argparse
import math
from typing import TextIO

from ...mechanisms import (
    UnboundedPrivacyLossError,
    true_epsilon,
)
from ...mechanisms.ldp.laplace import LDP_NOISE_RATIO, check_noise_ratio
from ._common import (
    UsageError,
    _emit,
    _epsilon,
    _finite,
    _groups,
    _number,
    _positive,
)


def _paper_claimed_epsilon(mechanism: str, eps1: float, eps2: float, k: float) -> float:
    """What Juarez and Korolova 2022, Theorem 5 / 6, claims (for contrast only; both are wrong)."""
    if mechanism == "R":
        return max(eps1, eps2)
    return max(eps2, math.log(2 / k) + eps2 / 2 - eps1, math.log(k / 2) + eps2 / k + eps1)


def run_privacy(args: argparse.Namespace, out: TextIO) -> int:
    eps1 = _epsilon("--eps1", args.eps1)
    eps2 = _epsilon("--eps2", args.eps2)
    groups = _groups(args.groups)
    noise_ratio = _positive("--k", _finite("--k", args.k))
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
    epsilon = true_epsilon(args.mechanism, eps1, eps2, groups)
    if args.mechanism == "P":  # not in Juarez and Korolova 2022: no claim to contrast
        payload_p = {
            "mechanism": "P",
            "epsilon_group": eps1,
            "epsilon_value": eps2,
            "num_groups": groups,
            "noise_ratio": None,
            "epsilon": epsilon,
            "paper_claimed_epsilon": None,
        }
        text_p = (
            f"M_P with eps1={eps1:g}, eps2={eps2:g}, d={groups}: true epsilon = {epsilon:.6g}\n"
            "(max(eps2, eps1 + eps2 / 2), as M_L; a released M_P computes its own from its "
            "grid's integer probabilities, at most this)"
        )
        _emit(payload_p, text_p, args.json, out)
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
        help="true LDP epsilon of M_R / M_L / M_P",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The true LDP epsilon of a mechanism with a group budget eps1 and a value budget "
            "eps2\n(M_R: randomized response for both; M_L: randomized response for the group, "
            "discrete\nLaplace for the value; M_P: randomized response for the group, the "
            "Piecewise\nmechanism for the value).\n\n"
            "examples:\n"
            "  fedparity privacy --mechanism R --eps1 0.5 --eps2 1\n"
            "      the epsilon a user really spends with M_R at eps1 = 0.5, eps2 = 1\n"
            "  fedparity privacy --mechanism L --eps1 0.5 --eps2 1 --groups 3 --json"
        ),
    )
    privacy.add_argument(
        "--mechanism",
        choices=("R", "L", "P"),
        required=True,
        help=(
            "R: randomized response for both (M_R); L: discrete Laplace for the value (M_L); "
            "P: the Piecewise mechanism for the value (M_P)"
        ),
    )
    privacy.add_argument("--eps1", required=True, help="group budget eps1 > 0")
    privacy.add_argument("--eps2", required=True, help="value budget eps2 > 0")
    privacy.add_argument("--groups", default="2", help="number of groups d >= 2 (default 2)")
    privacy.add_argument("--k", default="2", help="M_L noise ratio; only k = 2 is LDP")
    privacy.add_argument("--json", action="store_true", help="print one JSON object")
