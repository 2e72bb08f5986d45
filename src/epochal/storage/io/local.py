"""The local file as the first :mod:`byte store <epochal.storage.io.seam>`.

Reads are ``preadv`` on one file descriptor (thread-safe, no shared position), with
``RWF_NOWAIT`` to learn whether the page cache can serve a read, ``posix_fadvise(WILLNEED)``
hints and ``mmap``. Writes go through :class:`epochal.storage.io.atomic.AtomicFile`: a temp
name in the same directory, write-behind (``sync_file_range``) as the stream goes, then
fsync, rename and directory fsync at commit; an abort removes the temp file.
"""

from __future__ import annotations

import errno
import mmap as _mmap
import os
import stat as _stat
from collections.abc import Sequence
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError
from . import atomic, tuning
from .direct import DirectSink, direct_supported

__all__ = ["RWF_NOWAIT", "LocalSink", "LocalSource", "LocalStore"]

#: ``preadv`` flag: fail (EAGAIN) rather than wait for the disk (Linux 4.14+); 0 elsewhere
RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

_O_READ = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
#: opening never blocks (a FIFO would wait for a writer); reads of a regular file ignore it
_O_OPEN = _O_READ | getattr(os, "O_NONBLOCK", 0)


def open_regular(path: str, what: str = "db") -> int:
    """A read-only descriptor of the regular file ``path`` (symlinks to one are followed).

    A FIFO, device, socket or directory is refused before any read could block, and every
    failure names the file: CheckpointNotFoundError when it is absent, CheckpointError for
    anything else that is not a readable regular file (a symlink loop, a directory, EACCES)."""
    try:
        fd = os.open(path, _O_OPEN)
    except FileNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, f"no such {what} file", path) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open {what} file: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not _stat.S_ISREG(mode):
            kind = "a directory" if _stat.S_ISDIR(mode) else "not a regular file"
            raise CheckpointError(f"{path}: {what} file is {kind}")
        if _O_OPEN != _O_READ:  # back to blocking reads (a regular file never blocks anyway)
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalSource:
    """A local file open for reading (see :class:`~epochal.storage.io.seam.ByteSource`)."""

    def __init__(self, path: str, what: str = "db") -> None:
        self.name = path
        self.fd = -1
        self.fd = open_regular(path, what)
        self.nowait = bool(RWF_NOWAIT)
        self._hints = hasattr(os, "posix_fadvise")

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, views: Sequence[memoryview], offset: int, *, nowait: bool = False) -> int:
        if nowait:
            return os.preadv(self.fd, views, offset, RWF_NOWAIT)
        return os.preadv(self.fd, views, offset)

    def read(self, nbytes: int, offset: int) -> bytes:
        """Up to ``nbytes`` bytes at ``offset`` (fewer at the end of the file)."""
        return os.pread(self.fd, nbytes, offset)

    def map(self, *, sequential: bool = False) -> Any | None:
        try:
            mm = _mmap.mmap(self.fd, 0, access=_mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        if sequential and hasattr(mm, "madvise") and hasattr(_mmap, "MADV_SEQUENTIAL"):
            mm.madvise(_mmap.MADV_SEQUENTIAL)
        return mm

    def hint(self, offset: int, nbytes: int) -> bool:
        if not self._hints:
            return False
        try:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            if self.fd >= 0:
                os.close(self.fd)
        except (AttributeError, OSError):
            pass


class LocalSink:
    """A new local file through :class:`~epochal.storage.io.atomic.AtomicFile` (see
    :class:`~epochal.storage.io.seam.ByteSink`)."""

    def __init__(self, path: str, size: int | None = None) -> None:
        self.name = path
        self._file = atomic.AtomicFile(path, size=size)
        self._file.__enter__()

    def write(self, buffer: Any) -> int:
        return self._file.write(buffer)

    def patch(self, offset: int, data: Any) -> None:
        self._file.seek(offset)
        self._file.write(data)

    def commit(self) -> None:
        try:
            self._file.commit()
        except BaseException:
            self._file.abort()
            raise

    def abort(self) -> None:
        self._file.abort()


class LocalStore:
    """Files on the local disk (see :class:`~epochal.storage.io.seam.ByteStore`)."""

    def open_read(self, path: str, *, what: str = "db") -> LocalSource:
        return LocalSource(path, what)

    def create(self, path: str, size: int | None = None) -> LocalSink | DirectSink:
        """A :class:`LocalSink`; when tuning.DIRECT_MIN is set (512 MiB by default), for a file
        of at least that many bytes a :class:`~.direct.DirectSink` (O_DIRECT from reused
        buffers), where supported."""
        direct_min = tuning.DIRECT_MIN
        if size is not None and direct_min is not None and size >= direct_min and direct_supported():
            return DirectSink(path, size)
        return LocalSink(path, size)

    def create_pinned(self, path: str, size: int | None = None) -> LocalSink | DirectSink:
        """A sink for a file whose data the caller writes with ``write_pinned`` from memory
        that stays unchanged until the commit (a snapshot arena): a :class:`~.direct.DirectSink`
        from tuning.DIRECT_MIN_PINNED bytes on, where supported (no copy, no page cache),
        else what :meth:`create` gives."""
        pinned_min = tuning.DIRECT_MIN_PINNED
        if size is not None and pinned_min is not None and size >= pinned_min and direct_supported():
            return DirectSink(path, size)
        return self.create(path, size)

    def exists(self, path: str) -> bool:
        """True for a readable regular file (never blocks on a FIFO)."""
        try:
            os.close(open_regular(path))
        except (CheckpointError, OSError):
            return False
        return True
