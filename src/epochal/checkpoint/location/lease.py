"""The writer lease of a checkpoint location on object storage: ``<url>/.epochal/lease.json``.

Object stores have no flock, and a holder may die without a word (its machine is gone), so
the lock is a *fenced* lease. The object names its holder (host, pid, a random token), a
``generation`` (one more than the lease it replaced) and when it expires. Every change to it
is a compare-and-swap on the version the holder last wrote
(:mod:`epochal.storage.io.remote.conditional`: S3 ``If-None-Match: *`` / ``If-Match: <etag>``,
GCS ``ifGenerationMatch=0`` / ``ifGenerationMatch=<generation>``, checked by the store):

* ``acquire`` creates it only if absent; a live lease of another holder is
  :class:`~epochal.errors.CheckpointLockedError` naming it; an expired one, one whose holder
  is a dead process of this host, or one that is unreadable (not JSON, no expiry: a warning
  names it) is replaced only if it is still the version read, so of two takers exactly one
  wins.
* ``fence`` (before every commit, and before every save) renews it only if it is still the
  version this holder wrote: a holder whose lease was taken over learns it there, before it
  writes anything, as ``CheckpointLockedError`` naming the new holder, and from then on it
  never writes again (``renew`` never takes a lease back).
* a daemon thread owned by the lease renews it every ``seconds / 3`` while it is held, so a
  short lease (``DEFAULT_LEASE_SECONDS``) lets another host take over soon after a holder
  dies, whatever the time between commits.
* ``release`` stops that thread and deletes the object only if it is still this holder's.

On stores without conditional writes (neither S3 nor GCS) the same steps run as read-compare-write with a read
back after each write (see docs/remote.md: exactly what is and is not guaranteed there).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
import weakref
from datetime import datetime, timezone
from typing import Any, Protocol

from ...errors import CheckpointLockedError
from ...storage.io import atomic
from .lock import pid_alive

logger = logging.getLogger("epochal")

__all__ = ["DEFAULT_LEASE_SECONDS", "Lease", "LeaseState", "read_lease"]

#: how long a lease lasts without a renewal (renewed every third of it while held)
DEFAULT_LEASE_SECONDS = 60.0


class _Versioned(Protocol):
    @property
    def data(self) -> bytes: ...

    @property
    def version(self) -> str: ...


class _Conditional(Protocol):
    """Compare-and-swap on objects (:class:`epochal.storage.io.remote.conditional.ConditionalObjects`)."""

    atomic: bool

    def get(self, url: str) -> _Versioned | None: ...

    def create(self, url: str, data: bytes) -> str | None: ...

    def replace(self, url: str, data: bytes, version: str) -> str | None: ...

    def delete(self, url: str, version: str) -> bool: ...


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


class LeaseState:
    """What a lease object says: ``holder`` (its JSON, without the token) and why it may be
    taken (``free``: None when it is live and held by a live process)."""

    def __init__(self, raw: bytes, path: str, now: float) -> None:
        self.body: dict[str, Any] = {}
        self.problem: str | None = None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            data = None
        if not isinstance(data, dict):
            self.problem = "it is not a JSON object"
        else:
            self.body = data
            expires = data.get("expires_at")
            if not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires):
                self.problem = "it has no expiry"
        self.token = self.body.get("token")
        gen = self.body.get("generation")
        self.generation = gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0
        self.holder = {k: v for k, v in self.body.items() if k != "token"}
        self.free: str | None = None
        if self.problem is not None:
            self.free = f"it is unreadable ({self.problem}), so treated as expired"
        elif float(self.body["expires_at"]) < now:
            self.free = f"it expired at {self.body.get('expires')}"
        else:
            pid = self.body.get("pid")
            if (self.body.get("host") == atomic.hostname() and isinstance(pid, int)
                    and pid != os.getpid() and not pid_alive(pid)):
                self.free = f"its holder, pid {pid} of this host, is gone"


def read_lease(objects: _Conditional, path: str) -> LeaseState | None:
    """The lease at ``path`` now (None: there is none)."""
    got = objects.get(path)
    return None if got is None else LeaseState(got.data, path, time.time())


class Lease:
    """The fenced lease at ``path`` (see the module doc). ``seconds``: how long it lasts
    unrenewed; ``renew_every``: the background renewal period (default ``seconds / 3``)."""

    def __init__(self, objects: _Conditional, path: str, seconds: float = DEFAULT_LEASE_SECONDS,
                 renew_every: float | None = None) -> None:
        self.objects, self.path, self.seconds = objects, path, float(seconds)
        self.renew_every = float(renew_every) if renew_every is not None else max(self.seconds / 3, 0.01)
        self.token = secrets.token_hex(8)
        self.generation = 0
        self._version: str | None = None  # what we last wrote (None: not held)
        self._since: float | None = None
        self._lost: dict[str, Any] | None = None  # the holder that took it from us
        self._mutex = threading.Lock()  # one conditional write at a time (the thread, commits)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._version is not None

    @property
    def lost(self) -> dict[str, Any] | None:
        """The holder that took the lease over from this one (None: not lost)."""
        return self._lost

    def _body(self) -> bytes:
        now = time.time()
        since = self._since if self._since is not None else now
        return json.dumps({
            "host": atomic.hostname(), "pid": os.getpid(), "token": self.token,
            "generation": self.generation, "since": _iso(since), "expires": _iso(now + self.seconds),
            "expires_at": now + self.seconds, "seconds": self.seconds,
        }).encode("utf-8")

    def holder(self) -> dict[str, Any] | None:
        """What the lease object says now (None: no lease; {} when unreadable)."""
        state = read_lease(self.objects, self.path)
        return None if state is None else state.holder

    # -- taking it
    def acquire(self) -> None:
        """Take the lease, or raise CheckpointLockedError naming its live holder."""
        if self.held:
            self.fence()
            return
        self._lost = None  # a new attempt (say a second train() after losing it): by the rules below
        for _ in range(5):
            got = self.objects.get(self.path)
            if got is None:
                self.generation, self._since = 1, time.time()
                version = self.objects.create(self.path, self._body())
            else:
                state = LeaseState(got.data, self.path, time.time())
                if state.token == self.token:  # ours, left by a release that could not delete it
                    state.free = "it is this holder's own"
                if state.free is None:
                    raise CheckpointLockedError(self.path, state.holder)
                logger.warning("Taking over the expired checkpoint lease %s: %s (held by %s pid %s, generation %d)",
                               self.path, state.free, state.body.get("host"), state.body.get("pid"),
                               state.generation)
                self.generation, self._since = state.generation + 1, time.time()
                version = self.objects.replace(self.path, self._body(), got.version)
            if version is not None and self._confirm(version):
                self._version = version
                self._start_renewal()
                return
            self._since = None  # another taker won this round: look again
        last = read_lease(self.objects, self.path)
        raise CheckpointLockedError(self.path, last.holder if last else {"problem": "the lease keeps changing hands"})

    def _confirm(self, version: str) -> bool:
        """Where the store's writes are not compare-and-swap, read the lease back: still ours?"""
        if self.objects.atomic:
            return True
        got = self.objects.get(self.path)
        return got is not None and got.version == version and LeaseState(got.data, self.path, 0).token == self.token

    # -- keeping it
    def fence(self) -> None:
        """Prove the lease is still this holder's, right before a write, and renew it: a
        compare-and-swap on the version last written. CheckpointLockedError naming the new
        holder when another job took it over (and from then on, always)."""
        if self._lost is not None:
            raise CheckpointLockedError(self.path, self._lost)
        if not self.held:
            return
        with self._mutex:
            self._swap()
        if self._lost is not None:
            raise CheckpointLockedError(self.path, self._lost)

    def renew(self) -> None:
        """Push the expiry on (the renewal thread's step; no-op when not held); never takes a
        lease another job holds: a lost lease is recorded and raised at the next ``fence``."""
        if not self.held:
            return
        with self._mutex:
            self._swap()

    def _swap(self) -> None:
        assert self._version is not None
        version = self.objects.replace(self.path, self._body(), self._version)
        if version is not None and self._confirm(version):
            self._version = version
            return
        state = read_lease(self.objects, self.path)
        self._lost = state.holder if state is not None else {"problem": "the lease was deleted by another job"}
        self._version = None
        self._stop.set()
        logger.error("Lost the checkpoint lease %s to %s: this job writes no more checkpoints there",
                     self.path, self._lost)

    def _start_renewal(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self), self._stop, self.renew_every),
                                        name=f"epochal-lease-{self.token[:6]}", daemon=True)
        self._thread.start()

    def stop_renewal(self) -> None:
        """Stop the background renewal (the lease then expires unless fenced)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self.renew_every))

    # -- letting it go
    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (never raises)."""
        self.stop_renewal()
        with self._mutex:
            version, self._version, self._since = self._version, None, None
        if version is None:
            return
        try:
            if not self.objects.delete(self.path, version):
                logger.warning("Not deleting the checkpoint lease %s: another job holds it now (%s)",
                               self.path, self.holder())
        except Exception as ex:
            logger.warning("Cannot release the checkpoint lease %s: %s", self.path, ex)


def _renew_loop(ref: weakref.ref[Lease], stop: threading.Event, every: float) -> None:
    """Renew the lease every ``every`` seconds until stopped, lost, or garbage-collected.
    A failure to reach the store is a warning (the first of a streak, then every tenth)."""
    failures = 0
    while not stop.wait(every):
        lease = ref()
        if lease is None or not lease.held:
            return
        try:
            lease.renew()
            failures = 0
        except Exception as ex:
            failures += 1
            if failures % 10 == 1:
                logger.warning("Cannot renew the checkpoint lease %s (attempt %d; retrying): %s",
                               lease.path, failures, ex)
        del lease
