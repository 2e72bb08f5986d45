"""The native db format: exact round trips, partial and lazy loads, and error semantics."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointVersionError,
    MissingBlobError,
    UnsupportedBlobError,
)
from epochal.storage.encoding import codecs as C
from epochal.storage.formats.base import ReadStats, get_db_type
from epochal.storage.formats.native import (
    NativeBackend,
    layout,
    open_native,
    stat_native,
    write_native,
)
from epochal.storage.io import atomic, checksum, tuning


def nan_with_payload(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000000 | payload))[0]


def sample_blobs() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 4)).astype(np.float32)
    f32.view(np.uint32)[0, 0] = 0x7FC00123  # NaN with a payload
    f32[0, 1] = -0.0
    return {
        "f32": f32,
        "f16": rng.standard_normal(7).astype(np.float16),
        "f64_be": rng.standard_normal(5).astype(">f8"),
        "i16_be": np.arange(-4, 4, dtype=">i2"),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, -0.0 - 1j]),
        "zero_d": np.array(3.5, dtype=np.float64),
        "empty": np.empty((0, 5), dtype=np.int32),
        "empty_1d": np.array([], dtype=np.float32),
        "bytes_arr": np.array([b"ab", b"c"], dtype="S3"),
        "unicode_arr": np.array(["hé", "x"], dtype="<U2"),
        "dt64": np.array(["2024-01-01", "NaT"], dtype="datetime64[D]"),
        "structured": np.array(
            [(1, (2.0, 3.0)), (4, (5.0, -0.0))], dtype=[("a", "<i4"), ("b", ">f8", (2,))]
        ),
        "noncontig": np.arange(24, dtype=np.int64).reshape(4, 6).T,
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int8).reshape(2, 3)),
        "np_f32": np.float32(1.5),
        "np_bool": np.bool_(True),
        "np_i64": np.int64(-7),
        "none": None,
        "true": True,
        "false": False,
        "int": -(2**100) + 3,
        "zero": 0,
        "float": 0.1,
        "negzero": -0.0,
        "inf": -math.inf,
        "nan_payload": nan_with_payload(0x1234),
        "str": "héllo wörld ✓",
        "empty_str": "",
        "surrogate": "a\udc80b",
        "bytes": b"\x00\xff\x01",
        "empty_bytes": b"",
        "bytearray": bytearray(b"xyz"),
        "": "the empty name",
        "ünï/cödé name": np.ones(3, dtype=np.uint8),
    }


def same(a: Any, b: Any) -> bool:
    """Exact equality: type, dtype, shape and bits (NaN payloads, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


@pytest.fixture
def db(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    blobs = sample_blobs()
    path = str(tmp_path / "node0.epoch3.db")
    write_native(path, blobs)
    return path, blobs


def rewrite_index(path: str, edit: Any) -> None:
    """Apply ``edit(bytearray index) -> bytes`` and fix both checksums, as a crafted file would."""
    raw = bytearray(Path(path).read_bytes())
    sb = layout.SUPER.unpack(bytes(raw[:64]))
    ioff, ilen = sb[5], sb[6]
    fn = checksum.checksum_function(checksum.ALGORITHM_NAMES[sb[3]])
    index = bytes(edit(bytearray(raw[ioff : ioff + ilen])))
    assert len(index) == ilen
    raw[ioff:] = index
    fields = list(sb)
    fields[11] = fn(index, 0)
    body = layout.SUPER.pack(*fields)[:60]
    raw[:64] = body + struct.pack("<I", fn(body, 0))
    Path(path).write_bytes(bytes(raw))


def rewrite_superblock(path: str, **changes: int) -> None:
    names = ["magic", "major", "minor", "algo", "align", "ioff", "ilen", "fsize", "nblobs",
             "nsegs", "dbytes", "icrc", "scrc"]
    raw = bytearray(Path(path).read_bytes())
    fields = list(layout.SUPER.unpack(bytes(raw[:64])))
    for k, v in changes.items():
        fields[names.index(k)] = v
    body = layout.SUPER.pack(*fields)[:60]
    raw[:64] = body + struct.pack("<I", checksum.checksum(body, "crc32c"))
    Path(path).write_bytes(bytes(raw))


# --------------------------------------------------------------------------- round trips
def test_registered() -> None:
    assert isinstance(get_db_type("native"), NativeBackend)


def test_round_trip_every_blob_type(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    out = get_db_type("native").read(path)
    assert list(out) == list(blobs)
    for name, value in blobs.items():
        expect = value.copy(order="C") if isinstance(value, np.ndarray) else value
        assert same(out[name], expect), name
    assert out["noncontig"].shape == (6, 4)


def test_loaded_arrays_are_writable_and_aligned(db: tuple[str, dict[str, Any]]) -> None:
    out = get_db_type("native").read(db[0])
    arr = out["f32"]
    assert arr.flags.writeable and arr.flags.c_contiguous
    arr[0, 0] = 1.0  # does not raise


def test_segments_are_aligned_and_tile_the_file(db: tuple[str, dict[str, Any]]) -> None:
    with open_native(db[0]) as f:
        segs = f._index.segs
        assert np.all(segs["offset"] % 64 == 0)
        assert segs["offset"][0] == 64


def test_write_returns_size_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    n = get_db_type("native").write(str(path), {"x": np.arange(100)})
    assert n == path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.db"]


def test_deterministic_bytes(tmp_path: Path) -> None:
    blobs = sample_blobs()
    write_native(tmp_path / "a.db", blobs)
    write_native(tmp_path / "b.db", blobs)
    assert (tmp_path / "a.db").read_bytes() == (tmp_path / "b.db").read_bytes()


def test_empty_db(tmp_path: Path) -> None:
    path = str(tmp_path / "e.db")
    write_native(path, {})
    assert get_db_type("native").read(path) == {}
    assert stat_native(path).blob_count == 0


def test_big_and_small_segments_with_small_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exercise chunked big-segment I/O and coalesced small-segment I/O at test sizes."""
    monkeypatch.setattr(tuning, "BIG_SEGMENT", 4096)
    monkeypatch.setattr(tuning, "CHUNK", 1000)
    monkeypatch.setattr(tuning, "BATCH_BYTES", 3000)
    monkeypatch.setattr(tuning, "PREFETCH_MIN", 1000)
    monkeypatch.setattr(tuning, "PREFETCH_WINDOW", 5000)
    monkeypatch.setattr(tuning, "PREFETCH_STEP", 2000)
    rng = np.random.default_rng(2)
    blobs: dict[str, Any] = {f"s{i}": rng.integers(0, 255, int(rng.integers(0, 300)), dtype=np.uint8)
                             for i in range(300)}
    blobs["big"] = rng.standard_normal(3001)
    blobs["big2"] = rng.standard_normal(1024)  # exactly 8 KiB, no padding
    path = str(tmp_path / "c.db")
    write_native(path, blobs)
    for verify in (True, False):
        out = NativeBackend().read(path, verify=verify)
        assert all(same(out[k], v) for k, v in blobs.items())
    part = NativeBackend().read(path, ["s7", "big", "s299"])
    assert list(part) == ["s7", "s299", "big"]  # file order and same(part["big"], blobs["big"])


def test_many_blobs_partial_by_bisection(tmp_path: Path) -> None:
    blobs = {f"layer{i:05d}.weight": np.full(i % 7 + 1, i, dtype=np.int32) for i in range(3000)}
    path = str(tmp_path / "m.db")
    write_native(path, blobs)
    b = NativeBackend()
    out = b.read(path, ["layer01234.weight", "layer00000.weight", "layer02999.weight"])
    assert list(out) == ["layer00000.weight", "layer01234.weight", "layer02999.weight"]
    assert same(out["layer01234.weight"], blobs["layer01234.weight"])
    with pytest.raises(MissingBlobError) as ei:
        b.read(path, ["layer01234.weight", "layer9"])
    assert path in str(ei.value) and "layer9" in str(ei.value)
    many = [f"layer{i:05d}.weight" for i in range(0, 3000, 2)]
    assert list(b.read(path, many)) == many


# --------------------------------------------------------------------------- partial / options
def test_partial_and_missing(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    b = NativeBackend()
    stats = ReadStats()
    out = b.read(path, ["str", "f32"], stats=stats)
    assert set(out) == {"str", "f32"}
    assert stats.blobs == 2 and stats.nbytes == blobs["f32"].nbytes + len(blobs["str"].encode())
    with pytest.raises(MissingBlobError) as ei:
        b.read(path, ["str", "nope"])
    assert "nope" in str(ei.value) and path in str(ei.value)
    assert isinstance(ei.value, CheckpointError)
    out = b.read(path, ["str", "nope"], allow_incomplete=True)
    assert list(out) == ["str"]
    assert b.read(path, "str") == {"str": blobs["str"]}  # a bare name is one name


def test_describe(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    infos = NativeBackend().describe(path)
    assert [i.name for i in infos] == list(blobs)
    by = {i.name: i for i in infos}
    assert by["f32"].kind == "ndarray" and by["f32"].dtype == "<f4" and by["f32"].shape == (3, 4)
    assert by["f32"].nbytes == 48 and by["f32"].checksum.startswith("crc32c:")
    assert by["none"].nbytes == 0 and by["none"].checksum is None
    assert by["structured"].dtype is not None


def test_stat_and_digest(tmp_path: Path, db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    st = stat_native(path)
    assert st.format_version == "1.0" and st.major == 1 and st.blob_count == len(blobs)
    assert st.file_bytes == os.path.getsize(path) and st.checksum_algorithm == "crc32c"
    b = NativeBackend()
    assert b.digest(path) == st.digest
    other = str(tmp_path / "o.db")
    write_native(other, blobs)
    assert b.digest(other) == st.digest  # same content, same digest
    blobs2 = dict(blobs, int=5)
    write_native(other, blobs2)
    assert b.digest(other) != st.digest


def test_digest_reads_header_only(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    before = NativeBackend().digest(path)
    raw = bytearray(Path(path).read_bytes())
    raw[70] ^= 0xFF  # data damage: digest does not read data
    Path(path).write_bytes(bytes(raw))
    assert NativeBackend().digest(path) == before


def test_verify_false_skips_data_checksums(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    with open_native(path) as f:
        off = int(f._index.segs["offset"][0])
    raw = bytearray(Path(path).read_bytes())
    raw[off] ^= 1
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().read(path)
    out = NativeBackend().read(path, verify=False)  # the documented escape hatch
    assert not same(out["f32"], blobs["f32"])


def test_crc32_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "HAVE_CRC32C", False)
    assert checksum.default_algorithm() == "crc32"
    blobs = sample_blobs()
    path = str(tmp_path / "z.db")
    write_native(path, blobs)
    assert stat_native(path).checksum_algorithm == "crc32"
    out = NativeBackend().read(path)
    assert all(same(out[k], v.copy(order="C") if isinstance(v, np.ndarray) else v)
               for k, v in blobs.items())
    raw = bytearray(Path(path).read_bytes())
    raw[64] ^= 4
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().read(path)


# --------------------------------------------------------------------------- lazy / mmap
def test_open_native_mmap(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    with open_native(path) as f:
        assert f.mmap and len(f) == len(blobs) and list(f) == list(blobs)
        assert "f32" in f and "nope" not in f and 3 not in f
        arr = f["f32"]
        assert same(arr, blobs["f32"]) and not arr.flags.writeable
        assert f["str"] == blobs["str"]
        assert f.info("f64_be").dtype == ">f8"
        assert f.stat().blob_count == len(blobs)
        part = f.read(["i16_be", "nope"], allow_incomplete=True)
        assert list(part) == ["i16_be"]
        f.verify()
        f.verify(["f32"])
        with pytest.raises(MissingBlobError):
            f.info("nope")
    assert same(arr, blobs["f32"])  # still readable after close: the map lives on


def test_open_native_pread_mode(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    with open_native(path, mmap=False) as f:
        assert not f.mmap
        assert same(f["u64"], blobs["u64"]) and f["u64"].flags.writeable
    with pytest.raises(ValueError):
        f.read(["u64"])


def test_mmap_detects_damage(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    with open_native(path) as f:
        seg = f._index.segs[f._index.seg_range(f._index.find("str"))[0]]
    raw = bytearray(Path(path).read_bytes())
    raw[int(seg["offset"]) + 1] ^= 0x10
    Path(path).write_bytes(bytes(raw))
    with open_native(path) as f:
        assert f["f32"] is not None  # undamaged blobs still load
        with pytest.raises(CheckpointCorruptError) as ei:
            f["str"]
        assert ei.value.blob == "str" and ei.value.path == path
        with pytest.raises(CheckpointCorruptError):
            f.verify()


# --------------------------------------------------------------------------- errors
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        NativeBackend().read(str(tmp_path / "none.db"))
    with pytest.raises(CheckpointError):
        NativeBackend().read(str(tmp_path / "none.db"))
    assert not NativeBackend().exists(str(tmp_path / "none.db"))


def test_missing_directory_is_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        NativeBackend().write(str(tmp_path / "no" / "dir.db"), {"x": 1})


def test_unsupported_value_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    write_native(path, {"old": 1})
    before = path.read_bytes()
    with pytest.raises(UnsupportedBlobError) as ei:
        NativeBackend().write(str(path), {"ok": 1, "bad": object()})
    assert "bad" in str(ei.value)
    with pytest.raises(UnsupportedBlobError):
        NativeBackend().write(str(path), {"objarr": np.array([object()])})
    with pytest.raises(UnsupportedBlobError):
        NativeBackend().write(str(path), {3: 1})  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.db"]


def test_enospc_during_write_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "n.db"
    write_native(path, {"v": 1})
    before = path.read_bytes()
    calls = []

    def full(fd: int, buf: Any) -> int:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "write_all", full)
    with pytest.raises(OSError) as ei:
        NativeBackend().write(str(path), {"v": np.zeros(1000)})
    assert ei.value.errno == errno.ENOSPC and calls
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.db"]


def test_statvfs_free_space_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Tiny:
        f_bavail = 1
        f_frsize = 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny())
    path = str(tmp_path / "s.db")
    with pytest.raises(OSError) as ei:
        NativeBackend().write(path, {"v": np.zeros(10000)})
    assert ei.value.errno == errno.ENOSPC and path in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_fsync_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = atomic.fsync
    monkeypatch.setattr(atomic, "fsync", lambda fd: (seen.append(fd), real(fd))[1])
    write_native(tmp_path / "f.db", {"v": 1})
    assert len(seen) == 2  # the file, then its directory


@pytest.mark.parametrize("cut", [0, 10, 63, 64, 100, -1, -30])
def test_truncated(db: tuple[str, dict[str, Any]], cut: int) -> None:
    path, _ = db
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:cut] if cut >= 0 else raw[:cut])
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.path == path and path in str(ei.value)


def test_trailing_garbage(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(CheckpointCorruptError, match="longer"):
        NativeBackend().read(path)


def test_flip_in_data_names_blob(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    with open_native(path) as f:
        k = f._index.seg_range(f._index.find("c128"))[0]
        off = int(f._index.segs["offset"][k]) + 5
    raw = bytearray(Path(path).read_bytes())
    raw[off] ^= 0x80
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "c128" and "c128" in str(ei.value) and path in str(ei.value)
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().verify(path)
    assert ei.value.blob == "c128"
    assert NativeBackend().read(path, ["f32"])  # a partial load of other blobs still works


def test_flip_in_padding_detected(tmp_path: Path) -> None:
    path = str(tmp_path / "p.db")
    write_native(path, {"a": np.ones(3, dtype=np.uint8), "b": np.ones(3, dtype=np.uint8)})
    raw = bytearray(Path(path).read_bytes())
    raw[64 + 10] ^= 1  # inside a's padding
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "a"


@pytest.mark.parametrize("where", ["magic", "superblock", "index"])
def test_flip_in_header(db: tuple[str, dict[str, Any]], where: str) -> None:
    path, _ = db
    raw = bytearray(Path(path).read_bytes())
    pos = {"magic": 2, "superblock": 20, "index": len(raw) - 3}[where]
    raw[pos] ^= 0x04
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob is None and path in str(ei.value)
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().describe(path)


def test_newer_major_version_rejected(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    rewrite_superblock(path, major=layout.FORMAT_MAJOR + 1, minor=5)
    with pytest.raises(CheckpointVersionError) as ei:
        NativeBackend().read(path)
    assert f"{layout.FORMAT_MAJOR + 1}.5" in str(ei.value) and "upgrade" in str(ei.value)
    with pytest.raises(CheckpointVersionError):
        stat_native(path)


def test_newer_minor_version_is_read(db: tuple[str, dict[str, Any]]) -> None:
    path, blobs = db
    rewrite_superblock(path, minor=9)
    assert same(NativeBackend().read(path, ["f32"])["f32"], blobs["f32"])


def test_absurd_counts_are_rejected_without_allocating(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    rewrite_superblock(path, nblobs=2**32 - 1)
    with pytest.raises(CheckpointCorruptError, match="absurd"):
        NativeBackend().read(path)


def test_absurd_index_position(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db
    rewrite_superblock(path, ilen=2**62)
    with pytest.raises(CheckpointCorruptError, match="absurd"):
        NativeBackend().read(path)


def test_absurd_segment_length(db: tuple[str, dict[str, Any]]) -> None:
    path, _ = db

    def edit(index: bytearray) -> bytearray:
        n = stat_native(path).blob_count
        pos = layout.INDEX_HEAD.size + n * layout.REC_DTYPE.itemsize + 8  # segment 0 length
        index[pos : pos + 8] = struct.pack("<Q", 2**60)
        return index

    rewrite_index(path, edit)
    with pytest.raises(CheckpointCorruptError, match="tile"):
        NativeBackend().read(path)


def _edit_metas(path: str, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)

    def edit(index: bytearray) -> bytearray:
        pos = bytes(index).rindex(old)
        index[pos : pos + len(old)] = new
        return index

    rewrite_index(path, edit)


def test_unknown_dtype_names_blob(tmp_path: Path) -> None:
    path = str(tmp_path / "d.db")
    write_native(path, {"ok": 1, "w": np.zeros(2, dtype="<f4")})
    _edit_metas(path, b'"<f4"', b'"<x4"')
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "w"
    _edit_metas(path, b'"<x4"', b'"|O8"')  # object dtypes are refused too
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "w"


def test_unknown_kind_names_blob(tmp_path: Path) -> None:
    path = str(tmp_path / "k.db")
    write_native(path, {"w": np.zeros(2)})
    _edit_metas(path, b'"ndarray"', b'"ndarrax"')
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "w" and "ndarrax" in str(ei.value)


def test_meta_shape_disagreeing_with_length(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    write_native(path, {"w": np.zeros(4, dtype=np.uint8)})
    _edit_metas(path, b"[4]", b"[5]")
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(path)
    assert ei.value.blob == "w"
    with open_native(path) as f:  # the mmap path checks in decode
        with pytest.raises(CheckpointCorruptError):
            f["w"]


def test_bad_meta_json(tmp_path: Path) -> None:
    path = str(tmp_path / "j.db")
    write_native(path, {"w": np.zeros(4, dtype=np.uint8)})
    _edit_metas(path, b'{"dtype"', b'{"dtype\\')
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().read(path)


class _Spy:
    """A codec that records decode calls (to prove nothing is decoded before verification)."""

    kind = "test.spy"
    decoded: list[Any] = []

    def accepts(self, value: Any) -> bool:
        return isinstance(value, _SpyValue)

    def encode(self, value: Any) -> C.Encoded:
        return C.Encoded(self.kind, {"n": 2}, [memoryview(b"ab"), memoryview(b"")])

    def allocate(self, meta: dict[str, Any], sizes: Any) -> list[memoryview]:
        return C.fresh_buffers(sizes)

    def decode(self, meta: dict[str, Any], buffers: Any, existing: Any = None) -> Any:
        self.decoded.append(existing)
        return _SpyValue(bytes(buffers[0]))


class _SpyValue:
    def __init__(self, data: bytes = b"") -> None:
        self.data = data


def test_nothing_decoded_before_all_checksums(tmp_path: Path) -> None:
    C.register_codec(_Spy())
    path = str(tmp_path / "spy.db")
    write_native(path, {"spy": _SpyValue(), "later": np.arange(10)})
    live = object()
    out = NativeBackend().read(path, existing={"spy": live})
    assert out["spy"].data == b"ab" and _Spy.decoded == [live]
    _Spy.decoded.clear()
    with open_native(path) as f:
        k = f._index.seg_range(f._index.find("later"))[0]
        off = int(f._index.segs["offset"][k])
    raw = bytearray(Path(path).read_bytes())
    raw[off] ^= 1
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().read(path, existing={"spy": live})
    assert _Spy.decoded == []


def test_format_doc_exists() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "format.md"
    text = doc.read_text()
    version = f"version {layout.FORMAT_MAJOR}.{layout.FORMAT_MINOR}"
    assert version in text.lower() and "CheckpointCorruptError" in text
    json.dumps(text)  # plain text
