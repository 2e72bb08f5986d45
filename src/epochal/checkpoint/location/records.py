"""Where a checkpoint location's records (manifests, pins, stats, the writer lock) are read
and written: a local directory or an fsspec URL, behind one small interface.

:class:`~epochal.checkpoint.handler.directory.CheckpointDirectory` and
:class:`~epochal.checkpoint.handler.directory.DirectoryMetadataHandler` hold the commit, resume and
retention logic once; they reach files only through a :class:`RecordStore`, so the same
logic runs on a local disk (:class:`LocalRecords`: fsync, rename, flock, an appended stats
log) and on object storage (:class:`UrlRecords`: one PUT per record, which replaces the
object whole; one object per stats report, since objects cannot be appended to; a lease
object instead of flock).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from datetime import datetime, timezone
from typing import Any, Protocol

from ...storage.io import atomic
from ...storage.io.location import Location, location_for

__all__ = [
    "MAX_RECORD_BYTES",
    "STATS_DIR",
    "STATS_FILE",
    "LocalRecords",
    "RecordLock",
    "RecordStore",
    "UrlRecords",
    "read_local_record",
    "records_for",
]

#: records are small; anything bigger is not one of ours
MAX_RECORD_BYTES = 64 << 20
#: the appended stats log of a local directory
STATS_FILE = "stats.jsonl"
#: at a URL: one object per stats report under this folder of the records directory
STATS_DIR = "stats"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class RecordLock(Protocol):
    """The exclusive writer lock of one location (flock locally, a lease at a URL)."""

    def acquire(self) -> None: ...

    def renew(self) -> None: ...

    def fence(self) -> None:
        """Prove the lock is still held right before a write (CheckpointLockedError naming
        the new holder when it was taken over; a no-op for flock, held until the process ends)."""
        ...

    def release(self) -> None: ...


class RecordStore(Protocol):
    """The file operations the records logic needs (paths are the store's own: local paths
    or URLs)."""

    #: True for object storage (no fsync, no free-space check, no appends)
    remote: bool

    def read(self, path: str) -> bytes:
        """A record's bytes; FileNotFoundError when absent, OSError when it is not a regular
        file or too big for a record."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` atomically (a reader sees the old or the new whole)."""
        ...

    def delete(self, path: str) -> bool:
        """Remove ``path``; False when it was not there."""
        ...

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int:
        """Bytes of the file at ``path``; FileNotFoundError when absent."""
        ...

    def files(self, folder: str) -> list[tuple[str, str]]:
        """``(name, path)`` of the regular files directly in ``folder`` ([] when missing)."""
        ...

    def makedirs(self, folder: str) -> None: ...

    def sync_dir(self, folder: str) -> None:
        """Make renames and removals in ``folder`` durable (no-op on object storage)."""
        ...

    def add_stats(self, records_dir: str, data: bytes) -> str:
        """Record stats lines (JSON lines); return where they went."""
        ...

    def read_stats(self, records_dir: str) -> list[bytes]:
        """Every stats record's bytes, oldest first."""
        ...

    def writer_lock(self, path: str, seconds: float) -> RecordLock:
        """The writer lock whose file is ``path`` (a lease of ``seconds`` where it is one)."""
        ...


