"""Cold loads of big segments into fresh buffers read their whole pages with O_DIRECT (issue
27.2): the reader places each big array congruent to its file offset (io/direct.placed), the
parallel reader reads its pages straight from the disk into it and its unaligned head and
tail through the page cache, checksummed piece by piece in the reading thread
(io/direct.read_checked). Bits equal, damage anywhere named, the path really taken (the
O_DIRECT byte counter), and the page cache used where the file is cached, O_DIRECT is
refused or turned off."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError
from epochal.storage.encoding.codecs import buffer_address
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native
from epochal.storage.io import direct, tuning
from epochal.storage.io.local import RWF_NOWAIT

pytestmark = pytest.mark.skipif(not RWF_NOWAIT or not direct.direct_supported(),
                                reason="no RWF_NOWAIT or no O_DIRECT: every load takes the page cache")

MiB = 1 << 20
#: big arrays of sizes that are not multiples of the page (nor of each other), and small blobs
SIZES = {"a": MiB + 3, "b": 3 * MiB + 100, "c": 2 * MiB, "d": MiB + 4093}


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n in SIZES.items()}
    out["f"] = rng.standard_normal((700, 701)).astype(np.float32)  # 1.9 MiB, 2-d
    out["small"] = np.arange(100, dtype=np.int64)
    out["scalar"] = 3.5
    return out


def _cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """RWF_NOWAIT reads fail with EAGAIN, as for a file not in the page cache."""
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)


@pytest.fixture()
def small_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every big segment goes to the parallel reader, in several pieces, over 3 threads."""
    monkeypatch.setattr(tuning, "PARALLEL_MIN", MiB)
    monkeypatch.setattr(tuning, "READ_PIECE", 256 << 10)
    monkeypatch.setattr(tuning, "IO_THREADS", 3)
    direct.stats.reset()


def _segments(path: Path) -> dict[str, tuple[int, int, int]]:
    """blob -> (offset, length, padding) of its first segment."""
    with NativeFile(path, mmap=False) as f:
        idx = f._index
        out = {}
        for name in f.names():
            i = idx.find(name)
            assert i is not None
            if not int(idx.recs["seg_count"][i]):
                continue  # a scalar: no data segment
            k = int(idx.recs["seg_first"][i])
            out[name] = (int(idx.segs["offset"][k]), int(idx.segs["length"][k]), int(idx.segs["pad"][k]))
        return out


def _pages(off: int, n: int) -> int:
    """Bytes of the segment at ``off`` of ``n`` bytes that lie in whole pages (read O_DIRECT)."""
    head = -off % direct.ALIGN
    return (n - head) // direct.ALIGN * direct.ALIGN


def test_cold_fresh_arrays_read_with_o_direct_bit_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        small_tuning: None) -> None:
    state = _state()
    path = tmp_path / "a.db"
    write_native(path, state)
    segs = _segments(path)
    _cold(monkeypatch)
    got = NativeBackend().read(str(path))
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            assert got[k].tobytes() == v.tobytes(), k
        else:
            assert got[k] == v
    big = [k for k in segs if segs[k][1] >= tuning.BIG_SEGMENT]
    assert sorted(big) == ["a", "b", "c", "d", "f"]
    for k in big:  # placed congruent to its file offset modulo the page
        addr = int(got[k].__array_interface__["data"][0])
        assert (addr - segs[k][0]) % direct.ALIGN == 0, k
        assert got[k].flags.writeable and got[k].flags.c_contiguous
    assert direct.stats.read == sum(_pages(segs[k][0], segs[k][1]) for k in big)


