"""Faults injected at the byte-store seam (``storage.io.seam.local_store``), not by patching
``os`` or a module's internals: every format reads and writes through a store, so a fault
here is what a failing disk looks like to everything above it.

::

    faults = FaultyStore()
    faults.fail("write", when=lambda path: "trainer_1.3" in path, err=errno.ENOSPC)
    with local_store(faults):
        ...                       # the third epoch's db of trainer_1 hits a full disk
    assert faults.hits            # (path, op) of each fault raised
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epochal.storage.io.seam import ByteSink, ByteSource, disk_store

#: the operations a rule can fail: a sink's ``write`` (half the buffer is written first, as a
#: filling disk does), its ``commit`` (the durable rename never happens: an fsync error), a
#: source's ``read`` (``read`` and ``read_into``), and ``open`` for reading
OPS = ("write", "commit", "read", "open")


@dataclass
class Rule:
    op: str
    when: Callable[[str], bool]
    err: int
    times: int | None  # how many faults it raises (None: every matching call)
    before: Callable[[str], None] | None = None  # called instead of raising, e.g. send a signal
    raised: int = 0


@dataclass
class FaultyStore:
    """The local disk's store with rules that make chosen calls fail (see the module doc);
    ``hits``: (path, op) of every fault, ``writes``: paths of every sink write, in order."""

    rules: list[Rule] = field(default_factory=list)
    hits: list[tuple[str, str]] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)

    def fail(self, op: str, *, when: Callable[[str], bool] = lambda path: True,
             err: int = _errno.EIO, times: int | None = None) -> FaultyStore:
        """Make ``op`` (one of :data:`OPS`) raise ``OSError(err)`` on paths where ``when``
        holds, ``times`` times (None: always)."""
        assert op in OPS, op
        self.rules.append(Rule(op, when, err, times))
        return self

    def on(self, op: str, action: Callable[[str], None], *, when: Callable[[str], bool] = lambda p: True,
           times: int | None = 1) -> FaultyStore:
        """Call ``action(path)`` at ``op`` (it may raise, or send a signal) instead of a fault."""
        self.rules.append(Rule(op, when, 0, times, before=action))
        return self

    def check(self, op: str, path: str) -> None:
        for rule in self.rules:
            if rule.op != op or not rule.when(path) or (rule.times is not None and rule.raised >= rule.times):
                continue
            rule.raised += 1
            if rule.before is not None:
                rule.before(path)
                continue
            self.hits.append((path, op))
            raise OSError(rule.err, f"{os.strerror(rule.err)} (injected at {op} of {path})", path)

    # -- the ByteStore interface
    def open_read(self, path: str, *, what: str = "db") -> ByteSource:
        self.check("open", path)
        return _Source(disk_store().open_read(path, what=what), path, self)

    def create(self, path: str, size: int | None = None) -> ByteSink:
        return _Sink(disk_store().create(path, size), path, self)

    def exists(self, path: str) -> bool:
        return disk_store().exists(path)


class _Sink:
    """A local sink whose writes and commit may fail (never a pinned sink: zero-copy writes
    take the copying path under faults, which writes the same bytes)."""

    def __init__(self, inner: ByteSink, path: str, faults: FaultyStore) -> None:
        self.inner, self.path, self.faults = inner, path, faults

    def __getattr__(self, name: str) -> Any:  # ``name`` and the like; never write_pinned
        if name in ("write_pinned", "pin_align"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def write(self, buffer: Any) -> int:
        self.faults.writes.append(self.path)
        try:
            self.faults.check("write", self.path)
        except OSError:
            first = buffer[0] if isinstance(buffer, (list, tuple)) else buffer
            view = memoryview(first).cast("B")
            if view.nbytes > 1:
                self.inner.write(view[: view.nbytes // 2])  # a partial write first
            raise
        return self.inner.write(buffer)

    def patch(self, offset: int, data: Any) -> None:
        self.inner.patch(offset, data)

    def commit(self) -> None:
        try:
            self.faults.check("commit", self.path)
        except OSError:  # as a local sink whose fsync fails: the temp file goes, the old stays
            self.inner.abort()
            raise
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class _Source:
    """A local source whose reads may fail."""

    def __init__(self, inner: ByteSource, path: str, faults: FaultyStore) -> None:
        self.inner, self.path, self.faults = inner, path, faults

    def __getattr__(self, name: str) -> Any:  # size, map, hint, close, ... as they are
        return getattr(self.inner, name)

    def read(self, nbytes: int, offset: int) -> bytes:
        self.faults.check("read", self.path)
        return self.inner.read(nbytes, offset)

    def read_into(self, views: Any, offset: int, *, nowait: bool = False) -> int:
        self.faults.check("read", self.path)
        return self.inner.read_into(views, offset, nowait=nowait)

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.close()
