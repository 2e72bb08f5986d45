"""The first background save of a run: a snapshot that leases an arena the
warmer is still faulting in (a new JobRunner run prepares right before its init save) lets
a madvise warmer go on alongside its copy instead of stopping it; without madvise (the
zero-writing fallback) the lease still stops the warmer first. ``prepare`` also starts the
writer thread, so the first save only hands it the write. Checked with the pool's counters,
which thread did what, and the bits saved; no timings."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from epochal import get_db_type
from epochal.checkpoint.tasks import arenas
from epochal.checkpoint.tasks.background import BackgroundSaver

MIB = 1 << 20


def _blobs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(MIB, dtype=np.float32), "b": rng.integers(0, 255, 77, dtype=np.uint8)}


def _save(saver: BackgroundSaver, path: str, blobs: dict[str, np.ndarray]) -> None:
    saver.start(path, "native", saver.snapshot("n", blobs))
    saver.join(path)


def _same(path: str, blobs: dict[str, np.ndarray]) -> None:
    saved = get_db_type("native").read(path)
    assert sorted(saved) == sorted(blobs)
    for k, v in blobs.items():
        assert np.array_equal(saved[k], v), k


def _madvise_works() -> bool:
    buf = arenas._arena_memory(1 << 16)
    return arenas._populate(buf)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_snapshot_of_an_arena_still_warming_lets_the_madvise_warmer_go_on(tmp_path, monkeypatch):
    if not _madvise_works():
        pytest.skip("no MADV_POPULATE_WRITE on this kernel")
    monkeypatch.setattr(arenas, "_WARM_STEP", 1 << 16)
    saver = BackgroundSaver()
    pool = saver.pool
    real = arenas._populate
    steps: list[bool] = []  # per warmer step: was the arena leased (a copy into it under way)?
    ends: list[int] = []  # per warmer step: where in the arena its range ended

    def gated(view: np.ndarray) -> bool:
        (arena,) = pool._arenas
        if len(steps) == 1:  # the second step waits until the snapshot leased the arena
            deadline = time.monotonic() + 10  # (a lease that waits for the warmer: goes on)
            while not (pool.shared and arena.busy) and time.monotonic() < deadline:
                time.sleep(0.001)
        steps.append(arena.busy)
        ends.append(view.ctypes.data + view.nbytes - arena.buffer.ctypes.data)
        return real(view)

    release = pool.release

    def held_release(arena: arenas._Arena) -> None:
        """The arena comes back only once the warmer took a step while it was leased."""
        _wait(lambda: len(steps) >= 2, "a warmer step during the lease")
        release(arena)

    monkeypatch.setattr(arenas, "_populate", gated)
    monkeypatch.setattr(pool, "release", held_release)
    blobs = _blobs(0)
    assert saver.prepare("n", blobs) == 1
    _wait(lambda: len(steps) >= 1, "the first warmer step")
    path = str(tmp_path / "n.1")
    snap = saver.snapshot("n", blobs)  # leases the arena one step into its warming
    assert pool.shared == 1 and (pool.allocated, pool.reused, pool.fresh) == (1, 1, 0)
    assert snap.arena is pool._arenas[0]  # the prepared arena: no fresh memory for the copy
    saver.start(path, "native", snap)
    saver.join(path)
    assert pool.wait_warm(30)
    assert steps[0] is False and steps[1] is True  # the warmer went on while the copy ran
    # from the back to the front (the copy goes front to back: they meet in the middle)
    nbytes = pool._arenas[0].nbytes
    assert ends[0] == nbytes and ends[1] == nbytes - (1 << 16) and ends == sorted(ends, reverse=True)
    _same(path, blobs)
    assert pool.waited == 0
    saver.close()
    assert pool.pooled_bytes == 0


def test_without_madvise_a_snapshot_stops_the_zero_writing_warmer_first(tmp_path, monkeypatch):
    monkeypatch.setattr(arenas, "_WARM_STEP", 1 << 16)
    monkeypatch.setattr(arenas, "_populate", lambda view: False)  # an older kernel: zeros written
    saver = BackgroundSaver()
    pool = saver.pool
    blobs = _blobs(1)
    assert saver.prepare("n", blobs) == 1
    (arena,) = pool._arenas
    _wait(lambda: arena.cold < arena.nbytes, "the first warmer step")
    path = str(tmp_path / "n.1")
    snap = saver.snapshot("n", blobs)
    assert not arena.warming and pool._warming_now is not arena  # stopped before the copy
    assert pool.shared == 0 and (pool.allocated, pool.reused, pool.fresh) == (1, 1, 0)
    saver.start(path, "native", snap)
    saver.join(path)
    _same(path, blobs)  # no zero of the warmer reached the copied bytes
    saver.close()


def test_wait_warm_returns_once_the_prepared_arenas_are_faulted_in(monkeypatch):
    monkeypatch.setattr(arenas, "_WARM_STEP", 1 << 16)
    saver = BackgroundSaver()
    assert saver.pool.wait_warm(0)  # nothing queued
    assert saver.prepare("n", _blobs(2), arenas=2) == 2
    assert saver.pool.wait_warm(30)
    assert saver.pool.warmed == 2 and not any(a.warming for a in saver.pool._arenas)
    assert [a.cold for a in saver.pool._arenas] == [0, 0]
    saver.close()


def test_prepare_starts_the_writer_thread_the_first_save_uses(tmp_path):
    def writers() -> set[int | None]:
        return {t.ident for t in threading.enumerate() if t.name.startswith("epochal-save")}

    saver = BackgroundSaver()
    assert not saver.running
    others = writers()  # (other savers' threads, if any)
    blobs = _blobs(3)
    saver.prepare("n", blobs)
    assert saver.running
    _wait(lambda: len(writers() - others) == 1, "the thread")
    before = writers() - others
    wrote: list[int | None] = []
    real = saver._write

    def write(db_type, db, snap):
        wrote.append(threading.get_ident())
        return real(db_type, db, snap)

    saver._write = write  # type: ignore[method-assign]
    _save(saver, str(tmp_path / "n.1"), blobs)
    assert wrote == list(before)  # the thread started by prepare wrote the first save
    _same(str(tmp_path / "n.1"), blobs)
    saver.close()
    assert not saver.running
