"""Progress of byte movement: backends report bytes as they move, displays subscribe."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

__all__ = ["IO_PROGRESS", "report_progress"]

#: A callback ``fn(nbytes_done_increment)`` that backends call as data moves (per segment or
#: chunk) during a write or read; set by progress displays. None: no progress reporting.
IO_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("epochal_io_progress", default=None)


def report_progress(nbytes: int) -> None:
    """Tell the active progress display (if any) that ``nbytes`` more were written or read."""
    cb = IO_PROGRESS.get()
    if cb is not None:
        cb(nbytes)
