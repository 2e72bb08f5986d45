"""Background saves of big native files are written from the snapshot arena itself
(storage/native/image.py, DirectSink.write_pinned): the same bytes as a buffered write of the
same blobs, the zero-copy path really taken (counters, and a spy on the O_DIRECT pwrites of
the arena's memory), the copying path whenever a condition fails, and the atomic contract
kept on errors."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from epochal import knobs
from epochal.checkpoint.tasks import arenas
from epochal.checkpoint.tasks.background import BackgroundSaver
from epochal.storage.formats.native import NativeBackend, image
from epochal.storage.formats.native.writer import plan_file
from epochal.storage.io import atomic, direct, local, tuning

pytestmark = pytest.mark.skipif(not direct.direct_supported(), reason="no O_DIRECT here")


@pytest.fixture(autouse=True)
def small_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file goes the direct way, through 64 KiB buffers (so a small file spans many)."""
    monkeypatch.setattr(tuning, "DIRECT_MIN", 1)
    monkeypatch.setattr(tuning, "DIRECT_BUFFER", 1 << 16)
    direct.stats.reset()
    image.stats.reset()


def _random(n: int, seed: int, top: int = 40000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"b{i}": rng.standard_normal(int(rng.integers(0, top)), dtype=np.float32) for i in range(n)}


def _layouts() -> dict[str, dict]:
    rng = np.random.default_rng(7)
    return {
        "many small, some empty": _random(300, 1, 900),  # checksum groups (format 2.0)
        "odd sizes": {f"o{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in
                      enumerate([1, 63, 64, 65, 4031, 4032, 4033, 4096, 70001, 131072, 3])},
        "smaller than a page": {"x": np.arange(5, dtype=np.int16)},
        "empty arrays": {"e0": np.zeros(0), "a": np.ones(3000), "e1": np.zeros((0, 4)),
                         "b": np.arange(1 << 16, dtype=np.int64)},
        "big and mixed": {"w": rng.standard_normal((700, 300)), "step": np.int64(3),
                          "note": "epoch 3", "m": rng.standard_normal(100003).astype(np.float32)},
    }


def _buffered(path: Path, blobs: dict, monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(tuning, "DIRECT_MIN", None)
        NativeBackend().write(str(path), blobs)
    return path.read_bytes()


def _same(out: dict, blobs: dict) -> None:
    assert list(out) == list(blobs)
    for k, v in blobs.items():
        if isinstance(v, np.ndarray):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape
            assert out[k].tobytes() == v.tobytes()
        else:
            assert out[k] == v


@pytest.mark.parametrize("layout", list(_layouts()))
def test_arena_writes_the_same_bytes_without_a_copy(tmp_path, monkeypatch, layout):
    blobs = _layouts()[layout]
    saver = BackgroundSaver()
    snap = saver.snapshot("n", blobs)
    data_area = plan_file(snap.blobs).index_offset - 64
    NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    assert (image.stats.taken, image.stats.refused) == (1, 0)
    # every whole page of the data area came from the arena; only the pages shared with the
    # superblock and the index (and the index) were copied
    assert direct.stats.pinned == max(0, (data_area + 64) // 4096 * 4096 - 4096)
    assert direct.stats.copied <= 2 * 4096 + plan_file(snap.blobs).index_length
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)
    _same(NativeBackend().read(str(tmp_path / "z.db")), blobs)
    if layout.startswith("many"):
        assert len(plan_file(snap.blobs).groups)  # the group checksums are right too
    saver.pool.release(snap.arena)
    assert not [p for p in os.listdir(tmp_path) if atomic.parse_temp_path(p)]


def test_the_pinned_pwrites_read_the_arena_memory_with_o_direct(tmp_path, monkeypatch):
    """A spy on the writer threads' pwrite: the data pages are written from the arena (page
    aligned, through the O_DIRECT descriptor), not from the sink's staging buffers."""
    blobs = _random(40, 2)
    snap = BackgroundSaver().snapshot("n", blobs)
    arena = snap.arena.buffer
    lo = arena.ctypes.data
    hi = lo + arena.nbytes
    seen: list[tuple[bool, bool, int]] = []
    real = os.pwrite

    def spy(fd, data, offset):
        mv = memoryview(data)
        addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0
        seen.append((lo <= addr < hi, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct._O_DIRECT), mv.nbytes))
        if lo <= addr < hi:
            assert addr % 4096 == 0 and offset % 4096 == 0 and addr - lo == offset - 64
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", spy)
    NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    from_arena = sum(n for arena_mem, is_direct, n in seen if arena_mem and is_direct)
    assert from_arena == direct.stats.pinned > 0.9 * arena.nbytes
    assert any(not arena_mem for arena_mem, _, _ in seen)  # the head and the tail: staged
    monkeypatch.setattr(direct.os, "pwrite", real)
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


