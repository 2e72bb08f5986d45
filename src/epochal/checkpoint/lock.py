"""One writer per checkpoint directory: an exclusive lock in its records directory.

Two runners on one directory would mix their histories (one's retention deleting the other's
epochs, one overwriting a db the other committed). :class:`WriterLock` is held by
``DirectoryMetadataHandler`` for a whole ``JobRunner.train``; a second writer fails at once
with :class:`~epochal.errors.CheckpointLockedError` naming the holder (host, pid, since when).

The lock is ``flock`` on ``.epochal/lock``: the kernel drops it when its holder dies, however
it dies (kill -9 included), so a dead holder's lock is simply taken over; the file's content
(who holds it) is for messages. Where the filesystem has no ``flock``, the content decides: a
holder on this host whose process is gone is taken over; one on another host is not (its
process may be alive) and the message says which file to remove once that host is gone.
Read-only tools never take the lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from datetime import datetime, timezone
from typing import Any

from ..errors import CheckpointLockedError
from ..storage import atomic
from ..storage.atomic import pid_alive  # noqa: F401 - its home was here

logger = logging.getLogger("epochal")

LOCK_FILE = "lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


class WriterLock:
    """The exclusive writer lock at ``path`` (``.epochal/lock``). ``acquire`` / ``release``;
    re-entrant within one holder (a second ``acquire`` by the same object is a no-op)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

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

    def acquire(self) -> None:
        """Take the lock or raise CheckpointLockedError naming its live holder."""
        if self._fd is not None:
            return
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as ex:
            if ex.errno == errno.ELOOP:
                raise CheckpointLockedError(self.path, {"problem": "the lock file is a symlink"}) from None
            raise
        try:
            self._lock(fd)
            me = {
                "host": atomic.hostname(), "pid": os.getpid(),
                "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "monotonic_start": time.monotonic(),
            }
            raw = json.dumps(me).encode("utf-8")
            os.ftruncate(fd, 0)
            atomic.write_all(fd, raw)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _lock(self, fd: int) -> None:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                raise CheckpointLockedError(self.path, self._read_holder(fd)) from None
            except OSError as ex:
                if ex.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                logger.debug("%s: no flock here (%s): the lock file's content decides", self.path, ex)
        holder = self._read_holder(fd)
        if not holder:
            return
        host, pid = holder.get("host"), holder.get("pid")
        if host == atomic.hostname() and isinstance(pid, int):
            if pid == os.getpid() or not pid_alive(pid):
                logger.info("Taking over the lock %s of a process that is gone (pid %s)", self.path, pid)
                return
        raise CheckpointLockedError(self.path, holder)

    def renew(self) -> None:
        """A flock lasts as long as its process: nothing to renew (a lease's counterpart)."""
        return None

    def fence(self) -> None:
        """A held flock cannot be taken over: nothing to prove (a lease's counterpart)."""
        return None

    def release(self) -> None:
        """Let the lock go (the file stays, emptied: removing it could race a new holder)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing drops the flock
