"""Snapshot arenas when writes outlast the step: an arena reused by a snapshot of
another layout that fits (its padding zeroed, so the zero-copy O_DIRECT write still
happens), a second arena while the first is written, the bound held by waiting for a write
in flight instead of taking fresh memory, arenas pre-faulted on a thread, and background
saves below tuning.DIRECT_MIN written from the arena with O_DIRECT."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from epochal import get_db_type, register_db_type
from epochal.checkpoint.tasks import arenas
from epochal.checkpoint.tasks.background import BackgroundSaver, arena_bytes
from epochal.storage.formats.native import image
from epochal.storage.formats.native.backend import NativeBackend
from epochal.storage.io import direct, tuning

GATE = threading.Event()


class Gated27(NativeBackend):
    """The native format, whose writes wait for GATE (so a write stays in flight)."""

    name = "gated27"

    def write(self, path, blobs):
        assert GATE.wait(30)
        return super().write(path, blobs)


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch):
    from epochal.storage.formats import base

    monkeypatch.setattr(base, "_registry", dict(base._registry))
    register_db_type("gated27", Gated27)
    # every file of an arena goes the O_DIRECT way, through small pieces
    monkeypatch.setattr(tuning, "DIRECT_MIN_PINNED", 1)
    monkeypatch.setattr(tuning, "DIRECT_BUFFER", 1 << 16)
    direct.stats.reset()
    image.stats.reset()
    GATE.set()
    yield
    GATE.set()


def _read(path):
    return get_db_type("native").read(str(path))


def _state(sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"b{i}": rng.integers(1, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}


def _save(saver: BackgroundSaver, path, blobs, owner: str = "n") -> None:
    saver.start(str(path), "native", saver.snapshot(owner, blobs))
    saver.join(str(path))


def _same(path, blobs) -> None:
    got = _read(path)
    assert sorted(got) == sorted(blobs)
    for k, v in blobs.items():
        assert got[k].tobytes() == v.tobytes(), k


def test_a_new_layout_that_fits_reuses_the_arena_with_zero_padding(tmp_path):
    """Segment sizes change from epoch to epoch within the first arena's capacity: no new
    memory, and the bytes of the old layout left in the new padding are zeroed, so every
    write is still the zero-copy one (image.stats, DirectSink's pinned bytes)."""
    if not direct.direct_supported():
        pytest.skip("no O_DIRECT here")
    saver = BackgroundSaver()
    first = [70001, 4096, 1000, 65, 30000]
    _save(saver, tmp_path / "n.0", _state(first, 0))
    # each later layout: shorter segments (old bytes would sit where the padding now is)
    layouts = [[70000, 4090, 990, 64, 29999], [69950, 4000, 1, 1, 1], [40000, 4096, 1000, 65, 60001],
               [70001, 4096, 1000, 65, 30000]]
    for e, sizes in enumerate(layouts, 1):
        blobs = _state(sizes, e)
        _save(saver, tmp_path / f"n.{e}", blobs)
        _same(tmp_path / f"n.{e}", blobs)
    pool = saver.pool
    assert (pool.allocated, pool.fresh) == (1, 0)
    assert pool.reused == 4 and pool.refitted == 4
    assert pool.pooled_bytes == arena_bytes(tuple(first))
    assert (image.stats.taken, image.stats.refused) == (5, 0)
    assert direct.stats.pinned > 4 * 100_000
    # padding really is zero in the arena itself
    arena = pool._arenas[0]
    at = 0
    for n in layouts[-1]:
        assert not arena.buffer[at + n : at + -(-n // 64) * 64].any()
        at += -(-n // 64) * 64
    saver.close()


def test_a_layout_that_outgrows_the_arena_takes_a_new_one(tmp_path):
    saver = BackgroundSaver()
    _save(saver, tmp_path / "n.0", _state([1000, 2000], 0))
    blobs = _state([1000, 9000], 1)
    _save(saver, tmp_path / "n.1", blobs)
    _same(tmp_path / "n.1", blobs)
    assert (saver.pool.allocated, saver.pool.reused, saver.pool.fresh) == (2, 0, 0)
    assert saver.pool.pooled_bytes == arena_bytes((1000, 9000))  # the small one was dropped
    saver.close()


def test_the_pool_never_keeps_more_than_the_bound_when_the_state_shrinks(tmp_path):
    """An idle arena much bigger than the (default) bound of a smaller state is freed rather
    than reused: the pool holds at most ``limit`` bytes."""
    saver = BackgroundSaver()
    _save(saver, tmp_path / "n.0", _state([400_000], 0))
    blobs = _state([1000], 1)
    _save(saver, tmp_path / "n.1", blobs)
    _same(tmp_path / "n.1", blobs)
    assert saver.pool.pooled_bytes == arena_bytes((1000,)) <= saver.pool.limit
    assert (saver.pool.allocated, saver.pool.reused) == (2, 0)
    saver.close()


def test_a_second_arena_is_used_while_the_first_is_written_then_both_are_reused(tmp_path):
    saver = BackgroundSaver()
    sizes = [50000, 3000, 7]
    expected = {}
    GATE.clear()
    try:
        for e in range(2):  # two writes in flight at once (the first held at the gate)
            blobs = _state(sizes, e)
            saver.start(str(tmp_path / f"n.{e}"), "gated27", saver.snapshot("n", blobs))
            expected[e] = {k: v.copy() for k, v in blobs.items()}
            for v in blobs.values():
                v += 1  # later changes reach no file
        assert (saver.pool.allocated, saver.pool.fresh) == (2, 0)
        assert saver.pool.pooled_bytes == 2 * arena_bytes(tuple(sizes)) == saver.pool.limit
    finally:
        GATE.set()
    for e in range(2):
        saver.join(str(tmp_path / f"n.{e}"))
        _same(tmp_path / f"n.{e}", expected[e])
    for e in range(2, 6):  # steady state: the two arenas in turn, nothing new
        blobs = _state(sizes, e)
        saver.start(str(tmp_path / f"n.{e}"), "native", saver.snapshot("n", blobs))
        if e % 2:
            saver.join(str(tmp_path / f"n.{e - 1}"))
            saver.join(str(tmp_path / f"n.{e}"))
        expected[e] = {k: v.copy() for k, v in blobs.items()}
    for e in range(2, 6):
        _same(tmp_path / f"n.{e}", expected[e])
    assert (saver.pool.allocated, saver.pool.reused, saver.pool.fresh) == (2, 4, 0)
    saver.close()


@pytest.mark.parametrize("bound_arenas", [1, 2])
def test_the_bound_is_held_by_waiting_for_the_write_in_flight(tmp_path, bound_arenas):
    """When every arena the bound allows is being written, the next snapshot waits for one
    write to end instead of taking memory beyond ``max_host_bytes``."""
    sizes = [40000, 123]
    one = arena_bytes(tuple(sizes))
    saver = BackgroundSaver(max_host_bytes=bound_arenas * one)
    GATE.clear()
    peak = []
    done = threading.Event()
    try:
        for e in range(bound_arenas):
            saver.start(str(tmp_path / f"n.{e}"), "gated27", saver.snapshot("n", _state(sizes, e)))
        last = _state(sizes, 9)

        def snapshot_more() -> None:
            snap = saver.snapshot("n", last)  # waits for a write to end
            peak.append(saver.pool.pooled_bytes)
            saver.start(str(tmp_path / "n.9"), "native", snap)
            done.set()

        t = threading.Thread(target=snapshot_more)
        t.start()
        time.sleep(0.3)
        assert not done.is_set()  # still waiting: no fresh memory was taken
        assert saver.pool.waited == 1 and saver.pool.fresh == 0
    finally:
        GATE.set()
    t.join(30)
    assert done.is_set()
    for e in range(bound_arenas):
        saver.join(str(tmp_path / f"n.{e}"))
    saver.join(str(tmp_path / "n.9"))
    _same(tmp_path / "n.9", last)
    assert peak == [bound_arenas * one] and saver.pool.pooled_bytes <= saver.pool.max_host_bytes
    assert (saver.pool.allocated, saver.pool.fresh) == (bound_arenas, 0)
    saver.close()


def test_a_state_bigger_than_the_bound_is_written_synchronously_without_a_copy(tmp_path):
    saver = BackgroundSaver(max_host_bytes=1000)
    blobs = _state([5000], 1)
    _save(saver, tmp_path / "n.1", blobs)
    _same(tmp_path / "n.1", blobs)
    assert (saver.pool.allocated, saver.pool.fresh, saver.pool.pooled_bytes) == (0, 0, 0)
    assert saver.synchronous == 1  # max_host_bytes holds: no snapshot memory at all
    saver.close()


def _resident(buf: np.ndarray) -> float:
    """The share of ``buf``'s pages in memory (mincore)."""
    page = 4096
    addr = buf.ctypes.data
    lo = addr - addr % page
    n = (addr + buf.nbytes - lo + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0
    return sum(v & 1 for v in vec) / n


def test_prepare_faults_the_arena_in_on_a_thread_and_the_snapshot_takes_it(tmp_path):
    saver = BackgroundSaver()
    blobs = _state([8 << 20, 3 << 20, 100], 3)
    assert saver.prepare("n", blobs, arenas=2) == 2
    arenas = list(saver.pool._arenas)
    assert len(arenas) == 2 and saver.pool.allocated == 2
    deadline = time.monotonic() + 30
    while saver.pool.warmed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.pool.warmed == 2
    assert [_resident(a.buffer) for a in arenas] == [1.0, 1.0]
    assert not any(a.buffer.any() for a in arenas)  # faulted in, still all zeros
    _save(saver, tmp_path / "n.1", blobs)
    _same(tmp_path / "n.1", blobs)
    assert (saver.pool.allocated, saver.pool.reused, saver.pool.fresh) == (2, 1, 0)
    assert saver.prepare("n", blobs, arenas=2) == 0  # already there
    saver.close()
    assert saver.pool.pooled_bytes == 0


def test_a_snapshot_during_warming_never_loses_a_byte(tmp_path, monkeypatch):
    """The lease stops the warmer before the copy (the fallback warmer writes zeros)."""
    monkeypatch.setattr(arenas, "_WARM_STEP", 1 << 16)
    monkeypatch.setattr(arenas, "_LIBC", [None])  # the zero-writing fallback
    saver = BackgroundSaver()
    blobs = _state([16 << 20, 5], 4)
    saver.prepare("n", blobs)
    _save(saver, tmp_path / "n.1", blobs)  # most likely while the warmer is mid-way
    _same(tmp_path / "n.1", blobs)
    assert saver.pool.fresh == 0 and saver.pool.reused == 1
    saver.close()


def test_background_saves_below_direct_min_are_written_from_the_arena(tmp_path, monkeypatch):
    """DIRECT_MIN_PINNED: a background save of a file below DIRECT_MIN goes O_DIRECT from the
    arena; a sync save of the same blobs stays buffered (no copy into direct buffers)."""
    if not direct.direct_supported():
        pytest.skip("no O_DIRECT here")
    monkeypatch.setattr(tuning, "DIRECT_MIN", 512 << 20)
    monkeypatch.setattr(tuning, "DIRECT_MIN_PINNED", 1 << 20)
    blobs = _state([3 << 20, 77], 5)
    NativeBackend().write(str(tmp_path / "sync"), blobs)
    assert (direct.stats.pinned, direct.stats.copied) == (0, 0)
    saver = BackgroundSaver()
    _save(saver, tmp_path / "bg", blobs)
    assert direct.stats.pinned >= (3 << 20) - 2 * 4096 and image.stats.taken == 1  # only unaligned ends copied
    assert (tmp_path / "bg").read_bytes() == (tmp_path / "sync").read_bytes()
    direct.stats.reset()
    monkeypatch.setattr(tuning, "DIRECT_MIN_PINNED", None)  # off: buffered again
    _save(saver, tmp_path / "bg2", blobs)
    assert (direct.stats.pinned, direct.stats.copied) == (0, 0)
    assert (tmp_path / "bg2").read_bytes() == (tmp_path / "sync").read_bytes()
    saver.close()
