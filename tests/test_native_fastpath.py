"""The batch path for many small numpy arrays (NativeFile._read_small_arrays) returns exactly
what the general codec path does, and still detects every kind of damage."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from epochal.errors import CheckpointCorruptError
from epochal.storage.encoding import codecs as _codecs
from epochal.storage.formats.native import NativeBackend, NativeFile, write_native
from epochal.storage.formats.native.reads import batch


def _blobs() -> dict[str, object]:
    rng = np.random.default_rng(7)
    out: dict[str, object] = {}
    dtypes = ["<f4", ">f8", "<i2", "|u1", "<c16", "|b1", "<M8[s]", "<U3"]
    for i in range(300):
        dt = np.dtype(dtypes[i % len(dtypes)])
        n = int(rng.integers(1, 700))
        raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
        if dt.kind == "b":
            raw = raw & 1
        if dt.kind == "U":
            raw = np.frombuffer(np.array(["abc"] * n, dtype=dt).tobytes(), dtype=np.uint8)
        arr = raw.view(dt)
        if i % 5 == 0:
            arr = arr[: (n // 2) * 2].reshape(-1, 2)
        if i % 7 == 0:
            arr = arr[::2]  # not contiguous
        out[f"a{i:03d}"] = arr
    out["zero_d"] = np.array(3.5, dtype=np.float64)
    out["empty"] = np.zeros((0, 4), dtype=np.float32)
    out["big"] = rng.standard_normal(300_000).astype(np.float32)  # > BIG_SEGMENT: general path
    out["py"] = 12
    out["scalar"] = np.float32(2.5)
    out["structured"] = np.zeros(5, dtype=[("x", "<f4"), ("y", "<i8", (2,))])
    return out


def _slow_read(path: Path, monkeypatch: pytest.MonkeyPatch, **kw: object) -> dict[str, object]:
    with monkeypatch.context() as m:
        m.setattr(_codecs, "plain_ndarray_codec", lambda: None)
        return NativeBackend().read(str(path), **kw)  # type: ignore[arg-type]


def test_fast_path_matches_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    fast = NativeBackend().read(str(path))
    slow = _slow_read(path, monkeypatch)
    assert list(fast) == list(slow) == list(blobs)
    for name, want in blobs.items():
        a, b = fast[name], slow[name]
        assert type(a) is type(b), name
        if isinstance(want, np.ndarray):
            assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            assert a.dtype == b.dtype == want.dtype and a.shape == b.shape == want.shape, name
            assert a.tobytes() == b.tobytes() == np.ascontiguousarray(want).tobytes(), name
            assert a.flags.writeable and a.flags.c_contiguous and a.flags.aligned, name
        else:
            assert a == b == want
    # independent arrays: writing one does not change another
    before = fast["a001"].copy()  # type: ignore[union-attr]
    fast["a000"][...] = 0  # type: ignore[index]
    assert np.array_equal(fast["a001"], before)


def test_fast_path_used_and_stats(tmp_path: Path) -> None:
    from epochal.storage.formats.base import ReadStats

    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    with NativeFile(path) as f:
        small, rest, total = batch.read_small_arrays(f._f, list(range(len(blobs))), True)
    assert len(small) > 250 and "big" not in small and "py" not in small
    assert all(a.tobytes() == np.ascontiguousarray(blobs[k]).tobytes() for k, a in small.items())
    stats = ReadStats()
    NativeBackend().read(str(path), stats=stats)
    assert stats.blobs == len(blobs)
    assert stats.nbytes == sum(
        np.asarray(v).nbytes for v in blobs.values() if isinstance(v, (np.ndarray, np.generic))
    )


def test_partial_and_in_place(tmp_path: Path) -> None:
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    names = [f"a{i:03d}" for i in range(0, 300, 3)]
    live = {n: np.zeros(1) for n in names}
    out = NativeBackend().read(str(path), names, existing=live)
    assert list(out) == sorted(names)  # file order
    for n in names:
        assert out[n].tobytes() == np.ascontiguousarray(blobs[n]).tobytes()  # type: ignore[union-attr, call-overload]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "padding"])
def test_fast_path_detects_damage(tmp_path: Path, where: str) -> None:
    blobs = {f"b{i:03d}": np.arange(i + 1, dtype=np.float32) for i in range(200)}
    path = tmp_path / "x.db"
    write_native(path, blobs)
    with NativeFile(path) as f:
        idx = f._index
        i = idx.find("b123")
        assert i is not None
        k = int(idx.recs["seg_first"][i])
        off, ln, pad = (int(idx.segs[k][c]) for c in ("offset", "length", "pad"))
    if where == "padding":
        assert pad
        _flip(path, off + ln + pad - 1)
    else:
        _flip(path, off + ln // 2)
    with pytest.raises(CheckpointCorruptError) as ei:
        NativeBackend().read(str(path))
    assert ei.value.blob == "b123"
    assert ("checksum" if where == "data" else "padding") in str(ei.value)
    # unverified loads still work (and skip the checks)
    out = NativeBackend().read(str(path), verify=False)
    assert len(out) == 200


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    blobs = {f"b{i:03d}": np.arange(100, dtype=np.float64) for i in range(100)}
    path = tmp_path / "x.db"
    write_native(path, blobs)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError):
        NativeBackend().read(str(path))


def test_custom_ndarray_codec_disables_fast_path(tmp_path: Path) -> None:
    from epochal.storage.encoding import codecs

    blobs = {f"b{i:03d}": np.arange(10, dtype=np.int32) for i in range(100)}
    path = tmp_path / "x.db"
    write_native(path, blobs)
    original = codecs._by_kind["ndarray"]

    class Mine(codecs.NdarrayCodec):
        def decode(self, meta, buffers, existing=None):  # type: ignore[no-untyped-def]
            return ("mine", super().decode(meta, buffers, existing))

    try:
        codecs.register_codec(Mine())
        out = NativeBackend().read(str(path))
        assert all(v[0] == "mine" for v in out.values())
    finally:
        codecs.register_codec(original, first=False)
        codecs._codecs.remove(original)
        codecs._codecs.insert(1, original)


def test_candidates_that_do_not_fit_go_to_general_path(tmp_path: Path) -> None:
    # candidates are picked from the segment table alone; small one-segment blobs whose
    # meta is not a plain ndarray are read in a group but returned to the general path
    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    names = list(blobs)
    with NativeFile(path) as f:
        small, rest, total = batch.read_small_arrays(f._f, list(range(len(blobs))), True)
    assert rest == sorted(rest)
    assert sorted([names.index(k) for k in small] + rest) == list(range(len(blobs)))
    assert list(small) == [k for k in names if k in small]  # file order
    left = {names[i] for i in rest}
    assert {"big", "empty", "py", "scalar"} <= left
    assert total == sum(a.nbytes for a in small.values())


def test_bulk_load_restores_gc_state(tmp_path: Path) -> None:
    import gc

    blobs = _blobs()
    path = tmp_path / "x.db"
    write_native(path, blobs)
    was = gc.isenabled()
    try:
        gc.enable()
        NativeBackend().read(str(path))
        assert gc.isenabled()
        gc.disable()
        NativeBackend().read(str(path))
        assert not gc.isenabled()
        gc.enable()
        raw = bytearray(path.read_bytes())
        raw[64 + 3] ^= 0xFF  # first segment's data
        path.write_bytes(bytes(raw))
        with pytest.raises(CheckpointCorruptError):
            NativeBackend().read(str(path))
        assert gc.isenabled()
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


def test_save_fast_path_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain arrays skip the codec on save (meta text made from a template); the file must be
    byte for byte the one the codec path writes (dtypes incl. big-endian, unicode, datetime;
    0-d, empty, 2-d and strided arrays; shared metas)."""
    blobs = _blobs()
    blobs["zero_d_i"] = np.array(7, dtype=">i8")
    blobs["empty3"] = np.zeros((2, 0, 3), dtype="<f2")
    blobs["same_meta_1"] = np.ones((3, 4), dtype=np.float32)
    blobs["same_meta_2"] = np.zeros((3, 4), dtype=np.float32)
    fast, slow = tmp_path / "fast.db", tmp_path / "slow.db"
    write_native(fast, blobs)
    with monkeypatch.context() as m:
        m.setattr(_codecs, "plain_ndarray_codec", lambda: None)
        write_native(slow, blobs)
    assert fast.read_bytes() == slow.read_bytes()
    with NativeFile(fast) as f:
        assert f.info("same_meta_1").meta == {"dtype": "<f4", "shape": [3, 4]}
        assert f.info("empty3").shape == (2, 0, 3)


