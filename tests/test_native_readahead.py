"""Read-ahead of native loads: no hints while the page cache serves every read (tried with
RWF_NOWAIT), WILLNEED hints over just the loaded ranges from the first read it cannot
serve, and the same values whichever way the bytes arrive."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native
from epochal.storage.formats.native.reads import inplace
from epochal.storage.io.local import RWF_NOWAIT

pytestmark = pytest.mark.skipif(not RWF_NOWAIT, reason="RWF_NOWAIT is Linux-only")


def _big() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {f"w{i}": rng.standard_normal((3 << 20) // 4).astype(np.float32) for i in range(3)}


def _small() -> dict[str, Any]:
    rng = np.random.default_rng(2)
    return {f"s{i:04d}": rng.standard_normal(int(rng.integers(2_000, 16_000))).astype(np.float32)
            for i in range(600)}  # > 64 blobs, > PREFETCH_MIN bytes: the batch path


def _spy_fadvise(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    hints: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return hints


def _not_cached(monkeypatch: pytest.MonkeyPatch, served: int = 0, error: int = errno.EAGAIN) -> list[int]:
    """Make RWF_NOWAIT reads look like the file is not cached: the first ``served`` bytes of
    such a read are read, then EAGAIN (or ``error`` at once when ``served`` is 0)."""
    calls: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            calls.append(offset)
            if not served:
                raise OSError(error, os.strerror(error))
            first = memoryview(buffers[0]).cast("B")
            return real(fd, [first[:served]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


@pytest.mark.parametrize("build", [_big, _small], ids=["big", "small"])
def test_cached_file_gets_no_hints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
    blobs = build()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    path.read_bytes()  # in the page cache now
    hints = _spy_fadvise(monkeypatch)
    _check(NativeBackend().read(str(path)), blobs)
    assert hints == []


@pytest.mark.parametrize("build", [_big, _small], ids=["big", "small"])
@pytest.mark.parametrize("served", [0, 4096 * 3])
def test_uncached_file_is_hinted_and_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build: Any, served: int
) -> None:
    blobs = build()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    hints = _spy_fadvise(monkeypatch)
    nowait = _not_cached(monkeypatch, served)
    _check(NativeBackend().read(str(path)), blobs)
    assert len(nowait) == 1  # after the first read the cache cannot serve, no more tries
    assert hints, "a file the cache cannot serve gets read-ahead hints"
    with NativeFile(path) as f:
        data_end = f.stat().file_bytes - f.stat().index_bytes
    first = min(o for o, _ in hints)
    assert first >= nowait[0] + served  # hints start where the cache stopped serving
    assert all(o + n <= data_end for o, n in hints)  # only data ranges, never past them


def test_filesystem_without_nowait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _big()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    _not_cached(monkeypatch, error=errno.EOPNOTSUPP)
    _check(NativeBackend().read(str(path)), blobs)


def test_in_place_load_when_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live torch tensors: verified through the ring, then read in place, hinted ahead."""
    torch = pytest.importorskip("torch")
    saved = {k: torch.from_numpy(v) for k, v in _big().items()}
    path = tmp_path / "x.db"
    write_native(path, saved)
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    monkeypatch.setattr(inplace, "verify_direct", inplace.verify_direct_streamed)
    hints = _spy_fadvise(monkeypatch)
    _not_cached(monkeypatch)
    got = NativeBackend().read(str(path), existing=live)
    for k, v in saved.items():
        assert got[k] is live[k] and live[k].data_ptr() == ptrs[k] and torch.equal(live[k], v), k
    assert hints


def test_short_file_still_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NOWAIT read served short, then the disk ending early: corrupt, naming the file."""
    blobs = _small()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & RWF_NOWAIT:
            return real(fd, [memoryview(buffers[0]).cast("B")[:4096]], offset)
        return 0  # end of file

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(CheckpointCorruptError, match="truncated") as e:
        NativeBackend().read(str(path))
    assert str(path) in str(e.value)