def test_a_misaligned_arena_takes_the_copying_path(tmp_path, monkeypatch):
    monkeypatch.setattr(arenas, "_PAGE_SHIFT", 128)  # 64 bytes off the file's pages
    blobs = _random(30, 3)
    snap = BackgroundSaver().snapshot("n", blobs)
    assert snap.arena.buffer.ctypes.data % 4096 == 128
    NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    assert (image.stats.taken, image.stats.refused, direct.stats.pinned) == (0, 1, 0)
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


def test_dirty_padding_takes_the_copying_path(tmp_path, monkeypatch):
    blobs = {"a": np.arange(10, dtype=np.uint8), "b": np.arange(5000, dtype=np.float64)}
    snap = BackgroundSaver().snapshot("n", blobs)
    snap.arena.buffer[10] = 0xFF  # in a's padding (its 10 bytes are padded to 64)
    NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    assert (image.stats.taken, image.stats.refused, direct.stats.pinned) == (0, 1, 0)
    data = (tmp_path / "z.db").read_bytes()
    assert data == _buffered(tmp_path / "b.db", blobs, monkeypatch)  # the zeros, not 0xFF
    _same(NativeBackend().read(str(tmp_path / "z.db")), blobs)


def test_a_sync_save_of_live_arrays_is_unchanged(tmp_path, monkeypatch):
    blobs = _random(50, 4)
    NativeBackend().write(str(tmp_path / "z.db"), blobs)
    assert (image.stats.taken, direct.stats.pinned) == (0, 0)
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


def test_zero_copy_off_takes_the_copying_path(tmp_path, monkeypatch):
    blobs = _random(20, 5)
    snap = BackgroundSaver().snapshot("n", blobs)
    with knobs.override(zero_copy=False):
        NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    assert (image.stats.taken, direct.stats.pinned) == (0, 0) and direct.stats.copied
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


