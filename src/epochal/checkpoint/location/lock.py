"""One writer per checkpoint directory: an exclusive lock in its records directory.

Two runners on one directory would mix their histories (one's retention deleting the other's
epochs, one overwriting a db the other committed). :class:`WriterLock` is held by
``DirectoryMetadataHandler`` for a whole ``JobRunner.train``; a second writer fails at once
with :class:`~epochal.errors.CheckpointLockedError` naming the holder (host, pid, since when).

The lock is ``flock`` on ``.epochal/lock``: the kernel drops it when its holder dies, however
it dies (kill -9 included), so a dead holder's lock is simply taken over; the file's content
(who holds it) is for messages. A flock belongs to the open file, which a forked child (a
DataLoader worker) shares: so every child forked through ``os.fork`` closes its copy at once
(``os.register_at_fork``), and the lock dies with its holder, not with its last worker. Should
a child forked another way (C code) still hold it after its parent died, the holder record
decides: a holder on this host whose process is gone is taken over (a fresh lock file renamed
into place). Where the filesystem has no ``flock``, the content decides the same way; a
holder on another host is never taken over (its process may be alive) and the message says
which file to remove once that host is gone. A second lock of the same file in the same
process is refused at once, naming the object holding it and where it was taken (not
"another job"). Read-only tools never take the lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
import weakref
from datetime import datetime, timezone
from typing import Any

from ...errors import CheckpointLockedError
from ...storage.io import atomic
from ...storage.io.atomic import pid_alive  # noqa: F401 - its home was here

logger = logging.getLogger("epochal")

LOCK_FILE = "lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


# every WriterLock held in this process, by the (device, inode) of its file
_HELD: dict[tuple[int, int], WriterLock] = {}
_HELD_LOCK = threading.Lock()
_ALL: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _close_in_child() -> None:
    """In a child just forked: close every inherited lock fd (a flock is the open file's, so
    the child would hold its parent's lock for as long as it lives)."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # another thread may have held it at the fork
    for lock in list(_ALL):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)  # drops the child's reference only: the parent keeps its lock
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _caller() -> str:
    """``file:line`` of the first frame outside epochal (where the user took the lock)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not os.path.abspath(name).startswith(here):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class WriterLock:
    """The exclusive writer lock at ``path`` (``.epochal/lock``). ``acquire`` / ``release``;
    re-entrant within one holder (a second ``acquire`` by the same object is a no-op).
    ``owner``: what holds it, for the message a second lock in this process gets."""

    def __init__(self, path: str, owner: str | None = None) -> None:
        self.path = path
        self.owner = owner
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._taken_at = ""
        self._since = ""
        _ALL.add(self)

    def __repr__(self) -> str:
        return f"WriterLock({self.path!r})"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _read_holder(self, fd: int) -> dict[str, Any]:
        try:
            raw = os.pread(fd, 4096, 0)
            data = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (OSError, UnicodeDecodeError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _refuse_if_held_here(self) -> None:
        """CheckpointLockedError when another WriterLock of this process holds this file."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        other = _HELD.get((st.st_dev, st.st_ino))
        if other is not None and other is not self:
            by = other.owner or repr(other)
            raise CheckpointLockedError(self.path, {"host": atomic.hostname(), "pid": os.getpid(),
                                                    "since": other._since}, by=f"{by}, taken at {other._taken_at}")

    def acquire(self) -> None:
        """Take the lock or raise CheckpointLockedError naming its live holder."""
        if self._fd is not None:
            return
        with _HELD_LOCK:
            self._refuse_if_held_here()
            fd = self._open(self.path)
            try:
                fd = self._lock(fd)
                self._since = datetime.now(timezone.utc).isoformat(timespec="seconds")
                self._write_record(fd)
            except BaseException:
                os.close(fd)
                raise
            st = os.fstat(fd)
            self._fd, self._key, self._taken_at = fd, (st.st_dev, st.st_ino), _caller()
            _HELD[self._key] = self

    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(path, flags, 0o644)
        except OSError as ex:
            if ex.errno == errno.ELOOP:
                raise CheckpointLockedError(self.path, {"problem": "the lock file is a symlink"}) from None
            raise

    def _write_record(self, fd: int) -> None:
        me = {
            "host": atomic.hostname(), "pid": os.getpid(), "since": self._since,
            "monotonic_start": time.monotonic(),
        }
        os.ftruncate(fd, 0)
        atomic.write_all(fd, json.dumps(me).encode("utf-8"))

    def _lock(self, fd: int) -> int:
        """Lock ``fd`` (or a fresh lock file that replaced it: its fd is returned)."""
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                holder = self._read_holder(fd)
                if not self._dead_here(holder):
                    raise CheckpointLockedError(self.path, holder) from None
                # its holder is gone, yet the flock is held: by children it forked without
                # os.fork's hooks (they outlive it). A fresh lock file takes the name.
                logger.warning("Taking over the lock %s: its holder (pid %s) is gone, the processes it forked "
                               "still hold the old lock file", self.path, holder.get("pid"))
                return self._replace(fd)
            except OSError as ex:
                if ex.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                logger.debug("%s: no flock here (%s): the lock file's content decides", self.path, ex)
        holder = self._read_holder(fd)
        if not holder:
            return fd
        if self._dead_here(holder) or (holder.get("host") == atomic.hostname() and holder.get("pid") == os.getpid()):
            logger.info("Taking over the lock %s of a process that is gone (pid %s)", self.path, holder.get("pid"))
            return fd
        raise CheckpointLockedError(self.path, holder)

    @staticmethod
    def _dead_here(holder: dict[str, Any]) -> bool:
        pid = holder.get("pid")
        return (holder.get("host") == atomic.hostname() and isinstance(pid, int) and not isinstance(pid, bool)
                and pid != os.getpid() and not pid_alive(pid))

    def _replace(self, old_fd: int) -> int:
        """A new lock file, flocked, renamed over ``path`` (the orphans keep the old one); then
        checked to be the file at ``path`` (another taker may have renamed after us)."""
        assert fcntl is not None
        tmp = atomic.temp_path_for(self.path)
        fd = self._open(tmp)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, self.path)
            if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                raise CheckpointLockedError(self.path, {"problem": "another process took it over at the same time"})
        except BaseException:
            os.close(fd)
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        os.close(old_fd)
        return fd

    def renew(self) -> None:
        """A flock lasts as long as its process: nothing to renew (a lease's counterpart)."""
        return None

    def fence(self) -> None:
        """A held flock cannot be taken over: nothing to prove (a lease's counterpart)."""
        return None

    def release(self) -> None:
        """Let the lock go (the file stays, emptied: removing it could race a new holder)."""
        with _HELD_LOCK:
            fd, self._fd = self._fd, None
            if self._key is not None and _HELD.get(self._key) is self:
                del _HELD[self._key]
            self._key = None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing drops the flock
