"""``fedparity keys``: write a CKKS key pair for the encrypted FedEvalFair protocol.

With ``--holders N`` it writes everything N data holders need, each in a private folder of
its own (``OUT/holder-<i>/``, mode 0700: the shared secret context and the holder's identity
key, mode 0600, plus a copy of the roster), the roster of the holders' identity keys
(``OUT/roster.toml``) and the public context alone in ``--public-out`` (the server's).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._common import (
    UsageError,
    _emit,
    _integer,
)

if TYPE_CHECKING:
    from ...mechanisms.crypto.ckks import CkksParameters


def _exists(error: FileExistsError) -> str:
    """The CLI's sentence for a file that exists: the option ``--overwrite``, not the Python
    API's ``overwrite=True`` that the library's message names."""
    path = error.filename or str(error).split(" exists", 1)[0]
    return f"{path} exists; use --overwrite to replace it (and the keys written with it)"


def run_keys(args: argparse.Namespace, out: TextIO) -> int:
    """Write a CKKS key pair for FedEvalFair: the secret context for the key holders (the
    clients; give each node its path out of band) and the public one for the server."""
    from ...mechanisms.crypto.ckks import DEFAULT_KEY_DIR, CkksParameters, generate_keys

    degree = _integer("--poly-modulus-degree", args.poly_modulus_degree, 1024)
    try:
        moduli = tuple(int(part) for part in args.coeff_mod_bit_sizes.split(","))
    except ValueError:
        raise UsageError(
            f"--coeff-mod-bit-sizes must be comma-separated integers, got "
            f"{args.coeff_mod_bit_sizes!r}"
        ) from None
    scale = _integer("--scale-bits", args.scale_bits, 1)
    parameters = CkksParameters(degree, moduli, scale)
    if args.holders is not None:
        return _run_holders(args, parameters, out)
    kept = _kept_pair(Path(args.out or DEFAULT_KEY_DIR).expanduser(), args, parameters)
    if kept is not None:
        _emit(
            kept,
            f"CKKS key pair already in {kept['folder']}: kept (--overwrite writes a new pair)",
            args.json,
            out,
        )
        return 0
    try:
        paths = generate_keys(
            args.out or DEFAULT_KEY_DIR,
            parameters,
            overwrite=args.overwrite,
            public_directory=args.public_out,
        )
    except FileExistsError as error:
        raise UsageError(f"--out: {_exists(error)}") from None
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


def _kept_pair(
    folder: Path, args: argparse.Namespace, parameters: CkksParameters
) -> dict[str, Any] | None:
    """The payload of an existing key pair that ``fedparity keys`` run again keeps (None: write
    one, or refuse): both contexts in ``folder``, no --overwrite or --public-out, the default
    parameters (other parameters asked for are not what the folder holds). A folder whose two
    files are not one key pair (damaged, or copied from two runs) is refused, not kept."""
    from ...mechanisms.crypto.ckks import (
        PUBLIC_CONTEXT_FILE,
        SECRET_CONTEXT_FILE,
        CkksParameters,
        check_key_pair,
    )
    from ...mechanisms.crypto.ckks.errors import KeyMaterialError

    secret, public = folder / SECRET_CONTEXT_FILE, folder / PUBLIC_CONTEXT_FILE
    if args.overwrite or args.public_out or parameters != CkksParameters():
        return None
    if not (secret.is_file() and public.is_file()):
        return None
    try:
        check_key_pair(secret, public)
    except KeyMaterialError as error:
        raise UsageError(
            f"--out: {folder} holds key files that cannot be kept: {error}; --overwrite writes "
            "a new pair"
        ) from None
    return {
        "kept": True,
        "folder": str(folder),
        "secret_context": str(secret),
        "public_context": str(public),
    }


def _run_holders(args: argparse.Namespace, parameters: CkksParameters, out: TextIO) -> int:
    """``--holders N``: per-holder private folders, the roster, the public context apart."""
    from ...mechanisms._files import write_file_atomic
    from ...mechanisms.crypto.ckks import SECRET_CONTEXT_FILE, generate_keys
    from .identity import write_identities

    count = _integer("--holders", args.holders, 2)
    if not args.out or not args.public_out:
        raise UsageError(
            "--holders needs --out (the holders' private folders) and --public-out (the "
            "server's public context, in a folder of its own)"
        )
    folder = Path(args.out).expanduser().resolve()
    public_folder = Path(args.public_out).expanduser().resolve()
    if public_folder == folder or folder in public_folder.parents:
        raise UsageError("--public-out must be a folder apart from --out")
    holders = [folder / f"holder-{index}" for index in range(count)]
    roster_path = folder / "roster.toml"
    identity_files = {holder.name: holder / "identity.key" for holder in holders}
    if not args.overwrite:
        for path in (roster_path, *(holder / SECRET_CONTEXT_FILE for holder in holders)):
            if path.exists():
                raise UsageError(f"--out: {path} exists (use --overwrite to replace)")
    folder.mkdir(parents=True, exist_ok=True)
    if roster_path.exists():  # --overwrite: a new roster of exactly these holders
        roster_path.unlink()
    try:
        paths = generate_keys(
            holders[0], parameters, overwrite=args.overwrite, public_directory=public_folder
        )
        _, roster = write_identities(identity_files, roster_path, overwrite=args.overwrite)
    except FileExistsError as error:
        raise UsageError(f"--out: {_exists(error)}") from None
    secret = paths.secret.read_bytes()
    for holder in holders:
        holder.mkdir(mode=0o700, parents=True, exist_ok=True)
        holder.chmod(0o700)
        if holder != holders[0]:
            write_file_atomic(holder / SECRET_CONTEXT_FILE, secret, 0o600)
        roster.write(holder / "roster.toml")
    entries = [
        {
            "folder": str(holder),
            "secret_context": str(holder / SECRET_CONTEXT_FILE),
            "identity_key": str(identity_files[holder.name]),
            "roster": str(holder / "roster.toml"),
        }
        for holder in holders
    ]
    payload = {
        "holders": entries,
        "roster": str(roster_path),
        "public_context": str(paths.public),
        "security_bits": parameters.security_bits,
    }
    lines = [
        f"{count} holder folders (each private: hand holder i only OUT/holder-<i>): {folder}",
        f"roster of the holders' identity keys: {roster_path} (a copy is in every folder)",
        f"public context (server, run config fef-public-context): {paths.public}",
        "start holder i with: --node-config \"fef-secret-context='<folder>/"
        f"{SECRET_CONTEXT_FILE}' identity-key='<folder>/identity.key' "
        "roster='<folder>/roster.toml'\"",
        "run this on a key holder or key authority, not on the server's host",
    ]
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity keys`` and its options."""
    keys = commands.add_parser(
        "keys",
        help="write a CKKS key pair for FedEvalFair",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Write the CKKS (TenSEAL) key material of FedEvalFair: the secret context for the "
            "data\nholders (a private folder) and the public context for the server.\n\n"
            "examples:\n"
            "  fedparity keys\n"
            "      a simulation's key pair in ~/.fedparity/keys\n"
            "  fedparity keys --holders 3 --out ~/.fedparity/holders "
            "--public-out ~/.fedparity/keys\n"
            "      one private folder per holder, the public context apart"
        ),
    )
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
    keys.add_argument(
        "--holders",
        default=None,
        help=(
            "write N private holder folders OUT/holder-<i> (secret context + identity key), "
            "the roster, and the public context only in --public-out"
        ),
    )
    keys.add_argument("--poly-modulus-degree", default="8192")
    keys.add_argument("--coeff-mod-bit-sizes", default="60,40,40,60")
    keys.add_argument("--scale-bits", default="40")
    keys.add_argument("--overwrite", action="store_true")
    keys.add_argument("--json", action="store_true", help="print one JSON object")
