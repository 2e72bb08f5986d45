"""Signals during training: the first SIGTERM/SIGINT finishes the epoch and commits it; a
second stops at once (committed checkpoints are never touched by an interrupted save)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger("epochal")


class SignalGuard:
    """Installs handlers for ``signals`` (main thread only) and restores the old ones on exit.

    ``signum`` is the first signal received, or None. ``word``: what the loop calls its unit
    of work in the message ("epoch"; the Checkpointer's "step").
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), enabled: bool = True,
                 word: str = "epoch") -> None:
        self.signals = signals
        self.word = word
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:
        if self.enabled:
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning(
                "Received %s: finishing this %s and saving its checkpoint; send it again to stop now",
                signal.Signals(signum).name, self.word,
            )
            return
        logger.warning("Received %s again: stopping now", signal.Signals(signum).name)
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    def __exit__(self, *exc: object) -> None:
        self._restore()
