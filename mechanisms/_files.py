"""Durable files: atomic writes with fixed permission bits and the check that a secret file is
private to its owner (shared by the CKKS keys and the identity keys), and durable text files
(a run's status, the FPFL release ledger)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

__all__ = [
    "DEFAULT_RUNS_DIR",
    "new_run_folder",
    "private_file_problem",
    "write_file_atomic",
    "write_text_durably",
]

#: Where a run keeps its files when it is given no folder (``output-dir``'s default).
DEFAULT_RUNS_DIR = Path("~/.fedparity/runs")


def write_file_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` atomically to ``path`` with permission bits ``mode`` from the start: a
    temporary file in the same folder, ``fsync``-ed, renamed over ``path``, then the folder
    ``fsync``-ed, so a crash leaves the old file or the new one, never a torn or empty one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(descriptor, mode)  # the umask may have removed bits; never adds any
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that it survives a crash: scratch file, ``fsync``, atomic
    ``os.replace``, then ``fsync`` of the folder (POSIX) so the rename itself is on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with scratch.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    if hasattr(os, "O_DIRECTORY"):
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def new_run_folder(name: str, root: Path = DEFAULT_RUNS_DIR) -> Path:
    """A folder that does not exist yet: ``root/<name>-<UTC time>``, with ``-2``, ``-3``, ...
    appended when runs started in the same second took the name (not created here)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    base = root.expanduser() / f"{name}-{stamp}"
    folder, number = base, 1
    while folder.exists():
        number += 1
        folder = base.with_name(f"{base.name}-{number}")
    return folder


def private_file_problem(path: str | os.PathLike[str], what: str) -> str | None:
    """Why the secret file ``path`` must not be used (it cannot be read, or its group or others
    may read or write it: POSIX bits ``0o077``), or None. ``what`` names its content."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
    except OSError as error:
        return f"cannot read {what} {file}: {error}"
    if os.name == "posix" and mode & 0o077:
        return (
            f"{file} holds {what} but has mode {mode & 0o777:04o}: its group or others may "
            f"read it; refusing to use it (make it private: chmod 600 {file})"
        )
    return None