def test_reused_arena_keeps_zero_padding_across_epochs(tmp_path, monkeypatch):
    """Epoch after epoch the same arena is reused (its padding still zero): every write
    takes the zero-copy path and holds that epoch's values."""
    saver = BackgroundSaver()
    state = _random(60, 6)
    for epoch in range(3):
        blobs = {k: v + epoch for k, v in state.items()}
        saver.start(str(tmp_path / f"e{epoch}.db"), "native", saver.snapshot("n", blobs))
        saver.join(str(tmp_path / f"e{epoch}.db"))
        assert image.stats.taken == epoch + 1 and image.stats.refused == 0
        assert (tmp_path / f"e{epoch}.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)
    assert saver.pool.reused == 2 and saver.pool.allocated == 1
    saver.close()


def test_o_direct_refused_at_open_copies(tmp_path, monkeypatch, o_direct_refused):
    blobs = _random(30, 7)
    snap = BackgroundSaver().snapshot("n", blobs)
    with o_direct_refused():
        NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    assert (image.stats.taken, direct.stats.pinned) == (0, 0)
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


def test_o_direct_refused_at_write_writes_the_arena_plainly(tmp_path, monkeypatch):
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if not refused and fcntl.fcntl(fd, fcntl.F_GETFL) & direct._O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    blobs = _random(30, 8)
    snap = BackgroundSaver().snapshot("n", blobs)
    NativeBackend().write(str(tmp_path / "z.db"), snap.blobs)
    monkeypatch.setattr(direct.os, "pwrite", real)
    assert refused and image.stats.taken == 1
    assert (tmp_path / "z.db").read_bytes() == _buffered(tmp_path / "b.db", blobs, monkeypatch)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failed_pinned_write_keeps_the_old_file_and_frees_the_arena(tmp_path, monkeypatch, err):
    path = tmp_path / "x.db"
    NativeBackend().write(str(path), _random(5, 9))
    before = path.read_bytes()
    saver = BackgroundSaver()
    snap = saver.snapshot("n", _random(40, 10))
    arena = snap.arena
    lo, hi = arena.buffer.ctypes.data, arena.buffer.ctypes.data + arena.nbytes
    real = os.pwrite

    def pwrite(fd, data, offset):
        mv = memoryview(data)
        if mv.nbytes and lo <= np.frombuffer(mv, dtype=np.uint8).ctypes.data < hi and offset > 1 << 17:
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    saver.start(str(path), "native", snap)
    with pytest.raises(OSError) as ei:
        saver.join(str(path))
    assert ei.value.errno == err and ei.value.filename == str(path)
    assert image.stats.taken == 0 and direct.stats.pinned > 0  # it failed on the pinned path
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["x.db"]  # no temp file left
    assert not arena.busy  # the arena may be reused
    saver.close()


def _congruent(n: int, pos: int) -> np.ndarray:
    """``n`` random bytes whose address is congruent to ``pos`` modulo the page size."""
    raw = np.zeros(n + 8192, dtype=np.uint8)
    at = (pos - raw.ctypes.data) % 4096
    out = raw[at : at + n]
    out[:] = np.random.default_rng(n + pos).integers(0, 256, n, dtype=np.uint8)
    return out


@pytest.mark.parametrize(("before", "n", "after"), [
    (64, 5 << 16, 100), (0, 3 << 16, 0), (4096, 1 << 16, 7), (100, 4095, 3),
    (70000, 300001, 5000), ((1 << 16) - 64, (1 << 16) + 64, 0),
])
def test_write_pinned_streams_any_cut(tmp_path, before, n, after):
    """write_pinned between ordinary writes, at any position: the same bytes, and every page
    that can be is written from the caller's memory."""
    rng = np.random.default_rng(before + n)
    head, tail = rng.integers(0, 256, before, dtype=np.uint8), rng.integers(0, 256, after, dtype=np.uint8)
    body = _congruent(n, before)
    path = tmp_path / "f"
    sink = local.LocalStore().create(str(path), before + n + after)
    assert isinstance(sink, direct.DirectSink) and sink.pin_align == 4096
    sink.write(memoryview(head))
    sink.write_pinned(memoryview(body))
    sink.write(memoryview(tail))
    sink.patch(0, b"HEAD"[: before])
    sink.commit()
    want = bytearray(head.tobytes() + body.tobytes() + tail.tobytes())
    want[: min(4, before)] = b"HEAD"[: before]
    assert path.read_bytes() == bytes(want)
    start = max(-(-before // 4096) * 4096, 4096)  # the first page stays in memory for patch
    assert direct.stats.pinned == max(0, (before + n) // 4096 * 4096 - start)


def test_write_pinned_of_an_incongruent_buffer_copies(tmp_path):
    body = _congruent(5 << 16, 64 + 8)
    path = tmp_path / "f"
    sink = local.LocalStore().create(str(path), 64 + body.nbytes)
    sink.write(bytes(64))
    sink.write_pinned(memoryview(body))
    sink.commit()
    assert direct.stats.pinned == 0 and path.read_bytes() == bytes(64) + body.tobytes()


def test_views_out_of_their_arena_order_take_the_copying_path(tmp_path, monkeypatch):
    """The same arena's views in another blob order (or one snapshot saved twice under two
    names) are not at their planned offsets: the copying path, the right bytes."""
    blobs = _random(12, 11)
    snap = BackgroundSaver().snapshot("n", blobs)
    names = list(blobs)[::-1]
    NativeBackend().write(str(tmp_path / "r.db"), {k: snap.blobs[k] for k in names})
    NativeBackend().write(str(tmp_path / "d.db"), {**snap.blobs, "again": snap.blobs["b3"]})
    assert (image.stats.taken, image.stats.refused, direct.stats.pinned) == (0, 2, 0)
    assert (tmp_path / "r.db").read_bytes() == _buffered(tmp_path / "b.db", {k: blobs[k] for k in names}, monkeypatch)
    assert (tmp_path / "d.db").read_bytes() == _buffered(tmp_path / "b.db", {**blobs, "again": blobs["b3"]}, monkeypatch)