def _plain_1d_blobs() -> dict[str, np.ndarray]:
    """Only 1-D arrays: every meta entry is the writer's plain 1-D text (the regex path)."""
    rng = np.random.default_rng(3)
    dtypes = ["<f4", ">f8", "|u1", "<U3", "|b1", "<M8[s]", "<c16", "|S5", "<i2"]
    out: dict[str, np.ndarray] = {}
    for i in range(200):
        dt = np.dtype(dtypes[i % len(dtypes)])
        n = int(rng.integers(0, 500)) if i % 17 else 0
        raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
        if dt.kind == "b":
            raw = raw & 1
        if dt.kind == "U":
            raw = np.frombuffer(np.array(["ab"] * n, dtype=dt).tobytes(), dtype=np.uint8)
        out[f"v{i:03d}"] = raw.view(dt)
    return out


def test_plain_1d_metas_read_without_json_match_the_general_path(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = _plain_1d_blobs()
    path = tmp_path / "p.db"
    write_native(path, blobs)
    with NativeFile(path) as f:
        plain = f._index.plain_1d_metas()
        assert plain is not None
        f._index.parse_all_metas()
        for (kind, meta), d, n in zip(f._index.all_entries(), *plain):
            assert kind == "ndarray" and meta == {"dtype": d.decode(), "shape": [n]}
    parsed: list[object] = []
    from epochal.storage.formats.native import index as native_index

    real = native_index.Index.parse_all_metas
    monkeypatch.setattr(native_index.Index, "parse_all_metas", lambda self: parsed.append(1) or real(self))
    fast = NativeBackend().read(str(path))
    assert parsed == []  # no JSON parse on the batch path
    slow = _slow_read(path, monkeypatch)
    assert list(fast) == list(slow) == list(blobs)
    for name, want in blobs.items():
        a, b = fast[name], slow[name]
        assert a.dtype == b.dtype == want.dtype and a.shape == b.shape == want.shape, name
        assert a.tobytes() == b.tobytes() == want.tobytes() and a.flags.writeable, name


@pytest.mark.parametrize("text,outcome", [
    (b'["ndarray",{"dtype":"<f4","shape":[3]}]', "scan"),
    (b'["ndarray",{"dtype":"<f\\u0034","shape":[3]}]', "json"),  # an escape: JSON decides
    (b'["ndarray",{"dtype":"<f4","shape":[3] }]', "json"),  # a space
    (b'["ndarray",{"shape":[3],"dtype":"<f4"}]', "json"),  # another key order
    (b'["ndarray",{"dtype":"<f4","shape":[03]}]', "not JSON"),  # a leading zero
    (b'["ndarray",{"dtype":"<f4","shape":[99999999999999999999]}]', "bad shape"),  # 20 digits
])
def test_plain_1d_scan_is_exact(tmp_path: Path, text: bytes, outcome: str) -> None:
    """A meta entry the scan does not take exactly as the writer writes it goes to JSON,
    which reads it or refuses it: the scan never reads a text otherwise than JSON would."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _forge import NativeParts

    blobs = {f"a{i}": np.arange(3, dtype=np.float32) + i for i in range(80)}  # one shared meta
    path = tmp_path / "f.db"
    write_native(path, blobs)
    parts = NativeParts.parse(path.read_bytes())
    assert len(parts.moffs) == 1
    parts.metas = b"[" + text + b"]"
    parts.moffs = np.array([(1, len(text))], dtype=parts.moffs.dtype)
    path.write_bytes(parts.pack())
    with NativeFile(path) as f:
        assert (f._index.plain_1d_metas() is not None) == (outcome == "scan")
    if outcome in ("scan", "json"):
        got = NativeBackend().read(str(path))
        assert list(got) == list(blobs)
        for k, v in blobs.items():
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
    else:
        with pytest.raises(CheckpointCorruptError, match="JSON" if outcome == "not JSON" else "shape"):
            NativeBackend().read(str(path))


def test_metas_scan_and_json_agree_on_random_flips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: 300 single-bit flips in the metas text of an all-1-D file (checksums fixed,
    so the flip reaches the parsers): a full load with the scan and one with JSON only
    both raise CheckpointCorruptError or both return the same arrays, bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _forge import NativeParts

    from epochal.storage.formats.native import index as native_index

    blobs = _plain_1d_blobs()
    path = tmp_path / "base.db"
    write_native(path, blobs)
    base = NativeParts.parse(path.read_bytes())
    rng = np.random.default_rng(2026)
    real = native_index.Index.plain_1d_metas
    digits = [i for i, c in enumerate(base.metas) if chr(c).isalnum()]

    def load(p: Path, scan: bool) -> object:
        with monkeypatch.context() as m:
            if not scan:
                m.setattr(native_index.Index, "plain_1d_metas", lambda self: None)
            try:
                return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in NativeBackend().read(str(p)).items()}
            except CheckpointCorruptError as e:
                assert e.path == str(p)
                return "corrupt"

    scanned = 0
    for case in range(300):
        parts = NativeParts.parse(path.read_bytes())
        text = bytearray(base.metas)
        if case % 2:  # anywhere
            bit = int(rng.integers(0, len(text) * 8))
        else:  # in a shape's digits or a dtype's letters: texts the scan may still take
            at = digits[int(rng.integers(0, len(digits)))]
            bit = at * 8 + int(rng.integers(0, 4))
        text[bit // 8] ^= 1 << (bit % 8)
        parts.metas = bytes(text)
        p = tmp_path / f"f{case}.db"
        p.write_bytes(parts.pack())
        try:
            with NativeFile(p) as f:
                scanned += real(f._index) is not None
        except CheckpointCorruptError:
            pass  # refused at open (the meta table no longer tiles): both loads refuse it
        assert load(p, True) == load(p, False), bit
    assert scanned > 30  # flips that keep a text the scan takes (digits, dtype letters)
