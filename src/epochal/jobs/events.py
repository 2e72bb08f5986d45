"""What a JobRunner tells the outside world as it goes: listeners for progress displays.

Every event also goes to the ``epochal`` logger; a listener adds a view (the terminal
progress line of ``epochal.progress``, a test recorder, a metrics exporter).
"""

from __future__ import annotations

from dataclasses import dataclass


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
