"""Checksum groups (native format 2.0, docs/format.md): what the writer groups, that each
group's checksum is the CRC of its file range, that a full load checks groups (damage in a
grouped segment or its padding is named by blob), that a partial load still checks single
segments, that a group disagreeing with its segments is refused by loads, verify and check
alike, that 1.0 files (no groups) read the same, and that forged group tables are refused."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError, CheckpointVersionError
from epochal.storage.formats.native import NativeBackend, NativeFile, layout, write_native
from epochal.storage.formats.native import writer as native_writer
from epochal.storage.formats.native.reads import batch
from epochal.storage.io import checksum, tuning

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _forge import NativeParts  # noqa: E402

NATIVE = NativeBackend()


def _blobs() -> dict[str, Any]:
    """400 small arrays of several dtypes, split by a big array and a Python value."""
    rng = np.random.default_rng(12)
    out: dict[str, Any] = {}
    for i in range(400):
        dt = ["<f4", "<i8", ">f8", "<u2"][i % 4]
        n = int(rng.integers(1, 3000))
        out[f"p{i:03d}"] = rng.integers(0, 1000, n).astype(dt)
        if i == 150:
            out["big"] = rng.standard_normal(400_000).astype(np.float32)  # 1.6 MiB: not grouped
        if i == 250:
            out["step"] = 7  # a py blob (no segment)
            out["tag"] = "é" * 50  # a str: one small segment, grouped like the arrays
    return out


def _write(tmp_path: Path, name: str = "g.db", **kw: Any) -> tuple[Path, dict[str, Any]]:
    blobs = _blobs()
    path = tmp_path / name
    write_native(path, blobs, **kw)
    return path, blobs


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
        else:
            assert got[k] == v, k


def _groups(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    with NativeFile(path) as f:
        idx = f._index
        return idx.groups.copy(), idx.segs.copy(), f.names()


def _seg_owner(path: Path) -> list[str]:
    """The blob name of every segment."""
    with NativeFile(path) as f:
        recs, names = f._index.recs, f.names()
        return [names[i] for i in range(len(recs)) for _ in range(int(recs["seg_count"][i]))]


# ------------------------------------------------------------------------------- writer
def test_writer_groups_small_runs_and_each_checksum_is_its_range(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    raw = path.read_bytes()
    groups, segs, _ = _groups(path)
    with NativeFile(path) as f:
        assert f.stat().format_version == "2.0" and f.stat().digest.startswith("native2:")
    assert len(groups) >= 3
    owner = _seg_owner(path)
    covered: list[int] = []
    for g in groups:
        a, n = int(g["seg_first"]), int(g["seg_count"])
        assert n >= native_writer.GROUP_MIN and int(g["flags"]) == 0
        members = segs[a : a + n]
        assert np.all(members["length"] < native_writer.GROUP_SEGMENT)
        lo = int(members["offset"][0])
        hi = int(members["offset"][-1] + members["length"][-1] + members["pad"][-1])
        assert hi - lo < 2 * native_writer.GROUP_TARGET
        assert checksum.checksum(raw[lo:hi], "crc32c") == int(g["crc"])  # data and padding
        covered += range(a, a + n)
    assert "big" not in {owner[k] for k in covered}
    assert "tag" in {owner[k] for k in covered}
    assert covered == sorted(set(covered))  # disjoint, in file order


def test_few_blobs_or_groups_off_write_a_1_0_file_with_the_same_data(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    few = tmp_path / "few.db"
    write_native(few, {f"a{i}": np.arange(i + 1, dtype=np.float32) for i in range(40)})
    with NativeFile(few) as f:
        assert f.stat().format_version == "1.0" and not len(f._index.groups)
    v2, blobs = _write(tmp_path, "v2.db")
    monkeypatch.setattr(native_writer, "GROUP_TARGET", 0)
    v1, _ = _write(tmp_path, "v1.db")
    with NativeFile(v1) as f1, NativeFile(v2) as f2:
        assert f1.stat().format_version == "1.0" and f1.header.index_offset == f2.header.index_offset
        ioff = f1.header.index_offset
    r1, r2 = v1.read_bytes(), v2.read_bytes()
    assert r1[layout.SUPERBLOCK_SIZE : ioff] == r2[layout.SUPERBLOCK_SIZE : ioff]  # same data area
    assert len(r2) - len(r1) == layout.GROUP_DTYPE.itemsize * len(_groups(v2)[0])
    _same(NATIVE.read(str(v1)), blobs)  # a 1.0 file of many small arrays: the batch path
    NATIVE.verify(str(v1))


# ------------------------------------------------------------------------------- reader
def test_full_load_checks_groups_not_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full load makes one checksum call per group for the grouped arrays, and checks from
    the index alone that the segments' checksums combine to the group's: with the arrays'
    segment checksums in the index wrong (the group checksums left right), it is refused
    like verify and a partial load refuse it (a file loads only where it verifies;
    it loaded bit for bit before)."""
    path, blobs = _write(tmp_path)
    parts = NativeParts.parse(path.read_bytes())
    groups = parts.groups
    grouped = {k for g in groups for k in range(int(g["seg_first"]), int(g["seg_first"] + g["seg_count"]))}
    owner = _seg_owner(path)
    for k in grouped:
        if owner[k].startswith("p"):  # the arrays (the str blob takes the general path)
            parts.segs[k]["crc"] ^= 0xFFFFFFFF
    path.write_bytes(parts.pack())
    victim = next(owner[k] for k in sorted(grouped) if owner[k].startswith("p"))
    with pytest.raises(CheckpointCorruptError, match="data checksum mismatch") as ei:
        NATIVE.read(str(path))
    assert ei.value.blob == victim
    with pytest.raises(CheckpointCorruptError, match="data checksum mismatch") as ei:
        NATIVE.verify(str(path))
    assert ei.value.blob == victim
    with pytest.raises(CheckpointCorruptError, match="data checksum mismatch") as ei:
        NATIVE.read(str(path), [victim])
    assert ei.value.blob == victim


