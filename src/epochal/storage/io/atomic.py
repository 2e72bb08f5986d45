"""Durable, atomic file writing, shared by every db backend and by manifests.

A file is written under a temporary name in the same directory
(``f"{final_path}.tmp.{hostname}.{pid}.{token}"``), fsynced, renamed over the final name and
the directory is fsynced. A crash therefore leaves either the old file or the new one under
the final name, never a partial one; at worst a temp file is left behind, and
:func:`parse_temp_path` tells a cleaner whose it is (host and pid) so it can be removed once
that process is gone.

All data goes through the module-level :func:`write_all` and :func:`fsync`, looked up at call
time (``atomic.write_all(...)``), so tests can monkeypatch them to inject ENOSPC or EIO.

Write-behind: :meth:`AtomicFile.write` asks the kernel (Linux ``sync_file_range``) to start
writing each :data:`WRITE_BEHIND` bytes to disk as soon as they are written, so the disk works
while later blobs are still being copied into the page cache, instead of all at the final
fsync. It only moves work earlier: durability still comes from the fsync at commit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import socket
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

#: the most buffers handed to one ``writev`` (Linux IOV_MAX is 1024)
IOV_MAX = 1024

_TEMP_RE = re.compile(r"^(?P<final>.+)\.tmp\.(?P<host>[^/]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]{8})$")


def hostname() -> str:
    """This machine's host name as it appears in temp file names ("/" cannot appear)."""
    return socket.gethostname().replace("/", "_") or "localhost"


def temp_path_for(path: str | os.PathLike[str]) -> str:
    """A fresh temp name next to ``path``: ``{path}.tmp.{hostname}.{pid}.{8 hex digits}``."""
    return f"{os.fspath(path)}.tmp.{hostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this machine (zombies count as alive)."""
    if pid <= 0:
        return True  # never treat a nonsense pid as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def parse_temp_path(path: str | os.PathLike[str]) -> tuple[str, str, int] | None:
    """``(final_path, host, pid)`` of a name made by :func:`temp_path_for`, else None."""
    m = _TEMP_RE.match(os.fspath(path))
    if m is None:
        return None
    return m.group("final"), m.group("host"), int(m.group("pid"))


def write_all(fd: int, buffer: Any) -> int:
    """Write all of ``buffer`` to ``fd`` at its current position; return the bytes written.

    ``buffer`` is one bytes-like object, or a sequence of them written in order with
    ``writev`` (at most :data:`IOV_MAX` per call) so that many small segments need few system
    calls and no copy. Short writes are continued; errors (ENOSPC, EIO...) propagate."""
    if isinstance(buffer, (list, tuple)):
        return _writev_all(fd, buffer)
    view = memoryview(buffer).cast("B")
    total = view.nbytes
    done = 0
    while done < total:
        n = os.write(fd, view[done:])
        if n <= 0:  # pragma: no cover - regular files do not return 0
            raise OSError(errno.EIO, "write returned 0")
        done += n
    return total


def _writev_all(fd: int, buffers: Sequence[Any]) -> int:
    total = 0
    for start in range(0, len(buffers), IOV_MAX):
        batch = list(buffers[start : start + IOV_MAX])
        want = sum(memoryview(b).nbytes for b in batch)
        n = os.writev(fd, batch)
        total += want
        if n != want:  # short write: continue the rest byte-exactly (rare)
            rest = b"".join(bytes(memoryview(b).cast("B")) for b in batch)
            write_all(fd, memoryview(rest)[n:])
    return total


def fsync(fd: int) -> None:
    """Flush ``fd``'s data and metadata to stable storage (``os.fsync``)."""
    os.fsync(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """:func:`fsync` a file by name (one another writer or library closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or create in it is durable (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(directory) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # e.g. Windows cannot open directories
    try:
        fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def check_free_space(path: str | os.PathLike[str], nbytes: int) -> None:
    """Raise OSError(ENOSPC) naming ``path`` when its filesystem has less than ``nbytes`` free
    for unprivileged users (``statvfs``); silently passes where statvfs is unavailable."""
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"not enough free space to write {nbytes} bytes ({free} free)",
            os.fspath(path),
        )


#: files at least this big first drop the cached pages of the file they will replace
RECYCLE_MIN = 64 << 20


def drop_cached(path: str) -> None:
    """Drop the page-cache pages of the (clean, already durable) file at ``path``, if any.

    Called before a big file is rewritten under the same name: the old file's cache would be
    freed at the rename anyway, and freeing it first lets the kernel hand those pages
    straight to the new file's writes instead of taking never-touched ones (on a VM with
    free-page reporting, each first touch is a host page fault: writes ran up to 10x slower).
    The old file itself is untouched (it is still there, intact, until the rename). A hint:
    every error is ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


