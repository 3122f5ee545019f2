"""Node identity keys and the roster: authenticated messages between nodes, through a server
nobody has to trust.

A node (an FPFL node in a cross-silo deployment, a FedEvalFair data holder) holds a long-term
Ed25519 identity key (RFC 8032, from the ``cryptography`` package) made by ``fedparity
identity``; its public key goes, out of band, into the **roster** that every other node keeps
(a TOML file, ``[members]`` ``name = "<64 hex digits>"``). A node signs what it sends that
others must be able to attribute to it -- its masking public key of an FPFL run, its
FedEvalFair ciphertext of a run and round -- and a receiving node verifies the signature
against its own roster, so the server, which relays every message, cannot substitute or
invent a member (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, Section 6: the PKI of the actively secure variant).

What is signed is :func:`transcript` of a label and the fields: a length-prefixed,
unambiguous byte string, so a signature for one purpose is never valid for another.

Pure Python plus ``cryptography``: no Flower import.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .._files import private_file_problem, write_file_atomic

__all__ = [
    "IDENTITY_KEY_BYTES",
    "SIGNATURE_BYTES",
    "IdentityError",
    "IdentityKey",
    "Roster",
    "transcript",
    "verify_signature",
]

#: Length of a raw Ed25519 public key (bytes).
IDENTITY_KEY_BYTES = 32
#: Length of an Ed25519 signature (bytes).
SIGNATURE_BYTES = 64


class IdentityError(ValueError):
    """An identity key or roster is missing, unreadable, not private, or malformed."""


def transcript(label: str, *fields: bytes | int | str) -> bytes:
    """The byte string a signature covers: the label and each field, each prefixed by its
    type and its length (integers as unsigned 8-byte big-endian, strings as UTF-8), so two
    different (label, fields) never give the same bytes."""
    parts = [_field(label.encode())]
    for value in fields:
        if isinstance(value, bool):
            raise TypeError("transcript fields must be bytes, int or str, not bool")
        if isinstance(value, int):
            if not 0 <= value < 2**64:
                raise ValueError(f"transcript integers must be in [0, 2^64 - 1], got {value}")
            parts.append(b"i" + value.to_bytes(8, "big"))
        elif isinstance(value, str):
            parts.append(b"s" + _field(value.encode()))
        elif isinstance(value, (bytes, bytearray, memoryview)):
            parts.append(b"b" + _field(bytes(value)))
        else:
            raise TypeError(f"transcript fields must be bytes, int or str, got {type(value)}")
    return b"".join(parts)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``
    (False for a malformed key or signature as well: never raises on hostile input)."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes(public_key))
        key.verify(bytes(signature), bytes(message))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class IdentityKey:
    """A node's long-term Ed25519 identity key (the private half stays on the node)."""

    private_key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> IdentityKey:
        """A fresh key from OS entropy."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> IdentityKey:
        """The key in the PKCS#8 PEM file ``path``; refused (``IdentityError``) unless the file
        is private to its owner (no group or other permission bits)."""
        file = Path(path).expanduser()
        problem = private_file_problem(file, "an identity key")
        if problem is not None:
            raise IdentityError(problem)
        try:
            key = serialization.load_pem_private_key(file.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as error:
            raise IdentityError(f"{file} is not a PEM identity key ({error})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{file} is not an Ed25519 key")
        return cls(key)

    def write(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the private key (PKCS#8 PEM, mode 0600, atomically) to ``path``; its folder is
        created with mode 0700. An existing file raises ``FileExistsError`` unless
        ``overwrite``."""
        file = Path(path).expanduser()
        file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if file.exists() and not overwrite:
            raise FileExistsError(f"{file} exists (pass overwrite to replace it)")
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_file_atomic(file, pem, 0o600)
        return file

    def public_bytes(self) -> bytes:
        """The raw 32-byte public key (what the roster lists)."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message`` (normally a :func:`transcript`)."""
        return self.private_key.sign(bytes(message))


@dataclass(frozen=True)
class Roster:
    """The members a node trusts: ``{name: raw Ed25519 public key}``, given out of band.

    Names are for people (logs, errors); a member is its key. Two names with one key are
    refused.
    """

    members: Mapping[str, bytes]
    source: str = field(default="in memory", compare=False)

    def __post_init__(self) -> None:
        checked: dict[str, bytes] = {}
        for name, key in self.members.items():
            if not isinstance(name, str) or not name:
                raise IdentityError(f"roster {self.source}: member names must be non-empty text")
            if not isinstance(key, (bytes, bytearray)) or len(key) != IDENTITY_KEY_BYTES:
                raise IdentityError(
                    f"roster {self.source}: member {name!r} must have a {IDENTITY_KEY_BYTES}-byte "
                    "Ed25519 public key"
                )
            checked[name] = bytes(key)
        if len(set(checked.values())) != len(checked):
            raise IdentityError(f"roster {self.source}: two members have the same key")
        object.__setattr__(self, "members", dict(sorted(checked.items())))

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, public_key: object) -> bool:
        return isinstance(public_key, (bytes, bytearray)) and bytes(public_key) in self._keys()

    def _keys(self) -> set[bytes]:
        return set(self.members.values())

    def name_of(self, public_key: bytes) -> str | None:
        """The member name of ``public_key``, or None when it is not on the roster."""
        for name, key in self.members.items():
            if key == bytes(public_key):
                return name
        return None

    @classmethod
    def from_keys(cls, keys: Mapping[str, IdentityKey] | Iterable[tuple[str, bytes]]) -> Roster:
        """A roster of named identity keys (or ``(name, public key)`` pairs)."""
        items = keys.items() if isinstance(keys, Mapping) else keys
        return cls(
            {
                name: key.public_bytes() if isinstance(key, IdentityKey) else bytes(key)
                for name, key in items
            }
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Roster:
        """The roster in the TOML file ``path`` (table ``[members]``, ``name = "<hex key>"``)."""
        file = Path(path).expanduser()
        try:
            with file.open("rb") as handle:
                table = tomllib.load(handle)
        except FileNotFoundError:
            raise IdentityError(f"roster {file}: no such file") from None
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise IdentityError(f"roster {file}: not readable TOML ({error})") from None
        members = table.get("members")
        if not isinstance(members, dict) or not members:
            raise IdentityError(f"roster {file}: needs a non-empty [members] table")
        keys: dict[str, bytes] = {}
        for name, text in members.items():
            try:
                keys[name] = bytes.fromhex(str(text))
            except ValueError:
                raise IdentityError(
                    f"roster {file}: member {name!r} is not a hex-encoded key"
                ) from None
        return cls(keys, source=str(file))

    def to_toml(self) -> str:
        """The roster as the TOML text :meth:`from_file` reads."""
        lines = ["[members]"]
        lines += [f'"{name}" = "{key.hex()}"' for name, key in self.members.items()]
        return "\n".join(lines) + "\n"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the roster (public: mode 0644, atomically) to ``path``."""
        file = Path(path).expanduser()
        file.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(file, self.to_toml().encode(), 0o644)
        return file
