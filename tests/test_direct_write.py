"""Big local files are written with O_DIRECT from reused aligned buffers (storage/io/direct.py):
the same bytes as a buffered write, the same atomic contract, and a fallback wherever
O_DIRECT is refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from epochal.storage.formats.native import NativeBackend
from epochal.storage.io import atomic, direct, local, tuning
from epochal.storage.io.direct import DirectSink

pytestmark = pytest.mark.skipif(not direct.direct_supported(), reason="no O_DIRECT here")


@pytest.fixture
def small_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file goes the direct way, through 64 KiB buffers (so a small file spans many)."""
    monkeypatch.setattr(tuning, "DIRECT_MIN", 1)
    monkeypatch.setattr(tuning, "DIRECT_BUFFER", 1 << 16)


def _blobs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"b{i}": rng.standard_normal(int(rng.integers(1, 40000)), dtype=np.float32) for i in range(n)}


def _buffered_bytes(tmp_path: Path, blobs: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(tuning, "DIRECT_MIN", 1 << 62)
        NativeBackend().write(str(tmp_path / "buffered.db"), blobs)
    return (tmp_path / "buffered.db").read_bytes()


@pytest.mark.parametrize("n", [1, 2, 7, 300])
def test_direct_writes_the_same_bytes_as_buffered(tmp_path, small_direct, monkeypatch, n):
    blobs = _blobs(n, n)
    path = tmp_path / "direct.db"
    size = NativeBackend().write(str(path), blobs)
    data = path.read_bytes()
    assert len(data) == size and size % direct.ALIGN  # the tail was padded, then truncated
    assert data == _buffered_bytes(tmp_path, blobs, monkeypatch)
    out = NativeBackend().read(str(path))
    assert list(out) == list(blobs)
    for k, v in blobs.items():
        assert out[k].dtype == v.dtype and out[k].tobytes() == v.tobytes()
    assert not [p for p in os.listdir(tmp_path) if atomic.parse_temp_path(p)]


def test_only_big_files_go_direct(tmp_path, monkeypatch):
    store = local.LocalStore()
    monkeypatch.setattr(tuning, "DIRECT_MIN", 1000)
    small, big = store.create(str(tmp_path / "s"), 999), store.create(str(tmp_path / "b"), 1000)
    try:
        assert type(small) is local.LocalSink and type(big) is DirectSink
    finally:
        small.abort()
        big.abort()
    assert os.listdir(tmp_path) == []  # aborting leaves no temp file


def test_sink_stream_patch_and_exact_buffer_multiples(tmp_path, small_direct):
    """A stream that ends exactly at a buffer boundary, a patch of the first bytes, and a
    file shorter than one buffer."""
    for size in (1 << 16, 3 << 16, 100, 4096):
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        path = str(tmp_path / f"f{size}")
        sink = local.LocalStore().create(path, size)
        assert isinstance(sink, DirectSink)
        sink.write([memoryview(data)[:7], memoryview(data)[7:]])
        sink.patch(0, b"HEAD")
        sink.commit()
        want = b"HEAD" + data.tobytes()[4:]
        assert Path(path).read_bytes() == want


def test_buffers_are_reused_across_saves(tmp_path, small_direct):
    direct._pool.clear()
    NativeBackend().write(str(tmp_path / "a.db"), _blobs(20))
    first = list(direct._pool)
    assert len(first) == tuning.DIRECT_BUFFERS
    NativeBackend().write(str(tmp_path / "b.db"), _blobs(20, 1))
    assert {id(b) for b in direct._pool} == {id(b) for b in first}


def test_o_direct_refused_at_open_falls_back(tmp_path, small_direct, monkeypatch, o_direct_refused):
    blobs = _blobs(30, 3)
    with o_direct_refused():
        NativeBackend().write(str(tmp_path / "d.db"), blobs)
    assert (tmp_path / "d.db").read_bytes() == _buffered_bytes(tmp_path, blobs, monkeypatch)


def test_o_direct_refused_at_write_falls_back(tmp_path, small_direct, monkeypatch):
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if fd not in refused and _is_direct(fd):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    blobs = _blobs(30, 4)
    NativeBackend().write(str(tmp_path / "d.db"), blobs)
    monkeypatch.setattr(direct.os, "pwrite", real)
    assert refused
    assert (tmp_path / "d.db").read_bytes() == _buffered_bytes(tmp_path, blobs, monkeypatch)


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct._O_DIRECT)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_error_names_the_file_and_keeps_the_old_one(tmp_path, small_direct, monkeypatch, err):
    path = tmp_path / "x.db"
    NativeBackend().write(str(path), _blobs(5))
    before = path.read_bytes()
    calls = []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    real = os.pwrite
    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    with pytest.raises(OSError) as ei:
        NativeBackend().write(str(path), _blobs(40, 9))
    assert ei.value.errno == err and ei.value.filename == str(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["x.db"]  # no temp file left


def test_patch_beyond_the_first_buffer(tmp_path, small_direct):
    """A header longer than one buffer (safetensors with many tensors) is patched in full."""
    size = 5 << 16
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    path = str(tmp_path / "p")
    sink = local.LocalStore().create(path, size)
    sink.write(memoryview(data))
    head = bytes(range(256)) * 1000  # 256,000 bytes: about four buffers
    sink.patch(10, head)
    with pytest.raises(ValueError):
        sink.patch(size - 2, b"abc")
    sink.commit()
    want = bytearray(data.tobytes())
    want[10 : 10 + len(head)] = head
    assert Path(path).read_bytes() == bytes(want)


def test_safetensors_db_written_directly_reads_back(tmp_path, small_direct):
    from epochal.storage.formats.base import get_db_type

    blobs = _blobs(50, 5)
    st = get_db_type("safetensors")
    st.write(str(tmp_path / "s.db"), blobs)
    out = st.read(str(tmp_path / "s.db"))
    assert all(out[k].tobytes() == v.tobytes() for k, v in blobs.items())


def test_any_error_in_a_writer_thread_is_raised_not_hung(tmp_path, small_direct, monkeypatch):
    def pwrite(fd, data, offset):
        raise RuntimeError("writer broke")

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    with pytest.raises(RuntimeError, match="writer broke"):
        NativeBackend().write(str(tmp_path / "y.db"), _blobs(60, 2))
    assert os.listdir(tmp_path) == []


def test_on_by_default_for_big_files_only(tmp_path):
    assert tuning.DIRECT_MIN == 512 << 20
    small = local.LocalStore().create(str(tmp_path / "small"), 1 << 20)
    try:
        assert type(small) is local.LocalSink
    finally:
        small.abort()
