"""Atomic file writes: a reader (or Snakemake) sees either the old file, no file, or the whole new one.

    atomic_write(path, text_or_bytes)
    with atomic_open(path, "w") as fh:      # or "wb"; for writers that want a file object (pandas, numpy)
        fh.write(...)

The data goes to a temporary file in the destination's own directory (so the rename never crosses a file system),
is flushed and fsync'ed, gets the permissions an ordinary ``open(path, "w")`` would give it (``0o666 & ~umask``, not
``mkstemp``'s 0600: results stay readable by the user's group), and is renamed over ``path`` with ``os.replace``. If
anything fails — the writer raises, the disk fills, the process is interrupted — the temporary file is removed and
``path`` is untouched. Missing parent directories are created.

:func:`check_writable` answers, leaving nothing behind, whether a later atomic write to ``path`` can succeed
(used to validate ``--out``-style arguments before any work); it raises :class:`DestinationError` with the reason.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["DestinationError", "atomic_open", "atomic_write", "check_writable", "file_mode"]


class DestinationError(OSError):
    """The destination cannot be written: it is a directory, lies under a file, is empty, or is not writable."""


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask(0) would race with other threads creating files)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new ordinary file gets here: ``0o666 & ~umask``."""
    return 0o666 & ~_umask()


def _check_target(path) -> tuple[Path, Path]:
    """``path`` names a file whose nearest existing ancestor is a directory: (path, that ancestor)."""
    if path is None or str(path).strip() == "":
        raise DestinationError("empty path: give a file name to write")
    path = Path(path)
    if path.is_dir():
        raise DestinationError(f"{path} is a directory; give a file name inside it")
    if path.name in ("", ".", ".."):
        raise DestinationError(f"{path} does not name a file")
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link
            raise DestinationError(f"cannot write {path}: {parent} is a broken symbolic link")
        parent = parent.parent
    if not parent.is_dir():
        raise DestinationError(f"cannot write {path}: {parent} is a file, not a directory")
    return path, parent


def check_writable(path: str | os.PathLike) -> Path:
    """Raise :class:`DestinationError` unless a file can be written at ``path`` (parents may be missing, then the
    nearest existing ancestor must be a writable directory). Leaves nothing behind (it creates and removes one empty
    probe file, the only sure test of a read-only mount). Returns ``Path(path)``."""
    path, parent = _check_target(path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot write {path}: no write permission in directory {parent}")
    try:  # permissions are not the whole story (read-only mounts, /proc, root): try it
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", suffix=".tmp", dir=parent)
    except OSError as err:
        raise DestinationError(f"cannot write {path}: cannot create a file in {parent} "
                               f"({err.strerror or err})") from err
    os.close(fd)
    os.unlink(probe)
    return path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """A file object for writing ``path`` atomically (``mode`` "w" or "wb"); the file appears when the block ends
    without an exception, and not at all otherwise."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path, _ = _check_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise DestinationError(f"cannot write {path}: {err.strerror or err}") from err
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (best effort: not every FS allows it)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; returns ``Path(path)``."""
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write: data must be str or bytes, got {type(data).__name__}")
    with atomic_open(path, "w" if isinstance(data, str) else "wb") as fh:
        fh.write(data)
    return Path(path)
