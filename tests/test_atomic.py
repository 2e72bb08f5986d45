"""Durable atomic writes: temp names, fsync, rename, cleanup, free-space checks."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.storage.io import atomic


def test_temp_path_format_and_parse(tmp_path: Path) -> None:
    final = str(tmp_path / "node0.epoch1.db")
    tmp = atomic.temp_path_for(final)
    assert tmp.startswith(f"{final}.tmp.{atomic.hostname()}.{os.getpid()}.")
    assert atomic.parse_temp_path(tmp) == (final, atomic.hostname(), os.getpid())
    assert atomic.temp_path_for(final) != tmp  # a fresh token each time


@pytest.mark.parametrize(
    "name, expect",
    [
        ("/d/x.db.tmp.host.example.com.123.0badf00d", ("/d/x.db", "host.example.com", 123)),
        ("/d/a.tmp.b.db.tmp.h.7.deadbeef", ("/d/a.tmp.b.db", "h", 7)),
        ("/d/x.db", None),
        ("/d/x.db.tmp.h.notapid.deadbeef", None),
        ("/d/x.db.tmp.h.12.xyz", None),
    ],
)
def test_parse_temp_path(name: str, expect: Any) -> None:
    assert atomic.parse_temp_path(name) == expect


def test_atomic_write_bytes(tmp_path: Path) -> None:
    p = tmp_path / "manifest.json"
    assert atomic.atomic_write_bytes(p, b"one") == 3
    assert p.read_bytes() == b"one"
    atomic.atomic_write_bytes(p, bytearray(b"two!"))
    assert p.read_bytes() == b"two!"
    assert [x.name for x in tmp_path.iterdir()] == ["manifest.json"]


def test_error_removes_temp_and_keeps_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "m"
    atomic.atomic_write_bytes(p, b"old")

    def boom(fd: int, buf: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "write_all", boom)
    with pytest.raises(OSError) as ei:
        atomic.atomic_write_bytes(p, b"new")
    assert ei.value.errno == errno.ENOSPC
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["m"]


def test_failed_fsync_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def bad(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(atomic, "fsync", bad)
    with pytest.raises(OSError):
        atomic.atomic_write_bytes(tmp_path / "m", b"x")
    assert list(tmp_path.iterdir()) == []


def test_exception_inside_block(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with atomic.AtomicFile(tmp_path / "f", size=1) as f:
            atomic.write_all(f.fd, b"x")
            assert os.path.exists(f.temp_path)
            raise RuntimeError("caller failed")
    assert list(tmp_path.iterdir()) == []


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic.atomic_write_bytes(tmp_path / "no" / "m", b"x")


def test_free_space_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Tiny:
        f_bavail = 2
        f_frsize = 512

    atomic.check_free_space(tmp_path / "f", 10)
    monkeypatch.setattr(os, "statvfs", lambda p: Tiny())
    atomic.check_free_space(tmp_path / "f", 1024)
    with pytest.raises(OSError) as ei:
        atomic.atomic_write_bytes(tmp_path / "f", b"x" * 1025)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(tmp_path / "f")
    assert list(tmp_path.iterdir()) == []


def test_fsyncs_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: list[bool] = []
    real = atomic.fsync

    def spy(fd: int) -> None:
        import stat

        kinds.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(atomic, "fsync", spy)
    atomic.atomic_write_bytes(tmp_path / "m", b"x")
    assert kinds == [False, True]


def test_write_all_continues_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, bytes(b)[:3]))
    monkeypatch.setattr(os, "writev", lambda fd, bs: real_write(fd, bytes(bs[0])[:2]))
    p = tmp_path / "w"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        assert atomic.write_all(fd, b"0123456789") == 10
        assert atomic.write_all(fd, [b"abc", memoryview(b"defg"), bytearray(b"h"), b""]) == 8
    finally:
        os.close(fd)
    assert p.read_bytes() == b"0123456789abcdefgh"


def test_write_all_many_buffers(tmp_path: Path) -> None:
    bufs = [bytes([i % 256]) * (i % 5) for i in range(3000)]  # more than IOV_MAX
    p = tmp_path / "v"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        atomic.write_all(fd, bufs)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"".join(bufs)


def test_write_behind_starts_writeback_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AtomicFile.write starts the disk writing each WRITE_BEHIND bytes, over ranges that
    tile what was written, and the file is intact."""
    calls: list[tuple[int, int]] = []
    real = atomic.start_writeback
    monkeypatch.setattr(atomic, "WRITE_BEHIND", 1 << 16)
    monkeypatch.setattr(atomic, "_SFR", atomic._SFR or (lambda *a: 0))

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(atomic, "start_writeback", spy)
    data = np.random.default_rng(0).integers(0, 256, 10 * (1 << 16) + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    with atomic.AtomicFile(path, size=len(data)) as f:
        for start in range(0, len(data), 40_000):
            f.write(data[start : start + 40_000])
        assert f.position == len(data)
    assert path.read_bytes() == data
    assert len(calls) >= 5
    pos = 0
    for offset, nbytes in calls:
        assert offset == pos and nbytes >= 1 << 16
        pos += nbytes
    assert pos <= len(data)


def test_write_behind_stops_when_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(atomic, "WRITE_BEHIND", 1024)
    monkeypatch.setattr(atomic, "_SFR", atomic._SFR or (lambda *a: 0))
    monkeypatch.setattr(atomic, "start_writeback", lambda fd, o, n: calls.append(o) or False)
    path = tmp_path / "f.bin"
    with atomic.AtomicFile(path, size=8192) as f:
        for _ in range(8):
            f.write(b"x" * 1024)
        f.seek(0)
        f.write(b"HEAD")
    assert calls == [0]
    assert path.read_bytes() == b"HEAD" + b"x" * (8192 - 4)


def test_start_writeback_on_a_real_file(tmp_path: Path) -> None:
    """The libc call itself works here (Linux) on a regular file."""
    path = tmp_path / "g.bin"
    with open(path, "wb") as fh:
        fh.write(b"y" * 100_000)
        fh.flush()
        ok = atomic.start_writeback(fh.fileno(), 0, 100_000)
    assert ok is (atomic._SFR is not None)