def read_local_record(path: str) -> bytes:
    """The bytes of a local record file, opened without following a symlink and only when it
    is a regular file (a FIFO would block, a device never end); OSError naming the path
    otherwise, FileNotFoundError when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError as ex:
        if ex.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symlink (records are never read through one)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if st.st_size > MAX_RECORD_BYTES:
            raise OSError(errno.EFBIG, f"{path} is {st.st_size} bytes, too big for a record")
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class LocalRecords:
    """Records in a local directory (temp file + fsync + rename + directory fsync)."""

    remote = False

    def read(self, path: str) -> bytes:
        return read_local_record(path)

    def write(self, path: str, data: bytes) -> None:
        try:
            atomic.atomic_write_bytes(path, data)
        except OSError as ex:
            if ex.filename is None:  # name the file that could not be written
                raise OSError(ex.errno, f"{ex.strerror or ex} (writing {path})") from ex
            raise

    def delete(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def files(self, folder: str) -> list[tuple[str, str]]:
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in entries:
            try:
                if entry.is_file():
                    out.append((entry.name, entry.path))
            except OSError:
                continue
        return out

    def makedirs(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)

    def sync_dir(self, folder: str) -> None:
        atomic.fsync_dir(folder)

    def add_stats(self, records_dir: str, data: bytes) -> str:
        """Append to ``stats.jsonl`` (never through a symlink; a torn last line stays alone)."""
        path = os.path.join(records_dir, STATS_FILE)
        os.makedirs(records_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            atomic.write_all(fd, data)
        finally:
            os.close(fd)
        return path

    def read_stats(self, records_dir: str) -> list[bytes]:
        try:
            return [read_local_record(os.path.join(records_dir, STATS_FILE))]
        except FileNotFoundError:
            return []

    def writer_lock(self, path: str, seconds: float) -> RecordLock:
        from .lock import WriterLock

        return WriterLock(path)


class UrlRecords:
    """Records at an fsspec URL: each write is one PUT of the whole object."""

    remote = True

    def __init__(self, location: Location | None = None) -> None:
        from ...storage.io.remote.fsspec_store import filesystem_for

        self._fs_for = filesystem_for
        #: the options every request carries (None: this process's defaults for each URL)
        self._options = (location.storage_options or None) if location is not None else None

    def _fs(self, url: str) -> tuple[Any, str]:
        return self._fs_for(url, self._options)

    def read(self, path: str) -> bytes:
        """One ranged GET (no HEAD first): at most one byte more than a record may hold."""
        fs, p = self._fs(path)
        try:
            data = bytes(fs.cat_file(p, start=0, end=MAX_RECORD_BYTES + 1))
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise OSError(errno.EINVAL, f"{path} is not a file") from None
        except OSError as ex:
            if ex.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, "no such record", path) from None
            if "range" not in str(ex).lower():
                raise
            data = bytes(fs.cat_file(p))  # an empty object has no byte range to ask for (HTTP 416)
        if len(data) > MAX_RECORD_BYTES:
            raise OSError(errno.EFBIG, f"{path} is more than {MAX_RECORD_BYTES} bytes, too big for a record")
        return data

    def write(self, path: str, data: bytes) -> None:
        fs, p = self._fs(path)
        try:
            fs.pipe_file(p, bytes(data))
        except OSError as ex:
            raise _named(ex, path) from ex
        fs.invalidate_cache(p.rsplit("/", 1)[0])

    def delete(self, path: str) -> bool:
        fs, p = self._fs(path)
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            return False
        finally:
            fs.invalidate_cache(p.rsplit("/", 1)[0])
        return True

    def exists(self, path: str) -> bool:
        fs, p = self._fs(path)
        fs.invalidate_cache(p)  # asked of the store, not of an earlier listing
        return bool(fs.isfile(p))

    def size(self, path: str) -> int:
        fs, p = self._fs(path)
        fs.invalidate_cache(p)
        return int(fs.info(p)["size"])

    def files(self, folder: str) -> list[tuple[str, str]]:
        return [(name, path) for name, path, _ in self.listing(folder)]

    def listing(self, folder: str) -> list[tuple[str, str, int | None]]:
        """``(name, path, size)`` of the objects directly in ``folder``: one listing (a LIST
        request per 1,000 objects on S3)."""
        fs, p = self._fs(folder)
        try:
            entries = fs.ls(p, detail=True, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        base = folder.rstrip("/")
        for entry in entries:
            if entry.get("type") != "file":
                continue
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            size = entry.get("size")
            out.append((name, f"{base}/{name}" if folder else name, int(size) if size is not None else None))
        return out

    def abort_uploads(self, folder: str) -> list[str]:
        """Abort the multipart uploads in progress in ``folder`` (S3; see
        :func:`~epochal.storage.io.remote.fsspec_store.abort_uploads`); the URLs they were for."""
        from ...storage.io.remote.fsspec_store import abort_uploads

        return abort_uploads(folder, self._options)

    def makedirs(self, folder: str) -> None:
        return None  # object stores have no folders to make

    def sync_dir(self, folder: str) -> None:
        return None

    def add_stats(self, records_dir: str, data: bytes) -> str:
        """One new object per report: ``stats/<utc time>.<token>.jsonl`` (sortable by time)."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        path = f"{records_dir.rstrip('/')}/{STATS_DIR}/{stamp}.{secrets.token_hex(4)}.jsonl"
        self.write(path, data)
        return path

    def read_stats(self, records_dir: str) -> list[bytes]:
        folder = f"{records_dir.rstrip('/')}/{STATS_DIR}"
        out = []
        for name, path in sorted(self.files(folder)):
            if name.endswith(".jsonl"):
                try:
                    out.append(self.read(path))
                except FileNotFoundError:  # deleted since the listing
                    continue
        return out

    def writer_lock(self, path: str, seconds: float) -> RecordLock:
        from ...storage.io.remote.conditional import conditional_for
        from .lease import Lease

        lease_path = path.rsplit("/", 1)[0] + "/lease.json"
        return Lease(conditional_for(lease_path, self._options), lease_path, seconds)


def _named(ex: OSError, path: str) -> OSError:
    """``ex`` as an error naming the URL written (a missing bucket is CheckpointNotFoundError)."""
    from ...errors import CheckpointNotFoundError

    text = f"cannot write {path}: {ex.strerror or ex}"
    if isinstance(ex, FileNotFoundError):
        return CheckpointNotFoundError(text + " (does the bucket exist?)")
    return OSError(ex.errno, text)


def records_for(location: Location | str, storage_options: dict[str, Any] | None = None) -> RecordStore:
    """The record store of ``location`` (a :class:`~epochal.storage.io.location.Location`, or
    a local directory or URL with ``storage_options``). At a URL its requests carry the
    location's options, which are also remembered as this process's default for the URL
    (:meth:`~epochal.storage.io.location.Location.remember`: the dbs the handler reads by
    path, and tools built without options, reach it as before)."""
    loc = location_for(location, storage_options)
    if loc.is_local:
        return LocalRecords()
    loc.remember()
    return UrlRecords(loc)
