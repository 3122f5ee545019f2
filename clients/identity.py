"""Where a node finds its identity key and its roster: its own config, never the server.

* node config ``identity-key``: the path of the node's Ed25519 identity key (made by
  ``fedparity identity``; mode 0600), and ``roster``: the path of the roster of the members it
  trusts (TOML, :class:`~fedparity.mechanisms.crypto.identity.Roster`), both set by whoever starts
  the SuperNode (``flower-supernode --node-config "identity-key='/etc/fedparity/node.key'
  roster='/etc/fedparity/roster.toml'"``);
* otherwise the environment variable ``FEDPARITY_IDENTITY_DIR`` of the process that hosts the
  node: the folder holds ``roster.toml`` and one key per partition, ``node-<partition-id>.key``
  (``fedparity identity --nodes N --out DIR`` writes exactly that);
* otherwise the node's default folder ``~/.fedparity/identity`` (:func:`default_identity_dir`,
  where ``fedparity identity --nodes N`` writes by default), if it holds a roster: how a
  simulation's nodes find their material whatever process started the SuperLink (an
  environment variable reaches the simulated nodes only if it was set when the SuperLink
  started);
* otherwise the node has no identity (cross-device deployments: no roster can list every
  phone), and the protocols that need one refuse, naming these keys.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..mechanisms.crypto.identity import IdentityError, IdentityKey, Roster
from ..mechanisms.validation import parse_int

__all__ = [
    "IDENTITY_DIR_ENV",
    "IDENTITY_KEY_NODE_KEY",
    "ROSTER_FILE",
    "ROSTER_NODE_KEY",
    "NodeIdentity",
    "default_identity_dir",
    "identity_key_file",
    "node_identity",
]

#: Node config key of the node's identity key file.
IDENTITY_KEY_NODE_KEY = "identity-key"
#: Node config key of the roster file.
ROSTER_NODE_KEY = "roster"
#: Environment variable naming a folder of identity material (simulation, tests).
IDENTITY_DIR_ENV = "FEDPARITY_IDENTITY_DIR"
#: The roster's file name in such a folder.
ROSTER_FILE = "roster.toml"


def default_identity_dir() -> Path:
    """The node's own default identity folder, ``~/.fedparity/identity`` (read when asked, so
    it follows ``$HOME``; ``fedparity identity`` writes there by default)."""
    return Path.home() / ".fedparity" / "identity"


def identity_key_file(partition_id: int) -> str:
    """The file name of partition ``partition_id``'s key in a ``FEDPARITY_IDENTITY_DIR``."""
    return f"node-{int(partition_id)}.key"


@dataclass(frozen=True)
class NodeIdentity:
    """A node's identity key and the roster it trusts (either may be absent)."""

    key: IdentityKey | None
    roster: Roster | None

    def require(self, purpose: str) -> tuple[IdentityKey, Roster]:
        """Both, or ``IdentityError`` naming the node config keys that provide them."""
        if self.key is None or self.roster is None:
            missing = [
                name
                for name, value in (
                    (IDENTITY_KEY_NODE_KEY, self.key),
                    (ROSTER_NODE_KEY, self.roster),
                )
                if value is None
            ]
            raise IdentityError(
                f"{purpose} needs this node's {' and '.join(missing)}: set node config "
                f"{IDENTITY_KEY_NODE_KEY} and {ROSTER_NODE_KEY} (files made by fedparity "
                f"identity), or {IDENTITY_DIR_ENV} in a simulation's environment"
            )
        if self.key.public_bytes() not in self.roster:
            raise IdentityError(f"{purpose}: this node's identity key is not on its own roster")
        return self.key, self.roster


@functools.lru_cache(maxsize=64)
def _key(path: str, modified: float) -> IdentityKey:
    return IdentityKey.from_file(path)


@functools.lru_cache(maxsize=64)
def _roster(path: str, modified: float) -> Roster:
    return Roster.from_file(path)


def _mtime(path: Path, what: str) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        raise IdentityError(f"{what} {path}: no such file") from None


def node_identity(
    node_config: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    default_dir: Path | None = None,
) -> NodeIdentity:
    """This node's identity key and roster (module docstring: node config, then
    ``FEDPARITY_IDENTITY_DIR``, then ``default_dir`` (default :func:`default_identity_dir`) if
    it holds a roster, with the node's ``partition-id``); files are re-read when they change.
    Every source is the node's own: never a path from the server."""
    environ = os.environ if environ is None else environ
    key_path = node_config.get(IDENTITY_KEY_NODE_KEY) or None
    roster_path = node_config.get(ROSTER_NODE_KEY) or None
    folder = environ.get(IDENTITY_DIR_ENV)
    if not folder:
        fallback = default_identity_dir() if default_dir is None else Path(default_dir)
        folder = str(fallback) if (fallback / ROSTER_FILE).is_file() else None
    if key_path is None and roster_path is None and folder:
        if "partition-id" in node_config:
            key_path = str(
                Path(folder)
                / identity_key_file(
                    parse_int("partition-id", node_config["partition-id"], minimum=0)
                )
            )
        roster_path = str(Path(folder) / ROSTER_FILE)
    key = roster = None
    if key_path is not None:
        path = Path(str(key_path)).expanduser()
        key = _key(str(path), _mtime(path, "identity key"))
    if roster_path is not None:
        path = Path(str(roster_path)).expanduser()
        roster = _roster(str(path), _mtime(path, "roster"))
    return NodeIdentity(key=key, roster=roster)