#: AtomicFile.write starts the disk writing every this many bytes (0 turns it off)
WRITE_BEHIND = 8 << 20

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - Linux-only syscall
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - musl without it, odd libcs
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Start writing ``fd``'s dirty pages in ``[offset, offset + nbytes)`` to disk without
    waiting for them (``SYNC_FILE_RANGE_WRITE``); False where unsupported. A hint: it makes
    nothing durable (that is fsync's job) and a failure here is reported by the fsync."""
    if _SFR is None:
        return False
    return int(_SFR(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)) == 0


class AtomicFile:
    """An open temp file that becomes ``path`` on a clean exit, durably.

    ``with AtomicFile(path, size=n) as f: atomic.write_all(f.fd, data)``. On entry the
    directory must exist (else FileNotFoundError) and have room for ``size`` bytes (else
    OSError(ENOSPC) naming the file). On a clean exit the temp file is fsynced, renamed to
    ``path`` and the directory fsynced; on any exception the temp file is removed and the
    exception propagates."""

    def __init__(self, path: str | os.PathLike[str], size: int | None = None, mode: int = 0o644) -> None:
        self.path = os.fspath(path)
        self.size = size
        self.mode = mode
        self.temp_path = temp_path_for(self.path)
        self.fd = -1
        self.position = 0  # bytes written by write(), from the start of the file
        self._kicked = 0  # writeback started up to here
        self._write_behind = WRITE_BEHIND > 0 and _SFR is not None

    def __enter__(self) -> AtomicFile:
        if self.size is not None:
            directory = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(directory):
                raise FileNotFoundError(errno.ENOENT, "directory does not exist", directory)
            check_free_space(self.path, self.size)
        if self.size is not None and self.size >= RECYCLE_MIN:
            drop_cached(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(self.temp_path, flags, self.mode)
        return self

    def _named(self, e: OSError) -> OSError:
        """``e`` naming this file (ENOSPC from a write or an fsync names no file)."""
        if e.filename or e.errno is None:
            return e
        return type(e)(e.errno, e.strerror or str(e), self.path)

    def write(self, buffer: Any) -> int:
        """Append ``buffer`` (see :func:`write_all`) and start the disk writing each
        :data:`WRITE_BEHIND` bytes written; return the bytes written. An OSError names the file."""
        try:
            n = write_all(self.fd, buffer)
        except OSError as e:
            raise self._named(e) from None
        self.position += n
        if self._write_behind and self.position - self._kicked >= WRITE_BEHIND:
            if not start_writeback(self.fd, self._kicked, self.position - self._kicked):
                self._write_behind = False  # e.g. a filesystem that refuses it
            self._kicked = self.position
        return n

    def seek(self, offset: int) -> None:
        """Move the write position to ``offset`` (e.g. to fill in a header at the end)."""
        os.lseek(self.fd, offset, os.SEEK_SET)
        self.position = self._kicked = offset

    def commit(self) -> None:
        """fsync, close, rename into place, fsync the directory (an OSError names the file)."""
        try:
            fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.temp_path, self.path)
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            raise self._named(e) from None

    def abort(self) -> None:
        """Close and remove the temp file, ignoring errors (the original error matters)."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        try:
            os.unlink(self.temp_path)
        except OSError:
            pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> int:
    """Write ``data`` to ``path`` atomically and durably (for small files such as manifests);
    return the bytes written."""
    with AtomicFile(path, size=memoryview(data).nbytes) as f:
        return f.write(data)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc``), else by
    setting and restoring it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_regular_output(path: str | os.PathLike[str]) -> None:
    """Refuse an output path that exists and is not a regular file (a FIFO would block the
    writer forever, a device never end, a directory or socket cannot be replaced): OSError
    naming it. A missing path, or a regular file (replaced whole), is fine."""
    import stat as _stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not _stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if _stat.S_ISFIFO(st.st_mode) else "a directory" if _stat.S_ISDIR(st.st_mode)
                else "a socket" if _stat.S_ISSOCK(st.st_mode) else "a device or special file")
        raise OSError(errno.EINVAL, f"is {kind}, not a regular file: output is written to regular files only",
                      os.fspath(path))


def write_via_temp(target: str | os.PathLike[str], write: Any, mode: int = 0o644) -> None:
    """Replace ``target`` with what ``write(temp_path)`` writes to a temp file beside it (a
    library's own file writer): the temp file gets ``mode`` (less the umask, as every file
    epochal writes), is fsynced and renamed into place, then the directory fsynced. On any
    failure the temp file is removed and ``target`` (an earlier output) is left as it was.
    ``target`` must be a regular file or absent (:func:`check_regular_output`)."""
    check_regular_output(target)
    tmp = temp_path_for(target)
    try:
        write(tmp)
        os.chmod(tmp, mode & ~umask())
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
