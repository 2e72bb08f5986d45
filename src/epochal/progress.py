"""The terminal progress display of a running job: :class:`TerminalProgress`.

A :class:`~epochal.jobs.events.RunListener` that JobRunner attaches on its own when stderr is
a terminal (and ``CI``/``EPOCHAL_QUIET`` are unset), or always with ``JobRunner(...,
progress=True)``. It shows

* one line per epoch: epoch number, how long it ran, and how long its checkpoint took and
  how big it was (``epoch   3  1.24 s | saved 12.0 MiB in 0.08 s (150 MB/s)``);
* a progress bar while a save or load moves more than ``threshold`` bytes (64 MiB by default,
  guessed from the previous checkpoint's size; a load with nothing to guess from gets a bar
  once that many bytes have moved), fed by the db backends through
  :data:`epochal.storage.formats.base.IO_PROGRESS`.

Every line also goes to the ``epochal.progress`` logger (INFO). Rich draws the display when it
is installed (the ``cli`` extra); without it the lines are plain text and there is no bar.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
import time
from typing import IO, Any

from . import knobs
from .jobs.events import CheckpointEvent, RunListener
from .storage.formats.base import IO_PROGRESS

logger = logging.getLogger("epochal.progress")

#: saves and loads expected to move more than this get a progress bar
DEFAULT_THRESHOLD = 64 << 20

_ACTION_WORDS = {
    "checkpoint_save": "saved",
    "checkpoint_load": "loaded",
    "checkpoint_partial_load": "loaded (partial)",
}
_FAILED_WORDS = {"checkpoint_save": "save", "checkpoint_load": "load", "checkpoint_partial_load": "partial load"}

try:  # rich is optional: the core imports without it
    from rich.console import Console as _RichConsole
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    HAVE_RICH = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_RICH = False


def display_wanted(stream: IO[str] | None = None) -> bool:
    """Whether a progress display belongs on ``stream`` (stderr by default): it is a
    terminal, ``CI`` is unset and the ``quiet`` knob is off (:func:`epochal.knobs.is_quiet`:
    by default, ``EPOCHAL_QUIET`` unset)."""
    if os.environ.get("CI") or knobs.is_quiet():
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_seconds(s: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``75`` -> ``"1m15s"``."""
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 60:
        return f"{s:.2f} s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