def test_cold_fresh_torch_tensors_read_with_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     small_tuning: None) -> None:
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    torch.manual_seed(0)
    state = {"w": torch.randn(513, 1025), "p": torch.nn.Parameter(torch.randn(3 * MiB // 8 + 1, dtype=torch.float64))}
    path = tmp_path / "t.db"
    write_native(path, state)
    _cold(monkeypatch)
    got = NativeBackend().read(str(path))
    assert torch.equal(got["w"].view(torch.int32), state["w"].view(torch.int32))
    assert isinstance(got["p"], torch.nn.Parameter) and torch.equal(got["p"].detach(), state["p"].detach())
    assert direct.stats.read > 4 * MiB


@pytest.mark.parametrize("where", ["head", "first-page", "middle-piece", "last-page", "tail", "padding"])
def test_damage_in_any_piece_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_tuning: None,
                                      where: str) -> None:
    state = _state()
    path = tmp_path / "a.db"
    write_native(path, state)
    off, n, pad = _segments(path)["b"]
    head = -off % direct.ALIGN
    assert head and pad, "the test wants an unaligned head and a padding"
    at = {"head": off, "first-page": off + head, "middle-piece": off + n // 2,
          "last-page": off + head + _pages(off, n) - 1, "tail": off + n - 1, "padding": off + n}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    _cold(monkeypatch)
    with pytest.raises(CheckpointCorruptError, match="padding" if where == "padding" else None) as ei:
        NativeBackend().read(str(path))
    assert ei.value.blob == "b" and str(path) in str(ei.value)
    assert direct.stats.read > 0  # found on the O_DIRECT path


@pytest.mark.parametrize("where", ["head", "middle-piece", "tail"])
def test_staged_live_load_damage_leaves_live_tensors_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_tuning: None, where: str
) -> None:
    """The opt-in staged path (tuning.DIRECT_STAGE_MAX): every piece checked before the first
    live byte is written; bits equal when nothing is damaged."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    monkeypatch.setattr(tuning, "DIRECT_STAGE_MAX", 1 << 40)
    torch.manual_seed(0)
    src = {"w": torch.randn(3 * MiB // 4 + 5), "v": torch.randn(MiB // 4 + 1000)}
    path = tmp_path / "t.db"
    write_native(path, src)
    live = {"w": torch.zeros(3 * MiB // 4 + 5), "v": torch.zeros(MiB // 4 + 1000)}
    ptr = live["w"].data_ptr()
    _cold(monkeypatch)
    good = NativeBackend().read(str(path), existing=live)
    assert good["w"] is live["w"] and live["w"].data_ptr() == ptr
    assert all(torch.equal(live[k].view(torch.int32), src[k].view(torch.int32)) for k in src)
    assert direct.stats.read > 3 * MiB
    off, n, _ = _segments(path)["w"]
    at = {"head": off, "middle-piece": off + n // 2, "tail": off + n - 1}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    for t in live.values():
        t.fill_(2.0)
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(str(path), existing=live)
    assert ei.value.blob == "w" and str(path) in str(ei.value)
    assert all(bool((t == 2.0).all()) for t in live.values())


def test_a_truncated_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_tuning: None) -> None:
    path = tmp_path / "a.db"
    write_native(path, {"x": np.ones(3 * MiB, np.uint8), "y": np.ones(2 * MiB, np.uint8)})
    off, n, _ = _segments(path)["y"]
    real = direct._pread_all

    def short(fd: int, view: memoryview, offset: int) -> int:
        if offset >= off + n // 2:  # the disk ends in the middle of y
            return 0
        return real(fd, view, offset)

    monkeypatch.setattr(direct, "_pread_all", short)
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return 0 if offset >= off + n // 2 else real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(CheckpointCorruptError, match="truncated") as ei:
        NativeBackend().read(str(path))
    assert ei.value.blob == "y"


@pytest.mark.parametrize("when", ["read", "open"])
def test_refused_o_direct_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       small_tuning: None, o_direct_refused: Any,
                                                       when: str) -> None:
    state = _state()
    path = tmp_path / "a.db"
    write_native(path, state)

    def refused(fd: int, view: memoryview, offset: int) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    if when == "read":
        monkeypatch.setattr(direct, "_pread_all", refused)
    _cold(monkeypatch)
    if when == "open":
        with o_direct_refused():
            got = NativeBackend().read(str(path))
    else:
        got = NativeBackend().read(str(path))
    assert all(got[k].tobytes() == v.tobytes() for k, v in state.items() if isinstance(v, np.ndarray))
    assert direct.stats.read == 0


@pytest.mark.parametrize("why", ["cached", "turned-off", "mmap"])
def test_page_cache_when_cached_or_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_tuning: None,
                                              why: str) -> None:
    state = _state()
    path = tmp_path / "a.db"
    write_native(path, state)
    if why == "cached":
        path.read_bytes()  # every page in the page cache: a copy from there is faster
    else:
        _cold(monkeypatch)
    if why == "turned-off":
        monkeypatch.setattr(tuning, "DIRECT_READ", False)
    with NativeFile(path, mmap=why == "mmap") as f:
        got = f.read()
        assert all(np.array_equal(got[k], v) for k, v in state.items() if isinstance(v, np.ndarray))
    assert direct.stats.read == 0


def test_placed_memory_is_congruent_and_sized() -> None:
    for n, off in [(MiB, 0), (MiB + 3, 64), (5000, 4096 * 7 + 4032), (1, 123)]:
        mv = direct.placed(n, off)
        assert mv.nbytes == n and not mv.readonly
        assert (buffer_address(mv) - off) % direct.ALIGN == 0
