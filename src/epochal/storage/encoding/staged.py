"""Segments an encoder has already copied into memory of their own, which a snapshot keeps.

A background save snapshots the state: it encodes every blob and copies each segment into
its pooled arena (:mod:`epochal.checkpoint.tasks.arenas`), so that training can change the
live values while the copy is written. Some encoders cannot hand out a view of the live
bytes: a CUDA tensor's bytes must first come to host memory. Such an encoder copies them
straight into host memory fit for the purpose (pinned, so that the device-to-host copy runs
at the bus's speed) and, inside :func:`staging_scope`, says so with :func:`staged`: the
snapshot then keeps that segment as it is instead of copying it a second time, leaves it out
of its arena, and runs each ``settle`` callback once before it returns (the device copies,
issued without waiting, have landed by then). Outside a scope :func:`staged` returns False
and the encoder settles at once (a synchronous save writes the bytes right after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["Staged", "staged", "staging_scope"]


class Staged:
    """The segments encoded inside one :func:`staging_scope` that are already private copies,
    and what must run before their bytes are read (:meth:`settle`)."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._keep: list[Any] = []  # (the segments stay alive: their ids stay theirs)
        self._settle: dict[int, Callable[[], None]] = {}

    def add(self, segment: memoryview, settle: Callable[[], None] | None) -> None:
        self._ids.add(id(segment))
        self._keep.append(segment)
        if settle is not None:
            self._settle.setdefault(id(settle), settle)

    def has(self, segment: Any) -> bool:
        """True when ``segment`` is a private copy made in this scope (to keep, not copy)."""
        return id(segment) in self._ids

    def settle(self) -> None:
        """Run each settle callback once (the copies have landed when this returns)."""
        callbacks, self._settle = list(self._settle.values()), {}
        for fn in callbacks:
            fn()


_SCOPE: ContextVar[Staged | None] = ContextVar("epochal_staged", default=None)


@contextmanager
def staging_scope() -> Iterator[Staged]:
    """Encodes in this block may hand their private copies over (:func:`staged`); the caller
    keeps them, and calls :meth:`Staged.settle` before their bytes are read."""
    scope = Staged()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def staged(segment: memoryview, settle: Callable[[], None] | None = None) -> bool:
    """Called by an encoder that copied ``segment`` into memory of its own: inside a
    :func:`staging_scope` the snapshot keeps it (``settle`` runs before it is read) and this
    returns True; outside one it returns False (the encoder settles the copy itself)."""
    scope = _SCOPE.get()
    if scope is None:
        return False
    scope.add(segment, settle)
    return True
