"""Key files: atomic writes with fixed permission bits, and the check that a secret file is
private to its owner (shared by the CKKS keys and the identity keys)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["private_file_problem", "write_file_atomic"]


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
