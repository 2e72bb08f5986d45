"""An async save of a JAX job: its handle, and how several processes agree off the main thread.

An async save of several processes (``epochal.jax.save(..., async_save=True)``) makes its
first agreement and takes the host copies of its shards on the calling thread
(:mod:`.multiprocess`); the write of each process's db, the agreement that every db is
written, process 0's commit and the agreement on it run on a thread of their own. Those
two agreements are not JAX collectives (``multihost_utils.process_allgather``): processes
pair their collectives by the order each launches them, so one launched from a background
thread while the training thread launches its own (a sharded step, the next save's
agreement) may pair with another collective on another process, and the job deadlocks.
They go through the job's coordination service instead (``jax.distributed``'s key-value
store, which Orbax's async checkpointer uses for its barriers too): each process sets a key
of its own, ``epochal/jax_save/<n>/<phase>/<process>`` (``0``, or ``1``: it failed), then
reads every process's; the store is thread-safe and touches no device.

One save is in flight per process at a time. The next save joins it first (raising its
error), as a restore does; :func:`join_pending` (``epochal.jax.wait()``) joins it at the
end of a job. A save still in flight when the interpreter exits is finished first (its
thread is not a daemon) and its error, if nobody took it, raised at exit.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointError

__all__ = ["AGREE_SECONDS", "Agree", "PendingSave", "agree_off_thread", "join_pending", "start_pending"]

#: how long a background agreement waits for every process's key before it fails
AGREE_SECONDS = 1800.0

#: an agreement: ``(phase, this process failed)`` -> every process's flag (1: failed)
Agree = Callable[[str, bool], np.ndarray]

_PREFIX = "epochal/jax_save"
#: what each agreement tells, for errors
_WHAT = {"written": "wrote its db", "committed": "committed the step"}
_pending: PendingSave | None = None
_saves = 0  # background saves started by this process (the same count on every process)
_exit_hook = False


class PendingSave:
    """An async save still being written (:func:`~epochal.jax.save` returns it): :meth:`wait`
    joins it. ``step`` and ``directory`` name it."""

    def __init__(self, directory: str, step: int, finish: Callable[[], None], *, threaded: bool) -> None:
        self.directory = directory
        self.step = step
        self._finish = finish
        self._error: BaseException | None = None
        self._ran = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=f"epochal-jax-save-{step}", daemon=False)
            self._thread.start()

    def __repr__(self) -> str:
        return f"PendingSave({self.directory!r}, step {self.step}, {'done' if self.done() else 'in flight'})"

    def _run(self) -> None:
        try:
            self._finish()
        except BaseException as ex:  # raised where it is joined
            self._error = ex
        finally:
            self._ran = True

    def done(self) -> bool:
        """Whether the save has ended (committed, or failed: :meth:`wait` raises)."""
        return self._ran

    def wait(self) -> None:
        """Wait until the step is written and committed. Raises what failed, on every process
        of the save: the failing process its own error, the others CheckpointError naming
        the processes that failed (the step is then not committed; earlier steps untouched)."""
        global _pending
        if self._thread is not None:
            self._thread.join()
        elif not self._ran:
            self._run()  # (one process: the Checkpointer commits on the calling thread)
        if _pending is self:
            _pending = None
        if self._error is not None:
            raise self._error


def join_pending() -> None:
    """Wait for this process's async save in flight, if any (see :meth:`PendingSave.wait`)."""
    if _pending is not None:
        _pending.wait()


def _at_exit() -> None:
    join_pending()


def agree_off_thread() -> Any:
    """The job's coordination service client (``jax.distributed``), which background
    agreements go through; RuntimeError when the job has none."""
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:
        raise RuntimeError("an async save of several JAX processes agrees through jax.distributed's coordination "
                           "service: call jax.distributed.initialize(...) first")
    return client


def _kv_agree(client: Any, prefix: str, i: int, n: int) -> Agree:
    """An agreement through the key-value store (see the module doc)."""

    def agree(phase: str, failed: bool) -> np.ndarray:
        client.key_value_set(f"{prefix}/{phase}/{i}", "1" if failed else "0")
        flags = []
        for r in range(n):
            try:
                flags.append(int(client.blocking_key_value_get(f"{prefix}/{phase}/{r}", int(AGREE_SECONDS * 1000))))
            except Exception as ex:
                raise CheckpointError(f"process {r} did not report within {AGREE_SECONDS:g} s whether it "
                                      f"{_WHAT.get(phase, phase)} ({type(ex).__name__}: {ex}); the step is not "
                                      "committed, unless process 0 committed it before it stopped") from ex
        return np.array(flags, dtype=np.int64)

    return agree


def start_pending(directory: str, step: int, work: Callable[[Agree], None]) -> PendingSave:
    """Run ``work`` (the rest of a save of several processes) on a thread, agreeing through
    the coordination service; called by every process at the same point (after an
    agreement), so each numbers its saves alike."""
    import jax

    global _pending, _saves, _exit_hook
    client = agree_off_thread()
    i, n = jax.process_index(), jax.process_count()
    _saves += 1
    prefix = f"{_PREFIX}/{_saves}"
    if i == 0 and _saves > 1:  # every process joined the one before (it agreed since): its keys go
        try:
            client.key_value_delete(f"{_PREFIX}/{_saves - 1}")
        except Exception:  # a few bytes left in the job's store: nothing depends on them
            pass
    agree = _kv_agree(client, prefix, i, n)
    return _track(PendingSave(directory, step, lambda: work(agree), threaded=True))


def one_process_pending(directory: str, step: int, finish: Callable[[], None]) -> PendingSave:
    """The handle of a one-process async save, ``finish`` committing it (the Checkpointer's
    close, on the thread that waits)."""
    return _track(PendingSave(directory, step, finish, threaded=False))


def _track(p: PendingSave) -> PendingSave:
    global _pending, _exit_hook
    _pending = p
    if not _exit_hook:  # (registered after jax.distributed's own: runs before its shutdown)
        atexit.register(_at_exit)
        _exit_hook = True
    return p
