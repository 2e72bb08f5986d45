"""What a JobRunner tells the outside world as it goes: listeners for progress displays.

Every event also goes to the ``epochal`` logger; a listener adds a view (the terminal
progress line of ``epochal.progress``, a test recorder, a metrics exporter).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from .. import knobs

#: the terminal display attached when stderr is a terminal: named, not imported, so this
#: layer does not depend on the views above it
DEFAULT_DISPLAY = "epochal.progress:TerminalProgress"


@dataclass
class CheckpointEvent:
    """One save or load of every node's db for an epoch, as the runner saw it."""

    action: str  # "checkpoint_save" | "checkpoint_load" | "checkpoint_partial_load"
    epoch: int
    seconds: float
    nbytes: int
    ok: bool
    error: str | None = None


class RunListener:
    """Base listener: every hook is a no-op; override what you need."""

    def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None: ...

    def on_epoch_start(self, epoch: int) -> None: ...

    def on_epoch_end(self, epoch: int, seconds: float) -> None: ...

    def on_checkpoint_start(self, action: str, epoch: int) -> None:
        """A save or load begins; a display may set ``epochal.storage.formats.base.IO_PROGRESS`` here
        (and reset it in ``on_checkpoint``) to follow the bytes as they move."""

    def on_checkpoint(self, event: CheckpointEvent) -> None: ...

    def on_train_end(self, epoch: int, preempted: bool) -> None: ...

    def close(self) -> None: ...


def auto_progress(force: bool = False, **options: Any) -> RunListener | None:
    """The terminal progress display: when forced, or when stderr is a terminal outside CI and
    the ``quiet`` knob is off (:func:`epochal.knobs.is_quiet`: by default, EPOCHAL_QUIET unset)."""
    if not force and (os.environ.get("CI") or knobs.is_quiet() or not sys.stderr.isatty()):
        return None
    module, _, name = DEFAULT_DISPLAY.partition(":")
    try:
        display = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    return display(force=force, **options)  # type: ignore[no-any-return]
