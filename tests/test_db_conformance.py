"""The db backend conformance suite: every registered db_type passes the same tests.

A new backend (fsspec-backed, or a new format) is registered and then runs this file as it
is: round trips bit for bit, partial reads, missing blobs named, damage found and named,
describe, digest, stat and sniff (after fsspec's ``tests/abstract`` suite). Every test runs
on the local disk, on fsspec's memory:// and on moto's S3 server (127.0.0.1): the formats
read and write through the byte-store seam unchanged."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_native_format import same

from epochal.errors import CheckpointCorruptError, CheckpointNotFoundError, MissingBlobError
from epochal.storage.formats.base import (
    SNIFF_BYTES,
    DbBackend,
    DbStat,
    available_db_types,
    get_db_type,
    sniff_db_type,
)

DB_TYPES = available_db_types()
MARK = np.full(8192, 0x5A, dtype=np.uint8)  # a run of bytes to find (and damage) in any file


@pytest.fixture(params=DB_TYPES)
def backend(request: pytest.FixtureRequest) -> DbBackend:
    return get_db_type(request.param)


class Place:
    """A folder on one kind of store, with the raw file operations the tests need."""

    def __init__(self, root: str, local: bool) -> None:
        self.root, self.local = root, local

    def __truediv__(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _fs(self, p: str) -> tuple[Any, str]:
        from epochal.storage.io.remote.fsspec_store import filesystem_for

        return filesystem_for(p)

    def read_bytes(self, p: str) -> bytes:
        if self.local:
            return Path(p).read_bytes()
        fs, path = self._fs(p)
        return bytes(fs.cat_file(path))

    def write_bytes(self, p: str, data: bytes) -> None:
        if self.local:
            Path(p).write_bytes(data)
            return
        fs, path = self._fs(p)
        fs.pipe_file(path, data)

    def size(self, p: str) -> int:
        return len(self.read_bytes(p))

    def names(self) -> list[str]:
        if self.local:
            return sorted(os.listdir(self.root))
        fs, path = self._fs(self.root)
        fs.invalidate_cache()
        return sorted(k.rsplit("/", 1)[-1] for k in fs.find(path))


@pytest.fixture(params=["local", "memory", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    """The folder each test writes in: local, memory:// or moto S3."""
    if request.param == "local":
        yield Place(str(tmp_path), True)
        return
    if request.param == "memory":
        pytest.importorskip("fsspec", reason="the s3 extra is not installed")
        yield Place(f"memory://conformance-{secrets.token_hex(4)}", False)
        return
    opts = request.getfixturevalue("s3")
    from epochal.storage.io.remote.fsspec_store import set_storage_options

    root = f"s3://ckpts/conformance-{secrets.token_hex(4)}"
    set_storage_options(root, opts)
    yield Place(root, False)
    set_storage_options(root, None)


