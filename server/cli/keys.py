"""``fedparity keys``: write a CKKS key pair for the encrypted FedEvalFair protocol."""

from __future__ import annotations

import argparse
from typing import TextIO

from ._common import (
    UsageError,
    _emit,
    _int_at_least,
)


def run_keys(args: argparse.Namespace, out: TextIO) -> int:
    """Write a CKKS key pair for FedEvalFair: the secret context for the key holders (the
    clients; give each node its path out of band) and the public one for the server."""
    from ...mechanisms.ckks import DEFAULT_KEY_DIR, CkksParameters, generate_keys

    degree = _int_at_least("--poly-modulus-degree", args.poly_modulus_degree, 1024)
    try:
        moduli = tuple(int(part) for part in args.coeff_mod_bit_sizes.split(","))
    except ValueError:
        raise UsageError(
            f"--coeff-mod-bit-sizes must be comma-separated integers, got "
            f"{args.coeff_mod_bit_sizes!r}"
        ) from None
    scale = _int_at_least("--scale-bits", args.scale_bits, 1)
    parameters = CkksParameters(degree, moduli, scale)
    try:
        paths = generate_keys(
            args.out or DEFAULT_KEY_DIR,
            parameters,
            overwrite=args.overwrite,
            public_directory=args.public_out,
        )
    except FileExistsError as error:
        raise UsageError(f"--out: {error} (use --overwrite to replace)") from None
    payload = {
        "secret_context": str(paths.secret),
        "public_context": str(paths.public),
        "poly_modulus_degree": degree,
        "coeff_mod_bit_sizes": list(moduli),
        "scale_bits": scale,
        "security_bits": parameters.security_bits,
    }
    text = (
        f"secret context (key holders / clients, keep private): {paths.secret}\n"
        f"public context (server, run config fef-public-context): {paths.public}\n"
        f"CKKS N={degree}, moduli {list(moduli)} ({sum(moduli)} bits), scale 2^{scale}: "
        f"{parameters.security_bits}-bit security\n"
        f"give each node the secret path: --node-config \"fef-secret-context='{paths.secret}'\" "
        f"(or FEDPARITY_SECRET_CONTEXT in a simulation's environment)\n"
        "run this on a key holder, not on the server's host, and copy only the public "
        "context to the server (--public-out writes it to a folder of its own)"
    )
    _emit(payload, text, args.json, out)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity keys`` and its options."""
    keys = commands.add_parser("keys", help="write a CKKS key pair for FedEvalFair")
    keys.add_argument(
        "--out",
        default=None,
        help="folder for the secret context, made private to you (default ~/.fedparity/keys)",
    )
    keys.add_argument(
        "--public-out",
        default=None,
        help="folder for the public context, to copy to the server (default: --out)",
    )
    keys.add_argument("--poly-modulus-degree", default="8192")
    keys.add_argument("--coeff-mod-bit-sizes", default="60,40,40,60")
    keys.add_argument("--scale-bits", default="40")
    keys.add_argument("--overwrite", action="store_true")
    keys.add_argument("--json", action="store_true", help="print one JSON object")