@pytest.mark.parametrize("where", ["data", "padding"])
def test_damage_inside_a_group_is_named_by_blob(tmp_path: Path, where: str) -> None:
    path, blobs = _write(tmp_path)
    groups, segs, _ = _groups(path)
    owner = _seg_owner(path)
    g = groups[len(groups) // 2]
    k = next(k for k in range(int(g["seg_first"]) + 3, int(g["seg_first"] + g["seg_count"]))
             if segs["pad"][k])
    raw = bytearray(path.read_bytes())
    off = int(segs["offset"][k]) + (int(segs["length"][k]) // 2 if where == "data" else int(segs["length"][k]))
    raw[off] ^= 0x10
    path.write_bytes(bytes(raw))
    msg = "data checksum mismatch" if where == "data" else "nonzero padding"
    with pytest.raises(CheckpointCorruptError, match=msg) as ei:
        NATIVE.read(str(path))
    assert ei.value.blob == owner[k] and ei.value.path == str(path)
    with pytest.raises(CheckpointCorruptError) as ei:
        NATIVE.verify(str(path))
    assert ei.value.blob == owner[k]
    problems = NATIVE.check(str(path))
    assert [p.blob for p in problems] == [owner[k]]
    others = [n for n in blobs if n != owner[k]]
    _same(NATIVE.read(str(path), others), {n: blobs[n] for n in others})  # no group is whole


def test_a_group_that_disagrees_with_its_segments_is_refused(tmp_path: Path) -> None:
    """Segments verify, the group does not (a buggy or forged writer): loads that check the
    group, verify and check refuse it, naming its first blob; a partial load of one of its
    blobs checks that blob's segment and loads."""
    path, blobs = _write(tmp_path)
    parts = NativeParts.parse(path.read_bytes())
    g = parts.groups[1]
    g["crc"] ^= 1
    path.write_bytes(parts.pack(fix_groups=False))
    first = _seg_owner(path)[int(g["seg_first"])]
    with pytest.raises(CheckpointCorruptError, match="checksum group mismatch") as ei:
        NATIVE.read(str(path))
    assert ei.value.blob == first
    with pytest.raises(CheckpointCorruptError, match="checksum group mismatch"):
        NATIVE.verify(str(path))
    problems = NATIVE.check(str(path))
    assert len(problems) == 1 and problems[0].blob == first and "group" in problems[0].message
    _same(NATIVE.read(str(path), [first]), {first: blobs[first]})
    NativeFile(path).verify([first])  # its own segment verifies; the group is not whole
    with NativeFile(path, mmap=True) as f:
        assert f.read([first])[first].tobytes() == blobs[first].tobytes()


def test_read_cuts_never_split_a_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With reads much smaller than a group, each group still lies in one read (so it is
    checked with one call), values are exact and damage is still found."""
    path, blobs = _write(tmp_path)
    monkeypatch.setattr(tuning, "GROUP_BYTES", 64 << 10)
    calls: list[int] = []
    real = batch.checksum_function

    def counting(algorithm: str, *, inline: bool = False) -> Any:
        fn = real(algorithm, inline=inline)
        if inline:
            return fn

        def big(data: Any, value: int = 0) -> int:
            calls.append(memoryview(data).nbytes)
            return fn(data, value)
        return big

    monkeypatch.setattr(batch, "checksum_function", counting)
    _same(NATIVE.read(str(path)), blobs)
    groups, segs, _ = _groups(path)
    sizes = sorted(int(segs["offset"][g["seg_first"] + g["seg_count"] - 1] + segs["length"][g["seg_first"] + g["seg_count"] - 1]
                       + segs["pad"][g["seg_first"] + g["seg_count"] - 1] - segs["offset"][g["seg_first"]]) for g in groups)
    assert sorted(calls) == sizes  # one call per group, over its whole range


# ------------------------------------------------------------------------ forged tables
def _forge_groups(path: Path, edit: Any) -> None:
    parts = NativeParts.parse(path.read_bytes())
    parts.groups = edit(parts.groups.copy())
    path.write_bytes(parts.pack(fix_groups=False))


@pytest.mark.parametrize("case", ["empty group", "past the table", "overlap", "out of order"])
def test_forged_group_tables_are_refused(tmp_path: Path, case: str) -> None:
    path, _ = _write(tmp_path)

    def edit(g: np.ndarray) -> np.ndarray:
        if case == "empty group":
            g[0]["seg_count"] = 0
        elif case == "past the table":
            g[-1]["seg_count"] = 10**6
        elif case == "overlap":
            g[1]["seg_first"] = g[0]["seg_first"] + 1
        else:
            g[[0, 1]] = g[[1, 0]]
        return g

    _forge_groups(path, edit)
    for call in (lambda: NATIVE.read(str(path)), lambda: NATIVE.describe(str(path)),
                 lambda: NATIVE.read(str(path), ["p000"])):
        with pytest.raises(CheckpointCorruptError, match="checksum group table is inconsistent") as ei:
            call()
        assert ei.value.path == str(path) and ei.value.blob is None


def _append_index_part(path: Path, minor: int) -> None:
    """Append 16 unknown bytes after the metas text, as a later minor version might."""
    raw = bytearray(path.read_bytes())
    f = list(layout.SUPER.unpack(bytes(raw[:64])))
    index = bytes(raw[f[5]:]) + b"\xab" * 16
    fn = checksum.checksum_function("crc32c")
    f[2], f[6], f[7], f[11] = minor, len(index), f[5] + len(index), fn(index, 0)
    body = layout.SUPER.pack(*f)[:60]
    path.write_bytes(body + struct.pack("<I", fn(body, 0)) + bytes(raw[64 : f[5]]) + index)


def test_a_newer_minor_may_append_index_parts(tmp_path: Path) -> None:
    path, blobs = _write(tmp_path)
    _append_index_part(path, minor=layout.FORMAT_MINOR + 1)
    _same(NATIVE.read(str(path)), blobs)
    NATIVE.verify(str(path))
    path2, _ = _write(tmp_path, "same_minor.db")
    _append_index_part(path2, minor=layout.FORMAT_MINOR)  # this minor has no such part
    with pytest.raises(CheckpointCorruptError, match="absurd index counts"):
        NATIVE.read(str(path2))


def test_a_1_0_reader_refuses_a_2_0_file_by_its_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _write(tmp_path)
    monkeypatch.setattr(layout, "FORMAT_MAJOR", 1)  # what readers of 1.0 check first
    with pytest.raises(CheckpointVersionError, match="version 2.0.*upgrade"):
        NATIVE.read(str(path))


@pytest.mark.unit
def test_the_checksummer_calls_back_after_queued_work_and_raises_what_a_callback_raised():
    from epochal.storage.io.checksum import Checksummer, checksum_function

    fn = checksum_function("crc32c")
    data = bytearray(b"x" * (1 << 20))
    seen = []
    ck = Checksummer(fn, 2)
    ck.submit([(0, memoryview(data))])
    ck.after(lambda: seen.append(bytes(data[:1])))  # (the checksum above is taken by then)
    ck.after(lambda: data.__setitem__(0, ord("y")))  # a buffer reused after its checksum
    ck.submit([(1, b"abc")])
    assert ck.results() == [fn(b"x" * (1 << 20), 0), fn(b"abc", 0)] and seen == [b"x"] and data[0] == ord("y")
    ck = Checksummer(fn, 1)
    ck.after(lambda: 1 / 0)
    ck.submit([(0, b"abc")])
    with pytest.raises(ZeroDivisionError):
        ck.results()
