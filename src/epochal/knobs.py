"""The process-wide switches of epochal, in one place (torchsnapshot's ``knobs.py`` idea).

Each switch is a field of :class:`Knobs`, documented there. They are process-wide on purpose:
background writer threads read them, so a context variable would not reach them. Read the
values in force with :func:`get`; change them for a block with :func:`override` (tests and
benches do this instead of patching module attributes), which puts the old values back on
the way out, also when the block raises::

    from epochal import knobs

    with knobs.override(zero_copy=False):
        ...  # background saves write through the streaming path

The measured I/O thresholds are not here: they live in :mod:`epochal.storage.io.tuning`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["DEFAULT_SWITCH_INTERVAL", "Knobs", "get", "is_quiet", "override"]

#: the interpreter's switch interval (seconds) while a background write is in flight
DEFAULT_SWITCH_INTERVAL = 0.0005


@dataclass(frozen=True)
class Knobs:
    """The switches in force in this process.

    - ``zero_copy``: a background save's native file is written straight from its snapshot
      arena when the layout allows (:mod:`epochal.storage.formats.native.image`); False
      always takes the streaming path (benches compare both ways in one run). The bytes on
      disk are the same either way.
    - ``switch_interval``: while at least one background write is in flight, the
      interpreter's switch interval (``sys.setswitchinterval``) is lowered to this many
      seconds so the writer thread gets the GIL back promptly from a training loop, and the
      old value is put back after the last write (unless someone changed it meanwhile).
      None leaves the interpreter's value alone. A saver built with an explicit
      ``switch_interval`` uses its own value.
    - ``quiet``: True hides the progress display and the runner's notes on stderr; False
      shows them (where a terminal is attached); None (the default) follows the
      ``EPOCHAL_QUIET`` environment variable, read when asked (:func:`is_quiet`).
    - ``spare_bytes``: how many bytes of compressed segments' output buffers a compressed
      save gives back for the next save to reuse (:class:`~epochal.storage.encoding.planes.
      SpareBuffers`: memory already touched, instead of a page fault per 4 KiB page); they
      stay allocated between saves. 0 keeps none.
    - ``kept_bytes``: how many bytes of the content chunks an incremental save of a
      ``Checkpointer`` (or of each rank, DCP writer, JobRunner node) keeps in memory (a
      copy, :mod:`epochal.storage.formats.native.kept`), so that its next save compares
      against them instead of reading the step before back; freed when the Checkpointer
      closes (a node's: when ``train`` ends). Read when the saver makes its first
      incremental save. 0 keeps none (every save reads its base).
    - ``incremental_sources`` and ``incremental_pieces``: compaction of incremental saves
      (:mod:`epochal.storage.formats.native.incremental`): a content chunk whose bytes would
      lie in more than this many older files, or be cut into more than this many pieces, is
      stored whole again. Higher: fewer bytes written over a long run of scattered changes,
      slower restores of the steps between compactions (more files and pieces to read);
      lower: the reverse (bench_incremental.py ``--long``, RESULTS). Read at each save.
    """

    zero_copy: bool = True
    switch_interval: float | None = DEFAULT_SWITCH_INTERVAL
    quiet: bool | None = None
    spare_bytes: int = 1 << 30
    kept_bytes: int = 2 << 30
    incremental_sources: int = 8
    incremental_pieces: int = 2048


_current = Knobs()
_lock = threading.Lock()
_NAMES = frozenset(f.name for f in fields(Knobs))


def get() -> Knobs:
    """The switches in force now."""
    return _current


def is_quiet() -> bool:
    """Whether progress displays and notes are off: the ``quiet`` knob, or when it is None,
    the ``EPOCHAL_QUIET`` environment variable (set and non-empty)."""
    quiet = _current.quiet
    return bool(os.environ.get("EPOCHAL_QUIET")) if quiet is None else quiet


@contextmanager
def override(**changes: Any) -> Iterator[Knobs]:
    """Set the named switches (fields of :class:`Knobs`) for the ``with`` block and put the
    previous values back when it ends, however it ends. Unknown names raise TypeError.
    Overrides nest; they are process-wide (seen by every thread), so two threads overriding
    the same switch at once see each other's values."""
    global _current
    unknown = sorted(set(changes) - _NAMES)
    if unknown:
        raise TypeError(f"unknown knob(s) {', '.join(unknown)}; known: {', '.join(sorted(_NAMES))}")
    with _lock:
        old = _current
        _current = replace(old, **changes)
    try:
        yield _current
    finally:
        with _lock:
            restored = {name: getattr(old, name) for name in changes}
            _current = replace(_current, **restored)