def _blobs() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "big": rng.standard_normal(300_000),  # > 1 MiB: the big-segment paths
        "ints": np.arange(-5, 5, dtype=np.int64),
        "be": np.arange(6, dtype=">i4"),
        "zero_d": np.array(3.5, dtype=np.float16),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "flags": np.array([True, False, True]),
        "structured": np.zeros(4, dtype=[("x", "<f4"), ("y", "<i8", (2,))]),
        "mark": MARK,
        "step": 12,
        "big_int": 2**80 + 1,
        "lr": -0.0,
        "nan": float("nan"),
        "on": True,
        "name": "héllo",
        "raw": b"\x00\xff\x01",
        "none": None,
        "np_scalar": np.float32(2.5),
        "tree": {"a": [1, 2.0, np.ones(3, dtype=np.int8)], "b": ("x", None)},
    }


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of decoded values, containers included."""
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return same(a, b)


def _write(backend: DbBackend, path: str, blobs: dict[str, Any]) -> str:
    p = str(path)
    n = backend.write(p, blobs)
    assert n == get_db_type(backend.name).stat(p).file_bytes
    return p


def test_round_trip_is_bit_exact(backend: DbBackend, place: Place) -> None:
    blobs = _blobs()
    p = _write(backend, place / "n.0", blobs)
    got = backend.read(p)
    assert list(got) == list(blobs)
    for k, v in blobs.items():
        assert _same(got[k], v), k
    assert backend.exists(p) and not backend.exists(place / "absent")


def test_many_blobs_without_data(backend: DbBackend, place: Place) -> None:
    """More blobs than the bulk-load threshold, none with bytes (Python scalars only)."""
    blobs = {f"k{i:03d}": float(i) / 3 for i in range(200)}
    p = _write(backend, place / "n.0", blobs)
    assert backend.read(p) == blobs
    assert backend.check(p) == []


def test_partial_read(backend: DbBackend, place: Place) -> None:
    blobs = _blobs()
    p = _write(backend, place / "n.0", blobs)
    got = backend.read(p, ["tree", "w"])
    assert sorted(got) == ["tree", "w"]
    assert _same(got["w"], blobs["w"]) and _same(got["tree"], blobs["tree"])


def test_missing_blob_names_file_and_blob(backend: DbBackend, place: Place) -> None:
    p = _write(backend, place / "n.0", _blobs())
    with pytest.raises(MissingBlobError) as e:
        backend.read(p, ["w", "no_such_blob"])
    assert p in str(e.value) and "no_such_blob" in str(e.value)
    assert list(backend.read(p, ["w", "no_such_blob"], allow_incomplete=True)) == ["w"]


def test_missing_file_is_named(backend: DbBackend, place: Place) -> None:
    p = place / "absent.0"
    with pytest.raises(CheckpointNotFoundError) as e:
        backend.read(p)
    assert p in str(e.value)


def test_flipped_byte_found_and_named(backend: DbBackend, place: Place) -> None:
    p = _write(backend, place / "n.0", _blobs())
    assert backend.check(p) == []
    backend.verify(p)
    data = bytearray(place.read_bytes(p))
    at = data.find(MARK.tobytes())
    assert at > 0
    data[at + len(MARK) // 2] ^= 0x01
    place.write_bytes(p, bytes(data))
    problems = backend.check(p)
    assert problems and all(q.path == p for q in problems)
    assert [q.blob for q in problems] == ["mark"]
    assert "checksum" in problems[0].message
    with pytest.raises(CheckpointCorruptError) as e:
        backend.verify(p)
    assert e.value.path == p and e.value.blob == "mark"
    with pytest.raises(CheckpointCorruptError):
        backend.read(p)
    assert _same(backend.read(p, ["w"])["w"], _blobs()["w"])  # the other blobs still load


def test_truncated_file_is_one_problem(backend: DbBackend, place: Place) -> None:
    p = _write(backend, place / "n.0", _blobs())
    data = place.read_bytes(p)
    place.write_bytes(p, data[: len(data) // 2])
    problems = backend.check(p)
    assert len(problems) >= 1 and all(q.path == p for q in problems)


def test_describe(backend: DbBackend, place: Place) -> None:
    blobs = _blobs()
    p = _write(backend, place / "n.0", blobs)
    infos = backend.describe(p)
    assert [i.name for i in infos] == list(blobs)
    by = {i.name: i for i in infos}
    assert by["w"].kind == "ndarray" and by["w"].dtype == "<f4" and by["w"].shape == (64, 33)
    assert by["w"].nbytes == blobs["w"].nbytes and by["big"].nbytes == blobs["big"].nbytes
    assert by["empty"].shape == (0, 3) and by["empty"].nbytes == 0
    assert by["step"].kind == "py" and by["tree"].kind == "tree"
    assert all(i.checksum for i in infos if i.nbytes)


def test_digest_is_stable_and_content_addressed(backend: DbBackend, place: Place) -> None:
    blobs = _blobs()
    a = _write(backend, place / "a.0", blobs)
    b = _write(backend, place / "b.0", blobs)
    da = backend.digest(a)
    assert da is not None and da == backend.digest(a) == backend.digest(b)
    assert place.read_bytes(a) == place.read_bytes(b)  # same blobs, same bytes
    blobs["w"] = blobs["w"] + 1
    c = _write(backend, place / "c.0", blobs)
    assert backend.digest(c) != da


def test_stat(backend: DbBackend, place: Place) -> None:
    blobs = _blobs()
    p = _write(backend, place / "n.0", blobs)
    st = backend.stat(p)
    assert isinstance(st, DbStat)
    assert st.path == p and st.db_type == backend.name
    assert st.file_bytes == place.size(p)
    assert st.blob_count == len(blobs)
    assert st.data_bytes == sum(i.nbytes for i in backend.describe(p))
    assert st.digest == backend.digest(p)


def test_sniff(backend: DbBackend, place: Place) -> None:
    p = _write(backend, place / "n.0", _blobs())
    assert sniff_db_type(p) == backend.name
    head, size = place.read_bytes(p)[:SNIFF_BYTES], place.size(p)
    assert backend.sniff(head, size)
    others = [get_db_type(t) for t in DB_TYPES if t != backend.name]
    assert not any(o.sniff(head, size) for o in others)
    junk = place / "junk"
    place.write_bytes(junk, b"hello world, not a checkpoint")
    empty = place / "empty"
    place.write_bytes(empty, b"")
    assert sniff_db_type(junk) is None and sniff_db_type(empty) is None
    with pytest.raises(CheckpointNotFoundError):
        sniff_db_type(place / "absent")


def test_failed_write_keeps_the_old_file(backend: DbBackend, place: Place) -> None:
    p = _write(backend, place / "n.0", {"v": np.arange(3)})
    before = place.read_bytes(p)

    class Bad:
        pass

    with pytest.raises(Exception):  # noqa: B017 - UnsupportedBlobError, before any byte is written
        backend.write(p, {"v": np.arange(4), "bad": Bad()})
    assert place.read_bytes(p) == before
    assert place.names() == ["n.0"]


#: sha256 of the files epochal wrote for _golden_blobs() before the storage package split
#: (main at 051c208): the layout is the format, so a refactor must not change one byte.
#: "native-1.0": written without checksum groups, which must stay byte for byte the 1.0 file;
#: "native": the 2.0 file (the same superblock fields but the version, the same
#: data area, the index with a group table)
GOLDEN = {
    "native-1.0": "bb41275f0eb87115d4273d0ae906f6484410f6a4f61ac7116fa67e41a2211eda",  # crc32
    "native": "d58487c1fba12a14ca703dabc5d9f565441c0de3249e9710f6ded80d03c77abb",  # crc32
    "safetensors": "ec913edf400014d9f7d3fc23fa217853977bbfba4eb12c0318de01d8d9aaaef9",  # crc32c
}


def _golden_blobs() -> dict[str, Any]:
    rng = np.random.default_rng(14)
    out: dict[str, Any] = {
        f"s{i:03d}": rng.standard_normal(int(rng.integers(0, 700))).astype(np.float32) for i in range(100)
    }
    out.update(big=np.arange(300_000, dtype="<f8"), be=np.arange(7, dtype=">i2"), step=3, lr=0.5,
               name="x", raw=b"\x01", none=None, tree={"a": [1, (2.0, "b")], "w": np.ones((2, 3), np.int8)},
               sc=np.float16(1.5), st=np.zeros(2, dtype=[("x", "<f4")]))
    return out


@pytest.mark.parametrize("db_type", sorted(GOLDEN))
def test_file_bytes_unchanged(db_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from epochal.storage.formats.native import write_native
    from epochal.storage.formats.native import writer as native_writer
    from epochal.storage.io import checksum

    p = tmp_path / "g"
    if db_type == "native-1.0":
        monkeypatch.setattr(native_writer, "GROUP_TARGET", 0)
        write_native(p, _golden_blobs(), algorithm="crc32")
    elif db_type == "native":
        write_native(p, _golden_blobs(), algorithm="crc32")
    else:
        if not checksum.HAVE_CRC32C:
            pytest.skip("the pinned safetensors file uses CRC-32C")
        get_db_type(db_type).write(str(p), _golden_blobs())
    assert hashlib.sha256(p.read_bytes()).hexdigest() == GOLDEN[db_type]
