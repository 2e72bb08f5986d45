"""The writer lease of a checkpoint location on object storage: ``<url>/.epochal/lease.json``.

Object stores have no flock, and a holder may die without a word (its machine is gone), so
the lock is a lease: the object names its holder (host, pid, a random token), when it was
taken and when it expires. ``acquire`` creates it with a conditional write where the store
has one (S3 ``If-None-Match``), else create-if-absent then read back; a live lease of another
holder is :class:`~epochal.errors.CheckpointLockedError` naming it; an expired one is taken
over (with a warning). The holder renews it at each commit (``renew``) and deletes it when
the run ends (``release``). Choose ``seconds`` longer than the time between two commits.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from datetime import datetime, timezone
from typing import Any, Protocol

from ..errors import CheckpointLockedError
from ..storage import atomic

logger = logging.getLogger("epochal")

__all__ = ["DEFAULT_LEASE_SECONDS", "Lease"]

#: how long a lease lasts without a renewal (a commit renews it)
DEFAULT_LEASE_SECONDS = 3600.0


class _Objects(Protocol):
    def read(self, path: str) -> bytes: ...

    def write(self, path: str, data: bytes) -> None: ...

    def create_new(self, path: str, data: bytes) -> bool: ...

    def delete(self, path: str) -> bool: ...


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


class Lease:
    """The lease object at ``path`` in ``objects`` (a :class:`~.records.UrlRecords`)."""

    def __init__(self, objects: _Objects, path: str, seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.objects, self.path, self.seconds = objects, path, float(seconds)
        self.token = secrets.token_hex(8)
        self._since: float | None = None

    @property
    def held(self) -> bool:
        return self._since is not None

    def _body(self) -> bytes:
        now = time.time()
        since = self._since if self._since is not None else now
        return json.dumps({
            "host": atomic.hostname(), "pid": os.getpid(), "token": self.token,
            "since": _iso(since), "expires": _iso(now + self.seconds), "expires_at": now + self.seconds,
        }).encode("utf-8")

    def holder(self) -> dict[str, Any] | None:
        """What the lease object says now (None: no lease; {} when unreadable)."""
        try:
            raw = self.objects.read(self.path)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def acquire(self) -> None:
        """Take the lease, or raise CheckpointLockedError naming its live holder."""
        if self.held:
            self.renew()
            return
        for _ in range(3):
            current = self.holder()
            if current is None:
                self._since = time.time()
                if self.objects.create_new(self.path, self._body()):
                    if self._confirm():
                        return
                self._since = None
                continue
            if current.get("token") == self.token:
                self._since = time.time()
                return
            expires = current.get("expires_at")
            if isinstance(expires, (int, float)) and expires < time.time():
                logger.warning("Taking over the expired checkpoint lease %s (held by %s pid %s, expired %s)",
                               self.path, current.get("host"), current.get("pid"), current.get("expires"))
                self._since = time.time()
                self.objects.write(self.path, self._body())
                if self._confirm():
                    return
                self._since = None
                continue
            raise CheckpointLockedError(self.path, {k: v for k, v in current.items() if k != "token"})
        raise CheckpointLockedError(self.path, self.holder() or {"problem": "the lease keeps changing hands"})

    def _confirm(self) -> bool:
        """Read the lease back: ours (True), or a racing writer's (False)."""
        current = self.holder()
        return bool(current) and current.get("token") == self.token  # type: ignore[union-attr]

    def renew(self) -> None:
        """Push the expiry on (called at each commit); no-op when not held."""
        if self.held:
            self.objects.write(self.path, self._body())

    def release(self) -> None:
        """Delete the lease if it is still ours (never raises)."""
        if not self.held:
            return
        self._since = None
        try:
            current = self.holder()
            if current and current.get("token") == self.token:
                self.objects.delete(self.path)
        except Exception as ex:
            logger.warning("Cannot release the checkpoint lease %s: %s", self.path, ex)
