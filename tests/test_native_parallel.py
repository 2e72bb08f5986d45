"""Loads of big segments into fresh buffers by several threads (NativeFile._read_parallel):
the same values as one reader, every kind of damage still reported naming the blob, and
progress counts every byte once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError
from epochal.storage.formats.base import IO_PROGRESS
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native
from epochal.storage.formats.native.reads import parallel
from epochal.storage.io import tuning


@pytest.fixture(autouse=True)
def _small_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "PARALLEL_MIN", 4 << 20)
    monkeypatch.setattr(tuning, "READ_PIECE", 1 << 20)


def _blobs() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    out: dict[str, Any] = {}
    for i in range(9):  # big segments of uneven sizes, not multiples of the piece size
        out[f"big{i}"] = rng.standard_normal(int(rng.integers(300_000, 900_000))).astype(np.float32)
        out[f"small{i}"] = rng.integers(0, 100, 50, dtype=np.int16)
    out["step"] = 7
    out["name"] = "run-1"
    return out


def _segment(path: Path, name: str) -> tuple[int, int, int]:
    """(offset, length, pad) of the one segment of blob ``name``."""
    with NativeFile(path) as f:
        i = f._index.find(name)
        assert i is not None
        k = int(f._index.recs["seg_first"][i])
        return tuple(int(f._index.segs[c][k]) for c in ("offset", "length", "pad"))  # type: ignore[return-value]


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_parallel_path_is_used_and_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    calls: list[int] = []
    real = parallel.read_parallel

    def spy(f: Any, par: Any, verify: bool, got: list[int]) -> None:
        calls.append(len(par))
        real(f, par, verify, got)

    monkeypatch.setattr(parallel, "read_parallel", spy)
    _check(NativeBackend().read(str(path)), blobs)
    _check(NativeBackend().read(str(path), verify=False), blobs)
    assert calls == [9, 9]
    with NativeFile(path) as f:  # a partial load of one big blob: below the threshold
        got = f.read(["big3"])
    assert np.array_equal(got["big3"], blobs["big3"]) and calls == [9, 9]


def test_progress_counts_every_byte(tmp_path: Path) -> None:
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    seen: list[int] = []
    token = IO_PROGRESS.set(seen.append)
    try:
        NativeBackend().read(str(path))
    finally:
        IO_PROGRESS.reset(token)
    with NativeFile(path) as f:  # coalesced small reads also count their padding (< 64 B each)
        st = f.stat()
        assert st.data_bytes <= sum(seen) <= st.data_bytes + 64 * st.segment_count


@pytest.mark.parametrize("where", ["data", "padding"])
def test_damage_in_a_big_segment_names_the_blob(tmp_path: Path, where: str) -> None:
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    off, ln, pad = _segment(path, "big6")
    assert pad > 0 or where == "data"
    pos = off + ln // 2 if where == "data" else off + ln
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="big6") as e:
        NativeBackend().read(str(path))
    assert str(path) in str(e.value)
    # without verification the data flip goes unseen, but nothing crashes
    if where == "data":
        got = NativeBackend().read(str(path), verify=False)
        assert not np.array_equal(got["big6"], blobs["big6"])
        assert np.array_equal(got["big7"], blobs["big7"])


def test_short_read_in_a_thread_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    off, ln, _ = _segment(path, "big8")
    cut, seg_end = off + 1000, off + ln
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if cut <= offset < seg_end:
            return 0  # an unreadable stretch in the middle of big8
        n = sum(memoryview(b).nbytes for b in buffers)
        if offset < cut < offset + n:
            return real(fd, [memoryview(buffers[0]).cast("B")[: cut - offset]], offset)
        return real(fd, buffers, offset, flags) if flags else real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(CheckpointCorruptError, match="truncated") as e:
        NativeBackend().read(str(path))
    assert "big8" in str(e.value)
