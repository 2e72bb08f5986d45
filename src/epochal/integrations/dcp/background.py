"""A rank's background saves: each one a job (its planning, write and the ranks' agreement,
collective on a group of their own), run in order by one daemon thread.

:class:`Pending` runs the job, then has every rank agree that every rank's job ended well,
so its :attr:`~Pending.error` is the same failure (or None) on every rank; the training
thread waits on :attr:`~Pending.done` (or, leaving on an error, on :attr:`~Pending.written`
only) and then commits. :class:`Worker` hands jobs to its thread through a queue: a save
does not wait for a thread to start.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ..ranks import RankGroup
from .storage import EpochalStorageWriter

__all__ = ["Pending", "Worker"]


class Pending:
    """A background save of this rank: ``job`` (its write, collective on ``ranks``, the
    background group), then the ranks' agreement that every rank's job ended well; so
    :attr:`error` is the same failure (or None) on every rank."""

    def __init__(self, step: int, writer: EpochalStorageWriter, start: int, ranks: RankGroup,
                 job: Callable[[], None]) -> None:
        self.step, self.writer, self.start, self.ranks, self.job = step, writer, start, ranks, job
        self.error: BaseException | None = None
        self.written, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        problem: BaseException | None = None
        try:
            self.job()
        except BaseException as ex:
            problem = ex
        finally:
            self.written.set()
        try:
            self.ranks.agree(problem, f"write step {self.step} in the background")
        except BaseException as ex:  # handed to wait(), which raises it (on every rank)
            self.error = ex
            self.writer.discard_deferred()
        finally:
            self.done.set()


class Worker:
    """One daemon thread running the background saves in order (a queue: handing one over
    does not wait for a thread to start)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="epochal-dist-save", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._jobs.get()()
