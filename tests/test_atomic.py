"""Durable atomic writes: temp names, fsync, rename, cleanup, free-space checks."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from epochal.storage import atomic


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
