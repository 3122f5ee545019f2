"""A key holder's journal of one secret key: the commitments it signed and the releases it made.

Every release of a FedEvalFair key holder spends some of its secret key's flooding margin
(:mod:`.flooding`: a key that served R releases keeps about ``30 - log2(R)`` bits against key
recovery), so a holder counts its releases *per key*, not per run, and refuses past its
policy's cap. The same journal keeps, for each run (a :func:`~.signing.session_id`), the one
commitment to a round-1 and round-2 set the holder signed (:mod:`.signing`) and the one it
released: a holder that was restarted mid-run (its run state lost) still refuses to commit to,
or release, a second set of that run.

The journal is a small JSON file, written atomically with fixed permission bits. Its first save
leaves a ``<name>.created`` marker beside it, as the privacy ledgers do: a journal whose marker
is there but whose file is gone was lost, and the holder refuses every commitment and release
until its operator restores it
(:class:`~fedparity.mechanisms.privacy.basic_ledger.LedgerFileError`), instead of starting again at
zero.

Pure Python: no Flower, no TenSEAL.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..._files import write_file_atomic
from ...privacy.basic_ledger import LedgerFileError, ledger_marker, write_ledger_marker
from .signing import UnverifiedSumError

__all__ = [
    "JOURNAL_FORMAT",
    "CommitmentConflict",
    "ReleaseJournal",
    "journal_file_name",
    "key_fingerprint",
]

#: Format tag of a journal file (a new layout is a new tag).
JOURNAL_FORMAT = "fedparity-fedevalfair-key-journal/v1"
#: What to do when a journal cannot be used (part of every LedgerFileError text).
_RECOVERY = (
    "restore it from a backup; no FedEvalFair commitment or release is made with this key until "
    "then (or make new keys with `fedparity keys` and hand the new secret context out)"
)


class CommitmentConflict(UnverifiedSumError):
    """This holder already committed to (or released) another set of this run, or released
    this run before. Fixed sentences (safe to reach the server)."""


def key_fingerprint(flood_key: bytes) -> str:
    """A 16-hex-digit name of a secret key, from its
    :func:`~fedparity.mechanisms.crypto.ckks.flood_key` (one-way: it reveals nothing of the key)."""
    return hashlib.sha256(b"fedparity/ckks/key-fingerprint/v1" + bytes(flood_key)).hexdigest()[:16]


def journal_file_name(fingerprint: str) -> str:
    """The journal's file name in a node's ledger folder."""
    return f"fedevalfair-key-{fingerprint}.json"


@dataclass
class ReleaseJournal:
    """The commitments and releases of one secret key on one holder (module docstring).

    ``commitments`` and ``releases`` map a run's :func:`~.signing.session_id` to the 32-byte
    commitment digest (SHA-256 of :func:`~.signing.commitment_transcript`) signed or released.
    """

    key: str
    commitments: dict[int, bytes] = field(default_factory=dict)
    releases: dict[int, bytes] = field(default_factory=dict)

    @property
    def release_count(self) -> int:
        """Releases made with this key so far."""
        return len(self.releases)

    def check_commit(self, run_id: int, digest: bytes) -> None:
        """Refuse a commitment to ``digest`` when this run already has another one (signed or
        released)."""
        known = self.commitments.get(int(run_id))
        if known is not None and known != bytes(digest):
            raise CommitmentConflict(
                "this holder already committed to another round-1 and round-2 set in this run"
            )

    def commit(self, run_id: int, digest: bytes) -> None:
        """:meth:`check_commit`, then record the commitment (saved by the caller)."""
        self.check_commit(run_id, digest)
        self.commitments[int(run_id)] = bytes(digest)

    def check_release(self, run_id: int, digest: bytes) -> None:
        """Refuse a second release in a run, or a release of another set than this holder
        committed to in it."""
        if int(run_id) in self.releases:
            raise CommitmentConflict("this holder already released this run's statistics")
        self.check_commit(run_id, digest)

    def record_release(self, run_id: int, digest: bytes) -> None:
        """:meth:`check_release`, then count the release (saved by the caller)."""
        self.check_release(run_id, digest)
        self.commitments[int(run_id)] = bytes(digest)
        self.releases[int(run_id)] = bytes(digest)

    # -- storage ------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": JOURNAL_FORMAT,
                "key": self.key,
                "releases": len(self.releases),
                "released": {str(run): digest.hex() for run, digest in self.releases.items()},
                "committed": {str(run): digest.hex() for run, digest in self.commitments.items()},
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, key: str, *, source: str = "the journal") -> ReleaseJournal:
        """The journal ``text`` holds (:class:`LedgerFileError` naming ``source`` when it is
        not a journal of ``key``, or damaged)."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT:
                raise ValueError("not a FedEvalFair key journal")
            if data.get("key") != key:
                raise ValueError("a journal of another secret key")
            released = {int(run): bytes.fromhex(d) for run, d in data["released"].items()}
            committed = {int(run): bytes.fromhex(d) for run, d in data["committed"].items()}
            if data["releases"] != len(released):
                raise ValueError("the release count does not match the releases listed")
            if any(len(d) != 32 for d in (*released.values(), *committed.values())):
                raise ValueError("a digest is not 32 bytes")
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise LedgerFileError(
                f"FedEvalFair key journal {source}: {error}; {_RECOVERY}"
            ) from None
        return cls(key, committed, released)

    def save(self, path: str | Path) -> None:
        """Persist atomically; the first save leaves the ``.created`` marker."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_ledger_marker(path, f"{JOURNAL_FORMAT} of the secret key {self.key}")
        write_file_atomic(path, self.to_json().encode("utf-8"), 0o600)

    @classmethod
    def load_or_create(cls, path: str | Path, key: str) -> ReleaseJournal:
        """The journal at ``path``, or a new one when none was ever saved there
        (:class:`LedgerFileError` when it is damaged, foreign, or was lost: its ``.created``
        marker is there but the file is not)."""
        path = Path(path)
        if path.exists():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise LedgerFileError(
                    f"FedEvalFair key journal {path} cannot be read ({error}); {_RECOVERY}"
                ) from None
            return cls.from_json(text, key, source=str(path))
        marker = ledger_marker(path)
        if marker.exists():
            raise LedgerFileError(
                f"FedEvalFair key journal {path} is missing, but {marker.name} beside it says it "
                "was saved before: the releases this key made are not known. Restore it from a "
                "backup; no FedEvalFair commitment or release is made with this key until then "
                f"(to accept that the count starts again at zero, delete {marker} yourself)"
            )
        return cls(key)
