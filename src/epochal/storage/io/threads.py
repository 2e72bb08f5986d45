"""Threads for the read paths: a one-thread worker queue, running jobs over a few threads,
and splitting work between them (balanced or in contiguous runs)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from . import tuning

__all__ = ["Worker", "balanced", "contiguous", "cpu_threads", "run_parallel"]


def cpu_threads() -> int:
    """Threads for CPU-bound passes: the usable cores, at most tuning.CPU_THREADS."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(tuning.CPU_THREADS, n))


def balanced(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``n`` groups of about equal total (largest first, greedy),
    each group in increasing order; empty groups dropped."""
    groups: list[list[int]] = [[] for _ in range(max(1, n))]
    totals = [0] * len(groups)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        g = totals.index(min(totals))
        groups[g].append(k)
        totals[g] += sizes[k]
    return [sorted(g) for g in groups if g]


def contiguous(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into at most ``n`` consecutive runs of about equal total."""
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    acc = 0
    for k, sz in enumerate(sizes):
        if groups[-1] and len(groups) < n and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(k)
        acc += sz
    return groups


def run_parallel(jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs[0]`` on this thread and the others on their own threads; re-raise the
    first exception once all have ended."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,), name="epochal-inplace", daemon=True)
               for fn in jobs[1:]]
    for t in threads:
        t.start()
    try:
        if jobs:
            guarded(jobs[0])
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class Worker:
    """One background thread running submitted calls in order (checksums of the batch
    path, overlapped with the next read); ``wait`` re-raises a call's exception."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="epochal-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._done.set()
                return
            if self._error is None:
                try:
                    item[0](*item[1])
                except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                    self._error = e

    def submit(self, fn: Any, *args: Any) -> None:
        self._q.put((fn, args))

    def wait(self) -> None:
        """Wait for every submitted call; re-raise the first one's exception."""
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the thread after the queued calls (idempotent)."""
        if not self._done.is_set():
            self._q.put(None)
            self._thread.join()
            self._done.set()