class TerminalProgress(RunListener):
    """Epoch lines and I/O progress bars for a JobRunner; see the module docstring.

    ``force``: show even when ``stream`` is not a terminal or ``CI``/``EPOCHAL_QUIET`` is set
    (what ``JobRunner(progress=True)`` asks for). ``stream``: where to draw (stderr).
    ``threshold``: bytes above which a save or load gets a bar. ``use_rich``: False for plain
    lines even when rich is installed.
    """

    def __init__(
        self,
        force: bool = False,
        *,
        stream: IO[str] | None = None,
        threshold: int = DEFAULT_THRESHOLD,
        use_rich: bool | None = None,
        big_only: bool = False,
        word: str = "epoch",
    ) -> None:
        self.stream: IO[str] = sys.stderr if stream is None else stream
        #: a line only for a save or load of ``threshold`` bytes or more, or one that failed
        #: (a training loop's Checkpointer: its small saves pass silently)
        self.big_only = bool(big_only)
        self.word = word
        self.enabled = bool(force) or display_wanted(self.stream)
        self.threshold = int(threshold)
        self.rich = HAVE_RICH if use_rich is None else (bool(use_rich) and HAVE_RICH)
        self._console: Any = None
        if self.enabled and self.rich:
            self._console = _RichConsole(file=self.stream, highlight=False, soft_wrap=True)
        self._lock = threading.Lock()
        self._nodes: list[str] = []
        self._pending: tuple[int, float] | None = None  # (epoch, seconds) awaiting its save
        self._last_size: dict[str, int] = {}  # action -> bytes of the last checkpoint
        self._io_token: contextvars.Token[Any] | None = None
        self._io_done = 0
        self._io_expected = 0
        self._io_action = ""
        self._io_epoch = 0
        self._bar: Any = None
        self._bar_task: Any = None
        self._train_start = time.perf_counter()

    # ---------------------------------------------------------------- output
    def _emit(self, text: str, style: str | None = None) -> None:
        """One permanent line: to the display (when enabled) and to the logger."""
        logger.info("%s", text)
        if not self.enabled:
            return
        with self._lock:
            if self._console is not None:
                self._console.print(text, style=style, markup=False)
            else:
                try:
                    self.stream.write(text + "\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass

    def _flush_pending(self) -> None:
        if self._pending is not None:
            epoch, seconds = self._pending
            self._pending = None
            self._emit(f"epoch {epoch:>4}  {human_seconds(seconds):>9}")

    # ---------------------------------------------------------------- listener hooks
    def on_train_start(self, resume_epoch: int | None, nodes: list[str]) -> None:
        self._nodes = list(nodes)
        self._train_start = time.perf_counter()
        where = "from scratch" if resume_epoch is None else f"resuming from epoch {resume_epoch}"
        who = f" on {len(nodes)} node(s): {', '.join(nodes)}" if nodes else ""
        self._emit(f"training {where}{who}", style="bold")

    def on_epoch_start(self, epoch: int) -> None:
        self._flush_pending()

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        self._flush_pending()
        self._pending = (epoch, seconds)

    def on_checkpoint_start(self, action: str, epoch: int) -> None:
        self._stop_io()
        self._io_action, self._io_epoch = action, epoch
        self._io_done = 0
        self._io_expected = self._last_size.get(action) or self._last_size.get("checkpoint_save", 0)
        try:
            self._io_token = IO_PROGRESS.set(self._advance)
        except Exception:  # noqa: BLE001 - a display never breaks training
            self._io_token = None
        if self._io_expected >= self.threshold:
            self._start_bar(self._io_expected)

    def on_checkpoint(self, event: CheckpointEvent) -> None:
        self._stop_io()
        if event.ok and event.nbytes:
            self._last_size[event.action] = event.nbytes
        if self.big_only and event.ok and max(event.nbytes, self._io_done) < self.threshold:
            return
        word = _ACTION_WORDS.get(event.action, event.action)
        if event.ok:
            rate = f" ({event.nbytes / 1e6 / event.seconds:.0f} MB/s)" if event.nbytes and event.seconds > 0 else ""
            ck = f"{word} {human_bytes(event.nbytes)} in {human_seconds(event.seconds)}{rate}"
            style = None
        else:
            ck = f"{_FAILED_WORDS.get(event.action, event.action)} FAILED: {event.error}"
            style = "bold red"
        if self._pending is not None and self._pending[0] == event.epoch and event.action == "checkpoint_save":
            epoch, seconds = self._pending
            self._pending = None
            self._emit(f"epoch {epoch:>4}  {human_seconds(seconds):>9} | {ck}", style=style)
        else:
            self._flush_pending()
            self._emit(f"checkpoint {event.epoch}: {ck}" if self.word == "epoch" else f"{self.word} {event.epoch}: {ck}",
                       style=style)

    def on_train_end(self, epoch: int, preempted: bool) -> None:
        self._flush_pending()
        total = human_seconds(time.perf_counter() - self._train_start)
        if preempted:
            self._emit(f"preempted: stopped after epoch {epoch} (committed), {total}", style="bold yellow")
        else:
            self._emit(f"finished at epoch {epoch} in {total}", style="bold green")

    def close(self) -> None:
        self._stop_io()
        self._flush_pending()

    # ---------------------------------------------------------------- I/O progress
    def _advance(self, nbytes: int) -> None:
        """The IO_PROGRESS callback: ``nbytes`` more moved (may be called from any thread)."""
        self._io_done += int(nbytes)
        if self._bar is None and self._io_expected < self.threshold and self._io_done >= self.threshold:
            self._start_bar(None)
        bar, task = self._bar, self._bar_task
        if bar is not None:
            try:
                if self._io_expected and self._io_done > self._io_expected:
                    bar.update(task, total=self._io_done)
                bar.update(task, completed=self._io_done)
            except Exception:  # noqa: BLE001
                pass

    def _start_bar(self, total: int | None) -> None:
        if not (self.enabled and self._console is not None) or self._bar is not None:
            return
        verb = "saving" if self._io_action == "checkpoint_save" else "loading"
        try:
            bar = Progress(
                TextColumn(f"{verb} {self.word} {self._io_epoch}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            task: TaskID = bar.add_task(verb, total=total, completed=self._io_done)
            bar.start()
        except Exception:  # noqa: BLE001 - e.g. another live display is active
            return
        self._bar, self._bar_task = bar, task

    def _stop_io(self) -> None:
        if self._io_token is not None:
            try:
                IO_PROGRESS.reset(self._io_token)
            except (ValueError, RuntimeError):  # set in another context: just clear ours
                IO_PROGRESS.set(None)
            self._io_token = None
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.stop()
            except Exception:  # noqa: BLE001
                pass
