"""The writer lock of a :class:`~.directory.DirectoryMetadataHandler`: taken for a run, proved
before each write, let go at its end.

On a local directory it is the lock file ``.epochal/lock`` (:mod:`epochal.checkpoint.location.lock`);
at a URL the fenced lease ``.epochal/lease.json`` (:mod:`epochal.checkpoint.location.lease`), renewed
in the background. While the lease is held the records are read through a cache
(:class:`~epochal.checkpoint.location.record_cache.CachedRecords`), so a commit costs a bounded
number of requests whatever the history.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..location.lock import LOCK_FILE
from ..location.record_cache import CachedRecords
from ..location.records import RecordLock
from ..location.view import CheckpointDirectory
from . import cleanup

logger = logging.getLogger("epochal")


class WriterLockHolder:
    """The lock part of the directory handler (a mixin: the handler sets ``_lock``,
    ``_lock_path``, ``lease_seconds``, ``clean_temp`` and ``_index`` and gives ``_dir()``)."""

    _lock: RecordLock | None
    _lock_path: str
    lease_seconds: float
    clean_temp: bool
    _index: Any
    directory: CheckpointDirectory | None

    def _dir(self) -> CheckpointDirectory:
        raise NotImplementedError

    def acquire_lock(self) -> None:
        """Take the directory's writer lock (``.epochal/lock``) for a run: JobRunner.train
        calls this right after ``set_params`` and :meth:`release_lock` when it ends. A second
        writer gets CheckpointLockedError naming the holder; see :mod:`.lock`. At a URL it is
        the lease ``.epochal/lease.json`` (see :mod:`.lease`), renewed in the background."""
        d = self._dir()
        path = os.path.join(d.records_dir, LOCK_FILE)
        if self._lock is not None and self._lock_path != path:
            self._lock.release()
            self._lock = None
        if self._lock is None:
            self._lock, self._lock_path = d.records.writer_lock(path, self.lease_seconds), path
            if hasattr(self._lock, "owner"):  # named in the refusal of a second lock in this process
                self._lock.owner = repr(self)
        d.records.makedirs(d.records_dir)
        self._lock.acquire()
        self._index = None  # read afresh under the lock: another writer may have held it
        if d.records.remote and not isinstance(d.records, CachedRecords):
            d.records = CachedRecords(d.records)  # the lease holder's: commits cost O(1) requests
        if d.records.remote and self.clean_temp:  # the holder alone may remove dead uploads
            try:
                cleanup.clean_temp_keys(d)
            except OSError as ex:
                logger.warning("Cannot remove leftover uploads at %s: %s", d.db_dir, ex)

    def release_lock(self) -> None:
        """Let the writer lock go (no-op when not held)."""
        if self._lock is not None:
            self._lock.release()
        if self.directory is not None and isinstance(self.directory.records, CachedRecords):
            self.directory.records = self.directory.records.inner  # trusted only while held

    def _fence(self) -> None:
        """Prove this job still holds the writer lock before it writes (renews a lease;
        CheckpointLockedError naming the new holder when another job took it over)."""
        if self._lock is not None:
            self._lock.fence()
