"""``fedparity identity``: write node identity keys and the roster that lists them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ._common import UsageError, _emit, _integer

if TYPE_CHECKING:
    from ...mechanisms.crypto.identity import IdentityKey, Roster


def write_identities(
    files: Mapping[str, Path], roster_path: Path, *, overwrite: bool = False
) -> tuple[dict[str, IdentityKey], Roster]:
    """Write a fresh identity key for every ``name: file`` (mode 0600, folder 0700) and add
    their public keys to the roster at ``roster_path`` (created, or extended if it exists).

    Raises
    ------
    FileExistsError
        A key file exists, or the roster already lists a name, and not ``overwrite``.
    """
    from ...mechanisms.crypto.identity import IdentityKey, Roster

    existing: dict[str, bytes] = {}
    if roster_path.exists():
        existing = dict(Roster.from_file(roster_path).members)
    for name, file in files.items():
        if file.exists() and not overwrite:
            raise FileExistsError(f"{file} exists (use --overwrite to replace it)")
        if name in existing and not overwrite:
            raise FileExistsError(f"{roster_path} already lists {name!r} (use --overwrite)")
    keys = {}
    for name, file in files.items():
        keys[name] = IdentityKey.generate()
        keys[name].write(file, overwrite=overwrite)
    roster = Roster({**existing, **{name: key.public_bytes() for name, key in keys.items()}})
    roster.write(roster_path)
    return keys, roster


def write_node_identities(folder: str | Path, num_nodes: int, *, overwrite: bool = False) -> Path:
    """``node-0.key`` .. ``node-<num_nodes - 1>.key`` and ``roster.toml`` in ``folder``: the
    layout a simulation's ``FEDPARITY_IDENTITY_DIR`` names (what ``fedparity identity --nodes
    N --out DIR`` writes). Returns ``folder``."""
    from ...clients.identity import ROSTER_FILE, identity_key_file

    path = Path(folder).expanduser()
    files = {f"node-{index}": path / identity_key_file(index) for index in range(num_nodes)}
    write_identities(files, path / ROSTER_FILE, overwrite=overwrite)
    return path


def _already_written(files: Mapping[str, Path], roster_path: Path) -> bool:
    """Whether every key file exists and the roster lists each under its name with that key's
    public key (what this command wrote before, unchanged)."""
    from ...mechanisms.crypto.identity import IdentityError, IdentityKey, Roster

    if not roster_path.is_file() or not all(file.is_file() for file in files.values()):
        return False
    try:
        members = dict(Roster.from_file(roster_path).members)
        return all(
            members.get(name) == IdentityKey.from_file(file).public_bytes()
            for name, file in files.items()
        )
    except (IdentityError, OSError, ValueError):
        return False


def run_identity(args: argparse.Namespace, out: TextIO) -> int:
    """Write one identity key per node (mode 0600, for the node only) and the roster of their
    public keys (public: give every node a copy, out of band)."""
    from ...clients.identity import ROSTER_FILE, default_identity_dir, identity_key_file

    folder = default_identity_dir() if args.out is None else Path(args.out).expanduser()
    if args.nodes is not None and args.name is not None:
        raise UsageError("--nodes and --name: give one of them")
    if args.nodes is not None:
        count = _integer("--nodes", args.nodes, 1)
        names = [f"node-{index}" for index in range(count)]
        files = {name: folder / identity_key_file(index) for index, name in enumerate(names)}
    else:
        name = args.name or "node"
        files = {name: folder / f"{name}.key"}
    roster_path = Path(args.roster).expanduser() if args.roster else folder / ROSTER_FILE
    if not args.overwrite and _already_written(files, roster_path):
        # the same command run again (a second guide's "once" block): nothing to replace
        text = (
            f"identity keys of {', '.join(files)} already in {folder}, listed in the roster "
            f"{roster_path}: kept (--overwrite writes new ones)"
        )
        payload = {"kept": True, "keys": {n: str(f) for n, f in files.items()}}
        _emit({**payload, "roster": str(roster_path)}, text, args.json, out)
        return 0
    try:
        keys, roster = write_identities(files, roster_path, overwrite=args.overwrite)
    except FileExistsError as error:
        flag = "--roster" if "already lists" in str(error) else "--out"
        raise UsageError(f"{flag}: {error}") from None
    payload = {
        "keys": {name: str(file) for name, file in files.items()},
        "public_keys": {name: key.public_bytes().hex() for name, key in keys.items()},
        "roster": str(roster_path),
        "roster_members": len(roster),
    }
    lines = [
        f"identity key of {name} (that node only, keep private): {file}"
        for name, file in files.items()
    ]
    lines += [
        f"roster ({len(roster)} member(s); copy it to every node): {roster_path}",
        "give each node its key and the roster: --node-config \"identity-key='<key file>' "
        "roster='<roster file>'\""
        + (
            "; the nodes of a simulation on this machine find them here by themselves"
            if args.out is None and roster_path == folder / ROSTER_FILE
            else f" (or FEDPARITY_IDENTITY_DIR={folder} in a simulation's environment)"
        ),
    ]
    _emit(payload, "\n".join(lines), args.json, out)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``fedparity identity`` and its options."""
    parser = commands.add_parser(
        "identity",
        help="write node identity keys (Ed25519) and the roster of members",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Write node identity keys and add them to a roster.\n\n"
            "examples:\n"
            "  fedparity identity --nodes 3\n"
            "      node-0.key .. node-2.key and roster.toml in ~/.fedparity/identity, where the\n"
            "      nodes of a simulation on this machine find them\n"
            "  fedparity identity --name hospital-a --out /etc/fedparity --roster roster.toml\n"
            "      on each silo; then merge the rosters"
        ),
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the key file(s) (default ~/.fedparity/identity, where simulated "
        "nodes find them)",
    )
    parser.add_argument("--name", default=None, help="the member's name (one key: NAME.key)")
    parser.add_argument(
        "--nodes", default=None, help="write N keys node-0.key .. node-<N-1>.key instead"
    )
    parser.add_argument(
        "--roster", default=None, help="roster file to add to (default OUT/roster.toml)"
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
