"""Keeping a remote mirror in step with a checkpoint directory: the handler's side of
``DirectoryMetadataHandler(mirror=URL)``. Pushes of committed epochs (dbs then manifest, or
only the manifest when the nodes pushed their own dbs) run in order on one background thread
(or inline), a failed push is retried after the next commit, retention runs on the mirror's
own list of epochs, and a newer remote epoch is pulled (verified) before a resume. The
transfers themselves are :class:`~epochal.checkpoint.mirroring.mirror.RemoteMirror`'s.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

from ...errors import CheckpointError
from ..location.manifest import Manifest
from ..location.retention import RetentionPolicy, epochs_to_delete
from ..location.view import CheckpointDirectory

logger = logging.getLogger("epochal")

__all__ = ["EXIT_FLUSH", "ExitFlush", "MirrorSync"]


class ExitFlush:
    """The process's one ``atexit`` hook for background mirrors: at exit it flushes every
    handler registered here that is still alive, so pushes queued before the interpreter
    stops reach the mirror. Handlers are held by weak reference: a handler collected before
    exit is forgotten (no per-handler hook keeps it, and its state, alive for good)."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hooked = False

    def add(self, handler: Any) -> None:
        """Flush ``handler`` (anything with ``flush()``) at exit while it lives."""
        with self._lock:
            self._live.add(handler)
            if not self._hooked:
                atexit.register(self.flush_all)
                self._hooked = True

    def live(self) -> list[Any]:
        """The handlers registered and not yet collected."""
        with self._lock:
            return list(self._live)

    def flush_all(self) -> None:
        """Flush every live handler; one that fails is logged and the others still run."""
        for handler in self.live():
            try:
                handler.flush()
            except Exception as ex:  # noqa: BLE001 - at exit: flush the others too
                logger.warning("Cannot flush the mirror pushes of %r at exit: %s", handler, ex)


#: the registry of this process
EXIT_FLUSH = ExitFlush()


class MirrorSync:
    """Mixin of :class:`~epochal.checkpoint.handler.directory.DirectoryMetadataHandler`: the mirror
    work, on the handler's state (declared here; the handler sets it in ``__init__``)."""

    mirror: Any
    mirror_background: bool
    policy: RetentionPolicy
    db_type: str
    node_names: list[str]
    _unpushed: set[int]  # committed here, not yet at the mirror (worker-owned)
    _node_pushed: set[int]  # epochs whose dbs the nodes uploaded themselves
    _mirror_queue: Any
    _rejected: set[int]  # epochs whose load failed its checks in this run

    def _dir(self) -> CheckpointDirectory:
        raise NotImplementedError

    def _metrics(self, epochs: Any) -> dict[int, Any] | None:
        raise NotImplementedError

    def flush(self) -> None:
        """Wait for the mirror pushes in flight (no-op without a background mirror)."""
        if self._mirror_queue is not None:
            self._mirror_queue.flush()

    def _mirror_call(self, fn: Any, *args: Any) -> None:
        """Run mirror work now, or queue it on the background thread."""
        if not self.mirror_background:
            fn(*args)
            return
        if self._mirror_queue is None:
            from .mirror import MirrorQueue

            self._mirror_queue = MirrorQueue()
            EXIT_FLUSH.add(self)
        self._mirror_queue.submit(lambda: fn(*args))

    def _push_final(self, epoch: int) -> None:
        """Re-push the manifest of ``epoch`` now marked final (if the epoch is pushed)."""
        assert self.mirror is not None
        if epoch in self._unpushed:
            return  # its push, retried later, reads the manifest then
        try:
            self.mirror.put_manifest(epoch, self._dir().read_manifest(epoch))
        except Exception as ex:
            logger.warning("Cannot mark epoch %d final at %s: %s", epoch, self.mirror.url, ex)

    def _pull(self, epoch: int) -> bool:
        """Download and commit ``epoch`` from the mirror; False (with a warning) on failure."""
        d = self._dir()
        assert self.mirror is not None
        try:
            self.mirror.pull(d.db_dir, d.records_dir, epoch, self.db_type, self.node_names or None)
        except Exception as ex:  # network, permissions, damage: the local state decides
            logger.warning("Cannot restore epoch %d from %s: %s", epoch, self.mirror.url, ex)
            return False
        logger.info("Restored epoch %d from %s into %s", epoch, self.mirror.url, d.db_dir)
        return True

    def _newest_from_mirror(self, local: int | None) -> int | None:
        """The newest remote epoch newer than ``local`` that could be restored, else None."""
        assert self.mirror is not None
        try:
            remote = self.mirror.epochs()
        except Exception as ex:
            logger.warning("Cannot list the checkpoints at %s: %s", self.mirror.url, ex)
            return None
        for epoch in reversed(remote):
            if local is not None and epoch <= local:
                break
            if epoch in self._rejected:  # its load failed in this run (see reject_epoch)
                continue
            if self._pull(epoch):
                return epoch
        return None

    def _push(self, epoch: int, manifest: Manifest) -> None:
        """Push ``epoch`` (and earlier epochs whose push failed) to the mirror; never raises."""
        d = self._dir()
        assert self.mirror is not None
        for e in sorted(self._unpushed | {epoch}):
            try:
                m = manifest if e == epoch else d.read_manifest(e)
            except CheckpointError:
                self._unpushed.discard(e)  # no longer committed here (retention)
                continue
            try:
                if e in self._node_pushed:  # each node uploaded its own db: the manifest, last
                    self.mirror.put_manifest(e, m)
                else:
                    self.mirror.push(d.db_dir, e, m)
                self._node_pushed.discard(e)
            except Exception as ex:
                self._unpushed.add(e)
                logger.warning(
                    "Cannot mirror epoch %d to %s (it stays committed locally; retried after the next commit): %s",
                    e, self.mirror.url, ex,
                )
            else:
                self._unpushed.discard(e)
        if epoch not in self._unpushed and not self.policy.keeps_everything:
            try:
                self._mirror_retention(epoch)
            except Exception as ex:
                logger.warning("Retention at %s failed: %s", self.mirror.url, ex)

    def _mirror_retention(self, newest: int) -> None:
        """Apply the retention policy to the mirror's own list of epochs (it may hold epochs
        that this directory never had, pushed from a machine since lost)."""
        assert self.mirror is not None
        remote = self.mirror.epochs()
        newer = {e for e in remote if e > newest}
        metrics = self._metrics(self._dir().committed_epochs())
        for epoch in epochs_to_delete(remote, newest, self._dir().pins(), self.policy, protect=newer, metrics=metrics):
            self.mirror.delete(epoch)
            logger.info("Retention: deleted the checkpoint of epoch %d at %s", epoch, self.mirror.url)
